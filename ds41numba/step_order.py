"""The order a stack's layers run in (:class:`StepOrder`): the reference runs a step's layers in
layer order, each after the sources it reads, and a sequence's steps one after another; a
caller of :meth:`~ds41numba.stack.AttentionStack.forward` may run them in any order the
reference could have, and is refused (``ValueError``, saying what to run first) otherwise."""

from __future__ import annotations

from .config import AttnConfig

__all__ = ["StepOrder"]


class StepOrder:
    """Checks that a stack's layers run in an order the reference could have run them in.

    Within a step the compressed layers must run in layer order, as in the reference: a later
    layer overwrites the shared slots an earlier one reads. ``current`` is the step being run,
    the last compressed layer that ran in it and the tick it began at (a tick counts forwards);
    ``ticks`` the tick each layer last ran at; ``stale`` the compressed layers whose prefill an
    earlier layer redid (a new sequence from that layer) and that must prefill again.
    """

    def __init__(self, config: AttnConfig, layers: tuple[int, ...], states: dict, shared):
        self.config = config
        self.layers = layers
        self.states = states           # the stack's LayerAttnState per layer
        self.shared = shared           # and its SharedRuntime
        self.tick = 0
        self.ticks: dict[int, int] = {}
        self.current: tuple | None = None
        self.index_k_writer: int | None = None
        self.stale: set[int] = set()
        self.before_prefill = self._slots()   # the shared slots as the current prefill found them

    def admit(self, layer_id: int, start_pos: int, seqlen: int, prefill_len: int | None = None):
        """Refuse (``ValueError``) a step the reference could not have run; otherwise record
        that it begins. ``prefill_len``: the step is (a chunk of) a prefill of that many tokens
        (None: a decode step)."""
        c = self.config
        step = (start_pos, seqlen, prefill_len)
        if start_pos > 0:
            self._check_continues(layer_id, start_pos, seqlen, prefill_len)
        begin = current = None
        stale = set()
        if c.ratio(layer_id):
            begin, stale = self._check_layer_order(layer_id, step)
            current = (step, layer_id, begin)
        for src in c.step_sources(layer_id):
            if self.states[src].last_step != step:
                raise ValueError(f"layer {layer_id} reads what layer {src} publishes, but layer {src} "
                                 f"has not run this step (start_pos {start_pos}) yet: run sources first")
            if self.ticks.get(src, -1) < begin:
                later = f"layer {self.current[1]}" if self.current else "a later layer"
                raise ValueError(f"layer {layer_id} reads what layer {src} publishes, but {later} "
                                 f"ran this step after layer {src} and may have replaced it: run "
                                 f"layer {src} again first, then the layers after it in order")
        if c.ratio(layer_id) and c.is_index_source(layer_id):
            self._check_index_keys(layer_id, start_pos, seqlen, begin, prefill_len)
        if current is not None:
            if begin == self.tick and start_pos == 0:
                self.before_prefill = self._slots()
            elif begin == self.tick and prefill_len is not None:
                # The next chunk of a prefill: its layers find the shared slots as the one-shot
                # prefill's layers find them, not as the previous chunk's layers left them.
                (self.shared.compress_kv, self.shared.index_k, self.shared.topk_idxs,
                 self.shared.candidate_blocks, self.shared.candidate_width,
                 self.shared.candidate_block_size) = self.before_prefill
            self.current = current
            self.stale = (self.stale | stale) - {layer_id}

    def _slots(self):
        sh = self.shared
        return (sh.compress_kv, sh.index_k, sh.topk_idxs, sh.candidate_blocks, sh.candidate_width,
                sh.candidate_block_size)

    def ran(self, layer_id: int, start_pos: int, seqlen: int, prefill_len: int | None = None):
        """Record a step that ran: the layer's position and tick, and who wrote the index keys."""
        state = self.states[layer_id]
        state.end_pos = start_pos + seqlen
        state.last_step = (start_pos, seqlen, prefill_len)
        self.ticks[layer_id] = self.tick
        self.tick += 1
        if state.index_cache is not None and self.shared.index_k is state.index_cache:
            self.index_k_writer = layer_id

    def _check_continues(self, layer_id: int, start_pos: int, seqlen: int,
                         prefill_len: int | None):
        """A step at start_pos > 0 continues the layer's sequence: a decode step after its whole
        prefill, or the next chunk of its prefill."""
        state = self.states[layer_id]
        if prefill_len is None and seqlen != 1:
            raise ValueError(f"a step at start_pos {start_pos} > 0 must be one token (decode), "
                             f"got {seqlen}: a chunk of a prefill says which (prefill_len=P)")
        if state.last_step is None:
            raise ValueError(f"layer {layer_id}: {'a chunk' if prefill_len else 'decode'} at "
                             f"start_pos {start_pos} does not follow its last step (expected a "
                             f"prefill at start_pos 0)")
        done = state.end_pos >= state.prefill_len
        if prefill_len is None:
            if not done:
                raise ValueError(f"layer {layer_id}: its prefill of {state.prefill_len} tokens "
                                 f"stopped at {state.end_pos}: give the rest of it (prefill_len="
                                 f"{state.prefill_len}) before decoding")
            if state.end_pos != start_pos:
                raise ValueError(f"layer {layer_id}: decode at start_pos {start_pos} does not "
                                 f"follow its last step (expected start_pos {state.end_pos})")
            return
        if done or prefill_len != state.prefill_len or state.end_pos != start_pos:
            expect = ("its prefill is complete: decode one token at a time" if done and
                      prefill_len == state.prefill_len else
                      f"the next chunk starts at {state.end_pos} of a prefill of "
                      f"{state.prefill_len} tokens" if not done else
                      f"its prefill was {state.prefill_len} tokens")
            raise ValueError(f"layer {layer_id}: a chunk at start_pos {start_pos} of a prefill of "
                             f"{prefill_len} tokens does not continue its sequence ({expect}); "
                             f"a new prefill starts at start_pos 0")

    def _check_layer_order(self, layer_id: int, step: tuple[int, int]) -> tuple[int, set[int]]:
        """A compressed layer's place in its step: the tick the step began at, and the layers
        whose prefills a prefill restarted at this layer makes stale."""
        start_pos = step[0]
        cur = self.current
        if start_pos > 0 and layer_id in self.stale:
            raise ValueError(f"layer {layer_id}: its prefill was run before an earlier layer "
                             f"restarted the sequence (start_pos 0 again), so the shared slots "
                             f"it left are not the reference's: prefill layer {layer_id} again")
        if cur is not None and cur[0] == step and layer_id > cur[1]:
            return cur[2], set()                     # the step goes on, in layer order
        if cur is not None and cur[0] == step and start_pos > 0:
            raise ValueError(f"layer {layer_id}: layer {cur[1]} already ran this step (start_pos "
                             f"{start_pos}); within a step run the layers in increasing order, "
                             f"as the reference does")
        stale = set()                                # a new step (at start_pos 0: a new sequence)
        if start_pos == 0:
            # A new sequence from this layer: what the later layers ran before now predates it.
            stale = {j for j in self.layers if j > layer_id and self.config.ratio(j)
                     and self.states[j].last_step is not None}
        return self.tick, stale

    def _check_index_keys(self, layer_id: int, start_pos: int, seqlen: int, begin: int,
                          prefill_len: int | None = None):
        """An index source that does not write keys this step scores against the shared index keys
        as the latest key owner left them, even another ratio's (as the reference does). Those
        are the reference's only if every such owner has run as the reference runs it: the ones
        before this layer this step, the ones after it the previous step. Refuse a step the keys
        are too short for, instead of scoring missing rows."""
        c = self.config
        r = c.ratio(layer_id)
        decode = prefill_len is None
        width = (start_pos + seqlen if decode else prefill_len) // r
        writes = c.is_key_owner(layer_id) and (prefill_len >= r if not decode else (start_pos + 1) % r == 0)
        if width == 0 or writes:
            return
        if decode:
            for j in c.fallback_key_owners(layer_id):
                st = self.states[j]
                if j < layer_id and (st.last_step != (start_pos, seqlen, None) or self.ticks.get(j, -1) < begin):
                    raise ValueError(f"layer {layer_id} writes no index keys this step and scores "
                                     f"against the ones the key owners left, but key owner layer {j} "
                                     f"has not run this step (start_pos {start_pos}) yet: run it first")
                if j > layer_id and (st.last_step is None or st.end_pos != start_pos or j in self.stale):
                    raise ValueError(f"layer {layer_id} writes no index keys this step and scores "
                                     f"against the ones the key owners left, but key owner layer {j} "
                                     f"has not run the previous step (start_pos {start_pos - 1}): "
                                     f"every step runs all the key owners, in layer order")
        keys = None if self.shared.index_k is None else self.shared.index_k.keys
        if keys is not None and keys.shape[0] >= width:
            return
        who = self.index_k_writer
        owner = "no key owner" if keys is None else (
            f"layer {who} (ratio {c.ratio(who)})" if who is not None else "an earlier sequence")
        rows = 0 if keys is None else keys.shape[0]
        raise ValueError(f"layer {layer_id} (ratio {r}) would score {width} compressed positions "
                         f"against the shared index keys, which {owner} published last with only "
                         f"{rows} rows: the keys of another ratio's cache cannot cover this step")
