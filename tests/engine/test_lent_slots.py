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


@pytest.mark.parametrize("kernel", ["mlx", "cpu"])
def test_lent_and_taken_back_slots_leave_the_tokens(tiny_moe, kernel):
    """Slots lent mid-decode, more lent, then taken back: the same greedy tokens as a
    cache that never changed, logits bit-equal on the MLX path (a slot's position changes
    no computation) and within the CPU kernel's bound (its rounds differ with the slots)."""
    ids = mlx_tier.load(tiny_moe, config=TierConfig(slots_per_layer=1))[1].encode(PROMPT)
    want, want_tokens = _run(_load(tiny_moe, 1, kernel)[0], ids, {})
    model = _load(tiny_moe, 1, kernel)[0]
    got, got_tokens = _run(model, ids, {1: 2, 3: 3, 5: 0, 6: 1})
    assert got_tokens == want_tokens
    for i, (g, w) in enumerate(zip(got, want)):
        if kernel == "mlx":
            assert mx.array_equal(g, w).item(), f"call {i}"
        else:
            assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item(), f"call {i}: {mx.abs(g - w).max().item()}"
    assert model.expert_cache.layer_slots == (2,) * len(model.expert_cache.layers)


def test_resize_keeps_residents_and_their_bytes(tiny_moe):
    model, tokenizer = _load(tiny_moe, 2, "cpu")
    model(mx.array(tokenizer.encode(PROMPT))[None])
    cache = model.expert_cache
    layer = cache.layers[0]
    budget, resident = cache.budget_bytes, cache.resident_bytes
    held = {int(e): int(layer.slot_of[e]) for e in np.flatnonzero(layer.slot_of >= 0)}
    assert len(held) == 2
    rows = {name: np.array(t.module[t.attr])[list(held.values())] for name, t in layer.tensors.items()}

    cache.lend_slots(3)
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
    cache.lend_slots(0)
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
