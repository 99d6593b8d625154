"""A golden on a Dask cluster against one process, and the cost model of a cluster run:
``python -m benchmarks.cluster_model``.

Runs the same streamed golden (default: v41-flash layer 20, 16,384 + 4 tokens, ``--chunk``
4,096) in one process and on ``--workers N`` local worker processes, alternately (A B A B:
the machine's speed drifts), checks the two files are byte-identical, and prints the pairs'
times and ratios. Each cluster run's :class:`~ds41numba.golden.cluster.RunStats` give the
model's terms, all measured:

    T = start + weights + keys + sum over layers of broadcast + makespan(tiles) + write_tail
        + decode

``start`` the cluster's start-up as the run waits for it (the cluster starts in the
background, as the command line's does: its construction plus the drive's wait for it after
the key side), ``weights`` the driver's making (and writing) of the weights, ``keys`` the
driver's key side (the inputs, compressors and index keys of the whole prefill),
``broadcast`` each layer's weights and caches handed to the workers (written to shared files
for a local cluster), ``makespan`` the tiles' measured compute seconds placed in submission order on the
earliest free worker, ``write_tail`` the driver's writing of the last tile (the others overlap
the workers' compute), ``decode`` the decode steps on the driver. The model's sum is compared
with the run's wall time. Per-core rates derived from it project a longer run on more
machines (``--project-tokens``, ``--machines``, ``--cores``; see docs/full-length.md, "Running on a
cluster").

Options: ``--layers 20``, ``--prefill 16384``, ``--decode 4``, ``--chunk 4096``,
``--workers 2``, ``--pairs 2``, ``--dir DIR`` (goldens written there, deleted after each
pair), ``--json-file PATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import os
import tempfile
import time

from . import common


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def makespan(seconds: list[float], workers: int) -> float:
    """Tasks of these durations, in this order, each on the earliest free of ``workers``."""
    free = [0.0] * workers
    for s in seconds:
        heapq.heappush(free, heapq.heappop(free) + s)
    return max(free)


def model(stats, start: float, called: float, workers: int) -> dict:
    """The model's terms from one cluster run's stats (see the module docstring); ``called``:
    when write_golden was called (perf_counter)."""
    tiles = [s for _, _, _, s in stats.tiles]
    per_tile_write = stats.write_seconds / max(1, len(tiles))
    terms = {"start": start, "weights": stats.started - called, "keys": stats.keys_seconds,
             "broadcast": sum(s for *_, s in stats.broadcasts),
             "makespan": makespan(tiles, workers), "write_tail": per_tile_write,
             "decode": stats.decode_seconds}
    terms["total"] = sum(terms.values())
    terms["broadcast_weight_bytes"] = sum(w for _, w, _, _ in stats.broadcasts)
    terms["broadcast_cache_bytes"] = sum(c for _, _, c, _ in stats.broadcasts)
    terms["tile_seconds"] = sum(tiles)
    terms["layers"] = len({i for i, *_ in stats.tiles})
    terms["tile_rows"] = sum(n for _, _, n, _ in stats.tiles)
    terms["write_bytes"] = stats.write_bytes
    terms["input_bytes"] = stats.input_bytes
    terms["write_seconds"] = stats.write_seconds
    return terms


def one_run(plan, path: str, chunk: int, workers: int | None) -> dict:
    from ds41numba.golden import write_golden
    from ds41numba.golden.cluster import Cluster

    t0 = time.perf_counter()
    if workers is None:
        write_golden(plan, path, chunk=chunk, force=True)
        return {"seconds": time.perf_counter() - t0}
    with Cluster(workers=workers, background=True) as cluster:      # as the command line
        called = time.perf_counter()
        write_golden(plan, path, chunk=chunk, force=True, cluster=cluster)
        seconds = time.perf_counter() - t0
        stats = cluster.stats
        peaks = cluster.client.run(lambda: __import__("resource").getrusage(0).ru_maxrss * 1024)
    return {"seconds": seconds, "model": model(stats, called - t0 + stats.wait_seconds, called,
                                               workers),
            "worker_peak_rss": sorted(peaks.values())}


def project(terms: dict, threads: int, tokens: int, machines: int, cores: int, here: int,
            growth: float = 1.0, network: float = 1.25e9, disk: float = 1e9) -> dict:
    """A run of ``tokens`` on ``machines`` of ``cores`` (and a driver like them) from one
    measured run's terms, stated assumptions and all:

    * compute: the tiles' core-seconds per token as measured here, times ``growth`` (the
      indexer's longer rows, from ``benchmarks.cost_model``), spread perfectly over every core
      (a big machine's memory bandwidth per core is lower: this is a floor);
    * keys: the driver's key side per token-core as measured on this machine's ``here`` cores,
      or the writing of the inputs onto its disk at ``disk`` bytes/s if that is slower;
    * broadcast: every layer's weights, and its caches grown to the length, sent to each machine
      in turn at ``network`` bytes/s (10 Gb/s);
    * results: the tiles' rows into the driver at ``network``, and onto its disk at ``disk``
      bytes/s; both overlap the compute.
    """
    scale = tokens * terms["layers"] / terms["tile_rows"]        # the prefill's lengths
    compute = terms["tile_seconds"] * threads * scale * growth / (machines * cores)
    keys = max(terms["keys"] * scale * here / cores, terms.get("input_bytes", 0) * scale / disk)
    sent = terms["broadcast_weight_bytes"] + terms["broadcast_cache_bytes"] * scale
    broadcast = sent * machines / network
    results = terms["write_bytes"] * scale / min(network, disk)
    return {"compute": compute, "keys": keys, "broadcast": broadcast, "results": results,
            "total": keys + broadcast + max(compute, results)}


def measure(plan, args) -> list[dict]:
    """``--pairs`` A B pairs, one process then the cluster, each pair's files compared (in
    ``--dir``, else in a temporary directory removed at the end)."""
    if args.dir is not None:
        return _pairs(plan, args, args.dir)
    with tempfile.TemporaryDirectory(prefix="ds41-cluster-") as directory:
        return _pairs(plan, args, directory)


def _pairs(plan, args, directory: str) -> list[dict]:
    pairs = []
    for k in range(args.pairs):
        one, two = (os.path.join(directory, f"{w}.safetensors") for w in ("one", "cluster"))
        a = one_run(plan, one, args.chunk, None)
        b = one_run(plan, two, args.chunk, args.workers)
        same = _sha(one) == _sha(two)
        os.unlink(one)
        os.unlink(two)
        m = b["model"]
        pairs.append({"one_process": a["seconds"], "cluster": b["seconds"], "same_bytes": same,
                      "model": m, "worker_peak_rss": b["worker_peak_rss"]})
        print(f"pair {k + 1}: one process {a['seconds']:.1f} s, --workers {args.workers} "
              f"{b['seconds']:.1f} s (ratio {b['seconds'] / a['seconds']:.3f}), files "
              f"{'identical' if same else 'DIFFER'}; model {m['total']:.1f} s "
              f"({m['total'] / b['seconds']:.3f} of measured): start {m['start']:.1f}, keys "
              f"{m['keys']:.1f}, weights {m['weights']:.1f}, broadcast {m['broadcast']:.1f} "
              f"({(m['broadcast_weight_bytes'] + m['broadcast_cache_bytes']) / 1e6:.0f} MB), "
              f"tiles {m['makespan']:.1f} (sum {m['tile_seconds']:.1f}), write tail "
              f"{m['write_tail']:.2f} (all writes {m['write_seconds']:.1f} s, "
              f"{m['write_bytes'] / 1e6:.0f} MB), decode {m['decode']:.1f}; workers' peak RSS "
              f"{', '.join(f'{r / 1e9:.2f}' for r in b['worker_peak_rss'])} GB", flush=True)
    return pairs


def indexer_growth(path: str, ratio: int, short: int, long: int) -> float:
    """How much more a query of a ``long`` prefill costs than one of a ``short`` one, from a
    ``benchmarks.cost_model`` fit: ``a + i0 + i1 * visible``, a query seeing P / 2r on average."""
    with open(path) as f:
        cm = json.load(f)["model"]
    r = ratio or 1
    per_query = lambda n: cm["a"] + cm["i0"] + cm["i1"] * n / (2 * r)
    return per_query(long) / per_query(short)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=common.int_list, default=[20])
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--cost-model", metavar="JSON", default=None, help="a benchmarks.cost_model "
                    "--json-file of the same layer: its per-query indexer growth scales the "
                    "tiles' work to the projected length")
    ap.add_argument("--project-tokens", type=int, default=1 << 20)
    ap.add_argument("--machines", type=int, default=16)
    ap.add_argument("--cores", type=int, default=64)
    ap.add_argument("--runs-from", metavar="JSON", default=None, help="an earlier --json-file: "
                    "project from its pairs instead of measuring")
    ap.add_argument("--json-file", default=None)
    args = ap.parse_args(argv)

    from ds41numba.config import preset
    from ds41numba.golden import GoldenPlan

    plan = GoldenPlan(config=preset(common.PRESET), layers=tuple(args.layers),
                      prefill=args.prefill, decode=args.decode, capture="io",
                      preset=common.PRESET)
    cores = len(os.sched_getaffinity(0))
    if args.runs_from is None:
        pairs = measure(plan, args)
    else:
        with open(args.runs_from) as f:
            pairs = json.load(f)["pairs"]
    threads = max(1, cores // args.workers)
    growth, why = 1.0, "no indexer growth (give --cost-model)"
    if args.cost_model:
        growth = indexer_growth(args.cost_model, plan.config.ratio(args.layers[-1]),
                                args.prefill, args.project_tokens)
        why = f"the indexer's growth x{growth:.2f} from {args.cost_model}"
    proj = project(pairs[-1]["model"], threads, args.project_tokens, args.machines, args.cores,
                   cores, growth)
    print(f"projected layers {args.layers} at {args.project_tokens:,} tokens on {args.machines} "
          f"machines of {args.cores} cores and a driver like them (this machine's per-core "
          f"rates, {why}): {proj['total']:.0f} s (compute {proj['compute']:.0f} s, keys "
          f"{proj['keys']:.0f} s, broadcast {proj['broadcast']:.0f} s at 10 Gb/s, results "
          f"{proj['results']:.0f} s at 1 GB/s; disk 1 GB/s)")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump({"pairs": pairs, "cores": cores, "workers": args.workers,
                       "threads_per_worker": threads, "projection": proj}, f, indent=1)
    return 0 if all(p["same_bytes"] for p in pairs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
