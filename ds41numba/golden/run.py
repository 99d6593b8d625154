"""A golden run: what it does (:class:`GoldenPlan`), making a golden (:func:`run_golden`,
:func:`write_golden`, streamed: :func:`stream_golden`) and checking one (:func:`replay`), all
through the one step x layer driver (:mod:`.drive`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ..batched import BatchedStack
from ..config import AttnConfig
from ..stack import AttentionStack, held_weight_bytes, weight_specs
from .captures import (CAPTURE_MODES, RUNNERS_UP, STREAMED_MODES, WEIGHT_NAME,
                       cache_layout, records_shared, storage_kind, to_storage)
from .compare import CompareReport, Judge, TensorResult, compare_order, file_scores
from .checkpoint import CHECKPOINT_EVERY, Checkpoint, run_identity
from .errors import DiskError, GoldenError, RunInterrupted
from .files import (BatchRowFile, GoldenFile, RunInfo, StreamingGolden, check_target,
                    write_tensors_atomic)
from .drive import (drive, drive_piece, golden_steps, piece_name, prefill_chunks, query_tiles,
                    run_pieces, step_observers)
from .rows import PER_ROW, checked_rows
from .work import total_work, work_units
from .generator import (GeneratedWeights, LazyWeights, batch_input_name, checked_profile,
                        checked_seed, make_input, make_weights)
from .weights_dir import WeightsDir

__all__ = ["GoldenPlan", "missing_sources", "closed_selection", "golden_steps", "prefill_chunks",
           "run_pieces", "drive",
           "drive_piece", "run_golden", "write_golden", "stream_golden", "io_layout",
           "check_cluster_capture", "query_tiles",
           "DEFAULT_CHUNK", "minimum_bytes", "replay", "replay_weights", "StoredWeights",
           "make_stack"]


def missing_sources(config: AttnConfig, layers) -> list[str]:
    """One message per source a member of ``layers`` reads but that is not a member
    (:meth:`AttnConfig.missing_sources`)."""
    return list(dict.fromkeys(f"layer {i} needs layer {src} (its {role})"
                              for i, src, role in config.missing_sources(layers)))


def closed_selection(config: AttnConfig, layers) -> tuple[tuple[int, ...], dict[int, list[str]]]:
    """The smallest selection holding ``layers`` and every source its members read, theirs
    included (what ``--layers`` must name for ``layers`` to run), and why each added layer is
    needed: ``{source: ["layer 5's kv source", ...]}``."""
    closed, why = set(layers), {}
    while missing := config.missing_sources(closed):
        for i, src, role in missing:
            why.setdefault(src, []).append(f"layer {i}'s {role}")
        closed |= {src for _, src, _ in missing}
    return tuple(sorted(closed)), why


@dataclass(frozen=True)
class GoldenPlan:
    """What a golden run does: the stack, which of its layers, how long, which seed, what to keep.

    Weights and inputs are the generator's (``seed``, ``profile``) unless given: ``weights`` a
    :class:`~.weights_dir.WeightsDir` (``--weights DIR``) or any mapping of parameter name ->
    array (bf16 values where the parameter is bf16); ``inputs`` an
    :class:`~.inputs_file.InputsFile` (``--inputs FILE``). ``store_weights=False``
    (``--no-weights``, a checkpoint directory's weights only) leaves the weights out of the
    file, which then records their checksums for ``replay --weights DIR``.
    """

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    seed: int = 0
    capture: str = "all"
    preset: str = ""
    profile: str = "default"
    capture_rows: tuple[int, ...] = ()     # positions whose kernel inputs and outputs are sampled
    weights: object = field(default=None, compare=False, repr=False)
    inputs: object = field(default=None, compare=False, repr=False)
    store_weights: bool = True
    batch: int = 1                         # sequences in lockstep (docs/batches.md)
    rows: tuple[int, ...] | None = None    # the prefill rows answered (None: every one)

    def __post_init__(self):
        c = self.config
        if isinstance(self.batch, bool) or not isinstance(self.batch, (int, np.integer)) \
                or self.batch < 1:
            raise GoldenError(f"--batch must be an integer >= 1, got {self.batch!r}")
        object.__setattr__(self, "batch", int(self.batch))
        if self.inputs is not None and getattr(self.inputs, "batch", 1) != self.batch:
            raise GoldenError(f"--inputs: the file was opened for a batch of {self.inputs.batch}, "
                              f"the run has --batch {self.batch}")
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
        if self.rows is not None:
            if self.batch != 1:
                raise GoldenError("--rows: a batch (--batch > 1) answers every prefill row; "
                                  "run --rows without --batch")
            object.__setattr__(self, "rows", checked_rows(self.rows, self.prefill, self.capture,
                                                          self.capture_rows))
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
            closed, why = closed_selection(c, self.layers)
            lacking = "; ".join(f"layer {src} ({', '.join(dict.fromkeys(w))})"
                                for src, w in sorted(why.items()))
            raise GoldenError(f"--layers: the selection lacks {lacking}; every source is needed, "
                              f"e.g. --layers {','.join(map(str, closed))}")
        self._check_sources()

    def _check_sources(self):
        """The given weights and inputs cover the run; only a checkpoint's weights may be left
        out of the file (they are found again by their checksums)."""
        if not self.store_weights and not isinstance(self.weights, WeightsDir):
            raise GoldenError("--no-weights: only a golden made from a checkpoint directory "
                              "(--weights DIR) may leave its weights out")
        if self.weights is not None:
            names = [n for i in self.layers for n in weight_specs(self.config, i)]
            absent = [n for n in names if n not in self.weights]
            if absent:
                raise GoldenError(f"weights: {absent[0]} is missing"
                                  + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
        if self.inputs is not None:
            absent = [i for i in self.layers if i not in self.inputs.sources]
            if absent or self.inputs.tokens < self.prefill + self.decode:
                raise GoldenError("--inputs: opened for other layers or fewer tokens than the run")

    def weight_mapping(self, made=None):
        """The run's weights as the mapping the stack takes; ``made(name, array, kind)``, if
        given, sees each as the stack takes it (a streamed golden writes it then)."""
        if self.weights is None:
            return GeneratedWeights(self.config, self.layers, self.seed, self.profile, made=made)
        if isinstance(self.weights, WeightsDir):
            return self.weights.with_made(made)
        return _GivenWeights(self.weights, self.config, self.layers, made)

    def input_rows(self, name: str, first_row: int, rows: int, start_pos: int,
                   batch_row: int = 0) -> np.ndarray:
        """Rows ``first_row ..`` of input ``name`` (``step{s}.layers.{i}.x``, its step starting
        at ``start_pos``) of the batch's sequence ``batch_row``, as the file stores them:
        bfloat16."""
        if self.inputs is not None:
            return self.inputs.rows(name, first_row, rows, start_pos, batch_row)
        x = make_input(batch_input_name(name, batch_row), (rows, self.config.dim), self.seed,
                       self.profile, first_row, start_pos)
        return to_storage(name, x, "BF16")

    def steps(self):
        """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
        return golden_steps(self.prefill, self.decode)

    @property
    def total_tokens(self) -> int:
        """Token-layers the run processes (the progress bar's unit), every sequence's."""
        return (self.prefill + self.decode) * len(self.layers) * self.batch

    @property
    def total_work(self) -> float:
        """The run's work in the progress bar's unit (:func:`total_work`)."""
        return (total_work(self.config, self.layers, self.prefill, self.decode, self.rows)
                * self.batch)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata (str -> str) that makes the file self-describing."""
        return RunInfo(self.config, self.layers, self.prefill, self.decode, self.capture,
                       self.seed, self.preset, self.profile, self.capture_rows,
                       self._weights_provenance(),
                       None if self.inputs is None else self.inputs.provenance(),
                       batch=self.batch, rows=self.rows).metadata()

    def _weights_provenance(self) -> dict | None:
        if self.weights is None:
            return None
        if isinstance(self.weights, WeightsDir):
            return self.weights.provenance(self.store_weights)
        return {"source": "given to the Python API", "stored": True}


class _GivenWeights(LazyWeights):
    """A mapping of weights given to a plan, calling ``made`` as the stack takes each."""

    def __init__(self, weights, config, layers, made):
        self.weights, self.made = weights, made
        self.specs = {n: v for i in layers for n, v in weight_specs(config, i).items()}

    def make(self, name: str, shape, kind: str):
        return self.weights[name]


def make_stack(config: AttnConfig, weights, layers, batch: int = 1):
    """The stack a run of ``batch`` sequences drives: an :class:`AttentionStack` for one (the
    single-sequence run, unchanged), a :class:`BatchedStack` for more."""
    if batch == 1:
        return AttentionStack(config, weights, layers=layers)
    return BatchedStack(config, weights, batch, layers=layers)


def run_golden(plan: GoldenPlan, progress=None) -> dict[str, np.ndarray]:
    """Run ``plan`` and return every tensor of its file, already in the storage dtypes.

    Captures are converted (copied) to their storage dtype as soon as a layer's step returns,
    so memory holds the file's tensors plus the stack's working set, never per-step f32 copies.
    ``progress`` as in :func:`drive`.
    """
    cfg = plan.config
    weights = (make_weights(cfg, plan.layers, plan.seed, plan.profile) if plan.weights is None
               else plan.weight_mapping())
    kinds = {n: k for i in plan.layers for n, (_, k) in weight_specs(cfg, i).items()}
    stack = make_stack(cfg, weights, plan.layers, plan.batch)
    rows: dict[str, list] = {}      # name -> its tensor of each batch row
    tensors: dict[str, np.ndarray] = {}

    def stored_input(name, first_row, seqlen, start_pos, batch_row=0):
        # The stack takes the stored bfloat16 copy: half the memory of float32.
        rows.setdefault(name, []).append(plan.input_rows(name, first_row, seqlen, start_pos,
                                                         batch_row))
        return rows[name][-1]

    def store(prefix, captures, first_row, batch_row=0):
        for what, value in captures.items():
            rows.setdefault(prefix + what, []).append(
                to_storage(prefix + what, value, storage_kind(prefix + what)))

    drive(stack, plan.prefill, plan.decode, plan.capture, stored_input, store, progress,
          plan.capture_rows)
    del stack
    for name in list(rows):         # a batch's tensors: the batch axis first (docs/batches.md)
        got = rows.pop(name)
        tensors[name] = got[-1] if plan.batch == 1 else np.stack(got)
    # Weights last: the stack shared the float32 arrays, now they can go one by one (given
    # weights are asked for again).
    stored = {}
    for name in (kinds if plan.store_weights else ()):
        w = weights.pop(name) if isinstance(weights, dict) else weights[name]
        stored[name] = to_storage(name, w, storage_kind(name, kinds))
    stored.update(tensors)
    return stored


#: Prefill rows a streamed golden runs at a time (``--chunk``): products of this many rows run
#: at full speed, and a chunk's working set stays a few hundred MB at production shapes.
DEFAULT_CHUNK = 4096


def write_golden(plan: GoldenPlan, path, force: bool = False, progress=None,
                 chunk: int | None = DEFAULT_CHUNK, resume: bool = False,
                 checkpoint_every: float = CHECKPOINT_EVERY, cluster=None) -> dict:
    """Run ``plan`` and write its golden to ``path`` atomically; returns a summary for printing.

    With ``capture="io"`` or ``"caches"`` the file is streamed (:func:`stream_golden`): the
    prefill runs in chunks of ``chunk`` rows and each chunk's rows go into place as they are
    made, with checkpoints every ``checkpoint_every`` seconds that ``resume`` continues from.
    ``all`` holds ``[seqlen, positions]`` captures per step and runs in memory, the prefill in
    one call. ``cluster`` (a :class:`~.cluster.Cluster`, streamed only) runs the prefill's
    queries on its workers, tile by tile; the file is the same. A plan of some ``rows`` runs
    the same drive with its tiles in this process when no cluster is given
    (:class:`~.cluster.InProcess`).

    Args:
        plan: the run (:class:`GoldenPlan`: config, layers, prefill, decode, seed, capture).
        path: the file to write; it appears under this name only when complete.
        force: replace an existing file (without ``resume``: also discard an earlier run's
            partial file and checkpoint).
        progress: ``progress(n, where)``, called before (``n == 0``) and after each forward.
        chunk: prefill rows per forward for a streamed run (the file is the same for any).
        resume: continue a streamed run from its checkpoint.
        checkpoint_every: seconds of work between checkpoints (0: at every piece).
        cluster: a Dask cluster for the prefill's query tiles, or None.

    Returns:
        ``{"path", "tensors", "bytes", "seconds"}`` of the written file.

    Raises:
        GoldenError: the target exists without ``force``, a partial run is in the way, nothing
            to resume, the run would not fit in memory, or the disk fails (one line each).
        RunInterrupted: a streamed run stopped by Ctrl-C or SIGTERM after a checkpoint (its
            partial file and checkpoint are kept for ``resume``).

    Example:
        >>> plan = GoldenPlan(config=preset("tiny"), layers=tuple(range(6)), prefill=12,
        ...                   decode=40, seed=0, capture="all")
        >>> write_golden(plan, "tiny.safetensors")["tensors"]
        2850
    """
    path = os.fspath(path)
    if cluster is not None:
        check_cluster_capture(plan.capture, plan.batch)
    if resume and plan.capture not in STREAMED_MODES:
        raise GoldenError("--resume: only a streamed run (--capture io or caches) keeps a "
                          "checkpoint to resume from")
    check_target(path, force)
    _check_memory(plan, chunk)
    t0 = time.perf_counter()
    if plan.rows is not None and cluster is None:
        from .cluster import InProcess      # the cluster's drive, its tiles run here
        cluster = InProcess()
    if plan.capture in STREAMED_MODES:
        n = stream_golden(plan, path, force, progress, chunk, resume, checkpoint_every, cluster)
    else:
        tensors = run_golden(plan, progress)
        n = len(tensors)
        write_tensors_atomic(path, tensors, plan.metadata(), force)
    return {"path": os.path.abspath(path), "tensors": n,
            "bytes": os.path.getsize(path), "seconds": time.perf_counter() - t0}


def check_cluster_capture(capture: str, batch: int = 1) -> None:
    """A cluster runs streamed (``io``, ``caches``) goldens of one sequence only: refuse any
    other before a cluster starts (a batch's query tiles would need each sequence's caches on
    the workers, which the cluster's broadcast does not carry)."""
    if capture not in STREAMED_MODES:
        raise GoldenError("--workers/--scheduler: only a streamed run (--capture io or caches) "
                          "runs on a cluster")
    if batch != 1:
        raise GoldenError("--workers/--scheduler: a batch (--batch > 1) runs in one process; "
                          "run it without --workers")


def _topk_width(config: AttnConfig, j: int, prefill: int, start_pos: int, seqlen: int) -> int:
    """Columns of index source j's selection at a step (0 when it sees no compressed position)."""
    r = config.ratio(j)
    width = (prefill if start_pos == 0 else start_pos + seqlen) // r
    return min(config.index_topk, width)


def io_layout(plan: GoldenPlan):
    """Every tensor of the plan's ``io`` golden, ``[(name, dtype, shape)]`` in file order, and
    ``{name: source}`` for the tensors that repeat another's values: the selection a layer of
    the first decode step finds before any index source of that step ran is the prefill's last
    (all its rows), which the stream copies from the file instead of holding.

    Besides ``out``, ``idx`` and ``shared.topk_idxs``: at every index source the scores behind
    its selection (``topk_scores``, ``runner_idxs``, ``runner_scores``) and, for a step holding
    ``capture_rows`` positions, the ``sample.*`` captures (their rows are few: the drive hands
    them over from memory once the step's last chunk ran). A batch (``plan.batch`` > 1) puts a
    leading batch axis on every tensor but the weights (docs/batches.md).

    A ``rows`` plan holds of the prefill only its answered rows (``step0.layers.{i}.rows``, their
    positions, then each per-row tensor with those rows, in that order); the first decode step's
    copies of the prefill's whole selection are left out (``{name: None}``). ``caches`` adds,
    after each layer's prefill tensors, its :func:`~.captures.cache_captures`."""
    if plan.capture not in STREAMED_MODES:
        raise ValueError("io_layout: only a streamed golden is laid out up front")
    c = plan.config
    layout, copies = [], {}
    for i in (plan.layers if plan.store_weights else ()):
        for name, (shape, kind) in weight_specs(c, i).items():
            layout.append((name, "F32" if kind == "f32" else "BF16", shape))
    index_sources = [j for j in plan.layers if c.ratio(j) and c.is_index_source(j)]
    samples = np.asarray(plan.capture_rows, np.int64)
    slot = None                                  # (step, index source) the selection slot holds
    for s, start_pos, seqlen in plan.steps():
        nwin = min(plan.prefill, c.window_size) if s == 0 else c.window_size
        end = start_pos + seqlen
        ns = int(((samples >= start_pos) & (samples < end)).sum())
        held = seqlen if s or plan.rows is None else len(plan.rows)   # the rows the file holds
        for i in plan.layers:
            pre = f"step{s}.layers.{i}."
            r = c.ratio(i)
            if i in index_sources:
                slot = (s, i)
            if s == 0 and plan.rows is not None:
                layout.append((pre + "rows", "I32", (held,)))
            layout.append((pre + "x", "BF16", (held, c.dim)))
            layout.append((pre + "out", "BF16", (held, c.dim)))
            ncomp = 0
            if r:
                ncomp = _topk_width(c, slot[1], plan.prefill, start_pos, seqlen)
            layout.append((pre + "idx", "I32", (held, nwin + ncomp)))
            if records_shared(c, i) and slot is not None:
                ss, j = slot
                rows = plan.prefill if ss == 0 else 1
                sp = 0 if ss == 0 else plan.prefill + ss - 1
                if ss != s and ss == 0 and plan.rows is not None:
                    copies[pre + "shared.topk_idxs"] = None
                else:
                    layout.append((pre + "shared.topk_idxs", "I32",
                                   (held if ss == s else rows,
                                    _topk_width(c, j, plan.prefill, sp, rows))))
                if ss != s and ss == 0 and plan.rows is None:
                    copies[pre + "shared.topk_idxs"] = f"step0.layers.{j}.shared.topk_idxs"
            if i in index_sources:
                k = _topk_width(c, i, plan.prefill, start_pos, seqlen)
                layout += [(pre + "topk_scores", "BF16", (held, k)),
                           (pre + "runner_idxs", "I32", (held, RUNNERS_UP)),
                           (pre + "runner_scores", "BF16", (held, RUNNERS_UP))]
            if ns:
                hd, H = c.head_dim, c.n_heads
                scored = i in index_sources and end // r > 0
                width = end // r if r else 0
                layout += [(pre + "sample.rows", "I32", (ns,)), (pre + "sample.q", "BF16", (ns, H, hd)),
                           (pre + "sample.kv", "BF16", (ns, nwin + ncomp, hd)),
                           (pre + "sample.o", "BF16", (ns, H, hd))]
                if scored:
                    ih, idim = c.index_n_heads, c.index_head_dim
                    layout += [(pre + "sample.index_score", "BF16", (ns, width)),
                               (pre + "sample.index_q", "BF16", (ns, ih, idim)),
                               (pre + "sample.index_weights", "BF16", (ns, ih)),
                               (pre + "sample.index_k", "BF16", (width, idim))]
                if r:
                    layout.append((pre + "sample.compress_kv", "BF16", (width, hd)))
            if s == 0 and plan.capture == "caches":
                layout += cache_layout(c, i, plan.prefill)
    for n, kind, _ in layout:
        if not WEIGHT_NAME.fullmatch(n):
            assert kind == storage_kind(n), n
    if plan.batch > 1:     # every tensor but the weights: a leading batch axis, two row axes
        layout = [e if WEIGHT_NAME.fullmatch(e[0]) else (e[0], e[1], (plan.batch,) + tuple(e[2]), 2)
                  for e in layout]
    return layout, copies


def stream_golden(plan: GoldenPlan, path, force: bool = False, progress=None,
                  chunk: int | None = DEFAULT_CHUNK, resume: bool = False,
                  checkpoint_every: float = CHECKPOINT_EVERY, cluster=None) -> int:
    """Run an ``io`` plan and stream its golden to ``path``: the file is laid out up front
    (:func:`io_layout`, :class:`StreamingGolden`), the prefill runs ``chunk`` rows at a time
    through every layer, and each chunk's inputs (made a chunk at a time by the generator),
    outputs and index rows are written into place as they are made; no ``[seqlen, dim]``
    tensor is ever held, nor a dict of every weight (:class:`GeneratedWeights` makes each as
    the stack takes it, and it goes to the file then). The file is byte-identical whatever
    ``chunk`` or thread count, and tensor for tensor what :func:`run_golden` computes. Returns
    the number of tensors.

    The run is resumable (:mod:`.checkpoint`): it fills ``.NAME.partial`` and checkpoints into
    ``.NAME.ckpt/`` before its first piece and then between pieces (chunks, decode steps) once
    ``checkpoint_every`` seconds passed since the last. Ctrl-C or SIGTERM after a checkpoint
    keep both and raise :class:`RunInterrupted`; an OS error is a :class:`DiskError` that says
    whether the checkpoint was kept. ``resume`` continues from the checkpoint (same plan and
    ``chunk``, else refused); without it an earlier run's leftovers are refused, or discarded
    with ``force`` (with ``resume``, ``force`` lets the finished file replace an existing one).

    ``cluster`` (:class:`~.cluster.Cluster`) runs the prefill's query tiles on its workers
    (:meth:`~.cluster.Cluster.drive`); its checkpoints resume on any cluster, not in one process.
    """
    layout, copies = io_layout(plan)
    schedule = None if cluster is None else cluster.schedule
    ckpt = Checkpoint(path, run_identity(plan.metadata(), chunk, schedule), resume, force,
                      checkpoint_every)
    try:
        with StreamingGolden(path, layout, plan.metadata(), force, partial=ckpt.partial,
                             rows_written=ckpt.rows_written()) as out:
            out.keep = ckpt.saved
            try:
                _stream(plan, out, ckpt, copies, progress, chunk, cluster)
            finally:
                out.keep = ckpt.saved
            out.commit()
    except BaseException as e:
        if not ckpt.saved:
            ckpt.remove()                # the writer removed the partial file already
        if isinstance(e, DiskError):
            raise e.with_hint(_kept(ckpt, "free space (or fix the directory), then ")) from None
        if isinstance(e, (KeyboardInterrupt, SystemExit)) and ckpt.saved:
            status = 130 if isinstance(e, KeyboardInterrupt) else e.code
            raise RunInterrupted(f"{'interrupted' if status == 130 else 'terminated'}; "
                                 f"{_kept(ckpt, '')}", status) from None
        raise
    ckpt.remove()
    return len(layout)


def _kept(ckpt: Checkpoint, first: str) -> str:
    """What is left for ``--resume`` after a run stopped, for its message (``first``: what to
    do before resuming)."""
    if not (ckpt.saved and os.path.exists(ckpt.partial) and os.path.isdir(ckpt.dir)):
        return "nothing was kept to resume from"
    return (f"kept {ckpt.partial!r} and its checkpoint ({ckpt.where} done): {first}rerun the "
            f"same command with --resume to continue")


def _stream(plan: GoldenPlan, out: StreamingGolden, ckpt: Checkpoint, copies, progress, chunk,
            cluster=None):
    """The body of :func:`stream_golden`: the stack (its weights written as they are made),
    the checkpoint restored or a first one taken, the drive with checkpoints between pieces
    (or, on a ``cluster``, :meth:`~.cluster.Cluster.drive`)."""
    cfg = plan.config

    def put_weight(name, array, kind):
        if name in out.entries and out.missing_rows(name):   # a resumed run's file has them
            bf16 = kind == "bf16" and array.dtype.name == "bfloat16"
            out.write_rows(name, 0, array if bf16 else
                           to_storage(name, array, "F32" if kind == "f32" else "BF16"))

    stack = make_stack(cfg, plan.weight_mapping(made=put_weight), plan.layers, plan.batch)
    observer = ckpt.restore(stack)
    pieces = run_pieces(plan.prefill, plan.decode, chunk)
    split = len(pieces) - plan.decode > 1
    if ckpt.saved and progress is not None and cluster is None:
        progress(sum(work_units(cfg, i, p + a, n, prefill=s == 0) for s, p, a, n in
                     pieces[:ckpt.done] for i in plan.layers) * plan.batch, "resumed")

    def boundary(done, observer):
        if done < len(pieces) and (done == 0 or ckpt.due()):
            ckpt.save(done, piece_name(pieces[done - 1], split) if done else "nothing",
                      stack, observer, out)
            out.keep = True

    batched = plan.batch > 1
    answered = None if plan.rows is None else np.asarray(plan.rows, np.int64)

    def row_of(name, first_row, batch_row):
        # A batch's tensor [B, seqlen, ...] takes sequence b's rows at b * seqlen + first_row.
        return batch_row * out.shape(name)[1] + first_row if batched else first_row

    def streamed_input(name, first_row, rows, start_pos, batch_row=0):
        x = plan.input_rows(name, first_row, rows, start_pos, batch_row)
        if answered is None or start_pos:
            out.write_rows(name, row_of(name, first_row, batch_row), x)
        else:                              # the answered rows of a prefill chunk, in their place
            lo, hi = np.searchsorted(answered, (first_row, first_row + rows))
            if hi > lo:
                out.write_rows(name, int(lo), x[answered[lo:hi] - first_row])
            if first_row == 0:
                out.write_rows(name[:-len("x")] + "rows", 0, answered.astype(np.int32))
        return x

    def write(prefix, captures, first_row, batch_row=0):
        for what, value in captures.items():
            name = prefix + what
            if name in copies and copies[name] is None:
                continue                   # a rows golden leaves the copy out
            if name in copies and value.shape[0] != out.shape(name)[int(batched)]:
                if out.missing_rows(name):
                    out.copy_tensor(copies[name], name)
            else:
                out.write_rows(name, row_of(name, first_row, batch_row),
                               to_storage(name, value, storage_kind(name)))

    if not ckpt.saved:
        observer = step_observers(stack, plan.capture_rows)
        observer = observer if batched else observer[0]
    if cluster is not None:
        cluster.drive(plan, stack, ckpt, out, streamed_input, write, progress, chunk, observer)
    else:
        if not ckpt.saved:
            boundary(0, observer)
        drive(stack, plan.prefill, plan.decode, plan.capture, streamed_input, write, progress,
              plan.capture_rows, chunk=chunk, observer=observer, start=ckpt.done,
              boundary=boundary)
    for name, source in copies.items():     # a selection no layer of the step replaced
        if source is not None and out.missing_rows(name):
            out.copy_tensor(source, name)


def minimum_bytes(plan: GoldenPlan, chunk: int | None = DEFAULT_CHUNK) -> int:
    """An estimate of a run's peak memory: the weights as the stack holds them
    (:func:`~ds41numba.stack.held_weight_bytes`: 2 bytes a bf16 parameter) plus the one f32
    weight being made or widened at a time, the caches the run fills, the tensors it keeps (an
    ``io`` golden streams them; ``all`` holds every step's, and its f32 weights), and the
    working set of a prefill chunk (``chunk`` rows; ``all`` runs the prefill in one)."""
    c = plan.config
    shapes = [shape for i in plan.layers for shape, _ in weight_specs(c, i).values()]
    params = sum(math.prod(s) for s in shapes)
    weights = held_weight_bytes(c, plan.layers) + 4 * max(math.prod(s) for s in shapes)
    tokens = plan.prefill + plan.decode
    caches = 0
    for i in plan.layers * plan.batch:         # every sequence of a batch has its own
        caches += 2 * c.window_size * c.head_dim * 4
        if c.is_kv_source(i):
            rows = tokens // c.ratio(i)
            caches += rows * c.head_dim * 4
            if c.is_index_source(i):
                caches += rows * c.index_head_dim * 6      # f32 keys and the scorer's layout
    streamed = plan.capture in STREAMED_MODES
    kept = 0 if streamed else 2 * 2 * tokens * len(plan.layers) * c.dim * plan.batch + 4 * params
    rows = plan.prefill if not streamed or chunk is None else min(plan.prefill, chunk)
    tile = min(rows, 1024)
    working = (rows * (8 * c.dim + 4 * c.q_lora_rank + 4 * (c.window_size + c.index_topk))
               + tile * (3 * c.n_heads * c.head_dim * 4 + c.o_groups * c.o_lora_rank * 4)
               + (1 << 26) * 2)
    return weights + caches + kept + working


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(plan: GoldenPlan, chunk: int | None = DEFAULT_CHUNK):
    """Refuse up front a run that cannot fit (e.g. all 43 v41-flash layers), not hours later."""
    need, have = minimum_bytes(plan, chunk), _available_bytes()
    if have is not None and need > have:
        raise GoldenError(f"this run needs about {need / 2**30:.1f} GiB (weights of "
                          f"{len(plan.layers)} layers, caches, working set) but {have / 2**30:.1f} GiB "
                          f"is available; select fewer layers (e.g. --layers 20 for v41-flash)")


class StoredWeights:
    """A golden's weights as a mapping that reads each one from the file when asked for it, so
    a replay holds them only in the stack's forms, never a dict of every float32 weight. A
    weight the stack asks for and the file lacks is the file's fault: a GoldenError."""

    def __init__(self, golden: GoldenFile):
        self.golden = golden

    def __contains__(self, name) -> bool:
        return name in self.golden

    def get(self, name: str, default=None):
        if name not in self.golden:
            raise GoldenError(f"{self.golden.path!r}: weight {name} is missing")
        return np.asarray(self.golden.get(name), dtype=np.float32)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.get(name)


def replay_weights(golden: GoldenFile, info: RunInfo, weights_dir=None):
    """The weights a replay of ``golden`` runs on: its own, or, for a golden that left them out
    (``--no-weights``), those of the checkpoint directory ``weights_dir`` once their checksums
    are those the golden recorded. ``weights_dir`` for any other golden is refused."""
    recorded = info.weights or {}
    from_dir = recorded.get("source") == "checkpoint directory"
    if weights_dir is not None:
        if not from_dir:
            raise GoldenError(f"--weights: {golden.path!r} was not made from a checkpoint "
                              f"directory; it replays on the weights it holds")
        found = WeightsDir(weights_dir, info.config, info.layers)
        found.verify(recorded, golden.path)
        return found
    if from_dir and not recorded.get("stored", True):
        raise GoldenError(f"{golden.path!r} does not hold its weights (made with --no-weights): "
                          f"replay it with --weights DIR, the checkpoint directory it was made "
                          f"from ({recorded.get('directory')})")
    return StoredWeights(golden)


def replay(path, progress=None, index_tolerance: float | None = None,
           exact_index: bool = False, weights_dir=None) -> CompareReport:
    """Recompute every capture of a golden from its own weights and inputs and compare, by the
    rules of :func:`compare_files` (tie-aware index rows unless ``exact_index``), except that
    the recorded scores must agree too (in rows whose selection is identical).

    Works on this tool's safetensors goldens and on the reference's ``.npz`` goldens (whose
    captures are then checked against ds41numba). ``progress(n, where)`` as in :func:`drive`.
    A golden made from a checkpoint directory with ``--no-weights`` needs ``weights_dir``
    (:func:`replay_weights`).

    A ``--rows`` golden holds the inputs of its answered prefill rows only: the replay makes
    the prefill's inputs with the generator (the file's seed and profile), checks the stored
    ones against them, runs every row and compares the file's rows (so it costs the full run).

    Args:
        path: the golden to replay.
        progress: ``progress(n, where)`` or None.
        index_tolerance: the boundary band of tie-aware index rows (default 1/16).
        exact_index: index rows must be identical.
        weights_dir: the checkpoint directory of a golden made with ``--no-weights``.

    Returns:
        The :class:`~ds41numba.golden.CompareReport` (``.ok``, ``.table()``, ``.text()``).

    Raises:
        GoldenError: the file cannot be read or is not a golden.
    """
    with GoldenFile(path) as golden:
        info = golden.run_info()
        cfg = info.config
        names = set(golden.names)
        weights = replay_weights(golden, info, weights_dir)
        try:
            stack = make_stack(cfg, weights, info.layers, info.batch)
        except ValueError as e:
            raise GoldenError(f"{golden.path!r}: {e}") from None
        answered = info.row_positions(0)
        if answered is not None and info.inputs is not None:
            raise GoldenError(f"{golden.path!r}: a --rows golden made with --inputs holds only "
                              f"its answered rows' inputs; it cannot be replayed")
        positions = {} if answered is None else dict.fromkeys(info.layers, answered)
        # A batch's sequences are judged one by one (BatchRowFile), as compare does.
        files = ([golden] if info.batch == 1 else
                 [BatchRowFile(golden, b) for b in range(info.batch)])
        judges = [Judge(info, file_scores(f), index_tolerance, exact_index, strict_evidence=True,
                        positions=positions) for f in files]
        report = CompareReport(golden.path, "replay", index_rule=judges[0].rule)
        recomputed = set(f"step0.layers.{i}.rows" for i in positions)

        def recorded_input(name, first_row, seqlen, start_pos, batch_row=0):
            if name not in names:
                raise GoldenError(f"{golden.path!r}: input {name} is missing")
            recomputed.add(name)
            if answered is None or start_pos:
                return np.asarray(files[batch_row].get(name), dtype=np.float32)
            x = to_storage(name, make_input(name, (seqlen, cfg.dim), info.seed, info.profile,
                                            first_row, start_pos), "BF16")
            report.add(judges[0].compare(name, golden.get(name), x[answered], golden))
            return x

        def compare(prefix, captures, first_row, batch_row=0):
            f = files[batch_row]
            for what in sorted(captures, key=lambda w: compare_order(prefix + w)):
                name = prefix + what
                recomputed.add(name)
                if name in names:
                    got = captures[what]
                    if answered is not None and prefix.startswith("step0.") and what in PER_ROW:
                        got = got[answered]
                    res = judges[batch_row].compare(name, f.get(name), got, f)
                    if info.batch > 1:
                        res.name = f"{name}[{batch_row}]"
                    report.add(res)

        drive(stack, info.prefill, info.decode, info.capture, recorded_input, compare, progress,
              info.capture_rows)
        for name in golden.names:
            if name not in recomputed and not WEIGHT_NAME.fullmatch(name):
                report.add(TensorResult(name, "only-golden", ok=False,
                                        detail="in the file but not produced by the replay"))
    return report
