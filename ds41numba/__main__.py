"""``python -m ds41numba``: the same command line as the ``ds41numba`` console script."""

import sys

from .cli import main

sys.exit(main())
