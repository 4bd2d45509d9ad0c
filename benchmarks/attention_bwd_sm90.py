"""The attention backward on the H200: the sm_90 Gluon kernel (both modes) against cuDNN SDPA's
backward and tritonkit's Triton backward (both modes), in one process, bf16.

    python benchmarks/attention_bwd_sm90.py OUT.json [--deadline SECONDS] [--skip-triton]
        [--skip-deterministic] [--layer] [--full | --causal] [--candidates | --defaults] [--acquire-first]
        [--turn-blocks N] [--config MODE:FIELD=VALUE[,FIELD=VALUE]] [--shape B,Hq,Hkv,S,D] [--rounds N]
        [--window LEFT,RIGHT] [--softcap CAP]

``--layer`` times the decoder layer's attention alone (``tritonkit bench layer``'s 8b-4k: GQA 32/8, S =
4096, causal), q, k and v strided views of one QKV projection's output and dO of the output projection's
input, as the layer has them, with every Gluon candidate. ``--full`` or ``--causal`` times one mask's
rows only. A causal row also times the free order's other group sizes (``FREE_CAUSAL_GROUPS``), and
every row the deterministic order's (``DETERMINISTIC_GROUPS``); a GQA row also the deterministic mode
with the other ``bwd_sm90.DETERMINISTIC_GQA_PER_QUERY_HEAD``. ``--candidates`` times, in place of the
other orders, every Gluon candidate (``bwd_sm90.CANDIDATES``) in both modes (the deterministic ones
unless ``--skip-deterministic``); ``--defaults`` times each mode's default alone. ``--acquire-first``
times the deterministic default with the other ``Config.acquire_first`` too, and says whether its
gradients are the default's bits; ``--turn-blocks N`` likewise with ``Config.turn_blocks`` = N
(repeatable; the same bits where Sq = Sk). ``--config det:num_stages=3,acquire_first=False`` times a
mode's default (``free`` or ``det``) with those ``bwd_sm90.Config`` fields replaced (repeatable; a
deterministic one says whether its gradients are the default's bits). ``--shape`` keeps the rows of one
shape (repeatable). ``--window LEFT,RIGHT`` gives every row that sliding window (``flash_attention``'s),
which cuDNN does not take: cuDNN's backward without it is the rate to reach, the errors are against the
Triton kernels' deterministic gradients, and TFLOP/s count the pairs the window leaves; ``--softcap
CAP`` caps every row's scores likewise (cuDNN's backward uncapped the rate to reach). A head dim
between the kernel's own (``--shape 2,32,8,4096,96``) runs the Gluon rows on the kernel of the next one
up (``bwd.SM90_BACKWARD_PADDED``), TFLOP/s counted at the tensors' D; D = 256 (and 136-248) the Gluon
rows on ``bwd_sm90_wide``'s kernel (``bwd.SM90_BACKWARD_WIDE``); a head dim the Gluon kernels do not
take times cuDNN and the Triton kernels alone.

A row's providers take turns, ``--rounds`` of them (``tritonkit.bench.timing.interleaved_turns``;
each one's ``turns`` are in the JSON): its time is the median of its turns, each turn
``triton.testing.do_bench``'s median over a backward call (the delta pass and dq's conversion
included; cuDNN's own preprocessing too), from saved forward outputs, and ``spread`` is the range
of its turns over that median. The ratio printed is ``vs_cudnn_paired``: the median over rounds of
cuDNN's turn over the provider's in the same round (a clock that drifts between rounds moves both
alike), ``paired_spread`` its range over that median; a second line (``vs_default_paired``, and
its spread) has each Gluon variant so against its mode's default. TFLOP/s from 2.5 x 4 * B *
Hq * Sq * Sk * D (half of it causal). Each Gluon row also gives its largest gradient error against
cuDNN's. Rows stop being timed at the deadline (the JSON holds what
was measured).
"""

from __future__ import annotations

import ast
import itertools
import json
import sys
import time

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from tritonkit import tuning
from tritonkit.bench import runner, timing
from tritonkit.ops.attention import bwd, fwd
from tritonkit.ops.attention.common import Scores

# (B, Hq, Hkv, S, D), each full and causal
SHAPES = [
    (4, 32, 32, 4096, 128),
    (4, 32, 32, 4096, 64),
    (2, 16, 16, 16384, 128),
    (16, 16, 16, 1024, 128),
    (2, 32, 8, 8192, 128),
]


FREE_CAUSAL_GROUPS = (1, 2, 4, 8, 1024)  # 1: a head's key blocks together; 1024: all pairs
DETERMINISTIC_GROUPS = (None, 1, 4)  # None: all pairs
LAYER = (2, 32, 8, 4096, 128)  # bench layer's 8b-4k attention, causal


def _layer_tensors(shape, g) -> tuple:
    """q, k, v and dO as the decoder layer passes them: (B, H, S, D) views of (B, S, H, D) storage,
    q, k and v of one (B, S, (Hq + 2 Hkv) D) projection."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    width = heads_q + 2 * heads_kv
    qkv = torch.randn(batch, seq, width * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = qkv.view(batch, seq, width, head_dim).split([heads_q, heads_kv, heads_kv], dim=2)
    do = torch.randn(batch, seq, heads_q * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    do = do.view(batch, seq, heads_q, head_dim)
    return tuple(t.transpose(1, 2) for t in (q, k, v, do))


def _bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rounds() -> int:
    """``--rounds N``'s turns a provider (timing.ROUNDS unless given)."""
    (n,) = arguments("--rounds", int) or [timing.ROUNDS]
    return n


def interleaved() -> str:
    return (
        f"timing.interleaved_turns: {rounds()} turns a provider, each triton.testing.do_bench's median "
        f"(warmup {timing.ROUND_WARMUP_MS} ms, rep {timing.ROUND_REP_MS} ms), L2 flushed; the median "
        "turn; vs_cudnn_paired the median over rounds of cuDNN's turn over the provider's in the same round"
    )


def time_calls(row: dict, calls: dict) -> None:
    """The row's ``turns`` of ``calls`` taking turns (``timing.interleaved_turns``), their median
    ``ms`` and ``spread``, and each call's ratio to cuDNN round by round: its median
    (``vs_cudnn_paired``) and spread (``paired_spread``, the range over that median)."""
    torch.cuda.synchronize()
    row["turns"] = timing.interleaved_turns(calls, rounds())
    row["ms"] = {name: timing.median_of(ms) for name, ms in row["turns"].items()}
    row["spread"] = {name: timing.spread_of(ms) for name, ms in row["turns"].items()}
    ratios = timing.round_ratios(row["turns"], "cudnn")
    row["vs_cudnn_paired"] = {name: timing.median_of(r) for name, r in ratios.items()}
    row["paired_spread"] = {name: timing.spread_of(r) for name, r in ratios.items()}
    # each variant against its mode's default, round by round: what a change of config is worth
    against = {}
    for name in row["turns"]:
        default = mode_default(name)
        if default in row["turns"] and default != name:
            against[name] = timing.round_ratios(row["turns"], default)[name]
    row["vs_default_paired"] = {name: timing.median_of(r) for name, r in against.items()}
    row["vs_default_spread"] = {name: timing.spread_of(r) for name, r in against.items()}


def mode_default(name: str) -> str | None:
    """The provider a Gluon variant is a change of: its mode's default (``gluon`` or
    ``gluon_deterministic``); None for the others."""
    if not name.startswith("gluon"):
        return None
    return "gluon_deterministic" if name.startswith("gluon_deterministic") else "gluon"


def inputs(shape, layer: bool) -> tuple:
    """q, k, v and dO, bf16, seeded: contiguous, or as the layer has them (``_layer_tensors``)."""
    batch, heads_q, heads_kv, seq, head_dim = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    if layer:
        return _layer_tensors(shape, g)
    q = torch.randn(batch, heads_q, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(batch, heads_kv, seq, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in "kv"
    )
    return q, k, v, torch.randn_like(q)


def _window() -> tuple[int, int]:
    """``--window LEFT,RIGHT``, else (-1, -1)."""
    given = arguments("--window", lambda text: tuple(int(n) for n in text.split(",")))
    return given[-1] if given else (-1, -1)


def _softcap() -> float:
    """``--softcap CAP``, else 0 (no cap)."""
    given = arguments("--softcap", float)
    return given[-1] if given else 0.0


def _pairs(seq: int, causal: bool, window: tuple[int, int]) -> int:
    """The (query, key) pairs a head of ``seq`` rows and keys computes under the mask."""
    left, right = window
    rows = torch.arange(seq)
    last = rows if causal else (rows + right if right >= 0 else torch.full_like(rows, seq - 1))
    first = rows - left if left >= 0 else torch.zeros_like(rows)
    return int((last.clamp(max=seq - 1) - first.clamp(min=0) + 1).clamp(min=0).sum())


def _row(shape, causal: bool, layer: bool = False) -> dict:
    batch, heads_q, heads_kv, seq, head_dim = shape
    q, k, v, do = inputs(shape, layer)
    window, cap = _window(), _softcap()
    scores = Scores(head_dim**-0.5, causal, window=window, softcap=cap)
    o, lse = fwd.attention_fwd(q, k, v, scores)
    flops = 2.5 * 4 * batch * heads_q * _pairs(seq, causal, window) * head_dim
    row = {
        "shape": list(shape),
        "layer_layout": layer,
        "causal": causal,
        "dtype": "bf16",
        "window": list(window),
        "softcap": cap,
        "tflop": flops / 1e12,
        "tflops": {},
    }

    switches = (
        bwd.SM90_BACKWARD,
        bwd.SM90_BACKWARD_DETERMINISTIC,
        bwd.SM90_BACKWARD_DETERMINISTIC_GQA,
        bwd.SM90_BACKWARD_PADDED,
        bwd.SM90_BACKWARD_WIDE,
    )
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=causal, enable_gqa=heads_q != heads_kv
        )

        def cudnn():
            return torch.autograd.grad(out, leaves, do, retain_graph=True)

        reference = cudnn()
    calls = {"cudnn": cudnn}

    from tritonkit.ops.attention import bwd_sm90

    default_group = bwd_sm90.FREE_CAUSAL_PAIRS_PER_GROUP

    default_deterministic_group = bwd_sm90.DETERMINISTIC_PAIRS_PER_GROUP

    per_query_head = bwd_sm90.DETERMINISTIC_GQA_PER_QUERY_HEAD  # by mask (causal or not)

    default_config = bwd_sm90.default_config

    def ours(
        deterministic: bool,
        gluon: bool,
        group: int | None,
        by_query_head: bool = per_query_head[causal],
        switches: dict | None = None,
    ):
        """The backward in one mode, its program order's group size set for the mode (and, with GQA,
        whether a deterministic program takes a query head or the group; ``switches``: fields of
        the default config replaced)."""
        name = "DETERMINISTIC_PAIRS_PER_GROUP" if deterministic else "FREE_CAUSAL_PAIRS_PER_GROUP"
        default = default_deterministic_group if deterministic else default_group

        def switched_config(head_dim, *args, **kwargs):
            config = default_config(head_dim, *args, **kwargs)._replace(**switches)
            bwd_sm90.check_config(config, head_dim)  # (the launch checks only a config it is given)
            return config

        def call():
            bwd.SM90_BACKWARD = gluon
            bwd.SM90_BACKWARD_PADDED = bwd_sm90.PADDED_HEAD_DIMS + bwd_sm90.WIDE_HEAD_DIMS if gluon else ()
            bwd.SM90_BACKWARD_WIDE = gluon
            bwd.SM90_BACKWARD_DETERMINISTIC = bwd.SM90_BACKWARD_DETERMINISTIC_GQA = (64, 128) if gluon else ()
            setattr(bwd_sm90, name, group)
            bwd_sm90.DETERMINISTIC_GQA_PER_QUERY_HEAD = {**per_query_head, causal: by_query_head}
            bwd_sm90.default_config = switched_config if switches else default_config
            try:
                return bwd.attention_bwd(do, q, k, v, o, lse, None, scores, deterministic=deterministic)
            finally:
                setattr(bwd_sm90, name, default)
                bwd_sm90.DETERMINISTIC_GQA_PER_QUERY_HEAD = per_query_head
                bwd_sm90.default_config = default_config

        return call

    with tuning.disabled():  # the shipped (or cached) configs: no tuning runs inside the timing
        # the free causal order's other group sizes (bwd_sm90.FREE_CAUSAL_PAIRS_PER_GROUP), and the
        # deterministic order's (DETERMINISTIC_PAIRS_PER_GROUP)
        candidates_only = "--candidates" in sys.argv
        defaults_only = "--defaults" in sys.argv
        groups = (
            [g for g in FREE_CAUSAL_GROUPS if g != default_group]
            if causal and not (candidates_only or defaults_only)
            else []
        )
        gqa = heads_q != heads_kv
        # --config MODE:FIELD=VALUE,...: a mode's default with those fields replaced; --acquire-first
        # (the dQ warp's other way to poll its turn) and --turn-blocks N name deterministic ones
        # a head dim the Gluon kernels do not take times cuDNN and the Triton rows alone
        takes = head_dim in bwd_sm90.PADDED_HEAD_DIMS + bwd_sm90.WIDE_HEAD_DIMS
        kernel_dim = bwd_sm90.kernel_head_dim(head_dim)  # (a padded head dim's)
        shipped = default_config(kernel_dim, True, gqa, causal) if takes else bwd_sm90.CONFIGS[128]
        polls = not shipped.acquire_first
        switched = [
            *config_arguments(),
            *(
                [("det", f"acquire_first={polls}", {"acquire_first": polls})]
                if "--acquire-first" in sys.argv
                else []
            ),
            *(
                ("det", f"turn_blocks={n}", {"turn_blocks": n})
                for n in arguments("--turn-blocks", int)
                if n != shipped.turn_blocks
            ),
        ]
        configs = [
            (("gluon_deterministic_" if mode == "det" else "gluon_") + fields, mode == "det", switches)
            for mode, fields, switches in switched
        ]
        deterministic_grads = {}
        against = "cudnn"  # whose gradients the errors are taken against
        if window != (-1, -1) or cap:  # cuDNN's gradients are of other scores: the errors against Triton's
            reference = ours(True, False, None)()
            against = "triton_deterministic"
        for name, deterministic, gluon, group, *by_query_head in (
            ("gluon", False, True, default_group),
            *((f"gluon_pairs_per_group={g}", False, True, g) for g in groups),
            ("gluon_deterministic", True, True, default_deterministic_group),
            *(
                (
                    name,
                    det,
                    True,
                    default_deterministic_group if det else default_group,
                    per_query_head[causal],
                    switches,
                )
                for name, det, switches in configs
            ),
            *(
                [
                    (
                        f"gluon_deterministic_per_query_head={not per_query_head[causal]}",
                        True,
                        True,
                        default_deterministic_group,
                        not per_query_head[causal],
                    )
                ]
                if gqa
                else []
            ),
            *(
                (f"gluon_deterministic_pairs_per_group={g}", True, True, g)
                for g in DETERMINISTIC_GROUPS
                if g != default_deterministic_group
            ),
            ("triton", False, False, None),
            ("triton_deterministic", True, False, None),
        ):
            if (candidates_only or defaults_only) and "pairs_per_group" in name:
                continue
            if name.startswith("gluon_deterministic") and "--skip-deterministic" in sys.argv:
                continue
            if name.startswith("triton") and "--skip-triton" in sys.argv:
                continue
            if name.startswith("gluon") and not takes:
                continue
            fn = ours(deterministic, gluon, group, *by_query_head)
            grads = fn()
            calls[name] = fn
            if name == "gluon_deterministic" or any(name == c[0] and c[1] for c in configs):
                deterministic_grads[name] = grads  # (their bits compared below)
            if gluon:
                row[f"{name}_max_err_vs_{against}"] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference, strict=True)
                )
        # the way the dQ warp polls moves no add, nor do turns over groups of blocks at Sq = Sk: the
        # default's bits
        plain = deterministic_grads.pop("gluon_deterministic", None)
        for name, grads in deterministic_grads.items():
            row[f"{name}_same_bits"] = all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
        others = takes and kernel_dim in bwd_sm90.CANDIDATES and not defaults_only  # the other tiles
        if others and (heads_q == heads_kv or layer or candidates_only):
            delta = torch.empty(lse.shape, dtype=torch.float32, device="cuda")
            grads = tuple(torch.empty_like(t) for t in (q, k, v))
            modes = (False,) if "--skip-deterministic" in sys.argv else (False, True)
            for deterministic, config in itertools.product(modes, bwd_sm90.CANDIDATES[kernel_dim]):
                default = bwd_sm90.default_config(kernel_dim, deterministic)
                if config == default:  # timed above, as gluon or gluon_deterministic
                    continue

                def candidate(config=config, deterministic=deterministic):
                    for launch in bwd._delta_launches(o, do, None, delta):
                        launch.run()
                    bwd_sm90.attention_bwd_sm90(
                        do, q, k, v, lse, delta, *grads, scale=scores.scale, causal=causal,
                        upper_offset=0, deterministic=deterministic, config=config,
                    )  # fmt: skip

                changed = {
                    key: value for key, value in config._asdict().items() if value != default._asdict()[key]
                }
                name = ("gluon_deterministic_" if deterministic else "gluon_") + "_".join(
                    f"{key}={value}" for key, value in changed.items()
                )
                candidate()
                row[f"{name}_max_err_vs_{against}"] = max(
                    (a.float() - b.float()).abs().max().item() for a, b in zip(grads, reference, strict=True)
                )
                calls[name] = candidate
        time_calls(row, calls)
    (
        bwd.SM90_BACKWARD,
        bwd.SM90_BACKWARD_DETERMINISTIC,
        bwd.SM90_BACKWARD_DETERMINISTIC_GQA,
        bwd.SM90_BACKWARD_PADDED,
        bwd.SM90_BACKWARD_WIDE,
    ) = switches
    for name, ms in row["ms"].items():
        row["tflops"][name] = flops / ms / 1e9
    row["vs_cudnn"] = {name: row["ms"]["cudnn"] / ms for name, ms in row["ms"].items()}
    return row


def arguments(flag: str, convert) -> list:
    """Every value given after ``flag`` up to the next option, converted: ``--shape A --shape B`` and
    ``--shape A B`` alike (the second form once took A alone and dropped B without a word)."""
    values, taking = [], False
    for a in sys.argv[1:]:
        if a.startswith("--"):
            taking = a == flag
        elif taking:
            values.append(convert(a))
    return values


def config_arguments() -> list[tuple[str, str, dict]]:
    """Each ``--config MODE:FIELD=VALUE[,FIELD=VALUE]`` as (mode, its fields as given, {field: value}),
    the values Python literals; SystemExit naming what is wrong."""
    from tritonkit.ops.attention.bwd_sm90 import Config

    parsed = []
    for spec in arguments("--config", str):
        mode, _, fields = spec.partition(":")
        try:
            switches = {k: ast.literal_eval(v) for k, v in (f.split("=", 1) for f in fields.split(","))}
        except (ValueError, SyntaxError):
            raise SystemExit(f"--config takes MODE:FIELD=VALUE[,FIELD=VALUE], got {spec!r}") from None
        if mode not in ("free", "det") or not set(switches) <= set(Config._fields):
            raise SystemExit(
                f"--config: MODE is free or det and the fields are of {Config._fields}, got {spec!r}"
            )
        parsed.append((mode, fields, switches))
    return parsed


def deadline() -> float:
    """When rows stop being timed: ``--deadline SECONDS`` from now, else never."""
    seconds = float(sys.argv[sys.argv.index("--deadline") + 1]) if "--deadline" in sys.argv else 1e9
    return time.time() + seconds


def result_header(op: str, script: str, timing: str) -> dict:
    """A run's provenance: the command, the GPU, the versions and the commit
    (``TRITONKIT_GIT_SHA`` where the tree is no repository, as ``bench.runner.provenance``)."""
    sha = runner.provenance()["git_sha"]
    return {
        "op": op,
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git": sha,
        "timing": timing,
        "rows": [],
    }


def record(result: dict, row: dict, label: str, out: str) -> None:
    """Add ``row`` to ``result``, print its rates against cuDNN and rewrite ``out``."""
    result["rows"].append(row)
    paired = row.get("vs_cudnn_paired", row["vs_cudnn"])
    summary = "  ".join(f"{n} {t:.0f} ({paired[n]:.2f}x)" for n, t in row["tflops"].items())
    spread = f" [spread <= {max(row['spread'].values()):.1%}" if "spread" in row else ""
    if "paired_spread" in row:
        spread += f", of the ratios {max(row['paired_spread'].values()):.1%}]"
    elif spread:
        spread += "]"
    print(f"{label}{spread}: {summary}", flush=True)
    if row.get("vs_default_paired"):
        changes = "  ".join(
            f"{n} {x:.3f}x [rounds' range {row['vs_default_spread'][n]:.1%}]"
            for n, x in row["vs_default_paired"].items()
        )
        print(f"    against the mode's default, round by round: {changes}", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    torch.cuda.empty_cache()


def main() -> None:
    out, stop = sys.argv[1], deadline()
    config_arguments()  # (a malformed --config stops here, before any GPU work)
    result = result_header("attention_bwd", "attention_bwd_sm90.py", interleaved())
    layer = "--layer" in sys.argv
    flags = ((False, "--full"), (True, "--causal"))
    masks = [mask for mask, flag in flags if flag in sys.argv] or [False, True]
    shapes = [
        tuple(int(n) for n in sys.argv[i + 1].split(",")) for i, a in enumerate(sys.argv) if a == "--shape"
    ]
    cases = [(LAYER, True)] if layer else [(shape, causal) for shape in shapes or SHAPES for causal in masks]
    for shape, causal in cases:
        if time.time() <= stop:
            record(result, _row(shape, causal, layer), f"{shape} {'causal' if causal else 'full'}", out)


if __name__ == "__main__":
    main()
