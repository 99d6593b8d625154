"""Linear projections as the reference computes them: bf16 weights (``Bf16Matrix``, its bf16
linear ``linear_bf16``) and the ratio > 1 compressor's f32 weights (``linear_f32``), each summed
in the reference's own order where that order is known (docs/exactness.md).
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
from numba import prange

from ..jit import njit
from .backend import tier_at_least
from .bf16_dot import DOT_LANES, DOT_ROWS, gemm_bf16_sized
from .bf16_layouts import bf16_pairs
from .fma_choice import fma_faster, fma_safe, values_range
from .f32_products import F32Matrix, linear_f32_ordered
from .formats import (ELEMENT_COST, as_f32_array, bf16_halves, is_bf16_valued, is_int,
                      output_buffer, round_bf16_inplace)
from .matvec import MATVEC_MEMBERS, matvec_beside, matvec_into, pair_hi, pair_lo
from .workers import can_work_beside, serial_twin, sized_call

__all__ = ["linear_bf16", "linear_bf16_beside", "linear_f32", "Bf16Matrix", "SharedInput",
           "MATVEC_MAX_ROWS", "TINY_BF16_LINEAR", "BESIDE_MIN_BYTES", "bf16_k_block"]



def _check_linear(x, w, name):
    x = np.asarray(x)
    if x.dtype.name != "bfloat16":
        x = as_f32_array(x, f"{name}: x")
    w = as_f32_array(w, f"{name}: w")
    if w.ndim != 2:
        raise ValueError(f"{name}: w must be 2-D [out, in], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{name}: x of shape {x.shape} does not match w of shape {w.shape} ([out, in])")
    return x, w


# Rows of a bfloat16 input widened to float32 at a time: the f32 copy of a long input would
# otherwise be the largest array of a long prefill.
_WIDEN_ROWS = 4096


def linear_f32(x, w, out=None, ref_rows: int | None = None, first_row: int = 0):
    """``x @ w.T`` in f32, f32 result (the ratio > 1 compressor's projections).

    With w an :class:`~ds41numba.f32_products.F32Matrix` the sums follow the reference's own
    order (its MKL sgemm, :func:`~ds41numba.f32_products.linear_f32_ordered`) for a call of
    ``ref_rows`` rows (default: x's) of which x holds rows ``first_row ..`` (a chunk of a
    prefill: the reference's kernel for each row is chosen by the whole prefill's M); a plain
    float32 ``w [out, in]`` goes through numpy's f32 BLAS, in BLAS's order.
    x is ``[..., in]``, float32 or ``ml_dtypes.bfloat16`` (widened exactly, a block of rows at a
    time); returns ``[..., out]`` float32, written into ``out`` when given.
    """
    ordered = isinstance(w, F32Matrix)
    x, w32 = _check_linear(x, w.f32 if ordered else w, "linear_f32")
    x2 = x.reshape(-1, w32.shape[1])
    y = output_buffer(out, (x2.shape[0], w32.shape[0]), "linear_f32")
    ref_m = x2.shape[0] if ref_rows is None else ref_rows
    # A plain w pads a few rows standing for a longer call (ref_rows given) for BLAS.
    blas_ref = 1 if ref_rows is None else ref_rows
    product = ((lambda a, b, r0: linear_f32_ordered(a, w, out=b, ref_rows=ref_m,
                                                    first_row=first_row + r0)) if ordered
               else (lambda a, b, r0: _blas_product(a, w32, b, blas_ref)))
    if x.dtype == np.float32:
        product(x2, y, 0)
    else:
        # Each block says which rows of the call it holds, so every row keeps its kernel.
        for a in range(0, x2.shape[0], _WIDEN_ROWS):
            b = min(x2.shape[0], a + _WIDEN_ROWS)
            product(x2[a:b].astype(np.float32), y[a:b], a)
    return y.reshape(x.shape[:-1] + (w32.shape[0],))


# OpenBLAS sums a product of few rows (one row: its gemv; a few: its small-matrix kernels) in
# another order than the same rows of a longer product. A BLAS product that stands for a call of
# more than MATVEC_MAX_ROWS rows (a prefill's tile, a chunk of it) runs on at least this many
# rows, zero-padded, so each row's sum does not depend on how the rows were tiled or chunked
# (checked bit for bit at the presets' and the goldens' shapes).
_BLAS_MIN_ROWS = 64


def _blas_product(x2, w32, y, ref_rows):
    """``y = x2 @ w32.T`` through numpy's BLAS, padded as ``_BLAS_MIN_ROWS`` says."""
    m = x2.shape[0]
    # inf and NaN propagate as in the reference (torch does not warn): an f32 sum that overflows
    # is inf, inf - inf is NaN; 0 * inf in the padding rows is dropped with them.
    with np.errstate(over="ignore", invalid="ignore"):
        if m >= _BLAS_MIN_ROWS or ref_rows <= MATVEC_MAX_ROWS or m == 0:
            np.matmul(x2, w32.T, out=y)
            return
        padded = np.zeros((_BLAS_MIN_ROWS, x2.shape[1]), np.float32)
        padded[:m] = x2
        y[...] = np.matmul(padded, w32.T)[:m]


def linear_bf16(x, w, out=None, ref_rows: int | None = None):
    """bf16 linear: ``x @ w.T`` (w holds bf16 values) summed in f32, rounded to bf16 once.

    x is ``[..., in]``; w is ``[out, in]``, a float32 array or a :class:`Bf16Matrix` (which may
    be grouped: see there). With a :class:`Bf16Matrix` the sums follow the reference's order
    (:func:`bf16_k_block`) for a call of ``ref_rows`` rows (default: the rows of x; a tiled
    loop passes the length of the whole step): at most ``MATVEC_MAX_ROWS`` rows (a decode step)
    through the kernel that reads the held bf16 pairs a row at a time, more rows of bf16 values
    through :meth:`Bf16Matrix.dot_bf16` (AVX512-BF16, or its FMA twin on any CPU). For a plain
    float32 ``w``, or x not bf16-valued, numpy's f32 BLAS sums in its own order: approximate
    (docs/exactness.md). So do products of at most ``TINY_BF16_LINEAR``
    multiply-adds per group, which torch does not hand to oneDNN but sums in a kernel of its
    own (an order not pinned down; they occur only at toy shapes, where BLAS reproduces the
    reference's goldens).
    Returns ``[..., out]``, written into ``out`` (a C-contiguous float32 buffer) when given.
    """
    if not isinstance(w, Bf16Matrix):
        return round_bf16_inplace(linear_f32(x, w, out))
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] != w.in_features:
        raise ValueError(f"linear_bf16: x of shape {x.shape} does not match a weight taking "
                         f"{w.in_features} inputs")
    rows = x.size // max(x.shape[-1], 1)
    n_out, k_in = w.shape
    shape = x.shape[:-1] + (n_out,)
    ref_m = rows if ref_rows is None else ref_rows
    if _decode_kernel(w, rows, ref_rows):
        if out is None:
            return w.matvec(x, ref_rows)
        y = output_buffer(out, shape, "linear_bf16")
        y[...] = w.matvec(x, ref_rows)
        return y
    if _ordered(w, ref_m):
        y = output_buffer(out, (rows, n_out), "linear_bf16")
        if w.dot_bf16(x.reshape(rows, w.in_features), y, ref_rows):
            return round_bf16_inplace(y).reshape(shape)
    # numpy's BLAS: the weight widened for this call only (each group once).
    if w.groups == 1:
        return round_bf16_inplace(linear_f32(x, w.to_f32(), out, ref_rows=ref_m))
    per_group = x.reshape(-1, w.groups, k_in)
    rank = n_out // w.groups
    y = output_buffer(out, (rows, n_out), "linear_bf16")
    for g in range(w.groups):
        linear_f32(per_group[:, g], w.to_f32(g), out=y[:, g * rank:(g + 1) * rank], ref_rows=ref_m)
    return round_bf16_inplace(y).reshape(shape)


def _ordered(w, ref_rows: int) -> bool:
    """Whether the reference sums ``w``'s product of a call of ``ref_rows`` rows in oneDNN's
    order (``TINY_BF16_LINEAR``)."""
    return ref_rows * (w.shape[0] // w.groups) * w.shape[1] > TINY_BF16_LINEAR


def _decode_kernel(w, rows: int, ref_rows: int | None) -> bool:
    """Whether :func:`linear_bf16` multiplies ``rows`` rows of a call of ``ref_rows`` by the
    :class:`Bf16Matrix` ``w`` on the decode kernel (:meth:`Bf16Matrix.matvec`). The kernel is
    chosen by the reference's rows, not ours: a few rows of a long prefill (a tile's tail, a
    short chunk) run on the kernel its other rows run on."""
    ref_m = rows if ref_rows is None else ref_rows
    return _ordered(w, ref_m) and 0 < rows and ref_m <= MATVEC_MAX_ROWS


#: The smallest weight :func:`linear_bf16_beside` reads beside other work: handing a product to
#: the helper thread and back costs tens of microseconds, and a weight of 8 MB takes about
#: 0.3 ms to read (27 GB/s, 2 cores of the Zen 4).
BESIDE_MIN_BYTES = 8 << 20


@contextlib.contextmanager
def linear_bf16_beside(x, w, ref_rows: int | None = None):
    """:func:`linear_bf16` ``(x, w, ref_rows=ref_rows)`` beside the ``with`` block, where that
    pays: a decode step's product (the decode kernel's rows) of a :class:`Bf16Matrix` of at
    least ``BESIDE_MIN_BYTES``, with two or more numba threads. The weight is then read on a
    helper thread while the block runs on this one, and the block's numba kernels on one
    thread (:func:`~.matvec.matvec_beside`): a decode step's reading of its largest weight
    goes on while the indexer computes. The context's value is the product ``[..., out]``,
    complete when the block ends; None where it does not pay (the caller multiplies as
    usual). The same bits either way."""
    x = np.asarray(x)
    rows = x.size // max(x.shape[-1], 1) if x.ndim else 0
    if not (isinstance(w, Bf16Matrix) and x.ndim >= 1 and x.shape[-1] == w.in_features
            and _decode_kernel(w, rows, ref_rows) and w.nbytes >= BESIDE_MIN_BYTES
            and can_work_beside()):
        yield None
        return
    x2, block = w._matvec_input(x, ref_rows)
    out = np.empty((x2.shape[0], w.shape[0]), np.float32)
    with matvec_beside(x2, (w._pairs,), (w.groups,), w.shape[1], block, (out,)):
        yield out.reshape(x.shape[:-1] + (w.shape[0],))


def bf16_k_block(ref_rows: int, k: int) -> int:
    """How many inner-dimension elements the reference's bf16 linear sums in one run.

    torch's CPU bf16 linear (oneDNN's brgemm on AVX512-BF16) splits K into runs, sums each
    from zero with ``vdpbf16ps`` (each pair as ``(acc + p[2i+1]) + p[2i]``) and adds the run
    sums in order (docs/exactness.md, measured on the reference's machine):
    K <= 512 one run; one row (every decode step) runs of 512; two or more rows runs of 512 up
    to K = 1024 and of 1024 above. ``ref_rows`` is the number of rows the *reference* multiplies
    in that call (a prefill's length, 1 at decode), not the rows of a tile of ours.
    """
    if k <= 512:
        return k
    return 512 if ref_rows == 1 or k <= 1024 else 1024


# ----------------------------------------------------------------------------------------------
# bf16 weights held once, as pairs
# ----------------------------------------------------------------------------------------------

# A Bf16Matrix holds its weight once, in the AVX512-BF16 kernel's B layout (pack_bf16_pairs):
# uint32 [groups * blocks, ceil(in / 2), DOT_LANES], lane j of block b holding output row
# b * DOT_LANES + j of its group, pair p its inputs 2p (low half) and 2p + 1 (high half; zero
# past an odd K). Every other use (the decode kernel, BLAS) reads or widens that one copy.

#: At most this many input rows take the decode kernel (:meth:`Bf16Matrix.matvec`); more the
#: many-row product.
MATVEC_MAX_ROWS = 8
#: bf16 products of at most this many multiply-adds (M * N * K, per group) are not oneDNN's in
#: the reference but torch's own kernel (docs/exactness.md: "about 4096"; the toy
#: goldens agree: their 2,048-MAC decode products follow BLAS, their 8,192-MAC ones oneDNN).
TINY_BF16_LINEAR = 4096
# Rows of the caller's weight converted to bf16 bits at a time while packing: the only
# temporary of a construction.
_PACK_ROWS = 1024


@njit(parallel=True)
def _pack_bits(bits, out, first):
    """bf16 bit rows ``bits [n, k]`` (uint16) into lanes ``first ..`` of ``out [blocks, ceil(k/2),
    DOT_LANES]``; the high half of an odd k's last pair stays zero."""
    k = bits.shape[1]
    for i in prange(bits.shape[0]):
        r = first + i
        blk, lane = out[r // DOT_LANES], r % DOT_LANES
        for p in range(k // 2):
            hi = np.uint32(bits[i, 2 * p + 1]) << np.uint32(16)
            blk[p, lane] = np.uint32(bits[i, 2 * p]) | hi
        if k % 2:
            blk[k // 2, lane] = np.uint32(bits[i, k - 1])


_pack_bits_serial = serial_twin(_pack_bits)


# Pairs widened at a time per block: a block's panel of them (4 KB) stays in L1 while each of
# its rows is written out contiguously.
_WIDEN_PAIRS = 32


@njit(parallel=True)
def _widen_pairs(pairs, k_in, out):
    """``out [rows, k_in]`` float32: rows ``0 .. rows - 1`` of the blocks ``pairs [blocks, ceil(k_in
    / 2), DOT_LANES]`` (their first lanes), each value exactly the bf16 it holds."""
    rows = out.shape[0]
    both = k_in // 2
    for b in prange(-(-rows // DOT_LANES)):
        lanes = min(DOT_LANES, rows - b * DOT_LANES)
        for p0 in range(0, both, _WIDEN_PAIRS):
            p1 = min(both, p0 + _WIDEN_PAIRS)
            for j in range(lanes):
                row = out[b * DOT_LANES + j]
                for p in range(p0, p1):
                    pair = pairs[b, p, j]
                    row[2 * p] = pair_lo(pair)
                    row[2 * p + 1] = pair_hi(pair)
        if k_in % 2:
            for j in range(lanes):
                out[b * DOT_LANES + j, k_in - 1] = pair_lo(pairs[b, both, j])


_widen_pairs_serial = serial_twin(_widen_pairs)


def _even_width(x, groups=1):
    """``x [n, groups * k]`` with a zero column appended to each group's k inputs when k is odd:
    the kernels take pairs, and a last pair ``(p, 0)`` adds ``p`` alone, which is the
    reference's order for an odd K."""
    n, k = x.shape[0], x.shape[1] // groups
    if k % 2 == 0:
        return x
    parts = x.reshape(n, groups, k)
    return np.concatenate([parts, np.zeros((n, groups, 1), x.dtype)], axis=2).reshape(n, -1)


class Bf16Matrix:
    """A bf16-valued weight, held once as bf16 pairs (2 bytes a parameter plus padding).

    ``w [out, in]``: a float32 array holding bf16 values or an ``ml_dtypes.bfloat16`` array
    (read a block of rows at a time, never widened whole). With ``groups = G > 1`` it is the
    reference's grouped projection (``wo_a``): the input splits into G equal parts and part g
    goes through rows ``g*out/G .. (g+1)*out/G`` only, so ``in_features = G * in``. The packed
    pairs are the only copy kept (not the caller's array): the decode kernel and the
    AVX512-BF16 product read them as they are, the BLAS path widens them per call
    (:meth:`to_f32`).
    """

    __slots__ = ("shape", "groups", "_pairs", "_range", "_shared")

    def __init__(self, w, groups: int = 1):
        w = np.asarray(w)
        if w.dtype.name != "bfloat16":
            w = as_f32_array(w, "Bf16Matrix")
        if w.ndim != 2:
            raise ValueError(f"Bf16Matrix: expected a 2-D [out, in] weight, got shape {w.shape}")
        if not is_int(groups, 1) or w.shape[0] % groups:
            raise ValueError(f"Bf16Matrix: groups must be a positive divisor of out "
                             f"({w.shape[0]}), got {groups!r}")
        self.shape = tuple(int(s) for s in w.shape)
        self.groups = int(groups)
        self._pairs = self._packed(w)
        # The weight's exponents, for whether the FMA kernel may run (fma_choice.fma_safe).
        self._range = values_range(self._pairs)
        self._shared = None         # the SharedInput this weight's decode products run with

    def _packed(self, w):
        """``w`` in the pairs layout, group by group, ``_PACK_ROWS`` rows at a time."""
        n_out, k_in = self.shape
        rank = n_out // self.groups
        nb = -(-rank // DOT_LANES)
        pairs = np.zeros((self.groups * nb, -(-k_in // 2), DOT_LANES), np.uint32)
        for g in range(self.groups):
            for r0 in range(0, rank, _PACK_ROWS):
                rows = w[g * rank + r0:g * rank + min(rank, r0 + _PACK_ROWS)]
                sized_call(_pack_bits, rows.shape[0], k_in * ELEMENT_COST, _bf16_bits(rows),
                           pairs[g * nb:(g + 1) * nb], r0)
        return pairs

    @property
    def in_features(self):
        return self.shape[1] * self.groups

    @property
    def nbytes(self) -> int:
        """Bytes held (:meth:`held_bytes`): the pairs are all there is."""
        return self._pairs.nbytes

    @staticmethod
    def held_bytes(shape, groups: int = 1) -> int:
        """Bytes a Bf16Matrix of ``shape [out, in]`` holds: 2 a parameter, plus the padding of
        each group's rows to a multiple of ``DOT_LANES`` and of an odd ``in`` to even."""
        n_out, k_in = shape
        return groups * -(-(n_out // groups) // DOT_LANES) * DOT_LANES * -(-k_in // 2) * 4

    def to_f32(self, group: int | None = None) -> np.ndarray:
        """A fresh float32 copy ``[out, in]`` of the weight (``[out / groups, in]``, the rows of
        ``group``, when given), exact: for numpy's BLAS, made per use and not kept."""
        n_out, k_in = self.shape
        rank = n_out // self.groups
        nb = self._pairs.shape[0] // self.groups
        if group is None and self.groups > 1:
            return np.concatenate([self.to_f32(g) for g in range(self.groups)])
        g = 0 if group is None else group
        if not 0 <= g < self.groups:
            raise ValueError(f"Bf16Matrix.to_f32: group must be in 0..{self.groups - 1}, "
                             f"got {group}")
        out = np.empty((rank, k_in), np.float32)
        sized_call(_widen_pairs, -(-rank // DOT_LANES), DOT_LANES * k_in * ELEMENT_COST,
                   self._pairs[g * nb:(g + 1) * nb], k_in, out)
        return out

    def dot_bf16(self, x, out, ref_rows: int | None = None) -> bool:
        """``out = x @ w.T`` in f32 (not rounded), for rows ``x [m, in_features]`` of bf16 values
        (float32 or ``ml_dtypes.bfloat16``): the products are exact and each output sums them in
        the reference's order for a call of ``ref_rows`` rows (default ``m``; see
        :func:`bf16_k_block`), with ``vdpbf16ps`` or, where FMAs are faster on this CPU
        (:func:`~.fma_choice.fma_faster`) and give the same sums (:func:`~.fma_choice.fma_safe`),
        with two FMAs a pair in its order. Without AVX512-BF16 (the ``blas`` tier) always on the
        FMAs: the same sums but where ``vdpbf16ps`` would flush a denormal, which they keep.
        Either way no sum depends on the rows' tiling or the thread count (a BLAS's may: some
        OpenBLAS kernels sum a row by where it sits in the call). Returns False where x is not
        bf16-valued (``out`` may then be partly written): use BLAS instead.

        Rows run ``_WIDEN_ROWS`` at a time, so the operand copy of a long input stays small.
        """
        k_in = self.shape[1]
        x = np.ascontiguousarray(x)
        m, n_out = x.shape[0], self.shape[0]
        rank = n_out // self.groups
        b = self._pairs
        block_pairs = bf16_k_block(m if ref_rows is None else ref_rows, k_in) // 2
        native = tier_at_least("avx512bf16")
        fma = not native or (fma_faster() and self._range[0])
        for r0 in range(0, m, _WIDEN_ROWS):
            chunk = _even_width(x[r0:r0 + _WIDEN_ROWS], self.groups)
            n = chunk.shape[0]
            rows = -(-n // DOT_ROWS) * DOT_ROWS
            a = self._fma_operand(chunk, rows, same_as_dot=native) if fma else None
            if a is None and native:
                a = _pairs_operand(chunk, rows)
            if a is None:       # not bf16 values: the caller's BLAS path runs
                return False
            y = out[r0:r0 + n]
            if rows == n and rank % DOT_LANES == 0 and y.flags.c_contiguous:
                gemm_bf16_sized(a, b, y, self.groups, block_pairs)
            else:
                padded = np.empty((rows, b.shape[0] * DOT_LANES), np.float32)
                gemm_bf16_sized(a, b, padded, self.groups, block_pairs)
                y[...] = padded[:n].reshape(n, self.groups, -1)[:, :, :rank].reshape(n, n_out)
        return True

    def _fma_operand(self, chunk, rows, same_as_dot=True):
        """The FMA kernel's A operand for ``chunk`` (its values, padded to ``rows`` rows), or
        None where they are not bf16 values or (``same_as_dot``) where the FMA kernel's sums
        could differ from ``vdpbf16ps``'s (:func:`fma_safe`)."""
        values = np.ascontiguousarray(chunk, np.float32)
        if not (fma_safe(values_range(values), self._range, self.shape[1]) if same_as_dot
                else is_bf16_valued(values)):
            return None
        if rows == values.shape[0]:
            return values
        return np.concatenate([values, np.zeros((rows - values.shape[0], values.shape[1]), np.float32)])

    def _matvec_input(self, x, ref_rows: int | None):
        """The decode kernel's input rows ``[m, in]`` (float32, C-contiguous) and run length."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.in_features)
        block = bf16_k_block(x2.shape[0] if ref_rows is None else ref_rows, self.shape[1])
        return x2, block + block % 2

    def matvec(self, x, ref_rows: int | None = None):
        """``bf16(x @ w.T)`` for a few rows ``x [..., in_features]``, reading the held pairs, summed
        in the reference's order for a call of ``ref_rows`` rows (default: the rows of x). A
        weight that shares its input (:class:`SharedInput`) computes it with the others'."""
        x2, block = self._matvec_input(x, ref_rows)
        if self._shared is not None:
            out = self._shared.product(self, x2, block)
        else:
            out = np.empty((x2.shape[0], self.shape[0]), np.float32)
            matvec_into(x2, (self._pairs,), (self.groups,), self.shape[1], block, (out,))
        return out.reshape(x.shape[:-1] + (self.shape[0],))


class SharedInput:
    """Weights that read the same input at a decode step, whose products run as one kernel call.

    A layer's projections of its input ``x`` (``wkv``, ``wq_a``, the compressor's ``wkv``, the
    indexer's ``weights_proj``) are asked for one at a time, far apart in the step's code; a
    call each woke the threads four times and waited four times for the slower one. Here the
    first member asked for the product of an input computes every member's
    (:func:`~.matvec.matvec_into`: one list of work items over all their weights) and keeps the
    others' outputs; a member then asking with the same input (the same values and row count,
    the same run length) is handed its output, once. Any other request computes afresh, so the
    results are those of each weight alone whatever the order of the requests: each output is
    the same sum whichever call computes it.
    """

    __slots__ = ("members", "_lock", "_key", "_ready")

    def __init__(self, members):
        members = tuple(members)
        if not 2 <= len(members) <= MATVEC_MEMBERS or len({id(m) for m in members}) != len(members):
            raise ValueError(f"SharedInput: 2 to {MATVEC_MEMBERS} distinct weights, got "
                             f"{len(members)}")
        for m in members:
            if not isinstance(m, Bf16Matrix) or m.in_features != members[0].in_features \
                    or m.shape[1] != members[0].shape[1]:
                raise ValueError("SharedInput: every member must be a Bf16Matrix of one input "
                                 "width and one group width")
            if m._shared is not None:
                raise ValueError("SharedInput: a weight shares its input with one group at most")
        self.__setstate__(members)
        for m in members:
            m._shared = self

    def __getstate__(self):          # a pickle (a cluster's layer) carries the members alone
        return self.members

    def __setstate__(self, members):
        self.members = members
        self._lock = threading.Lock()
        self._key, self._ready = None, {}

    def product(self, member, x2, block: int) -> np.ndarray:
        """``member``'s ``bf16(x2 @ w.T)`` (``x2 [m, in]`` float32, C-contiguous; ``block`` the
        run length), from the last call when it holds it for this input, else from a new call
        for every member."""
        key = (block, x2.shape, x2.tobytes())       # the input's bits, not its values: NaN too
        with self._lock:
            if key == self._key and member in self._ready:
                return self._ready.pop(member)
            outs = [np.empty((x2.shape[0], m.shape[0]), np.float32) for m in self.members]
            matvec_into(x2, [m._pairs for m in self.members], [m.groups for m in self.members],
                        member.shape[1], block, outs)
            self._key = key
            self._ready = {m: o for m, o in zip(self.members, outs) if m is not member}
            return outs[self.members.index(member)]


# The A operand's buffer, kept per thread between products up to this size: a fresh array of a
# prefill's size is mapped anew by the allocator and its first writes fault every page in (0.6 s
# of a 4,096-token prefill of layer 20 on a Zen 4, against 0.055 s for the conversion itself).
_OPERAND_KEPT_BYTES = 64 << 20
_operand = threading.local()


def _operand_buffer(rows: int, cols: int) -> np.ndarray:
    """A uint32 ``[rows, cols]`` scratch array for this thread's next product (its contents
    whatever the last product left): the kept buffer when it is large enough, else a new one
    (kept if at most ``_OPERAND_KEPT_BYTES``)."""
    size = rows * cols
    buf = getattr(_operand, "buf", None)
    if buf is None or buf.size < size:
        buf = np.empty(size, np.uint32)
        if buf.nbytes <= _OPERAND_KEPT_BYTES:
            _operand.buf = buf
    return buf[:size].reshape(rows, cols)


def _pairs_operand(chunk, rows):
    """``vdpbf16ps``'s A operand for ``chunk`` (bf16 values as pairs, padded to ``rows`` rows), or
    None when the chunk does not hold bf16 values. It lies in this thread's scratch buffer: valid
    until the thread's next call."""
    n = chunk.shape[0]
    if chunk.dtype.name == "bfloat16":          # already pairs of bf16, in memory order
        a = np.ascontiguousarray(chunk).view(np.uint32)
        return a if rows == n else np.concatenate([a, np.zeros((rows - n, a.shape[1]), np.uint32)])
    a = _operand_buffer(rows, chunk.shape[1] // 2)
    a[n:] = 0
    try:
        bf16_pairs(np.ascontiguousarray(chunk, np.float32), out=a[:n])
    except ValueError:
        return None
    return a


def _bf16_bits(rows):
    """bf16-valued rows (float32 or ``ml_dtypes.bfloat16``) as their bf16 bit patterns (uint16)."""
    if rows.dtype.name == "bfloat16":
        return np.ascontiguousarray(rows).view(np.uint16)
    bits = bf16_halves(rows)
    if bits is not None:
        return bits
    if not is_bf16_valued(rows):        # a NaN is kept: its pattern's high half
        raise ValueError("Bf16Matrix: w must hold bf16 values (round it to bfloat16 first)")
    return (np.ascontiguousarray(rows).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
