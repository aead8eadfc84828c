"""LRU evicts the least recently used expert that is not protected."""

import functools

import pytest

from mlx_tier.policy.eviction import LRUPolicy, make_policy


def test_lru_order_and_protection():
    p = LRUPolicy()
    for e in (3, 1, 7):
        p.insert(e)
    p.access(3)  # order now 1, 7, 3
    assert p.evict() == 1
    assert p.evict(protected={7}) == 3
    assert len(p) == 1
    with pytest.raises(RuntimeError):
        p.evict(protected={7})


def test_make_policy_builds_by_name_and_refuses_unknown_names():
    assert isinstance(make_policy("lru"), LRUPolicy)
    belady = make_policy("belady", 4, future=[1, 2, 1])
    for e in (1, 2):
        belady.insert(e)
    assert belady.evict() == 2  # 1 is used again, 2 never: the future was taken
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fifo")


def test_policy_spec_makes_each_layer_its_own_policy_and_knows_what_it_needs():
    from mlx_tier.policy.eviction import PinnedPolicy, PolicySpec

    class Profile:  # a scripted profile: layer 1 says expert 5 is hot
        def frequencies(self, layer):
            return {5: 100.0} if layer == 1 else {}

    spec = PolicySpec("pinned", Profile())
    assert spec.live and spec.needs_profile
    p0, p1 = spec.make(0, 2), spec.make(1, 2)
    assert isinstance(p1, PinnedPolicy) and p0 is not p1
    for e in (5, 6):
        p1.insert(e)
    assert p1.evict() == 6  # the profile's hot expert stays
    assert not PolicySpec("belady").live and not PolicySpec("lru").needs_profile
    with pytest.raises(ValueError, match="unknown policy"):
        PolicySpec("fifo")


def test_lfu_with_aging_prefers_frequent_then_ages():
    from mlx_tier.policy.eviction import LFUAgingPolicy

    p = LFUAgingPolicy()
    for e in (1, 2, 3):
        p.insert(e)
    p.access(1)
    p.access(1)
    p.access(3)
    assert p.evict() == 2  # least frequent
    p.insert(4)  # enters with the evicted priority as its age: 1 + 1 = 2, ties with 3 (older) -> 3 goes
    assert p.evict(protected={1}) == 3


def test_2q_is_scan_resistant():
    from mlx_tier.policy.eviction import TwoQPolicy

    p = TwoQPolicy(slots=8)  # A1in holds 2 (25%), the ghost list A1out 4 (50%)
    for e in range(8):
        p.insert(e)  # all new: they enter the FIFO A1in
    assert p.evict() == 0  # A1in over its share: its oldest leaves, remembered in A1out
    p.insert(0)  # seen again while remembered -> the main LRU (Am)
    assert 0 in p._am
    for e in range(100, 110):  # a scan of one-off experts
        p.insert(e)
        p.evict(protected={e})
    assert 0 in p._am  # the scan did not flush the re-referenced expert


def test_pinned_keeps_profile_hot_experts():
    from mlx_tier.policy.eviction import PinnedPolicy

    p = PinnedPolicy(frequencies={5: 100, 6: 1, 7: 50})
    for e in (5, 6, 7):
        p.insert(e)
    p.access(6)
    assert p.evict() == 6  # least frequent in the profile, though most recent
    assert p.evict() == 7


def _optimal_misses(seq, slots):
    """Brute force: fewest misses over every eviction choice (tiny inputs)."""

    @functools.cache
    def best(i, resident):
        if i == len(seq):
            return 0
        e = seq[i]
        if e in resident:
            return best(i + 1, resident)
        if len(resident) < slots:
            return 1 + best(i + 1, resident | {e})
        return 1 + min(best(i + 1, (resident - {v}) | {e}) for v in resident)

    return best(0, frozenset())


def test_belady_is_optimal_on_small_sequences():
    import random

    from mlx_tier.routing.simulate import simulate_layer

    rng = random.Random(1)
    for _ in range(30):
        seq = [rng.randrange(5) for _ in range(14)]
        slots = rng.randrange(1, 4)
        hits, n = simulate_layer([[e] for e in seq], "belady", slots)
        assert n - hits == _optimal_misses(tuple(seq), slots), (seq, slots)


def test_belady_bounds_every_policy():
    from mlx_tier.routing.simulate import simulate, zipf_trace

    trace = zipf_trace(num_layers=3, num_experts=32, top_k=4, tokens=150, seed=2)
    for slots in (4, 8, 16, 24):
        ceiling = simulate(trace, "belady", slots).hit_rate
        for policy in ("tinylfu", "lru", "lfu", "2q", "pinned"):
            assert simulate(trace, policy, slots).hit_rate <= ceiling + 1e-12, (policy, slots)
