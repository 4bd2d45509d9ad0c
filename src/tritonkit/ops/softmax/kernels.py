"""The softmax family's one-pass and online Triton kernels (forward and backward) and the
``@triton.jit`` helpers every kernel shares (the split kernels are in ``split_kernels.py``, the
configs in ``configs.py``). ``softmax.py`` beside this holds the maths, the layout, the launches
and the API. Every kernel views its tensors as (O, R, N) with a stride for each axis.
"""

from __future__ import annotations

from tritonkit._triton import tl, triton
from tritonkit.jit import LN2, LOG2E, aligned, window_base, window_edges, window_interior


@triton.jit
def _row_offsets(R, row_blocks, stride_o, stride_r, BLOCK_M: tl.constexpr, ALIGN: tl.constexpr, block=None):
    """Element offsets of the BLOCK_M rows of row block ``block`` (this program's where None; int64:
    O*R*N may pass 2^31), and which exist.

    (_tile widens the row-entry offsets too: over a leading dim the entries of a row are R apart,
    so N * R passes 2^31 in a large tensor as well.)"""
    stride_o, stride_r = aligned(stride_o, ALIGN), aligned(stride_r, ALIGN)
    pid = tl.program_id(0) if block is None else block
    outer = pid // row_blocks  # one grid axis for both: the second is limited to 65535 programs
    rows = (pid % row_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return outer.to(tl.int64) * stride_o + rows.to(tl.int64) * stride_r, rows < R


@triton.jit
def _tile(ptr, row_offsets, cols, stride_n):
    """Pointers to a (rows, cols) tile: each row's offset plus its entries', all in int64."""
    return ptr + row_offsets[:, None] + cols.to(tl.int64)[None, :] * stride_n


@triton.jit
def _row_sum(values, SUM_FP64: tl.constexpr):
    """Sum along rows. log_softmax's output is absolute, y = (x - m) - log(s): one fp32 ulp of s
    (1.2e-7 relative) is 1.2e-7 of error in y wherever y is near 0, which the backward multiplies
    by sum(dy). An fp64 sum keeps fp32 log_softmax as exact as its last rounding."""
    if SUM_FP64:
        return tl.sum(values.to(tl.float64), axis=1)
    else:
        return tl.sum(values, axis=1)


@triton.jit
def _log(s):
    """Natural log in s's precision, returned in fp32 (log2 * ln 2 costs one MUFU op in fp32)."""
    if s.dtype == tl.float64:
        return tl.log(s).to(tl.float32)
    else:
        return tl.log2(s) * LN2


@triton.jit
def _exp_shifted(x, m):
    """exp(x - m) with the row max m; m = -inf only for rows that are all -inf (their result is NaN)."""
    return tl.exp2((x - m[:, None]) * LOG2E)


# ---------------------------------------------------------------- kernels


@triton.jit
def _softmax_fwd_kernel(
    x_ptr,  # input, viewed as (O, R, N) with strides (stride_xo, stride_xr, stride_xn)
    y_ptr,  # output, same view, strides (stride_yo, stride_yr, stride_yn)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    row_blocks,  # row blocks per outer slice, cdiv(R, BLOCK_M)
    stride_xo,
    stride_xr,
    stride_xn,  # elements between outer slices, rows and row entries of x
    stride_yo,
    stride_yr,
    stride_yn,  # the same for y
    blocks,  # row blocks in all, O * row_blocks: the grid, or what persistent programs walk
    LOG: tl.constexpr,  # log_softmax instead of softmax
    SUM_FP64: tl.constexpr,  # accumulate the row sum in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # power of two >= N: the whole row is one tile
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    STAGES: tl.constexpr,  # 0: a row block a program; else persistent, STAGES row blocks in flight
    WINDOW: tl.constexpr,  # 0, or rows read in windows of vectors of WINDOW entries (jit.window_base)
):
    if STAGES == 0:
        _softmax_fwd_block(
            x_ptr,
            y_ptr,
            None,
            R,
            N,
            row_blocks,
            stride_xo,
            stride_xr,
            stride_xn,
            stride_yo,
            stride_yr,
            stride_yn,
            LOG,
            SUM_FP64,
            BLOCK_M,
            BLOCK_N,
            ALIGN,
            WINDOW,
        )
    else:  # the pipeliner loads the next block into shared memory while this one is reduced
        for block in tl.range(tl.program_id(0), blocks, tl.num_programs(0), num_stages=STAGES):
            _softmax_fwd_block(
                x_ptr,
                y_ptr,
                block,
                R,
                N,
                row_blocks,
                stride_xo,
                stride_xr,
                stride_xn,
                stride_yo,
                stride_yr,
                stride_yn,
                LOG,
                SUM_FP64,
                BLOCK_M,
                BLOCK_N,
                ALIGN,
                WINDOW,
            )


@triton.jit
def _softmax_fwd_block(
    x_ptr,
    y_ptr,
    block,
    R,
    N,
    row_blocks,
    stride_xo,
    stride_xr,
    stride_xn,
    stride_yo,
    stride_yr,
    stride_yn,
    LOG: tl.constexpr,
    SUM_FP64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """The one-pass forward of row block ``block`` (this program's where None)."""
    if WINDOW > 0:
        _softmax_fwd_window(
            x_ptr, y_ptr, block, R, N, row_blocks, stride_xo, stride_xr, stride_yo, stride_yr,
            LOG, SUM_FP64, BLOCK_M, BLOCK_N, WINDOW,
        )  # fmt: skip
    else:
        N = aligned(N, ALIGN)
        x_rows, row_mask = _row_offsets(R, row_blocks, stride_xo, stride_xr, BLOCK_M, ALIGN, block)
        y_rows, _ = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, ALIGN, block)
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = tl.load(_tile(x_ptr, x_rows, cols, stride_xn), mask=mask, other=-float("inf"))
        x = x.to(tl.float32)
        m = tl.max(x, axis=1)
        e = _exp_shifted(x, m)
        s = _row_sum(e, SUM_FP64=SUM_FP64)
        if LOG:
            y = (x - m[:, None]) - _log(s)[:, None]
        else:
            y = e * (1.0 / s)[:, None]
        tl.store(_tile(y_ptr, y_rows, cols, stride_yn), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_window(
    x_ptr, y_ptr, block, R, N, row_blocks, stride_xo, stride_xr, stride_yo, stride_yr,
    LOG: tl.constexpr, SUM_FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    """The one-pass forward over rows that start off their vectors' alignment (jit.window_base): the
    vectors inside each row in 16-byte accesses, the entries of its first and last vectors alone,
    reduced together. Entries are contiguous; x's and y's row offsets agree modulo WINDOW."""
    x_rows, row_mask = _row_offsets(R, row_blocks, stride_xo, stride_xr, BLOCK_M, 1, block)
    y_rows, _ = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, 1, block)
    x_base, head = window_base(x_rows, WINDOW)
    y_base, _ = window_base(y_rows, WINDOW)
    cols = tl.arange(0, BLOCK_N)[None, :]
    inner = row_mask[:, None] & window_interior(cols, head[:, None], N, WINDOW)
    edges, on_edge = window_edges(head[:, None], N, WINDOW)
    on_edge &= row_mask[:, None]
    x = tl.load(x_ptr + x_base[:, None] + cols, mask=inner, other=-float("inf")).to(tl.float32)
    x_edge = tl.load(x_ptr + x_base[:, None] + edges, mask=on_edge, other=-float("inf")).to(tl.float32)
    m = tl.maximum(tl.max(x, axis=1), tl.max(x_edge, axis=1))
    e, e_edge = _exp_shifted(x, m), _exp_shifted(x_edge, m)
    s = _row_sum(e, SUM_FP64=SUM_FP64) + _row_sum(e_edge, SUM_FP64=SUM_FP64)
    if LOG:
        log_s = _log(s)[:, None]
        y, y_edge = (x - m[:, None]) - log_s, (x_edge - m[:, None]) - log_s
    else:
        scale = (1.0 / s)[:, None]
        y, y_edge = e * scale, e_edge * scale
    tl.store(y_ptr + y_base[:, None] + cols, y.to(y_ptr.dtype.element_ty), mask=inner)
    tl.store(y_ptr + y_base[:, None] + edges, y_edge.to(y_ptr.dtype.element_ty), mask=on_edge)


# Online forward: BLOCK_N is a chunk of the row; each pass holds one chunk at a time.


@triton.jit
def _first_pass_chunk(ptr, rows, start, offsets, stride_n, row_mask, N, other):
    """The online kernels' pass-1 load of the chunk at ``start``, kept in L2 for pass 2 (masked
    wholly past the row's end, where PREFETCH asks for the chunk after the last)."""
    cols = start + offsets
    return tl.load(
        _tile(ptr, rows, cols, stride_n),
        mask=row_mask[:, None] & (cols < N)[None, :],
        other=other,
        eviction_policy="evict_last",
    )


@triton.jit
def _softmax_fwd_online_kernel(
    x_ptr,  # input, viewed as (O, R, N) with strides (stride_xo, stride_xr, stride_xn)
    y_ptr,  # output, same view, strides (stride_yo, stride_yr, stride_yn)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    row_blocks,  # programs per outer slice, cdiv(R, BLOCK_M)
    stride_xo,
    stride_xr,
    stride_xn,  # elements between outer slices, rows and row entries of x
    stride_yo,
    stride_yr,
    stride_yn,  # the same for y
    LOG: tl.constexpr,  # log_softmax instead of softmax
    SUM_FP64: tl.constexpr,  # accumulate the row sum in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # row entries per chunk
    PREFETCH: tl.constexpr,  # pass 1 loads the next chunk before it reduces this one
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or rows read in windows of vectors of WINDOW entries (jit.window_base)
):
    if WINDOW > 0:
        _softmax_fwd_online_window(
            x_ptr, y_ptr, R, N, row_blocks, stride_xo, stride_xr, stride_yo, stride_yr,
            LOG, SUM_FP64, BLOCK_M, BLOCK_N, WINDOW,
        )  # fmt: skip
    else:
        N = aligned(N, ALIGN)
        x_rows, row_mask = _row_offsets(R, row_blocks, stride_xo, stride_xr, BLOCK_M=BLOCK_M, ALIGN=ALIGN)
        y_rows, _ = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M=BLOCK_M, ALIGN=ALIGN)
        offsets = tl.arange(0, BLOCK_N)
        m = tl.full([BLOCK_M], -float("inf"), tl.float32)  # running max
        s = tl.zeros([BLOCK_M], tl.float64 if SUM_FP64 else tl.float32)  # running sum of exp(x - m)
        if PREFETCH:
            x_next = _first_pass_chunk(x_ptr, x_rows, 0, offsets, stride_xn, row_mask, N, -float("inf"))
        for start in range(0, N, BLOCK_N):
            if PREFETCH:  # two chunks in flight: the reductions' barriers no longer wait on this load
                x = x_next
                x_next = _first_pass_chunk(
                    x_ptr, x_rows, start + BLOCK_N, offsets, stride_xn, row_mask, N, -float("inf")
                )
            else:
                x = _first_pass_chunk(x_ptr, x_rows, start, offsets, stride_xn, row_mask, N, -float("inf"))
            x = x.to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=1))
            # Until a row has seen a finite value its max is -inf and x - m would be -inf - -inf = NaN:
            # shift by 0 instead (exp(-inf) = 0 and s stays 0).
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp2((m - shift) * LOG2E) + _row_sum(_exp_shifted(x, shift), SUM_FP64=SUM_FP64)
            m = m_new
        # A row of all -inf keeps m = -inf, s = 0 and ends with 0 / 0 = NaN, as torch gives.
        m = tl.where(m == -float("inf"), 0.0, m)
        if LOG:
            log_s = _log(s)
        else:
            inv_s = 1.0 / s
        chunks = tl.cdiv(N, BLOCK_N)
        for i in range(chunks):
            cols = (chunks - 1 - i) * BLOCK_N + offsets  # last chunk first: the one L2 holds most surely
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(
                _tile(x_ptr, x_rows, cols, stride_xn),
                mask=mask,
                other=-float("inf"),
                eviction_policy="evict_first",
            )
            x = x.to(tl.float32)
            if LOG:
                y = (x - m[:, None]) - log_s[:, None]
            else:
                y = _exp_shifted(x, m) * inv_s[:, None]
            tl.store(_tile(y_ptr, y_rows, cols, stride_yn), y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_dot(y, dy, LOG: tl.constexpr, SUM_FP64: tl.constexpr):
    """The per-row sum the VJP needs: sum(dy * y) for softmax, sum(dy) for log_softmax (whose
    error exp(y) * error(sum(dy)) is absolute, hence fp64 for fp32 log_softmax, as in _row_sum)."""
    if LOG:
        return _row_sum(dy, SUM_FP64=SUM_FP64)
    else:
        return tl.sum(dy * y, axis=1)


@triton.jit
def _input_grad(y, dy, dot, LOG: tl.constexpr):
    """dx from the row's dot (_row_dot). An fp64 dot (fp32 log_softmax's sum(dy)) is applied as two
    fp32 halves, the first through one rounding (an fma): rounded to fp32 first, its error (half an
    ulp of a sum of tens) times exp(y) put dx past the oracle's bound (2.5e-6 against 2.1e-6 at
    (2, 999), a sum(dy) of -27), where torch's CPU kernel keeps within it."""
    if LOG:
        p = tl.exp2(y * LOG2E)
        if dot.dtype == tl.float64:
            hi = dot.to(tl.float32)
            lo = (dot - hi.to(tl.float64)).to(tl.float32)
            return tl.fma(-p, hi[:, None], dy) - p * lo[:, None]
        else:
            return dy - p * dot[:, None]
    else:
        return y * (dy - dot[:, None])


@triton.jit
def _widen_again(v):
    """v in fp32, by other instructions than ``v.to(tl.float32)`` for bf16 (its bits shifted into
    the high half of a 32-bit word, exact for every value). The one-pass backward widens y and dy
    for the row's dot and again for dx: with one conversion, ptxas keeps the widened copies alive
    across the row reduction, twice the registers of the 16-bit values, and spilled at 32768
    entries; with two it keeps the 16-bit values and converts each time."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _softmax_bwd_kernel(
    y_ptr,  # forward output, viewed as (O, R, N) with strides (stride_yo, stride_yr, stride_yn)
    dy_ptr,  # upstream gradient, same view, strides (stride_dyo, stride_dyr, stride_dyn)
    dx_ptr,  # input gradient, same view, strides (stride_dxo, stride_dxr, stride_dxn)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    row_blocks,  # row blocks per outer slice, cdiv(R, BLOCK_M)
    stride_yo,
    stride_yr,
    stride_yn,  # elements between outer slices, rows and row entries of y
    stride_dyo,
    stride_dyr,
    stride_dyn,  # the same for dy
    stride_dxo,
    stride_dxr,
    stride_dxn,  # the same for dx
    blocks,  # row blocks in all, O * row_blocks: the grid, or what persistent programs walk
    LOG: tl.constexpr,  # log_softmax instead of softmax
    SUM_FP64: tl.constexpr,  # accumulate the row sum in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # power of two >= N: the whole row is one tile
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    STAGES: tl.constexpr,  # 0: a row block a program; else persistent, STAGES row blocks in flight
    WINDOW: tl.constexpr,  # 0, or rows read in windows of vectors of WINDOW entries (jit.window_base)
):
    if STAGES == 0:
        _softmax_bwd_block(
            y_ptr,
            dy_ptr,
            dx_ptr,
            None,
            R,
            N,
            row_blocks,
            stride_yo,
            stride_yr,
            stride_yn,
            stride_dyo,
            stride_dyr,
            stride_dyn,
            stride_dxo,
            stride_dxr,
            stride_dxn,
            LOG,
            SUM_FP64,
            BLOCK_M,
            BLOCK_N,
            ALIGN,
            WINDOW,
        )
    else:  # as the forward's
        for block in tl.range(tl.program_id(0), blocks, tl.num_programs(0), num_stages=STAGES):
            _softmax_bwd_block(
                y_ptr,
                dy_ptr,
                dx_ptr,
                block,
                R,
                N,
                row_blocks,
                stride_yo,
                stride_yr,
                stride_yn,
                stride_dyo,
                stride_dyr,
                stride_dyn,
                stride_dxo,
                stride_dxr,
                stride_dxn,
                LOG,
                SUM_FP64,
                BLOCK_M,
                BLOCK_N,
                ALIGN,
                WINDOW,
            )


@triton.jit
def _softmax_bwd_block(
    y_ptr,
    dy_ptr,
    dx_ptr,
    block,
    R,
    N,
    row_blocks,
    stride_yo,
    stride_yr,
    stride_yn,
    stride_dyo,
    stride_dyr,
    stride_dyn,
    stride_dxo,
    stride_dxr,
    stride_dxn,
    LOG: tl.constexpr,
    SUM_FP64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALIGN: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """The one-pass backward of row block ``block`` (this program's where None)."""
    if WINDOW > 0:
        _softmax_bwd_window(
            y_ptr, dy_ptr, dx_ptr, block, R, N, row_blocks, stride_yo, stride_yr, stride_dyo, stride_dyr,
            stride_dxo, stride_dxr, LOG, SUM_FP64, BLOCK_M, BLOCK_N, WINDOW,
        )  # fmt: skip
    else:
        N = aligned(N, ALIGN)
        y_rows, row_mask = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, ALIGN, block)
        dy_rows, _ = _row_offsets(R, row_blocks, stride_dyo, stride_dyr, BLOCK_M, ALIGN, block)
        dx_rows, _ = _row_offsets(R, row_blocks, stride_dxo, stride_dxr, BLOCK_M, ALIGN, block)
        cols = tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        # kept as loaded: a 16-bit row takes half the registers of its fp32 widening
        y = tl.load(_tile(y_ptr, y_rows, cols, stride_yn), mask=mask, other=0.0)
        dy = tl.load(_tile(dy_ptr, dy_rows, cols, stride_dyn), mask=mask, other=0.0)
        dot = _row_dot(y.to(tl.float32), dy.to(tl.float32), LOG=LOG, SUM_FP64=SUM_FP64)
        dx = _input_grad(_widen_again(y), _widen_again(dy), dot, LOG=LOG)
        tl.store(_tile(dx_ptr, dx_rows, cols, stride_dxn), dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_window(
    y_ptr, dy_ptr, dx_ptr, block, R, N, row_blocks, stride_yo, stride_yr, stride_dyo, stride_dyr,
    stride_dxo, stride_dxr, LOG: tl.constexpr, SUM_FP64: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """The one-pass backward in windows, as _softmax_fwd_window: y's, dy's and dx's row offsets agree
    modulo WINDOW."""
    y_rows, row_mask = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, 1, block)
    dy_rows, _ = _row_offsets(R, row_blocks, stride_dyo, stride_dyr, BLOCK_M, 1, block)
    dx_rows, _ = _row_offsets(R, row_blocks, stride_dxo, stride_dxr, BLOCK_M, 1, block)
    y_base, head = window_base(y_rows, WINDOW)
    dy_base, _ = window_base(dy_rows, WINDOW)
    dx_base, _ = window_base(dx_rows, WINDOW)
    cols = tl.arange(0, BLOCK_N)[None, :]
    inner = row_mask[:, None] & window_interior(cols, head[:, None], N, WINDOW)
    edges, on_edge = window_edges(head[:, None], N, WINDOW)
    on_edge &= row_mask[:, None]
    y = tl.load(y_ptr + y_base[:, None] + cols, mask=inner, other=0.0)  # 16-bit kept, as the plain kernel
    dy = tl.load(dy_ptr + dy_base[:, None] + cols, mask=inner, other=0.0)
    y_edge = tl.load(y_ptr + y_base[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
    dy_edge = tl.load(dy_ptr + dy_base[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
    dot = _row_dot(y.to(tl.float32), dy.to(tl.float32), LOG=LOG, SUM_FP64=SUM_FP64)
    dot = dot + _row_dot(y_edge, dy_edge, LOG=LOG, SUM_FP64=SUM_FP64)
    dx = _input_grad(_widen_again(y), _widen_again(dy), dot, LOG=LOG)
    tl.store(dx_ptr + dx_base[:, None] + cols, dx.to(dx_ptr.dtype.element_ty), mask=inner)
    dx_edge = _input_grad(y_edge, dy_edge, dot, LOG=LOG)
    tl.store(dx_ptr + dx_base[:, None] + edges, dx_edge.to(dx_ptr.dtype.element_ty), mask=on_edge)


@triton.jit
def _softmax_bwd_online_kernel(
    y_ptr,  # forward output, viewed as (O, R, N) with strides (stride_yo, stride_yr, stride_yn)
    dy_ptr,  # upstream gradient, same view, strides (stride_dyo, stride_dyr, stride_dyn)
    dx_ptr,  # input gradient, same view, strides (stride_dxo, stride_dxr, stride_dxn)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    row_blocks,  # programs per outer slice, cdiv(R, BLOCK_M)
    stride_yo,
    stride_yr,
    stride_yn,  # elements between outer slices, rows and row entries of y
    stride_dyo,
    stride_dyr,
    stride_dyn,  # the same for dy
    stride_dxo,
    stride_dxr,
    stride_dxn,  # the same for dx
    LOG: tl.constexpr,  # log_softmax instead of softmax
    SUM_FP64: tl.constexpr,  # accumulate the row sum in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # row entries per chunk
    PREFETCH: tl.constexpr,  # pass 1 loads the next chunk before it reduces this one
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    WINDOW: tl.constexpr,  # 0, or rows read in windows of vectors of WINDOW entries (jit.window_base)
):
    if WINDOW > 0:
        _softmax_bwd_online_window(
            y_ptr, dy_ptr, dx_ptr, R, N, row_blocks, stride_yo, stride_yr, stride_dyo, stride_dyr,
            stride_dxo, stride_dxr, LOG, SUM_FP64, BLOCK_M, BLOCK_N, WINDOW,
        )  # fmt: skip
    else:
        N = aligned(N, ALIGN)
        y_rows, row_mask = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M=BLOCK_M, ALIGN=ALIGN)
        dy_rows, _ = _row_offsets(R, row_blocks, stride_dyo, stride_dyr, BLOCK_M=BLOCK_M, ALIGN=ALIGN)
        dx_rows, _ = _row_offsets(R, row_blocks, stride_dxo, stride_dxr, BLOCK_M=BLOCK_M, ALIGN=ALIGN)
        offsets = tl.arange(0, BLOCK_N)
        dot = tl.zeros([BLOCK_M], tl.float64 if SUM_FP64 else tl.float32)
        if PREFETCH:
            y_next = _first_pass_chunk(y_ptr, y_rows, 0, offsets, stride_yn, row_mask, N, 0.0)
            dy_next = _first_pass_chunk(dy_ptr, dy_rows, 0, offsets, stride_dyn, row_mask, N, 0.0)
        for start in range(0, N, BLOCK_N):
            if PREFETCH:  # as in the forward
                y, dy = y_next, dy_next
                y_next = _first_pass_chunk(
                    y_ptr, y_rows, start + BLOCK_N, offsets, stride_yn, row_mask, N, 0.0
                )
                dy_next = _first_pass_chunk(
                    dy_ptr, dy_rows, start + BLOCK_N, offsets, stride_dyn, row_mask, N, 0.0
                )
            else:
                y = _first_pass_chunk(y_ptr, y_rows, start, offsets, stride_yn, row_mask, N, 0.0)
                dy = _first_pass_chunk(dy_ptr, dy_rows, start, offsets, stride_dyn, row_mask, N, 0.0)
            dot += _row_dot(y.to(tl.float32), dy.to(tl.float32), LOG=LOG, SUM_FP64=SUM_FP64)
        chunks = tl.cdiv(N, BLOCK_N)
        for i in range(chunks):
            cols = (chunks - 1 - i) * BLOCK_N + offsets  # last chunk first, as in the forward
            mask = row_mask[:, None] & (cols < N)[None, :]
            y = tl.load(
                _tile(y_ptr, y_rows, cols, stride_yn), mask=mask, other=0.0, eviction_policy="evict_first"
            )
            dy = tl.load(
                _tile(dy_ptr, dy_rows, cols, stride_dyn), mask=mask, other=0.0, eviction_policy="evict_first"
            )
            dx = _input_grad(y.to(tl.float32), dy.to(tl.float32), dot, LOG=LOG)
            tl.store(_tile(dx_ptr, dx_rows, cols, stride_dxn), dx.to(dx_ptr.dtype.element_ty), mask=mask)


# Online kernels over rows that start off their vectors' alignment (jit.window_base): each chunk a
# run of the row's window, its vectors inside the row in 16-byte accesses; the entries of the row's
# first and last vectors loaded once, alone, and reduced before the chunks.


@triton.jit
def _softmax_fwd_online_window(
    x_ptr, y_ptr, R, N, row_blocks, stride_xo, stride_xr, stride_yo, stride_yr, LOG: tl.constexpr,
    SUM_FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    x_rows, row_mask = _row_offsets(R, row_blocks, stride_xo, stride_xr, BLOCK_M, 1)
    y_rows, _ = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, 1)
    x_base, head = window_base(x_rows, WINDOW)
    y_base, _ = window_base(y_rows, WINDOW)
    edges, on_edge = window_edges(head[:, None], N, WINDOW)
    on_edge &= row_mask[:, None]
    x_edge = tl.load(x_ptr + x_base[:, None] + edges, mask=on_edge, other=-float("inf")).to(tl.float32)
    m = tl.max(x_edge, axis=1)  # -inf where the row has no entry there
    s = _row_sum(_exp_shifted(x_edge, tl.where(m == -float("inf"), 0.0, m)), SUM_FP64=SUM_FP64)
    offsets = tl.arange(0, BLOCK_N)
    span = N + WINDOW - 1  # the positions a row's window reaches
    for start in range(0, span, BLOCK_N):
        positions = (start + offsets)[None, :]
        inner = row_mask[:, None] & window_interior(positions, head[:, None], N, WINDOW)
        x = tl.load(
            x_ptr + x_base[:, None] + positions, mask=inner, other=-float("inf"), eviction_policy="evict_last"
        ).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # as the plain kernel's
        s = s * tl.exp2((m - shift) * LOG2E) + _row_sum(_exp_shifted(x, shift), SUM_FP64=SUM_FP64)
        m = m_new
    m = tl.where(m == -float("inf"), 0.0, m)
    if LOG:
        scale = _log(s)
    else:
        scale = 1.0 / s
    chunks = tl.cdiv(span, BLOCK_N)
    for i in range(chunks):
        positions = ((chunks - 1 - i) * BLOCK_N + offsets)[None, :]  # last first, as the plain kernel's
        inner = row_mask[:, None] & window_interior(positions, head[:, None], N, WINDOW)
        x = tl.load(
            x_ptr + x_base[:, None] + positions,
            mask=inner,
            other=-float("inf"),
            eviction_policy="evict_first",
        ).to(tl.float32)
        y = _scaled(x, m, scale, LOG)
        tl.store(y_ptr + y_base[:, None] + positions, y.to(y_ptr.dtype.element_ty), mask=inner)
    y_edge = _scaled(x_edge, m, scale, LOG)
    tl.store(y_ptr + y_base[:, None] + edges, y_edge.to(y_ptr.dtype.element_ty), mask=on_edge)


@triton.jit
def _scaled(x, m, scale, LOG: tl.constexpr):
    """Softmax from the row's max and 1 / sum, or log_softmax from its max and log(sum)."""
    if LOG:
        return (x - m[:, None]) - scale[:, None]
    else:
        return _exp_shifted(x, m) * scale[:, None]


@triton.jit
def _softmax_bwd_online_window(
    y_ptr, dy_ptr, dx_ptr, R, N, row_blocks, stride_yo, stride_yr, stride_dyo, stride_dyr, stride_dxo,
    stride_dxr, LOG: tl.constexpr, SUM_FP64: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
):  # fmt: skip
    y_rows, row_mask = _row_offsets(R, row_blocks, stride_yo, stride_yr, BLOCK_M, 1)
    dy_rows, _ = _row_offsets(R, row_blocks, stride_dyo, stride_dyr, BLOCK_M, 1)
    dx_rows, _ = _row_offsets(R, row_blocks, stride_dxo, stride_dxr, BLOCK_M, 1)
    y_base, head = window_base(y_rows, WINDOW)
    dy_base, _ = window_base(dy_rows, WINDOW)
    dx_base, _ = window_base(dx_rows, WINDOW)
    edges, on_edge = window_edges(head[:, None], N, WINDOW)
    on_edge &= row_mask[:, None]
    y_edge = tl.load(y_ptr + y_base[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
    dy_edge = tl.load(dy_ptr + dy_base[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
    dot = _row_dot(y_edge, dy_edge, LOG=LOG, SUM_FP64=SUM_FP64)
    offsets = tl.arange(0, BLOCK_N)
    span = N + WINDOW - 1
    for start in range(0, span, BLOCK_N):
        positions = (start + offsets)[None, :]
        inner = row_mask[:, None] & window_interior(positions, head[:, None], N, WINDOW)
        y = tl.load(y_ptr + y_base[:, None] + positions, mask=inner, other=0.0, eviction_policy="evict_last")
        dy = tl.load(
            dy_ptr + dy_base[:, None] + positions, mask=inner, other=0.0, eviction_policy="evict_last"
        )
        dot += _row_dot(y.to(tl.float32), dy.to(tl.float32), LOG=LOG, SUM_FP64=SUM_FP64)
    chunks = tl.cdiv(span, BLOCK_N)
    for i in range(chunks):
        positions = ((chunks - 1 - i) * BLOCK_N + offsets)[None, :]
        inner = row_mask[:, None] & window_interior(positions, head[:, None], N, WINDOW)
        y = tl.load(y_ptr + y_base[:, None] + positions, mask=inner, other=0.0, eviction_policy="evict_first")
        dy = tl.load(
            dy_ptr + dy_base[:, None] + positions, mask=inner, other=0.0, eviction_policy="evict_first"
        )
        dx = _input_grad(y.to(tl.float32), dy.to(tl.float32), dot, LOG=LOG)
        tl.store(dx_ptr + dx_base[:, None] + positions, dx.to(dx_ptr.dtype.element_ty), mask=inner)
    dx_edge = _input_grad(y_edge, dy_edge, dot, LOG=LOG)
    tl.store(dx_ptr + dx_base[:, None] + edges, dx_edge.to(dx_ptr.dtype.element_ty), mask=on_edge)
