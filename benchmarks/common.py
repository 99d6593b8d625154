"""What the asv suite and the report share: the production cases, their useful FLOPs, and the
numpy baselines they are compared with.

Nothing here runs at import time (asv imports every module of the suite to discover it, in a
server process it then forks for each benchmark). Heavy objects -- a layer's weights, a stack
after a long prefill -- are built on first use and kept in module dictionaries, so the many
``setup`` calls asv makes within one benchmark process build them once.

*Useful FLOPs* count only real arithmetic, each multiply-add as 2:

* projections ``2 * rows * out * in`` for every matrix the step multiplies (``wq_a``, ``wq_b``,
  ``wkv``, the ``o_groups`` blocks of ``wo_a``, ``wo_b``; kv sources add the compressor's
  ``wkv`` (and ``wgate`` at ratio > 1); index sources add the indexer's ``wq_b`` and
  ``weights_proj``; key owners add ``wk`` once per new latent);
* attention ``4 * H * hd`` per (query, valid listed row): the ``q.k`` scores and the
  ``p.v`` sum, over valid rows only (window rows the query may see, plus ``min(k, visible)``
  compressed rows);
* indexer scoring ``2 * ih * id`` per (query, visible compressed position).

Norms, RoPE, quantisers, softmax exponentials and top-k are real work too but not FLOPs in
this sense; they show up as the gap between useful GFLOP/s and numpy's matmul rate.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from threadpoolctl import threadpool_limits

PRESET = "v41-flash"
SEED = 0
#: The production layers benchmarked: id -> what it is.
LAYERS = {
    0: "ratio 0 (window only)",
    2: "ratio 2, kv + index source",
    20: "ratio 1, kv + index + candidate source",
}
DECODE_LAYER = 20
#: Extra positions allocated beyond a decode benchmark's context (each timed step advances one).
DECODE_MARGIN = 64
#: Tokens of the untimed warm-up prefill that loads every kernel from numba's cache.
WARMUP_TOKENS = 256


def _env_sizes(name: str, default: list[int]) -> list[int]:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        sizes = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of token counts, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"{name} must list positive token counts, got {text!r}")
    return sizes


def int_list(text: str, minimum: int = 1) -> list[int]:
    """A command-line list ``"1024,4096"`` as integers of at least ``minimum`` (argparse type)."""
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < minimum for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return vals


FULL = os.environ.get("DS41_BENCH_FULL", "").strip() not in ("", "0")
PREFILL_SIZES = _env_sizes("DS41_BENCH_PREFILL", [1024, 4096, 16384] if FULL else [1024, 4096])
DECODE_CONTEXTS = _env_sizes("DS41_BENCH_DECODE", [4096, 65536] if FULL else [4096])


# ------------------------------------------------------------------------------ configs, weights


def layer_config(max_seq_len: int, layer: int | None = None):
    """The production config with caches sized for ``max_seq_len`` positions.

    With ``layer``, the config is truncated after that layer (sources and the candidate source
    past it dropped), so that a stack of that one layer is valid: its shapes and roles -- ratio,
    kv / index / key-owner / candidate source -- and hence its prefill are those of the full
    stack's layer, but it needs no later layer (a ratio-2 index source otherwise needs the later
    key owners whose keys it falls back on at some decode steps).
    """
    from ds41numba.config import preset

    cfg = preset(PRESET).replace(max_seq_len=int(max_seq_len))
    if layer is None:
        return cfg
    keep = lambda ids: [i for i in ids if i <= layer]   # noqa: E731
    return cfg.replace(compress_ratios=cfg.compress_ratios[:layer + 1],
                       kv_source_layers=keep(cfg.kv_source_layers),
                       index_source_layers=keep(cfg.index_source_layers),
                       candidate_source_layer=(cfg.candidate_source_layer
                                               if cfg.candidate_source_layer <= layer else -1))


_WEIGHTS: dict[int, dict] = {}


def layer_weights(layer: int) -> dict:
    """Layer ``layer``'s deterministic weights ``{"layers.{i}.attn.NAME": f32 array}`` (cached)."""
    if layer not in _WEIGHTS:
        from ds41numba.golden import make_weights

        _WEIGHTS[layer] = make_weights(layer_config(1024, layer), [layer], SEED)
    return _WEIGHTS[layer]


def weight_subset(layer: int, leaves) -> dict:
    """Only some of a layer's weights, e.g. ``["indexer.wq_b.weight"]``: ``{leaf: array}``.

    The same values :func:`layer_weights` gives, without building the whole 540 MB layer.
    """
    from ds41numba.golden import make_tensor, weight_distribution
    from ds41numba.stack import weight_specs

    specs = weight_specs(layer_config(1024, layer), layer)
    out = {}
    for leaf in leaves:
        name = f"layers.{layer}.attn.{leaf}"
        shape, kind = specs[name]
        center, scale = weight_distribution(name, shape)
        out[leaf] = make_tensor(name, shape, SEED, center, scale, bf16=(kind == "bf16"))
    return out


def step_weight_bytes(config, layer: int) -> int:
    """Bytes of every parameter a decode step of ``layer`` reads, at the width it is held in
    (bf16 projections 2 bytes a parameter, genuine f32 parameters 4): the least a step can
    read from memory, hence the decode floor's numerator."""
    from ds41numba.stack import weight_specs

    return sum(int(np.prod(shape)) * (2 if kind == "bf16" else 4)
               for shape, kind in weight_specs(config, layer).values())


def layer_input(layer: int, rows: int, step: int = 0, seed: int = SEED) -> np.ndarray:
    """The input ``step{step}.layers.{layer}.x`` of ``rows`` tokens (bf16 values, unit variance)."""
    from ds41numba.golden import make_input

    return make_input(f"step{step}.layers.{layer}.x", (rows, layer_config(1024).dim), seed)


def build_stack(layer: int, max_seq_len: int):
    """A one-layer :class:`AttentionStack` of production layer ``layer`` (sources of its own)."""
    from ds41numba.stack import AttentionStack

    return AttentionStack(layer_config(max_seq_len, layer), layer_weights(layer), layers=[layer])


def warm_up(stack, layer: int, tokens: int = WARMUP_TOKENS):
    """An untimed short prefill: loads (or compiles) the layer's numba kernels."""
    stack.forward(layer, layer_input(layer, tokens, step=99), 0)


def decode_inputs(layer: int, context: int, count: int) -> list[np.ndarray]:
    """Inputs of the decode steps at positions ``context .. context + count - 1``."""
    return [layer_input(layer, 1, step=1 + i) for i in range(count)]


# ------------------------------------------------------------------------------ useful FLOPs


def layer_roles(layer: int) -> str:
    return LAYERS.get(layer, "")


def layer_flops(config, layer: int, start_pos: int, seqlen: int) -> dict[str, int]:
    """Useful FLOPs of one step of ``layer``: ``{"projections", "attention", "indexer", "total"}``."""
    c = config
    H, hd, G = c.n_heads, c.head_dim, c.o_groups
    r = c.ratio(layer)
    S = int(seqlen)
    per_token = (c.dim * c.q_lora_rank + c.q_lora_rank * H * hd + c.dim * hd
                 + H * hd * c.o_lora_rank + G * c.o_lora_rank * c.dim)
    latents = 0
    if r and c.is_kv_source(layer):
        per_token += c.dim * hd * (2 if r > 1 else 1)
        if start_pos == 0:
            latents = S // r
        else:
            latents = 1 if (start_pos + 1) % r == 0 else 0
    if r and c.is_index_source(layer):
        per_token += c.q_lora_rank * c.index_n_heads * c.index_head_dim + c.dim * c.index_n_heads
    proj = 2 * S * per_token
    if r and c.is_key_owner(layer):
        proj += 2 * latents * hd * c.index_head_dim

    end_pos = start_pos + S
    if start_pos == 0:
        t = np.arange(S, dtype=np.int64)
        window = np.minimum(t + 1, c.window_size)
        clen = (t + 1) // r if r else np.zeros(S, np.int64)
    else:
        window = np.full(S, min(start_pos + 1, c.window_size), np.int64)
        clen = np.full(S, end_pos // r if r else 0, np.int64)
    k = min(c.index_topk, end_pos // r) if r else 0
    rows = int(window.sum()) + int(np.minimum(clen, k).sum())
    attn = 4 * H * hd * rows
    index = 2 * c.index_n_heads * c.index_head_dim * int(clen.sum()) if (r and c.is_index_source(layer)) else 0
    return {"projections": proj, "attention": attn, "indexer": index,
            "total": proj + attn + index}


# ------------------------------------------------------------------------------ numpy baselines


def matmul_rate(n: int = 2048, reps: int = 7, warmup_seconds: float = 1.0) -> dict:
    """numpy's f32 ``[n, n] @ [n, n]`` in GFLOP/s: the median of ``reps`` timed products, taken
    after a warm-up of at least ``warmup_seconds`` (and two products) whose rates are returned
    apart (``warmup``), never mixed in: BLAS's threads, the pages and the CPU's clock take a
    while to settle, and a median over cold and warm samples sits between two modes.
    ``spread`` is (min, max) of the timed samples."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)

    def one():
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        return 2.0 * n ** 3 / (time.perf_counter() - t0) / 1e9

    warmup, t_end = [], time.perf_counter() + warmup_seconds
    while len(warmup) < 2 or time.perf_counter() < t_end:
        warmup.append(one())
    rates = [one() for _ in range(reps)]
    return {"gflops": statistics.median(rates), "samples": rates, "spread": (min(rates), max(rates)),
            "warmup": warmup, "n": n}


#: The projections of a decode step, as (weight leaf, input width source) -- see matvec_set.
MATVEC_LEAVES = ("wq_a.weight", "wq_b.weight", "wkv.weight", "wo_a.weight", "wo_b.weight",
                 "compressor.wkv.weight", "compressor.wgate.weight", "indexer.wq_b.weight",
                 "indexer.weights_proj.weight", "indexer.wk.weight")


def matvec_set(config, layer: int, weights: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(x [1, in], W [out, in])`` pairs: every projection of one decode step, f32 weights.

    ``wo_a`` is split into its ``o_groups`` row blocks (one product per group), as the layer
    runs it. The inputs are random rows of the right widths (the values do not matter).
    """
    rng = np.random.default_rng(1)
    pairs = []
    prefix = f"layers.{layer}.attn."
    for leaf in MATVEC_LEAVES:
        name = prefix + leaf
        if name not in weights:
            continue
        w = np.ascontiguousarray(weights[name], dtype=np.float32)
        if leaf == "wo_a.weight":
            rank = w.shape[0] // config.o_groups
            blocks = [w[g * rank:(g + 1) * rank] for g in range(config.o_groups)]
        else:
            blocks = [w]
        for b in blocks:
            x = rng.standard_normal((1, b.shape[1]), dtype=np.float32)
            pairs.append((x, b))
    return pairs


def matvec_once(pairs) -> float:
    """numpy's time for the products: the faster of its default BLAS threading and one thread.

    OpenBLAS's threaded matrix-vector product is several times slower than its single-threaded
    one on some machines (this one among them); the fairer baseline is numpy at its best.
    """
    best = float("inf")
    for limit in (None, 1):
        with threadpool_limits(limits=limit, user_api="blas"):
            t0 = time.perf_counter()
            for x, w in pairs:
                x @ w.T
            best = min(best, time.perf_counter() - t0)
    return best


# ------------------------------------------------------------------------------ peak RSS


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux ``/proc/self/clear_refs``); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """This process's peak RSS since start (or the last successful :func:`reset_peak_rss`)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------ kernels


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


def _projection_case(tokens=1024):
    """One prefill tile's query up-projection (``wq_b``, the layer's largest) as a bf16 linear:
    on AVX512-BF16 where the CPU has it, else numpy's f32 BLAS."""
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

    return KernelCase("linear_bf16_tile", f"bf16 linear, a prefill tile's wq_b ({tokens} rows)",
                      f"x {tokens}x{k_in}, w {n_out}x{k_in}", build, run,
                      flops=2 * tokens * k_in * n_out, elements=tokens * n_out)


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
        _sparse_attn_case(),
        _indexer_case(),
        _index_scores_case("default"),
        _index_scores_case("vnni"),
        _index_scores_case("avx2int8"),
        _index_scores_case("f32"),
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
