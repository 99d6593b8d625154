"""bf16 dot products on AVX512-BF16: an LLVM-IR micro-kernel and its FMA twin, and the many-row
product built on them in the reference's order. Their operands are the pair layouts of
:mod:`.bf16_layouts`; when the FMA twin runs instead is :mod:`.fma_choice`'s to say.

Whether they run (or numpy's f32 BLAS instead) is read from :func:`.backend.tier_at_least`
(``"avx512bf16"``).
"""

from __future__ import annotations

import llvmlite.ir as ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..jit import njit
from .vector_ir import (F32, I32, V16F, V16I, broadcast_tile, close_loop, extent, i64, open_loop, prefetch,
                        row_operands, row_pointer, splat, wide_registers)
from .workers import serial_twin, sized_call

__all__ = ["DOT_ROWS", "DOT_LANES", "MATVEC_BLOCKS", "bf16_dot_tile", "bf16_dot_run", "bf16_fma_tile",
           "bf16_fma_run", "bf16_matvec_tile", "dot_sums", "gemm_bf16", "gemm_bf16_sized"]


# The reference's products are of bf16 values summed in f32: the bf16 linears, and the indexer's
# scores (fp4 values, which bf16 holds exactly). AVX512-BF16's ``vdpbf16ps`` computes exactly
# that (16 f32 lanes, each adding the products of one pair of bf16 values), twice the work of an
# f32 FMA per instruction on half the bytes: measured here 1.5-1.8x numpy's f32 matrix product
# on the prefill's projections, and 3x BLAS on the decode step's index scores, a product too thin
# for BLAS ([positions, 128] x [128, 32]). numba has no vector types, so the micro-kernel below is
# written in LLVM IR: a row block of A against a block of B, the accumulators in registers for
# the whole dot product.

#: Rows of A one micro-kernel call multiplies (A is padded to a multiple of this).
DOT_ROWS = 8
#: Columns of B one call multiplies: two 16-lane vectors.
DOT_LANES = 32
#: Pairs of B ahead the many-row micro-kernels ask the cache for.
GEMM_PREFETCH = 24


def _b_rows(builder, b_op, p, vecs=range(DOT_LANES // 16)):
    """Row ``p`` of a B block: its DOT_LANES pairs (or the 16-lane vectors ``vecs`` of them) as
    16-lane vectors."""
    return [builder.load(row_pointer(builder, b_op, p, i64(64 * v), V16I), align=4) for v in vecs]


def _sub_tiles():
    """``(rows, vectors)`` of the output tile that one pass over the pairs keeps in registers.

    AVX-512's 32 vector registers hold the whole ``[DOT_ROWS, DOT_LANES]`` tile's sums (16
    registers) with room for B's pairs; on AVX2 the whole tile (32 of its registers) spilled to
    memory at every step (a third of numpy's rate, measured), so it runs as four passes of four
    rows by 16 lanes (8 registers of sums; at numpy's f32 rate). Each lane's sum runs over the
    pairs in order either way: the passes change which sums share a loop, never how one is
    summed."""
    nvec = DOT_LANES // 16
    if wide_registers():
        return [(range(DOT_ROWS), range(nvec))]
    return [(range(r, r + 4), range(v, v + 1)) for r in range(0, DOT_ROWS, 4) for v in range(nvec)]


def _pairs_loop(builder, o_op, n_pairs, name, step, fresh):
    """The frame both bf16 micro-kernels share: per sub-tile (:func:`_sub_tiles`) a loop over the
    pairs p whose ``step(p, acc, rows, vecs)`` returns the new sums of the ``[DOT_ROWS,
    DOT_LANES]`` output tile's ``rows`` by 16-lane vectors ``vecs``, in registers throughout.
    The sums start from the output tile and are stored back; or (``fresh``) start from zero and
    are added to the output tile at the end, one rounded addition each: a later run of the
    reference's order (:func:`~.linear.bf16_k_block`) without a tile of its own in memory."""
    zero = ir.Constant(V16F, [0.0] * 16)
    for part, (rows, vecs) in enumerate(_sub_tiles()):
        out_ptrs = {(m, v): row_pointer(builder, o_op, i64(m), i64(64 * v), V16F)
                    for m in rows for v in vecs}
        start = {mv: zero if fresh else builder.load(ptr, align=4) for mv, ptr in out_ptrs.items()}
        p, entry = open_loop(builder, f"{name}{part}")
        acc = {mv: builder.phi(V16F) for mv in out_ptrs}
        for mv, a in acc.items():
            a.add_incoming(start[mv], entry)
        new = step(p, acc, rows, vecs)
        loop = builder.basic_block
        for mv, a in acc.items():
            a.add_incoming(new[mv], loop)
        close_loop(builder, p, n_pairs, f"{name}{part}")
        for mv, ptr in out_ptrs.items():
            total = builder.fadd(builder.load(ptr, align=4), new[mv]) if fresh else new[mv]
            builder.store(total, ptr, align=4)


def _dpbf16ps(builder):
    """``update(a, b, acc)``: ``vdpbf16ps``, ``acc`` plus the products of the pairs ``a`` and
    ``b`` (16-lane vectors of their bits, as integers or floats), the high halves' first."""
    # The bf16 pairs as <16 x i32>: the intrinsic's original type, which LLVMs that have
    # since typed it <32 x bfloat> upgrade as they read the IR (llvmlite has no bfloat type).
    dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I, V16I]),
                                         "llvm.x86.avx512bf16.dpbf16ps.512")

    def pairs(x):
        return x if x.type == V16I else builder.bitcast(x, V16I)
    return lambda a, b, acc: builder.call(dot, [acc, pairs(b), pairs(a)])


def dot_sums(builder, n_pairs, rows, nvec, load_a, load_b, name="dottile", unrolled=True):
    """:func:`~.f32_tiles.fma_sums` on pairs: for ``i < rows`` and the ``16 * nvec`` lanes,
    ``acc = vdpbf16ps(acc, a[p, i], b[p])`` over ``p = 0 .. n_pairs - 1`` from +0, ``load_a``
    giving a pair's bits as one float and ``load_b`` ``nvec`` vectors of pairs' bits. With
    each pair's first value in its high half, these are MKL's FMA chains over the values in
    order, where no product or sum is denormal (a product of bf16 values is exact in f32):
    :func:`.fma_choice.fma_safe`."""
    return broadcast_tile(builder, n_pairs, rows, nvec, load_a, load_b, _dpbf16ps(builder), name, unrolled)


def _dot_step(builder, a_op, b_op):
    """One pair of every row against the B block: ``vdpbf16ps``."""
    dot = _dpbf16ps(builder)

    def step(p, acc, rows, vecs):
        ahead = builder.add(p, i64(GEMM_PREFETCH))
        for v in vecs:
            prefetch(builder, row_pointer(builder, b_op, ahead, i64(64 * v), F32))
        bv = dict(zip(vecs, _b_rows(builder, b_op, p, vecs)))
        new = {}
        for m in rows:
            pair = builder.load(row_pointer(builder, a_op, i64(m), builder.mul(p, i64(4)), I32), align=4)
            pairs = splat(builder, pair, V16I)
            for v in vecs:
                new[m, v] = dot(pairs, bv[v], acc[m, v])
        return new

    return step


def _fma_step(builder, a_op, b_op):
    """One pair of every row against the B block: two FMAs, odd element first."""
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16F, V16F]),
                                         "llvm.fma.v16f32")
    high = ir.Constant(V16I, [0xFFFF0000 - (1 << 32)] * 16)
    sixteen = ir.Constant(V16I, [16] * 16)

    def step(p, acc, rows, vecs):
        ahead = builder.add(p, i64(GEMM_PREFETCH))
        for v in vecs:
            prefetch(builder, row_pointer(builder, b_op, ahead, i64(64 * v), F32))
        bv = dict(zip(vecs, _b_rows(builder, b_op, p, vecs)))
        b_even = {v: builder.bitcast(builder.shl(x, sixteen), V16F) for v, x in bv.items()}
        b_odd = {v: builder.bitcast(builder.and_(x, high), V16F) for v, x in bv.items()}
        p8 = builder.mul(p, i64(8))
        # Every row's odd products first, then the even ones: only half of B's pairs need a
        # register at a time.
        new = dict(acc)
        for at, b_half in ((builder.add(p8, i64(4)), b_odd), (p8, b_even)):
            for m in rows:
                a = splat(builder, builder.load(row_pointer(builder, a_op, i64(m), at, F32), align=4), V16F)
                for v in vecs:
                    new[m, v] = builder.call(fma, [a, b_half[v], new[m, v]])
        return new

    return step


def _tile_codegen(make_step, name, fresh):
    def codegen(context, builder, signature, args):
        (a_op, b_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_pairs = extent(builder, arrays[1])
        _pairs_loop(builder, o_op, n_pairs, name, make_step(builder, a_op, b_op), fresh)
        return context.get_dummy_value()

    return codegen


@intrinsic
def bf16_dot_tile(typingctx, a, b, out):
    """``out[m, j] += sum_p a[m, p] . b[p, j]`` for ``m < DOT_ROWS``, ``j < DOT_LANES``.

    ``a`` (uint32 ``[DOT_ROWS, P]``) and ``b`` (uint32 ``[P, DOT_LANES]``) hold pairs of bf16
    values (element ``2p`` in the low half); ``out`` is float32 ``[DOT_ROWS, DOT_LANES]``. The
    rows of each may lie apart, each row is contiguous. Each lane continues its sum in p order
    with ``vdpbf16ps``: products exact, sums rounded to f32 (RNE), denormal inputs and results
    flushed to zero. The caller checks the shapes; P >= 1.
    """
    return types.void(a, b, out), _tile_codegen(_dot_step, "bf16dot", fresh=False)


@intrinsic
def bf16_dot_run(typingctx, a, b, out):
    """:func:`bf16_dot_tile`'s sums from zero, then ``out[m, j] = out[m, j] + sum``: one later
    run of the reference's order, added to the runs before it."""
    return types.void(a, b, out), _tile_codegen(_dot_step, "bf16run", fresh=True)


@intrinsic
def bf16_fma_tile(typingctx, a, b, out):
    """:func:`bf16_dot_tile` with f32 FMAs: the same sums in the same order, from ``a`` as f32
    (float32 ``[DOT_ROWS, 2P]``, bf16 values) instead of pairs.

    ``vdpbf16ps`` adds a pair's two exact products one after the other (odd element first),
    rounding each sum: two FMAs, odd then even, compute exactly that, because a product of two
    bf16 values is exact in f32. Where ``vdpbf16ps`` issues at a quarter of the FMA rate (the
    machine this was written on: 1.2 vs 4.9 G instructions/s a core, measured), this is nearly
    twice as fast. It differs only where ``vdpbf16ps`` flushes denormals (inputs read as zero,
    results flushed): the caller keeps such inputs away (:func:`.fma_choice.fma_safe`). P >= 1.
    """
    return types.void(a, b, out), _tile_codegen(_fma_step, "bf16fma", fresh=False)


@intrinsic
def bf16_fma_run(typingctx, a, b, out):
    """:func:`bf16_fma_tile`'s sums from zero, then added to ``out`` (as :func:`bf16_dot_run`)."""
    return types.void(a, b, out), _tile_codegen(_fma_step, "bf16fmarun", fresh=True)


#: Output blocks (each DOT_LANES wide) one :func:`bf16_matvec_tile` call advances together.
MATVEC_BLOCKS = 4


@intrinsic
def bf16_matvec_tile(typingctx, x, b0, b1, b2, b3, out):
    """``out[q, j] = sum_p (out[q, j] + x[2p+1] * hi(bq[p, j])) + x[2p] * lo(bq[p, j])`` for the
    ``MATVEC_BLOCKS`` blocks ``b0 .. b3``: one input row against four blocks of held pairs.

    The decode step's product (one row of x against every weight) reads each weight once and
    does two multiply-adds a weight: it is bound by reading memory, which needs many loads in
    flight and the sums in registers (numba's own loop keeps them in memory, its stores and
    reloads holding up the loads). The four blocks' streams are left to the hardware's
    prefetchers: with software prefetches 24 pairs ahead a pass over layer 20's weights took
    0.83x as long on 2026-12-02 but 1.00-1.36x on 2026-12-07 (median 1.15, nine runs alternated
    in one process; no other distance or hint did better than none), on the same Zen 4 kind.
    Each product is rounded, then each sum (no FMA): the
    reference's order whatever the values. ``x`` float32 ``[1, 2P]``, each ``bq`` uint32 ``[P,
    DOT_LANES]`` (a block's pairs; a caller short of four blocks repeats one), ``out`` float32
    ``[MATVEC_BLOCKS, DOT_LANES]``. The caller checks the shapes; P >= 1.
    """
    sig = types.void(x, b0, b1, b2, b3, out)

    def codegen(context, builder, signature, args):
        (x_op, *b_ops, o_op), arrays = row_operands(context, builder, signature, args)
        high = ir.Constant(V16I, [0xFFFF0000 - (1 << 32)] * 16)
        sixteen = ir.Constant(V16I, [16] * 16)
        nvec = DOT_LANES // 16
        ptrs = [row_pointer(builder, o_op, i64(q), i64(64 * v), V16F)
                for q in range(MATVEC_BLOCKS) for v in range(nvec)]
        start = [builder.load(ptr, align=4) for ptr in ptrs]
        p, entry = open_loop(builder, "bf16mv")
        acc = [builder.phi(V16F) for _ in ptrs]
        for a, s in zip(acc, start):
            a.add_incoming(s, entry)
        p8 = builder.mul(p, i64(8))
        x_even, x_odd = (splat(builder, builder.load(row_pointer(builder, x_op, i64(0), at, F32),
                                                     align=4), V16F)
                         for at in (p8, builder.add(p8, i64(4))))
        new = []
        for q, b_op in enumerate(b_ops):
            for v, w in enumerate(_b_rows(builder, b_op, p)):
                hi = builder.bitcast(builder.and_(w, high), V16F)
                lo = builder.bitcast(builder.shl(w, sixteen), V16F)
                s = builder.fadd(acc[q * nvec + v], builder.fmul(x_odd, hi))
                new.append(builder.fadd(s, builder.fmul(x_even, lo)))
        loop = builder.basic_block
        for a, n in zip(acc, new):
            a.add_incoming(n, loop)
        close_loop(builder, p, extent(builder, arrays[1]), "bf16mv")
        for n, ptr in zip(new, ptrs):
            builder.store(n, ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


# A product of many rows runs in work items of _GEMM_ROWS rows by one block of DOT_LANES
# columns, one run of the reference's order (up to 512 pairs) at a time: that slice of B (up to
# 64 KB) stays in cache while every row group of the item passes over it, and each micro-kernel
# call sums a whole run in registers.
_GEMM_ROWS = 256


def _a_width(a):
    """Columns of A one pair takes: 1 for pairs (uint32), 2 for f32 values."""


@overload(_a_width)
def _a_width_impl(a):
    width = 2 if a.dtype == types.float32 else 1
    return lambda a: width


def tile_product(a, b, out, later):
    """The micro-kernel for A's layout: :func:`bf16_dot_tile` on pairs, :func:`bf16_fma_tile`
    on f32 values; their ``_run`` forms for a ``later`` run (summed from zero, then added)."""


@overload(tile_product)
def _tile_product_impl(a, b, out, later):
    tile, run = (bf16_fma_tile, bf16_fma_run) if a.dtype == types.float32 else (bf16_dot_tile, bf16_dot_run)

    def impl(a, b, out, later):
        if later:
            run(a, b, out)
        else:
            tile(a, b, out)

    return impl


@njit(parallel=True)
def gemm_bf16(a, b, out, groups, block_pairs):
    """``out = a . b`` for every block of columns: ``a [M, groups * P]`` (M a multiple of
    DOT_ROWS; pairs, or ``[M, groups * 2P]`` f32 values for the FMA kernel),
    ``b [blocks, P, DOT_LANES]``, ``out [M, blocks * DOT_LANES]`` float32.

    The blocks split evenly into ``groups``; block j belongs to group ``g = j // (blocks /
    groups)`` and reads the pairs ``g*P .. (g+1)*P`` of A (the grouped projection). The inner
    dimension is summed in the reference's order (:func:`bf16_k_block`): runs of
    ``block_pairs`` pairs (or >= P for one run), each from zero, added to the output in order.
    Every output is summed whole by one work item: the result does not depend on the thread
    count.
    """
    M = a.shape[0]
    n_blocks, P = b.shape[0], b.shape[1]
    width = _a_width(a)
    per_group = n_blocks // groups
    n_row_chunks = (M + _GEMM_ROWS - 1) // _GEMM_ROWS
    for item in prange(n_row_chunks * n_blocks):
        i, j = item // n_blocks, item % n_blocks
        g = j // per_group
        r0, r1 = i * _GEMM_ROWS, min(M, (i + 1) * _GEMM_ROWS)
        o = out[r0:r1, j * DOT_LANES:(j + 1) * DOT_LANES]
        o[:] = 0
        a_rows = a[r0:r1, g * P * width:(g + 1) * P * width]
        for k0 in range(0, P, block_pairs):
            k1 = min(P, k0 + block_pairs)
            b_run = b[j, k0:k1]
            for r in range(0, r1 - r0, DOT_ROWS):
                tile_product(a_rows[r:r + DOT_ROWS, k0 * width:k1 * width], b_run, o[r:r + DOT_ROWS], k0 > 0)


gemm_bf16_serial = serial_twin(gemm_bf16)


def gemm_bf16_sized(a, b, out, groups, block_pairs):
    """:func:`gemm_bf16` on numba's threads where the product is large enough to split, else in
    the calling thread (its serial twin; :func:`~.workers.sized_call`). A work item is
    ``_GEMM_ROWS`` rows of one block of columns."""
    rows = a.shape[0]
    items = -(-rows // _GEMM_ROWS) * b.shape[0]
    cost = min(rows, _GEMM_ROWS) * b.shape[1] * 2 * DOT_LANES
    sized_call(gemm_bf16, items, cost, a, b, out, groups, block_pairs)
