"""The pool model prices the experts with the kernel the run computes them with: the CPU
expert kernel's loops and GEMM, or a block kernel (MLX's ``gather_qmm``, Metal) timed as
a tiered layer calls it. A run with ``--kernel mlx`` on MLX's CPU backend was priced on
the CPU kernel, ~30x faster there: its plan and predicted documents/hour were fiction.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_tier.kernels import registry
from mlx_tier.tools import pools

SMALL = {"expert_shape": (64, 32), "bits": 4, "group_size": 32, "heads": 2, "head_dim": 16, "kv_heads": 1}


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(pools, "PROBE_SECONDS", 0.01)


class Clock:
    """A clock only the fake kernel moves (and each reading by a microsecond): the probes'
    timings are exact."""

    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        self.t += 1e-6
        return self.t


def fake_kernel(monkeypatch, seconds):
    """The registry's kernels replaced by one that takes ``seconds(rows, experts, call)``
    on the fake clock (``call``: its count so far); returns the calls' ``(rows, experts)``."""
    clock, calls = Clock(), []
    monkeypatch.setattr(pools, "time", clock)
    monkeypatch.setattr(pools, "_attention_rates", lambda *a: (1.0, 1.0))  # timed elsewhere; not on this clock

    def kernel(inner, x, slots):
        experts = len(np.unique(np.array(slots)))
        calls.append((x.shape[0], experts))
        clock.t += seconds(x.shape[0], experts, len(calls))
        return mx.zeros((x.shape[0], 1, x.shape[-1]))

    monkeypatch.setattr(registry, "kernel_for", lambda name: kernel)
    return calls


def test_a_block_kernels_fixed_and_per_row_costs_are_fitted(monkeypatch, quick):
    """A kernel that takes ``fixed`` seconds an expert it touches and ``per_row`` a row: the
    GEMM's rate is a row's FLOPs over ``per_row``, its fixed cost ``fixed`` (as
    ``dequant_gbps``), a one-row pair costs both, and the loops' rate at many rows
    approaches the fixed cost shared by the rows."""
    fixed, per_row = 4e-3, 1e-4
    calls = fake_kernel(monkeypatch, lambda rows, experts, _: fixed * experts + per_row * rows)
    r = pools.probe_rates(1.0, **SMALL, kernel="mlx")
    inner, hidden = SMALL["expert_shape"]
    flops = 2.0 * 3 * inner * hidden
    assert flops / (r.gemm_gflops * 1e9) == pytest.approx(per_row, rel=0.01)
    assert r.gemm_min_rows == pools.BLOCK_GEMM_ROWS[0]
    # one row a slot: a pair pays the expert's fixed cost and its row
    assert r.dequant_gbps / r.matvec_gbps == pytest.approx((fixed + per_row) / fixed, rel=0.01)
    # LOOP_PROBE_ROWS rows a slot: the rate solved for many rows shares the fixed cost
    assert r.loop_gbps > 3 * r.matvec_gbps
    gemm_calls = [c for c in calls if c[1] == 1]
    assert {rows for rows, _ in gemm_calls} == set(pools.BLOCK_GEMM_ROWS)
    assert {c for c in calls if c[1] > 1} == {(n * pools.BLOCK_PROBE_EXPERTS, pools.BLOCK_PROBE_EXPERTS)
                                              for n in (1, pools.LOOP_PROBE_ROWS)}


@pytest.mark.parametrize("jitter", [0.0, 0.04, -0.04])
def test_a_fixed_cost_within_the_timings_noise_is_none(monkeypatch, quick, jitter):
    """A review: the intercept of two timings' line, taken as it came, read 0.01 GB/s one
    run and the 10 TB/s floor the next on MLX's CPU backend (each row computed on its own,
    no fixed cost). A kernel whose time is its rows, one GEMM timing off by a few percent
    either way: no fixed cost, the row's price from the larger count, within the jitter."""
    per_row = 1e-4

    def seconds(rows, experts, _):
        return per_row * rows * (1 + jitter if rows == pools.BLOCK_GEMM_ROWS[0] and experts == 1 else 1)

    fake_kernel(monkeypatch, seconds)
    r = pools.probe_rates(1.0, **SMALL, kernel="mlx")
    inner, hidden = SMALL["expert_shape"]
    assert 2.0 * 3 * inner * hidden / (r.gemm_gflops * 1e9) == pytest.approx(per_row, rel=0.05)
    assert r.dequant_gbps > 1e3  # the floor: no fixed cost an expert


def test_the_mlx_kernel_is_timed_through_mlx_and_the_cpu_kernel_through_its_loops(monkeypatch, quick):
    """``kernel="mlx"`` calls the registry's MLX kernel on a quantized block, sorted slots
    of the block's experts; ``"cpu"`` never does (the CPU kernel's own probes). Both give
    finite positive rates; an unknown kernel is refused."""
    asked, real = [], registry.kernel_for

    def spy(name):
        fn = real(name)

        def call(inner, x, slots):
            asked.append((name, type(inner).__name__, np.array(slots)[:, 0].tolist()))
            return fn(inner, x, slots)

        return call

    monkeypatch.setattr(registry, "kernel_for", spy)
    for kernel in ("cpu", "mlx"):
        r = pools.probe_rates(1.0, **SMALL, kernel=kernel)
        fields = (r.gemm_gflops, r.matvec_gbps, r.dequant_gbps, r.loop_gbps, r.attention_gflops, r.kv_read_gbps)
        assert all(math.isfinite(x) and x > 0 for x in fields), (kernel, r)
        if kernel == "cpu":
            assert not asked
    assert {name for name, _, _ in asked} == {"mlx"} and {kind for _, kind, _ in asked} == {"SwitchGLU"}
    assert all(slots == sorted(slots) for _, _, slots in asked)
    with pytest.raises(ValueError, match="kernel must be one of"):
        pools.probe_rates(1.0, **SMALL, kernel="fast")


def test_a_run_prices_the_kernel_its_load_chose(monkeypatch, tiny_moe):
    """:func:`pools.rates_for` probes the loaded model's expert kernel, with the gate's shape
    (inner, hidden) as plan does and the experts' quantization mode; a process keeps one
    measurement a kernel (a model of another kernel is probed again, the same one not)."""
    import json

    import mlx_tier

    seen = []
    monkeypatch.setattr(pools, "_RATES", {})
    monkeypatch.setattr(pools, "measure_read_gbps", lambda *a, **k: 1.0)
    monkeypatch.setattr(pools, "probe_rates", lambda disk, **k: seen.append(k) or k["kernel"])
    config = json.loads((tiny_moe / "config.json").read_text())
    for kernel in ("cpu", "mlx", "cpu", "mlx"):
        model, _ = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel=kernel))
        assert pools.rates_for(model, pools.shape_of(model, 1.0)[1]) == model.expert_cache.kernel == kernel
    assert [k["kernel"] for k in seen] == ["cpu", "mlx"] and seen[1]["attention"] == "mlx"
    assert {k["expert_shape"] for k in seen} == {(config["intermediate_size"], config["hidden_size"])}
    assert {k["mode"] for k in seen} == {"affine"}


def test_the_plan_and_the_cache_chooser_price_the_chosen_kernel(monkeypatch, tiny_moe):
    """``plan``'s job pools and a capped run's cache chooser probe the kernel the run would
    use (the split's), and MLX's attention beside any kernel but the CPU one."""
    import json

    from mlx_tier.engine import footprint
    from mlx_tier.engine.checkpoint import open_checkpoint
    from mlx_tier.engine.sizes import needs_of
    from mlx_tier.tools import plan, pool_cache

    seen = []

    def probe(disk, *a, **k):
        seen.append((k["kernel"], k["attention"]))
        return pools.Rates(disk_gbps=1.0, gemm_gflops=40.0, matvec_gbps=8.0, dequant_gbps=8.0,
                           attention_gflops=20.0, per_expert_s=0.0)

    monkeypatch.setattr(pools, "probe_rates", probe)
    monkeypatch.setattr(pool_cache, "probe_rates", probe)
    monkeypatch.setattr(pool_cache, "measure_read_gbps", lambda *a, **k: 1.0)
    config = json.loads((tiny_moe / "config.json").read_text())
    for kernel in ("mlx", "cpu"):
        plan.job_pools(config, 2, 8, 2, 2, 100_000, 1e6, 1.0, 2**28, 300, 32, kernel=kernel)
    assert seen == [("mlx", "mlx"), ("cpu", "cpu" if mx.default_device() == mx.cpu else "mlx")]
    seen.clear()
    needs = needs_of(open_checkpoint(tiny_moe), "cpu", 4, 4)
    budget = footprint.MemoryBudget(2**30, "memory_gb", needs.runtime, needs.dense, 4 * needs.slot_row, 1 << 16,
                                    1 << 20, 1 << 20, 1 << 20, 512, False, needs.shape, "mlx", needs.slot_row)
    pool_cache.cache_for_pools(tiny_moe, budget, 300, 32, 6)
    assert seen == [("mlx", "mlx")]
