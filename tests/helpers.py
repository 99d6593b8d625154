"""Helpers several test files share: configs and inputs to build tests from.

The slow references the package is tested against are in ``naive.py``; this file holds none.
"""

from __future__ import annotations


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
