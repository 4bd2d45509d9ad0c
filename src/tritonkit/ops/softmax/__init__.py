"""Softmax and log-softmax: ``kernels`` (the Triton kernels and the configs they tune over) and
``softmax`` (launches, tuning, autograd, the public functions, reference and cost).

Nothing is re-exported here: ``tritonkit.ops.softmax.softmax`` is the op module, never the function
(which is ``tritonkit.softmax``).
"""
