"""One tensor's agreement with the golden's (:class:`TensorResult`): the record a comparison
fills (:mod:`.tolerance`, :class:`~.compare.Judge`) and its line and JSON forms in a report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .ties import SWAP_FLOAT_RANGE
from .where import fmt_steps as _fmt_steps, worst_lines

__all__ = ["TensorResult"]


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

