"""asv benchmarks of production-shaped v41-flash layers: prefill and one decode step.

* ``Prefill``: layers 0 (ratio 0), 2 (ratio 2, kv + index source) and 20 (ratio 1, kv + index +
  candidate source) at ``common.PREFILL_SIZES`` tokens (1,024 and 4,096; 16,384 with
  ``DS41_BENCH_FULL=1``).
* ``Decode``: one decode step of layer 20 at ``common.DECODE_CONTEXTS`` (4,096; 65,536 with
  ``DS41_BENCH_FULL=1``). ``setup_cache`` runs the prefill that reaches each context once and
  pickles the layer's state; every timed step decodes the next position.

Each benchmark process builds its layer's weights once (about 540 MB for layer 20, a few
seconds); peak memory therefore includes the weights, as it does in use, but not what numba
used while loading (or compiling) the kernels in the warm-up: the peak is reset after it.
"""

import os
import pickle

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
