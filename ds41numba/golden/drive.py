"""The one step x layer driver (:func:`drive`) that making a golden and checking one run the
stack through, and the pieces a run goes through (:func:`run_pieces`, :func:`query_tiles`).

Step 0 is the prefill (``prefill`` tokens at start_pos 0); step s >= 1 the decode of the token
at position ``prefill + s - 1``. Within a step the layers run in increasing order.
"""

from __future__ import annotations

from ..stack import AttentionStack
from .captures import StepObserver, cache_captures, forward_capture, layer_captures
from .rows import runs
from .work import work_units

__all__ = ["golden_steps", "prefill_chunks", "query_tiles", "run_pieces", "piece_name", "drive",
           "drive_piece", "step_observers"]


def golden_steps(prefill: int, decode: int):
    """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
    yield 0, 0, prefill
    for s in range(1, decode + 1):
        yield s, prefill + s - 1, 1


def prefill_chunks(prefill: int, chunk: int | None):
    """``(first_row, rows)`` of each chunk of a prefill (one chunk when ``chunk`` is None)."""
    size = prefill if chunk is None else max(1, int(chunk))
    return [(a, min(prefill, a + size) - a) for a in range(0, prefill, size)]


def query_tiles(prefill: int, chunk: int | None, rows=None) -> list[tuple[int, int]]:
    """``(first_row, rows)`` of the prefill's query tiles: its chunks (``rows`` None), or the
    runs of consecutive ``rows``, each cut into pieces of at most ``chunk``."""
    if rows is None:
        return prefill_chunks(prefill, chunk)
    size = prefill if chunk is None else max(1, int(chunk))
    return [(a + k, min(size, n - k)) for a, n in runs(rows) for k in range(0, n, size)]


def run_pieces(prefill: int, decode: int, chunk: int | None):
    """The pieces a run goes through, in order, ``(step, start_pos, first_row, rows)``: the
    rows ``first_row ..`` of the step at ``start_pos``, i.e. the prefill's chunks, then one per
    decode step. Each piece runs through every layer before the next; a checkpoint comes
    between two."""
    pieces = [(0, 0, a, n) for a, n in prefill_chunks(prefill, chunk)]
    return pieces + [(s, p, 0, 1) for s, p, _ in golden_steps(prefill, decode) if s]


def piece_name(piece, split: bool) -> str:
    """``step 0 rows 0-4095`` (a chunk of a prefill run in several), ``step 3``."""
    s, _, a, n = piece
    return f"step {s}" + (f" rows {a}-{a + n - 1}" if s == 0 and split else "")


def step_observers(stack, capture_rows=(), observer=None) -> list:
    """One :class:`StepObserver` per sequence of ``stack`` (``observer``: a restored one, or
    a list of them for a batch), each set on its sequence's shared runtime."""
    seqs = stack.sequences
    if observer is None:
        observers = [StepObserver(stack.config, capture_rows) for _ in seqs]
    else:
        observers = list(observer) if isinstance(observer, (list, tuple)) else [observer]
    for seq, obs in zip(seqs, observers):
        seq.shared.observer = obs
    return observers


def drive(stack: AttentionStack, prefill: int, decode: int, capture: str, x_of, take,
          progress=None, capture_rows=(), chunk: int | None = None, observer=None,
          start: int = 0, boundary=None):
    """The step x layer loop of a golden run: every step of :func:`golden_steps`, the stack's
    layers in increasing order within each; the prefill in chunks of ``chunk`` rows (default:
    one), each chunk through every layer before the next (token-major, which gives the one-shot
    prefill's rows: ``AttentionStack.forward``'s ``prefill_len``).

    ``x_of(name, first_row, rows, start_pos, batch_row)`` gives those rows of the input
    ``step{s}.layers.{i}.x`` of sequence ``batch_row`` (0 but in a :class:`BatchedStack`:
    within a layer the batch's sequences run in order), the step's first row being at position
    ``start_pos``; ``take(prefix, captures, first_row, batch_row)`` receives the layer's
    :func:`layer_captures` (the rows ``first_row ..`` of each per-row tensor) under their
    prefix ``step{s}.layers.{i}.``
    (views of the stack's live state: convert or compare them before returning; nothing holds
    them after). ``progress(n, where)``, if given, is called before each forward with
    ``n = 0`` and after it with the work it did (:func:`~.work.work_units`); ``where`` says
    which step, chunk and layer.

    The index scores and the samples of the positions ``capture_rows`` are collected by a
    :class:`StepObserver` (``observer``, or a new one) set on the stack's shared runtime for
    the run, begun for every forward (a chunk: its first row): the scores come with each
    chunk's rows; the samples (``sample.*``, a few rows of the whole step, and the step's keys
    and latents) are collected over the chunks and taken once, with the step's last chunk, at
    ``first_row`` 0.

    A resumed run starts at piece ``start`` of :func:`run_pieces` (the stack and ``observer``
    restored to where that piece begins; a batch has a list of them, one per sequence);
    ``boundary(done, observer)``, if given, is called after each piece with the number of
    pieces done.
    """
    pieces = run_pieces(prefill, decode, chunk)
    split = len(pieces) - decode > 1
    observers = step_observers(stack, capture_rows, observer)
    observer = observers if len(observers) > 1 else observers[0]
    try:
        for k in range(start, len(pieces)):
            drive_piece(stack, pieces[k], prefill, capture, x_of, take, progress, observer, split)
            if boundary is not None:
                boundary(k + 1, observer)
    finally:
        for seq in stack.sequences:
            seq.shared.observer = None


def drive_piece(stack, piece, prefill, capture, x_of, take, progress, observer, split):
    """One piece of :func:`drive` through every layer of the stack (of a batch: every layer
    through the batch's sequences in order, before the next layer). ``observer``: the
    sequence's :class:`StepObserver`, or a list of one per sequence."""
    s, start_pos, first, n = piece
    a = start_pos + first
    chunked = s == 0 and split
    prefill_len = prefill if s == 0 else None
    last = s == 0 and a + n == prefill          # the prefill's last piece: its caches are done
    seqs = stack.sequences
    observers = observer if isinstance(observer, (list, tuple)) else [observer]
    for i in stack.layers:
        prefix = f"step{s}.layers.{i}."
        for b, (seq, obs) in enumerate(zip(seqs, observers)):
            where = f"{piece_name(piece, split)} layer {i}" + (f" batch row {b}" if b else "")
            if progress is not None:
                progress(0, where)
            obs.begin(i, a, n, prefill_len)
            run = seq.forward(i, x_of(prefix + "x", first, n, start_pos, b), a,
                              capture=forward_capture(capture), prefill_len=prefill_len)
            got = layer_captures(seq, i, run, a, capture, obs)
            if chunked:
                samples = {w: v for w, v in got.items() if w.startswith("sample.")}
                take(prefix, {w: v for w, v in got.items() if w not in samples}, first, b)
                if samples:
                    take(prefix, samples, 0, b)
            else:
                take(prefix, got, first, b)
            if last and capture == "caches":
                take(prefix, cache_captures(seq, i, prefill), 0, b)
            del run, got
            if progress is not None:
                progress(work_units(stack.config, i, a, n, prefill=s == 0), where)
