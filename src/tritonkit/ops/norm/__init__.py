"""LayerNorm and RMSNorm, with the residual add fused in: ``kernels.py`` holds the Triton kernels with
the configs each is tuned over, ``split.py`` the kernels and rule for few long rows, ``norm.py``
their launches, tuning, autograd, public functions, references and costs, ``spec.py`` the registry's
ops and workloads, ``normed.py`` how a projection makes a norm's output again in its backward rather
than saving it."""

from tritonkit.ops.norm.norm import (
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    layer_norm,
    layer_norm_reference,
    norm_cost,
    rms_eps,
    rms_norm,
    rms_norm_reference,
)
from tritonkit.ops.norm.spec import OPS, WORKLOADS

__all__ = [
    "OPS",
    "WORKLOADS",
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "layer_norm",
    "layer_norm_reference",
    "norm_cost",
    "rms_eps",
    "rms_norm",
    "rms_norm_reference",
]
