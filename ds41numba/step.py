"""One forward call of the reference as a layer sees it: :class:`Step`.

The reference's ``Attention.forward(x, start_pos)`` is either a prefill (``start_pos == 0``, the
whole prompt in one call) or a decode step (one token at ``start_pos > 0``). ds41numba also runs
a prefill in chunks (``prefill_len``: rows ``start_pos ..`` of a prefill that long), and each
chunk's every result must be the one-shot prefill's rows. Two things follow from the call, not
from the rows a chunk holds: the products' row count, by which oneDNN and MKL choose their
summation order (docs/exactness.md), and the positions the call's keys reach, which set how
many compressed positions its queries are scored against. :class:`Step` says both once, for
the window, the compressor, the indexer and the captures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import SINGLE, BatchRow
from .numerics import is_int

__all__ = ["Step"]


@dataclass(frozen=True)
class Step:
    """Rows ``start_pos .. start_pos + seqlen - 1`` of one forward call of the reference: a
    prefill in one call (``start_pos == 0``), a chunk of a prefill of ``prefill_len`` tokens,
    or a decode step (one row at ``start_pos > 0``, ``prefill_len`` None). ``batch``: the
    sequence's place in a batch run in lockstep (:mod:`ds41numba.batch`).

    Callers check their own arguments first (their messages name them; a decode step of more
    than one row is refused where it matters); a Step with positions or a prefill length that
    cannot be is a ValueError here too.
    """

    start_pos: int
    seqlen: int
    prefill_len: int | None = None
    batch: BatchRow = SINGLE

    def __post_init__(self):
        if not (is_int(self.start_pos, 0) and is_int(self.seqlen, 1)):
            raise ValueError(f"Step: need start_pos >= 0 and seqlen >= 1 (integers), got "
                             f"{self.start_pos!r} and {self.seqlen!r}")
        if self.prefill_len is not None and not is_int(self.prefill_len, self.end):
            raise ValueError(f"Step: prefill_len must be an integer >= {self.end} (the chunk's "
                             f"end), got {self.prefill_len!r}")

    @property
    def chunk(self) -> bool:
        """The rows are a chunk of a prefill given in pieces (``prefill_len``)."""
        return self.prefill_len is not None

    @property
    def decode(self) -> bool:
        """A decode step: one token after the prefill."""
        return self.prefill_len is None and self.start_pos > 0

    @property
    def end(self) -> int:
        """The position after the step's last row."""
        return self.start_pos + self.seqlen

    @property
    def ref_start(self) -> int:
        """The position of the reference call's first row: 0 for a chunk (the prefill's)."""
        return 0 if self.chunk else self.start_pos

    @property
    def call_row(self) -> int:
        """The step's first row among the reference call's rows: a chunk's start, else 0."""
        return self.start_pos - self.ref_start

    @property
    def ref_end(self) -> int:
        """The position after the reference call's last row: the whole prefill's length for a
        chunk. A query of a prefill is scored against ``ref_end // ratio`` positions (those
        past it masked), whichever chunk it is in."""
        return self.prefill_len if self.chunk else self.end

    @property
    def ref_seqlen(self) -> int:
        """The rows of the reference call, per sequence: the whole prefill's (a chunk's too),
        the step's own otherwise (1 at a decode step)."""
        return self.prefill_len if self.chunk else self.seqlen

    @property
    def ref_rows(self) -> int:
        """The row count M of the reference call's products (:attr:`ref_seqlen` times the
        batch): what their summation order follows."""
        return self.batch.rows(self.ref_seqlen)

    @property
    def positions(self) -> np.ndarray:
        """The rows' positions, int64."""
        return np.arange(self.start_pos, self.end, dtype=np.int64)
