"""Routing traces: recorded from the live model, saved and read back in both
formats, and replayed by the simulator with the live cache's own semantics.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from typer.testing import CliRunner

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.cli.main import app
from mlx_tier.defaults import DEFAULT_POLICY
from mlx_tier.errors import TraceError
from mlx_tier.routing.simulate import simulate, zipf_trace
from mlx_tier.routing.trace import DECODE, PREFILL, load, save


def test_npz_round_trip(tmp_path):
    t = zipf_trace(num_layers=2, num_experts=16, top_k=2, tokens=20)
    save(t, tmp_path / "t.npz")
    u = load(tmp_path / "t.npz")
    np.testing.assert_array_equal(t.experts, u.experts)
    np.testing.assert_array_equal(t.layer, u.layer)
    assert u.meta["num_experts"] == 16 and u.meta["format"] == "mlx-tier-trace"


def test_text_format_and_errors(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("# token layer experts\n0 0 1 2\n0 1 3 4\n1 0 1 5\n")
    t = load(f)
    assert t.experts.tolist() == [[1, 2], [3, 4], [1, 5]] and t.num_layers == 2
    assert simulate(t, "lru", 2).hits == 1  # expert 1 at layer 0 is reused
    for text, msg in [("0 0 1 x\n", "t.txt:1: expected integers"), ("0 0 1 2\n0 0 1\n", "t.txt:2: 1 experts"), ("", "empty")]:
        f.write_text(text)
        with pytest.raises(TraceError, match=msg):
            load(f)
    with pytest.raises(TraceError, match="no such trace file"):
        load(tmp_path / "missing.npz")


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])
def test_recorded_trace_replays_to_the_live_hit_count(tiny_moe, policy):
    """Decoding one token per call, the simulator with the same policy and slots
    reproduces the live cache's hits and misses exactly."""
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=3, policy=policy))
    cache = model.expert_cache
    cache.start_trace(source="test")
    for _ in generate_step(mx.array([7]), model, max_tokens=12):
        pass
    trace = cache.stop_trace()
    stats = cache.stats
    assert len(trace.layer) >= 2 * 12 and set(trace.phase.tolist()) == {DECODE}  # mlx-lm runs one step ahead
    sim = simulate(trace, policy, 3)
    assert (sim.hits, sim.accesses - sim.hits) == (stats.hits, stats.misses)


def test_prefill_is_marked(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=8))
    model.expert_cache.start_trace()
    for _ in generate_step(mx.array(list(range(5, 25))), model, max_tokens=3):
        pass
    t = model.expert_cache.stop_trace()
    # mlx-lm prefills all but the last prompt token, which goes with the decode steps.
    assert (t.phase == PREFILL).sum() == 2 * 19 and (t.phase == DECODE).sum() >= 2 * 3


def test_trace_sim_cli(tmp_path):
    t = zipf_trace(num_layers=2, num_experts=16, top_k=2, tokens=60)
    save(t, tmp_path / "t.npz")
    r = CliRunner().invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--json", "--slots", "4", "--slots", "8"])
    assert r.exit_code == 0, r.output
    import json

    data = json.loads(r.stdout)
    rates = {(x["policy"], x["slots"]): x["hit_rate"] for x in data["results"]}
    assert rates[("belady", 4)] >= rates[("lru", 4)] and rates[("lru", 8)] >= rates[("lru", 4)]
    r = CliRunner().invoke(app, ["trace-sim", str(tmp_path / "t.npz")])
    assert r.exit_code == 0 and "belady" in r.output and "4 slots (25%)" in r.output
    r = CliRunner().invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--policy", "fifo"])
    assert r.exit_code == 2 and "unknown policy" in r.output


def test_run_records_a_trace(tmp_path, tiny_moe):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("A short note about rivers and the sea.")
    r = CliRunner().invoke(app, ["run", str(docs), "--out", str(tmp_path / "out"), "--model", str(tiny_moe),
                                 "--max-tokens", "3", "--trace", str(tmp_path / "run.npz")])
    assert r.exit_code == 0, r.output
    t = load(tmp_path / "run.npz")
    assert (t.phase == PREFILL).any() and t.num_layers == 2 and t.experts.shape[1] == 2


def test_live_policies_and_offline_refusal(tiny_moe):
    for policy in ("tinylfu", "lfu", "2q"):
        model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2, policy=policy))
        list(generate_step(mx.array([3, 4, 5]), model, max_tokens=4))
        assert model.expert_cache.stats.misses > 0
    with pytest.raises(ValueError, match="needs the future"):
        mlx_tier.load(tiny_moe, config=TierConfig(policy="belady"))
    with pytest.raises(ValueError, match="needs a saved frequency profile"):
        mlx_tier.load(tiny_moe, config=TierConfig(policy="pinned"))


def test_predictions_are_recorded_aligned_and_saved(tmp_path):
    """A prefetch's prediction for a layer's next call lands on that call's records
    (-1 where none was made, or made for a call of another shape) and survives save/load."""
    from mlx_tier.routing.trace import TraceRecorder

    rec = TraceRecorder(2, 8)
    rec.add(0, np.array([[[1, 2]]]))
    rec.predict(1, np.array([[[3, 4]]]))
    rec.add(1, np.array([[[3, 5]]]))
    rec.predict(1, np.array([[[6, 7], [0, 1]]]))  # a two-token prediction for a one-token call: dropped
    rec.add(1, np.array([[[2, 6]]]))
    t = rec.trace()
    assert t.predicted.tolist() == [[-1, -1], [3, 4], [-1, -1]]
    assert t.layer_predictions() == [[[-1, -1]], [[3, 4], [-1, -1]]]
    save(t, tmp_path / "t.npz")
    back = load(tmp_path / "t.npz")
    np.testing.assert_array_equal(back.predicted, t.predicted)
    plain = TraceRecorder(1, 8)
    plain.add(0, np.array([[[1, 2]]]))
    assert plain.trace().predicted is None
    save(plain.trace(), tmp_path / "p.npz")
    assert load(tmp_path / "p.npz").predicted is None and load(tmp_path / "p.npz").layer_predictions() is None
