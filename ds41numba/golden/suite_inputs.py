"""Reading a suite (:mod:`.suite`) back: each case's golden, manifest entry and the indexer's
captured inputs at the positions that matter, ready for a kernel under test.

:func:`ds41numba.testing.suite_cases` hands these to pytest; a kernel team's test takes a
:class:`SuiteCase`, runs its kernel on :meth:`SuiteCase.indexer_inputs` and asserts with the
checks of :mod:`ds41numba.testing`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..indexer import visible_lengths
from .files import GoldenFile
from .ties import RowScores
from .suite import read_manifest

__all__ = ["SuiteCase", "IndexerInputs", "read_suite"]


@dataclass
class IndexerInputs:
    """What the indexer of layer ``layer`` consumed and produced at the case's positions of
    step ``step`` (one row per position; ``rows`` are their rows within the step).

    ``index_q [n, heads, dim]``, ``weights [n, heads]`` and ``keys [positions, dim]`` are the
    kernel's inputs; ``visible [n]`` the compressed positions each row sees, ``offset`` what a
    selected position is shifted by (the rows sparse attention lists before the compressed
    ones), ``topk`` the selection's width. ``scores [n, positions]`` are the golden's index
    scores, ``want [n, topk]`` its selection and ``evidence`` the recorded scores that judge a
    boundary swap (for :func:`ds41numba.testing.assert_index_rows`). ``candidates``: for a
    layer that selects only among the candidate source's blocks, that source's scores of the
    same rows (its blocks are picked from them), else None.
    """

    step: int
    layer: int
    rows: np.ndarray
    positions: np.ndarray
    index_q: np.ndarray
    weights: np.ndarray
    keys: np.ndarray
    visible: np.ndarray
    offset: int
    topk: int
    scores: np.ndarray
    want: np.ndarray
    evidence: RowScores | None
    candidates: np.ndarray | None = None


class SuiteCase:
    """One case of a suite: ``name``, its manifest ``entry`` (covers, lengths, layers,
    positions, catches), ``path`` and its golden, opened on first use (``golden``: a
    :class:`~.files.GoldenFile`, tensors read one at a time)."""

    def __init__(self, directory: str, entry: dict):
        self.directory = directory
        self.entry = entry
        self.name = entry["name"]
        self.path = os.path.join(directory, entry["file"])
        self._golden = None

    def __repr__(self):
        return f"SuiteCase({self.name!r})"

    @property
    def golden(self) -> GoldenFile:
        if self._golden is None:
            self._golden = GoldenFile(self.path)
        return self._golden

    def close(self):
        if self._golden is not None:
            self._golden.close()
            self._golden = None

    def steps(self) -> list[int]:
        """The steps that hold one of the case's positions, in order."""
        return sorted({p["step"] for p in self.entry["positions"]})

    def index_layers(self) -> list[int]:
        """The index sources among the case's layers (of the case's ratio, when it has one)."""
        return list(self.entry["index_layers"])

    def indexer_inputs(self, step: int, layer: int) -> IndexerInputs:
        """The indexer's inputs and outputs of ``layer`` at the case's positions of ``step``."""
        g = self.golden
        run = g.run_info()
        c = run.config
        prefix = f"step{step}.layers.{layer}."
        rows = np.asarray(g.get(prefix + "sample.rows"), np.int64)
        start = 0 if step == 0 else run.prefill + step - 1
        seqlen = run.prefill if step == 0 else 1
        r = c.ratio(layer)
        visible = visible_lengths(start, seqlen, r)[rows]
        topk = g.get(prefix + "shared.topk_idxs")
        full = g.get(prefix + "topk_scores"), g.get(prefix + "runner_idxs"), g.get(prefix + "runner_scores")
        evidence = RowScores(topk[rows], full[0][rows], full[1][rows], full[2][rows], "golden")
        n, ih, dim = rows.size, c.index_n_heads, c.index_head_dim

        def get(name, shape):
            # A step with no compressed position yet scores nothing: no samples were recorded.
            return np.asarray(g.get(name), np.float32) if name in g else np.zeros(shape, np.float32)

        candidates = None
        if c.uses_candidates(layer):
            candidates = get(f"step{step}.layers.{c.candidate_source_layer}.sample.index_score",
                             (n, 0))
        return IndexerInputs(step, layer, rows, start + rows,
                             get(prefix + "sample.index_q", (n, ih, dim)),
                             get(prefix + "sample.index_weights", (n, ih)),
                             get(prefix + "sample.index_k", (0, dim)), visible,
                             run.prefill if step == 0 else c.window_size, topk.shape[1],
                             get(prefix + "sample.index_score", (n, 0)), topk[rows], evidence,
                             candidates)


def read_suite(directory) -> list[SuiteCase]:
    """The cases of a suite directory, in the manifest's order, after checking every case
    file's checksum (a directory that is not a suite or an edited file: a GoldenError)."""
    directory = os.fspath(directory)
    return [SuiteCase(directory, e) for e in read_manifest(directory)["cases"]]
