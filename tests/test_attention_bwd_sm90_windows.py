"""Sliding windows on the sm_90 Gluon attention backward (``ops/attention/bwd_sm90.py``): the
scores it runs for a left side alone (``bwd.sm90_scores``, on the CPU), and on the H200 (``gpu``) dq,
dk and dv against the float64 reference gradients with the oracle's rule, for causal windows,
two-sided ones and either side alone, both alignments of Sq != Sk, ragged lengths, GQA, D 64 and 128,
both modes, the deterministic mode's bits run to run, and ``flash_attention``'s backward taking this
kernel. The kernel's compile for sm_90 with a window is among test_attention_bwd_sm90's static cases."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from test_attention_bwd_sm90 import _inputs, _sm90, assert_oracle_passes

pytestmark = pytest.mark.attention


def test_a_left_side_alone_runs_with_a_right_side_that_cuts_nothing():
    """``bwd.sm90_scores``: a window's left side alone gains a right side of max(Sq, Sk) - 1 keys, which
    cuts no key of either alignment (the kernel's lower bound comes with an upper one); a side that
    cuts nothing is no side; every other window is the scores' own."""
    from tritonkit.ops.attention import bwd
    from tritonkit.ops.attention.common import Scores

    for scores, seq_q, seq_k, window in [
        (Scores(0.1, window=(1024, -1)), 4096, 4096, (1024, 4095)),
        (Scores(0.1, window=(16, -1), bottom_right=False), 700, 1300, (16, 1299)),
        (Scores(0.1, window=(100, -1)), 1300, 700, (100, 1299)),
        (Scores(0.1, window=(5000, -1)), 4096, 4096, (-1, -1)),  # cuts nothing: a full mask
        (Scores(0.1, causal=True, window=(100, 0)), 50, 50, (-1, 0)),  # cuts nothing at 50 keys
        (Scores(0.1, causal=True, window=(64, 0)), 4096, 4096, (64, 0)),
        (Scores(0.1, window=(200, 200)), 4096, 4096, (200, 200)),
        (Scores(0.1, window=(-1, 600)), 4096, 4096, (-1, 600)),
    ]:
        runs = bwd.sm90_scores(scores, seq_q, seq_k)
        assert runs.window == window, (scores, runs)
        assert runs._replace(window=scores.window) == scores
        (upper, lower, *_), flags = runs.kernel_args(seq_q, seq_k)
        if scores.window[1] < 0 and not scores.causal and window[0] >= 0:  # every row sees the last key
            assert flags["IS_CAUSAL"] and flags["HAS_LOWER"] and upper >= seq_k - 1


def _check_window(q, k, v, do, scores, deterministic: bool, config=None) -> tuple:
    """The kernel's (dq, dk, dv) for ``scores`` (written into NaN-filled buffers; ``config`` the
    kernel's, None its default), held by the oracle to autograd through the reference in float64,
    torch's error from the reference run in the inputs' dtype; returned for the bits' check."""
    from tritonkit.ops.attention import bwd, bwd_sm90
    from tritonkit.ops.attention.common import attention_reference

    seq_q, seq_k = q.shape[2], k.shape[2]
    options = {"causal": scores.causal, "bottom_right": scores.bottom_right, "window": scores.window}
    options["softcap"] = scores.softcap
    o, lse = attention_reference(
        q.double(), k.double(), v.double(), scale=scores.scale, return_lse=True, **options
    )
    o, lse = o.to(q.dtype), lse.float()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    for launch in bwd._delta_launches(o, do, None, delta):
        launch.run()
    (upper, lower, *_), flags = bwd.sm90_scores(scores, seq_q, seq_k).kernel_args(seq_q, seq_k)
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    bwd_sm90.attention_bwd_sm90(
        do, q, k, v, lse, delta, dq, dk, dv, scale=scores.scale, causal=flags["IS_CAUSAL"],
        upper_offset=upper, lower_offset=lower if flags["HAS_LOWER"] else None, softcap=scores.softcap,
        deterministic=deterministic, config=config,
    )  # fmt: skip

    def reference(dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention_reference(*inputs, scale=scores.scale, **options)
        return torch.autograd.grad(out, inputs, do.to(dtype))

    grads = (dq, dk, dv)
    assert_oracle_passes(grads, reference, q.dtype)
    return grads


# (B, Hq, Hkv, Sq, Sk, causal, bottom_right, window): causal windows whose left edge falls on and off
# the 64-row and 128-key blocks, wider and narrower than a key block's walk, Sq != Sk both ways and
# both alignments (rows that see no key), two-sided windows and either side alone, GQA and MQA, a
# soft cap beside a window (an optional ninth field); narrow windows (a key block's walk of one or two
# query blocks, masked at both ends), causal and two-sided
CASES = [
    (1, 2, 2, 1000, 1000, True, True, (600, 0)),
    (1, 2, 2, 1000, 1000, True, True, (639, 0)),
    (2, 3, 3, 777, 777, True, True, (700, 0)),
    (1, 4, 2, 2048, 2048, True, True, (1023, 0)),
    (1, 2, 2, 300, 1500, True, True, (700, 0)),
    (1, 2, 2, 1500, 300, True, True, (700, 0)),
    (1, 2, 2, 1500, 900, True, False, (700, 0)),
    (1, 2, 2, 1000, 1000, False, True, (400, 300)),
    (1, 2, 2, 700, 1300, False, False, (300, 500)),
    (1, 2, 2, 1000, 1000, False, True, (-1, 600)),
    (1, 2, 2, 1000, 1000, False, True, (600, -1)),
    (1, 4, 2, 700, 1300, False, False, (300, -1)),
    (1, 2, 2, 1300, 700, False, True, (100, -1)),
    (1, 8, 1, 1200, 1200, True, True, (777, 0)),
    (2, 4, 2, 900, 1100, True, True, (650, 0), 20.0),
    (1, 2, 2, 1000, 1000, True, True, (31, 0)),
    (1, 4, 2, 1000, 1000, True, True, (127, 0)),
    (2, 3, 3, 500, 700, True, True, (200, 0)),
    (1, 2, 2, 600, 400, True, False, (64, 0)),
    (1, 2, 2, 1000, 1000, False, True, (100, 50)),
    (1, 2, 2, 777, 777, True, True, (0, 0), 15.0),
]


def _case_id(case) -> str:
    shape = "x".join(map(str, case[:5]))
    mask = ("causal" if case[5] else "full") + ("" if case[6] else "-topleft")
    return f"{shape}-{mask}-window{case[7][0]},{case[7][1]}" + (
        f"-softcap{case[8]:g}" if len(case) > 8 else ""
    )


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True], ids=["any-order", "deterministic"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gpu_windows_match_the_reference(case, head_dim, deterministic):
    from tritonkit.ops.attention.common import Scores

    batch, heads_q, heads_kv, seq_q, seq_k, causal, bottom_right, window, *cap = case
    dtype = torch.float16 if CASES.index(case) % 3 == 2 else torch.bfloat16
    seed = 4 * CASES.index(case) + 2 * (head_dim == 128) + deterministic
    q, k, v, do = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, dtype, seed)
    scores = Scores(head_dim**-0.5, causal, bottom_right, window, *cap)
    grads = _check_window(q, k, v, do, scores, deterministic)
    if deterministic:  # the same bits again
        again = _check_window(q, k, v, do, scores, deterministic)
        assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


# windows whose walks end at different query blocks inside one turn's group (a left side): before
# the turns' ranks counted the head's query blocks rather than each walk's own end, two key blocks
# took the same rank in some group at one of these geometries and the dQ warps waited forever
TURN_CASES = [
    (1, 2, 2, 300, 1500, True, True, (700, 0)),
    (1, 2, 2, 1000, 1000, False, True, (400, 300)),
    (2, 4, 2, 900, 1100, True, True, (650, 0), 20.0),
    (1, 2, 2, 1500, 900, True, False, (700, 0)),
    (1, 4, 2, 1000, 1000, True, True, (127, 0)),
    (1, 2, 2, 700, 1300, False, False, (300, 500)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("turn_blocks", [2, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_windowed_turns_of_several_query_blocks(head_dim, turn_blocks):
    """Deterministic turns over several query blocks (``Config.turn_blocks``) under windows, at both
    step heights of D = 64 (128 rows, 64 with a soft cap) and D = 128's 64: the gradients pass the
    oracle and are the one-block turns' bits (a causal walk's adds come in the same order)."""
    from tritonkit.ops.attention import bwd_sm90
    from tritonkit.ops.attention.common import Scores

    for case in TURN_CASES:
        batch, heads_q, heads_kv, seq_q, seq_k, causal, bottom_right, window, *cap = case
        scores = Scores(head_dim**-0.5, causal, bottom_right, window, *cap)
        shipped = bwd_sm90.default_config(head_dim, True, heads_q != heads_kv, True, bool(cap))
        q, k, v, do = _inputs(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, torch.bfloat16, seed=seq_q)
        grouped = _check_window(q, k, v, do, scores, True, shipped._replace(turn_blocks=turn_blocks))
        single = _check_window(q, k, v, do, scores, True, shipped._replace(turn_blocks=1))
        assert all(torch.equal(a, b) for a, b in zip(grouped, single, strict=True)), case


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_flash_attention_backward_takes_the_gluon_kernel_with_a_window(deterministic, caplog):
    """A causal window, a narrow one and a left side alone go to this kernel."""
    import tritonkit

    q, k, v, _ = _inputs(1, 4, 4, 1024, 1024, 128, torch.bfloat16, seed=11)
    for causal, window, kernel in (
        (True, (700, 0), "sm_90 Gluon kernel"),
        (True, (64, 0), "sm_90 Gluon kernel"),
        (False, (700, -1), "sm_90 Gluon kernel"),
    ):
        caplog.clear()
        x = q.detach().clone().requires_grad_()
        with caplog.at_level(logging.DEBUG, logger="tritonkit"):
            tritonkit.flash_attention(
                x, k, v, causal=causal, window=window, deterministic=deterministic
            ).sum().backward()
        assert f"attention backward {tuple(q.shape)} on the {kernel}" in caplog.text, (window, caplog.text)
