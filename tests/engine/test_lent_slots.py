"""Slots lent to the expert cache and taken back (``ExpertCache.lend_slots``,
``LayerCache.resize``): the resident experts keep their slots and bytes, the
budget follows, and the tokens do not depend on when slots come and go."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_tier
from mlx_tier import TierConfig

PROMPT = "Seven ships sailed north; 42 crates, 19 barrels, one goat, and the river ran clear."


def _load(path, slots: int, kernel: str):
    return mlx_tier.load(path, config=TierConfig(slots_per_layer=slots, kernel=kernel))


def _run(model, ids: list[int], lend: dict[int, int], decode: int = 8) -> tuple[list[mx.array], list[int]]:
    """Logits of a prompt call and of greedy decode calls after it; before decode call
    ``i`` the cache's lent slots become ``lend[i]`` where given."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(mx.array(ids)[None], cache=cache)]
    tokens = []
    for i in range(decode):
        if i in lend:
            model.expert_cache.lend_slots(lend[i])
        tokens.append(int(mx.argmax(logits[-1][0, -1]).item()))
        logits.append(model(mx.array([[tokens[-1]]]), cache=cache))
        mx.eval(logits[-1])
    return logits, tokens


@pytest.mark.parametrize("kernel, bf16", [("mlx", False), ("cpu", False), ("mlx", True)])
def test_lent_and_taken_back_slots_leave_the_tokens(tiny_moe, tiny_moe_bf16, kernel, bf16):
    """Slots lent mid-decode, more lent, then taken back: the same greedy tokens as a
    cache that never changed, logits bit-equal on the MLX path (a slot's position changes
    no computation; bf16 slabs are resized by MLX ops, not through numpy) and within the
    CPU kernel's bound (its rounds differ with the slots)."""
    path = tiny_moe_bf16 if bf16 else tiny_moe
    ids = mlx_tier.load(path, config=TierConfig(slots_per_layer=1))[1].encode(PROMPT)
    want, want_tokens = _run(_load(path, 1, kernel)[0], ids, {})
    model = _load(path, 1, kernel)[0]
    if bf16:
        assert any(t.dtype == mx.bfloat16 for t in model.expert_cache.layers[0].tensors.values())  # MLX-op rows
    got, got_tokens = _run(model, ids, {1: 2, 3: 3, 5: 0, 6: 1})
    assert got_tokens == want_tokens
    for i, (g, w) in enumerate(zip(got, want)):
        if kernel == "mlx":
            assert mx.array_equal(g, w).item(), f"call {i}"
        else:
            assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item(), f"call {i}: {mx.abs(g - w).max().item()}"
    assert model.expert_cache.layer_slots == (2,) * len(model.expert_cache.layers)


@pytest.mark.parametrize("through_numpy", [True, False])
def test_resize_keeps_residents_and_their_bytes(tiny_moe, monkeypatch, through_numpy):
    """Growing keeps each resident expert's slot and bytes; shrinking keeps those below the
    new count and forgets the others; each slab is a buffer of its own after (the old one
    can be freed), whether its rows are copied through numpy (CPU backend) or by MLX ops."""
    from mlx_tier.engine.cache import LayerCache

    model, tokenizer = _load(tiny_moe, 2, "cpu" if through_numpy else "mlx")
    if not through_numpy:  # as on a GPU, or with bf16 slabs: no host view of a slab
        monkeypatch.setattr(LayerCache, "_host_slab", lambda self, name: None)
    model(mx.array(tokenizer.encode(PROMPT))[None])
    cache = model.expert_cache
    layer = cache.layers[0]
    budget, resident = cache.budget_bytes, cache.resident_bytes
    held = {int(e): int(layer.slot_of[e]) for e in np.flatnonzero(layer.slot_of >= 0)}
    assert len(held) == 2
    rows = {name: np.array(t.module[t.attr])[list(held.values())] for name, t in layer.tensors.items()}

    before = {name: np.asarray(t.module[t.attr]) for name, t in layer.tensors.items()}
    cache.lend_slots(3)
    assert not any(np.shares_memory(np.asarray(t.module[t.attr]), before[name]) for name, t in layer.tensors.items())
    assert layer.num_slots == 5 and cache.lent == 3
    assert {int(e): int(layer.slot_of[e]) for e in np.flatnonzero(layer.slot_of >= 0)} == held
    assert sorted(layer.free) == [2, 3, 4]
    for name, t in layer.tensors.items():
        assert t.module[t.attr].shape[0] == 5
        np.testing.assert_array_equal(np.array(t.module[t.attr])[list(held.values())], rows[name])
    assert cache.budget_bytes - budget == cache.resident_bytes - resident == 3 * len(cache.layers) * layer.slot_nbytes
    assert cache.resident_bytes <= cache.budget_bytes

    # Fill the lent slots, then take them back: experts in the dropped slots are forgotten.
    model(mx.array(tokenizer.encode(PROMPT + " And then the rain came down on the hills."))[None])
    assert (layer.slot_of >= 0).sum() == 5
    kept = {int(e): int(layer.slot_of[e]) for e in np.flatnonzero((layer.slot_of >= 0) & (layer.slot_of < 2))}
    rows = {name: np.array(t.module[t.attr])[:2] for name, t in layer.tensors.items()}
    grown = {name: np.asarray(t.module[t.attr]) for name, t in layer.tensors.items()}
    cache.lend_slots(0)
    for name, t in layer.tensors.items():
        np.testing.assert_array_equal(np.array(t.module[t.attr]), rows[name])
        assert not np.shares_memory(np.asarray(t.module[t.attr]), grown[name])  # the lent slab can be freed
    assert layer.num_slots == 2 and cache.lent == 0
    assert {int(e): int(layer.slot_of[e]) for e in np.flatnonzero(layer.slot_of >= 0)} == kept
    assert layer.free == [] and cache.budget_bytes == budget and cache.resident_bytes == resident
    assert all(t.module[t.attr].shape[0] == 2 for t in layer.tensors.values())
    victim = layer.policy.evict()  # the new policy knows exactly the kept experts
    assert victim in kept


def test_lend_slots_refuses_what_cannot_be(tiny_moe):
    model, _ = _load(tiny_moe, 2, "cpu")
    cache = model.expert_cache
    with pytest.raises(ValueError, match=">= 0"):
        cache.lend_slots(-1)
    with pytest.raises(ValueError, match="exceed"):
        cache.lend_slots(cache.num_experts)
    assert cache.layer_slots == (2,) * len(cache.layers) and cache.lent == 0


def test_a_layer_that_fails_to_grow_puts_every_layer_back(tiny_moe, monkeypatch):
    """Memory short half way through a lend: every layer back at the slots lent before, the
    budget and :attr:`lent` as they were, and the error raised."""
    from mlx_tier.engine.cache import LayerCache

    model, tokenizer = _load(tiny_moe, 2, "cpu")
    model(mx.array(tokenizer.encode(PROMPT))[None])
    cache = model.expert_cache
    assert len(cache.layers) >= 2
    cache.lend_slots(1)
    budget, resident = cache.budget_bytes, cache.resident_bytes
    real = LayerCache.resize

    def short(self, n):
        if self is cache.layers[-1] and n > 3:
            raise MemoryError("no room")
        real(self, n)

    monkeypatch.setattr(LayerCache, "resize", short)
    with pytest.raises(MemoryError):
        cache.lend_slots(3)
    assert cache.layer_slots == (3,) * len(cache.layers) and cache.lent == 1
    assert (cache.budget_bytes, cache.resident_bytes) == (budget, resident)
    monkeypatch.setattr(LayerCache, "resize", real)
    cache.lend_slots(0)
    assert cache.layer_slots == (2,) * len(cache.layers)


def test_a_cache_that_does_not_lend_refuses_and_the_engine_leaves_it(tiny_moe, monkeypatch):
    """A two-tier cache's hot tiers share their slot tables with its index: it lends nothing
    (the call is refused), and a pool engine asked to lend leaves it as it is."""
    from mlx_tier.engine.expert_cache import ExpertCache
    from mlx_tier.engine.two_tier import TwoTierCache
    from mlx_tier.job.batch_engine import stop_token_ids
    from mlx_tier.job.pool_engine import PoolEngine

    assert ExpertCache.can_lend and not TwoTierCache.can_lend
    model, tokenizer = _load(tiny_moe, 2, "cpu")
    monkeypatch.setattr(model.expert_cache, "can_lend", False)
    with pytest.raises(ValueError, match="does not lend"):
        model.expert_cache.lend_slots(1)
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), decode_slots=2, layer_seconds=None)
    engine._lend_slots(2)
    assert model.expert_cache.layer_slots == (2,) * len(model.expert_cache.layers) and model.expert_cache.lent == 0
