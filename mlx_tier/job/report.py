"""What report.json holds: each document's result, the job's totals, one record per run.

Plain data (dataclasses) filled by the job runner (:mod:`mlx_tier.job.run`) and
read back by ``mlx-tier status``, the job page and the CLI's summary. A run's
speeds (output tok/s, documents/hour) are :mod:`mlx_tier.rates`'s, over its
generation time; loading is counted apart.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil

from mlx_tier.outdir.journal import written_by
from mlx_tier.rates import RunSpeed, generated_tokens


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
    parts_kept: int | None = None  # of its map-reduce calls, how many an earlier (stopped) run had finished
    kept_tokens: int | None = None  # of output_tokens, those of calls kept before (not generated for it by this run)
    earlier_run: bool = False  # done or failed by an earlier run (its figures from the journal)
    name: str | None = None  # the original id (relative path, JSONL custom_id/id) the output name came from
    converter: str | None = None  # how the text was read: "text (cp1252)", "markitdown 0.1.9 PdfConverter"...
    # What the summary was made from and with (mlx_tier.job.provenance); None: not recorded (an older version).
    made_from: dict | None = None  # {"sha256", "size", "mtime", "hashed"} of the source
    model: dict | None = None  # {"name", "weights"}: the model that wrote it
    prompt: str | None = None  # the instruction's hash (its text: report.json "prompts")
    kv_bits: int | None = None  # the KV caches' bits it was generated with; None: unquantized (not recorded)
    generation: dict | None = None  # {"max_tokens", "repetition_penalty", "context"} it was generated with
    compute: dict | None = None  # {"kernel", "dtype"} its model computed with (mlx_tier.engine.compute)
    redo: str | None = None  # this run redoes it: "stale" (its source changed) or "changed" (model or prompt)
    reused: str | None = None  # the id whose summary it got (the same content under another name)
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
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT/SIGTERM/SIGHUP), if any
    seconds: float = 0.0
    cache: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    throttle: dict = field(default_factory=dict)  # Throttle.as_dict(): time throttled/paused, timeline
    runs: list[dict] = field(default_factory=list)
    prompts: dict[str, str] = field(default_factory=dict)  # prompt hash -> instruction text, every run's
    load_seconds: float | None = None  # this run: from its start to its model loaded (monotonic)
    generation_seconds: float = 0.0  # this run: from its model loaded to its last document or stop (mlx_tier.rates)
    # this run: tokens of the calls of long documents it wrote and kept without finishing the
    # documents (stopped, or failed): generated now, counted in no document's figures
    partial_tokens: int = 0
    # What this run's walk of an INPUT folder (or stdin list) left out: reason or suffix -> files
    # (folders, for a folder's reasons), as mlx_tier.job.documents.skip_note says them.
    skipped_files: dict[str, int] = field(default_factory=dict)
    # The runner's own state of this run (mlx_tier.job.run.RunStart: triage counts, whether the
    # model was loaded; never the model itself), for its RunRecord; not in report.json.
    run: object = field(default=None, repr=False, compare=False)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    def this_run(self, status: str) -> int:
        """Documents that reached ``status`` in this run."""
        return sum(r.status == status and not r.earlier_run for r in self.results)

    @property
    def noun(self) -> str:
        """What the job's items are called: ``"request"`` for a batch request file's, else ``"document"``."""
        return "request" if self.setup.get("batch_requests") else "document"

    @property
    def output_tokens(self) -> int:
        """Tokens generated in this run (a document's calls kept by an earlier run, or taken
        from a copy's, are not generated again: ``kept_tokens``), those of the calls it kept
        for documents it did not finish included (``partial_tokens``)."""
        return sum(generated_tokens(r) for r in self.results if not r.earlier_run) + self.partial_tokens

    def as_dict(self) -> dict:
        finished = [r for r in self.results if r.status == "done"]
        totals = {s: self.count(s) for s in ("done", "failed", "pending")}
        totals |= {
            "documents": len(self.results),
            "chunked": sum(r.parts > 0 for r in self.results),
            "input_tokens": sum(r.input_tokens for r in finished),
            "output_tokens": sum(r.output_tokens for r in finished),
            "run_seconds": round(sum(r.get("seconds", 0.0) for r in self.runs), 3),
            # the speeds' own counts: every recorded run's work (a summary rewritten counts
            # each time; runs of other inputs into this folder too), not the documents above
            "runs_output_tokens": sum(r.get("output_tokens", 0) for r in self.runs),
            "runs_done": sum(r.get("done", 0) for r in self.runs),
            **self.speed().as_dict(),
            "interrupted": self.interrupted,
        }
        return {
            "documents": [asdict(r) for r in self.results],
            "totals": totals,
            "written_by": written_by(asdict(r) for r in finished),
            "prompts": self.prompts,
            "cache": self.cache,
            "throttle": self.throttle,
            "runs": self.runs,
            "skipped_files": self.skipped_files,
            **self.setup,
        }

    def speed(self) -> RunSpeed:
        """Every run's speed together (:mod:`mlx_tier.rates`): tokens and documents over the sum
        of the runs' generation times (documents of a batch overlap: over time, not per document).
        A run recorded before generation time was (an older version) counts its whole time."""
        return RunSpeed(sum(r.get("output_tokens", 0) for r in self.runs), sum(r.get("done", 0) for r in self.runs),
                        sum(r.get("generation_seconds", r.get("seconds", 0.0)) for r in self.runs),
                        sum(r.get("load_seconds") or 0.0 for r in self.runs))


def rerun_account(results: list[DocResult], found: dict) -> dict:
    """What a run did with earlier summaries (:class:`RunRecord` ``rerun``).

    Args:
        results: the job's documents after the run.
        found: the triage's counts (:func:`mlx_tier.job.rerun.rerun_counts`).

    Returns:
        ``redone_stale`` / ``redone_changed``: summaries the run rewrote because their
        document changed, or (asked to) their model or prompt; ``stale_left``: stale ones
        not redone (a stop, ``retry_failed``, a failure); ``kept_changed``, ``reused``,
        ``unstamped``: as found.
    """
    mine = [r for r in results if r.status == "done" and not r.earlier_run]
    stale = sum(r.redo == "stale" for r in mine)
    return {"redone_stale": stale, "redone_changed": sum(r.redo == "changed" for r in mine),
            "stale_left": found.get("stale", 0) - stale,
            **{k: found.get(k, 0) for k in ("kept_changed", "reused", "unstamped")}}


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


# What a run record rebuilt from the journal says of how its run ended (unreported_runs).
UNREPORTED = ("no record in report.json (the run was killed, crashed or stopped at once, or the file was "
              "replaced): rebuilt from its journal records, its time up to the last of them")


def unreported_runs(entries, known: set[str]) -> list[dict]:
    """Records of the runs that ended without writing report.json, rebuilt from the journal.

    A run whose ``start`` record says it reports itself (``reports``) and whose id is not
    in ``known`` (report.json's runs and this run's) was killed (SIGKILL, the OOM killer,
    a power loss), crashed, or stopped by a second interrupt: its summaries are in the
    journal, but its time and tokens would leave the job's totals. Each record has
    :class:`RunRecord`'s keys the journal can give, in file order: ``run``, ``started``,
    ``seconds`` (to its last record: at least what it ran), ``load_seconds`` (its start
    record's ``run_t``), ``done``/``failed`` (its document records, not the summaries it
    recovered or copied: earlier runs' work; a summary it renamed into place and a kill kept
    from its ``done`` record counts for it, by its ``writing`` record), ``output_tokens``
    (:func:`~mlx_tier.rates.generated_tokens` of its done records), the speeds over its
    generation time (model loaded to its last record: a killed run has no end of its own),
    its ``model`` and ``prompt``, and ``ended`` (:data:`UNREPORTED`).

    Args:
        entries: the job's journal records in file order (:meth:`Journal.entries`).
        known: run ids that have a record already.
    """
    starts: dict[str, dict] = {}
    mine: dict[str, list[dict]] = {}
    entries = list(entries)  # read twice
    for rec in [*entries, *_renamed_unrecorded(entries)]:
        run = rec.get("run")
        if not isinstance(run, str) or run in known:
            continue
        if rec.get("event") == "start" and rec.get("reports") is True:
            starts.setdefault(run, rec)
        mine.setdefault(run, []).append(rec)
    return [_rebuilt(run, start, mine[run]) for run, start in starts.items()]


def _renamed_unrecorded(entries: list[dict]) -> list[dict]:
    """A done record, in the name of the run that wrote it, for each summary a later run
    recovered (renamed into place, its ``done`` record lost to a kill): the recovered record,
    with the figures of the ``writing`` record that vouched for it, names that run
    (``written_in``). The recovering run did not write it."""
    return [{k: v for k, v in rec.items() if k not in ("recovered", "written_in")} | {"run": rec["written_in"]}
            for rec in entries if rec.get("recovered") and rec.get("status") == "done"
            and isinstance(rec.get("written_in"), str)]


def _rebuilt(run: str, start: dict, records: list[dict]) -> dict:
    """:func:`unreported_runs`' record of run ``run`` from its ``start`` and all its records."""
    load = float(start.get("run_t") or 0.0)
    docs = [r for r in records if r.get("status") in ("done", "failed") and "id" in r  # its own work: not
            and not r.get("recovered") and "reused" not in r]  # a crash's output recorded, nor a copy
    end = max((r.get("run_t", load) for r in records), default=load)  # it worked to its last record at least
    partial = sum(r["partial_tokens"] for r in records if r.get("event") == "stopped"  # long documents' kept calls
                  and isinstance(r.get("partial_tokens"), int))
    speed = RunSpeed(sum(generated_tokens(r) for r in docs) + partial, sum(r["status"] == "done" for r in docs),
                     max(0.0, end - load), load)
    began = float(start.get("started", 0.0)) - load  # the start record is written once the model is loaded
    return {"run": run, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(began)),
            "seconds": round(max((r.get("run_t", 0.0) for r in records), default=load), 3),
            "done": speed.documents, "failed": len(docs) - speed.documents, "loaded_model": True,
            "output_tokens": speed.output_tokens, **speed.as_dict(),
            **{k: start[k] for k in ("model", "prompt") if k in start}, "ended": UNREPORTED}


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
        seconds: the run's whole time, loading included (monotonic).
        load_seconds, generation_seconds: its two phases (:mod:`mlx_tier.rates`);
            the speeds are over ``generation_seconds``.
        done, failed: documents this run finished or failed.
        already_done: done by earlier runs, not regenerated.
        left_failed: failed earlier, not retried (no ``retry_failed``).
        left_pending: neither done nor failed, not tried: a ``retry_failed`` run tries
            failed documents only and leaves these for a plain rerun.
        output_tokens: tokens generated this run.
        throttled_seconds: time slowed, paused or capped by the throttle.
        cache: the cache's figures; ``None``: nothing to do, the model was not loaded.
        settings: :meth:`~mlx_tier.job.provenance.Settings.fields` of the run
            (``{}``: the model was not loaded).
        run: the run's id (:class:`~mlx_tier.outdir.journal.RunClock`), as its journal
            records carry it; ``None``: not given (a distributed run's launcher).
        rerun: what it did with earlier summaries: ``redone_stale``, ``redone_changed``
            (summaries it rewrote because their source, or their settings, changed), ``kept_changed`` (written with other settings, kept),
            ``reused`` (copied under a new name), ``unstamped`` (older records taken as current).
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
    load_seconds: float | None = None
    generation_seconds: float = 0.0
    settings: dict = field(default_factory=dict)
    rerun: dict = field(default_factory=dict)
    left_pending: int = 0
    run: str | None = None

    @classmethod
    def of(cls, report: JobReport, t_wall: float, cache, skipped: int, left_failed: int,
           settings: dict | None = None, rerun: dict | None = None, left_pending: int = 0,
           run: str | None = None) -> RunRecord:
        t = report.throttle
        return cls(time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_wall)), round(report.seconds, 3),
                   report.this_run("done"), report.this_run("failed"), skipped, left_failed, report.output_tokens,
                   t.get("throttled_seconds", 0.0) + t.get("paused_seconds", 0.0) + t.get("capped_seconds", 0.0),
                   CacheRecord.of(cache) if cache is not None else None, report.load_seconds,
                   report.generation_seconds, settings or {}, rerun or {}, left_pending, run)

    def speed(self) -> RunSpeed:
        return RunSpeed(self.output_tokens, self.done, self.generation_seconds, self.load_seconds)

    def as_dict(self) -> dict:
        d = {"run": self.run} if self.run is not None else {}
        d |= {k: getattr(self, k) for k in ("started", "seconds", "done", "failed", "already_done", "left_failed",
                                            "left_pending")}
        d |= {"loaded_model": self.cache is not None, "output_tokens": self.output_tokens, **self.speed().as_dict(),
              "throttled_seconds": self.throttled_seconds, **self.settings, **self.rerun}
        if self.cache is not None:
            c = self.cache
            d |= {"slots_per_layer": c.slots_per_layer, "cache_budget_gib": c.cache_budget_gib}
            if c.warm_slots is not None:
                d |= {"warm_slots": c.warm_slots, "host_cache_budget_gib": c.host_cache_budget_gib}
            d |= {"cache": c.counters, "expert_use": c.expert_use}
        return d
