"""A streamed golden run spread over a Dask cluster (``--workers N``, ``--scheduler ADDRESS``).

Given a layer's caches (window, compressed KV, index keys), the queries of its prefill are
independent of one another, and a *tile* of them (``--chunk`` rows) is the unit of work. A run
has three parts:

1. *keys*, on the driver: the prefill's chunks through every layer's key side, token-major as
   in a one-process run (``AttentionStack.forward(..., queries=False)``): the inputs are
   written, and every layer's state and caches filled as the one-process run fills them;
2. *queries*, on the workers, one layer at a time in layer order: the layer's weights go to
   every worker once (``Client.scatter(..., broadcast=True)``), and so do the caches it reads,
   once for all the layers that read the same (a kv source's and the layers after it); each
   tile is a task (:func:`~ds41numba.attention.attention_rows`) that makes its own input rows
   with the generator and returns that tile's rows of the file (``out``, ``idx``, the selection
   and the scores behind it, samples), which the driver writes into place as they come back. A
   layer that reuses another's selection or candidates is given that layer's result for the
   same tile, which stays on the workers. With ``--inputs`` the driver sends each tile its
   input rows (read from the file it has), else a tile makes them with the generator;
3. the decode steps, on the driver (one token each: nothing to spread).

A ``--rows`` run answers only some prefill rows: its tiles are the runs of those rows (cut into
``--chunk`` pieces), and without a cluster the same drive runs them in this process
(:class:`InProcess`), so the key side, the tiles and the checkpoints are one machinery.

The file is the one-process run's, byte for byte: every row is computed as the one-shot prefill
computes it, on whichever worker and with whatever tiles. A killed worker costs only its
tasks, which Dask reruns from what the others hold (the broadcast copies, the tasks' inputs).
Checkpoints (``--checkpoint-every``) come between the key side's chunks and then as tiles
complete; a scheduler that goes away ends the run with one line and a checkpoint that
``--resume`` continues from, with ``--workers`` or on another cluster. Dask is an optional
extra (``pip install 'ds41numba[dask]'``): nothing else in the package imports it.
"""

from __future__ import annotations

import logging
import operator
import os
import time
import types
from concurrent.futures import CancelledError
from contextlib import contextmanager
from dataclasses import dataclass, field

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ..attention import attention_rows
from ..indexer import IndexKeyCache
from ..numerics import is_int
from ..stack import AttnWeights, SharedRuntime
from .captures import StepObserver, cache_captures, layer_captures, storage_kind, to_storage
from .errors import GoldenError, RunInterrupted
from .generator import make_input
from .drive import drive_piece, golden_steps, prefill_chunks, query_tiles
from .work import work_units

__all__ = ["Cluster", "InProcess", "LayerWork", "CacheRows", "RunStats", "run_tile", "drive_tiles",
           "SCHEDULE"]

#: The run identity's ``schedule`` of a run made this way: its checkpoints count other pieces
#: than a one-process run's, so the two cannot resume each other.
SCHEDULE = "tiles"


@dataclass
class RunStats:
    """Where a cluster run's time went (:attr:`Cluster.stats` after a run), the inputs of the
    cost model in the README ("Running on a cluster"): the driver's key side, each layer's
    broadcast (bytes, seconds), each tile's compute on its worker, the driver's writing of the
    tiles' rows, the decode steps, and the wall time of the queries part."""

    keys_seconds: float = 0.0
    input_bytes: int = 0                               # the inputs the key side wrote
    started: float = 0.0                               # perf_counter() at the drive's start
    broadcasts: list = field(default_factory=list)     # (layer, weight bytes, cache bytes, s)
    tiles: list = field(default_factory=list)          # (layer, first_row, rows, seconds)
    write_bytes: int = 0
    write_seconds: float = 0.0
    queries_seconds: float = 0.0
    decode_seconds: float = 0.0


class Cluster:
    """A connection to the workers a run uses: a new local cluster of ``workers`` processes
    (one thread each, the machine's cores shared among them) or the running scheduler at
    ``scheduler``. Use it as a context manager (the local cluster stops with it)."""

    schedule = SCHEDULE

    def __init__(self, scheduler: str | None = None, workers: int | None = None,
                 timeout: float = 10.0, workers_timeout: float = 120.0):
        if (scheduler is None) == (workers is None):
            raise GoldenError("give either --workers N or --scheduler ADDRESS")
        try:
            import distributed
        except ImportError:
            raise GoldenError("--workers and --scheduler run on Dask's distributed scheduler, "
                              "which is not installed: pip install 'ds41numba[dask]'") from None
        self._distributed = distributed
        self._local = None
        self.stats = RunStats()
        if workers is not None:
            if not is_int(workers, 1):
                raise GoldenError(f"--workers must be a positive integer, got {workers!r}")
            cores = len(os.sched_getaffinity(0))
            self.threads = max(1, cores // workers)     # numba and BLAS threads of each tile
            self._local = distributed.LocalCluster(
                n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                dashboard_address=":0", silence_logs=logging.ERROR)   # any free port
            self.address = self._local.scheduler_address
            self.client = distributed.Client(self._local)
        else:
            self.threads = None                         # each worker's own (NUMBA_NUM_THREADS)
            self.address = scheduler
            try:
                self.client = distributed.Client(scheduler, timeout=timeout)
            except (OSError, TimeoutError) as e:
                raise GoldenError(f"--scheduler: cannot reach a Dask scheduler at {scheduler!r} "
                                  f"({e})") from None
        try:
            try:
                self.client.wait_for_workers(1, timeout=workers_timeout)
            except TimeoutError:
                raise GoldenError(f"no Dask worker joined the scheduler at {self.address!r} "
                                  f"within {workers_timeout:g} s") from None
            self._check_workers()
        except BaseException:
            self.close()
            raise

    def _check_workers(self):
        try:
            probes = self.client.run(_probe)
        except Exception as e:          # a worker that cannot unpickle ds41numba's functions
            raise GoldenError(f"the Dask workers at {self.address!r} cannot run ds41numba's "
                              f"tasks ({type(e).__name__}: {e}): install ds41numba on every "
                              f"worker") from None
        from .. import __version__
        for w, probe in probes.items():
            if probe["ds41numba"] != __version__:
                raise GoldenError(f"Dask worker {w} has ds41numba {probe['ds41numba']}, this "
                                  f"driver {__version__}: install the same version everywhere")
        nthreads = self.client.nthreads()
        for w, n in nthreads.items():
            if n != 1:
                raise GoldenError(f"Dask worker {w} runs {n} threads; ds41numba's tiles run on "
                                  f"numba's own threads, one tile at a time: start workers with "
                                  f"'dask worker {self.address} --nthreads 1' (a tile then uses "
                                  f"NUMBA_NUM_THREADS cores, by default all of its machine's)")
        self.workers = probes

    def drive(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer) -> None:
        """A streamed run's pieces on this cluster (:func:`drive_tiles`)."""
        drive_tiles(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer)

    @property
    def lost(self) -> tuple:
        """The exceptions that mean the scheduler went away (the run ends, with a checkpoint)."""
        d = self._distributed
        return (d.comm.CommClosedError, CancelledError, OSError, TimeoutError)

    def close(self):
        try:
            self.client.close()
        finally:
            if self._local is not None:
                self._local.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Lazy:
    """A task of :class:`InProcess`: run when its result is first asked for, then kept (a part
    of a tile's result is handed over once and dropped from the tile)."""

    def __init__(self, fn, args, key):
        self.fn, self.args, self.key, self.status = fn, args, key, "pending"

    def result(self):
        if self.status == "pending":
            args = [a.result() if isinstance(a, _Lazy) else a for a in self.args]
            if self.fn is operator.getitem and isinstance(self.args[0], _Lazy):
                tile, k = self.args[0], self.args[1]
                self.value, tile.value = args[0][k], tuple(None if j == k else v
                                                           for j, v in enumerate(tile.value))
            else:
                self.value = self.fn(*args)
            self.fn = self.args = None
            self.status = "finished"
        return self.value


class _LocalClient:
    """What :class:`_Queries` asks of a Dask client, done in this process: scatter keeps the
    object, submit defers the call to the first ``result()``."""

    status = "running"

    def scatter(self, obj, broadcast=True, hash=False):
        task = _Lazy(None, (), None)
        task.value, task.status = obj, "finished"
        return task

    def submit(self, fn, *args, key=None):
        return _Lazy(fn, args, key or f"local-{os.urandom(4).hex()}")


class _InOrder(list):
    """``as_completed`` in this process: the tasks in submission order (each runs when asked)."""

    add = list.append


class InProcess:
    """The cluster drive (:func:`drive_tiles`) with its tiles run in this process, in order:
    a ``--rows`` run without ``--workers``. Nothing is copied: the tiles read the stack's own
    weights and caches."""

    schedule = SCHEDULE
    threads = None
    lost = ()
    _distributed = types.SimpleNamespace(as_completed=_InOrder)

    def __init__(self):
        self.client = _LocalClient()
        self.stats = RunStats()

    def drive(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer) -> None:
        drive_tiles(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer)


def _probe() -> dict:
    """What a worker has (the connection check runs it on every worker)."""
    from .. import __version__
    return {"ds41numba": __version__, "cores": len(os.sched_getaffinity(0)),
            "numba_threads": numba.config.NUMBA_NUM_THREADS}


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
    or None for the generator's.
    Returns ``(file_rows, selection)``: ``(first_row, {WHAT: rows in storage dtype}, (sample
    index, {sample.WHAT: rows}))`` for the driver to write, and this tile's selection
    ``(topk_idxs, candidate_blocks, candidate_width, candidate_block_size)`` for later layers.
    """
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


class _Queries:
    """Part 2 of :func:`drive_tiles`: every layer's query tiles on the cluster, in layer order.

    ``seen[i]`` is ``(compress_kv, index_k)`` as layer i's prefill found the shared slots;
    ``done`` the ``(layer, first_row)`` tiles already in the file (a resumed run's), which are
    not written again. A tile a later layer needs the selection of but whose result is gone (a
    resumed run) is run again for it, not written.
    """

    def __init__(self, cluster: Cluster, plan, stack, seen, done, out, progress, tiles, save):
        self.cluster, self.client, self.plan, self.stack = cluster, cluster.client, plan, stack
        self.seen, self.done, self.out, self.progress = seen, done, out, progress
        self.tiles, self.save = tiles, save
        self.answered = None if plan.rows is None else np.asarray(plan.rows, np.int64)
        self.works = {}          # layer -> the scattered LayerWork (its turn only)
        self.cache_rows = {}     # (id of a cache, rows) -> (the cache, its scattered rows)
        self.keys_of = {}        # key of a tile's rows future -> its first row
        self.selections = {}     # (layer, first_row) -> future of that tile's selection

    def work(self, i: int):
        """Layer i's LayerWork on every worker (scattered on first use in its turn)."""
        if i not in self.works:
            work = LayerWork(self.plan.config, i, self.plan.prefill, self.plan.seed,
                             self.plan.profile, self.plan.capture_rows, self.stack.weights[i],
                             self.cluster.threads)
            t0 = time.perf_counter()
            self.works[i] = self.client.scatter(work, broadcast=True, hash=False)
            self.cluster.stats.broadcasts.append((i, work.weights.nbytes(), 0,
                                                  time.perf_counter() - t0))
        return self.works[i]

    def reads(self, i: int) -> tuple:
        """The caches layer i's tiles read: its compressed KV and its index keys (or None)."""
        c = self.plan.config
        kv, index_k = self.seen[i]
        if not c.ratio(i):
            return None, None
        return kv, (index_k.keys if c.is_index_source(i) and index_k is not None else None)

    def caches(self, i: int):
        """The futures of the caches layer i reads (:meth:`reads`), each scattered once for all
        the layers that read it."""
        P, r = self.plan.prefill, self.plan.config.ratio(i)
        out = []
        for cache in self.reads(i):
            if cache is None:
                out.append(None)
                continue
            key = (id(cache), P // r)
            if key not in self.cache_rows:
                t0 = time.perf_counter()
                rows = cache[:P // r]
                fut = self.client.scatter(CacheRows(rows), broadcast=True, hash=False)
                self.cache_rows[key] = (cache, fut)   # the cache kept: its id stays its own
                self.cluster.stats.broadcasts.append((i, 0, rows.nbytes,
                                                      time.perf_counter() - t0))
            out.append(self.cache_rows[key][1])
        return out

    def sources(self, i: int):
        """The layers whose selection (index source) and candidates layer i's tiles read."""
        c = self.plan.config
        topk = (c.index_source_of(i) if c.ratio(i) and not c.is_index_source(i) else None)
        cands = c.candidate_source_layer if c.uses_candidates(i) else None
        return topk, cands

    def submit(self, i: int, a: int, n: int):
        """Layer i's tile at rows ``a ..``: the future of its file rows."""
        topk, cands = self.sources(i)
        x = None
        if self.plan.inputs is not None:        # the workers may not see the inputs file
            first = max(0, a - self.plan.config.window_size + 1)
            x = self.plan.input_rows(f"step0.layers.{i}.x", first, a + n - first, 0)
        tile = self.client.submit(run_tile, self.work(i), *self.caches(i), a, n,
                                  None if topk is None else self.selection(topk, a, n),
                                  None if cands is None else self.selection(cands, a, n), x,
                                  key=f"ds41numba-tile-{i}-{a}-{os.urandom(4).hex()}")
        self.selections[(i, a)] = self.client.submit(operator.getitem, tile, 1)
        rows = self.client.submit(operator.getitem, tile, 0)
        self.keys_of[rows.key] = a
        return rows

    def selection(self, j: int, a: int, n: int):
        if (j, a) not in self.selections:
            self.submit(j, a, n)          # its rows are in the file already: only its selection
        return self.selections[(j, a)]

    def run(self):
        layers = self.stack.layers
        for pos, i in enumerate(layers):
            rows_of = {a: n for a, n in self.tiles if (i, a) not in self.done}
            if rows_of:
                self._write_layer_samples(i)
            retries = dict.fromkeys(rows_of, 0)
            # as_completed holds each future until it hands it over: ``fut`` is then the only
            # reference, and the rows leave the workers once it goes.
            tiles = self.cluster._distributed.as_completed(
                [self.submit(i, a, n) for a, n in rows_of.items()])
            for fut in tiles:
                a = self.keys_of.pop(fut.key)
                try:
                    first_row, rows, (at, samples), seconds = fut.result()
                except CancelledError as e:
                    self._lost_tile(e, i, a, rows_of[a], retries)
                    tiles.add(self.submit(i, a, rows_of[a]))
                    continue
                finally:
                    del fut
                self.cluster.stats.tiles.append((i, first_row, rows_of[first_row], seconds))
                self._write(i, first_row, rows, at, samples)
                self.done.add((i, first_row))
                n = rows_of[first_row]
                if self.progress is not None:
                    self.progress(work_units(self.plan.config, i, first_row, n, keys=False),
                                  f"step 0 rows {first_row}-{first_row + n - 1} layer {i}")
                self.save()
            # Keep only the selections a later layer reads; each layer's work goes with its turn.
            keep = {s for k in layers[pos + 1:] for s in self.sources(k) if s is not None}
            self.selections = {k: f for k, f in self.selections.items() if k[0] in keep}
            self.works.clear()
            still = {id(x) for k in layers[pos + 1:] for x in self.reads(k) if x is not None}
            self.cache_rows = {k: v for k, v in self.cache_rows.items() if k[0] in still}

    def _lost_tile(self, error, i: int, a: int, n: int, retries: dict) -> None:
        """Layer i's tile at rows ``a ..`` was cancelled. With the scheduler still there, what
        it read was lost with the workers that held it (every copy of the scattered work, or a
        source tile's selection): those are made again for a retry (three at most). Otherwise
        the scheduler went away: ``error`` is raised for the run to stop."""
        if self.client.status != "running":
            raise error
        retries[a] += 1
        if retries[a] > 3:
            raise GoldenError(f"layer {i} rows {a}-{a + n - 1}: the workers lost what the tile "
                              f"reads three times over; giving up") from None
        self.works.clear()
        self.cache_rows.clear()
        self.selections = {k: f for k, f in self.selections.items()
                           if f.status not in ("cancelled", "error", "lost")}

    def _write(self, i, first_row, rows, at, samples):
        t0 = time.perf_counter()
        self.cluster.stats.write_bytes += sum(v.nbytes for v in rows.values())
        self._write_rows(i, first_row, rows, at, samples)
        self.cluster.stats.write_seconds += time.perf_counter() - t0

    def _write_rows(self, i, first_row, rows, at, samples):
        prefix = f"step0.layers.{i}."
        at_row = first_row if self.answered is None else int(np.searchsorted(self.answered,
                                                                             first_row))
        for what, value in rows.items():
            self.out.write_rows(prefix + what, at_row, value)
        if len(at):
            for what, value in samples.items():
                self.out.write_rows(prefix + what, int(at[0]), value)

    def _write_layer_samples(self, i: int):
        """The samples that are the step's, not a tile's: which rows, and the caches scored and
        attended (as the one-process run records them with the step's last chunk)."""
        c, P, out = self.plan.config, self.plan.prefill, self.out
        prefix = f"step0.layers.{i}."
        rows = np.asarray([p for p in self.plan.capture_rows if p < P], np.int32)
        r = c.ratio(i)
        kv, keys = self.reads(i)
        parts = {"sample.rows": rows}
        if kv is not None:
            parts["sample.compress_kv"] = kv[:P // r]
        if keys is not None:
            parts["sample.index_k"] = keys[:P // r]
        for what, value in parts.items():
            name = prefix + what
            if name in out.entries and out.missing_rows(name):
                out.write_rows(name, 0, to_storage(name, value, storage_kind(name)))


def drive_tiles(cluster: Cluster, plan, stack, ckpt, out, x_of, write, progress, chunk: int,
                observer) -> None:
    """A streamed run's pieces on ``cluster`` (see the module docstring): the key side of each
    prefill chunk (``chunk`` rows), the queries (one piece, checkpointed tile by tile), the
    decode steps. ``x_of`` and ``write`` are the stream's input maker and writer (as for
    :func:`~.run.drive`); ``ckpt`` the run's checkpoint, already restored into ``stack``."""
    P, L, c = plan.prefill, len(stack.layers), plan.config
    keys = prefill_chunks(P, chunk)
    tiles = query_tiles(P, chunk, plan.rows)
    steps = [(s, p, 0, 1) for s, p, _ in golden_steps(P, plan.decode) if s]
    extra = ckpt.extra or {}
    seen = extra.get("seen", {})
    done_tiles = set(extra.get("tiles", ()))
    done = ckpt.done

    def save(piece: int | None = None, where: str | None = None, force: bool = False):
        """A checkpoint (if due, or ``force``) after ``piece`` pieces (None: as many as so far)."""
        nonlocal done
        done = done if piece is None else piece
        if done < len(keys) + 1 + len(steps) and (force or ckpt.due()):
            if where is None:
                where = f"{len(done_tiles)} of {len(tiles) * L} query tiles"
            ckpt.save(done, where, stack, observer, out,
                      extra={"seen": seen, "tiles": sorted(done_tiles)})
            out.keep = True

    if progress is not None and ckpt.saved:
        keyed = sum(work_units(c, i, a, n, queries=False) for a, n in keys[:done]
                    for i in stack.layers)
        answered = sum(work_units(c, i, a, n, keys=False) for a, n in tiles
                       for i in stack.layers if (i, a) in done_tiles)
        decoded = sum(work_units(c, i, p, 1, prefill=False) for _, p, _, _ in
                      steps[:max(0, done - len(keys) - 1)] for i in stack.layers)
        progress(keyed + answered + decoded, "resumed")
    if not ckpt.saved:
        save(0, "nothing", force=True)
    stack.shared.observer = observer

    stats = cluster.stats = RunStats(started=time.perf_counter())
    t0 = stats.started
    # 1. The key side, token-major: inputs written, every layer's state and caches filled.
    for k in range(done, len(keys)):
        a, n = keys[k]
        for i in stack.layers:
            if progress is not None:
                progress(0, f"keys of rows {a}-{a + n - 1} layer {i}")
            x = x_of(f"step0.layers.{i}.x", a, n, 0)
            stats.input_bytes += x.nbytes
            stack.forward(i, x, a, prefill_len=P, queries=False)
            if k == len(keys) - 1:
                seen[i] = (stack.shared.compress_kv, stack.shared.index_k)
                if plan.capture == "caches":
                    write(f"step0.layers.{i}.", cache_captures(stack, i, P), 0)
            if progress is not None:
                progress(work_units(c, i, a, n, queries=False), f"keys of rows {a}-{a + n - 1} "
                         f"layer {i}")
        save(k + 1, f"the key side of rows 0-{a + n - 1}")

    stats.keys_seconds = time.perf_counter() - t0
    # 2. The queries, on the workers.
    t0 = time.perf_counter()
    if done == len(keys):
        queries = _Queries(cluster, plan, stack, seen, done_tiles, out, progress, tiles, save)
        try:
            queries.run()
        except cluster.lost as e:
            save(force=True)
            raise RunInterrupted(f"the Dask scheduler at {cluster.address} went away "
                                 f"({type(e).__name__}); kept {ckpt.partial!r} and its "
                                 f"checkpoint ({ckpt.where} done): rerun with --resume (and "
                                 f"--workers N or --scheduler ADDRESS) to continue", 2) from None
        save(len(keys) + 1, "the prefill", force=True)
    stats.queries_seconds = time.perf_counter() - t0

    # 3. The decode steps, on the driver.
    t0 = time.perf_counter()
    for k in range(done - len(keys) - 1, len(steps)):
        drive_piece(stack, steps[k], P, plan.capture, x_of, write, progress, observer, True)
        save(len(keys) + 2 + k, f"step {steps[k][0]}")
    stats.decode_seconds = time.perf_counter() - t0
