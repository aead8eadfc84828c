"""A full decode pool against one sequence: the steady-state cost of a generated token.

Question: what does a generated token cost in a decode step of B sequences, once
the pool is full, against a lone sequence's? `benches/throughput.py` measures a
whole job, whose decode pool fills and drains (with 32 documents it is rarely
full); this measures the step itself. The demo model (3 of 8 slots, the CPU
kernel as `run` uses it), greedy with the job's repetition penalty, random
prompts of 300-1,500 tokens read first through mlx-lm's batch primitives, then
``--steps`` decode steps timed (after two untimed ones) for the pool and for
one sequence of the pool's mean length, in one process.

    python benches/decode_pool.py [--pool 32] [--steps 6]

Prints the caliber, both costs and their ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import mlx.core as mx


def decode_cost(model, lengths: list[int], steps: int) -> float:
    """Seconds per generated token over ``steps`` decode steps of ``len(lengths)`` sequences."""
    from mlx_lm.generate import GenerationBatch, PromptProcessingBatch, StopSequences
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler, make_logits_processors

    from mlx_tier.defaults import DEFAULT_REPETITION_PENALTY

    B = len(lengths)
    prompts = [[random.randrange(100, 40000) for _ in range(n)] for n in lengths]
    batch = PromptProcessingBatch(
        model, list(range(B)), [make_prompt_cache(model) for _ in range(B)], tokens=[[] for _ in range(B)],
        prefill_step_size=1 << 30, fallback_sampler=greedy_sampler, samplers=[None] * B,
        logits_processors=[make_logits_processors(repetition_penalty=DEFAULT_REPETITION_PENALTY)
                           for _ in range(B)],
        stop_sequences=[StopSequences([[-1]])] * B, max_tokens=[steps + 8] * B)
    for i in range(0, max(lengths) - 1, 512):
        batch.prompt([p[i:min(i + 512, len(p) - 1)] for p in prompts])
    gen = GenerationBatch.empty(model, greedy_sampler)
    gen.extend(batch.generate([[p[-1]] for p in prompts]))
    gen.next()
    gen.next()
    t = time.perf_counter()
    for _ in range(steps):
        gen.next()
    return (time.perf_counter() - t) / steps / B


def main() -> None:
    import mlx_tier
    from mlx_tier.tools.demo_model import ensure_demo_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    random.seed(0)
    path = ensure_demo_model()
    model = mlx_tier.load(path, config=mlx_tier.TierConfig(slots_per_layer=3, kernel="cpu"))
    model = model[0] if isinstance(model, tuple) else model
    lengths = [random.randrange(300, 1500) for _ in range(args.pool)]
    load0 = os.getloadavg()[0]
    pool = decode_cost(model, lengths, args.steps)
    one = decode_cost(model, [sum(lengths) // len(lengths)], args.steps)
    print(f"caliber: {platform.machine()} {os.cpu_count()} cores, demo model at 3 of 8 slots, cpu kernel, "
          f"mlx {mx.__version__}, load {load0:.2f}-{os.getloadavg()[0]:.2f}, {args.steps} timed steps each")
    print(f"pool of {args.pool} (prompts {min(lengths)}-{max(lengths)} tokens): {pool * 1e3:.1f} ms per generated token")
    print(f"one sequence ({sum(lengths) // len(lengths)} tokens): {one * 1e3:.1f} ms per generated token")
    print(f"pool / one: {pool / one:.3f}")


if __name__ == "__main__":
    main()
