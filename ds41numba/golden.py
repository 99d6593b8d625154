"""Golden files: deterministic weights and inputs, a recorded run, replay and comparison.

A golden is one self-contained safetensors file: every weight of the layers that ran, every
layer input ``x`` of every step, and what the stack computed from them (the *captures*), named
exactly as in the reference goldens (``../shared/golden/README.md``):

* ``layers.{i}.attn.NAME`` -- layer i's parameters (BF16, or F32 for the f32 parameters);
* ``step{s}.layers.{i}.WHAT`` -- step 0 is the prefill (``prefill`` tokens at start_pos 0),
  step s >= 1 the decode of the token at position ``prefill + s - 1``; WHAT is ``x`` and the
  captures: ``io`` records ``out``, ``idx`` and ``shared.topk_idxs``; ``all`` adds ``q``, ``kv``,
  ``o``, ``index_score``, the other ``shared.*`` slots and the layer's ``state.*``.

The metadata holds the config (the reference's ModelArgs names), the run (preset, layers,
prefill, decode, seed, capture mode) and the generator's description, so the file alone is
enough to replay it and anyone can regenerate its weights and inputs in another language.

Generator ``ds41numba-splitmix64-v1``
-------------------------------------
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
import json
import math
import os
import re
import struct
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from numba import njit, prange

from .config import AttnConfig, preset

__all__ = [
    "GoldenError", "GENERATOR", "GENERATOR_SPEC", "CAPTURE_MODES", "FORMAT", "FORMAT_VERSION",
    "TOLERANCE", "make_tensor", "make_weights", "make_input", "weight_distribution", "stream_key",
    "parse_layers", "missing_sources", "load_config", "default_run", "GoldenPlan",
    "layer_captures", "storage_kind", "to_storage", "run_golden", "write_golden",
    "write_tensors_atomic", "GoldenFile", "RunInfo", "TensorResult", "CompareReport",
    "compare_tensor", "compare_files", "replay",
]

FORMAT = "ds41numba-golden"
FORMAT_VERSION = "1"
GENERATOR = "ds41numba-splitmix64-v1"
BF16 = ml_dtypes.bfloat16


class GoldenError(ValueError):
    """A bad request or an unusable file: the CLI prints it as one line and exits with status 2."""


# =========================================================================== the generator

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
_CHUNK = 1 << 22          # elements per piece when converting or comparing large tensors


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
    seed = _checked_seed(seed)
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
    from .stack import weight_specs   # the stack pulls in the numba kernels: import when needed

    layers = range(config.n_layers) if layers is None else layers
    weights = {}
    for i in layers:
        for name, (shape, kind) in weight_specs(config, i).items():
            center, scale = weight_distribution(name, shape)
            weights[name] = make_tensor(name, shape, seed, center, scale, bf16=(kind == "bf16"))
    return weights


def make_input(name: str, shape, seed: int = 0) -> np.ndarray:
    """A layer input (``step{s}.layers.{i}.x``): bf16 values with unit variance."""
    return make_tensor(name, shape, seed, 0.0, math.sqrt(3.0), bf16=True)


def _checked_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed <= _MASK64:
        raise GoldenError(f"seed must be an integer in 0 .. 2^64-1, got {seed!r}")
    return int(seed)


# =========================================================================== layers and roles


def parse_layers(text: str, n_layers: int) -> tuple[int, ...]:
    """``"2,3,20-24"`` -> ``(2, 3, 20, 21, 22, 23, 24)``; sorted, duplicates dropped."""
    layers = set()
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise GoldenError(f"--layers: {part!r} is not a layer number or range "
                              f"(write e.g. 20 or 2,3,20-24)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise GoldenError(f"--layers: range {part!r} runs backwards")
        for i in (lo, hi):
            if i >= n_layers:
                raise GoldenError(f"--layers: layer {i} is not a layer of this config "
                                  f"(0..{n_layers - 1})")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def missing_sources(config: AttnConfig, layers) -> list[str]:
    """One message per source a member of ``layers`` reads but that is not a member
    (:meth:`AttnConfig.missing_sources`)."""
    return list(dict.fromkeys(f"layer {i} needs layer {src} (its {role})"
                              for i, src, role in config.missing_sources(layers)))


# =========================================================================== captures

#: What each capture mode records per step and layer (besides the input ``x``), in file order.
CAPTURE_MODES = {
    "io": ("out", "idx", "shared.topk_idxs"),
    "all": ("out", "q", "kv", "idx", "o", "index_score", "shared.compress_kv", "shared.index_k",
            "shared.topk_idxs", "shared.candidates", "state.window_kv", "state.kv_state",
            "state.score_state"),
}
#: Captures not stored as BF16 (the index tensors, and the compressor's f32 state).
_CAPTURE_STORAGE = {"idx": "I32", "shared.topk_idxs": "I32", "shared.candidates": "U8",
                    "state.kv_state": "F32", "state.score_state": "F32"}
_STORAGE_DTYPES = {"BF16": BF16, "F32": np.float32, "I32": np.int32, "U8": np.uint8}
_STEP_NAME = re.compile(r"step(\d+)\.layers\.(\d+)\.(.+)")
_WEIGHT_NAME = re.compile(r"layers\.(\d+)\.attn\.(.+)")


def _records_shared(config: AttnConfig, layer_id: int) -> bool:
    """The goldens record the shared slots after ratio > 0 layers that publish one of them."""
    c = config
    return c.ratio(layer_id) > 0 and (c.is_kv_source(layer_id) or c.is_index_source(layer_id)
                                      or c.is_candidate_source(layer_id))


def _forward_capture(mode: str) -> bool:
    """``io`` runs the forward without capture: its q and o would be [seqlen, H, hd] each."""
    return mode == "all"


def layer_captures(stack, layer_id: int, run, start_pos: int, mode: str) -> dict[str, np.ndarray]:
    """The captures of one layer's step, ``{WHAT: array}``, as the reference goldens record them.

    Arrays may be views of the stack's live state: convert (copy) them before the next step.
    """
    from .attention import window_index_rows

    c = stack.config
    wanted = CAPTURE_MODES[mode]
    seqlen = run.out.shape[0]
    end_pos = start_pos + seqlen
    r = c.ratio(layer_id)
    shared = stack.shared
    got = {"out": run.out}
    if run.idx is not None:
        got["idx"] = run.idx
    else:
        # Without capture the forward does not return idx; it is the window entries followed by
        # the shared selection, exactly as attention_any assembles it (tested against capture).
        win = window_index_rows(start_pos, seqlen, c.window_size)
        win = np.broadcast_to(win, (seqlen, win.shape[1]))
        parts = [win] if r == 0 else [win, shared.topk_idxs]
        got["idx"] = np.concatenate(parts, axis=1).astype(np.int32, copy=False)
    if mode == "all":
        got.update(q=run.q, kv=run.kv_rows, o=run.o)
        if run.index_score is not None:
            got["index_score"] = run.index_score
    if _records_shared(c, layer_id):
        if shared.topk_idxs is not None:
            got["shared.topk_idxs"] = shared.topk_idxs
        if mode == "all":
            if shared.compress_kv is not None:
                got["shared.compress_kv"] = shared.compress_kv[: end_pos // r]
            if shared.index_k is not None:
                got["shared.index_k"] = shared.index_k[: end_pos // r]
            cands = shared.candidates
            if cands is not None:
                got["shared.candidates"] = cands
    if mode == "all":
        state = stack.states[layer_id]
        got["state.window_kv"] = state.window_kv
        if state.kv_state is not None:
            got["state.kv_state"] = state.kv_state
            got["state.score_state"] = state.score_state
    return {k: got[k] for k in wanted if k in got}


def storage_kind(name: str, weight_kinds: dict | None = None) -> str:
    """The safetensors dtype a tensor is stored in: "BF16", "F32", "I32" or "U8".

    ``weight_kinds`` maps parameter names to their :func:`weight_specs` kind ("bf16" | "f32").
    """
    m = _STEP_NAME.fullmatch(name)
    if m:
        return _CAPTURE_STORAGE.get(m.group(3), "BF16")
    if weight_kinds is not None and name in weight_kinds:
        return "F32" if weight_kinds[name] == "f32" else "BF16"
    raise ValueError(f"storage_kind: unknown tensor {name!r}")


def to_storage(name: str, array, kind: str) -> np.ndarray:
    """A new array holding ``array`` in the storage dtype ``kind``; refuses to change a value.

    The stack's arrays are float32 (bf16 values where the reference holds bf16) and int32 or
    bool: storing them must be exact, or a golden would record something that was not computed.
    """
    a = np.asarray(array)
    dtype = _STORAGE_DTYPES[kind]
    if kind in ("I32", "U8"):
        out = np.array(a, dtype=dtype, copy=True)
        if not np.array_equal(out, a):
            raise ValueError(f"{name}: values do not fit {kind}")
        return out
    a = np.asarray(a, dtype=np.float32)
    if kind == "F32":
        return np.array(a, copy=True)
    out = a.astype(BF16)
    if not _bf16_exact(a, out):
        raise ValueError(f"{name}: holds values that are not bf16 (it would be rounded on storage)")
    return out


def _bf16_exact(a32: np.ndarray, a16: np.ndarray, chunk: int = _CHUNK) -> bool:
    """True when the bf16 copy converts back to the same float32 (NaN to NaN, any payload)."""
    f, h = a32.reshape(-1), a16.reshape(-1)
    for lo in range(0, f.size, chunk):
        back, part = h[lo:lo + chunk].astype(np.float32), f[lo:lo + chunk]
        same = back.view(np.uint32) == part.view(np.uint32)
        if not same.all() and not (same | (np.isnan(back) & np.isnan(part))).all():
            return False
    return True


# =========================================================================== a golden run


@dataclass(frozen=True)
class GoldenPlan:
    """What a golden run does: the stack, which of its layers, how long, which seed, what to keep."""

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    seed: int = 0
    capture: str = "all"
    preset: str = ""

    def __post_init__(self):
        c = self.config
        for name in ("prefill", "decode"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise GoldenError(f"--{name} must be an integer, got {v!r}")
        if self.prefill < 1:
            raise GoldenError(f"--prefill must be at least 1, got {self.prefill}")
        if self.decode < 0:
            raise GoldenError(f"--decode must be at least 0, got {self.decode}")
        if self.prefill + self.decode > c.max_seq_len:
            raise GoldenError(f"--prefill {self.prefill} + --decode {self.decode} tokens exceed the "
                              f"config's max_seq_len {c.max_seq_len}")
        _checked_seed(self.seed)
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
            raise GoldenError(f"--layers: {missing[0]}, which is not in the selection"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def steps(self):
        """``(step, start_pos, seqlen)``: the prefill, then one decode step per token."""
        yield 0, 0, self.prefill
        for s in range(1, self.decode + 1):
            yield s, self.prefill + s - 1, 1

    @property
    def total_tokens(self) -> int:
        """Token-layers the run processes (the progress bar's unit)."""
        return (self.prefill + self.decode) * len(self.layers)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata (str -> str) that makes the file self-describing."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "ds41numba_version": _version(),
            "config": json.dumps(self.config.to_dict()),
            "preset": self.preset,
            "layers": json.dumps(list(self.layers)),
            "prefill": str(self.prefill),
            "decode": str(self.decode),
            "seed": str(self.seed),
            "capture": self.capture,
            "generator": GENERATOR,
            "generator_spec": GENERATOR_SPEC,
        }


def _version() -> str:
    try:
        from . import __version__
        return str(__version__)
    except ImportError:
        return "unknown"


def run_golden(plan: GoldenPlan, progress=None) -> dict[str, np.ndarray]:
    """Run ``plan`` and return every tensor of its file, already in the storage dtypes.

    Captures are converted (copied) to their storage dtype as soon as a layer's step returns,
    so memory holds the file's tensors plus the stack's working set, never per-step f32 copies.
    ``progress(n, where)``, if given, is called before each forward with ``n = 0`` and after it
    with the tokens it processed; ``where`` says which step and layer (a long prefill is one
    forward, so this is all a progress bar can show meanwhile).
    """
    from .stack import AttentionStack, weight_specs

    cfg = plan.config
    weights = make_weights(cfg, plan.layers, plan.seed)
    kinds = {n: k for i in plan.layers for n, (_, k) in weight_specs(cfg, i).items()}
    stack = AttentionStack(cfg, weights, layers=plan.layers)
    tensors: dict[str, np.ndarray] = {}
    for s, start_pos, seqlen in plan.steps():
        for i in plan.layers:
            prefix = f"step{s}.layers.{i}."
            where = f"step {s} layer {i}"
            if progress is not None:
                progress(0, where)
            x = make_input(prefix + "x", (seqlen, cfg.dim), plan.seed)
            tensors[prefix + "x"] = to_storage(prefix + "x", x, "BF16")
            del x   # the stack takes the stored bfloat16 copy: half the memory of float32
            run = stack.forward(i, tensors[prefix + "x"], start_pos,
                                capture=_forward_capture(plan.capture))
            for what, value in layer_captures(stack, i, run, start_pos, plan.capture).items():
                tensors[prefix + what] = to_storage(prefix + what, value, storage_kind(prefix + what))
            del run
            if progress is not None:
                progress(seqlen, where)
    del stack
    # Weights last: the stack shared the float32 arrays, now they can go one by one.
    stored = {}
    for name in list(weights):
        stored[name] = to_storage(name, weights.pop(name), storage_kind(name, kinds))
    stored.update(tensors)
    return stored


def write_golden(plan: GoldenPlan, path, force: bool = False, progress=None) -> dict:
    """Run ``plan`` and write its golden to ``path`` atomically; returns a summary for printing."""
    path = os.fspath(path)
    _check_target(path, force)
    _check_memory(plan)
    t0 = time.perf_counter()
    tensors = run_golden(plan, progress)
    write_tensors_atomic(path, tensors, plan.metadata(), force)
    return {"path": os.path.abspath(path), "tensors": len(tensors),
            "bytes": os.path.getsize(path), "seconds": time.perf_counter() - t0}


def minimum_bytes(plan: GoldenPlan) -> int:
    """A lower bound on the memory a run needs: float32 weights plus the stored x and out."""
    from .stack import weight_specs

    weights = sum(math.prod(shape) for i in plan.layers
                  for shape, _ in weight_specs(plan.config, i).values())
    tokens = (plan.prefill + plan.decode) * len(plan.layers)
    return 4 * weights + 2 * 2 * tokens * plan.config.dim


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(plan: GoldenPlan):
    """Refuse up front a run that cannot fit (e.g. all 43 v41-flash layers), not hours later."""
    need, have = minimum_bytes(plan), _available_bytes()
    if have is not None and need > have:
        raise GoldenError(f"this run needs at least {need / 2**30:.1f} GiB (weights of "
                          f"{len(plan.layers)} layers, inputs, outputs) but {have / 2**30:.1f} GiB "
                          f"is available; select fewer layers (e.g. --layers 20 for v41-flash)")


# =========================================================================== atomic writing


def _check_target(path: str, force: bool):
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise GoldenError(f"--out: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise GoldenError(f"--out: {path!r} is a directory")
    if os.path.exists(path) and not force:
        raise GoldenError(f"--out: {path!r} exists (use --force to overwrite it)")


@contextmanager
def _temporary_beside(path: str):
    """A temporary file in ``path``'s directory, removed unless the body renamed it away.

    Any exit -- error, Ctrl-C, a SIGTERM turned into SystemExit -- removes it, so no partial
    file survives. (A SIGKILL cannot be caught; then only this hidden ``.NAME.*.tmp`` remains,
    never a file under the target name.)
    """
    directory, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sort_metadata(f):
    """Rewrite the header of the safetensors file open in ``f`` with its metadata keys sorted.

    safetensors serialises the metadata map in a random order (a Rust HashMap), so two equal
    runs would give files that differ in their header bytes. Tensor entries keep their order;
    the rewritten header has the same length (padded with spaces, which the format allows).
    """
    f.seek(0)
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    if not header.get("__metadata__"):
        return
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) <= n:
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
        f.flush()


def write_tensors_atomic(path, tensors: dict[str, np.ndarray], metadata: dict[str, str],
                         force: bool = False):
    """Write a safetensors file to a temporary name beside ``path``, then rename it into place.

    safetensors >= 0.8 writes each array straight from its buffer, so this needs no second
    copy of the tensors (older versions copy each tensor to bytes first). Without ``force`` an
    existing ``path`` is never replaced, not even one that appeared while the file was written.
    """
    from safetensors.numpy import save_file

    path = os.fspath(path)
    _check_target(path, force)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    with _temporary_beside(path) as tmp:
        save_file(arrays, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            _sort_metadata(f)
            os.fsync(f.fileno())
        # mkstemp and safetensors both make private (0600) files; a golden is an ordinary file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        if force:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)     # fails if path exists: no clobbering, atomically
            except FileExistsError:
                raise GoldenError(f"--out: {path!r} appeared while writing (use --force)") from None
            except OSError:            # a filesystem without hard links
                if os.path.exists(path):
                    raise GoldenError(f"--out: {path!r} exists (use --force to overwrite it)") from None
                os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def _fsync_dir(directory: str):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# =========================================================================== reading goldens


@dataclass
class RunInfo:
    """How a golden was made: enough to rebuild its stack and replay it."""

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    capture: str
    seed: int | None = None
    preset: str = ""


class GoldenFile:
    """Read access to a golden: a ds41numba safetensors file or a reference ``.npz``.

    Tensors load one at a time on request, so comparing two large files never holds more than
    a pair of tensors. In an ``.npz`` the ``config`` string and the ``dtype.*`` notes are not
    tensors and are left out of :attr:`names`.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(8)
        except OSError as e:
            raise GoldenError(f"cannot read {self.path!r}: {e.strerror}") from None
        self.kind = "npz" if magic[:2] == b"PK" else "safetensors"
        try:
            if self.kind == "npz":
                self._npz = np.load(self.path, allow_pickle=False)
                self.names = [k for k in self._npz.files if k != "config" and not k.startswith("dtype.")]
                self.metadata = {}
                if "config" in self._npz.files:
                    self.metadata["config"] = str(self._npz["config"])
            else:
                from safetensors import safe_open
                self._st = safe_open(self.path, framework="np")
                self.names = list(self._st.keys())
                self.metadata = dict(self._st.metadata() or {})
        except GoldenError:
            raise
        except Exception as e:   # any parse failure of a foreign file is a usage error
            raise GoldenError(f"{self.path!r} is not a safetensors or .npz golden ({e})") from None
        self.names.sort(key=_natural_key)
        self._name_set = set(self.names)

    def __contains__(self, name):
        return name in self._name_set

    def get(self, name: str) -> np.ndarray:
        """One tensor, loaded now (a foreign dtype or a broken entry is a usage error)."""
        try:
            return self._npz[name] if self.kind == "npz" else self._st.get_tensor(name)
        except KeyError:
            raise
        except Exception as e:
            raise GoldenError(f"cannot read tensor {name} from {self.path!r}: {e}") from None

    def close(self):
        if getattr(self, "_npz", None) is not None:
            self._npz.close()
        self._st = self._npz = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run_info(self) -> RunInfo:
        """The run recorded in the file (metadata, or the reference ``config`` JSON of an npz)."""
        meta = self.metadata
        if self.kind == "safetensors" and meta.get("format") != FORMAT:
            raise GoldenError(f"{self.path!r} is not a {FORMAT} file (its metadata has no "
                              f"format {FORMAT!r}), so it cannot be replayed")
        if "config" not in meta:
            raise GoldenError(f"{self.path!r} has no config: not a golden this tool can replay")
        try:
            cfg_dict = json.loads(meta["config"])
            config = AttnConfig.from_dict(cfg_dict)
            if self.kind == "npz":
                layers = tuple(range(config.n_layers))
                prefill, decode = int(cfg_dict["prefill"]), int(cfg_dict["decode"])
                capture, seed, name = "all", cfg_dict.get("seed"), ""
            else:
                if meta.get("format_version") != FORMAT_VERSION:
                    raise GoldenError(f"{self.path!r} has format version {meta.get('format_version')!r}; "
                                      f"this ds41numba reads {FORMAT_VERSION}")
                layers = tuple(int(i) for i in json.loads(meta["layers"]))
                prefill, decode = int(meta["prefill"]), int(meta["decode"])
                capture, seed, name = meta["capture"], int(meta["seed"]), meta.get("preset", "")
        except GoldenError:
            raise
        except (KeyError, ValueError, TypeError) as e:
            raise GoldenError(f"{self.path!r}: unusable run description in its metadata ({e})") from None
        if capture not in CAPTURE_MODES:
            raise GoldenError(f"{self.path!r}: unknown capture mode {capture!r}")
        return RunInfo(config, layers, prefill, decode, capture, seed, name)


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


# =========================================================================== comparison

TOLERANCE = "|got - want| <= 2 * 2^-8 * max|want| + 1e-6 per tensor"
ROWS_LISTED = 1000   # differing index rows a result lists (the text line shows the first 10)


@dataclass
class TensorResult:
    """How one tensor of the candidate agrees with the golden's."""

    name: str
    kind: str                 # "index", "float", "only-golden", "only-candidate", "shape"
    ok: bool
    shape: list = field(default_factory=list)
    size: int = 0
    # index tensors: rows (along the first axis) with any differing element
    rows: int = 0
    rows_differ: int = 0
    first_rows: list = field(default_factory=list)   # the first ROWS_LISTED differing rows
    # float tensors
    max_abs_diff: float = 0.0
    tolerance: float = 0.0
    over_tolerance: int = 0
    max_bf16_steps: float = 0.0
    within_one_step: int = 0
    bit_identical: int = 0
    detail: str = ""

    def line(self) -> str:
        """One human-readable line."""
        shape = "[" + ", ".join(str(d) for d in self.shape) + "]"
        if self.kind == "index":
            state = "identical" if self.ok else (
                f"{self.rows_differ} of {self.rows} rows differ (first: "
                + ", ".join(str(r) for r in self.first_rows[:10])
                + (", ..." if self.rows_differ > 10 else "") + ")")
            return f"{self.name} {shape} index: {state}"
        if self.kind == "float":
            n = max(self.size, 1)
            verdict = (f"within tolerance {self.tolerance:.3g}" if self.ok else
                       f"> tolerance {self.tolerance:.3g} ({self.over_tolerance} of {self.size} "
                       f"elements over)")
            return (f"{self.name} {shape}: max |diff| {self.max_abs_diff:.3g} {verdict}; "
                    f"max {_fmt_steps(self.max_bf16_steps)} bf16 steps, "
                    f"{100 * self.within_one_step / n:.2f}% within 1 step, "
                    f"{100 * self.bit_identical / n:.2f}% bit-identical")
        return f"{self.name}: {self.detail}"

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        for k in ("max_abs_diff", "max_bf16_steps", "tolerance"):
            if not math.isfinite(d[k]):
                d[k] = str(d[k])   # JSON has no inf/nan
        return d


def _fmt_steps(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    return f"{v:.0f}" if v == int(v) else f"{v:.3g}"


def _is_index(a: np.ndarray) -> bool:
    return a.dtype.kind in "iub"


def compare_tensor(name: str, want, got) -> TensorResult:
    """Compare ``got`` with ``want``: exact for index tensors, the SPEC tolerance for floats."""
    want, got = np.asarray(want), np.asarray(got)
    index = _is_index(want) or _is_index(got)
    res = TensorResult(name=name, kind="index" if index else "float", ok=True,
                       shape=list(want.shape), size=int(want.size))
    if want.shape != got.shape:
        res.kind, res.ok = "shape", False
        res.detail = f"shape {list(got.shape)} in the candidate, {list(want.shape)} in the golden"
        return res
    return _compare_index(res, want, got) if index else _compare_float(res, want, got)


def _compare_index(res: TensorResult, want: np.ndarray, got: np.ndarray) -> TensorResult:
    rows = want.shape[0] if want.ndim else 1
    w, g = want.reshape(rows, -1), got.reshape(rows, -1)
    # Values are compared, not storage: int32 against uint8 or a float copy of an index is fine.
    common = np.float64 if "f" in (w.dtype.kind, g.dtype.kind) else np.int64
    step = max(1, _CHUNK // max(1, w.shape[1]))
    for lo in range(0, rows, step):
        bad = np.any(w[lo:lo + step].astype(common) != g[lo:lo + step].astype(common), axis=1)
        if len(res.first_rows) < ROWS_LISTED:
            res.first_rows += (np.flatnonzero(bad)[: ROWS_LISTED - len(res.first_rows)] + lo).tolist()
        res.rows_differ += int(np.count_nonzero(bad))
    res.rows = rows
    res.ok = res.rows_differ == 0
    return res


def _ordered(bits: np.ndarray) -> np.ndarray:
    """float32 bit patterns on a line where adjacent floats are adjacent integers (+0 == -0)."""
    i = bits.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _compare_float(res: TensorResult, want: np.ndarray, got: np.ndarray) -> TensorResult:
    w_all, g_all = want.reshape(-1), got.reshape(-1)
    amax = 0.0
    for lo in range(0, w_all.size, _CHUNK):
        w = np.abs(w_all[lo:lo + _CHUNK].astype(np.float32))
        w = w[np.isfinite(w)]
        if w.size:
            amax = max(amax, float(w.max()))
    bound = 2 * 2.0 ** -8 * amax + 1e-6
    res.tolerance = bound
    for lo in range(0, w_all.size, _CHUNK):
        w = np.ascontiguousarray(w_all[lo:lo + _CHUNK], dtype=np.float32)
        g = np.ascontiguousarray(g_all[lo:lo + _CHUNK], dtype=np.float32)
        wn, gn = np.isnan(w), np.isnan(g)
        res.bit_identical += int(np.count_nonzero((w.view(np.uint32) == g.view(np.uint32)) | (wn & gn)))
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(g.astype(np.float64) - w.astype(np.float64))
        finite = np.isfinite(w) & np.isfinite(g)
        ok = (finite & (diff <= bound)) | (w == g) | (wn & gn)
        res.over_tolerance += int(ok.size - np.count_nonzero(ok))
        if finite.any():
            res.max_abs_diff = max(res.max_abs_diff, float(diff[finite].max()))
        if (~finite & ~ok).any():
            res.max_abs_diff = math.inf
        steps = np.abs(_ordered(g.view(np.uint32)) - _ordered(w.view(np.uint32))) / 65536.0
        steps = np.where(wn | gn, np.where(wn & gn, 0.0, np.inf), steps)
        res.within_one_step += int(np.count_nonzero(steps <= 1.0))
        if steps.size:
            res.max_bf16_steps = max(res.max_bf16_steps, float(steps.max()))
    res.ok = res.over_tolerance == 0
    return res


@dataclass
class CompareReport:
    """Every tensor's result, the verdict, and the text and JSON forms of both."""

    golden: str
    candidate: str
    results: list = field(default_factory=list)
    subset: bool = False      # a tensor only in the golden is not a failure

    def add(self, result: TensorResult):
        self.results.append(result)

    @property
    def failures(self) -> list:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        compared = [r for r in self.results if r.kind in ("index", "float")]
        return bool(compared) and not self.failures

    def summary(self) -> dict:
        idx = [r for r in self.results if r.kind == "index"]
        flt = [r for r in self.results if r.kind == "float"]
        elems = sum(r.size for r in flt)
        return {
            "ok": self.ok,
            "compared": len(idx) + len(flt),
            "index_tensors": len(idx),
            "index_rows": sum(r.rows for r in idx),
            "index_rows_differ": sum(r.rows_differ for r in idx),
            "float_tensors": len(flt),
            "float_elements": elems,
            "float_over_tolerance": sum(r.over_tolerance for r in flt),
            "max_bf16_steps": max((r.max_bf16_steps for r in flt), default=0.0),
            "within_one_step_fraction": (sum(r.within_one_step for r in flt) / elems) if elems else 1.0,
            "bit_identical_fraction": (sum(r.bit_identical for r in flt) / elems) if elems else 1.0,
            "only_in_golden": sum(r.kind == "only-golden" for r in self.results),
            "only_in_candidate": sum(r.kind == "only-candidate" for r in self.results),
            "shape_mismatches": sum(r.kind == "shape" for r in self.results),
            "failing_tensors": len(self.failures),
            "tolerance": TOLERANCE,
        }

    def summary_line(self) -> str:
        s = self.summary()
        parts = [f"{s['compared']} tensors compared",
                 f"index rows {s['index_rows'] - s['index_rows_differ']}/{s['index_rows']} identical",
                 f"floats max {_fmt_steps(s['max_bf16_steps'])} bf16 steps, "
                 f"{100 * s['within_one_step_fraction']:.3f}% within 1 step, "
                 f"{100 * s['bit_identical_fraction']:.3f}% bit-identical"]
        if s["only_in_golden"]:
            parts.append(f"{s['only_in_golden']} only in {self.golden}")
        if s["only_in_candidate"]:
            parts.append(f"{s['only_in_candidate']} only in {self.candidate}")
        verdict = "OK" if self.ok else (f"FAIL ({s['failing_tensors']} tensors disagree)"
                                        if s["compared"] else "FAIL (no tensor in common)")
        return f"{verdict}: " + "; ".join(parts)

    def text(self, limit: int = 50) -> str:
        """One line per failing tensor (at most ``limit``), then the summary line."""
        lines = [r.line() for r in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"... and {len(self.failures) - limit} more failing tensors (--json lists all)")
        extra = [r.name for r in self.results if r.kind == "only-candidate"]
        if extra:
            lines.append(f"only in {self.candidate}: " + ", ".join(extra[:5])
                         + (f" ... ({len(extra)} in all)" if len(extra) > 5 else ""))
        if self.subset:
            skipped = [r.name for r in self.results if r.kind == "only-golden"]
            if skipped:
                lines.append(f"only in {self.golden} (skipped, --subset): {len(skipped)} tensors")
        lines.append(self.summary_line())
        return "\n".join(lines)

    def table(self) -> str:
        """Agreement per kind of tensor (``out``, ``idx``, ``weights``, ...), one row each.

        "steps" are per element: how many bf16 values lie between got and want. Near zero a
        harmless absolute difference can be many steps, hence also the share within one step.
        """
        groups: dict[str, list] = {}
        for r in self.results:
            if r.kind in ("index", "float", "shape"):
                groups.setdefault(_group_of(r.name), []).append(r)
        head = (f"{'tensor':<20} {'count':>6} {'failing':>7} {'rows differing':>15} "
                f"{'max steps':>9} {'within 1 step':>13} {'bit-identical':>13}")
        lines = [head, "-" * len(head)]
        for g, rs in groups.items():
            idx = [r for r in rs if r.kind == "index"]
            flt = [r for r in rs if r.kind == "float"]
            fail = sum(not r.ok for r in rs)
            rows = (f"{sum(r.rows_differ for r in idx)}/{sum(r.rows for r in idx)}" if idx else "-")
            steps = _fmt_steps(max(r.max_bf16_steps for r in flt)) if flt else "-"
            n = sum(r.size for r in flt)
            one = f"{100 * sum(r.within_one_step for r in flt) / n:.3f}%" if n else "-"
            ident = f"{100 * sum(r.bit_identical for r in flt) / n:.3f}%" if n else "-"
            lines.append(f"{g:<20} {len(rs):>6} {fail:>7} {rows:>15} {steps:>9} {one:>13} {ident:>13}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"golden": self.golden, "candidate": self.candidate,
                           "summary": self.summary(), "tensors": [r.to_dict() for r in self.results]},
                          indent=1)


def _group_of(name: str) -> str:
    m = _STEP_NAME.fullmatch(name)
    if m:
        return m.group(3)
    return "weights" if _WEIGHT_NAME.fullmatch(name) else name


def compare_files(golden_path, candidate_path, subset: bool = False) -> CompareReport:
    """Compare every tensor of two goldens (safetensors or reference .npz, either side).

    A tensor only in the golden fails unless ``subset`` (the candidate then need only carry
    some of the golden's tensors, e.g. a kernel's outputs); one only in the candidate is
    reported but does not fail.
    """
    with GoldenFile(golden_path) as golden, GoldenFile(candidate_path) as cand:
        report = CompareReport(golden.path, cand.path, subset=subset)
        cand_names = set(cand.names)
        for name in golden.names:
            if name in cand_names:
                report.add(compare_tensor(name, golden.get(name), cand.get(name)))
            else:
                report.add(TensorResult(name, "only-golden", ok=subset,
                                        detail=f"missing from {cand.path}"))
        gold_names = set(golden.names)
        for name in cand.names:
            if name not in gold_names:
                report.add(TensorResult(name, "only-candidate", ok=True,
                                        detail=f"not in {golden.path}"))
    return report


# =========================================================================== replay


def replay(path, progress=None) -> CompareReport:
    """Recompute every capture of a golden from its own weights and inputs and compare.

    Works on this tool's safetensors goldens and on the reference's ``.npz`` goldens (whose
    captures are then checked against ds41numba). ``progress(n, where)`` as in :func:`run_golden`.
    """
    from .stack import AttentionStack, weight_specs

    with GoldenFile(path) as golden:
        info = golden.run_info()
        cfg = info.config
        names = set(golden.names)
        weights = {}
        for i in info.layers:
            for name in weight_specs(cfg, i):
                if name not in names:
                    raise GoldenError(f"{golden.path!r}: weight {name} is missing")
                weights[name] = np.asarray(golden.get(name), dtype=np.float32)
        try:
            stack = AttentionStack(cfg, weights, layers=info.layers)
        except ValueError as e:
            raise GoldenError(f"{golden.path!r}: {e}") from None
        report = CompareReport(golden.path, "replay")
        recomputed = set()
        plan_steps = [(0, 0, info.prefill)] + [(s, info.prefill + s - 1, 1)
                                               for s in range(1, info.decode + 1)]
        for s, start_pos, seqlen in plan_steps:
            for i in info.layers:
                prefix = f"step{s}.layers.{i}."
                if prefix + "x" not in names:
                    raise GoldenError(f"{golden.path!r}: input {prefix}x is missing")
                if progress is not None:
                    progress(0, f"step {s} layer {i}")
                x = np.asarray(golden.get(prefix + "x"), dtype=np.float32)
                run = stack.forward(i, x, start_pos, capture=_forward_capture(info.capture))
                for what, value in layer_captures(stack, i, run, start_pos, info.capture).items():
                    name = prefix + what
                    recomputed.add(name)
                    if name in names:
                        report.add(compare_tensor(name, golden.get(name), value))
                recomputed.add(prefix + "x")
                if progress is not None:
                    progress(seqlen, f"step {s} layer {i}")
        for name in golden.names:
            if name not in recomputed and not _WEIGHT_NAME.fullmatch(name):
                report.add(TensorResult(name, "only-golden", ok=False,
                                        detail="in the file but not produced by the replay"))
    return report


def default_run(preset_name: str | None) -> tuple[int, int]:
    """``(prefill, decode)`` when not given: the reference goldens' runs for their presets."""
    return {"tiny": (12, 40), "mixed": (203, 48)}.get(preset_name or "", (12, 40))


def load_config(preset_name: str | None, config_path: str | None) -> tuple[AttnConfig, str]:
    """The config of a run and the preset name for the metadata ("" for a config file)."""
    try:
        if config_path is not None:
            return AttnConfig.from_json(config_path), ""
        name = preset_name or "tiny"
        return preset(name), name
    except ValueError as e:
        msg = str(e)
        raise GoldenError(msg if msg.startswith(("config", "unknown preset")) else f"config: {msg}") from None

