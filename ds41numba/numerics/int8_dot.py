"""Exact dot products of fp4 (e2m1, power-of-two block scale) vectors as integer dot products on
AVX512-VNNI: the LLVM-IR micro-kernel, the test of when its f32 result is the one every f32
summation order gives, and the kernel that mixes the heads' products of folded rows as they are
formed (:func:`vnni_mix_tile`, the VNNI twin of :func:`.amx_dot.amx_mix_tile`).

The operands are packed by :mod:`.int8_layouts` (a scale a 32-value block) or
:mod:`.folded_layouts` (a scale a row). Whether it runs is read from
:func:`.backend.tier_at_least` (``"avx512vnni"``).
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES, DOT_ROWS
from .folded_layouts import AMX_ROWS
from .head_mix import BitsMix, ConvertedMix, mix_tiles
from .int8_layouts import INT8_MAX, MIN_EXP
from .vector_ir import (F32, I32, I64, V16F, V16I, KeyQuarters, close_loop, extent, i64,
                        key_vector, load_row, open_loop, row_operands, row_pointer, splat)

__all__ = ["int8_dot_tile", "int8_dot_into", "int8_dot_exact", "vnni_mix_tile", "vnni_mix_quarters", "QUARTER",
           "add_group_term"]


# An fp4 (e8m0) quantised block is ``e2m1 * s`` with ``s`` a power of two, and twice an e2m1
# value is an integer in [-12, 12]: each value of a block is ``n * 2^e``, ``|n| <= 12``, one
# ``e`` for the block. A dot product of two such vectors is then, per block, an integer sum of
# products of small integers times one power of two: ``vpdpbusd`` forms those sums (64 byte
# products per instruction, twice ``vdpbf16ps``'s 32) exactly in int32, and two f32 products by
# powers of two place them. numba has no vector types, so the micro-kernel is LLVM IR, as
# :func:`.bf16_dot.bf16_dot_tile` is.

# f32's significand: integers up to 2^24 are exact.
_EXACT_BITS = 24


def int8_dot_exact(a_range: np.ndarray, b_range: np.ndarray, d: int) -> bool:
    """Whether every dot product of a row of A with a row of B (``d`` values each, of the two
    ranges) is one f32 number that every f32 summation order reaches, BLAS's and
    ``vdpbf16ps``'s included, and :func:`int8_dot_tile` computes.

    Row a's values are ``n * 2^ea_g`` and row b's ``m * 2^eb_g`` (``|n|, |m| <= 12``). Each
    product is an integer times ``2^(ea_g + eb_g)``, so every partial sum, in any order, is an
    integer multiple of ``2^E0`` (``E0 = min(ea) + min(eb)``) of magnitude at most
    ``144 d 2^E1`` (``E1 = max(ea) + max(eb)``): when ``144 d 2^(E1 - E0) < 2^24`` every partial
    sum is an f32 number, no addition rounds, and every order gives the exact dot product.
    ``E1 - E0`` is at most the sum of the two rows' exponent spreads (for d = 128: spreads adding
    up to 9 or less). That sum also must not leave f32's normal range: ``2^E0 >= 2^-126`` (so
    flushing denormals changes nothing) and ``144 d 2^E1 < 2^128``. The kernel's own steps are
    exact under the same conditions (its group sums are integers below 2^13, its scale products
    powers of two within range). Bad rows (not fp4 values) make it False.
    """
    if a_range[0] or b_range[0]:
        return False
    if a_range[1] > a_range[2] or b_range[1] > b_range[2]:
        return True     # a side of zeros only: every product is zero
    bound = np.log2(INT8_MAX * INT8_MAX * d)
    return (bound + a_range[3] + b_range[3] < _EXACT_BITS
            and a_range[1] + b_range[1] >= MIN_EXP
            and bound + a_range[2] + b_range[2] < 128)


@intrinsic
def int8_dot_tile(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """``out[m, j] += sum_g f32(I[m, j, g]) * (a_scale[m, g] * b_scale[g, j])`` for ``m <
    DOT_ROWS``, ``j < DOT_LANES``, the groups g in order, where ``I[m, j, g] = a_corr[m, g] +
    sum_p a[m, p] . b[p, j]`` over the group's quads as byte dot products (``vpdpbusd``).

    ``a`` (uint32 ``[DOT_ROWS, d / 4]``: signed bytes), ``a_corr`` (int32 ``[DOT_ROWS, G]``)
    and ``a_scale`` (float32 ``[DOT_ROWS, G]``) as :func:`.int8_layouts.int8_rows` packs them; ``b`` (uint32
    ``[d / 4, DOT_LANES]``: unsigned bytes) and ``b_scale`` (float32 ``[G, DOT_LANES]``) one
    block of :func:`.int8_layouts.pack_int8_blocks`; ``out`` float32 ``[DOT_ROWS, DOT_LANES]``. The rows of
    each may lie apart, each row is contiguous. A group is ``d / (4 G)`` quads: 8 for those
    layouts (a 32-value block a scale), all of them for the folded ones
    (:func:`.folded_layouts.folded_rows` with :func:`.folded_layouts.folded_corrections`,
    :func:`.folded_layouts.pack_offset_folded_blocks`: one scale a row). The
    caller checks the shapes; G >= 1.

    No int32 overflows: the bytes are ``|n| <= 12`` and ``n + 12 <= 24``, so a group's 32
    products sum to at most 32 * 24 * 12 = 9216 in magnitude, and with the correction
    ``|12 sum(n)| <= 4608`` the group sum ``I`` is ``sum n m``, at most 4608 in magnitude
    (exact in f32); folded, ``|n| <= 96`` and ``n + 128 <= 224``, 128 values at most 2.8e6 in
    magnitude before the correction, ``I`` at most 1.2e6. The f32 products and sums are exact
    when :func:`int8_dot_exact` says so.
    """
    return types.void(a, a_corr, a_scale, b, b_scale, out), _int8_codegen(fresh=False)


@intrinsic
def int8_dot_into(typingctx, a, a_corr, a_scale, b, b_scale, out):
    """:func:`int8_dot_tile` into ``out`` instead of onto it: ``out[m, j] = sum_g ...``, the
    output's old contents never read (the tile's first term is stored: never -0, since the
    scales are positive and f32(0) is +0, so this is ``0 + sum`` bit for bit)."""
    return types.void(a, a_corr, a_scale, b, b_scale, out), _int8_codegen(fresh=True)


def quad_sums(builder, a_op, b_op, start, p0, n_quads, row0, name):
    """The loop both VNNI kernels share: for the ``DOT_ROWS`` rows of A from ``row0`` against
    the ``DOT_LANES`` keys of B, the int32 sums ``start[m]`` (a vector a row) plus the byte
    products of quads ``p0 .. p0 + n_quads`` (``vpdpbusd``, the keys' unsigned bytes against
    the queries' signed ones, broadcast); returns them, ``[row][half]`` vectors."""
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16I, [V16I, V16I, V16I]),
                                         "llvm.x86.avx512.vpdpbusd.512")
    nvec = DOT_LANES // 16
    q, entry = open_loop(builder, name)
    acc = [[builder.phi(V16I) for _ in range(nvec)] for _ in range(DOT_ROWS)]
    for m in range(DOT_ROWS):
        for v in range(nvec):
            acc[m][v].add_incoming(start[m], entry)
    p = builder.add(p0, q)
    p4 = builder.mul(p, i64(4))
    bv = [key_vector(builder, b_op, p, v, V16I) for v in range(nvec)]
    new = []
    for m in range(DOT_ROWS):
        row = builder.add(row0, i64(m))
        aq = splat(builder, load_row(builder, a_op, row, p4, I32), V16I)
        # vpdpbusd's unsigned operand is its second (the keys), the signed one its third
        new.append([builder.call(dot, [acc[m][v], bv[v], aq]) for v in range(nvec)])
    body = builder.basic_block
    for m in range(DOT_ROWS):
        for v in range(nvec):
            acc[m][v].add_incoming(new[m][v], body)
    close_loop(builder, q, n_quads, name)
    return new


def add_group_term(builder, ptr, ints, scale, first):
    """``out += f32(ints) * scale`` at ``ptr`` (a vector of f32 lanes): a group's integer sums
    placed by their scale product, the step every integer kernel ends a group with. ``first``
    (an i1, or None): where true the output's old contents are not read (``0 + term``)."""
    vty = ir.VectorType(F32, ints.type.count)
    # f32(I) and the scale product are exact; so is their product (a power of two apart), and
    # the one rounding point, the addition, is exact when int8_dot_exact.
    term = builder.fmul(builder.sitofp(ints, vty), scale)
    before = builder.load(ptr, align=4)
    if first is not None:
        before = builder.select(first, ir.Constant(vty, None), before)
    builder.store(builder.fadd(before, term), ptr, align=4)


def _int8_codegen(fresh):
    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_groups = extent(builder, arrays[4])
        group_quads = builder.sdiv(extent(builder, arrays[3]), n_groups)
        nvec = DOT_LANES // 16

        g, _ = open_loop(builder, "int8dot")
        g4 = builder.mul(g, i64(4))
        first = builder.icmp_signed("==", g, i64(0))
        start = [splat(builder, load_row(builder, c_op, i64(m), g4, I32), V16I) for m in range(DOT_ROWS)]
        new = quad_sums(builder, a_op, b_op, start, builder.mul(g, group_quads), group_quads, i64(0),
                        "int8quads")
        sk = [load_row(builder, t_op, g, i64(64 * v), V16F) for v in range(nvec)]
        for m in range(DOT_ROWS):
            sq = splat(builder, load_row(builder, s_op, i64(m), g4, F32), V16F)
            for v in range(nvec):
                ptr = row_pointer(builder, o_op, i64(m), i64(64 * v), V16F)
                add_group_term(builder, ptr, new[m][v], builder.fmul(sq, sk[v]), first if fresh else None)
        close_loop(builder, g, n_groups, "int8dot")
        return context.get_dummy_value()

    return codegen


@intrinsic
def vnni_mix_tile(typingctx, a, a_corr, a_scale, w, b, b_scale, out, block_max, converts, maxima):
    """:func:`.amx_dot.amx_mix_tile` on AVX512-VNNI, for folded rows: the same scores, mixed the
    same way.

    ``a`` (uint32 ``[rows, d / 4]``: a query head's folded signed bytes,
    :func:`.folded_layouts.folded_rows`), ``a_corr`` (int32 ``[rows, 1]``,
    :func:`.folded_layouts.folded_corrections`), ``a_scale`` (float32 ``[rows, 1]``), ``b``,
    ``b_scale`` one block of :func:`.folded_layouts.pack_offset_folded_blocks` (unsigned bytes
    ``n + 128``, one scale a key); ``w``, ``out``, ``block_max``, ``converts``, ``maxima`` as for
    :func:`.amx_dot.amx_mix_tile`; the rows mixed are ``w``'s, a multiple of ``AMX_ROWS`` a
    query (the operands' rows after them, a layout's padding, are not read). Each row
    tile's integers (``a_corr`` plus the byte products, :func:`int8_dot_tile` in one group:
    eight rows and 32 keys a pass, two passes a tile) go through an L1 buffer into the mixer
    (:mod:`.head_mix`), never into a products array in memory. Exact where
    :func:`int8_dot_exact` and :func:`.folded_layouts.foldable` hold.
    """
    sig = types.void(a, a_corr, a_scale, w, b, b_scale, out, block_max, converts, maxima)

    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, w_op, b_op, t_op, o_op, m_op), arrays = row_operands(
            context, builder, signature, args[:8])
        n_rows = extent(builder, arrays[3])     # w's rows: a's after them (padding) unread
        n_quads = extent(builder, arrays[4])
        n_queries = extent(builder, arrays[6])
        maxima_on = context.cast(builder, args[9], signature.args[9], types.boolean)
        ops = (a_op, c_op, s_op, w_op, b_op, t_op, o_op, (m_op, maxima_on))
        _mix_by_rounding(context, builder, (args[8], signature.args[8]), ops, (n_rows, n_quads, n_queries))
        return context.get_dummy_value()

    return sig, codegen


#: Keys a quarter of a key block: what :func:`vnni_mix_quarters` reads from each place.
QUARTER = DOT_LANES // 4


@intrinsic
def vnni_mix_quarters(typingctx, a, a_corr, a_scale, w, b, b_scale, at, out, converts):
    """:func:`vnni_mix_tile` against four quarters of key blocks, from anywhere in the keys:
    ``b``, ``b_scale`` all of :func:`.folded_layouts.pack_offset_folded_blocks`' blocks (``[blocks,
    d / 4, DOT_LANES]``, ``[blocks, 1, DOT_LANES]``), ``at`` (int64 ``[4]``) the quarters' first
    keys (multiples of ``QUARTER``); lane ``QUARTER * i + j`` of ``out``'s rows is key ``at[i] +
    j``'s score. A candidate consumer needs its candidate blocks of 8 keys, each a quarter of a
    key block: four to a call, its multiply-adds are the keys it needs. No block maxima."""
    sig = types.void(a, a_corr, a_scale, w, b, b_scale, at, out, converts)

    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, w_op, b_op, t_op, at_op, o_op), arrays = row_operands(
            context, builder, signature, args[:8])
        b_rows, t_rows = (builder.extract_value(arrays[i].strides, 1) for i in (4, 5))
        quads, scales = [], []
        for i in range(4):
            first = load_row(builder, at_op, i64(i), i64(0), I64)
            block = builder.udiv(first, i64(DOT_LANES))
            lane4 = builder.mul(builder.urem(first, i64(DOT_LANES)), i64(4))
            for (base, stride), rows, got in ((b_op, b_rows, quads), (t_op, t_rows, scales)):
                got.append((builder.add(base, builder.add(builder.mul(block, stride), lane4)), rows))
        shape = (extent(builder, arrays[3]), extent(builder, arrays[4], 1), extent(builder, arrays[7]))
        ops = (a_op, c_op, s_op, w_op, KeyQuarters(quads), KeyQuarters(scales), o_op,
               (o_op, ir.Constant(ir.IntType(1), 0)))
        _mix_by_rounding(context, builder, (args[8], signature.args[8]), ops, shape)
        return context.get_dummy_value()

    return sig, codegen


def _mix_by_rounding(context, builder, converts, ops, shape):
    """:func:`_vnni_mix` with the mixer ``converts`` (an argument: value, type) picks."""
    with builder.if_else(context.cast(builder, *converts, types.boolean)) \
            as (converted, exact_bits):
        with converted:
            _vnni_mix(builder, ops, shape, ConvertedMix)
        with exact_bits:
            _vnni_mix(builder, ops, shape, BitsMix)


def _vnni_rows(builder, a_op, c_op, b_op, n_quads, row0, dst):
    """The folded integers of rows ``row0 .. row0 + DOT_ROWS`` against the key block, stored as
    rows of ``dst`` (int32, ``DOT_LANES`` a row)."""
    start = [splat(builder, load_row(builder, c_op, builder.add(row0, i64(m)), i64(0), I32), V16I)
             for m in range(DOT_ROWS)]
    sums = quad_sums(builder, a_op, b_op, start, i64(0), n_quads, row0, "vnnimix")
    for m in range(DOT_ROWS):
        for h in range(DOT_LANES // 16):
            at = builder.inttoptr(builder.add(dst, i64(4 * (m * DOT_LANES + 16 * h))), V16I.as_pointer())
            builder.store(sums[m][h], at, align=64)


def _vnni_mix(builder, operands, shape, mixer):
    """:func:`vnni_mix_tile`'s loop: per row tile, two passes of :func:`_vnni_rows` into an L1
    buffer, mixed (``mixer``'s rounding; :func:`.head_mix.mix_tiles`)."""
    a_op, c_op, s_op, w_op, b_op, t_op, o_op, maxima = operands
    n_rows, n_quads, n_queries = shape
    sums = cgutils.alloca_once(builder, ir.ArrayType(I32, AMX_ROWS * DOT_LANES))
    sums.align = 64
    sums_at = builder.ptrtoint(sums, I64)

    def fill(rt):
        for half in range(AMX_ROWS // DOT_ROWS):
            row0 = builder.add(builder.mul(rt, i64(AMX_ROWS)), i64(half * DOT_ROWS))
            _vnni_rows(builder, a_op, c_op, b_op, n_quads, row0,
                       builder.add(sums_at, i64(4 * half * DOT_ROWS * DOT_LANES)))
        return sums_at

    mix_tiles(builder, mixer(builder, s_op, w_op, t_op, maxima),
              builder.udiv(n_rows, i64(AMX_ROWS)), n_queries, o_op, fill)
