"""Compiling ahead: on a cold numba cache, the kernels a run calls are compiled in parallel first.

numba compiles a kernel the first time Python calls it with new argument types, one kernel
after another in one process; a first ``ds41numba golden`` spends nearly all its time there
(about 30 kernels, 50 s on one core). The kernels and argument types a run calls are known
ahead: ``kernels.txt`` beside this module lists those of the built-in default golden on every
tier (:mod:`.numerics.backend`), with what each cost to compile. :func:`compile_ahead` finds
the ones missing from numba's on-disk cache, compiles them in processes (one per core, each
taking the next *family* of kernels left, costliest first) and returns when they are all
cached: the run then loads them in a second. A kernel the list misses, or whose code changed
since it was recorded, is compiled by the run itself as before, so a stale list costs time,
never a result; the test suite checks the list against what the default golden calls.

The test suite compiles ahead too, more than a golden does: the list's kernels of every tier
this CPU has (the tests run each tier) and those of ``tests/kernels.txt``, the kernels only
tests call (:func:`compile_ahead` with ``every_tier`` and ``extra``).

:func:`load_cached` loads the listed kernels the cache holds into a process before it calls them
(a cluster's workers, while the driver runs the key side), with the parallel kernel of each
serial twin listed.

A small run (:func:`tier_for_run`: the built-in ``tiny`` and ``mixed`` goldens and suites) runs
on the ``blas`` tier, the same bits as every other: its products take milliseconds on any tier,
and the integer and bf16 kernels of the CPU's own would cost it more to compile (8 s of the
default golden's 39 on a Zen 4 core) than they could save.

``python -m ds41numba.kernel_list`` rewrites the list (:mod:`.kernel_list`).
``DS41NUMBA_COMPILE_AHEAD=0`` turns compiling ahead off.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path

from numba.core import config as numba_config, sigutils
from numba.core.dispatcher import Dispatcher

from .numerics import BACKENDS, backend, use_backend

__all__ = ["ANY_TIER", "KERNELS", "SMALL_RUN_MACS", "Kernel", "compile_ahead", "load_cached",
           "read_kernels", "tier_for_run"]

KERNELS = Path(__file__).with_name("kernels.txt")
ANY_TIER = "*"
_TWIN = "_serial"        # a parallel kernel's serial twin is named <kernel>_serial
_MODULE = "ds41numba.compile_ahead"     # run as `python -m` (then __name__ is "__main__")
#: Multiply-adds of a run's products (:func:`.golden.work.product_multiply_adds`) below which it
#: runs on the ``blas`` tier (:func:`tier_for_run`): about a tenth of a second on numpy's BLAS.
#: The tiny golden takes 4e6, the mixed one 4e7, one v41-flash layer 1e9 at 8 tokens.
SMALL_RUN_MACS = 1e9


@dataclass(frozen=True)
class Kernel:
    """One kernel a run calls from Python: ``module:qualname``, its argument types in numba's
    signature syntax, the tier it is called on (``*``: every tier) and its compile seconds."""
    tier: str
    seconds: float
    name: str
    signature: str

    def dispatcher(self) -> Dispatcher:
        module, qualname = self.name.split(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj

    def argtypes(self) -> tuple:
        return tuple(sigutils.normalize_signature(self.signature)[0])


def read_kernels(path: Path | None = None) -> list[Kernel]:
    """The list of kernels (``kernels.txt``): ``tier seconds module:qualname (types)`` a line."""
    kernels = []
    for line in (path or KERNELS).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            tier, seconds, name, signature = line.split(maxsplit=3)
            kernels.append(Kernel(tier, float(seconds), name, signature))
    return kernels


def _cached(kernel: Kernel) -> bool:
    """Whether numba's cache holds the kernel for these types on this CPU (its index only: the
    code is loaded when the run calls it)."""
    disp = kernel.dispatcher()
    cache = disp._cache
    key = cache._index_key(kernel.argtypes(), disp.targetctx.codegen())
    return key in cache._cache_file._load_index()


def _read(tiers: tuple[str, ...], lists: tuple[Path, ...] = ()) -> list[Kernel]:
    """The kernels of ``kernels.txt`` and of ``lists`` (more list files) called on any of
    ``tiers``, each kernel and signature once (a kernel several tiers call alike)."""
    seen: dict[tuple[str, str], Kernel] = {}
    for path in (KERNELS, *lists):
        for k in read_kernels(path):
            if k.tier in (ANY_TIER, *tiers):
                seen.setdefault((k.name, k.signature), k)
    return list(seen.values())


def _listed(tiers: tuple[str, ...], cached: bool, lists: tuple[Path, ...] = ()) -> list[Kernel]:
    """The listed kernels of ``tiers`` that numba's cache holds (``cached``) or lacks (a stale
    line, naming a kernel that is gone or types that do not read, is left out: the run compiles
    what it calls)."""
    chosen = []
    for k in _read(tiers, lists):
        try:
            if _cached(k) == cached:
                chosen.append(k)
        except Exception:
            continue
    return chosen


def _missing(tiers: tuple[str, ...], lists: tuple[Path, ...] = ()) -> list[Kernel]:
    return _listed(tiers, cached=False, lists=lists)


def _to_load() -> list[Kernel]:
    """The list's kernels of this CPU's tier and, for each serial twin (``<kernel>_serial``,
    :func:`.numerics.workers.serial_twin`: the default golden's calls are small), its parallel
    kernel, which a cluster's tiles call."""
    kernels = _read((backend(),))
    return kernels + [replace(k, name=k.name.removesuffix(_TWIN)) for k in kernels
                      if k.name.endswith(_TWIN)]


def load_cached() -> int:
    """Load into this process the kernels of :func:`_to_load` that numba's cache holds for this
    CPU, before they are called (a cluster's worker warming up while the driver runs the key
    side). Returns how many were loaded; nothing is compiled."""
    if not _enabled():
        return 0
    loaded = 0
    for k in _to_load():
        try:
            if _cached(k):
                k.dispatcher().compile(k.argtypes())
                loaded += 1
        except Exception:       # loading is only ahead of time: the tile loads what it calls
            continue
    return loaded


def _helpers(disp: Dispatcher, seen: set | None = None) -> set:
    """The ds41numba kernels and helpers ``disp`` calls, directly or not, by the global names
    its code (and its nested functions') reads: what numba compiles along with it."""
    seen = set() if seen is None else seen
    f = disp.py_func
    codes = [f.__code__]
    while codes:
        code = codes.pop()
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        for name in code.co_names:
            g = f.__globals__.get(name)
            if (isinstance(g, Dispatcher) and g.py_func.__module__.startswith("ds41numba")
                    and g not in seen):
                seen.add(g)
                _helpers(g, seen)
    return seen


def _families(kernels: list[Kernel]) -> list[tuple[list[str], float]]:
    """The kernels' names in families, each with its compile seconds: a kernel joins the family
    that holds more than half of the functions it compiles (:func:`_helpers`), which one process
    then compiles once (the indexer's two top-k kernels share 23 of 25), else starts one. The
    largest first, so a family's first kernel is its largest; every signature of a kernel is in
    its family (they share numba's index file). A line that does not load is its own family."""
    cost: dict[str, float] = {}
    for k in kernels:
        cost[k.name] = cost.get(k.name, 0.0) + k.seconds
    funcs: dict[str, set] = {}
    for k in kernels:
        try:
            disp = k.dispatcher()
            funcs[k.name] = _helpers(disp) | {disp}
        except Exception:
            funcs[k.name] = set()
    families: list[tuple[set, list[str]]] = []
    for name in sorted(cost, key=lambda m: -len(funcs[m])):
        mine = funcs[name]
        home = max(families, key=lambda f: len(mine & f[0]), default=None)
        if home is not None and 2 * len(mine & home[0]) > len(mine):
            home[0].update(mine)
            home[1].append(name)
        else:
            families.append((set(mine), [name]))
    return [(names, sum(cost[m] for m in names)) for _, names in families]


def _claimed(families: list[list[str]], claims: Path):
    """The families (each a list of kernel names) this process claims, in order: each of the
    processes compiling ahead walks the same list, costliest first, and takes a family when it
    is the first to create its claim file in ``claims``. A process that finishes early takes
    the next family left, so the processes end close together whatever each family really costs
    (a list's seconds were measured alone, in another hour, each helper counted once)."""
    for i, names in enumerate(families):
        try:
            os.close(os.open(claims / str(i), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        yield names


@contextlib.contextmanager
def tier_for_run(multiply_adds: float):
    """Run the block (a command's compiling ahead and its run) on the ``blas`` tier when the
    run's products are smaller than ``SMALL_RUN_MACS``, else on the tier it would run on anyway.
    Every tier gives the same bits; a small run saves compiling the kernels of a higher one."""
    if multiply_adds < SMALL_RUN_MACS and backend() != BACKENDS[-1]:
        with use_backend(BACKENDS[-1]):
            yield
    else:
        yield


def _compile(families, tiers: tuple[str, ...], lists: tuple[Path, ...] = ()) -> None:
    """Compile (into numba's cache) the listed kernels of each family in ``families`` (lists of
    kernel names, taken one by one: :func:`_claimed`'s as they are claimed), as ``tiers`` call
    them. The lists are read once."""
    listed = _read(tiers, lists)
    for names in families:
        chosen = set(names)
        for k in listed:
            if k.name in chosen:
                try:
                    k.dispatcher().compile(k.argtypes())
                except Exception:   # a stale line (a kernel renamed or retyped): the run compiles
                    continue        # what it calls itself, as without the list


def _enabled() -> bool:
    return (os.environ.get("DS41NUMBA_COMPILE_AHEAD", "1") != "0" and not numba_config.DISABLE_JIT
            and KERNELS.exists())


def _cores() -> int:
    """The cores this process may use, at most numba's thread count (a user's limit)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, numba_config.NUMBA_NUM_THREADS))


def compile_ahead(quiet: bool = False, every_tier: bool = False, extra: tuple[Path, ...] = ()) -> int:
    """Compile the kernels a run calls that numba's cache lacks, in parallel processes (one per
    core this process may use), and say so on stderr unless ``quiet``. Returns how many kernels
    were compiled: 0 on a warm cache, where it costs a few milliseconds.

    A run calls the kernels of this CPU's tier; with ``every_tier``, those of every tier it has
    (the tiers nest: this CPU's and every one after it in :data:`.numerics.BACKENDS`), as the
    test suite does. ``extra``: more list files, in the format of ``kernels.txt``."""
    if not _enabled():
        return 0
    tiers = tuple(BACKENDS[BACKENDS.index(backend()):]) if every_tier else (backend(),)
    lists = tuple(Path(p) for p in extra if Path(p).exists())
    missing = _missing(tiers, lists)
    if not missing:
        return 0
    families = [names for names, _ in sorted(_families(missing), key=lambda f: -f[1])]
    n = min(_cores(), len(families))
    if not quiet:
        print(f"compiling {len(missing)} numba kernels for this CPU in {n} "
              f"process{'es' if n > 1 else ''} (once; later runs load them)...",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    options = ["--tiers", ",".join(tiers)] + (["--lists", ",".join(map(str, lists))] if lists else [])
    with tempfile.TemporaryDirectory(prefix="ds41numba-claims-") as claims:
        families_args = [",".join(names) for names in families]
        children = [subprocess.Popen([sys.executable, "-m", _MODULE, *options, "--claims", claims,
                                      *families_args], stdout=subprocess.DEVNULL)
                    for _ in range(n - 1)]
        _compile(_claimed(families, Path(claims)), tiers, lists)
        for child in children:
            child.wait()    # a failed child leaves its kernels to the run: slower, never wrong
    if not quiet:
        print(f"compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return len(missing)


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {_MODULE}",
                                description="Compile the named kernels of the list into numba's cache.")
    p.add_argument("--tiers", help="the tiers, comma-separated, whose calls to compile "
                                   "(default: this CPU's)")
    p.add_argument("--lists", help="more list files than kernels.txt, comma-separated")
    p.add_argument("--claims", help="a directory of claims shared with other processes: compile "
                                    "only the families this process is first to claim there")
    p.add_argument("families", nargs="+", help="module:qualname of the kernels to compile, a "
                                               "family's names joined by commas")
    args = p.parse_args(argv)
    tiers = tuple(args.tiers.split(",")) if args.tiers else (backend(),)
    lists = tuple(Path(p) for p in args.lists.split(",")) if args.lists else ()
    families = [f.split(",") for f in args.families]
    _compile(_claimed(families, Path(args.claims)) if args.claims else families, tiers, lists)


if __name__ == "__main__":
    _main(sys.argv[1:])
