"""export-paged: a golden's caches in shuffled pages rebuild the golden's own tensors exactly."""

from __future__ import annotations

import numpy as np
import pytest

from ds41numba.cli import main
from ds41numba.golden import GoldenFile
from ds41numba.golden.captures import STEP_NAME
from ds41numba.golden.paged import PAGED_CACHES, page_cache, unpage


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    # 11 tokens: the ratio-2 caches hold 5 rows at the prefill, not a whole page of 4.
    path = tmp_path_factory.mktemp("paged") / "g.safetensors"
    assert main(["golden", "--preset", "tiny", "--prefill", "11", "--decode", "3",
                 "--quiet", "--out", str(path)]) == 0
    return path


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


@pytest.mark.parametrize("page_size, shuffle", [(4, 7), (2, None), (8, 3)])
def test_pages_rebuild_every_cache_and_selection(golden, tmp_path, capsys, page_size, shuffle):
    out = tmp_path / "p.safetensors"
    argv = ["export-paged", str(golden), "--page-size", str(page_size), "--out", str(out)]
    assert main(argv + ([] if shuffle is None else ["--shuffle", str(shuffle)])) == 0
    with GoldenFile(golden) as g, GoldenFile(out) as p:
        caches = [n for n in g.names if STEP_NAME.fullmatch(n)
                  and STEP_NAME.fullmatch(n).group(3) in PAGED_CACHES]
        assert len(caches) == 48        # 4 steps x (6 windows + 3 x 2 shared slots)
        shuffled = 0
        for name in caches:
            step, layer, what = STEP_NAME.fullmatch(name).groups()
            prefix = f"step{step}.layers.{layer}.paged.{PAGED_CACHES[what]}"
            want = g.get(name)
            pages, table = p.get(prefix + ".pages"), p.get(prefix + ".block_table")
            slots = p.get(prefix + ".slot_mapping")
            assert pages.shape == (-(-want.shape[0] // page_size), page_size) + want.shape[1:]
            assert sorted(table.tolist()) == list(range(len(table)))
            shuffled += table.tolist() != sorted(table.tolist())
            assert np.array_equal(_bits(unpage(pages, table, want.shape[0])), _bits(want))
            flat = pages.reshape((-1,) + want.shape[1:])
            assert np.array_equal(_bits(flat[slots]), _bits(want))
        assert (shuffled > 0) == (shuffle is not None)
        # A selection's slots hold the rows its positions name (the shared compressed KV).
        n = 0
        for name in p.names:
            if not name.endswith(("topk_slots", "idx_slots")):
                continue
            step, layer = int(name.split(".")[0][4:]), int(name.split(".")[2])
            run = g.run_info()
            offset = run.config.window_size if step else run.prefill
            entries = g.get(f"step{step}.layers.{layer}." + (
                "shared.topk_idxs" if name.endswith("topk_slots") else "idx"))
            got = p.get(name)
            assert got.shape == entries.shape and np.array_equal(got < 0, entries < 0)
            sel = entries >= offset
            if run.config.ratio(layer):
                src = max(j for j in range(layer + 1)
                          if f"step{step}.layers.{j}.shared.compress_kv" in g)
                comp = g.get(f"step{step}.layers.{src}.shared.compress_kv")
                cpages = p.get(f"step{step}.layers.{src}.paged.compress_kv.pages")
                rows = cpages.reshape(-1, comp.shape[1])[got[sel]]
                assert np.array_equal(_bits(rows), _bits(comp[entries[sel] - offset]))
            else:
                assert not sel.any()
            if name.endswith("idx_slots"):
                win = g.get(f"step{step}.layers.{layer}.state.window_kv")
                wpages = p.get(f"step{step}.layers.{layer}.paged.window_kv.pages")
                ring = (entries >= 0) & ~sel
                assert np.array_equal(_bits(wpages.reshape(-1, win.shape[1])[got[ring]]),
                                      _bits(win[entries[ring]]))
            n += 1
        assert n == 3 * 4 + 6 * 3     # topk at 3 sources x 4 steps; idx at 6 layers x 3 decodes


def test_page_cache_fills_the_last_page_with_zeros():
    rows = np.arange(1, 11, dtype=np.float32).reshape(5, 2)
    p = page_cache(rows, 4, shuffle=None)
    assert p["block_table"].tolist() == [0, 1] and p["slot_mapping"].tolist() == [0, 1, 2, 3, 4]
    assert p["pages"][1, 1:].tolist() == [[0, 0]] * 3


@pytest.mark.parametrize("argv, msg", [
    (["--page-size", "3"], "--page-size 3 does not divide the window (8 rows)"),
    (["--page-size", "0"], "--page-size must be an integer >= 1"),
])
def test_bad_page_size_is_one_line_and_exit_2(golden, tmp_path, capsys, argv, msg):
    assert main(["export-paged", str(golden), "--out", str(tmp_path / "p.safetensors")] + argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.safetensors").exists()


def test_a_golden_without_caches_is_refused(tmp_path, capsys):
    path = tmp_path / "io.safetensors"
    assert main(["golden", "--prefill", "4", "--decode", "1", "--capture", "io", "--quiet",
                 "--out", str(path)]) == 0
    assert main(["export-paged", str(path), "--page-size", "4", "--out",
                 str(tmp_path / "p.safetensors")]) == 2
    assert "records no cache" in capsys.readouterr().err


def test_a_caches_golden_pages_its_prefill_caches(tmp_path):
    # --capture caches records each owner's caches once, as the prefill leaves them
    # (state.compress_kv, state.index_k, state.window_kv); a --rows golden of three rows.
    path, out = tmp_path / "c.safetensors", tmp_path / "p.safetensors"
    assert main(["golden", "--preset", "tiny", "--prefill", "11", "--decode", "3", "--capture",
                 "caches", "--rows", "0,5,10", "--quiet", "--out", str(path)]) == 0
    assert main(["export-paged", str(path), "--page-size", "4", "--shuffle", "5",
                 "--out", str(out)]) == 0
    with GoldenFile(path) as g, GoldenFile(out) as p:
        run = g.run_info()
        caches = [n for n in g.names if STEP_NAME.fullmatch(n)
                  and STEP_NAME.fullmatch(n).group(3) in PAGED_CACHES]
        kinds = {STEP_NAME.fullmatch(n).group(3) for n in caches}
        assert kinds == {"state.window_kv", "state.compress_kv", "state.index_k"}
        assert all(n.startswith("step0.") for n in caches)
        for name in caches:
            _, layer, what = STEP_NAME.fullmatch(name).groups()
            prefix = f"step0.layers.{layer}.paged.{PAGED_CACHES[what]}"
            want = g.get(name)
            got = unpage(p.get(prefix + ".pages"), p.get(prefix + ".block_table"), want.shape[0])
            assert np.array_equal(_bits(got), _bits(want))
        # The prefill's selections (the three rows held) as slots of the kv source's cache.
        n = 0
        for name in p.names:
            if not name.endswith("topk_slots"):
                continue
            layer = int(name.split(".")[2])
            entries = g.get(f"step0.layers.{layer}.shared.topk_idxs")
            got = p.get(name)
            assert entries.shape[0] == 3 and got.shape == entries.shape
            src = run.config.kv_source_of(layer)
            comp = g.get(f"step0.layers.{src}.state.compress_kv")
            cpages = p.get(f"step0.layers.{src}.paged.compress_kv.pages")
            sel = entries >= run.prefill
            assert np.array_equal(got < 0, entries < 0) and sel.any()
            assert np.array_equal(_bits(cpages.reshape(-1, comp.shape[1])[got[sel]]),
                                  _bits(comp[entries[sel] - run.prefill]))
            n += 1
        assert n == 3                   # the 3 index sources' prefill selections
