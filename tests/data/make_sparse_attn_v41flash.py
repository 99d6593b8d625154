"""How tests/data/sparse_attn_v41flash.npz was made (kept for the record; its inputs are not in the repo).

For a few of the sampled prefill query rows of the reference's production-dimension goldens
(v41flash_L20_ref.safetensors layer 20, v41flash_kv_sources_ref.safetensors layer 2, in the directory
``DS41_REFERENCE_GOLDENS`` names),
everything sparse_attn needs and the reference's output, as bf16 bit patterns (uint16, the goldens' own
bytes):
* q, o: ``step0.layers.{L}.sample.q`` / ``sample.o`` rows, unchanged.
* idx: ``step0.layers.{L}.idx`` at ``sample.rows``, unchanged, then remapped onto the stored rows
  (``rows`` holds each stored row's id in the layer's KV rows: window rows 0 .. P-1, then compressed).
* kv: the compressed rows are the golden's ``step0.layers.{L}.shared.compress_kv``. The prefill's window rows
  are not in the golden (only its last 128, in ``state.window_kv``): they are ds41numba's own, dumped from a
  run of the same generator inputs (``attn_npz``), and checked here against the golden's window ring.
* sink: ``layers.{L}.attn.attn_sink`` of ds41numba's generator (the reference ran on the same weights),
  remade here with ``make_tensor``.
Run:  DS41_REFERENCE_GOLDENS=DIR PYTHONPATH=. python tests/data/make_sparse_attn_v41flash.py L20_NPZ L2_NPZ
"""
import json
import os
import sys

import ml_dtypes
import numpy as np
from safetensors import safe_open

from ds41numba.golden import make_tensor, weight_distribution

G = os.environ.get("DS41_REFERENCE_GOLDENS", ".")
SOURCES = [("L20", os.path.join(G, "v41flash_L20_ref.safetensors"), 20, [1, 3, 4, 15]),
           ("L2", os.path.join(G, "v41flash_kv_sources_ref.safetensors"), 2, [1, 4, 9, 15])]


def bits(a):
    a = np.asarray(a, np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    assert np.array_equal(b.astype(np.float32).view(np.uint32), a.view(np.uint32)), "not bf16 values"
    return b.view(np.uint16)


def main(npz_paths):
    out, notes = {}, {}
    for (name, path, L, picks), npz in zip(SOURCES, npz_paths):
        f = safe_open(path, "np")
        meta = f.metadata()
        seed, P = int(meta["seed"]), int(meta["prefill"])
        pre = f"step0.layers.{L}."
        sample_rows = f.get_tensor(pre + "sample.rows")
        q = f.get_tensor(pre + "sample.q")[picks]
        o = f.get_tensor(pre + "sample.o")[picks]
        idx = f.get_tensor(pre + "idx")[sample_rows[picks]]
        ck = f.get_tensor(pre + "shared.compress_kv").astype(np.float32)
        ring = f.get_tensor(pre + "state.window_kv").astype(np.float32)
        d = np.load(npz)
        assert np.array_equal(d["rows"], sample_rows)
        window = d["kv"][:P]
        win = ring.shape[0]
        assert np.array_equal(window[P - win:][np.argsort(np.arange(P - win, P) % win)], ring), "window rows"
        kv = np.concatenate([window, ck])
        shape = (q.shape[1],)
        sink = make_tensor(f"layers.{L}.attn.attn_sink", shape, seed,
                           *weight_distribution(f"layers.{L}.attn.attn_sink", shape), bf16=False)
        assert np.array_equal(sink, d["sink"])
        used = np.unique(idx[idx >= 0])
        remap = np.full(len(kv), -1, np.int64)
        remap[used] = np.arange(len(used))
        out[f"{name}.q"] = q.view(np.uint16)
        out[f"{name}.o"] = o.view(np.uint16)
        out[f"{name}.idx"] = np.where(idx >= 0, remap[np.maximum(idx, 0)], -1).astype(np.int32)
        out[f"{name}.rows"] = used.astype(np.int32)
        out[f"{name}.kv"] = bits(kv[used])
        out[f"{name}.sink"] = sink
        notes[name] = dict(golden=path.rsplit("/", 1)[-1], layer=L, sample_picks=picks,
                           query_rows=sample_rows[picks].tolist(), window_rows=P, seed=seed)
    out["provenance"] = np.array(json.dumps(notes))
    np.savez_compressed("tests/data/sparse_attn_v41flash.npz", **out)


if __name__ == "__main__":
    main(sys.argv[1:3])
