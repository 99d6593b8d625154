"""The quantisers (ds41numba.numerics.quant) against naive.py's ml_dtypes versions, and on the
reference's own outputs (tests/data), which must be their fixed points."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import naive
from helpers import REFERENCE_GOLDENS
from numerics_helpers import assert_same_bits, F32
from ds41numba import numerics as nm


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


def _quantised_idempotent(quantise, x, scale):
    """``x * scale`` on bf16 and its quantised copy, after the checks both of these quantisers
    pass: bf16 values, every sign kept, quantising again changes nothing."""
    x = naive.to_bf16_rne(x * F32(scale))
    q = quantise(x.copy())
    assert nm.is_bf16_valued(q)
    assert np.array_equal(np.signbit(q), np.signbit(x))
    assert_same_bits(quantise(q.copy()), q)  # idempotent
    return x, q


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
def test_fp8_properties(x, scale):
    x, q = _quantised_idempotent(nm.act_quant_fp8_inplace, x, scale)
    b = x.reshape(-1, 32)
    s = naive.pow2ceil(np.maximum(np.abs(b).max(axis=1), F32(1e-4)) / F32(448))[:, None]
    err = np.abs(q.reshape(-1, 32).astype(np.float64) - b)
    assert np.all(err <= np.maximum(2.0**-4 * np.abs(b), 2.0**-10 * s) * (1 + 2.0**-20))


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
def test_fp4_e8m0_properties(x, scale):
    x, q = _quantised_idempotent(nm.fp4_quant_e8m0_inplace, x, scale)
    b = x.reshape(-1, 32)
    s = naive.pow2ceil(np.maximum(np.abs(b).max(axis=1), F32(6 * 2.0**-126)) / F32(6))[:, None]
    err = np.abs(q.reshape(-1, 32).astype(np.float64) - b)
    assert np.all(err <= np.maximum(0.25 * s, np.abs(b) / 4) * (1 + 2.0**-20))


@settings(max_examples=150, deadline=None)
@given(bf16_blocks, scales)
@example(np.full((1, 32), 1576, F32), 1e-5)     # amax / 6 = 1.34 * 2^-9: s = 2^-9, saturated
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
    bf, qf, sf = b[finite], qb[finite], np.broadcast_to(s[finite], b[finite].shape)
    # The e4m3 scale is amax / 6 rounded to nearest, so it may lie below it (by up to a third
    # among e4m3's subnormals, under 2^-6): values from 6 s up then saturate, to +-6 s exactly.
    saturated = np.abs(bf) >= 6 * sf
    assert np.array_equal(qf[saturated], np.copysign(6 * sf, bf)[saturated])
    err = np.abs(qf.astype(np.float64) - bf)
    bound = np.maximum(0.25 * sf, np.abs(bf) / 4) * (1 + 2.0**-20)
    assert np.all(err[~saturated] <= bound[~saturated])
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
