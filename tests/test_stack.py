"""ds41numba.stack: AttentionStack against the reference goldens (every step, every layer,
every capture), its results independent of thread counts, the structural invariants of a run,
and the rules of its step order (StepOrder), layer subsets, inputs and weights: a bad call gets
a ValueError/TypeError that names the problem and changes nothing.

The goldens are the reference's own outputs (tests/data, copied unchanged from the reference's goldens).
Index tensors must be identical; float tensors within the SPEC's bf16 bar, and at least 99% of
all float elements bit-identical.

One exception to bit-identity, kept visible: the ratio > 1 compressor's partial-group state
(``state.kv_state``, ``state.score_state``) is a genuine f32 product, never rounded to bf16.
Where the reference multiplies a single row (every decode step, a 1-token prefill), torch's
BLAS takes a matrix-vector path whose summation order numpy's BLAS does not share (SPEC: do not
replicate a BLAS's order), so those rows differ in the last f32 bits. They are held to
f32 accuracy (``F32_REL``) instead, and left out of the bit-identical count.

Results must not depend on the thread count, numba's or BLAS's: each configuration runs in its
own process (thread counts are fixed at start-up) and prints a digest of every output, capture
and shared slot of the mixed golden's replay.
"""

import gc
import pickle
import os
import weakref
import subprocess
import sys

import ml_dtypes
import numba
import numpy as np
import pytest

import naive
from helpers import (DATA, captured_steps, random_config, random_weights, random_x, refused,
                     run_steps, xs)
from ds41numba import AttentionStack, AttnConfig, preset, to_bf16_rne
from ds41numba.golden import GoldenError, GoldenPlan, make_weights
from ds41numba.numerics import backend, use_backend
from ds41numba.stack import weight_specs


GOLDENS = ["tiny", "mixed", "edge_prefill1", "edge_prefill_window", "edge_r128_short",
           "edge_r128_groups"]
INDEX_KEYS = {"idx", "shared.topk_idxs", "shared.candidates"}
F32_STATE = {"state.kv_state", "state.score_state"}
F32_REL = 2.0 ** -20     # a few f32 ulps of the tensor's largest magnitude


# =============================================================================== the reference goldens


def bar(want):
    return 2 * 2.0 ** -8 * float(np.max(np.abs(want), initial=0.0)) + 1e-6


def captures(stack, run, layer_id, r, end_pos, keys_present):
    """The tensors the goldens record for one layer's step, under the goldens' names."""
    got = {"out": run.out, "q": run.q, "kv": run.kv_rows, "idx": run.idx, "o": run.o,
           "index_score": run.index_score}
    sh = stack.shared
    st = stack.states[layer_id]
    got["state.window_kv"] = st.window_kv
    if st.kv_state is not None:
        got["state.kv_state"] = st.kv_state
        got["state.score_state"] = st.score_state
    if r > 0:
        used = end_pos // r
        if sh.compress_kv is not None:
            got["shared.compress_kv"] = sh.compress_kv[:used]
        if sh.index_k is not None:
            got["shared.index_k"] = sh.index_k.keys[:used]
        got["shared.topk_idxs"] = sh.topk_idxs
        if sh.candidates is not None:
            got["shared.candidates"] = sh.candidates.astype(np.uint8)
    return {k: v for k, v in got.items() if k in keys_present}


def iter_captures(d):
    """Run golden ``d`` step by step, layer by layer; yield ``(prefix, key, got, want)``."""
    cfg = d.config
    stack = AttentionStack(cfg, d.weights)
    for s in range(1 + d.run.decode):
        start_pos = d.start_pos(s)
        for i in range(cfg.n_layers):
            pre = f"step{s}.layers.{i}."
            keys = {k[len(pre):] for k in d.tensors if k.startswith(pre)}
            x = d[pre + "x"]
            run = stack.forward(i, x, start_pos, capture=True)
            got = captures(stack, run, i, cfg.ratio(i), start_pos + x.shape[0], keys)
            missing = keys - set(got) - {"x"}
            assert not missing, f"{pre}: no capture for {sorted(missing)}"
            for k, g in got.items():
                yield pre, k, np.asarray(g), d[pre + k]


def replay(d):
    bits_same = bits_total = 0
    failures = []
    for pre, k, g, want in iter_captures(d):
        if g.shape != want.shape:
            failures.append(f"{pre}{k}: shape {g.shape} != {want.shape}")
            continue
        if k in INDEX_KEYS:
            if not np.array_equal(g.astype(np.int64), want.astype(np.int64)):
                rows = np.nonzero(np.any(g.astype(np.int64) != want.astype(np.int64),
                                         axis=tuple(range(1, g.ndim))))[0]
                failures.append(f"{pre}{k}: rows {rows[:10].tolist()} differ")
            continue
        same = (g == want) | (np.isnan(g) & np.isnan(want))
        if k not in F32_STATE:
            bits_same += int(same.sum())
            bits_total += same.size
        fin = np.isfinite(want)
        if not (np.array_equal(np.isfinite(g), fin) and np.all(same[~fin])):
            failures.append(f"{pre}{k}: non-finite entries differ")
            continue
        diff = float(np.max(np.abs(g[fin] - want[fin]), initial=0.0))
        if k in F32_STATE:
            limit = F32_REL * float(np.max(np.abs(want[fin]), initial=0.0))
            if diff > limit:
                failures.append(f"{pre}{k}: max diff {diff:.3g} > f32 bound {limit:.3g}")
        elif diff > bar(want[fin]):
            failures.append(f"{pre}{k}: max diff {diff:.3g} > bar {bar(want[fin]):.3g}")
    return failures, bits_same, bits_total


@pytest.mark.parametrize("name", GOLDENS)
def test_replay_golden(reference_golden, name):
    """Every index row identical and every float element bit-identical: the reference's own
    product orders."""
    failures, same, total = replay(reference_golden(name))
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:15])
    assert same == total, f"only {same / total:.4%} of float elements bit-identical"


@pytest.mark.parametrize("path", ["default", "blas-tier"])
def test_replay_prod_dev_exactly_on_every_tier(reference_golden, path):
    """Production head shapes, in the reference's own product orders: every index row and every
    float element identical, on this CPU's tier and on the ``blas`` tier (a CPU without
    AVX512-BF16, whose bf16 products run on the FMA twin of ``vdpbf16ps``)."""
    rows_same = rows_total = el_same = el_total = 0
    # Captures may be views of the stack's live state: each is counted before the next step.
    with use_backend("blas" if path == "blas-tier" else backend()):
        for _pre, k, g, want in iter_captures(reference_golden("prod_dev")):
            assert g.shape == want.shape, f"{_pre}{k}: shape {g.shape} != {want.shape}"
            if k in INDEX_KEYS:
                eq = np.all(g.astype(np.int64).reshape(len(g), -1)
                            == want.astype(np.int64).reshape(len(want), -1), axis=1)
                rows_same += int(eq.sum())
                rows_total += eq.size
            else:
                eq = (g == want) | (np.isnan(g) & np.isnan(want))
                el_same += int(eq.sum())
                el_total += eq.size
    assert rows_total > 8000 and el_total > 10**6
    assert rows_same == rows_total, f"index rows identical: {rows_same / rows_total:.4%}"
    assert el_same == el_total, f"float elements identical: {el_same / el_total:.4%}"


@pytest.mark.parametrize("name", ["tiny", "mixed"])
def test_replay_golden_without_avx512_bf16(reference_golden, name):
    """A CPU without AVX512-BF16 (the ``blas`` tier: bf16 products on FMAs, index scores on
    numpy's BLAS): the same goldens, bit for bit."""
    with use_backend("blas"):
        failures, same, total = replay(reference_golden(name))
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:15])
    assert same == total, f"only {same / total:.4%} of float elements bit-identical"


@pytest.mark.parametrize("name", ["mixed", "prod_dev"])
def test_replay_with_wq_b_read_beside_the_indexer(reference_golden, monkeypatch, name):
    """Each index source's decode product of ``wq_b`` read on a second thread while its indexer
    runs on one (as production weights are whenever numba runs two threads; here every weight,
    ``BESIDE_MIN_BYTES`` 0): the goldens bit for bit."""
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: nothing runs beside")
    from ds41numba.numerics import linear, matvec
    beside = []
    real = matvec.work_beside
    monkeypatch.setattr(linear, "BESIDE_MIN_BYTES", 0)
    monkeypatch.setattr(matvec, "work_beside", lambda *a: beside.append(a[0]) or real(*a))
    failures, same, total = replay(reference_golden(name))
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:15])
    assert same == total, f"only {same / total:.4%} of float elements bit-identical"
    d = reference_golden(name)
    sources = sum(d.config.ratio(i) > 0 and d.config.is_index_source(i)
                  for i in range(d.config.n_layers))
    assert len(beside) == sources * d.run.decode > 0


# =============================================================================== thread counts


SCRIPT = r"""
import hashlib, sys
import numba
import numpy as np
from threadpoolctl import threadpool_limits
from ds41numba import AttentionStack
from ds41numba.golden import load_golden

info, d = load_golden(sys.argv[1])
cfg = info.config
for pair in sys.argv[2:]:
    numba_threads, blas_threads = map(int, pair.split(","))
    numba.set_num_threads(numba_threads)
    with threadpool_limits(blas_threads):
        stack = AttentionStack(cfg, {k: v for k, v in d.items() if k.startswith("layers.")})
        h = hashlib.sha256()
        for s in range(1 + min(info.decode, 12)):
            start = 0 if s == 0 else info.prefill + s - 1
            for i in range(cfg.n_layers):
                run = stack.forward(i, d[f"step{s}.layers.{i}.x"], start, capture=True)
                for a in (run.out, run.q, run.kv_rows, run.idx, run.o, run.index_score,
                          stack.shared.topk_idxs, stack.shared.candidates):
                    if a is not None:
                        h.update(np.ascontiguousarray(a).tobytes())
    print(h.hexdigest())
"""


def digests(pairs, bf16_dot="1"):
    """The mixed golden's run digested once per ``(numba threads, BLAS threads)`` pair, all in
    one process started with 2 of each (the counts set for each run: one process start, not
    one a pair)."""
    env = dict(os.environ, NUMBA_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2",
               DS41NUMBA_BF16_DOT=bf16_dot)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(DATA / "mixed.npz"),
                          *(f"{n},{b}" for n, b in pairs)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_outputs_do_not_depend_on_thread_counts():
    one, *others = digests([(1, 1), (2, 2), (2, 1), (1, 2)])
    assert len(one) == 64
    assert others == [one] * 3
    # Without AVX512-BF16: thread-independent as well.
    blas = digests([(1, 1), (2, 2)], bf16_dot="0")
    assert blas[1] == blas[0]


# =============================================================================== a run's structure


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stack_structural_invariants(seed):
    """A random small stack (ratios 0, 3, 3, 1, 1; kv sources 1, 3; index sources 1, 3, 4;
    candidate source 3) over a prefill and decode steps: window rows, compressed entries in range
    or -1, sorted, as many as min(index_topk, end_pos // r), kv rows, shared selections."""
    rng = np.random.default_rng(seed)
    win = int(rng.integers(2, 10))
    topk = int(rng.integers(1, 7))
    cfg = random_config(compress_ratios=[0, 3, 3, 1, 1], kv_source_layers=[1, 3],
                        index_source_layers=[1, 3, 4], candidate_source_layer=3,
                        candidate_topk_blocks=int(rng.integers(1, 4)),
                        candidate_block_size=int(rng.integers(1, 4)), index_topk=topk,
                        window_size=win, n_heads=2, o_groups=2)
    stack = AttentionStack(cfg, random_weights(cfg, seed))
    P = int(rng.integers(1, 20))
    hd = cfg.head_dim
    prev_idx = {}
    for start_pos, seqlen, i, run in captured_steps(stack, cfg, P, 12, rng):
        r = cfg.ratio(i)
        end_pos = start_pos + seqlen
        offset = seqlen if start_pos == 0 else win
        nwin = min(seqlen, win) if start_pos == 0 else win
        width = end_pos // r if r else 0
        k = min(topk, width) if r else 0
        assert run.idx.dtype == np.int32 and run.idx.shape == (seqlen, nwin + k)
        assert run.kv_rows.shape == (offset + width, hd)
        assert np.array_equal(run.idx[:, :nwin], np.broadcast_to(
            naive.window_index_rows(start_pos, seqlen, win), (seqlen, nwin)))
        if not r:
            continue
        assert np.array_equal(run.kv_rows[offset:], stack.shared.compress_kv[:width])
        comp = run.idx[:, nwin:].astype(np.int64)
        clen = naive.visible_lengths(start_pos, seqlen, r)
        for s in range(seqlen):
            row = comp[s]
            valid = row[row >= 0]
            n_valid = len(valid)
            assert np.all(row[n_valid:] == -1), f"-1 before a valid entry: {row}"
            assert np.all(np.diff(valid) > 0), f"not sorted ascending: {row}"
            assert np.all((valid >= offset) & (valid < offset + clen[s])), (s, row, clen[s])
            if cfg.uses_candidates(i) and start_pos == 0:
                assert n_valid <= min(k, clen[s])
            else:
                assert n_valid == min(k, clen[s]), (i, start_pos, s, row)
        if cfg.is_index_source(i) and width == 0:
            assert run.index_score is None and stack.shared.topk_idxs.shape == (seqlen, 0)
        elif cfg.is_index_source(i):
            cands = stack.shared.candidates if cfg.uses_candidates(i) else None
            want = naive.indexer_topk_idxs(run.index_score, clen, k, offset, candidates=cands)
            assert np.array_equal(comp, want), (i, start_pos)
            if cfg.is_candidate_source(i):
                assert np.array_equal(stack.shared.candidates, naive.select_candidate_blocks(
                    run.index_score, clen, cfg.candidate_topk_blocks, cfg.candidate_block_size))
        else:
            # layer 2 reuses layer 1's selection
            assert np.array_equal(comp, prev_idx[cfg.index_source_of(i)])
        prev_idx[i] = comp


# =============================================================================== step order


TINY = preset("tiny")       # ratios 0,0,2,2,1,1; kv 2,4; index 2,4,5; candidate source 4


@pytest.fixture(scope="module")
def tiny_weights():
    return make_weights(TINY, None, 7)


def test_decode_must_follow_the_layers_last_position(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, xs(1), 5), ValueError, "layer 0", "prefill at start_pos 0")
    run_steps(st, 6, 2)                                   # positions 0..7 done
    for bad in (7, 9, 20):
        refused(lambda: st.forward(0, xs(1), bad), ValueError, f"start_pos {bad}", "expected start_pos 8")
    st.forward(0, xs(1), 8)


def test_positions_past_max_seq_len(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)              # max_seq_len 64
    refused(lambda: st.forward(0, xs(65), 0), ValueError, "max_seq_len 64")
    run_steps(st, 60, 4)                                  # ends exactly at max_seq_len
    for i in range(TINY.n_layers):
        refused(lambda: st.forward(i, xs(1), 64), ValueError, "past max_seq_len 64")


def test_a_run_can_end_exactly_at_max_seq_len_for_every_ratio():
    cfg = AttnConfig(dim=32, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=8, o_lora_rank=8,
                     o_groups=2, window_size=3, compress_ratios=[0, 7, 3, 1],
                     kv_source_layers=[1, 2, 3], index_source_layers=[1, 2, 3], index_n_heads=1,
                     index_head_dim=32, index_topk=4, original_seq_len=16, max_seq_len=23)
    st = AttentionStack(cfg, make_weights(cfg, None, 1))
    outs = run_steps(st, 20, 3)
    assert all(np.isfinite(o).all() for o in outs.values())
    refused(lambda: st.forward(1, xs(1, dim=32), 23), ValueError, "max_seq_len")


def test_zero_length_and_undeclared_chunks_are_refused(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, xs(0), 0), ValueError, "empty")
    run_steps(st, 4, 0)
    # Several tokens after position 0 are a chunk of a prefill only when it says so
    # (prefill_len, tests/test_chunked.py); after a complete prefill they are refused.
    refused(lambda: st.forward(0, xs(3), 4), ValueError, "start_pos 4", "prefill_len=P")
    st.forward(0, xs(1), 4)


def test_consumer_before_its_source_is_refused(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(3, xs(6), 0), ValueError, "layer 3", "layer 2", "run sources first")
    refused(lambda: st.forward(5, xs(6), 0), ValueError, "layer 5", "layer 4")
    for i in range(TINY.n_layers):
        st.forward(i, xs(6, i), 0)
    st.forward(2, xs(1), 6)
    refused(lambda: st.forward(5, xs(1), 6), ValueError, "layer 5", "layer 4", "start_pos 6")


def test_layers_run_in_order_within_a_step(tiny_weights):
    """A later layer overwrites the shared slots an earlier one reads: out of order is refused."""
    st = AttentionStack(TINY, tiny_weights)
    st.forward(2, xs(6, 2), 0)
    st.forward(4, xs(6, 4), 0)        # layer 4 (ratio 1) now holds compress_kv and topk_idxs
    msg = refused(lambda: st.forward(3, xs(6, 3), 0), ValueError, "layer 3", "layer 2")
    assert "again first" in msg
    st.forward(2, xs(6, 2), 0)        # restarting the step from layer 2 is fine
    st.forward(3, xs(6, 3), 0)
    st.forward(4, xs(6, 4), 0)
    st.forward(5, xs(6, 5), 0)
    st.forward(2, xs(1), 6)
    st.forward(4, xs(1), 6)
    refused(lambda: st.forward(3, xs(1), 6), ValueError, "layer 3", "layer 4 already ran this step")


def test_rerunning_a_consumer_after_later_layers_is_refused(tiny_weights):
    """Before: layer 3 re-run after layers 4 and 5 read layer 4's ratio-1 selection (an
    IndexError in sparse_attn, or silently the wrong rows)."""
    st = AttentionStack(TINY, tiny_weights)
    for i in range(TINY.n_layers):
        st.forward(i, xs(12, i), 0)
    refused(lambda: st.forward(3, xs(12, 3), 0), ValueError, "layer 3", "layer 2")


def test_an_index_source_needs_every_key_owner_it_may_fall_back_on(tiny_weights):
    """Layer 2 (ratio 2) writes no index keys on decode steps that complete no group; it then
    scores against the keys layer 4 (ratio 1) left, as the reference does (tiny golden)."""
    assert TINY.fallback_key_owners(2) == [4] and TINY.fallback_key_owners(4) == []
    refused(lambda: AttentionStack(TINY, tiny_weights, layers=[2, 3]), ValueError,
            "layer 2 needs layer 4")
    with pytest.raises(GoldenError, match=r"lacks layer 4 \(layer 2's key owner"):
        GoldenPlan(config=TINY, layers=(2, 3), prefill=6, decode=3)
    st = AttentionStack(TINY, tiny_weights, layers=[2, 3, 4])
    st.forward(2, xs(6), 0)
    st.forward(3, xs(6), 0)
    # end_pos 7 is odd: layer 2 writes no keys and would score against layer 4's, never computed.
    refused(lambda: st.forward(2, xs(1), 6), ValueError, "layer 2", "key owner layer 4",
            "previous step")
    st.forward(4, xs(6), 0)
    for p in (6, 7):                 # now every key owner is caught up
        for i in (2, 3, 4):
            st.forward(i, xs(1, p), p)
    st.forward(2, xs(1), 8)          # end_pos 9: layer 4 ran the previous step, fine
    st.forward(3, xs(1), 8)
    # Skip layer 4 this step: the next fallback step of layer 2 (end_pos 11) is refused.
    st.forward(2, xs(1), 9)
    refused(lambda: st.forward(2, xs(1), 10), ValueError, "layer 2 writes no index keys this step")


def test_subset_stacks_reproduce_the_full_stack(reference_golden):
    """With every source and fallback key owner in it, a layer subset gives the tiny golden's
    index rows exactly (a subset without layer 4 differed on 18 of 40 decode steps)."""
    d = reference_golden("tiny")
    st = AttentionStack(d.config, d.weights, layers=[2, 3, 4])
    for s in range(1 + d.run.decode):
        p = d.start_pos(s)
        for i in (2, 3, 4):
            run = st.forward(i, d[f"step{s}.layers.{i}.x"], p, capture=True)
            assert np.array_equal(run.idx, d[f"step{s}.layers.{i}.idx"]), (s, i)


def test_keys_of_another_ratio_too_short_are_refused():
    """Ratio 7 then ratio 2, both key owners: at end_pos 7 layer 1 writes no keys and would
    score 3 positions against layer 0's 1-row cache (max_seq_len // 7)."""
    cfg = AttnConfig(dim=32, n_heads=1, head_dim=32, rope_head_dim=2, q_lora_rank=8, o_lora_rank=4,
                     o_groups=1, window_size=1, compress_ratios=[7, 2], kv_source_layers=[0, 1],
                     index_source_layers=[0, 1], index_n_heads=1, index_head_dim=32, index_topk=1,
                     original_seq_len=0, max_seq_len=7)
    st = AttentionStack(cfg, make_weights(cfg, None, 0))
    for p in range(0, 6):
        st.forward(0, xs(1, p, 32), p)
        st.forward(1, xs(1, p, 32), p)
    st.forward(0, xs(1, 6, 32), 6)
    refused(lambda: st.forward(1, xs(1, 6, 32), 6), ValueError, "layer 1 (ratio 2)",
            "layer 0 (ratio 7)", "only 1 rows")


def test_a_refused_call_changes_nothing(tiny_weights):
    """Before: a refused prefill had already replaced the layer's state with a fresh one."""
    a, b = AttentionStack(TINY, tiny_weights), AttentionStack(TINY, tiny_weights)
    run_steps(a, 5, 2, seed=3)
    run_steps(b, 5, 2, seed=3)
    refused(lambda: a.forward(3, xs(4), 0), ValueError, "layer 3")      # no layer 2 prefill
    refused(lambda: a.forward(3, xs(2), 7), ValueError, "prefill_len")
    refused(lambda: a.forward(3, xs(2), 7, prefill_len=9), ValueError, "does not continue")
    refused(lambda: a.forward(2, xs(1).astype(np.float64), 7), ValueError, "float32")
    rng = np.random.default_rng(9)
    for i in range(TINY.n_layers):
        x = random_x(rng, 1, TINY.dim)
        assert np.array_equal(a.forward(i, x, 7).out, b.forward(i, x, 7).out), i


def test_a_prefill_restarted_at_an_earlier_layer_makes_later_prefills_stale():
    """Found by fuzzing: prefill layer 2 then layer 1 (a new sequence from layer 1), then decode
    in order. Layer 2's prefill now predates layer 1's, so the index keys layer 1 falls back on
    (ratio 2, odd end_pos: layer 2's, written before the restart in layer order) were not the
    reference's; the decode returned a different output. Now refused until layer 2 reruns."""
    cfg = AttnConfig(dim=32, n_heads=1, head_dim=32, rope_head_dim=2, q_lora_rank=8, o_lora_rank=4,
                     o_groups=1, window_size=1, compress_ratios=[0, 2, 1], kv_source_layers=[1, 2],
                     index_source_layers=[1, 2], index_n_heads=1, index_head_dim=32, index_topk=1,
                     original_seq_len=0, max_seq_len=11)
    st = AttentionStack(cfg, make_weights(cfg, None, 0))
    x = {i: xs(10, i, 32) for i in range(3)}
    st.forward(2, x[2], 0)
    st.forward(1, x[1], 0)                       # restarts the prefill at layer 1
    refused(lambda: st.forward(1, xs(1, 6, 32), 10), ValueError, "key owner layer 2")
    refused(lambda: st.forward(2, xs(1, 7, 32), 10), ValueError, "layer 2", "prefill layer 2 again")
    st.forward(2, x[2], 0)                       # layer 2 again, after layer 1: in order now
    ref = AttentionStack(cfg, make_weights(cfg, None, 0))
    for i in (1, 2):
        ref.forward(i, x[i], 0)
    for i in (1, 2):
        y = xs(1, 10 + i, 32)
        assert np.array_equal(st.forward(i, y, 10).out, ref.forward(i, y, 10).out)


# =============================================================================== x and arguments


@pytest.mark.parametrize("bad, words", [
    (lambda x: x.astype(np.float64), ["x must be float32", "float64"]),
    (lambda x: x.astype(np.float16), ["float16"]),
    (lambda x: x.astype(np.int32), ["int32"]),
    (lambda x: x.tolist(), ["float64"]),
    (lambda x: x[:, :-1], ["shape [seqlen, 64]", "[6, 63]"]),
    (lambda x: x[None], ["[1, 6, 64]"]),
    (lambda x: x[0], ["[64]"]),
    (lambda x: x + np.float32(2.0 ** -10), ["bf16 values"]),
])
def test_bad_x(tiny_weights, bad, words):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, bad(xs(6)), 0), ValueError, *words)


def test_x_layouts_and_bf16_dtype_give_the_same_bits(tiny_weights):
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    ro = x.copy()
    ro.setflags(write=False)
    for variant in (np.asfortranarray(x), np.repeat(x, 2, axis=1)[:, ::2], ro,
                    x.astype(ml_dtypes.bfloat16)):
        got = AttentionStack(TINY, tiny_weights).forward(2, variant, 0).out
        assert np.array_equal(got, want)


def test_weights_as_float32_or_bfloat16_give_the_same_bits(tiny_weights):
    """A projection given as float32 bf16 values (checked and taken apart in one pass) or as
    ``ml_dtypes.bfloat16`` is held alike; a NaN in one is kept (the slower way), and a value
    that is not bf16 is refused by the weight's name."""
    kinds = {n: k for i in range(TINY.n_layers) for n, (_, k) in weight_specs(TINY, i).items()}
    as_bf16 = {n: a.astype(ml_dtypes.bfloat16) if kinds[n] == "bf16" and a.ndim == 2 else a
               for n, a in tiny_weights.items()}
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    assert np.array_equal(AttentionStack(TINY, as_bf16).forward(2, x, 0).out, want)
    name = "layers.2.attn.wo_b.weight"
    with_nan = dict(tiny_weights, **{name: tiny_weights[name].copy()})
    with_nan[name][1, 3] = np.nan
    got = AttentionStack(TINY, with_nan).forward(2, x, 0).out
    assert np.isnan(got[:, 1]).all() and np.array_equal(np.delete(got, 1, 1), np.delete(want, 1, 1))
    off = dict(tiny_weights, **{name: tiny_weights[name].copy()})
    off[name][0, 0] = np.float32(1 + 2 ** -10)
    refused(lambda: AttentionStack(TINY, off), ValueError, name, "bf16 values")


@pytest.mark.parametrize("call, exc, words", [
    (lambda st: st.forward(6, xs(2), 0), ValueError, ["layer 6 is not in this stack"]),
    (lambda st: st.forward(-1, xs(2), 0), ValueError, ["layer -1"]),
    (lambda st: st.forward(1.0, xs(2), 0), TypeError, ["layer_id must be an int"]),
    (lambda st: st.forward(True, xs(2), 0), TypeError, ["layer_id"]),
    (lambda st: st.forward(0, xs(2), 0.0), TypeError, ["start_pos must be an int"]),
    (lambda st: st.forward(0, xs(2), None), TypeError, ["start_pos"]),
    (lambda st: st.forward(0, xs(1), -3), ValueError, ["start_pos must be >= 0"]),
])
def test_bad_layer_and_position_arguments(tiny_weights, call, exc, words):
    refused(lambda: call(AttentionStack(TINY, tiny_weights)), exc, *words)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(tile=-1), ValueError, ["tile"]),      # before: range(0, n, -1) left `out` uninitialised
    (dict(tile=0), ValueError, ["tile"]),
    (dict(tile=2.5), ValueError, ["tile"]),
    (dict(layers=[1.5, 2]), TypeError, ["1.5"]),  # before: silently layer 1
    (dict(layers=["a"]), TypeError, ["'a'"]),
    (dict(layers=7), TypeError, ["layers"]),
    (dict(layers=[9]), ValueError, ["layers: 9"]),
    (dict(layers=[5]), ValueError, ["layer 5 needs layer 4"]),
])
def test_bad_stack_arguments(tiny_weights, kw, exc, words):
    refused(lambda: AttentionStack(TINY, tiny_weights, **kw), exc, *words)


def test_tile_sizes_keep_outputs_sane(tiny_weights):
    for tile in (1, 3, 64):
        st = AttentionStack(TINY, tiny_weights, tile=tile)
        outs = run_steps(st, 10, 2)
        assert all(np.isfinite(o).all() for o in outs.values())


# =============================================================================== weights


def _weights_with(tiny_weights, name, value):
    w = dict(tiny_weights)
    if value is None:
        del w[name]
    else:
        w[name] = value
    return w


@pytest.mark.parametrize("name", ["layers.0.attn.wq_a.weight", "layers.2.attn.compressor.wgate.weight",
                                  "layers.4.attn.indexer.wk.weight", "layers.5.attn.attn_sink",
                                  "layers.2.attn.q_norm.weight"])
def test_missing_or_misshapen_weights(tiny_weights, name):
    a = tiny_weights[name]
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, None)), ValueError,
            name, "missing")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a[..., :-1])),
            ValueError, name, "shape")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a[None])),
            ValueError, name, "shape")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a.astype(np.int32))),
            ValueError, name, "dtype")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a.astype(np.complex64))),
            ValueError, name, "dtype")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, np.array("x"))),
            ValueError, name)


def test_bf16_weights_must_hold_bf16_values(tiny_weights):
    name = "layers.3.attn.wo_b.weight"
    bad = tiny_weights[name] + np.float32(2.0 ** -12)
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, bad)), ValueError,
            name, "bf16 values")
    # The f32 parameters take any float32 value.
    name = "layers.2.attn.compressor.wkv.weight"
    AttentionStack(TINY, _weights_with(tiny_weights, name, tiny_weights[name] + np.float32(2.0 ** -12)))


def test_weights_in_other_float_dtypes_and_layouts(tiny_weights):
    w = {k: (v.astype(ml_dtypes.bfloat16) if weight_kind(k) == "bf16" else np.asfortranarray(v))
         for k, v in tiny_weights.items()}
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    assert np.array_equal(AttentionStack(TINY, w).forward(2, x, 0).out, want)


class _LazyWeights:
    """A mapping that makes each weight on request (a fresh array, as a loader would read it) and
    records, at each request, which of the bf16 projections it handed out are still alive. Run
    with the cycle collector off: what is alive then is what reference counting alone keeps, as
    during a real load (a full collection at each request took 8-26 s of the suite)."""

    def __init__(self, weights, dtype_of):
        self.weights, self.dtype_of = weights, dtype_of
        self.handed, self.alive_at_request, self.asked = {}, [], []

    def get(self, name):
        self.alive_at_request.append([n for n, r in self.handed.items() if r() is not None])
        self.asked.append(name)
        a = self.weights[name].astype(self.dtype_of(name))      # a new array every time
        if a.ndim == 2 and weight_kind(name) == "bf16":
            self.handed[name] = weakref.ref(a)
        return a


def test_a_lazy_mapping_has_one_weight_alive_at_a_time(tiny_weights):
    """The stack asks for each weight once and keeps none of the bf16 projections it was handed
    (it holds them as pairs), so a loader that reads each tensor on request has at most the one
    being wrapped alive; the results are those of the plain dict. (The genuine f32 parameters
    are kept as given: they are what the stack holds.)"""
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    names = sorted(n for i in range(TINY.n_layers) for n in weight_specs(TINY, i))
    for dtype_of in (lambda name: np.float32,
                     lambda name: ml_dtypes.bfloat16 if weight_kind(name) == "bf16" else np.float32):
        lazy = _LazyWeights(tiny_weights, dtype_of)
        gc.disable()
        try:
            st = AttentionStack(TINY, lazy)
        finally:
            gc.enable()
        assert sorted(lazy.asked) == names and len(lazy.handed) == 39
        assert all(alive == [] for alive in lazy.alive_at_request)
        gc.collect()
        assert all(r() is None for r in lazy.handed.values())
        assert np.array_equal(st.forward(2, x, 0).out, want)


def test_weight_bytes_are_two_a_bf16_parameter(tiny_weights):
    from ds41numba.numerics import Bf16Matrix
    from ds41numba.stack import held_weight_bytes

    st = AttentionStack(TINY, tiny_weights)
    assert st.weight_bytes() == held_weight_bytes(TINY, range(TINY.n_layers))
    padded = 0      # 2 bytes a parameter, each group's rows padded to 32, an odd width to even
    for name, (shape, kind) in ((n, v) for i in range(TINY.n_layers) for n, v in weight_specs(TINY, i).items()):
        if kind == "bf16" and len(shape) == 2:
            groups = TINY.o_groups if name.endswith("wo_a.weight") else 1
            padded += groups * (-(-shape[0] // groups // 32) * 32) * (shape[1] + shape[1] % 2) * 2
    held = sum(w.nbytes for i in st.weights for w in vars(st.weights[i]).values()
               if isinstance(w, Bf16Matrix))
    held += sum(w.nbytes for i in st.weights for part in (st.weights[i].compressor, st.weights[i].indexer)
                if part is not None for w in vars(part).values() if isinstance(w, Bf16Matrix))
    assert held == padded
    # 43 v41-flash layers now fit in 24 GB of weights.
    flash = preset("v41-flash")
    assert held_weight_bytes(flash, range(flash.n_layers)) < 12 * 2 ** 30


def weight_kind(name):
    i = int(name.split(".")[1])
    return weight_specs(TINY, i)[name][1]


def test_weights_must_be_a_mapping_and_config_an_attnconfig(tiny_weights):
    refused(lambda: AttentionStack(TINY, list(tiny_weights.values())), TypeError, "mapping")
    refused(lambda: AttentionStack(TINY.to_dict(), tiny_weights), TypeError, "AttnConfig")


def test_snapshot_restores_a_stack_where_it_stood(tmp_path):
    """A pickled snapshot of a prefilled stack, restored into a fresh stack of the same weights,
    decodes exactly as the original does (the decode benchmark and checkpoints rely on it)."""
    cfg = preset("tiny")
    weights = make_weights(cfg, seed=3)
    first, second = AttentionStack(cfg, weights), AttentionStack(cfg, weights)
    rng = np.random.default_rng(3)
    for i in range(cfg.n_layers):
        first.forward(i, to_bf16_rne(rng.standard_normal((12, cfg.dim)).astype(np.float32)), 0)
    second.restore(pickle.loads(pickle.dumps(first.snapshot())))
    x = to_bf16_rne(rng.standard_normal((1, cfg.dim)).astype(np.float32))
    for i in range(cfg.n_layers):
        a, b = first.forward(i, x, 12), second.forward(i, x, 12)
        assert np.array_equal(a.out.view(np.uint32), b.out.view(np.uint32))
    with pytest.raises(ValueError, match="follow"):
        AttentionStack(cfg, weights).forward(0, x, 12)
