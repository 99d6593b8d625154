"""A streamed golden (:func:`stream_golden`): laid out up front (:mod:`.layout`), filled row
by row as the run makes them, resumable from its checkpoints (:mod:`.checkpoint`)."""

from __future__ import annotations

import os

import numpy as np

from .captures import storage_kind, to_storage
from .checkpoint import CHECKPOINT_EVERY, Checkpoint, run_identity
from .drive import drive, piece_name, run_pieces, step_observers
from .errors import DiskError, RunInterrupted
from .files import StreamingGolden
from .layout import io_layout
from .plan import GoldenPlan, make_stack
from .work import work_units

__all__ = ["DEFAULT_CHUNK", "stream_golden"]

#: Prefill rows a streamed golden runs at a time (``--chunk``): products of this many rows run
#: at full speed, and a chunk's working set stays a few hundred MB at production shapes.
DEFAULT_CHUNK = 4096


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
