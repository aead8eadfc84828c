"""The main job: summarise every document of an input with a tiered model (or run
every request of an OpenAI batch request file as written, :mod:`mlx_tier.job.batch_api`).

Resumable (journal), atomic (outputs appear only complete), interruptible
(SIGINT/SIGTERM/SIGHUP stop after the documents in progress). The CLI is a thin layer
over :func:`run_job`; progress goes to a :class:`Reporter`.

The control path, in vLLM v1's manner (plain data between small parts):
:class:`~mlx_tier.outdir.jobdir.JobDir` holds the output folder (prepare, lock,
clean, release); :func:`~mlx_tier.job.triage.triage` decides from the journal
which documents run (pure); the :class:`~mlx_tier.job.scheduler.Scheduler`
decides which prompts run next and the engine executes them; each run leaves
a :class:`RunRecord`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from mlx_tier.defaults import (
    DEFAULT_PROMPT,
    DEFAULT_REPETITION_PENALTY,
)
from mlx_tier.errors import InputError, JobError
from mlx_tier.fsio import DISK_FULL, current_folder, write_atomic
from mlx_tier.job import batch_api
from mlx_tier.job.activity import (
    Activity,
    LayerProgress,
    Rate,
    Reporter,
    Speed,
    achieved,
    announce,
)
from mlx_tier.job.config import JobConfig
from mlx_tier.job.doc_text import TEXT_SUFFIXES, decode_text, reading_route
from mlx_tier.job.doc_tokens import SAMPLE_CHARS, SAMPLE_DOCS
from mlx_tier.job.documents import (
    by_count,
    discover,
    discover_list,
    fails_unread,
    link_hint,
    size_hint,
    skip_note,
    source_field,
    source_file,
    source_hash,
    with_default_limit,
)
from mlx_tier.job.eta import EtaTracker
from mlx_tier.job.heartbeat import Heartbeat
from mlx_tier.job.kept_parts import call_identity, forget_finished, open_parts
from mlx_tier.job.model_setup import (
    Loaded,
    earlier_setup,
    generation_for,
    loaded_compute,
    model_for,
    planned_compute_of,
    record_peak,
    save_profile,
    save_trace,
    setup_record,
)
from mlx_tier.job.naming import fold
from mlx_tier.job.outputs import BatchOutputs, JsonlSummaries, keeps_jsonl, line_bytes
from mlx_tier.job.process import keep_awake, lower_priority
from mlx_tier.job.provenance import (
    SETTINGS_FIELDS,
    Settings,
    made_from,
    vouched,
    writing_record,
)
from mlx_tier.job.report import (
    DocResult,
    JobReport,
    RunRecord,
    previous_runs,
    rerun_account,
    sum_cache,
    unreported_runs,
)
from mlx_tier.job.rerun import (
    copy_reused,
    current_hashes,
    doubt_answers,
    doubt_unrecorded,
    limit_note,
    locate_model,
    refuse_other_files,
    request_hashes,
    rerun_counts,
    rerun_notes,
    run_settings,
)
from mlx_tier.job.scheduler import Outcome, Scheduler
from mlx_tier.job.stopflag import STOP_GRACE_SECONDS, StopFlag
from mlx_tier.job.throttle import Throttle
from mlx_tier.job.triage import (
    DONE_KEEPS,
    FAILED_KEEPS,
    FIGURES,
    OutputState,
    Triage,
    attempted_ids,
    foreign_outputs,
    triage,
)
from mlx_tier.messages import retry_command, terminal_width, with_command, wrap_words
from mlx_tier.monitor.view import progress_sample
from mlx_tier.outdir.jobdir import JobDir, ProgressFile, write_input_list
from mlx_tier.outdir.journal import JobInfo, Journal, RunClock, new_run_id, prompt_texts
from mlx_tier.outdir.layout import (
    BATCH_ERRORS,
    BATCH_OUTPUT,
    EDITED_DIR,
    JOURNAL,
    PROGRESS_FILE,
    REPORT,
    check_out_dir,
)
from mlx_tier.outdir.parts import PartStore
from mlx_tier.rates import RunSpeed
from mlx_tier.units import count_text

# What fails one document without stopping the job. MLX's out-of-memory errors
# surface as RuntimeError ("[metal::malloc] ...", "[malloc] ...") or, from a
# C++ std::bad_alloc, as MemoryError; tokenizer and disk-full errors vary. So
# any Exception; KeyboardInterrupt/SystemExit (BaseException) still stop the job.
DOCUMENT_ERRORS: tuple[type[BaseException], ...] = (Exception,)


def _figures(outcome: Outcome, res: DocResult) -> None:
    res.input_tokens, res.output_tokens, res.parts = outcome.input_tokens, outcome.output_tokens, outcome.parts
    res.doc_seconds, res.finish_reason = round(outcome.seconds, 3), outcome.finish_reason
    res.parts_kept, res.kept_tokens = outcome.kept or None, outcome.kept_tokens or None


def _kept_figures(res: DocResult) -> dict:
    """A result's :data:`~mlx_tier.job.triage.FIGURES` for its writing record: kept there in
    case a crash loses its ``done`` record."""
    return {k: getattr(res, k) for k in FIGURES if getattr(res, k) is not None}


def _record(outcome: Outcome, res: DocResult, out_dir: Path, journal: Journal, settings: Settings) -> None:
    """Write a finished summary (atomically, its ``writing`` record journalled first with
    the run's ``settings``: :func:`~mlx_tier.job.provenance.writing_record`) and fill
    ``res``; a write error fails the document. A redo of a changed document that failed
    removes its earlier summary (of the earlier text: stale); one redone for other settings
    (``redo_changed``) keeps it (of the same text).

    Raises:
        JobError: the disk is full (the document stays pending: no later one could be written either).
    """
    _figures(outcome, res)
    if outcome.status != "done":
        res.status, res.error = "failed", outcome.error
        if res.redo == "stale":  # its old summary, of an earlier text, goes (as its JSONL line): said
            try:
                os.unlink(out_dir / f"{res.id}.md")
                res.error += " (its summary of the earlier text was removed)"
            except FileNotFoundError:
                pass
            except OSError as e:
                res.error += f" (its earlier summary could not be removed: {e.strerror})"
        return
    try:
        data = (outcome.summary + "\n").encode("utf-8", "surrogateescape")  # as write_atomic encodes text
        journal.append(writing_record(res.id, res.made_from, data, settings.fields() | _kept_figures(res)))
        write_atomic(out_dir / f"{res.id}.md", data)
        res.status, res.output = "done", f"{res.id}.md"
    except OSError as e:
        if e.errno in DISK_FULL:
            raise JobError(f"{e.filename}: {e.strerror}; the job stopped (finished summaries are kept)") from None
        res.status, res.error = "failed", f"cannot write the summary: {type(e).__name__}: {e}"
    except DOCUMENT_ERRORS as e:
        res.status, res.error = "failed", f"cannot write the summary: {type(e).__name__}: {e}"


def _record_request(outcome: Outcome, res: DocResult, p: _Pass) -> None:
    """Append a finished request's line to ``output.jsonl`` (its ``writing`` record journalled
    first, as a summary's: :func:`~mlx_tier.job.provenance.writing_record`) or a failed one's
    to ``errors.jsonl`` (fsync'ed, before its journal record) and fill ``res``. A request
    redone because it changed (``res.redo``) has its old answer's line replaced
    (:class:`~mlx_tier.job.outputs.BatchOutputs`).

    Raises:
        JobError: the line cannot be written (disk full, a read-only folder): no
            later request could be written either; the request stays pending.
    """
    req, batch = p.requests[res.id], p.batch
    _figures(outcome, res)
    try:
        if outcome.status == "done":
            body = batch_api.response_body(req, outcome.choices, outcome.input_tokens, p.model_name, int(time.time()))
            line = batch_api.output_line(req.custom_id, body)
            p.journal.append(writing_record(res.id, res.made_from, line_bytes(line),
                                            p.settings.fields() | _kept_figures(res)))
            batch.add_output(req.custom_id, line, redo=res.redo is not None)
            res.status, res.output = "done", BATCH_OUTPUT
            return
        code = outcome.error_code or batch_api.SERVER_ERROR
        batch.add_error(req.custom_id, batch_api.error_line(req.custom_id, outcome.error, code, outcome.error_param,
                                                            req.line), redo=res.redo is not None)
        res.status, res.error, res.error_code, res.error_param = "failed", outcome.error, code, outcome.error_param
    except OSError as e:
        raise JobError(f"{e.filename}: {e.strerror or e}; the job stopped (finished answers are kept)") from None


def _lower_priority(config: JobConfig, reporter: Reporter) -> None:
    try:
        warning = lower_priority(config.nice, config.background_qos)
    except (OSError, subprocess.SubprocessError) as e:  # e.g. taskpolicy missing or refused
        warning = f"could not lower the job's priority: {e}"
    if warning:
        reporter.message(warning)


@dataclass
class _Pass:
    """What one run generates and where it writes, built once in :func:`_run_in` and passed down whole."""

    docs: Iterator  # the pending documents, in turn (:func:`_turns`)
    sizes: dict[str, int]  # characters of each pending document (0: unknown), for the ETA
    results: dict  # id -> DocResult, filled as documents finish
    journal: Journal
    reporter: Reporter
    report: JobReport
    progress: ProgressFile  # rewritten every 2 s with the :class:`Activity`
    settings: Settings  # this run's model and prompt, recorded with each summary
    last_t: float | None = None  # the run's clock at its last document record, or its stop (mlx_tier.rates)
    batch: BatchOutputs | None = None  # a batch request file's output.jsonl and errors.jsonl
    requests: dict = field(default_factory=dict)  # id -> BatchRequest of each pending request, in input order
    model_name: str = ""  # the model that answers, as each response names it
    samples: list = field(default_factory=list)  # (text, size) of a few documents: their characters per token
    sources: dict = field(default_factory=dict)  # id -> {"source": its file} of each pending file, for its record
    parts: PartStore | None = None  # long documents' finished calls, kept as they finish (None: requests)


def _eta_tracker(p: _Pass, config: JobConfig, scheduler: Scheduler) -> EtaTracker:
    """The run's ETA, primed with a resumed job's summary lengths (one call each), each
    request's own token limit and choices (requests are never split)."""
    earlier = [r.output_tokens for r in p.results.values()
               if r.earlier_run and r.status == "done" and not r.parts and r.output_tokens]
    limits = {i: r.plan.max_tokens for i, r in p.requests.items() if r.plan is not None and r.plan.max_tokens}
    choices = {i: r.plan.n for i, r in p.requests.items() if r.plan is not None and r.plan.n > 1}
    return EtaTracker(p.sizes, config.generation.max_tokens, scheduler.batch_size, time.monotonic(), earlier,
                      None if p.requests else scheduler.calls_for, config.throttle.max_tok_s, limits, choices)


def _summarise_all(p: _Pass, config: JobConfig, loaded: Loaded, stop: StopFlag, beat: Heartbeat) -> dict:
    """Generate every document ``p.docs`` yields (batched, throttled), writing and journalling
    each as it finishes; fills ``p.results``, records the generation settings in
    ``p.report.setup``. After a first signal (``stop``) the summaries being written get
    :data:`~mlx_tier.job.stopflag.STOP_GRACE_SECONDS`, then stay pending; ``beat`` is told
    of each step. Returns the throttle's account (:meth:`Throttle.as_dict`)."""
    journal, reporter, progress = p.journal, p.reporter, p.progress

    def stopping() -> bool:
        return stop.signal is not None

    _lower_priority(config, reporter)
    throttle = Throttle(config.throttle, should_stop=stopping)
    for line in throttle.unserved():
        reporter.message(line)
    known = [n for n in p.sizes.values() if n]
    probes = batch_api.probe_prompts(loaded.tokenizer, list(p.requests.values())) if p.requests else None
    generation = generation_for(config, loaded.budget)
    if p.requests:  # each request's own sampling and stop strings: the batch engine's (the pool engine is greedy)
        generation = replace(generation, schedule="paced")
    scheduler = Scheduler(loaded.model, loaded.tokenizer, loaded.model_dir, loaded.context, generation,
                          max(p.sizes.values(), default=0), probes=probes,
                          typical_chars=sum(known) // len(known) if known else None, documents=len(p.sizes),
                          memory=loaded.budget, samples=p.samples, parts=p.parts,
                          max_tok_s=config.throttle.max_tok_s)
    p.report.setup["generation"] = scheduler.info
    announce(scheduler, reporter)
    rate, prompt_rate = Rate(), Rate()
    layers = LayerProgress(reporter, progress, len(loaded.cache.layers), lambda: loaded.cache.stats.hit_rate,
                           stopping)
    generated = [0]  # tokens generated this run, for the samples the watch page plots
    eta = _eta_tracker(p, config, scheduler)
    speed = Speed()
    read: dict[str, tuple[int, int]] = {}  # how far each prompt in flight was read

    def on_step(info, in_flight):
        beat.step()
        speed.add(info, getattr(loaded.cache, "lent", 0))
        rate.add(info.generated, info.decode_seconds)
        prompt_rate.add(info.prefill_tokens, info.prefill_seconds)
        generated[0] += info.generated
        eta.step(info.prefill, info.generating, info.prefill_tokens, info.prefill_seconds, info.generated,
                 info.decode_seconds, info.merged)
        now = time.monotonic()
        read.update({i: (r, n) for i, r, n in info.prefill})
        for i in set(read) - set(in_flight):
            del read[i]
        activity = Activity(in_flight, info.prefill[-1] if info.prefill else None, info.generating,
                            rate.value, prompt_rate.value, loaded.cache.stats.hit_rate, eta.every(now),
                            stopping=stopping(), at=now, also_reading=tuple(info.prefill[:-1]), read=dict(read))
        reporter.working(activity)
        progress.update(activity)
        layers.step_done(activity)
        seen = len(throttle.timeline)
        throttle.step(info.generated)
        for change in throttle.timeline[seen:]:  # thermal state changes: durable, for `mlx-tier status`
            journal.append({"event": "thermal", **change})
            if change["mode"] != "full":
                reporter.message(f"throttle: {change['mode']} ({change['reason']})")

    throttled_before = 0.0
    for outcome in scheduler.run(p.docs, should_stop=stopping, on_step=on_step, on_layer=layers.layer,
                                 give_up=lambda: stop.seconds_stopping() > STOP_GRACE_SECONDS):
        throttled_before = _take_outcome(outcome, p, config, loaded, eta, throttle, throttled_before,
                                         rate.value, generated[0])
    if stopping() and any(r.status == "pending" for r in p.report.results):  # timed to its stop, said to `status`
        partial = _partial_tokens(p)  # the calls of long documents it did not finish: its work, in its speeds
        p.last_t = journal.append({"event": "stopped", **({"partial_tokens": partial} if partial else {})})["run_t"]
    if p.last_t is not None:  # the run's figure (its RunRecord's): done documents over its generation time
        report = p.report
        achieved(scheduler, RunSpeed(report.output_tokens, report.this_run("done"), _generation_seconds(p)),
                 report.this_run("failed"), reporter)
    if not stopping():
        speed.compare(scheduler.step_model(), loaded.cache, p.report, reporter)
    if p.parts is not None and p.parts.error:
        reporter.message(f"parts: could not keep finished calls of long documents ({p.parts.error}); "
                         "a stopped run would generate them again")
    return throttle.as_dict()

def _take_outcome(outcome: Outcome, p: _Pass, config: JobConfig, loaded: Loaded, eta: EtaTracker,
                  throttle: Throttle, throttled_before: float, rate: float, generated: int) -> float:
    """Write and journal one finished (or failed) document; returns the throttled seconds so far."""
    results, journal, reporter = p.results, p.journal, p.reporter
    res = results[outcome.id]
    if p.batch is not None:
        _record_request(outcome, res, p)
    else:
        _record(outcome, res, config.out_dir, journal, p.settings)
    eta.finished(res.id, res.output_tokens if res.status == "done" else None)
    spent = throttle.throttled_seconds + throttle.paused_seconds + throttle.capped_seconds
    if res.status == "done":  # what wrote it (mlx_tier.job.provenance)
        res.model, res.prompt, res.kv_bits = p.settings.fields()["model"], p.settings.prompt, p.settings.kv_bits
        res.generation = p.settings.generation if p.batch is None else None  # a request's body decides its own
        res.compute = p.settings.compute
    record = _doc_record(res, p)
    record["throttled_seconds"] = round(spent - throttled_before, 3)  # per record: `mlx-tier status` adds them up
    record["sample"] = progress_sample(loaded.cache, rate, generated)
    if outcome.reasoning:
        record["reasoning"] = outcome.reasoning
    p.last_t = journal.append(record)["run_t"]
    reporter.finished(res, loaded.cache.stats.as_dict())
    return spent


def _doc_record(res: DocResult, p: _Pass) -> dict:
    """A finished or failed document's journal record: its result's known fields (``source``
    as given left out) and the file itself, absolute (:func:`~mlx_tier.job.documents.source_file`)."""
    return {k: v for k, v in asdict(res).items() if v is not None and k != "source"} | p.sources.get(res.id, {})


def claim_all(doc_id: str) -> bool:
    """The default share of a job: every pending document."""
    return True


def input_order(pending: list[str]) -> Iterable[str]:
    """The default order of a job's pending documents: the input's."""
    return pending


@dataclass(frozen=True)
class Share:
    """Which part of the job this process does (default: all of it, one journal).

    Attributes:
        claim: asked with each pending document's id just before it would start;
            ``False`` leaves it pending here (another process's document).
        journal_name: the file in ``OUT_DIR`` this process journals to
            (:class:`~mlx_tier.outdir.jobdir.JobDir`); every process triages from the
            job's view (:meth:`~mlx_tier.outdir.jobdir.JobDir.view`).
        order: pending ids (input order) -> the ids to try, in turn; pulled one
            at a time as the scheduler has room, so it may decide late (a rank
            of a distributed run steals then: :func:`mlx_tier.ranks.stealing.rank_order`).
        part: one rank of a distributed run (docs/distributed.md), whose launcher holds
            ``OUT_DIR``'s lock and writes the start record, ``summaries.jsonl``,
            ``report.json`` and ``report.html``: this process locks only its own
            journal (:class:`~mlx_tier.outdir.jobdir.JobDir`) and writes none of those.
        progress_name: the progress file in ``OUT_DIR`` this process rewrites while it
            works (:class:`~mlx_tier.outdir.jobdir.ProgressFile`).
        run_id: the run's id (:class:`~mlx_tier.outdir.journal.RunClock`): the ranks of a
            distributed run take their launcher's; ``None``: a fresh one.
    """

    claim: Callable[[str], bool] = claim_all
    journal_name: str = JOURNAL
    order: Callable[[list[str]], Iterable[str]] = input_order
    part: bool = False
    progress_name: str = PROGRESS_FILE  # a rank: its own (mlx_tier.outdir.layout.rank_progress_name)
    run_id: str | None = None


def _convert_ahead(doc) -> Future:
    """Start converting ``doc`` in a worker thread (a :class:`~mlx_tier.job.documents.FileDocument`
    converts when first read; a conversion failure fails that document alone, never raises).
    Returns a future of its ``converter``.

    A daemon thread, not a ThreadPoolExecutor: the executor's workers are joined at
    interpreter exit, so a stopped job would wait there for a large PDF's conversion."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(doc.converter)
        except BaseException as e:  # noqa: BLE001 - MemoryError: raised where the result is taken
            future.set_exception(e)

    threading.Thread(target=work, name=f"mlx-tier-convert {doc.id}", daemon=True).start()
    return future


def _turns(pending: list, results: dict, share: Share) -> Iterator:
    """The pending documents this process claims, in the share's order, each converted one
    document ahead in a worker thread: while one document is read and written, the next
    one's conversion (a large PDF may take minutes) runs beside it, so it stalls neither the
    engine's steps nor a stop. One conversion runs at a time; ``share.claim`` is asked for a
    document when the one before it starts."""
    by_id = {d.id: d for d in pending}

    def claimed() -> Iterator:
        for i in share.order(list(by_id)):
            if i in by_id and share.claim(i):  # else another process's share: stays pending here
                yield by_id.pop(i)  # tried once

    ahead = claimed()
    d = next(ahead, None)
    converting = _convert_ahead(d) if d is not None else None
    while d is not None:
        results[d.id].converter = converting.result()
        results[d.id].made_from = made_from(d)  # hashed before converting
        following = next(ahead, None)
        converting = _convert_ahead(following) if following is not None else None
        yield d
        d = following


def _outputs(job: JobDir, docs, records: dict[str, dict], batch: BatchOutputs | None) -> dict[str, OutputState]:
    """The output of each document now: its ``<id>.md`` (and of each id summarised earlier: a
    renamed one's old name), or a batch request's line in ``output.jsonl``."""
    if batch is not None:
        return {d.id: OutputState(d.request.custom_id in batch.done, d.request.custom_id in batch.done) for d in docs}
    ids = [d.id for d in docs] + [i for i, rec in records.items() if rec.get("status") == "done"]
    return {i: OutputState.of(job.output(i)) for i in ids}


def output_name(doc) -> str:
    """Where a document's finished output is: ``<id>.md``, or a request's ``output.jsonl``."""
    return BATCH_OUTPUT if doc.request is not None else f"{doc.id}.md"


def is_batch(docs) -> bool:
    """Whether a job's documents are the requests of a batch request file."""
    return bool(docs) and docs[0].request is not None


def doc_results(docs, tri: Triage, records: dict[str, dict] | None = None) -> dict[str, DocResult]:
    """Each document's result as the triage leaves it (earlier runs' figures from their records;
    ``records``: the journal's, for the summaries reused under a new name)."""
    records = records or {}
    results = {}
    for d in docs:
        base = {"id": d.id, "source": d.source, "name": d.name}
        if d.id in tri.done:
            rec = tri.done[d.id]
            keep = {k: rec[k] for k in DONE_KEEPS if k in rec}
            results[d.id] = DocResult(status="done", output=output_name(d), earlier_run=True, **base, **keep)
        elif d.id in tri.recovered:  # figures and settings as its writing record vouched for them
            rec = tri.recovered_from.get(d.id) or {}
            keep = {k: rec[k] for k in DONE_KEEPS if k in rec and k != "reused"}
            results[d.id] = DocResult(status="done", output=output_name(d), earlier_run=True, **base, **keep)
        elif d.id in tri.reused:  # its summary written earlier, under the name its content had
            rec = records.get(tri.reused[d.id], {})
            keep = {k: rec[k] for k in DONE_KEEPS if k in rec} | {"reused": tri.reused[d.id]}
            results[d.id] = DocResult(status="done", output=output_name(d), earlier_run=True, **base, **keep)
        elif d.id in tri.failed:
            rec = tri.failed[d.id]
            keep = {k: rec[k] for k in FAILED_KEEPS if k in rec}
            results[d.id] = DocResult(status="failed", error=rec.get("error"), earlier_run=True, **base, **keep)
        else:
            redo = "stale" if d.id in tri.stale else "changed" if d.id in tri.changed else None
            results[d.id] = DocResult(status="pending", redo=redo, **base)
    return results


def find_documents(config: JobConfig, skipped: Counter | None = None, notes: list[str] | None = None) -> list:
    """The job's documents (not converted), each keeping the output name an earlier run gave it;
    the files left out (not documents) counted into ``skipped`` when given
    (:func:`mlx_tier.job.documents.discover`); ``notes`` (when given) gets a line for the
    documents named around a user's own ``<name>.md`` in OUT_DIR (:func:`named_around`).

    Raises:
        InputError: bad input or output folder, a document whose output holds the summary of
            another file (:func:`~mlx_tier.job.rerun.refuse_other_files`), or a trace path
            that cannot be written.
    """
    check_out_dir(config.out_dir, config.input if config.input_paths is None else None)
    earlier = Journal(config.out_dir) if config.out_dir.is_dir() else None
    attempted = attempted_ids(earlier.entries() if earlier is not None else ())
    # Each document keeps its output name; a user's own <name>.md in OUT_DIR is never taken.
    foreign = foreign_outputs(config.out_dir, attempted)
    previous = {**(earlier.names() if earlier is not None else {}), **foreign}
    docs = (discover_list(config.input_paths, exclude=config.out_dir, previous=previous, limits=config.conversion,
                          skipped=skipped)
            if config.input_paths is not None
            else discover(config.input, exclude=config.out_dir, follow_links=config.follow_links, previous=previous,
                          limits=config.conversion, skipped=skipped))
    docs = with_default_limit(docs, config.generation.max_tokens)  # requests that set no token limit
    if earlier is not None:  # before the folder is locked or anything written
        refuse_other_files(docs, earlier.records(), config.out_dir)
    if config.trace is not None and not os.access(Path(config.trace).parent.resolve(), os.W_OK):
        raise InputError(f"{config.trace}: cannot write the trace there (folder missing or not writable)")
    if notes is not None and (line := named_around(docs, foreign, previous.values())):
        notes.append(line)
    return docs


def named_around(docs, foreign: dict[str, str], named: Iterable[str]) -> str | None:
    """A line for the documents whose output is named otherwise (``a-2.md``) because OUT_DIR
    holds a ``<name>.md`` no run of this job wrote (``foreign``: :func:`foreign_outputs`),
    left as it is; ``named``: ids earlier runs gave (kept, not said again). ``None``: none."""
    stems, earlier = {fold(v) for v in foreign.values()}, {fold(v) for v in named} - {fold(v) for v in foreign.values()}
    moved = [d for d in docs if getattr(d, "wished", None) and fold(d.id) != fold(d.wished)
             and fold(d.wished) in stems and fold(d.id) not in earlier]
    if not moved:
        return None
    shown = ", ".join(f"{d.id}.md" for d in moved[:3]) + (", ..." if len(moved) > 3 else "")
    one = len(moved) == 1
    return (f"{count_text(len(moved), 'summary')} named otherwise ({shown}): the output folder holds "
            + ("a file of its name that no run of this job wrote, left as it is; move it out to use the plain name"
               if one else "files of their names that no run of this job wrote, left as they are; move them out to "
               "use the plain names"))


def start_detached(config: JobConfig, argv: list[str]) -> int:
    """Start the job detached (``mlx-tier run --background``), after checking its input
    here so that bad input is refused now, not in the log. Converts nothing.

    Args:
        config: the job, as the detached run will build it again from ``argv``.
        argv: the command the detached process runs (:func:`mlx_tier.outdir.jobdir.start_background`).

    Returns:
        the detached process's id.
    Raises:
        InputError: bad input or output folder, or another run active there.
        OSError: the folder is not writable or the command cannot start.
    """
    from mlx_tier.outdir.jobdir import start_background
    from mlx_tier.outdir.layout import lock_held

    docs = find_documents(config)
    stdin = None
    if config.input_paths is not None:
        if lock_held(config.out_dir):  # never replace a running job's resume list
            raise InputError(f"{config.out_dir}: another mlx-tier run is using this output folder")
        config.out_dir.mkdir(parents=True, exist_ok=True)
        stdin = write_input_list(config.out_dir, docs)
    return start_background(argv, config.out_dir, stdin)


def write_report_page(out_dir: Path, reporter: Reporter) -> None:
    """``OUT_DIR/report.html`` (:mod:`mlx_tier.monitor.page`); a failure to write it only warns."""
    from mlx_tier.monitor.page import write_report_html

    try:
        write_report_html(out_dir)
    except (OSError, ValueError) as e:
        reporter.message(f"could not write report.html: {e}")


def run_job(config: JobConfig, reporter: Reporter | None = None, share: Share = Share()) -> JobReport:
    """Summarise every document of ``config.input`` not already done.

    With nothing left to do (every document done, or failed without
    ``retry_failed``), the model is not loaded: report.json is rewritten
    with the job's totals and a run record that did nothing. Documents are
    converted only when their turn comes, never those done already. A
    document changed since its summary is redone (:mod:`mlx_tier.job.provenance`).
    Files of an INPUT folder (or stdin list) that are not documents are said in one
    line as the run starts (:func:`~mlx_tier.job.documents.skip_note`) and counted in
    report.json's ``skipped_files``.

    Args:
        config: the job (:class:`JobConfig`).
        reporter: receives progress (default: silent).
        share: the documents this process takes and the journal it keeps
            (:class:`Share`; default: every document, the job's journal).

    Raises:
        InputError: bad input or output folder (nothing is generated).
        mlx_tier.CheckpointError, mlx_tier.BudgetError: unusable model or budget.
        KeyboardInterrupt: a second interrupt; finished outputs are kept.
    """
    reporter = reporter or Reporter()
    clock, t_wall = RunClock(share.run_id or new_run_id()), time.time()  # the run starts now
    skipped: Counter = Counter()
    notes: list[str] = []
    docs = find_documents(config, skipped, notes)
    if skipped and not share.part:  # said once the model is found: a wrong --model is one error line
        notes[:0] = [skip_note(skipped), *filter(None, [link_hint(skipped)])]
    with JobDir(config.out_dir, share.journal_name, part=share.part) as job:
        report, loaded = _run_in(job, docs, config, reporter, share, clock, notes if not share.part else [])
        report.seconds = clock.t()
        report.skipped_files = by_count(skipped)
        _finish_report(report, loaded, config, t_wall, reporter, clock.id, write=not share.part)
    if not share.part:
        write_report_page(config.out_dir, reporter)  # after the lock: the page reads the job as not running
    reporter.close()
    return report


def start_run(job: JobDir, docs, config: JobConfig, reporter: Reporter, part: bool = False,
              clock: RunClock | None = None, settings: Settings | None = None):
    """Journal, triage (from the job's view) and results of this run, with the earlier runs'
    recovered outputs recorded and reused summaries copied (not by a ``part``: its launcher
    did; one found now is another rank's, its record on the way). ``settings``: this run's
    model and prompt, against which earlier summaries are judged (with each document's
    source hash now; ``None``: not judged); a batch request's answer is also judged by its
    request's hash (:func:`~mlx_tier.job.rerun.request_hashes`: a changed request is
    stale, redone), its settings by model and KV cache alone. Returns ``(journal, records, triage)``."""
    batch = BatchOutputs(config.out_dir) if is_batch(docs) else None
    summaries = JsonlSummaries(config.out_dir, docs) if keeps_jsonl(config.out_dir, config.output_format) \
        and not part and batch is None else None
    journal = job.journal(on_done=summaries.add if summaries is not None else None, clock=clock,
                          on_failed=summaries.drop if summaries is not None else None)
    view = job.view()
    entries = list(view.entries())  # the journal read once: its triage, doubts and edits all come from it
    records = {rec["id"]: rec for rec in entries if "id" in rec}  # the latest record of each id
    for warning in view.warnings.values():
        reporter.message(f"journal: {warning}")
    current = request_hashes(docs, records) if batch is not None else \
        current_hashes(docs, records) if settings is not None else {}
    tri = triage([d.id for d in docs], records, _outputs(job, docs, records, batch), attempted_ids(entries),
                 config.retry_failed, current, settings, config.redo_changed, reuse=batch is None,
                 routes={d.id: reading_route(source_file(d)) for d in docs})
    by_id = {d.id: d for d in docs}
    if batch is None:  # a rank decides as its launcher did: a doubted output is pending in both
        doubt_unrecorded(tri, entries, job.output, by_id, [d.id for d in docs], config.retry_failed)
    else:
        doubt_answers(tri, entries, {d.id: batch.done.get(d.request.custom_id) for d in docs}, by_id,
                      [d.id for d in docs], config.retry_failed)
    if part:
        return journal, records, tri
    for i in tri.recovered:  # complete but unrecorded (a crash after the rename): record it, never regenerate
        vouch = tri.recovered_from.get(i) or {}
        made = vouch.get("made_from") or (by_id[i].stamp.as_dict() if by_id[i].stamp is not None else None)
        made = {"made_from": made} if made is not None else {}
        made |= {k: vouch[k] for k in (*SETTINGS_FIELDS, *FIGURES) if k in vouch}
        made |= {"written_in": vouch["run"]} if isinstance(vouch.get("run"), str) else {}  # the run whose work it is
        journal.append({"id": i, "status": "done", "output": output_name(by_id[i]), "recovered": True,
                        "name": by_id[i].name, **source_field(by_id[i]), **made})
    if batch is None:  # before a copy or a redo would replace them (not those left for a plain rerun)
        replaced = set(tri.pending) | set(tri.reused)
        _set_aside_edited([i for i in tri.stale + tri.changed if i in replaced], entries, config.out_dir,
                          reporter)
    for i in copy_reused(tri, records, docs, config.out_dir, journal):  # not copied: written again
        del tri.reused[i]
        tri.pending.append(i)
    if summaries is not None:
        summaries.sync(journal.records())
    if batch is not None:
        _keep_errors(batch, [by_id[i] for i in tri.failed], tri.failed)
    return journal, records, tri


def _set_aside_edited(redone: list[str], entries: list[dict], out_dir: Path, reporter: Reporter) -> None:
    """Move each summary this run will replace (``redone``: their document or settings
    changed; redone, or given a copy's) that no ``writing`` record names
    (:func:`~mlx_tier.job.provenance.vouched`: someone edited it since it was written) to
    ``OUT_DIR/edited/<id>.md`` (a folder, so no document's output can take the name), and
    say so: a redo would overwrite it, a failed one remove it. A journal without writing
    records (an older version) leaves them as they are.

    Raises:
        InputError: ``OUT_DIR/edited`` is a link or a file (nothing is written through it).
    """
    moved = []
    for i in redone:
        path = out_dir / f"{i}.md"
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if vouched(entries, i, data, None) != "unwritten":
            continue
        folder = out_dir / EDITED_DIR
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise InputError(f"{folder}: is a link or a file; edited summaries are kept there (move it away)")
        folder.mkdir(exist_ok=True)
        aside, n = folder / f"{i}.md", 1
        while aside.exists() or aside.is_symlink():
            n += 1
            aside = folder / f"{i}-{n}.md"
        os.rename(path, aside)
        moved.append(f"{EDITED_DIR}/{aside.name}")
    if moved:
        reporter.message(f"{count_text(len(moved), 'summary')} edited since written, whose document or settings "
                         f"changed, kept apart before the redo: {', '.join(moved)}")


def _keep_errors(batch: BatchOutputs, failed: list, records: dict[str, dict]) -> None:
    """``errors.jsonl`` as this run starts: a line for each request that stays failed (made
    from its journal record when missing), none for the others (:meth:`BatchOutputs.keep_errors`)."""
    def line(doc, rec: dict):
        return lambda: batch_api.error_line(doc.request.custom_id, rec.get("error") or "failed", rec.get("error_code"),
                                            rec.get("error_param"), doc.request.line)

    batch.keep_errors({d.request.custom_id: line(d, records[d.id]) for d in failed})


def _start_notes(tri: Triage, pending: int, skipped: int, retry_failed: bool, batch: bool, part: bool) -> list[str]:
    """Lines for people as a run starts: the failed documents (or a request file's requests)
    it leaves, or the ``pending`` failed ones it retries, and the ``skipped`` ones done
    already (not said by a rank, ``part``: its launcher speaks for the job)."""
    noun = "request" if batch else "document"
    notes = []
    if tri.failed:
        notes.append(f"{count_text(len(tri.failed), noun)} failed in an earlier run; not retried (rerun with "
                     f"`retry_failed` to retry only {'that one' if len(tri.failed) == 1 else 'those'})")
    if retry_failed:
        notes.append(f"`retry_failed`: retrying {count_text(pending, f'failed {noun}')}; pending ones are left "
                     "for a plain rerun")
    if skipped and not part:
        notes.append(f"skipping {count_text(skipped, noun)} already done (journal)")
    return notes


def _run_in(job: JobDir, docs, config: JobConfig, reporter: Reporter, share: Share,
            clock: RunClock, notes: list[str] = ()) -> tuple[JobReport, Loaded | None]:
    """The run inside the held job folder: triage, load, generate. Returns the report and the
    model (``None`` when nothing was to do), kept apart: the report never holds the model.
    ``notes``: lines on the input (files skipped...), said once the model is loaded, with
    what the run does with earlier outputs (a wrong ``--model`` is then one error line)."""
    asked_kv_bits = config.generation.kv_bits
    if is_batch(docs):  # requests run on the batch engine, unquantized (said by _batch_pass)
        config = replace(config, generation=replace(config.generation, kv_bits=None))
    model_dir = locate_model(config.model)  # nothing downloaded or built to compare settings
    planned = planned_compute_of(config, model_dir)
    settings = run_settings(config.model, config.generation, model_dir, is_batch(docs), planned, reporter.message)
    journal, records, tri = start_run(job, docs, config, reporter, share.part, clock, settings)
    if not share.part:  # said with the input's notes, once the model is loaded
        notes = [*notes, *rerun_notes(tri, records, settings, config.retry_failed, [d.id for d in docs],
                                      is_batch(docs)), *(limit_note(docs, records, tri) if is_batch(docs) else [])]
    results = doc_results(docs, tri, records)
    report = JobReport(results=list(results.values()), prompts=prompt_texts(job.view().entries()))
    by_id = {d.id: d for d in docs}
    pending = [by_id[i] for i in tri.pending]
    # documents seen unusable without the model (an empty file): failed first, never loaded for or sized
    unusable = [d for d in pending if fails_unread(d)] if not is_batch(docs) and share.claim is claim_all else []
    todo = [d for d in pending if d not in unusable]
    sizes: dict[str, int] = {}
    samples: list[tuple[str, int]] = []

    def typical() -> tuple[int, int, list[tuple[str, int]]]:  # sized once the model is found (sizing may convert documents)
        sizes.update(_sizes(todo))
        samples[:] = _samples(todo, sizes) if share.claim is claim_all else []  # read only documents of this run's
        known = [n for n in sizes.values() if n]
        return (sum(known) // len(known) if known else 0), len(todo), samples

    pooled = config.generation.schedule == "throughput" and not is_batch(docs)  # batch requests run paced
    loaded = model_for(todo, config, reporter, job, model_dir, typical if pooled else None)
    for note in notes:  # after the model is found and loaded: a wrong --model is one error line alone
        reporter.message(note)
    made = (loaded_compute(loaded) or planned) if loaded is not None else planned
    if loaded is not None and (settings.weights is None or made != planned):  # built just now; a kernel unforeseen
        settings = run_settings(config.model, config.generation, loaded.model_dir, is_batch(docs), made,
                                reporter.message)
    report.run = RunStart(len(tri.done) + len(tri.recovered) + len(tri.reused), len(tri.failed), loaded is not None,
                          settings.fields() if loaded is not None else {}, rerun_counts(tri), len(tri.left))
    if loaded is not None:
        report.setup = setup_record(loaded, config)
        report.prompts[settings.prompt] = config.generation.instruction
    else:  # nothing to do: the job's setup and throttle account stay as the last run wrote them
        report.setup, report.throttle = earlier_setup(config)
    if is_batch(docs):  # the answers are in output.jsonl and errors.jsonl, not <id>.md
        # each request runs its own messages: the summarise instruction (--prompt) made none of them
        report.setup |= {"batch_requests": True, "prompt": None}
        report.prompts.clear()
    _mark_start(journal, report, config, share, tri, list(by_id), settings, loaded is not None, bool(records))
    if config.input_paths is not None and not share.part:
        write_input_list(config.out_dir, docs)
    for note in _start_notes(tri, len(pending), report.run.skipped, config.retry_failed, is_batch(docs), share.part):
        reporter.message(note)
    parts = None
    if not is_batch(docs):  # also when nothing is pending: the lines of documents finished since go
        parts, notes = open_parts(config, _call_identity(settings, report.setup, config), share.journal_name, tri,
                                  lambda i: source_hash(by_id[i]), share.part)
        for note in notes:
            reporter.message(note)
    # every document of the job but those a --retry-failed run leaves: the same count on each run
    reporter.start(total=len(pending) + report.run.skipped + len(tri.failed), skipped=report.run.skipped,
                   failed=len(tri.failed))
    if pending:
        p = _Pass(_turns(todo, results, share), sizes or _sizes(todo), results, journal, reporter, report,
                  ProgressFile(config.out_dir, name=share.progress_name, clock=clock), settings,
                  samples=samples, sources={d.id: source_field(d) for d in pending}, parts=parts)
        _fail_unusable(p, unusable, config.out_dir)
        if is_batch(docs):
            _batch_pass(p, todo, config, reporter, asked_kv_bits)
        if todo:
            _run_pending(p, config, loaded)
        report.generation_seconds = _generation_seconds(p, clock.t()) if loaded is not None else 0.0
        finished = [i for i, r in results.items() if r.status == "done" and not r.earlier_run]
        report.partial_tokens = _partial_tokens(p)
        for note in forget_finished(config.out_dir, finished) if parts is not None and not share.part else []:
            reporter.message(note)
    return report, loaded


def _fail_unusable(p: _Pass, docs: list, out_dir: Path) -> None:
    """Record each of ``docs`` (:func:`~mlx_tier.job.documents.fails_unread`) failed with its
    reading error, as the scheduler would have at its turn, but before any generation."""
    for d in docs:
        res = p.results[d.id]
        res.converter, res.made_from = d.converter, made_from(d)
        _record(Outcome(d.id, "failed", error=d.error), res, out_dir, p.journal, p.settings)
        p.last_t = p.journal.append(_doc_record(res, p) | {"throttled_seconds": 0.0})["run_t"]
        p.reporter.finished(res, {})


def _call_identity(settings: Settings, setup: dict, config: JobConfig) -> dict:
    """What decides a long document's calls besides their prompts (:func:`call_identity`):
    the kernel and dtype the load chose (``setup``), the dense and attention kernels asked for."""
    return call_identity(settings, {"kernel": setup.get("kernel"), "dtype": setup.get("dtype"),
                                    "dense_kernel": config.tier.dense_kernel,
                                    "attention_kernel": config.tier.attention_kernel})


def _partial_tokens(p: _Pass) -> int:
    """Tokens of the calls this run wrote for long documents it did not finish (stopped, or failed)."""
    if p.parts is None:
        return 0
    done = {i for i, r in p.results.items() if r.status == "done" and not r.earlier_run}
    return sum(n for i, n in p.parts.written_now().items() if i not in done)


def _generation_seconds(p: _Pass, now: float | None = None) -> float:
    """This run's generation time (:mod:`mlx_tier.rates`): from its model loaded to its last
    document recorded (or its stop, a first signal that left documents), else to ``now``
    (the run's clock); 0 when neither is known."""
    end = p.last_t if p.last_t is not None else now
    return max(end - (p.report.load_seconds or 0.0), 0.0) if end is not None else 0.0


def _mark_start(journal: Journal, report: JobReport, config: JobConfig, share: Share, tri: Triage, ids: list[str],
                settings: Settings, loaded: bool, earlier: bool) -> None:
    """Journal this run's start, once its model is loaded: the ``start`` record (a rank's: a
    ``loaded`` one), whose clock reading ``run_t`` is the run's loading time
    (:mod:`mlx_tier.rates`), put in ``report.load_seconds``. A rerun with nothing to do starts
    no run; it journals a ``triaged`` record, the job's documents as it found them (``ids``,
    an empty ``todo``), which ``mlx-tier status`` and the page count by."""
    if share.part:
        if loaded:
            report.load_seconds = journal.append({"event": "loaded"})["run_t"]
        return
    stale_left = [i for i in tri.left if i in tri.stale] or None  # a --retry-failed run's: pending, not done
    if not tri.pending and earlier:  # nothing to generate: no run starts, but the job's documents may have changed
        journal.append({"event": "triaged", "ids": ids, "todo": []} | ({"left": stale_left} if stale_left else {}))
        return
    model = settings.fields()["model"] if loaded else None
    rec = JobInfo(input=str(config.input), ids=ids, todo=tri.pending, started=time.time(), writes=True,
                  reports=True, retry_failed=config.retry_failed, pid=os.getpid(), command=config.command, cwd=current_folder(),
                  output_format=config.output_format, mono=time.monotonic(), host=socket.gethostname(),
                  model=model, prompt=settings.prompt if loaded else None,
                  prompt_text=config.generation.instruction if loaded else None,
                  left=stale_left).write(journal)
    if loaded:
        report.load_seconds = rec.get("run_t")


def _batch_pass(p: _Pass, pending: list, config: JobConfig, reporter: Reporter,
                asked_kv_bits: int | None = None) -> None:
    """Set ``p`` up to run batch requests: their output files, the model's name for the
    responses; says which settings apply to summaries only, when they were changed
    (``asked_kv_bits``: the ``kv_bits`` given; ``config``'s is ``None`` for requests)."""
    from mlx_tier.tools.demo_model import is_demo

    p.batch, p.requests = BatchOutputs(config.out_dir), {d.id: d.request for d in pending}
    p.model_name = "demo" if is_demo(config.model) else str(config.model)
    g = config.generation
    unused = [name for name, changed in (("`instruction`", g.instruction != DEFAULT_PROMPT),
                                          ("`repetition_penalty`", g.repetition_penalty != DEFAULT_REPETITION_PENALTY),
                                          ("`output_format` jsonl", config.output_format == "jsonl"),
                                          ("`kv_bits`", asked_kv_bits is not None)) if changed]
    if unused:
        reporter.message(f"batch requests run as written: {', '.join(unused)} "
                         f"{'applies' if len(unused) == 1 else 'apply'} to documents only (answers go to "
                         f"{BATCH_OUTPUT}, failures to {BATCH_ERRORS})")


def _sizes(pending: list) -> dict[str, int]:
    """Characters of each pending document (:func:`mlx_tier.job.documents.size_hint`), to size
    the batch by the longest and for the ETA. Documents that need converting (PDF...)
    are sized by converting them, only those of the first batch (the conversion is
    kept, not repeated), the others 0 (unknown); a later one that does not fit the
    memory left when it starts is split into parts (:class:`~mlx_tier.job.scheduler.Scheduler`)."""
    from mlx_tier.job.batch_engine import MAX_AUTO_BATCH

    return {d.id: size_hint(d, convert=i < MAX_AUTO_BATCH) for i, d in enumerate(pending)}


def _samples(pending: list, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """``(text, size)`` of the first few sized pending documents
    (:data:`~mlx_tier.job.doc_tokens.SAMPLE_DOCS`), whose characters per token turn the
    typical document's size into tokens for the pools. A plain-text file (sized by its
    bytes) gives its first bytes, read without converting it; a converted document was
    converted by sizing already. Sizes in the size hints' units (bytes, characters)."""
    out = []
    for d in [d for d in pending if sizes.get(d.id)][:SAMPLE_DOCS]:
        path = getattr(d, "path", None)
        if path is not None and path.suffix.lower() in TEXT_SUFFIXES:
            try:
                with open(path, "rb") as f:
                    head = f.read(4 * SAMPLE_CHARS)
            except OSError:
                continue
            text = decode_text(head).text  # a byte-order mark or the encoding decides, as for the whole file
            if text:
                out.append((text, len(head)))
        elif d.text:
            out.append((d.text, len(d.text)))
    return out


def _finish_report(report: JobReport, loaded: Loaded | None, config: JobConfig, t_wall: float,
                   reporter: Reporter, run_id: str, write: bool = True) -> None:
    """This run's record (``run_id``: its id), the records of earlier runs that ended without
    theirs (:func:`~mlx_tier.job.report.unreported_runs`), the summed cache counters, and
    (``write``) the profile and report.json (atomically)."""
    cache = loaded.cache if loaded is not None else None
    run = report.run
    record = RunRecord.of(report, t_wall, cache, run.skipped, run.left_failed, run.settings,
                          rerun_account(report.results, run.rerun), run.left_pending, run_id)
    earlier = previous_runs(config.out_dir / REPORT)
    known = {r.get("run") for r in earlier} | {run_id}
    lost = unreported_runs(Journal(config.out_dir).entries(), known) if write else []
    report.runs = earlier + lost + [record.as_dict()]
    report.cache = sum_cache(report.runs)
    if cache is not None:
        report.cache |= {"resident_bytes_max": cache.resident_bytes, "budget_bytes": cache.budget_bytes}
    if not write:  # a rank's: its launcher writes the job's report
        return
    if config.save_profile and report.output_tokens:
        save_profile(config, loaded, report, reporter)
    write_atomic(config.out_dir / REPORT, json.dumps(report.as_dict(), indent=2) + "\n")


def _run_pending(p: _Pass, config: JobConfig, loaded: Loaded) -> None:
    """Generate ``p.docs`` under the stop flag (first signal: stop after the step; second: at once).
    ``p.progress`` is removed at a clean end (every document tried, a first signal, a full
    disk); a crash or a second signal leaves it: ``mlx-tier status`` says "interrupted"."""
    from mlx_tier.engine.memory import model_memory_controls
    from mlx_tier.job.batch_engine import MAX_AUTO_BATCH

    g, reporter, report, progress = config.generation, p.reporter, p.report, p.progress
    context = min(loaded.context, g.context or loaded.context)
    outputs, inputs = ("answers", "requests") if p.batch is not None else ("summaries", "documents")
    notice = (f"stopping: {outputs} being written are finished if they can be within {STOP_GRACE_SECONDS:g} s, "
              f"else left for the next run with the {inputs} still being read (interrupt again to stop at once)")

    def stopping() -> None:  # the Ctrl-C notice, word-wrapped now (runner messages are soft-wrapped)
        reporter.message(wrap_words(notice, terminal_width(2)))

    def abort(signum: int) -> None:  # from the watchdog thread, just before the process ends
        reporter.close()
        message = hard_stop_message(signum, config.command, terminal_width(2), config.retry_failed,
                                    p.batch is not None)
        os.write(2, f"\n{message}\n".encode())

    if config.trace is not None:
        loaded.cache.start_trace(source=str(loaded.model_dir))
    try:
        buffers = loaded.budget.buffers if loaded.budget is not None else None
        with StopFlag(stopping, abort) as stop, keep_awake(), model_memory_controls(
                loaded.model, context, g.batch_size or MAX_AUTO_BATCH, buffers=buffers) as memory, \
                Heartbeat(progress, lambda: stop.signal is not None) as beat:  # limits restored after
            report.setup["memory"] = memory
            if loaded.budget is not None:
                report.setup["memory_budget"] = loaded.budget.as_dict()
            try:
                report.throttle = _summarise_all(p, config, loaded, stop, beat)
            except JobError:  # the disk is full: a clean stop, not a crash
                progress.clear()
                raise
            progress.clear()
            record_peak(report, loaded.budget, reporter)
            report.interrupted = stop.signal is not None and any(r.status == "pending" for r in report.results)
            report.stop_signal = stop.signal
    finally:
        if config.trace is not None:
            save_trace(loaded.cache, config.trace, reporter)


def hard_stop_message(signum: int, command: str | None, width: int, retry_failed: bool = False,
                      answers: bool = False) -> str:
    """What a second stop signal prints as the process ends at once: the prose
    word-wrapped to ``width`` columns, then the resume command alone on its line
    (:func:`mlx_tier.messages.with_command`); after a ``retry_failed`` run, also the
    command that retries the failed documents (the resume command never does).
    ``answers``: a request file's run (its answers, not summaries, are kept)."""
    kept = "answers" if answers else "summaries"
    prose = f"stopped at once ({signal.Signals(signum).name}); finished {kept} are kept."
    if not command:
        return wrap_words(prose, width)
    retry = f"\n{with_command('retry the failed ones with:', retry_command(command), width)}" if retry_failed else ""
    return with_command(f"{prose} Resume with:", command, width) + retry


@dataclass(frozen=True)
class RunStart:
    """What the triage and load left for this run's record.

    Attributes:
        skipped: documents done by earlier runs (recovered outputs included), not regenerated.
        left_failed: documents failed earlier and not retried (no ``retry_failed``).
        left_pending: documents neither done nor failed that ``retry_failed`` leaves
            for a plain rerun.
        loaded_model: whether the model was loaded (``False``: nothing to do). The
            model itself is never kept here: a caller holding the report must
            not keep the model, its slabs and store threads alive.
        settings: the run's model and prompt as records name them (``{}``: not loaded).
        rerun: the triage's counts of earlier summaries (:func:`~mlx_tier.job.rerun.rerun_counts`).
    """

    skipped: int
    left_failed: int
    loaded_model: bool
    settings: dict = field(default_factory=dict)
    rerun: dict = field(default_factory=dict)
    left_pending: int = 0


