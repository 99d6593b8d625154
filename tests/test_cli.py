"""The ``ds41numba`` command line, run in-process through ``main(argv)`` (and once for real)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from helpers import hf_config
from ds41numba import golden
from ds41numba.cli import main, parse_layers, parse_rows
from ds41numba.config import PRESETS, preset
from ds41numba.stack import AttentionStack

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parent.parent


def _golden(tmp_path, name="g.safetensors", *args):
    out = tmp_path / name
    assert main(["golden", "--quiet", "--out", str(out), *args]) == 0
    return out


def _metadata(path):
    with safe_open(path, framework="np") as f:
        return f.metadata()


def _without_scores(names):
    """A golden's tensor names less the score captures (which the reference goldens lack)."""
    return [n for n in names if n.rsplit(".", 1)[-1] not in golden.SCORE_CAPTURES]


def _rewrite(src, dst, change):
    """Copy a golden with ``change(tensors)`` applied, metadata kept."""
    tensors = dict(load_file(src))
    change(tensors)
    save_file(tensors, dst, metadata=_metadata(src))


# --------------------------------------------------------------------------- golden


def test_default_command_writes_the_tiny_golden(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["golden", "--quiet"]) == 0
    path = tmp_path / "ds41numba-golden-tiny.safetensors"
    assert str(path) in capsys.readouterr().out
    meta = _metadata(path)
    assert meta["preset"] == "tiny" and meta["capture"] == "all"
    assert json.loads(meta["config"]) == preset("tiny").to_dict()
    assert (meta["prefill"], meta["decode"], json.loads(meta["layers"])) == ("12", "40", list(range(6)))
    assert meta["generator"] == golden.GENERATOR and "splitmix64" in meta["generator_spec"].lower()
    for key in ("format", "format_version", "ds41numba_version", "seed"):
        assert meta[key]
    # The same tensors, by name, as the reference golden of the same run, plus the scores
    # behind every index source's selection.
    with golden.GoldenFile(path) as mine, golden.GoldenFile(DATA / "tiny.npz") as ref:
        assert _without_scores(mine.names) == ref.names
    assert os.listdir(tmp_path) == [path.name]


def test_storage_dtypes(tmp_path):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "5", "--decode", "2")
    t = load_file(path)
    assert t["layers.2.attn.wq_a.weight"].dtype == ml_dtypes.bfloat16
    assert t["layers.2.attn.attn_sink"].dtype == np.float32
    assert t["layers.2.attn.compressor.wgate.weight"].dtype == np.float32
    assert t["layers.4.attn.compressor.wkv.weight"].dtype == ml_dtypes.bfloat16
    assert t["step0.layers.2.x"].dtype == ml_dtypes.bfloat16
    assert t["step1.layers.4.idx"].dtype == np.int32
    assert t["step1.layers.4.shared.topk_idxs"].dtype == np.int32
    assert t["step1.layers.4.shared.candidates"].dtype == np.uint8
    assert t["step1.layers.2.state.score_state"].dtype == np.float32
    assert t["step1.layers.2.out"].dtype == ml_dtypes.bfloat16
    # Weights and inputs are the documented generator's.
    x = golden.make_input("step1.layers.3.x", (1, 64), seed=0)
    assert np.array_equal(t["step1.layers.3.x"].astype(np.float32), x)


@pytest.mark.parametrize("name, args", [
    ("tiny", ["--preset", "tiny", "--prefill", "9", "--decode", "7", "--seed", "3"]),
    ("mixed", ["--preset", "mixed", "--prefill", "37", "--decode", "12", "--seed", "4"]),
])
def test_golden_then_replay_agrees_exactly(tmp_path, capsys, name, args):
    path = _golden(tmp_path, f"{name}.safetensors", *args)
    capsys.readouterr()
    assert main(["replay", "--quiet", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert s["ok"] and s["index_rows_differ"] == 0 and s["bit_identical_fraction"] == 1.0
    assert s["compared"] > 0 and s["only_in_golden"] == 0


def test_mixed_default_run_has_the_reference_layout(tmp_path):
    path = _golden(tmp_path, "mixed.safetensors", "--preset", "mixed")
    with golden.GoldenFile(path) as mine, golden.GoldenFile(DATA / "mixed.npz") as ref:
        assert _without_scores(mine.names) == ref.names
        for name in ("step0.layers.5.shared.candidates", "step7.layers.3.shared.compress_kv",
                     "step0.layers.1.index_score", "step3.layers.6.idx"):
            assert mine.get(name).shape == ref.get(name).shape, name


def test_io_capture_matches_the_full_capture(tmp_path):
    args = ["--preset", "tiny", "--prefill", "10", "--decode", "5"]
    full = load_file(_golden(tmp_path, "all.safetensors", *args))
    io_path = _golden(tmp_path, "io.safetensors", *args, "--capture", "io")
    io = load_file(io_path)
    whats = {n.split(".", 3)[3] for n in io if n.startswith("step")}
    assert whats == {"x", "out", "idx", "shared.topk_idxs", *golden.SCORE_CAPTURES}
    for name, value in io.items():
        assert np.array_equal(value.view(np.uint8), full[name].view(np.uint8)), name
    assert main(["replay", "--quiet", str(io_path)]) == 0


def test_layer_subset(tmp_path):
    # Layer 2 (ratio 2) needs key owner 4 too: on odd steps it scores against layer 4's keys.
    path = _golden(tmp_path, "g.safetensors", "--layers", "0,2-4", "--prefill", "6", "--decode", "3")
    assert json.loads(_metadata(path)["layers"]) == [0, 2, 3, 4]
    names = load_file(path)
    assert {n.split(".")[1 if n.startswith("layers") else 2] for n in names} == {"0", "2", "3", "4"}
    assert main(["replay", "--quiet", str(path)]) == 0


def test_hf_config_json(tmp_path):
    hf = hf_config(PRESETS["tiny"])
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(hf))
    path = _golden(tmp_path, "g.safetensors", "--config", str(cfg), "--prefill", "4", "--decode", "2")
    meta = _metadata(path)
    assert json.loads(meta["config"]) == preset("tiny").to_dict() and meta["preset"] == ""
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(PRESETS["tiny"]))
    assert main(["golden", "--quiet", "--config", str(ref), "--prefill", "4", "--decode", "2",
                 "--out", str(tmp_path / "ref.safetensors")]) == 0


def test_default_output_name_for_a_config_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "my-stack.json").write_text(json.dumps(PRESETS["tiny"]))
    monkeypatch.chdir(tmp_path)
    assert main(["golden", "--quiet", "--config", "my-stack.json", "--prefill", "2", "--decode", "0"]) == 0
    assert (tmp_path / "ds41numba-golden-my-stack.safetensors").exists()


# --------------------------------------------------------------------------- arguments


def test_parse_layers():
    assert parse_layers("20", 43) == (20,)
    assert parse_layers("2,3,20-24", 43) == (2, 3, 20, 21, 22, 23, 24)
    assert parse_layers(" 5 , 1-2,2", 6) == (1, 2, 5)
    for bad, msg in [("a", "not a layer"), ("3-1", "backwards"), ("50", "not a layer of this config"),
                     ("1,,2", "not a layer"), ("-1", "not a layer")]:
        with pytest.raises(golden.GoldenError, match=msg):
            parse_layers(bad, 43)


def test_version(capsys):
    from ds41numba import __version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ds41numba {__version__}\n"


def test_progress_says_compiling_until_the_first_pieces_end_and_ends_at_100(capsys):
    """The first piece (the prefill) and the first decode step: no rate, "compiling"; the ETA
    comes from the steps after them; the last drawing is 100%."""
    import time
    from ds41numba.cli import _progress
    with _progress(40, False, "golden") as report:
        report(0, "step 0 layer 0")
        time.sleep(2.1)                       # past the bar's delay: the first piece is slow
        report(10, "step 0 layer 0")
        for s in (1, 2, 3):
            report(0, f"step {s} layer 0")
            report(10, f"step {s} layer 0")
    frames = [f for f in capsys.readouterr().err.split("\r") if "golden" in f]
    assert "compiling, step 0 layer 0" in frames[0] and "<" not in frames[0]
    assert "compiling, step 1 layer 0" in frames[1]
    assert "compiling" not in frames[-1] and " 100%|" in frames[-1]


# --------------------------------------------------------------------------- errors: exit 2, one line


@pytest.mark.parametrize("argv, msg", [
    ([], "choose a command"),
    (["golden", "--prefill", "abc"], "invalid int value"),
    (["golden", "--prefill", "0"], "--prefill must be at least 1"),
    (["golden", "--decode", "-2"], "--decode must be at least 0"),
    (["golden", "--bogus"], "unrecognized arguments"),
    (["golden", "--preset", "huge"], "unknown preset 'huge'"),
    (["golden", "--preset", "tiny", "--config", "x.json"], "not allowed with"),
    (["golden", "--config", "does-not-exist.json"], "cannot read"),
    (["golden", "--capture", "some"], "invalid choice"),
    (["golden", "--layers", "1-x"], "--layers"),
    (["golden", "--layers", "5"], "lacks layer 4 (layer 5's kv source"),
    (["golden", "--preset", "v41-flash", "--layers", "24"], "lacks layer 20 (layer 24's kv source"),
    (["golden", "--preset", "v41-flash", "--layers", "5"],
     "lacks layer 2 (layer 5's kv source, layer 5's index source); layer 8 (layer 2's key owner "
     "it may score against); layer 14 (layer 2's key owner it may score against); layer 20 "
     "(layer 2's key owner it may score against); every source is needed, e.g. --layers 2,5,8,14,20"),
    (["golden", "--prefill", "60", "--decode", "10"], "max_seq_len"),
    (["golden", "--out", "no/such/dir/g.safetensors"], "does not exist"),
    (["replay", "missing.safetensors"], "cannot read"),
    (["compare", "a.safetensors"], "required"),
    (["golden", "--capture-rows", "5-2"], "runs backwards"),
    (["golden", "--capture-rows", "60"], "past the run's 52 tokens"),
    (["golden", "--capture-rows", "random:0"], "random:0 needs 1 .. 52"),
    (["golden", "--profile", "flat"], "invalid choice"),
    (["compare", "--index-tolerance", "x", "a", "b"], "invalid float value"),
])
def test_bad_usage_exits_2_with_one_line(tmp_path, monkeypatch, capsys, argv, msg):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(tmp_path) == []


def test_unreadable_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["golden", "--config", str(bad), "--out", str(tmp_path / "g.safetensors")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    incomplete = tmp_path / "incomplete.json"
    incomplete.write_text(json.dumps({"dim": 64}))
    assert main(["golden", "--config", str(incomplete), "--out", str(tmp_path / "g.safetensors")]) == 2
    assert "missing field" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad.json", "incomplete.json"]


def test_existing_output_needs_force(tmp_path, capsys):
    out = tmp_path / "g.safetensors"
    out.write_bytes(b"precious")
    assert main(["golden", "--quiet", "--prefill", "3", "--decode", "1", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert main(["golden", "--quiet", "--prefill", "3", "--decode", "1", "--out", str(out), "--force"]) == 0
    assert _metadata(out)["format"] == golden.FORMAT


def test_run_that_cannot_fit_in_memory_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(golden.run, "_available_bytes", lambda: 1000)
    assert main(["golden", "--quiet", "--out", str(tmp_path / "g.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "needs about" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- interruption


def _interrupt_forward(monkeypatch, after, action):
    real = AttentionStack.forward
    calls = {"n": 0}

    def forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] > after:
            action()
        return real(self, *a, **kw)

    monkeypatch.setattr(AttentionStack, "forward", forward)


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


def test_ctrl_c_leaves_no_file(tmp_path, monkeypatch, capsys):
    _interrupt_forward(monkeypatch, 20, _raise_keyboard_interrupt)
    assert main(["golden", "--quiet", "--out", str(tmp_path / "g.safetensors")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_sigterm_leaves_no_file(tmp_path, monkeypatch):
    _interrupt_forward(monkeypatch, 20, lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert main(["golden", "--quiet", "--out", str(tmp_path / "g.safetensors")]) == 128 + signal.SIGTERM
    assert os.listdir(tmp_path) == []


def test_interrupt_while_writing_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.numpy

    real = safetensors.numpy.save_file

    def write_then_interrupt(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", write_then_interrupt)
    assert main(["golden", "--quiet", "--prefill", "3", "--decode", "1",
                 "--out", str(tmp_path / "g.safetensors")]) == 130
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- replay and compare


def test_replay_detects_a_tampered_capture(tmp_path, capsys):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "6", "--decode", "2")

    def tamper(t):
        idx = t["step1.layers.4.idx"].copy()
        idx[0, -1] = idx[0, -1] + 1
        t["step1.layers.4.idx"] = idx

    bad = tmp_path / "bad.safetensors"
    _rewrite(path, bad, tamper)
    capsys.readouterr()
    assert main(["replay", "--quiet", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "step1.layers.4.idx" in out and "1 of 1 rows wrong" in out and "FAIL" in out
    assert main(["replay", "--quiet", "--exact-index", str(bad)]) == 1
    assert "1 of 1 rows differ" in capsys.readouterr().out


def test_replay_of_a_reference_golden():
    assert main(["replay", "--quiet", str(DATA / "tiny.npz")]) == 0


def test_compare_self_passes_and_perturbed_copy_fails(tmp_path, capsys):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "6", "--decode", "2")
    capsys.readouterr()
    assert main(["compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:") and len(out.splitlines()) == 1

    def perturb(t):
        o = t["step2.layers.3.out"].astype(np.float32)
        o[0, 5] += 0.5
        t["step2.layers.3.out"] = o.astype(ml_dtypes.bfloat16)
        k = t["step0.layers.2.shared.topk_idxs"].copy()
        k[3] = -1
        t["step0.layers.2.shared.topk_idxs"] = k
        del t["step1.layers.0.q"]

    bad = tmp_path / "bad.safetensors"
    _rewrite(path, bad, perturb)
    assert main(["compare", str(path), str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(l.startswith("step2.layers.3.out [1, 64]:") and "> tolerance" in l for l in lines)
    assert any(l.startswith("step0.layers.2.shared.topk_idxs") and "1 of 6 rows wrong (row 3: "
               "2 -1 where the golden has a position" in l for l in lines)
    assert f"missing from {bad}: step1.layers.0.q" in lines
    assert "  1 row over tolerance; worst element of each (row: position got want steps):" in lines
    assert any(l.startswith("    row 0: [0, 5] got ") for l in lines)
    assert lines[-1].startswith("FAIL (2 tensors disagree, 1 missing): ")
    assert main(["compare", "--json", str(path), str(bad)]) == 1
    report = json.loads(capsys.readouterr().out)
    s = report["summary"]
    assert (s["failing_tensors"], s["disagreeing_tensors"], s["missing_tensors"]) == (3, 2, 1)
    assert not s["ok"]
    bad_out = next(r for r in report["tensors"] if r["name"] == "step2.layers.3.out")
    assert bad_out["kind"] == "float" and bad_out["over_tolerance"] == 1
    assert bad_out["first_rows"] == [0] and bad_out["rows_differ"] == 1
    worst = bad_out["row_worst"][0]
    assert worst["position"] == [0, 5] and worst["got"] - worst["want"] == pytest.approx(0.5, abs=0.01)
    assert worst["steps"] > 1
    assert 0.9 < bad_out["cosine"] < 1 and bad_out["max_abs_diff"] == pytest.approx(0.5, abs=0.01)
    assert bad_out["max_rel_diff"] == pytest.approx(0.5 / abs(worst["want"]), rel=0.05)
    same = next(r for r in report["tensors"] if r["name"] == "step2.layers.2.out")
    assert (same["cosine"], same["max_rel_diff"], same["first_rows"]) == (1.0, 0.0, [])


@pytest.mark.parametrize("drop, verdict", [
    (1, "FAIL (1 tensor missing)"), (3, "FAIL (3 tensors missing)")])
def test_compare_counts_missing_tensors_apart(tmp_path, capsys, drop, verdict):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "4", "--decode", "1")
    names = [f"step1.layers.{i}.q" for i in range(drop)]
    bad = tmp_path / "bad.safetensors"
    _rewrite(path, bad, lambda t: [t.pop(n) for n in names])
    capsys.readouterr()
    assert main(["compare", str(path), str(bad)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith(verdict + ": ")
    assert main(["compare", "--subset", str(path), str(bad)]) == 0


def test_compare_accepts_reference_npz(tmp_path, capsys):
    npz = str(DATA / "tiny.npz")
    assert main(["compare", npz, npz]) == 0
    assert "OK" in capsys.readouterr().out
    # npz on one side, safetensors on the other: the replayed reference's captures in our format.
    with golden.GoldenFile(npz) as ref:
        tensors = {n: ref.get(n) for n in ref.names if n.startswith("step1.")}
    ours = tmp_path / "step1.safetensors"
    save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, ours)
    assert main(["compare", "--subset", npz, str(ours)]) == 0
    assert main(["compare", npz, str(ours)]) == 1


def test_compare_unreadable_file_exits_2(tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\xff" * 16)
    assert main(["compare", str(junk), str(junk)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["tiny", "mixed", "edge_prefill1", "edge_prefill_window",
                                  "edge_r128_short", "edge_r128_groups", "prod_dev"])
def test_reference_goldens_replay_exactly_under_exact_index(name, capsys):
    assert main(["replay", "--quiet", "--exact-index", "--json", str(DATA / f"{name}.npz")]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    assert s["index_rule"] == "exact" and s["index_rows_differ"] == 0 and s["ok"]


def test_parse_rows():
    assert parse_rows("0,5, 7-9,5", 20) == (0, 5, 7, 8, 9)
    picked = parse_rows("random:6", 1000, seed=3)
    assert len(picked) == 6 and picked == parse_rows("random:6", 1000, seed=3)
    assert picked != parse_rows("random:6", 1000, seed=4) and all(0 <= p < 1000 for p in picked)
    for bad, msg in [("x", "not a position"), ("3-1", "backwards"), ("20", "past the run"),
                     ("random:21", "random:21 needs")]:
        with pytest.raises(golden.GoldenError, match=msg):
            parse_rows(bad, 20)


def test_capture_rows_and_profile_are_recorded_and_replay(tmp_path):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "9", "--decode", "3", "--capture", "io",
                   "--capture-rows", "random:4", "--seed", "2", "--profile", "ties")
    meta = _metadata(path)
    rows = json.loads(meta["capture_rows"])
    assert meta["profile"] == "ties" and rows == list(parse_rows("random:4", 12, 2))
    t = load_file(path)
    prefill_rows = [r for r in rows if r < 9]
    assert t["step0.layers.4.sample.rows"].tolist() == prefill_rows
    assert t["step0.layers.4.sample.q"].shape == (len(prefill_rows), 4, 32)
    x = t["step0.layers.4.x"].astype(np.float32)
    assert np.array_equal(x, golden.make_input("step0.layers.4.x", (9, 64), 2, "ties"))
    assert main(["replay", "--quiet", "--exact-index", str(path)]) == 0


def test_compare_plot_writes_a_png(tmp_path, capsys):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "12", "--decode", "3")

    def perturb(t):
        o = t["step0.layers.2.out"].astype(np.float32)
        o[5:8] += 0.5                         # a stripe of bad rows
        t["step0.layers.2.out"] = o.astype(ml_dtypes.bfloat16)
        k = t["step0.layers.4.shared.topk_idxs"].copy()
        k[9, 0] = k[9, 1]
        t["step0.layers.4.shared.topk_idxs"] = k

    bad = tmp_path / "bad.safetensors"
    _rewrite(path, bad, perturb)
    png = tmp_path / "where.png"
    capsys.readouterr()
    assert main(["compare", str(path), str(bad), "--plot", str(png)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("FAIL") and out[-1] == f"wrote {png}  (where {bad} differs from {path})"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image
    with Image.open(png) as im:
        im.verify()
    assert main(["compare", str(path), str(path), "--plot", str(tmp_path / "ok.png")]) == 0
    assert (tmp_path / "ok.png").exists()
    capsys.readouterr()
    assert main(["compare", str(path), str(bad), "--plot", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def _bad_candidates(tmp_path, path):
    """(name, file) of candidates that cannot be compared with the golden ``path``."""
    data = path.read_bytes()
    out = []
    trunc = tmp_path / "truncated.safetensors"
    trunc.write_bytes(data[: len(data) // 2])
    out.append(("truncated", trunc))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(data[:8] + b"{not json" + data[17:])
    out.append(("corrupt", corrupt))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"not": "a golden"}))
    out.append(("another format", other))
    t = load_file(path)
    shape = tmp_path / "shape.safetensors"
    save_file({"step0.layers.2.out": t["step0.layers.2.out"][:3]}, shape)
    out.append(("wrong shape", shape))
    nan_idx = tmp_path / "nan.npz"
    idx = t["step0.layers.4.idx"].astype(np.float32)
    idx[2, 3] = np.nan
    np.savez(nan_idx, **{"step0.layers.4.idx": idx})
    out.append(("NaN index", nan_idx))
    strings = tmp_path / "strings.npz"
    np.savez(strings, **{"step0.layers.2.out": np.full(t["step0.layers.2.out"].shape, "x")})
    out.append(("wrong dtype", strings))
    return out


def test_bad_candidates_are_one_line_and_exit_2(tmp_path, capsys):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "6", "--decode", "1")
    for what, cand in _bad_candidates(tmp_path, path):
        capsys.readouterr()
        assert main(["compare", "--subset", str(path), str(cand)]) == 2, what
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("ds41numba: error:"), (what, err)
        assert "Traceback" not in err, what


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    path = _golden(tmp_path, "g.safetensors", "--prefill", "12", "--decode", "6")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    run = subprocess.run(f"{sys.executable} -m ds41numba compare --json {path} {path} | head -1",
                         shell=True, env=env, capture_output=True, text=True, timeout=600)
    assert run.stdout.strip() == "{" and run.stderr == "", run.stderr


# --------------------------------------------------------------------------- the real command


def test_python_dash_m_smoke(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    out = tmp_path / "g.safetensors"
    run = subprocess.run([sys.executable, "-m", "ds41numba", "golden", "--prefill", "4", "--decode", "2",
                          "--quiet", "--out", str(out)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert str(out) in run.stdout and run.stderr == ""
    run = subprocess.run([sys.executable, "-m", "ds41numba", "golden", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "--force" in run.stderr


PRODUCTION = [
    # (reference file, the run that made it (as the reference recorded it), index rows and float
    # elements the comparison covers)
    ("v41flash_L20_ref.safetensors",
     ["--layers", "20", "--prefill", "2048", "--decode", "3", "--seed", "11"], 4102, 10_501_120),
    ("v41flash_kv_sources_ref.safetensors",
     ["--layers", "2,8,14,20", "--prefill", "1024", "--decode", "4", "--seed", "13"], 8224,
     21_053_440),
]


@pytest.mark.parametrize("ref, run, rows, floats", PRODUCTION, ids=[p[0] for p in PRODUCTION])
def test_production_references_through_the_cli(tmp_path, capsys, ref, run, rows, floats):
    """The reference at V4.1-Flash's real dimensions (inner dimensions 1280 to 8192), run on this
    package's generator (the golden README's commands): every index row identical and every
    float bit-identical (`out` of the prefill and of each decode step, the caches and window
    ring the file records), with the reference's own product orders (docs/exactness.md).
    Nothing here is statistical any more; before those orders: 84.9% / 48.7% and 98.4% / 67.0%.
    The files' ``sample.*`` tensors (q, o, index scores of a few rows) are not in an io capture
    and are checked stage by stage in test_attention / test_indexer."""
    mine = _golden(tmp_path, "mine.safetensors", "--preset", "v41-flash", *run, "--capture", "io")
    capsys.readouterr()
    assert main(["compare", str(DATA / ref), str(mine), "--subset", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["ok"] and summary["failing_tensors"] == 0 and summary["shape_mismatches"] == 0
    assert summary["index_rows"] == rows and summary["index_rows_differ"] == 0
    assert summary["float_elements"] == floats
    assert summary["bit_identical_fraction"] == 1.0 and summary["max_bf16_steps"] == 0


def test_chunk_option(tmp_path, capsys):
    """--chunk changes how the prefill runs, never the file; a chunk under 1 row is refused."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["golden", "--quiet", "--prefill", "9", "--decode", "2", "--capture", "io",
                 "--out", str(a)]) == 0
    assert main(["golden", "--quiet", "--prefill", "9", "--decode", "2", "--capture", "io",
                 "--chunk", "2", "--out", str(b)]) == 0
    assert a.read_bytes() == b.read_bytes()
    capsys.readouterr()
    assert main(["golden", "--quiet", "--chunk", "0", "--out", str(tmp_path / "c.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "--chunk" in err and len(err.strip().splitlines()) == 1


def test_chunk_with_scores_samples_and_ties(tmp_path, capsys):
    """--chunk with --capture-rows and --profile ties: the same file for any chunk, holding
    the recorded scores and the samples, and it replays."""
    files = []
    for chunk in ("1", "4", "4096"):
        path = tmp_path / f"g{chunk}.safetensors"
        assert main(["golden", "--quiet", "--prefill", "9", "--decode", "2", "--capture", "io",
                     "--capture-rows", "0,4-5,10", "--profile", "ties", "--chunk", chunk,
                     "--out", str(path)]) == 0
        files.append(path.read_bytes())
    assert files[0] == files[1] == files[2]
    names = set(golden.load_golden(str(path))[1])
    assert any(n.endswith(".topk_scores") for n in names)
    assert "step0.layers.0.sample.rows" in names and "step2.layers.0.sample.q" in names
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0


def test_a_small_run_runs_on_the_blas_tier_a_production_layer_on_this_cpus(tmp_path, monkeypatch):
    """``golden`` and ``replay`` of the built-in default (4e6 multiply-adds of products) and the
    tiny edge-case suite compile ahead and run on the blas tier, which compiles fastest and
    gives the same bits; a production layer at 2,048 tokens (3e11) on this CPU's own tier; the
    tier is this CPU's again after."""
    from ds41numba import cli
    from ds41numba.numerics import backend
    own = backend()
    made = _golden(tmp_path)
    tiers = []
    monkeypatch.setattr(cli, "compile_ahead", lambda quiet: tiers.append(("compile", backend())))

    def write(plan, out, **kw):
        tiers.append(("run", backend()))
        return {"path": out, "tensors": 0, "bytes": 0, "seconds": 0.0}

    class Agreed:
        ok = True
        table = text = lambda self: ""

    monkeypatch.setattr(cli.golden, "write_golden", write)
    monkeypatch.setattr(cli.golden, "replay", lambda *a, **kw: tiers.append(("run", backend()))
                        or Agreed())
    from ds41numba.golden import suite
    monkeypatch.setattr(suite, "write_suite", lambda *a, **kw: tiers.append(("run", backend()))
                        or {"cases": [], "not_built": []})
    assert main(["golden", "--quiet", "--out", str(tmp_path / "a.safetensors")]) == 0
    assert main(["replay", "--quiet", str(made)]) == 0
    assert main(["suite", "--quiet", "--preset", "tiny", "--out", str(tmp_path / "s")]) == 0
    assert tiers == [("compile", "blas"), ("run", "blas")] * 3 and backend() == own
    tiers.clear()
    assert main(["golden", "--quiet", "--preset", "v41-flash", "--layers", "20", "--prefill",
                 "2048", "--decode", "3", "--out", str(tmp_path / "b.safetensors")]) == 0
    assert tiers == [("compile", own), ("run", own)]


def test_the_products_of_the_default_golden_in_multiply_adds():
    """tiny: every layer's wq_a 16x64, wq_b 128x16, wkv 32x64, wo_a 32x64, wo_b 64x32 (9,216);
    kv sources 2 and 4 a compressor wkv 32x64 (and wgate 32x64 at ratio 2: layer 2); index
    sources 2, 4, 5 an indexer wq_b 64x16 and weights_proj 2x64 (and wk 32x32 at 2 and 4): 66,944
    a token for 52 tokens, and 52**2 / 2r scores of 2 heads x 32 at ratio 2 (layer 2) and 1
    (layers 4, 5)."""
    per_token = 9216 * 6 + 2048 * 2 + 2048 + (1024 + 128) * 3 + 1024 * 2
    scores = 52 * 52 / 4 * 64 + 2 * (52 * 52 / 2 * 64)
    assert per_token == 66944
    assert golden.product_multiply_adds(preset("tiny"), range(6), 52) == 52 * per_token + scores
