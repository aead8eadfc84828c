"""Frequency profiles, pre-warm and per-layer slot splits.

Invariants guarded: a profile counts exactly what the live cache served (same
unit as a trace); a pre-warmed or unevenly split live cache still replays
exactly in the simulator and still generates mlx-lm's greedy tokens; resident
bytes stay within the budget; a missing or mismatched profile is one clear error.
"""

import importlib.util
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from support.prompts import LONG, SHORT, greedy
from typer.testing import CliRunner

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.cli.main import app
from mlx_tier.engine.load import tier_model
from mlx_tier.routing import profile as prof
from mlx_tier.routing.simulate import (
    adaptive_split,
    simulate,
    simulate_layer,
    split_by_curves,
    zipf_trace,
)
from mlx_tier.routing.trace import Trace, save

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def tiered(path, config: TierConfig):
    """``mlx_tier.load`` without the tokenizer (loading it takes most of a tiny model's load time)."""
    model, _ = load_model(path, lazy=True)
    tier_model(model, path, config)
    return model


def _trace(rows_by_layer: list[list[list[int]]], num_experts: int) -> Trace:
    """A trace from per-layer top-k rows, interleaved token by token."""
    token, layer, experts = [], [], []
    for t in range(max(len(r) for r in rows_by_layer)):
        for lay, rows in enumerate(rows_by_layer):
            if t < len(rows):
                token.append(t)
                layer.append(lay)
                experts.append(rows[t])
    return Trace(np.array(token), np.array(layer, np.int32), np.ones(len(token), np.uint8), np.array(experts, np.int32),
                 {"num_layers": len(rows_by_layer), "num_experts": num_experts, "top_k": len(experts[0])})


def test_profile_counts_save_merge_and_shape_check(tmp_path):
    t = _trace([[[0, 1], [1, 2], [1, 3]], [[4, 5], [4, 5], [0, 5]]], num_experts=6)
    p = prof.from_trace(t)
    assert p.counts.dtype == np.int64 and p.counts.tolist() == [[1, 3, 1, 1, 0, 0], [1, 0, 0, 0, 2, 3]]
    assert p.hottest(0, 3) == [1, 0, 2] and p.hottest(1, 5) == [5, 4, 0]  # ties: lower id; zero counts never
    prof.save(p, tmp_path / "p.json")
    q = prof.load(tmp_path / "p.json")
    np.testing.assert_array_equal(q.counts, p.counts)
    m = q.merged(p, decay=0.5)  # old halved (rounded half to even), then the new added
    assert m.runs == 2 and m.counts[0].tolist() == [1, 5, 1, 1, 0, 0]
    with pytest.raises(prof.ProfileError, match="2 MoE layers x 6 experts, the model has 3 x 6"):
        q.check(3, 6, "p.json")
    with pytest.raises(prof.ProfileError, match="a trace of another model"):
        prof.from_trace(t, num_layers=2, num_experts=5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(prof.ProfileError, match="not an mlx-tier profile"):
        prof.load(tmp_path / "bad.json")


def test_record_next_to_checkpoint_merges_and_falls_back(tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    p = prof.from_counts([[1, 2], [3, 4]])
    assert prof.record(model_dir, p) == model_dir / prof.PROFILE_FILE
    assert prof.record(model_dir, p) == model_dir / prof.PROFILE_FILE  # merged: counts add
    assert prof.load_for(model_dir, 2, 2).counts.tolist() == [[2, 4], [6, 8]]

    # A read-only model folder (root ignores chmod, so the write is refused by a fake).
    ro_dir = tmp_path / "ro"
    ro_dir.mkdir()
    real = prof.write_atomic

    def refuse_model_dir(path, data):
        if path.parent == ro_dir:
            raise PermissionError(13, "Permission denied", str(path))
        real(path, data)

    monkeypatch.setattr(prof, "write_atomic", refuse_model_dir)
    where = prof.record(ro_dir, p)
    assert where == prof.fallback_path(ro_dir) and where.is_file() and not (ro_dir / prof.PROFILE_FILE).exists()
    assert prof.find_profile(ro_dir) == where and prof.load_for(tmp_path / "none", 2, 2) is None


def test_prewarm_in_the_simulator():
    seq = [[0, 1], [2, 3], [0, 1]]
    assert simulate_layer(seq, "lru", 2) == (0, 6)
    assert simulate_layer(seq, "lru", 2, prewarm=[0, 1]) == (2, 6)  # warm pair hits, then 2, 3 evict it
    assert simulate_layer(seq, "lru", 4, prewarm=[0, 1, 5]) == (4, 6)  # room for all: it hits twice
    t = zipf_trace(num_layers=2, num_experts=16, top_k=2, tokens=120, seed=4)
    for slots in (2, 6):
        ceiling = simulate(t, "belady", slots, prewarm=True).hit_rate
        for policy in ("lru", "lfu", "2q", "pinned"):
            assert simulate(t, policy, slots, prewarm=True).hit_rate <= ceiling + 1e-12, (policy, slots)


def test_split_follows_miss_curves():
    # Layer 0 cycles over 4 experts (LRU misses all until 4 slots), layer 1 uses one.
    t = _trace([[[e] for e in [0, 1, 2, 3] * 10], [[0]] * 40], num_experts=4)
    assert adaptive_split(t, "lru", 5) == (4, 1)
    assert simulate(t, "lru", (4, 1)).hit_rate > simulate(t, "lru", (3, 2)).hit_rate  # uniform-ish loses
    # A flat stretch (no gain from 1 to 2 slots) does not stop the greedy.
    assert split_by_curves([[9, 9, 0], [5, 4, 3]], 5) == (3, 2)
    assert split_by_curves([[3, 3], [3, 3]], 3) == (2, 1)  # no gain anywhere: spread evenly
    p = prof.from_counts([[10, 9, 8, 0], [10, 1, 0, 0]])
    assert prof.adaptive_slots(p, 5) == (3, 2) and prof.adaptive_slots(p, 100) == (4, 4)
    with pytest.raises(ValueError, match="cannot give each of 2 layers one"):
        prof.adaptive_slots(p, 1)


@pytest.fixture(scope="module")
def recorded(tiny_moe, tmp_path_factory):
    """A profile file from a recorded run of the tiny MoE (kept out of its folder)."""
    model = tiered(tiny_moe, TierConfig(slots_per_layer=3))
    cache = model.expert_cache
    cache.start_trace()
    for _ in generate_step(mx.array([7, 8, 9, 10]), model, max_tokens=10):
        pass
    trace = cache.stop_trace()
    counts = cache.profile_counts()
    path = tmp_path_factory.mktemp("profile") / "p.json"
    prof.save(prof.from_counts(counts), path)
    return trace, counts, path


def test_live_counts_equal_the_trace_profile(recorded):
    trace, counts, _ = recorded
    np.testing.assert_array_equal(counts, prof.from_trace(trace, 2, 8).counts)
    assert counts.sum() == trace.experts.size


def test_live_pinned_prewarms_and_replays_exactly(tiny_moe, recorded):
    _, _, path = recorded
    p = prof.load(path)
    model = tiered(tiny_moe, TierConfig(layer_slots=(3, 2), policy="pinned", profile=path))
    cache = model.expert_cache
    assert [sorted(layer.resident_experts()) for layer in cache.layers] == [sorted(p.hottest(0, 3)), sorted(p.hottest(1, 2))]
    s = cache.stats
    assert s.prewarmed == 5 and s.prewarm_bytes > 0 and (s.hits, s.misses, s.bytes_read) == (0, 0, 0)
    cache.start_trace()
    for _ in generate_step(mx.array([11]), model, max_tokens=12):
        pass
    trace = cache.stop_trace()
    s = cache.stats
    sim = simulate(trace, "pinned", (3, 2), profile=p, prewarm=True)
    assert (sim.hits, sim.accesses - sim.hits) == (s.hits, s.misses)
    assert simulate(trace, "pinned", (3, 2), profile=p).hits < sim.hits  # the pre-warm did make a difference
    assert cache.resident_bytes <= cache.budget_bytes and cache.layer_slots == (3, 2)


def test_uneven_slots_generate_mlx_lm_tokens(tiny_moe, recorded):
    _, _, path = recorded
    ref_model, tokenizer = mlx_load(str(tiny_moe))
    refs = {q: greedy(ref_model, tokenizer, q) for q in (SHORT, LONG)}
    for config in (TierConfig(layer_slots=(1, 5)), TierConfig(layer_slots=(6, 2), policy="lfu", prewarm=True, profile=path)):
        model = tiered(tiny_moe, config)
        for q, ref in refs.items():
            assert greedy(model, tokenizer, q) == ref, (config.layer_slots, q[:20])
        cache = model.expert_cache
        assert cache.stats.evictions > 0 and cache.resident_bytes <= cache.budget_bytes
        assert all(len(layer.resident_experts()) <= n for layer, n in zip(cache.layers, config.layer_slots))


def test_adaptive_split_live_and_profile_errors(tiny_moe, recorded, tmp_path):
    _, counts, path = recorded
    model = tiered(tiny_moe, TierConfig(slots_per_layer=3, split="adaptive", profile=path))
    cache = model.expert_cache
    assert cache.layer_slots == prof.adaptive_slots(prof.from_counts(counts), 6) and sum(cache.layer_slots) == 6
    assert cache.resident_bytes <= cache.budget_bytes
    with pytest.raises(prof.ProfileError, match="policy 'pinned' needs a saved frequency profile.*mlx-tier profile"):
        tiered(tiny_moe, TierConfig(policy="pinned"))
    prof.save(prof.from_counts(np.ones((3, 8), np.int64)), tmp_path / "other.json")
    with pytest.raises(prof.ProfileError, match="3 MoE layers x 8 experts, the model has 2 x 8"):
        tiered(tiny_moe, TierConfig(prewarm=True, profile=tmp_path / "other.json"))
    with pytest.raises(mlx_tier.BudgetError, match="layer_slots"):
        tiered(tiny_moe, TierConfig(layer_slots=(9, 1)))


def test_trace_sim_split_prewarm_and_profile_cli(tmp_path, tiny_moe):
    t = zipf_trace(num_layers=2, num_experts=8, top_k=2, tokens=60, seed=5)
    save(t, tmp_path / "t.npz")
    runner = CliRunner()
    r = runner.invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--json", "--slots", "2", "--split", "adaptive",
                            "--prewarm", "--policy", "lru", "--policy", "belady"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["split"] == "adaptive" and all(sum(x["layer_slots"]) == 4 for x in data["results"])
    for args, msg in [(["--slots", "9"], "between 1 and 8"), (["--split", "fancy"], "uniform or adaptive")]:
        r = runner.invoke(app, ["trace-sim", str(tmp_path / "t.npz"), *args])
        assert r.exit_code == 2 and msg in r.output, r.output
    prof.save(prof.from_counts(np.ones((3, 8), np.int64)), tmp_path / "p.json")
    r = runner.invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--profile", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "3 MoE layers" in r.output

    model_dir = shutil.copytree(tiny_moe, tmp_path / "model")
    r = runner.invoke(app, ["profile", str(model_dir), str(tmp_path / "t.npz")])
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(prof.load(model_dir / prof.PROFILE_FILE).counts, prof.from_trace(t).counts)
    save(zipf_trace(num_layers=2, num_experts=16, top_k=2, tokens=5), tmp_path / "wide.npz")
    r = runner.invoke(app, ["profile", str(model_dir), str(tmp_path / "wide.npz")])
    assert r.exit_code == 2 and "a trace of another model" in r.output


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib (the optional 'plot' extra) is not installed here")
def test_trace_sim_plot_writes_a_png(tmp_path):
    save(zipf_trace(num_layers=2, num_experts=8, top_k=2, tokens=40), tmp_path / "t.npz")
    r = CliRunner().invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--plot", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_MATPLOTLIB, reason="checks the message shown when matplotlib is missing; it is installed here")
def test_trace_sim_plot_without_matplotlib_is_a_clear_error(tmp_path):
    save(zipf_trace(num_layers=2, num_experts=8, top_k=2, tokens=10), tmp_path / "t.npz")
    r = CliRunner().invoke(app, ["trace-sim", str(tmp_path / "t.npz"), "--plot", str(tmp_path / "h.png")])
    assert r.exit_code == 2 and "mlx-tier[plot]" in r.output and not (tmp_path / "h.png").exists()
