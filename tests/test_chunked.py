"""Chunked prefill (``AttentionStack.forward(..., prefill_len=P)``): a prefill given as
consecutive chunks is the one-shot prefill, byte for byte: every output, index row, capture,
state and shared slot, for any chunk sizes (1-row chunks, chunks that split a compression group
or a candidate block), run token-major (chunk 1 through every layer, then chunk 2) or layer by
layer, on both product backends; and the decode steps after it are the same too.
"""

import numpy as np
import pytest

from helpers import refused
from ds41numba import AttentionStack, preset
from ds41numba.numerics import use_backend

GOLDENS = ["tiny", "mixed", "edge_prefill1", "edge_prefill_window", "edge_r128_short",
           "edge_r128_groups"]
ROWS = ("out", "idx", "q", "o", "index_score", "topk", "candidates")


def _record(stack, i, run, rec, decode_step=None):
    """What layer i's step left, by name: per-row tensors as lists of row blocks."""
    sh = stack.shared
    key = f"{decode_step}." if decode_step is not None else ""
    got = {"out": run.out, "idx": run.idx, "q": run.q, "o": run.o, "index_score": run.index_score}
    c = stack.config
    # After a chunked prefill the selection and candidate slots hold the last chunk's rows
    # until a layer of the decode step replaces them (what the decode's layers read is the
    # same): a decode step's slots are compared only once it wrote them.
    fresh_topk = decode_step is None or any(c.is_index_source(j) for j in range(i + 1))
    fresh_cands = decode_step is None or 0 <= c.candidate_source_layer <= i
    if c.ratio(i):
        if fresh_topk:
            got["topk"] = sh.topk_idxs
        if sh.candidate_blocks is not None and fresh_cands:
            got["candidates"] = sh.candidates
    for k, v in got.items():
        if v is not None:
            rec.setdefault(f"{key}{i}.{k}", []).append(np.array(v))


def _final(stack, rec, P):
    sh = stack.shared
    for i in stack.layers:
        st = stack.states[i]
        rec[f"{i}.window_kv"] = [st.window_kv.copy()]
        if st.kv_state is not None:
            rec[f"{i}.kv_state"] = [st.kv_state.copy()]
            rec[f"{i}.score_state"] = [st.score_state.copy()]
        if st.compress_cache is not None:
            rec[f"{i}.compress_cache"] = [st.compress_cache.copy()]
        if st.index_cache is not None:
            rec[f"{i}.index_cache"] = [st.index_cache.keys.copy()]
    if sh.index_k is not None:
        rec["shared.index_k"] = [sh.index_k.keys.copy()]
    if sh.compress_kv is not None:
        rec["shared.compress_kv"] = [sh.compress_kv.copy()]


def run(weights, cfg, xs, P, cuts=None, decode=(), token_major=True):
    """The prefill (one-shot when ``cuts`` is None, else chunks ending at ``cuts``), then the
    decode inputs ``decode[s][i]``; returns ``{name: array}``."""
    stack = AttentionStack(cfg, weights)
    rec = {}
    bounds = [0] + list(cuts or [P])
    pieces = list(zip(bounds[:-1], bounds[1:]))
    order = ([(a, b, i) for a, b in pieces for i in stack.layers] if token_major
             else [(a, b, i) for i in stack.layers for a, b in pieces])
    for a, b, i in order:
        if cuts is None:
            r = stack.forward(i, xs[i], 0, capture=True)
        else:
            r = stack.forward(i, xs[i][a:b], a, capture=True, prefill_len=P)
        _record(stack, i, r, rec)
    _final(stack, rec, P)
    for s, row in enumerate(decode):
        for i in stack.layers:
            r = stack.forward(i, row[i], P + s, capture=True)
            _record(stack, i, r, rec, decode_step=s)
    return {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in rec.items()}


def assert_same(want, got, what):
    assert want.keys() == got.keys(), f"{what}: {sorted(set(want) ^ set(got))}"
    for k in want:
        w, g = want[k], got[k]
        assert w.shape == g.shape, f"{what}: {k} shape {g.shape} != {w.shape}"
        assert w.dtype == g.dtype and w.tobytes() == g.tobytes(), (
            f"{what}: {k} differs in {int(np.sum(w.view(np.uint8) != g.view(np.uint8)))} bytes")


def schedules(P, cfg):
    """Chunk ends: 1-row chunks (short prefills), chunks that split groups and blocks, halves."""
    out = {"halves": [P // 2, P] if P > 1 else [P]}
    r = max([cfg.ratio(i) for i in range(cfg.n_layers)] + [1])
    out["odd"] = sorted(set(list(range(3, P, 7)) + [P]))
    out["groups"] = sorted(set([c for c in (r - 1, r + 1, 2 * r + 3, cfg.window_size + 1) if 0 < c < P] + [P]))
    if P <= 40:
        out["rows"] = list(range(1, P + 1))
    return out


def golden_inputs(d):
    cfg = d.config
    xs = {i: d[f"step0.layers.{i}.x"] for i in range(cfg.n_layers)}
    dec = [{i: d[f"step{s}.layers.{i}.x"] for i in range(cfg.n_layers)} for s in range(1, min(d.run.decode, 3) + 1)]
    return cfg, xs, dec


@pytest.mark.parametrize("name", GOLDENS)
def test_chunked_prefill_is_the_one_shot_prefill(reference_golden, name):
    d = reference_golden(name)
    cfg, xs, dec = golden_inputs(d)
    P = d.run.prefill
    want = run(d.weights, cfg, xs, P, decode=dec)
    for label, cuts in schedules(P, cfg).items():
        assert_same(want, run(d.weights, cfg, xs, P, cuts, decode=dec), f"{name} {label} {cuts}")


@pytest.mark.parametrize("name", ["tiny", "mixed"])
def test_chunked_prefill_on_blas_and_layer_major(reference_golden, name):
    d = reference_golden(name)
    cfg, xs, dec = golden_inputs(d)
    P = d.run.prefill
    with use_backend("blas"):
        want = run(d.weights, cfg, xs, P, decode=dec)
        for label, cuts in schedules(P, cfg).items():
            assert_same(want, run(d.weights, cfg, xs, P, cuts, decode=dec), f"blas {name} {label}")


def test_layer_major_chunks_are_refused_where_a_layer_reads_another(reference_golden):
    """A chunk reads what its sources published for the same chunk: layer by layer (every
    chunk of layer 2, then layer 3) is refused, not run on the wrong rows."""
    d = reference_golden("tiny")
    cfg, xs, _ = golden_inputs(d)
    stack = AttentionStack(cfg, d.weights)
    for i in (0, 1):
        stack.forward(i, xs[i][:6], 0, prefill_len=12)
        stack.forward(i, xs[i][6:], 6, prefill_len=12)
    stack.forward(2, xs[2][:6], 0, prefill_len=12)
    stack.forward(2, xs[2][6:], 6, prefill_len=12)
    refused(lambda: stack.forward(3, xs[3][:6], 0, prefill_len=12), ValueError, "layer 2", "run sources first")


def test_ratio0_layers_run_layer_major():
    cfg = preset("tiny")
    from ds41numba.golden import make_weights, make_input
    w = make_weights(cfg, [0, 1])
    xs = {i: make_input(f"x{i}", (40, cfg.dim)) for i in (0, 1)}
    one = AttentionStack(cfg, w, layers=[0, 1])
    want = {i: one.forward(i, xs[i], 0).out for i in (0, 1)}
    st = AttentionStack(cfg, w, layers=[0, 1])
    for i in (0, 1):
        got = np.concatenate([st.forward(i, xs[i][a:b], a, prefill_len=40).out
                              for a, b in ((0, 1), (1, 9), (9, 40))])
        assert got.tobytes() == want[i].tobytes()


def test_chunks_that_do_not_continue_the_sequence_are_refused(reference_golden):
    d = reference_golden("tiny")
    cfg, xs, _ = golden_inputs(d)
    st = AttentionStack(cfg, d.weights)
    x = xs[0]
    refused(lambda: st.forward(0, x[3:6], 3, prefill_len=12), ValueError, "expected a prefill at start_pos 0")
    st.forward(0, x[:4], 0, prefill_len=12)
    refused(lambda: st.forward(0, x[5:8], 5, prefill_len=12), ValueError, "next chunk starts at 4")
    refused(lambda: st.forward(0, x[4:8], 4, prefill_len=13), ValueError, "prefill of 12 tokens")
    refused(lambda: st.forward(0, x[4:8], 4, prefill_len=6), ValueError, "runs past its prefill")
    refused(lambda: st.forward(0, x[4:5], 4), ValueError, "stopped at 4", "prefill_len=12")
    refused(lambda: st.forward(0, x[4:8], 4), ValueError, "prefill_len=P")
    st.forward(0, x[4:], 4, prefill_len=12)
    refused(lambda: st.forward(0, x[:1], 12, prefill_len=12), ValueError, "runs past")
    refused(lambda: st.forward(0, x[:1], 12, prefill_len=13), ValueError, "its prefill was 12 tokens")
    st.forward(0, x[:1], 12)                     # the decode after it
