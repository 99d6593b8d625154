"""A cluster run's queries part (:class:`Queries`): every layer's prefill query tiles, a layer
at a time in layer order, submitted to the workers the costliest first and no more at once than
they run, and written into the file as they complete.

A layer's work (its weights) and the caches it reads reach the workers through the cluster's
handover (:mod:`.handover`), once per layer, or once for all the layers reading the same
caches; a layer reading another's selection or candidates is given that layer's result for the
same tile, which stays on the workers. A tile whose inputs were lost with the workers holding
them is submitted again, what it read sent or made again.
"""

from __future__ import annotations

import operator
import os
import time
from concurrent.futures import CancelledError

import numpy as np

from .captures import storage_kind, to_storage
from .errors import GoldenError
from .handover import HandoverGone
from .tiles import CacheRows, LayerWork, run_tile
from .work import work_units

__all__ = ["Queries"]


class Queries:
    """Part 2 of :func:`~.cluster.drive_tiles`: every layer's query tiles on the cluster, in layer order.

    ``seen[i]`` is ``(compress_kv, index_k)`` as layer i's prefill found the shared slots;
    ``done`` the ``(layer, first_row)`` tiles already in the file (a resumed run's), which are
    not written again. A tile a later layer needs the selection of but whose result is gone (a
    resumed run) is run again for it, not written.
    """

    def __init__(self, cluster, plan, stack, seen, done, out, progress, tiles, save):
        self.cluster, self.client, self.plan, self.stack = cluster, cluster.client, plan, stack
        self.seen, self.done, self.out, self.progress = seen, done, out, progress
        self.tiles, self.save = tiles, save
        self.answered = None if plan.rows is None else np.asarray(plan.rows, np.int64)
        self.handover = cluster.handover()
        self.works = {}          # layer -> its LayerWork as sent (its turn only)
        self.cache_rows = {}     # (id of a cache, rows) -> (the cache, its rows as sent)
        self.keys_of = {}        # key of a tile's future -> its first row
        self.selections = {}     # (layer, first_row) -> future of that tile's selection

    def work(self, i: int):
        """Layer i's LayerWork as the workers receive it (sent on first use in its turn)."""
        if i not in self.works:
            work = LayerWork(self.plan.config, i, self.plan.prefill, self.plan.seed,
                             self.plan.profile, self.plan.capture_rows, self.stack.weights[i],
                             self.cluster.threads)
            t0 = time.perf_counter()
            self.works[i] = self.handover.send(work)
            self.cluster.stats.broadcasts.append((i, work.weights.nbytes(), 0,
                                                  time.perf_counter() - t0))
        return self.works[i]

    def reads(self, i: int) -> tuple:
        """The caches layer i's tiles read: its compressed KV and its index keys (or None)."""
        c = self.plan.config
        kv, index_k = self.seen[i]
        if not c.ratio(i):
            return None, None
        return kv, (index_k.keys if c.is_index_source(i) and index_k is not None else None)

    def caches(self, i: int):
        """The caches layer i reads (:meth:`reads`) as the workers receive them, each sent once
        for all the layers that read it."""
        P, r = self.plan.prefill, self.plan.config.ratio(i)
        out = []
        for cache in self.reads(i):
            if cache is None:
                out.append(None)
                continue
            key = (id(cache), P // r)
            if key not in self.cache_rows:
                t0 = time.perf_counter()
                rows = cache[:P // r]
                sent = self.handover.send(CacheRows(rows))
                self.cache_rows[key] = (cache, sent)  # the cache kept: its id stays its own
                self.cluster.stats.broadcasts.append((i, 0, rows.nbytes,
                                                      time.perf_counter() - t0))
            out.append(self.cache_rows[key][1])
        return out

    def sources(self, i: int):
        """The layers whose selection (index source) and candidates layer i's tiles read."""
        c = self.plan.config
        topk = (c.index_source_of(i) if c.ratio(i) and not c.is_index_source(i) else None)
        cands = c.candidate_source_layer if c.uses_candidates(i) else None
        return topk, cands

    def submit(self, i: int, a: int, n: int):
        """Layer i's tile at rows ``a ..``: the tile's future, whose first part the driver
        writes; its selection (the second) stays on the workers for later layers."""
        topk, cands = self.sources(i)
        x = None
        if self.plan.inputs is not None:        # the workers may not see the inputs file
            first = max(0, a - self.plan.config.window_size + 1)
            x = self.plan.input_rows(f"step0.layers.{i}.x", first, a + n - first, 0)
        tile = self.client.submit(run_tile, self.work(i), *self.caches(i), a, n,
                                  None if topk is None else self.selection(topk, a, n),
                                  None if cands is None else self.selection(cands, a, n), x,
                                  key=f"ds41numba-tile-{i}-{a}-{os.urandom(4).hex()}")
        self.selections[(i, a)] = self.client.submit(operator.getitem, tile, 1)
        # The driver takes the whole tile, not a task taking its rows apart: Dask would run
        # that after the next tile its worker holds (one task at a time), and every tile's rows
        # would reach the driver at the end instead of while the workers compute.
        self.keys_of[tile.key] = a
        return tile

    def selection(self, j: int, a: int, n: int):
        if (j, a) not in self.selections:
            self.submit(j, a, n)          # its rows are in the file already: only its selection
        return self.selections[(j, a)]

    def run(self):
        layers = self.stack.layers
        try:
            for pos, i in enumerate(layers):
                self._layer(i)
                self._forget(layers[pos + 1:])
        finally:
            self.handover.close()

    def _layer(self, i: int):
        """Layer i's tiles: submitted, then written as they complete (a cancelled one again)."""
        rows_of = {a: n for a, n in self.tiles if (i, a) not in self.done}
        if rows_of:
            self._write_layer_samples(i)
        retries = dict.fromkeys(rows_of, 0)
        # The last rows first, and no more tiles out than the workers run at once: a tile costs
        # more the more positions its rows see, and each worker that ends one takes the
        # costliest left. (Dask would place every tile at once, in turn: of four tiles on two
        # workers, one ran the costliest and the third, the other the second and the cheapest.)
        # as_completed holds each future until it hands it over: ``fut`` is then the driver's
        # only reference, and the tile leaves its worker once it goes and the worker has taken
        # the selection from it.
        waiting = list(rows_of.items())                 # taken from the end
        tiles = self.cluster._distributed.as_completed()
        out = self._more(i, waiting, tiles, 0)
        for fut in tiles:
            a = self.keys_of.pop(fut.key)
            out = self._more(i, waiting, tiles, out - 1)
            try:
                (first_row, rows, (at, samples), seconds), _ = fut.result()
            except (CancelledError, HandoverGone) as e:
                self._lost_tile(e, i, a, rows_of[a], retries)
                waiting.append((a, rows_of[a]))
                out = self._more(i, waiting, tiles, out)
                continue
            finally:
                del fut
            self.cluster.stats.tiles.append((i, first_row, rows_of[first_row], seconds))
            self._write(i, first_row, rows, at, samples)
            self.done.add((i, first_row))
            n = rows_of[first_row]
            if self.progress is not None:
                self.progress(work_units(self.plan.config, i, first_row, n, keys=False),
                              f"step 0 rows {first_row}-{first_row + n - 1} layer {i}")
            self.save()

    def _more(self, i: int, waiting: list, tiles, out: int) -> int:
        """Layer i's next ``waiting`` tiles submitted (into ``tiles``) while fewer than the
        cluster's slots are ``out``; returns how many are out then."""
        slots = self.cluster.slots() if waiting else 0       # the scheduler asked once
        while waiting and out < slots:
            tiles.add(self.submit(i, *waiting.pop()))
            out += 1
        return out

    def _forget(self, later) -> None:
        """After a layer's turn, keep only the selections and caches a ``later`` layer reads;
        each layer's work goes with its turn."""
        keep = {s for k in later for s in self.sources(k) if s is not None}
        self.selections = {k: f for k, f in self.selections.items() if k[0] in keep}
        still = {id(x) for k in later for x in self.reads(k) if x is not None}
        self._drop(lambda key: key[0] not in still)

    def _drop(self, cache_gone) -> None:
        """Every layer's work, and the caches whose key ``cache_gone`` says, no longer sent."""
        for sent in self.works.values():
            self.handover.drop(sent)
        self.works.clear()
        for key in [k for k in self.cache_rows if cache_gone(k)]:
            self.handover.drop(self.cache_rows.pop(key)[1])

    def _lost_tile(self, error, i: int, a: int, n: int, retries: dict) -> None:
        """Layer i's tile at rows ``a ..`` was cancelled, or a source tile Dask ran again for
        it found its layer's shared files removed. With the scheduler still there, what it read
        was lost with the workers that held it (every copy of the broadcast work, or a source
        tile's selection): those are sent or made again for a retry (three at most). Otherwise
        the scheduler went away: ``error`` is raised for the run to stop."""
        if self.client.status != "running":
            raise error
        retries[a] += 1
        if retries[a] > 3:
            raise GoldenError(f"layer {i} rows {a}-{a + n - 1}: the workers lost what the tile "
                              f"reads three times over; giving up") from None
        if self.handover.lost_with_workers:
            self._drop(lambda key: True)
        self.selections = {k: f for k, f in self.selections.items()
                           if f.status not in ("cancelled", "error", "lost")}

    def _write(self, i, first_row, rows, at, samples):
        t0 = time.perf_counter()
        self.cluster.stats.write_bytes += sum(v.nbytes for v in rows.values())
        self._write_rows(i, first_row, rows, at, samples)
        self.cluster.stats.write_seconds += time.perf_counter() - t0

    def _write_rows(self, i, first_row, rows, at, samples):
        prefix = f"step0.layers.{i}."
        at_row = first_row if self.answered is None else int(np.searchsorted(self.answered,
                                                                             first_row))
        for what, value in rows.items():
            self.out.write_rows(prefix + what, at_row, value)
        if len(at):
            for what, value in samples.items():
                self.out.write_rows(prefix + what, int(at[0]), value)

    def _write_layer_samples(self, i: int):
        """The samples that are the step's, not a tile's: which rows, and the caches scored and
        attended (as the one-process run records them with the step's last chunk)."""
        c, P, out = self.plan.config, self.plan.prefill, self.out
        prefix = f"step0.layers.{i}."
        rows = np.asarray([p for p in self.plan.capture_rows if p < P], np.int32)
        r = c.ratio(i)
        kv, keys = self.reads(i)
        parts = {"sample.rows": rows}
        if kv is not None:
            parts["sample.compress_kv"] = kv[:P // r]
        if keys is not None:
            parts["sample.index_k"] = keys[:P // r]
        for what, value in parts.items():
            name = prefix + what
            if name in out.entries and out.missing_rows(name):
                out.write_rows(name, 0, to_storage(name, value, storage_kind(name)))
