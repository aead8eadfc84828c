"""Default tier budgets come from the free memory where each tier lives, and one
memory is never counted twice.

On CUDA the hot (GPU) default is a fraction of free *device* memory and the
warm default a fraction of available *host* memory; on the CPU backend and
Metal (one memory) a warm tier is carved out of the same memory as the hot
one, and `run --host-cache-gb` is refused with one line and exit code 2. The
CUDA cases run here with a scripted memory snapshot standing in for the probe.
"""

import json

import pytest
from typer.testing import CliRunner

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.cli.main import app
from mlx_tier.cli.render import as_flags
from mlx_tier.engine import budgets as tier_budgets
from mlx_tier.engine.budgets import FreeMemory, TierBudgets, device_memory
from mlx_tier.errors import BudgetError, ConfigError

GIB = 2**30
runner = CliRunner()
CUDA = FreeMemory("cuda", host_available=100 * GIB, host_total=128 * GIB, device_free=60 * GIB,
                  device_total=80 * GIB)
CPU = FreeMemory("cpu", host_available=20 * GIB, host_total=24 * GIB)


def test_cuda_defaults_come_from_device_and_host_memory():
    # hot: half of the 60 GiB free on the GPU (not of host memory); warm: half of 100 GiB available on the host
    assert tier_budgets.tier_budgets(None, None, CUDA) == TierBudgets(30 * GIB, 50 * GIB)
    small_gpu = FreeMemory("cuda", 100 * GIB, 128 * GIB, device_free=6 * GIB, device_total=8 * GIB)
    assert tier_budgets.tier_budgets(None, None, small_gpu) == TierBudgets(3 * GIB, 50 * GIB)
    assert tier_budgets.tier_budgets(20, 0, CUDA) == TierBudgets(20 * GIB, 0)  # warm tier off
    assert tier_budgets.tier_budgets(None, 70, CUDA) == TierBudgets(30 * GIB, 70 * GIB)
    with pytest.raises(BudgetError, match="cannot tell the GPU's free memory"):
        tier_budgets.tier_budgets(None, None, FreeMemory("cuda", GIB, GIB))
    assert tier_budgets.tier_budgets(4, None, FreeMemory("cuda", 2 * GIB, 4 * GIB)) == TierBudgets(4 * GIB, GIB)


def test_one_memory_is_never_counted_twice():
    assert tier_budgets.tier_budgets(None, None, CPU) == TierBudgets(10 * GIB, None)  # one tier, as before
    assert tier_budgets.tier_budgets(8, None, CPU) == TierBudgets(8 * GIB, None)
    # a warm tier on one memory comes out of the one default budget, not on top of it
    assert tier_budgets.tier_budgets(None, 4, CPU) == TierBudgets(6 * GIB, 4 * GIB)
    with pytest.raises(BudgetError, match="leaves nothing of the default expert budget"):
        tier_budgets.tier_budgets(None, 10, CPU)
    assert tier_budgets.tier_budgets(12, 12, CPU) == TierBudgets(12 * GIB, 12 * GIB)  # 24 GiB: fits
    with pytest.raises(BudgetError, match="both tiers share one memory"):
        tier_budgets.tier_budgets(16, 9, CPU)
    metal = FreeMemory("metal", 40 * GIB, 64 * GIB)
    with pytest.raises(BudgetError, match="on the metal backend"):
        tier_budgets.tier_budgets(None, 20, metal)


@pytest.mark.parametrize("cache_gb,host_cache_gb,field", [(-1, None, "cache_gb"), (0, None, "cache_gb"),
                                                         (None, -0.5, "host_cache_gb"),
                                                         (None, float("nan"), "host_cache_gb"),
                                                         (float("inf"), None, "cache_gb")])
def test_bad_budgets_name_their_setting(cache_gb, host_cache_gb, field):
    with pytest.raises(ConfigError, match=f"{field} must be a finite number") as e:
        tier_budgets.tier_budgets(cache_gb, host_cache_gb, CUDA)
    assert e.value.field == field


def test_device_memory_from_mlx_device_info():
    assert device_memory({"free_memory": 5, "total_memory": 9}) == (5, 9)  # recent MLX (NVML)
    assert device_memory({"memory_size": 9}, active=4) == (5, 9)  # older MLX: total - MLX's own
    assert device_memory({"device_name": "x"}) == (None, None)


def test_probe_on_cuda_empties_mlx_buffer_cache_first():
    """Freed buffers MLX keeps cached are still reserved on the GPU: the probe releases them
    before reading free memory, so the hot default is not shrunk by load-time temporaries."""
    from types import SimpleNamespace

    calls, cached = [], {"bytes": 3 * GIB}

    def clear_cache():
        calls.append("clear_cache")
        cached["bytes"] = 0

    def device_info():
        calls.append("device_info")
        return {"total_memory": 24 * GIB, "free_memory": 16 * GIB - cached["bytes"]}

    api = SimpleNamespace(metal=SimpleNamespace(is_available=lambda: False),
                          cuda=SimpleNamespace(is_available=lambda: True), clear_cache=clear_cache,
                          device_info=device_info, get_active_memory=lambda: 0)
    mem = tier_budgets.probe(api)
    assert calls == ["clear_cache", "device_info"] and (mem.device_free, mem.device_total) == (16 * GIB, 24 * GIB)
    assert tier_budgets.tier_budgets(None, None, mem).hot == tier_budgets.default_hot_budget(16 * GIB) == 8 * GIB


def test_describe_defaults_on_each_kind_of_machine():
    assert tier_budgets.describe_defaults(CUDA, 72 * GIB) == (
        "backend cuda: GPU free 60.0 of 80.0 GiB, host available 100.0 GiB -> default hot 30.0 GiB, "
        "warm 50.0 GiB; MLX memory limit 72.0 GiB")
    assert tier_budgets.describe_defaults(CPU) == ("backend cpu: one memory, host available 20.0 GiB -> one "
                                                   "tier, default 10.0 GiB")
    no_gpu_info = tier_budgets.describe_defaults(FreeMemory("cuda", GIB, GIB))
    # a library text names the setting; the CLI maps it to its flag
    assert "give `cache_gb`" in no_gpu_info and "--" not in no_gpu_info
    assert "give --cache-gb" in as_flags(no_gpu_info)
    assert "--" not in tier_budgets.describe_defaults(CUDA) + tier_budgets.describe_defaults(CPU)
    odd = FreeMemory("cpu", host_available=3 * GIB + 5, host_total=4 * GIB)  # one-tier default as a run takes it
    assert tier_budgets.tier_budgets(None, None, odd).hot == tier_budgets.default_warm_budget(3 * GIB + 5)
    assert tier_budgets.describe_defaults(tier_budgets.probe()).startswith("backend ")  # this machine, whatever it is


def fake_machine(monkeypatch, mem: FreeMemory) -> None:
    """The memory probe (and backend) report ``mem`` instead of this machine."""
    monkeypatch.setattr(tier_budgets, "probe", lambda api=None: mem)
    monkeypatch.setattr(tier_budgets, "backend_of", lambda api=None: mem.backend)


def test_cuda_load_takes_two_tiers_with_the_device_default(tiny_moe, monkeypatch):
    one, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=1))
    row = one.expert_cache.layers[0].slot_nbytes * len(one.expert_cache.layers)  # one slot in every layer
    # free GPU memory holding 2 slots per layer at the default fraction; host memory 3 more
    fake_machine(monkeypatch, FreeMemory("cuda", host_available=6 * row, host_total=64 * GIB,
                                         device_free=4 * row + 1, device_total=8 * GIB))
    model, _ = mlx_tier.load(tiny_moe)
    cache = model.expert_cache
    assert cache.slots_per_layer == 2 and cache.warm_slots == (3,) * len(cache.layers)
    assert cache.budget_bytes == 2 * row and cache.warm_budget_bytes == 3 * row
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(cache_gb=3 * row / GIB, host_cache_gb=0))
    assert model.expert_cache.slots_per_layer == 3 and model.expert_cache.warm_slots == (0,) * len(cache.layers)


def test_one_memory_load_keeps_one_tier_or_shares_it(tiny_moe, monkeypatch):
    one, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=1))
    row = one.expert_cache.layers[0].slot_nbytes * len(one.expert_cache.layers)
    fake_machine(monkeypatch, FreeMemory("cpu", host_available=10 * row, host_total=64 * GIB))
    model, _ = mlx_tier.load(tiny_moe)
    assert not hasattr(model.expert_cache, "warm_slots") and model.expert_cache.slots_per_layer == 5
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(host_cache_gb=2 * row / GIB))
    cache = model.expert_cache
    assert cache.slots_per_layer == 3 and cache.warm_slots == (2,) * len(cache.layers)  # 3 + 2 = the one 5
    assert cache.resident_bytes + cache.warm_resident_bytes <= 5 * row


def docs_dir(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    return docs


@pytest.mark.parametrize("extra", [[], ["--cache-gb", "1"]])
def test_run_refuses_a_warm_tier_on_one_memory(tmp_path, tiny_moe, extra, monkeypatch):
    fake_machine(monkeypatch, CPU)  # this machine, also when the suite runs on a GPU (benches/gpu_check.sh)
    r = runner.invoke(app, ["run", str(docs_dir(tmp_path)), "--out", str(tmp_path / "out"), "--model",
                            str(tiny_moe), "--host-cache-gb", "2", *extra])
    assert r.exit_code == 2, r.output
    assert "--host-cache-gb needs a CUDA GPU" in r.output and "--cache-gb alone" in r.output
    assert not (tmp_path / "out").exists()


def test_run_checks_cache_gb_against_the_gpu_on_cuda(tmp_path, tiny_moe, monkeypatch):
    fake_machine(monkeypatch, FreeMemory("cuda", 100 * GIB, 128 * GIB, device_free=20 * GIB, device_total=24 * GIB))
    r = runner.invoke(app, ["run", str(docs_dir(tmp_path)), "--out", str(tmp_path / "out"), "--model",
                            str(tiny_moe), "--cache-gb", "30"])
    assert r.exit_code == 2 and "more than the GPU's memory (24.0 GiB)" in r.output


def test_run_records_per_tier_hits_on_cuda(tmp_path, tiny_moe, monkeypatch):
    fake_machine(monkeypatch, FreeMemory("cuda", 100 * GIB, 128 * GIB, device_free=20 * GIB, device_total=24 * GIB))
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", str(docs_dir(tmp_path)), "--out", str(out), "--model", str(tiny_moe),
                            "--cache-gb", "0.0001", "--host-cache-gb", "0.0002", "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    cache, run = report["cache"], report["runs"][-1]
    assert run["warm_slots"] and min(run["warm_slots"]) >= 1
    assert cache["hot_hits"] + cache["warm_hits"] + cache["promotions"] == cache["hits"]
    assert cache["misses_hot"] + cache["misses_warm"] == cache["misses"] > 0
    assert run["cache"]["cpu_entries"] > 0 and 0 < run["cache"]["cpu_share"] <= 1
    assert report["kernel"] == "cpu"  # auto: the warm tier computed by the CPU kernel
