"""A golden run: making a golden (:func:`run_golden`, :func:`write_golden`; streamed:
:func:`~.stream.stream_golden`) through the one step x layer driver (:mod:`.drive`), after the
checks that refuse a run up front. What a run does is :mod:`.plan`'s, the streamed file's layout
:mod:`.layout`'s, checking a golden :mod:`.replaying`'s; their names are importable from here.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..stack import held_weight_bytes, weight_specs
from .captures import STREAMED_MODES, storage_kind, to_storage
from .checkpoint import CHECKPOINT_EVERY
from .drive import drive, drive_piece, golden_steps, prefill_chunks, query_tiles, run_pieces
from .errors import GoldenError
from .files import check_target, write_tensors_atomic
from .generator import make_weights
from .layout import io_layout
from .plan import GoldenPlan, closed_selection, make_stack, missing_sources
from .replaying import StoredWeights, replay, replay_weights
from .stream import DEFAULT_CHUNK, stream_golden

__all__ = ["GoldenPlan", "missing_sources", "closed_selection", "golden_steps", "prefill_chunks",
           "run_pieces", "drive",
           "drive_piece", "run_golden", "write_golden", "stream_golden", "io_layout",
           "check_cluster_capture", "query_tiles",
           "DEFAULT_CHUNK", "minimum_bytes", "replay", "replay_weights", "StoredWeights",
           "make_stack"]


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
