"""``mlx-tier``: the command line. Parses, builds a config, calls the library, prints."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import typer
import typer.core

from mlx_tier.defaults import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NICE,
    DEFAULT_POLICY,
    DEFAULT_PREFILL_STEP,
    DEFAULT_PROMPT,
    DEFAULT_REPETITION_PENALTY,
    JOB_KERNEL,
)

try:  # Typer >= 0.24 carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older Typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text


class OneLineErrors(typer.core.TyperGroup):
    """Usage errors (an option out of range, a missing argument) as one ``error:`` line and
    exit code 2, like the CLI's own errors, instead of a boxed usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except UsageError as e:
            where = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
            err.print(f"[bold red]error:[/] {escape(e.format_message() + where)}", highlight=False, soft_wrap=True)
            sys.exit(EXIT_BAD_INPUT)
        except ClickException as e:
            err.print(f"[bold red]error:[/] {escape(e.format_message())}", highlight=False, soft_wrap=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

from mlx_tier.cli import ranks_cmd, watch_cmd  # ranks_cmd: issue 16

app = typer.Typer(
    help="Run Mixture-of-Experts models larger than memory: experts stream from disk into a bounded cache.",
    no_args_is_help=True,
    add_completion=False,
    cls=OneLineErrors,
    rich_markup_mode=None,  # click's plain help: wraps to the terminal, never cuts an option name
)
err = Console(stderr=True)
out = Console()

EXIT_FAILED_DOCS = 1
EXIT_BAD_INPUT = 2
EXIT_JOB_ERROR = 3  # the job stopped early (disk full, checkpoint unreadable mid-job); rerun to resume
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15, as a shell reports a process it ended


# The library names a setting `like_this` in its messages (mlx_tier.errors: the
# error's ``field``); the CLI shows the flag that sets it.
FLAGS = {"max_tokens": "--max-tokens", "context": "--context", "max_temp": "--max-temp",
         "min_battery": "--min-battery", "max_tok_s": "--max-tok-s", "bits": "--bits", "mode": "--mode",
         "cache_gb": "--cache-gb", "batch_size": "--batch-size",
         "slots": "--slots", "retry_failed": "--retry-failed", "pause_on_battery": "--pause-on-battery",
         "follow_links": "--follow-links", "policy": "--policy", "instruction": "--prompt"}


def as_flags(message: str) -> str:
    """``message`` with each library setting name (`max_tokens`) as its flag (--max-tokens)."""
    for name, flag in FLAGS.items():
        message = message.replace(f"`{name}`", flag)
    return message


def print_with_command(console: Console, prose: str, command: str, label: str = "") -> None:
    """``prose`` word-wrapped to the console's width, then ``command`` alone on its own line
    (:func:`mlx_tier.messages.with_command`: copyable, never cut mid-word); ``label``
    (``"error:"``) starts the first line in bold red."""
    from mlx_tier.messages import with_command

    text = Text(with_command(f"{label} {prose}" if label else prose, command, console.width))
    if label:
        text.stylize("bold red", 0, len(label))
    console.print(text, highlight=False, soft_wrap=True)


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


def fail(message, command: str | None = None) -> None:
    """One clear error line (settings named by their flags) and exit code 2; a command that
    fixes it (given, or an :class:`~mlx_tier.errors.MlxTierError`'s ``command``) follows
    on its own line (:func:`print_with_command`). ``message``: text or the error itself."""
    command = command or getattr(message, "command", None)
    text = as_flags(getattr(message, "prose", None) if command and not isinstance(message, str) else str(message))
    if command:
        print_with_command(err, text, command, label="error:")
    else:
        err.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_BAD_INPUT)


HEARTBEAT_SECONDS = 60  # how often a log file gets a progress line between documents


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

    ``activity`` is a :class:`mlx_tier.jobs.Activity` or ``None`` (nothing started yet);
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
        what, details = "writing ", (f"{more}, {tokens} tokens", more)
    else:
        return _clip(head, width)
    rates = f"  {activity.decode_tok_s:.1f} tok/s  hit {activity.hit_rate:.0%}"
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
        err.print(f"[dim]{escape(as_flags(text))}[/]", highlight=False, soft_wrap=True)

    def start(self, total: int, skipped: int) -> None:
        self.total, self.done = total, skipped
        self.t0 = self.last_line = time.monotonic()
        if skipped:
            err.print(f"skipping {skipped} document(s) already done (journal)", soft_wrap=True)
        if skipped == total or not err.is_terminal:
            return
        from rich.live import Live

        self.live = Live(_Line(self), console=err, refresh_per_second=1, transient=False)
        self.live.start()

    def eta(self) -> float | None:
        """Seconds left: the runner's estimate (:mod:`mlx_tier.eta`, from tokens left and the
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
        self.activity, self.activity_at = activity, now
        if self.live is None and now - self.last_line >= HEARTBEAT_SECONDS:  # a log: a line now and then
            self.last_line = now
            print_wrapped(err, self.line(200))

    def finished(self, result, cache: dict) -> None:
        if result.status == "failed":
            self.failed += 1
            print_wrapped(err, f"failed {result.id}: {as_flags(str(result.error))}", "red", len("failed"))
            return
        self.done += 1
        if self.live is None:  # a log file gets one line per document instead of a live line
            print_wrapped(err, f"{self.done}/{self.total} {result.id}: {result.output_tokens} tokens, "
                          f"{result.doc_seconds:.1f} s of its own, hit rate so far {cache['hit_rate']:.1%}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def status_cell(result) -> str:
    """A document's status for the results table: ``done``, ``pending``, or ``failed:`` and
    the reason in a few words below it (``failed:\\nempty file``,
    :func:`mlx_tier.messages.short_reason`: the column stays narrow, so the names keep
    their width at 80 columns); ``*`` marks one done or failed by an earlier run."""
    from mlx_tier.messages import short_reason

    mark = "*" if result.earlier_run else ""
    if result.status == "failed":
        return f"failed{mark}:\n{short_reason(result.error)}"
    return f"{result.status}{mark}"


def print_summary(report, out_dir: Path) -> None:
    table = Table(title="mlx-tier run", caption="*: by an earlier run. in tok: the document with the instruction, in "
                  "tokens; out tok: tokens written (a long document's part summaries included). doc s: the "
                  "document's own time, reading its prompt and writing its summary (decode steps are shared "
                  "with the documents written alongside)")
    for col in ("document", "status", "in tok", "out tok", "doc s"):
        table.add_column(col, justify="left" if col in ("document", "status") else "right",
                         overflow="fold" if col in ("document", "status") else "ellipsis")
    for r in report.results:
        status = status_cell(r)
        style = {"failed": "red", "pending": "yellow"}.get(r.status, "dim" if r.earlier_run else "")
        table.add_row(r.id, status, str(r.input_tokens), str(r.output_tokens), f"{r.doc_seconds:.1f}", style=style)
    out.print(table)
    for part in summary_line(report, out_dir).split(" | "):  # one paragraph each, wrapped between words
        out.print(part, highlight=False, markup=False)


def summary_line(report, out_dir: Path) -> str:
    """The final line: the job's totals, then this run's own figures, then where the report is."""
    run = report.runs[-1]
    chunked = sum(r.parts > 0 for r in report.results)
    line = (f"job: {report.count('done')} done ({run['already_done']} by earlier runs), "
            f"{report.count('failed')} failed, {report.count('pending')} pending"
            + (f" ({chunked} long, summarised in parts)" if chunked else ""))
    if not run.get("loaded_model"):
        return line + f" | this run: nothing to do (model not loaded) | report: {out_dir / 'report.json'}"
    c = run["cache"]
    read = c["bytes_read"]
    experts = report.setup.get("expert_bytes_on_disk") or 0
    reread = (f" = {read / experts:.1f}x the experts' {experts / 2**20:.0f} MiB on disk: experts evicted "
              "from the cache are read again when next needed" if experts and read > experts else "")
    return (line + f" | this run: {run['output_tok_per_s']:.2f} output tok/s over its wall time (prompt reading "
            f"included), hit rate {c['hit_rate']:.1%}, read {read / 2**20:.0f} MiB{reread}, "
            f"throttled {run.get('throttled_seconds', 0.0):.0f} s | report: {out_dir / 'report.json'}")


def command_args(ctx: typer.Context, drop: tuple[str, ...] = ()) -> list[str]:
    """The arguments that repeat this command: every parameter given on the command line
    (not defaults), as parsed, except those named in ``drop``."""
    args: list[str] = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)  # click's ParameterSource (Typer may bring its own copy)
        if p.name in drop or source is None or source.name in ("DEFAULT", "DEFAULT_MAP"):
            continue
        value = ctx.params[p.name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if p.param_type_name == "argument":
            args += [str(v) for v in values]
        elif getattr(p, "is_flag", False) and isinstance(value, bool):
            if value or p.secondary_opts:
                args.append(p.opts[0] if value else p.secondary_opts[0])
        else:
            for v in values:
                args += [p.opts[0], str(v)]
    return args


def resume_command(ctx: typer.Context, out_dir: Path, from_stdin: bool) -> str:
    """The exact shell command that resumes this run (a stdin list is read back from OUT_DIR/inputs.txt)."""
    import shlex

    from mlx_tier.status import INPUT_LIST

    line = shlex.join(["mlx-tier", ctx.info_name or "run", *command_args(ctx, drop=("background",))])
    return line + (f" < {shlex.quote(str(out_dir / INPUT_LIST))}" if from_stdin else "")


def _raise_interrupted(signum, frame) -> None:
    from mlx_tier.jobs import Interrupted

    raise Interrupted(signum)


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM raises ``Interrupted`` (until the job installs its own stop handler), so a
    run terminated while loading its model also exits 143 with the resume line."""
    try:
        old = signal.signal(signal.SIGTERM, _raise_interrupted)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


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


# run() is 92 lines only by its 30 declared options and their --help text; the body
# (checks, one JobConfig, dispatch) is ~40 lines. Typer reads options from the signature.
@app.command()
def run(
    input: Path = typer.Argument(..., metavar="INPUT", help="Folder of documents (searched recursively: .txt/.md in any text encoding, .pdf, .docx, .pptx, .xlsx, .xls, .html, .epub, .ipynb, .msg), a JSONL file with custom_id (or id) and text (or an OpenAI batch request body) per line, or - for a list of file paths on stdin."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Folder for the summaries (<id>.md), journal.jsonl and report.json."),
    model: str | None = typer.Option(None, "--model", help="mlx-lm MoE checkpoint folder, or a Hugging Face repo id such as mlx-community/Qwen3-30B-A3B-4bit (local cache first, else downloaded; HF_HUB_OFFLINE=1 forbids downloads). Default: the built-in demo, SmolLM2-135M as an 8-expert MoE: a toy that shows the machinery, not good summaries."),
    cache_gb: float | None = typer.Option(None, "--cache-gb", help="Expert cache budget in GiB (on CUDA: GPU memory, the hot tier). Default: half the memory free after loading the dense part (on CUDA: free GPU memory)."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=1, help="Most tokens generated per summary."),
    prompt: str | None = typer.Option(None, help="Instruction placed before each document, or @FILE to read it from a file."),
    repetition_penalty: float = typer.Option(DEFAULT_REPETITION_PENALTY, "--repetition-penalty", min=1.0, help="mlx-lm repetition penalty over the last 20 tokens; 1.0 = plain greedy. Small models loop without it."),
    trace: Path | None = typer.Option(None, "--trace", help="Record this run's routing trace (top-k experts per token and layer) to this .npz file, for `mlx-tier trace-sim`."),
    output_format: str = typer.Option("md", "--format", help="md: one OUT_DIR/<id>.md per document; jsonl: also OUT_DIR/summaries.jsonl, one line per finished document with its custom_id/id and summary."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Rerun only the documents that failed in an earlier run (a plain rerun leaves them failed)."),
    background: bool = typer.Option(False, "--background", help="Detach: run in its own session with output to OUT_DIR/run.log and its pid in OUT_DIR/run.pid; return at once. Watch it with `mlx-tier status OUT_DIR`."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Documents decoded together (each expert read serves all of them). Default: what memory allows, at most 8."),
    context: int | None = typer.Option(None, "--context", min=64, help="Usable context in tokens (prompt + summary). Default: the model's, or less if memory is short. Longer documents are summarised in parts, then the parts' summaries combined (never truncated)."),
    prefill_step: int = typer.Option(DEFAULT_PREFILL_STEP, "--prefill-step", min=1, help="Most prompt tokens per step while reading a document's prompt (one document at a time). Steps are paced to about 4 s from the measured speed, up to this many tokens; smaller: less memory."),
    max_temp: float | None = typer.Option(None, "--max-temp", help="Slow down above this temperature (°C, hottest sensor)."),
    pause_on_battery: bool = typer.Option(False, "--pause-on-battery", help="Pause while the machine runs on battery; resume on AC."),
    min_battery: float | None = typer.Option(None, "--min-battery", min=0, max=100, help="Pause on battery below this charge (percent)."),
    max_tok_s: float | None = typer.Option(None, "--max-tok-s", help="Hard cap on generated tokens per second (all documents together)."),
    nice: int = typer.Option(DEFAULT_NICE, "--nice", min=0, max=19, help="Lower the job's CPU priority by this much (0: unchanged), so the machine stays responsive."),
    policy: str = typer.Option(DEFAULT_POLICY, "--policy", help="Expert cache eviction policy: lfu (LFU with dynamic aging; default), lru, 2q, or pinned (keeps the saved profile's most used experts; see --save-profile)."),
    prewarm: bool | None = typer.Option(None, "--prewarm/--no-prewarm", help="Fill the expert cache at load with the saved profile's most used experts. Default: only with --policy pinned."),
    save_profile: bool = typer.Option(False, "--save-profile", help="After the run, add its expert use counts to the model's saved profile (next to the checkpoint, or in the user cache if that folder is read-only), for --policy pinned and --prewarm."),
    host_cache_gb: float | None = typer.Option(None, "--host-cache-gb", help="CUDA only: the warm tier, this many GiB of host memory under the GPU's --cache-gb; warm experts are computed on the CPU where they lie (README, \"CUDA path\"); 0 turns it off. Default: half the available host memory. Refused elsewhere (one memory: use --cache-gb)."),
    prefetch: bool | None = typer.Option(None, "--prefetch/--no-prefetch", help="Predict each next layer's experts with its router and read them in the background. Default off: measured not to pay on a 2-core CPU with a warm page cache (README); try it on a slow disk."),
    follow_links: bool = typer.Option(False, "--follow-links", help="Also read links in INPUT that lead outside it (skipped by default)."),
    kernel: str = typer.Option(JOB_KERNEL, "--kernel", help="What computes the experts: cpu (own kernel, within fp32 rounding of MLX; many times faster on MLX's CPU backend), mlx (MLX's ops, tokens exactly as mlx-lm), metal, or auto (cpu on the CPU backend, else mlx)."),
    background_qos: bool = typer.Option(False, "--background-qos", help="macOS: run at background QoS (lowest priority). Warning: reported to slow Metal decoding about 8x."),
    # issue 16: one job over several ranks (cli/ranks_cmd.py, mlx_tier/distributed.py)
    ranks: int | None = typer.Option(None, "--ranks", min=1, help="Spread the job over this many processes on this machine, started by MLX's launcher (mlx.launch, ring backend); each loads the model and takes documents no other rank has started (README, \"Several ranks or Macs\")."),
    hosts: Path | None = typer.Option(None, "--hosts", help="Spread the job over the machines of this mlx.launch hosts file (JSON, one rank per entry: ssh name and IPs); INPUT and --out must be the same shared paths on every machine (README, \"Several ranks or Macs\")."),
    ctx: typer.Context = None,  # filled in by Typer
) -> None:
    """Summarise every document in INPUT into OUT_DIR, resumably.

    INPUT `-` reads file paths from stdin, one a line. Rerunning the same
    command skips finished documents and leaves failed ones failed
    (--retry-failed reruns only those). Documents are decoded in batches;
    the job slows down or pauses when the machine is hot or on battery
    (see `mlx-tier thermal`) and keeps a Mac awake while it runs. Ctrl-C or
    SIGTERM finishes the summaries being written and stops (a second one
    stops at once); everything finished is kept and the command to resume
    is printed.

    Skipped in a folder: dot-files and dot-folders, macOS ._ files and
    __MACOSX, editor lock and backup files (~$x.docx, .#x, x~, #x#, .swp,
    .bak, .tmp), and links that lead outside INPUT (--follow-links reads
    them). PDF, Office, HTML and EPUB files are converted by MarkItDown
    (the `documents` extra of mlx-tier).

    Exit codes: 0 all done, 1 some documents failed, 2 bad input, 3 the job
    stopped early (disk full, checkpoint unreadable; rerun to resume), 130
    interrupted (SIGINT), 143 terminated (SIGTERM).
    """
    from mlx_tier.errors import MlxTierError
    from mlx_tier.jobs import JobConfig, read_prompt
    from mlx_tier.policy import PolicySpec
    from mlx_tier.scheduler import GenerationConfig
    from mlx_tier.tiered import DEFAULT_PREFETCH, TierConfig

    throttle = _checked_run_options(cache_gb, host_cache_gb, prewarm, policy, output_format, kernel, model,
                                    max_temp, pause_on_battery, min_battery, max_tok_s)
    from_stdin = str(input) == "-"
    # Paths as bytes, split on newlines only, decoded as the file system does
    # (a name that is not valid UTF-8 survives as surrogates).
    paths = tuple(os.fsdecode(b.rstrip(b"\r")) for b in sys.stdin.buffer.read().split(b"\n")) if from_stdin else None
    command = resume_command(ctx, out_dir, from_stdin)
    if ranks is not None or hosts is not None:  # issue 16
        ranks_cmd.check(ranks, hosts, background, trace, save_profile)
    try:
        config = JobConfig(
            input=input, out_dir=out_dir, model=model,
            tier=TierConfig(cache_gb=cache_gb, policy=PolicySpec(policy), prewarm=prewarm,
                            prefetch=DEFAULT_PREFETCH if prefetch is None else prefetch,
                            host_cache_gb=host_cache_gb, kernel=kernel),
            generation=GenerationConfig(
                instruction=DEFAULT_PROMPT if prompt is None else read_prompt(prompt), max_tokens=max_tokens,
                repetition_penalty=repetition_penalty, batch_size=batch_size, context=context,
                prefill_step_size=prefill_step),
            throttle=throttle, trace=trace, input_paths=paths, output_format=output_format,
            retry_failed=retry_failed, command=command, nice=nice, background_qos=background_qos,
            save_profile=save_profile, follow_links=follow_links,
        )
    except MlxTierError as e:  # an empty --prompt, an unreadable --prompt @FILE
        fail(str(e))
    if background:
        _start_background(config, [sys.executable, "-m", "mlx_tier.cli.main", "run",
                                   *command_args(ctx, drop=("background",))])
    elif ranks is not None or hosts is not None:  # issue 16: one job over several ranks
        ranks_cmd.run_ranks(config, ranks, hosts, command)
    else:
        _run_job_and_exit(config, out_dir, command)


def _checked_run_options(cache_gb, host_cache_gb, prewarm, policy, output_format, kernel, model,
                         max_temp, pause_on_battery, min_battery, max_tok_s):
    """Check `run`'s options before any work (each bad one: one line, exit 2);
    returns the throttle's config."""
    from mlx_tier.errors import MlxTierError
    from mlx_tier.kernels import kernel_for
    from mlx_tier.policy import POLICIES, PolicySpec
    from mlx_tier.throttle import ThrottleConfig
    from mlx_tier.tier_budgets import probe

    if cache_gb is not None and not (math.isfinite(cache_gb) and cache_gb > 0):
        fail(f"--cache-gb must be a finite positive number of GiB, got {cache_gb}")
    if host_cache_gb is not None and not (math.isfinite(host_cache_gb) and host_cache_gb >= 0):
        fail(f"--host-cache-gb must be a finite number of GiB >= 0, got {host_cache_gb}")
    mem = probe()
    if host_cache_gb is not None and mem.unified:  # one memory: a warm tier would count it twice
        fail(f"--host-cache-gb needs a CUDA GPU (hot tier in GPU memory, warm in host memory); on the "
             f"{mem.backend} backend experts live in one memory: size it with --cache-gb alone")
    where, memory = ("the GPU's memory", mem.device_total) if not mem.unified else ("this machine's memory",
                                                                                    mem.host_total)
    if cache_gb is not None and memory is not None and cache_gb > memory / 2**30:
        fail(f"--cache-gb {cache_gb:g} is more than {where} ({memory / 2**30:.1f} GiB)")
    if output_format not in ("md", "jsonl"):
        fail(f"--format must be md or jsonl, got {output_format!r}")
    if policy not in POLICIES:
        fail(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if host_cache_gb is not None and (prewarm or PolicySpec(policy).needs_profile):
        fail("--host-cache-gb: pre-warm (and --policy pinned) are not implemented for the two-tier cache yet")
    try:
        kernel_for(kernel)  # an unknown name, or metal without Metal
    except ValueError as e:
        fail(f"--kernel: {e}")
    try:
        throttle = ThrottleConfig(max_temp=max_temp, pause_on_battery=pause_on_battery, min_battery=min_battery,
                                  max_tok_s=max_tok_s)
    except ValueError as e:
        fail(str(e))
    if model is not None:
        from mlx_tier.hub import check_name

        try:
            check_name(model)
        except MlxTierError as e:
            fail(str(e))
    return throttle


def _run_job_and_exit(config, out_dir: Path, command: str) -> None:
    """Run the job with the live display; map its ends to one line and an exit code
    (2 bad input, 3 job error, 130/143 signals, 1 failed documents)."""
    from mlx_tier.errors import JobError, MlxTierError
    from mlx_tier.jobs import run_job

    reporter = RichReporter()
    try:
        with _sigterm_interrupts():
            report = run_job(config, reporter)
    except MlxTierError as e:  # bad input, checkpoint, budget, profile, setting: one line, exit 2
        reporter.close()
        fail(e)
    except (JobError, OSError) as e:  # disk full, checkpoint unreadable: finished work is kept
        reporter.close()
        reason = str(e) if isinstance(e, JobError) else f"{e.filename or out_dir}: {e.strerror or e}"
        print_with_command(err, f"{reason}. Finished summaries are kept; resume with:", command, label="error:")
        raise typer.Exit(EXIT_JOB_ERROR)
    except KeyboardInterrupt as e:
        reporter.close()
        term = getattr(e, "signum", signal.SIGINT) == signal.SIGTERM
        print_with_command(err, f"{'terminated' if term else 'interrupted'}; finished summaries are kept. "
                                "Resume with:", command)
        raise typer.Exit(EXIT_TERMINATED if term else EXIT_INTERRUPTED)
    print_summary(report, out_dir)
    if report.interrupted:
        term = report.stop_signal == signal.SIGTERM
        print_with_command(err, f"stopped ({'SIGTERM' if term else 'SIGINT'}); summaries being written were "
                                "finished. Resume with:", command)
        raise typer.Exit(EXIT_TERMINATED if term else EXIT_INTERRUPTED)
    if report.count("failed"):
        raise typer.Exit(EXIT_FAILED_DOCS)


def _start_background(config, argv: list[str]) -> None:
    """Start the run detached (:func:`mlx_tier.jobs.start_detached`: bad input exits 2 now,
    not in a log) and say where to watch it."""
    import shlex

    from mlx_tier.documents import InputError
    from mlx_tier.jobs import start_detached
    from mlx_tier.status import LOG_FILE, PID_FILE

    out_dir = config.out_dir
    try:
        pid = start_detached(config, argv)
    except InputError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot start the background run ({e.strerror or e})")
    out.print(f"started in the background: pid {pid} (also in {out_dir / PID_FILE}), log {out_dir / LOG_FILE}",
              highlight=False, soft_wrap=True)
    print_with_command(out, "watch it with:", f"mlx-tier status {shlex.quote(str(out_dir))}")


def in_flight_rows(progress: dict | None) -> list[tuple[str, str]]:
    """Rows for ``mlx-tier status``: the documents in flight from a running job's progress file."""
    if not progress:
        return []
    age = time.time() - progress.get("time", time.time())
    rows = []
    if progress.get("reading"):
        name, read, length = progress["reading"]
        rows.append(("reading", f"{name}: {read:,}/{length:,} prompt tokens "
                                f"({progress.get('prompt_tok_s', 0):.1f} prompt tok/s)"))
    for name, tokens in progress.get("writing") or []:
        rows.append(("writing", f"{name}: {tokens} tokens so far"))
    waiting = [i for i in progress.get("in_flight") or []
               if i not in {w[0] for w in progress.get("writing") or []} | {(progress.get("reading") or [None])[0]}]
    if waiting:
        rows.append(("waiting", ", ".join(waiting)))
    rows.append(("rates", f"decode {progress.get('decode_tok_s', 0):.1f} tok/s, hit rate "
                          f"{progress.get('hit_rate', 0):.1%} (as of {age:.0f} s ago)"))
    return rows


@app.command()
def status(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Output folder of a running or finished `mlx-tier run`."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    as_html: bool = typer.Option(False, "--html", help="Also write OUT_DIR/report.html: the job's page with charts, openable with no server."),
) -> None:
    """Progress of the job in OUT_DIR: running or not, done/failed/pending, throughput, throttle time, ETA."""
    import json

    from mlx_tier.documents import InputError
    from mlx_tier.status import describe_state, describe_throttle, read_status

    try:
        s = read_status(out_dir)
    except InputError as e:
        fail(str(e))
    if as_html:
        watch_cmd.write_html(out_dir)
    for warning in s.warnings:  # journal lines that are not usable records
        err.print(f"warning: {warning}", highlight=False, soft_wrap=True, markup=False)
    if as_json:
        out.print_json(json.dumps(s.as_dict()))
        return
    t = Table(title=f"mlx-tier status: {out_dir}", show_header=False)
    t.add_row("state", describe_state(s))
    t.add_row("documents", f"{s.total if s.total is not None else '?'} total: {s.done} done, {s.failed} failed, "
                           f"{s.pending if s.pending is not None else '?'} pending")
    if s.started is not None:
        left = f", {s.todo_left} left" if s.todo_left is not None else ""
        t.add_row("this run", f"{s.finished_this_run} finished or failed in {s.elapsed_seconds:.0f} s "
                              f"({s.documents_per_hour:.1f} documents/hour, wall clock){left}")
    t.add_row("throughput", f"{s.output_tok_per_s:.2f} output tok/s this run (wall clock, prompt processing "
                            f"included); {s.output_tokens} tokens in all")
    t.add_row("throttled", f"{s.throttled_seconds:.1f} s")
    for change in s.thermal[-5:]:  # the latest throttle state changes of this run
        t.add_row("throttle", as_flags(describe_throttle(change)))
    for label, text in in_flight_rows(s.progress if s.running else None):
        t.add_row(label, Text(text))
    eta = ("none: stopping" if s.running and (s.progress or {}).get("stopping")
           else format_duration(s.eta_seconds) if s.eta_seconds is not None
           else "estimating (until a prompt step and a decode step are measured)" if s.running else "not running")
    t.add_row("ETA", eta)
    for doc_id, error in s.failures[:5]:
        t.add_row(f"failed: {doc_id}", Text(as_flags(error)))
    if len(s.failures) > 5:
        t.add_row("failed", f"... and {len(s.failures) - 5} more (report.json, journal.jsonl)")
    out.print(t)
    if not s.running and s.command and (s.pending or s.todo_left):
        print_with_command(out, "resume with:", s.command)
    if s.failed and not s.running:
        from mlx_tier.job_view import retry_command

        print_with_command(out, "retry the failed ones with:", retry_command(s.command))


app.command()(watch_cmd.watch)


@app.command()
def plan(
    model: str = typer.Argument(..., metavar="MODEL", help="mlx-lm MoE checkpoint folder, or a Hugging Face repo id (read from the local cache, else only its config and safetensors headers are fetched: nothing large is downloaded)."),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help="Plan for this much memory (GiB) instead of this machine's."),
    context: int = typer.Option(8192, "--context", min=1, help="Context length (tokens) for the KV cache estimate."),
    disk_gbps: float | None = typer.Option(None, "--disk-gbps", help="Disk bandwidth in GB/s (default: a short read test)."),
    compute_gbps: float | None = typer.Option(None, "--compute-gbps", help="Expert compute in GB/s of weights (default: a short matvec test)."),
    gpu_gb: float | None = typer.Option(None, "--gpu-gb", help="Also split the experts into GPU (hot), host (warm, from --memory-gb or this machine) and SSD (cold) tiers for a GPU with this much memory (GiB)."),
    as_json: bool = typer.Option(False, "--json", help="Print the worksheet as JSON."),
) -> None:  # over 60 lines by its 7 declared options and the worksheet's rows; the body calls plan.make_plan and renders
    """Capacity worksheet for MODEL from its config and shard headers (no weights loaded).

    Will it fit, and how fast might it decode: dense part, KV cache, expert
    sizes, the cache mlx-tier would choose and a decode range from the
    disk/compute roofline. Works on a hub repo id before downloading it.
    """
    import json

    from mlx_tier import CheckpointError
    from mlx_tier.plan import make_plan

    if memory_gb is not None and not (math.isfinite(memory_gb) and memory_gb > 0):
        fail(f"--memory-gb must be positive, got {memory_gb}")
    try:
        p = make_plan(model, memory_gb=memory_gb, context_tokens=context, disk_gbps=disk_gbps, compute_gbps=compute_gbps)
    except CheckpointError as e:
        fail(str(e))
    if gpu_gb is not None and not (math.isfinite(gpu_gb) and gpu_gb > 0):
        fail(f"--gpu-gb must be positive, got {gpu_gb}")
    from mlx_tier.tier_plan import three_tier_split

    split = three_tier_split(p, gpu_gb) if gpu_gb is not None else None
    if as_json:
        out.print_json(json.dumps({**p.as_dict(), **({"tiers": split.as_dict()} if split else {})}))
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
    if split is not None:
        E = split.experts_per_layer
        rows += [
            ("GPU free after the dense part", f"{split.device_free / gib:.2f} GiB (assumed: {gpu_gb:g} GiB - dense)"),
            ("GPU hot tier (half of it, as a run)", f"{split.hot_budget / gib:.2f} GiB = {split.hot_slots} of {E} experts per layer"),
            ("GPU left for KV cache, activations", f"{split.gpu_left / gib:.2f} GiB (KV estimate {p.kv_bytes / gib:.2f} GiB)"),
            ("host warm tier", f"{split.host_budget / gib:.2f} GiB = {split.warm_slots} of {E} experts per layer"),
            ("SSD cold tier", f"{split.cold_experts} of {E} experts per layer"),
        ]
        if not split.fits:
            rows.append(("three-tier split", f"does not fit: {split.why}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


@app.command()
def convert(
    hf_dir: str = typer.Argument(..., metavar="HF_DIR", help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer), or a repo id (local cache first, else downloaded)."),
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="New folder for the mlx-lm checkpoint (must not exist)."),
    bits: int = typer.Option(4, "--bits", help="Bits of the routed experts: 2, 3, 4, 5, 6 or 8."),
    group_size: int | None = typer.Option(None, "--group-size", help="Quantisation group size (default: 64 affine, 32 mxfp4)."),
    mode: str = typer.Option("affine", "--mode", help="affine or mxfp4."),
    router_bits: int = typer.Option(8, "--router-bits", help="Routers/gates: 8, or 16 to keep them unquantised."),
    shared_expert_bits: int | None = typer.Option(None, "--shared-expert-bits", help="Shared experts (default: max(8, --bits); 16 = unquantised)."),
    calib: Path | None = typer.Option(None, "--calib", help="Calibration text for the router-agreement check (default: a shipped text)."),
) -> None:
    """Convert a Hugging Face MoE checkpoint to mlx-lm format, router-safe.

    Routed experts at --bits; routers and shared experts at 8 bits or more (a
    quantised router flips the top-k choice). Checks every MoE layer holds all
    experts and reports router agreement with the unquantised model.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.convert import ConvertConfig
    from mlx_tier.convert import convert as do_convert

    if router_bits not in (8, 16):
        fail(f"--router-bits must be 8 or 16, got {router_bits}")
    cfg = ConvertConfig(bits=bits, group_size=group_size, mode=mode, router_bits=router_bits, shared_expert_bits=shared_expert_bits)
    try:
        from mlx_tier.hub import resolve_model

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


@app.command("trace-sim")
def trace_sim(
    trace: Path = typer.Argument(..., metavar="TRACE", help="A routing trace: mlx-tier's .npz (from `run --trace`) or plain text lines 'TOKEN LAYER E1 E2 ...'."),
    policy: list[str] = typer.Option(["lru", "lfu", "2q", "pinned", "belady"], "--policy", help="Policies to compare (repeatable): lru, lfu, 2q, pinned, belady."),
    slots: list[int] = typer.Option([], "--slots", help="Slots per layer (repeatable). Default: 25%, 50% and 75% of the experts."),
    split: str = typer.Option("uniform", "--split", help="uniform: every layer gets --slots; adaptive: the same total (slots x layers) spread by each layer's simulated miss curve."),
    prewarm: bool = typer.Option(False, "--prewarm", help="Start each layer with the profile's most used experts resident, as the live cache does at load."),
    profile: Path | None = typer.Option(None, "--profile", help="Profile file for `pinned` and --prewarm (a mlx-tier-profile.json). Default: the trace's own counts."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write a PNG of hit rate vs cache size (every size up to all experts), one line per policy. Needs matplotlib (pip install 'mlx-tier[plot]')."),
    warm_slots: int | None = typer.Option(None, "--warm-slots", min=0, help="CUDA path: also simulate a warm host tier of this many slots per layer under each --slots (hot, GPU) size; prints hot/warm/miss rates and the share computed on the CPU (live policies only). With --prewarm, hot then warm start filled; a trace recorded with --prefetch also replays the promotions from warm to hot ahead of use."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:  # over 60 lines by its 10 declared options and their help; the body checks, calls simulate.compare, renders
    """Replay a routing trace: hit rate per policy and cache size, Belady's optimum as the ceiling.

    Each layer has its own slots; hit rate = accesses found resident / all expert
    accesses. Without --profile, `pinned` and --prewarm use the trace's own expert
    counts (an upper bound for a profile saved from other runs), and the adaptive
    split is fitted on the trace it is scored on (also an upper bound).
    """
    import importlib.util

    from mlx_tier.errors import ConfigError
    from mlx_tier.policy import OFFLINE_POLICIES, POLICIES
    from mlx_tier.profile import ProfileError
    from mlx_tier.profile import load as load_profile
    from mlx_tier.simulate import Comparison, compare, plot_hit_rates
    from mlx_tier.trace import TraceError
    from mlx_tier.trace import load as load_trace

    try:
        t = load_trace(trace)
    except TraceError as e:
        fail(str(e))
    for p in policy:
        if p not in POLICIES and p not in OFFLINE_POLICIES:
            fail(f"unknown policy {p!r}; choose from {', '.join(list(POLICIES) + list(OFFLINE_POLICIES))}")
    if split not in ("uniform", "adaptive"):
        fail(f"--split must be uniform or adaptive, got {split!r}")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        fail("--plot needs matplotlib, which is not installed; install it with:", "pip install 'mlx-tier[plot]'")
    E, L = t.num_experts, t.num_layers
    sim = Comparison(tuple(policy), tuple(slots), split, prewarm, curve=plot is not None)
    try:
        sizes = sim.sizes(E)
    except ConfigError as e:
        fail(str(e))
    prof = None
    if profile is not None:
        try:
            prof = load_profile(profile)
            prof.check(L, E, str(profile))
        except ProfileError as e:
            fail(str(e))
    if warm_slots is not None:
        _two_tier_sim(t, trace, [p for p in policy if p in POLICIES], sizes, warm_slots, prof, prewarm, as_json)
        return
    results, curve = compare(t, sim, prof)
    if plot is not None:
        try:
            plot_hit_rates(curve, E, plot, f"{trace.name}: {L} layers x {E} experts, {split} split"
                           + (", pre-warmed" if prewarm else ""))
        except OSError as e:
            fail(f"{plot}: cannot write the plot ({e.strerror or e})")
    _print_sim_results(t, trace, results, policy, sizes, split, prewarm, profile, as_json)
    if plot is not None and not as_json:
        out.print(f"plot written to {plot}", highlight=False)


def _print_sim_results(t, trace: Path, results: list, policies: list[str], sizes: list[int], split: str,
                       prewarm: bool, profile: Path | None, as_json: bool) -> None:
    """`trace-sim`'s output: JSON, or one table row per policy and a column per cache size."""
    import json

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
        table.add_column(f"{n} slots ({n / E:.0%})", justify="right")
    for p in policies:
        table.add_row(p, *[f"{r.hit_rate:.1%}" for r in results if r.policy == p])
    out.print(table)


def _two_tier_sim(t, trace: Path, policies: list[str], hot_sizes: list[int], warm: int, prof, prewarm: bool,
                  as_json: bool) -> None:
    """`trace-sim --warm-slots`: the two-tier replay (mlx_tier.simulate_tiers), one table row per policy and
    hot size; a trace recorded with prefetch replays its warm -> hot promotions."""
    import json

    from mlx_tier.simulate_tiers import simulate_two_tier

    E = t.num_experts
    if not policies:
        fail("--warm-slots simulates live policies only (lru, lfu, 2q, pinned): give one with --policy")
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
        table.add_row(r.policy, str(r.hot_slots), f"{r.hot_hit_rate:.1%}", f"{r.warm_hit_rate:.1%}",
                      f"{r.miss_rate:.1%}", f"{r.cpu_share:.1%}")
    out.print(table)


@app.command("trace-stats")
def trace_stats(
    traces: list[Path] = typer.Argument(..., metavar="TRACE...", help="Routing traces (.npz from `run --trace`, or text)."),
    as_json: bool = typer.Option(False, "--json", help="Print every layer's statistics as JSON."),
) -> None:
    """Routing statistics of traces, to compare with a trained MoE's: expert popularity,
    step-to-step reuse, cross-layer predictability (means over layers; mlx_tier.routing_stats)."""
    import json

    from mlx_tier.routing_stats import routing_stats, summary_rows
    from mlx_tier.trace import TraceError
    from mlx_tier.trace import load as load_trace

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


@app.command("profile")
def profile_cmd(
    model: str = typer.Argument(..., metavar="MODEL", help="mlx-lm MoE checkpoint folder (or Hugging Face repo id) the traces were recorded on."),
    traces: list[Path] = typer.Argument(..., metavar="TRACE...", help="Routing traces (.npz from `run --trace`, or text)."),
    decay: float = typer.Option(1.0, "--decay", min=0.0, max=1.0, help="Weight of the saved counts before adding these (1 = counts add, 0.5 halves the past)."),
) -> None:
    """Save expert frequencies from routing traces as MODEL's profile (merged with
    any saved one), for the `pinned` policy, pre-warm at load and the adaptive split.

    Written to MODEL/mlx-tier-profile.json, or to the user cache dir when MODEL is
    not writable.
    """
    from mlx_tier import CheckpointError
    from mlx_tier.profile import ProfileError, from_trace, model_shape, record
    from mlx_tier.trace import TraceError
    from mlx_tier.trace import load as load_trace

    try:
        from mlx_tier.hub import resolve_model

        model = resolve_model(model)
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


@app.command()
def thermal(
    as_json: bool = typer.Option(False, "--json", help="Print every sensor's status and reading as JSON."),
) -> None:
    """Current readings from every sensor the throttle can use, and which are unavailable (and why)."""
    import json

    from rich.text import Text

    from mlx_tier.sensors import merge, survey

    statuses = survey()
    merged = merge((s.name, s.reading) for s in statuses if s.reading is not None)
    if as_json:
        out.print_json(json.dumps({"sensors": [s.as_dict() for s in statuses], "merged": merged.as_dict()}))
        return
    table = Table(title="mlx-tier thermal: sensors")
    for col in ("sensor", "available", "reading"):
        table.add_column(col)
    for s in statuses:
        if not s.available:
            table.add_row(s.name, "no", Text(s.reason or ""), style="dim")
            continue
        r = s.reading
        values = ", ".join(f"{k}={v}" for d in r.details.values() for k, v in d.items())
        errors = "; ".join(r.errors.values())
        table.add_row(s.name, "yes", Text(f"read failed: {errors}" if errors else values))
    out.print(table)
    if not any(s.available for s in statuses):
        out.print("no sensor available on this machine: the throttle can only apply --max-tok-s", highlight=False)
    else:
        out.print(f"throttle input: {merged.summary()}", highlight=False)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
