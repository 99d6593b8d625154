"""Exact dot products of fp4 vectors as integer dot products on AVX2: the twin of
:func:`.int8_dot.int8_dot_tile` for CPUs without AVX512-VNNI, on the same per-block layout
(:mod:`.int8_layouts`: a power of two a 32-value group) and with the same result bit for bit.

AVX2 has no ``vpdpbusd``. ``vpmaddubsw`` multiplies unsigned by signed bytes and adds each
pair of products into an int16 lane, saturating; ``vpmaddwd`` against ones adds pairs of int16
lanes into int32. On the per-block layout nothing saturates (:func:`pair_sums`), so a group's
sums are the VNNI kernel's integers exactly, and the same f32 steps place them
(:func:`.int8_dot.add_group_term`). Whether it runs is read from :func:`.backend.tier_at_least`
(``"avx2int8"``, and not ``"avx512vnni"``).
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES, DOT_ROWS
from .head_mix import PlacedMix, mix_tiles
from .int8_dot import add_group_term
from .int8_layouts import INT8_GROUP
from .vector_ir import (F32, I32, I64, V8F, V8I, close_loop, counted_loop, extent, i64, load_row, open_loop,
                        row_operands, row_pointer, splat)

__all__ = ["GROUP_QUADS", "int8_pairs_tile", "int8_pairs_into", "pairs_mix_tile"]

#: Quads (4 values, one uint32 of bytes) of a group: a group's sums are formed in int16.
GROUP_QUADS = INT8_GROUP // 4
# One pass of the [DOT_ROWS, DOT_LANES] tile: 4 rows by 2 vectors of 8 keys. Its 8 registers of
# int16 sums, the 2 of keys and the query broadcast fit AVX2's 16 registers; the whole tile (32
# registers of sums) would spill at every step, as the bf16 FMA twin's did.
_PASS_ROWS, _PASS_VECS = 4, 2
_V32B, _V16S = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16)


def _passes():
    """``(rows, vectors)`` of each pass: the vectors count 8 keys each."""
    return [(range(r, r + _PASS_ROWS), range(v, v + _PASS_VECS))
            for r in range(0, DOT_ROWS, _PASS_ROWS) for v in range(0, DOT_LANES // 8, _PASS_VECS)]


def pair_sums(builder, a_op, b_op, p0, rows, vecs, start, row0=i64(0)):
    """The int16 sums of one group (quads ``p0 .. p0 + GROUP_QUADS``) from ``start[m]`` (a
    ``<16 x i16>`` a row of A): per row ``m`` and vector ``v`` of 8 keys of B, ``{(m, v): <16 x
    i16>}``, lanes ``2k`` and ``2k + 1`` key ``k``'s (values ``4p, 4p + 1`` and ``4p + 2, 4p +
    3`` of each quad).

    Exact, never saturating: a key byte is ``n + 12`` in [0, 24] and a query byte ``|n| <= 12``,
    so a pair of products (``vpmaddubsw``'s saturating int16 sum) is at most 2 * 24 * 12 = 576 in
    magnitude and a lane's sum over the group's 8 quads at most 8 * 576 = 4608; with a start of
    at most 12 * 32 * 12 = 4608 (the correction) at most 9216 (int16 to 32767). Rows that are
    not fp4 values may carry any bytes, but the caller never uses their sums
    (:func:`.int8_dot.int8_dot_exact` is False for them). Rows ``m`` of A are counted from
    ``row0``."""
    madd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16S, [_V32B, _V32B]),
                                          "llvm.x86.avx2.pmadd.ub.sw")
    tile = [(m, v) for m in rows for v in vecs]

    def step(k, acc):
        p = builder.add(p0, k)
        bv = {v: builder.bitcast(load_row(builder, b_op, p, i64(32 * v), V8I), _V32B) for v in vecs}
        aq = {m: builder.bitcast(splat(builder, load_row(builder, a_op, builder.add(row0, i64(m)),
                                                         builder.mul(p, i64(4)), I32), V8I), _V32B)
              for m in rows}
        # vpmaddubsw's unsigned operand is its first (the keys), the signed one its second
        return [builder.add(a, builder.call(madd, [bv[v], aq[m]])) for a, (m, v) in zip(acc, tile)]

    # A loop, not straight-line code: unrolled, LLVM loaded every quad's operands first and
    # spilled them (AVX2's 16 registers).
    sums = counted_loop(builder, i64(GROUP_QUADS), [start[m] for m, _ in tile], step, "pairsums",
                        unrolled=False)
    return dict(zip(tile, sums))


def _pairs_rows(builder, operands, n_groups, row0, dst, fresh):
    """The dot products of rows ``row0 .. row0 + DOT_ROWS`` of A against the key block, added
    onto (``fresh``: stored into) the rows of ``dst`` (f32, ``DOT_LANES`` a row), a pass at a
    time, each pass a loop over the groups."""
    a_op, c_op, s_op, b_op, t_op = operands
    widen = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8I, [_V16S, _V16S]),
                                           "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(_V16S, [1] * 16)
    for part, (rows, vecs) in enumerate(_passes()):
        g, _ = open_loop(builder, f"int8pairs{part}")
        g4 = builder.mul(g, i64(4))
        first = builder.icmp_signed("==", g, i64(0)) if fresh else None
        row = {m: builder.add(row0, i64(m)) for m in rows}
        # Each key's even int16 lane starts from the row's correction (the offset's products
        # back out), its odd lane from 0: vpmaddwd adds them into the group's integer.
        start = {m: builder.bitcast(splat(builder, builder.and_(load_row(builder, c_op, row[m], g4, I32),
                                                                ir.Constant(I32, 0xFFFF)), V8I), _V16S)
                 for m in rows}
        sums = pair_sums(builder, a_op, b_op, builder.mul(g, i64(GROUP_QUADS)), rows, vecs, start, row0)
        sk = {v: load_row(builder, t_op, g, i64(32 * v), V8F) for v in vecs}
        for m in rows:
            sq = splat(builder, load_row(builder, s_op, row[m], g4, F32), V8F)
            for v in vecs:
                ints = builder.call(widen, [sums[m, v], ones])
                add_group_term(builder, row_pointer(builder, dst, i64(m), i64(32 * v), V8F), ints,
                               builder.fmul(sq, sk[v]), first)
        close_loop(builder, g, n_groups, f"int8pairs{part}")


def _pairs_codegen(fresh):
    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        _pairs_rows(builder, (a_op, c_op, s_op, b_op, t_op), extent(builder, arrays[4]), i64(0), o_op,
                    fresh)
        return context.get_dummy_value()

    return codegen


@intrinsic
def int8_pairs_tile(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """:func:`.int8_dot.int8_dot_tile` on AVX2, for the per-block layout only (``d / 4 ==
    GROUP_QUADS * G``: :func:`.int8_layouts.int8_rows` against
    :func:`.int8_layouts.pack_int8_blocks`; the folded layouts' bytes would saturate): the same
    operands, the same integers ``I[m, j, g]``, the same f32 steps in the same order, so the
    same ``out`` bit for bit. The caller checks the shapes; G >= 1."""
    return types.void(a, a_corr, a_scale, b, b_scale, out), _pairs_codegen(fresh=False)


@intrinsic
def int8_pairs_into(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """:func:`int8_pairs_tile` into ``out`` instead of onto it (:func:`.int8_dot.int8_dot_into`'s
    twin: the output's old contents never read)."""
    return types.void(a, a_corr, a_scale, b, b_scale, out), _pairs_codegen(fresh=True)


@intrinsic
def pairs_mix_tile(typingctx, a, a_corr, a_scale, w, b, b_scale, out, block_max, maxima):
    """:func:`.int8_dot.vnni_mix_tile` on AVX2, for the per-block layout: each row tile's dot
    products (:func:`int8_pairs_into`'s, ``DOT_ROWS`` rows) go through an L1 buffer into the
    head mix (:class:`.head_mix.PlacedMix`), never into a products array in memory: the scores
    of :func:`int8_pairs_into` then :func:`~ds41numba.indexer.blas_scores.mix_heads_by_head`,
    bit for bit. ``w`` (float32 ``[rows, 1]``) a row's head weight: the rows mixed are its, a
    multiple of ``DOT_ROWS`` a query (the operands' rows after them, a layout's padding, are
    not read); ``out``, ``block_max``, ``maxima`` as for :func:`.amx_dot.amx_mix_tile`."""
    sig = types.void(a, a_corr, a_scale, w, b, b_scale, out, block_max, maxima)

    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, w_op, b_op, t_op, o_op, m_op), arrays = row_operands(
            context, builder, signature, args[:8])
        maxima_on = context.cast(builder, args[8], signature.args[8], types.boolean)
        dots = cgutils.alloca_once(builder, ir.ArrayType(F32, DOT_ROWS * DOT_LANES))
        dots.align = 32
        dst = (builder.ptrtoint(dots, I64), i64(4 * DOT_LANES))
        n_groups = extent(builder, arrays[5])

        def fill(rt):
            _pairs_rows(builder, (a_op, c_op, s_op, b_op, t_op), n_groups,
                        builder.mul(rt, i64(DOT_ROWS)), dst, True)
            return dst[0]

        mix_tiles(builder, PlacedMix(builder, w_op, (m_op, maxima_on)),
                  builder.udiv(extent(builder, arrays[3]), i64(DOT_ROWS)), extent(builder, arrays[6]),
                  o_op, fill)
        return context.get_dummy_value()

    return sig, codegen
