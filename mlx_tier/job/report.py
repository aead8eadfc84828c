"""What report.json holds: each document's result, the job's totals, one record per run.

Plain data (dataclasses) filled by the job runner (:mod:`mlx_tier.job.run`) and
read back by ``mlx-tier status``, the job page and the CLI's summary.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil


@dataclass
class DocResult:
    """Outcome of one document (one entry of report.json)."""

    id: str
    status: str  # the document's state now: done | failed | pending (not reached yet)
    source: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    # The document's own time: its prompt-reading steps plus the decode steps it took
    # part in (a decode step serves the whole batch); not the time since the batch began.
    doc_seconds: float = 0.0
    error: str | None = None
    output: str | None = None
    finish_reason: str | None = None  # "stop" (end of text) or "length" (hit --max-tokens)
    parts: int = 0  # > 0: too long for the context, summarised by map-reduce over this many parts
    earlier_run: bool = False  # done or failed by an earlier run (its figures from the journal)
    name: str | None = None  # the original id (relative path, JSONL custom_id/id) the output name came from
    converter: str | None = None  # how the text was read: "text (cp1252)", "markitdown 0.1.9 PdfConverter"...
    error_code: str | None = None  # a failed batch request: the API's error code ("server_error": generating failed)
    error_param: str | None = None  # ... and the body parameter at fault, if one is


@dataclass
class JobReport:
    """Everything report.json holds.

    ``results`` covers every document of the job by its state now (a document
    done by an earlier run is ``done`` with ``earlier_run`` true and its figures
    from the journal), so ``totals`` tell the job's truth after any rerun;
    ``runs`` keeps one record per run (this one last: what it did itself) so a
    rerun never loses a run's measurements; ``cache`` sums the cache counters
    over all runs.
    """

    results: list[DocResult] = field(default_factory=list)
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT/SIGTERM), if any
    seconds: float = 0.0
    cache: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    throttle: dict = field(default_factory=dict)  # Throttle.as_dict(): time throttled/paused, timeline
    runs: list[dict] = field(default_factory=list)
    # The runner's own state of this run (mlx_tier.job.run.RunStart: triage counts, whether the
    # model was loaded; never the model itself), for its RunRecord; not in report.json.
    run: object = field(default=None, repr=False, compare=False)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def this_run(self, status: str) -> int:
        """Documents that reached ``status`` in this run."""
        return sum(r.status == status and not r.earlier_run for r in self.results)

    @property
    def output_tokens(self) -> int:
        """Tokens generated in this run."""
        return sum(r.output_tokens for r in self.results if r.status == "done" and not r.earlier_run)

    def as_dict(self) -> dict:
        finished = [r for r in self.results if r.status == "done"]
        out_tokens = sum(r.output_tokens for r in finished)
        # Documents of a batch overlap in time: throughput is over the runs' wall time.
        run_tokens = sum(r.get("output_tokens", 0) for r in self.runs)
        run_seconds = sum(r.get("seconds", 0.0) for r in self.runs)
        totals = {s: self.count(s) for s in ("done", "failed", "pending")}
        totals |= {
            "documents": len(self.results),
            "chunked": sum(r.parts > 0 for r in self.results),
            "input_tokens": sum(r.input_tokens for r in finished),
            "output_tokens": out_tokens,
            "run_seconds": round(run_seconds, 3),
            "output_tok_per_s": round(run_tokens / run_seconds, 3) if run_seconds else 0.0,
            "interrupted": self.interrupted,
        }
        return {
            "documents": [asdict(r) for r in self.results],
            "totals": totals,
            "cache": self.cache,
            "throttle": self.throttle,
            "runs": self.runs,
            **self.setup,
        }


# CacheStats counters that add up across runs (ratios are recomputed).
COUNTERS = ("hits", "misses", "evictions", "bytes_read", "read_seconds", "rounds", "prewarmed", "prewarm_bytes",
            "prewarm_seconds", "prefetch_predicted", "prefetch_used", "prefetch_wasted_bytes", "stall_seconds")


def previous_runs(path: Path) -> list[dict]:
    """The ``runs`` of an earlier report.json, if readable."""
    try:
        runs = json.loads(path.read_text()).get("runs", [])
        return [r for r in runs if isinstance(r, dict)]
    except (OSError, ValueError, AttributeError):
        return []


def sum_cache(runs: list[dict]) -> dict:
    """Cache counters summed over runs, hit rate recomputed."""
    total = {k: sum(r.get("cache", {}).get(k, 0) for r in runs) for k in COUNTERS}
    seen = total["hits"] + total["misses"]
    total["hit_rate"] = total["hits"] / seen if seen else 0.0
    total["prefetch_precision"] = total["prefetch_used"] / total["prefetch_predicted"] if total["prefetch_predicted"] else 0.0
    total["prefetch_recall"] = total["prefetch_used"] / total["misses"] if total["misses"] else 0.0
    from mlx_tier.engine.two_tier import TIER_COUNTERS

    total.update({k: sum(r.get("cache", {}).get(k, 0) for r in runs) for k in TIER_COUNTERS
                  if any(k in r.get("cache", {}) for r in runs)})
    return total


def backend_name() -> str:
    """``"metal"``, ``"cuda"`` or ``"cpu"``: where MLX runs by default."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if getattr(mx, "cuda", None) is not None and mx.cuda.is_available() else "gpu"


def machine_info() -> dict:
    """Machine, backend and library versions for the report."""
    import mlx_lm

    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.machine(),
            "cpu_count": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 2),
        },
        "backend": backend_name(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
    }


@dataclass(frozen=True)
class CacheRecord:
    """The expert cache's part of a run record (a run that loaded the model).

    Attributes:
        slots_per_layer: layer 0's slots (``layer_slots`` in the setup has each layer's).
        cache_budget_gib: the (hot) cache budget, GiB.
        counters: :meth:`CacheStats.as_dict` plus ``resident_bytes_max`` and ``budget_bytes``.
        expert_use: ``[L, E]`` uses this run (the watch page's heatmap).
        warm_slots, host_cache_budget_gib: the warm host tier of the CUDA path, if any.
    """

    slots_per_layer: int
    cache_budget_gib: float
    counters: dict
    expert_use: list
    warm_slots: list[int] | None = None
    host_cache_budget_gib: float | None = None

    @classmethod
    def of(cls, cache) -> CacheRecord:
        two_tier = hasattr(cache, "warm_slots")
        return cls(cache.slots_per_layer, round(cache.budget_bytes / 2**30, 4),
                   {**cache.stats.as_dict(), "resident_bytes_max": cache.resident_bytes,
                    "budget_bytes": cache.budget_bytes},
                   cache.profile_counts().tolist(),
                   list(cache.warm_slots) if two_tier else None,
                   round(cache.warm_budget_bytes / 2**30, 4) if two_tier else None)


@dataclass(frozen=True)
class RunRecord:
    """What one run did itself: one entry of report.json's ``runs`` (:meth:`as_dict`).

    Attributes:
        started: local start time, ISO 8601.
        seconds: the run's wall time.
        done, failed: documents this run finished or failed.
        already_done: done by earlier runs, not regenerated.
        left_failed: failed earlier, not retried (no ``retry_failed``).
        output_tokens: tokens generated this run.
        throttled_seconds: time slowed, paused or capped by the throttle.
        cache: the cache's figures; ``None``: nothing to do, the model was not loaded.
    """

    started: str
    seconds: float
    done: int
    failed: int
    already_done: int
    left_failed: int
    output_tokens: int
    throttled_seconds: float
    cache: CacheRecord | None = None

    @classmethod
    def of(cls, report: JobReport, t_wall: float, cache, skipped: int, left_failed: int) -> RunRecord:
        t = report.throttle
        return cls(time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_wall)), round(report.seconds, 3),
                   report.this_run("done"), report.this_run("failed"), skipped, left_failed, report.output_tokens,
                   t.get("throttled_seconds", 0.0) + t.get("paused_seconds", 0.0) + t.get("capped_seconds", 0.0),
                   CacheRecord.of(cache) if cache is not None else None)

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("started", "seconds", "done", "failed", "already_done", "left_failed")}
        d |= {"loaded_model": self.cache is not None, "output_tokens": self.output_tokens,
              "output_tok_per_s": round(self.output_tokens / self.seconds, 3) if self.seconds else 0.0,
              "throttled_seconds": self.throttled_seconds}
        if self.cache is not None:
            c = self.cache
            d |= {"slots_per_layer": c.slots_per_layer, "cache_budget_gib": c.cache_budget_gib}
            if c.warm_slots is not None:
                d |= {"warm_slots": c.warm_slots, "host_cache_budget_gib": c.host_cache_budget_gib}
            d |= {"cache": c.counters, "expert_use": c.expert_use}
        return d
