"""Slow, obviously-correct pure-Python references the fast kernels are tested against.

Each slow twin is named after the package function it mirrors: ``naive.sparse_attn`` is the twin
of ``ds41numba.sparse_attn``, ``naive.tile_scores`` of the indexer's ``tile_scores``. Where a
twin returns a new array for a function that works in place (the quantisers) or covers a whole
run (``compressor``), its docstring says so. The sections follow the package's modules.
"""

import ctypes
import ctypes.util
import math

import ml_dtypes
import numpy as np

import ds41numba as ds

F32 = np.float32
F64 = np.float64


# --- topk ---
# A line-by-line transcription of the libstdc++ algorithms torch's CPU topk calls
# (std::nth_element for k * 64 > n, std::partial_sort otherwise), on a Python list of
# (value, index) tuples with integer positions standing in for iterators. See SPEC.md,
# "torch_cpu_topk_set(vals, k)". The std_* functions are named after their libstdc++ originals.

# Incremented each time introselect hits its depth limit and falls back to heap select, so
# tests can check that path is exercised.
TOPK_STATS = {"introselect_heap_select": 0}


def before(a, b):
    """topk's ``_before``, torch's largest=True comparator on (value, index) pairs: NaN first, then larger value."""
    return (math.isnan(a[0]) and not math.isnan(b[0])) or a[0] > b[0]


def _std_push_heap(a, first, hole, top, value, comp):
    parent = (hole - 1) // 2
    while hole > top and comp(a[first + parent], value):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = value


def _std_adjust_heap(a, first, hole, length, value, comp):
    top = hole
    second = hole
    while second < (length - 1) // 2:
        second = 2 * (second + 1)
        if comp(a[first + second], a[first + second - 1]):
            second -= 1
        a[first + hole] = a[first + second]
        hole = second
    if (length & 1) == 0 and second == (length - 2) // 2:
        second = 2 * (second + 1)
        a[first + hole] = a[first + second - 1]
        hole = second - 1
    _std_push_heap(a, first, hole, top, value, comp)


def _std_make_heap(a, first, last, comp):
    if last - first < 2:
        return
    length = last - first
    parent = (length - 2) // 2
    while True:
        value = a[first + parent]
        _std_adjust_heap(a, first, parent, length, value, comp)
        if parent == 0:
            return
        parent -= 1


def _std_pop_heap(a, first, last, result, comp):
    value = a[result]
    a[result] = a[first]
    _std_adjust_heap(a, first, 0, last - first, value, comp)


def _std_heap_select(a, first, middle, last, comp):
    _std_make_heap(a, first, middle, comp)
    for i in range(middle, last):
        if comp(a[i], a[first]):
            _std_pop_heap(a, first, middle, i, comp)


def _std_sort_heap(a, first, last, comp):
    while last - first > 1:
        last -= 1
        _std_pop_heap(a, first, last, last, comp)


def std_partial_sort(a, middle, comp):
    """std::partial_sort(a.begin(), a.begin() + middle, a.end(), comp), in place."""
    _std_heap_select(a, 0, middle, len(a), comp)
    _std_sort_heap(a, 0, middle, comp)


def _std_iter_swap(a, i, j):
    a[i], a[j] = a[j], a[i]


def _std_move_median_to_first(a, result, x, y, z, comp):
    if comp(a[x], a[y]):
        if comp(a[y], a[z]):
            _std_iter_swap(a, result, y)
        elif comp(a[x], a[z]):
            _std_iter_swap(a, result, z)
        else:
            _std_iter_swap(a, result, x)
    elif comp(a[x], a[z]):
        _std_iter_swap(a, result, x)
    elif comp(a[y], a[z]):
        _std_iter_swap(a, result, z)
    else:
        _std_iter_swap(a, result, y)


def _std_unguarded_partition(a, first, last, pivot, comp):
    while True:
        while comp(a[first], a[pivot]):
            first += 1
        last -= 1
        while comp(a[pivot], a[last]):
            last -= 1
        if not first < last:
            return first
        _std_iter_swap(a, first, last)
        first += 1


def _std_unguarded_partition_pivot(a, first, last, comp):
    mid = first + (last - first) // 2
    _std_move_median_to_first(a, first, first + 1, mid, last - 1, comp)
    return _std_unguarded_partition(a, first + 1, last, first, comp)


def _std_unguarded_linear_insert(a, last, comp):
    val = a[last]
    nxt = last - 1
    while comp(val, a[nxt]):
        a[last] = a[nxt]
        last = nxt
        nxt -= 1
    a[last] = val


def _std_insertion_sort(a, first, last, comp):
    if first == last:
        return
    for i in range(first + 1, last):
        if comp(a[i], a[first]):
            val = a[i]
            a[first + 1:i + 1] = a[first:i]  # move_backward
            a[first] = val
        else:
            _std_unguarded_linear_insert(a, i, comp)


def _std_lg(n):
    return n.bit_length() - 1


def _std_introselect(a, first, nth, last, depth_limit, comp):
    while last - first > 3:
        if depth_limit == 0:
            TOPK_STATS["introselect_heap_select"] += 1
            _std_heap_select(a, first, nth + 1, last, comp)
            _std_iter_swap(a, first, nth)
            return
        depth_limit -= 1
        cut = _std_unguarded_partition_pivot(a, first, last, comp)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _std_insertion_sort(a, first, last, comp)


def std_nth_element(a, nth, comp):
    """std::nth_element(a.begin(), a.begin() + nth, a.end(), comp), in place."""
    first, last = 0, len(a)
    if first == last or nth == last:
        return
    _std_introselect(a, first, nth, last, _std_lg(last - first) * 2, comp)


def torch_cpu_topk_set(vals, k):
    """The index set torch's CPU topk(vals, k) returns, sorted ascending (a list of ints)."""
    row = np.asarray(vals, dtype=np.float32)
    n = len(row)
    if not 0 <= k <= n:
        raise ValueError("k out of range")
    if k == 0:
        return []
    pairs = [(float(v), i) for i, v in enumerate(row)]
    if k * 64 > n:
        std_nth_element(pairs, k - 1, before)
    else:
        std_partial_sort(pairs, k, before)
    return sorted(i for _, i in pairs[:k])


def topk_value_multiset(vals, k):
    """The k values topk must keep, NaN first then descending (ties make the indices ambiguous,
    never the values): the sorted-by-order top k, returned as a float32 array."""
    row = np.asarray(vals, dtype=np.float32)
    nan = row[np.isnan(row)]
    rest = np.sort(row[~np.isnan(row)])[::-1]
    return np.concatenate([nan, rest])[:k]


# --- numerics ---
# Roundings through ml_dtypes casts, quantisers and RMSNorm as whole-array numpy.


def to_bf16_rne(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, F32).astype(ml_dtypes.bfloat16).astype(F32)


def to_e4m3_rne(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def to_e2m1_rne(x):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(x, F32).astype(ml_dtypes.float4_e2m1fn).astype(F32)


def pow2ceil(x):
    """Smallest power of two >= v for v > 0 (inf past 2^127); NaN for v <= 0 or NaN."""
    with np.errstate(invalid="ignore"):
        v = np.asarray(x, F32).astype(np.float64)
    out = np.full(v.shape, np.nan)
    ok = v > 0
    m, e = np.frexp(np.where(ok & np.isfinite(v), v, 1.0))  # v = m * 2^e, m in [0.5, 1)
    p = np.ldexp(1.0, np.where(m == 0.5, e - 1, e))
    out[ok] = p[ok]
    out[np.isposinf(v)] = np.inf
    with np.errstate(over="ignore"):
        return out.astype(F32)


def _quant(x, block, amax_floor, scale_fn, bound, cast):
    x = np.asarray(x, F32)
    b = x.reshape(-1, block)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = np.maximum(np.max(np.abs(b), axis=1), F32(amax_floor))
        s = scale_fn(amax / F32(bound))[:, None]
        y = np.clip(b / s, F32(-bound), F32(bound))
        q = to_bf16_rne(cast(y) * s)
    return q.reshape(x.shape)


def act_quant_fp8_inplace(x, block=32):
    """The quantised copy of ``x`` (a new array)."""
    return _quant(x, block, 1e-4, pow2ceil, 448.0, to_e4m3_rne)


def fp4_quant_e8m0_inplace(x, block=32):
    """The quantised copy of ``x`` (a new array)."""
    return _quant(x, block, 6.0 * 2.0**-126, pow2ceil, 6.0, to_e2m1_rne)


def fp4_quant_e4m3_inplace(x, block=16):
    """The quantised copy of ``x`` (a new array)."""
    return _quant(x, block, 6.0 * 2.0**-9, to_e4m3_rne, 6.0, to_e2m1_rne)


def torch_sum_f32(row, lanes=8):
    """torch's CPU sum of one contiguous f32 row, transcribed from ATen's SumKernel.cpp
    (vectorized_inner_sum -> row_sum -> multi_row_sum) with numpy f32 vectors standing in for
    Vectorized<float>; below ``lanes`` values, its scalar_inner_sum (the same row_sum on scalars)."""
    row = np.asarray(row, F32)
    n = row.shape[0]
    vectorized = n >= lanes
    width = lanes if vectorized else 1
    vecs = [row[i * width:(i + 1) * width] for i in range(n // width)]
    zero = np.zeros(width, F32)

    # row_sum(in, size=len(vecs)) with ilp_factor 4 -> multi_row_sum over size // 4 rows of 4
    ilp, levels = 4, 4
    size = len(vecs) // ilp
    ceil_log2 = 1 if size <= 2 else int(size - 1).bit_length()
    level_power = max(4, ceil_log2 // levels)
    level_step, level_mask = 1 << level_power, (1 << level_power) - 1
    acc = [[zero.copy() for _ in range(ilp)] for _ in range(levels)]
    i = 0
    while i + level_step <= size:
        for _ in range(level_step):
            for k in range(ilp):
                acc[0][k] = acc[0][k] + vecs[i * ilp + k]
            i += 1
        for j in range(1, levels):
            for k in range(ilp):
                acc[j][k] = acc[j][k] + acc[j - 1][k]
                acc[j - 1][k] = zero.copy()
            if i & (level_mask << (j * level_power)):
                break
    while i < size:
        for k in range(ilp):
            acc[0][k] = acc[0][k] + vecs[i * ilp + k]
        i += 1
    for j in range(1, levels):
        for k in range(ilp):
            acc[0][k] = acc[0][k] + acc[j][k]
    partial = acc[0]
    for v in vecs[size * ilp:]:
        partial[0] = partial[0] + v
    for k in range(1, ilp):
        partial[0] = partial[0] + partial[k]
    if not vectorized:
        return F32(partial[0][0])
    total = F32(0.0)
    for v in row[len(vecs) * width:]:
        total = F32(total + v)
    for v in partial[0]:
        total = F32(total + v)
    return total


@np.errstate(invalid="ignore", over="ignore")
def rms_norm(x, w, eps):
    x = np.asarray(x, F32)
    sq = x * x
    ss = np.array([torch_sum_f32(r) for r in sq.reshape(-1, x.shape[-1])], F32)
    r = F32(1.0) / np.sqrt(ss.reshape(x.shape[:-1] + (1,)) / F32(x.shape[-1]) + F32(eps))
    return to_bf16_rne((x * r) * np.asarray(w, F32))


def linear_bf16(x, w):
    """The exact dot products (float64 holds each bf16 x bf16 product exactly), rounded to f32 and
    then to bf16: a summation-order-free reference, equal to an f32 accumulation within rounding."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    return to_bf16_rne((x @ w.T).astype(F32))


def bf16_k_block(ref_rows, k):
    """numerics.bf16_k_block: the reference's run length over K (docs/exactness.md, "bf16 linears")."""
    if k <= 512:
        return k
    return 512 if ref_rows == 1 or k <= 1024 else 1024


def linear_bf16_ordered(x, w, ref_rows=None):
    """linear_bf16 of a Bf16Matrix: summed as torch's CPU bf16 linear does. K in runs
    (bf16_k_block), each run from zero taking pair i as ``(acc + p[2i+1]) + p[2i]`` (a last odd
    product alone), run sums added in order, then one bf16 rounding. Literal and slow."""
    x = np.asarray(x, F32).reshape(-1, np.shape(w)[1])
    w = np.asarray(w, F32)
    k = x.shape[1]
    p = x[:, None, :] * w[None, :, :]               # exact: a bf16 x bf16 product fits in f32
    run = bf16_k_block(x.shape[0] if ref_rows is None else ref_rows, k)
    total = None
    for a in range(0, k, run):
        acc = np.zeros(p.shape[:2], F32)
        b = min(k, a + run)
        for i in range(a, b - 1, 2):
            acc = (acc + p[:, :, i + 1]) + p[:, :, i]
        if (b - a) % 2:
            acc = acc + p[:, :, b - 1]
        total = acc if total is None else total + acc
    return to_bf16_rne(total)


# --- rope ---
# The rotary table written after the reference's torch code, the rotation in explicit f32 real
# arithmetic. (numpy's own complex64 product fuses a*c - b*d into an FMA, which the reference's
# complex multiply does not.)


def yarn_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
    f32 = F32
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(
        np.float64)).astype(f32)
    if original_seq_len > 0:
        def correction_dim(num_rotations):
            return dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        linear = (np.arange(dim // 2, dtype=f32) - f32(low)) / f32(max(high - low, 0.001))
        smooth = f32(1) - np.clip(linear, f32(0), f32(1))
        freqs = freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth
    angle = np.outer(np.arange(seqlen).astype(f32), freqs)
    assert angle.dtype == f32
    # torch.polar: the C library's cosf / sinf of each f32 angle, called one by one.
    cosf, sinf = libm_cosf_sinf()
    flat = angle.reshape(-1).tolist()
    return (np.array([cosf(a) for a in flat], f32).reshape(angle.shape),
            np.array([sinf(a) for a in flat], f32).reshape(angle.shape))


def libm_cosf_sinf():
    """The C library's single-precision cosf and sinf (what torch.polar calls), through ctypes."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    for fn in (libm.cosf, libm.sinf):
        fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
    return libm.cosf, libm.sinf


def values_range(x):
    """``numerics.values_range``, one value at a time: ``(ok, lowest, highest)`` biased exponent
    of the non-zero values of f32 ``x`` (of the bf16 values of its pairs, when uint32), ok False
    where one is not a bf16 value, is denormal, inf or NaN (whose exponent, 255, counts)."""
    bits = np.ascontiguousarray(x).reshape(-1)
    if bits.dtype == np.uint32:                     # pairs: each half a bf16 value's top bits
        bits = np.stack([bits << 16, bits & 0xFFFF0000], axis=-1).reshape(-1)
    else:
        bits = bits.astype(F32).view(np.uint32)
    ok, lo, hi = True, 255, 0
    for b in bits.tolist():
        if b & 0xFFFF:
            ok = False
        if b & 0x7FFFFFFF:
            e = (b >> 23) & 0xFF
            ok = ok and e not in (0, 255)
            lo, hi = min(lo, e), max(hi, e)
    return ok, lo, hi


# NaN and infinities propagate through this reference as IEEE arithmetic says (the kernels'
# behaviour under test), so numpy's warnings about them are expected here.
@np.errstate(invalid="ignore", over="ignore")
def fma_f32(a, b, c):
    """``numerics.fma_f32``: exact a * b + c rounded once to f32. The f32 product is exact in float64; the float64 sum's
    rounding error is recovered with TwoSum and decides the one case where rounding that sum to f32
    would round twice: a sum that lands exactly on a midpoint between two f32 values."""
    f64 = np.float64
    p = np.asarray(a, F32).astype(f64) * np.asarray(b, F32).astype(f64)
    cc = np.asarray(c, F32).astype(f64)
    s = p + cc
    bb = s - p
    err = (p - (s - bb)) + (cc - bb)
    r = s.astype(F32)
    # The f32 neighbour of r on s's side, and whether s sits exactly halfway between the two.
    toward = np.nextafter(r, np.where(s > r.astype(f64), F32(np.inf), F32(-np.inf)))
    midpoint = (r.astype(f64) != s) & ((r.astype(f64) + toward.astype(f64)) / 2 == s)
    # On a midpoint the exact value lies on err's side of it.
    lo = np.minimum(r, toward)
    hi = np.maximum(r, toward)
    r = np.where(midpoint & (err > 0), hi, np.where(midpoint & (err < 0), lo, r))
    return r


# NaN and infinities propagate through this reference as IEEE arithmetic says (the kernels'
# behaviour under test), so numpy's warnings about them are expected here.
@np.errstate(invalid="ignore", over="ignore")
def apply_rotary(x, positions, table, inverse=False, coalesce_rows=None):
    """Pair by pair, as torch's complex64 multiply (AVX2 build) runs the reference's broadcast
    product: inner loops of rd/2 pairs per vector (one loop over all n * rd/2 pairs when x has one
    vector per row), whole blocks of 8 pairs with rounded products, the rest with the compiler's FMA
    contraction of ``a*c - b*d`` and ``a*d + b*c`` (the first product of each kept exact)."""
    x = np.array(x, dtype=F32)
    cos, sin = table
    w = cos.shape[1]
    n = x.shape[0]
    y = x.reshape(n, -1, x.shape[-1])
    heads = y.shape[1]
    coalesce = heads == 1 if coalesce_rows is None else coalesce_rows
    off = x.shape[-1] - 2 * w
    loop_len = n * w if coalesce else w
    vec_end = loop_len // 8 * 8
    for i in range(n):
        c = cos[positions[i]]
        s = -sin[positions[i]] if inverse else sin[positions[i]]
        t = i * w + np.arange(w) if coalesce else np.arange(w)
        vec = t < vec_end
        for h in range(heads):
            a = y[i, h, off::2].copy()
            b = y[i, h, off + 1::2].copy()
            re = np.where(vec, a * c - b * s, fma_f32(a, c, -(b * s)))
            im = np.where(vec, a * s + b * c, fma_f32(a, s, b * c))
            y[i, h, off::2] = to_bf16_rne(re)
            y[i, h, off + 1::2] = to_bf16_rne(im)
    return y.reshape(x.shape)


# --- f32 products ---
# The reference's f32 linears and NN matmuls in the summation order measured for its MKL sgemm
# (docs/exactness.md, "f32 linears"), written out row by row: numpy f32 arithmetic over all output
# columns at once, the fused multiply-add through fma_f32 above.


def linear_f32_ordered(x, w, nn=False):
    """``F.linear(x, w)`` (``w [N, K]``), or ``x @ w`` with ``nn=True`` (``w [K, N]``), for
    ``x [M, K]``, as the reference's two-thread MKL sums it. Rows ``m < nb`` (nb = M for M >= 12,
    else 4 * (M // 4)) take the blocked kernel: FMA chains from 0 over blocks of 192 k, block sums
    added in order. The other rows: for nn, one chain of rounded products over all k; else four
    lanes of rounded products after a peel (M = 1: from w's leading dimension, 4 - (-ldw mod 4);
    otherwise from x's, (-m * ldx) mod 4), reduced (l0 + l2) + (l1 + l3), then the leftovers."""
    x = np.asarray(x, F32)
    w = np.asarray(w, F32)
    wt = w.T if nn else w                       # [N, K]: wt[:, k] is the column of products' k
    M, K = x.shape
    N = wt.shape[0]
    ldx = x.strides[0] // 4 if M > 1 else K
    ldw = w.strides[0] // 4 if w.shape[0] > 1 else w.shape[1]
    nb = M if M >= 12 else 4 * (M // 4)
    out = np.zeros((M, N), F32)
    if nb:
        total = np.zeros((nb, N), F32)
        for k0 in range(0, K, 192):
            acc = np.zeros((nb, N), F32)
            for k in range(k0, min(K, k0 + 192)):
                acc = fma_f32(x[:nb, k:k + 1], wt[None, :, k], acc)
            total = acc if k0 == 0 else total + acc
        out[:nb] = total
    for m in range(nb, M):
        products = x[m][None, :] * wt               # [N, K], each rounded to f32
        if nn:
            acc = np.zeros(N, F32)
            for k in range(K):
                acc = acc + products[:, k]
            out[m] = acc
            continue
        peel = 4 - (-ldw) % 4 if M == 1 else (-m * ldx) % 4
        peel = min(peel, K)
        lanes = [np.zeros(N, F32) for _ in range(4)]
        for k in range(peel):
            lanes[0] = lanes[0] + products[:, k]
        n_q = (K - peel) // 4
        for q in range(n_q):
            for lane in range(4):
                lanes[lane] = lanes[lane] + products[:, peel + 4 * q + lane]
        r = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
        for k in range(peel + 4 * n_q, K):
            r = r + products[:, k]
        out[m] = r
    return out


# --- compressor, indexer, attention ---
# The parts of one attention layer, written as plain loops from SPEC.md's prose: the compressor
# (prefill groups, the partial-group state, decode), the indexer's scores, candidate blocks and
# selection, the window index rows and ring, sparse attention with a sink and the grouped output
# projection. Dot products are computed in float64 (every product of two f32 values is exact
# there) and rounded once to f32: a summation-order-free f32 accumulation. bf16 rounding, RMSNorm
# and top-k come from the package (``ds.``; tested on their own in the numerics tests / test_topk).


def _dot_f32(a, b):
    """f32(sum_i a_i * b_i) of two f32 vectors, the sum taken in float64."""
    return F32(np.dot(np.asarray(a, F64), np.asarray(b, F64)))


def _linear_f32_row(x_row, w):
    """One row through ``[out, in]`` weights: f32 results (the ratio > 1 compressor's kv / gate)."""
    return np.array([_dot_f32(x_row, w[o]) for o in range(w.shape[0])], F32)


def _linear_bf16_row(x_row, w):
    """bf16 linear of one row: products summed (here exactly) to f32, rounded to bf16 once."""
    return ds.to_bf16_rne(_linear_f32_row(x_row, w))


def _pool_group(kv, score):
    """One group's latent before rounding: per feature f, softmax over the group's r scores
    (max-subtracted, exp in float64 rounded to f32, f32 sums in token order) and the f32 sum of
    kv times those weights in token order. ``kv``, ``score`` ``[r, hd]`` f32."""
    r, hd = kv.shape
    out = np.zeros(hd, F32)
    for f in range(hd):
        m = max(float(score[j, f]) for j in range(r))
        e = [F32(math.exp(float(F32(score[j, f] - F32(m))))) for j in range(r)]
        denom = F32(0.0)
        for j in range(r):
            denom = F32(denom + e[j])
        acc = F32(0.0)
        for j in range(r):
            acc = F32(acc + F32(kv[j, f]) * F32(e[j] / denom))
        out[f] = acc
    return out


def compressor(x_steps, ratio, wkv, wgate, norm, eps):
    """The twin of ``compressor`` over a whole run: replay a prefill (``x_steps[0]``, at start_pos 0) then one-token decode steps through a
    ratio-``ratio`` compressor (SPEC step 4).

    Returns ``(latents, positions, kv_state, score_state)``: per step the pre-RoPE latents
    ``[groups, hd]`` (None when the step makes none) and their positions (a list), and the final
    partial-group state ``[r, hd]`` (None for ratio 1).
    """
    wkv = np.asarray(wkv, F32)
    hd = wkv.shape[0]
    kv_state = score_state = None
    if ratio > 1:
        kv_state = np.zeros((ratio, hd), F32)
        score_state = np.full((ratio, hd), -np.inf, F32)
        wgate = np.asarray(wgate, F32)
    all_latents, all_positions = [], []
    start_pos = 0
    for x in x_steps:
        x = np.asarray(x, F32)
        seqlen = x.shape[0]
        if ratio == 1:
            pre = np.array([_linear_bf16_row(x[t], wkv) for t in range(seqlen)], F32)
            latents = ds.rms_norm(pre.reshape(seqlen, hd), norm, eps)
            positions = [start_pos + t for t in range(seqlen)]
        else:
            kv = [_linear_f32_row(x[t], wkv) for t in range(seqlen)]
            score = [_linear_f32_row(x[t], wgate) for t in range(seqlen)]
            groups, positions = [], []
            if start_pos == 0:
                full = seqlen - seqlen % ratio
                for j in range(seqlen - full):           # trailing tokens -> slots 0 .. P%r-1
                    kv_state[j] = kv[full + j]
                    score_state[j] = score[full + j]
                for g in range(full // ratio):
                    groups.append((np.array(kv[g * ratio:(g + 1) * ratio]),
                                   np.array(score[g * ratio:(g + 1) * ratio])))
                    positions.append(g * ratio)
            else:
                slot = start_pos % ratio
                kv_state[slot] = kv[0]
                score_state[slot] = score[0]
                if (start_pos + 1) % ratio == 0:
                    groups.append((kv_state.copy(), score_state.copy()))
                    positions.append(start_pos + 1 - ratio)
            if groups:
                pooled = np.array([_pool_group(k, s) for k, s in groups], F32)
                latents = ds.rms_norm(ds.to_bf16_rne(pooled), norm, eps)
            else:
                latents = None
        all_latents.append(latents)
        all_positions.append(positions)
        start_pos += seqlen
    return all_latents, all_positions, kv_state, score_state


def visible_lengths(start_pos, seqlen, r):
    """SPEC step 5's clen per query: the compressed positions query s may see, ``(s + 1) // r``
    at prefill, ``end_pos // r`` at decode."""
    if start_pos == 0:
        return np.array([(s + 1) // r for s in range(seqlen)], np.int64)
    return np.full(seqlen, (start_pos + seqlen) // r, np.int64)


# NaN and infinities propagate through this reference as IEEE arithmetic says (the kernels'
# behaviour under test), so numpy's warnings about them are expected here.
@np.errstate(invalid="ignore", over="ignore")
def tile_scores(iq, w, keys, clen):
    """The indexer's scores (its ``tile_scores`` kernels): SPEC step 5 for queries ``iq [T, ih, id]`` with head weights ``w [T, ih]`` against
    ``keys [n, id]``: ``bf16(sum_h bf16(relu(bf16(iq[s,h] . keys[t])) * w[s,h]))``, the head sum
    in f32 in head order; ``-inf`` for ``t >= clen[s]``. Returns ``[T, n]`` f32.

    A query's visible keys at once: every head's dot product with every key in float64 (as
    ``_dot_f32``: exact products, rounded to f32 once), then each f32 step of the head sum as
    an element-wise numpy operation, head after head."""
    T, ih, _ = iq.shape
    n = keys.shape[0]
    out = np.full((T, n), -np.inf, F32)
    for s in range(T):
        c = max(0, min(int(clen[s]), n))
        dots = ds.to_bf16_rne((np.asarray(iq[s], F64) @ np.asarray(keys[:c], F64).T).astype(F32))
        acc = np.zeros(c, F32)
        for h in range(ih):
            d = dots[h]
            r = np.where((d > 0) | np.isnan(d), d, F32(0.0))     # relu; NaN passes, as in torch
            acc = acc + ds.to_bf16_rne(r * F32(w[s, h]))
        out[s, :c] = ds.to_bf16_rne(acc)
    return out


def select_candidate_blocks(scores, clen, topk_blocks, block):
    """SPEC "select_candidate_blocks": block maxima (width padded with -inf; a NaN propagates, as
    in torch's amax), the newest visible block pinned to +inf, torch's CPU top-k over the blocks,
    blocks above -inf kept (a NaN block is not), expanded."""
    scores = np.asarray(scores, F32)
    rows, width = scores.shape
    n_blocks = -(-width // block)
    k = min(topk_blocks, n_blocks)
    mask = np.zeros((rows, width), bool)
    for s in range(rows):
        bs = np.full(n_blocks, -np.inf, F32)
        for b in range(n_blocks):
            for t in range(b * block, (b + 1) * block):
                v = scores[s, t] if t < width else F32(-np.inf)
                if v > bs[b] or np.isnan(v):      # torch's amax: a NaN is the max, and stays
                    bs[b] = v
        c = int(clen[s])
        if c > 0:
            bs[(c - 1) // block] = np.inf
        for b in ds.torch_cpu_topk_set(bs, k):
            if bs[b] > -np.inf:
                for t in range(b * block, min((b + 1) * block, width)):
                    mask[s, t] = True
    return mask


def indexer_topk_idxs(scores, clen, k, offset, candidates=None):
    """The selection ``indexer`` returns (its ``topk_idxs``), SPEC step 5: candidate-masked scores (when ``candidates`` is given), torch's
    top-k set sorted ascending, -1 for an index >= clen[s], else index + offset."""
    scores = np.array(scores, F32)
    if candidates is not None:
        scores[~np.asarray(candidates, bool)] = -np.inf
    out = np.zeros((scores.shape[0], k), np.int64)
    for s in range(scores.shape[0]):
        picked = sorted(int(i) for i in ds.torch_cpu_topk_set(scores[s], k))
        out[s] = [-1 if i >= clen[s] else i + offset for i in picked]
    return out


def window_index_rows(start_pos, seqlen, win):
    """SPEC "Window KV" (step 2): prefill row t lists min(seqlen, win) entries max(0, t - win + 1) + j (-1 past
    t); the decode row lists the ring slots oldest first, -1 for a slot past start_pos."""
    if start_pos == 0:
        n = min(seqlen, win)
        rows = []
        for t in range(seqlen):
            first = max(0, t - win + 1)
            rows.append([first + j if first + j <= t else -1 for j in range(n)])
        return np.array(rows, dtype=np.int64).reshape(seqlen, n)
    o = start_pos % win + 1
    slots = list(range(o, win)) + list(range(0, o))
    return np.array([[s if s <= start_pos else -1 for s in slots]], dtype=np.int64)


class WindowRing:
    """The window ring a layer should hold: slot ``p % win`` has the KV row of the newest position p."""

    def __init__(self, win):
        self.win = win
        self.rows = {}          # slot -> (position, row)

    def prefill(self, kv_rows, seqlen):
        self.rows = {}
        for p in range(max(0, seqlen - self.win), seqlen):
            self.rows[p % self.win] = (p, kv_rows[p].copy())

    def decode(self, pos, row):
        self.rows[pos % self.win] = (pos, row.copy())


def window_ring(prefill_rows, decode_rows, win):
    """The ring after a prefill (``prefill_rows [P, hd]``, positions 0..P-1) and decode rows
    (positions P, P+1, ...): slot p % win holds the last row written there, unwritten slots 0."""
    prefill_rows = np.asarray(prefill_rows, F32)
    P, hd = prefill_rows.shape
    ring = WindowRing(win)
    ring.prefill(prefill_rows, P)
    for i, row in enumerate(decode_rows):
        ring.decode(P + i, row)
    out = np.zeros((win, hd), F32)
    for slot, (_, row) in ring.rows.items():
        out[slot] = row
    return out


def sparse_attn(q, kv, idx, sink, scale):
    """SPEC step 8 per query and head in f32: scores ``(q . kv_j) * scale`` over the listed rows
    (-1 skipped), softmax with the sink's logit in the denominator only, ``sum p_j kv_j`` rounded
    to bf16; zeros for a row with no valid entry. ``q [S, H, hd]``, ``kv [n, hd]``, ``idx [S, W]``."""
    S, H, hd = q.shape
    scale = F32(scale)
    out = np.zeros((S, H, hd), F32)
    for s in range(S):
        rows = [int(j) for j in idx[s] if j >= 0]
        if not rows:
            continue
        for h in range(H):
            logits = [F32(_dot_f32(q[s, h], kv[j]) * scale) for j in rows]
            m = max(max(logits), F32(sink[h]))
            e = [F32(math.exp(float(F32(v - m)))) for v in logits]
            denom = F32(0.0)
            for v in e:
                denom = F32(denom + v)
            denom = F32(denom + F32(math.exp(float(F32(F32(sink[h]) - m)))))
            acc = np.zeros(hd, F32)
            for v, j in zip(e, rows):
                acc = (acc + F32(v / denom) * kv[j].astype(F32)).astype(F32)
            out[s, h] = acc
    return ds.to_bf16_rne(out)


def output_projection(o, wo_a, wo_b, groups):
    """SPEC step 10: ``o [S, H*hd]`` split into ``groups`` consecutive head groups; group g through
    rows ``g*rank .. (g+1)*rank`` of ``wo_a [G*rank, H*hd/G]`` (bf16 linear), then ``wo_b``."""
    o = np.asarray(o, F32)
    wo_a = np.asarray(wo_a, F32)
    wo_b = np.asarray(wo_b, F32)
    S = o.shape[0]
    part = o.shape[1] // groups
    rank = wo_a.shape[0] // groups
    out = []
    for s in range(S):
        mid = []
        for g in range(groups):
            mid.extend(_linear_bf16_row(o[s, g * part:(g + 1) * part],
                                       wo_a[g * rank:(g + 1) * rank]))
        out.append(_linear_bf16_row(np.array(mid, F32), wo_b))
    return np.array(out, F32).reshape(S, wo_b.shape[0])


# --- sparse attention in the reference's order ---
# The reference's per-query order (docs/exactness.md, "f32 linears"; torch 2.13's AVX512 softmax):
# scores = q [H, hd] . rows^T and o = P [H, W] @ rows by MKL sgemm over the FULL index list (a -1
# entry's row taken as zeros), the kernel of each head row chosen by the row count H; between
# them torch's _vec_softmax_lastdim over [scores * scale with -inf at -1 entries, sink]. Literal and
# slow: one f32 operation (or one fused multiply-add, fma_f32) at a time, vectorised only
# across independent outputs.

_SA_KC = 192


def mkl_row_kernels(M):
    """MKL's kernel for each of the M rows of a product, with the reference's 2 threads."""
    if M == 1:
        return ["gemv"]
    if M <= 3:
        return ["small"] * M
    if 4 < M < 12 and M % 4:
        return ["blocked"] * (4 * (M // 4)) + ["small"] * (M % 4)
    return ["blocked"] * M


def _sa_blocked(a, b):
    """sum_k a[..., k] * b[..., k] as MKL's blocked kernel: k in blocks of 192, an FMA chain from
    +0 inside each, block results added in order (the first one as it is)."""
    K = a.shape[-1]
    total = None
    for k0 in range(0, K, _SA_KC):
        acc = np.zeros(np.broadcast_shapes(a.shape[:-1], b.shape[:-1]), F32)
        for k in range(k0, min(K, k0 + _SA_KC)):
            acc = fma_f32(a[..., k], b[..., k], acc)
        total = acc if total is None else (total + acc).astype(F32)
    return total


def _sa_small_dot(a, b, peel):
    """MKL's small / gemv dot, no FMA: products rounded; the first ``peel`` summed in order; then
    lane l = sum of products peel + 4i + l (lane 0 starting from the peel's sum); (l0 + l2) +
    (l1 + l3); then the leftover products one by one."""
    p = (a * b).astype(F32)
    K = p.shape[-1]
    lanes = [np.zeros(p.shape[:-1], F32) for _ in range(4)]
    for k in range(min(peel, K)):
        lanes[0] = lanes[0] + p[..., k]
    k = peel
    while k + 4 <= K:
        for lane in range(4):
            lanes[lane] = lanes[lane] + p[..., k + lane]
        k += 4
    r = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
    for j in range(k, K):
        r = r + p[..., j]
    return r


def sleef_expf_u10(d):
    """Sleef_expf16_u10 (Sleef 3's xexpf), its multiply-adds fused, element by element."""
    d = np.asarray(d, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        log2e = F32(1.442695040888963407359924681001892137426645954152985934135449406931)
        t = (d * log2e).astype(F32)
        q = np.where(np.abs(t) < 1000, np.rint(t), 0).astype(F32)  # else: selects below
        s = fma_f32(q, -F32(0.693145751953125), d)
        s = fma_f32(q, -F32(1.428606765330187045e-06), s)
        u = np.full(d.shape, F32(0.000198527617612853646278381), F32)
        for c in (0.00139304355252534151077271, 0.00833336077630519866943359, 0.0416664853692054748535156,
                  0.166666671633720397949219, 0.5):
            u = fma_f32(u, s, F32(c))
        u = (F32(1) + fma_f32((s * s).astype(F32), u, s)).astype(F32)
        qi = q.astype(np.int64)
        half = qi >> 1
        u = (u * np.ldexp(F32(1), half).astype(F32)).astype(F32)
        u = (u * np.ldexp(F32(1), qi - half).astype(F32)).astype(F32)
        u = np.where(d < -104, F32(0), u)
        u = np.where(d > 100, F32(np.inf), u)
    return u.astype(F32)


def reduce_all_sum(x):
    """torch's vec::reduce_all(x + y) over the last axis, Vectorized<float> of 16 lanes: fewer
    than 16 columns one by one; else a vector of lane sums over the whole vectors, the partial
    last vector added into lanes 0.., then lanes i^8, i^4, i^2, i^1 added into lane i."""
    x = np.asarray(x, F32)
    n = x.shape[-1]
    if n < 16:
        r = x[..., 0].copy()
        for i in range(1, n):
            r = (r + x[..., i]).astype(F32)
        return r
    acc = x[..., :16].copy()
    d = 16
    while d < n - n % 16:
        acc = (acc + x[..., d:d + 16]).astype(F32)
        d += 16
    if n > d:
        acc[..., :n - d] = (acc[..., :n - d] + x[..., d:]).astype(F32)
    for w in (8, 4, 2, 1):
        acc = (acc + acc[..., np.arange(16) ^ w]).astype(F32)
    return acc[..., 0]


def sparse_attn_ordered(q, kv, idx, sink, scale):
    """sparse_attn in the reference's exact f32 order (see above); zeros for a query with no
    valid entry (the SPEC's rule; the reference gives zeros too unless the sink is -inf).
    ``q [S, H, hd]``, ``kv [n, hd]``, ``idx [S, W]``, ``sink [H]``; returns bf16 values as f32."""
    q = np.asarray(q, F32)
    kv = np.asarray(kv, F32)
    sink = np.asarray(sink, F32)
    S, H, hd = q.shape
    kinds = mkl_row_kernels(H)
    out = np.zeros((S, H, hd), F32)
    with np.errstate(invalid="ignore", over="ignore"):
        for s in range(S):
            valid = idx[s] >= 0
            if not valid.any():
                continue
            rows = np.where(valid[:, None], kv[np.where(valid, idx[s], 0)], F32(0))
            W = rows.shape[0]
            scores = np.empty((H, W), F32)
            blocked = [h for h in range(H) if kinds[h] == "blocked"]
            if blocked:                                         # every blocked head at once
                scores[blocked] = _sa_blocked(q[s, blocked][:, None, :], rows[None])
            for h in range(H):
                if kinds[h] != "blocked":
                    # gemv: peel from the rows' alignment (64-byte aligned, hd apart); small: from
                    # the query row's (q 64-byte aligned, heads hd apart)
                    peel = 4 - (-hd) % 4 if kinds[h] == "gemv" else (-(h * hd)) % 4
                    scores[h] = _sa_small_dot(q[s, h][None, :], rows, peel)
            x = (scores * F32(scale)).astype(F32)
            x[:, ~valid] = -np.inf
            x = np.concatenate([x, sink[:, None]], axis=1)
            m = x.max(axis=1)                                   # NaN propagates
            e = sleef_expf_u10((x - m[:, None]).astype(F32))
            r = (F32(1) / reduce_all_sum(e)).astype(F32)
            p = (e * r[:, None]).astype(F32)[:, :W]
            if blocked:
                out[s, blocked] = _sa_blocked(p[blocked][:, None, :], rows.T[None])
            for h in range(H):
                if kinds[h] != "blocked":                       # one chain over W, no FMA
                    acc = np.zeros(hd, F32)
                    for j in range(W):
                        acc = (acc + (p[h, j] * rows[j]).astype(F32)).astype(F32)
                    out[s, h] = acc
    return to_bf16_rne(out)


# --- golden ---


def runners_up(scores, clen, topk, offset, R):
    """Twin of ``golden.captures._runners_up``: per row, the R best visible positions not in
    ``topk`` (NaN first, then larger, equal scores by position), as position + offset with their
    scores; -1 and -inf past the last. Returns ``(idxs [rows, R], scores [rows, R])``."""
    rows = scores.shape[0]
    idxs = np.full((rows, R), -1, np.int64)
    vals = np.full((rows, R), -np.inf, F32)
    for s in range(rows):
        chosen = {int(v) - offset for v in topk[s] if v >= 0}
        rest = [t for t in range(min(int(clen[s]), scores.shape[1])) if t not in chosen]
        rest.sort(key=lambda t: (not math.isnan(scores[s, t]),
                                 0.0 if math.isnan(scores[s, t]) else -float(scores[s, t]), t))
        for j, t in enumerate(rest[:R]):
            idxs[s, j], vals[s, j] = t + offset, scores[s, t]
    return idxs, vals


# --- stack ---
# The structural invariants every AttentionStack step must satisfy, written from SPEC.md's prose
# (not from the package): the window index rows, the ring of window KV rows, the compressed index
# entries (in range or -1, sorted, as many as min(index_topk, positions)), the shapes. Used by
# tests/test_fuzz.py.


def check_step(cfg, stack, layer, run, start_pos, seqlen, ring, exact_count):
    """Assert the structural invariants of one forward run with ``capture=True``.

    ``ring`` is the layer's :class:`WindowRing` (updated here). ``exact_count``: each row's number of
    valid compressed entries must be ``min(k, visible)`` (so for finite inputs and a selection made
    without candidate masking); otherwise it must only not exceed that. At decode every position is
    visible, so the count is always exactly k.
    """
    win, hd, r = cfg.window_size, cfg.head_dim, cfg.compress_ratios[layer]
    end_pos = start_pos + seqlen
    assert run.out.shape == (seqlen, cfg.dim) and run.out.dtype == np.float32, run.out.shape
    want_win = window_index_rows(start_pos, seqlen, win)
    nwin = want_win.shape[1]
    width = end_pos // r if r else 0
    k = min(cfg.index_topk, width) if r else 0
    idx = np.asarray(run.idx)
    assert idx.dtype == np.int32, idx.dtype
    assert idx.shape == (seqlen, nwin + k), (idx.shape, (seqlen, nwin + k))
    assert np.array_equal(idx[:, :nwin], np.broadcast_to(want_win, (seqlen, nwin))), "window rows"
    offset = seqlen if start_pos == 0 else win
    assert run.kv_rows.shape == (offset + width, hd), (run.kv_rows.shape, offset + width)
    state = stack.states[layer]
    assert state.window_kv.shape == (win, hd)
    if start_pos == 0:
        ring.prefill(run.kv_rows, seqlen)
    else:
        for slot, (pos, row) in ring.rows.items():
            if slot != start_pos % win:
                assert np.array_equal(run.kv_rows[slot], row, equal_nan=True), f"ring slot {slot}"
        ring.decode(start_pos, run.kv_rows[start_pos % win])
        assert np.array_equal(run.kv_rows[:win], state.window_kv, equal_nan=True), "decode rows != ring"
    for slot, (pos, row) in ring.rows.items():
        assert np.array_equal(state.window_kv[slot], row, equal_nan=True), f"state ring slot {slot}"
    if not r:
        return
    comp = idx[:, nwin:].astype(np.int64)
    assert np.array_equal(run.kv_rows[offset:], stack.shared.compress_kv[:width], equal_nan=True)
    vis = visible_lengths(start_pos, seqlen, r)
    for s in range(seqlen):
        row = comp[s]
        n_valid = int(np.count_nonzero(row != -1))
        valid = row[:n_valid]
        assert np.all(row[n_valid:] == -1), f"row {s}: a -1 entry before a valid one: {row}"
        assert np.all((valid >= offset) & (valid < offset + vis[s])), f"row {s} out of range: {row}"
        assert np.all(np.diff(valid) > 0), f"row {s} not sorted: {row}"
        if exact_count or start_pos > 0:
            assert n_valid == min(k, vis[s]), (s, n_valid, k, vis[s], row)
        else:
            assert n_valid <= min(k, vis[s]), (s, n_valid, k, vis[s], row)
