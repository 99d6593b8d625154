"""The progress bar's unit: work in key sides of a token-layer.

A run that answers a few rows of a long prefill spends nearly all its time on the key side of
every row, a full run nearly all on the queries (at 1M positions, the indexer): counting tokens
would be wrong for one or the other. :func:`work_units` weighs each part by what it costs.
:func:`product_multiply_adds` counts a run's products in multiply-adds instead, for deciding what
to compile before it.
"""

from __future__ import annotations

import math

from ..config import AttnConfig
from ..stack import weight_specs
from .rows import runs

__all__ = ["QUERY_WORK", "INDEX_WORK", "work_units", "total_work", "product_multiply_adds"]

#: The progress bar's weights, in key sides of a token-layer (measured on v41-flash layer 20,
#: AVX-512, about 55 us each): a query row's projections and attention, and each compressed
#: position an index source's query row scores (about 15 ns; 16 ms a row at 1M positions).
QUERY_WORK = 24.0
INDEX_WORK = 2.8e-4


def work_units(config: AttnConfig, layer: int, first: int, n: int, keys: bool = True,
               queries: bool = True, prefill: bool = True) -> float:
    """The work of rows ``first .. first + n - 1`` of one layer's step (``prefill``: of a
    prefill, whose row at position p sees ``(p + 1) // r`` compressed positions; else a decode
    step at ``first``, which sees ``(first + 1) // r``), its key side and/or its queries: what
    the progress bar counts, so a run that answers a few rows of a long prefill advances by
    what each part costs, not by tokens."""
    work = n * 1.0 if keys else 0.0
    if queries:
        work += n * QUERY_WORK
        r = config.ratio(layer)
        if r and config.is_index_source(layer):
            seen = (n * (2 * first + n + 1) / 2 if prefill else n * (first + 1)) / r
            work += INDEX_WORK * seen
    return work


def total_work(config: AttnConfig, layers, prefill: int, decode: int, rows=None) -> float:
    """A run's :func:`work_units`: every prefill row's key side, the queries of ``rows`` (None:
    all) and the decode steps."""
    total = 0.0
    for i in layers:
        if rows is None:
            total += work_units(config, i, 0, prefill)
        else:
            total += work_units(config, i, 0, prefill, queries=False)
            total += sum(work_units(config, i, a, n, keys=False) for a, n in runs(rows))
        total += sum(work_units(config, i, prefill + s, 1, prefill=False) for s in range(decode))
    return total


def product_multiply_adds(config: AttnConfig, layers, tokens: int) -> float:
    """About how many multiply-adds ``tokens`` positions through ``layers`` take in the products
    a CPU's tier speeds up (:mod:`ds41numba.numerics.backend`): each token through every weight
    matrix of each layer, and each index source's rows scoring the compressed positions they
    see (``tokens**2 / 2r`` of them, ``index_n_heads * index_head_dim`` each)."""
    total = 0.0
    for i in layers:
        total += tokens * sum(math.prod(shape) for shape, _ in weight_specs(config, i).values()
                              if len(shape) == 2)
        r = config.ratio(i)
        if r and config.is_index_source(i):
            total += tokens * tokens / (2 * r) * config.index_n_heads * config.index_head_dim
    return total
