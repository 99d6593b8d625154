"""A tile's query heads as each packed kernel's A operand, written into one reusable buffer.

Each layout's operand is a tuple of arrays, its rows padded with zero heads (of scale 1) to a
multiple of every kernel's row step: ``query_pairs`` (AVX512-BF16), ``query_int8`` (VNNI's
per-block layout), ``query_folded`` (AMX) and ``query_offset_folded`` (VNNI's folded layout).
"""

from __future__ import annotations

import numpy as np

from ..numerics import (AMX_ROWS, INT8_GROUP, aligned_empty, bf16_pairs, folded_corrections,
                        folded_rows, int8_rows)

__all__ = ["query_rows", "query_pairs_size", "query_buffer", "query_pairs", "query_int8",
           "query_folded", "query_offset_folded"]


def query_rows(T: int, ih: int) -> int:
    """A tile's query heads, padded for every kernel's row step (DOT_ROWS divides AMX_ROWS)."""
    return -(-T * ih // AMX_ROWS) * AMX_ROWS


def query_pairs_size(T: int, ih: int, idim: int) -> int:
    """uint32 elements of a tile's query heads as bf16 pairs (padded rows): also room for their
    int8 layouts (5/16 and 1/4 of a uint32 per value, against 1/2)."""
    return query_rows(T, ih) * (idim // 2)


def query_buffer(qbuf, T, ih, idim):
    """``qbuf`` if it holds a tile's query heads, else a fresh buffer that does."""
    size = query_pairs_size(T, ih, idim)
    return qbuf if qbuf is not None and qbuf.size >= size else aligned_empty(size, np.uint32)


def query_pairs(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the bf16 kernel's A operand, in ``qbuf``."""
    T, ih, idim = iq.shape
    qp = qbuf[:query_pairs_size(T, ih, idim)].reshape(-1, idim // 2)
    bf16_pairs(iq.reshape(T * ih, idim), out=qp[:T * ih])
    qp[T * ih:] = 0
    return (qp,)


def query_int8(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the VNNI kernel's A operand, in ``qbuf``:
    ``((quads, corr, scales), range)``, the padding rows zeros of scale 1."""
    T, ih, idim = iq.shape
    rows = query_rows(T, ih)
    n_quads, n_groups = rows * idim // 4, rows * (idim // INT8_GROUP)
    quads = qbuf[:n_quads].reshape(rows, idim // 4)
    corr = qbuf[n_quads:n_quads + n_groups].view(np.int32).reshape(rows, -1)
    scales = qbuf[n_quads + n_groups:n_quads + 2 * n_groups].view(np.float32).reshape(rows, -1)
    *_, rng = int8_rows(iq.reshape(T * ih, idim), out=(quads, corr, scales))
    quads[T * ih:] = 0
    corr[T * ih:] = 0
    scales[T * ih:] = 1
    return (quads, corr, scales), rng


def query_offset_folded(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` folded as the VNNI kernel's A operand against
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`' keys, in ``qbuf``: ``((quads, corr,
    scales), range)``, :func:`query_folded`'s operand with each row's correction (``[rows,
    1]``: one group a row) after it in the buffer."""
    T, ih, idim = iq.shape
    rows = query_rows(T, ih)
    (quads, scales), rng = query_folded(iq, qbuf)
    corr = qbuf[rows * (idim // 4 + 1):rows * (idim // 4 + 2)].view(np.int32).reshape(rows, 1)
    folded_corrections(quads, out=corr)
    return (quads, corr, scales), rng


def query_folded(iq: np.ndarray, qbuf: np.ndarray) -> tuple:
    """A tile's query heads ``iq [T, ih, id]`` as the AMX kernel's A operand, in ``qbuf``:
    ``((quads, scales), range)``, the padding rows zeros of scale 1."""
    T, ih, idim = iq.shape
    rows = query_rows(T, ih)
    quads = qbuf[:rows * idim // 4].reshape(rows, idim // 4)
    scales = qbuf[rows * idim // 4:rows * (idim // 4 + 1)].view(np.float32).reshape(rows, 1)
    *_, rng = folded_rows(iq.reshape(T * ih, idim), out=(quads, scales))
    quads[T * ih:] = 0
    scales[T * ih:] = 1
    return (quads, scales), rng

