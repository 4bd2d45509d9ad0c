"""Distributed attention over torch.distributed: ``ring_attention`` (context parallelism, each rank
holding a shard of the sequence) and the shard layout it expects (``shard_sequence``,
``unshard_sequence``), from ``ring.py`` (the ring's steps and its autograd function).
"""

from tritonkit.distributed.ring import ring_attention, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]
