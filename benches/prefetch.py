"""Does prefetching the next layer's experts pay on this machine?

Question (cold path): with prefetch (layer l+1's router applied to
layer l's expert input, predicted experts read in the background while layer
l computes; mlx_tier.engine.prefetch) vs without, what are decode tok/s, the
prediction's precision and recall, and the fraction of decode time the
forward pass stalls on reads? Tiered SmolLM2 demo MoE (8 experts, top-2) at a
few cache sizes, prefetch off and on, all engines in one process and runs
interleaved (so drift and the other load on the machine hit all alike);
greedy decoding, single request, page cache warm, median of N runs with the
spread, and the per-run on/off ratio (paired runs) per cache size.

    python benches/prefetch.py [--runs 5] [--max-tokens 32] [--slots 2 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import psutil
from mlx_lm import stream_generate

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.job.report import backend_name
from mlx_tier.tools.demo_model import ensure_demo_model

PROMPT = "The history of the city of Paris begins"
DELTAS = ("hits", "misses", "bytes_read", "read_seconds", "stall_seconds", "prefetch_predicted",
          "prefetch_used", "prefetch_wasted_bytes")


def measure(model, tokenizer, prompt, max_tokens) -> dict:
    """One greedy generation: TTFT, TPOT (s), tokens, and the cache's decode-phase deltas."""
    cache = model.expert_cache
    t0 = time.perf_counter()
    first = s_first = None
    n = 0
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        n = resp.generation_tokens
        if first is None:
            first = time.perf_counter()
            s_first = cache.stats.as_dict()
    end = time.perf_counter()
    s_end = cache.stats.as_dict()
    d = {k: s_end[k] - s_first[k] for k in DELTAS}
    decode = max(end - first, 1e-9)
    steps = max(n - 1, 1)
    return {
        "ttft": first - t0, "tpot": decode / steps, "tokens": n,
        "hit_rate": d["hits"] / max(d["hits"] + d["misses"], 1),
        "precision": d["prefetch_used"] / d["prefetch_predicted"] if d["prefetch_predicted"] else 0.0,
        "recall": d["prefetch_used"] / d["misses"] if d["misses"] else 0.0,
        "stall_fraction": d["stall_seconds"] / decode,
        "read_fraction": d["read_seconds"] / decode,
        "mib_per_token": d["bytes_read"] / steps / 2**20,
        "wasted_mib_per_token": d["prefetch_wasted_bytes"] / steps / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, nargs="+", default=[2, 4], help="slots per layer to compare at")
    ap.add_argument("--json", action="store_true", help="also print every run as JSON")
    args = ap.parse_args()

    path = ensure_demo_model(print)
    cfg = json.loads((path / "config.json").read_text())
    E = cfg["num_local_experts"]
    engines = {}
    for slots in args.slots:
        for prefetch in (False, True):
            m, tokenizer = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots, prefetch=prefetch,
                                                                          dtype=job_compute_dtype()))
            engines[(slots, prefetch)] = m
    prompt = tokenizer.encode(PROMPT)

    for m in engines.values():  # warm-up: compile, page cache, fill the slots
        measure(m, tokenizer, prompt, 4)
    runs = {key: [] for key in engines}
    for _ in range(args.runs):
        for key, m in engines.items():
            runs[key].append(measure(m, tokenizer, prompt, args.max_tokens))

    ckpt_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    m0 = next(iter(engines.values()))
    layer = m0.expert_cache.layers[0]
    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB (shared with other work: load avg "
          f"{', '.join(f'{x:.1f}' for x in psutil.getloadavg())}); backend {backend_name()}; mlx {mx.__version__}")
    print(f"  model: {path.name}, checkpoint {ckpt_bytes / 2**20:.0f} MiB on disk, {len(m0.expert_cache.layers)} MoE "
          f"layers x {E} experts, top-{cfg['num_experts_per_tok']}, {layer.slot_nbytes / 2**20:.2f} MiB per resident "
          f"expert (float32 compute); fits in memory, page cache warm")
    for slots in args.slots:
        c = engines[(slots, False)].expert_cache
        print(f"  {slots}/{E} slots: {c.resident_bytes / 2**20:.0f} MiB resident experts (same with prefetch on)")
    print(f"  single request, prompt {len(prompt)} tokens, output {args.max_tokens} tokens, greedy, "
          f"{args.runs} runs interleaved after one warm-up each; medians [min-max]; decode phase only")

    print(f"\n{'engine':22} {'tok/s':>18} {'hit rate':>8} {'precision':>9} {'recall':>6} {'stall':>6} "
          f"{'reads':>6} {'MiB/tok':>7} {'wasted':>6}")
    for (slots, prefetch), rs in runs.items():
        tps = sorted(1 / r["tpot"] for r in rs)
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        name = f"{slots}/{E} slots, prefetch {'on' if prefetch else 'off'}"
        print(f"{name:22} {statistics.median(tps):6.2f} [{tps[0]:4.2f}-{tps[-1]:4.2f}] {med['hit_rate']:8.1%} "
              f"{med['precision']:9.1%} {med['recall']:6.1%} {med['stall_fraction']:6.1%} {med['read_fraction']:6.1%} "
              f"{med['mib_per_token']:7.2f} {med['wasted_mib_per_token']:6.2f}")
    print("\nstall: decode time the forward pass blocked on reads; reads: the reads' own wall time "
          "(with prefetch it includes background reads); wasted: prefetched MiB/token never used")
    for slots in args.slots:
        ratios = sorted(off["tpot"] / on["tpot"] for off, on in zip(runs[(slots, False)], runs[(slots, True)]))
        print(f"{slots}/{E} slots: tok/s prefetch on / off, paired runs: median {statistics.median(ratios):.3f} "
              f"[{ratios[0]:.3f}-{ratios[-1]:.3f}]")
    if args.json:
        print(json.dumps({f"{s}/{E} prefetch={p}": rs for (s, p), rs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
