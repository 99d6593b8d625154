"""ds41numba.golden: the generator, a plan's layer sources, storage, atomic writing, reading,
comparison, and files byte-identical whatever the thread count."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numba
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from ds41numba import golden
from ds41numba.config import preset
from ds41numba.golden import GoldenError, GoldenPlan, compare_tensor, generator
from ds41numba.numerics import DOT_LANES
from ds41numba.stack import weight_specs

DATA = Path(__file__).parent / "data"


# --------------------------------------------------------------------------- the generator


def _spec_value(seed: int, name: str, n: int, center: float, scale: float, bf16: bool) -> float:
    """The generator as the module docstring writes it, in plain Python integers and floats."""
    mask = (1 << 64) - 1

    def mix64(z):
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    key = mix64(seed) ^ h
    bits = mix64(key + (n + 1) * 0x9E3779B97F4A7C15)
    m = bits >> 40
    t = (2 * m + 1 - 2 ** 24) / 2 ** 24
    v = np.float32(center + scale * t)
    return float(v.astype(ml_dtypes.bfloat16)) if bf16 else float(v)


@pytest.mark.parametrize("seed", [0, 7, 2 ** 64 - 1])
@pytest.mark.parametrize("bf16, bfloat16", [(True, False), (False, False), (True, True)])
def test_generator_matches_its_documented_algorithm(seed, bf16, bfloat16):
    name, center, scale = "layers.3.attn.wq_a.weight", 0.0, math.sqrt(3 / 64)
    got = golden.make_tensor(name, (5, 7), seed, center, scale, bf16=bf16,
                             bfloat16=bfloat16).reshape(-1)
    want = [_spec_value(seed, name, n, center, scale, bf16) for n in range(35)]
    assert got.dtype.name == ("bfloat16" if bfloat16 else "float32")
    assert got.astype(np.float32).tolist() == want


def test_generator_is_independent_of_chunking_and_threads():
    name, shape = "step3.layers.1.x", (1100, 64)      # large enough for the parallel kernel
    assert shape[0] * shape[1] >= generator._PARALLEL_FROM
    whole = golden.make_input(name, shape, seed=11)
    flat = whole.reshape(-1)
    cuts = [0, 1, 4096, 14096, 50000, flat.size]        # small pieces take the serial kernel
    pieces = [golden.make_tensor(name, (hi - lo,), 11, 0.0, math.sqrt(3.0), start=lo)
              for lo, hi in zip(cuts, cuts[1:])]
    assert np.array_equal(np.concatenate(pieces).view(np.uint32), flat.view(np.uint32))
    halves = golden.make_tensor(name, shape, 11, 0.0, math.sqrt(3.0), bfloat16=True)
    assert np.array_equal(halves.view(np.uint16), (flat.view(np.uint32) >> 16).reshape(shape))
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        single = golden.make_input(name, shape, seed=11)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(single.view(np.uint32), whole.view(np.uint32))


def test_generator_streams_differ_by_seed_and_name():
    a = golden.make_input("step0.layers.0.x", (64, 64), seed=1)
    assert not np.array_equal(a, golden.make_input("step0.layers.0.x", (64, 64), seed=2))
    assert not np.array_equal(a, golden.make_input("step0.layers.1.x", (64, 64), seed=1))
    assert np.array_equal(a, golden.make_input("step0.layers.0.x", (64, 64), seed=1))


def test_inputs_are_bf16_with_unit_variance():
    x = golden.make_input("step0.layers.0.x", (512, 256), seed=3)
    assert x.dtype == np.float32
    assert np.array_equal(x.astype(ml_dtypes.bfloat16).astype(np.float32), x)
    assert abs(float(x.std()) - 1.0) < 0.02 and abs(float(x.mean())) < 0.02
    assert float(np.abs(x).max()) <= math.sqrt(3.0) + 0.01


def test_make_weights_follows_weight_specs_and_kinds():
    cfg = preset("tiny")
    w = golden.make_weights(cfg, [2, 4], seed=5)
    specs = {**weight_specs(cfg, 2), **weight_specs(cfg, 4)}
    assert set(w) == set(specs)
    for name, (shape, kind) in specs.items():
        a = w[name]
        assert a.shape == shape and a.dtype == np.float32, name
        is_bf16 = np.array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), a)
        assert is_bf16 == (kind == "bf16"), name
        center, scale = golden.weight_distribution(name, shape)
        assert np.all(np.abs(a - center) <= scale * 1.01), name
    # A layer's weights do not depend on which other layers were made with it.
    alone = golden.make_weights(cfg, [4], seed=5)
    for name, a in alone.items():
        assert np.array_equal(a, w[name])


def test_weight_distribution_rejects_unknown_parameters():
    with pytest.raises(ValueError, match="no distribution"):
        golden.weight_distribution("layers.0.attn.mystery", (3, 3, 3))


def test_bad_seed_is_a_usage_error():
    with pytest.raises(GoldenError, match="seed"):
        golden.make_input("x", (2, 2), seed=-1)


# --------------------------------------------------------------------------- layer sources


def test_missing_sources_are_named():
    cfg = preset("v41-flash")
    assert golden.missing_sources(cfg, [20]) == []
    assert golden.missing_sources(cfg, [0, 1, 41]) == []
    msgs = golden.missing_sources(cfg, [24])
    assert msgs and "layer 24 needs layer 20" in msgs[0]
    with pytest.raises(GoldenError, match=r"lacks layer 20 \(layer 24's kv source"):
        GoldenPlan(cfg, (24,), prefill=4, decode=0)
    # Every missing layer at once, the sources' own sources too, and a selection that runs.
    assert golden.closed_selection(cfg, [5]) == ((2, 5, 8, 14, 20), {
        2: ["layer 5's kv source", "layer 5's index source"],
        8: ["layer 2's key owner it may score against"],
        14: ["layer 2's key owner it may score against"],
        20: ["layer 2's key owner it may score against"]})
    assert golden.missing_sources(cfg, golden.closed_selection(cfg, [5])[0]) == []


@pytest.mark.parametrize("kw, msg", [(dict(prefill=0), "--prefill"), (dict(decode=-1), "--decode"),
                                     (dict(prefill=60, decode=10), "max_seq_len"),
                                     (dict(capture="some"), "--capture"), (dict(seed=2 ** 64), "seed")])
def test_plan_validation(kw, msg):
    args = dict(prefill=4, decode=1) | kw
    with pytest.raises(GoldenError, match=msg):
        GoldenPlan(preset("tiny"), tuple(range(6)), **args)


# --------------------------------------------------------------------------- storage and writing


def _tensors():
    return {
        "layers.0.attn.wq_a.weight": np.ones((3, 4), np.float32).astype(ml_dtypes.bfloat16),
        "layers.0.attn.attn_sink": np.array([0.1, 0.2], np.float32),
        "step0.layers.0.idx": np.array([[0, -1], [1, 2]], np.int32),
        "step0.layers.0.shared.candidates": np.array([[1, 0]], np.uint8),
        "step0.layers.0.shared.topk_idxs": np.zeros((2, 0), np.int32),
    }


def test_storage_kinds_and_checks():
    assert golden.storage_kind("step3.layers.2.idx") == "I32"
    assert golden.storage_kind("step3.layers.2.shared.candidates") == "U8"
    assert golden.storage_kind("step3.layers.2.state.score_state") == "F32"
    assert golden.storage_kind("step3.layers.2.out") == "BF16"
    assert golden.storage_kind("layers.2.attn.attn_sink", {"layers.2.attn.attn_sink": "f32"}) == "F32"
    with pytest.raises(ValueError, match="not bf16"):
        golden.to_storage("step0.layers.0.out", np.array([1.0001], np.float32), "BF16")
    a = golden.to_storage("step0.layers.0.out", np.array([1.5, -np.inf], np.float32), "BF16")
    assert a.dtype == ml_dtypes.bfloat16
    # bf16 values alone are their f32 patterns' high halves; with a NaN, ml_dtypes' cast's bits.
    for values in ([[1.5, -0.0], [3e38, 1e-40]], [[1.5, np.nan], [-np.nan, 2.0]]):
        x = np.array(values, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
        a = golden.to_storage("step0.layers.0.out", x, "BF16")
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == (2, 2)
        np.testing.assert_array_equal(a.view(np.uint16), x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_write_is_atomic_and_refuses_to_overwrite(tmp_path):
    path = tmp_path / "g.safetensors"
    golden.write_tensors_atomic(path, _tensors(), {"k": "v"})
    back = load_file(path)
    assert back["layers.0.attn.wq_a.weight"].dtype == ml_dtypes.bfloat16
    assert back["step0.layers.0.idx"].dtype == np.int32
    assert back["step0.layers.0.shared.topk_idxs"].shape == (2, 0)
    with safe_open(path, framework="np") as f:
        assert f.metadata() == {"k": "v"}
    with pytest.raises(GoldenError, match="exists"):
        golden.write_tensors_atomic(path, _tensors(), {"k": "w"})
    golden.write_tensors_atomic(path, _tensors(), {"k": "w"}, force=True)
    with safe_open(path, framework="np") as f:
        assert f.metadata() == {"k": "w"}
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    import safetensors.numpy

    def half_then_interrupt(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        golden.write_tensors_atomic(tmp_path / "g.safetensors", _tensors(), {})
    assert os.listdir(tmp_path) == []


def test_written_file_is_readable_as_a_golden_file(tmp_path):
    path = tmp_path / "g.safetensors"
    golden.write_tensors_atomic(path, _tensors(), {"k": "v"})
    with golden.GoldenFile(path) as f:
        assert f.kind == "safetensors"
        assert "step0.layers.0.idx" in f
        assert f.get("step0.layers.0.idx").tolist() == [[0, -1], [1, 2]]
        with pytest.raises(GoldenError, match="not a ds41numba-golden file"):
            f.run_info()


def test_unreadable_files_are_usage_errors(tmp_path):
    with pytest.raises(GoldenError, match="cannot read"):
        golden.GoldenFile(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00hello")
    with pytest.raises(GoldenError, match="not a safetensors or .npz"):
        golden.GoldenFile(junk)


def test_npz_golden_is_read_without_its_notes():
    with golden.GoldenFile(DATA / "tiny.npz") as f:
        assert f.kind == "npz"
        assert "config" not in f.names and not any(n.startswith("dtype.") for n in f.names)
        info = f.run_info()
        assert (info.prefill, info.decode, info.layers) == (12, 40, tuple(range(6)))


# --------------------------------------------------------------------------- comparison


def test_compare_index_tensors_reports_differing_rows():
    want = np.arange(20, dtype=np.int32).reshape(5, 4)
    got = want.copy()
    got[1, 2] = -1
    got[4, 0] = 99
    r = compare_tensor("step0.layers.0.idx", want, got)
    assert (r.kind, r.ok, r.rows, r.rows_differ, r.first_rows) == ("index", False, 5, 2, [1, 4])
    assert "2 of 5 rows differ" in r.line()
    assert compare_tensor("i", want, want.astype(np.int64)).ok
    assert compare_tensor("m", np.array([[1, 0]], np.uint8), np.array([[True, False]])).ok


def test_compare_float_tolerance_and_steps():
    want = np.array([4.0, 1.0, -2.0, 0.0, -np.inf], np.float32)
    one_step = np.array([4.0, 1.0078125, -2.0, 0.0, -np.inf], np.float32)   # 1 + 2^-7: next bf16
    r = compare_tensor("t", want, one_step)
    assert r.ok and r.max_bf16_steps == 1.0 and r.bit_identical == 4 and r.within_one_step == 5
    assert r.tolerance == pytest.approx(2 * 2 ** -8 * 4.0 + 1e-6)
    over = want.copy()
    over[1] = 1.05                                         # 0.05 > 2 * 2^-8 * 4
    r = compare_tensor("t", want, over)
    assert not r.ok and r.over_tolerance == 1 and "(1 of 5 elements over)" in r.line()
    wrong_inf = want.copy()
    wrong_inf[4] = 0.0
    assert not compare_tensor("t", want, wrong_inf).ok
    nan = np.array([np.nan, 1.0], np.float32)
    assert compare_tensor("t", nan, nan.copy()).ok
    assert not compare_tensor("t", nan, np.array([0.0, 1.0], np.float32)).ok


def test_compare_bf16_against_f32_storage():
    want = np.array([1.5, 3.0], np.float32)
    assert compare_tensor("t", want, want.astype(ml_dtypes.bfloat16)).bit_identical == 2


def test_compare_shape_mismatch():
    r = compare_tensor("t", np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32))
    assert r.kind == "shape" and not r.ok and "[3, 2]" in r.line()


def test_compare_files_reports_tensors_in_one_file(tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    t = _tensors()
    golden.write_tensors_atomic(a, t, {})
    del t["step0.layers.0.idx"]
    t["extra"] = np.zeros(2, np.float32)
    golden.write_tensors_atomic(b, t, {})
    report = golden.compare_files(a, b)
    assert not report.ok
    kinds = {r.name: r.kind for r in report.results}
    assert kinds["step0.layers.0.idx"] == "only-golden" and kinds["extra"] == "only-candidate"
    assert golden.compare_files(a, b, subset=True).ok


# =============================================================================== determinism


def _golden_via_cli(path, threads, args):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads), PYTHONHASHSEED="random")
    out = subprocess.run([sys.executable, "-m", "ds41numba", "golden", *args, "--quiet",
                          "--out", str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return path.read_bytes()


def _header(data):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


# A config big enough that the parallel kernels (rounding, quantisers, RMSNorm, top-k rows) split
# their work across threads, and short enough for CI: 300-token prefill, ratio 1 rows past
# 64 * index_topk (partial-sort branch), ratio 4 with candidates.
_DET_CONFIG = dict(
    dim=128, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2,
    window_size=16, compress_ratios=[0, 4, 4, 1, 1], kv_source_layers=[1, 3],
    index_source_layers=[1, 2, 3, 4], candidate_source_layer=3, candidate_topk_blocks=4,
    candidate_block_size=4, index_n_heads=4, index_head_dim=32, index_topk=4,
    compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64, max_seq_len=320)


def test_golden_files_do_not_depend_on_the_thread_count(tmp_path):
    """The same seed and config give identical golden files with 1 and with 2 threads (numba and
    BLAS), written by the command line in separate processes."""
    cfg = tmp_path / "det.json"
    cfg.write_text(json.dumps(_DET_CONFIG))
    args = ["--config", str(cfg), "--prefill", "300", "--decode", "6", "--seed", "11"]
    one = _golden_via_cli(tmp_path / "one.safetensors", 1, args)
    two = _golden_via_cli(tmp_path / "two.safetensors", 2, args)
    (h1, d1), (h2, d2) = _header(one), _header(two)
    assert h1 == h2, "headers differ (tensor names, dtypes, shapes, offsets or metadata)"
    bad = [k for k, v in h1.items() if k != "__metadata__"
           and d1[slice(*v["data_offsets"])] != d2[slice(*h2[k]["data_offsets"])]]
    assert not bad, f"{len(bad)} tensors differ with the thread count, e.g. {bad[:5]}"
    assert one == two, "the files hold the same tensors but are not byte-identical"


# =============================================================================== tie-aware index rows
# A small stack with production's roles: a ratio-2 key owner, a ratio-1 key owner that is the
# candidate source, and a candidate consumer; 8 index heads of 64 (two fp4 blocks).
_TIE_CONFIG = dict(
    dim=128, n_heads=2, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2,
    window_size=16, compress_ratios=[0, 2, 1, 1], kv_source_layers=[1, 2],
    index_source_layers=[1, 2, 3], candidate_source_layer=2, candidate_topk_blocks=8,
    candidate_block_size=4, index_n_heads=8, index_head_dim=64, index_topk=16,
    compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64, max_seq_len=512)
_TIE_RUN = dict(prefill=300, decode=3, seed=5)


def _tie_plan(candidates=True, **kw):
    from ds41numba.config import AttnConfig
    cfg = AttnConfig.from_dict(_TIE_CONFIG | ({} if candidates else {"candidate_source_layer": -1}))
    return GoldenPlan(cfg, tuple(range(cfg.n_layers)), **(_TIE_RUN | kw))


@pytest.fixture(scope="module")
def tie_golden(tmp_path_factory):
    """``(path, tensors)`` of a golden of the small stack (capture all)."""
    path = tmp_path_factory.mktemp("ties") / "golden.safetensors"
    golden.write_golden(_tie_plan(), path)
    return path, load_file(path)


def _candidate(tmp_path, name, tensors, meta_from):
    path = tmp_path / name
    with safe_open(meta_from, framework="np") as f:
        meta = f.metadata()
    golden.write_tensors_atomic(path, tensors, meta)
    return path


def _made_with(tmp_path, monkeypatch, name, plan=None, **patches):
    """A candidate golden of ``plan`` (default: the small stack's) made by the stack with
    ``patches`` applied to the indexer's driver (``ds41numba.indexer.lightning``)."""
    indexer = importlib.import_module("ds41numba.indexer.lightning")
    with monkeypatch.context() as m:
        for attr, value in patches.items():
            m.setattr(indexer, attr, value)
        path = tmp_path / name
        golden.write_golden(plan or _tie_plan(), path)
    return path


def test_recorded_scores_are_the_selection_and_its_runners_up(tie_golden):
    import naive
    _, t = tie_golden
    for s, layer in [(0, 1), (0, 2), (0, 3), (2, 3)]:
        p = f"step{s}.layers.{layer}."
        topk = t[p + "shared.topk_idxs"].astype(np.int64)
        seqlen = topk.shape[0]
        offset = seqlen if s == 0 else _TIE_CONFIG["window_size"]
        scores = t[p + "index_score"].astype(np.float32)
        if layer == 3:   # a candidate consumer chooses among its candidates
            scores = np.where(t[f"step{s}.layers.2.shared.candidates"] > 0, scores, -np.inf)
        rows = np.arange(seqlen)[:, None]
        want = np.where(topk >= 0, scores[rows, np.clip(topk - offset, 0, None)], -np.inf)
        assert np.array_equal(t[p + "topk_scores"].astype(np.float32), want), p
        r = _TIE_CONFIG["compress_ratios"][layer]
        clen = golden.compare.visible_lengths(0 if s == 0 else 299 + s, seqlen, r)
        idxs, vals = naive.runners_up(scores, clen, topk, offset, golden.RUNNERS_UP)
        assert np.array_equal(t[p + "runner_idxs"], idxs), p
        assert np.array_equal(t[p + "runner_scores"].astype(np.float32), vals), p


def _block_hints(scores, clen, block, how):
    """Block hints of score rows as the top-k and the runners-up skip by them: none (block 0),
    each row's block maxima over what it sees (NaN wins), or upper bounds of them (the maxima
    plus 1, the newest visible block pinned to +inf as the candidate source pins it)."""
    if how == "none":
        return 0, scores
    T, width = scores.shape
    nb = -(-width // block)
    hints = np.full((T, nb), -np.inf, np.float32)
    for s in range(T):
        for b in range(-(-int(clen[s]) // block)):
            vals = scores[s, b * block:min(int(clen[s]), (b + 1) * block)]
            hints[s, b] = np.nan if np.isnan(vals).any() else vals.max()
        if how == "bounds":
            hints[s] += np.float32(1.0)
            if clen[s]:
                hints[s, (clen[s] - 1) // block] = np.inf
    return block, hints


@pytest.mark.parametrize("hints", ["none", "maxima", "bounds"])
@pytest.mark.parametrize("kind", ["ties", "nan", "masked", "picked_high", "pinned_nan"])
def test_runners_up_kernel_is_its_naive_twin_on_long_rows(kind, hints):
    # Rows of several scan runs, where the kernel skips a run none of whose scores passes its
    # last runner-up (read from the row, or from the top-k's block hints): ties on the last
    # one, NaN, a consumer's long -inf stretches, the selection's own (best) scores inside runs
    # it must skip over, and a NaN in the newest block, which the candidate source pins to
    # +inf, after more +inf scores than the selection and the runners-up hold.
    import naive
    from ds41numba.golden.captures import _runners_up
    rng = np.random.default_rng(len(kind))
    T, width, k, offset = 6, 300, 12, 5
    scores = np.round(rng.standard_normal((T, width)) * 2).astype(np.float32)     # many ties
    if kind == "nan":
        scores[rng.random((T, width)) < 0.02] = np.nan
    if kind == "masked":
        scores[rng.random((T, -(-width // 8))).repeat(8, axis=1)[:, :width] < 0.9] = -np.inf
    clen = np.array([0, 1, 40, 299, 300, 300])
    if kind == "pinned_nan":       # in the newest block of a whole last scan run
        clen = np.array([0, 1, 40, 288, 256, 300])
        scores[:, :100] = np.inf
        scores[3, 285] = scores[4, 250] = np.nan
    topk = np.full((T, k), -1, np.int64)
    for s in range(T):
        seen = min(clen[s], k)
        if kind == "picked_high":
            pick = rng.choice(clen[s], seen, replace=False) if clen[s] else np.zeros(0, np.int64)
            scores[s, pick] = 100
        elif kind == "pinned_nan":          # the NaN left out: the first runner-up
            pick = np.arange(seen)
        else:
            pick = np.argsort(-np.nan_to_num(scores[s, :clen[s]], nan=np.inf), kind="stable")[:seen]
        topk[s, :seen] = np.sort(pick) + offset
    idx = np.empty((T, golden.RUNNERS_UP), np.int64)
    val = np.empty((T, golden.RUNNERS_UP), np.float32)
    _runners_up(scores, clen, topk, offset, idx, val, *_block_hints(scores, clen, 8, hints)[::-1])
    want_idx, want_val = naive.runners_up(scores, clen, topk, offset, golden.RUNNERS_UP)
    assert np.array_equal(idx, want_idx) and np.array_equal(val, want_val, equal_nan=True)
    if kind == "pinned_nan":
        assert want_idx[3, 0] == 285 + offset and want_idx[4, 0] == 250 + offset


@pytest.mark.parametrize("block, density", [(8, 0.1), (4, 0.05), (12, 0.3), (8, 0.01)])
def test_listed_runners_up_are_the_naive_twin_on_a_consumers_rows(block, density):
    # A consumer's rows, -inf outside its candidate blocks, through the pass that visits only
    # the quarters holding a candidate (ListedSpans): ties, NaN, -inf inside quarters (blocks
    # of 4 and 12 do not fill them), and rows with too few candidates left out of the selection
    # (which then take -inf positions, the row's first ones: the whole-row fallback).
    import naive
    from ds41numba.golden.captures import _runners_up_listed
    from ds41numba.indexer.candidate_scores import candidate_quarters
    rng = np.random.default_rng(block * 100 + int(density * 100))
    T, width, k, offset = 7, 2000, 40, 5
    scores = np.round(rng.standard_normal((T, width)) * 2).astype(np.float32)     # many ties
    scores[rng.random((T, width)) < 0.01] = np.nan
    bits = rng.random((T, -(-width // block))) < density
    bits[6] = False
    bits[6, 3] = True                               # one block: fewer than k + R candidates
    scores[~np.repeat(bits, block, axis=1)[:, :width]] = -np.inf
    clen = np.array([0, 1, 700, 1999, 2000, 2000, 2000])
    scores[np.arange(width)[None, :] >= clen[:, None]] = -np.inf
    topk = np.full((T, k), -1, np.int64)
    for s in range(T):
        seen = min(clen[s], k)
        pick = np.argsort(-np.nan_to_num(scores[s, :clen[s]], nan=np.inf), kind="stable")[:seen]
        topk[s, :seen] = np.sort(pick) + offset
    offsets, firsts = candidate_quarters(np.packbits(bits, axis=1), clen, block)
    idx = np.empty((T, golden.RUNNERS_UP), np.int64)
    val = np.empty((T, golden.RUNNERS_UP), np.float32)
    _runners_up_listed(scores, clen, topk, offset, idx, val, offsets, firsts, 8)
    want_idx, want_val = naive.runners_up(scores, clen, topk, offset, golden.RUNNERS_UP)
    assert np.array_equal(idx, want_idx) and np.array_equal(val, want_val, equal_nan=True)
    assert np.isneginf(want_val[6]).any()


def _reversed_head_sum_scores(iq, w, keys, clen, width, out=None):
    """The indexer's scores with the head sum in reverse head order and each partial sum rounded
    to bf16 (a kernel's reduction; in f32 the few bf16 terms of this small stack add exactly in
    any order)."""
    d = np.einsum("thd,nd->thn", iq.astype(np.float64), keys.astype(np.float64)).astype(np.float32)
    d = d.astype(ml_dtypes.bfloat16).astype(np.float32)
    terms = (np.maximum(d, 0) * w[:, :, None]).astype(ml_dtypes.bfloat16).astype(np.float32)
    acc = np.zeros((iq.shape[0], keys.shape[0]), np.float32)
    for h in reversed(range(iq.shape[1])):
        acc = (acc + terms[:, h]).astype(ml_dtypes.bfloat16).astype(np.float32)
    res = np.full((iq.shape[0], width), -np.inf, np.float32)
    res[:, :keys.shape[0]] = acc.astype(ml_dtypes.bfloat16).astype(np.float32)
    res[np.arange(width)[None, :] >= clen[:, None]] = -np.inf
    if out is not None:
        out[...] = res
        return out
    return res


def _other_way_select(scores, clen, k, out, maxima=None):
    """Top-k breaking every tie the other way: among equal scores the highest positions (the
    block maxima, a hint for what to skip, unused)."""
    for s in range(scores.shape[0]):
        n = int(min(scores.shape[1], clen[s]))
        v = scores[s, :n]
        order = sorted(range(n), key=lambda t: (not np.isnan(v[t]),
                                                0.0 if np.isnan(v[t]) else -float(v[t]), -t))
        picked = order[:k] + list(range(n, n + k - len(order[:k])))
        out[s] = sorted(picked)


def _assert_passes_with_swaps(report, what):
    s = report.summary()
    assert report.ok, report.text()
    assert s["index_rows_swapped"] > 0 and s["index_rows_wrong"] == 0, what
    assert "boundary swaps" in report.summary_line()
    swapped = [r for r in report.results if r.rows_swapped]
    assert swapped and "boundary swaps (max gap" in swapped[0].line()
    return s


def test_another_head_order_passes_as_boundary_swaps(tmp_path, monkeypatch):
    # Without a candidate source: its block masks are compared exactly (README).
    plan = _tie_plan(candidates=False)
    path = tmp_path / "golden.safetensors"
    golden.write_golden(plan, path)
    indexer = importlib.import_module("ds41numba.indexer")
    block_maxima = importlib.import_module("ds41numba.indexer.block_maxima")
    candidate_scores = importlib.import_module("ds41numba.indexer.candidate_scores")

    def scores(self, iq, w, clen, width, out=None, qbuf=None, dirty_to=None, maxima=None,
               need=None):
        got = _reversed_head_sum_scores(iq, w, self.keys[:width], clen, width, out)
        if maxima is not None:      # the candidate source's block maxima, of these scores
            block_maxima.visible_block_maxima(got, clen, *maxima)
        if need is not None:        # a consumer scored whole: -inf outside its key blocks
            candidate_scores.clear_key_blocks(got, 1 - need.key_blocks, DOT_LANES)
        return got

    monkeypatch.setattr(indexer.IndexKeyCache, "scores", scores)
    cand = _made_with(tmp_path, monkeypatch, "heads.safetensors", plan)
    s = _assert_passes_with_swaps(golden.compare_files(path, cand), "head order")
    assert 0 < s["max_relative_gap"] < golden.DEFAULT_INDEX_TOLERANCE
    # Today's rule would have failed it, and a swap's float rows are judged apart.
    assert not golden.compare_files(path, cand, exact_index=True).ok


def test_breaking_every_tie_the_other_way_passes(tmp_path, monkeypatch):
    plan = _tie_plan(profile="ties", decode=2)
    path = tmp_path / "ties.safetensors"
    golden.write_golden(plan, path)
    lightning = importlib.import_module("ds41numba.indexer.lightning")
    with monkeypatch.context() as m:
        m.setattr(lightning, "select_rows", _other_way_select)
        cand = tmp_path / "other_way.safetensors"
        golden.write_golden(plan, cand)
    report = golden.compare_files(path, cand)
    s = _assert_passes_with_swaps(report, "ties the other way")
    assert s["max_score_gap"] == 0.0          # exact ties only
    assert s["index_rows_swapped"] > 100


def _tampered(tie_golden, tmp_path, name, change):
    path, t = tie_golden
    t = dict(t)
    change(t)
    return golden.compare_files(path, _candidate(tmp_path, name, t, path))


def _visible_row(t, name, min_valid=4):
    rows = np.flatnonzero((t[name] >= 0).sum(axis=1) >= min_valid)
    return int(rows[len(rows) // 2])


@pytest.mark.parametrize("bug, reason", [("minus_one", "-1 where the golden has a position"),
                                         ("duplicate", "duplicate index")])
def test_planted_index_bugs_fail_and_are_named(tie_golden, tmp_path, bug, reason):
    name = "step0.layers.2.shared.topk_idxs"

    def change(t):
        k = t[name].copy()
        row = _visible_row(t, name)
        if bug == "minus_one":
            k[row, 0] = -1
        else:
            k[row, 1] = k[row, 0]
        t[name] = k

    report = _tampered(tie_golden, tmp_path, f"{bug}.safetensors", change)
    assert not report.ok
    line = next(r.line() for r in report.failures if r.name == name)
    assert reason in line and "1 of 300 rows wrong" in line, line


def test_off_by_one_visibility_fails(tie_golden, tmp_path, monkeypatch):
    from ds41numba.indexer import visible_lengths

    def one_more(start_pos, seqlen, ratio, prefill=None):
        # (the golden's prefill is one chunk: start_pos 0 for a prefill's rows)
        v = visible_lengths(start_pos, seqlen, ratio, prefill)
        return np.minimum(v + 1, (start_pos + seqlen) // ratio) if start_pos == 0 else v

    cand = _made_with(tmp_path, monkeypatch, "visibility.safetensors", visible_lengths=one_more)
    report = golden.compare_files(tie_golden[0], cand)
    assert not report.ok
    lines = [r.line() for r in report.failures if r.name.endswith("shared.topk_idxs")]
    assert lines and any("past the query's" in l for l in lines), lines


def test_flipped_fp4_block_scale_fails(tie_golden, tmp_path, monkeypatch):
    import naive

    def flipped(x):
        """The indexer's fp4 quantiser with each row's block scales in reverse order."""
        b = x.reshape(x.shape[:-1] + (-1, 32))
        amax = np.maximum(np.abs(b).max(axis=-1), np.float32(6 * 2.0 ** -126))
        scale = naive.pow2ceil(amax / np.float32(6))[..., ::-1, None]
        q = naive.to_e2m1_rne(np.clip(b / scale, -6, 6)) * scale
        x[...] = naive.to_bf16_rne(q).reshape(x.shape)
        return x

    cand = _made_with(tmp_path, monkeypatch, "fp4.safetensors", fp4_quant_e8m0_inplace=flipped)
    report = golden.compare_files(tie_golden[0], cand)
    assert not report.ok
    wrong = [r for r in report.failures if r.name.endswith(("idx", "shared.topk_idxs"))]
    assert wrong and all("rows wrong" in r.line() for r in wrong)
    assert report.summary()["index_rows_wrong"] > report.summary()["index_rows"] // 4


def test_wrong_sink_fails(tie_golden, tmp_path):
    path, t = tie_golden
    plan = _tie_plan()
    weights = golden.make_weights(plan.config, plan.layers, plan.seed)
    stack_golden = golden.run_golden  # the candidate: the same run with every sink left out
    import ds41numba.golden.run as run_mod
    real = run_mod.make_weights

    def no_sink(*a, **kw):
        w = real(*a, **kw)
        for n in w:
            if n.endswith("attn_sink"):
                w[n] = np.full_like(w[n], -80.0)       # exp(-80): the sink left out
        return w

    run_mod.make_weights = no_sink
    try:
        cand = dict(stack_golden(plan))
    finally:
        run_mod.make_weights = real
    for n in weights:
        cand[n] = t[n]                                 # the golden's weights, as a kernel reads
    report = golden.compare_files(path, _candidate(tmp_path, "sink.safetensors", cand, path))
    assert not report.ok
    outs = [r for r in report.failures if r.name.endswith((".out", ".o"))]
    assert outs and "> tolerance" in outs[0].line(), report.text()
    assert report.summary()["index_rows_wrong"] == 0


def test_judge_index_rows_by_rule():
    from ds41numba.golden import RowBounds, RowScores, judge_index_rows
    want = np.array([[10, 11, 12], [10, 11, -1]], np.int32)
    scores = RowScores(want, np.array([[3.0, 2.0, 1.0], [3.0, 2.0, -np.inf]]),
                       np.array([[13, 14], [-1, -1]], np.int32), np.array([[0.97, 0.5], [-np.inf] * 2]))
    bounds = RowBounds(offset=10, clen=np.array([5, 2]))
    j = judge_index_rows(want, np.array([[10, 11, 13], [11, 10, -1]]), scores, bounds)
    assert (j.identical, j.swapped, j.wrong) == (1, 1, 0) and j.max_gap == pytest.approx(0.03)
    assert j.max_relative_gap == pytest.approx(0.01)
    for got, why in [([10, 11, 14], "below the boundary"), ([10, 11, 11], "duplicate index 11"),
                     ([10, 11, 15], "past the query's 5 visible positions"),
                     ([10, 11, -2], "out of range"), ([10, 12, 13], "dropped 11")]:
        j = judge_index_rows(want[:1], np.array([got]), scores, bounds)
        assert j.wrong == 1 and why in j.reasons[0], (got, j.reasons)
    assert judge_index_rows(want[:1], np.array([[10, 11, 13]]), scores, bounds,
                            tolerance=0.001).wrong == 1
    assert "no scores" in judge_index_rows(want[:1], np.array([[10, 11, 13]])).reasons[0]
    j = judge_index_rows(want[:1], np.array([[10.0, np.nan, 12.0]]))
    assert "NaN where an index belongs" in j.reasons[0]


def test_exact_index_restores_the_old_rule(tie_golden, tmp_path):
    def swap_one(t):
        k = t["step1.layers.3.shared.topk_idxs"].copy()
        k[0, 0] = k[0, 0]            # unchanged: the same file compares OK either way
        t["step1.layers.3.shared.topk_idxs"] = k

    assert _tampered(tie_golden, tmp_path, "same.safetensors", swap_one).ok
    path, _ = tie_golden
    assert golden.compare_files(path, path, exact_index=True).index_rule == "exact"


# =============================================================================== the ties profile


def test_ties_profile_changes_what_its_docstring_says():
    cfg = _tie_plan().config
    d = golden.make_weights(cfg, [2], seed=5)
    t = golden.make_weights(cfg, [2], seed=5, profile="ties")
    p = "layers.2.attn."
    idim = cfg.index_head_dim
    q = t[p + "indexer.wq_b.weight"].reshape(cfg.index_n_heads, idim, -1)
    assert (q == q[:1]).all() and np.array_equal(q[0], d[p + "indexer.wq_b.weight"][:idim])
    assert not t[p + "indexer.wk.weight"][1:].any()
    assert np.array_equal(t[p + "indexer.wk.weight"][0], d[p + "indexer.wk.weight"][0])
    for name in ("wq_a.weight", "wkv.weight", "compressor.wkv.weight"):
        assert not t[p + name][:, -1].any() and np.array_equal(t[p + name][:, :-1], d[p + name][:, :-1])
    assert (t[p + "indexer.weights_proj.weight"][:, -1] == 1024).all()
    same = [n for n in d if n.rsplit(".attn.", 1)[1] in ("attn_sink", "wq_b.weight", "wo_a.weight")]
    assert all(np.array_equal(d[n], t[n]) for n in same)
    x = golden.make_input("step0.layers.2.x", (130, cfg.dim), 5, "ties")
    col = x[:, -1]
    assert set(np.flatnonzero(col > 0)) == {17, 78} and set(np.flatnonzero(col < 0)) == {41, 102}
    assert np.array_equal(x[:, :-1], golden.make_input("step0.layers.2.x", (130, cfg.dim), 5)[:, :-1])
    # A decode step's row continues the pattern at its position.
    assert golden.make_input("step3.layers.2.x", (1, cfg.dim), 5, "ties", start_pos=139)[0, -1] > 0
    with pytest.raises(GoldenError, match="--profile"):
        golden.make_weights(cfg, [2], profile="flat")


def test_ties_profile_ties_most_rows_at_the_boundary():
    t = golden.run_golden(_tie_plan(profile="ties", decode=1))
    rows = ties = nan_rows = pos_inf = neg_inf = 0
    for layer in (1, 2, 3):
        p = f"step0.layers.{layer}."
        sel, sc = t[p + "shared.topk_idxs"], t[p + "topk_scores"].astype(np.float32)
        runners = t[p + "runner_scores"].astype(np.float32)
        scores = t[p + "index_score"].astype(np.float32)
        for s in range(sel.shape[0]):
            rows += 1
            valid = sc[s][sel[s] >= 0]
            finite = valid[~np.isnan(valid)]
            kth = finite.min() if finite.size else np.nan
            ties += bool(runners[s, 0] == kth or (np.isnan(kth) and np.isnan(runners[s, 0])))
            nan_rows += bool(np.isnan(scores[s]).any())
            pos_inf += bool((scores[s] == np.inf).any())
            neg_inf += s % 61 == 41 and bool(np.isnan(scores[s]).any())
    assert ties > 0.6 * rows, (ties, rows)
    assert nan_rows >= 10 and pos_inf >= 5 and neg_inf >= 5
    # Scores land on few values: 0 and one other per row (NaN/inf rows aside).
    s = t["step0.layers.2.index_score"].astype(np.float32)[210]
    assert len(np.unique(s[np.isfinite(s)])) <= 2 and (s == 0).sum() > 20


# =============================================================================== kernel-boundary samples


def test_capture_rows_hold_each_kernels_inputs_and_outputs():
    import naive
    from ds41numba import testing
    rows = (0, 7, 150, 299, 301)
    t = golden.run_golden(_tie_plan(capture_rows=rows))
    cfg = _tie_plan().config
    for s, layer in [(0, 1), (0, 2), (0, 3), (2, 3), (2, 0)]:
        p = f"step{s}.layers.{layer}."
        want = [r for r in rows if r < 300] if s == 0 else [0]
        assert t[p + "sample.rows"].tolist() == want, p
        for what in ("q", "o"):
            assert np.array_equal(t[p + "sample." + what].view(np.uint16),
                                  t[p + what][want].view(np.uint16)), p + what
        kv_all, idx = t[p + "kv"].astype(np.float32), t[p + "idx"][want]
        gathered = np.where(idx[..., None] >= 0, kv_all[np.maximum(idx, 0)], 0)
        assert np.array_equal(t[p + "sample.kv"].astype(np.float32), gathered), p
        # Sparse attention on the sample alone reproduces o.
        q = t[p + "sample.q"].astype(np.float32)
        kv = t[p + "sample.kv"].astype(np.float32)
        sink = t[f"layers.{layer}.attn.attn_sink"]
        local = np.where(idx >= 0, np.arange(idx.shape[1]), -1)
        for i in range(len(want)):
            o = naive.sparse_attn(q[i:i + 1], kv[i], local[i:i + 1], sink, cfg.head_dim ** -0.5)
            testing.assert_close(o, t[p + "sample.o"][i:i + 1], p + "sample.o")
        if layer == 0:
            assert p + "sample.index_score" not in t and p + "sample.compress_kv" not in t
            continue
        r = cfg.ratio(layer)
        width = (300 if s == 0 else 301 + s) // r
        assert np.array_equal(t[p + "sample.compress_kv"].view(np.uint16),
                              t[p + "shared.compress_kv"].view(np.uint16)[:width])
        keys = t[p + "sample.index_k"].astype(np.float32)
        assert np.array_equal(keys, t[p + "shared.index_k"].astype(np.float32)[:width])
        # The indexer's scores from the sample's fp4 queries, head weights and keys.
        clen = golden.compare.visible_lengths(0 if s == 0 else 299 + s, 300 if s == 0 else 1, r)
        got = naive.tile_scores(t[p + "sample.index_q"].astype(np.float32),
                                t[p + "sample.index_weights"].astype(np.float32), keys,
                                clen[want])
        assert np.array_equal(got, t[p + "sample.index_score"].astype(np.float32)), p
        assert np.array_equal(t[p + "sample.index_score"].view(np.uint16),
                              t[p + "index_score"][want].view(np.uint16)), p


def test_capture_rows_must_lie_in_the_run():
    with pytest.raises(GoldenError, match="--capture-rows"):
        _tie_plan(capture_rows=(303,))
