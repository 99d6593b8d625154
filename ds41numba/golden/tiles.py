"""One tile of a layer's prefill queries as a worker runs it (:func:`run_tile`), what the tile
reads (:class:`LayerWork`, :class:`CacheRows`, handed over by :mod:`.handover`), and a worker's
warm-up (:func:`warm_worker`).

A tile is independent of the others once the caches it reads are filled: the driver's key side
fills them, and any worker answers any tile, byte for byte as the one-process run does.
"""

from __future__ import annotations

import time
import types
from contextlib import contextmanager
from dataclasses import dataclass

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ..attention import attention_rows
from ..indexer import IndexKeyCache
from ..stack import AttnWeights, SharedRuntime
from .captures import StepObserver, layer_captures, storage_kind, to_storage
from .generator import make_input
from .handover import received

__all__ = ["LayerWork", "CacheRows", "run_tile", "warm_worker"]


@dataclass
class LayerWork:
    """What every worker needs for one layer's query tiles, sent to each once: the run's
    generator settings and the layer's weights. The caches it reads are sent apart
    (:class:`CacheRows`): several layers read the same ones."""

    config: object
    layer: int
    prefill: int
    seed: int
    profile: str
    capture_rows: tuple
    weights: AttnWeights
    threads: int | None = None


class CacheRows:
    """A cache's filled rows as a layer's prefill found them in a shared slot (a kv source's
    compressed KV, a key owner's index keys), sent to each worker once for every layer that
    reads it; the index keys are put in this worker's scorer layout on first use."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows
        self._index_k = None

    def index_cache(self) -> IndexKeyCache:
        if self._index_k is None:
            self._index_k = IndexKeyCache(self.rows)
        return self._index_k

    def __getstate__(self):
        return {"rows": self.rows, "_index_k": None}


@contextmanager
def _threads(n: int | None):
    """numba's and BLAS's threads for one tile (the worker's default when ``n`` is None)."""
    if n is None:
        yield
        return
    before = numba.get_num_threads()
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    try:
        with threadpool_limits(n):
            yield
    finally:
        numba.set_num_threads(before)


def run_tile(work: LayerWork, kv: CacheRows | None, keys: CacheRows | None, first_row: int,
             rows: int, topk_from=None, candidates_from=None, x=None):
    """One tile of a layer's prefill queries (rows ``first_row ..``), as a worker runs it.

    ``kv`` and ``keys``: the compressed KV rows and the index keys the layer reads (None where
    it reads none). ``topk_from`` / ``candidates_from``: the selection of the same rows at the layer's index
    source and candidate source (their tiles' second result), for a layer that reads them.
    ``x``: the tile's input rows (from ``max(0, first_row - window_size + 1)`` on, bfloat16),
    or None for the generator's. ``work``, ``kv`` and ``keys`` may be handles of them
    (:func:`~.handover.received`).
    Returns ``(file_rows, selection)``: ``(first_row, {WHAT: rows in storage dtype}, (sample
    index, {sample.WHAT: rows}))`` for the driver to write, and this tile's selection
    ``(topk_idxs, candidate_blocks, candidate_width, candidate_block_size)`` for later layers.
    """
    work, kv, keys = received(work), received(kv), received(keys)
    c, i, P = work.config, work.layer, work.prefill
    first = max(0, first_row - c.window_size + 1)
    name = f"step0.layers.{i}.x"
    if x is None:
        x = to_storage(name, make_input(name, (first_row + rows - first, c.dim), work.seed,
                                        work.profile, first, 0), "BF16")
    shared = SharedRuntime(compress_kv=None if kv is None else kv.rows,
                           index_k=None if keys is None else keys.index_cache())
    if topk_from is not None:
        shared.topk_idxs = topk_from[0]
    if candidates_from is not None:
        (_, shared.candidate_blocks, shared.candidate_width,
         shared.candidate_block_size) = candidates_from
    observer = StepObserver(c, work.capture_rows)
    observer.begin(i, first_row, rows, P)
    shared.observer = observer
    t0 = time.perf_counter()
    with _threads(work.threads):
        run = attention_rows(c, i, work.weights, shared, x, first_row, P)
    got = layer_captures(types.SimpleNamespace(config=c, shared=shared), i, run, first_row, "io",
                         observer)
    prefix = f"step0.layers.{i}."
    file_rows = {w: to_storage(prefix + w, v, storage_kind(prefix + w))
                 for w, v in got.items() if not w.startswith("sample.")}
    at, samples = observer.forward_samples()
    samples = {w: to_storage(prefix + w, v, storage_kind(prefix + w)) for w, v in samples.items()}
    selection = (shared.topk_idxs, shared.candidate_blocks, shared.candidate_width,
                 shared.candidate_block_size)
    return (first_row, file_rows, (at, samples), time.perf_counter() - t0), selection


def warm_worker() -> int:
    """Load the kernels numba's cache holds for this CPU (and, by this module's imports, the code
    a tile runs) ahead of the first tile: a cluster started in the background runs it on every
    worker while the driver makes the weights and runs the key side, where the first tile would
    otherwise pay it (2-4 s a worker here). Returns how many kernels were loaded."""
    from ..compile_ahead import load_cached
    return load_cached()
