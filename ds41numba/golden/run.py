"""A golden run: what it does (:class:`GoldenPlan`), the one step x layer driver (:func:`drive`)
that both making a golden (:func:`run_golden`, :func:`write_golden`) and checking one
(:func:`replay`) run the stack through.

Step 0 is the prefill (``prefill`` tokens at start_pos 0); step s >= 1 the decode of the token
at position ``prefill + s - 1``. Within a step the layers run in increasing order.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np

from ..config import AttnConfig
from ..stack import AttentionStack, weight_specs
from .captures import (CAPTURE_MODES, WEIGHT_NAME, StepObserver, forward_capture,
                       layer_captures, storage_kind, to_storage)
from .compare import CompareReport, Judge, TensorResult, compare_order, file_scores
from .errors import GoldenError
from .files import GoldenFile, RunInfo, check_target, write_tensors_atomic
from .generator import checked_profile, checked_seed, make_input, make_weights

__all__ = ["GoldenPlan", "missing_sources", "golden_steps", "drive", "run_golden",
           "write_golden", "minimum_bytes", "replay"]


def missing_sources(config: AttnConfig, layers) -> list[str]:
    """One message per source a member of ``layers`` reads but that is not a member
    (:meth:`AttnConfig.missing_sources`)."""
    return list(dict.fromkeys(f"layer {i} needs layer {src} (its {role})"
                              for i, src, role in config.missing_sources(layers)))


@dataclass(frozen=True)
class GoldenPlan:
    """What a golden run does: the stack, which of its layers, how long, which seed, what to keep."""

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    seed: int = 0
    capture: str = "all"
    preset: str = ""
    profile: str = "default"
    capture_rows: tuple[int, ...] = ()     # positions whose kernel inputs and outputs are sampled

    def __post_init__(self):
        c = self.config
        for name in ("prefill", "decode"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise GoldenError(f"--{name} must be an integer, got {v!r}")
        if self.prefill < 1:
            raise GoldenError(f"--prefill must be at least 1, got {self.prefill}")
        if self.decode < 0:
            raise GoldenError(f"--decode must be at least 0, got {self.decode}")
        if self.prefill + self.decode > c.max_seq_len:
            raise GoldenError(f"--prefill {self.prefill} + --decode {self.decode} tokens exceed the "
                              f"config's max_seq_len {c.max_seq_len}")
        checked_seed(self.seed)
        checked_profile(self.profile)
        rows = tuple(sorted({int(p) for p in self.capture_rows}))
        total = self.prefill + self.decode
        if rows and not 0 <= rows[0] <= rows[-1] < total:
            raise GoldenError(f"--capture-rows: positions must lie in 0..{total - 1} (the run's "
                              f"tokens), got {rows[0] if rows[0] < 0 else rows[-1]}")
        object.__setattr__(self, "capture_rows", rows)
        if self.capture not in CAPTURE_MODES:
            raise GoldenError(f"--capture must be one of {', '.join(CAPTURE_MODES)}, got {self.capture!r}")
        if not self.layers:
            raise GoldenError("--layers selects no layer")
        for i in self.layers:
            if not 0 <= i < c.n_layers:
                raise GoldenError(f"--layers: layer {i} is not a layer of this config (0..{c.n_layers - 1})")
        object.__setattr__(self, "layers", tuple(sorted(set(int(i) for i in self.layers))))
        missing = missing_sources(c, self.layers)
        if missing:
            raise GoldenError(f"--layers: {missing[0]}, which is not in the selection"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def steps(self):
        """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
        return golden_steps(self.prefill, self.decode)

    @property
    def total_tokens(self) -> int:
        """Token-layers the run processes (the progress bar's unit)."""
        return (self.prefill + self.decode) * len(self.layers)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata (str -> str) that makes the file self-describing."""
        return RunInfo(self.config, self.layers, self.prefill, self.decode, self.capture,
                       self.seed, self.preset, self.profile, self.capture_rows).metadata()


def golden_steps(prefill: int, decode: int):
    """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
    yield 0, 0, prefill
    for s in range(1, decode + 1):
        yield s, prefill + s - 1, 1


def drive(stack: AttentionStack, prefill: int, decode: int, capture: str, x_of, take,
          progress=None, capture_rows=()):
    """The step x layer loop of a golden run: every step of :func:`golden_steps`, the stack's
    layers in increasing order within each.

    ``x_of(name, seqlen, start_pos)`` gives the input ``step{s}.layers.{i}.x`` to feed (``name``);
    ``take(prefix, captures)`` receives the layer's :func:`layer_captures` under their prefix
    ``step{s}.layers.{i}.`` (views of the stack's live state: convert or compare them before
    returning; nothing holds them after). ``progress(n, where)``, if given, is called before
    each forward with ``n = 0`` and after it with the tokens it processed; ``where`` says which
    step and layer (a long prefill is one forward, so this is all a progress bar can show).
    The index scores and the samples of the positions ``capture_rows`` are collected by a
    :class:`StepObserver` set on the stack's shared runtime for the run.
    """
    observer = StepObserver(stack.config, capture_rows)
    stack.shared.observer = observer
    try:
        for s, start_pos, seqlen in golden_steps(prefill, decode):
            for i in stack.layers:
                prefix = f"step{s}.layers.{i}."
                where = f"step {s} layer {i}"
                if progress is not None:
                    progress(0, where)
                observer.begin(i, start_pos, seqlen)
                run = stack.forward(i, x_of(prefix + "x", seqlen, start_pos), start_pos,
                                    capture=forward_capture(capture))
                take(prefix, layer_captures(stack, i, run, start_pos, capture, observer))
                del run
                if progress is not None:
                    progress(seqlen, where)
    finally:
        stack.shared.observer = None


def run_golden(plan: GoldenPlan, progress=None) -> dict[str, np.ndarray]:
    """Run ``plan`` and return every tensor of its file, already in the storage dtypes.

    Captures are converted (copied) to their storage dtype as soon as a layer's step returns,
    so memory holds the file's tensors plus the stack's working set, never per-step f32 copies.
    ``progress`` as in :func:`drive`.
    """
    cfg = plan.config
    weights = make_weights(cfg, plan.layers, plan.seed, plan.profile)
    kinds = {n: k for i in plan.layers for n, (_, k) in weight_specs(cfg, i).items()}
    stack = AttentionStack(cfg, weights, layers=plan.layers)
    tensors: dict[str, np.ndarray] = {}

    def stored_input(name, seqlen, start_pos):
        # The stack takes the stored bfloat16 copy: half the memory of float32.
        x = make_input(name, (seqlen, cfg.dim), plan.seed, plan.profile, start_pos)
        tensors[name] = to_storage(name, x, "BF16")
        return tensors[name]

    def store(prefix, captures):
        for what, value in captures.items():
            tensors[prefix + what] = to_storage(prefix + what, value, storage_kind(prefix + what))

    drive(stack, plan.prefill, plan.decode, plan.capture, stored_input, store, progress,
          plan.capture_rows)
    del stack
    # Weights last: the stack shared the float32 arrays, now they can go one by one.
    stored = {}
    for name in list(weights):
        stored[name] = to_storage(name, weights.pop(name), storage_kind(name, kinds))
    stored.update(tensors)
    return stored


def write_golden(plan: GoldenPlan, path, force: bool = False, progress=None) -> dict:
    """Run ``plan`` and write its golden to ``path`` atomically; returns a summary for printing."""
    path = os.fspath(path)
    check_target(path, force)
    _check_memory(plan)
    t0 = time.perf_counter()
    tensors = run_golden(plan, progress)
    write_tensors_atomic(path, tensors, plan.metadata(), force)
    return {"path": os.path.abspath(path), "tensors": len(tensors),
            "bytes": os.path.getsize(path), "seconds": time.perf_counter() - t0}


def minimum_bytes(plan: GoldenPlan) -> int:
    """A lower bound on the memory a run needs: float32 weights plus the stored x and out."""
    weights = sum(math.prod(shape) for i in plan.layers
                  for shape, _ in weight_specs(plan.config, i).values())
    tokens = (plan.prefill + plan.decode) * len(plan.layers)
    return 4 * weights + 2 * 2 * tokens * plan.config.dim


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(plan: GoldenPlan):
    """Refuse up front a run that cannot fit (e.g. all 43 v41-flash layers), not hours later."""
    need, have = minimum_bytes(plan), _available_bytes()
    if have is not None and need > have:
        raise GoldenError(f"this run needs at least {need / 2**30:.1f} GiB (weights of "
                          f"{len(plan.layers)} layers, inputs, outputs) but {have / 2**30:.1f} GiB "
                          f"is available; select fewer layers (e.g. --layers 20 for v41-flash)")


def replay(path, progress=None, index_tolerance: float | None = None,
           exact_index: bool = False) -> CompareReport:
    """Recompute every capture of a golden from its own weights and inputs and compare, by the
    rules of :func:`compare_files` (tie-aware index rows unless ``exact_index``), except that
    the recorded scores must agree too (in rows whose selection is identical).

    Works on this tool's safetensors goldens and on the reference's ``.npz`` goldens (whose
    captures are then checked against ds41numba). ``progress(n, where)`` as in :func:`drive`.
    """
    with GoldenFile(path) as golden:
        info = golden.run_info()
        cfg = info.config
        names = set(golden.names)
        weights = {}
        for i in info.layers:
            for name in weight_specs(cfg, i):
                if name not in names:
                    raise GoldenError(f"{golden.path!r}: weight {name} is missing")
                weights[name] = np.asarray(golden.get(name), dtype=np.float32)
        try:
            stack = AttentionStack(cfg, weights, layers=info.layers)
        except ValueError as e:
            raise GoldenError(f"{golden.path!r}: {e}") from None
        judge = Judge(info, file_scores(golden), index_tolerance, exact_index, strict_evidence=True)
        report = CompareReport(golden.path, "replay", index_rule=judge.rule)
        recomputed = set()

        def recorded_input(name, seqlen, start_pos):
            if name not in names:
                raise GoldenError(f"{golden.path!r}: input {name} is missing")
            recomputed.add(name)
            return np.asarray(golden.get(name), dtype=np.float32)

        def compare(prefix, captures):
            for what in sorted(captures, key=lambda w: compare_order(prefix + w)):
                name = prefix + what
                recomputed.add(name)
                if name in names:
                    report.add(judge.compare(name, golden.get(name), captures[what], golden))

        drive(stack, info.prefill, info.decode, info.capture, recorded_input, compare, progress,
              info.capture_rows)
        for name in golden.names:
            if name not in recomputed and not WEIGHT_NAME.fullmatch(name):
                report.add(TensorResult(name, "only-golden", ok=False,
                                        detail="in the file but not produced by the replay"))
    return report
