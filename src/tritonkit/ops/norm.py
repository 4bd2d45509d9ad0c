"""LayerNorm and RMSNorm over the last dimension, with the residual add fused in, forward and backward.

Maths. For a row h of length N (h = x, or h = x + residual for the add_ forms):
    LayerNorm:  mean = sum(h) / N,  rstd = 1 / sqrt(sum((h - mean)^2) / N + eps),
                xhat = (h - mean) * rstd,  y = xhat * w + b
    RMSNorm:    rstd = 1 / sqrt(sum(h^2) / N + eps),  xhat = h * rstd,  y = xhat * w
VJP, with g = dy * w:
    LayerNorm:  dh = rstd * (g - mean(g) - xhat * mean(g * xhat))
    RMSNorm:    dh = rstd * (g - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,  db = sum over rows of dy
The add_ forms also return h; its upstream gradient adds to dh, and dx = dresidual = dh.

Work. Forward reads x (and the residual) and writes y (and h): 2 M N s bytes (4 M N s with the
residual) plus the weights; backward reads h, dy (and dh) and writes dx: 3 M N s, plus the weights
and the fp32 partial sums of dw and db. A handful of FLOPs an element: memory-bound.

dw and db are reduced in two stages, never with float atomics, so results are deterministic: each
backward program sums its rows into fp32 partials, and a second pass sums the partials.
A row lives in registers up to ``MAX_BLOCK_N`` entries; longer rows go through looped kernels
that read each row twice (see above them). h = x + residual is added in fp32 and
rounded to the input dtype before it is normalised, as ``norm(x + residual)`` is in PyTorch: the
backward then recomputes xhat from the stored h exactly.
"""

from __future__ import annotations

import functools
import math

import torch

from tritonkit._runtime import check_device, empty_output, interpret, sm_count

interpret()  # choose GPU or interpreter before triton is imported and any kernel is defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tritonkit._launch import Launcher, cdiv  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A row lives in registers: at 16 warps, 64 fp32 values a thread hold 32768 entries forward; the
# backward holds h and dy at once, hence half.
MAX_BLOCK_N = {"fwd": 32768, "bwd": 16384}
ROW_ELEMENTS = 8192  # elements a program takes at a time: rows of 1024 go 8 to a program
PER_THREAD = 16  # values a thread holds per row tile: four 16-byte fp32 vectors in flight
# Rows each backward program walks, summing its dw and db partials in registers (a power of two in
# this range; looped: finishing them chunk by chunk). Fewer rows a program cost partial traffic,
# 4 N bytes a program for each of dw and db, written and summed again; too few programs leave SMs
# idle: 8192 rows at 64 a program made 128 programs for 132 SMs.
BWD_ROWS_RANGE = {False: (8, 64), True: (4, 16)}  # one-pass, looped
BWD_PROGRAMS_PER_SM = 2  # what an SM holds of the one-pass backward (h and dy in registers)
LOOP_BLOCK_N = 4096  # chunk of the looped kernels: 16 fp32 values a thread at 8 warps
LOOP_WARPS = 8


# ---------------------------------------------------------------- kernels


@triton.jit
def _norm_fwd_kernel(
    x_ptr,  # input, (M, N), row stride stride_xm, unit column stride
    r_ptr,  # residual, (M, N), row stride stride_rm (unused without HAS_RESIDUAL)
    h_ptr,  # x + residual out, (M, N), contiguous (unused without HAS_RESIDUAL)
    y_ptr,  # normalised output, (M, N), contiguous
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    b_ptr,  # bias, (N,) (unused without HAS_BIAS)
    mean_ptr,  # fp32 row means, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations (or RMS), (M,)
    M,  # rows
    N,  # row length: the normalised dimension
    stride_xm,  # elements between rows of x
    stride_rm,  # elements between rows of the residual
    eps,  # added to the variance (mean square) before the square root
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_RESIDUAL: tl.constexpr,  # add the residual first and store the sum
    HAS_WEIGHT: tl.constexpr,  # scale by w
    HAS_BIAS: tl.constexpr,  # shift by b
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # power of two >= N: the whole row is one tile
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*N may pass 2^31
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * N + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    if RMS:
        centred = h
    else:
        mean = tl.sum(h, axis=1) / N
        centred = tl.where(mask, h - mean[:, None], 0.0)  # padding must not enter the variance
        tl.store(mean_ptr + rows, mean, mask=rows < M)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr,  # upstream gradient of y, (M, N), row stride stride_dym, unit column stride
    dh_ptr,  # upstream gradient of h (add_ forms), (M, N), row stride stride_dhm
    h_ptr,  # the forward's normalised input (x, or x + residual), (M, N), row stride stride_hm
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    mean_ptr,  # fp32 row means from the forward, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations from the forward, (M,)
    dx_ptr,  # gradient of x (and of the residual), (M, N), contiguous
    dw_partial_ptr,  # fp32 partial sums of dw, (programs, N) (unused without HAS_WEIGHT)
    db_partial_ptr,  # fp32 partial sums of db, (programs, N) (unused without HAS_BIAS)
    M,  # rows
    N,  # row length
    stride_dym,  # elements between rows of dy
    stride_dhm,  # elements between rows of dh
    stride_hm,  # elements between rows of h
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_DH: tl.constexpr,  # add the gradient of h (add_ forms)
    HAS_WEIGHT: tl.constexpr,  # the forward scaled by w: g = dy * w, and dw is wanted
    HAS_BIAS: tl.constexpr,  # db is wanted
    ROWS: tl.constexpr,  # rows a program walks, one at a time
    BLOCK_N: tl.constexpr,  # power of two >= N
):
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask).to(tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    for i in range(ROWS):
        row = first + i
        mask = col_mask & (row < M)
        h = tl.load(h_ptr + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
        if RMS:
            xhat = h * rstd
        else:
            xhat = tl.where(mask, (h - tl.load(mean_ptr + row, mask=row < M, other=0.0)) * rstd, 0.0)
        g = dy * w if HAS_WEIGHT else dy
        c1 = tl.sum(g * xhat, axis=0) / N
        if RMS:
            dh = (g - xhat * c1) * rstd
        else:
            dh = (g - xhat * c1 - tl.sum(g, axis=0) / N) * rstd
        if HAS_DH:
            dh += tl.load(dh_ptr + row * stride_dhm + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * N + cols, dh.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dw += dy * xhat
        if HAS_BIAS:
            db += dy
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + tl.program_id(0) * N + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + tl.program_id(0) * N + cols, db, mask=col_mask)


# Rows longer than a register tile: the looped kernels walk each row in BLOCK_N chunks, twice.
# Forward: pass 1 adds the residual (storing h) and gathers the statistics as sums of h - shift,
# shift being the first chunk's mean, so that LayerNorm's variance does not cancel when the row
# sits far from zero; pass 2 reads h back and normalises. Backward: per row, pass 1 gathers
# mean(g * xhat) and mean(g) into a small fp32 scratch; then chunk by chunk, every row of the
# program is finished and dw and db for that chunk are summed in registers over the rows.


@triton.jit
def _norm_fwd_looped_kernel(
    x_ptr,  # input, (M, N), row stride stride_xm, unit column stride
    r_ptr,  # residual, (M, N), row stride stride_rm (unused without HAS_RESIDUAL)
    h_ptr,  # x + residual out, (M, N), contiguous (unused without HAS_RESIDUAL)
    y_ptr,  # normalised output, (M, N), contiguous
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    b_ptr,  # bias, (N,) (unused without HAS_BIAS)
    mean_ptr,  # fp32 row means, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations (or RMS), (M,)
    M,  # rows
    N,  # row length
    stride_xm,  # elements between rows of x
    stride_rm,  # elements between rows of the residual
    eps,  # added to the variance (mean square) before the square root
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_RESIDUAL: tl.constexpr,  # add the residual first and store the sum
    HAS_WEIGHT: tl.constexpr,  # scale by w
    HAS_BIAS: tl.constexpr,  # shift by b
    BLOCK_N: tl.constexpr,  # entries per chunk
):
    row = tl.program_id(0).to(tl.int64)  # one row a program
    offsets = tl.arange(0, BLOCK_N)
    shift = 0.0  # LayerNorm: the first chunk's mean; sums of h - shift stay small and do not cancel
    total = 0.0  # sum of h - shift (LayerNorm)
    squares = 0.0  # sum of (h - shift)^2 (LayerNorm) or of h^2 (RMSNorm)
    for start in range(0, N, BLOCK_N):
        cols = start + offsets
        mask = cols < N
        h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            h += tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * N + cols, h, mask=mask)
            h = h.to(tl.float32)
        if RMS:
            squares += tl.sum(h * h, axis=0)
        else:
            if start == 0:
                shift = tl.sum(h, axis=0) / tl.minimum(N, BLOCK_N).to(tl.float32)
            deviations = tl.where(mask, h - shift, 0.0)
            total += tl.sum(deviations, axis=0)
            squares += tl.sum(deviations * deviations, axis=0)
    if RMS:
        mean = 0.0
        rstd = 1.0 / tl.sqrt(squares / N + eps)
    else:
        offset = total / N  # the mean is shift + offset, the variance E[(h - shift)^2] - offset^2
        mean = shift + offset
        rstd = 1.0 / tl.sqrt(tl.maximum(squares / N - offset * offset, 0.0) + eps)
        tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    source_ptr = h_ptr + row * N if HAS_RESIDUAL else x_ptr + row * stride_xm
    for start in range(0, N, BLOCK_N):
        cols = start + offsets
        mask = cols < N
        h = tl.load(source_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (h * rstd) if RMS else (h - mean) * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask).to(tl.float32)
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_looped_kernel(
    dy_ptr,  # upstream gradient of y, (M, N), row stride stride_dym, unit column stride
    dh_ptr,  # upstream gradient of h (add_ forms), (M, N), row stride stride_dhm
    h_ptr,  # the forward's normalised input, (M, N), row stride stride_hm
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    mean_ptr,  # fp32 row means from the forward, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations from the forward, (M,)
    sums_ptr,  # fp32 scratch, (M, 2): each row's mean(g * xhat) and mean(g)
    dx_ptr,  # gradient of x (and of the residual), (M, N), contiguous
    dw_partial_ptr,  # fp32 partial sums of dw, (programs, N) (unused without HAS_WEIGHT)
    db_partial_ptr,  # fp32 partial sums of db, (programs, N) (unused without HAS_BIAS)
    M,  # rows
    N,  # row length
    stride_dym,  # elements between rows of dy
    stride_dhm,  # elements between rows of dh
    stride_hm,  # elements between rows of h
    RMS: tl.constexpr,  # RMSNorm instead of LayerNorm
    HAS_DH: tl.constexpr,  # add the gradient of h (add_ forms)
    HAS_WEIGHT: tl.constexpr,  # the forward scaled by w
    HAS_BIAS: tl.constexpr,  # db is wanted
    ROWS: tl.constexpr,  # rows a program finishes
    BLOCK_N: tl.constexpr,  # entries per chunk
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    offsets = tl.arange(0, BLOCK_N)
    for i in range(ROWS):  # pass 1: each row's two sums, over all its chunks
        row = first + i
        if row < M:
            rstd = tl.load(rstd_ptr + row)
            shift = 0.0 if RMS else tl.load(mean_ptr + row)
            gx = tl.zeros([BLOCK_N], tl.float32)
            g_sum = tl.zeros([BLOCK_N], tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + offsets
                mask = cols < N
                h = tl.load(h_ptr + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + row * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                gx += g * tl.where(mask, (h - shift) * rstd, 0.0)
                g_sum += g
            tl.store(sums_ptr + row * 2, tl.sum(gx, axis=0) / N)
            tl.store(sums_ptr + row * 2 + 1, tl.sum(g_sum, axis=0) / N)
    for start in range(0, N, BLOCK_N):  # pass 2: chunk by chunk over the program's rows
        cols = start + offsets
        mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], tl.float32)
        db = tl.zeros([BLOCK_N], tl.float32)
        for i in range(ROWS):
            row = first + i
            row_mask = mask & (row < M)
            rstd = tl.load(rstd_ptr + row, mask=row < M, other=0.0)
            shift = 0.0 if RMS else tl.load(mean_ptr + row, mask=row < M, other=0.0)
            c1 = tl.load(sums_ptr + row * 2, mask=row < M, other=0.0)
            c2 = tl.load(sums_ptr + row * 2 + 1, mask=row < M, other=0.0)
            h = tl.load(h_ptr + row * stride_hm + cols, mask=row_mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * stride_dym + cols, mask=row_mask, other=0.0).to(tl.float32)
            xhat = tl.where(row_mask, (h - shift) * rstd, 0.0)
            g = dy * w if HAS_WEIGHT else dy
            dh = (g - xhat * c1) * rstd if RMS else (g - xhat * c1 - c2) * rstd
            if HAS_DH:
                dh += tl.load(dh_ptr + row * stride_dhm + cols, mask=row_mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row * N + cols, dh.to(dx_ptr.dtype.element_ty), mask=row_mask)
            dw += dy * xhat
            db += dy
        if HAS_WEIGHT:
            tl.store(dw_partial_ptr + tl.program_id(0) * N + cols, dw, mask=mask)
        if HAS_BIAS:
            tl.store(db_partial_ptr + tl.program_id(0) * N + cols, db, mask=mask)


# ---------------------------------------------------------------- launchers

_LAUNCHERS = {(direction, looped): Launcher(kernel) for (direction, looped), kernel in {
    ("fwd", False): _norm_fwd_kernel, ("fwd", True): _norm_fwd_looped_kernel,
    ("bwd", False): _norm_bwd_kernel, ("bwd", True): _norm_bwd_looped_kernel}.items()}


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(elements: int) -> int:
    """Warps for a tile of ``elements`` fp32 values at PER_THREAD a thread, within 4..16."""
    return min(16, max(4, elements // (32 * PER_THREAD)))


def _bwd_rows_per_program(rows: int, device, looped: bool) -> int:
    """The most rows a backward program may walk while every SM still gets BWD_PROGRAMS_PER_SM
    programs, as a power of two within BWD_ROWS_RANGE."""
    low, high = BWD_ROWS_RANGE[looped]
    most = max(1, rows // (BWD_PROGRAMS_PER_SM * sm_count(device)))
    return min(high, max(low, 1 << (most.bit_length() - 1)))


def _rows_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (rows, n) with unit column stride: a view where the strides allow, else a copy."""
    t = t.reshape(-1, n)
    return t if t.stride(1) == 1 or n == 1 else t.contiguous()


def _check_normalized_shape(input, normalized_shape) -> int:
    """N, the last dimension, which ``normalized_shape`` must name (the only form supported)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise NotImplementedError(f"normalized_shape over more than the last dimension: {shape}")
    n = input.shape[-1]
    if shape[0] != n:
        raise ValueError(f"normalized_shape {shape} must match input's last dimension {n}")
    return n


def _validate(input, normalized_shape, weight, bias, residual=None) -> int:
    """Check the arguments; return N, the normalised length."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dtype not in DTYPES:
        raise TypeError(f"input must be float16, bfloat16 or float32, got {input.dtype}")
    if input.dim() == 0:
        raise ValueError("input must have at least one dimension")
    n = _check_normalized_shape(input, normalized_shape)
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(param).__name__}")
        if param.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(param.shape)}")
        if param.dtype not in (input.dtype, torch.float32):
            raise TypeError(f"{name} must be float32 or input's dtype {input.dtype}, got {param.dtype}")
        if param.device != input.device:
            raise ValueError(f"{name} must be on input's device {input.device}, got {param.device}")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != input.shape or residual.dtype != input.dtype:
            raise ValueError(f"residual must match input: {tuple(input.shape)} {input.dtype}, got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        if residual.device != input.device:
            raise ValueError(f"residual must be on input's device {input.device}")
    check_device("input", input)
    return n


def _norm_fwd(input, residual, weight, bias, eps: float, rms: bool):
    """(y, h or None, mean or None, rstd): h = input + residual when a residual is given."""
    _validate(input, input.shape[-1:], weight, bias, residual)
    outputs, launcher, grid, args, meta = _fwd_launch_args(input, residual, weight, bias, eps, rms)
    if input.numel():
        launcher(grid, *args, **meta)
    return outputs


def _fwd_launch_args(input, residual, weight, bias, eps: float, rms: bool):
    """((y, h, mean, rstd), launcher, grid, arguments, constexprs and options) of the forward, with
    the outputs allocated (h None without a residual, mean None for RMSNorm)."""
    n = input.shape[-1]
    rows = input.numel() // n if n else 0
    y = empty_output(input.shape, input.dtype, input.device)
    h = empty_output(input.shape, input.dtype, input.device) if residual is not None else None
    mean = empty_output((rows,), torch.float32, input.device) if not rms else None
    rstd = empty_output((rows,), torch.float32, input.device)
    outputs = (y, h, mean, rstd)
    if input.numel() == 0:
        return outputs, None, None, None, None
    x2 = _rows_2d(input, n)
    r2 = _rows_2d(residual, n) if residual is not None else x2
    args = (x2, r2, h if h is not None else y, y, weight if weight is not None else y,
            bias if bias is not None else y, mean if mean is not None else rstd, rstd, rows, n, x2.stride(0),
            r2.stride(0), float(eps))
    meta = {"RMS": rms, "HAS_RESIDUAL": residual is not None, "HAS_WEIGHT": weight is not None,
            "HAS_BIAS": bias is not None}
    block_n = _next_power_of_2(n)
    if block_n > MAX_BLOCK_N["fwd"]:
        return outputs, _LAUNCHERS["fwd", True], (rows,), args, meta | {"BLOCK_N": LOOP_BLOCK_N,
                                                                        "num_warps": LOOP_WARPS}
    block_m = max(1, min(_next_power_of_2(rows), ROW_ELEMENTS // block_n))
    meta |= {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": _warps(block_m * block_n)}
    return outputs, _LAUNCHERS["fwd", False], (cdiv(rows, block_m),), args, meta


def _norm_bwd(grad_y, grad_h, h, weight, bias, mean, rstd, rms: bool):
    """(dx, dw or None, db or None); dx is also the residual's gradient in the add_ forms."""
    (dx, dw_partial, db_partial), launcher, grid, args, meta = _bwd_launch_args(
        grad_y, grad_h, h, weight, bias, rms, mean, rstd)
    if h.numel() == 0:
        n = h.shape[-1]
        zeros = lambda param: torch.zeros(n, dtype=param.dtype, device=h.device)  # noqa: E731
        return dx, zeros(weight) if weight is not None else None, zeros(bias) if bias is not None else None
    launcher(grid, *args, **meta)
    # the second stage of the two-stage reduction: deterministic, no atomics
    dw = dw_partial.sum(0) if weight is not None else None
    db = db_partial.sum(0) if bias is not None else None
    return dx, _cast(dw, weight), _cast(db, bias)


def _bwd_launch_args(grad_y, grad_h, h, weight, bias, rms: bool, mean=None, rstd=None):
    """((dx, dw partials, db partials), launcher, grid, arguments, constexprs and options) of the
    backward, with its outputs allocated (statistics default to empty ones, for inspect)."""
    n = h.shape[-1]
    rows = h.numel() // n if n else 0
    dx = empty_output(h.shape, h.dtype, h.device)
    block_n = _next_power_of_2(n)
    looped = block_n > MAX_BLOCK_N["bwd"]
    rows_per_program = _bwd_rows_per_program(rows, h.device, looped)
    programs = cdiv(rows, rows_per_program)
    rstd = rstd if rstd is not None else torch.empty(rows, dtype=torch.float32, device=h.device)
    if mean is None and not rms:
        mean = torch.empty(rows, dtype=torch.float32, device=h.device)
    dw_partial = empty_output((programs, n), torch.float32, h.device) if weight is not None else rstd
    db_partial = empty_output((programs, n), torch.float32, h.device) if bias is not None else rstd
    outputs = (dx, dw_partial, db_partial)
    if h.numel() == 0:
        return outputs, None, None, None, None
    h2, dy2 = _rows_2d(h, n), _rows_2d(grad_y.to(h.dtype), n)
    dh2 = _rows_2d(grad_h.to(h.dtype), n) if grad_h is not None else dy2
    stats = (weight if weight is not None else rstd, mean if mean is not None else rstd, rstd)
    tail = (dx, dw_partial, db_partial, rows, n, dy2.stride(0), dh2.stride(0), h2.stride(0))
    meta = {"RMS": rms, "HAS_DH": grad_h is not None, "HAS_WEIGHT": weight is not None,
            "HAS_BIAS": bias is not None}
    if looped:
        sums = torch.empty((rows, 2), dtype=torch.float32, device=h.device)  # per-row scratch
        meta |= {"ROWS": rows_per_program, "BLOCK_N": LOOP_BLOCK_N, "num_warps": LOOP_WARPS}
        return outputs, _LAUNCHERS["bwd", True], (programs,), (dy2, dh2, h2, *stats, sums, *tail), meta
    meta |= {"ROWS": rows_per_program, "BLOCK_N": block_n, "num_warps": _warps(block_n)}
    return outputs, _LAUNCHERS["bwd", False], (programs,), (dy2, dh2, h2, *stats, *tail), meta


def _cast(grad, param):
    """A weight or bias gradient (fp32 sums) in its parameter's dtype."""
    return None if grad is None else grad.to(param.dtype)


# ---------------------------------------------------------------- custom ops and autograd

def _absent(t, like):
    """An absent output of a custom op (they return tensors only) is an empty tensor."""
    return t if t is not None else like.new_empty(0)


def _present(t):
    return t if t is not None and t.numel() else None


@torch.library.custom_op("tritonkit::norm", mutates_args=())
def _norm_op(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None,
             bias: torch.Tensor | None, eps: float,
             rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, h, mean, rstd = _norm_fwd(input, residual, weight, bias, eps, rms)
    return y, _absent(h, y), _absent(mean, rstd), rstd


@_norm_op.register_fake
def _(input, residual, weight, bias, eps, rms):
    _validate(input, input.shape[-1:], weight, bias, residual)
    rows = input.numel() // max(1, input.shape[-1])
    stats = input.new_empty((rows,), dtype=torch.float32)
    return (input.new_empty(input.shape), input.new_empty(input.shape if residual is not None else (0,)),
            stats if not rms else input.new_empty((0,), dtype=torch.float32), stats.new_empty((rows,)))


@torch.library.custom_op("tritonkit::norm_backward", mutates_args=())
def _norm_backward_op(grad_y: torch.Tensor, grad_h: torch.Tensor | None, h: torch.Tensor,
                      weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
                      rstd: torch.Tensor, rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _norm_bwd(grad_y, grad_h, h, weight, bias, _present(mean), rstd, rms)
    return dx, _absent(dw, rstd), _absent(db, rstd)


@_norm_backward_op.register_fake
def _(grad_y, grad_h, h, weight, bias, mean, rstd, rms):
    return (h.new_empty(h.shape), weight.new_empty(weight.shape) if weight is not None else rstd.new_empty(0),
            bias.new_empty(bias.shape) if bias is not None else rstd.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    input, residual, weight, bias, _, rms = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else input, weight, bias, mean, rstd)
    ctx.rms, ctx.has_residual = rms, residual is not None


def _backward_traced(ctx, grad_y, grad_h, _grad_mean, _grad_rstd):
    h, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = _norm_backward_op(grad_y, grad_h if ctx.has_residual else None, h, weight, bias, mean, rstd,
                                   ctx.rms)
    return (dx, dx if ctx.has_residual else None, _present(dw) if weight is not None else None,
            _present(db) if bias is not None else None, None, None)


_norm_op.register_autograd(_backward_traced, setup_context=_setup_context)


class _Norm(torch.autograd.Function):
    """Eager autograd without the custom-op dispatcher; returns y, or (y, h) with a residual."""

    @staticmethod
    def forward(ctx, input, residual, weight, bias, eps, rms):
        y, h, mean, rstd = _norm_fwd(input, residual, weight, bias, eps, rms)
        ctx.save_for_backward(h if residual is not None else input, weight, bias, mean, rstd)
        ctx.rms, ctx.has_residual = rms, residual is not None
        return (y, h) if residual is not None else y

    @staticmethod
    def backward(ctx, grad_y, grad_h=None):
        h, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _norm_bwd(grad_y, grad_h, h, weight, bias, mean, rstd, ctx.rms)
        return dx, dx if ctx.has_residual else None, dw, db, None, None


def _norm(input, residual, normalized_shape, weight, bias, eps, rms: bool):
    if torch.compiler.is_compiling():  # the fake implementation validates, on fake tensors
        _check_normalized_shape(input, normalized_shape)
        y, h, _, _ = _norm_op(input, residual, weight, bias, eps, rms)
        return (y, h) if residual is not None else y
    _validate(input, normalized_shape, weight, bias, residual)
    tensors = [t for t in (input, residual, weight, bias) if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _Norm.apply(input, residual, weight, bias, eps, rms)
    y, h, _, _ = _norm_fwd(input, residual, weight, bias, eps, rms)
    return (y, h) if residual is not None else y


def rms_eps(eps: float | None, dtype: torch.dtype) -> float:
    """F.rms_norm's default eps: the machine epsilon of the type it computes in, fp32 for 16-bit
    inputs (1.2e-7, not bf16's 7.8e-3, which shifts outputs of small rows by several percent)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps if eps is None else eps


def layer_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, bias, eps, rms=False)


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` over the last dimension, statistics in fp32."""
    return _norm(input, None, normalized_shape, weight, None, rms_eps(eps, input.dtype), rms=True)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape,
                   weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` in one pass."""
    return _norm(x, residual, normalized_shape, weight, bias, eps, rms=False)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape,
                 weight: torch.Tensor | None = None,
                 eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    return _norm(x, residual, normalized_shape, weight, None, rms_eps(eps, x.dtype), rms=True)


# ---------------------------------------------------------------- reference and cost


def layer_norm_reference(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Plain PyTorch; pass float64 inputs for the oracle's reference."""
    return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)


def rms_norm_reference(input, normalized_shape, weight=None, eps=None):
    return torch.nn.functional.rms_norm(input, normalized_shape, weight, eps)


def add_layer_norm_reference(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    h = x + residual
    return torch.nn.functional.layer_norm(h, normalized_shape, weight, bias, eps), h


def add_rms_norm_reference(x, residual, normalized_shape, weight=None, eps=None):
    h = x + residual
    return torch.nn.functional.rms_norm(h, normalized_shape, weight, eps), h


def norm_cost(shape: tuple, dtype: torch.dtype, mode: str = "fwd", *, residual: bool = False,
              bias: bool = True):
    """Minimal traffic with a weight (and bias) in the input dtype. Forward reads x (and the
    residual), writes y (and h), reads the parameters; backward reads h and dy (and dh), writes dx
    (the residual's gradient is the same tensor), reads the weight and writes dw (and db)."""
    from tritonkit.roofline import Cost

    n, elements = shape[-1], math.prod(shape)
    size, params = torch.finfo(dtype).bits // 8, 2 if bias else 1
    fwd = Cost(FWD_FLOPS_PER_ELEMENT * elements, size * ((4 if residual else 2) * elements + params * n))
    bwd = Cost(BWD_FLOPS_PER_ELEMENT * elements,
               size * ((4 if residual else 3) * elements + (1 + params) * n))
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


# FLOPs an element, each add, multiply and reduction step counted once: forward the sums, centring,
# scaling, weight and bias; backward g, the two row sums, the combination and the dw/db sums.
FWD_FLOPS_PER_ELEMENT = 7
BWD_FLOPS_PER_ELEMENT = 10


def _make_inputs(residual: bool, bias: bool):
    def make(shape: tuple, dtype: torch.dtype, device, generator: torch.Generator) -> tuple:
        from tritonkit.testing import random_tensor

        x = random_tensor(shape, dtype, device, generator=generator)
        extra = (random_tensor(shape, dtype, device, generator=generator),) if residual else ()
        params = tuple(random_tensor(shape[-1:], dtype, device, generator=generator)
                       for _ in range(2 if bias else 1))
        return (x, *extra, (shape[-1],), *params)

    return make


def _liger(rms: bool, residual: bool):
    def factory(kwargs: dict):
        if residual and rms:
            from liger_kernel.transformers.functional import liger_fused_add_rms_norm

            return lambda x, r, shape, w, eps=None: liger_fused_add_rms_norm(
                x, r, w, rms_eps(eps, x.dtype), in_place=False)
        if residual:
            return "has no fused add + LayerNorm"
        if rms:
            from liger_kernel.transformers.functional import liger_rms_norm

            return lambda x, shape, w, eps=None: liger_rms_norm(x, w, rms_eps(eps, x.dtype), in_place=False)
        from liger_kernel.transformers.functional import liger_layer_norm

        return lambda x, shape, w, b, eps=1e-5: liger_layer_norm(x, w, b, eps)

    return factory


def _inspect_launches(residual: bool, rms: bool, bias: bool, shape: tuple, dtype: torch.dtype,
                      config: dict | None = None) -> list:
    """The forward and backward launches for ``shape``: what ``tritonkit inspect`` compiles."""
    from tritonkit.inspect import Launch

    if config is not None:
        raise ValueError("the norms have no tuning configs: their tiles follow from the row length")
    x = torch.empty(shape, dtype=dtype, device="meta")
    w = torch.empty(shape[-1:], dtype=dtype, device="meta")
    _, fwd, _, fwd_args, fwd_meta = _fwd_launch_args(x, x if residual else None, w, w if bias else None,
                                                     1e-5, rms)
    _, bwd, _, bwd_args, bwd_meta = _bwd_launch_args(x, x if residual else None, x, w, w if bias else None,
                                                     rms)
    return [Launch("fwd", fwd.kernel, fwd_args, fwd_meta), Launch("bwd", bwd.kernel, bwd_args, bwd_meta)]


def _spec(name: str, residual: bool, rms: bool):
    from tritonkit.ops import OpSpec

    bias = not rms
    fns = {"layer_norm": (layer_norm, layer_norm_reference), "rms_norm": (rms_norm, rms_norm_reference),
           "add_layer_norm": (add_layer_norm, add_layer_norm_reference),
           "add_rms_norm": (add_rms_norm, add_rms_norm_reference)}
    fn, reference = fns[name]
    params = (2, 3) if bias else (2,)
    return OpSpec(
        name=name,
        family="norm",
        fn=fn,
        reference=reference,
        cost=lambda shape, dtype, mode="fwd": norm_cost(shape, dtype, mode, residual=residual, bias=bias),
        make_inputs=_make_inputs(residual, bias),
        grad_inputs=(0, 1, *(p + 1 for p in params)) if residual else (0, *params),
        flop_unit="fp32",
        shapes={
            "interpreter": [(4, 96), (9, 1000)],
            "quick": [((32768, 4096), "bf16"), ((16384, 8192), "bf16"), ((65536, 1024), "bf16"),
                      ((4096, 65536), "bf16"), ((8192, 4096), "fp32")],
            "full": [((32768, 4096), "bf16"), ((16384, 8192), "bf16"), ((65536, 1024), "bf16"),
                     ((4096, 65536), "bf16"), ((8192, 4096), "fp32"), ((4097, 1823), "bf16"),
                     ((1024, 262144), "bf16")],
        },
        tiny_shape=(4, 256),
        peers={"liger": _liger(rms, residual)},
        inspect=functools.partial(_inspect_launches, residual, rms, bias),
    )


SPECS = {name: _spec(name, residual=name.startswith("add_"), rms="rms" in name)
         for name in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")}
