"""Distributed ops over torch.distributed: ``ring_attention`` (context parallelism, each rank holding
a shard of the sequence) and the shard layout it expects (``shard_sequence``, ``unshard_sequence``),
from ``ring.py``; ``vocab_parallel_linear_cross_entropy`` (a tensor-parallel LM head's loss, each
rank holding a shard of the vocabulary), from ``vocab.py``; what they share of their process groups
in ``groups.py``.
"""

from tritonkit.distributed.ring import ring_attention, shard_sequence, unshard_sequence
from tritonkit.distributed.vocab import vocab_parallel_linear_cross_entropy

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "vocab_parallel_linear_cross_entropy"]
