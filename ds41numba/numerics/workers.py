"""Threads: numba's parallel kernels, a pool of Python workers for BLAS-heavy pieces, BLAS's own.

Not numerics, but every kernel of the package decides the same question, "is this large enough
to run in parallel?", so the answer is written once here (:func:`worth_parallel`), with the
measurements behind its thresholds. No result of the package depends on the answer: every
output is computed whole by one work item, in a fixed order, whichever thread runs it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import llvmlite.ir as ir
import numba
import numpy as np
from numba.extending import intrinsic
from threadpoolctl import ThreadpoolController

from ..jit import njit

__all__ = ["PARALLEL_MIN_MACS", "POOL_MIN_MACS", "worth_parallel", "serial_twin", "sized_call",
           "single_threaded_blas", "in_workers", "split_range", "claim_next", "can_work_beside",
           "work_beside", "in_beside_block", "share_with_helper"]

#: Work, in multiply-adds, from which a numba parallel kernel repays waking its workers (tens of
#: microseconds, up to ~0.4 ms on a busy machine, measured here). An element of an element-wise
#: pass (a rounding, a quantiser step) counts as 8 multiply-adds, a rotated pair as 16: the
#: callers pass that cost.
PARALLEL_MIN_MACS = 1 << 18
#: The same for handing work to the Python worker pool (:func:`in_workers`): a few hundred
#: microseconds a hand-off, about a millisecond of BLAS.
POOL_MIN_MACS = 1 << 26


def worth_parallel(items: int, cost: int = 1, pool: bool = False) -> bool:
    """Whether ``items`` pieces of work of ``cost`` multiply-adds each are worth splitting over
    threads: numba's workers (``PARALLEL_MIN_MACS``) or, with ``pool``, the Python worker pool
    (``POOL_MIN_MACS``)."""
    return items * cost >= (POOL_MIN_MACS if pool else PARALLEL_MIN_MACS)


#: Each parallel kernel's serial twin (:func:`serial_twin`), by the kernel.
_TWINS: dict = {}


def serial_twin(kernel):
    """``kernel``'s body compiled without ``parallel=True`` (its ``prange`` loops run as
    ``range``), named ``<kernel>_serial``: what :func:`sized_call` runs for a small call. Assign
    it to that name in the kernel's module (the kernel lists name kernels by module attribute).

    numba optimises a parallel kernel's body twice (once as the parfor's function, again inside
    the kernel that links it), so the kernel compiles in about 1.6 times its twin's time
    (sparse attention 11-12 s against 7.5 s on one Zen 4 core): a run whose calls are all small,
    the default golden's, compiles only twins. The same body in the same order: the same bits.
    """
    if not hasattr(kernel, "py_func"):      # NUMBA_DISABLE_JIT: plain Python, already serial
        return kernel
    f = kernel.py_func
    body = types.FunctionType(f.__code__, f.__globals__, f"{f.__name__}_serial", f.__defaults__,
                              f.__closure__)
    body.__qualname__ = f"{f.__qualname__}_serial"    # numba's cache files are named by it
    body.__doc__ = f"{f.__qualname__} without parallel=True (workers.serial_twin)."
    twin = njit(nogil=kernel.targetoptions.get("nogil", False))(body)
    _TWINS[kernel] = twin
    return twin


def sized_call(kernel, items: int, cost: int, *args):
    """``kernel(*args)``, a numba parallel kernel whose loop splits into ``items`` pieces of
    ``cost`` multiply-adds each, on numba's threads where that is :func:`worth_parallel` (and
    more than one piece), else in the calling thread alone: the kernel's serial twin where it
    has one (:func:`serial_twin`), else the kernel itself on one thread.

    A parallel call with little to split (a decode step's kernels of one row: one key folded,
    one score row masked or selected) still wakes every worker and waits for the last of them:
    tens of microseconds on a quiet machine, milliseconds when another process holds a core.
    With numba's thread count set to 1 for the call none is woken, and the kernel's loop runs
    as a plain loop; the results are the same either way.
    """
    if items > 1 and worth_parallel(items, cost):
        return kernel(*args)
    twin = _TWINS.get(kernel)
    if twin is not None:
        return twin(*args)
    threads = numba.get_num_threads()
    if threads == 1:
        return kernel(*args)
    numba.set_num_threads(1)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def _blas_controller():
    return ThreadpoolController()


def single_threaded_blas(threads: int = 1):
    """A context in which numpy's BLAS runs on ``threads`` threads (default one).

    For work made of many small products (a decode step; one query's attention), BLAS's own
    threads cost more than they give: OpenBLAS's threaded matrix-vector product is several
    times slower here than its single-threaded one. The results are the same either way.
    """
    return _blas_controller().limit(limits=threads, user_api="blas")


@functools.lru_cache(maxsize=None)
def _executor(pid: int, workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` Python threads named ``name``, one per process (``pid``): a child
    forked from a process that had one holds none of its threads, and work queued for them
    would never run."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)


def _pool(workers: int) -> ThreadPoolExecutor:
    """:func:`in_workers`' pool."""
    return _executor(os.getpid(), workers, "ds41numba")


def in_workers(fn, jobs) -> None:
    """``fn(*job)`` for every job, spread over ``numba.get_num_threads()`` Python threads, each
    with single-threaded BLAS (numpy releases the GIL in BLAS and ufuncs).

    For independent pieces of work (queries, heads, position ranges) whose results do not
    depend on which thread runs them; one job runs in the calling thread.
    """
    jobs = list(jobs)
    with single_threaded_blas():
        if len(jobs) == 1:
            fn(*jobs[0])
            return
        pool = _pool(numba.config.NUMBA_NUM_THREADS)
        for future in [pool.submit(fn, *job) for job in jobs]:
            future.result()


def split_range(n: int, parts: int) -> list[tuple[int, int]]:
    """``0 .. n`` cut into at most ``parts`` near-equal non-empty ranges."""
    cuts = np.linspace(0, n, max(1, min(parts, n)) + 1).astype(int)
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


@intrinsic
def claim_next(typingctx, counter):
    """``counter[0]`` (an int64 array), incremented in the same step (an atomic fetch-and-add):
    threads claiming work items this way each get an item no other thread gets."""
    if not (isinstance(counter, numba.types.Array) and counter.dtype == numba.types.int64):
        return None
    sig = numba.types.int64(counter)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "seq_cst")

    return sig, codegen


def _helper() -> ThreadPoolExecutor:
    """:func:`work_beside`'s helper thread."""
    return _executor(os.getpid(), 1, "ds41numba-beside")


def can_work_beside() -> bool:
    """Whether :func:`work_beside` can run its kernel on a second core: numba runs at least two
    threads here, and compiles (``NUMBA_DISABLE_JIT`` makes kernels Python, which hold the GIL)."""
    return numba.get_num_threads() > 1 and not numba.config.DISABLE_JIT


# How many work_beside blocks this thread is in.
_beside = threading.local()


@contextlib.contextmanager
def work_beside(kernel, *args):
    """``kernel(*args)`` on a helper thread while the ``with`` block runs on this one, then on
    this thread too; the context ends when both calls have.

    For work bound by reading memory beside work bound by arithmetic: a decode step's product
    streams its weight at 22-25 GB/s on one core of the Zen 4 where both cores reach 27-40 (the
    host's memory moves between those), so while this thread computes on one core the other
    reads most of what both would. ``kernel`` is a ``nogil`` njit function whose calls share
    its work items, each claimed once (:func:`claim_next` on a counter among ``args``): the call
    after the block takes the items the helper has not, so this thread's core joins the reading
    as soon as its own work is done. In the block this thread's numba kernels run on one thread
    (numba's count is per thread), so two cores hold two threads. Which thread runs an item
    changes none of its results.

    The helper needs the GIL to enter its kernel: the block's kernels should release it
    (``nogil``, as the decode step's products and index scores do), else the helper starts
    when the block ends and this thread does the work alone (the same results, later). Nothing
    waits for the helper to start: waking an idle core took 0.13 ms here.
    """
    done = _helper().submit(kernel, *args)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    _beside.depth = getattr(_beside, "depth", 0) + 1
    try:
        yield
    finally:
        _beside.depth -= 1
        numba.set_num_threads(threads)
        kernel(*args)
        done.result()


def in_beside_block() -> bool:
    """Whether this thread is in a :func:`work_beside` block (the helper thread busy with its
    kernel, this thread's numba kernels on one thread)."""
    return getattr(_beside, "depth", 0) > 0


def share_with_helper(kernel, *args) -> None:
    """``kernel(*args)`` here and, once it is free, on the helper thread: in a
    :func:`work_beside` block, for arithmetic that can outlast the helper's reading (a decode
    step's index scores at long context). ``kernel`` is a ``nogil`` njit function whose calls
    share their work items (:func:`claim_next` on a counter among ``args``); the helper's call
    waits behind the block's kernel and starts when that has no items left. When this thread's
    call finds none left first, the helper's is withdrawn if it has not begun (the helper still
    reading), else awaited (at most its last item). Which thread runs an item changes none of
    its results."""
    later = _helper().submit(kernel, *args)
    kernel(*args)
    if not later.cancel():
        later.result()
