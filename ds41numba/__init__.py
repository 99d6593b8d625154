"""ds41numba: a fast, exact CPU reference for DeepSeek-V4.1 compressed attention.

It reproduces DeepSeek's ``inference/model.py`` (bit for bit in its index selections, at bf16
tolerance in its tensors) and runs at full length on multicore CPUs.

Names. The config's fields (:class:`AttnConfig`, also ``CompAttnCfg``: the attention fields of
the reference's ``ModelArgs``), the parameter names (``layers.{i}.attn.NAME``, the reference's ``Attention``
parameters) and the golden tensor names are the reference's, and so are ``sparse_attn`` (its
sparse-attention kernel) and ``select_candidate_blocks``. The other public names say what they
compute; where the reference has a function for it, it is:

* ``act_quant_fp8_inplace``: the reference's ``act_quant`` (fp8 e4m3, block 32: the window KV);
* ``fp4_quant_e8m0_inplace``: its ``fp4_act_quant`` with the default e8m0 scales (block 32,
  ``FP4_BLOCK``: the indexer's queries and keys);
* ``fp4_quant_e4m3_inplace``: its fp4 quantiser with e4m3 scales (block 16, ``LATENT_BLOCK``:
  the compressed KV latents);
* ``linear_bf16``, ``linear_f32``: its linears (torch's ``F.linear``) on bf16 weights, and on the
  f32 weights of the ratio > 1 compressor;
* ``rms_norm``: the forward of its ``RMSNorm``;
* ``yarn_freqs_cis``, ``apply_rotary``: its rotary table (with YaRN on compressed layers) and the
  rotation of a vector's last ``rope_head_dim`` elements by it;
* ``torch_cpu_topk_set``, ``torch_cpu_topk_rows``: the index set its ``torch.topk`` calls return on
  the CPU, ties included;
* ``compressor`` (with ``CompressorWeights``, ``CompressorState``) and ``indexer`` (with
  ``IndexerWeights``, ``IndexerCfg``): the forwards of its ``Attention``'s ``compressor`` and
  ``indexer`` submodules (the parameters ``layers.{i}.attn.compressor.*``, ``.indexer.*``);
* ``attention_any``: the forward of its ``Attention`` for a layer of any compress ratio;
  ``AttentionStack``: the layers' ``Attention`` forwards in the order the model runs them, with
  the state they share; ``BatchedStack``:
  a batch of sequences run through them in lockstep, as the reference runs ``bsz > 1``
  (``BatchRow``: which rows of the batch's products a sequence's rows are; docs/batches.md).

The rest (the roundings ``to_bf16_rne``, ``to_e4m3_rne``, ``to_e2m1_rne``, ``pow2ceil``,
``is_bf16_valued``; ``window_index_rows``, ``output_projection``, ``IndexKeyCache``, ...) are
ds41numba's own names for what the reference does inline; ``attention_rows`` answers any rows
of a prefill's queries on their own, given the caches (what a cluster run spreads).
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

# Before any kernel is defined: a cached kernel is kept only while the whole package's source is
# unchanged (numba alone would keep one whose helpers in other modules changed).
from . import kernel_cache as _kernel_cache

_kernel_cache.install()

from .numerics import (FP4_BLOCK, FP8_BLOCK, LATENT_BLOCK, act_quant_fp8_inplace,
                       fp4_quant_e4m3_inplace, fp4_quant_e8m0_inplace, is_bf16_valued,
                       linear_bf16, linear_f32, pow2ceil, rms_norm, to_bf16_rne, to_e2m1_rne,
                       to_e4m3_rne)
from .rope import apply_rotary, yarn_freqs_cis
from .topk import torch_cpu_topk_rows, torch_cpu_topk_set
from .config import PRESETS, AttnConfig, preset

#: The seed's name of the attention config (its ``CompAttnCfg`` struct): the same class.
CompAttnCfg = AttnConfig
from .compressor import CompressorState, CompressorWeights, compressor
from .indexer import IndexerCfg, IndexerWeights, IndexKeyCache, indexer, select_candidate_blocks
from .attention import (CompAttnRun, KvPairs, attention_any, attention_rows, kv_pairs,
                        output_projection, sparse_attn, window_index_rows)
from .stack import AttentionStack, AttnWeights, LayerAttnState, SharedRuntime, weight_specs
from .batch import BatchRow
from .batched import BatchedStack

__version__ = "0.1.0"
