"""Resumable streamed goldens (``--resume``) and a failing disk: an interrupted run continues
from its checkpoint to the uninterrupted run's bytes; leftovers are never reused silently; an
OS error is one line, exit 2, no file under the target name, the checkpoint kept."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ds41numba import cli, preset
from ds41numba.cli import main
from ds41numba.golden import (Checkpoint, GoldenPlan, RunInterrupted, checkpoint_dir, make_input,
                              make_weights, partial_path, run_pieces, write_golden)
from ds41numba.golden.checkpoint import run_identity
from ds41numba.golden.generator import GeneratedWeights
from ds41numba.stack import AttentionStack, weight_specs


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _plan(name="mixed", prefill=203, decode=4, rows=(5, 100, 204), seed=3):
    cfg = preset(name)
    return GoldenPlan(cfg, tuple(range(cfg.n_layers)), prefill, decode, seed=seed, capture="io",
                      preset=name, capture_rows=rows)


def _stop_after(n, action=None):
    """A progress callback that calls ``action`` (default: raise KeyboardInterrupt) once ``n``
    forwards have run."""
    done = {"n": 0}

    def progress(tokens, where):
        if tokens:
            done["n"] += 1
            if done["n"] == n:
                if action is None:
                    raise KeyboardInterrupt
                action()
    return progress


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted mixed run (chunk 7: chunks split the ratio-4 and -128 groups)."""
    path = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    write_golden(_plan(), path, chunk=7)
    return sha(path)


# mixed has 8 layers (ratios 0, 4, 4, 16, 16, 1, 1, 1) and 29 chunks of 7 rows, which split its
# compression groups: 232 prefill forwards, then 8 per decode step. Interrupted at the first
# forward, mid-prefill, at the prefill's last forward, in the first decode step, between decode
# steps.
@pytest.mark.parametrize("stop", [1, 9, 100, 232, 233, 249])
def test_interrupted_then_resumed_is_the_uninterrupted_file(tmp_path, reference, stop):
    path = tmp_path / "g.safetensors"
    with pytest.raises(RunInterrupted) as e:
        write_golden(_plan(), path, chunk=7, progress=_stop_after(stop), checkpoint_every=0)
    assert e.value.status == 130 and "--resume" in str(e.value)
    assert not path.exists()
    assert os.path.isfile(partial_path(path)) and os.path.isdir(checkpoint_dir(path))
    ckpt = Checkpoint(path, run_identity(_plan().metadata(), 7), resume=True)
    # the checkpoint stands at the last boundary before the interrupted forward
    assert ckpt.done == (stop - 1) // 8
    write_golden(_plan(), path, chunk=7, resume=True, checkpoint_every=0)
    assert sha(path) == reference
    assert sorted(os.listdir(tmp_path)) == ["g.safetensors"]


def test_resume_twice_and_with_sparse_checkpoints(tmp_path, reference):
    """Interrupted twice (the second time mid-way through the resumed run), and with a
    checkpoint only at the start (a long --checkpoint-every): still the same file."""
    path = tmp_path / "g.safetensors"
    with pytest.raises(RunInterrupted):
        write_golden(_plan(), path, chunk=7, progress=_stop_after(50), checkpoint_every=0)
    with pytest.raises(RunInterrupted):
        write_golden(_plan(), path, chunk=7, progress=_stop_after(60), resume=True,
                     checkpoint_every=0)
    write_golden(_plan(), path, chunk=7, resume=True)
    assert sha(path) == reference
    other = tmp_path / "h.safetensors"
    with pytest.raises(RunInterrupted) as e:
        write_golden(_plan(), other, chunk=7, progress=_stop_after(150), checkpoint_every=3600)
    assert "nothing done" in str(e.value)
    write_golden(_plan(), other, chunk=7, resume=True)
    assert sha(other) == reference


def test_checkpoint_appends_only_the_new_cache_rows(tmp_path):
    """The cache files grow by the rows filled since the last checkpoint, the record does not
    hold the preallocated caches, and a restored stack holds exactly the caches it had."""
    plan = _plan()
    cfg = plan.config
    path = str(tmp_path / "g.safetensors")
    sizes = []

    def look():
        d = checkpoint_dir(path)
        if os.path.isdir(d):
            sizes.append({f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)})

    with pytest.raises(RunInterrupted):
        write_golden(plan, path, chunk=7, progress=_watch(8, 20, look), checkpoint_every=0)
    r4 = [i for i in range(cfg.n_layers) if cfg.ratio(i) == 4 and cfg.is_kv_source(i)][0]
    key = f"compress.{r4}.rows"
    grown = [s[key] for s in sizes if key in s]
    row = cfg.head_dim * 4
    assert grown[-1] == (7 * len(grown)) // 4 * row        # rows filled after the last chunk
    assert all(b >= a for a, b in zip(grown, grown[1:]))
    with open(os.path.join(checkpoint_dir(path), "record.pkl"), "rb") as f:
        record = pickle.load(f)
    owners = [i for i in plan.layers if cfg.is_kv_source(i)]
    assert sorted(record["caches"]) == sorted(
        [f"compress.{i}" for i in owners] + [f"index.{i}" for i in owners if cfg.is_index_source(i)])
    with pytest.raises(pickle.UnpicklingError, match="persistent"):
        pickle.loads(record["state"])          # the caches are references, not pickled arrays
    stack = AttentionStack(cfg, GeneratedWeights(cfg, plan.layers, plan.seed), layers=plan.layers)
    ckpt = Checkpoint(path, run_identity(plan.metadata(), 7), resume=True)
    ckpt.restore(stack)
    again = AttentionStack(cfg, make_weights(cfg, plan.layers, plan.seed), layers=plan.layers)
    pieces = run_pieces(plan.prefill, plan.decode, 7)[:ckpt.done]
    for s, sp, first, n in pieces:
        for i in plan.layers:
            x = make_input(f"step{s}.layers.{i}.x", (n, cfg.dim), plan.seed, first_row=first)
            again.forward(i, x, sp + first, prefill_len=plan.prefill)
    for i in plan.layers:
        a, b = stack.states[i], again.states[i]
        assert a.end_pos == b.end_pos == 7 * ckpt.done
        assert np.array_equal(a.window_kv, b.window_kv)
        if b.compress_cache is not None:
            assert a.compress_cache.shape == b.compress_cache.shape
            assert np.array_equal(a.compress_cache, b.compress_cache)
        if b.index_cache is not None:
            assert np.array_equal(a.index_cache.keys, b.index_cache.keys)
    assert stack.shared.compress_kv is stack.states[max(
        i for i in plan.layers if cfg.is_kv_source(i))].compress_cache


def _watch(every_layers, pieces, look):
    """After each piece (``every_layers`` forwards) call ``look``; interrupt after ``pieces``."""
    done = {"n": 0}

    def progress(tokens, where):
        if tokens:
            done["n"] += 1
            if done["n"] % every_layers == 1 and done["n"] > 1:
                look()
            if done["n"] == every_layers * pieces + 1:
                raise KeyboardInterrupt
    return progress


def test_weights_are_made_one_at_a_time_and_equal_make_weights():
    cfg = preset("mixed")
    made = []
    lazy = GeneratedWeights(cfg, (0, 2, 3), seed=5, profile="ties",
                            made=lambda name, a, kind: made.append((name, kind)))
    whole = make_weights(cfg, (0, 2, 3), 5, "ties")
    assert set(lazy) == set(whole) and len(lazy) == len(whole)
    for name in whole:
        assert name in lazy
        # bf16 parameters come as bfloat16 (2 bytes each), the values make_weights gives.
        got, kind = lazy[name], weight_specs(cfg, int(name.split(".")[1]))[name][1]
        assert (got.dtype.name == "bfloat16") == (kind == "bf16")
        assert got.astype(np.float32).tobytes() == whole[name].tobytes()
    assert [n for n, _ in made] == list(whole)
    assert lazy.get("layers.99.attn.nothing") is None and "layers.99.attn.nothing" not in lazy
    with pytest.raises(KeyError):
        lazy["layers.99.attn.nothing"]


# --------------------------------------------------------------------------- the command line


ARGS = ["golden", "--quiet", "--preset", "mixed", "--prefill", "203", "--decode", "3",
        "--capture", "io", "--chunk", "7", "--seed", "2"]


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("cliref") / "ref.safetensors"
    assert main(ARGS + ["--out", str(path)]) == 0
    return sha(path)


def _cli_progress(monkeypatch, progress):
    """Make the CLI's progress callback ``progress`` (the test's hook into a run)."""
    import contextlib

    @contextlib.contextmanager
    def fake(total, quiet, desc):
        yield progress
    monkeypatch.setattr(cli, "_progress", fake)


def test_cli_ctrl_c_then_resume(tmp_path, monkeypatch, capsys, cli_reference):
    out = tmp_path / "g.safetensors"
    _cli_progress(monkeypatch, _stop_after(40))
    assert main(ARGS + ["--out", str(out), "--checkpoint-every", "0"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interrupted" in err[0] and "--resume" in err[0]
    assert "step 0 rows 21-27 done" in err[0]
    monkeypatch.undo()
    assert main(ARGS + ["--out", str(out), "--resume"]) == 0
    assert sha(out) == cli_reference
    assert os.listdir(tmp_path) == ["g.safetensors"]


def test_cli_sigterm_keeps_the_checkpoint(tmp_path, monkeypatch, capsys, cli_reference):
    out = tmp_path / "g.safetensors"
    _cli_progress(monkeypatch, _stop_after(100, lambda: os.kill(os.getpid(), signal.SIGTERM)))
    assert main(ARGS + ["--out", str(out), "--checkpoint-every", "0"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ds41numba: terminated; kept")
    monkeypatch.undo()
    assert main(ARGS + ["--out", str(out), "--resume"]) == 0
    assert sha(out) == cli_reference


def test_stale_partial_is_refused_without_resume(tmp_path, monkeypatch, capsys, cli_reference):
    out = tmp_path / "g.safetensors"
    _cli_progress(monkeypatch, _stop_after(30))
    assert main(ARGS + ["--out", str(out), "--checkpoint-every", "0"]) == 130
    monkeypatch.undo()
    capsys.readouterr()
    assert main(ARGS + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume to continue" in err[0] and "--force to start over" in err[0]
    assert os.path.isdir(checkpoint_dir(out)) and not out.exists()
    # different arguments: refused, naming what differs
    assert main([a if a != "3" else "4" for a in ARGS] + ["--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--decode (3 then, 4 now)" in err[0]
    assert main(ARGS[:-2] + ["--seed", "5", "--chunk", "9", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "--chunk (7 then, 9 now)" in err and "--seed (2 then, 5 now)" in err
    # --force starts over (and gives the same file)
    assert main(ARGS + ["--out", str(out), "--force"]) == 0
    assert sha(out) == cli_reference
    assert os.listdir(tmp_path) == ["g.safetensors"]


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    out = tmp_path / "g.safetensors"
    assert main(ARGS + ["--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing to resume" in err[0]
    assert main(["golden", "--quiet", "--out", str(out), "--resume"]) == 2   # --capture all
    assert "--capture io" in capsys.readouterr().err
    partial_path_ = partial_path(out)
    open(partial_path_, "wb").close()            # a kill -9 before the first checkpoint
    assert main(ARGS + ["--out", str(out), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert os.listdir(tmp_path) == [os.path.basename(partial_path_)]


def test_kill_9_then_resume(tmp_path, cli_reference):
    """A real SIGKILL of the command partway through the prefill, once a checkpoint past the
    first is on disk; --resume gives the uninterrupted file."""
    out = tmp_path / "g.safetensors"
    env = dict(os.environ, NUMBA_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "ds41numba"] + ARGS + ["--out", str(out)]
    proc = subprocess.Popen(cmd + ["--checkpoint-every", "0"], env=env, stderr=subprocess.PIPE)
    record = os.path.join(checkpoint_dir(out), "record.pkl")
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(record) and _checkpoint_done(out) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out.exists() and os.path.exists(record)
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sha(out) == cli_reference


def _checkpoint_done(out) -> int:
    try:
        with open(os.path.join(checkpoint_dir(out), "record.pkl"), "rb") as f:
            return pickle.load(f)["done"]
    except (OSError, EOFError, pickle.UnpicklingError):
        return 0


# --------------------------------------------------------------------------- a failing disk


def _failing(monkeypatch, name, after, err):
    """``os.NAME`` fails with ``err`` from its ``after``-th call on."""
    real = getattr(os, name)
    calls = {"n": 0}

    def fake(*a, **kw):
        calls["n"] += 1
        if calls["n"] >= after:
            raise OSError(err, os.strerror(err))
        return real(*a, **kw)
    monkeypatch.setattr(os, name, fake)


def test_full_disk_exits_2_keeps_the_checkpoint_and_resumes(tmp_path, monkeypatch, capsys,
                                                              cli_reference):
    out = tmp_path / "g.safetensors"
    _failing(monkeypatch, "pwrite", 400, errno.ENOSPC)
    assert main(ARGS + ["--out", str(out), "--checkpoint-every", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device (ENOSPC)" in err[0]
    assert str(tmp_path) in err[0] and "--resume" in err[0]
    assert not out.exists() and os.path.exists(os.path.join(checkpoint_dir(out), "record.pkl"))
    monkeypatch.undo()
    assert main(ARGS + ["--out", str(out), "--resume"]) == 0   # space freed
    assert sha(out) == cli_reference


def test_full_disk_before_any_checkpoint_leaves_nothing(tmp_path, monkeypatch, capsys):
    out = tmp_path / "g.safetensors"
    _failing(monkeypatch, "pwrite", 1, errno.ENOSPC)
    assert main(ARGS + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".g.safetensors.partial" in err[0] and "ENOSPC" in err[0]
    assert "nothing was kept" in err[0]
    assert os.listdir(tmp_path) == []


def test_read_only_directory_exits_2(tmp_path, monkeypatch, capsys):
    out = tmp_path / "g.safetensors"
    if os.geteuid() == 0:          # root writes through chmod: simulate the refusal
        _failing(monkeypatch, "open", 1, errno.EROFS)
    else:
        os.chmod(tmp_path, 0o500)
    try:
        assert main(ARGS + ["--out", str(out)]) == 2
    finally:
        os.chmod(tmp_path, 0o700)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(tmp_path) in err[0]
    assert ("Read-only file system" in err[0]) or ("Permission denied" in err[0])
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_output_directory_removed_mid_run(tmp_path, monkeypatch, capsys):
    where = tmp_path / "out"
    where.mkdir()
    out = where / "g.safetensors"
    _cli_progress(monkeypatch, _stop_after(60, lambda: shutil.rmtree(where)))
    assert main(ARGS + ["--out", str(out), "--checkpoint-every", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No such file or directory" in err[0] and str(where) in err[0]
    assert not where.exists()
