"""The kernel benchmarks' cases: each kernel at a production shape, what it is fed, what it
computes (useful FLOPs, elements) and what it needs to run here (a private function, a tier).

asv's ``bench_kernels`` times them; ``report.py`` compares each with numpy's matmul rate.
Built lazily like everything in :mod:`.common` (nothing runs at import).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .common import DECODE_LAYER, layer_config, layer_input, weight_subset


@dataclass
class KernelCase:
    """One kernel at a production shape.

    ``build()`` returns the state (data, weights); ``prepare(state)`` restores what the kernel
    overwrites (in-place quantisers) and is not timed; ``run(state)`` is the timed call.
    ``flops`` counts useful FLOPs (None where the kernel has none: quantisers, top-k);
    ``elements`` what it processes, for a throughput figure either way.
    """

    name: str
    label: str
    shape: str
    build: Callable[[], dict]
    run: Callable[[dict], object]
    prepare: Callable[[dict], None] | None = None
    flops: int | None = None
    elements: int = 0
    private: str = ""   # the private function it needs, "" when the API is public
    tier: str = ""      # the backend tier it runs on, "" for the default


def _bf16(a: np.ndarray) -> np.ndarray:
    from ds41numba.numerics import to_bf16_rne

    return to_bf16_rne(np.ascontiguousarray(a, dtype=np.float32))


def normal_bf16(shape, seed) -> np.ndarray:
    """Standard normal values rounded to bf16 (seeded)."""
    return _bf16(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _inplace_case(name, label, shape, fn_name):
    def build():
        return {"src": normal_bf16(shape, 10), "buf": np.empty(shape, np.float32)}

    def prepare(st):
        np.copyto(st["buf"], st["src"])

    def run(st):
        import ds41numba.numerics as nm

        getattr(nm, fn_name)(st["buf"])

    return KernelCase(name, label, "x".join(map(str, shape)), build, run, prepare,
                      elements=int(np.prod(shape)))


def _topk_case(name, label, rows, n, k):
    def build():
        return {"vals": normal_bf16((rows, n), 11), "k": k}

    def run(st):
        from ds41numba.topk import torch_cpu_topk_rows

        torch_cpu_topk_rows(st["vals"], st["k"])

    return KernelCase(name, label, f"{rows}x{n} k={k}", build, run, elements=rows * n)


# Tile shapes: 64 queries at the end of a 4,096-token prefill of layer 20 (ratio 1).
_TILE, _CTX = 64, 4096


def _sparse_attn_case():
    cfg = layer_config(_CTX)
    H, hd, win, k = cfg.n_heads, cfg.head_dim, cfg.window_size, cfg.index_topk
    start = _CTX - _TILE
    valid = _TILE * (win + k)

    def build():
        rng = np.random.default_rng(12)
        q = normal_bf16((_TILE, H, hd), 13)
        kv = normal_bf16((2 * _CTX, hd), 14)     # the prefill's window rows, then the compressed cache
        idx = np.empty((_TILE, win + k), np.int32)
        for i in range(_TILE):
            s = start + i
            idx[i, :win] = np.arange(s - win + 1, s + 1)
            idx[i, win:] = np.sort(rng.choice(s + 1, k, replace=False)) + _CTX
        sink = rng.uniform(0.0, 0.5, H).astype(np.float32)
        return {"q": q, "kv": kv, "idx": idx, "sink": sink, "scale": hd ** -0.5}

    def run(st):
        from ds41numba.attention import sparse_attn

        sparse_attn(st["q"], st["kv"], st["idx"], st["sink"], st["scale"])

    return KernelCase("sparse_attn_tile", "sparse attention (64 queries, 128 window + 512 picked rows)",
                      f"q {_TILE}x{H}x{hd}, idx {_TILE}x{win + k}", build, run,
                      flops=4 * H * hd * valid, elements=valid * H)


def index_keys(n, idim, seed):
    """``n`` random fp4 (e2m1, e8m0-scaled) index keys of ``idim`` values, as a key owner writes them."""
    from ds41numba.numerics import fp4_quant_e8m0_inplace

    return fp4_quant_e8m0_inplace(normal_bf16((n, idim), seed))


def _indexer_case():
    cfg = layer_config(_CTX, DECODE_LAYER)
    ih, idim, layer = cfg.index_n_heads, cfg.index_head_dim, DECODE_LAYER
    start = _CTX - _TILE
    proj = 2 * _TILE * (cfg.q_lora_rank * ih * idim + cfg.dim * ih)
    score = 2 * ih * idim * _TILE * _CTX

    def build():
        from ds41numba.attention import layer_rope_table
        from ds41numba.indexer import IndexerCfg, IndexerWeights, IndexKeyCache
        from ds41numba.numerics import Bf16Matrix

        # As a layer holds them: the projections as Bf16Matrix (the reference's bf16 order, not
        # numpy's f32 BLAS), the keys packed once in the scorer's layout as a key owner writes them.
        w = weight_subset(layer, ["indexer.wq_b.weight", "indexer.weights_proj.weight"])
        return {"x": layer_input(layer, _TILE), "qr": normal_bf16((_TILE, cfg.q_lora_rank), 15),
                "cfg": IndexerCfg.for_layer(cfg, layer),
                "weights": IndexerWeights(wq_b=Bf16Matrix(w["indexer.wq_b.weight"]),
                                          weights_proj=Bf16Matrix(w["indexer.weights_proj.weight"])),
                "table": layer_rope_table(cfg, cfg.ratio(layer), _CTX),
                "keys": IndexKeyCache(index_keys(_CTX, idim, 16))}

    def run(st):
        from ds41numba.indexer import indexer

        # start_pos > 0: every query sees all 4,096 positions (a tile at the end of the prefill).
        indexer(st["x"], st["qr"], start, st["cfg"], st["weights"], st["table"], st["keys"],
                cfg.window_size)

    return KernelCase("indexer_tile", "indexer, whole (64 queries x 4096 positions, layer 20: "
                      "projections, fp4, scores, candidate blocks, top-k 512)",
                      f"{_TILE} queries x {_CTX} keys", build, run,
                      flops=proj + score, elements=_TILE * _CTX)


def _index_scores_case(path: str):
    """Scoring one tile: ``path`` "default" is what the indexer runs on this machine (AMX,
    AVX512-VNNI or AVX2's integer kernel where the CPU has them), "vnni" the AVX512-VNNI kernel
    (where AMX is the default, the kernel it replaced; skipped on CPUs without it), "avx2int8"
    AVX2's integer kernel, "f32" numpy's f32 BLAS (the fallback)."""
    cfg = layer_config(_CTX)
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    tier = {"f32": "blas", "vnni": "avx512vnni", "avx2int8": "avx2int8"}.get(path)

    def build():
        from ds41numba.indexer import IndexKeyCache
        from ds41numba.numerics import backend, fp4_quant_e8m0_inplace, use_backend

        iq = fp4_quant_e8m0_inplace(normal_bf16((_TILE, ih, idim), 17))
        w = normal_bf16((_TILE, ih), 18) * np.float32(0.01)
        with use_backend(tier or backend()):
            keys = IndexKeyCache(index_keys(_CTX, idim, 16))
        return {"iq": iq, "w": _bf16(w), "keys": keys, "clen": np.full(_TILE, _CTX, np.int64)}

    def run(st):
        from ds41numba.numerics import backend, use_backend

        with use_backend(tier or backend()):
            st["keys"].scores(st["iq"], st["w"], st["clen"], _CTX)

    name, what = {"default": ("indexer_scores_tile", "indexer scoring only"),
                  "vnni": ("indexer_scores_tile_vnni", "indexer scoring on AVX512-VNNI"),
                  "avx2int8": ("indexer_scores_tile_avx2int8", "indexer scoring on AVX2 integers"),
                  "f32": ("indexer_scores_tile_f32", "indexer scoring on f32 BLAS")}[path]
    return KernelCase(name, f"{what} (64 queries x 4096 positions)",
                      f"iq {_TILE}x{ih}x{idim}, keys {_CTX}x{idim}", build, run,
                      flops=2 * ih * idim * _TILE * _CTX, elements=_TILE * _CTX,
                      private="ds41numba.indexer.blas_scores.tile_scores", tier=tier or "")


def _index_scores_row_case(path="default", positions=65536):
    """A decode step's index scores: one query against ``positions`` keys (layer 20's step at
    that context), with the candidate blocks' maxima of 8 the candidate source takes; ``path``
    "default" on this machine's default path, "avx2int8" on AVX2's integer kernel (skipped on
    CPUs without AVX2). The step runs it on one core beside its weight reading; here it runs on
    every thread."""
    cfg = layer_config(positions)
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    block = cfg.candidate_block_size
    tier = "" if path == "default" else path

    def build():
        from ds41numba.indexer import IndexKeyCache
        from ds41numba.numerics import backend, fp4_quant_e8m0_inplace, use_backend

        iq = fp4_quant_e8m0_inplace(normal_bf16((1, ih, idim), 19))
        w = normal_bf16((1, ih), 20) * np.float32(0.01)
        with use_backend(tier or backend()):
            keys = IndexKeyCache(index_keys(positions, idim, 16))
        return {"iq": iq, "w": _bf16(w), "keys": keys, "clen": np.full(1, positions, np.int64),
                "maxima": np.empty((1, -(-positions // block)), np.float32)}

    def run(st):
        from ds41numba.numerics import backend, use_backend

        with use_backend(tier or backend()):
            st["keys"].scores(st["iq"], st["w"], st["clen"], positions,
                              maxima=(block, st["maxima"]))

    name = "indexer_scores_row" + (f"_{path}" if tier else "")
    on = " on AVX2 integers" if tier else ""
    return KernelCase(name, f"indexer scoring{on}, a decode step's row (1 query x {positions} "
                      f"positions, block maxima)", f"iq 1x{ih}x{idim}, keys {positions}x{idim}",
                      build, run, flops=2 * ih * idim * positions, elements=positions, tier=tier)


def _projection_case(tokens=1024):
    """A prefill's query up-projection (``wq_b``, the layer's largest) as a bf16 linear on
    1,024 rows (four of a prefill's attention tiles, which were 1,024 rows until 2026-12-07; the
    case keeps its shape, so its history stays comparable): on AVX512-BF16 where the CPU has
    it, else numpy's f32 BLAS."""
    cfg = layer_config(tokens)
    n_out, k_in = cfg.n_heads * cfg.head_dim, cfg.q_lora_rank

    def build():
        from ds41numba.numerics import Bf16Matrix

        w = Bf16Matrix(weight_subset(20, ["wq_b.weight"])["wq_b.weight"])
        return {"x": normal_bf16((tokens, k_in), 21), "w": w,
                "out": np.empty((tokens, n_out), np.float32)}

    def run(st):
        from ds41numba.numerics import linear_bf16

        linear_bf16(st["x"], st["w"], out=st["out"])

    return KernelCase("linear_bf16_tile", f"bf16 linear, a prefill's wq_b ({tokens} rows)",
                      f"x {tokens}x{k_in}, w {n_out}x{k_in}", build, run,
                      flops=2 * tokens * k_in * n_out, elements=tokens * n_out)


def _input_range_case(tokens=4096):
    """The check a bf16 product's input passes before the FMA twin multiplies it (where that
    kernel runs: every Intel kind, the ``blas`` tier): a 4,096-token prefill's input of
    ``wo_b``, layer 20's widest. One pass over the values, so bound by reading them."""
    cfg = layer_config(tokens)
    k_in = cfg.o_groups * cfg.o_lora_rank

    def build():
        return {"x": normal_bf16((tokens, k_in), 23)}

    def run(st):
        from ds41numba.numerics import values_range

        values_range(st["x"])

    return KernelCase("bf16_input_range", f"a bf16 product's input check ({tokens} rows of wo_b)",
                      f"x {tokens}x{k_in}", build, run, elements=tokens * k_in)


def _compressor_case(tokens=1024):
    cfg = layer_config(tokens, 2)
    layer, r, hd = 2, 2, cfg.head_dim
    proj = 2 * tokens * 2 * cfg.dim * hd

    def build():
        from ds41numba.compressor import CompressorWeights

        w = weight_subset(layer, ["compressor.wkv.weight", "compressor.wgate.weight",
                                  "compressor.norm.weight"])
        return {"x": layer_input(layer, tokens),
                "weights": CompressorWeights(wkv=w["compressor.wkv.weight"],
                                             wgate=w["compressor.wgate.weight"],
                                             norm=w["compressor.norm.weight"])}

    def run(st):
        from ds41numba.compressor import CompressorState, compressor

        compressor(st["x"], 0, r, st["weights"], CompressorState.fresh(r, hd), cfg.norm_eps)

    return KernelCase("compressor_r2", f"compressor, whole (ratio 2, {tokens} tokens: f32 "
                      "projections, pooling, norm)", f"x {tokens}x{cfg.dim}", build, run,
                      flops=proj, elements=tokens * hd)


def _pool_case(tokens=4096):
    hd, r = 512, 2

    def build():
        kv = np.random.default_rng(19).standard_normal((tokens, hd), dtype=np.float32)
        score = np.random.default_rng(20).standard_normal((tokens, hd), dtype=np.float32)
        return {"kv": kv, "score": score}

    def run(st):
        cm = importlib.import_module("ds41numba.compressor")
        cm._pool_groups(st["kv"], st["score"], r)

    # Per (token, feature): exp, divide, multiply-add of the pooled sum (plus a max and a sum).
    return KernelCase("compressor_pool", f"compressor pooling only (ratio 2, {tokens} tokens)",
                      f"kv/score {tokens}x{hd}", build, run, flops=4 * tokens * hd,
                      elements=tokens * hd, private="ds41numba.compressor._pool_groups")


def _rope_case(name, label, shape, first_pos):
    cfg = layer_config(_CTX)
    pairs = int(np.prod(shape[:-1])) * (cfg.rope_head_dim // 2)

    def build():
        from ds41numba.attention import layer_rope_table

        return {"x": normal_bf16(shape, 21), "pos": np.arange(first_pos, first_pos + shape[0]),
                "table": layer_rope_table(cfg, 1, _CTX)}

    def run(st):
        from ds41numba.rope import apply_rotary

        apply_rotary(st["x"], st["pos"], st["table"])

    # A complex multiply per rotated pair: 4 multiplies and 2 adds.
    return KernelCase(name, label, "x".join(map(str, shape)), build, run, flops=6 * pairs,
                      elements=int(np.prod(shape)))


def kernel_cases() -> dict[str, KernelCase]:
    """Every kernel benchmark, by name (in display order)."""
    cases = [
        _inplace_case("quant_fp8", "fp8 quantiser (window KV rows, block 32)", (4096, 512),
                      "act_quant_fp8_inplace"),
        _inplace_case("quant_fp4_e8m0", "fp4 e8m0 quantiser (index rows, block 32)", (16384, 128),
                      "fp4_quant_e8m0_inplace"),
        _inplace_case("quant_fp4_e4m3", "fp4 e4m3 quantiser (latent rows, block 16)", (4096, 512),
                      "fp4_quant_e4m3_inplace"),
        _topk_case("topk_1m", "top-k, 1M entries (partial_sort branch)", 1, 1 << 20, 512),
        _topk_case("topk_4k", "top-k, 4K entries (nth_element branch)", 64, 4096, 512),
        _projection_case(),
        _input_range_case(),
        _sparse_attn_case(),
        _indexer_case(),
        _index_scores_case("default"),
        _index_scores_case("vnni"),
        _index_scores_case("avx2int8"),
        _index_scores_case("f32"),
        _index_scores_row_case(),
        _index_scores_row_case("avx2int8"),
        _compressor_case(),
        _pool_case(),
        _rope_case("rope_q_tile", "RoPE on a query tile (64 tokens x 64 heads)", (64, 64, 512),
                   _CTX - 64),
        _rope_case("rope_kv", "RoPE on KV rows (4096 tokens)", (4096, 512), 0),
    ]
    return {c.name: c for c in cases}


def unavailable(case: KernelCase) -> str:
    """Why a case cannot run here ("" when it can): its private function has gone (the
    package's internals move), or its backend tier is not one this CPU (or this version of the
    package) runs."""
    if case.private:
        mod, _, attr = case.private.rpartition(".")
        try:
            if not hasattr(importlib.import_module(mod), attr):
                return f"{case.private} no longer exists"
        except ImportError:
            return f"{mod} no longer exists"
    if case.tier:
        from ds41numba import numerics

        tiers = getattr(numerics, "BACKENDS", ())
        if case.tier not in tiers or tiers.index(case.tier) < tiers.index(numerics.backend()):
            return f"the {case.tier} tier does not run here"
    return ""
