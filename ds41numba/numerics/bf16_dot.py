"""bf16 dot products on AVX512-BF16: an LLVM-IR micro-kernel, the many-row product built on it in
the reference's order, and the bf16-pair layouts it reads.

Whether they run (or numpy's f32 BLAS instead) is read from :func:`.backend.bf16_dot_enabled`.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .formats import as_f32_array, output_buffer
from .vector_ir import (I32, V16F, V16I, close_loop, i64, open_loop, row_operands, row_pointer,
                        splat)

__all__ = ["DOT_ROWS", "DOT_LANES", "GEMM_PAIRS", "bf16_dot_tile", "gemm_bf16", "bf16_pairs",
           "pack_bf16_pairs"]


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


@intrinsic
def bf16_dot_tile(typingctx, a, b, out):
    """``out[m, j] += sum_p a[m, p] . b[p, j]`` for ``m < DOT_ROWS``, ``j < DOT_LANES``.

    ``a`` (uint32 ``[DOT_ROWS, P]``) and ``b`` (uint32 ``[P, DOT_LANES]``) hold pairs of bf16
    values (element ``2p`` in the low half); ``out`` is float32 ``[DOT_ROWS, DOT_LANES]``. The
    rows of each may lie apart, each row is contiguous. Each lane continues its sum in p order
    with ``vdpbf16ps``: products exact, sums rounded to f32 (RNE), denormal inputs and results
    flushed to zero. The caller checks the shapes; P >= 1.
    """
    sig = types.void(a, b, out)

    def codegen(context, builder, signature, args):
        # The bf16 pairs as <16 x i32>: the intrinsic's original type, which LLVMs that have
        # since typed it <32 x bfloat> upgrade as they read the IR (llvmlite has no bfloat type).
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F, V16I, V16I]),
                                             "llvm.x86.avx512bf16.dpbf16ps.512")
        (a_op, b_op, o_op), arrays = row_operands(context, builder, signature, args)
        n_pairs = cgutils.unpack_tuple(builder, arrays[1].shape, 2)[0]
        nvec = DOT_LANES // 16

        out_ptrs = [[row_pointer(builder, o_op, i64(m), i64(64 * v), V16F) for v in range(nvec)]
                    for m in range(DOT_ROWS)]
        start = [[builder.load(ptr, align=4) for ptr in row] for row in out_ptrs]
        p, entry = open_loop(builder, "bf16dot")
        acc = [[builder.phi(V16F) for _ in range(nvec)] for _ in range(DOT_ROWS)]
        for m in range(DOT_ROWS):
            for v in range(nvec):
                acc[m][v].add_incoming(start[m][v], entry)
        bv = [builder.load(row_pointer(builder, b_op, p, i64(64 * v), V16I), align=4)
              for v in range(nvec)]
        new = []
        for m in range(DOT_ROWS):
            pair = builder.load(row_pointer(builder, a_op, i64(m), builder.mul(p, i64(4)), I32), align=4)
            pairs = splat(builder, pair, V16I)
            new.append([builder.call(dot, [acc[m][v], bv[v], pairs]) for v in range(nvec)])
        loop = builder.basic_block
        for m in range(DOT_ROWS):
            for v in range(nvec):
                acc[m][v].add_incoming(new[m][v], loop)
        close_loop(builder, p, n_pairs, "bf16dot")
        for m in range(DOT_ROWS):
            for v in range(nvec):
                builder.store(new[m][v], out_ptrs[m][v], align=4)
        return context.get_dummy_value()

    return sig, codegen



# A product of many rows runs in work items of _GEMM_ROWS rows by one block of DOT_LANES
# columns, over the inner dimension GEMM_PAIRS pairs at a time: that slice of B (32 KB) stays
# in L1 while every row group of the item passes over it.
_GEMM_ROWS = 256
GEMM_PAIRS = 256


@njit(parallel=True, cache=True)
def gemm_bf16(a, b, out, groups, block_pairs):
    """``out = a . b`` for every block of columns: ``a [M, groups * P]`` (M a multiple of
    DOT_ROWS), ``b [blocks, P, DOT_LANES]``, ``out [M, blocks * DOT_LANES]`` float32.

    The blocks split evenly into ``groups``; block j belongs to group ``g = j // (blocks /
    groups)`` and reads the pairs ``g*P .. (g+1)*P`` of A (the grouped projection). The inner
    dimension is summed in the reference's order (:func:`bf16_k_block`): runs of
    ``block_pairs`` pairs (a multiple of ``GEMM_PAIRS``, or >= P for one run), each from zero,
    added to the output in order. Every output is summed whole by one work item: the result
    does not depend on the thread count.
    """
    M = a.shape[0]
    n_blocks, P = b.shape[0], b.shape[1]
    per_group = n_blocks // groups
    n_row_chunks = (M + _GEMM_ROWS - 1) // _GEMM_ROWS
    for item in prange(n_row_chunks * n_blocks):
        i, j = item // n_blocks, item % n_blocks
        g = j // per_group
        r0, r1 = i * _GEMM_ROWS, min(M, (i + 1) * _GEMM_ROWS)
        o = out[r0:r1, j * DOT_LANES:(j + 1) * DOT_LANES]
        o[:] = 0
        # The first run sums straight into the output; later runs into a tile of their own.
        run = np.empty((r1 - r0 if P > block_pairs else 0, DOT_LANES), np.float32)
        a_rows = a[r0:r1, g * P:(g + 1) * P]
        for k0 in range(0, P, GEMM_PAIRS):
            k1 = min(P, k0 + GEMM_PAIRS)
            later = k0 >= block_pairs
            starts = later and k0 % block_pairs == 0
            ends = later and (k1 == P or k1 % block_pairs == 0)
            b_panel = b[j, k0:k1]
            for r in range(0, r1 - r0, DOT_ROWS):
                t = run[r:r + DOT_ROWS] if later else o[r:r + DOT_ROWS]
                if starts:
                    t[:] = 0
                bf16_dot_tile(a_rows[r:r + DOT_ROWS, k0:k1], b_panel, t)
                if ends:
                    o[r:r + DOT_ROWS] += t


@njit(cache=True)
def _bf16_pair(lo, hi):
    """Two bf16 values (f32 bit patterns) as one uint32, ``lo`` in the low half."""
    return (lo >> np.uint32(16)) | (hi & np.uint32(0xFFFF0000))


@njit(cache=True)
def _n_not_bf16(lo, hi):
    return ((lo & np.uint32(0xFFFF)) != 0) + ((hi & np.uint32(0xFFFF)) != 0)


@njit(parallel=True, cache=True)
def _pairs_kernel(bits, out):
    """A operand: ``out[i, p]`` = the pair (``bits[i, 2p]``, ``bits[i, 2p + 1]``); returns how many
    values were not bf16 values."""
    bad = 0
    for i in prange(bits.shape[0]):
        row, dst = bits[i], out[i]
        miss = 0
        for p in range(dst.shape[0]):
            miss += _n_not_bf16(row[2 * p], row[2 * p + 1])
            dst[p] = _bf16_pair(row[2 * p], row[2 * p + 1])
        bad += miss
    return bad


@njit(parallel=True, cache=True)
def _blocked_pairs_kernel(bits, out, first):
    """B operand: row ``i`` into lane ``(first + i) % DOT_LANES`` of block ``(first + i) //
    DOT_LANES`` of ``out [blocks, d / 2, DOT_LANES]``; returns how many values were not bf16."""
    bad = 0
    for i in prange(bits.shape[0]):
        r = first + i
        blk = out[r // DOT_LANES]
        lane = r % DOT_LANES
        row = bits[i]
        miss = 0
        for p in range(blk.shape[0]):
            miss += _n_not_bf16(row[2 * p], row[2 * p + 1])
            blk[p, lane] = _bf16_pair(row[2 * p], row[2 * p + 1])
        bad += miss
    return bad


def _pair_bits(x, name):
    x = np.ascontiguousarray(as_f32_array(x, name))
    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: x must be [n, d] with d even, got shape {x.shape}")
    return x.view(np.uint32)


def bf16_pairs(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16-valued rows ``x [n, d]`` (d even) as the A operand of the AVX512-BF16 micro-kernel:
    uint32 ``[n, d / 2]``, values ``2p`` and ``2p + 1`` of a row in element p (into ``out``
    when given)."""
    bits = _pair_bits(x, "bf16_pairs")
    out = output_buffer(out, (bits.shape[0], bits.shape[1] // 2), "bf16_pairs", np.uint32)
    if _pairs_kernel(bits, out):
        raise ValueError("bf16_pairs: x must hold bf16 values (round it to bfloat16 first)")
    return out


def pack_bf16_pairs(x: np.ndarray, out: np.ndarray | None = None, first: int = 0) -> np.ndarray:
    """bf16-valued rows ``x [n, d]`` (d even) as the B operand of the AVX512-BF16 micro-kernel:
    uint32 ``[blocks, d / 2, DOT_LANES]``, row ``first + i`` of ``x`` in lane ``(first + i) %
    DOT_LANES`` of block ``(first + i) // DOT_LANES``. Into ``out`` when given (its other rows
    untouched), else into a fresh zero-padded array with ``first = 0``."""
    bits = _pair_bits(x, "pack_bf16_pairs")
    n, d = bits.shape
    if out is None:
        if first:
            raise ValueError("pack_bf16_pairs: first needs an out array")
        out = np.zeros((-(-n // DOT_LANES), d // 2, DOT_LANES), np.uint32)
    elif (not isinstance(out, np.ndarray) or out.dtype != np.uint32 or out.ndim != 3
          or out.shape[1:] != (d // 2, DOT_LANES) or not out.flags.c_contiguous
          or not 0 <= first <= out.shape[0] * DOT_LANES - n):
        raise ValueError(f"pack_bf16_pairs: out must be a C-contiguous uint32 [blocks, {d // 2}, "
                         f"{DOT_LANES}] with room for rows {first}..{first + n}")
    if _blocked_pairs_kernel(bits, out, first):
        raise ValueError("pack_bf16_pairs: x must hold bf16 values (round it to bfloat16 first)")
    return out
