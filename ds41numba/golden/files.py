"""Golden files on disk: atomic writing, the metadata that describes a run, and reading.

A golden is one self-contained safetensors file (weights, inputs, captures; see the package
docstring) whose ``__metadata__`` records the config, the run and the generator, so the file
alone is enough to replay it. :class:`GoldenFile` reads it, and the reference's ``.npz``
goldens too, one tensor at a time; :func:`load_golden` reads a whole (small) one at once.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import safetensors.numpy
from ml_dtypes import bfloat16 as BF16
from safetensors import safe_open

from .. import __version__
from ..config import AttnConfig
from .captures import CAPTURE_MODES, STEP_NAME
from .rows import runs
from .tensor_files import read_header
from .errors import GoldenError, disk_errors
from .generator import BATCH_INPUTS, GENERATOR, GENERATOR_SPEC, PROFILES

__all__ = ["FORMAT", "FORMAT_VERSION", "RunInfo", "GoldenFile", "BatchRowFile", "load_golden",
           "write_tensors_atomic", "check_target", "StreamingGolden", "SAFETENSORS_DTYPES",
           "fsync_dir"]

FORMAT = "ds41numba-golden"
FORMAT_VERSION = "2"
#: Versions this ds41numba reads: 1 has no index scores, profile or sampled rows.
READABLE_VERSIONS = ("1", "2")


# =========================================================================== atomic writing


def check_target(path: str, force: bool):
    """Refuse an output path whose directory is missing, that is a directory, or that exists
    (unless ``force``): a :class:`GoldenError` in the command line's words."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise GoldenError(f"--out: directory {directory!r} does not exist")
    if os.path.isdir(path):
        raise GoldenError(f"--out: {path!r} is a directory")
    if os.path.exists(path) and not force:
        raise GoldenError(f"--out: {path!r} exists (use --force to overwrite it)")


@contextmanager
def _temporary_beside(path: str):
    """A temporary file in ``path``'s directory, removed unless the body renamed it away.

    Any exit -- error, Ctrl-C, a SIGTERM turned into SystemExit -- removes it, so no partial
    file survives. (A SIGKILL cannot be caught; then only this hidden ``.NAME.*.tmp`` remains,
    never a file under the target name.)
    """
    directory, base = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sort_metadata(f):
    """Rewrite the header of the safetensors file open in ``f`` with its metadata keys sorted.

    safetensors serialises the metadata map in a random order (a Rust HashMap), so two equal
    runs would give files that differ in their header bytes. Tensor entries keep their order;
    the rewritten header has the same length (padded with spaces, which the format allows).
    """
    f.seek(0)
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
    if not header.get("__metadata__"):
        return
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(text) <= n:
        f.seek(8)
        f.write(text + b" " * (n - len(text)))
        f.flush()


def write_tensors_atomic(path, tensors: dict[str, np.ndarray], metadata: dict[str, str],
                         force: bool = False):
    """Write a safetensors file to a temporary name beside ``path``, then rename it into place.

    safetensors >= 0.8 writes each array straight from its buffer, so this needs no second
    copy of the tensors (older versions copy each tensor to bytes first). Without ``force`` an
    existing ``path`` is never replaced, not even one that appeared while the file was written.
    """
    path = os.fspath(path)
    check_target(path, force)
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    with _temporary_beside(path) as tmp:
        safetensors.numpy.save_file(arrays, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            _sort_metadata(f)
            os.fsync(f.fileno())
        _publish(tmp, path, force)


def _publish(tmp: str, path: str, force: bool):
    """Rename the complete temporary file ``tmp`` to ``path`` (never over an existing file
    without ``force``), as an ordinary file, and sync the directory."""
    # mkstemp and safetensors both make private (0600) files; a golden is an ordinary file.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    if force:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)     # fails if path exists: no clobbering, atomically
        except FileExistsError:
            raise GoldenError(f"--out: {path!r} appeared while writing (use --force)") from None
        except OSError:            # a filesystem without hard links
            if os.path.exists(path):
                raise GoldenError(f"--out: {path!r} exists (use --force to overwrite it)") from None
            os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(directory: str):
    """Sync a directory, so a rename into it survives a power cut (best effort: some
    filesystems cannot)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# =========================================================================== streaming writing

#: numpy dtype of each safetensors dtype a golden uses.
SAFETENSORS_DTYPES = {"BF16": np.dtype(BF16), "F32": np.dtype(np.float32),
                      "I32": np.dtype(np.int32), "U8": np.dtype(np.uint8)}


def _laid_out(layout, metadata: dict[str, str]) -> tuple[dict, bytes]:
    """The entries ``{name: (dtype, shape, offset, row bytes, rows, row axes)}`` of a layout
    and its header (metadata keys sorted, padded with spaces to 8 bytes): all of a file's
    offsets. A layout entry may add a fourth element, its row axes (default 1): a tensor's
    rows are its first ``row axes`` axes taken together (2 for ``[batch, seqlen, ...]``,
    whose row ``b * seqlen + s`` is sequence b's row s)."""
    header = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    entries, offset = {}, 0
    for name, dtype, shape, *axes in layout:
        shape = tuple(int(d) for d in shape)
        axes = int(axes[0]) if axes else 1
        size = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if name in entries:
            raise ValueError(f"StreamingGolden: tensor {name} appears twice in the layout")
        rows = math.prod(shape[:axes]) if shape else 1
        row = size // rows if rows else size
        entries[name] = (dtype, shape, offset, row, rows, axes)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return entries, text + b" " * (-len(text) % 8)


def _entry_bytes(entry) -> int:
    dtype, shape = entry[0], entry[1]
    return math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize


class StreamingGolden:
    """A safetensors file laid out up front and filled in place, a block of rows at a time.

    ``layout`` lists every tensor, ``(name, dtype, shape)`` in file order (dtype a safetensors
    name: ``BF16``, ``F32``, ``I32``, ``U8``; a fourth element 2 makes the first two axes the
    rows, as for a batch's ``[batch, seqlen, ...]`` tensors); the header (metadata keys
    sorted, entries in layout order, padded with spaces to 8 bytes) and every byte offset
    follow from it alone, so
    the file is byte-identical whatever order or block sizes its rows are written in. It is
    made under a hidden temporary name beside ``path`` (``.NAME.*.tmp``), sized at once,
    :meth:`write_rows` puts rows in place, and :meth:`commit` checks every row was written,
    syncs and renames it into place. Use it as a context manager: leaving it without a commit
    (an error, Ctrl-C) removes the temporary file, unless :attr:`keep` is set.

    A resumable run (:mod:`.checkpoint`) names the file itself (``partial``, created new) and
    sets :attr:`keep` once a checkpoint refers to it; resuming passes the checkpoint's
    ``rows_written`` and reopens that file. OS errors are :class:`DiskError` naming the file.
    """

    def __init__(self, path, layout, metadata: dict[str, str], force: bool = False,
                 partial: str | None = None, rows_written: dict | None = None):
        self.path = os.fspath(path)
        self.force = force
        self.keep = False
        check_target(self.path, force)
        self.entries, text = _laid_out(layout, metadata)
        self.data_start = 8 + len(text)
        self.size = self.data_start + sum(_entry_bytes(e) for e in self.entries.values())
        self.rows_written = {name: 0 for name in self.entries}
        directory, base = os.path.split(os.path.abspath(self.path))
        self.tmp, self._fd = partial, None
        with disk_errors(partial or directory):
            if partial is None:
                self._fd, self.tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp",
                                                      dir=directory)
            elif rows_written is None:
                self._fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            else:
                self._reopen(text, rows_written)
                return
            try:
                os.write(self._fd, struct.pack("<Q", len(text)) + text)
                os.ftruncate(self._fd, self.size)
            except BaseException:
                self.abort()
                raise

    def _reopen(self, text: bytes, rows_written: dict):
        """Continue filling the partial file ``self.tmp`` of an interrupted run whose rows
        written are ``rows_written``; it must be this layout's file (header and size)."""
        fd = os.open(self.tmp, os.O_RDWR)
        head = os.pread(fd, 8 + len(text), 0)
        if head != struct.pack("<Q", len(text)) + text or os.fstat(fd).st_size != self.size \
                or set(rows_written) != set(self.entries):
            os.close(fd)
            raise GoldenError(f"{self.tmp!r} is not the partial file of this run (its header or "
                              f"size differs): use --force to start over")
        self._fd = fd
        self.rows_written.update(rows_written)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def write_rows(self, name: str, first_row: int, array) -> None:
        """Rows ``first_row ..`` of tensor ``name`` (a whole tensor at ``first_row`` 0), given in
        its storage dtype; a wrong dtype, shape or row range is an error, not a corrupt file.
        A tensor laid out with two row axes takes rows ``[n, ...]`` of its flattened first two
        axes (sequence b's rows start at ``b * shape[1]``)."""
        dtype, shape, offset, row, rows, axes = self.entries[name]
        a = np.ascontiguousarray(array)
        n = a.shape[0] if a.ndim else 1
        if a.dtype != SAFETENSORS_DTYPES[dtype] or tuple(a.shape[1:]) != shape[axes:] or \
                not 0 <= first_row <= rows - n:
            raise ValueError(f"StreamingGolden: {name} is {dtype} {list(shape)}; rows {first_row}.."
                             f"{first_row + n - 1} of {a.dtype} {list(a.shape)} do not fit it")
        data = memoryview(a.reshape(-1).view(np.uint8))
        pos = self.data_start + offset + first_row * row
        with disk_errors(self.tmp):
            while len(data):
                done = os.pwrite(self._fd, data, pos)
                data, pos = data[done:], pos + done
        self.rows_written[name] += n

    def copy_tensor(self, source: str, name: str, block: int = 1 << 24) -> None:
        """Tensor ``name`` as a copy of the already written ``source`` (same dtype and shape),
        ``block`` bytes at a time."""
        sdt, sshape, soff = self.entries[source][:3]
        dt, shape, off = self.entries[name][:3]
        if (sdt, sshape) != (dt, shape) or self.missing_rows(source):
            raise ValueError(f"StreamingGolden: cannot copy {source} ({sdt} {list(sshape)}) to "
                             f"{name} ({dt} {list(shape)})")
        size = math.prod(shape) * SAFETENSORS_DTYPES[dt].itemsize
        with disk_errors(self.tmp):
            for a in range(0, size, block):
                data = os.pread(self._fd, min(block, size - a), self.data_start + soff + a)
                os.pwrite(self._fd, data, self.data_start + off + a)
        self.rows_written[name] = self.entries[name][4]

    def missing_rows(self, name: str) -> int:
        return self.entries[name][4] - self.rows_written[name]

    def missing(self) -> list[str]:
        """Tensors not all of whose rows were written."""
        return [n for n, e in self.entries.items() if self.rows_written[n] < e[4]]

    def commit(self) -> None:
        """Check every tensor is complete, sync, and rename the file into place."""
        missing = self.missing()
        if missing:
            raise ValueError(f"StreamingGolden: {len(missing)} tensors incomplete, first {missing[0]}")
        self.sync()
        os.close(self._fd)
        self._fd = None
        try:
            with disk_errors(self.path):
                _publish(self.tmp, self.path, self.force)
        except BaseException:
            self.abort()
            raise
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def sync(self) -> None:
        """Make the rows written so far durable (a checkpoint that counts them comes after)."""
        with disk_errors(self.tmp):
            os.fsync(self._fd)

    def abort(self) -> None:
        """Close the file and remove it, unless :attr:`keep` (a checkpoint refers to it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self.keep and os.path.exists(self.tmp):
            os.unlink(self.tmp)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._fd is not None:
            self.abort()


# =========================================================================== the run and reading


@dataclass
class RunInfo:
    """How a golden was made: enough to rebuild its stack and replay it."""

    config: AttnConfig
    layers: tuple[int, ...]
    prefill: int
    decode: int
    capture: str
    seed: int | None = None
    preset: str = ""
    profile: str = "default"
    capture_rows: tuple[int, ...] = ()
    weights: dict | None = None     # where given weights came from (None: the generator's)
    inputs: dict | None = None      # where given inputs came from (None: the generator's)
    batch: int = 1                  # sequences in lockstep (docs/batches.md)
    rows: tuple[int, ...] | None = None      # the prefill rows answered (None: every one)

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata (str -> str) that makes the file self-describing; what
        :meth:`GoldenFile.run_info` reads back. ``weights`` and ``inputs`` appear only for a
        run whose weights or inputs were given (a checkpoint directory, an inputs file);
        ``batch`` and ``batch_inputs`` only for a batch of more than one sequence."""
        sources = {key: json.dumps(value, sort_keys=True) for key, value in
                   (("weights", self.weights), ("inputs", self.inputs)) if value is not None}
        if self.batch != 1:
            sources |= {"batch": str(self.batch), "batch_inputs": BATCH_INPUTS}
        return {**sources,
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "ds41numba_version": str(__version__),
            "config": json.dumps(self.config.to_dict()),
            "preset": self.preset,
            "layers": json.dumps(list(self.layers)),
            "prefill": str(self.prefill),
            "decode": str(self.decode),
            "seed": str(self.seed),
            "capture": self.capture,
            "profile": self.profile,
            "capture_rows": json.dumps([int(p) for p in self.capture_rows]),
            "generator": GENERATOR,
            "generator_spec": GENERATOR_SPEC,
        } | ({} if self.rows is None else {"rows": ranges_text(self.rows)})

    def row_positions(self, step: int) -> np.ndarray | None:
        """The positions of a step's rows the file holds when they are not all of them (a
        ``--rows`` golden's prefill), else None."""
        return None if step or self.rows is None else np.asarray(self.rows, np.int64)


class GoldenFile:
    """Read access to a golden: a ds41numba safetensors file or a reference ``.npz``.

    Tensors load one at a time on request, so comparing two large files never holds more than
    a pair of tensors. In an ``.npz`` the ``config`` string and the ``dtype.*`` notes are not
    tensors and are left out of :attr:`names`.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(8)
        except OSError as e:
            raise GoldenError(f"cannot read {self.path!r}: {e.strerror}") from None
        self.kind = "npz" if magic[:2] == b"PK" else "safetensors"
        self._stored = None     # the header's tensors, memory-mappable one by one (get_rows)
        try:
            if self.kind == "npz":
                self._npz = np.load(self.path, allow_pickle=False)
                self.names = [k for k in self._npz.files if k != "config" and not k.startswith("dtype.")]
                self.metadata = {}
                if "config" in self._npz.files:
                    self.metadata["config"] = str(self._npz["config"])
            else:
                self._st = safe_open(self.path, framework="np")
                self.names = list(self._st.keys())
                self.metadata = dict(self._st.metadata() or {})
        except GoldenError:
            raise
        except Exception as e:   # any parse failure of a foreign file is a usage error
            raise GoldenError(f"{self.path!r} is not a safetensors or .npz golden ({e})") from None
        self.names.sort(key=_natural_key)
        self._name_set = set(self.names)

    def __contains__(self, name):
        return name in self._name_set

    def get(self, name: str) -> np.ndarray:
        """One tensor, loaded now (a foreign dtype or a broken entry is a usage error)."""
        try:
            return self._npz[name] if self.kind == "npz" else self._st.get_tensor(name)
        except KeyError:
            raise
        except Exception as e:
            raise GoldenError(f"cannot read tensor {name} from {self.path!r}: {e}") from None

    def get_rows(self, name: str, take) -> np.ndarray:
        """Rows ``take`` (indices into the first axis) of one tensor, reading only those rows:
        comparing a few rows with a 1M-row golden must not load its 10 GB tensors whole."""
        take = np.asarray(take, np.int64)
        if self.kind == "npz":
            return self.get(name)[take]
        if self._stored is None:
            self._stored = read_header(self.path)
        return np.array(self._stored[name].array()[take])

    def close(self):
        if getattr(self, "_npz", None) is not None:
            self._npz.close()
        self._st = self._npz = self._stored = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run_info(self) -> RunInfo:
        """The run recorded in the file (metadata, or the reference ``config`` JSON of an npz)."""
        meta = self.metadata
        if self.kind == "safetensors" and meta.get("format") != FORMAT:
            raise GoldenError(f"{self.path!r} is not a {FORMAT} file (its metadata has no "
                              f"format {FORMAT!r}), so it cannot be replayed")
        if "config" not in meta:
            raise GoldenError(f"{self.path!r} has no config: not a golden this tool can replay")
        try:
            cfg_dict = json.loads(meta["config"])
            config = AttnConfig.from_dict(cfg_dict)
            profile, rows, batch, answered = "default", (), 1, None
            if self.kind == "npz":
                layers = tuple(range(config.n_layers))
                prefill, decode = int(cfg_dict["prefill"]), int(cfg_dict["decode"])
                capture, seed, name = "all", cfg_dict.get("seed"), ""
                sources = [None, None]
            else:
                if meta.get("format_version") not in READABLE_VERSIONS:
                    raise GoldenError(f"{self.path!r} has format version {meta.get('format_version')!r}; "
                                      f"this ds41numba reads {', '.join(READABLE_VERSIONS)}")
                layers = tuple(int(i) for i in json.loads(meta["layers"]))
                prefill, decode = int(meta["prefill"]), int(meta["decode"])
                capture, seed, name = meta["capture"], int(meta["seed"]), meta.get("preset", "")
                profile = meta.get("profile", "default")
                rows = tuple(int(p) for p in json.loads(meta.get("capture_rows", "[]")))
                sources = [json.loads(meta[k]) if k in meta else None for k in ("weights", "inputs")]
                batch = int(meta.get("batch", "1"))
                if batch < 1:
                    raise ValueError(f"batch {batch}")
                answered = None if "rows" not in meta else ranges_parsed(meta["rows"])
        except GoldenError:
            raise
        except (KeyError, ValueError, TypeError) as e:
            raise GoldenError(f"{self.path!r}: unusable run description in its metadata ({e})") from None
        if capture not in CAPTURE_MODES:
            raise GoldenError(f"{self.path!r}: unknown capture mode {capture!r}")
        if profile not in PROFILES:
            raise GoldenError(f"{self.path!r}: unknown generator profile {profile!r}")
        return RunInfo(config, layers, prefill, decode, capture, seed, name, profile, rows, *sources,
                       batch=batch, rows=answered)

    def step_info(self) -> RunInfo | None:
        """The run as far as the file describes it, for judging index rows (which config, which
        steps), or None: also for files of other formats that carry a ``config``, ``prefill``
        and ``decode`` (the reference's safetensors outputs), never an error."""
        try:
            return self.run_info()
        except GoldenError:
            pass
        try:
            meta = self.metadata
            cfg = AttnConfig.from_dict(json.loads(meta["config"]))
            layers = tuple(int(i) for i in json.loads(meta.get("layers", "null"))
                           or range(cfg.n_layers))
            return RunInfo(cfg, layers, int(meta["prefill"]), int(meta["decode"]), "io")
        except (KeyError, ValueError, TypeError):
            return None


def ranges_text(ids) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"`` (sorted ids; "" for none)."""
    return ",".join(str(a) if n == 1 else f"{a}-{a + n - 1}" for a, n in runs(ids))


def ranges_parsed(text: str) -> tuple[int, ...]:
    """The ids :func:`ranges_text` wrote."""
    out = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return tuple(out)


class BatchRowFile:
    """Sequence ``batch_row`` of a batch's golden (an open :class:`GoldenFile`, or any file
    with its layout) read as a single sequence's: the same names, every ``step{s}.layers.{i}.*``
    tensor (``[batch, ...]``) as its row ``batch_row``, the other tensors (the weights) as they
    are. What compare, replay and :mod:`ds41numba.testing` judge a batch's sequence by."""

    def __init__(self, golden: GoldenFile, batch_row: int):
        self.golden, self.batch_row = golden, int(batch_row)
        self.path, self.names, self.metadata = golden.path, golden.names, golden.metadata

    def __contains__(self, name):
        return name in self.golden

    def get(self, name: str) -> np.ndarray:
        a = self.golden.get(name)
        if not STEP_NAME.fullmatch(name):
            return a
        if a.ndim == 0 or a.shape[0] <= self.batch_row:
            raise GoldenError(f"{self.path!r}: {name} of shape {list(a.shape)} has no batch row "
                              f"{self.batch_row} (a batch's tensors are [batch, ...])")
        return np.ascontiguousarray(a[self.batch_row])

    def run_info(self) -> RunInfo:
        return replace(self.golden.run_info(), batch=1)

    def step_info(self) -> RunInfo | None:
        info = self.golden.step_info()
        return None if info is None else replace(info, batch=1)


def _natural_key(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def load_golden(path) -> tuple[RunInfo, dict[str, np.ndarray]]:
    """A whole golden at once (a ds41numba safetensors file or a reference ``.npz``): how it
    was made and every tensor, ``{name: array}`` as stored. For files that fit in memory; use
    :class:`GoldenFile` to read a large one a tensor at a time.

    Args:
        path: a ds41numba ``.safetensors`` golden or a reference ``.npz`` golden.

    Returns:
        ``(RunInfo, {name: array})``: the config, layers, prefill, decode, seed and capture of
        the run, and every tensor (BF16 as ``ml_dtypes.bfloat16``, I32 as int32, ...).

    Raises:
        GoldenError: the file cannot be read, or is not a golden.

    Example:
        >>> info, t = load_golden("ds41numba-golden-tiny.safetensors")
        >>> info.prefill, t["step0.layers.2.out"].shape
        (12, (12, 64))
    """
    with GoldenFile(path) as f:
        return f.run_info(), {name: f.get(name) for name in f.names}
