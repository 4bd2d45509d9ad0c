"""The linear family's Triton kernels: the matmul C = epilogue(A B^T) that serves the forward and
backward products of ``linear`` and ``gated_linear``, with the configs it is tuned over and their
prune directly above it, and the backward's elementwise step, dz = dy * act'(z) with db's partial
sums (gated: dg and du). ``matmul.py`` builds and tunes the matmul's launches; ``linear.py`` holds
the maths, the API and the autograd."""

from __future__ import annotations

from tritonkit._runtime import current_device, interpret, shared_memory_bytes
from tritonkit._triton import tl, triton
from tritonkit.jit import (
    GELU_EXP2_CUBIC,
    GELU_EXP2_LINEAR,
    dot_fp32,
    gelu,
    gelu_lean_grad,
)

# activation name -> the kernel's ACTIVATION code (constexprs: kernels read globals only as such)
ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "relu": 4, "relu2": 5}
NONE, GELU, GELU_TANH, SILU, RELU, RELU2 = (tl.constexpr(code) for code in ACTIVATIONS.values())
# The matmul's GATED forms: gated_linear's forward (two products, C = act(A B^T) * (A B2^T)) and
# its backward's dx = dg Wg + du Wu (C = A B^T + A2 B2^T, one accumulator); its dWg = dg^T x and
# dWu = du^T x are plain matmuls.
NOT_GATED, GATED_FWD, GATED_DX = (tl.constexpr(code) for code in range(3))
FORMS = ("linear", "gated fwd", "gated dx")  # the forms' names in tuning keys, by GATED code
# scaled_mm's scales: none; one each for A and B (tensorwise) or one a row of A and one a row of B
# (rowwise: C's rows and columns), applied to the fp32 product before the rest of the epilogue; or
# one a 1 x SCALE_BLOCK run of A's rows and one a SCALE_BLOCK x SCALE_BLOCK block of B (blockwise,
# DeepSeek-V3's recipe), applied to each step's product before it is added (a step within one
# block of K and a tile within one block of B's rows: SCALE_BLOCK a multiple of both)
SCALINGS = {None: 0, "tensor": 1, "row": 2, "block": 3}
UNSCALED, SCALE_TENSOR, SCALE_ROWS, SCALE_BLOCKS = (tl.constexpr(code) for code in SCALINGS.values())
SCALE_BLOCK = tl.constexpr(128)


@triton.jit
def _activate(z, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """act(z) in fp32. FAST, for outputs rounded to 16 bits: GELU (tanh) as z sigmoid(2u), one
    exp2 and one division, where the form bias_gelu keeps for fp32 (tanh from exp(-2|u|), exact
    near +-1) takes twice the instructions and live values, paid by the matmul's epilogue on every
    output while the tensor cores wait (sm_90, 128 x 256 tile: 784 bytes of spills -> 120)."""
    if ACTIVATION == GELU:
        y = gelu(z, APPROX_TANH=False)
    elif ACTIVATION == GELU_TANH:
        if FAST:  # 0.5 z (1 + tanh u) = z / (1 + 2^(-2u log2 e)), u = sqrt(2/pi) (z + 0.044715 z^3)
            y = z / (1.0 + tl.exp2(z * (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC * (z * z))))
        else:
            y = gelu(z, APPROX_TANH=True)
    elif ACTIVATION == SILU:
        y = z / (1.0 + tl.exp(-z))
    elif ACTIVATION == RELU:
        y = tl.maximum(z, 0.0)
    elif ACTIVATION == RELU2:
        y = tl.maximum(z, 0.0) * tl.maximum(z, 0.0)
    else:
        y = z
    return y


@triton.jit
def _activation_grad(z, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """act'(z) in fp32. GELU's in jit.gelu_lean_grad's few instructions (FAST: the tanh form's for a
    gradient rounded to 16 bits), as bias_gelu's backward: this pass is bound by them in 16 bits
    with libdevice's erf. The tuned matmul's epilogue, _activate, keeps jit.gelu until its tunings
    are next refreshed."""
    if ACTIVATION == GELU:
        g = gelu_lean_grad(z, APPROX_TANH=False, FAST=FAST)
    elif ACTIVATION == GELU_TANH:
        g = gelu_lean_grad(z, APPROX_TANH=True, FAST=FAST)
    elif ACTIVATION == SILU:
        sigmoid = 1.0 / (1.0 + tl.exp(-z))
        g = sigmoid * (1.0 + z * (1.0 - sigmoid))
    elif ACTIVATION == RELU:
        g = tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == RELU2:
        g = 2.0 * tl.maximum(z, 0.0)
    else:
        g = tl.full(z.shape, 1.0, tl.float32)
    return g


@triton.jit
def _tile_position(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of C's tile-th tile in grouped order: consecutive tiles share GROUP_M
    row tiles of A and one column tile of B, which L2 then serves to all of them."""
    group_first_m = tile // (GROUP_M * tiles_n) * GROUP_M
    group_rows = tl.minimum(tiles_m - group_first_m, GROUP_M)
    in_group = tile % (GROUP_M * tiles_n)
    return group_first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def _descriptor(
    ptr, rows, K, stride_row, stride_k, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, K_MAJOR: tl.constexpr
):
    """A tensor descriptor (TMA) of an operand (rows, K) over its memory as it lies: boxes of
    [BLOCK_R, BLOCK_K] over (rows, K) when K is the unit stride, else [BLOCK_K, BLOCK_R] over
    (K, rows). Boxes past the edges load zeros."""
    if K_MAJOR:
        return tl.make_tensor_descriptor(
            ptr, shape=[rows, K], strides=[stride_row, 1], block_shape=[BLOCK_R, BLOCK_K]
        )
    else:
        return tl.make_tensor_descriptor(
            ptr, shape=[K, rows], strides=[stride_k, 1], block_shape=[BLOCK_K, BLOCK_R]
        )


@triton.jit
def _rows_by_depth(descriptor, first_row, k, K_MAJOR: tl.constexpr):
    """The [BLOCK_R, BLOCK_K] box at (first_row, k) of a ``_descriptor``."""
    if K_MAJOR:
        return descriptor.load([first_row, k])
    else:
        return tl.trans(descriptor.load([k, first_row]))


@triton.jit
def _depth_by_rows(descriptor, first_row, k, K_MAJOR: tl.constexpr):
    """The [BLOCK_K, BLOCK_R] box at (first_row, k) of a ``_descriptor`` (B's tile as the dot takes it)."""
    if K_MAJOR:
        return tl.trans(descriptor.load([first_row, k]))
    else:
        return descriptor.load([k, first_row])


@triton.jit
def _a_step(
    source, rows, first_row, k, M, K, stride_am, stride_ak, TMA: tl.constexpr, K_MAJOR: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A's [rows, BLOCK_K] tile at depth k: from a ``_descriptor`` (TMA), else through pointers from
    ``source``, zeros past M and K."""
    if TMA:
        return _rows_by_depth(source, first_row, k, K_MAJOR=K_MAJOR)
    else:
        ks = k + tl.arange(0, BLOCK_K)
        mask = (rows[:, None] < M) & (ks[None, :] < K)
        return tl.load(source + rows[:, None] * stride_am + ks[None, :] * stride_ak, mask=mask, other=0.0)


@triton.jit
def _b_step(
    source, cols, first_col, k, N, K, stride_bn, stride_bk, TMA: tl.constexpr, K_MAJOR: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """B's [BLOCK_K, cols] tile at depth k (as the dot takes it), as ``_a_step``."""
    if TMA:
        return _depth_by_rows(source, first_col, k, K_MAJOR=K_MAJOR)
    else:
        ks = k + tl.arange(0, BLOCK_K)
        mask = (ks[:, None] < K) & (cols[None, :] < N)
        return tl.load(source + cols[None, :] * stride_bn + ks[:, None] * stride_bk, mask=mask, other=0.0)


@triton.jit
def _epilogue(
    acc,
    acc2,
    rows,
    cols,
    first_row,
    first_col,
    c_ptr,
    c_target,
    bias_ptr,
    residual_ptr,
    pre_ptr,
    pre2_ptr,
    scale_a_ptr,
    scale_b_ptr,
    M,
    N,
    stride_rm,
    stride_rn,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
    GATED: tl.constexpr,
    SCALING: tl.constexpr,
    C_TMA: tl.constexpr,
):
    """C's tile (rows x cols, from (first_row, first_col)) from the accumulators: * the scales, +
    bias, the pre-activations stored, act, * the second product (GATED_FWD), + residual; C_TMA: C
    stored through ``c_target``, a descriptor."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = rows[:, None] * N + cols[None, :]  # offsets in C and in the stored pre-activations
    if SCALING == SCALE_TENSOR:
        acc *= tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    elif SCALING == SCALE_ROWS:
        scale_a = tl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)
        scale_b = tl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
        acc *= scale_a[:, None] * scale_b[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + out, acc.to(pre_ptr.dtype.element_ty), mask=mask)
        if GATED == GATED_FWD:
            tl.store(pre2_ptr + out, acc2.to(pre2_ptr.dtype.element_ty), mask=mask)
    y = _activate(acc, ACTIVATION=ACTIVATION, FAST=c_ptr.dtype.element_ty != tl.float32)
    if GATED == GATED_FWD:
        y *= acc2
    if HAS_RESIDUAL:
        y += tl.load(
            residual_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn, mask=mask, other=0.0
        ).to(tl.float32)
    if C_TMA:  # the copy engine writes the tile from shared memory, clipped at C's edges
        c_target.store([first_row, first_col], y.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptr + out, y.to(c_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- the matmul: configs, prune, kernel

# Tiles, depths, warps and stages, tuned per kernel form, layout and shape bucket through the
# accuracy gate; pruned where the accumulators pass MAX_ACC_VALUES fp32 values a thread (sm_90:
# 128 x 128 at 8 warps, 64 a thread, compiles without spills; the gated forward's two at 128 x 128,
# 128 a thread, spilled) or the stages pass an SM's shared memory.
CONFIGS = [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}
    for bm in (64, 128)
    for bn in (64, 128, 256)
    for warps in (4, 8)
    for stages in (3, 4)
]
# The large tiles that won the large shapes' tuning at 3f55667, with A and B through TMA, and with
# TMA on a persistent grid (one program an SM walking tiles in grouped order).
CONFIGS += [
    {
        "BLOCK_M": 128,
        "BLOCK_N": bn,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": warps,
        "num_stages": stages,
        "TMA": True,
        **persistent,
    }
    for bn, warps in ((256, 8), (128, 8), (128, 4))
    for stages in (3, 4)
    for persistent in ({}, {"PERSISTENT": 1})
]
# Split K for few tiles over a long K (decode-like rows: dx of 16 rows over K = 16384 is 64 tiles
# of 64 x 64 for 132 SMs): plain matmuls only.
CONFIGS += [
    {
        "BLOCK_M": 64,
        "BLOCK_N": bn,
        "BLOCK_K": 64,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 3,
        "SPLIT_K": split_k,
    }
    for bn in (64, 128)
    for split_k in (4, 16)
]
# Decode-like rows (at most DECODE_ROWS): W is the traffic, so tiles that keep more of it in flight
# a program: 16-row tiles (mma.sync; only where the rows fit them), 128-256 deep, 4-6 stages. Found
# by benchmarks/prototypes/decode_tiles.py; timed with L2 flushed, the 16-row tiles won the H200's
# 16-row keys (forward 47.5 -> 45.8 us, dx 56.6 -> 48.1) but the gated dx's, the deep 64-row ones none.
DECODE_TILES = (  # rows, columns, depth, stages, TMA or not
    (16, 128, 128, 5, {}),
    (16, 64, 128, 6, {}),
    (16, 32, 256, 6, {}),
    (64, 64, 128, 6, {"TMA": True}),
    (64, 128, 128, 4, {"TMA": True}),
)
CONFIGS += [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": 4, "num_stages": stages, **tma}
    for bm, bn, bk, stages, tma in DECODE_TILES
]
# Shallow matmuls (K of at most DECODE_ROWS: dW of decode-like rows, out_features x in_features
# written from 16-128 rows) are bound by writing C, 128 MB at the benchmark's shapes: steps no
# deeper than K (16-32, where 64-deep boxes load zeros), two programs an SM so that one's stores
# overlap the other's, and C stored through a descriptor. Found by
# benchmarks/prototypes/decode_backward.py (L2 flushed, as the tuner times): dW of 16 rows 50.7 ->
# 37.8 us, of 128 rows 75.1 -> 57.5 (51.0 with a descriptor store; cuBLAS 47.4 and 51.5). The H200's
# tuner chose 128 x 128 x 16 (38.0 us) and the 128 x 256 tile with the store (51.2).
SHALLOW_TILES = (  # rows, columns, depth, warps, and TMA, grid and store
    (128, 128, 16, 4, {}),
    (128, 64, 16, 4, {}),
    (128, 128, 32, 4, {}),
    (128, 128, 16, 4, {"TMA": True, "PERSISTENT": 2}),
    (128, 128, 32, 4, {"TMA": True, "PERSISTENT": 2}),
    (128, 128, 64, 4, {"TMA": True, "PERSISTENT": 2}),
    (128, 128, 16, 4, {"TMA": True, "PERSISTENT": 2, "TMA_STORE": True}),
    (128, 128, 64, 4, {"TMA": True, "PERSISTENT": 2, "TMA_STORE": True}),
    (128, 256, 64, 8, {"TMA": True, "PERSISTENT": 1, "TMA_STORE": True}),
)
CONFIGS += [
    {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": 3, **form}
    for bm, bn, bk, warps, form in SHALLOW_TILES
]

# The untuned configs, the tuner's default wherever tuning cannot run: 128 x 128 outputs at 8 warps
# and 64-deep steps on the GPU (Triton's own Hopper matmul tutorial's tile); the gated forms, two
# accumulators or two B tiles a step, take 128 x 64 (sm_90: 128 x 128 spills the gated forward at
# 254 registers; 128 x 64 takes 125-142, no spills). The interpreter runs each program in numpy,
# so its small tile keeps several programs and k-steps in a test's odd shapes.
DEFAULT_CONFIGS = {  # the GPU's, by kernel form
    "linear": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
}
DEFAULT_CONFIGS |= {form: DEFAULT_CONFIGS["linear"] | {"BLOCK_N": 64} for form in ("gated fwd", "gated dx")}
INTERPRETER_CONFIG = {
    "BLOCK_M": 32,
    "BLOCK_N": 32,
    "BLOCK_K": 16,
    "GROUP_M": 2,
    "num_warps": 4,
    "num_stages": 1,
}


def default_config(form: str) -> dict:
    """The untuned config of a kernel form (``FORMS``): the interpreter's small tile, else the GPU's.
    The tuner's default for a key of that form, and what ``tritonkit inspect`` compiles untold."""
    return dict(INTERPRETER_CONFIG if interpret() else DEFAULT_CONFIGS[form])


DECODE_ROWS = 128  # rows (M) up to which a matmul is decode-like, and depths (K) up to which shallow
SPLIT_K_MAX_TILES = 264  # two programs an SM of the H200's 132: past that the tiles fill the GPU
SPLIT_K_MIN_STEPS = 4  # k-steps a share of K takes at least
MAX_ACC_VALUES = 128  # fp32 accumulator values a thread may hold (see CONFIGS)


def _accumulator_values(config: dict, key: dict) -> float:
    """fp32 accumulator values a thread holds: the gated forward keeps two products."""
    accumulators = 2 if key["form"] == "gated fwd" else 1
    return accumulators * config["BLOCK_M"] * config["BLOCK_N"] / (32 * config["num_warps"])


def _fits_shared_memory(config: dict, key: dict) -> bool:
    """Whether the stages of A and B tiles (two of B for the gated forward; the gated dx's products take
    turns, a tile of each a step), and C's tile where it takes shared memory of its own, fit in the
    shared memory a program may use. C's tile is apart from the stages where TMA_STORE stages it, and
    where an fp32 C leaves a persistent grid's accumulator: its layout change cannot reuse the stages'
    buffers, which already hold the next tile's loads. sm_90, 128 x 256 on four TMA stages: 196640 bytes
    one tile a program, 229408 persistent with bf16 C (32 KB of scratch), 327712 with fp32 C (the tile's
    128 KB)."""
    b_tiles = 2 if key["form"] == "gated fwd" else 1
    tile_rows = config["BLOCK_M"] + b_tiles * config["BLOCK_N"]  # of A and B, each BLOCK_K deep
    fp32_c = key.get("out") == "fp32"
    c_apart = config.get("TMA_STORE") or (config.get("PERSISTENT") and fp32_c)
    c_tile = config["BLOCK_M"] * config["BLOCK_N"] * (4 if fp32_c else 2) if c_apart else 0
    shared = config["num_stages"] * config["BLOCK_K"] * tile_rows * 2 + c_tile
    return shared <= shared_memory_bytes(current_device())


def _overhangs_the_problem(config: dict, key: dict) -> bool:
    """A tile at least twice the problem's rows or columns (decode-like rows still take 64-row tiles)."""
    return config["BLOCK_M"] > max(64, key["m"]) or config["BLOCK_N"] > max(64, key["n"])


def _split_k_fits(config: dict, key: dict) -> bool:
    """Whether a split of K suits the key: a plain matmul without an epilogue, few enough tiles that
    they leave the GPU idle, and at least SPLIT_K_MIN_STEPS k-steps in each share of K."""
    tiles = -(-key["m"] // config["BLOCK_M"]) * -(-key["n"] // config["BLOCK_N"])
    return (
        key["form"] == "linear"
        and not key["epilogue"]
        and tiles <= SPLIT_K_MAX_TILES
        and key["k"] >= config["SPLIT_K"] * SPLIT_K_MIN_STEPS * config["BLOCK_K"]
    )


def _is_decode_tile(config: dict) -> bool:
    """A tile for decode-like rows: under 64 rows, or steps past 64 deep."""
    return config["BLOCK_K"] > 64 or config["BLOCK_M"] < 64


def _decode_tile_fits(config: dict, key: dict) -> bool:
    """Whether a decode tile suits the key: decode-like rows, K at least a step deep, and (under 64
    rows) rows within the tile."""
    return (
        key["m"] <= DECODE_ROWS
        and config["BLOCK_K"] <= key["k"]
        and not (config["BLOCK_M"] < 64 and key["m"] > config["BLOCK_M"])
    )


def _is_shallow_tile(config: dict) -> bool:
    """A tile for shallow matmuls: steps under 64 deep, two programs an SM, or C stored by TMA."""
    return config["BLOCK_K"] < 64 or config.get("PERSISTENT", 0) > 1 or config.get("TMA_STORE", False)


def _shallow_tile_fits(config: dict, key: dict) -> bool:
    """Whether a shallow tile suits the key: K of at most DECODE_ROWS, a step under 64 deep no deeper
    than K (K under 16 takes the 16-deep step), and C stored by TMA only for plain matmuls without
    an epilogue."""
    deeper_than_k = 64 > config["BLOCK_K"] > max(key["k"], 16)
    tma_store_refused = config.get("TMA_STORE", False) and (key["epilogue"] or key["form"] != "linear")
    return key["k"] <= DECODE_ROWS and not deeper_than_k and not tma_store_refused


def _prune(config: dict, key: dict) -> bool:
    """True drops the config for the key (see each predicate)."""
    return (
        _accumulator_values(config, key) > MAX_ACC_VALUES
        or not _fits_shared_memory(config, key)
        or _overhangs_the_problem(config, key)
        or (config.get("SPLIT_K", 1) > 1 and not _split_k_fits(config, key))
        or (_is_decode_tile(config) and not _decode_tile_fits(config, key))
        or (_is_shallow_tile(config) and not _shallow_tile_fits(config, key))
    )


@triton.jit
def _linear_kernel(
    a_ptr,  # A, (M, K), strides (stride_am, stride_ak)
    a2_ptr,  # GATED_DX: the second A (du), strides (stride_am, stride_ak) as A
    b_ptr,  # B, (N, K), strides (stride_bn, stride_bk): C = A B^T
    b2_ptr,  # GATED_FWD, GATED_DX: the second B (Wu or Wu^T), strides (stride_bn, stride_bk) as B
    c_ptr,  # output, (M, N), contiguous (SPLIT_K > 1: fp32 partial products, (SPLIT_K, M, N))
    bias_ptr,  # HAS_BIAS: (N,), added to every row
    residual_ptr,  # HAS_RESIDUAL: (M, N), strides (stride_rm, stride_rn), added after the activation
    pre_ptr,  # STORE_PRE: the pre-activation out, (M, N), contiguous (gated: g)
    pre2_ptr,  # STORE_PRE and GATED_FWD: u out, (M, N), contiguous
    scale_a_ptr,  # SCALING: fp32 scales of A, one (SCALE_TENSOR), one a row (M,), or one a row's
    # run of SCALE_BLOCK (M, cdiv(K, SCALE_BLOCK)) (SCALE_BLOCKS); contiguous
    scale_b_ptr,  # ... of B: one, one a row of B (N,), or (cdiv(K, SCALE_BLOCK), cdiv(N, SCALE_BLOCK))
    M,  # rows of A and C
    N,  # rows of B: columns of C
    K,  # the reduced dimension
    stride_am,  # elements between rows of A
    stride_ak,  # elements between columns of A
    stride_bn,  # ... rows of B
    stride_bk,  # ... columns of B
    stride_rm,  # ... rows of the residual
    stride_rn,  # ... columns of the residual
    ACTIVATION: tl.constexpr,  # epilogue: C = act(A B^T + bias) (+ residual); an ACTIVATIONS code
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,  # also store A B^T + bias, the pre-activation
    GATED: tl.constexpr,  # NOT_GATED, or a gated_linear product (GATED_FWD, GATED_DX; see above)
    SCALING: tl.constexpr,  # UNSCALED, or scaled_mm's scales (SCALE_TENSOR, SCALE_ROWS; see above)
    FAST_ACCUM: tl.constexpr,  # fp8: the steps summed in the tensor cores' accumulator (see _linear_tile)
    EXACT_DOT_IN_FP32: tl.constexpr,  # multiply the 16-bit tiles as fp32 (the interpreter's path)
    TMA: tl.constexpr,  # load A and B through tensor descriptors (unit stride one way, 16-byte aligned)
    A_K_MAJOR: tl.constexpr,  # TMA: A's unit stride is along K (else along M)
    B_K_MAJOR: tl.constexpr,  # TMA: B's unit stride is along K (else along N)
    C_TMA: tl.constexpr,  # store C through a tensor descriptor (contiguous, 16-byte aligned rows)
    PERSISTENT: tl.constexpr,  # fewer programs than tiles: pipeline across a program's tiles
    SPLIT_K: tl.constexpr,  # > 1: program_id(1) takes a 1/SPLIT_K share of K, C is fp32 (SPLIT_K, M, N)
    BLOCK_M: tl.constexpr,  # rows of a tile of C
    BLOCK_N: tl.constexpr,  # columns of a tile of C
    BLOCK_K: tl.constexpr,  # depth of a step
    GROUP_M: tl.constexpr,  # row tiles a group walks before the next column of tiles (L2 reuse of B)
):
    # One program a tile of C; or, PERSISTENT, a few programs an SM, each walking tiles from its id
    # in steps of the grid, so that a tile's epilogue runs while the next tile's loads are in flight;
    # or, SPLIT_K, SPLIT_K programs a tile, each over a share of K (few tiles, a long K: dx of
    # decode-like rows), whose fp32 partial products the launcher sums.
    a_source, a2_source, b_source, b2_source, c_target = a_ptr, a2_ptr, b_ptr, b2_ptr, c_ptr
    if C_TMA:
        c_target = _descriptor(c_ptr, M, N, N, 1, BLOCK_R=BLOCK_M, BLOCK_K=BLOCK_N, K_MAJOR=True)
    if TMA:
        a_source = _descriptor(
            a_ptr, M, K, stride_am, stride_ak, BLOCK_R=BLOCK_M, BLOCK_K=BLOCK_K, K_MAJOR=A_K_MAJOR
        )
        b_source = _descriptor(
            b_ptr, N, K, stride_bn, stride_bk, BLOCK_R=BLOCK_N, BLOCK_K=BLOCK_K, K_MAJOR=B_K_MAJOR
        )
        if GATED == GATED_DX:
            a2_source = _descriptor(
                a2_ptr, M, K, stride_am, stride_ak, BLOCK_R=BLOCK_M, BLOCK_K=BLOCK_K, K_MAJOR=A_K_MAJOR
            )
        if GATED != NOT_GATED:
            b2_source = _descriptor(
                b2_ptr, N, K, stride_bn, stride_bk, BLOCK_R=BLOCK_N, BLOCK_K=BLOCK_K, K_MAJOR=B_K_MAJOR
            )
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
            _linear_tile(
                tile,
                tiles_m,
                tiles_n,
                a_source,
                a2_source,
                b_source,
                b2_source,
                c_ptr,
                c_target,
                bias_ptr,
                residual_ptr,
                pre_ptr,
                pre2_ptr,
                scale_a_ptr,
                scale_b_ptr,
                M,
                N,
                K,
                0,
                K,
                stride_am,
                stride_ak,
                stride_bn,
                stride_bk,
                stride_rm,
                stride_rn,
                ACTIVATION=ACTIVATION,
                HAS_BIAS=HAS_BIAS,
                HAS_RESIDUAL=HAS_RESIDUAL,
                STORE_PRE=STORE_PRE,
                GATED=GATED,
                SCALING=SCALING,
                FAST_ACCUM=FAST_ACCUM,
                EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
                TMA=TMA,
                A_K_MAJOR=A_K_MAJOR,
                B_K_MAJOR=B_K_MAJOR,
                C_TMA=C_TMA,
                BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K,
                GROUP_M=GROUP_M,
            )
    else:
        c_tile, k_start, k_end = c_ptr, 0, K
        if SPLIT_K > 1:  # whole steps a share: only the last share's last step is ragged
            split = tl.program_id(1)
            share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
            c_tile = c_ptr + split.to(tl.int64) * M * N
            k_start, k_end = split * share, tl.minimum(K, (split + 1) * share)
        _linear_tile(
            tl.program_id(0),
            tiles_m,
            tiles_n,
            a_source,
            a2_source,
            b_source,
            b2_source,
            c_tile,
            c_target,
            bias_ptr,
            residual_ptr,
            pre_ptr,
            pre2_ptr,
            scale_a_ptr,
            scale_b_ptr,
            M,
            N,
            K,
            k_start,
            k_end,
            stride_am,
            stride_ak,
            stride_bn,
            stride_bk,
            stride_rm,
            stride_rn,
            ACTIVATION=ACTIVATION,
            HAS_BIAS=HAS_BIAS,
            HAS_RESIDUAL=HAS_RESIDUAL,
            STORE_PRE=STORE_PRE,
            GATED=GATED,
            SCALING=SCALING,
            FAST_ACCUM=FAST_ACCUM,
            EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32,
            TMA=TMA,
            A_K_MAJOR=A_K_MAJOR,
            B_K_MAJOR=B_K_MAJOR,
            C_TMA=C_TMA,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            GROUP_M=GROUP_M,
        )


@triton.jit
def _linear_tile(
    tile,
    tiles_m,
    tiles_n,
    a_source,
    a2_source,
    b_source,
    b2_source,
    c_ptr,
    c_target,
    bias_ptr,
    residual_ptr,
    pre_ptr,
    pre2_ptr,
    scale_a_ptr,
    scale_b_ptr,
    M,
    N,
    K,
    k_start,
    k_end,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_rm,
    stride_rn,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
    GATED: tl.constexpr,
    SCALING: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    EXACT_DOT_IN_FP32: tl.constexpr,
    TMA: tl.constexpr,
    A_K_MAJOR: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    C_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C's tile-th tile (grouped order): the k-loop over A and B from k_start to k_end (pointers, or
    descriptors with TMA; see the kernel for the operands), then the epilogue."""
    if SCALING == SCALE_BLOCKS:
        tl.static_assert(SCALE_BLOCK % BLOCK_K == 0 and SCALE_BLOCK % BLOCK_N == 0)
    pid_m, pid_n = _tile_position(tile, tiles_m, tiles_n, GROUP_M=GROUP_M)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M * K may pass 2^31
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GATED_FWD: A B2^T
    for k in range(k_start, k_end, BLOCK_K):
        a = _a_step(a_source, rows, pid_m * BLOCK_M, k, M, K, stride_am, stride_ak, TMA, A_K_MAJOR, BLOCK_K)
        b = _b_step(b_source, cols, pid_n * BLOCK_N, k, N, K, stride_bn, stride_bk, TMA, B_K_MAJOR, BLOCK_K)
        if SCALING == SCALE_BLOCKS:  # this step's product in its block of K, scaled, then added
            block_k = k // SCALE_BLOCK
            blocks_k = tl.cdiv(K, SCALE_BLOCK)
            scale_a = tl.load(scale_a_ptr + rows * blocks_k + block_k, mask=rows < M, other=0.0)
            scale_b = tl.load(
                scale_b_ptr + block_k * tl.cdiv(N, SCALE_BLOCK) + pid_n * BLOCK_N // SCALE_BLOCK
            )
            part = dot_fp32(a, b, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
            acc += part * (scale_a * scale_b)[:, None]
        elif FAST_ACCUM and not EXACT_DOT_IN_FP32:  # fp8: every step chained in the tensor cores' sum
            acc = tl.dot(a, b, acc)
        else:
            # 16-bit: Triton chains the product into acc. fp8 on sm_90: Triton keeps each step's
            # product apart (its default max_num_imprecise_acc) and adds it to acc in fp32 after the
            # step: the tensor cores' fp8 sums keep about 14 bits, so K is summed exactly but within
            # a step (torch._scaled_mm's default had the same error on the H200, to three digits)
            acc += dot_fp32(a, b, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
        if GATED == GATED_FWD:
            b2 = _b_step(
                b2_source, cols, pid_n * BLOCK_N, k, N, K, stride_bn, stride_bk, TMA, B_K_MAJOR, BLOCK_K
            )
            acc2 += dot_fp32(a, b2, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
    if GATED == GATED_DX:
        # dg Wg + du Wu: the second product's steps after the first's, into the same sum, so that a
        # step loads one tile of A and one of B and the tile takes a plain matmul's stages (the two
        # side by side, two tiles of each a step, left 128 x 128 on three stages: 0.81x cuBLAS)
        for k in range(k_start, k_end, BLOCK_K):
            a2 = _a_step(
                a2_source, rows, pid_m * BLOCK_M, k, M, K, stride_am, stride_ak, TMA, A_K_MAJOR, BLOCK_K
            )
            b2 = _b_step(
                b2_source, cols, pid_n * BLOCK_N, k, N, K, stride_bn, stride_bk, TMA, B_K_MAJOR, BLOCK_K
            )
            acc += dot_fp32(a2, b2, EXACT_DOT_IN_FP32=EXACT_DOT_IN_FP32)
    _epilogue(
        acc,
        acc2,
        rows,
        cols,
        pid_m * BLOCK_M,
        pid_n * BLOCK_N,
        c_ptr,
        c_target,
        bias_ptr,
        residual_ptr,
        pre_ptr,
        pre2_ptr,
        scale_a_ptr,
        scale_b_ptr,
        M,
        N,
        stride_rm,
        stride_rn,
        ACTIVATION=ACTIVATION,
        HAS_BIAS=HAS_BIAS,
        HAS_RESIDUAL=HAS_RESIDUAL,
        STORE_PRE=STORE_PRE,
        GATED=GATED,
        SCALING=SCALING,
        C_TMA=C_TMA,
    )


# ---------------------------------------------------------------- the gated forward's elementwise step


@triton.jit
def _gated_activation_kernel(
    g_ptr,  # the gate's product, (numel,) contiguous
    u_ptr,  # the up product, (numel,) contiguous
    y_ptr,  # act(g) * u out, (numel,) contiguous
    numel,  # elements of each
    ACTIVATION: tl.constexpr,  # an ACTIVATIONS code
    BLOCK: tl.constexpr,  # elements a program
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: numel may pass 2^31
    mask = offsets < numel
    g = tl.load(g_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = _activate(g, ACTIVATION=ACTIVATION, FAST=y_ptr.dtype.element_ty != tl.float32) * u
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------- the backward's elementwise step


@triton.jit
def _activation_backward_kernel(
    dy_ptr,  # upstream gradient, (M, N), strides (stride_dym, stride_dyn)
    z_ptr,  # the forward's pre-activation (gated: g), (M, N), contiguous
    u_ptr,  # GATED: u, (M, N), contiguous
    dz_ptr,  # STORE_DZ: dz out (gated: dg), (M, N), contiguous
    du_ptr,  # GATED: du out, (M, N), contiguous
    db_partial_ptr,  # SUM_DB: fp32 sums of dz over each program's rows, (row programs, N), contiguous
    M,  # rows
    N,  # columns (out_features)
    stride_dym,  # elements between rows of dy
    stride_dyn,  # elements between columns of dy
    ACTIVATION: tl.constexpr,  # an ACTIVATIONS code
    GATED: tl.constexpr,  # dg = dy * u * act'(g) and du = dy * act(g), else dz = dy * act'(z)
    STORE_DZ: tl.constexpr,  # False: no activation, dz is dy itself and only db is summed
    SUM_DB: tl.constexpr,  # store the column sums of dz (as rounded to its dtype, as torch's db sums it)
    BLOCK_M: tl.constexpr,  # rows of one tile
    BLOCK_N: tl.constexpr,  # columns a program handles
    ROW_TILES: tl.constexpr,  # tiles a program walks down its columns
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    db = tl.zeros([BLOCK_N], tl.float32)
    first_row = tl.program_id(0).to(tl.int64) * (BLOCK_M * ROW_TILES)  # int64: M * N may pass 2^31
    for tile in range(ROW_TILES):
        rows = first_row + tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        out = rows[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn, mask=mask, other=0.0)
        if GATED:
            g = tl.load(z_ptr + out, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + out, mask=mask, other=0.0).to(tl.float32)
            dg = (
                dy.to(tl.float32)
                * u
                * _activation_grad(g, ACTIVATION, FAST=dz_ptr.dtype.element_ty != tl.float32)
            )
            tl.store(dz_ptr + out, dg.to(dz_ptr.dtype.element_ty), mask=mask)
            act = _activate(g, ACTIVATION=ACTIVATION, FAST=du_ptr.dtype.element_ty != tl.float32)
            tl.store(du_ptr + out, (dy.to(tl.float32) * act).to(du_ptr.dtype.element_ty), mask=mask)
        else:
            if STORE_DZ:
                z = tl.load(z_ptr + out, mask=mask, other=0.0).to(tl.float32)
                dz = (
                    dy.to(tl.float32)
                    * _activation_grad(z, ACTIVATION, FAST=dz_ptr.dtype.element_ty != tl.float32)
                ).to(dz_ptr.dtype.element_ty)
                tl.store(dz_ptr + out, dz, mask=mask)
            else:
                dz = dy
            if SUM_DB:
                db += tl.sum(dz.to(tl.float32), axis=0)  # masked entries loaded as 0: dz is 0 there
    if SUM_DB:
        tl.store(db_partial_ptr + tl.program_id(0) * N + cols, db, mask=cols < N)
