"""The head mix of the index scores in LLVM IR, as the integer kernels' products come out of
them: each row tile's exact integer scores scaled, rounded to bf16, ReLU'd, weighted by its
head, rounded again and summed over a query's heads in order, then rounded into the query's row
of scores (the reference's ``mix_heads_by_head``, :mod:`ds41numba.indexer.blas_scores`).

The mixing kernels build on it, each through :func:`mix_tiles`: AMX's
(:func:`.amx_dot.amx_mix_tile`), the VNNI tier's on folded rows (:func:`.int8_dot.vnni_mix_tile`)
and AVX2's on the per-block layout (:func:`.int8_pairs.pairs_mix_tile`, its scores already
placed in f32: :class:`PlacedMix`). Two mixers, one result: :class:`BitsMix`
rounds with integer arithmetic on the bits, :class:`ConvertedMix` with the CPU's conversion
instruction where :func:`converted_mix_exact` says the two agree.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba.core import cgutils

from .bf16_dot import DOT_LANES, DOT_ROWS
from .folded_layouts import AMX_ROWS
from .vector_ir import F32, I32, V16F, V16I, i64, key_vector, load_row, row_pointer, splat

__all__ = ["MAX_BLOCK", "BitsMix", "ConvertedMix", "PlacedMix", "converted_mix_exact", "mix_tiles"]

# Vectors of 16 keys in a key block.
_HALVES = DOT_LANES // 16


def _bf16_round(builder, v, may_be_nan):
    """``v`` (16 f32 lanes) rounded to bf16 as :func:`.formats.bf16_scalar` rounds: RNE on the
    bits, a NaN made quiet with its sign."""
    c = lambda x: ir.Constant(V16I, [x] * 16)      # noqa: E731
    bits = builder.bitcast(v, V16I)
    lsb = builder.and_(builder.lshr(bits, c(16)), c(1))
    rounded = builder.and_(builder.add(builder.add(bits, c(0x7FFF)), lsb), c(0xFFFF0000 - (1 << 32)))
    if may_be_nan:
        nan = builder.icmp_unsigned(">", builder.and_(bits, c(0x7FFFFFFF)), c(0x7F800000))
        quiet = builder.or_(builder.and_(bits, c(-(1 << 31))), c(0x7FC00000))
        rounded = builder.select(nan, quiet, rounded)
    return builder.bitcast(rounded, V16F)


def _head_weight(builder, w):
    """A head's weight (an f32 scalar) with a NaN made quiet with its sign and no payload, as
    :func:`~ds41numba.indexer.blas_scores.mix_heads_by_head` takes it: a product with it is
    then a NaN only as one with no payload (its, or the CPU's default NaN for 0 * inf), which
    rounding on the bits leaves as it is, so the weighted term's rounding needs no NaN test."""
    bits = builder.bitcast(w, I32)
    nan = builder.icmp_unsigned(">", builder.and_(bits, ir.Constant(I32, 0x7FFFFFFF)),
                                ir.Constant(I32, 0x7F800000))
    quiet = builder.or_(builder.and_(bits, ir.Constant(I32, -(1 << 31))), ir.Constant(I32, 0x7FC00000))
    return builder.bitcast(builder.select(nan, quiet, bits), F32)


def _lanes(v):
    return ir.Constant(V16I, [v] * 16)


#: Keys a block maximum of :func:`.amx_dot.amx_mix_tile` spans (the production candidate block).
MAX_BLOCK = 8


def _nan_max(builder, a, b):
    """Lane by lane the larger of ``a`` and ``b``, a NaN in either winning."""
    bigger = builder.select(builder.fcmp_ordered(">", b, a), b, a)
    return builder.select(builder.fcmp_unordered("uno", a, b), builder.fadd(a, b), bigger)


class BitsMix:
    """Each row tile's products scaled, rounded to bf16 on the bits (RNE), ReLU'd, weighted,
    rounded again and added into the query's head sums, rows (heads) in order; lane j of the
    sums is key j."""

    #: Rows of a row tile.
    TILE = AMX_ROWS

    def __init__(self, builder, s_op, w_op, t_op, maxima):
        self.b, self.s_op, self.w_op = builder, s_op, w_op
        self.m_op, self.maxima = maxima
        zero = ir.Constant(V16F, [0.0] * 16)
        self.acc = [cgutils.alloca_once_value(builder, zero) for _ in range(_HALVES)]
        self.sk = [key_vector(builder, t_op, i64(0), h, V16F) for h in range(_HALVES)] if t_op else None

    def rows(self, src_at, rt, rows=None):
        """Row tile ``rt``'s products (``[TILE, DOT_LANES]`` at ``src_at``), its rows ``rows``
        (in order; all by default)."""
        builder = self.b
        src = (src_at, i64(4 * DOT_LANES))
        zero = ir.Constant(V16F, [0.0] * 16)
        for m in range(self.TILE) if rows is None else rows:
            row = builder.add(builder.mul(rt, i64(self.TILE)), i64(m))
            wr = splat(builder, _head_weight(builder, load_row(builder, self.w_op, row, i64(0), F32)), V16F)
            for h, v in enumerate(self.scores(src, m, row)):
                v = builder.select(builder.fcmp_ordered("<", v, zero), zero, v)
                term = _bf16_round(builder, builder.fmul(v, wr), False)
                builder.store(builder.fadd(builder.load(self.acc[h]), term), self.acc[h])

    def scores(self, src, m, row):
        """Row ``m``'s scores, rounded to bf16: int32 integers scaled by the row's and the keys'
        scales (row ``row`` of the operands)."""
        builder = self.b
        sq = splat(builder, load_row(builder, self.s_op, row, i64(0), F32), V16F)
        # The score is exact and finite (see amx_dot_tile): no NaN to keep. It is never -0
        # either (an integer zero times a scale).
        ints = [builder.sitofp(load_row(builder, src, i64(m), i64(64 * h), V16I), V16F)
                for h in range(_HALVES)]
        return [_bf16_round(builder, builder.fmul(ints[h], builder.fmul(sq, self.sk[h])), False)
                for h in range(_HALVES)]

    def finish(self, o_op, q):
        """Query ``q``'s sums rounded into its row of ``out``, and the sums zeroed."""
        builder = self.b
        sums = [_bf16_round(builder, builder.load(acc), True) for acc in self.acc]
        for h in range(_HALVES):
            builder.store(sums[h], row_pointer(builder, o_op, q, i64(64 * h), V16F), align=4)
            builder.store(ir.Constant(V16F, [0.0] * 16), self.acc[h])
        self.block_maxima(q, sums)

    def block_maxima(self, q, sums):
        """Where asked, query ``q``'s maxima of its scores ``sums`` (two vectors, keys in order)
        over each ``MAX_BLOCK`` keys, into its row of ``block_max``: three steps of a max
        against the lanes swapped in pairs, fours, eights. A NaN wins, as in torch's amax (which
        NaN does not matter: every use reads it as NaN)."""
        builder = self.b
        with builder.if_then(self.maxima):
            for step in (4, 2, 1):
                lanes = ir.Constant(V16I, [j ^ step for j in range(16)])
                sums = [_nan_max(builder, v, builder.shuffle_vector(v, v, lanes)) for v in sums]
            firsts = ir.Constant(ir.VectorType(I32, 4), [0, MAX_BLOCK, 16, 16 + MAX_BLOCK])
            ptr = row_pointer(builder, self.m_op, q, i64(0), ir.VectorType(F32, 4))
            builder.store(builder.shuffle_vector(sums[0], sums[1], firsts), ptr, align=4)


class PlacedMix(BitsMix):
    """:class:`BitsMix` of scores already placed in f32 (``[TILE, DOT_LANES]`` f32, rows of
    ``DOT_ROWS``): the per-block layout's, each 32-value group placed by its own scales
    (:func:`.int8_dot.add_group_term`). Exact and finite where the kernel's are, never -0."""

    TILE = DOT_ROWS

    def __init__(self, builder, w_op, maxima):
        super().__init__(builder, None, w_op, None, maxima)

    def scores(self, src, m, row):
        return [_bf16_round(self.b, load_row(self.b, src, i64(m), i64(64 * h), V16F), False)
                for h in range(_HALVES)]


def mix_tiles(builder, mix, n_tiles, n_queries, o_op, fill):
    """A mixing kernel's loop over its ``n_tiles`` row tiles (``n_queries`` queries' worth):
    ``fill(rt)`` forms row tile ``rt``'s products in an L1 buffer and returns its address, ``mix``
    adds them into the query's sums, each query's row of ``o_op`` written when its last tile is
    in."""
    tiles_per_query = builder.udiv(n_tiles, n_queries)
    with cgutils.for_range(builder, n_tiles) as loop:
        rt = loop.index
        mix.rows(fill(rt), rt)
        done = builder.add(rt, i64(1))
        with builder.if_then(builder.icmp_unsigned("==", builder.urem(done, tiles_per_query), i64(0))):
            mix.finish(o_op, builder.sub(builder.udiv(done, tiles_per_query), i64(1)))


_V32H = ir.VectorType(ir.IntType(16), 32)


class _BFloat(ir.Type):
    """LLVM's ``bfloat`` (llvmlite has no such type), to declare the conversion's result."""

    def _to_string(self):
        return "bfloat"


def _round_pair(builder, lo, hi, relu=False):
    """Two vectors of 16 f32 rounded to bf16 by ``vcvtne2ps2bf16`` (RNE; denormal inputs and
    results flushed to zero), back as f32 and split by parity: of the 32 values ``[lo, hi]``,
    the even ones (value ``2d`` in lane d) and the odd ones. No shuffle: each result pair is
    one 32-bit lane of the instruction's output. ``relu``: negative results made +0 on the
    32 bf16 values at once (a signed 16-bit max with 0: a bf16 value and its bit pattern have
    the same sign)."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VectorType(_BFloat(), 32), [V16F, V16F]),
        "llvm.x86.avx512bf16.cvtne2ps2bf16.512")
    pairs = builder.call(fn, [hi, lo])        # the low half from its 2nd operand
    if relu:
        halves = builder.bitcast(pairs, _V32H)
        zero = ir.Constant(_V32H, [0] * 32)
        pairs = builder.select(builder.icmp_signed(">", halves, zero), halves, zero)
    pairs = builder.bitcast(pairs, V16I)
    even = builder.bitcast(builder.shl(pairs, _lanes(16)), V16F)
    odd = builder.bitcast(builder.and_(pairs, _lanes(0xFFFF0000 - (1 << 32))), V16F)
    return even, odd


def _split(order):
    """The lanes' keys after :func:`_round_pair` of two vectors holding keys ``order``."""
    return order[0::2], order[1::2]


# Which key each lane holds: after the first rounding (even / odd keys), and after the second,
# which rounds the products in that order and so interleaves once more.
_FIRST = _split(list(range(DOT_LANES)))
_SECOND = _split(_FIRST[0] + _FIRST[1])
# Lane j of out from the second rounding's two vectors, as one shuffle's indices.
_UNSHUFFLE = [(_SECOND[0] + _SECOND[1]).index(j) for j in range(DOT_LANES)]


class ConvertedMix(BitsMix):
    """:class:`BitsMix` with both roundings on ``vcvtne2ps2bf16``: the ReLU on the rounded
    integers (``relu(bf16(s)) = bf16(relu(s))``: rounding keeps a sign),
    ``bf16(relu(bf16(s * sq * sk)) * w) = bf16(bf16(relu(s)) * (w * sq * sk))``
    (scaling by powers of two commutes with rounding while every value stays normal), so a
    product needs one scale vector per row. The sums' lanes hold the keys in the order the
    conversions leave them (``_SECOND``), put back in order when written out."""

    def __init__(self, builder, s_op, w_op, t_op, maxima):
        super().__init__(builder, s_op, w_op, t_op, maxima)
        sk = self.sk
        self.sk = [builder.shuffle_vector(sk[0], sk[1], ir.Constant(V16I, keys)) for keys in _FIRST]

    def rows(self, src_at, rt, rows=None):
        builder = self.b
        src = (src_at, i64(4 * DOT_LANES))
        for m in range(self.TILE) if rows is None else rows:
            row = builder.add(builder.mul(rt, i64(self.TILE)), i64(m))
            sq = load_row(builder, self.s_op, row, i64(0), F32)
            wq = splat(builder, builder.fmul(load_row(builder, self.w_op, row, i64(0), F32), sq), V16F)
            f = [builder.sitofp(load_row(builder, src, i64(m), i64(64 * h), V16I), V16F)
                 for h in range(_HALVES)]
            rounded = _round_pair(builder, *f, relu=True)
            products = [builder.fmul(rounded[i], builder.fmul(wq, self.sk[i])) for i in range(2)]
            for acc, term in zip(self.acc, _round_pair(builder, *products)):
                builder.store(builder.fadd(builder.load(acc), term), acc)

    def finish(self, o_op, q):
        builder = self.b
        sums = [_bf16_round(builder, builder.load(acc), True) for acc in self.acc]
        ordered = [builder.shuffle_vector(sums[0], sums[1],
                                          ir.Constant(V16I, _UNSHUFFLE[16 * h:16 * (h + 1)]))
                   for h in range(_HALVES)]
        for h in range(_HALVES):
            builder.store(ordered[h], row_pointer(builder, o_op, q, i64(64 * h), V16F), align=4)
        for acc in self.acc:
            builder.store(ir.Constant(V16F, [0.0] * 16), acc)
        self.block_maxima(q, ordered)


# Exponents of the normal f32 numbers.
_NORMAL = (-126, 127)


def converted_mix_exact(a_scale: np.ndarray, b_range: np.ndarray, w: np.ndarray) -> bool:
    """Whether the mixing kernels (:func:`.amx_dot.amx_mix_tile`, :func:`.int8_dot.vnni_mix_tile`)
    may round on ``vcvtne2ps2bf16`` (``converts``) for queries of these scales (``a_scale``,
    :func:`.folded_layouts.folded_rows`'), keys of this range
    (:func:`.folded_layouts.pack_folded_blocks`', every block of them) and head weights ``w``.

    Both roundings then see only zeros, normal numbers and infinities, where the instruction's
    RNE is the bits' (it flushes denormals): every weight is finite, and every scale product
    ``sq * sk``, ``w * sq`` and ``w * sq * sk`` (w not zero) is a normal number (a score is an
    integer, at least 1 when not zero, times them). A key row of zeros has scale 1, and 1 is
    therefore in the keys' range. For operands :func:`.folded_layouts.foldable` and
    :func:`.int8_dot.int8_dot_exact` accept (the only ones the kernel takes): their scores are
    exact and finite.
    """
    w = np.abs(np.asarray(w, np.float64))
    if not np.isfinite(w).all() or a_scale.size == 0:
        return False
    e_k = (min(int(b_range[1]), 0), max(int(b_range[2]), 0))
    sq = np.asarray(a_scale, np.float64)
    lo, hi = float(sq.min()), float(sq.max())
    bounds = [(lo * 2.0 ** e_k[0], hi * 2.0 ** e_k[1])]
    nonzero = w[w > 0]
    if nonzero.size:
        wl, wh = float(nonzero.min()), float(nonzero.max())
        bounds += [(wl * lo, wh * hi), (wl * lo * 2.0 ** e_k[0], wh * hi * 2.0 ** e_k[1])]
    return all(2.0 ** _NORMAL[0] <= a and b < 2.0 ** (_NORMAL[1] + 1) for a, b in bounds)
