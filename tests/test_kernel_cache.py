"""numba's cache of the package's kernels, kept only while the whole package's source is
unchanged (ds41numba.kernel_cache)."""

import importlib
import os
import subprocess
import sys
import textwrap

from ds41numba import kernel_cache
from ds41numba.kernel_cache import PACKAGE_ROOT, PackageStampedLocator, source_fingerprint

packed_scores = importlib.import_module("ds41numba.indexer.packed_scores")


def _write_package(root, helper_value):
    """A package of two modules: ``a.f`` (cached) returns ``b.helper()`` (cached too)."""
    root.mkdir(exist_ok=True)
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text(textwrap.dedent("""\
        from numba import njit
        from .b import helper

        @njit(cache=True)
        def f():
            return helper()
        """))
    (root / "b.py").write_text(textwrap.dedent(f"""\
        from numba import njit

        @njit(cache=True)
        def helper():
            return {helper_value}
        """))


# Runs a.f() in a fresh process with the package's locator applied to the package at argv[1].
_RUN = """
import sys
from pathlib import Path
from ds41numba import kernel_cache
kernel_cache.PACKAGE_ROOT = Path(sys.argv[1]).resolve()
sys.path.insert(0, sys.argv[1] + "/..")
from pkg import a
print(a.f())
"""


def test_a_cached_kernel_is_compiled_again_when_another_module_of_its_package_changes(tmp_path):
    """``a.f`` is cached with ``b.helper`` compiled into it; after ``b.py`` changes (``a.py``
    does not) a new process must run the new helper, not load ``f``'s old machine code (which
    numba's stamp of ``a.py`` alone would keep)."""
    root = tmp_path / "pkg"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))

    def run():
        return subprocess.run([sys.executable, "-c", _RUN, str(root)], env=env, capture_output=True,
                              text=True, check=True).stdout.split()[-1]

    _write_package(root, 1)
    assert run() == "1"
    assert any((tmp_path / "cache").rglob("a.f-*.nbi")), "a.f was not cached"
    _write_package(root, 2)
    assert run() == "2"


def test_the_fingerprint_follows_every_source_file(tmp_path):
    _write_package(tmp_path, 1)
    first = source_fingerprint(tmp_path)
    source_fingerprint.cache_clear()
    assert source_fingerprint(tmp_path) == first
    for change in (lambda: (tmp_path / "b.py").write_text("x = 1\n"),
                   lambda: (tmp_path / "c.py").write_text(""),
                   lambda: (tmp_path / "c.py").rename(tmp_path / "d.py")):
        change()
        source_fingerprint.cache_clear()
        new = source_fingerprint(tmp_path)
        assert new != first
        first = new


def test_the_package_kernels_carry_the_fingerprint_and_other_functions_do_not():
    impl = packed_scores._vnni_kernel._cache._impl
    assert isinstance(impl.locator, PackageStampedLocator)
    assert packed_scores._vnni_kernel._cache._cache_file._source_stamp[1] == \
        source_fingerprint(PACKAGE_ROOT)
    assert PackageStampedLocator.from_function(test_the_fingerprint_follows_every_source_file,
                                               __file__) is None
    kernel_cache.install()          # a second install adds nothing
    assert kernel_cache._CACHE_IMPL._locator_classes.count(PackageStampedLocator) == 1
