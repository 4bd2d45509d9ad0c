"""LayerNorm and RMSNorm, with the residual add fused in: ``kernels.py`` holds the Triton kernels,
``norm.py`` their launches, tuning, autograd, public functions, references, costs and specs."""

from tritonkit.ops.norm.norm import (
    SPECS,
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

__all__ = [
    "SPECS",
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
