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
    refuses fp32 weights, torch.nn.Linear's default, by name). Its arguments are torch.nn.Linear's,
    in their order, and ``activation`` by keyword."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        activation: str | None = None,
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


class Float8Linear(torch.nn.Linear):
    """``torch.nn.Linear`` (same parameters and state_dict) whose forward and backward matmuls run in
    fp8 (``tritonkit.float8_linear``: e4m3 operands quantized on the fly with dynamic scales, the
    weight and its gradient in their own dtype, so fp32 master weights stay fp32). ``recipe``:
    "rowwise" (a scale a row of each operand along the product's K), "tensorwise" (one scale an
    operand) or "blockwise" (1 x 128 runs and 128 x 128 blocks, DeepSeek-V3's). Its arguments are
    torch.nn.Linear's, in their order, and ``recipe`` by keyword."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, recipe="rowwise"):
        from tritonkit.ops.float8_linear import RECIPES

        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: str = "rowwise") -> Float8Linear:
        """A Float8Linear over ``linear``'s own parameters (shared, not copied), in its training mode."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe)
        new.weight, new.bias = linear.weight, linear.bias
        return new.train(linear.training)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from tritonkit.ops.float8_linear import float8_linear

        return float8_linear(input, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"


def convert_to_float8(model: torch.nn.Module, filter=None, recipe: str = "rowwise") -> torch.nn.Module:
    """Swap ``model``'s ``torch.nn.Linear`` modules (exactly that class, not subclasses) for
    Float8Linear over the same parameters, in place, where ``filter(name, module)`` is true (every
    one without a filter); returns the model. Layers to keep in high precision (an LM head, small
    projections) are the filter's to leave out."""
    swaps = [  # every place a module sits (one shared by two places is named twice)
        (name, module)
        for name, module in model.named_modules(remove_duplicate=False)
        if type(module) is torch.nn.Linear and (filter is None or filter(name, module))
    ]
    converted: dict[int, Float8Linear] = {}  # a shared Linear stays one shared module
    for name, module in swaps:
        if not name:
            raise ValueError("the model is itself a torch.nn.Linear: use Float8Linear.from_linear(model)")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if id(module) not in converted:
            converted[id(module)] = Float8Linear.from_linear(module, recipe)
        setattr(parent, child, converted[id(module)])
    return model
