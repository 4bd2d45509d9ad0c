"""Decode attention over a KV cache on the H200: ``tritonkit.flash_attention_with_kvcache`` against
SDPA's cuDNN and flash backends (and, with ``--flex``, compiled FlexAttention), in one process, bf16.

    python benchmarks/decode_attention.py OUT.json [--deadline SECONDS] [--flex] [--skip-step]
    python benchmarks/decode_attention.py OUT.json --configs [--paged] [--batch B1,B2] [--deadline SECONDS]
    python benchmarks/decode_attention.py OUT.json --pages [--deadline SECONDS]
    python benchmarks/decode_attention.py OUT.json --splits [--deadline SECONDS]
    python benchmarks/decode_attention.py OUT.json --layouts [--batch B1,B2] [--deadline SECONDS]
    python benchmarks/decode_attention.py RESULT.json --markdown   (the table in docs/ops/decode.md)

Rows: issue 28's shapes (B, Hq, Hkv, S_cache, D), one new query token (four at one shape), every
sequence's cache full. tritonkit reads a contiguous cache (B, S, Hkv, D) and a paged one (blocks of
64 slots, a shuffled block table), with the lengths in ``cache_seqlens``; "tritonkit+append" also
writes the step's new keys and values (the cache's last Sq slots) inside the call, as a decode step
does; "tritonkit-paged-in-order" reads the contiguous cache as blocks in memory order through a
block table (the paged walk without the shuffle). The peers read (B, Hkv, S, D) caches, their own
layout, the new tokens aligned bottom-right (one token: no mask; four: SDPA's lower-right causal
bias).

Each time is a median in ms, two ways: ``graph`` replays the call from a CUDA graph
(``tritonkit.bench.timing.kernel_ms``: L2 flushed, warm-up first), what a serving loop replays;
``eager`` is ``triton.testing.do_bench`` over the plain call, the host path included; ``loop_us``
a call of 200 made back to back, then a sync, as an eager decode loop makes them (the host's time or
the GPU's, whichever is longer), and ``host_us`` the host's time alone
(``tritonkit.bench.timing.host_us``, bursts the GPU keeps up with). TB/s is the
K + V bytes read over the graph time; ``copy_tbps`` is a device copy moving as many bytes (half read,
half written) in the same run, the speed of light at that size. Each row gives tritonkit's largest
output difference from cuDNN's (or the first peer that ran). Unless ``--skip-step``, a last row
times a Llama-3-8B-shaped decode step's attention: 32 layers' calls at B = 16, 4096 cached tokens,
each layer its own cache, the step's token appended to it, replayed from one CUDA graph, against the
same with cuDNN SDPA, the token written by ``index_copy_`` (and, beside it, SDPA without the write).

``--configs`` times tritonkit alone, at each shape with the contiguous cache (appending) and the
paged one (``--paged``: the paged one only): every launch config of ``CONFIGS`` at the rule's split
count and at one wave's (SMs // (B x Hkv)), then the fastest config at the split counts of
``_split_counts`` (a short protocol: 10 ms
warm-up, 40 ms of repetitions). ``--pages`` times the paged call with each of ``PAGE_READS`` table
entries read at once (``decode.PAGES``), the contiguous call beside it. ``--batch`` keeps the shapes of
those batch sizes. ``--splits`` times, where
the rule splits the keys, a few launches at many split counts, cuDNN beside. ``--layouts`` times
tritonkit's call on its own cache layout (B, S, Hkv, D) and on the peers' (B, Hkv, S, D), read
through a transposed view, cuDNN beside, in turns: what the layout alone costs.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing
from attention_bwd_sm90 import deadline, result_header
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import tritonkit
from tritonkit.bench import layer, runner, timing
from tritonkit.ops.attention import decode

SHAPES = [  # ((B, Hq, Hkv, S_cache, D), Sq)
    ((1, 32, 8, 8192, 128), 1),
    ((16, 32, 8, 8192, 128), 1),
    ((32, 32, 8, 8192, 128), 1),
    ((64, 32, 32, 2048, 128), 1),
    ((8, 32, 8, 32768, 128), 1),
    ((16, 32, 8, 8192, 128), 4),
]
SLOTS = 64  # the paged cache's block size
STEP = ((16, 32, 8, 4096, 128), 32)  # a decode step of Llama-3-8B: (shape, layers)
CONFIGS = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))  # (BLOCK_N, NUM_WARPS, NUM_STAGES)


def _inputs(shape, seq_q, g) -> dict:
    batch, heads_q, heads_kv, seq, head_dim = shape

    def randn(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=g)

    q = randn(batch, seq_q, heads_q, head_dim)
    k_cache, v_cache = randn(batch, seq, heads_kv, head_dim), randn(batch, seq, heads_kv, head_dim)
    per_sequence = seq // SLOTS
    order = torch.randperm(batch * per_sequence, device="cuda", generator=g)
    table = order.view(batch, per_sequence).to(torch.int32)
    paged_k, paged_v = (
        torch.empty(batch * per_sequence, SLOTS, heads_kv, head_dim, **_like(q)) for _ in "kv"
    )
    paged_k[table.long()] = k_cache.view(batch, per_sequence, SLOTS, heads_kv, head_dim)
    paged_v[table.long()] = v_cache.view(batch, per_sequence, SLOTS, heads_kv, head_dim)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "paged": (paged_k, paged_v, table),
        # the contiguous cache read as pages in order (sequence b's i-th block is b x blocks + i)
        "in_order": (
            *(c.view(batch * per_sequence, SLOTS, heads_kv, head_dim) for c in (k_cache, v_cache)),
            torch.arange(batch * per_sequence, device="cuda", dtype=torch.int32).view(batch, per_sequence),
        ),
        "full": torch.full((batch,), seq, dtype=torch.int32, device="cuda"),
        "before_new": torch.full((batch,), seq - seq_q, dtype=torch.int32, device="cuda"),
        "new": (k_cache[:, seq - seq_q :].clone(), v_cache[:, seq - seq_q :].clone()),
        # the peers' layout: (B, H, S, D) contiguous
        "peer": tuple(t.transpose(1, 2).contiguous() for t in (q, k_cache, v_cache)),
    }


def _like(t) -> dict:
    return {"device": t.device, "dtype": t.dtype}


def _providers(x: dict, seq_q: int, flex: bool) -> dict:
    """name -> a no-argument call returning the output as (B, Sq, Hq, D)."""
    q, (pk, pv, table) = x["q"], x["paged"]
    calls = {
        "tritonkit": lambda: tritonkit.flash_attention_with_kvcache(
            q, x["k_cache"], x["v_cache"], cache_seqlens=x["full"]
        ),
        "tritonkit-paged": lambda: tritonkit.flash_attention_with_kvcache(
            q, pk, pv, cache_seqlens=x["full"], block_table=table
        ),
        # a diagnostic: the paged walk over blocks in memory order, the shuffle's cost apart
        "tritonkit-paged-in-order": lambda: tritonkit.flash_attention_with_kvcache(
            q, *x["in_order"][:2], cache_seqlens=x["full"], block_table=x["in_order"][2]
        ),
        # rewrites the cache's last Sq slots with what they hold: the same state each repetition
        "tritonkit+append": lambda: tritonkit.flash_attention_with_kvcache(
            q, x["k_cache"], x["v_cache"], *x["new"], cache_seqlens=x["before_new"]
        ),
    }
    pq, pk_, pv_ = x["peer"]
    mask = causal_lower_right(seq_q, pk_.shape[2]) if seq_q > 1 else None
    gqa = pq.shape[1] != pk_.shape[1]
    for name, backend in (
        ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa-flash", SDPBackend.FLASH_ATTENTION),
    ):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(
                    pq, pk_, pv_, attn_mask=mask, enable_gqa=gqa
                )
            return o.transpose(1, 2)

        calls[name] = sdpa
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention)
        seq = pk_.shape[2]
        block_mask = (
            create_block_mask(lambda b, h, i, j: j <= i + seq - seq_q, None, None, seq_q, seq)
            if seq_q > 1
            else None
        )
        calls["flex"] = lambda: compiled(pq, pk_, pv_, block_mask=block_mask, enable_gqa=gqa).transpose(1, 2)
    return calls


def _loop_us(call, calls: int = 200, repeats: int = 5) -> float:
    """us a call of ``calls`` made back to back, eagerly, as a decode loop makes them, then one sync:
    the host's time or the GPU's, whichever is longer (the median of ``repeats`` loops)."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    loops = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(loops)[repeats // 2]


def _row(shape, seq_q: int, flex: bool) -> dict:
    batch, heads_q, heads_kv, seq, head_dim = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = _inputs(shape, seq_q, g)
    kv_bytes = 2 * batch * heads_kv * seq * head_dim * 2
    cost = decode.kvcache_cost(shape, torch.bfloat16, seq_q)
    row = {"shape": list(shape), "seq_q": seq_q, "dtype": "bf16", "kv_bytes": kv_bytes}
    row["cost"] = {"flops": cost.flops, "bytes": cost.bytes}
    fields = ("graph_ms", "eager_ms", "loop_us", "host_us", "tbps", "errors", "method")
    row |= {field: {} for field in fields}
    outputs = {}
    for name, call in _providers(x, seq_q, flex).items():
        try:
            outputs[name] = call().float()
            (_, median, _), method = timing.kernel_ms([lambda call=call: call])
            row["graph_ms"][name], row["method"][name] = median, method
            row["eager_ms"][name] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            row["loop_us"][name] = _loop_us(call)
            row["host_us"][name] = timing.host_us(call)
            row["tbps"][name] = kv_bytes / median / 1e9
        except Exception as error:  # a peer that cannot take the case: its reason, the others run on
            row["errors"][name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        torch.cuda.synchronize()
    peers = [n for n in outputs if not n.startswith("tritonkit")]
    if peers:
        reference = outputs[peers[0]]
        row["max_err_vs"] = peers[0]
        row["max_err"] = {n: (o - reference).abs().max().item() for n, o in outputs.items() if n != peers[0]}
    row["copy_tbps"] = kv_bytes / runner._copy_ms(kv_bytes) / 1e9
    best = min((ms for n, ms in row["graph_ms"].items() if not n.startswith("tritonkit")), default=None)
    row["vs_best_peer"] = {n: best / ms for n, ms in row["graph_ms"].items()} if best else {}
    row["of_copy"] = {n: tbps / row["copy_tbps"] for n, tbps in row["tbps"].items()}
    return row


def _step_row() -> dict:
    """32 layers' attention calls of one decode step, each on its own cache, in one CUDA graph."""
    (batch, heads_q, heads_kv, seq, head_dim), layers = STEP
    g = torch.Generator(device="cuda").manual_seed(1)
    caches = [_inputs((batch, heads_q, heads_kv, seq, head_dim), 1, g) for _ in range(layers)]
    for x in caches:
        del x["paged"]  # the step reads contiguous caches; free the paged copies
    positions = torch.tensor([seq - 1], device="cuda")  # the step's token: the cache's last slot

    def cudnn_appending(x):  # a step as a serving loop over SDPA runs it: write the token, attend
        q, k_cache, v_cache = x["peer"]
        for cache, new in zip((k_cache, v_cache), x["new"], strict=True):
            cache.index_copy_(2, positions, new.transpose(1, 2))
        return _cudnn(q, k_cache, v_cache)

    steps = {
        "tritonkit": lambda: [
            tritonkit.flash_attention_with_kvcache(
                x["q"], x["k_cache"], x["v_cache"], *x["new"], x["before_new"]
            )
            for x in caches
        ],
        "sdpa-cudnn+append": lambda: [cudnn_appending(x) for x in caches],
        "sdpa-cudnn": lambda: [_cudnn(*x["peer"]) for x in caches],
    }
    row = {"step": {"shape": list(STEP[0]), "layers": layers}, "graph_ms": {}}
    for name, call in steps.items():
        (_, median, _), method = timing.kernel_ms([lambda call=call: call])
        row["graph_ms"][name], row["method"] = median, method
    row["vs_cudnn"] = {n: ms / row["graph_ms"]["tritonkit"] for n, ms in row["graph_ms"].items()}
    return row


def _cudnn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


def _split_counts(pairs: int, rule: int) -> list[int]:
    """The rule's split count, half and twice it, and the counts that make one, two, four and eight
    programs an SM (132 SMs) of ``pairs`` (batch x key/value heads)."""
    waves = [-(-132 * n // pairs) for n in (1, 2, 4, 8)]
    return sorted(c for c in {1, max(1, rule // 2), rule, 2 * rule, *waves} if c <= decode.MAX_SPLITS * 4)


def _forced_call(x: dict, paged: bool, splits: int):
    """A no-argument decode call over ``x`` with ``splits`` forced: paged (full caches) or contiguous
    (appending the step's tokens)."""
    if paged:
        pk, pv, table = x["paged"]
        return lambda: tritonkit.flash_attention_with_kvcache(
            x["q"], pk, pv, cache_seqlens=x["full"], block_table=table, num_splits=splits
        )
    return lambda: tritonkit.flash_attention_with_kvcache(
        x["q"], x["k_cache"], x["v_cache"], *x["new"], cache_seqlens=x["before_new"], num_splits=splits
    )


# decode's launches, forced to one config while timed
LAUNCH_KINDS = ("ONE_SPLIT_LAUNCH", "SPLIT_LAUNCH", "ALONE_LAUNCH")


def _config_us(call, config: tuple) -> float:
    """Graph time in us of ``call`` with both of decode's launches forced to ``config`` (BLOCK_N,
    warps, stages), or inf where the GPU cannot hold it (its reason printed)."""
    defaults = {kind: getattr(decode, kind) for kind in LAUNCH_KINDS}
    for kind in LAUNCH_KINDS:
        setattr(decode, kind, config)
    decode._plans.clear()  # a recorded launch holds the config it was built with
    try:
        with timing.protocol(10, 40):
            (_, median, _), _ = timing.kernel_ms([lambda: call])
        return median * 1e3
    except Exception as error:  # a config the GPU cannot hold (shared memory): its reason, not a time
        print(f"{config}: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
        return float("inf")
    finally:
        for kind, launch in defaults.items():
            setattr(decode, kind, launch)
        decode._plans.clear()


def _config_row(shape, seq_q: int, paged: bool, stop: float) -> dict:
    """Graph time in us of each (BLOCK_N, warps, stages, splits) tried, keyed "64-4-3-5"."""
    batch, _, heads_kv, seq, _ = shape
    x = _inputs(shape, seq_q, torch.Generator(device="cuda").manual_seed(0))
    rule = decode.default_splits(batch, heads_kv, seq, "cuda", paged)
    peer = _providers(x, seq_q, False)["sdpa-cudnn"]
    (_, cudnn, _), _ = timing.kernel_ms([lambda: peer])
    us = {}
    # every config at the rule's split count and at one wave's (one program an SM at most, where deep
    # rings pay: decode-and-ring.md, "Programs alone on their SMs")
    one_wave = max(1, decode.sm_count("cuda") // (batch * heads_kv))
    for splits in dict.fromkeys((one_wave, rule)):
        for config in CONFIGS:
            if time.time() < stop:
                us["-".join(map(str, (*config, splits)))] = _config_us(_forced_call(x, paged, splits), config)
    best = min(us, key=us.get)
    config = tuple(int(c) for c in best.split("-")[:3])
    for splits in _split_counts(batch * heads_kv, rule):
        if time.time() < stop:
            us["-".join(map(str, (*config, splits)))] = _config_us(_forced_call(x, paged, splits), config)
    best = min(us, key=us.get)
    kv_bytes = 2 * batch * heads_kv * seq * shape[4] * 2
    rows = shape[1] // heads_kv * seq_q
    row_blocks = decode.cdiv(rows, decode.row_block(rows))
    default = decode._launch_config(batch * heads_kv * rule * row_blocks, paged, rule, shape[4], 2, "cuda")
    return {
        "shape": list(shape), "seq_q": seq_q, "paged": paged, "rule_splits": rule, "us": us,
        "cudnn_us": cudnn * 1e3,
        "default": "-".join(map(str, (*default, rule))), "best": best, "best_tbps": kv_bytes / us[best] / 1e6,
    }  # fmt: skip


SPLIT_CONFIGS = ((32, 2, 3), (32, 4, 3), (64, 4, 2))  # --splits: the launches timed at every count
SPLIT_COUNTS = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)


def _splits(out: str, stop: float) -> None:
    """--splits: at each shape where the rule splits the keys, graph time in us of each launch of
    SPLIT_CONFIGS at each of SPLIT_COUNTS (splits of at least MIN_SPLIT_KEYS keys), contiguous
    (appending) and paged, cuDNN's time beside: how the split count and the programs it makes (B x
    Hkv x splits, against the SMs and the programs an SM holds) set the time; and the kernels of the
    default call (contiguous, appending: the split kernel and the combine), each one's GPU time."""
    method = "tritonkit.bench.timing.kernel_ms, warm-up 10 ms, repetitions 40 ms"
    result = result_header("decode_attention_splits", "decode_attention.py", method)
    for shape, seq_q in SHAPES:
        batch, _, heads_kv, seq, _ = shape
        rule = decode.default_splits(batch, heads_kv, seq, "cuda")
        if rule == 1 or time.time() > stop:
            continue
        x = _inputs(shape, seq_q, torch.Generator(device="cuda").manual_seed(0))
        peer = _providers(x, seq_q, False)["sdpa-cudnn"]
        (_, cudnn, _), _ = timing.kernel_ms([lambda peer=peer: peer])
        row = {"shape": list(shape), "seq_q": seq_q, "rule_splits": rule, "cudnn_us": cudnn * 1e3, "us": {}}
        counts = [c for c in SPLIT_COUNTS if c * decode.MIN_SPLIT_KEYS <= seq]
        for paged, config, splits in itertools.product((False, True), SPLIT_CONFIGS, counts):
            if time.time() < stop:
                key = "-".join(map(str, ("paged" if paged else "contiguous", *config, splits)))
                row["us"][key] = _config_us(_forced_call(x, paged, splits), config)
        row["kernels"] = layer.kernel_profile(_forced_call(x, False, 0), [])["kernels"]  # the rule's launches
        result["rows"].append(row)
        best = {
            kind: min((k for k in row["us"] if k.startswith(kind)), key=row["us"].get)
            for kind in ("contiguous", "paged")
        }
        print(
            shape,
            seq_q,
            f"cuDNN {row['cudnn_us']:.1f}",
            {k: round(row["us"][k], 1) for k in best.values()},
            flush=True,
        )
        Path(out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


def _chosen_shapes() -> list:
    """SHAPES, or those whose batch size ``--batch B1,B2`` names."""
    if "--batch" not in sys.argv:
        return SHAPES
    batches = {int(b) for b in sys.argv[sys.argv.index("--batch") + 1].split(",")}
    return [(shape, seq_q) for shape, seq_q in SHAPES if shape[0] in batches]


def _configs(out: str, stop: float) -> None:
    method = "tritonkit.bench.timing.kernel_ms, warm-up 10 ms, repetitions 40 ms"
    result = result_header("decode_attention_configs", "decode_attention.py", method)
    kinds = (True,) if "--paged" in sys.argv else (False, True)
    for (shape, seq_q), paged in itertools.product(_chosen_shapes(), kinds):
        if time.time() > stop:
            break
        row = _config_row(shape, seq_q, paged, stop)
        result["rows"].append(row)
        print(f"{shape} Sq {seq_q} paged {paged}: default {row['us'].get(row['default'])} best {row['best']} "
              f"{row['us'][row['best']]:.1f} us ({row['best_tbps']:.2f} TB/s)", flush=True)  # fmt: skip
        Path(out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


PAGE_READS = (8, 16, 32, 64, 128)  # --pages: table entries a paged walk reads at once


def _pages(out: str, stop: float) -> None:
    """Graph time in us of the paged call (appending) with each of PAGE_READS as ``decode.PAGES``,
    the contiguous call's beside it: what the walk's outer loop (a vector of table entries, then an
    inner pipelined loop over their steps, restarted each time) costs."""
    method = "tritonkit.bench.timing.kernel_ms"
    result = result_header("decode_attention_pages", "decode_attention.py", method)
    default = decode.PAGES
    for shape, seq_q in SHAPES:
        if time.time() > stop:
            break
        calls = _providers(_inputs(shape, seq_q, torch.Generator(device="cuda").manual_seed(0)), seq_q, False)
        row = {"shape": list(shape), "seq_q": seq_q, "us": {}}
        for pages in PAGE_READS:
            decode.PAGES = pages
            decode._plans.clear()  # a recorded launch holds the PAGES it was built with
            for name in ("tritonkit", "tritonkit-paged"):
                if name == "tritonkit-paged" or pages == default:
                    (_, median, _), _ = timing.kernel_ms([lambda call=calls[name]: call])
                    row["us"][name if name == "tritonkit" else f"paged {pages}"] = median * 1e3
        decode.PAGES = default
        decode._plans.clear()
        result["rows"].append(row)
        print(shape, seq_q, {name: round(us, 1) for name, us in row["us"].items()}, flush=True)
        Path(out).write_text(json.dumps(result, indent=1))


LAYOUT_ROUNDS = 3  # --layouts: turns of the three calls, so that a drift falls on all alike


def _layout_calls(x: dict, seq_q: int) -> dict:
    """--layouts' calls: ours on each cache layout, cuDNN on its own."""
    q, lengths, heads_major = x["q"], x["full"], [t.transpose(1, 2) for t in x["peer"][1:]]
    return {
        "keys-major": lambda: tritonkit.flash_attention_with_kvcache(
            q, x["k_cache"], x["v_cache"], cache_seqlens=lengths
        ),
        "heads-major": lambda: tritonkit.flash_attention_with_kvcache(q, *heads_major, cache_seqlens=lengths),
        "sdpa-cudnn": _providers(x, seq_q, False)["sdpa-cudnn"],
    }


def _layouts(out: str, stop: float) -> None:
    """Graph time in us of tritonkit's call on the (B, S, Hkv, D) cache ("keys-major": a key's heads
    side by side, a head's keys 2 KB apart at Hkv 8) and on the peers' (B, Hkv, S, D) cache through a
    transposed view ("heads-major": a head's keys one run), cuDNN on the latter, one new token: how
    much of the gap to cuDNN the layout makes. Both of ours must give the same output."""
    method = f"tritonkit.bench.timing.kernel_ms, {LAYOUT_ROUNDS} rounds in turns"
    result = result_header("decode_attention_layouts", "decode_attention.py", method)
    for shape, seq_q in _chosen_shapes():
        if seq_q != 1 or time.time() > stop:
            continue
        x = _inputs(shape, seq_q, torch.Generator(device="cuda").manual_seed(0))
        calls = _layout_calls(x, seq_q)
        outputs = {name: call().float() for name, call in calls.items()}
        row = {"shape": list(shape), "seq_q": seq_q, "us": {name: [] for name in calls}}
        reference = outputs["sdpa-cudnn"]
        row["max_err_vs_cudnn"] = {n: (o - reference).abs().max().item() for n, o in outputs.items()}
        row["layouts_differ_by"] = (outputs["keys-major"] - outputs["heads-major"]).abs().max().item()
        for _ in range(LAYOUT_ROUNDS):
            for name, call in calls.items():
                (_, median, _), _ = timing.kernel_ms([lambda call=call: call])
                row["us"][name].append(median * 1e3)
        row["median_us"] = {name: sorted(us)[len(us) // 2] for name, us in row["us"].items()}
        result["rows"].append(row)
        print(shape, {name: round(us, 1) for name, us in row["median_us"].items()}, flush=True)
        Path(out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


def markdown(result: dict) -> str:
    """docs/ops/decode.md's table of a run: graph-replayed us, TB/s and share of copy, the peers beside."""
    lines = [
        "| B, Hq, Hkv, S, new tokens | tritonkit us | +append us | TB/s | of copy | paged (block 64) us "
        "| cuDNN us | flash us | x best peer | eager loop us a call (tritonkit, best peer) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        if "step" in row:
            continue
        us = {name: ms * 1e3 for name, ms in row["graph_ms"].items()}
        # a call in an eager loop where the run has it, else do_bench's eager median
        eager = row.get("loop_us") or {name: ms * 1e3 for name, ms in row["eager_ms"].items()}
        best_eager = min(ms for name, ms in eager.items() if not name.startswith("tritonkit"))
        cells = [
            ", ".join(map(str, [*row["shape"][:4], row["seq_q"]])),
            f"{us['tritonkit']:.1f}", f"{us['tritonkit+append']:.1f}", f"{row['tbps']['tritonkit']:.2f}",
            f"{row['of_copy']['tritonkit']:.2f}", f"{us['tritonkit-paged']:.1f}",
            f"{us.get('sdpa-cudnn', float('nan')):.1f}", f"{us.get('sdpa-flash', float('nan')):.1f}",
            f"{row['vs_best_peer']['tritonkit']:.2f}x", f"{eager['tritonkit']:.0f}, {best_eager:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if "--markdown" in sys.argv:  # python benchmarks/decode_attention.py RESULT.json --markdown
        return print(markdown(json.loads(Path(sys.argv[1]).read_text())))
    out, stop = sys.argv[1], deadline()
    if "--configs" in sys.argv:
        return _configs(out, stop)
    if "--pages" in sys.argv:
        return _pages(out, stop)
    if "--splits" in sys.argv:
        return _splits(out, stop)
    if "--layouts" in sys.argv:
        return _layouts(out, stop)
    result = result_header(
        "decode_attention",
        "decode_attention.py",
        "graph: tritonkit.bench.timing.kernel_ms; "
        "eager: triton.testing.do_bench median (warmup 25 ms, rep 100 ms), L2 flushed",
    )
    for shape, seq_q in SHAPES:
        if time.time() > stop:
            break
        row = _row(shape, seq_q, "--flex" in sys.argv)
        result["rows"].append(row)
        summary = "  ".join(
            f"{n} {ms * 1e3:.0f}us {row['tbps'][n]:.2f}TB/s" for n, ms in row["graph_ms"].items()
        )
        print(f"{shape} Sq {seq_q} (copy {row['copy_tbps']:.2f} TB/s): {summary} {row['errors']}", flush=True)
        Path(out).write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    if "--skip-step" not in sys.argv and time.time() <= stop:
        row = _step_row()
        result["rows"].append(row)
        print(f"decode step {row['step']}: {row['graph_ms']} (tritonkit x: {row['vs_cudnn']})", flush=True)
        Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
