"""What the command line's arguments name: the layers of ``--layers``, the positions of
``--capture-rows`` and ``--rows``, a run's default length, and its config (``--preset``,
``--config``, a ``--weights`` directory's ``config.json``). Each refuses a bad value with a
one-line :class:`~ds41numba.golden.GoldenError` naming the option."""

from __future__ import annotations

import json
import os
import re

from .config import AttnConfig, preset
from .golden.errors import GoldenError
from .golden.weights_dir import dir_config_differences, load_dir_config

__all__ = ["parse_layers", "parse_rows", "default_run", "load_config", "run_config"]


def _number_list(text: str, flag: str, noun: str, limit: int, past: str) -> tuple[int, ...]:
    """The integers ``"2,3,20-24"`` names, sorted, duplicates dropped; ``noun`` says what a part
    must be, and a number >= ``limit`` is refused with ``past`` (formatted with it as ``i``)."""
    items = set()
    for part in str(text).split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise GoldenError(f"{flag}: {part!r} is not {noun}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise GoldenError(f"{flag}: range {part!r} runs backwards")
        for i in (lo, hi):
            if i >= limit:
                raise GoldenError(f"{flag}: " + past.format(i=i))
        items.update(range(lo, hi + 1))
    return tuple(sorted(items))


def parse_layers(text: str, n_layers: int) -> tuple[int, ...]:
    """The layers ``--layers`` names.

    Args:
        text: numbers and ranges, e.g. ``"2,3,20-24"``.
        n_layers: the config's layer count (every layer must be below it).

    Returns:
        The layers, sorted, duplicates dropped: ``"2,3,20-24"`` -> ``(2, 3, 20, 21, 22, 23, 24)``.

    Raises:
        GoldenError: a part is not a number or range, a range runs backwards, or a layer is
            not one of the config's.
    """
    return _number_list(text, "--layers", "a layer number or range (write e.g. 20 or 2,3,20-24)",
                        n_layers, f"layer {{i}} is not a layer of this config (0..{n_layers - 1})")


def parse_rows(text: str, total: int, seed: int = 0, flag: str = "--capture-rows",
               what: str = "run's") -> tuple[int, ...]:
    """The positions ``--capture-rows`` (or ``--rows``) names.

    Args:
        text: ``"0,5,100-120"`` (positions and ranges), ``"none"``, ``"first:N"``,
            ``"last:N"``, ``"every:N"`` (0, N, 2N, ...) or ``"random:N"``.
        total: the positions' count (the run's tokens; for ``--rows`` the prefill's); every
            position must be below it.
        seed: for ``random:N``, the seed of numpy's ``default_rng(seed).choice``.
        flag: the option, ``what``: whose positions, as the one-line errors name them.

    Returns:
        The positions, sorted, duplicates dropped (``random:N``: N distinct ones).

    Raises:
        GoldenError: a malformed part, a backward range, a position past the run, or ``N``
            outside ``1 .. total``.
    """
    text = str(text).strip()
    if text == "none":
        return ()
    m = re.fullmatch(r"(random|first|last|every):(\d+)", text)
    if m:
        kind, n = m.group(1), int(m.group(2))
        if not 1 <= n <= total:
            raise GoldenError(f"{flag}: {kind}:{n} needs 1 .. {total} (the {what} tokens)")
        if kind == "first":
            return tuple(range(n))
        if kind == "last":
            return tuple(range(total - n, total))
        if kind == "every":
            return tuple(range(0, total, n))
        import numpy as np
        return tuple(sorted(int(p) for p in np.random.default_rng(seed).choice(total, n, replace=False)))
    return _number_list(text, flag, "a position, a range, none, first:N, last:N, every:N or "
                        "random:N (write e.g. 0,5,100-120 or random:16)", total,
                        f"position {{i}} is past the {what} {total} tokens")


def default_run(preset_name: str | None) -> tuple[int, int]:
    """The run's length when ``--prefill`` / ``--decode`` are not given.

    Args:
        preset_name: a preset's name, or None / "" for a config file.

    Returns:
        ``(prefill, decode)``: the reference goldens' runs for their presets (``mixed``: 203 and
        48), else 12 and 40.
    """
    return {"tiny": (12, 40), "mixed": (203, 48)}.get(preset_name or "", (12, 40))


def load_config(preset_name: str | None, config_path: str | None) -> tuple[AttnConfig, str]:
    """The config of a run.

    Args:
        preset_name: ``--preset`` (None: ``tiny`` unless a config file is given).
        config_path: ``--config``, a JSON file in the reference's ``ModelArgs`` names or a
            Hugging Face ``config.json``; wins over ``preset_name``.

    Returns:
        ``(config, preset name)``; the name is "" for a config file (the file's metadata says so).

    Raises:
        GoldenError: an unknown preset, an unreadable file, or an invalid config (one line).
    """
    try:
        if config_path is not None:
            return AttnConfig.from_json(config_path), ""
        name = preset_name or "tiny"
        return preset(name), name
    except ValueError as e:
        msg = str(e)
        raise GoldenError(msg if msg.startswith(("config", "unknown preset")) else f"config: {msg}") from None


def run_config(preset_name: str | None, config_path: str | None,
               weights_dir: str | None) -> tuple[AttnConfig, str]:
    """:func:`load_config`, or with ``--weights DIR`` its ``config.json``: alone, or checked
    against the ``--preset``/``--config`` given, field by attention field."""
    if weights_dir is None:
        return load_config(preset_name, config_path)
    found = load_dir_config(weights_dir)
    if preset_name is None and config_path is None:
        return found, ""
    config, name = load_config(preset_name, config_path)
    differ = dir_config_differences(config, found)
    if differ:
        key = differ[0]
        given = f"--preset {name}" if name else f"--config {config_path}"
        raise GoldenError(f"--weights: {os.path.join(weights_dir, 'config.json')} has {key} "
                          f"{json.dumps(found.to_dict()[key])}, {given} has {key} "
                          f"{json.dumps(config.to_dict()[key])}")
    return config, name
