"""Compiling ahead (ds41numba/compile_ahead.py): the list of kernels is what the default golden
calls, its types spell and read back exactly, processes claim each family of kernels once, and
a kernel compiled ahead in one process is what another finds in the cache."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba.core import sigutils

from ds41numba import compile_ahead as ahead, kernel_list
from ds41numba.numerics import BACKENDS, backend

VALUES = [
    (np.zeros(3, np.float32), "float32[::1]"),
    (np.zeros((2, 3), np.uint32), "uint32[:, ::1]"),
    (np.zeros((2, 3, 4), np.int64), "int64[:, :, ::1]"),
    ((np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32)), "UniTuple(float32[:, ::1], 2)"),
    ((np.zeros((2, 3), np.uint32), np.zeros((2, 3), np.int32)), "Tuple((uint32[:, ::1], int32[:, ::1],))"),
    (np.int64(3), "int64"), (np.uint64(3), "uint64"), (np.float32(1), "float32"),
    (1.5, "float64"), (True, "bool"),
]


@pytest.mark.parametrize("value,spelling", VALUES, ids=[s for _, s in VALUES])
def test_spelling_reads_back_as_the_type_numba_gives_the_value(value, spelling):
    t = numba.typeof(value)
    assert kernel_list.spelling(t) == spelling
    assert sigutils.normalize_signature(f"({spelling},)")[0][0] == t


@pytest.mark.parametrize("value", [np.zeros((3, 4), np.float32, order="F"),
                                   np.zeros((3, 4), np.float32)[:, ::2], "text"])
def test_a_type_without_a_spelling_is_refused(value):
    with pytest.raises(ValueError, match="kernel_list"):
        kernel_list.spelling(numba.typeof(value))


@pytest.mark.parametrize("argtypes,spelling", [
    ((numba.int64,), "(int64,)"),
    ((numba.float32[::1], numba.boolean), "(float32[::1], bool)")])
def test_a_signature_spells_as_numba_reads_it(argtypes, spelling):
    assert kernel_list.signature_spelling(argtypes) == spelling
    assert tuple(sigutils.normalize_signature(spelling)[0]) == argtypes


def test_processes_claim_each_family_once_in_order(tmp_path):
    """Two processes walking the same families: whichever asks first takes the next one left;
    every family is compiled by exactly one of them, and a late walker finds none left."""
    families = [["m:a"], ["m:b", "m:c"], ["m:d"], ["m:e"]]
    first, second = ahead._claimed(families, tmp_path), ahead._claimed(families, tmp_path)
    taken = [next(first), next(second), next(second), next(first)]
    assert taken == families
    assert list(first) == [] and list(second) == []
    assert list(ahead._claimed(families, tmp_path)) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]


def test_kernels_that_compile_mostly_the_same_helpers_are_one_family():
    """The golden's two runners-up kernels call most of the same helpers (compiled once in one
    process, not in each of two); sparse attention and the top-k of whole rows call none of
    theirs, nor each other's."""
    names = {"_runners_up_serial", "_runners_up_listed_serial", "_sparse_attn_kernel_serial",
             "_whole_row_sets_serial"}
    kernels = [k for k in ahead.read_kernels() if k.name.split(":")[1] in names]
    seconds = {}            # a kernel's seconds over its lines (a line a tier where they differ)
    for k in kernels:
        seconds[k.name.split(":")[1]] = seconds.get(k.name.split(":")[1], 0.0) + k.seconds
    families = sorted((sorted(n.split(":")[1] for n in f), s) for f, s in ahead._families(kernels))
    assert families == [
        (["_runners_up_listed_serial", "_runners_up_serial"],
         seconds["_runners_up_serial"] + seconds["_runners_up_listed_serial"]),
        (["_sparse_attn_kernel_serial"], seconds["_sparse_attn_kernel_serial"]),
        (["_whole_row_sets_serial"], seconds["_whole_row_sets_serial"])]
    top_k = next(k for k in kernels if k.name.endswith(":_whole_row_sets_serial"))
    assert "_adjust_heap" in {d.py_func.__qualname__ for d in ahead._helpers(top_k.dispatcher())}


@pytest.mark.parametrize("path", [ahead.KERNELS, kernel_list.SUITE_KERNELS], ids=["golden", "suite"])
def test_the_list_reads_and_names_kernels_that_exist(path):
    kernels = ahead.read_kernels(path)
    assert len(kernels) >= 10
    for k in kernels:
        assert k.tier == "*" or k.tier in BACKENDS
        assert isinstance(k.dispatcher(), numba.core.registry.CPUDispatcher), k.name
        assert k.argtypes()


@pytest.mark.parametrize("tier", sorted({backend(), BACKENDS[-1]}, key=BACKENDS.index))
def test_the_list_holds_every_kernel_the_default_golden_calls_on_a_tier(tier):
    """Run the default golden (a fresh process) on this CPU's tier and on ``blas`` (where it runs,
    being small: :func:`tier_for_run`) and note the kernels it calls from Python: each must be on
    the list for that tier, or a first run compiles it alone."""
    listed = {(k.name, k.signature) for k in ahead.read_kernels() if k.tier in ("*", tier)}
    called = kernel_list.traced_kernels(tier, numba.get_num_threads())
    assert called and called <= listed, sorted(called - listed)


@pytest.mark.parametrize("claims", [False, True], ids=["named", "claimed"])
def test_a_kernel_compiled_ahead_is_in_the_cache_another_process_reads(tmp_path, claims):
    """A child compiles one listed kernel into an empty cache (named, or claimed as compiling
    ahead's children claim a family): another process finds it there, and the kernels still
    missing are one fewer."""
    kernel = next(k for k in ahead.read_kernels() if k.name.endswith(":_pack_picks"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    check = [sys.executable, "-c", "from ds41numba import compile_ahead as a; "
             f"k = [k for k in a.read_kernels() if k.name == {kernel.name!r}][0]; "
             "print(a._cached(k), len(a._missing((a.backend(),))))"]
    before = subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout.split()
    options = ["--claims", str(tmp_path)] if claims else []
    subprocess.run([sys.executable, "-m", "ds41numba.compile_ahead", *options, kernel.name],
                   env=env, check=True)
    after = subprocess.run(check, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert before[0] == "False" and after[0] == "True"
    assert int(after[1]) == int(before[1]) - 1


STALE = ["* 1.00 ds41numba.indexer.candidates:_pack_picks (float32[::1],)",    # retyped
         "* 1.00 ds41numba.indexer.candidates:_pack_picks (int64)",            # not a tuple
         "* 1.00 ds41numba.indexer.candidates:_gone (int64,)",                 # renamed
         "* 1.00 ds41numba.gone:_pack_picks (int64,)"]                         # moved


@pytest.mark.parametrize("line", STALE)
def test_a_stale_line_is_skipped_not_raised(line, tmp_path, monkeypatch):
    stale = tmp_path / "kernels.txt"
    stale.write_text(line + "\n")
    monkeypatch.setattr(ahead, "KERNELS", stale)
    ahead._missing((backend(),))
    ahead._compile([[line.split()[2]]], (backend(),))


def test_every_tier_takes_the_lines_of_the_tiers_below_this_cpus(tmp_path, monkeypatch):
    """The test suite's compile ahead: the lines of this CPU's tier and of every tier after it
    (the tiers nest), and of the extra lists, a kernel several tiers or lists name alike once."""
    monkeypatch.delenv("DS41NUMBA_COMPILE_AHEAD", raising=False)
    golden, extra = tmp_path / "kernels.txt", tmp_path / "suite.txt"
    golden.write_text("".join(f"{t} 1.00 m:k_{t} (int64,)\n" for t in BACKENDS)
                      + "* 1.00 m:shared (int64,)\n")
    extra.write_text(f"{BACKENDS[-1]} 1.00 m:shared (int64,)\n* 1.00 m:test_only (int64,)\n")
    monkeypatch.setattr(ahead, "KERNELS", golden)
    asked = []
    monkeypatch.setattr(ahead, "_missing", lambda tiers, lists=(): asked.append((tiers, lists)) or [])
    ahead.compile_ahead(quiet=True, every_tier=True, extra=(extra, tmp_path / "absent.txt"))
    ahead.compile_ahead(quiet=True)
    below = tuple(BACKENDS[BACKENDS.index(backend()):])
    assert asked == [(below, (extra,)), ((backend(),), ())]
    read = [k.name for k in ahead._read(below, (extra,))]
    assert sorted(read) == sorted([f"m:k_{t}" for t in below] + ["m:shared", "m:test_only"])


def test_switched_off_it_compiles_nothing(monkeypatch):
    monkeypatch.setenv("DS41NUMBA_COMPILE_AHEAD", "0")
    assert ahead.compile_ahead(quiet=True) == 0


def test_loading_the_cached_kernels_loads_and_compiles_nothing_new(tmp_path, monkeypatch):
    """A cluster worker's warm-up: every listed kernel the cache holds is loaded (the session's
    compile ahead cached them), a line the cache lacks or that is stale is passed over."""
    monkeypatch.delenv("DS41NUMBA_COMPILE_AHEAD", raising=False)
    to_load = ahead._to_load()
    twins = [k for k in to_load if k.name.endswith("_serial")]
    assert twins and {k.name[:-len("_serial")] for k in twins} < {k.name for k in to_load}
    cached = [k for k in to_load if ahead._cached(k)]
    assert ahead.load_cached() == len(cached) > 0
    assert all(k.argtypes() in k.dispatcher().overloads for k in cached)
    mine = tmp_path / "kernels.txt"
    mine.write_text("\n".join(STALE + ["* 1.00 ds41numba.numerics.quant:quant_row (int8[::1], "
                                       "int64, int64)"]) + "\n")    # types never compiled
    monkeypatch.setattr(ahead, "KERNELS", mine)
    before = len(ahead.Kernel("*", 0, "ds41numba.numerics.quant:quant_row", "()").dispatcher()
                 .signatures)
    assert ahead.load_cached() == 0
    assert len(ahead.Kernel("*", 0, "ds41numba.numerics.quant:quant_row", "()").dispatcher()
               .signatures) == before
    monkeypatch.setenv("DS41NUMBA_COMPILE_AHEAD", "0")
    assert ahead.load_cached() == 0


def test_a_workers_warm_up_loads_the_kernels_of_this_cpus_tier():
    """The list keeps each tier's kernels although the small default golden runs on ``blas``:
    a cluster's worker loads this CPU tier's (their parallel kernels, which its tiles call)."""
    tiers = {k.tier for k in ahead._to_load()}
    assert tiers == {"*", backend()}
    assert {k.tier for k in ahead.read_kernels()} == {"*", *BACKENDS}
