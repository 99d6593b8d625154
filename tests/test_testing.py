"""ds41numba.testing: the assertions apply compare's rules and raise its report line."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ds41numba import golden, testing
from ds41numba.config import preset


@pytest.fixture(scope="module")
def tiny_golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("testing") / "tiny.safetensors"
    golden.write_golden(golden.GoldenPlan(preset("tiny"), tuple(range(6)), 12, 3, capture="io"),
                        path)
    return path


def test_from_bf16_bits_reads_torch_int16_views():
    want = np.array([1.5, -2.0, np.inf, 3.140625], np.float32)
    bits = want.astype(ml_dtypes.bfloat16).view(np.int16)      # what t.view(torch.int16) holds
    assert np.array_equal(testing.from_bf16_bits(bits), want)
    with pytest.raises(TypeError, match="int16"):
        testing.from_bf16_bits(want)


def test_assert_close_passes_within_tolerance_and_names_the_failure():
    want = np.array([[4.0, 1.0], [2.0, -1.0]], np.float32)
    res = testing.assert_close(want + np.float32(0.01), want, "o")
    assert res.ok and res.max_abs_diff == pytest.approx(0.01, rel=1e-4)
    with pytest.raises(AssertionError, match=r"^o \[2, 2\]: max \|diff\| 0.5 > tolerance"):
        testing.assert_close(want + np.float32([[0, 0], [0, 0.5]]), want, "o")
    # Rows after a differing index row are held to the tensor's range only.
    testing.assert_close(want + np.float32([[0, 0], [0, 0.5]]), want, "o", after_swaps=[1])


def test_assert_index_rows_accepts_swaps_and_rejects_bugs():
    want = np.array([[10, 11, 12]], np.int32)
    scores = {"topk_idxs": want, "topk_scores": np.array([[3.0, 2.0, 1.0]], np.float32),
              "runner_idxs": np.array([[13, 14]], np.int32),
              "runner_scores": np.array([[1.0, 0.2]], np.float32)}
    res = testing.assert_index_rows(np.array([[10, 13, 11]]), want, scores, offset=10, visible=5)
    assert res.rows_swapped == 1 and res.max_score_gap == 0.0          # an exact tie, any order
    for got, why in [([[10, 11, 14]], "below the boundary"), ([[10, 10, 11]], "duplicate index 10"),
                     ([[10, 11, -1]], "-1 where the golden has a position"),
                     ([[10, 11, 15]], "past the query's 5 visible positions")]:
        with pytest.raises(AssertionError, match=why):
            testing.assert_index_rows(np.array(got), want, scores, offset=10, visible=5)
    with pytest.raises(AssertionError, match="rows differ"):
        testing.assert_index_rows(np.array([[10, 13, 11]]), want, scores, exact=True)


def test_assert_golden_tensor_by_name(tiny_golden):
    from safetensors.numpy import load_file
    t = load_file(tiny_golden)
    name = "step0.layers.4.shared.topk_idxs"
    res = testing.assert_golden_tensor(tiny_golden, name, t[name])
    assert res.tie_aware and res.rows_swapped == 0
    # Swap a selected position for the best runner-up of a row whose two scores tie.
    scores = testing.golden_scores(tiny_golden, 0, 4)
    sel, sc = scores.topk_idxs, scores.topk_scores
    ru, rs = scores.runner_idxs, scores.runner_scores
    rows = [s for s in range(sel.shape[0]) if (sel[s] >= 0).all() and ru[s, 0] >= 0
            and rs[s, 0] == sc[s][sel[s] >= 0].min()]
    if rows:
        s = rows[0]
        got = t[name].copy()
        got[s, int(np.argmin(np.where(sel[s] >= 0, sc[s], np.inf)))] = ru[s, 0]
        assert testing.assert_golden_tensor(tiny_golden, name, got).rows_swapped == 1
    got = t[name].copy()
    got[-1, 0] = got[-1, 1]
    with pytest.raises(AssertionError, match="duplicate index"):
        testing.assert_golden_tensor(tiny_golden, name, got)
    out = "step1.layers.3.out"
    testing.assert_golden_tensor(tiny_golden, out, t[out].astype(np.float32))
    with pytest.raises(AssertionError, match="> tolerance"):
        testing.assert_golden_tensor(tiny_golden, out, t[out].astype(np.float32) + 1)
    with pytest.raises(KeyError, match="no tensor"):
        testing.assert_golden_tensor(tiny_golden, "step9.layers.0.out", t[out])


def test_assert_candidate_file(tiny_golden, tmp_path):
    from safetensors.numpy import load_file, save_file
    t = load_file(tiny_golden)
    only = {n: t[n] for n in t if n.endswith((".out", ".idx"))}
    save_file(only, tmp_path / "mine.safetensors")
    report = testing.assert_candidate_file(tiny_golden, tmp_path / "mine.safetensors")
    assert report.ok
    only["step2.layers.5.out"] = (only["step2.layers.5.out"].astype(np.float32) * 2).astype(
        ml_dtypes.bfloat16)
    save_file(only, tmp_path / "bad.safetensors")
    with pytest.raises(AssertionError, match=r"(?s)step2.layers.5.out \[1, 64\].*\nFAIL \(1 tensors disagree\)"):
        testing.assert_candidate_file(tiny_golden, tmp_path / "bad.safetensors")
