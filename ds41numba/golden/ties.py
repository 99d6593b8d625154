"""Tie-aware judgement of index rows: which differences from a golden's selection are correct.

A kernel that sums the indexer's heads in another order, or whose top-k breaks ties another
way, swaps positions at the top-k boundary: correct behaviour (the reference does it against
itself, see README "Testing your kernel"). A golden records the scores behind each selection
(``topk_scores``, ``runner_idxs``, ``runner_scores``: :mod:`.captures`), and a candidate's row
is then one of:

* **identical**: the same set of entries as the golden's (order is not compared);
* **swap**: it differs only at the boundary (a -1 for a visible position included when the
  boundary is at -inf, where invisible positions tie): every dropped position and every added one has a
  golden score within ``tol`` of the row's k-th score (exact ties included), where
  ``tol = tolerance * max |finite selected score of the row|`` (:data:`DEFAULT_INDEX_TOLERANCE`);
* **wrong**: anything else, named by its first reason: an entry that is not an integer (NaN),
  out of range (below -1, past the query's visible positions, in the wrong part of the row), a
  duplicate, a -1 where the golden has a position (or the reverse: the count of valid entries
  differs), a different window entry, a dropped or added position away from the boundary.

When the golden has no scores but the candidate does (a ds41numba golden as the candidate of a
reference output), the rule is applied from the candidate's side with its scores.

An added position below the recorded runners-up has a golden score of at most the last
runner-up's: it is accepted (and counted as *unlisted*) only when that bound is itself within
``tol`` of the k-th score, i.e. when the row's tie band is wider than the record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DEFAULT_INDEX_TOLERANCE", "SWAP_FLOAT_RANGE", "RowScores", "RowBounds",
           "IndexJudgement", "judge_index_rows"]

#: Default tolerance of a boundary swap, relative to the row's largest |selected score|. The
#: reference against itself (two torch CPU backends, v41-flash layer 20, 2048-token prefill)
#: needs 0.0353; 1/16 leaves a margin of 1.8 (docs/testing.md).
DEFAULT_INDEX_TOLERANCE = 1 / 16
#: Float rows downstream of a differing index row (that query's ``o``/``out``, in the layer and
#: the layers reusing its selection) attend other KV rows: they are held only to the golden
#: tensor's own range, ``|got - want| <= SWAP_FLOAT_RANGE * max|want| + tolerance``, with the
#: same NaN and infinities. (The reference against itself moves them by up to 1.94 x the
#: tolerance; a tie broken the other way, where the attended rows' keys are unrelated, by up
#: to 0.9 x max|want|.) Their largest difference is reported apart.
SWAP_FLOAT_RANGE = 2.0
_REASONS_KEPT = 10


@dataclass
class RowScores:
    """A golden's record of one selection: its rows ``topk_idxs [rows, k]`` (the coordinates
    of the compared rows) with ``topk_scores`` aligned, and ``runner_idxs``/``runner_scores``
    ``[rows, R]``, best first (-1 past the last)."""

    topk_idxs: np.ndarray
    topk_scores: np.ndarray
    runner_idxs: np.ndarray
    runner_scores: np.ndarray
    source: str = "golden"          # whose file the scores come from

    def __post_init__(self):
        self.topk_scores = np.asarray(self.topk_scores, np.float32)
        self.runner_scores = np.asarray(self.runner_scores, np.float32)
        for name in ("topk_scores", "runner_scores", "runner_idxs"):
            a = getattr(self, name)
            ref = self.topk_idxs if name == "topk_scores" else self.runner_idxs
            if a.shape != ref.shape or a.ndim != 2 or a.shape[0] != self.topk_idxs.shape[0]:
                raise ValueError(f"RowScores: {name} has shape {list(a.shape)}, expected "
                                 f"{list(ref.shape)} with {self.topk_idxs.shape[0]} rows")

    def take(self, rows) -> "RowScores":
        """The record of some rows only (e.g. a golden's ``sample.rows``)."""
        rows = np.asarray(rows, np.int64)
        return RowScores(self.topk_idxs[rows], self.topk_scores[rows], self.runner_idxs[rows],
                         self.runner_scores[rows], self.source)


@dataclass
class RowBounds:
    """Where a row's entries may lie: window entries below ``offset`` (``window`` true for an
    ``idx`` tensor, which lists them first), compressed ones in ``offset .. offset + clen[row]``
    (``clen`` None: not checked)."""

    offset: int
    clen: np.ndarray | None = None
    window: bool = False


@dataclass
class IndexJudgement:
    """How a candidate's index rows relate to the golden's."""

    rows: int = 0
    identical: int = 0
    swapped: int = 0
    wrong: int = 0
    unlisted: int = 0               # added positions accepted below the recorded runners-up
    max_gap: float = 0.0            # largest |score - k-th score| a swap used
    max_relative_gap: float = 0.0   # the same over the row's score scale
    differ_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    swap_rows: list = field(default_factory=list)
    wrong_rows: list = field(default_factory=list)
    reasons: list = field(default_factory=list)     # "row r: why" for the first wrong rows
    first_reason: str = ""


def _is_nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _kth(scores: np.ndarray) -> float:
    """The lowest of a selection's scores in torch's order (NaN highest)."""
    finite = scores[~np.isnan(scores)]
    return float(finite.min()) if finite.size else math.nan


def _gap(hi: float, lo: float) -> float:
    """``hi - lo`` for a score at or above ``lo`` in torch's order; 0 for equal values."""
    if hi == lo or (math.isnan(hi) and math.isnan(lo)):
        return 0.0
    if math.isnan(hi):
        return math.inf
    return hi - lo if not math.isnan(lo) else math.inf


def _row_reason(want, got, scores: RowScores | None, bounds: RowBounds | None, s: int,
                tolerance: float, judgement: IndexJudgement) -> str:
    """Why candidate row ``s`` is wrong, or "" for a swap (updating the judgement's gaps)."""
    g = np.asarray(got[s])
    why = _not_indices(g)
    if why:
        return why
    g = g.astype(np.int64)
    w = np.asarray(want[s]).astype(np.int64)
    gv, wv = g[g >= 0], w[w >= 0]
    why = _entries_reason(g, gv, bounds, s)
    if why:
        return why
    dropped = np.setdiff1d(wv, gv)
    added = np.setdiff1d(gv, wv)
    if bounds is not None and bounds.window:
        if (dropped < bounds.offset).any() or (added < bounds.offset).any():
            return "a window entry differs"
    scored = kth = None
    if scores is not None:
        scored, kth = _scored_row(scores, s)
    # Fewer (more) valid entries than the golden is a -1 where a position was visible (or the
    # reverse), unless the boundary is at -inf: invisible positions score -inf too, so a -1
    # and a visible position scoring -inf are the same tie.
    if gv.size != wv.size and kth != -math.inf:
        if gv.size < wv.size:
            return f"{wv.size - gv.size} -1 where the golden has a position"
        return f"{gv.size - wv.size} positions where the golden has -1"
    if scores is None:
        return "differs, and there are no scores to judge a swap by"
    if scores.source == "candidate":
        # The scores are the candidate's, aligned with its own selection: judge from its side
        # (what it holds and the golden does not must lie at its boundary, and the reverse).
        dropped, added = added, dropped
    return _swap_reason(dropped, added, scored, kth, scores, s, tolerance, judgement,
                        missing=wv.size - gv.size)


def _not_indices(g: np.ndarray) -> str:
    """Why a float row holds no indices (NaN, a fraction), or ""."""
    if g.dtype.kind == "f":
        if np.isnan(g).any():
            return "NaN where an index belongs"
        if (g != np.round(g)).any():
            return "an index that is not an integer"
    return ""


def _entries_reason(g: np.ndarray, gv: np.ndarray, bounds: RowBounds | None, s: int) -> str:
    """Why row ``s``'s entries ``g`` (its positions ``gv``) cannot be a selection whatever the
    scores: one below -1, a duplicate, one outside the row's bounds; or ""."""
    if (g < -1).any():
        return f"index {int(g[g < -1][0])} out of range"
    if np.unique(gv).size != gv.size:
        vals, counts = np.unique(gv, return_counts=True)
        return f"duplicate index {int(vals[counts > 1][0])}"
    if bounds is not None:
        lo = 0 if bounds.window else bounds.offset
        hi = None if bounds.clen is None else bounds.offset + int(bounds.clen[s])
        bad = gv[(gv < lo) | ((gv >= hi) if hi is not None else False)]
        if bad.size:
            return (f"index {int(bad[0])} past the query's {int(bounds.clen[s])} visible positions"
                    if bad[0] >= lo else f"index {int(bad[0])} below the compressed entries")
    return ""


def _scored_row(scores: RowScores, s: int):
    """Row ``s`` of the record: ``(positions, their scores)`` and its k-th score."""
    sel, sel_scores = scores.topk_idxs[s].astype(np.int64), scores.topk_scores[s]
    scored = (sel[sel >= 0], sel_scores[sel >= 0])
    # A -1 in the scored row is an invisible position top-k chose: it scored -inf.
    kth = -math.inf if (sel < 0).any() else _kth(scored[1])
    return scored, kth


def _swap_reason(dropped, added, scored, kth: float, scores: RowScores, s: int,
                 tolerance: float, judgement: IndexJudgement, missing: int) -> str:
    """Why the positions ``dropped`` from and ``added`` to the scores' selection are not a swap
    at its boundary ``kth`` (``missing``: how many fewer valid entries the candidate holds), or
    "" when they are, updating the judgement's gaps."""
    sel, sel_scores = scored
    score_of = dict(zip(sel.tolist(), sel_scores.tolist()))
    finite = np.abs(sel_scores[np.isfinite(sel_scores)])
    scale = float(finite.max()) if finite.size else 0.0
    tol = tolerance * scale
    gaps = []
    for p in dropped.tolist():
        if p not in score_of:
            return f"the golden's selection does not hold its own entry {p} (scores misaligned)"
        gap = _gap(score_of[p], kth)
        if gap > tol:
            if missing > 0:
                return (f"{missing} -1 where the golden has a position (dropped {p}, "
                        f"{gap:.3g} above the boundary)")
            return f"dropped {p}, {gap:.3g} above the boundary (tolerance {tol:.3g})"
        gaps.append(gap)
    why = _added_reason(added, scores, s, kth, tol, judgement, gaps)
    if why:
        return why
    if gaps:
        judgement.max_gap = max(judgement.max_gap, max(gaps))
        if scale > 0:
            judgement.max_relative_gap = max(judgement.max_relative_gap, max(gaps) / scale)
    return ""


def _added_reason(added, scores: RowScores, s: int, kth: float, tol: float,
                  judgement: IndexJudgement, gaps: list) -> str:
    """Why a position ``added`` is not just below the boundary ``kth`` (within ``tol``, by the
    recorded runners-up or, below them, by the last one's score), or ""; appends the gaps."""
    runners = scores.runner_idxs[s].astype(np.int64)
    runner_of = dict(zip(runners[runners >= 0].tolist(),
                         scores.runner_scores[s][runners >= 0].tolist()))
    for p in added.tolist():
        if p in runner_of:
            gap = _gap(kth, runner_of[p])
        elif runners[-1] < 0:
            return f"added {p}, which is not a visible position below the boundary"
        else:
            gap = _gap(kth, float(scores.runner_scores[s][-1]))
            if gap > tol:
                return f"added {p}, below every recorded runner-up (tolerance {tol:.3g})"
            judgement.unlisted += 1
        if gap > tol:
            return f"added {p}, {gap:.3g} below the boundary (tolerance {tol:.3g})"
        gaps.append(gap)
    return ""


def judge_index_rows(want, got, scores: RowScores | None = None, bounds: RowBounds | None = None,
                     tolerance: float = DEFAULT_INDEX_TOLERANCE) -> IndexJudgement:
    """Classify every row of the candidate's ``got [rows, width]`` against the golden's ``want``
    (module docstring). Rows are compared as sets; a row the same as the golden's is identical
    without looking at scores."""
    want, got = np.asarray(want), np.asarray(got)
    rows = want.shape[0] if want.ndim else 1
    w, g = want.reshape(rows, -1), got.reshape(rows, -1)
    j = IndexJudgement(rows=rows)
    common = np.float64 if "f" in (w.dtype.kind, g.dtype.kind) else np.int64
    same = np.all(w.astype(common) == g.astype(common), axis=1)
    differ = np.flatnonzero(~same)
    # Rows equal as sets (another order) are identical too.
    if differ.size:
        ws = np.sort(w[differ].astype(common), axis=1)
        gs = np.sort(g[differ].astype(common), axis=1)
        differ = differ[~np.all(ws == gs, axis=1)]
    j.differ_rows = differ
    for s in differ.tolist():
        why = _row_reason(w, g, scores, bounds, s, tolerance, j)
        if why:
            j.wrong_rows.append(s)
            if len(j.reasons) < _REASONS_KEPT:
                j.reasons.append(f"row {s}: {why}")
        else:
            j.swap_rows.append(s)
    j.wrong, j.swapped = len(j.wrong_rows), len(j.swap_rows)
    j.identical = rows - j.wrong - j.swapped
    j.first_reason = j.reasons[0] if j.reasons else ""
    return j
