"""Where a float tensor disagrees: the rows (first axis) holding an element over the bound and
each one's worst element, gathered a chunk at a time as :func:`.tolerance._compare_float` reads the
tensor, and the cosine similarity engines' tests report."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ROWS_LISTED", "ROWS_SHOWN", "RowsOver", "cosine", "worst_lines", "fmt_steps", "count"]

#: Differing rows a result lists: an index tensor's, or a float tensor's over the bound (with its
#: worst element each).
ROWS_LISTED = 1000


def fmt_steps(v: float) -> str:
    """A count of bf16 steps: an integer as one, else three significant digits."""
    if not math.isfinite(v):
        return str(v)
    return f"{v:.0f}" if v == int(v) else f"{v:.3g}"


def count(n: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


#: Rows of a float tensor over tolerance the text names (--json lists up to ROWS_LISTED).
ROWS_SHOWN = 8


def worst_lines(rows_over: int, worst: list) -> str:
    """The text form of a float tensor's rows over tolerance: each with its worst element."""
    lines = [f"  {count(rows_over, 'row')} over tolerance; worst element of each "
             f"(row: position got want steps):"]
    for w in worst[:ROWS_SHOWN]:
        pos = "[" + ", ".join(str(i) for i in w["position"]) + "]"
        lines.append(f"    row {w['row']}: {pos} got {w['got']:.6g} want {w['want']:.6g} "
                     f"({fmt_steps(w['steps'])} steps)")
    if rows_over > ROWS_SHOWN:
        lines.append(f"    ... and {rows_over - ROWS_SHOWN} more rows (--json lists the first "
                     f"{min(rows_over, ROWS_LISTED)})")
    return "\n".join(lines)


def cosine(dots) -> float:
    """Cosine similarity from (g.w, g.g, w.w); 1 for two zero tensors, 0 for one."""
    gw, gg, ww = (float(x) for x in dots)
    if gg == 0 and ww == 0:
        return 1.0
    if gg == 0 or ww == 0:
        return 0.0
    return gw / math.sqrt(gg * ww)


class RowsOver:
    """The first-axis rows of a float tensor that hold an element over the bound, and for the
    first ``ROWS_LISTED`` of them their worst element (largest |diff|; NaN or infinity where the
    golden has none counts as infinite), gathered chunk by chunk in row order."""

    def __init__(self, shape, row_ids=None):
        self.shape = tuple(int(d) for d in shape)
        n = self.shape[0]
        self.row_size = max(1, math.prod(self.shape[1:]))
        self.over = np.zeros(n, bool)
        self.row_ids = None if row_ids is None else np.asarray(row_ids, np.int64)
        self.worst: dict[int, tuple] = {}     # local row -> (badness, flat index, got, want, steps)

    def note(self, lo, bad, badness, g, w, steps):
        """The elements ``bad`` (ascending, into the chunk at flat index ``lo``) are over."""
        rows = (lo + bad) // self.row_size
        self.over[rows] = True
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])   # each distinct row's first
        # Rows only grow from chunk to chunk: past the first ROWS_LISTED nothing more is kept.
        keep = ROWS_LISTED - len(self.worst) + (int(rows[0]) in self.worst)
        if keep <= 0:
            return
        end = starts[keep] if keep < starts.size else rows.size
        bad, rows = bad[:end], rows[:end]
        order = np.lexsort((-badness[bad], rows))         # by row, the worst first
        for i in order[np.r_[True, rows[order][1:] != rows[order][:-1]]]:
            r, j = int(rows[i]), int(bad[i])
            if r not in self.worst or badness[j] > self.worst[r][0]:
                self.worst[r] = (float(badness[j]), lo + j, float(g[j]), float(w[j]),
                                 float(steps[j]))

    def fill(self, res):
        ids = self.row_ids
        res.rows = self.shape[0]
        res.rows_differ = int(np.count_nonzero(self.over))
        res.row_worst = []
        for r in sorted(self.worst):
            _, flat, g, w, steps = self.worst[r]
            row = int(ids[r]) if ids is not None else r
            rest = np.unravel_index(flat % self.row_size, self.shape[1:]) if len(self.shape) > 1 else ()
            res.row_worst.append({"row": row, "position": [row] + [int(i) for i in rest],
                                  "got": g, "want": w, "steps": steps})
        res.first_rows = [w["row"] for w in res.row_worst]


