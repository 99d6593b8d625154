"""Number formats: rounding f32 onto bf16, float8 e4m3, float4 e2m1 and powers of two, bit for bit.

The reference rounds to bf16 after almost every op and quantises KV and index tensors to fp8/fp4,
so an implementation is only as exact as these roundings. Each is done on the IEEE bit pattern of
the f32 input (RNE on the integer significand), never through a float64 intermediate that could
round twice. The scalar roundings (``bf16_scalar``, ``e4m3_scalar``, ``e2m1_scalar``,
``pow2ceil_scalar``) and ``nan_max`` are plain ``@njit`` functions so that other kernels can call
them inside their own loops, as they call ``fma_f32`` (``a * b + c`` rounded once: the fused
multiply-adds of rope's rotation and Sleef's ``expf``); the array functions validate at the
Python boundary and hand off to parallel kernels. The array helpers at the end (``as_f32_array``, ``check_inplace``,
``output_buffer``) are the boundary checks the package's numeric functions share.
"""

from __future__ import annotations

import math
import numbers

import llvmlite.ir as ir
import numpy as np
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..jit import njit
from .workers import worth_parallel

__all__ = ["is_int", "FP4_BLOCK", "LATENT_BLOCK", "FP8_BLOCK", "E4M3_MAX", "E2M1_MAX", "bf16_scalar",
           "bf16_scalar_no_payload",
           "e4m3_scalar", "e2m1_scalar", "pow2ceil_scalar", "nan_max", "to_bf16_rne", "to_e4m3_rne",
           "to_e2m1_rne", "pow2ceil", "round_bf16_inplace", "is_bf16_valued", "bf16_halves", "as_f32_array",
           "check_inplace", "output_buffer", "aligned_empty", "ELEMENT_COST", "fma_f32"]

FP4_BLOCK = 32
LATENT_BLOCK = 16
FP8_BLOCK = 32

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# An element of an element-wise pass, in multiply-adds (workers.worth_parallel).
ELEMENT_COST = 8
# Elements per parallel work item of the element-wise kernels.
_CHUNK = 1 << 14

_F32_NAN_BITS = 0x7FC00000

# ----------------------------------------------------------------------------------------------
# Scalar roundings (callable from any njit kernel)
# ----------------------------------------------------------------------------------------------


@njit
def _f32_from_bits(bits):
    return np.uint32(bits).view(np.float32)


@njit
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


@njit
def _bf16_rne_bits(bits):
    """An f32's bits rounded to bf16's (RNE), truncated: right for every value but a NaN."""
    # Ties go to the even bf16 pattern: add 0x7FFF plus the lowest kept bit, then truncate.
    # Only a NaN pattern can carry out of 32 bits.
    return (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)


@njit
def bf16_scalar(v):
    """Round an f32 to the nearest bf16 value (RNE), returned as f32. NaN -> quiet NaN of the same
    sign (as ml_dtypes), +-inf -> +-inf, overflow past the largest bf16 -> +-inf, -0.0 stays -0.0."""
    bits = np.float32(v).view(np.uint32)
    # NaN takes the other branch: the select is branch-free, so loops over it vectorise.
    nan = (bits & np.uint32(0x80000000)) | np.uint32(_F32_NAN_BITS)
    return _f32_from_bits(nan if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
                          else _bf16_rne_bits(bits))


@njit
def bf16_scalar_no_payload(v):
    """:func:`bf16_scalar` of a value that is no NaN, or a NaN as bf16_scalar makes them (quiet,
    no payload: sign | 0x7FC00000), which is its own rounding: without the NaN branch."""
    return _f32_from_bits(_bf16_rne_bits(np.float32(v).view(np.uint32)))


@njit
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


@njit
def e2m1_scalar(v):
    """f32 -> float4_e2m1fn (RNE) -> f32: |v| onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Binary RNE is the
    reference's even-3-bit-code tie rule, since the codes 0..7 are the format's bit patterns in order.
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


@njit
def pow2ceil_scalar(v):
    """The smallest power of two >= v, exactly: 2^e for v = 1.m * 2^e, times 2 when m != 0. Defined
    for v > 0: a subnormal v gives its exact (possibly subnormal) power of two, v > 2^127 and +inf give
    +inf. Outside the domain (v <= 0, -0.0, NaN) the result is NaN. The quantisers' amax floors keep
    their arguments positive normal, where this is the reference's bit rule."""
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


@njit
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


@njit(parallel=True)
def _convert_kernel(x, op, chunk):
    n = x.shape[0]
    nchunks = (n + chunk - 1) // chunk
    for c in prange(nchunks):
        lo = c * chunk
        _convert_range(x, op, lo, min(lo + chunk, n))


def as_f32_array(x, name):
    arr = np.asarray(x)
    if arr.dtype != np.float32:
        raise TypeError(f"{name}: expected a float32 array, got dtype {arr.dtype}")
    return arr


def _convert(x, op, name):
    arr = as_f32_array(x, name)
    flat = np.array(arr, dtype=np.float32, order="C", copy=True).reshape(-1)
    _run_convert(flat, op)
    return flat.reshape(arr.shape)


def _run_convert(x, op):
    """Convert the 1-D array ``x`` in place."""
    n = x.shape[0]
    if worth_parallel(n, ELEMENT_COST):
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


@njit
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
    arr = as_f32_array(x, "is_bf16_valued")
    flat = np.ascontiguousarray(arr).reshape(-1)
    return bool(_bf16_valued_range(flat, 0, flat.shape[0]))


@njit
def _bf16_halves_range(bits, out, lo, hi):
    """``out[i]``: the high half of ``bits[i]`` (an f32's), for ``i`` in ``lo .. hi``; False when
    one of them is not that f32's value (its low half is not zero) or is a NaN."""
    b, h = bits[lo:hi], out[lo:hi]          # from 0: see _convert_range
    bad = np.uint32(0)
    for i in range(b.shape[0]):
        v = b[i]
        h[i] = np.uint16(v >> np.uint32(16))
        bad |= (v & np.uint32(0xFFFF)) | ((v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
    return bad == 0


@njit(parallel=True)
def _bf16_halves_kernel(bits, out, chunk):
    n = bits.shape[0]
    nchunks = (n + chunk - 1) // chunk
    ok = np.empty(nchunks, np.bool_)
    for c in prange(nchunks):
        lo = c * chunk
        ok[c] = _bf16_halves_range(bits, out, lo, min(lo + chunk, n))
    return ok.all()


def bf16_halves(x):
    """The bf16 bit patterns (uint16, ``x``'s shape) of the float32 array ``x`` when every
    element is a bf16 value and none is a NaN, else None (a NaN's bf16 pattern is a cast's to
    choose). A bf16 value's pattern is the high half of its f32 pattern, so this is exact; it
    runs on every core, where ``ml_dtypes``' cast runs on one."""
    arr = np.ascontiguousarray(as_f32_array(x, "bf16_halves"))
    bits = arr.reshape(-1).view(np.uint32)
    out = np.empty(bits.shape[0], np.uint16)
    n = bits.shape[0]
    if worth_parallel(n, ELEMENT_COST):
        ok = _bf16_halves_kernel(bits, out, _CHUNK)
    else:
        ok = _bf16_halves_range(bits, out, 0, n)
    return out.reshape(arr.shape) if ok else None


def is_int(value, minimum=None) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's, not a bool) of at least ``minimum``
    (any, when None): the one check behind every integer argument's error message."""
    if type(value) is not int:      # Python's int (not bool) answers without the ABC's check
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
            return False
    return minimum is None or value >= minimum


def check_inplace(x, name):
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
    check_inplace(x, "round_bf16_inplace")
    flat = x.reshape(-1)
    _run_convert(flat, _OP_BF16)
    return x



@njit
def nan_max(best, v):
    """The larger of ``best`` and ``v``, where a NaN wins and then stays (torch's max and amax
    propagate NaN): fold it over values starting from -inf (or 0 for magnitudes)."""
    return v if (v > best or v != v) else best


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c with one rounding (LLVM's fma intrinsic; exact even without hardware FMA)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32"
        )
        return builder.call(fn, args)

    return sig, codegen


def output_buffer(out, shape, name, dtype=np.float32):
    """``out`` viewed as ``shape`` (a new ``dtype`` array when None). A caller's buffer lets a tiled
    loop reuse its memory: each fresh array of a prefill's size costs page faults that were ~10%
    of a 4K-token prefill here."""
    dtype = np.dtype(dtype)
    if out is None:
        return np.empty(shape, dtype)
    if (not isinstance(out, np.ndarray) or out.dtype != dtype or not out.flags.writeable
            or out.size != math.prod(shape)):
        raise ValueError(f"{name}: out must be a writeable {dtype} array of shape {list(shape)}, got "
                         f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    view = out.view()
    try:
        view.shape = shape      # a view, never a silent copy the result would be lost in
    except AttributeError:
        raise ValueError(f"{name}: out of shape {list(out.shape)} cannot be viewed as "
                         f"{list(shape)} without a copy: pass a C-contiguous buffer") from None
    return view


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary (numpy's may start on 16):
    a kernel's 64-byte row loads then never cross a cache line."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    per_line = 64 // dtype.itemsize
    raw = np.empty(n + per_line, dtype)
    start = (-(raw.ctypes.data // dtype.itemsize)) % per_line
    return raw[start:start + n].reshape(shape)
