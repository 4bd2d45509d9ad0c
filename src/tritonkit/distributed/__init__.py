"""Distributed attention over torch.distributed: ``ring_attention`` (context parallelism, each rank
holding a shard of the sequence) and the shard layout it expects (``shard_sequence``,
``unshard_sequence``). They live in ``ring_attention.py``; the function of that name, imported
here, is what ``tritonkit.distributed.ring_attention`` names (import the module's other names with
``from tritonkit.distributed.ring_attention import ...``).
"""

from tritonkit.distributed.ring_attention import ring_attention, shard_sequence, unshard_sequence

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]
