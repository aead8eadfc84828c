"""The throughput schedule's engine: a document's tokens do not depend on its pool.

Invariant guarded: prompts of different lengths read together in one prefill
pool (each its own pass, their expert blocks computed together; the decode
pool's batched KV caches left-padded by mlx-lm: the case of mlx-lm#1906) and
decoded together give, with kernel ``mlx``, exactly the
greedy tokens of each prompt decoded alone by mlx-lm's ``stream_generate``;
with the CPU kernel, the same tokens on these prompts (its logits stay within
the stated bound, tests/kernels). The same with module batching (a prefill
step decodes the generating sequences in its layer steps) and without. Also:
pools of every shape (one prompt at a time, 7-token pools, all at once),
the shared prefix, the repetition penalty, and a stop that abandons a prefill
step between layers.
"""

from __future__ import annotations

import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors

import mlx_tier
from mlx_tier.engine.load import TieredExperts
from mlx_tier.job.batch_engine import PrefixCache, Task, common_prefix, stop_token_ids
from mlx_tier.job.pool_engine import PoolEngine
from mlx_tier.job.prompts import build_prompt

N = 10
TEXTS = ["The cat sat.", "A much longer text about rivers, mountains and the sea, and boats.", "Numbers: 1 2 3 4 5",
         "Short one.", "Winter, spring, summer and autumn follow each other; farmers plant in spring."]


def alone(model, tokenizer, prompt, penalty=1.0):
    procs = make_logits_processors(repetition_penalty=penalty) if penalty != 1.0 else None
    out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=N, logits_processors=procs)]
    return [t for t in out if t not in tokenizer.eos_token_ids]


def run_pool(engine, prompts, interrupt=None):
    results, pending = {}, list(enumerate(prompts))
    while pending or engine.active:
        while pending and engine.free:
            i, p = pending.pop(0)
            engine.add(Task(i, p, N))
        for f in engine.step(interrupt).finished:
            results[f.key] = f
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["mlx", "cpu"])
def tiered(request, tiny_moe):
    return mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel=request.param))


@pytest.fixture(scope="module")
def prompts_and_refs(tiered):
    model, tokenizer = tiered
    prompts = [build_prompt(tokenizer, "Summarise this.", t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ: padding is exercised
    refs = [alone(model, tokenizer, p) for p in prompts]
    assert len({tuple(r) for r in refs}) == len(refs)  # outputs differ, so a mix-up would show
    return prompts, refs


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("batch, prefill_batch, pool_tokens", [
    (5, 5, 4096),  # every prompt in one prefill step, all decoding together
    (5, 5, 7),  # 7-token pools: many steps, prompts ending inside them
    (5, 3, 24),  # up to 3 prompts read at once, a step's 24 tokens across them
    (2, 2, 16),  # fewer places than prompts: later prompts join while others decode
    (1, 1, 512),  # one at a time
])
def test_pool_equals_alone(tiered, tiny_moe, prompts_and_refs, batch, prefill_batch, pool_tokens, merge):
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=batch,
                        prefill_batch=prefill_batch, pool_tokens=pool_tokens, merge=merge,
                        layer_seconds=None)  # the pools as given (4096: every prompt in one step)
    got = run_pool(engine, prompts)
    assert [g.tokens for g in got] == refs
    assert [g.text for g in got] == [tokenizer.decode(r) for r in refs]


@pytest.mark.parametrize("penalty", [1.0, 1.1])
def test_pool_with_prefix_and_penalty(tiered, tiny_moe, prompts_and_refs, penalty):
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    if penalty != 1.0:
        refs = [alone(model, tokenizer, p, penalty) for p in prompts]
    n = common_prefix(prompts)
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=4, prefill_batch=4,
                        pool_tokens=32, repetition_penalty=penalty, prefix=PrefixCache(model, prompts[0][:n]))
    got = run_pool(engine, prompts)
    assert [g.tokens for g in got] == refs
    assert all(g.prefix_tokens == n for g in got)


def test_interrupt_between_layers_drops_the_prompts_being_read(tiered, tiny_moe, prompts_and_refs):
    """A stop asked during a prefill step abandons it at the next MoE layer; the prompts being
    read are handed back, the engine keeps working for the rest."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5, prefill_batch=2,
                        pool_tokens=len(prompts[0]) + 3)  # the first prompt and 4 tokens of the second
    for i, p in enumerate(prompts):
        engine.add(Task(i, p, N))
    calls = []

    def interrupt(layer):
        calls.append(layer)
        return len(calls) >= 2  # the second layer of the first prefill step

    info = engine.step(interrupt)
    assert calls == [0, 1] and info.prefill_tokens == 0
    assert sorted(t.key for t in engine.take_interrupted()) == [0, 1]
    assert engine.active == 3 and engine.take_interrupted() == []
    results = {}
    while engine.active:
        for f in engine.step().finished:
            results[f.key] = f.tokens
    assert results == {i: refs[i] for i in (2, 3, 4)}
    assert all(layer.hook is None for layer in model.expert_cache.layers)


def test_engine_refuses_overfill_and_bad_sizes(tiered, tiny_moe):
    model, tokenizer = tiered
    stops = stop_token_ids(tokenizer, tiny_moe)
    with pytest.raises(ValueError, match=">= 1"):
        PoolEngine(model, tokenizer, stops, batch_size=0)
    eng = PoolEngine(model, tokenizer, stops, batch_size=1)
    eng.add(Task("a", [1, 2, 3], 4))
    with pytest.raises(ValueError, match="full"):
        eng.add(Task("b", [1, 2], 4))
    assert [t.key for t in eng.cancel()] == ["a"] and eng.free == 1
    with pytest.raises(ValueError, match="empty"):
        eng.add(Task("c", [], 4))


def test_the_decode_pool_is_filled_before_it_decodes_without_merging(tiered, tiny_moe, prompts_and_refs):
    """Prompts are read until a prefill batch no longer waits; a lone waiting prompt waits
    for a whole batch while the pool is at least half full, and is read once it is not."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=4,
                        prefill_batch=2, pool_tokens=4096, merge=False)
    for i in range(4):
        engine.add(Task(i, prompts[i], N - i))  # summaries of different lengths: places free one by one
    kinds = [bool(engine.step().prefill_tokens) for _ in range(3)]
    assert kinds == [True, True, False]  # two prefill steps of two prompts, then the full pool decodes
    assert len(engine._generating) == 4
    results = {}
    while len(engine._generating) == 4:
        results.update((f.key, f) for f in engine.step().finished)
    engine.add(Task(4, prompts[4], N - 4))  # one place free: one prompt waits, fewer than a prefill batch
    while engine._waiting and len(engine._generating) >= 2:
        info = engine.step()
        assert not info.prefill_tokens  # the pool (at least half full) decodes; the prompt waits
        results.update((f.key, f) for f in info.finished)
    while engine.active:
        results.update((f.key, f) for f in engine.step().finished)
    assert [results[i].tokens for i in range(5)] == [r[:N - i] for i, r in enumerate(refs)]  # tokens unchanged


def _count_block_calls(model, monkeypatch) -> list:
    """Rows of each tiered expert block call, as ``(layer, rows)``."""
    calls = []
    alone = TieredExperts.alone

    def counted(self, x, indices):
        calls.append((self.cache.layer, indices.size // indices.shape[-1]))
        return alone(self, x, indices)

    monkeypatch.setattr(TieredExperts, "alone", counted)
    return calls


def test_a_prefill_step_decodes_the_pool_in_its_layer_steps(tiered, tiny_moe, prompts_and_refs, monkeypatch):
    """With merging, waiting prompts are read at once and each of their prefill steps also
    decodes the generating sequences: one call of each expert block on the rows of both
    (prompt chunk and decode pool), not one for each."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5, prefill_batch=1,
                        pool_tokens=16)
    for i in range(3):
        engine.add(Task(i, prompts[i], N))
    while not engine._generating:  # the first prompt, read alone
        engine.step()
    calls = _count_block_calls(model, monkeypatch)
    info = engine.step()  # the second prompt's first chunk, with the first sequence's next token
    layers = len(model.expert_cache.layers)
    assert info.merged and info.prefill_tokens == 16 and info.generated == 1 and info.generating[0][0] == 0
    assert calls == [(i, 16 + 1) for i in range(layers)]
    assert info.seconds == pytest.approx(info.prefill_seconds + info.decode_seconds)
    assert info.decode_seconds == pytest.approx(info.seconds / 17)
    results = {}
    while engine.active:
        results.update((f.key, f.tokens) for f in engine.step().finished)
    assert results == {i: refs[i] for i in range(3)}


def test_a_stop_in_a_merged_step_drops_the_prompt_and_keeps_the_decoded_token(tiered, tiny_moe, prompts_and_refs):
    """A stop between layers of a merged step abandons the prompt chunk there; the decode
    pool finishes its layers alone and keeps its token."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5, prefill_batch=1,
                        pool_tokens=8)
    engine.add(Task(0, prompts[0], N))
    while not engine._generating:
        engine.step()
    engine.add(Task(1, prompts[1], N))
    asked = []
    info = engine.step(lambda layer: asked.append(layer) or layer == 1)
    assert asked == [0, 1] and info.prefill_tokens == 0 and info.generated == 1
    assert [t.key for t in engine.take_interrupted()] == [1]
    results = {}
    while engine.active:
        results.update((f.key, f.tokens) for f in engine.step().finished)
    assert results == {0: refs[0]}


def test_a_prefill_step_is_filled_across_prompts_without_padding(tiered, tiny_moe, prompts_and_refs, monkeypatch):
    """A prompt that ends inside a step leaves the rest of the pool to the next prompt: every
    step but the last carries exactly ``pool_tokens`` prompt rows through each expert block
    (one call a layer, with the decode pool's rows; no padded rows), and a prompt shorter
    than the pool shares its step."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    pool = 20
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5, prefill_batch=3,
                        pool_tokens=pool)
    for i, p in enumerate(prompts):
        engine.add(Task(i, p, N))
    calls = _count_block_calls(model, monkeypatch)
    layers = len(model.expert_cache.layers)
    total = sum(len(p) - 1 for p in prompts)  # each prompt's last token is its first decode input
    steps, read = [], 0
    while read < total:
        calls.clear()
        starting = len(engine._starting)  # prompts read in the last step: their first decode input now
        info = engine.step()
        steps.append(info.prefill_tokens)
        read += info.prefill_tokens
        # one call a layer on the prompt rows (no padded ones), the decode pool's and the starting ones'
        assert calls == [(i, info.prefill_tokens + info.generated + starting) for i in range(layers)]
        assert len(info.prefill) <= 3
    assert steps[:-1] == [pool] * (len(steps) - 1) and 0 < steps[-1] <= pool
    assert len(steps) == -(-total // pool)
    results = {}
    while engine.active:
        results.update((f.key, f.tokens) for f in engine.step().finished)
    assert results == dict(enumerate(refs))


def _long_prompt(tokenizer, words: int = 1200):
    text = " ".join(TEXTS[i % len(TEXTS)] for i in range(words // 8))
    return build_prompt(tokenizer, "Summarise this.", text)


def _prefill_steps(engine, *prompts) -> list[int]:
    """Prompt tokens of each prefill step while ``prompts`` are read and 2 tokens written."""
    for i, prompt in enumerate(prompts):
        engine.add(Task(i, prompt, 2))
    steps = []
    while engine.active:
        info = engine.step()
        if info.prefill_tokens:
            steps.append(info.prefill_tokens)
    return steps


def test_prefill_steps_start_small_and_grow_to_the_pool_while_layers_are_quick(tiered, tiny_moe):
    """Before any step is measured the first carries FIRST_POOL_TOKENS; quick layer steps let
    each next one double, up to ``pool_tokens``."""
    from mlx_tier.job.pool_engine import FIRST_POOL_TOKENS

    model, tokenizer = tiered
    prompt = _long_prompt(tokenizer, 2400)
    assert len(prompt) > 2 * 1024
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=1, prefill_batch=1,
                        pool_tokens=1024, layer_seconds=60.0)
    steps = _prefill_steps(engine, prompt)
    assert steps[:3] == [FIRST_POOL_TOKENS, 2 * FIRST_POOL_TOKENS, 1024] and set(steps[3:-1]) <= {1024}
    assert sum(steps) == len(prompt) - 1
    unpaced = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=1, prefill_batch=1,
                         pool_tokens=1024, layer_seconds=None)
    assert _prefill_steps(unpaced, prompt)[:2] == [1024, 1024]


def test_a_model_slower_than_planned_gets_prefill_steps_of_about_layer_seconds(tiered, tiny_moe, monkeypatch):
    """Each expert block sleeps 1 ms a row (a model far slower than its pool was planned for):
    a 0.1 s layer step is ~100 tokens, so steps shrink from the first one's 256 to about that,
    and a stop asked between layers acts within about 0.1 s, not the pool's 2 s a layer."""
    import time

    model, tokenizer = tiered
    alone_ = TieredExperts.alone

    def slow(self, x, indices):
        time.sleep(0.001 * (indices.size // indices.shape[-1]))
        return alone_(self, x, indices)

    monkeypatch.setattr(TieredExperts, "alone", slow)
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=1, prefill_batch=1,
                        pool_tokens=2048, layer_seconds=0.1)
    steps = _prefill_steps(engine, _long_prompt(tokenizer))
    assert steps[0] == 256 and len(steps) >= 5
    assert all(20 <= n <= 130 for n in steps[1:-1]), steps  # ~90 here; less on a loaded machine


def test_a_prompts_short_tail_does_not_shrink_the_next_steps(tiered, tiny_moe):
    """One prompt at a time: the first ends in a short step (its tail), the next prompt's
    first step is still twice the last full one, not twice the tail."""
    model, tokenizer = tiered
    short, long = _long_prompt(tokenizer, 240), _long_prompt(tokenizer, 2400)
    assert 256 < len(short) < 512
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=2, prefill_batch=1,
                        pool_tokens=1024, layer_seconds=60.0, merge=False)
    steps = _prefill_steps(engine, short, long)
    assert steps[:3] == [256, len(short) - 1 - 256, 512], steps


def test_the_decode_pool_makes_room_once_for_the_longest_sequence_it_holds(tiered, tiny_moe, prompts_and_refs):
    """The pool's KV cache is told the engine's longest sequence (prompt and max_tokens, of
    every task it holds: waiting ones too) and its rows (every task it holds), so it grows once."""
    from mlx_tier.job.pool_kv import RoomyKVCache

    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5,
                        prefill_batch=1, pool_tokens=4096, layer_seconds=None)
    lengths = [N - 2 * i for i in range(5)]
    for i, p in enumerate(prompts):
        engine.add(Task(i, p, lengths[i]))
    while len(engine._generating) < 2:
        engine.step()
    layers = [c for c in engine._gen.prompt_cache if isinstance(c, RoomyKVCache)]
    assert layers and all(c.rows == 5 for c in layers)
    assert {c.longest for c in layers} == {max(len(p) + n for p, n in zip(prompts, lengths))}
    assert all(c.keys.shape[2] >= c.longest for c in layers)  # grown once, to the longest
    shapes = {c.keys.shape for c in layers}
    results = {}
    while engine.active:
        results.update((f.key, f) for f in engine.step().finished)
    assert {c.keys.shape for c in engine._gen.prompt_cache if isinstance(c, RoomyKVCache)} <= shapes | {None}
    assert [results[i].tokens for i in range(5)] == [r[:n] for r, n in zip(refs, lengths)]


def test_the_decode_pool_makes_room_only_for_the_sequences_the_engine_holds(tiered, tiny_moe, prompts_and_refs):
    """Under a memory cap the scheduler admits fewer sequences than the planned pool (their
    KV caches are what it counted): the pool's KV cache makes room for those it holds, not
    for ``batch_size`` rows; one admitted later grows it, and tokens stay mlx-lm's."""
    from mlx_tier.job.pool_kv import RoomyKVCache

    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=5,
                        prefill_batch=1, pool_tokens=4096, layer_seconds=None)
    for i in range(3):
        engine.add(Task(i, prompts[i], N))
    while len(engine._generating) < 2:
        engine.step()
    layers = [c for c in engine._gen.prompt_cache if isinstance(c, RoomyKVCache)]
    assert layers and all(c.rows == 3 and c.keys.shape[0] == 3 for c in layers)
    engine.add(Task(3, prompts[3], N))
    results = {}
    while 3 not in engine._generating:
        results.update((f.key, f) for f in engine.step().finished)
    layers = [c for c in engine._gen.prompt_cache if isinstance(c, RoomyKVCache)]
    assert all(c.rows == 4 and c.keys.shape[0] == 4 for c in layers)  # grown by the one admitted
    while engine.active:
        results.update((f.key, f) for f in engine.step().finished)
    assert [results[i].tokens for i in range(4)] == [r[:N] for r in refs[:4]]


def test_a_pool_decoding_past_its_room_moves_its_rows_between_steps(tiered, tiny_moe):
    """A long prompt with a short summary beside a short prompt with a long one: once the
    long one finishes, the short one decodes past the room the pool made (the longest
    sequence and its slack) and the shared padding is dropped between two steps; the
    tokens are mlx-lm's alone."""
    from mlx_tier.job import pool_kv

    model, tokenizer = tiered
    long = build_prompt(tokenizer, "Summarise this.", " ".join(["rivers and mountains"] * 60))
    short = build_prompt(tokenizer, "Summarise this.", "The cat sat.")
    assert len(long) - len(short) > pool_kv.ROOM_SLACK
    budget = pool_kv.ROOM_SLACK + 40
    engine = PoolEngine(model, tokenizer, [], batch_size=2, prefill_batch=2, pool_tokens=4096,
                        layer_seconds=None)  # no stop token: every summary runs to its max_tokens
    engine.add(Task(0, long, 2))
    engine.add(Task(1, short, len(long) - len(short) + budget))
    moved, results = [], {}
    real = pool_kv.RoomyKVCache._move
    pool_kv.RoomyKVCache._move = lambda self, shift: moved.append(shift) or real(self, shift)
    try:
        while engine.active:
            results.update((f.key, f) for f in engine.step().finished)
    finally:
        pool_kv.RoomyKVCache._move = real
    assert moved and all(s < 0 for s in moved)  # the rows moved left, in place
    ref = [r.token for r in stream_generate(model, tokenizer, short, max_tokens=len(results[1].tokens))]
    assert results[1].tokens == ref and len(results[0].tokens) == 2


@pytest.mark.parametrize("merge", [True, False])
def test_a_join_leaves_no_prompt_cache_alive_behind_the_pool(tiered, tiny_moe, prompts_and_refs, merge):
    """After a step in which sequences join the decode pool, their own prompt caches are
    freed: the copies into the pool's buffer are made in that step, not left to the next
    forward pass (until then they would hold every joiner's cache, uncounted by admission,
    for as many prompt steps as run before the pool next decodes)."""
    import gc

    import mlx.core as mx

    from mlx_tier.job.pool_engine import _kv_arrays

    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=4,
                        prefill_batch=1, pool_tokens=4096, layer_seconds=None, merge=merge)
    for i in range(3):
        engine.add(Task(i, prompts[i], N))
    joined, freed_later = 0, []
    while engine.active:
        before = len(engine._generating)
        engine.step()
        if len(engine._generating) > before:
            joined += 1
            gc.collect()
            held = mx.get_active_memory()
            mx.eval([a for c in engine._gen.prompt_cache for a in _kv_arrays([c])])
            gc.collect()
            freed_later.append(held - mx.get_active_memory())
    assert joined >= 2 and freed_later == [0] * joined


def test_the_pools_growth_targets_follow_the_sequences_held(tiered, tiny_moe, prompts_and_refs):
    """Once a sequence finishes, a growth of the decode pool's KV cache (a decode step past
    its room) is sized for the sequences held then, not for those held at the last join."""
    from mlx_tier.job.pool_kv import RoomyKVCache

    model, tokenizer = tiered
    prompts, _ = prompts_and_refs
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=3,
                        prefill_batch=3, pool_tokens=4096, layer_seconds=None)
    for i, n in enumerate((2, N, N)):
        engine.add(Task(i, prompts[i], n))
    finished = []
    while not finished:
        finished += engine.step().finished
    assert [f.key for f in finished] == [0] and engine.active == 2
    engine.step()
    layers = [c for c in engine._gen.prompt_cache if isinstance(c, RoomyKVCache)]
    assert layers and all(c.rows == 2 for c in layers)


@pytest.mark.parametrize("merge", [True, False])
def test_decode_steps_borrow_slots_and_give_them_back_before_a_prefill_step(tiered, tiny_moe, prompts_and_refs,
                                                                             monkeypatch, merge):
    """``decode_slots``: each decode step runs with the slots lent, each prefill step
    without; the tokens are each prompt's alone; closing gives the slots back."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    cache = model.expert_cache
    base = cache.layer_slots
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=2, prefill_batch=2,
                        pool_tokens=16, merge=merge, layer_seconds=None, decode_slots=2)
    seen = []  # (step, slots lent while its passes ran)
    real_run = engine._run
    monkeypatch.setattr(engine, "_run", lambda chunks, *a: (seen.append(("prefill" if chunks else "decode",
                                                                          cache.lent)), real_run(chunks, *a))[1])
    try:
        got = run_pool(engine, prompts)
        assert [g.tokens for g in got] == refs
        assert {lent for kind, lent in seen if kind == "decode"} == {2}
        assert {lent for kind, lent in seen if kind == "prefill"} == {0}
        kinds = [kind for kind, _ in seen]
        assert any(a == "decode" and b == "prefill" for a, b in zip(kinds, kinds[1:]))  # taken back between
    finally:
        engine.close()
    assert cache.lent == 0 and cache.layer_slots == base


def test_a_growth_of_lent_slots_that_fails_for_memory_leaves_those_lent_before(tiered, tiny_moe, prompts_and_refs,
                                                                              monkeypatch):
    """Lent slots are spare: when growing them fails for memory the step runs with the slots
    lent before (the cache puts every layer back), the documents finish with their own
    tokens, and no later step asks for more than that."""
    model, tokenizer = tiered
    prompts, refs = prompts_and_refs
    cache = model.expert_cache
    real_lend, asked = cache.lend_slots, []

    def lend(extra):
        asked.append(extra)
        if extra > 1:
            raise MemoryError("no room for the slabs")
        real_lend(extra)

    monkeypatch.setattr(cache, "lend_slots", lend)
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=2, prefill_batch=2,
                        pool_tokens=16, layer_seconds=None, decode_slots=1)
    try:
        got = run_pool(engine, prompts[:1])
        engine.decode_slots = 2  # more asked for: refused once, never asked again
        got += run_pool(engine, prompts[1:2])
        assert [g.tokens for g in got] == refs[:2]
        assert asked.count(2) == 1 and cache.lent <= 1
    finally:
        engine.close()
    assert cache.lent == 0
