"""Decode speed of the tiered SmolLM2 demo MoE vs plain mlx-lm, side by side.

Question: what does tiering cost, with every expert resident and with a cache
of 2 of 8 experts per layer? Three engines on the same checkpoint in one
process, runs interleaved (plain, tiered all slots, tiered 2 slots) so drift
hits all alike; greedy decoding, single request, median of N runs.

    python benches/decode_speed.py [--runs 9] [--prompt-tokens ~] [--max-tokens 32]

Prints the caliber (DESIGN.md "Measuring") and ratios to plain mlx-lm.
The page cache is warm (the checkpoint was just read); no cold-cache figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
import psutil
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.demo_model import ensure_demo_model
from mlx_tier.jobs import backend_name

PROMPT = "The history of the city of Paris begins"


def measure(model, tokenizer, prompt, max_tokens, stats=None):
    # `stats`: the model's ExpertCache, or None for plain mlx-lm.
    """One greedy generation: TTFT (s), TPOT (s), tokens, and cache deltas in decode."""
    t0 = time.perf_counter()
    first = None
    s_first = None
    n = 0
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        n = resp.generation_tokens
        if first is None:
            first = time.perf_counter()
            s_first = stats.stats.as_dict() if stats is not None else None
    end = time.perf_counter()
    out = {"ttft": first - t0, "tpot": (end - first) / max(n - 1, 1), "tokens": n, "total": end - t0}
    if stats is not None:
        s_end = stats.stats.as_dict()
        d = {k: s_end[k] - s_first[k] for k in ("hits", "misses", "bytes_read", "stall_seconds")}
        out["hit_rate"] = d["hits"] / max(d["hits"] + d["misses"], 1)
        out["bytes_per_token"] = d["bytes_read"] / max(n - 1, 1)
        out["io_fraction"] = d["stall_seconds"] / max(end - first, 1e-9)  # time the forward pass waited on reads
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=2, help="slots per layer of the small cache")
    ap.add_argument("--json", action="store_true", help="also print the raw medians as JSON")
    args = ap.parse_args()

    path = ensure_demo_model(print)
    plain, tokenizer = mlx_load(str(path))
    plain.set_dtype(mx.float32)  # the tiered model's compute dtype on the CPU backend
    engines = {"mlx-lm (all resident)": (plain, None)}
    cfg = json.loads((path / "config.json").read_text())
    E = cfg["num_local_experts"]
    for slots in (E, args.slots):
        m, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots))
        engines[f"mlx-tier {slots}/{E} slots"] = (m, m.expert_cache)
    prompt = tokenizer.encode(PROMPT)

    for name, (m, stats) in engines.items():  # warm-up: compile, fill caches
        measure(m, tokenizer, prompt, 4, stats)
    runs = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, (m, stats) in engines.items():
            runs[name].append(measure(m, tokenizer, prompt, args.max_tokens, stats))

    ckpt_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; backend {backend_name()}; mlx {mx.__version__}")
    print(f"  model: {path.name}, checkpoint {ckpt_bytes / 2**20:.0f} MiB on disk (fits in memory: "
          f"this measures tiering overhead, not a model larger than memory)")
    for name, (m, stats) in engines.items():
        if stats is not None:
            c = m.expert_cache
            print(f"  {name}: cache {c.resident_bytes / 2**20:.0f} MiB resident experts (compute dtype float32)")
    print(f"  single request, prompt {len(prompt)} tokens, output {args.max_tokens} tokens, greedy, "
          f"page cache warm, {args.runs} runs, medians")
    base = statistics.median(r["tpot"] for r in runs["mlx-lm (all resident)"])
    medians = {}
    print(f"\n{'engine':28} {'TTFT s':>8} {'TPOT ms':>8} {'tok/s':>7} {'vs mlx-lm':>9} {'hit rate':>8} "
          f"{'MiB/tok':>8} {'I/O wait':>8}")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        medians[name] = med
        extra = (f"{med['hit_rate']:8.1%} {med['bytes_per_token'] / 2**20:8.2f} {med['io_fraction']:8.1%}"
                 if "hit_rate" in med else f"{'-':>8} {'-':>8} {'-':>8}")
        print(f"{name:28} {med['ttft']:8.2f} {med['tpot'] * 1e3:8.1f} {1 / med['tpot']:7.2f} "
              f"{base / med['tpot']:9.2f} {extra}")
    if args.json:
        print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
