"""Exact fp4 dot products on AVX512-VNNI and AVX2, their packed layouts and exactness bounds
(ds41numba.numerics.int8_dot, int8_pairs, int8_layouts)."""

import numba
import numpy as np
import pytest

from numerics_helpers import (INT8_KERNELS, assert_same_bits, bf16_dot_rows, F32, fp4_rows, int8_dot_blocks,
                              int8_dot_rows, needs_bf16_dot, needs_int8_dot)
from ds41numba import numerics as nm


# ------------------------------------------------------------------------ AVX512-VNNI dot products


@numba.njit
def _int8_dot_into(qa, ca, sa, qb, sb, out):
    nm.int8_dot_into(qa, ca, sa, qb, sb, out)


@pytest.mark.parametrize("blocks", INT8_KERNELS)
@pytest.mark.parametrize("d, a_stride, out_stride", [(32, 0, 0), (64, 3, 5), (128, 0, 0), (160, 8, 16)])
def test_int8_dot_exact_on_fp4_values(d, a_stride, out_stride, blocks):
    """The integer kernels' products of fp4 rows are the exact dot products, the bf16 kernel's
    bit for bit, whatever the group scales within the bound int8_dot_exact checks (spreads of
    4 + 4 here: every 32-value group scaled apart)."""
    rng = np.random.default_rng(50 + d)
    a, b = fp4_rows(rng, nm.DOT_ROWS, d, 4), fp4_rows(rng, 75, d, 4)
    got, ra, rb = int8_dot_rows(a, b, a_stride, out_stride, blocks=blocks)
    assert nm.int8_dot_exact(ra, rb, d) and (d == 32 or ra[3] + rb[3] >= 5)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    if nm.tier_at_least("avx512bf16"):
        assert_same_bits(got, bf16_dot_rows(a, b, a_stride, out_stride))
    # The kernel continues the sum already in its output.
    assert_same_bits(int8_dot_rows(a, b, a_stride, out_stride, start=0.75, blocks=blocks)[0],
                     (exact + 0.75).astype(F32))


# Query integers (rows) by key integers (columns) of the byte table: every query byte -12..12
# against every key byte 0..24 (n + 12), each group holding a +-12 so that its scale is 1/2.
_EVERY_INT = np.arange(-12, 13)


def _byte_table_rows(n_rows, d, shift):
    """``n_rows`` rows of ``d`` values ``n / 2``, the integers n cycling through -12..12 (row
    ``i`` from ``shift * i``), a +-12 in every 32-value group."""
    ints = np.array([[_EVERY_INT[(shift * i + j) % 25] for j in range(d)] for i in range(n_rows)])
    ints[:, ::32] = np.where(np.arange(n_rows) % 2, -12, 12)[:, None]
    return (ints / 2).astype(F32)


@pytest.mark.parametrize("blocks", INT8_KERNELS)
@pytest.mark.parametrize("d, n_keys", [(32, 25), (64, 33), (96, 63), (128, 1), (256, 70)])
def test_int8_dot_on_every_byte(d, n_keys, blocks):
    """Table-driven: every query byte (-12..12) meets every key byte (0..24) at every position
    of a quad and of a pair, in key blocks with tails (key counts not a multiple of 32); the
    integer kernels give the exact products, VNNI's and AVX2's the same bits."""
    a = _byte_table_rows(nm.DOT_ROWS, d, 7)
    b = _byte_table_rows(n_keys, d, 3)[::-1].copy()
    got, ra, rb = int8_dot_rows(a, b, blocks=blocks)
    assert nm.int8_dot_exact(ra, rb, d) and ra[1] == ra[2] == rb[1] == rb[2] == -1
    assert_same_bits(got, (a.astype(np.float64) @ b.T.astype(np.float64)).astype(F32))
    pairs = [(qa, qb) for qa in range(-12, 13) for qb in range(-12, 13)]
    seen = {(int(2 * x), int(2 * y)) for r in a for k in b for x, y in zip(r, k)}
    assert n_keys < 25 or seen.issuperset(pairs), "the table misses a byte pair"


@pytest.mark.parametrize("blocks", INT8_KERNELS)
def test_int8_dot_at_its_largest_bytes(blocks):
    """Every value +-6 s (the integers +-12, the keys' bytes 0 and 24): the largest group sums
    (+-4608) and corrections (on AVX2 the largest int16 pairs, +-576, and group sums of
    pairs, +-4608), with no overflow or saturation and exact f32 results."""
    d = 128
    a = np.full((nm.DOT_ROWS, d), 6.0, F32)
    a[1] = -6.0
    a[2, ::2] = -6.0
    a[3] *= F32(2.0 ** -100)
    b = np.full((40, d), 6.0, F32)
    b[1::2] = -6.0
    b[5, 64:] = F32(6.0 * 2.0 ** 3)
    got, ra, rb = int8_dot_rows(a, b, blocks=blocks)
    assert nm.int8_dot_exact(ra, rb, d)
    assert_same_bits(got, (a.astype(np.float64) @ b.T.astype(np.float64)).astype(F32))
    assert got[0, 0] == 36.0 * d and got[1, 0] == -36.0 * d and got[2, 0] == 0.0


def _decode_rows(quads, scales, offset):
    """The values int8_rows / pack_int8_blocks packed (bytes minus ``offset`` times the scales)."""
    ints = quads.view(np.uint8).astype(np.int64) - offset
    if offset == 0:
        ints = np.where(ints > 127, ints - 256, ints)
    return (ints * np.repeat(scales, 32, axis=-1)).astype(F32)


def _offset_folded_dot(a_rows, b_rows):
    """:func:`int8_dot_rows` on folded rows: queries :func:`folded_rows` with their corrections,
    keys :func:`pack_offset_folded_blocks` (one group a row); returns the products and ranges."""
    R, L = nm.DOT_ROWS, nm.DOT_LANES
    qa, sa, ra = nm.folded_rows(a_rows)
    ca = nm.folded_corrections(qa)
    qb, sb, rb = nm.pack_offset_folded_blocks(b_rows)
    out = np.zeros((qb.shape[0], R, L), F32)
    int8_dot_blocks(qa, ca, sa, qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


@needs_int8_dot
@pytest.mark.parametrize("d, spread", [(64, 0), (128, 2), (256, 1)])
def test_offset_folded_rows_on_the_vnni_kernel_are_exact(d, spread):
    """Folded rows (a row's block exponents at most FOLD_SPREAD apart, one scale a row) on the
    VNNI kernel as one group: the exact dot products, the per-block layout's bit for bit."""
    rng = np.random.default_rng(60 + d)
    a, b = fp4_rows(rng, nm.DOT_ROWS, d, spread), fp4_rows(rng, 70, d, spread)
    got, ra, rb = _offset_folded_dot(a, b)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    assert_same_bits(got, int8_dot_rows(a, b)[0])
    # int8_dot_into never reads its output: NaN there changes nothing.
    qa, sa, _ = nm.folded_rows(a)
    qb, sb, _ = nm.pack_offset_folded_blocks(b)
    into = np.full((nm.DOT_ROWS, nm.DOT_LANES), np.nan, F32)
    _int8_dot_into(qa, nm.folded_corrections(qa), sa, qb[1], sb[1], into)
    assert_same_bits(into, got[:, nm.DOT_LANES:2 * nm.DOT_LANES])


@needs_int8_dot
def test_offset_folded_dot_at_its_largest_bytes():
    """Values +-6 s with a row's blocks 2^3 apart: folded integers +-96 (key bytes 32 and 224),
    the largest sums and corrections, no int32 overflow, exact f32 results."""
    d = 128
    a = np.full((nm.DOT_ROWS, d), 6.0, F32)
    a[:, 96:] *= F32(8.0)
    a[1] = -a[1]
    a[2, ::2] = -a[2, ::2]
    b = np.full((40, d), 48.0, F32)
    b[:, :32] = F32(6.0)
    b[1::2] = -b[1::2]
    got, ra, rb = _offset_folded_dot(a, b)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d) and ra[3] == rb[3] == 3
    assert_same_bits(got, (a.astype(np.float64) @ b.T.astype(np.float64)).astype(F32))


def test_offset_folded_packing_holds_the_values():
    """The offset-folded keys are each value's folded integer plus FOLDED_KEY_OFFSET in its
    lane, scale 2^(lowest block exponent); unwritten lanes hold the offset (zeros) and scale 1;
    the corrections are -FOLDED_KEY_OFFSET times each query row's byte sum."""
    rng = np.random.default_rng(62)
    x = fp4_rows(rng, 40, 128, 2)
    kq, ks, rb = nm.pack_offset_folded_blocks(x)
    assert nm.foldable(rb, nm.EMPTY_RANGE) and kq.shape == (2, 32, nm.DOT_LANES) and ks.shape == (2, 1, nm.DOT_LANES)
    ints = kq.view(np.uint8).reshape(2, 32, nm.DOT_LANES, 4).astype(np.int64) - nm.FOLDED_KEY_OFFSET
    values = ints.transpose(0, 2, 1, 3).reshape(2 * nm.DOT_LANES, 128) * ks.reshape(-1, 1)
    assert np.array_equal(values[:40], x) and not values[40:].any()
    assert np.all(ks.reshape(-1)[40:] == 1)
    qa, sa, _ = nm.folded_rows(x)
    assert np.array_equal(nm.folded_corrections(qa)[:, 0],
                          -nm.FOLDED_KEY_OFFSET * qa.view(np.int8).astype(np.int64).sum(axis=1))
    with pytest.raises(ValueError, match="folded_corrections"):
        nm.folded_corrections(qa.view(np.int32))


def test_int8_packing_holds_the_values():
    """Both layouts give back every value exactly (a zero's sign aside: a product with -0 or +0
    adds nothing to a sum that starts at +0); the A operand's corrections are -12 times its
    group sums, and rows go into the lanes pack_bf16_pairs would give them."""
    rng = np.random.default_rng(51)
    x = fp4_rows(rng, 70, 96, 6)
    quads, corr, scales, ra = nm.int8_rows(x)
    assert np.array_equal(_decode_rows(quads, scales, 0), x)
    ints = quads.view(np.int8).astype(np.int64).reshape(70, 3, 32)
    assert np.array_equal(corr, -nm.KEY_OFFSET * ints.sum(axis=2))
    assert ra[0] == 0 and ra[3] <= 6 + 1
    kq, ks, rb = nm.pack_int8_blocks(x)
    assert kq.shape == (3, 24, nm.DOT_LANES) and ks.shape == (3, 3, nm.DOT_LANES)
    rows = _decode_rows(kq.transpose(0, 2, 1).copy(), ks.transpose(0, 2, 1), nm.KEY_OFFSET)
    assert np.array_equal(rows.reshape(-1, 96)[:70], x)
    assert np.all(rows.reshape(-1, 96)[70:] == 0)               # padding lanes: zeros
    assert np.array_equal(ra, rb)
    # rows written into a block layout at an offset, the other rows untouched
    out = nm.pack_int8_blocks(np.zeros((96, 96), F32))[:2]
    nm.pack_int8_blocks(x[:5], out, first=30)
    assert np.array_equal(out[0][0, :, 30:], kq[0, :, :2]) and np.array_equal(out[0][1, :, :3], kq[0, :, 2:5])
    assert np.all(out[0][:, :, 35:] == np.uint32(0x0C0C0C0C)) and np.all(out[0][0, :, :30] == np.uint32(0x0C0C0C0C))
    with pytest.raises(ValueError, match="room"):
        nm.pack_int8_blocks(x, out, first=30)
    with pytest.raises(ValueError, match="multiple of 32"):
        nm.int8_rows(x[:, :40])


@pytest.mark.parametrize("value, bad", [(np.nan, True), (np.inf, True), (0.3, True),
                                        (2.0 ** -130, True), (2.0 ** -123, False), (1.5, False),
                                        (2.0 ** 126, False), (0.0, False)])
def test_int8_ranges_count_the_rows_that_are_not_fp4(value, bad):
    """A row is bad when one of its values is not an integer up to 12 times its group's power
    of two within the normal range (NaN, inf, a value off the e2m1 grid, a denormal): such rows
    send a tile to another kernel, never into the integer product."""
    x = np.zeros((3, 64), F32)
    x[0, :8] = np.array([1, -2, 3, 0.5, 0, 0, 0, 6], F32) * F32(2.0 ** -3)
    x[1, 40] = F32(value)
    x[1, 41] = F32(value / 2) if np.isfinite(value) and value > 2.0 ** -120 else 0
    for pack in (nm.int8_rows, nm.pack_int8_blocks):
        rng = pack(x)[-1]
        assert rng[0] == bad
        if not bad:         # row 0's group: 12 * 2^-4 >= 0.75; row 1's: 12 * 2^e >= value
            e = int(np.ceil(np.log2(value / 12))) if value else -4
            assert (rng[1], rng[2], rng[3]) == (min(-4, e), max(-4, e), 0)


def test_int8_dot_exact_bounds():
    """The bound of int8_dot_exact at d = 128: spreads adding up to 9 pass, 10 do not; the
    lowest exponents must add up to -126 or more, the highest stay below overflow; a side of
    zeros always passes, bad rows never."""
    def r(bad=0, emin=0, emax=0):
        return np.array([bad, emin, emax, emax - emin], np.int64)
    assert nm.int8_dot_exact(r(0, 0, 4), r(0, 0, 5), 128)
    assert not nm.int8_dot_exact(r(0, 0, 5), r(0, 0, 5), 128)
    assert nm.int8_dot_exact(r(0, -63, -63), r(0, -63, -60), 128)
    assert not nm.int8_dot_exact(r(0, -64, -64), r(0, -63, -63), 128)
    assert nm.int8_dot_exact(r(0, 56, 56), r(0, 57, 57), 128)
    assert not nm.int8_dot_exact(r(0, 57, 57), r(0, 57, 57), 128)
    assert nm.int8_dot_exact(nm.EMPTY_RANGE, r(0, -200, 200), 128)
    assert not nm.int8_dot_exact(r(1, 0, 0), r(0, 0, 0), 128)
    assert nm.int8_dot_exact(nm.merge_ranges(r(0, 0, 2), r(0, -1, 1)), r(0, 0, 6), 128)
    assert not nm.int8_dot_exact(nm.merge_ranges(r(0, 0, 2), r(0, -1, 3)), r(0, 0, 6), 128)


@needs_bf16_dot
def test_int8_dot_exact_bound_is_needed():
    """Past the bound the f32 sums round and their order shows: a first group whose products
    sum to 2^24 and more (f32's ulp there is 2), then 95 products of 0.25. The bf16 kernel's
    sequential sum loses each 0.25; the exact sum, rounded once, does not: no kernel's order
    is "the" f32 value, which is why the VNNI path declines such tiles."""
    a = np.full((nm.DOT_ROWS, 128), 0.5, F32)
    a[:, :32] = F32(6.0 * 2.0 ** 14)
    a[:, 127] = 0.0
    b = np.full((32, 128), 0.5, F32)
    b[:, :32] = 6.0
    *_, ra = nm.int8_rows(a)
    *_, rb = nm.pack_int8_blocks(b)
    assert not nm.int8_dot_exact(ra, rb, 128)
    exact = (a.astype(np.float64) @ b.T.astype(np.float64))
    assert np.all(exact == 32 * 36 * 2.0 ** 14 + 95 * 0.25)
    assert np.all(bf16_dot_rows(a, b) == F32(32 * 36 * 2.0 ** 14)) and np.all(exact.astype(F32) > F32(32 * 36 * 2.0 ** 14))


# ------------------------------------------------------------------ VNNI's mix of key quarters


@numba.njit
def _mix_quarters(qa, ca, sa, w, qb, sb, at, out, converts):
    nm.vnni_mix_quarters(qa, ca, sa, w, qb, sb, at, out, converts)


# Four quarters a call: one key block's in order, from four blocks out of order, one quarter
# twice, the last keys (a block of padding lanes beside them unread).
QUARTER_SETS = [[0, 8, 16, 24], [184, 8, 96, 40], [64, 64, 160, 72], [176, 168, 184, 0]]


@needs_int8_dot
@pytest.mark.parametrize("at", QUARTER_SETS, ids=["block", "scattered", "repeated", "last"])
def test_vnni_mix_of_quarters_is_the_mix_of_their_keys(at):
    """vnni_mix_quarters' lane ``8i + j`` is key ``at[i] + j``'s mixed score, bit for bit the
    numpy mix (both roundings, ties to even among them: rows 2^1 apart), for three queries of 32
    heads against 190 keys (six key blocks, the last two lanes padding)."""
    from test_amx_dot import _mixed_reference

    rng = np.random.default_rng(sum(at))
    heads, d = 2 * nm.AMX_ROWS, 128
    a, b = fp4_rows(rng, 3 * heads, d, 1), fp4_rows(rng, 190, d, 1)
    b[41] = 0.0
    w = nm.to_bf16_rne(rng.standard_normal(3 * heads).astype(F32) * F32(0.05))
    want = _mixed_reference(a, w, b, heads)[0]
    qa, sa, ra = nm.folded_rows(a)
    qb, sb, rb = nm.pack_offset_folded_blocks(b)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d)
    keys = np.array([t + j for t in at for j in range(nm.QUARTER)])
    for converts in (True, False):
        out = np.full((3, nm.DOT_LANES), np.nan, F32)
        _mix_quarters(qa, nm.folded_corrections(qa), sa, w.reshape(-1, 1), qb, sb,
                      np.array(at, np.int64), out, converts)
        seen = keys < b.shape[0]
        assert_same_bits(out[:, seen], want[:, keys[seen]])
