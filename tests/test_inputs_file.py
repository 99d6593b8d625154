"""Layer inputs from a file (``--inputs FILE``): the generator's inputs written to a file give
the generator's golden, byte for byte in every tensor, whatever the chunking, with sampled
rows, resumed, on a Dask worker and in replay; F32 inputs are rounded to bf16 and the file says
so; a bad inputs file is one line, exit 2, nothing written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
from ml_dtypes import bfloat16
from safetensors import safe_open
from safetensors.numpy import save_file

from ds41numba import preset
from ds41numba.cli import main
from ds41numba.golden import GoldenError, GoldenPlan, RunInterrupted, make_input, write_golden
from ds41numba.golden.inputs_file import InputsFile

P, D = 12, 5


def generator_rows(cfg, layer, prefill, decode, seed=0):
    """The generator's inputs of ``layer`` as one ``[tokens, dim]`` array, row t position t."""
    rows = [make_input(f"step0.layers.{layer}.x", (prefill, cfg.dim), seed)]
    rows += [make_input(f"step{s}.layers.{layer}.x", (1, cfg.dim), seed, start_pos=prefill + s - 1)
             for s in range(1, decode + 1)]
    return np.concatenate(rows)


def write_inputs(path, cfg, layers, prefill=P, decode=D, seed=0, extra_rows=0):
    """The generator's inputs in a file: even layers BF16, odd layers F32 (bf16 values); then
    ``extra_rows`` rows of NaN past the run's, which it must not read."""
    tensors = {}
    for i in layers:
        x = np.concatenate([generator_rows(cfg, i, prefill, decode, seed),
                            np.full((extra_rows, cfg.dim), np.nan, np.float32)])
        tensors[f"x.layers.{i}"] = x.astype(bfloat16) if i % 2 == 0 else x
    save_file(tensors, str(path))
    return path


def tensors_of(path):
    with safe_open(path, "np") as f:
        return {n: f.get_tensor(n) for n in f.keys()}, f.metadata()


def assert_same_tensors(a, b):
    ta, _ = tensors_of(a)
    tb, _ = tensors_of(b)
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and ta[n].tobytes() == tb[n].tobytes(), n


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _golden(path, *args):
    assert main(["golden", "--quiet", "--out", str(path), *args]) == 0
    return path


@pytest.mark.parametrize("capture, chunk", [("all", "4096"), ("io", "5"), ("io", "12")])
def test_the_generators_inputs_from_a_file_give_the_generators_golden(tmp_path, capture, chunk):
    cfg = preset("tiny")
    inputs = write_inputs(tmp_path / "x.safetensors", cfg, range(cfg.n_layers), extra_rows=3)
    run = ["--prefill", str(P), "--decode", str(D), "--capture", capture, "--chunk", chunk,
           "--capture-rows", "2,11,14"]
    mine = _golden(tmp_path / "mine.safetensors", *run, "--inputs", str(inputs))
    want = _golden(tmp_path / "want.safetensors", *run)
    assert_same_tensors(mine, want)
    _, meta = tensors_of(mine)
    recorded = json.loads(meta["inputs"])
    assert recorded["file"] == "x.safetensors"
    assert recorded["layers"]["1"]["dtype"] == "F32" and recorded["layers"]["0"]["dtype"] == "BF16"
    assert not any(v["rounded_to_bf16"] for v in recorded["layers"].values())
    assert main(["replay", str(mine), "--quiet", "--exact-index"]) == 0


def test_f32_inputs_are_rounded_to_bf16_and_the_file_says_so(tmp_path):
    cfg = preset("tiny")
    x = generator_rows(cfg, 0, P, D)
    # within half a bf16 step of each value: rounds back to it (RNE)
    nudged = (x.view(np.uint32) + np.uint32(0x3FFF)).view(np.float32)
    assert not np.array_equal(nudged, x)
    save_file({"x": nudged}, str(tmp_path / "x.safetensors"))
    save_file({"x": x.astype(bfloat16)}, str(tmp_path / "x16.safetensors"))
    run = ["--layers", "0,1", "--prefill", str(P), "--decode", str(D), "--capture", "io"]
    a = _golden(tmp_path / "a.safetensors", *run, "--inputs", str(tmp_path / "x.safetensors"))
    b = _golden(tmp_path / "b.safetensors", *run, "--inputs", str(tmp_path / "x16.safetensors"))
    assert_same_tensors(a, b)           # one x for both layers, rounded as the bf16 file holds it
    layers = json.loads(tensors_of(a)[1]["inputs"])["layers"]
    assert layers["0"]["tensor"] == layers["1"]["tensor"] == "x"
    assert layers["0"]["rounded_to_bf16"] is True
    assert json.loads(tensors_of(b)[1]["inputs"])["layers"]["0"]["rounded_to_bf16"] is False


def test_nan_inputs_are_taken_as_they_are(tmp_path):
    cfg = preset("tiny")
    x = generator_rows(cfg, 0, P, D)
    x[3, 7] = np.nan
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    g = _golden(tmp_path / "g.safetensors", "--layers", "0", "--prefill", str(P), "--decode",
                str(D), "--capture", "io", "--inputs", str(tmp_path / "x.safetensors"))
    stored = tensors_of(g)[0]["step0.layers.0.x"].astype(np.float32)
    assert np.isnan(stored[3, 7]) and np.isnan(stored).sum() == 1
    assert np.isnan(tensors_of(g)[0]["step0.layers.0.out"].astype(np.float32)[3]).all()


def test_an_interrupted_inputs_run_resumes_to_the_same_file(tmp_path):
    cfg = preset("mixed")
    layers = tuple(range(cfg.n_layers))
    path = write_inputs(tmp_path / "x.safetensors", cfg, layers, prefill=40, decode=3)

    def plan():
        return GoldenPlan(cfg, layers, 40, 3, capture="io", preset="mixed", capture_rows=(5, 41),
                          inputs=InputsFile(path, cfg, layers, 43))

    whole = tmp_path / "whole.safetensors"
    write_golden(plan(), whole, chunk=7)
    calls = {"n": 0}

    def stop(tokens, where):
        calls["n"] += bool(tokens)
        if calls["n"] == 20:
            raise KeyboardInterrupt

    cut = tmp_path / "cut.safetensors"
    with pytest.raises(RunInterrupted):
        write_golden(plan(), cut, chunk=7, progress=stop, checkpoint_every=0)
    # the inputs are part of the run's identity: other inputs do not resume it
    other = write_inputs(tmp_path / "other.safetensors", cfg, layers, prefill=40, decode=3, seed=1)
    with pytest.raises(GoldenError, match="--inputs"):
        write_golden(dataclasses.replace(plan(), inputs=InputsFile(other, cfg, layers, 43)), cut,
                     chunk=7, resume=True)
    write_golden(plan(), cut, chunk=7, resume=True)
    assert sha(cut) == sha(whole)


def test_inputs_on_a_dask_worker(tmp_path):
    cfg = preset("tiny")
    inputs = write_inputs(tmp_path / "x.safetensors", cfg, range(cfg.n_layers), prefill=30, decode=3)
    run = ["--prefill", "30", "--decode", "3", "--capture", "io", "--chunk", "8",
           "--inputs", str(inputs)]
    one = _golden(tmp_path / "one.safetensors", *run)
    two = _golden(tmp_path / "two.safetensors", *run, "--workers", "1")
    assert sha(one) == sha(two)
    assert_same_tensors(one, _golden(tmp_path / "gen.safetensors", "--prefill", "30", "--decode",
                                     "3", "--capture", "io", "--chunk", "8"))


@pytest.mark.parametrize("tensors, words", [
    ({"x.layers.0": np.zeros((P + D - 1, 64), np.float32)},
     ["x.layers.0 in x.safetensors has 16 rows; the run needs 17"]),
    ({"x.layers.0": np.zeros((P + D, 32), np.float32)},
     ["x.layers.0 in x.safetensors has shape [17, 32]", "dim 64"]),
    ({"x.layers.0": np.zeros((P + D, 64), np.int32)}, ["x.layers.0 in x.safetensors is I32"]),
    ({"x.layers.0": np.zeros((P + D, 64), np.float16)}, ["is F16; inputs are BF16 or F32"]),
    ({"x.layers.1": np.zeros((P + D, 64), np.float32)},
     ["x.safetensors has neither x.layers.0 nor x for layer 0"]),
])
def test_a_bad_inputs_file_is_one_line_and_nothing_written(tmp_path, capsys, tensors, words):
    save_file(tensors, str(tmp_path / "x.safetensors"))
    out = tmp_path / "out"
    out.mkdir()
    capsys.readouterr()
    status = main(["golden", "--layers", "0,1", "--prefill", str(P), "--decode", str(D),
                   "--inputs", str(tmp_path / "x.safetensors"), "--out", str(out / "g.safetensors"),
                   "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    for w in words:
        assert w in err, err
    assert os.listdir(out) == []
