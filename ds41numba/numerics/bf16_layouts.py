"""The bf16-pair layouts the AVX512-BF16 micro-kernels (:mod:`.bf16_dot`) read: two bf16 values
of a row in one uint32, the A operand row by row (:func:`bf16_pairs`) and the B operand in
blocks of ``DOT_LANES`` rows side by side (:func:`pack_bf16_pairs`). Values that are not bf16
values are refused, not rounded: the caller rounds first, as the reference does.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .bf16_dot import DOT_LANES
from .formats import as_f32_array, output_buffer

__all__ = ["bf16_pairs", "pack_bf16_pairs"]


@njit
def _bf16_pair(lo, hi):
    """Two bf16 values (f32 bit patterns) as one uint32, ``lo`` in the low half."""
    return (lo >> np.uint32(16)) | (hi & np.uint32(0xFFFF0000))


@njit
def _n_not_bf16(lo, hi):
    return ((lo & np.uint32(0xFFFF)) != 0) + ((hi & np.uint32(0xFFFF)) != 0)


@njit(parallel=True)
def _pairs_kernel(bits, out, in_order):
    """A operand: ``out[i, p]`` = the pair (``bits[i, 2p]``, ``bits[i, 2p + 1]``), or with
    ``in_order`` (``bits[i, 2p + 1]``, ``bits[i, 2p]``); returns how many values were not bf16
    values."""
    bad = 0
    for i in prange(bits.shape[0]):
        row, dst = bits[i], out[i]
        miss = 0
        for p in range(dst.shape[0]):
            lo, hi = (row[2 * p + 1], row[2 * p]) if in_order else (row[2 * p], row[2 * p + 1])
            miss += _n_not_bf16(lo, hi)
            dst[p] = _bf16_pair(lo, hi)
        bad += miss
    return bad


@njit(parallel=True)
def _blocked_pairs_kernel(bits, out, first):
    """B operand: row ``i`` into lane ``(first + i) % DOT_LANES`` of block ``(first + i) //
    DOT_LANES`` of ``out [blocks, d / 2, DOT_LANES]``; returns how many values were not bf16."""
    bad = 0
    for i in prange(bits.shape[0]):
        r = first + i
        blk = out[r // DOT_LANES]
        lane = r % DOT_LANES
        row = bits[i]
        miss = 0
        for p in range(blk.shape[0]):
            miss += _n_not_bf16(row[2 * p], row[2 * p + 1])
            blk[p, lane] = _bf16_pair(row[2 * p], row[2 * p + 1])
        bad += miss
    return bad


def _pair_bits(x, name):
    x = np.ascontiguousarray(as_f32_array(x, name))
    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: x must be [n, d] with d even, got shape {x.shape}")
    return x.view(np.uint32)


def bf16_pairs(x: np.ndarray, out: np.ndarray | None = None, in_order: bool = False) -> np.ndarray:
    """bf16-valued rows ``x [n, d]`` (d even) as the A operand of the AVX512-BF16 micro-kernel:
    uint32 ``[n, d / 2]``, values ``2p`` and ``2p + 1`` of a row in element p (into ``out``
    when given), value ``2p`` in the low half; ``in_order``: in the high half, which
    ``vdpbf16ps`` adds first, so that a row's products are summed in the values' order."""
    bits = _pair_bits(x, "bf16_pairs")
    out = output_buffer(out, (bits.shape[0], bits.shape[1] // 2), "bf16_pairs", np.uint32)
    if _pairs_kernel(bits, out, in_order):
        raise ValueError("bf16_pairs: x must hold bf16 values (round it to bfloat16 first)")
    return out


def pack_bf16_pairs(x: np.ndarray, out: np.ndarray | None = None, first: int = 0) -> np.ndarray:
    """bf16-valued rows ``x [n, d]`` (d even) as the B operand of the AVX512-BF16 micro-kernel:
    uint32 ``[blocks, d / 2, DOT_LANES]``, row ``first + i`` of ``x`` in lane ``(first + i) %
    DOT_LANES`` of block ``(first + i) // DOT_LANES``. Into ``out`` when given (its other rows
    untouched), else into a fresh zero-padded array with ``first = 0``."""
    bits = _pair_bits(x, "pack_bf16_pairs")
    n, d = bits.shape
    if out is None:
        if first:
            raise ValueError("pack_bf16_pairs: first needs an out array")
        out = np.zeros((-(-n // DOT_LANES), d // 2, DOT_LANES), np.uint32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.uint32 or out.ndim != 3
          or out.shape[1:] != (d // 2, DOT_LANES) or not out.flags.c_contiguous
          or not 0 <= first <= out.shape[0] * DOT_LANES - n):
        raise ValueError(f"pack_bf16_pairs: out must be a C-contiguous uint32 [blocks, {d // 2}, "
                         f"{DOT_LANES}] with room for rows {first}..{first + n}")
    if _blocked_pairs_kernel(bits, out, first):
        raise ValueError("pack_bf16_pairs: x must hold bf16 values (round it to bfloat16 first)")
    return out
