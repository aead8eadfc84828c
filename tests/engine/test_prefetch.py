"""Prefetch only moves reads earlier: greedy tokens, hits, misses, evictions and
the slabs are those without it, no expert is read twice (extra bytes = wasted
bytes), a failed prefetch falls back to a normal read, and the forward pass's
wait on an in-flight prefetch is counted as stall. Reading a layer's next round
ahead (more experts than slots) likewise, and it is in flight while a round
computes.
"""

import importlib
import threading
import time
from concurrent.futures import Future

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model
from support.arch_configs import BASE, CONFIGS, E

from mlx_tier import TierConfig
from mlx_tier.engine.checkpoint import find_expert_blocks
from mlx_tier.engine.load import tier_model
from mlx_tier.engine.prefetch import PrefetchedRead, expert_input_dims, find_router

# > 32 tokens: prefill takes mlx-lm's sorted path, and prefetch its capped union.
PROMPT = [1, 5, 9, 17, 33, 2, 7] + list(range(40, 200, 5))
PREFETCH_COUNTERS = ("prefetch_predicted", "prefetch_used", "prefetch_wasted_bytes", "stall_seconds")


def tiered(path, **config):
    model, _ = load_model(path, lazy=True)
    tier_model(model, path, TierConfig(**config))
    return model


def greedy_ids(model, n=6):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=n)]


@pytest.fixture(scope="module")
def reference(tiny_moe):
    model, _ = load_model(tiny_moe)
    return greedy_ids(model)


@pytest.mark.parametrize("slots", [1, 2])  # rounds (1 < k), one pass (k)
def test_prefetch_changes_nothing_but_when_bytes_arrive(tiny_moe, reference, slots):
    off = tiered(tiny_moe, slots_per_layer=slots)
    on = tiered(tiny_moe, slots_per_layer=slots, prefetch=True)
    assert greedy_ids(off) == reference
    assert greedy_ids(on) == reference
    s_off, s_on = off.expert_cache.stats, on.expert_cache.stats
    for k in ("hits", "misses", "evictions", "rounds"):  # prefetch never evicts nor reorders
        assert getattr(s_on, k) == getattr(s_off, k), k
    assert on.expert_cache.resident_bytes == off.expert_cache.resident_bytes <= on.expert_cache.budget_bytes
    assert 0 < s_on.prefetch_used <= s_on.prefetch_predicted  # predictions were issued and some served misses
    assert 0 < s_on.prefetch_recall < 1 and 0 < s_on.prefetch_precision <= 1
    # Every prefetched expert either replaced a normal read or was dropped: nothing read twice.
    assert s_on.bytes_read == s_off.bytes_read + s_on.prefetch_wasted_bytes
    assert s_off.prefetch_predicted == s_off.prefetch_wasted_bytes == 0 and s_off.stall_seconds > 0
    on.expert_cache.reset_stats()
    assert all(on.expert_cache.stats.as_dict()[k] == 0 for k in PREFETCH_COUNTERS)


def test_failed_prefetch_falls_back_to_a_normal_read(tiny_moe, reference):
    model = tiered(tiny_moe, slots_per_layer=2, prefetch=True)
    store = model.expert_cache.store
    real = store.read_experts

    def fails_in_background(names, experts):
        if threading.current_thread().name.startswith("mlx-tier-prefetch"):
            raise OSError(5, "Input/output error")
        return real(names, experts)

    store.read_experts = fails_in_background
    assert greedy_ids(model) == reference
    stats = model.expert_cache.stats
    assert stats.prefetch_predicted > 0 and stats.prefetch_used == 0 and stats.prefetch_wasted_bytes == 0


def test_miss_waits_for_in_flight_prefetch_and_takes_its_bytes(tiny_moe):
    model = tiered(tiny_moe, slots_per_layer=2)
    layer = model.expert_cache.layers[1]
    names = list(layer.tensors)
    store = layer.store
    nbytes = sum(t.info.expert_nbytes() for t in layer.tensors.values())
    read_now = []
    real = store.read_experts
    store.read_experts = lambda n, experts: read_now.append(list(experts)) or real(n, experts)

    def arrives_late(experts, delay=0.2):
        fut = Future()
        threading.Timer(delay, lambda: fut.set_result(real(names, experts))).start()
        return PrefetchedRead(experts, fut, nbytes)

    layer.incoming = arrives_late([3, 5])  # 3 will be needed, 5 not
    t0 = time.perf_counter()
    list(layer.assign(np.array([[3, 6]])))
    assert time.perf_counter() - t0 >= 0.15
    assert layer.stats.stall_seconds >= 0.15  # the wait is stall
    assert read_now == [[6]]  # 3 came from the prefetch
    assert layer.stats.prefetch_used == 1 and layer.stats.misses == 2
    layer.end_call()
    assert layer.stats.prefetch_wasted_bytes == nbytes  # expert 5, dropped
    # The slot filled from the prefetched buffer holds expert 3's bytes.
    for name, t in layer.tensors.items():
        got = np.array(t.module[t.attr][int(layer.slot_of[3])])
        want = np.array(mx.array(real([name], [3])[name][0]).astype(t.dtype))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("prefetch", [False, True])
def test_read_ahead_changes_nothing_but_when_bytes_arrive(tiny_moe, reference, prefetch):
    off = tiered(tiny_moe, slots_per_layer=1, read_ahead=False, prefetch=prefetch)
    on = tiered(tiny_moe, slots_per_layer=1, prefetch=prefetch)  # read ahead: the default
    assert greedy_ids(off) == greedy_ids(on) == reference
    s_off, s_on = off.expert_cache.stats, on.expert_cache.stats
    for k in ("hits", "misses", "evictions", "rounds", "prefetch_predicted", "prefetch_used"):
        assert getattr(s_on, k) == getattr(s_off, k), k
    assert s_on.rounds > 0 and s_on.read_ahead > 0 and s_off.read_ahead == 0
    # Nothing read twice: a round's experts read ahead are all used, and none a prefetch holds is read again.
    assert s_on.bytes_read == s_off.bytes_read and s_on.prefetch_wasted_bytes == s_off.prefetch_wasted_bytes


def test_next_round_is_read_while_a_round_computes(tiny_moe):
    model = tiered(tiny_moe, slots_per_layer=2)
    layer = model.expert_cache.layers[0]
    store = layer.store
    real = store.read_experts
    reads = []  # (thread, experts)
    store.read_experts = lambda n, experts: reads.append((threading.current_thread().name, list(experts))) \
        or real(n, experts)
    idx = np.array([[0, 1], [2, 3], [4, 5], [6, 7], [0, 7]])  # 8 experts, 2 slots: 4 rounds
    rounds = []
    for slots, mask in layer.assign(idx):
        assert mask is not None
        ahead = layer.incoming
        rounds.append((sorted(int(e) for e in np.unique(idx[mask])), ahead.experts if ahead else None))
        layer.pending = None
    assert [r[0] for r in rounds] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # While round r computes, round r + 1's experts are in flight; nothing after the last.
    assert [r[1] for r in rounds] == [[2, 3], [4, 5], [6, 7], None]
    assert reads[0] == ("MainThread", [0, 1])  # only the first round is read on the forward pass
    assert all(t.startswith("mlx-tier-prefetch") for t, _ in reads[1:]) and len(reads) == 4
    assert layer.stats.read_ahead == 6 and layer.stats.misses == 8 and layer.stats.prefetch_predicted == 0
    for e in range(6, 8):  # the last round's slots hold the bytes read ahead for it
        for name, t in layer.tensors.items():
            want = np.array(mx.array(real([name], [e])[name][0]).astype(t.dtype))
            np.testing.assert_array_equal(np.array(t.module[t.attr][int(layer.slot_of[e])]), want)


def test_read_ahead_leaves_out_experts_a_prefetch_holds(tiny_moe):
    """A round whose experts a prefetch of predicted ones already holds is not read ahead:
    nothing is read twice, and the prefetch serves it."""
    model = tiered(tiny_moe, slots_per_layer=2)
    layer = model.expert_cache.layers[0]
    store, names = layer.store, list(layer.tensors)
    real = store.read_experts
    fut = Future()
    fut.set_result(real(names, [4, 5]))
    layer.accept_prefetch(PrefetchedRead([4, 5], fut, sum(t.info.expert_nbytes() for t in layer.tensors.values())))
    reads = []
    store.read_experts = lambda n, experts: reads.append(list(experts)) or real(n, experts)
    for _ in layer.assign(np.array([[0, 1], [2, 3], [4, 5], [6, 7]])):  # rounds [0 1] [2 3] [4 5] [6 7]
        layer.pending = None
    assert reads == [[0, 1], [2, 3], [6, 7]]  # 4 and 5 came from the prefetch, read once
    assert layer.stats.prefetch_used == 2 and layer.stats.read_ahead == 4 and layer.stats.misses == 8


# Router found by shape in every mlx-lm MoE type, except where it reads another
# hidden state (gemma4_text; kimi_k3, whose experts see a down-projected x) or
# scores E + zero experts (longcat_flash): prefetch is then off for that layer.
NO_ROUTER = {"gemma4_text", "kimi_k3", "longcat_flash"}
# Plain softmax/top-k routers: the prediction on the block's own input is its routing.
EXACT = ("mixtral", "qwen3_moe", "olmoe", "granitemoe", "step3p5", "hunyuan")


class _Capture(nn.Module):
    def __call__(self, x, indices):
        self.seen = indices
        return mx.zeros((*indices.shape, x.shape[-1]), dtype=x.dtype)


def test_router_found_by_shape_in_every_architecture():
    found = {}
    for name in sorted(CONFIGS):
        config = {**BASE, "model_type": name, **CONFIGS[name]}
        module = importlib.import_module(f"mlx_lm.models.{name}")
        mx.random.seed(0)
        model = module.Model(module.ModelArgs.from_dict(config))
        path, block = find_expert_blocks(model)[0]
        parent_path, _, attr = path.rpartition(".")
        parent = dict(model.named_modules())[parent_path]
        router = find_router(parent, E, expert_input_dims(block))
        found[name] = router is not None
        if name in EXACT:
            x = mx.random.normal((1, 5, expert_input_dims(block)))
            parent[attr] = capture = _Capture()
            parent(x)
            k = capture.seen.shape[-1]
            predicted = mx.argpartition(-router(x), kth=k - 1, axis=-1)[..., :k]
            rows = [np.sort(np.array(a).reshape(-1, k), axis=-1) for a in (predicted, capture.seen)]
            assert np.array_equal(*rows), name  # some blocks flatten x to [T, D] first
    assert {n for n, ok in found.items() if not ok} == NO_ROUTER
    assert find_router(nn.Module(), E, 64) is None
