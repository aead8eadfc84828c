"""Batched generation equals one prompt at a time; the reasoning rule; stop ids; memory plan.

Invariant guarded: greedy tokens of a batch (prompts of different lengths,
right-padded by mlx-lm, with and without the shared-prefix KV cache) equal
each prompt decoded alone by mlx-lm's ``stream_generate`` on the same model,
at a cache smaller than the experts.
"""

from __future__ import annotations

import json

import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_logits_processors

import mlx_tier
from mlx_tier.job.batch_engine import (
    BatchEngine,
    MemoryPlan,
    PrefixCache,
    Task,
    common_prefix,
    stop_token_ids,
)
from mlx_tier.job.prompts import build_prompt, strip_reasoning

N = 10
TEXTS = ["The cat sat.", "A much longer text about rivers, mountains and the sea, and boats.", "Numbers: 1 2 3 4 5"]


def alone(model, tokenizer, prompt, penalty):
    procs = make_logits_processors(repetition_penalty=penalty) if penalty != 1.0 else None
    out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=N, logits_processors=procs)]
    return [t for t in out if t not in tokenizer.eos_token_ids]


def run_batch(engine, prompts):
    results = {}
    pending = list(enumerate(prompts))
    while pending or engine.active:
        while pending and engine.free:
            i, p = pending.pop(0)
            engine.add(Task(i, p, N))
        for f in engine.step().finished:
            results[f.key] = f
    return [results[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiered(tiny_moe):
    return mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2))


@pytest.mark.parametrize("penalty", [1.0, 1.1])
def test_batch_equals_alone_with_and_without_prefix(tiered, tiny_moe, penalty):
    model, tokenizer = tiered
    prompts = [build_prompt(tokenizer, "Summarise this.", t) for t in TEXTS]
    assert len({len(p) for p in prompts}) == 3  # different lengths: padding is exercised
    refs = [alone(model, tokenizer, p, penalty) for p in prompts]
    assert len({tuple(r) for r in refs}) == 3  # the outputs differ, so a mix-up would show
    n = common_prefix(prompts)
    assert 0 < n < min(len(p) for p in prompts)
    stops = stop_token_ids(tokenizer, tiny_moe)
    for prefix in (None, PrefixCache(model, prompts[0][:n])):
        # batch of 2 for 3 prompts: the third joins when the first finishes
        got = run_batch(BatchEngine(model, tokenizer, stops, batch_size=2, repetition_penalty=penalty,
                                    prefix=prefix), prompts)
        assert [g.tokens for g in got] == refs
        assert all(g.prefix_tokens == (n if prefix else 0) for g in got)
        assert [g.text for g in got] == [tokenizer.decode(r) for r in refs]


def test_engine_refuses_overfill_and_cancels(tiered, tiny_moe):
    model, tokenizer = tiered
    eng = BatchEngine(model, tokenizer, stop_token_ids(tokenizer, tiny_moe), batch_size=1)
    eng.add(Task("a", [1, 2, 3], 4))
    with pytest.raises(ValueError, match="full"):
        eng.add(Task("b", [1, 2], 4))
    eng.step()
    assert [t.key for t in eng.cancel()] == ["a"] and eng.free == 1
    with pytest.raises(ValueError, match="empty"):
        eng.add(Task("c", [], 4))


def test_stop_ids_union_of_tokenizer_and_configs(tmp_path):
    class Tok:
        eos_token_ids = frozenset({2})
        eos_token_id = 2

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert stop_token_ids(Tok(), tmp_path) == {2, 7, 9, 11}
    (tmp_path / "generation_config.json").write_text("not json")
    assert stop_token_ids(Tok(), tmp_path) == {2, 7, 9}


@pytest.mark.parametrize(
    "text, summary, reasoning",
    [
        ("Plain summary.", "Plain summary.", ""),
        ("<think>weigh it</think>\nThe answer.", "The answer.", "weigh it"),
        ("Start. <think>a</think> Middle. <think>b</think> End.", "Start.  Middle.  End.", "a\n\nb"),
        ("<think>never closed", "", "never closed"),
        ("opened by the template</think> Final words.", "Final words.", "opened by the template"),
        ("<|channel|>analysis<|message|>think here<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>",
         "Done.", "think here"),
        ("<|channel|>analysis<|message|>only thinking", "", "only thinking"),
    ],
)
def test_strip_reasoning(text, summary, reasoning):
    assert strip_reasoning(text) == (summary, reasoning)


def test_memory_plan_arithmetic():
    plan = MemoryPlan(kv_per_token=1000.0, fixed_per_seq=500, prefill_per_token=9000.0, prefill_fixed=9500,
                      free_bytes=1_010_000)
    assert plan.sequence_bytes(100) == 1_010_000  # 10 000 B/token (cache + prefill transient) + 10 000 fixed
    assert plan.batch_size(100) == 1
    assert plan.batch_size(40) == 2  # 1_010_000 // 410_000
    assert plan.batch_size(10) == 8  # 9 fit, capped at 8
    assert plan.batch_size(10_000) == 1  # never below one
    assert plan.max_tokens() == 100


def test_memory_plan_does_not_collapse_for_many_heads():
    """64 heads, 512-token prefill steps, 0.9 GiB free: the transient grows with the
    context being solved for, so the usable context stays in the thousands."""
    plan = MemoryPlan(kv_per_token=2048.0, fixed_per_seq=0, prefill_per_token=64 * 512 * 4.0,
                      prefill_fixed=512 * 2880 * 16, free_bytes=int(0.9 * 2**30))
    assert 6000 < plan.max_tokens() < 8000


def test_pacer_chooses_step_tokens_from_measured_step_times():
    from mlx_tier.job.batch_engine import PrefillPacer

    p = PrefillPacer(512, target_seconds=4.0)
    assert p.size() == 4  # nothing measured yet: a short first step
    p.observe(4, 1.0)  # 4 tok/s, a 2-core CPU: 512 tokens would be a 128 s step
    assert p.size() == 8  # 16 would fit the target; a step at most doubles
    p.observe(16, 4.0)
    assert p.model() == pytest.approx((0.0, 0.25)) and p.size() == 16
    assert p.size(decode_seconds=2.0) == 8  # the decode step shares the budget
    assert p.size(decode_seconds=10.0) == 4  # never below a quarter of the target
    noisy = PrefillPacer(512, target_seconds=4.0)
    for n, t in ((6, 4.0), (7, 4.1), (6, 3.9)):  # sizes too close to separate overhead from rate
        noisy.observe(n, t)
    assert noisy.size() == 6  # a plain rate, not a wild fit
    q = PrefillPacer(512, target_seconds=4.0)
    for n in (8, 32):  # 1 s of overhead per step + 0.1 s per token
        q.observe(n, 1.0 + 0.1 * n)
    assert q.model() == pytest.approx((1.0, 0.1)) and q.size() in (29, 30)  # 1 + 3 s
    r = PrefillPacer(512, target_seconds=4.0)
    for n in (8, 32):  # 2.5 s of overhead per step: the overhead is kept at half the step
        r.observe(n, 2.5 + 0.1 * n)
    assert r.size() in (24, 25)  # a 5 s step rather than 15-token 4 s steps, mostly overhead
    fast = PrefillPacer(512, target_seconds=4.0, seed=(400, 0.01))
    assert fast.size() == 512  # a fast machine: capped at --prefill-step
    fast.observe(0, 0.0)  # a step without prompt work changes nothing
    assert fast.size() == 512


def test_prompt_steps_are_bounded_in_time_on_a_slow_machine(tiny_moe):
    """A model that reads 100 prompt tokens a second (sleeping, so the CPU load of other
    tests hardly matters): a 400-token prompt is read in short steps, not one 4 s step."""
    model, tokenizer = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2))
    cls = type(model)

    def slow_call(self, inputs, *args, **kwargs):
        import time

        if inputs.shape[1] > 1:
            time.sleep(0.01 * inputs.shape[1])
        return cls.__call__(self, inputs, *args, **kwargs)

    model.__class__ = type("SlowModel", (cls,), {"__call__": slow_call})
    engine = BatchEngine(model, tokenizer, stop_token_ids(tokenizer), prefill_step_size=512, step_seconds=0.4)
    prompt = tokenizer.encode(" ".join(["river flood spring farmer plant"] * 80))[:400]
    engine.add(Task("k", prompt, 2))
    steps = []
    while engine.active:
        info = engine.step()
        if info.prefill:
            steps.append((info.prefill_tokens, info.prefill_seconds))
    assert sum(t for t, _ in steps) == len(prompt) - 1  # mlx-lm reads the last token when decoding starts
    assert len(steps) >= 5
    # 0.4 s aimed at; a step sized without pacing (512 tokens) sleeps 4 s alone. The
    # bound leaves room for the real compute under heavy load (1.27 s seen at load 15).
    assert max(s for _, s in steps[1:]) < 2.0, steps


def test_a_requests_output_tokens_are_the_apis_count_its_stop_token_included():
    """A user trial: a request that ended on its stop token said 12 completion tokens in
    output.jsonl and 11 in report.json, the table and the progress line."""
    from types import SimpleNamespace

    from mlx_tier.job.batch_api import COMPLETIONS
    from mlx_tier.job.scheduler import Scheduler

    doc = SimpleNamespace(id="r", request=SimpleNamespace(url=COMPLETIONS))
    d = SimpleNamespace(output_tokens=0, choices=[None, None], doc=doc, input_tokens=3, seconds=0.1, finished=False)
    stop = SimpleNamespace(tokens=[5, 6, 7], text="abc", finish_reason="stop", stop_reason=2)  # its stop token: id 2
    cut = SimpleNamespace(tokens=[5, 6, 7, 8], text="abcd", finish_reason="length", stop_reason=None)
    me = SimpleNamespace(reasoning=None)
    assert Scheduler._answered(me, d, stop, 0) is None  # one choice of two so far
    outcome = Scheduler._answered(me, d, cut, 1)
    assert [c.tokens for c in outcome.choices] == [4, 4] and outcome.output_tokens == 8
