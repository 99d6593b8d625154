"""torch_cpu_topk_set / torch_cpu_topk_rows against torch's goldens and a libstdc++ transcription.

The goldens (tests/data/topk_cases.npz, topk_nan_cases.npz, copied unchanged from the reference's goldens) are the sets
torch 2.13's CPU topk returned on tie-heavy bf16 rows; every row must match exactly, through both the
single-row and the batched form. ``naive.torch_cpu_topk_set`` is a slow line-by-line transcription of the
libstdc++ algorithms; the kernels must agree with it on random rows full of ties, NaN and infinities,
in both branches (nth_element for k * 64 > n, partial_sort for k * 64 <= n) and on inputs built to
drive introselect into its depth-limit heap-select fallback.
"""

import os
import time
from collections import defaultdict

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit, prange

import naive
from ds41numba.topk import (topk_scratch_len, topk_set_into, torch_cpu_topk_rows,
                            torch_cpu_topk_set)

DATA = os.path.join(os.path.dirname(__file__), "data")

# Branch sizes of the golden files (k * 64 <= n is the partial_sort branch).
GOLDEN_BRANCH_COUNTS = {
    "topk_cases": {"partial_sort": 742, "nth_element": 758},
    "topk_nan_cases": {"partial_sort": 174, "nth_element": 226},
}


def branch(n, k):
    return "partial_sort" if k * 64 <= n else "nth_element"


def load_cases(name):
    d = np.load(os.path.join(DATA, name + ".npz"))
    vals, offsets, ks, idx = d["vals"], d["offsets"], d["k"], d["idx"]
    idx_sorted = d["idx_sorted"] if "idx_sorted" in d.files else None
    idx_off = np.concatenate([[0], np.cumsum(ks)])
    rows = []
    for i in range(len(ks)):
        want = idx[idx_off[i]:idx_off[i + 1]]
        want_sorted = None if idx_sorted is None else idx_sorted[idx_off[i]:idx_off[i + 1]]
        rows.append((vals[offsets[i]:offsets[i + 1]], int(ks[i]), want, want_sorted))
    return rows


@pytest.fixture(scope="module", params=sorted(GOLDEN_BRANCH_COUNTS))
def golden(request):
    return request.param, load_cases(request.param)


# --------------------------------------------------------------------------- goldens


def test_golden_single_row(golden):
    name, rows = golden
    passed = defaultdict(int)
    for i, (row, k, want, want_sorted) in enumerate(rows):
        if want_sorted is not None:
            # sorted=True and sorted=False gave the same set.
            assert np.array_equal(np.sort(want_sorted), want), f"{name} row {i}: golden sets differ"
        got = torch_cpu_topk_set(row, k)
        assert got.dtype == np.int64 and got.shape == (k,)
        assert np.array_equal(got, want), f"{name} row {i} (n={len(row)}, k={k}, {branch(len(row), k)})"
        passed[branch(len(row), k)] += 1
    print(f"\n{name}: single-row passes per branch: {dict(passed)}")
    assert dict(passed) == GOLDEN_BRANCH_COUNTS[name]


def test_golden_batched(golden):
    """Rows of equal length go through torch_cpu_topk_rows together, each with its own k."""
    name, rows = golden
    by_n = defaultdict(list)
    for i, (row, k, want, _) in enumerate(rows):
        by_n[len(row)].append(i)
    passed = defaultdict(int)
    for n, members in by_n.items():
        mat = np.stack([rows[i][0] for i in members])
        ks = np.array([rows[i][1] for i in members], dtype=np.int64)
        out = torch_cpu_topk_rows(mat, ks)
        assert out.shape == (len(members), ks.max())
        for r, i in enumerate(members):
            k, want = rows[i][1], rows[i][2]
            assert np.array_equal(out[r, :k], want), f"{name} row {i} (n={n}, k={k})"
            assert np.all(out[r, k:] == -1)
            passed[branch(n, k)] += 1
    print(f"\n{name}: batched passes per branch: {dict(passed)}")
    assert dict(passed) == GOLDEN_BRANCH_COUNTS[name]


def test_golden_scalar_k_batched(golden):
    """A scalar k over a stack of rows (rows cut to a common length, so the goldens don't apply:
    compared with the single-row form instead)."""
    _, rows = golden
    n = 600
    mat = np.stack([row[:n] for row, *_ in rows if len(row) >= n][:64])
    for k in (1, 9, 10, 200, n):  # 9 -> partial_sort, 10 -> nth_element
        out = torch_cpu_topk_rows(mat, k)
        assert out.shape == (len(mat), k)
        for r in range(len(mat)):
            assert np.array_equal(out[r], torch_cpu_topk_set(mat[r], k))


def test_naive_matches_goldens():
    """The transcription itself reproduces torch on golden rows (a subset, it is slow)."""
    for name in GOLDEN_BRANCH_COUNTS:
        for row, k, want, _ in load_cases(name)[::7]:
            assert naive.torch_cpu_topk_set(row, k) == want.tolist()


# --------------------------------------------------------------------------- random vs naive

ALPHABET = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1.0, -1.0, 0.5, 3.0, -2.5e-3, 1.5e30],
                    dtype=np.float32)


def random_row(seed, n, alphabet_ids, p_bf16):
    """Values from a small alphabet (ties everywhere), some replaced by random bf16 values."""
    rng = np.random.default_rng(seed)
    alpha = ALPHABET[np.asarray(alphabet_ids)]
    row = alpha[rng.integers(0, len(alpha), n)]
    wide = rng.random(n) < p_bf16
    bf16 = (rng.standard_normal(n).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return np.where(wide, bf16, row).astype(np.float32)


@st.composite
def topk_problem(draw, which):
    if which == "partial_sort":
        n = draw(st.integers(64, 1500))
        k = draw(st.integers(1, n // 64))
    elif which == "nth_element":
        n = draw(st.integers(1, 400))
        k = draw(st.integers(n // 64 + 1, n))
    else:  # edges
        n = draw(st.integers(0, 200))
        k = draw(st.sampled_from([0, n]))
    ids = draw(st.lists(st.integers(0, len(ALPHABET) - 1), min_size=1, max_size=4, unique=True))
    p_bf16 = draw(st.sampled_from([0.0, 0.0, 0.1, 0.5]))
    seed = draw(st.integers(0, 2**32 - 1))
    return random_row(seed, n, ids, p_bf16), k


def check_against_naive(row, k):
    got = torch_cpu_topk_set(row, k)
    assert got.tolist() == naive.torch_cpu_topk_set(row, k)
    # Properties that hold whatever the tie rule: k distinct in-range indices, ascending, and the
    # kept values are exactly the top-k multiset (NaN first, then descending).
    assert len(got) == k and np.all(np.diff(got) > 0)
    assert k == 0 or (got[0] >= 0 and got[-1] < len(row))
    assert np.array_equal(np.sort(row[got]), np.sort(naive.topk_value_multiset(row, k)),
                          equal_nan=True)
    return got


HYP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@HYP
@given(topk_problem("partial_sort"))
def test_random_partial_sort_branch(problem):
    check_against_naive(*problem)


@HYP
@given(topk_problem("nth_element"))
def test_random_nth_element_branch(problem):
    check_against_naive(*problem)


@settings(max_examples=30, deadline=None)
@given(topk_problem("edges"))
def test_random_edges(problem):
    row, k = problem
    got = check_against_naive(row, k)
    assert np.array_equal(got, np.arange(k)) if k == len(row) else len(got) == 0


@settings(max_examples=40, deadline=None)
@given(topk_problem("partial_sort"), st.integers(0, 2**32 - 1))
def test_random_batched_matches_single(problem, seed):
    """Several rows of one length, per-row k spanning both branches, against the single-row form."""
    row, _ = problem
    n = len(row)
    rng = np.random.default_rng(seed)
    mat = np.stack([row, rng.permutation(row), row[::-1], np.sort(row)])
    ks = np.array([rng.integers(0, n + 1), rng.integers(0, n // 64 + 1), n // 64, n // 64 + 1])
    out = torch_cpu_topk_rows(mat, ks)
    assert out.shape == (4, ks.max())
    for r in range(4):
        assert np.array_equal(out[r, :ks[r]], torch_cpu_topk_set(mat[r], ks[r]))
        assert np.all(out[r, ks[r]:] == -1)


# --------------------------------------------------------------------------- introselect depth limit


def introselect_killer(n, nth):
    """A row that drives libstdc++'s introselect to its depth limit (McIlroy's adversary).

    Runs the naive introselect with a comparator that fixes values only as it is forced to, always
    making the current pivot candidate lose; the values it fixed (plus one shared value for all the
    ones never fixed, a big tie) replay the same comparisons on a real row.
    """
    gas = n - 1
    val = [gas] * n
    state = {"solid": 0, "candidate": 0}

    def freeze(x):
        val[x] = state["solid"]
        state["solid"] += 1

    def comp(a, b):
        x, y = a[1], b[1]
        if val[x] == gas and val[y] == gas:
            freeze(x if x == state["candidate"] else y)
        if val[x] == gas:
            state["candidate"] = x
        elif val[y] == gas:
            state["candidate"] = y
        return val[x] < val[y]

    pairs = [(0.0, i) for i in range(n)]
    naive._std_introselect(pairs, 0, nth, n, naive._std_lg(n) * 2, comp)
    # `before` ranks larger values first; the adversary ranked smaller ones first.
    return -np.asarray(val, dtype=np.float32)


@pytest.mark.parametrize("n", [50, 257, 1000, 4000])
def test_introselect_depth_limit(n):
    hits = 0
    for k in sorted({n // 64 + 1, n // 4, n // 2, n - 3, n - 1}):
        row = introselect_killer(n, k - 1)
        for variant in (row, np.floor(row / 3), np.where(row < -n / 2, -np.inf, row)):
            before = naive.TOPK_STATS["introselect_heap_select"]
            check_against_naive(variant.astype(np.float32), k)
            hits += naive.TOPK_STATS["introselect_heap_select"] > before
    assert hits > 0, "no input reached introselect's heap-select fallback"


# --------------------------------------------------------------------------- full length


def test_partial_sort_of_a_prefix_is_the_whole_rows_set():
    """The indexer passes only the part of a row a query sees (the rest is -inf, which never
    enters torch's heap): the set is the whole row's, also for a prefix of exactly k values
    (kept whole without a heap) and with ties and a NaN in the prefix."""
    from ds41numba.topk import partial_sort_set_into

    rng = np.random.default_rng(23)
    for seen, k in [(32, 32), (32, 40), (100, 64), (700, 64), (5000, 512)]:
        n = max(64 * k, seen)
        row = np.full(n, -np.inf, np.float32)
        row[:seen] = rng.integers(-4, 4, size=seen).astype(np.float32) / 4
        if seen > 10:
            row[7] = np.nan
        want = torch_cpu_topk_set(row, k)
        got = np.empty(k, np.int64)
        m = max(k, seen)
        partial_sort_set_into(row[:m], k, got, np.empty(k, np.int64))
        assert np.array_equal(got, want), (seen, k)


@pytest.mark.parametrize("block", [8, 3, 32])
def test_hinted_partial_sort_skips_by_block_maxima_and_keeps_the_set(block):
    """The indexer's top-k scan skips runs by the candidate source's block scores: hints that
    are the block maxima, or above them (a pinned +inf block, every hint +inf), give the set the
    row alone gives (torch's), ties at the cut, NaN and inf values and k not a multiple of the
    block included."""
    from ds41numba.topk import partial_sort_set_hinted

    rng = np.random.default_rng(block)
    for n, k in [(20000, 100), (70000, 512), (4096, 64)]:
        row = (np.round(rng.standard_normal(n) * 3) / 4).astype(np.float32)   # wide ties
        row[rng.integers(0, n, 5)] = np.nan
        row[rng.integers(0, n, 5)] = np.inf
        nb = -(-n // block)
        padded = np.full(nb * block, -np.inf, np.float32)
        padded[:n] = row
        blocks = padded.reshape(nb, block)
        maxima = np.where(np.isnan(blocks).any(axis=1), np.nan, blocks.max(axis=1))
        pinned = maxima.copy()
        pinned[nb // 2] = np.inf
        want = torch_cpu_topk_set(row, k)
        for hint in (maxima, pinned, np.full(nb, np.inf, np.float32), maxima + np.float32(1.0)):
            got = np.empty(k, np.int64)
            partial_sort_set_hinted(row, k, got, np.empty(k, np.int64),
                                    np.ascontiguousarray(hint, np.float32), block)
            assert np.array_equal(got, want), (n, k)
    # More +inf values than k, then a NaN in the pinned block: the top is +inf when the scan
    # reaches it, and the NaN (torch's first) is read all the same.
    row = np.zeros(4096, np.float32)
    row[:100] = np.inf
    row[4000] = np.nan
    hint = np.where(np.arange(-(-4096 // block)) == 4000 // block, np.inf, 0).astype(np.float32)
    hint[:-(-100 // block)] = np.inf
    got = np.empty(64, np.int64)
    partial_sort_set_hinted(row, 64, got, np.empty(64, np.int64), hint, block)
    assert 4000 in got and np.array_equal(got, torch_cpu_topk_set(row, 64))


@pytest.mark.parametrize("block", [8, 4, 12])
def test_listed_partial_sort_visits_the_spans_and_keeps_the_set(block):
    """A candidate consumer's masked rows (-inf outside its candidate blocks) through the scan
    that visits only the quarters holding a candidate (:class:`ListedSpans`): the set the row
    alone gives (torch's), with ties at the cut, NaN and inf among the candidates, candidates
    among the first k positions (the heap's first fill) and fewer candidate positions than k
    (then -inf positions are picked, torch's way)."""
    from ds41numba.indexer.candidate_scores import candidate_quarters
    from ds41numba.topk import partial_sort_set_listed

    rng = np.random.default_rng(block)
    for n, k, density in [(20000, 100, 0.05), (70000, 512, 0.01), (4096, 64, 0.3), (8192, 128, 0.001)]:
        nb = -(-n // block)
        cand = rng.random(nb) < density
        cand[1] = True
        row = (np.round(rng.standard_normal(n) * 3) / 4).astype(np.float32)   # wide ties
        row[rng.integers(0, n, 5)] = np.nan
        row[rng.integers(0, n, 5)] = np.inf
        row[~np.repeat(cand, block)[:n]] = -np.inf
        offsets, firsts = candidate_quarters(np.packbits(cand)[None], np.array([n]), block)
        want = torch_cpu_topk_set(row, k)
        got = np.empty(k, np.int64)
        partial_sort_set_listed(row, k, got, np.empty(k, np.int64), firsts, 8)
        assert np.array_equal(got, want), (n, k)
        if np.isfinite(row).sum() < k:          # the case reaches -inf picks
            assert np.isneginf(row[want]).any()


def test_million_row_partial_sort():
    rng = np.random.default_rng(41)
    n, k = 1_000_000, 512
    row = (np.round(rng.standard_normal(n) * 4) / 4).astype(np.float32)  # coarse: big ties at the cut
    row[rng.random(n) < 0.4] = -np.inf
    row[rng.integers(0, n, 100)] = np.nan
    row[rng.integers(0, n, 100)] = np.inf
    torch_cpu_topk_set(row[:100_000], k)  # warm (compiled already; touch the code paths)
    t0 = time.perf_counter()
    got = torch_cpu_topk_set(row, k)
    dt = time.perf_counter() - t0
    print(f"\n1M-entry row, k=512 (partial_sort branch): {dt * 1e3:.2f} ms")
    assert len(got) == k and np.all(np.diff(got) > 0)
    want_vals = naive.topk_value_multiset(row, k)
    assert np.array_equal(np.sort(row[got]), np.sort(want_vals), equal_nan=True)
    # The tie rule too: the naive heap select is a Python loop, but linear (~1 s).
    assert got.tolist() == naive.torch_cpu_topk_set(row, k)
    # And the batched form at this length.
    out = torch_cpu_topk_rows(np.stack([row, row[::-1]]), np.array([k, 300]))
    assert np.array_equal(out[0], got)
    assert np.array_equal(out[1, :300], torch_cpu_topk_set(row[::-1], 300))


def test_thread_count_independent():
    rng = np.random.default_rng(7)
    mat = random_row(3, 64 * 3000, [0, 3, 5], 0.3).reshape(64, 3000)
    mat[::2] = np.round(rng.standard_normal((32, 3000)) * 2).astype(np.float32)
    ks = rng.integers(0, 3001, 64)
    ks[::3] = rng.integers(0, 47, len(ks[::3]))  # partial_sort rows
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = torch_cpu_topk_rows(mat, ks)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = torch_cpu_topk_rows(mat, ks)
    finally:
        numba.set_num_threads(old)
    assert np.array_equal(one, many)


# --------------------------------------------------------------------------- the njit core


@njit(parallel=True)
def _core_caller(mat, k, out):
    rows, n = mat.shape
    need = topk_scratch_len(n, k)
    for r in prange(rows):
        sv = np.empty(need, np.float32)
        si = np.empty(need, np.int64)
        topk_set_into(mat[r], k, out[r], sv, si)


def test_core_callable_from_prange():
    mat = random_row(11, 8 * 700, [0, 2, 3, 5], 0.2).reshape(8, 700)
    for k in (5, 11, 700):
        out = np.full((8, k + 2), -7, np.int64)
        _core_caller(mat, k, out)
        assert np.all(out[:, k:] == -7)  # only [:k] is written
        for r in range(8):
            assert np.array_equal(out[r, :k], torch_cpu_topk_set(mat[r], k))


def test_core_scratch_len_and_errors():
    assert topk_scratch_len(1000, 15) == 15
    assert topk_scratch_len(1000, 16) == 1000
    assert topk_scratch_len(64, 1) == 1
    row = np.arange(100, dtype=np.float32)
    out = np.empty(10, np.int64)
    with pytest.raises(ValueError, match="scratch"):
        topk_set_into(row, 10, out, np.empty(10, np.float32), np.empty(10, np.int64))
    with pytest.raises(ValueError, match="k must be"):
        topk_set_into(row, 101, out, np.empty(100, np.float32), np.empty(100, np.int64))
    topk_set_into(row, 1, out, np.empty(1, np.float32), np.empty(1, np.int64))
    assert out[0] == 99


# --------------------------------------------------------------------------- boundary


def test_dtypes_converted():
    import ml_dtypes

    row = random_row(5, 300, [0, 3, 5, 6], 0.5)  # bf16 values: exact in every dtype below
    want = torch_cpu_topk_set(row, 30)
    for dt in (np.float64, ml_dtypes.bfloat16):
        assert np.array_equal(torch_cpu_topk_set(row.astype(dt), 30), want)
        assert np.array_equal(torch_cpu_topk_rows(row.astype(dt)[None], 30)[0], want)
    assert np.array_equal(torch_cpu_topk_set(row.tolist(), 30), want)
    # Non-contiguous views.
    assert np.array_equal(torch_cpu_topk_set(np.repeat(row, 2)[::2], 30), want)
    assert np.array_equal(torch_cpu_topk_rows(np.stack([row, row], 1).T, 30)[1], want)
    # float64 is rounded to float32 first (as the f32 comparison implies).
    assert np.array_equal(torch_cpu_topk_set(np.array([1.0, 1.0 + 1e-12, 0.0]), 1), [0])


def test_edges():
    assert torch_cpu_topk_set(np.empty(0, np.float32), 0).shape == (0,)
    assert torch_cpu_topk_set(np.ones(5, np.float32), 0).shape == (0,)
    assert np.array_equal(torch_cpu_topk_set(np.ones(5, np.float32), 5), np.arange(5))
    assert np.array_equal(torch_cpu_topk_set([np.nan, 1.0, np.inf], 1), [0])
    assert torch_cpu_topk_rows(np.empty((3, 0), np.float32), 0).shape == (3, 0)
    assert torch_cpu_topk_rows(np.empty((0, 7), np.float32), 4).shape == (0, 4)
    assert torch_cpu_topk_rows(np.empty((0, 7), np.float32), np.empty(0, np.int64)).shape == (0, 0)
    out = torch_cpu_topk_rows(np.ones((2, 4), np.float32), np.array([0, 0]))
    assert out.shape == (2, 0)


@pytest.mark.parametrize("vals, k, err, match", [
    (np.arange(5), 2, TypeError, "floating"),
    (np.ones(5, bool), 2, TypeError, "floating"),
    (np.ones(5, complex), 2, TypeError, "floating"),
    (np.array(["a", "b"]), 1, TypeError, "floating"),
    (np.ones((2, 3), np.float32), 1, ValueError, "1-D"),
    (np.float32(1.0), 1, ValueError, "1-D"),
    (np.ones(5, np.float32), 6, ValueError, r"\[0, 5\]"),
    (np.ones(5, np.float32), -1, ValueError, r"\[0, 5\]"),
    (np.ones(5, np.float32), 2.0, TypeError, "integer"),
    (np.ones(5, np.float32), True, TypeError, "integer"),
    (np.ones(5, np.float32), None, TypeError, "integer"),
])
def test_set_rejects(vals, k, err, match):
    with pytest.raises(err, match=match):
        torch_cpu_topk_set(vals, k)


@pytest.mark.parametrize("vals, k, err, match", [
    (np.ones(5, np.float32), 2, ValueError, "2-D"),
    (np.ones((2, 2, 2), np.float32), 1, ValueError, "2-D"),
    (np.ones((2, 3), np.int32), 1, TypeError, "floating"),
    (np.ones((2, 3), np.float32), 4, ValueError, r"\[0, 3\]"),
    (np.ones((2, 3), np.float32), -1, ValueError, r"\[0, 3\]"),
    (np.ones((2, 3), np.float32), np.array([1, 2, 3]), ValueError, r"shape \(2,\)"),
    (np.ones((2, 3), np.float32), np.array([[1, 2]]), ValueError, r"shape \(2,\)"),
    (np.ones((2, 3), np.float32), np.array([1, 4]), ValueError, r"k\[1\] = 4"),
    (np.ones((2, 3), np.float32), np.array([-1, 1]), ValueError, r"k\[0\] = -1"),
    (np.ones((2, 3), np.float32), np.array([1.0, 2.0]), TypeError, "integer dtype"),
    (np.ones((2, 3), np.float32), np.array([True, False]), TypeError, "integer dtype"),
    (np.ones((2, 3), np.float32), 1.5, TypeError, "integer"),
    (np.ones((2, 3), np.float32), True, TypeError, "integer"),
])
def test_rows_rejects(vals, k, err, match):
    with pytest.raises(err, match=match):
        torch_cpu_topk_rows(vals, k)


# --------------------------------------------------------------------------- pairs as integers


def _special_f32():
    """Every kind of f32 the comparator meets: both zeros, both infinities, NaNs of either sign
    and any payload, the smallest and largest subnormals and normals of each sign, values a bit
    apart, and random bit patterns."""
    bits = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
            0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,
            0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0x3F800001, 0xBF800000,
            0xBF800001, 0x3F7FFFFF, 0xBF7FFFFF]
    rng = np.random.default_rng(5)
    bits += list(rng.integers(0, 1 << 32, 200, dtype=np.uint64))
    return np.array(bits, np.uint32).view(np.float32)


def test_pair_keys_order_values_as_torchs_comparator_does():
    """``pair_key(a) > pair_key(b)`` exactly when ``before(a, b)``, for every two values of the
    table (each with itself too): -0 ties +0, every NaN ties every other and comes first."""
    from ds41numba.topk import before, pair_key

    vals = _special_f32()
    keys = np.array([pair_key(v) for v in vals])
    for a, ka in zip(vals, keys):
        want = np.array([bool(before(a, b)) for b in vals])
        assert np.array_equal(ka > keys, want), a
    assert pair_key(np.float32(-0.0)) == pair_key(np.float32(0.0))
    assert keys.max() == pair_key(np.float32(np.nan)) > pair_key(np.float32(np.inf))
