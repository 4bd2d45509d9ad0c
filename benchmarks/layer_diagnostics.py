"""Where the decoder layer's training step (``tritonkit bench layer``'s 8b-4k) loses time beyond its
kernels' profile, on the H200: six diagnostics, one a run.

    python benchmarks/layer_diagnostics.py OUT.json protocols [PROVIDERS]
    python benchmarks/layer_diagnostics.py OUT.json sustained [PROVIDERS]
    python benchmarks/layer_diagnostics.py OUT.json matmuls
    python benchmarks/layer_diagnostics.py OUT.json backward
    python benchmarks/layer_diagnostics.py OUT.json gated
    python benchmarks/layer_diagnostics.py OUT.json host [CASES]

``protocols``: the step timed five ways (do_bench as the layer benchmark does, CUDA events with and
without the L2 flush, a sync after each step, one loop of steps), the host's time to issue it, and
under torch.profiler the runtime calls a step makes (a sync or a malloc would show) and the GPU's
idle gaps. ``sustained``: the step's time right after three seconds idle (cool) and through 70 steps
back to back (hot: the H200 at its 700 W cap), with nvidia-smi's clock and power sampled beside it
(OUT.json.PROVIDER.smi.csv); provider ``hybrid`` is tritonkit's norms and attention with cuBLAS's
matmuls (F.linear). ``matmuls``: each of the layer's projections (fwd+bwd and fwd alone) on
tritonkit.linear and on cuBLAS, cool and hot, and five tiles of the linear kernel hot at two of
them. ``backward``: each of the backward's matmul products (dx and dW of three projections, the
MLP's gated dx in one kernel, as two matmuls and each of those apart) hot, in turns, on cuBLAS, on
the tile tritonkit runs and on BACKWARD_TILES. ``gated``: gated_linear's forward at the three
layers' MLP shapes, cool and hot, with its products stored by the one gated kernel or by two plain
matmuls and an elementwise act(g) * u, against cuBLAS's matmuls and torch's SiLU and product.
``host``: tritonkit's layer at each of CASES (comma-separated, default 8b-4k,d64-4k), forward and
step: the host's time to issue it, the GPU idle before each (HOST_REPEATS times, sorted), through
tritonkit's lean launch path and, alternating with it, through Triton's own launch, and under
cProfile the Python calls a step makes and where its host time goes (``finish`` at 0087522 timed the
attention backward's finishing passes). PROVIDERS: comma-separated, of ``bench layer``'s providers
(and ``hybrid``).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import subprocess
import sys
import time
from collections import defaultdict

import torch
from attention_bwd_sm90 import result_header
from torch.nn import functional
from torch.profiler import ProfilerActivity, profile, schedule

import tritonkit
from tritonkit import _launch, tuning
from tritonkit.bench import layer

SHAPE = layer.CASES["8b-4k"]


# One call alone (the layer benchmark's rows take turns, bench.layer.time_in_turns): a step takes
# 10-100 ms, so 500 ms of repetitions give 10-50 steps; 250 ms of warm-up passes a single matmul's
# power-limit onset (bench.timing), not the whole step's (about a second).
WARMUP_MS, REP_MS = 250, 500


def _do_bench_ms(call, tensors: list) -> float:
    """The median ms of ``call`` alone after WARMUP_MS (do_bench, L2 flushed, gradients set to None)."""
    from triton.testing import do_bench

    return do_bench(call, warmup=WARMUP_MS, rep=REP_MS, grad_to_none=tensors, return_mode="median")


def _layer_inputs():
    x, g = layer.make_inputs(SHAPE, torch.bfloat16, "cuda")
    w = layer.make_weights(SHAPE, torch.bfloat16, "cuda")
    return x, g, w, [x, *w]


def _clear(tensors):
    for t in tensors:
        t.grad = None


def _hybrid_layer(x, w):
    """tritonkit's norms and attention, cuBLAS's matmuls (F.linear), the residuals added apart."""
    d = (SHAPE.dim,)
    q, k, v = layer._split_heads(
        functional.linear(tritonkit.rms_norm(x, d, w.attn_norm, layer.EPS), w.qkv), SHAPE
    )
    a = tritonkit.flash_attention(q, k, v, causal=True)
    x2 = x + functional.linear(layer._merge_heads(a), w.out)
    h2 = tritonkit.rms_norm(x2, d, w.mlp_norm, layer.EPS)
    return x2 + functional.linear(
        functional.silu(functional.linear(h2, w.gate)) * functional.linear(h2, w.up), w.down
    )


def _provider(name: str, backend):
    return _hybrid_layer if name == "hybrid" else layer.build(name, SHAPE, backend)


# ---------------------------------------------------------------- protocols


def _events_median(call, tensors, n: int, flush: bool, sync_each: bool, cache) -> float:
    times = []
    torch.cuda.synchronize()
    for _ in range(n):
        _clear(tensors)
        if flush:
            cache.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        if sync_each:
            torch.cuda.synchronize()
        times.append((start, end))
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in times)
    return ms[len(ms) // 2]


def _loop_ms(call, tensors, n: int) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        _clear(tensors)
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def protocols(providers: list[str]) -> dict:
    x, g, w, tensors = _layer_inputs()
    backend = layer.sdpa_backend(SHAPE, torch.bfloat16, "cuda")
    cache = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    result = {}
    for provider in providers:
        fn = _provider(provider, backend)

        def call(fn=fn):
            fn(x, w).backward(g)

        started = time.time()
        _clear(tensors)
        call()
        torch.cuda.synchronize()
        row = {"first_step_s": time.time() - started}
        for _ in range(5):
            _clear(tensors)
            call()
        torch.cuda.synchronize()
        row["do_bench_ms"] = _do_bench_ms(call, tensors)
        row["events_flush_ms"] = _events_median(call, tensors, 20, True, False, cache)
        row["events_noflush_ms"] = _events_median(call, tensors, 20, False, False, cache)
        row["events_sync_each_ms"] = _events_median(call, tensors, 10, True, True, cache)
        row["whole_loop_ms"] = _loop_ms(call, tensors, 20)
        row["host_ms"] = layer.host_ms(call, tensors)
        for _ in range(10):
            _clear(tensors)
            call()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                _clear(tensors)
                call()
            torch.cuda.synchronize()
        api = defaultdict(lambda: [0, 0.0, 0.0])  # calls, ms, longest ms
        kernels = []
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels.append((event.time_range.start, event.time_range.end, event.name))
            elif event.name.startswith(("cuda", "cu")) and not event.name.startswith("cudnn"):
                entry, us = api[event.name], event.time_range.end - event.time_range.start
                entry[0] += 1
                entry[1] += us / 1e3
                entry[2] = max(entry[2], us / 1e3)
        row["api_per_step"] = {
            k: [v[0] / 3, v[1] / 3, v[2]] for k, v in sorted(api.items(), key=lambda i: -i[1][1])
        }
        kernels.sort()
        gaps = sorted(
            (
                (s1 - e0, n0[:70], n1[:70])
                for (_, e0, n0), (s1, _, n1) in zip(kernels, kernels[1:], strict=False)
                if s1 - e0 > 5
            ),
            reverse=True,
        )
        row |= {
            "span_ms": (kernels[-1][1] - kernels[0][0]) / 3e3,
            "busy_ms": sum(e - s for s, e, _ in kernels) / 3e3,
            "kernels_per_step": len(kernels) / 3,
            "gap_ms_over_5us": sum(gap[0] for gap in gaps) / 3e3,
            "top_gaps": gaps[:25],
        }
        print(provider, {k: v for k, v in row.items() if k not in ("top_gaps", "api_per_step")}, flush=True)
        result[provider] = row
        del fn
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- sustained


def _smi(path: str):
    try:
        query = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
        command = ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader", "-lms", "50"]
        return subprocess.Popen(command, stdout=open(path, "w"), stderr=subprocess.STDOUT)
    except OSError as error:
        print("no nvidia-smi:", error)
        return None


def _kernel_ms(prof, steps: int) -> dict:
    totals = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time_total > 0:
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time_total / 1e3 / steps
            entry[1] += 1
    return dict(sorted(totals.items(), key=lambda i: -i[1][0]))


def _profiled_steps(step, steps: int, wait: int, warmup: int, active: int) -> dict:
    """Run ``step`` ``steps`` times under a profiler that records ``active`` of them after ``wait``
    and ``warmup``; their kernels' ms a step (the profiler live throughout: no pause cools the GPU)."""
    with profile(
        # one cycle: a second (past wait + warmup + active steps) added its steps to the first's, whose
        # sums were then divided by ``active`` (the hot rows at c58ad14: 6 steps' kernels over 4)
        activities=[ProfilerActivity.CUDA],
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
    ) as prof:
        for _ in range(steps):
            step()
            prof.step()
        torch.cuda.synchronize()
    return _kernel_ms(prof, active)


def sustained(providers: list[str], out: str) -> dict:
    x, g, w, tensors = _layer_inputs()
    backend = layer.sdpa_backend(SHAPE, torch.bfloat16, "cuda")
    result = {}
    for provider in providers:
        fn = _provider(provider, backend)

        def call(fn=fn):
            fn(x, w).backward(g)

        for _ in range(4):
            _clear(tensors)
            call()
        torch.cuda.synchronize()
        smi = _smi(f"{out}.{provider}.smi.csv")
        time.sleep(3.0)  # idle: the GPU cools below its power cap
        steps = []

        def timed_step(call=call, steps=steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _clear(tensors)
            start.record()
            call()
            end.record()
            steps.append((start, end))

        cool_kernels = _profiled_steps(timed_step, 6, wait=2, warmup=1, active=3)
        hot_kernels = _profiled_steps(timed_step, 70, wait=60, warmup=2, active=4)
        if smi:
            smi.terminate()
        result[provider] = {
            "step_ms": [s.elapsed_time(e) for s, e in steps],
            "cold_kernels": cool_kernels,
            "hot_kernels": hot_kernels,
        }
        print(provider, [round(ms, 2) for ms in result[provider]["step_ms"][:6]], "...",
              [round(ms, 2) for ms in result[provider]["step_ms"][-10:]], flush=True)  # fmt: skip
        del fn
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- matmuls


def _cool_and_hot(call, seconds_hot: float = 1.2, n: int = 30) -> tuple[float, float]:
    """(the fastest of three calls after 1.5 s idle, the median of n after seconds_hot of calls)."""
    torch.cuda.synchronize()
    time.sleep(1.5)
    cool = []
    for _ in range(3):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        cool.append(start.elapsed_time(end))
    return min(cool), _hot(call, seconds_hot, n)


def _hot(call, seconds_hot: float = 1.2, n: int = 30) -> float:
    """The median of n calls after seconds_hot of calls (the H200 at its power cap)."""
    stop = time.time() + seconds_hot
    while time.time() < stop:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    events = []
    for _ in range(n):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        call()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    hot = sorted(s.elapsed_time(e) for s, e in events)
    return hot[len(hot) // 2]


def _tiles(specs) -> dict:
    """The linear kernel's TMA tiles by name, from (rows, columns, warps, stages, persistent)."""
    return {
        f"{m}x{n} w{warps} s{stages}{' P' if persistent else ''}": {
            "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, "TMA": True, **({"PERSISTENT": 1} if persistent else {}),
        }
        for m, n, warps, stages, persistent in specs
    }  # fmt: skip


TILES = _tiles(
    ((128, 256, 8, 3, True), (128, 256, 8, 4, True), (128, 256, 8, 3, False), (128, 128, 8, 4, True),
     (128, 128, 4, 4, True))
)  # fmt: skip


def matmuls() -> dict:
    from tritonkit.ops.linear import matmul as mm

    tokens, d, ffn = SHAPE.batch * SHAPE.seq, SHAPE.dim, SHAPE.ffn
    qkv = (SHAPE.heads + 2 * SHAPE.kv_heads) * SHAPE.head_dim
    projections = {"qkv": (qkv, d), "out": (d, d), "gate": (ffn, d), "down": (d, ffn)}
    result = {"linear_fwd_bwd": {}, "tiles": {}}
    for name, (n, k) in projections.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
        g = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        row = {}
        for provider, linear in (("tritonkit", tritonkit.linear), ("cublas", functional.linear)):

            def step(linear=linear, x=x, w=w, g=g):
                x.grad = w.grad = None
                linear(x, w).backward(g)

            def forward(linear=linear, x=x, w=w):
                with torch.no_grad():
                    linear(x, w)

            step()
            step()
            row[provider] = _cool_and_hot(step)
            row[provider + " fwd"] = _cool_and_hot(forward)
        print(name, row, flush=True)
        result["linear_fwd_bwd"][name] = row
    for name in ("gate", "down"):
        n, k = projections[name]
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        c = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
        row = {"cublas": _cool_and_hot(lambda a=a, b=b, c=c: torch.mm(a, b.t(), out=c))}
        for tile, config in TILES.items():
            problem = mm.matmul_problem(a, b, c)
            mm.MATMUL.run(problem, config)
            row[tile] = _cool_and_hot(lambda problem=problem, config=config: mm.MATMUL.run(problem, config))
        print(name, row, flush=True)
        result["tiles"][name] = row
    return result


# ---------------------------------------------------------------- backward


# 256-row tiles lost 2-9% at every product at c1ce4d6 (docs/perf-notes/linear.md): the 128-row
# tiles the tuner chooses among, each layout's C stored from registers and through TMA
BACKWARD_TILES = _tiles(
    (
        (128, 256, 8, 4, True),
        (128, 256, 8, 3, True),
        (128, 256, 8, 4, False),
        (128, 128, 4, 4, True),
    )
) | {"128x256 w8 s3 P TMA store": _tiles(((128, 256, 8, 3, True),))["128x256 w8 s3 P"] | {"TMA_STORE": True}}
BACKWARD_ROUNDS = 2  # every product's calls in turn, twice: the card's clock wanders between rounds


def _backward_products(tokens: int, d: int, ffn: int, qkv: int):
    """(name, the kernel's problem or None, cuBLAS's call, tritonkit's call) for each backward product
    of the layer's projections: dx = dz W and dW = dz^T x, and the MLP's gated dx = dg Wg + du Wu."""
    from tritonkit.ops.linear import kernels as kn
    from tritonkit.ops.linear import matmul as mm

    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    for name, (n, k) in {"gate": (ffn, d), "down": (d, ffn), "qkv": (qkv, d)}.items():
        x, dz = torch.randn(tokens, k, **bf16), torch.randn(tokens, n, **bf16)
        w = torch.randn(n, k, **bf16) / k**0.5
        dx, dw = torch.empty(tokens, k, **bf16), torch.empty(n, k, **bf16)
        for product, a, b, out in (("dx", dz, w.t(), dx), ("dw", dz.t(), x.t(), dw)):
            problem = mm.matmul_problem(a, b, out)
            yield (
                f"{name} {product}",
                problem,
                lambda a=a, b=b, out=out: torch.mm(a, b.t(), out=out),
                lambda a=a, b=b, out=out: mm.matmul(a, b, out),
            )
    wg, wu = (torch.randn(ffn, d, **bf16) / d**0.5 for _ in "gu")
    dg, du = (torch.randn(tokens, ffn, **bf16) for _ in "gu")
    dx = torch.empty(tokens, d, **bf16)

    def cublas():
        torch.mm(dg, wg, out=dx)
        dx.addmm_(du, wu)

    def one_kernel():
        mm.matmul(dg, wg.t(), dx, a2=du, b2=wu.t(), gated=kn.GATED_DX)

    def two_matmuls():  # as gated_linear's backward runs it from SPLIT_ROWS rows
        mm.matmul(dg, wg.t(), dx)
        mm.matmul(du, wu.t(), dx, residual=dx)

    # the two launches of gated_linear's dx apart: the second reads C back as its residual
    first, second = mm.matmul_problem(dg, wg.t(), dx), mm.matmul_problem(du, wu.t(), dx, residual=dx)
    yield (
        "gated dx's first launch",
        first,
        lambda: torch.mm(dg, wg, out=dx),
        lambda: mm.matmul(dg, wg.t(), dx),
    )
    yield (
        "gated dx's second launch (+ residual)",
        second,
        lambda: dx.addmm_(du, wu),
        lambda: mm.matmul(du, wu.t(), dx, residual=dx),
    )
    one = mm.matmul_problem(dg, wg.t(), dx, a2=du, b2=wu.t(), gated=kn.GATED_DX)
    yield "gated dx (one kernel)", one, cublas, one_kernel
    yield "gated dx (two matmuls, C read back as the residual)", None, cublas, two_matmuls


def backward(save=lambda rows: None) -> dict:
    """The backward's matmul products of the 8b-4k layer, hot: cuBLAS, the tuned tile tritonkit runs
    and BACKWARD_TILES, in turns BACKWARD_ROUNDS times (a row's figure the fastest of its rounds, its
    ``rounds`` each); the gated dx in one kernel, as two matmuls and each of those apart."""
    from tritonkit.ops.linear import matmul as mm

    qkv = (SHAPE.heads + 2 * SHAPE.kv_heads) * SHAPE.head_dim
    rows = {}
    for name, problem, cublas, ours in _backward_products(SHAPE.batch * SHAPE.seq, SHAPE.dim, SHAPE.ffn, qkv):
        ours()  # a first call tunes an unshipped key
        calls = {"tritonkit": ours, "cublas": cublas}
        for tile, config in BACKWARD_TILES.items() if problem is not None else ():
            if config.get("TMA_STORE") and (problem["residual"] is not None or problem["gated"]):
                continue  # (the TMA store is the plain products' only)
            calls[tile] = lambda problem=problem, config=config: mm.MATMUL.run(problem, config)
        turns = defaultdict(list)
        for _ in range(BACKWARD_ROUNDS):
            for key, call in calls.items():
                turns[key].append(_hot(call))
        row = {key: min(ms) for key, ms in turns.items()}
        print(name, {key: [round(ms, 3) for ms in turns[key]] for key in turns}, flush=True)
        rows[name] = row | {"rounds": dict(turns)}
        save(rows)  # each product's row kept as it ends: a long run cut short keeps what it timed
    return rows


# ---------------------------------------------------------------- gated


def _gated_forms(x, wg, wu) -> dict:
    """The MLP's gated forward, products kept (training) and y alone (inference), each way."""
    from tritonkit.ops.linear import kernels as kn
    from tritonkit.ops.linear import matmul as mm
    from tritonkit.ops.linear.linear import _gated_activation_launch

    silu = kn.ACTIVATIONS["silu"]
    m, n = x.shape[0], wg.shape[0]
    y, g, u = (torch.empty(m, n, device="cuda", dtype=x.dtype) for _ in range(3))

    def split(y, g, u):
        mm.matmul(x, wg, g)
        mm.matmul(x, wu, u)
        _gated_activation_launch(g, u, y, silu).run()

    def cublas(y, g, u):
        torch.mm(x, wg.t(), out=g)
        torch.mm(x, wu.t(), out=u)
        torch.mul(functional.silu(g), u, out=y)

    return {
        "products: one kernel": lambda: mm.matmul(
            x, wg, y, b2=wu, activation=silu, gated=kn.GATED_FWD, pre=g, pre2=u
        ),
        "products: two matmuls + act(g) * u": lambda: split(y, g, u),
        "products: cuBLAS + torch silu * u": lambda: cublas(y, g, u),
        "y: one kernel": lambda: mm.matmul(x, wg, y, b2=wu, activation=silu, gated=kn.GATED_FWD),
        "act(g) * u alone": lambda: _gated_activation_launch(g, u, y, silu).run(),
    }


def gated() -> dict:
    """gated_linear's forward at the layers' MLP shapes, cool and hot: the one kernel storing y, g
    and u against two plain matmuls and the elementwise act(g) * u, and cuBLAS's matmuls."""
    result = {}
    for case in ("8b-4k", "d64-4k", "8b-16k"):
        shape = layer.CASES[case]
        tokens, d, ffn = shape.batch * shape.seq, shape.dim, shape.ffn
        x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
        wg, wu = (torch.randn(ffn, d, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in "gu")
        row = {}
        for name, call in _gated_forms(x, wg, wu).items():
            call()  # a first call tunes an unshipped key
            row[name] = _cool_and_hot(call)
        print(case, {name: [round(ms, 3) for ms in times] for name, times in row.items()}, flush=True)
        result[case] = row
        del x, wg, wu
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------- host

HOST_REPEATS = 10


def _host_times(call, tensors) -> dict[str, list[float]]:
    """The host's time to issue ``call``, HOST_REPEATS times each through tritonkit's lean launch
    path and through Triton's own launch (``_launch.LEAN``), alternating, so that the host's drift
    falls on both alike; sorted."""
    times = {"lean": [], "triton": []}
    try:
        for _ in range(HOST_REPEATS):
            for path in times:
                _launch.LEAN = path == "lean"
                _clear(tensors)
                torch.cuda.synchronize()
                started = time.perf_counter()
                call()
                times[path].append((time.perf_counter() - started) * 1e3)
    finally:
        _launch.LEAN = True
    torch.cuda.synchronize()
    return {path: sorted(t) for path, t in times.items()}


def _python_profile(call, tensors) -> dict:
    """cProfile over HOST_REPEATS steps: Python calls and seconds a step, the 25 costliest functions."""
    profiler = cProfile.Profile()
    for _ in range(HOST_REPEATS):
        _clear(tensors)
        torch.cuda.synchronize()
        profiler.enable()
        call()
        profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    text = io.StringIO()
    stats.stream = text
    stats.sort_stats("tottime").print_stats(25)
    return {
        "python_calls_per_step": stats.total_calls / HOST_REPEATS,
        "profiled_ms_per_step": stats.total_tt * 1e3 / HOST_REPEATS,
        "by_own_time": text.getvalue(),
    }


def host(cases: list[str]) -> dict:
    result = {}
    for case in cases:
        shape = layer.CASES[case]
        x, g = layer.make_inputs(shape, torch.bfloat16, "cuda")
        w = layer.make_weights(shape, torch.bfloat16, "cuda")
        fn = layer.build("tritonkit", shape, None)
        tensors = [x, *w]
        for mode in ("fwd", "fwd+bwd"):
            call = layer._mode_call(fn, mode, x, w, g)
            for _ in range(5):
                _clear(tensors)
                call()
            times = _host_times(call, tensors)
            row = {"host_ms": times["lean"], "host_ms_through_triton": times["triton"]}
            row |= _python_profile(call, tensors)
            medians = [times[path][HOST_REPEATS // 2] for path in times]
            print(case, mode, "host ms, lean and through Triton:", medians, flush=True)
            result[f"{case} {mode}"] = row
        del x, g, w, fn, tensors
        torch.cuda.empty_cache()
    return result


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    providers = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    if mode == "protocols":
        rows = protocols(providers or ["tritonkit", "torch.compile"])
    elif mode == "sustained":
        rows = sustained(providers or ["tritonkit", "torch.compile", "hybrid"], out)
    elif mode == "matmuls":
        rows = matmuls()
    elif mode == "gated":
        rows = gated()
    elif mode == "backward":
        rows = backward(lambda rows: _save(out, mode, rows))
    elif mode == "host":
        rows = host(providers or ["8b-4k", "d64-4k"])
    else:
        raise SystemExit(f"mode must be protocols, sustained, matmuls, backward, gated or host, got {mode!r}")
    _save(out, mode, rows)


def _save(out: str, mode: str, rows) -> None:
    timing = "CUDA events; do_bench (_do_bench_ms) where named (module docstring)"
    with open(out, "w") as f:
        json.dump(
            result_header("layer", "layer_diagnostics.py", timing) | {"mode": mode, "rows": rows}, f, indent=1
        )


if __name__ == "__main__":
    with tuning.enabled():  # tritonkit as tuned (where nothing is cached or shipped, tuned here)
        main()
