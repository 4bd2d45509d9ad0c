"""cross_entropy against the float64 reference with the oracle's rule, values and the logits'
gradient: vocabularies from 1 to 32000 and odd sizes, every reduction, class weights, label
smoothing with ignored rows, the z-loss, the soft cap, the returned lse and its own gradient, every
row ignored (torch's NaN mean), targets out of range (NaN, no sync), strided logits and int32
targets, and bad input refused by name; short rows both packed (many rows a program, the default)
and a row a program. The contract tests (tests/contract) add opcheck, compile,
poisoning, empty input and the cost model, and tests/test_inspect.py the sm_90 compile at the
benchmark's vocabularies (no spills, the logits and dx in 16-byte vectors)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tritonkit
from grids import case_id, in_turn, pairs_not_met
from tritonkit import _runtime, testing
from tritonkit._triton import tl, triton
from tritonkit.jit import softcap_tanh_and_sech2
from tritonkit.ops import cross_entropy as ce
from tritonkit.ops import cross_entropy_packed as packed
from tritonkit.ops import cross_entropy_split as split

pytestmark = pytest.mark.cross_entropy

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (rows, classes): one class; a few; a thousand; a vocabulary-sized row over several blocks
SIZES = [(6, 1), (9, 7), (17, 1000), (3, 32000)]
# keyword arguments beyond the defaults; "weight" stands for random class weights
FEATURES = [
    {},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.1, "ignore_index": 2},
    {"weight": True, "label_smoothing": 0.2},
    {"weight": True, "reduction": "none"},
    {"weight": True, "label_smoothing": 0.1, "reduction": "none"},  # the sum kernel for W alone
    {"z_loss": 1e-3, "softcap": 5.0},
    {"softcap": 2.0, "label_smoothing": 0.05, "reduction": "sum"},
]
# each feature meets each size, and each of them each dtype
GRID = in_turn(FEATURES, SIZES, last=[F32, BF16, F16])


def _inputs(rows: int, classes: int, dtype, device, seed: int = 0, ignore_index: int = -100):
    g = testing.generator(seed)
    x = testing.random_tensor((rows, classes), dtype, device, generator=g, scale=3.0)
    target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(seed)).to(device)
    target[::3] = ignore_index  # every third row ignored
    weight = torch.rand(classes, generator=torch.Generator().manual_seed(seed + 1)).to(device) + 0.5
    return x, target, weight


def _check(x, target, weight, upstream=None, **kwargs):
    reduction = kwargs.get("reduction", "mean")
    if upstream is None:
        shape = (x.shape[0],) if reduction == "none" else ()
        upstream = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(x)
    testing.check_against_reference(
        lambda x, t, w: tritonkit.cross_entropy(x, t, w, **kwargs),
        lambda x, t, w: ce.cross_entropy_reference(x, t, w, **kwargs),
        (x, target, weight),
        grad_inputs=(0,),
        grad_outputs=[upstream],
        dtype=x.dtype,
    )


def _check_lse(x, target, seed: int, **kwargs):
    """The returned lse and its own gradient (a random upstream one) against the reference."""
    upstream = torch.randn(x.shape[0], generator=torch.Generator().manual_seed(seed)).to(x.device)
    testing.check_against_reference(
        lambda x, t: tritonkit.cross_entropy(x, t, return_lse=True, **kwargs)[1],
        lambda x, t: ce.cross_entropy_reference(x, t, return_lse=True, **kwargs)[1],
        (x, target),
        grad_inputs=(0,),
        grad_outputs=[upstream],
    )


def test_the_grid_meets_every_pair():
    assert not pairs_not_met([(repr(f), s, d) for f, s, d in GRID])


@pytest.mark.parametrize(
    "features, size, dtype", GRID, ids=[case_id((i, *c[1:])) for i, c in enumerate(GRID)]
)
def test_matches_the_reference(features, size, dtype, device):
    kwargs = dict(features)
    x, target, weight = _inputs(*size, dtype, device, ignore_index=kwargs.get("ignore_index", -100))
    _check(x, target, weight if kwargs.pop("weight", False) else None, **kwargs)


# Rows short enough to pack (SIZES' first three) through the row-a-program kernels too
ROW_KERNELS_GRID = in_turn(FEATURES, SIZES[:3], last=[F32, BF16, F16])


@pytest.mark.parametrize(
    "features, size, dtype",
    ROW_KERNELS_GRID,
    ids=[case_id((i, *c[1:])) for i, c in enumerate(ROW_KERNELS_GRID)],
)
def test_short_rows_match_the_reference_a_program_a_row_too(features, size, dtype, monkeypatch, device):
    monkeypatch.setattr(packed, "PACKED", False)
    kwargs = dict(features)
    x, target, weight = _inputs(*size, dtype, device, ignore_index=kwargs.get("ignore_index", -100))
    _check(x, target, weight if kwargs.pop("weight", False) else None, **kwargs)


def _launches(x, target, weight=None, reduction="mean"):
    """The forward's and backward's launches for ``x`` and ``target`` (no smoothing, z-loss or cap)."""
    options = (-100, reduction, 0.0, 0.0, 0.0)
    out, lse, work = ce._forward_outputs(x, reduction, ce._needs_sums(reduction, weight, 0.0))
    rows, row_weight, totals = ce._work_parts(work, x.shape[0], reduction)
    fwd = ce._fwd_launches(x, target, weight, options, (out, rows, lse, row_weight, totals))
    grad = torch.ones((x.shape[0],) if reduction == "none" else (1,), dtype=x.dtype, device=x.device)
    return fwd, ce._bwd_launches(grad, None, x, target, weight, lse, totals, options, x)


@pytest.mark.parametrize(
    "features",
    [{}, {"weight": True, "label_smoothing": 0.1, "reduction": "none"}, {"z_loss": 1e-3, "softcap": 4.0}],
    ids=["mean", "weights-smoothing-none", "z_loss-softcap"],
)
def test_many_short_rows_pack_into_each_program(features, device):
    """300 rows of 76 bf16 classes (the sweep's 162064 x 76, shortened): 16 rows a program, 19
    programs, the last one partial, one launch a direction; its lse and the lse's gradient too."""
    kwargs = dict(features)
    x, target, weight = _inputs(300, 76, BF16, device, seed=76)
    weight = weight if kwargs.pop("weight", False) else None
    (fwd, *_), (bwd,) = _launches(x, target, weight, kwargs.get("reduction", "mean"))
    for launch in (fwd, bwd):
        assert launch.kernel in (
            packed._cross_entropy_fwd_packed_kernel,
            packed._cross_entropy_bwd_packed_kernel,
        )
        assert (launch.meta["ROWS"], launch.meta["BLOCK_C"], launch.meta["num_warps"], launch.grid) == (
            16,
            128,
            2,
            (19,),
        )
    _check(x, target, weight, **kwargs)
    _check_lse(x, target, seed=3, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_many_rows_are_summed_a_span_a_program_first(reduction, monkeypatch, device):
    """Over more than SUM_BLOCK rows the sum kernel adds the fp64 sums of spans of SUM_SPAN rows
    (here 16 and 8: 300 rows, 38 spans, the last partial); the same bits on a second call."""
    monkeypatch.setattr(ce, "SUM_BLOCK", 16)
    monkeypatch.setattr(ce, "SUM_SPAN", 8)
    x, target, weight = _inputs(300, 76, BF16, device, seed=5)
    fwd, _ = _launches(x, target, weight, reduction)
    assert [(launch.name, launch.grid) for launch in fwd[1:]] == [("fwd sum spans", (38,)), ("fwd sum", (1,))]
    _check(x, target, weight, reduction=reduction)
    first, second = (tritonkit.cross_entropy(x, target, weight, reduction=reduction) for _ in range(2))
    assert torch.equal(first, second)


# Few long rows split into segments (SPLIT_MIN_ROW_BYTES and the blocks made small): rows on their
# vectors and off them (1003 16-bit: the forward's segments in windows), the features that read the
# class weights by class and the smoothing sums
SPLIT_FEATURES = [
    {},
    {"weight": True, "label_smoothing": 0.1, "reduction": "none"},
    {"z_loss": 1e-3, "softcap": 4.0, "reduction": "sum"},
]
SPLIT_CASES = in_turn([(3, 1000), (2, 1003)], SPLIT_FEATURES, last=[F32, BF16])


@pytest.mark.parametrize("size, features, dtype", SPLIT_CASES, ids=map(case_id, SPLIT_CASES))
def test_few_long_rows_split_into_segments(size, features, dtype, monkeypatch, device):
    """A row's segments a program each: the forward's partials combined a program a row, the
    backward's segments written side by side; the loss, its lse and their gradients match the
    reference, the same bits on a second call."""
    monkeypatch.setattr(split, "SPLIT_MIN_ROW_BYTES", 0)
    monkeypatch.setattr(ce, "BLOCK_BYTES", 256)  # blocks of 64 (fp32) or 128 logits: several a segment
    kwargs = dict(features)
    x, target, weight = _inputs(*size, dtype, device, seed=size[1])
    weight = weight if kwargs.pop("weight", False) else None
    fwd, (bwd,) = _launches(x, target, weight, kwargs.get("reduction", "mean"))
    assert [launch.name for launch in fwd[:2]] == ["fwd segments", "fwd"]
    segments = fwd[0].grid[0] // size[0]
    assert bwd.kernel is split._cross_entropy_bwd_segments_kernel and bwd.grid == fwd[0].grid
    assert segments == -(-size[1] // (64 if dtype == F32 else 128)), segments  # 88 wanted: one block each
    _check(x, target, weight, **kwargs)
    _check_lse(x, target, seed=4, **kwargs)
    first, second = (tritonkit.cross_entropy(x, target, weight, **kwargs) for _ in range(2))
    assert torch.equal(first, second)


def test_the_split_takes_few_rows_of_a_megabyte():
    """Rows fewer than the SMs (132 nominal) of SPLIT_MIN_ROW_BYTES or more: segments of whole
    blocks, about SPLIT_PER_SM programs an SM in all."""
    assert split.split_segment(2, 12291808, 2, 8192, "cpu") == 98304  # 126 segments a row
    assert split.split_segment(4, 13795015, 4, 4096, "cpu") == 212992  # 65 a row
    assert split.split_segment(132, 13795015, 4, 4096, "cpu") == 0  # as many rows as SMs
    assert split.split_segment(8, 128256, 2, 8192, "cpu") == 0  # 256 KB rows
    assert split.split_segment(0, 13795015, 4, 4096, "cpu") == 0  # no rows: no launch but the sum


def test_rows_pack_where_one_warp_spans_them():
    """ROWS: TILE_BYTES of logits a program, for rows whose block 32 threads' vectors of the rows'
    alignment (16 bytes at most) span; no more rows than there are."""
    assert [packed.vector_entries(torch.empty(2, c, dtype=BF16), c) for c in (256, 76, 37)] == [8, 4, 1]
    assert packed.vector_entries(torch.empty(2, 64)[:, :60], 60) == 4  # the row stride (64) too
    assert packed.packed_rows(162064, 76, 2, 4) == 16 and packed.packed_rows(8192, 256, 2, 8) == 8
    assert packed.packed_rows(8192, 100, 4, 4) == 8 and packed.packed_rows(8192, 129, 4, 1) == 0
    assert packed.packed_rows(8192, 300, 2, 4) == 0 and packed.packed_rows(8192, 1000, 4, 8) == 0
    assert packed.packed_rows(3, 7, 4, 1) == 4 and packed.packed_rows(9, 37, 2, 1) == 0


_PACKED_SASS = r"""
import json, torch
from tritonkit.asm import compile_launch
from tritonkit.ops import cross_entropy as ce
for n, classes in ((4096, 256), (162064, 76), (2, 12291808)):
    for launch in ce._inspect_launches((n, classes), torch.bfloat16):
        r = compile_launch(launch, "sm_90")
        print(json.dumps({"classes": classes, "launch": launch.name, "kernel": launch.kernel.__name__,
                          "spills": r.spills, "loads": sorted(r.loads), "stores": sorted(r.stores)}))
"""


def test_packed_and_split_rows_compile_for_hopper_without_spills_and_as_wide_as_their_rows_allow():
    """Packed rows of 256 bf16 logits (16-byte rows) move in 16-byte vectors, rows of 76 (8-byte
    rows) in 8-byte ones; a row's target, lse and upstream gradient are single values, as in the
    row kernels. The sum's spans (162064 rows) read the rows' losses in 16-byte vectors and write an
    fp64 each. Split rows (2 x 12291808) move in 16-byte vectors both ways, a segment's partials
    fp64 values."""
    import sm90

    rows = [json.loads(line) for line in sm90.run(_PACKED_SASS)]
    expected = {(c, d) for c in (256, 76) for d in ("fwd", "bwd")} | {(76, "fwd sum spans")}
    assert {(row["classes"], row["launch"]) for row in rows} >= expected | {(12291808, "fwd segments")}
    for row in rows:
        assert not row["spills"], row
        if row["classes"] == 12291808 and row["launch"] in ("fwd segments", "bwd"):
            assert "segments" in row["kernel"] and 128 in row["loads"], row
            assert row["stores"] == ([128] if row["launch"] == "bwd" else [64]), row
        elif row["launch"] in ("fwd", "bwd") and row["classes"] != 12291808:
            assert "packed" in row["kernel"], row
            widest = 128 if row["classes"] == 256 else 64
            assert max(row["loads"]) == widest, row
            assert row["stores"] == [widest] if row["launch"] == "bwd" else max(row["stores"]) <= 32, row
        elif row["launch"] == "fwd sum spans":
            assert row["loads"] == [128] and row["stores"] == [64], row


def test_the_lse_and_its_gradient_with_the_loss(device):
    """return_lse: the capped logits' lse, and a loss that uses it (a z-loss of one's own) gets
    both gradients."""
    x, target, _ = _inputs(10, 300, F32, device, seed=1)

    def loss_and_lse(fn):
        def call(x, t, w):
            loss, lse = fn(x, t, w, reduction="none", softcap=4.0, return_lse=True)
            return loss, lse

        return call

    upstream = [torch.randn(10, generator=torch.Generator().manual_seed(s)).to(device) for s in (2, 3)]
    testing.check_against_reference(
        loss_and_lse(tritonkit.cross_entropy), loss_and_lse(ce.cross_entropy_reference), (x, target, None),
        grad_inputs=(0,), grad_outputs=upstream, dtype=F32,
    )  # fmt: skip


def test_every_row_ignored_gives_torchs_nan_mean_and_zero_gradient(device):
    x = testing.random_tensor((5, 11), F32, device, generator=testing.generator(4)).requires_grad_(True)
    target = torch.full((5,), -100, device=device)
    loss = tritonkit.cross_entropy(x, target)
    loss.backward()
    assert loss.isnan() and torch.equal(x.grad, torch.zeros_like(x))


def test_a_target_out_of_range_marks_its_row_nan(device):
    """No host sync reads the targets: the row with target C gets NaN loss and gradient, the
    others are right, and its mean is NaN."""
    x, target, _ = _inputs(6, 9, F32, device, seed=6)
    target[4] = 9
    x.requires_grad_(True)
    rows = tritonkit.cross_entropy(x, target, reduction="none")
    rows.sum().backward()
    assert rows[4].isnan() and x.grad[4].isnan().all()
    fine = torch.ones(6, dtype=torch.bool)
    fine[4] = False
    expected = ce.cross_entropy_reference(x.detach().double(), target.clamp(max=8), reduction="none")
    torch.testing.assert_close(rows.detach()[fine].double(), expected[fine])
    assert tritonkit.cross_entropy(x.detach(), target).isnan()


def test_strided_logits_and_int32_targets(device):
    """Logits as every other column of a wider tensor (column stride 2), targets int32."""
    g = testing.generator(7)
    x = testing.random_tensor((8, 130), BF16, device, generator=g, noncontiguous=True)
    assert x.stride(1) == 2
    target = torch.randint(0, 130, (8,), generator=torch.Generator().manual_seed(7)).to(device, torch.int32)
    _check(x, target, None, label_smoothing=0.1)


def test_a_cap_far_above_the_logits(device):
    """softcap 1e7 over logits of a few units: tanh of about 1e-7, whose (1 - e) / (1 + e) form kept
    only 6e-8 of absolute precision, 0.35 off once the cap multiplied it."""
    x, target, _ = _inputs(6, 37, F32, device, seed=9)
    _check(x, target, None, softcap=1e7)
    _check(x, target, None, softcap=1e7, reduction="none")


@triton.jit
def _capped_tanh(u_ptr, t_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    t, _ = softcap_tanh_and_sech2(tl.load(u_ptr + offsets))
    tl.store(t_ptr + offsets, t)


def test_the_caps_tanh_is_within_an_ulp_below_a_half_and_four_past_it(device):
    """The soft cap's tanh in fp32 against float64's, in ulps: its series below |u| = 1/2 within
    one (the (1 - e) / (1 + e) form there erred up to 6, and a fuzzed fp32 loss summed over 27 capped
    rows 3.4x torch's error), FMAs alone, on any device; the exponential form past it within four
    where the exponential is numpy's (the interpreter; the GPU's ex2.approx has its own error)."""
    u = torch.linspace(-1.5, 1.5, 4096, dtype=torch.float32, device=device)
    t = torch.empty_like(u)
    _capped_tanh[(1,)](u, t, N=4096)
    u, t = u.cpu(), t.cpu()
    exact = torch.tanh(u.double())
    ulps = (t.double() - exact).abs() / torch.from_numpy(np.spacing(exact.float().abs().numpy())).double()
    near = u.abs() < 0.5
    assert ulps[near].max() <= 1.0, ulps[near].max()
    if _runtime.interpret():
        assert ulps[~near].max() <= 4.0, ulps[~near].max()


@pytest.mark.parametrize("view", ["strided", "expanded"])
def test_class_weights_as_views(view, device):
    """Class weights as every other entry of a longer tensor, or one value expanded over the classes
    (stride 0): the kernels once read them as contiguous (the expanded one past its storage)."""
    x, target, weight = _inputs(6, 37, F32, device, seed=8)
    if view == "strided":
        wide = torch.zeros(74, device=device)
        wide[::2] = weight
        weight = wide[::2]
    else:
        weight = torch.tensor([2.0], device=device).expand(37)
    _check(x, target, weight, label_smoothing=0.1)
    _check(x, target, weight, reduction="none")


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda a: a.update(input=a["input"][None]), NotImplementedError, "takes \\(N, C\\) logits"),
        (lambda a: a.update(target=a["target"].float()), NotImplementedError, "class probabilities"),
        (lambda a: a.update(target=a["target"][:3]), ValueError, "target must have N = 4"),
        (lambda a: a.update(weight=a["input"].new_ones(6)), ValueError, "weight must have C = 5"),
        (
            lambda a: a.update(weight=a["input"].new_ones(5).requires_grad_()),
            NotImplementedError,
            "no gradient",
        ),
        (lambda a: a.update(reduction="avg"), ValueError, "reduction must be"),
        (lambda a: a.update(label_smoothing=1.5), ValueError, "label_smoothing must be in"),
        (lambda a: a.update(softcap=0.0), ValueError, "softcap must be None or"),
        (lambda a: a.update(z_loss=-1.0), ValueError, "z_loss must be"),
        (lambda a: a.update(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    ],
)
def test_bad_input_is_refused_by_name(change, error, message, device):
    args = {"input": torch.randn(4, 5, device=device), "target": torch.tensor([0, 1, 2, 3], device=device)}
    change(args)
    with pytest.raises(error, match=message):
        tritonkit.cross_entropy(**args)


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, classes, dtype, features",
    [
        (1024, 128256, BF16, {}),
        (512, 262144, BF16, {"label_smoothing": 0.1, "z_loss": 1e-4}),
        (2048, 50304, F16, {"softcap": 30.0, "reduction": "sum"}),
        (777, 151936, F32, {"weight": True, "reduction": "none"}),
        (1024, 50257, BF16, {"label_smoothing": 0.1}),  # GPT-2's odd vocabulary: in windows
        (333, 32001, F32, {"weight": True, "label_smoothing": 0.1, "reduction": "none"}),
    ],
)
def test_gpu_vocabulary_sized_rows_match_the_reference(rows, classes, dtype, features, device):
    kwargs = dict(features)
    x, target, weight = _inputs(rows, classes, dtype, device)
    _check(x, target, weight if kwargs.pop("weight", False) else None, **kwargs)


@pytest.mark.gpu
@pytest.mark.hbm
def test_gpu_logits_past_2_to_the_31_elements(device):
    """16385 rows of 131072 logits: the last rows' offsets need 64 bits. Rows at both ends, loss
    and gradient, against the reference on those rows alone."""
    rows, classes = 16385, 131072
    assert rows * classes > 2**31
    x, target, _ = _inputs(rows, classes, BF16, device, seed=8)
    x.requires_grad_(True)
    upstream = torch.randn(rows, device=device, generator=torch.Generator(device=device).manual_seed(9))
    with testing.poisoned_outputs():
        loss = tritonkit.cross_entropy(x, target, reduction="none")
        (grad,) = torch.autograd.grad(loss, x, upstream.to(BF16))
    for part in (slice(0, 4), slice(rows - 4, rows)):
        expected = x.detach()[part].double().requires_grad_(True)
        reference = ce.cross_entropy_reference(expected, target[part], reduction="none")
        (expected_grad,) = torch.autograd.grad(reference, expected, upstream[part].double().to(BF16).double())
        torch.testing.assert_close(loss[part].double(), reference, atol=0.1, rtol=1e-2)
        torch.testing.assert_close(grad[part].double(), expected_grad, atol=1e-3, rtol=2e-2)


def test_vocabularies_of_any_size_load_as_wide_as_their_alignment_allows():
    """Logits of 32008 classes (a multiple of 8: 16-byte rows) load in 16-byte vectors and their
    gradient stores so (``_launch.row_align``); of 32004 (rows off 16 bytes) in 16-byte vectors
    through windows, the ends of each row an entry at a time (``_launch.row_window``). Triton alone
    moved them an entry at a time. The target's logit, gathered alone, stays a single entry."""
    import sm90

    rows = sm90.access_widths("cross_entropy", [(512, 32004), (512, 32008)])
    for row in rows:
        windowed = row["shape"][1] == 32004
        if row["launch"] in ("fwd", "bwd"):  # 16-bit: the target's logit (and the ends, in windows)
            assert 128 in row["loads"] and (row["loads"].get(16, 0) > 1) == windowed, row
            # between: a row's target (64 bits), its lse and upstream gradient (32): single values
            assert {bits for bits in row["loads"] if 16 < bits < 128} <= {32, 64}, row
        if row["launch"] == "bwd":
            assert set(row["stores"]) == ({128, 16} if windowed else {128}), row
    assert {row["launch"] for row in rows} >= {"fwd", "bwd"}


def test_short_rows_take_fewer_warps(monkeypatch):
    """A program holds four 16-byte loads a thread a step: 8 warps at a full step (8192 16-bit or
    4096 fp32 logits), fewer for a shorter row's (195 classes: 1), both row kernels alike (packing
    off: test_many_short_rows_pack_into_each_program has the packed kernels' warps)."""
    monkeypatch.setattr(packed, "PACKED", False)
    warps = lambda classes, size: ce._step(classes, size)[1]  # noqa: E731
    assert warps(32000, 2) == warps(8192, 2) == warps(4096, 4) == 8 and warps(3027, 2) == 4
    assert warps(195, 4) == warps(1, 2) == 1 and ce._step(195, 4)[0] == 256
    for classes, warps in ((195, 1), (3027, 4), (32000, 8)):
        logits, target = torch.randn(3, classes, dtype=torch.bfloat16), torch.randint(0, classes, (3,))
        (fwd, *_), (bwd,) = _launches(logits, target)
        assert fwd.meta["num_warps"] == bwd.meta["num_warps"] == warps, classes


# Vocabularies whose rows start off their vectors (odd: every row on another alignment), read in
# windows and (WINDOWS off) an entry at a time, with the features that read class weights by class;
# through the row kernels (packing off: 33 classes would pack, and the packed kernels have no windows).
ODD_FEATURES = [{}, {"weight": True, "label_smoothing": 0.2}, {"softcap": 3.0, "reduction": "none"}]
ODD = in_turn([33, 8195, 50257], ODD_FEATURES, [True, False], last=[BF16, F32])


@pytest.mark.parametrize("classes, features, windows, dtype", ODD, ids=map(case_id, ODD))
def test_odd_vocabularies_in_windows_and_without(classes, features, windows, dtype, monkeypatch, device):
    monkeypatch.setattr(ce, "WINDOWS", windows)
    monkeypatch.setattr(packed, "PACKED", False)
    kwargs = dict(features)
    x, target, weight = _inputs(5, classes, dtype, device, seed=classes)
    _check(x, target, weight if kwargs.pop("weight", False) else None, **kwargs)
    out, lse, work = ce._forward_outputs(x, "mean", True)
    rows, row_weight, totals = ce._work_parts(work, x.shape[0], "mean")
    outputs = (out, rows, lse, row_weight, totals)
    launch = ce._fwd_launches(x, target, None, (-100, "mean", 0.0, 0.0, 0.0), outputs)[0]
    assert launch.meta["WINDOW"] == ((4 if dtype == F32 else 8) if windows else 0)
