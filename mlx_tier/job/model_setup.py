"""A run's model: found, its memory split decided, loaded, and what is kept of it.

:func:`model_for` loads the tiered model only when a run has work (the split
checked before loading, the expert cache chosen for the pools where the pool
model prices that higher, the context checked before any document);
:func:`setup_record` is the run's settings for report.json; the rest saves
what a run leaves beside its summaries (routing trace, expert use profile,
peak memory).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlx_tier.defaults import DEFAULT_POOL_STEP, PLAN_DOC_TOKENS
from mlx_tier.engine.checkpoint import context_length
from mlx_tier.engine.dtypes import job_compute_dtype
from mlx_tier.engine.footprint import MemoryBudget, named
from mlx_tier.engine.sizes import peak_rss, run_budget
from mlx_tier.engine.store import DEFAULT_PAGE_CACHE, DEFAULT_READ_METHOD
from mlx_tier.job.activity import Reporter
from mlx_tier.job.config import JobConfig
from mlx_tier.job.report import JobReport, machine_info
from mlx_tier.job.scheduler import GenerationConfig, check_context
from mlx_tier.kernels.warmup import compile_for
from mlx_tier.outdir.jobdir import JobDir
from mlx_tier.outdir.layout import REPORT
from mlx_tier.units import GIB, rate_text

if TYPE_CHECKING:
    from mlx_tier.engine.load import TierConfig

# When the checkpoint states no context length.
FALLBACK_CONTEXT = 4096


def earlier_setup(config: JobConfig) -> tuple[dict, dict]:
    """``(setup, throttle)`` of the job's last report.json (a rerun that loads no
    model keeps them), with this machine's facts; minimal if there is none."""
    try:
        earlier = json.loads((config.out_dir / REPORT).read_text())
        earlier = earlier if isinstance(earlier, dict) else {}
    except (OSError, ValueError):
        earlier = {}
    own = ("documents", "totals", "cache", "throttle", "runs", "written_by", "prompts")
    setup = {k: v for k, v in earlier.items() if k not in own}
    setup |= {**machine_info(), "model": setup.get("model") or (str(config.model) if config.model is not None else "demo")}
    throttle = earlier.get("throttle")
    return setup, throttle if isinstance(throttle, dict) else {}



@dataclass
class Loaded:
    """The model of this run and what was decided at its load."""

    model: object
    tokenizer: object
    model_dir: Path
    context: int  # the model's context length, tokens
    budget: MemoryBudget | None = None  # the run's memory split (None on CUDA)

    @property
    def cache(self):
        return self.model.expert_cache



def load_model(config: JobConfig, reporter: Reporter, model_dir: Path | None = None,
                pools: Callable[[], tuple[int, int, list]] | None = None) -> Loaded:
    """The tiered model (from ``model_dir`` when it was found already), its checkpoint opened
    and its context checked against `max_tokens` before the memory split is said or anything
    loaded. ``pools``: when the run uses the throughput schedule (its
    expert cache may give room to its pools), gives ``(characters of a typical document,
    documents, a few documents' samples (:data:`~mlx_tier.job.doc_tokens.Sample`))``; asked only once the model is found and its split fits."""
    from mlx_lm.utils import load_tokenizer

    from mlx_tier.engine.load import load
    from mlx_tier.tools.demo_model import resolve

    if model_dir is None:
        model_dir = resolve(config.model, reporter.message)
    compile_for(model_dir, config.tier.kernel, reporter.message)  # before the split: its memory is not in it
    g = config.generation
    step = g.prefill_step_size  # the paced schedule's; the throughput schedule's pools reach further
    step = step if pools is None else max(step, DEFAULT_POOL_STEP)
    budget = run_budget(model_dir, config.tier, config.memory_gb, step, g.kv_bits)  # opens the checkpoint
    context = context_length(model_dir, FALLBACK_CONTEXT)  # the settings checked before anything is said or loaded
    capped = not g.context or g.context >= context  # the model's own context: no setting raises it
    tokenizer = load_tokenizer(model_dir)  # ~0.4 s, once: the check's and the pools' (the load reads its own)
    check_context(tokenizer, g.instruction, g.max_tokens, min(context, g.context or context),
                  "the model's context of" if capped else "a context of", raisable=not capped)
    tier, cache_gb = config.tier, None
    if budget is not None and pools is not None and tier.layer_slots is None:
        budget = _cache_for_pools(budget, model_dir, config, reporter, tokenizer, *pools())
    if budget is not None:
        reporter.message(f"memory: {budget.describe()}")
        if (tier.read_method, tier.page_cache) == (DEFAULT_READ_METHOD, DEFAULT_PAGE_CACHE):  # else the caller's
            tier = replace(tier, page_cache=read_mode(model_dir, budget, config.generation.schedule, reporter.message))
        if tier.cache_gb is None and tier.slots_per_layer is None and tier.layer_slots is None:
            cache_gb = budget.cache / GIB  # the split's share (load's own cache_gb overrides the config's None)
        elif tier.cache_gb is not None and budget.cache < int(tier.cache_gb * GIB):  # more than every expert
            tier = replace(tier, cache_gb=budget.cache / GIB)
    reporter.message(f"loading {model_dir}")
    model, tokenizer = load(model_dir, cache_gb, config=job_tier(tier))
    return Loaded(model, tokenizer, model_dir, context, budget)



def job_tier(tier: TierConfig) -> TierConfig:
    """``tier`` with the job's compute dtype where it names none (the one place that
    default is applied: :func:`mlx_tier.engine.dtypes.job_compute_dtype`)."""
    return tier if tier.dtype is not None else replace(tier, dtype=job_compute_dtype())


def planned_compute_of(config: JobConfig, model_dir: Path | None) -> dict:
    """``{"kernel", "dtype"}`` the run's model will compute with, before it loads
    (:func:`mlx_tier.engine.compute.planned_compute`)."""
    from mlx_tier.engine.compute import planned_compute

    tier = job_tier(config.tier)
    return planned_compute(tier.kernel, tier.dtype, tier.host_cache_gb, model_dir)


def loaded_compute(loaded: Loaded) -> dict | None:
    """``{"kernel", "dtype"}`` the loaded model computes with (as :func:`setup_record` says);
    ``None`` for a cache that does not say (a stand-in's)."""
    from mlx_tier.engine.compute import compute_fields

    kernel, dtype = getattr(loaded.cache, "kernel", None), getattr(loaded.cache, "dtype_name", None)
    return compute_fields(kernel, dtype) if isinstance(kernel, str) and isinstance(dtype, str) else None


def read_mode(model_dir: Path, budget: MemoryBudget, schedule: str, say: Callable[[str], None]) -> str:
    """How this run reads its experts (``TierConfig.page_cache``): around the page cache
    when its experts exceed all the process may hold and the schedule is the throughput
    one (:mod:`mlx_tier.policy.reads`), said in one line, unless the checkpoint's
    filesystem refuses direct reads; else through it. Asked only when the caller left
    ``TierConfig``'s ``read_method`` and ``page_cache`` at their defaults."""
    from mlx_tier.engine.checkpoint import index_checkpoint
    from mlx_tier.engine.limits import probe_limit
    from mlx_tier.engine.store import direct_reads_work
    from mlx_tier.policy.reads import DIRECT, KEEP, page_cache_for

    total = probe_limit().total
    if page_cache_for(schedule, budget.experts_on_disk, total) != DIRECT:
        return KEEP
    why = f"its experts' {budget.experts_on_disk / GIB:.2f} GiB exceed the {total / GIB:.2f} GiB this process may hold"
    if not direct_reads_work(sorted({info.file for info in index_checkpoint(model_dir).values()})):
        say(f"reads: through the page cache, though {why}: the model's filesystem refuses O_DIRECT")
        return KEEP
    say(f"reads: around the page cache (O_DIRECT): {why}")
    return DIRECT


def _cache_for_pools(budget: MemoryBudget, model_dir: Path, config: JobConfig, reporter: Reporter, tokenizer,
                     chars: int, documents: int, samples: list) -> MemoryBudget:
    """``budget`` with fewer expert slots when the pool model predicts more documents/hour from
    the KV room they leave (:mod:`mlx_tier.tools.pool_cache`), said in one line; else as it is.
    Documents are estimated as the scheduler sizes its pools (``chars`` at the ``samples``'
    characters per token, :mod:`mlx_tier.job.doc_tokens`, and the instruction's tokens,
    within the context); of unknown length, as ``plan``'s default. ``tokenizer``: the model's."""
    from mlx_tier.job.doc_tokens import chars_per_token, predicted_tokens
    from mlx_tier.tools.pool_cache import cache_for_pools, with_cache

    g = config.generation
    room = context_length(model_dir, FALLBACK_CONTEXT) - g.max_tokens  # the scheduler caps its estimate so
    per = chars_per_token(tokenizer, samples) if samples else None
    doc = predicted_tokens(chars, per) if chars else PLAN_DOC_TOKENS
    prompt = max(1, min(room, doc + predicted_tokens(len(g.instruction), per) + 16))
    found = cache_for_pools(model_dir, budget, prompt, g.max_tokens, documents, g.batch_size,
                            max_tok_s=config.throttle.max_tok_s)
    if found is None:
        return budget
    slots, plan, own = found
    new = with_cache(budget, slots)
    per_layer = f"{slots} slot{'' if slots == 1 else 's'} per layer"
    reporter.message(f"memory: expert cache {new.cache / GIB:.2f} GiB ({per_layer}) instead of "
                     f"{budget.cache / GIB:.2f}, for room to pool documents: predicted "
                     f"{rate_text(plan.docs_per_hour)} documents/hour against {rate_text(own.docs_per_hour)}")
    return new



def generation_for(config: JobConfig, budget: MemoryBudget | None) -> GenerationConfig:
    """The generation settings of this run: the prompt step no larger than the memory split allows."""
    g = config.generation
    if budget is None or budget.prefill_step >= g.prefill_step_size:
        return g
    return replace(g, prefill_step_size=budget.prefill_step)



def model_for(pending: list, config: JobConfig, reporter: Reporter, job: JobDir,
               model_dir: Path | None = None, pools: Callable[[], tuple[int, int, list]] | None = None
               ) -> Loaded | None:
    """The model when there is work, else ``None``: a rerun with nothing to do never loads
    it. A failed load frees the folder (and removes it when this run created it and left
    nothing else there)."""
    if not pending:
        return None
    try:
        return load_model(config, reporter, model_dir, pools)
    except BaseException:
        job.discard_if_unused()  # leave no trace of a run that never started
        raise



def setup_record(loaded: Loaded, config: JobConfig) -> dict:
    """The run's settings for report.json."""
    cache, g = loaded.cache, config.generation
    return {
        **machine_info(),
        "model": str(loaded.model_dir),
        "cache_budget_gib": round(cache.budget_bytes / 2**30, 4),
        "slots_per_layer": cache.slots_per_layer,
        "layer_slots": list(cache.layer_slots),
        "experts_per_layer": cache.num_experts,
        # all experts of all layers as stored: bytes_read beyond this are re-reads of evicted experts
        "expert_bytes_on_disk": sum(t.info.nbytes for layer in cache.layers for t in layer.tensors.values()),
        "policy": config.tier.policy.name,
        "prefetch": config.tier.prefetch,
        "read_ahead": config.tier.read_ahead,
        "page_cache": cache.store.page_cache,  # "direct": experts read around the page cache (read_mode)
        "kv_bits": g.kv_bits,  # None: KV caches unquantized (mlx_tier.job.quantized_kv)
        "kernel": getattr(cache, "kernel", config.tier.kernel),  # as chosen for this model (mlx_tier.kernels.registry.choose)
        "dtype": getattr(cache, "dtype_name", None),  # the cast made at load (mlx_tier.engine.dtypes)
        "max_tokens": g.max_tokens,
        "repetition_penalty": g.repetition_penalty,
        "prompt": g.instruction,
    }



def record_peak(report: JobReport, budget: MemoryBudget | None, reporter: Reporter) -> None:
    """The process's peak resident set against the run's memory total, in report.json and one line."""
    if budget is None:
        return
    peak = peak_rss()
    report.setup["memory_budget"]["peak_rss"] = peak
    reporter.message(f"memory: peak resident set {peak / GIB:.2f} GiB of the {budget.total / GIB:.2f} GiB total "
                     f"({named(budget.source)})")



def save_trace(cache, path: Path, reporter: Reporter) -> None:
    from mlx_tier.routing import trace

    try:
        trace.save(cache.stop_trace(), path)
    except OSError as e:
        reporter.message(f"could not write the trace {path}: {e.strerror or e}")



def save_profile(config: JobConfig, loaded: Loaded, report: JobReport, reporter: Reporter) -> None:
    from mlx_tier.routing import profile

    try:
        counts = profile.from_counts(loaded.cache.profile_counts(), source=str(config.input))
        where = profile.record(loaded.model_dir, counts)
        report.setup["profile_saved"] = str(where)
        reporter.message(f"expert use profile saved to {where}")
    except (OSError, profile.ProfileError) as e:
        reporter.message(f"could not save the expert use profile: {e}")
