"""The index key cache: the keys a key owner writes, kept also in the layout its tier scores.

:meth:`IndexKeyCache.scores` picks the tier's kernel (:mod:`.tier_scores`) and falls back a
tier where the keys or queries need it; every kernel gives the same scores.
"""

from __future__ import annotations

import numpy as np

from ..numerics import (DOT_LANES, EMPTY_RANGE, FOLDED_KEY_OFFSET, KEY_OFFSET, aligned_empty,
                        folded_blocks_shape, foldable, int8_blocks_shape, merge_ranges, pack_bf16_pairs,
                        pack_folded_blocks, pack_int8_blocks, pack_offset_folded_blocks,
                        tier_at_least)
from .blas_scores import tile_scores
from .block_maxima import visible_block_maxima
from .candidate_scores import NeededKeys, clear_key_blocks
from .tier_scores import (amx_scored, int8_scored, tile_scores_amx, tile_scores_bf16, tile_scores_int8,
                          tile_scores_vnni_folded, vnni_folded_scored)

__all__ = ["IndexKeyCache"]


class IndexKeyCache:
    """The index keys a key owner writes and every index source scores against.

    ``keys`` holds the rows (f32 ``[capacity, id]``, bf16 values: the fp4-quantised keys). When
    the products run on a packed kernel (:func:`~ds41numba.numerics.backend`) the cache keeps
    the same rows a second time in the layout that kernel reads, written together with them: a
    decode step scores every key, and repacking them all each step would cost more than scoring
    them (15 ms at 65,536 keys). On AMX that is ``folded`` (``(quads, scales)``, see
    :func:`~ds41numba.numerics.pack_folded_blocks`, with ``folded_range``, what decides whether
    they fold); on AVX512-VNNI ``vnni_folded`` (``(quads, scales)`` folded for ``vpdpbusd``, see
    :func:`~ds41numba.numerics.pack_offset_folded_blocks`, with ``vnni_folded_range``) for heads of
    a multiple of 64 values, else ``int8`` (``(quads, scales)``, see
    :func:`~ds41numba.numerics.pack_int8_blocks`, with ``int8_range``, what decides whether their
    integer dot products are exact); on AVX2 (the ``avx2int8`` tier) ``int8`` alone, scored
    with ``vpmaddubsw``; on AVX512-BF16 ``blocks`` (see
    :func:`~ds41numba.numerics.pack_bf16_pairs`). A tier also packs the next tier's layout,
    once, the first time its own kernel cannot score the keys (rows that do not fold, products
    not exact as integers). :meth:`scores` picks the kernel; every kernel gives the same scores.
    """

    __slots__ = ("keys", "blocks", "int8", "int8_range", "folded", "folded_range", "vnni_folded",
                 "vnni_folded_range", "_blank")

    #: The byte of a key 0 in each integer layout: what a row not written yet holds there (a
    #: row of zeros of scale 1).
    _ZERO_BYTE = {"folded": 0, "vnni_folded": FOLDED_KEY_OFFSET, "int8": KEY_OFFSET}

    def __init__(self, keys: np.ndarray, packed_rows: int | None = None):
        """Wrap ``keys`` (kept as given, not copied); its first ``packed_rows`` rows (all by
        default) hold keys already and are packed."""
        self.keys = keys
        self.blocks = self.int8 = self.folded = self.vnni_folded = None
        self._blank = 0
        self.int8_range = self.folded_range = self.vnni_folded_range = EMPTY_RANGE
        rows = keys.shape[0] if packed_rows is None else packed_rows
        if amx_scored(keys.shape[1]):
            self._pack_folded(rows)
        if vnni_folded_scored(keys.shape[1]):
            self._pack_vnni_folded(rows)
        if int8_scored(keys.shape[1]) and not self._folds():
            self._pack_int8(rows)
        if tier_at_least("avx512bf16") and not (self._folds() or (self.int8 is not None and not self.int8_range[0])):
            self._pack_all(rows)

    @classmethod
    def empty(cls, capacity: int, head_dim: int) -> "IndexKeyCache":
        """A key owner's cache of ``capacity`` rows, none written yet."""
        return cls(np.zeros((capacity, head_dim), np.float32), packed_rows=0)

    def _pack_all(self, rows: int) -> None:
        n, d = self.keys.shape
        self.blocks = np.zeros((-(-n // DOT_LANES), d // 2, DOT_LANES), np.uint32)
        if rows:
            pack_bf16_pairs(self.keys[:rows], self.blocks, 0)

    def _folds(self) -> bool:
        """Whether the cache holds folded keys (either layout) and they all fold."""
        return ((self.folded is not None and foldable(self.folded_range, EMPTY_RANGE))
                or (self.vnni_folded is not None and foldable(self.vnni_folded_range, EMPTY_RANGE)))

    def _layout(self, name: str, shapes: tuple) -> tuple:
        """A new integer layout ``(quads, scales)`` of ``shapes``, blank as far as the others
        (:meth:`_blank_to`), the rest not yet laid down."""
        quads, scales = aligned_empty(shapes[0], np.uint32), np.ones(shapes[1], np.float32)
        self._lay_blank(name, quads, 0, self._blank)
        return quads, scales

    def _lay_blank(self, name: str, quads: np.ndarray, lo: int, hi: int) -> None:
        quads[lo:hi] = np.uint32(self._ZERO_BYTE[name] * 0x01010101)

    def _blank_to(self, rows: int) -> None:
        """Every integer layout's blocks up to row ``rows`` laid down as rows not written (then
        packed over as rows are written). A key owner's cache is sized for the model's whole
        context (hundreds of MB a layout at V4.1's), while a run reads the blocks of the
        positions it reached: the rest is never touched, in memory or in time."""
        top = min(-(-rows // DOT_LANES), -(-self.keys.shape[0] // DOT_LANES))
        if top <= self._blank:
            return
        for name in self._ZERO_BYTE:
            if getattr(self, name) is not None:
                self._lay_blank(name, getattr(self, name)[0], self._blank, top)
        self._blank = top

    def _pack_vnni_folded(self, rows: int) -> None:
        self.vnni_folded = self._layout("vnni_folded", folded_blocks_shape(*self.keys.shape))
        self.vnni_folded_range = EMPTY_RANGE
        self._blank_to(rows)
        if rows:
            self.vnni_folded_range = pack_offset_folded_blocks(self.keys[:rows], self.vnni_folded, 0)[2]

    def _pack_folded(self, rows: int) -> None:
        self.folded = self._layout("folded", folded_blocks_shape(*self.keys.shape))
        self.folded_range = EMPTY_RANGE
        self._blank_to(rows)
        if rows:
            self.folded_range = pack_folded_blocks(self.keys[:rows], self.folded, 0)[2]

    def _pack_int8(self, rows: int) -> None:
        self.int8 = self._layout("int8", int8_blocks_shape(*self.keys.shape))
        self.int8_range = EMPTY_RANGE
        self._blank_to(rows)
        if rows:
            self.int8_range = pack_int8_blocks(self.keys[:rows], self.int8, 0)[2]

    def write(self, first_row: int, keys: np.ndarray) -> None:
        """Keys of rows ``first_row .. first_row + len(keys)``, into every layout kept. The
        range only widens (rows written over keep counting), which can only send a tile to the
        bf16 kernel, never give a wrong score; keys that are not fp4 values (a bad range) start
        the bf16 layout at once."""
        self.keys[first_row:first_row + len(keys)] = keys
        if not len(keys):
            return
        self._blank_to(first_row + len(keys))
        rows = self.keys[first_row:first_row + len(keys)]
        if self.blocks is not None:
            pack_bf16_pairs(rows, self.blocks, first_row)
        if self.folded is not None:
            self.folded_range = merge_ranges(self.folded_range,
                                             pack_folded_blocks(rows, self.folded, first_row)[2])
        if self.vnni_folded is not None:
            self.vnni_folded_range = merge_ranges(self.vnni_folded_range, pack_offset_folded_blocks(
                rows, self.vnni_folded, first_row)[2])
        if (self.folded is not None or self.vnni_folded is not None) and not self._folds() \
                and self.int8 is None:                      # keys the per-block layout will score
            self._pack_int8(self.keys.shape[0])
        if self.int8 is not None:
            self.int8_range = merge_ranges(self.int8_range,
                                           pack_int8_blocks(rows, self.int8, first_row)[2])
            if self.int8_range[0] and self.blocks is None and tier_at_least("avx512bf16"):
                # keys the bf16 kernel will score
                self._pack_all(self.keys.shape[0])

    def scores(self, iq: np.ndarray, w: np.ndarray, clen: np.ndarray, width: int,
               out: np.ndarray | None = None, qbuf: np.ndarray | None = None,
               dirty_to: int | None = None, maxima: tuple | None = None,
               need: NeededKeys | None = None) -> np.ndarray:
        """A tile's scores ``[T, width]`` after the visibility mask (see :func:`tile_scores`);
        ``dirty_to``: the columns of ``out`` from there on hold -inf already (:func:`masked_buffer`).

        ``need`` (a candidate consumer's, :class:`~.candidate_scores.NeededKeys`): the keys
        whose scores each query needs; the packed kernels form those of the key blocks of
        ``DOT_LANES`` positions holding one (VNNI's folded kernel: the quarters holding one) and
        no other, leaving the other positions (below ``clen``) as they were for the caller to
        mask. BLAS's tier forms every score and writes -inf outside those key blocks (what a
        caller that keeps its rows -inf there finds either way).

        ``maxima = (block, block_max)``: also each row's maxima of the blocks of ``block``
        positions it sees, into ``block_max [T, >= ceil(width / block)]`` (float32): entry
        ``[s, j]`` for ``j < ceil(clen[s] / block)`` the max (NaN wins) over the positions ``j *
        block ..`` below ``clen[s]``, the rest left as they were. The packed kernels take them
        while each key block's scores are in cache (``block`` dividing DOT_LANES); otherwise a
        pass over the scores after them.
        """
        if maxima is not None:
            block, block_max = maxima
            if block < 1 or block_max.dtype != np.float32 or block_max.shape[0] < len(clen) \
                    or block_max.shape[1] < -(-width // block):
                raise ValueError(f"IndexKeyCache.scores: block maxima of {block} positions need a "
                                 f"float32 [{len(clen)}, {-(-width // max(block, 1))}] buffer, got "
                                 f"{block_max.dtype} {block_max.shape}")
        self._blank_to(width)
        # The integer tiers, highest first; each declines (None) where it is not exact.
        for scored, layout, pack, tier_scores in (
                (amx_scored, "folded", self._pack_folded, tile_scores_amx),
                (vnni_folded_scored, "vnni_folded", self._pack_vnni_folded, tile_scores_vnni_folded),
                (int8_scored, "int8", self._pack_int8, tile_scores_int8)):
            if not scored(self.keys.shape[1]):
                continue
            if getattr(self, layout) is None:   # made while the products ran on another tier
                pack(self.keys.shape[0])
            got = tier_scores(iq, w, getattr(self, layout), getattr(self, layout + "_range"), clen,
                              width, out=out, qbuf=qbuf, dirty_to=dirty_to, maxima=maxima,
                              need=need)
            if got is not None:
                return got
        if not tier_at_least("avx512bf16"):
            got = tile_scores(iq, w, self.keys[:width], clen, width, out=out, dirty_to=dirty_to)
            if maxima is not None:
                visible_block_maxima(got, clen, *maxima)
            if need is not None:    # -inf where a packed kernel forms nothing: the same rows
                clear_key_blocks(got, 1 - need.key_blocks, DOT_LANES)
            return got
        if self.blocks is None:
            self._pack_all(self.keys.shape[0])
        return tile_scores_bf16(iq, w, self.blocks, clen, width, out=out, qbuf=qbuf,
                                dirty_to=dirty_to, maxima=maxima, need=need)
