"""Eviction policies vs Belady's optimum on recorded and synthetic routing traces.

Question: is the default policy's hit rate within 5
percentage points of Belady's at cache = 25%, 50% and 75% of the experts per
layer? And does an adaptive per-layer split of the same total slots beat the
uniform one?

Traces:
* ``demo-docs``: routing recorded from the SmolLM2 8-expert demo MoE (the
  default version, ``mlx_tier.tools.demo_model.DEMO_VERSION``) while it
  summarises the README's example documents (``examples/docs``; chat prompt
  as ``mlx-tier run`` builds it, greedy, ``--max-tokens`` per document; one
  sequence at a time, so one trace record = one token). Cached in the
  mlx-tier cache dir (``--refresh`` re-records). The demo's router is a
  *random* matrix (not trained): routing follows the hidden states, so it is
  not uniform, but there is none of the topic locality of a trained router.
* ``zipf-*``: :func:`mlx_tier.routing.simulate.zipf_trace`, Zipf expert popularity
  per layer plus temporal reuse of the previous token's experts (seeded).

Table 1 replays the whole trace, every layer with the same slots. ``pinned``
there uses the trace's own counts (in-sample: an upper bound). Table 2 is
held out: profiles and the adaptive split are fitted on the first half of
the tokens and scored on the second half; pre-warm fills each layer with the
first half's most used experts.

Hit rates come from the simulator, which replays exactly what the live cache
counts (tests/routing/test_trace.py, tests/routing/test_profile.py); they are deterministic,
so one run each. No timing is measured here.

    python benches/policy_targets.py [--max-tokens 48] [--zipf-tokens 2000] [--refresh] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from mlx_tier.routing.profile import from_trace
from mlx_tier.routing.simulate import miss_curves, simulate, split_by_curves, zipf_trace
from mlx_tier.routing.trace import DECODE, Trace
from mlx_tier.routing.trace import load as load_trace
from mlx_tier.routing.trace import save as save_trace

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "examples" / "docs"
FRACTIONS = (0.25, 0.5, 0.75)
TARGET_PP = 5.0
from mlx_tier.policy.eviction import (
    DEFAULT_POLICY,  # the one default (TierConfig, JobConfig, CLI)
)

ONLINE = ("lru", "lfu", "2q", "pinned")


def record_demo_trace(max_tokens: int, refresh: bool) -> tuple[Trace, float]:
    """Routing of the demo MoE summarising examples/docs (cached). Returns (trace, seconds to record)."""
    from mlx_lm import generate

    import mlx_tier
    from mlx_tier import TierConfig
    from mlx_tier.defaults import DEFAULT_PROMPT
    from mlx_tier.engine.dtypes import job_compute_dtype
    from mlx_tier.fsio import user_cache_dir as cache_dir
    from mlx_tier.job.prompts import build_prompt
    from mlx_tier.tools.demo_model import demo_name, ensure_demo_model

    path = cache_dir() / "traces" / f"{demo_name()}-docs-{max_tokens}.npz"  # the default demo's version
    if path.is_file() and not refresh:
        return load_trace(path), 0.0
    model_dir = ensure_demo_model(print)
    t0 = time.perf_counter()
    config = TierConfig(slots_per_layer=8, dtype=job_compute_dtype())  # all resident: routing only
    model, tokenizer = mlx_tier.load(model_dir, config=config)
    model.expert_cache.start_trace(source=f"demo MoE {model_dir.name} on examples/docs, greedy,"
                                          f" max_tokens={max_tokens}")
    for doc in sorted(DOCS.iterdir()):
        prompt = build_prompt(tokenizer, DEFAULT_PROMPT, doc.read_text(encoding="utf-8"))
        generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)
    trace = model.expert_cache.stop_trace()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_trace(trace, path)
    return trace, time.perf_counter() - t0


def by_token(trace: Trace, keep: np.ndarray) -> Trace:
    """The records whose ``keep`` is true, same meta."""
    return Trace(trace.token[keep], trace.layer[keep], trace.phase[keep], trace.experts[keep], dict(trace.meta))


def halves(trace: Trace) -> tuple[Trace, Trace]:
    """Records of the first and of the second half of the tokens (``token`` counts
    each layer's records in order, so the cut is the same token at every layer)."""
    first = trace.token < (int(trace.token.max()) + 1) // 2
    return by_token(trace, first), by_token(trace, ~first)


def mixed_zipf(alphas: list[float], num_experts: int, top_k: int, tokens: int, reuse: float = 0.5) -> Trace:
    """Layers that differ: layer l is a one-layer :func:`zipf_trace` with ``alphas[l]``."""
    parts = [zipf_trace(1, num_experts, top_k, tokens, alpha=a, reuse=reuse, seed=10 + i) for i, a in enumerate(alphas)]
    L = len(parts)
    token = np.concatenate([p.token for p in parts])
    layer = np.concatenate([np.full(len(p.layer), i, np.int32) for i, p in enumerate(parts)])
    order = np.lexsort((layer, token))  # token by token, layers in order within a token
    experts = np.concatenate([p.experts for p in parts])
    return Trace(token[order], layer[order], np.concatenate([p.phase for p in parts])[order], experts[order],
                 {"num_layers": L, "num_experts": num_experts, "top_k": top_k,
                  "source": f"zipf per layer, alpha {alphas}, reuse={reuse}"})


def sizes(E: int) -> list[int]:
    return [max(1, round(E * f)) for f in FRACTIONS]


def table1(name: str, trace: Trace) -> list[dict]:
    E, rows = trace.num_experts, []
    for n in sizes(E):
        ceiling = simulate(trace, "belady", n).hit_rate
        for p in ONLINE:
            r = simulate(trace, p, n).hit_rate
            rows.append({"trace": name, "slots": n, "fraction": n / E, "policy": p, "hit_rate": r,
                         "belady": ceiling, "gap_pp": 100 * (ceiling - r)})
    return rows


def table2(name: str, trace: Trace) -> list[dict]:
    fit, test = halves(trace)
    L, E = trace.num_layers, trace.num_experts
    prof = from_trace(fit, L, E)
    curves = {p: miss_curves(fit, p) for p in (DEFAULT_POLICY, "belady")}  # the same for every budget
    rows = []
    for n in sizes(E):
        total = n * L
        split_lru = split_by_curves(curves[DEFAULT_POLICY], total)
        split_bel = split_by_curves(curves["belady"], total)
        cases = {
            "lru uniform": simulate(test, "lru", n),
            "lru adaptive": simulate(test, "lru", split_lru),
            "lru uniform + pre-warm": simulate(test, "lru", n, prof, prewarm=True),
            "pinned uniform (profile: 1st half)": simulate(test, "pinned", n, prof),
            "pinned uniform + pre-warm": simulate(test, "pinned", n, prof, prewarm=True),
            "belady uniform": simulate(test, "belady", n),
            "belady adaptive": simulate(test, "belady", split_bel),
        }
        for case, r in cases.items():
            rows.append({"trace": name, "slots": n, "fraction": n / E, "case": case, "hit_rate": r.hit_rate,
                         "layer_slots_min": min(r.layer_slots), "layer_slots_max": max(r.layer_slots)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens generated per document for the demo trace")
    ap.add_argument("--zipf-tokens", type=int, default=2000)
    ap.add_argument("--refresh", action="store_true", help="re-record the demo trace")
    ap.add_argument("--json", action="store_true", help="also print every row as JSON")
    args = ap.parse_args()

    from mlx_tier.job.report import machine_info

    demo, rec_s = record_demo_trace(args.max_tokens, args.refresh)
    traces = {
        "demo-docs": demo,
        "demo-docs decode only": by_token(demo, demo.phase == DECODE),
        "zipf-mixed (8x64, top-4)": mixed_zipf([0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8], 64, 4, args.zipf_tokens),
        "zipf-a1.1-r0.5 (8x64, top-4)": zipf_trace(8, 64, 4, args.zipf_tokens, alpha=1.1, reuse=0.5, seed=0),
        "zipf-a0.8-r0.3 (8x64, top-4)": zipf_trace(8, 64, 4, args.zipf_tokens, alpha=0.8, reuse=0.3, seed=1),
        "zipf-a1.2-r0.6 (30x8, top-2)": zipf_trace(30, 8, 2, args.zipf_tokens // 2, alpha=1.2, reuse=0.6, seed=2),
    }
    info = machine_info()
    print("caliber:", json.dumps(info["machine"]), f"backend={info['backend']} mlx={info['mlx']} mlx-lm={info['mlx_lm']}")
    print("method: trace replay in mlx_tier.routing.simulate (exact mirror of the live cache's hit/miss counts);"
          " deterministic, 1 run each; no timing; cache size = slots per layer / experts per layer")
    for name, t in traces.items():
        n_pre = int((t.phase == 0).sum()) // max(t.num_layers, 1)
        n_dec = int((t.phase == 1).sum()) // max(t.num_layers, 1)
        print(f"  trace {name}: {t.num_layers} layers x {t.num_experts} experts, top-{t.experts.shape[1]}, "
              f"{len(t.layer)} records ({n_pre} prefill + {n_dec} decode tokens); source: {t.meta.get('source', '')}"
              + (f"; recorded in {rec_s:.0f} s" if name == "demo-docs" and rec_s else ""))

    t0 = time.perf_counter()
    rows1 = [r for name, t in traces.items() for r in table1(name, t)]
    print(f"\nTable 1: whole trace, uniform split; gap = Belady - policy (pp); target: {DEFAULT_POLICY} (default) "
          f"within {TARGET_PP:.0f} pp. pinned uses the trace's own counts (in-sample upper bound).")
    print(f"{'trace':32s} {'cache':>9s} {'belady':>7s} " + " ".join(f"{p:>14s}" for p in ONLINE) + "  target")
    for name in traces:
        for n in sorted({r["slots"] for r in rows1 if r["trace"] == name}):
            rs = {r["policy"]: r for r in rows1 if r["trace"] == name and r["slots"] == n}
            d = rs[DEFAULT_POLICY]
            verdict = "PASS" if d["gap_pp"] <= TARGET_PP else "MISS"
            cells = " ".join(f"{100 * rs[p]['hit_rate']:6.1f}% ({rs[p]['gap_pp']:4.1f})" for p in ONLINE)
            print(f"{name:32s} {n:3d} ({d['fraction']:.0%}) {100 * d['belady']:6.1f}% {cells}  {verdict}")

    rows2 = [r for name, t in traces.items() for r in table2(name, t)]
    cases = list(dict.fromkeys(r["case"] for r in rows2))
    print("\nTable 2: held out (fit on the first half of the tokens, score on the second half); "
          "adaptive = same total slots, split by simulated miss curves of the first half")
    for name, t in traces.items():
        print(f"  {name}")
        for n in sorted({r["slots"] for r in rows2 if r["trace"] == name}):
            rs = {r["case"]: r for r in rows2 if r["trace"] == name and r["slots"] == n}
            E = t.num_experts
            cells = "; ".join(
                f"{c} {100 * rs[c]['hit_rate']:.1f}%"
                + (f" [{rs[c]['layer_slots_min']}-{rs[c]['layer_slots_max']}]" if "adaptive" in c else "")
                for c in cases)
            print(f"    {n}/{E} slots ({n / E:.0%}): {cells}")
    print(f"\nsimulation time {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(json.dumps({"table1": rows1, "table2": rows2}, indent=1))


if __name__ == "__main__":
    main()
