"""Step: the reference call a layer's step is part of, table-driven."""

from __future__ import annotations

import numpy as np
import pytest

from ds41numba.batch import BatchRow
from ds41numba.step import Step

# (start_pos, seqlen, prefill_len, batch size) -> decode, chunk, ref_start, ref_end, ref_seqlen,
# ref_rows: the reference runs a prefill as one call of every prompt row (a chunk of it
# included) and a decode step as a call of one row; a batch multiplies the rows by B.
CASES = [
    ((0, 12, None, 1), (False, False, 0, 12, 12, 12)),      # a one-shot prefill
    ((0, 5, 12, 1), (False, True, 0, 12, 12, 12)),          # the first chunk of it
    ((5, 7, 12, 1), (False, True, 0, 12, 12, 12)),          # the last chunk
    ((0, 12, 12, 1), (False, True, 0, 12, 12, 12)),         # the one-shot prefill as a chunk
    ((12, 1, None, 1), (True, False, 12, 13, 1, 1)),        # a decode step
    ((12, 1, None, 4), (True, False, 12, 13, 1, 4)),        # ... of a batch of 4: M = B
    ((5, 7, 12, 3), (False, True, 0, 12, 12, 36)),          # a chunk of a batch of 3
    ((1048575, 1, None, 1), (True, False, 1048575, 1048576, 1, 1)),
]


@pytest.mark.parametrize("args, want", CASES)
def test_step_says_the_reference_call(args, want):
    start_pos, seqlen, prefill_len, size = args
    s = Step(start_pos, seqlen, prefill_len, BatchRow(0, size))
    assert (s.decode, s.chunk, s.ref_start, s.ref_end, s.ref_seqlen, s.ref_rows) == want
    assert s.end == start_pos + seqlen
    assert s.call_row == (start_pos if s.chunk else 0)
    assert s.positions.dtype == np.int64
    assert np.array_equal(s.positions, np.arange(start_pos, start_pos + seqlen))


@pytest.mark.parametrize("args", [(-1, 1, None), (0, 0, None), (5, 8, 12), (0, 4, 3), (0, 4, 4.0),
                                  (True, 1, None), (0, 2, True)])
def test_a_step_that_cannot_be_is_one_line(args):
    with pytest.raises(ValueError, match=r"^Step: "):
        Step(*args)
