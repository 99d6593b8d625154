"""ds41numba benchmarks: an asv suite (``bench_*.py``) and a one-shot report (``report.py``).

Run from the repository root:

* ``asv machine --yes && asv run --python=same --quick`` -- every benchmark once;
* ``python -m benchmarks.report --quick`` -- GFLOP/s and ratios against numpy, peak RSS;
* ``python -m benchmarks.cost_model`` -- a 1,048,576-token layer projected from shorter runs;
* ``python -m benchmarks.first_run`` -- the default golden on an empty numba cache, then warm.

The production layers are v41-flash layers 0 (ratio 0), 2 (ratio 2, kv + index source) and 20
(ratio 1, kv + index + candidate source), with deterministic weights and inputs from
:mod:`ds41numba.golden`. Environment variables (read when the suite is imported):

* ``DS41_BENCH_FULL=1`` adds the heavy cases: prefill at 16,384 tokens and a decode step at
  65,536 context (whose setup is a 65,536-token prefill);
* ``DS41_BENCH_PREFILL=1024,4096`` and ``DS41_BENCH_DECODE=4096`` set the lists explicitly.
"""
