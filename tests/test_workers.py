"""Threads (ds41numba.numerics.workers): where a parallel kernel runs."""

import numba
import numpy as np
import pytest
from numba import njit, prange

from ds41numba.numerics import PARALLEL_MIN_MACS, sized_call


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
