"""Bad input gets a ValueError/TypeError that names the problem, never garbage or a crash.

One focused test per rule of issues 3 and 6: steps out of order, positions past max_seq_len,
chunked prefill, malformed x and weights, inconsistent configs, layer subsets that would read
what they cannot have; a refused call leaves the stack unchanged. Then the documented behaviour
on non-finite inputs (NaN and inf propagate as torch propagates them; top-k ranks NaN first), and
byte-identical golden files whatever the thread count.
"""

import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import naive
from ds41numba import AttentionStack, AttnConfig, preset
from ds41numba.golden import GoldenError, GoldenPlan, make_weights
from ds41numba.stack import weight_specs

TINY = preset("tiny")       # ratios 0,0,2,2,1,1; kv 2,4; index 2,4,5; candidate source 4


@pytest.fixture(scope="module")
def tiny_weights():
    return make_weights(TINY, None, 7)


def xs(seqlen, seed=0, dim=TINY.dim):
    return naive.hz_random_x(np.random.default_rng(seed), seqlen, dim)


def run_steps(stack, prefill, decode, seed=0, layers=None):
    """Prefill then decode steps through every layer in order; returns {(pos, layer): out}."""
    layers = stack.layers if layers is None else layers
    outs = {}
    rng = np.random.default_rng(seed)
    for p in [0] + list(range(prefill, prefill + decode)):
        n = prefill if p == 0 else 1
        for i in layers:
            outs[p, i] = stack.forward(i, naive.hz_random_x(rng, n, stack.config.dim), p).out
    return outs


def refused(call, exc, *words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} does not mention {w!r}"
    return str(info.value)


# =============================================================================== step order


def test_decode_must_follow_the_layers_last_position(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, xs(1), 5), ValueError, "layer 0", "prefill at start_pos 0")
    run_steps(st, 6, 2)                                   # positions 0..7 done
    for bad in (7, 9, 20):
        refused(lambda: st.forward(0, xs(1), bad), ValueError, f"start_pos {bad}", "expected start_pos 8")
    st.forward(0, xs(1), 8)


def test_positions_past_max_seq_len(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)              # max_seq_len 64
    refused(lambda: st.forward(0, xs(65), 0), ValueError, "max_seq_len 64")
    run_steps(st, 60, 4)                                  # ends exactly at max_seq_len
    for i in range(TINY.n_layers):
        refused(lambda: st.forward(i, xs(1), 64), ValueError, "past max_seq_len 64")


def test_a_run_can_end_exactly_at_max_seq_len_for_every_ratio():
    cfg = AttnConfig(dim=32, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=8, o_lora_rank=8,
                     o_groups=2, window_size=3, compress_ratios=[0, 7, 3, 1],
                     kv_source_layers=[1, 2, 3], index_source_layers=[1, 2, 3], index_n_heads=1,
                     index_head_dim=32, index_topk=4, original_seq_len=16, max_seq_len=23)
    st = AttentionStack(cfg, make_weights(cfg, None, 1))
    outs = run_steps(st, 20, 3)
    assert all(np.isfinite(o).all() for o in outs.values())
    refused(lambda: st.forward(1, xs(1, dim=32), 23), ValueError, "max_seq_len")


def test_zero_length_and_chunked_prefill_are_refused(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, xs(0), 0), ValueError, "empty")
    run_steps(st, 4, 0)
    # The reference has no chunked prefill: several tokens after position 0 are refused.
    refused(lambda: st.forward(0, xs(3), 4), ValueError, "start_pos 4", "chunked prefill")
    st.forward(0, xs(1), 4)


def test_consumer_before_its_source_is_refused(tiny_weights):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(3, xs(6), 0), ValueError, "layer 3", "layer 2", "run sources first")
    refused(lambda: st.forward(5, xs(6), 0), ValueError, "layer 5", "layer 4")
    for i in range(TINY.n_layers):
        st.forward(i, xs(6, i), 0)
    st.forward(2, xs(1), 6)
    refused(lambda: st.forward(5, xs(1), 6), ValueError, "layer 5", "layer 4", "start_pos 6")


def test_layers_run_in_order_within_a_step(tiny_weights):
    """A later layer overwrites the shared slots an earlier one reads: out of order is refused."""
    st = AttentionStack(TINY, tiny_weights)
    st.forward(2, xs(6, 2), 0)
    st.forward(4, xs(6, 4), 0)        # layer 4 (ratio 1) now holds compress_kv and topk_idxs
    msg = refused(lambda: st.forward(3, xs(6, 3), 0), ValueError, "layer 3", "layer 2")
    assert "again first" in msg
    st.forward(2, xs(6, 2), 0)        # restarting the step from layer 2 is fine
    st.forward(3, xs(6, 3), 0)
    st.forward(4, xs(6, 4), 0)
    st.forward(5, xs(6, 5), 0)
    st.forward(2, xs(1), 6)
    st.forward(4, xs(1), 6)
    refused(lambda: st.forward(3, xs(1), 6), ValueError, "layer 3", "layer 4 already ran this step")


def test_rerunning_a_consumer_after_later_layers_is_refused(tiny_weights):
    """Before: layer 3 re-run after layers 4 and 5 read layer 4's ratio-1 selection (an
    IndexError in sparse_attn, or silently the wrong rows)."""
    st = AttentionStack(TINY, tiny_weights)
    for i in range(TINY.n_layers):
        st.forward(i, xs(12, i), 0)
    refused(lambda: st.forward(3, xs(12, 3), 0), ValueError, "layer 3", "layer 2")


def test_an_index_source_needs_every_key_owner_it_may_fall_back_on(tiny_weights):
    """Layer 2 (ratio 2) writes no index keys on decode steps that complete no group; it then
    scores against the keys layer 4 (ratio 1) left, as the reference does (tiny golden)."""
    assert TINY.fallback_key_owners(2) == [4] and TINY.fallback_key_owners(4) == []
    refused(lambda: AttentionStack(TINY, tiny_weights, layers=[2, 3]), ValueError,
            "layer 2 needs layer 4")
    with pytest.raises(GoldenError, match="layer 2 needs layer 4"):
        GoldenPlan(config=TINY, layers=(2, 3), prefill=6, decode=3)
    st = AttentionStack(TINY, tiny_weights, layers=[2, 3, 4])
    st.forward(2, xs(6), 0)
    st.forward(3, xs(6), 0)
    # end_pos 7 is odd: layer 2 writes no keys and would score against layer 4's, never computed.
    refused(lambda: st.forward(2, xs(1), 6), ValueError, "layer 2", "key owner layer 4",
            "previous step")
    st.forward(4, xs(6), 0)
    for p in (6, 7):                 # now every key owner is caught up
        for i in (2, 3, 4):
            st.forward(i, xs(1, p), p)
    st.forward(2, xs(1), 8)          # end_pos 9: layer 4 ran the previous step, fine
    st.forward(3, xs(1), 8)
    # Skip layer 4 this step: the next fallback step of layer 2 (end_pos 11) is refused.
    st.forward(2, xs(1), 9)
    refused(lambda: st.forward(2, xs(1), 10), ValueError, "layer 2 writes no index keys this step")


def test_subset_stacks_reproduce_the_full_stack():
    """With every source and fallback key owner in it, a layer subset gives the tiny golden's
    index rows exactly (a subset without layer 4 differed on 18 of 40 decode steps)."""
    d = np.load(os.path.join(os.path.dirname(__file__), "data", "tiny.npz"))
    cfg_dict = json.loads(str(d["config"]))
    cfg = AttnConfig.from_dict(cfg_dict)
    st = AttentionStack(cfg, {k: d[k] for k in d.files if k.startswith("layers.")}, layers=[2, 3, 4])
    for s in range(1 + cfg_dict["decode"]):
        p = 0 if s == 0 else cfg_dict["prefill"] + s - 1
        for i in (2, 3, 4):
            run = st.forward(i, d[f"step{s}.layers.{i}.x"], p, capture=True)
            assert np.array_equal(run.idx, d[f"step{s}.layers.{i}.idx"]), (s, i)


def test_keys_of_another_ratio_too_short_are_refused():
    """Ratio 7 then ratio 2, both key owners: at end_pos 7 layer 1 writes no keys and would
    score 3 positions against layer 0's 1-row cache (max_seq_len // 7)."""
    cfg = AttnConfig(dim=32, n_heads=1, head_dim=32, rope_head_dim=2, q_lora_rank=8, o_lora_rank=4,
                     o_groups=1, window_size=1, compress_ratios=[7, 2], kv_source_layers=[0, 1],
                     index_source_layers=[0, 1], index_n_heads=1, index_head_dim=32, index_topk=1,
                     original_seq_len=0, max_seq_len=7)
    st = AttentionStack(cfg, make_weights(cfg, None, 0))
    for p in range(0, 6):
        st.forward(0, xs(1, p, 32), p)
        st.forward(1, xs(1, p, 32), p)
    st.forward(0, xs(1, 6, 32), 6)
    refused(lambda: st.forward(1, xs(1, 6, 32), 6), ValueError, "layer 1 (ratio 2)",
            "layer 0 (ratio 7)", "only 1 rows")


def test_a_refused_call_changes_nothing(tiny_weights):
    """Before: a refused prefill had already replaced the layer's state with a fresh one."""
    a, b = AttentionStack(TINY, tiny_weights), AttentionStack(TINY, tiny_weights)
    run_steps(a, 5, 2, seed=3)
    run_steps(b, 5, 2, seed=3)
    refused(lambda: a.forward(3, xs(4), 0), ValueError, "layer 3")      # no layer 2 prefill
    refused(lambda: a.forward(3, xs(2), 7), ValueError, "chunked")
    refused(lambda: a.forward(2, xs(1).astype(np.float64), 7), ValueError, "float32")
    rng = np.random.default_rng(9)
    for i in range(TINY.n_layers):
        x = naive.hz_random_x(rng, 1, TINY.dim)
        assert np.array_equal(a.forward(i, x, 7).out, b.forward(i, x, 7).out), i


# =============================================================================== x and arguments


@pytest.mark.parametrize("bad, words", [
    (lambda x: x.astype(np.float64), ["x must be float32", "float64"]),
    (lambda x: x.astype(np.float16), ["float16"]),
    (lambda x: x.astype(np.int32), ["int32"]),
    (lambda x: x.tolist(), ["float64"]),
    (lambda x: x[:, :-1], ["shape [seqlen, 64]", "[6, 63]"]),
    (lambda x: x[None], ["[1, 6, 64]"]),
    (lambda x: x[0], ["[64]"]),
    (lambda x: x + np.float32(2.0 ** -10), ["bf16 values"]),
])
def test_bad_x(tiny_weights, bad, words):
    st = AttentionStack(TINY, tiny_weights)
    refused(lambda: st.forward(0, bad(xs(6)), 0), ValueError, *words)


def test_x_layouts_and_bf16_dtype_give_the_same_bits(tiny_weights):
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    ro = x.copy()
    ro.setflags(write=False)
    for variant in (np.asfortranarray(x), np.repeat(x, 2, axis=1)[:, ::2], ro,
                    x.astype(ml_dtypes.bfloat16)):
        got = AttentionStack(TINY, tiny_weights).forward(2, variant, 0).out
        assert np.array_equal(got, want)


@pytest.mark.parametrize("call, exc, words", [
    (lambda st: st.forward(6, xs(2), 0), ValueError, ["layer 6 is not in this stack"]),
    (lambda st: st.forward(-1, xs(2), 0), ValueError, ["layer -1"]),
    (lambda st: st.forward(1.0, xs(2), 0), TypeError, ["layer_id must be an int"]),
    (lambda st: st.forward(True, xs(2), 0), TypeError, ["layer_id"]),
    (lambda st: st.forward(0, xs(2), 0.0), TypeError, ["start_pos must be an int"]),
    (lambda st: st.forward(0, xs(2), None), TypeError, ["start_pos"]),
    (lambda st: st.forward(0, xs(1), -3), ValueError, ["start_pos must be >= 0"]),
])
def test_bad_layer_and_position_arguments(tiny_weights, call, exc, words):
    refused(lambda: call(AttentionStack(TINY, tiny_weights)), exc, *words)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(tile=-1), ValueError, ["tile"]),      # before: range(0, n, -1) left `out` uninitialised
    (dict(tile=0), ValueError, ["tile"]),
    (dict(tile=2.5), ValueError, ["tile"]),
    (dict(layers=[1.5, 2]), TypeError, ["1.5"]),  # before: silently layer 1
    (dict(layers=["a"]), TypeError, ["'a'"]),
    (dict(layers=7), TypeError, ["layers"]),
    (dict(layers=[9]), ValueError, ["layers: 9"]),
    (dict(layers=[5]), ValueError, ["layer 5 needs layer 4"]),
])
def test_bad_stack_arguments(tiny_weights, kw, exc, words):
    refused(lambda: AttentionStack(TINY, tiny_weights, **kw), exc, *words)


def test_tile_sizes_keep_outputs_sane(tiny_weights):
    for tile in (1, 3, 64):
        st = AttentionStack(TINY, tiny_weights, tile=tile)
        outs = run_steps(st, 10, 2)
        assert all(np.isfinite(o).all() for o in outs.values())


# =============================================================================== weights


def _weights_with(tiny_weights, name, value):
    w = dict(tiny_weights)
    if value is None:
        del w[name]
    else:
        w[name] = value
    return w


@pytest.mark.parametrize("name", ["layers.0.attn.wq_a.weight", "layers.2.attn.compressor.wgate.weight",
                                  "layers.4.attn.indexer.wk.weight", "layers.5.attn.attn_sink",
                                  "layers.2.attn.q_norm.weight"])
def test_missing_or_misshapen_weights(tiny_weights, name):
    a = tiny_weights[name]
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, None)), ValueError,
            name, "missing")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a[..., :-1])),
            ValueError, name, "shape")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a[None])),
            ValueError, name, "shape")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a.astype(np.int32))),
            ValueError, name, "dtype")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, a.astype(np.complex64))),
            ValueError, name, "dtype")
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, np.array("x"))),
            ValueError, name)


def test_bf16_weights_must_hold_bf16_values(tiny_weights):
    name = "layers.3.attn.wo_b.weight"
    bad = tiny_weights[name] + np.float32(2.0 ** -12)
    refused(lambda: AttentionStack(TINY, _weights_with(tiny_weights, name, bad)), ValueError,
            name, "bf16 values")
    # The f32 parameters take any float32 value.
    name = "layers.2.attn.compressor.wkv.weight"
    AttentionStack(TINY, _weights_with(tiny_weights, name, tiny_weights[name] + np.float32(2.0 ** -12)))


def test_weights_in_other_float_dtypes_and_layouts(tiny_weights):
    w = {k: (v.astype(ml_dtypes.bfloat16) if weight_kind(k) == "bf16" else np.asfortranarray(v))
         for k, v in tiny_weights.items()}
    x = xs(6)
    want = AttentionStack(TINY, tiny_weights).forward(2, x, 0).out
    assert np.array_equal(AttentionStack(TINY, w).forward(2, x, 0).out, want)


def weight_kind(name):
    i = int(name.split(".")[1])
    return weight_specs(TINY, i)[name][1]


def test_weights_must_be_a_mapping_and_config_an_attnconfig(tiny_weights):
    refused(lambda: AttentionStack(TINY, list(tiny_weights.values())), TypeError, "mapping")
    refused(lambda: AttentionStack(TINY.to_dict(), tiny_weights), TypeError, "AttnConfig")


# =============================================================================== configs

BASE = dict(dim=32, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=8, o_lora_rank=8,
            o_groups=2, window_size=4, compress_ratios=[0, 2, 2], kv_source_layers=[1],
            index_source_layers=[1], index_n_heads=1, index_head_dim=32, index_topk=4)


@pytest.mark.parametrize("changes, words", [
    # topology
    (dict(compress_ratios=[0, 2, 4]), ["layer 2 (ratio 4)", "kv source 1 (ratio 2)"]),
    (dict(compress_ratios=[0, 2, 2], kv_source_layers=[2], index_source_layers=[1, 2]),
     ["layer 1", "no kv source at or before it"]),
    (dict(index_source_layers=[]), ["no index source at or before it"]),
    (dict(index_source_layers=[1, 2], kv_source_layers=[2], compress_ratios=[0, 2, 2]),
     ["layer 1", "no kv source"]),
    (dict(compress_ratios=[0, 2, 2, 1], kv_source_layers=[1, 3], index_source_layers=[1, 3],
          candidate_source_layer=1), ["candidate consumer 3", "compress_ratio 1", "candidate source 1"]),
    (dict(candidate_source_layer=2), ["candidate_source_layer 2 must be an index source"]),
    (dict(candidate_source_layer=3), ["candidate_source_layer"]),
    (dict(candidate_source_layer=-2), ["candidate_source_layer"]),
    (dict(kv_source_layers=[1, 1]), ["kv_source_layers has duplicates"]),
    (dict(kv_source_layers=[0]), ["kv_source_layers names layer 0", "compress_ratio is 0"]),
    (dict(index_source_layers=[1, 5]), ["index_source_layers names layer 5"]),
    (dict(compress_ratios=[]), ["compress_ratios is empty"]),
    (dict(compress_ratios=[0, -2, 2]), ["compress_ratios must be >= 0"]),
    (dict(compress_ratios=[0, 2.5, 2]), ["compress_ratios must be a list of integers", "2.5"]),
    (dict(compress_ratios=[0, True, 2]), ["compress_ratios must be a list of integers"]),
    (dict(compress_ratios=[0, None, 2]), ["compress_ratios must be a list of integers"]),
    (dict(compress_ratios="022"), ["compress_ratios must be a list of integers"]),
    (dict(kv_source_layers=[1.0]), ["kv_source_layers must be a list of integers"]),
    (dict(index_source_layers=[1, 2], compress_ratios=[0, 2, 2], kv_source_layers=[1],
          candidate_source_layer=2), []),   # valid: checked below not to raise
    # dimensions
    (dict(head_dim=48), ["head_dim (48) must be a multiple of 32"]),
    (dict(head_dim=40), ["head_dim (40)"]),
    (dict(index_head_dim=48), ["index_head_dim (48) must be a multiple of FP4_BLOCK (32)"]),
    (dict(rope_head_dim=7), ["rope_head_dim (7) must be even"]),
    (dict(rope_head_dim=64, head_dim=32), ["rope_head_dim (64)"]),
    (dict(rope_head_dim=64, head_dim=64), ["rope_head_dim (64) must be at most index_head_dim"]),
    (dict(o_groups=3, n_heads=4), ["n_heads (4) must be a multiple of o_groups (3)"]),
    (dict(window_size=0), ["window_size must be a positive integer, got 0"]),
    (dict(window_size=-3), ["window_size"]),
    (dict(window_size=4.0), ["window_size must be a positive integer, got 4.0"]),
    (dict(dim=True), ["dim must be a positive integer, got True"]),
    (dict(max_seq_len=0), ["max_seq_len"]),
    (dict(index_topk=0), ["index_topk"]),
    # reals and YaRN
    (dict(norm_eps=True), ["norm_eps must be a positive number, got True"]),
    (dict(norm_eps=float("nan")), ["norm_eps"]),
    (dict(rope_theta=float("inf")), ["rope_theta"]),
    (dict(rope_factor=0.0), ["rope_factor"]),
    (dict(compress_rope_theta="1e4"), ["compress_rope_theta"]),
    (dict(compress_rope_theta=1.0), ["compress_rope_theta must not be 1 when YaRN is on"]),
    (dict(beta_fast=0), ["beta_fast must be positive when YaRN is on"]),
    (dict(beta_slow=-1), ["beta_slow must be positive"]),
    (dict(beta_fast=32.0), ["beta_fast must be an integer"]),
    (dict(original_seq_len=-1), ["original_seq_len must be >= 0"]),
])
def test_inconsistent_configs(changes, words):
    fields = {**BASE, **changes}
    if not words:
        AttnConfig.from_dict(fields)
        return
    refused(lambda: AttnConfig.from_dict(fields), ValueError, "config: ", *words)


def test_config_accepts_numpy_scalars_and_yarn_off_with_base_1():
    cfg = AttnConfig.from_dict({**BASE, "dim": np.int64(32), "rope_factor": np.float32(2.0),
                                "compress_ratios": np.array([0, 2, 2]),
                                "kv_source_layers": np.array([1])})
    assert type(cfg.dim) is int and type(cfg.rope_factor) is float
    assert all(type(r) is int for r in cfg.compress_ratios)
    assert cfg == AttnConfig.from_dict({**BASE, "rope_factor": 2.0})
    # Without YaRN a base of 1 is just a constant rotation: allowed, and it runs.
    cfg = AttnConfig.from_dict({**BASE, "compress_rope_theta": 1.0, "original_seq_len": 0})
    st = AttentionStack(cfg, make_weights(cfg, None, 0))
    for i in range(cfg.n_layers):
        assert np.isfinite(st.forward(i, xs(5, dim=32), 0).out).all()


def test_config_file_errors(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{not json")
    refused(lambda: AttnConfig.from_json(p), ValueError, "not valid JSON")
    refused(lambda: AttnConfig.from_json(tmp_path / "missing.json"), ValueError, "cannot read")
    p.write_text(json.dumps({"dim": 32}))
    refused(lambda: AttnConfig.from_json(p), ValueError, "missing field(s)", "n_heads")
    refused(lambda: AttnConfig.from_dict([1, 2]), ValueError, "expected a mapping")


# =============================================================================== non-finite input


def _nan_stack(ratios, kv, idx, window=4, topk=4):
    cfg = AttnConfig(dim=32, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=8, o_lora_rank=8,
                     o_groups=2, window_size=window, compress_ratios=ratios, kv_source_layers=kv,
                     index_source_layers=idx, index_n_heads=2, index_head_dim=32, index_topk=topk,
                     max_seq_len=64)
    return cfg, AttentionStack(cfg, make_weights(cfg, None, 5))


def _nan_rows(out):
    rows = np.isnan(out).all(axis=1)
    assert np.array_equal(rows, ~np.isfinite(out).all(axis=1)), "rows partly non-finite"
    return set(np.flatnonzero(rows).tolist())


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("whole_row", [True, False])
def test_nan_row_in_a_window_layer(value, whole_row):
    """Ratio 0, window 4, prefill 12, a non-finite value in token 5: its KV row is NaN (RMSNorm of
    inf is inf * 0), so exactly the queries whose window holds it, 5..8, output NaN rows."""
    cfg, st = _nan_stack([0], [], [])
    x = xs(12, dim=32)
    if whole_row:
        x[5] = value
    else:
        x[5, 3] = value
    assert _nan_rows(st.forward(0, x, 0).out) == {5, 6, 7, 8}
    # Decode: the NaN row (slot 5 % 4) stays in the ring until position 9 overwrites it... it was
    # already overwritten at prefill by token 9 (slot 1), so decodes are finite again.
    for p in range(12, 16):
        assert _nan_rows(st.forward(0, xs(1, p, 32), p).out) == set()
    y = xs(1, 99, 32)
    y[0, 0] = value
    assert _nan_rows(st.forward(0, y, 16).out) == {0}
    for p in range(17, 20):           # the NaN row sits in slot 0 until position 20 replaces it
        assert _nan_rows(st.forward(0, xs(1, p, 32), p).out) == {0}, p
    assert _nan_rows(st.forward(0, xs(1, 20, 32), 20).out) == set()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_nan_row_in_a_compressed_layer_is_selected_first(value):
    """Ratio 1 with an indexer: token 5's latent and index key are NaN, so every later query's
    score for position 5 is NaN, top-k ranks it first (torch's NaN-first order), and the query
    attends to a NaN row: queries 5.. output NaN, queries before it are finite."""
    cfg, st = _nan_stack([1], [0], [0], window=2, topk=2)
    x = xs(12, dim=32)
    x[5, 7] = value
    run = st.forward(0, x, 0, capture=True)
    assert _nan_rows(run.out) == set(range(5, 12))
    comp = run.idx[:, 2:]            # window entries first (min(12, 2) of them)
    for s in range(5, 12):
        assert 12 + 5 in comp[s], (s, comp[s])           # offset 12 + position 5, picked first
    assert np.isnan(run.index_score[6:, 5]).all() and np.isfinite(run.index_score[6:, :5]).all()
    # Decode: the NaN position stays selectable, so every later step outputs NaN.
    run = st.forward(0, xs(1, 1, 32), 12, capture=True)
    assert cfg.window_size + 5 in run.idx[0] and _nan_rows(run.out) == {0}


def test_nan_in_a_ratio_2_group():
    """Ratio 2: token 5 poisons group 2 (tokens 4, 5) through the softmax pooling; queries see
    position 2 from query 5 on ((s + 1) // 2 > 2), plus token 5's own window (2 rows)."""
    cfg, st = _nan_stack([2], [0], [0], window=2, topk=2)
    x = xs(12, dim=32)
    x[5] = np.nan
    run = st.forward(0, x, 0, capture=True)
    assert _nan_rows(run.out) == set(range(5, 12))
    assert np.isnan(st.shared.compress_kv[2]).all()
    assert np.isfinite(np.delete(st.shared.compress_kv[:6], 2, axis=0)).all()


def test_nan_in_the_compressor_state_during_decode():
    """A NaN token at decode fills its state slot; the group's latent is NaN once the group
    completes, never before (the pooling reads all r slots only then)."""
    cfg, st = _nan_stack([3], [0], [0], window=2, topk=1)
    st.forward(0, xs(6, dim=32), 0)
    y = xs(1, 5, 32)
    y[0] = np.nan
    st.forward(0, y, 6)                      # slot 0 of group 2 (positions 6..8)
    assert np.isnan(st.states[0].kv_state[0]).all()
    assert np.isfinite(st.shared.compress_kv[:2]).all()
    st.forward(0, xs(1, 6, 32), 7)
    assert np.isfinite(st.shared.compress_kv[:2]).all()
    out = st.forward(0, xs(1, 7, 32), 8).out   # group 2 completes: latent 2 is NaN
    assert np.isnan(st.shared.compress_kv[2]).all() and np.isnan(out).all()


# =============================================================================== determinism


def _golden_via_cli(path, threads, args):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               OMP_NUM_THREADS=str(threads), PYTHONHASHSEED="random")
    out = subprocess.run([sys.executable, "-m", "ds41numba", "golden", *args, "--quiet",
                          "--out", str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return path.read_bytes()


def _header(data):
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


# A config big enough that the parallel kernels (rounding, quantisers, RMSNorm, top-k rows) split
# their work across threads, and short enough for CI: 300-token prefill, ratio 1 rows past
# 64 * index_topk (partial-sort branch), ratio 4 with candidates.
_DET_CONFIG = dict(
    dim=128, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_lora_rank=32, o_groups=2,
    window_size=16, compress_ratios=[0, 4, 4, 1, 1], kv_source_layers=[1, 3],
    index_source_layers=[1, 2, 3, 4], candidate_source_layer=3, candidate_topk_blocks=4,
    candidate_block_size=4, index_n_heads=4, index_head_dim=32, index_topk=4,
    compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64, max_seq_len=320)


def test_golden_files_do_not_depend_on_the_thread_count(tmp_path):
    """The same seed and config give identical golden files with 1 and with 2 threads (numba and
    BLAS), written by the command line in separate processes."""
    cfg = tmp_path / "det.json"
    cfg.write_text(json.dumps(_DET_CONFIG))
    args = ["--config", str(cfg), "--prefill", "300", "--decode", "6", "--seed", "11"]
    one = _golden_via_cli(tmp_path / "one.safetensors", 1, args)
    two = _golden_via_cli(tmp_path / "two.safetensors", 2, args)
    (h1, d1), (h2, d2) = _header(one), _header(two)
    assert h1 == h2, "headers differ (tensor names, dtypes, shapes, offsets or metadata)"
    bad = [k for k, v in h1.items() if k != "__metadata__"
           and d1[slice(*v["data_offsets"])] != d2[slice(*h2[k]["data_offsets"])]]
    assert not bad, f"{len(bad)} tensors differ with the thread count, e.g. {bad[:5]}"
    assert one == two, "the files hold the same tensors but are not byte-identical"


def test_a_prefill_restarted_at_an_earlier_layer_makes_later_prefills_stale():
    """Found by fuzzing: prefill layer 2 then layer 1 (a new sequence from layer 1), then decode
    in order. Layer 2's prefill now predates layer 1's, so the index keys layer 1 falls back on
    (ratio 2, odd end_pos: layer 2's, written before the restart in layer order) were not the
    reference's; the decode returned a different output. Now refused until layer 2 reruns."""
    cfg = AttnConfig(dim=32, n_heads=1, head_dim=32, rope_head_dim=2, q_lora_rank=8, o_lora_rank=4,
                     o_groups=1, window_size=1, compress_ratios=[0, 2, 1], kv_source_layers=[1, 2],
                     index_source_layers=[1, 2], index_n_heads=1, index_head_dim=32, index_topk=1,
                     original_seq_len=0, max_seq_len=11)
    st = AttentionStack(cfg, make_weights(cfg, None, 0))
    x = {i: xs(10, i, 32) for i in range(3)}
    st.forward(2, x[2], 0)
    st.forward(1, x[1], 0)                       # restarts the prefill at layer 1
    refused(lambda: st.forward(1, xs(1, 6, 32), 10), ValueError, "key owner layer 2")
    refused(lambda: st.forward(2, xs(1, 7, 32), 10), ValueError, "layer 2", "prefill layer 2 again")
    st.forward(2, x[2], 0)                       # layer 2 again, after layer 1: in order now
    ref = AttentionStack(cfg, make_weights(cfg, None, 0))
    for i in (1, 2):
        ref.forward(i, x[i], 0)
    for i in (1, 2):
        y = xs(1, 10 + i, 32)
        assert np.array_equal(st.forward(i, y, 10).out, ref.forward(i, y, 10).out)
