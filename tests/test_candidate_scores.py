"""A candidate consumer scores only inside its candidate blocks: its masked score rows and its
selection must be exactly those of the full rows masked afterwards (naive.tile_scores, the
candidate mask, naive.indexer_topk_idxs), on every tier this CPU runs, with ties, rows with
fewer candidate positions than k (top-k then picks -inf positions: which ones is torch's tie
order over the whole masked row), rows without a candidate, both of torch's top-k branches,
and score buffers reused tile after tile (a skipped key block keeps the last tile's scores
until the mask clears them).
"""

import importlib

import numpy as np
import pytest

import naive
from helpers import EPS, bf16, random_config
from numerics_helpers import TIERS
from ds41numba import fp4_quant_e8m0_inplace
from ds41numba.attention import layer_rope_table
from ds41numba.numerics import DOT_LANES, use_backend

indexer_mod = importlib.import_module("ds41numba.indexer")
candidate_scores = importlib.import_module("ds41numba.indexer.candidate_scores")

class _Recorder:
    """An observer that keeps the masked scores top-k chose from, and wants no scores before
    the candidate mask (so the consumer forms only its candidates' scores)."""

    def __init__(self, seqlen, width):
        self.masked = np.full((seqlen, width), np.nan, np.float32)

    def wants_index_scores(self, s0, n):
        return False

    def index_scores(self, s0, iq, w, scores):
        raise AssertionError("index_scores called where they were not wanted")

    def index_selection(self, s0, scores, topk, maxima):
        self.masked[s0:s0 + scores.shape[0]] = scores


def _consumer_case(seed, seqlen, ih, idim, block, density, topk, zero_heads):
    """A ratio-1 consumer's prefill of ``seqlen`` queries with random candidate bits (each
    visible block a candidate with probability ``density``; row 3 none, row 5 one block);
    ``zero_heads``: head weights of zero, so whole rows of scores tie at 0."""
    rng = np.random.default_rng(seed)
    dim, q_rank = 48, 24
    cfg = indexer_mod.IndexerCfg(n_heads=ih, head_dim=idim, topk=topk, ratio=1, norm_eps=EPS,
                                 use_candidates=True, candidate_topk_blocks=4,
                                 candidate_block_size=block)
    proj = bf16(rng, (ih, dim), 0.2)
    if zero_heads:
        proj[: ih // 2 + 1] = 0
    weights = indexer_mod.IndexerWeights(wq_b=bf16(rng, (ih * idim, q_rank), 0.2), weights_proj=proj)
    nb = -(-seqlen // block)
    clen = np.arange(1, seqlen + 1)
    bits = (rng.random((seqlen, nb)) < density) & (np.arange(nb)[None, :] < -(-clen[:, None] // block))
    bits[3] = False
    bits[5] = False
    bits[5, 0] = True
    args = dict(x=bf16(rng, (seqlen, dim)), qr=bf16(rng, (seqlen, q_rank)), start_pos=0, cfg=cfg,
                weights=weights, table=layer_rope_table(random_config(index_head_dim=idim), 1, seqlen),
                offset=2, index_k=fp4_quant_e8m0_inplace(bf16(rng, (seqlen, idim))),
                candidate_blocks=np.packbits(bits, axis=1))
    return args, np.repeat(bits, block, axis=1)[:, :seqlen], clen


# seed, seqlen, heads, head dim, block, density, topk, zero heads: per-block and folded layouts
# (32 heads of 128 run the mixing tile kernels), blocks dividing DOT_LANES and not, top-k's
# heap branch (k * 64 <= width) and its nth_element branch.
CASES = [
    (1, 200, 4, 32, 8, 0.3, 2, False),
    (2, 200, 4, 32, 8, 0.1, 8, True),
    (3, 150, 32, 128, 8, 0.25, 2, False),
    (4, 150, 32, 128, 4, 0.05, 6, True),
    (5, 170, 3, 64, 3, 0.4, 2, True),
    (6, 130, 16, 128, 12, 0.5, 40, False),
]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_consumer_scores_and_picks_only_inside_its_candidates(tier, case):
    args, allowed, clen = _consumer_case(*case)
    seqlen, k, block = args["x"].shape[0], args["cfg"].topk, args["cfg"].candidate_block_size
    with use_backend(tier):
        rec = _Recorder(seqlen, seqlen)
        got = indexer_mod.indexer(**args, tile=7, observer=rec)
        whole = indexer_mod.indexer(**args, tile=7, capture=True)
    full = naive.tile_scores(*_scoring_inputs(args))
    assert np.array_equal(whole[2], full), "the captured scores are not the full rows"
    masked = np.where(allowed, full, np.float32(-np.inf))
    assert np.array_equal(rec.masked, masked, equal_nan=True), \
        f"{np.sum(rec.masked != masked)} masked scores differ"
    want = naive.indexer_topk_idxs(full, clen, k, args["offset"], candidates=allowed)
    assert np.array_equal(got[0], want) and np.array_equal(whole[0], want)
    # The case reaches what it is for: -inf picks inside the visible range, and skipped blocks.
    assert np.any((want >= 0) & (np.take_along_axis(masked, np.clip(want - 2, 0, None), 1) == -np.inf))
    need = candidate_scores.needed_key_blocks(args["candidate_blocks"], clen, block, DOT_LANES,
                                              -(-seqlen // DOT_LANES))
    assert not need.all() and need.any()


def _scoring_inputs(args):
    """The indexer's own queries, head weights and keys, as naive.tile_scores takes them
    (test_indexer's, which a consumer's arguments also fit)."""
    from test_indexer import _indexer_scoring_inputs
    return _indexer_scoring_inputs(args)


@pytest.mark.parametrize("lanes, block", [(32, 8), (32, 3), (32, 12), (16, 32)])
def test_needed_key_blocks_are_the_blocks_holding_a_visible_candidate(lanes, block):
    rng = np.random.default_rng(lanes + block)
    T, width = 9, 301
    nb = -(-width // block)
    bits = rng.random((T, nb)) < 0.2
    clen = rng.integers(0, width + 1, T)
    got = candidate_scores.needed_key_blocks(np.packbits(bits, axis=1), clen, block, lanes,
                                             -(-width // lanes))
    per_pos = np.repeat(bits, block, axis=1)[:, :width]
    for s in range(T):
        for b in range(got.shape[1]):
            p0 = b * lanes
            want = p0 < clen[s] and per_pos[s, p0:p0 + lanes].any()
            assert got[s, b] == want, (s, b)


def test_mask_needs_bits_that_cover_the_rows():
    with pytest.raises(ValueError, match="do not cover"):
        candidate_scores.mask_outside_candidates(np.zeros((2, 40), np.float32),
                                                 np.zeros((2, 1), np.uint8), np.array([3, 4]), 4)


@pytest.mark.parametrize("block", [3, 4, 8, 12, 32])
def test_candidate_quarters_are_the_quarters_holding_a_visible_candidate(block):
    rng = np.random.default_rng(block)
    T, width, quarter = 9, 301, 8
    bits = rng.random((T, -(-width // block))) < 0.2
    bits[0] = False
    clen = rng.integers(0, width + 1, T)
    clen[1] = width
    offsets, firsts = candidate_scores.candidate_quarters(np.packbits(bits, axis=1), clen, block)
    per_pos = np.repeat(bits, block, axis=1)[:, :width]
    for s in range(T):
        want = [u * quarter for u in range(-(-width // quarter))
                if per_pos[s, u * quarter:min((u + 1) * quarter, clen[s])].any()]
        assert list(firsts[offsets[s]:offsets[s + 1]]) == want, s
    assert offsets[1] == 0 and offsets[-1] == len(firsts) > 0
