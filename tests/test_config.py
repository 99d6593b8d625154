"""ds41numba.config: AttnConfig's fields and names (reference ModelArgs, Hugging Face), its
validation, the layer-role graph, and the presets."""

import json

import pytest

from ds41numba import AttnConfig, preset
from ds41numba.config import IGNORED_KEYS, PRESETS
from helpers import hf_config

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


def test_a_reference_golden_config_entry_is_a_config():
    """A reference golden's ``config`` entry adds its run (prefill, decode, seed)."""
    cfg = AttnConfig.from_dict({**PRESETS["tiny"], "prefill": 12, "decode": 40, "seed": 0})
    assert cfg == TINY


def test_hugging_face_config_json_extra_keys_are_ignored(tmp_path):
    hf = hf_config(PRESETS["tiny"], vocab_size=129280, num_hidden_layers=43, torch_dtype="bfloat16",
                   model_type="deepseek_v4", n_routed_experts=256, moe_intermediate_size=2048,
                   quantization_config={"quant_method": "fp8"}, bos_token_id=0)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert AttnConfig.from_json(path) == TINY
    path.write_text(json.dumps({"text_config": hf, "vision_config": {"hidden_size": 1}}))
    assert AttnConfig.from_json(path) == TINY
