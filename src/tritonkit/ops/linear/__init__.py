"""The linear family: ``linear`` (a matmul with a fused epilogue) and ``gated_linear`` (SwiGLU and
GeGLU in one kernel). ``kernels`` holds the Triton kernels, ``matmul`` the matmul's launches and
tuning (the API other ops build on), ``linear`` the public functions, autograd, references and costs."""

from tritonkit.ops.linear.kernels import ACTIVATIONS
from tritonkit.ops.linear.linear import (
    DTYPES,
    OPS,
    WORKLOADS,
    gated_linear,
    gated_linear_cost,
    gated_linear_reference,
    linear,
    linear_cost,
    linear_reference,
)

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "OPS",
    "WORKLOADS",
    "gated_linear",
    "gated_linear_cost",
    "gated_linear_reference",
    "linear",
    "linear_cost",
    "linear_reference",
]
