"""How every numba function of the package is compiled: numba's ``njit`` with the package's options.

Each kernel and helper is declared ``@njit`` or ``@njit(parallel=True)`` (and ``nogil=True`` or
``inline="always"`` where it says so) from this module rather than from numba, so that two
options hold for all of them:

- ``cache=True``: the machine code is kept in numba's on-disk cache (:mod:`.kernel_cache`), so
  a process loads what an earlier one compiled (:mod:`.compile_ahead` fills it in parallel).
- ``no_cfunc_wrapper=True``: numba otherwise builds, optimises and emits a C-ABI wrapper beside
  every function it compiles (for ``cfunc``-style calls by address, which nothing here makes),
  once for the function and again in each function that calls it. Without them the default
  golden's kernels compiled in about 0.9 of the time on a Zen 4 core (2026-12-08, both versions
  at once on the two cores, four rounds). Python still calls a kernel through numba's usual
  wrapper.

Never ``fastmath``: bit-exactness is the product.
"""

from __future__ import annotations

import numba

__all__ = ["JIT_OPTIONS", "njit"]

#: The options every function of the package is compiled with (besides its own).
JIT_OPTIONS = {"cache": True, "no_cfunc_wrapper": True}


def njit(function=None, **options):
    """``numba.njit`` with :data:`JIT_OPTIONS`: as a decorator (``@njit``, ``@njit(parallel=True)``)
    or called on a function (``njit(nogil=True)(f)``)."""
    if "fastmath" in options:
        raise ValueError("ds41numba never compiles with fastmath: its results are bit-exact")
    compile_ = numba.njit(**JIT_OPTIONS, **options)
    return compile_ if function is None else compile_(function)
