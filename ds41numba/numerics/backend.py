"""Which kernels the products run on: the one function that chooses (:func:`backend`), the one
question its callers ask (:func:`tier_at_least`) and the one switch (:func:`use_backend`).

The backends are nested tiers, each running everything the next one down runs plus one more
instruction set, so a CPU is simply on the highest tier it supports:

- ``"amx"``: ``"avx512vnni"`` and those integer dot products on AMX's tile multiplier
  (:mod:`.amx_dot`) wherever each row's block scales fold into its bytes;
- ``"avx512vnni"``: ``"avx512bf16"`` and the indexer's fp4 dot products as integer dot products
  on AVX512-VNNI (:mod:`.int8_dot`);
- ``"avx512bf16"``: ``"avx2int8"`` and the bf16 products of many rows (linears, and the index
  scores the integer kernels decline) on AVX512-BF16 (:mod:`.bf16_dot`), in the reference's
  order;
- ``"avx2int8"``: ``"blas"`` and the indexer's fp4 dot products as integer dot products on AVX2
  (``vpmaddubsw``, :mod:`.int8_pairs`), where AVX512-VNNI is not on;
- ``"blas"``: any x86-64 CPU: the bf16 products of many rows on f32 FMAs in the reference's
  order (the FMA twin of ``vdpbf16ps``, :mod:`.bf16_dot`), the index scores on numpy's f32
  BLAS (exact in any order).

Every CPU with AVX512-BF16 so far (Cooper Lake, Sapphire Rapids, Zen 4) also has AVX512-VNNI, so
nesting the tiers costs nothing there; a CPU with VNNI but no BF16 stays on ``"avx2int8"``.
Every CPU with AVX-512 has AVX2, and every CPU with AMX-INT8 (Sapphire Rapids on) has the
others.
"""

from __future__ import annotations

import contextlib
import os

from .vector_ir import compiles_for

__all__ = ["BACKENDS", "backend", "tier_at_least", "use_backend"]

#: From the highest tier down.
BACKENDS = ("amx", "avx512vnni", "avx512bf16", "avx2int8", "blas")
# The LLVM CPU features each tier needs, and the environment variable that turns it off ("0").
_NEEDS = {"amx": ("avx2", "avx512bf16", "avx512vnni", "amx-tile", "amx-int8"),
          "avx512vnni": ("avx2", "avx512bf16", "avx512vnni"), "avx512bf16": ("avx2", "avx512bf16"),
          "avx2int8": ("avx2",), "blas": ()}
_OFF_SWITCH = {"amx": "DS41NUMBA_AMX", "avx512vnni": "DS41NUMBA_INT8_DOT",
               "avx512bf16": "DS41NUMBA_BF16_DOT", "avx2int8": "DS41NUMBA_AVX2_INT8"}


def _supported(name: str) -> bool:
    """True when this CPU has the features of tier ``name`` and numba compiles for them (the host
    CPU, features not overridden without them). The LLVM-IR kernels name their instructions
    outright, so compiling them for another target would fail or fault."""
    if not all(compiles_for(f) for f in _NEEDS[name]):
        return False
    # The tile registers are the process's only once Linux has granted them.
    return name != "amx" or _tile_state_granted()


def _tile_state_granted() -> bool:
    if not _granted:
        from .amx_dot import request_tile_state

        _granted.append(request_tile_state())
    return _granted[0]


_granted: list[bool] = []


def _allowed(name: str) -> bool:
    """Tier ``name`` and every tier below it not switched off in the environment."""
    tiers = BACKENDS[BACKENDS.index(name):]
    return all(os.environ.get(_OFF_SWITCH.get(t, ""), "1") != "0" for t in tiers if t in _OFF_SWITCH)


_backend = [next(b for b in BACKENDS if _allowed(b) and _supported(b))]


def backend() -> str:
    """The tier the products run on (one of ``BACKENDS``): the highest this CPU supports, decided
    at import (``DS41NUMBA_AMX=0`` stops below ``"amx"``, ``DS41NUMBA_INT8_DOT=0`` below
    ``"avx512vnni"``, ``DS41NUMBA_BF16_DOT=0`` below ``"avx512bf16"``, ``DS41NUMBA_AVX2_INT8=0``
    forces ``"blas"``). Every caller asks this function, so :func:`use_backend` switches them
    all."""
    return _backend[0]


def tier_at_least(name: str) -> bool:
    """Whether the products run on tier ``name`` (one of ``BACKENDS``) or one above it: the one
    question every kernel's caller asks, each tier by its one name. The tiers nest, so
    ``tier_at_least("avx2int8")``: the indexer's fp4 dot products run as integer dot products
    (on AVX2 at least); ``tier_at_least("avx512bf16")``: the bf16 products run on AVX512-BF16;
    ``tier_at_least("avx512vnni")``: the indexer's fp4 dot products run as integer dot products
    (AVX512-VNNI, or AMX); ``tier_at_least("amx")``: those run on AMX's tile multiplier where
    the rows fold."""
    if name not in BACKENDS:
        raise ValueError(f"tier_at_least: {name!r} is not one of {BACKENDS}")
    return BACKENDS.index(_backend[0]) <= BACKENDS.index(name)


@contextlib.contextmanager
def use_backend(name: str):
    """Run the block on tier ``name`` (one of ``BACKENDS``): the one switch the tests use to run
    a path on purpose. A tier this CPU (or numba's target) lacks is refused."""
    if name not in BACKENDS:
        raise ValueError(f"use_backend: {name!r} is not one of {BACKENDS}")
    if not _supported(name):
        raise ValueError(f"use_backend: this CPU (or numba's target) lacks {' and '.join(_NEEDS[name])}")
    before = _backend[0]
    _backend[0] = name
    try:
        yield
    finally:
        _backend[0] = before
