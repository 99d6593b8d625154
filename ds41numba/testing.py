"""Assertions for your own test suite, with exactly the rules of ``ds41numba compare``.

Each raises an ``AssertionError`` whose message is the comparison's report line, and returns
the :class:`~ds41numba.golden.TensorResult` (or the :class:`~ds41numba.golden.CompareReport`)
when it passes::

    from ds41numba import testing
    testing.assert_golden_tensor("g.safetensors", "step0.layers.20.out", my_out)
    testing.assert_golden_tensor("g.safetensors", "step0.layers.20.shared.topk_idxs", my_topk)
    testing.assert_candidate_file("g.safetensors", "mine.safetensors")

* :func:`assert_close`: a float tensor within the bf16 tolerance
  (``|got - want| <= 2 * 2^-8 * max|want| + 1e-6``), NaN matching NaN, infinities exactly;
* :func:`assert_index_rows`: index rows, tie-aware (identical or boundary swaps, judged by the
  golden's scores; :mod:`ds41numba.golden.ties`) or exact;
* :func:`assert_golden_tensor`: a tensor of a golden file by name, by the rule its name calls
  for (index selections tie-aware with the file's recorded scores and the run's visibility);
* :func:`assert_candidate_file`: a whole candidate file, as ``compare`` judges it.

A batch's golden (``--batch B``) holds every tensor but the weights as ``[B, ...]``: pass
``batch_row=b`` to :func:`assert_golden_tensor` and :func:`golden_scores` with sequence b's
tensor (``assert_candidate_file`` judges every row).

Arrays may be any numeric numpy dtype, ``ml_dtypes.bfloat16`` included. From torch, hand over
``t.float().numpy()`` (bf16 -> f32 is exact) or the raw bits ``t.view(torch.int16).numpy()``
through :func:`from_bf16_bits`; ds41numba never imports torch.
"""

from __future__ import annotations

import numpy as np

from .golden import GoldenFile, compare_files
from .golden.files import BatchRowFile
from .golden.compare import Judge, TensorResult, compare_tensor, file_scores
from .golden.captures import STEP_NAME
from .golden.rows import held_positions
from .golden.ties import DEFAULT_INDEX_TOLERANCE, RowBounds, RowScores

__all__ = ["from_bf16_bits", "golden_scores", "assert_close", "assert_index_rows",
           "assert_golden_tensor", "assert_candidate_file", "suite_cases"]


def from_bf16_bits(bits) -> np.ndarray:
    """float32 values of bf16 bit patterns: how a torch bf16 tensor crosses without torch here.

    Args:
        bits: int16 or uint16 array of bf16 bit patterns, e.g. ``t.view(torch.int16).numpy()``.

    Returns:
        A float32 array of the same shape holding the same values (bf16 -> f32 is exact).

    Raises:
        TypeError: ``bits`` is not int16 or uint16.

    Example:
        >>> from_bf16_bits(np.array([0x3F80, 0xC000], np.uint16))
        array([ 1., -2.], dtype=float32)
    """
    b = np.asarray(bits)
    if b.dtype not in (np.int16, np.uint16):
        raise TypeError(f"from_bf16_bits: expected int16 or uint16 bit patterns, got {b.dtype}")
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _check(res: TensorResult) -> TensorResult:
    if not res.ok:
        raise AssertionError(res.line())
    return res


def assert_close(got, want, name: str = "tensor", after_swaps=None) -> TensorResult:
    """``got`` within the bf16 float tolerance of ``want``, as ``compare`` judges a float tensor.

    The tolerance is ``2 * 2^-8 * max|want| + 1e-6`` for every element; NaN matches NaN and
    infinities must match exactly.

    Args:
        got: your tensor (any numeric dtype, ``ml_dtypes.bfloat16`` included).
        want: the golden's tensor, of the same shape.
        name: what the failure message calls the tensor.
        after_swaps: first-axis rows downstream of a differing index row (they attended other
            rows), held only to the golden tensor's range (``SWAP_FLOAT_RANGE``).

    Returns:
        The comparison (:class:`~ds41numba.golden.TensorResult`: largest difference, bf16
        steps, share bit-identical, ...).

    Raises:
        AssertionError: an element is out of tolerance; the message is ``compare``'s line.
    """
    return _check(compare_tensor(name, want, got, relaxed_rows=after_swaps))


def golden_scores(golden, step: int, layer: int, batch_row: int | None = None) -> RowScores | None:
    """The scores a golden file records behind a layer's index selection at a step.

    Args:
        golden: a path or an open :class:`~ds41numba.golden.GoldenFile`.
        step: 0 for the prefill, s for the s-th decode step.
        layer: an index source of the run.
        batch_row: in a batch's golden (``--batch``), the sequence.

    Returns:
        A :class:`~ds41numba.golden.RowScores` (what :func:`assert_index_rows` takes as
        ``scores``; ``.take(rows)`` picks rows), or None when the file records none there.
    """
    with _open(golden) as f:
        return file_scores(_sequence(f, batch_row))(step, layer)


def assert_index_rows(got, want, scores: RowScores | dict | None = None, offset: int | None = None,
                      visible=None, window: bool = False,
                      tolerance: float = DEFAULT_INDEX_TOLERANCE, exact: bool = False,
                      name: str = "index rows") -> TensorResult:
    """Index rows ``got [rows, width]`` against the golden's ``want``, tie-aware.

    A row passes when it holds the golden's entries (order is not compared) or differs only by
    boundary swaps: every dropped and added position scores within ``tolerance`` x the row's
    largest |selected score| of the row's k-th score. Without ``scores`` any difference fails.

    Args:
        got: your rows, integer, ``-1`` for an empty entry.
        want: the golden's rows (e.g. ``shared.topk_idxs`` at the rows you test).
        scores: the golden's scores behind the rows (:func:`golden_scores`, or a dict with
            ``topk_idxs``, ``topk_scores``, ``runner_idxs``, ``runner_scores``).
        offset: the window rows before the compressed entries (an entry ``e`` is compressed
            position ``e - offset``); with ``visible``, entries past a query's view are wrong.
        visible: per row, how many compressed positions the query sees.
        window: the rows list window entries first (``idx`` rows) rather than only compressed
            ones (``shared.topk_idxs``).
        tolerance: the boundary band, relative to the row's scale (default 1/16).
        exact: rows must be identical (no swaps).
        name: what the failure message calls the tensor.

    Returns:
        The comparison (:class:`~ds41numba.golden.TensorResult`), with the swaps it accepted.

    Raises:
        AssertionError: a row is wrong; the message names the first row and its reason.
    """
    if isinstance(scores, dict):
        scores = RowScores(np.asarray(scores["topk_idxs"]), scores["topk_scores"],
                           np.asarray(scores["runner_idxs"]), scores["runner_scores"])
    bounds = None
    if offset is not None:
        clen = None if visible is None else np.broadcast_to(np.asarray(visible, np.int64),
                                                            (np.asarray(want).shape[0],))
        bounds = RowBounds(int(offset), clen, window)
    return _check(compare_tensor(name, want, got, scores=scores, bounds=bounds,
                                 index_tolerance=None if exact else tolerance))


def assert_golden_tensor(golden, name: str, got, index_tolerance: float | None = None,
                         exact_index: bool = False, after_swaps=None,
                         batch_row: int | None = None) -> TensorResult:
    """A tensor of a golden file against ``got``, by the rule ``compare`` applies to its name.

    An index selection (``idx``, ``shared.topk_idxs``) is judged tie-aware with the file's
    recorded scores and the run's visibility; a float tensor within the bf16 tolerance. In a
    batch's golden (``--batch``) ``got`` is sequence ``batch_row``'s tensor, judged against row
    ``batch_row`` of the file's ``[batch, ...]`` tensor with that sequence's scores.

    Args:
        golden: a path or an open :class:`~ds41numba.golden.GoldenFile`.
        name: the tensor, e.g. ``"step0.layers.20.sample.index_score"``.
        got: your tensor, of the golden tensor's shape.
        index_tolerance: the boundary band (default 1/16 of the row's scale).
        exact_index: index rows must be identical.
        after_swaps: rows held only to the golden tensor's range, as in :func:`assert_close`.
        batch_row: in a batch's golden, the sequence.

    Returns:
        The comparison (:class:`~ds41numba.golden.TensorResult`).

    Raises:
        KeyError: the file holds no tensor ``name``.
        AssertionError: the tensor disagrees; the message is ``compare``'s line.

    Example:
        >>> with GoldenFile("golden.safetensors") as g:
        ...     assert_golden_tensor(g, "step0.layers.20.out", my_layer(g))
    """
    with _open(golden) as opened:
        f = _sequence(opened, batch_row)
        if name not in f:
            raise KeyError(f"{f.path!r} holds no tensor {name!r}")
        want = f.get(name)
        if after_swaps is not None:
            return _check(compare_tensor(name, want, got, relaxed_rows=after_swaps))
        m = STEP_NAME.fullmatch(name)
        held = None if m is None else held_positions(f, int(m.group(2)))
        positions = {} if held is None else {int(m.group(2)): held}   # a --rows golden's rows
        judge = Judge(f.step_info(), file_scores(f), index_tolerance, exact_index,
                      positions=positions)
        return _check(judge.compare(name, want, np.asarray(got), f))


def assert_candidate_file(golden, candidate, subset: bool = True,
                          index_tolerance: float | None = None, exact_index: bool = False):
    """A whole candidate file against a golden, as ``ds41numba compare [--subset]`` judges it.

    Args:
        golden: the golden file (a ds41numba ``.safetensors`` or a reference ``.npz``).
        candidate: your file (safetensors or ``.npz``) under the golden's tensor names.
        subset: the candidate may leave out tensors of the golden (``--subset``).
        index_tolerance: the boundary band (default 1/16 of the row's scale).
        exact_index: index rows must be identical.

    Returns:
        The :class:`~ds41numba.golden.CompareReport`.

    Raises:
        AssertionError: a tensor disagrees; the message is the report (failing tensors, then
            the summary line).
    """
    report = compare_files(golden, candidate, subset=subset, index_tolerance=index_tolerance,
                           exact_index=exact_index)
    if not report.ok:
        raise AssertionError(report.text())
    return report


def _sequence(f: GoldenFile, batch_row: int | None):
    """``f`` itself (one sequence), or its sequence ``batch_row`` when it holds a batch; a
    batch without ``batch_row`` (or a row it lacks) is refused."""
    info = f.step_info()
    batch = 1 if info is None else info.batch
    if batch == 1 and batch_row in (None, 0):
        return f
    if batch_row is None or not 0 <= batch_row < batch:
        raise ValueError(f"{f.path!r} holds a batch of {batch} sequences: give batch_row "
                         f"0..{batch - 1}, got {batch_row!r}")
    return BatchRowFile(f, batch_row)


def suite_cases(directory) -> list:
    """The cases of a ``ds41numba suite`` directory as pytest parameters (ids: the case names),
    each a :class:`~ds41numba.golden.suite_inputs.SuiteCase` (its manifest ``entry``, its
    ``golden``, :meth:`~ds41numba.golden.suite_inputs.SuiteCase.indexer_inputs`)::

        @pytest.mark.parametrize("case", testing.suite_cases("suite-dir"))
        def test_my_indexer(case):
            for step in case.steps():
                for layer in case.index_layers():
                    i = case.indexer_inputs(step, layer)
                    got = my_indexer(i.index_q, i.weights, i.keys, i.visible, i.topk) + i.offset
                    testing.assert_index_rows(got, i.want, i.evidence, i.offset, i.visible)

    The manifest and every case file's checksum are checked first: a directory that is not a
    suite, or an edited case, is an error at collection.
    """
    import pytest
    from .golden.suite_inputs import read_suite
    return [pytest.param(case, id=case.name) for case in read_suite(directory)]


class _open:
    """A GoldenFile for a path (closed after), or the caller's open one (left open)."""

    def __init__(self, golden):
        self.own = not isinstance(golden, GoldenFile)
        self.f = GoldenFile(golden) if self.own else golden

    def __enter__(self) -> GoldenFile:
        return self.f

    def __exit__(self, *exc):
        if self.own:
            self.f.close()
