"""One compressed-attention layer for any ``compress_ratio``: ``attention_any``.

Every query attends to two sets of rows: the sliding window of the last ``window_size``
tokens (fp8-quantised KV, kept in a ring) and, for ratio > 0, the compressed positions its
index source selected (fp4 latents of the shared compressed cache). Attention is sparse over
those listed rows, with a per-head *sink* logit that absorbs probability mass without
contributing a value. The heads' outputs are projected back in ``o_groups`` independent groups
(``wo_a``) and then mixed (``wo_b``).

The forward builds what every query needs first (window rows, latents, index keys: the key
side) and then answers the queries (the index selection, then tiles run end to end), so memory
grows with ``seqlen * (dim + head_dim)`` rather than ``seqlen * heads * head_dim``. Given the
caches, any rows of a prefill's queries can be answered on their own (:func:`attention_rows`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .batch import SINGLE, checked_batch
from .compressor import compressor, latent_positions
from .indexer import IndexerCfg, index_keys, indexer
from .numerics import (MATVEC_MAX_ROWS, act_quant_fp8_inplace, fp4_quant_e4m3_inplace, is_int,
                       linear_bf16, linear_bf16_beside, rms_norm, single_threaded_blas)
from .rope import apply_rotary, yarn_freqs_cis
from .sparse_attention import KvPairs, kv_pairs, sparse_attn
from .step import Step

__all__ = ["CompAttnRun", "attention_any", "attention_rows", "KvPairs", "kv_pairs", "sparse_attn",
           "window_index_rows", "index_rows", "output_projection", "layer_rope_table"]

#: Queries a prefill answers per tile (``_default_tile``). Each fresh page a tile's buffers take
#: costs its first write (on the project's KVM hosts about 2.6 s a GB, the host backing it
#: anew); at 1,024 rows the query, output and middle buffers took 302 MB. From 128 to 512 rows
#: the products run alike; against 1,024, a 16,384-token golden of layer 20 took 0.96 of the
#: time (peak RSS 902 MiB for 1,175) and a 65,536-token prefill 0.96 (peak 4.55 GiB for 4.79).
_TILE_ROWS = 256


@dataclass
class CompAttnRun:
    """One layer's step. ``out`` is always set; the rest only with ``capture=True``.

    ``q`` queries after RoPE ``[seqlen, H, hd]``; ``kv_rows`` the rows attention received
    (window rows, then compressed rows); ``idx`` the index rows ``[seqlen, topk]`` int32
    (window entries, then compressed entries; -1 = skip); ``o`` the attention output before
    the inverse RoPE; ``index_score`` the indexer's scores after the visibility mask (index
    sources only).
    """

    out: np.ndarray
    q: np.ndarray | None = None
    kv_rows: np.ndarray | None = None
    idx: np.ndarray | None = None
    topk: int | None = None
    o: np.ndarray | None = None
    index_score: np.ndarray | None = None


@functools.lru_cache(maxsize=4)
def _cached_table(dim, length, original_seq_len, base, factor, beta_fast, beta_slow):
    return yarn_freqs_cis(dim, length, original_seq_len, base, factor, beta_fast, beta_slow)


def layer_rope_table(config, ratio: int, end_pos: int):
    """The layer's ``(cos, sin)`` table covering positions ``0 .. end_pos - 1`` at least.

    Ratio-0 layers rotate with ``rope_theta`` and no YaRN; compressed layers with
    ``compress_rope_theta`` and YaRN. Table rows do not depend on the table's length, so a
    longer cached table serves shorter needs.
    """
    length = min(config.max_seq_len, max(1024, 1 << (max(end_pos, 1) - 1).bit_length()))
    if ratio == 0:
        return _cached_table(config.rope_head_dim, length, 0, float(config.rope_theta), 1.0, 0, 0)
    return _cached_table(config.rope_head_dim, length, config.original_seq_len,
                         float(config.compress_rope_theta), float(config.rope_factor),
                         config.beta_fast, config.beta_slow)


def window_index_rows(start_pos: int, seqlen: int, window: int,
                      prefill_len: int | None = None) -> np.ndarray:
    """Index rows into the window KV rows; -1 marks an entry to skip.

    Prefill: query t sees the new rows ``max(0, t - win + 1) ..`` (``min(seqlen, win)`` entries,
    future ones -1). Decode: the whole ring, oldest slot first, slots not yet filled -1.
    ``prefill_len``: the rows ``start_pos ..`` of a prefill of that many tokens (a chunk), as
    the one-shot prefill's rows (``min(prefill_len, win)`` entries, into its ``prefill_len`` rows).
    """
    for name, v, lo in (("start_pos", start_pos, 0), ("seqlen", seqlen, 1), ("window", window, 1)):
        if not is_int(v, lo):
            raise ValueError(f"window_index_rows: {name} must be an integer >= {lo}, got {v!r}")
    if prefill_len is not None and not is_int(prefill_len, start_pos + seqlen):
        raise ValueError(f"window_index_rows: prefill_len must be an integer >= "
                         f"{start_pos + seqlen}, got {prefill_len!r}")
    if prefill_len is None and start_pos > 0 and seqlen != 1:
        raise ValueError(f"window_index_rows: a decode (start_pos {start_pos} > 0) has one token, got {seqlen}")
    step = Step(start_pos, seqlen, prefill_len)
    if not step.decode:
        t = step.positions[:, None]
        pos = np.maximum(0, t - window + 1) + np.arange(min(step.ref_seqlen, window))[None, :]
        return np.where(pos > t, -1, pos).astype(np.int32)
    first = start_pos % window + 1
    slots = (np.arange(window) + first) % window
    return np.where(slots > start_pos, -1, slots).astype(np.int32)[None, :]


def index_rows(start_pos: int, seqlen: int, window: int, compressed=None,
               prefill_len: int | None = None) -> np.ndarray:
    """The index rows sparse attention receives, ``[seqlen, width]`` int32: the window entries
    (:func:`window_index_rows`), then ``compressed``, the compressed entries (the shared
    selection, offsets applied; None for a ratio-0 layer)."""
    win = window_index_rows(start_pos, seqlen, window, prefill_len)
    return win if compressed is None else np.concatenate([win, compressed], axis=1)


def output_projection(o: np.ndarray, wo_a, wo_b, out=None, mid=None,
                      ref_rows: int | None = None) -> np.ndarray:
    """Grouped low-rank output projection: ``o [S, H*hd]`` through ``wo_a``, a grouped
    :class:`Bf16Matrix` (head group g through its own block of rows), then through ``wo_b``.
    ``out`` and ``mid`` optionally take the result and the low-rank intermediate (buffers a
    tiled loop reuses); ``ref_rows`` is the step's length when ``o`` is one tile of it (the
    reference's summation order depends on it, see ``linear_bf16``)."""
    return linear_bf16(linear_bf16(o, wo_a, mid, ref_rows), wo_b, out, ref_rows)


def _default_tile(seqlen: int) -> int:
    """Queries per tile: enough rows for the projections to run at full speed, few enough that
    the tile's buffers stay small (each fresh page is a cost; see ``_TILE_ROWS``)."""
    return max(1, min(_TILE_ROWS, seqlen))


def _window_kv(config, weights, x, positions, table, ref_rows):
    """The KV rows of ``x`` as the window holds them: normed, rotated and fp8-quantised, each row
    on its own (the products' order is chosen by ``ref_rows``, not by how many rows ``x`` has)."""
    kv = rms_norm(linear_bf16(x, weights.wkv, ref_rows=ref_rows), weights.kv_norm, config.norm_eps)
    return act_quant_fp8_inplace(apply_rotary(kv, positions, table, inplace=True))


def _window_rows(config, weights, state, x, step, table):
    """This step's window: the KV rows attention reads, the offset, and the first position
    those rows stand for.

    A prefill attends to all its new rows and the ring keeps the last ``window_size`` of them;
    a decode step writes its row into the ring and attends to the whole ring. The offset is the
    number of window rows, which the compressed entries of an index row are shifted by. A chunk
    of a prefill (``prefill_len``, start_pos > 0) attends to the ring's rows of the ``win - 1``
    positions before it, then its own rows; its index rows are the one-shot prefill's (offset
    ``prefill_len``), which :func:`_local_rows` maps onto these rows.
    """
    start_pos, win, positions = step.start_pos, config.window_size, step.positions
    kv = _window_kv(config, weights, x, positions, table, step.ref_rows)
    if step.decode:
        state.window_kv[start_pos % win] = kv[0]
        return state.window_kv.copy(), win, 0
    first = max(0, start_pos - win + 1)
    # Read the earlier positions before this chunk's rows overwrite their slots.
    earlier = state.window_kv[np.arange(first, start_pos) % win]
    keep = min(step.seqlen, win)
    state.window_kv[positions[-keep:] % win] = kv[-keep:]
    rows = np.concatenate([earlier, kv]) if len(earlier) else kv
    return rows, step.ref_seqlen, first


def _local_rows(idx, first, offset, window_rows, n_window):
    """``idx`` (the one-shot prefill's index rows: window entries are positions, compressed ones
    shifted by ``offset``) as rows of what a chunk attends to: its ``window_rows`` window rows
    (positions ``first ..``), then the compressed rows."""
    out = idx.copy()
    win, comp = out[:, :n_window], out[:, n_window:]
    win[win >= 0] -= first
    comp[comp >= 0] += window_rows - offset
    return out


def _update_caches(config, layer_id, weights, state, shared, x, step, table):
    """Steps 4-5 for a ratio > 0 layer, the *key side*: compress, write the index keys and the
    fp4 latents into the layer's caches, publish them in the shared slots. What the queries then
    read depends on this step's rows only through those caches."""
    c = config
    r = c.ratio(layer_id)
    first_row = step.start_pos // r
    latents = lpos = None
    if c.is_kv_source(layer_id):
        latents = compressor(x, step.start_pos, r, weights.compressor, state.compressor,
                             c.norm_eps, prefill_len=step.prefill_len, batch=step.batch)
        lpos = latent_positions(step.start_pos, step.seqlen, r, prefill=not step.decode)
    # A prefill's key owner publishes when the prefill writes keys, whichever chunk this is.
    writes = latents is not None or (step.chunk and step.prefill_len >= r)
    if c.is_key_owner(layer_id) and writes:
        # The key owner publishes its cache only on a step that wrote keys: otherwise the slot
        # keeps the previous writer's cache (even another ratio's), as in the reference, and
        # this layer scores against that.
        if latents is not None:
            # The reference's keys of the call: the whole prefill's groups for a chunk.
            n_keys = step.prefill_len // r if step.chunk else len(latents)
            keys = index_keys(latents, lpos, weights.indexer, table, c.norm_eps,
                              ref_rows=step.batch.rows(n_keys))
            state.index_cache.write(first_row, keys)
        shared.index_k = state.index_cache
    if latents is not None:
        lat = fp4_quant_e4m3_inplace(apply_rotary(latents, lpos, table, inplace=True))
        state.compress_cache[first_row:first_row + len(lat)] = lat
    if c.is_kv_source(layer_id):
        shared.compress_kv = state.compress_cache


def _select(config, layer_id, weights, shared, x, qr, step, table, offset, capture):
    """Step 6 for an index source: each query's compressed positions, published as the shared
    selection (and, at the candidate source, the candidate blocks); returns the scores with
    ``capture``."""
    c = config
    ref_width = step.ref_end // c.ratio(layer_id)
    if ref_width == 0:
        shared.topk_idxs = np.zeros((step.seqlen, 0), np.int32)
        return None
    cands = shared.candidate_blocks if c.uses_candidates(layer_id) else None
    shared.topk_idxs, published, index_score = indexer(
        x, qr, step.start_pos, IndexerCfg.for_layer(c, layer_id), weights.indexer, table,
        shared.index_k, offset, candidate_blocks=cands, capture=capture,
        prefill_len=step.prefill_len, observer=shared.observer, batch=step.batch)
    if published is not None:
        shared.candidate_blocks = published
        shared.candidate_width = ref_width
        shared.candidate_block_size = c.candidate_block_size
    return index_score


def attention_any(config, layer_id: int, weights, state, shared, x: np.ndarray, start_pos: int,
                  capture: bool = False, tile: int | None = None,
                  prefill_len: int | None = None, queries: bool = True,
                  batch=SINGLE) -> CompAttnRun | None:
    """One layer's forward for any ratio; updates ``state`` and the ``shared`` slots.

    Inputs are assumed valid (``AttentionStack.forward`` checks them). The *key side* runs
    first (window rows, latents, index keys: the layer's state and caches); then the *query
    side*: the index selection, and the queries in tiles (projection, RoPE, sparse attention,
    inverse RoPE, output projection). ``queries=False`` stops after the key side and returns
    None: a distributed run fills the caches so and runs the queries elsewhere
    (:func:`attention_rows`). A decode step's products are all small, and BLAS's threads would
    only contend with the numba kernels between them: BLAS runs single-threaded for it.

    ``prefill_len``: ``x`` is rows ``start_pos ..`` of a prefill of that many tokens, the
    previous chunk (if any) ended at ``start_pos``; every result is the one-shot prefill's rows.

    ``batch`` (a :class:`~ds41numba.batch.BatchRow`): ``x`` is one sequence of a batch run in
    lockstep, ``state`` and ``shared`` that sequence's; every projection sums as the batch's
    product over B times the step's rows does (:mod:`ds41numba.batch` says which products see
    the batch and which are per row or per query).
    """
    step = Step(start_pos, x.shape[0], prefill_len, checked_batch(batch, "attention_any"))
    if x.shape[0] <= MATVEC_MAX_ROWS:
        with single_threaded_blas():
            return _attention_step(config, layer_id, weights, state, shared, x, step, capture,
                                   tile, queries)
    return _attention_step(config, layer_id, weights, state, shared, x, step, capture, tile,
                           queries)


def _attention_step(config, layer_id, weights, state, shared, x, step, capture, tile, queries):
    c = config
    table = layer_rope_table(c, c.ratio(layer_id), step.end)
    window = _window_rows(c, weights, state, x, step, table)
    if c.ratio(layer_id) > 0:
        _update_caches(c, layer_id, weights, state, shared, x, step, table)
    if not queries:
        return None
    return _answer_queries(c, layer_id, weights, shared, x, step, window, table, capture, tile)


def attention_rows(config, layer_id: int, weights, shared, x: np.ndarray, first_row: int,
                   prefill_len: int, tile: int | None = None) -> CompAttnRun:
    """The *query side* of rows ``first_row ..`` of a prefill of ``prefill_len`` tokens, given
    the caches its key side filled (``shared.compress_kv``, ``shared.index_k`` as layer
    ``layer_id``'s prefill finds them, at least up to these rows' end) and, for a layer that
    reads another's, the rows of the shared selection (``shared.topk_idxs``) and candidate blocks
    the same rows of its sources got. ``x`` holds the input rows from ``max(0, first_row -
    window_size + 1)`` on: the earlier ones give the window's KV rows, which are recomputed
    rather than shipped.

    The rows are the one-shot prefill's, bit for bit, whoever runs them and in whatever pieces:
    a distributed run (:mod:`ds41numba.golden.cluster`) spreads a layer's query tiles over
    workers this way. ``shared`` receives the rows' own selection at an index source.
    """
    c = config
    first, n = _check_rows(c, layer_id, shared, x, first_row, prefill_len)
    table = layer_rope_table(c, c.ratio(layer_id), first_row + n)
    positions = np.arange(first, first_row + n, dtype=np.int64)
    kv = _window_kv(c, weights, x, positions, table, prefill_len)
    with_history = (kv, prefill_len, first)
    return _answer_queries(c, layer_id, weights, shared, x[first_row - first:],
                           Step(first_row, n, prefill_len), with_history, table, False, tile)


def _check_rows(c, layer_id, shared, x, first_row, prefill_len) -> tuple[int, int]:
    """:func:`attention_rows`' arguments checked: ``(first position x holds, rows answered)``."""
    def bad(msg):
        raise ValueError(f"attention_rows: {msg}")

    for name, v in (("first_row", first_row), ("prefill_len", prefill_len)):
        if not is_int(v):
            bad(f"{name} must be an int, got {type(v).__name__}")
    if not (isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[1] == c.dim
            and (x.dtype == np.float32 or x.dtype.name == "bfloat16")):
        bad(f"x must be [rows, {c.dim}] float32 (bf16 values) or bfloat16, got "
            f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}")
    first = max(0, first_row - c.window_size + 1)
    n = x.shape[0] - (first_row - first)
    if first_row < 0 or n < 1 or first_row + n > prefill_len:
        bad(f"rows {first_row}..{first_row + n - 1} do not lie in a prefill of {prefill_len} "
            f"tokens (x holds {x.shape[0]} rows from position {first})")
    r = c.ratio(layer_id)
    if r:
        need = (first_row + n) // r
        kv = shared.compress_kv
        if kv is None or kv.shape[0] < need:
            bad(f"layer {layer_id} reads {need} compressed rows, shared.compress_kv holds "
                f"{0 if kv is None else kv.shape[0]}")
        if c.is_index_source(layer_id) and prefill_len // r and shared.index_k is None:
            bad(f"layer {layer_id} scores against the index keys: shared.index_k is None")
        if not c.is_index_source(layer_id) and (shared.topk_idxs is None
                                                or shared.topk_idxs.shape[0] != n):
            bad(f"layer {layer_id} reuses its index source's selection: shared.topk_idxs must "
                f"hold these {n} rows")
    return first, n


def _answer_queries(c, layer_id, weights, shared, x, step, window, table, capture, tile):
    """Steps 6-9, the *query side*: the index selection, then the queries in tiles (projection,
    RoPE, sparse attention over the window and the selected compressed rows, inverse RoPE,
    output projection). ``window`` is :func:`_window_rows`'s ``(rows, offset, first)``."""
    seqlen, ref_rows, positions = step.seqlen, step.ref_rows, step.positions
    H, hd = c.n_heads, c.head_dim
    r = c.ratio(layer_id)
    window, offset, first = window

    qr = rms_norm(linear_bf16(x, weights.wq_a, ref_rows=ref_rows), weights.q_norm, c.norm_eps)
    kv_rows, idx_comp, index_score, q_read = (window,), None, None, None
    if r > 0:
        if c.is_index_source(layer_id):
            # A decode step reads wq_b (a third of V4.1-Flash's step's weights) on one core
            # while the other runs the indexer, which does not need it (linear_bf16_beside).
            with linear_bf16_beside(qr, weights.wq_b, ref_rows) as q_read:
                index_score = _select(c, layer_id, weights, shared, x, qr, step, table, offset,
                                      capture)
        kv_rows = (window, shared.compress_kv[:step.end // r])
        idx_comp = shared.topk_idxs
    idx = index_rows(step.start_pos, seqlen, c.window_size, idx_comp, step.prefill_len)
    attend = idx
    if step.chunk and (first or len(window) != offset):
        attend = _local_rows(idx, first, offset, len(window), min(step.prefill_len, c.window_size))

    out = np.empty((seqlen, c.dim), np.float32)
    q_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    o_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    # q.k's operand for every tile at once, where it pays (sparse_attention.kv_pairs).
    pairs = kv_pairs(kv_rows, seqlen * attend.shape[1])
    step = tile or _default_tile(seqlen)
    # One set of tile buffers for every tile (fresh arrays this size cost page faults each time).
    q_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    o_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    mid_buf = np.empty((min(step, seqlen), weights.wo_a.shape[0]), np.float32)
    for s0 in range(0, seqlen, step):
        s1 = min(seqlen, s0 + step)
        n = s1 - s0
        q = (q_read[s0:s1] if q_read is not None else
             linear_bf16(qr[s0:s1], weights.wq_b, out=q_buf[:n], ref_rows=ref_rows)).reshape(n, H, hd)
        q = apply_rotary(q, positions[s0:s1], table, inplace=True)
        o = sparse_attn(q, kv_rows, attend[s0:s1], weights.attn_sink, hd ** -0.5, out=o_buf[:n],
                        pairs=pairs)
        if capture:
            q_cap[s0:s1] = q
            o_cap[s0:s1] = o
        if shared.observer is not None:   # golden captures (SharedRuntime.observer)
            shared.observer.attention_tile(s0, q, o, kv_rows, attend[s0:s1])
        o = apply_rotary(o, positions[s0:s1], table, inverse=True, inplace=True)
        output_projection(o.reshape(n, H * hd), weights.wo_a, weights.wo_b, out=out[s0:s1],
                          mid=mid_buf[:n], ref_rows=ref_rows)
    if not capture:
        # The index rows are small ([seqlen, win + topk]) and a chunk's cannot be rebuilt from
        # the step alone: always returned.
        return CompAttnRun(out=out, idx=idx, topk=idx.shape[1])
    return CompAttnRun(out=out, q=q_cap, kv_rows=np.concatenate(kv_rows), idx=idx,
                       topk=idx.shape[1], o=o_cap, index_score=index_score)
