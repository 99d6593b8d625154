"""Tensors of safetensors files this tool did not write, read memory-mapped one at a time.

A released checkpoint's shards are gigabytes each and hold mostly tensors attention never reads
(experts, embeddings), and a file of engine activations may hold every layer's: so a file's
header is parsed on its own (:func:`read_header`) and each tensor is a :class:`StoredTensor`
that maps just its own bytes when asked (``numpy.memmap``), never the whole file. The dtypes are
read from the header as they are named there (``F8_E4M3``, ``F8_E8M0`` too, which numpy and
safetensors' numpy loader cannot hold): callers decide what each may be. Shared by the
checkpoint reader (:mod:`.weights_dir`) and the inputs reader (:mod:`.inputs_file`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16

from .errors import GoldenError

__all__ = ["StoredTensor", "read_header", "ITEMSIZE"]

#: Bytes an element of each safetensors dtype takes.
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
            "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
            "F64": 8}
#: numpy dtype a tensor is mapped as: its own where numpy has it, else its raw bytes (uint8).
_NUMPY = {"BF16": np.dtype(bfloat16), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
          "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "F8_E4M3": np.dtype(np.uint8),
          "F8_E8M0": np.dtype(np.uint8)}
_MAX_HEADER = 1 << 28      # safetensors' own limit on the JSON header


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are, and views of them on request."""

    name: str
    path: str          # the file holding it
    dtype: str         # the safetensors dtype name
    shape: tuple
    offset: int        # of its first byte in the file
    nbytes: int

    @property
    def file(self) -> str:
        """The file's name (what error messages and a golden's metadata call it)."""
        return os.path.basename(self.path)

    def raw(self) -> np.ndarray:
        """The stored bytes, memory-mapped (read-only, uint8)."""
        if self.nbytes == 0:
            return np.zeros(0, np.uint8)
        try:
            return np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.offset,
                             shape=(self.nbytes,))
        except (OSError, ValueError) as e:
            raise GoldenError(f"{self.name} in {self.file}: cannot read it ({e})") from None

    def array(self) -> np.ndarray:
        """The tensor memory-mapped in its shape: its own numpy dtype (bf16 as ml_dtypes'),
        or its raw bytes (uint8) for the float8 formats."""
        if self.dtype not in _NUMPY:
            raise GoldenError(f"{self.name} in {self.file}: dtype {self.dtype} is not readable here")
        return self.raw().view(_NUMPY[self.dtype]).reshape(self.shape)

    def sha256(self) -> str:
        """SHA-256 of the stored bytes, as they are in the file (a block at a time)."""
        h = hashlib.sha256()
        raw = self.raw()
        block = 1 << 24
        for a in range(0, raw.size, block):
            h.update(raw[a:a + block])
        del raw
        return h.hexdigest()


def read_header(path: str) -> dict[str, StoredTensor]:
    """Every tensor of the safetensors file ``path`` by name (its ``__metadata__`` left out),
    checked against the file's size; a file that is not one is a :class:`GoldenError`."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise GoldenError(f"{name} is not a safetensors file (no header)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise GoldenError(f"cannot read {path!r}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise GoldenError(f"{name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise GoldenError(f"{name} is not a safetensors file (its header is not a mapping)")
    start = 8 + n
    out = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            a, b = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise GoldenError(f"{key} in {name}: unusable header entry {entry!r}") from None
        if dtype not in ITEMSIZE or any(d < 0 for d in shape):
            raise GoldenError(f"{key} in {name}: unknown dtype {dtype!r} or shape {list(shape)}")
        if b - a != math.prod(shape) * ITEMSIZE[dtype] or a < 0 or start + b > size:
            raise GoldenError(f"{key} in {name}: its bytes {a}..{b} do not fit its {dtype} "
                              f"{list(shape)} or the file (truncated?)")
        out[key] = StoredTensor(key, path, dtype, shape, start + a, b - a)
    return out
