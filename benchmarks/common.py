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
import os
import statistics
import time

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


#: How long a measurement runs its work untimed before timing it (:func:`settle`).
SETTLE_SECONDS = 0.3


def settle(run_once, most: int | None = None) -> int:
    """``run_once()`` untimed for ``SETTLE_SECONDS`` (at least once, at most ``most`` times);
    how many ran. OpenBLAS's threads spin for ~0.1-0.2 s after a threaded call (numpy's pass, a
    case's set-up) and take a core from numba's meanwhile (they slowed the next decode steps by
    up to 60%, and the AMX index scores 2x); after an idle pause instead, the machine itself is
    slow for a while: on the 2-core Zen 5 (2026-12-07, docs/speed-history.md) the eight decode
    steps after a 0.3 s pause took 1.2-1.7x as long as steps run back to back, as a decode loop
    runs them."""
    end = time.perf_counter() + SETTLE_SECONDS
    n = 0
    while n == 0 or (time.perf_counter() < end and (most is None or n < most)):
        run_once()
        n += 1
    return n


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


def products_set(stack, layer: int) -> list:
    """``(x [1, in], W)`` pairs: every bf16 projection of one decode step of ``layer`` as
    ``stack`` holds it (:class:`~ds41numba.numerics.Bf16Matrix`, ``wo_a`` grouped), the weights
    of one input width given one row: those a step multiplies as one call
    (:class:`~ds41numba.numerics.linear.SharedInput`) run as one here too."""
    from ds41numba.numerics import Bf16Matrix, to_bf16_rne

    rng = np.random.default_rng(2)
    rows, pairs = {}, []
    for m in stack.weights[layer].parameters():
        if isinstance(m, Bf16Matrix):
            if m.in_features not in rows:
                rows[m.in_features] = to_bf16_rne(rng.standard_normal((1, m.in_features), np.float32))
            pairs.append((rows[m.in_features], m))
    return pairs


def products_once(pairs) -> float:
    """Our decode products' time for :func:`products_set`'s pairs: each weight through the
    decode kernel as a step calls it (one row, the reference's one-row order)."""
    from ds41numba.numerics import linear_bf16

    t0 = time.perf_counter()
    for x, w in pairs:
        linear_bf16(x, w, ref_rows=1)
    return time.perf_counter() - t0


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
