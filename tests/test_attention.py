"""ds41numba.attention against the plain loops of naive.py: the window index rows and ring,
sparse attention with a sink, the grouped output projection, rows with nothing visible, the
reference's own tensors (tiny golden), and non-finite input through a layer.

Index rows are compared exactly. Float results that go through a BLAS dot product are compared
in bf16 steps (the distance in representable bf16 values): at most one step anywhere and at
least 99.9% identical (the SPEC's "How exact is exact"); the naive versions sum their dot
products exactly, so they do not share any BLAS's order.
"""

import json

import numba
import numpy as np
import pytest
from numba import njit

import naive
from helpers import (DATA, assert_bf16_close, bf16, captured_steps, nan_rows, nan_stack, random_config,
                     random_weights, xs)
from ds41numba import (AttentionStack, act_quant_fp8_inplace, apply_rotary, fp4_quant_e4m3_inplace,
                       linear_bf16, linear_f32, output_projection, sparse_attn, to_bf16_rne,
                       window_index_rows)
from ds41numba.attention import layer_rope_table
from ds41numba.numerics import Bf16Matrix, expf_u10
from ds41numba import sparse_attention as sa_mod
from ds41numba.numerics import fma_choice, use_backend
from ds41numba.sparse_attention import _head_groups, kv_pairs
from numerics_helpers import needs_bf16_dot


# =============================================================================== window


@pytest.mark.parametrize("win", [1, 3, 8])
def test_window_index_rows_vs_naive(win):
    for P in sorted({1, max(1, win - 1), win, win + 1, 2 * win + 3}):
        got = window_index_rows(0, P, win)
        want = naive.window_index_rows(0, P, win)
        assert got.dtype == np.int32 and np.array_equal(got, want), (win, P)
        # Row t's valid entries are exactly the positions max(0, t - win + 1) .. t.
        for t in range(P):
            assert sorted(got[t][got[t] >= 0]) == list(range(max(0, t - win + 1), t + 1))
        # decode while the ring fills and after several wraps
        for start_pos in range(P, P + 4 * win + 2):
            got = window_index_rows(start_pos, 1, win)
            want = naive.window_index_rows(start_pos, 1, win)
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
    assert np.array_equal(run.idx, naive.window_index_rows(0, P, win))
    assert np.array_equal(stack.states[0].window_kv, naive.window_ring(prefill_rows, [], win))
    decode_rows = []
    for start_pos in range(P, P + 3 * win + 3):
        before = stack.states[0].window_kv.copy()
        run = stack.forward(0, bf16(rng, (1, 64)), start_pos, capture=True)
        ring = stack.states[0].window_kv
        assert run.kv_rows.shape == (win, 32)
        assert np.array_equal(run.kv_rows, ring), "decode attends to the whole ring"
        assert np.array_equal(run.idx, naive.window_index_rows(start_pos, 1, win))
        slot = start_pos % win
        others = np.arange(win) != slot
        assert np.array_equal(ring[others], before[others]), "a decode step writes one slot"
        decode_rows.append(ring[slot].copy())
        assert np.array_equal(ring, naive.window_ring(prefill_rows, decode_rows, win))
        # every row is an fp8-quantised row (quantising it again changes nothing)
        assert np.array_equal(act_quant_fp8_inplace(ring.copy()), ring)


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
        want = naive.sparse_attn(q, kv, idx, sink, scale)
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
    want = naive.sparse_attn(q, kv, idx, sink, scale)
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
    assert_bf16_close(got[others], naive.sparse_attn(q, kv, idx, sink, scale)[others],
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
        compiled = set(sa_mod._sparse_attn_kernel.signatures)
        three = sparse_attn(q, [kv[:5], kv[5:win], kv[win:]], rows, sink, scale)
        assert set(sa_mod._sparse_attn_kernel.signatures) == compiled     # the two blocks' kernel
        assert np.array_equal(whole, split) and np.array_equal(whole, three)
        assert_bf16_close(whole, naive.sparse_attn(q, kv, rows, sink, scale), "sparse_attn")


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
    @njit
    def exp_all(d):
        out = np.empty_like(d)
        for i in range(d.shape[0]):
            out[i] = expf_u10(d[i])
        return out

    rng = np.random.default_rng(7)
    d = np.concatenate([rng.uniform(-200, 10, 200_000), rng.uniform(-1, 0, 50_000),
                        np.arange(-120, 101) * np.log(2), np.arange(-241, 201) * 0.5 * np.log(2),
                        [0.0, -0.0, 1e-30, -1e-30, -103.97, -104.0, -104.01, 88.7, 100.0, 100.01,
                         -1e30, 1e30, -np.inf, np.inf, np.nan]]).astype(np.float32)
    assert _bits_equal(exp_all(d), naive.sleef_expf_u10(d))


@pytest.mark.parametrize("H", [1, 2, 3, 4, 5, 7, 64])
def test_sparse_attn_follows_the_reference_order_bit_for_bit(H):
    """Against naive.sparse_attn_ordered (the reference's MKL and torch order, literally):
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
        want = naive.sparse_attn_ordered(q, kv, idx, sink, scale)
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
        want = naive.sparse_attn_ordered(q, kv, idx, sink, 1.0)
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
    d = np.load(DATA / "sparse_attn_v41flash.npz")
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
        # One query a call, as a decode step runs it: its 64 heads split between the workers.
        for s in range(q.shape[0]):
            one = sparse_attn(q[s:s + 1], kv, d[f"{name}.idx"][s:s + 1], d[f"{name}.sink"], 512 ** -0.5)
            assert np.array_equal(one.view(np.uint32), o[s:s + 1].view(np.uint32)), (name, s)


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


@needs_bf16_dot
@pytest.mark.parametrize("H", [64, 7, 4])
def test_sparse_attn_q_k_on_bf16_pairs_is_the_reference_order(H, monkeypatch):
    """q.k on in-order bf16 pairs (vdpbf16ps, :func:`kv_pairs`) against the reference's order
    (naive.sparse_attn_ordered) and the f32 FMAs (no pairs where vdpbf16ps is the slower, none on
    a tier without AVX512-BF16), every bit: hd 512 (product blocks of 96, 96 and 64 pairs), 96
    and 64, -1 entries, a query listing nothing, one with a value too small for the rows'
    smallest (its q.k on FMAs), the rows in two blocks. A query holding a bf16 denormal, which
    vdpbf16ps reads as zero, takes the FMAs: against a row of 2^126 it moves a score by 2^-4."""
    rng = np.random.default_rng(500 + H)
    for hd, n, W in [(512, 700, 640), (96, 400, 250), (64, 300, 200)]:
        q, kv, idx, sink = _attn_case(rng, S=5, H=H, hd=hd, n=n, W=W)
        q[4, 0, 5] = 2.0 ** -100
        pairs = kv_pairs(kv)
        assert pairs is not None and pairs.range[0] and kv_pairs(kv, listed=n - 1) is None
        want = naive.sparse_attn_ordered(q, kv, idx, sink, 0.1)
        got = sparse_attn(q, (kv[:n // 3], kv[n // 3:]), idx, sink, 0.1,
                          pairs=kv_pairs((kv[:n // 3], kv[n // 3:])))
        with monkeypatch.context() as m:
            m.setattr(fma_choice, "_fma_choice", [True])
            assert kv_pairs(kv, listed=5 * W) is None
            fma = sparse_attn(q, kv, idx, sink, 0.1)
        assert _bits_equal(got, want) and np.array_equal(got.view(np.uint32), fma.view(np.uint32))
    with use_backend("avx2int8"):       # one small query: the kernel the golden's list compiles
        assert kv_pairs(kv) is None
        below = sparse_attn(q[:1], kv, idx[:1], sink, 0.1, pairs=pairs)
    assert np.array_equal(below.view(np.uint32), got[:1].view(np.uint32))
    q = np.zeros((1, H, 32), np.float32)
    q[0, :, :2] = [2.0 ** -130, 2.0 ** -20]
    kv = np.zeros((2, 32), np.float32)
    kv[0, :2], kv[1, 1] = [2.0 ** 126, 1.0], 1.0
    args = (q, kv, np.array([[0, 1]]), np.zeros(H, np.float32), 1.0)
    got = sparse_attn(*args, pairs=kv_pairs(kv))
    assert _bits_equal(got, naive.sparse_attn_ordered(*args))
    flushed = q.copy()
    flushed[0, :, 0] = 0
    assert not np.array_equal(got, sparse_attn(flushed, *args[1:]))


@needs_bf16_dot
def test_kv_pairs_only_where_they_serve_and_pay(monkeypatch):
    """No pairs for rows with a denormal, an inf, a NaN or a value that is not bf16, nor for an
    odd hd; none where they would not pay: fewer list entries than rows, or vdpbf16ps not the
    faster on this CPU. Pairs of other rows are refused."""
    rng = np.random.default_rng(8)
    q, kv, idx, sink = _attn_case(rng, S=4, H=4, hd=64, n=40, W=20)
    assert kv_pairs(kv).parts[0].shape == (40, 32) and kv_pairs(kv).parts[1].shape == (0, 32)
    for bad in (2.0 ** -130, np.inf, np.nan, 1.0 + 2.0 ** -10):
        worse = kv.copy()
        worse[7, 3] = bad
        assert kv_pairs(worse) is None, bad
    assert kv_pairs(bf16(rng, (40, 33))) is None
    assert kv_pairs(kv, listed=40) is not None and kv_pairs(kv, listed=39) is None
    monkeypatch.setattr(fma_choice, "_fma_choice", [True])
    assert kv_pairs(kv, listed=40) is None and kv_pairs(kv) is not None
    with pytest.raises(ValueError, match="kv_pairs"):
        sparse_attn(q, kv, idx, sink, 0.1, pairs=kv_pairs(kv[:30]))


@pytest.mark.parametrize("H", [64, 32, 96, 48, 7])
def test_sparse_attn_of_one_query_splits_its_heads_without_changing_a_bit(H):
    """A single query (a decode step) on 2 threads: its heads split into groups of a multiple of
    16 (64, 32 and 96 heads into two; 48 and 7 not), each worker a group. Against the
    reference's order (naive.sparse_attn_ordered) and the 1-thread run, every bit, with -1
    entries, a list across product blocks and a query that lists nothing."""
    rng = np.random.default_rng(300 + H)
    q, kv, idx, sink = _attn_case(rng, S=4, H=H, hd=96, n=400, W=250)
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    assert _head_groups(1, H, threads) == (threads if H % 32 == 0 else 1)
    before = numba.get_num_threads()
    try:
        for s in range(4):
            args = (q[s:s + 1], kv, idx[s:s + 1], sink, 0.1)
            numba.set_num_threads(threads)
            split = sparse_attn(*args)
            numba.set_num_threads(1)
            whole = sparse_attn(*args)
            assert _bits_equal(split, naive.sparse_attn_ordered(*args)), s
            assert np.array_equal(split.view(np.uint32), whole.view(np.uint32)), s
    finally:
        numba.set_num_threads(before)


def test_head_groups_split_only_what_leaves_workers_idle():
    assert [_head_groups(1, 64, w) for w in (1, 2, 3, 4, 8)] == [1, 2, 2, 4, 4]
    assert [_head_groups(S, 64, 4) for S in (1, 2, 3, 4, 9)] == [4, 2, 1, 1, 1]
    assert [_head_groups(1, H, 8) for H in (16, 48, 96, 128)] == [1, 1, 2, 8]


@pytest.mark.parametrize("name", ["tiny", "mixed", "edge_prefill1", "edge_prefill_window",
                                  "edge_r128_short", "edge_r128_groups"])
def test_sparse_attn_reproduces_every_recorded_o_bit_for_bit(reference_golden, name):
    """Every ``o`` a small golden records, from its own q, kv, idx and sink: bit-identical (4
    heads, MKL's blocked kernel; the earlier numpy-BLAS order missed 0 to 47 elements per golden)."""
    d = reference_golden(name)
    hd = d.config.head_dim
    keys = [k for k in d.tensors if k.endswith(".o")]
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
    want = naive.output_projection(o, wo_a, wo_b, G)
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


# =============================================================================== a layer


@pytest.mark.parametrize("P", [3, 10])
def test_rows_with_nothing_visible(P):
    """Prefill queries with (s + 1) // r == 0 see no compressed position: their compressed
    entries are all -1 and their output is window attention alone."""
    r, win = 4, 6
    cfg = random_config(compress_ratios=[r], kv_source_layers=[0], index_source_layers=[0],
                        window_size=win, index_topk=3)
    stack = AttentionStack(cfg, random_weights(cfg, seed=P))
    rng = np.random.default_rng(P)
    runs = list(captured_steps(stack, cfg, P, 6, rng))
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


def test_sparse_attn_and_output_projection_reproduce_the_golden(reference_golden):
    """Per layer and step of tiny.npz: sparse_attn(q, kv, idx) gives the golden o, and the output
    projection of the inverse-rotated o gives the golden out."""
    d = reference_golden("tiny")
    cfg = d.config
    stack = AttentionStack(cfg, d.weights)
    P = d.run.prefill
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


# =============================================================================== non-finite input


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("whole_row", [True, False])
def test_nan_row_in_a_window_layer(value, whole_row):
    """Ratio 0, window 4, prefill 12, a non-finite value in token 5: its KV row is NaN (RMSNorm of
    inf is inf * 0), so exactly the queries whose window holds it, 5..8, output NaN rows."""
    cfg, st = nan_stack([0], [], [])
    x = xs(12, dim=32)
    if whole_row:
        x[5] = value
    else:
        x[5, 3] = value
    assert nan_rows(st.forward(0, x, 0).out) == {5, 6, 7, 8}
    # Decode: the NaN row (slot 5 % 4) stays in the ring until position 9 overwrites it... it was
    # already overwritten at prefill by token 9 (slot 1), so decodes are finite again.
    for p in range(12, 16):
        assert nan_rows(st.forward(0, xs(1, p, 32), p).out) == set()
    y = xs(1, 99, 32)
    y[0, 0] = value
    assert nan_rows(st.forward(0, y, 16).out) == {0}
    for p in range(17, 20):           # the NaN row sits in slot 0 until position 20 replaces it
        assert nan_rows(st.forward(0, xs(1, p, 32), p).out) == {0}, p
    assert nan_rows(st.forward(0, xs(1, 20, 32), 20).out) == set()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_row_in_a_compressed_layer_is_selected_first(value):
    """Ratio 1 with an indexer: token 5's latent and index key are NaN, so every later query's
    score for position 5 is NaN, top-k ranks it first (torch's NaN-first order), and the query
    attends to a NaN row: queries 5.. output NaN, queries before it are finite."""
    cfg, st = nan_stack([1], [0], [0], window=2, topk=2)
    x = xs(12, dim=32)
    x[5, 7] = value
    run = st.forward(0, x, 0, capture=True)
    assert nan_rows(run.out) == set(range(5, 12))
    comp = run.idx[:, 2:]            # window entries first (min(12, 2) of them)
    for s in range(5, 12):
        assert 12 + 5 in comp[s], (s, comp[s])           # offset 12 + position 5, picked first
    assert np.isnan(run.index_score[6:, 5]).all() and np.isfinite(run.index_score[6:, :5]).all()
    # Decode: the NaN position stays selectable, so every later step outputs NaN.
    run = st.forward(0, xs(1, 1, 32), 12, capture=True)
    assert cfg.window_size + 5 in run.idx[0] and nan_rows(run.out) == {0}
