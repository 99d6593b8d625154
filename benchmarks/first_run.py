"""A first run, measured: ``python -m benchmarks.first_run``.

The README's first command creates a venv, installs the package and runs ``ds41numba golden``
on the built-in default; on a fresh install numba's cache is empty, so that golden compiles the
kernels it calls first (:mod:`ds41numba.compile_ahead`, one process a core) and then loads them.
This times that golden alone, as the command line runs it: a fresh process whose numba cache is
an empty directory (*cold*), then the same golden again on the cache the first one filled
(*warm*), ``--runs`` times each, and prints each run, the medians and the kernels compiled.
The venv and ``pip install`` are the host's (10-17 s on the project's 2-core Zen 4 in
2026-12-07's hours) and are not timed here. ``bench_first_run.py`` tracks the same two numbers
with asv.

Options: ``--runs 3``, ``--preset`` (default: the command's own default), ``--json-file PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

_COMPILING = re.compile(r"compiling (\d+) numba kernels")


def golden_seconds(out: str, cache: str | None = None, preset: str | None = None) -> tuple[float, int]:
    """Run ``ds41numba golden`` in a fresh process, writing ``out``, with numba's cache in
    ``cache`` (default: where this process has it); returns ``(wall seconds, kernels it
    compiled ahead)``. Raises on a failed run."""
    cmd = [sys.executable, "-m", "ds41numba", "golden", "--force", "--out", out]
    if preset:
        cmd += ["--preset", preset]
    env = dict(os.environ, **({"NUMBA_CACHE_DIR": cache} if cache else {}))
    env.pop("DS41NUMBA_COMPILE_AHEAD", None)
    start = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}): {run.stderr[-2000:]}")
    found = _COMPILING.search(run.stderr)
    return seconds, int(found.group(1)) if found else 0


def first_runs(runs: int, preset: str | None = None) -> list[dict]:
    """``runs`` pairs of a cold golden (an empty cache) and a warm one (the cache it filled)."""
    results = []
    for i in range(runs):
        with tempfile.TemporaryDirectory(prefix="ds41numba-first-run-") as d:
            out = os.path.join(d, "golden.safetensors")
            cold, compiled = golden_seconds(out, os.path.join(d, "cache"), preset)
            warm, _ = golden_seconds(out, os.path.join(d, "cache"), preset)
        results.append({"cold_seconds": cold, "warm_seconds": warm, "kernels_compiled": compiled})
        print(f"run {i + 1}: cold {cold:.1f} s (compiling {compiled} kernels ahead), "
              f"warm {warm:.1f} s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_run",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="cold and warm goldens, each (default 3)")
    ap.add_argument("--preset", help="the golden's preset (default: the command's own)")
    ap.add_argument("--json-file", metavar="PATH", help="also write the runs to PATH as JSON")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    results = first_runs(args.runs, args.preset)
    cold = statistics.median(r["cold_seconds"] for r in results)
    warm = statistics.median(r["warm_seconds"] for r in results)
    colds = ", ".join(f"{r['cold_seconds']:.1f}" for r in results)
    print(f"ds41numba golden{' --preset ' + args.preset if args.preset else ''}, {os.cpu_count()} "
          f"CPUs, medians of {len(results)}: cold (an empty numba cache) {cold:.1f} s, warm "
          f"{warm:.1f} s; cold runs {colds} s")
    print("The README's first command adds creating a venv and pip install to the cold run "
          "(its target: under 30 s in all).")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"cpus": os.cpu_count(), "preset": args.preset, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
