"""MLX memory controls: the wired limit covers the resident set (dense + slabs +
KV) within the device's recommended maximum, the buffer cache is bounded and
never raised, and both limits are restored on exit, even after an error.

A scripted fake of ``mlx.core``'s memory functions stands in for a Mac; the
real-Metal check is marked ``metal`` and skipped elsewhere.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_tier
from mlx_tier.engine import memory
from mlx_tier.engine.memory import ResidentSet
from mlx_tier.units import GIB


class FakeMetal:
    def __init__(self, available: bool):
        self.available = available

    def is_available(self) -> bool:
        return self.available


class FakeMx:
    """``set_wired_limit``/``set_cache_limit`` return the previous value like
    MLX's; every call is recorded in ``calls``."""

    def __init__(self, *, metal: bool, max_recommended: int | None = None, wired: int = 0, cache: int = 48 * GIB):
        self.metal = FakeMetal(metal)
        self.info = {"architecture": "fake"}
        if max_recommended is not None:
            self.info["max_recommended_working_set_size"] = max_recommended
        self.wired, self.cache = wired, cache
        self.calls: list[tuple] = []

    def device_info(self) -> dict:
        return dict(self.info)

    def set_wired_limit(self, n: int) -> int:
        self.calls.append(("wired", n))
        if "max_recommended_working_set_size" in self.info and n > self.info["max_recommended_working_set_size"]:
            raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than the system limit")
        previous, self.wired = self.wired, n
        return previous

    def set_cache_limit(self, n: int) -> int:
        self.calls.append(("cache", n))
        previous, self.cache = self.cache, n
        return previous

    def synchronize(self) -> None:
        self.calls.append(("sync",))


def _resident(dense=2 * GIB, slabs=4 * GIB, kv=1 * GIB, slot=9 << 20) -> ResidentSet:
    return ResidentSet(dense, slabs, kv, slot)


def test_wired_limit_covers_resident_set_with_margin():
    fake = FakeMx(metal=True, max_recommended=12 * GIB)
    settings = memory.plan_memory(_resident(), "metal", fake.device_info())
    assert settings.wired_limit == int(7 * GIB * 1.1)
    assert settings.wired_covers_resident is True
    with memory.memory_controls(settings, fake) as report:
        assert fake.wired == int(7 * GIB * 1.1)
        assert report["resident_total"] == 7 * GIB
        assert report["previous_wired_limit"] == 0
    assert fake.wired == 0 and fake.cache == 48 * GIB  # restored
    assert fake.calls[-3][0] == "sync"  # the device finishes before the limits change


def test_wired_limit_bounded_by_recommended_maximum():
    fake = FakeMx(metal=True, max_recommended=5 * GIB)  # 7 GiB resident does not fit
    settings = memory.plan_memory(_resident(), "metal", fake.device_info())
    assert settings.wired_limit == 5 * GIB
    assert settings.wired_covers_resident is False
    assert "exceeds the recommended maximum" in settings.note
    with memory.memory_controls(settings, fake):  # the fake raises above the maximum, like MLX
        assert fake.wired == 5 * GIB


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_no_wired_limit_off_metal_but_cache_bounded(backend):
    fake = FakeMx(metal=False)
    settings = memory.plan_memory(_resident(slot=32 << 20), backend, fake.device_info())
    assert settings.wired_limit is None and settings.wired_max is None
    assert "MLX wires only Metal buffers" in settings.note
    with memory.memory_controls(settings, fake) as report:
        assert not any(c[0] == "wired" for c in fake.calls)
        assert fake.cache == memory.CACHE_SLOTS * (32 << 20) == report["cache_limit"]
    assert fake.cache == 48 * GIB


def test_cache_limit_from_slot_size_with_a_floor_and_never_raised():
    assert memory.plan_memory(_resident(slot=1 << 20), "cpu", {}).cache_target == memory.CACHE_FLOOR
    assert memory.plan_memory(_resident(slot=64 << 20), "cpu", {}).cache_target == 16 * (64 << 20)
    fake = FakeMx(metal=False, cache=32 << 20)  # a stricter limit already in force
    settings = memory.plan_memory(_resident(), "cpu", {})
    with memory.memory_controls(settings, fake) as report:
        assert fake.cache == 32 << 20 == report["cache_limit"]
    assert fake.cache == 32 << 20


def test_limits_restored_after_an_error():
    fake = FakeMx(metal=True, max_recommended=64 * GIB, wired=3 * GIB, cache=5 * GIB)
    settings = memory.plan_memory(_resident(), "metal", fake.device_info())
    with pytest.raises(RuntimeError), memory.memory_controls(settings, fake):
        raise RuntimeError("generation failed")
    assert (fake.wired, fake.cache) == (3 * GIB, 5 * GIB)


def test_metal_without_recommended_size_sets_no_wired_limit():
    settings = memory.plan_memory(_resident(), "metal", {})
    assert settings.wired_limit is None and "no recommended size" in settings.note


def test_kv_estimate_standard_attention():
    class Args:
        num_hidden_layers, num_attention_heads, num_key_value_heads, hidden_size = 24, 32, 4, 2048

    assert memory.kv_bytes_estimate(Args, 4096, 2, 2) == 2 * 24 * 4 * 64 * 2 * 4096 * 2

    class WithHeadDim(Args):
        head_dim = 128

    assert memory.kv_bytes_estimate(WithHeadDim, 100, 1, 4) == 2 * 24 * 4 * 128 * 4 * 100
    assert memory.kv_bytes_estimate(None, 100, 1, 4) == 0


def test_resident_set_of_a_tiered_model(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=3))
    rs = memory.resident_set(model, context=256, batch=2)
    cache = model.expert_cache
    assert rs.slab_bytes == cache.resident_bytes == 3 * sum(layer.slot_nbytes for layer in cache.layers)
    assert rs.slot_bytes == cache.layers[0].slot_nbytes
    # dense: embeddings, attention, norms, routers -- and no slab counted twice
    embed = model.model.embed_tokens
    assert rs.dense_bytes >= sum(a.nbytes for a in (embed.weight,))
    from mlx.utils import tree_flatten

    everything = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    assert rs.dense_bytes <= everything
    args = model.args
    itemsize = 4 if mx.default_device() == mx.cpu else 2
    head_dim = args.hidden_size // args.num_attention_heads
    assert rs.kv_bytes == 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * itemsize * 256 * 2
    with memory.model_memory_controls(model, 256, 2) as report:
        assert report["backend"] == memory.backend_of()
        assert report["cache_limit"] <= report["previous_cache_limit"]


@pytest.mark.metal
@pytest.mark.skipif(not mx.metal.is_available(), reason="needs Apple Metal")
def test_real_metal_limits_set_and_restored():
    info = mx.device_info()
    settings = memory.plan_memory(_resident(dense=GIB // 4, slabs=GIB // 4, kv=GIB // 8), "metal", info)
    before_wired = mx.set_wired_limit(0)
    mx.set_wired_limit(before_wired)
    with memory.memory_controls(settings, mx) as report:
        assert report["wired_covers_resident"] is True
        assert mx.set_wired_limit(settings.wired_limit) == settings.wired_limit  # it was in force
    assert mx.set_wired_limit(before_wired) == before_wired


def test_job_reports_and_restores_the_limits(tmp_path, tiny_moe, monkeypatch):
    """``mlx-tier run`` sets the limits for the job, writes them to report.json
    under ``memory``, and leaves MLX's limits as it found them."""
    import json

    from mlx_tier.job.run import JobConfig, Reporter, run_job
    from mlx_tier.job.scheduler import GenerationConfig

    monkeypatch.setattr("mlx_tier.job.model_setup.FALLBACK_CONTEXT", 256)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    before = mx.set_cache_limit(7 << 30)  # a known limit in force before the job
    try:
        run_job(JobConfig(input=docs, out_dir=tmp_path / "out", model=tiny_moe,
                          generation=GenerationConfig(max_tokens=3)), Reporter())
        assert mx.set_cache_limit(before) == 7 << 30  # restored
    finally:
        mx.set_cache_limit(before)
    m = json.loads((tmp_path / "out" / "report.json").read_text())["memory"]
    assert m["backend"] == memory.backend_of()
    assert m["resident_total"] == sum(m["resident"][k] for k in ("dense_bytes", "slab_bytes", "kv_bytes")) > 0
    assert m["cache_limit"] == min(m["cache_target"], 7 << 30) and m["previous_cache_limit"] == 7 << 30
    if m["backend"] != "metal":
        assert m["wired_limit"] is None and "only Metal" in m["note"]
