"""The hot tier's bookkeeping is encapsulated: stats snapshots do not move,
the budget invariant is a checked error, a failed pre-warm never leaves the
store's counters swapped, and prefetched reads enter a layer through one door.
"""

from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import pytest

import mlx_tier
from mlx_tier import BudgetError, TierConfig
from mlx_tier.engine.cache import ExpertCache
from mlx_tier.engine.prefetch import PrefetchedRead


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
