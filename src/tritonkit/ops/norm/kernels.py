"""The norm family's Triton kernels, each under the configs its tuner tries, its prune and its default.

Rows are (M, N) with a row stride and unit column stride. ``norm.py`` beside this file has the maths,
the launches, the tuning keys and the API. A config is what the launch takes of a kernel: rows a
program (``BLOCK_M`` forward, ``ROWS`` backward), chunk sizes of the looped kernels (``BLOCK_N``,
``OUT_BLOCK_N``), warps, and flags (``EVICT``, ``PREFETCH``, ``PER_SM``). The defaults, used under the
interpreter and wherever tuning cannot run, are the fixed rules the kernels had before tuning.
A tuning key (``norm._tuning_key``) holds "block_n", the row length rounded up to a power of two,
"rows", the row count rounded likewise, and "looped", which kernel pair runs.
"""

from __future__ import annotations

from tritonkit._launch import cdiv
from tritonkit._runtime import current_device, sm_count
from tritonkit._triton import tl, triton
from tritonkit.jit import aligned
from tritonkit.ops.norm.split import split_default
from tritonkit.ops.norm.terms import centres_rows, layer_norm_terms

# fp32 values a thread holds per tile, by looped or not (one-pass: the row tile, x or h and dy;
# looped: a chunk): past 64 the one-pass kernels spill (the backward at 64 too where it also sums dw: at
# 16384 entries, hence norm.MAX_BLOCK_N), under 8 a program moves too little at once (the
# looped forward's pass 1 holds a chunk of 64 a thread at 32 warps in 64 registers, no spill on sm_90)
PER_THREAD_RANGE = {False: (8, 64), True: (8, 64)}
PREFETCH_MAX_PER_THREAD = 32  # a PREFETCH backward holds the next row's h and dy too: at most 32 a row
LOOPED_MIN_PER_THREAD = 4  # looped forward on rows that fit: torch.compile's 2048-entry chunks, 16 warps
# default: elements a forward program takes at a time (rows of 1024 go 2 to one, at 4 warps). In
# the H200's shipped tuning records (tuned/h200.json) 8192 (16 warps) ran up to 17% behind each key's
# fastest config (65536 rows of 1024 bf16); 2048 is within 10% at every key of 8192 rows or more,
# 2.3% faster than 8192 on average and never 0.6% slower (tests/test_norm_tuning.py)
ROW_ELEMENTS = 2048
PER_THREAD = 16  # default: values a thread holds per row tile, four 16-byte fp32 vectors in flight
# Rows each backward program walks, by looped or not, summing its dw and db partials in registers (a
# power of two in this range; looped: finishing them chunk by chunk). Fewer rows a program cost
# partial traffic, 4 N bytes a program for each of dw and db, written and summed again; too few
# programs leave SMs idle: 8192 rows at 64 a program made 128 programs for 132 SMs.
BWD_ROWS_RANGE = {False: (8, 64), True: (4, 16)}
BWD_PROGRAMS_PER_SM = 2  # default: what an SM holds of the one-pass backward (h and dy in registers)
LOOP_BLOCK_N = 4096  # default chunk of the looped kernels: 16 fp32 values a thread at 8 warps
LOOP_WARPS = 8


def _warps(elements: int) -> int:
    """Warps for a tile of ``elements`` fp32 values at PER_THREAD a thread, within 4..16."""
    return min(16, max(4, elements // (32 * PER_THREAD)))


def _bwd_rows_per_program(rows: int, device, looped: bool) -> int:
    """The most rows a backward program may walk while every SM still gets BWD_PROGRAMS_PER_SM
    programs, as a power of two within BWD_ROWS_RANGE."""
    low, high = BWD_ROWS_RANGE[looped]
    most = max(1, rows // (BWD_PROGRAMS_PER_SM * sm_count(device)))
    return min(high, max(low, 1 << (most.bit_length() - 1)))


def _per_thread(config: dict, key: dict, tiles: int = 1) -> float:
    """fp32 values a thread holds of ``tiles`` tiles at once, a tile being BLOCK_M rows (else one) of
    BLOCK_N entries (else the key's whole row block)."""
    return (
        config.get("BLOCK_N", key["block_n"]) * config.get("BLOCK_M", 1) * tiles / (32 * config["num_warps"])
    )


def _outside(per_thread: float, looped: bool, low: int | None = None) -> bool:
    """Whether ``per_thread`` values a thread fall outside PER_THREAD_RANGE (from ``low`` if given)."""
    least, most = PER_THREAD_RANGE[looped]
    return not (least if low is None else low) <= per_thread <= most


def _leaves_sms_idle(config: dict, key: dict, looped: bool) -> bool:
    """Whether a backward config walks so many rows a program that some SM gets none (the fewest rows
    a program of BWD_ROWS_RANGE always stay)."""
    rows = config["ROWS"]
    return rows > BWD_ROWS_RANGE[looped][0] and cdiv(key["rows"], rows) < sm_count(current_device())


# ---------------------------------------------------------------- the one-pass forward

# BLOCK_M rows a program, the row in registers; EVICT: L2 eviction hints, as torch.compile's kernels
# give them (evict_first on what is read for the last time, evict_last on what is read again).
FWD_CONFIGS = (
    [
        {"BLOCK_M": m, "num_warps": w, **evict}
        for m in (1, 2, 4, 8, 16, 32)
        for w in (4, 8, 16)
        for evict in ({}, {"EVICT": True})
    ]
    # rows that fit in registers may still go faster through the looped kernel, one row a program
    # in chunks, read twice (the second time from cache), as torch.compile's kernels do
    + [
        {"BLOCK_N": n, "num_warps": w, **evict}
        for n in (1024, 2048, 4096)
        for w in (4, 8, 16)
        for evict in ({}, {"EVICT": True})
    ]  # 1024 at 8 warps and 2048 at 16: torch.compile's 4 a thread
)


def _fwd_default(key: dict) -> dict:
    """ROW_ELEMENTS a program at PER_THREAD values a thread."""
    block_m = max(1, min(key["rows"], ROW_ELEMENTS // key["block_n"]))
    return {"BLOCK_M": block_m, "num_warps": _warps(block_m * key["block_n"])}


def _fwd_prune(config: dict, key: dict) -> bool:
    """True drops the config: fp32 values a thread outside PER_THREAD_RANGE (from
    LOOPED_MIN_PER_THREAD for a looped candidate), rows a program beyond the problem, or a looped
    chunk past the row."""
    low = LOOPED_MIN_PER_THREAD if "BLOCK_N" in config else None
    return (
        _outside(_per_thread(config, key), False, low)
        or config.get("BLOCK_M", 1) > max(1, key["rows"])
        or config.get("BLOCK_N", 0) > key["block_n"]
    )


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
    EVICT_READ_ONCE: tl.constexpr,  # eviction policy of x and the residual, read once: "" or "evict_first"
    EVICT_REREAD: tl.constexpr,  # ... of what every program reads again (w, b): "" or "evict_last"
    BLOCK_M: tl.constexpr,  # rows a program handles
    BLOCK_N: tl.constexpr,  # power of two >= N: the whole row is one tile
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    N = aligned(N, ALIGN)
    stride_xm = aligned(stride_xm, ALIGN)
    stride_rm = aligned(stride_rm, ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M*N may pass 2^31
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = (rows < M)[:, None] & col_mask[None, :]
    h = tl.load(
        x_ptr + rows[:, None] * stride_xm + cols[None, :],
        mask=mask,
        other=0.0,
        eviction_policy=EVICT_READ_ONCE,
    ).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(
            r_ptr + rows[:, None] * stride_rm + cols[None, :],
            mask=mask,
            other=0.0,
            eviction_policy=EVICT_READ_ONCE,
        ).to(tl.float32)
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * N + cols[None, :], h, mask=mask)
        h = h.to(tl.float32)
    if RMS:
        centred = h
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    else:
        mean = tl.sum(h, axis=1) / N
        centred = tl.where(mask, h - mean[:, None], 0.0)  # padding must not enter the variance
        if centres_rows(x_ptr):
            # the corrected two-pass variance: h - mean sums to N times the fp32 mean's error, a
            # shift that is much of the centred values where a row's spread is small beside its
            # mean; taken out before they are squared and scaled. (Two sums, not one reduction of
            # the pair: the interpreter folds a combine function's reduction entry by entry, whose
            # rounding over a row of squares erred 4x torch's on rows of 360-1897 entries.)
            error = tl.sum(centred, axis=1) / N
            squares = tl.sum(centred * centred, axis=1)
            centred = tl.where(mask, centred - error[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.maximum(squares / N - error * error, 0.0) + eps)
            if STATS:
                tl.store(mean_ptr + rows, mean + error, mask=rows < M)
        else:
            if STATS:
                tl.store(mean_ptr + rows, mean, mask=rows < M)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)
    y = centred * rstd[:, None]
    if HAS_WEIGHT:
        y *= tl.load(w_ptr + cols, mask=col_mask, eviction_policy=EVICT_REREAD).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, eviction_policy=EVICT_REREAD).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- the one-pass backward

# ROWS rows a program, summing their dw and db partials; PREFETCH loads the next block of rows
# before this one is reduced.
BWD_CONFIGS = (
    [
        {"ROWS": r, "num_warps": w, **prefetch}
        for r in (8, 16, 32, 64)
        for w in (2, 4, 8, 16)
        for prefetch in ({}, {"PREFETCH": True})
    ]
    # rows of up to 4096 entries (the prune's values a thread) also reduced BLOCK_M at a time: one
    # exchange between warps for the block, where each row had its own
    + [
        {"ROWS": r, "BLOCK_M": m, "num_warps": w, **prefetch}
        for r in (32, 64)
        for m in (2, 4)
        for w in (4, 8)
        for prefetch in ({}, {"PREFETCH": True})
    ]
)


# Blocks a backward program adds into dw and db one after the other, at most, for fp32 inputs. A
# chain of 64 fp32 adds a column (ROWS 64, BLOCK_M 1) erred at 2.4x torch's dw error on the H200
# (1000 x 65536), past the gate's 2x; 16-bit inputs, whose reference rounds to 16 bits, keep them.
FP32_SUM_CHAIN_MAX = 32


# A backward of 9 to 64 rows (fp32: to 32) making at most this many elements runs as one program that reduces
# them all at once (BLOCK_M = ROWS): one load of the tile, and dw and db written by the
# program itself (norm._bwd_launches), where the rule below walks 8 rows a program, a row at a
# time, and sums the programs' partials in a second launch: two launches' latency for a tiny input
# (21 x 10 fp32 on the H200: 9.5 us against torch.compile's one kernel's 7.1). 8192: 29 x 224 fp32 (the
# sweep's rows, padded to 32 x 256) walked 8 rows a program at 12-15 us, 0.71-0.77x the best peer on an H100;
# as one program at 16 warps it compiles for sm_90 at 83-88 registers, no spills, 128-bit accesses.
BWD_ONE_PROGRAM_ELEMENTS = 8192


def _bwd_default(key: dict) -> dict:
    """BWD_PROGRAMS_PER_SM programs an SM, each holding h and dy at PER_THREAD values a thread (fp32
    inputs: FP32_SUM_CHAIN_MAX rows at most); in 16 bits with the next row's loads in flight
    (PREFETCH), at PER_THREAD values a thread a row however few the warps (BWD_PREFETCH_DEFAULT).
    A tiny input (BWD_ONE_PROGRAM_ELEMENTS) is one program's tile; in fp32 FP32_SUM_CHAIN_MAX rows
    at most: the interpreter sums a tile's rows in order (numpy down axis 0), and at 64 rows of 64
    dw erred past the oracle's bound at 4 seeds of 40, where the CPU suite checks these kernels
    (on sm_90 the fp32 tile's layout holds four rows a thread and sums the rest as a tree; the cost is
    a second launch for fp32 inputs of 33-64 rows)."""
    elements = key["rows"] * key["block_n"]
    low, high = BWD_ROWS_RANGE[False]  # (up to ``low`` rows the rule below is one program already)
    chain_ok = key["dtype"] != "fp32" or key["rows"] <= FP32_SUM_CHAIN_MAX
    if low < key["rows"] <= high and elements <= BWD_ONE_PROGRAM_ELEMENTS and chain_ok:
        return {"ROWS": key["rows"], "BLOCK_M": key["rows"], "num_warps": _warps(elements)}
    if key["block_n"] <= BWD_TINY_BLOCK_N and (tiny := _bwd_tiny_default(key)):
        return tiny
    rows = _bwd_rows_per_program(key["rows"], current_device(), False)
    if key["dtype"] == "fp32":
        rows = min(rows, FP32_SUM_CHAIN_MAX)
    config = {"ROWS": rows, "num_warps": _warps(key["block_n"])}
    if BWD_PREFETCH_DEFAULT and key["dtype"] != "fp32":
        warps = min(16, max(2, key["block_n"] // (32 * PER_THREAD)))
        prefetch = {"ROWS": rows, "num_warps": warps, "PREFETCH": True}
        return config if _bwd_prune(prefetch, key) else prefetch
    return config


# Rows of at most this many entries (a block) are many to a tile in the backward's default: a tile of
# one row leaves a thread a value or two (the configs' BLOCK_M 4 at 4 warps: 4 values at 64), and
# the default walked 64 rows a program one at a time (327218 x 5 fp16: LayerNorm's backward 0.67x
# the best peer, add_rms_norm's 0.27x; the sweep's shard 7, docs/perf-notes/norms-split-rows.md).
BWD_TINY_BLOCK_N = 64


def _bwd_tiny_default(key: dict) -> dict | None:
    """Where the row-at-a-time rule would walk 16 rows a program or more: tiles of BLOCK_M rows
    holding PER_THREAD values a thread of h and dy together at 4 warps (fp32: FP32_SUM_CHAIN_MAX rows
    at most, the interpreter's order of a tile's sum; fewer where BWD_PROGRAMS_PER_SM programs an SM
    need it), and as many tiles a program (at most 16) as leave every SM that many; else None."""
    programs = BWD_PROGRAMS_PER_SM * sm_count(current_device())
    if key["rows"] < 16 * programs:
        return None
    most = key["rows"] // programs  # (16 or more)
    block_m = min(32 * 4 * PER_THREAD // (2 * key["block_n"]), 1 << (most.bit_length() - 1))
    if key["dtype"] == "fp32":
        block_m = min(block_m, FP32_SUM_CHAIN_MAX)
    tiles = key["rows"] // (block_m * programs)
    return {"ROWS": block_m * min(16, 1 << (tiles.bit_length() - 1)), "BLOCK_M": block_m, "num_warps": 4}


# Whether the 16-bit backward's default loads the next row ahead (PREFETCH, at block_n / 512 warps,
# 2 for rows of 1024). In the H200's shipped tuning records (tuned/h200.json), at the ten 16-bit
# keys of 8192 rows or more, the plain default ran 5-48% behind each key's fastest config (1.48x at
# 65536 rows of 1024, layer_norm); this one 0-8% (tests/test_norm_tuning.py). In fp32 PREFETCH lost
# (4-8% behind the plain default at 8192 rows of 4096), so fp32 keeps it.
BWD_PREFETCH_DEFAULT = True


def _bwd_prune(config: dict, key: dict) -> bool:
    """True drops the config: fp32 values a thread (h and dy) outside PER_THREAD_RANGE, or past
    PREFETCH_MAX_PER_THREAD where the next block is loaded ahead; a block of rows beyond the problem;
    so many rows a program that SMs would sit idle; fp32 inputs summed over more than
    FP32_SUM_CHAIN_MAX blocks of rows."""
    per_thread = _per_thread(config, key, tiles=2)
    chain = config["ROWS"] // config.get("BLOCK_M", 1)
    return (
        _outside(per_thread, False)
        or config.get("PREFETCH", False)
        and per_thread > PREFETCH_MAX_PER_THREAD
        or config.get("BLOCK_M", 1) > max(1, key["rows"])
        or _leaves_sms_idle(config, key, False)
        or key["dtype"] == "fp32"
        and chain > FP32_SUM_CHAIN_MAX
    )


@triton.jit
def _bwd_rows(
    h_ptr,
    dy_ptr,
    mean_ptr,
    rstd_ptr,
    rows,
    rows_exist,
    cols,
    col_mask,
    stride_hm,
    stride_dym,
    RMS: tl.constexpr,
):
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
def _add_triples(a_first, a_second, a_third, b_first, b_second, b_third):
    return a_first + b_first, a_second + b_second, a_third + b_third


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
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    N = aligned(N, ALIGN)
    stride_dym = aligned(stride_dym, ALIGN)
    stride_dhm = aligned(stride_dhm, ALIGN)
    stride_hm = aligned(stride_hm, ALIGN)
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
        h_next, dy_next, mean_next, rstd_next = _bwd_rows(
            h_ptr, dy_ptr, mean_ptr, rstd_ptr, rows, rows < M, cols, col_mask, stride_hm, stride_dym, RMS=RMS
        )
    for i in range(0, ROWS, BLOCK_M):
        rows = first + i + block_rows
        rows_exist = rows < M
        mask = rows_exist[:, None] & col_mask[None, :]
        if PREFETCH:  # two blocks in flight: this block's barriers no longer wait on the next one's loads
            h, dy, mean, rstd = h_next, dy_next, mean_next, rstd_next
            next_rows = rows + BLOCK_M
            h_next, dy_next, mean_next, rstd_next = _bwd_rows(
                h_ptr,
                dy_ptr,
                mean_ptr,
                rstd_ptr,
                next_rows,
                (i + BLOCK_M < ROWS) & (next_rows < M),
                cols,
                col_mask,
                stride_hm,
                stride_dym,
                RMS=RMS,
            )
        else:
            h, dy, mean, rstd = _bwd_rows(
                h_ptr,
                dy_ptr,
                mean_ptr,
                rstd_ptr,
                rows,
                rows_exist,
                cols,
                col_mask,
                stride_hm,
                stride_dym,
                RMS=RMS,
            )
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
        elif centres_rows(h_ptr):  # the three sums in one reduction: one exchange between warps
            sum_g_xhat, sum_g, sum_xhat = tl.reduce((g * xhat, g, xhat), 1, _add_triples)
            c1, c2 = layer_norm_terms(sum_g_xhat, sum_g, sum_xhat, N)
            dh = (g - xhat * c1[:, None] - c2[:, None]) * rstd
        else:
            sum_g_xhat, sum_g = tl.reduce((g * xhat, g), 1, _add_pairs)
            dh = (g - xhat * (sum_g_xhat / N)[:, None] - (sum_g / N)[:, None]) * rstd
        if HAS_DH:
            dh += tl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(dx_ptr + rows[:, None] * N + cols[None, :], dh.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:  # a block's rows sit in each thread's registers: the sums over them stay in-thread
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + tl.program_id(0) * N + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + tl.program_id(0) * N + cols, db, mask=col_mask)


# ---------------------------------------------------------------- the looped kernels

# Rows longer than a register tile: the looped kernels walk each row in BLOCK_N chunks, twice.
# Forward: pass 1 adds the residual (storing h) and gathers the statistics as sums of h - shift,
# shift being the first chunk's mean, so that LayerNorm's variance does not cancel when the row
# sits far from zero; pass 2 reads h back and normalises. Backward: per row, pass 1 gathers
# mean(g * xhat) and mean(g) into a small fp32 scratch; then chunk by chunk, every row of the
# program is finished and dw and db for that chunk are summed in registers over the rows.

# BLOCK_N entries a chunk, one row a program
FWD_LOOPED_CONFIGS = (
    [{"BLOCK_N": n, "num_warps": w} for n in (2048, 4096, 8192) for w in (4, 8, 16)]
    # PER_SM: a persistent grid of that many programs an SM walks the rows, so that fewer rows are
    # between their two passes at once (the second pass is to find its row in L2)
    + [{"BLOCK_N": n, "num_warps": w, "PER_SM": p} for n in (4096, 8192) for w in (8, 16) for p in (1, 2, 4)]
    + [
        {"BLOCK_N": n, "num_warps": w, "EVICT": True, **per_sm}
        for n in (4096, 8192)
        for w in (8, 16)
        for per_sm in ({}, {"PER_SM": 1}, {"PER_SM": 2})
    ]
    # chunks of 16-64K entries at 16-32 warps: one or two programs an SM, each with its whole row
    # (or half of it) in flight, so that pass 2 may find the row it has just read in L1 or L2
    + [
        {"BLOCK_N": n, "num_warps": w, **evict}
        for n in (16384, 32768, 65536)
        for w in (16, 32)
        for evict in ({}, {"EVICT": True})
    ]
    # ... with pass 2 in smaller chunks (OUT_BLOCK_N), as it holds h, w and b together. LayerNorm's
    # whole-row chunk (65536 at 32 warps, sm_90) spilled 96 bytes; 56 with the smaller pass 2 alone,
    # none once its sums are also shifted by a sampled mean (SHIFT_SAMPLE)
    + [
        {"BLOCK_N": n, "OUT_BLOCK_N": out, "num_warps": w, **evict}
        for n in (32768, 65536)
        for out in (8192, 16384)
        for w in (16, 32)
        for evict in ({}, {"EVICT": True})
    ]
)


def _fwd_looped_default(key: dict) -> dict:
    """Few rows: each split across programs (``split.split_default``); else LOOP_BLOCK_N entries a
    chunk at LOOP_WARPS."""
    return split_default(key) or {"BLOCK_N": LOOP_BLOCK_N, "num_warps": LOOP_WARPS}


def _fwd_looped_prune(config: dict, key: dict) -> bool:
    """True drops the config: fp32 values a thread of a chunk outside PER_THREAD_RANGE."""
    return _outside(_per_thread(config, key), True)


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
    EVICT_READ_ONCE: tl.constexpr,  # eviction policy of pass 2's reads, the row's last: "" or "evict_first"
    EVICT_REREAD: tl.constexpr,  # ... of the first pass's reads, and of w and b: "" or "evict_last"
    BLOCK_N: tl.constexpr,  # entries per chunk of pass 1
    ROW_LENGTH: tl.constexpr,  # N when compiling for it (rows that fit in registers), else 0
    OUT_BLOCK_N: tl.constexpr,  # entries per chunk of pass 2 (at most BLOCK_N)
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    # A row length known when compiling fixes the trip count: the chunk loops unroll whole, and
    # pass 1 issues all its chunk loads before the first is summed. On the H200, rows of 4096-8192
    # entries with the eviction hints: 3-17% faster at the launches tried (some without the hints
    # ran slower; the tuner chooses). Long rows keep N a run-time value, one compilation for all.
    N = aligned(N, ALIGN)
    stride_xm = aligned(stride_xm, ALIGN)
    stride_rm = aligned(stride_rm, ALIGN)
    if ROW_LENGTH > 0:
        n = ROW_LENGTH
    else:
        n = N
    # one row a program, or (a grid smaller than M) a persistent walk over the rows
    for program_row in range(tl.program_id(0), M, tl.num_programs(0)):
        _norm_fwd_looped_row(
            x_ptr,
            r_ptr,
            h_ptr,
            y_ptr,
            w_ptr,
            b_ptr,
            mean_ptr,
            rstd_ptr,
            tl.cast(program_row, tl.int64),
            n,
            stride_xm,
            stride_rm,
            eps,
            RMS=RMS,
            HAS_RESIDUAL=HAS_RESIDUAL,
            HAS_WEIGHT=HAS_WEIGHT,
            HAS_BIAS=HAS_BIAS,
            BLOCK_N=BLOCK_N,
            OUT_BLOCK_N=OUT_BLOCK_N,
            EVICT_READ_ONCE=EVICT_READ_ONCE,
            EVICT_REREAD=EVICT_REREAD,
        )


SHIFT_SAMPLE = tl.constexpr(256)  # entries whose mean shifts a large chunk's sums (LayerNorm)


@triton.jit
def _norm_fwd_looped_row(
    x_ptr,
    r_ptr,
    h_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    mean_ptr,
    rstd_ptr,
    row,
    N,
    stride_xm,
    stride_rm,
    eps,
    RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BLOCK_N: tl.constexpr,
    EVICT_READ_ONCE: tl.constexpr,
    EVICT_REREAD: tl.constexpr,
):
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
            h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0, eviction_policy=EVICT_READ_ONCE)
            h = h.to(tl.float32) + tl.load(
                r_ptr + row * stride_rm + cols, mask=mask, other=0.0, eviction_policy=EVICT_READ_ONCE
            ).to(tl.float32)
            h = h.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * N + cols, h, mask=mask, eviction_policy=EVICT_REREAD)
            h = h.to(tl.float32)
        else:
            h = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0, eviction_policy=EVICT_REREAD)
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
        h = tl.load(source_ptr + cols, mask=mask, other=0.0, eviction_policy=EVICT_READ_ONCE).to(tl.float32)
        y = (h * rstd) if RMS else (h - mean) * rstd
        if HAS_WEIGHT:
            y *= tl.load(w_ptr + cols, mask=mask, eviction_policy=EVICT_REREAD).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, eviction_policy=EVICT_REREAD).to(tl.float32)
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


# ROWS rows a program, each in BLOCK_N chunks
BWD_LOOPED_CONFIGS = [
    {"ROWS": r, "BLOCK_N": n, "num_warps": w} for r in (4, 8, 16) for n in (2048, 4096) for w in (4, 8)
]


# Long rows this few (the key's power of two) take one a program: at 4 a program (BWD_ROWS_RANGE's
# least) 10 rows of 72384 fp32 made 3 programs for 132 SMs (123 us on the H200, torch 111), each
# walking 4 rows in turn. One a program moves each program's h, dy and dx once and its partials of
# dw and db (8 N bytes a row more): 20 N bytes a program in fp32 where four rows were 56 N.
BWD_LOOPED_ROW_A_PROGRAM = 32


def _bwd_looped_default(key: dict) -> dict:
    """Few rows: each split across programs (``split.split_default``); else BWD_PROGRAMS_PER_SM
    programs an SM in LOOP_BLOCK_N chunks at LOOP_WARPS, a row a program up to
    BWD_LOOPED_ROW_A_PROGRAM rows."""
    split = split_default(key)
    if split is not None:
        return split
    if key["rows"] <= BWD_LOOPED_ROW_A_PROGRAM:
        rows = 1
    else:
        rows = _bwd_rows_per_program(key["rows"], current_device(), True)
    return {"ROWS": rows, "BLOCK_N": LOOP_BLOCK_N, "num_warps": LOOP_WARPS}


def _bwd_looped_prune(config: dict, key: dict) -> bool:
    """True drops the config: fp32 values a thread of a chunk outside PER_THREAD_RANGE, or so many
    rows a program that SMs would sit idle."""
    return _outside(_per_thread(config, key), True) or _leaves_sms_idle(config, key, True)


@triton.jit
def _norm_bwd_looped_kernel(
    dy_ptr,  # upstream gradient of y, (M, N), row stride stride_dym, unit column stride
    dh_ptr,  # upstream gradient of h (add_ forms), (M, N), row stride stride_dhm
    h_ptr,  # the forward's normalised input, (M, N), row stride stride_hm
    w_ptr,  # weight, (N,) (unused without HAS_WEIGHT)
    mean_ptr,  # fp32 row means from the forward, (M,) (LayerNorm only)
    rstd_ptr,  # fp32 reciprocal standard deviations from the forward, (M,)
    sums_ptr,  # fp32 scratch, (M, 2): each row's c1 and c2 (layer_norm_terms; RMSNorm's mean(g * xhat))
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
    ALIGN: tl.constexpr,  # N and the row strides are multiples of it (jit.aligned)
):
    N = aligned(N, ALIGN)
    stride_dym = aligned(stride_dym, ALIGN)
    stride_dhm = aligned(stride_dhm, ALIGN)
    stride_hm = aligned(stride_hm, ALIGN)
    first = tl.program_id(0).to(tl.int64) * ROWS
    offsets = tl.arange(0, BLOCK_N)
    for i in range(ROWS):  # pass 1: each row's two sums, over all its chunks
        row = first + i
        if row < M:
            rstd = tl.load(rstd_ptr + row)
            shift = 0.0 if RMS else tl.load(mean_ptr + row)
            gx = tl.zeros([BLOCK_N], tl.float32)
            g_sum = tl.zeros([BLOCK_N], tl.float32)
            x_sum = tl.zeros([BLOCK_N], tl.float32)  # (LayerNorm's: xhat's own mean)
            for start in range(0, N, BLOCK_N):
                cols = start + offsets
                mask = cols < N
                h = tl.load(h_ptr + row * stride_hm + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.load(dy_ptr + row * stride_dym + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    g *= tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                gx += g * tl.where(mask, (h - shift) * rstd, 0.0)
                g_sum += g
                if centres_rows(h_ptr) and not RMS:
                    x_sum += tl.where(mask, (h - shift) * rstd, 0.0)
            if centres_rows(h_ptr) and not RMS:
                sums = layer_norm_terms(tl.sum(gx, axis=0), tl.sum(g_sum, axis=0), tl.sum(x_sum, axis=0), N)
                tl.store(sums_ptr + row * 2, sums[0])
                tl.store(sums_ptr + row * 2 + 1, sums[1])
            else:
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
