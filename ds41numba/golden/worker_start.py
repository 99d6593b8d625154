"""What a local cluster's workers start from (``--workers N``): imported once by the process
they are forked from (the forkserver of :func:`~.cluster._forkserver`), never by a worker itself.

Started Dask's default way, each worker is a new interpreter that imports Dask, numba and
ds41numba (1.1 CPU-seconds a worker on a 2-core Zen 5, taken from the driver's key side running
meanwhile). Forked from one process that imported them once, a worker starts with them
imported. The kernels are not loaded here: loading a parallel kernel starts numba's OpenMP
threads, and numba ends a forked child that then runs one ("fork() called from a process
already using GNU OpenMP"); each worker loads its own (:func:`~.tiles.warm_worker`).
``gc.freeze()`` last: the collector then leaves every object made so far alone, so that a
worker's collections neither walk them nor write to (and so copy) the pages it shares with its
siblings.
"""

import gc

from . import tiles  # noqa: F401  (what a tile runs, imported)

gc.freeze()
