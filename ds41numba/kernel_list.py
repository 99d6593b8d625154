"""The list of kernels a first run compiles ahead (``kernels.txt``), traced from the default golden.

:mod:`.compile_ahead` reads the list; this module writes it. ``python -m ds41numba.kernel_list``
runs the default golden (``ds41numba golden``) on every tier this CPU has, at one thread and at
eight (the tiny golden calls the same kernels at both today; a kernel chosen by thread count
would show here), with the bf16 products on this CPU's choice of ``vdpbf16ps`` or its FMA twin
and on the other (:func:`.numerics.fma_faster`), each in a fresh process on an empty numba
cache and then again on the cache it filled; it notes each kernel Python called with argument
types it had no code for, and how long that took, and rewrites the list (the lines of a tier
this CPU lacks are kept as they were: they need a CPU with it). A developer's step after a
kernel's arguments change, which the test suite asks for by failing
(``tests/test_compile_ahead.py``).

``python -m ds41numba.kernel_list --suite`` writes the test suite's own list
(``tests/kernels.txt``, :data:`SUITE_KERNELS`): it runs the suite on an empty numba cache with
compiling ahead off and notes, with the tier each was first called on, the kernels the tests call
that the golden's list lacks (a direct test of a kernel on types no run gives it). The suite
compiles both lists ahead at its start (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from numba.core import types
from numba.core.dispatcher import Dispatcher

from . import cli, compile_ahead
from .compile_ahead import ANY_TIER, KERNELS, read_kernels
from .numerics import BACKENDS, backend, fma_faster, use_backend

__all__ = ["SUITE_KERNELS", "TRACE_ENV", "signature_spelling", "spelling", "traced_kernels",
           "tracing"]

_MODULE = "ds41numba.kernel_list"       # run as `python -m` (then __name__ is "__main__")
_THREADS = (1, 8)
#: The test suite's list: the kernels tests call that no default golden does.
SUITE_KERNELS = Path(__file__).resolve().parents[1] / "tests" / "kernels.txt"
#: Set to a file name, the test suite writes there the kernels it called (``tests/conftest.py``).
TRACE_ENV = "DS41NUMBA_TRACE_KERNELS"


def spelling(t) -> str:
    """A kernel argument's type in numba's signature syntax (``float32[:, ::1]``, ...), which
    :func:`numba.core.sigutils.normalize_signature` reads back."""
    if isinstance(t, types.Array):
        if t.layout != "C" or not t.mutable or not t.aligned:
            raise ValueError(f"kernel_list: a kernel takes a non-contiguous or read-only array {t}")
        return f"{t.dtype}[{', '.join([':'] * (t.ndim - 1) + ['::1'])}]"
    if isinstance(t, types.UniTuple):
        return f"UniTuple({spelling(t.dtype)}, {t.count})"
    if isinstance(t, types.Tuple):
        return f"Tuple(({', '.join(spelling(x) for x in t.types)},))"
    if isinstance(t, (types.Integer, types.Float, types.Boolean)):
        return str(t)
    raise ValueError(f"kernel_list: no spelling for a kernel argument of type {t}")


def signature_spelling(argtypes) -> str:
    """A kernel's argument types as numba reads a signature: ``(int64,)``, ``(float32[::1], bool)``."""
    parts = [spelling(t) for t in argtypes]
    return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"


@contextlib.contextmanager
def tracing(calls: list, strict: bool = True) -> Iterator[list]:
    """Inside, each ds41numba kernel Python calls with types it had no code for (compiled, or
    loaded from the cache) appends ``(name, signature, seconds, tier)`` to ``calls``. With
    ``strict`` False a kernel whose types have no spelling (a read-only or strided array) is
    passed over, not an error."""
    inner = Dispatcher._compile_for_args

    def noting(self, *args, **kws):
        before = set(self.signatures)
        start = time.perf_counter()
        try:
            return inner(self, *args, **kws)
        finally:
            name = f"{self.py_func.__module__}:{self.py_func.__qualname__}"
            for sig in set(self.signatures) - before:
                if not name.startswith("ds41numba"):
                    continue
                try:
                    calls.append((name, signature_spelling(sig), time.perf_counter() - start,
                                  backend()))
                except ValueError:
                    if strict:
                        raise

    Dispatcher._compile_for_args = noting
    try:
        yield calls
    finally:
        Dispatcher._compile_for_args = inner


def _trace(tier: str, argv: list[str]) -> None:
    """Run ``ds41numba ARGV`` on ``tier`` and print, a JSON line each, the kernels Python called
    with types they had no code for and the seconds each took (:func:`tracing`).

    The run stays on ``tier`` however small (:func:`.compile_ahead.tier_for_run` is off): the
    list holds each tier's kernels as the default golden calls them there, what a larger run on
    that tier compiles ahead and a cluster's workers load (the small default golden itself runs
    on ``blas``, whose lines the list has too)."""
    compile_ahead.SMALL_RUN_MACS = 0        # this process only: a subprocess of _traced_calls
    with tracing([]) as calls, use_backend(tier):
        cli.main(argv)
    for name, sig, seconds, _ in calls:
        print(json.dumps((name, sig, seconds)))


def _traced_calls(tier: str, threads: int, cache: str | None, fma: str | None = None) -> list[tuple]:
    """``(name, signature, seconds)`` of the kernels the default golden calls on ``tier`` with
    ``threads`` threads, in a fresh process (``cache``: its numba cache directory; None: the
    usual one; ``fma``: ``DS41NUMBA_BF16_FMA`` for it, None: this CPU's own choice)."""
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), DS41NUMBA_COMPILE_AHEAD="0")
    if fma is not None:
        env["DS41NUMBA_BF16_FMA"] = fma
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = cache
    with tempfile.TemporaryDirectory() as tmp:
        golden = ["golden", "--out", os.path.join(tmp, "g.safetensors"), "--quiet"]
        out = subprocess.run([sys.executable, "-m", _MODULE, "--trace", tier, *golden],
                             env=env, check=True, capture_output=True, text=True).stdout
    return [tuple(json.loads(line)) for line in out.splitlines() if line.startswith("[")]


def traced_kernels(tier: str, threads: int) -> set[tuple[str, str]]:
    """``(name, signature)`` of each kernel the default golden calls on ``tier`` with ``threads``
    threads, traced in a fresh process on the usual numba cache."""
    return {(name, sig) for name, sig, _ in _traced_calls(tier, threads, None)}


def _bf16_choices(tier: str) -> tuple:
    """``DS41NUMBA_BF16_FMA`` for each trace on ``tier``: where vdpbf16ps runs, the bf16
    products' operand depends on which of it and its FMA twin this CPU runs faster
    (:func:`.numerics.fma_faster`, a measurement with kernels of its own), so this CPU's own
    choice (None) is traced and the other one forced."""
    if BACKENDS.index(tier) > BACKENDS.index("avx512bf16"):
        return (None,)
    return (None, "0" if fma_faster() else "1")


def _available() -> tuple[str, ...]:
    """The tiers this CPU has: its own and every one after it (the tiers nest)."""
    return BACKENDS[BACKENDS.index(backend()):]


def _untraceable(path: Path) -> dict[tuple[str, str, str], float]:
    """The lines of list ``path`` of the tiers this CPU lacks, which it cannot trace: a rewrite
    keeps them as they were, ``{(tier, name, signature): seconds}``."""
    available = _available()
    return {(k.tier, k.name, k.signature): k.seconds
            for k in (read_kernels(path) if path.exists() else [])
            if k.tier not in (ANY_TIER, *available)}


def _kept_note(rows) -> list[str]:
    """The list's comment line on the lines :func:`_untraceable` kept (none when none were)."""
    kept = sorted({tier for tier, _, _ in rows}, key=BACKENDS.index)
    return ([f"# The lines of {', '.join(kept)} are kept from an earlier list (a CPU with them)."]
            if kept else [])


def _record(path: Path) -> None:
    """Rewrite the list from the default golden's runs on every tier this CPU has (the lines
    of a tier it lacks are kept)."""
    available = _available()
    seen: dict[str, dict[tuple[str, str], float]] = {}
    for tier in available:
        seen[tier] = {}
        for threads, fma in itertools.product(_THREADS, _bf16_choices(tier)):
            with tempfile.TemporaryDirectory() as cache:
                # Cold, then warm: a function a kernel compiled along with it on the cold run is
                # one Python calls (and numba loads) on a warm one.
                for name, sig, seconds in (_traced_calls(tier, threads, cache, fma)
                                           + _traced_calls(tier, threads, cache, fma)):
                    seen[tier][name, sig] = max(seconds, seen[tier].get((name, sig), 0.0))
            print(f"{tier} at {threads} threads (bf16 FMA: {fma or 'own choice'}): "
                  f"{len(seen[tier])} kernels", file=sys.stderr)
    everywhere = set.intersection(*(set(calls) for calls in seen.values()))
    rows = _untraceable(path)
    lines = _kept_note(rows)
    for tier, calls in seen.items():
        for (name, sig), seconds in calls.items():
            row = (ANY_TIER if (name, sig) in everywhere else tier, name, sig)
            rows[row] = max(seconds, rows.get(row, 0.0))
    lines = ["# The kernels the default golden (`ds41numba golden`) calls from Python on each tier (run",
             "# there however small; it runs on blas itself), read by ds41numba/compile_ahead.py:",
             "# tier ('*': every tier), compile seconds, module:qualname,",
             "# argument types. Written by `python -m ds41numba.kernel_list` on a CPU with the",
             f"# tiers {', '.join(available)}."] + lines
    lines += [f"{tier} {rows[tier, name, sig]:.2f} {name} {sig}" for tier, name, sig in sorted(rows)]
    path.write_text("\n".join(lines) + "\n")


def _record_suite(path: Path) -> None:
    """Write the test suite's list: run the suite (a fresh process, an empty numba cache,
    compiling ahead off) and keep the kernels it calls that the golden's list lacks, each with
    the tier it was first called on and its compile seconds."""
    golden = {(k.name, k.signature) for k in read_kernels()}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "calls.jsonl"
        env = dict(os.environ, NUMBA_CACHE_DIR=str(Path(tmp) / "cache"),
                   DS41NUMBA_COMPILE_AHEAD="0", **{TRACE_ENV: str(trace)})
        status = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 str(path.parent)], env=env, cwd=path.parent.parent).returncode
        calls = [json.loads(line) for line in trace.read_text().splitlines()]
    if status:
        print(f"the suite exited with status {status}: the list holds what the tests that ran "
              "called", file=sys.stderr)
    kept = _untraceable(path)
    rows: dict[tuple[str, str], tuple[str, float]] = {}
    for name, sig, seconds, tier in calls:
        if (name, sig) not in golden and (name, sig) not in rows:
            rows[name, sig] = (tier, seconds)
    lines = ["# The kernels the test suite calls from Python that ds41numba/kernels.txt lacks, compiled",
             "# ahead at the suite's start (tests/conftest.py): the tier first called on, compile",
             "# seconds, module:qualname, argument types. Written by",
             "# `python -m ds41numba.kernel_list --suite`."] + _kept_note(kept)
    rows.update({(name, sig): (tier, seconds) for (tier, name, sig), seconds in kept.items()
                 if (name, sig) not in golden})
    lines += [f"{tier} {seconds:.2f} {name} {sig}"
              for (name, sig), (tier, seconds) in sorted(rows.items())]
    path.write_text("\n".join(lines) + "\n")
    print(f"{path}: {len(rows)} kernels, {sum(s for _, s in rows.values()):.0f} s to compile",
          file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trace"]:
        _trace(sys.argv[2], sys.argv[3:])
    elif sys.argv[1:] == ["--suite"]:
        _record_suite(SUITE_KERNELS)
    elif sys.argv[1:]:
        sys.exit(f"usage: python -m {_MODULE} [--suite]   (rewrites {KERNELS}; "
                 f"with --suite, {SUITE_KERNELS})")
    else:
        _record(KERNELS)
