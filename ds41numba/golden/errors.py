"""The one error of the golden-file library."""

__all__ = ["GoldenError"]


class GoldenError(ValueError):
    """A bad request or an unusable file: the CLI prints it as one line and exits with status 2."""
