"""Attention: FlashAttention-2's forward and backward, packed variable-length batches, masks and a
soft cap, and the merge of partial results over disjoint keys.

The modules, each importing only those before it: ``common`` (what forward and backward share:
scores, masks, packed batches, checks, the tuning key, the reference), ``fwd`` and ``bwd`` (the
kernels, their launches and tuners), ``merge`` (the log-sum-exp merge that ring attention and
split-K decoding fold partial results with), ``attention`` (the public functions, custom ops,
cost and benchmark specs). Their public names are here too.
"""

from tritonkit.ops.attention.attention import (
    SPECS,
    attention_cost,
    flash_attention,
    scaled_dot_product_attention,
)
from tritonkit.ops.attention.common import attention_reference
from tritonkit.ops.attention.merge import merge_attention

__all__ = ["SPECS", "attention_cost", "attention_reference", "flash_attention", "merge_attention",
           "scaled_dot_product_attention"]
