"""Bit-level tests of the roundings (ds41numba.numerics.formats) against ml_dtypes: ten million
random f32 per conversion (random bit patterns and normals over many scales), exhaustive code
tables and every tie."""

import ml_dtypes
import numpy as np
import pytest

import naive
from numerics_helpers import assert_same_bits, F32, U32
from ds41numba import numerics as nm


N_RANDOM = 10_000_000


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


def test_bf16_scalar_no_payload_is_bf16_scalar_but_for_nans_with_payloads(random_bits):
    """Without the NaN branch: every value but a NaN as bf16_scalar rounds it, and the NaNs
    bf16_scalar makes (quiet, no payload, either sign) kept; a NaN with a payload is not
    (0x7FFFFFFF carries out of the pattern)."""
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000,
                         0x00000001, 0x3F808000, 0x3F818000, 0x7FC00000, 0xFFC00000],
                        np.uint32).view(F32)
    some = random_bits[:200_000]
    vals = np.concatenate([specials, some[~np.isnan(some)]])
    got = np.array([nm.bf16_scalar_no_payload(v) for v in vals], F32)
    assert_same_bits(got, np.array([nm.bf16_scalar(v) for v in vals], F32))
    assert not np.isnan(nm.bf16_scalar_no_payload(np.uint32(0x7FFFFFFF).view(F32)))


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


@pytest.mark.parametrize("copies", [1, 64])      # 65,536 values, then 4.2 million: parallel
def test_bf16_halves_is_ml_dtypes_cast_of_every_bf16_value(copies):
    """Every bf16 pattern but the NaNs, as an f32, gives ml_dtypes' cast's bits (zeros,
    subnormals, infinities included); one NaN anywhere, or one value with a low bit set, and
    the answer is None (the caller's cast then decides)."""
    every = (np.arange(1 << 16, dtype=U32) << U32(16)).view(F32)
    values = np.tile(every[~np.isnan(every)], copies)
    got = nm.bf16_halves(values.reshape(copies, -1))
    assert got.dtype == np.uint16 and got.shape == (copies, values.size // copies)
    np.testing.assert_array_equal(got.reshape(-1), values.astype(ml_dtypes.bfloat16).view(np.uint16))
    for at in (0, values.size // 2, values.size - 1):
        for bad in (np.uint32(0x7FC00000), np.uint32(0xFF800001), values[at:at + 1].view(U32)[0] | 1):
            spoilt = values.copy()
            spoilt.view(U32)[at] = bad
            assert nm.bf16_halves(spoilt) is None
    assert nm.bf16_halves(np.zeros(0, F32)).shape == (0,)
    with pytest.raises(TypeError, match="float32"):
        nm.bf16_halves(np.zeros(3))


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
