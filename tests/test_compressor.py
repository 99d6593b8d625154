"""ds41numba.compressor against naive.compressor (a plain-loop replay written from SPEC.md):
ratio 1; ratio r > 1 with a prefill shorter than a group, with a trailing partial group, with
whole groups; decode across several group boundaries; and non-finite input in a group and in the
partial-group state.

Latents go through a BLAS dot product, so they are compared in bf16 steps (at most one step
anywhere and at least 99.9% identical, the SPEC's "How exact is exact"); the f32 partial-group
state is held to the worst-case summation bound of any order.
"""

import numpy as np
import pytest

import naive
from helpers import (EPS, assert_bf16_close, assert_f32_dot_close, bf16, nan_rows, nan_stack,
                     xs)
from ds41numba import to_bf16_rne
from ds41numba.compressor import CompressorState, CompressorWeights, compressor, latent_positions


def compressor_case(ratio, seed, dim=64, hd=32):
    rng = np.random.default_rng(seed)
    if ratio == 1:
        wkv, wgate = bf16(rng, (hd, dim), dim ** -0.5), None
    else:
        wkv = (rng.standard_normal((hd, dim)) * dim ** -0.5).astype(np.float32)
        wgate = (rng.standard_normal((hd, dim)) * dim ** -0.5).astype(np.float32)
    norm = to_bf16_rne((1.0 + 0.1 * rng.standard_normal(hd)).astype(np.float32))
    return rng, CompressorWeights(wkv=wkv, wgate=wgate, norm=norm)


def run_compressor(ratio, weights, x_steps):
    """The package compressor over a prefill and decode steps: latents, positions, state."""
    state = CompressorState.fresh(ratio, weights.wkv.shape[0])
    latents, positions = [], []
    start_pos = 0
    for x in x_steps:
        latents.append(compressor(x, start_pos, ratio, weights, state, EPS))
        positions.append(latent_positions(start_pos, x.shape[0], ratio).tolist())
        start_pos += x.shape[0]
    return latents, positions, state


# =============================================================================== ratio 1


def test_compressor_ratio_1_one_latent_per_token():
    rng, w = compressor_case(1, seed=1)
    x = bf16(rng, (11, 64))
    steps = [x[:7]] + [x[i:i + 1] for i in range(7, 11)]
    got, got_pos, state = run_compressor(1, w, steps)
    want, want_pos, _, _ = naive.compressor(steps, 1, w.wkv, w.wgate, w.norm, EPS)
    assert state.kv is None and state.score is None
    assert got_pos == want_pos == [list(range(7))] + [[p] for p in range(7, 11)]
    for i, (g, wn) in enumerate(zip(got, want)):
        assert g.shape == (steps[i].shape[0], 32)
        assert_bf16_close(g, wn, f"step {i} latents")


# =============================================================================== ratio > 1


def _prefill_lengths(r):
    """P < r (no latent), P % r != 0 (groups and a trailing partial group), P % r == 0."""
    return sorted({1, r - 1, 2 * r + r // 2 + 1 if r > 2 else 2 * r + 1, 2 * r})


@pytest.mark.parametrize("r", [2, 3, 4, 7, 128])
def test_compressor_prefill_groups_and_state(r):
    rng, w = compressor_case(r, seed=r)
    hd = 32
    for P in _prefill_lengths(r):
        x = bf16(rng, (P, 64))
        (got,), (pos,), state = run_compressor(r, w, [x])
        (want,), (want_pos,), nkv, nscore = naive.compressor([x], r, w.wkv, w.wgate,
                                                                   w.norm, EPS)
        groups, rest = divmod(P, r)
        assert pos == want_pos == [g * r for g in range(groups)]
        if groups == 0:
            assert got is None and want is None, f"P={P} < r={r} must give no latent"
        else:
            assert got.shape == (groups, hd)
            assert_bf16_close(got, want, f"r={r} P={P} latents")
        # Slots 0 .. P%r-1 hold the trailing tokens' kv and score; the others are untouched.
        assert_f32_dot_close(state.kv[:rest], x[P - rest:], w.wkv, f"r={r} P={P} kv state")
        assert_f32_dot_close(state.score[:rest], x[P - rest:], w.wgate, f"r={r} P={P} score state")
        assert np.array_equal(state.kv[rest:], np.zeros((r - rest, hd), np.float32))
        assert np.array_equal(state.score[rest:], np.full((r - rest, hd), -np.inf, np.float32))
        assert np.all(np.isfinite(state.score[:rest]))
        assert_f32_dot_close(nkv[:rest], x[P - rest:], w.wkv, "naive kv state")


@pytest.mark.parametrize("r", [2, 3, 4, 7, 128])
def test_compressor_decode_across_group_boundaries(r):
    rng, w = compressor_case(r, seed=100 + r)
    for P in _prefill_lengths(r):
        n_decode = 3 * r + 2
        x = bf16(rng, (P + n_decode, 64))
        steps = [x[:P]] + [x[p:p + 1] for p in range(P, P + n_decode)]
        got, got_pos, state = run_compressor(r, w, steps)
        want, want_pos, nkv, nscore = naive.compressor(steps, r, w.wkv, w.wgate, w.norm, EPS)
        assert got_pos == want_pos
        made = 0
        for i in range(1, len(steps)):
            start_pos = P + i - 1
            if (start_pos + 1) % r == 0:
                assert got_pos[i] == [start_pos + 1 - r]
                assert got[i] is not None and got[i].shape == (1, 32), (r, P, start_pos)
                assert_bf16_close(got[i], want[i], f"r={r} P={P} decode latent at {start_pos}")
                made += 1
            else:
                assert got[i] is None and want[i] is None and got_pos[i] == [], (r, P, start_pos)
        assert made >= 3, "the decode must cross several group boundaries"
        # The final state: slot p % r holds token p's projections (pooling does not clear it).
        end_pos = P + n_decode
        for slot in range(r):
            p = max(q for q in range(end_pos) if q % r == slot)
            if p < P - P % r:
                # never written since the prefill (a slot of a whole prefill group)
                assert np.all(state.kv[slot] == 0) and np.all(state.score[slot] == -np.inf)
                continue
            assert_f32_dot_close(state.kv[slot], x[p], w.wkv, f"r={r} kv slot {slot}")
            assert_f32_dot_close(state.score[slot], x[p], w.wgate, f"r={r} score slot {slot}")


def test_compressor_decode_latent_pools_its_own_group():
    """A decode latent pools exactly the r tokens start_pos + 1 - r .. start_pos: it equals the
    prefill latent of the same tokens as a whole group."""
    r = 4
    rng, w = compressor_case(r, seed=7)
    x = bf16(rng, (2 * r, 64))
    got, pos, _ = run_compressor(r, w, [x[:r + 1]] + [x[p:p + 1] for p in range(r + 1, 2 * r)])
    assert pos[-1] == [r] and got[-1] is not None
    alone = compressor(x[r:2 * r], 0, r, w, CompressorState.fresh(r, 32), EPS)
    assert_bf16_close(got[-1], alone, "decode latent vs the same group pooled at prefill")


# =============================================================================== non-finite input


def test_nan_in_a_ratio_2_group():
    """Ratio 2: token 5 poisons group 2 (tokens 4, 5) through the softmax pooling; queries see
    position 2 from query 5 on ((s + 1) // 2 > 2), plus token 5's own window (2 rows)."""
    cfg, st = nan_stack([2], [0], [0], window=2, topk=2)
    x = xs(12, dim=32)
    x[5] = np.nan
    run = st.forward(0, x, 0, capture=True)
    assert nan_rows(run.out) == set(range(5, 12))
    assert np.isnan(st.shared.compress_kv[2]).all()
    assert np.isfinite(np.delete(st.shared.compress_kv[:6], 2, axis=0)).all()


def test_nan_in_the_compressor_state_during_decode():
    """A NaN token at decode fills its state slot; the group's latent is NaN once the group
    completes, never before (the pooling reads all r slots only then)."""
    cfg, st = nan_stack([3], [0], [0], window=2, topk=1)
    st.forward(0, xs(6, dim=32), 0)
    y = xs(1, 5, 32)
    y[0] = np.nan
    st.forward(0, y, 6)                      # slot 0 of group 2 (positions 6..8)
    assert np.isnan(st.states[0].kv_state[0]).all()
    assert np.isfinite(st.shared.compress_kv[:2]).all()
    st.forward(0, xs(1, 6, 32), 7)
    assert np.isfinite(st.shared.compress_kv[:2]).all()
    out = st.forward(0, xs(1, 7, 32), 8).out   # group 2 completes: latent 2 is NaN
    assert np.isnan(st.shared.compress_kv[2]).all() and np.isnan(out).all()
