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

A batch of B sequences (``--batch B``, docs/batches.md) takes sequence 0's inputs as above and
sequence b's (b >= 1) from the tensor named ``batch{b}.step{s}.layers.{i}.x`` (the same rule,
seed and profile): ``batch_input_name``.

Profiles (``--profile``; the default is ``default``, the table above). ``ties`` makes the
indexer's scores tie-heavy, to stress top-k kernels, by changing the default tensors as follows
(``c = dim - 1``, the last input feature; ``R(p) = p mod 61`` for the token at position p)::

    indexer.wq_b.weight  [ih*id, q_lora]   every head's rows are head 0's (one query for all heads)
    indexer.wk.weight    [id, hd]          rows 1.. are zero: a key is +-K e_0, two values in all
    wq_a, wkv, compressor.wkv, compressor.wgate   column c is zero (feature c reaches nothing...)
    indexer.weights_proj.weight           column c is 1024 (... but the index head weights)
    step{s}.layers.{i}.x                  column c is 0, except +bf16max where R(p) = 17 and
                                          -bf16max where R(p) = 41

So a query's scores take two values, ``0`` (ReLU) and one other, over hundreds to thousands of
positions: most rows tie at the top-k boundary; the first rows of a prefill see fewer positions
than ``index_topk``; and at R(p) = 17 (41) the head weights overflow to +inf (-inf), which gives a
row of NaN (0 * inf) and +inf (-inf) scores. Nothing else in the layer sees feature c.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
from ml_dtypes import bfloat16 as BF16
from numba import prange

from ..jit import njit
from ..config import AttnConfig
from ..numerics import is_int, serial_twin
from ..stack import weight_specs
from .errors import GoldenError

__all__ = ["GENERATOR", "GENERATOR_SPEC", "PROFILES", "stream_key", "make_tensor",
           "weight_distribution", "make_weights", "make_weight", "GeneratedWeights", "LazyWeights",
           "make_input", "batch_input_name", "BATCH_INPUTS", "checked_seed", "checked_profile"]

#: Generator profiles: ``default`` (the table above) and ``ties`` (tie-heavy index scores).
PROFILES = ("default", "ties")
_TIES_PERIOD, _TIES_POS_INF, _TIES_NEG_INF = 61, 17, 41
_BF16_MAX = float(np.float32(3.3895313892515355e38))

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
    "float32 value. Profile ties (metadata profile=ties), with c = the last input feature and "
    "R(p) = p mod 61: indexer.wq_b rows of every head = head 0's; indexer.wk rows 1.. = 0; column "
    "c of wq_a, wkv, compressor.wkv, compressor.wgate = 0; column c of indexer.weights_proj = "
    "1024; x[:, c] = 0 except +bf16max (3.3895313892515355e38) where R(p) = 17, -bf16max where "
    "R(p) = 41."
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


@njit
def _fill_block(out_bits, key, start, center, scale, to_bf16, lo, hi):
    """Elements ``start + lo .. start + hi - 1`` of the stream ``key`` into ``out_bits[lo:hi]``:
    their f32 bit patterns (uint32 ``out_bits``) or, bf16 values, their bf16 ones (uint16)."""
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
    drop = np.uint32(32 - 8 * out_bits.itemsize)       # a uint16 output keeps the high half
    for j in range(lo, hi):
        v = bits[j - lo]
        if to_bf16:   # RNE to bf16 on the bit pattern; values are finite by construction
            v = (v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        out_bits[j] = v >> drop


@njit(parallel=True)
def _fill_bits_kernel(out_bits, key, start, center, scale, to_bf16):
    """Blocks in parallel. Each element depends only on its own index, so the result is the
    same for any thread count and any split of a tensor into calls."""
    n = out_bits.size
    for b in prange((n + _FILL_BLOCK - 1) // _FILL_BLOCK):
        lo = b * _FILL_BLOCK
        _fill_block(out_bits, key, start, center, scale, to_bf16, lo, min(lo + _FILL_BLOCK, n))


# Small tensors: waking a thread pool would cost more than the work.
_fill_bits_kernel_serial = serial_twin(_fill_bits_kernel)
_PARALLEL_FROM = 1 << 16  # elements


def make_tensor(name: str, shape, seed: int, center: float, scale: float, bf16: bool = True,
                start: int = 0, bfloat16: bool = False) -> np.ndarray:
    """The generator's tensor ``name``: float32 ``shape`` (bf16 values when ``bf16``), or with
    ``bf16`` and ``bfloat16`` the same values as an ``ml_dtypes.bfloat16`` array (half the bytes,
    none of them made twice).

    ``start`` offsets the element counter, so a tensor can be made in pieces: the piece
    ``make_tensor(name, (k,), ..., start=n)`` equals elements ``n .. n+k-1`` of the whole.
    """
    seed = checked_seed(seed)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"make_tensor: negative dimension in shape {shape}")
    if not (math.isfinite(center) and math.isfinite(scale)):
        raise ValueError(f"make_tensor: center and scale must be finite, got {center}, {scale}")
    halves = bool(bf16 and bfloat16)
    bits = np.empty(shape, np.uint16 if halves else np.uint32)
    fill = _fill_bits_kernel if bits.size >= _PARALLEL_FROM else _fill_bits_kernel_serial
    fill(bits.reshape(-1), np.uint64(stream_key(seed, name)), int(start), float(center),
         float(scale), bool(bf16))
    return bits.view(BF16 if halves else np.float32)


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


def checked_profile(profile) -> str:
    """``profile`` when it is one of :data:`PROFILES`, else a :class:`GoldenError`."""
    if profile not in PROFILES:
        raise GoldenError(f"--profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    return profile


def make_weights(config: AttnConfig, layers=None, seed: int = 0,
                 profile: str = "default") -> dict[str, np.ndarray]:
    """Every parameter of ``layers`` (default: all) as float32 arrays, bf16 values where bf16.

    Args:
        config: the stack's :class:`~ds41numba.AttnConfig`.
        layers: the layers whose parameters to make (default: all).
        seed: the generator seed, 0 .. 2^64 - 1.
        profile: ``"default"`` or ``"ties"`` (tie-heavy index scores).

    Returns:
        ``{"layers.{i}.attn.NAME": float32 array}``, the shapes of
        :func:`~ds41numba.weight_specs`; the same values on any machine.

    Raises:
        ValueError: an unknown profile or a seed out of range.
    """
    checked_profile(profile)
    layers = range(config.n_layers) if layers is None else layers
    return {name: make_weight(config, name, shape, kind, seed, profile)
            for i in layers for name, (shape, kind) in weight_specs(config, i).items()}


def make_weight(config: AttnConfig, name: str, shape, kind: str, seed: int = 0,
                profile: str = "default", bfloat16: bool = False) -> np.ndarray:
    """One parameter (``kind`` "bf16" or "f32", as :func:`weight_specs` gives it), exactly as
    :func:`make_weights` makes it; with ``bfloat16`` a bf16 one as an ``ml_dtypes.bfloat16``
    array (:func:`make_tensor`)."""
    center, scale = weight_distribution(name, shape)
    w = make_tensor(name, shape, seed, center, scale, bf16=(kind == "bf16"), bfloat16=bfloat16)
    if checked_profile(profile) == "ties":
        _tie_weight(config, name, w)
    return w


class LazyWeights:
    """Parameters as the mapping a stack takes, each made (or read) only when asked for:
    subclasses set ``specs`` (:func:`weight_specs`' ``{name: (shape, kind)}``) and ``made``, and
    define ``make(name, shape, kind)``. ``made(name, array, kind)``, if set, sees each tensor as
    it is made (a streamed golden writes it into the file then)."""

    specs: dict
    made = None

    def __contains__(self, name) -> bool:
        return name in self.specs

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def get(self, name: str, default=None):
        if name not in self.specs:
            return default
        shape, kind = self.specs[name]
        w = self.make(name, shape, kind)
        if self.made is not None:
            self.made(name, w, kind)
        return w

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.specs:
            raise KeyError(name)
        return self.get(name)


class GeneratedWeights(LazyWeights):
    """The parameters of ``layers`` as a mapping that makes each one when asked for it.

    A stack built from it holds its weights only in the forms it computes with, never a second
    dict of every layer's float32 arrays (at v41-flash a layer's weights are hundreds of MB).
    ``made(name, array, kind)``, if given, sees each tensor as it is made (a streamed golden
    writes it into the file). Nothing is kept: asking twice makes the tensor twice. The bf16
    parameters come as ``ml_dtypes.bfloat16`` arrays (the values :func:`make_weights` gives as
    float32): the file stores and the stack packs their bit patterns as they are.
    """

    def __init__(self, config: AttnConfig, layers, seed: int = 0, profile: str = "default",
                 made=None):
        self.config, self.seed, self.profile = config, checked_seed(seed), checked_profile(profile)
        self.specs = {n: v for i in layers for n, v in weight_specs(config, i).items()}
        self.made = made

    def make(self, name: str, shape, kind: str) -> np.ndarray:
        return make_weight(self.config, name, shape, kind, self.seed, self.profile, bfloat16=True)


def _tie_weight(config: AttnConfig, name: str, w: np.ndarray):
    """The ``ties`` profile's change to parameter ``name`` (module docstring), in place."""
    leaf = name.rsplit(".attn.", 1)[-1]
    if leaf == "indexer.wq_b.weight":
        idim = config.index_head_dim
        w[idim:] = np.tile(w[:idim], (config.index_n_heads - 1, 1))
    elif leaf == "indexer.wk.weight":
        w[1:] = 0
    elif leaf in ("wq_a.weight", "wkv.weight", "compressor.wkv.weight", "compressor.wgate.weight"):
        w[:, -1] = 0
    elif leaf == "indexer.weights_proj.weight":
        w[:, -1] = 1024.0


#: How the inputs of a batch's sequences are made (recorded in a batched golden's metadata).
BATCH_INPUTS = ("batch row 0: the tensor step{s}.layers.{i}.x (a single-sequence run's input); "
                "batch row b >= 1: the tensor named batch{b}.step{s}.layers.{i}.x; same seed, "
                "profile and rule (ties: R(p) of the row's own positions)")


def batch_input_name(name: str, batch_row: int = 0) -> str:
    """The generator's name for input ``name`` (``step{s}.layers.{i}.x``) of a batch's
    sequence ``batch_row``: the name itself for row 0, so a batch's first sequence is the
    single-sequence run's, ``batch{b}.NAME`` for the others (:data:`BATCH_INPUTS`)."""
    return name if batch_row == 0 else f"batch{int(batch_row)}.{name}"


def make_input(name: str, shape, seed: int = 0, profile: str = "default", first_row: int = 0,
               start_pos: int = 0) -> np.ndarray:
    """A layer input (``step{s}.layers.{i}.x``): bf16 values with unit variance; the ``ties``
    profile changes its last feature (module docstring).

    ``first_row`` makes ``shape`` a block of rows of the whole input: rows ``first_row ..``,
    bit-identical to that slice of the whole (a chunked prefill makes its input a chunk at a
    time), for either profile. ``start_pos`` is the position of the step's first row (a decode
    step's token), so row j of the block stands for position ``start_pos + first_row + j``.

    Args:
        name: the tensor's name, which seeds it with ``seed`` (e.g. ``"step0.layers.2.x"``).
        shape: ``(rows, dim)``.
        seed: the generator seed.
        profile: ``"default"`` or ``"ties"``.
        first_row: the block's first row within the whole input.
        start_pos: the position of the step's first row.

    Returns:
        A float32 array of bf16 values.

    Raises:
        ValueError: an unknown profile or a seed out of range.
    """
    row = math.prod(int(d) for d in tuple(shape)[1:])
    x = make_tensor(name, shape, seed, 0.0, math.sqrt(3.0), bf16=True, start=int(first_row) * row)
    if checked_profile(profile) == "ties":
        r = (int(start_pos) + int(first_row) + np.arange(shape[0])) % _TIES_PERIOD
        x[:, -1] = np.where(r == _TIES_POS_INF, _BF16_MAX, np.where(r == _TIES_NEG_INF, -_BF16_MAX, 0.0))
    return x


def checked_seed(seed) -> int:
    """``seed`` as an int, or a :class:`GoldenError` unless it is an integer in 0 .. 2^64-1."""
    if not is_int(seed, 0) or seed > _MASK64:
        raise GoldenError(f"seed must be an integer in 0 .. 2^64-1, got {seed!r}")
    return int(seed)
