"""RMSNorm as the reference's torch computes it on the CPU, including the order of its f32 sum.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .formats import ELEMENT_COST, as_f32_array, bf16_scalar
from .workers import serial_twin, sized_call

__all__ = ["rms_norm", "torch_sum_f32", "SUM_LANES"]


# torch's CPU sum of a contiguous f32 row (ATen SumKernel: ``vectorized_inner_sum`` / ``row_sum`` /
# ``multi_row_sum``), the reduction inside the reference RMSNorm's ``x.square().mean(-1)``. The sum
# kernel is registered with REGISTER_DISPATCH, which leaves the AVX512 slot empty, so even on the
# reference's AVX512 machine torch runs its AVX2 build: Vectorized<float> has 8 lanes.
SUM_LANES = 8
_SUM_ILP = 4
_SUM_LEVELS = 4

# The sum's helpers are inlined into their callers' numba IR (``inline="always"``): compiled
# apart, each nested level was optimised and compiled to machine code again inside the next,
# and RMSNorm took 3.2 s to compile on a Zen 4 core instead of 1.9 (the same code and speed).


@njit(inline="always")
def _ceil_log2(x):
    if x <= 2:
        return 1
    r = 0
    v = x - 1
    while v > 0:
        v >>= 1
        r += 1
    return r


@njit(inline="always")
def _add_group(x, square, lanes, i, acc):
    """Group i (4 vectors of ``lanes`` values) into the 4 ILP partial sums ``acc[0]``."""
    for k in range(_SUM_ILP):
        base = (i * _SUM_ILP + k) * lanes
        for l in range(lanes):
            v = x[base + l]
            acc[0, k, l] += v * v if square else v


@njit(inline="always")
def _multi_row_sum(x, square, lanes, size, acc):
    """``multi_row_sum`` with 4 ILP rows of ``lanes`` lanes over ``size`` groups of 4 * lanes values:
    ``acc[0, k, l]`` ends with the sum of values ``(4 * i + k) * lanes + l``, accumulated in cascade
    levels of 16 groups (more for huge rows). ``acc`` is ``[levels, 4, lanes]`` f32, zeroed."""
    level_power = max(4, _ceil_log2(size) // _SUM_LEVELS)
    level_step = 1 << level_power
    level_mask = level_step - 1
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            _add_group(x, square, lanes, i, acc)
            i += 1
        for j in range(1, _SUM_LEVELS):
            for k in range(_SUM_ILP):
                for l in range(lanes):
                    acc[j, k, l] += acc[j - 1, k, l]
                    acc[j - 1, k, l] = np.float32(0.0)
            if (i & (level_mask << (j * level_power))) != 0:
                break
    while i < size:
        _add_group(x, square, lanes, i, acc)
        i += 1
    for j in range(1, _SUM_LEVELS):
        for k in range(_SUM_ILP):
            for l in range(lanes):
                acc[0, k, l] += acc[j, k, l]


@njit(inline="always")
def torch_sum_f32(x, square):
    """The f32 sum of the 1-D float32 row ``x`` (of its squares, each rounded to f32, when ``square``)
    in exactly the order torch's CPU ``sum`` over a contiguous last dimension adds them with 8-lane
    vectors (below 8 values: its scalar path, 4 interleaved partial sums). Thread-count independent."""
    n = x.shape[0]
    lanes = SUM_LANES if n >= SUM_LANES else 1
    groups = n // lanes  # vectors (or scalars)
    acc = np.zeros((_SUM_LEVELS, _SUM_ILP, lanes), dtype=np.float32)
    _multi_row_sum(x, square, lanes, groups // _SUM_ILP, acc)
    # row_sum: leftover vectors into partial 0, then partials 1..3 into partial 0, in order.
    for g in range(groups - groups % _SUM_ILP, groups):
        for l in range(lanes):
            v = x[g * lanes + l]
            acc[0, 0, l] += v * v if square else v
    for k in range(1, _SUM_ILP):
        for l in range(lanes):
            acc[0, 0, l] += acc[0, k, l]
    if lanes == 1:
        return acc[0, 0, 0]
    # vectorized_inner_sum: the scalar tail first, then the lanes in order.
    total = np.float32(0.0)
    for e in range(groups * lanes, n):
        v = x[e]
        total += v * v if square else v
    for l in range(lanes):
        total += acc[0, 0, l]
    return total


@njit
def _rms_norm_row(x, w, eps, out):
    n = x.shape[0]
    mean = torch_sum_f32(x, True) / np.float32(n)
    r = np.float32(1.0) / np.sqrt(mean + eps)
    for j in range(n):
        out[j] = bf16_scalar((x[j] * r) * w[j])


@njit(parallel=True)
def _rms_norm_kernel(x, w, eps, out):
    for i in prange(x.shape[0]):
        _rms_norm_row(x[i], w, eps, out[i])


_rms_norm_kernel_serial = serial_twin(_rms_norm_kernel)


def rms_norm(x, w, eps):
    """RMSNorm over the last dimension in f32: ``bf16((x * (1 / sqrt(mean(x^2) + eps))) * w)``.

    ``mean`` is the f32 sum of the f32 squares divided (f32) by n. The sum adds in torch's CPU order
    (``torch_sum_f32``), not left to right: on the goldens that order reproduces an order of magnitude
    more RMSNorm outputs bit for bit than an in-order sum. x is ``[..., n]``, w ``[n]``.
    """
    x = as_f32_array(x, "rms_norm: x")
    w = as_f32_array(w, "rms_norm: w")
    if w.ndim != 1:
        raise ValueError(f"rms_norm: w must be 1-D, got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"rms_norm: x of shape {x.shape} does not match w of shape {w.shape}")
    x2 = np.ascontiguousarray(x).reshape(-1, w.shape[0])
    wc = np.ascontiguousarray(w)
    out = np.empty_like(x2)
    if x2.shape[0]:
        sized_call(_rms_norm_kernel, x2.shape[0], w.shape[0] * ELEMENT_COST, x2, wc,
                   np.float32(eps), out)
    return out.reshape(x.shape)
