"""Attention backward, the host side: the launches of the three kernels in ``bwd_kernels`` (delta,
dK/dV, dQ), the tuners of the two main ones, and the backward itself (``attention_bwd``, and
``attention_bwd_into`` for gradients the caller allocated).

A backward call poses each main kernel's tuner the problem it runs: its inputs by name, the
gradients it writes, the scores and the packed batch. The dK/dV kernel also writes dq when dq is
accumulated with atomics (``deterministic=False``): into an fp32 accumulator that its run zeroes
first and scales into dq after. Each gate compares against autograd's gradients through the
plain-PyTorch reference, on a calibration problem whose o, lse and delta the forward and the delta
kernel compute first.
"""

from __future__ import annotations

import functools
import logging

import torch

from tritonkit import tuning
from tritonkit._launch import Launch, cdiv, ensure_allocator, scratch
from tritonkit._runtime import interpret
from tritonkit.ops.attention import fwd
from tritonkit.ops.attention.bwd_kernels import (
    CONFIGS,
    DELTA_BLOCK_M,
    KERNELS,
    _attn_bwd_delta_kernel,
    _attn_bwd_dkdv_kernel,
    _attn_bwd_dq_kernel,
    _prune,
    default_config,
)
from tritonkit.ops.attention.common import (
    Packed,
    Scores,
    _block_d,
    attention_reference,
    batch_runs,
    calibration_inputs,
    calibration_scores,
    empty_in_layout,
    grid_lengths,
    per_sequence,
    problem_runs,
    sequence_args,
    tuning_key,
)

# ---------------------------------------------------------------- launches


def _delta_launches(o, do, dlse, delta) -> list[Launch]:
    """The delta kernel's launches: every query row of (B, H, Sq) views (a packed batch's are (1, H,
    T): delta needs no sequence bounds), a launch a run of batches (``batch_runs``)."""
    batch, heads, seq_q, head_dim = o.shape
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": _block_d(head_dim),
        "HAS_DLSE": dlse is not None,
        "BLOCK_M": DELTA_BLOCK_M,
        "num_warps": 4,
    }
    launches = []
    for b0, b1 in batch_runs(batch, heads):
        run = [t if t is None else t[b0:b1] for t in (o, do, dlse, delta)]  # dlse None: HAS_DLSE off
        args = (*run, *o.stride()[:3], *do.stride(), heads, seq_q)
        grid = (cdiv(seq_q, DELTA_BLOCK_M), (b1 - b0) * heads)
        launches.append(Launch("bwd delta", _attn_bwd_delta_kernel, args, meta, grid=grid))
    return launches


def _problem(
    q,
    k,
    v,
    do,
    lse,
    delta,
    scores: Scores,
    packed: Packed | None = None,
    *,
    dk=None,
    dv=None,
    dq=None,
    dq_acc=None,
) -> dict:
    """A backward call as a main kernel's launches and tuner see it: the inputs and gradients as
    the kernels take them ((B, H, S, ...), or a packed batch's (1, H, T, ...) views), by name. A
    dK/dV problem has dk and dv, and dq with its fp32 accumulator ``dq_acc`` when it accumulates dq
    with atomics; a dQ problem has dq."""
    return {
        "q": q,
        "k": k,
        "v": v,
        "do": do,
        "lse": lse,
        "delta": delta,
        "dk": dk,
        "dv": dv,
        "dq": dq,
        "dq_acc": dq_acc,
        "scores": scores,
        "packed": packed,
    }


def _main_launches(kernel: str, problem: dict, config: dict) -> list[Launch]:
    """The launch of the dK/dV kernel (``kernel`` "dkdv": writes dk and dv, and adds into the dq
    accumulator where the problem has one) or of the dQ kernel ("dq": writes dq); a launch a run of
    batches where batch x heads pass the grid's second dimension (``problem_runs``)."""
    if len(runs := problem_runs(problem, problem["q"].shape[1])) > 1:
        return [launch for run in runs for launch in _main_launches(kernel, run, config)]
    q, k, v, do, lse, delta = (problem[name] for name in ("q", "k", "v", "do", "lse", "delta"))
    scores, packed = problem["scores"], problem["packed"]
    _, heads, _, head_dim = q.shape
    heads_kv = k.shape[1]
    shown, config = config, dict(config)
    batch, seq_q, seq_k, cu, score_args, score_meta = sequence_args(
        scores, packed, q.shape[0], q.shape[2], k.shape[2], lse
    )
    tma_dq = config.pop("TMA_DQ", False)
    if kernel == "dkdv":
        dk, dv, dq_acc = problem["dk"], problem["dv"], problem["dq_acc"]
        score_meta["ATOMIC_DQ"] = dq_acc is not None
        # the bulk reduction: on a GPU, to a contiguous accumulator whose rows a TMA coordinate reaches
        tma_dq = tma_dq and dq_acc is not None and not interpret() and dq_acc.numel() // head_dim < 2**31
        # without ATOMIC_DQ dk stands in for the accumulator, never written through: the kernel packs
        # its pointer into a tuple of shared arguments, which in Triton 3.6 cannot hold a None
        grads = (dk, dv, dk if dq_acc is None else dq_acc)
        outputs = [(dk, 3), (grads[2], 3)]
    else:
        grads = (problem["dq"],)
        outputs = [(grads[0], 3)]
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": _block_d(head_dim),
        **score_meta,
        "BLOCK_M": config.pop("BLOCK_M"),
        "BLOCK_N": config.pop("BLOCK_N"),
        "EXACT_DOT_IN_FP32": interpret(),
        **({"TMA_DQ": tma_dq} if kernel == "dkdv" else {}),
        **config,
    }
    if tma_dq:
        ensure_allocator()
    strides = [
        per_sequence(t.stride()[:rank], packed)
        for t, rank in ((q, 4), (k, 4), (v, 4), (do, 4), (lse, 2), *outputs)
    ]
    args = (
        q,
        k,
        v,
        do,
        lse,
        delta,
        *grads,
        *cu,
        *(s for group in strides for s in group),
        heads_kv if kernel == "dkdv" else heads,
        heads // heads_kv,
        seq_q,
        seq_k,
        *score_args,
        scores.scale,
    )
    if kernel == "dkdv":
        grid = (cdiv(seq_k, meta["BLOCK_N"]), batch * heads_kv)
        return [Launch("bwd dk dv", _attn_bwd_dkdv_kernel, args, meta, shown, grid)]
    grid = (cdiv(seq_q, meta["BLOCK_M"]), batch * heads)
    return [Launch("bwd dq", _attn_bwd_dq_kernel, args, meta, shown, grid)]


# ---------------------------------------------------------------- tuning


def _calibration(kernel: str, problem: dict, config: dict) -> dict:
    """A small seeded dense problem of the call's kind for ``kernel``'s gate: q, k, v and dO of the
    forward's calibration shape, o and the lse from the forward (on its untuned tile), delta from
    the delta kernel; the gradients the kernel writes allocated (the gate poisons them)."""
    from tritonkit.testing import generator, random_tensor

    atomic = problem["dq_acc"] is not None
    key = tuning_key(problem["q"], problem["k"], problem["scores"], problem["packed"])
    device = problem["q"].device
    q, k, v = calibration_inputs(key, config, device)
    scores = calibration_scores(problem["scores"], config)
    do = random_tensor(q.shape, q.dtype, device, generator=generator(13))
    o, lse = fwd.attention_fwd(q, k, v, scores, config=fwd._default(key))
    delta = torch.empty(lse.shape, dtype=torch.float32, device=device)
    for launch in _delta_launches(o, do, None, delta):
        launch.run()
    if kernel == "dq":
        return _problem(q, k, v, do, lse, delta, scores, dq=torch.empty_like(q))
    dq, dq_acc = (
        (torch.empty_like(q), torch.empty(q.shape, dtype=torch.float32, device=device))
        if atomic
        else (None, None)
    )
    return _problem(
        q, k, v, do, lse, delta, scores, dk=torch.empty_like(k), dv=torch.empty_like(v), dq=dq, dq_acc=dq_acc
    )


def _gradients_reference(problem: dict) -> dict:
    """dq, dk and dv of a dense problem: autograd's through the plain-PyTorch reference, with dO as
    the output's upstream gradient (the gate runs inside the backward, where autograd is off)."""
    if problem["packed"] is not None:
        raise ValueError("the backward's problem reference takes dense problems (calibration problems are)")
    with torch.enable_grad():
        inputs = [problem[name].detach().requires_grad_() for name in ("q", "k", "v")]
        o = attention_reference(*inputs, **problem["scores"]._asdict())
        dq, dk, dv = torch.autograd.grad(o, inputs, problem["do"])
    return {"dq": dq, "dk": dk, "dv": dv}


class _DkDvTuned(tuning.Tuned):
    """The dK/dV kernel's tuned kernel: the scaffolding's, with a run that, where the problem
    accumulates dq with atomics, zeroes the accumulator before the launch and writes dq, its sum
    times the scale, after it (what computes the problem's dq, for the gate, the timing and the
    call alike)."""

    def run(self, problem: dict, config: dict) -> None:
        dq_acc = problem["dq_acc"]
        if dq_acc is not None:
            dq_acc.zero_()
        super().run(problem, config)
        if dq_acc is not None:
            problem["dq"].copy_(dq_acc.mul_(problem["scores"].scale))


_TUNERS = {
    kernel: tuning.Tuner(
        f"attention_bwd_{kernel}",
        CONFIGS[kernel],
        default=lambda key, kernel=kernel: default_config(
            key["head_dim"], key.get("dq") == "atomic", key.get("window") == "none" and not key.get("softcap")
        )[kernel],
        prune=lambda config, key, kernel=kernel: _prune(kernel, config, key),
        sources=(_attn_bwd_dkdv_kernel if kernel == "dkdv" else _attn_bwd_dq_kernel,),
    )
    for kernel in KERNELS
}
_TUNED = {
    kernel: (_DkDvTuned if kernel == "dkdv" else tuning.Tuned)(
        _TUNERS[kernel],
        launches=functools.partial(_main_launches, kernel),
        calibrate=functools.partial(_calibration, kernel),
        reference=_gradients_reference,
        outputs=("dk", "dv", "dq") if kernel == "dkdv" else ("dq",),
    )
    for kernel in KERNELS
}


# ---------------------------------------------------------------- the backward

log = logging.getLogger("tritonkit")

# Whether a backward the sm_90 Gluon kernel takes (``bwd_sm90.supports``) runs there: with
# ``deterministic=False`` always; deterministic, at the head dims named, without GQA and with it. On the H200
# (bf16, at 6ea5362, `python benchmarks/attention_bwd_sm90.py OUT.json --defaults --skip-triton`;
# docs/perf-notes/attention-backward-sm90.md), against cuDNN: free 0.80-0.96x, past this file's kernels
# at every shape; deterministic 0.75-0.93x at D = 128, where the Triton kernels' table has 0.68-0.83x,
# and 0.53-0.58x at D = 64 (0.67-0.77x with shared_dq, its default since) against their 0.81-0.83x.
# With GQA, deterministic, a program a query head (bwd_sm90.Config.per_query_head): 0.85x cuDNN at
# the Llama-3-8B decoder layer's attention (GQA 32/8, causal, S = 4096, B = 2; q, k and v strided
# views of one QKV projection), 0.94x causal and 0.85x full at (2, 32/8, 8192, 128), where the
# Triton kernels ran at 0.28-0.34x untuned (at af34fdd, `python benchmarks/attention_bwd_sm90.py
# OUT.json --layer --defaults` and `... --defaults --shape 2,32,8,8192,128`), and tuned inside the
# model step at 0.57x (2.8 ms a layer against cuDNN's 1.6, `tritonkit bench model`, at 9c8575e).
# At D = 64 with GQA (2, 32/8, 4096, 64): 0.71x full and 0.77x causal, against the Triton kernels'
# 0.44x and 0.50x in the same run (`... --defaults --shape 2,32,8,4096,64`, at 347c830). Since the fp32 P
# and turns of two query blocks at D = 64 without GQA too: on an H100 at ac90bf1, 0.88x full and 0.96x
# causal at (4, 32, 4096, 64), 0.93x and 0.96x at (2, 32/8, 4096, 64) (`... --defaults --shape
# 4,32,32,4096,64 --shape 2,32,8,4096,64`), where the Triton kernels' tuned table on the H200 has 0.82x
# both masks; with 128-row steps (bwd_sm90.CONFIGS) 0.94x and 0.97x full, 0.97x causal (at 548605e).
SM90_BACKWARD = True
SM90_BACKWARD_DETERMINISTIC: tuple[int, ...] = (64, 128)  # kernel head dims, without GQA
SM90_BACKWARD_DETERMINISTIC_GQA: tuple[int, ...] = (64, 128)
# Packed batches (``bwd_sm90``'s VARLEN: each sequence's key blocks over the longest one's grid, dK and
# dV stored row by row) on the Gluon kernel too, in both modes.
SM90_BACKWARD_PACKED = True
# The head dims other than a kernel's own that take the Gluon kernel of the next one up, its boxes
# padded with zeros, as the forward runs them (``bwd_sm90.PADDED_HEAD_DIMS``, multiples of 8 up to
# 128, on the D = 64 and 128 kernels; ``bwd_sm90.WIDE_HEAD_DIMS``, 136-248, on D = 256's): every
# multiple of 8. On an H100 at ca940e0 (`python benchmarks/attention_bwd_sm90.py OUT.json --defaults
# --shape 2,32,8,4096,96 --shape 4,32,32,4096,80 --shape 4,32,32,4096,32`; results/h100/history/
# attention-bwd-sm90-padded-ca940e0.json), against cuDNN, full / causal, free and deterministic: D = 96
# (GQA 32/8) 1.05x / 1.13x and 1.03x / 1.00x, where the Triton kernels ran 0.47x / 0.43x and 0.29x /
# 0.33x; D = 80 0.94x / 1.03x and 0.99x / 0.98x (Triton 0.48x / 0.48x, 0.31x / 0.33x); D = 32, half
# the D = 64 kernel's products zeros, 0.94x / 1.02x and 0.95x / 0.97x (Triton 0.86x / 0.91x, 0.89x /
# 0.72x). Their gpu cases (tests/test_attention_bwd_sm90_padded.py) passed on that H100.
SM90_BACKWARD_PADDED: tuple[int, ...] = tuple(range(8, 257, 8))
# D = 256 on the Gluon kernel whose two warpgroups split a step's products (``bwd_sm90_wide``), in both
# modes. On the same H100 (`... --defaults --shape
# 2,16,8,4096,256 --shape 8,16,16,1024,256`, results/h100/history/attention-bwd-sm90-d256-ca940e0.json),
# full / causal: free 1.06x / 1.08x cuDNN at (2, 16/8, 4096) and 1.08x / 1.02x at (8, 16, 1024),
# deterministic 0.73x / 0.73x and 0.82x / 0.80x, where the Triton kernels ran 0.24-0.38x.
SM90_BACKWARD_WIDE = True


def sm90_scores(scores: Scores, seq_q: int, seq_k: int) -> Scores:
    """The scores the sm_90 Gluon backward runs for ``scores`` over (seq_q, seq_k) lengths (a packed
    batch's longest): its sides that cut nothing dropped (``Scores.within``), and a window's left
    side alone given a right side that cuts nothing either (max(seq_q, seq_k) - 1 keys past the
    diagonal, either alignment), since the kernel's lower bound comes with an upper one: the
    deterministic mode's turns descend from the last key block a query block sees."""
    scores = scores.within(seq_q, seq_k)
    left, right = scores.window
    if left >= 0 and right < 0 and not scores.causal:
        return scores._replace(window=(left, max(seq_q, seq_k) - 1))
    return scores


# Windows of any width take the Gluon backward: the narrow ones ran faster than the Triton kernels at
# every width timed, on an H100 (at c4c0611, causal, `benchmarks/attention_bwd_sm90.py --window W,0
# --defaults`), free / deterministic: 1.49x / 1.24x at 32 keys, 1.98x / 1.64x at 128 and 2.37x /
# 1.91x at 256 at (2, 32/8, 4096, 128), 1.53x / 1.26x at 128 and 1.54x / 1.24x at 256 at (4, 32, 4096,
# 64) (results/h100/history/attention-bwd-sm90-narrow-windows-c4c0611.json), and their gpu cases
# (tests/test_attention_bwd_sm90_windows.py: two-sided, top-left, ragged, a soft cap) passed on an
# H100 at ca940e0.
def sm90_takes(q, k, v, scores: Scores, packed: Packed | None, deterministic: bool = True) -> bool:
    """Whether the sm_90 Gluon backward (``bwd_sm90``) computes this call (a packed batch's as (1, H,
    T, D) views): natively compiled, on an sm_90 GPU, within what it supports (either causal
    alignment, soft caps, windows of any width, ``sm90_scores``, the padded head dims
    SM90_BACKWARD_PADDED names), and switched on for its mode (and, deterministic,
    for its kernel's head dim, with GQA or not; packed, SM90_BACKWARD_PACKED). Everything else takes
    the Triton kernels."""
    if interpret() or not q.is_cuda or (packed is not None and not SM90_BACKWARD_PACKED):
        return False
    if not scores.scale > 0:
        return False
    from tritonkit.ops.attention import bwd_sm90

    if not bwd_sm90.supports(q, k, v, packed):
        return False
    kernel_dim = bwd_sm90.kernel_head_dim(q.shape[3])
    if kernel_dim != q.shape[3] and q.shape[3] not in SM90_BACKWARD_PADDED:
        return False
    if kernel_dim == 256:  # the wide kernel (bwd_sm90_wide), both modes
        return SM90_BACKWARD_WIDE
    if deterministic:
        dims = SM90_BACKWARD_DETERMINISTIC_GQA if q.shape[1] != k.shape[1] else SM90_BACKWARD_DETERMINISTIC
        return kernel_dim in dims
    return SM90_BACKWARD


def attention_bwd_into(
    do,
    q,
    k,
    v,
    o,
    lse,
    dlse,
    dq,
    dk,
    dv,
    scores: Scores,
    packed: Packed | None = None,
    deterministic: bool = True,
    config: dict | None = None,
) -> None:
    """Write attention's gradients into ``dq``, ``dk`` and ``dv`` (q's, k's and v's shapes and dtype).
    ``o`` and ``lse`` are the forward's (o laid out as q, the lse contiguous), ``dlse`` the upstream
    gradient of the lse or None. Arguments are the forward's, already validated: (B, H, S, D)
    tensors, or with ``packed`` (T, H, D) tensors and a (H, T) lse. ``config`` ({"dkdv": ...,
    "dq": ...}) overrides the tuned launch configs. ``deterministic=False`` accumulates dq in the
    dK/dV kernel with fp32 atomics instead of running the dQ kernel, which recomputes the scores
    and dP: two matmuls of five fewer, and dq's last bits vary from run to run."""
    if k.numel() == 0 or q.numel() == 0:  # no keys (every row sees none), or no query rows
        for grad in (dq, dk, dv):
            grad.zero_()
        return
    if dlse is not None:
        dlse = dlse.contiguous()  # the delta kernel reads it by row index (a sum's gradient is expanded)
    shape = tuple(q.shape)
    if packed is not None:  # the kernels take (1, H, T, D) views of (T, H, D) and (1, H, T) of (H, T)
        do, q, k, v, o, dq, dk, dv = (t.transpose(0, 1).unsqueeze(0) for t in (do, q, k, v, o, dq, dk, dv))
        lse, dlse = lse.unsqueeze(0), dlse if dlse is None else dlse.unsqueeze(0)
    delta = scratch(lse.shape, torch.float32, q.device)
    for launch in _delta_launches(o, do, dlse, delta):
        launch.run()
    if config is None and sm90_takes(q, k, v, scores, packed, deterministic):
        from tritonkit.ops.attention import bwd_sm90

        log.debug("tritonkit: attention backward %s on the sm_90 Gluon kernel", shape)
        # a packed batch's offsets are the window's sides: each sequence adds its own alignment
        lengths = grid_lengths(q, k, packed)
        (upper_offset, lower_offset, *_), flags = sm90_scores(scores, *lengths).kernel_args(
            *(lengths if packed is None else (0, 0))
        )
        bwd_sm90.attention_bwd_sm90(
            do, q, k, v, lse, delta, dq, dk, dv, scale=scores.scale, causal=flags["IS_CAUSAL"],
            upper_offset=upper_offset, lower_offset=lower_offset if flags["HAS_LOWER"] else None,
            softcap=scores.softcap, deterministic=deterministic, packed=packed,
        )  # fmt: skip
        return
    log.debug("tritonkit: attention backward %s on the Triton kernels", shape)
    # the dK/dV kernel writes dk and dv through one set of strides, dk's: a dv laid out otherwise (k
    # and v in different layouts) is written in dk's layout first, then copied
    given_dv = dv
    if dv.stride() != dk.stride():
        dv = torch.empty_strided(dk.shape, dk.stride(), dtype=dv.dtype, device=dv.device)
    if deterministic:
        problems = {
            "dkdv": _problem(q, k, v, do, lse, delta, scores, packed, dk=dk, dv=dv),
            "dq": _problem(q, k, v, do, lse, delta, scores, packed, dq=dq),
        }
    else:  # the accumulator is zeroed by each run of the dK/dV kernel (tuning runs too)
        dq_acc = scratch(q.shape, torch.float32, q.device)
        problems = {
            "dkdv": _problem(q, k, v, do, lse, delta, scores, packed, dk=dk, dv=dv, dq=dq, dq_acc=dq_acc)
        }
    configs = config or _configs(problems, q, k, scores, packed)
    for kernel, problem in problems.items():
        _TUNED[kernel].run(problem, configs[kernel])
    if dv is not given_dv:
        given_dv.copy_(dv)


def _configs(problems: dict, q, k, scores: Scores, packed: Packed | None) -> dict:
    """The tuned (or default) config of each main kernel that ``problems`` name; dK/dV's key says
    when it accumulates dq with atomics (its candidates then compete at that work)."""
    key = tuning_key(q, k, scores, packed)
    signature = (q.shape, k.shape, q.dtype, q.device, scores, packed and packed[2:])
    configs = {}
    for kernel, problem in problems.items():
        atomic = problem["dq_acc"] is not None
        configs[kernel], _ = _TUNED[kernel].choose(
            key | {"dq": "atomic"} if atomic else key, problem, signature=(*signature, atomic)
        )
    return configs


def attention_bwd(
    do,
    q,
    k,
    v,
    o,
    lse,
    dlse,
    scores: Scores,
    config: dict | None = None,
    packed: Packed | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of attention, allocated here (see :func:`attention_bwd_into`)."""
    dq, dk, dv = (empty_in_layout(t) for t in (q, k, v))
    attention_bwd_into(do, q, k, v, o, lse, dlse, dq, dk, dv, scores, packed, deterministic, config)
    return dq, dk, dv


def _inspect_launches(shape: tuple, dtype: torch.dtype, config: dict | None, scores: Scores) -> list[Launch]:
    """The backward's three launches for a benchmark shape (B, Hq, Hkv, S, D), for ``tritonkit
    inspect``; ``config`` ({"dkdv": ..., "dq": ...}, either or both) over the defaults."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    q = torch.empty((batch, heads_q, seq, head_dim), dtype=dtype, device="meta")
    kv = torch.empty((batch, heads_kv, seq, head_dim), dtype=dtype, device="meta")
    rows = torch.empty((batch, heads_q, seq), dtype=torch.float32, device="meta")
    configs = default_config(head_dim)
    for kernel in KERNELS:
        configs[kernel] |= (config or {}).get(kernel, {})
    problem = _problem(q, kv, kv, q, rows, rows, scores, dk=kv, dv=kv, dq=q)
    return [
        *_delta_launches(q, q, None, rows),
        *(launch for kernel in KERNELS for launch in _main_launches(kernel, problem, configs[kernel])),
    ]
