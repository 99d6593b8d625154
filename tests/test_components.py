"""Focused tests of each attention component against the plain-loop references in naive.py
(section "attention components"), written from SPEC.md.

Covered: the compressor (ratio 1; ratio r > 1 with a prefill shorter than a group, with a
trailing partial group, with whole groups; decode across several group boundaries), the window
index rows and the window ring (filling, wrapping), the candidate blocks, the index scores, the
index selection of a candidate consumer that picks candidate-masked positions (also in the tiny
golden), rows with nothing visible, sparse attention with a sink, the grouped output projection,
and the structural invariants of a prefill + decode run of a small stack.

Exactness: index rows and selections are compared exactly. Float results that go through a BLAS
dot product are compared in bf16 steps (the distance in representable bf16 values): at most one
step anywhere and at least 99.9% identical (the SPEC's "How exact is exact"); the naive versions
sum their dot products exactly, so they do not share any BLAS's order. Results whose sums are
exact in f32 whatever the order (fp4-quantised index scores) must be bit-identical.
"""

import importlib
import json
import os

import numba
import numpy as np
import pytest

import naive
from ds41numba import (AttentionStack, AttnConfig, act_quant_fp8_inplace, apply_rotary,
                       fp4_quant_e4m3_inplace, fp4_quant_e8m0_inplace, linear_bf16, linear_f32,
                       output_projection,
                       select_candidate_blocks,
                       sparse_attn, to_bf16_rne, weight_specs,
                       window_index_rows)
from ds41numba.attention import layer_rope_table
from ds41numba.compressor import CompressorState, CompressorWeights, compressor, latent_positions
from ds41numba.numerics import BF16_DOT, Bf16Matrix, pack_bf16_pairs

# ``ds41numba.indexer`` is the function (the package namespace re-exports it over the module)
indexer_mod = importlib.import_module("ds41numba.indexer")

DATA = os.path.join(os.path.dirname(__file__), "data")
EPS = 1e-20
F32_U = 2.0 ** -24


# =============================================================================== helpers


def bf16_steps(a, b):
    """Elementwise distance of two bf16-valued arrays in bf16 steps (+0 and -0 are 0 apart)."""
    def ordered(x):
        u = (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)
    return np.abs(ordered(a) - ordered(b))


def assert_bf16_close(got, want, what, min_identical=0.999):
    """At most one bf16 step apart everywhere, and at least ``min_identical`` bit-identical."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), f"{what}: non-finite values"
    assert np.array_equal(to_bf16_rne(got), got), f"{what}: not bf16-valued"
    d = bf16_steps(got, want)
    worst = np.unravel_index(np.argmax(d), d.shape) if d.size else ()
    assert d.max(initial=0) <= 1, (f"{what}: {int(d.max())} bf16 steps apart at {worst}: "
                                   f"got {got[worst]!r}, want {want[worst]!r}")
    same = float(np.mean(d == 0)) if d.size else 1.0
    assert same >= min_identical, f"{what}: only {same:.4%} bit-identical"


def bf16(rng, shape, scale=1.0):
    return to_bf16_rne((rng.standard_normal(shape) * scale).astype(np.float32))


def assert_f32_dot_close(got, x, w, what):
    """``got`` holds f32 dot products ``x @ w.T`` summed in some f32 order: within the worst-case
    bound of any order, ``(n - 1) u sum|x_i w_i|``, of the exact value."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    exact = x64 @ w64.T
    bound = (x64.shape[-1] - 1) * F32_U * (np.abs(x64) @ np.abs(w64).T) * 1.0001
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(err <= bound), f"{what}: f32 error {err.max():.3g} beyond the summation bound"


def random_config(**kw):
    base = dict(dim=64, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
                o_groups=1, window_size=8, compress_ratios=[0], kv_source_layers=[],
                index_source_layers=[], candidate_source_layer=-1, candidate_topk_blocks=2,
                candidate_block_size=2, index_n_heads=2, index_head_dim=32, index_topk=4,
                compress_rope_theta=40000.0, rope_factor=2.0, original_seq_len=32, beta_fast=32,
                beta_slow=1, rope_theta=10000.0, norm_eps=EPS, max_seq_len=512)
    base.update(kw)
    return AttnConfig.from_dict(base)


def random_weights(config, seed):
    """Every parameter of every layer: N(0, 1/in) projections, norms near 1, N(0, 1) sinks."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(config.n_layers):
        for name, (shape, kind) in weight_specs(config, i).items():
            if name.endswith("attn_sink"):
                a = rng.standard_normal(shape)
            elif name.endswith("norm.weight"):
                a = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                a = rng.standard_normal(shape) / np.sqrt(shape[-1])
            a = a.astype(np.float32)
            out[name] = to_bf16_rne(a) if kind == "bf16" else a
    return out


def visible(start_pos, seqlen, r):
    """SPEC step 5's clen per query."""
    if start_pos == 0:
        return np.array([(s + 1) // r for s in range(seqlen)], np.int64)
    return np.full(seqlen, (start_pos + seqlen) // r, np.int64)


def compressor_case(ratio, seed, dim=64, hd=32):
    rng = np.random.default_rng(seed)
    if ratio == 1:
        wkv, wgate = bf16(rng, (hd, dim), dim ** -0.5), None
    else:
        wkv = (rng.standard_normal((hd, dim)) * dim ** -0.5).astype(np.float32)
        wgate = (rng.standard_normal((hd, dim)) * dim ** -0.5).astype(np.float32)
    norm = to_bf16_rne((1.0 + 0.1 * rng.standard_normal(hd)).astype(np.float32))
    return rng, CompressorWeights(wkv=wkv, wgate=wgate, norm=norm)


def run_compressor(ratio, weights, x_steps):
    """The package compressor over a prefill and decode steps: latents, positions, state."""
    state = CompressorState.fresh(ratio, weights.wkv.shape[0])
    latents, positions = [], []
    start_pos = 0
    for x in x_steps:
        latents.append(compressor(x, start_pos, ratio, weights, state, EPS))
        positions.append(latent_positions(start_pos, x.shape[0], ratio).tolist())
        start_pos += x.shape[0]
    return latents, positions, state


# =============================================================================== compressor


def test_compressor_ratio_1_one_latent_per_token():
    rng, w = compressor_case(1, seed=1)
    x = bf16(rng, (11, 64))
    steps = [x[:7]] + [x[i:i + 1] for i in range(7, 11)]
    got, got_pos, state = run_compressor(1, w, steps)
    want, want_pos, _, _ = naive.naive_compressor(steps, 1, w.wkv, w.wgate, w.norm, EPS)
    assert state.kv is None and state.score is None
    assert got_pos == want_pos == [list(range(7))] + [[p] for p in range(7, 11)]
    for i, (g, wn) in enumerate(zip(got, want)):
        assert g.shape == (steps[i].shape[0], 32)
        assert_bf16_close(g, wn, f"step {i} latents")


def _prefill_lengths(r):
    """P < r (no latent), P % r != 0 (groups and a trailing partial group), P % r == 0."""
    return sorted({1, r - 1, 2 * r + r // 2 + 1 if r > 2 else 2 * r + 1, 2 * r})


@pytest.mark.parametrize("r", [2, 3, 4, 7, 128])
def test_compressor_prefill_groups_and_state(r):
    rng, w = compressor_case(r, seed=r)
    hd = 32
    for P in _prefill_lengths(r):
        x = bf16(rng, (P, 64))
        (got,), (pos,), state = run_compressor(r, w, [x])
        (want,), (want_pos,), nkv, nscore = naive.naive_compressor([x], r, w.wkv, w.wgate,
                                                                   w.norm, EPS)
        groups, rest = divmod(P, r)
        assert pos == want_pos == [g * r for g in range(groups)]
        if groups == 0:
            assert got is None and want is None, f"P={P} < r={r} must give no latent"
        else:
            assert got.shape == (groups, hd)
            assert_bf16_close(got, want, f"r={r} P={P} latents")
        # Slots 0 .. P%r-1 hold the trailing tokens' kv and score; the others are untouched.
        assert_f32_dot_close(state.kv[:rest], x[P - rest:], w.wkv, f"r={r} P={P} kv state")
        assert_f32_dot_close(state.score[:rest], x[P - rest:], w.wgate, f"r={r} P={P} score state")
        assert np.array_equal(state.kv[rest:], np.zeros((r - rest, hd), np.float32))
        assert np.array_equal(state.score[rest:], np.full((r - rest, hd), -np.inf, np.float32))
        assert np.all(np.isfinite(state.score[:rest]))
        assert_f32_dot_close(nkv[:rest], x[P - rest:], w.wkv, "naive kv state")


@pytest.mark.parametrize("r", [2, 3, 4, 7, 128])
def test_compressor_decode_across_group_boundaries(r):
    rng, w = compressor_case(r, seed=100 + r)
    for P in _prefill_lengths(r):
        n_decode = 3 * r + 2
        x = bf16(rng, (P + n_decode, 64))
        steps = [x[:P]] + [x[p:p + 1] for p in range(P, P + n_decode)]
        got, got_pos, state = run_compressor(r, w, steps)
        want, want_pos, nkv, nscore = naive.naive_compressor(steps, r, w.wkv, w.wgate, w.norm, EPS)
        assert got_pos == want_pos
        made = 0
        for i in range(1, len(steps)):
            start_pos = P + i - 1
            if (start_pos + 1) % r == 0:
                assert got_pos[i] == [start_pos + 1 - r]
                assert got[i] is not None and got[i].shape == (1, 32), (r, P, start_pos)
                assert_bf16_close(got[i], want[i], f"r={r} P={P} decode latent at {start_pos}")
                made += 1
            else:
                assert got[i] is None and want[i] is None and got_pos[i] == [], (r, P, start_pos)
        assert made >= 3, "the decode must cross several group boundaries"
        # The final state: slot p % r holds token p's projections (pooling does not clear it).
        end_pos = P + n_decode
        for slot in range(r):
            p = max(q for q in range(end_pos) if q % r == slot)
            if p < P - P % r:
                # never written since the prefill (a slot of a whole prefill group)
                assert np.all(state.kv[slot] == 0) and np.all(state.score[slot] == -np.inf)
                continue
            assert_f32_dot_close(state.kv[slot], x[p], w.wkv, f"r={r} kv slot {slot}")
            assert_f32_dot_close(state.score[slot], x[p], w.wgate, f"r={r} score slot {slot}")


def test_compressor_decode_latent_pools_its_own_group():
    """A decode latent pools exactly the r tokens start_pos + 1 - r .. start_pos: it equals the
    prefill latent of the same tokens as a whole group."""
    r = 4
    rng, w = compressor_case(r, seed=7)
    x = bf16(rng, (2 * r, 64))
    got, pos, _ = run_compressor(r, w, [x[:r + 1]] + [x[p:p + 1] for p in range(r + 1, 2 * r)])
    assert pos[-1] == [r] and got[-1] is not None
    alone = compressor(x[r:2 * r], 0, r, w, CompressorState.fresh(r, 32), EPS)
    assert_bf16_close(got[-1], alone, "decode latent vs the same group pooled at prefill")


# =============================================================================== window


@pytest.mark.parametrize("win", [1, 3, 8])
def test_window_index_rows_vs_naive(win):
    for P in sorted({1, max(1, win - 1), win, win + 1, 2 * win + 3}):
        got = window_index_rows(0, P, win)
        want = naive.naive_window_index_rows(0, P, win)
        assert got.dtype == np.int32 and np.array_equal(got, want), (win, P)
        # Row t's valid entries are exactly the positions max(0, t - win + 1) .. t.
        for t in range(P):
            assert sorted(got[t][got[t] >= 0]) == list(range(max(0, t - win + 1), t + 1))
        # decode while the ring fills and after several wraps
        for start_pos in range(P, P + 4 * win + 2):
            got = window_index_rows(start_pos, 1, win)
            want = naive.naive_window_index_rows(start_pos, 1, win)
            assert got.shape == (1, win) and np.array_equal(got, want), (win, P, start_pos)
            assert sorted(got[0][got[0] >= 0]) == sorted(
                p % win for p in range(max(0, start_pos - win + 1), start_pos + 1))


@pytest.mark.parametrize("P", [3, 8, 13, 21])
def test_window_ring_through_stack(P):
    """The ring after a prefill shorter than, equal to and longer than the window, and while decode
    fills it and wraps it several times: slot p % win holds the quantised kv row of the newest p."""
    win = 8
    cfg = random_config(window_size=win)
    stack = AttentionStack(cfg, random_weights(cfg, seed=P))
    rng = np.random.default_rng(P)
    run = stack.forward(0, bf16(rng, (P, 64)), 0, capture=True)
    assert run.kv_rows.shape == (P, 32)
    prefill_rows = run.kv_rows.copy()
    assert np.array_equal(run.idx, naive.naive_window_index_rows(0, P, win))
    assert np.array_equal(stack.states[0].window_kv, naive.naive_window_ring(prefill_rows, [], win))
    decode_rows = []
    for start_pos in range(P, P + 3 * win + 3):
        before = stack.states[0].window_kv.copy()
        run = stack.forward(0, bf16(rng, (1, 64)), start_pos, capture=True)
        ring = stack.states[0].window_kv
        assert run.kv_rows.shape == (win, 32)
        assert np.array_equal(run.kv_rows, ring), "decode attends to the whole ring"
        assert np.array_equal(run.idx, naive.naive_window_index_rows(start_pos, 1, win))
        slot = start_pos % win
        others = np.arange(win) != slot
        assert np.array_equal(ring[others], before[others]), "a decode step writes one slot"
        decode_rows.append(ring[slot].copy())
        assert np.array_equal(ring, naive.naive_window_ring(prefill_rows, decode_rows, win))
        # every row is an fp8-quantised row (quantising it again changes nothing)
        assert np.array_equal(act_quant_fp8_inplace(ring.copy()), ring)


# =============================================================================== candidate blocks


def _tie_heavy_scores(rng, rows, width):
    vals = np.array([-np.inf, -1.0, 0.0, 0.5, 1.0, 2.0], np.float32)
    scores = rng.choice(vals, size=(rows, width), p=[0.3, 0.1, 0.2, 0.2, 0.1, 0.1])
    return scores.astype(np.float32)


def test_select_candidate_blocks_vs_naive_tie_heavy():
    rng = np.random.default_rng(3)
    cases = 0
    for _ in range(150):
        width = int(rng.integers(1, 41))
        block = int(rng.integers(1, 6))
        n_blocks = -(-width // block)
        topk_blocks = int(rng.integers(1, n_blocks + 4))     # sometimes > n_blocks
        rows = int(rng.integers(1, 7))
        scores = _tie_heavy_scores(rng, rows, width)
        clen = rng.integers(0, width + 1, size=rows)
        clen[0] = 0                                          # a row with nothing visible
        scores[rows // 2] = -np.inf                          # an all -inf row
        if rng.random() < 0.5:                               # the indexer's visibility mask
            scores[np.arange(width)[None, :] >= clen[:, None]] = -np.inf
        got = select_candidate_blocks(scores, clen, topk_blocks, block)
        want = naive.naive_select_candidate_blocks(scores, clen, topk_blocks, block)
        assert got.shape == (rows, width) and got.dtype == bool
        assert np.array_equal(got, want), (width, block, topk_blocks, clen, scores)
        # the newest visible position is always a candidate; nothing when all is -inf and clen 0
        for s in range(rows):
            if clen[s] > 0:
                assert got[s, clen[s] - 1]
            elif np.all(scores[s] == -np.inf):
                assert not got[s].any()
        cases += 1
    assert cases == 150


def test_select_candidate_blocks_topk_beyond_blocks_keeps_every_finite_block():
    scores = np.array([[1.0, -np.inf, -np.inf, 2.0, 0.0, -np.inf, -np.inf]], np.float32)
    got = select_candidate_blocks(scores, np.array([4]), 10, 2)
    # blocks {0,1} (max 1), {2,3} (pinned), {4,5} (max 0) kept; {6} is all -inf: dropped
    assert got.tolist() == [[True, True, True, True, True, True, False]]
    assert np.array_equal(got, naive.naive_select_candidate_blocks(scores, [4], 10, 2))


# =============================================================================== index scores


def _index_inputs(rng, T, ih, idim, n):
    iq = fp4_quant_e8m0_inplace(bf16(rng, (T, ih, idim)))
    keys = fp4_quant_e8m0_inplace(bf16(rng, (n, idim)))
    w = bf16(rng, (T, ih), 0.2)
    return iq, w, keys


LAYOUTS = {"position-major": 1 << 30, "head-major": 1}
needs_bf16_dot = pytest.mark.skipif(not BF16_DOT, reason="the AVX512-BF16 kernel is off (no "
                                    "such CPU, or DS41NUMBA_BF16_DOT=0): the f32 BLAS path runs")
# The f32 BLAS path in both of its layouts, and the AVX512-BF16 kernel.
SCORE_PATHS = [*LAYOUTS, pytest.param("avx512-bf16", marks=needs_bf16_dot)]


def tile_scores(path, monkeypatch, iq, w, keys, clen, n):
    if path == "avx512-bf16":
        return indexer_mod._tile_scores_bf16(iq, w, pack_bf16_pairs(keys), clen, n)
    monkeypatch.setattr(indexer_mod, "_HEAD_MAJOR_MIN", LAYOUTS[path])
    return indexer_mod._tile_scores(iq, w, keys, clen, n)


@pytest.mark.parametrize("path", SCORE_PATHS)
def test_tile_scores_bit_identical_to_naive(monkeypatch, path):
    rng = np.random.default_rng(11)
    # 3 heads: the bf16 kernel's rows of 4 cross query boundaries and end in a padding row.
    for T, ih, idim, n in [(1, 1, 32, 5), (6, 3, 64, 40), (9, 4, 32, 70), (5, 32, 128, 100)]:
        iq, w, keys = _index_inputs(rng, T, ih, idim, n)
        clen = rng.integers(0, n + 1, size=T)
        clen[0] = 0
        clen[-1] = n
        got = tile_scores(path, monkeypatch, iq, w, keys, clen, n)
        want = naive.naive_index_scores(iq, w, keys, clen)
        assert got.dtype == np.float32 and got.shape == (T, n)
        assert np.array_equal(got, want), f"{np.sum(got != want)} scores differ"
        assert np.all(got[np.arange(n)[None, :] >= clen[:, None]] == -np.inf)
        assert np.array_equal(to_bf16_rne(got), got)


@pytest.mark.parametrize("path", SCORE_PATHS)
def test_tile_scores_across_position_chunks_and_workers(monkeypatch, path):
    """Small chunks, split across the workers: every chunk boundary, a NaN and an inf key."""
    monkeypatch.setattr(indexer_mod, "_SCORE_CHUNK_ELEMS", 64)
    monkeypatch.setattr(indexer_mod, "_SPLIT_MIN_MACS", 0)
    rng = np.random.default_rng(12)
    T, ih, idim, n = 3, 2, 32, 600
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    keys[17, 3] = np.nan
    keys[401, 0] = np.inf
    clen = np.array([0, 300, 600])
    got = tile_scores(path, monkeypatch, iq, w, keys, clen, n)
    assert np.array_equal(got, naive.naive_index_scores(iq, w, keys, clen), equal_nan=True)
    assert np.isnan(got[1, 17]) and np.isnan(got[2, 17])


@needs_bf16_dot
def test_bf16_tile_scores_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(13)
    T, ih, idim, n = 7, 8, 64, 1000
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    clen = np.arange(n - T + 1, n + 1)
    packed = pack_bf16_pairs(keys)
    before = numba.get_num_threads()
    got = []
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            got.append(indexer_mod._tile_scores_bf16(iq, w, packed, clen, n))
    finally:
        numba.set_num_threads(before)
    assert before > 1 and np.array_equal(got[0], got[1])


def _indexer_case(rng, seqlen=40, n_keys=60, ih=4, idim=32, dim=48, q_rank=24):
    cfg = indexer_mod.IndexerCfg(n_heads=ih, head_dim=idim, topk=8, ratio=1, norm_eps=EPS)
    weights = indexer_mod.IndexerWeights(wq_b=bf16(rng, (ih * idim, q_rank), 0.2),
                                         weights_proj=bf16(rng, (ih, dim), 0.2))
    table = layer_rope_table(random_config(index_head_dim=idim), 1, seqlen)
    args = dict(x=bf16(rng, (seqlen, dim)), qr=bf16(rng, (seqlen, q_rank)), start_pos=0, cfg=cfg,
                weights=weights, table=table, offset=3,
                index_k=fp4_quant_e8m0_inplace(bf16(rng, (n_keys, idim))))
    return args


def test_indexer_same_selection_on_both_scoring_paths(monkeypatch):
    """The AVX512-BF16 kernel and the f32 BLAS path (CPUs without it) pick the same rows."""
    args = _indexer_case(np.random.default_rng(14))
    results = []
    for use_bf16 in (False, BF16_DOT):
        monkeypatch.setattr(indexer_mod, "BF16_DOT", use_bf16)
        results.append(indexer_mod.indexer(**args, capture=True))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][2], results[1][2])
    want = naive.naive_index_scores(*_indexer_scoring_inputs(args))
    assert np.array_equal(results[0][2], want)


def _indexer_scoring_inputs(args):
    """The indexer's own query projection, weights and keys, as naive_index_scores takes them."""
    cfg, wts, table = args["cfg"], args["weights"], args["table"]
    seqlen = args["x"].shape[0]
    iq = linear_bf16(args["qr"], wts.wq_b).reshape(seqlen, cfg.n_heads, cfg.head_dim)
    iq = fp4_quant_e8m0_inplace(apply_rotary(iq, np.arange(seqlen), table))
    scale = np.float32(cfg.head_dim ** -0.5 * cfg.n_heads ** -0.5)
    w = to_bf16_rne(linear_bf16(args["x"], wts.weights_proj) * scale)
    width = seqlen // cfg.ratio
    return iq, w, args["index_k"][:width], np.arange(1, seqlen + 1) // cfg.ratio


@needs_bf16_dot
def test_packed_index_keys_follow_their_cache_and_only_it():
    rng = np.random.default_rng(15)
    args = _indexer_case(rng)
    cache = np.zeros_like(args["index_k"])
    packed = indexer_mod.PackedIndexKeys(cache, rows=0)
    for lo, hi in [(0, 33), (33, 34), (34, 60)]:       # a prefill, then rows a step at a time
        cache[lo:hi] = args["index_k"][lo:hi]
        packed.write(lo, hi - lo)
    assert np.array_equal(packed.blocks, pack_bf16_pairs(args["index_k"]))
    want = indexer_mod.indexer(**args)[0]
    args["index_k"] = cache
    assert np.array_equal(indexer_mod.indexer(**args, packed_keys=packed)[0], want)
    # A packed copy of some other cache is not used: the indexer packs index_k itself.
    stale = indexer_mod.PackedIndexKeys(np.zeros_like(cache))
    assert np.array_equal(indexer_mod.indexer(**args, packed_keys=stale)[0], want)
    with pytest.raises(TypeError, match="PackedIndexKeys"):
        indexer_mod.indexer(**args, packed_keys=packed.blocks)
    args["index_k"] = cache + np.float32(2.0 ** -12)
    with pytest.raises(ValueError, match="bf16 values"):
        indexer_mod.indexer(**args)


# =============================================================================== sparse attention


def _attn_case(rng, S=10, H=4, hd=64, n=48, W=20):
    q = bf16(rng, (S, H, hd))
    kv = act_quant_fp8_inplace(bf16(rng, (n, hd)))
    idx = np.array([rng.permutation(n)[:W] for _ in range(S)], np.int32)   # duplicate-free
    idx[rng.random(idx.shape) < 0.3] = -1
    idx[2] = -1                                                 # nothing valid: zeros
    idx[3, 1:] = -1                                             # a single valid row
    sink = (rng.standard_normal(H) * 2).astype(np.float32)
    return q, kv, idx, sink


def test_sparse_attn_vs_naive():
    rng = np.random.default_rng(21)
    for _ in range(4):
        q, kv, idx, sink = _attn_case(rng)
        scale = q.shape[-1] ** -0.5
        got = sparse_attn(q, kv, idx, sink, scale)
        want = naive.naive_sparse_attn(q, kv, idx, sink, scale)
        assert np.array_equal(got[2], np.zeros_like(got[2])), "a row with no valid entry is zeros"
        assert_bf16_close(got, want, "sparse_attn")


def test_sparse_attn_large_sink():
    """A sink far above every score takes almost all the probability mass; the tiny outputs
    still match the naive softmax to a bf16 step."""
    rng = np.random.default_rng(22)
    q, kv, idx, sink = _attn_case(rng)
    sink[:] = [12.0, 20.0, 0.0, 30.0]
    scale = q.shape[-1] ** -0.5
    got = sparse_attn(q, kv, idx, sink, scale)
    want = naive.naive_sparse_attn(q, kv, idx, sink, scale)
    assert_bf16_close(got, want, "sparse_attn with a large sink")
    no_sink = sparse_attn(q, kv, idx, np.full(4, -np.inf, np.float32), scale)
    assert np.max(np.abs(got[:, 3])) < 1e-6 * np.max(np.abs(no_sink[:, 3]))
    assert np.max(np.abs(got[:, 2])) > 1e-3


def test_sparse_attn_sink_only_in_the_denominator():
    """One valid row j: the output is kv_j * e^s / (e^s + e^sink) (softmax weight of one row)."""
    q = np.zeros((1, 1, 32), np.float32)
    kv = to_bf16_rne(np.linspace(-2, 2, 64, dtype=np.float32).reshape(2, 32))
    idx = np.array([[-1, 1]], np.int32)
    got = sparse_attn(q, kv, idx, np.array([0.0], np.float32), 1.0)       # score 0, sink 0
    assert np.array_equal(got[0, 0], to_bf16_rne(kv[1] * np.float32(0.5)))


def test_sparse_attn_queries_of_a_block_stay_apart():
    """Queries share work buffers (a worker's, reused query after query): a NaN row listed by one
    query, a query with a longer list, or one with none must not change its neighbours, and a
    decode-sized call (one query) gives each query's own result."""
    rng = np.random.default_rng(24)
    q, kv, idx, sink = _attn_case(rng, S=8, W=20)
    kv[7] = np.nan
    idx[idx == 7] = -1
    idx[1, 0] = 7                                     # only query 1 lists the NaN row
    idx[5, :] = np.arange(20)                         # the longest list of its block
    idx[5, 7] = -1
    scale = q.shape[-1] ** -0.5
    got = sparse_attn(q, kv, idx, sink, scale)
    assert np.all(np.isnan(got[1]))
    others = [s for s in range(8) if s != 1]
    assert not np.any(np.isnan(got[others]))
    assert_bf16_close(got[others], naive.naive_sparse_attn(q, kv, idx, sink, scale)[others],
                      "sparse_attn block neighbours")
    for s in others:
        one = sparse_attn(q[s:s + 1], kv, idx[s:s + 1], sink, scale)
        assert_bf16_close(one, got[s:s + 1], f"query {s} alone")


def test_sparse_attn_kv_as_row_blocks_is_identical():
    rng = np.random.default_rng(23)
    q, kv, idx, sink = _attn_case(rng, n=40)
    win = 12
    # window entries first, then compressed entries (the layout attention_any builds) ...
    idx_w = np.array([rng.permutation(win)[:6] for _ in range(len(idx))], np.int32)
    idx_c = np.array([win + np.sort(rng.permutation(40 - win)[:5]) for _ in range(len(idx))],
                     np.int32)
    ordered = np.concatenate([idx_w, idx_c], axis=1)
    ordered[rng.random(ordered.shape) < 0.25] = -1
    ordered[4] = -1
    scale = q.shape[-1] ** -0.5
    for rows in (ordered, idx):       # ... and arbitrary order (compressed before window)
        whole = sparse_attn(q, kv, rows, sink, scale)
        split = sparse_attn(q, (kv[:win], kv[win:]), rows, sink, scale)
        three = sparse_attn(q, [kv[:5], kv[5:win], kv[win:]], rows, sink, scale)
        assert np.array_equal(whole, split) and np.array_equal(whole, three)
        assert_bf16_close(whole, naive.naive_sparse_attn(q, kv, rows, sink, scale), "sparse_attn")


def _bits_equal(got, want):
    """Bit-identical, NaN for NaN (the payload aside)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    return (got.shape == want.shape and np.array_equal(np.isnan(got), nan)
            and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32)))


def test_softmax_exp_is_sleef_expf_u10_bit_for_bit():
    """The softmax's exp (torch's Vectorized<float>::exp, Sleef_expf16_u10) against the naive
    twin: random f32 over [-200, 10] (underflow below -104, denormal results between), whole
    numbers and half-way points of the range reduction, tiny values, +-0, +-inf, NaN."""
    from numba import njit

    from ds41numba.attention import _expf_u10

    @njit
    def exp_all(d):
        out = np.empty_like(d)
        for i in range(d.shape[0]):
            out[i] = _expf_u10(d[i])
        return out

    rng = np.random.default_rng(7)
    d = np.concatenate([rng.uniform(-200, 10, 200_000), rng.uniform(-1, 0, 50_000),
                        np.arange(-120, 101) * np.log(2), np.arange(-241, 201) * 0.5 * np.log(2),
                        [0.0, -0.0, 1e-30, -1e-30, -103.97, -104.0, -104.01, 88.7, 100.0, 100.01,
                         -1e30, 1e30, -np.inf, np.inf, np.nan]]).astype(np.float32)
    assert _bits_equal(exp_all(d), naive.naive_sleef_expf_u10(d))


@pytest.mark.parametrize("H", [1, 2, 3, 4, 5, 7, 64])
def test_sparse_attn_follows_the_reference_order_bit_for_bit(H):
    """Against naive.naive_sparse_attn_ordered (the reference's MKL and torch order, literally):
    every bit, for each MKL row-kernel mix (1 row gemv, 2-3 small, 5 and 7 blocked + small rows,
    4 and 64 blocked), lists with -1 entries, an all -1 row, W < 16 (the softmax's scalar sum),
    W across product blocks (200 > 192, 400), hd not a multiple of 4 or 16 (the small kernels'
    peels, the masked tile columns), bf16 inputs as in the model and full f32 ones (where q.k's
    FMAs matter), and the kv rows as one array or as row blocks."""
    rng = np.random.default_rng(100 + H)
    for hd, W, n, as_bf16 in [(64, 20, 50, True), (42, 200, 300, False), (33, 9, 40, True),
                              (48, 400, 500, True), (16, 13, 30, False)]:
        S = 3 if H == 64 else 4
        q = rng.standard_normal((S, H, hd)).astype(np.float32)
        kv = rng.standard_normal((n, hd)).astype(np.float32)
        if as_bf16:
            q, kv = to_bf16_rne(q), to_bf16_rne(kv)
            if hd % 32 == 0:
                kv = act_quant_fp8_inplace(kv)
        idx = np.array([rng.permutation(n)[:W] for _ in range(S)], np.int32)
        idx[rng.random(idx.shape) < 0.25] = -1
        idx[1] = -1                                          # nothing valid: zeros
        idx[2, W // 2:] = -1                                 # a -1 tail, as the model's lists
        sink = rng.standard_normal(H).astype(np.float32)
        scale = hd ** -0.5
        want = naive.naive_sparse_attn_ordered(q, kv, idx, sink, scale)
        got = sparse_attn(q, kv, idx, sink, scale)
        assert _bits_equal(got, want), (hd, W)
        assert np.array_equal(got[1], np.zeros_like(got[1]))
        split = sparse_attn(q, (kv[:n // 3], kv[n // 3:]), idx, sink, scale)
        assert np.array_equal(split.view(np.uint32), got.view(np.uint32))


def test_sparse_attn_signed_zeros_and_non_finite_values_as_the_reference():
    """The edge cases of the order, against the naive twin: an accumulated -0 that a -1 entry's
    zero row (0 * 0 added) turns into +0 and that a listed -0 row keeps; a NaN row listed by one
    query (NaN for every head of it, as torch's max lets NaN through); inf in q (scores of inf, -inf
    and NaN: NaN); a -inf sink (the softmax without it) and a +inf one (NaN). A query with no
    valid entry gives zeros whatever the sink."""
    hd = 16
    kv = np.zeros((4, hd), np.float32)
    kv[0, 0], kv[0, 1], kv[1, 0] = -1e-10, -95.0, -0.0   # p_0 * kv[0, 0] underflows to -0
    kv[2] = np.linspace(-1, 1, hd)
    kv[3] = np.nan
    q = np.zeros((7, 4, hd), np.float32)
    q[:, :, 1] = 1
    q[5, 2, 1] = np.inf
    idx = np.array([[0, -1, 1], [0, 1, -1], [0, 1, 1], [2, 3, -1], [-1, -1, -1], [2, 0, 1],
                    [2, 1, 0]], np.int32)
    for sink in (np.zeros(4, np.float32), np.array([0, -np.inf, np.inf, 1], np.float32)):
        got = sparse_attn(q, kv, idx, sink, 1.0)
        want = naive.naive_sparse_attn_ordered(q, kv, idx, sink, 1.0)
        assert _bits_equal(got, want)
        assert np.all(np.isnan(got[3])) and np.all(np.isnan(got[5, 2]))
        assert np.array_equal(got[4].view(np.uint32), np.zeros((4, hd), np.uint32))
    got = sparse_attn(q, kv, idx, np.zeros(4, np.float32), 1.0)
    assert list(np.signbit(got[:3, 0, 0])) == [False, False, True]


def test_sparse_attn_reproduces_the_reference_at_production_dimensions():
    """tests/data/sparse_attn_v41flash.npz (made by tests/data/make_sparse_attn_v41flash.py): 4
    sampled prefill queries of V4.1-Flash layer 20 (v41flash_L20_ref.safetensors, 2048-token
    prefill) and 4 of layer 2 (v41flash_kv_sources_ref.safetensors, 1024 tokens): 64 heads of 512,
    640-entry lists (full and with -1 tails). q, o and idx are the golden's ``sample.q``,
    ``sample.o`` and ``step0.layers.{L}.idx`` rows, unchanged (bf16 bit patterns); kv holds only
    the rows those lists name (``rows``: their ids; idx remapped onto them): the compressed ones
    the golden's ``shared.compress_kv``, the prefill's window rows ds41numba's own (not stored in
    the golden; checked against its window ring); sink the generator's ``attn_sink``. The rows
    are what they claim: window rows fp8 and compressed rows fp4 e4m3 fixed points.
    Every element bit-identical."""
    d = np.load(os.path.join(DATA, "sparse_attn_v41flash.npz"))
    notes = json.loads(str(d["provenance"]))
    as_f32 = lambda a: a.astype(np.uint32) << 16   # noqa: E731  bf16 bits -> f32 bits
    for name in ("L20", "L2"):
        q, kv, o = (as_f32(d[f"{name}.{k}"]).view(np.float32) for k in ("q", "kv", "o"))
        window = d[f"{name}.rows"] < notes[name]["window_rows"]
        assert window.any() and (~window).any()
        assert np.array_equal(act_quant_fp8_inplace(kv[window].copy()), kv[window])
        assert np.array_equal(fp4_quant_e4m3_inplace(kv[~window].copy()), kv[~window])
        got = sparse_attn(q, kv, d[f"{name}.idx"], d[f"{name}.sink"], 512 ** -0.5)
        same = got.view(np.uint32) == o.view(np.uint32)
        assert same.all(), f"{name}: {int((~same).sum())} of {same.size} elements differ"


def test_sparse_attn_does_not_depend_on_the_thread_count():
    """Each query is computed whole by one work item: 1 and 2 numba threads give the same bits."""
    rng = np.random.default_rng(41)
    q, kv, idx, sink = _attn_case(rng, S=9, H=64, hd=96, n=300, W=250)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = sparse_attn(q, kv, idx, sink, 0.1)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = sparse_attn(q, kv, idx, sink, 0.1)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one.view(np.uint32), two.view(np.uint32))


@pytest.mark.parametrize("name", ["tiny", "mixed", "edge_prefill1", "edge_prefill_window",
                                  "edge_r128_short", "edge_r128_groups"])
def test_sparse_attn_reproduces_every_recorded_o_bit_for_bit(name):
    """Every ``o`` a small golden records, from its own q, kv, idx and sink: bit-identical (4
    heads, MKL's blocked kernel; the earlier numpy-BLAS order missed 0 to 47 elements per golden)."""
    d = np.load(os.path.join(DATA, name + ".npz"))
    hd = json.loads(str(d["config"]))["head_dim"]
    keys = [k for k in d.files if k.endswith(".o")]
    assert keys
    for k in keys:
        pre = k[:-1]
        layer = int(pre.split(".")[2])
        got = sparse_attn(d[pre + "q"], d[pre + "kv"], d[pre + "idx"],
                          d[f"layers.{layer}.attn.attn_sink"], hd ** -0.5)
        assert np.array_equal(got.view(np.uint32), d[k].view(np.uint32)), k


# =============================================================================== output projection


@pytest.mark.parametrize("S,H,hd,G,rank,dim", [(5, 4, 32, 2, 16, 64), (3, 6, 32, 3, 8, 40),
                                               (2, 8, 128, 2, 1024, 1024)])
def test_output_projection_vs_naive(S, H, hd, G, rank, dim):
    """Grouped wo_a then wo_b. Few rows of a large weight take the bf16-bits matrix-vector
    kernel (the last shape); many rows (the input repeated) the many-row path (AVX512-BF16
    for a Bf16Matrix where the CPU has it, else BLAS; BLAS for the plain array)."""
    rng = np.random.default_rng(S * 100 + G)
    o = bf16(rng, (S, H * hd))
    wo_a = bf16(rng, (G * rank, H * hd // G), (H * hd // G) ** -0.5)
    wo_b = bf16(rng, (dim, G * rank), (G * rank) ** -0.5)
    want = naive.naive_output_projection(o, wo_a, wo_b, G)
    grouped = Bf16Matrix(wo_a, groups=G)
    got = output_projection(o, grouped, Bf16Matrix(wo_b))
    many = np.repeat(o, 3, axis=0)
    got_many = output_projection(many, grouped, wo_b)
    assert got.shape == (S, dim) and got_many.shape == (3 * S, dim)
    assert_bf16_close(got, want, "output_projection (few rows)")
    assert_bf16_close(got_many, np.repeat(want, 3, axis=0), "output_projection (many rows)")


def test_output_buffers_take_the_result_and_refuse_a_bad_buffer():
    """The tile loops pass reused buffers (``out=``, ``mid=``): the result lands in them,
    identical to a fresh array; a buffer that cannot hold it is refused, never copied into."""
    rng = np.random.default_rng(31)
    S, H, hd, G, rank, dim = 6, 4, 32, 2, 16, 40
    o = bf16(rng, (S, H * hd))
    wo_a = Bf16Matrix(bf16(rng, (G * rank, H * hd // G), 0.1), groups=G)
    wo_b = bf16(rng, (dim, G * rank), 0.1)
    want = output_projection(o, wo_a, wo_b)
    out, mid = np.full((S, dim), np.nan, np.float32), np.full((S, G * rank), np.nan, np.float32)
    got = output_projection(o, wo_a, wo_b, out=out, mid=mid)
    assert np.shares_memory(got, out) and np.array_equal(out, want)
    assert np.array_equal(mid, linear_bf16(o, wo_a))
    q, kv, idx, sink = _attn_case(rng)
    buf = np.full(q.shape, np.nan, np.float32)
    assert np.array_equal(sparse_attn(q, kv, idx, sink, 0.125, out=buf), buf)
    assert np.array_equal(buf, sparse_attn(q, kv, idx, sink, 0.125))
    with pytest.raises(ValueError, match="out must be a writeable float32"):
        linear_f32(mid, wo_b, out=np.empty((S, dim), np.float64))
    with pytest.raises(ValueError, match="without a copy"):
        linear_f32(mid, wo_b, out=np.empty((S, dim), np.float32).T)
    with pytest.raises(ValueError, match="out must be a writeable float32"):
        sparse_attn(q, kv, idx, sink, 0.125, out=np.empty(3, np.float32))


# =============================================================================== the stack


def _run_steps(stack, cfg, P, n_decode, rng, layers=None):
    """Prefill then decode through every layer in order; yields (start_pos, layer, run)."""
    layers = range(cfg.n_layers) if layers is None else layers
    for step in range(1 + n_decode):
        start_pos, seqlen = (0, P) if step == 0 else (P + step - 1, 1)
        for i in layers:
            run = stack.forward(i, bf16(rng, (seqlen, cfg.dim)), start_pos, capture=True)
            yield start_pos, seqlen, i, run


@pytest.mark.parametrize("P", [3, 10])
def test_rows_with_nothing_visible(P):
    """Prefill queries with (s + 1) // r == 0 see no compressed position: their compressed
    entries are all -1 and their output is window attention alone."""
    r, win = 4, 6
    cfg = random_config(compress_ratios=[r], kv_source_layers=[0], index_source_layers=[0],
                        window_size=win, index_topk=3)
    stack = AttentionStack(cfg, random_weights(cfg, seed=P))
    rng = np.random.default_rng(P)
    runs = list(_run_steps(stack, cfg, P, 6, rng))
    start_pos, seqlen, _, run = runs[0]
    width = P // r
    k = min(3, width)
    nwin = min(P, win)
    assert run.idx.shape == (P, nwin + k) and run.kv_rows.shape == (P + width, 32)
    comp = run.idx[:, nwin:]
    for s in range(P):
        if (s + 1) // r == 0:
            assert np.all(comp[s] == -1), (s, comp[s])
            alone = sparse_attn(run.q[s:s + 1], run.kv_rows, run.idx[s:s + 1, :nwin],
                                stack.weights[0].attn_sink, 32 ** -0.5)
            assert np.array_equal(run.o[s:s + 1], alone)
        else:
            n_valid = min(k, (s + 1) // r)
            assert np.all(comp[s, :n_valid] >= P) and np.all(comp[s, n_valid:] == -1)
    # decode: the first latent appears when end_pos reaches r
    for start_pos, _, _, run in runs[1:]:
        end_pos = start_pos + 1
        width = end_pos // r
        assert run.idx.shape == (1, win + min(3, width))
        assert run.kv_rows.shape == (win + width, 32)
        assert np.all(run.idx[0, win:] >= win)


@pytest.mark.parametrize("block,topk,P", [(2, 6, 12), (1, 2, 140)])
def test_candidate_consumer_keeps_masked_picks_inside_the_visible_range(block, topk, P):
    """A consumer with fewer candidate positions than k: top-k also picks -inf positions. Those
    inside the visible range stay valid indices (SPEC step 5's note); those at or past clen are -1.
    The second case has k * 64 <= positions: torch's partial-sort branch."""
    cfg = random_config(compress_ratios=[1, 1], kv_source_layers=[0], index_source_layers=[0, 1],
                        candidate_source_layer=0, candidate_topk_blocks=1,
                        candidate_block_size=block, index_topk=topk, window_size=4)
    stack = AttentionStack(cfg, random_weights(cfg, seed=5))
    rng = np.random.default_rng(5)
    masked_valid = masked_dropped = 0
    src = None
    for start_pos, seqlen, layer, run in _run_steps(stack, cfg, P, 8, rng):
        end_pos = start_pos + seqlen
        clen = visible(start_pos, seqlen, 1)
        k = min(topk, end_pos)
        offset = seqlen if start_pos == 0 else 4
        nwin = run.idx.shape[1] - k
        comp = run.idx[:, nwin:].astype(np.int64)
        cands = stack.shared.candidates
        if layer == 0:
            src = run
            want_c = naive.naive_select_candidate_blocks(run.index_score, clen, 1, block)
            assert np.array_equal(cands, want_c)
            assert np.array_equal(comp, naive.naive_topk_idxs(run.index_score, clen, k, offset))
            continue
        assert src is not None and run.index_score.shape == (seqlen, end_pos)
        want = naive.naive_topk_idxs(run.index_score, clen, k, offset, candidates=cands)
        assert np.array_equal(comp, want)
        assert np.array_equal(stack.shared.topk_idxs, want)
        for s in range(seqlen):
            assert int(cands[s, :clen[s]].sum()) <= block
            valid = comp[s][comp[s] >= 0] - offset
            assert np.all(valid < clen[s]) and np.all(np.diff(valid) > 0)
            masked_valid += int(np.sum(~cands[s, valid]))
            masked_dropped += int(np.sum(comp[s] == -1))
            if start_pos > 0:
                assert len(valid) == k, "at decode every pick is visible, masked or not"
    assert masked_valid > 0, "the config must make a consumer pick candidate-masked positions"
    assert masked_dropped > 0


def test_candidate_consumer_quirk_in_the_tiny_golden():
    """In tiny.npz, layer 5 (a candidate consumer, ratio 1, index_topk 6 over 3 blocks of 2) keeps
    candidate-masked picks: the naive selection from the golden's own scores and candidates
    reproduces its index rows, and so does the stack."""
    d = np.load(os.path.join(DATA, "tiny.npz"))
    meta = json.loads(str(d["config"]))
    cfg = AttnConfig.from_dict(meta)
    assert cfg.uses_candidates(5) and cfg.ratio(5) == 1
    stack = AttentionStack(cfg, {k: d[k] for k in d.files if k.startswith("layers.")})
    win, P = cfg.window_size, meta["prefill"]
    quirk_rows = []
    for step in range(1 + meta["decode"]):
        start_pos = 0 if step == 0 else P + step - 1
        for i in range(cfg.n_layers):
            pre = f"step{step}.layers.{i}."
            run = stack.forward(i, d[pre + "x"], start_pos, capture=(i == 5))
        pre = f"step{step}.layers.5."
        seqlen = d[pre + "x"].shape[0]
        end_pos = start_pos + seqlen
        offset, nwin = (seqlen, min(seqlen, win)) if start_pos == 0 else (win, win)
        k = min(cfg.index_topk, end_pos)
        clen = visible(start_pos, seqlen, 1)
        cands = d[pre + "shared.candidates"].astype(bool)
        want = d[pre + "idx"][:, nwin:].astype(np.int64)
        assert np.array_equal(
            naive.naive_topk_idxs(d[pre + "index_score"], clen, k, offset, candidates=cands), want)
        assert np.array_equal(run.idx[:, nwin:], want)
        assert np.array_equal(stack.shared.candidates, cands)
        for s in range(seqlen):
            valid = want[s][want[s] >= 0] - offset
            if np.any(~cands[s, valid]):
                quirk_rows.append((step, s))
    # measured on the golden: the prefill's query 10 and every odd decode step
    assert (0, 10) in quirk_rows
    assert [st for st, _ in quirk_rows[1:]] == list(range(1, meta["decode"] + 1, 2))


def test_sparse_attn_and_output_projection_reproduce_the_golden():
    """Per layer and step of tiny.npz: sparse_attn(q, kv, idx) gives the golden o, and the output
    projection of the inverse-rotated o gives the golden out."""
    d = np.load(os.path.join(DATA, "tiny.npz"))
    meta = json.loads(str(d["config"]))
    cfg = AttnConfig.from_dict(meta)
    stack = AttentionStack(cfg, {k: d[k] for k in d.files if k.startswith("layers.")})
    P = meta["prefill"]
    for step in (0, 1, 2, 9, 40):
        start_pos = 0 if step == 0 else P + step - 1
        for i in range(cfg.n_layers):
            pre = f"step{step}.layers.{i}."
            q, kv, idx, o = (d[pre + n] for n in ("q", "kv", "idx", "o"))
            w = stack.weights[i]
            got_o = sparse_attn(q, kv, idx, w.attn_sink, cfg.head_dim ** -0.5)
            assert_bf16_close(got_o, o, pre + "o", min_identical=0.99)
            pos = np.arange(start_pos, start_pos + q.shape[0])
            table = layer_rope_table(cfg, cfg.ratio(i), start_pos + q.shape[0])
            o_rot = apply_rotary(o, pos, table, inverse=True).reshape(q.shape[0], -1)
            got = output_projection(o_rot, w.wo_a, w.wo_b)
            assert_bf16_close(got, d[pre + "out"], pre + "out", min_identical=0.99)


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
    for start_pos, seqlen, i, run in _run_steps(stack, cfg, P, 12, rng):
        r = cfg.ratio(i)
        end_pos = start_pos + seqlen
        offset = seqlen if start_pos == 0 else win
        nwin = min(seqlen, win) if start_pos == 0 else win
        width = end_pos // r if r else 0
        k = min(topk, width) if r else 0
        assert run.idx.dtype == np.int32 and run.idx.shape == (seqlen, nwin + k)
        assert run.kv_rows.shape == (offset + width, hd)
        assert np.array_equal(run.idx[:, :nwin], np.broadcast_to(
            naive.naive_window_index_rows(start_pos, seqlen, win), (seqlen, nwin)))
        if not r:
            continue
        assert np.array_equal(run.kv_rows[offset:], stack.shared.compress_kv[:width])
        comp = run.idx[:, nwin:].astype(np.int64)
        clen = visible(start_pos, seqlen, r)
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
            want = naive.naive_topk_idxs(run.index_score, clen, k, offset, candidates=cands)
            assert np.array_equal(comp, want), (i, start_pos)
            if cfg.is_candidate_source(i):
                assert np.array_equal(stack.shared.candidates, naive.naive_select_candidate_blocks(
                    run.index_score, clen, cfg.candidate_topk_blocks, cfg.candidate_block_size))
        else:
            # layer 2 reuses layer 1's selection
            assert np.array_equal(comp, prev_idx[cfg.index_source_of(i)])
        prev_idx[i] = comp
