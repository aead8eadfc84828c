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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="an MoE checkpoint (e.g. the synthetic)")
    ap.add_argument("--slots", type=int, default=4, help="expert slots per layer")
    ap.add_argument("--pools", default="128,256", help="prompt tokens per step, comma-separated")
    ap.add_argument("--prompts", type=int, default=1, help="prompts a step reads together")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per pool (after one untimed)")
    ap.add_argument("--warm", action="store_true", help="read the checkpoint's files once first")
    a = ap.parse_args()

    from mlx_tier.engine.load import TierConfig, load

    if a.warm:
        for f in sorted(a.model.glob("*.safetensors")):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    model, _ = load(a.model, config=TierConfig(slots_per_layer=a.slots, kernel="cpu", dtype=mx.float32))
    timer = Timer()
    instrument(model.model, timer)
    random.seed(0)
    print("caliber:", json.dumps({
        "machine": f"{platform.machine()} {psutil.cpu_count(logical=False)} cores "
                   f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "cpu": platform.processor() or "",
        "model": str(a.model), "slots_per_layer": a.slots, "kernel": "cpu", "dtype": "float32",
        "prompts_per_step": a.prompts, "page_cache": "warmed" if a.warm else "as found",
        "steps": a.steps, "load": [round(x, 1) for x in os.getloadavg()]}))
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
