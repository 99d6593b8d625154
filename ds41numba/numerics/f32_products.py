"""f32 matrix products summed in the order of the reference's CPU BLAS (torch 2.13, MKL sgemm).

The ratio > 1 compressor keeps its kv and gate projections in f32 and feeds them to a softmax
and a pooled sum, so an f32 product that rounds differently from the reference's moves the
compressed keys, and the index selections built on them. A BLAS of our own (OpenBLAS here) adds
the products in its own order; this module adds them in the order measured for the reference's
MKL (SGEMM 'T','N' for ``F.linear`` / ``x @ w.t()``, 'N','N' for ``x @ v``). Which of three
kernels computes an output row depends on the number of rows M:

* **blocked** (the main kernel, M >= 4): the inner dimension in blocks of ``KC = 192`` (the last
  block the rest); within a block one fused multiply-add chain from 0 in k order; the block sums
  added in order in f32.
* **small** (M = 2..3 of a linear): products rounded to f32 (no FMA); the first ``peel`` of them
  summed in order into lane 0, then four lanes (lane l takes k = peel + 4q + l), reduced as
  ``(l0 + l2) + (l1 + l3)``, then the leftover products one by one. ``peel`` aligns the x row
  to 16 bytes: 0 for rows at multiples of 4 elements from an aligned base.
* **gemv** (M = 1 of a linear): the small kernel with the peel taken from the weight's leading
  dimension instead (4 when it is a multiple of 4).
* an NN product (``x @ v``) of M <= 3 rows: one sequential chain over all of K, no FMA.

The reference ran on two threads, and two-thread MKL splits an M of 5..11 that is not a multiple
of 4: rows ``[0, 4 * (M // 4))`` go to the blocked kernel, the last ``M % 4`` to the small one
(the NN chain for ``x @ v``). This module always follows that two-thread rule: its results never
depend on numba's or BLAS's thread count, since each output is summed whole by one work item.

The fused multiply-add is LLVM's ``llvm.fma`` (one rounding on every x86-64 CPU; ``vfmadd`` where
the CPU has FMA). Nothing here is compiled with fastmath, which would reorder and fuse the sums.
The orders were measured on aligned tensors; a leading dimension here stands for the reference
tensor's, its base taken as 64-byte aligned (torch's allocations are). The kernels' LLVM-IR
micro-kernels are :mod:`.f32_tiles`; this module runs them over work items, packs the weights
and checks the arguments.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from ..jit import njit
from .f32_tiles import CHAIN_LANES, CHAIN_ROWS, TILE_LANES, TILE_ROWS, chain_tile, fma_tile, lanes_tile
from .formats import aligned_empty
from .workers import serial_twin, sized_call

__all__ = [
    "KC",
    "TILE_ROWS",
    "TILE_LANES",
    "F32Matrix",
    "blocked_rows",
    "linear_f32_ordered",
    "matmul_nn_f32_ordered",
    "pack_columns",
]

#: The reference's block of the inner dimension in its main kernel.
KC = 192

# Rows of one work item of the blocked kernel: its x block of KC columns (60 KB) and the output
# rows it updates (160 KB for 512 columns) stay in L2 while the item passes over all of w's
# panels; a panel's block (24 KB) stays in L1 while the item's rows pass over it.
_CHUNK_ROWS = 8 * TILE_ROWS
# Below this many row chunks, the blocked kernel's work items also split the columns.
_MIN_ITEMS = 8


@njit
def blocked_rows(m: int) -> int:
    """How many leading rows of an M-row product the reference's two-thread MKL sends to its
    blocked kernel (the rest go to the small kernel, or the NN chain); sparse attention's heads
    too (its products have a row a head)."""
    if m <= 3:
        return 0
    if 4 < m < 12 and m % 4:
        return 4 * (m // 4)
    return m


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@njit
def _tiles(x, panel, o, k0, k1, first):
    """The micro-kernel over all rows of ``x`` (``o`` the same rows) for the block k0..k1."""
    rows = x.shape[0]
    for r in range(0, rows, TILE_ROWS):
        r1 = min(rows, r + TILE_ROWS)
        fma_tile(x[r:r1, k0:k1], panel, o[r:r1], first)


@njit
def _blocked_item(x, wp, out, rows, n_out, col_groups, item):
    """Work item ``item`` of ``out[:rows] = x[:rows] . w.T`` in the blocked kernel's order: a
    chunk of rows by a group of column panels (``wp`` is w packed by :func:`pack_columns`,
    ``out [>= rows, n_out]``). Every output is summed whole by one item."""
    n_panels, K = wp.shape[0], wp.shape[1]
    per_group = (n_panels + col_groups - 1) // col_groups
    i, g = item // col_groups, item % col_groups
    r0, r1 = i * _CHUNK_ROWS, min(rows, (i + 1) * _CHUNK_ROWS)
    j0, j1 = g * per_group, min(n_panels, (g + 1) * per_group)
    xs = x[r0:r1]
    ragged = j1 * TILE_LANES > n_out     # this item holds the last, partial panel
    scratch = np.empty((r1 - r0, TILE_LANES), np.float32)
    for k0 in range(0, K, KC):
        k1 = min(K, k0 + KC)
        first = k0 == 0
        for j in range(j0, j1):
            panel = wp[j, k0:k1]
            c0 = j * TILE_LANES
            if c0 + TILE_LANES <= n_out:
                _tiles(xs, panel, out[r0:r1, c0:c0 + TILE_LANES], k0, k1, first)
            else:
                _tiles(xs, panel, scratch, k0, k1, first)
    if ragged:
        c0 = (j1 - 1) * TILE_LANES
        for r in range(r1 - r0):    # a loop: docs/architecture.md, cold start
            for c in range(n_out - c0):
                out[r0 + r, c0 + c] = scratch[r, c]


@njit
def _small_item(x, wp, out, first_row, peels, n_out, j):
    """Panel j of rows ``first_row ..`` of ``out = x . w.T`` in the small kernel's order
    (products rounded, no FMA), row r with ``peels[r - first_row]``."""
    K = wp.shape[1]
    panel = wp[j]
    c0 = j * TILE_LANES
    nc = min(TILE_LANES, n_out - c0)
    lane0 = np.empty(TILE_LANES, np.float32)
    res = np.empty(TILE_LANES, np.float32)
    for r in range(first_row, x.shape[0]):
        xr = x[r]
        peel = min(peels[r - first_row], K)
        lane0[:] = 0
        for k in range(peel):
            xk = xr[k]
            for t in range(TILE_LANES):
                lane0[t] += xk * panel[k, t]
        k1 = peel + 4 * ((K - peel) // 4)
        lanes_tile(xr[peel:k1], panel[peel:k1], lane0, res)
        for k in range(k1, K):
            xk = xr[k]
            for t in range(TILE_LANES):
                res[t] += xk * panel[k, t]
        for t in range(nc):         # a loop: docs/architecture.md, cold start
            out[r, c0 + t] = res[t]


@njit
def _chain_item(x, v, out, first_row, j):
    """Columns ``j*CHAIN_LANES ..`` of rows ``first_row ..`` of ``out = x . v`` (``v [K, N]``):
    one sequential chain over K per output, products rounded (no FMA)."""
    K, N = v.shape
    rows = x.shape[0]
    c0 = j * CHAIN_LANES
    c1 = min(N, c0 + CHAIN_LANES)
    if c1 - c0 == CHAIN_LANES:
        for r in range(first_row, rows, CHAIN_ROWS):
            r1 = min(rows, r + CHAIN_ROWS)
            chain_tile(x[r:r1], v[:, c0:c1], out[r:r1, c0:c1])
    else:
        acc = np.empty(c1 - c0, np.float32)
        for r in range(first_row, rows):
            acc[:] = 0
            for k in range(K):
                xk = x[r, k]
                for t in range(c1 - c0):
                    acc[t] += xk * v[k, c0 + t]
            out[r, c0:c1] = acc


# Each kernel runs its work items in parallel, or its serial twin runs them in the calling
# thread (workers.sized_call). The items do not depend on which thread runs them.


@njit(parallel=True)
def _blocked_kernel(x, wp, out, rows, n_out, col_groups, n_items):
    for item in prange(n_items):
        _blocked_item(x, wp, out, rows, n_out, col_groups, item)


_blocked_kernel_serial = serial_twin(_blocked_kernel)


@njit(parallel=True)
def _small_kernel(x, wp, out, first_row, peels, n_out):
    for j in prange(wp.shape[0]):
        _small_item(x, wp, out, first_row, peels, n_out, j)


_small_kernel_serial = serial_twin(_small_kernel)


@njit(parallel=True)
def _chain_kernel(x, v, out, first_row, n_items):
    for j in prange(n_items):
        _chain_item(x, v, out, first_row, j)


_chain_kernel_serial = serial_twin(_chain_kernel)


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


@njit
def _pack_item(w, out, transposed, j):
    """Panel j: ``out[j, k, t] = w[j*TILE_LANES + t, k]`` (``transposed``: ``w[k, j*TILE_LANES +
    t]``), zero past the last column."""
    K = out.shape[1]
    n = w.shape[1] if transposed else w.shape[0]
    for k in range(K):
        for t in range(TILE_LANES):
            c = j * TILE_LANES + t
            if c >= n:
                out[j, k, t] = 0.0
            elif transposed:
                out[j, k, t] = w[k, c]
            else:
                out[j, k, t] = w[c, k]


@njit(parallel=True)
def _pack_kernel(w, out, transposed):
    for j in prange(out.shape[0]):
        _pack_item(w, out, transposed, j)


_pack_kernel_serial = serial_twin(_pack_kernel)


def _pack(w, transposed):
    n = w.shape[1] if transposed else w.shape[0]
    k = w.shape[0] if transposed else w.shape[1]
    out = aligned_empty((-(-n // TILE_LANES), k, TILE_LANES))
    sized_call(_pack_kernel, out.shape[0], k * TILE_LANES, w, out, transposed)
    return out


def pack_columns(w: np.ndarray) -> np.ndarray:
    """w ``[N, K]`` float32 as the kernels' operand ``[ceil(N / TILE_LANES), K, TILE_LANES]``:
    panel j holds output columns ``j*TILE_LANES ..`` side by side for each k (zero padded), so
    one vector load gives one k of a whole panel."""
    return _pack(_rows_contiguous(_as_f32_2d(w, "pack_columns: w", "[N, K]")), False)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _as_f32(a, name):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy float32 array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    return a


def _as_f32_2d(a, name, layout):
    """``_as_f32`` of a matrix: ``name`` must be 2-D (``layout`` says which way round)."""
    a = _as_f32(a, name)
    if a.ndim != 2:
        raise ValueError(f"{name} must be 2-D {layout}, got shape {a.shape}")
    return a


def _rows_contiguous(a):
    """``a`` itself when its rows are contiguous (keeping its leading dimension, which decides
    the reference's peel), else a C-contiguous copy."""
    if a.shape[-1] > 1 and a.strides[-1] != 4:
        return np.ascontiguousarray(a)
    return a


def _lead(a):
    """The leading dimension (elements) of a 2-D array with contiguous rows."""
    return a.strides[0] // 4 if a.shape[0] > 1 else a.shape[1]


class F32Matrix:
    """An f32 weight ``w [out, in]`` for :func:`linear_f32_ordered`, with its packed copy.

    The packed operand (:func:`pack_columns`, the same size as w) is built on the first product
    and kept, so a projection applied at every decode step packs once. The array is kept as given
    when its rows are contiguous (its leading dimension picks the reference's gemv peel). Treat
    the weight as read-only once wrapped.
    """

    __slots__ = ("f32", "_packed")

    def __init__(self, w):
        self.f32 = _rows_contiguous(_as_f32_2d(w, "F32Matrix: w", "[out, in]"))
        self._packed = None

    @property
    def shape(self):
        return self.f32.shape

    @property
    def out_features(self):
        return self.f32.shape[0]

    @property
    def in_features(self):
        return self.f32.shape[1]

    @property
    def packed(self) -> np.ndarray:
        if self._packed is None:
            self._packed = _pack(self.f32, False)
        return self._packed

    @property
    def nbytes(self) -> int:
        """Bytes held once the first product has built the packed copy (:meth:`held_bytes`)."""
        return self.held_bytes(self.f32.shape)

    @staticmethod
    def held_bytes(shape) -> int:
        """Bytes an F32Matrix of ``shape [out, in]`` holds once it has run a product: the array
        and its packed copy (rows padded to a multiple of ``TILE_LANES``, 64 bytes more for its
        alignment)."""
        n, k = shape
        return 4 * n * k + (-(-n // TILE_LANES) * TILE_LANES * k + 16) * 4

    @property
    def gemv_peel(self) -> int:
        """The reference's gemv peel for this weight: ``4 - (-ldw mod 4)``, 4 for a leading
        dimension that is a multiple of 4."""
        return 4 - (-_lead(self.f32)) % 4


def _check_x(x, k, name):
    x = _as_f32(x, f"{name}: x")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{name}: x of shape {x.shape} does not match an inner dimension of {k}")
    x2 = x.reshape(-1, k) if x.ndim != 2 else x
    return _rows_contiguous(x2)


def _check_out(out, shape, name):
    if out is None:
        return np.empty(shape, np.float32)
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or not out.flags.writeable
            or not out.flags.c_contiguous or out.size != int(np.prod(shape))):
        raise ValueError(f"{name}: out must be a writeable C-contiguous float32 array of "
                         f"{int(np.prod(shape))} elements ({list(shape)}), got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    return out.reshape(shape)


def _col_groups(rows, n_panels):
    """Column groups per row chunk: all panels in one item when there are enough row chunks
    (each item's x rows then come from memory once), else one panel per item."""
    n_chunks = -(-rows // _CHUNK_ROWS)
    return 1 if n_chunks >= _MIN_ITEMS else n_panels


def _run_blocked(x2, wp, y, nb, n):
    if nb:
        groups = _col_groups(nb, wp.shape[0])
        n_items = -(-nb // _CHUNK_ROWS) * groups
        sized_call(_blocked_kernel, n_items, -(-nb * x2.shape[1] * n // n_items), x2, wp, y, nb, n,
                   groups, n_items)


def linear_f32_ordered(x, w, out=None, ref_rows: int | None = None, first_row: int = 0):
    """``x @ w.T`` in f32, summed as the reference's ``F.linear`` (MKL sgemm 'T','N', two threads).

    x is float32 ``[..., K]``; w is float32 ``[N, K]`` or an :class:`F32Matrix` (packed once
    and kept: pass one for a weight used more than once). Returns float32 ``[..., N]``, written
    into ``out`` (a C-contiguous float32 buffer of that many elements) when given. The M rows of
    x (all leading dimensions folded) pick the kernels as the reference's do; the small kernel's
    peel comes from x's leading dimension, the gemv's from w's. A row of the blocked kernel does
    not depend on the others: x may go through in pieces of 4, 8 or at least 12 rows with the
    same result; a piece of another size would take the small kernels' order for some rows,
    unless it says which rows of which call it is: ``ref_rows`` is the reference call's M
    (default: x's rows) and ``first_row`` the index of x's first row in it, and then every row
    takes the kernel (and the small kernel's peel) it takes in that call, whatever the piece.
    """
    name = "linear_f32_ordered"
    if isinstance(w, F32Matrix):
        wm = w
    else:
        wm = F32Matrix(_as_f32_2d(w, f"{name}: w", "[N, K]"))
    n, k = wm.shape
    x2 = _check_x(x, k, name)
    m = x2.shape[0]
    ref_m = m if ref_rows is None else int(ref_rows)
    first_row = int(first_row)
    if first_row < 0 or first_row + m > ref_m:
        raise ValueError(f"{name}: rows {first_row}..{first_row + m - 1} are not rows of a call "
                         f"of {ref_m} (ref_rows)")
    y = _check_out(out, (m, n), name)
    if m and n:
        if k == 0:
            y[...] = 0
        else:
            nb = min(m, max(0, blocked_rows(ref_m) - first_row))
            _run_blocked(x2, wm.packed, y, nb, n)
            if nb < m:
                if ref_m == 1:
                    peels = np.array([wm.gemv_peel], np.int64)
                else:
                    ldx = _lead(x2)
                    peels = (-(np.arange(first_row + nb, first_row + m, dtype=np.int64) * ldx)) % 4
                panels = wm.packed.shape[0]
                sized_call(_small_kernel, panels, -(-(m - nb) * k * n // panels), x2, wm.packed, y,
                           nb, peels, n)
    return y.reshape(np.shape(x)[:-1] + (n,))


def matmul_nn_f32_ordered(x, v, out=None):
    """``x @ v`` in f32 with ``v [K, N]``, summed as the reference's ``torch.matmul`` of two
    row-major operands (MKL sgemm 'N','N', two threads): the blocked kernel for the rows the
    two-thread rule gives it, one sequential chain without FMA over all of K for the others.

    x is float32 ``[..., K]``, v float32 ``[K, N]``; returns float32 ``[..., N]`` (into ``out``
    when given). v is packed for each call that has blocked rows (its size, once).
    """
    name = "matmul_nn_f32_ordered"
    v = _rows_contiguous(_as_f32_2d(v, f"{name}: v", "[K, N]"))
    k, n = v.shape
    x2 = _check_x(x, k, name)
    m = x2.shape[0]
    y = _check_out(out, (m, n), name)
    if m and n:
        if k == 0:
            y[...] = 0
        else:
            nb = blocked_rows(m)
            if nb:
                _run_blocked(x2, _pack(v, True), y, nb, n)
            if nb < m:
                n_items = -(-n // CHAIN_LANES)
                sized_call(_chain_kernel, n_items, -(-(m - nb) * k * n // n_items), x2, v, y, nb,
                           n_items)
    return y.reshape(np.shape(x)[:-1] + (n,))
