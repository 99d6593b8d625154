"""Replaying a golden (:func:`replay`): every capture recomputed from the file's own weights
and inputs and judged by the rules of :mod:`.compare`, the recorded scores included."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from .captures import WEIGHT_NAME
from .cluster import InProcess
from .compare import Judge, compare_files, compare_order, file_scores
from .drive import drive
from .errors import GoldenError
from .files import BatchRowFile, GoldenFile, RunInfo
from .plan import GoldenPlan, make_stack
from .report import CompareReport
from .stream import stream_golden
from .tensor_result import TensorResult
from .weights_dir import WeightsDir

__all__ = ["StoredWeights", "replay_weights", "replay"]


class StoredWeights:
    """A golden's weights as a mapping that reads each one from the file when asked for it, so
    a replay holds them only in the stack's forms, never a dict of every float32 weight. A
    weight the stack asks for and the file lacks is the file's fault: a GoldenError."""

    def __init__(self, golden: GoldenFile):
        self.golden = golden

    def __contains__(self, name) -> bool:
        return name in self.golden

    def get(self, name: str, default=None):
        if name not in self.golden:
            raise GoldenError(f"{self.golden.path!r}: weight {name} is missing")
        return np.asarray(self.golden.get(name), dtype=np.float32)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.get(name)


def replay_weights(golden: GoldenFile, info: RunInfo, weights_dir=None):
    """The weights a replay of ``golden`` runs on: its own, or, for a golden that left them out
    (``--no-weights``), those of the checkpoint directory ``weights_dir`` once their checksums
    are those the golden recorded. ``weights_dir`` for any other golden is refused."""
    recorded = info.weights or {}
    from_dir = recorded.get("source") == "checkpoint directory"
    if weights_dir is not None:
        if not from_dir:
            raise GoldenError(f"--weights: {golden.path!r} was not made from a checkpoint "
                              f"directory; it replays on the weights it holds")
        found = WeightsDir(weights_dir, info.config, info.layers)
        found.verify(recorded, golden.path)
        return found
    if from_dir and not recorded.get("stored", True):
        raise GoldenError(f"{golden.path!r} does not hold its weights (made with --no-weights): "
                          f"replay it with --weights DIR, the checkpoint directory it was made "
                          f"from ({recorded.get('directory')})")
    return StoredWeights(golden)


def replay(path, progress=None, index_tolerance: float | None = None,
           exact_index: bool = False, weights_dir=None) -> CompareReport:
    """Recompute every capture of a golden from its own weights and inputs and compare, by the
    rules of :func:`compare_files` (tie-aware index rows unless ``exact_index``), except that
    the recorded scores must agree too (in rows whose selection is identical).

    Works on this tool's safetensors goldens and on the reference's ``.npz`` goldens (whose
    captures are then checked against ds41numba). ``progress(n, where)`` as in :func:`drive`.
    A golden made from a checkpoint directory with ``--no-weights`` needs ``weights_dir``
    (:func:`replay_weights`).

    A ``--rows`` golden holds the inputs of its answered prefill rows only: the replay makes
    the golden again as it was made (the generator's inputs of the file's seed and profile, the
    file's weights, the other rows' key side only), in a temporary file, and compares the two
    by the same rules, so it costs what making it cost, not the full run.

    Args:
        path: the golden to replay.
        progress: ``progress(n, where)`` or None.
        index_tolerance: the boundary band of tie-aware index rows (default 1/16).
        exact_index: index rows must be identical.
        weights_dir: the checkpoint directory of a golden made with ``--no-weights``.

    Returns:
        The :class:`~ds41numba.golden.CompareReport` (``.ok``, ``.table()``, ``.text()``).

    Raises:
        GoldenError: the file cannot be read or is not a golden.
    """
    with GoldenFile(path) as golden:
        info = golden.run_info()
        weights = replay_weights(golden, info, weights_dir)
        answered = info.row_positions(0)
        if answered is not None and info.inputs is not None:
            raise GoldenError(f"{golden.path!r}: a --rows golden made with --inputs holds only "
                              f"its answered rows' inputs; it cannot be replayed")
        try:
            if answered is not None:     # made again by the generator's run, which builds its stack
                return _replay_rows(golden, info, weights, progress, index_tolerance, exact_index)
            stack = make_stack(info.config, weights, info.layers, info.batch)
        except ValueError as e:
            raise GoldenError(f"{golden.path!r}: {e}") from None
        check = _Replay(golden, info, index_tolerance, exact_index)
        drive(stack, info.prefill, info.decode, info.capture, check.recorded_input, check.compare,
              progress, info.capture_rows)
        check.add_unproduced()
    return check.report


def _replay_rows(golden: GoldenFile, info: RunInfo, weights, progress, index_tolerance,
                 exact_index) -> CompareReport:
    """:func:`replay` of a ``--rows`` golden: the same plan run again into a temporary file (in
    ``TMPDIR``; as large as the golden) and the golden judged against it, tensor for tensor."""
    stored = (info.weights or {}).get("stored", True)
    plan = GoldenPlan(info.config, info.layers, info.prefill, info.decode, seed=info.seed,
                      capture=info.capture, preset=info.preset, profile=info.profile,
                      capture_rows=info.capture_rows, weights=weights, store_weights=stored,
                      rows=info.rows)
    with tempfile.TemporaryDirectory(prefix="ds41numba-replay-") as tmp:
        again = os.path.join(tmp, os.path.basename(golden.path))
        stream_golden(plan, again, progress=progress, cluster=InProcess())
        report = compare_files(golden.path, again, index_tolerance=index_tolerance,
                               exact_index=exact_index, strict_evidence=True)
    report.candidate = "replay"
    return report


class _Replay:
    """A replay's judgement as the drive runs: the recorded inputs it hands the stack, and each
    layer's captures compared with the file's as they come. A batch's sequences are judged one
    by one (:class:`~.files.BatchRowFile`), as compare does."""

    def __init__(self, golden: GoldenFile, info: RunInfo, index_tolerance, exact_index):
        self.golden, self.info = golden, info
        self.names = set(golden.names)
        self.files = ([golden] if info.batch == 1 else
                      [BatchRowFile(golden, b) for b in range(info.batch)])
        self.judges = [Judge(info, file_scores(f), index_tolerance, exact_index,
                             strict_evidence=True) for f in self.files]
        self.report = CompareReport(golden.path, "replay", index_rule=self.judges[0].rule)
        self.recomputed = set()

    def recorded_input(self, name, first_row, seqlen, start_pos, batch_row=0):
        """The file's input rows."""
        if name not in self.names:
            raise GoldenError(f"{self.golden.path!r}: input {name} is missing")
        self.recomputed.add(name)
        return np.asarray(self.files[batch_row].get(name), dtype=np.float32)

    def compare(self, prefix, captures, first_row, batch_row=0):
        """A layer's captures of a step against the file's, selections first
        (:func:`~.compare.compare_order`)."""
        f = self.files[batch_row]
        for what in sorted(captures, key=lambda w: compare_order(prefix + w)):
            name = prefix + what
            self.recomputed.add(name)
            if name in self.names:
                res = self.judges[batch_row].compare(name, f.get(name), captures[what], f)
                if self.info.batch > 1:
                    res.name = f"{name}[{batch_row}]"
                self.report.add(res)

    def add_unproduced(self):
        """Every tensor of the file the replay did not produce (weights aside) fails."""
        for name in self.golden.names:
            if name not in self.recomputed and not WEIGHT_NAME.fullmatch(name):
                self.report.add(TensorResult(name, "only-golden", ok=False,
                                             detail="in the file but not produced by the replay"))
