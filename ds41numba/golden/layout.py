"""The layout of a streamed golden (:func:`io_layout`): every tensor's name, dtype and shape in
file order, fixed before the run starts so that each row is written into its place."""

from __future__ import annotations

import numpy as np

from ..config import AttnConfig
from ..stack import weight_specs
from .captures import (RUNNERS_UP, STREAMED_MODES, WEIGHT_NAME, cache_layout, index_sampled,
                       records_shared, storage_kind)
from .plan import GoldenPlan

__all__ = ["io_layout"]


def _topk_width(config: AttnConfig, j: int, prefill: int, start_pos: int, seqlen: int) -> int:
    """Columns of index source j's selection at a step (0 when it sees no compressed position)."""
    r = config.ratio(j)
    width = (prefill if start_pos == 0 else start_pos + seqlen) // r
    return min(config.index_topk, width)


def io_layout(plan: GoldenPlan):
    """Every tensor of the plan's ``io`` golden, ``[(name, dtype, shape)]`` in file order, and
    ``{name: source}`` for the tensors that repeat another's values: the selection a layer of
    the first decode step finds before any index source of that step ran is the prefill's last
    (all its rows), which the stream copies from the file instead of holding.

    Besides ``out``, ``idx`` and ``shared.topk_idxs``: at every index source the scores behind
    its selection (``topk_scores``, ``runner_idxs``, ``runner_scores``) and, for a step holding
    ``capture_rows`` positions, the ``sample.*`` captures (their rows are few: the drive hands
    them over from memory once the step's last chunk ran). A batch (``plan.batch`` > 1) puts a
    leading batch axis on every tensor but the weights (docs/batches.md).

    A ``rows`` plan holds of the prefill only its answered rows (``step0.layers.{i}.rows``, their
    positions, then each per-row tensor with those rows, in that order); the first decode step's
    copies of the prefill's whole selection are left out (``{name: None}``). ``caches`` adds,
    after each layer's prefill tensors, its :func:`~.captures.cache_captures`."""
    if plan.capture not in STREAMED_MODES:
        raise ValueError("io_layout: only a streamed golden is laid out up front")
    c = plan.config
    layout, copies = _weights_layout(plan), {}
    index_sources = [j for j in plan.layers if c.ratio(j) and c.is_index_source(j)]
    slot = None                                  # (step, index source) the selection slot holds
    for step in plan.steps():
        for i in plan.layers:
            if i in index_sources:
                slot = (step[0], i)
            layout += _layer_layout(plan, step, i, slot, i in index_sources, copies)
    for n, kind, _ in layout:
        if not WEIGHT_NAME.fullmatch(n):
            assert kind == storage_kind(n), n
    if plan.batch > 1:     # every tensor but the weights: a leading batch axis, two row axes
        layout = [e if WEIGHT_NAME.fullmatch(e[0]) else (e[0], e[1], (plan.batch,) + tuple(e[2]), 2)
                  for e in layout]
    return layout, copies


def _weights_layout(plan: GoldenPlan) -> list:
    """The weights the file stores (none with ``store_weights`` off), layer by layer."""
    layout = []
    for i in (plan.layers if plan.store_weights else ()):
        for name, (shape, kind) in weight_specs(plan.config, i).items():
            layout.append((name, "F32" if kind == "f32" else "BF16", shape))
    return layout


def _layer_layout(plan: GoldenPlan, step, i: int, slot, index_source: bool, copies) -> list:
    """Layer ``i``'s tensors at ``step`` ``(s, start_pos, seqlen)``, in file order. ``slot`` is
    the (step, index source) whose selection the shared slot holds; an ``index_source`` adds
    the scores behind its own selection."""
    c = plan.config
    s, start_pos, seqlen = step
    pre, r = f"step{s}.layers.{i}.", c.ratio(i)
    nwin = min(plan.prefill, c.window_size) if s == 0 else c.window_size
    held = seqlen if s or plan.rows is None else len(plan.rows)   # the rows the file holds
    ncomp = _topk_width(c, slot[1], plan.prefill, start_pos, seqlen) if r else 0
    layout = [(pre + "rows", "I32", (held,))] if s == 0 and plan.rows is not None else []
    layout += [(pre + "x", "BF16", (held, c.dim)), (pre + "out", "BF16", (held, c.dim)),
               (pre + "idx", "I32", (held, nwin + ncomp))]
    if records_shared(c, i) and slot is not None:
        layout += _shared_layout(plan, s, pre, held, slot, copies)
    if index_source:
        k = _topk_width(c, i, plan.prefill, start_pos, seqlen)
        layout += [(pre + "topk_scores", "BF16", (held, k)),
                   (pre + "runner_idxs", "I32", (held, RUNNERS_UP)),
                   (pre + "runner_scores", "BF16", (held, RUNNERS_UP))]
    end = start_pos + seqlen
    samples = np.asarray(plan.capture_rows, np.int64)
    ns = int(((samples >= start_pos) & (samples < end)).sum())
    if ns:
        layout += _samples_layout(c, pre, r, ns, nwin + ncomp, end, index_sampled(c, i, end))
    if s == 0 and plan.capture == "caches":
        layout += cache_layout(c, i, plan.prefill)
    return layout


def _shared_layout(plan: GoldenPlan, s: int, pre: str, held: int, slot, copies) -> list:
    """The ``shared.topk_idxs`` a layer records at step ``s``: the selection of ``slot`` (its
    step and index source). The prefill's, met again in the first decode step, is copied from
    the file (``copies``), or left out of a ``rows`` golden (``{name: None}``)."""
    ss, j = slot
    rows = plan.prefill if ss == 0 else 1
    sp = 0 if ss == 0 else plan.prefill + ss - 1
    if ss != s and ss == 0 and plan.rows is not None:
        copies[pre + "shared.topk_idxs"] = None
        return []
    if ss != s and ss == 0:
        copies[pre + "shared.topk_idxs"] = f"step0.layers.{j}.shared.topk_idxs"
    return [(pre + "shared.topk_idxs", "I32",
             (held if ss == s else rows, _topk_width(plan.config, j, plan.prefill, sp, rows)))]


def _samples_layout(c: AttnConfig, pre: str, r: int, ns: int, kv_rows: int, end: int,
                    scored: bool) -> list:
    """The ``sample.*`` captures of a layer (ratio ``r``) at a step holding ``ns`` sampled
    positions and ending at position ``end``; ``kv_rows``: the rows each query attends;
    ``scored``: it records what the indexer scored (:func:`~.captures.index_sampled`)."""
    hd, H = c.head_dim, c.n_heads
    width = end // r if r else 0
    layout = [(pre + "sample.rows", "I32", (ns,)), (pre + "sample.q", "BF16", (ns, H, hd)),
              (pre + "sample.kv", "BF16", (ns, kv_rows, hd)),
              (pre + "sample.o", "BF16", (ns, H, hd))]
    if scored:
        ih, idim = c.index_n_heads, c.index_head_dim
        layout += [(pre + "sample.index_score", "BF16", (ns, width)),
                   (pre + "sample.index_q", "BF16", (ns, ih, idim)),
                   (pre + "sample.index_weights", "BF16", (ns, ih)),
                   (pre + "sample.index_k", "BF16", (width, idim))]
    if r:
        layout.append((pre + "sample.compress_kv", "BF16", (width, hd)))
    return layout
