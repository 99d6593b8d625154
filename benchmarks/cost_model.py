"""What a full-length golden costs, measured: ``python -m benchmarks.cost_model``.

A golden of one layer at 1,048,576 tokens runs for hours, so it is projected from shorter runs
of the same code. Each run is a streamed ``io`` golden (``ds41numba.golden.write_golden``, the
CLI's path) of one v41-flash layer in a subprocess of its own; every prefill chunk is timed and
the times are fitted by least squares as

    t_chunk = rows * (a + b * m / r + c * P / r)

``rows`` the chunk's rows, ``m`` its middle position, ``P`` the prefill's length and ``r`` the
layer's ratio (``m / r`` is what a query of the chunk sees on average, ``P / r`` the width of
the prefill's score rows). ``a`` is the per-token work that does not grow with the length
(projections, the compressor, sparse attention over at most 128 window + 512 selected rows),
``b`` the indexer's scores and top-k over the positions a query sees, ``c`` what each query pays
for the full width of its score row (the mask past what it sees, the recorded runners-up). A
ratio-0 layer has no indexer: only ``a``. Two lengths separate ``b`` from ``c``; the first chunk
of each run (numba's kernels loading) is left out of the fit.

Peak RSS is each run's own (``getrusage`` in its subprocess) and is fitted as
``RSS(N) = R0 + g * N``: ``g`` should be the caches' bytes per token (window ring, compressed KV
and index keys), nothing else.

The second projection ("from the indexer's own rate") is the one to quote: the indexer is
timed directly (:func:`indexer_seconds`) at ``--widths`` positions of the longest projected
prefill, up to its full width, and summed over every query of a projected length
(:func:`indexer_total`); the rest of a token's work is the first run's pace without its own
indexer's share (timed the same way at that run's middle width). The fit of ``a, b, c``
extrapolates the short runs' chunk times alone, whose growth is mostly noise.

Options: ``--layer 20`` (default), ``--lengths 16384,32768``, ``--chunk 4096``, ``--decode 4``,
``--project 65536,131072,262144,1048576``, ``--widths 4096,65536,262144,1048576`` (where the
indexer is timed directly), ``--runs-from JSON``, ``--dir DIR`` (where the goldens are written;
each is deleted after its run), ``--json-file PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import common, kernel_cases

_STEP = re.compile(r"step (\d+)")
_ROWS = re.compile(r"rows (\d+)-(\d+)")


def piece_rows(where: str) -> int:
    """The rows of the piece a progress report names: a prefill chunk's are in its name ("step 0
    rows 4096-8191 layer 20"), a decode step is one row. (The report's count is the progress
    bar's work units, not rows.)"""
    rows = _ROWS.search(where)
    return int(rows.group(2)) - int(rows.group(1)) + 1 if rows else 1


def run_worker(layer: int, prefill: int, decode: int, chunk: int, directory: str) -> dict:
    """One streamed golden in this process: the seconds of every forward of ``layer``, and the
    peak RSS. A layer that reads another's selection or candidates (a candidate consumer) runs
    with its sources (``closed_selection``); only its own forwards are timed."""
    from ds41numba.config import preset
    from ds41numba.golden import GoldenPlan, write_golden
    from ds41numba.golden.plan import closed_selection

    config = preset(common.PRESET)
    plan = GoldenPlan(config=config, layers=closed_selection(config, (layer,))[0], prefill=prefill,
                      decode=decode, capture="io", preset=common.PRESET)
    forwards, started = [], {}

    def progress(n, where):
        now = time.perf_counter()
        if not where.endswith(f"layer {layer}"):
            return
        if n == 0:
            started["t"] = now
        else:
            forwards.append({"step": int(_STEP.match(where).group(1)), "rows": piece_rows(where),
                             "seconds": now - started["t"]})

    fd, path = tempfile.mkstemp(suffix=".safetensors", dir=directory)
    os.close(fd)
    try:
        summary = write_golden(plan, path, force=True, progress=progress, chunk=chunk)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    first = 0
    for f in forwards:
        if f["step"] == 0:
            f["first_row"], first = first, first + f["rows"]
    return {"layer": layer, "prefill": prefill, "decode": decode, "chunk": chunk,
            "ratio": plan.config.ratio(layer), "seconds": summary["seconds"],
            "bytes": summary["bytes"], "forwards": forwards,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def indexer_seconds(layer: int, width: int, prefill: int, queries: int = 64, repeat: int = 3) -> float:
    """Seconds a query spends in the indexer (projections, scores, candidate blocks, top-k) when
    it sees ``width`` compressed positions of a prefill of ``prefill`` tokens, over random fp4
    keys (the values do not change the work). Measured directly because at the lengths a chunked
    run can reach in minutes the indexer's growth is lost in the noise of the rest.

    The marginal cost: calls of ``queries`` and of ``2 * queries`` queries (medians of
    ``repeat``), their difference divided by ``queries``. A call's own fixed work (the first
    tile's mask of a fresh score buffer: 64 MB of -inf at 1,048,576 positions) is then left out;
    a real prefill pays it once per chunk of thousands of queries, not once per 64.

    A candidate consumer's queries each get ``candidate_topk_blocks`` blocks of the positions
    they see (:func:`random_candidates`). The golden's observer records each row's selection
    scores and runners-up as an ``io`` golden does (a pass over each score row, as long as
    what the query sees)."""
    from ds41numba.attention import layer_rope_table
    from ds41numba.golden.captures import StepObserver
    from ds41numba.indexer import IndexerCfg, IndexerWeights, IndexKeyCache, indexer

    cfg = common.layer_config(prefill, layer)
    r = cfg.ratio(layer)
    w = common.weight_subset(layer, ["indexer.wq_b.weight", "indexer.weights_proj.weight"])
    weights = IndexerWeights(wq_b=w["indexer.wq_b.weight"], weights_proj=w["indexer.weights_proj.weight"])
    keys = IndexKeyCache(kernel_cases.index_keys(prefill // r, cfg.index_head_dim, 16))
    table = layer_rope_table(cfg, r, prefill)
    icfg = IndexerCfg.for_layer(cfg, layer)
    x = common.layer_input(layer, 2 * queries)
    qr = kernel_cases.normal_bf16((2 * queries, cfg.q_lora_rank), 15)
    medians = []
    for n in (queries, 2 * queries):
        start = width * r - n         # the last query sees ``width`` positions
        cands = random_candidates(icfg, start, n, prefill // r) if icfg.use_candidates else None
        times = []
        observer = StepObserver(cfg)
        for _ in range(repeat + 1):           # the first call loads the kernels
            t0 = time.perf_counter()
            observer.begin(layer, start, n, prefill_len=prefill)
            indexer(x[:n], qr[:n], start, icfg, weights, table, keys, cfg.window_size,
                    prefill_len=prefill, candidate_blocks=cands[:n] if cands is not None else None,
                    observer=observer)
            times.append(time.perf_counter() - t0)
        medians.append(float(np.median(times[1:])))
    return max(medians[1] - medians[0], 0.0) / queries


def random_candidates(icfg, start: int, n: int, width: int, seed: int = 17) -> np.ndarray:
    """A candidate consumer's packed candidate bits for queries ``start ..`` of a prefill whose
    score rows are ``width`` positions wide: each query's newest visible block and
    ``candidate_topk_blocks - 1`` others it sees, drawn at random (spread over what it sees, as
    the generator's candidate source picks them: at 32,768 tokens 98% of a query's key blocks
    of 32 positions held one)."""
    rng = np.random.default_rng(seed)
    block = icfg.candidate_block_size
    bits = np.zeros((n, -(-width // block)), bool)
    for s in range(n):
        seen = -(-((start + s + 1) // icfg.ratio) // block)
        if seen:
            bits[s, rng.permutation(seen - 1)[:icfg.candidate_topk_blocks - 1]] = True
            bits[s, seen - 1] = True
    return np.packbits(bits, axis=1)


def indexer_total(per_query: dict, n: int, ratio: int) -> float:
    """Seconds the queries of an ``n``-token prefill spend in the indexer: query ``s`` sees
    ``(s + 1) // ratio`` positions, and a query's seconds at ``W`` positions are read off
    ``per_query`` ({W: seconds}) by linear interpolation (the nearest measured width outside
    them), summed as ``ratio`` times the integral over ``W`` up to ``n / ratio``."""
    widths = sorted(per_query)
    seconds = [per_query[w] for w in widths]
    grid = np.linspace(0.0, n / ratio, 4097)
    t = np.interp(grid, widths, seconds)
    return float(ratio * np.sum((t[1:] + t[:-1]) / 2 * np.diff(grid)))


def _features(rows, middle, prefill, ratio):
    """The fit's columns for chunks of ``rows`` rows (see the module docstring)."""
    rows = np.asarray(rows, np.float64)
    if not ratio:
        return rows[:, None]
    return np.stack([rows, rows * np.asarray(middle) / ratio,
                     rows * np.full(len(rows), prefill, np.float64) / ratio], axis=1)


def fit(runs: list[dict]) -> dict:
    """Least-squares ``a, b, c`` (seconds a token) over every run's prefill chunks but its first,
    and ``RSS(N) = R0 + g * N`` over the runs' peaks."""
    ratio = runs[0]["ratio"]
    cols, times = [], []
    for run in runs:
        chunks = [f for f in run["forwards"] if f["step"] == 0][1:]
        if not chunks:
            continue
        cols.append(_features([f["rows"] for f in chunks],
                              [f["first_row"] + f["rows"] / 2 for f in chunks], run["prefill"], ratio))
        times += [f["seconds"] for f in chunks]
    if not cols:
        raise SystemExit("cost_model: no prefill chunk to fit (use --lengths of several chunks)")
    x, y = np.concatenate(cols), np.asarray(times)
    if x.shape[1] == 3 and len({r["prefill"] for r in runs}) < 2:
        x = x[:, :2]            # one length cannot tell b from c: fold c into a's column
    names = ["a", "b", "c"][:x.shape[1]]
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    while len(coef) > 1 and coef[1:].min() < 0:
        # A negative growth term is noise, not physics: drop it and refit with the others.
        drop = 1 + int(np.argmin(coef[1:]))
        x, names = np.delete(x, drop, axis=1), names[:drop] + names[drop + 1:]
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
    out = {n: float(v) for n, v in zip(names, coef)}
    out["residual"] = float(np.sqrt(np.mean((x @ coef - y) ** 2)) / np.mean(y))
    n = np.array([r["prefill"] for r in runs], np.float64)
    rss = np.array([r["peak_rss"] for r in runs], np.float64)
    if len(runs) >= 2 and np.ptp(n) > 0:
        g, r0 = np.polyfit(n, rss, 1)
        out["rss_r0"], out["rss_per_token"] = float(r0), float(g)
    return out


def project(model: dict, ratio: int, prefill: int, chunk: int) -> float:
    """Seconds of the prefill of ``prefill`` tokens the fitted model predicts."""
    firsts = np.arange(0, prefill, chunk)
    rows = np.minimum(chunk, prefill - firsts)
    cols = _features(rows, firsts + rows / 2, prefill, ratio)
    names = ("a", "b", "c")[:cols.shape[1]]
    return float(sum(cols[:, j].sum() * model[n] for j, n in enumerate(names) if n in model))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cost_model", description=__doc__.split("\n")[0])
    ap.add_argument("--layer", type=int, default=common.DECODE_LAYER)
    ap.add_argument("--lengths", type=common.int_list, default=[16384, 32768])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--project", type=common.int_list, default=[65536, 131072, 262144, 1048576])
    ap.add_argument("--widths", type=common.int_list, default=[4096, 65536, 262144, 1048576],
                    help="positions a query sees where the indexer is timed directly")
    ap.add_argument("--dir", default=None, help="where the goldens are written (default: a temp dir)")
    ap.add_argument("--json-file", default=None)
    ap.add_argument("--runs-from", default=None, metavar="JSON",
                    help="take the runs from an earlier --json-file instead of running them")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    directory = args.dir or tempfile.gettempdir()
    os.makedirs(directory, exist_ok=True)     # a --dir not made yet is made, as a user expects
    if args.worker is not None:
        print(json.dumps(run_worker(args.layer, args.worker, args.decode, args.chunk, directory)))
        return 0
    runs = []
    if args.runs_from:
        with open(args.runs_from) as f:
            runs = json.load(f)["runs"]
    for n in [] if args.runs_from else args.lengths:
        t0 = time.perf_counter()
        print(f"layer {args.layer}, {n} tokens ...", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "benchmarks.cost_model", "--layer", str(args.layer),
                               "--worker", str(n), "--decode", str(args.decode), "--chunk",
                               str(args.chunk), "--dir", directory],
                              capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {time.perf_counter() - t0:.0f} s, peak RSS {runs[-1]['peak_rss'] / 1e9:.2f} GB",
              file=sys.stderr, flush=True)
    model = fit(runs)
    ratio = runs[0]["ratio"]
    print(f"v41-flash layer {args.layer} (ratio {ratio}), streamed io goldens, chunks of {args.chunk}")
    for r in runs:
        prefill_s = sum(f["seconds"] for f in r["forwards"] if f["step"] == 0)
        print(f"  measured {r['prefill']:>9,} tokens: prefill {prefill_s:8.1f} s (model "
              f"{project(model, ratio, r['prefill'], args.chunk):8.1f} s), whole run {r['seconds']:.1f} s, "
              f"peak RSS {r['peak_rss'] / 1e9:.2f} GB")
    terms = "  ".join(f"{k} = {model[k] * 1e6:.3f} us" for k in ("a", "b", "c") if k in model)
    print(f"  fit per token: {terms}  (rms residual {100 * model['residual']:.1f}% of a chunk)")
    if "rss_per_token" in model:
        print(f"  RSS(N) = {model['rss_r0'] / 1e9:.2f} GB + {model['rss_per_token']:.0f} B x N")
    for n in args.project:
        line = f"  projected {n:>9,} tokens: prefill {project(model, ratio, n, args.chunk) / 3600:6.2f} h"
        if "rss_per_token" in model:
            line += f", peak RSS {(model['rss_r0'] + model['rss_per_token'] * n) / 1e9:.2f} GB"
        print(line)
    if ratio and args.widths:
        # The indexer timed directly in a prefill of the longest projected length (its score
        # rows that wide), and at the first run's own length and middle width: that run's pace
        # holds its indexer's cost, which the projection replaces by the long rows'.
        longest = max(args.project)
        idx = {w: indexer_seconds(args.layer, w, longest) for w in args.widths if w <= longest // ratio}
        short = runs[0]["prefill"]
        chunks = [f for f in runs[0]["forwards"] if f["step"] == 0][1:] or \
            [f for f in runs[0]["forwards"] if f["step"] == 0]
        rows = sum(f["rows"] for f in chunks)
        middle = sum((f["first_row"] + f["rows"] / 2) * f["rows"] for f in chunks) / rows
        idx_short = indexer_seconds(args.layer, max(1, int(middle / ratio)), short)
        other = sum(f["seconds"] for f in chunks) / rows - idx_short
        i1, i0 = np.polyfit(list(idx), list(idx.values()), 1)
        model.update(indexer_per_query={str(w): t for w, t in idx.items()}, i0=float(i0), i1=float(i1),
                     indexer_short=idx_short, other_per_token=other)
        print(f"  indexer alone (marginal), a query seeing W positions of a {longest:,}-token prefill: "
              + ", ".join(f"W={w:,}: {t * 1e3:.2f} ms" for w, t in idx.items())
              + f"; in the {short:,}-token run (W={int(middle / ratio):,}): {idx_short * 1e3:.2f} ms")
        print(f"  the {short:,}-token run's pace without its indexer: {other * 1e3:.2f} ms a token "
              f"(chunks after the first)")
        for n in args.project:
            ix = indexer_total(idx, n, ratio)
            t = n * other + ix
            print(f"  projected {n:>9,} tokens from the indexer's own rate: prefill {t / 3600:6.2f} h "
                  f"(indexer {ix / t:.0%})")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"runs": runs, "model": model}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
