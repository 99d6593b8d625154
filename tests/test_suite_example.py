"""The example of docs/suite.md: a naive numpy indexer checked on every case of a suite.

A kernel team's version is the test below with their kernel in place of ``numpy_indexer`` and
their suite directory (``ds41numba suite --preset v41-flash --layers 2,20 --out DIR``) in place
of the tiny one this file writes at collection.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import ml_dtypes
import numpy as np
import pytest

from ds41numba import testing
from ds41numba.cli import main

BF16 = ml_dtypes.bfloat16


def _bf16(a):
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def index_scores(index_q, weights, keys, visible):
    """The indexer's scores: bf16(sum over heads, in order, of bf16(relu(bf16(q_h . k)) * w_h)),
    -inf past each row's visible positions."""
    dots = _bf16(np.einsum("thd,nd->thn", index_q.astype(np.float64), keys.astype(np.float64)))
    with np.errstate(invalid="ignore"):      # 0 x an inf weight is NaN, as in the reference
        terms = _bf16(np.where(np.isnan(dots) | (dots > 0), dots, 0).astype(np.float32)
                      * weights[:, :, None])
    acc = np.zeros((index_q.shape[0], keys.shape[0]), np.float32)
    for h in range(index_q.shape[1]):
        acc = acc + terms[:, h]
    scores = _bf16(acc)
    scores[np.arange(keys.shape[0])[None, :] >= np.asarray(visible)[:, None]] = -np.inf
    return scores


def numpy_indexer(index_q, weights, keys, visible, topk, offset, candidates=None):
    """Each row's ``topk`` best positions (NaN first, then larger, ties by position), sorted,
    as ``position + offset``; -1 for a pick past the visible positions. ``candidates``: a mask
    of the positions a row may pick."""
    scores = index_scores(index_q, weights, keys, visible)
    if candidates is not None:
        scores = np.where(candidates, scores, -np.inf)
    out = np.full((scores.shape[0], topk), -1, np.int64)
    for s, row in enumerate(scores):
        order = np.lexsort((np.arange(row.size), -np.nan_to_num(row, nan=np.inf), ~np.isnan(row)))
        picked = np.sort(order[:topk])
        out[s, :picked.size] = np.where(picked < visible[s], picked + offset, -1)
    return np.sort(out, axis=1)


def _tiny_suite() -> str:
    """The tiny suite, written once per session (the parameters need it at collection)."""
    parent = tempfile.mkdtemp(prefix="ds41numba-suite-")
    atexit.register(shutil.rmtree, parent, True)
    directory = os.path.join(parent, "tiny")
    assert main(["suite", "--preset", "tiny", "--quiet", "--out", directory]) == 0
    return directory


SUITE = _tiny_suite()


@pytest.mark.parametrize("case", testing.suite_cases(SUITE))
def test_numpy_indexer_on_the_suite(case):
    for step in case.steps():
        for layer in case.index_layers():
            i = case.indexer_inputs(step, layer)
            mask = None
            if i.candidates is not None:
                from naive import select_candidate_blocks
                c = case.golden.run_info().config
                mask = select_candidate_blocks(i.candidates, i.visible, c.candidate_topk_blocks,
                                               c.candidate_block_size)
            testing.assert_close(index_scores(i.index_q, i.weights, i.keys, i.visible), i.scores,
                                 name=f"step{step}.layers.{layer}.sample.index_score")
            got = numpy_indexer(i.index_q, i.weights, i.keys, i.visible, i.topk, i.offset, mask)
            testing.assert_index_rows(got, i.want, i.evidence, offset=i.offset,
                                      visible=i.visible,
                                      name=f"step{step}.layers.{layer}.shared.topk_idxs")
