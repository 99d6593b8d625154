"""Goldens of some prefill rows (``--rows``) and of the caches a prefill leaves (``--capture
caches``): every row, decode step and cache such a file holds is byte for byte the full run's
(every layer role: the tiny and mixed presets hold ratio-0 layers, kv sources of ratio 4, 2 and
1, index sources and key owners, the candidate source and its consumers, selection reusers),
whatever the chunks, on both register tiers, resumed, on a cluster; compare, replay, testing and
--plot match rows by position."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from ds41numba import preset
from ds41numba.cli import main, parse_rows
from ds41numba.golden import (GoldenError, GoldenFile, GoldenPlan, RunInterrupted, compare_files,
                              load_golden, replay, write_golden)
from ds41numba.golden.cluster import Cluster
from ds41numba.golden.rows import PER_ROW
from ds41numba.numerics import use_backend
from ds41numba.testing import assert_candidate_file, assert_golden_tensor

RUNS = {"tiny": (12, 5), "mixed": (203, 4)}


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _plan(name, rows=None, capture="caches", capture_rows=(), seed=3):
    cfg = preset(name)
    prefill, decode = RUNS[name]
    return GoldenPlan(cfg, tuple(range(cfg.n_layers)), prefill, decode, seed=seed,
                      capture=capture, preset=name, rows=rows, capture_rows=capture_rows)


def assert_same_rows(full_path, rows_path):
    """Every tensor of the rows golden equals the full golden's, at its rows' positions."""
    _, full = load_golden(full_path)
    info, part = load_golden(rows_path)
    held = np.asarray(info.rows, np.int64)
    for name, got in part.items():
        if name.endswith(".rows") and name.count(".") == 3:
            assert np.array_equal(got, held), name
            continue
        want = full[name]
        what = name.split(".", 3)[3] if name.startswith("step") else ""
        if name.startswith("step0.") and what in ("x", "out", "idx", "shared.topk_idxs",
                                                  "topk_scores", "runner_idxs", "runner_scores"):
            want = want[held]
        assert want.dtype == got.dtype and want.shape == got.shape, name
        assert want.tobytes() == got.tobytes(), name
    return part


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The full caches goldens (chunk 7), one per preset and tier."""
    made = {}

    def get(name, tier="default"):
        if (name, tier) not in made:
            path = tmp_path_factory.mktemp("full") / f"{name}-{tier}.safetensors"
            with use_backend(tier) if tier != "default" else _nothing():
                write_golden(_plan(name), path, chunk=7)
            made[name, tier] = path
        return made[name, tier]
    return get


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("text, want", [
    ("none", ()), ("first:3", (0, 1, 2)), ("last:2", (10, 11)), ("every:5", (0, 5, 10)),
    ("0-2,7,5-6", (0, 1, 2, 5, 6, 7)), ("3,3,1", (1, 3))])
def test_parse_rows(text, want):
    assert parse_rows(text, 12, flag="--rows", what="prefill") == want


def test_parse_rows_random_is_seeded_and_errors_are_one_line():
    a = parse_rows("random:4", 100, seed=5)
    assert len(a) == 4 and a == tuple(sorted(a)) and a == parse_rows("random:4", 100, seed=5)
    assert a != parse_rows("random:4", 100, seed=6)
    for bad in ("last:0", "last:13", "every:x", "12", "3-1"):
        with pytest.raises(GoldenError, match="--rows"):
            parse_rows(bad, 12, flag="--rows", what="prefill")


@pytest.mark.parametrize("name, rows, chunk", [
    ("tiny", (0, 5, 6, 7, 11), 7), ("tiny", (), 4), ("tiny", (11,), 12),
    ("mixed", tuple(range(0, 40)) + (127, 128, 129, 200, 201, 202), 16),
    ("mixed", tuple(range(150, 203)), 203), ("mixed", (), 50)])
def test_rows_golden_holds_the_full_runs_bytes(tmp_path, full, name, rows, chunk):
    path = tmp_path / "rows.safetensors"
    write_golden(_plan(name, rows), path, chunk=chunk)
    part = assert_same_rows(full(name), path)
    cfg = preset(name)
    for i in range(cfg.n_layers):   # every layer's caches are there (the decode's start)
        assert f"step0.layers.{i}.state.window_kv" in part
        if cfg.is_kv_source(i):
            assert part[f"step0.layers.{i}.state.compress_kv"].shape == (
                RUNS[name][0] // cfg.ratio(i), cfg.head_dim)
    assert part["step0.layers.0.x"].shape[0] == len(rows)


@pytest.mark.parametrize("name", ["tiny", "mixed"])
def test_rows_golden_on_the_blas_tier(tmp_path, full, name):
    """The blas tier (the AVX2 machines' products and register tiles): the same bytes as its
    own full run."""
    path = tmp_path / "rows.safetensors"
    with use_backend("blas"):
        write_golden(_plan(name, (1, 2, 3, 9, 11) if name == "tiny" else (0, 64, 65, 190, 202)),
                     path, chunk=5)
    assert_same_rows(full(name, "blas"), path)


def test_random_rows_with_samples_are_the_full_runs(tmp_path, full):
    """--capture-rows at answered prefill rows keeps its samples; decode samples as usual."""
    rows = tuple(sorted(np.random.default_rng(1).choice(203, 17, replace=False).tolist()))
    plan = _plan("mixed", rows, capture="io", capture_rows=(rows[3], rows[9], 205))
    one = tmp_path / "full.safetensors"
    write_golden(_plan("mixed", None, capture="io", capture_rows=(rows[3], rows[9], 205)), one,
                 chunk=64)
    write_golden(plan, tmp_path / "rows.safetensors", chunk=8)
    part = assert_same_rows(one, tmp_path / "rows.safetensors")
    assert any(n.startswith("step0.") and ".sample." in n for n in part)


def test_sampled_rows_must_be_answered():
    with pytest.raises(GoldenError, match="not among --rows"):
        _plan("tiny", (1, 2), capture_rows=(3,))
    with pytest.raises(GoldenError, match="--rows: only a streamed run"):
        _plan("tiny", (1, 2), capture="all")


def test_interrupted_rows_run_resumes_to_the_same_bytes(tmp_path):
    plan = _plan("mixed", tuple(range(100, 140)) + (202,))
    write_golden(plan, tmp_path / "one.safetensors", chunk=16)
    seen = {"n": 0}

    def progress(n, where):
        if n and where.startswith("step 0 rows"):
            seen["n"] += 1
            if seen["n"] == 7:
                raise KeyboardInterrupt

    path = tmp_path / "two.safetensors"
    with pytest.raises(RunInterrupted):
        write_golden(plan, path, chunk=16, progress=progress, checkpoint_every=0)
    assert not path.exists()
    got = []
    write_golden(plan, path, chunk=16, resume=True, checkpoint_every=0,
                 progress=lambda n, where: got.append(n))
    assert sha(path) == sha(tmp_path / "one.safetensors")
    assert sum(got) == pytest.approx(plan.total_work)      # what was done, then the rest


def test_a_resumed_full_runs_progress_counts_the_plans_work(tmp_path):
    plan = _plan("tiny")
    path = tmp_path / "f.safetensors"
    calls = {"n": 0}

    def stop(n, where):
        calls["n"] += bool(n)
        if calls["n"] == 20:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        write_golden(plan, path, chunk=5, progress=stop, checkpoint_every=0)
    got = []
    write_golden(plan, path, chunk=5, resume=True, progress=lambda n, where: got.append(n))
    assert sum(got) == pytest.approx(plan.total_work)


def test_rows_on_two_workers_are_the_in_process_file(tmp_path):
    plan = _plan("mixed", (0, 1, 2, 50, 51, 150, 202))
    write_golden(plan, tmp_path / "one.safetensors", chunk=32)
    with Cluster(workers=2) as cluster:
        write_golden(plan, tmp_path / "two.safetensors", chunk=32, cluster=cluster)
    assert sha(tmp_path / "two.safetensors") == sha(tmp_path / "one.safetensors")


def test_progress_counts_the_plans_work(tmp_path):
    for rows in ((3, 4, 11), None):
        plan = _plan("tiny", rows)
        got = []
        write_golden(plan, tmp_path / f"{rows is None}.safetensors", chunk=5,
                     progress=lambda n, where: got.append(n))
        assert sum(got) == pytest.approx(plan.total_work)
    # Layer 20 of v41-flash at 1M positions, --rows last:256: the key side took 57 s, the 256
    # rows about 16 ms of indexer each (4 s): the queries are a few percent of the bar.
    cfg = preset("v41-flash")
    keys = GoldenPlan(cfg, (20,), 1048568, 8, capture="io", rows=()).total_work
    last = GoldenPlan(cfg, (20,), 1048568, 8, capture="io",
                      rows=tuple(range(1048312, 1048568))).total_work
    assert 0.03 < (last - keys) / last < 0.15


def _flip_index(path, name, row):
    """Change one compressed entry of an index row in place (a kernel's wrong selection)."""
    b = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", b[:8])[0]
    e = json.loads(b[8:8 + n])[name]
    width = e["shape"][1]
    at = 8 + n + e["data_offsets"][0] + 4 * (row * width + width - 1)
    v = int(np.frombuffer(bytes(b[at:at + 4]), np.int32)[0])
    b[at:at + 4] = np.int32(v + 1 if v >= 0 else 12).tobytes()
    open(path, "wb").write(bytes(b))


def test_compare_replay_and_testing_match_rows_by_position(tmp_path, full):
    rows_path = tmp_path / "rows.safetensors"
    write_golden(_plan("mixed", (10, 11, 150, 202)), rows_path, chunk=64)
    whole = full("mixed")
    assert compare_files(rows_path, whole).ok                       # rows golden first
    assert not compare_files(whole, rows_path).ok                   # rows the candidate lacks
    assert compare_files(whole, rows_path, subset=True).ok
    assert replay(rows_path).ok
    assert_candidate_file(whole, rows_path)
    with GoldenFile(rows_path) as f:
        got = f.get("step0.layers.5.idx")
    assert_golden_tensor(rows_path, "step0.layers.5.idx", got)
    _flip_index(rows_path, "step0.layers.5.idx", 2)
    report = compare_files(whole, rows_path, subset=True)
    assert not report.ok
    wrong = next(r for r in report.results if r.name == "step0.layers.5.idx")
    assert wrong.first_rows == [150] and wrong.reasons[0].startswith("row 150:")   # its position
    assert not replay(rows_path).ok
    with pytest.raises(AssertionError):
        assert_golden_tensor(whole, "step0.layers.5.idx",
                             np.asarray(load_golden(whole)[1]["step0.layers.5.idx"])[::-1])


def test_a_rows_goldens_replay_costs_what_making_it_cost(tmp_path):
    # The replay makes the golden again with its unanswered rows' key side only: its progress
    # counts the rows plan's work, well below the full run's; and it still catches a wrong row.
    plan = _plan("mixed", (10, 11, 150, 202))
    path = tmp_path / "rows.safetensors"
    write_golden(plan, path, chunk=64)
    got = []
    report = replay(path, progress=lambda n, where: got.append(n))
    assert report.ok and report.candidate == "replay"
    assert sum(got) == pytest.approx(plan.total_work)
    assert plan.total_work < 0.5 * _plan("mixed").total_work
    _flip_index(path, "step0.layers.5.idx", 3)
    wrong = replay(path).failures
    assert "step0.layers.5.idx" in [r.name for r in wrong]
    assert all(r.name.startswith("step0.layers.5.") for r in wrong)


def test_compare_says_where_by_position(tmp_path, full):
    """A rows golden's float row over tolerance is reported at its prefill position."""
    rows_path = tmp_path / "rows.safetensors"
    write_golden(_plan("mixed", (10, 11, 150, 202)), rows_path, chunk=64)
    _scale_float(rows_path, "step0.layers.5.out", row=3, col=7)
    report = compare_files(full("mixed"), rows_path, subset=True)
    bad = next(r for r in report.results if r.name == "step0.layers.5.out")
    assert not bad.ok and bad.first_rows == [202]
    assert bad.row_worst[0]["row"] == 202 and bad.row_worst[0]["position"] == [202, 7]
    back = next(r for r in compare_files(rows_path, full("mixed")).results
                if r.name == "step0.layers.5.out")
    assert back.first_rows == [202]


def test_a_full_goldens_rows_are_read_alone(tmp_path, full, monkeypatch):
    """Compared with a rows golden, a full golden's step-0 tensors are read at the rows' positions
    only (a 1M-position golden's are 10 GB each), and those rows are the tensor's own."""
    rows_path = tmp_path / "rows.safetensors"
    write_golden(_plan("mixed", (10, 11, 150, 202)), rows_path, chunk=64)
    whole = str(full("mixed"))
    with GoldenFile(whole) as f:
        for name in f.names:
            if name.startswith("step0.") and name.split(".", 3)[3] in PER_ROW:
                assert f.get_rows(name, [10, 11, 150, 202]).tobytes() == \
                    f.get(name)[[10, 11, 150, 202]].tobytes(), name
    loaded = []
    get = GoldenFile.get
    monkeypatch.setattr(GoldenFile, "get", lambda self, name: loaded.append((self.path, name))
                        or get(self, name))
    assert compare_files(rows_path, whole).ok
    whole_rows = [n for p, n in loaded if p == whole and n.startswith("step0.")
                  and n.split(".", 3)[3] in PER_ROW]
    assert not whole_rows, whole_rows[:3]


def _scale_float(path, name, row, col):
    """Double one bf16 element of a [rows, dim] tensor in place (its exponent + 1)."""
    b = bytearray(open(path, "rb").read())
    n = struct.unpack("<Q", b[:8])[0]
    e = json.loads(b[8:8 + n])[name]
    assert e["dtype"] == "BF16"
    at = 8 + n + e["data_offsets"][0] + 2 * (row * e["shape"][1] + col)
    v = int(np.frombuffer(bytes(b[at:at + 2]), np.uint16)[0])
    assert 0 < v & 0x7F80 < 0x7F00, "a normal value, doubled without overflow"
    b[at:at + 2] = np.uint16(v + 0x80).tobytes()
    open(path, "wb").write(bytes(b))


def test_cli_rows_and_plot(tmp_path, full, capsys):
    out = tmp_path / "r.safetensors"
    assert main(["golden", "--preset", "tiny", "--prefill", "12", "--decode", "5", "--seed", "3",
                 "--capture", "caches", "--rows", "last:4", "--chunk", "7", "--out", str(out),
                 "--quiet"]) == 0
    assert_same_rows(full("tiny"), out)
    png = tmp_path / "p.png"
    assert main(["compare", str(full("tiny")), str(out), "--subset", "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    assert main(["golden", "--preset", "tiny", "--capture", "all", "--rows", "none",
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "--rows: only a streamed run" in capsys.readouterr().err


def test_rows_with_a_batch_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "b.safetensors"
    assert main(["golden", "--preset", "tiny", "--capture", "io", "--rows", "last:2",
                 "--batch", "2", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rows: a batch (--batch > 1) answers every prefill row" in err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_a_batchs_caches_are_its_all_captures_states(tmp_path):
    # --capture caches with --batch 2: each sequence's caches after the prefill, [2, ...], are
    # the step-0 states and shared slots a --capture all batch golden records.
    cfg = preset("tiny")
    paths = {}
    for capture in ("caches", "all"):
        paths[capture] = tmp_path / f"{capture}.safetensors"
        write_golden(GoldenPlan(cfg, tuple(range(cfg.n_layers)), 11, 2, seed=3, capture=capture,
                                preset="tiny", batch=2), paths[capture])
    with GoldenFile(paths["caches"]) as c, GoldenFile(paths["all"]) as a:
        caches = [n for n in c.names if ".state." in n]
        assert {n.rsplit(".", 1)[1] for n in caches} == {
            "window_kv", "compress_kv", "index_k", "kv_state", "score_state"}
        for name in caches:
            i = int(name.split(".")[2])
            what = name.split(".", 3)[3]
            if what in ("state.compress_kv", "state.index_k"):
                want = a.get(f"step0.layers.{i}.shared.{what[len('state.'):]}")
            else:
                want = a.get(name)
            got = c.get(name)
            assert got.shape[0] == 2 and got.shape == want.shape
            assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert replay(paths["caches"]).ok


def test_rows_from_an_inputs_file_are_that_files_full_runs_rows(tmp_path, full):
    # --inputs (here the generator's inputs of another seed) feeds a rows run's key side and
    # its answered tiles alike: the rows golden is the full golden of the same file at its
    # rows; such a golden holds too few inputs to be replayed, which says so in one line.
    from test_inputs_file import write_inputs
    from ds41numba.golden.inputs_file import InputsFile
    cfg = preset("tiny")
    layers, (prefill, decode) = tuple(range(cfg.n_layers)), RUNS["tiny"]
    inputs = write_inputs(tmp_path / "in.safetensors", cfg, layers, prefill, decode, seed=4)
    paths = {}
    for rows in (None, (0, 5, 6, 11)):
        paths[rows] = tmp_path / f"{'full' if rows is None else 'rows'}.safetensors"
        write_golden(GoldenPlan(cfg, layers, prefill, decode, seed=3, capture="caches",
                                preset="tiny", rows=rows,
                                inputs=InputsFile(inputs, cfg, layers, prefill + decode)),
                     paths[rows], chunk=5)
    part = assert_same_rows(paths[None], paths[(0, 5, 6, 11)])
    _, generated = load_golden(full("tiny"))
    assert not np.array_equal(part["step1.layers.0.x"], generated["step1.layers.0.x"])
    with pytest.raises(GoldenError, match="cannot be replayed"):
        replay(paths[(0, 5, 6, 11)])
