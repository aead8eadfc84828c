"""The default policy (W-TinyLFU) is scan-resistant and keeps what frequency gains on
trained-like routing: on a loop over 1.1x the cache, where LRU and LFU with dynamic
aging miss (nearly) every access, it hits most; on a hot set plus bursts of scanned
experts, where LFU with dynamic aging flushes the hot set, it is at least as good as
LRU; on trained-like routing it is at least as good as LFU with dynamic aging, within
TOLERANCE. (Numbers at every size: benches/results/policies/NOTES.md.)
"""

import pytest

from mlx_tier.defaults import DEFAULT_POLICY
from mlx_tier.policy.eviction import WTinyLFUPolicy, make_policy
from mlx_tier.routing.simulate import simulate
from mlx_tier.routing.synthetic import (
    cyclic,
    generate,
    hot_and_scan,
    mixtral_like,
    qwen3_like,
)

TOLERANCE = 0.005  # hit rate: the default may trail lfu by at most 0.5 pp on trained-like routing
MARGIN = 0.01  # and LRU by at most 1 pp where LRU is good (hot set plus scan)


def rate(trace, policy, slots):
    return simulate(trace, policy, slots).hit_rate


def test_the_default_is_w_tinylfu():
    assert DEFAULT_POLICY == "tinylfu" and isinstance(make_policy(DEFAULT_POLICY, 8), WTinyLFUPolicy)


@pytest.mark.parametrize("slots", [32, 64, 96])
def test_a_loop_over_1_1x_the_cache_still_hits(slots):
    trace = cyclic(128, 8, round(1.1 * slots), 600)
    assert rate(trace, "lru", slots) < 0.65 and rate(trace, "lfu", slots) < 0.65  # recency: 62%, 25%, 0%
    assert rate(trace, DEFAULT_POLICY, slots) > 0.70  # Belady ~89%


@pytest.mark.parametrize("experts,top_k,slots,kw", [
    (1024, 1, 64, {}),  # top-1: a hot set used in turn, bursts of 3 uses of a scanned expert
    (128, 8, 64, {"scan_share": 0.6, "burst": 4, "width": 4}),  # top-8: 4 scanned experts a token
])
def test_a_hot_set_plus_a_scan_keeps_the_hot_set(experts, top_k, slots, kw):
    trace = hot_and_scan(experts, top_k, round(0.78 * slots), 6000 // top_k, **kw)
    lru, lfu = rate(trace, "lru", slots), rate(trace, "lfu", slots)
    assert lfu < lru - 0.3  # the bursts flush LFU-DA's hot set (44% and 37% against 88% and 82%)
    assert rate(trace, DEFAULT_POLICY, slots) >= lru - MARGIN


@pytest.mark.parametrize("model,tokens,slot_counts", [
    (mixtral_like(8), 1000, (4, 6)),
    (qwen3_like(4, stick=0.3), 600, (32, 64, 96)),
])
def test_trained_like_routing_keeps_what_lfu_gains(model, tokens, slot_counts):
    trace = generate(model, tokens, seed=0)
    for slots in slot_counts:
        lfu, lru = rate(trace, "lfu", slots), rate(trace, "lru", slots)
        got = rate(trace, DEFAULT_POLICY, slots)
        assert got >= lfu - TOLERANCE and got >= lru, (model.name, slots, got, lfu, lru)


def _filled(slots, experts):
    p = WTinyLFUPolicy(slots)
    for e in experts:
        p.insert(e)
    return p


def test_the_window_oldest_gets_in_only_by_being_used_more():
    p = _filled(4, (1, 2, 3, 4))  # window [4], probation [1, 2, 3]
    assert p.evict() == 4  # a tie (one use each) keeps the resident expert
    p.insert(5)
    p.access(5)
    p.access(5)  # 5 (three uses) now beats probation's oldest, 1 (one use)
    assert p.evict(protected={6}) == 1
    p.insert(6)
    assert 5 in p._probation and 6 in p._window


def test_a_hit_on_probation_protects_and_protection_is_bounded():
    p = _filled(6, range(6))  # window [5], probation [0..4]; protected holds at most 80% of 5 = 4
    for e in (0, 1, 2, 3, 4):
        p.access(e)
    assert list(p._protected) == [1, 2, 3, 4] and list(p._probation) == [0]  # 0, oldest, went back
    assert p.evict() == 5  # window's 5 (1 use) does not beat 0 (2 uses)


def test_a_tokens_own_new_experts_do_not_enter_the_main_area_untested():
    p = _filled(8, range(8))  # window [7], main [0..6]
    for e in range(8):
        p.access(e)  # every resident expert used twice
    for e in (10, 11, 12, 13):  # one token's four new experts, protected while they are served
        p.evict(protected={10, 11, 12, 13})
        p.insert(e)
    assert set(p._window) == {10, 11, 12, 13}  # the window grew to the token's experts
    for e in (20, 21, 22, 23):  # the next token's: the last token's lose to the more used main area
        assert p.evict(protected={20, 21, 22, 23}) in {10, 11, 12, 13}
        p.insert(e)
    assert len(p) == 8 and set(p._probation) | set(p._protected) <= set(range(8))


def test_counts_halve_so_popularity_can_change():
    p = WTinyLFUPolicy(2)  # halves every 10 x 2 = 20 counted uses
    p.insert(1)
    for _ in range(18):
        p.access(1)
    assert p._uses[1] == 19
    p.access(1)  # the 20th use
    assert p._uses[1] == 10


def test_remove_forgets_without_choosing_and_all_protected_raises():
    p = _filled(3, (1, 2, 3))
    p.remove(2)
    assert len(p) == 2
    with pytest.raises(KeyError):
        p.remove(2)
    with pytest.raises(RuntimeError, match="every resident expert is protected"):
        p.evict(protected={1, 3})
    assert {p.evict(), p.evict()} == {1, 3}
