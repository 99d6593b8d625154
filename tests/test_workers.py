"""Threads (ds41numba.numerics.workers): where a parallel kernel runs."""

import numba
import numpy as np
import pytest
from numba import njit, prange

from ds41numba.numerics import PARALLEL_MIN_MACS, serial_twin, sized_call, workers


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
