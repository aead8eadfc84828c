"""``mlx-tier``: the command line. Parses, builds a config, calls the library, prints."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

app = typer.Typer(
    help="Run Mixture-of-Experts models larger than memory: experts stream from disk into a bounded cache.",
    no_args_is_help=True,
    add_completion=False,
)
err = Console(stderr=True)
out = Console()

EXIT_FAILED_DOCS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def fail(message: str) -> None:
    """One clear error line and exit code 2."""
    err.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_BAD_INPUT)


class RichReporter:
    """Progress bar: documents done/total, tok/s, cache hit rate, ETA."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("decode {task.fields[tps]:5.1f} tok/s"),
            TextColumn("hit rate {task.fields[hit]:5.1%}"),
            TextColumn("{task.fields[doc]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=err,
            transient=False,
        )
        self.task = None

    def message(self, text: str) -> None:
        err.print(f"[dim]{text}[/]", highlight=False)

    def start(self, total: int, skipped: int) -> None:
        self.total, self.done = total, skipped
        if skipped:
            err.print(f"skipping {skipped} document(s) already done (journal)")
        if skipped == total:
            return
        self.progress.start()
        self.task = self.progress.add_task("summarising", total=total, completed=skipped, tps=0.0, hit=0.0, doc="")

    def tokens(self, doc, generated: int, tok_per_s: float) -> None:
        self.progress.update(self.task, tps=tok_per_s, doc=f"{doc.id} ({generated} tok)")

    def finished(self, result, cache: dict) -> None:
        self.done += 1
        self.progress.update(self.task, advance=1, hit=cache["hit_rate"], doc="")
        if result.status == "failed":
            self.progress.console.print(f"[red]failed[/] {result.id}: {result.error}", highlight=False)
        elif not err.is_terminal:  # a log file gets one line per document instead of a live bar
            err.print(
                f"{self.done}/{self.total} {result.id}: {result.output_tokens} tokens in {result.seconds:.1f} s, "
                f"hit rate so far {cache['hit_rate']:.1%}",
                highlight=False,
            )

    def close(self) -> None:
        if self.task is not None:
            self.progress.stop()


def print_summary(report, out_dir: Path) -> None:
    table = Table(title="mlx-tier run")
    for col in ("document", "status", "in tok", "out tok", "seconds"):
        table.add_column(col, justify="right" if "tok" in col or col == "seconds" else "left")
    for r in report.results:
        style = {"failed": "red", "pending": "yellow", "skipped": "dim"}.get(r.status, "")
        table.add_row(r.id, r.status, str(r.input_tokens), str(r.output_tokens), f"{r.seconds:.1f}", style=style)
    out.print(table)
    c = report.runs[-1]["cache"]  # this run's counters
    tps = report.output_tokens / report.generation_seconds if report.generation_seconds else 0.0
    out.print(
        f"done {report.count('done')}, skipped {report.count('skipped')}, failed {report.count('failed')}, "
        f"pending {report.count('pending')} | this run: {tps:.2f} output tok/s overall (prompt processing "
        f"included), hit rate {c['hit_rate']:.1%}, read {c['bytes_read'] / 2**20:.0f} MiB | "
        f"report: {out_dir / 'report.json'}",
        highlight=False,
    )


def _version(value: bool) -> None:
    if value:
        from mlx_tier import __version__

        out.print(f"mlx-tier {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_version, help="Print the version and exit."),
) -> None:
    """mlx-tier: Mixture-of-Experts models larger than memory, on MLX."""


@app.command()
def run(
    input: Path = typer.Argument(..., metavar="INPUT", help="Folder of .txt/.md documents (searched recursively) or a JSONL file with id and text per line."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Folder for the summaries (<id>.md), journal.jsonl and report.json."),
    model: Optional[Path] = typer.Option(None, help="mlx-lm MoE checkpoint folder. Default: the built-in SmolLM2 8-expert demo MoE (built on first use)."),
    cache_gb: Optional[float] = typer.Option(None, "--cache-gb", help="Expert cache budget in GiB. Default: half the memory available after loading the dense part."),
    max_tokens: int = typer.Option(160, "--max-tokens", min=1, help="Most tokens generated per summary."),
    prompt: Optional[str] = typer.Option(None, help="Instruction placed before each document, or @FILE to read it from a file."),
    repetition_penalty: float = typer.Option(1.1, "--repetition-penalty", min=1.0, help="mlx-lm repetition penalty over the last 20 tokens; 1.0 = plain greedy. Small models loop without it."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Record this run's routing trace (top-k experts per token and layer) to this .npz file, for `mlx-tier trace-sim`."),
) -> None:
    """Summarise every document in INPUT into OUT_DIR, resumably.

    Rerunning the same command skips finished documents. Ctrl-C stops after the
    current document; everything finished is kept. Exit codes: 0 all done,
    1 some documents failed, 2 bad input, 130 interrupted.
    """
    from mlx_tier import BudgetError, CheckpointError
    from mlx_tier.demo_model import DemoModelError
    from mlx_tier.documents import InputError
    from mlx_tier.jobs import DEFAULT_PROMPT, JobConfig, read_prompt, run_job

    if cache_gb is not None and not (math.isfinite(cache_gb) and cache_gb > 0):
        fail(f"--cache-gb must be a positive number, got {cache_gb}")
    reporter = RichReporter()
    try:
        config = JobConfig(
            input=input,
            out_dir=out_dir,
            model=model,
            cache_gb=cache_gb,
            max_tokens=max_tokens,
            prompt=read_prompt(prompt) if prompt else DEFAULT_PROMPT,
            repetition_penalty=repetition_penalty,
            trace=trace,
        )
        report = run_job(config, reporter)
    except (InputError, CheckpointError, BudgetError, DemoModelError) as e:
        reporter.close()
        fail(str(e))
    except KeyboardInterrupt:
        reporter.close()
        err.print("interrupted; finished summaries are kept. Run the same command again to resume.")
        raise typer.Exit(EXIT_INTERRUPTED)
    print_summary(report, out_dir)
    if report.interrupted:
        err.print("stopped after the current document; run the same command again to resume.")
        raise typer.Exit(EXIT_INTERRUPTED)
    if report.count("failed"):
        raise typer.Exit(EXIT_FAILED_DOCS)


@app.command()
def plan(
    model: Path = typer.Argument(..., metavar="MODEL", help="mlx-lm MoE checkpoint folder."),
    memory_gb: Optional[float] = typer.Option(None, "--memory-gb", help="Plan for this much memory (GiB) instead of this machine's."),
    context: int = typer.Option(8192, "--context", min=1, help="Context length (tokens) for the KV cache estimate."),
    disk_gbps: Optional[float] = typer.Option(None, "--disk-gbps", help="Disk bandwidth in GB/s (default: a short read test)."),
    compute_gbps: Optional[float] = typer.Option(None, "--compute-gbps", help="Expert compute in GB/s of weights (default: a short matvec test)."),
    as_json: bool = typer.Option(False, "--json", help="Print the worksheet as JSON."),
) -> None:
    """Capacity worksheet for MODEL from its config and shard headers (no weights loaded)."""
    import json

    from mlx_tier import CheckpointError
    from mlx_tier.plan import make_plan

    if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
        fail(f"--memory-gb must be positive, got {memory_gb}")
    try:
        p = make_plan(model, memory_gb=memory_gb, context_tokens=context, disk_gbps=disk_gbps, compute_gbps=compute_gbps)
    except CheckpointError as e:
        fail(str(e))
    if as_json:
        out.print_json(json.dumps(p.as_dict()))
        return
    mib, gib = 2**20, 2**30
    t = Table(title=f"mlx-tier plan: {p.model}", show_header=False)
    rows = [
        ("model type", p.model_type),
        ("MoE layers x experts, top-k", f"{p.moe_layers} x {p.experts_per_layer}, top-{p.top_k}"),
        ("total parameters", f"{p.total_params / 1e9:.3f} B"),
        ("active parameters per token", f"{p.active_params / 1e9:.3f} B"),
        ("dense part (always resident)", f"{p.dense_bytes / gib:.3f} GiB"),
        (f"KV cache at {p.context_tokens} tokens (estimate)", f"{p.kv_bytes / gib:.3f} GiB"),
        ("one expert: disk / resident", f"{p.expert_bytes_disk / mib:.2f} / {p.expert_bytes_resident / mib:.2f} MiB"),
        ("one layer's experts (disk)", f"{p.layer_bytes_disk / gib:.3f} GiB"),
        ("experts per GiB of cache", f"{p.experts_per_gb:.0f}"),
        ("memory: total / available", f"{p.memory_total / gib:.1f} / {p.memory_available / gib:.1f} GiB"),
        ("cache budget mlx-tier would choose", f"{p.cache_budget / gib:.2f} GiB = {p.slots_per_layer} of {p.experts_per_layer} slots per layer"),
        ("disk bandwidth", f"{p.disk_gbps:.2f} GB/s ({'measured, random 4 MiB reads' if p.disk_measured else 'given'})"),
        ("expert compute", f"{p.compute_gbps:.2f} GB/s of weights"),
        ("predicted decode", f"{p.tok_s_low:.2f}-{p.tok_s_high:.2f} tok/s (hit rate {p.hit_rate_low:.0%}-{p.hit_rate_high:.0%})"
         if p.slots_per_layer else "does not fit: the budget holds less than one expert slot per layer"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


@app.command()
def convert(
    hf_dir: Path = typer.Argument(..., metavar="HF_DIR", help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="New folder for the mlx-lm checkpoint (must not exist)."),
    bits: int = typer.Option(4, "--bits", help="Bits of the routed experts: 2, 3, 4, 5, 6 or 8."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Quantisation group size (default: 64 affine, 32 mxfp4)."),
    mode: str = typer.Option("affine", "--mode", help="affine or mxfp4."),
    router_bits: int = typer.Option(8, "--router-bits", help="Routers/gates: 8, or 16 to keep them unquantised."),
    shared_expert_bits: Optional[int] = typer.Option(None, "--shared-expert-bits", help="Shared experts (default: max(8, --bits); 16 = unquantised)."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text for the router-agreement check (default: a shipped text)."),
) -> None:
    """Convert a Hugging Face MoE checkpoint to mlx-lm format, router-safe.

    Routed experts at --bits; routers and shared experts at 8 bits or more (a
    quantised router flips the top-k choice). Checks every MoE layer holds all
    experts and reports router agreement with the unquantised model.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.convert import ConvertConfig, convert as do_convert

    if router_bits not in (8, 16):
        fail(f"--router-bits must be 8 or 16, got {router_bits}")
    cfg = ConvertConfig(bits=bits, group_size=group_size, mode=mode, router_bits=router_bits, shared_expert_bits=shared_expert_bits)
    try:
        report = do_convert(hf_dir, out_dir, cfg, calib)
    except (CheckpointError, FileExistsError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot write ({e.strerror or e}); nothing was left behind")
    out.print(
        f"converted {hf_dir} -> {report.out_dir}: {report.moe_layers} MoE layers x {report.experts_per_layer} experts; "
        f"router agreement {report.router_agreement:.1%} of (token, layer) top-k sets on {report.calibration_tokens} calibration tokens",
        highlight=False,
    )


@app.command("trace-sim")
def trace_sim(
    trace: Path = typer.Argument(..., metavar="TRACE", help="A routing trace: mlx-tier's .npz (from `run --trace`) or plain text lines 'TOKEN LAYER E1 E2 ...'."),
    policy: list[str] = typer.Option(["lru", "lfu", "2q", "pinned", "belady"], "--policy", help="Policies to compare (repeatable): lru, lfu, 2q, pinned, belady."),
    slots: list[int] = typer.Option([], "--slots", help="Slots per layer (repeatable). Default: 25%, 50% and 75% of the experts."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Replay a routing trace: hit rate per policy and cache size, Belady's optimum as the ceiling.

    Each layer has its own N slots; hit rate = accesses found resident / all expert
    accesses. `pinned` uses the trace's own expert counts as its profile (an upper
    bound for a profile saved from other runs).
    """
    import json

    from mlx_tier.policy import OFFLINE_POLICIES, POLICIES
    from mlx_tier.simulate import simulate
    from mlx_tier.trace import TraceError, load as load_trace

    try:
        t = load_trace(trace)
    except TraceError as e:
        fail(str(e))
    for p in policy:
        if p not in POLICIES and p not in OFFLINE_POLICIES:
            fail(f"unknown policy {p!r}; choose from {', '.join(list(POLICIES) + list(OFFLINE_POLICIES))}")
    E = t.num_experts
    sizes = sorted(set(slots)) or sorted({max(1, round(E * f)) for f in (0.25, 0.5, 0.75)})
    if any(n < 1 for n in sizes):
        fail("--slots must be at least 1")
    results = [simulate(t, p, n) for p in policy for n in sizes]
    if as_json:
        out.print_json(json.dumps({
            "trace": str(trace), "records": int(len(t.layer)), "layers": t.num_layers, "experts": E,
            "results": [{"policy": r.policy, "slots": r.slots, "hit_rate": r.hit_rate, "hits": r.hits,
                         "accesses": r.accesses, "per_layer": list(r.per_layer)} for r in results],
        }))
        return
    table = Table(title=f"hit rate: {trace.name} ({len(t.layer)} token-layer records, {t.num_layers} layers x {E} experts)")
    table.add_column("policy")
    for n in sizes:
        table.add_column(f"{n} slots ({n / E:.0%})", justify="right")
    for p in policy:
        table.add_row(p, *[f"{r.hit_rate:.1%}" for r in results if r.policy == p])
    out.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
