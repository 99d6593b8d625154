"""The backend's tiers and switches (ds41numba.numerics.backend)."""

import pytest

from ds41numba import numerics as nm


def test_backend_tiers_nest():
    """Each tier runs what the one below runs plus one instruction set; use_backend switches
    every caller's answer and refuses a name it does not know."""
    assert nm.backend() in nm.BACKENDS
    runnable = nm.BACKENDS[nm.BACKENDS.index(nm.backend()):]
    for tier in runnable:
        with nm.use_backend(tier):
            assert nm.backend() == tier
            assert nm.tier_at_least("amx") == (tier == "amx")
            assert nm.tier_at_least("avx512vnni") == (tier in ("amx", "avx512vnni"))
            assert nm.tier_at_least("avx512bf16") == (tier not in ("avx2int8", "blas"))
            assert nm.tier_at_least("avx2int8") == (tier != "blas")
    with pytest.raises(ValueError, match="not one of"):
        with nm.use_backend("avx2"):
            pass
    with pytest.raises(ValueError, match="not one of"):
        nm.tier_at_least("avx2")


@pytest.mark.parametrize("env, highest", [("DS41NUMBA_AMX", "avx512vnni"), ("DS41NUMBA_INT8_DOT", "avx512bf16"),
                                          ("DS41NUMBA_BF16_DOT", "avx2int8"), ("DS41NUMBA_AVX2_INT8", "blas")])
def test_backend_environment_switches(env, highest):
    """``DS41NUMBA_AMX=0`` stops below the AMX tier, ``DS41NUMBA_INT8_DOT=0`` below the VNNI
    tier, ``DS41NUMBA_BF16_DOT=0`` below the BF16 tier, ``DS41NUMBA_AVX2_INT8=0`` at BLAS."""
    import os
    import subprocess
    import sys
    code = "from ds41numba.numerics import backend; print(backend())"
    got = subprocess.run([sys.executable, "-c", code], env={**os.environ, env: "0"},
                         capture_output=True, text=True, check=True).stdout.strip()
    tiers = nm.BACKENDS
    assert got == tiers[max(tiers.index(highest), tiers.index(nm.backend()))]
