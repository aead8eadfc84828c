"""The main job: summarise every document of an input with a tiered model.

Resumable (journal), atomic (outputs appear only complete), interruptible
(SIGINT/SIGTERM stop after the documents in progress). The CLI is a thin layer
over :func:`run_job`; progress goes to a :class:`Reporter`.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil

from .checkpoint import context_length
from .documents import InputError, discover, discover_list
from .errors import JobError
from .job_view import progress_sample
from .journal import (
    DISK_FULL,
    Journal,
    JsonlSummaries,
    remove_stale_temps,
    write_atomic,
)
from .longdoc import build_prompt, trim_to_sentence  # noqa: F401 - part of this module's API
from .outdir import check_out_dir
from .policy import DEFAULT_POLICY
from .process import DEFAULT_NICE, keep_awake, lower_priority
from .scheduler import GenerationConfig, Outcome, Scheduler, check_context
from .status import LOCK, JobInfo, ProgressFile, write_input_list
from .throttle import Throttle, ThrottleConfig

DEFAULT_PROMPT = (
    "Summarise the following document in three to five sentences. "
    "Say what it is, its main points, and any conclusion."
)
DEFAULT_MAX_TOKENS = 160
# Small models fall into loops under pure greedy decoding; mlx-lm's repetition
# penalty (over the last 20 tokens) breaks them. 1.0 turns it off.
DEFAULT_REPETITION_PENALTY = 1.1
REPORT = "report.json"
# When the checkpoint states no context length.
FALLBACK_CONTEXT = 4096


@dataclass(frozen=True)
class JobConfig:
    """What to summarise, where, and with which model.

    Attributes:
        input: folder (recursive .txt/.md) or JSONL file (``id``, ``text``).
        out_dir: summaries go to ``out_dir/<id>.md``; journal and report beside them.
        model: mlx-lm MoE checkpoint directory; ``None``: the built-in demo model.
        cache_gb: expert cache budget in GiB; ``None``: from free memory.
        max_tokens: most tokens generated per summary.
        prompt: the instruction placed before each document.
        repetition_penalty: mlx-lm's repetition penalty (1.0: plain greedy).
        trace: write this run's routing trace (:mod:`mlx_tier.trace`) here.
        input_paths: a list of file paths to summarise instead of ``input``
            (``mlx-tier run -`` reads it from stdin; kept in ``OUT_DIR/inputs.txt``).
        output_format: ``md`` (``<id>.md`` files) or ``jsonl`` (also
            ``OUT_DIR/summaries.jsonl``, one line per finished document).
        retry_failed: run only the documents that failed in an earlier run
            (a plain rerun runs pending documents and keeps failed ones failed).
        command: the command line that resumes this job, recorded in
            the journal's ``start`` record for ``mlx-tier status``.
        batch_size: documents decoded together; ``None``: from memory headroom (at most 8).
        context: usable context in tokens; ``None``: the model's. Longer
            documents are summarised by map-reduce (:mod:`mlx_tier.longdoc`).
        prefill_step_size: prompt tokens per forward call during prefill.
        reuse_prefix: prefill the shared instruction prefix once (mlx-lm prompt cache).
        throttle: the thermal-aware throttle's settings (:mod:`mlx_tier.throttle`).
        nice: CPU priority decrease (``os.nice`` increment; 0 = unchanged).
        background_qos: macOS background QoS (slows Metal ~8x; off by default).
        policy: expert cache eviction policy (``lru``, ``lfu``, ``2q``, ``pinned``).
        prewarm: fill the cache at load with the saved profile's most used
            experts (``None``: only for ``pinned``; :mod:`mlx_tier.profile`).
        save_profile: after the run, add its expert use counts to the
            checkpoint's saved profile (next to it, or in the user cache).
        prefetch: read the next layer's predicted experts in the background
            (``None``: :data:`mlx_tier.tiered.DEFAULT_PREFETCH`).
        follow_links: read links in an INPUT folder that lead outside it.
        kernel: what computes the experts (:mod:`mlx_tier.kernels`); ``auto``:
            the CPU kernel on MLX's CPU backend (README, "CPU expert kernel").
    """

    input: Path
    out_dir: Path
    model: Path | None = None
    cache_gb: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    prompt: str = DEFAULT_PROMPT
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    trace: Path | None = None
    input_paths: tuple[str, ...] | None = None
    output_format: str = "md"
    retry_failed: bool = False
    command: str | None = None
    batch_size: int | None = None
    context: int | None = None
    prefill_step_size: int = 512
    reuse_prefix: bool = True
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    nice: int = DEFAULT_NICE
    background_qos: bool = False
    policy: str = DEFAULT_POLICY
    prewarm: bool | None = None
    save_profile: bool = False
    prefetch: bool | None = None
    host_cache_gb: float | None = None  # warm host tier of the CUDA path (TierConfig.host_cache_gb)
    follow_links: bool = False
    kernel: str = "auto"


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


def _earlier_setup(config: JobConfig) -> tuple[dict, dict]:
    """``(setup, throttle)`` of the job's last report.json (a rerun that loads no
    model keeps them), with this machine's facts; minimal if there is none."""
    try:
        earlier = json.loads((config.out_dir / REPORT).read_text())
        earlier = earlier if isinstance(earlier, dict) else {}
    except (OSError, ValueError):
        earlier = {}
    own = ("documents", "totals", "cache", "throttle", "runs")
    setup = {k: v for k, v in earlier.items() if k not in own}
    setup |= {**machine_info(), "model": setup.get("model") or (str(config.model) if config.model is not None else "demo")}
    throttle = earlier.get("throttle")
    return setup, throttle if isinstance(throttle, dict) else {}


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
    from .two_tier import (
        TIER_COUNTERS,  # per-tier hits of the two-tier cache, when a run had one
    )

    total.update({k: sum(r.get("cache", {}).get(k, 0) for r in runs) for k in TIER_COUNTERS
                  if any(k in r.get("cache", {}) for r in runs)})
    return total


@dataclass(frozen=True)
class Activity:
    """What the job is doing, after an engine step (for progress displays and ``mlx-tier status``).

    Attributes:
        in_flight: ids of the documents started and not finished.
        reading: ``(id, prompt tokens read, prompt length)`` of the prompt being read, or ``None``.
        writing: ``(id, tokens generated so far)`` of each document being written.
        decode_tok_s: generated tokens per second over recent decode steps (all documents).
        prompt_tok_s: prompt tokens read per second over recent steps.
        hit_rate: expert cache hit rate of this run so far, in [0, 1].
    """

    in_flight: list[str]
    reading: tuple[str, int, int] | None
    writing: list[tuple[str, int]]
    decode_tok_s: float
    prompt_tok_s: float
    hit_rate: float

    def as_dict(self) -> dict:
        return {"in_flight": self.in_flight, "reading": list(self.reading) if self.reading else None,
                "writing": [list(w) for w in self.writing], "decode_tok_s": round(self.decode_tok_s, 3),
                "prompt_tok_s": round(self.prompt_tok_s, 3), "hit_rate": round(self.hit_rate, 4)}


class Reporter:
    """Receives progress events; the CLI shows them with Rich. Default: silent."""

    def message(self, text: str) -> None: ...
    def start(self, total: int, skipped: int) -> None:
        """``total`` documents in the job, ``skipped`` of them done by earlier runs."""
    def working(self, activity: Activity) -> None:
        """After each engine step (a few seconds apart at most: :data:`~mlx_tier.generation.STEP_SECONDS`)."""
    def finished(self, result: DocResult, cache: dict) -> None: ...
    def close(self) -> None: ...


class Interrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: abandon the documents in progress now. ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# After a second signal, how long the main thread has to stop by itself (raising
# Interrupted between Python bytecodes) before the watchdog ends the process.
HARD_STOP_GRACE_SECONDS = 1.0


class StopFlag:
    """Set by SIGINT/SIGTERM: finish the documents in progress, start no new one, then stop.

    A second signal stops at once. Python runs signal handlers only between
    bytecodes of the main thread, so during a long MLX call (a prompt step can
    take minutes on a CPU) the handler waits, and two signals that arrive
    meanwhile run it once. So the signals are also counted where they arrive:
    Python's C-level handler writes one byte per signal to a wakeup fd
    (``signal.set_wakeup_fd``), which a watchdog thread reads. At the second
    signal the main thread gets :data:`HARD_STOP_GRACE_SECONDS` to raise
    :class:`Interrupted` itself (restoring the default handler, so a third
    signal kills); if it has not left the ``with`` block by then, the watchdog
    calls ``on_abort(signum)`` and ends the process (``os._exit``, 128 +
    signum). Finished summaries are safe either way: each was written
    atomically and journalled (fsync) before it was reported.
    """

    def __init__(self, on_first=lambda: None, on_abort=lambda signum: None) -> None:
        self.signal: int | None = None
        self._old: dict = {}
        self._on_first, self._on_abort = on_first, on_abort
        self._active = False
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no clean stop
                return self
        self._active = True
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="mlx-tier-stop-watchdog", daemon=True).start()
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise Interrupted(signum)
        self.signal = signum
        self._on_first()

    def _watch(self, fd: int) -> None:
        """Count SIGINT/SIGTERM as they arrive; at the second, stop the process if the main thread does not."""
        seen = 0
        with os.fdopen(fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):  # b"" once __exit__ closes the write end
                seen = self._count(data, seen)

    def _count(self, data: bytes, seen: int) -> int:
        for signum in data:
            if signum in (signal.SIGINT, signal.SIGTERM):
                seen += 1
                if seen >= 2:
                    time.sleep(HARD_STOP_GRACE_SECONDS)
                    if self._active:
                        self._on_abort(signum)
                        os._exit(128 + signum)
        return seen

    def __exit__(self, *exc):
        self._active = False
        if self._pipe is not None:
            signal.set_wakeup_fd(self._old_wakeup)
            os.close(self._pipe[1])  # the watchdog reads end-of-file and returns
            self._pipe = None
        for sig, old in self._old.items():
            signal.signal(sig, old)


def prepare_out_dir(out_dir: Path) -> bool:
    """Create ``out_dir`` and check it is writable.

    Returns:
        whether it was created now.
    Raises:
        InputError: it cannot be created or written.
    """
    import tempfile

    created = not out_dir.exists()
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: is a file; the output must be a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir) as probe:  # a fresh name: no planted link is followed
            probe.write(b"ok")
    except OSError as e:
        raise InputError(f"{out_dir}: output folder not writable ({e.strerror or e})") from None
    return created



def lock_out_dir(out_dir: Path):
    """An exclusive lock on ``OUT_DIR`` (``flock``): a second run on the same
    folder while one is active is refused. Released when the file is closed
    or the process ends (even by SIGKILL).

    Raises:
        InputError: another run holds it.
    """
    f = os.fdopen(os.open(out_dir / LOCK, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0),
                          0o666), "a")
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no flock (Windows): no protection
        pass
    except OSError:
        f.close()
        raise InputError(f"{out_dir}: another mlx-tier run is using this output folder") from None
    return f


def read_prompt(value: str) -> str:
    """``--prompt`` value: literal text, or ``@FILE`` to read it from a file.

    Raises:
        InputError: the file is missing, unreadable or empty.
    """
    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read prompt file ({e})") from None
    if not text:
        raise InputError(f"{path}: prompt file is empty")
    return text


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


# What fails one document without stopping the job. MLX's out-of-memory errors
# surface as RuntimeError ("[metal::malloc] ...", "[malloc] ...") or, from a
# C++ std::bad_alloc, as MemoryError; tokenizer and disk-full errors vary. So
# any Exception; KeyboardInterrupt/SystemExit (BaseException) still stop the job.
DOCUMENT_ERRORS: tuple[type[BaseException], ...] = (Exception,)


class _Rate:
    """Generated tokens per second over the recent decode steps (exponential average)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.value, self._w = 0.0, weight

    def add(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            now = tokens / seconds
            self.value = now if not self.value else (1 - self._w) * self.value + self._w * now


def _record(outcome: Outcome, res: DocResult, out_dir: Path) -> None:
    """Write a finished summary (atomically) and fill ``res``; a write error fails the document.

    Raises:
        JobError: the disk is full (the document stays pending: no later one could be written either).
    """
    res.input_tokens, res.output_tokens, res.parts = outcome.input_tokens, outcome.output_tokens, outcome.parts
    res.doc_seconds, res.finish_reason = round(outcome.seconds, 3), outcome.finish_reason
    if outcome.status != "done":
        res.status, res.error = "failed", outcome.error
        return
    try:
        write_atomic(out_dir / f"{res.id}.md", outcome.summary + "\n")
        res.status, res.output = "done", f"{res.id}.md"
    except OSError as e:
        if e.errno in DISK_FULL:
            raise JobError(f"{e.filename}: {e.strerror}; the job stopped (finished summaries are kept)") from None
        res.status, res.error = "failed", f"cannot write the summary: {type(e).__name__}: {e}"
    except DOCUMENT_ERRORS as e:
        res.status, res.error = "failed", f"cannot write the summary: {type(e).__name__}: {e}"


def _summarise_all(todo, results: dict, config: JobConfig, model, tokenizer, model_dir: Path, journal: Journal,
                   reporter: Reporter, stopping, setup: dict, share=None) -> dict:
    """Generate every document of ``todo`` (batched, throttled), writing and journalling each as it
    finishes; fills ``results``. Returns the throttle's account (:meth:`Throttle.as_dict`)."""
    try:
        warning = lower_priority(config.nice, config.background_qos)
    except (OSError, subprocess.SubprocessError) as e:  # e.g. taskpolicy missing or refused
        warning = f"could not lower the job's priority: {e}"
    if warning:
        reporter.message(warning)
    throttle = Throttle(config.throttle, should_stop=stopping)
    generation = GenerationConfig(
        config.prompt, config.max_tokens, config.repetition_penalty, config.batch_size, config.context,
        config.prefill_step_size, config.reuse_prefix,
    )
    scheduler = Scheduler(model, tokenizer, model_dir, context_length(model_dir, FALLBACK_CONTEXT), generation)
    scheduler.size_batch(todo)
    setup["generation"] = scheduler.info
    reporter.message(
        f"batch size {scheduler.batch_size} ({scheduler.info['batch_size_from']}), "
        f"usable context {scheduler.context} tokens"
    )
    rate, prompt_rate = _Rate(), _Rate()
    progress = ProgressFile(config.out_dir)
    generated = [0]  # tokens generated this run, for the samples the watch page plots

    def on_step(info, in_flight):
        rate.add(info.generated, info.decode_seconds)
        prompt_rate.add(info.prefill_tokens, info.prefill_seconds)
        generated[0] += info.generated
        activity = Activity(in_flight, info.prefill[-1] if info.prefill else None, info.generating,
                            rate.value, prompt_rate.value, model.expert_cache.stats.hit_rate)
        reporter.working(activity)
        progress.update(activity)
        seen = len(throttle.timeline)
        throttle.step(info.generated)
        for change in throttle.timeline[seen:]:  # thermal state changes: durable, for `mlx-tier status`
            journal.append({"event": "thermal", **change})
            if change["mode"] != "full":
                reporter.message(f"throttle: {change['mode']} ({change['reason']})")

    throttled_before = 0.0
    for outcome in scheduler.run(todo, should_stop=stopping, on_step=on_step, share=share):  # issue 16: share
        res = results[outcome.id]
        _record(outcome, res, config.out_dir)
        spent = throttle.throttled_seconds + throttle.paused_seconds + throttle.capped_seconds
        record = {k: v for k, v in asdict(res).items() if v is not None and k != "source"}
        # Per-record increment: `mlx-tier status` adds them up.
        record["throttled_seconds"] = round(spent - throttled_before, 3)
        throttled_before = spent
        record["sample"] = progress_sample(model.expert_cache, rate.value, generated[0])
        if outcome.reasoning:
            record["reasoning"] = outcome.reasoning
        journal.append(record)
        reporter.finished(res, model.expert_cache.stats.as_dict())
    progress.clear()
    return throttle.as_dict()


def _attempted_ids(journal: Journal | None) -> set[str]:
    """Ids an earlier run of this job named (its start record) or recorded."""
    ids: set[str] = set()
    for rec in journal.entries() if journal is not None else ():
        ids.update(x for x in (rec.get("ids") or []) + (rec.get("todo") or []) if isinstance(x, str))
        if isinstance(rec.get("id"), str):
            ids.add(rec["id"])
    return ids


def _foreign_outputs(out_dir: Path, attempted: set[str]) -> dict[str, str]:
    """``<stem>.md`` entries in ``out_dir`` that no run of this job wrote (a user's
    own files), as reserved names for :func:`mlx_tier.naming.assign` (keys no
    document can have), so that no document's output is named after them."""
    if not out_dir.is_dir():
        return {}
    return {f"\0{p.name}": p.stem for p in out_dir.glob("*.md") if p.stem not in attempted}


def _triage(docs, records: dict, config: JobConfig, journal: Journal, results: dict,
            attempted: set[str] = frozenset()) -> tuple[list, list]:
    """Sort the job's documents by their journal state; fills ``results``.

    Returns:
        ``(todo, failed_earlier)``: documents to run now, ids left failed.
    """
    todo, failed_earlier = [], []
    for d in docs:
        out_path = config.out_dir / f"{d.id}.md"
        rec = records.get(d.id)
        res = results[d.id]
        if rec and rec.get("status") == "done" and out_path.exists():
            keep = {k: rec[k] for k in ("input_tokens", "output_tokens", "doc_seconds", "finish_reason", "parts")
                    if k in rec}
            res.__dict__.update(status="done", output=out_path.name, earlier_run=True, **keep)
        elif d.id in attempted and out_path.is_file() and not out_path.is_symlink():
            # Complete (written atomically) but unrecorded: a crash after the
            # rename. Record it; never regenerate a finished output. (A file
            # no run of this job wrote was reserved at naming: never adopted.)
            journal.append({"id": d.id, "status": "done", "output": out_path.name, "recovered": True, "name": d.name})
            res.__dict__.update(status="done", output=out_path.name, earlier_run=True)
        elif rec and rec.get("status") == "failed" and not config.retry_failed:
            # Failed in an earlier run: stays failed until --retry-failed.
            keep = {k: rec[k] for k in ("input_tokens", "doc_seconds") if k in rec}
            res.__dict__.update(status="failed", error=rec.get("error"), earlier_run=True, **keep)
            failed_earlier.append(d.id)
        elif config.retry_failed and not (rec and rec.get("status") == "failed"):
            continue  # pending: left for a plain rerun
        else:
            todo.append(d)
    return todo, failed_earlier


def _load_model(config: JobConfig, reporter: Reporter, prefetch: bool):
    """The tiered model, with the context checked before any document.

    Returns:
        ``(model, tokenizer, model_dir)``.
    """
    from .demo_model import ensure_demo_model
    from .hub import resolve_model
    from .tiered import TierConfig, load

    model_dir = resolve_model(config.model) if config.model is not None else ensure_demo_model(reporter.message)
    reporter.message(f"loading {model_dir}")
    model, tokenizer = load(model_dir, cache_gb=config.cache_gb,
                            config=TierConfig(policy=config.policy, prewarm=config.prewarm, prefetch=prefetch,
                                              host_cache_gb=config.host_cache_gb, kernel=config.kernel))
    model_context = context_length(model_dir, FALLBACK_CONTEXT)
    context = min(model_context, config.context or model_context)
    check_context(tokenizer, config.prompt, config.max_tokens, context)  # before any document
    return model, tokenizer, model_dir


def _model_for(todo: list, config: JobConfig, reporter: Reporter, prefetch: bool, created: bool, lock):
    """``(model, tokenizer, model_dir)`` when there is work, else ``(None, None, None)``: a rerun
    with nothing to do never loads the model. A failed load frees the folder (and removes
    it when this run created it and left nothing else there)."""
    if not todo:
        return None, None, None
    try:
        return _load_model(config, reporter, prefetch)
    except BaseException:
        lock.close()
        if created and [p.name for p in config.out_dir.iterdir()] == [LOCK]:
            (config.out_dir / LOCK).unlink()
            config.out_dir.rmdir()  # leave no trace of a run that never started
        raise


def _setup(model_dir, cache, config: JobConfig, prefetch: bool) -> dict:
    """The run's settings for report.json."""

    return {
        **machine_info(),
        "model": str(model_dir),
        "cache_budget_gib": round(cache.budget_bytes / 2**30, 4),
        "slots_per_layer": cache.slots_per_layer,
        "layer_slots": list(cache.layer_slots),
        "experts_per_layer": cache.num_experts,
        # all experts of all layers as stored: bytes_read beyond this are re-reads of evicted experts
        "expert_bytes_on_disk": sum(t.info.nbytes for layer in cache.layers for t in layer.tensors.values()),
        "policy": config.policy,
        "prefetch": prefetch,
        "kernel": getattr(cache, "kernel", config.kernel),  # as chosen for this model (mlx_tier.kernels.choose)
        "max_tokens": config.max_tokens,
        "repetition_penalty": config.repetition_penalty,
        "prompt": config.prompt,
    }
def _write_report_page(out_dir: Path, reporter: Reporter) -> None:
    """``OUT_DIR/report.html`` (:mod:`mlx_tier.report_page`); a failure to write it only warns."""
    from .report_page import write_report_html

    try:
        write_report_html(out_dir)
    except (OSError, ValueError) as e:
        reporter.message(f"could not write report.html: {e}")


def run_job(config: JobConfig, reporter: Reporter | None = None) -> JobReport:
    """Summarise every document of ``config.input`` not already done.

    With nothing left to do (every document done, or failed without
    ``retry_failed``), the model is not loaded: report.json is rewritten
    with the job's totals and a run record that did nothing.

    Raises:
        InputError: bad input or output folder (nothing is generated).
        mlx_tier.CheckpointError, mlx_tier.BudgetError: unusable model or budget.
        KeyboardInterrupt: a second interrupt; finished outputs are kept.
    """
    from .tiered import DEFAULT_PREFETCH

    reporter = reporter or Reporter()
    prefetch = DEFAULT_PREFETCH if config.prefetch is None else config.prefetch
    t_start, t_wall = time.perf_counter(), time.time()
    check_out_dir(config.out_dir, config.input if config.input_paths is None else None)
    earlier = Journal(config.out_dir) if config.out_dir.is_dir() else None
    attempted = _attempted_ids(earlier)
    # Each document keeps its output name; a user's own <name>.md in OUT_DIR is never taken.
    previous = {**(earlier.names() if earlier is not None else {}), **_foreign_outputs(config.out_dir, attempted)}
    docs = (discover_list(config.input_paths, exclude=config.out_dir, previous=previous)
            if config.input_paths is not None
            else discover(config.input, exclude=config.out_dir, follow_links=config.follow_links, previous=previous))
    if config.trace is not None and not os.access(Path(config.trace).parent.resolve(), os.W_OK):
        raise InputError(f"{config.trace}: cannot write the trace there (folder missing or not writable)")
    created = prepare_out_dir(config.out_dir)
    lock = lock_out_dir(config.out_dir)  # held until the process exits
    remove_stale_temps(config.out_dir)  # a killed run's half-written outputs
    summaries = JsonlSummaries(config.out_dir, docs) if config.output_format == "jsonl" else None
    journal = Journal(config.out_dir, on_done=summaries.add if summaries is not None else None)
    records = journal.records()
    for warning in journal.warnings.values():
        reporter.message(f"journal: {warning}")
    results = {d.id: DocResult(d.id, "pending", d.source, name=d.name, converter=d.converter) for d in docs}
    report = JobReport(results=list(results.values()))
    todo, failed_earlier = _triage(docs, records, config, journal, results, attempted)
    model, tokenizer, model_dir = _model_for(todo, config, reporter, prefetch, created, lock)
    cache = model.expert_cache if model is not None else None
    if model is not None:
        report.setup = _setup(model_dir, cache, config, prefetch)
    else:  # nothing to do: the job's setup and throttle account stay as the last run wrote them
        report.setup, report.throttle = _earlier_setup(config)
    skipped = sum(r.status == "done" for r in report.results)
    if summaries is not None:
        summaries.sync(journal.records())
    if todo or not records:  # a rerun with nothing to do starts no run (status keeps the last one)
        JobInfo(
            input=str(config.input), ids=[d.id for d in docs], todo=[d.id for d in todo], started=time.time(),
            pid=os.getpid(), command=config.command, output_format=config.output_format,
        ).write(journal)
    if config.input_paths is not None:
        write_input_list(config.out_dir, docs)
    if failed_earlier:
        reporter.message(f"{len(failed_earlier)} document(s) failed in an earlier run; not retried "
                         "(rerun with --retry-failed to retry only those)")
    if config.retry_failed:
        reporter.message(f"--retry-failed: retrying {len(todo)} failed document(s); pending ones are left for a plain rerun")
    reporter.start(total=len(todo) + skipped, skipped=skipped)
    if todo:
        _run_todo(todo, results, config, model, tokenizer, model_dir, journal, reporter, report, lock)
    report.seconds = time.perf_counter() - t_start
    report.runs = previous_runs(config.out_dir / REPORT) + [_run_record(report, t_wall, cache, skipped, failed_earlier)]
    report.cache = sum_cache(report.runs)
    if cache is not None:
        report.cache |= {"resident_bytes_max": cache.resident_bytes, "budget_bytes": cache.budget_bytes}
    if config.save_profile and report.output_tokens:
        _save_profile(config, model_dir, cache, report, reporter)
    try:
        write_atomic(config.out_dir / REPORT, json.dumps(report.as_dict(), indent=2) + "\n")
    finally:  # disk full: the folder is free for the rerun all the same
        lock.close()
    _write_report_page(config.out_dir, reporter)  # after the lock: the page reads the job as not running
    reporter.close()
    return report


def _run_todo(todo, results, config: JobConfig, model, tokenizer, model_dir, journal, reporter, report, lock,
              share=None) -> None:
    """Generate ``todo`` under the stop flag (first signal: stop after the step; second: at once).
    ``share``: issue 16, a rank's part of a distributed run (:class:`mlx_tier.distributed.Share`)."""
    from .generation import MAX_AUTO_BATCH
    from .memory import model_memory_controls

    cache = model.expert_cache
    model_context = context_length(model_dir, FALLBACK_CONTEXT)
    context = min(model_context, config.context or model_context)
    notice = ("stopping: summaries being written are finished, documents still being read are left for "
              "the next run (interrupt again to stop at once)")
    resume = f" Resume with: {config.command}" if config.command else ""

    def abort(signum: int) -> None:  # from the watchdog thread, just before the process ends
        reporter.close()
        os.write(2, f"\nstopped at once ({signal.Signals(signum).name}); finished summaries are kept.{resume}\n"
                 .encode())

    if config.trace is not None:
        cache.start_trace(source=str(model_dir))
    try:
        with StopFlag(lambda: reporter.message(notice), abort) as stop, keep_awake(), model_memory_controls(
                model, context, config.batch_size or MAX_AUTO_BATCH) as memory:  # wired + cache limits, restored
            report.setup["memory"] = memory
            report.throttle = _summarise_all(todo, results, config, model, tokenizer, model_dir, journal,
                                             reporter, lambda: stop.signal is not None, report.setup,
                                             share)  # issue 16
            report.interrupted = stop.signal is not None and any(r.status == "pending" for r in report.results)
            report.stop_signal = stop.signal
    except BaseException:  # a second interrupt, or an error that stops the job: free the folder now
        lock.close()
        raise
    finally:
        if config.trace is not None:
            from .trace import save as save_trace

            try:
                save_trace(cache.stop_trace(), config.trace)
            except OSError as e:
                reporter.message(f"could not write the trace {config.trace}: {e.strerror or e}")


def _run_record(report: JobReport, t_wall: float, cache, skipped: int, failed_earlier: list) -> dict:
    """What this run did itself (one entry of report.json's ``runs``)."""
    throttle = report.throttle
    record = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_wall)),
        "seconds": round(report.seconds, 3),
        "done": report.this_run("done"),
        "failed": report.this_run("failed"),
        "already_done": skipped,  # done by earlier runs, not regenerated
        "left_failed": len(failed_earlier),  # failed earlier, not retried (no --retry-failed)
        "loaded_model": cache is not None,
        "output_tokens": report.output_tokens,
        "output_tok_per_s": round(report.output_tokens / report.seconds, 3) if report.seconds else 0.0,
        "throttled_seconds": throttle.get("throttled_seconds", 0.0) + throttle.get("paused_seconds", 0.0)
        + throttle.get("capped_seconds", 0.0),
    }
    if cache is not None:
        record |= {
            "slots_per_layer": cache.slots_per_layer,
            "cache_budget_gib": round(cache.budget_bytes / 2**30, 4),
            **({"warm_slots": list(cache.warm_slots),
                "host_cache_budget_gib": round(cache.warm_budget_bytes / 2**30, 4)}
               if hasattr(cache, "warm_slots") else {}),
            "cache": {**cache.stats.as_dict(), "resident_bytes_max": cache.resident_bytes,
                      "budget_bytes": cache.budget_bytes},
            "expert_use": cache.profile_counts().tolist(),  # [L, E] uses this run (the watch page's heatmap)
        }
    return record


def _save_profile(config: JobConfig, model_dir, cache, report: JobReport, reporter: Reporter) -> None:
    from . import profile

    try:
        where = profile.record(model_dir, profile.from_counts(cache.profile_counts(), source=str(config.input)))
        report.setup["profile_saved"] = str(where)
        reporter.message(f"expert use profile saved to {where}")
    except (OSError, profile.ProfileError) as e:
        reporter.message(f"could not save the expert use profile: {e}")
