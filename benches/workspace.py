"""What a prompt step and a decode step hold beyond the expert cache and the KV cache.

Question: a run's memory is the runtime, the dense part, the expert slabs, the
KV cache and the *workspace* of the step being computed (activations, attention
scores, the expert kernel's rows, freed buffers MLX keeps for reuse). How large
is the workspace, for the kernel in use, at a prompt step of T tokens over a
context of C tokens, and at a decode step of a batch of B sequences?

How: the model is loaded tiered with the kernel given, every expert resident
(so no read buffer is in the figure) unless ``--slots``; MLX's buffer cache
limit is set as a job sets it (:func:`mlx_tier.engine.memory.plan_memory`), and
one warm-up step compiles the kernel first. For each case the step runs
once on a copy of its cache (the kernel's loops for those shapes loaded, the
heap warm), then again measured (``model(tokens, cache)`` and the cache state
evaluated, as mlx-lm's prompt steps do; a decode step also evaluates its
logits): workspace = MLX's peak memory in use over what was in use before
(``mx.get_peak_memory``, the KV rows the step writes included) + numpy's peak
(``tracemalloc``: the CPU kernel's arrays). The resident set's rise
(``/proc/self/clear_refs`` then ``VmHWM``) is printed beside it: it misses
what the heap already held from earlier steps.
The figure is compared with the shape terms (plus the KV rows written) of
:mod:`mlx_tier.engine.footprint`.

    python benches/workspace.py MODEL [--kernel cpu] [--steps 32,128,512] [--contexts 0,1024] [--batches 1,8]

Linux only (``clear_refs``, ``VmHWM``). Prints its caliber; one run per case
(memory figures, unlike times, do not move with the machine's load).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import tracemalloc
from pathlib import Path

import mlx.core as mx
import psutil

MIB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def kv_bytes(cache) -> int:
    return sum(c.nbytes for c in cache)


def measure(model, tokens: mx.array, cache, logits: bool) -> dict:
    """Run one step of ``tokens`` [B, T] through ``model`` with ``cache``; its memory figures.

    ``workspace``: MLX's peak of memory in use during the step over what was in
    use before it (``mx.get_peak_memory``; its freed-buffer cache excluded) plus
    the peak of numpy's allocations (the CPU kernel's rows and tiles, traced by
    ``tracemalloc``). Neither is masked by freed memory the process already
    holds, which the resident set (``rss_delta``, beside it) is.
    """
    mx.eval(model(tokens, cache=copy.deepcopy(cache)))  # same shapes once: compiled loops loaded, heap warm
    mx.clear_cache()
    before, active, kv0 = rss(), mx.get_active_memory(), kv_bytes(cache)
    reset_peak()
    mx.reset_peak_memory()
    tracemalloc.start()
    t0 = time.perf_counter()
    out = model(tokens, cache=cache)
    mx.eval([c.state for c in cache] + ([out[:, -1, :]] if logits else []))
    seconds = time.perf_counter() - t0
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    grew = kv_bytes(cache) - kv0  # allocated: mlx-lm grows a cache 256 tokens at a time
    del out
    return {"workspace": mx.get_peak_memory() - active + numpy_peak, "mlx": mx.get_peak_memory() - active,
            "numpy": numpy_peak, "rss_delta": peak() - before, "kv_allocated": grew, "seconds": round(seconds, 2)}


def fill(model, cache, batch: int, tokens: int, step: int = 256) -> None:
    """Put ``tokens`` context tokens (random ids) in ``cache`` for ``batch`` sequences."""
    vocab = model.args.vocab_size
    for i in range(0, tokens, step):
        n = min(step, tokens - i)
        model(mx.random.randint(0, vocab, (batch, n)), cache=cache)
        mx.eval([c.state for c in cache])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--kernel", default="cpu")
    ap.add_argument("--slots", type=int, default=None, help="slots per layer (default: every expert)")
    ap.add_argument("--steps", default="32,128,512")
    ap.add_argument("--contexts", default="0,1024")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--decode-context", type=int, default=200)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()

    from mlx_lm.models.cache import make_prompt_cache

    import mlx_tier
    from mlx_tier.engine.footprint import ModelShape, step_workspace
    from mlx_tier.engine.memory import plan_memory, resident_set

    model, _ = mlx_tier.load(a.model, config=mlx_tier.TierConfig(kernel=a.kernel, slots_per_layer=a.slots,
                                                                 cache_gb=None if a.slots else 1000))
    settings = plan_memory(resident_set(model, 1, 1), "cpu", {})
    mx.set_cache_limit(settings.cache_target)
    config = json.loads((a.model / "config.json").read_text())
    cache0 = model.expert_cache
    inner = config.get("moe_intermediate_size") or config["intermediate_size"]
    top_k = config.get("num_experts_per_tok")
    shape = ModelShape.of_config(config, inner, top_k, cache0.num_experts)
    warm = make_prompt_cache(model)
    fill(model, warm, 1, 64)  # compiles the kernel's loops
    print(f"caliber: {platform.machine()} {platform.system()}, MLX {mx.__version__} CPU backend, model {a.model} "
          f"({shape}), kernel {a.kernel}, slots {a.slots or 'all'}, MLX cache limit "
          f"{settings.cache_target / MIB:.0f} MiB, one run per case, {psutil.cpu_count()} cores, load "
          f"{psutil.getloadavg()[0]:.1f}")
    rows = []
    vocab = model.args.vocab_size
    for ctx in map(int, a.contexts.split(",")):
        for t in map(int, a.steps.split(",")):
            cache = make_prompt_cache(model)
            fill(model, cache, 1, ctx)
            m = measure(model, mx.random.randint(0, vocab, (1, t)), cache, logits=False)
            est = step_workspace(shape, a.kernel, t, ctx + t, 1) + t * shape.kv_per_token
            rows.append({"kind": "prompt", "tokens": t, "context": ctx, "batch": 1, **m, "estimate": est})
            del cache
    for b in map(int, a.batches.split(",")):
        cache = make_prompt_cache(model)
        fill(model, cache, b, a.decode_context)
        m = measure(model, mx.random.randint(0, vocab, (b, 1)), cache, logits=True)
        est = step_workspace(shape, a.kernel, b, a.decode_context + 1, b) + b * shape.kv_per_token
        rows.append({"kind": "decode", "tokens": 1, "context": a.decode_context, "batch": b, **m, "estimate": est})
        del cache
    print(f"{'step':>7} {'T':>5} {'ctx':>5} {'B':>2} {'workspace MiB':>13} {'MLX':>7} {'numpy':>7} {'RSS rise':>8} "
          f"{'estimate MiB':>12} {'meas/est':>8} {'s':>6}")
    for r in rows:
        print(f"{r['kind']:>7} {r['tokens']:>5} {r['context']:>5} {r['batch']:>2} {r['workspace'] / MIB:>13.1f} "
              f"{r['mlx'] / MIB:>7.1f} {r['numpy'] / MIB:>7.1f} {r['rss_delta'] / MIB:>8.1f} "
              f"{r['estimate'] / MIB:>12.1f} {r['workspace'] / r['estimate']:>8.2f} {r['seconds']:>6}")
    if a.json:
        a.json.write_text(json.dumps({"model": str(a.model), "kernel": a.kernel, "shape": str(shape),
                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
