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
    with pytest.raises(AssertionError, match=r"(?s)step2.layers.5.out \[1, 64\].*\nFAIL \(1 tensor disagrees\)"):
        testing.assert_candidate_file(tiny_golden, tmp_path / "bad.safetensors")


# --------------------------------------------------------------------------- the README's examples
# "Testing your kernel": the four pytest examples, on a tiny golden (layer 4: ratio 1, index
# source), with ds41numba's slow reference kernels (tests/naive.py) standing in for yours.


@pytest.fixture(scope="module")
def sampled_golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("readme") / "golden.safetensors"
    plan = golden.GoldenPlan(preset("tiny"), tuple(range(6)), 12, 3, capture="io",
                             capture_rows=(3, 8, 11))
    golden.write_golden(plan, path)
    return path


P = "step0.layers.4."


def my_index_scores(iq, w, keys, visible):
    import naive
    return naive.tile_scores(iq, w, keys, visible)


def my_topk(scores, k, visible):
    from ds41numba import torch_cpu_topk_set
    out = np.array([sorted(torch_cpu_topk_set(row, k)) for row in scores])
    return np.where(out < np.asarray(visible)[:, None], out, -1)


def my_sparse_attn(q, kv, valid, sink, scale):
    import naive
    local = np.where(valid, np.arange(valid.shape[1]), -1)
    return np.concatenate([naive.sparse_attn(q[i:i + 1], kv[i], local[i:i + 1], sink, scale)
                           for i in range(q.shape[0])])


def test_readme_indexer_scores(sampled_golden):
    with golden.GoldenFile(sampled_golden) as g:
        rows = g.get(P + "sample.rows")
        iq = g.get(P + "sample.index_q").astype(np.float32)
        w = g.get(P + "sample.index_weights").astype(np.float32)
        keys = g.get(P + "sample.index_k").astype(np.float32)
        scores = my_index_scores(iq, w, keys, visible=rows + 1)
        testing.assert_golden_tensor(g, P + "sample.index_score", scores)


def test_readme_topk(sampled_golden):
    with golden.GoldenFile(sampled_golden) as g:
        rows = g.get(P + "sample.rows")
        scores = g.get(P + "sample.index_score").astype(np.float32)
        got = my_topk(scores, k=6, visible=rows + 1)
        got = np.where(got >= 0, got + 12, -1)
        res = testing.assert_index_rows(got, g.get(P + "shared.topk_idxs")[rows],
                                        testing.golden_scores(g, 0, 4).take(rows),
                                        offset=12, visible=rows + 1)
        assert res.rows == 3 and res.rows_wrong == 0
        got[0, 0] = got[0, 1]
        with pytest.raises(AssertionError, match="duplicate"):
            testing.assert_index_rows(got, g.get(P + "shared.topk_idxs")[rows],
                                      testing.golden_scores(g, 0, 4).take(rows),
                                      offset=12, visible=rows + 1)


def test_readme_sparse_attention(sampled_golden):
    cfg = preset("tiny")
    with golden.GoldenFile(sampled_golden) as g:
        rows = g.get(P + "sample.rows")
        q = g.get(P + "sample.q").astype(np.float32)
        kv = g.get(P + "sample.kv").astype(np.float32)
        valid = g.get(P + "idx")[rows] >= 0
        sink = g.get("layers.4.attn.attn_sink")
        o = my_sparse_attn(q, kv, valid, sink, cfg.head_dim ** -0.5)
        testing.assert_golden_tensor(g, P + "sample.o", o)
        with pytest.raises(AssertionError, match="> tolerance"):
            testing.assert_golden_tensor(g, P + "sample.o", my_sparse_attn(q, kv, valid, sink - 5,
                                                                           cfg.head_dim ** -0.5))


def test_readme_whole_layer(sampled_golden, tmp_path):
    from safetensors.numpy import save_file
    plan = golden.GoldenPlan(preset("tiny"), tuple(range(6)), 12, 3, capture="io")
    mine = {n: a for n, a in golden.run_golden(plan).items() if n.endswith((".out", ".idx"))}
    save_file(mine, tmp_path / "mine.safetensors")
    testing.assert_candidate_file(sampled_golden, tmp_path / "mine.safetensors")
