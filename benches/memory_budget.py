"""Peak memory of a run against its budget, for prompts of 32, 300 and 1,500 tokens.

Question: a run given a memory total (``--memory-gb``, or the memory cgroup it
lives in) splits it into runtime, dense part, expert cache, KV cache, step
workspace, MLX's buffers and a margin (mlx_tier/engine/footprint.py). Does
its resident set stay inside the total, with how much of the margin left, as
the prompt grows?

How: for each prompt length, one document of about that many tokens (the
instruction included; the text cut by the model's tokenizer), a fresh
``mlx-tier run`` process with default settings apart from ``--max-tokens``,
a short ``--prompt`` (so that a 32-token prompt exists) and the total: ``--memory-gb`` (``--budget-gb``), or, with ``--cap-gb``, no
``--memory-gb`` at all and the process started inside a new memory cgroup of
that limit (Linux, root: tests/support/cgroups.py), which the run must find by
itself. Figures from the run's report.json: the split, the prompt step it
chose, the peak resident set (``getrusage``); with a cap also the group's peak
charge (page cache included) and OOM kills.

    python benches/memory_budget.py [--model DIR] [--budget-gb 1.5] [--cap-gb 1.0] [--prompts 32,300,1500]

Default model: the 2 GiB synthetic qwen3_moe of make_synthetic_moe.py with
12 layers, hidden 1024, 128 experts of 768, top-8 (built when missing, in the
user cache). Memory figures do not move with the machine's load; one run per
prompt length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from make_synthetic_moe import SyntheticSpec, default_path, ensure_synthetic  # noqa: E402
from support.cgroups import MemoryCgroup, why_not  # noqa: E402

GIB, MIB = 2**30, 2**20
SPEC = SyntheticSpec(num_layers=12, hidden_size=1024, moe_intermediate_size=768)
PROMPT = "Summarise the text."  # short, so that a 32-token prompt exists (the default instruction is ~50)
TEXT = ("The history of the city begins with a small settlement on an island in the river, where fishermen and "
        "traders lived for centuries before the town grew into a centre of learning and trade. ")


def document(model: Path, tokens: int) -> str:
    """Text whose prompt (:data:`PROMPT` and the chat template included) is about ``tokens`` tokens."""
    from mlx_lm.utils import load_tokenizer

    from mlx_tier.job.prompts import build_prompt

    tok = load_tokenizer(model)
    overhead = len(build_prompt(tok, PROMPT, ""))
    ids = tok.encode(TEXT * (tokens // 20 + 2))[: max(1, tokens - overhead)]
    return tok.decode(ids)


def run_one(model: Path, text: str, args, cap: MemoryCgroup | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="mlx-tier-memory-") as tmp:
        docs, out = Path(tmp) / "docs", Path(tmp) / "out"
        docs.mkdir()
        (docs / "doc.txt").write_text(text)
        cmd = [sys.executable, "-m", "mlx_tier.cli.main", "run", str(docs), "--out", str(out), "--model", str(model),
               "--max-tokens", str(args.max_tokens), "--prompt", PROMPT]
        if cap is None:
            cmd += ["--memory-gb", str(args.budget_gb)]
        else:
            cmd = cap.wrap(cmd)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        row = {"exit": proc.returncode, "seconds": round(time.perf_counter() - t0, 1)}
        if cap is not None:
            row |= {"group_peak": cap.peak(), "oom_kills": cap.oom_kills()}
        try:
            report = json.loads((out / "report.json").read_text())
        except (OSError, ValueError):
            return row | {"error": proc.stderr.strip().splitlines()[-1:] }
        doc = report["documents"][0]
        return row | {"budget": report.get("memory_budget"), "generation": report.get("generation"),
                      "speed": report.get("speed"), "cache": report.get("cache"),
                      "prompt_tokens": doc.get("input_tokens"), "status": doc.get("status")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--budget-gb", type=float, default=1.5, help="the --memory-gb each run is given (no --cap-gb)")
    ap.add_argument("--cap-gb", type=float, default=None, help="run inside a memory cgroup of this limit instead")
    ap.add_argument("--prompts", default="32,300,1500")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or ensure_synthetic(default_path(SPEC), SPEC)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    where = f"--memory-gb {args.budget_gb:g}" if args.cap_gb is None else f"cgroup limit {args.cap_gb:g} GiB"
    print(f"caliber: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f}; model {model} ({size / GIB:.2f} GiB on disk); {where}; default settings, "
          f"--max-tokens {args.max_tokens}, --prompt {PROMPT!r}; one run per prompt length; greedy")
    rows = []
    for n in map(int, args.prompts.split(",")):
        text = document(model, n)
        if args.cap_gb is None:
            row = run_one(model, text, args, None)
        else:
            if why_not() is not None:
                sys.exit(f"no memory cgroup here: {why_not()}")
            with MemoryCgroup(int(args.cap_gb * GIB), f"mlx-tier-bench-{os.getpid()}-{n}") as cap:
                row = run_one(model, text, args, cap)
        rows.append({"prompt": n, **row})
        print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def print_row(r: dict) -> None:
    b, g = r.get("budget") or {}, r.get("generation") or {}
    if not b:
        print(f"prompt {r['prompt']:>5}: exit {r['exit']} {r.get('error')}")
        return
    parts = " + ".join(f"{k} {b[k] / GIB:.2f}" for k in ("runtime", "dense_part", "experts", "KV", "workspace",
                                                          "MLX_buffers", "margin"))
    peak = b.get("peak_rss", 0)
    cap = f", group peak {r['group_peak'] / GIB:.2f} GiB, OOM kills {r['oom_kills']}" if "group_peak" in r else ""
    print(f"prompt {r['prompt_tokens']:>5} tok: exit {r['exit']} {r['status']}, {r['seconds']} s; total "
          f"{b['total'] / GIB:.2f} GiB ({b['source']}) = {parts}; prompt step {g.get('prefill_step_size')}, batch "
          f"{g.get('batch_size')}, context {g.get('usable_context')}; peak RSS {peak / GIB:.2f} GiB = "
          f"{peak / b['total']:.0%} of the total, {(b['total'] - peak) / MIB:.0f} MiB left (margin "
          f"{b['margin'] / MIB:.0f} MiB){cap}")
    sp = r.get("speed")
    if sp:
        want = sp["predicted"]
        print(f"    speed: decode {sp['decode_tok_s']:.2f} tok/s (predicted {want['decode_tok_s']:.2f}), prompt "
              f"{sp['prompt_tok_s']:.1f} tok/s (predicted {want['prompt_tok_s']:.1f}), hit rate "
              f"{want['hit_rate']:.0%}, reads {sp['read_gbps']:.2f} GB/s")


if __name__ == "__main__":
    main()
