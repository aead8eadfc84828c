"""A throughput run under a memory cap gives expert slots back to its KV caches when the
pool model predicts more documents/hour from the larger pools they allow; a cache the
user gave, one slot row, or memory to spare keep the split's cache.

Rates are fixed here (the probes are timed elsewhere): the choice is arithmetic over them.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlx_tier.engine import footprint
from mlx_tier.engine.checkpoint import open_checkpoint
from mlx_tier.engine.sizes import needs_of
from mlx_tier.tools import pool_cache, pools
from mlx_tier.tools.pools import Rates, choose_pools

# Fixed costs per expert read off: a tiny expert's slot is worth its read alone (a fixed cost per
# miss, 3 ms by default, would price a slot of this 8-expert model above any pool).
RATES = Rates(disk_gbps=1.0, gemm_gflops=40.0, matvec_gbps=8.0, dequant_gbps=8.0, attention_gflops=20.0,
              per_expert_s=0.0)
PROMPT, SUMMARY = 600, 32


@pytest.fixture
def fixed_rates(monkeypatch):
    monkeypatch.setattr(pool_cache, "probe_rates", lambda *a, **k: RATES)
    monkeypatch.setattr(pool_cache, "measure_read_gbps", lambda *a, **k: 1.0)


def budget(tiny_moe, slots: int, sequences: float) -> footprint.MemoryBudget:
    """A split of ``slots`` slot rows and KV room for ``sequences`` documents."""
    needs = needs_of(open_checkpoint(tiny_moe), "cpu", 4, 4)
    kv = int(sequences * needs.shape.kv_per_token * (PROMPT + SUMMARY + pools.KV_STEP))  # as a batch holds one
    return footprint.MemoryBudget(2**30, "memory_gb", needs.runtime, needs.dense, slots * needs.slot_row, kv,
                                  1 << 20, 1 << 20, 1 << 20, 512, False, needs.shape, "cpu", needs.slot_row)


def test_the_checkpoints_shape(tiny_moe):
    b = budget(tiny_moe, 4, 1)
    shape, probe, files = pool_cache.checkpoint_shape(tiny_moe, b)
    ckpt = open_checkpoint(tiny_moe)
    experts = ckpt.experts()
    assert (shape.layers, shape.experts, shape.top_k) == (len(experts), experts[0][1], b.shape.top_k)
    stored = sum(t.info.nbytes for _, _, ts in experts for t in ts.values())
    assert shape.expert_bytes * shape.experts * shape.layers == pytest.approx(stored, rel=0.01)
    assert shape.kv_bytes == b.shape.kv_per_token and probe["bits"] == 4 and probe["group_size"] == 32
    assert files and all(f.exists() for f in files)
    head = [i.nbytes for name, i in ckpt.index.items() if name.startswith("lm_head.")]
    assert head and shape.head_bytes == sum(head) and shape.head_flops == 2 * b.shape.vocab * b.shape.hidden


def test_a_loaded_models_shape_prices_its_output_layer(tiny_moe):
    """The run's shape (:func:`pools.shape_of`) holds the output layer as loaded."""
    import mlx_tier

    model, _ = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu"))
    shape = pools.shape_of(model, 1.0)[0]
    head = model.lm_head
    assert shape.head_bytes == sum(head[k].nbytes for k in ("weight", "scales", "biases")) > 0
    assert shape.head_flops == 2 * model.args.vocab_size * model.args.hidden_size


def test_a_tight_cap_trades_slots_for_pools(tiny_moe, fixed_rates):
    """KV room just short of a second sequence once the chooser's margin is taken (a slot row here is 1/17 of a sequence's KV
    and the prompt step's transient about 0.7 of one): slots given back let it in."""
    b = budget(tiny_moe, 4, 2.7)
    found = pool_cache.cache_for_pools(tiny_moe, b, PROMPT, SUMMARY, 16)
    assert found is not None
    slots, plan, own = found
    assert slots == 2  # two slot rows given back: the second sequence fits, a third row buys nothing more
    assert (own.decode_pool, plan.decode_pool) == (1, 2) and plan.docs_per_hour > own.docs_per_hour
    shape = pool_cache.checkpoint_shape(tiny_moe, b)[0]
    margin = 1 - pools.ROOM_MARGIN  # each cache priced with a share less of the room it leaves
    assert own == choose_pools(replace(shape, slots=4), RATES, PROMPT, SUMMARY, int(b.kv * margin), documents=16)
    new = pool_cache.with_cache(b, slots)
    assert new.cache == slots * b.slot_row and new.cache + new.kv == b.cache + b.kv  # the total is unchanged
    assert sum(new.parts().values()) == sum(b.parts().values())


def test_the_splits_cache_stays_when_given_alone_or_roomy(tiny_moe, fixed_rates):
    assert pool_cache.cache_for_pools(tiny_moe, budget(tiny_moe, 4, 2.7), PROMPT, SUMMARY, 16) is not None
    assert pool_cache.cache_for_pools(tiny_moe, replace(budget(tiny_moe, 4, 2.7), cache_given=True),
                                      PROMPT, SUMMARY, 16) is None  # --cache-gb / --slots: the same room, kept
    assert pool_cache.cache_for_pools(tiny_moe, budget(tiny_moe, 1, 2.9), PROMPT, SUMMARY, 16) is None
    assert pool_cache.cache_for_pools(tiny_moe, budget(tiny_moe, 4, 2.7), PROMPT, SUMMARY, 16, cap=1) is None
    assert pool_cache.cache_for_pools(tiny_moe, budget(tiny_moe, 4, 200), PROMPT, SUMMARY, 16) is None


def test_the_routing_earlier_runs_saved_refines_the_choice(tiny_moe, tmp_path):
    """Before loading, nothing has run: routing is taken as uniform unless an earlier run saved
    the model's expert use profile; then each layer's measured shares price the slots. A
    profile of another shape, or an unreadable one, leaves the guess as it was."""
    import numpy as np

    from mlx_tier.routing import profile

    b = budget(tiny_moe, 4, 2.7)
    shape = pool_cache.checkpoint_shape(tiny_moe, b)[0]
    model = tmp_path / "model"
    model.mkdir()
    assert pool_cache.with_saved_routing(shape, model) == shape  # none saved
    counts = np.zeros((shape.layers, shape.experts), np.int64)
    counts[:, :2] = 50  # every token to the same two experts
    profile.save(profile.from_counts(counts), model / profile.PROFILE_FILE)
    seen = pool_cache.with_saved_routing(shape, model)
    assert seen.popularity == ((0.5, 0.5) + (0.0,) * (shape.experts - 2),) * shape.layers
    profile.save(profile.from_counts(counts[:, :4]), model / profile.PROFILE_FILE)  # another model's shape
    assert pool_cache.with_saved_routing(shape, model) == shape
    (model / profile.PROFILE_FILE).write_text("not json")
    assert pool_cache.with_saved_routing(shape, model) == shape


def test_decode_steps_borrow_the_idle_workspace_up_to_a_layers_experts(tiny_moe, monkeypatch):
    """``lent_slots``: the split's :meth:`decode_slots`, at most a layer's experts beyond the
    cache's slots; none where lending is switched off, the cache was given or the slot row
    is unknown."""
    b = budget(tiny_moe, 2, 2)
    three = (3 * b.slot_row + footprint.step_workspace(b.shape, "cpu", 4, 700, 4)
             + footprint.read_ahead_bytes(b.cache + 3 * b.slot_row, b.shape, "cpu", b.expert))
    some = replace(b, workspace=three)  # room for three slot rows beside the decode step and its read ahead
    assert pool_cache.lent_slots(some, 4, 700) == some.decode_slots(4, 700) == 3
    roomy = replace(b, workspace=1 << 34)
    assert pool_cache.lent_slots(roomy, 4, 700) == b.shape.experts - 2  # every expert resident, no more
    assert pool_cache.lent_slots(replace(some, slot_row=0), 4, 700) == 0
    assert pool_cache.lent_slots(replace(some, cache_given=True), 4, 700) == 0  # the user's cache size kept
    monkeypatch.setattr(footprint, "LEND_SLOTS", False)
    assert pool_cache.lent_slots(some, 4, 700) == 0


def test_the_users_tok_s_cap_is_priced_in_the_cache_choice(tiny_moe, fixed_rates):
    """The review's case: the cache chooser priced the pools without `--max-tok-s`, so the run
    said "predicted A documents/hour against B" uncapped, then announced the capped pools. With a
    cap that bounds decode, a larger decode pool buys nothing: the split's cache stays."""
    b = budget(tiny_moe, 4, 2.7)
    found = pool_cache.cache_for_pools(tiny_moe, b, PROMPT, SUMMARY, 16, max_tok_s=1e6)
    assert found is not None and found[0] == 2  # a cap above the machine's rate: as without one
    assert pool_cache.cache_for_pools(tiny_moe, b, PROMPT, SUMMARY, 16, max_tok_s=0.05) is None
