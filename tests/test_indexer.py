"""ds41numba.indexer against the plain loops of naive.py: the candidate blocks
(naive.select_candidate_blocks), the index scores on every scoring path (naive.tile_scores),
the selection (naive.indexer_topk_idxs), including a candidate consumer that picks
candidate-masked positions (also in the tiny golden), and the packed index keys.

Index rows and selections are compared exactly; the index scores are sums that are exact in f32
whatever the order (fp4-quantised operands), so they must be bit-identical.
"""

import importlib
import threading

import numba
import numpy as np
import pytest

import naive
from helpers import EPS, bf16, captured_steps, random_config, random_weights
from numerics_helpers import (ALL_TIERS, TIERS, fp4_rows, needs_amx, needs_avx2_int8,
                              needs_bf16_dot, needs_int8_dot)
from ds41numba import (AttentionStack, apply_rotary, fp4_quant_e8m0_inplace, linear_bf16,
                       select_candidate_blocks, to_bf16_rne)
from ds41numba.attention import layer_rope_table
from ds41numba.numerics import (DOT_LANES, pack_bf16_pairs, pack_folded_blocks, pack_int8_blocks,
                                pack_offset_folded_blocks, use_backend, workers)

# ``ds41numba.indexer`` is the function (the package namespace re-exports it over the module)
indexer_mod = importlib.import_module("ds41numba.indexer")
blas_scores = importlib.import_module("ds41numba.indexer.blas_scores")
candidates = importlib.import_module("ds41numba.indexer.candidates")
lightning = importlib.import_module("ds41numba.indexer.lightning")
packed_scores = importlib.import_module("ds41numba.indexer.packed_scores")
query_layouts = importlib.import_module("ds41numba.indexer.query_layouts")
tier_scores = importlib.import_module("ds41numba.indexer.tier_scores")


# =============================================================================== selection


@pytest.mark.parametrize("k, width", [(4, 255), (4, 256), (4, 257), (8, 511), (8, 512), (3, 40)])
@pytest.mark.parametrize("rows", [1, 5])
def test_top_k_sets_takes_torchs_branch_for_the_width(k, width, rows):
    """Each row's set is torch's (naive, its libstdc++ transcription) on both sides of the
    branch edge (``k * 64 <= width``: the heap's kernel, else the whole row's ``nth_element``):
    rows -inf past ``clen`` and full of ties, one row (the serial twin) and several; in the heap
    branch also skipped by block maxima and visited by listed spans."""
    from ds41numba.indexer.candidate_scores import candidate_quarters
    from ds41numba.indexer.selection import top_k_sets
    from ds41numba.topk import ListedSpans

    rng = np.random.default_rng(k * width + rows)
    scores = _tie_heavy_scores(rng, rows, width)
    clen = rng.integers(k, width + 1, rows).astype(np.int64)
    clen[0] = width
    for s in range(rows):
        scores[s, clen[s]:] = -np.inf
    want = np.stack([naive.torch_cpu_topk_set(r, k) for r in scores])
    got = np.full((rows, k), -7, np.int64)
    top_k_sets(scores, clen, k, got)
    assert np.array_equal(got, want)
    if k * 64 > width:
        return
    block = 8
    padded = np.full((rows, -(-width // block) * block), -np.inf, np.float32)
    padded[:, :width] = scores
    maxima = np.ascontiguousarray(padded.reshape(rows, -1, block).max(axis=2))
    got[:] = -7
    top_k_sets(scores, clen, k, got, hints=maxima, block=block)
    assert np.array_equal(got, want)
    # Listed spans: rows -inf outside a few candidate blocks of 8 (every other block past 0).
    cand = np.zeros((rows, -(-width // block)), bool)
    cand[:, ::2] = True
    masked = np.where(np.repeat(cand, block, axis=1)[:, :width], scores, -np.inf).astype(np.float32)
    offsets, firsts = candidate_quarters(np.packbits(cand, axis=1), clen, block)
    want = np.stack([naive.torch_cpu_topk_set(r, k) for r in masked])
    got[:] = -7
    top_k_sets(masked, clen, k, got, listed=ListedSpans(offsets, firsts, 8))
    assert np.array_equal(got, want)


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
        want = naive.select_candidate_blocks(scores, clen, topk_blocks, block)
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


def test_candidate_bits_of_masked_rows_are_the_naive_mask_packed():
    """The indexer's candidate source writes its blocks as packed bits straight from the picks of
    rows past whose visible length every score is -inf (the block scores written only as far as
    the top-k reads): the naive candidate mask, packed, in both of torch's top-k branches (k * 64
    at most the blocks, and more), with ties, a NaN and rows that see nothing."""
    rng = np.random.default_rng(4)
    branches = set()
    for _ in range(60):
        block = int(rng.integers(1, 9))
        width = int(rng.integers(1, 1200))
        n_blocks = -(-width // block)
        topk_blocks = int(rng.choice([1, 2, 3, max(1, n_blocks // 2), n_blocks + 3]))
        rows = int(rng.integers(1, 6))
        scores = _tie_heavy_scores(rng, rows, width)
        clen = rng.integers(0, width + 1, size=rows)
        if rng.random() < 0.3:
            scores[0, int(rng.integers(0, width))] = np.nan
        scores[np.arange(width)[None, :] >= clen[:, None]] = -np.inf
        got = np.zeros((rows, (n_blocks + 7) // 8), np.uint8)
        candidates.candidate_block_bits(scores, clen, topk_blocks, block, got)
        want = naive.select_candidate_blocks(scores, clen, topk_blocks, block)[:, ::block]
        assert np.array_equal(got, np.packbits(want, axis=1)), (width, block, topk_blocks, clen)
        branches.add(min(topk_blocks, n_blocks) * 64 <= n_blocks)
    assert branches == {True, False}


def test_select_candidate_blocks_topk_beyond_blocks_keeps_every_finite_block():
    scores = np.array([[1.0, -np.inf, -np.inf, 2.0, 0.0, -np.inf, -np.inf]], np.float32)
    got = select_candidate_blocks(scores, np.array([4]), 10, 2)
    # blocks {0,1} (max 1), {2,3} (pinned), {4,5} (max 0) kept; {6} is all -inf: dropped
    assert got.tolist() == [[True, True, True, True, True, True, False]]
    assert np.array_equal(got, naive.select_candidate_blocks(scores, [4], 10, 2))


# =============================================================================== index scores


def _index_inputs(rng, T, ih, idim, n):
    iq = fp4_quant_e8m0_inplace(bf16(rng, (T, ih, idim)))
    keys = fp4_quant_e8m0_inplace(bf16(rng, (n, idim)))
    w = bf16(rng, (T, ih), 0.2)
    return iq, w, keys


LAYOUTS = {"position-major": 1 << 30, "head-major": 1}
# The f32 BLAS path in both of its layouts, the AVX2 integer, AVX512-BF16, AVX512-VNNI and AMX
# kernels.
SCORE_PATHS = [*LAYOUTS, pytest.param("avx2-int8", marks=needs_avx2_int8),
               pytest.param("avx512-bf16", marks=needs_bf16_dot),
               pytest.param("avx512-vnni", marks=needs_int8_dot), pytest.param("amx", marks=needs_amx)]
# The tier each integer path of SCORE_PATHS runs on.
INT8_PATHS = {"avx2-int8": "avx2int8", "avx512-vnni": "avx512vnni"}


def int8_tile_scores(iq, w, keys, clen, n, tier="avx512vnni", **kwargs):
    """The per-block integer kernel's scores on ``tier`` (VNNI's, or AVX2's on "avx2int8"), or
    None where it declines (products not exact as integers)."""
    quads, scales, rng = pack_int8_blocks(keys)
    with use_backend(tier):
        return tier_scores.tile_scores_int8(iq, w, (quads, scales), rng, clen, n, **kwargs)


def amx_tile_scores(iq, w, keys, clen, n):
    """The AMX kernel's scores, or None where it declines (rows that do not fold, products not
    exact), and None for heads that do not split into its tile products."""
    if keys.shape[1] % 64:
        return None
    quads, scales, rng = pack_folded_blocks(keys)
    return tier_scores.tile_scores_amx(iq, w, (quads, scales), rng, clen, n)


def vnni_folded_tile_scores(iq, w, keys, clen, n, **kwargs):
    """The VNNI tier's folded kernel's scores (:func:`amx_tile_scores`' twin)."""
    if keys.shape[1] % 64:
        return None
    quads, scales, rng = pack_offset_folded_blocks(keys)
    return tier_scores.tile_scores_vnni_folded(iq, w, (quads, scales), rng, clen, n, **kwargs)


# The kernels that mix folded rows' products as they form them: AMX's, and VNNI's.
FOLDED_MIXERS = [pytest.param(amx_tile_scores, marks=needs_amx, id="amx"),
                 pytest.param(vnni_folded_tile_scores, marks=needs_int8_dot, id="vnni")]


def package_tile_scores(path, monkeypatch, iq, w, keys, clen, n):
    if path == "amx":
        got = amx_tile_scores(iq, w, keys, clen, n)
        if got is None:     # the cache runs the next kernel down
            with use_backend("amx"):
                got = indexer_mod.IndexKeyCache(keys).scores(iq, w, clen, n)
        return got
    if path == "avx512-bf16":
        return tier_scores.tile_scores_bf16(iq, w, pack_bf16_pairs(keys), clen, n)
    if path in INT8_PATHS:
        got = int8_tile_scores(iq, w, keys, clen, n, INT8_PATHS[path])
        if got is None:     # not fp4 values (a NaN key): the cache runs the bf16 kernel (or BLAS)
            with use_backend(INT8_PATHS[path]):
                got = indexer_mod.IndexKeyCache(keys).scores(iq, w, clen, n)
        return got
    monkeypatch.setattr(blas_scores, "_HEAD_MAJOR_MIN", LAYOUTS[path])
    return blas_scores.tile_scores(iq, w, keys, clen, n)


@pytest.mark.parametrize("path", SCORE_PATHS)
def test_tile_scores_bit_identical_to_naive(monkeypatch, path):
    rng = np.random.default_rng(11)
    # 3 heads: the bf16 kernel's rows of 4 cross query boundaries and end in a padding row.
    for T, ih, idim, n in [(1, 1, 32, 5), (6, 3, 64, 40), (9, 4, 32, 70), (5, 32, 128, 100),
                           (3, 16, 128, 33), (2, 5, 192, 64)]:
        iq, w, keys = _index_inputs(rng, T, ih, idim, n)
        clen = rng.integers(0, n + 1, size=T)
        clen[0] = 0
        clen[-1] = n
        got = package_tile_scores(path, monkeypatch, iq, w, keys, clen, n)
        want = naive.tile_scores(iq, w, keys, clen)
        if path in INT8_PATHS:
            assert int8_tile_scores(iq, w, keys, clen, n, INT8_PATHS[path]) is not None, "declined"
        if path == "amx" and idim % 64 == 0:
            assert amx_tile_scores(iq, w, keys, clen, n) is not None, "the AMX kernel declined"
        assert got.dtype == np.float32 and got.shape == (T, n)
        assert np.array_equal(got, want), f"{np.sum(got != want)} scores differ"
        assert np.all(got[np.arange(n)[None, :] >= clen[:, None]] == -np.inf)
        assert np.array_equal(to_bf16_rne(got), got)


def _naive_visible_maxima(scores, clen, block):
    """Per row, the max (NaN wins) of each block of ``block`` positions it sees, over those."""
    out = {}
    for s, n in enumerate(clen):
        for j in range(-(-int(n) // block)):
            vals = scores[s, j * block:min(int(n), (j + 1) * block)]
            out[s, j] = np.float32(np.nan) if np.isnan(vals).any() else vals.max()
    return out


@pytest.mark.parametrize("path", SCORE_PATHS)
@pytest.mark.parametrize("T, ih, idim, n", [(3, 3, 64, 57), (2, 16, 128, 100), (1, 5, 32, 31)])
def test_tile_scores_on_every_fp4_byte(monkeypatch, path, T, ih, idim, n):
    """The integer kernels' extreme bytes through the whole path: query integers -12..12 and
    key bytes 0..24 (e2m1's values and the integers between, each group's scale pinned by a
    +-12), odd head counts and key tails; every path gives the naive scores bit for bit."""
    ints = (np.arange(T * ih * idim).reshape(T, ih, idim) * 7) % 25 - 12
    ints[..., ::32] = 12
    iq = (ints / 2).astype(np.float32)
    kints = (np.arange(n * idim).reshape(n, idim) * 3 + np.arange(n)[:, None]) % 25 - 12
    kints[::2, ::32] = -12
    keys = (kints / 4).astype(np.float32)
    w = bf16(np.random.default_rng(T), (T, ih), 0.2)
    clen = np.linspace(n // 3, n, T).astype(np.int64)
    got = package_tile_scores(path, monkeypatch, iq, w, keys, clen, n)
    if path in INT8_PATHS:
        assert int8_tile_scores(iq, w, keys, clen, n, INT8_PATHS[path]) is not None, "declined"
    assert np.array_equal(got, naive.tile_scores(iq, w, keys, clen))


@pytest.mark.parametrize("tier", ALL_TIERS)
@pytest.mark.parametrize("block", [8, 4, 32, 3, 12])
@pytest.mark.parametrize("clen", [[0, 1, 37, 200, 299, 300], [250, 260, 280, 299, 300, 300]])
def test_block_maxima_taken_with_the_scores_are_the_naive_maxima(tier, block, clen):
    """The candidate source's block maxima from ``scores(maxima=...)`` (inside the packed
    kernels where ``block`` divides their key block, a pass after them otherwise): each row's
    visible blocks only, a partly visible one over what the row sees, a NaN winning (an inf
    head weight times a zero product), every other entry of the buffer left as it was. The
    second ``clen``: the first key blocks seen whole by every row (the kernels' straight path)."""
    rng = np.random.default_rng(block)
    T, ih, idim, n = 6, 32, 128, 300
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    clen = np.array(clen)
    for weights in (w, np.where(np.arange(ih) == 3, np.float32(np.inf), w).astype(np.float32)):
        want_scores = naive.tile_scores(iq, weights, keys, clen)
        with use_backend(tier):
            buf = np.full((T, -(-n // block) + 2), 7.0, np.float32)
            got = indexer_mod.IndexKeyCache(keys).scores(iq, weights, clen, n, maxima=(block, buf))
        assert np.array_equal(got, want_scores, equal_nan=True)
        want = _naive_visible_maxima(want_scores, clen, block)
        for (s, j), v in want.items():
            assert buf[s, j] == v or (np.isnan(v) and np.isnan(buf[s, j])), (s, j, buf[s, j], v)
        untouched = np.ones(buf.shape, bool)
        untouched[tuple(zip(*want))] = False
        assert np.all(buf[untouched] == 7.0)
        if weights is not w:
            assert any(np.isnan(v) for v in want.values()), "no NaN block: the case tests nothing"


def test_block_maxima_need_a_buffer_that_holds_them():
    rng = np.random.default_rng(3)
    iq, w, keys = _index_inputs(rng, 2, 4, 64, 40)
    cache = indexer_mod.IndexKeyCache(keys)
    for maxima in ((8, np.empty((2, 4), np.float32)), (8, np.empty((1, 5), np.float32)),
                   (0, np.empty((2, 5), np.float32)), (8, np.empty((2, 5), np.float64))):
        with pytest.raises(ValueError, match="block maxima"):
            cache.scores(iq, w, np.array([10, 40]), 40, maxima=maxima)


@pytest.mark.parametrize("tier", ALL_TIERS)
def test_a_reused_score_buffer_is_masked_only_where_it_was_written(tier):
    """The indexer reuses one score buffer tile after tile and masks only the columns a
    previous tile wrote (``dirty_to``): a buffer full of garbage masked in full, then reused
    for queries that see fewer positions, gives exactly a fresh buffer's scores."""
    rng = np.random.default_rng(12)
    T, ih, idim, n = 6, 4, 128, 300
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    with use_backend(tier):
        cache = indexer_mod.IndexKeyCache(keys)
        buf = np.full((T, n), 7.0, np.float32)                 # garbage everywhere
        wide = np.array([250, 260, 270, 280, 290, 300])
        first = cache.scores(iq, w, wide, n, out=buf).copy()
        assert np.array_equal(first, naive.tile_scores(iq, w, keys, wide))
        narrow = np.array([0, 10, 120, 121, 200, 299])
        got = cache.scores(iq, w, narrow, n, out=buf, dirty_to=int(wide.max()))
        assert np.array_equal(got, naive.tile_scores(iq, w, keys, narrow))


@np.errstate(invalid="ignore", over="ignore")
def test_the_head_mix_keeps_every_bit_of_nans_and_zeros():
    """Both head mixes (head-major for tiles, position-major for a few queries) round each
    weighted product without bf16's NaN branch, since such a product is a quiet NaN with no
    payload or none; every bit as the naive mix's, with NaN payloads and signalling NaNs of
    either sign, infinities and zeros of either sign among the dot products and the weights."""
    rng = np.random.default_rng(31)
    T, ih, n, t0 = 3, 8, 64, 128
    d = rng.standard_normal((T * ih, n)).astype(np.float32)
    bits = d.view(np.uint32)
    for k, pattern in enumerate([0x7F800001, 0xFFA12345, 0x7FC00000, 0xFFFFFFFF, 0x7F80FFFF,
                                 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x00000001]):
        bits[(3 * k) % (T * ih), (7 * k) % n] = pattern
    w = naive.to_bf16_rne(rng.standard_normal((T, ih)))
    w_bits = w.view(np.uint32)
    w_bits[0, 1], w_bits[1, 2], w_bits[2, 3] = 0x7FC10000, 0xFF800001, 0x7F800000   # NaNs, inf
    w_bits[2, 6] = 0x7FFFFFFF        # a NaN whose bits, rounded without the NaN branch, carry
    w[0, 4], w[1, 5] = 0.0, -0.0
    clen = np.array([t0, t0 + 40, t0 + n], np.int64)
    want = np.full((T, t0 + n), -np.inf, np.float32)
    either = np.zeros(want.shape, bool)      # a NaN added to a NaN sum: either one's sign
    for s in range(T):
        for t in range(clen[s] - t0):
            acc = np.float32(0.0)
            for h in range(ih):
                # (the product of two NaNs is either one, the CPU's choice: not built here)
                assert not (np.isnan(d[s * ih + h, t]) and np.isnan(w[s, h]))
                v = naive.to_bf16_rne(d[s * ih + h, t])
                r = v if (v > 0 or v != v) else np.float32(0.0)
                term = naive.to_bf16_rne(np.float32(r * naive.to_bf16_rne(w[s, h])))
                either[s, t0 + t] |= bool(np.isnan(acc) and np.isnan(term))
                acc = np.float32(acc + term)
            want[s, t0 + t] = naive.to_bf16_rne(acc)
    assert np.isnan(want).sum() > either.sum() > 0
    for mix, dots in [(blas_scores.mix_heads_by_head, d), (blas_scores._mix_heads, d.T.copy())]:
        got = np.full((T, t0 + n), -np.inf, np.float32)
        mix(dots, w, clen, t0, got)
        assert np.array_equal(got.view(np.uint32)[~either], want.view(np.uint32)[~either]), mix
        assert np.isnan(got[either]).all()


@np.errstate(invalid="ignore", over="ignore")
def test_the_head_mix_of_finite_dot_products_rounds_them_without_the_nan_branch():
    """An integer kernel's dot products are finite, and the head-major mix told so rounds them
    without bf16's NaN branch: every bit as the naive mix's and as the mix not told so, with
    rounding ties of both parities, zeros of either sign, the largest f32 (which rounds to inf)
    and values that round up a binade among the dot products, and NaN, inf and zero weights."""
    rng = np.random.default_rng(32)
    T, ih, n, t0 = 4, 8, 64, 96
    d = (rng.standard_normal((T * ih, n)) * 300).astype(np.float32)
    bits = d.view(np.uint32)
    for k, pattern in enumerate([0x3F808000, 0x3F818000, 0xC3008000, 0x80000000, 0x00000000,
                                 0x3F7F8000, 0x3FFFFFFF, 0x00000001, 0xBF7F8000, 0x4B7FC000]):
        bits[(5 * k) % (2 * ih), (11 * k) % n] = pattern
    bits[1, 50] = 0x7F7FFFFF      # query 0, head 1: rounds to inf
    w = naive.to_bf16_rne(rng.standard_normal((T, ih)))
    w[0, 4], w[1, 5] = 0.0, -0.0
    # A NaN or infinite weight makes its query's every score NaN or infinite: queries 2 and 3.
    w_bits = w.view(np.uint32)
    w_bits[2, 1], w_bits[3, 2], w_bits[3, 3] = 0x7FC10000, 0xFF800000, 0x7F800000
    clen = np.array([t0 + n, t0 + 40, t0 + n, t0 + 7], np.int64)
    want = np.full((T, t0 + n), -np.inf, np.float32)
    for s in range(T):
        for t in range(clen[s] - t0):
            acc = np.float32(0.0)
            for h in range(ih):
                v = naive.to_bf16_rne(d[s * ih + h, t])
                r = v if v > 0 else np.float32(0.0)
                acc = np.float32(acc + naive.to_bf16_rne(np.float32(r * naive.to_bf16_rne(w[s, h]))))
            want[s, t0 + t] = naive.to_bf16_rne(acc)
    assert np.isnan(want).any() and np.isinf(want[0, t0 + 50]) and np.isfinite(want[1, t0:t0 + 40]).all()
    for finite in (True, False):
        got = np.full((T, t0 + n), -np.inf, np.float32)
        blas_scores.mix_heads_by_head(d, w, clen, t0, got, finite)
        # NaN scores come from the weights alone (0 * inf, a NaN weight): quiet, no payload
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), finite


@np.errstate(invalid="ignore", over="ignore")
@pytest.mark.parametrize("path", [*SCORE_PATHS, pytest.param("vnni-folded", marks=needs_int8_dot)])
def test_every_score_path_keeps_the_bits_of_nan_and_infinite_head_weights(monkeypatch, path):
    """A head weight that is a NaN (with a payload, signalling, or one whose bits would carry if
    rounded as a number), an infinity or a zero of either sign: every path's scores are the
    naive ones bit for bit. The mixing kernels make such a NaN quiet with no payload once a row,
    so a weighted term's rounding needs no NaN test; a dropped or wrong quieting fails here.
    One weight that is not finite a query: two NaNs in one sum leave the CPU's choice of bits."""
    rng = np.random.default_rng(33)
    T, ih, idim, n = 5, 16, 128, 100
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    w_bits = w.view(np.uint32)
    w_bits[0, 3], w_bits[1, 0], w_bits[2, 15], w_bits[3, 7] = 0x7FC10000, 0xFF800001, 0x7FFFFFFF, 0x7F800000
    w[4, 2], w[4, 9] = 0.0, -0.0
    clen = np.array([n, 70, n, 33, n], np.int64)
    if path == "vnni-folded":
        got = vnni_folded_tile_scores(iq, w, keys, clen, n)
    else:
        got = package_tile_scores(path, monkeypatch, iq, w, keys, clen, n)
    want = naive.tile_scores(iq, w, keys, clen)
    assert np.isnan(want[:3, :33]).all() and np.isnan(want[3, :33]).any() and np.isinf(want[3]).any()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("path", SCORE_PATHS)
# The keys hold NaN and infinities on purpose; numpy's BLAS path warns as it multiplies them.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
def test_tile_scores_across_position_chunks_and_workers(monkeypatch, path):
    """Small chunks, split across the workers: every chunk boundary, a NaN and an inf key."""
    monkeypatch.setattr(blas_scores, "_SCORE_CHUNK_ELEMS", 64)
    monkeypatch.setattr(workers, "POOL_MIN_MACS", 0)
    rng = np.random.default_rng(12)
    T, ih, idim, n = 3, 2, 32, 600
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    keys[17, 3] = np.nan
    keys[401, 0] = np.inf
    clen = np.array([0, 300, 600])
    got = package_tile_scores(path, monkeypatch, iq, w, keys, clen, n)
    assert np.array_equal(got, naive.tile_scores(iq, w, keys, clen), equal_nan=True)
    assert np.isnan(got[1, 17]) and np.isnan(got[2, 17])
    if path in INT8_PATHS:
        assert int8_tile_scores(iq, w, keys, clen, n, INT8_PATHS[path]) is None


@pytest.mark.parametrize("path", [pytest.param("avx512-bf16", marks=needs_bf16_dot),
                                  pytest.param("avx512-vnni", marks=needs_int8_dot),
                                  pytest.param("avx2-int8", marks=needs_avx2_int8),
                                  pytest.param("amx", marks=needs_amx)])
def test_packed_tile_scores_do_not_depend_on_the_thread_count(path):
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
            got.append(tier_scores.tile_scores_bf16(iq, w, packed, clen, n) if path == "avx512-bf16"
                       else int8_tile_scores(iq, w, keys, clen, n, INT8_PATHS[path]) if path in INT8_PATHS
                       else amx_tile_scores(iq, w, keys, clen, n))
    finally:
        numba.set_num_threads(before)
    assert before > 1 and np.array_equal(got[0], got[1])


def avx2_tile_scores(iq, w, keys, clen, n, **kwargs):
    """AVX2's integer scores (the per-block layout), or None where they decline."""
    return int8_tile_scores(iq, w, keys, clen, n, "avx2int8", **kwargs)


# The integer paths that take a tile's queries whole: VNNI's per-block and folded kernels, AVX2's.
INTEGER_SCORES = [pytest.param(int8_tile_scores, marks=needs_int8_dot, id="per-block"),
                  pytest.param(vnni_folded_tile_scores, marks=needs_int8_dot, id="folded"),
                  pytest.param(avx2_tile_scores, marks=needs_avx2_int8, id="avx2")]


@pytest.mark.parametrize("scores", INTEGER_SCORES)
@pytest.mark.parametrize("T, ih", [(7, 8), (3, 16), (1, 32)])
def test_integer_scores_write_no_row_past_their_queries(scores, T, ih):
    """The queries' rows are padded to whole row tiles (7 x 8 heads: 56 rows in 64); a kernel
    that mixed the padding as queries would write rows past the tile's. The score and maxima
    buffers are the first T rows of larger ones, their rows after untouched; the key blocks
    every query sees whole (the first ones here) go straight to the mixing kernels."""
    rng = np.random.default_rng(17)
    n, block = 200, 8
    iq, w, keys = _index_inputs(rng, T, ih, 128, n)
    clen = np.arange(n - T + 1, n + 1)
    out = np.full((T + 2, n), 7.0, np.float32)
    maxima = np.full((T + 2, -(-n // block)), 7.0, np.float32)
    got = scores(iq, w, keys, clen, n, out=out[:T], maxima=(block, maxima[:T]))
    want = naive.tile_scores(iq, w, keys, clen)
    assert got is not None and np.array_equal(got, want)
    assert (out[T:] == 7.0).all() and (maxima[T:] == 7.0).all()
    for (s, j), v in _naive_visible_maxima(want, clen, block).items():
        assert maxima[s, j] == v, (s, j)


@pytest.mark.parametrize("scores", [INTEGER_SCORES[0], INTEGER_SCORES[2]])
def test_integer_scores_of_groups_scaled_apart_and_groups_of_zeros(scores):
    """Query and key groups scaled apart (spreads of 3 + 4 and the values' own, within the
    bound int8_dot_exact checks), rows scaled far from 1 (queries by 2^-20, keys by 2^20), and
    groups and rows of zeros among them (scale 1 in the layout, far from their rows' other
    groups): the per-block layout's scores (VNNI's, AVX2's mixed as formed; the folded rows do
    not fold such spreads) are the naive ones."""
    rng = np.random.default_rng(19)
    T, ih, idim, n = 3, 16, 128, 100
    iq = (fp4_rows(rng, T * ih, idim, 3) * np.float32(2.0 ** -20)).reshape(T, ih, idim)
    keys = fp4_rows(rng, n, idim, 4) * np.float32(2.0 ** 20)
    iq[:, ::3, 32:64] = 0
    iq[1, 5] = 0
    keys[::4, 64:96] = 0
    keys[7] = 0
    w = bf16(rng, (T, ih), 0.2)
    clen = np.array([n, 60, n], np.int64)
    got = scores(iq, w, keys, clen, n)
    assert got is not None, "declined: the case's spreads are past the bound"
    assert np.array_equal(got, naive.tile_scores(iq, w, keys, clen))


@pytest.mark.parametrize("scores", INTEGER_SCORES)
def test_scores_beside_a_weight_read_are_shared_with_the_free_helper(monkeypatch, scores):
    """In a decode step's block beside its weight reading (``work_beside``) the integer scores
    (VNNI's, AVX2's) go a run of ``SHARED_BLOCKS`` key blocks at a time to the thread that
    claims it: this one, and the helper once free (here at once; this thread's call waits for
    it to start, so both run). The same scores and block maxima as the naive loops, the last
    run a partial one."""
    if not workers.can_work_beside():
        pytest.skip("one numba thread: nothing runs beside")
    rng = np.random.default_rng(14)
    T, ih, idim, block = 2, 32, 128, 8
    n = (2 * packed_scores.SHARED_BLOCKS + 3) * DOT_LANES - 5
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    clen = np.array([n - 1000, n])
    here, helper_in, calls = threading.get_ident(), threading.Event(), []

    def counted(kernel):
        def run(*args):
            calls.append(threading.get_ident())
            if threading.get_ident() != here:
                helper_in.set()
            else:
                assert helper_in.wait(30)
            kernel(*args)
        return run

    for layout, kernel in list(packed_scores._SHARED.items()):
        monkeypatch.setitem(packed_scores._SHARED, layout, counted(kernel))
    buf = np.full((T, -(-n // block)), 7.0, np.float32)
    with workers.work_beside(lambda: None):
        got = scores(iq, w, keys, clen, n, maxima=(block, buf))
    want = naive.tile_scores(iq, w, keys, clen)
    assert len(set(calls)) == 2 and np.array_equal(got, want)
    for (s, j), v in _naive_visible_maxima(want, clen, block).items():
        assert buf[s, j] == v, (s, j)


def _spread(x, head, groups, factor):
    """``x`` with the given 32-value groups of one head (last axis) scaled by ``factor``."""
    x = x.copy()
    for g in groups:
        x[..., head, g * 32:(g + 1) * 32] *= np.float32(factor)
    return x


@pytest.mark.parametrize("tier", [pytest.param("avx512vnni", marks=needs_int8_dot),
                                  pytest.param("avx512bf16", marks=needs_bf16_dot),
                                  pytest.param("avx2int8", marks=needs_avx2_int8)])
def test_int8_scores_fall_back_a_tier_where_integer_products_are_not_exact(tier):
    """Block scales far apart (a query head's spread plus a key's above 9): the per-block
    integer kernel declines and the cache scores that tile on the bf16 kernel (on AVX2 alone,
    numpy's f32 BLAS), which gives what it always gave; up to that bound it runs and equals
    the naive scores bit for bit."""
    rng = np.random.default_rng(16)
    T, ih, idim, n = 4, 3, 128, 90
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    keys = _spread(keys[:, None], 0, [1], 2.0 ** 4)[:, 0]        # every key: spread 4 or 5
    clen = np.full(T, n)
    wide = _spread(iq, 1, [2, 3], 2.0 ** 6)                      # one head: spread 6 or 7
    assert int8_tile_scores(wide, w, keys, clen, n, tier) is None
    with use_backend(tier):
        cache = indexer_mod.IndexKeyCache(keys)
        assert cache.blocks is None and cache.int8 is not None
        assert np.array_equal(cache.scores(wide, w, clen, n), naive.tile_scores(wide, w, keys, clen))
        # the bf16 layout packed once, on demand, where the bf16 kernel runs
        assert (cache.blocks is not None) == (tier != "avx2int8")
    narrow = _spread(iq, 1, [2, 3], 2.0 ** 3)
    got = int8_tile_scores(narrow, w, keys, clen, n, tier)
    assert got is not None
    assert np.array_equal(got, naive.tile_scores(narrow, w, keys, clen))


@pytest.mark.parametrize("folded_scores", FOLDED_MIXERS)
@pytest.mark.parametrize("T, ih", [(1, 16), (7, 16), (3, 32), (2, 48)])
def test_folded_mixed_scores_with_every_kind_of_head_weight(T, ih, folded_scores):
    """The scores mixed as they are formed (AMX's tile multiplier, or VNNI's ``vpdpbusd`` on
    folded rows; heads a multiple of 16 rows, one or several row tiles a query, odd and even
    numbers of row tiles): bit for bit the naive scores, with head weights of zero, -0, inf,
    -inf and NaN (relu(0) * inf is NaN, as torch's), whatever the thread count and the visible
    lengths."""
    rng = np.random.default_rng(18)
    idim, n = 128, 200
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    w[0, :4] = [0.0, -0.0, np.inf, -np.inf]
    if T > 1:
        w[1, 5] = np.nan
    iq[0, 2] = 0.0                                          # a zero head: scores 0, relu 0
    clen = np.sort(rng.integers(1, n + 1, size=T))
    want = naive.tile_scores(iq, w, keys, clen)
    before = numba.get_num_threads()
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            got = folded_scores(iq, w, keys, clen, n)
            assert got is not None
            assert np.array_equal(got, want, equal_nan=True), f"{np.sum(got != want)} scores differ"
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("folded_scores", FOLDED_MIXERS)
def test_folded_scores_round_on_the_conversion_where_the_guard_allows(monkeypatch, folded_scores):
    """Queries and weights of ordinary size take the kernel's converted rounding (the guard
    says yes); the scores are the naive ones, and the same with the guard made to say no."""
    rng = np.random.default_rng(19)
    T, ih, idim, n = 5, 32, 128, 300
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    clen = np.sort(rng.integers(1, n + 1, size=T))
    want = naive.tile_scores(iq, w, keys, clen)
    asked = []
    guard = tier_scores.converted_mix_exact
    monkeypatch.setattr(tier_scores, "converted_mix_exact", lambda *a: asked.append(guard(*a)) or asked[-1])
    assert np.array_equal(folded_scores(iq, w, keys, clen, n), want)
    assert asked == [True]
    monkeypatch.setattr(tier_scores, "converted_mix_exact", lambda *a: False)
    assert np.array_equal(folded_scores(iq, w, keys, clen, n), want)


@pytest.mark.parametrize("tier", [pytest.param("amx", marks=needs_amx),
                                  pytest.param("avx512vnni", marks=needs_int8_dot)])
def test_folded_scores_fall_back_to_the_per_block_layout_where_rows_do_not_fold(tier):
    """A cache of 128-value keys holds them folded (for AMX's tile products, or on the VNNI tier
    for ``vpdpbusd``: one integer a dot product) and scores there, bit for bit the naive scores.
    Keys or a query head whose block exponents lie more than FOLD_SPREAD apart: the folded
    kernel declines, the cache packs the per-block VNNI layout once and scores there, the same
    scores; keys written later that do not fold do the same for a cache that folded."""
    rng = np.random.default_rng(17)
    T, ih, idim, n = 4, 16, 128, 90
    iq, w, keys = _index_inputs(rng, T, ih, idim, n)
    clen = np.full(T, n)
    with use_backend(tier):
        cache = indexer_mod.IndexKeyCache(keys)
        held = cache.folded if tier == "amx" else cache.vnni_folded
        assert held is not None and cache.int8 is None and cache.blocks is None
        assert (cache.folded is None) == (tier != "amx") and (cache.vnni_folded is None) == (tier == "amx")
        assert np.array_equal(cache.scores(iq, w, clen, n), naive.tile_scores(iq, w, keys, clen))
        wide_q = _spread(iq, 3, [1], 2.0 ** 5)
        declined = (amx_tile_scores(wide_q, w, keys, clen, n) if tier == "amx" else
                    tier_scores.tile_scores_vnni_folded(wide_q, w, cache.vnni_folded,
                                                           cache.vnni_folded_range, clen, n))
        assert declined is None
        assert np.array_equal(cache.scores(wide_q, w, clen, n), naive.tile_scores(wide_q, w, keys, clen))
        assert cache.int8 is not None                            # packed once, on demand
        later = indexer_mod.IndexKeyCache.empty(n, idim)
        later.write(0, keys[:50])
        assert later.int8 is None and later._folds()
        wide_k = _spread(keys[50:, None], 0, [2], 2.0 ** 5)[:, 0]
        later.write(50, wide_k)
        assert later.int8 is not None and not later._folds()
        all_keys = np.concatenate([keys[:50], wide_k])
        assert np.array_equal(later.scores(iq, w, clen, n), naive.tile_scores(iq, w, all_keys, clen))


@pytest.mark.parametrize("tier", [pytest.param("avx2int8", marks=needs_avx2_int8),
                                  pytest.param("avx512vnni", marks=needs_int8_dot),
                                  pytest.param("amx", marks=needs_amx)])
@pytest.mark.parametrize("idim", [32, 128])
def test_a_key_owners_cache_lays_down_only_the_blocks_a_run_reaches(tier, idim):
    """A key owner's cache is sized for the model's whole context, and a run reaches its first
    rows only: the integer layouts' blocks past them are never laid down (hundreds of MB a
    layer at V4.1's sizes, touched for nothing), while the rows reached score as the naive
    scores say, those not written yet as keys of zeros (what a fresh cache held everywhere)."""
    rng = np.random.default_rng(19)
    T, ih, written, width, capacity = 3, 8, DOT_LANES + 5, 3 * DOT_LANES - 7, 64 * DOT_LANES
    iq, w, keys = _index_inputs(rng, T, ih, idim, written)
    clen = np.array([width, written - 2, 1])
    with use_backend(tier):
        cache = indexer_mod.IndexKeyCache.empty(capacity, idim)
        cache.write(0, keys[:20])
        assert cache._blank == -(-20 // DOT_LANES)
        cache.write(20, keys[20:])
        got = cache.scores(iq, w, clen, width)
        assert cache._blank == -(-width // DOT_LANES) < capacity // DOT_LANES
        assert np.array_equal(got, naive.tile_scores(iq, w, cache.keys[:width], clen))
        # A layout packed later (keys that do not fold) starts at the same mark.
        cache.write(written, _spread(keys[:3, None], 0, [idim // 32 - 1], 2.0 ** 5)[:, 0])
        assert np.array_equal(cache.scores(iq, w, clen, width),
                              naive.tile_scores(iq, w, cache.keys[:width], clen))


def test_a_tiles_scores_stay_within_budget_at_a_million_positions():
    """At 1,048,576 positions a tile's [tile, width] f32 scores (the indexer's largest buffer
    per tile) still fit in _TILE_ELEMS (64 MB); so do the packed queries beside them."""
    width = 1 << 20
    tile = lightning._tile_rows(width)
    assert tile >= 1 and tile * width * 4 <= lightning._TILE_ELEMS * 4 == 64 << 20
    assert query_layouts.query_pairs_size(tile, 64, 128) * 4 <= 1 << 20
    assert lightning._tile_rows(4096) == lightning._TILE_MAX


# =============================================================================== the indexer


def _indexer_case(rng, seqlen=40, n_keys=60, ih=4, idim=32, dim=48, q_rank=24):
    cfg = indexer_mod.IndexerCfg(n_heads=ih, head_dim=idim, topk=8, ratio=1, norm_eps=EPS)
    weights = indexer_mod.IndexerWeights(wq_b=bf16(rng, (ih * idim, q_rank), 0.2),
                                         weights_proj=bf16(rng, (ih, dim), 0.2))
    table = layer_rope_table(random_config(index_head_dim=idim), 1, seqlen)
    args = dict(x=bf16(rng, (seqlen, dim)), qr=bf16(rng, (seqlen, q_rank)), start_pos=0, cfg=cfg,
                weights=weights, table=table, offset=3,
                index_k=fp4_quant_e8m0_inplace(bf16(rng, (n_keys, idim))))
    return args


def test_indexer_same_selection_on_every_scoring_path():
    """The AVX512-VNNI and AVX512-BF16 kernels and the f32 BLAS path (CPUs without them) pick
    the same rows from the same scores."""
    args = _indexer_case(np.random.default_rng(14))
    results = []
    for path in TIERS:
        with use_backend(path):
            results.append(indexer_mod.indexer(**args, capture=True))
    for other in results[1:]:
        assert np.array_equal(results[0][0], other[0])
        assert np.array_equal(results[0][2], other[2])
    want = naive.tile_scores(*_indexer_scoring_inputs(args))
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


@pytest.mark.parametrize("tier", [pytest.param("avx2int8", marks=needs_avx2_int8),
                                  pytest.param("avx512bf16", marks=needs_bf16_dot),
                                  pytest.param("avx512vnni", marks=needs_int8_dot),
                                  pytest.param("amx", marks=needs_amx)])
def test_index_key_cache_keeps_its_layout_as_keys_are_written(tier):
    rng = np.random.default_rng(15)
    args = _indexer_case(rng, idim=64 if tier == "amx" else 32)
    with use_backend(tier):
        cache = indexer_mod.IndexKeyCache.empty(*args["index_k"].shape)
        for lo, hi in [(0, 33), (33, 34), (34, 60)]:       # a prefill, then rows a step at a time
            cache.write(lo, args["index_k"][lo:hi])
        assert np.array_equal(cache.keys, args["index_k"])
        if tier == "amx":
            quads, scales, key_range = pack_folded_blocks(args["index_k"])
            assert np.array_equal(cache.folded[0], quads) and np.array_equal(cache.folded[1], scales)
            assert np.array_equal(cache.folded_range, key_range)
            assert cache.int8 is None and cache.blocks is None
        else:
            quads, scales, key_range = pack_int8_blocks(args["index_k"])
            assert np.array_equal(cache.int8[0], quads) and np.array_equal(cache.int8[1], scales)
            assert np.array_equal(cache.int8_range, key_range) and cache.blocks is None
        want = indexer_mod.indexer(**args)[0]
        assert np.array_equal(indexer_mod.indexer(**dict(args, index_k=cache))[0], want)
        # A cache made while the products ran on BLAS holds no packed copy; scoring on a packed
        # kernel later packs it once.
        with use_backend("blas"):
            late = indexer_mod.IndexKeyCache(args["index_k"].copy())
        assert late.blocks is None and late.int8 is None
        assert np.array_equal(indexer_mod.indexer(**dict(args, index_k=late))[0], want)
        if tier == "amx":
            assert np.array_equal(late.folded[0], cache.folded[0]) and late.int8 is None
        else:
            assert np.array_equal(late.int8[0], cache.int8[0])
        args["index_k"] = args["index_k"] + np.float32(2.0 ** -12)
        if tier == "avx2int8":      # not fp4 values: scored on BLAS, as on the blas tier
            got = indexer_mod.indexer(**args)[0]
            with use_backend("blas"):
                assert np.array_equal(got, indexer_mod.indexer(**args)[0])
            return
        with pytest.raises(ValueError, match="bf16 values"):
            indexer_mod.indexer(**args)


# =============================================================================== candidate consumers


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
    for start_pos, seqlen, layer, run in captured_steps(stack, cfg, P, 8, rng):
        end_pos = start_pos + seqlen
        clen = naive.visible_lengths(start_pos, seqlen, 1)
        k = min(topk, end_pos)
        offset = seqlen if start_pos == 0 else 4
        nwin = run.idx.shape[1] - k
        comp = run.idx[:, nwin:].astype(np.int64)
        cands = stack.shared.candidates
        if layer == 0:
            src = run
            want_c = naive.select_candidate_blocks(run.index_score, clen, 1, block)
            assert np.array_equal(cands, want_c)
            assert np.array_equal(comp, naive.indexer_topk_idxs(run.index_score, clen, k, offset))
            continue
        assert src is not None and run.index_score.shape == (seqlen, end_pos)
        want = naive.indexer_topk_idxs(run.index_score, clen, k, offset, candidates=cands)
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


def test_candidate_consumer_quirk_in_the_tiny_golden(reference_golden):
    """In tiny.npz, layer 5 (a candidate consumer, ratio 1, index_topk 6 over 3 blocks of 2) keeps
    candidate-masked picks: the naive selection from the golden's own scores and candidates
    reproduces its index rows, and so does the stack."""
    d = reference_golden("tiny")
    cfg = d.config
    assert cfg.uses_candidates(5) and cfg.ratio(5) == 1
    stack = AttentionStack(cfg, d.weights)
    win, P = cfg.window_size, d.run.prefill
    quirk_rows = []
    for step in range(1 + d.run.decode):
        start_pos = 0 if step == 0 else P + step - 1
        for i in range(cfg.n_layers):
            pre = f"step{step}.layers.{i}."
            run = stack.forward(i, d[pre + "x"], start_pos, capture=(i == 5))
        pre = f"step{step}.layers.5."
        seqlen = d[pre + "x"].shape[0]
        end_pos = start_pos + seqlen
        offset, nwin = (seqlen, min(seqlen, win)) if start_pos == 0 else (win, win)
        k = min(cfg.index_topk, end_pos)
        clen = naive.visible_lengths(start_pos, seqlen, 1)
        cands = d[pre + "shared.candidates"].astype(bool)
        want = d[pre + "idx"][:, nwin:].astype(np.int64)
        assert np.array_equal(
            naive.indexer_topk_idxs(d[pre + "index_score"], clen, k, offset, candidates=cands), want)
        assert np.array_equal(run.idx[:, nwin:], want)
        assert np.array_equal(stack.shared.candidates, cands)
        for s in range(seqlen):
            valid = want[s][want[s] >= 0] - offset
            if np.any(~cands[s, valid]):
                quirk_rows.append((step, s))
    # measured on the golden: the prefill's query 10 and every odd decode step
    assert (0, 10) in quirk_rows
    assert [st for st, _ in quirk_rows[1:]] == list(range(1, d.run.decode + 1, 2))
