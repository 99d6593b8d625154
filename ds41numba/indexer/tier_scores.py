"""Index scores on each packed tier, from a tile's queries and keys packed for it.

Each entry point packs the tile's queries into its layout (:mod:`.query_layouts`) and runs the
layout's kernel (:func:`~.packed_scores.tile_scores_packed`). The integer tiers return None
where their integer dot products would not be the f32 value the other kernels give (values
that are not fp4, rows that do not fold): the caller, :class:`~.key_cache.IndexKeyCache`, then
runs the next tier down. Which tier scores a head size: :func:`amx_scored`,
:func:`vnni_folded_scored`, :func:`int8_scored` (else AVX512-BF16, else BLAS).
"""

from __future__ import annotations

import numpy as np

from ..numerics import (AMX_K, INT8_GROUP, converted_mix_exact, foldable, int8_dot_exact,
                        tier_at_least)
from .candidate_scores import NeededKeys
from .packed_scores import tile_scores_packed
from .query_layouts import query_buffer, query_folded, query_int8, query_offset_folded, query_pairs

__all__ = ["int8_scored", "amx_scored", "vnni_folded_scored", "tile_scores_bf16",
           "tile_scores_int8", "tile_scores_vnni_folded", "tile_scores_amx"]


def int8_scored(head_dim: int) -> bool:
    """Index scores of this head size run as integer dot products on the per-block layout
    (AVX512-VNNI, else AVX2): the tier is on, and the heads split into the fp4 quantiser's
    blocks (which any quantised head does)."""
    return tier_at_least("avx2int8") and head_dim % INT8_GROUP == 0


def amx_scored(head_dim: int) -> bool:
    """... and first on AMX: that tier is on, and the heads split into its tile products."""
    return tier_at_least("amx") and head_dim % AMX_K == 0


def vnni_folded_scored(head_dim: int) -> bool:
    """... and first on VNNI's folded rows: the VNNI tier (not AMX), heads as long as AMX's."""
    return tier_at_least("avx512vnni") and not tier_at_least("amx") and head_dim % AMX_K == 0


def _check_key_dims(name: str, packed: np.ndarray, per_value: int, idim: int) -> None:
    """Packed keys must hold ``idim / per_value`` elements a row (``per_value`` values an element)."""
    if packed.shape[1] != idim // per_value:
        raise ValueError(f"{name}: packed keys {packed.shape} are not of {idim} dims")


def tile_scores_bf16(iq: np.ndarray, w: np.ndarray, keys: np.ndarray, clen: np.ndarray,
                     width: int, out: np.ndarray | None = None,
                     qbuf: np.ndarray | None = None, dirty_to: int | None = None,
                     maxima: tuple | None = None, need: NeededKeys | None = None) -> np.ndarray:
    """The scores (:func:`~.blas_scores.tile_scores`) on AVX512-BF16 against packed keys
    (``[blocks, id / 2, DOT_LANES]``); ``qbuf`` a reusable uint32 buffer of at least
    :func:`~.query_layouts.query_pairs_size` elements; ``need``: the keys each query
    needs (:func:`~.packed_scores.tile_scores_packed`)."""
    T, ih, idim = iq.shape
    _check_key_dims("tile_scores_bf16", keys, 2, idim)
    q = query_pairs(iq, query_buffer(qbuf, T, ih, idim))
    return tile_scores_packed("bf16", q, (keys,), w, clen, width, out=out, dirty_to=dirty_to,
                              maxima=maxima, need=need)


def tile_scores_int8(iq: np.ndarray, w: np.ndarray, keys: tuple, key_range: np.ndarray,
                     clen: np.ndarray, width: int, out: np.ndarray | None = None,
                     qbuf: np.ndarray | None = None,
                     dirty_to: int | None = None, maxima: tuple | None = None,
                     need: NeededKeys | None = None) -> np.ndarray | None:
    """The scores on AVX512-VNNI (on AVX2 where VNNI is not on) against keys packed by
    :func:`~ds41numba.numerics.pack_int8_blocks` (``(quads, scales)`` and their range), or None
    when these queries and keys are not all fp4 values whose dot products are exact in f32
    (:func:`~ds41numba.numerics.int8_dot_exact`): only then is the integer dot product the f32
    value the other kernels give, and the caller runs one of them instead."""
    T, ih, idim = iq.shape
    _check_key_dims("tile_scores_int8", keys[0], 4, idim)
    q, q_range = query_int8(iq, query_buffer(qbuf, T, ih, idim))
    if not int8_dot_exact(q_range, key_range, idim):
        return None
    layout = "int8" if tier_at_least("avx512vnni") else "int8_pairs"
    return tile_scores_packed(layout, q, keys, w, clen, width, out=out, dirty_to=dirty_to,
                              maxima=maxima, need=need)


def _tile_scores_folded(layout: str, query, iq: np.ndarray, w: np.ndarray, keys: tuple,
                        key_range: np.ndarray, clen: np.ndarray, width: int,
                        out: np.ndarray | None = None, qbuf: np.ndarray | None = None,
                        dirty_to: int | None = None, maxima: tuple | None = None,
                        need: NeededKeys | None = None) -> np.ndarray | None:
    """The scores on folded rows (``layout`` ``"amx"`` or ``"vnni_folded"``), the queries folded
    by ``query``, or None when the queries or keys do not fold or their products are not exact;
    the mix rounds on the conversion where :func:`~ds41numba.numerics.converted_mix_exact`
    allows (the query scales are the operand's last array)."""
    T, ih, idim = iq.shape
    _check_key_dims(f"tile_scores_{layout}", keys[0], 4, idim)
    q, q_range = query(iq, query_buffer(qbuf, T, ih, idim))
    if not (foldable(q_range, key_range) and int8_dot_exact(q_range, key_range, idim)):
        return None
    converts = converted_mix_exact(q[-1], key_range, w)
    return tile_scores_packed(layout, q, keys, w, clen, width, out=out, dirty_to=dirty_to,
                              converts=converts, maxima=maxima, need=need)


def tile_scores_vnni_folded(iq, w, keys, key_range, clen, width, **kwargs):
    """:func:`tile_scores_int8` with both sides folded (one scale a row, one integer a dot
    product, mixed as it is formed) against keys packed by
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`, or None where they do not fold or
    are not exact: the caller then runs the per-block layout."""
    return _tile_scores_folded("vnni_folded", query_offset_folded, iq, w, keys, key_range, clen,
                               width, **kwargs)


def tile_scores_amx(iq, w, keys, key_range, clen, width, **kwargs):
    """:func:`tile_scores_int8` on AMX against keys packed by
    :func:`~ds41numba.numerics.pack_folded_blocks`, or None when the queries or keys do not fold
    (:func:`~ds41numba.numerics.foldable`) or their products are not exact: the caller then
    runs the VNNI kernel (which any foldable rows also pass)."""
    return _tile_scores_folded("amx", query_folded, iq, w, keys, key_range, clen, width, **kwargs)
