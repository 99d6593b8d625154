"""Candidate blocks: the candidate source's best blocks of positions per query.

Blocks of ``block`` positions score their max (NaN wins); each row's newest visible block is
pinned (+inf); torch's top-k over the block scores picks ``topk_blocks`` of them, and those
scoring above -inf are kept. Later index sources may only pick inside those blocks.
"""

from __future__ import annotations

import numpy as np

from ..jit import njit
from ..numerics import is_int
from .block_maxima import visible_block_maxima
from .selection import top_k_sets

__all__ = ["candidate_block_bits", "candidate_mask", "select_candidate_blocks"]


@njit
def _finish_block_scores(block_scores, clen, block, valid):
    """The block scores of rows whose visible blocks hold their maxima: -inf from there to
    ``valid`` blocks, the newest visible block pinned to +inf."""
    for s in range(block_scores.shape[0]):
        seen = -(-max(clen[s], 0) // block)
        block_scores[s, seen:max(seen, min(block_scores.shape[1], valid))] = -np.inf
        if clen[s] > 0:
            block_scores[s, (clen[s] - 1) // block] = np.inf


def _block_scores(scores, clen, block, masked, valid, block_max=None):
    """Per row, the max over each block of ``block`` positions; the newest visible block is +inf.

    With ``masked`` the positions at or past ``clen[s]`` are known to hold -inf (the indexer's
    visibility mask), so their blocks hold -inf and only the visible ones are scanned: in a long
    chunked prefill a row is the whole prefill wide (1,048,576 positions) while a query sees
    only the positions before it. Then only a row's first ``valid`` blocks (at least) are
    written, the rest left undefined: the top-k that reads them scans no further
    (:func:`_candidate_picks`). ``block_max``: the visible blocks' maxima already taken (a
    buffer :meth:`IndexKeyCache.scores` filled), finished in place.
    """
    rows, width = scores.shape
    nb = -(-width // block)
    if block_max is None:
        block_max = np.empty((rows, nb), np.float32)
        visible_block_maxima(scores, clen if masked else np.full(rows, width, np.int64), block,
                              block_max)
    else:
        block_max = block_max[:rows, :nb]
    _finish_block_scores(block_max, clen, block, valid if masked else 0)
    return block_max


def _candidate_picks(scores: np.ndarray, clen: np.ndarray, topk_blocks: int, block: int,
                     masked: bool, block_max: np.ndarray | None = None) -> tuple:
    """Per row, the block scores (:func:`_block_scores`, from ``block_max`` when taken already) and
    the blocks torch's top-k picks from them, ``[rows, min(topk_blocks, n_blocks)]``
    (``masked``: the scores past ``clen`` are -inf)."""
    clen = clen.astype(np.int64)
    nb = -(-scores.shape[1] // block)
    k = min(topk_blocks, nb)
    # The blocks a row sees; past them (masked) every block is -inf: top_k_sets scans only
    # these where torch's branch is the heap's (k * 64 <= n_blocks), which -inf never enters,
    # and -inf picks are dropped anyway; it reads no block past the first k of them then.
    # Unmasked rows are scanned whole.
    heap = masked and k * 64 <= nb
    block_scores = _block_scores(np.ascontiguousarray(scores, np.float32), clen, block, masked,
                       k if heap else nb, block_max)
    seen = (clen + block - 1) // block if masked else np.full(len(clen), nb, np.int64)
    picked = np.empty((scores.shape[0], k), np.int64)
    top_k_sets(block_scores, seen, k, picked)
    return block_scores, picked


def _candidate_block_mask(scores: np.ndarray, clen: np.ndarray, topk_blocks: int,
                          block: int) -> np.ndarray:
    """Per row, which blocks are candidates: ``[rows, n_blocks]`` bool, every score read (the
    indexer's rows, -inf past ``clen``, take :func:`candidate_block_bits`)."""
    block_scores, picked = _candidate_picks(scores, clen, topk_blocks, block, False)
    rows, k = picked.shape
    mask = np.zeros(block_scores.shape, dtype=bool)
    if k:
        r = np.repeat(np.arange(rows), k)
        c = picked.reshape(-1)
        keep = block_scores[r, c] > -np.inf
        mask[r[keep], c[keep]] = True
    return mask


@njit
def _pack_picks(block_scores, picked, out):
    """The picked blocks scoring above -inf as bits of ``out`` (zeros), packed along each row in
    ``np.packbits``' order (block 0 the first byte's highest bit)."""
    for s in range(picked.shape[0]):
        for c in picked[s]:
            if block_scores[s, c] > -np.inf:
                out[s, c >> 3] |= np.uint8(0x80 >> (c & 7))


def candidate_block_bits(scores: np.ndarray, clen: np.ndarray, topk_blocks: int, block: int,
                          out: np.ndarray, block_max: np.ndarray | None = None) -> None:
    """:func:`_candidate_block_mask` of rows that are -inf past ``clen`` (so scanned only as far
    as they see), as bits packed along each row into ``out`` (zeros; ``np.packbits``' layout),
    without a row-wide bool array: a long chunked prefill's rows are 131,072 blocks wide while a
    query picks 2,048. ``block_max``: the visible blocks' maxima, taken with the scores."""
    block_scores, picked = _candidate_picks(scores, clen, topk_blocks, block, True, block_max)
    _pack_picks(block_scores, picked, out)



def candidate_mask(packed_blocks: np.ndarray, width: int, block_size: int) -> np.ndarray:
    """Expand per-block candidates (bits packed along each row, ``np.packbits``) to ``[rows, width]``."""
    n_blocks = -(-width // block_size)
    blocks = np.unpackbits(packed_blocks, axis=1, count=n_blocks).astype(bool)
    return np.repeat(blocks, block_size, axis=1)[:, :width]


def select_candidate_blocks(scores: np.ndarray, clen, topk_blocks: int,
                            block_size: int) -> np.ndarray:
    """The candidate mask ``[rows, width]`` bool of the candidate source.

    Blocks of ``block_size`` positions score their max; each row's newest visible block is
    pinned; torch's top-k over the block scores picks ``min(topk_blocks, n_blocks)`` blocks
    and those scoring above -inf are kept, expanded back to positions.
    """
    scores = np.asarray(scores)
    if not (np.issubdtype(scores.dtype, np.floating) or scores.dtype.name == "bfloat16"):
        raise TypeError(f"scores must be a real floating-point array, got dtype {scores.dtype}")
    scores = scores.astype(np.float32, copy=False)
    if scores.ndim != 2:
        raise ValueError(f"scores must be [rows, width], got shape {scores.shape}")
    rows, width = scores.shape
    clen = np.asarray(clen)
    if clen.dtype == np.bool_ or not np.issubdtype(clen.dtype, np.integer):
        raise TypeError(f"clen must be integers, got dtype {clen.dtype}")
    if clen.shape not in ((), (rows,)):
        raise ValueError(f"clen must be one integer or one per row ({rows}), got shape {clen.shape}")
    clen = np.broadcast_to(clen.astype(np.int64), (rows,))
    for name, v in (("topk_blocks", topk_blocks), ("block_size", block_size)):
        if not is_int(v):
            raise TypeError(f"{name} must be an integer, got {v!r}")
    if topk_blocks < 1 or block_size < 1:
        raise ValueError(f"topk_blocks ({topk_blocks}) and block_size ({block_size}) must be >= 1")
    if np.any(clen < 0) or np.any(clen > width):
        raise ValueError(f"clen must lie in 0..{width}")
    blocks = _candidate_block_mask(scores, clen, topk_blocks, block_size)
    return np.repeat(blocks, block_size, axis=1)[:, :width]
