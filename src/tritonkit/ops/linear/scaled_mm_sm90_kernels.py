"""An fp8 matmul for Hopper (sm_90) in Gluon, warp-specialized: ``scaled_mm``'s tensorwise and
rowwise products where ``scaled_mm`` measured it faster than the linear family's Triton kernel
(``scaled_mm._gluon_pays``).

Maths: C = (A B^T) * scales, A (M, K) and B (N, K) fp8, K-major, the scales one each (SCALING 1),
one a row of A and one a row of B (SCALING 2), or blockwise (SCALING 3: one a 128-run of a row of
A, (M, cdiv(K, 128)), and one a 128 x 128 block of B, (cdiv(K, 128), cdiv(N, 128))), C in its dtype.
Each 128-deep step's product is either chained in the tensor cores' sum (CHAINED, ``use_fast_accum``)
or promoted: waited for and added to an fp32 accumulator, as ``torch._scaled_mm`` does by default
(``scaled_mm``'s module docstring has the numbers); blockwise, promoted times its step's scales (a
step is one block of K, a 128-column tile one block of N).

Structure (a program a (64 x CONSUMERS) x BLOCK_N tile of C, in the grouped order of the linear
family, or on a persistent grid one program an SM walking tiles pid, pid + programs, ..., its
ring running on from one tile to the next; ``scaled_mm_sm90.TILES`` has each mode's):
- a producer warp (24 registers) issues every TMA load, A's 64-row slices and B's tile a step,
  into a NUM_STAGES-deep ring of ready and empty mbarriers;
- CONSUMERS warpgroups of 64 rows each (two at 240 registers, or three at 160). Chained, each
  issues a step's wgmma chain and waits for the previous step's only (``warpgroup_mma_wait(1)``), so
  that the tensor cores run on while it releases the stage. Promoted, each waits for its step's
  product and adds it, as CUTLASS's fp8 promotion does: the other warpgroups' products run under
  the adds (the plain Triton kernel's two warpgroups share one instruction stream and add at the
  same time); with three, two products queue behind the one being added. Carrying a product in
  flight across steps, to add it under the next, made ptxas serialize every wgmma ("non wgmma
  instructions reading accumulator registers ... between start and end of the pipeline stage"),
  compiled ad hoc.
- the epilogue scales the fp32 accumulator and stores C from registers, masked at its edges.

References: Triton's Gluon tutorials (05-wgmma, 08-warp-specialization); DeepSeek-V3's report,
section 3.3.2, on the fp8 sums' promotion.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

ROWS = gl.constexpr(64)  # a consumer warpgroup's rows: a wgmma's M per warpgroup
CONSUMER_WARPS = gl.constexpr(4)
PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _tile_position(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(first row, first column) of a tile in the grouped order (kernels._tile_position's)."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_rows
    pid_n = (tile % in_group) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _tiles(M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(C's tiles, the stride between a program's tiles): one tile a program (grid = tiles), or a
    persistent grid's programs walking tile pid, pid + programs, ...; one loop serves both."""
    return gl.cdiv(M, BLOCK_M) * gl.cdiv(N, BLOCK_N), gl.num_programs(0)


@gluon.jit
def _load_partition(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, GROUP_M: gl.constexpr):
    """The producer: every TMA load of the program's tiles' steps into the ring, which runs on from
    one tile to the next (so a persistent program's next tile loads under this one's epilogue)."""
    NUM_STAGES: gl.constexpr = b_smem.type.shape[0]
    BLOCK_N: gl.constexpr = b_smem.type.shape[1]
    BLOCK_K: gl.constexpr = b_smem.type.shape[2]
    CONSUMERS: gl.constexpr = a_smem.type.shape[0] // NUM_STAGES
    nbytes: gl.constexpr = CONSUMERS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles, stride = _tiles(M, N, CONSUMERS * ROWS, BLOCK_N)
    steps = gl.cdiv(K, BLOCK_K)
    done = 0  # the ring's steps before this tile's
    for tile in range(gl.program_id(0), tiles, stride):
        off_m, off_n = _tile_position(tile, M, N, CONSUMERS * ROWS, BLOCK_N, GROUP_M)
        for ki in range(steps):
            stage = (done + ki) % NUM_STAGES
            mbarrier.wait(empty.index(stage), (((done + ki) // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(
                    a_desc,
                    [off_m + c * ROWS, ki * BLOCK_K],
                    ready.index(stage),
                    a_smem.index(CONSUMERS * stage + c),
                )
            tma.async_copy_global_to_shared(
                b_desc, [off_n, ki * BLOCK_K], ready.index(stage), b_smem.index(stage)
            )
        done += steps


@gluon.jit
def _mma_partition(
    cid: gl.constexpr,
    a_smem,
    b_smem,
    ready,
    empty,
    c_ptr,
    scale_a_ptr,
    scale_b_ptr,
    M,
    N,
    K,
    stride_cm,
    SCALING: gl.constexpr,
    CHAINED: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """A consumer warpgroup: rows cid * 64, ... of each of the program's tiles, every step's product
    (chained or promoted: the module docstring), then the scaled epilogue."""
    NUM_STAGES: gl.constexpr = b_smem.type.shape[0]
    BLOCK_N: gl.constexpr = b_smem.type.shape[1]
    CONSUMERS: gl.constexpr = a_smem.type.shape[0] // NUM_STAGES
    tiles, stride = _tiles(M, N, CONSUMERS * ROWS, BLOCK_N)
    done = 0  # the ring's steps before this tile's (the producer's count)
    for tile in range(gl.program_id(0), tiles, stride):
        off_m, off_n = _tile_position(tile, M, N, CONSUMERS * ROWS, BLOCK_N, GROUP_M)
        done = _consume_tile(
            cid, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, off_m, off_n, done, M, N, K,
            stride_cm, SCALING, CHAINED,
        )  # fmt: skip


@gluon.jit
def _consume_tile(
    cid: gl.constexpr,
    a_smem,
    b_smem,
    ready,
    empty,
    c_ptr,
    scale_a_ptr,
    scale_b_ptr,
    off_m,
    off_n,
    done,
    M,
    N,
    K,
    stride_cm,
    SCALING: gl.constexpr,
    CHAINED: gl.constexpr,
):
    """One tile's products and epilogue, its steps the ring's done, done + 1, ...; the ring's count
    after them."""
    NUM_STAGES: gl.constexpr = b_smem.type.shape[0]
    BLOCK_N: gl.constexpr = b_smem.type.shape[1]
    BLOCK_K: gl.constexpr = b_smem.type.shape[2]
    CONSUMERS: gl.constexpr = a_smem.type.shape[0] // NUM_STAGES
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
    steps = gl.cdiv(K, BLOCK_K)
    rows = off_m + cid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    if SCALING == 3:  # a step's scales: its block of K's, of the tile's rows and its block of N
        gl.static_assert(BLOCK_K == 128 and BLOCK_N == 128, "blockwise: a step one block of K, a tile of N")
        scale_rows = scale_a_ptr + rows.to(gl.int64) * steps
        scale_block = scale_b_ptr + off_n // BLOCK_N
    if CHAINED:
        for ki in range(steps):
            stage = (done + ki) % NUM_STAGES
            mbarrier.wait(ready.index(stage), ((done + ki) // NUM_STAGES) & 1)
            acc = warpgroup_mma(
                a_smem.index(CONSUMERS * stage + cid), b_smem.index(stage).permute((1, 0)), acc, is_async=True
            )
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if ki > 0:
                mbarrier.arrive(empty.index((done + ki - 1) % NUM_STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        # each step's product waited for and promoted (CUTLASS's fp8 promotion does the same):
        # the other consumer warpgroup's products run on the tensor cores under this one's adds
        zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
        for ki in range(steps):
            stage = (done + ki) % NUM_STAGES
            mbarrier.wait(ready.index(stage), ((done + ki) // NUM_STAGES) & 1)
            part = warpgroup_mma(
                a_smem.index(CONSUMERS * stage + cid),
                b_smem.index(stage).permute((1, 0)),
                zero,
                use_acc=False,
                is_async=True,
            )
            if SCALING == 3:  # loaded while the product runs
                scale = gl.load(scale_rows + ki, mask=rows < M, other=0.0)
                scale = scale * gl.load(scale_block + ki * gl.cdiv(N, BLOCK_N))
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            if ki > 0:
                mbarrier.arrive(empty.index((done + ki - 1) % NUM_STAGES), count=1)
            if SCALING == 3:
                acc += part * scale[:, None]
            else:
                acc += part
    mbarrier.arrive(empty.index((done + steps - 1) % NUM_STAGES), count=1)
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))  # (after the loop: registers)
    if SCALING == 1:
        acc = acc * (gl.load(scale_a_ptr) * gl.load(scale_b_ptr))
    elif SCALING == 2:
        sa = gl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)
        sb = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    gl.store(
        c_ptr + rows[:, None].to(gl.int64) * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mask,
    )
    return done + steps


@gluon.jit
def _scaled_mm_sm90_kernel(
    a_desc,
    b_desc,
    c_ptr,
    scale_a_ptr,
    scale_b_ptr,
    M,
    N,
    K,
    stride_cm,
    SCALING: gl.constexpr,
    CHAINED: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """(a_desc: A (M, K) fp8 in 64 x BLOCK_K boxes; b_desc: B (N, K) in BLOCK_N x BLOCK_K boxes; c_ptr:
    C (M, N), rows stride_cm apart; the scales: one each (SCALING 1), M and N of them (2) or
    blockwise (3); CHAINED: the steps summed in the tensor cores' accumulator; NUM_STAGES: the
    ring's depth; GROUP_M: row tiles a group walks before the next column of tiles; CONSUMERS:
    consumer warpgroups, 64 rows of the tile each, at CONSUMER_REGS registers a thread.)"""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [CONSUMERS * NUM_STAGES, ROWS, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    # fmt: off
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_mma_partition, (0, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                              stride_cm, SCALING, CHAINED, GROUP_M)),
            (_mma_partition, (1, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                              stride_cm, SCALING, CHAINED, GROUP_M)),
            (_mma_partition, (2, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                              stride_cm, SCALING, CHAINED, GROUP_M)),
            (_load_partition, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, GROUP_M)),
        ], [CONSUMER_WARPS, CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (0, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                              stride_cm, SCALING, CHAINED, GROUP_M)),
            (_mma_partition, (1, a_smem, b_smem, ready, empty, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                              stride_cm, SCALING, CHAINED, GROUP_M)),
            (_load_partition, (a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K, GROUP_M)),
        ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    # fmt: on
