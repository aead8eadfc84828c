"""Prompt reading in steps bounded in time vs a fixed token count, on the tiered demo MoE.

Question: with steps paced to about ``--step-seconds`` (the default engine), how
long is the longest step — the wait before progress moves, the throttle acts or
Ctrl-C is seen — and what does pacing cost in total prompt-reading time against
fixed ``--prefill-step`` token steps?

    python benches/prefill_pacing.py [--tokens 256] [--prefill-step 512] [--slots 3]
                                     [--step-seconds 4] [--runs 1]

One prompt of ``--tokens`` tokens (the example documents, concatenated) is
read by :class:`mlx_tier.job.batch_engine.BatchEngine` twice per run — paced, and
fixed (``step_seconds=None``: every step is ``--prefill-step`` tokens) — on one model load, alternating which goes first. Page cache warm.
Prints the caliber, each run, and the ratios paced / fixed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import psutil

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.job.batch_engine import BatchEngine, Task, stop_token_ids
from mlx_tier.job.report import backend_name
from mlx_tier.tools.demo_model import ensure_demo_model


def read_prompt(model, tokenizer, prompt: list[int], prefill_step: int, step_seconds: float | None) -> dict:
    engine = BatchEngine(model, tokenizer, stop_token_ids(tokenizer), prefill_step_size=prefill_step,
                         step_seconds=step_seconds)
    engine.add(Task("doc", prompt, 1))
    steps, t0 = [], time.perf_counter()
    while engine.active:
        info = engine.step()
        if info.prefill_tokens:
            steps.append((info.prefill_tokens, info.seconds))
    total = time.perf_counter() - t0
    engine.close()
    return {"total_s": total, "steps": len(steps), "max_step_s": max(s for _, s in steps),
            "tokens_per_step": [n for n, _ in steps]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--slots", type=int, default=3, help="expert slots per layer (of 8)")
    ap.add_argument("--step-seconds", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()

    model_dir = ensure_demo_model()
    config = TierConfig(slots_per_layer=args.slots, dtype=job_compute_dtype())  # as mlx-tier run computes
    model, tokenizer = mlx_tier.load(model_dir, config=config)
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted(Path("examples/docs").glob("*.*")))
    prompt = tokenizer.encode(text)[: args.tokens]
    print(f"caliber: {platform.platform()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} "
          f"GiB, MLX {backend_name()} backend; demo MoE (SmolLM2-135M, 8 experts x 30 layers, 4-bit), "
          f"{args.slots} of 8 slots per layer; one prompt of {len(prompt)} tokens, single request; page cache warm; "
          f"{args.runs} run(s); load average at start {os.getloadavg()[0]:.1f}")
    ratios_total, ratios_max = [], []
    for run in range(args.runs):
        order = [("paced", args.step_seconds), ("fixed", None)]
        results = {}
        for name, seconds in (order if run % 2 == 0 else order[::-1]):
            results[name] = read_prompt(model, tokenizer, prompt, args.prefill_step, seconds)
        p, f = results["paced"], results["fixed"]
        print(f"run {run + 1}: paced {p['total_s']:.1f} s in {p['steps']} steps (longest {p['max_step_s']:.1f} s, "
              f"tokens per step {p['tokens_per_step']}); fixed {f['total_s']:.1f} s in {f['steps']} steps "
              f"(longest {f['max_step_s']:.1f} s); load average now {os.getloadavg()[0]:.1f}")
        ratios_total.append(p["total_s"] / f["total_s"])
        ratios_max.append(p["max_step_s"] / f["max_step_s"])
    print(f"paced / fixed: total prompt-reading time {statistics.median(ratios_total):.2f}x, "
          f"longest step {statistics.median(ratios_max):.2f}x (medians of {args.runs})")


if __name__ == "__main__":
    main()
