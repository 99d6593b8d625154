"""The ``ds41numba`` command: argument parsing and printing only (what an argument names is
:mod:`.arguments`'s, the work is in ``golden/``).

Exit status: 0 success; 1 a replay or comparison that disagrees; 2 a bad argument, an unreadable
config or file (a candidate too: truncated, of another format, a tensor of the wrong shape or
dtype, NaN where an index belongs), an output that exists without ``--force``, a disk that
fails (full, read-only, removed; always one line on stderr), a Dask scheduler that is unreachable
or goes away mid-run (``--workers``/``--scheduler``); 130 interrupted by Ctrl-C, 143 by SIGTERM.
An interrupted ``--capture io`` run that wrote a checkpoint (a lost scheduler's too) keeps its
partial file and checkpoint and says to rerun with ``--resume``; any other leaves nothing behind. Output into a
pipe that closes early (``| head``) ends quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading

from tqdm import tqdm

from . import golden
from .arguments import default_run, load_config, parse_layers, parse_rows, run_config
from .compile_ahead import compile_ahead, tier_for_run
from .golden.files import check_target, ranges_text
from .golden import CAPTURE_MODES, DEFAULT_INDEX_TOLERANCE, PROFILES, GoldenError, RunInterrupted
from .golden.inputs_file import InputsFile
from .golden.weights_dir import WeightsDir

__all__ = ["main", "parse_layers", "parse_rows", "default_run", "load_config", "run_config"]

PROG = "ds41numba"
_EPILOG = ("Exit status: 0 ok, 1 disagreement, 2 bad usage, unreadable input, a failing disk or "
           "a lost Dask scheduler, 130 interrupted (143 by SIGTERM).")


class _UsageError(Exception):
    """Raised by the parser instead of printing its multi-line usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{self.prog}: error: {message}")


def _version() -> str:
    from . import __version__
    return __version__


def _config_source(sub) -> None:
    """``--preset`` or ``--config``, one of them at most: where a command's config comes from."""
    src = sub.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a built-in config: tiny (default), mixed, v41-flash")
    src.add_argument("--config", metavar="FILE", help="a JSON config in the reference's ModelArgs "
                     "names or a Hugging Face V4.1 config.json")


def _build_parser() -> argparse.ArgumentParser:
    """The command line's parser: ``golden``, ``replay``, ``compare``, ``export-paged`` and
    ``suite`` (the CLI reference of the documentation is generated from it)."""
    p = _Parser(prog=PROG, description="A CPU reference for DeepSeek-V4.1 compressed attention: "
                "write, replay and compare golden files.", epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = p.add_subparsers(dest="command", metavar="{golden,replay,compare,export-paged,suite}")
    for add in (_golden_parser, _replay_parser, _compare_parser, _export_paged_parser,
                _suite_parser):
        add(sub)
    return p


def _golden_parser(sub) -> None:
    g = sub.add_parser("golden", help="run a layer stack on generated (or given) weights and "
                       "inputs and write a golden file", epilog=_EPILOG,
                       description="Build a layer stack with deterministic weights and inputs "
                       "from --seed (or a checkpoint's weights, --weights, and a file's "
                       "inputs, --inputs), run a prefill and --decode steps, and write one "
                       "self-contained safetensors file.")
    _config_source(g)
    g.add_argument("--weights", metavar="DIR", help="run on the attention weights of a model "
                   "checkpoint directory in the released layout (config.json, "
                   "model.safetensors.index.json, shards; fp8 weights dequantized to bf16); its "
                   "config.json is the config unless --preset/--config is given, which must "
                   "then agree with it")
    g.add_argument("--no-weights", action="store_true", help="with --weights, leave the "
                   "weights out of the file (it records their checksums; replay then needs "
                   "--weights DIR)")
    g.add_argument("--inputs", metavar="FILE", help="layer inputs from a safetensors file: "
                   "x.layers.{i} (or one x for every layer) [tokens, dim], BF16 or F32, row t "
                   "the input at position t")
    g.add_argument("--layers", metavar="LIST", help="layers to run, e.g. 20 or 2,3,20-24 "
                   "(default: all); every source they read must be included")
    g.add_argument("--prefill", type=int, metavar="N", help="prefill tokens (default: 12, or the "
                   "reference golden's 203 for --preset mixed)")
    g.add_argument("--decode", type=int, metavar="M", help="decode steps after the prefill "
                   "(default: 40, or 48 for --preset mixed)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="generator seed (default: 0)")
    g.add_argument("--capture", choices=tuple(CAPTURE_MODES), default="all",
                   help="io: out, idx and shared.topk_idxs; caches: io and the caches the "
                   "prefill leaves (window ring, compressed KV, index keys, compressor state), "
                   "for a decode kernel; all (default): everything the reference goldens carry "
                   "(each: the scores behind each selection)")
    g.add_argument("--rows", metavar="SPEC", help="with --capture io or caches, answer and "
                   "store only these prefill query rows (every other row runs its key side "
                   "only): none, last:N, first:N, every:N, random:N (drawn with --seed) or "
                   "positions and ranges (0-127,1000); the decode steps run as usual; "
                   "one sequence only, not with --batch")
    g.add_argument("--chunk", type=int, default=golden.DEFAULT_CHUNK, metavar="N",
                   help=f"with --capture io, run the prefill N rows at a time through every "
                   f"layer, streaming each chunk's rows to the file (default: "
                   f"{golden.DEFAULT_CHUNK}; the file is the same for any N)")
    g.add_argument("--capture-rows", metavar="ROWS", help="also record, for these query "
                   "positions of every step, what each kernel consumes and produces (sample.*): "
                   "a list and ranges (0,5,100-120) or random:N (N positions drawn with --seed)")
    g.add_argument("--batch", type=int, default=1, metavar="B", help="B sequences in lockstep, "
                   "as the reference runs a batch (their products over B x seqlen rows); every "
                   "tensor but the weights gets a leading batch axis (default: 1, one sequence, "
                   "no batch axis; docs/batches.md)")
    g.add_argument("--profile", choices=PROFILES, default="default", help="generator profile: "
                   "default, or ties (tie-heavy index scores, NaN and +-inf rows)")
    g.add_argument("--out", metavar="FILE", help="output file (default: "
                   "./ds41numba-golden-PRESET.safetensors)")
    g.add_argument("--force", action="store_true", help="overwrite an existing output file; "
                   "without --resume also discard an interrupted run's partial file and checkpoint")
    g.add_argument("--resume", action="store_true", help="continue an interrupted --capture io "
                   "run from its checkpoint (.FILE.ckpt/ beside --out; give the same arguments): "
                   "the file is the one an uninterrupted run writes")
    g.add_argument("--checkpoint-every", type=float, default=golden.CHECKPOINT_EVERY,
                   metavar="SECONDS", help="with --capture io, checkpoint between prefill chunks "
                   f"and decode steps once this much work has passed (default: "
                   f"{golden.CHECKPOINT_EVERY:g}; 0: at every one)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, metavar="N", help="with --capture io, run the "
                       "prefill's query tiles (--chunk rows each) on a local Dask cluster of N "
                       "worker processes, the machine's cores shared among them (needs "
                       "'ds41numba[dask]'); the file is the same")
    where.add_argument("--scheduler", metavar="ADDRESS", help="with --capture io, run the "
                       "prefill's query tiles on the Dask cluster of the scheduler at ADDRESS "
                       "(e.g. tcp://10.0.0.1:8786; workers started with --nthreads 1, each "
                       "with ds41numba installed); the file is the same")
    g.add_argument("--quiet", action="store_true", help="no progress bar")


def _index_rules(sub) -> None:
    """The options replay and compare judge index rows by."""
    sub.add_argument("--index-tolerance", type=float, metavar="T", help="a boundary swap's "
                     "score gap, relative to the row's largest |selected score| (default "
                     f"{DEFAULT_INDEX_TOLERANCE:g})")
    sub.add_argument("--exact-index", action="store_true", help="index rows must be "
                     "identical (no boundary swaps)")


def _replay_parser(sub) -> None:
    r = sub.add_parser("replay", help="recompute a golden's captures from its own weights and "
                       "inputs and report agreement", epilog=_EPILOG)
    r.add_argument("file", metavar="FILE", help="a ds41numba golden (.safetensors) or a "
                   "reference golden (.npz)")
    r.add_argument("--weights", metavar="DIR", help="the checkpoint directory a golden made "
                   "with --no-weights ran on (its tensors' checksums are checked)")
    r.add_argument("--json", action="store_true", help="machine-readable report")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    _index_rules(r)


def _compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="compare a candidate's tensors with a golden's",
                       epilog=_EPILOG, description="Index rows must be identical or differ by "
                       "boundary swaps (tie-aware, with the scores the golden records); float "
                       f"tensors within the bf16 tolerance ({golden.TOLERANCE}). Either file may "
                       "be a ds41numba .safetensors golden or a reference .npz golden.")
    c.add_argument("golden", metavar="GOLDEN")
    c.add_argument("candidate", metavar="CANDIDATE")
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.add_argument("--subset", action="store_true", help="the candidate may leave out tensors "
                   "of the golden (e.g. only a kernel's outputs)")
    c.add_argument("--plot", metavar="FILE.png", help="draw where the differences sit "
                   "(needs matplotlib: pip install 'ds41numba[plot]')")
    _index_rules(c)


def _export_paged_parser(sub) -> None:
    e = sub.add_parser("export-paged", help="lay out a golden's caches in shuffled pages with a "
                       "block table and slot mapping", epilog=_EPILOG,
                       description="For every cache a --capture all golden records "
                       "(shared.compress_kv, shared.index_k, state.window_kv), write its pages, "
                       "block table (logical -> physical page) and slot mapping (slot = "
                       "physical_page * P + offset), and the index selections as slots.")
    e.add_argument("golden", metavar="GOLDEN")
    e.add_argument("--page-size", type=int, required=True, metavar="P",
                   help="rows per page; must divide the window")
    e.add_argument("--shuffle", type=int, metavar="SEED", help="shuffle the physical page "
                   "order with this seed (default: pages in logical order)")
    e.add_argument("--out", required=True, metavar="FILE")
    e.add_argument("--force", action="store_true", help="overwrite an existing output file")


def _suite_parser(sub) -> None:
    s = sub.add_parser("suite", help="write the edge-case suite: small goldens at the places "
                       "kernels get wrong, and a manifest", epilog=_EPILOG,
                       description="Write one small golden per edge case (named for what it "
                       "covers) and manifest.json (each case's file, what it covers, its "
                       "lengths, layers and positions, its sha256) into DIR. The same arguments "
                       "give the same bytes; an interrupted suite continues where it stopped.")
    _config_source(s)
    s.add_argument("--layers", metavar="LIST", help="the layers the cases are about (default: "
                   "all); each case also runs the layers they read")
    s.add_argument("--seed", type=int, default=0, metavar="S", help="generator seed (default: 0)")
    s.add_argument("--out", metavar="DIR", help="the suite's directory (made if missing; an "
                   "existing one must be empty or this suite's)")
    s.add_argument("--check", metavar="DIR", help="only check a suite directory: its manifest "
                   "and every case file's checksum")
    s.add_argument("--quiet", action="store_true", help="no line per case")


def main(argv=None) -> int:
    """Run the ``ds41numba`` command line.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``), e.g.
            ``["golden", "--preset", "mixed"]``.

    Returns:
        The exit status: 0 success; 1 a replay or comparison that disagrees; 2 a bad argument,
        an unreadable input, an existing output without ``--force``, a failing disk or a lost
        Dask scheduler (one line on stderr); 130 interrupted (143 by SIGTERM). Nothing is
        raised for those.

    Example:
        >>> main(["--version"])
        ds41numba 0.1.0
        0
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            raise _UsageError(f"{PROG}: error: choose a command: golden, replay, compare, export-paged, suite "
                              f"(see {PROG} --help)")
        with _sigterm_as_exit():
            return {"golden": _golden, "replay": _replay, "compare": _compare,
                    "export-paged": _export_paged, "suite": _suite}[args.command](args)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except GoldenError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:   # a streamed run that keeps its checkpoint
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except _Terminated as e:
        print(f"{PROG}: terminated; nothing was written", file=sys.stderr)
        return e.code
    except SystemExit as e:   # --help
        return e.code if isinstance(e.code, int) else 0


class _Terminated(SystemExit):
    """SIGTERM, raised where the program stood (see :func:`_sigterm_as_exit`)."""


@contextlib.contextmanager
def _sigterm_as_exit():
    """Turn SIGTERM into SystemExit so cleanup (the temporary output file) runs, as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Terminated(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


#: The bar while numba compiles: no rate or ETA (a rate from those steps promised hours).
_COMPILING_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}, compiling{postfix}]"


@contextlib.contextmanager
def _progress(total: int, quiet: bool, desc: str):
    """A progress callback ``(n, where)`` drawing a tqdm bar with an ETA on stderr.

    The bar shows itself only once a run has lasted two seconds, counts work in key-side
    token-layers (a query row weighs what its projections and indexer width cost:
    :func:`~ds41numba.golden.work.work_units`), and names the step and layer in progress (a long
    prefill is a single forward call). ``where`` is ``"<piece> layer <i>"``
    (``piece_name`` in ``golden/drive.py``). The first piece of a run (the prefill, or its first chunk)
    and the first decode step run numba compiling (on a first run) or loading the kernels they
    need: while they run the bar says "compiling" and their work is counted without entering
    the rate, so the ETA comes from the steps after them. The bar is drawn once more when the
    run is complete, so it ends at 100%.
    """
    with tqdm(total=total, disable=quiet, delay=2.0, unit="tok", unit_scale=True, desc=desc,
              file=sys.stderr, dynamic_ncols=True, leave=False,
              bar_format=_COMPILING_FORMAT) as bar:
        warming, seen = set(), set()

        def report(n: int, where: str):
            if bar.disable:
                return
            piece = where.rsplit(" layer ", 1)[0]
            if piece not in seen:
                seen.add(piece)
                if len(seen) == 1 or piece == "step 1" or piece == "resumed":
                    warming.add(piece)
                bar.bar_format = _COMPILING_FORMAT if piece in warming else None
            n = min(n, max(total - bar.n, 0))   # float sums of work units overshoot by rounding
            if not n:
                bar.set_postfix_str(where, refresh=False)
            elif piece in warming:   # counted, but not a sample of the rate
                bar.n += n
                bar.last_print_n, bar.last_print_t = bar.n, bar._time()
                if bar.last_print_t >= bar.start_t + bar.delay:
                    bar.refresh()
            else:
                bar.update(n)
            if bar.n >= total and bar._time() >= bar.start_t + bar.delay:
                bar.refresh()
        yield report


def _golden(args) -> int:
    if args.chunk < 1:
        raise GoldenError(f"--chunk must be at least 1, got {args.chunk}")
    config, preset_name = run_config(args.preset, args.config, args.weights)
    layers = (parse_layers(args.layers, config.n_layers) if args.layers is not None
              else tuple(range(config.n_layers)))
    prefill, decode = default_run(preset_name)
    prefill = prefill if args.prefill is None else args.prefill
    decode = decode if args.decode is None else args.decode
    rows = () if args.capture_rows is None else parse_rows(args.capture_rows, prefill + decode,
                                                           args.seed)
    answered = (None if args.rows is None else
                parse_rows(args.rows, prefill, args.seed, flag="--rows", what="prefill"))
    plan = golden.GoldenPlan(config=config, layers=layers, prefill=prefill, decode=decode,
                             seed=args.seed, capture=args.capture, preset=preset_name,
                             profile=args.profile, capture_rows=rows, batch=args.batch,
                             rows=answered)
    if args.no_weights and args.weights is None:
        raise GoldenError("--no-weights: only a golden made from a checkpoint directory "
                          "(--weights DIR) may leave its weights out")
    if args.weights is not None or args.inputs is not None:
        plan = dataclasses.replace(
            plan, store_weights=not args.no_weights,
            weights=None if args.weights is None else WeightsDir(args.weights, config, plan.layers),
            inputs=None if args.inputs is None else InputsFile(args.inputs, config, plan.layers,
                                                              prefill + decode, args.batch))
    if args.out is not None:
        out = args.out
    else:
        source = args.config or os.path.abspath(args.weights or "")
        stem = preset_name or os.path.splitext(os.path.basename(source))[0]
        out = os.path.join(".", f"ds41numba-golden-{stem}.safetensors")
    check_target(out, args.force)       # said before a first run's compile, not after it
    with tier_for_run(plan.product_multiply_adds):
        compile_ahead(quiet=args.quiet)
        title = f"golden {preset_name or 'config'}"
        with _cluster(args, plan) as cluster, \
                _progress(plan.total_work, args.quiet, title) as progress:
            info = golden.write_golden(plan, out, force=args.force, progress=progress,
                                       chunk=args.chunk, resume=args.resume,
                                       checkpoint_every=args.checkpoint_every, cluster=cluster)
    what = preset_name or args.config or args.weights
    print(f"wrote {info['path']}  ({what}, layers {ranges_text(plan.layers)}, prefill {plan.prefill} "
          f"+ {plan.decode} decode steps{f', batch {plan.batch}' if plan.batch > 1 else ''}, "
          f"capture {plan.capture}, {info['tensors']} tensors, "
          f"{_size(info['bytes'])}, {info['seconds']:.1f} s)")
    return 0


@contextlib.contextmanager
def _cluster(args, plan):
    """The Dask cluster of ``--workers`` / ``--scheduler`` (None without them), closed after."""
    if args.workers is None and args.scheduler is None:
        yield None
        return
    golden.check_cluster_capture(plan.capture, plan.batch)
    from .golden.cluster import Cluster
    # Started in the background: the workers start while the driver makes the weights and runs
    # the key side, which they do not need.
    with Cluster(scheduler=args.scheduler, workers=args.workers, background=True) as cluster:
        yield cluster


def _replay(args) -> int:
    with golden.GoldenFile(args.file) as f:
        info = f.run_info()
    total = golden.total_work(info.config, info.layers, info.prefill, info.decode,
                              info.rows) * info.batch
    macs = golden.product_multiply_adds(info.config, info.layers, info.prefill + info.decode)
    with tier_for_run(macs * info.batch):
        compile_ahead(quiet=args.quiet)
        with _progress(total, args.quiet, "replay") as progress:
            report = golden.replay(args.file, progress=progress,
                                   index_tolerance=args.index_tolerance,
                                   exact_index=args.exact_index, weights_dir=args.weights)
    _print(report.to_json() if args.json else report.table() + "\n" + report.text())
    return 0 if report.ok else 1


def _compare(args) -> int:
    if args.plot is not None:
        from .golden.plot import check_plot_target
        check_plot_target(args.plot)
    report = golden.compare_files(args.golden, args.candidate, subset=args.subset,
                                  index_tolerance=args.index_tolerance,
                                  exact_index=args.exact_index)
    bad = [r for r in report.results if r.kind in ("unusable", "shape")]
    if bad:
        raise GoldenError(f"{args.candidate!r} cannot be compared: {bad[0].line()}"
                          + (f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""))
    wrote = None
    if args.plot is not None:
        from .golden.plot import plot_report
        wrote = plot_report(report, args.golden, args.candidate, args.plot)
    _print(report.to_json() if args.json else report.text())
    if wrote is not None:   # stderr under --json, whose stdout is the JSON alone
        print(f"wrote {wrote}  (where {args.candidate} differs from {args.golden})",
              file=sys.stderr if args.json else sys.stdout)
    return 0 if report.ok else 1


def _export_paged(args) -> int:
    from .golden.paged import export_paged
    info = export_paged(args.golden, args.out, args.page_size, args.shuffle, force=args.force)
    print(f"wrote {info['path']}  ({info['caches']} caches in pages of {args.page_size} rows, "
          f"{info['tensors']} tensors)")
    return 0


def _suite(args) -> int:
    from .golden.suite import plan_cases, read_manifest, write_suite
    if args.check is not None:
        if args.out is not None:
            raise GoldenError("give --out DIR (write) or --check DIR (check), not both")
        m = read_manifest(args.check)
        print(f"{args.check}: a suite of {len(m['cases'])} cases, every file as its manifest says")
        return 0
    if args.out is None:
        raise GoldenError("--out DIR is required (or --check DIR)")
    config, preset_name = load_config(args.preset, args.config)
    layers = (parse_layers(args.layers, config.n_layers) if args.layers is not None
              else tuple(range(config.n_layers)))

    def report(case, status, seconds):
        if not args.quiet:
            print(f"{status:>9}  {case.name}" + (f"  ({seconds:.1f} s)" if status == "written"
                                                 else ""), flush=True)

    largest = max((golden.product_multiply_adds(config, c.layers, c.prefill + c.decode)
                   for c in plan_cases(config, layers)), default=0.0)
    with tier_for_run(largest):
        compile_ahead(quiet=args.quiet)
        m = write_suite(config, preset_name, layers, args.out, args.seed, report=report)
    print(f"suite {args.out}: {len(m['cases'])} cases" + (
        f", {len(m['not_built'])} not built (they need: "
        f"{'; '.join(sorted({e['needs'] for e in m['not_built']}))})" if m["not_built"] else ""))
    return 0


def _print(text: str):
    """Print to stdout; a reader that closed the pipe early (``| head``) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would report the failed flush of sys.stdout at exit: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


if __name__ == "__main__":
    sys.exit(main())
