"""Helpers several test files share: where the data is, random inputs, small configs and
weights, comparisons in bf16 steps, and a refusal check.

The slow references the package is tested against are in ``naive.py``; this file holds none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds41numba import AttentionStack, AttnConfig, to_bf16_rne, weight_specs
from ds41numba.golden import make_weights

DATA = Path(__file__).parent / "data"
#: The reference's linears at production inner dimensions (the reference's linear_cases.npz, copied into tests/data).
LINEAR_CASES = DATA / "linear_cases.npz"


def linear_case_names(kind: str) -> list[str]:
    """The case names of LINEAR_CASES of one kind: ``y`` (bf16 linears) or ``f32``."""
    with np.load(LINEAR_CASES) as z:
        return [str(c) for c in z["cases"] if str(c).startswith(kind + ".")]


def linear_case(cases, name: str):
    """``(x, w, want)`` of one case: the reference's views ``x[:M, :K]``, ``w[:N, :K]`` of the
    8192-wide arrays (leading dimension 8192, as the reference multiplied them)."""
    m, k, n = (int(v[1:]) for v in name.split(".")[1:])
    return cases["x"][:m, :k], cases["w"][:n, :k], cases[name]
#: The reference goldens in DATA (DeepSeek's reference's own outputs, copied unchanged from
#: the reference's goldens); the other .npz files there are not goldens of a stack.
REFERENCE_GOLDENS = ("tiny", "mixed", "edge_prefill1", "edge_prefill_window", "edge_r128_short",
                     "edge_r128_groups", "prod_dev")
EPS = 1e-20
F32_U = 2.0 ** -24


# =============================================================================== inputs


def bf16(rng, shape, scale=1.0):
    """Normal values times ``scale``, rounded to bf16 (RNE), as float32."""
    return to_bf16_rne((rng.standard_normal(shape) * scale).astype(np.float32))


def random_x(rng, seqlen, dim, scale=1.0):
    """Random bf16-valued float32 rows ``[seqlen, dim]`` (rounded half away from zero: any bf16 will do)."""
    x = (rng.standard_normal((seqlen, dim)) * scale).astype(np.float32)
    bits = (x.view(np.uint32) + np.uint32(0x8000)) & np.uint32(0xFFFF0000)
    return bits.view(np.float32)


def xs(seqlen, seed=0, dim=64):
    """:func:`random_x` rows from a generator seeded with ``seed`` (dim 64: the tiny preset's)."""
    return random_x(np.random.default_rng(seed), seqlen, dim)


# =============================================================================== configs and stacks


def random_config(**kw):
    """A small one-layer config (ratio 0) with ``kw`` changed."""
    base = dict(dim=64, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
                o_groups=1, window_size=8, compress_ratios=[0], kv_source_layers=[],
                index_source_layers=[], candidate_source_layer=-1, candidate_topk_blocks=2,
                candidate_block_size=2, index_n_heads=2, index_head_dim=32, index_topk=4,
                compress_rope_theta=40000.0, rope_factor=2.0, original_seq_len=32, beta_fast=32,
                beta_slow=1, rope_theta=10000.0, norm_eps=EPS, max_seq_len=512)
    base.update(kw)
    return AttnConfig.from_dict(base)


def random_weights(config, seed):
    """Every parameter of every layer: N(0, 1/in) projections, norms near 1, N(0, 1) sinks."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(config.n_layers):
        for name, (shape, kind) in weight_specs(config, i).items():
            if name.endswith("attn_sink"):
                a = rng.standard_normal(shape)
            elif name.endswith("norm.weight"):
                a = 1.0 + 0.1 * rng.standard_normal(shape)
            else:
                a = rng.standard_normal(shape) / np.sqrt(shape[-1])
            a = a.astype(np.float32)
            out[name] = to_bf16_rne(a) if kind == "bf16" else a
    return out


def captured_steps(stack, cfg, P, n_decode, rng, layers=None):
    """Prefill then decode through every layer in order, with capture and ``bf16`` inputs;
    yields (start_pos, seqlen, layer, run)."""
    layers = range(cfg.n_layers) if layers is None else layers
    for step in range(1 + n_decode):
        start_pos, seqlen = (0, P) if step == 0 else (P + step - 1, 1)
        for i in layers:
            run = stack.forward(i, bf16(rng, (seqlen, cfg.dim)), start_pos, capture=True)
            yield start_pos, seqlen, i, run


def run_steps(stack, prefill, decode, seed=0, layers=None):
    """Prefill then decode steps through every layer in order; returns {(pos, layer): out}."""
    layers = stack.layers if layers is None else layers
    outs = {}
    rng = np.random.default_rng(seed)
    for p in [0] + list(range(prefill, prefill + decode)):
        n = prefill if p == 0 else 1
        for i in layers:
            outs[p, i] = stack.forward(i, random_x(rng, n, stack.config.dim), p).out
    return outs


def nan_stack(ratios, kv, idx, window=4, topk=4):
    """``(config, stack)`` of small layers with the given ratios and roles, for non-finite inputs."""
    cfg = AttnConfig(dim=32, n_heads=2, head_dim=32, rope_head_dim=8, q_lora_rank=8, o_lora_rank=8,
                     o_groups=2, window_size=window, compress_ratios=ratios, kv_source_layers=kv,
                     index_source_layers=idx, index_n_heads=2, index_head_dim=32, index_topk=topk,
                     max_seq_len=64)
    return cfg, AttentionStack(cfg, make_weights(cfg, None, 5))


def nan_rows(out):
    """The rows of ``out`` that are NaN (each row must be all finite or all NaN)."""
    rows = np.isnan(out).all(axis=1)
    assert np.array_equal(rows, ~np.isfinite(out).all(axis=1)), "rows partly non-finite"
    return set(np.flatnonzero(rows).tolist())


# =============================================================================== checks


def bf16_steps(a, b):
    """Elementwise distance of two bf16-valued arrays in bf16 steps (+0 and -0 are 0 apart)."""
    def ordered(x):
        u = (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u)
    return np.abs(ordered(a) - ordered(b))


def assert_bf16_close(got, want, what, min_identical=0.999):
    """At most one bf16 step apart everywhere, and at least ``min_identical`` bit-identical."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)) and np.all(np.isfinite(want)), f"{what}: non-finite values"
    assert np.array_equal(to_bf16_rne(got), got), f"{what}: not bf16-valued"
    d = bf16_steps(got, want)
    worst = np.unravel_index(np.argmax(d), d.shape) if d.size else ()
    assert d.max(initial=0) <= 1, (f"{what}: {int(d.max())} bf16 steps apart at {worst}: "
                                   f"got {got[worst]!r}, want {want[worst]!r}")
    same = float(np.mean(d == 0)) if d.size else 1.0
    assert same >= min_identical, f"{what}: only {same:.4%} bit-identical"


def assert_f32_dot_close(got, x, w, what):
    """``got`` holds f32 dot products ``x @ w.T`` summed in some f32 order: within the worst-case
    bound of any order, ``(n - 1) u sum|x_i w_i|``, of the exact value."""
    x64 = np.asarray(x, np.float64)
    w64 = np.asarray(w, np.float64)
    exact = x64 @ w64.T
    bound = (x64.shape[-1] - 1) * F32_U * (np.abs(x64) @ np.abs(w64).T) * 1.0001
    err = np.abs(np.asarray(got, np.float64) - exact)
    assert np.all(err <= bound), f"{what}: f32 error {err.max():.3g} beyond the summation bound"


def refused(call, exc, *words):
    """``call()`` must raise ``exc`` whose message contains every one of ``words``; returns it."""
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert w in str(info.value), f"{str(info.value)!r} does not mention {w!r}"
    return str(info.value)


# =============================================================================== config files


def hf_config(ref: dict, **extra) -> dict:
    """A Hugging Face V4.1 ``config.json`` for the reference-named config ``ref`` (e.g. a
    ``PRESETS`` entry), with ``extra`` keys added as they are."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": ref["dim"],
        "num_attention_heads": ref["n_heads"], "head_dim": ref["head_dim"],
        "qk_rope_head_dim": ref["rope_head_dim"], "q_lora_rank": ref["q_lora_rank"],
        "o_lora_rank": ref["o_lora_rank"], "o_groups": ref["o_groups"],
        "sliding_window": ref["window_size"], "compress_ratios": ref["compress_ratios"],
        "kv_source_layer_ids": ref["kv_source_layers"],
        "index_source_layer_ids": ref["index_source_layers"],
        "candidate_source_layer_id": ref["candidate_source_layer"],
        "candidate_topk_blocks": ref["candidate_topk_blocks"],
        "candidate_block_size": ref["candidate_block_size"],
        "index_n_heads": ref["index_n_heads"], "index_head_dim": ref["index_head_dim"],
        "index_topk": ref["index_topk"], "compress_rope_theta": ref["compress_rope_theta"],
        "rope_theta": ref["rope_theta"], "rms_norm_eps": ref["norm_eps"],
        "max_position_embeddings": ref["max_seq_len"],
        "rope_scaling": {"type": "yarn", "factor": ref["rope_factor"],
                         "original_max_position_embeddings": ref["original_seq_len"],
                         "beta_fast": ref["beta_fast"], "beta_slow": ref["beta_slow"]},
        **extra,
    }
