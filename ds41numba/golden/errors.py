"""The errors of the golden-file library: a usage error, a failing disk, an interrupted run."""

from __future__ import annotations

import errno
from contextlib import contextmanager

__all__ = ["GoldenError", "DiskError", "RunInterrupted", "disk_errors"]


class GoldenError(ValueError):
    """A bad request or an unusable file: the CLI prints it as one line and exits with status 2."""


class DiskError(GoldenError):
    """Writing (or reading back) a golden or its checkpoint failed in the operating system: a
    full disk, a read-only or removed directory. A GoldenError, so the CLI prints the path and
    the OS's reason as one line and exits 2 instead of a traceback."""

    def __init__(self, verb: str, path: str, error: OSError, hint: str = ""):
        self.verb, self.path, self.error, self.hint = verb, path, error, hint
        code = errno.errorcode.get(error.errno, "")
        reason = (error.strerror or str(error)) + (f" ({code})" if code else "")
        super().__init__(f"cannot {verb} {path!r}: {reason}" + (f"; {hint}" if hint else ""))

    def with_hint(self, hint: str) -> "DiskError":
        """The same error with what the user can do about it appended."""
        return DiskError(self.verb, self.path, self.error, hint)


@contextmanager
def disk_errors(path: str, verb: str = "write"):
    """Turn an ``OSError`` of the I/O in the body into a :class:`DiskError` naming ``path``
    (the file being written, as the user knows it), and nothing else."""
    try:
        yield
    except OSError as e:
        raise DiskError(verb, getattr(e, "filename", None) or path, e) from None


class RunInterrupted(BaseException):
    """A streamed run stopped by Ctrl-C or SIGTERM after it wrote a checkpoint: its partial file
    and checkpoint are kept for ``--resume``. A BaseException, as KeyboardInterrupt is, so no
    ``except Exception`` swallows it; ``status`` is the exit status (130 Ctrl-C, 143 SIGTERM)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
