"""The two-tier placement rule (mlx_tier.policy.placement, mlx_tier.policy.cost_model) and its simulator:
hand-worked event sequences (calls, warm -> hot prefetch, pre-warm), the cost
model's thresholds with their numbers, and
cross-checks against the independent single-tier simulator (W = 0 is the
single-tier cache; with copy-always LRU the hot tier is an LRU of H slots and
hot + warm an LRU of H + W slots). Per tier, resident experts never exceed the slots.
"""

import math

import numpy as np
import pytest

from mlx_tier.policy.cost_model import TransferCosts, copy_ahead_pays, goes_to_hot
from mlx_tier.policy.eviction import PolicySpec, make_policy
from mlx_tier.policy.placement import (
    DEMOTE,
    DROP,
    HOT_HIT,
    MISS_HOT,
    MISS_WARM,
    PROMOTE,
    PROMOTE_AHEAD,
    WARM_HIT,
    TierIndex,
)
from mlx_tier.routing.simulate import simulate, zipf_trace
from mlx_tier.routing.simulate_tiers import replay_layer, simulate_two_tier
from mlx_tier.routing.trace import Trace

NEVER_COPY = TransferCosts(cpu_gbps=math.inf)  # the CPU is free: copy only into a free hot slot
ALWAYS_COPY = TransferCosts(pcie_gbps=math.inf, gpu_gbps=math.inf)


def run(calls, H, W, costs, policy="lru", E=4):
    index = TierIndex(0, E, H, W, PolicySpec(policy), costs, expert_nbytes=1)
    index.log = []
    replay_layer(index, [np.array(c) for c in calls])
    return index


def test_cost_model_threshold_with_its_numbers():
    c = TransferCosts()  # 25 GB/s PCIe, 1000 GB/s GPU, 50 GB/s CPU per token
    gb = 10**9
    assert c.cpu_seconds(gb, 1) == pytest.approx(0.02)
    assert c.copy_seconds(gb, 1) == pytest.approx(0.04 + 0.001)
    # threshold t > 50 x (1/25 + 1/1000) = 2.05 tokens
    assert [c.copy_is_cheaper(gb, t) for t in (1, 2, 3, 10)] == [False, False, True, True]
    # Another machine: PCIe 3.0 (12 GB/s), a CPU at 100 GB/s: 100 x (1/12 + 1/900) = 8.44
    pcie3 = TransferCosts(pcie_gbps=12, gpu_gbps=900, cpu_gbps=100)
    assert [pcie3.copy_is_cheaper(336 * 2**20, t) for t in (8, 9)] == [False, True]
    # A free hot slot is always filled; otherwise the model decides.
    assert goes_to_hot(c, gb, 1, hot_has_free_slot=True)
    assert not goes_to_hot(c, gb, 1, hot_has_free_slot=False)
    assert goes_to_hot(c, gb, 3, hot_has_free_slot=False)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_cost_model_rejects_bad_bandwidths(bad):
    with pytest.raises(ValueError, match="cpu_gbps must be a positive bandwidth"):
        TransferCosts(cpu_gbps=bad)


def test_never_copy_computes_on_the_cpu_once_hot_is_full():
    ix = run([[0], [1], [2], [0], [1]], H=1, W=1, costs=NEVER_COPY)
    assert ix.log == [(MISS_HOT, 0), (MISS_WARM, 1), (DROP, 1), (MISS_WARM, 2), (HOT_HIT, 0),
                      (DROP, 2), (MISS_WARM, 1)]


def test_always_copy_demotes_to_warm_and_promotes_back():
    ix = run([[0], [1], [2], [1], [0]], H=1, W=1, costs=ALWAYS_COPY)
    assert ix.log == [(MISS_HOT, 0),
                      (DEMOTE, 0), (MISS_HOT, 1),
                      (DROP, 0), (DEMOTE, 1), (MISS_HOT, 2),
                      (DEMOTE, 2), (PROMOTE, 1),  # 1's warm slot taken by 2: a swap
                      (DROP, 2), (DEMOTE, 1), (MISS_HOT, 0)]
    assert ix.hot_slot[0] >= 0 and ix.warm_slot[1] >= 0 and ix.warm_slot[2] < 0


def test_many_tokens_on_a_warm_expert_promote_it():
    """Default costs: 3 tokens copy, 2 compute on the CPU."""
    ix = run([[0], [1], [[1], [1]], [[1], [1], [1]]], H=1, W=1, costs=TransferCosts())
    assert [k for k, _ in ix.log] == [MISS_HOT, MISS_WARM, WARM_HIT, DEMOTE, PROMOTE]
    assert ix.hot_slot[1] >= 0 and ix.warm_slot[0] >= 0


@pytest.mark.parametrize("costs", [NEVER_COPY, ALWAYS_COPY, TransferCosts()])
def test_rounds_keep_each_tier_within_its_slots(costs):
    rng = np.random.default_rng(0)
    H, W, E = 2, 3, 8
    index = TierIndex(0, E, H, W, PolicySpec("lfu"), costs, expert_nbytes=1)
    for _ in range(50):
        idx = rng.integers(0, E, size=(int(rng.integers(1, 6)), 2))
        uses = np.bincount(idx.reshape(-1), minlength=E)
        for group in index.rounds(np.flatnonzero(uses).tolist()):
            assert len(group) <= H + W
            index.place(group, uses)
            hot, warm = set(np.flatnonzero(index.hot_slot >= 0)), set(np.flatnonzero(index.warm_slot >= 0))
            assert set(group) <= hot | warm and not hot & warm
            assert len(hot) <= H and len(warm) <= W
            slots = index.hot_slot[list(hot)].tolist()
            assert len(set(slots)) == len(slots) and all(0 <= s < H for s in slots)


@pytest.mark.parametrize("policy", ["tinylfu", "lru", "lfu", "2q"])
@pytest.mark.parametrize("H", [1, 3, 6])
def test_without_a_warm_tier_it_is_the_single_tier_cache(policy, H):
    trace = zipf_trace(2, 8, 2, tokens=120, seed=3)
    two = simulate_two_tier(trace, policy, H, 0)
    one = simulate(trace, policy, H)
    assert two.counts[HOT_HIT] == one.hits
    assert two.counts[MISS_HOT] == one.accesses - one.hits and two.counts[MISS_WARM] == 0


@pytest.mark.parametrize("H,W", [(1, 1), (2, 3), (4, 2)])
def test_copy_always_lru_is_an_lru_hierarchy(H, W):
    """Top-1, so that no call holds two experts: within one call the single
    cache touches hits in id order, the two-tier one hot hits before warm ones."""
    trace = zipf_trace(3, 16, 1, tokens=300, alpha=0.9, seed=5)
    two = simulate_two_tier(trace, "lru", H, W, costs=ALWAYS_COPY)
    assert two.counts[HOT_HIT] == simulate(trace, "lru", H).hits
    assert two.counts[HOT_HIT] + two.counts[PROMOTE] == simulate(trace, "lru", H + W).hits
    assert two.counts[WARM_HIT] == two.counts[MISS_WARM] == 0


def test_warm_tier_raises_the_host_hit_rate():
    trace = zipf_trace(2, 16, 2, tokens=200, seed=1)
    off = simulate_two_tier(trace, "lru", 4, 0)
    on = simulate_two_tier(trace, "lru", 4, 8)
    assert on.miss_rate < off.miss_rate
    assert on.cpu_share > 0 and off.cpu_share == 0
    assert on.hot_hit_rate + on.warm_hit_rate + on.miss_rate == pytest.approx(1.0)


def test_policy_remove_forgets_without_side_effects():
    for name in ("tinylfu", "lru", "lfu", "2q"):
        p = make_policy(name, 4)
        for e in (1, 2, 3):
            p.insert(e)
        p.remove(2)
        assert {p.evict(), p.evict()} == {1, 3}, name


def test_simulator_refuses_belady_and_bad_sizes():
    trace = zipf_trace(1, 8, 2, tokens=10)
    with pytest.raises(ValueError, match="single-tier only"):
        simulate_two_tier(trace, "belady", 2, 2)
    with pytest.raises(ValueError, match="hot \\+ warm"):
        simulate_two_tier(trace, "lru", 4, 5)


def test_copy_ahead_threshold_with_its_numbers():
    """Ahead of use the PCIe copy is hidden: copy when t > cpu / gpu."""
    gb = 10**9
    assert copy_ahead_pays(TransferCosts(), gb, 1)  # 1/1000 s on the GPU < 1/50 s on the CPU
    slow_gpu = TransferCosts(gpu_gbps=40, cpu_gbps=100)  # threshold 2.5 tokens
    assert [copy_ahead_pays(slow_gpu, gb, t) for t in (1, 2, 3)] == [False, False, True]
    assert not copy_ahead_pays(NEVER_COPY, gb, 100) and copy_ahead_pays(ALWAYS_COPY, gb, 1)


def test_promote_ahead_moves_predicted_warm_experts_to_hot():
    ix = run([[0], [1]], H=1, W=2, costs=TransferCosts())  # 0 hot, 1 warm (one token: the CPU computes it)
    assert ix.log == [(MISS_HOT, 0), (MISS_WARM, 1)]
    moves = ix.promote_ahead(np.array([[1, 0]]))  # 0 is predicted too: no victim allowed
    assert moves.copies == [] and len(ix.log) == 2
    moves = ix.promote_ahead(np.array([[1, 2]]))  # 2 is cold: left to the read-ahead
    assert ix.log[2:] == [(DEMOTE, 0), (PROMOTE_AHEAD, 1)]
    assert moves.copies == [("demote", 0, 0, 0), ("promote", 1, 0, 0)]  # a swap through warm slot 0
    replay_layer(ix, [np.array([1])])
    assert ix.log[-1] == (HOT_HIT, 1) and ix.counts[PROMOTE_AHEAD] == 1
    # Most voted first; never-copy costs only fill a free hot slot
    ix = run([[0], [1], [2]], H=2, W=2, costs=NEVER_COPY, E=6)
    assert ix.log == [(MISS_HOT, 0), (MISS_HOT, 1), (MISS_WARM, 2)]
    assert ix.promote_ahead(np.array([[2, 3]])).copies == [] and ix.counts[PROMOTE_AHEAD] == 0
    # The most voted expert goes first (id order would pick 1), and the promoted one is then protected
    ix = run([[0], [1], [2]], H=1, W=2, costs=TransferCosts())
    ix.promote_ahead(np.array([[2], [2], [1]]))
    assert ix.log[3:] == [(DEMOTE, 0), (PROMOTE_AHEAD, 2)]
    assert ix.hot_slot[2] >= 0 and ix.warm_slot[1] >= 0 and ix.warm_slot[0] >= 0


def test_prewarm_fills_hot_then_warm_by_rank():
    ix = TierIndex(0, 8, 2, 3, PolicySpec("lru"), TransferCosts(), expert_nbytes=1)
    moves = ix.prewarm([5, 3, 7, 1, 0, 2])
    assert moves.reads == [(5, "hot", 0), (3, "hot", 1), (7, "warm", 0), (1, "warm", 1), (0, "warm", 2)]
    assert ix.hot_slot[2] < 0 and ix.warm_slot[2] < 0 and sum(ix.counts.values()) == 0  # not hits nor misses
    assert ix.hot_policy.evict() == 3 and ix.warm_policy.evict() == 0  # the hottest is the most recent
    ix = TierIndex(0, 8, 2, 3, PolicySpec("lru"), TransferCosts(), expert_nbytes=1)
    replay_layer(ix, [np.array([5])])
    assert ix.prewarm([5, 6]).reads == [(6, "hot", 1)]  # already placed experts are skipped


def test_simulator_replays_predictions_only_when_asked_and_recorded():
    experts = np.array([[0], [1], [0], [1], [2], [1]], np.int32)
    predicted = np.array([[-1], [-1], [1], [-1], [-1], [-1]], np.int32)
    n = len(experts)
    t = Trace(np.arange(n), np.zeros(n, np.int32), np.ones(n, np.uint8), experts,
              {"num_layers": 1, "num_experts": 4, "top_k": 1}, predicted)
    # H=1, W=1, default costs: 0 hot, 1 warm; the prediction before record 2 promotes 1 ahead
    on = simulate_two_tier(t, "lru", 1, 1, keep_events=True, prefetch=True)
    off = simulate_two_tier(t, "lru", 1, 1, keep_events=True)
    assert on.events[0][:5] == ((MISS_HOT, 0), (MISS_WARM, 1), (DEMOTE, 0), (PROMOTE_AHEAD, 1), (WARM_HIT, 0))
    assert off.counts[PROMOTE_AHEAD] == 0 and on.counts[PROMOTE_AHEAD] == 1
    with pytest.raises(ValueError, match="no prefetch predictions"):
        simulate_two_tier(Trace(t.token, t.layer, t.phase, t.experts, t.meta), "lru", 1, 1, prefetch=True)
    # pre-warm from the trace's own counts: 1 (3 uses) hot, 0 (2 uses) warm
    warmed = simulate_two_tier(t, "lru", 1, 1, keep_events=True, prewarm=True)
    assert warmed.events[0][:2] == ((WARM_HIT, 0), (HOT_HIT, 1))
