"""The prefill rows a golden holds, and matching two goldens' rows by position.

A ``--rows`` golden answers only some of its prefill's query rows: ``step0.layers.{i}.rows``
(int32) lists their positions, and every per-row tensor of that step and layer (``x``, ``out``,
``idx``, the selection and its scores) holds those rows in that order. A full golden holds
every row (position = row). Comparing two goldens, each side's rows are taken at the positions
both hold (:func:`match_rows`), so a rows golden compares with a full one, either way round,
and with another rows golden.
"""

from __future__ import annotations

import numpy as np

from .captures import SCORE_CAPTURES, STEP_NAME, STREAMED_MODES
from .errors import GoldenError

__all__ = ["PER_ROW", "runs", "checked_rows", "held_positions", "RowsOf", "match_rows"]

#: The step-0 tensors with one row per query row (the ones a ``--rows`` golden cuts).
PER_ROW = ("x", "out", "q", "o", "idx", "index_score", "shared.topk_idxs",
           "shared.candidates") + SCORE_CAPTURES


def runs(rows) -> list[tuple[int, int]]:
    """``(first, n)`` of each run of consecutive positions in sorted ``rows``."""
    rows = np.asarray(rows, np.int64)
    if not rows.size:
        return []
    cut = np.flatnonzero(np.diff(rows) != 1) + 1
    starts, ends = rows[np.r_[0, cut]], rows[np.r_[cut - 1, rows.size - 1]]
    return [(int(a), int(b - a + 1)) for a, b in zip(starts, ends)]


def checked_rows(rows, prefill: int, capture: str, capture_rows) -> tuple[int, ...]:
    """A run's ``--rows``, sorted: prefill positions, answered only in a streamed run; the
    prefill's ``capture_rows`` must be among them (a sample is an answered row's)."""
    rows = tuple(sorted({int(p) for p in rows}))
    if capture not in STREAMED_MODES:
        raise GoldenError(f"--rows: only a streamed run (--capture {' or '.join(STREAMED_MODES)}) "
                          f"answers some prefill rows, not --capture {capture}")
    if rows and not 0 <= rows[0] <= rows[-1] < prefill:
        raise GoldenError(f"--rows: positions must lie in 0..{prefill - 1} (the prefill), "
                          f"got {rows[0] if rows[0] < 0 else rows[-1]}")
    unanswered = sorted(set(p for p in capture_rows if p < prefill) - set(rows))
    if unanswered:
        raise GoldenError(f"--capture-rows: prefill position {unanswered[0]} is not among "
                          f"--rows (only answered rows are sampled)")
    return rows


def held_positions(f, layer: int) -> np.ndarray | None:
    """The prefill positions file ``f`` holds of ``layer`` (its ``rows`` tensor), or None when it
    holds every row."""
    name = f"step0.layers.{layer}.rows"
    return np.asarray(f.get(name), np.int64) if name in f else None


class RowsOf:
    """A golden file whose step-0 per-row tensors read as the rows ``take[layer]`` (indices into
    what the file holds); everything else is the file's."""

    def __init__(self, f, take: dict[int, np.ndarray], positions: dict[int, np.ndarray]):
        self.file, self.take, self.positions = f, take, positions
        self.path, self.names, self.kind, self.metadata = f.path, f.names, f.kind, f.metadata

    def __contains__(self, name):
        return name in self.file

    def step_info(self):
        return self.file.step_info()

    def get(self, name: str) -> np.ndarray:
        m = STEP_NAME.fullmatch(name)
        if m and m.group(1) == "0" and int(m.group(2)) in self.take:
            layer, what = int(m.group(2)), m.group(3)
            if what == "rows":
                return self.positions[layer].astype(np.int32)
            if what in PER_ROW:
                return self.file.get_rows(name, self.take[layer])
        return self.file.get(name)


def _layers(f) -> set[int]:
    out = set()
    for name in f.names:
        m = STEP_NAME.fullmatch(name)
        if m and m.group(1) == "0":
            out.add(int(m.group(2)))
    return out


def match_rows(golden, candidate, prefill: int | None):
    """Both files as :class:`RowsOf` at the positions both hold, ``{layer: positions}``, and
    ``{layer: golden positions the candidate lacks}``; the files themselves (and empty dicts)
    when neither cuts its rows. ``prefill``: the golden's prefill length (a full file's rows)."""
    take_g, take_c, positions, lacking = {}, {}, {}, {}
    for i in sorted(_layers(golden) | _layers(candidate)):
        g, c = held_positions(golden, i), held_positions(candidate, i)
        if g is None and c is None:
            continue
        every = np.arange(prefill if prefill is not None else 0, dtype=np.int64)
        g_all, c_all = (every if g is None else g), (every if c is None else c)
        common = np.intersect1d(g_all, c_all)
        take_g[i] = np.searchsorted(g_all, common)
        take_c[i] = np.searchsorted(c_all, common)
        positions[i] = common
        missing = np.setdiff1d(g_all, common)
        if missing.size:
            lacking[i] = missing
    if not positions:
        return golden, candidate, positions, lacking
    return (RowsOf(golden, take_g, positions), RowsOf(candidate, take_c, positions), positions,
            lacking)
