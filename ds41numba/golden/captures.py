"""What a layer's step records (the *captures*), and the storage dtypes a golden holds them in.

Tensor names are the reference goldens': ``layers.{i}.attn.NAME`` for parameters,
``step{s}.layers.{i}.WHAT`` for a step's input ``x`` and captures. ``io`` records ``out``,
``idx`` and ``shared.topk_idxs``; ``all`` adds ``q``, ``kv``, ``o``, ``index_score``, the other
``shared.*`` slots and the layer's ``state.*``. Every stored value is exactly the value computed.

Both modes also record, at every index source, the scores behind its selection, so a candidate's
index rows can be judged without the whole ``[seqlen, positions]`` score matrix
(:mod:`.ties`): ``topk_scores`` (the score of each selected position, aligned with
``shared.topk_idxs``; -inf for a -1 entry) and the best ``RUNNERS_UP`` positions below the
boundary, ``runner_idxs`` (in the same coordinates: position + offset; -1 past the last) and
``runner_scores``. Scores are those top-k chose from: after the visibility and candidate masks.

With ``--capture-rows`` (``sample_positions``), for just those query positions of every step,
what each kernel consumes and produces (the ``sample.*`` captures, :data:`SAMPLE_CAPTURES`).

A :class:`StepObserver` collects the scores and samples from inside the forward, a tile at a time
(``SharedRuntime.observer``): nothing of size ``[seqlen, positions]`` or ``[seqlen, H, hd]`` is
held for them.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
from numba import prange

from ..jit import njit
from ..attention import index_rows
from ..config import AttnConfig
from ..indexer import visible_lengths
from ..numerics import bf16_halves, serial_twin, sized_call
from ..step import Step
from ..topk import SCAN_RUN, ListedSpans, before, hints_pass, run_passes

__all__ = ["CAPTURE_MODES", "CACHE_CAPTURES", "STREAMED_MODES", "cache_captures", "cache_layout",
           "SCORE_CAPTURES", "SAMPLE_CAPTURES", "RUNNERS_UP", "STEP_NAME",
           "WEIGHT_NAME", "CHUNK", "StepObserver", "forward_capture", "layer_captures",
           "storage_kind", "to_storage"]

BF16 = ml_dtypes.bfloat16
CHUNK = 1 << 22          # elements per piece when converting or comparing large tensors

#: Runners-up recorded per index row: the measured swaps of the reference against itself reach
#: rank 56 below the boundary (docs/testing.md).
RUNNERS_UP = 64
#: The scores behind an index source's selection (both modes).
SCORE_CAPTURES = ("topk_scores", "runner_idxs", "runner_scores")
#: What ``--capture-rows`` adds for the sampled rows of a step (``sample.rows``: the step's query
#: rows, row r being position start_pos + r), and once per such step the keys and latents the
#: layer scored against and attended.
SAMPLE_CAPTURES = ("sample.rows", "sample.q", "sample.kv", "sample.o", "sample.index_score",
                   "sample.index_q", "sample.index_weights", "sample.index_k", "sample.compress_kv")
#: What each capture mode records per step and layer (besides the input ``x``), in file order.
CAPTURE_MODES = {
    "io": ("out", "idx", "shared.topk_idxs") + SCORE_CAPTURES,
    "caches": ("out", "idx", "shared.topk_idxs") + SCORE_CAPTURES,
    "all": ("out", "q", "kv", "idx", "o", "index_score", "shared.compress_kv", "shared.index_k",
            "shared.topk_idxs", "shared.candidates", "state.window_kv", "state.kv_state",
            "state.score_state") + SCORE_CAPTURES,
}
#: What ``--capture caches`` adds, once, after each layer's prefill: the layer's own caches as
#: its last prefill step leaves them (:func:`cache_captures`).
CACHE_CAPTURES = ("state.window_kv", "state.compress_kv", "state.index_k", "state.kv_state",
                  "state.score_state")
#: The capture modes a golden streams to its file (laid out up front, resumable, on a cluster).
STREAMED_MODES = ("io", "caches")
#: Captures not stored as BF16 (the index tensors, and the compressor's f32 state).
_CAPTURE_STORAGE = {"idx": "I32", "shared.topk_idxs": "I32", "shared.candidates": "U8",
                    "state.kv_state": "F32", "state.score_state": "F32", "runner_idxs": "I32",
                    "sample.rows": "I32", "rows": "I32"}
_STORAGE_DTYPES = {"BF16": BF16, "F32": np.float32, "I32": np.int32, "U8": np.uint8}
STEP_NAME = re.compile(r"step(\d+)\.layers\.(\d+)\.(.+)")
WEIGHT_NAME = re.compile(r"layers\.(\d+)\.attn\.(.+)")


def _records_shared(config: AttnConfig, layer_id: int) -> bool:
    """The goldens record the shared slots after ratio > 0 layers that publish one of them."""
    c = config
    return c.ratio(layer_id) > 0 and (c.is_kv_source(layer_id) or c.is_index_source(layer_id)
                                      or c.is_candidate_source(layer_id))


#: Whether the goldens record the shared slots after a layer (a file laid out up front asks).
records_shared = _records_shared


def index_sampled(config: AttnConfig, layer_id: int, end_pos: int) -> bool:
    """Whether a sampled step ending at ``end_pos`` records what the layer's indexer scored
    (``sample.index_*``): an index source, once it has a compressed row to score."""
    r = config.ratio(layer_id)
    return r > 0 and config.is_index_source(layer_id) and end_pos // r > 0


def forward_capture(mode: str) -> bool:
    """``io`` runs the forward without capture: its q and o would be [seqlen, H, hd] each."""
    return mode == "all"


def layer_captures(stack, layer_id: int, run, start_pos: int, mode: str,
                   observer: "StepObserver | None" = None) -> dict[str, np.ndarray]:
    """The captures of one layer's step, ``{WHAT: array}``, as the reference goldens record them,
    plus what ``observer`` (the step's :class:`StepObserver`) collected.

    Arrays may be views of the stack's live state: convert (copy) them before the next step.
    """
    c = stack.config
    wanted = CAPTURE_MODES[mode] + SAMPLE_CAPTURES
    seqlen = run.out.shape[0]
    end_pos = start_pos + seqlen
    r = c.ratio(layer_id)
    shared = stack.shared
    # Without capture the forward does not return idx: the helper attention_any builds it with
    # (index_rows) makes it again from the shared selection the layer read.
    got = {"out": run.out, "idx": run.idx if run.idx is not None else index_rows(
        start_pos, seqlen, c.window_size, shared.topk_idxs if r else None)}
    if mode == "all":
        got.update(q=run.q, kv=run.kv_rows, o=run.o)
        if run.index_score is not None:
            got["index_score"] = run.index_score
    if _records_shared(c, layer_id):
        if shared.topk_idxs is not None:
            got["shared.topk_idxs"] = shared.topk_idxs
        if mode == "all":
            if shared.compress_kv is not None:
                got["shared.compress_kv"] = shared.compress_kv[: end_pos // r]
            if shared.index_k is not None:
                got["shared.index_k"] = shared.index_k.keys[: end_pos // r]
            cands = shared.candidates
            if cands is not None:
                got["shared.candidates"] = cands
    if mode == "all":
        state = stack.states[layer_id]
        got["state.window_kv"] = state.window_kv
        if state.kv_state is not None:
            got["state.kv_state"] = state.kv_state
            got["state.score_state"] = state.score_state
    if observer is not None:
        got.update(observer.captures())
        if observer.sampling and r:
            got["sample.compress_kv"] = shared.compress_kv[: end_pos // r]
            if index_sampled(c, layer_id, end_pos) and shared.index_k is not None:
                got["sample.index_k"] = shared.index_k.keys[: end_pos // r]
    return {k: got[k] for k in wanted if k in got}


def cache_captures(stack, layer_id: int, prefill: int) -> dict[str, np.ndarray]:
    """Layer ``layer_id``'s own caches as its prefill of ``prefill`` tokens left them (what a
    decode kernel starts from): ``state.window_kv`` (the ring, ``[window_size, hd]``: position
    p in slot ``p % window_size``), for a kv source ``state.compress_kv`` (its compressed KV,
    rows ``0 .. prefill // r - 1``) and, ratio > 1, ``state.kv_state`` / ``state.score_state``
    (the compressor's partial group, ``[r, hd]`` f32), for a key owner ``state.index_k`` (its
    index keys, the same rows). Views of the live state: convert them before the next step."""
    state = stack.states[layer_id]
    r = stack.config.ratio(layer_id)
    got = {"state.window_kv": state.window_kv}
    if state.compress_cache is not None:
        got["state.compress_kv"] = state.compress_cache[:prefill // r]
    if state.index_cache is not None:
        got["state.index_k"] = state.index_cache.keys[:prefill // r]
    if state.kv_state is not None:
        got["state.kv_state"] = state.kv_state
        got["state.score_state"] = state.score_state
    return got


def cache_layout(c: AttnConfig, i: int, prefill: int) -> list:
    """Layer i's :func:`cache_captures` as a streamed file's layout entries ``(name, dtype,
    shape)``."""
    pre, r, hd = f"step0.layers.{i}.", c.ratio(i), c.head_dim
    out = [(pre + "state.window_kv", "BF16", (c.window_size, hd))]
    if c.is_kv_source(i):
        out.append((pre + "state.compress_kv", "BF16", (prefill // r, hd)))
        if c.is_index_source(i):
            out.append((pre + "state.index_k", "BF16", (prefill // r, c.index_head_dim)))
        if r > 1:
            out += [(pre + "state.kv_state", "F32", (r, hd)),
                    (pre + "state.score_state", "F32", (r, hd))]
    return out


@njit
def _keep_if_better(vals, ids, cnt, v, i):
    """Score ``v`` of index ``i`` into the sorted list ``vals / ids`` of ``cnt`` (at most its
    length, R) if it holds fewer than R or ``v`` comes before its last; returns its new count.
    Equal scores keep their order of arrival (by position)."""
    R = vals.shape[0]
    if cnt == R and not before(v, vals[R - 1]):
        return cnt
    j = cnt if cnt < R else R - 1
    while j > 0 and before(v, vals[j - 1]):
        vals[j] = vals[j - 1]
        ids[j] = ids[j - 1]
        j -= 1
    vals[j] = v
    ids[j] = i
    return cnt + 1 if cnt < R else cnt


@njit
def _left_out(topk_row, offset):
    """The positions a row's selection ``topk_row`` (``position + offset``, -1 for none) took,
    ascending."""
    sel = np.empty(topk_row.shape[0], np.int64)
    m = 0
    for j in range(topk_row.shape[0]):
        if topk_row[j] >= 0:
            # An insertion sort, not np.sort (whose quicksort took a second of a cold start's
            # compiling): top_k_sets' rows are ascending, so it is one pass over the row.
            p = topk_row[j] - offset
            t = m
            while t > 0 and sel[t - 1] > p:
                sel[t] = sel[t - 1]
                t -= 1
            sel[t] = p
            m += 1
    return sel[:m]


@njit
def _keep_run(row, t0, t1, sel, p, vals, ids, cnt, offset):
    """:func:`_keep_if_better` over ``row[t0:t1]`` but the selected positions (``sel`` from
    ``p``, ascending); returns ``(cnt, p)``."""
    for t in range(t0, t1):
        while p < sel.shape[0] and sel[p] < t:
            p += 1
        if not (p < sel.shape[0] and sel[p] == t):
            cnt = _keep_if_better(vals, ids, cnt, row[t], t + offset)
    return cnt, p


@njit
def _row_runners_up(row, n, sel, offset, vals, ids, hint, block):
    """One row's runners-up (see :func:`_runners_up`) among its first ``n`` scores; returns
    how many it found."""
    R = vals.shape[0]
    cnt = 0
    p = 0
    span = SCAN_RUN * max(block, 1)
    for a in range(0, n, span):
        if block and cnt == R and a + span <= n and not hints_pass(hint, a // block,
                                                                   a // block + SCAN_RUN,
                                                                   vals[R - 1]):
            continue
        for t0 in range(a, min(n, a + span), SCAN_RUN):
            if cnt == R and t0 + SCAN_RUN <= n and not run_passes(row, t0, vals[R - 1], hint,
                                                                   block):
                continue
            cnt, p = _keep_run(row, t0, min(n, t0 + SCAN_RUN), sel, p, vals, ids, cnt, offset)
    return cnt


@njit
def _finish_runners_up(vals, ids, cnt):
    for j in range(cnt, vals.shape[0]):
        ids[j] = -1
        vals[j] = -np.inf


@njit(parallel=True)
def _runners_up(scores, clen, topk, offset, out_idx, out_val, hints, block):
    """Per row, the best ``R`` visible positions the selection ``topk`` left out, best first in
    torch's order (NaN first, then larger; equal scores by position), as ``position + offset``
    into ``out_idx`` with their scores into ``out_val`` (-1 and -inf past the last).

    One pass over the row's visible scores keeps a sorted list of R: O(positions) per row.
    Once it holds R, a run of scores none of which passes the last is skipped after one vector
    test (most of a long row; all of a candidate consumer's -inf outside its candidates). With
    the top-k's block hints (``block`` > 0, ``hints [T, blocks]``: a ``block``-th of the row to
    read) the tests read them instead: first those of ``SCAN_RUN`` blocks at once, then a
    run's (:func:`~ds41numba.topk.run_passes`).
    """
    for s in prange(scores.shape[0]):
        n = min(clen[s], scores.shape[1])
        cnt = _row_runners_up(scores[s], n, _left_out(topk[s], offset), offset, out_val[s],
                              out_idx[s], hints[s], block)
        _finish_runners_up(out_val[s], out_idx[s], cnt)


_runners_up_serial = serial_twin(_runners_up)


@njit(parallel=True)
def _runners_up_listed(scores, clen, topk, offset, out_idx, out_val, offsets, firsts, span):
    """:func:`_runners_up` of rows that are -inf outside the spans of ``span`` positions at
    ``firsts[offsets[s]:offsets[s + 1]]`` (:class:`~ds41numba.topk.ListedSpans`): the spans
    alone are visited, in order. Where that leaves fewer than R, or a -inf among them (a -inf
    outside the spans at a smaller position would come first), the row is scanned whole."""
    R = out_idx.shape[1]
    for s in prange(scores.shape[0]):
        n = min(clen[s], scores.shape[1])
        row, vals, ids = scores[s], out_val[s], out_idx[s]
        sel = _left_out(topk[s], offset)
        cnt = p = 0
        for first in firsts[offsets[s]:offsets[s + 1]]:
            cnt, p = _keep_run(row, first, min(n, first + span), sel, p, vals, ids, cnt, offset)
        if cnt < R or vals[R - 1] == -np.inf:
            cnt = _row_runners_up(row, n, sel, offset, vals, ids, row, 0)
        _finish_runners_up(vals, ids, cnt)


_runners_up_listed_serial = serial_twin(_runners_up_listed)


class StepObserver:
    """Collects, from inside one layer's step, the index scores a golden records and the
    ``--capture-rows`` samples; set as ``stack.shared.observer`` for the run.

    :meth:`begin` before each forward; the indexer and attention then call
    :meth:`index_scores`, :meth:`index_selection` and :meth:`attention_tile` a tile at a time
    (with offsets ``s0`` into the forward's rows); :meth:`captures` returns what the step left.
    A prefill run in chunks (``begin``'s ``prefill_len``) gives each chunk's score rows, and the
    samples, collected over the chunks, with the last one.
    """

    def __init__(self, config: AttnConfig, sample_positions=(), runners: int = RUNNERS_UP):
        self.config = config
        self.runners = int(runners)
        self.sample_positions = np.unique(np.asarray(sample_positions, np.int64))
        self.rows = np.zeros(0, np.int64)
        self._got: dict[str, np.ndarray] = {}
        self._samples: dict[str, np.ndarray] = {}
        self._steps: dict[int, tuple] = {}       # layer -> (sampled rows, samples) of its step
        self._row0, self._step_end, self._seqlen = 0, True, 0

    def begin(self, layer_id: int, start_pos: int, seqlen: int, prefill_len: int | None = None):
        """Before each forward, with its arguments: ``prefill_len`` makes it the chunk of a
        prefill whose first row is ``start_pos`` (the forward's ``prefill_len``). The score
        captures are the chunk's rows (to be stored at rows ``start_pos ..``); the samples
        collect over the step's chunks and :meth:`captures` returns them, all rows of the
        step, with the step's last chunk (:attr:`sampling`)."""
        c = self.config
        r = c.ratio(layer_id)
        p = self.sample_positions
        step = Step(start_pos, seqlen, prefill_len)
        step0, steprows = step.ref_start, step.ref_seqlen
        self._row0 = step.call_row                  # the chunk's first row of the step
        self._step_end = self._row0 + seqlen == steprows
        if self._row0 == 0 or layer_id not in self._steps:
            rows = p[(p >= step0) & (p < step0 + steprows)] - step0
            self._steps[layer_id] = (rows, {"sample.rows": rows.astype(np.int32)} if rows.size else {})
        self.rows, self._samples = self._steps[layer_id]
        self._seqlen = seqlen
        if self._step_end:
            del self._steps[layer_id]
        self.offset = c.window_size if step.decode else step.ref_seqlen   # the window's rows
        self._got = {}
        self._clen = visible_lengths(start_pos, seqlen, r, prefill=not step.decode) if r else None
        if r and c.is_index_source(layer_id):
            k = min(c.index_topk, step.ref_end // r)
            self._got["topk_scores"] = np.full((seqlen, k), -np.inf, np.float32)
            self._got["runner_idxs"] = np.full((seqlen, self.runners), -1, np.int32)
            self._got["runner_scores"] = np.full((seqlen, self.runners), -np.inf, np.float32)

    def __getstate__(self):
        """What a checkpoint between two forwards keeps: not the last forward's score captures
        (``[rows, index_topk]`` each, already written; :meth:`begin` makes new ones)."""
        return {**self.__dict__, "_got": {}}

    @property
    def sampling(self) -> bool:
        """Whether :meth:`captures` holds samples: the step has sampled rows and this forward
        was its last chunk."""
        return bool(self.rows.size) and self._step_end

    def _sampled(self, s0: int, n: int):
        """``(i, t)``: index into the samples and row of the tile, of the sampled rows in it
        (``s0`` counts from the forward's first row)."""
        a = self._row0 + s0
        i = np.flatnonzero((self.rows >= a) & (self.rows < a + n))
        return i, self.rows[i] - a

    def _sample(self, name: str, i, values: np.ndarray):
        if name not in self._samples:
            self._samples[name] = np.zeros((self.rows.size,) + values.shape[1:], np.float32)
        self._samples[name][i] = values

    def wants_index_scores(self, s0: int, n: int) -> bool:
        """Whether the tile of ``n`` rows from ``s0`` holds a sampled row, whose scores before
        the candidate mask :meth:`index_scores` records (a candidate consumer forms them
        only then)."""
        return bool(self._sampled(s0, n)[0].size)

    def index_scores(self, s0: int, iq: np.ndarray, w: np.ndarray, scores: np.ndarray):
        i, t = self._sampled(s0, scores.shape[0])
        if i.size:
            self._sample("sample.index_score", i, scores[t])
            self._sample("sample.index_q", i, iq[t])
            self._sample("sample.index_weights", i, w[t])

    def index_selection(self, s0: int, scores: np.ndarray, topk: np.ndarray,
                        maxima: tuple | None = None):
        n, k = topk.shape
        rows = slice(s0, s0 + n)
        cols = np.clip(topk.astype(np.int64) - self.offset, 0, max(scores.shape[1] - 1, 0))
        if k:
            picked = np.take_along_axis(scores, cols, axis=1)
            self._got["topk_scores"][rows] = np.where(topk >= 0, picked, -np.inf)
        outs = (self._got["runner_idxs"][rows], self._got["runner_scores"][rows])
        if isinstance(maxima, ListedSpans):
            sized_call(_runners_up_listed, n, scores.shape[1], scores, self._clen[rows], topk,
                       self.offset, *outs, *maxima)
            return
        block, hints = maxima if maxima is not None else (0, scores)
        sized_call(_runners_up, n, scores.shape[1], scores, self._clen[rows], topk, self.offset,
                   *outs, hints, block)

    def attention_tile(self, s0: int, q: np.ndarray, o: np.ndarray, kv_rows, idx: np.ndarray):
        i, t = self._sampled(s0, q.shape[0])
        if not i.size:
            return
        self._sample("sample.q", i, q[t])
        self._sample("sample.o", i, o[t])
        parts = tuple(kv_rows)
        starts = np.cumsum([0] + [len(p) for p in parts[:-1]])
        rows = idx[t].astype(np.int64)
        kv = np.zeros(rows.shape + (parts[0].shape[1],), np.float32)
        for p, first in zip(parts, starts):
            sel = (rows >= first) & (rows < first + len(p))
            kv[sel] = p[rows[sel] - first]
        self._sample("sample.kv", i, kv)

    def forward_samples(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The samples of this forward's own rows, for a run that collects a step's samples
        from several processes (:mod:`.cluster`): their indices into the step's ``sample.*``
        rows (consecutive) and ``{sample.WHAT: those rows}``, without ``sample.rows``."""
        i, _ = self._sampled(0, self._seqlen)
        if not i.size:
            return i, {}
        return i, {k: v[i] for k, v in self._samples.items() if k != "sample.rows"}

    def captures(self) -> dict[str, np.ndarray]:
        """The forward's score captures (its rows) and, with the step's last chunk, the step's
        samples."""
        return {**self._got, **self._samples} if self.sampling else dict(self._got)


def storage_kind(name: str, weight_kinds: dict | None = None) -> str:
    """The safetensors dtype a tensor is stored in: "BF16", "F32", "I32" or "U8".

    ``weight_kinds`` maps parameter names to their :func:`weight_specs` kind ("bf16" | "f32").
    """
    m = STEP_NAME.fullmatch(name)
    if m:
        return _CAPTURE_STORAGE.get(m.group(3), "BF16")
    if weight_kinds is not None and name in weight_kinds:
        return "F32" if weight_kinds[name] == "f32" else "BF16"
    raise ValueError(f"storage_kind: unknown tensor {name!r}")


def to_storage(name: str, array, kind: str) -> np.ndarray:
    """A new array holding ``array`` in the storage dtype ``kind``; refuses to change a value.

    The stack's arrays are float32 (bf16 values where the reference holds bf16) and int32 or
    bool: storing them must be exact, or a golden would record something that was not computed.
    """
    a = np.asarray(array)
    dtype = _STORAGE_DTYPES[kind]
    if kind in ("I32", "U8"):
        out = np.array(a, dtype=dtype, copy=True)
        if not np.array_equal(out, a):
            raise ValueError(f"{name}: values do not fit {kind}")
        return out
    a = np.asarray(a, dtype=np.float32)
    if kind == "F32":
        return np.array(a, copy=True)
    bits = bf16_halves(a)
    if bits is not None:
        return bits.view(BF16)
    out = a.astype(BF16)        # a NaN (or a value bf16 does not hold): ml_dtypes' cast, checked
    if not _bf16_exact(a, out):
        raise ValueError(f"{name}: holds values that are not bf16 (it would be rounded on storage)")
    return out


def _bf16_exact(a32: np.ndarray, a16: np.ndarray, chunk: int = CHUNK) -> bool:
    """True when the bf16 copy converts back to the same float32 (NaN to NaN, any payload)."""
    f, h = a32.reshape(-1), a16.reshape(-1)
    for lo in range(0, f.size, chunk):
        back, part = h[lo:lo + chunk].astype(np.float32), f[lo:lo + chunk]
        same = back.view(np.uint32) == part.view(np.uint32)
        if not same.all() and not (same | (np.isnan(back) & np.isnan(part))).all():
            return False
    return True


