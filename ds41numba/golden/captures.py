"""What a layer's step records (the *captures*), and the storage dtypes a golden holds them in.

Tensor names are the reference goldens': ``layers.{i}.attn.NAME`` for parameters,
``step{s}.layers.{i}.WHAT`` for a step's input ``x`` and captures. ``io`` records ``out``,
``idx`` and ``shared.topk_idxs``; ``all`` adds ``q``, ``kv``, ``o``, ``index_score``, the other
``shared.*`` slots and the layer's ``state.*``. Every stored value is exactly the value computed.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from ..attention import index_rows
from ..config import AttnConfig

__all__ = ["CAPTURE_MODES", "STEP_NAME", "WEIGHT_NAME", "CHUNK", "forward_capture",
           "layer_captures", "storage_kind", "to_storage"]

BF16 = ml_dtypes.bfloat16
CHUNK = 1 << 22          # elements per piece when converting or comparing large tensors

#: What each capture mode records per step and layer (besides the input ``x``), in file order.
CAPTURE_MODES = {
    "io": ("out", "idx", "shared.topk_idxs"),
    "all": ("out", "q", "kv", "idx", "o", "index_score", "shared.compress_kv", "shared.index_k",
            "shared.topk_idxs", "shared.candidates", "state.window_kv", "state.kv_state",
            "state.score_state"),
}
#: Captures not stored as BF16 (the index tensors, and the compressor's f32 state).
_CAPTURE_STORAGE = {"idx": "I32", "shared.topk_idxs": "I32", "shared.candidates": "U8",
                    "state.kv_state": "F32", "state.score_state": "F32"}
_STORAGE_DTYPES = {"BF16": BF16, "F32": np.float32, "I32": np.int32, "U8": np.uint8}
STEP_NAME = re.compile(r"step(\d+)\.layers\.(\d+)\.(.+)")
WEIGHT_NAME = re.compile(r"layers\.(\d+)\.attn\.(.+)")


def _records_shared(config: AttnConfig, layer_id: int) -> bool:
    """The goldens record the shared slots after ratio > 0 layers that publish one of them."""
    c = config
    return c.ratio(layer_id) > 0 and (c.is_kv_source(layer_id) or c.is_index_source(layer_id)
                                      or c.is_candidate_source(layer_id))


#: Whether the goldens record the shared slots after a layer (a file laid out up front asks).
records_shared = _records_shared


def forward_capture(mode: str) -> bool:
    """``io`` runs the forward without capture: its q and o would be [seqlen, H, hd] each."""
    return mode == "all"


def layer_captures(stack, layer_id: int, run, start_pos: int, mode: str) -> dict[str, np.ndarray]:
    """The captures of one layer's step, ``{WHAT: array}``, as the reference goldens record them.

    Arrays may be views of the stack's live state: convert (copy) them before the next step.
    """
    c = stack.config
    wanted = CAPTURE_MODES[mode]
    seqlen = run.out.shape[0]
    end_pos = start_pos + seqlen
    r = c.ratio(layer_id)
    shared = stack.shared
    # Without capture the forward does not return idx: the helper attention_any builds it with
    # (index_rows) makes it again from the shared selection the layer read.
    got = {"out": run.out, "idx": run.idx if run.idx is not None else index_rows(
        start_pos, seqlen, c.window_size, shared.topk_idxs if r else None)}
    if mode == "all":
        got.update(q=run.q, kv=run.kv_rows, o=run.o)
        if run.index_score is not None:
            got["index_score"] = run.index_score
    if _records_shared(c, layer_id):
        if shared.topk_idxs is not None:
            got["shared.topk_idxs"] = shared.topk_idxs
        if mode == "all":
            if shared.compress_kv is not None:
                got["shared.compress_kv"] = shared.compress_kv[: end_pos // r]
            if shared.index_k is not None:
                got["shared.index_k"] = shared.index_k.keys[: end_pos // r]
            cands = shared.candidates
            if cands is not None:
                got["shared.candidates"] = cands
    if mode == "all":
        state = stack.states[layer_id]
        got["state.window_kv"] = state.window_kv
        if state.kv_state is not None:
            got["state.kv_state"] = state.kv_state
            got["state.score_state"] = state.score_state
    return {k: got[k] for k in wanted if k in got}


def storage_kind(name: str, weight_kinds: dict | None = None) -> str:
    """The safetensors dtype a tensor is stored in: "BF16", "F32", "I32" or "U8".

    ``weight_kinds`` maps parameter names to their :func:`weight_specs` kind ("bf16" | "f32").
    """
    m = STEP_NAME.fullmatch(name)
    if m:
        return _CAPTURE_STORAGE.get(m.group(3), "BF16")
    if weight_kinds is not None and name in weight_kinds:
        return "F32" if weight_kinds[name] == "f32" else "BF16"
    raise ValueError(f"storage_kind: unknown tensor {name!r}")


def to_storage(name: str, array, kind: str) -> np.ndarray:
    """A new array holding ``array`` in the storage dtype ``kind``; refuses to change a value.

    The stack's arrays are float32 (bf16 values where the reference holds bf16) and int32 or
    bool: storing them must be exact, or a golden would record something that was not computed.
    """
    a = np.asarray(array)
    dtype = _STORAGE_DTYPES[kind]
    if kind in ("I32", "U8"):
        out = np.array(a, dtype=dtype, copy=True)
        if not np.array_equal(out, a):
            raise ValueError(f"{name}: values do not fit {kind}")
        return out
    a = np.asarray(a, dtype=np.float32)
    if kind == "F32":
        return np.array(a, copy=True)
    out = a.astype(BF16)
    if not _bf16_exact(a, out):
        raise ValueError(f"{name}: holds values that are not bf16 (it would be rounded on storage)")
    return out


def _bf16_exact(a32: np.ndarray, a16: np.ndarray, chunk: int = CHUNK) -> bool:
    """True when the bf16 copy converts back to the same float32 (NaN to NaN, any payload)."""
    f, h = a32.reshape(-1), a16.reshape(-1)
    for lo in range(0, f.size, chunk):
        back, part = h[lo:lo + chunk].astype(np.float32), f[lo:lo + chunk]
        same = back.view(np.uint32) == part.view(np.uint32)
        if not same.all() and not (same | (np.isnan(back) & np.isnan(part))).all():
            return False
    return True


