"""Invariant 1: a tiered model generates exactly the greedy tokens of the same
checkpoint fully resident in mlx-lm (as ``mlx_lm.load`` loads it: nothing cast),
for every cache size; invariant 2: resident
expert bytes never exceed the budget, and after load only the dense part is resident.
"""

import gc
import threading

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from support.checkpoints import make_mixtral
from support.prompts import LONG, SHORT, greedy

import mlx_tier
from mlx_tier import BudgetError, CheckpointError, TierConfig


@pytest.fixture(scope="module", params=["q4", "fp32", "bf16-q4"])
def checkpoint(request, tiny_moe, tiny_moe_fp, tiny_moe_bf16):
    """A checkpoint and mlx_lm.load's greedy tokens on it, as loaded: the bf16 one
    (mlx-community's usual layout) computes in bf16 in both, nothing cast."""
    path = {"q4": tiny_moe, "fp32": tiny_moe_fp, "bf16-q4": tiny_moe_bf16}[request.param]
    model, tokenizer = mlx_load(str(path))
    refs = {p: greedy(model, tokenizer, p) for p in (SHORT, LONG)}
    return path, refs


@pytest.mark.parametrize("slots", [1, 2, 4, 8])  # 1, top-k, E/2, E
def test_greedy_tokens_equal_mlx_lm(checkpoint, slots):
    path, refs = checkpoint
    model, tokenizer = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots))
    for prompt, ref in refs.items():
        assert greedy(model, tokenizer, prompt) == ref, f"slots={slots} prompt={prompt[:20]!r}"
    stats = model.expert_cache.stats
    assert stats.misses > 0 and stats.bytes_read > 0
    if slots < 8:
        assert stats.evictions > 0  # the small caches really were exercised
    else:  # every expert resident: the remap ran lazily and hits were still counted
        assert all(layer.all_resident() for layer in model.expert_cache.layers)
        hits, misses = stats.hits, stats.misses
        greedy(model, tokenizer, LONG, n=3)
        assert model.expert_cache.stats.hits > hits and model.expert_cache.stats.misses >= misses
    for layer in model.expert_cache.layers:
        assert len(layer.resident_experts()) <= slots


def test_wrong_expert_is_detected(tiny_moe):
    """The exactness test can fail: serving a different expert changes the output."""
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=8))
    x = mx.array(tokenizer.encode(LONG))[None]
    good = model(x)
    for t in model.expert_cache.layers[0].tensors.values():  # every slot now holds another expert
        setattr(t.module, t.attr, mx.roll(t.module[t.attr], 1, axis=0))
    bad = model(x)
    assert not mx.allclose(good, bad, atol=1e-3).item()


def test_budget_sets_slots_and_bounds_resident_bytes(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=1))
    slot_nbytes = model.expert_cache.layers[0].slot_nbytes
    n_layers = len(model.expert_cache.layers)
    budget_gb = 3.5 * slot_nbytes * n_layers / 2**30
    model, tokenizer = mlx_tier.load(tiny_moe, cache_gb=budget_gb)
    cache = model.expert_cache
    assert cache.slots_per_layer == 3
    greedy(model, tokenizer, LONG)
    allocated = sum(
        t.module[t.attr].nbytes for layer in cache.layers for t in layer.tensors.values()
    )
    assert allocated == cache.resident_bytes <= cache.budget_bytes


def test_budget_too_small_is_a_clear_error(tiny_moe):
    with pytest.raises(BudgetError, match="one expert slot per MoE layer needs"):
        mlx_tier.load(tiny_moe, cache_gb=1e-6)
    with pytest.raises(BudgetError, match="slots per layer"):
        mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=9))


def test_default_budget_comes_from_free_memory(tiny_moe):
    model, _ = mlx_tier.load(tiny_moe)
    assert model.expert_cache.slots_per_layer == 8  # tiny experts: all fit in half of free memory


def test_only_the_dense_part_is_resident_after_load(tmp_path, tokenizer_dir):
    path = make_mixtral(tmp_path / "big-experts", tokenizer_dir, quantized=False, hidden_size=128, intermediate_size=2048)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    model, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=8))
    resident = mx.get_active_memory() - before
    dense = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    experts = model.expert_cache.resident_bytes
    assert experts > 0.9 * dense  # so the check below would catch experts being loaded
    assert resident <= dense * 1.02 + 2**16


def test_not_an_moe_checkpoint(tiny_dense, tmp_path):
    with pytest.raises(CheckpointError, match="not a Mixture-of-Experts"):
        mlx_tier.load(tiny_dense)
    with pytest.raises(CheckpointError, match="no config.json"):
        mlx_tier.load(tmp_path)


@pytest.mark.parametrize("read_ahead", [False, True])
def test_failed_read_marks_nothing_resident(tiny_moe, read_ahead):
    """A read error surfaces, and afterwards the model is still exact: no expert
    was marked resident over a slot that never received its weights. (A failed
    read ahead only loses its head start: the forward pass reads again, and
    that read's error surfaces.)"""
    model, tokenizer = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=2, read_ahead=read_ahead))
    store = model.expert_cache.store
    real = store.read_experts
    calls = {"n": 0}
    failed = []

    def flaky(names, experts):
        calls["n"] += 1
        if calls["n"] in (3, 4):  # a read ahead that fails is redone by the forward pass: fail that too
            failed.append(threading.current_thread().name)
            raise OSError(5, "Input/output error")
        return real(names, experts)

    store.read_experts = flaky
    with pytest.raises(OSError):
        greedy(model, tokenizer, LONG)
    # read ahead: the first failure was a read ahead (swallowed), the second the forward pass's own
    assert failed == (["mlx-tier-prefetch_0", "MainThread"] if read_ahead else ["MainThread"])
    store.read_experts = real
    ref_model, ref_tok = mlx_load(str(tiny_moe))
    assert greedy(model, tokenizer, LONG) == greedy(ref_model, ref_tok, LONG)
