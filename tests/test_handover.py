"""Handing a layer's work and caches to a cluster's workers (ds41numba/golden/handover.py): an
object sent through a shared file loads as an equal object whose arrays are the file's pages,
writable, aligned and of numba's ordinary array type; the files go when dropped or closed."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numba
import numpy as np

from ds41numba import preset
from ds41numba.golden.generator import GeneratedWeights
from ds41numba.golden.handover import Broadcast, SharedFiles, SharedObject, received
from ds41numba.golden.tiles import CacheRows, LayerWork
from ds41numba.stack import AttnWeights


def _layer_work(layer=3):
    cfg = preset("mixed")
    weights = AttnWeights.from_mapping(cfg, layer, GeneratedWeights(cfg, [layer], seed=3))
    return LayerWork(cfg, layer, 40, 3, "default", (5, 9), weights, 1)


def _arrays(obj, prefix=""):
    """Every array an object holds, by its path of attributes (slots and dataclass fields)."""
    if isinstance(obj, np.ndarray):
        return {prefix: obj}
    names = getattr(obj, "__dataclass_fields__", None) or getattr(type(obj), "__slots__", ())
    found = {}
    for name in names:
        found.update(_arrays(getattr(obj, name, None), f"{prefix}.{name}"))
    return found


def test_weights_from_a_shared_file_equal_the_drivers(tmp_path):
    work = _layer_work()
    files = SharedFiles(str(tmp_path))
    handle = files.send(work)
    assert len(pickle.dumps(handle)) < 16_384                # the arrays are not in the handle
    got = pickle.loads(pickle.dumps(handle)).load()          # as a worker unpickles it
    want, have = _arrays(work.weights), _arrays(got.weights)
    assert len(want) > 12 and have.keys() == want.keys()   # a compressor and an indexer
    for name, a in want.items():
        b = have[name]
        assert type(b) is np.ndarray and b.dtype == a.dtype and b.shape == a.shape, name
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
        assert b.flags.writeable and b.flags.c_contiguous and b.ctypes.data % 64 == 0, name
        assert numba.typeof(b) == numba.typeof(a), name   # the kernels compiled for the driver's
    assert (got.config, got.layer, got.capture_rows) == (work.config, work.layer, work.capture_rows)
    assert handle.load() is got                              # loaded once per process
    files.drop(handle)
    assert os.listdir(files.dir) == []
    files.close()
    assert not os.path.exists(files.dir)


def test_cache_rows_from_a_shared_file_score_as_the_drivers(tmp_path):
    rng = np.random.default_rng(0)        # index keys are fp4 (e2m1) values, here of scale 1
    rows = (rng.choice([0, 0.5, 1, 1.5, 2, 3, 4, 6], (37, 64))
            * rng.choice([-1, 1], (37, 64))).astype(np.float32)
    files = SharedFiles(str(tmp_path))
    got = files.send(CacheRows(rows[:29])).load()
    assert np.array_equal(got.rows, rows[:29])
    assert np.array_equal(got.index_cache().keys, CacheRows(rows[:29]).index_cache().keys)
    files.close()


def test_another_process_maps_the_file_and_writes_only_its_own_copy(tmp_path):
    """A worker's writes stay its own (copy-on-write): the file, and so every other worker's
    arrays, keep the driver's values."""
    files = SharedFiles(str(tmp_path))
    handle = files.send({"a": np.arange(5000, dtype=np.float32), "small": 7})
    code = ("import pickle, sys; from ds41numba.golden.handover import received; "
            "o = received(pickle.loads(sys.stdin.buffer.read())); o['a'][:] = -1; "
            "print(float(o['a'].sum()), o['small'])")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(handle),
                         capture_output=True, check=True).stdout.decode().split()
    assert out == ["-5000.0", "7"]
    assert np.array_equal(SharedObject(handle.path, handle.meta, handle.spans).load()["a"],
                          np.arange(5000, dtype=np.float32))
    files.close()


def test_objects_without_arrays_and_what_is_not_a_handle(tmp_path):
    files = SharedFiles(str(tmp_path))
    assert files.send(None).load() is None
    assert files.send((1, "two")).load() == (1, "two")
    files.close()
    assert received(5) == 5 and received(None) is None


def test_an_object_of_empty_arrays_only_loads(tmp_path):
    """A cache of no rows yet (a ratio-128 layer before its first 128 tokens): its file holds
    no bytes, which cannot be mapped."""
    files = SharedFiles(str(tmp_path))
    sent = {"kv": np.empty((0, 512), np.float32), "idx": np.empty(0, np.int64)}
    got = files.send(sent).load()
    assert got.keys() == sent.keys()
    for name, a in sent.items():
        assert got[name].shape == a.shape and got[name].dtype == a.dtype
        assert got[name].flags.writeable
    files.close()


def test_the_broadcast_scatters_to_every_worker():
    class Client:
        def scatter(self, obj, broadcast, hash):
            self.called = (obj, broadcast, hash)
            return "future"

    client = Client()
    sent = Broadcast(client)
    assert sent.send("work") == "future" and client.called == ("work", True, False)
    sent.drop("future")
    sent.close()
