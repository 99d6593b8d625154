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
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16_dot import DOT_LANES
from .int8_dot import (INT8_GROUP, _check_out, _decompose_row, _int8_input, _quad, _range_of,
                       int8_blocks_shape)
from .vector_ir import F32, I32, I64, V16F, V16I, row_operands, row_pointer, splat

__all__ = ["AMX_ROWS", "AMX_K", "FOLD_SPREAD", "amx_begin", "amx_end", "amx_dot_tile",
           "folded_rows", "pack_folded_blocks", "folded_blocks_shape", "foldable",
           "request_tile_state"]

#: Rows of A one tile product multiplies (a tile register's rows); A is padded to a multiple.
AMX_ROWS = 16
#: Bytes of the inner dimension one tile product takes: the rows' length must be a multiple.
AMX_K = 64
#: The widest spread of one row's block exponents whose folded integers stay signed bytes
#: (``12 * 2^3 = 96 <= 127``).
FOLD_SPREAD = 3

_I8 = ir.IntType(8)
_P8 = _I8.as_pointer()
# Key lanes of one B tile: 16 int32 columns; a block of DOT_LANES keys is two.
_HALVES = DOT_LANES // 16
# Tile registers: one accumulator per half of the key block, the queries, the two key halves.
_C, _A, _B = (0, 1), 2, (3, 4)
_ROWS_BYTES = {_C[0]: (AMX_ROWS, 64), _C[1]: (AMX_ROWS, 64), _A: (AMX_ROWS, AMX_K),
               _B[0]: (AMX_K // 4, 64), _B[1]: (AMX_K // 4, 64)}


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


# ------------------------------------------------------------------------------ folded layouts


@njit(cache=True)
def _fold_row(row, ints, scales):
    """``row`` as folded integers in ``ints`` (``n_g * 2^(e_g - e_min)``, clipped to a byte when
    the row cannot be folded) and returns ``(bad, emin, emax, scale)``, ``scale = 2^e_min`` (1 for
    a row of zeros). Exponents as :func:`.int8_dot._decompose_row` finds them."""
    bad, emin, emax = _decompose_row(row, ints, scales)
    if emin > emax:
        return bad, emin, emax, np.float32(1.0)
    for g in range(scales.shape[0]):
        e = (np.float32(scales[g]).view(np.int32) >> 23) - 127
        shift = min(max(e - emin, 0), FOLD_SPREAD + 1)
        for j in range(g * INT8_GROUP, (g + 1) * INT8_GROUP):
            ints[j] = min(max(ints[j] << shift, -127), 127)
    return bad, emin, emax, np.uint32((emin + 127) << 23).view(np.float32)


@njit(parallel=True, cache=True)
def _fold_rows_kernel(x, quads, scales):
    n, d = x.shape
    bad = np.zeros(n, np.int64)
    emin = np.empty(n, np.int64)
    emax = np.empty(n, np.int64)
    for i in prange(n):
        ints = np.empty(d, np.int32)
        s = np.empty(d // INT8_GROUP, np.float32)
        bad[i], emin[i], emax[i], scales[i, 0] = _fold_row(x[i], ints, s)
        for p in range(d // 4):
            quads[i, p] = _quad(ints, p, 0)
    return _range_of(bad, emin, emax)


@njit(parallel=True, cache=True)
def _fold_blocks_kernel(x, quads, scales, first):
    n, d = x.shape
    bad = np.zeros(n, np.int64)
    emin = np.empty(n, np.int64)
    emax = np.empty(n, np.int64)
    for i in prange(n):
        r = first + i
        blk, lane = r // DOT_LANES, r % DOT_LANES
        ints = np.empty(d, np.int32)
        s = np.empty(d // INT8_GROUP, np.float32)
        bad[i], emin[i], emax[i], scales[blk, 0, lane] = _fold_row(x[i], ints, s)
        for p in range(d // 4):
            quads[blk, p, lane] = _quad(ints, p, 0)
    return _range_of(bad, emin, emax)


def _folded_input(x, name):
    x = _int8_input(x, name)
    if x.shape[1] % AMX_K:
        raise ValueError(f"{name}: rows must be a multiple of {AMX_K} values long, got {x.shape[1]}")
    return x


def folded_rows(x: np.ndarray, out: tuple | None = None) -> tuple:
    """fp4-valued rows ``x [n, d]`` (``d`` a multiple of ``AMX_K``) as the A operand of
    :func:`amx_dot_tile`: ``(quads uint32 [n, d / 4] of signed bytes, scales float32 [n, 1],
    range)``, into the first n rows of ``out = (quads, scales)`` when given. Rows that are not
    fp4 values count as bad in the range, rows whose exponents spread wider than FOLD_SPREAD in
    its spread: :func:`foldable` says whether the products are exact."""
    x = _folded_input(x, "folded_rows")
    n, d = x.shape
    shapes = ((n, d // 4), (n, 1))
    if out is None:
        out = (np.empty(shapes[0], np.uint32), np.empty(shapes[1], np.float32))
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        _check_out(a, s, t, "folded_rows", what)
    quads, scales = out[0][:n], out[1][:n]
    return quads, scales, _fold_rows_kernel(x, quads, scales)


def folded_blocks_shape(n: int, d: int) -> tuple:
    """Shapes of the B operand of ``n`` rows of ``d`` values: ``(quads, scales)``."""
    quads = int8_blocks_shape(n, d)[0]
    return quads, (quads[0], 1, DOT_LANES)


def pack_folded_blocks(x: np.ndarray, out: tuple | None = None, first: int = 0) -> tuple:
    """fp4-valued rows ``x [n, d]`` as the B operand of :func:`amx_dot_tile`: ``(quads uint32
    [blocks, d / 4, DOT_LANES] of signed bytes, scales float32 [blocks, 1, DOT_LANES], range)``,
    row ``first + i`` in lane ``(first + i) % DOT_LANES`` of block ``(first + i) // DOT_LANES``;
    into ``out`` when given (its other rows untouched), else fresh arrays (padding lanes zero,
    scale 1) with ``first = 0``. The range as in :func:`folded_rows`."""
    x = _folded_input(x, "pack_folded_blocks")
    n, d = x.shape
    shapes = folded_blocks_shape(n, d)
    if out is None:
        if first:
            raise ValueError("pack_folded_blocks: first needs an out array")
        out = (np.zeros(shapes[0], np.uint32), np.ones(shapes[1], np.float32))
    for a, s, t, what in zip(out, shapes, (np.uint32, np.float32), ("quads", "scales")):
        _check_out(a, (1,) + s[1:], t, "pack_folded_blocks", what)
    if out[0].shape[0] != out[1].shape[0] or not 0 <= first <= out[0].shape[0] * DOT_LANES - n:
        raise ValueError(f"pack_folded_blocks: out has no room for rows {first}..{first + n}")
    return out[0], out[1], _fold_blocks_kernel(x, out[0], out[1], first)


def foldable(a_range: np.ndarray, b_range: np.ndarray) -> bool:
    """Whether rows of these two ranges were folded whole (no bad rows, every row's exponents
    within FOLD_SPREAD). With :func:`.int8_dot.int8_dot_exact` true as well, :func:`amx_dot_tile`
    gives the exact dot products."""
    return bool(not (a_range[0] or b_range[0]) and max(a_range[3], b_range[3]) <= FOLD_SPREAD)


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
    :func:`foldable` and :func:`.int8_dot.int8_dot_exact` say so.
    """
    sig = types.void(a, a_scale, b, b_scale, out)

    def codegen(context, builder, signature, args):
        (a_op, s_op, b_op, t_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_quads = cgutils.unpack_tuple(builder, arrays[2].shape, 2)[0]
        # The two accumulator tiles are stored here side by side: [AMX_ROWS, DOT_LANES] int32.
        sums = cgutils.alloca_once(builder, ir.ArrayType(I32, AMX_ROWS * DOT_LANES))
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
