"""The reference's three quantise-then-dequantise schemes, in place.

fp8 with power-of-two scales (``act_quant``: the window KV), fp4 with power-of-two (e8m0) scales
(``fp4_act_quant``: the indexer's queries and keys) and fp4 with e4m3 scales (the compressed KV
latents). A quantised tensor is rounded twice, to its element format and back to bf16, so these
follow the reference's f32 operations one by one: the true division by the scale, the clamp, the
element rounding, the product with the scale and its bf16 rounding. ``quant_row`` is a plain
``@njit`` function, for kernels that quantise rows inside their own loops.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .formats import (ELEMENT_COST, FP4_BLOCK, FP8_BLOCK, LATENT_BLOCK, bf16_scalar, check_inplace,
                      e2m1_scalar, e4m3_scalar, is_int, nan_max, pow2ceil_scalar)
from .workers import worth_parallel

__all__ = ["act_quant_fp8_inplace", "fp4_quant_e8m0_inplace", "fp4_quant_e4m3_inplace", "quant_row",
           "Q_FP8", "Q_FP4_E8M0", "Q_FP4_E4M3"]



@njit
def _block_amax(blk):
    # Largest |x| in f32; a NaN anywhere makes it NaN, as torch's amax does.
    amax = np.float32(0.0)
    for j in range(blk.shape[0]):
        amax = nan_max(amax, abs(blk[j]))
    return amax


@njit
def _clamp(y, bound):
    # NaN passes through unchanged, as in torch.clamp.
    if y > bound:
        return bound
    if y < -bound:
        return -bound
    return y


Q_FP8 = 0       # act_quant: e4m3 elements, power-of-two scale
Q_FP4_E8M0 = 1  # fp4_act_quant: e2m1 elements, power-of-two scale
Q_FP4_E4M3 = 2  # latent quantiser: e2m1 elements, e4m3 scale


@njit
def quant_row(row, block, kind):
    """One of the three quantise-dequantise schemes on a 1-D float32 view, in place.

    Per block of ``block`` values (a shorter last block is quantised on its own): the block's
    amax, floored; the scale ``s`` (``pow2ceil(amax / bound)``, or for the latents the e4m3
    rounding of ``amax / 6``); then ``bf16(elem(clamp(x / s, +-bound)) * s)`` with the element
    format e4m3 (fp8) or e2m1 (fp4). A block whose e4m3 scale overflows gets a NaN scale, as
    the non-saturating e4m3fn cast gives.
    """
    if kind == Q_FP8:
        bound, floor = np.float32(448.0), np.float32(1e-4)
    elif kind == Q_FP4_E8M0:
        bound, floor = np.float32(6.0), np.float32(6.0 * 2.0**-126)
    else:
        bound, floor = np.float32(6.0), np.float32(6.0 * 2.0**-9)
    for lo in range(0, row.shape[0], block):
        # A slice indexed from 0 (not row[lo + j]) lets the loops below vectorise.
        blk = row[lo:lo + block]
        amax = _block_amax(blk)
        if amax < floor:
            amax = floor
        if kind == Q_FP4_E4M3:
            s = e4m3_scalar(amax / bound)
        else:
            s = pow2ceil_scalar(amax / bound)
        for j in range(blk.shape[0]):
            # A true f32 division, not a multiply by 1/s.
            y = _clamp(blk[j] / s, bound)
            q = e4m3_scalar(y) if kind == Q_FP8 else e2m1_scalar(y)
            blk[j] = bf16_scalar(q * s)


@njit(parallel=True)
def _quant_kernel(flat, block, kind):
    for b in prange(flat.shape[0] // block):
        quant_row(flat[b * block : (b + 1) * block], block, kind)


def _check_block(x, block, name):
    check_inplace(x, name)
    if not is_int(block, 1):
        raise ValueError(f"{name}: block must be a positive integer, got {block!r}")
    if x.ndim == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{name}: the last dimension of shape {x.shape} is not a multiple of block {block}"
        )
    return int(block)


def _quantise(x, block, name, kind):
    block = _check_block(x, block, name)
    flat = x.reshape(-1)
    if worth_parallel(flat.shape[0], ELEMENT_COST):
        _quant_kernel(flat, block, kind)
    elif flat.shape[0]:
        quant_row(flat, block, kind)
    return x


def act_quant_fp8_inplace(x, block=FP8_BLOCK):
    """fp8 quantise-dequantise (the reference's ``act_quant``, window KV) of every block of ``block``
    consecutive last-dimension values, in place. Returns ``x``; the result is bf16-valued."""
    return _quantise(x, block, "act_quant_fp8_inplace", Q_FP8)


def fp4_quant_e8m0_inplace(x, block=FP4_BLOCK):
    """fp4 quantise-dequantise with power-of-two (e8m0) scales (indexer q and keys), in place."""
    return _quantise(x, block, "fp4_quant_e8m0_inplace", Q_FP4_E8M0)


def fp4_quant_e4m3_inplace(x, block=LATENT_BLOCK):
    """fp4 quantise-dequantise with e4m3 scales (compressed KV latents), in place."""
    return _quantise(x, block, "fp4_quant_e4m3_inplace", Q_FP4_E4M3)
