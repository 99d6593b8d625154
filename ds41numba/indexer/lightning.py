"""The lightning indexer itself: which compressed positions each query attends to.

Per tile of queries it does what the reference's ``Indexer`` does: project the queries
(``wq_b``), rotate them (RoPE), quantise them (fp4, e8m0 scales), score them against the index
keys (ReLU'd dot products mixed by the per-token head weights ``weights_proj``), mask what a
query cannot see, and select its ``topk`` best positions (torch's CPU ``topk``, ties included);
the candidate source also publishes its best blocks (:mod:`.candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16 as BF16

from ..batch import SINGLE, BatchRow, checked_batch
from ..numerics import (DOT_LANES, fp4_quant_e8m0_inplace, is_int, linear_bf16, rms_norm,
                        tier_at_least, to_bf16_rne)
from ..rope import apply_rotary
from ..step import Step
from .candidate_scores import clear_key_blocks, mask_outside_candidates, needed_keys
from .candidates import candidate_block_bits
from .key_cache import IndexKeyCache
from .query_layouts import query_pairs_size
from .selection import select_rows
from .visibility import visible_lengths

__all__ = ["IndexerWeights", "IndexerCfg", "index_keys", "indexer"]

# Elements of one tile's [tile, positions] scores: 64 MB of f32, whatever the sequence length.
_TILE_ELEMS = 1 << 24
# Queries of one tile at most: enough query heads for the packed kernels' rows of DOT_ROWS.
_TILE_MAX = 256
# Rows of the indexer's query projection run as one product.
_PROJ_ROWS = 1024


@dataclass
class IndexerWeights:
    """``wq_b [ih*id, q_lora]``, ``weights_proj [ih, dim]``; key owners add ``wk [id, hd]`` and
    ``k_norm [id]``. All bf16 values."""

    wq_b: np.ndarray
    weights_proj: np.ndarray
    wk: np.ndarray | None = None
    k_norm: np.ndarray | None = None


@dataclass(frozen=True)
class IndexerCfg:
    """What one index source needs to know about its place in the stack."""

    n_heads: int
    head_dim: int
    topk: int
    ratio: int
    norm_eps: float
    candidate_source: bool = False
    use_candidates: bool = False
    candidate_topk_blocks: int = 1
    candidate_block_size: int = 1

    @classmethod
    def for_layer(cls, config, layer_id: int) -> "IndexerCfg":
        return cls(n_heads=config.index_n_heads, head_dim=config.index_head_dim,
                   topk=config.index_topk, ratio=config.ratio(layer_id), norm_eps=config.norm_eps,
                   candidate_source=config.is_candidate_source(layer_id),
                   use_candidates=config.uses_candidates(layer_id),
                   candidate_topk_blocks=config.candidate_topk_blocks,
                   candidate_block_size=config.candidate_block_size)


def index_keys(latents: np.ndarray, positions: np.ndarray, weights: IndexerWeights, table,
               norm_eps: float, ref_rows: int | None = None) -> np.ndarray:
    """Index keys of new latents (pre-RoPE): projected, normed, rotated, fp4 (e8m0) quantised.
    ``ref_rows``: the latents of the reference's call (a chunked prefill's whole), as in
    :func:`~ds41numba.numerics.linear_bf16`."""
    k = rms_norm(linear_bf16(latents, weights.wk, ref_rows=ref_rows), weights.k_norm, norm_eps)
    k = apply_rotary(k, positions, table, inplace=True)
    return fp4_quant_e8m0_inplace(k)


def _tile_rows(width: int) -> int:
    """Queries scored as one tile against ``width`` positions: as many as keep the tile's
    ``[tile, width]`` f32 scores within ``_TILE_ELEMS`` (at least one), at most ``_TILE_MAX``."""
    return max(1, min(_TILE_MAX, _TILE_ELEMS // max(width, 1)))


def _check_indexer_args(x, qr, start_pos, cfg, weights, index_k, offset, candidate_blocks, tile,
                        prefill_len):
    """The shapes the scoring kernels index by must agree: a mismatch is an error, not a stray read."""
    def bad(msg):
        raise ValueError(f"indexer: {msg}")

    if not isinstance(cfg, IndexerCfg):
        raise TypeError(f"indexer: cfg must be an IndexerCfg, got {type(cfg).__name__}")
    for name in ("n_heads", "head_dim", "topk", "ratio", "candidate_topk_blocks", "candidate_block_size"):
        if not is_int(getattr(cfg, name), 1):
            bad(f"cfg.{name} must be a positive integer, got {getattr(cfg, name)!r}")
    if not is_int(start_pos, 0) or not is_int(offset, 0):
        bad(f"start_pos and offset must be integers >= 0, got {start_pos!r} and {offset!r}")
    if tile is not None and not is_int(tile, 1):
        bad(f"tile must be None or a positive integer, got {tile!r}")
    if isinstance(index_k, IndexKeyCache):
        index_k = index_k.keys
    for name, a in (("x", x), ("qr", qr), ("index_k", index_k)):
        dtypes = (np.float32, BF16) if name == "x" else (np.float32,)
        if not isinstance(a, np.ndarray) or a.dtype not in dtypes or a.ndim != 2:
            bad(f"{name} must be a 2-D float32 array, got {getattr(a, 'dtype', type(a).__name__)} "
                f"{getattr(a, 'shape', '')}")
    seqlen = x.shape[0]
    if seqlen == 0 or qr.shape[0] != seqlen:
        bad(f"x and qr must have the same number (>= 1) of rows, got {x.shape} and {qr.shape}")
    ih, idim = cfg.n_heads, cfg.head_dim
    for name, w, want in (("weights_proj", weights.weights_proj, (ih, x.shape[1])),
                          ("wq_b", weights.wq_b, (ih * idim, qr.shape[1]))):
        if tuple(getattr(w, "shape", ())) != want:
            bad(f"weights.{name} must have shape {list(want)}, got {list(getattr(w, 'shape', ()))}")
    if prefill_len is not None and not (is_int(prefill_len, 1) and start_pos + seqlen <= prefill_len):
        bad(f"prefill_len must be an integer >= {start_pos + seqlen} (the chunk's end), got "
            f"{prefill_len!r}")
    width = Step(start_pos, seqlen, prefill_len).ref_end // cfg.ratio
    if index_k.shape[0] < width or index_k.shape[1] != idim:
        bad(f"index_k must be [>= {width}, {idim}] (the keys of every position scored), got "
            f"{list(index_k.shape)}")
    if cfg.use_candidates:
        nb = -(-width // cfg.candidate_block_size)
        want = (seqlen, (nb + 7) // 8)
        if (not isinstance(candidate_blocks, np.ndarray) or candidate_blocks.dtype != np.uint8
                or candidate_blocks.shape != want):
            bad(f"candidate_blocks must be the candidate source's packed uint8 mask of shape "
                f"{list(want)}, got {getattr(candidate_blocks, 'shape', candidate_blocks)}")



def _as_key_cache(index_k, width: int) -> IndexKeyCache:
    """``index_k`` as a key cache: itself, or its first ``width`` rows packed now."""
    if isinstance(index_k, IndexKeyCache):
        return index_k
    try:
        return IndexKeyCache(index_k[:width])
    except ValueError:
        raise ValueError("indexer: index_k must hold bf16 values (the fp4-quantised keys)") from None


class _Queries:
    """The index queries of a step's rows: projected (``wq_b``), rotated and fp4-quantised,
    several tiles' rows at once (a 256-row product is well below BLAS's speed) into one buffer
    reused throughout (fresh arrays this size cost page faults each time)."""

    def __init__(self, qr, wq_b, cfg, table, positions, tile, ref_rows):
        self.qr, self.wq_b, self.table, self.positions = qr, wq_b, table, positions
        self.ref_rows = ref_rows
        self.proj_rows = tile * max(1, _PROJ_ROWS // tile)
        self.buf = np.empty((min(self.proj_rows, len(qr)), cfg.n_heads, cfg.head_dim), np.float32)
        self.rows = None

    def tile(self, s0: int, s1: int) -> np.ndarray:
        """The queries ``[s1 - s0, ih, id]`` of rows ``s0 .. s1`` (tiles in order)."""
        if s0 % self.proj_rows == 0:
            p1 = min(len(self.qr), s0 + self.proj_rows)
            iq = linear_bf16(self.qr[s0:p1], self.wq_b, out=self.buf[:p1 - s0], ref_rows=self.ref_rows)
            iq = iq.reshape(p1 - s0, *self.buf.shape[1:])
            self.rows = fp4_quant_e8m0_inplace(apply_rotary(iq, self.positions[s0:p1], self.table,
                                                            inplace=True))
        first = s0 % self.proj_rows
        return self.rows[first:first + s1 - s0]


class _Scorer:
    """A step's tiles of index scores against the key cache, in buffers reused tile after
    tile; with the candidate source's block size (``block``), the rows' block maxima too, taken
    by the score kernel while the scores are in cache (a second pass over a tile's rows, 64 MB
    at 1M positions, costs more)."""

    def __init__(self, keys: IndexKeyCache, cfg, tile: int, seqlen: int, width: int):
        rows = min(tile, seqlen)
        self.keys, self.width = keys, width
        self.buf = np.empty((rows, width), np.float32)
        self.dirty_to = None        # buf's columns from here on hold -inf (None: unknown)
        # A consumer's last tile's needed key blocks, where alone its rows are not -inf (None:
        # unknown, e.g. after a tile scored whole).
        self.written = None
        self.qbuf = (np.empty(query_pairs_size(rows, cfg.n_heads, cfg.head_dim), np.uint32)
                     if tier_at_least("avx2int8") else None)
        self.block = cfg.candidate_block_size
        self.block_max = (np.empty((rows, -(-width // self.block)), np.float32)
                          if cfg.candidate_source else None)

    def scores(self, iq, w, clen, need=None) -> tuple:
        """A tile's scores after the visibility mask, and ``(block, block maxima)`` or None.
        ``need``: a consumer's :class:`~.candidate_scores.NeededKeys` of these queries; then
        only the scores in the key blocks holding a candidate are formed, and the rows come
        masked to the candidates (outside them -inf, within ``need.spans`` alone).

        A consumer's rows are -inf but in the key blocks the tile before wrote: only those are
        cleared, and only this tile's masked, not whole rows (4 MB a query at 1M positions)."""
        n = len(clen)
        maxima = None if self.block_max is None else (self.block, self.block_max[:n])
        clean = need is not None and self.written is not None and n <= len(self.written)
        if clean:
            clear_key_blocks(self.buf, self.written, DOT_LANES)
        got = self.keys.scores(iq, w, clen, self.width, out=self.buf[:n], qbuf=self.qbuf,
                               dirty_to=self.dirty_to, maxima=maxima, need=need)
        if need is not None:
            mask_outside_candidates(got, need.bits, clen, self.block,
                                    (need.key_blocks, DOT_LANES) if clean else None)
        self.written = None if need is None else need.key_blocks
        # What the tile wrote: below each row's clen (later writers only write -inf).
        self.dirty_to = max(int(clen.max(initial=0)), 0)
        return got, maxima


def _selection(scores, clen, k: int, offset: int, maxima) -> np.ndarray:
    """A tile's ``topk_idxs``: each row's top-k positions plus ``offset``, -1 past its visible
    range. ``maxima``: ``(block, hints)``, each hint at least its block's max (the candidate
    source's block scores, the pinned block's +inf too), which let the top-k's scan skip runs
    of a row; or a consumer's :class:`~ds41numba.topk.ListedSpans`, where alone its masked rows
    are above -inf."""
    picked = np.zeros((len(clen), k), np.int64)
    if k:
        select_rows(scores, clen, k, picked, maxima)
    # Positions past a query's visible range are dropped; a candidate-masked position inside
    # it that top-k still picked (fewer candidates than k) stays valid.
    return np.where(picked >= clen[:, None], -1, picked + offset)


def indexer(x: np.ndarray, qr: np.ndarray, start_pos: int, cfg: IndexerCfg,
            weights: IndexerWeights, table, index_k, offset: int,
            candidate_blocks: np.ndarray | None = None, tile: int | None = None,
            capture: bool = False, prefill_len: int | None = None, observer=None,
            batch: BatchRow = SINGLE):
    """Select each query's compressed positions.

    ``index_k`` holds the shared index keys (at least ``end_pos // r`` rows): an
    :class:`IndexKeyCache` (a key owner's, kept in the scorer's layout as keys are written) or
    an array of bf16 values (the fp4-quantised keys), packed here when the scorer needs it.
    ``offset`` is added to every kept index (the number of window rows ahead of the compressed
    rows). Returns ``(topk_idxs [seqlen, k] int32, candidate_blocks or None, index_score or
    None)``: the candidate source's per-block mask (bits packed along rows, see
    :func:`candidate_mask`), and with ``capture`` the scores after the visibility mask and
    before candidate masking.

    ``prefill_len`` makes the step rows ``start_pos ..`` of a prefill of that many tokens (a
    chunk): each query sees ``(s + 1) // r`` positions as in the one-shot prefill, and the rows
    (scores of the one-shot's width ``prefill_len // r``, selection, candidates, every sum) are
    that prefill's rows. ``index_k`` then needs the keys up to the chunk's end only.
    ``batch``: one sequence of a batch in lockstep; the projections (``weights_proj``,
    ``wq_b``) sum as the batch's products of B times the step's rows do
    (:mod:`ds41numba.batch`); the scores and the selection are per query.

    ``observer`` (the golden captures' hook, :mod:`ds41numba.golden.captures`), if given, sees
    every tile of queries (``s0`` counts from this call's first row, a chunk's too) while its
    buffers are live (copy what it keeps): where ``observer.wants_index_scores(s0, T)``,
    ``observer.index_scores(s0, iq, w, scores)`` with the fp4-rounded queries ``[T, ih, id]``,
    the head weights ``[T, ih]`` and the scores after the visibility mask, before candidate
    masking; then ``observer.index_selection(s0, scores, topk, maxima)`` with the scores top-k
    chose from (candidate-masked), the tile's rows of ``topk_idxs`` and the block hints the
    top-k skipped by (``(block, hints)``, a consumer's ``ListedSpans``, or None). It changes
    nothing computed.

    A candidate consumer forms only the scores inside its queries' candidate blocks (in key
    blocks of ``DOT_LANES``, or their quarters; :mod:`.candidate_scores`) unless the scores before the candidate
    mask are recorded (``capture``, or an observer that wants them): its masked rows, and so
    its selection, are the same either way.
    """
    _check_indexer_args(x, qr, start_pos, cfg, weights, index_k, offset, candidate_blocks, tile,
                        prefill_len)
    step = Step(start_pos, x.shape[0], prefill_len, checked_batch(batch, "indexer"))
    seqlen = step.seqlen
    width = step.ref_end // cfg.ratio
    k = min(cfg.topk, width)
    clen = visible_lengths(start_pos, seqlen, cfg.ratio, prefill=not step.decode)
    index_k = _as_key_cache(index_k, width)
    scale = np.float32(cfg.head_dim ** -0.5 * cfg.n_heads ** -0.5)
    w_all = to_bf16_rne(linear_bf16(x, weights.weights_proj, ref_rows=step.ref_rows) * scale)

    topk_idxs = np.empty((seqlen, k), np.int32)
    # The candidate source's mask, one bit per block and query: it must outlive the step's
    # later layers, and at long lengths a bool per position would be the step's largest array.
    published = (np.zeros((seqlen, (-(-width // cfg.candidate_block_size) + 7) // 8), np.uint8)
                 if cfg.candidate_source else None)
    score_capture = np.empty((seqlen, width), np.float32) if capture else None
    tile = tile or _tile_rows(width)
    queries = _Queries(qr, weights.wq_b, cfg, table, step.positions, tile, step.ref_rows)
    scorer = _Scorer(index_k, cfg, tile, seqlen, width)
    for s0 in range(0, seqlen, tile):
        s1 = min(seqlen, s0 + tile)
        iq = queries.tile(s0, s1)
        need = (needed_keys(candidate_blocks[s0:s1], clen[s0:s1], cfg.candidate_block_size, width)
                if cfg.use_candidates else None)
        # Every score is formed where they are recorded before the candidate mask.
        whole = capture or (observer is not None and observer.wants_index_scores(s0, s1 - s0))
        scores, maxima = scorer.scores(iq, w_all[s0:s1], clen[s0:s1], None if whole else need)
        if capture:
            score_capture[s0:s1] = scores
        if whole and observer is not None:
            observer.index_scores(s0, iq, w_all[s0:s1], scores)
        if cfg.candidate_source:
            candidate_block_bits(scores, clen[s0:s1], cfg.candidate_topk_blocks,
                                 cfg.candidate_block_size, published[s0:s1], maxima[1])
        if need is not None:
            if whole:       # formed whole for the record: masked now
                mask_outside_candidates(scores, need.bits, clen[s0:s1], cfg.candidate_block_size)
            maxima = need.spans
        topk_idxs[s0:s1] = _selection(scores, clen[s0:s1], k, offset, maxima)
        if observer is not None:
            observer.index_selection(s0, scores, topk_idxs[s0:s1], maxima)
    return topk_idxs, published, score_capture
