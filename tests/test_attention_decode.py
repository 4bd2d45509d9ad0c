"""Decode attention over a KV cache (``ops/attention/decode.py``) against the float64 reference with
the oracle's rule: contiguous and paged caches (a shuffled block table), ragged lengths from 0 to
full, the new tokens appended where they belong and nowhere else, GQA, Sq 1, 3 and 4, windows, soft
caps, forced key splits; its custom op, the refusal of a gradient and of bad input. Small shapes
under the CPU interpreter."""

from __future__ import annotations

import functools
import gc
import json
import weakref

import pytest
import torch

import tritonkit
from tritonkit import _runtime, testing
from tritonkit.opdef import recording_calls
from tritonkit.ops.attention import decode
from tritonkit.oracle import compare

pytestmark = pytest.mark.attention

BF16 = torch.bfloat16


def _case(batch, seq_q, heads_q, heads_kv, head_dim, cache, lengths, device, slots=None, seed=0):
    """(q, k_cache, v_cache, k, v, cache_seqlens, block_table): a contiguous cache of ``cache``
    slots a sequence, or (``slots``) a paged one of shuffled blocks with two to spare. Every slot
    past a sequence's keys holds NaN, so a kernel that read one would show it."""
    g = testing.generator(seed)
    q = testing.random_tensor((batch, seq_q, heads_q, head_dim), BF16, device, generator=g)
    k, v = (
        testing.random_tensor((batch, seq_q, heads_kv, head_dim), BF16, device, generator=g) for _ in "kv"
    )
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    if slots is None:
        shape, table = (batch, cache, heads_kv, head_dim), None
    else:
        per_sequence = -(-cache // slots)
        order = torch.randperm(batch * per_sequence + 2, generator=torch.Generator().manual_seed(seed))
        table = order[: batch * per_sequence].view(batch, per_sequence).to(torch.int32).to(device)
        shape = (batch * per_sequence + 2, slots, heads_kv, head_dim)
    k_cache, v_cache = (testing.random_tensor(shape, BF16, device, generator=g) for _ in "kv")
    for b, length in enumerate(lengths):  # NaN past each sequence's cached keys
        positions = torch.arange(length, per_sequence * slots if slots else cache, device=device)
        blocks, slots_of = (
            (table[b, positions // slots].long(), positions % slots) if slots else (b, positions)
        )
        k_cache[blocks, slots_of] = v_cache[blocks, slots_of] = float("nan")
    return q, k_cache, v_cache, k, v, seqlens, table


def _check(args, append=True, **kwargs):
    """The call's output and lse against the reference's in float64 and in bf16."""
    q, k_cache, v_cache, k, v, seqlens, table = args
    new = (k, v) if append else (None, None)
    before = k_cache.clone(), v_cache.clone()
    with testing.poisoned_outputs():  # NaN in every output and partial until a kernel writes it
        out, lse = tritonkit.flash_attention_with_kvcache(
            q, k_cache, v_cache, *new, seqlens, table, return_lse=True, **kwargs
        )
    after = k_cache.clone(), v_cache.clone()

    def reference(dtype):
        cast = [t if t is None or not t.is_floating_point() else t.to(dtype) for t in (q, *before, *new)]
        kwargs_ref = {key: value for key, value in kwargs.items() if key != "num_splits"}
        return decode.kvcache_reference(*cast[:3], *cast[3:], seqlens, table, return_lse=True, **kwargs_ref)

    exact, in_dtype = reference(torch.float64), reference(BF16)
    finite = torch.isfinite(exact[1])  # rows that see no key: lse -inf (and an output of 0) in both
    assert torch.equal(torch.isfinite(lse), finite)
    comparisons = [
        compare("out", out, in_dtype[0], exact[0], BF16),
        compare("lse", lse[finite], in_dtype[1].float()[finite], exact[1][finite], torch.float32),
    ]
    assert all(c.passed for c in comparisons), [str(c) for c in comparisons]
    return out, lse, before, after


@pytest.mark.parametrize("seq_q", [1, 3, 4])
def test_contiguous_cache_with_the_new_tokens_appended(seq_q, device):
    """GQA 4/2, ragged lengths (0, partly filled, full but for the new tokens); the new keys and
    values land at cache_seqlens[b]... and every other slot keeps its bits (its NaN too)."""
    cache, lengths = 96, [0, 37, 96 - seq_q]
    args = _case(3, seq_q, 4, 2, 32, cache, lengths, device, seed=seq_q)
    _, _, before, after = _check(args, causal=True)
    k, v = args[3], args[4]
    for old, new, fresh in zip(before, after, (k, v), strict=True):
        expected = old.clone()
        for b, length in enumerate(lengths):
            expected[b, length : length + seq_q] = fresh[b]
        assert torch.equal(new.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("slots", [16, 64, 256])
def test_paged_cache_through_a_shuffled_block_table(slots, device):
    args = _case(2, 2, 6, 2, 64, 160, [0, 101], device, slots=slots, seed=slots)
    _, _, before, after = _check(args, causal=True)
    q, k_cache, _, k, _, _, table = args
    block, slot = int(table[1, 101 // slots]), 101 % slots
    assert torch.equal(after[0][block, slot], k[1, 0])  # the first new token of sequence 1
    changed = (after[0] != before[0]) & ~(torch.isnan(after[0]) & torch.isnan(before[0]))
    assert int(changed.any(-1).any(-1).sum()) == 2 + 2  # two tokens each of two sequences, nothing else


def test_attending_the_cache_alone_windows_and_soft_caps(device):
    """No append (the lengths are the keys), full and causal masks, a window, a soft cap."""
    args = _case(2, 2, 2, 2, 32, 80, [80, 45], device, seed=5)
    _check(args, append=False, causal=False)
    _check(args, append=False, causal=True, window=(20, -1), softcap=3.0)


def test_forced_splits_agree_with_one_split(device):
    """Three key splits folded by their lse give the single split's output and lse."""
    args = _case(2, 1, 4, 1, 32, 200, [200, 130], device, seed=7)
    one, lse_one, _, _ = _check(args, append=False, num_splits=1)
    three, lse_three, _, _ = _check(args, append=False, num_splits=3)
    torch.testing.assert_close(three.float(), one.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(lse_three, lse_one, atol=1e-4, rtol=1e-5)


def test_the_cost_model_counts_the_caches_once_for_the_group():
    """The bytes are K and V once (not once a query head), q and the output; FLOPs two products."""
    batch, heads_q, heads_kv, seq, head_dim, seq_q = 16, 32, 8, 8192, 128, 4
    cache = torch.empty(batch, seq, heads_kv, head_dim, dtype=torch.bfloat16, device="meta")
    q = torch.empty(batch, seq_q, heads_q, head_dim, dtype=torch.bfloat16, device="meta")
    cost = decode.kvcache_cost((batch, heads_q, heads_kv, seq, head_dim), torch.bfloat16, seq_q)
    assert cost.bytes == 2 * cache.nbytes + 2 * q.nbytes
    assert cost.flops == 2 * (2 * batch * heads_q * seq_q * seq * head_dim)


def test_more_splits_than_the_combine_loads_at_once(device, monkeypatch):
    """Seven splits folded two at a time (the combine's running max across its steps), the last
    splits of the shorter sequence holding no key, against the reference."""
    monkeypatch.setattr(decode, "COMBINE_SPLITS", 2)
    monkeypatch.setattr(decode, "_plans", {})  # no launch recorded before the change
    args = _case(2, 1, 4, 2, 32, 200, [200, 70], device, seed=9)
    _check(args, append=False, num_splits=7, scale=2.0)  # scores spread: the splits' lse far apart


def test_a_chunk_of_new_tokens_over_several_row_blocks(device):
    """17 new tokens of a GQA group of 4: 68 rows, over two programs of MAX_ROWS, two key splits."""
    assert decode.MAX_ROWS < 4 * 17
    args = _case(1, 17, 4, 1, 16, 48, [20], device, seed=11)
    _check(args, causal=True, num_splits=2)


@pytest.mark.parametrize("append", [False, True])
def test_pages_read_a_few_table_entries_at_a_time(append, device, monkeypatch):
    """Blocks a whole number of steps long take their table entries PAGES at a time: with two at a
    time, three splits of 96 keys (the second starts mid-block) walk several such reads each."""
    monkeypatch.setattr(decode, "PAGES", 2)
    monkeypatch.setattr(decode, "_plans", {})  # no launch recorded before the change
    assert 64 % decode.SPLIT_LAUNCH[0] == 0  # a block a whole number of steps (the kernel's PAGE_A_STEP)
    args = _case(2, 1, 4, 2, 32, 288, [288 - append, 150], device, slots=64, seed=13)
    _check(args, append=append, num_splits=3)
    q, k_cache, v_cache, k, v, seqlens, table = args
    table[1, 1] = -1  # a block the cache lacks, read in the step's table entries: NaN for that sequence
    out = tritonkit.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table
    )
    assert out[1].isnan().all() and not out[0].isnan().any()


def test_overrun_caches_and_missing_blocks_give_nan_without_a_sync(device):
    """Sequence 0's new tokens would run past its cache; sequence 1's table names a block the cache
    lacks: each gets NaN (outputs and lse), nothing is written past the cache or through the missing
    block, and sequence 2 is unharmed."""
    q, k_cache, v_cache, k, v, seqlens, table = _case(3, 2, 2, 1, 16, 64, [63, 20, 9], device, slots=16)
    table[1, 0] = k_cache.shape[0]  # one past the last block
    before = k_cache.clone()
    out, lse = tritonkit.flash_attention_with_kvcache(
        q, k_cache, v_cache, k, v, seqlens, table, return_lse=True
    )
    assert out[:2].isnan().all() and lse[:2].isnan().all()
    assert not out[2].isnan().any() and not lse[2].isnan().any()
    last = int(table[0, 3])  # sequence 0's last block: its final slot takes the first new token
    assert torch.equal(k_cache[last, 15], k[0, 0])
    unchanged = torch.ones(k_cache.shape[:2], dtype=torch.bool, device=device)
    unchanged[last, 15] = False
    unchanged[table[1, 1], 4:6] = False  # sequence 1's new tokens (its block 1 exists)
    unchanged[table[2, 0], 9:11] = False  # sequence 2's
    assert torch.equal(k_cache[unchanged].view(torch.int16), before[unchanged].view(torch.int16))


@pytest.mark.parametrize("splits", [1, 3])
def test_a_new_tokens_missing_block_gives_nan_and_writes_nothing(splits, device):
    """Sequence 0's new tokens fall in a block its table lacks (-1, then one past the last): NaN
    outputs and lse (the append was lost silently, with finite outputs), nothing written anywhere;
    sequence 1 is unharmed, split or not."""
    for missing in (-1, None):
        q, k_cache, v_cache, k, v, seqlens, table = _case(2, 2, 2, 1, 16, 48, [16, 20], device, slots=16)
        table[0, 1] = k_cache.shape[0] if missing is None else missing  # the block of positions 16-31
        before = k_cache.clone()
        out, lse = tritonkit.flash_attention_with_kvcache(
            q, k_cache, v_cache, k, v, seqlens, table, return_lse=True, num_splits=splits
        )
        assert out[0].isnan().all() and lse[0].isnan().all(), (missing, lse[0])
        assert not out[1].isnan().any() and not lse[1].isnan().any()
        unchanged = torch.ones(k_cache.shape[:2], dtype=torch.bool, device=device)
        unchanged[table[1, 1], 4:6] = False  # sequence 1's new tokens
        assert torch.equal(k_cache[unchanged].view(torch.int16), before[unchanged].view(torch.int16))


@pytest.mark.parametrize("length", [-2, 1025])
def test_a_broken_sequence_of_split_keys_gives_nan_lse(length, device):
    """A negative length or one past the cache, its keys split over programs (the default's split
    at 1024 keys, and four): NaN lse as well as outputs; the combine read the splits' NaN lse as
    'no key seen' and gave -inf, which a merge by lse takes for an empty sequence."""
    q, k_cache, v_cache, _, _, _, _ = _case(1, 1, 2, 1, 16, 1024, [1024], device, seed=3)
    seqlens = torch.tensor([length], dtype=torch.int32, device=device)
    for splits in (0, 4):
        out, lse = tritonkit.flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, return_lse=True, num_splits=splits
        )
        assert out.isnan().all() and lse.isnan().all(), (splits, lse)


def test_negative_lengths_give_nan_and_write_nothing(device):
    """A cache_seqlens entry below 0 (no sync checks it): that sequence's outputs and lse are NaN and
    its new tokens go nowhere (they once landed at slots 0...); the other sequence is unharmed."""
    q, k_cache, v_cache, k, v, seqlens, _ = _case(2, 3, 2, 1, 16, 32, [5, 9], device, seed=13)
    seqlens[0] = -2
    before = k_cache.clone()
    out, lse = tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True)
    assert out[0].isnan().all() and lse[0].isnan().all()
    assert not out[1].isnan().any() and not lse[1].isnan().any()
    assert torch.equal(k_cache[0].view(torch.int16), before[0].view(torch.int16))


def test_lengths_and_tables_read_through_strided_views(device):
    """cache_seqlens as every other entry of a longer tensor and a column-major block table: the
    call reads their values, and gives the contiguous ones' bits (appending the same slots)."""
    q, k_cache, v_cache, k, v, seqlens, table = _case(
        3, 2, 4, 2, 16, 64, [10, 40, 61], device, slots=16, seed=14
    )
    spaced = torch.full((6,), 1000, dtype=torch.int32, device=device)
    spaced[::2] = seqlens
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    got = tritonkit.flash_attention_with_kvcache(q, *caches[0], k, v, spaced[::2], table.t().contiguous().t())
    want = tritonkit.flash_attention_with_kvcache(q, *caches[1], k, v, seqlens, table)
    for a, b in zip((got, *caches[0]), (want, *caches[1]), strict=True):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_window_sides_past_every_key_are_unbounded(causal, device):
    """Sides up to 2^31 - 1, which the kernel's 32-bit offset + RIGHT once overflowed: the unbounded
    window's bits."""
    q, k_cache, v_cache, _, _, seqlens, _ = _case(2, 3, 2, 1, 16, 32, [5, 30], device, seed=15)
    want = tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, None, None, seqlens, causal=causal)
    for window in ((2**31 - 1, -1), (-1, 2**31 - 1), (2**31 - 1, 2**31 - 1)):
        got = tritonkit.flash_attention_with_kvcache(
            q, k_cache, v_cache, None, None, seqlens, causal=causal, window=window
        )
        assert torch.equal(_bits(got), _bits(want)), window


def test_one_int_length_for_every_sequence(device):
    """cache_seqlens as an int (flash-attn takes one), a numpy integer too: every sequence's length,
    as a tensor of it."""
    import numpy as np

    q, k_cache, v_cache, k, v, seqlens, _ = _case(2, 1, 4, 2, 16, 32, [7, 7], device, seed=16)
    want_caches = (k_cache.clone(), v_cache.clone())
    want = tritonkit.flash_attention_with_kvcache(q, *want_caches, k, v, cache_seqlens=seqlens)
    for length in (7, np.int32(7)):
        caches = (k_cache.clone(), v_cache.clone())
        got = tritonkit.flash_attention_with_kvcache(q, *caches, k, v, cache_seqlens=length)
        for a, b in zip((got, *caches), (want, *want_caches), strict=True):
            assert torch.equal(_bits(a), _bits(b)), type(length)


class _Replaying:
    """A stand-in for a GPU's recorded plan (the interpreter records none): runs the recorded
    launches again, as a replay does, without the op's call."""

    def __init__(self, launches, tensors):
        self.launches = launches

    def run(self, tensors) -> bool:
        for launch in self.launches:
            launch.run()
        return True


def test_appending_marks_the_caches_written(device, monkeypatch):
    """The append writes the caches in place: their version counters move, at the first call and at
    a replayed one (whose launches skip the op), so a product autograd saved them for raises at
    its backward rather than read the new tokens."""
    monkeypatch.setattr(decode, "_plans", {})
    monkeypatch.setattr(decode.Plan, "record", _Replaying)
    q, k_cache, v_cache, k, v, seqlens, _ = _case(1, 1, 2, 1, 16, 32, [5], device, seed=17)
    k_cache = torch.nan_to_num(k_cache)
    for _ in range(2):  # recorded, then replayed
        w = torch.ones_like(k_cache, requires_grad=True)
        saved = w * k_cache
        versions = k_cache._version, v_cache._version
        tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
        assert k_cache._version > versions[0] and v_cache._version > versions[1]
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.sum().backward()


def test_numpy_integers_for_the_window_and_splits(device):
    """Sides and a split count as numpy integers (int() once took them, and floats too): as ints."""
    import numpy as np

    q, k_cache, v_cache, _, _, seqlens, _ = _case(1, 1, 2, 1, 16, 32, [9], device, seed=18)
    want = tritonkit.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, window=(4, 0), num_splits=2
    )
    got = tritonkit.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, window=(np.int64(4), np.int32(0)), num_splits=np.int64(2)
    )
    assert torch.equal(_bits(got), _bits(want))


def test_an_empty_batch(device):
    q, k_cache, v_cache, _, _, seqlens, _ = _case(1, 1, 4, 2, 16, 32, [3], device)
    out = tritonkit.flash_attention_with_kvcache(q[:0], k_cache[:0], v_cache[:0], cache_seqlens=seqlens[:0])
    assert out.shape == (0, 1, 4, 16)


def test_the_split_rule_fills_the_sms_from_shapes_alone():
    assert decode.default_splits(64, 8, 8192, "cpu") == 1  # 512 programs: every SM busy
    assert decode.default_splits(1, 8, 8192, "cpu") == 32  # 8 programs: 256 keys a split at least
    sms = _runtime.NOMINAL_SMS
    # more than a third as many pairs as SMs: one wave of programs alone on their SMs, contiguous
    assert decode.default_splits(16, 8, 8192, "cpu") == 1  # 128 programs
    assert decode.default_splits(8, 8, 32768, "cpu") == sms // 64 == 2
    assert decode.default_splits(5, 8, 32768, "cpu") == 3 * sms // 40  # 40 pairs: three an SM at most
    # paged, as many splits as keep the programs within three an SM (6 on the H200's 132)
    assert decode.default_splits(8, 8, 32768, "cpu", paged=True) == 3 * sms // 64
    assert 8 * 8 * decode.default_splits(8, 8, 32768, "cpu", paged=True) <= 3 * sms
    assert decode.default_splits(16, 8, 8192, "cpu", paged=True) == 3
    assert decode.default_splits(1, 8, 300, "cpu") == 2  # a short cache: 256 keys a split at least
    assert decode.default_splits(1, 1, 10**6, "cpu") == decode.MAX_SPLITS


@pytest.mark.parametrize("head_dim, block_n", [(64, 128), (128, 128), (256, 64)])
def test_programs_alone_on_their_sms_take_deep_steps(head_dim, block_n):
    """A contiguous cache's programs, one an SM at most, step ALONE_STEP_BYTES of keys and values (192 KB
    in flight at three stages, whatever the head dim); more programs, or a paged cache, keep the launches
    by split count."""
    sms = _runtime.NOMINAL_SMS
    alone = decode._launch_config(sms, False, 1, head_dim, 2, "cpu")
    assert alone == (block_n, *decode.ALONE_LAUNCH[1:])
    assert 3 * alone[0] * head_dim * 2 * 2 <= 192 * 1024
    assert decode._launch_config(sms + 1, False, 1, head_dim, 2, "cpu") == decode.ONE_SPLIT_LAUNCH
    assert decode._launch_config(sms + 1, False, 3, head_dim, 2, "cpu") == decode.SPLIT_LAUNCH
    assert decode._launch_config(sms, True, 3, head_dim, 2, "cpu") == decode.SPLIT_LAUNCH


@pytest.mark.parametrize("sms", [1, _runtime.NOMINAL_SMS], ids=["sms-shared", "alone"])
def test_both_contiguous_launches_match_the_reference(sms, device, monkeypatch):
    """The same call with its programs sharing SMs (the launches by split count) and alone on them
    (ALONE_LAUNCH's 128-key steps): three splits of 300 keys, ragged lengths, the append."""
    monkeypatch.setattr(decode, "sm_count", lambda device: sms)
    monkeypatch.setattr(decode, "_plans", {})  # no launch recorded before the change
    args = _case(2, 1, 4, 2, 32, 300, [299, 170], device, seed=17)
    _check(args, num_splits=3)


def test_the_custom_op_and_a_gradient(device):
    q, k_cache, v_cache, k, v, seqlens, _ = _case(1, 1, 2, 1, 16, 32, [5], device, seed=9)
    q.requires_grad_(True)
    out = tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
    with pytest.raises(RuntimeError, match="has no backward: decoding needs none"):
        out.sum().backward()
    _, lse = tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, return_lse=True)
    with pytest.raises(RuntimeError, match="has no backward: decoding needs none"):
        lse.sum().backward()
    schema = str(decode._decode.custom_op._opoverload._schema)  # it names what it writes
    for written in ("k_cache", "v_cache", "out", "lse"):
        assert f"!) {written}" in schema, schema
    q = q.detach()
    with recording_calls() as calls:
        tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens)
    ((custom, args),) = calls
    torch.library.opcheck(custom, args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_compiles_without_a_graph_break_and_matches_eager(device):
    """The call with its append under torch.compile(fullgraph=True): the cache it writes and the
    output and lse it returns are eager's, bit for bit."""
    q, k_cache, v_cache, k, v, seqlens, table = _case(2, 2, 4, 2, 32, 64, [7, 40], device, slots=16, seed=12)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, k, v, seqlens, table):
        return tritonkit.flash_attention_with_kvcache(
            q, k_cache, v_cache, k, v, seqlens, table, return_lse=True, num_splits=2
        )

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, *caches[0], k, v, seqlens, table)
    want = step(q, *caches[1], k, v, seqlens, table)
    for a, b in zip((*got, *caches[0]), (*want, *caches[1]), strict=True):
        assert torch.equal(_bits(a), _bits(b))  # NaN in the cache's unused slots included


def test_a_call_like_a_checked_one_skips_the_check(device, monkeypatch):
    """The check runs once a call signature (shapes, strides, dtypes, devices, options): again for a
    new length of cache or a new window, not for new values; bad input is still refused after."""
    q, k_cache, v_cache, k, v, seqlens, _ = _case(2, 1, 4, 2, 16, 32, [3, 4], device)
    checks = []
    monkeypatch.setattr(decode, "_check", lambda *args: checks.append(args[0].shape))
    monkeypatch.setattr(decode, "_plans", {})
    for _ in range(3):
        tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens + 1)
    assert len(checks) == 1
    tritonkit.flash_attention_with_kvcache(q, k_cache[:, :24], v_cache[:, :24], k, v, cache_seqlens=seqlens)
    tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, window=(8, 0))
    assert len(checks) == 3
    monkeypatch.undo()
    with pytest.raises(ValueError, match="k must be"):
        tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k[:, :, :1], v, cache_seqlens=seqlens)


def _every_other_dim(t: torch.Tensor) -> torch.Tensor:
    """t's values as every other element of a tensor twice as wide in its last dim."""
    wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(q=a["q"].float()), "q must be one of"),
        (lambda a: a.update(q=a["q"][:, :, :3]), "q's 3 heads must be a multiple of the cache's 2"),
        (lambda a: a.update(v=None), "give both or neither"),
        (lambda a: a.update(cache_seqlens=None), "needs cache_seqlens"),
        (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), "cache_seqlens must be one of"),
        (lambda a: a.update(window=(-2, 0)), "window's left side must be an int >= -1"),
        (lambda a: a.update(window=(2.7, 0)), "window's left side must be an int >= -1"),
        (lambda a: a.update(num_splits=-1), "num_splits must be an int >= 0"),
        (lambda a: a.update(num_splits=2.5), "num_splits must be an int >= 0"),
        (lambda a: a.update(scale=float("nan")), "scale must be a finite number"),
        (lambda a: a.update(k_cache=_every_other_dim(a["k_cache"])), "k_cache must have a unit stride"),
        (lambda a: a.update(k=a["k"][:, :, :1]), "k must be \\(B, Sq, Hkv, D\\)"),
        (lambda a: a.update(k_cache=a["k_cache"][:, :0], v_cache=a["v_cache"][:, :0]), "fewer than the Sq"),
    ],
)
def test_bad_input_is_refused_by_name(change, message, device):
    q, k_cache, v_cache, k, v, seqlens, _ = _case(2, 1, 4, 2, 16, 32, [3, 4], device)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": seqlens}
    change(args)
    with pytest.raises((TypeError, ValueError), match=message):
        tritonkit.flash_attention_with_kvcache(**args)


_SASS_CHECK = r"""
import json, re, torch
from tritonkit.asm import compile_launch
from tritonkit.ops.attention import decode
def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")
HQ, HKV, S = 32, 8, 8192
WAIT = re.compile(r"ttg\.async_wait %[^{]*\{num = (\d+)")  # a loop's wait: how many loads stay in flight
# at B = 32 the plain call, the paged one, and both kinds of cache with splits and the append; at B = 16
# a program alone on its SM, at D = 128 and at D = 256 (64-key steps)
CASES = [(32, False, 1, 1, False, 128), (32, True, 1, 1, False, 128), (32, False, 4, 1, True, 128),
         (32, True, 3, 4, True, 128), (16, False, 1, 1, True, 128), (16, False, 1, 1, True, 256)]
for B, paged, splits, seq_q, append, D in CASES:
    q = meta(B, seq_q, HQ, D)
    cache = meta(B * S // 64, 64, HKV, D) if paged else meta(B, S, HKV, D)
    new = meta(B, seq_q, HKV, D) if append else None
    table = meta(B, S // 64, dtype=torch.int32) if paged else None
    part = meta(splits, B * HKV, HQ // HKV * seq_q, D, dtype=torch.float32)
    lse = meta(B, HQ, seq_q, dtype=torch.float32)
    for launch in decode.launches(
        q, cache, cache, new, new, meta(B, dtype=torch.int32), table, q, lse, part, part[..., 0], D**-0.5,
        True, -1, -1, 0.0,
    ):
        r = compile_launch(launch, "sm_90")
        print(json.dumps({"case": [paged, splits, seq_q, append, B, D], "launch": r.name, "spills": r.spills,
                          "spills_in_loops": r.spills_in_loops,
                          "hmma": r.opcodes["HMMA"], "registers": r.registers, "per_sm": r.occupancy[0],
                          "async_128": len(re.findall(r"LDGSTS\.E\.BYPASS\.128", r.asm["sass"])),
                          "loads": sorted(r.loads), "stores": sorted(r.stores),
                          "waits": [int(n) for n in WAIT.findall(r.asm["ttgir"])]}))
"""


def test_the_kernels_compile_for_hopper_to_tensor_cores_16_byte_loads_and_no_spills():
    """At (32, 32/8, 8192, 128) bf16, contiguous and paged, one split and several, Sq 1 and 4, with
    and without the append, and at B = 16 a program alone on its SM (D = 128 and 256): no spills; both
    products on tensor cores (HMMA: 16 rows are under wgmma's 64); keys and values streamed into
    shared memory 16 bytes a copy (LDGSTS.128, the pipelined loop's loads), waiting for the oldest
    step only; at least three programs an SM, whose loads overlap, or one alone with its deep steps;
    the combine reads 16-byte vectors (it writes one 256-byte row a program, whose stores are
    narrower)."""
    import sm90

    rows = [json.loads(line) for line in sm90.run(_SASS_CHECK)]
    assert len(rows) == 6 + 2
    for row in rows:
        paged, alone = row["case"][0], row["case"][4] == 16
        # none at all, but for the paged call of one split: one value stored at the kernel's entry and
        # loaded at its end (64-key steps at 168 registers, the most that keep three programs an SM)
        assert row["spills_in_loops"] == 0 and (paged or not row["spills"]), row
        if row["launch"] == "decode combine":
            assert 128 in row["loads"], row
            continue
        assert row["hmma"] > 0 and row["async_128"] > 0 and 128 in row["stores"], row
        # each loop waits for its oldest step's loads only, the next stages - 1 steps' in flight (a
        # paged cache's table entry loaded in the loop once made it wait for all of them)
        by_splits = decode.ONE_SPLIT_LAUNCH if row["case"][1] == 1 else decode.SPLIT_LAUNCH
        stages = (decode.ALONE_LAUNCH if alone else by_splits)[2]
        assert row["waits"] and all(n == stages - 1 for n in row["waits"]), row
        assert row["per_sm"] >= (1 if alone else 3), row


# ---------------------------------------------------------------- on the H200


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, seq_q, heads_q, heads_kv, head_dim, cache, slots, splits",
    [
        (4, 1, 32, 8, 128, 8192, None, 0),  # one split a program at B x Hkv = 32: the rule's splits
        (16, 1, 32, 8, 128, 8192, None, 0),  # 128 programs alone on their SMs, 128-key steps
        (4, 4, 32, 8, 128, 8192, 64, 0),  # speculative tokens, paged
        (2, 1, 32, 32, 128, 2048, 256, 1),  # MHA, blocks of 256, forced to one split
        (1, 1, 32, 8, 128, 32768, None, 0),  # B = 1: the rule's 32 splits
        (3, 2, 16, 2, 64, 3001, 16, 5),  # D = 64, an odd cache, blocks of 16, five splits
    ],
)
def test_gpu_large_caches_match_the_reference(
    batch, seq_q, heads_q, heads_kv, head_dim, cache, slots, splits, device
):
    """Ragged lengths from 0 to full, the new tokens appended, bf16 against float64."""
    lengths = [0, cache - seq_q, cache // 3][:batch] + [cache // 2 + 7] * max(0, batch - 3)
    args = _case(batch, seq_q, heads_q, heads_kv, head_dim, cache, lengths, device, slots=slots)
    _check(args, causal=True, num_splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [None, 64], ids=["contiguous", "paged"])
def test_gpu_a_cuda_graph_replays_with_new_lengths_and_tables(slots, device):
    """One call with its append, captured once; replayed with new lengths, new tokens and (paged) a
    new block table, each replay gives what an eager call on the same state gives, and the reference's
    output within the oracle's rule."""
    # every slot holds a key (no NaN past the first lengths: the replays attend to more of them)
    q, k_cache, v_cache, k, v, seqlens, table = _case(3, 1, 8, 2, 128, 1024, [1024] * 3, device, slots)
    seqlens.copy_(torch.tensor([10, 500, 900], dtype=torch.int32))
    call = functools.partial(tritonkit.flash_attention_with_kvcache, return_lse=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(q, k_cache.clone(), v_cache.clone(), k, v, seqlens, table)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call(q, k_cache, v_cache, k, v, seqlens, table)
    g = testing.generator(3)
    for step, lengths in enumerate([[11, 0, 1000], [700, 3, 64], [1023, 1023, 512]]):
        for t in (q, k, v):
            t.copy_(testing.random_tensor(t.shape, BF16, device, generator=g))
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        if table is not None:
            table.copy_(table[torch.randperm(3, generator=torch.Generator().manual_seed(step))])
        cache_before = k_cache.clone(), v_cache.clone()
        graph.replay()
        eager_cache = [c.clone() for c in cache_before]
        eager_out, eager_lse = call(q, *eager_cache, k, v, seqlens, table)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        assert torch.equal(k_cache, eager_cache[0]) and torch.equal(v_cache, eager_cache[1])
        exact = decode.kvcache_reference(
            q.double(), *(c.double() for c in cache_before), k.double(), v.double(), seqlens, table
        )
        expected = decode.kvcache_reference(q, *cache_before, k, v, seqlens, table)
        assert compare("out", out, expected, exact, BF16).passed, step


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [None, 64], ids=["contiguous", "paged"])
def test_gpu_a_call_like_an_earlier_one_replays_its_launches(slots, device, monkeypatch):
    """The first call of a signature records its launches (a Plan) and keeps none of its tensors;
    a later call of it replays them (the launch builder not called) with the same bits as a call
    launched anew; a q aligned otherwise is launched anew, with those bits too."""
    monkeypatch.setattr(decode, "_plans", {})
    q, k_cache, v_cache, k, v, seqlens, table = _case(2, 1, 8, 2, 128, 1024, [700, 1000], device, slots)
    tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, table)
    ((_, plan),) = decode._plans.values()
    assert plan is not None
    first_cache = weakref.ref(k_cache)
    del q, k_cache, v_cache, k, v, seqlens, table
    gc.collect()
    assert first_cache() is None
    q, k_cache, v_cache, k, v, seqlens, table = _case(
        2, 1, 8, 2, 128, 1024, [99, 1001], device, slots, seed=5
    )
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape).copy_(q)
    builds, build = [], decode.launches
    monkeypatch.setattr(decode, "launches", lambda *args: builds.append(args) or build(*args))
    results = {}
    for name, query in (("planned", q), ("unaligned", unaligned), ("anew", q)):
        if name == "anew":
            monkeypatch.setattr(decode, "_plans", {})
        caches = [c.clone() for c in (k_cache, v_cache)]
        before = len(builds)
        out, lse = tritonkit.flash_attention_with_kvcache(
            query, *caches, k, v, seqlens, table, return_lse=True
        )
        assert (len(builds) > before) == (name != "planned"), name
        results[name] = [_bits(t) for t in (out, lse, *caches)]
    for name in ("planned", "unaligned"):
        assert all(torch.equal(a, b) for a, b in zip(results[name], results["anew"], strict=True)), name


@pytest.mark.gpu
def test_gpu_a_decode_loop_equals_flash_attention_on_the_whole_sequence(device):
    """A paged cache filled with a prompt, then steps of one new token (and two of four, as
    speculative decoding verifies), each appended by the call: at every step the output is
    flash_attention's over the sequence so far, the new tokens last (causal, bottom-right)."""
    heads_q, heads_kv, head_dim, slots = 16, 4, 128, 64
    prompts, steps = [300, 517], [1] * 12 + [4, 4]
    g = testing.generator(4)
    capacity = max(prompts) + sum(steps)
    per_sequence = -(-capacity // slots)
    table = torch.randperm(2 * per_sequence, generator=torch.Generator().manual_seed(4)).view(2, -1)
    table = table.to(torch.int32).to(device)
    keys, values = (
        [testing.random_tensor((p, heads_kv, head_dim), BF16, device, generator=g) for p in prompts]
        for _ in "kv"
    )
    k_cache, v_cache = (
        torch.full((2 * per_sequence, slots, heads_kv, head_dim), float("nan"), dtype=BF16, device=device)
        for _ in "kv"
    )
    for b, length in enumerate(prompts):
        positions = torch.arange(length, device=device)
        blocks = table[b, positions // slots].long()
        k_cache[blocks, positions % slots], v_cache[blocks, positions % slots] = keys[b], values[b]
    seqlens = torch.tensor(prompts, dtype=torch.int32, device=device)
    for seq_q in steps:
        q = testing.random_tensor((2, seq_q, heads_q, head_dim), BF16, device, generator=g)
        k, v = (
            testing.random_tensor((2, seq_q, heads_kv, head_dim), BF16, device, generator=g) for _ in "kv"
        )
        out = tritonkit.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, table)
        for b in range(2):
            keys[b], values[b] = torch.cat([keys[b], k[b]]), torch.cat([values[b], v[b]])
            whole = tritonkit.flash_attention(
                q[b : b + 1].transpose(1, 2), keys[b][None].transpose(1, 2), values[b][None].transpose(1, 2),
                causal=True,
            )  # fmt: skip
            torch.testing.assert_close(out[b : b + 1].transpose(1, 2), whole, atol=1e-2, rtol=1e-2)
        seqlens += seq_q
