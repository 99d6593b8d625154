"""A batch of sequences in lockstep (``--batch B``, :class:`BatchedStack`): B = 1 is the
single-sequence file byte for byte; each sequence of a batch is, within the bf16 bar and with
tie-aware equal index rows, the single-sequence run of the same inputs; the batch's products sum
in the order of its ``B x seqlen`` rows (a decode step's projections in the many-row order, the
compressor's f32 rows by their place in the batch), checked against the slow emulations."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import naive
from ds41numba import AttentionStack, preset, testing
from ds41numba import rms_norm as ds_rms_norm
from ds41numba.attention import layer_rope_table
from ds41numba.batch import BatchRow
from ds41numba.batched import BatchedStack
from ds41numba.cli import main
from ds41numba.golden import (GoldenFile, GoldenPlan, RunInterrupted, make_input, make_weights,
                              write_golden)
from ds41numba.golden.compare import Judge, compare_order, file_scores
from ds41numba.golden.files import BatchRowFile
from ds41numba.golden.generator import batch_input_name
from ds41numba.golden.run import StoredWeights, drive
from ds41numba.rope import apply_rotary
from helpers import random_config, random_weights, random_x, refused

TINY = ["--preset", "tiny", "--prefill", "13", "--decode", "4", "--seed", "3"]


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def golden(tmp_path, name, *args):
    out = tmp_path / name
    assert main(["golden", "--quiet", "--out", str(out), *args]) == 0
    return out


def single_sequence_results(path, b):
    """Sequence ``b`` of the batch golden at ``path`` run alone (an AttentionStack on its
    inputs), every capture judged against that row of the file as compare judges a tensor."""
    with GoldenFile(path) as g:
        info = g.run_info()
        f = BatchRowFile(g, b)
        stack = AttentionStack(info.config, StoredWeights(g), layers=info.layers)
        judge = Judge(f.run_info(), file_scores(f))
        results = []

        def x_of(name, first_row, rows, start_pos, batch_row=0):
            return np.asarray(f.get(name), np.float32)

        def take(prefix, captures, first_row, batch_row=0):
            for what in sorted(captures, key=lambda w: compare_order(prefix + w)):
                results.append(judge.compare(prefix + what, f.get(prefix + what), captures[what], f))

        drive(stack, info.prefill, info.decode, info.capture, x_of, take, None, info.capture_rows)
    return results


# ------------------------------------------------------------------------------ the file layout


@pytest.mark.parametrize("args", [[], ["--capture", "io", "--capture-rows", "2,12,14", "--chunk", "5"]])
def test_batch_1_is_the_single_sequence_file(tmp_path, args):
    plain = golden(tmp_path, "plain.safetensors", *TINY, *args)
    one = golden(tmp_path, "one.safetensors", *TINY, *args, "--batch", "1")
    assert open(plain, "rb").read() == open(one, "rb").read()
    with GoldenFile(one) as f:
        assert "batch" not in f.metadata and f.run_info().batch == 1
        assert f.get("step0.layers.2.out").shape == (13, 64)


def test_batch_3_layout_metadata_and_inputs(tmp_path):
    path = golden(tmp_path, "b3.safetensors", *TINY, "--batch", "3", "--capture", "io",
                  "--capture-rows", "2,14")
    single = golden(tmp_path, "b1.safetensors", *TINY, "--capture", "io", "--capture-rows", "2,14")
    with GoldenFile(path) as f, GoldenFile(single) as s:
        assert f.run_info().batch == 3 and json.loads(f.metadata["config"]) == json.loads(s.metadata["config"])
        assert "batch{b}" in f.metadata["batch_inputs"]
        assert set(f.names) == set(s.names)
        for name in s.names:
            got, one = f.get(name), s.get(name)
            if name.startswith("layers."):
                assert np.array_equal(got, one)             # the weights: once, no batch axis
            else:
                assert got.shape == (3,) + one.shape, name
        # Row 0's inputs are the single-sequence run's; row b's the generator's batch{b}. stream.
        assert np.array_equal(f.get("step0.layers.3.x")[0], s.get("step0.layers.3.x"))
        for b in (1, 2):
            want = make_input(batch_input_name("step2.layers.3.x", b), (1, 64), 3)
            assert batch_input_name("step2.layers.3.x", b) == f"batch{b}.step2.layers.3.x"
            assert np.array_equal(f.get("step2.layers.3.x")[b].astype(np.float32), want)
        assert not np.array_equal(f.get("step0.layers.3.x")[1], f.get("step0.layers.3.x")[2])
        assert f.get("step0.layers.2.sample.rows").tolist() == [[2]] * 3


def test_batch_stream_chunked_and_resumed_is_the_one_shot_file(tmp_path):
    cfg = preset("mixed")
    plan = GoldenPlan(cfg, tuple(range(cfg.n_layers)), 37, 3, seed=5, capture="io",
                      preset="mixed", capture_rows=(4, 36, 38), batch=3)
    whole = tmp_path / "whole.safetensors"
    write_golden(plan, whole, chunk=None)
    chunked = tmp_path / "chunked.safetensors"
    write_golden(plan, chunked, chunk=7)
    assert sha(chunked) == sha(whole)
    # Interrupted mid-prefill (chunk 3 of 6, batch row 1 of layer 4), then resumed.
    resumed = tmp_path / "resumed.safetensors"
    calls = {"n": 0}

    def stop(tokens, where):
        calls["n"] += bool(tokens)
        if calls["n"] == 2 * 8 * 3 + 4 * 3 + 2:
            raise KeyboardInterrupt
    with pytest.raises(RunInterrupted):
        write_golden(plan, resumed, chunk=7, progress=stop, checkpoint_every=0)
    write_golden(plan, resumed, chunk=7, resume=True, checkpoint_every=0)
    assert sha(resumed) == sha(whole)
    # the in-memory run (--capture all) writes the same io tensors
    full = tmp_path / "all.safetensors"
    write_golden(GoldenPlan(cfg, plan.layers, 37, 3, seed=5, preset="mixed", batch=3), full)
    with GoldenFile(whole) as w, GoldenFile(full) as a:
        for name in w.names:
            if name in a:
                assert np.array_equal(w.get(name), a.get(name)), name


def test_batch_replay_compare_and_testing(tmp_path, capsys):
    path = golden(tmp_path, "b3.safetensors", *TINY, "--batch", "3")
    assert main(["replay", "--quiet", str(path)]) == 0
    assert main(["compare", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "step4.layers.5.out[2]" in out or "OK:" in out
    # One float of batch row 2 changed: compare names that row.
    with GoldenFile(path) as f:
        tensors = {n: f.get(n) for n in f.names}
        meta = dict(f.metadata)
    bad = tensors["step1.layers.4.out"].astype(np.float32)
    bad[2, 0, 5] += 1.0 + abs(bad[2]).max()
    tensors["step1.layers.4.out"] = bad.astype(tensors["step1.layers.4.out"].dtype)
    import safetensors.numpy
    other = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(tensors, str(other), metadata=meta)
    capsys.readouterr()
    assert main(["compare", str(path), str(other)]) == 1
    out = capsys.readouterr().out
    assert "step1.layers.4.out[2]" in out and "step1.layers.4.out[1]" not in out.split("FAIL")[0]
    # ds41numba.testing: a sequence's tensor by batch_row.
    with GoldenFile(path) as f:
        idx = f.get("step0.layers.5.shared.topk_idxs")
        testing.assert_golden_tensor(f, "step0.layers.5.shared.topk_idxs", idx[1], batch_row=1)
        assert testing.golden_scores(f, 0, 5, batch_row=2) is not None
        with pytest.raises(ValueError, match="batch_row"):
            testing.assert_golden_tensor(f, "step0.layers.5.out", f.get("step0.layers.5.out")[0])
        with pytest.raises(AssertionError):
            testing.assert_golden_tensor(f, "step1.layers.4.out", bad[2], batch_row=2)
    testing.assert_candidate_file(path, path)


def test_batch_refusals(tmp_path, capsys):
    out = tmp_path / "g.safetensors"
    for argv, words in ((["--batch", "0"], "--batch"),
                        (["--batch", "2", "--capture", "io", "--workers", "2"], "--batch")):
        assert main(["golden", "--quiet", *TINY, "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0]
    assert not out.exists()
    cfg = preset("tiny")
    stack = BatchedStack(cfg, make_weights(cfg, None, 0), 2)
    refused(lambda: stack.forward(0, [random_x(np.random.default_rng(0), 3, 64)], 0),
            ValueError, "2 sequences")
    refused(lambda: stack.forward(0, [random_x(np.random.default_rng(0), n, 64) for n in (3, 4)], 0),
            ValueError, "lockstep")
    refused(lambda: BatchRow(2, 2), ValueError, "index")
    refused(lambda: BatchedStack(cfg, {}, 0), ValueError, "batch")


# ------------------------------------------------------------- each sequence, the single run


@pytest.mark.parametrize("args", [TINY, ["--preset", "mixed", "--prefill", "37", "--decode", "5",
                                         "--seed", "2", "--profile", "ties"]])
def test_batch_rows_are_the_single_sequence_runs(tmp_path, args):
    """Every sequence of a --batch 3 golden within the bf16 bar of (index rows tie-aware equal
    to) the same inputs run alone; row 0 also against the single-sequence golden itself."""
    path = golden(tmp_path, "b3.safetensors", *args, "--batch", "3")
    for b in range(3):
        results = single_sequence_results(path, b)
        failed = [r.line() for r in results if not r.ok]
        assert not failed and len(results) > 100, failed[:3]
    single = golden(tmp_path, "b1.safetensors", *args)
    with GoldenFile(path) as g, GoldenFile(single) as s:
        row0 = BatchRowFile(g, 0)
        judge = Judge(s.run_info(), file_scores(s))
        for name in sorted(s.names, key=compare_order):
            res = judge.compare(name, s.get(name), row0.get(name), s)
            assert res.ok, res.line()


def test_batch_rows_production_shapes(tmp_path):
    """v41-flash layer 20 (dims 5120, K up to 8192): a batch of 2, prefill 40 and 2 decode
    steps: the prefill rows are the single run's bit for bit (M >= 2 either way), the decode
    steps within the bar and tie-aware equal (their products take the many-row order)."""
    path = golden(tmp_path, "b2.safetensors", "--preset", "v41-flash", "--layers", "20",
                  "--prefill", "40", "--decode", "2", "--batch", "2", "--capture", "io")
    for b in range(2):
        results = single_sequence_results(path, b)
        assert all(r.ok for r in results), [r.line() for r in results if not r.ok][:3]
        prefill_out = next(r for r in results if r.name == "step0.layers.20.out")
        assert prefill_out.bit_identical == prefill_out.size
        decode_out = next(r for r in results if r.name == "step1.layers.20.out")
        assert decode_out.bit_identical < decode_out.size      # the many-row order, not the one-row


# ------------------------------------------------------------ the products' order in a batch


def _query_chain(x, w, cfg, pos, ref_rows):
    """q of one decode token by the slow emulation: wq_a, q_norm, wq_b (each summed as a
    bf16 linear of ``ref_rows`` rows), RoPE at ``pos``."""
    qr = ds_rms_norm(naive.linear_bf16_ordered(x, w["layers.0.attn.wq_a.weight"], ref_rows),
                     w["layers.0.attn.q_norm.weight"], cfg.norm_eps)
    q = naive.linear_bf16_ordered(qr, w["layers.0.attn.wq_b.weight"], ref_rows)
    q = q.reshape(1, cfg.n_heads, cfg.head_dim)
    return apply_rotary(q, np.array([pos]), layer_rope_table(cfg, 0, pos + 1))


def test_batched_decode_projection_takes_the_many_row_order():
    """A decode step of a batch of 3: the query projection ``wq_a`` (K = dim = 2048 > 1024)
    sums in runs of 1024 as the reference's M = 3 product does, not in the one-row runs of 512
    of a single sequence's decode step. Its weights carry +-2^12 at columns 0 and 600 (one
    512-run apart), so the two orders round differently and the queries differ."""
    cfg = random_config(dim=2048, q_lora_rank=64)
    w = random_weights(cfg, 1)
    wq_a = w["layers.0.attn.wq_a.weight"]
    wq_a[:, 0], wq_a[:, 600] = 4096.0, -4096.0
    rng = np.random.default_rng(2)
    B, P = 3, 5
    batch = BatchedStack(cfg, w, B)
    batch.forward(0, [random_x(rng, P, cfg.dim) for _ in range(B)], 0)
    x = [random_x(rng, 1, cfg.dim) for _ in range(B)]
    for xb in x:
        xb[0, 0] = xb[0, 600] = 1.0
    runs = batch.forward(0, x, P, capture=True)
    differs = 0
    for xb, run in zip(x, runs):
        many = _query_chain(xb, w, cfg, P, ref_rows=B)
        assert np.array_equal(run.q, many)
        differs += int((many != _query_chain(xb, w, cfg, P, ref_rows=1)).sum())
    assert differs > 100
    # A single sequence's decode step keeps the one-row order.
    alone = AttentionStack(cfg, w)
    alone.forward(0, random_x(rng, P, cfg.dim), 0)
    run = alone.forward(0, x[0], P, capture=True)
    assert np.array_equal(run.q, _query_chain(x[0], w, cfg, P, ref_rows=1))


@pytest.mark.parametrize("B", [2, 3, 6, 7])
def test_batched_compressor_rows_take_their_place_in_the_batch(B):
    """The ratio > 1 compressor's f32 projections of a batched decode step are rows of one
    M = B product (MKL's two-thread rule: M = 2-3 small kernel; M = 6, 7 the last M % 4 rows
    small, the others blocked; dim 66, so a small row's first lane start follows its row),
    bit for bit the emulation of that product, unlike each row's M = 1 gemv."""
    cfg = random_config(dim=66, compress_ratios=[4], kv_source_layers=[0], index_source_layers=[0])
    w = random_weights(cfg, 3)
    rng = np.random.default_rng(4)
    P = 6
    batch = BatchedStack(cfg, w, B)
    batch.forward(0, [random_x(rng, P, cfg.dim) for _ in range(B)], 0)
    x = np.stack([random_x(rng, 1, cfg.dim)[0] for _ in range(B)])
    batch.forward(0, list(x[:, None]), P)
    wkv = w["layers.0.attn.compressor.wkv.weight"]
    want = naive.linear_f32_ordered(x, wkv)
    got = np.stack([s.states[0].kv_state[P % 4] for s in batch.sequences])
    assert np.array_equal(got, want)
    alone = np.stack([naive.linear_f32_ordered(x[b:b + 1], wkv)[0] for b in range(B)])
    assert not np.array_equal(got, alone)


# ------------------------------------------------------------------ --inputs FILE with a batch


def test_batch_inputs_file_gives_the_generators_batch(tmp_path, capsys):
    """``--inputs`` with ``--batch 2``: ``x.layers.{i}`` as ``[2, tokens, dim]`` holding the
    generator's inputs of each batch row gives the generator's batch golden, every tensor byte
    for byte (chunked, with sampled rows); a ``[tokens, dim]`` file is refused in one line."""
    from ml_dtypes import bfloat16
    from safetensors import safe_open
    from safetensors.numpy import save_file
    cfg, B, P, D = preset("tiny"), 2, 12, 3
    tensors = {}
    for i in range(cfg.n_layers):
        seqs = []
        for b in range(B):
            rows = [make_input(batch_input_name(f"step0.layers.{i}.x", b), (P, cfg.dim), 0)]
            rows += [make_input(batch_input_name(f"step{s}.layers.{i}.x", b), (1, cfg.dim), 0,
                                start_pos=P + s - 1) for s in range(1, D + 1)]
            seqs.append(np.concatenate(rows))
        tensors[f"x.layers.{i}"] = np.stack(seqs).astype(bfloat16)
    inputs = tmp_path / "inputs.safetensors"
    save_file(tensors, str(inputs))
    run = ["--preset", "tiny", "--prefill", str(P), "--decode", str(D), "--batch", str(B),
           "--capture", "io", "--chunk", "5", "--capture-rows", "3,13"]
    gen = golden(tmp_path, "gen.safetensors", *run)
    given = golden(tmp_path, "given.safetensors", *run, "--inputs", str(inputs))
    with safe_open(str(gen), "np") as a, safe_open(str(given), "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for n in a.keys():
            assert a.get_tensor(n).tobytes() == b.get_tensor(n).tobytes(), n
        assert "[b, t]" in b.metadata()["inputs"] and b.metadata()["batch"] == "2"
    assert main(["replay", "--quiet", str(given)]) == 0
    flat = tmp_path / "flat.safetensors"
    save_file({"x": tensors["x.layers.0"][0]}, str(flat))
    capsys.readouterr()
    assert main(["golden", "--quiet", *run, "--inputs", str(flat),
                 "--out", str(tmp_path / "no.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "[2, tokens, dim]" in err[0]
