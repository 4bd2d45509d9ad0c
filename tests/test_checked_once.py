"""Input checks once a call signature (``opdef.checked_once``): a signature that passed is not checked
again, and whatever a check reads besides the tensors' geometry (an option's value, or its type where
the check refuses a float) is in the signature, so that a bad call after good ones of the same tensors
still raises. (The norms' wiring: tests/test_norm.py. Where a check costs about what its signature does,
as linear's, bias_gelu's, cross_entropy's and quantize_fp8's, it runs every call: measured level or
slower once a signature on the CPU.)"""

from __future__ import annotations

import pytest
import torch

import tritonkit
from tritonkit.opdef import checked_once
from tritonkit.testing import generator, random_tensor

BF16, F32 = torch.bfloat16, torch.float32


def test_a_signature_that_passed_is_not_checked_again():
    checked = []

    def check(x, option):
        checked.append(option)
        if option == "bad":
            raise ValueError("bad option")

    once = checked_once(check, lambda x, option: (x.shape, option))
    x = torch.zeros(2)
    for _ in range(3):
        once(x, "good")
    assert checked == ["good"]
    with pytest.raises(ValueError, match="bad option"):
        once(x, "bad")
    with pytest.raises(ValueError, match="bad option"):
        once(x, "bad")  # a failed check is not remembered
    once(torch.zeros(3), "good")  # another signature: checked
    assert checked == ["good", "bad", "bad", "good"]


def test_a_signature_that_cannot_key_checks_every_call():
    checked = []
    once = checked_once(lambda x, option: checked.append(option), lambda x, option: (x.shape, option))
    for _ in range(2):
        once(torch.zeros(2), ["unhashable"])  # TypeError hashing the key
        once([1.0, 2.0], "good")  # AttributeError building it: the check says what is wrong
    once_none = checked_once(lambda x: checked.append("none"), lambda x: None)
    once_none(1), once_none(1)
    assert len(checked) == 6


def _tensors(*shapes, dtype=BF16, seed=0):
    g = generator(seed)
    return [random_tensor(shape, dtype, "cpu", generator=g) for shape in shapes]


def _linear():
    x, w = _tensors((4, 16), (8, 16))
    return x, w


def _rotary_hf():
    q, k, cos, sin = _tensors((1, 2, 4, 8), (1, 1, 4, 8), (4, 8), (4, 8))
    return q, k, cos, sin


def _packed_rotary():
    (x,) = _tensors((6, 2, 8))
    cos, sin = _tensors((8, 4), (8, 4), dtype=F32, seed=1)
    return x, cos, sin, torch.tensor([0, 2, 6], dtype=torch.int32)


# op -> (module whose check_tensor the check calls, its checked_once function, the first tensor's
# name, a good call, and bad calls of the same tensors: (call, error, message))
CASES = {
    "gated_linear": (
        "tritonkit.ops.linear.linear",
        "_validate_gated_once",
        "input",
        lambda: tritonkit.gated_linear(*_linear(), _linear()[1]),
        [
            (
                lambda: tritonkit.gated_linear(*_linear(), _linear()[1], "tanh"),
                ValueError,
                "^activation must be",
            )
        ],
    ),
    "apply_rotary_pos_emb": (
        "tritonkit.ops.rotary",
        "_validate_hf_once",
        "q",
        lambda: tritonkit.apply_rotary_pos_emb(*_rotary_hf()),
        [
            (
                lambda: tritonkit.apply_rotary_pos_emb(*_rotary_hf(), unsqueeze_dim=3),
                NotImplementedError,
                "^unsqueeze_dim must be",
            )
        ],
    ),
    "apply_rotary_emb": (
        "tritonkit.ops.rotary",
        "_validate_flash_once",
        "x",
        lambda: tritonkit.apply_rotary_emb(
            *_packed_rotary()[:3], cu_seqlens=_packed_rotary()[3], max_seqlen=4
        ),
        [
            (  # a float max_seqlen equal to the int that passed
                lambda: tritonkit.apply_rotary_emb(
                    *_packed_rotary()[:3], cu_seqlens=_packed_rotary()[3], max_seqlen=4.0
                ),
                ValueError,
                "^packed sequences",
            )
        ],
    ),
    "apply_rotary_emb, offset": (
        "tritonkit.ops.rotary",
        "_validate_flash_once",
        "x",
        lambda: tritonkit.apply_rotary_emb(_packed_rotary()[0].view(2, 3, 2, 8), *_packed_rotary()[1:3]),
        [  # an offset past the tables (the host knows an int one)
            (
                lambda: tritonkit.apply_rotary_emb(
                    _packed_rotary()[0].view(2, 3, 2, 8), *_packed_rotary()[1:3], seqlen_offsets=6
                ),
                ValueError,
                "^positions up to 8",
            )
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_op_checks_a_signature_once_and_still_refuses_bad_calls(name, monkeypatch):
    import importlib

    module_name, once_name, first, good, bad_calls = CASES[name]
    module = importlib.import_module(module_name)
    getattr(module, once_name).passed.clear()
    checked = []
    check = module.check_tensor
    monkeypatch.setattr(module, "check_tensor", lambda n, *a, **k: checked.append(n) or check(n, *a, **k))
    for _ in range(3):
        good()
    assert checked.count(first) == 1
    for bad, error, message in bad_calls:
        with pytest.raises(error, match=message):
            bad()
