"""The main job: summarise every document of an input with a tiered model.

Resumable (journal), atomic (outputs appear only complete), interruptible
(SIGINT/SIGTERM stop after the current document). The CLI is a thin layer
over :func:`run_job`; progress goes to a :class:`Reporter`.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import psutil

from .documents import Document, InputError, discover
from .journal import Journal, write_atomic

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
    """

    input: Path
    out_dir: Path
    model: Path | None = None
    cache_gb: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    prompt: str = DEFAULT_PROMPT
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    trace: Path | None = None


@dataclass
class DocResult:
    """Outcome of one document (one entry of report.json)."""

    id: str
    status: str  # done | skipped (done by an earlier run) | failed | pending (not reached)
    source: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None
    output: str | None = None
    finish_reason: str | None = None  # "stop" (end of text) or "length" (hit --max-tokens)


@dataclass
class JobReport:
    """Everything report.json holds.

    ``results`` covers every document of the job (earlier runs' finished ones
    as ``skipped``, with their figures from the journal); ``runs`` keeps one
    record per run (this one last) so a rerun never loses a run's measurements;
    ``cache`` sums the cache counters over all runs.
    """

    results: list[DocResult] = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0
    cache: dict = field(default_factory=dict)
    setup: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.results)

    @property
    def output_tokens(self) -> int:
        """Tokens generated in this run."""
        return sum(r.output_tokens for r in self.results if r.status == "done")

    @property
    def generation_seconds(self) -> float:
        """Seconds spent on this run's documents (prompt processing included)."""
        return sum(r.seconds for r in self.results if r.status == "done")

    def as_dict(self) -> dict:
        finished = [r for r in self.results if r.status in ("done", "skipped")]
        out_tokens = sum(r.output_tokens for r in finished)
        seconds = sum(r.seconds for r in finished)
        totals = {s: self.count(s) for s in ("done", "skipped", "failed", "pending")}
        totals |= {
            "documents": len(self.results),
            "input_tokens": sum(r.input_tokens for r in finished),
            "output_tokens": out_tokens,
            "document_seconds": round(seconds, 3),
            "output_tok_per_s": round(out_tokens / seconds, 3) if seconds else 0.0,
            "interrupted": self.interrupted,
        }
        return {
            "documents": [asdict(r) for r in self.results],
            "totals": totals,
            "cache": self.cache,
            "runs": self.runs,
            **self.setup,
        }


COUNTERS = ("hits", "misses", "evictions", "bytes_read", "read_seconds", "rounds")


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
    return total


class Reporter:
    """Receives progress events; the CLI shows them with Rich. Default: silent."""

    def message(self, text: str) -> None: ...
    def start(self, total: int, skipped: int) -> None: ...
    def tokens(self, doc: Document, generated: int, tok_per_s: float) -> None: ...
    def finished(self, result: DocResult, cache: dict) -> None: ...
    def close(self) -> None: ...


class StopFlag:
    """Set by SIGINT/SIGTERM: finish the current document, then stop.

    A second signal restores the default handler, so a third one kills.
    """

    def __init__(self, on_first=lambda: None) -> None:
        self.signal: int | None = None
        self._old: dict = {}
        self._on_first = on_first

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no handlers, no clean stop
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:
            signal.signal(signum, self._old.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.signal = signum
        self._on_first()

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def prepare_out_dir(out_dir: Path) -> bool:
    """Create ``out_dir`` and check it is writable.

    Returns:
        whether it was created now.
    Raises:
        InputError: it cannot be created or written.
    """
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".mlx-tier-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise InputError(f"{out_dir}: output folder not writable ({e.strerror or e})") from None
    return created


LOCK = ".mlx-tier.lock"


def lock_out_dir(out_dir: Path):
    """An exclusive lock on ``OUT_DIR`` (``flock``): a second run on the same
    folder while one is active is refused. Released when the file is closed
    or the process ends (even by SIGKILL).

    Raises:
        InputError: another run holds it.
    """
    f = open(out_dir / LOCK, "a")
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


def context_length(model_dir: Path) -> int:
    """The checkpoint's context length in tokens, from its config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        if isinstance(config.get(key), int):
            return config[key]
    return FALLBACK_CONTEXT


def build_prompt(tokenizer, instruction: str, text: str) -> list[int]:
    """Token ids of the chat prompt for one document (plain text without a chat template)."""
    content = f"{instruction}\n\n{text.strip()}"
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        return list(ids)
    return tokenizer.encode(content + "\n\nSummary:")


def trim_to_sentence(text: str) -> str:
    """Drop a trailing unfinished sentence (output cut by the token limit), if any sentence ended."""
    cut = max(text.rfind(c) for c in ".!?")
    return text[: cut + 1] if cut > 0 else text


def summarise(
    model, tokenizer, prompt: list[int], max_tokens: int, repetition_penalty: float = 1.0, on_token=None
) -> tuple[str, int, str]:
    """Summary of one prompt with mlx-lm's ``stream_generate`` (argmax sampling).

    Returns:
        ``(text, generated_tokens, finish_reason)``; when the token limit cut
        the text, its unfinished last sentence is dropped.
    """
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(repetition_penalty=repetition_penalty) if repetition_penalty != 1.0 else None
    text, n, reason = [], 0, None
    for resp in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=processors):
        text.append(resp.text)
        n = resp.generation_tokens
        reason = resp.finish_reason or reason
        if on_token is not None:
            on_token(n, resp.generation_tps)
    out = "".join(text).strip()
    if reason == "length":
        out = trim_to_sentence(out)
    return out, n, reason or "length"


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


def summarise_document(doc: Document, res: DocResult, config: JobConfig, model, tokenizer, max_context: int,
                       reporter: Reporter) -> None:
    """Summarise one document into ``OUT_DIR/<id>.md``, or record in ``res`` why it failed."""
    if doc.error is not None:
        res.status, res.error = "failed", doc.error
        return
    prompt = build_prompt(tokenizer, config.prompt, doc.text)
    res.input_tokens = len(prompt)
    if len(prompt) + config.max_tokens > max_context:
        res.status = "failed"
        res.error = (
            f"document too long: {len(prompt)} prompt tokens + {config.max_tokens} to generate "
            f"> the model's context of {max_context} (not truncated; split it)"
        )
        return
    try:
        text, n, reason = summarise(
            model, tokenizer, prompt, config.max_tokens, config.repetition_penalty,
            lambda n, tps: reporter.tokens(doc, n, tps),
        )
        write_atomic(config.out_dir / f"{doc.id}.md", text + "\n")
        res.status, res.output_tokens, res.output, res.finish_reason = "done", n, f"{doc.id}.md", reason
    except (RuntimeError, ValueError, OSError) as e:  # MLX errors surface as these
        res.status, res.error = "failed", f"{type(e).__name__}: {e}"


def run_job(config: JobConfig, reporter: Reporter | None = None) -> JobReport:
    """Summarise every document of ``config.input`` not already done.

    Raises:
        InputError: bad input or output folder (nothing is generated).
        mlx_tier.CheckpointError, mlx_tier.BudgetError: unusable model or budget.
        KeyboardInterrupt: a second interrupt; finished outputs are kept.
    """
    from .demo_model import ensure_demo_model
    from .tiered import load

    reporter = reporter or Reporter()
    t_start, t_wall = time.perf_counter(), time.time()
    docs = discover(config.input, exclude=config.out_dir)
    if config.trace is not None and not os.access(Path(config.trace).parent.resolve(), os.W_OK):
        raise InputError(f"{config.trace}: cannot write the trace there (folder missing or not writable)")
    created = prepare_out_dir(config.out_dir)
    lock = lock_out_dir(config.out_dir)  # held until the process exits
    journal = Journal(config.out_dir)
    records = journal.records()

    try:
        model_dir = Path(config.model) if config.model is not None else ensure_demo_model(reporter.message)
        if not model_dir.exists():
            raise InputError(f"{model_dir}: model folder not found")
        reporter.message(f"loading {model_dir}")
        model, tokenizer = load(model_dir, cache_gb=config.cache_gb)
    except BaseException:
        lock.close()
        if created and [p.name for p in config.out_dir.iterdir()] == [LOCK]:
            (config.out_dir / LOCK).unlink()
            config.out_dir.rmdir()  # leave no trace of a run that never started
        raise
    cache = model.expert_cache
    max_context = context_length(model_dir)

    report = JobReport(
        setup={
            **machine_info(),
            "model": str(model_dir),
            "cache_budget_gib": round(cache.budget_bytes / 2**30, 4),
            "slots_per_layer": cache.slots_per_layer,
            "experts_per_layer": cache.num_experts,
            "max_tokens": config.max_tokens,
            "repetition_penalty": config.repetition_penalty,
            "prompt": config.prompt,
        }
    )
    results = {d.id: DocResult(d.id, "pending", d.source) for d in docs}
    report.results = list(results.values())

    todo = []
    for d in docs:
        out_path = config.out_dir / f"{d.id}.md"
        rec = records.get(d.id)
        if rec and rec.get("status") == "done" and out_path.exists():
            keep = {k: rec[k] for k in ("input_tokens", "output_tokens", "seconds", "finish_reason") if k in rec}
            results[d.id].__dict__.update(status="skipped", output=out_path.name, **keep)
        elif out_path.exists():
            # Complete (written atomically) but unrecorded: a crash after the
            # rename. Record it; never regenerate a finished output.
            journal.append({"id": d.id, "status": "done", "output": out_path.name, "recovered": True})
            results[d.id].__dict__.update(status="skipped", output=out_path.name)
        else:
            todo.append(d)
    reporter.start(total=len(docs), skipped=len(docs) - len(todo))

    notice = "stopping after the current document (interrupt again to abort it now)"
    if config.trace is not None:
        cache.start_trace(source=str(model_dir))
    try:
        with StopFlag(lambda: reporter.message(notice)) as stop:
            for d in todo:
                if stop.signal is not None:
                    break
                res, t0 = results[d.id], time.perf_counter()
                summarise_document(d, res, config, model, tokenizer, max_context, reporter)
                res.seconds = round(time.perf_counter() - t0, 3)
                journal.append({k: v for k, v in asdict(res).items() if v is not None and k != "source"})
                reporter.finished(res, cache.stats.as_dict())
            report.interrupted = stop.signal is not None and any(r.status == "pending" for r in report.results)
    finally:
        if config.trace is not None:
            from .trace import save as save_trace

            try:
                save_trace(cache.stop_trace(), config.trace)
            except OSError as e:
                reporter.message(f"could not write the trace {config.trace}: {e.strerror or e}")

    report.seconds = time.perf_counter() - t_start
    this_run = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_wall)),
        "seconds": round(report.seconds, 3),
        "done": report.count("done"),
        "failed": report.count("failed"),
        "output_tokens": report.output_tokens,
        "output_tok_per_s": round(report.output_tokens / report.generation_seconds, 3) if report.generation_seconds else 0.0,
        "slots_per_layer": cache.slots_per_layer,
        "cache_budget_gib": round(cache.budget_bytes / 2**30, 4),
        "cache": {**cache.stats.as_dict(), "resident_bytes_max": cache.resident_bytes, "budget_bytes": cache.budget_bytes},
    }
    report.runs = previous_runs(config.out_dir / REPORT) + [this_run]
    report.cache = {**sum_cache(report.runs), "resident_bytes_max": cache.resident_bytes, "budget_bytes": cache.budget_bytes}
    write_atomic(config.out_dir / REPORT, json.dumps(report.as_dict(), indent=2) + "\n")
    lock.close()
    reporter.close()
    return report
