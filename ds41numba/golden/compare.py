"""Comparing a candidate's tensors with a golden's, and the reports.

Floats: the bf16 tolerance (docs/testing.md), ``|got - want| <= 2 * 2^-8 * max|want| + 1e-6`` per tensor. Index
selections (``idx``, ``shared.topk_idxs``): row by row, tie-aware (:mod:`.ties`): identical rows
and boundary swaps pass, wrong rows fail; with ``exact_index`` every row must be identical (the
rule before goldens carried scores). Rows of ``o``/``out`` (and ``sample.o``) downstream of a
differing index row are reported apart and held to the golden tensor's range
(``SWAP_FLOAT_RANGE``).
The score captures (``topk_scores``, ``runner_*``) are the golden's evidence, not results: they
are compared, in rows whose selection is identical, for information only. Other integer tensors (``shared.candidates``, ``sample.rows``) must be identical.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

from ..indexer import visible_lengths
from .captures import CHUNK, SCORE_CAPTURES, STEP_NAME, WEIGHT_NAME
from .errors import GoldenError
from .files import BatchRowFile, GoldenFile, RunInfo
from .rows import match_rows
from .ties import (DEFAULT_INDEX_TOLERANCE, SWAP_FLOAT_RANGE, RowBounds, RowScores,
                   judge_index_rows)
from .where import (ROWS_LISTED, RowsOver, cosine, count as _count, fmt_steps as _fmt_steps,
                    worst_lines)

__all__ = ["TOLERANCE", "ROWS_LISTED", "SELECTIONS", "DOWNSTREAM", "TensorResult",
           "CompareReport", "Judge", "compare_tensor", "compare_files", "file_scores",
           "compare_order", "group_of"]

TOLERANCE = "|got - want| <= 2 * 2^-8 * max|want| + 1e-6 per tensor"
#: Index tensors judged tie-aware, and the float tensors whose rows follow a query's selection.
SELECTIONS = ("idx", "shared.topk_idxs")
DOWNSTREAM = ("o", "out", "sample.o")


@dataclass
class TensorResult:
    """How one tensor of the candidate agrees with the golden's."""

    name: str
    kind: str                 # "index", "float", "only-golden", "only-candidate", "shape"
    ok: bool
    shape: list = field(default_factory=list)
    size: int = 0
    # index tensors: rows (along the first axis) with any differing element
    rows: int = 0
    rows_differ: int = 0
    first_rows: list = field(default_factory=list)   # the first ROWS_LISTED differing rows
    # float tensors
    max_abs_diff: float = 0.0
    tolerance: float = 0.0
    over_tolerance: int = 0
    max_bf16_steps: float = 0.0
    within_one_step: int = 0
    bit_identical: int = 0
    detail: str = ""
    # tie-aware index rows (rows_differ = rows_swapped + rows_wrong)
    tie_aware: bool = False
    rows_swapped: int = 0
    rows_wrong: int = 0
    unlisted: int = 0
    max_score_gap: float = 0.0
    max_relative_gap: float = 0.0
    index_tolerance: float = 0.0
    scores_from: str = ""
    reasons: list = field(default_factory=list)
    # float rows downstream of a differing index row: held to the tensor's range only
    # (SWAP_FLOAT_RANGE), and how many of their elements the tolerance would have failed
    swap_rows: int = 0
    swap_max_abs_diff: float = 0.0
    swap_over_tolerance: int = 0
    swap_over_range: int = 0
    rows_not_compared: int = 0      # score captures: rows whose selection differs
    informational: bool = False     # the golden's evidence (score captures): never fails
    # float tensors: engines' per-tensor figures (finite elements; relative where want != 0),
    # and, aligned with first_rows (the first rows holding an element over tolerance), each
    # row's worst element: {"row", "position", "got", "want", "steps"}
    max_rel_diff: float = 0.0
    cosine: float = 1.0
    row_worst: list = field(default_factory=list)

    def line(self) -> str:
        """One human-readable line."""
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        if self.kind == "index" and self.tie_aware:
            state = f"{self.rows_wrong} of {self.rows} rows wrong ({self.reasons[0]})" if (
                self.rows_wrong) else "identical"
            if self.rows_swapped:
                state += (f"{'; ' if self.rows_wrong else ' except '}{self.rows_swapped} boundary "
                          f"swaps (max gap {self.max_score_gap:.3g}, {self.max_relative_gap:.3g} "
                          f"of the row's scale; tolerance {self.index_tolerance:.3g}; scores "
                          f"from the {self.scores_from})")
            return f"{self.name} {shape} index: {state}"
        if self.kind == "index":
            state = "identical" if not self.rows_differ else (
                f"{self.rows_differ} of {self.rows} rows differ (first: "
                + ", ".join(str(r) for r in self.first_rows[:10])
                + (", ..." if self.rows_differ > 10 else "") + ")")
            return f"{self.name} {shape} index: {state}"
        if self.kind == "float":
            n = max(self.size, 1)
            verdict = (f"within tolerance {self.tolerance:.3g}" if self.over_tolerance == 0 else
                       f"> tolerance {self.tolerance:.3g} ({self.over_tolerance} of {self.size} "
                       f"elements over)")
            line = (f"{self.name} {shape}: max |diff| {self.max_abs_diff:.3g} {verdict}; "
                    f"max {_fmt_steps(self.max_bf16_steps)} bf16 steps, "
                    f"{100 * self.within_one_step / n:.2f}% within 1 step, "
                    f"{100 * self.bit_identical / n:.2f}% bit-identical")
            if self.swap_rows:
                line += (f"; {self.swap_rows} rows after differing index rows: max |diff| "
                         f"{self.swap_max_abs_diff:.3g} ({self.swap_over_tolerance} elements over "
                         f"the tolerance"
                         + (f", {self.swap_over_range} beyond {SWAP_FLOAT_RANGE:g} x max|want|)"
                            if self.swap_over_range else ", all within the tensor's range)"))
            if self.rows_not_compared:
                line += f"; {self.rows_not_compared} rows not compared (their selection differs)"
            if self.row_worst:
                line += "\n" + worst_lines(self.rows_differ, self.row_worst)
            return line
        return f"{self.name}: {self.detail}"

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("differ_rows", "swap_list", "wrong_list", "_dots"):
            d.pop(k, None)
        for k in ("max_abs_diff", "max_bf16_steps", "tolerance", "max_score_gap",
                  "max_relative_gap", "swap_max_abs_diff", "max_rel_diff", "cosine"):
            d[k] = _json_float(d[k])
        d["row_worst"] = [{k: _json_float(v) if isinstance(v, float) else v for k, v in w.items()}
                          for w in self.row_worst]
        return d


def _json_float(v: float):
    return v if math.isfinite(v) else str(v)   # JSON has no inf/nan


def _is_index(a: np.ndarray) -> bool:
    return a.dtype.kind in "iub"


def _candidate_problem(want: np.ndarray, got: np.ndarray) -> str:
    """Why ``got`` cannot be compared with ``want`` at all (a dtype that holds no numbers, an
    index tensor holding NaN), or ""."""
    if got.dtype.kind not in "iubf" and got.dtype.name != "bfloat16":
        return f"dtype {got.dtype} in the candidate holds no numbers"
    if _is_index(want) and not _is_index(got):
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
    index = _is_index(want) or _is_index(got)
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


@dataclass
class CompareReport:
    """Every tensor's result, the verdict, and the text and JSON forms of both."""

    golden: str
    candidate: str
    results: list = field(default_factory=list)
    subset: bool = False      # a tensor only in the golden is not a failure
    index_rule: str = "exact"  # or "tie-aware, tolerance T"

    def add(self, result: TensorResult):
        self.results.append(result)

    @property
    def failures(self) -> list:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        compared = [r for r in self.results if r.kind in ("index", "float")]
        return bool(compared) and not self.failures

    def summary(self) -> dict:
        idx = [r for r in self.results if r.kind == "index" and not r.informational]
        flt = [r for r in self.results if r.kind == "float" and not r.informational]
        elems = sum(r.size for r in flt)
        return {
            "ok": self.ok,
            "compared": len(idx) + len(flt),
            "index_tensors": len(idx),
            "index_rows": sum(r.rows for r in idx),
            "index_rows_differ": sum(r.rows_differ for r in idx),
            "index_rows_swapped": sum(r.rows_swapped for r in idx),
            "index_rows_wrong": sum(r.rows_wrong if r.tie_aware else r.rows_differ for r in idx),
            "max_score_gap": max((r.max_score_gap for r in idx), default=0.0),
            "max_relative_gap": max((r.max_relative_gap for r in idx), default=0.0),
            "unlisted_positions": sum(r.unlisted for r in idx),
            "index_rule": self.index_rule,
            "float_rows_after_swaps": sum(r.swap_rows for r in flt),
            "max_abs_diff_after_swaps": max((r.swap_max_abs_diff for r in flt), default=0.0),
            "float_tensors": len(flt),
            "float_elements": elems,
            "float_over_tolerance": sum(r.over_tolerance for r in flt),
            "max_bf16_steps": max((r.max_bf16_steps for r in flt), default=0.0),
            "within_one_step_fraction": (sum(r.within_one_step for r in flt) / elems) if elems else 1.0,
            "bit_identical_fraction": (sum(r.bit_identical for r in flt) / elems) if elems else 1.0,
            "only_in_golden": sum(r.kind == "only-golden" for r in self.results),
            "only_in_candidate": sum(r.kind == "only-candidate" for r in self.results),
            "shape_mismatches": sum(r.kind == "shape" for r in self.results),
            "unusable": sum(r.kind == "unusable" for r in self.results),
            "failing_tensors": len(self.failures),
            "disagreeing_tensors": sum(r.kind != "only-golden" for r in self.failures),
            "missing_tensors": sum(r.kind == "only-golden" for r in self.failures),
            "tolerance": TOLERANCE,
        }

    def summary_line(self) -> str:
        s = self.summary()
        rows = f"index rows {s['index_rows'] - s['index_rows_differ']}/{s['index_rows']} identical"
        if self.index_rule != "exact":
            rows += (f", {s['index_rows_swapped']} boundary swaps (max gap "
                     f"{s['max_relative_gap']:.3g} of the row's scale), {s['index_rows_wrong']} wrong")
            if s["float_rows_after_swaps"]:
                rows += (f"; {s['float_rows_after_swaps']} float rows after swaps (max |diff| "
                         f"{s['max_abs_diff_after_swaps']:.3g})")
        parts = [_count(s['compared'], "tensor") + " compared", rows,
                 f"floats max {_fmt_steps(s['max_bf16_steps'])} bf16 steps, "
                 f"{100 * s['within_one_step_fraction']:.3f}% within 1 step, "
                 f"{100 * s['bit_identical_fraction']:.3f}% bit-identical"]
        if s["only_in_golden"]:
            parts.append(f"{s['only_in_golden']} only in {self.golden}")
        if s["only_in_candidate"]:
            parts.append(f"{s['only_in_candidate']} only in {self.candidate}")
        return f"{self._verdict(s)}: " + "; ".join(parts)

    def _verdict(self, s: dict) -> str:
        """OK, or FAIL with how many tensors disagree and how many the candidate lacks."""
        if self.ok:
            return "OK"
        if not s["compared"]:
            return "FAIL (no tensor in common)"
        n, missing = s["disagreeing_tensors"], s["missing_tensors"]
        why = []
        if n:
            why.append(_count(n, "tensor") + (" disagrees" if n == 1 else " disagree"))
        if missing:
            why.append(f"{missing} missing" if n else _count(missing, "tensor") + " missing")
        return f"FAIL ({', '.join(why) or 'nothing compared agrees'})"

    def text(self, limit: int = 50) -> str:
        """One line per failing tensor (at most ``limit``), then the summary line."""
        failing = [r for r in self.failures if r.kind != "only-golden"]
        lines = [r.line() for r in failing[:limit]]
        if len(failing) > limit:
            lines.append(f"... and {len(failing) - limit} more failing tensors (--json lists all)")
        missing = [r.name for r in self.failures if r.kind == "only-golden"]
        if missing:
            lines.append(f"missing from {self.candidate}: " + ", ".join(missing[:5])
                         + (f" ... ({len(missing)} in all)" if len(missing) > 5 else ""))
        extra = [r.name for r in self.results if r.kind == "only-candidate"]
        if extra:
            lines.append(f"only in {self.candidate}: " + ", ".join(extra[:5])
                         + (f" ... ({len(extra)} in all)" if len(extra) > 5 else ""))
        if self.subset:
            skipped = [r.name for r in self.results if r.kind == "only-golden"]
            if skipped:
                lines.append(f"only in {self.golden} (skipped, --subset): {len(skipped)} tensors")
        lines.append(self.summary_line())
        return "\n".join(lines)

    def table(self) -> str:
        """Agreement per kind of tensor (``out``, ``idx``, ``weights``, ...), one row each.

        "steps" are per element: how many bf16 values lie between got and want. Near zero a
        harmless absolute difference can be many steps, hence also the share within one step.
        """
        groups: dict[str, list] = {}
        for r in self.results:
            if r.kind in ("index", "float", "shape", "unusable"):
                groups.setdefault(group_of(r.name), []).append(r)
        head = (f"{'tensor':<20} {'count':>6} {'failing':>7} {'rows differing':>15} "
                f"{'max steps':>9} {'within 1 step':>13} {'bit-identical':>13}")
        lines = [head, "-" * len(head)]
        for g, rs in groups.items():
            idx = [r for r in rs if r.kind == "index"]
            flt = [r for r in rs if r.kind == "float"]
            fail = sum(not r.ok for r in rs)
            rows = (f"{sum(r.rows_differ for r in idx)}/{sum(r.rows for r in idx)}" if idx else "-")
            steps = _fmt_steps(max(r.max_bf16_steps for r in flt)) if flt else "-"
            n = sum(r.size for r in flt)
            one = f"{100 * sum(r.within_one_step for r in flt) / n:.3f}%" if n else "-"
            ident = f"{100 * sum(r.bit_identical for r in flt) / n:.3f}%" if n else "-"
            lines.append(f"{g:<20} {len(rs):>6} {fail:>7} {rows:>15} {steps:>9} {one:>13} {ident:>13}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"golden": self.golden, "candidate": self.candidate,
                           "summary": self.summary(), "tensors": [r.to_dict() for r in self.results]},
                          indent=1)


def group_of(name: str) -> str:
    """The kind of tensor a name is (``out``, ``idx``, ``weights``, ...): a report's group."""
    m = STEP_NAME.fullmatch(name)
    if m:
        return m.group(3)
    return "weights" if WEIGHT_NAME.fullmatch(name) else name


def _step_layer(name: str):
    m = STEP_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def compare_order(name: str):
    """Within a step and layer, selections first: the float rows after them need their verdict."""
    sl = _step_layer(name)
    if sl is None:
        return (-1, -1, 2)
    return (sl[0], sl[1], 0 if sl[2] in SELECTIONS else 1)


class Judge:
    """The comparison of one golden with one candidate, tensor by tensor (:meth:`compare`), in
    the order :func:`compare_order` gives (a step and layer's selections before its floats).

    ``run`` is the golden's run (config and steps: the rows' bounds), ``scores(step, layer)``
    the :class:`RowScores` of an index source's selection, or None. With ``exact_index`` index
    rows must be identical and no float row is relaxed (the rule before scores were recorded).
    The score captures are informational unless ``strict_evidence`` (a replay, which checks
    the golden itself).
    """

    def __init__(self, run: RunInfo | None, scores=None, index_tolerance: float | None = None,
                 exact_index: bool = False, strict_evidence: bool = False, positions=None):
        self.run = run
        self.positions = positions or {}     # layer -> the prefill positions of its rows
        self.scores = scores or (lambda step, layer: None)
        self.exact = bool(exact_index)
        self.strict_evidence = bool(strict_evidence)
        tol = DEFAULT_INDEX_TOLERANCE if index_tolerance is None else float(index_tolerance)
        if not (math.isfinite(tol) and tol >= 0):
            raise GoldenError(f"--index-tolerance must be a number >= 0, got {index_tolerance!r}")
        self.tolerance = None if self.exact else tol
        self.rule = "exact" if self.exact else f"tie-aware, tolerance {tol:g}"
        self.differ: dict[tuple[int, int], set] = {}      # (step, layer) -> differing rows

    def _source(self, layer: int) -> int | None:
        c = self.run.config if self.run is not None else None
        if c is None or not 0 <= layer < c.n_layers or c.ratio(layer) == 0:
            return None
        try:
            return c.index_source_of(layer)
        except ValueError:
            return None

    def _bounds(self, step: int, layer: int, what: str, rows: int) -> RowBounds | None:
        run = self.run
        if run is None or not 0 <= layer < run.config.n_layers:
            return None
        c = run.config
        start_pos = 0 if step == 0 else run.prefill + step - 1
        offset = rows if step == 0 else c.window_size
        src = self._source(layer)
        r = c.ratio(src if src is not None else layer)
        clen = visible_lengths(start_pos, rows, r) if r else np.zeros(rows, np.int64)
        if step == 0 and layer in self.positions:      # some rows of the prefill, by position
            offset, pos = run.prefill, self.positions[layer]
            clen = (pos + 1) // r if r else np.zeros(rows, np.int64)
        return RowBounds(offset, clen, window=(what == "idx"))

    def _relaxed(self, step: int, layer: int, name: str, golden, candidate):
        rows = set(self.differ.get((step, layer), ()))
        src = self._source(layer)
        if src is not None:
            rows |= self.differ.get((step, src), set())
        if not rows:
            return None
        if name.endswith("sample.o"):       # sample rows -> query rows
            sample = f"step{step}.layers.{layer}.sample.rows"
            if sample not in golden:
                return None
            q = np.asarray(golden.get(sample))
            return np.flatnonzero(np.isin(q, list(rows)))
        return np.array(sorted(rows), np.int64)

    def compare(self, name: str, want, got, golden=None, candidate=None) -> TensorResult:
        sl = _step_layer(name)
        if self.exact or sl is None:
            return compare_tensor(name, want, got)
        step, layer, what = sl
        if what in SELECTIONS and _is_index(np.asarray(want)):
            src = self._source(layer)
            scores = self.scores(step, src) if src is not None else None
            bounds = self._bounds(step, layer, what, np.asarray(want).shape[0])
            res = compare_tensor(name, want, got, scores=scores, bounds=bounds,
                                 index_tolerance=self.tolerance)
            differ = getattr(res, "differ_rows", None)
            if differ is not None and len(differ):
                self.differ.setdefault((step, layer), set()).update(differ.tolist())
            return res
        if what in DOWNSTREAM:
            return compare_tensor(name, want, got,
                                  relaxed_rows=self._relaxed(step, layer, name, golden, candidate))
        if what in SCORE_CAPTURES:
            # The evidence a selection is judged by, not a result: a kernel's own scores may
            # differ from it (another head order) without being wrong. Compared, in the rows
            # whose selection is identical, for information only.
            rows = self.differ.get((step, layer))
            keep = None
            if rows:
                keep = np.ones(np.asarray(want).shape[0], bool)
                keep[sorted(rows)] = False
            res = compare_tensor(name, want, got, rows=keep)
            if res.kind in ("index", "float") and not self.strict_evidence:
                res.ok, res.informational = True, True
            return res
        return compare_tensor(name, want, got)


def file_scores(golden: GoldenFile, candidate: GoldenFile | None = None):
    """``scores(step, layer)``: the golden's recorded scores of that selection, else the
    candidate's (a golden without them, e.g. another backend's reference output), else None."""
    memo = {}

    def scores(step, layer):
        if (step, layer) not in memo:
            memo[step, layer] = _scores_of(step, layer)
        return memo[step, layer]

    def _scores_of(step, layer):
        prefix = f"step{step}.layers.{layer}."
        for f, who in ((golden, "golden"), (candidate, "candidate")):
            if f is None or any(prefix + n not in f for n in SCORE_CAPTURES):
                continue
            if prefix + "shared.topk_idxs" not in f:
                continue
            return RowScores(np.asarray(f.get(prefix + "shared.topk_idxs")),
                             f.get(prefix + "topk_scores"), np.asarray(f.get(prefix + "runner_idxs")),
                             f.get(prefix + "runner_scores"), who)
        return None
    return scores


def compare_files(golden_path, candidate_path, subset: bool = False,
                  index_tolerance: float | None = None, exact_index: bool = False) -> CompareReport:
    """Compare every tensor of two goldens (safetensors or reference .npz, either side).

    A tensor only in the golden fails unless ``subset`` (the candidate then need only carry
    some of the golden's tensors, e.g. a kernel's outputs); one only in the candidate is
    reported but does not fail. Index selections are judged tie-aware with the scores the
    golden records (or, when it has none, the candidate's), unless ``exact_index``.

    A golden of some prefill rows (``--rows``) is compared at the positions both files hold
    (:func:`~.rows.match_rows`); prefill rows of the golden the candidate lacks fail unless
    ``subset``.

    A batch's golden (metadata ``batch`` > 1) is judged sequence by sequence: batch row b of
    each ``step{s}.layers.{i}.*`` tensor by the rules above, reported as ``NAME[b]``; the
    weights once.

    Args:
        golden_path: the golden (ds41numba ``.safetensors`` or reference ``.npz``).
        candidate_path: the file to judge (safetensors or ``.npz``, the golden's tensor names).
        subset: the candidate may leave out tensors of the golden.
        index_tolerance: the boundary band of tie-aware index rows (default 1/16).
        exact_index: index rows must be identical.

    Returns:
        A :class:`CompareReport`: ``.ok``, ``.results`` (one :class:`TensorResult` a tensor),
        ``.text()`` (what ``compare`` prints), ``.to_json()``.

    Raises:
        GoldenError: either file cannot be read.
    """
    with GoldenFile(golden_path) as golden, GoldenFile(candidate_path) as cand:
        info = golden.step_info()
        batch = 1 if info is None else info.batch
        report = None
        cand_names = set(cand.names)
        for b in range(batch):
            if batch == 1:          # a --rows golden (never a batch): matched by position
                g, c, positions, lacking = match_rows(golden, cand,
                                                      None if info is None else info.prefill)
            else:
                g, c, positions, lacking = BatchRowFile(golden, b), BatchRowFile(cand, b), {}, {}
            judge = Judge(g.step_info(), file_scores(g, c), index_tolerance, exact_index,
                          positions=positions)
            if report is None:
                report = CompareReport(golden.path, cand.path, subset=subset, index_rule=judge.rule)
            for i, missing in lacking.items():
                report.add(TensorResult(f"step0.layers.{i}.rows", "only-golden", ok=subset,
                                        detail=f"{missing.size} prefill rows of the golden are "
                                        f"not in {cand.path} (first: position {missing[0]})"))
            for name in sorted(golden.names, key=compare_order):
                per_row = batch > 1 and STEP_NAME.fullmatch(name) is not None
                if b and not per_row:
                    continue                       # the weights: once
                if name in cand_names:
                    res = judge.compare(name, g.get(name), c.get(name), g, c)
                elif name.endswith(".rows") and _step_layer(name)[2] == "rows":
                    continue             # the other file holds every row: matched by position
                else:
                    res = TensorResult(name, "only-golden", ok=subset,
                                       detail=f"missing from {cand.path}")
                if per_row:
                    res.name = f"{name}[{b}]"
                report.add(res)
        report.results.sort(key=lambda r: _natural(r.name))
        gold_names = set(golden.names)
        for name in cand.names:
            if name not in gold_names:
                report.add(TensorResult(name, "only-candidate", ok=True,
                                        detail=f"not in {golden.path}"))
    return report


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
