"""The oracle's torch error for fp8 products: what torch computes from the same fp8 operands on the
same hardware.

On the GPU, ``torch._scaled_mm`` (cuBLAS): the tensor cores' fp8 sums, promoted to fp32 every 128 of
K, or chained with ``use_fast_accum``. Its operands are zero-padded to the multiples of 16 it
requires (zeros add nothing to a sum); blockwise scales run as one rowwise call a 128-block of K,
summed in fp32 (the blockwise recipe's own promotion). cuBLAS takes no e5m2 x e5m2 product: that
pair, and every product under the interpreter (whose fp8 products are exact), get the same maths in
fp32, the arithmetic of an exact product's sum.
"""

from __future__ import annotations

import torch

from tritonkit.ops import scaled_mm as sm

BLOCK = sm.BLOCK


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """fp8 t (row-major) in a zero (rows, cols) tensor: through its bits (no fp8 padding op)."""
    bits = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    bits[: t.shape[0], : t.shape[1]] = t.contiguous().view(torch.uint8)
    return bits.view(t.dtype)


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def _cublas(a, b, scale_a, scale_b, out_dtype, fast) -> torch.Tensor:
    """torch._scaled_mm of a (M, K) and b (K, N), K and N padded to 16; scales tensorwise or rowwise."""
    (m, k), n = a.shape, b.shape[1]
    a16 = _padded(a, m, _up16(k))
    b16 = _padded(b.t(), _up16(n), _up16(k)).t()
    if scale_b.numel() > 1:  # a scale a column: the padded columns' scales are ones
        scale_b = torch.cat([scale_b.reshape(1, -1), scale_b.new_ones(1, _up16(n) - n)], dim=1)
    out = torch._scaled_mm(a16, b16, scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast)
    return out[:, :n]


def _fp32(a, b, scale_a, scale_b) -> torch.Tensor:
    if sm._scaling(a, b, scale_a, scale_b) == "block":
        k, n = b.shape
        rows_a = scale_a.repeat_interleave(BLOCK, dim=1)[:, :k]
        blocks_b = scale_b.repeat_interleave(BLOCK, dim=0)[:k].repeat_interleave(BLOCK, dim=1)[:, :n]
        return (a.float() * rows_a) @ (b.float() * blocks_b)
    return (a.float() @ b.float()) * scale_a.reshape(-1, 1) * scale_b.reshape(1, -1)


def scaled_mm_peer(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, fast=False) -> torch.Tensor:
    """torch's result for ``scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, fast)`` (module
    docstring), in ``out_dtype``."""
    both_e5m2 = a.dtype == b.dtype == torch.float8_e5m2
    if a.device.type != "cuda" or both_e5m2:
        out = _fp32(a, b, scale_a, scale_b)
    elif sm._scaling(a, b, scale_a, scale_b) == "block":
        (k, n), out = b.shape, 0
        for i, start in enumerate(range(0, k, BLOCK)):
            cols = slice(start, start + BLOCK)
            scale_cols = scale_b[i].repeat_interleave(BLOCK)[:n].reshape(1, n).contiguous()
            part_scale_a = scale_a[:, i : i + 1].contiguous()
            out = out + _cublas(a[:, cols], b[cols], part_scale_a, scale_cols, torch.float32, False)
    else:
        unbiased_dtype = torch.float32 if bias is not None else out_dtype
        out = _cublas(a, b, scale_a, scale_b, unbiased_dtype, fast)
        if bias is None:
            return out
    return (out if bias is None else out.float() + bias.float()).to(out_dtype)
