"""What the CLI prints: the two consoles, a job's live progress and final table,
the rows of ``mlx-tier status``, and messages that carry a command.

Rendering only: nothing here parses an option, runs a job or decides an exit
code (:mod:`mlx_tier.cli.exits`). Each command module lays out its own tables
with these helpers.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlx_tier.messages import in_request_words
from mlx_tier.outdir.journal import options_apart, short_fingerprint
from mlx_tier.units import (
    count_text,
    mib_text,
    percent_text,
    rate_text,
    seconds_text,
    tokens_text,
)

# A write to a closed pipe (`mlx-tier run ... | head`): 128 + SIGPIPE, as a shell reports a
# process the pipe ended, not 1 ("some documents failed"); finished summaries are kept.
EXIT_CLOSED_PIPE = 141


class _Console(Console):
    """Rich's console, whose write to a closed pipe exits :data:`EXIT_CLOSED_PIPE` (Rich's own
    exits 1, the code of failed documents), its stream pointed at the null device first so
    that nothing else fails on it."""

    def on_broken_pipe(self) -> None:
        import os
        import sys

        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (sys.stderr if self.stderr else sys.stdout).fileno())
        raise SystemExit(EXIT_CLOSED_PIPE)


err = _Console(stderr=True)
out = _Console()

HEARTBEAT_SECONDS = 60  # how often a log file gets a progress line between documents

# The library names a setting `like_this` in its messages (mlx_tier.errors: the
# error's ``field``); the CLI shows the flag that sets it.
FLAGS = {"max_tokens": "--max-tokens", "context": "--context", "max_temp": "--max-temp",
         "min_battery": "--min-battery", "max_tok_s": "--max-tok-s", "bits": "--bits", "mode": "--mode",
         "cache_gb": "--cache-gb", "memory_gb": "--memory-gb", "host_cache_gb": "--host-cache-gb",
         "batch_size": "--batch-size", "kv_bits": "--kv-bits", "kernel": "--kernel",
         "slots": "--slots", "retry_failed": "--retry-failed", "pause_on_battery": "--pause-on-battery",
         "follow_links": "--follow-links", "policy": "--policy", "instruction": "--prompt",
         "redo_changed": "--redo-changed", "repetition_penalty": "--repetition-penalty", "output_format": "--format",
         "convert_seconds": "--convert-seconds", "convert_memory_mb": "--convert-memory-mb", "out_dir": "--out"}


def as_flags(message: str) -> str:
    """``message`` with each library setting name (`max_tokens`) as its flag (--max-tokens)."""
    for name, flag in FLAGS.items():
        message = message.replace(f"`{name}`", flag)
    return message


def failure_text(result) -> str:
    """A failed document's error as the terminal says it (``result``: a
    :class:`~mlx_tier.job.report.DocResult`): the settings it names (`max_tokens`) as their
    flags; but a batch request's error (``error_code`` set) names a field of the request's
    body, as errors.jsonl does, never a flag: `max_tokens` of request <custom_id>."""
    text = str(result.error)
    if result.error_code is None:
        return as_flags(text)
    return in_request_words(text, result.error_param, result.name or result.id)


def print_with_command(console: Console, prose: str, command: str, label: str = "") -> None:
    """``prose`` word-wrapped to the console's width, then ``command`` alone on its own line
    (:func:`mlx_tier.messages.with_command`: copyable, never cut mid-word); ``label``
    (``"error:"``) starts the first line in bold red."""
    from mlx_tier.messages import with_command

    text = Text(with_command(f"{label} {prose}" if label else prose, command, console.width))
    if label:
        text.stylize("bold red", 0, len(label))
    console.print(text, highlight=False, soft_wrap=True)


def print_resume(console: Console, prose: str, command: str, retry_failed: bool = False, label: str = "") -> None:
    """``prose`` and the command that resumes a job (:func:`print_with_command`); after a
    ``--retry-failed`` run also the one that retries failed documents, since the resume
    command never carries that flag (a run with it leaves pending documents as they are)."""
    from mlx_tier.messages import retry_command

    print_with_command(console, prose, command, label=label)
    if retry_failed:
        print_with_command(console, "retry the failed ones with:", retry_command(command))


def print_left_pending(report, command: str) -> None:
    """After a ``--retry-failed`` run (a :class:`~mlx_tier.job.report.JobReport`) that left
    documents pending (its run record's ``left_pending``): how many, and the plain rerun
    that summarises them; nothing otherwise."""
    left = report.runs[-1].get("left_pending", 0) if report.runs else 0
    if left:
        noun = report.noun
        print_with_command(err, f"{count_text(left, noun)} pending, left for a plain rerun (--retry-failed tries "
                                f"failed {noun}s only); {'answer' if noun == 'request' else 'summarise'} "
                                f"{'it' if left == 1 else 'them'} with:", command)


def print_wrapped(console: Console, text: str, style: str = "", styled: int | None = None) -> None:
    """``text`` (plain, no markup) word-wrapped to the console's width
    (:func:`mlx_tier.messages.wrap_words`: between words, a long path kept whole) rather
    than left to the terminal, which cuts one long line mid-word at its edge; ``style``
    colours the first ``styled`` characters (all when ``None``)."""
    from mlx_tier.messages import wrap_words

    wrapped = Text(wrap_words(text, console.width))
    if style:
        wrapped.stylize(style, 0, len(wrapped) if styled is None else styled)
    console.print(wrapped, highlight=False, soft_wrap=True)


def print_error(text: str) -> None:
    """One ``error:`` message on stderr (``text`` plain: brackets are not markup): on a
    terminal word-wrapped to its width (a long path kept whole:
    :func:`~mlx_tier.messages.wrap_words`), else one line (a log, a script's pipe: one line
    to find)."""
    from mlx_tier.messages import wrap_words

    line = Text(wrap_words(f"error: {text}", err.width) if err.is_terminal else f"error: {text}")
    line.stylize("bold red", 0, len("error:"))
    err.print(line, highlight=False, soft_wrap=True)


def choices(names) -> str:
    """An option's metavar listing its choices, as click shows a ``Choice``: ``[md|jsonl]``."""
    return "[" + "|".join(map(str, names)) + "]"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def format_duration(seconds: float | None) -> str:
    """``"1h02m"``, ``"12m05s"``, ``"45s"``; ``"?"`` when unknown."""
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def progress_line(done: int, total: int, elapsed: float, eta: float | None, activity, width: int,
                  failed: int = 0) -> str:
    """One status line that fits ``width`` columns: done/total and ETA first, then elapsed
    time, what is being read or written (the document name cut to what fits) and the rates,
    which are dropped first when the line is too narrow.

    ``activity`` is a :class:`mlx_tier.job.run.Activity` or ``None`` (nothing started yet);
    ``eta`` ``None`` reads "estimating" (no rate measured yet).
    """
    left = ("stopping" if activity is not None and activity.stopping
            else f"ETA {format_duration(eta)}" if eta is not None else "ETA estimating")
    head = f"{done}/{total} done{f', {failed} failed' if failed else ''}  {left}  {format_duration(elapsed)}"
    if activity is None:
        return _clip(head, width)
    if activity.reading is not None:
        name, read, length = activity.reading
        what, details = "reading ", (f" {read:,}/{length:,} prompt tokens", f" {read:,}/{length:,}")
    elif activity.writing:
        name, tokens = activity.writing[0]
        more = f" +{len(activity.writing) - 1} more" if len(activity.writing) > 1 else ""
        what, details = "writing ", (f"{more}, {tokens_text(tokens)}", more)
    else:
        return _clip(head, width)
    rates = f"  {activity.decode_tok_s:.1f} tok/s  hit {percent_text(activity.hit_rate)}"
    for detail, tail in ((details[0], rates), (details[0], ""), (details[1], "")):
        room = width - len(head) - 2 - len(what) - len(detail) - len(tail)
        if room >= min(len(name), 8):
            return f"{head}  {what}{_clip(name, room)}{detail}{tail}"
    return _clip(head, width)


class _Line:
    """The live progress line, rendered at the console's current width on every refresh."""

    def __init__(self, reporter: RichReporter) -> None:
        self.r = reporter

    def __rich__(self) -> Text:
        return Text(self.r.line(err.width - 1), no_wrap=True, overflow="ellipsis")


class RichReporter:
    """Progress: a live line on a terminal (refreshed every second, new data after every
    engine step), one line per document and a heartbeat each minute in a log file."""

    def __init__(self) -> None:
        self.live = None
        self.activity, self.activity_at = None, 0.0
        self.total = self.done = self.failed = 0
        self.t0 = self.last_line = time.monotonic()

    def message(self, text: str) -> None:
        """A runner's message, dim, wrapped between words (a long path kept whole)."""
        print_wrapped(err, as_flags(text), style="dim")

    def start(self, total: int, skipped: int, failed: int = 0) -> None:
        self.total, self.done, self.failed = total, skipped, failed
        self.t0 = self.last_line = time.monotonic()
        if skipped + failed >= total or not err.is_terminal:
            return
        from rich.live import Live

        self.live = Live(_Line(self), console=err, refresh_per_second=1, transient=False)
        self.live.start()

    def eta(self) -> float | None:
        """Seconds left: the runner's estimate (:mod:`mlx_tier.job.eta`, from tokens left and the
        rates measured) less the time since it came; ``None`` while it is estimating."""
        if self.done + self.failed >= self.total:
            return 0.0
        if self.activity is None or self.activity.eta_seconds is None:
            return None
        return max(self.activity.eta_seconds - (time.monotonic() - self.activity_at), 0.0)

    def line(self, width: int) -> str:
        return progress_line(self.done, self.total, time.monotonic() - self.t0, self.eta(), self.activity, width,
                             self.failed)

    def working(self, activity) -> None:
        now = time.monotonic()
        at = getattr(activity, "at", None)  # when its ETA was measured: an update during a long step keeps it
        self.activity, self.activity_at = activity, at if at is not None and at <= now else now
        if self.live is None and now - self.last_line >= HEARTBEAT_SECONDS:  # a log: a line now and then
            self.last_line = now
            print_wrapped(err, self.line(200))

    def finished(self, result, cache: dict) -> None:
        if result.status == "failed":
            self.failed += 1
            print_wrapped(err, f"failed {result.id}: {failure_text(result)}", "red", len("failed"))
            return
        self.done += 1
        if self.live is None:  # a log file gets one line per document instead of a live line
            print_wrapped(err, f"{self.done}/{self.total} {result.id}: {tokens_text(result.output_tokens)}, "
                          f"{result.doc_seconds:.1f} s of its own, hit rate so far {percent_text(cache['hit_rate'], 1)}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def status_cell(result) -> str:
    """A document's status for the results table: ``done``, ``pending``, or ``failed:`` and
    the reason in a few words below it (``failed:\\nempty``,
    :func:`mlx_tier.messages.short_reason`: the column stays narrow, so the names keep
    their width at 80 columns); ``*`` marks one done or failed by an earlier run."""
    from mlx_tier.messages import short_reason

    mark = "*" if result.earlier_run else ""
    if result.status == "failed":
        return f"failed{mark}:\n{short_reason(result.error, getattr(result, 'error_code', None))}"
    return f"{result.status}{mark}"


def _shown_name(result) -> str:
    """A result's name as its input gave it (a file's path in the folder, a JSONL line's id),
    else its output id; a file name that is not valid UTF-8 with its stray bytes written out
    (:func:`mlx_tier.monitor.page.shown`)."""
    from mlx_tier.monitor.page import shown

    return shown(result.name if isinstance(result.name, str) and result.name else result.id)


def _renamed(result) -> bool:
    """Whether a result's output is named otherwise than its name says (a file ``x/a.txt`` is
    ``x__a.md``, a JSONL line's ``report.v2`` is ``report.v2.md``; a clash made it
    ``a.txt-2.md`` or, beside an ``a.txt``, ``a.md.md`` for a file ``a.md``, or the name was
    cut to fit). A file is told from a JSONL line by its ``source`` (the file's path, or
    ``FILE:LINE``); without one (an older record) either form is its own."""
    name = _shown_name(result)
    as_file, as_line = Path(name).with_suffix("").as_posix().replace("/", "__"), name.replace("/", "__")
    source = result.source if isinstance(result.source, str) and result.source else None
    if source is None:
        return result.id not in (as_file, as_line)
    return result.id != (as_file if Path(source).name == Path(name).name else as_line)


def print_summary(report, out_dir: Path) -> None:
    """A job's results table (one row per document), then :func:`summary_line` in paragraphs."""
    earlier = "*: by an earlier run. " if any(r.earlier_run for r in report.results) else ""
    what = report.noun
    renamed = ", → its output where it is named otherwise" if any(_renamed(r) for r in report.results) else ""
    seconds = "req s" if what == "request" else "doc s"
    parts = "" if what == "request" else " (a long document's part summaries included)"
    table = Table(title="mlx-tier run", caption=earlier + f"{what}: as the input names it{renamed}. in tok: the "
                  f"{what} with {'its messages' if what == 'request' else 'the instruction'}, in tokens; out "
                  f"tok: tokens written{parts}. {seconds}: its own time, reading its prompt and writing its "
                  "answer (decode steps are shared with those written alongside)")
    for col in (what, "status", "in tok", "out tok", seconds):
        table.add_column(col, justify="left" if col in (what, "status") else "right",
                         overflow="fold" if col in (what, "status") else "ellipsis")
    for r in report.results:
        status = status_cell(r)
        style = {"failed": "red", "pending": "yellow"}.get(r.status, "dim" if r.earlier_run else "")
        shown = f"{_shown_name(r)} → {r.id}.md" if _renamed(r) and what != "request" else _shown_name(r)
        table.add_row(shown, status, str(r.input_tokens), str(r.output_tokens), f"{r.doc_seconds:.1f}", style=style)
    out.print(table)
    for part in summary_line(report, out_dir).split(" | "):  # one paragraph each, wrapped between words
        out.print(part, highlight=False, markup=False)


def _reread_text(read: int, experts: int, evictions: int, ranks: int | None) -> str:
    """Why a run read more expert bytes than the experts hold on disk (``""`` when it did
    not): each of a distributed run's ``ranks`` reads its own copy, and experts a cache
    evicted are read again when next needed; what is left unexplained is not guessed."""
    if not experts or read <= experts:
        return ""
    why = ([f"each of the {ranks} ranks reads its own copy"] if ranks and ranks > 1 else []) \
        + (["experts evicted from the cache are read again when next needed"] if evictions else [])
    return f" = {read / experts:.1f}x the experts' {experts / 2**20:.0f} MiB on disk" + (
        ": " + "; ".join(why) if why else "")


def summary_line(report, out_dir: Path) -> str:
    """The final line: the job's totals, then this run's own figures, then where the report
    (and a batch request file's answers) are."""
    from mlx_tier.outdir.layout import BATCH_ERRORS, BATCH_OUTPUT

    failures = f"failures: {out_dir / BATCH_ERRORS}" if report.count("failed") else ""
    answers = f"answers: {out_dir / BATCH_OUTPUT}" if (out_dir / BATCH_OUTPUT).exists() else "no answers"
    where = (f" | {answers}{', ' + failures if failures else ''}" if report.setup.get("batch_requests") else "") \
        + f" | report: {out_dir / 'report.json'}"
    run = report.runs[-1]
    chunked = sum(r.parts > 0 and r.status == "done" for r in report.results)  # a failed one was not summarised
    copied = run.get("reused", 0)  # summaries of the same content this run copied under a new name
    earlier = f"{run['already_done']} by earlier runs" + (f", {copied} of them copied now under a new name"
                                                          if copied else "")
    line = (f"job: {report.count('done')} done ({earlier}), "
            f"{report.count('failed')} failed, {report.count('pending')} pending"
            + (f" ({chunked} long, summarised in parts)" if chunked else ""))
    if not run.get("loaded_model") and run.get("failed"):  # each document it tried failed as read
        return line + f" | this run: {run['failed']} failed as read (empty or unreadable); no model loaded" + where
    if not run.get("loaded_model"):
        return line + " | this run: nothing to do (model not loaded)" + where
    c = run["cache"]
    read = c["bytes_read"]
    experts = report.setup.get("expert_bytes_on_disk") or 0
    reread = _reread_text(read, experts, c.get("evictions", 0), (report.setup.get("distributed") or {}).get("ranks"))
    redone = redone_text(run.get("redone_stale", 0), run.get("redone_changed", 0), report.noun)
    loading = f" (loading {seconds_text(run['load_seconds'])} apart)" if run.get("load_seconds") is not None else ""
    return (line + f" | this run: {rate_text(run.get('documents_per_hour', 0.0))} {report.noun}s/hour, "
            f"{run.get('output_tok_per_s', 0.0):.2f} output tok/s over "
            f"{seconds_text(run.get('generation_seconds', run.get('seconds', 0.0)))} of generation{loading}"
            + (f", redone {redone}" if redone else "")
            + f", {_hit_text(c)}, read {mib_text(read)}{reread}, "
            f"throttled {run.get('throttled_seconds', 0.0):.0f} s" + where)


def _hit_text(counters: dict) -> str:
    """``"hit rate 36.6%"``, or ``"no expert lookups"`` for a run that routed no token (a
    stop before its first step): 0.0% would read as a cache that missed everything."""
    if "hits" in counters and not counters["hits"] + counters.get("misses", 0):
        return "no expert lookups"
    return f"hit rate {percent_text(counters['hit_rate'], 1)}"


def redone_text(stale: int, changed: int, what: str = "document") -> str:
    """How many summaries (or a batch request file's answers: ``what`` ``"request"``) a run
    rewrote and why, e.g. ``"2 stale (document changed)"``; ``""`` when none."""
    why = "request changed, or the --max-tokens of one without its own" if what == "request" else f"{what} changed"
    parts = [f"{stale} stale ({why})" if stale else "",
             f"{changed} written with other settings" if changed else ""]
    return ", ".join(p for p in parts if p)


def mix_lines(written: list[dict], prompts: dict[str, str], width: int = 40) -> list[str]:
    """One line per model and prompt the job's summaries were written with (report.json
    ``written_by``), e.g. ``"3 by demo [3f2a…], prompt 9c1d…: Summarise the…"``, with the
    options that differ among the lines (``"…, prompt 9c1d…, max_tokens 64: …"``,
    :func:`mlx_tier.outdir.journal.options_apart`); an older version's summaries, which
    record neither, as ``"2 by an earlier version (not recorded)"``."""
    lines = []
    for w in written:
        if w.get("model") is None and w.get("prompt") is None:
            lines.append(f"{w['documents']} by an earlier version (not recorded)")
            continue
        weights = f" [{short_fingerprint(w['weights'])}]" if w.get("weights") else ""
        text = prompts.get(w.get("prompt") or "", "")
        said = f": {_clip(' '.join(text.split()), width)}" if text else ""
        prompt = (w.get("prompt") or "?")[:8]
        apart = options_apart(written, w.get("options"))
        apart = f", {apart}" if apart else ""
        lines.append(f"{w['documents']} by {w.get('model') or '?'}{weights}, prompt {prompt}{apart}{said}")
    return lines


def _how_far(doc_id: str, read: dict) -> str:
    """A document in flight that this step neither read nor wrote, and how far it got: its
    prompt read (to write), part of it read, or not started (a user trial: all three were
    listed alike as "waiting")."""
    got = read.get(doc_id)
    if not (isinstance(got, list) and len(got) == 2 and all(isinstance(x, int) for x in got)):
        return f"{doc_id} (not started)"
    done, length = got
    return f"{doc_id} (prompt read)" if done >= length else f"{doc_id} ({done:,}/{length:,} read)"


def in_flight_rows(progress: dict | None) -> list[tuple[str, str]]:
    """Rows for ``mlx-tier status``: the documents in flight from a running job's progress file."""
    if not progress:
        return []
    from mlx_tier.monitor.status import estimate_age

    age = estimate_age(progress, time.time(), time.monotonic())  # the rates' age, not the file's
    rows = []
    # the prompts a step reads together (a throughput run's, or a distributed run's ranks'), the
    # step's rate once, on the prompt of the snapshot it was measured in (the freshest rank's)
    own = progress.get("reading")
    read_now = [r for r in [*(progress.get("also_reading") or []), own] if r]
    for r in read_now:
        name, read, length = r
        rate = f" ({progress.get('prompt_tok_s', 0):.1f} prompt tok/s)" if r is own else ""
        rows.append(("reading", f"{name}: {read:,}/{length:,} prompt tokens{rate}"))
    for name, tokens in progress.get("writing") or []:
        rows.append(("writing", f"{name}: {tokens_text(tokens)} so far"))
    busy = {w[0] for w in progress.get("writing") or []} | {r[0] for r in read_now}
    waiting = [i for i in progress.get("in_flight") or [] if i not in busy]
    if waiting:
        rows.append(("waiting", ", ".join(_how_far(i, progress.get("read") or {}) for i in waiting)))
    rows.append(("rates", f"decode {progress.get('decode_tok_s', 0):.1f} tok/s, hit rate "
                          f"{percent_text(progress.get('hit_rate', 0), 1)} (as of {age:.0f} s ago)"))
    return rows
