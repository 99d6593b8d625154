"""Bit-level tests of ds41numba.f32_products: the reference's own f32 linears (tests/data), the
order-by-order twin in naive.py on shapes that reach every kernel and edge (M around the
two-thread split, K off the lane and block sizes, N off the panel width, strided rows that change
the peel, the NN layout), thread-count independence and the boundary's errors.
"""

import numba
import numpy as np
import pytest

import naive
from helpers import linear_case, linear_case_names
from ds41numba.numerics import workers
from ds41numba.numerics.f32_products import (KC, TILE_LANES, F32Matrix, blocked_rows, linear_f32_ordered,
                                    matmul_nn_f32_ordered, pack_columns)

F32 = np.float32


def assert_same_bits(got, want):
    got = np.ascontiguousarray(got, F32)
    want = np.ascontiguousarray(want, F32)
    assert got.shape == want.shape
    diff = got.view(np.uint32) != want.view(np.uint32)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} outputs differ, first at " \
                           f"{np.argwhere(diff)[0].tolist()}"


def order_sensitive(rng, shape):
    """Full-mantissa values over 2^-8 .. 2^8 of both signs: almost every change of summation
    order or of rounding (FMA or not) moves the last bits."""
    return (rng.standard_normal(shape) * np.exp2(rng.uniform(-8, 8, shape))).astype(F32)


@pytest.mark.parametrize("case", linear_case_names("f32"))
def test_reference_f32_linears_bit_exact(linear_cases, case):
    x, w, want = linear_case(linear_cases, case)
    assert_same_bits(linear_f32_ordered(x, w), want)
    assert_same_bits(linear_f32_ordered(x, F32Matrix(w)), want)


@pytest.mark.parametrize("case", ["f32.M1.K640.N64", "f32.M7.K640.N64", "f32.M300.K640.N64"])
def test_naive_twin_matches_the_reference(linear_cases, case):
    x, w, want = linear_case(linear_cases, case)
    assert_same_bits(naive.linear_f32_ordered(x, w), want)


SHAPES = [(m, k, n) for m, (k, n) in zip(
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 64],
    [(387, 45), (197, 150), (578, 33), (193, 70), (385, 131), (5, 17), (643, 150), (1, 3),
     (2, 200), (201, 64), (390, 97), (577, 129), (250, 75)])]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_linear_matches_naive(m, k, n):
    rng = np.random.default_rng(1000 * m + k)
    x, w = order_sensitive(rng, (m, k)), order_sensitive(rng, (n, k))
    want = naive.linear_f32_ordered(x, w)
    assert_same_bits(linear_f32_ordered(x, w), want)


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_nn_matmul_matches_naive(m, k, n):
    rng = np.random.default_rng(1000 * m + k + 1)
    x, v = order_sensitive(rng, (m, k)), order_sensitive(rng, (k, n))
    want = naive.linear_f32_ordered(x, v, nn=True)
    assert_same_bits(matmul_nn_f32_ordered(x, v), want)
    assert_same_bits(matmul_nn_f32_ordered(x, v[:, ::-1].copy()[:, ::-1]), want)  # strided v


@pytest.mark.parametrize("m", [1, 2, 3, 7, 13])
@pytest.mark.parametrize("pad", [1, 2, 3])
def test_leading_dimension_sets_the_peel(m, pad):
    """Rows a leading dimension apart that is not a multiple of 4 start the small kernel's lanes
    after a peel of (-m * ld) mod 4 products; the gemv's peel follows w's leading dimension."""
    rng = np.random.default_rng(7 * m + pad)
    k, n = 203, 40
    xs = order_sensitive(rng, (m, k + pad))[:, :k]
    ws = order_sensitive(rng, (n, k + pad))[:, :k]
    want = naive.linear_f32_ordered(xs, ws)
    assert_same_bits(linear_f32_ordered(xs, ws), want)
    # a contiguous copy is another reference tensor, with another peel
    xc, wc = np.ascontiguousarray(xs), np.ascontiguousarray(ws)
    assert_same_bits(linear_f32_ordered(xc, wc), naive.linear_f32_ordered(xc, wc))


def test_fma_only_in_the_blocked_kernel():
    """x . w = 1 * -1 + (1 + 2^-12)^2: with one rounding (FMA) 2^-11 + 2^-24, with the product
    rounded first (a tie, to even) 2^-11."""
    a = F32(1 + 2.0 ** -12)
    w = np.array([[1.0, a]], F32)
    for m, want in [(4, 2.0 ** -11 + 2.0 ** -24), (2, 2.0 ** -11), (1, 2.0 ** -11)]:
        x = np.tile(np.array([[-1.0, a]], F32), (m, 1))
        assert linear_f32_ordered(x, w)[:, 0].tolist() == [want] * m, m
        assert matmul_nn_f32_ordered(x, w.T.copy())[:, 0].tolist() == [want] * m, m


def test_block_sums_are_added_in_order():
    """With kc = 192 the blocked kernel sums k < 192 and k >= 192 apart: 2^24 + 1 + 1 is
    2^24 + 2 when the ones lie in the next block, 2^24 when they join the chain (ties to even)."""
    k = KC + 8
    x = np.ones((4, k), F32)
    w = np.zeros((1, k), F32)
    w[0, 0], w[0, KC], w[0, KC + 1] = 2.0 ** 24, 1.0, 1.0
    assert linear_f32_ordered(x, w)[:, 0].tolist() == [2.0 ** 24 + 2] * 4
    w[0, KC], w[0, KC + 1], w[0, KC - 2], w[0, KC - 1] = 0.0, 0.0, 1.0, 1.0
    assert linear_f32_ordered(x, w)[:, 0].tolist() == [2.0 ** 24] * 4


def test_two_thread_row_rule():
    assert [blocked_rows(m) for m in range(1, 14)] == [0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 13]
    assert blocked_rows(300) == 300


def test_batch_dims_out_and_packed_weight():
    rng = np.random.default_rng(3)
    x, w = order_sensitive(rng, (2, 5, 300)), order_sensitive(rng, (70, 300))
    want = naive.linear_f32_ordered(x.reshape(10, 300), w).reshape(2, 5, 70)
    wm = F32Matrix(w)
    out = np.full(10 * 70, np.nan, F32)
    got = linear_f32_ordered(x, wm, out=out)
    assert got.shape == (2, 5, 70) and np.shares_memory(got, out)
    assert_same_bits(got, want)
    assert_same_bits(linear_f32_ordered(x, wm), want)          # the kept packing again
    assert wm.packed.shape == (-(-70 // TILE_LANES), 300, TILE_LANES)
    assert_same_bits(pack_columns(w), wm.packed)
    assert linear_f32_ordered(np.zeros((0, 300), F32), w).shape == (0, 70)
    assert not linear_f32_ordered(np.ones((5, 0), F32), np.ones((3, 0), F32)).any()
    assert not matmul_nn_f32_ordered(np.ones((5, 0), F32), np.ones((0, 3), F32)).any()


@pytest.mark.parametrize("m", [1, 3, 7, 200])
def test_results_do_not_depend_on_the_thread_count(m, monkeypatch):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs two numba threads")
    rng = np.random.default_rng(m)
    x, w = order_sensitive(rng, (m, 900)), order_sensitive(rng, (150, 900))
    v = order_sensitive(rng, (900, 150))
    before = numba.get_num_threads()
    got = []
    try:
        for threads, parallel_min in [(1, 0), (2, 0), (2, 1 << 62)]:   # parallel, then serial
            monkeypatch.setattr(workers, "PARALLEL_MIN_MACS", parallel_min)
            numba.set_num_threads(threads)
            got.append((linear_f32_ordered(x, w), matmul_nn_f32_ordered(x, v)))
    finally:
        numba.set_num_threads(before)
    for other in got[1:]:
        assert_same_bits(got[0][0], other[0])
        assert_same_bits(got[0][1], other[1])


def test_validation_errors():
    x, w = np.ones((3, 8), F32), np.ones((4, 8), F32)
    with pytest.raises(TypeError, match="float32"):
        linear_f32_ordered(x.astype(np.float64), w)
    with pytest.raises(TypeError, match="float32"):
        linear_f32_ordered(x, w.astype(np.float16))
    with pytest.raises(TypeError, match="numpy"):
        linear_f32_ordered(x.tolist(), w)
    with pytest.raises(TypeError, match="float32"):
        F32Matrix(w.astype(np.float64))
    with pytest.raises(ValueError, match="2-D"):
        F32Matrix(np.ones(8, F32))
    with pytest.raises(ValueError, match="2-D"):
        linear_f32_ordered(x, np.ones((2, 4, 8), F32))
    with pytest.raises(ValueError, match="does not match"):
        linear_f32_ordered(np.ones((3, 7), F32), w)
    with pytest.raises(ValueError, match="does not match"):
        linear_f32_ordered(np.ones((), F32), w)
    with pytest.raises(ValueError, match="out"):
        linear_f32_ordered(x, w, out=np.empty((3, 5), F32))
    with pytest.raises(ValueError, match="out"):
        linear_f32_ordered(x, w, out=np.empty((3, 4), np.float64))
    with pytest.raises(ValueError, match="out"):
        linear_f32_ordered(x, w, out=np.empty((4, 3), F32).T)
    with pytest.raises(ValueError, match="2-D"):
        matmul_nn_f32_ordered(x, np.ones(8, F32))
    with pytest.raises(ValueError, match="does not match"):
        matmul_nn_f32_ordered(x, np.ones((4, 8), F32))
    with pytest.raises(TypeError, match="float32"):
        matmul_nn_f32_ordered(x, np.ones((8, 4), np.int32))
    with pytest.raises(ValueError, match="2-D"):
        pack_columns(np.ones(8, F32))
