"""Routing statistics give the known answers on hand-made traces, and the
trained-like generator reproduces the published statistics it cites
(mlx_tier.routing.synthetic's module doc) within a stated tolerance.
"""

from math import log

import numpy as np
import pytest

from mlx_tier.routing.stats import routing_stats
from mlx_tier.routing.synthetic import (
    MIXTRAL_CROSS_TOP1,
    MIXTRAL_FIRST_REPEAT,
    MIXTRAL_OVERLAP_ANY,
    QWEN3_COVERAGE90,
    QWEN3_ENTROPY,
    QWEN3_TOP_SHARE,
    RoutingModel,
    generate,
    mixtral_like,
    qwen3_like,
)
from mlx_tier.routing.trace import DECODE, Trace

TOL = 0.03  # 3 pp: what a few thousand tokens measure to (binomial s.e. ~0.7 pp per layer) plus model fit


def make(rows_per_layer: list[list[list[int]]], num_experts: int, ordered: bool = True) -> Trace:
    """A trace from per-layer lists of top-k rows (same token count in every layer), token-major."""
    L, T = len(rows_per_layer), len(rows_per_layer[0])
    experts = np.array([rows_per_layer[lay][t] for t in range(T) for lay in range(L)], np.int32)
    return Trace(np.repeat(np.arange(T), L), np.tile(np.arange(L, dtype=np.int32), T),
                 np.full(T * L, DECODE, np.uint8), experts,
                 {"num_layers": L, "num_experts": num_experts, "top_k": experts.shape[1], "ordered": ordered})


def test_reuse_and_popularity_on_a_hand_made_trace():
    s = routing_stats(make([[[0, 1], [0, 1], [2, 3], [2, 3]]], 4))
    x = s.layers[0]
    # pairs: {0,1}->{0,1} shares 2 of 2, {0,1}->{2,3} none, {2,3}->{2,3} 2 of 2
    assert x.reuse == pytest.approx(2 / 3) and x.overlap_any == pytest.approx(2 / 3)
    assert x.first_repeat == pytest.approx(2 / 3)
    assert x.reuse_indep == pytest.approx(0.5)  # every expert in half the tokens: (4 x 0.25) / k
    assert (s.reuse_uniform, s.overlap_uniform) == (pytest.approx(0.5), pytest.approx(1 - 1 / 6))
    assert (x.entropy, x.top_share, x.coverage90) == (pytest.approx(1.0), pytest.approx(0.25), 1.0)


def test_skewed_popularity_and_unordered_traces():
    x = routing_stats(make([[[0], [0], [0], [1]]], 4, ordered=False)).layers[0]
    assert x.entropy == pytest.approx(-(0.75 * log(0.75) + 0.25 * log(0.25)) / log(4))
    assert x.top_share == pytest.approx(0.75) and x.coverage90 == 0.5  # 2 of 4 experts cover 90%
    assert x.reuse == pytest.approx(2 / 3) and np.isnan(x.first_repeat)  # unordered: no first choice


def test_cross_layer_table_finds_a_deterministic_map():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 4, 400)
    s = routing_stats(make([[[e] for e in a], [[(e + 1) % 4] for e in a]], 4))
    x = s.layers[0]
    assert x.cross_recall == 1.0 and x.cross_top1 == 1.0
    assert x.cross_recall_static < 0.4  # the most used expert of layer 1 alone: ~1/4
    assert np.isnan(s.layers[1].cross_recall)  # no layer after the last


def test_cross_layer_table_on_independent_layers_is_the_static_guess():
    rng = np.random.default_rng(1)
    rows = [[list(rng.choice(8, 2, replace=False)) for _ in range(4000)] for _ in range(2)]
    x = routing_stats(make(rows, 8, ordered=False)).layers[0]
    assert abs(x.cross_recall - 0.25) < 0.03 and abs(x.cross_recall_static - 0.25) < 0.03  # k/E


def test_empty_trace_is_refused():
    t = Trace(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros((0, 2), np.int32), {})
    with pytest.raises(ValueError, match="empty trace"):
        routing_stats(t)


def test_mixtral_like_matches_table5_and_the_lookup_table():
    model = mixtral_like()
    s = routing_stats(generate(model, 4000, seed=0))
    for lay, target in MIXTRAL_FIRST_REPEAT.items():
        assert abs(s.layers[lay].first_repeat - target) < TOL, (lay, s.layers[lay].first_repeat, target)
    for lay, target in MIXTRAL_OVERLAP_ANY.items():
        assert abs(s.layers[lay].overlap_any - target) < TOL, (lay, s.layers[lay].overlap_any, target)
    assert abs(s.mean("cross_top1") - MIXTRAL_CROSS_TOP1) < TOL
    assert s.mean("entropy") > 0.97  # near-uniform use (Jiang et al. 2024, Figure 7)


def test_qwen3_like_matches_published_popularity():
    s = routing_stats(generate(qwen3_like(num_layers=6), 1500, seed=3))
    for name, (lo, hi) in (("entropy", QWEN3_ENTROPY), ("top_share", QWEN3_TOP_SHARE),
                           ("coverage90", QWEN3_COVERAGE90)):
        assert lo - 0.01 <= s.mean(name) <= hi + 0.01, (name, s.mean(name), lo, hi)


def test_generator_knobs_move_the_statistics():
    base = {"num_layers": 3, "num_experts": 16, "top_k": 2, "alpha": (0.8,) * 3}
    free = routing_stats(generate(RoutingModel(**base, stick_first=(0.0,) * 3, stick_other=(0.0,) * 3,
                                               affinity=0.0), 3000, seed=5))
    sticky = routing_stats(generate(RoutingModel(**base, stick_first=(0.6,) * 3, stick_other=(0.6,) * 3,
                                                 affinity=0.0), 3000, seed=5))
    affine = routing_stats(generate(RoutingModel(**base, stick_first=(0.0,) * 3, stick_other=(0.0,) * 3,
                                                 affinity=0.9), 3000, seed=5))
    # without stickiness, reuse is what independent picks with the same popularity give
    assert abs(free.mean("reuse") - free.mean("reuse_indep")) < 0.02
    assert sticky.mean("reuse") > free.mean("reuse") + 0.3
    assert affine.mean("cross_top1") > free.mean("cross_top1") + 0.5
    assert abs(affine.mean("reuse") - free.mean("reuse")) < 0.05  # affinity alone adds no reuse


def test_generator_is_seeded_and_validates():
    a, b = generate(mixtral_like(4), 50, seed=7), generate(mixtral_like(4), 50, seed=7)
    np.testing.assert_array_equal(a.experts, b.experts)
    assert a.experts.shape == (200, 2) and all(len(set(r)) == 2 for r in a.experts.tolist())
    with pytest.raises(ValueError, match="alpha: 2 values for 3 layers"):
        RoutingModel(3, 8, 2, (1.0, 1.0), (0.0,) * 3, (0.0,) * 3, 0.0)


def test_trace_stats_cli(tmp_path):
    import json

    from typer.testing import CliRunner

    from mlx_tier.cli.main import app
    from mlx_tier.routing.trace import save

    save(make([[[0, 1], [0, 1], [2, 3], [2, 3]]], 4), tmp_path / "t.npz")
    r = CliRunner().invoke(app, ["trace-stats", str(tmp_path / "t.npz")])
    assert r.exit_code == 0, r.output
    assert "experts reused at the next token" in r.output and "66.7%" in r.output
    r = CliRunner().invoke(app, ["trace-stats", str(tmp_path / "t.npz"), "--json"])
    assert json.loads(r.stdout)[str(tmp_path / "t.npz")]["mean"]["overlap_any"] == pytest.approx(2 / 3)
    r = CliRunner().invoke(app, ["trace-stats", str(tmp_path / "missing.npz")])
    assert r.exit_code == 2 and "no such trace file" in r.output
