"""Bit-exact low-precision building blocks: bf16/fp8/fp4 roundings, the quantisers, linears, RMSNorm,
and a bf16 dot-product micro-kernel for CPUs with AVX512-BF16.

The reference rounds to bf16 after almost every op and quantises KV and index tensors to fp8/fp4, so an
implementation is only as exact as these primitives. Every rounding here is done on the IEEE bit
pattern of the f32 input (RNE on the integer significand), never through a float64 intermediate that
could round twice. The scalar helpers (``bf16_scalar``, ``e4m3_scalar``, ``e2m1_scalar``,
``pow2ceil_scalar``) and the row quantisers (``_fp8_quant_row``, ``_fp4_e8m0_row``, ``_fp4_e4m3_row``)
are plain ``@njit`` functions so that other kernels of the package can call them inside their own loops;
the public array functions validate at the Python boundary and hand off to parallel kernels.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import llvmlite.binding as llb
import llvmlite.ir as ir
import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from threadpoolctl import ThreadpoolController

from .f32_products import F32Matrix, linear_f32_ordered

__all__ = [
    "FP4_BLOCK",
    "LATENT_BLOCK",
    "FP8_BLOCK",
    "E4M3_MAX",
    "E2M1_MAX",
    "bf16_scalar",
    "e4m3_scalar",
    "e2m1_scalar",
    "pow2ceil_scalar",
    "to_bf16_rne",
    "to_e4m3_rne",
    "to_e2m1_rne",
    "pow2ceil",
    "round_bf16_inplace",
    "is_bf16_valued",
    "act_quant_fp8_inplace",
    "fp4_quant_e8m0_inplace",
    "fp4_quant_e4m3_inplace",
    "linear_bf16",
    "linear_f32",
    "Bf16Matrix",
    "MATVEC_MAX_ROWS",
    "bf16_k_block",
    "TINY_BF16_LINEAR",
    "rms_norm",
    "torch_sum_f32",
    "SUM_LANES",
    "BF16_DOT",
    "DOT_ROWS",
    "DOT_LANES",
    "bf16_pairs",
    "pack_bf16_pairs",
]

FP4_BLOCK = 32
LATENT_BLOCK = 16
FP8_BLOCK = 32

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# Below this many elements the thread start-up of a parallel kernel costs more than the work.
_PARALLEL_MIN = 1 << 15
# Elements per parallel work item of the element-wise kernels.
_CHUNK = 1 << 14

_F32_NAN_BITS = 0x7FC00000


# ----------------------------------------------------------------------------------------------
# Scalar roundings (callable from any njit kernel)
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _f32_from_bits(bits):
    return np.uint32(bits).view(np.float32)


@njit(cache=True)
def _round_magnitude(a, mbits, emin):
    """RNE of the finite f32 magnitude with bit pattern ``a`` onto a binary format with ``mbits``
    mantissa bits, normal exponents from ``emin`` up (no upper bound) and subnormals below. Returns
    the bit pattern of the rounded magnitude as an f32 (int64); the caller handles overflow."""
    e = (a >> 23) - 127
    if e >= emin:
        # Normal in the target: drop 23 - mbits low bits with RNE on the integer pattern; a carry
        # out of the mantissa correctly bumps the exponent.
        shift = 23 - mbits
        lsb = (a >> shift) & 1
        return (a + ((1 << (shift - 1)) - 1) + lsb) & ~((1 << shift) - 1)
    # Subnormal in the target: round the significand to a multiple of the quantum 2^(emin - mbits).
    if (a >> 23) == 0:
        sig = a
        big_e = -126
    else:
        sig = (a & 0x7FFFFF) | 0x800000
        big_e = e
    k = (emin - mbits) - (big_e - 23)  # right shift from f32 significand units to quanta, >= 2
    if k > 25:
        return np.int64(0)  # sig < 2^24 <= half a quantum
    n = sig >> k
    rem = sig & ((1 << k) - 1)
    half = np.int64(1) << (k - 1)
    if rem > half or (rem == half and (n & 1) == 1):
        n += 1
    # n * 2^(emin - mbits) is exact in f32 (n has at most mbits + 1 bits).
    return np.int64(np.float32(np.float32(n) * np.float32(2.0 ** (emin - mbits))).view(np.uint32))


@njit(cache=True)
def bf16_scalar(v):
    """Round an f32 to the nearest bf16 value (RNE), returned as f32. NaN -> quiet NaN of the same
    sign (as ml_dtypes), +-inf -> +-inf, overflow past the largest bf16 -> +-inf, -0.0 stays -0.0."""
    bits = np.float32(v).view(np.uint32)
    # Ties go to the even bf16 pattern: add 0x7FFF plus the lowest kept bit, then truncate.
    # Only a NaN pattern can carry out of 32 bits, and NaN takes the other branch: the select
    # below is branch-free, so loops over it vectorise.
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    nan = (bits & np.uint32(0x80000000)) | np.uint32(_F32_NAN_BITS)
    return _f32_from_bits(nan if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@njit(cache=True)
def e4m3_scalar(v):
    """f32 -> float8_e4m3fn (RNE) -> f32, as ml_dtypes converts: |v| rounding above 448 (that is
    |v| > 464; 464 itself ties to the even 448) and +-inf become NaN, because e4m3fn has no infinity
    and does not saturate. Subnormals (multiples of 2^-9 below 2^-6) round with RNE; the sign of a
    zero result is kept."""
    bits = np.int64(np.float32(v).view(np.uint32))
    sign = bits & 0x80000000
    a = bits & 0x7FFFFFFF
    if a >= 0x7F800000:
        return _f32_from_bits(sign | _F32_NAN_BITS)
    r = _round_magnitude(a, 3, -6)
    if r > 0x43E00000:  # 448.0
        return _f32_from_bits(sign | _F32_NAN_BITS)
    return _f32_from_bits(sign | r)


@njit(cache=True)
def e2m1_scalar(v):
    """f32 -> float4_e2m1fn (RNE) -> f32: |v| onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Binary RNE is the
    SPEC's even-3-bit-code tie rule, since the codes 0..7 are the format's bit patterns in order.
    The sign is kept (-0.2 -> -0.0). Beyond 6 it saturates to +-6 (inf included), as ml_dtypes does.
    NaN -> NaN (ml_dtypes turns NaN into a zero; e2m1 has no NaN, but an f32 result can keep it)."""
    bits = np.int64(np.float32(v).view(np.uint32))
    sign = bits & 0x80000000
    a = bits & 0x7FFFFFFF
    if a > 0x7F800000:
        return _f32_from_bits(sign | _F32_NAN_BITS)
    if a == 0x7F800000:
        return _f32_from_bits(sign | 0x40C00000)
    r = _round_magnitude(a, 1, 0)
    if r > 0x40C00000:  # 6.0
        r = np.int64(0x40C00000)
    return _f32_from_bits(sign | r)


@njit(cache=True)
def pow2ceil_scalar(v):
    """The smallest power of two >= v, exactly: 2^e for v = 1.m * 2^e, times 2 when m != 0. Defined
    for v > 0: a subnormal v gives its exact (possibly subnormal) power of two, v > 2^127 and +inf give
    +inf. Outside the domain (v <= 0, -0.0, NaN) the result is NaN. The quantisers' amax floors keep
    their arguments positive normal, where this is the SPEC's bit rule."""
    bits = np.int64(np.float32(v).view(np.uint32))
    if bits == 0 or bits >= 0x7F800001:  # +0, NaN, or any negative (incl. -0.0, -inf)
        return np.float32(np.nan)
    if bits == 0x7F800000:
        return np.float32(np.inf)
    exp_field = bits >> 23
    man = bits & 0x7FFFFF
    if exp_field == 0:
        # Subnormal v = man * 2^-149: the next power of two of the integer man; 2^23 is 2^-126.
        p = np.int64(1)
        while p < man:
            p <<= 1
        return _f32_from_bits(p)
    if man == 0:
        return np.float32(v)
    if exp_field + 1 >= 255:
        return np.float32(np.inf)
    return _f32_from_bits((exp_field + 1) << 23)


# ----------------------------------------------------------------------------------------------
# Element-wise array conversions
# ----------------------------------------------------------------------------------------------

_OP_BF16 = 0
_OP_E4M3 = 1
_OP_E2M1 = 2
_OP_POW2CEIL = 3


@njit(cache=True)
def _convert_range(x, op, lo, hi):
    # Index a slice from 0: with x[lo + i] numba's negative-index wraparound makes LLVM
    # vectorise the loop into gathers and scatters, several times slower.
    v = x[lo:hi]
    if op == 0:
        for i in range(v.shape[0]):
            v[i] = bf16_scalar(v[i])
    elif op == 1:
        for i in range(v.shape[0]):
            v[i] = e4m3_scalar(v[i])
    elif op == 2:
        for i in range(v.shape[0]):
            v[i] = e2m1_scalar(v[i])
    else:
        for i in range(v.shape[0]):
            v[i] = pow2ceil_scalar(v[i])


@njit(parallel=True, cache=True)
def _convert_kernel(x, op, chunk):
    n = x.shape[0]
    nchunks = (n + chunk - 1) // chunk
    for c in prange(nchunks):
        lo = c * chunk
        _convert_range(x, op, lo, min(lo + chunk, n))


def _as_f32_array(x, name):
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected a float32 array, got dtype {arr.dtype}")
    return arr


def _convert(x, op, name):
    arr = _as_f32_array(x, name)
    flat = np.array(arr, dtype=np.float32, order="C", copy=True).reshape(-1)
    _run_convert(flat, op)
    return flat.reshape(arr.shape)


def _run_convert(x, op):
    """Convert the 1-D array ``x`` in place."""
    n = x.shape[0]
    if n >= _PARALLEL_MIN:
        _convert_kernel(x, op, _CHUNK)
    elif n:
        _convert_range(x, op, 0, n)


def to_bf16_rne(x):
    """A new float32 array holding ``x`` rounded to bf16 (RNE; see ``bf16_scalar``)."""
    return _convert(x, _OP_BF16, "to_bf16_rne")


def to_e4m3_rne(x):
    """A new float32 array holding ``x`` cast to float8_e4m3fn and back (see ``e4m3_scalar``)."""
    return _convert(x, _OP_E4M3, "to_e4m3_rne")


def to_e2m1_rne(x):
    """A new float32 array holding ``x`` cast to float4_e2m1fn and back (see ``e2m1_scalar``)."""
    return _convert(x, _OP_E2M1, "to_e2m1_rne")


def pow2ceil(x):
    """A new float32 array with the smallest power of two >= each element (see ``pow2ceil_scalar``)."""
    return _convert(x, _OP_POW2CEIL, "pow2ceil")


@njit(cache=True)
def _bf16_valued_range(src, lo, hi):
    for i in range(lo, hi):
        v = src[i]
        # NaN counts as bf16-valued whatever its payload ("NaN stays NaN").
        if v == v and (np.int64(np.float32(v).view(np.uint32)) & 0xFFFF) != 0:
            return False
    return True


def is_bf16_valued(x):
    """True when every element of the float32 array ``x`` is a bf16 value (its low 16 bits are zero;
    any NaN counts). Used to check inputs and weights that the reference holds in bf16."""
    arr = _as_f32_array(x, "is_bf16_valued")
    flat = np.ascontiguousarray(arr).reshape(-1)
    return bool(_bf16_valued_range(flat, 0, flat.shape[0]))


def _check_inplace(x, name):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name}: expected a float32 array, got dtype {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: the array must be C-contiguous to be modified in place")
    if not x.flags.writeable:
        raise ValueError(f"{name}: the array is read-only")


def round_bf16_inplace(x):
    """Round a writeable C-contiguous float32 array to bf16 in place and return it."""
    _check_inplace(x, "round_bf16_inplace")
    flat = x.reshape(-1)
    _run_convert(flat, _OP_BF16)
    return x


# ----------------------------------------------------------------------------------------------
# Quantisers (quantise, then dequantise, in place; SPEC "Quantisers")
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def nan_max(best, v):
    """The larger of ``best`` and ``v``, where a NaN wins and then stays (torch's max and amax
    propagate NaN): fold it over values starting from -inf (or 0 for magnitudes)."""
    return v if (v > best or v != v) else best


@njit(cache=True)
def _block_amax(blk):
    # Largest |x| in f32; a NaN anywhere makes it NaN, as torch's amax does.
    amax = np.float32(0.0)
    for j in range(blk.shape[0]):
        amax = nan_max(amax, abs(blk[j]))
    return amax


@njit(cache=True)
def _clamp(y, bound):
    # NaN passes through unchanged, as in torch.clamp.
    if y > bound:
        return bound
    if y < -bound:
        return -bound
    return y


_Q_FP8 = 0       # act_quant: e4m3 elements, power-of-two scale
_Q_FP4_E8M0 = 1  # fp4_act_quant: e2m1 elements, power-of-two scale
_Q_FP4_E4M3 = 2  # latent quantiser: e2m1 elements, e4m3 scale


@njit(cache=True)
def _quant_row(row, block, kind):
    """One of the three quantise-dequantise schemes on a 1-D float32 view, in place.

    Per block of ``block`` values (a shorter last block is quantised on its own): the block's
    amax, floored; the scale ``s`` (``pow2ceil(amax / bound)``, or for the latents the e4m3
    rounding of ``amax / 6``); then ``bf16(elem(clamp(x / s, +-bound)) * s)`` with the element
    format e4m3 (fp8) or e2m1 (fp4). A block whose e4m3 scale overflows gets a NaN scale, as
    the non-saturating e4m3fn cast gives.
    """
    if kind == _Q_FP8:
        bound, floor = np.float32(448.0), np.float32(1e-4)
    elif kind == _Q_FP4_E8M0:
        bound, floor = np.float32(6.0), np.float32(6.0 * 2.0**-126)
    else:
        bound, floor = np.float32(6.0), np.float32(6.0 * 2.0**-9)
    for lo in range(0, row.shape[0], block):
        # A slice indexed from 0 (not row[lo + j]) lets the loops below vectorise.
        blk = row[lo:lo + block]
        amax = _block_amax(blk)
        if amax < floor:
            amax = floor
        if kind == _Q_FP4_E4M3:
            s = e4m3_scalar(amax / bound)
        else:
            s = pow2ceil_scalar(amax / bound)
        for j in range(blk.shape[0]):
            # A true f32 division, not a multiply by 1/s.
            y = _clamp(blk[j] / s, bound)
            q = e4m3_scalar(y) if kind == _Q_FP8 else e2m1_scalar(y)
            blk[j] = bf16_scalar(q * s)


@njit(cache=True)
def _fp8_quant_row(row, block):
    """act_quant on a 1-D float32 view in place: amax floored at 1e-4, ``s = pow2ceil(amax / 448)``,
    ``bf16(e4m3(clamp(x / s, +-448)) * s)``."""
    _quant_row(row, block, _Q_FP8)


@njit(cache=True)
def _fp4_e8m0_row(row, block):
    """fp4_act_quant with e8m0 scales in place: amax floored at 6 * 2^-126, ``s = pow2ceil(amax / 6)``,
    ``bf16(e2m1(clamp(x / s, +-6)) * s)``."""
    _quant_row(row, block, _Q_FP4_E8M0)


@njit(cache=True)
def _fp4_e4m3_row(row, block):
    """fp4 with e4m3 scales (compressed-KV latents) in place: amax floored at 6 * 2^-9,
    ``s = e4m3(amax / 6)``, ``bf16(e2m1(clamp(x / s, +-6)) * s)``."""
    _quant_row(row, block, _Q_FP4_E4M3)


@njit(parallel=True, cache=True)
def _quant_kernel(flat, block, kind):
    for b in prange(flat.shape[0] // block):
        _quant_row(flat[b * block : (b + 1) * block], block, kind)


def _check_block(x, block, name):
    _check_inplace(x, name)
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"{name}: block must be a positive integer, got {block!r}")
    if x.ndim == 0 or x.shape[-1] % block != 0:
        raise ValueError(
            f"{name}: the last dimension of shape {x.shape} is not a multiple of block {block}"
        )
    return int(block)


def _quantise(x, block, name, kind):
    block = _check_block(x, block, name)
    flat = x.reshape(-1)
    if flat.shape[0] >= _PARALLEL_MIN:
        _quant_kernel(flat, block, kind)
    elif flat.shape[0]:
        _quant_row(flat, block, kind)
    return x


def act_quant_fp8_inplace(x, block=FP8_BLOCK):
    """fp8 quantise-dequantise (the reference's ``act_quant``, window KV) of every block of ``block``
    consecutive last-dimension values, in place. Returns ``x``; the result is bf16-valued."""
    return _quantise(x, block, "act_quant_fp8_inplace", _Q_FP8)


def fp4_quant_e8m0_inplace(x, block=FP4_BLOCK):
    """fp4 quantise-dequantise with power-of-two (e8m0) scales (indexer q and keys), in place."""
    return _quantise(x, block, "fp4_quant_e8m0_inplace", _Q_FP4_E8M0)


def fp4_quant_e4m3_inplace(x, block=LATENT_BLOCK):
    """fp4 quantise-dequantise with e4m3 scales (compressed KV latents), in place."""
    return _quantise(x, block, "fp4_quant_e4m3_inplace", _Q_FP4_E4M3)


# ----------------------------------------------------------------------------------------------
# Projections and RMSNorm (SPEC "Precision of the building blocks")
# ----------------------------------------------------------------------------------------------


def _check_linear(x, w, name):
    x = np.asarray(x)
    if x.dtype.name != "bfloat16":
        x = _as_f32_array(x, f"{name}: x")
    w = _as_f32_array(w, f"{name}: w")
    if w.ndim != 2:
        raise ValueError(f"{name}: w must be 2-D [out, in], got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"{name}: x of shape {x.shape} does not match w of shape {w.shape} ([out, in])")
    return x, w


# Rows of a bfloat16 input widened to float32 at a time: the f32 copy of a long input would
# otherwise be the largest array of a long prefill.
_WIDEN_ROWS = 4096


def _output(out, shape, name, dtype=np.float32):
    """``out`` viewed as ``shape`` (a new ``dtype`` array when None). A caller's buffer lets a tiled
    loop reuse its memory: each fresh array of a prefill's size costs page faults that were ~10%
    of a 4K-token prefill here."""
    dtype = np.dtype(dtype)
    if out is None:
        return np.empty(shape, dtype)
    if (not isinstance(out, np.ndarray) or out.dtype != dtype or not out.flags.writeable
            or out.size != int(np.prod(shape))):
        raise ValueError(f"{name}: out must be a writeable {dtype} array of shape {list(shape)}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    view = out.view()
    try:
        view.shape = shape      # a view, never a silent copy the result would be lost in
    except AttributeError:
        raise ValueError(f"{name}: out of shape {list(out.shape)} cannot be viewed as "
                         f"{list(shape)} without a copy: pass a C-contiguous buffer") from None
    return view


def linear_f32(x, w, out=None):
    """``x @ w.T`` in f32, f32 result (the ratio > 1 compressor's projections).

    With w an :class:`~ds41numba.f32_products.F32Matrix` the sums follow the reference's own
    order (its MKL sgemm, :func:`~ds41numba.f32_products.linear_f32_ordered`) for a call of
    x's rows; a plain float32 ``w [out, in]`` goes through numpy's f32 BLAS, in BLAS's order.
    x is ``[..., in]``, float32 or ``ml_dtypes.bfloat16`` (widened exactly, a block of rows at a
    time); returns ``[..., out]`` float32, written into ``out`` when given.
    """
    ordered = isinstance(w, F32Matrix)
    x, w32 = _check_linear(x, w.f32 if ordered else w, "linear_f32")
    x2 = x.reshape(-1, w32.shape[1])
    y = _output(out, (x2.shape[0], w32.shape[0]), "linear_f32")
    product = ((lambda a, b: linear_f32_ordered(a, w, out=b)) if ordered
               else (lambda a, b: np.matmul(a, w32.T, out=b)))
    if x.dtype == np.float32:
        product(x2, y)
    else:
        for a, b in _row_blocks(x2.shape[0], _WIDEN_ROWS):
            product(x2[a:b].astype(np.float32), y[a:b])
    return y.reshape(x.shape[:-1] + (w32.shape[0],))


def _row_blocks(m: int, size: int) -> list[tuple[int, int]]:
    """``0 .. m`` in blocks of ``size`` rows, a short remainder (under 12 rows) joined to the block
    before it: the reference's f32 kernels are chosen by row count, and an M of at least 12
    (or the whole call) keeps every row on the kernel the whole call's M gives it."""
    cuts = list(range(0, m, size)) + [m]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < 12:
        del cuts[-2]
    return list(zip(cuts[:-1], cuts[1:]))


def linear_bf16(x, w, out=None, ref_rows: int | None = None):
    """bf16 linear: ``x @ w.T`` (w holds bf16 values) summed in f32, rounded to bf16 once.

    x is ``[..., in]``; w is ``[out, in]``, a float32 array or a :class:`Bf16Matrix` (which may
    be grouped: see there). With a :class:`Bf16Matrix` the sums follow the reference's order
    (:func:`bf16_k_block`) for a call of ``ref_rows`` rows (default: the rows of x; a tiled
    loop passes the length of the whole step): at most ``MATVEC_MAX_ROWS`` rows (a decode step)
    through the kernel that reads the weight as bf16 bits, more rows of bf16 values through the
    AVX512-BF16 kernel where the CPU has it (:attr:`Bf16Matrix.dot_bf16`). Elsewhere, and for a
    plain float32 ``w``, numpy's f32 BLAS sums in its own order: approximate (README, "How
    exact"). So do products of at most ``TINY_BF16_LINEAR`` multiply-adds per group, which
    torch does not hand to oneDNN but sums in a kernel of its own (an order not pinned down;
    they occur only at toy shapes, where BLAS reproduces the reference's goldens).
    Returns ``[..., out]``, written into ``out`` (a C-contiguous float32 buffer) when given.
    """
    if not isinstance(w, Bf16Matrix):
        return round_bf16_inplace(linear_f32(x, w, out))
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] != w.in_features:
        raise ValueError(f"linear_bf16: x of shape {x.shape} does not match a weight taking "
                         f"{w.in_features} inputs")
    rows = x.size // max(x.shape[-1], 1)
    shape = x.shape[:-1] + (w.f32.shape[0],)
    n_out, k_in = w.f32.shape
    ordered = (rows if ref_rows is None else ref_rows) * (n_out // w.groups) * k_in > TINY_BF16_LINEAR
    if ordered and 0 < rows <= MATVEC_MAX_ROWS:
        if out is None:
            return w.matvec(x, ref_rows)
        y = _output(out, shape, "linear_bf16")
        y[...] = w.matvec(x, ref_rows)
        return y
    if ordered and BF16_DOT:
        y = _output(out, (rows, w.f32.shape[0]), "linear_bf16")
        if w.dot_bf16(x.reshape(rows, w.in_features), y, ref_rows):
            return round_bf16_inplace(y).reshape(shape)
    if w.groups == 1:
        return round_bf16_inplace(linear_f32(x, w.f32, out))
    per_group = x.reshape(-1, w.groups, w.f32.shape[1])
    rank = w.f32.shape[0] // w.groups
    y = _output(out, (rows, w.f32.shape[0]), "linear_bf16")
    for g in range(w.groups):
        linear_f32(per_group[:, g], w.f32[g * rank:(g + 1) * rank], out=y[:, g * rank:(g + 1) * rank])
    return round_bf16_inplace(y).reshape(shape)


@functools.lru_cache(maxsize=1)
def _blas_controller():
    return ThreadpoolController()


def single_threaded_blas(threads: int = 1):
    """A context in which numpy's BLAS runs on ``threads`` threads (default one).

    For work made of many small products (a decode step; one query's attention), BLAS's own
    threads cost more than they give: OpenBLAS's threaded matrix-vector product is several
    times slower here than its single-threaded one. The results are the same either way.
    """
    return _blas_controller().limit(limits=threads, user_api="blas")


@functools.lru_cache(maxsize=1)
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ds41numba")


def in_workers(fn, jobs) -> None:
    """``fn(*job)`` for every job, spread over ``numba.get_num_threads()`` Python threads, each
    with single-threaded BLAS (numpy releases the GIL in BLAS and ufuncs).

    For independent pieces of work (queries, heads, position ranges) whose results do not
    depend on which thread runs them; one job runs in the calling thread.
    """
    jobs = list(jobs)
    with single_threaded_blas():
        if len(jobs) == 1:
            fn(*jobs[0])
            return
        pool = _pool(numba.config.NUMBA_NUM_THREADS)
        for future in [pool.submit(fn, *job) for job in jobs]:
            future.result()


def split_range(n: int, parts: int) -> list[tuple[int, int]]:
    """``0 .. n`` cut into at most ``parts`` near-equal non-empty ranges."""
    cuts = np.linspace(0, n, max(1, min(parts, n)) + 1).astype(int)
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


# ----------------------------------------------------------------------------------------------
# bf16 dot products on AVX512-BF16
# ----------------------------------------------------------------------------------------------

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


def _bf16_dot_supported() -> bool:
    """True when this CPU runs ``vdpbf16ps`` and numba compiles for it (the host CPU, features
    not overridden without it), unless ``DS41NUMBA_BF16_DOT=0`` asks for the f32 BLAS path."""
    if os.environ.get("DS41NUMBA_BF16_DOT", "1") == "0" or numba.config.CPU_NAME not in (None, "host"):
        return False
    features = numba.config.CPU_FEATURES
    if features is not None and "+avx512bf16" not in features.split(","):
        return False
    return bool(llb.get_host_cpu_features().get("avx512bf16", False))


#: Whether the AVX512-BF16 micro-kernel is used (decided once, at import).
BF16_DOT = _bf16_dot_supported()


@intrinsic
def _bf16_dot_tile(typingctx, a, b, out):
    """``out[m, j] += sum_p a[m, p] . b[p, j]`` for ``m < DOT_ROWS``, ``j < DOT_LANES``.

    ``a`` (uint32 ``[DOT_ROWS, P]``) and ``b`` (uint32 ``[P, DOT_LANES]``) hold pairs of bf16
    values (element ``2p`` in the low half); ``out`` is float32 ``[DOT_ROWS, DOT_LANES]``. The
    rows of each may lie apart, each row is contiguous. Each lane continues its sum in p order
    with ``vdpbf16ps``: products exact, sums rounded to f32 (RNE), denormal inputs and results
    flushed to zero. The caller checks the shapes; P >= 1.
    """
    sig = types.void(a, b, out)

    def codegen(context, builder, signature, args):
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        v16i, v16f = ir.VectorType(i32, 16), ir.VectorType(f32, 16)
        # The bf16 pairs as <16 x i32>: the intrinsic's original type, which LLVMs that have
        # since typed it <32 x bfloat> upgrade as they read the IR (llvmlite has no bfloat type).
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16f, [v16f, v16i, v16i]),
                                             "llvm.x86.avx512bf16.dpbf16ps.512")
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)]
        (a_base, a_row), (b_base, b_row), (o_base, o_row) = [
            (builder.ptrtoint(ary.data, i64), cgutils.unpack_tuple(builder, ary.strides, 2)[0])
            for ary in arrays]
        n_pairs = cgutils.unpack_tuple(builder, arrays[1].shape, 2)[0]
        nvec = DOT_LANES // 16

        def at(base, row_stride, row, offset, ty):
            addr = builder.add(base, builder.add(builder.mul(row_stride, row), offset))
            return builder.inttoptr(addr, ty.as_pointer())

        def const(v):
            return ir.Constant(i64, v)

        out_ptrs = [[at(o_base, o_row, const(m), const(64 * v), v16f) for v in range(nvec)]
                    for m in range(DOT_ROWS)]
        start = [[builder.load(ptr, align=4) for ptr in row] for row in out_ptrs]
        entry = builder.basic_block
        loop = builder.append_basic_block("bf16dot.loop")
        done = builder.append_basic_block("bf16dot.done")
        builder.branch(loop)
        builder.position_at_end(loop)
        p = builder.phi(i64)
        p.add_incoming(const(0), entry)
        acc = [[builder.phi(v16f) for _ in range(nvec)] for _ in range(DOT_ROWS)]
        for m in range(DOT_ROWS):
            for v in range(nvec):
                acc[m][v].add_incoming(start[m][v], entry)
        bv = [builder.load(at(b_base, b_row, p, const(64 * v), v16i), align=4) for v in range(nvec)]
        new = []
        for m in range(DOT_ROWS):
            pair = builder.load(at(a_base, a_row, const(m), builder.mul(p, const(4)), i32), align=4)
            splat = builder.insert_element(ir.Constant(v16i, ir.Undefined), pair, ir.Constant(i32, 0))
            splat = builder.shuffle_vector(splat, splat, ir.Constant(v16i, None))
            new.append([builder.call(dot, [acc[m][v], bv[v], splat]) for v in range(nvec)])
        p_next = builder.add(p, const(1))
        p.add_incoming(p_next, loop)
        for m in range(DOT_ROWS):
            for v in range(nvec):
                acc[m][v].add_incoming(new[m][v], loop)
        builder.cbranch(builder.icmp_signed("<", p_next, n_pairs), loop, done)

        builder.position_at_end(done)
        for m in range(DOT_ROWS):
            for v in range(nvec):
                builder.store(new[m][v], out_ptrs[m][v], align=4)
        return context.get_dummy_value()

    return sig, codegen


def bf16_k_block(ref_rows: int, k: int) -> int:
    """How many inner-dimension elements the reference's bf16 linear sums in one run.

    torch's CPU bf16 linear (oneDNN's brgemm on AVX512-BF16) splits K into runs, sums each
    from zero with ``vdpbf16ps`` (each pair as ``(acc + p[2i+1]) + p[2i]``) and adds the run
    sums in order (../shared/orders/README.md, measured on the reference's machine):
    K <= 512 one run; one row (every decode step) runs of 512; two or more rows runs of 512 up
    to K = 1024 and of 1024 above. ``ref_rows`` is the number of rows the *reference* multiplies
    in that call (a prefill's length, 1 at decode), not the rows of a tile of ours.
    """
    if k <= 512:
        return k
    return 512 if ref_rows == 1 or k <= 1024 else 1024


# A product of many rows runs in work items of _GEMM_ROWS rows by one block of DOT_LANES
# columns, over the inner dimension _GEMM_PAIRS pairs at a time: that slice of B (32 KB) stays
# in L1 while every row group of the item passes over it.
_GEMM_ROWS = 256
_GEMM_PAIRS = 256


@njit(parallel=True, cache=True)
def _gemm_bf16_kernel(a, b, out, groups, block_pairs):
    """``out = a . b`` for every block of columns: ``a [M, groups * P]`` (M a multiple of
    DOT_ROWS), ``b [blocks, P, DOT_LANES]``, ``out [M, blocks * DOT_LANES]`` float32.

    The blocks split evenly into ``groups``; block j belongs to group ``g = j // (blocks /
    groups)`` and reads the pairs ``g*P .. (g+1)*P`` of A (the grouped projection). The inner
    dimension is summed in the reference's order (:func:`bf16_k_block`): runs of
    ``block_pairs`` pairs (a multiple of ``_GEMM_PAIRS``, or >= P for one run), each from zero,
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
        for k0 in range(0, P, _GEMM_PAIRS):
            k1 = min(P, k0 + _GEMM_PAIRS)
            later = k0 >= block_pairs
            starts = later and k0 % block_pairs == 0
            ends = later and (k1 == P or k1 % block_pairs == 0)
            b_panel = b[j, k0:k1]
            for r in range(0, r1 - r0, DOT_ROWS):
                t = run[r:r + DOT_ROWS] if later else o[r:r + DOT_ROWS]
                if starts:
                    t[:] = 0
                _bf16_dot_tile(a_rows[r:r + DOT_ROWS, k0:k1], b_panel, t)
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
    x = np.ascontiguousarray(_as_f32_array(x, name))
    if x.ndim != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: x must be [n, d] with d even, got shape {x.shape}")
    return x.view(np.uint32)


def bf16_pairs(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16-valued rows ``x [n, d]`` (d even) as the A operand of the AVX512-BF16 micro-kernel:
    uint32 ``[n, d / 2]``, values ``2p`` and ``2p + 1`` of a row in element p (into ``out``
    when given)."""
    bits = _pair_bits(x, "bf16_pairs")
    out = _output(out, (bits.shape[0], bits.shape[1] // 2), "bf16_pairs", np.uint32)
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

# ----------------------------------------------------------------------------------------------
# bf16 weights as bits, for matrix-vector products
# ----------------------------------------------------------------------------------------------

# A decode step multiplies one row by every weight: it is bound by reading the weights, so it
# reads them as bf16 bits. Output rows are packed in blocks of _MV_BLOCK laid out [in, block], so
# each block streams contiguously and the inner loop runs across the block's outputs (SIMD lanes
# without reassociating any sum: every output still adds its products in input order).
_MV_BLOCK = 64
#: At most this many input rows take the fused bf16-bits kernel; more go through BLAS.
MATVEC_MAX_ROWS = 8
#: bf16 products of at most this many multiply-adds (M * N * K, per group) are not oneDNN's in
#: the reference but torch's own kernel (../shared/orders/README.md: "about 4096"; the toy
#: goldens agree: their 2,048-MAC decode products follow BLAS, their 8,192-MAC ones oneDNN).
TINY_BF16_LINEAR = 4096


@njit(cache=True)
def _widen(bits):
    """A bf16 bit pattern (uint16) as the f32 it stands for."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@njit(parallel=True, cache=True)
def _matvec_bf16_kernel(x, bits, out, groups, block):
    """``out = bf16(x @ W.T)`` for W packed as bf16 bits ``[blocks, in, _MV_BLOCK]``.

    The blocks split evenly into ``groups``; block b belongs to group ``g = b // (blocks /
    groups)``, reads inputs ``x[:, g*in : (g+1)*in]`` and writes outputs ``g*rank + ...``
    (``rank = out.shape[1] / groups``); padding rows of a group's last block are dropped. Each
    output adds its products in the reference's order: runs of ``block`` inputs (even, see
    :func:`bf16_k_block`) each from zero, every pair as ``(acc + p[2i+1]) + p[2i]``, run sums
    added in order. Two pairs per pass keep the accumulator in a register (measured faster
    here than one or four: enough work per load of the accumulators, few enough weight rows
    in flight).
    """
    m = x.shape[0]
    k_in = bits.shape[1]
    per_group = bits.shape[0] // groups
    rank = out.shape[1] // groups
    for b in prange(bits.shape[0]):
        g = b // per_group
        x0_col = g * k_in
        acc = np.zeros((m, _MV_BLOCK), np.float32)
        part = np.empty(_MV_BLOCK, np.float32)
        for i in range(m):
            xi = x[i, x0_col:x0_col + k_in]
            for k0 in range(0, k_in, block):
                k1 = min(k_in, k0 + block)
                # The first run sums straight into the output row, later ones from zero apart.
                run = acc[i] if k0 == 0 else part
                if k0:
                    run[:] = 0
                k4 = k0 + (k1 - k0) // 4 * 4
                for k in range(k0, k4, 4):
                    x0, x1, x2, x3 = xi[k], xi[k + 1], xi[k + 2], xi[k + 3]
                    for j in range(_MV_BLOCK):
                        a = run[j]
                        a = (a + x1 * _widen(bits[b, k + 1, j])) + x0 * _widen(bits[b, k, j])
                        a = (a + x3 * _widen(bits[b, k + 3, j])) + x2 * _widen(bits[b, k + 2, j])
                        run[j] = a
                if k1 - k4 >= 2:
                    x0, x1 = xi[k4], xi[k4 + 1]
                    for j in range(_MV_BLOCK):
                        run[j] = (run[j] + x1 * _widen(bits[b, k4 + 1, j])) + x0 * _widen(bits[b, k4, j])
                if (k1 - k4) % 2:
                    for j in range(_MV_BLOCK):
                        run[j] += xi[k1 - 1] * _widen(bits[b, k1 - 1, j])
                if k0:
                    for j in range(_MV_BLOCK):
                        acc[i, j] += part[j]
        first = (b - g * per_group) * _MV_BLOCK
        for i in range(m):
            for j in range(min(_MV_BLOCK, rank - first)):
                out[i, g * rank + first + j] = bf16_scalar(acc[i, j])


def _even_width(x):
    """``x [n, d]`` with a zero column appended when d is odd: the kernels take pairs, and a last
    pair ``(p, 0)`` adds ``p`` alone, which is the reference's order for an odd K."""
    if x.shape[1] % 2 == 0:
        return x
    return np.concatenate([x, np.zeros((x.shape[0], 1), x.dtype)], axis=1)


class Bf16Matrix:
    """A bf16-valued weight: f32 for BLAS, and bf16 bits for matrix-vector products.

    ``w [out, in]``. With ``groups = G > 1`` it is the reference's grouped projection (``wo_a``):
    the input splits into G equal parts and part g goes through rows ``g*out/G .. (g+1)*out/G``
    only, so ``in_features = G * in``. The f32 array is kept as given (no copy when already
    C-contiguous float32); the packed bits are built on the first matrix-vector product, the
    AVX512-BF16 operand on the first product of many rows (each half the f32 weight's size).
    Treat the weight as read-only once wrapped.
    """

    __slots__ = ("f32", "groups", "_bits", "_pairs")

    def __init__(self, w, groups: int = 1):
        w = np.ascontiguousarray(_as_f32_array(w, "Bf16Matrix"))
        if w.ndim != 2:
            raise ValueError(f"Bf16Matrix: expected a 2-D [out, in] weight, got shape {w.shape}")
        if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1 \
                or w.shape[0] % groups:
            raise ValueError(f"Bf16Matrix: groups must be a positive divisor of out "
                             f"({w.shape[0]}), got {groups!r}")
        self.f32 = w
        self.groups = int(groups)
        self._bits = None
        self._pairs = None

    @property
    def shape(self):
        return self.f32.shape

    @property
    def in_features(self):
        return self.f32.shape[1] * self.groups

    def _packed(self):
        if self._bits is None:
            n_out, k_in = self.f32.shape
            rank = n_out // self.groups
            nb = -(-rank // _MV_BLOCK)
            hi = np.zeros((self.groups, nb * _MV_BLOCK, k_in), np.uint16)
            hi[:, :rank] = (self.f32.view(np.uint32) >> 16).reshape(self.groups, rank, k_in)
            blocks = hi.reshape(self.groups * nb, _MV_BLOCK, k_in)
            self._bits = np.ascontiguousarray(blocks.transpose(0, 2, 1))
        return self._bits

    def _packed_pairs(self):
        if self._pairs is None:
            n_out, k_in = self.f32.shape
            rank = n_out // self.groups
            nb = -(-rank // DOT_LANES)
            self._pairs = np.zeros((self.groups * nb, -(-k_in // 2), DOT_LANES), np.uint32)
            for g in range(self.groups):
                pack_bf16_pairs(_even_width(self.f32[g * rank:(g + 1) * rank]),
                                self._pairs[g * nb:(g + 1) * nb])
        return self._pairs

    def dot_bf16(self, x, out, ref_rows: int | None = None) -> bool:
        """``out = x @ w.T`` in f32 (not rounded) on AVX512-BF16, for rows ``x [m, in_features]``
        of bf16 values (float32 or ``ml_dtypes.bfloat16``): the products are exact and each output
        sums them in the reference's order for a call of ``ref_rows`` rows (default ``m``; see
        :func:`bf16_k_block`), at nearly twice the f32 rate. Returns False where it cannot run
        (no AVX512-BF16, x not bf16-valued; ``out`` may then be partly
        written): use BLAS instead.

        Rows run ``_WIDEN_ROWS`` at a time, so the operand copy of a long input stays small. The
        weight is packed on the first call (a second copy, half the f32 weight's size).
        """
        k_in = self.f32.shape[1]
        if not BF16_DOT:
            return False
        x = np.ascontiguousarray(x)
        m, n_out = x.shape[0], self.f32.shape[0]
        rank = n_out // self.groups
        b = self._packed_pairs()
        block_pairs = bf16_k_block(m if ref_rows is None else ref_rows, k_in) // 2
        for r0 in range(0, m, _WIDEN_ROWS):
            chunk = _even_width(x[r0:r0 + _WIDEN_ROWS])
            n = chunk.shape[0]
            rows = -(-n // DOT_ROWS) * DOT_ROWS
            if x.dtype.name == "bfloat16":          # already pairs of bf16, in memory order
                a = chunk.view(np.uint32)
                if rows != n:
                    a = np.concatenate([a, np.zeros((rows - n, a.shape[1]), np.uint32)])
            else:
                a = (np.zeros if rows != n else np.empty)((rows, chunk.shape[1] // 2), np.uint32)
                if _pairs_kernel(np.ascontiguousarray(chunk, np.float32).view(np.uint32), a[:n]):
                    return False
            y = out[r0:r0 + n]
            if rows == n and rank % DOT_LANES == 0 and y.flags.c_contiguous:
                _gemm_bf16_kernel(a, b, y, self.groups, block_pairs)
            else:
                padded = np.empty((rows, b.shape[0] * DOT_LANES), np.float32)
                _gemm_bf16_kernel(a, b, padded, self.groups, block_pairs)
                y[...] = padded[:n].reshape(n, self.groups, -1)[:, :, :rank].reshape(n, n_out)
        return True

    def matvec(self, x, ref_rows: int | None = None):
        """``bf16(x @ w.T)`` for a few rows ``x [..., in_features]``, reading the bf16 bits, summed
        in the reference's order for a call of ``ref_rows`` rows (default: the rows of x)."""
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.in_features)
        out = np.empty((x2.shape[0], self.f32.shape[0]), np.float32)
        k_in = self.f32.shape[1]
        block = bf16_k_block(x2.shape[0] if ref_rows is None else ref_rows, k_in)
        _matvec_bf16_kernel(x2, self._packed(), out, self.groups, block + block % 2)
        return out.reshape(x.shape[:-1] + (self.f32.shape[0],))



# torch's CPU sum of a contiguous f32 row (ATen SumKernel: ``vectorized_inner_sum`` / ``row_sum`` /
# ``multi_row_sum``), the reduction inside the reference RMSNorm's ``x.square().mean(-1)``. The sum
# kernel is registered with REGISTER_DISPATCH, which leaves the AVX512 slot empty, so even on the
# reference's AVX512 machine torch runs its AVX2 build: Vectorized<float> has 8 lanes.
SUM_LANES = 8
_SUM_ILP = 4
_SUM_LEVELS = 4


@njit(cache=True)
def _ceil_log2(x):
    if x <= 2:
        return 1
    r = 0
    v = x - 1
    while v > 0:
        v >>= 1
        r += 1
    return r


@njit(cache=True)
def _add_group(x, square, lanes, i, acc):
    """Group i (4 vectors of ``lanes`` values) into the 4 ILP partial sums ``acc[0]``."""
    for k in range(_SUM_ILP):
        base = (i * _SUM_ILP + k) * lanes
        for l in range(lanes):
            v = x[base + l]
            acc[0, k, l] += v * v if square else v


@njit(cache=True)
def _multi_row_sum(x, square, lanes, size, acc):
    """``multi_row_sum`` with 4 ILP rows of ``lanes`` lanes over ``size`` groups of 4 * lanes values:
    ``acc[0, k, l]`` ends with the sum of values ``(4 * i + k) * lanes + l``, accumulated in cascade
    levels of 16 groups (more for huge rows). ``acc`` is ``[levels, 4, lanes]`` f32, zeroed."""
    level_power = max(4, _ceil_log2(size) // _SUM_LEVELS)
    level_step = 1 << level_power
    level_mask = level_step - 1
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            _add_group(x, square, lanes, i, acc)
            i += 1
        for j in range(1, _SUM_LEVELS):
            for k in range(_SUM_ILP):
                for l in range(lanes):
                    acc[j, k, l] += acc[j - 1, k, l]
                    acc[j - 1, k, l] = np.float32(0.0)
            if (i & (level_mask << (j * level_power))) != 0:
                break
    while i < size:
        _add_group(x, square, lanes, i, acc)
        i += 1
    for j in range(1, _SUM_LEVELS):
        for k in range(_SUM_ILP):
            for l in range(lanes):
                acc[0, k, l] += acc[j, k, l]


@njit(cache=True)
def torch_sum_f32(x, square):
    """The f32 sum of the 1-D float32 row ``x`` (of its squares, each rounded to f32, when ``square``)
    in exactly the order torch's CPU ``sum`` over a contiguous last dimension adds them with 8-lane
    vectors (below 8 values: its scalar path, 4 interleaved partial sums). Thread-count independent."""
    n = x.shape[0]
    lanes = SUM_LANES if n >= SUM_LANES else 1
    groups = n // lanes  # vectors (or scalars)
    acc = np.zeros((_SUM_LEVELS, _SUM_ILP, lanes), dtype=np.float32)
    _multi_row_sum(x, square, lanes, groups // _SUM_ILP, acc)
    # row_sum: leftover vectors into partial 0, then partials 1..3 into partial 0, in order.
    for g in range(groups - groups % _SUM_ILP, groups):
        for l in range(lanes):
            v = x[g * lanes + l]
            acc[0, 0, l] += v * v if square else v
    for k in range(1, _SUM_ILP):
        for l in range(lanes):
            acc[0, 0, l] += acc[0, k, l]
    if lanes == 1:
        return acc[0, 0, 0]
    # vectorized_inner_sum: the scalar tail first, then the lanes in order.
    total = np.float32(0.0)
    for e in range(groups * lanes, n):
        v = x[e]
        total += v * v if square else v
    for l in range(lanes):
        total += acc[0, 0, l]
    return total


@njit(cache=True)
def _rms_norm_row(x, w, eps, out):
    n = x.shape[0]
    mean = torch_sum_f32(x, True) / np.float32(n)
    r = np.float32(1.0) / np.sqrt(mean + eps)
    for j in range(n):
        out[j] = bf16_scalar((x[j] * r) * w[j])


@njit(parallel=True, cache=True)
def _rms_norm_kernel(x, w, eps, out):
    for i in prange(x.shape[0]):
        _rms_norm_row(x[i], w, eps, out[i])


@njit(cache=True)
def _rms_norm_serial(x, w, eps, out):
    for i in range(x.shape[0]):
        _rms_norm_row(x[i], w, eps, out[i])


def rms_norm(x, w, eps):
    """RMSNorm over the last dimension in f32: ``bf16((x * (1 / sqrt(mean(x^2) + eps))) * w)``.

    ``mean`` is the f32 sum of the f32 squares divided (f32) by n. The sum adds in torch's CPU order
    (``torch_sum_f32``), not left to right: on the goldens that order reproduces an order of magnitude
    more RMSNorm outputs bit for bit than an in-order sum. x is ``[..., n]``, w ``[n]``.
    """
    x = _as_f32_array(x, "rms_norm: x")
    w = _as_f32_array(w, "rms_norm: w")
    if w.ndim != 1:
        raise ValueError(f"rms_norm: w must be 1-D, got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[0] or w.shape[0] == 0:
        raise ValueError(f"rms_norm: x of shape {x.shape} does not match w of shape {w.shape}")
    x2 = np.ascontiguousarray(x).reshape(-1, w.shape[0])
    wc = np.ascontiguousarray(w)
    out = np.empty_like(x2)
    if x2.size >= _PARALLEL_MIN:
        _rms_norm_kernel(x2, wc, np.float32(eps), out)
    elif x2.shape[0]:
        _rms_norm_serial(x2, wc, np.float32(eps), out)
    return out.reshape(x.shape)
