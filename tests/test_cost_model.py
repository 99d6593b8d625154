"""The cost model reads each piece's rows from the run's progress reports."""

from benchmarks.cost_model import piece_rows
from ds41numba.config import preset
from ds41numba.golden import GoldenPlan, write_golden


def test_the_cost_model_counts_a_runs_rows(tmp_path):
    """Its chunks' rows add up to the prefill and each decode step is one row: the reports'
    counts are work units (a query row weighs 24 key sides and more), so reading rows from them
    made the 16,384-token run's chunks 25 times too long and the projection nonsense."""
    cfg = preset("tiny")
    plan = GoldenPlan(cfg, tuple(range(cfg.n_layers)), 12, 3, capture="io", preset="tiny")
    done = []
    write_golden(plan, tmp_path / "g.safetensors", chunk=5,
                 progress=lambda n, where: done.append(where) if n else None)
    first_layer = [w for w in done if w.endswith(" layer 0")]
    prefill = [piece_rows(w) for w in first_layer if w.startswith("step 0")]
    decode = [piece_rows(w) for w in first_layer if not w.startswith("step 0")]
    assert prefill == [5, 5, 2] and decode == [1, 1, 1]
