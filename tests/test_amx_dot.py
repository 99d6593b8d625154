"""The fp4 dot products and their mixers on AMX (ds41numba.numerics.amx_dot, head_mix), and the
folded layouts (folded_layouts)."""

import numba
import numpy as np
import pytest

from numerics_helpers import assert_same_bits, F32, fp4_rows, int8_dot_rows, needs_amx, strided
from ds41numba import numerics as nm


# ------------------------------------------------------------------------------ AMX dot products


@numba.njit
def _amx_dot_all(qa, sa, qb, sb, out):
    """Each block of B against every row tile of A, through the tile micro-kernel."""
    nm.amx_begin()
    for k in range(qb.shape[0]):
        for r in range(0, qa.shape[0], nm.AMX_ROWS):
            nm.amx_dot_tile(qa[r:r + nm.AMX_ROWS], sa[r:r + nm.AMX_ROWS], qb[k], sb[k],
                            out[k, r:r + nm.AMX_ROWS])
    nm.amx_end()


def _amx_dot(a_rows, b_rows, a_stride=0, out_stride=0, start=0.0):
    """:func:`int8_dot_rows` on the AMX kernel (rows of A a multiple of AMX_ROWS)."""
    R, L = a_rows.shape[0], nm.DOT_LANES
    qa, sa, ra = nm.folded_rows(a_rows)
    qb, sb, rb = nm.pack_folded_blocks(b_rows)
    out = np.full((qb.shape[0], R, L + out_stride), np.nan, F32)[:, :, :L]
    out[:] = start
    _amx_dot_all(strided(qa, a_stride), strided(sa, a_stride), qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


@needs_amx
@pytest.mark.parametrize("d, a_stride, out_stride, spread", [(64, 0, 0, 0), (128, 3, 5, 2),
                                                             (256, 0, 0, 1), (192, 8, 16, 2)])
def test_amx_dot_exact_on_folded_fp4_values(d, a_stride, out_stride, spread):
    """The AMX kernel's products of folded fp4 rows are the exact dot products, the VNNI
    kernel's bit for bit, with each row's groups up to FOLD_SPREAD exponents apart."""
    rng = np.random.default_rng(60 + d)
    a, b = fp4_rows(rng, 2 * nm.AMX_ROWS, d, spread), fp4_rows(rng, 75, d, spread)
    b[3] = 0.0                                     # a key of zeros
    a[5, :32] = 0.0                                # a zero group: no exponent
    got, ra, rb = _amx_dot(a, b, a_stride, out_stride)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    for r in range(0, a.shape[0], nm.DOT_ROWS):
        assert_same_bits(got[r:r + nm.DOT_ROWS], int8_dot_rows(a[r:r + nm.DOT_ROWS], b)[0])
    assert_same_bits(_amx_dot(a, b, start=0.75)[0], (exact + 0.75).astype(F32))


@needs_amx
def test_amx_dot_at_its_largest_bytes():
    """Values +-6 s in one group and +-6 s/8 in the others (spread 3): folded bytes +-96 and
    +-12, the largest tile sums, exact."""
    d = 128
    a = np.full((nm.AMX_ROWS, d), 6.0 / 8, F32)
    a[:, :32] = 6.0
    a[1] *= -1
    b = np.full((40, d), -6.0 / 8, F32)
    b[:, 96:] = -6.0
    b[1::2] *= -1
    got, ra, rb = _amx_dot(a, b)
    assert nm.foldable(ra, rb) and ra[3] == rb[3] == 3
    assert_same_bits(got, (a.astype(np.float64) @ b.T.astype(np.float64)).astype(F32))


@numba.njit
def _amx_mix_all(qa, sa, w, qb, sb, out, block_max, converts, maxima):
    """Every block of B mixed against all of A's rows, through the mixing tile kernel."""
    nm.amx_begin()
    for k in range(qb.shape[0]):
        nm.amx_mix_tile(qa, sa, w, qb[k], sb[k], out[k], block_max[k], converts, maxima)
    nm.amx_end()


def _amx_mix(a_rows, w, b_rows, converts):
    """amx_mix_tile's scores ``[T, n]`` of queries ``a_rows [T * H, d]`` (head weights ``w [T * H]``)
    against keys ``b_rows [n, d]`` (n a multiple of DOT_LANES), and whether converted_mix_exact
    allows ``converts``. The kernel's block maxima (asked for in a second run, which must give
    the same scores) are checked against the maxima of those scores (NaN wins)."""
    T = a_rows.shape[0] // nm.AMX_ROWS // 2
    qa, sa, ra = nm.folded_rows(a_rows)
    qb, sb, rb = nm.pack_folded_blocks(b_rows)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, a_rows.shape[1])
    wr = np.ascontiguousarray(w, F32).reshape(-1, 1)
    per_block = nm.DOT_LANES // nm.MAX_BLOCK
    outs, maxima = [], np.full((qb.shape[0], T, per_block), 7.0, F32)
    for take in (False, True):
        out = np.full((qb.shape[0], T, nm.DOT_LANES), np.nan, F32)
        _amx_mix_all(qa, sa, wr, qb, sb, out, maxima, converts, take)
        outs.append(out.transpose(1, 0, 2).reshape(T, -1)[:, :b_rows.shape[0]])
        if not take:
            assert np.all(maxima == 7.0), "block maxima written without being asked for"
    got = outs[0]
    assert_same_bits(outs[1], got)
    blocks = got.reshape(T, -1, nm.MAX_BLOCK)
    want = np.where(np.isnan(blocks).any(axis=2), np.nan, blocks.max(axis=2, initial=-np.inf))
    assert np.array_equal(maxima.transpose(1, 0, 2).reshape(T, -1), want, equal_nan=True)
    return got, nm.converted_mix_exact(sa, rb, w)


def _mixed_reference(a_rows, w, b_rows, heads):
    """The head mix in numpy: ``bf16(sum_h bf16(relu(bf16(q_h . k)) * w_h))``, f32 sums in head
    order, the dot products exact (float64, then f32: they are, see int8_dot_exact)."""
    s = nm.to_bf16_rne((a_rows.astype(np.float64) @ b_rows.T.astype(np.float64)).astype(F32))
    r = np.where((s > 0) | np.isnan(s), s, F32(0.0))
    terms = nm.to_bf16_rne(r * np.asarray(w, F32)[:, None])
    acc = np.zeros((a_rows.shape[0] // heads, b_rows.shape[0]), F32)
    for h in range(heads):
        acc += terms[h::heads]
    return nm.to_bf16_rne(acc), s


@needs_amx
@pytest.mark.parametrize("d", [64, 128, 256])
def test_amx_mix_rounds_on_the_conversion_as_on_the_bits(d):
    """The mixing kernel's two roundings on vcvtne2ps2bf16 (``converts``) and on the bits give the
    numpy mix bit for bit, ties to even included: 8 queries of 32 heads, 2,048 keys, groups up to
    2^1 apart, where thousands of scores and weighted terms fall exactly halfway; rows of 128
    values (the key block held in tile registers) and of 64 and 256 (reloaded each step)."""
    rng = np.random.default_rng(62)
    heads, n = 2 * nm.AMX_ROWS, 2048
    a, b = fp4_rows(rng, 8 * heads, d, 1), fp4_rows(rng, n, d, 1)
    b[7] = 0.0                                         # a key of zeros: its scale is 1
    w = nm.to_bf16_rne(rng.standard_normal(8 * heads).astype(F32) * F32(0.05))
    w[[3, 40]] = [0.0, -0.0]
    want, s = _mixed_reference(a, w, b, heads)
    dots = (a.astype(np.float64) @ b.T.astype(np.float64)).astype(F32)
    products = np.where(s > 0, s, F32(0.0)) * w[:, None]
    for halfway in (dots, products):                # ties of the first and second rounding
        assert np.sum(halfway.view(np.uint32) & 0xFFFF == 0x8000) > 1000
    for converts in (True, False):
        got, allowed = _amx_mix(a, w, b, converts)
        assert allowed
        assert_same_bits(got, want)


@needs_amx
# An infinite head weight times a ReLU'd zero score is NaN in the numpy reference mix, as in the
# kernel: the case under test, not a fault.
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_converted_mix_exact_guards_what_the_conversion_flushes():
    """Where a weighted term would be denormal the conversion flushes it to zero: the guard says
    no, and the kernel forced to convert anyway gives other scores (the bits' rounding keeps
    them). Weights of inf or NaN, or scale products past f32's range, are refused too."""
    rng = np.random.default_rng(63)
    heads, n = 2 * nm.AMX_ROWS, 64
    a, b = fp4_rows(rng, heads, 128), fp4_rows(rng, n, 128)
    w = nm.to_bf16_rne(rng.standard_normal(heads).astype(F32) * F32(0.05))
    tiny = w.copy()
    tiny[:] = F32(2.0 ** -133)                    # a bf16 denormal: every term denormal
    want, _ = _mixed_reference(a, tiny, b, heads)
    assert np.any(want != 0)
    got, allowed = _amx_mix(a, tiny, b, False)
    assert not allowed
    assert_same_bits(got, want)
    forced, _ = _amx_mix(a, tiny, b, True)
    assert np.all(forced == 0)
    qa, sa, _ = nm.folded_rows(a)
    rb = nm.pack_folded_blocks(b)[2]
    assert nm.converted_mix_exact(sa, rb, w)
    for bad in (np.inf, -np.inf, np.nan):
        w2 = w.copy()
        w2[5] = bad
        assert not nm.converted_mix_exact(sa, rb, w2), bad
        got, _ = _amx_mix(a, w2, b, False)          # NaN scores: their blocks' maxima NaN
        np.testing.assert_array_equal(got, _mixed_reference(a, w2, b, heads)[0])
        assert np.isnan(got).any()
    w2[5] = 2.0 ** 127                            # finite, but w * sq * sk may reach 2^129
    # The bound in float64: in f32 the product overflowed (a RuntimeWarning) before the compare.
    assert nm.converted_mix_exact(sa, rb, w2) == (2.0 ** 127 * float(sa.max()) * 2.0 ** max(rb[2], 0) < 2.0 ** 128)
    assert not nm.converted_mix_exact(sa * F32(8.0), rb, w2)
    assert not nm.converted_mix_exact(sa * F32(2.0 ** -120), rb, w)
    assert nm.converted_mix_exact(sa, rb, np.zeros_like(w))


def test_folded_packing_holds_the_values_and_counts_what_does_not_fold():
    """Folded rows give back every value (bytes times the row's scale); a row whose exponents
    spread wider than FOLD_SPREAD, or a value that is not fp4, is counted, never packed as good;
    rows go into the lanes pack_int8_blocks gives them."""
    rng = np.random.default_rng(61)
    x = fp4_rows(rng, 70, 128, 2)
    quads, scales, ra = nm.folded_rows(x)
    ints = quads.view(np.int8).astype(np.int64)
    assert np.array_equal((ints * scales).astype(F32), x) and scales.shape == (70, 1)
    assert ra[0] == 0 and ra[3] <= nm.FOLD_SPREAD and nm.foldable(ra, ra)
    kq, ks, rb = nm.pack_folded_blocks(x)
    assert kq.shape == nm.pack_int8_blocks(x)[0].shape and ks.shape == (3, 1, nm.DOT_LANES)
    keys = kq.transpose(0, 2, 1).reshape(-1, 32).view(np.int8).astype(np.int64) * ks.reshape(-1, 1)
    assert np.array_equal(keys[:70].astype(F32), x) and np.all(keys[70:] == 0)
    assert np.array_equal(ra, rb)
    out = nm.pack_folded_blocks(np.zeros((96, 128), F32))[:2]
    nm.pack_folded_blocks(x[:5], out, first=30)
    assert np.array_equal(out[0][0, :, 30:], kq[0, :, :2]) and np.all(out[0][:, :, 35:] == 0)
    with pytest.raises(ValueError, match="room"):
        nm.pack_folded_blocks(x, out, first=30)
    with pytest.raises(ValueError, match="multiple of 64"):
        nm.folded_rows(x[:, :96])
    wide = x.copy()
    wide[4, 64:96] *= F32(2.0 ** 6)                # one row spread 4 or more
    for pack in (nm.folded_rows, nm.pack_folded_blocks):
        r = pack(wide)[-1]
        assert r[0] == 0 and r[3] > nm.FOLD_SPREAD and not nm.foldable(r, ra)
    bad = x.copy()
    bad[2, 7] = np.nan
    assert nm.folded_rows(bad)[-1][0] == 1 and not nm.foldable(nm.folded_rows(bad)[-1], ra)
