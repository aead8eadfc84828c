"""How far is the demo's routing from a trained MoE's, and do the policy targets hold on trained-like routing?

Question: (a) side by side, the routing statistics of
trained-like traces (:mod:`mlx_tier.routing.synthetic`: generated to match
published Mixtral 8x7B and Qwen3-30B-A3B statistics, sources in that module),
of the demo MoE, both versions (v1: random routers; v2, the default:
routers fitted to Mixtral's reuse, ``mlx_tier.tools.demo_router``; recorded while
it summarises the two shortest example documents, greedy, 48 tokens each;
``--all-docs``: all seven for v2, as ``policy_targets.py``; neither is the
calibration text the fit used), of the synthetic random-weight checkpoint
(recorded, when ``--synthetic DIR`` is given) and of the Zipf traces of
``benches/policy_targets.py``; (b) on the trained-like traces: lru / lfu / 2q /
pinned vs Belady at 25/50/75% of the experts (target: the default policy
within 3 pp of Belady), held out (fit on the first half of the tokens, score
on the second): pre-warm from the profile, pinned, the adaptive split; and
(c) the recall of a next-layer predictor (a count table from layer l's
experts, held out), i.e. what prefetching k experts of layer l+1 would catch.

Statistics are defined in :mod:`mlx_tier.routing.stats`. Hit rates come
from :mod:`mlx_tier.routing.simulate` (the live cache's own policy objects and rules).
Everything is deterministic (seeded generator, recorded traces cached), so
one run each; no timing is measured.

    python benches/trained_routing.py [--tokens 2000] [--qwen-layers 8] [--synthetic DIR] [--all-docs] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from policy_targets import (
    ONLINE,
    by_token,
    mixed_zipf,
    record_demo_trace,
    table1,
    table2,
)

from mlx_tier.routing.simulate import zipf_trace
from mlx_tier.routing.stats import RoutingStats, routing_stats
from mlx_tier.routing.synthetic import generate, mixtral_like, qwen3_like
from mlx_tier.routing.trace import DECODE, Trace
from mlx_tier.routing.trace import load as load_trace
from mlx_tier.routing.trace import save as save_trace

TARGET_PP = 3.0
from mlx_tier.policy.eviction import (
    DEFAULT_POLICY,  # the one default (TierConfig, JobConfig, CLI)
)

DOCS = Path(__file__).resolve().parent.parent / "examples" / "docs"
SYNTH_TEXT = DOCS / "gettysburg_address.txt"
DEMO_DOCS = ("the_new_colossus.md", "second_inaugural_address_closing.txt")  # the two shortest


def record_synthetic(model_dir: Path) -> Trace:
    """Routing of a synthetic checkpoint (``make_synthetic_moe.py``) reading the
    Gettysburg Address (teacher-forced, one prefill call; a random model's greedy
    output repeats one token). Cached next to the checkpoint."""
    path = model_dir / "routing-gettysburg.npz"
    if path.is_file():
        return load_trace(path)
    import mlx.core as mx

    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.engine.dtypes import job_compute_dtype

    E = json.loads((model_dir / "config.json").read_text())["num_experts"]
    model, tok = mlx_tier.load(model_dir, config=TierConfig(slots_per_layer=E, dtype=job_compute_dtype()))  # all resident
    ids = tok.encode(SYNTH_TEXT.read_text(encoding="utf-8"))
    model.expert_cache.start_trace(source=f"synthetic {model_dir.name} reading {SYNTH_TEXT.name}")
    mx.eval(model(mx.array([ids])))
    trace = model.expert_cache.stop_trace()
    save_trace(trace, path)
    return trace


def record_demo_docs(names: tuple[str, ...], max_tokens: int, version: int) -> Trace:
    """Routing of demo MoE ``version`` (1: random routers, 2: fitted) summarising a few
    example documents, as ``policy_targets.record_demo_trace`` does for all of them (cached)."""
    from mlx_lm import generate as lm_generate

    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.defaults import DEFAULT_PROMPT
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.fsio import user_cache_dir as cache_dir
    from mlx_tier.job.prompts import build_prompt
    from mlx_tier.tools.demo_model import demo_name, ensure_demo_model

    path = cache_dir() / "traces" / f"{demo_name(version)}-{len(names)}docs-{max_tokens}.npz"
    if path.is_file():
        return load_trace(path)
    model, tokenizer = mlx_tier.load(ensure_demo_model(print, version), config=TierConfig(slots_per_layer=8,
                                                                                     dtype=job_compute_dtype()))
    model.expert_cache.start_trace(source=f"demo MoE v{version} on {', '.join(names)}, greedy,"
                                          f" max_tokens={max_tokens}")
    for name in names:
        prompt = build_prompt(tokenizer, DEFAULT_PROMPT, (DOCS / name).read_text(encoding="utf-8"))
        lm_generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)
    trace = model.expert_cache.stop_trace()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, path)
    return trace


def stats_row(name: str, s: RoutingStats) -> str:
    m = s.mean
    def pct(x: float) -> str:
        return "   -" if np.isnan(x) else f"{100 * x:4.0f}"
    return (f"{name:34s} {s.num_experts:3d}/{s.top_k:<2d} {s.tokens:5d}  {m('entropy'):.2f} {pct(m('top_share'))}"
            f" {pct(m('coverage90'))} | {pct(m('reuse'))} {pct(m('reuse_indep'))} {pct(s.reuse_uniform)}"
            f" {pct(m('overlap_any'))} {pct(s.overlap_uniform)} {pct(m('first_repeat'))} |"
            f" {pct(m('cross_recall'))} {pct(m('cross_recall_static'))} {pct(m('cross_top1'))}")


def print_stats(traces: dict[str, Trace]) -> dict:
    print("\nTable A: routing statistics (means over layers; % unless said; mlx_tier.routing.stats)")
    print(f"{'trace':34s} {'E/k':6s} {'tok':>5s}  {'ent':4s} {'top':>4s} {'c90':>4s} | {'reus':>4s} {'ind':>4s}"
          f" {'unif':>4s} {'any':>4s} {'unif':>4s} {'1st':>4s} | {'xrec':>4s} {'stat':>4s} {'xtop':>4s}")
    out = {}
    for name, t in traces.items():
        s = routing_stats(t)
        out[name] = s.as_dict()
        print(stats_row(name, s))
    print("ent = normalised entropy of expert use (1 = uniform); top = top expert's share; c90 = experts for 90%"
          " of uses; reus = share of a token's experts chosen again at the next token (ind = independent picks"
          " with the same popularity, unif = k/E); any = P(consecutive tokens share an expert) (unif ="
          " independent uniform); 1st = first choice repeated (ordered traces only); xrec = recall of k"
          " experts of layer l+1 predicted by a table from layer l's experts (held out), stat = the k most"
          " used of layer l+1; xtop = table from layer l's first choice predicts l+1's first choice")
    return out


def print_policies(traces: dict[str, Trace]) -> tuple[list, list]:
    rows1 = [r for name, t in traces.items() for r in table1(name, t)]
    print(f"\nTable B: whole trace, uniform split, hit rate (gap to Belady, pp); target: {DEFAULT_POLICY} within"
          f" {TARGET_PP:.0f} pp. pinned uses the trace's own counts (in-sample upper bound).")
    print(f"{'trace':34s} {'cache':>9s} {'belady':>7s} " + " ".join(f"{p:>14s}" for p in ONLINE) + "  target best")
    for name in traces:
        for n in sorted({r["slots"] for r in rows1 if r["trace"] == name}):
            rs = {r["policy"]: r for r in rows1 if r["trace"] == name and r["slots"] == n}
            d = rs[DEFAULT_POLICY]
            best = max(ONLINE, key=lambda p: (rs[p]["hit_rate"], p == DEFAULT_POLICY))
            verdict = "PASS" if d["gap_pp"] <= TARGET_PP else "MISS"
            cells = " ".join(f"{100 * rs[p]['hit_rate']:6.1f}% ({rs[p]['gap_pp']:4.1f})" for p in ONLINE)
            print(f"{name:34s} {n:3d} ({d['fraction']:.0%}) {100 * d['belady']:6.1f}% {cells}  {verdict}  {best}")
    rows2 = [r for name, t in traces.items() for r in table2(name, t)]
    print("\nTable C: held out (profile and adaptive split from the first half of the tokens, scored on the second)")
    for name, t in traces.items():
        print(f"  {name}")
        for n in sorted({r["slots"] for r in rows2 if r["trace"] == name}):
            rs = {r["case"]: r for r in rows2 if r["trace"] == name and r["slots"] == n}
            cells = "; ".join(f"{c} {100 * r['hit_rate']:.1f}%" + (
                f" [{r['layer_slots_min']}-{r['layer_slots_max']}]" if "adaptive" in c else "") for c, r in rs.items())
            print(f"    {n}/{t.num_experts} ({n / t.num_experts:.0%}): {cells}")
    return rows1, rows2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens of each generated trace")
    ap.add_argument("--qwen-layers", type=int, default=8, help="layers of the qwen3-like traces (policy tables"
                    " cost E simulations per layer for the adaptive split)")
    ap.add_argument("--synthetic", type=Path, default=None, help="a make_synthetic_moe.py checkpoint to record")
    ap.add_argument("--demo-max-tokens", type=int, default=48, help="tokens generated per document (demo trace)")
    ap.add_argument("--all-docs", action="store_true", help="demo trace on all of examples/docs (default: the"
                    " two shortest)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from mlx_tier.job.report import machine_info

    trained = {"mixtral-like (32x8, top-2)": generate(mixtral_like(), args.tokens, seed=0)}
    for stick in (0.1, 0.3, 0.5):
        trained[f"qwen3-like s={stick} ({args.qwen_layers}x128, top-8)"] = generate(
            qwen3_like(args.qwen_layers, stick), args.tokens // 2, seed=1)
    from mlx_tier.tools.demo_model import DEMO_VERSION, ROUTERS

    others = {}
    for version in ROUTERS:  # 1: random routers, 2: fitted to route like a trained MoE
        if args.all_docs and version == DEMO_VERSION:  # as policy_targets.py (~1 h on a busy 2-core machine)
            demo, _ = record_demo_trace(args.demo_max_tokens, refresh=False)
        else:
            demo = record_demo_docs(DEMO_DOCS, args.demo_max_tokens, version)
        others |= {f"demo v{version} (30x8, top-2)": demo,
                   f"demo v{version}, decode only": by_token(demo, demo.phase == DECODE)}
    if args.synthetic is not None:
        others["synthetic checkpoint"] = record_synthetic(args.synthetic)
    others |= {
        "zipf-mixed (8x64, top-4)": mixed_zipf([0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8], 64, 4, 2000),
        "zipf-a1.1-r0.5 (8x64, top-4)": zipf_trace(8, 64, 4, 2000, alpha=1.1, reuse=0.5, seed=0),
        "zipf-a0.8-r0.3 (8x64, top-4)": zipf_trace(8, 64, 4, 2000, alpha=0.8, reuse=0.3, seed=1),
        "zipf-a1.2-r0.6 (30x8, top-2)": zipf_trace(30, 8, 2, 1000, alpha=1.2, reuse=0.6, seed=2),
    }
    info = machine_info()
    print("caliber:", json.dumps(info["machine"]), f"backend={info['backend']} mlx={info['mlx']}")
    print("method: deterministic trace statistics and replays (mlx_tier.routing.stats, mlx_tier.routing.simulate);"
          " 1 run each; no timing")
    for name, t in (trained | others).items():
        print(f"  {name}: {t.num_layers} layers x {t.num_experts} experts, top-{t.experts.shape[1]},"
              f" {len(t.layer)} records; source: {t.meta.get('source', '')}")
    t0 = time.perf_counter()
    stats = print_stats(trained | others)
    rows1, rows2 = print_policies(trained)
    print(f"\nstatistics and simulation time {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps({"stats": stats, "table1": rows1, "table2": rows2}, indent=1, default=float))


if __name__ == "__main__":
    main()
