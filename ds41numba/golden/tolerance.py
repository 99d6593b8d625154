"""One tensor against the golden's: floats within the bf16 tolerance (:data:`TOLERANCE`, with
the rows downstream of a differing selection held to the tensor's range), index tensors row by
row, identical or tie-aware (:func:`.ties.judge_index_rows`). A tensor is read a chunk at a time:
a memory-mapped one is never read whole."""

from __future__ import annotations

import math

import numpy as np

from .captures import CHUNK
from .tensor_result import TensorResult
from .ties import SWAP_FLOAT_RANGE, RowBounds, RowScores, judge_index_rows
from .where import ROWS_LISTED, RowsOver, cosine

__all__ = ["TOLERANCE", "compare_tensor", "is_index"]

TOLERANCE = "|got - want| <= 2 * 2^-8 * max|want| + 1e-6 per tensor"


def is_index(a: np.ndarray) -> bool:
    """Whether ``a`` holds indices (integer or bool storage): compared row by row, not within
    the float tolerance."""
    return a.dtype.kind in "iub"


def _candidate_problem(want: np.ndarray, got: np.ndarray) -> str:
    """Why ``got`` cannot be compared with ``want`` at all (a dtype that holds no numbers, an
    index tensor holding NaN), or ""."""
    if got.dtype.kind not in "iubf" and got.dtype.name != "bfloat16":
        return f"dtype {got.dtype} in the candidate holds no numbers"
    if is_index(want) and not is_index(got):
        g = got.astype(np.float32, copy=False)
        if np.isnan(g).any():
            return "NaN in the candidate where an index belongs"
        if (g != np.round(g)).any():
            return "non-integer values in the candidate where an index belongs"
    return ""


def compare_tensor(name: str, want, got, *, scores: RowScores | None = None,
                   bounds: RowBounds | None = None, index_tolerance: float | None = None,
                   relaxed_rows=None, rows=None) -> TensorResult:
    """Compare ``got`` with ``want``: the bf16 tolerance for floats; for index tensors exact
    rows, or tie-aware rows when ``index_tolerance`` is given (:func:`.ties.judge_index_rows`,
    with the golden's ``scores`` and the rows' ``bounds``). ``relaxed_rows`` (first-axis rows)
    of a float tensor are held to the tensor's range (``SWAP_FLOAT_RANGE``); ``rows``, a boolean mask
    of first-axis rows, restricts the comparison to them."""
    want, got = np.asarray(want), np.asarray(got)
    index = is_index(want) or is_index(got)
    res = TensorResult(name=name, kind="index" if index else "float", ok=True,
                       shape=list(want.shape), size=int(want.size))
    if want.shape != got.shape:
        res.kind, res.ok = "shape", False
        res.detail = f"shape {list(got.shape)} in the candidate, {list(want.shape)} in the golden"
        return res
    problem = _candidate_problem(want, got)
    if problem:
        res.kind, res.ok, res.detail = "unusable", False, problem
        return res
    row_ids = None
    if rows is not None and want.ndim and not rows.all():
        res.rows_not_compared = int(np.count_nonzero(~rows))
        row_ids = np.flatnonzero(rows)
        want, got = want[rows], got[rows]
        res.size = int(want.size)
        if want.shape[0] == 0:
            return res
    if want.size == 0:              # no rows (a --rows none golden's prefill): nothing differs
        return res
    if index and index_tolerance is not None:
        return _judge_index(res, want, got, scores, bounds, index_tolerance)
    if index:
        return _compare_index(res, want, got)
    return _compare_float(res, want, got, relaxed_rows, row_ids=row_ids)


def _judge_index(res, want, got, scores, bounds, tolerance) -> TensorResult:
    j = judge_index_rows(want, got, scores, bounds, tolerance)
    res.tie_aware, res.index_tolerance = True, tolerance
    res.rows, res.rows_differ = j.rows, j.swapped + j.wrong
    res.rows_swapped, res.rows_wrong, res.unlisted = j.swapped, j.wrong, j.unlisted
    res.max_score_gap, res.max_relative_gap = j.max_gap, j.max_relative_gap
    res.first_rows = sorted(j.wrong_rows + j.swap_rows)[:ROWS_LISTED]
    res.reasons = j.reasons
    res.scores_from = scores.source if scores is not None else "none"
    res.ok = j.wrong == 0
    # Not in the JSON (first_rows lists them): every differing row, for --plot and the caller.
    res.differ_rows, res.swap_list, res.wrong_list = j.differ_rows, j.swap_rows, j.wrong_rows
    return res


def _compare_index(res: TensorResult, want: np.ndarray, got: np.ndarray) -> TensorResult:
    rows = want.shape[0] if want.ndim else 1
    w, g = want.reshape(rows, -1), got.reshape(rows, -1)
    # Values are compared, not storage: int32 against uint8 or a float copy of an index is fine.
    common = np.float64 if "f" in (w.dtype.kind, g.dtype.kind) else np.int64
    step = max(1, CHUNK // max(1, w.shape[1]))
    for lo in range(0, rows, step):
        bad = np.any(w[lo:lo + step].astype(common) != g[lo:lo + step].astype(common), axis=1)
        if len(res.first_rows) < ROWS_LISTED:
            res.first_rows += (np.flatnonzero(bad)[: ROWS_LISTED - len(res.first_rows)] + lo).tolist()
        res.rows_differ += int(np.count_nonzero(bad))
    res.rows = rows
    res.ok = res.rows_differ == 0
    return res


def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns on a line where adjacent floats are adjacent integers (+0 == -0)."""
    i = bits.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _abs_max(a: np.ndarray) -> float:
    """The largest finite |value| of ``a`` (0 for none), a chunk at a time."""
    flat, amax = a.reshape(-1), 0.0
    for lo in range(0, flat.size, CHUNK):
        w = np.abs(flat[lo:lo + CHUNK].astype(np.float32))
        w = w[np.isfinite(w)]
        if w.size:
            amax = max(amax, float(w.max()))
    return amax


def _compare_float(res: TensorResult, want: np.ndarray, got: np.ndarray,
                   relaxed_rows=None, factor: float = 1.0, amax: float | None = None,
                   row_ids=None) -> TensorResult:
    """Float agreement at ``factor`` x the bf16 tolerance of ``max|want|`` (``amax``, default
    this tensor's); ``relaxed_rows`` are judged apart (:func:`_compare_float_relaxed`).

    A chunk at a time (a memory-mapped tensor is never read whole); besides the counts it notes
    which first-axis rows hold an element over the bound and each row's worst element
    (``row_ids``: the tensor's row numbers of ``want``'s rows, when it is a selection of them).
    """
    if relaxed_rows is not None and len(relaxed_rows) and want.ndim:
        return _compare_float_relaxed(res, want, got, np.asarray(relaxed_rows, np.int64))
    w_all, g_all = want.reshape(-1), got.reshape(-1)
    res.tolerance = 2 * 2.0 ** -8 * (_abs_max(want) if amax is None else amax) + 1e-6
    bound = factor * res.tolerance
    rows = RowsOver(want.shape if want.ndim else (1,), row_ids)
    dots = np.zeros(3)      # sum g*w, g*g, w*w over the finite elements: the cosine
    for lo in range(0, w_all.size, CHUNK):
        w = np.ascontiguousarray(w_all[lo:lo + CHUNK], dtype=np.float32)
        g = np.ascontiguousarray(g_all[lo:lo + CHUNK], dtype=np.float32)
        wn, gn = np.isnan(w), np.isnan(g)
        res.bit_identical += int(np.count_nonzero((w.view(np.uint32) == g.view(np.uint32)) | (wn & gn)))
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(g64 - w64)
        finite = np.isfinite(w) & np.isfinite(g)
        ok = (finite & (diff <= bound)) | (w == g) | (wn & gn)
        res.over_tolerance += int(ok.size - np.count_nonzero(ok))
        if finite.any():
            res.max_abs_diff = max(res.max_abs_diff, float(diff[finite].max()))
            _figures(res, dots, g64, w64, diff, finite)
        del g64, w64
        if (~finite & ~ok).any():
            res.max_abs_diff = math.inf
        steps = np.abs(_ordered(g.view(np.uint32)) - _ordered(w.view(np.uint32))) / 65536.0
        steps = np.where(wn | gn, np.where(wn & gn, 0.0, np.inf), steps)
        res.within_one_step += int(np.count_nonzero(steps <= 1.0))
        if steps.size:
            res.max_bf16_steps = max(res.max_bf16_steps, float(steps.max()))
        if not ok.all():
            rows.note(lo, np.flatnonzero(~ok), np.where(finite, diff, np.inf), g, w, steps)
    res._dots = dots
    res.cosine = cosine(dots)
    rows.fill(res)
    res.ok = res.over_tolerance == 0
    return res


def _figures(res: TensorResult, dots, g64, w64, diff, finite):
    """Add a chunk's sums for the cosine to ``dots`` and its largest relative difference to
    ``res``, over its finite elements (``g64``, ``w64`` are overwritten: no more copies of the
    chunk than the comparison holds)."""
    if not finite.all():
        g64[~finite], w64[~finite] = 0.0, 0.0
    dots += (np.dot(g64, w64), np.dot(g64, g64), np.dot(w64, w64))
    moved = np.flatnonzero(diff > 0)          # NaN compares False: only finite differences
    if moved.size:
        want = np.abs(w64[moved])
        keep = finite[moved] & (want != 0)
        if keep.any():
            res.max_rel_diff = max(res.max_rel_diff, float((diff[moved][keep] / want[keep]).max()))


def _compare_float_relaxed(res: TensorResult, want, got, relaxed) -> TensorResult:
    """:func:`_compare_float` with the rows ``relaxed`` (downstream of a differing index row)
    judged apart: within ``SWAP_FLOAT_RANGE * max|want|`` (plus the tolerance) of the golden,
    NaN and infinities as the golden's; the tolerance stays the whole tensor's. The rows over
    are those of the strict rows over the tolerance and of the relaxed rows beyond the range."""
    mask = np.zeros(want.shape[0], bool)
    mask[relaxed[(relaxed >= 0) & (relaxed < want.shape[0])]] = True
    kept, loosened = np.flatnonzero(~mask), np.flatnonzero(mask)
    amax = _abs_max(want)
    strict = _compare_float(TensorResult(res.name, "float", True), want[~mask], got[~mask],
                            amax=amax, row_ids=kept)
    loose = _compare_float(TensorResult(res.name, "float", True), want[mask], got[mask],
                           amax=amax)
    tol = strict.tolerance
    ranged = _compare_float(TensorResult(res.name, "float", True), want[mask], got[mask],
                            factor=(SWAP_FLOAT_RANGE * amax + tol) / tol, amax=amax,
                            row_ids=loosened)
    res.tolerance = tol
    res.over_tolerance, res.max_abs_diff = strict.over_tolerance, strict.max_abs_diff
    res.within_one_step = strict.within_one_step + loose.within_one_step
    res.bit_identical = strict.bit_identical + loose.bit_identical
    res.max_bf16_steps = max(strict.max_bf16_steps, loose.max_bf16_steps)
    res.max_rel_diff = max(strict.max_rel_diff, loose.max_rel_diff)
    res.cosine = cosine(strict._dots + loose._dots)
    res.rows, res.rows_differ = want.shape[0], strict.rows_differ + ranged.rows_differ
    res.row_worst = sorted(strict.row_worst + ranged.row_worst, key=lambda w: w["row"])[:ROWS_LISTED]
    res.first_rows = [w["row"] for w in res.row_worst]
    res.swap_rows = int(mask.sum())
    res.swap_over_tolerance, res.swap_max_abs_diff = loose.over_tolerance, loose.max_abs_diff
    res.swap_over_range = ranged.over_tolerance
    res.ok = strict.ok and ranged.ok
    return res

