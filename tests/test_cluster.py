"""Golden runs on a Dask cluster (``--workers`` / ``--scheduler``): a local cluster of 2 worker
processes on the loopback interface writes the one-process run's file byte for byte, whatever
the tiles; a killed worker costs only its tasks; a scheduler that goes away leaves a checkpoint
that another cluster resumes to the same bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import sys

import distributed
import numpy as np
import pytest

from ds41numba import preset
from ds41numba.attention import attention_rows
from ds41numba.cli import main
from ds41numba.golden import GoldenError, GoldenPlan, RunInterrupted, make_input, write_golden
from ds41numba.golden import queries as queries_module
from ds41numba.golden.cluster import Cluster
from ds41numba.golden.generator import GeneratedWeights
from ds41numba.golden.handover import Broadcast, SharedFiles
from ds41numba.stack import AttentionStack, AttnWeights, SharedRuntime


def sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _plan(name="mixed", prefill=203, decode=4, rows=(5, 100, 150, 204), seed=3, profile="default"):
    cfg = preset(name)
    return GoldenPlan(cfg, tuple(range(cfg.n_layers)), prefill, decode, seed=seed, capture="io",
                      preset=name, capture_rows=rows, profile=profile)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process mixed run (chunk 7: chunks split the ratio-4 and -16 groups and the
    candidate blocks)."""
    path = tmp_path_factory.mktemp("ref") / "ref.safetensors"
    write_golden(_plan(), path, chunk=7)
    return sha(path)


@pytest.mark.parametrize("chunk", [37, 64, 203])
def test_two_workers_write_the_one_process_file(tmp_path, cluster, reference, chunk):
    path = tmp_path / "c.safetensors"
    write_golden(_plan(), path, chunk=chunk, cluster=cluster)
    assert sha(path) == reference
    assert os.listdir(tmp_path) == ["c.safetensors"]       # no partial file or checkpoint left


def test_a_prefill_shorter_than_a_ratio_on_two_workers(tmp_path, cluster):
    """10 tokens and a sampled row: the ratio-16 layers have no compressed rows yet (nothing
    scored, no index keys sampled; their shared files hold no bytes); both runs write, the
    cluster's file is the one process's."""
    one, two = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    write_golden(_plan(prefill=10, decode=1, rows=(3,)), one)
    write_golden(_plan(prefill=10, decode=1, rows=(3,)), two, cluster=cluster)
    assert sha(two) == sha(one)


def test_ties_profile_on_two_workers(tmp_path, cluster):
    """Tie-heavy scores, NaN and inf rows (the candidate source and its consumers included)."""
    plan = _plan("tiny", prefill=40, decode=6, rows=(3, 39, 44), profile="ties")
    write_golden(plan, tmp_path / "one.safetensors", chunk=40)
    write_golden(plan, tmp_path / "two.safetensors", chunk=9, cluster=cluster)
    assert sha(tmp_path / "two.safetensors") == sha(tmp_path / "one.safetensors")


def test_a_killed_worker_costs_only_its_tasks(tmp_path, cluster, reference):
    pids = cluster.client.run(os.getpid)
    victim = sorted(pids.values())[0]
    seen = {"tiles": 0}

    def progress(n, where):
        if n and where.startswith("step 0 rows"):
            seen["tiles"] += 1
            if seen["tiles"] == 2:
                os.kill(victim, signal.SIGKILL)

    path = tmp_path / "k.safetensors"
    write_golden(_plan(), path, chunk=13, cluster=cluster, progress=progress)
    assert seen["tiles"] == 16 * 8                   # ceil(203 / 13) tiles of each of 8 layers
    assert victim not in cluster.client.run(os.getpid).values()
    assert sha(path) == reference


def test_tiles_go_out_as_workers_free_up_the_last_rows_first(tmp_path, cluster, reference,
                                                             monkeypatch):
    """No more tiles out than the cluster's slots (a worker ending one takes the costliest
    left: the last rows first, layer by layer), and the file as before."""
    submit, sent = queries_module.Queries.submit, []

    def counted(self, i, a, n):
        sent.append((i, a, len(self.keys_of)))           # tiles out, not yet handed over
        return submit(self, i, a, n)

    monkeypatch.setattr(queries_module.Queries, "submit", counted)
    cluster.client.wait_for_workers(2, timeout=60)        # a worker killed earlier is back
    path = tmp_path / "s.safetensors"
    write_golden(_plan(), path, chunk=37, cluster=cluster)
    assert sha(path) == reference
    assert max(out for *_, out in sent) == cluster.slots() - 1 == 1
    firsts = list(range(0, 203, 37))[::-1]               # 185, 148, ..., 0
    assert [(i, a) for i, a, _ in sent] == [(i, a) for i in range(8) for a in firsts]


def _kill_all_in_layer(layer, cluster, seen):
    """A progress callback that kills every worker at once at ``layer``'s third tile."""
    def progress(n, where):
        if n and where.startswith("step 0 rows") and where.endswith(f"layer {layer}"):
            seen["tiles"] += 1
            if seen["tiles"] == 3:
                for pid in cluster.client.run(os.getpid).values():
                    os.kill(pid, signal.SIGKILL)
    return progress


def _counting_retries(monkeypatch, seen):
    retry = queries_module.Queries._lost_tile

    def counted(self, *args):
        seen["retried"] += 1
        return retry(self, *args)

    monkeypatch.setattr(queries_module.Queries, "_lost_tile", counted)


def test_workers_that_all_die_lose_the_broadcast_and_get_it_again(tmp_path, cluster, reference,
                                                                  monkeypatch):
    """Every copy of a layer's broadcast work gone (both workers killed at once; the broadcast,
    a scheduler's workers' handover, chosen here for the local workers): the tiles that needed
    it are cancelled, the work is sent again to the restarted workers."""
    seen = {"tiles": 0, "retried": 0}
    _counting_retries(monkeypatch, seen)
    monkeypatch.setattr(Cluster, "handover", lambda self: Broadcast(self.client))
    path = tmp_path / "k.safetensors"
    write_golden(_plan(), path, chunk=13, cluster=cluster,
                 progress=_kill_all_in_layer(5, cluster, seen))
    assert seen["retried"] >= 1
    assert sha(path) == reference


def test_workers_that_all_die_map_the_shared_files_again(tmp_path, cluster, reference,
                                                         monkeypatch):
    """A local cluster's workers read the layer's work from shared files, which outlive them:
    both killed at once in layer 7, their replacements read the same files; the selections of
    layer 6 that layer 7 reads died with them, and Dask's rerun of layer 6's tiles finds their
    files removed (layer 6's turn is over): those are sent again and the tiles resubmitted."""
    seen = {"tiles": 0, "retried": 0}
    _counting_retries(monkeypatch, seen)
    made = []
    monkeypatch.setattr(Cluster, "handover",
                        lambda self: made.append(SharedFiles(str(tmp_path))) or made[-1])
    path = tmp_path / "k.safetensors"
    write_golden(_plan(), path, chunk=13, cluster=cluster,
                 progress=_kill_all_in_layer(7, cluster, seen))
    assert seen["tiles"] == 16 and len(made) == 1 and seen["retried"] >= 1
    assert sha(path) == reference
    assert os.listdir(tmp_path) == ["k.safetensors"]       # the shared files removed


def test_a_lost_scheduler_leaves_a_checkpoint_another_cluster_resumes(tmp_path, reference):
    path = tmp_path / "s.safetensors"
    doomed = Cluster(workers=2)
    seen = {"tiles": 0}

    def progress(n, where):
        if n and where.startswith("step 0 rows"):
            seen["tiles"] += 1
            if seen["tiles"] == 20:
                doomed._local.close()                  # the scheduler and its workers go away

    try:
        with pytest.raises(RunInterrupted) as stop:
            write_golden(_plan(), path, chunk=13, cluster=doomed, progress=progress,
                         checkpoint_every=0)
    finally:
        doomed.close()
    assert stop.value.status == 2
    assert "went away" in str(stop.value) and "--resume" in str(stop.value)
    assert not path.exists()
    with pytest.raises(GoldenError, match="--workers/--scheduler"):
        write_golden(_plan(), path, chunk=13, resume=True)      # not in one process
    with Cluster(workers=2) as again:
        write_golden(_plan(), path, chunk=13, cluster=again, resume=True)
    assert sha(path) == reference


def test_interrupted_in_the_key_side_then_resumed(tmp_path, cluster, reference):
    """Ctrl-C while the driver fills the caches: the checkpoint resumes on the cluster; a
    one-process checkpoint is not continued on a cluster, nor the other way round."""
    path = tmp_path / "i.safetensors"
    calls = {"n": 0}

    def progress(n, where):
        if where.startswith("keys of rows"):
            calls["n"] += 1
            if calls["n"] == 20:              # chunk 3 of 16, layer 3
                raise KeyboardInterrupt

    with pytest.raises(RunInterrupted) as stop:
        write_golden(_plan(), path, chunk=13, cluster=cluster, progress=progress,
                     checkpoint_every=0)
    assert stop.value.status == 130
    write_golden(_plan(), path, chunk=13, cluster=cluster, resume=True)
    assert sha(path) == reference

    def stop_at_chunk_3(n, where):
        if where.startswith("step 0 rows 26"):
            raise KeyboardInterrupt

    local = tmp_path / "l.safetensors"
    with pytest.raises(RunInterrupted):
        write_golden(_plan(), local, chunk=13, checkpoint_every=0, progress=stop_at_chunk_3)
    with pytest.raises(GoldenError, match=r"--workers/--scheduler \(unset then, tiles now\)"):
        write_golden(_plan(), local, chunk=13, cluster=cluster, resume=True)


def test_a_background_start_warms_the_workers_and_writes_the_file(tmp_path, reference,
                                                                  monkeypatch):
    """The command line's cluster: started (and its workers' kernels loaded) while the driver
    runs the key side, its workers (on Linux) forked from the server that imported what a tile
    runs (and still alive: a worker that numba ended for using OpenMP after a fork would have
    been started anew, not forked), without Dask's malloc trim threshold; the file is the same."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)   # an earlier cluster's
    with Cluster(workers=2, background=True) as c:
        write_golden(_plan(), tmp_path / "b.safetensors", chunk=64, cluster=c)
        assert c.stats.wait_seconds >= 0
        warmed = c.client.run(lambda: ("ds41numba.golden.worker_start" in sys.modules,
                                       os.environ.get("MALLOC_TRIM_THRESHOLD_")))
    assert sha(tmp_path / "b.safetensors") == reference
    forked = sys.platform == "linux"
    assert list(warmed.values()) == [(forked, None), (forked, None)]


def test_a_background_start_that_fails_keeps_the_key_side_for_resume(tmp_path, reference,
                                                                     monkeypatch):
    def refused(self):
        raise GoldenError("Dask worker w has ds41numba 0.0.0")

    path = tmp_path / "f.safetensors"
    with monkeypatch.context() as m:
        m.setattr(Cluster, "_check_workers", refused)
        with Cluster(workers=1, background=True) as doomed:
            with pytest.raises(GoldenError, match=r"0\.0\.0; kept .*rerun with --resume"):
                write_golden(_plan(), path, chunk=64, cluster=doomed)
    assert not path.exists()
    with Cluster(workers=1) as again:
        write_golden(_plan(), path, chunk=64, cluster=again, resume=True)
    assert sha(path) == reference


def test_a_schedulers_workers_get_the_broadcast_and_write_the_file(tmp_path, reference):
    """Workers that may be on other machines (``--scheduler``) are sent the layer's work by
    Dask's broadcast, not through this machine's shared files; the file is the same."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as lc, \
            Cluster(scheduler=lc.scheduler_address) as c:
        assert isinstance(c.handover(), Broadcast)
        write_golden(_plan(), tmp_path / "s.safetensors", chunk=64, cluster=c)
        assert sum(w for _, w, _, _ in c.stats.broadcasts) > 0
    assert sha(tmp_path / "s.safetensors") == reference


def test_a_workers_weights_from_the_shared_file_are_the_drivers(tmp_path, cluster):
    """The weights a local worker maps are the driver's, array for array and bit for bit."""
    cfg = preset("mixed")
    weights = AttnWeights.from_mapping(cfg, 5, GeneratedWeights(cfg, [5], seed=3))
    files = cluster.handover()
    assert isinstance(files, SharedFiles)
    try:
        handle = files.send(weights)
        got = cluster.client.submit(_digests, handle, pure=False).result()
    finally:
        files.close()
    assert got == _digests(weights)


def _digests(weights) -> dict:
    from ds41numba.golden.handover import received
    w = received(weights)
    return {name: hashlib.sha256(np.ascontiguousarray(getattr(w, name)._pairs
                                                      if hasattr(getattr(w, name), "_pairs")
                                                      else getattr(w, name)).tobytes()).hexdigest()
            for name in ("attn_sink", "wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")}


def test_query_rows_anywhere_are_the_stack_rows():
    """attention_rows on any rows, given the caches the key side filled, is the stack's forward
    of those rows (every layer kind of ``mixed``)."""
    cfg = preset("mixed")
    P = 150
    weights = GeneratedWeights(cfg, range(cfg.n_layers), 1)
    whole = AttentionStack(cfg, weights)
    keys = AttentionStack(cfg, GeneratedWeights(cfg, range(cfg.n_layers), 1))
    xs = {i: make_input(f"x{i}", (P, cfg.dim), 1) for i in range(cfg.n_layers)}
    runs = {i: whole.forward(i, xs[i], 0) for i in range(cfg.n_layers)}
    seen = {}
    for i in range(cfg.n_layers):
        keys.forward(i, xs[i], 0, prefill_len=P, queries=False)
        seen[i] = (keys.shared.compress_kv, keys.shared.index_k)
    for a, n in [(0, 1), (17, 40), (140, 10)]:
        selections = {}
        for i in range(cfg.n_layers):
            shared = SharedRuntime(compress_kv=seen[i][0], index_k=seen[i][1])
            src = cfg.index_source_of(i) if cfg.ratio(i) and not cfg.is_index_source(i) else None
            if src is not None:
                shared.topk_idxs = selections[src][0]
            if cfg.uses_candidates(i):
                shared.candidate_blocks, shared.candidate_width, shared.candidate_block_size = \
                    selections[cfg.candidate_source_layer][1:]
            first = max(0, a - cfg.window_size + 1)
            run = attention_rows(cfg, i, keys.weights[i], shared, xs[i][first:a + n], a, P)
            selections[i] = (shared.topk_idxs, shared.candidate_blocks, shared.candidate_width,
                             shared.candidate_block_size)
            np.testing.assert_array_equal(run.out.view(np.uint32),
                                          runs[i].out[a:a + n].view(np.uint32))
            np.testing.assert_array_equal(run.idx, runs[i].idx[a:a + n])


def test_attention_rows_refuses_what_it_cannot_answer():
    cfg = preset("mixed")
    stack = AttentionStack(cfg, GeneratedWeights(cfg, range(cfg.n_layers), 1))
    x = make_input("x", (40, cfg.dim), 1)
    w = stack.weights[5]
    with pytest.raises(ValueError, match="do not lie in a prefill of 30"):
        attention_rows(cfg, 0, stack.weights[0], SharedRuntime(), x, 0, 30)
    with pytest.raises(ValueError, match="shared.compress_kv holds 0"):
        attention_rows(cfg, 5, w, SharedRuntime(), x, 0, 40)
    with pytest.raises(ValueError, match="must be \\[rows, 128\\]"):
        attention_rows(cfg, 0, stack.weights[0], SharedRuntime(), x[:, :5], 0, 40)
    with pytest.raises(ValueError, match="shared.topk_idxs must hold these 40 rows"):
        attention_rows(cfg, 2, stack.weights[2], SharedRuntime(compress_kv=np.zeros((10, 64),
                                                                 np.float32)), x, 0, 40)


def test_refusals(tmp_path, capsys, cluster, monkeypatch):
    monkeypatch.setattr(Cluster, "connect_timeout", 1.0)     # the unreachable address below
    with pytest.raises(GoldenError, match="only a streamed run"):
        write_golden(dataclasses.replace(_plan(), capture="all"), tmp_path / "a.safetensors",
                     cluster=cluster)
    assert main(["golden", "--preset", "tiny", "--workers", "2", "--capture", "all",
                 "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "only a streamed run" in capsys.readouterr().err
    assert main(["golden", "--preset", "tiny", "--workers", "0", "--capture", "io",
                 "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "--workers must be a positive integer" in capsys.readouterr().err
    assert main(["golden", "--preset", "tiny", "--scheduler", "tcp://127.0.0.1:1",
                 "--capture", "io", "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "cannot reach a Dask scheduler" in capsys.readouterr().err
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=":0") as lc:
        assert main(["golden", "--preset", "tiny", "--scheduler", lc.scheduler_address,
                     "--capture", "io", "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "--nthreads 1" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "b.safetensors")


def test_workers_of_another_version_are_refused(monkeypatch):
    import ds41numba
    monkeypatch.setattr(ds41numba, "__version__", "0.0.0-driver")   # the workers keep theirs
    with pytest.raises(GoldenError, match="install the same version everywhere"):
        Cluster(workers=1)


def test_cli_workers_writes_the_one_process_file(tmp_path, capsys):
    """Any number of workers and threads (one worker of two threads here) gives the file."""
    args = ["golden", "--preset", "tiny", "--capture", "io", "--prefill", "30", "--decode", "3",
            "--chunk", "8", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "one.safetensors")]) == 0
    assert main(args + ["--workers", "1", "--out", str(tmp_path / "two.safetensors")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sha(tmp_path / "two.safetensors") == sha(tmp_path / "one.safetensors")


def test_a_tile_run_in_process_hands_its_rows_over_once():
    """A ``--rows`` run without workers (the in-process client) keeps no tile's file rows once
    the driver has taken them, as Dask frees a tile no one holds: only the selection stays, for
    a later layer's tile, and goes with it."""
    import operator

    from ds41numba.golden.cluster import _LocalClient

    client = _LocalClient()
    rows, selection = np.arange(3), np.arange(2)
    tile = client.submit(lambda: (rows, selection))
    taken = client.submit(operator.getitem, tile, 1)
    first, second = tile.result()
    assert first is rows and second is selection
    assert tile.result() == (None, selection)
    assert taken.result() is selection
    assert tile.result() == (None, None)
