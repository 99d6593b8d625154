"""Which rows of the reference's products one sequence's rows are, in a batch.

The reference runs a batch of ``B`` sequences in lockstep: one ``start_pos`` for the whole
batch, ``x`` of shape ``[B, seqlen, dim]``. Every projection (``F.linear`` on ``[B, seqlen,
...]``) multiplies the ``B * seqlen`` rows as one matrix, row ``b * seqlen + s`` being
sequence b's row s, and its oneDNN (bf16) and MKL (f32) kernels choose their summation order by
that row count and, for MKL's f32 rule, by the row's place in it (docs/exactness.md):

* bf16 linears: one row (M = 1) sums K in runs of 512, two or more rows in runs of 1024 above
  K = 1024. A batched decode step of B >= 2 is M = B: the many-row order, unlike a single
  sequence's decode step. Which row a row is does not matter.
* f32 linears (the ratio > 1 compressor's ``wkv``/``wgate``): M = 1 the gemv kernel, M = 2-3
  the small kernel, M >= 4 the blocked one, except that with the reference's two threads and
  4 < M < 12, M % 4 != 0, the last M % 4 rows take the small kernel, whose first lane start
  (peel) follows the row's address, ``(b * seqlen + s) * dim`` floats into the input. So the
  row's index in the ``B * seqlen`` rows matters.

A row's sum depends on nothing else, so ds41numba runs each sequence of a batch on its own
(:class:`~ds41numba.batched.BatchedStack`: its states, caches and shared slots are per sequence,
as the reference's ``[B, ...]`` buffers are) and tells every product which call its rows belong
to: :class:`BatchRow`. The other operations of a layer are per row or per query and do not see
the batch: RMSNorm, RoPE, the quantisers, the compressor's pooling (per group and feature),
the indexer's scores (exact fp4 products; their mix over heads is per query), top-k and the
candidate blocks (per query row), and sparse attention, whose products are per query: its
``q [H, hd]`` against the query's listed rows is an MKL product of M = H rows (the heads),
whatever B is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .numerics import is_int

__all__ = ["BatchRow", "SINGLE", "checked_batch"]


@dataclass(frozen=True)
class BatchRow:
    """Sequence ``index`` of a batch of ``size`` sequences run in lockstep (the default: a
    sequence run alone). The reference's product over a step of ``seq_rows`` rows per sequence
    has :meth:`rows` rows, of which this sequence's row s is row :meth:`first` ``(seq_rows, s)``."""

    index: int = 0
    size: int = 1

    def __post_init__(self):
        for name in ("index", "size"):
            v = getattr(self, name)
            if not is_int(v):
                raise TypeError(f"BatchRow: {name} must be an int, got {type(v).__name__}")
        if self.size < 1 or not 0 <= self.index < self.size:
            raise ValueError(f"BatchRow: need 0 <= index < size and size >= 1, got index "
                             f"{self.index}, size {self.size}")

    def rows(self, seq_rows: int) -> int:
        """The M of the batch's product when each sequence gives ``seq_rows`` rows."""
        return self.size * int(seq_rows)

    def first(self, seq_rows: int, row: int = 0) -> int:
        """The index, in the batch's product, of this sequence's row ``row``."""
        return self.index * int(seq_rows) + int(row)


#: A sequence run alone: every product's rows are its own.
SINGLE = BatchRow()


def checked_batch(batch, name: str) -> BatchRow:
    """``batch`` if it is a :class:`BatchRow`, else a one-line TypeError naming ``name``."""
    if not isinstance(batch, BatchRow):
        raise TypeError(f"{name}: batch must be a BatchRow, got {type(batch).__name__}")
    return batch
