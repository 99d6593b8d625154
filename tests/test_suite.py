"""ds41numba suite: the cases a config calls for, determinism, resuming, refusals, exact replay,
and the planted off-by-ones each case must catch."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from ds41numba import testing
from ds41numba.cli import main
from ds41numba.config import preset
from ds41numba.golden import GoldenError, GoldenFile, replay
from ds41numba.golden.suite import (MANIFEST, PLANTED, plan_cases, visible_count, write_suite)
from ds41numba.golden.suite_inputs import read_suite
from test_suite_example import SUITE, numpy_indexer


def _tree(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def test_cases_follow_the_config():
    """v41-flash layers 2 (ratio 2) and 20 (ratio 1, the candidate source): every item at each
    ratio where it can occur, lengths from index_topk, the window, the candidate blocks and a
    page of 64."""
    c = preset("v41-flash")
    cases = {k.name: k for k in plan_cases(c, (2, 20))}
    assert set(cases) == {
        "r2-prompt-one-short-of-group", "r2-first-complete-group", "r2-prompt-shorter-than-ratio",
        "r2-rows-with-no-compressed-position", "r2-decode-completes-group",
        "r2-query-sees-topk-or-one-more", "r2-lengths-not-a-page-multiple",
        "r1-first-complete-group", "r1-decode-completes-group", "r1-query-sees-topk-or-one-more",
        "r1-last-partial-candidate-block", "r1-lengths-not-a-page-multiple",
        "prompt-shorter-than-window", "window-wrap", "ties-nan-and-inf-rows", "ties-topk-boundary",
        "int32-offsets-near-1m", "long-context-decode"}
    topk = cases["r2-query-sees-topk-or-one-more"]
    assert topk.prefill == 1026 and {1021, 1023, 1025} <= set(topk.positions)
    assert [visible_count(p, 2) for p in (1021, 1023, 1025)] == [511, 512, 513]
    assert cases["r1-query-sees-topk-or-one-more"].prefill == 513
    cand = cases["r1-last-partial-candidate-block"]
    assert (cand.prefill, cand.layers) == (2048 * 8 + 1, (20,))
    assert cases["r2-lengths-not-a-page-multiple"].prefill == 2 * 65 + 1
    assert cases["window-wrap"].prefill == 127 and {127, 128} <= set(cases["window-wrap"].positions)
    assert cases["r2-prompt-one-short-of-group"].prefill % 4 == 3
    assert cases["int32-offsets-near-1m"].prefill == (1 << 20) - 3
    assert cases["int32-offsets-near-1m"].layers == (20,)       # ratio 1: the largest offsets
    tiny = {k.name for k in plan_cases(preset("tiny"), range(6))}
    assert "r1-prompt-shorter-than-ratio" not in tiny and "r1-first-complete-group" in tiny


def test_suite_is_deterministic_and_resumes(tmp_path, capsys):
    """An interrupted suite continues where it stopped; the directory ends as the bytes of an
    uninterrupted one (SUITE, written by test_suite_example)."""
    out = tmp_path / "s"
    written = []

    def interrupt_after_three(plan, path):
        if len(written) == 3:
            raise KeyboardInterrupt
        from ds41numba.golden import write_golden
        write_golden(plan, path, force=True)
        written.append(path)

    with pytest.raises(KeyboardInterrupt):
        write_suite(preset("tiny"), "tiny", tuple(range(6)), out, write_case=interrupt_after_three)
    assert len(json.loads((out / MANIFEST).read_text())["cases"]) == 3
    capsys.readouterr()
    assert main(["suite", "--preset", "tiny", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(l.strip().startswith("kept") for l in lines) == 3
    assert sum(l.strip().startswith("written") for l in lines) == 15
    assert _tree(out) == _tree(SUITE)
    # The long cases run their prefill's key side only (GoldenPlan rows=()): built, none left.
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["not_built"] == []
    for name in ("int32-offsets-near-1m", "long-context-decode"):
        entry = next(e for e in manifest["cases"] if e["name"] == name)
        with GoldenFile(out / entry["file"]) as g:
            assert g.run_info().rows == ()
            assert g.get("step0.layers.5.out").shape[0] == 0


def _copy(tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(SUITE, out)
    return out


def _one_line(capsys, argv, text):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert text in err and len(err.strip().splitlines()) == 1, err


def test_bad_suites_are_one_line_and_exit_2(tmp_path, capsys):
    _one_line(capsys, ["suite", "--check", str(tmp_path)], "is not a ds41numba suite (no manifest.json)")
    (tmp_path / "x.txt").write_text("x")
    _one_line(capsys, ["suite", "--preset", "tiny", "--out", str(tmp_path)],
              "is not empty and not a suite")
    out = _copy(tmp_path)
    _one_line(capsys, ["suite", "--preset", "tiny", "--seed", "1", "--out", str(out)],
              "holds a suite of other arguments")
    case = out / "window-wrap.safetensors"
    data = bytearray(case.read_bytes())
    data[-1] ^= 1
    case.write_bytes(bytes(data))
    _one_line(capsys, ["suite", "--check", str(out)], "case file window-wrap.safetensors was changed")
    _one_line(capsys, ["suite", "--preset", "tiny", "--out", str(out)],
              "case file window-wrap.safetensors was changed")
    with pytest.raises(GoldenError, match="was changed"):
        testing.suite_cases(out)
    (out / MANIFEST).write_text("{}")
    _one_line(capsys, ["suite", "--check", str(out)], "is not a suite manifest")
    assert main(["suite", "--check", SUITE]) == 0


@pytest.mark.parametrize("case", testing.suite_cases(SUITE))
def test_every_case_replays_exactly(case):
    report = replay(case.path, exact_index=True)
    assert report.ok, report.text()
    assert report.summary()["bit_identical_fraction"] == 1.0


# --------------------------------------------------------------------------- planted bugs


def _window_row(position, prefill, window, bug):
    """The window entries of the query at ``position`` (prefill rows: positions; decode: the
    ring's slots oldest first), with a planted window bug: one row more or fewer (prefill),
    the ring's oldest slot one off (decode)."""
    d = {"window+1": -1, "window-1": 1}.get(bug, 0)
    if position < prefill:
        n = min(prefill, window)
        pos = max(0, position - window + 1 + d) + np.arange(n)
        return np.where(pos > position, -1, pos)
    slots = (np.arange(window) + position % window + 1 + d) % window
    return np.where(slots > position, -1, slots)


def _failing_positions(case, bug) -> set:
    """Positions of ``case`` at which a kernel with the planted ``bug`` disagrees with the
    golden: its index selection (the numpy indexer with the bug's visible counts) or its
    window entries."""
    failed = set()
    run = case.golden.run_info()
    c = run.config
    for step in case.steps():
        for layer in case.index_layers():
            i = case.indexer_inputs(step, layer)
            r = c.ratio(layer)
            vis = np.clip([visible_count(int(p), r, bug) for p in i.positions], 0, i.keys.shape[0])
            got = numpy_indexer(i.index_q, i.weights, i.keys, vis, i.topk, i.offset)
            for j, p in enumerate(i.positions):
                try:
                    testing.assert_index_rows(got[j:j + 1], i.want[j:j + 1], _row(i.evidence, j),
                                              offset=i.offset, visible=i.visible[j:j + 1])
                except AssertionError:
                    failed.add(int(p))
        idx = case.golden.get(f"step{step}.layers.{case.entry['layers'][0]}.idx")
        for e in case.entry["positions"]:
            if e["step"] != step:
                continue
            want = _window_row(e["position"], run.prefill, c.window_size, "")
            row = idx[e["row"], :want.size]
            assert np.array_equal(row, want)            # the honest window is the golden's
            if not np.array_equal(row, _window_row(e["position"], run.prefill, c.window_size, bug)):
                failed.add(e["position"])
    return failed


def _row(scores, j):
    from ds41numba.golden.ties import RowScores
    return RowScores(*(a[j:j + 1] for a in (scores.topk_idxs, scores.topk_scores,
                                           scores.runner_idxs, scores.runner_scores)), "golden")


#: The item each planted bug is there for: that case must catch it.
SHOULD_CATCH = {
    "group-late": ["r2-prompt-one-short-of-group", "r2-first-complete-group",
                   "r2-decode-completes-group", "r2-prompt-shorter-than-ratio"],
    "group-early": ["r2-rows-with-no-compressed-position"],
    "visibility+1": ["r2-rows-with-no-compressed-position", "r1-query-sees-topk-or-one-more",
                     "r2-query-sees-topk-or-one-more"],
    "visibility-1": ["r1-query-sees-topk-or-one-more", "r2-query-sees-topk-or-one-more",
                     "r1-last-partial-candidate-block", "r2-lengths-not-a-page-multiple"],
    "window+1": ["window-wrap"], "window-1": ["window-wrap"],
}


def test_planted_off_by_ones_are_caught():
    """Each planted bug fails every case at every position its manifest entry names for it; every
    bug is caught by at least one case, and by the cases it is there for."""
    caught = {bug: set() for bug in PLANTED}
    for case in read_suite(SUITE):
        for bug in PLANTED:
            failed = _failing_positions(case, bug)
            named = {e["position"] for e in case.entry["positions"] if bug in e["catches"]}
            assert named <= failed, (case.name, bug, sorted(named - failed))
            if failed:
                caught[bug].add(case.name)
        assert any(e["catches"] for e in case.entry["positions"]), case.name
        case.close()
    for bug in PLANTED:
        assert caught[bug], bug
        assert set(SHOULD_CATCH[bug]) <= caught[bug], (bug, sorted(caught[bug]))


def test_the_page_case_pages_with_the_manifests_page_size(tmp_path):
    """The paging case's caches fill their pages but one row: export-paged takes the manifest's
    page size and the pages rebuild the golden's caches."""
    from ds41numba.golden import GoldenFile
    from ds41numba.golden.paged import unpage
    manifest = json.loads(open(os.path.join(SUITE, MANIFEST)).read())
    case = next(e for e in manifest["cases"] if e["name"] == "r2-lengths-not-a-page-multiple")
    size = manifest["page_size"]
    assert size == case["lengths"]["page_size"] == 8          # tiny's window
    assert case["lengths"]["compressed_after_prefill"] == size + 1
    out = tmp_path / "paged.safetensors"
    assert main(["export-paged", os.path.join(SUITE, case["file"]), "--page-size", str(size),
                 "--shuffle", "1", "--out", str(out)]) == 0
    with GoldenFile(os.path.join(SUITE, case["file"])) as g, GoldenFile(out) as p:
        want = g.get("step0.layers.2.shared.compress_kv")
        pre = "step0.layers.2.paged.compress_kv."
        pages = p.get(pre + "pages")
        assert pages.shape[0] == 2 and want.shape[0] == size + 1
        got = unpage(pages, p.get(pre + "block_table"), want.shape[0])
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
