"""A batch of sequences run in lockstep, as the reference runs ``bsz > 1``: :class:`BatchedStack`.

The reference keeps every per-sequence buffer with a leading batch axis (the window ring, the
compressor's partial group, the compressed and index-key caches, the shared slots
``compress_kv``, ``index_k``, ``topk_idxs`` and the candidate mask), runs one ``start_pos`` for
the whole batch and multiplies ``B * seqlen`` rows in each projection. A
:class:`BatchedStack` holds one :class:`~ds41numba.stack.AttentionStack` per batch row, all
sharing one set of weights, each with its own states and shared slots, and runs a step through
all of them with the same ``start_pos``; each knows its :class:`~ds41numba.batch.BatchRow`, so
its products sum in the order of the batch's products (:mod:`ds41numba.batch`). Sequence b's
results are bit for bit the reference's batch row b.
"""

from __future__ import annotations

import numpy as np

from .attention import CompAttnRun
from .batch import BatchRow
from .config import AttnConfig
from .numerics import is_int
from .stack import AttentionStack

__all__ = ["BatchedStack"]


class BatchedStack:
    """``batch`` sequences in lockstep through a stack of V4.1 attention layers.

    ``config``, ``weights``, ``layers`` and ``tile`` as for :class:`AttentionStack` (the weights
    are checked and held once). :attr:`sequences` are the per-sequence stacks (batch row b is
    ``sequences[b]``: its ``states``, ``shared`` and what :meth:`forward` returns for it).
    """

    def __init__(self, config: AttnConfig, weights, batch: int, layers=None,
                 tile: int | None = None):
        if not is_int(batch):
            raise TypeError(f"batch must be an int, got {type(batch).__name__}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        first = AttentionStack(config, weights, layers=layers, tile=tile,
                               batch=BatchRow(0, int(batch)))
        self.sequences = (first,) + tuple(first.sibling(BatchRow(b, int(batch)))
                                          for b in range(1, int(batch)))

    @property
    def config(self) -> AttnConfig:
        return self.sequences[0].config

    @property
    def layers(self) -> tuple[int, ...]:
        return self.sequences[0].layers

    @property
    def batch(self) -> int:
        return len(self.sequences)

    def weight_bytes(self) -> int:
        """Bytes the shared parameters hold (once for the whole batch)."""
        return self.sequences[0].weight_bytes()

    def snapshot(self) -> dict:
        """Every sequence's :meth:`AttentionStack.snapshot`, in batch order."""
        return {"sequences": [s.snapshot() for s in self.sequences]}

    def restore(self, snapshot: dict) -> None:
        """Continue from a :meth:`snapshot` of a batch of the same size."""
        got = snapshot.get("sequences")
        if got is None or len(got) != len(self.sequences):
            raise ValueError(f"restore: the snapshot is not of a batch of {len(self.sequences)}")
        for s, snap in zip(self.sequences, got):
            s.restore(snap)

    def forward(self, layer_id: int, x, start_pos: int, capture: bool = False,
                prefill_len: int | None = None, queries: bool = True) -> list[CompAttnRun | None]:
        """Run layer ``layer_id`` on ``x [B, seqlen, dim]`` (bf16 values, or a sequence of B
        ``[seqlen, dim]`` arrays) at ``start_pos`` for every sequence; returns their runs, in
        batch order. The arguments mean what they mean for :meth:`AttentionStack.forward`, for
        the whole batch: one ``start_pos``, one ``prefill_len``."""
        if len(x) != len(self.sequences):
            raise ValueError(f"x must hold {len(self.sequences)} sequences (one per batch row), "
                             f"got {len(x)}")
        if len({np.shape(xb) for xb in x}) != 1:
            raise ValueError(f"x: the sequences of a batch have one length (lockstep), got shapes "
                             f"{[list(np.shape(xb)) for xb in x]}")
        return [s.forward(layer_id, xb, start_pos, capture=capture, prefill_len=prefill_len,
                          queries=queries) for s, xb in zip(self.sequences, x)]
