"""Comparing a candidate's tensors with a golden's: the :class:`Judge` that applies the rules
name by name (a step and layer's selections before the floats that follow them) and
:func:`compare_files`. One tensor's comparison is :mod:`.tolerance`'s, the report
:mod:`.report`'s.

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

import math
import re

import numpy as np

from ..indexer import visible_lengths
from .captures import SCORE_CAPTURES, STEP_NAME
from .errors import GoldenError
from .files import BatchRowFile, GoldenFile, RunInfo
from .report import CompareReport, group_of
from .rows import PER_ROW, match_rows
from .tensor_result import TensorResult
from .ties import DEFAULT_INDEX_TOLERANCE, RowBounds, RowScores
from .tolerance import TOLERANCE, compare_tensor, is_index
from .where import ROWS_LISTED

__all__ = ["TOLERANCE", "ROWS_LISTED", "SELECTIONS", "DOWNSTREAM", "TensorResult",
           "CompareReport", "Judge", "compare_tensor", "compare_files", "file_scores",
           "compare_order", "group_of"]

#: Index tensors judged tie-aware, and the float tensors whose rows follow a query's selection.
SELECTIONS = ("idx", "shared.topk_idxs")
DOWNSTREAM = ("o", "out", "sample.o")


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
        """Judge one tensor; a ``--rows`` golden's prefill rows reported at their positions."""
        res = self._judged(name, want, got, golden, candidate)
        sl = _step_layer(name)
        if sl is not None and sl[0] == 0 and sl[1] in self.positions and sl[2] in PER_ROW:
            _at_positions(res, self.positions[sl[1]])
        return res

    def _judged(self, name: str, want, got, golden, candidate) -> TensorResult:
        sl = _step_layer(name)
        if self.exact or sl is None:
            return compare_tensor(name, want, got)
        step, layer, what = sl
        if what in SELECTIONS and is_index(np.asarray(want)):
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


_ROW_REASON = re.compile(r"^row (\d+):")


def _at_positions(res: TensorResult, positions) -> None:
    """Report a ``--rows`` golden's step-0 rows as the prefill positions they stand for (row
    ``j`` is position ``positions[j]``), as a full golden's rows are: ``first_rows``, each
    ``row_worst`` entry, the reasons and the plot's lists. ``differ_rows`` stays the tensor's
    own rows: the judge relaxes the rows after a differing selection by it."""
    def at(row):
        return int(positions[row])
    res.first_rows = [at(r) for r in res.first_rows]
    for w in res.row_worst:
        w["row"] = w["position"][0] = at(w["row"])
    res.reasons = [_ROW_REASON.sub(lambda m: f"row {at(int(m.group(1)))}:", r) for r in res.reasons]
    for k in ("swap_list", "wrong_list"):
        if hasattr(res, k):
            setattr(res, k, [at(r) for r in getattr(res, k)])


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
                  index_tolerance: float | None = None, exact_index: bool = False,
                  strict_evidence: bool = False) -> CompareReport:
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
        strict_evidence: the recorded scores must agree too, in rows whose selection is
            identical (:func:`~.replaying.replay`'s rule).

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
                          strict_evidence=strict_evidence, positions=positions)
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
