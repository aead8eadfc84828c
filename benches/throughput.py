"""Documents per hour: today's paced schedule against the throughput schedule, side by side.

Question: how many documents per hour does the overnight job summarise with
the throughput schedule (prompt pools of several documents, decode pools of
many sequences, CPU attention: :mod:`mlx_tier.job.pool_engine`) against the
schedule it replaces (one prompt at a time in ~4 s steps, at most 8 sequences
decoding, MLX's attention), on the same documents, model, cache and cap?

How:
- Schedules (``--schedules``): ``paced`` (what ``mlx-tier run`` did before:
  ``schedule="paced"``, MLX's attention, the batch from memory, at most 8);
  ``throughput`` (the job's default now: pools from :mod:`mlx_tier.tools.pools`);
  ``batch1`` (the throughput schedule with one sequence at a time, on the first
  ``--batch1-docs`` documents: the decode cost of a lone sequence);
  ``throughput-mlx-attn`` (the throughput schedule with MLX's attention: what
  the pools alone buy); ``throughput-no-ahead`` (the throughput schedule with
  each round of experts read only when it comes: ``TierConfig.read_ahead``
  off, what overlapping reads with compute buys); ``throughput-kv8`` (the
  throughput schedule with its KV caches at 8 bits, ``run --kv-bits 8``:
  larger pools in the same memory); ``throughput-one-token`` (the throughput
  schedule with the VNNI rows computing one token at a time,
  ``cpu_vnni.TWO_TOKEN`` off: what the two-token step buys);
  ``throughput-prefetch`` (the throughput schedule with ``TierConfig.prefetch``
  on: the next layer's experts predicted and read while a layer computes);
  ``throughput-separate`` (the throughput schedule with prefill and decode
  steps apart, ``pool_engine.MODULE_BATCHING`` off: what decoding the pool
  inside the prefill steps buys; the scheduler prices its pools so, its expert
  cache is chosen as the default's); ``throughput-no-lend`` (no expert slots lent
  to decode steps: ``footprint.LEND_SLOTS`` off); ``throughput-workspace-lend``
  (decode steps borrow the prompt step's idle workspace only, not the KV room no
  sequence holds: ``footprint.LEND_KV_ROOM`` off); ``throughput-b1``,
  ``throughput-b2`` (the throughput schedule with its decode pool fixed at 1 or 2,
  as ``run --batch-size N`` fixes it, the expert cache chosen for it);
  ``throughput-keep``, ``throughput-drop`` (the throughput schedule with its
  expert reads through the page cache, keeping or dropping the pages read,
  where the job reads around it: ``TierConfig.page_cache``,
  :mod:`mlx_tier.policy.reads`). All use the CPU
  expert kernel, greedy with the job's repetition penalty, the job's instruction and the same documents.
- Documents: ``--docs`` pieces of the example documents (examples/docs, cycled)
  of ``--min-tokens`` to ``--max-tokens`` tokens (evenly spread, in a shuffled
  order), summaries of at most ``--summary-tokens``.
- Each run loads and sizes its job as ``mlx-tier run`` does: the CPU kernel
  compiled ahead in a child process of its own
  (:func:`mlx_tier.kernels.warmup.compile_for`: Numba's working memory is not
  the run's), the job's compute dtype, the memory split of the limit it runs
  under (:func:`mlx_tier.engine.sizes.run_budget`) and the prompt step it allows.
- Each run is a fresh process (``--worker``), inside a cgroup v1 memory group
  of ``--cap-gb`` when given (page cache charged: ``benches/capped.py``), the
  checkpoint's pages evicted first under a cap (every run starts cold). Rounds
  interleave the schedules (round r rotated by r), so a load that moves hits
  them alike; the load average is recorded at each run's start and end.
- Per run: wall time, documents/hour, prompt tok/s (prompt tokens over the
  time of the steps that read prompts), generated tok/s and decode seconds per
  generated token (decode steps only), bytes read per token, hit rate, read
  stall, the bytes fetched from storage (Linux: `/proc/self/io`; what the
  page cache served aside), peak RSS, the share of the roofline (the job's time if each
  of its own steps cost only max(what it fetched from storage / read rate, its
  compute / compute rates), rates probed in the run:
  :func:`mlx_tier.tools.pools.probe_rates`; ``roofline_seconds``), and for
  the throughput schedule its pools and predicted documents/hour.
- Resumable: every finished run is appended to ``OUT/runs.jsonl`` at once; the
  same command continues where it stopped (another command's settings are
  refused). ``--report-only`` prints the table from the file.

    python benches/throughput.py --out OUT --slots 3 --docs 8            # the demo, 3/8 slots
    python benches/throughput.py --out OUT --model /path/synth-24 --cache-gb 0.5 --cap-gb 2 --docs 6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
SCHEDULES = ("paced", "throughput", "batch1", "throughput-mlx-attn", "throughput-no-ahead", "throughput-kv8",
             "throughput-one-token", "throughput-prefetch", "throughput-separate", "throughput-no-lend",
             "throughput-workspace-lend", "throughput-b1", "throughput-b2", "throughput-keep", "throughput-drop")


# ------------------------------------------------------------------- documents
def documents(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list:
    """``n`` documents of ``lo``..``hi`` tokens cut from the example documents (cycled)."""
    from mlx_tier.job.documents import Document

    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((HERE.parent / "examples/docs").glob("*.*")))
    ids = tokenizer.encode(text)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    random.Random(seed).shuffle(lengths)
    docs, start = [], 0
    for i, length in enumerate(lengths):
        piece = [ids[(start + j) % len(ids)] for j in range(length)]
        start += 997
        docs.append(Document(f"doc{i:02d}", "", tokenizer.decode(piece)))
    return docs


# ---------------------------------------------------------------------- worker
def worker(spec: dict) -> dict:
    """One run: load, summarise the documents with one schedule, measure."""
    from mlx_lm.utils import load_tokenizer

    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.defaults import (
        DEFAULT_POOL_STEP,
        DEFAULT_PROMPT,
        DEFAULT_REPETITION_PENALTY,
    )
    from mlx_tier.defaults import DEFAULT_PREFILL_STEP as PREFILL_STEP
    from mlx_tier.engine import footprint
    from mlx_tier.engine.checkpoint import context_length
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.engine.sizes import peak_rss, run_budget
    from mlx_tier.job import pool_engine
    from mlx_tier.job.doc_tokens import SAMPLE_DOCS, chars_per_token, predicted_tokens
    from mlx_tier.job.model_setup import FALLBACK_CONTEXT
    from mlx_tier.job.scheduler import GenerationConfig, Scheduler
    from mlx_tier.kernels import cpu_vnni
    from mlx_tier.kernels.warmup import compile_for
    from mlx_tier.tools import pool_cache, pools

    load0 = os.getloadavg()[0]
    sched = spec["schedule"]
    model_dir = Path(spec["model"])
    # As `run` does before its split: a first run in a fresh tree compiled the kernel in
    # this process, and LLVM's memory it kept (~170 MB) shrank the room its pools were planned in.
    t0 = time.perf_counter()
    compile_for(model_dir, "cpu", lambda line: print(line, file=sys.stderr))
    compile_s = time.perf_counter() - t0
    cpu_vnni.TWO_TOKEN = sched != "throughput-one-token"
    pool_engine.MODULE_BATCHING = sched != "throughput-separate"
    footprint.LEND_SLOTS = sched != "throughput-no-lend"
    footprint.LEND_KV_ROOM = sched != "throughput-workspace-lend"
    tier = TierConfig(slots_per_layer=spec.get("slots"), cache_gb=spec.get("cache_gb"), kernel="cpu",
                      attention_kernel=sched not in ("paced", "throughput-mlx-attn"), dtype=job_compute_dtype(),
                      read_ahead=sched != "throughput-no-ahead", prefetch=sched == "throughput-prefetch")
    docs = documents(load_tokenizer(model_dir), spec["docs"], spec["min_tokens"], spec["max_tokens"])
    if sched == "batch1":
        docs = docs[: spec["batch1_docs"]]
    chars = [len(d.text) for d in docs]
    # The job's memory split, as run_job makes it: the cgroup's limit, the prompt step it allows,
    # the expert cache it loads (a throughput run's pools may take slots: tools/pool_cache.py).
    kv_bits = 8 if sched == "throughput-kv8" else None
    budget = run_budget(model_dir, tier, None, PREFILL_STEP if sched == "paced" else DEFAULT_POOL_STEP, kv_bits)
    step = min(PREFILL_STEP, budget.prefill_step) if budget is not None else PREFILL_STEP
    if budget is not None and tier.slots_per_layer is None and tier.cache_gb is None:
        if sched != "paced":
            per = chars_per_token(load_tokenizer(model_dir), [d.text for d in docs])  # run's estimate
            prompt = predicted_tokens(sum(chars) // len(chars), per) + predicted_tokens(len(DEFAULT_PROMPT), per) + 16
            found = pool_cache.cache_for_pools(model_dir, budget, prompt, spec["summary_tokens"], len(docs),
                                               1 if sched == "batch1" else _pool_given(sched))
            budget = pool_cache.with_cache(budget, found[0]) if found else budget
        tier = replace(tier, cache_gb=budget.cache / 2**30)
    tier = replace(tier, page_cache=_page_cache(sched, model_dir, budget))
    t0 = time.perf_counter()
    model, tokenizer = mlx_tier.load(model_dir, config=tier)
    load_s = time.perf_counter() - t0
    gen = GenerationConfig(DEFAULT_PROMPT, spec["summary_tokens"], DEFAULT_REPETITION_PENALTY,
                           schedule="paced" if sched == "paced" else "throughput",
                           batch_size=1 if sched == "batch1" else _pool_given(sched),
                           prefill_batch=1 if sched == "batch1" else None,
                           prefill_step_size=step, kv_bits=kv_bits)
    t0 = time.perf_counter()
    s = Scheduler(model, tokenizer, model_dir, context_length(model_dir, FALLBACK_CONTEXT), gen, max(chars),
                  typical_chars=sum(chars) // len(chars), documents=len(docs), memory=budget,
                  samples=[d.text for d in docs[:SAMPLE_DOCS]])
    setup_s = time.perf_counter() - t0
    model.expert_cache.reset_stats()
    acc = {"prompt_tokens": 0, "prompt_s": 0.0, "generated": 0, "decode_s": 0.0, "steps": 0, "merged": 0}
    # one row a step: [s, prompt tokens, prompts read, generated, merged, misses, stall s, MiB from storage]
    steps_log = []
    last = [model.expert_cache.snapshot(), storage_read_bytes()]
    storage0 = last[1]

    def on_step(info, ids):
        now, io = model.expert_cache.snapshot(), storage_read_bytes()
        d = now - last[0]
        io_mib = round((io - last[1]) / 2**20, 1) if io is not None and last[1] is not None else None
        last[:] = [now, io]
        steps_log.append([round(info.seconds, 3), info.prefill_tokens, len(info.prefill), info.generated,
                          int(info.merged), d.misses, round(d.stall_seconds, 3), io_mib])
        acc["prompt_tokens"] += info.prefill_tokens
        acc["prompt_s"] += info.prefill_seconds
        acc["generated"] += info.generated
        acc["decode_s"] += info.decode_seconds
        acc["merged"] += info.generated if info.merged else 0
        acc["steps"] += 1

    from mlx_tier.engine.memory import model_memory_controls

    t0 = time.perf_counter()
    with model_memory_controls(model, s.context, s.batch_size):  # MLX's buffer cache bounded, as run_job does
        outs = list(s.run(docs, on_step=on_step))
    wall = time.perf_counter() - t0
    storage1 = storage_read_bytes()
    st = model.expert_cache.stats
    tokens = acc["prompt_tokens"] + acc["generated"]
    found = pools.shape_of(model, s.plan.kv_per_token)
    rates = pools.rates_for(model, found[1]) if found else None
    roof_s = roofline_seconds(found[0], rates, steps_log, acc["prompt_tokens"] / max(1, len(outs))) if found else None
    return {
        "schedule": sched, "docs": len(outs), "done": sum(o.status == "done" for o in outs), "wall_s": wall,
        "errors": [o.error for o in outs if o.error], "parts": sum(o.parts for o in outs),
        "compile_s": compile_s, "load_s": load_s, "setup_s": setup_s, "docs_per_hour": len(outs) / wall * 3600,
        "prompt_tok_s": acc["prompt_tokens"] / max(acc["prompt_s"], 1e-9), "prompt_tokens": acc["prompt_tokens"],
        "generated": acc["generated"], "generated_in_prefill_steps": acc["merged"], "gen_tok_s_wall": acc["generated"] / wall,
        "decode_s_per_token": acc["decode_s"] / max(1, acc["generated"]), "steps": acc["steps"],
        "tokens_per_s": tokens / wall, "roofline_s": roof_s, "roofline_share": roof_s / wall if roof_s else None,
        "hit_rate": st.hit_rate, "bytes_read_per_token": st.bytes_read / max(1, tokens), "read_stall_share": st.stall_seconds / wall,
        # the expert bytes the misses read, against what the process fetched from storage (page cache aside)
        "expert_bytes_read": st.bytes_read, "misses": st.misses,
        "storage_read_bytes": storage1 - storage0 if storage0 is not None and storage1 is not None else None,
        "page_cache": model.expert_cache.store.page_cache,
        "slots_per_layer": model.expert_cache.slots_per_layer, "cache_gib": model.expert_cache.budget_bytes / 2**30,
        "decode_slots": s.info.get("decode_slots"), "cache_lent_at_end": model.expert_cache.lent,
        "batch_size": s.batch_size, "pool_tokens": s.pool_tokens if sched != "paced" else None,
        "prefill_batch": s.prefill_batch if sched != "paced" else None,
        "pools": s.pools.as_dict() if s.pools is not None else None,
        "rates": rates.as_dict() if rates else None,
        # the memory the pools were planned in: the split's shares, the room the plan found, the KV room
        "memory_mib": {k: round(v / 2**20, 1) for k, v in (
            [(f, getattr(budget, f)) for f in ("total", "cache", "kv", "workspace", "margin")] if budget else [])
            + [("plan_free", s.plan.free_bytes), ("kv_room", s._kv_room)]},
        "summaries": {o.id: o.summary for o in outs}, "peak_rss": peak_rss(), "load_start": load0, "load_end": os.getloadavg()[0],
        "steps_log": steps_log,
    }


def _page_cache(sched: str, model_dir: Path, budget) -> str:
    """What a schedule's expert reads do to the page cache (``TierConfig.page_cache``): as
    the job chooses (:func:`mlx_tier.job.model_setup.read_mode`), but ``throughput-keep``
    keeps the pages and ``throughput-drop`` drops those it read."""
    from mlx_tier.job.model_setup import read_mode

    if sched in ("throughput-keep", "throughput-drop"):
        return sched.removeprefix("throughput-")
    if budget is None:
        return "keep"
    return read_mode(model_dir, budget, "paced" if sched == "paced" else "throughput",
                     lambda line: print(line, file=sys.stderr))


def _pool_given(sched: str) -> int | None:
    """The decode pool a ``throughput-bN`` schedule fixes (``run --batch-size N``, N >= 1),
    else ``None``."""
    n = sched.removeprefix("throughput-b")
    return int(n) if n != sched and n.isdigit() and int(n) >= 1 else None


def roofline_seconds(shape, rates, steps_log: list, prompt_tokens: float) -> float:
    """The job's time at the roofline of its own steps: each logged step costs the larger of
    its compute at the probed rates (experts, dense layers, attention:
    :func:`mlx_tier.tools.pools.layer_step_seconds` with the fixed costs at 0) and what it
    fetched from storage at the probed read rate (the step log's MiB from storage: a miss
    the page cache served costs no read; a step logged without them prices its reads as
    the pool model does: every miss from storage, less what read ahead overlaps with
    compute). A prefill step's rows are its prompt tokens and the tokens decoded in it
    (module batching), of its prompts and riding sequences.

    Args:
        shape, rates: :func:`mlx_tier.tools.pools.shape_of`'s shape, the run's probed rates.
        steps_log: the run's rows ``[s, prompt tokens, prompts, generated, merged, misses,
            stall s, MiB from storage]`` (the last may be missing or ``None``).
        prompt_tokens: a document's mean prompt tokens (a prompt token's mean context is half).

    Returns:
        Seconds.
    """
    from dataclasses import replace

    from mlx_tier.tools import pools

    bare = replace(rates, overhead_s=0.0, per_expert_s=0.0)
    total = 0.0
    for row in steps_log:
        prompt, prompts, generated = row[1], row[2], row[3]
        rows = prompt + generated
        if rows == 0:
            continue
        if prompt:
            parts = pools.layer_step_seconds(shape, bare, rows, prompt_tokens / 2, max(1, prompts) + generated)
        else:
            parts = pools.layer_step_seconds(shape, bare, rows, prompt_tokens)
        compute = shape.layers * (parts["expert"] + parts["dense"] + parts["attn"])
        mib = row[7] if len(row) > 7 else None
        read = mib * 2**20 / (max(rates.disk_gbps, 1e-3) * 1e9) if mib is not None else shape.layers * parts["read"]
        total += max(compute, read)
    return total


# ------------------------------------------------------------------ the driver
def fingerprint(args) -> dict:
    keys = ("model", "slots", "cache_gb", "cap_gb", "docs", "min_tokens", "max_tokens", "summary_tokens",
            "batch1_docs", "schedules", "rounds")
    return {k: getattr(args, k) if k != "model" else str(args.model) for k in keys}


def plan(args) -> list[tuple[int, str]]:
    scheds = args.schedules.split(",")
    return [(r, scheds[(i + r) % len(scheds)]) for r in range(args.rounds) for i in range(len(scheds))]


def run_one(args, schedule: str) -> dict:
    spec = {"schedule": schedule, "model": str(args.model), "slots": args.slots, "cache_gb": args.cache_gb,
            "docs": args.docs, "min_tokens": args.min_tokens, "max_tokens": args.max_tokens,
            "summary_tokens": args.summary_tokens, "batch1_docs": args.batch1_docs}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    files = sorted(Path(args.model).glob("*.safetensors"))
    if args.cap_gb:
        sys.path.insert(0, str(HERE))
        from capped import MemoryCgroup
        from pagecache import drop_pages

        drop_pages(files)
        with MemoryCgroup(int(args.cap_gb * 2**30), f"throughput-bench-{os.getpid()}") as cg:
            p = subprocess.run(cg.wrap(cmd), capture_output=True, text=True)
            extra = {"cgroup_peak": cg.read("memory.max_usage_in_bytes"), "oom_kills": cg.oom_kills()}
    else:
        p = subprocess.run(cmd, capture_output=True, text=True)
        extra = {}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"schedule": schedule, "failed": True, "returncode": p.returncode, "stderr": p.stderr[-2000:], **extra}
    return {**json.loads(lines[-1]), **extra}


def caliber(args) -> dict:
    disk = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors"))
    return {"machine": f"{platform.machine()} {psutil.cpu_count()} cores "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "model": str(args.model),
            "model_gib": round(disk / 2**30, 2), "cache": f"{args.slots} slots/layer" if args.slots
            else f"{args.cache_gb} GiB" if args.cache_gb else "as `run` sizes it (runs.jsonl: slots_per_layer)", "cap_gib": args.cap_gb or "none", "docs": args.docs,
            "doc_tokens": f"{args.min_tokens}-{args.max_tokens}", "summary_tokens": args.summary_tokens,
            "decoding": "greedy, repetition penalty 1.1 (the job's default)", "kernel": "cpu",
            "page_cache": "cold each run (evicted)" if args.cap_gb else "warm", "rounds": args.rounds}


def _med(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def storage_read_bytes() -> int | None:
    """Bytes this process has caused to be fetched from storage (``read_bytes`` of Linux's
    ``/proc/self/io``: reads served from the page cache not counted), or ``None`` where
    the file is missing or unreadable."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def step_kinds(run: dict) -> list[str]:
    """Lines on a run's steps by kind (prompt only, prompt with decoded tokens riding, decode
    only): count, seconds, tokens, misses a step; and a least-squares fit of a prompt
    step's seconds on its prompt tokens, riding tokens and misses (what a riding token
    adds to the step carrying it). Empty for a run recorded without a step log."""
    log = run.get("steps_log")
    if not log:
        return []
    kinds = {"prompt only": lambda r: r[1] > 0 and r[3] == 0, "prompt + riding": lambda r: r[1] > 0 and r[3] > 0,
             "decode only": lambda r: r[1] == 0}
    lines = []
    for name, test in kinds.items():
        rows = [r for r in log if test(r)]
        if rows:
            lines.append(f"  {name:<15} {len(rows):4d} steps {sum(r[0] for r in rows):7.1f} s, "
                         f"{sum(r[0] for r in rows) / len(rows):5.2f} s a step, prompt {sum(r[1] for r in rows):6d}, "
                         f"generated {sum(r[3] for r in rows):4d}, misses a step {statistics.mean(r[5] for r in rows):5.0f}"
                         + storage_share(run, rows))
    prompt = [r for r in log if r[1] > 0]
    if len(prompt) >= 5 and any(r[3] for r in prompt):
        import numpy as np

        a = np.array([[1.0, r[1], r[3], r[5]] for r in prompt])
        c, *_ = np.linalg.lstsq(a, np.array([r[0] for r in prompt]), rcond=None)
        lines.append(f"  prompt step fit: {c[0]:.2f} s + {c[1] * 1e3:.1f} ms a prompt token + {c[2]:.3f} s a riding "
                     f"token + {c[3] * 1e3:.1f} ms a miss")
    return lines


def storage_share(run: dict, rows: list) -> str:
    """", from storage N%": the share of these steps' missed expert bytes the process
    fetched from storage (the rest came from the page cache; prompt steps also read
    their KV and activations, a few MiB), or "" for a run recorded without it."""
    if not rows or any(len(r) < 8 or r[7] is None for r in rows) or not run.get("misses"):
        return ""
    per_miss = run["expert_bytes_read"] / run["misses"]
    missed = sum(r[5] for r in rows) * per_miss
    return f", from storage {sum(r[7] for r in rows) * 2**20 / missed:4.0%}" if missed else ""


def report(out: Path) -> None:
    meta = json.loads((out / "plan.json").read_text())
    runs = [json.loads(ln) for ln in (out / "runs.jsonl").read_text().splitlines() if ln.strip()]
    print("caliber:", json.dumps(meta["caliber"]))
    by = {}
    for r in runs:
        if not r.get("failed"):
            by.setdefault(r["schedule"], []).append(r)
    print(f"\n{'schedule':<20} {'runs':>4} {'docs/h':>8} {'prompt t/s':>10} {'dec s/tok':>9} {'gen t/s':>8} "
          f"{'MiB/tok':>8} {'hit':>6} {'roof':>6} {'pred d/h':>8} {'load':>9}")
    for name, rs in by.items():
        pred = _med([r["pools"] for r in rs if r.get("pools")], "docs_per_hour") if any(r.get("pools") for r in rs) \
            else None
        share = _med(rs, "roofline_share")
        print(f"{name:<20} {len(rs):>4} {_med(rs, 'docs_per_hour'):8.1f} {_med(rs, 'prompt_tok_s'):10.2f} "
              f"{_med(rs, 'decode_s_per_token'):9.3f} {_med(rs, 'gen_tok_s_wall'):8.2f} "
              f"{_med(rs, 'bytes_read_per_token') / 2**20:8.2f} {_med(rs, 'hit_rate'):6.1%} "
              f"{(share or 0):6.1%} {pred if pred is not None else float('nan'):8.1f} "
              f"{min(r['load_start'] for r in rs):4.1f}-{max(r['load_end'] for r in rs):4.1f}")
    for r in runs:
        if r.get("failed"):
            print(f"FAILED {r['schedule']}: rc {r['returncode']} {r.get('stderr', '')[-300:]}")
    for r in runs:
        if lines := step_kinds(r):
            print(f"\nsteps of {r['schedule']} (round {r['round']}):", *lines, sep="\n")
    base, new, one = by.get("paced"), by.get("throughput"), by.get("batch1")
    if base and new:
        print(f"\nthroughput / paced: documents/hour {_med(new, 'docs_per_hour') / _med(base, 'docs_per_hour'):.2f}x, "
              f"prompt reading {_med(new, 'prompt_tok_s') / _med(base, 'prompt_tok_s'):.2f}x, decode cost per "
              f"token {_med(new, 'decode_s_per_token') / _med(base, 'decode_s_per_token'):.2f}x")
        same = [a["summaries"] == b["summaries"] for a in base for b in new]
        print(f"summaries identical between the schedules: {sum(same)}/{len(same)} pairs of runs")
    if new and one:
        print(f"decode cost per generated token at the chosen pool / batch 1: "
              f"{_med(new, 'decode_s_per_token') / _med(one, 'decode_s_per_token'):.3f}")
    if new and any(r.get("pools") for r in new):
        for r in new:
            p = r["pools"]
            print(f"predicted {p['docs_per_hour']:.1f} docs/h, achieved {r['docs_per_hour']:.1f} "
                  f"(achieved / predicted {r['docs_per_hour'] / p['docs_per_hour']:.2f}); pools: prefill "
                  f"{r['pool_tokens']} tokens x {r['prefill_batch']} prompts, decode {r['batch_size']}; "
                  f"{r.get('slots_per_layer')} slots per layer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the demo model)")
    ap.add_argument("--slots", type=int, default=None, help="expert slots per layer")
    ap.add_argument("--cache-gb", type=float, default=None)
    ap.add_argument("--cap-gb", type=float, default=0.0, help="cgroup v1 memory cap, GiB (0: none)")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--summary-tokens", type=int, default=64)
    ap.add_argument("--batch1-docs", type=int, default=3)
    ap.add_argument("--schedules", default="paced,throughput,batch1")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    unknown = [s for s in args.schedules.split(",") if s not in SCHEDULES]
    if unknown and not args.report_only:
        ap.error(f"unknown schedule {', '.join(unknown)}; one of {', '.join(SCHEDULES)}")
    if args.report_only:
        report(args.out)
        return
    if args.model is None:
        from mlx_tier.tools.demo_model import ensure_demo_model

        args.model = ensure_demo_model()
    args.out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(args)
    meta_file, runs_file = args.out / "plan.json", args.out / "runs.jsonl"
    if meta_file.exists() and json.loads(meta_file.read_text())["fingerprint"] != fp:
        sys.exit(f"{args.out} holds runs of other settings: {json.loads(meta_file.read_text())['fingerprint']}")
    meta_file.write_text(json.dumps({"fingerprint": fp, "caliber": caliber(args)}, indent=1))
    done = [json.loads(ln) for ln in runs_file.read_text().splitlines()] if runs_file.exists() else []
    todo = plan(args)[len(done):]
    print(f"{len(done)} runs recorded, {len(todo)} to go", flush=True)
    for r, sched in todo:
        t0 = time.time()
        run = {"round": r, **run_one(args, sched), "started": t0}
        with runs_file.open("a") as f:
            f.write(json.dumps(run) + "\n")
        print(f"round {r} {sched}: {run.get('docs_per_hour', 'FAILED')} docs/h, {time.time() - t0:.0f} s, "
              f"load {run.get('load_start')}-{run.get('load_end')}", flush=True)
    report(args.out)


if __name__ == "__main__":
    main()
