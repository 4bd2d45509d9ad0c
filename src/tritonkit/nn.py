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
