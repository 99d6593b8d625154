"""Paged caches: a golden's caches laid out as serving engines hold them (``export-paged``).

Engines keep a sequence's caches in fixed-size pages of ``P`` rows, anywhere in a pool, and
find them through a *block table* (logical page -> physical page); a row's *slot* is
``physical_page * P + offset``. A kernel that reads pages must find the same rows a
contiguous cache holds, and must turn logical positions into slots. This module writes, for
every cache a golden records at a step (``shared.compress_kv``, ``shared.index_k``,
``state.window_kv``; a ``--capture caches`` golden's ``state.compress_kv`` and
``state.index_k`` at the prefill), its pages in a shuffled physical order, the block table and the slot of
every logical row, and the index selections as slots (``topk_slots``; at decode also the
attention's whole index rows, ``idx_slots``), so a paged kernel can be tested against the
golden's logical tensors. :func:`unpage` is the inverse, for tests.

Names, for a cache ``WHAT`` recorded as ``step{s}.layers.{i}.{shared|state}.WHAT``:

* ``step{s}.layers.{i}.paged.WHAT.pages`` ``[pages, P, width]`` (the cache's dtype; slots past
  the last row zero);
* ``step{s}.layers.{i}.paged.WHAT.block_table`` ``[pages]`` int32, logical -> physical page;
* ``step{s}.layers.{i}.paged.WHAT.slot_mapping`` ``[rows]`` int32, logical row -> slot.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

from ..numerics import is_int
from .captures import STEP_NAME
from .errors import GoldenError
from .files import GoldenFile, write_tensors_atomic

__all__ = ["PAGED_FORMAT", "PAGED_CACHES", "page_cache", "unpage", "export_paged"]

PAGED_FORMAT = "ds41numba-paged"
#: The caches a step reads, by capture name -> their name in the paged file.
PAGED_CACHES = {"shared.compress_kv": "compress_kv", "shared.index_k": "index_k",
                "state.window_kv": "window_kv",
                # a --capture caches golden: each owner's caches as the prefill leaves them
                "state.compress_kv": "compress_kv", "state.index_k": "index_k"}


def _permutation(pages: int, shuffle: int | None, name: str) -> np.ndarray:
    """Physical page of each logical page: identity, or a permutation drawn from ``shuffle``
    and the cache's name (each cache its own order, the same for the same seed)."""
    if shuffle is None:
        return np.arange(pages, dtype=np.int32)
    rng = np.random.Generator(np.random.PCG64([int(shuffle), zlib.crc32(name.encode())]))
    return rng.permutation(pages).astype(np.int32)


def page_cache(rows: np.ndarray, page_size: int, shuffle: int | None = None,
               name: str = "") -> dict[str, np.ndarray]:
    """``rows [n, width]`` laid out in pages of ``page_size`` rows: ``{"pages", "block_table",
    "slot_mapping"}`` (see the module docstring)."""
    rows = np.asarray(rows)
    n = rows.shape[0]
    count = -(-n // page_size)
    table = _permutation(count, shuffle, name)
    pages = np.zeros((count, page_size) + rows.shape[1:], rows.dtype)
    logical = np.arange(n)
    slots = (table[logical // page_size].astype(np.int64) * page_size + logical % page_size)
    pages.reshape((count * page_size,) + rows.shape[1:])[slots] = rows
    return {"pages": pages, "block_table": table, "slot_mapping": slots.astype(np.int32)}


def unpage(pages: np.ndarray, block_table: np.ndarray, length: int) -> np.ndarray:
    """The logical rows ``0 .. length - 1`` of a paged cache, read through its block table."""
    page_size = pages.shape[1]
    logical = np.arange(length)
    slots = block_table[logical // page_size].astype(np.int64) * page_size + logical % page_size
    return pages.reshape((-1,) + pages.shape[2:])[slots]


def _as_slots(entries: np.ndarray, offset: int, compressed_slots: np.ndarray,
              window_slots: np.ndarray | None) -> np.ndarray:
    """Index entries as slots: entries >= ``offset`` are compressed positions + ``offset``,
    those below ring slots (``window_slots``; None: there are none); -1 stays -1."""
    e = np.asarray(entries, np.int64)
    out = np.full(e.shape, -1, np.int64)
    comp = e >= offset
    if (comp.any() and compressed_slots is None) or (((e >= 0) & ~comp).any() and window_slots is None):
        raise GoldenError("an index row holds an entry of a cache this step does not record")
    if comp.any():
        out[comp] = compressed_slots[e[comp] - offset]
    win = (e >= 0) & ~comp
    if win.any():
        out[win] = window_slots[e[win]]
    return out.astype(np.int32)


def _check_page_size(page_size: int, window: int):
    if not is_int(page_size, 1):
        raise GoldenError(f"--page-size must be an integer >= 1, got {page_size!r}")
    if window % page_size:
        raise GoldenError(f"--page-size {page_size} does not divide the window ({window} rows): "
                          f"the window ring must fill whole pages")


def export_paged(golden_path, out, page_size: int, shuffle: int | None = None,
                 force: bool = False) -> dict:
    """Write the paged caches of the golden ``golden_path`` to ``out``; returns ``{"path",
    "caches", "tensors"}``. A golden that records no cache, or a page size that does not divide
    the window, is a :class:`GoldenError`."""
    with GoldenFile(golden_path) as f:
        run = f.run_info()
        c = run.config
        _check_page_size(page_size, c.window_size)
        tensors: dict[str, np.ndarray] = {}
        recorded: dict[tuple[int, int], dict[str, np.ndarray]] = {}   # (step, layer) -> slots
        for name in f.names:
            m = STEP_NAME.fullmatch(name)
            if not m or m.group(3) not in PAGED_CACHES:
                continue
            step, layer, what = int(m.group(1)), int(m.group(2)), PAGED_CACHES[m.group(3)]
            prefix = f"step{step}.layers.{layer}.paged.{what}"
            paged = page_cache(f.get(name), page_size, shuffle, prefix)
            for part, a in paged.items():
                tensors[f"{prefix}.{part}"] = a
            recorded.setdefault((step, layer), {})[what] = paged["slot_mapping"]
        if not tensors:
            raise GoldenError(f"{f.path!r} records no cache (shared.compress_kv, shared.index_k, "
                              f"state.window_kv): write it with --capture all or caches")
        for step, layer in sorted(recorded):
            _selections_as_slots(f, run, step, layer, recorded, tensors)
        meta = {"format": PAGED_FORMAT, "page_size": str(page_size),
                "shuffle": "none" if shuffle is None else str(int(shuffle)),
                "config": f.metadata.get("config", ""), "golden_metadata": json.dumps(
                    dict(sorted(f.metadata.items())))}
    write_tensors_atomic(out, tensors, meta, force=force)
    return {"path": str(out), "caches": sum(k.endswith(".block_table") for k in tensors),
            "tensors": len(tensors)}


def _latest(recorded, step: int, layer: int, what: str):
    """The slots of cache ``what`` as layer ``layer`` reads it at ``step``: the last recording
    at or before it in that step (the shared slot holds what the last layer wrote)."""
    found = [j for (s, j), d in recorded.items() if s == step and j <= layer and what in d]
    return recorded[step, max(found)][what] if found else None


def _selections_as_slots(f: GoldenFile, run, step: int, layer: int, recorded, tensors):
    """``topk_slots`` (the shared selection) and, at decode, ``idx_slots`` (the attention's
    rows: window ring slots, then compressed positions) of one step and layer, as slots."""
    c = run.config
    prefix = f"step{step}.layers.{layer}."
    comp = None
    if c.ratio(layer) and run.capture == "caches":   # only the owners record theirs
        comp = recorded.get((step, c.kv_source_of(layer)), {}).get("compress_kv")
    elif c.ratio(layer):
        comp = _latest(recorded, step, layer, "compress_kv")
    offset = c.window_size if step else run.prefill
    if comp is not None and prefix + "shared.topk_idxs" in f:
        tensors[prefix + "paged.topk_slots"] = _as_slots(f.get(prefix + "shared.topk_idxs"),
                                                        offset, comp, None)
    window = recorded.get((step, layer), {}).get("window_kv")
    if step and window is not None and prefix + "idx" in f:
        tensors[prefix + "paged.idx_slots"] = _as_slots(f.get(prefix + "idx"), offset, comp,
                                                       window)
