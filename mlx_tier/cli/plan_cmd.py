"""``mlx-tier plan`` (will MODEL fit, how fast might it decode) and ``mlx-tier convert``
(a Hugging Face checkpoint to mlx-lm, router-safe): :mod:`mlx_tier.tools.plan` and
:mod:`mlx_tier.tools.convert`, their choices listed from :mod:`mlx_tier.tools`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from mlx_tier.cli import checks
from mlx_tier.cli.exits import fail
from mlx_tier.cli.render import FLAGS, as_flags, choices, err, out, print_wrapped
from mlx_tier.defaults import PLAN_DOC_TOKENS
from mlx_tier.tools import QUANT_BITS, QUANT_MODES, ROUTER_BITS
from mlx_tier.units import GIB, MIB, count_text, decimal_text, percent_text, rate_text


def plan(
    model: str = typer.Argument(..., metavar="MODEL", help="mlx-lm MoE checkpoint folder, a Hugging Face repo id (read from the local cache, else only its config and safetensors headers are fetched: nothing large is downloaded), or demo for the built-in demo model."),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help="Plan for a run given this much memory in all (GiB), as `run --memory-gb`, instead of what this process may use here (its container's limit, else the machine's available memory)."),
    context: int = typer.Option(8192, "--context", min=64, help="Context length (tokens) for the KV cache estimate (at least 64, as `run --context`)."),
    disk_gbps: float | None = typer.Option(None, "--disk-gbps", help="Disk bandwidth in GB/s (default: a short read test)."),
    compute_gbps: float | None = typer.Option(None, "--compute-gbps", help="Expert compute in GB/s of weights (default: a short test of the expert kernel a run would use)."),
    gpu_gb: float | None = typer.Option(None, "--gpu-gb", help="Also split the experts into GPU (hot), host (warm, from --memory-gb or this machine) and SSD (cold) tiers for a GPU with this much memory (GiB)."),
    doc_tokens: int = typer.Option(PLAN_DOC_TOKENS, "--doc-tokens", min=0, help="Plan the overnight job (`run`) for documents of this many tokens: its prompt and decode pools and predicted documents/hour (its kernels are probed, a few seconds); 0: not planned."),
    summary_tokens: int = typer.Option(64, "--summary-tokens", min=1, help="Summary length (tokens) the job plan is for."),
    kv_bits: int | None = typer.Option(None, "--kv-bits", metavar="[4|8]", help="Plan for KV caches quantized to 4 or 8 bits, as `run --kv-bits`."),
    as_json: bool = typer.Option(False, "--json", help="Print the worksheet as JSON."),
) -> None:
    """Capacity worksheet for MODEL from its config and shard headers (no weights loaded).

    Will it fit, and how fast might it decode: dense part, KV cache, expert
    sizes, the cache mlx-tier would choose and a decode range from the
    disk/compute roofline. Works on a hub repo id before downloading it.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.errors import ConfigError
    from mlx_tier.tools.demo_model import is_demo, resolve
    from mlx_tier.tools.plan import make_plan

    if is_demo(model):  # the built-in demo (built on first use): plan its local folder
        model = str(resolve(model, lambda text: print_wrapped(err, text, style="dim")))
    checks.gib("--memory-gb", memory_gb)
    checks.gib("--gpu-gb", gpu_gb)
    checks.gbps("--disk-gbps", disk_gbps)
    checks.gbps("--compute-gbps", compute_gbps)
    if Path(model).is_dir() and (compute_gbps is None or doc_tokens):  # its kernel is probed: compiled first
        from mlx_tier.defaults import JOB_KERNEL
        from mlx_tier.kernels.warmup import compile_for

        compile_for(Path(model), JOB_KERNEL, lambda text: print_wrapped(err, text, style="dim"))
    _say_remote(model)
    try:
        p = make_plan(model, memory_gb=memory_gb, context_tokens=context, disk_gbps=disk_gbps,
                      compute_gbps=compute_gbps, doc_tokens=doc_tokens or None, summary_tokens=summary_tokens,
                      kv_bits=kv_bits)
    except (CheckpointError, ConfigError) as e:
        fail(as_flags(str(e)))
    from mlx_tier.tools.plan_gpu import three_tier_split

    split = three_tier_split(p, gpu_gb) if gpu_gb is not None else None
    if as_json:
        out.print_json(json.dumps({**p.as_dict(), **({"tiers": split.as_dict()} if split else {})}))
        return
    t = Table(title=f"mlx-tier plan: {p.model}", show_header=False)
    for k, v in _plan_rows(p) + (_split_rows(p, split, gpu_gb) if split is not None else []):
        t.add_row(k, v)
    out.print(t)


def _span(low: float, high: float, spec) -> str:
    """``"low-high"`` in ``spec`` (a format spec, or a function giving the text), or one value
    when both print the same (``16.76``, not ``16.76-16.76``)."""
    a, b = (spec(low), spec(high)) if callable(spec) else (format(low, spec), format(high, spec))
    return a if a == b else f"{a}-{b}"


def _say_remote(model: str) -> None:
    """One dim line before a plan reads a repo not on this machine from the hub (its config
    and headers: seconds, or tens of seconds to find the hub unreachable)."""
    from mlx_tier.engine.hub import cached_snapshot, is_repo_id, offline

    if not Path(model).expanduser().exists() and is_repo_id(model) and not offline() \
            and cached_snapshot(model) is None:
        print_wrapped(err, f"{model}: not on this machine; reading its config and safetensors headers from the "
                      "Hugging Face hub (nothing large is downloaded)", style="dim")


def _plan_rows(p) -> list[tuple[str, str]]:
    """The worksheet of a :class:`mlx_tier.tools.plan.Plan`, one (label, value) per row."""
    return [
        ("model type", p.model_type),
        ("MoE layers x experts, top-k", f"{p.moe_layers} x {p.experts_per_layer}, top-{p.top_k}"),
        ("total parameters", f"{p.total_params / 1e9:.3f} B"),
        ("active parameters per token", f"{p.active_params / 1e9:.3f} B"),
        ("dense part (always resident)", f"{p.dense_bytes / GIB:.3f} GiB"),
        (f"KV cache at {p.context_tokens} tokens (estimate{f', {p.kv_bits}-bit' if p.kv_bits else ''})",
         f"{p.kv_bytes / GIB:.3f} GiB" + (f" (beyond the model's {p.model_context:,}-token context: a run takes "
                                          "at most that)" if p.model_context and p.context_tokens > p.model_context
                                          else "")),
        ("one expert: disk / resident", f"{p.expert_bytes_disk / MIB:.2f} / {p.expert_bytes_resident / MIB:.2f} MiB"),
        ("one layer's experts (disk)", f"{p.layer_bytes_disk / GIB:.3f} GiB"),
        ("experts per GiB of cache", f"{p.experts_per_gb:.0f}"),
        _memory_row(p),
        ("a run's memory", _split_text(p)),
        ("cache budget mlx-tier would choose", f"{p.cache_budget / GIB:.2f} GiB = {p.slots_per_layer} of {p.experts_per_layer} slots per layer"),
        ("disk bandwidth", f"{decimal_text(p.disk_gbps)} GB/s ({p.disk_method})"),
        ("expert reads (throughput schedule)", "around the page cache (O_DIRECT, where the filesystem takes it): "
         "the experts exceed all this process may hold" if p.page_cache == "direct" else "through the page cache"),
        ("expert compute", _compute_text(p)),
        ("predicted decode", f"{_span(p.tok_s_low, p.tok_s_high, '.2f')} tok/s (hit rate "
                             f"{_span(p.hit_rate_low, p.hit_rate_high, percent_text)})"
         if p.slots_per_layer else "does not fit: the budget holds less than one expert slot per layer"),
        ("predicted prompt reading", f"{p.prompt_tok_s:.1f} tok/s in {p.prompt_step}-token steps (hit rate {percent_text(p.hit_rate_low)})"
         if p.prompt_tok_s else "not predicted: " + ("--compute-gbps given" if not p.prompt_gflops else "a run would be refused")),
    ] + _job_rows(p.job)


def _job_rows(job: dict | None) -> list[tuple[str, str]]:
    """`plan --doc-tokens`: the overnight job's pools and predicted documents/hour."""
    if not job:
        return []
    traded = job.get("cache_for_pools")
    return [
        (f"job: documents of {job.get('document_tokens') or job['prompt_tokens']} tokens, "
         f"{job['output_tokens']}-token summaries", ""),
        *([("  calls a document", f"{job['calls']}: parts of ~{job['prompt_tokens']} prompt tokens, then the "
                                  "calls combining their summaries")] if job.get("calls", 1) > 1 else []),
        *([("  expert cache for pools", f"{traded['slots']} slot{'' if traded['slots'] == 1 else 's'} per layer, not the split's "
                                         f"{traded['split_slots']}: the KV caches take the rest")]
          if traded else []),
        ("  prompt pool (throughput schedule)", f"{job['prefill_tokens']} tokens a step, "
                                                f"{count_text(job['prefill_batch'], 'document')} read together: {job['prompt_tok_s']:.1f} tok/s"),
        ("  decode pool", f"{count_text(job['decode_pool'], 'sequence')} ({job['limited_by']}): {job['decode_tok_s']:.1f} tok/s"),
        *([("  expert slots lent to decode steps", f"{job['decode_slots']} a layer, from the prompt steps' "
                                                   "workspace; more from KV room left idle")] if job.get("decode_slots") else []),
        *([("  decoded in prompt steps", f"{job['merged_tokens']:.0f} of a document's {job['output_tokens']} tokens "
                                         "(module batching)")] if job.get("merged_tokens") else []),
        ("  predicted documents/hour", f"{rate_text(job['docs_per_hour'])} (one document at a time: "
                                       f"{rate_text(job['batch1_docs_per_hour'])})"),
    ]


def _memory_row(p) -> tuple[str, str]:
    """The total planned for and this machine's available memory: a ``--memory-gb`` total is
    as given (a plan may be for another machine), said so beside what is available here."""
    if p.memory_source == "memory_gb":
        from mlx_tier.engine.budgets import probe
        from mlx_tier.engine.sizes import may_use_now

        mem = probe()
        if not mem.unified:
            return "memory: planned total", (f"{p.memory_total / GIB:.1f} GiB (--memory-gb; `run` on this "
                                             f"{mem.backend} machine sizes its tiers with --cache-gb and "
                                             "--host-cache-gb instead)")
        may_use = may_use_now(mem.host_available, mem.host_total)  # as `run --memory-gb` checks it
        here = f"a run here may use {may_use / GIB:.1f} GiB"
        beyond = ": a plan for another machine, `run` here refuses it" if p.memory_total > may_use else ""
        return "memory: planned total", f"{p.memory_total / GIB:.1f} GiB (--memory-gb; {here}{beyond})"
    return ("memory: total / available",
            f"{p.memory_total / GIB:.1f} / {p.memory_available / GIB:.1f} GiB ({FLAGS.get(p.memory_source, p.memory_source)})")


def _split_text(p) -> str:
    """The run's memory split, or why a run would be refused."""
    if p.memory_split is None:
        return f"does not fit: {as_flags(p.memory_fit or '')}"
    parts = {k: v for k, v in p.memory_split.items() if k not in ("total", "source", "prefill_step")}
    listed = " + ".join(f"{name.replace('_', ' ')} {v / GIB:.2f}" for name, v in parts.items())
    total = p.memory_split["total"]
    held = total - p.memory_available  # a run may hold what is available and what it holds already
    why = (f" (available {p.memory_available / GIB:.2f} + {held / GIB:.2f} a process holds once MLX is loaded)"
           if p.memory_source != "memory_gb" and held >= 0.005 * GIB else "")
    return f"{total / GIB:.2f} GiB{why} = {listed} GiB"


def _compute_text(p) -> str:
    if not p.prompt_gflops:
        return f"{decimal_text(p.compute_gbps)} GB/s of weights (given)"
    return (f"{p.compute_gbps:.2f} GB/s of weights decoding, {p.prompt_gflops:.1f} GFLOP/s reading a prompt "
            f"({p.kernel} kernel, as a run computes; measured)")


def _split_rows(p, split, gpu_gb: float) -> list[tuple[str, str]]:
    """`plan --gpu-gb`: the three-tier split's rows (:mod:`mlx_tier.tools.plan_gpu`)."""
    E = split.experts_per_layer
    rows = [
        ("GPU free after the dense part", f"{split.device_free / GIB:.2f} GiB (assumed: {gpu_gb:g} GiB - dense)"),
        ("GPU hot tier (half of it, as a run)", f"{split.hot_budget / GIB:.2f} GiB = {split.hot_slots} of {E} experts per layer"),
        ("GPU left for KV cache, activations", f"{split.gpu_left / GIB:.2f} GiB (KV estimate {p.kv_bytes / GIB:.2f} GiB)"),
        ("host warm tier", f"{split.host_budget / GIB:.2f} GiB = {split.warm_slots} of {E} experts per layer"),
        ("SSD cold tier", f"{split.cold_experts} of {E} experts per layer"),
    ]
    if not split.fits:
        rows.append(("three-tier split", f"does not fit: {split.why}"))
    return rows


def convert(
    hf_dir: str = typer.Argument(..., metavar="HF_DIR", help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer), or a repo id (local cache first, else downloaded)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="New folder for the mlx-lm checkpoint (must not exist)."),
    bits: int = typer.Option(4, "--bits", metavar=choices(QUANT_BITS), help="Bits of the routed experts."),
    group_size: int | None = typer.Option(None, "--group-size", help="Quantisation group size (default: 64 affine, 32 mxfp4)."),
    mode: str = typer.Option("affine", "--mode", metavar=choices(QUANT_MODES), help="Quantisation mode (mxfp4: 4 bits only)."),
    router_bits: int = typer.Option(8, "--router-bits", metavar=choices(ROUTER_BITS), help="Routers/gates: 8, or 16 to keep them unquantised."),
    shared_expert_bits: int | None = typer.Option(None, "--shared-expert-bits", help="Shared experts (default: max(8, --bits); 16 = unquantised)."),
    calib: Path | None = typer.Option(None, "--calib", help="Calibration text for the router-agreement check (default: a shipped text)."),
) -> None:
    """Convert a Hugging Face MoE checkpoint to mlx-lm format, router-safe.

    Routed experts at --bits; routers and shared experts at 8 bits or more (a
    quantised router flips the top-k choice). Checks every MoE layer holds all
    experts and reports router agreement with the unquantised model.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.engine.hub import resolve_model
    from mlx_tier.tools.convert import ConvertConfig
    from mlx_tier.tools.convert import convert as do_convert

    if router_bits not in ROUTER_BITS:
        fail(f"--router-bits must be {' or '.join(map(str, ROUTER_BITS))}, got {router_bits}")
    cfg = ConvertConfig(bits=bits, group_size=group_size, mode=mode, router_bits=router_bits, shared_expert_bits=shared_expert_bits)
    try:
        report = do_convert(resolve_model(hf_dir), out_dir, cfg, calib)
    except (CheckpointError, FileExistsError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot write ({e.strerror or e}); nothing was left behind")
    out.print(
        f"converted {hf_dir} -> {report.out_dir}: {report.moe_layers} MoE layers x {report.experts_per_layer} experts; "
        f"router agreement {report.router_agreement:.1%} of (token, layer) top-k sets on {report.calibration_tokens} calibration tokens",
        highlight=False,
    )
