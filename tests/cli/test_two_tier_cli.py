"""The CUDA path at the edges: `plan --gpu-gb` splits the experts into three tiers
by the stated arithmetic, `trace-sim --warm-slots` prints what the two-tier
simulator computes, and bad values are one error line with exit code 2.
"""

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.routing.simulate import zipf_trace
from mlx_tier.routing.simulate_tiers import simulate_two_tier
from mlx_tier.routing.trace import save as save_trace
from mlx_tier.tools import plan_gpu as tier_plan
from mlx_tier.tools.plan_gpu import three_tier_split

MIB = 2**20
runner = CliRunner()


def fake_plan(**kw):
    base = dict(dense_bytes=100 * MIB, kv_bytes=8 * MIB, moe_layers=2, expert_bytes_disk=int(1.5 * MIB),
                expert_bytes_warm=2 * MIB, experts_per_layer=8, memory_available=64 * MIB, memory_total=128 * MIB)
    return SimpleNamespace(**{**base, **kw})


def test_three_tier_split_arithmetic():
    # GPU 120 MiB - dense 100 = 20 MiB free -> hot half of it, 10 MiB (as a run); a hot row is 2 layers x
    # 1.5 MiB = 3 MiB -> 3 hot; 10 MiB left for KV and activations. Warm rows are 2 x 2 MiB (float32
    # scales): host 9 MiB -> 2 warm (3 by the hot bytes); 8 - 3 - 2 = 3 cold.
    s = three_tier_split(fake_plan(), gpu_gb=120 / 1024, host_gb=9 / 1024)
    assert (s.device_free, s.hot_budget, s.gpu_left) == (20 * MIB, 10 * MIB, 10 * MIB)
    assert (s.hot_slots, s.warm_slots, s.cold_experts) == (3, 2, 3)
    # Default host budget: half of the available 64 MiB = 32 MiB -> 8 rows, capped at the 5 non-hot experts.
    s = three_tier_split(fake_plan(), gpu_gb=120 / 1024)
    assert (s.host_budget, s.hot_slots, s.warm_slots, s.cold_experts) == (32 * MIB, 3, 5, 0)
    # A GPU smaller than the dense part: nothing hot, everything the host holds warm, the rest cold.
    s = three_tier_split(fake_plan(), gpu_gb=0.05, host_gb=12 / 1024)
    assert (s.device_free, s.hot_budget, s.hot_slots, s.warm_slots, s.cold_experts) == (0, 0, 0, 3, 5)
    with pytest.raises(ValueError, match="gpu_gb must be a positive"):
        three_tier_split(fake_plan(), gpu_gb=0)


def test_three_tier_split_says_what_does_not_fit():
    from mlx_tier.engine.load import plan_slots
    from mlx_tier.errors import BudgetError

    # 120 MiB GPU: 10 MiB left for the 8 MiB KV estimate, 3 hot slots -> it fits
    s = three_tier_split(fake_plan(), gpu_gb=120 / 1024, host_gb=9 / 1024)
    assert (s.fits, s.why) == (True, "")
    # 0.05 GiB GPU (below the dense part): no hot slot, which a run refuses; nothing left for the KV cache
    s = three_tier_split(fake_plan(), gpu_gb=0.05, host_gb=12 / 1024)
    assert not s.fits and s.why.startswith("a run refuses it: the hot budget holds less than one expert slot")
    assert "below the KV cache estimate (0.01 GiB)" in s.why
    with pytest.raises(BudgetError):  # as a run sizes its hot tier
        plan_slots(s.hot_budget, 2, s.expert_bytes, 8)
    # 106 MiB GPU: 6 MiB free -> 3 MiB hot = 1 slot per layer (a run takes it), 3 MiB left < 8 MiB KV
    s = three_tier_split(fake_plan(), gpu_gb=106 / 1024)
    assert (s.hot_slots, s.gpu_left, s.fits) == (1, 3 * MIB, False)
    assert s.why == "the GPU memory left (0.00 GiB) is below the KV cache estimate (0.01 GiB)"
    # the same GPU with a KV estimate that fits what is left
    assert three_tier_split(fake_plan(kv_bytes=3 * MIB), gpu_gb=106 / 1024).fits


def plan_tiers(path, gpu_gb: float, *more: str):
    r = runner.invoke(app, ["plan", str(path), "--disk-gbps", "1", "--compute-gbps", "1", "--memory-gb", "1",
                            "--gpu-gb", f"{gpu_gb!r}", *more])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) if "--json" in more else r.output


def test_plan_cli_says_when_the_split_does_not_fit(tiny_moe):
    p = plan_tiers(tiny_moe, 0.5, "--json")
    row = p["moe_layers"] * p["expert_bytes_disk"]  # one hot slot in every layer
    assert p["tiers"]["fits"] and p["tiers"]["why"] == ""
    cases = {  # GPU bytes -> what the table says
        p["dense_bytes"] + row: "does not fit: a run refuses it",  # hot = half a row: no slot per layer
        p["dense_bytes"] + 3 * row: "does not fit: the GPU memory left",  # 1 hot slot, 1.5 rows left < KV
    }
    for gpu_bytes, says in cases.items():
        gpu_gb = gpu_bytes / 2**30
        tiers = plan_tiers(tiny_moe, gpu_gb, "--json")["tiers"]
        assert not tiers["fits"] and says.removeprefix("does not fit: ") in tiers["why"]
        if "left" in says:  # what the plan reports is what it judged: left below the KV estimate
            assert tiers["hot_slots"] >= 1 and tiers["gpu_left"] < p["kv_bytes"]
        out = plan_tiers(tiny_moe, gpu_gb)
        assert says in out and max(map(len, out.splitlines())) <= 80
    assert "does not fit" not in plan_tiers(tiny_moe, 0.5)


def test_plan_cli_three_tiers(tiny_moe):
    r = runner.invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1",
                            "--memory-gb", "1", "--gpu-gb", "0.5"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    tiers = data["tiers"]
    assert tiers["hot_slots"] + tiers["warm_slots"] + tiers["cold_experts"] == data["experts_per_layer"]
    assert tiers["device_free"] == int(0.5 * 2**30) - data["dense_bytes"]
    assert tiers["hot_budget"] == tiers["device_free"] // 2
    r = runner.invoke(app, ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1", "--gpu-gb", "0.5"])
    assert r.exit_code == 0 and "GPU hot tier" in r.output and "SSD cold tier" in r.output
    assert "GPU free after the dense part" in r.output and "(assumed: 0.5 GiB - dense)" in r.output
    r = runner.invoke(app, ["plan", str(tiny_moe), "--gpu-gb", "-1"])
    assert r.exit_code == 2 and "--gpu-gb must be a finite positive number of GiB" in r.output


@pytest.fixture(scope="module")
def gpt_oss_mxfp8_bf16(tmp_path_factory, tokenizer_dir):
    """A tiny gpt_oss (experts with biases) whose experts are mxfp8, which the CPU
    kernel cannot compute, and whose floating tensors are bf16 (the expert biases)."""
    import importlib

    from mlx_lm.models.switch_layers import SwitchLinear
    from mlx_lm.utils import quantize_model
    from support.arch_configs import BASE, CONFIGS
    from support.checkpoints import write_checkpoint

    config = {**BASE, "model_type": "gpt_oss", **CONFIGS["gpt_oss"]}
    mx.random.seed(3)
    gpt_oss = importlib.import_module("mlx_lm.models.gpt_oss")
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    model, config = quantize_model(model, config, 32, 8, mode="mxfp8",
                                   quant_predicate=lambda p, m: isinstance(m, SwitchLinear))
    model.set_dtype(mx.bfloat16)  # floating leaves only: packed weights and E8M0 scales stay integers
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "gpt-oss-mxfp8-bf16", model, config, tokenizer_dir)


def assert_plan_split_equals_run(path, monkeypatch, hot_rows, warm_rows) -> None:
    """`plan --gpu-gb` and a run on CUDA with the same memory figures choose the same hot and
    warm slots and slot sizes: the run here is `load` with the probe reporting the plan's
    assumed memory, the checkpoint's dtype kept (as on a GPU) and the job runner's default
    kernel (auto)."""
    from mlx_tier import TierConfig, load
    from mlx_tier.engine import budgets as tier_budgets
    from mlx_tier.tools.plan import make_plan

    p = make_plan(path, memory_gb=1, disk_gbps=1, compute_gbps=1)
    L, E = p.moe_layers, p.experts_per_layer
    gpu_gb = (p.dense_bytes + 2 * hot_rows * L * p.expert_bytes_disk) / 2**30  # hot = half of the free rest
    mem_gb = 2 * warm_rows * L * p.expert_bytes_warm / 2**30
    p = make_plan(path, memory_gb=mem_gb, disk_gbps=1, compute_gbps=1)
    split = three_tier_split(p, gpu_gb)
    assert (split.hot_slots, split.warm_slots) == (int(hot_rows), min(E - int(hot_rows), int(warm_rows)))
    monkeypatch.setattr(tier_budgets, "probe", lambda api=None: tier_plan.assumed_memory(p, gpu_gb))
    monkeypatch.setattr(tier_budgets, "backend_of", lambda api=None: "cuda")
    model, _ = load(path, config=TierConfig(kernel="auto"))
    cache = model.expert_cache
    assert cache.slots_per_layer == split.hot_slots and cache.warm_slots == (split.warm_slots,) * L
    assert (cache.budget_bytes, cache.warm_budget_bytes) == (split.hot_budget, split.host_budget)
    assert cache.layers[0].slot_nbytes == split.expert_bytes
    assert cache.tier_layers[0].warm.slot_nbytes == split.warm_expert_bytes


@pytest.mark.parametrize("hot_rows,warm_rows", [(3.5, 2.5), (1.2, 9.0)])
def test_plan_split_equals_what_a_run_chooses(tiny_moe_bf16, monkeypatch, hot_rows, warm_rows):
    from mlx_tier.tools.plan import make_plan

    p = make_plan(tiny_moe_bf16, memory_gb=1, disk_gbps=1, compute_gbps=1)
    assert p.expert_bytes_warm > p.expert_bytes_disk  # bf16 scales become float32 for the CPU kernel
    assert_plan_split_equals_run(tiny_moe_bf16, monkeypatch, hot_rows, warm_rows)


@pytest.mark.parametrize("hot_rows,warm_rows", [(2.5, 3.5), (1.5, 1.5)])
def test_plan_warm_slot_keeps_the_checkpoint_dtype_without_the_cpu_kernel(gpt_oss_mxfp8_bf16, monkeypatch,
                                                                         hot_rows, warm_rows):
    """mxfp8 experts: `auto` falls back to MLX's ops, so the warm pool keeps the bf16
    biases as stored (a float32 sizing would count them twice over)."""
    from mlx_tier.tools.plan import make_plan

    p = make_plan(gpt_oss_mxfp8_bf16, memory_gb=1, disk_gbps=1, compute_gbps=1)
    assert p.expert_bytes_warm == p.expert_bytes_disk  # as stored: packed weights, uint8 scales, bf16 biases
    assert_plan_split_equals_run(gpt_oss_mxfp8_bf16, monkeypatch, hot_rows, warm_rows)


def test_trace_sim_warm_slots(tmp_path):
    trace = zipf_trace(2, 16, 2, tokens=80, seed=2)
    path = tmp_path / "t.npz"
    save_trace(trace, path)
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "2", "--slots", "4", "--warm-slots", "6",
                            "--policy", "lru", "--policy", "belady", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)["results"]
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
    data = json.loads(r.stdout)
    assert data["prefetch"] is True and data["prewarm"] is True
    want = simulate_two_tier(trace, "lfu", 3, 6, prewarm=True, prefetch=True).as_dict()
    assert data["results"] == [json.loads(json.dumps(want))] and want["promotions_ahead"] > 0
    assert want != simulate_two_tier(trace, "lfu", 3, 6, prewarm=True).as_dict()
    r = runner.invoke(app, ["trace-sim", str(path), "--slots", "3", "--warm-slots", "6", "--policy", "lfu"])
    assert r.exit_code == 0 and "prefetch from the trace's predictions" in " ".join(r.output.split())


def test_run_refuses_a_bad_host_cache(tmp_path, tiny_moe):
    """(report.json's per-tier counts: tests/engine/test_budgets.py, on a scripted CUDA machine.)"""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.txt").write_text("The river floods every spring.")
    r = runner.invoke(app, ["run", str(docs), "--out", str(tmp_path / "o2"), "--model", str(tiny_moe),
                            "--host-cache-gb", "-2"])
    assert r.exit_code == 2 and "--host-cache-gb must be a finite number of GiB >= 0" in r.output
