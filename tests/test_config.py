"""ds41numba.config: AttnConfig's fields and names (reference ModelArgs, Hugging Face), its
validation, the layer-role graph, and the presets."""

import json

import numpy as np
import pytest

from helpers import hf_config, refused, xs
from ds41numba import AttentionStack, AttnConfig, preset
from ds41numba.config import FALLBACK_KEY_OWNER, IGNORED_KEYS, PRESETS
from ds41numba.golden import make_weights

TINY = preset("tiny")       # ratios 0,0,2,2,1,1; kv 2,4; index 2,4,5; candidate source 4


# =============================================================================== names


@pytest.mark.parametrize("typo, close", [("windw_size", "window_size"), ("n_head", "n_heads"),
                                         ("index_topk_", "index_topk"),
                                         ("compress_ratio", "compress_ratios")])
def test_an_unknown_key_is_refused_with_the_closest_name(typo, close):
    fields = {**PRESETS["tiny"], typo: 8}
    with pytest.raises(ValueError, match=f"config: unknown field '{typo}'; did you mean {close}"):
        AttnConfig.from_dict(fields)


def test_an_unknown_key_without_a_close_name():
    with pytest.raises(ValueError) as info:
        AttnConfig.from_dict({**PRESETS["tiny"], "zzz": 1})
    assert str(info.value) == "config: unknown field 'zzz'"


def test_model_args_keys_that_are_not_attention_fields_are_ignored():
    """The reference's ModelArgs carries the whole model: its other fields are accepted."""
    others = {"vocab_size": 129280, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 43,
              "n_dense_layers": 3, "n_routed_experts": 256, "n_shared_experts": 1,
              "n_activated_experts": 8, "n_expert_groups": 8, "n_limited_groups": 4,
              "score_func": "sigmoid", "route_scale": 2.5, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mscale": 1.0,
              "max_batch_size": 8, "dtype": "fp8", "scale_fmt": None, "hc_mult": 4}
    assert set(others) <= IGNORED_KEYS
    cfg = AttnConfig.from_dict({**PRESETS["tiny"], **others})
    assert cfg == TINY and cfg.extra == others


def test_a_reference_golden_config_entry_is_a_config(reference_golden):
    """A reference golden's ``config`` entry adds its run (prefill, decode, seed)."""
    cfg = AttnConfig.from_dict({**PRESETS["tiny"], "prefill": 12, "decode": 40, "seed": 0})
    assert cfg == TINY == reference_golden("tiny").config


def test_hugging_face_config_json_extra_keys_are_ignored(tmp_path):
    hf = hf_config(PRESETS["tiny"], vocab_size=129280, num_hidden_layers=43, torch_dtype="bfloat16",
                   model_type="deepseek_v4", n_routed_experts=256, moe_intermediate_size=2048,
                   quantization_config={"quant_method": "fp8"}, bos_token_id=0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert AttnConfig.from_json(path) == TINY
    path.write_text(json.dumps({"text_config": hf, "vision_config": {"hidden_size": 1}}))
    assert AttnConfig.from_json(path) == TINY


# =============================================================================== validation


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


# =============================================================================== the layer-role graph


def test_which_layers_a_layer_reads():
    """tiny: ratios 0,0,2,2,1,1; kv sources 2, 4; index sources 2, 4, 5; candidate source 4."""
    assert TINY.sources_of(0) == [] and TINY.sources_of(4) == []
    assert TINY.sources_of(3) == [(2, "kv source"), (2, "index source")]
    assert TINY.sources_of(5) == [(4, "kv source"), (4, "index-key owner"), (4, "candidate source")]
    # Layer 2 (ratio 2) scores against layer 4's keys on a decode step that completes no group.
    assert TINY.sources_of(2) == [(4, FALLBACK_KEY_OWNER)]
    assert TINY.fallback_key_owners(2) == [4] and TINY.fallback_key_owners(5) == []
    assert TINY.step_sources(2) == [] and TINY.step_sources(3) == [2] and TINY.step_sources(5) == [4]


def test_a_subset_of_layers_is_closed_under_what_they_read():
    assert TINY.missing_sources(range(6)) == [] and TINY.missing_sources([0, 1]) == []
    assert TINY.missing_sources([2, 3, 4]) == [] and TINY.missing_sources([4, 5]) == []
    assert TINY.missing_sources([3, 5, 2]) == [
        (2, 4, FALLBACK_KEY_OWNER), (5, 4, "kv source"), (5, 4, "index-key owner"),
        (5, 4, "candidate source")]
    flash = preset("v41-flash")
    assert flash.missing_sources([20]) == [] and flash.missing_sources([0, 1, 41]) == []
    assert [m[:2] for m in flash.missing_sources([24])] == [(24, 20)] * 3
