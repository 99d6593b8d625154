"""The LLVM-IR micro-kernels of the f32 products in MKL's order (:mod:`.f32_products`), one a
kernel of the reference's: the blocked kernel's FMA chain over one block of the inner dimension
(:func:`fma_tile`), the small kernel's four lanes of rounded products (:func:`lanes_tile`) and
the NN layout's single chain (:func:`chain_tile`). numba has no vector types, so each keeps a
register tile of sums in LLVM IR for its whole loop; which sums share a tile never changes how
one is summed.
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vector_ir import (F32, V16F, broadcast_tile, counted_loop, extent, i64, load_row,
                        row_operands, row_pointer, splat)

__all__ = ["TILE_ROWS", "TILE_LANES", "CHAIN_ROWS", "CHAIN_LANES", "fma_sums", "fma_tile",
           "lanes_tile", "chain_tile"]

#: Rows of x one micro-kernel call multiplies: 10 x 2 vector accumulators, the two vectors of w
#: and the 10 broadcasts of x fill the 32 zmm registers (12 rows spilled accumulators: LLVM
#: hoists all of a step's broadcasts).
TILE_ROWS = 10
#: Output columns one micro-kernel call multiplies: two 16-lane vectors.
TILE_LANES = 32
_NV = TILE_LANES // 16


def fma_sums(builder, n_k, rows, nvec, load_a, load_b, name="fmatile", unrolled=True):
    """MKL's blocked kernel inside one block of the inner dimension, on a register tile: for
    ``i < rows`` and the ``16 * nvec`` lanes ``c``, the FMA chain ``acc = fma(a[k, i], b[k, c],
    acc)`` over ``k = 0 .. n_k - 1`` from +0 (``load_a(k, i)`` the float ``a[k, i]``,
    ``load_b(k)`` row k of b as ``nvec`` vectors). The one model of that kernel's sums, which
    :func:`fma_tile` and sparse attention's tiles store; returns them as
    :func:`~.vector_ir.broadcast_tile` does."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3),
                                         "llvm.fma.v16f32")
    return broadcast_tile(builder, n_k, rows, nvec, load_a, load_b,
                          lambda a, b, acc: builder.call(fma, [a, b, acc]), name, unrolled)


def _vectors(builder, operand, row, nvec):
    """Row ``row`` (an i64) of a row operand as ``nvec`` 16-lane float vectors."""
    return [load_row(builder, operand, row, i64(64 * v), V16F) for v in range(nvec)]


def _row_elements(builder, operand, rows, n):
    """``load(k, m)``: the float ``x[m, k]`` of a row operand of ``rows`` rows (an i64), for the
    ``n`` rows of a tile; rows past ``rows`` repeat the last, so a tile always has all its rows
    to read."""
    last = builder.sub(rows, i64(1))
    clamped = [builder.select(builder.icmp_signed("<", i64(m), rows), i64(m), last)
               for m in range(n)]

    def load(k, m):
        at = row_pointer(builder, operand, clamped[m], builder.mul(k, i64(4)), F32)
        return builder.load(at, align=4)
    return load


def _for_rows(builder, rows, n, store):
    """``store(m)`` for each m < min(rows, n); row 0 is always stored."""
    for m in range(n):
        if m == 0:
            store(m)
        else:
            with builder.if_then(builder.icmp_signed("<", i64(m), rows)):
                store(m)


@intrinsic
def fma_tile(typingctx, x, w, out, first):
    """One block of the inner dimension for ``TILE_ROWS`` rows by ``TILE_LANES`` columns:
    ``acc[m, j] = fma(x[m, k], w[k, j], acc[m, j])`` for k in order from ``acc = 0``, then
    ``out[m, j] = acc`` when ``first``, else ``out[m, j] = out[m, j] + acc``.

    ``x`` float32 ``[rows, kb]`` (1 <= rows <= TILE_ROWS, rows contiguous), ``w`` float32
    ``[kb, TILE_LANES]`` (kb >= 1, rows contiguous), ``out`` float32 ``[rows, TILE_LANES]`` (rows
    contiguous). Rows past ``rows`` repeat the last row and are not stored. The caller checks the
    shapes.
    """
    sig = types.void(x, w, out, first)

    def codegen(context, builder, signature, args):
        (x_op, w_op, o_op, first), arrays = row_operands(context, builder, signature, args)
        is_first = builder.icmp_unsigned("!=", first, ir.Constant(first.type, 0))
        rows = extent(builder, arrays[0])
        acc = fma_sums(builder, extent(builder, arrays[1]), TILE_ROWS, _NV,
                       _row_elements(builder, x_op, rows, TILE_ROWS),
                       lambda k: _vectors(builder, w_op, k, _NV), name="loop")

        def store(m):
            ptrs = [row_pointer(builder, o_op, i64(m), i64(64 * v), V16F) for v in range(_NV)]
            with builder.if_else(is_first) as (then, otherwise):
                with then:
                    for v in range(_NV):
                        builder.store(acc[m][v], ptrs[v], align=4)
                with otherwise:
                    for v in range(_NV):
                        builder.store(builder.fadd(builder.load(ptrs[v], align=4), acc[m][v]),
                                      ptrs[v], align=4)

        _for_rows(builder, rows, TILE_ROWS, store)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lanes_tile(typingctx, x, w, lane0, out):
    """The small kernel's four lanes for one x row and ``TILE_LANES`` columns: lane l sums
    ``round(x[4q + l] * w[4q + l, j])`` in q order (lane 0 from ``lane0[j]``, the others from 0),
    then ``out[j] = (l0 + l2) + (l1 + l3)``.

    ``x`` float32 1-D ``[4 nq]`` (contiguous), ``w`` float32 ``[4 nq, TILE_LANES]`` (rows
    contiguous), ``lane0`` and ``out`` float32 1-D ``[TILE_LANES]`` contiguous; nq >= 0.
    """
    sig = types.void(x, w, lane0, out)

    def codegen(context, builder, signature, args):
        (x_op, w_op, l_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_q = builder.sdiv(extent(builder, arrays[1]), i64(4))
        zero = ir.Constant(V16F, None)
        inits = _vectors(builder, l_op, i64(0), _NV) + [zero] * (3 * _NV)

        def body(q, acc):
            new = []
            for lane in range(4):
                k = builder.add(builder.mul(q, i64(4)), i64(lane))
                x = load_row(builder, x_op, i64(0), builder.mul(k, i64(4)), F32)
                xs = splat(builder, x, V16F)
                new += [builder.fadd(acc[lane * _NV + v], builder.fmul(xs, w))
                        for v, w in enumerate(_vectors(builder, w_op, k, _NV))]
            return new

        acc = counted_loop(builder, n_q, inits, body)
        for v in range(_NV):
            lane = [acc[i * _NV + v] for i in range(4)]
            r = builder.fadd(builder.fadd(lane[0], lane[2]), builder.fadd(lane[1], lane[3]))
            builder.store(r, row_pointer(builder, o_op, i64(0), i64(64 * v), V16F), align=4)
        return context.get_dummy_value()

    return sig, codegen


#: Rows and 16-lane vectors of the NN chain's micro-kernel (24 of the 32 zmm registers).
CHAIN_ROWS = 3
_CHAIN_NV = 8
CHAIN_LANES = 16 * _CHAIN_NV


@intrinsic
def chain_tile(typingctx, x, v, out):
    """The NN layout's small-M order for ``CHAIN_ROWS`` rows by ``CHAIN_LANES`` columns: one
    chain over all of k, ``acc = acc + round(x[m, k] * v[k, j])`` from 0, stored to ``out``.

    ``x`` float32 ``[rows, K]`` (1 <= rows <= CHAIN_ROWS, rows contiguous), ``v`` float32
    ``[K, CHAIN_LANES]`` (K >= 0, rows contiguous), ``out`` ``[rows, CHAIN_LANES]``.
    """
    sig = types.void(x, v, out)

    def codegen(context, builder, signature, args):
        (x_op, v_op, o_op), arrays = row_operands(context, builder, signature, args)
        rows = extent(builder, arrays[0])
        # No FMA: each product rounded, then added.
        acc = broadcast_tile(builder, extent(builder, arrays[1]), CHAIN_ROWS, _CHAIN_NV,
                             _row_elements(builder, x_op, rows, CHAIN_ROWS),
                             lambda k: _vectors(builder, v_op, k, _CHAIN_NV),
                             lambda xs, vv, a: builder.fadd(a, builder.fmul(xs, vv)), name="loop")

        def store(m):
            for i in range(_CHAIN_NV):
                builder.store(acc[m][i], row_pointer(builder, o_op, i64(m), i64(64 * i), V16F),
                              align=4)

        _for_rows(builder, rows, CHAIN_ROWS, store)
        return context.get_dummy_value()

    return sig, codegen
