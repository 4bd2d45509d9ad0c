"""Modules over tritonkit's ops that load the state_dict of their torch.nn counterparts."""

from __future__ import annotations

import torch


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (same parameters and state_dict) over the last dimension, computed by
    ``tritonkit.layer_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from tritonkit.ops.norm import layer_norm

        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (same parameters and state_dict) over the last dimension, computed by
    ``tritonkit.rms_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from tritonkit.ops.norm import rms_norm

        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


class Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters and state_dict) with an activation applied in the
    matmul's epilogue, computed by ``tritonkit.linear``: in fp16 or bf16 (``dtype=``; its forward
    refuses fp32 weights, torch.nn.Linear's default, by name)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        from tritonkit.ops.linear import ACTIVATIONS

        if activation not in ACTIVATIONS:
            names = ", ".join(map(repr, ACTIVATIONS))
            raise ValueError(f"activation must be one of {names}, got {activation!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.activation = activation

    def forward(self, input: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        from tritonkit.ops.linear import DTYPES, linear

        if self.weight.dtype not in DTYPES:  # torch.nn.Linear's default, fp32, which no kernel takes
            raise TypeError(
                f"tritonkit.nn.Linear computes in fp16 or bf16, and its weight is {self.weight.dtype}: "
                "build it with dtype=torch.bfloat16 (or float16), or convert it with .to(torch.bfloat16)"
            )
        return linear(input, self.weight, self.bias, self.activation, residual)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"
