"""The CUDA path at the edges: `plan --gpu-gb` splits the experts into three tiers
by the stated arithmetic, `trace-sim --warm-slots` prints what the two-tier
simulator computes, and bad values are one error line with exit code 2.
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from mlx_tier.cli.main import app
from typer.testing import CliRunner

from mlx_tier.simulate import zipf_trace
from mlx_tier.simulate_tiers import simulate_two_tier
from mlx_tier.tier_plan import three_tier_split
from mlx_tier.trace import save as save_trace

MIB = 2**20
runner = CliRunner()


def fake_plan(**kw):
    base = dict(dense_bytes=100 * MIB, kv_bytes=28 * MIB, moe_layers=2, expert_bytes_disk=int(1.5 * MIB),
                experts_per_layer=8, memory_available=64 * MIB)
    return SimpleNamespace(**{**base, **kw})


def test_three_tier_split_arithmetic():
    # GPU 144 MiB - dense 100 - KV 28 = 16 MiB hot; a slot row is 2 layers x 1.5 MiB = 3 MiB -> 5 hot;
    # host 7 MiB -> 2 warm; 8 - 5 - 2 = 1 cold.
    s = three_tier_split(fake_plan(), gpu_gb=144 / 1024, host_gb=7 / 1024)
    assert (s.hot_budget, s.hot_slots, s.warm_slots, s.cold_experts) == (16 * MIB, 5, 2, 1)
    # Default host budget: half of the available 64 MiB = 32 MiB -> 10 rows, capped at the 3 non-hot experts.
    s = three_tier_split(fake_plan(), gpu_gb=144 / 1024)
    assert (s.host_budget, s.hot_slots, s.warm_slots, s.cold_experts) == (32 * MIB, 5, 3, 0)
    # A GPU smaller than the dense part: nothing hot, everything the host holds warm, the rest cold.
    s = three_tier_split(fake_plan(), gpu_gb=0.05, host_gb=12 / 1024)
    assert (s.hot_budget, s.hot_slots, s.warm_slots, s.cold_experts) == (0, 0, 4, 4)
    with pytest.raises(ValueError, match="gpu_gb must be a positive"):
        three_tier_split(fake_plan(), gpu_gb=0)


def test_plan_cli_three_tiers(tiny_moe):
    r = runner.invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1",
                            "--memory-gb", "1", "--gpu-gb", "0.5"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    tiers = data["tiers"]
    assert tiers["hot_slots"] + tiers["warm_slots"] + tiers["cold_experts"] == data["experts_per_layer"]
    assert tiers["hot_budget"] == int(0.5 * 2**30) - data["dense_bytes"] - data["kv_bytes"]
    r = runner.invoke(app, ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1", "--gpu-gb", "0.5"])
    assert r.exit_code == 0 and "GPU hot tier" in r.output and "SSD cold tier" in r.output
    r = runner.invoke(app, ["plan", str(tiny_moe), "--gpu-gb", "-1"])
    assert r.exit_code == 2 and "--gpu-gb must be positive" in r.output


def test_trace_sim_warm_slots(tmp_path):
    trace = zipf_trace(2, 16, 2, tokens=80, seed=2)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "2", "--slots", "4", "--warm-slots", "6",
                            "--policy", "lru", "--policy", "belady", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)["results"]
    want = [simulate_two_tier(trace, "lru", n, 6).as_dict() for n in (2, 4)]  # belady skipped: single-tier only
    assert got == json.loads(json.dumps(want))
    assert got[0]["warm_hit_rate"] > 0 and got[1]["hot_hit_rate"] > got[0]["hot_hit_rate"]
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "4", "--warm-slots", "6"])
    assert r.exit_code == 0 and "on CPU" in r.output
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "12", "--warm-slots", "6"])
    assert r.exit_code == 2 and "at most 16" in r.output
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "4", "--warm-slots", "6", "--policy", "belady"])
    assert r.exit_code == 2 and "live policies only" in r.output


def test_trace_sim_warm_slots_replays_predictions_and_prewarm(tmp_path):
    trace = zipf_trace(2, 16, 2, tokens=80, seed=4)
    rng = np.random.default_rng(0)
    # predictions: the true experts for about 2/3 of the records, random ones otherwise
    guess = rng.integers(0, 16, size=trace.experts.shape).astype(np.int32)
    trace.predicted = np.where(rng.random((len(guess), 1)) < 0.67, trace.experts, guess).astype(np.int32)
    trace.predicted[trace.layer == 0] = -1  # the first layer has no layer before it
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "3", "--warm-slots", "6", "--policy", "lfu",
                            "--prewarm", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["prefetch"] is True and data["prewarm"] is True
    want = simulate_two_tier(trace, "lfu", 3, 6, prewarm=True, prefetch=True).as_dict()
    assert data["results"] == [json.loads(json.dumps(want))] and want["promotions_ahead"] > 0
    assert want != simulate_two_tier(trace, "lfu", 3, 6, prewarm=True).as_dict()
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "3", "--warm-slots", "6", "--policy", "lfu"])
    assert r.exit_code == 0 and "prefetch from the trace's predictions" in " ".join(r.output.split())


def test_run_refuses_a_bad_host_cache(tmp_path, tiny_moe):
    """(report.json's per-tier counts: tests/test_tier_budgets.py, on a scripted CUDA machine.)"""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("The river floods every spring.")
    r = runner.invoke(app, ["run", str(docs), "--out", str(tmp_path / "o2"), "--model", str(tiny_moe),
                            "--host-cache-gb", "-2"])
    assert r.exit_code == 2 and "--host-cache-gb must be a number >= 0" in r.output
