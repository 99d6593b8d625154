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

Whether it runs is read from :func:`.backend.tier_at_least` (``"amx"``); Linux hands a process
the tile registers only on request (:func:`request_tile_state`). The operands are the folded
layouts of :mod:`.folded_layouts`; :func:`amx_mix_tile` mixes the heads' products as they come
out of the tile multiplier, with the mixers of :mod:`.head_mix`.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES
from .folded_layouts import AMX_K, AMX_ROWS
from .head_mix import BitsMix, ConvertedMix
from .vector_ir import F32, I32, I64, V16F, V16I, extent, load_row, row_operands, row_pointer, splat

__all__ = ["amx_begin", "amx_end", "amx_dot_tile", "amx_mix_tile", "request_tile_state"]

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
    :func:`.folded_layouts.folded_rows` packs them; ``b`` (uint32 ``[d / 4, DOT_LANES]``) and
    ``b_scale`` (float32 ``[1, DOT_LANES]``) one block of
    :func:`.folded_layouts.pack_folded_blocks`; ``out`` float32 ``[AMX_ROWS, DOT_LANES]``. Each row contiguous, rows may lie apart; ``d`` a multiple of
    ``AMX_K``. The caller checks the shapes and has run :func:`amx_begin` in this thread.
    The integer sum is exact (at most ``d * 96^2`` in magnitude), and so is the rest when
    :func:`.folded_layouts.foldable` and :func:`.int8_dot.int8_dot_exact` say so.
    """
    sig = types.void(a, a_scale, b, b_scale, out)

    def codegen(context, builder, signature, args):
        (a_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_quads = extent(builder, arrays[2])
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
        sk = [load_row(builder, t_op, zero, ir.Constant(I64, 64 * h), V16F) for h in range(_HALVES)]
        for m in range(AMX_ROWS):
            row = ir.Constant(I64, m)
            sq = splat(builder, load_row(builder, s_op, row, zero, F32), V16F)
            for h in range(_HALVES):
                at = ir.Constant(I64, 64 * h)
                total = load_row(builder, sums_op, row, at, V16I)
                ptr = row_pointer(builder, o_op, row, at, V16F)
                # f32(total) is exact (below 2^24), the scale product a power of two in range:
                # their product is the exact dot product, and adding it to a zero is exact.
                term = builder.fmul(builder.sitofp(total, V16F), builder.fmul(sq, sk[h]))
                builder.store(builder.fadd(builder.load(ptr, align=4), term), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


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
    :func:`.head_mix.converted_mix_exact` says so: the instruction flushes denormals.

    ``maxima`` (a bool) also writes each query's maxima of the key block's four blocks of
    ``MAX_BLOCK`` (:mod:`.head_mix`) keys into its row of ``block_max`` (float32 ``[queries,
    4]``; NaN wins), the candidate source's block scores, while the sums are in registers.
    """
    sig = types.void(a, a_scale, w, b, b_scale, out, block_max, converts, maxima)

    def codegen(context, builder, signature, args):
        (a_op, s_op, w_op, b_op, t_op, o_op, m_op), arrays = row_operands(context, builder, signature,
                                                                          args[:7])
        n_rows = extent(builder, arrays[0])
        n_quads = extent(builder, arrays[3])
        n_queries = extent(builder, arrays[5])
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
            pipeline(builder, ops, shape, ConvertedMix)
        with exact_bits:
            pipeline(builder, ops, shape, BitsMix)


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
