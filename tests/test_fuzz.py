"""Hypothesis fuzzing of the public API, as a hostile user would call it.

Every case must either raise ValueError/TypeError with a message that names the problem, or return
a result that satisfies the structural invariants of SPEC.md (``naive.check_step``): window rows
as the formula says, the ring holding the newest row of each slot, compressed index entries in
range or -1, sorted, ``min(index_topk, positions)`` of them, documented shapes. A call that is
refused must leave the stack as it was. The whole file also runs with ``NUMBA_BOUNDSCHECK=1``
(.ci/run), where an out-of-range index inside a kernel raises instead of reading garbage.

The examples are derandomized so CI is reproducible; for a deeper local search set
``DS41NUMBA_FUZZ_EXAMPLES`` (examples per test, e.g. 500) and ``DS41NUMBA_FUZZ_RANDOM=1``.
"""

import math
import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import naive
from helpers import bf16, random_x
from ds41numba import (AttentionStack, AttnConfig, act_quant_fp8_inplace, apply_rotary,
                       fp4_quant_e4m3_inplace, fp4_quant_e8m0_inplace, is_bf16_valued,
                       linear_bf16, linear_f32, pow2ceil, rms_norm, select_candidate_blocks,
                       sparse_attn, to_bf16_rne, to_e2m1_rne, to_e4m3_rne, torch_cpu_topk_rows,
                       torch_cpu_topk_set, window_index_rows, yarn_freqs_cis)
from ds41numba.compressor import CompressorState, CompressorWeights, compressor
from ds41numba.golden import make_weights
from ds41numba.indexer import IndexerCfg, IndexerWeights, indexer

RATIOS = [0, 1, 2, 3, 4, 7, 128]
ERRORS = (ValueError, TypeError)


def fuzz(examples):
    """Settings for one fuzz test: ``examples`` by default, reproducible unless asked otherwise."""
    n = int(os.environ.get("DS41NUMBA_FUZZ_EXAMPLES", examples))
    return settings(max_examples=n, deadline=None, print_blob=True,
                    derandomize=os.environ.get("DS41NUMBA_FUZZ_RANDOM") != "1",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def refused(call, *words):
    """``call()`` must raise ValueError/TypeError whose message names the problem (all ``words``)."""
    with pytest.raises(ERRORS) as info:
        call()
    msg = str(info.value).lower()
    for w in words:
        assert w.lower() in msg, f"message {str(info.value)!r} does not mention {w!r}"
    return info.value


# =============================================================================== configs


@st.composite
def small_dims(draw):
    """The non-topology fields of a small config (cheap to run)."""
    n_heads = draw(st.integers(1, 4))
    return dict(
        dim=draw(st.integers(32, 64)), n_heads=n_heads, head_dim=draw(st.sampled_from([32, 64])),
        rope_head_dim=draw(st.sampled_from([2, 8, 16])), q_lora_rank=draw(st.integers(8, 32)),
        o_lora_rank=draw(st.integers(4, 24)),
        o_groups=draw(st.sampled_from([g for g in range(1, n_heads + 1) if n_heads % g == 0])),
        window_size=draw(st.integers(1, 33)), index_n_heads=draw(st.integers(1, 3)),
        index_head_dim=32, index_topk=draw(st.integers(1, 12)),
        candidate_topk_blocks=draw(st.integers(1, 4)), candidate_block_size=draw(st.integers(1, 5)),
        compress_rope_theta=draw(st.sampled_from([40000.0, 160000.0])),
        rope_factor=draw(st.sampled_from([1.0, 2.0, 16.0])),
        original_seq_len=draw(st.sampled_from([0, 16, 64])), beta_fast=32, beta_slow=1,
        rope_theta=10000.0, norm_eps=draw(st.sampled_from([1e-20, 1e-6])))


@st.composite
def valid_topology(draw, min_layers=1, max_layers=5, min_compressed=0):
    """Ratios and roles that satisfy SPEC's sharing rules, built layer by layer: a compressed layer
    becomes a kv / index source whenever the latest one has another ratio (else at random), and an
    index source that is not a kv source needs a key owner of its ratio."""
    n = draw(st.integers(max(min_layers, min_compressed), max_layers))
    ratios = draw(st.lists(st.sampled_from(RATIOS), min_size=n, max_size=n))
    if sum(r > 0 for r in ratios) < min_compressed:
        for i in range(min_compressed):
            ratios[-1 - i] = ratios[-1 - i] or draw(st.sampled_from(RATIOS[1:]))
    kv, idx = [], []
    last_kv = last_idx = last_owner = None
    for i, r in enumerate(ratios):
        if r == 0:
            continue
        is_kv = last_kv != r or draw(st.booleans())
        is_idx = last_idx != r or draw(st.booleans())
        if is_idx and not is_kv and last_owner != r:
            is_kv = True
        if is_kv:
            kv.append(i)
            last_kv = r
        if is_idx:
            idx.append(i)
            last_idx = r
        if is_kv and is_idx:
            last_owner = r
    cands = [c for c in idx if all(ratios[j] == ratios[c] for j in idx if j > c)]
    cand = draw(st.sampled_from([-1] + cands)) if cands else -1
    return dict(compress_ratios=ratios, kv_source_layers=kv, index_source_layers=idx,
                candidate_source_layer=cand)


def topology_ok(d):
    """SPEC's sharing rules, checked independently of config.py: None if they hold, else a reason."""
    ratios, kv, idx, c = (d["compress_ratios"], d["kv_source_layers"], d["index_source_layers"],
                          d["candidate_source_layer"])
    n = len(ratios)
    if n == 0 or any(r < 0 for r in ratios):
        return "ratios"
    for ids in (kv, idx):
        if len(set(ids)) != len(ids) or any(not 0 <= i < n or ratios[i] == 0 for i in ids):
            return "ids"
    for i, r in enumerate(ratios):
        if r == 0:
            continue
        ks = [s for s in kv if s <= i]
        xs = [s for s in idx if s <= i]
        if not ks or ratios[max(ks)] != r or not xs or ratios[max(xs)] != r:
            return f"layer {i} sources"
        if i in idx:
            owners = [s for s in kv if s <= i and s in idx]
            if not owners or ratios[max(owners)] != r:
                return f"layer {i} key owner"
    if not -1 <= c < n:
        return "candidate range"
    if c >= 0 and (c not in idx or any(ratios[j] != ratios[c] for j in idx if j > c)):
        return "candidate"
    return None


# =============================================================================== config fuzz

_BAD_VALUES = [0, -1, -7, 1.5, float("nan"), float("inf"), -0.0, True, False, None, "8", [], 2**70]
_FIELDS = ["dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
           "window_size", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
           "candidate_block_size", "compress_rope_theta", "rope_factor", "original_seq_len",
           "beta_fast", "beta_slow", "rope_theta", "norm_eps", "max_seq_len",
           "candidate_source_layer"]


@fuzz(400)
@given(dims=small_dims(), data=st.data())
def test_fuzz_config(dims, data):
    """Random topologies (valid and not) and hostile field values: ValueError/TypeError naming the
    field, or a config whose topology really satisfies the rules and whose stack runs a prefill."""
    n = data.draw(st.integers(0, 5), "n_layers")
    topo = dict(
        compress_ratios=data.draw(st.lists(st.sampled_from(RATIOS + [-1]), min_size=n, max_size=n)),
        kv_source_layers=data.draw(st.lists(st.integers(-1, n), max_size=3)),
        index_source_layers=data.draw(st.lists(st.integers(-1, n), max_size=4)),
        candidate_source_layer=data.draw(st.integers(-2, n)))
    if data.draw(st.booleans(), "valid topology"):
        topo = data.draw(valid_topology())
    fields = {**dims, **topo, "max_seq_len": data.draw(st.integers(1, 300), "max_seq_len")}
    bad = data.draw(st.lists(st.tuples(st.sampled_from(_FIELDS + ["compress_ratios"]),
                                       st.sampled_from(_BAD_VALUES)), max_size=2), "bad fields")
    for name, value in bad:
        if name == "compress_ratios" and isinstance(fields[name], list) and fields[name]:
            fields[name] = [value] + list(fields[name][1:])
        else:
            fields[name] = value
    try:
        cfg = AttnConfig.from_dict(fields)
    except ERRORS as e:
        msg = str(e)
        assert msg.startswith("config:"), msg
        named = [name for name, _ in bad] + ["compress_ratios", "kv_source", "index_source",
                                              "candidate", "layer", "ratio", "head_dim", "rope",
                                              "o_groups", "index"]
        assert any(w in msg for w in named), msg
        return
    # Accepted: every field holds what a reference ModelArgs would (ints as ints, reals finite).
    for name in _FIELDS:
        v = getattr(cfg, name)
        assert not isinstance(v, bool), (name, v)
        assert isinstance(v, (int, float)) and math.isfinite(v), (name, v)
    assert all(type(r) is int for r in cfg.compress_ratios)
    reason = topology_ok(cfg.to_dict())
    assert reason is None, f"accepted a config that breaks the rules: {reason}: {cfg.to_dict()}"
    sizes = [getattr(cfg, f) for f in _FIELDS[:13]] + [cfg.max_seq_len, *cfg.compress_ratios]
    if max(sizes) > 4096:        # valid, but too big to build here (a MemoryError at worst)
        return
    stack = AttentionStack(cfg, make_weights(cfg, None, 0))
    x = random_x(np.random.default_rng(0), min(3, cfg.max_seq_len), cfg.dim)
    for i in range(cfg.n_layers):
        run = stack.forward(i, x, 0)
        assert run.out.shape == x.shape and np.isfinite(run.out).all()


# =============================================================================== stack runs


@st.composite
def stack_plan(draw, min_compressed=0):
    dims = draw(small_dims())
    topo = draw(valid_topology(min_compressed=min_compressed))
    prefill = draw(st.one_of(st.integers(1, 24), st.integers(1, 300),
                             st.sampled_from([120, 126, 127, 128, 129])))
    decode = draw(st.integers(0, 20))
    cfg = AttnConfig(**dims, **topo, max_seq_len=prefill + decode + draw(st.integers(0, 3)))
    return cfg, prefill, decode


def non_finite(rng, x, kind):
    """Put NaN, +-inf, the largest bf16 or a bf16 subnormal into a random row (whole row or one
    element) of x. The largest bf16 squares to inf in RMSNorm, so it acts as non-finite input."""
    v = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": -3.3895314e38, "tiny": 2.0 ** -130}[kind]
    x = x.copy()
    row = rng.integers(0, x.shape[0])
    if rng.integers(0, 2):
        x[row] = v
    else:
        x[row, rng.integers(0, x.shape[1])] = v
    return x


@fuzz(150)
@given(plan=stack_plan(), seed=st.integers(0, 2**32 - 1),
       poison=st.sampled_from([None, None, None, "nan", "inf", "-inf", "huge", "tiny"]),
       twin=st.booleans())
def test_fuzz_stack(plan, seed, poison, twin):
    """A prefill and decode steps that cross group and window boundaries, on random configs and
    weights, inputs sometimes carrying NaN / inf: every step satisfies the invariants; with finite
    inputs the output is finite; a second stack run without capture gives the same bits."""
    cfg, prefill, decode = plan
    note(f"config {cfg.to_dict()} prefill {prefill} decode {decode}")
    rng = np.random.default_rng(seed)
    weights = make_weights(cfg, None, seed)
    stack = AttentionStack(cfg, weights)
    other = AttentionStack(cfg, weights) if twin else None
    rings = {i: naive.WindowRing(cfg.window_size) for i in range(cfg.n_layers)}
    poison_step = rng.integers(0, decode + 1) if poison else None
    finite = True
    steps = [(0, prefill)] + [(prefill + s, 1) for s in range(decode)]
    for step, (start_pos, seqlen) in enumerate(steps):
        for i in range(cfg.n_layers):
            x = random_x(rng, seqlen, cfg.dim)
            if step == poison_step and rng.integers(0, 2):
                x = non_finite(rng, x, poison)
                finite = finite and poison == "tiny"     # bf16 subnormals stay finite
            try:
                run = stack.forward(i, x, start_pos, capture=True)
            except ValueError as e:
                # The one refusal a valid config may meet: an index source falls back on the keys
                # another ratio's key owner published last, and they are too short for this step.
                assert "shared index keys" in str(e), e
                keys = stack.shared.index_k
                width = (start_pos + seqlen) // cfg.ratio(i)
                assert keys is None or keys.keys.shape[0] < width, e
                return
            src = cfg.index_source_of(i) if cfg.ratio(i) else None
            exact = finite and not (src is not None and cfg.uses_candidates(src))
            naive.check_step(cfg, stack, i, run, start_pos, seqlen, rings[i], exact)
            if finite:
                assert np.isfinite(run.out).all(), f"layer {i} step {step}: non-finite output"
            if other is not None:
                got = other.forward(i, x, start_pos).out
                assert np.array_equal(got, run.out, equal_nan=True), f"layer {i} step {step}: capture"


# =============================================================================== call order


@fuzz(150)
@given(plan=stack_plan(min_compressed=2), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_fuzz_call_order(plan, seed, data):
    """Layers called in random orders, repeated and skipped, within each step: a call is either
    refused with a ValueError that says what to run first, or returns exactly what the in-order run
    (the reference's order) returned for that layer and step."""
    cfg, prefill, decode = plan
    decode = min(decode, 6)
    note(f"config {cfg.to_dict()} prefill {prefill} decode {decode}")
    weights = make_weights(cfg, None, seed)
    rng = np.random.default_rng(seed)
    steps = [(0, prefill)] + [(prefill + s, 1) for s in range(decode)]
    xs = {(s, i): random_x(rng, n, cfg.dim) for s, (_, n) in enumerate(steps)
          for i in range(cfg.n_layers)}
    ref = AttentionStack(cfg, weights)
    want = {}
    try:
        for s, (p, _) in enumerate(steps):
            for i in range(cfg.n_layers):
                want[s, i] = ref.forward(i, xs[s, i], p).out
    except ValueError as e:     # see test_fuzz_stack: keys of another ratio too short
        assert "shared index keys" in str(e), e
        return
    stack = AttentionStack(cfg, weights)
    layers = list(range(cfg.n_layers))
    for s, (start_pos, _) in enumerate(steps):
        order = data.draw(st.lists(st.sampled_from(layers), max_size=2 * cfg.n_layers)
                          | st.permutations(layers), f"order of step {s}")
        for i in order:
            try:
                run = stack.forward(i, xs[s, i], start_pos)
            except ValueError as e:
                msg = str(e)
                assert f"layer {i}" in msg and ("run" in msg or "follow" in msg), msg
                continue
            assert np.array_equal(run.out, want[s, i], equal_nan=True), \
                f"step {s}: layer {i} accepted in order {order} but its output differs"


# =============================================================================== bad inputs


def _tiny_stack(seed=0):
    cfg = AttnConfig(dim=40, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16,
                     o_lora_rank=8, o_groups=1, window_size=5, compress_ratios=[0, 2, 2, 2],
                     kv_source_layers=[1], index_source_layers=[1, 3],
                     candidate_source_layer=1, candidate_topk_blocks=2, candidate_block_size=2,
                     index_n_heads=2, index_head_dim=32, index_topk=3, max_seq_len=24)
    return cfg, make_weights(cfg, None, seed)


_X_BENIGN = ["noncontig", "fortran", "readonly", "bfloat16", "plain"]
_X_BAD = ["float64", "float16", "int32", "bool", "complex64", "object", "str", "1d", "3d", "0d",
          "dim", "empty", "non_bf16", "list"]
_POS_BAD = ["negative", "float", "bool", "none", "str", "past_max", "not_following", "chunked",
            "layer_neg", "layer_big", "layer_float", "layer_str"]


def _mutate_x(kind, x, rng):
    if kind == "noncontig":
        wide = np.repeat(x, 2, axis=1)
        return wide[:, ::2]
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "readonly":
        y = x.copy()
        y.setflags(write=False)
        return y
    if kind == "bfloat16":
        return x.astype(ml_dtypes.bfloat16)
    if kind == "plain":
        return x
    if kind in ("float64", "float16", "int32", "bool", "complex64", "object", "str"):
        return x.astype(kind if kind != "str" else "U8")
    if kind == "1d":
        return x.reshape(-1)
    if kind == "3d":
        return x[None]
    if kind == "0d":
        return np.float32(1.0)
    if kind == "dim":
        return np.concatenate([x, x[:, :1]], axis=1) if rng.integers(0, 2) else x[:, :-1].copy()
    if kind == "empty":
        return x[:0]
    if kind == "non_bf16":
        y = x.copy()
        y[rng.integers(0, y.shape[0]), rng.integers(0, y.shape[1])] += np.float32(2.0 ** -12)
        y.view(np.uint32).reshape(-1)[0] |= 1
        return y
    if kind == "list":
        return x.tolist()
    raise AssertionError(kind)


_X_WORDS = {"float64": "float32", "float16": "float32", "int32": "float32", "bool": "float32",
            "complex64": "float32", "object": "float32", "str": "float32", "list": "float32",
            "1d": "shape", "3d": "shape", "0d": "shape", "dim": "shape", "empty": "empty",
            "non_bf16": "bf16"}


@fuzz(150)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(0, 6),
       kind=st.sampled_from(_X_BENIGN + _X_BAD + _POS_BAD), layer=st.integers(0, 3))
def test_fuzz_bad_step(seed, steps, kind, layer):
    """A bad x, start_pos or layer id at some point of a run: refused naming the problem, and the
    refused call changes nothing (the run continues exactly as a twin that never saw it). Non-
    contiguous, Fortran-ordered, read-only and bfloat16 inputs are fine and give the same bits."""
    cfg, weights = _tiny_stack()
    rng = np.random.default_rng(seed)
    stack, twin = AttentionStack(cfg, weights), AttentionStack(cfg, weights)
    prefill = 4
    positions = [0] + list(range(prefill, prefill + steps))
    for p in positions:
        seqlen = prefill if p == 0 else 1
        for i in range(cfg.n_layers):
            x = random_x(rng, seqlen, cfg.dim)
            want = twin.forward(i, x, p).out
            if i == layer and p == positions[-1] and kind in _X_BENIGN:
                arg = _mutate_x(kind, x, rng)
                keep = np.array(arg, dtype=np.float32, copy=True)
                got = stack.forward(i, arg, p).out
                assert np.array_equal(np.asarray(arg, dtype=np.float32), keep), "x was modified"
            else:
                if i == layer and p == positions[-1]:
                    _refused_step(stack, kind, i, x, p, rng, cfg)
                got = stack.forward(i, x, p).out
            assert np.array_equal(got, want, equal_nan=True), f"layer {i} at {p} after {kind}"


def _refused_step(stack, kind, i, x, p, rng, cfg):
    if kind in _X_BAD:
        refused(lambda: stack.forward(i, _mutate_x(kind, x, rng), p), "x", _X_WORDS[kind])
        return
    word = "layer" if kind.startswith("layer") else "max_seq_len" if kind == "past_max" else "start_pos"
    args = {"negative": (i, x, -1 - p), "float": (i, x, float(p)), "bool": (i, x, bool(p)),
            "none": (i, x, None), "str": (i, x, str(p)),
            "past_max": (i, random_x(rng, cfg.max_seq_len + 1 - p, cfg.dim), p)
            if p == 0 else (i, x, cfg.max_seq_len),
            "not_following": (i, x, p + 1 + int(rng.integers(0, 3))),
            "chunked": (i, random_x(rng, 2, cfg.dim), max(p, 1)),
            "layer_neg": (-1, x, p), "layer_big": (cfg.n_layers, x, p),
            "layer_float": (float(i), x, p), "layer_str": (str(i), x, p)}[kind]
    refused(lambda: stack.forward(*args), word)


# =============================================================================== public functions

_DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "bool", "complex64"]
_SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 448.0, 6.0, 1e-30, 3e38],
                     np.float32)


@st.composite
def hostile_arrays(draw, max_ndim=3, max_side=9, dtypes=_DTYPES):
    """Arrays of any small shape (0-d and empty included) and dtype, full of ties and specials,
    sometimes non-contiguous, Fortran-ordered or read-only."""
    ndim = draw(st.integers(0, max_ndim))
    shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vals = to_bf16_rne(rng.standard_normal(shape).astype(np.float32) * np.float32(draw(
        st.sampled_from([1.0, 1e-3, 100.0]))))
    if vals.size and draw(st.booleans()):
        mask = rng.random(shape) < 0.3
        vals[mask] = rng.choice(_SPECIALS, size=int(mask.sum()))
    dtype = draw(st.sampled_from(dtypes))
    with np.errstate(all="ignore"):
        a = vals.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    layout = draw(st.sampled_from(["c", "f", "strided", "readonly"]))
    if layout == "f":
        a = np.asfortranarray(a)
    elif layout == "strided" and a.ndim:
        a = np.repeat(a, 2, axis=-1)[..., ::2]
    elif layout == "readonly":
        a = a.copy()
        a.setflags(write=False)
    return a


def same_bits(got, want):
    """Equal as float32, any NaN meeting any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return got.shape == want.shape and bool(np.all((got == want) | (np.isnan(got) & np.isnan(want))))


@fuzz(300)
@given(a=hostile_arrays(max_ndim=2, max_side=70),
       k=st.one_of(st.integers(-2, 80), st.sampled_from([1.0, True, None, "2"]),
                   st.lists(st.integers(-1, 70), max_size=3)))
def test_fuzz_topk(a, k):
    """torch_cpu_topk_set / _rows on anything: a TypeError/ValueError naming vals or k, or the set
    libstdc++'s algorithms give (naive.torch_cpu_topk_set), sorted, distinct, in range; NaN first."""
    before = np.array(a, copy=True)
    fn = torch_cpu_topk_set if a.ndim == 1 else torch_cpu_topk_rows
    try:
        got = fn(a, k)
    except ERRORS as e:
        assert "vals" in str(e) or "k" in str(e), str(e)
        return
    finally:
        assert np.array_equal(np.asarray(a), before, equal_nan=True), "input modified"
    assert a.ndim in (1, 2) and (np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16")
    rows = np.asarray(a, np.float32) if a.ndim == 2 else np.asarray(a, np.float32)[None]
    got = got if a.ndim == 2 else got[None]
    assert got.dtype == np.int64 and got.shape[0] == rows.shape[0]
    ks = np.broadcast_to(np.asarray(k), (len(rows),))
    for row, kk, g in zip(rows, ks, got):
        sel = g[g != -1] if a.ndim == 2 else g
        assert len(sel) == kk and np.all(np.diff(sel) > 0) and np.all((sel >= 0) & (sel < len(row)))
        assert np.array_equal(sel, naive.torch_cpu_topk_set(row, int(kk)))


_CONVERSIONS = {"to_bf16_rne": (to_bf16_rne, naive.to_bf16_rne),
                "to_e4m3_rne": (to_e4m3_rne, naive.to_e4m3_rne),
                "to_e2m1_rne": (to_e2m1_rne, naive.to_e2m1_rne),
                "pow2ceil": (pow2ceil, naive.pow2ceil)}
_QUANTS = {"act_quant_fp8_inplace": (act_quant_fp8_inplace, naive.act_quant_fp8_inplace, 32),
           "fp4_quant_e8m0_inplace": (fp4_quant_e8m0_inplace, naive.fp4_quant_e8m0_inplace, 32),
           "fp4_quant_e4m3_inplace": (fp4_quant_e4m3_inplace, naive.fp4_quant_e4m3_inplace, 16)}


@fuzz(300)
@given(a=hostile_arrays(max_side=40),
       name=st.sampled_from(sorted(_CONVERSIONS) + sorted(_QUANTS) + ["is_bf16_valued"]),
       block=st.one_of(st.none(), st.integers(-1, 40), st.sampled_from([2.0, True])))
def test_fuzz_roundings(a, name, block):
    """Roundings and quantisers on any array: TypeError/ValueError naming the problem, or the
    ml_dtypes / numpy result bit for bit, the input untouched (out-of-place) or x returned."""
    before = np.array(a, copy=True)
    if name in _CONVERSIONS or name == "is_bf16_valued":
        fn = to_bf16_rne if name == "is_bf16_valued" else _CONVERSIONS[name][0]
        try:
            got = (is_bf16_valued if name == "is_bf16_valued" else fn)(a)
        except TypeError as e:
            assert a.dtype != np.float32 and "float32" in str(e), (a.dtype, str(e))
            return
        assert a.dtype == np.float32
        assert np.array_equal(a, before, equal_nan=True), "input modified"
        if name == "is_bf16_valued":
            assert got == bool(np.all(np.isnan(a) | (naive.to_bf16_rne(a) == a)))
            return
        want = _CONVERSIONS[name][1](a)
        if name == "to_e2m1_rne":     # documented: NaN stays NaN (ml_dtypes' e2m1 makes it a zero)
            want = np.where(np.isnan(a), np.float32(np.nan), want)
        assert got.dtype == np.float32 and same_bits(got, want)
        return
    fn, ref, default = _QUANTS[name]
    try:
        got = fn(a) if block is None else fn(a, block)
    except ERRORS as e:
        blk = default if block is None else block
        ok_block = not isinstance(blk, (bool, float)) and blk >= 1
        fits = ok_block and a.ndim and a.shape[-1] % blk == 0
        ok = (a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable and fits)
        assert not ok, f"refused a valid call: {e}"
        assert any(w in str(e) for w in ("float32", "contiguous", "read-only", "block")), str(e)
        assert np.array_equal(a, before, equal_nan=True), "refused call modified its input"
        return
    blk = default if block is None else block
    assert got is a and is_bf16_valued(got)
    assert same_bits(got, ref(before, blk)), "differs from the naive quantiser"


@fuzz(200)
@given(x=hostile_arrays(max_ndim=3, max_side=12, dtypes=["float32"] * 5 + ["float64"]),
       wshape=st.lists(st.integers(0, 12), min_size=0, max_size=3),
       fn=st.sampled_from(["linear_bf16", "linear_f32", "rms_norm"]))
def test_fuzz_linear_and_norm(x, wshape, fn):
    """Projections and RMSNorm with matching and mismatching shapes: an error naming the shapes,
    or a float32 result of shape ``[..., out]`` / x's shape."""
    rng = np.random.default_rng(0)
    w = to_bf16_rne(rng.standard_normal(wshape).astype(np.float32))
    try:
        if fn == "rms_norm":
            got = rms_norm(x, w, 1e-6)
        else:
            got = (linear_bf16 if fn == "linear_bf16" else linear_f32)(x, w)
    except ERRORS as e:
        assert any(w in str(e) for w in ("shape", "float32", "1-D", "2-D")), str(e)
        return
    assert x.dtype == np.float32 and got.dtype == np.float32
    want = x.shape if fn == "rms_norm" else x.shape[:-1] + (w.shape[0],)
    assert got.shape == want
    if fn == "rms_norm" and x.size:
        assert same_bits(got, naive.rms_norm(x, w, 1e-6))


@fuzz(200)
@given(data=st.data(), rd=st.sampled_from([2, 4, 8, 16]), length=st.integers(0, 40),
       yarn=st.sampled_from([0, 32]), base=st.sampled_from([10000.0, 1.0, 0.5, 0.0, -5.0, np.inf]))
def test_fuzz_rope(data, rd, length, yarn, base):
    """yarn_freqs_cis and apply_rotary with hostile parameters, positions and shapes: an error
    that names the parameter, or a finite table and the naive rotation bit for bit."""
    try:
        table = yarn_freqs_cis(rd, length, yarn, base, 2.0, 32, 1)
    except ERRORS as e:
        assert "base" in str(e), str(e)
        assert not (base > 0 and np.isfinite(base)) or (yarn and base == 1.0)
        return
    assert table[0].shape == (length, rd // 2) and np.isfinite(table[0]).all()
    x = data.draw(hostile_arrays(max_ndim=3, max_side=20, dtypes=["float32"] * 4 + ["float64"]), "x")
    n = x.shape[0] if x.ndim else 0
    positions = data.draw(st.one_of(
        st.lists(st.integers(-2, length + 1), min_size=n, max_size=n),
        st.lists(st.integers(0, max(length - 1, 0)), min_size=max(n - 1, 0), max_size=n + 1)), "pos")
    pos = np.array(positions, dtype=data.draw(st.sampled_from(["int64", "int32", "float64"])))
    inverse = data.draw(st.booleans(), "inverse")
    try:
        got = apply_rotary(x, pos, table, inverse=inverse)
    except ERRORS as e:
        assert any(w in str(e) for w in ("x", "position", "table", "rd")), str(e)
        return
    assert got.shape == x.shape and got.dtype == np.float32
    if x.size:
        assert same_bits(got, naive.apply_rotary(x, pos.astype(np.int64), table, inverse))


@fuzz(200)
@given(scores=hostile_arrays(max_ndim=3, max_side=30),
       clen=st.one_of(st.integers(-1, 31), st.lists(st.integers(-1, 31), max_size=4),
                      st.sampled_from([1.5, None])),
       topk_blocks=st.one_of(st.integers(-1, 8), st.sampled_from([2.0, True])),
       block_size=st.one_of(st.integers(-1, 6), st.sampled_from([1.0, False])))
def test_fuzz_select_candidate_blocks(scores, clen, topk_blocks, block_size):
    """The candidate mask on anything: an error naming the argument, or whole blocks, at most
    topk_blocks of them, always including the block of the newest visible position."""
    try:
        mask = select_candidate_blocks(scores, clen, topk_blocks, block_size)
    except ERRORS as e:
        assert any(w in str(e) for w in ("scores", "clen", "topk_blocks", "block_size")), str(e)
        return
    rows, width = scores.shape
    assert mask.shape == (rows, width) and mask.dtype == np.bool_
    cl = np.broadcast_to(np.asarray(clen), (rows,))
    nb = -(-width // block_size)
    for r in range(rows):
        blocks = np.zeros(nb, bool)
        for b in range(nb):
            part = mask[r, b * block_size:(b + 1) * block_size]
            assert part.all() or not part.any(), "a block is partly selected"
            blocks[b] = part.any()
        assert blocks.sum() <= topk_blocks
        if cl[r] > 0 and not np.isnan(np.asarray(scores[r], np.float32)).any():   # NaN ranks first
            assert blocks[(cl[r] - 1) // block_size], "the newest visible block is not kept"


@fuzz(200)
@given(data=st.data(), S=st.integers(0, 4), H=st.integers(1, 3), rows=st.integers(0, 6),
       W=st.integers(0, 5), split=st.booleans())
def test_fuzz_sparse_attn_and_window(data, S, H, rows, W, split):
    """sparse_attn with indices in and out of range (and -2), wrong sinks and dtypes; window rows
    for any arguments: an error naming the argument, or the documented result."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), "seed"))
    q = bf16(rng, (S, H, 32))
    kv = bf16(rng, (rows, 32))
    idx = np.array(data.draw(st.lists(st.lists(st.integers(-2, rows), min_size=W, max_size=W),
                                      min_size=S, max_size=S), "idx"), dtype=np.int64).reshape(S, W)
    idx = idx.astype(data.draw(st.sampled_from(["int32", "int64", "float32"]), "idx dtype"))
    sink = bf16(rng, (data.draw(st.sampled_from([H, H, H + 1]), "sink"),))
    kv_arg = (kv[:rows // 2], kv[rows // 2:]) if split else kv
    try:
        o = sparse_attn(q, kv_arg, idx, sink, 32 ** -0.5)
    except ERRORS as e:
        assert any(w in str(e) for w in ("idx", "attn_sink")), str(e)
        assert idx.dtype == np.float32 or sink.shape != (H,) or (idx.size and (
            idx.min() < -1 or idx.max() >= rows)), f"refused a valid call: {e}"
    else:
        assert o.shape == (S, H, 32) and is_bf16_valued(o) and np.isfinite(o).all()
        for s in range(S):
            if not np.any(idx[s] >= 0):
                assert not o[s].any(), "a query with no listed row must output zeros"
    start_pos = data.draw(st.sampled_from([-1, 0, 0, 3, 40]), "start_pos")
    seqlen = data.draw(st.sampled_from([0, 1, 1, 5]), "seqlen")
    window = data.draw(st.sampled_from([-1, 0, 1, 4, 33]), "window")
    try:
        got = window_index_rows(start_pos, seqlen, window)
    except ERRORS as e:
        assert any(w in str(e) for w in ("start_pos", "seqlen", "window", "decode")), str(e)
        assert start_pos < 0 or seqlen < 1 or window < 1 or (start_pos > 0 and seqlen != 1)
    else:
        assert np.array_equal(got, naive.window_index_rows(start_pos, seqlen, window))


_IDX_BREAKS = ["none", "weights_proj", "wq_b", "index_k_rows", "index_k_dim", "cands_missing",
               "cands_shape", "cands_dtype", "ratio", "n_heads", "tile", "qr_rows", "x_dtype",
               "offset", "topk"]
_COMP_BREAKS = ["none", "wgate", "wkv", "state_ratio", "state_dim", "ratio", "x_1d", "decode_2"]


@fuzz(200)
@given(seed=st.integers(0, 2**16), brk=st.sampled_from(_IDX_BREAKS), cbrk=st.sampled_from(_COMP_BREAKS),
       seqlen=st.integers(1, 9), ratio=st.sampled_from([1, 2, 3]), decode=st.booleans())
def test_fuzz_indexer_and_compressor(seed, brk, cbrk, seqlen, ratio, decode):
    """The indexer and compressor called directly with one inconsistent argument: a ValueError or
    TypeError naming it (never a stray read: run with NUMBA_BOUNDSCHECK=1), else a valid result."""
    rng = np.random.default_rng(seed)
    dim, ql, ih, idim, hd = 40, 16, 2, 32, 32
    start_pos = 9 if decode else 0
    n = 1 if decode else seqlen
    width = (start_pos + n) // ratio
    cfg = IndexerCfg(n_heads=ih, head_dim=idim, topk=3, ratio=ratio, norm_eps=1e-6,
                     use_candidates=True, candidate_block_size=2)
    nb = -(-width // 2)
    args = dict(x=bf16(rng, (n, dim)), qr=bf16(rng, (n, ql)), start_pos=start_pos, cfg=cfg,
                weights=IndexerWeights(wq_b=bf16(rng, (ih * idim, ql), 0.2),
                                       weights_proj=bf16(rng, (ih, dim), 0.2)),
                table=yarn_freqs_cis(8, 64, 0, 10000.0, 1.0, 0, 0),
                index_k=bf16(rng, (width + 1, idim)), offset=5,
                candidate_blocks=np.packbits(rng.random((n, nb)) < 0.5, axis=1))
    W = args["weights"]
    breaks = {
        "weights_proj": lambda: setattr(W, "weights_proj", bf16(rng, (ih + 1, dim))),
        "wq_b": lambda: setattr(W, "wq_b", bf16(rng, (ih * idim - 1, ql))),
        "index_k_rows": lambda: args.update(index_k=args["index_k"][:max(width - 1, 0)]),
        "index_k_dim": lambda: args.update(index_k=bf16(rng, (width + 1, idim // 2))),
        "cands_missing": lambda: args.update(candidate_blocks=None),
        "cands_shape": lambda: args.update(candidate_blocks=np.zeros((n + 1, 1), np.uint8)),
        "cands_dtype": lambda: args.update(candidate_blocks=np.ones((n, (nb + 7) // 8), bool)),
        "ratio": lambda: args.update(cfg=IndexerCfg(ih, idim, 3, 0, 1e-6)),
        "n_heads": lambda: args.update(cfg=IndexerCfg(ih + 1, idim, 3, ratio, 1e-6)),
        "tile": lambda: args.update(tile=-1),
        "qr_rows": lambda: args.update(qr=bf16(rng, (n + 1, ql))),
        "x_dtype": lambda: args.update(x=args["x"].astype(np.float64)),
        "offset": lambda: args.update(offset=-3),
        "topk": lambda: args.update(cfg=IndexerCfg(ih, idim, 0, ratio, 1e-6)),
        "none": lambda: None}
    breaks[brk]()
    valid = brk == "none" or (brk == "index_k_rows" and width == 0)
    try:
        idx, published, _ = indexer(**args)
    except ERRORS as e:
        assert not valid, f"refused a valid call: {e}"
        assert "indexer" in str(e), str(e)
    else:
        assert valid, f"accepted a broken call ({brk})"
        k = min(3, width)
        assert idx.shape == (n, k) and idx.dtype == np.int32
        assert np.all((idx == -1) | ((idx >= 5) & (idx < 5 + width)))

    cw = CompressorWeights(wkv=bf16(rng, (hd, dim)), wgate=bf16(rng, (hd, dim)), norm=bf16(rng, (hd,)))
    state = CompressorState.fresh(ratio, hd)
    x, r = bf16(rng, (n, dim)), ratio
    if cbrk == "wgate" and ratio > 1:
        cw.wgate = bf16(rng, (hd // 2, dim))
    elif cbrk == "wkv":
        cw.wkv = bf16(rng, (hd, dim + 1))
    elif cbrk == "state_ratio" and ratio > 1:
        state = CompressorState.fresh(ratio + 1, hd)
    elif cbrk == "state_dim" and ratio > 1:
        state = CompressorState.fresh(ratio, hd + 16)
    elif cbrk == "ratio":
        r = 0
    elif cbrk == "x_1d":
        x = x[0]
    elif cbrk == "decode_2" and decode:
        x = bf16(rng, (2, dim))
    else:
        cbrk = "none"
    try:
        lat = compressor(x, start_pos, r, cw, state, 1e-6)
    except ERRORS as e:
        assert cbrk != "none", f"refused a valid call: {e}"
        assert "compressor" in str(e), str(e)
    else:
        assert cbrk == "none", f"accepted a broken call ({cbrk})"
        groups = n // ratio if not decode else int((start_pos + 1) % ratio == 0)
        assert (lat is None and groups == 0) or lat.shape == (groups, hd)
