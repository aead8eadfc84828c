"""The hot tier's bookkeeping is encapsulated: stats snapshots do not move,
the budget invariant is a checked error, a failed pre-warm never leaves the
store's counters swapped, and prefetched reads enter a layer through one door.
Slots written in place through numpy hold what MLX's casts give, and never a
buffer another model shares.
"""

import copy
from concurrent.futures import Future
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_tier
from mlx_tier import BudgetError, TierConfig
from mlx_tier.engine.checkpoint import TensorInfo
from mlx_tier.engine.expert_cache import ExpertCache
from mlx_tier.engine.prefetch import PrefetchedRead
from mlx_tier.engine.slabs import host_cast, to_mx


def run_tokens(model, ids):
    mx.eval(model(mx.array(ids)[None]))


def test_snapshots_do_not_move_and_their_difference_is_the_phase(tiny_moe):
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2))
    cache = model.expert_cache
    ids = tokenizer.encode("The weather today is mild and the river runs clear")
    run_tokens(model, ids)
    before = cache.snapshot()
    frozen = before.as_dict()
    run_tokens(model, ids[:3])
    after = cache.snapshot()
    assert before.as_dict() == frozen  # a snapshot is a copy, not the live counters
    phase = after - before
    assert phase.hits + phase.misses > 0
    assert phase.misses == after.misses - before.misses and phase.bytes_read == after.bytes_read - before.bytes_read
    assert (after - after).as_dict()["hits"] == 0


def test_slots_per_layer_is_none_when_layers_differ(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(layer_slots=(2, 5)))
    assert model.expert_cache.slots_per_layer is None
    assert model.expert_cache.layer_slots == (2, 5)
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(layer_slots=(3, 3)))
    assert model.expert_cache.slots_per_layer == 3


def test_budget_invariant_is_checked_not_assumed(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2))
    cache = model.expert_cache
    with pytest.raises(BudgetError, match="exceed the cache budget"):
        ExpertCache(cache.layers, cache._stats, cache.resident_bytes - 1, cache.store)


def test_failed_prewarm_restores_the_store_counters(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2))
    cache = model.expert_cache
    counters = cache.store.stats

    class BrokenProfile:
        def hottest(self, layer, n):
            return [0, 1]

    def fail(names, experts):
        raise OSError("disk unplugged")

    cache.store.read_experts = fail
    with pytest.raises(OSError, match="unplugged"):
        cache.prewarm(BrokenProfile())
    assert cache.store.stats is counters


def test_prefetched_read_enters_through_accept_prefetch(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2))
    layer = model.expert_cache.layers[0]
    names = list(layer.tensors)
    nbytes = sum(t.info.expert_nbytes() for t in layer.tensors.values())
    fut = Future()
    fut.set_result(layer.store.read_experts(names, [4]))
    layer.accept_prefetch(PrefetchedRead([4], fut, nbytes))
    assert layer.stats.prefetch_predicted == 1
    list(layer.assign(np.array([[4, 7]])))
    assert layer.stats.prefetch_used == 1
    layer.pending = mx.zeros((1,))
    layer.discard_pending()
    assert layer.pending is None


def _raw(dtype: str) -> np.ndarray:
    """Rows of every kind of value a checkpoint may hold in ``dtype``: normals,
    subnormals, signed zeros, infinities, NaN (raw bits, bfloat16 as uint16)."""
    rng = np.random.default_rng(0)
    if dtype == "U32":
        return rng.integers(0, 2**32, (3, 8), dtype=np.uint32)
    vals = np.array([1.5, -2.25, 1e-40, -1e-42, 0.0, -0.0, np.inf, -np.inf, np.nan, 3e38, 6e-8, 65504],
                    np.float32)
    vals = np.concatenate([vals, rng.standard_normal(12).astype(np.float32) * 10])
    if dtype == "F16":
        with np.errstate(over="ignore"):  # 3e38 becomes inf, as a checkpoint may hold
            return vals.astype(np.float16).reshape(3, 8)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).reshape(3, 8)  # BF16


@pytest.mark.parametrize("stored,casts", [
    ("BF16", (mx.float32,)), ("F16", (mx.float32,)), ("U32", ()), ("F16", ()), ("BF16", (mx.bfloat16, mx.float32)),
])
def test_slots_written_through_numpy_hold_what_mlx_casts_give(stored, casts):
    info = TensorInfo(Path("x.safetensors"), stored, (3, 8), 0, 0)
    raw = _raw(stored)
    cast = host_cast(info, casts)
    want = np.asarray(to_mx(raw, info, casts))
    got = cast(raw)
    assert got.dtype == want.dtype and got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()  # bit for bit


@pytest.mark.parametrize("stored,casts", [("BF16", ()), ("BF16", (mx.float16,)), ("F32", (mx.float16,)),
                                          ("BF16", (mx.float16, mx.float32))])
def test_casts_numpy_does_not_make_alike_are_left_to_mlx(stored, casts):
    assert host_cast(TensorInfo(Path("x.safetensors"), stored, (3, 8), 0, 0), casts) is None


def test_a_copy_and_its_original_each_write_their_own_slots(tiny_moe):
    """A deep copy's slabs share MLX buffers with the original's; a slot written in place
    in either must not change the other's: each model's logits stay those of a model
    never copied, call after call, while the two read different experts."""
    config = TierConfig(slots_per_layer=3)
    model, tokenizer = mlx_tier.load(tiny_moe, config=config)
    alone_a, _ = mlx_tier.load(tiny_moe, config=config)
    alone_b, _ = mlx_tier.load(tiny_moe, config=config)
    a = tokenizer.encode("The weather today is mild and the river runs clear")
    b = tokenizer.encode("Seven ships sailed north; 42 crates, 19 barrels, one goat.")
    for m in (model, alone_a, alone_b):
        run_tokens(m, a)
    twin = copy.deepcopy(model)
    for i in range(len(a)):
        xa, xb = mx.array(a[i:i + 2])[None], mx.array(b[i % len(b):][:3])[None]
        assert mx.array_equal(model(xa), alone_a(xa)).item(), f"the original, call {i}"
        assert mx.array_equal(twin(xb), alone_b(xb)).item(), f"the copy, call {i}"
    assert model.expert_cache.stats.misses > 0 and twin.expert_cache.stats.misses > 0


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the numpy write serves MLX's CPU backend only")
def test_slots_are_written_in_place_on_the_cpu_backend(tiny_moe):
    """The numpy write is the path taken here (a slab of the cache's own, the module's)."""
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2))
    run_tokens(model, tokenizer.encode("The weather today is mild"))
    layer = model.expert_cache.layers[0]
    assert set(layer._private) == set(layer.tensors)
    assert all(layer._private[n] is t.module[t.attr] for n, t in layer.tensors.items())
    assert all(layer._host_slab(n) is not None for n in layer.tensors)


def _experts_of(model, token: int) -> list[set]:
    """The experts each MoE layer routes ``token`` to."""
    before = [layer.counts.copy() for layer in model.expert_cache.layers]
    mx.eval(model(mx.array([[token]])))
    return [set(np.flatnonzero(layer.counts - b)) for layer, b in zip(model.expert_cache.layers, before)]


def test_an_output_still_lazy_is_not_changed_by_a_later_write(tiny_moe):
    """MLX's kernels leave a layer's output lazy; a later call that hits every expert
    replaces the reader the cache knows, and a call after that writes slots: the
    first output, evaluated last, is still what a model with every expert resident gives."""
    config = TierConfig(slots_per_layer=2, kernel="mlx")
    probe, _ = mlx_tier.load(tiny_moe, config=config)
    routes = {t: _experts_of(probe, t) for t in range(100, 300)}
    a = 100
    c = next(t for t, r in routes.items() if not r[-1] & routes[a][-1])  # all misses at the last layer
    model, _ = mlx_tier.load(tiny_moe, config=config)
    full, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=8, kernel="mlx"))
    y1 = model(mx.array([[a]]))
    y2 = model(mx.array([[a]]))
    y3 = model(mx.array([[c]]))
    mx.eval(y1, y2, y3)
    want = full(mx.array([[a]]))
    assert mx.array_equal(y2, want).item() and mx.array_equal(y1, want).item()


def test_a_cast_lets_the_old_slabs_go(tiny_moe):
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=8))
    run_tokens(model, tokenizer.encode("The weather today is mild and the river runs clear"))
    layer = model.expert_cache.layers[0]
    model.set_dtype(mx.float16)
    mx.eval(model(mx.array([[5]])))
    assert all(p is layer.tensors[n].module[layer.tensors[n].attr] for n, p in layer._private.items())
