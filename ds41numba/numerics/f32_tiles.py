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

from .vector_ir import counted_loop, splat

__all__ = ["TILE_ROWS", "TILE_LANES", "CHAIN_ROWS", "CHAIN_LANES", "fma_tile", "lanes_tile",
           "chain_tile"]

#: Rows of x one micro-kernel call multiplies: 10 x 2 vector accumulators, the two vectors of w
#: and the 10 broadcasts of x fill the 32 zmm registers (12 rows spilled accumulators: LLVM
#: hoists all of a step's broadcasts).
TILE_ROWS = 10
#: Output columns one micro-kernel call multiplies: two 16-lane vectors.
TILE_LANES = 32
_NV = TILE_LANES // 16

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V16 = ir.VectorType(_F32, 16)


class _Emit:
    """A kernel's operands over an llvmlite builder: integer addresses, typed loads and stores,
    the broadcast step of a register tile (its loops and splats: :mod:`.vector_ir`)."""

    def __init__(self, context, builder, signature, args):
        self.b = builder
        self.arrays = [context.make_array(t)(context, builder, v) if isinstance(t, types.Array) else v
                       for t, v in zip(signature.args, args)]
        self.ndims = [getattr(t, "ndim", 0) for t in signature.args]

    def const(self, v):
        return ir.Constant(_I64, v)

    def base(self, i):
        return self.b.ptrtoint(self.arrays[i].data, _I64)

    def shape(self, i, d):
        return cgutils.unpack_tuple(self.b, self.arrays[i].shape, self.ndims[i])[d]

    def stride(self, i, d):
        return cgutils.unpack_tuple(self.b, self.arrays[i].strides, self.ndims[i])[d]

    def addr(self, *terms):
        acc = terms[0]
        for t in terms[1:]:
            acc = self.b.add(acc, self.const(t) if isinstance(t, int) else t)
        return acc

    def load(self, addr, ty):
        return self.b.load(self.b.inttoptr(addr, ty.as_pointer()), align=4)

    def store(self, value, addr):
        self.b.store(value, self.b.inttoptr(addr, value.type.as_pointer()), align=4)

    def broadcast_step(self, x_rows, b_base, b_stride, nv, update):
        """The loop body of a register tile: at step k, ``nv`` vectors of row k of B against the
        broadcast element k of each x row, ``acc = update(x, b, acc)`` for every accumulator
        (row-major: row m's vectors at ``m * nv ..``)."""
        def body(k, acc):
            b_row = self.addr(b_base, self.b.mul(k, b_stride))
            bv = [self.load(self.addr(b_row, 64 * v), _V16) for v in range(nv)]
            k4 = self.b.mul(k, self.const(4))
            new = []
            for m, x_row in enumerate(x_rows):
                xs = splat(self.b, self.load(self.addr(x_row, k4), _F32), _V16)
                new += [update(xs, bv[v], acc[m * nv + v]) for v in range(nv)]
            return new
        return body

    def clamped_rows(self, base, stride, rows, n):
        """Addresses of rows 0..n-1, those past ``rows`` repeating the last row."""
        last = self.b.sub(rows, self.const(1))
        return [self.b.add(base, self.b.mul(
            self.b.select(self.b.icmp_signed("<", self.const(m), rows), self.const(m), last), stride))
            for m in range(n)]

    def for_rows(self, rows, n, store):
        """``store(m)`` for each m < min(rows, n); row 0 is always stored."""
        for m in range(n):
            if m == 0:
                store(m)
            else:
                with self.b.if_then(self.b.icmp_signed("<", self.const(m), rows)):
                    store(m)


def _fma_vec(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16, [_V16] * 3),
                                          "llvm.fma.v16f32")


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
        e = _Emit(context, builder, signature, args)
        fma = _fma_vec(builder)
        is_first = builder.icmp_unsigned("!=", args[3], ir.Constant(args[3].type, 0))
        rows = e.shape(0, 0)
        x_rows = e.clamped_rows(e.base(0), e.stride(0, 0), rows, TILE_ROWS)
        w_base, w_stride = e.base(1), e.stride(1, 0)
        o_base, o_stride = e.base(2), e.stride(2, 0)

        body = e.broadcast_step(x_rows, w_base, w_stride, _NV,
                                lambda xs, wv, a: builder.call(fma, [xs, wv, a]))

        acc = counted_loop(builder, e.shape(1, 0), [ir.Constant(_V16, None)] * (TILE_ROWS * _NV), body)

        def store(m):
            o_row = e.addr(o_base, builder.mul(e.const(m), o_stride))
            with builder.if_else(is_first) as (then, otherwise):
                with then:
                    for v in range(_NV):
                        e.store(acc[m * _NV + v], e.addr(o_row, 64 * v))
                with otherwise:
                    for v in range(_NV):
                        a = e.addr(o_row, 64 * v)
                        e.store(builder.fadd(e.load(a, _V16), acc[m * _NV + v]), a)

        e.for_rows(rows, TILE_ROWS, store)
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
        e = _Emit(context, builder, signature, args)
        x_base = e.base(0)
        w_base, w_stride = e.base(1), e.stride(1, 0)
        n_q = builder.sdiv(e.shape(1, 0), e.const(4))
        zero = ir.Constant(_V16, None)
        inits = [e.load(e.addr(e.base(2), 64 * v), _V16) for v in range(_NV)] + [zero] * (3 * _NV)

        def body(q, acc):
            new = []
            for lane in range(4):
                k = builder.add(builder.mul(q, e.const(4)), e.const(lane))
                xs = splat(builder, e.load(e.addr(x_base, builder.mul(k, e.const(4))), _F32), _V16)
                w_row = e.addr(w_base, builder.mul(k, w_stride))
                new += [builder.fadd(acc[lane * _NV + v],
                                     builder.fmul(xs, e.load(e.addr(w_row, 64 * v), _V16)))
                        for v in range(_NV)]
            return new

        acc = counted_loop(builder, n_q, inits, body)
        o_base = e.base(3)
        for v in range(_NV):
            lane = [acc[i * _NV + v] for i in range(4)]
            r = builder.fadd(builder.fadd(lane[0], lane[2]), builder.fadd(lane[1], lane[3]))
            e.store(r, e.addr(o_base, 64 * v))
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
        e = _Emit(context, builder, signature, args)
        rows = e.shape(0, 0)
        x_rows = e.clamped_rows(e.base(0), e.stride(0, 0), rows, CHAIN_ROWS)
        v_base, v_stride = e.base(1), e.stride(1, 0)

        # No FMA: each product rounded, then added.
        body = e.broadcast_step(x_rows, v_base, v_stride, _CHAIN_NV,
                                lambda xs, vv, a: builder.fadd(a, builder.fmul(xs, vv)))

        acc = counted_loop(builder, e.shape(1, 0), [ir.Constant(_V16, None)] * (CHAIN_ROWS * _CHAIN_NV),
                           body)
        o_base, o_stride = e.base(2), e.stride(2, 0)

        def store(m):
            o_row = e.addr(o_base, builder.mul(e.const(m), o_stride))
            for i in range(_CHAIN_NV):
                e.store(acc[m * _CHAIN_NV + i], e.addr(o_row, 64 * i))

        e.for_rows(rows, CHAIN_ROWS, store)
        return context.get_dummy_value()

    return sig, codegen
