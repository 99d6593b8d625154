"""The exact fp4 dot products of :mod:`.int8_dot` on AMX's tile multiplier (AMX-INT8), with each
row's block scales folded into its bytes.

One ``tdpbssd`` forms 16 x 16 x 64 byte products (16,384) from two tile registers, some ten
times ``vpdpbusd``'s rate here. But a tile product sums across its whole 64 bytes, two of the
fp4 quantiser's blocks, each with its own power of two, and applying per-block scales after the
multiplier (as the VNNI kernel does) costs more vector work than the products themselves. So
the scales go into the integers instead: a row's values are ``n_g * 2^e_g`` (``|n_g| <= 12``),
that is ``(n_g * 2^(e_g - e_min)) * 2^e_min``, and while the row's exponents lie at most
``FOLD_SPREAD`` apart the folded integers ``n_g * 2^(e_g - e_min)`` are still signed bytes (at
most 96 in magnitude). A dot product of two folded rows is then one integer times
``2^(e_min(a) + e_min(b))``: exact in int32, exact as f32 (:func:`.int8_dot.int8_dot_exact`'s
bound covers it), so bit for bit the value every other kernel gives. Rows whose exponents lie
further apart are counted in the range, and the caller takes the VNNI kernel for them.

AMX's bf16 product (``tdpbf16ps``) is not used anywhere: measured here, it rounds its sums its
own way (even a single pair per call differs from ``vdpbf16ps`` in about 5% of results), so it
cannot follow the reference's order. Integer sums have no order.

Whether it runs is read from :func:`.backend.amx_enabled`; Linux hands a process the tile
registers only on request (:func:`request_tile_state`).

The head mix of those products (``amx_mix_tile``'s mixers) also serves the VNNI tier's folded
rows: :func:`vnni_mix_tile` forms the same integers with ``vpdpbusd`` and mixes them the same
way, without a tile register.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import llvmlite.ir as ir
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES, DOT_ROWS
from .int8_dot import AMX_K, quad_sums
from .vector_ir import F32, I32, I64, V16F, V16I, i64, row_operands, row_pointer, splat

__all__ = ["AMX_ROWS", "MAX_BLOCK", "amx_begin", "amx_end", "amx_dot_tile", "amx_mix_tile",
           "vnni_mix_tile", "converted_mix_exact", "request_tile_state"]

#: Rows of A one tile product multiplies (a tile register's rows); A is padded to a multiple.
AMX_ROWS = 16

_I8 = ir.IntType(8)
_P8 = _I8.as_pointer()
# Key lanes of one B tile: 16 int32 columns; a block of DOT_LANES keys is two.
_HALVES = DOT_LANES // 16
# Tile registers: one accumulator per half of the key block, the queries, the two key halves;
# amx_mix_tile forms two row tiles a step, the second into the accumulators _C2.
_C, _A, _B, _C2 = (0, 1), 2, (3, 4), (5, 6)
# For 128-value rows the key block's four B tiles stay loaded for the whole call: the queries'
# two K halves then take tiles 2 and 7, the products tiles 0 and 1 (_mix_resident).
_A2, _B2 = 7, (5, 6)
_ROWS_BYTES = {**{c: (AMX_ROWS, 64) for c in _C + _C2}, _A: (AMX_ROWS, AMX_K), _A2: (AMX_ROWS, AMX_K),
               **{b: (AMX_K // 4, 64) for b in _B}}


def _tile_config() -> bytearray:
    """The 64-byte ``ldtilecfg`` operand: palette 1, each tile's bytes per row (bytes 16-47, two
    a tile) and rows (bytes 48-63)."""
    cfg = bytearray(64)
    cfg[0] = 1
    for t, (rows, colsb) in _ROWS_BYTES.items():
        cfg[16 + 2 * t:18 + 2 * t] = colsb.to_bytes(2, "little")
        cfg[48 + t] = rows
    return cfg


_ARCH_GET_XCOMP_PERM, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 0x1022, 0x1023, 18
_SYS_ARCH_PRCTL = 158     # x86-64


def request_tile_state() -> bool:
    """Ask Linux for the AMX tile registers (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``),
    which a process must hold before its first tile instruction (else it is killed with
    SIGILL); True when the process holds them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        granted = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(granted)) != 0:
            return False
        return bool(granted.value >> _XFEATURE_XTILEDATA & 1)
    except (OSError, AttributeError, TypeError):
        return False


# ------------------------------------------------------------------------------ the tile kernel


def _call(builder, name, args, arg_types):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arg_types), name)
    return builder.call(fn, args)


def _tile(t):
    return ir.Constant(_I8, t)


@intrinsic
def amx_begin(typingctx):
    """Load the calling thread's tile configuration: every thread that runs :func:`amx_dot_tile`
    runs this first (the configuration belongs to the thread)."""
    def codegen(context, builder, signature, args):
        const = ir.Constant(ir.ArrayType(_I8, 64), _tile_config())
        slot = cgutils.alloca_once(builder, const.type)
        builder.store(const, slot)
        _call(builder, "llvm.x86.ldtilecfg", [builder.bitcast(slot, _P8)], [_P8])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def amx_end(typingctx):
    """Release the calling thread's tile registers (after its last :func:`amx_dot_tile`), so
    the kernel does not save and restore 8 KB of them at every context switch after."""
    def codegen(context, builder, signature, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def amx_dot_tile(typingctx, a, a_scale, b, b_scale, out):
    """``out[m, j] += f32(sum_p a[m, p] . b[p, j]) * (a_scale[m, 0] * b_scale[0, j])`` for ``m <
    AMX_ROWS``, ``j < DOT_LANES``: byte dot products of signed bytes (``tdpbssd``), ``AMX_K`` of
    them a tile product.

    ``a`` (uint32 ``[AMX_ROWS, d / 4]``) and ``a_scale`` (float32 ``[AMX_ROWS, 1]``) as
    :func:`folded_rows` packs them; ``b`` (uint32 ``[d / 4, DOT_LANES]``) and ``b_scale``
    (float32 ``[1, DOT_LANES]``) one block of :func:`pack_folded_blocks`; ``out`` float32
    ``[AMX_ROWS, DOT_LANES]``. Each row contiguous, rows may lie apart; ``d`` a multiple of
    ``AMX_K``. The caller checks the shapes and has run :func:`amx_begin` in this thread.
    The integer sum is exact (at most ``d * 96^2`` in magnitude), and so is the rest when
    :func:`.int8_dot.foldable` and :func:`.int8_dot.int8_dot_exact` say so.
    """
    sig = types.void(a, a_scale, b, b_scale, out)

    def codegen(context, builder, signature, args):
        (a_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_quads = cgutils.unpack_tuple(builder, arrays[2].shape, 2)[0]
        # The two accumulator tiles are stored here side by side: [AMX_ROWS, DOT_LANES] int32.
        sums = cgutils.alloca_once(builder, ir.ArrayType(I32, AMX_ROWS * DOT_LANES))
        sums.align = 64
        sums_op = (builder.ptrtoint(sums, I64), ir.Constant(I64, 4 * DOT_LANES))
        for h in range(_HALVES):
            _call(builder, "llvm.x86.tilezero", [_tile(_C[h])], [_I8])
        with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n_quads,
                                     ir.Constant(I64, AMX_K // 4)) as (p, _):
            a_at = row_pointer(builder, a_op, ir.Constant(I64, 0), builder.mul(p, ir.Constant(I64, 4)), _I8)
            _call(builder, "llvm.x86.tileloadd64", [_tile(_A), a_at, a_op[1]], [_I8, _P8, I64])
            for h in range(_HALVES):
                b_at = row_pointer(builder, b_op, p, ir.Constant(I64, 64 * h), _I8)
                _call(builder, "llvm.x86.tileloadd64", [_tile(_B[h]), b_at, b_op[1]], [_I8, _P8, I64])
                _call(builder, "llvm.x86.tdpbssd", [_tile(_C[h]), _tile(_A), _tile(_B[h])], [_I8] * 3)
        for h in range(_HALVES):
            dst = builder.inttoptr(builder.add(sums_op[0], ir.Constant(I64, 64 * h)), _P8)
            _call(builder, "llvm.x86.tilestored64", [_tile(_C[h]), dst, sums_op[1]], [_I8, _P8, I64])
        zero = ir.Constant(I64, 0)
        sk = [builder.load(row_pointer(builder, t_op, zero, ir.Constant(I64, 64 * h), V16F), align=4)
              for h in range(_HALVES)]
        for m in range(AMX_ROWS):
            row = ir.Constant(I64, m)
            sq = splat(builder, builder.load(row_pointer(builder, s_op, row, zero, F32)), V16F)
            for h in range(_HALVES):
                at = ir.Constant(I64, 64 * h)
                total = builder.load(row_pointer(builder, sums_op, row, at, V16I), align=4)
                ptr = row_pointer(builder, o_op, row, at, V16F)
                # f32(total) is exact (below 2^24), the scale product a power of two in range:
                # their product is the exact dot product, and adding it to a zero is exact.
                term = builder.fmul(builder.sitofp(total, V16F), builder.fmul(sq, sk[h]))
                builder.store(builder.fadd(builder.load(ptr, align=4), term), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


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


# Row tiles one step of amx_mix_tile forms and mixes: two, on two accumulator sets, so the two
# chains of tile products overlap.
_PAIR = 2


def _issue_pair(builder, a_op, b_op, n_quads, rt, has_second, dst):
    """The tile products of row tiles ``rt`` and ``rt + 1`` (when ``has_second``, an i1) of A
    against the key block, stored at ``dst`` (``[2 * AMX_ROWS, DOT_LANES]`` int32)."""
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    sets = (_C, _C2)
    for c in sets:
        for h in range(_HALVES):
            _call(builder, "llvm.x86.tilezero", [_tile(c[h])], [_I8])
    with cgutils.for_range_slice(builder, k(0), n_quads, k(AMX_K // 4)) as (p, _):
        for h in range(_HALVES):
            b_at = row_pointer(builder, b_op, p, k(64 * h), _I8)
            _call(builder, "llvm.x86.tileloadd64", [_tile(_B[h]), b_at, b_op[1]], [_I8, _P8, I64])
        for i, c in enumerate(sets):
            def products():
                row = builder.add(rt, k(i)) if i else rt
                a_at = row_pointer(builder, a_op, builder.mul(row, k(AMX_ROWS)),
                                   builder.mul(p, k(4)), _I8)
                _call(builder, "llvm.x86.tileloadd64", [_tile(_A), a_at, a_op[1]], [_I8, _P8, I64])
                for h in range(_HALVES):
                    _call(builder, "llvm.x86.tdpbssd", [_tile(c[h]), _tile(_A), _tile(_B[h])], [_I8] * 3)
            if i:
                with builder.if_then(has_second):
                    products()
            else:
                products()
    for i, c in enumerate(sets):
        for h in range(_HALVES):
            at = builder.inttoptr(builder.add(dst, k(4 * AMX_ROWS * DOT_LANES * i + 64 * h)), _P8)
            _call(builder, "llvm.x86.tilestored64", [_tile(c[h]), at, k(4 * DOT_LANES)], [_I8, _P8, I64])


@intrinsic
def amx_mix_tile(typingctx, a, a_scale, w, b, b_scale, out, block_max, converts, maxima):
    """The index scores of a key block for several queries, their heads' dot products on the
    tile multiplier and mixed as they come out of it:

    ``out[q, j] = bf16(sum_h bf16(relu(bf16(s[q * H + h, j])) * w[q * H + h, 0]))``, the heads h
    in order, f32 sums from zero, ``s`` the scores of :func:`amx_dot_tile` (row ``r`` of ``a``
    against lane ``j`` of ``b``), ``H = rows(a) / rows(out)`` heads a query, a multiple of
    ``AMX_ROWS``. That is :func:`ds41numba.indexer.blas_scores.mix_heads_by_head` on those scores, for
    every lane (the caller keeps the visible ones).

    ``a``, ``a_scale`` as for :func:`amx_dot_tile` (any multiple of ``AMX_ROWS`` rows), ``w``
    float32 ``[rows(a), 1]`` (bf16 values), ``b``, ``b_scale`` one block, ``out`` float32
    ``[queries, DOT_LANES]``. The thread has run :func:`amx_begin`. A step's row tiles are
    formed while the step before is mixed (software pipelining: the tile multiplier and the
    vector units work side by side): for 128-value rows one row tile a step against the key
    block held in tile registers, else two a step with the block's tiles loaded again for each.
    Exact where :func:`amx_dot_tile` is.

    ``converts`` (a bool) rounds to bf16 with the CPU's conversion instruction
    (``vcvtne2ps2bf16``, 32 values in two micro-ops) instead of integer arithmetic on the bits
    (five a vector, more with NaNs): a third of the vector work. Only where
    :func:`converted_mix_exact` says so: the instruction flushes denormals.

    ``maxima`` (a bool) also writes each query's maxima of the key block's four blocks of
    ``MAX_BLOCK`` keys into its row of ``block_max`` (float32 ``[queries, 4]``; NaN wins), the
    candidate source's block scores, while the sums are in registers.
    """
    sig = types.void(a, a_scale, w, b, b_scale, out, block_max, converts, maxima)

    def codegen(context, builder, signature, args):
        (a_op, s_op, w_op, b_op, t_op, o_op, m_op), arrays = row_operands(context, builder, signature,
                                                                          args[:7])
        n_rows = cgutils.unpack_tuple(builder, arrays[0].shape, 2)[0]
        n_quads = cgutils.unpack_tuple(builder, arrays[3].shape, 2)[0]
        n_queries = cgutils.unpack_tuple(builder, arrays[5].shape, 2)[0]
        shape = (n_rows, n_quads, n_queries)
        maxima_on = context.cast(builder, args[8], signature.args[8], types.boolean)
        ops = (a_op, s_op, w_op, b_op, t_op, o_op, (m_op, maxima_on))
        # 128-value rows (the index heads): the key block stays in four tile registers.
        resident = builder.icmp_unsigned("==", n_quads, ir.Constant(I64, 2 * AMX_K // 4))
        with builder.if_else(resident) as (held, streamed):
            with held:
                _both_mixes(context, builder, signature, args, ops, shape, _mix_resident)
            with streamed:
                _both_mixes(context, builder, signature, args, ops, shape, _mix_pipeline)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def vnni_mix_tile(typingctx, a, a_corr, a_scale, w, b, b_scale, out, block_max, converts, maxima):
    """:func:`amx_mix_tile` on AVX512-VNNI, for folded rows: the same scores, mixed the same way.

    ``a`` (uint32 ``[rows, d / 4]``: a query head's folded signed bytes, :func:`.int8_dot.folded_rows`),
    ``a_corr`` (int32 ``[rows, 1]``, :func:`.int8_dot.folded_corrections`), ``a_scale`` (float32
    ``[rows, 1]``), ``b``, ``b_scale`` one block of :func:`.int8_dot.pack_offset_folded_blocks`
    (unsigned bytes ``n + 128``, one scale a key); ``w``, ``out``, ``block_max``, ``converts``,
    ``maxima`` as for :func:`amx_mix_tile`, ``rows`` a multiple of ``AMX_ROWS`` per query. Each
    row tile's integers (``a_corr`` plus the byte products, :func:`.int8_dot.int8_dot_tile` in
    one group: eight rows and 32 keys a pass, two passes a tile) go through an L1 buffer into
    the mixer, never into a products array in memory. Exact where :func:`.int8_dot.int8_dot_exact`
    and :func:`.int8_dot.foldable` hold.
    """
    sig = types.void(a, a_corr, a_scale, w, b, b_scale, out, block_max, converts, maxima)

    def codegen(context, builder, signature, args):
        (a_op, c_op, s_op, w_op, b_op, t_op, o_op, m_op), arrays = row_operands(
            context, builder, signature, args[:8])
        n_rows = cgutils.unpack_tuple(builder, arrays[0].shape, 2)[0]
        n_quads = cgutils.unpack_tuple(builder, arrays[4].shape, 2)[0]
        n_queries = cgutils.unpack_tuple(builder, arrays[6].shape, 2)[0]
        maxima_on = context.cast(builder, args[9], signature.args[9], types.boolean)
        ops = (a_op, c_op, s_op, w_op, b_op, t_op, o_op, (m_op, maxima_on))
        with builder.if_else(context.cast(builder, args[8], signature.args[8], types.boolean)) \
                as (converted, exact_bits):
            with converted:
                _vnni_mix(builder, ops, (n_rows, n_quads, n_queries), _ConvertedMix)
            with exact_bits:
                _vnni_mix(builder, ops, (n_rows, n_quads, n_queries), _BitsMix)
        return context.get_dummy_value()

    return sig, codegen


def _vnni_rows(builder, a_op, c_op, b_op, n_quads, row0, dst):
    """The folded integers of rows ``row0 .. row0 + DOT_ROWS`` against the key block, stored as
    rows of ``dst`` (int32, ``DOT_LANES`` a row)."""
    start = [splat(builder, builder.load(row_pointer(builder, c_op, builder.add(row0, i64(m)), i64(0),
                                                     I32)), V16I)
             for m in range(DOT_ROWS)]
    sums = quad_sums(builder, a_op, b_op, start, i64(0), n_quads, row0, "vnnimix")
    for m in range(DOT_ROWS):
        for h in range(_HALVES):
            at = builder.inttoptr(builder.add(dst, i64(4 * (m * DOT_LANES + 16 * h))), V16I.as_pointer())
            builder.store(sums[m][h], at, align=64)


def _vnni_mix(builder, operands, shape, mixer):
    """:func:`vnni_mix_tile`'s loop: per row tile, two passes of :func:`_vnni_rows` into an L1
    buffer, mixed (``mixer``'s rounding); each query's sums written out when its last tile is in."""
    a_op, c_op, s_op, w_op, b_op, t_op, o_op, maxima = operands
    n_rows, n_quads, n_queries = shape
    n_tiles = builder.udiv(n_rows, i64(AMX_ROWS))
    tiles_per_query = builder.udiv(n_tiles, n_queries)
    sums = cgutils.alloca_once(builder, ir.ArrayType(I32, AMX_ROWS * DOT_LANES))
    sums.align = 64
    sums_at = builder.ptrtoint(sums, I64)
    mix = mixer(builder, s_op, w_op, t_op, maxima)
    with cgutils.for_range(builder, n_tiles) as loop:
        rt = loop.index
        for half in range(AMX_ROWS // DOT_ROWS):
            row0 = builder.add(builder.mul(rt, i64(AMX_ROWS)), i64(half * DOT_ROWS))
            _vnni_rows(builder, a_op, c_op, b_op, n_quads, row0,
                       builder.add(sums_at, i64(4 * half * DOT_ROWS * DOT_LANES)))
        mix.rows(sums_at, rt)
        done = builder.add(rt, i64(1))
        with builder.if_then(builder.icmp_unsigned("==", builder.urem(done, tiles_per_query), i64(0))):
            mix.finish(o_op, builder.sub(builder.udiv(done, tiles_per_query), i64(1)))


def _issue_resident(builder, a_op, rt, dst, halves=(0, 1)):
    """Row tile ``rt``'s products against the loaded key block (:func:`_load_resident`), stored
    at ``dst`` (``[AMX_ROWS, DOT_LANES]`` int32). ``halves``: which of its two parts to issue
    (the products of the first 64 values; those of the second and the stores), so the caller
    can place them apart among the vector work."""
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    if 0 in halves:
        for h in range(_HALVES):
            _call(builder, "llvm.x86.tilezero", [_tile(_C[h])], [_I8])
    for step, (a, bs) in enumerate(((_A, _B), (_A2, _B2))):
        if step not in halves:
            continue
        a_at = row_pointer(builder, a_op, builder.mul(rt, k(AMX_ROWS)), k(step * AMX_K), _I8)
        _call(builder, "llvm.x86.tileloadd64", [_tile(a), a_at, a_op[1]], [_I8, _P8, I64])
        for h in range(_HALVES):
            _call(builder, "llvm.x86.tdpbssd", [_tile(_C[h]), _tile(a), _tile(bs[h])], [_I8] * 3)
    if 1 in halves:
        for h in range(_HALVES):
            at = builder.inttoptr(builder.add(dst, k(64 * h)), _P8)
            _call(builder, "llvm.x86.tilestored64", [_tile(_C[h]), at, k(4 * DOT_LANES)], [_I8, _P8, I64])


def _load_resident(builder, b_op):
    """The key block's four B tiles (two K halves of 64 bytes, two halves of its keys)."""
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    for step, bs in enumerate((_B, _B2)):
        for h in range(_HALVES):
            b_at = row_pointer(builder, b_op, k(step * AMX_K // 4), k(64 * h), _I8)
            _call(builder, "llvm.x86.tileloadd64", [_tile(bs[h]), b_at, b_op[1]], [_I8, _P8, I64])


def _both_mixes(context, builder, signature, args, ops, shape, pipeline):
    """``pipeline`` with the converted rounding where the call's ``converts`` says so, else the
    bits' rounding."""
    with builder.if_else(context.cast(builder, args[7], signature.args[7], types.boolean)) \
            as (converted, exact_bits):
        with converted:
            pipeline(builder, ops, shape, _ConvertedMix)
        with exact_bits:
            pipeline(builder, ops, shape, _BitsMix)


def _mix_resident(builder, operands, shape, mixer):
    """:func:`_mix_pipeline` for 128-value rows with the key block held in tile registers: a
    step is one row tile, its products formed while the one before it is mixed."""
    a_op, s_op, w_op, b_op, t_op, o_op, maxima = operands
    n_rows, n_quads, n_queries = shape
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    n_tiles = builder.udiv(n_rows, k(AMX_ROWS))
    tiles_per_query = builder.udiv(n_tiles, n_queries)
    step_bytes = k(4 * AMX_ROWS * DOT_LANES)
    sums = cgutils.alloca_once(builder, ir.ArrayType(I32, 2 * AMX_ROWS * DOT_LANES))
    sums.align = 64
    sums_at = builder.ptrtoint(sums, I64)
    mix = mixer(builder, s_op, w_op, t_op, maxima)
    _load_resident(builder, b_op)
    _issue_resident(builder, a_op, k(0), sums_at)
    with cgutils.for_range(builder, n_tiles) as loop:
        rt = loop.index
        parity = builder.and_(rt, k(1))
        nxt = builder.add(rt, k(1))
        dst = builder.add(sums_at, builder.mul(builder.sub(k(1), parity), step_bytes))
        src = builder.add(sums_at, builder.mul(parity, step_bytes))
        has_next = builder.icmp_unsigned("<", nxt, n_tiles)
        # The next tile's two parts placed among this one's rows: the tile multiplier's latency
        # then hides behind vector work in program order too (measured 0.92x the time of
        # issuing it whole before the mix).
        with builder.if_then(has_next):
            _issue_resident(builder, a_op, nxt, dst, (0,))
        mix.rows(src, rt, range(0, AMX_ROWS // 2))
        with builder.if_then(has_next):
            _issue_resident(builder, a_op, nxt, dst, (1,))
        mix.rows(src, rt, range(AMX_ROWS // 2, AMX_ROWS))
        with builder.if_then(builder.icmp_unsigned("==", builder.urem(nxt, tiles_per_query), k(0))):
            mix.finish(o_op, builder.sub(builder.udiv(nxt, tiles_per_query), k(1)))


def _mix_pipeline(builder, operands, shape, mixer):
    """:func:`amx_mix_tile`'s loop for any row length: the tile products of a step's two row
    tiles stored, the two before them mixed (``mixer``'s rounding) and each query's sums written
    out when its last row tile is in."""
    a_op, s_op, w_op, b_op, t_op, o_op, maxima = operands
    n_rows, n_quads, n_queries = shape
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    n_tiles = builder.udiv(n_rows, k(AMX_ROWS))
    tiles_per_query = builder.udiv(n_tiles, n_queries)
    n_steps = builder.udiv(builder.add(n_tiles, k(_PAIR - 1)), k(_PAIR))
    # Two stores of a step's products: one being mixed while the next is formed.
    step_bytes = k(4 * _PAIR * AMX_ROWS * DOT_LANES)
    sums = cgutils.alloca_once(builder, ir.ArrayType(I32, 2 * _PAIR * AMX_ROWS * DOT_LANES))
    sums.align = 64         # whole cache lines for the tile stores and the loads after them
    sums_at = builder.ptrtoint(sums, I64)
    mix = mixer(builder, s_op, w_op, t_op, maxima)

    def issue(step, dst):
        rt = builder.mul(step, k(_PAIR))
        has_second = builder.icmp_unsigned("<", builder.add(rt, k(1)), n_tiles)
        _issue_pair(builder, a_op, b_op, n_quads, rt, has_second, dst)

    issue(k(0), sums_at)
    with cgutils.for_range(builder, n_steps) as loop:
        step = loop.index
        parity = builder.and_(step, k(1))
        nxt = builder.add(step, k(1))
        with builder.if_then(builder.icmp_unsigned("<", nxt, n_steps)):
            issue(nxt, builder.add(sums_at, builder.mul(builder.sub(k(1), parity), step_bytes)))
        src_at = builder.add(sums_at, builder.mul(parity, step_bytes))
        for i in range(_PAIR):
            rt = builder.add(builder.mul(step, k(_PAIR)), k(i))
            with builder.if_then(builder.icmp_unsigned("<", rt, n_tiles)):
                mix.rows(builder.add(src_at, k(4 * AMX_ROWS * DOT_LANES * i)), rt)
                done = builder.add(rt, k(1))
                with builder.if_then(builder.icmp_unsigned("==", builder.urem(done, tiles_per_query), k(0))):
                    mix.finish(o_op, builder.sub(builder.udiv(done, tiles_per_query), k(1)))


def _lanes(v):
    return ir.Constant(V16I, [v] * 16)


#: Keys a block maximum of :func:`amx_mix_tile` spans (the production candidate block).
MAX_BLOCK = 8


def _nan_max(builder, a, b):
    """Lane by lane the larger of ``a`` and ``b``, a NaN in either winning."""
    bigger = builder.select(builder.fcmp_ordered(">", b, a), b, a)
    return builder.select(builder.fcmp_unordered("uno", a, b), builder.fadd(a, b), bigger)


class _BitsMix:
    """Each row tile's products scaled, rounded to bf16 on the bits (RNE), ReLU'd, weighted,
    rounded again and added into the query's head sums, rows (heads) in order; lane j of the
    sums is key j."""

    def __init__(self, builder, s_op, w_op, t_op, maxima):
        self.b, self.s_op, self.w_op = builder, s_op, w_op
        self.m_op, self.maxima = maxima
        zero = ir.Constant(V16F, [0.0] * 16)
        self.acc = [cgutils.alloca_once_value(builder, zero) for _ in range(_HALVES)]
        self.sk = [builder.load(row_pointer(builder, t_op, i64(0), i64(64 * h), V16F), align=4)
                   for h in range(_HALVES)]

    def rows(self, src_at, rt, rows=range(AMX_ROWS)):
        """Row tile ``rt``'s products (int32 ``[AMX_ROWS, DOT_LANES]`` at ``src_at``), its rows
        ``rows`` (in order)."""
        builder = self.b
        src = (src_at, i64(4 * DOT_LANES))
        zero = ir.Constant(V16F, [0.0] * 16)
        for m in rows:
            row = builder.add(builder.mul(rt, i64(AMX_ROWS)), i64(m))
            sq = splat(builder, builder.load(row_pointer(builder, self.s_op, row, i64(0), F32)), V16F)
            wr = splat(builder, builder.load(row_pointer(builder, self.w_op, row, i64(0), F32)), V16F)
            for h in range(_HALVES):
                total = builder.load(row_pointer(builder, src, i64(m), i64(64 * h), V16I), align=4)
                # The score is exact and finite (see amx_dot_tile): no NaN to keep. It is never
                # -0 either (an integer zero times a scale).
                v = _bf16_round(builder, builder.fmul(builder.sitofp(total, V16F),
                                                      builder.fmul(sq, self.sk[h])), False)
                v = builder.select(builder.fcmp_ordered("<", v, zero), zero, v)
                term = _bf16_round(builder, builder.fmul(v, wr), True)
                builder.store(builder.fadd(builder.load(self.acc[h]), term), self.acc[h])

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


class _ConvertedMix(_BitsMix):
    """:class:`_BitsMix` with both roundings on ``vcvtne2ps2bf16``: the ReLU on the rounded
    integers (``relu(bf16(s)) = bf16(relu(s))``: rounding keeps a sign),
    ``bf16(relu(bf16(s * sq * sk)) * w) = bf16(bf16(relu(s)) * (w * sq * sk))``
    (scaling by powers of two commutes with rounding while every value stays normal), so a
    product needs one scale vector per row. The sums' lanes hold the keys in the order the
    conversions leave them (``_SECOND``), put back in order when written out."""

    def __init__(self, builder, s_op, w_op, t_op, maxima):
        super().__init__(builder, s_op, w_op, t_op, maxima)
        sk = self.sk
        self.sk = [builder.shuffle_vector(sk[0], sk[1], ir.Constant(V16I, keys)) for keys in _FIRST]

    def rows(self, src_at, rt, rows=range(AMX_ROWS)):
        builder = self.b
        src = (src_at, i64(4 * DOT_LANES))
        for m in rows:
            row = builder.add(builder.mul(rt, i64(AMX_ROWS)), i64(m))
            sq = builder.load(row_pointer(builder, self.s_op, row, i64(0), F32))
            wq = splat(builder, builder.fmul(builder.load(row_pointer(builder, self.w_op, row, i64(0), F32)),
                                             sq), V16F)
            f = [builder.sitofp(builder.load(row_pointer(builder, src, i64(m), i64(64 * h), V16I),
                                             align=4), V16F)
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
    """Whether :func:`amx_mix_tile` may round on ``vcvtne2ps2bf16`` (``converts``) for queries of
    these scales (``a_scale``, :func:`.int8_dot.folded_rows`'), keys of this range
    (:func:`.int8_dot.pack_folded_blocks`', every block of them) and head weights ``w``.

    Both roundings then see only zeros, normal numbers and infinities, where the instruction's
    RNE is the bits' (it flushes denormals): every weight is finite, and every scale product
    ``sq * sk``, ``w * sq`` and ``w * sq * sk`` (w not zero) is a normal number (a score is an
    integer, at least 1 when not zero, times them). A key row of zeros has scale 1, and 1 is
    therefore in the keys' range. For operands :func:`.int8_dot.foldable` and
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
