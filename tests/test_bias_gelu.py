"""bias_gelu: outputs and gradients against the float64 reference, layouts, edges, errors, compile."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import sm90
from tritonkit.ops.bias_gelu import (
    APPROXIMATIONS,
    DTYPES,
    MAX_BLOCK_N,
    MAX_ROW_TILES,
    OPS,
    TILE_BYTES,
    bias_gelu,
    bias_gelu_reference,
)
from tritonkit.testing import (
    check_against_reference,
    compare,
    generator,
    poisoned_outputs,
    random_tensor,
)

bg = importlib.import_module("tritonkit.ops.bias_gelu")  # the module (the package names a function so)
OP = OPS["bias_gelu"]

pytestmark = pytest.mark.elementwise

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _tile_rows(n_cols: int, dtype: torch.dtype) -> int:
    """Rows of one tile (the launcher's tiling, computed from the module's constants)."""
    block_n = min(1 << (n_cols - 1).bit_length(), MAX_BLOCK_N)
    return max(1, TILE_BYTES // dtype.itemsize // block_n)


@pytest.fixture(autouse=True)
def one_sm(monkeypatch):
    """A device of one SM: the backward walks its MAX_ROW_TILES tiles a program wherever the rows
    allow (on 132 SMs, these small shapes would take one tile a program)."""
    monkeypatch.setattr(bg, "sm_count", lambda device: 1)


def test_row_tiles_leave_two_programs_an_sm():
    """Programs walk MAX_ROW_TILES tiles unless the GPU would then hold under two programs an SM:
    128 rows of 16384 bf16 entries (32 row tiles, 16 column blocks) take one tile a program."""
    assert bg.row_tiles_per_program(2048, 16, 132) == MAX_ROW_TILES  # 8192 rows: 2048 programs as before
    assert bg.row_tiles_per_program(32, 16, 132) == 1  # 512 programs, not 32
    assert bg.row_tiles_per_program(456, 5, 132) == 8  # 285 programs
    assert bg.row_tiles_per_program(3, 1, 1) == 1 and bg.row_tiles_per_program(33, 1, 1) == MAX_ROW_TILES


def _many_rows(n_cols: int, dtype: torch.dtype, chunks: int = 3) -> tuple[int, int]:
    """A shape whose backward walks all MAX_ROW_TILES tiles in ``chunks`` row chunks, the last short."""
    return ((chunks - 1) * _tile_rows(n_cols, dtype) * MAX_ROW_TILES + 3, n_cols)


GRID = [
    *[((7, 33), dtype, approximate) for dtype in DTYPES for approximate in APPROXIMATIONS],
    ((1, 1), F32, "none"),
    ((1, 1), BF16, "tanh"),
    ((37,), F16, "tanh"),  # 1-D input: a single row
    ((123, 257), BF16, "none"),
    ((123, 257), F16, "tanh"),
    ((2, 3, 96), F16, "none"),
    ((2, 3, 96), F32, "tanh"),
    ((5, 1), BF16, "tanh"),  # one column
    ((3, 1823), F32, "none"),  # two column blocks, the second ragged
    ((3, 1823), BF16, "tanh"),
    ((2, 2 * MAX_BLOCK_N + 1), F16, "none"),  # three column blocks, the last of one column
    (_many_rows(48, F32), F32, "tanh"),  # 48 columns: a partial column block too
    (_many_rows(48, BF16), BF16, "none"),
]


def _inputs(shape, dtype, device, seed):
    """Input, bias and upstream gradient: fresh seeded standard-normal values."""
    g = generator(seed)
    return (
        random_tensor(shape, dtype, device, generator=g),
        random_tensor(shape[-1:], dtype, device, generator=g),
        random_tensor(shape, dtype, device, generator=g),
    )


def _check(x, b, dy, approximate="none", grad_inputs=(0, 1), kernel=bias_gelu):
    return check_against_reference(
        kernel,
        bias_gelu_reference,
        [x, b],
        kwargs={"approximate": approximate},
        grad_inputs=grad_inputs,
        grad_outputs=[dy],
    )


@pytest.mark.parametrize("shape, dtype, approximate", GRID, ids=str)
def test_matches_reference(shape, dtype, approximate, device):
    comparisons = _check(*_inputs(shape, dtype, device, seed=len(shape) * 1000 + shape[-1]), approximate)
    assert [c.name for c in comparisons] == ["output[0]", "grad input[0]", "grad input[1]"]


def _backward_both_ways(x, b, dy, monkeypatch):
    """(dx, db) from the window backward and from the plain one (``WINDOWS`` off), outputs poisoned."""
    results = []
    for windows in (True, False):
        monkeypatch.setattr(bg, "WINDOWS", windows)
        dx, db = torch.full_like(x, float("nan")), torch.full_like(b, float("nan"))
        torch.ops.tritonkit.bias_gelu_backward(dy, x, b, "none", dx, db)
        results.append((dx, db))
    return results


@pytest.mark.parametrize(
    "shape, dtype",
    [((133, 27), BF16), ((45, 131), F16), ((29, 301), F32), ((1027, 17), BF16), ((9, 2 * 128 + 3), F32)],
    ids=str,
)
def test_window_backward_equals_the_plain_one(shape, dtype, device, monkeypatch):
    """Rows off their vectors, in windows: dx the plain kernel's bits (the same arithmetic an entry),
    db its sums in another order; several row tiles a program (one SM), several column blocks, rows
    of barely two vectors; and against the float64 reference."""
    x, b, dy = _inputs(shape, dtype, device, seed=shape[1])
    (dx, db), (plain_dx, plain_db) = _backward_both_ways(x, b, dy, monkeypatch)
    monkeypatch.setattr(bg, "WINDOWS", True)
    launch = bg._bwd_launches(dy, x, b, dx, torch.empty_like(b), "none")[0]
    assert launch.meta["WINDOW"] == 16 // dtype.itemsize and launch.meta["ROW_TILES"] > 1
    assert torch.equal(dx, plain_dx)
    torch.testing.assert_close(db, plain_db, rtol=1e-5 if dtype == F32 else 1e-2, atol=1e-5)
    assert all(c.passed for c in _check(x, b, dy)), [str(c) for c in _check(x, b, dy)]


def test_rows_shorter_than_two_vectors_take_no_windows(monkeypatch):
    """A row shorter than two vectors (16 bytes each) holds no whole vector wherever it starts, or
    one at most: windows bought it only small tiles (327218 x 5 fp16: 2557 programs of 16 tiles of
    8 rows, 0.28x the best peer in the sweep; in row tiles 640 tiles of 512 rows, where they are
    not flat)."""
    monkeypatch.setattr(bg, "FLAT", False)
    for n, window in ((1, 0), (5, 0), (15, 0), (16, 0), (17, 8), (27, 8)):
        x = torch.empty((4099, n), dtype=BF16)
        assert bg._bwd_tiles(x, torch.empty_like(x), torch.empty_like(x))[3] == window, n
    x = torch.empty((327218, 5), dtype=F16, device="meta")
    (bwd, _) = bg._bwd_launches(
        torch.empty_like(x), x, torch.empty(5, dtype=F16, device="meta"), x, x[0], "none"
    )
    assert (bwd.meta["BLOCK_M"], bwd.meta["WINDOW"], bwd.grid[0] * bwd.meta["ROW_TILES"]) == (512, 0, 640)


def test_grids_are_flat_so_long_rows_launch():
    """A grid's second dimension holds at most 65535 programs: a row of 13795015 fp32 entries was
    107774 column blocks of the backward and failed to launch (the sweep). Every grid is one
    dimension, row tiles fastest (``_tile_of_program``)."""
    for shape, dtype in (((4, 13795015), F32), ((3, 1 << 27), BF16), ((38788, 3027), BF16)):
        x = torch.empty(shape, dtype=dtype, device="meta")
        b, dy = torch.empty(shape[1:], dtype=dtype, device="meta"), torch.empty_like(x)
        launches = bg._fwd_launches(x, b, torch.empty_like(x), "none")
        launches += bg._bwd_launches(dy, x, b, torch.empty_like(x), torch.empty_like(b), "none")
        for launch in launches:
            assert len(launch.grid) == 1 and launch.grid[0] < 2**31, (shape, launch.name, launch.grid)
    # 38788 x 3027: the flat forward's blocks of 4096 entries (its rows are off their vectors), the
    # backward's as before
    assert [launch.grid for launch in launches[:2]] == [(28665,), (7296,)]


@pytest.mark.parametrize(
    "shape, dtype",
    [((333, 5), F16), ((57, 1), BF16), ((40, 3), F32), ((19, 27), BF16), ((3, 1823), F32), ((4, 7), F32)],
    ids=str,
)
def test_the_flat_forward_equals_the_row_tiles(shape, dtype, device, monkeypatch):
    """Rows off their 16-byte vectors (shorter than a vector too: TINY) go forward flat, bit for bit
    as the row tiles compute them, the bias read through a stride as well."""
    x, b, _ = _inputs(shape, dtype, device, seed=shape[1])
    strided_b = torch.stack([b, -b], dim=1)[:, 0]  # entries 2 apart
    for bias in (b, strided_b):
        monkeypatch.setattr(bg, "FLAT", True)
        (launch,) = bg._fwd_launches(x, bias, torch.empty_like(x), "tanh")
        assert launch.kernel.__name__ == "_bias_gelu_fwd_flat_kernel"
        assert launch.meta["TINY"] == (shape[1] * dtype.itemsize < 16)
        outputs = []
        for flat in (True, False):
            monkeypatch.setattr(bg, "FLAT", flat)
            with poisoned_outputs():
                outputs.append(bias_gelu(x, bias, approximate="tanh"))
        assert torch.equal(outputs[0], outputs[1])
        assert all(c.passed for c in _check(x, bias, torch.ones_like(x), "tanh", grad_inputs=()))


# (rows, N, dtype, SMs): more rows than a row tile holds, N under and over a vector, and on one SM a
# walk of four chunks a program (13 chunks of 2040 entries: the last program's first ragged, its
# other three past the end)
FLAT_BACKWARD = [
    (1100, 5, F16, None),
    (600, 3, F32, None),
    (700, 7, BF16, None),
    (5000, 1, BF16, None),
    (300, 13, F32, None),
    (5000, 5, F16, 1),
]


@pytest.mark.parametrize("rows, n, dtype, sms", FLAT_BACKWARD, ids=str)
def test_the_flat_backward_matches_the_reference(rows, n, dtype, sms, device, monkeypatch):
    """Narrow rows off their vectors go backward flat: chunks of whole rows and vectors, db summed a
    place over a program's chunks, then by column, then over programs."""
    if sms is not None:
        monkeypatch.setattr(bg, "sm_count", lambda device: sms)
    x, b, dy = _inputs((rows, n), dtype, device, seed=rows + n)
    launches = bg._bwd_launches(dy, x, b, torch.empty_like(x), torch.empty_like(b), "none")
    assert [launch.kernel.__name__ for launch in launches] == [
        "_bias_gelu_bwd_flat_kernel",
        "_sum_partials_kernel",
    ]
    length = launches[0].args[-1] * launches[0].meta["VECTOR"]
    assert length % n == 0 and length <= launches[0].meta["BLOCK"]
    if sms is not None:
        assert (launches[0].meta["CHUNKS"], launches[0].grid, length) == (4, (4,), 2040)
    _check(x, b, dy)


def test_which_backward_calls_go_flat(device):
    """Contiguous rows off their vectors of at most FLAT_BWD_MAX_N entries, past one plain tile of
    rows; not wider rows, aligned ones, strided ones, or one tile (one program sums db itself)."""

    def flat(x, dy):
        launch = bg._bwd_launches(dy, x, x[0], torch.empty_like(x), torch.empty_like(x[0]), "none")[0]
        return launch.kernel.__name__ == "_bias_gelu_bwd_flat_kernel"

    for n, expected in ((5, True), (bg.FLAT_BWD_MAX_N, False), (15, True), (17, False), (8, False)):
        x = torch.empty((4099, n), dtype=BF16, device=device)
        assert flat(x, torch.empty_like(x)) == expected, n
    x = torch.empty((4099, 5), dtype=BF16, device=device)
    assert not flat(torch.empty((5, 4099), dtype=BF16, device=device).t(), torch.empty_like(x))
    assert not flat(x[:100], torch.empty_like(x[:100]))  # one tile


def test_aligned_or_strided_rows_keep_the_row_tiles(device):
    """The flat forward needs one run of entries whose rows start off their vectors: aligned rows, a
    strided input and rows with gaps between them keep the row tiles."""
    x, b, _ = _inputs((12, 32), BF16, device, seed=1)
    odd, b_odd, _ = _inputs((12, 30), BF16, device, seed=2)
    for input, bias in ((x, b), (odd.t().contiguous().t(), b_odd), (x[:, :30], b_odd)):
        (launch,) = bg._fwd_launches(input, bias, torch.empty(input.shape, dtype=BF16, device=device), "none")
        assert launch.kernel.__name__ == "_bias_gelu_fwd_kernel"


@pytest.mark.parametrize("shape", [(21, 10), (2, 1), (64, 27)], ids=str)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_a_tiny_backward_is_one_launch(shape, dtype, device, monkeypatch):
    """An input of one plain tile of rows (rows off their vectors too) is one program, which
    writes db itself, cast as it stores it: no torch sum or copy after the kernel (three launches
    at 21 x 10, where torch.compile's backward is one kernel). The gradients match."""
    x, b, dy = _inputs(shape, dtype, device, seed=shape[0])
    db = torch.full_like(b, float("nan"))
    (launch,) = bg._bwd_launches(dy, x, b, torch.empty_like(x), db, "none")
    assert launch.grid[0] == 1 and launch.meta["WINDOW"] == 0 and launch.args[4] is db
    sums = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: sums.append(a) or torch.sum(*a, **k))
    assert all(c.passed for c in _check(x, b, dy)), [str(c) for c in _check(x, b, dy)]
    assert not sums


def test_which_backward_calls_take_windows(device):
    """Windows where rows start off their 16-byte vectors and every tensor's entries are contiguous
    from a 16-byte aligned start, past one plain tile of rows; not for aligned rows, strided
    entries, an offset start or rows that fit one tile (one program, no sum of db after it)."""
    x, b, dy = _inputs((133, 27), BF16, device, seed=3)

    def window(x, dy):
        dx = torch.empty_like(x)
        launch = bg._bwd_launches(dy, x, b, dx, torch.empty_like(b), "none")[0]
        return launch.meta["WINDOW"]

    assert window(x, dy) == 8
    assert window(x.float(), dy.float()) == 4
    wide = _inputs((133, 32), BF16, device, seed=4)
    assert window(wide[0], wide[2]) == 0  # every row on its vectors: the plain kernel's 16 bytes
    columns = torch.randn(27, 133, device=device).to(BF16).t()  # entries 133 apart
    assert window(columns, dy) == 0
    shifted = torch.randn(133 * 27 + 1, device=device).to(BF16)[1:].view(133, 27)  # 2 bytes past 16
    assert window(shifted, dy) == 0
    assert window(x[:128], dy[:128]) == 0  # 128 rows of 27: one plain tile of 32-entry rows


@pytest.mark.parametrize("shape", OP.shapes, ids=str)
def test_op_inputs_match_reference(shape, device):
    g = generator(7)
    inputs = OP.make_inputs(shape, F32, device, g)
    dy = random_tensor(shape, F32, device, generator=g)
    check_against_reference(OP.fn, OP.reference, inputs, grad_inputs=OP.grad_inputs, grad_outputs=[dy])


# ---------------------------------------------------------------- layouts


def _row_shaped(g, dtype, device, **layout):
    return random_tensor((9, 70), dtype, device, generator=g, **layout)


def _strided_input(g, dtype, device):
    x = _row_shaped(g, dtype, device, noncontiguous=True)
    assert x.stride() == (140, 2)
    return x, random_tensor((70,), dtype, device, generator=g), _row_shaped(g, dtype, device)


def _transposed_input(g, dtype, device):
    x = random_tensor((70, 9), dtype, device, generator=g).t()
    assert x.stride() == (1, 9)
    return x, random_tensor((70,), dtype, device, generator=g), _row_shaped(g, dtype, device)


def _strided_bias(g, dtype, device):
    b = random_tensor((70,), dtype, device, generator=g, noncontiguous=True)
    assert b.stride() == (2,)
    return _row_shaped(g, dtype, device), b, _row_shaped(g, dtype, device)


def _strided_grad_output(g, dtype, device):
    dy = _row_shaped(g, dtype, device, noncontiguous=True)
    assert not dy.is_contiguous()
    return _row_shaped(g, dtype, device), random_tensor((70,), dtype, device, generator=g), dy


@pytest.mark.parametrize(
    "make",
    [_strided_input, _transposed_input, _strided_bias, _strided_grad_output],
    ids=lambda f: f.__name__.strip("_"),
)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_strided_layouts(make, dtype, device):
    x, b, dy = make(generator(11), dtype, device)
    _check(x, b, dy, approximate="tanh")


def _expand_first(fn, rows):
    """``fn`` on its first argument broadcast to ``rows`` rows (a stride-0 view)."""
    return lambda x, bias, approximate: fn(x.expand(rows, -1), bias, approximate)


def _expand_bias(fn, cols):
    """``fn`` with a one-element bias broadcast to ``cols`` entries (a stride-0 view)."""
    return lambda x, bias, approximate: fn(x, bias.expand(cols), approximate)


def test_expanded_input(device):
    g = generator(12)
    row, b = random_tensor((1, 65), F32, device, generator=g), random_tensor((65,), F32, device, generator=g)
    dy = random_tensor((6, 65), F32, device, generator=g)
    assert bias_gelu(row.expand(6, -1), b).shape == (6, 65)
    check_against_reference(
        _expand_first(bias_gelu, 6),
        _expand_first(bias_gelu_reference, 6),
        [row, b],
        kwargs={"approximate": "none"},
        grad_inputs=(0, 1),
        grad_outputs=[dy],
    )


def test_expanded_bias(device):
    g = generator(13)
    x, b = random_tensor((6, 65), F32, device, generator=g), random_tensor((1,), F32, device, generator=g)
    # The bias gradient is one sum of 390 terms: a small dy keeps it near 1, the magnitude ATOL is for.
    dy = random_tensor((6, 65), F32, device, generator=g, scale=0.05)
    check_against_reference(
        _expand_bias(bias_gelu, 65),
        _expand_bias(bias_gelu_reference, 65),
        [x, b],
        kwargs={"approximate": "tanh"},
        grad_inputs=(0, 1),
        grad_outputs=[dy],
    )


# ---------------------------------------------------------------- edges and invariants


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 5), (3, 0)], ids=str)
def test_empty_input(shape, device):
    x = torch.empty(shape, device=device).requires_grad_()
    b = random_tensor(shape[-1:], F32, device, generator=generator(14)).requires_grad_()
    y = bias_gelu(x, b)
    assert y.shape == shape and y.dtype == F32
    grad_x, grad_b = torch.autograd.grad(y, (x, b), torch.empty(shape, device=device))
    assert grad_x.shape == shape
    torch.testing.assert_close(grad_b, torch.zeros_like(b), rtol=0, atol=0)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_far_tails(approximate, device):
    """gelu(z) = z for large positive z and 0 for large negative z (to fp32 rounding)."""
    g = generator(15)
    b = random_tensor((40,), F32, device, generator=g, scale=0.1)
    x = 8.0 + random_tensor((8, 40), F32, device, generator=g).abs()
    torch.testing.assert_close(bias_gelu(x, b, approximate), x + b, rtol=2e-7, atol=0)
    tail = bias_gelu(-x, b, approximate)
    assert tail.abs().max().item() < 1e-12 and (tail <= 0).all()


def test_exact_form_keeps_relative_precision_in_the_lower_tail(device):
    """Below z = -5.5 or so fp32's 0.5 z (1 + erf(z / sqrt 2)) cancels to -0 (torch's gelu, and the
    libdevice form this op used before jit.normal_cdf); the lower tail erfc / 2 keeps each value
    and its gradient within 1e-5 of the float64 reference relatively, down to z = -12."""
    z = -torch.linspace(1.0, 12.0, 257, dtype=torch.float64)
    x = z.float().to(device).reshape(1, -1).requires_grad_()
    b = torch.zeros(257, dtype=F32, device=device)
    y = bias_gelu(x, b)
    y.backward(torch.ones_like(y))
    exact_z = x.detach().double().cpu().reshape(-1)
    phi = 0.5 * torch.erfc(-exact_z / 2**0.5)
    pdf = torch.exp(-0.5 * exact_z**2) / (2 * torch.pi) ** 0.5
    for value, reference in ((y, exact_z * phi), (x.grad, phi + exact_z * pdf)):
        relative = (value.detach().double().cpu().reshape(-1) - reference).abs() / reference.abs()
        assert relative.max().item() < 1e-5, relative.max().item()


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_odd_part_is_identity(approximate, device):
    """gelu(z) - gelu(-z) = z for both forms, since Phi(z) + Phi(-z) = 1 and tanh is odd."""
    g = generator(16)
    x, b = (
        random_tensor((16, 50), F32, device, generator=g, scale=2.0),
        random_tensor((50,), F32, device, generator=g),
    )
    odd = bias_gelu(x, b, approximate).double() - bias_gelu(-x, -b, approximate).double()
    torch.testing.assert_close(odd, x.double() + b.double(), rtol=1e-6, atol=1e-6)


def test_fp32_tanh_gradients_over_seeds(device):
    """Where tanh(u) nears +-1, 1 - t*t cancels; the gradients must still meet the oracle on every seed."""
    for seed in range(6):
        _check(*_inputs((64, 256), F32, device, seed=seed), approximate="tanh")


# ---------------------------------------------------------------- bad arguments


def _valid_arguments(device):
    g = generator(18)
    return random_tensor((4, 8), F32, device, generator=g), random_tensor((8,), F32, device, generator=g)


# (turn valid input and bias into bad ones, expected exception, the argument its message starts with)
BAD_ARGUMENTS = [
    pytest.param(lambda x, b: (x.tolist(), b), TypeError, "input", id="input not a tensor"),
    pytest.param(lambda x, b: (x, b.tolist()), TypeError, "bias", id="bias not a tensor"),
    pytest.param(lambda x, b: ((100 * x).int(), (100 * b).int()), TypeError, "input", id="int input"),
    pytest.param(lambda x, b: (x.double(), b.double()), TypeError, "input", id="float64 input"),
    pytest.param(lambda x, b: (x, b.to(BF16)), TypeError, "bias", id="bias dtype"),
    pytest.param(lambda x, b: (x, torch.cat([b, b[:1]])), ValueError, "bias", id="bias length"),
    pytest.param(lambda x, b: (x, b[None]), ValueError, "bias", id="2-D bias"),
    pytest.param(lambda x, b: (x[0, 0], b[:1]), ValueError, "input", id="0-dim input"),
    pytest.param(lambda x, b: (x, b.to("meta")), ValueError, "bias", id="bias on another device"),
]


@pytest.mark.parametrize("corrupt, error, argument", BAD_ARGUMENTS)
def test_bad_arguments(corrupt, error, argument, device):
    with pytest.raises(error, match=rf"^{argument} "):
        bias_gelu(*corrupt(*_valid_arguments(device)))


def test_bad_approximate(device):
    with pytest.raises(ValueError, match="^approximate "):
        bias_gelu(*_valid_arguments(device), approximate="exact")


@pytest.mark.parametrize("dy_shape, dy_dtype", [((4, 9), F32), ((4, 8), F16)], ids=["shape", "dtype"])
def test_backward_rejects_mismatched_grad_output(dy_shape, dy_dtype, device):
    x, b = _valid_arguments(device)
    dy = random_tensor(dy_shape, dy_dtype, device, generator=generator(19))
    with pytest.raises(ValueError, match="grad_output"):
        torch.ops.tritonkit.bias_gelu_backward(dy, x, b, "none", torch.empty_like(x), torch.empty_like(b))


# ---------------------------------------------------------------- autograd, custom op, compile


@pytest.mark.parametrize("grad_inputs", [(0,), (1,)], ids=["input only", "bias only"])
def test_partial_gradients(grad_inputs, device):
    _check(*_inputs((10, 40), F32, device, seed=20), grad_inputs=grad_inputs)


# ---------------------------------------------------------------- cost model


# ---------------------------------------------------------------- GPU: large shapes


@pytest.mark.gpu
@pytest.mark.hbm
@pytest.mark.parametrize(
    "shape, dtype, approximate", [((8192, 4096), BF16, "none"), ((1823, 4097), F16, "tanh")], ids=str
)
def test_large_shapes_match_reference(shape, dtype, approximate, device):
    _check(*_inputs(shape, dtype, device, seed=25), approximate)


@pytest.mark.gpu
def test_input_on_cpu_rejected_on_gpu():
    x, b = _valid_arguments("cpu")
    with pytest.raises(ValueError, match="input must be a CUDA tensor"):
        bias_gelu(x, b)
    with pytest.raises(ValueError, match="bias"):
        bias_gelu(x.cuda(), b)


HUGE_COLS = 4096
HUGE_ROWS = 2**31 // HUGE_COLS + 3  # past 2^31 elements: int32 offsets would wrap
FIRST_ROW_PAST_2_31 = 2**31 // HUGE_COLS


def _huge_inputs(seed):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn((HUGE_ROWS, HUGE_COLS), generator=g, device="cuda", dtype=BF16)
    b = torch.randn((HUGE_COLS,), generator=g, device="cuda", dtype=BF16)
    rows = torch.tensor(
        [0, HUGE_ROWS // 2, FIRST_ROW_PAST_2_31 - 1, FIRST_ROW_PAST_2_31, HUGE_ROWS - 1], device="cuda"
    )
    return g, x, b, rows


@pytest.mark.gpu
@pytest.mark.hbm
def test_forward_past_2_31_elements():
    _, x, b, rows = _huge_inputs(seed=26)
    assert x.numel() > 2**31
    with poisoned_outputs():
        y = bias_gelu(x, b)
    assert not torch.isnan(y).any()
    reference = bias_gelu_reference(x[rows].double(), b.double())
    comparison = compare("sampled rows", y[rows], bias_gelu_reference(x[rows], b), reference, BF16)
    assert comparison.passed, str(comparison)


def _row_grads(x_rows, b, dy_rows, upcast=None):
    x_rows = x_rows.detach().to(upcast or x_rows.dtype).requires_grad_()
    b = b.detach().to(upcast or b.dtype).requires_grad_()
    out = bias_gelu_reference(x_rows, b)
    return torch.autograd.grad(out, (x_rows, b), dy_rows.to(out.dtype))


@pytest.mark.gpu
@pytest.mark.hbm
def test_backward_past_2_31_elements():
    g, x, b, rows = _huge_inputs(seed=27)
    dy = torch.randn(x.shape, generator=g, device="cuda", dtype=BF16)
    grad_x, grad_b = torch.full_like(x, float("nan")), torch.full_like(b, float("nan"))
    torch.ops.tritonkit.bias_gelu_backward(dy, x, b, "none", grad_x, grad_b)
    assert not torch.isnan(grad_x).any()
    reference_x, _ = _row_grads(x[rows], b, dy[rows], torch.float64)
    torch_x, _ = _row_grads(x[rows], b, dy[rows])
    comparison = compare("grad input rows", grad_x[rows], torch_x, reference_x, BF16)
    assert comparison.passed, str(comparison)
    del grad_x
    # db sums every row: the float64 reference in chunks, torch's bf16 autograd in one go.
    chunks = zip(x.split(1 << 16), dy.split(1 << 16), strict=True)
    reference_b = sum(_row_grads(xc, b, dyc, torch.float64)[1] for xc, dyc in chunks)
    comparison = compare("grad bias", grad_b, _row_grads(x, b, dy)[1], reference_b, BF16)
    assert comparison.passed, str(comparison)


# ---------------------------------------------------------------- compiles for Hopper, no GPU needed

_HOPPER_CHECK = r"""
import tritonkit.ops.bias_gelu as bg

COMMON = {"M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "constexpr", "stride_bn": "constexpr"}
for dtype in ("bf16", "fp32"):
    for tanh in (False, True):
        block_m, block_n = bg.tile_shape(4096, 2 if dtype == "bf16" else 4)
        fwd = {"x_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", **COMMON}
        bwd = {"dy_ptr": f"*{dtype}", "x_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "dx_ptr": f"*{dtype}",
               "db_partial_ptr": "*fp32", "M": "i32", "N": "i32", "stride_dym": "i32",
               "stride_dyn": "constexpr", "stride_xm": "i32", "stride_xn": "constexpr",
               "stride_bn": "constexpr"}
        meta = {"APPROX_TANH": tanh, "BLOCK_M": block_m, "BLOCK_N": block_n, "ALIGN": 1}
        for kernel, signature, extra in ((bg._bias_gelu_fwd_kernel, fwd, {}),
                                         (bg._bias_gelu_bwd_kernel, bwd, {"ROW_TILES": bg.MAX_ROW_TILES,
                                                                          "WINDOW": 0})):
            constexprs = {n: 1 for n, t in signature.items() if t == "constexpr"} | meta | extra
            report = compile_kernel(kernel, signature, constexprs, bg.NUM_WARPS)
            per_value = sum(report.opcodes.values()) * bg.NUM_WARPS * 32 / (block_m * block_n)
            print(kernel.__name__, dtype, tanh, round(per_value, 1), set(report.loads) == {128},
                  set(report.stores) == {128}, not report.spills)
"""


def test_kernels_compile_for_hopper_with_wide_accesses_and_no_spills():
    """Compiled for sm_90 with Triton's own ptxas (the interpreter never compiles): 16-byte global
    loads and stores on contiguous rows, and no stack or local memory (no spills)."""
    lines = sm90.run(_HOPPER_CHECK)
    assert len(lines) == 8, lines
    for line in lines:
        assert line.endswith("True True True"), line


# SASS instructions a value of each kernel's whole program at bf16 4096-entry rows, (exact, tanh):
# what the exact GELU through jit.normal_cdf compiled to (25 forward, 36.5 backward; libdevice's
# erf took 38 and 55 and held the 16-bit passes to 52-65% of the copy bandwidth on the H200), and
# the tanh form as z sigmoid(2u) in 16 bits (14 and 27, where tanh from exp(-2|u|) took 29 and 45)
INSTRUCTIONS_A_VALUE = {"_bias_gelu_fwd_kernel": (27, 16), "_bias_gelu_bwd_kernel": (39, 29)}


def test_16_bit_passes_compile_to_few_instructions_a_value():
    """A 16-bit pass moves 4 (forward) or 6 (backward) bytes a value: at the H200's copy rate its SMs
    issue about 32 or 48 instructions a value at most, so the GELU's arithmetic decides whether the
    pass is bound by memory or by instructions."""
    for line in sm90.run(_HOPPER_CHECK):
        kernel, dtype, tanh, per_value = line.split()[:4]
        if dtype == "bf16":
            assert float(per_value) <= INSTRUCTIONS_A_VALUE[kernel][tanh == "True"], line


def test_rows_of_any_length_move_as_wide_as_their_alignment_allows():
    """Rows of 2904 bf16 entries (a multiple of 8) move in 16-byte vectors in row tiles; rows off
    their 16-byte vectors (2900, a multiple of 4; 3027, odd; 5) move forward flat in 16-byte vectors
    (entry-wide loads only for the bias's gathers and the last program's tail), where row tiles
    moved them 8 or 2 bytes at a time; the backward takes rows off their vectors in windows:
    16-byte vectors but for the rows' first and last entries (an entry at a time) and its fp32 db
    partials, which the norms' second stage sums in loads as wide as their fp32 rows allow (16
    bytes, 4 at 3027)."""
    rows = sm90.access_widths("bias_gelu", [(4096, 2900), (4096, 2904), (4096, 3027)])
    sums = [row for row in rows if row["launch"] == "bwd partial sums"]
    assert [set(row["loads"]) for row in sums] == [{128}, {128}, {32}], sums
    rows = [row for row in rows if row not in sums] + sm90.access_widths("bias_gelu", [(327218, 5)])[:1]
    assert len(rows) == 7, rows
    for row in rows:
        n, backward = row["shape"][1], row["launch"] == "bwd"
        if n == 2904:
            assert set(row["loads"]) == set(row["stores"]) == {128}, row
        elif backward:
            assert max(row["loads"]) == max(row["stores"]) == 128, row
            assert row["loads"][128] == 4 and row["stores"][128] == 1, row  # x, dy (two tiles); dx
        else:  # flat: x and y in 16-byte vectors (16 entries a thread), in the last program's
            # masked branch too where M x N is a multiple of 16 (Triton knows it then)
            vectors = 4 if math.prod(row["shape"]) % 16 == 0 else 2
            assert row["launch"] == "fwd" and row["loads"][128] == row["stores"][128] == vectors, row


_FLAT_CHECK = r"""
import torch
import tritonkit.ops.bias_gelu as bg
from tritonkit.asm import compile_launch

for dtype, n in ((torch.bfloat16, 5), (torch.bfloat16, 3027), (torch.float32, 5), (torch.float32, 3027)):
    x = torch.empty((327218, n), dtype=dtype, device="meta")
    b = torch.empty((n,), dtype=dtype, device="meta")
    launches = bg._fwd_launches(x, b, x, "none") + bg._bwd_launches(x, x, b, x, b, "none")[:1]
    for launch in launches:
        report = compile_launch(launch)
        print(launch.kernel.__name__, report.registers, report.occupancy[0], not report.spills,
              max(report.loads), max(report.stores))
"""


def test_the_flat_kernels_keep_their_registers_and_their_programs():
    """The flat kernels' sm_90 compile: at most 80 registers a thread at 8 warps (the forward's bias
    gathered at 16 entries a thread; 32 at 4 warps held 110 registers), at least 3 programs an SM,
    no spills, x and dy read and y and dx written in 16-byte vectors (the backward's narrow rows;
    3027 goes backward in windows)."""
    lines = sm90.run(_FLAT_CHECK)
    kernels = [line.split()[0] for line in lines]
    flat = ["_bias_gelu_fwd_flat_kernel", "_bias_gelu_bwd_flat_kernel"]
    assert kernels == [*flat, flat[0], "_bias_gelu_bwd_kernel"] * 2, lines
    for line in lines:
        kernel, registers, programs, no_spills, load, store = line.split()
        assert no_spills == "True" and load == store == "128", line
        if kernel in flat:
            assert int(registers) <= 80 and int(programs) >= 3, line


_WINDOW_CHECK = r"""
import torch
import tritonkit.ops.bias_gelu as bg
from tritonkit.asm import compile_launch

for dtype, n in ((torch.bfloat16, 3027), (torch.float32, 195), (torch.bfloat16, 2900)):
    x = torch.empty((38788, n), dtype=dtype, device="meta")
    b = torch.empty((n,), dtype=dtype, device="meta")
    launch = bg._bwd_launches(x, x, b, x, torch.empty_like(b), "none")[0]
    report = compile_launch(launch)
    print(launch.meta["WINDOW"], report.registers, report.occupancy[0], not report.spills)
"""


def test_the_window_backward_keeps_registers_for_two_tiles_in_flight():
    """The window backward's sm_90 compile at the sweep's worst rows: 64-72 registers a thread, at
    least 7 programs an SM (each with this tile's and the next one's loads in flight), no spills.
    (The plain kernel at 38788 x 3027 bf16 held 168 registers, 3 programs an SM, and its 16-bit
    loads a few at a time: 13% of the copy bandwidth on the H200.)"""
    lines = sm90.run(_WINDOW_CHECK)
    assert [line.split()[0] for line in lines] == ["8", "4", "8"], lines
    for line in lines:
        _, registers, programs, no_spills = line.split()
        assert int(registers) <= 80 and int(programs) >= 7 and no_spills == "True", line
