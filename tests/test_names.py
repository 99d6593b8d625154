"""The seed's public names: every public name of its ``compress`` module is one of ours, so
code written against the seed runs against ds41numba unchanged."""

from __future__ import annotations

import ds41numba

SEED_COMPRESS_NAMES = [
    "attention_any", "compressor", "indexer", "select_candidate_blocks", "torch_cpu_topk_set",
    "yarn_freqs_cis", "to_e2m1_rne", "linear_f32", "fp4_quant_e4m3_inplace",
    "fp4_quant_e8m0_inplace", "CompAttnCfg", "CompAttnRun", "CompressorState",
    "CompressorWeights", "IndexerCfg", "IndexerWeights", "LayerAttnState", "SharedRuntime",
    "FP4_BLOCK", "LATENT_BLOCK",
]


def test_every_public_name_of_the_seeds_compress_module_is_exported():
    missing = [name for name in SEED_COMPRESS_NAMES if not hasattr(ds41numba, name)]
    assert not missing, f"not exported from ds41numba: {missing}"


def test_the_seeds_config_struct_is_our_attention_config():
    assert ds41numba.CompAttnCfg is ds41numba.AttnConfig
    assert ds41numba.CompAttnCfg.__name__ == "AttnConfig"


def test_the_seeds_block_constants_have_the_seeds_values():
    # fp4 with e8m0 scales quantises blocks of 32 values; the latents' e4m3 scales blocks of 16.
    assert (ds41numba.FP4_BLOCK, ds41numba.LATENT_BLOCK) == (32, 16)
