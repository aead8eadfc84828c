"""The scheduler: batched documents equal documents alone; map-reduce for long ones; a failing
document fails alone while the others finish; a stop request starts nothing new."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import pytest

import mlx_tier
from mlx_tier.job.batch_engine import Task
from mlx_tier.job.documents import Document
from mlx_tier.job.longdoc import JOIN_SLACK, REDUCE_NOTE
from mlx_tier.job.prompts import build_prompt
from mlx_tier.job.scheduler import GenerationConfig, Scheduler
from mlx_tier.outdir.layout import PARTS
from mlx_tier.outdir.parts import PartStore
from mlx_tier.tools.pools import KV_STEP

TEXTS = {
    "a": "The cat sat on the mat and looked at the garden.",
    "b": "Rivers run to the sea. Mountains stand. Boats float on the water near the harbour.",
    "c": "Numbers: one, two, three, four, five, six.",
}
LONG = "\n\n".join(f"Paragraph {i}: the {i}th bridge crosses the river at mile {i * 7}." for i in range(40))


def docs(texts):
    return [Document(k, k, t) for k, t in texts.items()]


@pytest.fixture(scope="module")
def tiered(tiny_moe):
    return mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2))


def engines_of(sched: Scheduler) -> list:
    """The engines ``sched`` makes from now on, as it makes them."""
    engines, new_engine = [], sched._new_engine
    sched._new_engine = lambda n: engines.append(new_engine(n)) or engines[-1]
    return engines


def run(model, tokenizer, path, texts, *, batch, model_context=4096, **kw):
    config = GenerationConfig("Summarise this.", max_tokens=8, batch_size=batch, **kw)
    sched = Scheduler(model, tokenizer, path, model_context, config)
    return {o.id: o for o in sched.run(docs(texts))}, sched


def test_batched_documents_equal_documents_alone(tiered, tiny_moe):
    model, tokenizer = tiered
    alone, _ = run(model, tokenizer, tiny_moe, TEXTS, batch=1, reuse_prefix=False)
    batched, sched = run(model, tokenizer, tiny_moe, TEXTS, batch=2)
    assert sched.info["batch_size"] == 2 and sched.info["shared_prefix_tokens"] > 0
    assert all(o.status == "done" and o.output_tokens > 0 for o in batched.values())
    assert {k: o.summary for k, o in batched.items()} == {k: o.summary for k, o in alone.items()}
    assert len({o.summary for o in alone.values()}) == 3


def test_long_document_is_summarised_by_map_reduce(tiered, tiny_moe):
    model, tokenizer = tiered
    out, sched = run(model, tokenizer, tiny_moe, {"long": LONG, "a": TEXTS["a"]}, batch=2, model_context=180)
    assert sched.context == 180
    long, short = out["long"], out["a"]
    assert long.status == "done" and long.parts >= 3 and long.levels >= 2
    assert long.input_tokens > 180  # the whole document's prompt: never truncated
    assert long.output_tokens > 8  # every part's tokens count
    assert short.status == "done" and short.parts == 0


def test_a_long_document_resumes_from_the_calls_a_stopped_run_kept(tiered, tiny_moe, tmp_path):
    """Each finished call of a document read in parts is kept (:class:`PartStore`): a run
    stopped midway loses only its calls in flight. The next run splits the document as the
    stopped one did, though its memory now allows larger parts, generates only the calls not
    kept, and writes the summary an uninterrupted run writes (the MLX path's tokens do not
    depend on what ran beside them); under another identity nothing is reused."""
    model, tokenizer = tiered
    config = GenerationConfig("Summarise this.", max_tokens=8, batch_size=2)
    identity = {"model": "tiny", "kernel": "mlx"}

    def run_with(store, should_stop=lambda: False, context=180, texts=None):
        steps = []
        sched = Scheduler(model, tokenizer, tiny_moe, context, config, parts=store)
        out = {o.id: o for o in sched.run(docs(texts or {"long": LONG}), should_stop=should_stop,
                                          on_step=lambda info, ids: steps.append(info))}
        return out, steps

    for folder in ("whole", "stopped", "twins"):
        (tmp_path / folder).mkdir()
    whole, _ = run_with(PartStore(tmp_path / "whole", identity))
    calls = PartStore(tmp_path / "whole", identity).docs({"long": None})["long"]
    assert whole["long"].status == "done" and whole["long"].parts >= 3 and whole["long"].kept == 0
    assert calls >= whole["long"].parts + 1  # every part and the combining call(s)
    again, steps = run_with(PartStore(tmp_path / "whole", identity))  # everything kept: nothing generated
    assert again["long"].summary == whole["long"].summary and again["long"].kept == calls
    # its tokens are all written (kept calls'), none generated
    assert again["long"].output_tokens == again["long"].kept_tokens == whole["long"].output_tokens and steps == []

    store = PartStore(tmp_path / "stopped", identity)
    stopped, _ = run_with(store, should_stop=lambda: bool(store.docs({"long": None})))  # once one call is kept
    assert stopped == {} and store.error is None
    kept = [json.loads(line) for line in (tmp_path / "stopped" / PARTS).read_text().splitlines()]
    # the calls in flight when the stop came finish and are kept (two: batch 2); nothing new starts
    assert len(kept) <= config.batch_size < whole["long"].parts and [k["doc"] for k in kept] == ["long"] * len(kept)
    resumed, _ = run_with(PartStore(tmp_path / "stopped", identity), context=400)  # more room now
    r = resumed["long"]
    assert r.summary == whole["long"].summary and r.kept == len(kept) and r.parts == whole["long"].parts
    assert r.output_tokens == whole["long"].output_tokens and r.kept_tokens == sum(k["tokens"] for k in kept)

    other, _ = run_with(PartStore(tmp_path / "whole", {**identity, "kernel": "cpu"}))
    assert other["long"].kept == 0 and other["long"].output_tokens == whole["long"].output_tokens

    # Two copies in one run: the second takes the first's calls, none counted as an earlier run's.
    twins, _ = run_with(PartStore(tmp_path / "twins", identity), texts={"long": LONG, "copy": LONG})
    assert [twins[k].kept for k in ("long", "copy")] == [0, 0]
    assert twins["copy"].summary == whole["long"].summary
    # each writes every call's tokens; those it took from the other were not generated for it
    assert twins["copy"].output_tokens == twins["long"].output_tokens == whole["long"].output_tokens
    assert twins["copy"].kept_tokens + twins["long"].kept_tokens > 0


def test_a_long_document_that_could_not_be_combined_fails_before_any_step(tiered, tiny_moe):
    model, tokenizer = tiered
    floor = len(build_prompt(tokenizer, REDUCE_NOTE + "Summarise this.", "")) + JOIN_SLACK + 16
    steps = []
    sched = Scheduler(model, tokenizer, tiny_moe, floor - 1 + 8, GenerationConfig("Summarise this.", max_tokens=8))
    out = list(sched.run(docs({"long": LONG}), on_step=lambda info, ids: steps.append(info)))
    assert [o.status for o in out] == ["failed"] and "after the combining instruction" in out[0].error
    assert steps == []


class Poisoned:
    """The model, failing like an MLX out-of-memory error whenever a batch holds ``token``."""

    def __init__(self, model, token: int):
        self._model, self._token = model, token

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, *args, **kwargs):
        if (inputs == self._token).any().item():
            raise RuntimeError("[malloc] Unable to allocate 1234 bytes")
        return self._model(inputs, *args, **kwargs)


def test_a_failing_document_fails_alone(tiered, tiny_moe):
    model, tokenizer = tiered
    texts = {**TEXTS, "bad": "zebraquokka " * 3}
    token = tokenizer.encode(" zebraquokka", add_special_tokens=False)[0]
    assert all(token not in tokenizer.encode(t) for t in TEXTS.values())
    clean, _ = run(model, tokenizer, tiny_moe, TEXTS, batch=4)
    out, _ = run(Poisoned(model, token), tokenizer, tiny_moe, texts, batch=4)
    assert out["bad"].status == "failed" and "Unable to allocate" in out["bad"].error
    assert {k: out[k].summary for k in TEXTS} == {k: o.summary for k, o in clean.items()}


def test_stop_request_starts_nothing_new(tiered, tiny_moe):
    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=2,
                                                                         schedule="paced"))
    generated = []

    def on_step(info, ids):
        generated.append(info.generated)

    # Stop once a token is out: the documents already writing finish; b was still
    # being read (prefill runs one prompt at a time) and c never started.
    out = list(sched.run(docs(TEXTS), should_stop=lambda: sum(generated) > 0, on_step=on_step))
    assert [o.id for o in out] == ["a"] and out[0].status == "done"
    # Stop while the first prompt is still being read: nothing finishes.
    generated.clear()
    out = list(sched.run(docs(TEXTS), should_stop=lambda: len(generated) > 0, on_step=on_step))
    assert out == [] and sum(generated) == 0


def test_stop_abandons_a_prompt_pool_between_layers(tiered, tiny_moe):
    """Throughput schedule: a stop asked while a prompt pool is being read takes effect
    at the next MoE layer (not at the end of the step); the documents being read are
    left for the next run, and the scheduler ends with nothing finished."""
    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=3,
                                                                         pool_tokens=512, prefill_batch=3))
    layers, steps = [], []
    out = list(sched.run(docs(TEXTS), should_stop=lambda: bool(layers), on_step=lambda info, ids: steps.append(info),
                         on_layer=lambda layer, reading: layers.append((layer, reading))))
    assert out == [] and [layer for layer, _ in layers] == [0]  # asked once, before the first layer: no further
    reading = layers[0][1]  # the step's own prompts, with nothing read before it: 512 tokens over three
    assert [d for d, *_ in reading] == ["a", "b", "c"][:len(reading)] and all(r == 0 for _, r, _, _ in reading)
    assert sum(n for _, _, n, _ in reading) <= 512 and all(0 < n <= total for _, _, n, total in reading)
    assert [s.prefill_tokens for s in steps] == [0]  # one step, nothing read


def test_impossible_context_is_refused_before_any_document(tiered, tiny_moe):
    from mlx_tier.errors import InputError

    model, tokenizer = tiered
    with pytest.raises(InputError, match="raise `context` or lower `max_tokens`") as e:
        Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 160, context=100))
    assert e.value.field == "context"  # the CLI names its flag (test_cli: "raise --context")


def test_nothing_outside_the_reasoning_fails_the_document(tiered, tiny_moe):
    from mlx_tier.cli.render import as_flags
    from mlx_tier.job.scheduler import _Doc

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8))
    d = _Doc(Document("t", "t", "text"), 0.0, reasoning=["thinking, cut by the limit"])
    out = sched._finish(d, "", "length")
    assert out.status == "failed" and "outside the reasoning" in out.error and "`retry_failed`" in out.error
    assert "--" not in out.error and "--retry-failed" in as_flags(out.error)  # the CLI renders the flags
    assert sched._finish(_Doc(Document("u", "u", "x"), 0.0), "A summary.", "stop").status == "done"


def test_kv_caches_are_counted_as_the_pool_engine_holds_them(tiered, tiny_moe):
    """The decode pool holds every sequence at the longest one's length (ROOM_SLACK columns
    more), and a sequence not in it yet holds its own prompt cache besides (grown in KV_STEP
    steps): a short document beside a long one is counted at the long one's length (counted
    at its own, a 2 GiB run of 16 documents was killed for memory) and at its own prompt,
    and one that would not fit so waits."""
    from mlx_tier.job.pool_kv import ROOM_SLACK

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=8,
                                                                         pool_tokens=512, prefill_batch=3))
    engine = sched._new_engine(8)
    engine.add(Task("long", list(range(600)), 100))
    assert engine.kv_tokens() == 700 + ROOM_SLACK + 600 + KV_STEP
    short = Task("short", list(range(92)), 8)  # 100 tokens at its longest
    assert engine.kv_tokens(short) == 2 * (700 + ROOM_SLACK) + (600 + KV_STEP) + (92 + KV_STEP)
    per, fixed = sched.plan.kv_per_token, sched.plan.fixed_per_seq
    assert sched._held_bytes(engine, short) == int(per * engine.kv_tokens(short)) + 2 * fixed
    sched._kv_room = sched._held_bytes(engine, short) - 1
    assert not sched._fits(short, engine)  # its own 100 tokens would have fitted
    sched._kv_room += 1
    assert sched._fits(short, engine)
    for i in range(6):  # prompt caches of at most 2 x prefill_batch at once: the longest 6 of 7 counted
        engine.add(Task(i, list(range(10 * (i + 1))), 8))
    assert engine.kv_tokens() == 7 * (700 + ROOM_SLACK) + 600 + sum(10 * i for i in range(2, 7)) + 6 * KV_STEP
    # A pool whose last column is beyond the longest + ROOM_SLACK (shared left padding not
    # dropped yet) grows to that column rounded up to KV_STEP; a wider buffer counts as it is.
    unjoined = 600 + sum(10 * i for i in range(2, 7)) + 6 * KV_STEP
    layer = type("Layer", (), {"keys": mx.zeros((2, 1, 300, 4)), "values": mx.zeros((2, 1, 300, 4)), "_idx": 900})
    engine._gen.prompt_cache = [layer]
    assert engine.kv_tokens() == 7 * 1024 + unjoined
    layer.keys = layer.values = mx.zeros((8, 1, 1100, 4))
    assert engine.kv_tokens() == 8 * 1100 + unjoined


def test_documents_whose_kv_cache_does_not_fit_wait(tiered, tiny_moe):
    """Throughput schedule: a document starts only when its KV cache (prompt + max_tokens)
    fits beside those in flight; the others wait for a place, then all finish."""
    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=3,
                                                                         pool_tokens=512, prefill_batch=3))
    per_doc = sched.plan.kv_per_token * (70 + KV_STEP)  # the prompts here are ~50 tokens + 8 generated
    sched._kv_room = int(1.5 * per_doc)  # room for one document at a time
    in_flight = []
    out = list(sched.run(docs(TEXTS), on_step=lambda info, ids: in_flight.append(len(ids))))
    assert sorted(o.id for o in out) == ["a", "b", "c"] and all(o.status == "done" for o in out)
    assert max(in_flight) == 1


def test_a_document_that_finds_no_memory_waits_instead_of_failing(tiered, tiny_moe, monkeypatch):
    """When the memory left now (not the model's context) is what keeps a document from
    fitting whole, and others are in flight, it waits for them instead of being split
    into parts or failed; alone, it is split as before."""
    import mlx_tier.job.scheduler as scheduler_module

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=3,
                                                                         pool_tokens=512, prefill_batch=3))
    plenty, engines = scheduler_module.sequence_room(), engines_of(sched)
    monkeypatch.setattr(scheduler_module, "sequence_room",
                        lambda memory=None, lent=0: plenty if not (engines and engines[-1].active) else 0)
    in_flight = []
    out = list(sched.run(docs(TEXTS), on_step=lambda info, ids: in_flight.append(len(ids))))
    assert sorted(o.id for o in out) == ["a", "b", "c"]
    assert all(o.status == "done" and o.parts == 0 for o in out) and max(in_flight) == 1


def test_the_pool_model_calibrates_on_the_shared_prefix(tiered, tiny_moe):
    """The throughput schedule measures its first forward call (the shared prefix): one call
    of the prefix's tokens, between top-k and all experts routed per layer, its time."""
    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="throughput"))
    seen, args = sched._seen, model.args
    assert seen is not None and seen.tokens == len(sched.prefix) > 1 and seen.seconds == sched.prefix.seconds > 0
    assert args.num_experts_per_tok <= seen.distinct <= args.num_local_experts
    assert 0 <= seen.misses <= seen.distinct  # the experts it read into slots
    layers = len(model.expert_cache.layers)  # its routing, each layer's shares most used first
    assert len(seen.popularity) == layers and all(sum(p) == pytest.approx(1) for p in seen.popularity)
    assert all(list(p) == sorted(p, reverse=True) and len(p) == args.num_local_experts for p in seen.popularity)
    paced = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="paced"))
    assert paced._seen is None


def test_a_document_starting_alone_measures_memory_without_what_the_process_freed(tiered, tiny_moe,
                                                                                   monkeypatch):
    """A document that starts with nothing in flight cannot wait, so whether it is read whole
    or in parts is decided from the memory measured then. A finished pool's KV caches are
    freed but stay in the resident set (glibc's heap) until handed back: measured so, the
    same input was read in parts in some runs and whole in others. The room is measured
    again after handing back what the process freed; only memory really in use splits it."""
    import mlx_tier.job.scheduler as scheduler_module

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=1))
    plenty = scheduler_module.sequence_room()
    released = []
    monkeypatch.setattr(scheduler_module, "release_freed_memory", lambda: released.append(1))
    monkeypatch.setattr(scheduler_module, "sequence_room",  # freed memory held until released, once per document
                        lambda memory=None, lent=0: plenty if len(released) >= len(sched._started) else 0)
    sched._started = []
    real_start = sched._start

    def start(d, can_wait=False):
        sched._started.append(d)
        return real_start(d, can_wait)

    monkeypatch.setattr(sched, "_start", start)
    out = list(sched.run(docs(TEXTS)))
    assert sorted(o.id for o in out) == ["a", "b", "c"]
    assert all(o.status == "done" and o.parts == 0 for o in out)  # each read whole
    assert len(released) == 3  # one hand-back per document that did not fit as first measured


def test_the_pools_price_documents_at_their_measured_characters_per_token(tiered, tiny_moe):
    """The pools and the predicted documents/hour are for documents of the typical length in
    tokens, at the characters per token measured on a sample of the documents (English prose:
    ~4.7 with this tokenizer); without a sample, the sizing estimate's 3 (erring long)."""
    from mlx_tier.job.doc_tokens import chars_per_token

    model, tokenizer = tiered
    text = "The committee met on Tuesday to discuss the budget for the coming year. " * 30
    g = GenerationConfig("Summarise this.", 8, schedule="throughput")
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=len(text), documents=4, samples=[text])
    per = chars_per_token(tokenizer, [text])
    assert per > 3.5 and sched.info["chars_per_token"] == round(per, 2)
    extra = len(sched.prefix) + 16
    assert sched.pools.prompt_tokens == int(len(text) / per) + extra
    blind = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=len(text), documents=4)
    assert blind.pools.prompt_tokens == len(text) // 3 + extra and blind.info["chars_per_token"] is None


def test_quantized_kv_caches_are_priced_as_the_attention_reads_them(moe_head_dim_64, monkeypatch):
    """With ``kv_bits`` the KV caches are stored quantized (fewer bytes a token: more sequences
    fit) but the attention dequantises them as it reads: the pool model prices a decode
    step's reads at the unquantized bytes a token, the memory at the stored ones."""
    import mlx_tier.tools.pools as pools_module
    from mlx_tier.job.batch_engine import kv_bytes_per_token

    model, tokenizer = mlx_tier.load(moe_head_dim_64, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu"))
    seen = []
    real = pools_module.choose_pools
    monkeypatch.setattr(pools_module, "choose_pools", lambda shape, *a, **k: seen.append(shape) or real(shape, *a, **k))
    for bits in (None, 8):
        sched = Scheduler(model, tokenizer, moe_head_dim_64, 4096,
                          GenerationConfig("Summarise this.", 8, schedule="throughput", kv_bits=bits))
        unquantized = kv_bytes_per_token(sched.prefix.cache)[0]
        shape = seen[-1]
        if bits is None:
            assert shape.kv_read_bytes == 0.0 and shape.kv_bytes == pytest.approx(unquantized)
        else:
            assert shape.kv_read_bytes == pytest.approx(unquantized) and shape.kv_bytes < 0.5 * unquantized


VARIED = {f"d{i}": " ".join(f"word{j} of document {i}." for j in range(3 + 9 * (i % 4))) for i in range(8)}


@pytest.mark.parametrize("room,kv_bits", [(2.5, None), (3.5, None), (3.5, 8)])
def test_the_kv_caches_the_engine_holds_stay_within_what_the_scheduler_counted(tiered, tiny_moe, room, kv_bits,
                                                                              request):
    """Throughput schedule, a KV room for a few sequences, prompts of different lengths
    read a few tokens a step: after every step the bytes the engine's KV caches hold (the
    decode pool's buffer with its spare rows and columns, the prompt caches of sequences
    being read) stay within what the scheduler counted for them, and that within its room
    (under a memory cap, more is an OOM kill). Counted per sequence at the longest + 256
    tokens, as before, 11 of 207 steps held more, up to 1.25x: prompt caches beside their
    rows in the pool. Quantized KV caches too (8 bits, head dim 64)."""
    model, tokenizer = tiered
    if kv_bits:
        tiny_moe = request.getfixturevalue("moe_head_dim_64")
        model, tokenizer = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2))
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, batch_size=5,
                                                                         pool_tokens=16, prefill_batch=2,
                                                                         kv_bits=kv_bits))
    sched._kv_room = int(room * sched.plan.kv_per_token * (100 + KV_STEP))
    engines, held = engines_of(sched), []

    def on_step(info, ids):
        e = engines[-1]
        held.append((e.kv_bytes(), sched._held_bytes(e) if e.active else 0, e.active))

    out = list(sched.run(docs(VARIED), on_step=on_step))
    assert sorted(o.id for o in out) == sorted(VARIED) and all(o.status == "done" for o in out)
    assert max(n for *_, n in held) >= 2  # sequences shared the room
    assert all(h <= counted for h, counted, _ in held), [(h, c) for h, c, _ in held if h > c]
    assert all(counted <= sched._kv_room for _, counted, n in held if n > 1)


def test_slots_lent_to_decode_steps_are_not_counted_twice_in_the_room_for_a_new_document(tiered, tiny_moe,
                                                                                       monkeypatch):
    """While decode steps hold the prompt step's workspace as expert slots, a document starting
    then is sized without them: the workspace is reserved in the room already."""
    import mlx_tier.job.scheduler as scheduler_module

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="throughput"))
    asked = []
    monkeypatch.setattr(scheduler_module, "sequence_room", lambda memory=None, lent=0: asked.append(lent) or 1 << 30)
    cache = model.expert_cache
    try:
        cache.lend_slots(2)
        sched._context_now()
        assert asked == [cache.lent_bytes] and cache.lent_bytes == 2 * sum(la.slot_nbytes for la in cache.layers) > 0
    finally:
        cache.lend_slots(0)
    sched._context_now()
    assert asked[-1] == 0


def test_no_slots_are_lent_where_the_layers_slots_differ_or_the_cache_does_not_lend(tiered, tiny_moe, monkeypatch):
    """Per-layer slot counts (given, or an adaptive split) are kept as they are, and a cache
    that does not lend (two-tier) gets none: the engine is given 0 slots to lend."""
    model, tokenizer = tiered
    cache = model.expert_cache
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="throughput"))
    assert sched._decode_slots(4) == 0  # no memory split: nothing known idle
    sched.memory = SimpleNamespace(cache_given=False)  # a split (what it lends is lent_slots', stubbed)
    monkeypatch.setattr("mlx_tier.tools.pool_cache.lent_slots", lambda *a: 3)
    assert sched._decode_slots(4) == min(3, min(la.num_experts - la.num_slots for la in cache.layers)) > 0
    monkeypatch.setattr(type(cache), "layer_slots", property(lambda self: (1,) + (2,) * (len(self.layers) - 1)))
    assert sched._decode_slots(4) == 0
    monkeypatch.undo()
    monkeypatch.setattr(cache, "can_lend", False)
    assert sched._decode_slots(4) == 0


def test_decode_steps_also_borrow_the_kv_room_no_sequence_holds(tiered, tiny_moe, monkeypatch):
    """Beside the prompt step's idle workspace, a decode step borrows the KV room that the
    sequences in flight will never hold (at their longest, with the prompts being read and
    joining), in whole slot rows, at most a layer's experts beyond its slots: a job's tail
    (one document left decoding) runs with most of the KV share as slots. A document started
    later has it back before its KV cache exists (the prefill step reading it takes every lent
    slot back first: tests/job/test_pool_engine.py)."""
    from mlx_tier.engine import footprint

    model, tokenizer = tiered
    cache = model.expert_cache
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="throughput"))
    sched.memory = SimpleNamespace(cache_given=False)
    monkeypatch.setattr("mlx_tier.tools.pool_cache.lent_slots", lambda *a: 1)  # the workspace's: one slot row
    engine = sched._new_engine(4)
    layers = len(cache.layers)
    row = cache.slot_row_bytes + cache.slot_row_bytes // layers  # a slot row and its layer's read ahead
    assert engine.decode_slots == 1 and cache.lendable >= 3
    sched._kv_room = 2 * row + row // 2  # nothing in flight: two whole rows idle
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == 3
    engine.add(Task(("a", 0), tokenizer.encode(TEXTS["a"]), 8))
    held = sched._held_bytes(engine)
    assert held > 0
    sched._kv_room = held + held // layers + row  # one row beside what the sequence may hold, and a layer's copy
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == 2
    sched._kv_room -= 1  # not a whole row: the workspace's only
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == 1
    sched._kv_room = 1 << 40
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == cache.lendable  # every expert of a layer at most
    monkeypatch.setattr(footprint, "LEND_KV_ROOM", False)
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == 1  # the workspace's only (benches/throughput.py's throughput-workspace-lend)
    monkeypatch.setattr(footprint, "LEND_SLOTS", False)
    engine.decode_slots = 0
    sched._lend_idle_kv(engine)
    assert engine.decode_slots == 0  # lending off: none
    engine.close()


def test_the_job_sets_the_slots_to_lend_before_every_step(tiered, tiny_moe, monkeypatch):
    """The throughput job sizes what its decode steps borrow before each step, from what is
    in flight then (the test above: the arithmetic)."""
    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 4, schedule="throughput"))
    calls, steps = [], []
    real_step = sched._step
    monkeypatch.setattr(sched, "_lend_idle_kv", lambda engine: calls.append(len(steps)))
    monkeypatch.setattr(sched, "_step", lambda *a: steps.append(1) or real_step(*a))
    out = list(sched.run(docs(TEXTS)))
    assert len(out) == 3 and steps and calls == list(range(len(steps)))


def test_the_room_for_the_whole_job_is_measured_without_what_the_process_freed(tiered, tiny_moe, monkeypatch):
    """The pools and the room documents are admitted against are measured once, at the start:
    after handing back what loading and the shared prefix freed (glibc's heap held 70 MiB
    of the capped synthetic's then), not with it counted as in use."""
    import mlx_tier.job.scheduler as scheduler_module

    model, tokenizer = tiered
    events = []
    monkeypatch.setattr(scheduler_module, "release_freed_memory", lambda: events.append("release"))
    monkeypatch.setattr(scheduler_module, "sequence_room",
                        lambda memory=None, lent=0: events.append("measure") or 1 << 30)
    Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8, schedule="throughput"))
    assert events[:2] == ["release", "measure"]


def test_a_document_about_to_wait_measures_the_room_without_what_the_process_freed(tiered, tiny_moe, monkeypatch):
    """A document that does not fit as first measured while others are in flight would wait
    for them to finish; but memory the process freed and still holds (a finished pool's KV
    caches, the kernels' temporaries in glibc's heap: 200-400 MiB of the capped synthetic's
    resident set) is room too. It is handed back and measured again before the document
    waits, at most every WAIT_RELEASE_S (each hand-back costs a full garbage collection);
    before a document would be read in parts, always."""
    import mlx_tier.job.scheduler as scheduler_module

    model, tokenizer = tiered
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, GenerationConfig("Summarise this.", 8))
    released, clock = [], [1000.0]
    monkeypatch.setattr(scheduler_module.time, "perf_counter", lambda: clock[0])
    held = [True]  # freed memory still held until handed back
    monkeypatch.setattr(sched, "_context_now", lambda: 100 if held[0] else 4096)

    def release():
        released.append(clock[0])
        held[0] = False

    monkeypatch.setattr(scheduler_module, "release_freed_memory", release)
    assert sched._context_for(50, can_wait=True) == 100 and not released  # fits: nothing to hand back
    assert sched._context_for(500, can_wait=True) == 4096 and released == [1000.0]
    held[0] = True  # the next step's temporaries, held again
    clock[0] += scheduler_module.WAIT_RELEASE_S / 2
    assert sched._context_for(500, can_wait=True) == 100 and len(released) == 1  # it waits: too soon
    assert sched._context_for(500, can_wait=False) == 4096 and len(released) == 2  # would split: always
    held[0] = True
    clock[0] += scheduler_module.WAIT_RELEASE_S
    assert sched._context_for(500, can_wait=True) == 4096 and len(released) == 3
    monkeypatch.setattr(sched, "context", 100)  # the usable context itself bounds it, not memory
    held[0] = True
    clock[0] += scheduler_module.WAIT_RELEASE_S
    assert sched._context_for(500, can_wait=False) == 100 and len(released) == 3  # a hand-back cannot help


def test_the_predicted_documents_per_hour_are_under_the_users_tok_s_cap(tiered, tiny_moe):
    """A user trial: `run --max-tok-s 2` announced the uncapped prediction. The run's
    scheduler prices the throttle's cap: its documents never generate faster than it."""
    model, tokenizer = tiered
    g = GenerationConfig("Summarise this.", 8, schedule="throughput")
    free = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=400, documents=4).pools
    capped = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=400, documents=4, max_tok_s=0.05).pools
    assert free is not None and capped is not None
    assert capped.docs_per_hour * 8 / 3600 <= 0.05 < free.docs_per_hour * 8 / 3600


def test_a_long_typical_document_is_predicted_over_all_its_calls(tiny_moe):
    """A user trial: a document of ~1,300 tokens at a small context was predicted as one call
    (1062 documents/hour against 33 achieved). The prediction counts its parts and combining
    calls (:func:`mlx_tier.tools.calls.call_plan`), each priced at its own prompt, and says so."""
    from mlx_tier.job.activity import announce
    from mlx_tier.tools.pools import choose_pools

    model, tokenizer = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu"))
    g = GenerationConfig("Summarise this.", 8, schedule="throughput", context=256)
    short = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=400, documents=4).pools
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=20_000, documents=4)
    long = sched.pools
    assert short.calls == 1 and long.calls > 2 and long.document_tokens > 256 >= long.prompt_tokens
    calls = sched.calls_for(long.document_tokens)
    shape, rates = sched.step_model()
    part = choose_pools(shape, rates, calls.part_prompt, 8, sched.plan.free_bytes - sched.plan.prefill_fixed,
                        None, 4, None, len(sched.prefix) if sched._prefix() else 0, True,
                        decode_slots=sched._decode_slots(long.decode_pool))  # a part's call as the scheduler priced it
    assert part.prompt_tokens == long.prompt_tokens and long.docs_per_hour < part.docs_per_hour / calls.parts
    said = []
    announce(sched, type("R", (), {"message": lambda self, text: said.append(text)})())
    line = " ".join(" ".join(said).split())
    assert f"documents of ~{long.document_tokens} tokens, each summarised in {long.calls} calls" in line, line


def test_documents_of_unknown_size_are_predicted_as_one_full_call(tiny_moe):
    """A user trial: a --retry-failed run of an unconvertible .html (its size unknown) was
    predicted "for documents of ~8192 tokens, each summarised in 3 calls". A document of
    unknown size is priced as one call as long as the context allows."""
    model, tokenizer = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel="cpu"))
    g = GenerationConfig("Summarise this.", 8, schedule="throughput", context=512)
    pools = Scheduler(model, tokenizer, tiny_moe, 4096, g, typical_chars=None, documents=1).pools
    assert pools.calls == 1 and pools.prompt_tokens <= 512 - 8


def test_an_asked_batch_is_cut_to_what_memory_holds(tiered, tiny_moe, monkeypatch):
    """A user trial: `--batch-size 100000` said "batch size 100000" and the paced schedule would
    admit that many sequences whatever their KV caches take (the throughput schedule makes them
    wait). An asked batch is an upper bound: memory's count when lower, said so."""
    import mlx_tier.job.scheduler as scheduler_module
    from mlx_tier.job.activity import announce

    model, tokenizer = tiered
    small = scheduler_module.estimate_memory

    def tight(cache, args, step, free_bytes=None):  # room for a few sequences only
        plan = small(cache, args, step, free_bytes)
        return replace(plan, free_bytes=plan.prefill_fixed + 5 * plan.sequence_bytes(600))

    monkeypatch.setattr(scheduler_module, "estimate_memory", tight)
    config = GenerationConfig("Summarise this.", 8, batch_size=100_000, schedule="paced")
    sched = Scheduler(model, tokenizer, tiny_moe, 4096, config, longest_chars=1200)
    default = Scheduler(model, tokenizer, tiny_moe, 4096, replace(config, batch_size=None), longest_chars=1200)
    assert default.batch_size < 8  # memory, not mlx-lm's cap of 8, bounds the default here
    assert sched.batch_size == default.batch_size  # the asked 100,000: what memory holds, as the default
    assert sched.info["batch_size_from"] == "batch_size, memory headroom"
    lines = []
    announce(sched, SimpleNamespace(message=lines.append))
    assert lines[0].startswith(f"batch size {sched.batch_size} (`batch_size` 100,000 cut to what memory holds)")
    asked = Scheduler(model, tokenizer, tiny_moe, 4096, replace(config, batch_size=2), longest_chars=1200)
    assert asked.batch_size == 2 and asked.info["batch_size_from"] == "batch_size"  # within it: as asked
    # a user trial: the throughput schedule said "batch size 99999999999999999999" and "up to
    # 99,999,999,999,999,999,999 sequences decoding together", then decoded 7
    huge = replace(config, batch_size=10**20, schedule="throughput", pool_tokens=64, prefill_batch=1)
    pooled = Scheduler(model, tokenizer, tiny_moe, 4096, huge, longest_chars=1200)
    assert pooled.batch_size == 64 and pooled.info["batch_size_from"] == "batch_size, pool plan"  # memory: fewer
    lines = []
    announce(pooled, SimpleNamespace(message=lines.append))
    assert lines[0].startswith(f"batch size 64 (`batch_size` {10**20:,} cut to the most a pool plan takes)")
    assert f"up to {pooled.batch_size} sequences decoding together" in " ".join(lines), lines
    # a review: the throughput schedule sizes its pools for the typical document (a longer one waits
    # for room), so an asked batch is cut by what memory holds for those: asking for the default's
    # own size with one long document among short ones gave 1
    base = GenerationConfig("Summarise this.", 8, schedule="throughput")
    kw = dict(longest_chars=6000, typical_chars=300, documents=200)
    plain = Scheduler(model, tokenizer, tiny_moe, 4096, base, **kw)
    same = Scheduler(model, tokenizer, tiny_moe, 4096, replace(base, batch_size=plain.batch_size), **kw)
    assert plain.batch_size > 1 and same.batch_size == plain.batch_size, (plain.batch_size, same.batch_size)
