"""Context-parallel (ring) attention over torch.distributed: each rank holds a shard of the sequence.

Maths. Attention over keys split into blocks B_1..B_W merges exactly: with each block's output o_j
and log-sum-exp lse_j for a query row, lse = log sum_j exp(lse_j) and o = sum_j exp(lse_j - lse) o_j.
So a rank attends its queries to the key/value block in hand, passes the block on around the ring
(W - 1 hops) and merges the partial results as they come (``tritonkit.ops.attention.merge``). The
backward is FlashAttention-2's per block, with the merged o and lse: P = exp(S - lse) and delta =
rowsum(dO * O) are the full row's, so each block's dq, dk and dv are exactly its share. dq stays on
its rank; dk and dv travel with their block and reach its owner after one more hop.

Causal sharding is load-balanced: the sequence is cut into 2W chunks and rank i holds chunks i and
2W - 1 - i, so every rank has one early and one late chunk and the same work. Query chunk a sees
key chunk b whole if b < a, causally (its diagonal) if b == a, not at all if b > a.

Work per rank and step: the attention FLOPs of its queries against one block (half of them skipped
or causal when causal), and one block of K and V sent and received (2 B Hkv S_local D elements),
which the send and receive of the next block overlap with the attention of the one in hand.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tritonkit.distributed.groups import (
    dtype_code,
    float_code,
    gather_facts,
    process_group,
    same_on_every_rank,
)
from tritonkit.opdef import first_derivative_only
from tritonkit.ops.attention.bwd import attention_bwd
from tritonkit.ops.attention.common import Scores, softmax_scale, validate_qkv
from tritonkit.ops.attention.fwd import attention_fwd
from tritonkit.ops.attention.merge import merge_attention

SUMS_TAG = 2  # point-to-point tags: a block's K and V take 0 and 1, its gradient sums 2 and 3
MAX_DIMS = 8  # of a shard whose shape unshard_sequence compares across ranks


# ---------------------------------------------------------------- groups, shards and the ring


def _chunks(rank: int, world: int, causal: bool) -> list[int]:
    """The sequence chunks a rank holds, in order: of 2W chunks causal (load-balanced), else of W."""
    return [rank, 2 * world - 1 - rank] if causal else [rank]


def shard_sequence(x: torch.Tensor, dim: int, group=None, causal: bool = False) -> torch.Tensor:
    """This rank's shard of ``x`` along ``dim`` (contiguous): chunk r of W, or with ``causal``
    chunks r and 2W - 1 - r of 2W, the load-balanced layout ``ring_attention`` expects. The length
    must be a multiple of W (2W causal): pad the sequence first (and mask the padding) otherwise."""
    _check_dim(x, dim)
    group = process_group(group, "ring attention")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = 2 * world if causal else world
    length = x.shape[dim]
    if length % parts:
        raise ValueError(
            f"the sequence ({length} along dim {dim}) must be a multiple of {parts} to shard "
            f"over {world} ranks{' causally' if causal else ''}; pad it to "
            f"{-(-length // parts) * parts}"
        )
    pieces = x.chunk(parts, dim)
    return torch.cat([pieces[i] for i in _chunks(rank, world, causal)], dim).contiguous()


def _check_dim(x, dim) -> None:
    """x a tensor and dim one of its dims (negative from the end), else TypeError or ValueError."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}"
        )


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` (equal shapes), on every rank. Backward: a shard's gradient is the sum of
    what each rank's use of it gave (an all-reduce), this rank's part of it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, x, group=group)
        return tuple(shards)

    @staticmethod
    def backward(ctx, *grads):
        stacked = torch.stack(grads).contiguous()
        dist.all_reduce(stacked, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def unshard_sequence(x: torch.Tensor, dim: int, group=None, causal: bool = False) -> torch.Tensor:
    """The whole sequence from every rank's shard along ``dim`` (the inverse of ``shard_sequence``,
    gathered on every rank); differentiable. Shards of other shapes or dtypes on other ranks raise
    the same ValueError on every rank (gloo aborted a process on them)."""
    group = process_group(group, "ring attention")
    world = dist.get_world_size(group)
    try:  # (an error on one rank alone would leave the others waiting in the exchange)
        _check_dim(x, dim)
        if x.dim() > MAX_DIMS:
            raise ValueError(f"x must have at most {MAX_DIMS} dims, got {x.dim()}")
        dim %= x.dim()
        local_error = ""
        facts = [
            x.dim(),
            dim,
            dtype_code(x.dtype),
            _backward_follows(x),
            *x.shape,
            *[0] * (MAX_DIMS - x.dim()),
        ]
    except (TypeError, ValueError) as error:
        local_error, facts = f"{type(error).__name__}: {error}", [0] * (4 + MAX_DIMS)
    rows = gather_facts(local_error, facts, "unshard_sequence", group)
    names = (
        "number of dims",
        "dim",
        "dtype",
        "gradient (requires_grad)",
        *(f"size of dim {d}" for d in range(MAX_DIMS)),
    )
    same_on_every_rank(rows, names, "unshard_sequence", "every rank must hold an equal shard")
    shards = _AllGather.apply(x.contiguous(), group)
    parts = 2 * world if causal else world
    ordered = [None] * parts
    for rank, shard in enumerate(shards):
        indices = _chunks(rank, world, causal)
        for index, piece in zip(indices, shard.chunk(len(indices), dim), strict=True):
            ordered[index] = piece
    return torch.cat(ordered, dim)


def _backward_follows(*tensors) -> int:
    """1 where autograd records the call: its backward exchanges gradients, so every rank must run
    one or none (a rank alone in a collective waits forever)."""
    return int(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _check_across_ranks(q, k, v, causal: bool, scale, group) -> float:
    """Validate the shards and the scale locally, then agree across ranks: every rank raises the
    same error. The softmax scale to use (the same on every rank: a scale given on one rank alone
    was used there alone)."""
    try:
        validate_qkv(q, k, v)
        scale = softmax_scale(scale, q.shape[-1])
        local_error = ""
        facts = [
            *q.shape,
            k.shape[1],
            k.shape[2],
            int(causal),
            dtype_code(q.dtype),
            _backward_follows(q, k, v),
            float_code(scale),
        ]
    except (TypeError, ValueError) as error:
        local_error = f"{type(error).__name__}: {error}"
        facts = [0] * 10
    rows = gather_facts(local_error, facts, "ring_attention", group)
    names = (
        "batch", "query heads", "sequence shard", "head dim", "key/value heads", "key/value shard",
        "causal", "dtype", "gradient (any of q, k, v requiring grad)", "softmax scale",
    )  # fmt: skip
    same_on_every_rank(rows, names, "ring_attention", "every rank must hold an equal shard")
    if causal and k.shape[2] != q.shape[2]:  # (the causal chunks of keys are q's chunks' positions)
        raise ValueError(
            f"ring_attention: causal shards of q and k must be as long, got {q.shape[2]} and {k.shape[2]}"
        )
    if causal and q.shape[2] % 2:
        raise ValueError(
            f"ring_attention: a causal shard holds two equal chunks (shard_sequence(..., "
            f"causal=True)); its length {q.shape[2]} is odd"
        )
    return scale


class _Ring:
    """The ring: blocks go to rank + 1 and come from rank - 1 (global ranks of the group)."""

    def __init__(self, group):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.send_to = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.recv_from = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def start(self, tensors: list[torch.Tensor], tag: int = 0):
        """Send ``tensors`` on and receive the previous rank's like them; (received, requests). Each
        tensor has its own tag from ``tag`` on: exchanges in flight together (a block and the sums
        of the one before) never match each other's messages."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [
            dist.P2POp(dist.irecv, t, self.recv_from, self.group, tag + i) for i, t in enumerate(received)
        ]
        return received, dist.batch_isend_irecv(ops)


def _calls(rank: int, owner: int, causal: bool) -> list[tuple[int | None, int | None, bool]]:
    """The attention calls of this rank's queries against ``owner``'s block: (query chunk, key chunk,
    masked) each, a chunk by its place in the shard or block (None: all of it). Causal shards hold
    chunks r and 2W - 1 - r of 2W, so against its own block a rank's first chunk meets its own
    diagonal and its second chunk both key chunks, the last on the diagonal (one bottom-right
    causal call); a lower rank's block is seen whole by both query chunks through its first chunk,
    unmasked; a higher rank's block only by the second query chunk, whole, unmasked. Two calls a
    step at most, one past the first step."""
    if not causal:
        return [(None, None, False)]
    if owner == rank:
        return [(0, 0, True), (1, None, True)]
    return [(None, 0, False)] if owner < rank else [(1, None, False)]


def _rows(place: int | None, chunk: int) -> slice:
    """The slice of a shard (or block) along the sequence that a chunk's place names."""
    return slice(None) if place is None else slice(place * chunk, (place + 1) * chunk)


def _ring_forward(q, k, v, scale: float, causal: bool, ring: _Ring):
    """(o, lse) of this rank's queries against every rank's keys."""
    places = 2 if causal else 1
    chunk = q.shape[2] // places
    shape = (*q.shape[:2], chunk, q.shape[3])
    o = [torch.zeros(shape, dtype=torch.float32, device=q.device) for _ in range(places)]  # per query chunk
    lse = [torch.full(shape[:3], -float("inf"), dtype=torch.float32, device=q.device) for _ in range(places)]
    block, owner = [k, v], ring.rank
    for step in range(ring.world):
        incoming, requests = ring.start(block) if step < ring.world - 1 else (None, [])
        for rows, keys, masked in _calls(ring.rank, owner, causal):
            part, part_lse = attention_fwd(
                q[:, :, _rows(rows, chunk)],
                block[0][:, :, _rows(keys, chunk)],
                block[1][:, :, _rows(keys, chunk)],
                Scores(scale, masked),
            )
            met = range(places) if rows is None else [rows]  # the query chunks the call covered
            for place in met:
                share = _rows(place, chunk) if len(met) > 1 else slice(None)  # its rows of the part
                merge_attention(o[place], lse[place], part[:, :, share], part_lse[:, :, share])
        for request in requests:
            request.wait()
        block, owner = incoming, (owner - 1) % ring.world
    return torch.cat(o, 2).to(q.dtype), torch.cat(lse, 2)


def _ring_backward(do, q, k, v, o, lse, scale: float, causal: bool, ring: _Ring):
    """(dq, dk, dv) of this rank's shards. K and V go on as in the forward; each block's dk and dv
    follow a step behind: a rank adds what it computed for the block in hand to the sums the rank
    before sent for it, and sends those on while it computes the next block. After the last step
    the sums go one hop further, home, with no compute left to hide it: that hop carries them
    rounded to k's and v's dtype, as they would be at home (fp32 sums: twice the bytes of K and V)."""
    chunk = q.shape[2] // (2 if causal else 1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block, owner, sums = [k, v], ring.rank, None  # sums: (received dk and dv, their requests)
    for step in range(ring.world):
        more = step < ring.world - 1
        incoming, requests = ring.start(block) if more else (None, [])
        dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in block)
        for rows, keys, masked in _calls(ring.rank, owner, causal):
            rows, keys = _rows(rows, chunk), _rows(keys, chunk)
            piece = [t[:, :, rows].contiguous() for t in (do, q, o)] + [lse[:, :, rows].contiguous()]
            dq_part, dk_part, dv_part = attention_bwd(
                piece[0],
                piece[1],
                block[0][:, :, keys].contiguous(),
                block[1][:, :, keys].contiguous(),
                piece[2],
                piece[3],
                None,
                Scores(scale, masked),
            )
            dq[:, :, rows] += dq_part
            dk[:, :, keys] += dk_part
            dv[:, :, keys] += dv_part
        if sums is not None:  # what the ranks before computed for this block
            for request in sums[1]:
                request.wait()
            dk += sums[0][0]
            dv += sums[0][1]
        if ring.world > 1:  # the last hop carries finished sums: in the output dtype, half the bytes
            sums = ring.start([dk, dv] if more else [dk.to(k.dtype), dv.to(v.dtype)], tag=SUMS_TAG)
        for request in requests:
            request.wait()
        if more:
            block, owner = incoming, (owner - 1) % ring.world
    if sums is not None:  # this rank's own block, from the rank that saw it last
        for request in sums[1]:
            request.wait()
        dk, dv = sums[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, ring):
        o, lse = _ring_forward(q, k, v, scale, causal, ring)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.causal, ctx.ring = scale, causal, ring
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None
        return o, lse

    @staticmethod
    @first_derivative_only("ring_attention")
    def backward(ctx, do, dlse):
        if dlse is not None or do is None:  # (was dropped without a word: lse non-differentiable)
            raise NotImplementedError("ring_attention has no gradient through its lse: use its output alone")
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do.contiguous(), q, k, v, o, lse, ctx.scale, ctx.causal, ctx.ring)
        return dq, dk, dv, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    group=None,
    return_lse: bool = False,
):
    """Attention over a sequence sharded across the ranks of ``group`` (a process group, a
    one-dimensional DeviceMesh, or None for the default group): q, k and v are this rank's shards,
    (B, H, S_local, D), as ``shard_sequence`` makes them (with ``causal``, its load-balanced
    layout). GQA as in ``flash_attention``. Returns this rank's output shard (and its lse, (B, Hq,
    S_local), with ``return_lse``); differentiable in q, k and v (a gradient through the lse raises).
    Causal shards of q and k are as long. Every rank must call it with equal shards, requiring grad
    on every rank or on none; bad input raises the same ValueError on every rank."""
    group = process_group(group, "ring attention")
    scale = _check_across_ranks(q, k, v, causal, scale, group)
    k, v = k.contiguous(), v.contiguous()  # (their blocks are sent as they lie)
    o, lse = _RingAttention.apply(q, k, v, scale, bool(causal), _Ring(group))
    return (o, lse) if return_lse else o
