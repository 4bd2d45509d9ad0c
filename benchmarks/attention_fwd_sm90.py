"""The attention forward on the H200: the sm_90 Gluon kernel against cuDNN SDPA's forward, in one
process, bf16, with the causal order's group sizes beside the default.

    python benchmarks/attention_fwd_sm90.py OUT.json [--deadline SECONDS] [--candidates]
        [--changes KEY=VALUE ...] [--shape B,Hq,Hkv,S,D] [--full | --causal] [--rounds N]
        [--softcap CAP] [--window LEFT,RIGHT]

Rows: the backward benchmark's shapes (``attention_bwd_sm90.SHAPES``), full and causal, then the decoder
layer's attention (``tritonkit bench layer``'s 8b-4k: GQA 32/8, S = 4096, causal, q, k and v strided
views of one QKV projection). ``--shape`` times the given shapes instead (repeatable; no layer row),
``--full`` or ``--causal`` one mask. A causal row also times the causal order's other group sizes
(``fwd_sm90.order``; ``GROUPS``); ``--candidates`` times every tile of ``fwd_sm90.CANDIDATES`` for the
head dim instead (with ``--changes``, only the default and the candidates that change it by those words,
as the rows name them: ``--changes pingpong=True``). A row's providers take turns, ``--rounds``
of them, as the backward benchmark's (``tritonkit.bench.timing.interleaved_turns``; the turns, the
median turn, its spread and the paired ratios to cuDNN and of each variant to the default, which are
what is printed), each turn ``triton.testing.do_bench``'s median over an eager call (the host path
included), L2 flushed; TFLOP/s from 4 * B * Hq * Sq * Sk * D (half of it causal). Each row gives the
largest difference from cuDNN's output. Rows stop being timed at the deadline (the JSON holds what was
measured).

``--softcap CAP`` and ``--window LEFT,RIGHT`` time soft-capped scores and sliding windows
(``flash_attention``'s), which cuDNN does not take: the Gluon forward (with ``--candidates`` its
other tiles too) and the Triton kernel (``fwd.SM90_FORWARD`` off) on those scores, beside cuDNN's
forward without them as the rate to reach (``vs_cudnn`` then compares unlike work: a window does
less); the differences are from the fp32 reference of those scores (``common.attention_reference``).
"""

from __future__ import annotations

import sys
import time

import torch
from attention_bwd_sm90 import LAYER, SHAPES, deadline, inputs, interleaved, record, result_header, time_calls
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritonkit.ops.attention import fwd, fwd_sm90
from tritonkit.ops.attention.common import Scores, attention_reference

GROUPS = (1, 2, 4, 8, 1 << 20)  # heads a group of the causal order; the last: every head at once


def _row(shape, causal: bool, layer: bool) -> dict:
    batch, heads_q, heads_kv, seq, head_dim = shape
    q, k, v, _ = inputs(shape, layer)
    flops = 4 * batch * heads_q * seq * seq * head_dim * (0.5 if causal else 1.0)
    row = {"shape": list(shape), "layer_layout": layer, "causal": causal, "dtype": "bf16"}

    def cudnn():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=heads_q != heads_kv
        )

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        reference = cudnn()
    if "--softcap" in sys.argv or "--window" in sys.argv:
        return _scores_row(row, (q, k, v), causal, cudnn, flops)
    if not fwd_sm90.supports(q, k, v, causal=causal):
        raise ValueError(f"the sm_90 forward does not take {shape} (layer layout: {layer})")
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)
    calls = {"cudnn": cudnn}

    def check(name: str, call) -> None:
        """Run ``call`` once (compiling it), keep its error against cuDNN and add it to the row's calls."""
        o.fill_(float("nan"))
        call()
        row[f"{name}_max_err_vs_cudnn"] = (o.float() - reference.float()).abs().max().item()
        calls[name] = call

    if "--candidates" in sys.argv:
        tile = fwd_sm90.default_config(head_dim, seq)
        for config in fwd_sm90.CANDIDATES[head_dim]:
            if config != tile and not _wanted(_changes(config, tile)):
                continue

            def candidate(config=config):
                fwd_sm90.attention_fwd_sm90(
                    q, k, v, o, lse, scale=head_dim**-0.5, causal=causal, config=config
                )

            check("gluon" if config == tile else f"gluon_{_changes(config, tile)}", candidate)
    else:
        default = fwd_sm90.order(True, 1 << 30, fwd_sm90.kernel_head_dim(head_dim))  # the rule's, at this D
        rules = fwd_sm90.CAUSAL_HEADS_PER_GROUP, fwd_sm90.WIDE_CAUSAL_HEADS_PER_GROUP
        for group in (default, *(g for g in GROUPS if g != default)) if causal else (default,):

            def grouped(group=group):
                fwd_sm90.CAUSAL_HEADS_PER_GROUP = fwd_sm90.WIDE_CAUSAL_HEADS_PER_GROUP = group
                try:
                    fwd_sm90.attention_fwd_sm90(q, k, v, o, lse, scale=head_dim**-0.5, causal=causal)
                finally:
                    fwd_sm90.CAUSAL_HEADS_PER_GROUP, fwd_sm90.WIDE_CAUSAL_HEADS_PER_GROUP = rules

            check("gluon" if group == default else f"gluon_heads_per_group={group}", grouped)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        time_calls(row, calls)
    row["tflops"] = {name: flops / ms / 1e9 for name, ms in row["ms"].items()}
    row["vs_cudnn"] = {name: row["ms"]["cudnn"] / ms for name, ms in row["ms"].items()}
    return row


def _scores_row(row: dict, qkv: tuple, causal: bool, cudnn, flops: float) -> dict:
    """``row`` timed with ``--softcap``'s and ``--window``'s scores: the Gluon forward and the Triton
    kernel's, cuDNN's forward without them beside (see the module docstring)."""
    q, k, v = qkv
    scale = q.shape[-1] ** -0.5
    cap = float(sys.argv[sys.argv.index("--softcap") + 1]) if "--softcap" in sys.argv else 0.0
    window = (-1, -1)
    if "--window" in sys.argv:
        window = tuple(int(n) for n in sys.argv[sys.argv.index("--window") + 1].split(","))
    scores = Scores(scale, causal, window=window, softcap=cap)
    reference = attention_reference(
        q.float(), k.float(), v.float(), causal, scale, window=window, softcap=cap
    )
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device="cuda", dtype=torch.float32)

    def gluon():
        fwd_sm90.attention_fwd_sm90(q, k, v, o, lse, scale=scale, causal=causal, window=window, softcap=cap)

    def triton():
        fwd.SM90_FORWARD = False
        try:
            fwd.attention_fwd_into(q, k, v, o, lse, scores)
        finally:
            fwd.SM90_FORWARD = True

    row["softcap"], row["window"] = cap, list(window)
    calls = {"gluon": gluon, "triton": triton}
    if "--candidates" in sys.argv:  # the Gluon forward's other tiles on these scores
        tile = fwd_sm90.default_config(fwd_sm90.kernel_head_dim(q.shape[-1]), k.shape[2])
        for config in fwd_sm90.CANDIDATES[fwd_sm90.kernel_head_dim(q.shape[-1])]:
            if config != tile:

                def candidate(config=config):
                    fwd_sm90.attention_fwd_sm90(
                        q, k, v, o, lse, scale=scale, causal=causal, window=window, softcap=cap, config=config
                    )

                calls[f"gluon_{_changes(config, tile)}"] = candidate
    for name, call in calls.items():
        o.fill_(float("nan"))
        call()
        row[f"{name}_max_err_vs_reference"] = (o.float() - reference).abs().max().item()
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        time_calls(row, {"cudnn": cudnn, **calls})
    row["tflops"] = {name: flops / ms / 1e9 for name, ms in row["ms"].items()}
    row["vs_cudnn"] = {name: row["ms"]["cudnn"] / ms for name, ms in row["ms"].items()}
    return row


def _wanted(changes: str) -> bool:
    """Whether ``--changes`` (if given) names a candidate's changes of the default tile."""
    if "--changes" not in sys.argv:
        return True
    named = sys.argv[sys.argv.index("--changes") + 1 :]
    return changes in named[: next((i for i, word in enumerate(named) if word.startswith("--")), len(named))]


def _changes(config, tile) -> str:
    """What a candidate changes of the row's default tile, as key=value words."""
    default = tile._asdict()
    return "_".join(f"{key}={value}" for key, value in config._asdict().items() if value != default[key])


def main() -> None:
    out, stop = sys.argv[1], deadline()
    result = result_header("attention_fwd", "attention_fwd_sm90.py", interleaved() + ", eager calls")
    shapes = [
        tuple(int(n) for n in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"
    ]
    masks = [mask for mask, flag in ((True, "--causal"), (False, "--full")) if flag in sys.argv] or [
        True,
        False,
    ]
    cases = [] if shapes or masks == [False] else [(LAYER, True, True)]
    cases += [(shape, causal, False) for shape in shapes or SHAPES for causal in masks]
    for shape, causal, layer in cases:
        if time.time() > stop:
            break
        label = f"{shape}{' layer' if layer else ''} {'causal' if causal else 'full'}"
        record(result, _row(shape, causal, layer), label, out)


if __name__ == "__main__":
    main()
