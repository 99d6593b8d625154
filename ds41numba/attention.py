"""One compressed-attention layer for any ``compress_ratio``: ``attention_any``.

Every query attends to two sets of rows: the sliding window of the last ``window_size``
tokens (fp8-quantised KV, kept in a ring) and, for ratio > 0, the compressed positions its
index source selected (fp4 latents of the shared compressed cache). Attention is sparse over
those listed rows, with a per-head *sink* logit that absorbs probability mass without
contributing a value. The heads' outputs are projected back in ``o_groups`` independent groups
(``wo_a``) and then mixed (``wo_b``).

The forward builds what every query needs first (window rows, latents, index keys: the key
side) and then answers the queries (the index selection, then tiles run end to end), so memory
grows with ``seqlen * (dim + head_dim)`` rather than ``seqlen * heads * head_dim``. Given the
caches, any rows of a prefill's queries can be answered on their own (:func:`attention_rows`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .batch import SINGLE, checked_batch
from .compressor import compressor, latent_positions
from .indexer import IndexerCfg, index_keys, indexer
from .numerics import (MATVEC_MAX_ROWS, act_quant_fp8_inplace, bf16_scalar, fp4_quant_e4m3_inplace,
                       linear_bf16, nan_max, output_buffer, rms_norm, single_threaded_blas)
from .numerics.vector_ir import not_unrolled, prefetch as prefetch_line, wide_registers
from .rope import apply_rotary, fma_f32, yarn_freqs_cis

__all__ = ["CompAttnRun", "attention_any", "attention_rows", "sparse_attn", "window_index_rows",
           "index_rows", "output_projection", "layer_rope_table"]


@dataclass
class CompAttnRun:
    """One layer's step. ``out`` is always set; the rest only with ``capture=True``.

    ``q`` queries after RoPE ``[seqlen, H, hd]``; ``kv_rows`` the rows attention received
    (window rows, then compressed rows); ``idx`` the index rows ``[seqlen, topk]`` int32
    (window entries, then compressed entries; -1 = skip); ``o`` the attention output before
    the inverse RoPE; ``index_score`` the indexer's scores after the visibility mask (index
    sources only).
    """

    out: np.ndarray
    q: np.ndarray | None = None
    kv_rows: np.ndarray | None = None
    idx: np.ndarray | None = None
    topk: int | None = None
    o: np.ndarray | None = None
    index_score: np.ndarray | None = None


@functools.lru_cache(maxsize=4)
def _cached_table(dim, length, original_seq_len, base, factor, beta_fast, beta_slow):
    return yarn_freqs_cis(dim, length, original_seq_len, base, factor, beta_fast, beta_slow)


def layer_rope_table(config, ratio: int, end_pos: int):
    """The layer's ``(cos, sin)`` table covering positions ``0 .. end_pos - 1`` at least.

    Ratio-0 layers rotate with ``rope_theta`` and no YaRN; compressed layers with
    ``compress_rope_theta`` and YaRN. Table rows do not depend on the table's length, so a
    longer cached table serves shorter needs.
    """
    length = min(config.max_seq_len, max(1024, 1 << (max(end_pos, 1) - 1).bit_length()))
    if ratio == 0:
        return _cached_table(config.rope_head_dim, length, 0, float(config.rope_theta), 1.0, 0, 0)
    return _cached_table(config.rope_head_dim, length, config.original_seq_len,
                         float(config.compress_rope_theta), float(config.rope_factor),
                         config.beta_fast, config.beta_slow)


def window_index_rows(start_pos: int, seqlen: int, window: int,
                      prefill_len: int | None = None) -> np.ndarray:
    """Index rows into the window KV rows; -1 marks an entry to skip.

    Prefill: query t sees the new rows ``max(0, t - win + 1) ..`` (``min(seqlen, win)`` entries,
    future ones -1). Decode: the whole ring, oldest slot first, slots not yet filled -1.
    ``prefill_len``: the rows ``start_pos ..`` of a prefill of that many tokens (a chunk), as
    the one-shot prefill's rows (``min(prefill_len, win)`` entries, into its ``prefill_len`` rows).
    """
    for name, v, lo in (("start_pos", start_pos, 0), ("seqlen", seqlen, 1), ("window", window, 1)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"window_index_rows: {name} must be an integer >= {lo}, got {v!r}")
    if prefill_len is not None and not (not isinstance(prefill_len, (bool, np.bool_))
                                        and isinstance(prefill_len, (int, np.integer))
                                        and start_pos + seqlen <= prefill_len):
        raise ValueError(f"window_index_rows: prefill_len must be an integer >= "
                         f"{start_pos + seqlen}, got {prefill_len!r}")
    if prefill_len is None and start_pos > 0 and seqlen != 1:
        raise ValueError(f"window_index_rows: a decode (start_pos {start_pos} > 0) has one token, got {seqlen}")
    if start_pos == 0 or prefill_len is not None:
        n = min(seqlen if prefill_len is None else prefill_len, window)
        t = np.arange(start_pos, start_pos + seqlen)[:, None]
        pos = np.maximum(0, t - window + 1) + np.arange(n)[None, :]
        return np.where(pos > t, -1, pos).astype(np.int32)
    first = start_pos % window + 1
    slots = (np.arange(window) + first) % window
    return np.where(slots > start_pos, -1, slots).astype(np.int32)[None, :]


def index_rows(start_pos: int, seqlen: int, window: int, compressed=None,
               prefill_len: int | None = None) -> np.ndarray:
    """The index rows sparse attention receives, ``[seqlen, width]`` int32: the window entries
    (:func:`window_index_rows`), then ``compressed``, the compressed entries (the shared
    selection, offsets applied; None for a ratio-0 layer)."""
    win = window_index_rows(start_pos, seqlen, window, prefill_len)
    return win if compressed is None else np.concatenate([win, compressed], axis=1)


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

#: MKL sgemm's inner-dimension block (the blocked kernel).
_KC = 192
#: Lanes of torch's Vectorized<float> on AVX512: the softmax's sum runs 16 lane accumulators.
_LANES = 16
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
#: Entries of the address table past the list that the tiles may read.
_LIST_SLACK = max(_QK_ROWS - 1, _PV_PREFETCH)


def _fma_tile(rows, nvec, by_address, prefetch=0, masked=False):
    """An intrinsic running MKL's blocked kernel inside one block on a tile of accumulators:
    for ``i < rows`` and the ``16 * nvec`` lanes ``c``, the FMA chain ``acc = fma(a[k, i],
    b[k, c], acc)`` over ``k = 0 .. K-1`` from +0, then ``out[i, c] = acc`` or, if
    ``accumulate``, ``out[i, c] + acc`` (this block added to the earlier ones).

    The listed KV rows are read where they lie, through a table of their addresses (int64),
    as one operand, so they are never copied:
    * ``by_address == "a"`` (q.k): ``tile(addr, offset, b, out, accumulate)``; ``a[k, i]`` is
      the float at ``addr[i] + 4 * (offset + k)``; K is ``b.shape[0]``.
    * ``by_address == "b"`` (P @ rows): ``tile(a, addr, offset, width, out, accumulate)``;
      ``b[k, c]`` is the float at ``addr[k] + 4 * (offset + c)`` for ``c < width`` (lanes from
      ``width`` on read nothing and hold 0); K is ``a.shape[0]``. Only a ``masked`` tile reads
      part of a row (masked loads, slower); an unmasked one reads all its lanes and ignores
      ``width``.
    The array operands are float32 2-d views: ``a`` any strides, ``b`` and ``out`` contiguous
    rows; the caller checks the shapes. numba has no vector types, so the loop is written in
    LLVM IR: the accumulators stay in registers for the whole chain and each step is one vector
    FMA per (row, vector), as in MKL's kernel.
    """
    def codegen(context, builder, signature, values):
        i1, i8, i32, i64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
        f32 = ir.FloatType()
        v16f = ir.VectorType(f32, 16)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(v16f, [v16f] * 3), "llvm.fma.v16f32")

        def const(v):
            return ir.Constant(i64, v)

        def at(base, offset, ty):
            return builder.inttoptr(builder.add(base, offset), ty.as_pointer())

        def view(n):
            ary = context.make_array(signature.args[n])(context, builder, values[n])
            return (builder.ptrtoint(ary.data, i64), cgutils.unpack_tuple(builder, ary.strides),
                    cgutils.unpack_tuple(builder, ary.shape))

        if by_address == "a":
            addr, _, _ = view(0)
            offset = builder.mul(values[1], const(4))
            b_base, (b_k, _), (n_k, _) = view(2)
            o_base, (o_i, _), _ = view(3)
            accumulate = values[4]
            a_rows = [builder.add(builder.load(at(addr, const(8 * i), i64)), offset)
                      for i in range(rows)]

            def load_a(k, i):
                return builder.load(at(a_rows[i], builder.mul(k, const(4)), f32), align=4)

            def load_b(k):
                row = builder.add(b_base, builder.mul(k, b_k))
                return [builder.load(at(row, const(64 * v), v16f), align=4) for v in range(nvec)]
        else:
            a_base, (a_k, a_i), (n_k, _) = view(0)
            addr, _, _ = view(1)
            offset = builder.mul(values[2], const(4))
            o_base, (o_i, _), _ = view(4)
            accumulate = values[5]
            if masked:
                masked_load = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(v16f, [v16f.as_pointer(), i32, ir.VectorType(i1, 16), v16f]),
                    "llvm.masked.load.v16f32.p0v16f32")
                lane = ir.Constant(ir.VectorType(i64, 16), list(range(16)))
                width = builder.insert_element(ir.Constant(ir.VectorType(i64, 16), ir.Undefined),
                                               values[3], ir.Constant(i32, 0))
                width = builder.shuffle_vector(width, width, ir.Constant(ir.VectorType(i32, 16), None))
                masks = [builder.icmp_signed("<", builder.add(lane, ir.Constant(lane.type, [16 * v] * 16)),
                                             width)
                         for v in range(nvec)]

            def load_a(k, i):
                row = builder.add(a_base, builder.mul(k, a_k))
                return builder.load(at(row, builder.mul(a_i, const(i)), f32), align=4)

            def load_b(k):
                row = builder.add(builder.load(at(addr, builder.mul(k, const(8)), i64)), offset)
                if prefetch:
                    ahead = builder.mul(builder.add(k, const(prefetch)), const(8))
                    ahead = builder.add(builder.load(at(addr, ahead, i64)), offset)
                    for line in range(0, 64 * nvec, 64):
                        prefetch_line(builder, at(ahead, const(line), i8))
                if not masked:
                    return [builder.load(at(row, const(64 * v), v16f), align=4) for v in range(nvec)]
                return [builder.call(masked_load, [at(row, const(64 * v), v16f), ir.Constant(i32, 4),
                                                   masks[v], zero])
                        for v in range(nvec)]

        zero = ir.Constant(v16f, [ir.Constant(f32, 0.0)] * 16)
        entry = builder.basic_block
        loop = builder.append_basic_block("fmatile.loop")
        done = builder.append_basic_block("fmatile.done")
        builder.cbranch(builder.icmp_signed(">", n_k, const(0)), loop, done)

        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(const(0), entry)
        acc = [[builder.phi(v16f) for _ in range(nvec)] for _ in range(rows)]
        for row in acc:
            for x in row:
                x.add_incoming(zero, entry)
        bv = load_b(k)
        splat_mask = ir.Constant(ir.VectorType(i32, 16), None)
        new = []
        for i in range(rows):
            s = load_a(k, i)
            splat = builder.insert_element(ir.Constant(v16f, ir.Undefined), s, ir.Constant(i32, 0))
            splat = builder.shuffle_vector(splat, splat, splat_mask)
            new.append([builder.call(fma, [splat, bv[v], acc[i][v]]) for v in range(nvec)])
        k_next = builder.add(k, const(1))
        k.add_incoming(k_next, loop)
        for i in range(rows):
            for v in range(nvec):
                acc[i][v].add_incoming(new[i][v], loop)
        not_unrolled(builder.cbranch(builder.icmp_signed("<", k_next, n_k), loop, done))

        builder.position_at_end(done)
        result = [[builder.phi(v16f) for _ in range(nvec)] for _ in range(rows)]
        for i in range(rows):
            for v in range(nvec):
                result[i][v].add_incoming(zero, entry)
                result[i][v].add_incoming(new[i][v], loop)
        add = builder.icmp_signed("!=", accumulate, ir.Constant(accumulate.type, 0))
        for i in range(rows):
            for v in range(nvec):
                p = at(o_base, builder.add(builder.mul(o_i, const(i)), const(64 * v)), v16f)
                summed = builder.fadd(builder.load(p, align=4), result[i][v])
                builder.store(builder.select(add, summed, result[i][v]), p, align=4)
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


# q.k tiles for 16, 32, 48 and 64 heads; the P @ rows tile.
_qk_tile1 = _fma_tile(_QK_ROWS, 1, "a")
_qk_tile2 = _fma_tile(_QK_ROWS, 2, "a")
_qk_tile3 = _fma_tile(_QK_ROWS, 3, "a")
_qk_tile4 = _fma_tile(_QK_ROWS, _QK_HEADS // 16, "a")
_pv_tile = _fma_tile(_PV_HEADS, _PV_COLS // 16, "b", _PV_PREFETCH)
_pv_tile_masked = _fma_tile(_PV_HEADS, _PV_COLS // 16, "b", _PV_PREFETCH, masked=True)


@njit(cache=True)
def _blocked_heads(H):
    """How many of the H heads (from head 0) take MKL's blocked kernel in the reference; the
    rest take the 2-3 row kernels (the reference's 2-thread rule, see above)."""
    if H < 4:
        return 0
    if 4 < H < 12 and H % 4:
        return 4 * (H // 4)
    return H


# Sleef_expf16_u10 (Sleef 3's xexpf), torch's Vectorized<float>::exp on AVX512; its multiply-adds
# are fused (vfmadd).
_R_LN2F = np.float32(1.442695040888963407359924681001892137426645954152985934135449406931)
_L2UF = np.float32(0.693145751953125)
_L2LF = np.float32(1.428606765330187045e-06)
_EXP_C0 = np.float32(0.000198527617612853646278381)
_EXP_C1 = np.float32(0.00139304355252534151077271)
_EXP_C2 = np.float32(0.00833336077630519866943359)
_EXP_C3 = np.float32(0.0416664853692054748535156)
_EXP_C4 = np.float32(0.166666671633720397949219)
_EXP_C5 = np.float32(0.5)
# Adding and subtracting 1.5 * 2^23 rounds |t| < 2^22 to an integer, ties to even (as cvtps2dq).
_RINT_MAGIC = np.float32(12582912.0)


@njit(cache=True)
def _pow2i(e):
    """2^e as f32 for -126 <= e <= 127 (Sleef's vpow2i: the exponent field alone)."""
    return np.uint32((e + 127) << 23).view(np.float32)


@njit(cache=True)
def _expf_u10(d):
    """e^d as Sleef_expf16_u10 computes it, bit for bit (d float32)."""
    t = d * _R_LN2F
    if not abs(t) < np.float32(4096.0):
        t = np.float32(0.0)          # non-finite or far out of range: the selects below decide
    q = (t + _RINT_MAGIC) - _RINT_MAGIC
    s = fma_f32(q, -_L2UF, d)
    s = fma_f32(q, -_L2LF, s)
    u = fma_f32(_EXP_C0, s, _EXP_C1)
    u = fma_f32(u, s, _EXP_C2)
    u = fma_f32(u, s, _EXP_C3)
    u = fma_f32(u, s, _EXP_C4)
    u = fma_f32(u, s, _EXP_C5)
    u = np.float32(1.0) + fma_f32(s * s, u, s)
    qi = np.int64(q)
    h = qi >> 1
    u = (u * _pow2i(h)) * _pow2i(qi - h)
    if d < np.float32(-104.0):
        u = np.float32(0.0)
    if d > np.float32(100.0):
        u = np.float32(np.inf)
    return u


@njit(cache=True, nogil=True)
def _list_rows(parts, starts, row_idx, zero_row, addr, src, pos, listed, edges):
    """One query's list, compacted: its listed rows in list order and one zero row (``listed``
    False) for each run of -1 entries inside a product block (see above). For each: ``addr``
    the row's address, ``src`` the row (``zero_row`` for a run), ``pos`` its list position;
    ``edges[b]`` the first of product block b. ``addr`` is filled with the zero row's address
    past the end (the last q.k tile reads up to 5 more). ``parts`` are row blocks that stack to
    the KV rows, ``starts`` their first row ids. Returns ``(n, number listed)``."""
    W = row_idx.shape[0]
    zero_addr = zero_row.ctypes.data
    n = 0
    n_listed = 0
    for b in range(len(edges) - 1):
        edges[b] = n
        in_gap = False
        for j in range(b * _KC, min(W, (b + 1) * _KC)):
            r = row_idx[j]
            if r >= 0:
                p = len(starts) - 1
                while starts[p] > r:
                    p -= 1
                part = parts[p]
                addr[n] = part.ctypes.data + (r - starts[p]) * part.strides[0]
                src[n, 0] = p
                src[n, 1] = r - starts[p]
                listed[n] = True
                n_listed += 1
            elif in_gap:
                continue
            else:
                addr[n] = zero_addr
                src[n, 0] = -1
                listed[n] = False
            in_gap = r < 0
            pos[n] = j
            n += 1
    edges[len(edges) - 1] = n
    addr[n:] = zero_addr
    return n, n_listed


@njit(cache=True, nogil=True)
def _row(parts, src, zero_row, c):
    """Row c of the compacted list (see _list_rows)."""
    p = src[c, 0]
    return zero_row if p < 0 else parts[p][src[c, 1]]


@njit(cache=True, nogil=True)
def _qk_blocked(qT, addr, n, x, lo, hi):
    """``x[c, h] = q_h . row_c`` for ``c < n`` and the heads ``lo .. hi - 1`` (``lo`` a multiple
    of 16; up to a multiple of 16 are computed: qT's extra columns are zero), MKL's blocked
    order over hd."""
    hd = qT.shape[0]
    for d0 in range(0, hd, _KC):
        for h0 in range(lo, hi, _QK_HEADS):
            nv = min(_QK_HEADS // 16, (hi - h0 + 15) // 16)
            b = qT[d0:min(hd, d0 + _KC), h0:h0 + 16 * nv]
            for c0 in range(0, n, _QK_ROWS):
                a = addr[c0:c0 + _QK_ROWS]
                t = x[c0:c0 + _QK_ROWS, h0:h0 + 16 * nv]
                if nv == 4:
                    _qk_tile4(a, d0, b, t, d0 > 0)
                elif nv == 3:
                    _qk_tile3(a, d0, b, t, d0 > 0)
                elif nv == 2:
                    _qk_tile2(a, d0, b, t, d0 > 0)
                else:
                    _qk_tile1(a, d0, b, t, d0 > 0)


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def _softmax_rows(x, pos, listed, n, W, sink, scale, lo, hi, lanes):
    """In place over ``x[:n, lo:hi]`` (the dot products of the compacted list): torch's AVX512
    ``_vec_softmax_lastdim`` of each head's row ``[scores * scale (-inf at -1 entries), sink]``
    of W + 1 columns, the sink's column dropped: ``x`` becomes the probabilities.

    Max over the row (NaN wins), ``e = exp(v - max)`` (Sleef), the sum by ``vec::reduce_all``:
    16 lane sums (lane l takes the columns l, l + 16, ... in order; the last partial vector,
    the sink's column among it, joins lanes 0 ..), then lanes i + 8, i + 4, i + 2, i + 1 added
    into lane i; a row shorter than 16 is summed column by column. Then ``p = e * (1 / sum)``.
    The columns a compacted list leaves out are -1 entries: their e is +0, which leaves every
    lane sum as it is (or the whole row is NaN anyway).
    """
    m = sink.copy()
    for c in range(n):
        for h in range(lo, hi):
            v = x[c, h] * scale if listed[c] else np.float32(-np.inf)
            x[c, h] = v
            m[h] = nan_max(m[h], v)
    e_sink = np.empty(sink.shape[0], np.float32)
    for h in range(lo, hi):
        e_sink[h] = _expf_u10(sink[h] - m[h])
    for c in range(n):
        for h in range(lo, hi):
            x[c, h] = _expf_u10(x[c, h] - m[h])
    total = np.zeros(sink.shape[0], np.float32)
    if W + 1 < _LANES:
        for c in range(n):
            for h in range(lo, hi):
                total[h] += x[c, h]
        for h in range(lo, hi):
            total[h] += e_sink[h]
    else:
        lanes[:, lo:hi] = 0
        for c in range(n):
            lane = lanes[pos[c] % _LANES]
            for h in range(lo, hi):
                lane[h] += x[c, h]
        lane = lanes[W % _LANES]
        for h in range(lo, hi):
            lane[h] += e_sink[h]
        half = _LANES // 2
        while half:
            for i in range(half):
                for h in range(lo, hi):
                    lanes[i, h] += lanes[i + half, h]
            half //= 2
        total[lo:hi] = lanes[0, lo:hi]
    for h in range(lo, hi):
        total[h] = np.float32(1.0) / total[h]
    for c in range(n):
        for h in range(lo, hi):
            x[c, h] *= total[h]


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


def _head_groups(S: int, H: int, workers: int) -> int:
    """Into how many groups of heads each query's work splits: one, unless there are fewer
    queries than workers (a decode step), then as many as keep the workers busy, each a multiple
    of 16 heads (the q.k tiles' columns). Every head's arithmetic is the same in any group."""
    groups = 1
    while S * groups * 2 <= workers and H % (32 * groups) == 0:
        groups *= 2
    return groups


@njit(parallel=True, cache=True, nogil=True)
def _sparse_attn_kernel(q, parts, starts, idx, sink, scale, o, workers, groups):
    """:func:`sparse_attn` into ``o``: the work items are the queries, or with fewer queries than
    workers each query's ``groups`` groups of heads (:func:`_head_groups`); worker w takes the
    items w, w + workers, ..., each whole (its arithmetic does not depend on which worker runs it), in
    buffers of its own."""
    S, H, hd = q.shape
    W = idx.shape[1]
    blocked = _blocked_heads(H)
    n_blocks = (W + _KC - 1) // _KC
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
        x = np.zeros((cap, hp), np.float32)
        acc = np.zeros((hp, hd_pad), np.float32)
        lanes = np.zeros((_LANES, hp), np.float32)
        for item in range(w, S * groups, workers):
            s, g = item // groups, item % groups
            lo, hi = g * H // groups, (g + 1) * H // groups
            n, n_listed = _list_rows(parts, starts, idx[s], zero_row, addr, src, pos, listed, edges)
            if n_listed == 0:
                o[s, lo:hi] = 0
                continue
            qs = q[s]
            for h in range(lo, hi):
                for d in range(hd):
                    qT[d, h] = qs[h, d]
            _qk_blocked(qT, addr, n, x, lo, min(hi, blocked))
            _qk_small(qs, parts, src, zero_row, listed, n, x, max(lo, blocked), hi)
            _softmax_rows(x, pos, listed, n, W, sink, scale, lo, hi, lanes)
            _pv_blocked(x, addr, edges, acc, lo, min(hi, blocked), hd)
            _pv_small(x, parts, src, zero_row, n, acc, max(lo, blocked), hi, hd)
            for h in range(lo, hi):
                for d in range(hd):
                    o[s, h, d] = bf16_scalar(acc[h, d])


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


def sparse_attn(q: np.ndarray, kv: np.ndarray, idx: np.ndarray, attn_sink: np.ndarray,
                softmax_scale: float, out: np.ndarray | None = None) -> np.ndarray:
    """Attention of each query over its listed KV rows, with a sink logit per head.

    ``q [S, H, hd]``, ``kv [rows, hd]`` (shared by all heads; or a tuple of row blocks that
    stack to it, e.g. the window rows and the compressed cache, so that they need not be copied
    together), ``idx [S, W]`` (-1 = skip), ``attn_sink [H]``. Softmax in f32 over the listed
    scores plus the sink, which joins only the denominator. A query with no listed row outputs
    zeros. Result rounded to bf16, written into ``out`` (a C-contiguous float32 buffer) if given.

    Every f32 operation is the reference's, in its order (see the notes above
    ``_fma_tile``): the last bit of a score, a probability or an output is what the reference
    computes, including NaN and inf propagation. Queries are spread over
    ``numba.get_num_threads()`` workers, each query (with fewer queries than workers, each
    group of a query's heads) computed whole by one of them, so the result does not depend on
    the thread count.
    """
    _check_sparse_attn(q, kv, idx, attn_sink)
    S, H, hd = q.shape
    scale = np.float32(softmax_scale)
    sink = np.ascontiguousarray(attn_sink, dtype=np.float32)
    parts = tuple(np.ascontiguousarray(p) for p in (kv if isinstance(kv, (tuple, list)) else (kv,)))
    starts = np.cumsum([0] + [len(p) for p in parts[:-1]]).astype(np.int64)
    o = output_buffer(out, (S, H, hd), "sparse_attn")       # every query's row is written below
    if S:
        threads = numba.get_num_threads()
        groups = _head_groups(S, H, threads)
        _sparse_attn_kernel(np.ascontiguousarray(q), parts, starts,
                            np.ascontiguousarray(idx, dtype=np.int64), sink, scale, o,
                            max(1, min(S * groups, threads)), groups)
    return o


def output_projection(o: np.ndarray, wo_a, wo_b, out=None, mid=None,
                      ref_rows: int | None = None) -> np.ndarray:
    """Grouped low-rank output projection: ``o [S, H*hd]`` through ``wo_a``, a grouped
    :class:`Bf16Matrix` (head group g through its own block of rows), then through ``wo_b``.
    ``out`` and ``mid`` optionally take the result and the low-rank intermediate (buffers a
    tiled loop reuses); ``ref_rows`` is the step's length when ``o`` is one tile of it (the
    reference's summation order depends on it, see ``linear_bf16``)."""
    return linear_bf16(linear_bf16(o, wo_a, mid, ref_rows), wo_b, out, ref_rows)


def _default_tile(seqlen: int) -> int:
    """Queries per tile: enough rows for the projections to run at BLAS speed."""
    return max(1, min(1024, seqlen))


def _window_kv(config, weights, x, positions, table, ref_rows):
    """The KV rows of ``x`` as the window holds them: normed, rotated and fp8-quantised, each row
    on its own (the products' order is chosen by ``ref_rows``, not by how many rows ``x`` has)."""
    kv = rms_norm(linear_bf16(x, weights.wkv, ref_rows=ref_rows), weights.kv_norm, config.norm_eps)
    return act_quant_fp8_inplace(apply_rotary(kv, positions, table, inplace=True))


def _window_rows(config, weights, state, x, start_pos, positions, table, prefill_len, batch):
    """This step's window: the KV rows attention reads, the offset, and the first position
    those rows stand for.

    A prefill attends to all its new rows and the ring keeps the last ``window_size`` of them;
    a decode step writes its row into the ring and attends to the whole ring. The offset is the
    number of window rows, which the compressed entries of an index row are shifted by. A chunk
    of a prefill (``prefill_len``, start_pos > 0) attends to the ring's rows of the ``win - 1``
    positions before it, then its own rows; its index rows are the one-shot prefill's (offset
    ``prefill_len``), which :func:`_local_rows` maps onto these rows.
    """
    seqlen, win = x.shape[0], config.window_size
    decode = prefill_len is None and start_pos > 0
    ref_rows = 1 if decode else (seqlen if prefill_len is None else prefill_len)
    kv = _window_kv(config, weights, x, positions, table, batch.rows(ref_rows))
    if decode:
        state.window_kv[start_pos % win] = kv[0]
        return state.window_kv.copy(), win, 0
    first = max(0, start_pos - win + 1)
    # Read the earlier positions before this chunk's rows overwrite their slots.
    earlier = state.window_kv[np.arange(first, start_pos) % win]
    keep = min(seqlen, win)
    state.window_kv[positions[-keep:] % win] = kv[-keep:]
    rows = np.concatenate([earlier, kv]) if len(earlier) else kv
    return rows, ref_rows, first


def _local_rows(idx, first, offset, window_rows, n_window):
    """``idx`` (the one-shot prefill's index rows: window entries are positions, compressed ones
    shifted by ``offset``) as rows of what a chunk attends to: its ``window_rows`` window rows
    (positions ``first ..``), then the compressed rows."""
    out = idx.copy()
    win, comp = out[:, :n_window], out[:, n_window:]
    win[win >= 0] -= first
    comp[comp >= 0] += window_rows - offset
    return out


def _update_caches(config, layer_id, weights, state, shared, x, start_pos, table, prefill_len,
                   batch):
    """Steps 4-5 for a ratio > 0 layer, the *key side*: compress, write the index keys and the
    fp4 latents into the layer's caches, publish them in the shared slots. What the queries then
    read depends on this step's rows only through those caches. ``prefill_len``: the step is a
    chunk of a prefill that long."""
    c = config
    seqlen = x.shape[0]
    r = c.ratio(layer_id)
    chunk = prefill_len is not None
    first_row = start_pos // r
    latents = lpos = None
    if c.is_kv_source(layer_id):
        latents = compressor(x, start_pos, r, weights.compressor, state.compressor, c.norm_eps,
                             prefill_len=prefill_len, batch=batch)
        lpos = latent_positions(start_pos, seqlen, r, prefill=chunk or start_pos == 0)
    # A prefill's key owner publishes when the prefill writes keys, whichever chunk this is.
    writes = latents is not None or (chunk and prefill_len >= r)
    if c.is_key_owner(layer_id) and writes:
        # The key owner publishes its cache only on a step that wrote keys: otherwise the slot
        # keeps the previous writer's cache (even another ratio's), as in the reference, and
        # this layer scores against that.
        if latents is not None:
            keys = index_keys(latents, lpos, weights.indexer, table, c.norm_eps,
                              ref_rows=batch.rows(prefill_len // r if chunk else len(latents)))
            state.index_cache.write(first_row, keys)
        shared.index_k = state.index_cache
    if latents is not None:
        lat = fp4_quant_e4m3_inplace(apply_rotary(latents, lpos, table, inplace=True))
        state.compress_cache[first_row:first_row + len(lat)] = lat
    if c.is_kv_source(layer_id):
        shared.compress_kv = state.compress_cache


def _select(config, layer_id, weights, shared, x, qr, start_pos, table, offset, capture,
            prefill_len, batch):
    """Step 6 for an index source: each query's compressed positions, published as the shared
    selection (and, at the candidate source, the candidate blocks); returns the scores with
    ``capture``."""
    c = config
    seqlen = x.shape[0]
    r = c.ratio(layer_id)
    chunk = prefill_len is not None
    ref_width = (prefill_len if chunk else start_pos + seqlen) // r
    if ref_width == 0:
        shared.topk_idxs = np.zeros((seqlen, 0), np.int32)
        return None
    cands = shared.candidate_blocks if c.uses_candidates(layer_id) else None
    shared.topk_idxs, published, index_score = indexer(
        x, qr, start_pos, IndexerCfg.for_layer(c, layer_id), weights.indexer, table,
        shared.index_k, offset, candidate_blocks=cands, capture=capture,
        prefill_len=prefill_len, observer=shared.observer, batch=batch)
    if published is not None:
        shared.candidate_blocks = published
        shared.candidate_width = ref_width
        shared.candidate_block_size = c.candidate_block_size
    return index_score


def attention_any(config, layer_id: int, weights, state, shared, x: np.ndarray, start_pos: int,
                  capture: bool = False, tile: int | None = None,
                  prefill_len: int | None = None, queries: bool = True,
                  batch=SINGLE) -> CompAttnRun | None:
    """One layer's forward for any ratio; updates ``state`` and the ``shared`` slots.

    Inputs are assumed valid (``AttentionStack.forward`` checks them). The *key side* runs
    first (window rows, latents, index keys: the layer's state and caches); then the *query
    side*: the index selection, and the queries in tiles (projection, RoPE, sparse attention,
    inverse RoPE, output projection). ``queries=False`` stops after the key side and returns
    None: a distributed run fills the caches so and runs the queries elsewhere
    (:func:`attention_rows`). A decode step's products are all small, and BLAS's threads would
    only contend with the numba kernels between them: BLAS runs single-threaded for it.

    ``prefill_len``: ``x`` is rows ``start_pos ..`` of a prefill of that many tokens, the
    previous chunk (if any) ended at ``start_pos``; every result is the one-shot prefill's rows.

    ``batch`` (a :class:`~ds41numba.batch.BatchRow`): ``x`` is one sequence of a batch run in
    lockstep, ``state`` and ``shared`` that sequence's; every projection sums as the batch's
    product over B times the step's rows does (:mod:`ds41numba.batch` says which products see
    the batch and which are per row or per query).
    """
    batch = checked_batch(batch, "attention_any")
    if x.shape[0] <= MATVEC_MAX_ROWS:
        with single_threaded_blas():
            return _attention_step(config, layer_id, weights, state, shared, x, start_pos,
                                   capture, tile, prefill_len, queries, batch)
    return _attention_step(config, layer_id, weights, state, shared, x, start_pos, capture, tile,
                           prefill_len, queries, batch)


def _attention_step(config, layer_id, weights, state, shared, x, start_pos, capture, tile,
                    prefill_len=None, queries=True, batch=SINGLE):
    c = config
    seqlen = x.shape[0]
    positions = np.arange(start_pos, start_pos + seqlen, dtype=np.int64)
    table = layer_rope_table(c, c.ratio(layer_id), start_pos + seqlen)
    window = _window_rows(c, weights, state, x, start_pos, positions, table, prefill_len, batch)
    if c.ratio(layer_id) > 0:
        _update_caches(c, layer_id, weights, state, shared, x, start_pos, table, prefill_len,
                       batch)
    if not queries:
        return None
    return _answer_queries(c, layer_id, weights, shared, x, start_pos, window, table, capture,
                           tile, prefill_len, batch)


def attention_rows(config, layer_id: int, weights, shared, x: np.ndarray, first_row: int,
                   prefill_len: int, tile: int | None = None) -> CompAttnRun:
    """The *query side* of rows ``first_row ..`` of a prefill of ``prefill_len`` tokens, given
    the caches its key side filled (``shared.compress_kv``, ``shared.index_k`` as layer
    ``layer_id``'s prefill finds them, at least up to these rows' end) and, for a layer that
    reads another's, the rows of the shared selection (``shared.topk_idxs``) and candidate blocks
    the same rows of its sources got. ``x`` holds the input rows from ``max(0, first_row -
    window_size + 1)`` on: the earlier ones give the window's KV rows, which are recomputed
    rather than shipped.

    The rows are the one-shot prefill's, bit for bit, whoever runs them and in whatever pieces:
    a distributed run (:mod:`ds41numba.golden.cluster`) spreads a layer's query tiles over
    workers this way. ``shared`` receives the rows' own selection at an index source.
    """
    c = config
    first, n = _check_rows(c, layer_id, shared, x, first_row, prefill_len)
    table = layer_rope_table(c, c.ratio(layer_id), first_row + n)
    positions = np.arange(first, first_row + n, dtype=np.int64)
    kv = _window_kv(c, weights, x, positions, table, prefill_len)
    with_history = (kv, prefill_len, first)
    return _answer_queries(c, layer_id, weights, shared, x[first_row - first:], first_row,
                           with_history, table, False, tile, prefill_len)


def _check_rows(c, layer_id, shared, x, first_row, prefill_len) -> tuple[int, int]:
    """:func:`attention_rows`' arguments checked: ``(first position x holds, rows answered)``."""
    def bad(msg):
        raise ValueError(f"attention_rows: {msg}")

    for name, v in (("first_row", first_row), ("prefill_len", prefill_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            bad(f"{name} must be an int, got {type(v).__name__}")
    if not (isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[1] == c.dim
            and (x.dtype == np.float32 or x.dtype.name == "bfloat16")):
        bad(f"x must be [rows, {c.dim}] float32 (bf16 values) or bfloat16, got "
            f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', ()))}")
    first = max(0, first_row - c.window_size + 1)
    n = x.shape[0] - (first_row - first)
    if first_row < 0 or n < 1 or first_row + n > prefill_len:
        bad(f"rows {first_row}..{first_row + n - 1} do not lie in a prefill of {prefill_len} "
            f"tokens (x holds {x.shape[0]} rows from position {first})")
    r = c.ratio(layer_id)
    if r:
        need = (first_row + n) // r
        kv = shared.compress_kv
        if kv is None or kv.shape[0] < need:
            bad(f"layer {layer_id} reads {need} compressed rows, shared.compress_kv holds "
                f"{0 if kv is None else kv.shape[0]}")
        if c.is_index_source(layer_id) and prefill_len // r and shared.index_k is None:
            bad(f"layer {layer_id} scores against the index keys: shared.index_k is None")
        if not c.is_index_source(layer_id) and (shared.topk_idxs is None
                                                or shared.topk_idxs.shape[0] != n):
            bad(f"layer {layer_id} reuses its index source's selection: shared.topk_idxs must "
                f"hold these {n} rows")
    return first, n


def _answer_queries(c, layer_id, weights, shared, x, start_pos, window, table, capture, tile,
                    prefill_len, batch=SINGLE):
    """Steps 6-9, the *query side*: the index selection, then the queries in tiles (projection,
    RoPE, sparse attention over the window and the selected compressed rows, inverse RoPE,
    output projection). ``window`` is :func:`_window_rows`'s ``(rows, offset, first)``."""
    seqlen = x.shape[0]
    H, hd = c.n_heads, c.head_dim
    r = c.ratio(layer_id)
    positions = np.arange(start_pos, start_pos + seqlen, dtype=np.int64)
    # The reference's rows of every product: the whole prefill (a chunk's too), 1 at decode;
    # times B in a batch.
    ref_rows = batch.rows(prefill_len if prefill_len is not None else
                          (seqlen if start_pos == 0 else 1))
    window, offset, first = window

    qr = rms_norm(linear_bf16(x, weights.wq_a, ref_rows=ref_rows), weights.q_norm, c.norm_eps)
    kv_rows, idx_comp, index_score = (window,), None, None
    if r > 0:
        if c.is_index_source(layer_id):
            index_score = _select(c, layer_id, weights, shared, x, qr, start_pos, table, offset,
                                  capture, prefill_len, batch)
        kv_rows = (window, shared.compress_kv[:(start_pos + seqlen) // r])
        idx_comp = shared.topk_idxs
    idx = index_rows(start_pos, seqlen, c.window_size, idx_comp, prefill_len)
    attend = idx
    if prefill_len is not None and (first or len(window) != offset):
        attend = _local_rows(idx, first, offset, len(window), min(prefill_len, c.window_size))

    out = np.empty((seqlen, c.dim), np.float32)
    q_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    o_cap = np.empty((seqlen, H, hd), np.float32) if capture else None
    step = tile or _default_tile(seqlen)
    # One set of tile buffers for every tile (fresh arrays this size cost page faults each time).
    q_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    o_buf = np.empty((min(step, seqlen), H, hd), np.float32)
    mid_buf = np.empty((min(step, seqlen), weights.wo_a.shape[0]), np.float32)
    for s0 in range(0, seqlen, step):
        s1 = min(seqlen, s0 + step)
        n = s1 - s0
        q = linear_bf16(qr[s0:s1], weights.wq_b, out=q_buf[:n], ref_rows=ref_rows).reshape(n, H, hd)
        q = apply_rotary(q, positions[s0:s1], table, inplace=True)
        o = sparse_attn(q, kv_rows, attend[s0:s1], weights.attn_sink, hd ** -0.5, out=o_buf[:n])
        if capture:
            q_cap[s0:s1] = q
            o_cap[s0:s1] = o
        if shared.observer is not None:   # golden captures (SharedRuntime.observer)
            shared.observer.attention_tile(s0, q, o, kv_rows, attend[s0:s1])
        o = apply_rotary(o, positions[s0:s1], table, inverse=True, inplace=True)
        output_projection(o.reshape(n, H * hd), weights.wo_a, weights.wo_b, out=out[s0:s1],
                          mid=mid_buf[:n], ref_rows=ref_rows)
    if not capture:
        # The index rows are small ([seqlen, win + topk]) and a chunk's cannot be rebuilt from
        # the step alone: always returned.
        return CompAttnRun(out=out, idx=idx, topk=idx.shape[1])
    return CompAttnRun(out=out, q=q_cap, kv_rows=np.concatenate(kv_rows), idx=idx,
                       topk=idx.shape[1], o=o_cap, index_score=index_score)
