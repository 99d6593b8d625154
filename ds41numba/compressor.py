"""The KV compressor: one latent per ``compress_ratio`` tokens.

A ratio-r layer attends, beyond its sliding window, to a compressed history in which each
group of r consecutive tokens is pooled into one latent. The pooling weights are learned:
each token gets a gate score per feature, and the group's latent is the softmax-weighted sum
of the group's KV projections, feature by feature. Ratio 1 degenerates to a plain projection.
During decode a group fills one token at a time, so the partial group lives in the state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16 as BF16
from numba import prange

from .jit import njit
from .batch import SINGLE, BatchRow, checked_batch
from .numerics import (is_int, linear_bf16, linear_f32, rms_norm, serial_twin, sized_call,
                       to_bf16_rne)
from .numerics.formats import ELEMENT_COST
from .step import Step

__all__ = ["CompressorWeights", "CompressorState", "compressor", "latent_positions"]


@dataclass
class CompressorWeights:
    """``wkv [hd, dim]`` (bf16 values for ratio 1, f32 for ratio > 1), ``wgate [hd, dim]`` f32
    (ratio > 1 only), ``norm [hd]`` bf16."""

    wkv: np.ndarray
    wgate: np.ndarray | None
    norm: np.ndarray


@dataclass
class CompressorState:
    """The partial group of a ratio > 1 compressor: ``kv`` and ``score``, ``[r, hd]`` f32.

    Token p's projections live in slot ``p % r`` until its group completes. Slots start as
    kv 0 and score -inf; pooling does not clear them.
    """

    kv: np.ndarray | None
    score: np.ndarray | None

    @classmethod
    def fresh(cls, ratio: int, head_dim: int) -> "CompressorState":
        if ratio <= 1:
            return cls(kv=None, score=None)
        return cls(kv=np.zeros((ratio, head_dim), np.float32),
                   score=np.full((ratio, head_dim), -np.inf, np.float32))


def latent_positions(start_pos: int, seqlen: int, ratio: int, prefill: bool | None = None) -> np.ndarray:
    """Positions of the latents a step produces: a latent stands for its group's first token.

    ``prefill`` (default: ``start_pos == 0``) says the step is (a chunk of) a prefill: it
    produces the groups it completes, ``start_pos // r .. (start_pos + seqlen) // r - 1``."""
    if start_pos == 0 if prefill is None else prefill:
        return np.arange(start_pos // ratio, (start_pos + seqlen) // ratio, dtype=np.int64) * ratio
    if (start_pos + 1) % ratio == 0:
        return np.array([start_pos + 1 - ratio], dtype=np.int64)
    return np.zeros(0, dtype=np.int64)


@njit(parallel=True)
def _pool_groups(kv, score, ratio):
    """Softmax over each group's r scores, per feature, then the weighted sum of kv, in f32.

    The r-term sums run in token order, as torch reduces a non-innermost dimension.
    """
    groups = kv.shape[0] // ratio
    hd = kv.shape[1]
    out = np.empty((groups, hd), np.float32)
    for g in prange(groups):
        base = g * ratio
        for f in range(hd):
            m = score[base, f]
            for j in range(1, ratio):
                if score[base + j, f] > m:
                    m = score[base + j, f]
            denom = np.float32(0.0)
            for j in range(ratio):
                denom += np.float32(np.exp(score[base + j, f] - m))
            acc = np.float32(0.0)
            for j in range(ratio):
                p = np.float32(np.exp(score[base + j, f] - m)) / denom
                acc += kv[base + j, f] * p
            out[g, f] = acc
    return out


_pool_groups_serial = serial_twin(_pool_groups)


def _pooled(kv, score, ratio):
    """``_pool_groups`` of every whole group of ``kv`` / ``score`` (:func:`sized_call`)."""
    return sized_call(_pool_groups, kv.shape[0] // ratio, ratio * kv.shape[1] * ELEMENT_COST,
                      kv, score, ratio)


def _check_args(x, start_pos, ratio, weights, state, prefill_len):
    """What the pooling kernel indexes by must agree: a mismatch is an error, not a stray read."""
    if not is_int(ratio, 1):
        raise ValueError(f"compressor: ratio must be a positive integer, got {ratio!r}")
    if not is_int(start_pos, 0):
        raise ValueError(f"compressor: start_pos must be an integer >= 0, got {start_pos!r}")
    if (not isinstance(x, np.ndarray) or x.dtype not in (np.float32, BF16) or x.ndim != 2
            or x.shape[0] == 0):
        raise ValueError(f"compressor: x must be a non-empty float32 [seqlen, dim] array, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    if prefill_len is None and start_pos > 0 and x.shape[0] != 1:
        raise ValueError(f"compressor: a decode (start_pos {start_pos} > 0) takes one token, got "
                         f"{x.shape[0]} (a chunk of a prefill says so: prefill_len)")
    if prefill_len is not None and not is_int(prefill_len, start_pos + x.shape[0]):
        raise ValueError(f"compressor: prefill_len must be an integer >= {start_pos + x.shape[0]} "
                         f"(the chunk's end), got {prefill_len!r}")
    shape = tuple(getattr(weights.wkv, "shape", ()))
    if len(shape) != 2 or shape[1] != x.shape[1]:
        raise ValueError(f"compressor: wkv must be [hd, {x.shape[1]}], got {list(shape)}")
    if ratio > 1:
        if tuple(getattr(weights.wgate, "shape", ())) != shape:
            raise ValueError(f"compressor: wgate must have wkv's shape {list(shape)}, got "
                             f"{None if weights.wgate is None else list(weights.wgate.shape)}")
        for name in ("kv", "score"):
            a = getattr(state, name)
            if not isinstance(a, np.ndarray) or a.shape != (ratio, shape[0]) or a.dtype != np.float32:
                raise ValueError(f"compressor: state.{name} must be float32 [{ratio}, {shape[0]}] "
                                 f"(CompressorState.fresh(ratio, hd)), got "
                                 f"{None if a is None else (a.dtype, list(a.shape))}")


def compressor(x: np.ndarray, start_pos: int, ratio: int, weights: CompressorWeights,
               state: CompressorState, norm_eps: float,
               prefill_len: int | None = None, batch: BatchRow = SINGLE) -> np.ndarray | None:
    """Compress the step's tokens; return the new pre-RoPE latents ``[groups, hd]`` or None.

    Prefill (``start_pos == 0``) pools every complete group and keeps the trailing
    ``P % r`` tokens in ``state`` slots ``0 .. P % r - 1``; decode puts the token in slot
    ``start_pos % r`` and pools when that completes a group. Positions: :func:`latent_positions`.

    ``prefill_len`` makes the step rows ``start_pos ..`` of a prefill of that many tokens given
    in chunks (``start_pos`` the previous chunk's end): the chunk's tokens join the partial group
    the state holds, the groups they complete are pooled, the new partial group is kept (the
    slots after it fresh, as a one-shot prefill leaves them), and every product sums as the
    one-shot prefill's does; the chunks' latents are the one-shot prefill's, in order.

    ``batch``: this is one sequence of a batch run in lockstep; the projections sum as rows
    ``batch.first(n, s)`` of the batch's ``batch.rows(n)``-row products, ``n`` the reference
    call's rows (:class:`~ds41numba.step.Step`; :mod:`ds41numba.batch`: the reference's
    ``[B, seqlen, dim]`` input flattened).
    """
    _check_args(x, start_pos, ratio, weights, state, prefill_len)
    step = Step(start_pos, x.shape[0], prefill_len, checked_batch(batch, "compressor"))
    if ratio == 1:
        return rms_norm(linear_bf16(x, weights.wkv, ref_rows=step.ref_rows), weights.norm,
                        norm_eps)
    # The f32 products' order follows each row's place in the reference call (its MKL rule).
    first = step.batch.first(step.ref_seqlen, step.call_row)
    kv = linear_f32(x, weights.wkv, ref_rows=step.ref_rows, first_row=first)
    score = linear_f32(x, weights.wgate, ref_rows=step.ref_rows, first_row=first)
    if not step.decode:
        held = start_pos % ratio            # this group's earlier tokens, in slots 0 .. held-1
        if held:
            kv = np.concatenate([state.kv[:held], kv])
            score = np.concatenate([state.score[:held], score])
        full = kv.shape[0] - kv.shape[0] % ratio
        rest = kv.shape[0] - full
        state.kv[:rest] = kv[full:]
        state.score[:rest] = score[full:]
        state.kv[rest:] = 0
        state.score[rest:] = -np.inf
        if full == 0:
            return None
        pooled = _pooled(kv[:full], score[:full], ratio)
    else:
        slot = start_pos % ratio
        state.kv[slot] = kv[0]
        state.score[slot] = score[0]
        if (start_pos + 1) % ratio:
            return None
        pooled = _pooled(state.kv, state.score, ratio)
    return rms_norm(to_bf16_rne(pooled), weights.norm, norm_eps)
