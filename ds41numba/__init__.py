"""ds41numba: a fast, exact CPU reference for DeepSeek-V4.1 compressed attention.

It reproduces DeepSeek's ``inference/model.py`` (bit for bit in its index selections, at bf16
tolerance in its tensors) and runs at full length on multicore CPUs. The public names follow
the reference's.
"""

import os as _os

# numba's OpenMP workers by default spin for a long while after every parallel kernel, fighting
# OpenBLAS's threads for the cores between the kernels and the BLAS calls of a layer (several
# times slower on two cores). Passive workers sleep instead, but waking one costs ~70 us per
# kernel launch (2 us when it still spins), and a decode step launches a few dozen kernels: so
# they spin briefly (10,000 spins, ~0.2-0.4 ms here) and then sleep. Read by the OpenMP runtime
# when numba first starts it; an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .numerics import (FP4_BLOCK, FP8_BLOCK, LATENT_BLOCK, act_quant_fp8_inplace,
                       fp4_quant_e4m3_inplace, fp4_quant_e8m0_inplace, is_bf16_valued,
                       linear_bf16, linear_f32, pow2ceil, rms_norm, to_bf16_rne, to_e2m1_rne,
                       to_e4m3_rne)
from .rope import apply_rotary, yarn_freqs_cis
from .topk import torch_cpu_topk_rows, torch_cpu_topk_set
from .config import PRESETS, AttnConfig, preset
from .compressor import CompressorState, CompressorWeights, compressor
from .indexer import IndexerCfg, IndexerWeights, PackedIndexKeys, indexer, select_candidate_blocks
from .attention import CompAttnRun, attention_any, output_projection, sparse_attn, window_index_rows
from .stack import AttentionStack, AttnWeights, LayerAttnState, SharedRuntime, weight_specs

__version__ = "0.1.0"
