"""numba's on-disk cache of this package's kernels, kept only while the whole package's source is
unchanged.

numba judges a cached kernel by its own source file alone (a hash of it): a kernel that calls
a helper or an LLVM-IR intrinsic from another module (``packed_scores`` calls ``head_mix``'s
mixers through ``int8_pairs``) keeps its old machine code when only that other module changes,
and a checkout or upgrade that changes a mixer but not its callers would then run the old mixer:
other bits, silently. Every cached function of the package is therefore stamped with a
fingerprint of all of the package's source (:func:`source_fingerprint`) beside numba's own
stamp, so a change to any module compiles its kernels again (in parallel, by
:mod:`.compile_ahead`). Where the cache lives is numba's choice as before (``NUMBA_CACHE_DIR``,
else ``__pycache__`` beside the source, else the user's cache); numba's
``NUMBA_CACHE_LOCATOR_CLASSES``, when set, replaces this with the locators it names.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from numba.core import caching

__all__ = ["PACKAGE_ROOT", "source_fingerprint", "install"]

#: The package's directory: the functions whose cache entries carry the fingerprint.
PACKAGE_ROOT = Path(__file__).resolve().parent

# numba 0.59-0.6x names the cache's implementation class with a leading underscore.
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl


@functools.cache
def source_fingerprint(root: Path) -> bytes:
    """A SHA-256 of every ``.py`` file under ``root`` (the package's: :data:`PACKAGE_ROOT`):
    their paths (relative, in order) and contents."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.digest()


class PackageStampedLocator(caching._CacheLocator):
    """The locator numba would choose for a function of this package, its source stamp widened
    to ``(numba's stamp, source_fingerprint(PACKAGE_ROOT))``; other functions are left to
    numba's locators."""

    def __init__(self, inner):
        self._inner = inner

    def ensure_cache_path(self):
        self._inner.ensure_cache_path()

    def get_cache_path(self):
        return self._inner.get_cache_path()

    def get_source_stamp(self):
        return self._inner.get_source_stamp(), source_fingerprint(PACKAGE_ROOT)

    def get_disambiguator(self):
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not Path(py_file).resolve().is_relative_to(PACKAGE_ROOT):
            return None
        for other in _CACHE_IMPL._locator_classes:
            inner = None if other is cls else other.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        return None


def install() -> None:
    """Put :class:`PackageStampedLocator` first among numba's locators (once); to run before
    any of the package's kernels is defined."""
    if PackageStampedLocator not in _CACHE_IMPL._locator_classes:
        _CACHE_IMPL._locator_classes.insert(0, PackageStampedLocator)
