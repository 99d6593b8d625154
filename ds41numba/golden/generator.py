"""The deterministic generator of every weight and input: ``ds41numba-splitmix64-v1``.

Every weight and input is a function of (seed, tensor name, element index) only, so the values
do not depend on thread count, chunking or the order tensors are made in. For a tensor NAME with
shape S, the run's SEED (0 <= SEED < 2^64), all integer arithmetic modulo 2^64::

    mix64(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
               z = (z ^ (z >> 27)) * 0x94D049BB133111EB
               return z ^ (z >> 31)                       # SplitMix64's finaliser
    key      = mix64(SEED) ^ H(NAME)                      # H: BLAKE2b of NAME's UTF-8 bytes with
                                                          # an 8-byte digest (digest_size=8, no key),
                                                          # read as a little-endian uint64
    element n (0-based, row-major over S):
    bits     = mix64(key + (n + 1) * 0x9E3779B97F4A7C15)  # the n-th output of SplitMix64(key)
    m        = bits >> 40                                 # the top 24 bits
    t        = (2 * m + 1 - 2^24) / 2^24                  # in (-1, 1), symmetric, exact
    value    = float32(center + scale * t)                # float64 arithmetic, one RNE to float32
    BF16 tensors: value rounded to bfloat16 (RNE) as well

``center`` and ``scale`` (scale in float64, e.g. ``sqrt(3 / in)`` computed as such):

============================================  ======  ================  =====================
tensor                                        center  scale             why
============================================  ======  ================  =====================
``step{s}.layers.{i}.x``                      0       sqrt(3)           unit variance inputs
``layers.{i}.attn.attn_sink``                 0.25    0.25              small sink logits
1-D ``*norm.weight``                          1       0.2               norm gains around 1
2-D ``*.weight`` ``[out, in]``                0       sqrt(3 / in)      variance 1/in keeps
                                                                        activations O(1)
============================================  ======  ================  =====================

A tensor whose reference dtype is f32 (``attn_sink``, the ratio > 1 compressor's ``wkv`` and
``wgate``) keeps the float32 value; every other one is rounded to bf16.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from numba import njit, prange

from ..config import AttnConfig
from ..stack import weight_specs
from .errors import GoldenError

__all__ = ["GENERATOR", "GENERATOR_SPEC", "stream_key", "make_tensor", "weight_distribution",
           "make_weights", "make_input", "checked_seed"]

GENERATOR = "ds41numba-splitmix64-v1"

GENERATOR_SPEC = (
    "ds41numba-splitmix64-v1. All integer arithmetic mod 2^64. "
    "mix64(z): z=(z^(z>>30))*0xBF58476D1CE4E5B9; z=(z^(z>>27))*0x94D049BB133111EB; return z^(z>>31). "
    "key = mix64(seed) ^ H(name), H = BLAKE2b(UTF-8 name, digest_size=8) read little-endian. "
    "Element n (0-based, row-major): bits = mix64(key + (n+1)*0x9E3779B97F4A7C15); m = bits>>40; "
    "t = (2m + 1 - 2^24) / 2^24; value = float32(center + scale*t) computed in float64 and rounded "
    "once to float32 (RNE); BF16 tensors then rounded to bfloat16 (RNE). "
    "(center, scale): step{s}.layers.{i}.x (0, sqrt(3)); layers.{i}.attn.attn_sink (0.25, 0.25); "
    "1-D *norm.weight (1, 0.2); 2-D *.weight [out, in] (0, sqrt(3/in)). "
    "Tensors whose reference dtype is f32 (attn_sink, ratio>1 compressor.wkv/wgate) keep the "
    "float32 value."
)

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_FILL_BLOCK = 4096


def _mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (the scalar reference of the kernel's)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def stream_key(seed: int, name: str) -> int:
    """The SplitMix64 state a tensor's elements are counted from: ``mix64(seed) ^ H(name)``."""
    return _mix64(seed) ^ _name_hash(name)


@njit(cache=True)
def _fill_block(out_bits, key, start, center, scale, to_bf16, lo, hi):
    """Elements ``start + lo .. start + hi - 1`` of the stream ``key`` into ``out_bits[lo:hi]``."""
    buf = np.empty(hi - lo, np.float32)
    for j in range(lo, hi):
        z = key + np.uint64(start + j + 1) * _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        z = z ^ (z >> np.uint64(31))
        m = np.int64(z >> np.uint64(40))
        t = np.float64(2 * m + 1 - 16777216) * (1.0 / 16777216.0)
        buf[j - lo] = np.float32(center + scale * t)
    bits = buf.view(np.uint32)
    for j in range(lo, hi):
        v = bits[j - lo]
        if to_bf16:   # RNE to bf16 on the bit pattern; values are finite by construction
            v = (v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out_bits[j] = v


@njit(parallel=True, cache=True)
def _fill_bits_parallel(out_bits, key, start, center, scale, to_bf16):
    """Blocks in parallel. Each element depends only on its own index, so the result is the
    same for any thread count and any split of a tensor into calls."""
    n = out_bits.size
    for b in prange((n + _FILL_BLOCK - 1) // _FILL_BLOCK):
        lo = b * _FILL_BLOCK
        _fill_block(out_bits, key, start, center, scale, to_bf16, lo, min(lo + _FILL_BLOCK, n))


@njit(cache=True)
def _fill_bits_serial(out_bits, key, start, center, scale, to_bf16):
    """Small tensors: waking a thread pool would cost more than the work."""
    _fill_block(out_bits, key, start, center, scale, to_bf16, 0, out_bits.size)


_PARALLEL_FROM = 1 << 16  # elements


def make_tensor(name: str, shape, seed: int, center: float, scale: float, bf16: bool = True,
                start: int = 0) -> np.ndarray:
    """The generator's tensor ``name``: float32 ``shape`` (bf16 values when ``bf16``).

    ``start`` offsets the element counter, so a tensor can be made in pieces: the piece
    ``make_tensor(name, (k,), ..., start=n)`` equals elements ``n .. n+k-1`` of the whole.
    """
    seed = checked_seed(seed)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"make_tensor: negative dimension in shape {shape}")
    if not (math.isfinite(center) and math.isfinite(scale)):
        raise ValueError(f"make_tensor: center and scale must be finite, got {center}, {scale}")
    out = np.empty(shape, np.float32)
    fill = _fill_bits_parallel if out.size >= _PARALLEL_FROM else _fill_bits_serial
    fill(out.reshape(-1).view(np.uint32), np.uint64(stream_key(seed, name)), int(start),
         float(center), float(scale), bool(bf16))
    return out


def weight_distribution(name: str, shape) -> tuple[float, float]:
    """``(center, scale)`` of a parameter: values are uniform in ``center +- scale``."""
    leaf = name.rsplit(".attn.", 1)[-1]
    if leaf == "attn_sink":
        return 0.25, 0.25
    if name.endswith("norm.weight") and len(shape) == 1:
        return 1.0, 0.2
    if name.endswith(".weight") and len(shape) == 2:
        return 0.0, math.sqrt(3.0 / shape[1])
    raise ValueError(f"make_weights: no distribution for parameter {name!r} of shape {list(shape)}")


def make_weights(config: AttnConfig, layers=None, seed: int = 0) -> dict[str, np.ndarray]:
    """Every parameter of ``layers`` (default: all) as float32 arrays, bf16 values where bf16."""
    layers = range(config.n_layers) if layers is None else layers
    weights = {}
    for i in layers:
        for name, (shape, kind) in weight_specs(config, i).items():
            center, scale = weight_distribution(name, shape)
            weights[name] = make_tensor(name, shape, seed, center, scale, bf16=(kind == "bf16"))
    return weights


def make_input(name: str, shape, seed: int = 0, first_row: int = 0) -> np.ndarray:
    """A layer input (``step{s}.layers.{i}.x``): bf16 values with unit variance.

    ``first_row`` makes ``shape`` a block of rows of the whole input: rows ``first_row ..``,
    bit-identical to that slice of the whole (a chunked prefill makes its input a chunk at a
    time)."""
    row = math.prod(int(d) for d in tuple(shape)[1:])
    return make_tensor(name, shape, seed, 0.0, math.sqrt(3.0), bf16=True, start=int(first_row) * row)


def checked_seed(seed) -> int:
    """``seed`` as an int, or a :class:`GoldenError` unless it is an integer in 0 .. 2^64-1."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= _MASK64:
        raise GoldenError(f"seed must be an integer in 0 .. 2^64-1, got {seed!r}")
    return int(seed)
