"""The softmax family's split-row kernels (forward and backward), for rows far longer than
registers hold: a row's segments in programs side by side that wait for each other. Their configs
and the rules that prune and default them are in ``configs.py``, with the other kernels'.
"""

from __future__ import annotations

from tritonkit._triton import tl, triton
from tritonkit.jit import LOG2E, aligned, segment_edges, window_base, window_interior, window_span
from tritonkit.ops.softmax.kernels import _exp_shifted, _input_grad, _log, _row_dot, _row_sum, _tile
from tritonkit.split_rows import _publish_and_wait, _segment_of_program

# How the programs of a row share it, wait for each other and launch: ``tritonkit.split_rows``.


@triton.jit
def _row_start(row, R, stride_o, stride_r, ALIGN: tl.constexpr):
    """Element offset of row ``row`` (counting across outer slices) of an (O, R, N) view, in int64,
    as a one-row tile's row offsets."""
    stride_o, stride_r = aligned(stride_o, ALIGN), aligned(stride_r, ALIGN)
    outer = row // R
    start = outer.to(tl.int64) * stride_o + (row - outer * R).to(tl.int64) * stride_r
    return tl.full([1], 0, tl.int64) + start


@triton.jit
def _row_window(start, WINDOW: tl.constexpr):
    """(offset, head) of a row whose entries are read from ``offset``: WINDOW 0, the row's start and
    0; else its window's base and the row's start past it (``jit.window_base``: the row's vectors
    16 bytes at a time, its two edge vectors an entry at a time, ``jit.segment_edges``)."""
    if WINDOW > 0:
        return window_base(start, WINDOW)
    else:
        return start, tl.zeros_like(start).to(tl.int32)


@triton.jit
def _chunk_mask(cols, N, head, WINDOW: tl.constexpr):
    """A (1, BLOCK_N) chunk's mask: its entries in the row (WINDOW 0), or its vectors wholly in the
    row, the cols then counting from the row's window base (``_row_window``)."""
    if WINDOW > 0:
        return window_interior(cols[None, :], head[:, None], N, WINDOW)
    else:
        return (cols < N)[None, :]


@triton.jit
def _segment_chunk(
    ptr, row, first, i, chunks, offsets, stride_n, N, head, other, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr
):
    """Pass 1's load of chunk ``i`` of the segment at ``first``, kept in L2 for pass 2 (masked wholly
    for i = chunks, the chunk after the last that PREFETCH asks for: another program's)."""
    cols = first + i * BLOCK_N + offsets
    return tl.load(
        _tile(ptr, row, cols, stride_n),
        mask=_chunk_mask(cols, N, head, WINDOW) & (i < chunks),
        other=other,
        eviction_policy="evict_last",
    )


@triton.jit
def _online_step(x, m, s, SUM_FP64: tl.constexpr):
    """The running max m and rescaled sum s of a row taking the (1, n) fp32 entries x."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    shift = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, s * tl.exp2((m - shift) * LOG2E) + _row_sum(_exp_shifted(x, shift), SUM_FP64=SUM_FP64)


@triton.jit
def _normalized(x, m, scale, LOG: tl.constexpr):
    """Softmax from the row's max m and scale (1 / sum), or log_softmax (scale = log(sum))."""
    if LOG:
        return (x - m[:, None]) - scale[:, None]
    else:
        return _exp_shifted(x, m) * scale[:, None]


@triton.jit
def _softmax_fwd_split_kernel(
    x_ptr,  # input, viewed as (O, R, N) with strides (stride_xo, stride_xr, stride_xn)
    y_ptr,  # output, same view, strides (stride_yo, stride_yr, stride_yn)
    max_ptr,  # fp32 (O * R, segments): each segment's max
    sum_ptr,  # fp32, or fp64 with SUM_FP64 (O * R, segments): each segment's sum of exp(x - its max)
    arrived_ptr,  # int32 (O * R,): segments of each row through pass 1, zero at launch (PHASE 0)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    rows,  # O * R: every row of every outer slice
    segments,  # programs per row, cdiv(N, SEGMENT); the grid is a multiple of it
    SEGMENT,  # row entries per program, a multiple of BLOCK_N
    stride_xo,
    stride_xr,
    stride_xn,  # elements between outer slices, rows and row entries of x
    stride_yo,
    stride_yr,
    stride_yn,  # the same for y
    LOG: tl.constexpr,  # log_softmax instead of softmax
    SUM_FP64: tl.constexpr,  # accumulate the sums in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_N: tl.constexpr,  # row entries per chunk
    SEGMENTS: tl.constexpr,  # power of two >= segments: the partials a program combines
    PHASE: tl.constexpr,  # 0: both passes, waiting between them; 1: pass 1 only; 2: pass 2 only
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    PREFETCH: tl.constexpr,  # pass 1 loads the segment's next chunk before it reduces this one
    WINDOW: tl.constexpr,  # 0, or rows read in windows of WINDOW entries (_row_window); unit strides
):
    N = aligned(N, ALIGN)
    first_row, groups, segment, first, chunks = _segment_of_program(
        window_span(N, WINDOW), segments, SEGMENT, BLOCK_N=BLOCK_N
    )
    offsets = tl.arange(0, BLOCK_N)
    for row in range(first_row, rows, groups):
        x_row, head = _row_window(_row_start(row, R, stride_xo, stride_xr, ALIGN), WINDOW)
        if PHASE != 2:  # pass 1: the segment's running max and rescaled sum, as the online kernel
            m = tl.full([1], -float("inf"), tl.float32)
            s = tl.zeros([1], tl.float64 if SUM_FP64 else tl.float32)
            if PREFETCH:
                x_next = _segment_chunk(
                    x_ptr,
                    x_row,
                    first,
                    0,
                    chunks,
                    offsets,
                    stride_xn,
                    N,
                    head,
                    -float("inf"),
                    BLOCK_N,
                    WINDOW,
                )
            for i in range(chunks):
                if PREFETCH:  # two chunks in flight: the reductions' barriers no longer wait on this load
                    x = x_next
                    x_next = _segment_chunk(
                        x_ptr, x_row, first, i + 1, chunks, offsets, stride_xn, N, head, -float("inf"),
                        BLOCK_N, WINDOW,
                    )  # fmt: skip
                else:
                    cols = first + i * BLOCK_N + offsets
                    x = tl.load(
                        _tile(x_ptr, x_row, cols, stride_xn),
                        mask=_chunk_mask(cols, N, head, WINDOW),
                        other=-float("inf"),
                        eviction_policy="evict_last",
                    )
                m, s = _online_step(x.to(tl.float32), m, s, SUM_FP64)
            if WINDOW > 0:
                edges, on_edge = segment_edges(head[:, None], N, first, SEGMENT, WINDOW)
                x_edge = tl.load(x_ptr + x_row[:, None] + edges, mask=on_edge, other=-float("inf"))
                m, s = _online_step(x_edge.to(tl.float32), m, s, SUM_FP64)
            tl.store(max_ptr + row * segments + segment + tl.arange(0, 1), m)
            tl.store(sum_ptr + row * segments + segment + tl.arange(0, 1), s)
        if PHASE == 0:
            _publish_and_wait(arrived_ptr, row, segments)
        if PHASE != 1:  # combine the row's partials, then pass 2 over this segment
            parts = tl.arange(0, SEGMENTS)
            part_mask = parts < segments
            maxima = tl.load(
                max_ptr + row * segments + parts, mask=part_mask, other=-float("inf"), cache_modifier=".cg"
            )  # written by other SMs: not from L1
            sums = tl.load(sum_ptr + row * segments + parts, mask=part_mask, other=0.0, cache_modifier=".cg")
            m = tl.max(maxima, axis=0)
            m = tl.where(m == -float("inf"), 0.0, m)  # a row of all -inf: 0 / 0 = NaN, as torch
            # the partials' rescale in the sums' precision: in fp32 its error (an ulp of exp2's
            # argument) reached fp32 log_softmax's outputs, and its backward amplified it past the
            # oracle's bound (rows of several segments); fp64 keeps the sum as exact as it is summed
            s = tl.sum(sums * tl.exp2((maxima.to(sums.dtype) - m.to(sums.dtype)) * LOG2E), axis=0)
            m = tl.full([1], 0.0, tl.float32) + m
            y_row, _ = _row_window(_row_start(row, R, stride_yo, stride_yr, ALIGN), WINDOW)
            if LOG:
                scale = tl.full([1], 0.0, tl.float32) + _log(s)
            else:
                scale = tl.full([1], 0.0, tl.float32) + (1.0 / s).to(tl.float32)
            for i in range(chunks):
                cols = first + (chunks - 1 - i) * BLOCK_N + offsets  # last read first: in L2
                mask = _chunk_mask(cols, N, head, WINDOW)
                x = tl.load(
                    _tile(x_ptr, x_row, cols, stride_xn),
                    mask=mask,
                    other=-float("inf"),
                    eviction_policy="evict_first",
                ).to(tl.float32)
                tl.store(
                    _tile(y_ptr, y_row, cols, stride_yn),
                    _normalized(x, m, scale, LOG=LOG).to(y_ptr.dtype.element_ty),
                    mask=mask,
                )
            if WINDOW > 0:
                edges, on_edge = segment_edges(head[:, None], N, first, SEGMENT, WINDOW)
                x_edge = tl.load(x_ptr + x_row[:, None] + edges, mask=on_edge, other=-float("inf"))
                y_edge = _normalized(x_edge.to(tl.float32), m, scale, LOG=LOG)
                tl.store(y_ptr + y_row[:, None] + edges, y_edge.to(y_ptr.dtype.element_ty), mask=on_edge)


@triton.jit
def _softmax_bwd_split_kernel(
    y_ptr,  # forward output, viewed as (O, R, N) with strides (stride_yo, stride_yr, stride_yn)
    dy_ptr,  # upstream gradient, same view, strides (stride_dyo, stride_dyr, stride_dyn)
    dx_ptr,  # input gradient, same view, strides (stride_dxo, stride_dxr, stride_dxn)
    dot_ptr,  # fp32, or fp64 with SUM_FP64 (O * R, segments): each segment's sum(y * dy) or sum(dy)
    arrived_ptr,  # int32 (O * R,): segments of each row through pass 1, zero at launch (PHASE 0)
    R,  # rows in each outer slice
    N,  # row length: the softmax dimension
    rows,  # O * R: every row of every outer slice
    segments,  # programs per row, cdiv(N, SEGMENT); the grid is a multiple of it
    SEGMENT,  # row entries per program, a multiple of BLOCK_N
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
    SUM_FP64: tl.constexpr,  # accumulate the sums in fp64 (fp32 log_softmax: see _row_sum)
    BLOCK_N: tl.constexpr,  # row entries per chunk
    SEGMENTS: tl.constexpr,  # power of two >= segments: the partials a program combines
    PHASE: tl.constexpr,  # 0: both passes, waiting between them; 1: pass 1 only; 2: pass 2 only
    ALIGN: tl.constexpr,  # N and the row and outer strides are multiples of it (jit.aligned)
    PREFETCH: tl.constexpr,  # pass 1 loads the segment's next chunk before it reduces this one
    WINDOW: tl.constexpr,  # 0, or rows read in windows of WINDOW entries (_row_window); unit strides
):
    N = aligned(N, ALIGN)
    first_row, groups, segment, first, chunks = _segment_of_program(
        window_span(N, WINDOW), segments, SEGMENT, BLOCK_N=BLOCK_N
    )
    offsets = tl.arange(0, BLOCK_N)
    for row in range(first_row, rows, groups):
        y_row, head = _row_window(_row_start(row, R, stride_yo, stride_yr, ALIGN), WINDOW)
        dy_row, _ = _row_window(_row_start(row, R, stride_dyo, stride_dyr, ALIGN), WINDOW)
        if PHASE != 2:
            dot = tl.zeros([1], tl.float64 if SUM_FP64 else tl.float32)
            if PREFETCH:
                y_next = _segment_chunk(
                    y_ptr, y_row, first, 0, chunks, offsets, stride_yn, N, head, 0.0, BLOCK_N, WINDOW
                )
                dy_next = _segment_chunk(
                    dy_ptr, dy_row, first, 0, chunks, offsets, stride_dyn, N, head, 0.0, BLOCK_N, WINDOW
                )
            for i in range(chunks):
                if PREFETCH:  # as in the forward
                    y, dy = y_next, dy_next
                    y_next = _segment_chunk(
                        y_ptr, y_row, first, i + 1, chunks, offsets, stride_yn, N, head, 0.0, BLOCK_N, WINDOW
                    )
                    dy_next = _segment_chunk(
                        dy_ptr,
                        dy_row,
                        first,
                        i + 1,
                        chunks,
                        offsets,
                        stride_dyn,
                        N,
                        head,
                        0.0,
                        BLOCK_N,
                        WINDOW,
                    )
                else:
                    cols = first + i * BLOCK_N + offsets
                    mask = _chunk_mask(cols, N, head, WINDOW)
                    y = tl.load(
                        _tile(y_ptr, y_row, cols, stride_yn),
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_last",
                    )
                    dy = tl.load(
                        _tile(dy_ptr, dy_row, cols, stride_dyn),
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_last",
                    )
                dot += _row_dot(y.to(tl.float32), dy.to(tl.float32), LOG=LOG, SUM_FP64=SUM_FP64)
            if WINDOW > 0:
                edges, on_edge = segment_edges(head[:, None], N, first, SEGMENT, WINDOW)
                y_edge = tl.load(y_ptr + y_row[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
                dy_edge = tl.load(dy_ptr + dy_row[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
                dot += _row_dot(y_edge, dy_edge, LOG=LOG, SUM_FP64=SUM_FP64)
            tl.store(dot_ptr + row * segments + segment + tl.arange(0, 1), dot)
        if PHASE == 0:
            _publish_and_wait(arrived_ptr, row, segments)
        if PHASE != 1:
            parts = tl.arange(0, SEGMENTS)
            dots = tl.load(
                dot_ptr + row * segments + parts, mask=parts < segments, other=0.0, cache_modifier=".cg"
            )
            dot = tl.full([1], 0.0, dots.dtype) + tl.sum(dots, axis=0)  # fp64 kept: see _input_grad
            dx_row, _ = _row_window(_row_start(row, R, stride_dxo, stride_dxr, ALIGN), WINDOW)
            for i in range(chunks):
                cols = first + (chunks - 1 - i) * BLOCK_N + offsets
                mask = _chunk_mask(cols, N, head, WINDOW)
                y = tl.load(
                    _tile(y_ptr, y_row, cols, stride_yn), mask=mask, other=0.0, eviction_policy="evict_first"
                )
                dy = tl.load(
                    _tile(dy_ptr, dy_row, cols, stride_dyn),
                    mask=mask,
                    other=0.0,
                    eviction_policy="evict_first",
                )
                dx = _input_grad(y.to(tl.float32), dy.to(tl.float32), dot, LOG=LOG)
                tl.store(_tile(dx_ptr, dx_row, cols, stride_dxn), dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WINDOW > 0:
                edges, on_edge = segment_edges(head[:, None], N, first, SEGMENT, WINDOW)
                y_edge = tl.load(y_ptr + y_row[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
                dy_edge = tl.load(dy_ptr + dy_row[:, None] + edges, mask=on_edge, other=0.0).to(tl.float32)
                dx_edge = _input_grad(y_edge, dy_edge, dot, LOG=LOG)
                tl.store(dx_ptr + dx_row[:, None] + edges, dx_edge.to(dx_ptr.dtype.element_ty), mask=on_edge)
