"""A streamed golden run spread over a Dask cluster (``--workers N``, ``--scheduler ADDRESS``).

Given a layer's caches (window, compressed KV, index keys), the queries of its prefill are
independent of one another, and a *tile* of them (``--chunk`` rows) is the unit of work. A run
has three parts:

1. *keys*, on the driver: the prefill's chunks through every layer's key side, token-major as
   in a one-process run (``AttentionStack.forward(..., queries=False)``): the inputs are
   written, and every layer's state and caches filled as the one-process run fills them;
2. *queries*, on the workers, one layer at a time in layer order (:mod:`.queries`): the
   layer's weights reach every worker once, and so do the caches it reads, once for all the
   layers that read the same (a kv source's and the layers after it): through files in shared
   memory for a local cluster's workers, by Dask's broadcast for a scheduler's
   (:mod:`.handover`); each tile is a task (:func:`~.tiles.run_tile`) that makes its own input
   rows with the generator and returns that tile's rows of the file (``out``, ``idx``, the
   selection and the scores behind it, samples), which the driver writes into place as they
   come back. A layer that reuses another's selection or candidates is given that layer's
   result for the same tile, which stays on the workers. With ``--inputs`` the driver sends
   each tile its input rows (read from the file it has), else a tile makes them with the
   generator;
3. the decode steps, on the driver (one token each: nothing to spread).

A ``--rows`` run answers only some prefill rows: its tiles are the runs of those rows (cut into
``--chunk`` pieces), and without a cluster the same drive runs them in this process
(:class:`InProcess`), so the key side, the tiles and the checkpoints are one machinery.

The command line starts a local cluster in the background (:class:`Cluster`, ``background``):
its workers start and load their kernels while the driver makes the weights and runs the key
side, which the one-process run does as well; a cluster's own cost is then what the workers do
twice (their start, and each worker's kernels loaded) and the handover.

The file is the one-process run's, byte for byte: every row is computed as the one-shot prefill
computes it, on whichever worker and with whatever tiles. A killed worker costs only its
tasks, which Dask reruns from what the others hold (the shared files or the broadcast copies,
the tasks' inputs).
Checkpoints (``--checkpoint-every``) come between the key side's chunks and then as tiles
complete; a scheduler that goes away ends the run with one line and a checkpoint that
``--resume`` continues from, with ``--workers`` or on another cluster. Dask is an optional
extra (``pip install 'ds41numba[dask]'``): nothing else in the package imports it.
"""

from __future__ import annotations

import logging
import multiprocessing
import operator
import os
import sys
import threading
import time
import types
from concurrent.futures import CancelledError
from dataclasses import dataclass, field

import numba

from ..numerics import is_int
from .captures import cache_captures
from .errors import GoldenError, RunInterrupted
from .drive import drive_piece, golden_steps, prefill_chunks, query_tiles
from .handover import Broadcast, SharedFiles
from .queries import Queries
from .tiles import warm_worker
from .work import work_units

__all__ = ["Cluster", "InProcess", "RunStats", "drive_tiles", "SCHEDULE"]

#: The run identity's ``schedule`` of a run made this way: its checkpoints count other pieces
#: than a one-process run's, so the two cannot resume each other.
SCHEDULE = "tiles"


@dataclass
class RunStats:
    """Where a cluster run's time went (:attr:`Cluster.stats` after a run), the inputs of the
    cost model in the README ("Running on a cluster"): the driver's key side, the wait for a
    cluster started in the background, each layer's handover (bytes, seconds), each tile's
    compute on its worker, the driver's writing of the tiles' rows, the decode steps, and the
    wall time of the queries part."""

    keys_seconds: float = 0.0
    wait_seconds: float = 0.0                          # for the cluster's background start
    input_bytes: int = 0                               # the inputs the key side wrote
    started: float = 0.0                               # perf_counter() at the drive's start
    broadcasts: list = field(default_factory=list)     # (layer, weight bytes, cache bytes, s)
    tiles: list = field(default_factory=list)          # (layer, first_row, rows, seconds)
    write_bytes: int = 0
    write_seconds: float = 0.0
    queries_seconds: float = 0.0
    decode_seconds: float = 0.0


#: The dask setting a local cluster's workers start without (see :meth:`Cluster._start`).
_TRIM = "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_"
#: How a local cluster's workers are started: forked from one process (see :func:`_forkserver`).
_METHOD = "distributed.worker.multiprocessing-method"
#: A local cluster's housekeeping made rare: at Dask's defaults each worker's event loop wakes
#: every 10 to 100 ms (the loop's tick, the memory monitor, the statistical profiler, the
#: system monitor) and took 0.7 s of a worker's CPU, and the driver's loop 0.9 s, in a
#: 21-second window of tiles on 2 cores; with these settings 0.1 s and 0.3 s.
_QUIET = {"distributed.admin.tick.interval": "1s",
          "distributed.worker.memory.monitor-interval": "1s",
          "distributed.worker.profile.enabled": False,
          "distributed.admin.system-monitor.interval": "5s"}


class Cluster:
    """A connection to the workers a run uses: a new local cluster of ``workers`` processes
    (one thread each, the machine's cores shared among them) or the running scheduler at
    ``scheduler``. Use it as a context manager (the local cluster stops with it).

    ``background=True`` (the command line's) returns at once: a local cluster starts, and the
    workers load the kernels a tile runs (:func:`~.tiles.warm_worker`), in a thread while the
    driver makes the weights and runs the key side; the drive waits for them (:meth:`ready`)
    before the first tile, and a failure to start is raised there. A scheduler is connected
    to (and its workers checked) at once either way, so that a wrong address is said before
    the run, not after its key side."""

    schedule = SCHEDULE
    #: Seconds to keep trying a scheduler's address (Dask retries a refused connection).
    connect_timeout = 10.0

    def __init__(self, scheduler: str | None = None, workers: int | None = None,
                 timeout: float | None = None, workers_timeout: float = 120.0,
                 background: bool = False):
        timeout = self.connect_timeout if timeout is None else timeout
        if (scheduler is None) == (workers is None):
            raise GoldenError("give either --workers N or --scheduler ADDRESS")
        try:
            import distributed
        except ImportError:
            raise GoldenError("--workers and --scheduler run on Dask's distributed scheduler, "
                              "which is not installed: pip install 'ds41numba[dask]'") from None
        self._distributed = distributed
        self._local = self.client = self._starting = self._failed = None
        self.address = scheduler
        self.stats = RunStats()
        self.threads = None                             # each worker's own (NUMBA_NUM_THREADS)
        if workers is not None:
            if not is_int(workers, 1):
                raise GoldenError(f"--workers must be a positive integer, got {workers!r}")
            cores = len(os.sched_getaffinity(0))
            self.threads = max(1, cores // workers)     # numba and BLAS threads of each tile
        later = background and workers is not None
        if not later:
            self._start(workers, timeout, workers_timeout)
        if background:
            self._starting = threading.Thread(target=self._in_background, daemon=True,
                                              args=(later, workers, timeout, workers_timeout),
                                              name="ds41numba-cluster-start")
            self._starting.start()

    def _start(self, workers, timeout: float, workers_timeout: float):
        """Start the local cluster (``workers``) or connect to the scheduler, then wait for a
        worker and check them all."""
        import dask
        distributed = self._distributed
        if workers is not None:
            # Dask starts its workers with MALLOC_TRIM_THRESHOLD_ set, which fixes glibc's
            # threshold for mapping a block: a tile's every large temporary is then mapped and
            # faulted in anew (5 times the page faults of a worker without it).
            with dask.config.set({_TRIM: None, **_forkserver(), **_QUIET}):
                self._local = distributed.LocalCluster(
                    n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                    dashboard_address=":0", silence_logs=logging.ERROR)   # any free port
            self.address = self._local.scheduler_address
            self.client = distributed.Client(self._local)
        else:
            try:
                self.client = distributed.Client(self.address, timeout=timeout)
            except (OSError, TimeoutError) as e:
                raise GoldenError(f"--scheduler: cannot reach a Dask scheduler at "
                                  f"{self.address!r} ({e})") from None
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

    def _in_background(self, start: bool, *args):
        """The thread of a background start: the local cluster started (``start``), then every
        worker warmed up. A failure to start is kept for :meth:`ready`; a failed warm-up is
        only time lost (the tiles load what they call)."""
        try:
            if start:
                self._start(*args)
        except BaseException as e:
            self._failed = e
            return
        try:
            self.client.run(warm_worker)
        except Exception:
            pass

    def ready(self) -> None:
        """Wait for a background start and warm-up to end; raise what failed to start."""
        if self._starting is not None:
            self._starting.join()
            self._starting = None
        if self._failed is not None:
            raise self._failed

    def slots(self) -> int:
        """How many tiles the workers run at once now (one a worker, :meth:`_check_workers`);
        1 when the scheduler cannot say: a scheduler gone is for the tiles' results to tell."""
        try:
            return max(1, sum(self.client.nthreads().values()))
        except Exception:
            return 1

    def handover(self):
        """How a layer's work and caches reach the workers (:mod:`.handover`): through shared
        files when the workers are this machine's own processes, else Dask's broadcast."""
        return Broadcast(self.client) if self._local is None else SharedFiles()

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
        if self._starting is not None and self._starting is not threading.current_thread():
            self._starting.join()
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self._local is not None:
                self._local.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Lazy:
    """A task of :class:`InProcess`: run when its result is first asked for, then kept. A part
    of a tile's result is handed over once and dropped from the tile: its file rows to the
    first asking for the tile (the driver, which writes them), its selection to a ``getitem``
    (a later layer's tile), as Dask frees what nothing holds any more."""

    def __init__(self, fn, args, key):
        self.fn, self.args, self.key, self.status = fn, args, key, "pending"

    def result(self):
        if self.status != "pending":
            return self.value
        args = [a.result() if isinstance(a, _Lazy) else a for a in self.args]
        taken = self.fn is operator.getitem and isinstance(self.args[0], _Lazy)
        if taken:
            tile, k = self.args[0], self.args[1]
            self.value, tile.value = args[0][k], _without(tile.value, k)
        else:
            self.value = self.fn(*args)
        self.fn = self.args = None
        self.status = "finished"
        if taken:
            return self.value
        value, self.value = self.value, _without(self.value, 0)
        return value


def _without(parts: tuple, k: int) -> tuple:
    """``parts`` with part ``k`` handed over (None in its place)."""
    return tuple(None if j == k else v for j, v in enumerate(parts))


class _LocalClient:
    """What :class:`~.queries.Queries` asks of a Dask client, done in this process: scatter keeps the
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

    def ready(self) -> None:
        """Nothing to wait for."""

    def slots(self) -> int:
        """One tile at a time."""
        return 1

    def handover(self):
        return Broadcast(self.client)

    def drive(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer) -> None:
        drive_tiles(self, plan, stack, ckpt, out, x_of, write, progress, chunk, observer)


def _forkserver() -> dict:
    """The dask setting that forks a local cluster's workers from one process which imported
    Dask and what a tile runs (:mod:`.worker_start`; each worker then loads its kernels), on
    Linux (elsewhere none: each worker starts its own interpreter, as macOS's system libraries
    are not safe to use in a forked child). The server starts with the first worker and serves
    this process's later clusters too; a worker Dask starts again (one that died) starts its
    own interpreter."""
    if sys.platform != "linux" or "forkserver" not in multiprocessing.get_all_start_methods():
        return {}
    import dask
    from distributed.utils import get_mp_context
    setting = {_METHOD: "forkserver"}
    with dask.config.set(setting):
        # Dask names the modules the server imports on its first call (its own and every
        # package's it knows); ours replace them. A server already running keeps its own.
        get_mp_context().set_forkserver_preload(["distributed", f"{__package__}.worker_start"])
    return setting


def _probe() -> dict:
    """What a worker has (the connection check runs it on every worker)."""
    from .. import __version__
    return {"ds41numba": __version__, "cores": len(os.sched_getaffinity(0)),
            "numba_threads": numba.config.NUMBA_NUM_THREADS}


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
        stats.wait_seconds = _wait_for(cluster, save, ckpt)
        queries = Queries(cluster, plan, stack, seen, done_tiles, out, progress, tiles, save)
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


def _wait_for(cluster, save, ckpt) -> float:
    """Wait for a cluster started in the background (:meth:`Cluster.ready`); one that failed
    to start ends the run with the key side's checkpoint kept for ``--resume``. Returns the
    seconds waited."""
    t0 = time.perf_counter()
    try:
        cluster.ready()
    except Exception as e:
        save(force=True)
        why = str(e) if isinstance(e, GoldenError) else (f"the Dask cluster did not start "
                                                         f"({type(e).__name__}: {e})")
        raise GoldenError(f"{why}; kept {ckpt.partial!r} and its checkpoint ({ckpt.where} done): "
                          f"rerun with --resume (and --workers N or --scheduler ADDRESS) to "
                          f"continue") from None
    return time.perf_counter() - t0
