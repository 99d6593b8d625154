"""The projections (ds41numba.numerics.linear) and the reference's bf16 summation order."""

import gc
import weakref

import ml_dtypes
import numba
import numpy as np
import pytest

import naive
from helpers import linear_case, linear_case_names
from numerics_helpers import assert_same_bits, bf16_dot_blocks, F32, needs_bf16_dot
from ds41numba import numerics as nm
from ds41numba.numerics import linear as linear_mod
from ds41numba.numerics import matvec as matvec_mod


# --------------------------------------------------------------------------------------- linear


def test_linear_bf16_and_f32():
    rng = np.random.default_rng(11)
    x = naive.to_bf16_rne(rng.standard_normal((2, 5, 96)).astype(F32))
    w = naive.to_bf16_rne(rng.standard_normal((40, 96)).astype(F32) / 10)
    y32 = nm.linear_f32(x, w)
    assert y32.shape == (2, 5, 40) and y32.dtype == F32
    assert_same_bits(y32, np.matmul(x.reshape(-1, 96), w.T).reshape(2, 5, 40))
    y = nm.linear_bf16(x, w)
    assert_same_bits(y, naive.to_bf16_rne(y32))
    # Against exact dot products: at most one bf16 step apart (summation order).
    want = naive.linear_bf16(x, w)
    assert np.all(np.abs(y - want) <= 2.0**-7 * np.abs(want) + 1e-30)
    assert np.mean(y == want) > 0.95
    with pytest.raises(ValueError, match="does not match"):
        nm.linear_bf16(x, w.T)
    with pytest.raises(TypeError, match="float32"):
        nm.linear_f32(x.astype(np.float64), w)
    with pytest.raises(ValueError, match="2-D"):
        nm.linear_f32(x, w[None])


@pytest.mark.parametrize("m, k, n, groups", [(9, 96, 40, 1), (64, 256, 64, 1), (13, 64, 40, 2),
                                             (16, 128, 128, 4), (300, 1100, 96, 1), (61, 64, 64, 1)])
def test_linear_bf16_many_rows_of_a_bf16_matrix(monkeypatch, m, k, n, groups):
    """More rows than a matrix-vector product: the AVX512-BF16 product where the CPU has it (the
    last shapes span several work items, inner-dimension panels, and input chunks of 16 rows),
    else BLAS. Either way at most one bf16 step from the exact dot products, and independent of
    the thread count."""
    monkeypatch.setattr(linear_mod, "_WIDEN_ROWS", 16 if m == 61 else linear_mod._WIDEN_ROWS)
    rng = np.random.default_rng(m + k)
    x = naive.to_bf16_rne(rng.standard_normal((m, groups * k)).astype(F32))
    w = naive.to_bf16_rne((rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32))
    rank = n // groups
    want = np.concatenate([naive.linear_bf16(x[:, g * k:(g + 1) * k], w[g * rank:(g + 1) * rank])
                           for g in range(groups)], axis=1)
    mat = nm.Bf16Matrix(w, groups=groups)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = nm.linear_bf16(x, mat)
    finally:
        numba.set_num_threads(before)
    got = nm.linear_bf16(x, mat)
    assert_same_bits(got, one)
    assert got.shape == (m, n) and nm.is_bf16_valued(got)
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.abs(want) + 1e-30)
    assert np.mean(got == want) > 0.95


@needs_bf16_dot
def test_bf16_matrix_product_is_f32_accurate_and_falls_back_where_it_cannot_run():
    rng = np.random.default_rng(43)
    x = naive.to_bf16_rne(rng.standard_normal((20, 512)).astype(F32))
    w = naive.to_bf16_rne(rng.standard_normal((64, 512)).astype(F32))
    y = np.full((20, 64), np.nan, F32)
    assert nm.Bf16Matrix(w).dot_bf16(x, y)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert np.max(np.abs(y - exact) / scale) < 8 * 2.0 ** -24
    # An ml_dtypes bfloat16 input is read as it is, with the same result.
    y16 = np.full((20, 64), np.nan, F32)
    assert nm.Bf16Matrix(w).dot_bf16(x.astype(ml_dtypes.bfloat16), y16)
    assert_same_bits(y16, y)
    # x not bf16-valued: the caller's BLAS path runs instead.
    off = x + F32(2.0 ** -12)
    assert not nm.Bf16Matrix(w).dot_bf16(off, y)
    assert_same_bits(nm.linear_bf16(off, nm.Bf16Matrix(w)), naive.to_bf16_rne(off @ w.T))
    # An odd input width runs too, its last product added alone.
    assert nm.Bf16Matrix(w[:, :511]).dot_bf16(x[:, :511], y)
    assert_same_bits(naive.to_bf16_rne(y), naive.linear_bf16_ordered(x[:, :511], w[:, :511]))

# ------------------------------------------------------------- the reference's bf16 summation order

def test_bf16_k_block_is_the_measured_rule():
    assert [nm.bf16_k_block(1, k) for k in (128, 512, 513, 1024, 5120)] == [128, 512, 512, 512, 512]
    assert [nm.bf16_k_block(2, k) for k in (512, 513, 1024, 1025, 8192)] == [512, 512, 512, 1024, 1024]
    for m, k in [(1, 4096), (7, 640), (300, 8192), (2, 1280)]:
        assert nm.bf16_k_block(m, k) == naive.bf16_k_block(m, k)


@pytest.fixture(params=["vdpbf16ps", "fma", "blas-tier"])
def bf16_kernel(request, monkeypatch):
    """Many-row bf16 products on either micro-kernel, whichever this CPU prefers, and on the
    ``blas`` tier (a CPU without AVX512-BF16: the FMA kernel whatever the values)."""
    from ds41numba.numerics import fma_choice
    monkeypatch.setattr(fma_choice, "_fma_choice", [request.param == "fma"])
    with nm.use_backend("blas" if request.param == "blas-tier" else nm.backend()):
        yield request.param


def test_every_bf16_linear_case_of_the_reference_is_bit_exact(linear_cases, bf16_kernel):
    """Every ``y.*`` case of the reference's bf16 F.linear at production inner dimensions (K up to
    8192, with 513): bit for bit. Rows up to MATVEC_MAX_ROWS take the bf16-bits kernel; more
    rows ``vdpbf16ps`` or its FMA twin (every CPU: the ``blas`` tier runs the twin)."""
    checked = 0
    for name in linear_case_names("y"):
        x, w, want = linear_case(linear_cases, name)
        got = nm.linear_bf16(x, nm.Bf16Matrix(np.ascontiguousarray(w)))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        checked += 1
    assert checked == 100


@needs_bf16_dot
def test_bf16_fma_tile_is_vdpbf16ps_where_fma_safe_says_so():
    """The FMA micro-kernel against vdpbf16ps's, bit for bit, on values of every exponent
    fma_safe admits (down to a smallest-product exponent sum of 142, up to the overflow bound);
    inputs it refuses (a denormal, which vdpbf16ps reads as zero; inf; NaN; not bf16; sums that
    could turn denormal or overflow) go to the vdpbf16ps kernel, so the product is the same."""
    rng = np.random.default_rng(70)
    d = 512
    x = naive.to_bf16_rne(rng.standard_normal((nm.DOT_ROWS, d)).astype(F32)
                          * np.exp2(rng.integers(-65, 15, (nm.DOT_ROWS, d))).astype(F32))
    w = naive.to_bf16_rne(rng.standard_normal((64, d)).astype(F32)
                          * np.exp2(rng.integers(-20, 20, (64, d))).astype(F32))
    rx, rw = nm.values_range(x), nm.values_range(nm.pack_bf16_pairs(w))
    assert rx[0] and rw[0] and nm.fma_safe(rx, rw, d) and 142 <= rx[1] + rw[1] < 150
    b = nm.pack_bf16_pairs(w)
    out_dot = np.full((b.shape[0], nm.DOT_ROWS, nm.DOT_LANES), 0.25, F32)
    out_fma = out_dot.copy()
    bf16_dot_blocks(nm.bf16_pairs(x), b, out_dot)
    _fma_all(x, b, out_fma)
    assert_same_bits(out_fma, out_dot)
    assert nm.fma_safe((True, 71, 127), (True, 71, 127), d)
    assert not nm.fma_safe((True, 70, 127), (True, 71, 127), d)
    assert not nm.fma_safe((True, 127, 190), (True, 127, 180), 512)
    assert nm.fma_safe((True, 127, 190), (True, 127, 179), 512)
    assert nm.fma_safe((True, 255, 0), (True, 1, 254), d)          # a side of zeros
    # safe_partner: the bounds fma_safe holds a second operand to, checked on its own.
    for a in [(True, 71, 127), (True, 127, 190), (True, 100, 129), (True, 255, 0)]:
        lo, hi = nm.safe_partner(a, d)
        for b in [(True, e, f) for e in (1, lo - 1, lo, lo + 1) for f in (hi - 1, hi, hi + 1, 254)
                  if 1 <= e <= f <= 254]:
            assert nm.fma_safe(a, b, d) == (lo <= b[1] and b[2] <= hi), (a, b)
    for bad in (2.0 ** -130, np.inf, np.nan, 1.0 + 2.0 ** -10):
        y = x.copy()
        y[3, 7] = F32(bad)
        assert not nm.values_range(y)[0]


# Every kind of value values_range tells apart, as f32 bits: zeros, normals (the extremes of
# bf16's range among them), denormals, infinities, NaNs, values that are not bf16.
_RANGE_VALUES = np.array([0x00000000, 0x80000000, 0x3F800000, 0xBF800000, 0x00800000, 0x80800000,
                          0x7F7F0000, 0xFF7F0000, 0x00010000, 0x807F0000, 0x7F800000, 0xFF800000,
                          0x7FC00000, 0xFF810000, 0x3F800001, 0x3F808000, 0x40490FDB],
                         np.uint32)


def test_values_range_every_bf16_value_against_the_naive_twin():
    """Exhaustive over the 65,536 bf16 bit patterns, each beside 1.0 (exponent 127), as f32
    values and as a pair: the range of every one is the naive twin's, NaN's and inf's exponent
    255 and a denormal's 0 included."""
    ones = np.uint32(0x3F80)
    for h in range(1 << 16):
        f32 = (np.array([h, ones], np.uint32) << 16).view(F32)[None]
        pair = np.array([[h | (ones << 16)]], np.uint32)
        assert nm.values_range(f32) == naive.values_range(f32), hex(h)
        assert nm.values_range(pair) == naive.values_range(pair), hex(h)


@pytest.mark.parametrize("width", [1, 2, 15, 16, 17, 64, 1031])
def test_values_range_mixed_rows_against_the_naive_twin(width):
    """Rows of every width a vector loop splits differently (its tails), drawn from
    ``_RANGE_VALUES``, some values only where the rows are mostly zeros or normals: the whole
    array's range is the twin's, for f32 values and for pairs. A NaN among zeros is not ok (the
    float minima and maxima that came before missed it)."""
    rng = np.random.default_rng(width)
    zero, nan = _RANGE_VALUES[0], _RANGE_VALUES[12]
    for trial in range(40):
        pool = _RANGE_VALUES[: rng.integers(1, len(_RANGE_VALUES) + 1)]
        bits = rng.choice(pool, size=(rng.integers(1, 5), width)).astype(np.uint32)
        if trial % 4 == 0:
            bits[:] = zero
            bits.flat[rng.integers(bits.size)] = rng.choice(_RANGE_VALUES)
        f32 = bits.view(F32)
        assert nm.values_range(f32) == naive.values_range(f32), bits
        pairs = (bits >> 16) | (rng.choice(pool, size=bits.shape).astype(np.uint32) & 0xFFFF0000)
        assert nm.values_range(pairs) == naive.values_range(pairs), pairs
    assert nm.values_range(np.array([[0, nan]], np.uint32).view(F32)) == (False, 255, 255)
    assert nm.values_range(np.zeros((3, width), F32)) == (True, 255, 0)


@pytest.mark.parametrize("wide", [True, False], ids=["avx512", "avx2"])
def test_the_bf16_micro_kernels_passes_cover_their_tile_once(monkeypatch, wide):
    """Whatever this CPU is, both register widths' passes of a bf16 micro-kernel call
    (``bf16_dot._sub_tiles``: AVX-512 one, AVX2 four of 4 rows x 16 lanes) sum every (row,
    16-lane vector) of the output tile exactly once, each within AVX2's 16 registers or
    AVX-512's 32 (a 16-lane vector of sums takes two AVX2 registers)."""
    from ds41numba.numerics import bf16_dot

    monkeypatch.setattr(bf16_dot, "wide_registers", lambda: wide)
    passes = bf16_dot._sub_tiles()
    cells = sorted((m, v) for rows, vecs in passes for m in rows for v in vecs)
    assert cells == [(m, v) for m in range(nm.DOT_ROWS) for v in range(nm.DOT_LANES // 16)]
    registers = max(len(rows) * len(vecs) for rows, vecs in passes) * (1 if wide else 2)
    assert registers <= (16 if wide else 8)


@numba.njit
def _fma_all(a, b, out):
    for k in range(b.shape[0]):
        nm.bf16_fma_tile(a, b[k], out[k])


@needs_bf16_dot
def test_linear_bf16_on_inputs_the_fma_kernel_refuses(bf16_kernel):
    """A denormal input (vdpbf16ps reads it as zero) and tiny values whose products' sums could
    be denormal: with the FMA kernel preferred these run on vdpbf16ps, as the literal order."""
    rng = np.random.default_rng(71)
    x = naive.to_bf16_rne(rng.standard_normal((40, 256)).astype(F32))
    w = naive.to_bf16_rne(rng.standard_normal((64, 256)).astype(F32) / 16)
    x[5, 9] = F32(2.0 ** -130)                                   # a denormal
    tiny = x * F32(2.0 ** -60)
    for a in (x, tiny):
        got = nm.linear_bf16(a, nm.Bf16Matrix(w))
        assert_same_bits(got, naive.linear_bf16_ordered(np.where(np.abs(a) < 2.0 ** -126, 0, a), w))


@pytest.mark.parametrize("m, k, n, groups, ref_rows", [
    (1, 1280, 70, 1, None), (3, 1025, 64, 1, None), (1, 2048, 64, 2, None), (5, 3000, 40, 1, 2048),
    (20, 1536, 64, 1, None), (20, 2050, 96, 2, None), (9, 1100, 64, 1, 1), (40, 777, 64, 1, None),
    (24, 777, 64, 2, None)])
def test_linear_bf16_follows_the_reference_order(m, k, n, groups, ref_rows, bf16_kernel):
    """Against the literal emulation, for both kernels (few rows / many rows), grouped, odd K, and
    a tile of rows summed in the order of a call of ``ref_rows`` rows (a tiled prefill)."""
    rng = np.random.default_rng(m * k + n)
    x = naive.to_bf16_rne(rng.standard_normal((m, groups * k)).astype(F32))
    w = naive.to_bf16_rne((rng.standard_normal((n, k)) / np.sqrt(k)).astype(F32))
    rank = n // groups
    want = np.concatenate([naive.linear_bf16_ordered(
        x[:, g * k:(g + 1) * k], w[g * rank:(g + 1) * rank], ref_rows or m) for g in range(groups)], axis=1)
    got = nm.linear_bf16(x, nm.Bf16Matrix(w, groups=groups), ref_rows=ref_rows)
    assert_same_bits(got, want)


def _bf16_rows(rng, shape, scale=1.0):
    return naive.to_bf16_rne((rng.standard_normal(shape) * scale).astype(F32))


@pytest.mark.parametrize("m, k, n, groups, ref_rows", [
    (1, 64, 32, 1, None), (1, 1280, 300, 1, None), (1, 5, 7, 1, None), (1, 511, 33, 1, None),
    (1, 1025, 96, 1, None), (2, 1537, 130, 1, None), (8, 2048, 64, 1, None), (1, 4096, 8 * 40, 8, None),
    (3, 1024, 4 * 160, 4, 3), (1, 777, 2 * 200, 2, 1), (5, 3000, 40, 1, 2048), (1, 1100, 129, 1, 9),
    (7, 513, 256, 1, 1)])
def test_matvec_is_the_literal_reference_order(m, k, n, groups, ref_rows):
    """The decode kernel against the literal emulation, bit for bit: one and several rows, odd K
    (below, at and above a run), rows not a multiple of a block or of a work item's blocks,
    grouped weights, and the run length of a call of ``ref_rows`` rows."""
    rng = np.random.default_rng(m * 7 + k + n)
    x = _bf16_rows(rng, (m, groups * k))
    w = _bf16_rows(rng, (n, k), 1 / np.sqrt(k))
    rank = n // groups
    want = np.concatenate([naive.linear_bf16_ordered(
        x[:, g * k:(g + 1) * k], w[g * rank:(g + 1) * rank], ref_rows or m) for g in range(groups)], axis=1)
    got = nm.Bf16Matrix(w, groups=groups).matvec(x, ref_rows)
    assert got.shape == (m, n)
    assert_same_bits(got, want)


def test_matvec_propagates_special_values_as_the_literal_order_does():
    """inf, NaN, inf * 0 and signed zeros (an odd K's last product among them) come out as in
    the literal order."""
    w = np.array([[1.0, 1.0, 1.0], [1.0, 2.0, np.inf], [0.0, 1.0, 0.0], [-1.0, np.nan, 1.0]] * 9, F32)
    for xi in ([-0.0, -0.0, -0.0], [1.0, -2.0, 0.5], [1.0, 2.0, np.inf], [np.inf, 0.0, -1.0]):
        x = np.array([xi], F32)
        with np.errstate(invalid="ignore"):
            want = naive.linear_bf16_ordered(x, w, 1)
        assert_same_bits(nm.Bf16Matrix(w).matvec(x), want)


def test_a_read_only_row_takes_the_compiled_kernel():
    """A read-only input (a row of a memory-mapped golden) gives the writable input's bits, with
    the kernel numba compiled for it (a read-only array is a type of its own: a compile of
    seconds for nothing)."""
    from ds41numba.numerics import matvec as matvec_mod
    rng = np.random.default_rng(5)
    x = _bf16_rows(rng, (1, 96))
    mat = nm.Bf16Matrix(_bf16_rows(rng, (40, 96), 0.1))
    want = mat.matvec(x)
    compiled = set(matvec_mod._matvec_kernel.signatures)
    x.flags.writeable = False
    assert_same_bits(mat.matvec(x), want)
    assert set(matvec_mod._matvec_kernel.signatures) == compiled


@needs_bf16_dot
@pytest.mark.parametrize("k, n, groups", [(1280, 96, 1), (2048, 8 * 32, 8), (1537, 70, 1)])
def test_one_row_and_many_row_products_of_one_matrix_agree(k, n, groups):
    """The decode kernel and the AVX512-BF16 product read the same held pairs in the same order:
    each row on its own (told the call has the many rows' count) is the many-row product's row."""
    rng = np.random.default_rng(k + n)
    x = _bf16_rows(rng, (24, groups * k))
    mat = nm.Bf16Matrix(_bf16_rows(rng, (n, k), 1 / np.sqrt(k)), groups=groups)
    many = nm.linear_bf16(x, mat)
    rows = np.concatenate([mat.matvec(x[i:i + 1], ref_rows=24) for i in range(24)])
    assert_same_bits(rows, many)


@pytest.mark.parametrize("m, k, n, groups", [(20, 96, 40, 1), (16, 128, 64, 4), (3, 20, 30, 1),
                                             (40, 777, 64, 2), (9, 1100, 64, 1), (12, 16, 16, 2)])
def test_blas_tier_widens_the_held_weight_exactly_and_orders_the_rest(m, k, n, groups):
    """On the ``blas`` tier (a CPU without AVX512-BF16) the tiny products (torch's own kernel in
    the reference) run on BLAS from the held pairs widened back to the very f32 weight: BLAS's own
    product of that weight. Every other many-row product runs on the FMA kernel, in the
    reference's order."""
    rng = np.random.default_rng(m + k + n)
    x = _bf16_rows(rng, (m, groups * k))
    w = _bf16_rows(rng, (n, k), 1 / np.sqrt(k))
    mat = nm.Bf16Matrix(w, groups=groups)
    rank = n // groups
    assert_same_bits(mat.to_f32(), w)
    assert_same_bits(mat.to_f32(groups - 1), w[(groups - 1) * rank:])
    tiny = m * rank * k <= nm.TINY_BF16_LINEAR
    want = np.empty((m, n), F32)
    for g in range(groups):
        xg = np.ascontiguousarray(x[:, g * k:(g + 1) * k])
        wg = np.ascontiguousarray(w[g * rank:(g + 1) * rank])
        if tiny:
            y = np.empty((m, rank), F32)
            linear_mod._blas_product(xg, wg, y, m)
            want[:, g * rank:(g + 1) * rank] = naive.to_bf16_rne(y)
        else:
            want[:, g * rank:(g + 1) * rank] = naive.linear_bf16_ordered(xg, wg, m)
    with nm.use_backend("blas"):
        got = nm.linear_bf16(x, mat)
    assert_same_bits(got, want)


def test_bf16_and_f32_inputs_build_the_same_matrix():
    """An ``ml_dtypes.bfloat16`` weight and the float32 one holding its values give the same held
    pairs, the same products on every path, and hold 2 bytes a parameter plus only the padding;
    neither keeps the caller's array."""
    rng = np.random.default_rng(11)
    for (n, k, groups) in [(64, 512, 1), (8 * 40, 65, 8), (70, 511, 1)]:
        w = _bf16_rows(rng, (n, k))
        a, b = nm.Bf16Matrix(w, groups=groups), nm.Bf16Matrix(w.astype(ml_dtypes.bfloat16), groups=groups)
        assert np.array_equal(a._pairs, b._pairs) and a.shape == b.shape == (n, k)
        rank = n // groups
        padded = groups * (-(-rank // 32) * 32) * (k + k % 2)
        assert a.nbytes == b.nbytes == 2 * padded == nm.Bf16Matrix.held_bytes((n, k), groups)
        x = _bf16_rows(rng, (12, groups * k))
        for rows in (1, 12):
            assert_same_bits(nm.linear_bf16(x[:rows], a), nm.linear_bf16(x[:rows], b))
        with nm.use_backend("blas"):
            assert_same_bits(nm.linear_bf16(x, a), nm.linear_bf16(x, b))
    assert nm.Bf16Matrix(np.zeros((64, 512), F32)).nbytes == 64 * 512 * 2
    w = _bf16_rows(rng, (40, 30))
    ref = weakref.ref(w)
    mat = nm.Bf16Matrix(w)
    del w
    gc.collect()
    assert ref() is None and mat.shape == (40, 30)
    with pytest.raises(ValueError, match="bf16 values"):
        nm.Bf16Matrix(_bf16_rows(rng, (4, 6)) + F32(2.0 ** -12))
    with pytest.raises(TypeError, match="float32"):
        nm.Bf16Matrix(np.zeros((4, 6)))


# ------------------------------------------------------------------------- inputs shared by weights


def _shared_case(rng, k, outs, groups=1):
    """Weights of ``outs`` rows taking ``groups * k`` inputs, their naive products of ``x``."""
    ws = [_bf16_rows(rng, (n, k), 1 / np.sqrt(k)) for n in outs]
    mats = [nm.Bf16Matrix(w, groups=groups) for w in ws]

    def want(x, ref_rows=None):
        out = []
        for w, n in zip(ws, outs):
            rank = n // groups
            out.append(np.concatenate([naive.linear_bf16_ordered(
                x[:, g * k:(g + 1) * k], w[g * rank:(g + 1) * rank], ref_rows or len(x))
                for g in range(groups)], axis=1))
        return out
    return mats, want


@pytest.mark.parametrize("k, outs, groups, m, ref_rows", [
    (5120 // 8, [512, 96, 1280 // 8, 32], 1, 1, None), (1537, [70, 33], 1, 2, None),
    (300, [64, 8 * 40, 16], 8, 1, None), (1100, [129, 1, 64], 1, 3, 1), (513, [256, 40], 1, 1, 9)])
def test_weights_sharing_an_input_give_each_its_own_product(k, outs, groups, m, ref_rows):
    """Weights that share their input (a layer's projections of x) each get the literal
    reference order's product, bit for bit, whichever asks first, one row or several, odd K,
    outputs not a multiple of a block, grouped weights, a call's run length."""
    rng = np.random.default_rng(k + len(outs))
    mats, want = _shared_case(rng, k, outs, groups)
    nm.SharedInput(mats)
    x = _bf16_rows(rng, (m, groups * k))
    expected = want(x, ref_rows)
    for order in (range(len(mats)), reversed(range(len(mats)))):
        for j in order:
            assert_same_bits(mats[j].matvec(x, ref_rows), expected[j])
    x2 = _bf16_rows(rng, (m, groups * k))
    assert_same_bits(nm.linear_bf16(x2, mats[-1], ref_rows=ref_rows), want(x2, ref_rows)[-1])


def test_weights_sharing_an_input_run_one_kernel_call_a_step(monkeypatch):
    """The first member asked computes every member's product in one call; the others are handed
    theirs for the same input, each once; another input, run length or a second request of one
    member calls again (and still gets its own product)."""
    from ds41numba.numerics import matvec as matvec_mod

    calls = []
    real = matvec_mod.matvec_into
    monkeypatch.setattr(linear_mod, "matvec_into", lambda *a: calls.append(len(a[1])) or real(*a))
    rng = np.random.default_rng(5)
    mats, want = _shared_case(rng, 1100, [512, 96, 160, 32])
    nm.SharedInput(mats)
    x = _bf16_rows(rng, (1, 1100))
    for mat in mats:
        mat.matvec(x)
    assert calls == [4]
    assert_same_bits(mats[0].matvec(x), want(x)[0])            # asked again: a new call
    x_other = x.copy()
    x_other[0, 3] = -x_other[0, 3] if x_other[0, 3] else 1.0
    assert_same_bits(mats[1].matvec(x_other), want(x_other)[1])
    assert_same_bits(mats[2].matvec(x_other, ref_rows=2), want(x_other, 2)[2])   # runs of 1,024
    assert calls == [4, 4, 4, 4]
    assert_same_bits(mats[3].matvec(x_other, ref_rows=2), want(x_other, 2)[3])
    assert calls == [4, 4, 4, 4]


@pytest.mark.parametrize("lead", [0, 1 << 20, 1 << 30], ids=["no-lead", "lead-1MB", "half-lead"])
@pytest.mark.parametrize("k, n, groups, m, ref_rows", [
    (2048, 2048, 1, 1, None), (1024, 4096, 2, 3, None), (2047, 2048, 1, 2, 1)])
def test_a_product_read_beside_other_work_is_the_product(k, n, groups, m, ref_rows, lead,
                                                         monkeypatch):
    """``linear_bf16_beside`` of a decode step's rows by a weight of ``BESIDE_MIN_BYTES`` (one
    row or several, grouped, odd K, a call's run length): the literal reference order's
    product bit for bit, and ``linear_bf16``'s, complete when the block ends; the block's own
    numba kernels run on one thread meanwhile. Whatever the calling thread reads first
    (``matvec.LEAD_BYTES``: none, 1 MB, or as much as it may: half the weight, 4 MB here, as
    the default does)."""
    if not nm.can_work_beside():
        pytest.skip("one numba thread: nothing runs beside")
    monkeypatch.setattr(matvec_mod, "LEAD_BYTES", lead)
    rng = np.random.default_rng(k + m)
    mats, want = _shared_case(rng, k, [n], groups)
    assert mats[0].nbytes >= nm.BESIDE_MIN_BYTES
    x = _bf16_rows(rng, (m, groups * k))
    small, small_x = nm.Bf16Matrix(_bf16_rows(rng, (64, 96))), _bf16_rows(rng, (1, 96))
    with nm.linear_bf16_beside(x, mats[0], ref_rows) as got:
        threads_inside = numba.get_num_threads()
        small_y = nm.linear_bf16(small_x, small)
    assert threads_inside == 1 and got is not None
    assert_same_bits(got, want(x, ref_rows)[0])
    assert_same_bits(got, nm.linear_bf16(x, mats[0], ref_rows=ref_rows))
    assert_same_bits(small_y, nm.linear_bf16(small_x, small))


def test_a_claimed_call_runs_at_most_its_share_of_items():
    """``matvec._claimed_kernel`` with ``most`` items claims and runs that many (each whole,
    the outputs of the others untouched), then, called again without a limit, the rest: the
    calling thread's first share of a product read beside its block."""
    rng = np.random.default_rng(29)
    w = nm.Bf16Matrix(_bf16_rows(rng, (512, 96)))       # 4 items of 128 outputs
    x = _bf16_rows(rng, (1, 96))
    want = nm.linear_bf16(x, w)
    out = np.full((1, 512), np.nan, np.float32)
    x2, block = w._matvec_input(x, None)
    args = matvec_mod._call_args("test", x2, (w._pairs,), (w.groups,), (out,))
    counter = np.zeros(1, np.int64)
    matvec_mod._claimed_kernel(*args, 96, block, counter, 3)
    assert counter[0] == 3
    assert_same_bits(out[:, :384], want[:, :384])
    assert np.isnan(out[:, 384:]).all()
    matvec_mod._claimed_kernel(*args, 96, block, counter, 1 << 20)
    assert counter[0] == 5                      # the last claim found no item
    assert_same_bits(out, want)


def test_a_product_that_would_not_pay_beside_is_left_to_the_caller():
    """``linear_bf16_beside`` gives None (the caller multiplies as usual) for a weight under
    ``BESIDE_MIN_BYTES``, a plain float32 weight, a prefill's rows, and one numba thread."""
    rng = np.random.default_rng(23)
    big = nm.Bf16Matrix(_bf16_rows(rng, (2048, 2048), 1 / 45))
    w_small = _bf16_rows(rng, (256, 2048))
    cases = [(_bf16_rows(rng, (1, 2048)), nm.Bf16Matrix(w_small), None),
             (_bf16_rows(rng, (1, 2048)), w_small, None),
             (_bf16_rows(rng, (16, 2048)), big, None),
             (_bf16_rows(rng, (2, 2048)), big, 4096)]
    for x, w, ref_rows in cases:
        with nm.linear_bf16_beside(x, w, ref_rows) as got:
            assert got is None
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with nm.linear_bf16_beside(_bf16_rows(rng, (1, 2048)), big) as got:
            assert got is None
    finally:
        numba.set_num_threads(threads)


def test_shared_inputs_survive_a_pickle_and_refuse_what_cannot_share():
    """A pickled layer's weights still share their input (and carry no output); weights of other
    widths, a weight twice or in two groups, or more than MATVEC_MEMBERS are refused."""
    import pickle

    rng = np.random.default_rng(8)
    mats, want = _shared_case(rng, 96, [64, 40])
    group = nm.SharedInput(mats)
    x = _bf16_rows(rng, (1, 96))
    mats[0].matvec(x)
    back = pickle.loads(pickle.dumps(mats))
    assert back[0]._shared is back[1]._shared and back[0]._shared.members == tuple(back)
    assert back[0]._shared._ready == {} and group._ready
    for got, expected in zip(back, want(x)):
        assert_same_bits(got.matvec(x), expected)
    with pytest.raises(ValueError, match="one group at most"):
        nm.SharedInput([mats[0], nm.Bf16Matrix(_bf16_rows(rng, (8, 96)))])
    for bad in ([nm.Bf16Matrix(_bf16_rows(rng, (8, 96)))] * 2,
                [nm.Bf16Matrix(_bf16_rows(rng, (8, 96))), nm.Bf16Matrix(_bf16_rows(rng, (8, 95)))],
                [nm.Bf16Matrix(_bf16_rows(rng, (8, 96))) for _ in range(nm.MATVEC_MEMBERS + 1)]):
        with pytest.raises(ValueError, match="SharedInput"):
            nm.SharedInput(bad)


@pytest.mark.parametrize("workers", [1, 2, 3, 11])
def test_the_decode_kernel_splits_its_items_whole_whatever_the_workers(workers):
    """Each worker's run of work items (an equal share of the weights' blocks; a weight's last
    item and a one-block weight's only one hold fewer) covers the call's list once: every
    product is the literal order's for any number of workers, more than there are items too."""
    from ds41numba.numerics import matvec as matvec_mod

    rng = np.random.default_rng(workers)
    mats, want = _shared_case(rng, 300, [512, 96, 160, 32])     # 4 + 1 + 2 + 1 items
    x = _bf16_rows(rng, (1, 300))
    outs = tuple(np.full((1, m.shape[0]), np.nan, F32) for m in mats)
    matvec_mod._matvec_kernel(x, tuple(m._pairs for m in mats), outs, (1, 1, 1, 1), 300, 300,
                                workers)
    for got, expected in zip(outs, want(x)):
        assert_same_bits(got, expected)


@pytest.mark.parametrize("ends", [[], [4], [4, 5, 9, 13], [1, 2, 3, 4, 5, 6, 7, 8], [4, 8, 8, 12]])
def test_items_up_to_counts_the_items_ending_by_a_share_of_blocks(ends):
    """A worker's first and last item: numpy's ``searchsorted(side="right")``, at every share."""
    from ds41numba.numerics import matvec as matvec_mod

    ends = np.array(ends, np.int64)
    for blocks in range(-1, (ends[-1] if len(ends) else 0) + 2):
        assert matvec_mod._items_up_to(ends, blocks) == np.searchsorted(ends, blocks, side="right")
