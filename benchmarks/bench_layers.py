"""asv benchmarks of production-shaped v41-flash layers: prefill and one decode step.

* ``Prefill``: layers 0 (ratio 0), 2 (ratio 2, kv + index source) and 20 (ratio 1, kv + index +
  candidate source) at ``common.PREFILL_SIZES`` tokens (1,024 and 4,096; 16,384 with
  ``DS41_BENCH_FULL=1``).
* ``Decode``: one decode step of layer 20 at ``common.DECODE_CONTEXTS`` (4,096; 65,536 with
  ``DS41_BENCH_FULL=1``). ``setup_cache`` runs the prefill that reaches each context once and
  pickles the layer's state; every timed step decodes the next position.
* ``DecodeOverhead``: a decode step of layer 20's roles at tiny dimensions, where every kernel
  is nearly free: what a step spends besides its arithmetic and its reading.
* ``DecodeProducts``: a decode step's bf16 products of layer 20 alone, and their reading rate
  against numpy's matrix-vector pass over the same weights (the decode floor's yardstick).

Each benchmark process builds its layer's weights once (about 540 MB for layer 20, a few
seconds); peak memory therefore includes the weights, as it does in use, but not what numba
used while loading (or compiling) the kernels in the warm-up: the peak is reset after it.
"""

import os
import pickle
import statistics

from . import common

# Generous: the lead is still optimising, and a 16K prefill or a 64K-context setup is long.
_TIMEOUT = 4 * 3600 if common.FULL else 3600
_PREFILL: dict = {}
_DECODE: dict = {}


class Prefill:
    params = (sorted(common.LAYERS), common.PREFILL_SIZES)
    param_names = ["layer", "tokens"]
    number = 1
    repeat = (1, 3, 60.0)     # at most 3 samples, none started after 60 s
    rounds = 1                # one benchmark process per case (each builds the layer's weights)
    warmup_time = 0
    timeout = _TIMEOUT

    def setup(self, layer, tokens):
        key = (layer, tokens)
        if key not in _PREFILL:
            stack = common.build_stack(layer, tokens)
            common.warm_up(stack, layer, min(tokens, common.WARMUP_TOKENS))
            _PREFILL[key] = (stack, common.layer_input(layer, tokens))
            common.reset_peak_rss()   # peakmem: the weights held and the call, not the loading
        self.stack, self.x = _PREFILL[key]

    def time_prefill(self, layer, tokens):
        self.stack.forward(layer, self.x, 0)

    def peakmem_prefill(self, layer, tokens):
        self.stack.forward(layer, self.x, 0)


class Decode:
    params = common.DECODE_CONTEXTS
    param_names = ["context"]
    number = 1
    repeat = (3, 20, 20.0)
    rounds = 1
    warmup_time = 0
    timeout = _TIMEOUT

    def setup_cache(self):
        """Prefill each context once; pickle the stack's snapshot (not its weights) to a file."""
        layer = common.DECODE_LAYER
        paths = {}
        for context in common.DECODE_CONTEXTS:
            stack = common.build_stack(layer, context + common.DECODE_MARGIN)
            stack.forward(layer, common.layer_input(layer, context), 0)
            path = os.path.abspath(f"decode_{layer}_{context}.pickle")
            with open(path, "wb") as f:
                pickle.dump(stack.snapshot(), f, protocol=5)
            paths[context] = path
            del stack
        return paths

    setup_cache.timeout = _TIMEOUT

    def setup(self, paths, context):
        layer = common.DECODE_LAYER
        if context not in _DECODE:
            stack = common.build_stack(layer, context + common.DECODE_MARGIN)
            with open(paths[context], "rb") as f:
                saved = pickle.load(f)
            stack.restore(saved)
            inputs = common.decode_inputs(layer, context, common.DECODE_MARGIN)
            _DECODE[context] = run = {"stack": stack, "inputs": inputs, "next": 0}
            self._step(run, context)   # warm: kernels loaded, bf16 weight bits packed
            common.reset_peak_rss()
        self.run = _DECODE[context]

    @staticmethod
    def _step(run, context):
        i = run["next"]
        if i >= len(run["inputs"]):
            raise RuntimeError(f"decode benchmark ran more than {common.DECODE_MARGIN} steps")
        run["stack"].forward(common.DECODE_LAYER, run["inputs"][i], context + i)
        run["next"] = i + 1

    def time_decode_step(self, paths, context):
        self._step(self.run, context)

    def peakmem_decode_step(self, paths, context):
        self._step(self.run, context)


class DecodeOverhead:
    """A decode step of layer 20's roles (ratio 1; kv, index, key-owner and candidate source) at
    tiny dimensions (dim 256, 16 heads of 128, 16 index heads of 64), 256 positions of context:
    every kernel takes microseconds, so what is timed is the step's Python, numba's dispatch,
    the small kernels and the hand-off of ``wq_b`` to the helper thread, as a production step
    runs them (``BESIDE_MIN_BYTES`` lowered to 0 for the tiny weight): 0.6-0.8 ms on the 2-core
    Zen 4 (2026-12-05) against a 10 ms production step, most of it (all but the indexer's
    0.26 ms) time in which a production step reads no weight. It hardly depends on the host's
    memory, so it moves when the code does."""

    number = 20
    repeat = (5, 20, 10.0)
    rounds = 1
    warmup_time = 0
    timeout = 600
    _CONTEXT = 256
    _STEPS = 32                     # a sample's steps (asv runs setup before each sample)

    def setup(self):
        from ds41numba.golden import make_input, make_weights
        from ds41numba.numerics import linear
        from ds41numba.stack import AttentionStack

        layer = common.DECODE_LAYER
        cfg = common.layer_config(self._CONTEXT + self._STEPS, layer).replace(
            dim=256, n_heads=16, head_dim=128, q_lora_rank=64, o_lora_rank=32, o_groups=2,
            index_n_heads=16, index_head_dim=64, index_topk=64, candidate_topk_blocks=16)
        self.stack = AttentionStack(cfg, make_weights(cfg, [layer], common.SEED), layers=[layer])
        self.stack.forward(layer, make_input("x", (self._CONTEXT, cfg.dim), common.SEED), 0)
        self.inputs = [make_input(f"decode{i}", (1, cfg.dim), common.SEED)
                       for i in range(self._STEPS)]
        self._beside = linear.BESIDE_MIN_BYTES
        linear.BESIDE_MIN_BYTES = 0
        self.next = 0
        self.time_decode_step()         # warm

    def teardown(self):
        from ds41numba.numerics import linear

        linear.BESIDE_MIN_BYTES = self._beside

    def time_decode_step(self):
        i = self.next
        self.stack.forward(common.DECODE_LAYER, self.inputs[i], self._CONTEXT + i)
        self.next = i + 1


class DecodeProducts:
    """A decode step's bf16 products of layer 20 alone: its 269 MB of projections, each read
    once through the decode kernel as a step calls it (``common.products_once``). The track is
    their reading rate over numpy's f32 matrix-vector pass over the same weights (the decode
    floor's yardstick, ``common.matvec_once``), in blocks alternated in one process: above 1 the
    products read faster than the floor assumes. On the 2-core Zen 4 (2026-12-07) they read
    28-55 GB/s where numpy's pass read 30-40, moving with the host's memory from minute to
    minute; with software prefetches in the kernel they had taken about 1.15x as long there."""

    number = 1
    repeat = (5, 20, 10.0)
    rounds = 1
    warmup_time = 0
    timeout = 600
    _BLOCKS = 5

    def setup(self):
        layer = common.DECODE_LAYER
        stack = common.build_stack(layer, 64)
        self.ours = common.products_set(stack, layer)
        self.numpy = common.matvec_set(stack.config, layer, common.layer_weights(layer))
        common.products_once(self.ours)         # warm: kernels loaded

    def time_products(self):
        common.products_once(self.ours)

    def track_products_vs_numpy(self):
        ours, numpy = [], []
        for _ in range(self._BLOCKS):
            common.settle(lambda: common.products_once(self.ours))   # after numpy's pass
            ours += [common.products_once(self.ours) for _ in range(3)]
            numpy += [common.matvec_once(self.numpy) for _ in range(2)]
        ours_rate = sum(w.nbytes for _, w in self.ours) / statistics.median(ours)
        numpy_rate = sum(w.nbytes for _, w in self.numpy) / statistics.median(numpy)
        return ours_rate / numpy_rate

    track_products_vs_numpy.unit = "x numpy's bytes/s"
