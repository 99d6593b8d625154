"""A comparison's report (:class:`CompareReport`): every tensor's result, the verdict, and
the text, table and JSON forms ``compare`` and ``replay`` print."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .captures import STEP_NAME, WEIGHT_NAME
from .tensor_result import TensorResult
from .tolerance import TOLERANCE
from .where import count as _count, fmt_steps as _fmt_steps

__all__ = ["CompareReport", "group_of"]


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

