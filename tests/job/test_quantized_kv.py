"""The quantized KV cache for pools: what mlx-lm's own quantized cache holds, per sequence.

Invariants guarded: each sequence's part of a :class:`BatchQuantizedKVCache`
(merged from float caches, right-padded prompt chunks rolled to left padding,
sequences filtered and joined) holds exactly the codes, scales and biases
mlx-lm's ``QuantizedKVCache`` holds for that sequence alone; a pool with
``kv_bits`` gives each prompt the greedy tokens mlx-lm gives it alone with a
quantized cache (kernel ``mlx``: exactly; the CPU kernel and its attention:
the same tokens on these prompts); the bytes are the stated share.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

import mlx_tier
from mlx_tier.engine.footprint import kv_element_bytes
from mlx_tier.job.batch_engine import PrefixCache, Task, common_prefix, stop_token_ids
from mlx_tier.job.pool_engine import PoolEngine
from mlx_tier.job.prompts import build_prompt
from mlx_tier.job.quantized_kv import BatchQuantizedKVCache, quantizing

N = 10
TEXTS = ["The cat sat.", "A much longer text about rivers, mountains and the sea, and boats.", "Numbers: 1 2 3 4 5",
         "Short one.", "Winter, spring, summer and autumn follow each other; farmers plant in spring."]
H, D = 2, 64


def kv(n, seed):
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
    return k, k * 0.5 + 1


def same(batch: BatchQuantizedKVCache, i: int, alone: QuantizedKVCache):
    got = batch.extract(i)
    assert got.offset == alone.offset
    for a, b in zip((*got.keys, *got.values), (*alone.keys, *alone.values)):
        np.testing.assert_array_equal(np.array(a), np.array(b[..., : alone.offset, :]))


@pytest.mark.parametrize("bits", [8, 4])
def test_each_sequence_holds_what_mlx_lm_quantized_cache_holds(bits):
    prefix = [kv(5, 0), kv(5, 0)]  # a shared prefix (float) copied into two sequences
    floats = []
    for k, v in prefix:
        c = KVCache()
        c.update_and_fetch(k, v)
        floats.append(c)
    batch = BatchQuantizedKVCache.merge(floats, 64, bits)
    alone = [QuantizedKVCache(64, bits) for _ in floats]
    for a, (k, v) in zip(alone, prefix):
        a.update_and_fetch(k, v)
    # A prompt chunk of different lengths: right-padded, then rolled to left padding (mlx-lm#1906).
    chunks = [kv(7, 1), kv(3, 2)]
    batch.prepare(lengths=[7, 3], right_padding=[0, 4])
    pad = mx.zeros((1, H, 4, D))
    batch.update_and_fetch(mx.concatenate([chunks[0][0], mx.concatenate([chunks[1][0], pad], axis=2)]),
                           mx.concatenate([chunks[0][1], mx.concatenate([chunks[1][1], pad], axis=2)]))
    batch.finalize()
    for a, (k, v) in zip(alone, chunks):
        a.update_and_fetch(k, v)
    for step in range(300):  # decode steps, past the 256-step growth
        k, v = kv(1, 10 + step)
        batch.update_and_fetch(mx.concatenate([k, k * 2]), mx.concatenate([v, v * 2]))
        alone[0].update_and_fetch(k, v)
        alone[1].update_and_fetch(k * 2, v * 2)
    same(batch, 0, alone[0])
    same(batch, 1, alone[1])
    # A third sequence joins (extend), the first finishes (filter): the others keep their contents.
    third = BatchQuantizedKVCache.merge([floats[0]], 64, bits)
    batch.extend(third)
    batch.filter([1, 2])
    same(batch, 0, alone[1])
    alone3 = QuantizedKVCache(64, bits)
    alone3.update_and_fetch(*prefix[0])
    same(batch, 1, alone3)
    B, L = batch.keys[0].shape[0], batch.keys[0].shape[2]  # as allocated
    assert kv_element_bytes(bits) == bits / 8 + 8 / 64  # float32 scales and biases, groups of 64
    assert batch.nbytes == 2 * B * H * L * D * kv_element_bytes(bits)  # 0.28x float32's at 8 bits


def quantized_alone(model, tokenizer, prompt, bits, prefix=None):
    cache = make_prompt_cache(model)
    if prefix is not None:  # as the pool: the prefix's float cache, then quantized
        cache = prefix.copy()
        prompt = prompt[len(prefix):]
    cache = [c.to_quantized(group_size=64, bits=bits) if prefix is not None else QuantizedKVCache(64, bits)
             for c in cache]
    out = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=N, prompt_cache=cache)]
    return [t for t in out if t not in tokenizer.eos_token_ids]


def run_pool(engine, prompts):
    results, pending = {}, list(enumerate(prompts))
    while pending or engine.active:
        while pending and engine.free:
            i, p = pending.pop(0)
            engine.add(Task(i, p, N))
        for f in engine.step().finished:
            results[f.key] = f.tokens
        caches = [c for s in engine._reading + engine._starting for c in s.batch.prompt_cache]
        caches += engine._gen.prompt_cache
        assert all(type(c) is BatchQuantizedKVCache for c in caches)
        assert caches or not (engine._reading or engine._starting or engine._generating)
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kernel, bits", [("mlx", 8), ("cpu", 8), ("cpu", 4)])
def test_pool_with_quantized_kv_equals_mlx_lm_quantized_alone(moe_head_dim_64, kernel, bits):
    tiny_moe = moe_head_dim_64
    model, tokenizer = mlx_tier.load(tiny_moe, config=mlx_tier.TierConfig(slots_per_layer=2, kernel=kernel))
    prompts = [build_prompt(tokenizer, "Summarise this.", t) for t in TEXTS]
    refs = [quantized_alone(model, tokenizer, p, bits) for p in prompts]
    assert len({tuple(r) for r in refs}) == len(refs)
    stops = stop_token_ids(tokenizer, tiny_moe)
    for batch, prefill_batch, pool_tokens in [(5, 5, 4096), (2, 2, 16), (5, 3, 7)]:
        engine = PoolEngine(model, tokenizer, stops, batch_size=batch, prefill_batch=prefill_batch,
                            pool_tokens=pool_tokens, kv_bits=bits, layer_seconds=None)  # pools as given
        assert run_pool(engine, prompts) == refs, (batch, prefill_batch, pool_tokens)
    prefix = PrefixCache(model, prompts[0][: common_prefix(prompts)])
    refs = [quantized_alone(model, tokenizer, p, bits, prefix) for p in prompts]
    engine = PoolEngine(model, tokenizer, stops, batch_size=4, prefill_batch=4, pool_tokens=32, prefix=prefix,
                        kv_bits=bits)
    assert run_pool(engine, prompts) == refs


def test_a_batch_of_empty_caches_extends_and_filters():
    """Sequences with nothing cached yet (no shared prefix) merge into an empty batch cache,
    which another joins; keys come with the first update."""
    empty = BatchQuantizedKVCache.merge([KVCache(), KVCache()], 64, 8)
    assert empty.keys is None and empty.size() == 0
    c = KVCache()
    c.update_and_fetch(*kv(3, 7))
    empty.extend(BatchQuantizedKVCache.merge([c], 64, 8))
    alone = QuantizedKVCache(64, 8)
    alone.update_and_fetch(*kv(3, 7))
    same(empty, 2, alone)
    assert empty.left_padding.tolist() == [3, 3, 0]
    empty.filter([2])
    same(empty, 0, alone)
    assert empty.left_padding.tolist() == [0]


def test_quantizing_marks_only_plain_kv_caches():
    from mlx_lm.models.cache import RotatingKVCache

    cache = quantizing([KVCache(), RotatingKVCache(max_size=8)], 4)
    assert type(cache[0]).kv_bits == 4 and type(cache[1]) is RotatingKVCache
    assert quantizing([KVCache()], None)[0].__class__ is KVCache
    with pytest.raises(ValueError, match="one of 4, 8"):
        PoolEngine(None, None, set(), kv_bits=3)


def test_a_run_bounded_by_memory_names_kv_bits_and_one_using_it_says_so():
    from types import SimpleNamespace

    from mlx_tier.job.activity import announce
    from mlx_tier.job.scheduler import GenerationConfig

    said = []
    reporter = SimpleNamespace(message=said.append)

    def scheduler(limited_by, bits):
        pools = SimpleNamespace(limited_by=limited_by, decode_pool=3, docs_per_hour=100.0, prompt_tokens=800,
                                output_tokens=32, calls=1)
        return SimpleNamespace(info={"batch_size_from": "memory headroom", "schedule": "throughput"}, pools=pools,
                               batch_size=3, context=4096, prefill_batch=1, pool_tokens=256,
                               config=GenerationConfig(kv_bits=bits), kv_itemsize=4)

    announce(scheduler("memory", None), reporter)
    assert said[-1] == ("memory bounds the pool at 3 sequences: `kv_bits` 8 would store their KV caches in "
                        "0.28x the bytes (summaries may then differ)")
    said.clear()
    announce(scheduler("memory", 8), reporter)
    assert "(KV caches at 8 bits)" in said[-1] and not any("would store" in m for m in said)
    said.clear()
    announce(scheduler("documents", None), reporter)
    assert not any("would store" in m or "KV caches at" in m for m in said)


def test_a_filter_that_drops_shared_padding_keeps_no_larger_buffer():
    """A finish that leaves every row with left padding drops it with a copy of the columns
    kept, not a view: a view keeps the whole gathered buffer alive (the longest sequence's
    columns, every row) beside what the cache shows."""
    import gc

    caches = []
    for n in (400, 10_000):  # arrays of many pages: an allocator's rounding is small beside them
        c = KVCache()
        c.update_and_fetch(*kv(n, 11))
        caches.append(c)
    batch = BatchQuantizedKVCache.merge(caches, 64, 8)
    del caches
    batch.filter([0])  # the long one leaves: 9,600 columns of shared padding dropped
    arrays = [*batch.keys, *batch.values]
    mx.eval(arrays)
    gc.collect()
    assert batch.keys[0].shape[2] == 400 and batch.left_padding.tolist() == [0]
    shown = sum(a.nbytes for a in arrays)
    held = mx.get_active_memory()
    del batch, arrays
    gc.collect()
    assert held - mx.get_active_memory() <= 2 * shown  # what it held: its arrays' own bytes (a view: ~25x)
