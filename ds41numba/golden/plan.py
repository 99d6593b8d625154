"""What a golden run does (:class:`GoldenPlan`): the stack, which of its layers, how long, which
seed, what to keep; the checks that refuse a plan that cannot run, and the stack a run drives
(:func:`make_stack`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..batched import BatchedStack
from ..config import AttnConfig
from ..numerics import is_int
from ..stack import AttentionStack, weight_specs
from .captures import CAPTURE_MODES, to_storage
from .drive import golden_steps
from .errors import GoldenError
from .files import RunInfo
from .generator import (GeneratedWeights, LazyWeights, batch_input_name, checked_profile,
                        checked_seed, make_input)
from .rows import checked_rows
from .weights_dir import WeightsDir
from .work import product_multiply_adds, total_work

__all__ = ["GoldenPlan", "missing_sources", "closed_selection", "make_stack"]


def missing_sources(config: AttnConfig, layers) -> list[str]:
    """One message per source a member of ``layers`` reads but that is not a member
    (:meth:`AttnConfig.missing_sources`)."""
    return list(dict.fromkeys(f"layer {i} needs layer {src} (its {role})"
                              for i, src, role in config.missing_sources(layers)))


def closed_selection(config: AttnConfig, layers) -> tuple[tuple[int, ...], dict[int, list[str]]]:
    """The smallest selection holding ``layers`` and every source its members read, theirs
    included (what ``--layers`` must name for ``layers`` to run), and why each added layer is
    needed: ``{source: ["layer 5's kv source", ...]}``."""
    closed, why = set(layers), {}
    while missing := config.missing_sources(closed):
        for i, src, role in missing:
            why.setdefault(src, []).append(f"layer {i}'s {role}")
        closed |= {src for _, src, _ in missing}
    return tuple(sorted(closed)), why


@dataclass(frozen=True)
class GoldenPlan:
    """What a golden run does: the stack, which of its layers, how long, which seed, what to keep.

    Weights and inputs are the generator's (``seed``, ``profile``) unless given: ``weights`` a
    :class:`~.weights_dir.WeightsDir` (``--weights DIR``) or any mapping of parameter name ->
    array (bf16 values where the parameter is bf16); ``inputs`` an
    :class:`~.inputs_file.InputsFile` (``--inputs FILE``). ``store_weights=False``
    (``--no-weights``, a checkpoint directory's weights only) leaves the weights out of the
    file, which then records their checksums for ``replay --weights DIR``.
    """

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    seed: int = 0
    capture: str = "all"
    preset: str = ""
    profile: str = "default"
    capture_rows: tuple[int, ...] = ()     # positions whose kernel inputs and outputs are sampled
    weights: object = field(default=None, compare=False, repr=False)
    inputs: object = field(default=None, compare=False, repr=False)
    store_weights: bool = True
    batch: int = 1                         # sequences in lockstep (docs/batches.md)
    rows: tuple[int, ...] | None = None    # the prefill rows answered (None: every one)

    def __post_init__(self):
        c = self.config
        if not is_int(self.batch, 1):
            raise GoldenError(f"--batch must be an integer >= 1, got {self.batch!r}")
        object.__setattr__(self, "batch", int(self.batch))
        if self.inputs is not None and getattr(self.inputs, "batch", 1) != self.batch:
            raise GoldenError(f"--inputs: the file was opened for a batch of {self.inputs.batch}, "
                              f"the run has --batch {self.batch}")
        for name in ("prefill", "decode"):
            v = getattr(self, name)
            if not is_int(v):
                raise GoldenError(f"--{name} must be an integer, got {v!r}")
        if self.prefill < 1:
            raise GoldenError(f"--prefill must be at least 1, got {self.prefill}")
        if self.decode < 0:
            raise GoldenError(f"--decode must be at least 0, got {self.decode}")
        if self.prefill + self.decode > c.max_seq_len:
            raise GoldenError(f"--prefill {self.prefill} + --decode {self.decode} tokens exceed the "
                              f"config's max_seq_len {c.max_seq_len}")
        checked_seed(self.seed)
        checked_profile(self.profile)
        rows = tuple(sorted({int(p) for p in self.capture_rows}))
        total = self.prefill + self.decode
        if rows and not 0 <= rows[0] <= rows[-1] < total:
            raise GoldenError(f"--capture-rows: positions must lie in 0..{total - 1} (the run's "
                              f"tokens), got {rows[0] if rows[0] < 0 else rows[-1]}")
        object.__setattr__(self, "capture_rows", rows)
        if self.rows is not None:
            if self.batch != 1:
                raise GoldenError("--rows: a batch (--batch > 1) answers every prefill row; "
                                  "run --rows without --batch")
            object.__setattr__(self, "rows", checked_rows(self.rows, self.prefill, self.capture,
                                                          self.capture_rows))
        if self.capture not in CAPTURE_MODES:
            raise GoldenError(f"--capture must be one of {', '.join(CAPTURE_MODES)}, got {self.capture!r}")
        if not self.layers:
            raise GoldenError("--layers selects no layer")
        for i in self.layers:
            if not 0 <= i < c.n_layers:
                raise GoldenError(f"--layers: layer {i} is not a layer of this config (0..{c.n_layers - 1})")
        object.__setattr__(self, "layers", tuple(sorted(set(int(i) for i in self.layers))))
        missing = missing_sources(c, self.layers)
        if missing:
            closed, why = closed_selection(c, self.layers)
            lacking = "; ".join(f"layer {src} ({', '.join(dict.fromkeys(w))})"
                                for src, w in sorted(why.items()))
            raise GoldenError(f"--layers: the selection lacks {lacking}; every source is needed, "
                              f"e.g. --layers {','.join(map(str, closed))}")
        self._check_sources()

    def _check_sources(self):
        """The given weights and inputs cover the run; only a checkpoint's weights may be left
        out of the file (they are found again by their checksums)."""
        if not self.store_weights and not isinstance(self.weights, WeightsDir):
            raise GoldenError("--no-weights: only a golden made from a checkpoint directory "
                              "(--weights DIR) may leave its weights out")
        if self.weights is not None:
            names = [n for i in self.layers for n in weight_specs(self.config, i)]
            absent = [n for n in names if n not in self.weights]
            if absent:
                raise GoldenError(f"weights: {absent[0]} is missing"
                                  + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
        if self.inputs is not None:
            absent = [i for i in self.layers if i not in self.inputs.sources]
            if absent or self.inputs.tokens < self.prefill + self.decode:
                raise GoldenError("--inputs: opened for other layers or fewer tokens than the run")

    def weight_mapping(self, made=None):
        """The run's weights as the mapping the stack takes; ``made(name, array, kind)``, if
        given, sees each as the stack takes it (a streamed golden writes it then)."""
        if self.weights is None:
            return GeneratedWeights(self.config, self.layers, self.seed, self.profile, made=made)
        if isinstance(self.weights, WeightsDir):
            return self.weights.with_made(made)
        return _GivenWeights(self.weights, self.config, self.layers, made)

    def input_rows(self, name: str, first_row: int, rows: int, start_pos: int,
                   batch_row: int = 0) -> np.ndarray:
        """Rows ``first_row ..`` of input ``name`` (``step{s}.layers.{i}.x``, its step starting
        at ``start_pos``) of the batch's sequence ``batch_row``, as the file stores them:
        bfloat16."""
        if self.inputs is not None:
            return self.inputs.rows(name, first_row, rows, start_pos, batch_row)
        x = make_input(batch_input_name(name, batch_row), (rows, self.config.dim), self.seed,
                       self.profile, first_row, start_pos)
        return to_storage(name, x, "BF16")

    def steps(self):
        """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
        return golden_steps(self.prefill, self.decode)

    @property
    def total_tokens(self) -> int:
        """Token-layers the run processes (the progress bar's unit), every sequence's."""
        return (self.prefill + self.decode) * len(self.layers) * self.batch

    @property
    def total_work(self) -> float:
        """The run's work in the progress bar's unit (:func:`total_work`)."""
        return (total_work(self.config, self.layers, self.prefill, self.decode, self.rows)
                * self.batch)

    @property
    def product_multiply_adds(self) -> float:
        """About how many multiply-adds the run's products take (:func:`product_multiply_adds`),
        every sequence's."""
        return (product_multiply_adds(self.config, self.layers, self.prefill + self.decode)
                * self.batch)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata (str -> str) that makes the file self-describing."""
        return RunInfo(self.config, self.layers, self.prefill, self.decode, self.capture,
                       self.seed, self.preset, self.profile, self.capture_rows,
                       self._weights_provenance(),
                       None if self.inputs is None else self.inputs.provenance(),
                       batch=self.batch, rows=self.rows).metadata()

    def _weights_provenance(self) -> dict | None:
        if self.weights is None:
            return None
        if isinstance(self.weights, WeightsDir):
            return self.weights.provenance(self.store_weights)
        return {"source": "given to the Python API", "stored": True}


class _GivenWeights(LazyWeights):
    """A mapping of weights given to a plan, calling ``made`` as the stack takes each."""

    def __init__(self, weights, config, layers, made):
        self.weights, self.made = weights, made
        self.specs = {n: v for i in layers for n, v in weight_specs(config, i).items()}

    def make(self, name: str, shape, kind: str):
        return self.weights[name]


def make_stack(config: AttnConfig, weights, layers, batch: int = 1):
    """The stack a run of ``batch`` sequences drives: an :class:`AttentionStack` for one (the
    single-sequence run, unchanged), a :class:`BatchedStack` for more."""
    if batch == 1:
        return AttentionStack(config, weights, layers=layers)
    return BatchedStack(config, weights, batch, layers=layers)
