"""Helpers the numerics tests share: bit comparisons and the dot-product micro-kernels run
over whole operands."""

import numba
import numpy as np
import pytest

from ds41numba import numerics as nm

F32 = np.float32
U32 = np.uint32


# ================================================================== the tiers this CPU runs
# Each kernel's tests skip where its tier is off (no such CPU, or switched off); a test over
# every tier runs the ones this CPU has, from the highest down, and lists the others skipped.
needs_avx2_int8 = pytest.mark.skipif(not nm.tier_at_least("avx2int8"), reason="the AVX2 integer kernel is off "
                                     "(no AVX2, or DS41NUMBA_AVX2_INT8=0)")
needs_bf16_dot = pytest.mark.skipif(not nm.tier_at_least("avx512bf16"), reason="the AVX512-BF16 kernel is off (no "
                                    "such CPU, or DS41NUMBA_BF16_DOT=0): the f32 BLAS path runs")
needs_int8_dot = pytest.mark.skipif(not nm.tier_at_least("avx512vnni"), reason="the AVX512-VNNI kernel is off (no "
                                    "such CPU, or DS41NUMBA_INT8_DOT=0)")
needs_amx = pytest.mark.skipif(not nm.tier_at_least("amx"), reason="the AMX kernel is off (no AMX-INT8, "
                               "no tile state from Linux, or DS41NUMBA_AMX=0)")
#: The tiers this CPU runs, from the highest down.
TIERS = [b for b in nm.BACKENDS if b == "blas" or nm.BACKENDS.index(b) >= nm.BACKENDS.index(nm.backend())]
#: Every tier, those this CPU lacks skipped.
ALL_TIERS = [pytest.param(b, marks=pytest.mark.skipif(b not in TIERS, reason=f"this CPU lacks the "
                                                      f"{b} tier (or it is switched off)"))
             for b in nm.BACKENDS]


def bits(a):
    return np.ascontiguousarray(a, dtype=F32).view(U32)


def assert_same_bits(got, want, *, nan_any=False):
    """Bitwise equality; with ``nan_any`` a NaN only has to meet a NaN (payload and sign free)."""
    got = np.asarray(got, F32)
    want = np.asarray(want, F32)
    assert got.shape == want.shape
    same = bits(got) == bits(want)
    if nan_any:
        same |= np.isnan(got) & np.isnan(want)
    if not same.all():
        i = np.flatnonzero(~same.reshape(-1))
        g, w = got.reshape(-1)[i[:5]], want.reshape(-1)[i[:5]]
        pytest.fail(f"{i.size} mismatches, first: got {g} ({[hex(v) for v in bits(g)]}), "
                    f"want {w} ({[hex(v) for v in bits(w)]})")


@numba.njit
def bf16_dot_blocks(a, b, out):
    """Each block of B against the same rows of A, through the micro-kernel."""
    for k in range(b.shape[0]):
        nm.bf16_dot_tile(a, b[k], out[k])


def bf16_dot_rows(a_rows, b_rows, a_stride=0, out_stride=0, start=0.0):
    """``start + a_rows [DOT_ROWS, d] . b_rows [n, d]^T`` via the kernel (which adds to its
    output); A's and the output's rows sit ``a_stride`` / ``out_stride`` elements further apart
    than their length."""
    R, L = nm.DOT_ROWS, nm.DOT_LANES
    pairs = nm.bf16_pairs(a_rows)
    a = np.zeros((R, pairs.shape[1] + a_stride), np.uint32)[:, :pairs.shape[1]]
    a[:] = pairs
    b = nm.pack_bf16_pairs(b_rows)
    out = np.full((b.shape[0], R, L + out_stride), np.nan, F32)[:, :, :L]
    out[:] = start
    bf16_dot_blocks(a, b, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]]


@numba.njit
def int8_dot_blocks(qa, ca, sa, qb, sb, out):
    """Each block of B against the same rows of A, through the micro-kernel."""
    for k in range(qb.shape[0]):
        nm.int8_dot_tile(qa, ca, sa, qb[k], sb[k], out[k])


@numba.njit
def int8_pairs_blocks(qa, ca, sa, qb, sb, out):
    """:func:`int8_dot_blocks` through AVX2's twin of the micro-kernel."""
    for k in range(qb.shape[0]):
        nm.int8_pairs_tile(qa, ca, sa, qb[k], sb[k], out[k])


#: The per-block integer micro-kernels, each run only where its tier is on.
INT8_KERNELS = [pytest.param(int8_dot_blocks, marks=needs_int8_dot, id="vnni"),
                pytest.param(int8_pairs_blocks, marks=needs_avx2_int8, id="avx2")]


def strided(x, extra):
    """``x`` (2-D) as a view whose rows sit ``extra`` elements further apart than their length."""
    out = np.zeros((x.shape[0], x.shape[1] + extra), x.dtype)[:, :x.shape[1]]
    out[:] = x
    return out


def int8_dot_rows(a_rows, b_rows, a_stride=0, out_stride=0, start=0.0, blocks=int8_dot_blocks):
    """:func:`bf16_dot_rows` on the VNNI kernel (or ``blocks``: :data:`INT8_KERNELS`; each also adds to
    its output); returns the products and the two ranges."""
    R, L = nm.DOT_ROWS, nm.DOT_LANES
    *qa, ra = nm.int8_rows(a_rows)
    qb, sb, rb = nm.pack_int8_blocks(b_rows)
    out = np.full((qb.shape[0], R, L + out_stride), np.nan, F32)[:, :, :L]
    out[:] = start
    blocks(*(strided(x, a_stride) for x in qa), qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


def fp4_rows(rng, rows, d, spread=0):
    """fp4 (e8m0) rows, each 32-value group scaled by a random power of two up to ``2^spread``."""
    x = rng.standard_normal((rows, d)).astype(F32)
    x *= np.exp2(rng.integers(0, spread + 1, size=(rows, d // 32))).repeat(32, axis=1).astype(F32)
    return nm.fp4_quant_e8m0_inplace(x)

