"""``compare --plot``: a picture of where a candidate differs from a golden.

One row of panels per failing or swapped group of tensors (``out``, ``o``, ``idx``, ...):

* index groups: every differing row as a point at (query position, layer), orange for a
  boundary swap and red for a wrong row;
* float groups: the largest |diff| / tolerance of each query position and layer as a heat map
  (a tile-boundary or wrap-around bug shows as a stripe; the scale stops at 4 x tolerance), and
  for ``[seqlen, H, hd]`` tensors the same by position and head for the worst layer.

Positions are those of the run (step 0's rows are the prefill's positions, step s >= 1 the
decode of position ``prefill + s - 1``), binned to at most ``_COLUMNS`` columns (each bin shows
its largest value). Needs matplotlib (``pip install 'ds41numba[plot]'``).
"""

from __future__ import annotations

import os
import textwrap

import numpy as np

from .captures import STEP_NAME
from .report import CompareReport, group_of
from .errors import GoldenError
from .files import GoldenFile
from .rows import match_rows

__all__ = ["plot_report", "check_plot_target"]

_COLUMNS = 1024
_VMAX = 4       # colour scale of |diff| / tolerance: 1 is the bar; more than 4 shows as 4
_TITLE_CHARS = 140   # a title line at 9 points within the 13-inch figure


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise GoldenError("--plot needs matplotlib: pip install 'ds41numba[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_plot_target(path):
    """Refuse, before comparing, a plot that could not be drawn or written."""
    _pyplot()
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(directory):
        raise GoldenError(f"--plot: directory {directory!r} does not exist")


def _position(step: int, row: int, prefill: int, held=None) -> int:
    """A row's position: a prefill row's own (``held``: the positions a ``--rows`` golden's
    rows stand for), a decode step's token."""
    if step:
        return prefill + step - 1
    return row if held is None else int(held[row])


def _binned(values: np.ndarray, positions: np.ndarray, total: int) -> np.ndarray:
    """Max of ``values [n, ...]`` per column of ``positions`` binned into <= _COLUMNS columns."""
    cols = min(_COLUMNS, max(total, 1))
    out = np.full((cols,) + values.shape[1:], np.nan, np.float64)
    b = positions * cols // max(total, 1)
    for i in np.unique(b):
        out[i] = np.nanmax(values[b == i], axis=0)
    return out


def plot_report(report: CompareReport, golden_path, candidate_path, out_path) -> str:
    """Draw ``report``'s failing and swapped groups into ``out_path`` (PNG); returns the path."""
    plt = _pyplot()
    # A group is drawn when one of its tensors fails or differs; then all of its tensors are
    # (the rows that agree are the picture's background).
    groups: dict[str, list] = {}
    drawn = set()
    for r in report.results:
        m = STEP_NAME.fullmatch(r.name)
        if m is None or r.kind not in ("index", "float") or r.informational:
            continue
        groups.setdefault(group_of(r.name), []).append((int(m.group(1)), int(m.group(2)), r))
        if not r.ok or r.rows_differ or r.swap_rows:
            drawn.add(group_of(r.name))
    groups = {g: rs for g, rs in groups.items() if g in drawn}
    with GoldenFile(golden_path) as golden_file, GoldenFile(candidate_path) as cand_file:
        info = golden_file.step_info() or cand_file.step_info()
        prefill = info.prefill if info is not None else 0
        golden, cand, held, _ = match_rows(golden_file, cand_file, prefill)
        steps = max((s for rs in groups.values() for s, _, _ in rs), default=0)
        total = max(prefill + steps, 1)
        panels = [(g, rs) for g, rs in groups.items()]
        n = max(1, len(panels))
        fig, axes = plt.subplots(n, 2, figsize=(13, 3.2 * n), squeeze=False)
        if not panels:
            axes[0, 0].text(0.5, 0.5, "no differences", ha="center", va="center")
        for (group, rs), ax in zip(panels, axes):
            if rs[0][2].kind == "index":
                _index_panel(ax, group, rs, prefill, total)
            else:
                _float_panel(ax, group, rs, golden, cand, prefill, total, held)
        # The whole summary, wrapped to the figure's width, above the panels.
        title = textwrap.fill(f"{os.path.basename(str(candidate_path))} against "
                              f"{os.path.basename(str(golden_path))}: {report.summary_line()}",
                              width=_TITLE_CHARS)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.15 * (title.count("\n") + 1) + 0.02)
                               / fig.get_figheight()))
        fig.savefig(out_path, dpi=90)
        plt.close(fig)
    return os.fspath(out_path)


def _index_panel(ax, group, rs, prefill, total):
    layers = sorted({layer for _, layer, _ in rs})
    kinds = (("boundary swap", "orange", -0.15, lambda r: getattr(r, "swap_list", [])),
             ("wrong", "red", 0.15, lambda r: getattr(r, "wrong_list", [])
              if r.tie_aware else r.first_rows))
    for kind, color, dy, rows_of in kinds:
        xs, ys = [], []
        for step, layer, r in rs:
            rows = rows_of(r)
            xs += [_position(step, row, prefill) for row in rows]   # positions already
            ys += [layer + dy] * len(rows)
        if xs:
            ax[0].scatter(xs, ys, s=6, c=color, label=f"{kind} ({len(xs)} rows)")
        counts = [sum(len(rows_of(r)) for _, lay, r in rs if lay == layer) for layer in layers]
        ax[1].bar([str(l) for l in layers], counts, color=color, label=kind,
                  bottom=None if color == "orange" else [sum(len(kinds[0][3](r)) for _, lay, r in rs
                                                             if lay == layer) for layer in layers])
    ax[0].set(title=f"{group}: differing index rows", xlabel="query position", ylabel="layer",
              xlim=(-0.5, total - 0.5), ylim=(layers[0] - 0.5, layers[-1] + 0.5))
    ax[0].set_yticks(layers)
    ax[0].legend(fontsize=7, loc="upper left")
    ax[1].set(title=f"{group}: differing rows per layer", xlabel="layer", ylabel="rows")
    ax[1].legend(fontsize=7)


def _float_panel(ax, group, rs, golden, cand, prefill, total, held):
    layers = sorted({layer for _, layer, _ in rs})
    heat = np.full((len(layers), min(_COLUMNS, total)), np.nan)
    worst, worst_val = None, -1.0
    for step, layer, r in rs:
        want = np.asarray(golden.get(r.name), np.float32)
        got = np.asarray(cand.get(r.name), np.float32)
        if want.ndim < 2:
            continue
        with np.errstate(invalid="ignore"):
            err = np.abs(got - want) / r.tolerance
        err = np.where(np.isnan(want) & np.isnan(got), 0.0, err)
        per_row = np.nanmax(err.reshape(err.shape[0], -1), axis=1)
        pos = np.array([_position(step, i, prefill, held.get(layer)) for i in range(want.shape[0])],
                       np.int64)
        line = _binned(per_row, pos, total)
        row = layers.index(layer)
        heat[row] = np.fmax(heat[row], line)
        if want.ndim == 3 and float(np.nanmax(per_row, initial=0)) > worst_val:
            worst_val = float(np.nanmax(per_row, initial=0))
            worst = (r.name, _binned(np.nanmax(err, axis=2), pos, total))
    im = ax[0].imshow(heat, aspect="auto", interpolation="nearest", cmap="magma",
                      extent=(0, total, len(layers) - 0.5, -0.5), vmin=0, vmax=_VMAX)
    ax[0].set_yticks(range(len(layers)), [str(l) for l in layers])
    ax[0].set(title=f"{group}: max |diff| / tolerance by position and layer (capped at {_VMAX})",
              xlabel="query position", ylabel="layer")
    ax[0].figure.colorbar(im, ax=ax[0])
    if worst is not None:
        name, by_head = worst
        im = ax[1].imshow(by_head.T, aspect="auto", interpolation="nearest", cmap="magma",
                          extent=(0, total, by_head.shape[1] - 0.5, -0.5), vmin=0, vmax=_VMAX)
        ax[1].set(title=f"{name}: by position and head", xlabel="query position", ylabel="head")
        ax[1].set_yticks(range(by_head.shape[1]))
        ax[1].figure.colorbar(im, ax=ax[1])
    else:
        per_layer = [np.nanmax(heat[i], initial=0) for i in range(len(layers))]
        ax[1].bar([str(l) for l in layers], per_layer, color="purple")
        ax[1].axhline(1.0, color="k", lw=0.8, ls="--")
        ax[1].set(title=f"{group}: worst |diff| / tolerance per layer", xlabel="layer")
