"""Results must not depend on the thread count: numba's or BLAS's.

Each configuration runs in its own process (thread counts are fixed at start-up) and prints a
digest of every output, capture and shared slot of the mixed golden's replay.
"""

import os
import subprocess
import sys

SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from ds41numba import AttentionStack, AttnConfig

d = np.load(sys.argv[1])
files = set(d.files)
cfg_dict = json.loads(str(d["config"]))
cfg = AttnConfig.from_dict(cfg_dict)
stack = AttentionStack(cfg, {k: d[k] for k in files if k.startswith("layers.")})
h = hashlib.sha256()
for s in range(1 + min(cfg_dict["decode"], 12)):
    start = 0 if s == 0 else cfg_dict["prefill"] + s - 1
    for i in range(cfg.n_layers):
        run = stack.forward(i, d[f"step{s}.layers.{i}.x"], start, capture=True)
        for a in (run.out, run.q, run.kv_rows, run.idx, run.o, run.index_score,
                  stack.shared.topk_idxs, stack.shared.candidates):
            if a is not None:
                h.update(np.ascontiguousarray(a).tobytes())
print(h.hexdigest())
"""

DATA = os.path.join(os.path.dirname(__file__), "data", "mixed.npz")


def digest(numba_threads, blas_threads, bf16_dot="1"):
    env = dict(os.environ, NUMBA_NUM_THREADS=str(numba_threads),
               OPENBLAS_NUM_THREADS=str(blas_threads), OMP_NUM_THREADS=str(blas_threads),
               DS41NUMBA_BF16_DOT=bf16_dot)
    out = subprocess.run([sys.executable, "-c", SCRIPT, DATA], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_outputs_do_not_depend_on_thread_counts():
    one = digest(1, 1)
    assert len(one) == 64
    assert digest(2, 2) == one
    assert digest(2, 1) == one
    assert digest(1, 2) == one
    # Without AVX512-BF16 the products run on numpy's f32 BLAS: thread-independent as well.
    blas = digest(1, 1, bf16_dot="0")
    assert digest(2, 2, bf16_dot="0") == blas
