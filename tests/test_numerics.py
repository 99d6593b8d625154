"""Bit-level tests of ds41numba.numerics against ml_dtypes and the numpy versions in naive.py.

Every rounding is compared bit for bit (NaN payloads included where ml_dtypes defines them) on ten
million random f32 per conversion (random bit patterns and normals over many scales), on exhaustive
code tables and on every tie. The quantisers are compared with naive.py's ml_dtypes versions and
checked on the reference's own outputs (tests/data), which must be their fixed points.
"""

import gc
import weakref

import ml_dtypes
import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import naive
from helpers import REFERENCE_GOLDENS, linear_case, linear_case_names
from ds41numba import numerics as nm
from ds41numba.numerics import linear as linear_mod

F32 = np.float32
U32 = np.uint32
N_RANDOM = 10_000_000


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


@pytest.fixture(scope="module")
def random_bits():
    rng = np.random.default_rng(20240601)
    return rng.integers(0, 1 << 32, N_RANDOM, dtype=np.uint64).astype(U32).view(F32)


@pytest.fixture(scope="module")
def random_normals():
    """Ten million normals, a million at each of ten scales from the f32 subnormals to 1e30."""
    rng = np.random.default_rng(7)
    scales = [1e-44, 1e-40, 1e-30, 1e-8, 1e-3, 1.0, 37.0, 1e3, 1e8, 1e30]
    n = N_RANDOM // len(scales)
    return np.concatenate([(rng.standard_normal(n) * s).astype(F32) for s in scales])


def neighbours(x):
    """x and its f32 neighbours below and above."""
    x = np.asarray(x, F32)
    return np.concatenate([x, np.nextafter(x, F32(-np.inf)), np.nextafter(x, F32(np.inf))])


def test_constants():
    assert (nm.FP4_BLOCK, nm.LATENT_BLOCK, nm.FP8_BLOCK) == (32, 16, 32)
    assert (nm.E4M3_MAX, nm.E2M1_MAX) == (448.0, 6.0)


# --------------------------------------------------------------------------------------- bf16


def test_bf16_every_bf16_pattern_and_every_tie():
    hi = np.arange(1 << 16, dtype=U32) << 16
    lows = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # 0x8000 is the exact tie
    x = np.concatenate([(hi | low).view(F32) for low in lows])
    assert_same_bits(nm.to_bf16_rne(x), naive.to_bf16_rne(x))


def test_bf16_ties_go_to_even():
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-126 * (1 + 2.0**-8)], F32)
    want = np.array([1.0, 1 + 2.0**-6, -1.0, 2.0**-126], F32)
    assert_same_bits(nm.to_bf16_rne(x), want)


def test_bf16_random_bits(random_bits):
    assert_same_bits(nm.to_bf16_rne(random_bits), naive.to_bf16_rne(random_bits))


def test_bf16_random_normals(random_normals):
    assert_same_bits(nm.to_bf16_rne(random_normals), naive.to_bf16_rne(random_normals))


def test_bf16_specials():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4028235e38, -3.4028235e38,
                  1e-45, -1e-45, 2.0**-133, 2.0**-134, 3 * 2.0**-134, 1.1754942e-38], F32)
    got = nm.to_bf16_rne(x)
    assert_same_bits(got, naive.to_bf16_rne(x))
    assert np.signbit(got[1]) and got[1] == 0
    assert np.isposinf(got[6]) and np.isneginf(got[7])  # overflow rounds to infinity
    assert got[10] == 2.0**-133 and got[11] == 0 and got[12] == 2.0**-132  # bf16 subnormals


def test_bf16_scalar_matches_array():
    vals = neighbours(np.array([1.00390625, 0.0, -3.0, 65504.0, 1e-40], F32))
    assert_same_bits(np.array([nm.bf16_scalar(v) for v in vals], F32), naive.to_bf16_rne(vals))


def test_round_bf16_inplace_and_is_bf16_valued():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 7)).astype(F32)
    assert not nm.is_bf16_valued(x)
    want = naive.to_bf16_rne(x)
    assert nm.round_bf16_inplace(x) is x
    assert_same_bits(x, want)
    assert nm.is_bf16_valued(x)
    assert nm.is_bf16_valued(np.array([np.nan, np.inf, -0.0], F32))
    with pytest.raises(ValueError, match="C-contiguous"):
        nm.round_bf16_inplace(np.zeros((4, 4), F32)[:, ::2])
    with pytest.raises(TypeError, match="float32"):
        nm.is_bf16_valued(np.zeros(3))


def test_conversions_accept_any_shape_and_layout():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((6, 8, 10)).astype(F32)
    view = base[::2, :, 1::3]  # non-contiguous
    for fn, ref in [(nm.to_bf16_rne, naive.to_bf16_rne), (nm.to_e4m3_rne, naive.to_e4m3_rne),
                    (nm.to_e2m1_rne, naive.to_e2m1_rne)]:
        got = fn(view)
        assert got.shape == view.shape and got.dtype == F32 and got.flags.c_contiguous
        assert_same_bits(got, ref(view))
        assert fn(np.zeros((0, 3), F32)).shape == (0, 3)
        assert fn(np.float32(1.5)).shape == ()
        with pytest.raises(TypeError, match="float32"):
            fn(view.astype(np.float64))
    original = base.copy()
    nm.to_bf16_rne(base)
    assert_same_bits(base, original)  # inputs are never modified


# --------------------------------------------------------------------------------------- e4m3


def e4m3_codes():
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(F32)


def test_e4m3_all_codes_and_midpoints():
    codes = e4m3_codes()
    finite = np.unique(codes[np.isfinite(codes)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(F32)
    assert np.all(mids.astype(np.float64) == (finite[:-1].astype(np.float64) + finite[1:]) / 2)
    x = np.concatenate([codes, neighbours(finite), neighbours(mids)])
    got = nm.to_e4m3_rne(x)
    assert_same_bits(got, naive.to_e4m3_rne(x))
    fin = np.isfinite(codes)
    assert_same_bits(got[:256][fin], codes[fin])  # every code maps to itself
    assert np.isnan(got[:256][~fin]).all()


def test_e4m3_ties_subnormals_and_overflow():
    x = np.array([2.0**-10, 3 * 2.0**-10, -(2.0**-10), 1.5 * 2.0**-9, 5 * 2.0**-10, 2.0**-20, 1e-40,
                  448.0, 449.0, 463.99, 464.0, 464.01, 480.0, 1e6, np.inf, -np.inf, -464.0, np.nan],
                 F32)
    got = nm.to_e4m3_rne(x)
    assert_same_bits(got, naive.to_e4m3_rne(x))
    assert np.signbit(got[2]) and got[2] == 0  # tie at half the smallest subnormal -> -0
    assert got[1] == 2.0**-8 and got[3] == 2.0**-8 and got[4] == 2.0**-8  # ties to even codes
    assert got[5] == 0 and got[6] == 0
    assert list(got[7:11]) == [448.0] * 4 and got[16] == -448.0  # 464 ties down to 448
    assert np.isnan(got[11:16]).all() and np.isnan(got[17])  # no inf, no saturation


def test_e4m3_random_bits(random_bits):
    assert_same_bits(nm.to_e4m3_rne(random_bits), naive.to_e4m3_rne(random_bits))


def test_e4m3_random_normals(random_normals):
    x = np.concatenate([random_normals[::4], random_normals[1::4] * F32(2.0**-30)])
    x = np.concatenate([x, random_normals[2::4] * F32(2.0**-12), random_normals[3::4] * F32(2.0**9)])
    assert_same_bits(nm.to_e4m3_rne(x), naive.to_e4m3_rne(x))


# --------------------------------------------------------------------------------------- e2m1

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)


def test_e2m1_grid_midpoints_and_tie_rule():
    codes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(F32)
    assert_same_bits(nm.to_e2m1_rne(codes), codes)
    mids = (E2M1_GRID[:-1] + E2M1_GRID[1:]) / 2
    # SPEC: on a tie the neighbour with the even 3-bit code (codes 0..7 = the grid in order).
    lower_code = np.arange(7)
    want = np.where(lower_code % 2 == 0, E2M1_GRID[:-1], E2M1_GRID[1:])
    assert_same_bits(nm.to_e2m1_rne(mids), want)
    assert_same_bits(nm.to_e2m1_rne(-mids), -want)
    x = np.concatenate([neighbours(E2M1_GRID), neighbours(mids), -neighbours(mids)])
    assert_same_bits(nm.to_e2m1_rne(x), naive.to_e2m1_rne(x))


def test_e2m1_sign_saturation_and_nan():
    x = np.array([-0.2, -0.0, 0.2, 6.5, 7.0, 1e30, np.inf, -7.0, -np.inf, 1e-40, -1e-40], F32)
    got = nm.to_e2m1_rne(x)
    assert_same_bits(got, naive.to_e2m1_rne(x))
    assert np.signbit(got[0]) and got[0] == 0 and np.signbit(got[1]) and not np.signbit(got[2])
    assert list(got[3:7]) == [6.0] * 4 and list(got[7:9]) == [-6.0] * 2
    # e2m1 has no NaN: ml_dtypes turns NaN into a zero, an f32 result keeps it NaN.
    assert np.isnan(nm.to_e2m1_rne(np.array([np.nan, -np.nan], F32))).all()


def test_e2m1_random_bits(random_bits):
    got = nm.to_e2m1_rne(random_bits)
    nan = np.isnan(random_bits)
    assert np.isnan(got[nan]).all()
    assert_same_bits(got[~nan], naive.to_e2m1_rne(random_bits[~nan]))


def test_e2m1_random_normals(random_normals):
    x = np.concatenate([random_normals[::2], random_normals[1::2] * F32(1e-30) * F32(1e30)])
    x = np.clip(x, F32(-1e30), F32(1e30)) / F32(1e2)
    assert_same_bits(nm.to_e2m1_rne(x), naive.to_e2m1_rne(x))


# --------------------------------------------------------------------------------------- pow2ceil


def test_pow2ceil_random_bits(random_bits):
    assert_same_bits(nm.pow2ceil(random_bits), naive.pow2ceil(random_bits))


def test_pow2ceil_powers_and_e8m0_scales():
    p = np.ldexp(F32(1), np.arange(-149, 128)).astype(F32)
    assert_same_bits(nm.pow2ceil(p), p)  # an exact power of two maps to itself
    above = np.nextafter(p, F32(np.inf))
    got = nm.pow2ceil(above)
    assert_same_bits(got[:-1], p[1:]) and np.isposinf(got[-1])
    # On positive normals the result is a power of two an e8m0 scale holds, and v <= p < 2v.
    rng = np.random.default_rng(3)
    v = rng.integers(0x00800000, 0x7F000000, 2_000_000, dtype=np.uint64).astype(U32).view(F32)
    got = nm.pow2ceil(v)
    as_e8m0 = got.astype(ml_dtypes.float8_e8m0fnu).astype(F32)
    assert_same_bits(as_e8m0, got)
    assert np.all(got >= v) and np.all(got / 2 < v)


def test_pow2ceil_specials():
    x = np.array([0.0, -0.0, -1.0, -np.inf, np.nan, np.inf, 3e38, 2.0**127, 2.0**-149, 3 * 2.0**-149, 1e-39,
                  1.0, 1.0000001, 448.0 / 448.0, 1e-4 / 448.0], F32)
    got = nm.pow2ceil(x)
    assert np.isnan(got[:5]).all()
    assert np.isposinf(got[5]) and np.isposinf(got[6]) and got[7] == 2.0**127
    assert got[8] == 2.0**-149 and got[9] == 2.0**-147 and got[10] == 2.0**-129
    assert got[11] == 1 and got[12] == 2 and got[13] == 1 and got[14] == 2.0**-22
    assert [nm.pow2ceil_scalar(v) for v in x[5:]] == list(got[5:])


# --------------------------------------------------------------------------------------- quantisers

QUANTISERS = [
    (nm.act_quant_fp8_inplace, naive.act_quant_fp8_inplace, 32),
    (nm.fp4_quant_e8m0_inplace, naive.fp4_quant_e8m0_inplace, 32),
    (nm.fp4_quant_e4m3_inplace, naive.fp4_quant_e4m3_inplace, 16),
]
QUANT_IDS = ["fp8", "fp4_e8m0", "fp4_e4m3"]


def random_blocks(rng, rows, cols, block):
    """bf16-valued rows whose blocks span 1e-30 .. 1e30 in scale, with special blocks mixed in."""
    x = rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-69, 69, (rows, 1)))
    x = x.astype(F32)
    if rows < 6:
        return naive.to_bf16_rne(x)
    x[0] = 0.0
    x[1, :block] = -0.0
    x[2, :block] = rng.standard_normal(block) * 1e-7  # under every amax floor
    x[3, :block] = 1e-3
    x[3, 1] = 3e4  # a single huge value
    x[4, :block] = np.array([0.25, -0.75, 1.25, -1.75, 2.5, 3.5, -5.0, 6.0], F32).repeat(block // 8)
    x[5, :block] = 2.0**-130  # f32 subnormals
    return naive.to_bf16_rne(x)


@pytest.mark.parametrize("fn,ref,block", QUANTISERS, ids=QUANT_IDS)
def test_quantiser_matches_naive(fn, ref, block):
    rng = np.random.default_rng(block)
    for shape in [(block,), (7, 2 * block), (40, 3, 4 * block), (3000, 8 * block)]:
        x = random_blocks(rng, int(np.prod(shape[:-1])), shape[-1], block).reshape(shape)
        want = ref(x, block)
        got = x.copy()
        assert fn(got, block) is got
        assert_same_bits(got, want)
        assert nm.is_bf16_valued(got)


@pytest.mark.parametrize("fn,ref,block", QUANTISERS, ids=QUANT_IDS)
def test_quantiser_floors_and_specials(fn, ref, block):
    x = np.zeros((6, block), F32)
    x[1] = -0.0
    x[2, 3] = np.nan
    x[3, 5] = np.inf
    x[4, :] = 1e-30
    x[5, :] = 1.5  # a fixed point of all three
    got = fn(x.copy(), block)
    assert_same_bits(got, ref(x, block), nan_any=True)
    assert_same_bits(got[:2], x[:2])  # zero blocks stay zeros, -0.0 included
    assert np.isnan(got[2]).all()  # a NaN poisons its block (NaN amax) ...
    assert_same_bits(got[5], x[5])  # ... and no other block
    assert np.signbit(got[4]).sum() == 0


def test_fp8_amax_floor_grid():
    # amax < 1e-4 is floored: s = pow2ceil(1e-4 / 448) = 2^-22, so 1e-6 -> e4m3(4.19...) * s = 4 * s
    x = np.full((1, 32), 1e-6, F32)
    assert np.all(nm.act_quant_fp8_inplace(x) == F32(4 * 2.0**-22))


def test_fp4_e4m3_scale_is_e4m3():
    # amax 10 -> s = e4m3(10 / 6) = 1.625; 10 / s = 6.15 clamps to 6 -> 9.75; 1 / s -> 0.5 * s
    x = np.zeros((1, 16), F32)
    x[0, 0], x[0, 1] = 10.0, 1.0
    got = nm.fp4_quant_e4m3_inplace(x)
    assert got[0, 0] == F32(9.75) and got[0, 1] == F32(0.8125)


@pytest.mark.parametrize("fn", [q[0] for q in QUANTISERS], ids=QUANT_IDS)
def test_quantiser_validation(fn):
    with pytest.raises(ValueError, match=r"\(3, 20\).*block 16"):
        fn(np.zeros((3, 20), F32), 16)
    with pytest.raises(ValueError, match="C-contiguous"):
        fn(np.zeros((64, 64), F32)[:, ::2])
    with pytest.raises(TypeError, match="float32"):
        fn(np.zeros((2, 64)))
    ro = np.zeros((2, 64), F32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fn(ro)
    with pytest.raises(ValueError, match="block"):
        fn(np.zeros((2, 64), F32), 0)
    with pytest.raises(ValueError, match="multiple"):
        fn(np.zeros((), F32))


def test_row_helpers_work_on_views():
    rng = np.random.default_rng(5)
    x = random_blocks(rng, 8, 64, 32)
    for kind, ref, block in [(nm.Q_FP8, naive.act_quant_fp8_inplace, 32),
                             (nm.Q_FP4_E8M0, naive.fp4_quant_e8m0_inplace, 32),
                             (nm.Q_FP4_E4M3, naive.fp4_quant_e4m3_inplace, 16)]:
        y = x.copy()
        for r in range(y.shape[0]):
            nm.quant_row(y[r], block, kind)
        assert_same_bits(y, ref(x, block))


bf16_blocks = hnp.arrays(
    F32, st.tuples(st.integers(1, 4), st.sampled_from([32, 64])),
    elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
).map(naive.to_bf16_rne)
scales = st.sampled_from([1e-30, 1e-12, 1e-5, 1.0, 1e5, 1e20])


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
def test_fp8_properties(x, scale):
    x = naive.to_bf16_rne(x * F32(scale))
    q = nm.act_quant_fp8_inplace(x.copy())
    assert nm.is_bf16_valued(q)
    assert np.array_equal(np.signbit(q), np.signbit(x))
    assert_same_bits(nm.act_quant_fp8_inplace(q.copy()), q)  # idempotent
    b = x.reshape(-1, 32)
    s = naive.pow2ceil(np.maximum(np.abs(b).max(axis=1), F32(1e-4)) / F32(448))[:, None]
    err = np.abs(q.reshape(-1, 32).astype(np.float64) - b)
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(b), 2.0**-10 * s) * (1 + 2.0**-20))


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
def test_fp4_e8m0_properties(x, scale):
    x = naive.to_bf16_rne(x * F32(scale))
    q = nm.fp4_quant_e8m0_inplace(x.copy())
    assert nm.is_bf16_valued(q)
    assert np.array_equal(np.signbit(q), np.signbit(x))
    assert_same_bits(nm.fp4_quant_e8m0_inplace(q.copy()), q)  # idempotent
    b = x.reshape(-1, 32)
    s = naive.pow2ceil(np.maximum(np.abs(b).max(axis=1), F32(6 * 2.0**-126)) / F32(6))[:, None]
    err = np.abs(q.reshape(-1, 32).astype(np.float64) - b)
    assert np.all(err <= np.maximum(0.25 * s, np.abs(b) / 4) * (1 + 2.0**-20))


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
def test_fp4_e4m3_properties(x, scale):
    x = naive.to_bf16_rne(x * F32(scale))
    q = nm.fp4_quant_e4m3_inplace(x.copy())
    b = x.reshape(-1, 16)
    amax = np.maximum(np.abs(b).max(axis=1), F32(6 * 2.0**-9))
    s = naive.to_e4m3_rne(amax / F32(6))[:, None]
    finite = np.isfinite(s[:, 0])  # amax / 6 beyond 464: the e4m3 scale itself is NaN
    qb = q.reshape(-1, 16)
    assert np.isnan(qb[~finite]).all()
    assert nm.is_bf16_valued(q)
    assert np.array_equal(np.signbit(qb[finite]), np.signbit(b[finite]))
    err = np.abs(qb[finite].astype(np.float64) - b[finite])
    assert np.all(err <= np.maximum(0.25 * s[finite], np.abs(b[finite]) / 4) * (1 + 2.0**-20))
    # Idempotent only where the scale is an e4m3 normal (>= 2^-6): a subnormal scale is so coarse
    # that the re-quantised amax can pick a smaller one.
    again = nm.fp4_quant_e4m3_inplace(q.copy()).reshape(-1, 16)
    normal = finite & (s[:, 0] >= 2.0**-6)
    assert_same_bits(again[normal], qb[normal])


def test_fp4_e4m3_not_idempotent_with_subnormal_scale():
    # amax/6 = 1.6 * 2^-9 -> s = 2^-8 (subnormal); 4.8 -> 4, amax' = 2^-6 -> s' = 2^-9 -> 4 * 2 -> 6
    x = np.zeros(16, F32)
    x[0] = F32(6 * 1.6 * 2.0**-9)
    q = nm.fp4_quant_e4m3_inplace(naive.to_bf16_rne(x))
    assert q[0] == 4 * 2.0**-8
    assert nm.fp4_quant_e4m3_inplace(q.copy())[0] == 6 * 2.0**-9


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



# ------------------------------------------------------------------------ AVX512-BF16 dot products

needs_bf16_dot = pytest.mark.skipif(not nm.bf16_dot_enabled(), reason="the AVX512-BF16 kernel is off (no "
                                    "such CPU, or DS41NUMBA_BF16_DOT=0): the f32 BLAS path runs")


@numba.njit
def _dot_all(a, b, out):
    """Each block of B against the same rows of A, through the micro-kernel."""
    for k in range(b.shape[0]):
        nm.bf16_dot_tile(a, b[k], out[k])


def _dot(a_rows, b_rows, a_stride=0, out_stride=0, start=0.0):
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
    _dot_all(a, b, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]]


@needs_bf16_dot
@pytest.mark.parametrize("d, a_stride, out_stride", [(2, 0, 0), (32, 3, 5), (128, 0, 0), (130, 8, 16)])
def test_bf16_dot_exact_on_fp4_values(d, a_stride, out_stride):
    """Products of fp4 values are exact and their sums exact in f32 unless the block scales are
    far apart: any summation order, BLAS's or the kernel's, gives the exact dot product."""
    rng = np.random.default_rng(40 + d)
    a = nm.fp4_quant_e8m0_inplace(rng.standard_normal((nm.DOT_ROWS, 160)).astype(F32))[:, :d].copy()
    b = nm.fp4_quant_e8m0_inplace(rng.standard_normal((75, 160)).astype(F32))[:, :d].copy()
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(_dot(a, b, a_stride, out_stride), exact.astype(F32))
    # The kernel continues the sum already in its output.
    assert_same_bits(_dot(a, b, a_stride, out_stride, start=0.75), (exact + 0.75).astype(F32))


@needs_bf16_dot
def test_bf16_dot_on_bf16_values_is_an_f32_dot_product():
    rng = np.random.default_rng(41)
    a = naive.to_bf16_rne(rng.standard_normal((nm.DOT_ROWS, 512)).astype(F32))
    b = naive.to_bf16_rne(rng.standard_normal((40, 512)).astype(F32))
    got = _dot(a, b)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    scale = np.abs(a).astype(np.float64) @ np.abs(b).T.astype(np.float64)
    # f32 accumulation (the classic bound is 512 * 2^-24 * scale; random rounding stays far
    # below it), not bf16's (an error near 2^-9 * scale)
    assert np.max(np.abs(got - exact) / scale) < 8 * 2.0 ** -24


@needs_bf16_dot
def test_bf16_dot_special_values():
    a = np.zeros((nm.DOT_ROWS, 4), F32)
    b = np.zeros((4, 4), F32)
    a[0, 0], b[0, 0] = np.nan, 1.0            # NaN propagates
    a[1, 1], b[1, 1] = np.inf, 2.0            # inf * finite
    a[2, 2], b[2, 2] = np.inf, 0.0            # inf * 0 is NaN
    a[3, 3], b[3, 3] = 2.0 ** -130, 2.0 ** 20  # a denormal input is read as zero (DAZ)
    got = np.diag(_dot(a, b))
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2]) and got[3] == 0.0



# ------------------------------------------------------------------------ AVX512-VNNI dot products

needs_int8_dot = pytest.mark.skipif(not nm.int8_dot_enabled(), reason="the AVX512-VNNI kernel is off (no "
                                    "such CPU, or DS41NUMBA_INT8_DOT=0)")


@numba.njit
def _int8_dot_all(qa, ca, sa, qb, sb, out):
    """Each block of B against the same rows of A, through the micro-kernel."""
    for k in range(qb.shape[0]):
        nm.int8_dot_tile(qa, ca, sa, qb[k], sb[k], out[k])


@numba.njit
def _int8_dot_into(qa, ca, sa, qb, sb, out):
    nm.int8_dot_into(qa, ca, sa, qb, sb, out)


def _strided(x, extra):
    """``x`` (2-D) as a view whose rows sit ``extra`` elements further apart than their length."""
    out = np.zeros((x.shape[0], x.shape[1] + extra), x.dtype)[:, :x.shape[1]]
    out[:] = x
    return out


def _int8_dot(a_rows, b_rows, a_stride=0, out_stride=0, start=0.0):
    """:func:`_dot` on the VNNI kernel (which also adds to its output); returns the products and
    the two ranges."""
    R, L = nm.DOT_ROWS, nm.DOT_LANES
    *qa, ra = nm.int8_rows(a_rows)
    qb, sb, rb = nm.pack_int8_blocks(b_rows)
    out = np.full((qb.shape[0], R, L + out_stride), np.nan, F32)[:, :, :L]
    out[:] = start
    _int8_dot_all(*(_strided(x, a_stride) for x in qa), qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


def _fp4_rows(rng, rows, d, spread=0):
    """fp4 (e8m0) rows, each 32-value group scaled by a random power of two up to ``2^spread``."""
    x = rng.standard_normal((rows, d)).astype(F32)
    x *= np.exp2(rng.integers(0, spread + 1, size=(rows, d // 32))).repeat(32, axis=1).astype(F32)
    return nm.fp4_quant_e8m0_inplace(x)


@needs_int8_dot
@pytest.mark.parametrize("d, a_stride, out_stride", [(32, 0, 0), (64, 3, 5), (128, 0, 0), (160, 8, 16)])
def test_int8_dot_exact_on_fp4_values(d, a_stride, out_stride):
    """The VNNI kernel's products of fp4 rows are the exact dot products, the bf16 kernel's bit
    for bit, whatever the group scales within the bound int8_dot_exact checks (spreads of 4 + 4
    here: every 32-value group scaled apart)."""
    rng = np.random.default_rng(50 + d)
    a, b = _fp4_rows(rng, nm.DOT_ROWS, d, 4), _fp4_rows(rng, 75, d, 4)
    got, ra, rb = _int8_dot(a, b, a_stride, out_stride)
    assert nm.int8_dot_exact(ra, rb, d) and (d == 32 or ra[3] + rb[3] >= 5)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    if nm.bf16_dot_enabled():
        assert_same_bits(got, _dot(a, b, a_stride, out_stride))
    # The kernel continues the sum already in its output.
    assert_same_bits(_int8_dot(a, b, a_stride, out_stride, start=0.75)[0], (exact + 0.75).astype(F32))


@needs_int8_dot
def test_int8_dot_at_its_largest_bytes():
    """Every value +-6 s (the integers +-12, the keys' bytes 0 and 24): the largest group sums
    (+-4608) and corrections, with no int32 overflow and exact f32 results."""
    d = 128
    a = np.full((nm.DOT_ROWS, d), 6.0, F32)
    a[1] = -6.0
    a[2, ::2] = -6.0
    a[3] *= F32(2.0 ** -100)
    b = np.full((40, d), 6.0, F32)
    b[1::2] = -6.0
    b[5, 64:] = F32(6.0 * 2.0 ** 3)
    got, ra, rb = _int8_dot(a, b)
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
    """:func:`_int8_dot` on folded rows: queries :func:`folded_rows` with their corrections,
    keys :func:`pack_offset_folded_blocks` (one group a row); returns the products and ranges."""
    R, L = nm.DOT_ROWS, nm.DOT_LANES
    qa, sa, ra = nm.folded_rows(a_rows)
    ca = nm.folded_corrections(qa)
    qb, sb, rb = nm.pack_offset_folded_blocks(b_rows)
    out = np.zeros((qb.shape[0], R, L), F32)
    _int8_dot_all(qa, ca, sa, qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


@needs_int8_dot
@pytest.mark.parametrize("d, spread", [(64, 0), (128, 2), (256, 1)])
def test_offset_folded_rows_on_the_vnni_kernel_are_exact(d, spread):
    """Folded rows (a row's block exponents at most FOLD_SPREAD apart, one scale a row) on the
    VNNI kernel as one group: the exact dot products, the per-block layout's bit for bit."""
    rng = np.random.default_rng(60 + d)
    a, b = _fp4_rows(rng, nm.DOT_ROWS, d, spread), _fp4_rows(rng, 70, d, spread)
    got, ra, rb = _offset_folded_dot(a, b)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    assert_same_bits(got, _int8_dot(a, b)[0])
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
    x = _fp4_rows(rng, 40, 128, 2)
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
    x = _fp4_rows(rng, 70, 96, 6)
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
    assert np.all(_dot(a, b) == F32(32 * 36 * 2.0 ** 14)) and np.all(exact.astype(F32) > F32(32 * 36 * 2.0 ** 14))


# ------------------------------------------------------------------------------ AMX dot products

needs_amx = pytest.mark.skipif(not nm.amx_enabled(), reason="the AMX kernel is off (no AMX-INT8, "
                               "no tile state from Linux, or DS41NUMBA_AMX=0)")


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
    """:func:`_int8_dot` on the AMX kernel (rows of A a multiple of AMX_ROWS)."""
    R, L = a_rows.shape[0], nm.DOT_LANES
    qa, sa, ra = nm.folded_rows(a_rows)
    qb, sb, rb = nm.pack_folded_blocks(b_rows)
    out = np.full((qb.shape[0], R, L + out_stride), np.nan, F32)[:, :, :L]
    out[:] = start
    _amx_dot_all(_strided(qa, a_stride), _strided(sa, a_stride), qb, sb, out)
    return out.transpose(1, 0, 2).reshape(R, -1)[:, :b_rows.shape[0]], ra, rb


@needs_amx
@pytest.mark.parametrize("d, a_stride, out_stride, spread", [(64, 0, 0, 0), (128, 3, 5, 2),
                                                             (256, 0, 0, 1), (192, 8, 16, 2)])
def test_amx_dot_exact_on_folded_fp4_values(d, a_stride, out_stride, spread):
    """The AMX kernel's products of folded fp4 rows are the exact dot products, the VNNI
    kernel's bit for bit, with each row's groups up to FOLD_SPREAD exponents apart."""
    rng = np.random.default_rng(60 + d)
    a, b = _fp4_rows(rng, 2 * nm.AMX_ROWS, d, spread), _fp4_rows(rng, 75, d, spread)
    b[3] = 0.0                                     # a key of zeros
    a[5, :32] = 0.0                                # a zero group: no exponent
    got, ra, rb = _amx_dot(a, b, a_stride, out_stride)
    assert nm.foldable(ra, rb) and nm.int8_dot_exact(ra, rb, d)
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(got, exact.astype(F32))
    for r in range(0, a.shape[0], nm.DOT_ROWS):
        assert_same_bits(got[r:r + nm.DOT_ROWS], _int8_dot(a[r:r + nm.DOT_ROWS], b)[0])
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
    a, b = _fp4_rows(rng, 8 * heads, d, 1), _fp4_rows(rng, n, d, 1)
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
    a, b = _fp4_rows(rng, heads, 128), _fp4_rows(rng, n, 128)
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
    x = _fp4_rows(rng, 70, 128, 2)
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


def test_backend_tiers_nest():
    """Each tier runs what the one below runs plus one instruction set; use_backend switches
    every caller's answer and refuses a name it does not know."""
    assert nm.backend() in nm.BACKENDS
    runnable = nm.BACKENDS[nm.BACKENDS.index(nm.backend()):]
    for tier in runnable:
        with nm.use_backend(tier):
            assert nm.backend() == tier
            assert nm.amx_enabled() == (tier == "amx")
            assert nm.int8_dot_enabled() == (tier in ("amx", "avx512vnni"))
            assert nm.bf16_dot_enabled() == (tier != "blas")
    with pytest.raises(ValueError, match="not one of"):
        with nm.use_backend("avx2"):
            pass


@pytest.mark.parametrize("env, highest", [("DS41NUMBA_AMX", "avx512vnni"), ("DS41NUMBA_INT8_DOT", "avx512bf16"),
                                          ("DS41NUMBA_BF16_DOT", "blas")])
def test_backend_environment_switches(env, highest):
    """``DS41NUMBA_AMX=0`` stops below the AMX tier, ``DS41NUMBA_INT8_DOT=0`` below the VNNI
    tier, ``DS41NUMBA_BF16_DOT=0`` at BLAS."""
    import os
    import subprocess
    import sys
    code = "from ds41numba.numerics import backend; print(backend())"
    got = subprocess.run([sys.executable, "-c", code], env={**os.environ, env: "0"},
                         capture_output=True, text=True, check=True).stdout.strip()
    tiers = nm.BACKENDS
    assert got == tiers[max(tiers.index(highest), tiers.index(nm.backend()))]


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
    from ds41numba.numerics import bf16_dot
    monkeypatch.setattr(bf16_dot, "_fma_choice", [request.param == "fma"])
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
    _dot_all(nm.bf16_pairs(x), b, out_dot)
    _fma_all(x, b, out_fma)
    assert_same_bits(out_fma, out_dot)
    assert nm.fma_safe((True, 71, 127), (True, 71, 127), d)
    assert not nm.fma_safe((True, 70, 127), (True, 71, 127), d)
    assert not nm.fma_safe((True, 127, 190), (True, 127, 180), 512)
    assert nm.fma_safe((True, 127, 190), (True, 127, 179), 512)
    assert nm.fma_safe((True, 255, 0), (True, 1, 254), d)          # a side of zeros
    for bad in (2.0 ** -130, np.inf, np.nan, 1.0 + 2.0 ** -10):
        y = x.copy()
        y[3, 7] = F32(bad)
        assert not nm.values_range(y)[0]


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


def test_bf16_pair_layouts():
    rng = np.random.default_rng(42)
    x = naive.to_bf16_rne(rng.standard_normal((37, 6)).astype(F32))
    hi = (x.view(np.uint32) >> 16).astype(np.uint32)
    pairs = hi[:, 0::2] | (hi[:, 1::2] << 16)
    assert np.array_equal(nm.bf16_pairs(x), pairs)
    packed = nm.pack_bf16_pairs(x)
    assert packed.shape == (2, 3, nm.DOT_LANES) and packed.dtype == np.uint32
    want = np.zeros((2 * nm.DOT_LANES, 3), np.uint32)
    want[:37] = pairs
    assert np.array_equal(packed, want.reshape(2, nm.DOT_LANES, 3).transpose(0, 2, 1))
    # Rows written into a packed array at an offset; the other rows are left alone.
    into = np.full((3, 3, nm.DOT_LANES), 7, np.uint32)
    nm.pack_bf16_pairs(x[:5], into, first=30)
    flat = into.transpose(0, 2, 1).reshape(-1, 3)
    assert np.array_equal(flat[30:35], pairs[:5])
    assert np.all(flat[:30] == 7) and np.all(flat[35:] == 7)


def test_bf16_pair_validation():
    x = np.ones((4, 6), F32)
    with pytest.raises(ValueError, match="bf16 values"):
        nm.bf16_pairs(x + F32(2.0 ** -10))
    with pytest.raises(ValueError, match="bf16 values"):
        nm.pack_bf16_pairs(x + F32(2.0 ** -10))
    with pytest.raises(ValueError, match="d even"):
        nm.pack_bf16_pairs(np.ones((4, 5), F32))
    with pytest.raises(ValueError, match="room for rows"):
        nm.pack_bf16_pairs(x, np.zeros((1, 3, nm.DOT_LANES), np.uint32), first=30)
    with pytest.raises(ValueError, match="C-contiguous uint32"):
        nm.pack_bf16_pairs(x, np.zeros((1, 3, nm.DOT_LANES), np.int32))
    with pytest.raises(ValueError, match="first needs an out"):
        nm.pack_bf16_pairs(x, first=1)
    with pytest.raises(ValueError, match="uint32 array of shape"):
        nm.bf16_pairs(x, out=np.zeros((4, 3), F32))


# --------------------------------------------------------------------------------------- rms_norm


def test_torch_sum_matches_naive_transcription():
    rng = np.random.default_rng(12)
    sizes = list(range(1, 70)) + [127, 128, 129, 512, 1000, 1023, 1024, 1025, 1280, 5120, 8192,
                                  16384 + 77, 70_000]
    for n in sizes:
        x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2)).astype(F32)
        want = naive.torch_sum_f32(x * x)
        assert nm.torch_sum_f32(x, True) == want, n
        assert nm.torch_sum_f32(x * x, False) == want, n


def test_torch_sum_is_not_left_to_right():
    x = np.array([1.0] + [2.0**-24] * 31, F32)  # in order every tiny term is lost
    assert np.add.accumulate(x)[-1] == 1.0
    # Four 8-lane vectors summed lane-wise: lane 0 stays 1 (each 1 + 2^-24 ties to 1), lanes 1..7
    # hold 4 * 2^-24 = 2^-22 each, then added to 1 in turn.
    assert nm.torch_sum_f32(x, False) == F32(1 + 7 * 2.0**-22)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 64, 96, 128, 512, 1280])
def test_rms_norm_matches_naive(n):
    rng = np.random.default_rng(n)
    w = naive.to_bf16_rne(rng.standard_normal(n).astype(F32))
    for lead in [(3,), (2, 4), (1200,)]:
        x = naive.to_bf16_rne((rng.standard_normal(lead + (n,)) * 10.0 ** rng.uniform(-8, 8, lead + (1,)))
                             .astype(F32))
        x[(0,) * len(lead)] = 0.0
        got = nm.rms_norm(x, w, 1e-20)
        assert got.shape == x.shape
        assert_same_bits(got, naive.rms_norm(x, w, 1e-20))
    assert nm.is_bf16_valued(got)


def test_rms_norm_validation():
    with pytest.raises(ValueError, match="does not match"):
        nm.rms_norm(np.zeros((2, 8), F32), np.ones(4, F32), 1e-6)
    with pytest.raises(ValueError, match="1-D"):
        nm.rms_norm(np.zeros((2, 8), F32), np.ones((1, 8), F32), 1e-6)
    with pytest.raises(TypeError, match="float32"):
        nm.rms_norm(np.zeros((2, 8)), np.ones(8, F32), 1e-6)


# --------------------------------------------------------------------------------------- goldens


@pytest.mark.parametrize("name", REFERENCE_GOLDENS)
def test_goldens_are_quantiser_fixed_points(reference_golden, name):
    """The reference's quantised tensors must be fixed points of our quantisers: the window ring
    (fp8), the shared index keys (fp4 e8m0) and compressed KV (fp4 e4m3), and in the KV rows sparse
    attention received, the window rows (fp8) followed by the compressed rows (fp4 e4m3)."""
    d = reference_golden(name)
    cfg = {"prefill": d.run.prefill, "window_size": d.config.window_size}
    checked = 0
    for key in d.tensors:
        if not key.startswith("step"):
            continue
        step = int(key.split(".")[0][4:])
        what = key.split(".", 3)[-1]
        a = d[key]
        if what == "state.window_kv":
            parts = [(nm.act_quant_fp8_inplace, a)]
        elif what == "shared.index_k":
            parts = [(nm.fp4_quant_e8m0_inplace, a)]
        elif what == "shared.compress_kv":
            parts = [(nm.fp4_quant_e4m3_inplace, a)]
        elif what == "kv":
            offset = cfg["prefill"] if step == 0 else cfg["window_size"]
            parts = [(nm.act_quant_fp8_inplace, a[:offset]), (nm.fp4_quant_e4m3_inplace, a[offset:])]
        else:
            continue
        for fn, rows in parts:
            rows = np.ascontiguousarray(rows)
            assert_same_bits(fn(rows.copy()), rows)
            checked += rows.size
    assert checked > 0
