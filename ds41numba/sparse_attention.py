"""Sparse attention in the reference's f32 order: ``sparse_attn``, the reference's
sparse-attention kernel.

Each query attends to its listed rows (the window's, then its selected compressed rows; -1
entries skipped) with a per-head sink logit; q.k, torch's softmax and P @ rows are summed in
the order the reference's CPU libraries sum them (MKL's blocked sgemm, torch's AVX512
softmax, :mod:`.numerics.softmax`), so the output is the reference's bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .jit import njit
from .numerics import (SOFTMAX_LANES, bf16_pairs, bf16_scalar, fma_faster, output_buffer, serial_twin,
                       sized_call, softmax_rows, tier_at_least, values_range)
from .numerics.bf16_dot import dot_sums
from .numerics.f32_products import KC, blocked_rows
from .numerics.f32_tiles import fma_sums
from .numerics.fma_choice import magnitudes_range, safe_partner
from .numerics.vector_ir import (F32, I32, I64, V16F, extent, i64, lane_masks, load_row,
                                 row_operands, row_pointer, wide_registers)
from .numerics.vector_ir import prefetch as prefetch_line

__all__ = ["sparse_attn", "kv_pairs", "KvPairs"]


# ------------------------------------------------------------------------------------------------
# Sparse attention in the reference's f32 order
#
# The reference multiplies, per query, all H heads at once: scores = q [H, hd] . rows^T (MKL
# sgemm, T layout), torch's AVX512 softmax over [H, W + 1] (the sink the last column), and
# P [H, W] @ rows (MKL sgemm, NN layout) over every list position, -1 entries included (their
# probability is exactly 0). MKL picks its kernel by the row count M = H
# (docs/exactness.md, "f32 linears"):
# * blocked (M >= 4): the inner dimension in blocks of 192 from its start, a fused multiply-add
#   chain from zero inside each block, block results added in order. q.k blocks hd; P @ rows
#   blocks the W list positions, so its block edges fall at list positions 192, 384, ...
# * 2-3 rows: q.k a 4-lane dot without FMA (lane l takes k = peel + 4i + l), P @ rows one
#   chain over all W positions without FMA; one row: q.k the gemv variant of the same dot.
# * with the reference's 2 threads and 4 < M < 12, M % 4 != 0: rows 4 * (M // 4) .. M - 1 take
#   the 2-3 row kernels, the rest the blocked one.
# Only the blocked kernel is verified at attention shapes (V4.1 has 64 heads and every golden
# 4): the emulation of this whole order reproduces 100% of the reference's production-dimension
# samples (tests/data/sparse_attn_v41flash.npz). The other row kernels follow the measured MKL
# rules for linears and are not verified here.
#
# Skipping -1 entries: a -1 entry's probability is exactly +0 and the reference's row for it
# holds finite values (zeros in the emulation), so its q.k is never needed and in P @ rows each
# of its multiply-adds is acc + (+0): an identity except that it turns an accumulated -0 into
# +0, and a run of them does exactly what one does. Each maximal run of -1 entries inside a
# product block is kept as one zero row with probability +0; every other -1 entry is skipped.
# Block edges stay at list positions: the bits are those of the full list.
#
# MKL's block (KC), its row-blocking rule (blocked_rows) and its FMA chain inside a block
# (fma_sums) are the ones the f32 products use (:mod:`.numerics.f32_products`,
# :mod:`.numerics.f32_tiles`): one model of its order.
#
# q.k as bf16 pairs: the model's q and KV rows are bf16 values, whose products are exact in
# f32, so the blocked kernel's FMA chain over hd is a chain of rounded additions of exact
# products; ``vdpbf16ps`` adds two such products a lane, the pair's high half first, at the
# FMA's rate on a Zen 4 (twice the work an instruction). With each pair's first value in its
# high half (``bf16_pairs(in_order=True)``) the chains are the same, where no product or sum
# can be denormal (``vdpbf16ps`` flushes them; :func:`.numerics.fma_safe`): checked for the
# rows once (:func:`kv_pairs`) and for each query's q as it is laid out, which otherwise
# takes the f32 FMAs. P @ rows multiplies f32 probabilities: FMAs always.

# The tiles' sums stay in registers: AVX-512 has 32 of 16 floats, AVX2 16 of 8
# (:func:`~.numerics.vector_ir.wide_registers`), where the AVX-512 tiles spilled at every step
# (sparse attention at a quarter of the FMA rate, measured). The tile shape changes which sums
# share a loop, never how one is summed.
#: q.k micro-kernel tile: 6 listed rows x 64 heads (4 vectors), 24 vector accumulators; on AVX2
#: 6 rows x 16 heads, 12 registers (its 2 rows of q and the broadcast make 15).
_QK_ROWS = 6
_QK_HEADS = 64 if wide_registers() else 16
#: P @ rows micro-kernel tile: 8 heads x 48 hd columns (3 vectors), 24 vector accumulators
#: (measured faster than 6 x 64 here: a block's 48-column slice of the rows stays in L1 while
#: the head tiles pass over it); on AVX2 6 heads x 16 columns, 12 registers.
_PV_HEADS = 8 if wide_registers() else 6
_PV_COLS = 48 if wide_registers() else 16
#: List rows ahead whose slice the P @ rows tile prefetches (the rows lie scattered in memory).
_PV_PREFETCH = 4
#: Entries of the address table past the list that the tiles may read (a q.k tile's rows and
#: the next tile's, which it prefetches).
_LIST_SLACK = max(2 * _QK_ROWS - 1, _PV_PREFETCH)


def _tile_operands(builder, ops, arrays, rows, nvec, by_address, prefetch, masked):
    """:func:`_fma_tile`'s operands in IR: the chain's length, ``load_a(k, i)``, ``load_b(k)``
    (:func:`~.numerics.f32_tiles.fma_sums`), the output operand and the accumulate flag."""
    def listed(table, k):
        """Where listed row ``k`` (an i64) starts: entry k of an address table, plus the tile's
        float offset."""
        return builder.add(builder.load(row_pointer(builder, table, k, i64(0), I64)), offset)

    def vectors(row, masks=None):
        """``nvec`` vectors of the floats from address ``row`` on; with ``masks``, only their
        lanes the masks allow (the others 0)."""
        ptrs = [builder.inttoptr(builder.add(row, i64(64 * v)), V16F.as_pointer())
                for v in range(nvec)]
        if masks is None:
            return [builder.load(p, align=4) for p in ptrs]
        masked_load = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            V16F, [V16F.as_pointer(), I32, masks[0].type, V16F]),
            "llvm.masked.load.v16f32.p0v16f32")
        return [builder.call(masked_load, [p, ir.Constant(I32, 4), m, ir.Constant(V16F, None)])
                for p, m in zip(ptrs, masks)]

    if by_address == "a":
        table, first, b_op, o_op, accumulate = ops
        offset = builder.mul(first, i64(4))
        a_rows = [listed(table, i64(i)) for i in range(rows)]

        def load_a(k, i):
            at = builder.add(a_rows[i], builder.mul(k, i64(4)))
            return builder.load(builder.inttoptr(at, F32.as_pointer()), align=4)

        def load_b(k):
            if prefetch:
                # One line a step of the rows ``prefetch`` entries on in the table (the next
                # tile's): step k asks for row k % rows's line holding element k, so the
                # block's lines of every row are asked for while this tile runs.
                ahead = listed(table, builder.add(builder.urem(k, i64(rows)), i64(prefetch)))
                line = builder.and_(builder.mul(k, i64(4)), i64(-64))
                prefetch_line(builder, builder.inttoptr(builder.add(ahead, line),
                                                        ir.IntType(8).as_pointer()))
            return [load_row(builder, b_op, k, i64(64 * v), V16F) for v in range(nvec)]

        return extent(builder, arrays[2]), load_a, load_b, o_op, accumulate

    a_op, table, first, width, o_op, accumulate = ops
    offset = builder.mul(first, i64(4))
    a_stride = builder.extract_value(arrays[0].strides, 1)
    masks = lane_masks(builder, width, nvec) if masked else None

    def load_a(k, i):
        return load_row(builder, a_op, k, builder.mul(a_stride, i64(i)), F32)

    def load_b(k):
        if prefetch:
            ahead = listed(table, builder.add(k, i64(prefetch)))
            for line in range(0, 64 * nvec, 64):
                prefetch_line(builder, builder.inttoptr(builder.add(ahead, i64(line)),
                                                        ir.IntType(8).as_pointer()))
        return vectors(listed(table, k), masks)

    return extent(builder, arrays[0]), load_a, load_b, o_op, accumulate


def _fma_tile(rows, nvec, by_address, prefetch=0, masked=False, sums=fma_sums):
    """An intrinsic running MKL's blocked kernel inside one block on a tile of accumulators:
    for ``i < rows`` and the ``16 * nvec`` lanes ``c``, the FMA chain ``acc = fma(a[k, i],
    b[k, c], acc)`` over ``k = 0 .. K-1`` from +0, then ``out[i, c] = acc`` or, if
    ``accumulate``, ``out[i, c] + acc`` (this block added to the earlier ones). With ``sums =
    dot_sums``, the same chains on in-order bf16 pairs (a step a pair, ``a`` and ``b`` uint32).

    The listed KV rows are read where they lie, through a table of their addresses (int64),
    as one operand, so they are never copied:
    * ``by_address == "a"`` (q.k): ``tile(addr, offset, b, out, accumulate)``; ``a[k, i]`` is
      the float at ``addr[i] + 4 * (offset + k)``; K is ``b.shape[0]``. With ``prefetch``
      the rows ``addr[prefetch .. prefetch + rows - 1]`` (the next tile's, for ``prefetch ==
      rows``) are asked for one line a step.
    * ``by_address == "b"`` (P @ rows): ``tile(a, addr, offset, width, out, accumulate)``;
      ``b[k, c]`` is the float at ``addr[k] + 4 * (offset + c)`` for ``c < width`` (lanes from
      ``width`` on read nothing and hold 0); K is ``a.shape[0]``; with ``prefetch`` the row
      that many steps ahead is asked for. Only a ``masked`` tile reads
      part of a row (masked loads, slower); an unmasked one reads all its lanes and ignores
      ``width``.
    The array operands are float32 2-d views: ``a`` any strides, ``b`` and ``out`` contiguous
    rows; the caller checks the shapes. numba has no vector types, so the loop is written in
    LLVM IR: the accumulators stay in registers for the whole chain and each step is one vector
    FMA per (row, vector), as in MKL's kernel.
    """
    def codegen(context, builder, signature, values):
        ops, arrays = row_operands(context, builder, signature, values)
        n_k, load_a, load_b, o_op, accumulate = _tile_operands(builder, ops, arrays, rows, nvec,
                                                               by_address, prefetch, masked)
        acc = sums(builder, n_k, rows, nvec, load_a, load_b, unrolled=False)
        add = builder.icmp_signed("!=", accumulate, ir.Constant(accumulate.type, 0))
        for i in range(rows):
            for v in range(nvec):
                p = row_pointer(builder, o_op, i64(i), i64(64 * v), V16F)
                summed = builder.fadd(builder.load(p, align=4), acc[i][v])
                builder.store(builder.select(add, summed, acc[i][v]), p, align=4)
        return context.get_dummy_value()

    if by_address == "a":
        @intrinsic
        def tile(typingctx, addr, offset, b, out, accumulate):
            return types.void(addr, offset, b, out, accumulate), codegen
    else:
        @intrinsic
        def tile(typingctx, a, addr, offset, width, out, accumulate):
            return types.void(a, addr, offset, width, out, accumulate), codegen
    return tile


# q.k tiles for 16, 32, 48 and 64 heads, on f32 values and on pairs; the P @ rows tile.
_QK_TILES = {sums: tuple(_fma_tile(_QK_ROWS, min(nv, _QK_HEADS // 16), "a", _QK_ROWS, sums=sums)
                         for nv in (1, 2, 3, 4))
             for sums in (fma_sums, dot_sums)}
_pv_tile = _fma_tile(_PV_HEADS, _PV_COLS // 16, "b", _PV_PREFETCH)
_pv_tile_masked = _fma_tile(_PV_HEADS, _PV_COLS // 16, "b", _PV_PREFETCH, masked=True)


def _qk_tile(a, first, b, t, accumulate, nv):
    """The q.k tile of ``nv`` vectors of heads for ``b``'s layout: f32 values (float32) or pairs
    (uint32)."""


@overload(_qk_tile)
def _qk_tile_impl(a, first, b, t, accumulate, nv):
    tile1, tile2, tile3, tile4 = _QK_TILES[dot_sums if b.dtype == types.uint32 else fma_sums]

    def impl(a, first, b, t, accumulate, nv):
        if nv == 4:
            tile4(a, first, b, t, accumulate)
        elif nv == 3:
            tile3(a, first, b, t, accumulate)
        elif nv == 2:
            tile2(a, first, b, t, accumulate)
        else:
            tile1(a, first, b, t, accumulate)
    return impl


@njit(nogil=True)
def _list_rows(parts, starts, row_idx, zero_row, addr, src, pos, listed, edges):
    """One query's list, compacted: its listed rows in list order and one zero row (``listed``
    False) for each run of -1 entries inside a product block (see above). For each: ``src``
    the row (block and row in it; ``-1`` for ``zero_row``), ``pos`` its list position, ``addr``
    its address (:func:`_row_addresses`); ``edges[b]`` the first of product block b.
    ``parts`` are row blocks that stack to the KV rows, ``starts`` their first row ids.
    Returns ``(n, number listed)``."""
    W = row_idx.shape[0]
    n = 0
    n_listed = 0
    for b in range(len(edges) - 1):
        edges[b] = n
        in_gap = False
        for j in range(b * KC, min(W, (b + 1) * KC)):
            r = row_idx[j]
            if r >= 0:
                p = len(starts) - 1
                while starts[p] > r:
                    p -= 1
                src[n, 0] = p
                src[n, 1] = r - starts[p]
                listed[n] = True
                n_listed += 1
            elif in_gap:
                continue
            else:
                src[n, 0] = -1
                listed[n] = False
            in_gap = r < 0
            pos[n] = j
            n += 1
    edges[len(edges) - 1] = n
    _row_addresses(parts, src, zero_row, addr, n)
    return n, n_listed


@njit(nogil=True)
def _row_addresses(parts, src, zero_row, addr, n):
    """``addr``: the address of each of the compacted list's ``n`` rows (``src``, see
    _list_rows) in the row blocks ``parts`` (the f32 rows, or their pairs: :func:`kv_pairs`),
    and ``zero_row``'s past them (the last q.k tile reads up to 11 more: its rows, then those it
    prefetches)."""
    zero_addr = zero_row.ctypes.data
    for c in range(n):
        p = src[c, 0]
        addr[c] = zero_addr if p < 0 else parts[p].ctypes.data + src[c, 1] * parts[p].strides[0]
    addr[n:] = zero_addr


@njit(nogil=True)
def _row(parts, src, zero_row, c):
    """Row c of the compacted list (see _list_rows)."""
    p = src[c, 0]
    return zero_row if p < 0 else parts[p][src[c, 1]]


@njit(nogil=True)
def _qk_blocked(qT, addr, n, x, lo, hi, kc):
    """``x[c, h] = q_h . row_c`` for ``c < n`` and the heads ``lo .. hi - 1`` (``lo`` a multiple
    of 16; up to a multiple of 16 are computed: qT's extra columns are zero), MKL's blocked
    order over hd: ``qT [hd, hq]`` f32 values and ``addr`` the rows' (``kc = KC``), or ``qT
    [hd / 2, hq]`` in-order pairs and ``addr`` the pair rows' (``kc = KC // 2``)."""
    K = qT.shape[0]
    for d0 in range(0, K, kc):
        for h0 in range(lo, hi, _QK_HEADS):
            nv = min(_QK_HEADS // 16, (hi - h0 + 15) // 16)
            b = qT[d0:min(K, d0 + kc), h0:h0 + 16 * nv]
            for c0 in range(0, n, _QK_ROWS):
                _qk_tile(addr[c0:c0 + 2 * _QK_ROWS], d0, b, x[c0:c0 + _QK_ROWS, h0:h0 + 16 * nv],
                         d0 > 0, nv)


@njit(nogil=True)
def _dot_no_fma(qh, row, hd, peel):
    """MKL's small/gemv dot (no FMA): ``peel`` products summed first, then 4 lane sums (lane l
    takes k = peel + 4i + l, lane 0 continuing the peel's sum) reduced ``(l0 + l2) + (l1 + l3)``,
    then the leftover products one by one."""
    s0 = np.float32(0.0)
    for k in range(min(peel, hd)):
        s0 += qh[k] * row[k]
    s1 = s2 = s3 = np.float32(0.0)
    k = peel
    while k + 4 <= hd:
        s0 += qh[k] * row[k]
        s1 += qh[k + 1] * row[k + 1]
        s2 += qh[k + 2] * row[k + 2]
        s3 += qh[k + 3] * row[k + 3]
        k += 4
    r = (s0 + s2) + (s1 + s3)
    while k < hd:
        r += qh[k] * row[k]
        k += 1
    return r


@njit(nogil=True)
def _qk_small(qs, parts, src, zero_row, listed, n, x, lo, hi):
    """Heads ``lo .. hi - 1`` by the reference's 1-3 row kernels: one head alone the gemv dot, whose
    peel follows the rows' alignment (64-byte aligned, ``hd`` apart); otherwise the small dot,
    whose peel follows the query row's (q 64-byte aligned, head rows ``hd`` apart)."""
    H, hd = qs.shape
    for h in range(lo, hi):
        peel = 4 - (-hd) % 4 if H == 1 else (-(h * hd)) % 4
        for c in range(n):
            if listed[c]:
                x[c, h] = _dot_no_fma(qs[h], _row(parts, src, zero_row, c), hd, peel)


@njit(nogil=True)
def _pv_blocked(p, addr, edges, out, h_lo, h_hi, hd):
    """``out[h] = sum_c p[c, h] row_c`` for the heads ``h_lo .. h_hi - 1`` (whole tiles of
    _PV_HEADS heads from ``h_lo`` are computed), MKL's blocked order over the list: one FMA
    chain per block, blocks added in order."""
    for d0 in range(0, hd, _PV_COLS):
        for b in range(len(edges) - 1):
            lo, hi = edges[b], edges[b + 1]
            for h0 in range(h_lo, h_hi, _PV_HEADS):
                pt, o = p[lo:hi, h0:h0 + _PV_HEADS], out[h0:h0 + _PV_HEADS, d0:d0 + _PV_COLS]
                if hd - d0 >= _PV_COLS:
                    _pv_tile(pt, addr[lo:hi], d0, _PV_COLS, o, b > 0)
                else:       # the rows' last columns: the tile's lanes past them read nothing
                    _pv_tile_masked(pt, addr[lo:hi], d0, hd - d0, o, b > 0)


@njit(nogil=True)
def _pv_small(p, parts, src, zero_row, n, out, lo, hi, hd):
    """Heads ``lo .. hi - 1``: the reference's 1-3 row NN kernel, one chain over the whole list
    without FMA (each product rounded, then added)."""
    for h in range(lo, hi):
        acc = out[h]
        acc[:hd] = 0
        for c in range(n):
            w = p[c, h]
            row = _row(parts, src, zero_row, c)
            for d in range(hd):
                acc[d] += w * row[d]


def _q_pairs(qs, qP, lo, hi, bounds):
    """Heads ``lo .. hi - 1`` of one query's ``qs [H, hd]`` as in-order pairs, ``qP[p, h]``;
    returns whether their values are bf16 values within ``bounds`` (the biased exponents the
    rows allow: :func:`.numerics.fma_choice.safe_partner`; none if ``lowest > highest``), the
    pairs to be used only then. Always False where ``qP`` is not uint32 (no pairs: the rows'
    f32 values serve)."""


@overload(_q_pairs)
def _q_pairs_impl(qs, qP, lo, hi, bounds):
    if qP.dtype != types.uint32:
        return lambda qs, qP, lo, hi, bounds: False
    u32 = np.uint32

    # The range in the same pass as the pairs, as values_range takes it (magnitudes' minima
    # and maxima): calling values_range's row kernel here instead made this kernel's compile
    # 2 s longer (measured).
    def impl(qs, qP, lo, hi, bounds):
        bits = qs.view(u32)
        low_bits, largest, smallest_less_one = u32(0), u32(0), u32(0xFFFFFFFF)
        for h in range(lo, hi):
            row = bits[h]
            for p in range(qP.shape[0]):
                a, b = row[2 * p], row[2 * p + 1]
                ma, mb = a & u32(0x7FFFFFFF), b & u32(0x7FFFFFFF)
                low_bits |= (a | b) & u32(0xFFFF)
                largest = max(largest, max(ma, mb))
                smallest_less_one = min(smallest_less_one, min(u32(ma - u32(1)), u32(mb - u32(1))))
                qP[p, h] = (a & u32(0xFFFF0000)) | (b >> u32(16))
        ok, lowest, highest = magnitudes_range(low_bits, smallest_less_one, largest, u32(23))
        if not ok or bounds[0] > bounds[1]:
            return False
        return highest < lowest or bounds[0] <= lowest <= highest <= bounds[1]
    return impl


def _head_groups(S: int, H: int, workers: int) -> int:
    """Into how many groups of heads each query's work splits: one, unless there are fewer
    queries than workers (a decode step), then as many as keep the workers busy, each a multiple
    of 16 heads (the q.k tiles' columns). Every head's arithmetic is the same in any group."""
    groups = 1
    while S * groups * 2 <= workers and H % (32 * groups) == 0:
        groups *= 2
    return groups


@njit(parallel=True, nogil=True)
def _sparse_attn_kernel(q, parts, pairs, bounds, starts, idx, sink, scale, o, workers, groups):
    """:func:`sparse_attn` into ``o``: the work items are the queries, or with fewer queries than
    workers each query's ``groups`` groups of heads (:func:`_head_groups`); worker w takes the
    items w, w + workers, ..., each whole (its arithmetic does not depend on which worker runs it), in
    buffers of its own. ``pairs``: the rows as in-order pairs, q.k's operand for a query whose
    q lies within ``bounds`` (:func:`_q_pairs`); or ``parts`` again (f32 q.k throughout)."""
    S, H, hd = q.shape
    W = idx.shape[1]
    blocked = blocked_rows(H)
    n_blocks = (W + KC - 1) // KC
    hq = (H + 15) // 16 * 16                   # qT's columns: q.k tiles read 16 heads at a time
    # P's columns (a multiple of 16: rows 64-byte aligned) and the output tile's rows: P @ rows
    # tiles read and write _PV_HEADS heads at a time from a group's first head, the last up to
    # _PV_HEADS - 1 past H where _PV_HEADS does not divide the group.
    hp = (max(hq, H + _PV_HEADS - 1) + 15) // 16 * 16
    hd_pad = (hd + _PV_COLS - 1) // _PV_COLS * _PV_COLS
    cap = W + _LIST_SLACK
    for w in prange(workers):
        zero_row = np.zeros(hd_pad, np.float32)
        addr = np.zeros(cap, np.int64)
        src = np.zeros((cap, 2), np.int64)
        pos = np.zeros(cap, np.int64)
        listed = np.zeros(cap, np.bool_)
        edges = np.zeros(n_blocks + 1, np.int64)
        qT = np.zeros((hd, hq), np.float32)
        qP = np.zeros((hd // 2, hq), pairs[0].dtype)
        paddr = np.zeros(cap, np.int64)
        x = np.zeros((cap, hp), np.float32)
        acc = np.zeros((hp, hd_pad), np.float32)
        lanes = np.zeros((SOFTMAX_LANES, hp), np.float32)
        for item in range(w, S * groups, workers):
            s, g = item // groups, item % groups
            lo, hi = g * H // groups, (g + 1) * H // groups
            n, n_listed = _list_rows(parts, starts, idx[s], zero_row, addr, src, pos, listed, edges)
            if n_listed == 0:
                o[s, lo:hi] = 0
                continue
            qs = q[s]
            if _q_pairs(qs, qP, lo, hi, bounds):
                _row_addresses(pairs, src, zero_row, paddr, n)
                _qk_blocked(qP, paddr, n, x, lo, min(hi, blocked), KC // 2)
            else:
                for h in range(lo, hi):
                    for d in range(hd):
                        qT[d, h] = qs[h, d]
                _qk_blocked(qT, addr, n, x, lo, min(hi, blocked), KC)
            _qk_small(qs, parts, src, zero_row, listed, n, x, max(lo, blocked), hi)
            softmax_rows(x, pos, listed, n, W, sink, scale, lo, hi, lanes)
            _pv_blocked(x, addr, edges, acc, lo, min(hi, blocked), hd)
            _pv_small(x, parts, src, zero_row, n, acc, max(lo, blocked), hi, hd)
            for h in range(lo, hi):
                for d in range(hd):
                    o[s, h, d] = bf16_scalar(acc[h, d])


_sparse_attn_kernel_serial = serial_twin(_sparse_attn_kernel)


def _check_sparse_attn(q, kv, idx, attn_sink):
    """Shapes and index range, checked before any row is gathered: a bad entry is an error."""
    parts = tuple(kv) if isinstance(kv, (tuple, list)) else (kv,)
    if not isinstance(q, np.ndarray) or q.dtype != np.float32 or q.ndim != 3:
        raise ValueError(f"sparse_attn: q must be float32 [S, H, hd], got {getattr(q, 'shape', q)!r}")
    S, H, hd = q.shape
    for p in parts:
        if not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.ndim != 2 or p.shape[1] != hd:
            raise ValueError(f"sparse_attn: kv rows must be float32 [rows, {hd}], got "
                             f"{getattr(p, 'dtype', type(p).__name__)} {getattr(p, 'shape', '')}")
    if not isinstance(idx, np.ndarray) or idx.dtype == np.bool_ or not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"sparse_attn: idx must be an integer array, got {getattr(idx, 'dtype', idx)!r}")
    if idx.ndim != 2 or idx.shape[0] != S:
        raise ValueError(f"sparse_attn: idx must be [{S}, W], got {list(idx.shape)}")
    n_rows = sum(p.shape[0] for p in parts)
    if idx.size and (idx.min() < -1 or idx.max() >= n_rows):
        raise ValueError(f"sparse_attn: idx entries must be -1 (skip) or a row 0..{n_rows - 1}, "
                         f"got {int(idx.min())}..{int(idx.max())}")
    if np.shape(attn_sink) != (H,):
        raise ValueError(f"sparse_attn: attn_sink must be [{H}], got {list(np.shape(attn_sink))}")


#: Bounds no q meets (:func:`_q_pairs`): q.k on the f32 values.
_NO_Q = (1, 0)


def _row_parts(kv) -> tuple:
    """The KV rows as the kernel takes them: two contiguous row blocks. numba compiles each
    tuple length anew (~10 s), so one block takes an empty second and more than two are joined
    after the first."""
    parts = tuple(np.ascontiguousarray(p) for p in (kv if isinstance(kv, (tuple, list)) else (kv,)))
    if len(parts) == 1:
        return parts + (np.empty((0, parts[0].shape[1]), parts[0].dtype),)
    if len(parts) > 2:
        return (parts[0], np.concatenate(parts[1:]))
    return parts


class KvPairs(NamedTuple):
    """KV rows as q.k's bf16 pairs (:func:`kv_pairs`): ``parts``, uint32 ``[rows, hd / 2]`` for
    each of the kernel's two row blocks, and ``range``, :func:`.numerics.values_range` of them
    all."""
    parts: tuple
    range: tuple


def kv_pairs(kv, listed: int | None = None) -> KvPairs | None:
    """The KV rows ``kv`` (as :func:`sparse_attn` takes them) laid out for q.k on AVX512-BF16,
    for one or many calls on the same rows (a layer's query tiles): None where they cannot
    serve (no such tier, an odd hd, values that are not bf16 values, a denormal, inf or NaN),
    and, given ``listed`` (the list entries the calls read), where they would not pay for
    themselves: ``vdpbf16ps`` not the faster (:func:`.numerics.fma_faster`), or fewer entries
    read than rows laid out (a decode step over a long cache)."""
    parts = _row_parts(kv)
    hd, rows = parts[0].shape[1], sum(len(p) for p in parts)
    if not tier_at_least("avx512bf16") or hd % 2:
        return None
    if listed is not None and (fma_faster() or listed < rows):
        return None
    try:
        pairs = tuple(bf16_pairs(p, in_order=True) for p in parts)
    except ValueError:      # not bf16 values: q.k on the f32 values
        return None
    ranges = [values_range(p) for p in pairs]
    whole = (all(r[0] for r in ranges), min(r[1] for r in ranges), max(r[2] for r in ranges))
    return KvPairs(pairs, whole) if whole[0] else None


def sparse_attn(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, attn_sink: np.ndarray,
                softmax_scale: float, out: np.ndarray | None = None,
                pairs: KvPairs | None = None) -> np.ndarray:
    """Attention of each query over its listed KV rows, with a sink logit per head.

    ``q [S, H, hd]``, ``kv [rows, hd]`` (shared by all heads; or a tuple of row blocks that
    stack to it, e.g. the window rows and the compressed cache, so that two need not be copied
    together; a third and more are joined to the second), ``idx [S, W]`` (-1 = skip),
    ``attn_sink [H]``. Softmax in f32 over the listed scores plus the sink, which joins only
    the denominator. A query with no listed row outputs zeros. Result rounded to bf16, written
    into ``out`` (a C-contiguous float32 buffer) if given. ``pairs``: :func:`kv_pairs` of
    these rows, made once for many calls (by default made here where they pay; unused on a
    tier below ``avx512bf16``).

    Every f32 operation is the reference's, in its order (see the notes above
    ``_fma_tile``): the last bit of a score, a probability or an output is what the reference
    computes, including NaN and inf propagation. Queries are spread over
    ``numba.get_num_threads()`` workers, each query (with fewer queries than workers, each
    group of a query's heads) computed whole by one of them, so the result does not depend on
    the thread count, nor on whether q.k runs on pairs.
    """
    _check_sparse_attn(q, kv, idx, attn_sink)
    S, H, hd = q.shape
    W = idx.shape[1]
    scale = np.float32(softmax_scale)
    sink = np.ascontiguousarray(attn_sink, dtype=np.float32)
    parts = _row_parts(kv)
    if pairs is None and S:
        pairs = kv_pairs(parts, S * W)
    if pairs is not None and (not isinstance(pairs, KvPairs) or len(pairs.parts) != 2 or any(
            a.shape != (len(p), hd // 2) for a, p in zip(pairs.parts, parts))):
        raise ValueError("sparse_attn: pairs must be kv_pairs() of these kv rows")
    # One compiled kernel a tier: with AVX512-BF16 it takes pairs always, none (and bounds no q
    # meets) where there are none; below it, the f32 rows again.
    if not tier_at_least("avx512bf16"):
        pair_parts, bounds = parts, _NO_Q
    elif pairs is None:
        pair_parts, bounds = tuple(np.empty((0, hd // 2), np.uint32) for _ in parts), _NO_Q
    else:
        pair_parts, bounds = pairs.parts, safe_partner(pairs.range, hd)
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    o = output_buffer(out, (S, H, hd), "sparse_attn")       # every query's row is written below
    if S:
        threads = numba.get_num_threads()
        groups = _head_groups(S, H, threads)
        sized_call(_sparse_attn_kernel, S * groups, 2 * H // groups * W * hd,
                   np.ascontiguousarray(q), parts, pair_parts, bounds, starts,
                   np.ascontiguousarray(idx, dtype=np.int64), sink, scale, o,
                   max(1, min(S * groups, threads)), groups)
    return o
