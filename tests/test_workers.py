"""Threads (ds41numba.numerics.workers): where a parallel kernel runs."""

import multiprocessing
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
from numba import njit, prange
from numba.core.errors import TypingError

from ds41numba.numerics import (PARALLEL_MIN_MACS, claim_next, in_beside_block, serial_twin,
                                share_with_helper, sized_call, work_beside, workers)


@njit(parallel=True)
def _thread_ids(out, fail):
    for i in prange(out.shape[0]):
        out[i] = numba.get_thread_id()
    if fail:
        raise ValueError("asked to fail")


@pytest.mark.parametrize("items, cost", [(1, PARALLEL_MIN_MACS), (64, 1), (2, PARALLEL_MIN_MACS // 4)])
def test_a_small_parallel_call_runs_in_the_calling_thread_alone(items, cost):
    """Work below the threshold (or a single piece, which nothing could split) runs every
    iteration on the calling thread (id 0), and numba's thread count is as it was after."""
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: every call runs in the calling thread")
    before = numba.get_num_threads()
    ids = np.full(64, -1, np.int64)
    sized_call(_thread_ids, items, cost, ids, False)
    assert (ids == 0).all() and numba.get_num_threads() == before


def test_a_large_call_keeps_the_threads_and_a_failing_one_restores_them():
    """Work above the threshold runs on numba's threads as it would without sized_call (its
    count untouched); a kernel that raises inside the one-thread call leaves the count as it
    was."""
    before = numba.get_num_threads()
    ids = np.full(64, -1, np.int64)
    sized_call(_thread_ids, 64, PARALLEL_MIN_MACS, ids, False)
    assert (ids >= 0).all() and (ids < before).all() and numba.get_num_threads() == before
    if before > 1:
        assert len(set(ids.tolist())) > 1          # numba's static split: every thread a share
    with pytest.raises(ValueError, match="asked to fail"):
        sized_call(_thread_ids, 1, 1, ids, True)
    assert numba.get_num_threads() == before


@njit(parallel=True)
def _row_sums(x, out):
    for i in prange(x.shape[0]):
        out[i] = x[i].sum()


_row_sums_serial = serial_twin(_row_sums)


def test_a_small_call_runs_the_serial_twin_a_large_one_the_kernel():
    """Below the threshold the twin runs (the parallel kernel is not even compiled), above it
    the kernel; the same body gives the same bits."""
    x = np.random.default_rng(3).standard_normal((64, 33)).astype(np.float32)
    small, large = np.empty(64, np.float32), np.empty(64, np.float32)
    sized_call(_row_sums, 64, 1, x, small)
    assert _row_sums_serial.signatures and not _row_sums.signatures
    sized_call(_row_sums, 64, PARALLEL_MIN_MACS, x, large)
    assert _row_sums.signatures
    assert small.tobytes() == large.tobytes()


def test_every_twin_in_the_package_is_its_kernel_under_the_kernel_lists_name():
    """A twin is the kernel's own code, not parallel, and its module holds it as
    ``<kernel>_serial`` (the kernel lists find a kernel by module attribute)."""
    import importlib
    import ds41numba  # noqa: F401  (imports every module that makes twins)
    from ds41numba.golden import captures, generator  # noqa: F401
    twins = {k: t for k, t in workers._TWINS.items() if k.py_func.__module__.startswith("ds41numba")}
    assert len(twins) >= 15
    for kernel, twin in twins.items():
        f, g = kernel.py_func, twin.py_func
        assert kernel.targetoptions["parallel"] and not twin.targetoptions.get("parallel")
        assert g.__code__ is f.__code__ and g.__qualname__ == f"{f.__qualname__}_serial"
        assert getattr(importlib.import_module(g.__module__), g.__qualname__) is twin


def test_with_the_jit_off_the_package_imports_and_runs_as_python():
    """``NUMBA_DISABLE_JIT=1`` (a debugging mode: every kernel plain Python) leaves a kernel's
    twin the plain function itself, so the package still imports and a small call runs."""
    import os
    import subprocess
    import sys
    code = ("import numpy as np; from ds41numba.numerics import rms_norm; "
            "print(rms_norm(np.full((2, 8), 2, np.float32), np.ones(8, np.float32), 0.0)[1, 7])")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, NUMBA_DISABLE_JIT="1"),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1.0"


# ================================================================================ work beside


@njit(nogil=True)
def _claim_all(counter, n, mine):
    """Claim items of ``counter`` below ``n`` until none is left, with some arithmetic on each
    (so that two threads' claims interleave); ``mine`` gets them in order. Returns how many."""
    got = 0
    item = claim_next(counter)
    while item < n:
        acc = 0.0
        for j in range(300):
            acc += np.sqrt(item + j)
        mine[got] = item if acc >= 0 else -1
        got += 1
        item = claim_next(counter)
    return got


@njit(nogil=True)
def _claim_count(counter, n, seen):
    """Claim items of ``counter`` below ``n`` until none is left, counting each in ``seen``."""
    item = claim_next(counter)
    while item < n:
        seen[item] += 1
        item = claim_next(counter)


@njit
def _claim_one(counter):
    return claim_next(counter)


def test_claims_count_up_from_the_counter_in_one_atomic_step():
    counter = np.array([5], np.int64)
    assert [_claim_one(counter) for _ in range(3)] == [5, 6, 7] and counter[0] == 8
    assert "atomicrmw add" in next(iter(_claim_one.inspect_llvm().values()))
    with pytest.raises(TypingError):
        _claim_one(np.zeros(1, np.int32))


def test_two_threads_claiming_at_once_get_every_item_once():
    """Two threads started together claim 300,000 items of one counter, both some: each item
    exactly once (a claim made of a load and a store would hand some out twice, as measured
    with one, in most runs)."""
    n = 300_000
    _claim_all(np.array([n], np.int64), n, np.empty(1, np.int64))     # compiled before the race
    for _ in range(3):
        counter = np.zeros(1, np.int64)
        mine = [np.full(n, -1, np.int64) for _ in range(2)]
        start = threading.Barrier(2)

        def claim(m):
            start.wait()
            return _claim_all(counter, n, m)

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(claim, mine))
        claimed = np.concatenate([m[:g] for m, g in zip(mine, got)])
        assert sorted(claimed.tolist()) == list(range(n)) and min(got) > 0
        assert counter[0] == n + 2          # each thread's last claim found nothing left


def test_work_beside_shares_a_kernels_items_between_a_helper_and_this_thread():
    """The kernel runs on another thread (started with the block; nothing waits for it) and,
    after the block, here with the count restored (1 in the block); between them every item is
    claimed once."""
    if not workers.can_work_beside():
        pytest.skip("one numba thread: nothing runs beside")
    threads, n = numba.get_num_threads(), 50_000
    counter, seen = np.zeros(1, np.int64), np.zeros(n, np.int64)
    calls = []

    def kernel(counter, n, seen):
        calls.append((threading.get_ident(), numba.get_num_threads()))
        _claim_count(counter, n, seen)

    with work_beside(kernel, counter, n, seen):
        inside = numba.get_num_threads()
    assert inside == 1 and numba.get_num_threads() == threads
    here = threading.get_ident()
    assert len(calls) == 2 and {c[0] for c in calls} - {here} and (here, threads) in calls
    assert (seen == 1).all() and counter[0] == n + 2


def test_work_beside_waits_for_its_helper_when_the_block_raises():
    """An error in the block reaches the caller after both calls have ended, the count
    restored."""
    if not workers.can_work_beside():
        pytest.skip("one numba thread: nothing runs beside")
    threads = numba.get_num_threads()
    counter, n = np.zeros(1, np.int64), 20_000
    seen = np.zeros(n, np.int64)
    with pytest.raises(RuntimeError, match="in the block"):
        with work_beside(_claim_count, counter, n, seen):
            raise RuntimeError("in the block")
    assert (seen == 1).all() and counter[0] == n + 2 and numba.get_num_threads() == threads


def test_a_share_with_a_busy_helper_is_withdrawn_and_a_free_one_joins():
    """In a block whose helper is still busy (its kernel waits here for an event) the shared
    kernel runs here alone: the helper's call, queued behind the busy one, is withdrawn before
    it starts, and nothing waits for the helper. With the helper free, both calls run; every
    item is claimed once either way. ``in_beside_block`` is true only inside the block."""
    if not workers.can_work_beside():
        pytest.skip("one numba thread: nothing runs beside")
    release, here = threading.Event(), threading.get_ident()
    n = 20_000
    for busy in (True, False):
        counter, seen, calls = np.zeros(1, np.int64), np.zeros(n, np.int64), []
        helper_in = threading.Event()

        def shared(counter, n, seen):
            calls.append(threading.get_ident())
            if threading.get_ident() != here:
                helper_in.set()
            elif not busy:      # this thread waits for the free helper to join
                assert helper_in.wait(30)
            _claim_count(counter, n, seen)

        release.clear()
        assert not in_beside_block()
        with work_beside(lambda: release.wait(30) if busy else None):
            assert in_beside_block()
            share_with_helper(shared, counter, n, seen)
            assert calls == [here] if busy else len(set(calls)) == 2
            release.set()
        assert not in_beside_block()
        assert (seen == 1).all()
        assert calls == [here] if busy else len(calls) == 2


def _helper_in_child():
    sys.exit(0 if workers._helper().submit(int, "7").result(timeout=30) == 7 else 1)


def test_a_forked_child_gets_its_own_helper_thread():
    """The helper thread (and the worker pool) belong to a process: a child forked after its
    parent used them starts its own (the parent's threads do not exist in it, and work queued
    for them would wait forever)."""
    assert workers._helper().submit(int, "5").result(timeout=30) == 5
    child = multiprocessing.get_context("fork").Process(target=_helper_in_child)
    child.start()
    child.join(60)
    assert child.exitcode == 0
