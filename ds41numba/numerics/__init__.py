"""Bit-exact low-precision building blocks, one module per concept:

- ``formats``: rounding f32 onto bf16, e4m3, e2m1 and powers of two (scalar ``@njit`` helpers
  and array functions), and the array checks the numeric functions share;
- ``quant``: the reference's fp8 / fp4 quantise-dequantise schemes;
- ``backend``: the one choice of kernels (AMX, AVX512-VNNI, AVX512-BF16, AVX2 or numpy's BLAS:
  ``backend``, ``tier_at_least``, ``use_backend``);
- ``bf16_dot``: the AVX512-BF16 micro-kernel, its FMA twin and their many-row product;
- ``bf16_layouts``: the bf16-pair layouts those read;
- ``fma_choice``: when the FMA twin runs instead (the ranges that keep it exact, the speed probe);
- ``int8_layouts``: fp4 rows as small integers and a power of two a 32-value block, packed for
  AVX512-VNNI, and the ranges that say when their products are exact;
- ``folded_layouts``: fp4 rows with their block scales folded into the bytes (a power of two a
  row), the layouts AMX reads and the VNNI tier's folded keys;
- ``int8_dot``: exact fp4 dot products as integer dot products on AVX512-VNNI, the test of when
  they are exact, and the VNNI mixer of folded rows (``vnni_mix_tile``);
- ``int8_pairs``: the same integer dot products on AVX2 (``vpmaddubsw``), on the per-block layout;
- ``amx_dot``: the same dot products on AMX's tile multiplier, from the folded layouts, and
  AMX's mixer (``amx_mix_tile``);
- ``head_mix``: the head mix both mixers share (its two roundings, ``converted_mix_exact``);
- ``f32_products``: f32 products in the reference's MKL order, on the micro-kernels of
  ``f32_tiles``;
- ``linear``: the projections (``Bf16Matrix``, ``SharedInput``, ``linear_bf16``,
  ``linear_bf16_beside``, ``linear_f32``);
- ``matvec``: the decode step's product of one or several held bf16 weights, one kernel call
  (or read beside other work, ``matvec_beside``);
- ``norm``: RMSNorm and torch's CPU sum order;
- ``softmax``: torch's CPU softmax and Sleef's ``expf``, as sparse attention runs them;
- ``workers``: threads (not numerics: the "run in parallel?" policy, the worker pool, BLAS's
  threads).

Every public name is re-exported here, so ``from ds41numba.numerics import linear_bf16`` works.
"""

from .amx_dot import amx_begin, amx_dot_tile, amx_end, amx_mix_tile
from .backend import BACKENDS, backend, tier_at_least, use_backend
from .bf16_dot import (DOT_LANES, DOT_ROWS, bf16_dot_run, bf16_dot_tile, bf16_fma_run, bf16_fma_tile,
                       gemm_bf16)
from .bf16_layouts import bf16_pairs, pack_bf16_pairs
from .folded_layouts import (AMX_K, AMX_ROWS, FOLD_SPREAD, FOLDED_KEY_OFFSET, empty_folded_blocks,
                             foldable, folded_blocks_shape, folded_corrections, folded_rows,
                             pack_folded_blocks, pack_offset_folded_blocks)
from .head_mix import MAX_BLOCK, converted_mix_exact
from .int8_dot import QUARTER, int8_dot_exact, int8_dot_into, int8_dot_tile, vnni_mix_quarters, vnni_mix_tile
from .int8_pairs import int8_pairs_into, int8_pairs_tile, pairs_mix_tile
from .int8_layouts import (EMPTY_RANGE, INT8_GROUP, INT8_MAX, KEY_OFFSET, int8_blocks_shape,
                           int8_rows, merge_ranges, pack_int8_blocks)
from .f32_products import F32Matrix, linear_f32_ordered, matmul_nn_f32_ordered
from .fma_choice import fma_faster, fma_safe, safe_partner, values_range
from .formats import (E2M1_MAX, E4M3_MAX, ELEMENT_COST, FP4_BLOCK, FP8_BLOCK, LATENT_BLOCK,
                      aligned_empty, as_f32_array, bf16_halves, bf16_scalar, bf16_scalar_no_payload, check_inplace, is_int, e2m1_scalar, e4m3_scalar, fma_f32,
                      is_bf16_valued, nan_max, output_buffer, pow2ceil, pow2ceil_scalar,
                      round_bf16_inplace, to_bf16_rne, to_e2m1_rne, to_e4m3_rne)
from .linear import (BESIDE_MIN_BYTES, MATVEC_MAX_ROWS, TINY_BF16_LINEAR, Bf16Matrix, SharedInput,
                     bf16_k_block, linear_bf16, linear_bf16_beside, linear_f32)
from .matvec import MATVEC_MEMBERS, matvec_beside, matvec_into, pair_hi, pair_lo
from .norm import SUM_LANES, rms_norm, torch_sum_f32
from .softmax import SOFTMAX_LANES, expf_u10, softmax_rows
from .quant import (Q_FP4_E4M3, Q_FP4_E8M0, Q_FP8, act_quant_fp8_inplace, fp4_quant_e4m3_inplace,
                    fp4_quant_e8m0_inplace, quant_row)
from .workers import (PARALLEL_MIN_MACS, POOL_MIN_MACS, can_work_beside, claim_next,
                      in_beside_block, in_workers, serial_twin, share_with_helper,
                      single_threaded_blas, sized_call, split_range, work_beside, worth_parallel)

__all__ = [
    "AMX_K", "AMX_ROWS", "MAX_BLOCK", "FOLD_SPREAD", "amx_begin", "amx_dot_tile", "amx_end", "amx_mix_tile", "converted_mix_exact",
    "vnni_mix_tile", "vnni_mix_quarters", "QUARTER",
    "empty_folded_blocks", "foldable", "folded_blocks_shape", "folded_rows", "pack_folded_blocks",
    "FOLDED_KEY_OFFSET", "folded_corrections", "pack_offset_folded_blocks",
    "BACKENDS", "backend", "tier_at_least", "use_backend",
    "DOT_LANES", "DOT_ROWS", "bf16_dot_run", "bf16_dot_tile", "bf16_fma_run", "bf16_fma_tile", "bf16_pairs", "fma_faster",
    "fma_safe", "gemm_bf16", "pack_bf16_pairs", "safe_partner", "values_range",
    "EMPTY_RANGE", "INT8_GROUP", "INT8_MAX", "KEY_OFFSET", "int8_blocks_shape", "int8_dot_exact",
    "int8_dot_into", "int8_pairs_into", "int8_pairs_tile", "pairs_mix_tile",
    "int8_dot_tile", "int8_rows", "merge_ranges", "pack_int8_blocks",
    "F32Matrix", "linear_f32_ordered", "matmul_nn_f32_ordered",
    "E2M1_MAX", "E4M3_MAX", "ELEMENT_COST", "FP4_BLOCK", "FP8_BLOCK", "LATENT_BLOCK",
    "aligned_empty", "as_f32_array", "bf16_scalar", "bf16_scalar_no_payload", "check_inplace", "is_int", "e2m1_scalar", "e4m3_scalar", "fma_f32",
    "is_bf16_valued", "bf16_halves", "nan_max", "output_buffer", "pow2ceil", "pow2ceil_scalar",
    "round_bf16_inplace", "to_bf16_rne", "to_e2m1_rne", "to_e4m3_rne",
    "BESIDE_MIN_BYTES", "MATVEC_MAX_ROWS", "TINY_BF16_LINEAR", "Bf16Matrix", "SharedInput",
    "bf16_k_block", "linear_bf16", "linear_bf16_beside", "linear_f32", "MATVEC_MEMBERS",
    "matvec_beside", "matvec_into", "pair_hi", "pair_lo",
    "SUM_LANES", "rms_norm", "torch_sum_f32",
    "SOFTMAX_LANES", "expf_u10", "softmax_rows",
    "Q_FP4_E4M3", "Q_FP4_E8M0", "Q_FP8", "act_quant_fp8_inplace", "fp4_quant_e4m3_inplace",
    "fp4_quant_e8m0_inplace", "quant_row",
    "PARALLEL_MIN_MACS", "POOL_MIN_MACS", "in_workers", "single_threaded_blas", "split_range",
    "worth_parallel", "serial_twin", "sized_call", "claim_next", "can_work_beside", "work_beside",
    "in_beside_block", "share_with_helper",
]
