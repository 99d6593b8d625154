"""The layer stack: per-layer weights and state, the runtime layers share, and the driver.

In V4.1 a compressed-attention layer rarely works alone. A *kv source* owns the compressed
KV cache that the following layers of its ratio read; an *index source* runs the indexer and
publishes the top-k selection that the following layers reuse; a *key owner* (an index source
that is also a kv source) writes the index keys the later index sources score against; the
*candidate source* publishes block candidates that later index sources are restricted to.
:class:`SharedRuntime` holds those four slots, :class:`LayerAttnState` what one layer carries
from step to step, and :class:`AttentionStack` runs them, its :class:`StepOrder` checking that
a caller runs them in an order the reference could have run them in. Which layers a layer reads
is the config's (:meth:`AttnConfig.sources_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ml_dtypes import bfloat16 as BF16

from .attention import CompAttnRun, attention_any
from .batch import SINGLE, BatchRow, checked_batch
from .compressor import CompressorState, CompressorWeights
from .config import FALLBACK_KEY_OWNER, AttnConfig
from .indexer import IndexerWeights, IndexKeyCache, candidate_mask
from .numerics import Bf16Matrix, F32Matrix, SharedInput, bf16_halves, is_bf16_valued, is_int
from .step_order import StepOrder

__all__ = ["AttnWeights", "LayerAttnState", "SharedRuntime", "AttentionStack", "StepOrder",
           "weight_specs", "held_weight_bytes"]


def weight_specs(config: AttnConfig, layer_id: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every parameter of layer ``layer_id``: ``{"layers.{i}.attn.NAME": (shape, "bf16" | "f32")}``.

    "bf16" means a float32 array holding bf16 values; "f32" a genuine float32 parameter.
    """
    c = config
    H, hd, G = c.n_heads, c.head_dim, c.o_groups
    r = c.ratio(layer_id)
    spec = {
        "attn_sink": ((H,), "f32"),
        "wq_a.weight": ((c.q_lora_rank, c.dim), "bf16"),
        "q_norm.weight": ((c.q_lora_rank,), "bf16"),
        "wq_b.weight": ((H * hd, c.q_lora_rank), "bf16"),
        "wkv.weight": ((hd, c.dim), "bf16"),
        "kv_norm.weight": ((hd,), "bf16"),
        "wo_a.weight": ((G * c.o_lora_rank, H * hd // G), "bf16"),
        "wo_b.weight": ((c.dim, G * c.o_lora_rank), "bf16"),
    }
    if c.is_kv_source(layer_id):
        spec["compressor.wkv.weight"] = ((hd, c.dim), "f32" if r > 1 else "bf16")
        if r > 1:
            spec["compressor.wgate.weight"] = ((hd, c.dim), "f32")
        spec["compressor.norm.weight"] = ((hd,), "bf16")
    if c.is_index_source(layer_id):
        spec["indexer.wq_b.weight"] = ((c.index_n_heads * c.index_head_dim, c.q_lora_rank), "bf16")
        spec["indexer.weights_proj.weight"] = ((c.index_n_heads, c.dim), "bf16")
        if c.is_kv_source(layer_id):
            spec["indexer.wk.weight"] = ((c.index_head_dim, hd), "bf16")
            spec["indexer.k_norm.weight"] = ((c.index_head_dim,), "bf16")
    return {f"layers.{layer_id}.attn.{name}": v for name, v in spec.items()}


def held_weight_bytes(config: AttnConfig, layers) -> int:
    """Bytes the parameters of ``layers`` take once an :class:`AttentionStack` holds them
    (:meth:`AttentionStack.weight_bytes`), from the shapes alone: for checking that a run fits
    in memory before making any weight."""
    total = 0
    for i in layers:
        for full, (shape, kind) in weight_specs(config, i).items():
            if len(shape) == 1:
                total += 4 * shape[0]
            elif kind == "bf16":
                groups = config.o_groups if full.endswith(".attn.wo_a.weight") else 1
                total += Bf16Matrix.held_bytes(shape, groups)
            else:
                total += F32Matrix.held_bytes(shape)
    return total


def _checked_weight(name: str, array, shape: tuple[int, ...], kind: str, groups: int = 1):
    """One parameter checked and in the form it is held in: a :class:`Bf16Matrix` (a bf16
    projection: 2 bytes a parameter), an :class:`F32Matrix` (the ratio > 1 compressor's f32
    projections) or a float32 vector (norms, the sink). Nothing of ``array`` is kept beyond
    that, so a mapping that makes each tensor on request has one alive at a time."""
    if array is None:
        raise ValueError(f"weights: {name} is missing (expected shape {shape})")
    a = np.asarray(array)
    bf16 = a.dtype.name == "bfloat16"
    if not (np.issubdtype(a.dtype, np.floating) or bf16):
        raise ValueError(f"weights: {name} has dtype {a.dtype}, expected a float array")
    if a.shape != shape:
        raise ValueError(f"weights: {name} has shape {a.shape}, expected {shape}")
    if kind == "bf16" and a.ndim == 2 and bf16:     # bf16 already: nothing to check or widen
        return Bf16Matrix(a, groups=groups)
    a = np.ascontiguousarray(a, dtype=np.float32)
    # A projection's check and its bit patterns in one pass on every core; a NaN (or a value
    # that is not bf16, for the error below) takes the slower way.
    bits = bf16_halves(a) if kind == "bf16" and a.ndim == 2 else None
    if bits is not None:
        return Bf16Matrix(bits.view(BF16), groups=groups)
    if kind == "bf16" and not is_bf16_valued(a):
        raise ValueError(f"weights: {name} must hold bf16 values (round it to bfloat16 first)")
    if a.ndim == 1:
        return a
    return Bf16Matrix(a, groups=groups) if kind == "bf16" else F32Matrix(a)


# The projections that read one input, by that input: a decode step runs each set as one call.
# (The query latent's two, ``wq_b`` and the indexer's, do not share a call: ``wq_b`` is read
# beside the indexer's work, which needs the indexer's own first; attention.linear_bf16_beside.)
_SHARED_INPUTS = {"x": ("wkv.weight", "compressor.wkv.weight", "wq_a.weight",
                        "indexer.weights_proj.weight")}


def _share_inputs(got: dict) -> None:
    """Each set of a layer's bf16 projections that read the same input (``_SHARED_INPUTS``;
    the layer's parameters as held, by name) made a :class:`SharedInput`."""
    for names in _SHARED_INPUTS.values():
        members = [got[n] for n in names if isinstance(got.get(n), Bf16Matrix)]
        if len(members) > 1:
            SharedInput(members)


@dataclass
class AttnWeights:
    """One layer's attention parameters: float32 arrays (norms, the sink), :class:`Bf16Matrix`
    projections and, for a ratio > 1 compressor, :class:`F32Matrix` ones; ``wo_a`` is grouped
    (``o_groups``)."""

    attn_sink: np.ndarray
    wq_a: Bf16Matrix
    q_norm: np.ndarray
    wq_b: Bf16Matrix
    wkv: Bf16Matrix
    kv_norm: np.ndarray
    wo_a: Bf16Matrix
    wo_b: Bf16Matrix
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None

    @classmethod
    def from_mapping(cls, config: AttnConfig, layer_id: int, weights) -> "AttnWeights":
        """Pick and check layer ``layer_id``'s parameters out of ``{"layers.{i}.attn.NAME": array}``.

        Each is asked for once (``weights.get``), checked and wrapped before the next is asked
        for; a mapping may make them on request (float32 holding bf16 values, or
        ``ml_dtypes.bfloat16`` for the bf16 ones)."""
        prefix = f"layers.{layer_id}.attn."
        got = {}
        for full, (shape, kind) in weight_specs(config, layer_id).items():
            name = full[len(prefix):]
            # wo_a is grouped: o_groups independent projections.
            groups = config.o_groups if name == "wo_a.weight" else 1
            got[name] = _checked_weight(full, weights.get(full), shape, kind, groups)
        comp = idx = None
        if "compressor.norm.weight" in got:
            comp = CompressorWeights(wkv=got["compressor.wkv.weight"],
                                     wgate=got.get("compressor.wgate.weight"),
                                     norm=got["compressor.norm.weight"])
        if "indexer.wq_b.weight" in got:
            idx = IndexerWeights(wq_b=got["indexer.wq_b.weight"],
                                 weights_proj=got["indexer.weights_proj.weight"],
                                 wk=got.get("indexer.wk.weight"),
                                 k_norm=got.get("indexer.k_norm.weight"))
        _share_inputs(got)
        return cls(attn_sink=got["attn_sink"], wq_a=got["wq_a.weight"], q_norm=got["q_norm.weight"],
                   wq_b=got["wq_b.weight"], wkv=got["wkv.weight"], kv_norm=got["kv_norm.weight"],
                   wo_a=got["wo_a.weight"], wo_b=got["wo_b.weight"], compressor=comp, indexer=idx)

    def parameters(self) -> list:
        """Every parameter this layer holds (arrays and projections), the compressor's and the
        indexer's included."""
        parts = [self.attn_sink, self.wq_a, self.q_norm, self.wq_b, self.wkv, self.kv_norm,
                 self.wo_a, self.wo_b]
        if self.compressor is not None:
            parts += [self.compressor.wkv, self.compressor.wgate, self.compressor.norm]
        if self.indexer is not None:
            parts += [self.indexer.wq_b, self.indexer.weights_proj, self.indexer.wk,
                      self.indexer.k_norm]
        return [p for p in parts if p is not None]

    def nbytes(self) -> int:
        """Bytes this layer's parameters hold (see :meth:`AttentionStack.weight_bytes`)."""
        return sum(int(p.nbytes) for p in self.parameters())


@dataclass
class LayerAttnState:
    """What one layer carries between steps.

    ``window_kv`` is the ring of the last ``window_size`` quantised KV rows (token p in slot
    ``p % win``). Kv sources own ``compress_cache`` (``[max_seq_len // r, hd]``) and, for
    ratio > 1, the compressor's partial group; key owners own ``index_cache``.
    """

    window_kv: np.ndarray
    compressor: CompressorState | None = None
    compress_cache: np.ndarray | None = None
    index_cache: IndexKeyCache | None = None
    end_pos: int = 0               # the next position this layer expects
    last_step: tuple | None = None   # (start_pos, seqlen, prefill_len or None) it last ran
    prefill_len: int | None = None   # the length of this sequence's prefill

    @property
    def kv_state(self) -> np.ndarray | None:
        return None if self.compressor is None else self.compressor.kv

    @property
    def score_state(self) -> np.ndarray | None:
        return None if self.compressor is None else self.compressor.score

    @classmethod
    def fresh(cls, config: AttnConfig, layer_id: int) -> "LayerAttnState":
        r, hd = config.ratio(layer_id), config.head_dim
        st = cls(window_kv=np.zeros((config.window_size, hd), np.float32))
        if config.is_kv_source(layer_id):
            st.compressor = CompressorState.fresh(r, hd)
            st.compress_cache = np.zeros((config.max_seq_len // r, hd), np.float32)
            if config.is_index_source(layer_id):
                st.index_cache = IndexKeyCache.empty(config.max_seq_len // r, config.index_head_dim)
        return st


@dataclass
class SharedRuntime:
    """The four slots carried down the stack within a step; never reset, as in the reference.

    ``compress_kv`` and ``index_k`` are the latest writer's whole cache (``index_k`` an
    :class:`~ds41numba.indexer.IndexKeyCache`: its ``keys`` are the rows); ``topk_idxs`` is the
    latest index source's selection (``[seqlen, k]`` int32, offsets applied); the candidate
    source's mask is kept per block, one bit each (``candidate_blocks``, packed along rows) and
    expanded to positions on demand by :attr:`candidates`.

    ``observer`` is not a slot: it is the golden captures' hook (None unless a golden run set
    it, see :mod:`ds41numba.golden.captures`). The indexer hands it every tile's scores and
    selection, attention every tile's ``q``, ``o``, KV rows and index rows; it changes nothing.
    """

    compress_kv: np.ndarray | None = None
    index_k: IndexKeyCache | None = None
    topk_idxs: np.ndarray | None = None
    candidate_blocks: np.ndarray | None = None
    candidate_width: int = 0
    candidate_block_size: int = 1
    observer: object | None = None

    @property
    def candidates(self) -> np.ndarray | None:
        """The candidate mask ``[seqlen, width]`` bool (None until the candidate source ran)."""
        if self.candidate_blocks is None:
            return None
        return candidate_mask(self.candidate_blocks, self.candidate_width, self.candidate_block_size)


class AttentionStack:
    """A stack of V4.1 attention layers that runs steps as the reference does.

    ``weights`` maps ``layers.{i}.attn.NAME`` to arrays (see :func:`weight_specs`). ``layers``
    restricts the stack to a subset of the config's layers (default: all); a layer outside it
    cannot be run, and every source a member needs must be a member too. ``batch`` makes the
    stack one sequence of a batch run in lockstep (:class:`~ds41numba.batched.BatchedStack`
    holds the others, :meth:`sibling`): its products then sum as the batch's do.

    Args:
        config: the stack's :class:`~ds41numba.AttnConfig` (:func:`~ds41numba.preset`).
        weights: ``{"layers.{i}.attn.NAME": array}`` for every member layer (bf16 values where
            the parameter is bf16), e.g. :func:`ds41numba.golden.make_weights`.
        layers: the member layers (default: all); closed under the layers' sources
            (:meth:`AttnConfig.missing_sources` lists what a subset lacks).
        tile: query rows per tile of the prefill's attention (default: the stack's own).
        batch: which rows of a batch's products this sequence's rows are (default: a
            sequence on its own).

    Raises:
        TypeError: ``config`` or ``weights`` of the wrong kind.
        ValueError: a missing, misshapen or non-bf16 weight, a layer out of range, or a subset
            that lacks a source of its members.

    Example:
        >>> cfg = preset("tiny")
        >>> stack = AttentionStack(cfg, make_weights(cfg))
        >>> run = stack.forward(0, make_input("x", (12, cfg.dim)), start_pos=0, capture=True)
        >>> run.out.shape
        (12, 64)
    """

    def __init__(self, config: AttnConfig, weights, layers=None, tile: int | None = None,
                 batch: BatchRow = SINGLE):
        if not isinstance(config, AttnConfig):
            raise TypeError(f"config must be an AttnConfig, got {type(config).__name__}")
        if not hasattr(weights, "get"):
            raise TypeError("weights must be a mapping of 'layers.{i}.attn.NAME' to arrays")
        if tile is not None and not is_int(tile, 1):
            raise ValueError(f"tile must be None or a positive integer, got {tile!r}")
        self.config = config
        self.layers = _checked_layers(config, layers)
        self.weights = {i: AttnWeights.from_mapping(config, i, weights) for i in self.layers}
        self.states = {i: LayerAttnState.fresh(config, i) for i in self.layers}
        self.shared = SharedRuntime()
        self.tile = None if tile is None else int(tile)
        self.batch = checked_batch(batch, "AttentionStack")
        self._order = StepOrder(config, self.layers, self.states, self.shared)

    @property
    def sequences(self) -> tuple["AttentionStack", ...]:
        """The stacks of the batch's sequences, one per batch row: this stack alone."""
        return (self,)

    def sibling(self, batch: BatchRow) -> "AttentionStack":
        """Another sequence of a batch: a stack of the same config, layers, tile and weights
        (the same objects, not copies) with fresh states and shared slots, at ``batch``."""
        other = object.__new__(AttentionStack)
        other.config, other.layers, other.weights, other.tile = (self.config, self.layers,
                                                                 self.weights, self.tile)
        other.batch = checked_batch(batch, "AttentionStack.sibling")
        other.states = {i: LayerAttnState.fresh(self.config, i) for i in self.layers}
        other.shared = SharedRuntime()
        other._order = StepOrder(other.config, other.layers, other.states, other.shared)
        return other

    def weight_bytes(self) -> int:
        """Bytes the stack's parameters hold: 2 a parameter for every bf16 projection (plus its
        padding, :attr:`Bf16Matrix.nbytes`), 8 for the ratio > 1 compressors' f32 projections
        (the array and the packed copy its first product builds, counted from the start), 4 for
        the norms and sinks. :func:`held_weight_bytes` gives the same number from the config
        before any weight is made."""
        return sum(w.nbytes() for w in self.weights.values())

    def snapshot(self) -> dict:
        """What the stack carries from step to step (every layer's state, the shared slots and
        the record of which steps ran), as one picklable dict: :meth:`restore` on a stack of the
        same config and weights continues exactly where this one stood."""
        return {"states": self.states, "shared": self.shared, "order": self._order}

    def restore(self, snapshot: dict) -> None:
        """Continue from a :meth:`snapshot` (for instance one unpickled from a file)."""
        self.states, self.shared, self._order = (snapshot["states"], snapshot["shared"],
                                                 snapshot["order"])
        self._order.states, self._order.shared = self.states, self.shared

    def forward(self, layer_id: int, x, start_pos: int, capture: bool = False,
                prefill_len: int | None = None, queries: bool = True) -> CompAttnRun | None:
        """Run layer ``layer_id`` on ``x [seqlen, dim]`` (bf16 values) at ``start_pos``.

        ``start_pos == 0`` is a prefill and starts a new sequence for this layer; ``start_pos > 0``
        is the decode of one token and must follow the layer's previous step.

        A prefill may also be given in chunks: ``prefill_len=P`` says ``x`` is the rows
        ``start_pos .. start_pos + seqlen - 1`` of a prefill of ``P`` tokens (``start_pos == 0``
        starts it, every later chunk starts where the layer's previous one ended; any sizes,
        1-row chunks included). The results, the layer's state and the shared slots are the
        one-shot prefill's, row for row: the reference's products sum in an order chosen by
        its row count ``P``, which is why the stack must be told it. Run the chunks token-major
        (chunk 1 through every layer in order, then chunk 2): a layer reads what its sources
        published for the same chunk (layers that read no other layer may also run all their
        chunks one after another). ``forward(i, x, 0, prefill_len=len(x))`` is the one-shot
        prefill. Decode steps (``prefill_len`` None) follow once the layer has run all ``P``
        tokens. After a chunked prefill ``shared.topk_idxs`` and ``shared.candidates`` hold the
        last chunk's rows (the one-shot's last rows), not all ``P``: the decode step's layers
        replace them before any layer reads them.

        ``queries=False`` runs only the key side of the step (the layer's state and caches, the
        shared caches it publishes; see :func:`~ds41numba.attention.attention_any`) and returns
        None: the rows' outputs and selection are then :func:`~ds41numba.attention.attention_rows`'
        to compute, wherever they run. Only a chunk of a prefill (``prefill_len``) may skip
        its queries: a decode step's selection is read by the layers after it.

        Args:
            layer_id: a member layer.
            x: ``[seqlen, dim]``, bf16 values (any float dtype holding them).
            start_pos: the position of ``x``'s first row.
            capture: also keep the intermediates (``q``, ``kv_rows``, ``idx``, ``o``,
                ``index_score``) in the result.
            prefill_len: the whole prefill's length when ``x`` is a chunk of it.
            queries: False runs only the key side (see above).

        Returns:
            The layer's :class:`~ds41numba.CompAttnRun` (``.out [seqlen, dim]``, ``.idx``, and
            with ``capture`` the intermediates), or None with ``queries=False``.

        Raises:
            ValueError: a bad shape or non-bf16 input, or a step out of the order the reference
                could run (a decode before the prefill is complete, a chunk that does not
                start where the layer's last one ended, several rows at ``start_pos > 0``
                without ``prefill_len``, ...).
        """
        c = self.config
        layer_id = _checked_int("layer_id", layer_id)
        if layer_id not in self.states:
            raise ValueError(f"layer {layer_id} is not in this stack (layers {list(self.layers)})")
        start_pos = _checked_int("start_pos", start_pos)
        x = _checked_input(x, c.dim)
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if prefill_len is not None:
            prefill_len = _checked_int("prefill_len", prefill_len)
            if start_pos + x.shape[0] > prefill_len:
                raise ValueError(f"a chunk of rows {start_pos}..{start_pos + x.shape[0] - 1} runs "
                                 f"past its prefill of prefill_len {prefill_len} tokens")
        if start_pos + x.shape[0] > c.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + x.shape[0] - 1} run past "
                             f"max_seq_len {c.max_seq_len}")
        if start_pos == 0 and prefill_len is None:
            prefill_len = x.shape[0]          # the one-shot prefill
        if not queries and prefill_len is None:
            raise ValueError("queries=False: only a prefill (prefill_len) may run its key side alone")
        # refuses before anything changes
        self._order.admit(layer_id, start_pos, x.shape[0], prefill_len)
        if start_pos == 0:
            self.states[layer_id] = LayerAttnState.fresh(c, layer_id)
            self.states[layer_id].prefill_len = prefill_len
        chunk = None if prefill_len is None or (start_pos == 0 and prefill_len == x.shape[0]) \
            else prefill_len
        run = attention_any(c, layer_id, self.weights[layer_id], self.states[layer_id],
                            self.shared, x, start_pos, capture=capture, tile=self.tile,
                            prefill_len=chunk, queries=queries, batch=self.batch)
        self._order.ran(layer_id, start_pos, x.shape[0], prefill_len)
        return run


def _checked_int(name: str, value) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _checked_layers(config: AttnConfig, layers) -> tuple[int, ...]:
    """The stack's layers, sorted: all of the config's by default; a subset must hold every
    source its members read (:meth:`AttnConfig.missing_sources`)."""
    n = config.n_layers
    if layers is None:
        return tuple(range(n))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be a list of layer ids, got {layers!r}")
    for i in layers:
        if not is_int(i):
            raise TypeError(f"layers: {i!r} is not a layer id (an integer)")
    ids = tuple(sorted({int(i) for i in layers}))
    for i in ids:
        if not 0 <= i < n:
            raise ValueError(f"layers: {i} is not a layer of this config (0..{n - 1})")
    missing = config.missing_sources(ids)
    if missing:
        i, src, role = missing[0]
        why = ("a key owner whose index keys it scores against on steps it writes none itself, "
               "as the reference does" if role == FALLBACK_KEY_OWNER else "a source it reads")
        raise ValueError(f"layers: layer {i} needs layer {src} ({why}), which is not in the stack")
    return ids


def _checked_input(x, dim: int) -> np.ndarray:
    """x as given when float32 (bf16 values) or ``ml_dtypes.bfloat16``: a bfloat16 input is used
    as it is, widened to float32 a block of rows at a time (half the memory of a long input)."""
    a = np.asarray(x)
    if a.dtype != np.float32 and a.dtype.name != "bfloat16":
        raise ValueError(f"x must be float32 holding bf16 values (or ml_dtypes.bfloat16), got {a.dtype}")
    if a.ndim != 2 or a.shape[1] != dim:
        raise ValueError(f"x must have shape [seqlen, {dim}], got {list(a.shape)}")
    if a.shape[0] == 0:
        raise ValueError("x is empty: a step needs at least one token")
    a = np.ascontiguousarray(a)
    if a.dtype == np.float32 and not is_bf16_valued(a):
        raise ValueError("x must hold bf16 values (round it to bfloat16 first)")
    return a
