"""``@triton.jit`` helpers and constants that more than one family's kernels use.

A family's kernels import these by name (``from tritonkit.jit import LOG2E, gelu``); helpers that
only one family uses stay in that family's ``kernels`` module. Kernels read globals only as
constexprs, so every constant here is one.
"""

from __future__ import annotations

from tritonkit._triton import tl, triton

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e)): one FMA and one MUFU.EX2
LN2 = tl.constexpr(0.6931471805599453)  # log(s) = log2(s) * ln(2)

SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
# tanh's Taylor coefficients of u^5 ... u^17 (2/15, -17/315, 62/2835, -1382/155925, 21844/6081075,
# -929569/638512875, 6404582/10854718875)
TANH_SERIES_5 = tl.constexpr(2.0 / 15.0)
TANH_SERIES_7 = tl.constexpr(-17.0 / 315.0)
TANH_SERIES_9 = tl.constexpr(62.0 / 2835.0)
TANH_SERIES_11 = tl.constexpr(-1382.0 / 155925.0)
TANH_SERIES_13 = tl.constexpr(21844.0 / 6081075.0)
TANH_SERIES_15 = tl.constexpr(-929569.0 / 638512875.0)
TANH_SERIES_17 = tl.constexpr(6404582.0 / 10854718875.0)
TANH_CUBIC = tl.constexpr(0.044715)  # coefficient of GELU's tanh approximation (Hendrycks & Gimpel)


@triton.jit
def aligned(value, ALIGN: tl.constexpr):
    """``value``, a multiple of ALIGN (the launch checked: ``_launch.row_align``), written so that
    Triton knows it. Triton specializes integers only as multiples of 16, so a row of 2900 bf16
    entries (or a row stride of 2904) loaded one 16-bit entry an instruction; knowing N and the row
    strides multiples of 4 (or 8), it loads 8 (or 16) bytes at a time."""
    return value // ALIGN * ALIGN


@triton.jit
def dot_fp32(a, b, EXACT_DOT_IN_FP32: tl.constexpr):
    """a @ b with an fp32 result: 16-bit tiles on tensor cores, or as fp32 under the interpreter,
    whose bf16 dot products Triton 3.6 gets wrong (the products of 16-bit values are exact in fp32)."""
    if EXACT_DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def tanh_and_sech2(u):
    # With e = exp(-2|u|) <= 1 (no overflow for any u): tanh|u| = (1 - e) / (1 + e) and
    # sech^2 u = 1 - tanh^2 u = 4e / (1 + e)^2, which keeps full precision where tanh is near +-1
    # (1 - t*t would cancel there and lose the gradient's low bits).
    e = tl.exp(-2.0 * tl.abs(u))
    inv = 1.0 / (1.0 + e)
    t = (1.0 - e) * inv
    return tl.where(u >= 0, t, -t), 4.0 * e * inv * inv


@triton.jit
def softcap_tanh_and_sech2(u):
    """tanh_and_sech2, with tanh for |u| < 1/2 by its series through u^17 (u plus u^3 times a Horner
    polynomial in u^2): within 0.7 ulp of fp32 there (numpy's fp32 emulation), where (1 - e) / (1 +
    e) cancels (up to 6.1 ulp at |u| = 1/16 to 1/4, 3.8 to 1/2, and only 6e-8 of absolute precision
    near 0, which a soft cap multiplies back: a cap of 1e7 put cross-entropy's loss 0.35 off). Past
    1/2 the exponential form is within 3.3 ulp."""
    t, sech2 = tanh_and_sech2(u)
    u2 = u * u
    p = TANH_SERIES_17 * u2 + TANH_SERIES_15
    p = p * u2 + TANH_SERIES_13
    p = p * u2 + TANH_SERIES_11
    p = p * u2 + TANH_SERIES_9
    p = p * u2 + TANH_SERIES_7
    p = p * u2 + TANH_SERIES_5
    p = p * u2 - 1.0 / 3.0
    return tl.where(tl.abs(u) < 0.5, u + u * u2 * p, t), sech2


@triton.jit
def gelu(z, APPROX_TANH: tl.constexpr):
    """GELU of fp32 ``z``: z * Phi(z) by erf, or (APPROX_TANH) 0.5 z (1 + tanh(sqrt(2/pi) (z + c z^3)))."""
    if APPROX_TANH:
        t, _ = tanh_and_sech2(SQRT_2_OVER_PI * (z + TANH_CUBIC * z * z * z))
        return 0.5 * z * (1.0 + t)
    else:
        return 0.5 * z * (1.0 + tl.math.erf(z * SQRT_HALF))


@triton.jit
def gelu_grad(z, APPROX_TANH: tl.constexpr):
    """d gelu(z) / dz for fp32 ``z``, in the same form as :func:`gelu`."""
    if APPROX_TANH:
        t, sech2 = tanh_and_sech2(SQRT_2_OVER_PI * (z + TANH_CUBIC * z * z * z))
        du_dz = SQRT_2_OVER_PI * (1.0 + 3.0 * TANH_CUBIC * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * sech2 * du_dz
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * SQRT_HALF))
        return cdf + z * INV_SQRT_2PI * tl.exp(-0.5 * z * z)


@triton.jit
def reciprocal_at_least_one(d):
    """1 / d of fp32 ``d`` >= 1 (+inf gives 0) as rsqrt(d)^2: MUFU.RSQ and an FMUL, where fp32
    division (``div.full``) compiles to eight instructions with its range checks, which d >= 1
    never needs; within a few ulps (rsqrt.approx's error, doubled)."""
    r = tl.math.rsqrt(d)
    return r * r


# GELU's tanh form as z sigmoid(2u) = z / (1 + 2^E), E = z (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC z^2)
# (u = sqrt(2 / pi) (z + 0.044715 z^3)): one MUFU.EX2 and a reciprocal
GELU_EXP2_LINEAR = tl.constexpr(-2.0 * SQRT_2_OVER_PI.value * LOG2E.value)
GELU_EXP2_CUBIC = tl.constexpr(-2.0 * SQRT_2_OVER_PI.value * LOG2E.value * TANH_CUBIC.value)


# Phi(z) = erfc(x) / 2 with x = -z / sqrt(2), from erfc(x) = t exp(-x^2 + P(t)) for x >= 0, t = 1 /
# (1 + x / 2), P of degree 9: Numerical Recipes' erfcc (Press et al., 2nd ed., 6.2), a Chebyshev
# fit whose fractional error is under 1.2e-7 for every x >= 0. Its coefficients, lowest first:
ERFC_P = (
    -1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
    0.27886807, -1.13520398, 1.48851587, -0.82215223, 0.17087277,
)  # fmt: skip
# P in base 2 with Phi's 1/2 folded in: exp(P - x^2) / 2 = exp2(log2(e) P - 1 - log2(e) x^2)
ERFC_Q0, ERFC_Q1, ERFC_Q2, ERFC_Q3, ERFC_Q4, ERFC_Q5, ERFC_Q6, ERFC_Q7, ERFC_Q8, ERFC_Q9 = (
    tl.constexpr(LOG2E.value * c - (1.0 if k == 0 else 0.0)) for k, c in enumerate(ERFC_P)
)


@triton.jit
def normal_cdf(z):
    """Phi(z), the standard normal CDF, of fp32 ``z`` in two MUFU operations, Horner's nine FMAs and
    a few more: the lower tail h = erfc(|z| / sqrt(2)) / 2 (ERFC_P), Phi = h below 0 and 1 - h above.
    An exact GELU through it compiles to 25 sm_90 instructions a value where libdevice's erf
    (about twenty FMAs of its own) gave 38; and where 0.5 (1 + erf) cancels to 0, below about
    -5.5, h keeps its relative precision: Phi(-8) is 6.2e-16, not 0."""
    t = reciprocal_at_least_one(1.0 + tl.abs(z) * (0.5 * SQRT_HALF))
    q = ERFC_Q8 + t * ERFC_Q9
    q = ERFC_Q7 + t * q
    q = ERFC_Q6 + t * q
    q = ERFC_Q5 + t * q
    q = ERFC_Q4 + t * q
    q = ERFC_Q3 + t * q
    q = ERFC_Q2 + t * q
    q = ERFC_Q1 + t * q
    q = ERFC_Q0 + t * q
    h = t * tl.exp2(q + z * (z * (-0.5 * LOG2E)))
    return tl.where(z > 0.0, 1.0 - h, h)


@triton.jit
def normal_pdf(z):
    """phi(z) = exp(-z^2 / 2) / sqrt(2 pi) of fp32 ``z``: one FMA and one MUFU.EX2."""
    return INV_SQRT_2PI * tl.exp2(z * (z * (-0.5 * LOG2E)))


@triton.jit
def gelu_lean(z, APPROX_TANH: tl.constexpr, FAST: tl.constexpr):
    """gelu(z) of fp32 ``z`` in few instructions, for the memory-bound passes (bias_gelu, the linear
    family's elementwise backward), which libdevice's erf held below the memory's rate in 16 bits:
    exact as z Phi(z) through normal_cdf (an exponential, a reciprocal and about a dozen FMAs where
    erf takes about twenty FMAs), or the tanh form: FAST, for outputs rounded to 16 bits, as z
    sigmoid(2u) (one exp2 and a reciprocal, as the matmul epilogue's); else as gelu (tanh from
    exp(-2|u|), twice the instructions, fp32's precision near +-1). The tuned matmul's epilogue
    keeps gelu until its tunings are refreshed (a helper's text is part of their source hash)."""
    if APPROX_TANH:
        if FAST:
            e = tl.exp2(z * (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC * (z * z)))
            return z * reciprocal_at_least_one(1.0 + e)
        else:
            return gelu(z, APPROX_TANH=True)
    else:
        return z * normal_cdf(z)


# d/dz of z s, s = 1 / (1 + 2^E): s - z s (1 - s) ln2 E'(z), E'(z) = GELU_EXP2_LINEAR + 3
# GELU_EXP2_CUBIC z^2, with ln2 folded in
TANH_SLOPE_LINEAR = tl.constexpr(LN2.value * GELU_EXP2_LINEAR.value)
TANH_SLOPE_CUBIC = tl.constexpr(3.0 * LN2.value * GELU_EXP2_CUBIC.value)


@triton.jit
def gelu_lean_grad(z, APPROX_TANH: tl.constexpr, FAST: tl.constexpr):
    """gelu'(z) of fp32 ``z`` in :func:`gelu_lean`'s form: Phi(z) + z phi(z), or the tanh form's."""
    if APPROX_TANH:
        if FAST:
            s = reciprocal_at_least_one(1.0 + tl.exp2(z * (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC * (z * z))))
            return s - z * s * (1.0 - s) * (TANH_SLOPE_LINEAR + TANH_SLOPE_CUBIC * (z * z))
        else:
            return gelu_grad(z, APPROX_TANH=True)
    else:
        return normal_cdf(z) + z * normal_pdf(z)


# Rows that start off their vectors' alignment (an odd row length in 16 bits, say): a row kernel
# reads a window from each row's offset rounded down to WINDOW entries (16 bytes of the narrowest
# dtype), so that every vector wholly inside the row is a 16-byte access, and takes the row's
# entries in its first and last vectors (at most 2 x WINDOW - 2) one at a time. The launch passes
# WINDOW only where every tensor starts 16-byte aligned and the tensors' row offsets agree modulo
# WINDOW, so that one head serves them all.


@triton.jit
def window_base(offsets, WINDOW: tl.constexpr):
    """(base, head): each row's offset rounded down to a multiple of WINDOW (so written that Triton
    knows it) and how far past the base the row starts (int32, below WINDOW)."""
    base = offsets // WINDOW * WINDOW
    return base, (offsets - base).to(tl.int32)


@triton.jit
def window_interior(positions, head, N, WINDOW: tl.constexpr):
    """Which ``positions`` (from a row's window base, ``head`` broadcasting against them) lie in
    vectors of WINDOW entries wholly in the row: a mask constant along each vector, under which
    loads and stores stay vectors."""
    vector = positions // WINDOW * WINDOW
    return (vector >= head) & (vector + WINDOW <= head + N)


@triton.jit
def window_edges(head, N, WINDOW: tl.constexpr):
    """(positions, mask): the row's entries outside window_interior's vectors, which lie in its first
    and last vectors: 2 x WINDOW positions from the base (a scalar ``head``, or a (rows, 1) one for
    a tile of rows), and which are the row's (each entry once, where the first vector is the last)."""
    e = tl.arange(0, 2 * WINDOW)
    last = (head + N - 1) // WINDOW * WINDOW
    positions = tl.where(e < WINDOW, e, last + e - WINDOW)
    in_row = (positions >= head) & (positions < head + N)
    first_or_other = (e < WINDOW) | (last > 0)
    return positions, in_row & ~window_interior(positions, head, N, WINDOW) & first_or_other


@triton.jit
def window_span(N, WINDOW: tl.constexpr):
    """The positions a row of N entries covers from its window base: up to WINDOW - 1 more (WINDOW 0:
    no window, N; ``_launch.row_span`` on the host)."""
    if WINDOW > 0:
        return N + (WINDOW - 1)
    else:
        return N


@triton.jit
def segment_edges(head, N, first, SEGMENT, WINDOW: tl.constexpr):
    """``window_edges`` of the positions ``first``, ... ``first + SEGMENT - 1``: a split row's segment's
    share of its two edge vectors (each edge entry taken by the one segment that holds it)."""
    positions, mask = window_edges(head, N, WINDOW)
    return positions, mask & (positions >= first) & (positions < first + SEGMENT)
