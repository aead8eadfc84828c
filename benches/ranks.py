"""Question: how much sooner does a job finish on 2 ranks than on 1?

Runs the same job, side by side in one invocation, as ``mlx-tier run --ranks 1``
and ``--ranks 2`` (both through mlx.launch, so the launch overhead is in both),
each into a fresh output folder (cold start: every rank loads the model), the
order alternating between repeats; prints the caliber, each wall time, the
medians and the ratio. On one machine the ranks share its cores: on 2 cores,
expect far less than 2x (each rank's MLX and CPU-kernel work already uses both).

    python benches/ranks.py [--docs 8] [--max-tokens 48] [--repeats 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEXTS = [
    "The river flooded in spring. Farmers waited for the water to go down, then planted seeds in the wet soil.",
    "Bees carry pollen between flowers; without them many fruit trees in the valley would bear nothing.",
    "The town library opens at nine and lends books, maps and tools to anyone with a card.",
    "A storm closed the harbour for two days. The boats stayed tied to the pier and the market was empty.",
    "The school added a garden where children grow beans and learn how seeds become food.",
    "Engineers repaired the old bridge with new steel beams, and traffic returned after six weeks.",
    "The museum opened a room about the history of the railway that first reached the town in 1881.",
    "Volunteers cleaned the beach every Sunday and counted the plastic they collected for a survey.",
]


def run_once(ranks: int, docs: Path, work: Path, args) -> tuple[float, dict]:
    out = work / f"out-{ranks}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "mlx_tier.cli.main", "run", str(docs), "--out", str(out), "--ranks", str(ranks),
           "--max-tokens", str(args.max_tokens)] + (["--model", args.model] if args.model else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"--ranks {ranks} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return wall, json.loads((out / "report.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    args = ap.parse_args()
    import mlx.core as mx
    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = work / "docs"
        docs.mkdir()
        for i in range(args.docs):
            (docs / f"doc{i:02d}.txt").write_text(TEXTS[i % len(TEXTS)])
        load_before = os.getloadavg()
        walls: dict[int, list[float]] = {1: [], 2: []}
        reports: dict[int, dict] = {}
        for r in range(args.repeats):
            for ranks in ((1, 2) if r % 2 == 0 else (2, 1)):
                wall, reports[ranks] = run_once(ranks, docs, work, args)
                walls[ranks].append(wall)
                print(f"repeat {r + 1}: --ranks {ranks}: {wall:.1f} s", flush=True)
        load_after = os.getloadavg()
    print(f"machine: {platform.platform()}, {psutil.cpu_count()} cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB; MLX {mx.__version__} CPU backend")
    print(f"load average (1/5/15 min) before {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}, "
          f"after {load_after[0]:.1f}/{load_after[1]:.1f}/{load_after[2]:.1f} (other work shares these cores)")
    setup = reports[1]
    print(f"model: {setup.get('model')}, cache {setup.get('cache_budget_gib')} GiB, kernel {setup.get('kernel')}; "
          f"{args.docs} documents of ~20 words, --max-tokens {args.max_tokens}, default batch; cold start "
          f"(each rank loads the model), {args.repeats} run(s) each, order alternating")
    for ranks in (1, 2):
        run = reports[ranks]["runs"][-1]
        per = ", ".join(f"rank {a['rank']}: {a['done']} docs {a['output_tok_per_s']:.2f} tok/s" for a in run["ranks"])
        print(f"--ranks {ranks}: wall {statistics.median(walls[ranks]):.1f} s median "
              f"({', '.join(f'{w:.1f}' for w in walls[ranks])}); {run['output_tokens']} tokens; {per}")
    ratio = statistics.median(walls[1]) / statistics.median(walls[2])
    print(f"speed-up, 2 ranks vs 1 (wall time ratio, same run): {ratio:.2f}x")


if __name__ == "__main__":
    main()
