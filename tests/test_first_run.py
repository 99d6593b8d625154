"""The first run's measurement (benchmarks/first_run.py) times the command as a user runs it and
reads how many kernels it compiled from what compile_ahead prints."""

import pytest

from benchmarks import first_run
from ds41numba import compile_ahead as ahead
from ds41numba.golden import load_golden


def test_the_kernels_compiled_are_read_from_compile_aheads_own_message(monkeypatch, capsys):
    kernels = [ahead.Kernel("*", 1.0, f"m:k{i}", "(int64,)") for i in range(7)]
    monkeypatch.setattr(ahead, "_enabled", lambda: True)
    monkeypatch.setattr(ahead, "_missing", lambda tiers, lists=(): kernels)
    monkeypatch.setattr(ahead, "_cores", lambda: 1)
    monkeypatch.setattr(ahead, "_compile", lambda families, tiers, lists=(): list(families))
    assert ahead.compile_ahead() == 7
    assert first_run._COMPILING.search(capsys.readouterr().err).group(1) == "7"


def test_a_golden_is_timed_as_the_command_runs_it(tmp_path):
    out = tmp_path / "golden.safetensors"
    seconds, compiled = first_run.golden_seconds(str(out))     # this session's numba cache
    assert seconds > 0 and isinstance(compiled, int)
    info, tensors = load_golden(out)
    assert info.preset == "tiny" and tensors


def test_a_failed_golden_raises_with_its_message(tmp_path):
    with pytest.raises(RuntimeError, match="preset"):
        first_run.golden_seconds(str(tmp_path / "g.safetensors"), preset="no-such-preset")
