"""LayerNorm's and RMSNorm's backward row terms: dh = (g - xhat * c1 - c2) * rstd, c1 and c2 from a
row's sums (one row's in the one-pass and looped kernels, its segments' or programs' added in the
split ones), and, on fp32 rows, LayerNorm's centring of xhat by its own mean
(docs/perf-notes/norms.md, "LayerNorm on rows far from zero")."""

from __future__ import annotations

from tritonkit._triton import tl, triton

# a backward row's sums, per segment or program: of g * xhat, of g and (LayerNorm, centres_rows) of xhat
BACKWARD_SUMS = tl.constexpr(3)


@triton.jit
def centres_rows(rows_ptr):
    """Whether LayerNorm's kernels take the fp32 mean's rounding out of a row's centred values
    (``layer_norm_terms``; the one-pass forward's corrected variance): fp32 rows, whose spread may
    sit far below their mean; a 16-bit row's entries cannot (its grid is coarser than that
    rounding), so its kernels stay as they were, without the extra sums' registers."""
    return rows_ptr.dtype.element_ty == tl.float32


@triton.jit
def layer_norm_terms(sum_g_xhat, sum_g, sum_xhat, N):
    """LayerNorm's backward, dh = (g - xhat * c1 - c2) * rstd: its row terms (c1, c2) from the row's
    sums of g * xhat, g and xhat. The exact xhat has mean zero; one computed from the forward's fp32
    mean is off by that mean's rounding times rstd, one shift for the whole row, which the formula
    multiplies up where the row's spread is small beside its mean (or beside eps; docs/perf-notes/
    norms.md, "LayerNorm on rows far from zero").
    xhat centred by its own mean c3 drops the shift, folded into the terms:
    (xhat - c3) * c1 + c2 = xhat * c1 + (c2 - c3 * c1)."""
    c3 = sum_xhat / N
    c1 = (sum_g_xhat - c3 * sum_g) / N
    return c1, sum_g / N - c3 * c1


@triton.jit
def row_terms(sums_at, exists, N, RMS: tl.constexpr, CENTRE: tl.constexpr):
    """A row's backward terms (c1, c2) from its parts' sums at ``sums_at`` (BACKWARD_SUMS apart, where
    ``exists``): RMSNorm's mean(g * xhat) and 0, LayerNorm's ``layer_norm_terms`` (``CENTRE``) or
    mean(g * xhat) and mean(g)."""
    sum_g_xhat = tl.sum(tl.load(sums_at, mask=exists, other=0.0, cache_modifier=".cg"), axis=-1)
    sum_g = tl.sum(tl.load(sums_at + 1, mask=exists, other=0.0, cache_modifier=".cg"), axis=-1)
    if RMS:
        c1, c2 = sum_g_xhat / N, tl.zeros_like(sum_g_xhat)
    elif CENTRE:
        sum_xhat = tl.sum(tl.load(sums_at + 2, mask=exists, other=0.0, cache_modifier=".cg"), axis=-1)
        c1, c2 = layer_norm_terms(sum_g_xhat, sum_g, sum_xhat, N)
    else:
        c1, c2 = sum_g_xhat / N, sum_g / N
    return c1, c2
