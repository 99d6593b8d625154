"""Layer inputs from a file (``--inputs FILE``): e.g. hidden states dumped from an engine.

The file is a safetensors file holding, for each layer ``i`` a run selects, ``x.layers.{i}``
``[tokens, dim]``, or one ``x`` for every layer that has no tensor of its own. Row t is the
input at position t: the prefill's rows, then one row per decode step, so ``tokens`` must be at
least ``prefill + decode`` (rows past them are not read). ``BF16`` rows are used as they are;
``F32`` rows are rounded to bf16 (RNE), as the reference's cast of its input to bf16 does, and a
golden says in its metadata which tensors that changed. NaN and infinite values are taken as they
are (the reference propagates them). Tensors are memory-mapped, a block of rows read at a time.

The rows of a tensor are found by one function, :func:`layer_rows`. A batch's run
(``--batch B``, B > 1) takes each tensor as ``[B, tokens, dim]``: row ``[b, t]`` is sequence b's
input at position t (docs/batches.md).
"""

from __future__ import annotations

import os
import re

import numpy as np
from ml_dtypes import bfloat16

from ..config import AttnConfig
from ..numerics import is_bf16_valued, to_bf16_rne
from .errors import GoldenError
from .tensor_files import StoredTensor, read_header

__all__ = ["InputsFile", "layer_rows", "INPUT_NAME", "SHARED_INPUT"]

#: The tensor of layer i's inputs, and the one every other layer takes.
INPUT_NAME = "x.layers.{i}"
SHARED_INPUT = "x"
#: What a golden's ``inputs`` metadata says about F32 inputs.
ROUNDING = "F32 rows rounded to bf16 (RNE), as the reference's cast of its input to bf16"
_STEP_INPUT = re.compile(r"step(\d+)\.layers\.(\d+)\.x")
_ROWS_AT_ONCE = 1 << 12


def layer_rows(t: StoredTensor, dim: int, tokens: int, batch: int = 1) -> np.ndarray:
    """Tensor ``t`` as a layer's input rows ``[rows, dim]`` (memory-mapped), checked: 2-D, BF16
    or F32, ``dim`` wide, at least ``tokens`` rows; else a :class:`GoldenError` naming it. For a
    batch of ``batch`` > 1 sequences: ``[batch, rows, dim]``, 3-D."""
    where = f"--inputs: {t.name} in {t.file}"
    if t.dtype not in ("BF16", "F32"):
        raise GoldenError(f"{where} is {t.dtype}; inputs are BF16 or F32")
    lead = () if batch == 1 else (batch,)
    want = "[tokens, dim]" if batch == 1 else f"[{batch}, tokens, dim] (--batch {batch})"
    if len(t.shape) != 2 + len(lead) or tuple(t.shape[:len(lead)]) != lead or t.shape[-1] != dim:
        raise GoldenError(f"{where} has shape {list(t.shape)}; inputs are {want} with dim {dim}")
    if t.shape[-2] < tokens:
        raise GoldenError(f"{where} has {t.shape[-2]} rows; the run needs {tokens} (prefill + "
                          f"decode, one per position)")
    return t.array()


class InputsFile:
    """The inputs of ``layers`` in the file ``path``, for a run of ``tokens`` positions, checked
    when opened (every layer has its tensor, of the right dtype, width and length)."""

    def __init__(self, path, config: AttnConfig, layers, tokens: int, batch: int = 1):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GoldenError(f"--inputs: {self.path!r} is not a file")
        self.dim, self.tokens, self.batch = config.dim, int(tokens), int(batch)
        tensors = read_header(self.path)
        self.sources = {}
        for i in layers:
            name = INPUT_NAME.format(i=i)
            t = tensors.get(name, tensors.get(SHARED_INPUT))
            if t is None:
                raise GoldenError(f"--inputs: {os.path.basename(self.path)} has neither {name} "
                                  f"nor {SHARED_INPUT} for layer {i}")
            layer_rows(t, self.dim, self.tokens, self.batch)
            self.sources[int(i)] = t
        self._provenance = None

    def rows(self, name: str, first_row: int, rows: int, start_pos: int,
             batch_row: int = 0) -> np.ndarray:
        """The rows ``first_row ..`` (``rows`` of them) of input ``step{s}.layers.{i}.x`` whose
        step starts at position ``start_pos``, as bfloat16: positions ``start_pos + first_row
        ..`` of layer i's tensor (of a batch's, of its sequence ``batch_row``)."""
        m = _STEP_INPUT.fullmatch(name)
        if m is None or int(m.group(2)) not in self.sources:
            raise KeyError(name)
        t = self.sources[int(m.group(2))]
        a = start_pos + first_row
        block = layer_rows(t, self.dim, self.tokens, self.batch)
        block = block[a:a + rows] if self.batch == 1 else block[batch_row, a:a + rows]
        if t.dtype == "BF16":
            return np.array(block)
        return to_bf16_rne(np.array(block, dtype=np.float32)).astype(bfloat16)

    def provenance(self) -> dict:
        """What a golden records about its inputs: the file, and for every layer the tensor it
        read, its dtype, shape, SHA-256 of its stored bytes and whether rounding to bf16
        changed any value of the rows used."""
        if self._provenance is None:
            layers = {}
            for i, t in self.sources.items():
                layers[str(i)] = {"tensor": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                  "sha256": t.sha256(), "rounded_to_bf16": self._rounds(t)}
            rows = ("row t is position t" if self.batch == 1 else
                    "[b, t]: sequence b's position t")
            self._provenance = {"source": "inputs file", "file": os.path.basename(self.path),
                                "rows": rows, "f32": ROUNDING, "layers": layers}
        return self._provenance

    def _rounds(self, t: StoredTensor) -> bool:
        """Whether an F32 tensor's rows used hold a value that is not bf16."""
        if t.dtype != "F32":
            return False
        seqs = layer_rows(t, self.dim, self.tokens, self.batch)
        seqs = seqs[None] if self.batch == 1 else seqs
        return any(not is_bf16_valued(np.array(rows[a:min(self.tokens, a + _ROWS_AT_ONCE)]))
                   for rows in seqs for a in range(0, self.tokens, _ROWS_AT_ONCE))
