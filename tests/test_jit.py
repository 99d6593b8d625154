"""Every numba function of the package is compiled with the package's options (ds41numba.jit)."""

import importlib
import pkgutil

import pytest
from numba.core.caching import NullCache
from numba.core.dispatcher import Dispatcher

import ds41numba
from ds41numba.jit import JIT_OPTIONS, njit


def _package_dispatchers():
    """``(module:name, dispatcher)`` for every numba function defined in a module of the package."""
    found = []
    for info in pkgutil.walk_packages(ds41numba.__path__, "ds41numba."):
        if info.name.endswith("__main__"):      # the command line: importing it runs it
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, Dispatcher) and value.py_func.__module__ == info.name:
                found.append((f"{info.name}:{name}", value))
    return found


def test_every_numba_function_of_the_package_is_cached_and_has_no_cfunc_wrapper():
    dispatchers = _package_dispatchers()
    assert len(dispatchers) > 150          # the kernels and helpers, twins included
    uncached = [n for n, d in dispatchers if isinstance(d._cache, NullCache)]
    wrapped = [n for n, d in dispatchers if not d.targetoptions.get("no_cfunc_wrapper")]
    assert not uncached, f"not in numba's on-disk cache: {uncached}"
    assert not wrapped, f"compiled with a cfunc wrapper: {wrapped}"
    assert not [n for n, d in dispatchers if d.targetoptions.get("fastmath")]


@pytest.mark.parametrize("options", [{}, {"nogil": True}, {"parallel": True}])
def test_njit_adds_the_package_options_to_a_functions_own(options):
    def f(x):
        return x + 1

    for compiled in (njit(**options)(f), njit(f) if not options else njit(f, **options)):
        assert compiled(2) == 3
        assert compiled.targetoptions["no_cfunc_wrapper"] is JIT_OPTIONS["no_cfunc_wrapper"]
        assert all(compiled.targetoptions.get(k) == v for k, v in options.items())
        assert not isinstance(compiled._cache, NullCache)


def test_njit_refuses_fastmath():
    with pytest.raises(ValueError, match="fastmath"):
        njit(fastmath=True)
