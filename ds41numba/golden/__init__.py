"""Golden files: deterministic weights and inputs, a recorded run, replay and comparison.

A golden is one self-contained safetensors file: every weight of the layers that ran, every
layer input ``x`` of every step, and what the stack computed from them (the *captures*), named
exactly as in the reference goldens (docs/golden-files.md, "Layout"):

* ``layers.{i}.attn.NAME`` -- layer i's parameters (BF16, or F32 for the f32 parameters);
* ``step{s}.layers.{i}.WHAT`` -- step 0 is the prefill (``prefill`` tokens at start_pos 0),
  step s >= 1 the decode of the token at position ``prefill + s - 1``; WHAT is ``x`` and the
  captures: ``io`` records ``out``, ``idx`` and ``shared.topk_idxs``; ``all`` adds ``q``, ``kv``,
  ``o``, ``index_score``, the other ``shared.*`` slots and the layer's ``state.*``.

The metadata holds the config (the reference's ModelArgs names), the run (preset, layers,
prefill, decode, seed, capture mode) and the generator's description, so the file alone is
enough to replay it and anyone can regenerate its weights and inputs in another language.

One module per part:

* :mod:`.generator` -- the deterministic generator (``ds41numba-splitmix64-v1``, specified in
  its docstring): ``make_tensor``, ``make_weights``, ``make_input``, ``stream_key``;
* :mod:`.captures` -- what a layer's step records, in its storage dtypes: ``layer_captures``,
  ``storage_kind``, ``to_storage``;
* :mod:`.files` -- atomic writing (``write_tensors_atomic``), the metadata of a run
  (``RunInfo``) and reading (``GoldenFile``, ``load_golden``);
* :mod:`.ties` -- the tie-aware judgement of index rows (``judge_index_rows``);
* :mod:`.tolerance` -- one tensor against the golden's (``compare_tensor``), recorded in a
  :mod:`.tensor_result` (``TensorResult``);
* :mod:`.compare` -- ``compare_files`` and the ``Judge`` both it and replay use; :mod:`.report`
  -- their ``CompareReport``;
* :mod:`.plan` -- ``GoldenPlan``, what a run does;
* :mod:`.run` -- ``run_golden`` / ``write_golden``, through the one step x layer driver
  (:mod:`.drive`, ``drive``) that :mod:`.stream` (``stream_golden``, the file laid out by
  :mod:`.layout`'s ``io_layout``) and :mod:`.replaying` (``replay``) run the stack through too;
* :mod:`.checkpoint` -- the checkpoints that make a streamed run resumable (``--resume``);
* :mod:`.weights_dir` -- a model checkpoint directory in the released layout as a run's weights
  (``WeightsDir``, ``--weights DIR``; not the resume checkpoints above);
* :mod:`.inputs_file` -- layer inputs from a file (``InputsFile``, ``--inputs FILE``);
* :mod:`.tensor_files` -- the tensors of files this tool did not write, memory-mapped one at a time.

The command line (``ds41numba golden | replay | compare``, :mod:`ds41numba.cli`) parses its
arguments and calls these.
"""

from .captures import (CACHE_CAPTURES, CAPTURE_MODES, RUNNERS_UP, SAMPLE_CAPTURES, SCORE_CAPTURES,
                       StepObserver,
                       layer_captures, storage_kind, to_storage)
from .compare import Judge, compare_files, file_scores
from .report import CompareReport
from .tensor_result import TensorResult
from .tolerance import TOLERANCE, compare_tensor
from .ties import (DEFAULT_INDEX_TOLERANCE, SWAP_FLOAT_RANGE, IndexJudgement, RowBounds,
                   RowScores, judge_index_rows)
from .errors import DiskError, GoldenError, RunInterrupted
from .checkpoint import CHECKPOINT_EVERY, Checkpoint, checkpoint_dir, partial_path
from .files import (FORMAT, FORMAT_VERSION, GoldenFile, RunInfo, StreamingGolden, load_golden,
                    write_tensors_atomic)
from .files import BatchRowFile
from .generator import BATCH_INPUTS, batch_input_name
from .generator import (GENERATOR, GENERATOR_SPEC, PROFILES, GeneratedWeights, make_input,
                        make_tensor, make_weight, make_weights, stream_key, weight_distribution)
from .weights_dir import WeightsDir, dequantize_fp8
from .inputs_file import InputsFile
from .drive import drive, query_tiles, run_pieces
from .layout import io_layout
from .plan import GoldenPlan, closed_selection, missing_sources
from .replaying import StoredWeights, replay
from .run import check_cluster_capture, run_golden, write_golden
from .stream import DEFAULT_CHUNK, stream_golden
from .work import product_multiply_adds, total_work, work_units
from .rows import PER_ROW, held_positions, match_rows

__all__ = [
    "GoldenError", "GENERATOR", "GENERATOR_SPEC", "CAPTURE_MODES", "FORMAT", "FORMAT_VERSION",
    "TOLERANCE", "make_tensor", "make_weights", "make_input", "weight_distribution", "stream_key",
    "missing_sources", "closed_selection", "GoldenPlan", "layer_captures", "storage_kind",
    "to_storage", "drive",
    "run_golden", "write_golden", "write_tensors_atomic", "GoldenFile", "RunInfo", "load_golden",
    "TensorResult", "CompareReport", "compare_tensor", "compare_files", "replay", "PROFILES",
    "StreamingGolden", "stream_golden", "io_layout", "DEFAULT_CHUNK",
    "RUNNERS_UP", "SCORE_CAPTURES", "SAMPLE_CAPTURES", "StepObserver", "Judge", "file_scores",
    "DEFAULT_INDEX_TOLERANCE", "SWAP_FLOAT_RANGE", "IndexJudgement", "RowBounds", "RowScores",
    "judge_index_rows", "DiskError", "RunInterrupted", "CHECKPOINT_EVERY", "Checkpoint",
    "checkpoint_dir", "partial_path", "GeneratedWeights", "make_weight", "StoredWeights",
    "run_pieces", "check_cluster_capture", "WeightsDir", "dequantize_fp8", "InputsFile",
    "BatchRowFile", "BATCH_INPUTS", "batch_input_name", "total_work", "work_units",
    "product_multiply_adds", "query_tiles", "PER_ROW", "held_positions", "match_rows", "CACHE_CAPTURES",
]
