"""Throughput of batched summarisation vs batch size, on the tiered SmolLM2 demo MoE.

Question: how many documents per hour, and how many generated tokens per
second over the whole run, for batch sizes 1, 2, 4, 8 with a cache smaller
than the experts — and how many bytes are read from disk per generated token?
Also: what does reusing the shared instruction prefix's KV cache save?

    python benches/batch_throughput.py [--batches 1,2,4,8] [--docs 8] [--chars 400]
                                       [--max-tokens 32] [--slots 3] [--runs 1]

Each configuration runs the same documents (the first ``--chars`` characters
of each file in examples/docs, cycled to ``--docs`` documents) through
:class:`mlx_tier.job.scheduler.Scheduler`, greedy, repetition penalty 1.1, the
same model load (cache counters reset between runs). The page cache is warm
(the checkpoint was just read). Prints the caliber and ratios to batch 1.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import psutil

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.defaults import DEFAULT_PROMPT
from mlx_tier.engine.checkpoint import context_length
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.job.documents import Document
from mlx_tier.job.model_setup import FALLBACK_CONTEXT
from mlx_tier.job.report import backend_name
from mlx_tier.job.scheduler import GenerationConfig, Scheduler
from mlx_tier.tools.demo_model import ensure_demo_model


def documents(n: int, chars: int) -> list[Document]:
    files = sorted(Path(__file__).parent.parent.joinpath("examples/docs").glob("*.*"))
    texts = [f.read_text(encoding="utf-8")[:chars] for f in files]
    return [Document(f"doc{i}", "", texts[i % len(texts)]) for i in range(n)]


def one_run(model, tokenizer, model_dir, docs, batch: int, max_tokens: int, reuse_prefix: bool = True) -> dict:
    cache = model.expert_cache
    cache.reset_stats()
    config = GenerationConfig(DEFAULT_PROMPT, max_tokens, 1.1, batch_size=batch, reuse_prefix=reuse_prefix)
    sched = Scheduler(model, tokenizer, model_dir, context_length(model_dir, FALLBACK_CONTEXT), config)
    first_token, decode_s, prefill_s = None, 0.0, 0.0
    t0 = time.perf_counter()

    def on_step(info, ids):
        nonlocal first_token, decode_s, prefill_s
        if info.generated and first_token is None:
            first_token = time.perf_counter() - t0
        # A step that produced tokens is a decode step (it may carry a
        # prefill step of a newcomer too); the others are prefill only.
        if info.generated:
            decode_s += info.seconds
        else:
            prefill_s += info.seconds

    outs = list(sched.run(docs, on_step=on_step))
    wall = time.perf_counter() - t0
    tokens = sum(o.output_tokens for o in outs)
    stats = cache.stats
    return {
        "batch": batch,
        "reuse_prefix": reuse_prefix,
        "docs_done": sum(o.status == "done" for o in outs),
        "wall_s": wall,
        "docs_per_hour": len(outs) / wall * 3600,
        "tok_per_s": tokens / wall,
        "generated_tokens": tokens,
        "decode_step_s": decode_s,
        "prefill_only_s": prefill_s,
        "ttft_s": first_token,
        "hit_rate": stats.hit_rate,
        "bytes_read_per_token": stats.bytes_read / max(1, tokens),
        "io_wait_fraction": stats.stall_seconds / wall,  # time the forward pass waited on reads
        "summaries": {o.id: o.summary for o in outs},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--chars", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=3, help="expert slots per layer (of 8)")
    ap.add_argument("--runs", type=int, default=1, help="runs per configuration (median reported)")
    ap.add_argument("--json", type=Path, help="also write all results here")
    args = ap.parse_args()

    model_dir = ensure_demo_model()
    config = TierConfig(slots_per_layer=args.slots, dtype=job_compute_dtype())  # as mlx-tier run computes
    model, tokenizer = mlx_tier.load(model_dir, config=config)
    docs = documents(args.docs, args.chars)
    batches = [int(b) for b in args.batches.split(",")]
    disk = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    print("caliber:", json.dumps({
        "machine": f"{platform.machine()} {psutil.cpu_count()} cores {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "backend": backend_name(), "model": f"SmolLM2 demo MoE, 8 experts top-2, {disk / 2**20:.0f} MiB on disk (fits)",
        "cache": f"{args.slots}/8 slots per layer", "docs": args.docs, "prompt_chars": args.chars,
        "max_tokens": args.max_tokens, "greedy": "argmax + repetition penalty 1.1", "page_cache": "warm",
        "runs": args.runs,
    }))
    rows = []
    configs = [(b, True) for b in batches] + [(batches[0], False)]  # last: prefix reuse off, for its saving
    for b, reuse in configs:
        runs = [one_run(model, tokenizer, model_dir, docs, b, args.max_tokens, reuse) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "docs_per_hour", "tok_per_s",
                                                                   "bytes_read_per_token", "io_wait_fraction",
                                                                   "hit_rate", "decode_step_s", "prefill_only_s")}
        rows.append({**runs[0], **med})
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()
                          if k != "summaries"}), flush=True)
    base = rows[0]
    print(f"\n{'batch':>5} {'docs/h':>8} {'tok/s':>7} {'x b1':>6} {'hit':>6} {'MiB/tok':>8} {'io wait':>8}")
    for r in rows[:-1]:
        print(f"{r['batch']:>5} {r['docs_per_hour']:8.1f} {r['tok_per_s']:7.2f} {r['tok_per_s'] / base['tok_per_s']:6.2f} "
              f"{r['hit_rate']:6.1%} {r['bytes_read_per_token'] / 2**20:8.1f} {r['io_wait_fraction']:8.1%}")
    off = rows[-1]
    print(f"\nshared prefix reuse at batch {off['batch']}: wall {base['wall_s']:.1f} s with, {off['wall_s']:.1f} s "
          f"without ({(off['wall_s'] - base['wall_s']) / args.docs:+.2f} s per document saved)")
    same = all(r["summaries"] == base["summaries"] for r in rows)
    print(f"summaries identical across batch sizes and prefix reuse: {same}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
