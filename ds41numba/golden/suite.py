"""The edge-case suite (``ds41numba suite``): small goldens at the places kernels get wrong.

One golden proves a kernel right at one length and one set of positions; the bugs shipped in
sparse-attention kernels sit at particular places: a prompt one short of a compression group,
the first complete group, a prompt shorter than the ratio or the window, the window's wrap, a
decode step that completes a group, a query that sees exactly ``index_topk`` positions or one
more, the last partially filled candidate block, rows that see no compressed position, NaN
scores, lengths that are not a multiple of a page. :data:`ITEMS` lists them, each a rule that
turns a config (its ratios, window, ``index_topk``, candidate blocks) into a :class:`Case`: a
run (prefill, decode, profile, layers) and the positions that matter. A case is built for every
compress ratio of the layers asked for where the item depends on the ratio.

Every case records, at its positions, what the indexer consumed and produced
(``--capture-rows``), so a kernel can be run on them alone (:func:`ds41numba.testing.suite_cases`).
Each position lists the planted off-by-ones (:data:`PLANTED`) that must make the case fail
there: the compressed positions a query sees one more or one fewer, a compression group's
boundary one token late or early, the window one row longer or shorter.

The directory holds one ``NAME.safetensors`` per case and ``manifest.json``; the manifest
(sorted keys, no times) and the goldens are the same bytes for the same arguments. The
manifest is rewritten after each case, so an interrupted suite continues where it stopped:
a case whose file carries the manifest's checksum is kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

from ..config import AttnConfig
from .errors import GoldenError
from .files import check_target, fsync_dir
from .generator import checked_seed

__all__ = ["MANIFEST", "SUITE_FORMAT", "PLANTED", "ITEMS", "Case", "plan_cases", "write_suite",
           "read_manifest", "checksum", "visible_count", "window_start", "catches"]

MANIFEST = "manifest.json"
SUITE_FORMAT = "ds41numba-suite"
SUITE_VERSION = 1
#: The page size engines commonly use (the paging case's lengths are one past a multiple of it).
PAGE_SIZE = 64
#: Prefill rows above which a case records ``--capture io`` (with its samples) instead of ``all``,
#: in windows: ``all`` holds ``[seqlen, heads, head_dim]`` captures in memory.
_ALL_CAPTURE_WINDOWS = 4

#: The planted off-by-ones: compressed visibility +-1, a group's boundary one token late or
#: early (the compressed positions a query at position p sees: (p + 1 -+ 1) // r), the window
#: one row longer or shorter.
PLANTED = ("visibility+1", "visibility-1", "group-late", "group-early", "window+1", "window-1")


def visible_count(position: int, ratio: int, bug: str = "") -> int:
    """Compressed positions a query at ``position`` sees, ``(position + 1) // ratio`` (prefill or
    decode alike), or what a kernel with the planted ``bug`` computes."""
    shift = {"group-late": -1, "group-early": 1}.get(bug, 0)
    n = max(0, position + 1 + shift) // ratio
    return n + {"visibility+1": 1, "visibility-1": -1}.get(bug, 0)


def window_start(position: int, window: int, bug: str = "") -> int:
    """The oldest position a query at ``position`` sees in the window (its window holds
    ``position - window + 1 .. position``), or what a kernel with a window ``bug`` uses."""
    return max(0, position - window + 1 - {"window+1": 1, "window-1": -1}.get(bug, 0))


@dataclass(frozen=True)
class Case:
    """One golden of the suite: its run and the positions that matter (position -> why)."""

    name: str
    covers: str
    prefill: int
    decode: int
    positions: dict
    ratio: int = 0                  # the compress ratio the item is about (0: every layer's)
    profile: str = "default"
    layers: tuple = ()              # () -> the layers asked for
    page_size: int = 0              # the page size the lengths are about (0: none)
    requires: str = ""              # a golden option this ds41numba lacks: the case is listed, not built
    lengths: dict = field(default_factory=dict)
    asked: tuple = ()               # the layers asked for that the case is about


# --------------------------------------------------------------------------- the items


def _one_short(c, r):
    if r < 2:
        return None
    p = 4 * r - 1
    return Case(f"r{r}-prompt-one-short-of-group", f"a {p}-token prompt, one short of its 4th "
                f"group of {r} (a wrong token whenever the prompt is r-1 mod r), then the decode "
                f"that completes the group", p, 2,
                {p - 1: "the prompt's last row: 3 groups visible, the 4th one short",
                 p: "the decode that completes the 4th group"}, r)


def _first_group(c, r):
    pos = {r - 1: "the first row that sees a compressed position (the first complete group)",
           r: "the first decode after the first group"}
    if r > 1:
        pos[r - 2] = "the last row before the first group completes (sees none)"
    return Case(f"r{r}-first-complete-group", f"a prompt of exactly one group of {r}: the "
                f"compressor's first complete group", r, 1, pos, r)


def _shorter_than_ratio(c, r):
    if r < 2:
        return None
    p = r - 1
    return Case(f"r{r}-prompt-shorter-than-ratio", f"a {p}-token prompt, shorter than the ratio "
                f"{r} (no compressed position, index rows of width 0), then decodes across the "
                f"first group", p, 2,
                {p - 1: "a prompt row with no compressed position",
                 p: "the decode that completes the first group",
                 p + 1: "the decode after it"}, r)


def _no_visible(c, r):
    if r < 2:
        return None
    p = 2 * r
    return Case(f"r{r}-rows-with-no-compressed-position", f"a {p}-token prompt whose first "
                f"{r - 1} rows see no compressed position: their index rows are all -1",
                p, 1, {0: "a row that sees no compressed position (all -1)",
                       r - 1: "the first row that sees one", p - 1: "the prompt's last row"}, r)


def _group_by_decode(c, r):
    p = 2 * r + 1
    done = 3 * r - 1        # the decode whose token completes the 3rd group
    return Case(f"r{r}-decode-completes-group", f"decode steps across a group of {r}: the step "
                f"at position {done} completes the 3rd group", p, done - p + 2,
                {done - 1: "the decode before the group completes",
                 done: "the decode that completes the group",
                 done + 1: "the decode after it"}, r)


def _topk_exact(c, r):
    k = c.index_topk
    p = (k + 1) * r
    pos = {k * r - 1: f"a query that sees exactly index_topk = {k} positions",
           (k + 1) * r - 1: f"a query that sees index_topk + 1 = {k + 1} positions",
           p: "the first decode"}
    if k * r - 1 - r >= 0:
        pos[k * r - 1 - r] = f"a query that sees index_topk - 1 = {k - 1} positions"
    return Case(f"r{r}-query-sees-topk-or-one-more", "queries that see index_topk - 1, exactly "
                "index_topk and index_topk + 1 compressed positions", p, 1, pos, r)


def _candidate_block(c, r):
    if c.candidate_source_layer < 0 or c.ratio(c.candidate_source_layer) != r:
        return None
    b, nb = c.candidate_block_size, c.candidate_topk_blocks
    n = nb * b + 1                    # one block more than the candidates keep, its last partial
    p = n * r
    return Case(f"r{r}-last-partial-candidate-block", f"queries whose last candidate block of "
                f"{b} holds one position, with one block more than the {nb} candidates kept",
                p, 1, {p - 1: f"the prompt's last row: {n} positions, the last block partial",
                       p - 1 - r: "the row before it: whole blocks only", p: "the first decode"},
                r, layers=_candidate_layers(c))


def page_size(c: AttnConfig) -> int:
    """The suite's page size: engines' 64 rows, or less where the window is not whole pages of
    64 (``export-paged`` needs the window's ring in whole pages)."""
    return math.gcd(PAGE_SIZE, c.window_size)


def _page_lengths(c, r):
    size = page_size(c)
    n = size + 1
    p = n * r + 1
    return Case(f"r{r}-lengths-not-a-page-multiple", f"{n} compressed positions and a "
                f"{p}-token prompt: one past a page of {size}, then a decode", p, 1,
                {p - 1: f"the prompt's last row: {n} compressed positions, one past a page",
                 p: "the first decode"}, r, page_size=size)


def _shorter_than_window(c, r):
    p = max(2, c.window_size // 2)
    return Case("prompt-shorter-than-window", f"a {p}-token prompt, shorter than the window of "
                f"{c.window_size}, then a decode", p, 1,
                {p - 1: "the prompt's last row", p: "the first decode: the ring not yet full"})


def _window_wrap(c, r):
    w = c.window_size
    return Case("window-wrap", f"a prompt of window - 1 = {w - 1} tokens, then decodes that fill "
                f"the ring of {w} and wrap it", w - 1, 3,
                {w - 2: "the prompt's last row", w - 1: "the decode that fills the ring",
                 w: "the decode that wraps the ring (overwrites its oldest slot)",
                 w + 1: "the decode after the wrap"})


def _nan_rows(c, r):
    return Case("ties-nan-and-inf-rows", "the ties profile: rows of NaN scores (position 17) and "
                "of -inf head weights (position 41) among tie-heavy rows", 43, 2,
                {17: "a row of NaN and +inf scores", 41: "a row of NaN and -inf scores",
                 42: "the prompt's last row", 43: "a decode"}, profile="ties")


def _tie_stress(c, r):
    rmax = max(c.ratio(i) for i in range(c.n_layers))
    k = c.index_topk
    p = rmax * (k + k // 2) + 1
    return Case("ties-topk-boundary", f"the ties profile over {p} tokens: index rows that tie "
                f"at the top-k boundary with more than index_topk = {k} positions visible",
                p, 2, {p - 1: "the prompt's last row, ties across the boundary",
                       p: "a decode", p + 1: "a decode"}, profile="ties")


#: What the long cases need: a prefill that runs only its key side (the teammate feature
#: ``golden --rows none``, GoldenPlan's ``rows=()``); without it they are listed, not built.
ROWS_NONE = "golden --rows none (the prefill's key side only)"


def rows_none_supported() -> bool:
    """Whether this ds41numba's golden runs can answer no prefill row (``GoldenPlan.rows``)."""
    from .run import GoldenPlan
    return "rows" in getattr(GoldenPlan, "__dataclass_fields__", {})


def _long_offsets(c, r):
    # At the smallest ratio of the layers asked: the most compressed positions, the largest
    # offsets; those layers only (the key side of 2^20 tokens is the suite's longest run).
    p = min(c.max_seq_len - 2, 1 << 20) - 1
    return Case("int32-offsets-near-1m", f"decodes after a {p}-token context: offsets and "
                f"slots near 2^20 positions (compressed positions at ratio {r})", p, 2,
                {p: "a decode near 2^20 positions", p + 1: "the next decode"}, r,
                requires=ROWS_NONE)


def _long_decode(c, r):
    p = min(c.max_seq_len - 4, 1 << 16)
    return Case("long-context-decode", f"decode steps after a {p}-token context", p, 3,
                {p: "a decode", p + 2: "the last decode"}, r, requires=ROWS_NONE)


#: The suite's items, in order: (rule, per ratio). A rule turns (config, ratio) into a Case, or
#: None where the item cannot occur (a prompt shorter than a ratio of 1).
ITEMS = (
    (_one_short, True), (_first_group, True), (_shorter_than_ratio, True), (_no_visible, True),
    (_group_by_decode, True), (_topk_exact, True), (_candidate_block, True),
    (_page_lengths, True), (_shorter_than_window, False), (_window_wrap, False),
    (_nan_rows, False), (_tie_stress, False), (_long_offsets, False), (_long_decode, False),
)


def _closure(c: AttnConfig, layers) -> tuple[int, ...]:
    """``layers`` with every layer they read, recursively."""
    found, todo = set(), list(layers)
    while todo:
        i = todo.pop()
        if i not in found:
            found.add(i)
            todo += [src for src, _ in c.sources_of(i)]
    return tuple(sorted(found))


def _candidate_layers(c: AttnConfig) -> tuple[int, ...]:
    """The candidate source and the layers that select among its blocks."""
    return (c.candidate_source_layer,) + tuple(i for i in range(c.n_layers) if c.uses_candidates(i))


def plan_cases(config: AttnConfig, layers) -> list[Case]:
    """Every case of the suite for ``config``'s ``layers``: the ratio items once for each
    compress ratio among them, the others once; each case's layers and lengths filled in.

    A case runs the layers it is about with every layer they read (a ratio-2 index source
    scores, on a decode step where it writes no keys, the keys another key owner wrote): a
    ratio's items the layers of that ratio, the others every layer asked for."""
    layers = tuple(sorted(set(layers)))
    ratios = sorted({config.ratio(i) for i in layers} - {0})
    cases = []
    for rule, per_ratio in ITEMS:
        for r in (ratios if per_ratio else [ratios[0] if ratios else 0]):
            case = rule(config, r)
            if case is None:
                continue
            asked = [i for i in layers if not case.ratio or config.ratio(i) == case.ratio]
            if case.layers:     # only these of the layers asked
                asked = [i for i in case.layers if i in asked]
                if not asked:
                    continue
            run_layers = _closure(config, asked)
            total = case.prefill + case.decode
            requires = (f"a config with max_seq_len >= {total}" if total > config.max_seq_len
                        else case.requires)
            positions = {int(p): why for p, why in sorted(case.positions.items()) if 0 <= p < total}
            cases.append(Case(case.name, case.covers, case.prefill, case.decode, positions,
                              case.ratio, case.profile, tuple(run_layers), case.page_size,
                              requires, _lengths(config, case), tuple(asked)))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), names
    return cases


def _lengths(c: AttnConfig, case: Case) -> dict:
    d = {"prefill": case.prefill, "decode": case.decode, "tokens": case.prefill + case.decode,
         "window": c.window_size, "index_topk": c.index_topk}
    if case.ratio:
        d["ratio"] = case.ratio
        d["compressed_after_prefill"] = case.prefill // case.ratio
    if case.page_size:
        d["page_size"] = case.page_size
    if "candidate" in case.name:
        d["candidate_block_size"] = c.candidate_block_size
        d["candidate_topk_blocks"] = c.candidate_topk_blocks
    return d


# --------------------------------------------------------------------------- what fails where


def catches(config: AttnConfig, case: Case, position: int, index_layers) -> list[str]:
    """The planted bugs (:data:`PLANTED`) that must change what a kernel gives at ``position``
    of ``case``: its index selection at one of ``index_layers`` (``visibility``,
    ``group`` bugs) or its window entries (``window`` bugs). Only certain failures are listed:
    a changed visible count the selection must show (every visible position is selected, and
    the keys of one more are recorded) or a changed window."""
    found = []
    step0 = position < case.prefill
    end = case.prefill if step0 else position + 1         # keys recorded: end // r
    for r in sorted({config.ratio(i) for i in index_layers}):
        n_keys = end // r
        k = min(config.index_topk, n_keys)
        c = visible_count(position, r)
        for bug in PLANTED[:4]:
            got = visible_count(position, r, bug)
            if got == c:
                continue
            if (got < c and 1 <= c <= k) or (got > c and c < n_keys and c + 1 <= k):
                found.append(bug)
    w = config.window_size
    for bug in PLANTED[4:]:
        if step0:
            if window_start(position, w, bug) != window_start(position, w):
                found.append(bug)
        elif position >= 1:
            found.append(bug)        # the decode's ring order turns by one slot
    return list(dict.fromkeys(found))


# --------------------------------------------------------------------------- the directory


def checksum(path) -> str:
    """sha256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _arguments(config: AttnConfig, preset: str, layers, seed: int) -> dict:
    return {"config": config.to_dict(), "preset": preset, "layers": list(layers), "seed": seed}


def _entry(config: AttnConfig, case: Case) -> dict:
    capture = ("all" if case.prefill <= _ALL_CAPTURE_WINDOWS * config.window_size
               and not case.requires else "io")
    index_layers = [i for i in case.asked if config.ratio(i) and config.is_index_source(i)]
    return {
        "name": case.name, "file": f"{case.name}.safetensors", "covers": case.covers,
        "prefill": case.prefill, "decode": case.decode, "profile": case.profile,
        "capture": capture, "layers": list(case.layers), "ratio": case.ratio,
        "index_layers": index_layers,
        "lengths": case.lengths,
        "positions": [{"position": p, "step": 0 if p < case.prefill else p - case.prefill + 1,
                       "row": p if p < case.prefill else 0, "why": why,
                       "catches": catches(config, case, p, index_layers)}
                      for p, why in case.positions.items()],
    }


def _write_manifest(directory: str, manifest: dict):
    path = os.path.join(directory, MANIFEST)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(directory)


def read_manifest(directory, verify: bool = True) -> dict:
    """The manifest of a suite directory; with ``verify`` every case file must exist with its
    checksum. A directory that is not a suite, or an edited or missing case, is a
    :class:`GoldenError` (one line)."""
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise GoldenError(f"{directory!r} is not a directory")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise GoldenError(f"{directory!r} is not a ds41numba suite (no {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise GoldenError(f"{path!r} is not a suite manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != SUITE_FORMAT:
        raise GoldenError(f"{path!r} is not a suite manifest (its format is not {SUITE_FORMAT!r})")
    if verify:
        for case in manifest.get("cases", []):
            if case.get("sha256") is None:
                raise GoldenError(f"{directory!r}: case {case['name']} was not written (an "
                                  f"interrupted suite: run the same suite command to finish it)")
            file = os.path.join(directory, case["file"])
            if not os.path.exists(file):
                raise GoldenError(f"{directory!r}: case file {case['file']} is missing")
            if checksum(file) != case["sha256"]:
                raise GoldenError(f"{directory!r}: case file {case['file']} was changed (its "
                                  f"sha256 is not the manifest's)")
    return manifest


def write_suite(config: AttnConfig, preset: str, layers, out, seed: int = 0, write_case=None,
                report=None) -> dict:
    """Write (or finish) the suite of ``config``'s ``layers`` into directory ``out``.

    ``write_case(plan, path)`` writes one golden (:func:`~.run.write_golden` by default);
    ``report(case, status, seconds)`` hears of each case (``written``, ``kept``, ``not built``). An
    existing ``out`` must be empty or a suite of the same arguments, whose cases with the
    manifest's checksum are kept (a case file that differs from its checksum is an error: it
    was edited). Returns the manifest.
    """
    from .run import GoldenPlan, write_golden
    write_case = write_case or (lambda plan, path: write_golden(plan, path, force=True))
    report = report or (lambda case, status, seconds: None)
    seed = checked_seed(seed)
    out = os.fspath(out)
    args = _arguments(config, preset, layers, seed)
    old = _existing(out, args)
    cases = plan_cases(config, layers)
    manifest = {"format": SUITE_FORMAT, "version": SUITE_VERSION, **args,
                "page_size": page_size(config),
                "planted": list(PLANTED), "cases": [], "not_built": []}
    for case in cases:
        if case.requires and not (case.requires == ROWS_NONE and rows_none_supported()):
            manifest["not_built"].append({"name": case.name, "covers": case.covers,
                                          "lengths": case.lengths, "needs": case.requires})
            report(case, "not built", 0.0)
            continue
        t0 = time.perf_counter()
        entry = _entry(config, case)
        path = os.path.join(out, entry["file"])
        known = old.get(case.name, {}).get("sha256")
        if os.path.exists(path) and known is not None:
            if checksum(path) != known:
                raise GoldenError(f"{out!r}: case file {entry['file']} was changed (its sha256 is "
                                  f"not the manifest's): remove it to rebuild it")
            entry["sha256"] = known
            status = "kept"
        else:
            extra = {"rows": ()} if case.requires == ROWS_NONE else {}
            plan = GoldenPlan(config=config, layers=case.layers, prefill=case.prefill,
                              decode=case.decode, seed=seed, capture=entry["capture"],
                              preset=preset, profile=case.profile,
                              capture_rows=tuple(case.positions), **extra)
            write_case(plan, path)
            entry["sha256"] = checksum(path)
            status = "written"
        manifest["cases"].append(entry)
        _write_manifest(out, {**manifest, "cases": manifest["cases"] + _pending(old, manifest)})
        report(case, status, time.perf_counter() - t0)
    _write_manifest(out, manifest)
    return manifest


def _pending(old: dict, manifest: dict) -> list:
    """Entries of the old manifest not yet redone (kept so a second interruption loses none)."""
    done = {e["name"] for e in manifest["cases"]}
    return [e for name, e in sorted(old.items()) if name not in done]


def _existing(out: str, args: dict) -> dict:
    """``{case name: old manifest entry}`` of a suite being continued in ``out`` (made if
    missing); an ``out`` that holds something else is an error."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise GoldenError(f"--out: {out!r} is not a directory")
    if not os.path.exists(out):
        check_target(out, force=False)     # its parent must exist
        os.mkdir(out)
        return {}
    if not os.path.exists(os.path.join(out, MANIFEST)):
        if os.listdir(out):
            raise GoldenError(f"--out: {out!r} is not empty and not a suite (no {MANIFEST})")
        return {}
    manifest = read_manifest(out, verify=False)
    if {k: manifest.get(k) for k in args} != args:
        raise GoldenError(f"--out: {out!r} holds a suite of other arguments (preset, config, "
                          f"layers or seed): use another directory")
    return {e["name"]: e for e in manifest.get("cases", [])}
