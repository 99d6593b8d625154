"""Checkpoints of a streamed golden run, so that an interrupted run (Ctrl-C, SIGTERM,
``kill -9``, a power cut, a full disk) continues where it stopped (``--resume``) instead of
redoing hours of work, and still gives the uninterrupted run's file byte for byte.

Beside the target ``NAME`` a streamed run keeps

* ``.NAME.partial``: the golden being filled (:class:`~.files.StreamingGolden`), renamed to
  ``NAME`` when complete;
* ``.NAME.ckpt/``: the checkpoint, ``record.pkl`` and one ``KEY.rows`` file per cache.

The record holds the run's identity (its metadata and ``--chunk``: a resume with other
arguments is refused, naming what differs), how far the run got (the pieces of
:func:`~.run.run_pieces` done), the writer's rows-written counts, and the stack's snapshot
(:meth:`AttentionStack.snapshot`) and observer pickled *without* the caches. A kv source's
compressed cache and a key owner's index keys are preallocated for ``max_seq_len`` (hundreds of
MB each at v41-flash) and mostly unfilled, and their filled rows never change once written, so
each checkpoint appends to ``KEY.rows`` only the rows filled since the previous one; the record
says how many rows count, and a resume ignores anything past that.

Crash safety is by order: a checkpoint syncs the partial file (every row written so far), then
appends and syncs the cache rows, then replaces the record atomically (a temporary file,
fsync, rename, fsync of the directory). A crash anywhere leaves a complete previous record all
of whose rows are on disk; rows past it (in the partial file, or a cache file) are rewritten or
ignored on resume. The record is a pickle: it is this tool's own file beside the user's output,
read back only by ``--resume`` of the same target.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import time

import numpy as np

from ..indexer import IndexKeyCache
from .errors import DiskError, GoldenError, disk_errors
from .files import fsync_dir

__all__ = ["CHECKPOINT_EVERY", "RECORD_VERSION", "partial_path", "checkpoint_dir", "Checkpoint",
           "run_identity", "identity_differences"]

#: Seconds of work between two checkpoints (``--checkpoint-every``): a resume redoes at most
#: about this much, and a checkpoint (a few MB appended, a small record) costs well under a
#: second at v41-flash shapes. 0 checkpoints at every chunk and decode step.
CHECKPOINT_EVERY = 60.0
RECORD_VERSION = 1
_RECORD = "record.pkl"

#: The command-line flag behind each identity key, to say what differs.
_FLAGS = {"config": "the config (--preset/--config)", "preset": "--preset", "layers": "--layers",
          "prefill": "--prefill", "decode": "--decode", "seed": "--seed", "capture": "--capture",
          "profile": "--profile", "capture_rows": "--capture-rows", "chunk": "--chunk",
          "schedule": "--workers/--scheduler", "weights": "--weights (or --no-weights)",
          "inputs": "--inputs"}


def partial_path(path: str) -> str:
    """``DIR/.NAME.partial``: the file a streamed run fills before it is complete."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.partial")


def checkpoint_dir(path: str) -> str:
    """``DIR/.NAME.ckpt``: the checkpoint of the run filling ``partial_path(path)``."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.ckpt")


def run_identity(metadata: dict[str, str], chunk: int | None,
                 schedule: str | None = None) -> dict[str, str]:
    """What a resumed run must share with the interrupted one: the file's metadata (config, run,
    generator, version), the chunk size and the schedule (what the pieces a checkpoint counts
    are: None for one process, ``"tiles"`` on a cluster, whichever and however many workers)."""
    identity = {**metadata, "chunk": str(chunk)}
    if schedule is not None:
        identity["schedule"] = schedule
    return identity


def identity_differences(then: dict[str, str], now: dict[str, str]) -> list[str]:
    """One phrase per key that differs, in the command line's words."""
    out = []
    for key in sorted(set(then) | set(now)):
        a, b = then.get(key), now.get(key)
        if a == b:
            continue
        flag = _FLAGS.get(key, key)
        if key == "config" or len(f"{a}{b}") > 60:
            out.append(flag)
        else:
            out.append(f"{flag} ({_shown(a)} then, {_shown(b)} now)")
    return out


def _shown(value) -> str:
    if value is None:
        return "unset"
    try:
        return json.dumps(json.loads(value)) if value[:1] == "[" else value
    except ValueError:
        return value


def _caches(stack) -> dict[str, tuple[object, np.ndarray, int]]:
    """The stack's preallocated caches, ``{key: (object, rows array, rows filled)}``: each kv
    source's compressed cache and each key owner's index keys (an IndexKeyCache, whose packed
    copy is rebuilt from the keys on restore). A layer at ``end_pos`` has filled
    ``end_pos // ratio`` rows of both. A batch's sequence b > 0 has its own, keyed ``b{b}.``."""
    out = {}
    for b, seq in enumerate(stack.sequences):
        pre = f"b{b}." if b else ""
        for i, st in seq.states.items():
            r = seq.config.ratio(i)
            if st.compress_cache is not None:
                out[f"{pre}compress.{i}"] = (st.compress_cache, st.compress_cache, st.end_pos // r)
            if st.index_cache is not None:
                out[f"{pre}index.{i}"] = (st.index_cache, st.index_cache.keys, st.end_pos // r)
    return out


class _CachePickler(pickle.Pickler):
    """Pickles everything but the caches, which become references by key."""

    def __init__(self, file, caches: dict):
        super().__init__(file, protocol=5)
        self._keys = {id(obj): key for key, (obj, _, _) in caches.items()}

    def persistent_id(self, obj):
        return self._keys.get(id(obj))


class _CacheUnpickler(pickle.Unpickler):
    """Unpickles a record's state, the caches read back (once each) by ``load(key)``."""

    def __init__(self, file, load):
        super().__init__(file)
        self._load, self._got = load, {}

    def persistent_load(self, key):
        if key not in self._got:
            self._got[key] = self._load(key)
        return self._got[key]


class Checkpoint:
    """The checkpoint of one streamed run at ``path`` (see the module docstring).

    Made at the start of the run: without ``resume`` it refuses an earlier run's leftovers
    (unless ``force``, which discards them); with ``resume`` it loads the record and refuses
    one of another run (``identity``). :meth:`due` says whether ``every`` seconds passed since
    the last checkpoint, :meth:`save` takes one, :meth:`restore` puts a loaded one into a stack,
    :meth:`remove` deletes it once the golden is complete.
    """

    def __init__(self, path: str, identity: dict[str, str], resume: bool = False,
                 force: bool = False, every: float = CHECKPOINT_EVERY):
        if isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 0:
            raise GoldenError(f"--checkpoint-every must be a number of seconds >= 0, got {every!r}")
        self.path, self.identity, self.every = os.fspath(path), identity, float(every)
        self.partial, self.dir = partial_path(self.path), checkpoint_dir(self.path)
        self.record: dict | None = None
        self.extra: dict | None = None           # what the driver saved beside the stack
        self._rows: dict[str, int] = {}          # rows of each cache file the record counts
        self._last = time.monotonic()
        if resume:
            self._load()
        else:
            self._start(force)

    # ------------------------------------------------------------------ starting

    def _start(self, force: bool):
        left = [p for p in (self.partial, self.dir) if os.path.lexists(p)]
        if left and not force:
            raise GoldenError(f"--out: an interrupted run of {self.path!r} left "
                              f"{' and '.join(map(repr, left))}: rerun with --resume to continue "
                              f"it, or --force to start over")
        self.discard()

    def discard(self):
        """Remove the partial file and the checkpoint (``--force``, or a run that ended before
        its first checkpoint)."""
        with disk_errors(self.dir, "remove"):
            if os.path.lexists(self.partial):
                os.unlink(self.partial)
            if os.path.isdir(self.dir):
                shutil.rmtree(self.dir)

    def _load(self):
        record = os.path.join(self.dir, _RECORD)
        if not os.path.exists(record):
            if os.path.exists(self.partial):
                raise GoldenError(f"--resume: {self.partial!r} has no checkpoint (the run stopped "
                                  f"before its first one): use --force to start over")
            raise GoldenError(f"--resume: nothing to resume for {self.path!r} (no checkpoint "
                              f"{self.dir!r}): run without --resume to start")
        try:
            with open(record, "rb") as f:
                self.record = pickle.load(f)
            version = self.record["version"]
        except OSError as e:
            raise DiskError("read", record, e) from None
        except Exception as e:     # a damaged record is the file's fault, not a bug
            raise GoldenError(f"--resume: the checkpoint {record!r} is unreadable ({e}): use "
                              f"--force to start over") from None
        if version != RECORD_VERSION:
            raise GoldenError(f"--resume: the checkpoint {record!r} has version {version}, this "
                              f"ds41numba writes {RECORD_VERSION}: use --force to start over")
        differs = identity_differences(self.record["identity"], self.identity)
        if differs:
            raise GoldenError(f"--resume: this run differs from the interrupted one in "
                              f"{', '.join(differs)}: give the same arguments, or --force to "
                              f"start over")
        if not os.path.isfile(self.partial):
            raise GoldenError(f"--resume: the checkpoint's partial file {self.partial!r} is "
                              f"missing: use --force to start over")
        self._rows = {k: v[3] for k, v in self.record["caches"].items()}

    # ------------------------------------------------------------------ state

    @property
    def saved(self) -> bool:
        """Whether a record is on disk (the partial file must then be kept)."""
        return self.record is not None

    @property
    def done(self) -> int:
        """Pieces of the run the record has done (0 without one)."""
        return 0 if self.record is None else self.record["done"]

    @property
    def where(self) -> str:
        """What the record has done, for messages."""
        return "nothing yet" if self.record is None else self.record["where"]

    def rows_written(self) -> dict | None:
        """The writer's rows-written counts the record holds (None: a new run)."""
        return None if self.record is None else dict(self.record["rows_written"])

    def due(self) -> bool:
        return time.monotonic() - self._last >= self.every

    # ------------------------------------------------------------------ saving

    def save(self, done: int, where: str, stack, observer, writer, extra: dict | None = None) -> None:
        """A checkpoint after ``done`` pieces (``where`` says which, for messages): sync the
        partial file, append the caches' new rows, then replace the record atomically.
        ``extra``: what else the driver needs to continue (pickled with the stack, so references
        to its caches stay references), back as :attr:`extra` after :meth:`restore`."""
        writer.sync()
        caches = _caches(stack)
        with disk_errors(self.dir):
            if not os.path.isdir(self.dir):
                os.mkdir(self.dir)        # not makedirs: a removed --out directory stays removed
            for key, (_, rows, n) in caches.items():
                self._append(key, rows, n)
            buf = io.BytesIO()
            _CachePickler(buf, caches).dump({"stack": stack.snapshot(), "observer": observer,
                                             "extra": extra})
            record = {"version": RECORD_VERSION, "identity": self.identity, "done": done,
                      "where": where, "rows_written": dict(writer.rows_written),
                      "caches": {k: (type(obj).__name__, rows.shape, rows.dtype.str, n)
                                 for k, (obj, rows, n) in caches.items()},
                      "state": buf.getvalue()}
            self._replace_record(pickle.dumps(record, protocol=5))
        self.record = record
        self._rows = {k: n for k, (_, _, n) in caches.items()}
        self._last = time.monotonic()

    def _append(self, key: str, rows: np.ndarray, n: int):
        """Rows ``m .. n - 1`` of a cache into ``KEY.rows`` (m: the rows the record counts),
        cutting whatever an interrupted checkpoint left past them, and sync."""
        m = self._rows.get(key, 0)
        m = 0 if m > n else m            # a cache that started over (never in one run)
        row = rows[0].nbytes if rows.shape[0] else 0
        fd = os.open(os.path.join(self.dir, f"{key}.rows"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            data = memoryview(np.ascontiguousarray(rows[m:n]).reshape(-1).view(np.uint8))
            pos = m * row
            while len(data):
                k = os.pwrite(fd, data, pos)
                data, pos = data[k:], pos + k
            os.ftruncate(fd, n * row)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _replace_record(self, data: bytes):
        tmp = os.path.join(self.dir, _RECORD + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(data)
            while len(view):
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.dir, _RECORD))
        fsync_dir(self.dir)

    # ------------------------------------------------------------------ restoring

    def restore(self, stack):
        """Put the record's state into ``stack`` (built with the run's weights); returns the
        observer it held (None without a record)."""
        if self.record is None:
            return None
        with disk_errors(self.dir, "read"):
            state = _CacheUnpickler(io.BytesIO(self.record["state"]), self._read_cache).load()
        stack.restore(state["stack"])
        self.extra = state.get("extra")
        return state["observer"]

    def _read_cache(self, key: str):
        kind, shape, dtype, n = self.record["caches"][key]
        rows = np.zeros(shape, np.dtype(dtype))
        want = n * (rows[0].nbytes if shape[0] else 0)
        path = os.path.join(self.dir, f"{key}.rows")
        with open(path, "rb") as f:
            got = f.readinto(memoryview(rows.reshape(-1).view(np.uint8))[:want])
        if got != want:
            raise GoldenError(f"--resume: the checkpoint's {path!r} holds {got} of its {want} "
                              f"bytes: use --force to start over")
        return IndexKeyCache(rows, packed_rows=n) if kind == "IndexKeyCache" else rows

    def remove(self) -> None:
        """Delete the checkpoint of a completed golden (best effort: the golden is written, and
        a later run at this target refuses or, with --force, discards what is left)."""
        try:
            shutil.rmtree(self.dir)
        except OSError:
            pass
