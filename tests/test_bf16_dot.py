"""The AVX512-BF16 micro-kernel, its pair layouts and its FMA twin's guards (ds41numba.numerics.bf16_dot,
bf16_layouts, fma_choice)."""

import numpy as np
import pytest

import naive
from numerics_helpers import assert_same_bits, bf16_dot_rows, F32, needs_bf16_dot
from ds41numba import numerics as nm


# ------------------------------------------------------------------------ AVX512-BF16 dot products


@needs_bf16_dot
@pytest.mark.parametrize("d, a_stride, out_stride", [(2, 0, 0), (32, 3, 5), (128, 0, 0), (130, 8, 16)])
def test_bf16_dot_exact_on_fp4_values(d, a_stride, out_stride):
    """Products of fp4 values are exact and their sums exact in f32 unless the block scales are
    far apart: any summation order, BLAS's or the kernel's, gives the exact dot product."""
    rng = np.random.default_rng(40 + d)
    a = nm.fp4_quant_e8m0_inplace(rng.standard_normal((nm.DOT_ROWS, 160)).astype(F32))[:, :d].copy()
    b = nm.fp4_quant_e8m0_inplace(rng.standard_normal((75, 160)).astype(F32))[:, :d].copy()
    exact = a.astype(np.float64) @ b.T.astype(np.float64)
    assert_same_bits(bf16_dot_rows(a, b, a_stride, out_stride), exact.astype(F32))
    # The kernel continues the sum already in its output.
    assert_same_bits(bf16_dot_rows(a, b, a_stride, out_stride, start=0.75), (exact + 0.75).astype(F32))


@needs_bf16_dot
def test_bf16_dot_on_bf16_values_is_an_f32_dot_product():
    rng = np.random.default_rng(41)
    a = naive.to_bf16_rne(rng.standard_normal((nm.DOT_ROWS, 512)).astype(F32))
    b = naive.to_bf16_rne(rng.standard_normal((40, 512)).astype(F32))
    got = bf16_dot_rows(a, b)
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
    got = np.diag(bf16_dot_rows(a, b))
    assert np.isnan(got[0]) and got[1] == np.inf and np.isnan(got[2]) and got[3] == 0.0


def test_bf16_pair_layouts():
    rng = np.random.default_rng(42)
    x = naive.to_bf16_rne(rng.standard_normal((37, 6)).astype(F32))
    hi = (x.view(np.uint32) >> 16).astype(np.uint32)
    pairs = hi[:, 0::2] | (hi[:, 1::2] << 16)
    assert np.array_equal(nm.bf16_pairs(x), pairs)
    # In order: value 2p in the high half, which vdpbf16ps adds first.
    assert np.array_equal(nm.bf16_pairs(x, in_order=True), hi[:, 1::2] | (hi[:, 0::2] << 16))
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
