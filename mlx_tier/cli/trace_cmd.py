"""``mlx-tier trace-sim``, ``trace-stats`` and ``profile``: what a recorded routing trace
says about cache policies, routing statistics and the experts to keep
(:mod:`mlx_tier.routing`, no MLX except ``profile``, which reads a checkpoint's shape).
Policy names come from :mod:`mlx_tier.policy.eviction`'s registries.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from mlx_tier.cli.exits import fail
from mlx_tier.cli.render import err, out, print_wrapped
from mlx_tier.policy.eviction import OFFLINE_POLICIES, POLICIES
from mlx_tier.units import percent_text

SIM_POLICIES = (*POLICIES, *OFFLINE_POLICIES)  # live policies, then the offline ceiling
TRACE_HELP = "Routing traces (.npz from `run --trace`, or text)."


def trace_sim(
    trace: Path = typer.Argument(..., metavar="TRACE", help="A routing trace: mlx-tier's .npz (from `run --trace`) or plain text lines 'TOKEN LAYER E1 E2 ...'."),
    policy: list[str] = typer.Option(list(SIM_POLICIES), "--policy", help=f"Policies to compare (repeatable): {', '.join(SIM_POLICIES)}."),
    slots: list[int] = typer.Option([], "--slots", help="Slots per layer (repeatable). Default: 25%, 50% and 75% of the experts."),
    split: str = typer.Option("uniform", "--split", help="uniform: every layer gets --slots; adaptive: the same total (slots x layers) spread by each layer's simulated miss curve."),
    prewarm: bool = typer.Option(False, "--prewarm", help="Start each layer with the profile's most used experts resident, as the live cache does at load."),
    profile: Path | None = typer.Option(None, "--profile", help="Profile file for `pinned` and --prewarm (a mlx-tier-profile.json). Default: the trace's own counts."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write a PNG of hit rate vs cache size (every size up to all experts), one line per policy. Needs matplotlib (pip install 'mlx-tier[plot]')."),
    warm_slots: int | None = typer.Option(None, "--warm-slots", min=0, help="CUDA path: also simulate a warm host tier of this many slots per layer under each --slots (hot, GPU) size; prints hot/warm/miss rates and the share computed on the CPU (live policies only). With --prewarm, hot then warm start filled; a trace recorded with --prefetch also replays the promotions from warm to hot ahead of use."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Replay a routing trace: hit rate per policy and cache size, Belady's optimum as the ceiling.

    Each layer has its own slots; hit rate = accesses found resident / all expert
    accesses. Without --profile, `pinned` and --prewarm use the trace's own expert
    counts (an upper bound for a profile saved from other runs), and the adaptive
    split is fitted on the trace it is scored on (also an upper bound).
    """
    from mlx_tier.errors import ConfigError
    from mlx_tier.routing.simulate import Comparison, compare

    t = _load_trace(trace)
    _check_sim_options(policy, split, plot)
    sim = Comparison(tuple(policy), tuple(slots), split, prewarm, curve=plot is not None)
    try:
        sizes = sim.sizes(t.num_experts)
    except ConfigError as e:
        fail(str(e))
    prof = _load_profile(profile, t) if profile is not None else None
    if warm_slots is not None:
        _two_tier_sim(t, trace, [p for p in policy if p in POLICIES], sizes, warm_slots, prof, prewarm, as_json)
        return
    results, curve = compare(t, sim, prof)
    if plot is not None:
        _plot(curve, t, trace, plot, split, prewarm)
    _print_sim_results(t, trace, results, policy, sizes, split, prewarm, profile, as_json)
    if plot is not None and not as_json:
        out.print(f"plot written to {plot}", highlight=False)


def _load_trace(path: Path):
    """The trace at ``path`` (:func:`mlx_tier.routing.trace.load`); an unreadable one: one line, exit 2."""
    from mlx_tier.errors import TraceError
    from mlx_tier.routing.trace import load

    try:
        return load(path)
    except TraceError as e:
        fail(str(e))


def _check_sim_options(policies: list[str], split: str, plot: Path | None) -> None:
    """Refuse an unknown policy or split, or --plot without matplotlib (one line, exit 2)."""
    import importlib.util

    from mlx_tier.routing.simulate import SPLITS

    for p in policies:
        if p not in SIM_POLICIES:
            fail(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)}")
    if split not in SPLITS:
        fail(f"--split must be {' or '.join(SPLITS)}, got {split!r}")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        fail("--plot needs matplotlib, which is not installed; install it with:", "pip install 'mlx-tier[plot]'")


def _load_profile(path: Path, t):
    """The profile at ``path``, checked against trace ``t``'s shape (one line, exit 2 if not)."""
    from mlx_tier.errors import ProfileError
    from mlx_tier.routing.profile import load

    try:
        prof = load(path)
        prof.check(t.num_layers, t.num_experts, str(path))
    except ProfileError as e:
        fail(str(e))
    return prof


def _plot(curve: list, t, trace: Path, plot: Path, split: str, prewarm: bool) -> None:
    """`trace-sim --plot`: hit rate vs cache size as a PNG (exit 2 when it cannot be written)."""
    from mlx_tier.routing.simulate import plot_hit_rates

    title = (f"{trace.name}: {t.num_layers} layers x {t.num_experts} experts, {split} split"
             + (", pre-warmed" if prewarm else ""))
    try:
        plot_hit_rates(curve, t.num_experts, plot, title)
    except OSError as e:
        fail(f"{plot}: cannot write the plot ({e.strerror or e})")


def _print_sim_results(t, trace: Path, results: list, policies: list[str], sizes: list[int], split: str,
                       prewarm: bool, profile: Path | None, as_json: bool) -> None:
    """`trace-sim`'s output: JSON, or one table row per policy and a column per cache size."""
    E, L = t.num_experts, t.num_layers
    if as_json:
        out.print_json(json.dumps({
            "trace": str(trace), "records": len(t.layer), "layers": L, "experts": E,
            "split": split, "prewarm": prewarm, "profile": str(profile) if profile else None,
            "results": [{"policy": r.policy, "slots": r.slots, "layer_slots": list(r.layer_slots),
                         "hit_rate": r.hit_rate, "hits": r.hits, "accesses": r.accesses,
                         "per_layer": list(r.per_layer)} for r in results],
        }))
        return
    table = Table(title=f"hit rate: {trace.name} ({len(t.layer)} token-layer records, {L} layers x {E} experts, "
                        f"{split} split{', pre-warmed' if prewarm else ''})")
    table.add_column("policy")
    for n in sizes:
        table.add_column(f"{n} slot{'' if n == 1 else 's'} ({n / E:.0%})", justify="right")
    for p in policies:
        table.add_row(p, *[percent_text(r.hit_rate, 1) for r in results if r.policy == p])
    out.print(table)


def _two_tier_sim(t, trace: Path, policies: list[str], hot_sizes: list[int], warm: int, prof, prewarm: bool,
                  as_json: bool) -> None:
    """`trace-sim --warm-slots`: the two-tier replay (mlx_tier.routing.simulate_tiers), one table row per policy and
    hot size; a trace recorded with prefetch replays its warm -> hot promotions."""
    from mlx_tier.routing.simulate_tiers import simulate_two_tier

    E = t.num_experts
    if not policies:
        fail(f"--warm-slots simulates live policies only ({', '.join(POLICIES)}): give one with --policy")
    if any(n + warm > E for n in hot_sizes):
        fail(f"--slots plus --warm-slots must be at most {E} (the trace's experts per layer)")
    ahead = t.predicted is not None
    results = [simulate_two_tier(t, p, n, warm, profile=prof, prewarm=prewarm, prefetch=ahead)
               for p in policies for n in hot_sizes]
    if as_json:
        out.print_json(json.dumps({"trace": str(trace), "records": len(t.layer), "layers": t.num_layers,
                                   "experts": E, "prewarm": prewarm, "prefetch": ahead,
                                   "results": [r.as_dict() for r in results]}))
        return
    table = Table(title=f"two tiers: {trace.name} ({t.num_layers} layers x {E} experts), {warm} warm slots per layer, "
                        "one token per call, default cost model" + (", pre-warmed" if prewarm else "")
                        + (", warm->hot prefetch from the trace's predictions" if ahead else ""))
    for col in ("policy", "hot slots", "hot hit", "warm hit", "miss", "on CPU"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        table.add_row(r.policy, str(r.hot_slots), percent_text(r.hot_hit_rate, 1), percent_text(r.warm_hit_rate, 1),
                      percent_text(r.miss_rate, 1), percent_text(r.cpu_share, 1))
    out.print(table)


def trace_stats(
    traces: list[Path] = typer.Argument(..., metavar="TRACE...", help=TRACE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print every layer's statistics as JSON."),
) -> None:
    """Routing statistics of traces, to compare with a trained MoE's: expert popularity,
    step-to-step reuse, cross-layer predictability (means over layers; mlx_tier.routing.stats)."""
    from mlx_tier.errors import TraceError
    from mlx_tier.routing.stats import routing_stats, summary_rows
    from mlx_tier.routing.trace import load as load_trace

    try:
        stats = {str(p): routing_stats(load_trace(p)) for p in traces}
    except (TraceError, ValueError) as e:
        fail(str(e))
    if as_json:
        out.print_json(json.dumps({p: s.as_dict() for p, s in stats.items()}, default=float).replace("NaN", "null"))
        return
    for path, s in stats.items():
        table = Table(title=f"{Path(path).name}: {len(s.layers)} layers x {s.num_experts} experts, top-{s.top_k}, {s.tokens} tokens")
        for col in ("measure", "trace", "independent picks"):
            table.add_column(col)
        for row in summary_rows(s):
            table.add_row(*row)
        out.print(table)


def profile_cmd(
    model: str = typer.Argument(..., metavar="MODEL", help="mlx-lm MoE checkpoint folder (or Hugging Face repo id) the traces were recorded on."),
    traces: list[Path] = typer.Argument(..., metavar="TRACE...", help=TRACE_HELP),
    decay: float = typer.Option(1.0, "--decay", min=0.0, max=1.0, help="Weight of the saved counts before adding these (1 = counts add, 0.5 halves the past)."),
) -> None:
    """Save expert frequencies from routing traces as MODEL's profile (merged with
    any saved one), for the `pinned` policy, pre-warm at load and the adaptive split.

    Written to MODEL/mlx-tier-profile.json, or to the user cache dir when MODEL is
    not writable.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.engine.checkpoint import model_shape
    from mlx_tier.errors import ProfileError, TraceError
    from mlx_tier.routing.profile import from_trace, record
    from mlx_tier.routing.trace import load as load_trace
    from mlx_tier.tools.demo_model import resolve

    try:
        model = resolve(model, lambda text: print_wrapped(err, text, style="dim"))
        L, E = model_shape(model)
        merged = None
        for path in traces:
            p = from_trace(load_trace(path), L, E)
            merged = p if merged is None else merged.merged(p)
        path = record(model, merged, decay)
    except (CheckpointError, TraceError) as e:
        fail(str(e))
    except ProfileError as e:
        fail(f"{e} ({', '.join(map(str, traces))})")
    except OSError as e:
        fail(f"cannot write the profile ({e.strerror or e})")
    uses = merged.counts.sum()
    top = max(1, E // 4)
    share = sum(merged.counts[i, merged.hottest(i, top)].sum() for i in range(L)) / uses if uses else 0.0
    out.print(f"profile of {L} MoE layers x {E} experts: {int(uses)} expert uses from {len(traces)} trace(s); "
              f"the {top} most used experts per layer take {share:.1%} of them. Saved to {path}", highlight=False)
