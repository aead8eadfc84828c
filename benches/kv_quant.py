"""The quantized KV cache's effect on summaries, bytes and speed (``run --kv-bits``).

Question: what does storing the pools' KV caches at 8 or 4 bits (groups of 64,
:mod:`mlx_tier.job.quantized_kv`) change in the summaries, and what does it
save? The demo model (SmolLM2-135M's trained weights as an 8-expert MoE: its
text is real, so agreement means something; every expert resident), the CPU
kernel and attention as ``run`` uses them, float32 compute, the job's
instruction and repetition penalty, greedy. ``--docs`` pieces of the example
documents (300-1,500 tokens, as benches/throughput.py cuts them) summarised in
one pool (``PoolEngine``, all prompts read first, then decoded together) once
per setting, in one process, the unquantized run first (each setting warmed
up first on two documents, untimed).

Per setting: summaries identical to the unquantized run's, the share of
generated tokens before each summary's first difference, KV bytes per token
(measured on a filled cache), prompt tok/s and decode seconds per generated
token (a speed cost of dequantizing per layer).

    python benches/kv_quant.py [--docs 16] [--summary-tokens 64] [--bits 8,4]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))


def summarise(model, tokenizer, stops, prompts: list[list[int]], max_tokens: int, bits: int | None) -> dict:
    """Every prompt through one pool; tokens per prompt and the step times."""
    from mlx_tier.defaults import DEFAULT_REPETITION_PENALTY
    from mlx_tier.job.batch_engine import Task
    from mlx_tier.job.pool_engine import PoolEngine

    engine = PoolEngine(model, tokenizer, stops, batch_size=len(prompts), prefill_batch=4, pool_tokens=2048,
                        repetition_penalty=DEFAULT_REPETITION_PENALTY, kv_bits=bits)
    for i, p in enumerate(prompts):
        engine.add(Task(i, p, max_tokens))
    out, acc = {}, {"prompt_tokens": 0, "prompt_s": 0.0, "generated": 0, "decode_s": 0.0}
    while engine.active:
        info = engine.step()
        acc["prompt_tokens"] += info.prefill_tokens
        acc["prompt_s"] += info.prefill_seconds
        acc["generated"] += info.generated
        acc["decode_s"] += info.decode_seconds
        out.update({f.key: f.tokens for f in info.finished})
    return {"tokens": [out[i] for i in range(len(prompts))], **acc}


def kv_bytes(model, prompt: list[int], bits: int | None) -> float:
    """KV bytes per token of one filled sequence cache stored with ``bits``."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_tier.job.batch_engine import kv_bytes_per_token
    from mlx_tier.job.quantized_kv import quantized_copy

    cache = make_prompt_cache(model)
    model(mx.array(prompt[:64])[None], cache=cache)
    return kv_bytes_per_token(quantized_copy(cache, bits))[0]


def agreement(ref: list[int], got: list[int]) -> float:
    """Share of ``ref``'s tokens before the first position where ``got`` differs."""
    n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return n / max(1, len(ref))


def main() -> None:
    from mlx_lm.utils import load_tokenizer
    from throughput import documents

    import mlx_tier
    from mlx_tier.defaults import DEFAULT_PROMPT
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.job.batch_engine import stop_token_ids
    from mlx_tier.job.prompts import build_prompt
    from mlx_tier.tools.demo_model import ensure_demo_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--summary-tokens", type=int, default=64)
    ap.add_argument("--bits", default="8,4")
    args = ap.parse_args()
    path = ensure_demo_model()
    model, tokenizer = mlx_tier.load(path, config=mlx_tier.TierConfig(slots_per_layer=8, kernel="cpu",
                                                                      dtype=job_compute_dtype()))
    docs = documents(load_tokenizer(path), args.docs, 300, 1500)
    prompts = [build_prompt(tokenizer, DEFAULT_PROMPT, d.text) for d in docs]
    stops = stop_token_ids(tokenizer, path)
    load0 = os.getloadavg()[0]
    print(f"caliber: {platform.machine()} {os.cpu_count()} cores, demo model (all experts resident), cpu kernel "
          f"and attention, float32, mlx {mx.__version__}, {len(prompts)} documents of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens, summaries <= {args.summary_tokens} "
          f"tokens, greedy, one pool, one run each", flush=True)
    settings = [None, *(int(b) for b in args.bits.split(","))]
    for bits in settings:  # untimed: first calls (allocation, the kernels' first use)
        summarise(model, tokenizer, stops, prompts[:2], 2, bits)
    runs = {}
    for bits in settings:
        t0 = time.perf_counter()
        runs[bits] = summarise(model, tokenizer, stops, prompts, args.summary_tokens, bits)
        runs[bits]["wall"] = time.perf_counter() - t0
        runs[bits]["kv"] = kv_bytes(model, prompts[0], bits)
    ref = runs[None]["tokens"]
    print(f"{'KV cache':<12}{'B/token':>9}{'x f32':>7}{'identical':>11}{'agree':>7}{'prompt t/s':>12}"
          f"{'dec s/tok':>11}")
    for bits, r in runs.items():
        same = sum(a == b for a, b in zip(ref, r["tokens"]))
        agree = sum(agreement(a, b) for a, b in zip(ref, r["tokens"])) / len(ref)
        name = "float32" if bits is None else f"{bits}-bit"
        print(f"{name:<12}{r['kv']:>9.0f}{r['kv'] / runs[None]['kv']:>7.3f}{f'{same}/{len(ref)}':>11}"
              f"{agree:>7.1%}{r['prompt_tokens'] / r['prompt_s']:>12.1f}{r['decode_s'] / r['generated']:>11.3f}")
    print(f"load {load0:.2f}-{os.getloadavg()[0]:.2f}")
    for bits in settings[1:]:
        for i, (a, b) in enumerate(zip(ref, runs[bits]["tokens"])):
            if a != b:
                print(f"{bits}-bit, {docs[i].id}: float32 {tokenizer.decode(a)[:150]!r}")
                print(f"{' ' * len(str(bits))}       {' ' * len(docs[i].id)}  {bits}-bit   "
                      f"{tokenizer.decode(b)[:150]!r}")
                break


if __name__ == "__main__":
    main()
