"""A model checkpoint directory in the released layout, as a golden's weights (``--weights DIR``).

Not to be confused with :mod:`.checkpoint`, the *resume* checkpoints a streamed run keeps beside
its output: this module reads the model's published weights, as DeepSeek releases them:

* ``config.json``: the reference's ``ModelArgs`` fields (the non-attention ones are kept aside,
  see :data:`~ds41numba.config.IGNORED_KEYS`);
* ``model.safetensors.index.json``: ``weight_map``, tensor name -> shard file (or, for a small
  model, a single ``model.safetensors``);
* the shards. Of them only the attention parameters of the layers a run asks for are read
  (:func:`~ds41numba.stack.weight_specs` names them), each memory-mapped on its own
  (:mod:`.tensor_files`), never a whole shard.

A parameter ``layers.{i}.attn.NAME`` is looked for under that name, with a ``model.`` prefix,
and for a draft layer (:meth:`~ds41numba.config.AttnConfig.draft_layers`, layer
``n_layers + k``) also as ``mtp.{k}.attn.NAME`` (with or without ``model.``). It is stored

* ``BF16`` or ``F32``, used as it is (a bf16 parameter stored as F32 must hold bf16 values; an
  f32 parameter stored as BF16 widens exactly), or
* ``F8_E4M3`` (a 2-D bf16 linear only) with its scale beside it under the module's name
  (``...wq_a.scale`` for ``...wq_a.weight``, as the reference's ``Linear`` names it): one scale
  per 32 x 32 block, ``[ceil(out/32), ceil(in/32)]``, stored as ``F8_E8M0`` (a biased exponent
  byte e: 2^(e - 127)) or ``F32``. It is dequantized as the reference's fp8-to-bf16 cast does:
  each e4m3 value widened to float32, times its block's scale in float32, rounded to bf16 (RNE).
  With e8m0 scales the product is exact, so only the final rounding can round.

Everything about the directory is checked when it is opened (names, shards, dtypes, shapes,
scales and their values), before any output is touched: a missing tensor, a dtype or shape that
does not fit the config, a scale of the wrong shape or a NaN/inf one, a shard the index names but
the directory lacks are each a one-line :class:`GoldenError` naming the tensor and the file.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16, float8_e4m3fn
from numba import prange

from ..jit import njit
from ..config import AttnConfig
from ..numerics import FP8_BLOCK, is_bf16_valued
from ..numerics.formats import bf16_scalar
from ..stack import weight_specs
from .errors import GoldenError
from .generator import LazyWeights
from .tensor_files import StoredTensor, read_header

__all__ = ["WeightsDir", "INDEX_FILE", "SINGLE_FILE", "dequantize_fp8", "load_dir_config",
           "dir_config_differences"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: What a golden's ``weights`` metadata says about how fp8 weights became its bf16 ones.
DEQUANTIZED = ("F8_E4M3 x its 32x32 block's scale (F8_E8M0: 2^(e-127), or F32), the product in "
               "float32, rounded to bf16 (RNE), as the reference's fp8-to-bf16 cast")

_E4M3 = np.arange(256, dtype=np.uint8).view(float8_e4m3fn).astype(np.float32)
_E8M0 = np.array([2.0 ** (e - 127) for e in range(255)] + [np.nan], np.float32)   # exact


@njit(parallel=True)
def _dequantize_blocks(q, scale, lut, out_bits, block):
    """``out_bits[r, c]``: the bf16 pattern of ``lut[q[r, c]] * scale[r // block, c // block]``
    (a float32 product, then RNE). Each block rounds its 256 possible products once, into a
    table its elements then look up."""
    rows, cols = q.shape
    table = np.empty((scale.shape[0], lut.size), np.uint16)
    for rb in prange(scale.shape[0]):
        tab = table[rb]
        for b in range(scale.shape[1]):
            s = scale[rb, b]
            for k in range(lut.size):
                v = np.float32(bf16_scalar(lut[k] * s))
                tab[k] = np.uint16(v.view(np.uint32) >> np.uint32(16))
            for r in range(rb * block, min(rows, (rb + 1) * block)):
                for c in range(b * block, min(cols, (b + 1) * block)):
                    out_bits[r, c] = tab[q[r, c]]


def dequantize_fp8(q, scale) -> np.ndarray:
    """An fp8 e4m3 weight ``q`` (its bytes, uint8 ``[out, in]``) times its block scales
    ``scale`` (float32 ``[ceil(out/32), ceil(in/32)]``), rounded to bf16: an ``ml_dtypes``
    bfloat16 array, as the reference's fp8-to-bf16 cast makes it."""
    q = np.asarray(q)
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    if q.dtype != np.uint8 or q.ndim != 2:
        raise ValueError(f"dequantize_fp8: expected the uint8 bytes of a 2-D weight, got "
                         f"{q.dtype} {list(q.shape)}")
    want = _scale_shape(q.shape)
    if scale.shape != want:
        raise ValueError(f"dequantize_fp8: scale has shape {list(scale.shape)}, expected {list(want)}")
    out = np.empty(q.shape, np.uint16)
    _dequantize_blocks(q, scale, _E4M3, out, FP8_BLOCK)
    return out.view(bfloat16)


def _scale_shape(shape) -> tuple[int, int]:
    return tuple(-(-int(d) // FP8_BLOCK) for d in shape)


def load_dir_config(path) -> AttnConfig:
    """The config of a checkpoint directory (its ``config.json``), as a :class:`GoldenError`
    naming the file when it is missing or unusable."""
    path = _checked_dir(path)
    try:
        return AttnConfig.from_json(os.path.join(path, CONFIG_FILE))
    except ValueError as e:
        raise GoldenError(f"--weights: {os.path.join(path, CONFIG_FILE)}: {e}") from None


def _checked_dir(path) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise GoldenError(f"--weights: {path!r} is not a directory")
    return path


@dataclass(frozen=True)
class _Source:
    """Where one parameter comes from: its tensor, and its block scales (an fp8 one)."""

    tensor: StoredTensor
    kind: str                       # the parameter's kind, weight_specs': "bf16" | "f32"
    scale: StoredTensor | None = None


class WeightsDir(LazyWeights):
    """The attention parameters of ``layers`` in the checkpoint directory ``path``, as the
    weights mapping an :class:`~ds41numba.AttentionStack` takes (``get(name)`` reads one,
    nothing is kept): 2-D bf16 parameters as ``ml_dtypes`` bfloat16 arrays, the others as
    float32. ``made(name, array, kind)``, if given, sees each as it is read (a streamed golden
    writes it then), as :class:`~.generator.GeneratedWeights` does.

    :meth:`provenance` is what a golden records about them (names, shards, checksums);
    :meth:`verify` checks a directory against such a record.
    """

    def __init__(self, path, config: AttnConfig, layers, made=None):
        self.path = _checked_dir(path)
        self.config = config
        self.layers = tuple(layers)
        self.made = made
        self._provenance = None
        self.specs = {n: v for i in self.layers for n, v in weight_specs(config, i).items()}
        weight_map, index = self._weight_map()
        self.index_file = index
        headers = {}
        self.sources = {}
        for name, (shape, kind) in self.specs.items():
            self.sources[name] = self._source(name, shape, kind, weight_map, headers)

    def with_made(self, made) -> "WeightsDir":
        """The same directory, opened already, with another ``made`` callback."""
        other = object.__new__(WeightsDir)
        other.__dict__.update(self.__dict__)
        other.made = made
        return other

    # ------------------------------------------------------------------ opening
    def _weight_map(self) -> tuple[dict, str]:
        """``(tensor name -> shard file, the file that says so)``."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not a mapping")
            except OSError as e:
                raise GoldenError(f"--weights: cannot read {index!r}: {e.strerror}") from None
            except (ValueError, KeyError, TypeError) as e:
                raise GoldenError(f"--weights: {INDEX_FILE} is not a checkpoint index (no "
                                  f"usable weight_map: {e})") from None
            return weight_map, INDEX_FILE
        single = os.path.join(self.path, SINGLE_FILE)
        if os.path.exists(single):
            return {name: SINGLE_FILE for name in read_header(single)}, SINGLE_FILE
        raise GoldenError(f"--weights: {self.path!r} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    def _stored(self, name: str, weight_map: dict, headers: dict, what: str) -> StoredTensor:
        """Checkpoint tensor ``name`` (which the index names) from its shard."""
        shard = weight_map[name]
        path = os.path.join(self.path, str(shard))
        if shard not in headers:
            if not os.path.isfile(path):
                raise GoldenError(f"--weights: {what} is in shard {shard}, which "
                                  f"{self.index_file} names but the directory lacks")
            headers[shard] = read_header(path)
        if name not in headers[shard]:
            raise GoldenError(f"--weights: {what} is not in {shard}, where {self.index_file} "
                              f"says it is")
        return headers[shard][name]

    def candidates(self, name: str) -> list[str]:
        """The checkpoint names parameter ``name`` (``layers.{i}.attn.X``) may have, in the
        order they are looked for."""
        layer, leaf = name.split(".", 2)[1], name.split(".attn.", 1)[1]
        names = [name, "model." + name]
        drafts = self.config.draft_layers()
        if int(layer) in drafts:
            k = int(layer) - drafts.start
            names += [f"mtp.{k}.attn.{leaf}", f"model.mtp.{k}.attn.{leaf}"]
        return names

    def _source(self, name, shape, kind, weight_map, headers) -> _Source:
        found = [c for c in self.candidates(name) if c in weight_map]
        if not found:
            raise GoldenError(f"--weights: {name} (shape {list(shape)}) is missing from "
                              f"{self.index_file}")
        t = self._stored(found[0], weight_map, headers, found[0])
        where = f"{t.name} in {t.file}"
        allowed = ("BF16", "F32") + (("F8_E4M3",) if kind == "bf16" and len(shape) == 2 else ())
        if t.dtype not in allowed:
            raise GoldenError(f"--weights: {where} is {t.dtype}; this parameter is "
                              f"{kind} {list(shape)}, stored as {' or '.join(allowed)}")
        if t.shape != tuple(shape):
            raise GoldenError(f"--weights: {where} has shape {list(t.shape)}; the config "
                              f"makes it {list(shape)}")
        if t.dtype != "F8_E4M3":
            return _Source(t, kind)
        scale_name = t.name[:-len(".weight")] + ".scale"
        if scale_name not in weight_map:
            raise GoldenError(f"--weights: {scale_name}, the scale of the F8_E4M3 {where}, is "
                              f"missing from {self.index_file}")
        s = self._stored(scale_name, weight_map, headers, scale_name)
        swhere = f"{s.name} in {s.file}"
        if s.dtype not in ("F8_E8M0", "F32"):
            raise GoldenError(f"--weights: {swhere} is {s.dtype}; a block scale is F8_E8M0 or F32")
        if s.shape != _scale_shape(shape):
            raise GoldenError(f"--weights: {swhere} has shape {list(s.shape)}; one scale per "
                              f"{FP8_BLOCK}x{FP8_BLOCK} block of {list(shape)} is "
                              f"{list(_scale_shape(shape))}")
        if not np.isfinite(_scales(s)).all():
            raise GoldenError(f"--weights: {swhere} holds a NaN or infinite scale")
        return _Source(t, kind, s)

    # ------------------------------------------------------------------ the mapping
    def make(self, name: str, shape, kind: str) -> np.ndarray:
        return self.read(name)

    def read(self, name: str) -> np.ndarray:
        """Parameter ``name`` as the stack takes it (see the class docstring)."""
        src = self.sources[name]
        t = src.tensor
        if src.scale is not None:
            return dequantize_fp8(t.array(), _scales(src.scale))
        a = t.array()
        if src.kind == "bf16" and a.ndim == 2 and t.dtype == "BF16":
            return a                # mapped: the stack packs its own copy, a block at a time
        a = np.array(a, dtype=np.float32)
        if src.kind == "bf16" and not is_bf16_valued(a):
            raise GoldenError(f"--weights: {t.name} in {t.file} is F32 with values that are not "
                              f"bf16, but the reference holds this parameter in bf16")
        return a

    # ------------------------------------------------------------------ provenance
    def provenance(self, stored: bool = True) -> dict:
        """What a golden records about these weights: for every parameter the checkpoint
        tensor it came from, its shard, dtype and the SHA-256 of its stored bytes (and its
        scale's), and whether the golden keeps the weights themselves (``stored``). The
        checksums are taken once."""
        if self._provenance is None:
            stored = [t for src in self.sources.values() for t in (src.tensor, src.scale) if t]
            # hashlib lets go of the GIL: the tensors are hashed on every core at once
            with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
                sums = dict(zip(stored, pool.map(StoredTensor.sha256, stored)))
            tensors = {}
            for name, src in self.sources.items():
                entry = _describe(src.tensor, sums)
                if src.scale is not None:
                    entry["scale"] = _describe(src.scale, sums)
                tensors[name] = entry
            self._provenance = {"source": "checkpoint directory",
                                "directory": os.path.basename(os.path.abspath(self.path)),
                                "index": self.index_file, "fp8": DEQUANTIZED, "tensors": tensors}
        return {**self._provenance, "stored": bool(stored)}

    def verify(self, recorded: dict, golden: str) -> None:
        """Check that this directory holds the very tensors a golden (``golden``, its path)
        recorded in its ``weights`` metadata: a :class:`GoldenError` naming the first that
        differs."""
        mine = self.provenance()["tensors"]
        for name, want in sorted(recorded.get("tensors", {}).items()):
            have = mine.get(name)
            if have is None:
                raise GoldenError(f"--weights: {golden!r} ran on {name}, which this replay "
                                  f"does not read")
            for part in (None, "scale"):
                w = want if part is None else want.get(part)
                h = have if part is None else have.get(part)
                if w is None and h is None:
                    continue
                if w is None or h is None or w.get("sha256") != h.get("sha256"):
                    t = (h or w)["tensor"]
                    f = (h or w)["file"]
                    raise GoldenError(f"--weights: {t} in {f} is not the tensor {golden!r} ran "
                                      f"on (its checksum differs)")


def _scales(s: StoredTensor) -> np.ndarray:
    """A block-scale tensor as float32 values."""
    a = s.array()
    return _E8M0[a] if s.dtype == "F8_E8M0" else np.array(a, dtype=np.float32)


def _describe(t: StoredTensor, sums: dict) -> dict:
    return {"tensor": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape),
            "sha256": sums[t]}


def dir_config_differences(a: AttnConfig, b: AttnConfig) -> list[str]:
    """The attention fields on which two configs differ, in field order."""
    da, db = a.to_dict(), b.to_dict()
    return [k for k in da if da[k] != db[k]]
