"""Comparing a candidate's tensors with a golden's: exact for index tensors, SPEC's tolerance
for floats (``|got - want| <= 2 * 2^-8 * max|want| + 1e-6`` per tensor), and the reports."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from .captures import CHUNK, STEP_NAME, WEIGHT_NAME
from .files import GoldenFile

__all__ = ["TOLERANCE", "ROWS_LISTED", "TensorResult", "CompareReport", "compare_tensor",
           "compare_files"]

TOLERANCE = "|got - want| <= 2 * 2^-8 * max|want| + 1e-6 per tensor"
ROWS_LISTED = 1000   # differing index rows a result lists (the text line shows the first 10)


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

    def line(self) -> str:
        """One human-readable line."""
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        if self.kind == "index":
            state = "identical" if self.ok else (
                f"{self.rows_differ} of {self.rows} rows differ (first: "
                + ", ".join(str(r) for r in self.first_rows[:10])
                + (", ..." if self.rows_differ > 10 else "") + ")")
            return f"{self.name} {shape} index: {state}"
        if self.kind == "float":
            n = max(self.size, 1)
            verdict = (f"within tolerance {self.tolerance:.3g}" if self.ok else
                       f"> tolerance {self.tolerance:.3g} ({self.over_tolerance} of {self.size} "
                       f"elements over)")
            return (f"{self.name} {shape}: max |diff| {self.max_abs_diff:.3g} {verdict}; "
                    f"max {_fmt_steps(self.max_bf16_steps)} bf16 steps, "
                    f"{100 * self.within_one_step / n:.2f}% within 1 step, "
                    f"{100 * self.bit_identical / n:.2f}% bit-identical")
        return f"{self.name}: {self.detail}"

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("max_abs_diff", "max_bf16_steps", "tolerance"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])   # JSON has no inf/nan
        return d


def _fmt_steps(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.0f}" if v == int(v) else f"{v:.3g}"


def _is_index(a: np.ndarray) -> bool:
    return a.dtype.kind in "iub"


def compare_tensor(name: str, want, got) -> TensorResult:
    """Compare ``got`` with ``want``: exact for index tensors, the SPEC tolerance for floats."""
    want, got = np.asarray(want), np.asarray(got)
    index = _is_index(want) or _is_index(got)
    res = TensorResult(name=name, kind="index" if index else "float", ok=True,
                       shape=list(want.shape), size=int(want.size))
    if want.shape != got.shape:
        res.kind, res.ok = "shape", False
        res.detail = f"shape {list(got.shape)} in the candidate, {list(want.shape)} in the golden"
        return res
    return _compare_index(res, want, got) if index else _compare_float(res, want, got)


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


def _compare_float(res: TensorResult, want: np.ndarray, got: np.ndarray) -> TensorResult:
    w_all, g_all = want.reshape(-1), got.reshape(-1)
    amax = 0.0
    for lo in range(0, w_all.size, CHUNK):
        w = np.abs(w_all[lo:lo + CHUNK].astype(np.float32))
        w = w[np.isfinite(w)]
        if w.size:
            amax = max(amax, float(w.max()))
    bound = 2 * 2.0 ** -8 * amax + 1e-6
    res.tolerance = bound
    for lo in range(0, w_all.size, CHUNK):
        w = np.ascontiguousarray(w_all[lo:lo + CHUNK], dtype=np.float32)
        g = np.ascontiguousarray(g_all[lo:lo + CHUNK], dtype=np.float32)
        wn, gn = np.isnan(w), np.isnan(g)
        res.bit_identical += int(np.count_nonzero((w.view(np.uint32) == g.view(np.uint32)) | (wn & gn)))
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        finite = np.isfinite(w) & np.isfinite(g)
        ok = (finite & (diff <= bound)) | (w == g) | (wn & gn)
        res.over_tolerance += int(ok.size - np.count_nonzero(ok))
        if finite.any():
            res.max_abs_diff = max(res.max_abs_diff, float(diff[finite].max()))
        if (~finite & ~ok).any():
            res.max_abs_diff = math.inf
        steps = np.abs(_ordered(g.view(np.uint32)) - _ordered(w.view(np.uint32))) / 65536.0
        steps = np.where(wn | gn, np.where(wn & gn, 0.0, np.inf), steps)
        res.within_one_step += int(np.count_nonzero(steps <= 1.0))
        if steps.size:
            res.max_bf16_steps = max(res.max_bf16_steps, float(steps.max()))
    res.ok = res.over_tolerance == 0
    return res


@dataclass
class CompareReport:
    """Every tensor's result, the verdict, and the text and JSON forms of both."""

    golden: str
    candidate: str
    results: list = field(default_factory=list)
    subset: bool = False      # a tensor only in the golden is not a failure

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
        idx = [r for r in self.results if r.kind == "index"]
        flt = [r for r in self.results if r.kind == "float"]
        elems = sum(r.size for r in flt)
        return {
            "ok": self.ok,
            "compared": len(idx) + len(flt),
            "index_tensors": len(idx),
            "index_rows": sum(r.rows for r in idx),
            "index_rows_differ": sum(r.rows_differ for r in idx),
            "float_tensors": len(flt),
            "float_elements": elems,
            "float_over_tolerance": sum(r.over_tolerance for r in flt),
            "max_bf16_steps": max((r.max_bf16_steps for r in flt), default=0.0),
            "within_one_step_fraction": (sum(r.within_one_step for r in flt) / elems) if elems else 1.0,
            "bit_identical_fraction": (sum(r.bit_identical for r in flt) / elems) if elems else 1.0,
            "only_in_golden": sum(r.kind == "only-golden" for r in self.results),
            "only_in_candidate": sum(r.kind == "only-candidate" for r in self.results),
            "shape_mismatches": sum(r.kind == "shape" for r in self.results),
            "failing_tensors": len(self.failures),
            "tolerance": TOLERANCE,
        }

    def summary_line(self) -> str:
        s = self.summary()
        parts = [f"{s['compared']} tensors compared",
                 f"index rows {s['index_rows'] - s['index_rows_differ']}/{s['index_rows']} identical",
                 f"floats max {_fmt_steps(s['max_bf16_steps'])} bf16 steps, "
                 f"{100 * s['within_one_step_fraction']:.3f}% within 1 step, "
                 f"{100 * s['bit_identical_fraction']:.3f}% bit-identical"]
        if s["only_in_golden"]:
            parts.append(f"{s['only_in_golden']} only in {self.golden}")
        if s["only_in_candidate"]:
            parts.append(f"{s['only_in_candidate']} only in {self.candidate}")
        verdict = "OK" if self.ok else (f"FAIL ({s['failing_tensors']} tensors disagree)"
                                        if s["compared"] else "FAIL (no tensor in common)")
        return f"{verdict}: " + "; ".join(parts)

    def text(self, limit: int = 50) -> str:
        """One line per failing tensor (at most ``limit``), then the summary line."""
        lines = [r.line() for r in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more failing tensors (--json lists all)")
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
            if r.kind in ("index", "float", "shape"):
                groups.setdefault(_group_of(r.name), []).append(r)
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


def _group_of(name: str) -> str:
    m = STEP_NAME.fullmatch(name)
    if m:
        return m.group(3)
    return "weights" if WEIGHT_NAME.fullmatch(name) else name


def compare_files(golden_path, candidate_path, subset: bool = False) -> CompareReport:
    """Compare every tensor of two goldens (safetensors or reference .npz, either side).

    A tensor only in the golden fails unless ``subset`` (the candidate then need only carry
    some of the golden's tensors, e.g. a kernel's outputs); one only in the candidate is
    reported but does not fail.
    """
    with GoldenFile(golden_path) as golden, GoldenFile(candidate_path) as cand:
        report = CompareReport(golden.path, cand.path, subset=subset)
        cand_names = set(cand.names)
        for name in golden.names:
            if name in cand_names:
                report.add(compare_tensor(name, golden.get(name), cand.get(name)))
            else:
                report.add(TensorResult(name, "only-golden", ok=subset,
                                        detail=f"missing from {cand.path}"))
        gold_names = set(golden.names)
        for name in cand.names:
            if name not in gold_names:
                report.add(TensorResult(name, "only-candidate", ok=True,
                                        detail=f"not in {golden.path}"))
    return report

