"""mlx_tier.tools.demo_router: routers fitted so the demo routes like a trained MoE.

Synthetic MoE inputs with what skews the demo's v1 router: a large mean and
most variance in slowly varying directions. The fit must remove the skew and
hit a given share of consecutive tokens sharing an expert.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_tier.routing.stats import membership, popularity
from mlx_tier.tools.demo_router import (
    fit_router,
    mixtral_overlap_targets,
    overlap_any,
    slow_directions,
    top_k,
)


def hidden_states(T=400, D=96, seed=0):
    """AR(1) states: 16 slow directions (rho 0.97, large), 80 fast (white, small), plus a mean of norm 20."""
    rng = np.random.default_rng(seed)
    slow = np.zeros((T, 16))
    for t in range(1, T):
        slow[t] = 0.97 * slow[t - 1] + rng.standard_normal(16) * np.sqrt(1 - 0.97**2)
    fast = rng.standard_normal((T, D - 16)) * 0.3
    basis = np.linalg.qr(rng.standard_normal((D, D)))[0]
    mean = rng.standard_normal(D)
    return (np.hstack([3 * slow, fast]) @ basis.T + 20 * mean / np.linalg.norm(mean)).astype(np.float32)


def test_a_random_router_on_such_states_is_skewed_and_sticky():
    h = hidden_states()
    ids = top_k(h @ (np.random.default_rng(1).standard_normal((8, h.shape[1])) / np.sqrt(h.shape[1])).T, 2)
    assert popularity(membership(ids, 8))[1] > 0.3 and overlap_any(ids, 8) > 0.8


@pytest.mark.parametrize("target", [0.48, 0.5091, 0.64])
def test_fit_hits_the_overlap_target_with_near_uniform_use(target):
    h = hidden_states()
    fit = fit_router(h, np.random.default_rng(2), 8, 2, target)
    ids = top_k(h.astype(np.float64) @ fit.weight.T.astype(np.float64), 2)
    assert abs(overlap_any(ids, 8) - target) < 0.02 and abs(fit.overlap_any - target) < 0.02
    assert fit.top_share < 0.22 and popularity(membership(ids, 8))[0] > 0.95  # uniform: 1/8 = 12.5%
    mu = h.mean(axis=0).astype(np.float64)
    logits = h.astype(np.float64) @ fit.weight.T
    assert np.abs(fit.weight @ mu).max() < 1e-3 * np.abs(logits).max()  # no constant head start
    assert logits.std() == pytest.approx(1.0, rel=1e-3)
    again = fit_router(h, np.random.default_rng(2), 8, 2, target)
    assert np.array_equal(again.weight, fit.weight)  # seeded: the same router


def test_fit_keeps_the_end_of_the_range_when_the_target_is_out_of_reach():
    h = hidden_states()
    assert fit_router(h, np.random.default_rng(3), 8, 2, 1.01).beta == pytest.approx(-40.0, abs=1e-6)
    assert fit_router(h, np.random.default_rng(3), 8, 2, 0.0).beta == pytest.approx(40.0, abs=1e-6)


def test_slow_directions_are_white_sorted_and_need_varying_states():
    h = hidden_states()
    dirs, rho = slow_directions(h)
    z = (h - h.mean(axis=0)) @ dirs.T
    assert np.allclose(np.cov(z.T, bias=True), np.eye(len(rho)), atol=0.05)
    assert np.all(np.diff(rho) >= 0) and rho[-1] > 0.9 and rho[0] < 0.2
    with pytest.raises(ValueError, match="at least 3 tokens"):
        slow_directions(h[:2])
    with pytest.raises(ValueError, match="do not vary"):
        slow_directions(np.tile(h[:1], (10, 1)))


def test_directions_do_not_depend_on_the_solvers_sign_choices():
    # The SVD's and eigensolver's signs vary with the LAPACK build; the fixed sign is on each final
    # direction (largest entry positive). Reordering the coordinates reorders the solver's inputs and
    # its sign choices, and must only reorder the directions' entries.
    h = hidden_states()
    dirs, rho = slow_directions(h)
    assert np.all(dirs[np.arange(len(dirs)), np.abs(dirs).argmax(axis=1)] > 0)
    perm = np.random.default_rng(4).permutation(h.shape[1])
    dirs_p, rho_p = slow_directions(h[:, perm])
    assert np.allclose(rho_p, rho, atol=1e-9) and np.allclose(dirs_p, dirs[:, perm], atol=1e-6)


def test_mixtral_targets_run_through_table_5_at_the_demos_depth():
    t = mixtral_overlap_targets(30)
    assert len(t) == 30 and t[0] == pytest.approx(0.4804) and t[-1] == pytest.approx(0.5091)
    assert max(t) == pytest.approx(0.6369, abs=0.01)
    assert mixtral_overlap_targets(1) == (pytest.approx(0.4804),)


def test_moe_inputs_are_each_layers_normed_state_in_token_order(tiny_moe_fp, monkeypatch):
    from mlx_lm import load

    from mlx_tier.tools import demo_router

    text = "Four score and seven years ago our fathers brought forth"
    monkeypatch.setattr(demo_router, "CHUNK", 4)  # read in steps with a KV cache, as the build does
    steps = []
    got = demo_router.moe_inputs(tiny_moe_fp, text, progress=lambda done, total: steps.append((done, total)))
    model, tokenizer = load(str(tiny_moe_fp))  # the reference: the norm's own outputs, by another hook
    ids = tokenizer.encode(text)
    seen = []
    for layer in model.model.layers:
        norm = layer.post_attention_layernorm
        layer.post_attention_layernorm = lambda x, norm=norm: seen.append(norm(x)) or seen[-1]
    model.model(mx.array([ids]))
    assert len(got) == len(model.model.layers) == len(seen)
    assert steps == [(min(n, len(ids)), len(ids)) for n in range(4, len(ids) + 4, 4)]  # one per step
    for g, ref in zip(got, seen, strict=True):
        assert g.dtype == np.float32 and g.shape == (len(ids), ref.shape[-1])
        assert np.allclose(g, np.array(ref[0].astype(mx.float32)), atol=1e-6)
