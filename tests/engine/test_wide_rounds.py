"""Wide rounds: with the CPU kernel, a layer call that needs more experts than the
layer has slots is computed in rounds of ``width`` experts read into scratch
slabs (two halves; the tensors kept as on disk read there in place), not in
rounds of S through the slots. The outputs are those of slot
rounds, each distinct expert is still one hit or one miss, the slots hold what
they claim after, and a deep copy gets scratch slabs of its own.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.defaults import ROUND_EXPERTS
from mlx_tier.engine.slabs import host_cast

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="scratch slabs serve MLX's CPU backend only")

PROMPT = "Seven ships sailed north; 42 crates, 19 barrels, one goat, and the river ran clear."


def _load(path, slots: int, width: int | None = None, kernel: str = "cpu", **config):
    model, tokenizer = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots, kernel=kernel, **config))
    if width is not None:
        for layer in model.expert_cache.layers:
            layer.width = width
    return model, tokenizer


def _run(model, ids: list[int], decode: int = 6) -> tuple[list[mx.array], list[int]]:
    """Logits of a prompt call (several tokens: many experts a layer) and of greedy
    decode calls after it (one token each), with a KV cache; and the greedy tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(mx.array(ids)[None], cache=cache)]
    tokens = []
    for _ in range(decode):
        tokens.append(int(mx.argmax(logits[-1][0, -1]).item()))
        logits.append(model(mx.array([[tokens[-1]]]), cache=cache))
    mx.eval(logits)
    return logits, tokens


def _same_outputs(rounds, wide, ids: list[int]) -> None:
    """The wide model's greedy tokens are the slot rounds' and its logits within the bound."""
    want, want_tokens = _run(rounds, ids)
    got, got_tokens = _run(wide, ids)
    assert got_tokens == want_tokens
    for i, (g, w) in enumerate(zip(got, want)):
        assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item(), f"call {i}: {mx.abs(g - w).max().item()}"


@pytest.mark.parametrize("slots, width", [(1, 3), (1, 8), (2, 5), (3, 4)])
def test_wide_rounds_give_what_slot_rounds_give(tiny_moe, slots, width):
    rounds, tokenizer = _load(tiny_moe, slots, width=slots)  # width = slots: assign's rounds
    wide, _ = _load(tiny_moe, slots, width=width)
    assert wide.expert_cache.layers[0].widens() and not rounds.expert_cache.layers[0].widens()
    _same_outputs(rounds, wide, tokenizer.encode(PROMPT))
    a, b = rounds.expert_cache.stats, wide.expert_cache.stats
    assert a.hits + a.misses == b.hits + b.misses  # each distinct expert of a call: one hit or one miss
    assert b.rounds < a.rounds


@pytest.mark.parametrize("read_ahead, prefetch", [(True, False), (False, False), (True, True)])
def test_wide_rounds_read_in_place_and_give_what_slot_rounds_give(tiny_moe, read_ahead, prefetch):
    """The tensors kept as on disk are read straight into a scratch half (ahead of the
    round, or when it comes); a predicted prefetch serving some of a round's experts
    (those rounds' reads are then cast or copied there) changes nothing."""
    config = {"read_ahead": read_ahead, "prefetch": prefetch}
    rounds, tokenizer = _load(tiny_moe, 1, width=1, **config)
    wide, _ = _load(tiny_moe, 1, width=3, **config)
    store, real, into = wide.expert_cache.store, wide.expert_cache.store.read_experts, []

    def recording(names, experts, out=None):
        into.append(sorted(out or ()))
        return real(names, experts, out)

    store.read_experts = recording
    _same_outputs(rounds, wide, tokenizer.encode(PROMPT))
    as_is = sorted(wide.expert_cache.layers[0]._stored_as_is())
    assert as_is and as_is in into  # the packed weights at least: read in place
    for layer in wide.expert_cache.layers:
        _slot_contents_are_the_experts(layer)


def _slot_contents_are_the_experts(layer) -> None:
    """Every resident expert's slot holds that expert as the store reads it."""
    resident = [int(e) for e in np.flatnonzero(layer.slot_of >= 0)]
    raw = layer.store.read_experts(list(layer.tensors), resident)
    for name, t in layer.tensors.items():
        host, cast = layer._host_slab(name), host_cast(t.info, t.casts)
        for i, e in enumerate(resident):
            assert np.array_equal(host[layer.slot_of[e]], cast(raw[name][i])), (name, e)


def test_after_wide_rounds_the_slots_hold_what_they_claim(tiny_moe):
    model, tokenizer = _load(tiny_moe, 2, width=3)
    _run(model, tokenizer.encode(PROMPT), decode=3)
    for layer in model.expert_cache.layers:
        assert 0 < (layer.slot_of >= 0).sum() <= layer.num_slots
        assert sorted(layer.slot_of[layer.slot_of >= 0].tolist()) == sorted(set(layer.slot_of[layer.slot_of >= 0]))
        _slot_contents_are_the_experts(layer)
    assert model.expert_cache.resident_bytes <= model.expert_cache.budget_bytes


def test_the_cpu_kernel_widens_rounds_and_mlx_kernels_do_not(tiny_moe):
    cpu, _ = _load(tiny_moe, 1)
    mlx, _ = _load(tiny_moe, 1, kernel="mlx")
    E = cpu.expert_cache.num_experts
    assert {layer.width for layer in cpu.expert_cache.layers} == {min(E, ROUND_EXPERTS)}
    assert {layer.width for layer in mlx.expert_cache.layers} == {1}
    assert not mlx.expert_cache.layers[0].widens()


def test_a_copy_gets_scratch_slabs_of_its_own(tiny_moe):
    """The scratch slabs are written in place; a deep copy's would share their buffers
    with the original's. Interleaved calls of a model and its copy give what models
    never copied give."""
    model, tokenizer = _load(tiny_moe, 1, width=3)
    alone_a, _ = _load(tiny_moe, 1, width=3)
    alone_b, _ = _load(tiny_moe, 1, width=3)
    a, b = tokenizer.encode(PROMPT), tokenizer.encode("The weather today is mild and the wind is calm")
    for m in (model, alone_a, alone_b):
        mx.eval(m(mx.array(a)[None]))
    twin = copy.deepcopy(model)
    assert twin.expert_cache._scratch == {}
    for i in range(0, len(a) - 3, 2):
        xa, xb = mx.array(a[i:i + 4])[None], mx.array(b[i % len(b):][:4])[None]
        assert mx.array_equal(model(xa), alone_a(xa)).item(), f"the original, call {i}"
        assert mx.array_equal(twin(xb), alone_b(xb)).item(), f"the copy, call {i}"


def test_a_failed_read_in_a_wide_round_leaves_the_layer_usable(tiny_moe):
    model, tokenizer = _load(tiny_moe, 1, width=3)
    ids = mx.array(tokenizer.encode(PROMPT))[None]
    want = model(ids)
    store, real = model.expert_cache.store, model.expert_cache.store.read_experts
    calls = []

    def fail_after_one(names, experts, out=None):  # a failed read ahead is read again, and fails then
        calls.append(experts)
        if len(calls) >= 2:
            raise OSError("disk went away")
        return real(names, experts, out)

    store.read_experts = fail_after_one
    with pytest.raises(OSError, match="disk went away"):
        mx.eval(model(ids))
    store.read_experts = real
    for layer in model.expert_cache.layers:
        _slot_contents_are_the_experts(layer)
    assert mx.allclose(model(ids), want, atol=1e-5).item()


def test_a_call_abandoned_between_rounds_leaves_no_read_into_the_scratch(tiny_moe):
    """A round that raised: the call's rounds are closed at once (its read ahead into a
    scratch half ends there); and a layer whose rounds were left open (a generator kept
    alive) drops that read at its next call, before other layers have rewritten the
    halves it lies in: no slot ever gets another expert's bytes."""
    from mlx_tier.engine.load import TieredExperts

    model, tokenizer = _load(tiny_moe, 1, width=3)
    blocks = [m for _, m in model.named_modules() if isinstance(m, TieredExperts)]
    kernel, calls = blocks[1]._kernel, []

    def fails_in_round_two(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the kernel failed")
        return kernel(*args)

    blocks[1]._kernel = fails_in_round_two
    with pytest.raises(RuntimeError, match="kernel failed") as kept:  # the traceback kept alive
        mx.eval(model(mx.array(tokenizer.encode(PROMPT))[None]))
    assert kept.value is not None
    assert all(layer.incoming is None or layer.incoming.predicted for layer in model.expert_cache.layers)
    blocks[1]._kernel = kernel

    l0, l1 = model.expert_cache.layers[:2]
    idx = np.arange(l1.num_experts).reshape(-1, 2)
    left_open = l1.assign_wide(idx)
    next(left_open), next(left_open)  # abandoned in its first wide round, its next one read ahead
    for _ in l0.assign_wide(idx[::-1].copy()):  # another layer rewrites both halves
        pass
    for _ in l1.assign_wide(np.array([[4, 0]])):
        pass
    _slot_contents_are_the_experts(l1)


def test_a_cast_after_load_keeps_the_outputs_and_lets_the_old_scratch_go(tiny_moe):
    rounds, tokenizer = _load(tiny_moe, 1, width=1)
    wide, _ = _load(tiny_moe, 1, width=3)
    ids = mx.array(tokenizer.encode(PROMPT))[None]
    for m in (rounds, wide):
        mx.eval(m(ids))
        m.set_dtype(mx.float16)
    assert mx.allclose(wide(ids), rounds(ids), atol=1e-3).item()
    # The float32 scratch of the cast scales and biases is let go (numpy does not make
    # MLX's float16 casts: those layers widen no more, `widens`).
    assert mx.float32 not in {key[2] for key in wide.expert_cache._scratch}
    from mlx_tier.engine.load import TieredExperts

    assert not any(getattr(m, "_wide_blocks", None) for _, m in wide.named_modules() if isinstance(m, TieredExperts))


def test_the_layers_share_one_scratch_slab_per_role(tiny_moe):
    """One layer computes at a time: the scratch is two halves of `width` experts in all
    (consecutive rounds alternate), not per layer."""
    model, tokenizer = _load(tiny_moe, 1, width=3)
    mx.eval(model(mx.array(tokenizer.encode(PROMPT))[None]))
    cache = model.expert_cache
    assert len(cache.layers) > 1 and all(layer.stats.rounds for layer in cache.layers[:1])
    assert sum(a.nbytes for a, _ in cache._scratch.values()) == 2 * 3 * cache.layers[0].slot_nbytes


@pytest.mark.parametrize("slots, width, idx", [
    (3, 3, [[0, 1], [2, 3]]),  # a cold cache: the first round fills the slots, the last one evicts
    (2, 3, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (1, 3, [[5, 2], [7, 0]]),
])
def test_wide_rounds_leave_the_slots_full_with_the_last_rounds_experts(tiny_moe, slots, width, idx):
    model, _ = _load(tiny_moe, slots, width=width)
    layer = model.expert_cache.layers[0]
    idx = np.array(idx)
    rounds = list(layer.assign_wide(idx))
    assert len(rounds) > 1
    resident = set(np.flatnonzero(layer.slot_of >= 0).tolist())
    need = sorted(set(idx.reshape(-1).tolist()))
    last = sorted(set(idx[rounds[-1][1]].tolist()))
    assert len(resident) == slots and set(last[-slots:]) <= resident
    before = layer.stats.hits
    list(layer.assign_wide(idx))  # the same call again: every resident expert a hit
    assert layer.stats.hits - before == len(resident & set(need))
    _slot_contents_are_the_experts(layer)


def test_a_cast_evaluates_the_cast_slabs(tiny_moe_fp):
    """The old float32 slabs are let go at the cast, not kept alive by a lazy astype."""
    import gc

    model, tokenizer = mlx_tier.load(tiny_moe_fp, config=TierConfig(slots_per_layer=8, kernel="mlx"))
    mx.eval(model(mx.array(tokenizer.encode(PROMPT))[None]))
    layer = model.expert_cache.layers[0]
    fp32 = layer.num_slots * layer.slot_nbytes
    gc.collect()
    before = mx.get_active_memory()
    layer.cast({name: mx.float16 for name in layer.tensors})
    gc.collect()
    assert before - mx.get_active_memory() >= 0.4 * fp32
