"""The attention fields of the reference's ``ModelArgs``, validated, plus named presets.

A config describes a whole stack: one ``compress_ratios`` entry per layer and the cross-layer
roles (which layers own a compressed KV cache, which run the indexer, which publishes the
candidate blocks). Everything the layers later assume about each other is checked here once,
so that a bad topology is a clear ``ValueError`` at construction instead of a wrong answer later.
The layer-role graph (which layers a layer reads, :meth:`AttnConfig.sources_of`, and whether a
subset of layers is closed under it, :meth:`AttnConfig.missing_sources`) lives here too: the
stack and the golden runs both ask it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass, field

from .numerics import FP4_BLOCK, LATENT_BLOCK, is_int

__all__ = ["AttnConfig", "PRESETS", "preset", "IGNORED_KEYS", "IGNORED_PREFIXES",
           "FALLBACK_KEY_OWNER"]

_INT_MAX = 2**31 - 1

#: Keys :meth:`AttnConfig.from_dict` accepts and ignores (keeps in ``extra``): any other key
#: that is not a field is refused, as the reference's ``ModelArgs(**config)`` refuses it.
IGNORED_KEYS = frozenset({
    # The reference's ModelArgs fields (DeepSeek V3 / V3.2 / V4 inference/model.py) that are not
    # attention fields: batch and dtype, vocabulary and dense width, the MoE, the V3 MLA head
    # split, YaRN's attention-scale knob, the V4 hyper-connections.
    "max_batch_size", "dtype", "scale_fmt", "vocab_size", "inter_dim", "moe_inter_dim",
    "n_layers", "n_dense_layers", "n_routed_experts", "n_shared_experts", "n_activated_experts",
    "n_expert_groups", "n_limited_groups", "score_func", "route_scale", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale", "hc_mult",
    # The V4.1 reference's further non-attention fields: the draft (MTP) layers, expert and
    # scale dtypes, sampling, the router, the hash layers, the hyper-connections' Sinkhorn.
    "n_mtp_layers", "n_hash_layers", "expert_dtype", "scale_dtype", "temperature", "gate_temp",
    "norm_topk_prob", "swiglu_limit", "hc_sinkhorn_iters", "hc_eps", "image_token_id",
    # Hugging Face's keys of a released config.json.
    "architectures", "model_type", "torch_dtype", "transformers_version", "quantization_config",
    "auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
    "use_cache", "initializer_range", "attention_bias", "attention_dropout",
    # The run a reference golden's ``config`` entry records beside the attention fields (so
    # that entry is a config file as it is, see README "--config").
    "prefill", "decode", "seed",
})

#: Prefixes of the V4.1 reference's non-attention field families (engram memory, the vision
#: tower, the dspark draft head): any key starting with one is kept in ``extra`` too. None of
#: them starts an attention field, so a misspelt attention field is still refused.
IGNORED_PREFIXES = ("engram_", "vision_", "dspark_")

#: The role :meth:`AttnConfig.sources_of` gives a key owner that a layer reads only on a step
#: where it writes no index keys itself (:meth:`AttnConfig.fallback_key_owners`).
FALLBACK_KEY_OWNER = "key owner it may score against"


def _ignored(key) -> bool:
    """A key :meth:`AttnConfig.from_dict` keeps in ``extra`` instead of refusing it."""
    return key in IGNORED_KEYS or str(key).startswith(IGNORED_PREFIXES)


@dataclass(frozen=True)
class AttnConfig:
    """Attention hyper-parameters of a DeepSeek-V4.1 layer stack (the reference's names)."""

    dim: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: int = 32
    beta_slow: int = 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-20
    max_seq_len: int = 1048576
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ValueError(f"config: {name} must be a list of integers, got {value!r}")
            value = tuple(value)
            if not all(is_int(v) for v in value):
                raise ValueError(f"config: {name} must be a list of integers, got {list(value)!r}")
            object.__setattr__(self, name, tuple(int(v) for v in value))
        for f in dataclasses.fields(self):   # numpy scalars (read from arrays) as Python numbers
            v = getattr(self, f.name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, f.name, int(v))
            elif isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float, numbers.Integral)):
                object.__setattr__(self, f.name, float(v))
        self._validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "extra")

    @classmethod
    def from_dict(cls, mapping: dict) -> "AttnConfig":
        """Build from the reference's ModelArgs names.

        The keys of :data:`IGNORED_KEYS` (the reference's non-attention fields, and the run a
        reference golden's config records) are kept in ``extra``; any other unknown key is a
        ``ValueError`` that names it and the closest field name. A mapping that looks like a
        Hugging Face ``config.json`` (it has ``hidden_size``) is translated first, see
        :meth:`from_hf_dict`.
        """
        if not isinstance(mapping, dict):
            raise ValueError(f"config: expected a mapping, got {type(mapping).__name__}")
        if "hidden_size" in mapping or "text_config" in mapping:
            return cls.from_hf_dict(mapping)
        names = cls.field_names()
        for key in mapping:
            if key not in names and not _ignored(key):
                close = difflib.get_close_matches(str(key), names, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(f"config: unknown field {key!r}{hint}")
        known = {k: v for k, v in mapping.items() if k in names}
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in known]
        if missing:
            raise ValueError(f"config: missing field(s) {', '.join(missing)}")
        extra = {k: v for k, v in mapping.items() if k not in names}
        config = cls(**known, extra=extra)
        config.draft_layers()        # n_layers and n_mtp_layers checked against the ratios
        return config

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "AttnConfig":
        """Translate a Hugging Face V4.1 ``config.json`` (its text config) to the reference names.

        Only the attention keys are read; the others (vocabulary, experts, ...) are ignored.
        """
        if "text_config" in hf and isinstance(hf["text_config"], dict):
            hf = {**hf, **hf["text_config"]}
        rename = {
            "hidden_size": "dim",
            "num_attention_heads": "n_heads",
            "head_dim": "head_dim",
            "qk_rope_head_dim": "rope_head_dim",
            "q_lora_rank": "q_lora_rank",
            "o_lora_rank": "o_lora_rank",
            "o_groups": "o_groups",
            "sliding_window": "window_size",
            "compress_ratios": "compress_ratios",
            "kv_source_layer_ids": "kv_source_layers",
            "index_source_layer_ids": "index_source_layers",
            "candidate_source_layer_id": "candidate_source_layer",
            "candidate_topk_blocks": "candidate_topk_blocks",
            "candidate_block_size": "candidate_block_size",
            "index_n_heads": "index_n_heads",
            "index_head_dim": "index_head_dim",
            "index_topk": "index_topk",
            "compress_rope_theta": "compress_rope_theta",
            "rope_theta": "rope_theta",
            "rms_norm_eps": "norm_eps",
            "max_position_embeddings": "max_seq_len",
        }
        out = {ref: hf[key] for key, ref in rename.items() if key in hf}
        # The reference's own names are accepted too (some exports keep them).
        for name in cls.field_names():
            if name not in out and name in hf:
                out[name] = hf[name]
        if out.get("candidate_source_layer") is None:
            out["candidate_source_layer"] = -1
        rs = hf.get("rope_scaling") or {}
        if rs:
            kind = rs.get("type", rs.get("rope_type", "yarn"))
            if kind != "yarn":
                raise ValueError(f"config: rope_scaling type {kind!r} is not supported (only 'yarn')")
            out["rope_factor"] = rs.get("factor", cls.rope_factor)
            out["original_seq_len"] = rs.get("original_max_position_embeddings", cls.original_seq_len)
            out["beta_fast"] = rs.get("beta_fast", cls.beta_fast)
            out["beta_slow"] = rs.get("beta_slow", cls.beta_slow)
        elif "rope_scaling" in hf:  # explicitly null: no YaRN
            out["original_seq_len"] = 0
        return cls.from_dict(out)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "AttnConfig":
        """Load a JSON file in either naming (reference ModelArgs or Hugging Face)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"config: cannot read {os.fspath(path)!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config: {os.fspath(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        """The reference-named fields as plain JSON-able values."""
        d = {name: getattr(self, name) for name in self.field_names()}
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers"):
            d[name] = list(d[name])
        return d

    def replace(self, **changes) -> "AttnConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ the layer-role graph
    @property
    def n_layers(self) -> int:
        """Layers of the stack: one per ``compress_ratios`` entry, draft layers included (not
        the reference's ``n_layers`` field, which counts its main layers only and is kept in
        ``extra``; see :meth:`draft_layers`)."""
        return len(self.compress_ratios)

    def draft_layers(self) -> range:
        """The draft (MTP) layers among this stack's layers, as the reference numbers them.

        The reference builds its main layers ``Block(i)`` for ``i < n_layers`` and its draft
        layers ``MTPBlock(n_layers + k)`` for ``k < n_mtp_layers``, each taking its ratio from
        ``compress_ratios[layer_id]``. So layer ids here are the reference's ``layer_id``s and
        every ``compress_ratios`` entry is a layer; ``n_layers`` and ``n_mtp_layers`` (kept in
        ``extra``) only say which of them are draft layers. A config that gives
        ``n_mtp_layers`` is a V4.1 one and must not ask for more layers than it has ratios
        (the reference would index past ``compress_ratios``; entries past its layers are the
        draft layers a larger ``n_mtp_layers`` would build). Empty unless the config gives both.
        """
        main, drafts = self.extra.get("n_layers"), self.extra.get("n_mtp_layers")
        if drafts is None or main is None:
            return range(0)
        for name, v in (("n_layers", main), ("n_mtp_layers", drafts)):
            if not is_int(v, 0):
                raise ValueError(f"config: {name} must be a non-negative integer, got {v!r}")
        if main + drafts > len(self.compress_ratios):
            raise ValueError(f"config: n_layers ({main}) + n_mtp_layers ({drafts}) layers, but "
                             f"compress_ratios has {len(self.compress_ratios)} entries (the "
                             f"reference takes layer i's ratio from compress_ratios[i])")
        return range(int(main), int(main) + int(drafts))

    def ratio(self, layer_id: int) -> int:
        return self.compress_ratios[layer_id]

    def is_kv_source(self, layer_id: int) -> bool:
        return layer_id in self.kv_source_layers

    def is_index_source(self, layer_id: int) -> bool:
        return layer_id in self.index_source_layers

    def is_key_owner(self, layer_id: int) -> bool:
        """An index source that also owns a compressor writes the shared index keys."""
        return self.is_index_source(layer_id) and self.is_kv_source(layer_id)

    def is_candidate_source(self, layer_id: int) -> bool:
        return layer_id == self.candidate_source_layer

    def uses_candidates(self, layer_id: int) -> bool:
        return self.is_index_source(layer_id) and 0 <= self.candidate_source_layer < layer_id

    def kv_source_of(self, layer_id: int) -> int:
        """The kv source whose compressed cache this layer reads (itself when it is one)."""
        return max(s for s in self.kv_source_layers if s <= layer_id)

    def index_source_of(self, layer_id: int) -> int:
        """The index source whose selection this layer reuses (itself when it is one)."""
        return max(s for s in self.index_source_layers if s <= layer_id)

    def key_owner_of(self, layer_id: int) -> int:
        """The key owner whose index keys this index source scores against."""
        return max(s for s in self.kv_source_layers if s <= layer_id and self.is_index_source(s))

    def fallback_key_owners(self, layer_id: int) -> list[int]:
        """Key owners whose index keys index source ``layer_id`` may score against on a decode
        step where no key owner at or before it of its own ratio writes keys.

        The shared ``index_k`` slot then holds whatever key owner wrote last, of any ratio (the
        reference's behaviour, which the goldens record), so the result depends on those layers
        having run. A ratio-1 index source always has fresh keys of its own ratio; an owner
        before this layer whose ratio is a multiple of this layer's never writes last (this
        layer's own key owner writes after it at every step it writes).
        """
        r = self.ratio(layer_id)
        if not self.is_index_source(layer_id) or r <= 1:
            return []
        owners = [j for j in self.kv_source_layers if self.is_index_source(j) and j != layer_id]
        return sorted(j for j in owners if j > layer_id or self.ratio(j) % r)

    def sources_of(self, layer_id: int) -> list[tuple[int, str]]:
        """``(layer, role)`` of every other layer whose published slots layer ``layer_id`` reads.

        Within a step: its kv source, index source, index-key owner and candidate source, in
        that order (:meth:`step_sources`); then the key owners it may score against on a step
        where it writes no index keys, with the role :data:`FALLBACK_KEY_OWNER`. A ratio-0 layer
        reads none.
        """
        if self.ratio(layer_id) == 0:
            return []
        found = [(self.kv_source_of(layer_id), "kv source"),
                 (self.index_source_of(layer_id), "index source")]
        if self.is_index_source(layer_id):
            found.append((self.key_owner_of(layer_id), "index-key owner"))
        if self.uses_candidates(layer_id):
            found.append((self.candidate_source_layer, "candidate source"))
        found += [(j, FALLBACK_KEY_OWNER) for j in self.fallback_key_owners(layer_id)]
        return [(src, role) for src, role in found if src != layer_id]

    def step_sources(self, layer_id: int) -> list[int]:
        """The layers whose published slots layer ``layer_id`` reads within a step, ascending:
        they must have run this step before it, and no later layer since."""
        return sorted({src for src, role in self.sources_of(layer_id) if role != FALLBACK_KEY_OWNER})

    def missing_sources(self, layers) -> list[tuple[int, int, str]]:
        """Whether a subset of layers is closed under :meth:`sources_of`: ``(layer, source,
        role)`` for every source a member reads that is not a member (members in increasing
        order), empty when the subset can run on its own."""
        members = set(layers)
        return [(i, src, role) for i in sorted(members) for src, role in self.sources_of(i)
                if src not in members]

    # ------------------------------------------------------------------ validation
    def _validate(self):
        """Refuse, with the first reason, a config the layers could not run as the reference
        does: field types and ranges, YaRN's, the dimensions the kernels' blocks need, the
        layers' roles and the candidate source."""
        self._check_fields()
        self._check_yarn()
        self._check_dims()
        self._check_roles()
        self._check_candidates()

    def _check_fields(self):
        positive = ("dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_lora_rank",
                    "o_groups", "window_size", "index_n_heads", "index_head_dim", "index_topk",
                    "max_seq_len", "candidate_topk_blocks", "candidate_block_size")
        for name in positive:
            v = getattr(self, name)
            if not is_int(v, 1):
                _bad(f"{name} must be a positive integer, got {v!r}")
            if v > _INT_MAX:     # sizes and counts the kernels index with int64 arithmetic
                _bad(f"{name} must be at most 2**31 - 1, got {v}")
        for name in ("compress_rope_theta", "rope_theta", "rope_factor", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                _bad(f"{name} must be a positive number, got {v!r}")
        for name in ("original_seq_len", "beta_fast", "beta_slow", "candidate_source_layer"):
            v = getattr(self, name)
            if not is_int(v):
                _bad(f"{name} must be an integer, got {v!r}")

    def _check_yarn(self):
        if self.original_seq_len < 0:
            _bad(f"original_seq_len must be >= 0, got {self.original_seq_len}")
        if self.original_seq_len > 0:   # YaRN: log(original_seq_len / (beta * 2 pi)) / log(base)
            for name in ("beta_fast", "beta_slow"):
                if getattr(self, name) <= 0:
                    _bad(f"{name} must be positive when YaRN is on (original_seq_len > 0), "
                         f"got {getattr(self, name)}")
            if self.compress_rope_theta == 1:
                _bad("compress_rope_theta must not be 1 when YaRN is on (original_seq_len > 0): "
                     "YaRN divides by log(compress_rope_theta)")

    def _check_dims(self):
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim:
            _bad(f"rope_head_dim ({self.rope_head_dim}) must be even and at most head_dim ({self.head_dim})")
        if self.rope_head_dim > self.index_head_dim:
            _bad(f"rope_head_dim ({self.rope_head_dim}) must be at most index_head_dim ({self.index_head_dim})")
        if self.head_dim % 32:
            _bad(f"head_dim ({self.head_dim}) must be a multiple of 32 (the fp8 block and FP4_BLOCK)")
        if self.head_dim % LATENT_BLOCK:
            _bad(f"head_dim ({self.head_dim}) must be a multiple of LATENT_BLOCK ({LATENT_BLOCK})")
        if self.index_head_dim % FP4_BLOCK:
            _bad(f"index_head_dim ({self.index_head_dim}) must be a multiple of FP4_BLOCK ({FP4_BLOCK})")
        if self.n_heads % self.o_groups:
            _bad(f"n_heads ({self.n_heads}) must be a multiple of o_groups ({self.o_groups})")

    def _check_roles(self):
        """The ratios, the kv and index source lists, and every compressed layer's sources (at
        or before it, of its ratio) and an index source's key owner."""
        n = self.n_layers
        if n == 0:
            _bad("compress_ratios is empty: a stack needs at least one layer")
        if any(r < 0 or r > _INT_MAX for r in self.compress_ratios):
            _bad(f"compress_ratios must be >= 0 and at most 2**31 - 1, got {list(self.compress_ratios)}")
        for name in ("kv_source_layers", "index_source_layers"):
            ids = getattr(self, name)
            if len(set(ids)) != len(ids):
                _bad(f"{name} has duplicates: {list(ids)}")
            for i in ids:
                if not 0 <= i < n:
                    _bad(f"{name} names layer {i}, but the stack has layers 0..{n - 1}")
                if self.compress_ratios[i] == 0:
                    _bad(f"{name} names layer {i}, whose compress_ratio is 0 (no compressed attention)")
        for i, r in enumerate(self.compress_ratios):
            if r:
                self._check_sources_of(i, r)

    def _check_sources_of(self, i: int, r: int):
        for role, sources, reads in (
                ("kv source", self.kv_source_layers, "read the compressed cache of"),
                ("index source", self.index_source_layers, "reuse the selection of")):
            before = [s for s in sources if s <= i]
            if not before:
                _bad(f"layer {i} has compress_ratio {r} but no {role} at or before it")
            s = max(before)
            if self.compress_ratios[s] != r:
                _bad(f"layer {i} (ratio {r}) would {reads} {role} {s} "
                     f"(ratio {self.compress_ratios[s]}): ratios must agree")
        if self.is_index_source(i):
            owners = [k for k in self.kv_source_layers if k <= i and self.is_index_source(k)]
            if not owners:
                _bad(f"index source {i} has no key owner (an index source that is also a kv "
                     f"source) at or before it")
            if self.compress_ratios[max(owners)] != r:
                _bad(f"index source {i} (ratio {r}) would score against the keys of layer "
                     f"{max(owners)} (ratio {self.compress_ratios[max(owners)]}): ratios must agree")

    def _check_candidates(self):
        c, n = self.candidate_source_layer, self.n_layers
        if c < -1 or c >= n:
            _bad(f"candidate_source_layer must be -1 (off) or a layer 0..{n - 1}, got {c}")
        if c >= 0:
            if not self.is_index_source(c):
                _bad(f"candidate_source_layer {c} must be an index source")
            for i in self.index_source_layers:
                if i > c and self.compress_ratios[i] != self.compress_ratios[c]:
                    _bad(f"candidate consumer {i} has compress_ratio {self.compress_ratios[i]} but its "
                         f"candidate source {c} has {self.compress_ratios[c]}: they must agree")


def _bad(msg: str):
    raise ValueError(f"config: {msg}")


# ---------------------------------------------------------------------- presets
_TINY = dict(
    dim=64, n_heads=4, head_dim=32, rope_head_dim=8, q_lora_rank=16, o_lora_rank=16, o_groups=2,
    window_size=8, compress_ratios=[0, 0, 2, 2, 1, 1], kv_source_layers=[2, 4],
    index_source_layers=[2, 4, 5], candidate_source_layer=4, candidate_topk_blocks=3,
    candidate_block_size=2, index_n_heads=2, index_head_dim=32, index_topk=6,
    compress_rope_theta=40000.0, rope_factor=2.0, original_seq_len=32, beta_fast=32, beta_slow=1,
    rope_theta=10000.0, norm_eps=1e-20, max_seq_len=64,
)
_MIXED = dict(
    dim=128, n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_lora_rank=32, o_groups=2,
    window_size=16, compress_ratios=[0, 4, 4, 16, 16, 1, 1, 1], kv_source_layers=[1, 3, 5],
    index_source_layers=[1, 3, 4, 5, 6], candidate_source_layer=5, candidate_topk_blocks=6,
    candidate_block_size=4, index_n_heads=4, index_head_dim=32, index_topk=3,
    compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=64, beta_fast=32, beta_slow=1,
    rope_theta=10000.0, norm_eps=1e-20, max_seq_len=320,
)
_V41_FLASH = dict(
    dim=5120, n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024,
    o_groups=8, window_size=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    kv_source_layers=[2, 8, 14, 20], index_source_layers=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
    index_n_heads=32, index_head_dim=128, index_topk=512, compress_rope_theta=160000.0,
    rope_factor=16.0, original_seq_len=65536, beta_fast=32, beta_slow=1, rope_theta=10000.0,
    norm_eps=1e-20, max_seq_len=1048576,
)

#: Named configs: ``tiny`` and ``mixed`` are the developer goldens' stacks, ``v41-flash`` is the
#: production V4.1-Flash attention (43 layers incl. the 3 draft layers).
PRESETS: dict[str, dict] = {"tiny": _TINY, "mixed": _MIXED, "v41-flash": _V41_FLASH}


def preset(name: str, **overrides) -> AttnConfig:
    """The named preset as an :class:`AttnConfig`, with any field overridden.

    Args:
        name: ``"tiny"`` and ``"mixed"`` (the reference goldens' stacks) or ``"v41-flash"``
            (V4.1-Flash's 43 production layers).
        **overrides: fields to replace, e.g. ``max_seq_len=65536``.

    Returns:
        The validated config.

    Raises:
        ValueError: an unknown preset, or an override that makes the config invalid.

    Example:
        >>> preset("v41-flash").n_layers
        43
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return AttnConfig.from_dict({**PRESETS[name], **overrides})
