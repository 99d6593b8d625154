"""RMSNorm and torch's CPU sum order (ds41numba.numerics.norm)."""

import numpy as np
import pytest

import naive
from numerics_helpers import assert_same_bits, F32
from ds41numba import numerics as nm


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
