"""How a layer's work and caches reach a cluster's workers: :class:`SharedFiles` for workers on
the driver's machine (``--workers N``), :class:`Broadcast` for any others (``--scheduler``).

Every tile of a layer reads the layer's weights (269 MB as held for layer 20 of v41-flash) and
the caches it reads (42 MB at 16,384 tokens). Dask's broadcast (``Client.scatter(...,
broadcast=True)``) sends each worker its own copy through the scheduler: 2.4-2.9 s of 2 local
workers' time per layer at 16,384 tokens on a 2-core machine, while they wait. Workers on the
driver's machine read the same objects from a file in shared memory (``/dev/shm``) instead: the
driver writes an object's arrays once, as pickle protocol 5's out-of-band buffers at page-aligned
offsets, and each worker maps the file copy-on-write. Nothing is copied then: the pages are the
file's, shared by every worker until one writes to them (none does), and the arrays are writable
numpy arrays, the types numba's kernels were compiled for. A task is given the handle
(:class:`SharedObject`: the pickle without its buffers and where they lie, a few KB) where it
was given a Dask future; a worker loads a handle once and keeps the few it loaded last
(:func:`received`). The files outlive a killed worker (its tasks rerun and map them again) and
are removed when the layer's turn ends and when the run does.
"""

from __future__ import annotations

import mmap
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass

__all__ = ["SharedObject", "SharedFiles", "Broadcast", "HandoverGone", "received"]

#: Buffers start at page boundaries in a shared file (the arrays then are as aligned as numpy's).
_ALIGN = 4096
#: Objects a worker keeps loaded: a layer's work and the two caches it reads, and one to spare.
_KEPT = 4
_loaded: dict[str, object] = {}          # this process's loaded handles, oldest first


class HandoverGone(Exception):
    """A shared file was removed before a task read it: a tile of a layer whose turn had ended
    (its files removed), run again by Dask for a later layer that reads its selection after the
    worker holding that selection died. The driver sends the layer's work again and resubmits,
    as for a lost broadcast."""


@dataclass(frozen=True)
class SharedObject:
    """An object in a shared file: its pickle without the buffers (``meta``), the file and
    ``(offset, bytes)`` of each buffer in it."""

    path: str
    meta: bytes
    spans: tuple

    def load(self):
        """The object, its arrays mapped from the file (once per process: later calls return
        the same object while it is among the last few loaded)."""
        held = _loaded.get(self.path)
        if held is not None:
            return held
        views = []
        if self.spans:
            try:
                with open(self.path, "rb") as f:
                    # A file of empty arrays only (a cache of no rows yet) cannot be mapped.
                    view = (memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
                            if os.fstat(f.fileno()).st_size else memoryview(bytearray()))
            except FileNotFoundError:
                raise HandoverGone(self.path) from None
            views = [view[at:at + n] for at, n in self.spans]
        held = _loaded[self.path] = pickle.loads(self.meta, buffers=views)
        while len(_loaded) > _KEPT:
            del _loaded[next(iter(_loaded))]
        return held


def received(x):
    """What a task was handed: the object of a :class:`SharedObject`, anything else as is."""
    return x.load() if isinstance(x, SharedObject) else x


class SharedFiles:
    """Objects handed to workers on this machine through files in a directory of shared memory
    (``/dev/shm`` where there is one, else the temporary directory), removed with
    :meth:`close`. A worker that dies loses nothing of them."""

    lost_with_workers = False

    def __init__(self, directory: str | None = None):
        if directory is None and os.access("/dev/shm", os.W_OK):
            directory = "/dev/shm"
        self.dir = tempfile.mkdtemp(prefix="ds41numba-cluster-", dir=directory)

    def send(self, obj) -> SharedObject:
        buffers = []
        meta = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        fd, path = tempfile.mkstemp(dir=self.dir, suffix=".bin")
        spans, at = [], 0
        with os.fdopen(fd, "wb") as f:
            for buffer in buffers:
                raw = buffer.raw()
                at += -at % _ALIGN
                f.seek(at)
                f.write(raw)
                spans.append((at, raw.nbytes))
                at += raw.nbytes
        return SharedObject(path, meta, tuple(spans))

    def drop(self, handle: SharedObject) -> None:
        """The object is no longer read (a worker's mapping keeps its pages until it lets go)."""
        try:
            os.unlink(handle.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Broadcast:
    """Objects sent to every worker by Dask (``Client.scatter(..., broadcast=True)``): for
    workers that may be on other machines, and for the in-process drive, whose client keeps
    the object itself. The copies die with the workers holding them."""

    lost_with_workers = True

    def __init__(self, client):
        self.client = client

    def send(self, obj):
        return self.client.scatter(obj, broadcast=True, hash=False)

    def drop(self, handle) -> None:
        """Nothing to do: the copies go with the last future of them."""

    def close(self) -> None:
        """Nothing to do (see :meth:`drop`)."""

