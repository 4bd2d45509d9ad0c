"""The linear family's untuned tiles against the H200's shipped tuning records (every candidate's
time at each tuned key): what a first call on a shape no tuning covers runs."""

from __future__ import annotations

import pytest
import torch

from tritonkit import tuning
from tritonkit.ops.linear import kernels as lk
from tritonkit.ops.linear import matmul as mm

pytestmark = pytest.mark.linear


# the most each group's untuned tile may run over the key's fastest, and how far the fixed tile ran
GROUPS = {  # (form, large, epilogue): bound
    ("linear", True, False): 1.15,  # fixed tile: up to 1.69x
    ("linear", True, True): 1.30,
    ("gated fwd", True, False): 1.05,
    ("gated fwd", True, True): 1.05,
    ("gated dx", True, False): 1.05,
    ("linear", False, False): 1.80,  # decode-like: fixed tile up to 3.0x
    ("linear", False, True): 1.80,
    ("gated fwd", False, True): 1.10,
    ("gated dx", False, False): 1.05,
}


def test_untuned_tiles_are_near_each_records_fastest(monkeypatch):
    """At every record of M >= 4096 rows (N and K at least 1024) and of decode-like M (at most
    DECODE_ROWS, K at least 1024), ``untuned_tile``'s config was timed and is within its group's
    bound of the fastest, and on average past the fixed tile it replaced."""
    monkeypatch.setattr(mm, "interpret", lambda: False)
    monkeypatch.setattr(lk, "interpret", lambda: False)
    checked, gained = 0, []
    for entry in tuning.shipped_records("linear"):
        key = entry["key"]
        large = key["m"] >= mm.LARGE_M and min(key["n"], key["k"]) >= mm.LARGE_NK
        if not (large or (key["m"] <= lk.DECODE_ROWS and key["k"] >= mm.LARGE_NK)):
            continue
        tile = mm.untuned_tile(key)
        ratio = tuning.time_over_fastest(entry, tile)
        assert ratio <= GROUPS[key["form"], large, key["epilogue"]], (key, tile)
        gained.append(tuning.time_over_fastest(entry, lk.DEFAULT_CONFIGS[key["form"]]) / ratio)
        checked += 1
    assert checked >= 35 and sum(gained) / len(gained) > 1.2


def test_untuned_tiles_are_the_fixed_one_elsewhere_and_under_the_interpreter(monkeypatch):
    key = {"form": "linear", "epilogue": False, "dtype": "bf16", "out": "bf16", "m": 8192, "n": 4096,
           "k": 4096, "a": "k-major", "b": "k-major"}  # fmt: skip
    for module in (mm, lk):
        monkeypatch.setattr(module, "interpret", lambda: True)
    assert mm.untuned_tile(key) == lk.INTERPRETER_CONFIG
    for module in (mm, lk):
        monkeypatch.setattr(module, "interpret", lambda: False)
    assert mm.untuned_tile(key) == mm.LARGE_TILES["linear"]
    assert mm.untuned_tile(key | {"k": 16}) == lk.DEFAULT_CONFIGS["linear"]  # (neither group)
    assert mm.untuned_tile(key | {"m": 64}) == mm.DECODE_TILES["linear"]


def test_the_layers_gated_dx_takes_the_wide_tile(monkeypatch):
    """The gated dx at Llama-3-8B's MLP (8192 x 4096 x 14336): no shipped record (those timed the
    kernel whose products ran side by side, two tiles of each a step), so the untuned 128 x 256
    tile runs, which the prune keeps."""
    for module in (mm, lk):
        monkeypatch.setattr(module, "interpret", lambda: False)
    meta = {"dtype": torch.bfloat16, "device": "meta"}
    dg, du = (torch.empty(8192, 14336, **meta) for _ in "gu")
    wg, wu = (torch.empty(14336, 4096, **meta) for _ in "gu")
    problem = mm.matmul_problem(
        dg, wg.t(), torch.empty(8192, 4096, **meta), a2=du, b2=wu.t(), gated=lk.GATED_DX
    )
    key = mm.tuning_key(problem)
    assert key["form"] == "gated dx" and not [e for e in tuning.shipped_records("linear") if e["key"] == key]
    assert mm.untuned_tile(key) == mm.LARGE_TILES["gated dx"] and mm.LARGE_TILES["gated dx"]["BLOCK_N"] == 256
