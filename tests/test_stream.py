"""Streamed goldens (``--capture io``): the file laid out up front and filled a chunk at a
time is a standard safetensors file, tensor for tensor what the in-memory run computes, and
byte-identical whatever the chunk size or thread count."""

import hashlib
import os
import subprocess
import sys

import ml_dtypes  # noqa: F401
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from ds41numba import preset
from ds41numba.golden import GoldenPlan, make_input, run_golden, stream_golden, write_golden


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("name, prefill, decode", [("tiny", 12, 5), ("mixed", 203, 4), ("tiny", 1, 3)])
def test_streamed_golden_is_the_in_memory_run(tmp_path, name, prefill, decode):
    plan = GoldenPlan(preset(name), tuple(range(preset(name).n_layers)), prefill, decode,
                      seed=3, capture="io", preset=name)
    want = run_golden(plan)
    digests = set()
    for chunk in (None, 1, 5, 64):
        path = tmp_path / f"g{chunk}.safetensors"
        stream_golden(plan, path, chunk=chunk)
        got = load_file(str(path))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert got[k].tobytes() == want[k].tobytes(), k
        with safe_open(str(path), framework="np") as f:
            assert f.metadata() == plan.metadata()
        digests.add(sha(path))
    assert len(digests) == 1


def test_inputs_by_rows_are_slices_of_the_whole():
    whole = make_input("step0.layers.3.x", (50, 24), seed=9)
    for a, b in ((0, 1), (7, 20), (49, 50)):
        assert make_input("step0.layers.3.x", (b - a, 24), 9, first_row=a).tobytes() == whole[a:b].tobytes()


SCRIPT = r"""
import sys
from ds41numba import preset
from ds41numba.golden import GoldenPlan, write_golden
plan = GoldenPlan(preset("mixed"), tuple(range(preset("mixed").n_layers)), 203, 3, capture="io",
                  preset="mixed")
write_golden(plan, sys.argv[1], chunk=int(sys.argv[2]))
"""


def test_streamed_file_does_not_depend_on_threads_or_chunks(tmp_path):
    digests = set()
    for threads, chunk in ((1, 7), (2, 4096), (2, 50)):
        path = tmp_path / f"g{threads}_{chunk}.safetensors"
        env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), str(chunk)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        digests.add(sha(path))
    assert len(digests) == 1
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
