"""Decode speed of the tiered SmolLM2 demo MoE vs plain mlx-lm, side by side.

Question: what does tiering cost, with every expert resident and with a cache
of 2 of 8 experts per layer, and what does the CPU expert kernel
(``TierConfig(kernel="cpu")``, dense quantized layers served too) gain over
MLX's CPU ops? Engines on the same checkpoint in one process, runs
interleaved (plain, then tiered at all slots and at 2 slots with each
kernel) so drift hits all alike; greedy decoding, single request, median of
N runs. Then prompt reading: TTFT of a longer prompt (an example document).
For the cpu-kernel engines the decode time is split into expert kernel,
dense quantized layers (kernel) and the rest (MLX: attention, norms, ...).

    python benches/decode_speed.py [--runs 9] [--max-tokens 32] [--prompt-runs 1]

Prints the caliber (docs/architecture.md "Measuring"), the load average, and ratios to
plain mlx-lm. The page cache is warm (the checkpoint was just read).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import psutil
from mlx_lm import load as mlx_load
from mlx_lm import stream_generate

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.engine.load import TieredExperts
from mlx_tier.job.report import backend_name
from mlx_tier.kernels import cpu_dense
from mlx_tier.tools.demo_model import ensure_demo_model

PROMPT = "The history of the city of Paris begins"
DOCUMENT = Path(__file__).resolve().parent.parent / "examples" / "docs" / "constitution_preamble_and_article_1.txt"


class Split:
    """Seconds spent in the CPU kernel's expert and dense calls (bench-only wrappers)."""

    def __init__(self):
        self.experts = self.dense = 0.0

    def wrap_experts(self, model):
        for _, w in model.named_modules():
            if isinstance(w, TieredExperts):
                w._kernel = self._timed(w._kernel, "experts")

    def _timed(self, fn, field):
        def run(*a):
            mx.eval([x for x in a if isinstance(x, mx.array)])  # MLX's pending work is "the rest"
            t = time.perf_counter()
            out = fn(*a)
            setattr(self, field, getattr(self, field) + time.perf_counter() - t)
            return out
        return run


SPLIT = Split()
cpu_dense.quantized_matmul = SPLIT._timed(cpu_dense.quantized_matmul, "dense")


def measure(model, tokenizer, prompt, max_tokens, stats=None):
    # `stats`: the model's ExpertCache, or None for plain mlx-lm.
    """One greedy generation: TTFT (s), TPOT (s), tokens, cache deltas in decode, kernel split."""
    SPLIT.experts = SPLIT.dense = 0.0
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
    out = {"ttft": first - t0, "tpot": (end - first) / max(n - 1, 1), "tokens": n, "total": end - t0,
           "experts": SPLIT.experts / (end - t0), "dense": SPLIT.dense / (end - t0)}
    if stats is not None:
        s_end = stats.stats.as_dict()
        d = {k: s_end[k] - s_first[k] for k in ("hits", "misses", "bytes_read", "stall_seconds")}
        out["hit_rate"] = d["hits"] / max(d["hits"] + d["misses"], 1)
        out["bytes_per_token"] = d["bytes_read"] / max(n - 1, 1)
        out["io_fraction"] = d["stall_seconds"] / max(end - first, 1e-9)  # time the forward pass waited on reads
    return out


def load_avg() -> str:
    return "{:.1f} {:.1f} {:.1f}".format(*os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=2, help="slots per layer of the small cache")
    ap.add_argument("--kernels", default="mlx,cpu", help="expert kernels of the tiered engines, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="length of the prompt-reading test")
    ap.add_argument("--prompt-runs", type=int, default=1, help="runs of the prompt-reading test (MLX: ~1 min each)")
    ap.add_argument("--json", action="store_true", help="also print the raw medians as JSON")
    args = ap.parse_args()

    path = ensure_demo_model(print)
    plain, tokenizer = mlx_load(str(path))
    plain.set_dtype(mx.float32)  # as the tiered engines compute here (job_compute_dtype)
    engines = {"mlx-lm (all resident)": (plain, None)}
    cfg = json.loads((path / "config.json").read_text())
    E = cfg["num_local_experts"]
    for slots in (E, args.slots):
        for kernel in args.kernels.split(","):
            config = TierConfig(slots_per_layer=slots, kernel=kernel, dtype=job_compute_dtype())
            m, _ = mlx_tier.load(path, config=config)
            if kernel == "cpu":
                SPLIT.wrap_experts(m)
            engines[f"mlx-tier {slots}/{E} {kernel}"] = (m, m.expert_cache)
    prompt = tokenizer.encode(PROMPT)
    doc = tokenizer.encode(DOCUMENT.read_text())[: args.prompt_tokens]

    for name, (m, stats) in engines.items():  # warm-up: compile, fill caches
        measure(m, tokenizer, prompt, 4, stats)
    runs = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, (m, stats) in engines.items():
            runs[name].append(measure(m, tokenizer, prompt, args.max_tokens, stats))
    decode_load = load_avg()
    reading = {name: [] for name in engines}
    for _ in range(args.prompt_runs):
        for name, (m, stats) in engines.items():
            reading[name].append(measure(m, tokenizer, doc, 1, stats)["ttft"])
    reading_load = load_avg()

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
          f"page cache warm, {args.runs} runs, medians; load average {decode_load}")
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
    print("\ncpu-kernel engines, share of generation time (prompt + decode):")
    for name, med in medians.items():
        if med.get("experts"):
            rest = 1 - med["experts"] - med["dense"]
            print(f"  {name:26} experts {med['experts']:5.1%}  dense quantized {med['dense']:5.1%}  "
                  f"rest (MLX: attention, norms, router, sampling) {rest:5.1%}")
    print(f"\nprompt reading: {len(doc)}-token prompt ({DOCUMENT.name}), TTFT, median of {args.prompt_runs}; "
          f"load average {reading_load}")
    base = statistics.median(reading["mlx-lm (all resident)"])
    for name, ts in reading.items():
        t = statistics.median(ts)
        print(f"  {name:28} {t:7.2f} s {len(doc) / t:7.1f} tok/s {base / t:6.2f}x")
    if args.json:
        print(json.dumps(medians, indent=2))


if __name__ == "__main__":
    main()
