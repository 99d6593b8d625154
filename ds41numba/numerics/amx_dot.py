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
"""

from __future__ import annotations

import ctypes
import ctypes.util

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES
from .int8_dot import AMX_K
from .vector_ir import F32, I32, I64, V16F, V16I, row_operands, row_pointer, splat

__all__ = ["AMX_ROWS", "amx_begin", "amx_end", "amx_dot_tile", "amx_mix_tile", "request_tile_state"]

#: Rows of A one tile product multiplies (a tile register's rows); A is padded to a multiple.
AMX_ROWS = 16

_I8 = ir.IntType(8)
_P8 = _I8.as_pointer()
# Key lanes of one B tile: 16 int32 columns; a block of DOT_LANES keys is two.
_HALVES = DOT_LANES // 16
# Tile registers: one accumulator per half of the key block, the queries, the two key halves;
# amx_mix_tile forms two row tiles a step, the second into the accumulators _C2.
_C, _A, _B, _C2 = (0, 1), 2, (3, 4), (5, 6)
_ROWS_BYTES = {**{c: (AMX_ROWS, 64) for c in _C + _C2}, _A: (AMX_ROWS, AMX_K),
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
def amx_mix_tile(typingctx, a, a_scale, w, b, b_scale, out):
    """The index scores of a key block for several queries, their heads' dot products on the
    tile multiplier and mixed as they come out of it:

    ``out[q, j] = bf16(sum_h bf16(relu(bf16(s[q * H + h, j])) * w[q * H + h, 0]))``, the heads h
    in order, f32 sums from zero, ``s`` the scores of :func:`amx_dot_tile` (row ``r`` of ``a``
    against lane ``j`` of ``b``), ``H = rows(a) / rows(out)`` heads a query, a multiple of
    ``AMX_ROWS``. That is :func:`ds41numba.indexer._mix_heads_by_head` on those scores, for
    every lane (the caller keeps the visible ones).

    ``a``, ``a_scale`` as for :func:`amx_dot_tile` (any multiple of ``AMX_ROWS`` rows), ``w``
    float32 ``[rows(a), 1]`` (bf16 values), ``b``, ``b_scale`` one block, ``out`` float32
    ``[queries, DOT_LANES]``. The thread has run :func:`amx_begin`. Two row tiles' products
    are formed while the two before them are mixed (software pipelining: the tile multiplier
    and the vector units work side by side). Exact where :func:`amx_dot_tile` is.
    """
    sig = types.void(a, a_scale, w, b, b_scale, out)

    def codegen(context, builder, signature, args):
        (a_op, s_op, w_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        k = lambda x: ir.Constant(I64, x)       # noqa: E731
        n_rows = cgutils.unpack_tuple(builder, arrays[0].shape, 2)[0]
        n_quads = cgutils.unpack_tuple(builder, arrays[3].shape, 2)[0]
        n_queries = cgutils.unpack_tuple(builder, arrays[5].shape, 2)[0]
        n_tiles = builder.udiv(n_rows, k(AMX_ROWS))
        tiles_per_query = builder.udiv(n_tiles, n_queries)
        n_steps = builder.udiv(builder.add(n_tiles, k(_PAIR - 1)), k(_PAIR))
        # Two stores of a step's products: one being mixed while the next is formed.
        step_bytes = k(4 * _PAIR * AMX_ROWS * DOT_LANES)
        sums = cgutils.alloca_once(builder, ir.ArrayType(I32, 2 * _PAIR * AMX_ROWS * DOT_LANES))
        sums.align = 64         # whole cache lines for the tile stores and the loads after them
        sums_at = builder.ptrtoint(sums, I64)
        zero = ir.Constant(V16F, [0.0] * 16)
        acc = [cgutils.alloca_once_value(builder, zero) for _ in range(_HALVES)]
        sk = [builder.load(row_pointer(builder, t_op, k(0), k(64 * h), V16F), align=4)
              for h in range(_HALVES)]

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
                    src = (builder.add(src_at, k(4 * AMX_ROWS * DOT_LANES * i)), k(4 * DOT_LANES))
                    _mix_rows(builder, src, s_op, w_op, sk, acc, rt)
                    done = builder.add(rt, k(1))
                    with builder.if_then(builder.icmp_unsigned("==", builder.urem(done, tiles_per_query), k(0))):
                        q = builder.sub(builder.udiv(done, tiles_per_query), k(1))
                        for h in range(_HALVES):
                            ptr = row_pointer(builder, o_op, q, k(64 * h), V16F)
                            builder.store(_bf16_round(builder, builder.load(acc[h]), True), ptr, align=4)
                            builder.store(zero, acc[h])
        return context.get_dummy_value()

    return sig, codegen


def _mix_rows(builder, src, s_op, w_op, sk, acc, rt):
    """Row tile ``rt``'s products (int32 at ``src``) scaled, rounded, ReLU'd, weighted and added
    into the query's head sums ``acc``, its rows (heads) in order."""
    k = lambda x: ir.Constant(I64, x)       # noqa: E731
    zero = ir.Constant(V16F, [0.0] * 16)
    for m in range(AMX_ROWS):
        row = builder.add(builder.mul(rt, k(AMX_ROWS)), k(m))
        sq = splat(builder, builder.load(row_pointer(builder, s_op, row, k(0), F32)), V16F)
        wr = splat(builder, builder.load(row_pointer(builder, w_op, row, k(0), F32)), V16F)
        for h in range(_HALVES):
            total = builder.load(row_pointer(builder, src, k(m), k(64 * h), V16I), align=4)
            # The score is exact and finite (see amx_dot_tile): no NaN to keep. It is never -0
            # either (an integer zero times a scale).
            v = _bf16_round(builder, builder.fmul(builder.sitofp(total, V16F), builder.fmul(sq, sk[h])), False)
            v = builder.select(builder.fcmp_ordered("<", v, zero), zero, v)
            term = _bf16_round(builder, builder.fmul(v, wr), True)
            builder.store(builder.fadd(builder.load(acc[h]), term), acc[h])
