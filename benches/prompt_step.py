"""Where a prompt pool step's time goes, per prompt token.

Question: of what a prompt token costs in the throughput schedule's prefill
step (a pool of prompt tokens through every layer), how much is attention (its
projections and the attention itself), the router, the experts' computation
(the CPU kernel), the read stalls, and the rest of the MoE layer (slot writes,
the rounds' bookkeeping when a pool needs more experts than a layer has
slots)? A checkpoint (the synthetic of ``benches/make_synthetic_moe.py``, as
``benches/throughput.py`` runs it) tiered with ``--slots`` per layer, the CPU
kernel in float32 as ``run`` uses it, no memory cap, the page cache as found
(``--warm`` reads the checkpoint once first, so reads come from memory and
the parts left are compute). Each pool is ``--prompts`` random prompts of
``tokens / prompts`` tokens from an empty KV cache (mlx-lm evaluates only the
caches of a prefill step, so does this); one untimed step, then ``--steps``
timed ones, medians.

Each part is timed by a wrapper that evaluates its output (so lazy work lands
in the part that made it): a little less overlap than the job has, the same
work.

    python benches/prompt_step.py --model DIR [--slots 4] [--pools 128,256] [--steps 3] [--warm]

Prints the caliber, then one row per pool: ms per prompt token, total and by
part, and the experts read per step.

``--engine N`` asks instead whether the job's own path costs more than one
model call: the same pool size, alternated, as (1) one model call on
``--prompts`` random prompts from an empty cache, as above but uninstrumented,
and (2) prefill steps of the job's ``PoolEngine`` (``merge`` off, unpaced) on
``N`` real document prompts (``benches/throughput.py``'s documents of
``--min-tokens``..``--max-tokens`` tokens, the job's instruction and shared
prefix), full pools only: ms per prompt token each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
import psutil

PARTS = ("attention", "router", "experts", "read stall", "moe rest", "other")


class Timer:
    """Seconds per part, accumulated by wrapped callables."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            y = fn(*a, **k)
            mx.eval(y)
            self.seconds[part] += time.perf_counter() - t
            return y
        return timed


def instrument(model, timer: Timer) -> None:
    """Wrap each layer's attention, router gate, expert block and kernel."""
    for layer in model.layers:
        attn = layer.self_attn
        mlp = layer.mlp if "mlp" in layer else layer.block_sparse_moe  # qwen3_moe's, mixtral's (the demo)
        layer.self_attn = _Wrapped(attn, timer.wrap("attention", attn))
        mlp.gate = _Wrapped(mlp.gate, timer.wrap("router", mlp.gate))
        tiered = mlp.switch_mlp
        tiered._kernel = timer.wrap("experts", tiered._kernel)
        mlp.switch_mlp = _Wrapped(tiered, timer.wrap("moe", tiered))


class _Wrapped:
    """Calls ``fn``; everything else is ``inner``'s (mlx-lm reads attributes of layers)."""

    def __init__(self, inner, fn):
        self._inner, self._fn = inner, fn

    def __call__(self, *a, **k):
        return self._fn(*a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def step(model, tokens: int, prompts: int, timer: Timer) -> dict:
    """One prefill step of ``prompts`` random prompts, ``tokens`` in all: ms per token by part."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([[random.randrange(100, 40000) for _ in range(tokens // prompts)] for _ in range(prompts)])
    stats0 = model.expert_cache.snapshot()
    timer.seconds.clear()
    t = time.perf_counter()
    model(x, cache=cache)
    mx.eval([c.state for c in cache])
    total = time.perf_counter() - t
    stats = model.expert_cache.snapshot() - stats0
    s = dict(timer.seconds)
    moe = s.pop("moe", 0.0)
    s["read stall"] = stats.stall_seconds
    s["moe rest"] = moe - s.get("experts", 0.0) - stats.stall_seconds
    s["other"] = total - moe - s.get("attention", 0.0) - s.get("router", 0.0)
    per = {p: s.get(p, 0.0) / tokens * 1e3 for p in PARTS}
    per["total"] = total / tokens * 1e3
    per["misses"] = stats.misses
    return per


def single_call(model, tokens: int, prompts: int) -> float:
    """Seconds per token of one uninstrumented model call on random prompts (empty caches)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([[random.randrange(100, 40000) for _ in range(tokens // prompts)] for _ in range(prompts)])
    t = time.perf_counter()
    model(x, cache=cache)
    mx.eval([c.state for c in cache])
    return (time.perf_counter() - t) / (x.size)


def engine_prompts(tokenizer, n: int, lo: int, hi: int) -> list[list[int]]:
    """The job's prompts (its instruction, the shared prefix) for throughput.py's documents."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from throughput import documents

    from mlx_tier.defaults import DEFAULT_PROMPT
    from mlx_tier.job.prompts import build_prompt

    return [build_prompt(tokenizer, DEFAULT_PROMPT, d.text) for d in documents(tokenizer, n, lo, hi)]


def engine_steps(model, tokenizer, model_dir: Path, prompts: list[list[int]], tokens: int) -> list[float]:
    """Seconds per prompt token of each full prefill step of the job's PoolEngine over ``prompts``."""
    from mlx_tier.job.batch_engine import (
        PrefixCache,
        Task,
        common_prefix,
        stop_token_ids,
    )
    from mlx_tier.job.pool_engine import PoolEngine

    prefix = PrefixCache(model, prompts[0][:common_prefix(prompts)])
    engine = PoolEngine(model, tokenizer, stop_token_ids(tokenizer, model_dir), batch_size=len(prompts),
                        prefill_batch=len(prompts), pool_tokens=tokens, prefix=prefix, merge=False,
                        layer_seconds=None)
    for i, p in enumerate(prompts):
        engine.add(Task(i, p, 1))
    out = []
    while engine.active:
        info = engine.step()
        if info.prefill_tokens == tokens and not info.generated:
            out.append(info.seconds / tokens)
    return out


def compare_engine(model, tokenizer, a) -> None:
    prompts = engine_prompts(tokenizer, a.engine, a.min_tokens, a.max_tokens)
    print(f"\n{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    print(f"{'pool':>5} {'round':>5} {'single call':>12} {'engine':>8} {'steps':>6} {'ratio':>6}   ms per prompt token")
    for tokens in (int(t) for t in a.pools.split(",")):
        single_call(model, tokens, a.prompts)  # untimed
        for r in range(a.steps):
            one = statistics.median(single_call(model, tokens, a.prompts) for _ in range(2))
            steps = engine_steps(model, tokenizer, a.model, prompts, tokens)
            eng = statistics.median(steps)
            print(f"{tokens:>5} {r:>5} {one * 1e3:>12.2f} {eng * 1e3:>8.2f} {len(steps):>6} {eng / one:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="an MoE checkpoint (e.g. the synthetic)")
    ap.add_argument("--slots", type=int, default=4, help="expert slots per layer")
    ap.add_argument("--pools", default="128,256", help="prompt tokens per step, comma-separated")
    ap.add_argument("--prompts", type=int, default=1, help="prompts a step reads together")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per pool (after one untimed)")
    ap.add_argument("--warm", action="store_true", help="read the checkpoint's files once first")
    ap.add_argument("--engine", type=int, default=0, metavar="N",
                    help="compare one model call with the job's PoolEngine on N document prompts")
    ap.add_argument("--min-tokens", type=int, default=300, help="--engine: shortest document, tokens")
    ap.add_argument("--max-tokens", type=int, default=1500, help="--engine: longest document, tokens")
    ap.add_argument("--cache-limit-mb", type=int, default=None,
                    help="MLX's buffer cache limit (run sets one from its memory split); default: MLX's")
    ap.add_argument("--keep-buffers", action="store_true",
                    help="experiment: mx.clear_cache() does nothing (mlx-lm's prompt pass calls it after each call)")
    a = ap.parse_args()
    if a.keep_buffers:
        mx.clear_cache = lambda: None
    if a.cache_limit_mb is not None:
        mx.set_cache_limit(a.cache_limit_mb << 20)

    from mlx_tier.engine.load import TierConfig, load

    if a.warm:
        for f in sorted(a.model.glob("*.safetensors")):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    model, tokenizer = load(a.model, config=TierConfig(slots_per_layer=a.slots, kernel="cpu", dtype=mx.float32))
    timer = Timer()
    if not a.engine:
        instrument(model.model, timer)
    random.seed(0)
    print("caliber:", json.dumps({
        "machine": f"{platform.machine()} {psutil.cpu_count(logical=False)} cores "
                   f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "cpu": platform.processor() or "",
        "model": str(a.model), "slots_per_layer": a.slots, "kernel": "cpu", "dtype": "float32",
        "prompts_per_step": a.prompts, "page_cache": "warmed" if a.warm else "as found",
        "steps": a.steps, "cache_limit_mb": a.cache_limit_mb, "keep_buffers": a.keep_buffers, "load": [round(x, 1) for x in os.getloadavg()]}))
    if a.engine:
        return compare_engine(model, tokenizer, a)
    print(f"\n{'pool':>5} {'total':>7} " + " ".join(f"{p:>10}" for p in PARTS) + f" {'misses':>7}")
    print("      ms per prompt token (medians)")
    for tokens in (int(t) for t in a.pools.split(",")):
        step(model, tokens, a.prompts, timer)  # untimed
        runs = [step(model, tokens, a.prompts, timer) for _ in range(a.steps)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{tokens:>5} {med['total']:>7.1f} " + " ".join(f"{med[p]:>10.1f}" for p in PARTS)
              + f" {med['misses']:>7.0f}")


if __name__ == "__main__":
    main()
