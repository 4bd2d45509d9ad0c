"""Attention: FlashAttention-2's forward and backward, packed variable-length batches, masks and a
soft cap, and the merge of partial results over disjoint keys.

The modules, each importing only those before it: ``common`` (what forward and backward share:
scores, masks, packed batches, checks, the tuning key, the reference), ``fwd`` (the forward's
kernel, launch and tuner), ``bwd_kernels`` (the backward's kernels with the configs they are tuned
over) and ``bwd`` (their launches and tuners), ``merge`` (the log-sum-exp merge that ring attention
and split-K decoding fold partial results with), ``attention`` (the public functions, the custom
ops and their autograd, cost, the registry's op and its benchmark workloads), ``decode`` (attention
over a KV cache: ``tritonkit.flash_attention_with_kvcache``). Nothing is re-exported
here: the public functions are ``tritonkit.flash_attention`` and
``tritonkit.scaled_dot_product_attention``, and each module is reached by its own name.
"""
