"""Where ds41numba stands against numpy: ``python -m benchmarks.report`` (from the repo root).

One command prints, for the kernels and the production layers (v41-flash layers 0, 2, 20):
useful GFLOP/s (see ``benchmarks/common.py`` for what counts) next to numpy's f32 matrix-product
rate measured in the same process, the decode step's time next to numpy's time for that layer's
projection matrix-vector products alone (f32 weights, one row), and peak RSS. It ends with the
ratios the project quotes, against issue 30's targets (those of issue 14 before it: the index
scores alone >= 3.0, prefill >= 1.8 at 65,536, decode <= 1.1 / 1.2):

* ``indexer_tile`` (the whole tile as a layer runs it): useful FLOP/s / numpy matmul FLOP/s
  (target >= 1.5)
* prefill of layer 20 at 4,096 tokens: useful FLOP/s / numpy matmul FLOP/s   (target >= 1.5)
* prefill of layer 20 at 65,536 tokens (``--long 65536``): the same ratio (target >= 1.75),
  and it completes with peak RSS <= 6 GB
* decode step / its weight-reading floor (the layer's weights as held, 2 bytes a bf16
  parameter, read once at the bandwidth numpy's matvec pass reaches in the same process):
  target <= 1.15 at 4,096 and at 65,536 context

The decode table also shows the step against numpy's own projection matvecs (f32 weights), and
the rate at which our decode products alone read the layer's weights ("ours GB/s", timed in the
same blocks): whether the products keep up with the floor's own yardstick.

Kernels run in this process (each peak RSS reset through ``/proc/self/clear_refs``). Every layer
measurement runs in a subprocess of its own, so its peak RSS is its own; that subprocess also
measures numpy's matmul rate (before and after the layer) and, for decode, interleaves blocks of
numpy's matvec passes with blocks of decode steps, so each ratio compares numbers taken side by
side (each block of timed steps after untimed ones: see :func:`~benchmarks.common.settle`).
A decode at context C first prefills C tokens; when C is also a prefill size, one subprocess
serves both.

Options: ``--sizes 1024,4096,16384`` (prefill), ``--decode-context 4096,65536``, ``--quick``
(sizes 1024,4096, decode 4096, fewer repeats), ``--long 65536`` (opt-in, many minutes),
``--layers 0,2,20``, ``--no-kernels``, ``--no-layers``, ``--repeat N``, ``--decode-steps N``,
``--profile N`` (top N functions by own time, per layer run, from cProfile), ``--json`` (JSON
instead of the table), ``--json-file PATH`` (the JSON as well).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from . import common, kernel_cases

#: Issue 30's targets: useful FLOP/s over numpy's f32 matmul rate (the indexer's whole tile, and
#: layer 20's prefill at these lengths), and a decode step against the time it takes just to
#: read the layer's weights once.
TARGET_INDEXER_CASE = "indexer_tile"
TARGET_INDEXER_RATIO = 1.5
TARGET_PREFILL_RATIO = {4096: 1.5, 65536: 1.75}
TARGET_DECODE_FLOOR = {4096: 1.15, 65536: 1.15}
TARGET_LONG_PEAK = 6 * 1024 ** 3
TARGET_PREFILL_TOKENS = 4096
TARGET_LONG_TOKENS = 65536
#: The most untimed steps a decode block runs (the stack's caches are sized for them).
SETTLE_STEPS_MAX = 96
#: Blocks the timed decode steps are split into, alternating with numpy's blocks.
_BLOCKS = 2


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def _layer_ids(text: str) -> list[int]:
    return common.int_list(text, minimum=0)


def _median(xs):
    return statistics.median(xs) if xs else None


# ====================================================================== the layer worker


def _profile_rows(prof: cProfile.Profile, top: int) -> list[dict]:
    st = pstats.Stats(prof, stream=io.StringIO())
    total = st.total_tt or 1e-12
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}({func})", "calls": nc,
                     "tottime": tt, "cumtime": ct, "share": tt / total})
    rows.sort(key=lambda r: -r["tottime"])
    return rows[:top]


def _decode_positions(steps: int) -> int:
    """Positions a decode measurement of ``steps`` timed steps may take: the first (untimed)
    step, each block's untimed steps at most, the timed ones."""
    return 1 + _BLOCKS * SETTLE_STEPS_MAX + steps


def run_worker(args) -> dict:
    """One layer measurement in this (fresh) process; the result is printed as JSON."""
    layer, tokens = args.layer, args.prefill
    steps = args.decode_steps
    tag = f"[layer {layer}, {tokens} tokens]"
    out = {"layer": layer, "tokens": tokens, "pid": os.getpid()}
    mm = [common.matmul_rate(reps=5)]
    _log(f"{tag} numpy matmul {mm[0]['gflops']:.1f} GFLOP/s; building weights and stack")
    t0 = time.perf_counter()
    stack = common.build_stack(layer, tokens + (_decode_positions(steps) if steps else 0))
    cfg = stack.config
    out["setup_seconds"] = time.perf_counter() - t0
    common.warm_up(stack, layer, min(tokens, common.WARMUP_TOKENS))
    x = common.layer_input(layer, tokens)
    out["flops"] = common.layer_flops(cfg, layer, 0, tokens)

    prof = cProfile.Profile() if args.profile else None
    times = []
    for i in range(args.prefill_repeat):
        last = i == args.prefill_repeat - 1
        if prof is not None and last:
            prof.enable()
        t0 = time.perf_counter()
        stack.forward(layer, x, 0)
        times.append(time.perf_counter() - t0)
        if prof is not None and last:
            prof.disable()
        _log(f"{tag} prefill {i + 1}/{args.prefill_repeat}: {times[-1]:.2f} s")
    out["prefill_seconds"] = times
    out["peak_rss"] = common.peak_rss_bytes()          # the whole process so far
    if prof is not None:
        out["prefill_profile"] = _profile_rows(prof, args.profile)
    del x

    if steps:
        pairs = common.matvec_set(cfg, layer, common.layer_weights(layer))
        ours = common.products_set(stack, layer)
        inputs = common.decode_inputs(layer, tokens, _decode_positions(steps))
        pos = tokens

        def step():
            nonlocal pos
            pos += 1
            stack.forward(layer, inputs[pos - tokens], pos)

        stack.forward(layer, inputs[0], pos)            # warm: bf16 weight bits packed, etc.
        reset = common.reset_peak_rss()
        prof = cProfile.Profile() if args.profile else None
        dec, mv, prod, settle = [], [], [], []
        # Decode steps and numpy's matvecs alternate in blocks, not step by step. Each block of
        # timed steps follows untimed ones (common.settle).
        for block in np.array_split(np.arange(steps), _BLOCKS):
            common.matvec_once(pairs)
            settle.append(common.settle(step, SETTLE_STEPS_MAX))
            for _ in block:
                if prof is not None:
                    prof.enable()
                t0 = time.perf_counter()
                step()
                dec.append(time.perf_counter() - t0)
                if prof is not None:
                    prof.disable()
            # Our products alone, before numpy's pass (whose BLAS threads spin after it).
            prod.extend(common.products_once(ours) for _ in block)
            mv.extend(common.matvec_once(pairs) for _ in block)
        out["decode"] = {
            "context": tokens, "step_seconds": dec, "matvec_seconds": mv,
            "matvec_bytes": int(sum(w.nbytes for _, w in pairs)),
            "products_seconds": prod, "products_bytes": int(sum(w.nbytes for _, w in ours)),
            "weight_bytes": common.step_weight_bytes(cfg, layer),
            "matvec_flops": int(sum(2 * w.shape[0] * w.shape[1] for _, w in pairs)),
            "flops": common.layer_flops(cfg, layer, tokens + 1, 1),
            "peak_rss": common.peak_rss_bytes() if reset else None,
            "settle_steps": settle,
        }
        if prof is not None:
            out["decode_profile"] = _profile_rows(prof, args.profile)
        _log(f"{tag} decode: median step {1e3 * _median(dec):.1f} ms, numpy matvecs "
             f"{1e3 * _median(mv):.1f} ms")
    mm.append(common.matmul_rate(reps=5))
    out["matmul_gflops"] = [r for m in mm for r in m["samples"]]
    return out


# ====================================================================== kernels (in process)


def run_kernels(quick: bool) -> list[dict]:
    results = []
    reps, budget = (5, 3.0) if quick else (15, 8.0)
    for name, case in kernel_cases.kernel_cases().items():
        why = kernel_cases.unavailable(case)
        if why:
            results.append({"name": name, "label": case.label, "shape": case.shape, "skipped": why})
            continue
        st = case.build()

        def run_once():
            if case.prepare:
                case.prepare(st)
            case.run(st)

        common.settle(run_once)
        times = []
        start = time.perf_counter()
        peak = None
        while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget):
            if case.prepare:
                case.prepare(st)
            if peak is None:
                reset = common.reset_peak_rss()
            t0 = time.perf_counter()
            case.run(st)
            times.append(time.perf_counter() - t0)
            if peak is None:
                peak = common.peak_rss_bytes() if reset else None
        t = _median(times)
        results.append({"name": name, "label": case.label, "shape": case.shape,
                        "seconds": t, "samples": times, "flops": case.flops,
                        "elements": case.elements, "peak_rss": peak})
        _log(f"kernel {name}: {1e3 * t:.2f} ms")
        del st
    return results


# ====================================================================== planning


def plan_jobs(args) -> list[dict]:
    """Layer subprocess jobs: ``{"layer", "tokens", "prefill_row", "decode", "long", "repeat"}``."""
    jobs: dict[tuple[int, int], dict] = {}

    def job(layer, tokens):
        key = (layer, tokens)
        if key not in jobs:
            jobs[key] = {"layer": layer, "tokens": tokens, "prefill_row": False,
                         "decode": False, "long": False}
        return jobs[key]

    for layer in args.layers:
        for s in args.sizes:
            job(layer, s)["prefill_row"] = True
    for c in args.decode_context:
        job(common.DECODE_LAYER, c)["decode"] = True
    for n in args.long:
        j = job(common.DECODE_LAYER, n)
        j["long"] = j["prefill_row"] = True
    for j in jobs.values():
        if args.repeat:
            j["repeat"] = args.repeat
        elif args.quick or j["tokens"] > 4096 or not j["prefill_row"]:
            j["repeat"] = 1
        else:
            j["repeat"] = 3
    return sorted(jobs.values(), key=lambda j: (j["long"], j["tokens"], j["layer"]))


def run_job(j: dict, args) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "benchmarks.report", "--_worker", "--layer", str(j["layer"]),
           "--prefill", str(j["tokens"]), "--prefill-repeat", str(j["repeat"]),
           "--decode-steps", str(args.decode_steps if j["decode"] else 0),
           "--profile", str(args.profile)]
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tail: list[str] = []

    def relay():   # the worker's progress lines, passed on as they come; the last kept
        for line in proc.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.strip():
                tail[:] = (tail + [line.strip()])[-3:]

    relay_thread = threading.Thread(target=relay, daemon=True)
    relay_thread.start()
    stdout = proc.stdout.read()
    proc.wait()
    relay_thread.join()
    res = {"job": j, "wall_seconds": time.perf_counter() - t0, "returncode": proc.returncode}
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    if proc.returncode == 0 and lines:
        res["result"] = json.loads(lines[-1])
    else:
        res["error"] = (f"worker exited with status {proc.returncode}"
                        + (f": {tail[-1]}" if tail else ""))
    return res


# ====================================================================== summary and printing


def summarise(kernels, layer_runs, parent_mm) -> dict:
    """``parent_mm``: numpy's matmul rate measured (warm) before and after everything else; the
    kernels, measured right after the first, are compared with that one."""
    mm_parent = parent_mm[0]["gflops"]
    for k in kernels:
        if "seconds" in k:
            k["gflops"] = k["flops"] / k["seconds"] / 1e9 if k["flops"] else None
            k["vs_matmul"] = k["gflops"] / mm_parent if k["gflops"] else None
            k["gelem_per_s"] = k["elements"] / k["seconds"] / 1e9
    prefill, decode, targets = [], [], {}
    tile = next((k for k in kernels if k.get("name") == TARGET_INDEXER_CASE and k.get("vs_matmul")),
                None)
    if tile:
        targets[TARGET_INDEXER_CASE] = {"ratio": tile["vs_matmul"], "target": TARGET_INDEXER_RATIO,
                                        "met": tile["vs_matmul"] >= TARGET_INDEXER_RATIO}
    for run in layer_runs:
        j = run["job"]
        r = run.get("result")
        if r is None:
            row = {"layer": j["layer"], "tokens": j["tokens"], "error": run.get("error")}
            if j["prefill_row"]:
                prefill.append(row)
            if j["decode"]:
                decode.append({"context": j["tokens"], "error": run.get("error")})
            if j["long"]:
                targets[f"prefill_{j['tokens']}_long"] = {"completed": False, "error": run.get("error")}
            continue
        mm = _median(r["matmul_gflops"])
        t = _median(r["prefill_seconds"])
        gf = r["flops"]["total"] / t / 1e9
        row = {"layer": r["layer"], "roles": common.layer_roles(r["layer"]), "tokens": r["tokens"],
               "seconds": t, "samples": r["prefill_seconds"], "flops": r["flops"],
               "gflops": gf, "matmul_gflops": mm, "ratio": gf / mm, "peak_rss": r["peak_rss"],
               "profile": r.get("prefill_profile")}
        if j["prefill_row"]:
            prefill.append(row)
        if r["layer"] == common.DECODE_LAYER and r["tokens"] == TARGET_PREFILL_TOKENS:
            tgt = TARGET_PREFILL_RATIO[TARGET_PREFILL_TOKENS]
            targets["prefill_4096"] = {"ratio": row["ratio"], "target": tgt, "met": row["ratio"] >= tgt}
        if j["long"]:
            targets[f"prefill_{r['tokens']}_long"] = {
                "completed": True, "seconds": t, "peak_rss": r["peak_rss"],
                "target_peak_rss": TARGET_LONG_PEAK, "met": r["peak_rss"] <= TARGET_LONG_PEAK,
                "ratio": row["ratio"], "target_ratio": TARGET_PREFILL_RATIO.get(r["tokens"]),
                "ratio_met": row["ratio"] >= TARGET_PREFILL_RATIO.get(r["tokens"], np.inf)}
        if "decode" in r:
            d = r["decode"]
            step, mv = _median(d["step_seconds"]), _median(d["matvec_seconds"])
            # The floor: the layer's weights, as the step holds them, read once at the
            # bandwidth numpy's own matvec pass reached in the same process.
            bandwidth = d["matvec_bytes"] / mv
            floor = d["weight_bytes"] / bandwidth if d.get("weight_bytes") else None
            # Our decode products alone read the same weights at this rate (None in a record
            # made before they were timed).
            prod = _median(d["products_seconds"]) if d.get("products_seconds") else None
            drow = {"context": d["context"], "step_seconds": step, "samples": d["step_seconds"],
                    "matvec_seconds": mv, "matvec_samples": d["matvec_seconds"],
                    "ratio": step / mv, "matvec_gbytes_per_s": bandwidth / 1e9,
                    "products_seconds": prod,
                    "products_gbytes_per_s": prod and d["products_bytes"] / prod / 1e9,
                    "floor_seconds": floor, "floor_ratio": step / floor if floor else None,
                    "flops": d["flops"], "gflops": d["flops"]["total"] / step / 1e9,
                    "peak_rss": d["peak_rss"], "prefill_peak_rss": r["peak_rss"],
                    "settle_steps": d.get("settle_steps"), "profile": r.get("decode_profile")}
            decode.append(drow)
            tgt = TARGET_DECODE_FLOOR.get(d["context"])
            if tgt is not None and floor:
                targets[f"decode_floor_{d['context']}"] = {"ratio": drow["floor_ratio"],
                                                           "target": tgt,
                                                           "met": drow["floor_ratio"] <= tgt}
    return {"matmul_gflops_parent": mm_parent, "matmul_parent": parent_mm,
            "kernels": kernels, "prefill": prefill, "decode": decode, "targets": targets}


def _mb(b):
    return "-" if b is None else f"{b / 2 ** 20:,.0f} MB"


def _gb(b):
    return "-" if b is None else f"{b / 2 ** 30:.2f} GB"


def _f(v, fmt):
    if v is None:
        return "-"
    return format(v, fmt) if abs(v) >= 0.1 else format(v, ".2g")


def _table_head(w, title: str, header: str):
    """A blank line, the table's title, its column header and a rule as wide as the header."""
    w("")
    w(title)
    w(header)
    w("-" * len(header))


def print_text(s: dict, meta: dict):
    w = print
    w(f"ds41numba benchmark report  ({meta['when']}, {meta['cpus']} CPUs, numba threads "
      f"{meta['numba_threads']}, BLAS {meta['blas']}, AVX512-BF16 products {meta['bf16_dot']}, "
      f"index scores on {meta.get('index_scores', 'AVX512-VNNI' if meta.get('int8_dot') == 'on' else '-')}, "
      f"load average {meta['load_before']} -> "
      f"{meta['load_after']})")
    for when, m in zip(("before", "after"), s["matmul_parent"]):
        w(f"numpy f32 matmul 2048x2048x2048 in this process, {when} the rest: {m['gflops']:.1f} "
          f"GFLOP/s (median of {len(m['samples'])} after {len(m['warmup'])} warm-up products; "
          f"spread {m['spread'][0]:.0f}-{m['spread'][1]:.0f}; warm-up "
          f"{', '.join(f'{v:.0f}' for v in m['warmup'])})")
    if s["kernels"]:
        _table_head(w, "Kernels, in this process (median time; GFLOP/s = useful FLOPs / time; "
                       "'vs matmul' = GFLOP/s / numpy matmul; peak RSS = this process's peak during "
                       "one call)",
                    f"{'kernel':<20} {'shape':<34} {'time':>10} {'GFLOP/s':>8} {'vs matmul':>9} "
                    f"{'Gelem/s':>8} {'peak RSS':>9}")
        for k in s["kernels"]:
            if "skipped" in k:
                w(f"{k['name']:<20} {k['shape']:<34} skipped: {k['skipped']}")
                continue
            w(f"{k['name']:<20} {k['shape']:<34} {1e3 * k['seconds']:>8.2f}ms "
              f"{_f(k['gflops'], '8.1f'):>8} {_f(k['vs_matmul'], '9.3f'):>9} "
              f"{k['gelem_per_s']:>8.3f} {_mb(k['peak_rss']):>9}")
    if s["prefill"]:
        _table_head(w, "Prefill, one production layer (subprocess each; matmul = numpy's rate in "
                       "that process; peak = process peak RSS)",
                    f"{'layer':>5} {'what':<40} {'tokens':>7} {'time s':>9} {'TFLOP':>7} "
                    f"{'GFLOP/s':>8} {'matmul':>7} {'ratio':>6} {'peak RSS':>9}")
        for p in s["prefill"]:
            if "error" in p:
                w(f"{p['layer']:>5} {'':<40} {p['tokens']:>7} FAILED: {p['error']}")
                continue
            w(f"{p['layer']:>5} {p['roles']:<40} {p['tokens']:>7} {p['seconds']:>9.2f} "
              f"{p['flops']['total'] / 1e12:>7.2f} {p['gflops']:>8.1f} {p['matmul_gflops']:>7.1f} "
              f"{p['ratio']:>6.3f} {_gb(p['peak_rss']):>9}")
        w("  useful FLOPs split (projections / attention / indexer): " + "; ".join(
            f"L{p['layer']}@{p['tokens']}: {p['flops']['projections'] / 1e12:.2f} / "
            f"{p['flops']['attention'] / 1e12:.2f} / {p['flops']['indexer'] / 1e12:.2f} TFLOP"
            for p in s["prefill"] if "flops" in p))
    if s["decode"]:
        _table_head(w, f"Decode, one step of layer {common.DECODE_LAYER} (median of steps, each "
                       f"block's timed after {common.SETTLE_SECONDS} s of untimed ones; numpy = "
                       "the layer's projection matvecs alone, f32 weights, in blocks alternating with "
                       "the steps; the faster of numpy's default BLAS threads and one thread; ours = "
                       "the step's bf16 products alone through the decode kernel, in the same blocks)",
                    f"{'context':>8} {'step ms':>9} {'numpy ms':>9} {'ratio':>6} {'numpy GB/s':>10} "
                    f"{'ours GB/s':>9} "
                    f"{'floor ms':>8} {'/floor':>6} "
                    f"{'step GFLOP/s':>12} {'decode peak':>11} {'prefill peak':>12}")
        for d in s["decode"]:
            if "error" in d:
                w(f"{d['context']:>8} FAILED: {d['error']}")
                continue
            w(f"{d['context']:>8} {1e3 * d['step_seconds']:>9.2f} {1e3 * d['matvec_seconds']:>9.2f} "
              f"{d['ratio']:>6.3f} {d['matvec_gbytes_per_s']:>10.1f} "
              f"{_f(d.get('products_gbytes_per_s'), '.1f'):>9} "
              f"{_f(d['floor_seconds'] and 1e3 * d['floor_seconds'], '.2f'):>8} "
              f"{_f(d['floor_ratio'], '.3f'):>6} {d['gflops']:>12.1f} "
              f"{_gb(d['peak_rss']):>11} {_gb(d['prefill_peak_rss']):>12}")
    w("")
    w("Targets")
    t = s["targets"]

    def verdict(ok):
        return "MET" if ok else "NOT MET"

    k = t.get(TARGET_INDEXER_CASE)
    w(f"  {TARGET_INDEXER_CASE}: useful FLOP/s / numpy matmul = "
      + (f"{k['ratio']:.3f}  (target >= {k['target']})  {verdict(k['met'])}" if k
         else "not measured (--no-kernels)"))
    p = t.get("prefill_4096")
    w(f"  prefill L{common.DECODE_LAYER} @ 4096: useful FLOP/s / numpy matmul = "
      + (f"{p['ratio']:.3f}  (target >= {p['target']})  {verdict(p['met'])}" if p
         else "not measured (needs --sizes with 4096)"))
    longs = sorted((int(key.split("_")[1]), v) for key, v in t.items() if key.endswith("_long"))
    if TARGET_LONG_TOKENS not in [n for n, _ in longs]:
        w(f"  prefill L{common.DECODE_LAYER} @ {TARGET_LONG_TOKENS}: not run (opt-in: --long {TARGET_LONG_TOKENS})")
    for n, lk in longs:
        if not lk["completed"]:
            w(f"  prefill L{common.DECODE_LAYER} @ {n} (--long): FAILED ({lk.get('error')})")
        else:
            w(f"  prefill L{common.DECODE_LAYER} @ {n} (--long): completed in {lk['seconds']:.0f} s, "
              f"peak RSS {_gb(lk['peak_rss'])} (target <= 6 GB)  {verdict(lk['met'])}")
            if lk.get("target_ratio"):
                w(f"  prefill L{common.DECODE_LAYER} @ {n}: useful FLOP/s / numpy matmul = "
                  f"{lk['ratio']:.3f}  (target >= {lk['target_ratio']})  "
                  f"{verdict(lk['ratio_met'])}")
    for c, tgt in TARGET_DECODE_FLOOR.items():
        d = t.get(f"decode_floor_{c}")
        w(f"  decode L{common.DECODE_LAYER} @ {c}: step / weight-reading floor = "
          + (f"{d['ratio']:.3f}  (target <= {tgt})  {verdict(d['met'])}" if d
             else f"not measured (--decode-context {c})"))
    profiled = [(f"prefill L{p['layer']} @ {p['tokens']}", p["profile"]) for p in s["prefill"]
                if p.get("profile")]
    profiled += [(f"decode L{common.DECODE_LAYER} @ {d['context']}", d["profile"])
                 for d in s["decode"] if d.get("profile")]
    for title, rows in profiled:
        w("")
        w(f"Hotspots, {title} (cProfile, own time; share of the profiled run)")
        for r in rows:
            w(f"  {100 * r['share']:5.1f}%  {r['tottime']:8.3f} s  {r['calls']:>6} calls  {r['function']}")


def _meta() -> dict:
    import numba

    try:
        from threadpoolctl import threadpool_info

        blas = ", ".join(f"{i['internal_api']} x{i['num_threads']}" for i in threadpool_info()
                         if i.get("user_api") == "blas") or "?"
    except ImportError:
        blas = "?"
    from ds41numba.numerics import tier_at_least

    return {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
            "numba_threads": numba.get_num_threads(), "blas": blas,
            "bf16_dot": "on" if tier_at_least("avx512bf16") else "off",
            "int8_dot": "on" if tier_at_least("avx512vnni") else "off",
            "index_scores": ("AMX" if tier_at_least("amx")
                             else "AVX512-VNNI" if tier_at_least("avx512vnni")
                             else "AVX2 int8" if tier_at_least("avx2int8") else "BLAS"),
            "python": platform.python_version(),
            "load_before": " ".join(f"{v:.1f}" for v in os.getloadavg())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=common.int_list, default=None,
                    help="prefill token counts (default 1024,4096,16384; --quick 1024,4096)")
    ap.add_argument("--decode-context", type=common.int_list, default=None,
                    help="decode contexts, each reached by a prefill (default 4096,65536; --quick 4096)")
    ap.add_argument("--long", type=common.int_list, default=[],
                    help="opt-in long prefill(s) of layer 20, e.g. 65536 (checks peak RSS <= 6 GB)")
    ap.add_argument("--layers", type=_layer_ids, default=sorted(common.LAYERS),
                    help="prefill layers (default 0,2,20)")
    ap.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    ap.add_argument("--repeat", type=int, default=0, help="prefill repeats per size (default 3, 1 above 4096 or --quick)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 16; --quick 8)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="add the top N functions by own time (cProfile) of each layer run")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--no-layers", action="store_true")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--json-file", metavar="PATH", help="also write the JSON to PATH")
    # The per-measurement subprocess.
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layer", type=int, default=common.DECODE_LAYER, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args._worker:
        print(json.dumps(run_worker(args)), flush=True)
        return 0

    if args.sizes is None:
        args.sizes = [1024, 4096] if args.quick else [1024, 4096, 16384]
    if args.decode_context is None:
        args.decode_context = [4096] if args.quick else [4096, 65536]
    if args.decode_steps is None:
        args.decode_steps = 8 if args.quick else 16
    if args.no_layers:
        args.sizes, args.decode_context, args.long = [], [], []

    meta = _meta()
    t_start = time.perf_counter()
    parent_mm = [common.matmul_rate(reps=7)]
    kernels = [] if args.no_kernels else run_kernels(args.quick)
    layer_runs = []
    for j in plan_jobs(args):
        what = ", ".join(w for w, on in (("prefill", j["prefill_row"]), ("decode", j["decode"]),
                                         ("long", j["long"])) if on)
        _log(f"layer {j['layer']} at {j['tokens']} tokens ({what}), subprocess ...")
        layer_runs.append(run_job(j, args))
    parent_mm.append(common.matmul_rate(reps=7))
    meta["load_after"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    meta["wall_seconds"] = time.perf_counter() - t_start
    summary = summarise(kernels, layer_runs, parent_mm)
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"meta": meta, **summary}, f, indent=1)
    if args.json:
        print(json.dumps({"meta": meta, **summary}, indent=1))
    else:
        print_text(summary, meta)
        print(f"\n(report took {meta['wall_seconds']:.0f} s)")
    failed = any("error" in r for r in layer_runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
