"""The norm family's Triton kernels: one-pass and looped, forward and backward.

``norm.py`` beside it holds the maths, the configs, the launch and the API; this file holds only
what runs on the GPU, split off to keep each file readable. Rows are (M, N) with a row stride and
unit column stride.
"""

from __future__ import annotations

from tritonkit._triton import tl, triton


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
    STATS: tl.constexpr,  # store the mean and rstd: the backward needs them, a call without autograd not
    STREAM: tl.constexpr,  # eviction policy of what is read once (x, the residual): "" or "evict_first"
    KEEP: tl.constexpr,  # ... of what every program reads again (w, b): "" or "evict_last"
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # power of two >= N: the whole row is one tile
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*N may pass 2^31
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0,
                eviction_policy=STREAM).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0,
                     eviction_policy=STREAM).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * N + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    if RMS:
        centred = h
    else:
        mean = tl.sum(h, axis=1) / N
        centred = tl.where(mask, h - mean[:, None], 0.0)  # padding must not enter the variance
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=rows < M)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask, eviction_policy=KEEP).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, eviction_policy=KEEP).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rows_exist, cols, col_mask, stride_hm, stride_dym,
              RMS: tl.constexpr):
    """What the backward loads for a block of rows before its reductions, as stored: h, dy, the rows'
    means (LayerNorm, else 0) and rstds; zeros where a row or an entry does not exist. A prefetched
    block's scalars are then in flight with it. (The add_ forms' dh is loaded where it is added:
    held from one block to the next, it would cost a block of registers, and half the programs an SM.)"""
    mask = rows_exist[:, None] & col_mask[None, :]
    h = tl.load(h_ptr + rows[:, None] * stride_hm + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0)
    mean = 0.0
    if not RMS:
        mean = tl.load(mean_ptr + rows, mask=rows_exist, other=0.0)
    return h, dy, mean, tl.load(rstd_ptr + rows, mask=rows_exist, other=0.0)


@triton.jit
def _add_pairs(a_first, a_second, b_first, b_second):
    return a_first + b_first, a_second + b_second


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
    ROWS: tl.constexpr,  # rows a program walks, BLOCK_M at a time (a multiple of BLOCK_M)
    BLOCK_M: tl.constexpr,  # rows reduced together: one exchange between warps serves them all
    BLOCK_N: tl.constexpr,  # power of two >= N
    PREFETCH: tl.constexpr,  # load the next block (h, dy, mean, rstd) before this block is reduced
):
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    block_rows = tl.arange(0, BLOCK_M)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    if PREFETCH:
        rows = first + block_rows
        h_next, dy_next, mean_next, rstd_next = _bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rows < M,
                                                          cols, col_mask, stride_hm, stride_dym, RMS)
    for i in range(0, ROWS, BLOCK_M):
        rows = first + i + block_rows
        rows_exist = rows < M
        mask = rows_exist[:, None] & col_mask[None, :]
        if PREFETCH:  # two blocks in flight: this block's barriers no longer wait on the next one's loads
            h, dy, mean, rstd = h_next, dy_next, mean_next, rstd_next
            next_rows = rows + BLOCK_M
            h_next, dy_next, mean_next, rstd_next = _bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, next_rows,
                                                              (i + BLOCK_M < ROWS) & (next_rows < M), cols,
                                                              col_mask, stride_hm, stride_dym, RMS)
        else:
            h, dy, mean, rstd = _bwd_rows(h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rows_exist, cols, col_mask,
                                          stride_hm, stride_dym, RMS)
        h = h.to(tl.float32)
        dy = dy.to(tl.float32)
        rstd = rstd[:, None]
        if RMS:
            xhat = h * rstd
        else:
            xhat = tl.where(mask, (h - mean[:, None]) * rstd, 0.0)
        g = dy * w if HAS_WEIGHT else dy
        if RMS:
            dh = (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]) * rstd
        else:  # both sums in one reduction: one exchange between warps instead of two
            sum_g_xhat, sum_g = tl.reduce((g * xhat, g), 1, _add_pairs)
            dh = (g - xhat * (sum_g_xhat / N)[:, None] - (sum_g / N)[:, None]) * rstd
        if HAS_DH:
            dh += tl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dh.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:  # a block's rows sit in each thread's registers: the sums over them stay in-thread
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
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
    STREAM: tl.constexpr,  # eviction policy of the second pass's reads (the row's last): "" or "evict_first"
    KEEP: tl.constexpr,  # ... of the first pass's reads, and of w and b: "" or "evict_last"
    BLOCK_N: tl.constexpr,  # entries per chunk of pass 1
    ROW_LENGTH: tl.constexpr,  # N when compiling for it (rows that fit in registers), else 0
    OUT_BLOCK_N: tl.constexpr,  # entries per chunk of pass 2 (at most BLOCK_N)
):
    # A row length known when compiling fixes the trip count: the chunk loops unroll whole, and
    # pass 1 issues all its chunk loads before the first is summed. On the H200, rows of 4096-8192
    # entries with the eviction hints: 3-17% faster at the launches tried (some without the hints
    # ran slower; the tuner chooses). Long rows keep N a run-time value, one compilation for all.
    if ROW_LENGTH > 0:
        n = ROW_LENGTH
    else:
        n = N
    # one row a program, or (a grid smaller than M) a persistent walk over the rows
    for program_row in range(tl.program_id(0), M, tl.num_programs(0)):
        _norm_fwd_looped_row(x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr,
                             tl.cast(program_row, tl.int64), n, stride_xm, stride_rm, eps, RMS, HAS_RESIDUAL,
                             HAS_WEIGHT, HAS_BIAS, BLOCK_N, OUT_BLOCK_N, STREAM, KEEP)


SHIFT_SAMPLE = tl.constexpr(256)  # entries whose mean shifts a large chunk's sums (LayerNorm)


@triton.jit
def _norm_fwd_looped_row(x_ptr, r_ptr, h_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, row, N, stride_xm,
                         stride_rm, eps, RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                         OUT_BLOCK_N: tl.constexpr, STREAM: tl.constexpr, KEEP: tl.constexpr):
    """One row of the looped forward: its statistics over the chunks, then its output."""
    offsets = tl.arange(0, BLOCK_N)
    # chunks of up to 8192 entries add into vectors, reduced across the warps once after the loop;
    # a larger chunk reduces itself, as its vectors would double the registers it holds
    VECTORS: tl.constexpr = BLOCK_N <= 8192
    shift = 0.0  # LayerNorm: the first chunk's mean; sums of h - shift stay small and do not cancel
    if not RMS and not VECTORS:
        # a large chunk would hold all of h across the reduction that makes its mean: the mean of
        # the row's first SHIFT_SAMPLE entries, loaded apart (from cache once the chunk is issued),
        # lets h die as it is summed (one chunk of 65536 entries at 32 warps spilled without it)
        sample = tl.arange(0, SHIFT_SAMPLE)
        head = tl.load(x_ptr + row * stride_xm + sample, mask=sample < N, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            head += tl.load(r_ptr + row * stride_rm + sample, mask=sample < N, other=0.0).to(tl.float32)
        shift = tl.sum(head, axis=0) / tl.minimum(N, SHIFT_SAMPLE).to(tl.float32)
    if VECTORS:
        total = tl.zeros([BLOCK_N], tl.float32)  # sum of h - shift (LayerNorm)
        squares = tl.zeros([BLOCK_N], tl.float32)  # sum of (h - shift)^2 (LayerNorm) or of h^2 (RMSNorm)
    else:
        total = 0.0
        squares = 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + offsets
        mask = cols < N
        if HAS_RESIDUAL:  # x and the residual are read once; h, stored here, is what pass 2 reads
            h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0, eviction_policy=STREAM)
            h = h.to(tl.float32) + tl.load(r_ptr + row * stride_rm + cols, mask=mask, other=0.0,
                                           eviction_policy=STREAM).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * N + cols, h, mask=mask, eviction_policy=KEEP)
            h = h.to(tl.float32)
        else:
            h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0, eviction_policy=KEEP)
            h = h.to(tl.float32)
        if RMS:
            deviations = h
        else:
            if VECTORS and start == 0:
                shift = tl.sum(h, axis=0) / tl.minimum(N, BLOCK_N).to(tl.float32)
            deviations = tl.where(mask, h - shift, 0.0)
        if VECTORS:
            total += deviations
            squares += deviations * deviations
        else:
            if not RMS:
                total += tl.sum(deviations, axis=0)
            squares += tl.sum(deviations * deviations, axis=0)
    if VECTORS:
        if not RMS:
            total = tl.sum(total, axis=0)
        squares = tl.sum(squares, axis=0)
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
    # pass 2 may take smaller chunks than pass 1: it holds h, w and b at once, where pass 1 holds
    # only h, and its reads come from cache when pass 1 took the whole row in one chunk
    out_offsets = tl.arange(0, OUT_BLOCK_N)
    for start in range(0, N, OUT_BLOCK_N):
        cols = start + out_offsets
        mask = cols < N
        h = tl.load(source_ptr + cols, mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        y = (h * rstd) if RMS else (h - mean) * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + cols, mask=mask, eviction_policy=KEEP).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, eviction_policy=KEEP).to(tl.float32)
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


@triton.jit
def _sum_partials_kernel(
    dw_partial_ptr,  # fp32 partial sums of dw, (PROGRAMS, N) (unused without HAS_WEIGHT)
    db_partial_ptr,  # fp32 partial sums of db, (PROGRAMS, N) (unused without HAS_BIAS)
    dw_ptr,  # dw, (N,), in the weight's dtype
    db_ptr,  # db, (N,), in the bias's dtype
    PROGRAMS,  # rows of partials: the backward's programs
    N,  # row length
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,  # partial rows a step loads
    BLOCK_COLS: tl.constexpr,  # columns a program sums
):
    """The backward's second stage: dw and db, each the column sums of its partials, in one launch
    that also casts them to the parameters' dtype. The steps add into a (BLOCK_P, BLOCK_COLS)
    accumulator, reduced across rows once at the end, so a step's loads wait on no reduction; the
    order of the additions is fixed, so the sums are the same bits on every run."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_P, BLOCK_COLS], tl.float32)
    db = tl.zeros([BLOCK_P, BLOCK_COLS], tl.float32)
    for start in range(0, PROGRAMS, BLOCK_P):
        partial_rows = start + tl.arange(0, BLOCK_P)
        mask = (partial_rows < PROGRAMS)[:, None] & col_mask[None, :]
        offsets = partial_rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            dw += tl.load(dw_partial_ptr + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(db_partial_ptr + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(db_ptr + cols, tl.sum(db, axis=0).to(db_ptr.dtype.element_ty), mask=col_mask)
