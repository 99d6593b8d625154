"""Fixtures shared by the test files."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import numpy as np
import pytest

from ds41numba import kernel_list
from ds41numba.compile_ahead import compile_ahead
from ds41numba.golden import RunInfo, load_golden
from helpers import DATA, LINEAR_CASES

_tracing = contextlib.ExitStack()


def pytest_configure(config):
    """With ``DS41NUMBA_TRACE_KERNELS=FILE`` set (``python -m ds41numba.kernel_list --suite``),
    the kernels the tests call are noted and written to FILE at the end, a JSON line each."""
    if os.environ.get(kernel_list.TRACE_ENV):
        config._kernel_calls = _tracing.enter_context(kernel_list.tracing([], strict=False))


def pytest_unconfigure(config):
    _tracing.close()
    calls = getattr(config, "_kernel_calls", None)
    if calls is not None:
        with open(os.environ[kernel_list.TRACE_ENV], "w") as f:
            f.writelines(json.dumps(call) + "\n" for call in calls)


def pytest_sessionstart(session):
    """On a cold numba cache (a fresh CI machine) the kernels the tests call compile on every
    core first, those of the default golden on every tier this CPU has and those only tests call
    (``tests/kernels.txt``); the tests load them instead of compiling them one after another."""
    compile_ahead(every_tier=True, extra=(kernel_list.SUITE_KERNELS,))


@dataclass(frozen=True)
class ReferenceGolden:
    """A reference golden of ``tests/data`` as ds41numba's reader reads it: the run (``config``,
    ``prefill``, ``decode``, ...) and every tensor by name (``golden["step0.layers.2.x"]``)."""

    name: str
    run: RunInfo
    tensors: dict

    @property
    def config(self):
        return self.run.config

    @property
    def weights(self) -> dict[str, np.ndarray]:
        """The parameters, ``{"layers.{i}.attn.NAME": array}``, as AttentionStack takes them."""
        return {k: v for k, v in self.tensors.items() if k.startswith("layers.")}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def start_pos(self, step: int) -> int:
        """Step 0 is the prefill; step s >= 1 decodes the token at ``prefill + s - 1``."""
        return 0 if step == 0 else self.run.prefill + step - 1


@pytest.fixture(scope="session")
def reference_golden():
    """``reference_golden(name)``: the reference golden ``tests/data/{name}.npz``, read once per
    session through the package's own reader (``ds41numba.golden.load_golden``)."""
    cache: dict[str, ReferenceGolden] = {}

    def load(name: str) -> ReferenceGolden:
        if name not in cache:
            cache[name] = ReferenceGolden(name, *load_golden(DATA / f"{name}.npz"))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def linear_cases():
    """``tests/data/linear_cases.npz`` read once per session: ``{"x", "w", case name: expected}``."""
    with np.load(LINEAR_CASES) as z:
        return {k: z[k] for k in z.files}
