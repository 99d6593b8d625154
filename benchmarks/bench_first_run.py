"""asv benchmarks of a first run: the default ``ds41numba golden`` in a fresh process.

* ``ColdGolden.track_seconds``: on an empty numba cache, as after ``pip install``: importing the
  package, compiling ahead the kernels the golden calls (one process a core), loading them and
  making the golden (``first_run.golden_seconds``; the README's first command less its venv and
  install).
* ``WarmGolden.track_seconds``: the same golden on the cache a first one filled.

Each sample is a whole process's wall seconds, timed from outside (``track_``: the command's
processes, not asv's), one a round.
"""

import os
import tempfile

from . import first_run


class ColdGolden:
    rounds = 3                # a sample a round: 15-40 s on the 2-core Zen 4
    timeout = 900

    def setup(self):
        self._dir = tempfile.TemporaryDirectory(prefix="ds41numba-asv-cold-")

    def teardown(self):
        self._dir.cleanup()

    def track_seconds(self):
        d = self._dir.name
        return first_run.golden_seconds(os.path.join(d, "golden.safetensors"),
                                        cache=os.path.join(d, "cache"))[0]

    track_seconds.unit = "seconds"


class WarmGolden(ColdGolden):
    def setup(self):
        super().setup()
        self.track_seconds()                  # the first golden fills the cache
