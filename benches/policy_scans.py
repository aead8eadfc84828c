"""Is the default cache policy scan-resistant, and does it keep what it gains on trained-like routing?

Question: LFU with dynamic aging (``lfu``, the default until 2026-12) misses
every access on a loop over 1.1x the cache and lets short bursts of scanned
experts flush a hot set; W-TinyLFU (``tinylfu``) should not, while staying at
least as good as ``lfu`` on trained-like routing. Every trace is replayed at
25/50/75% of the experts per layer through the live cache's own policy objects
(:func:`mlx_tier.routing.simulate.simulate`, what ``mlx-tier trace-sim``
runs), with Belady's optimum as the ceiling.

Traces (all seeded, deterministic):
* trained-like, as benches/trained_routing.py: ``mixtral_like()`` (32x8,
  top-2, 2000 tokens, seed 0) and ``qwen3_like(8, stick)`` (8x128, top-8,
  1000 tokens, seed 1) for stick 0.1 / 0.3 / 0.5
  (:mod:`mlx_tier.routing.synthetic`, statistics of published routers);
* cyclic: :func:`mlx_tier.routing.synthetic.cyclic`, a loop over
  round(1.1 x the cache) experts (128 experts, top-8; and 1024, top-1), one
  trace per cache size;
* hot plus scan: :func:`mlx_tier.routing.synthetic.hot_and_scan`, a hot set
  of 0.8 x the cache used in turn plus scan bursts (128 experts, top-8:
  share 0.6, burst 4, width 4; 1024 experts, top-1: hot 0.78 x the cache,
  share 0.12, burst 3, width 1), one trace per cache size;
* optionally (``--demo``) the demo MoE's recorded routing on examples/docs
  (prefill and decode; benches/policy_targets.py records and caches it).

``--save DIR`` writes every trace as ``.npz``; ``mlx-tier trace-sim
DIR/<name>.npz --slots N`` then reproduces a row. No timing is measured.

    python benches/policy_scans.py [--policies belady,lru,lfu,2q,tinylfu] [--save DIR] [--demo] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from mlx_tier.policy.eviction import DEFAULT_POLICY
from mlx_tier.routing.simulate import simulate
from mlx_tier.routing.synthetic import (
    cyclic,
    generate,
    hot_and_scan,
    mixtral_like,
    qwen3_like,
)
from mlx_tier.routing.trace import Trace
from mlx_tier.routing.trace import save as save_trace

FRACTIONS = (0.25, 0.5, 0.75)
POLICIES = ("belady", "lru", "lfu", "2q", "tinylfu")


def sizes(num_experts: int) -> list[int]:
    return [max(1, round(num_experts * f)) for f in FRACTIONS]


def trained_like() -> dict[str, Trace]:
    traces = {"mixtral-like (32x8, top-2)": generate(mixtral_like(), 2000, seed=0)}
    for stick in (0.1, 0.3, 0.5):
        traces[f"qwen3-like s={stick} (8x128, top-8)"] = generate(qwen3_like(8, stick), 1000, seed=1)
    return traces


def per_size(num_experts: int) -> list[tuple[str, int, Trace]]:
    """``(family, slots, trace)`` for the traces that are built for one cache size."""
    rows = []
    for n in sizes(num_experts):
        if num_experts == 128:
            rows.append(("cyclic 1.1x (128, top-8)", n, cyclic(128, 8, round(1.1 * n), 1000)))
            rows.append(("hot+scan (128, top-8)", n,
                         hot_and_scan(128, 8, round(0.8 * n), 1000, scan_share=0.6, burst=4, width=4)))
        else:
            rows.append(("cyclic 1.1x (1024, top-1)", n, cyclic(1024, 1, round(1.1 * n), 8000)))
            rows.append(("hot+scan (1024, top-1)", n, hot_and_scan(1024, 1, round(0.78 * n), 8000)))
    return rows


def replay(family: str, trace: Trace, n: int, policies: tuple[str, ...]) -> dict:
    rates = {p: simulate(trace, p, n).hit_rate for p in policies}
    return {"trace": family, "slots": n, "experts": trace.num_experts, **rates}


def cell(row: dict, p: str) -> str:
    r = row[p]
    return f"{100 * r:5.1f}" if p == "belady" else f"{100 * r:5.1f} ({100 * (row['belady'] - r):4.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--save", type=Path, help="write every trace here as .npz (for mlx-tier trace-sim)")
    ap.add_argument("--demo", action="store_true", help="also the demo MoE's recorded trace (records it if needed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    policies = tuple(args.policies.split(","))

    import platform

    print(f"caliber: {platform.machine()} {platform.python_implementation()} {platform.python_version()}; trace replay"
          " (mlx_tier.routing.simulate, the live cache's policy objects and rules); deterministic, 1 run each; no"
          f" timing; hit rate = accesses found resident / all; (gap to Belady, pp); default policy: {DEFAULT_POLICY}")
    t0 = time.perf_counter()
    whole = trained_like()
    if args.demo:
        from policy_targets import record_demo_trace

        whole["demo MoE on examples/docs (8 experts, top-2)"] = record_demo_trace(48, refresh=False)[0]
    jobs = [(name, n, t) for name, t in whole.items() for n in sizes(t.num_experts)]
    jobs += per_size(128) + per_size(1024)
    rows = [replay(name, t, n, policies) for name, n, t in jobs]
    print(f"{'trace':44s} {'cache':>10s} " + " ".join(f"{p:>13s}" for p in policies))
    for row in rows:
        frac = row["slots"] / row["experts"]
        print(f"{row['trace']:44s} {row['slots']:4d} ({frac:.0%}) " + " ".join(f"{cell(row, p):>13s}" for p in policies))
    print(f"simulation time {time.perf_counter() - t0:.0f} s")
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for name, n, t in jobs:
            stem = re.sub(r"[^\w.-]+", "_", name.split(" (")[0]) + f"-{t.num_experts}"
            stem += f"-n{n}" if name.startswith(("cyclic", "hot")) else ""
            save_trace(t, args.save / f"{stem}.npz")
        print(f"traces written to {args.save}")
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
