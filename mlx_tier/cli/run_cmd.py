"""``mlx-tier run``: options in, one :class:`~mlx_tier.job.config.JobConfig`, then the job
in this process (:func:`mlx_tier.job.run.run_job`), detached (``--background``) or over
several ranks (:mod:`mlx_tier.cli.ranks_cmd`); its ends mapped to exit codes.

The lists in ``--help`` come from the library: document suffixes from
:mod:`mlx_tier.job.doc_text`, policies from :mod:`mlx_tier.policy.eviction`, kernels
from :mod:`mlx_tier.kernels`, output formats from :mod:`mlx_tier.outdir.layout`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import typer

from mlx_tier.cli import checks, ranks_cmd
from mlx_tier.cli.exits import (
    EXIT_FAILED_DOCS,
    EXIT_JOB_ERROR,
    fail,
    stopped_by,
)
from mlx_tier.cli.render import (
    RichReporter,
    choices,
    err,
    out,
    print_left_pending,
    print_resume,
    print_summary,
    print_with_command,
)
from mlx_tier.defaults import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_NICE,
    DEFAULT_POLICY,
    DEFAULT_PREFILL_STEP,
    DEFAULT_PROMPT,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_SCHEDULE,
    JOB_KERNEL,
    SCHEDULES,
)
from mlx_tier.job.convert_limits import (
    DEFAULT_MEMORY_MB,
    DEFAULT_SECONDS,
    DEFAULT_SECONDS_PER_MB,
)
from mlx_tier.job.doc_text import CONVERTED_SUFFIXES, TEXT_SUFFIXES
from mlx_tier.kernels import KERNELS
from mlx_tier.outdir.layout import BATCH_ERRORS, BATCH_OUTPUT, OUTPUT_FORMATS, SUMMARIES
from mlx_tier.policy.eviction import POLICIES, PolicySpec
from mlx_tier.units import count_text

INPUT_HELP = (f"Folder of documents (searched recursively: {'/'.join(TEXT_SUFFIXES)} in any text encoding, "
              f"{', '.join(CONVERTED_SUFFIXES)}), a JSONL file with custom_id (or id) and text per line, an OpenAI "
              f"Batch API file (run as written; answers in OUT_DIR/{BATCH_OUTPUT}, failures in "
              f"OUT_DIR/{BATCH_ERRORS}), or - for a list of file paths on stdin.")
FORMAT_HELP = (f"md: one OUT_DIR/<id>.md per document; jsonl: also OUT_DIR/{SUMMARIES}, one line per finished "
               "document with its custom_id/id and summary.")
POLICY_HELP = ("Expert cache eviction policy: tinylfu (W-TinyLFU: scan-resistant, frequency-based), lfu is LFU "
               "with dynamic aging; pinned keeps the saved profile's most used experts (see --save-profile).")
KERNEL_HELP = ("What computes the experts: cpu, own kernel (within fp32 rounding of MLX; many times faster on MLX's "
               "CPU backend); mlx, MLX's ops (tokens exactly as mlx-lm); metal; auto, cpu on the CPU backend, "
               "else mlx.")


def stop_outcome(report) -> str:
    """What a first stop left: the finished summaries kept, and how many documents (or a
    request file's requests) wait for the next run; those being written when it came were
    finished only where they could be within the stop's grace (:data:`STOP_GRACE_SECONDS`)."""
    from mlx_tier.job.stopflag import STOP_GRACE_SECONDS

    left = report.count("pending")
    outputs = "answers" if report.noun == "request" else "summaries"
    if not left:
        return f"the {outputs} being written were finished"
    return (f"finished {outputs} are kept, {count_text(left, report.noun)} left for the next run (what was being "
            f"written is finished only within {STOP_GRACE_SECONDS:g} s)")


def run(
    input: Path = typer.Argument(..., metavar="INPUT", help=INPUT_HELP),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Folder for the summaries (<id>.md), journal.jsonl and report.json."),
    model: str | None = typer.Option(None, "--model", help="mlx-lm MoE checkpoint folder, or a Hugging Face repo id such as mlx-community/Qwen3-30B-A3B-4bit (local cache first, else downloaded; HF_HUB_OFFLINE=1 forbids downloads). Default (or demo): the built-in demo, SmolLM2-135M as an 8-expert MoE: a toy that shows the machinery, not good summaries."),
    memory_gb: float | None = typer.Option(None, "--memory-gb", help="Memory the whole run may hold, in GiB: the expert cache, KV cache, step workspace and the rest are derived from it (see docs/cli.md). Default: what this process may use: its container's (cgroup) limit, else the machine's available memory. A run that cannot fit is refused before loading."),
    cache_gb: float | None = typer.Option(None, "--cache-gb", help="Expert cache budget in GiB alone (on CUDA: GPU memory, the hot tier). Default: half of what the memory total leaves after the runtime, dense part, workspace and margin (on CUDA: of free GPU memory)."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=1, help="Most tokens generated per summary."),
    prompt: str | None = typer.Option(None, help="Instruction placed before each document, or @FILE to read it from a file."),
    repetition_penalty: float = typer.Option(DEFAULT_REPETITION_PENALTY, "--repetition-penalty", min=1.0, help="mlx-lm repetition penalty over the last 20 tokens; 1.0 = plain greedy. Small models loop without it."),
    trace: Path | None = typer.Option(None, "--trace", help="Record this run's routing trace (top-k experts per token and layer) to this .npz file, for `mlx-tier trace-sim`."),
    output_format: str = typer.Option("md", "--format", metavar=choices(OUTPUT_FORMATS), help=FORMAT_HELP),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Rerun only the documents that failed in an earlier run (a plain rerun leaves them failed); pending ones are left for a plain rerun."),
    redo_changed: bool = typer.Option(False, "--redo-changed", help="Also redo the summaries written with another --model, --prompt, --kv-bits, --max-tokens, --repetition-penalty, --context or --kernel (kept by default). A document changed since its summary is redone in any case."),
    background: bool = typer.Option(False, "--background", help="Detach: run in its own session with output to OUT_DIR/run.log and its pid in OUT_DIR/run.pid; return once it is under way (a setting it refuses is said here, with its exit code). Watch it with `mlx-tier status OUT_DIR`."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Most documents in flight (decoded together: each expert read serves all of them). Default: the throughput schedule's pool plan (memory and measured speeds, at most 64); with --schedule paced, what memory allows, at most 8."),
    schedule: str = typer.Option(DEFAULT_SCHEDULE, "--schedule", metavar=choices(SCHEDULES), help="throughput: prompts of several documents read together in large pools and many documents decoded together (each expert read once per layer step for all of them); paced: one prompt at a time in ~4 s steps beside at most 8 decoding (the earlier default)."),
    kv_bits: int | None = typer.Option(None, "--kv-bits", metavar="[4|8]", help="Store the KV caches of the documents in flight quantized to 4 or 8 bits (groups of 64; the throughput schedule): at 8 bits ~0.28x the bytes of float32, so more documents fit in a pool under a memory limit. Summaries may differ from an unquantized cache's (benches/results/kv-quant). Default: not quantized."),
    context: int | None = typer.Option(None, "--context", min=64, help="Usable context in tokens (prompt + summary). Default: the model's, or less if memory is short. Longer documents are summarised in parts, then the parts' summaries combined (never truncated)."),
    prefill_step: int = typer.Option(DEFAULT_PREFILL_STEP, "--prefill-step", min=1, help="--schedule paced: most prompt tokens per step while reading a document's prompt (one document at a time); steps are paced to about 4 s from the measured speed, up to this many tokens; smaller: less memory. (The throughput schedule sizes its prompt pools from its plan.)"),
    max_temp: float | None = typer.Option(None, "--max-temp", help="Slow down above this temperature (°C, hottest sensor)."),
    pause_on_battery: bool = typer.Option(False, "--pause-on-battery", help="Pause while the machine runs on battery; resume on AC."),
    min_battery: float | None = typer.Option(None, "--min-battery", min=0, max=100, help="Pause on battery below this charge (percent)."),
    max_tok_s: float | None = typer.Option(None, "--max-tok-s", help="Hard cap on generated tokens per second (all documents together)."),
    nice: int = typer.Option(DEFAULT_NICE, "--nice", min=0, max=19, help="Lower the job's CPU priority by this much (0: unchanged), so the machine stays responsive."),
    policy: str = typer.Option(DEFAULT_POLICY, "--policy", metavar=choices(POLICIES), help=POLICY_HELP),
    prewarm: bool | None = typer.Option(None, "--prewarm/--no-prewarm", help="Fill the expert cache at load with the saved profile's most used experts. Default: only with --policy pinned."),
    save_profile: bool = typer.Option(False, "--save-profile", help="After the run, add its expert use counts to the model's saved profile (next to the checkpoint, or in the user cache if that folder is read-only), for --policy pinned, --prewarm and the expert cache a capped throughput run chooses."),
    host_cache_gb: float | None = typer.Option(None, "--host-cache-gb", help="CUDA only: the warm tier, this many GiB of host memory under the GPU's --cache-gb; warm experts are computed on the CPU where they lie (docs/cuda.md); 0 turns it off. Default: half the available host memory. Refused elsewhere (one memory: use --cache-gb)."),
    prefetch: bool | None = typer.Option(None, "--prefetch/--no-prefetch", help="Predict each next layer's experts with its router and read them in the background. Default off: measured not to pay on a 2-core CPU with a warm page cache (benches/results/prefetch); try it on a slow disk."),
    follow_links: bool = typer.Option(False, "--follow-links", help="Also read links in INPUT that lead outside it (skipped by default)."),
    convert_seconds: float = typer.Option(DEFAULT_SECONDS, "--convert-seconds", min=1, help=f"Most seconds converting one PDF, Office, HTML or EPUB file may take, plus {DEFAULT_SECONDS_PER_MB:.0f} s per MB of the file; over it, that document fails alone."),
    convert_memory_mb: int = typer.Option(DEFAULT_MEMORY_MB, "--convert-memory-mb", min=64, help="Most memory (MiB) converting one such file may use; over it, that document fails alone (files that would unpack to far more than any real document are refused before converting)."),
    kernel: str = typer.Option(JOB_KERNEL, "--kernel", metavar=choices(KERNELS), help=KERNEL_HELP),
    background_qos: bool = typer.Option(False, "--background-qos", help="macOS: run at background QoS (lowest priority). Warning: reported to slow Metal decoding about 8x."),
    ranks: int | None = typer.Option(None, "--ranks", min=1, help="Spread the job over this many processes on this machine, started by MLX's launcher (mlx.launch, ring backend); each loads the model and takes documents no other rank has started (docs/distributed.md)."),
    hosts: Path | None = typer.Option(None, "--hosts", help="Spread the job over the machines of this mlx.launch hosts file (JSON, one rank per entry: ssh name and IPs); INPUT and --out must be the same shared paths on every machine (docs/distributed.md)."),
    ctx: typer.Context = None,  # filled in by Typer
) -> None:
    """Summarise every document in INPUT into OUT_DIR, resumably.

    A JSONL file of OpenAI Batch API requests runs as written instead (its own
    messages, max_tokens, temperature, stop...): answers in OUT_DIR/output.jsonl,
    failed requests in OUT_DIR/errors.jsonl, in the Batch API's format.

    INPUT `-` reads file paths from stdin, one a line. Rerunning the same
    command skips finished documents, redoes those changed since their
    summary, and leaves failed ones failed (--retry-failed reruns only
    those). Documents are decoded in batches;
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
    stopped early (disk full, checkpoint unreadable; rerun to resume), 129 hung
    up (SIGHUP: its terminal closed), 130 interrupted (SIGINT), 141 output to a
    closed pipe, 143 terminated (SIGTERM).
    """
    _run(SimpleNamespace(**locals()))


def _run(o: SimpleNamespace) -> None:
    """:func:`run`'s body, its options by name in ``o``: the checks (a bad option: one
    line, exit 2), one :class:`~mlx_tier.job.config.JobConfig`, then the job in the
    background, over ranks, or here."""
    from mlx_tier.engine.load import DEFAULT_PREFETCH, TierConfig
    from mlx_tier.errors import MlxTierError
    from mlx_tier.job.config import JobConfig, read_prompt
    from mlx_tier.job.convert_limits import ConversionLimits
    from mlx_tier.job.scheduler import GenerationConfig

    throttle = _checked_options(o.cache_gb, o.host_cache_gb, o.prewarm, o.policy, o.output_format, o.kernel,
                                o.model, o.max_temp, o.pause_on_battery, o.min_battery, o.max_tok_s)
    checks.gib("--memory-gb", o.memory_gb, most=math.inf)  # then against what this process may use
    from_stdin = str(o.input) == "-"
    paths = _stdin_paths() if from_stdin else None
    command = resume_command(o.ctx, o.out_dir, from_stdin)
    distributed = o.ranks is not None or o.hosts is not None
    if distributed:
        ranks_cmd.check(o.ranks, o.hosts, o.background, o.trace, o.save_profile)
    try:
        config = JobConfig(
            input=o.input, out_dir=o.out_dir, model=o.model,
            tier=TierConfig(cache_gb=o.cache_gb, policy=PolicySpec(o.policy), prewarm=o.prewarm,
                            prefetch=DEFAULT_PREFETCH if o.prefetch is None else o.prefetch,
                            host_cache_gb=o.host_cache_gb, kernel=o.kernel),
            generation=GenerationConfig(
                instruction=DEFAULT_PROMPT if o.prompt is None else read_prompt(o.prompt),
                max_tokens=o.max_tokens, repetition_penalty=o.repetition_penalty, batch_size=o.batch_size,
                context=o.context, prefill_step_size=o.prefill_step, schedule=o.schedule, kv_bits=o.kv_bits),
            throttle=throttle, trace=o.trace, input_paths=paths,
            output_format=o.output_format, retry_failed=o.retry_failed, redo_changed=o.redo_changed,
            command=command, nice=o.nice,
            background_qos=o.background_qos, save_profile=o.save_profile, follow_links=o.follow_links,
            conversion=ConversionLimits(memory_mb=o.convert_memory_mb, seconds=o.convert_seconds),
            memory_gb=o.memory_gb,
        )
    except MlxTierError as e:  # an empty --prompt, an unreadable --prompt @FILE
        fail(str(e))
    if o.background:
        _start_background(config, [sys.executable, "-m", "mlx_tier.cli.main", "run",
                                   *command_args(o.ctx, drop=("background",))])
    elif distributed:
        ranks_cmd.run_ranks(config, o.ranks, o.hosts, command)
    else:
        _run_job_and_exit(config, o.out_dir, command)

def _stdin_paths() -> tuple[str, ...]:
    """``mlx-tier run -``: the file paths on stdin, one a line. Read as bytes, split on
    newlines only, decoded as the file system does (a name that is not valid UTF-8
    survives as surrogates)."""
    return tuple(os.fsdecode(b.rstrip(b"\r")) for b in sys.stdin.buffer.read().split(b"\n"))


def _checked_options(cache_gb, host_cache_gb, prewarm, policy, output_format, kernel, model,
                     max_temp, pause_on_battery, min_battery, max_tok_s):
    """Check `run`'s options before any work (each bad one: one line, exit 2);
    returns the throttle's config."""
    from mlx_tier.errors import MlxTierError
    from mlx_tier.job.throttle import ThrottleConfig
    from mlx_tier.kernels.registry import kernel_for

    _check_memory(cache_gb, host_cache_gb)
    if output_format not in OUTPUT_FORMATS:
        fail(f"--format must be {' or '.join(OUTPUT_FORMATS)}, got {output_format!r}")
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
        from mlx_tier.engine.hub import check_name

        try:
            check_name(model)
        except MlxTierError as e:
            fail(str(e))
    return throttle


def _check_memory(cache_gb: float | None, host_cache_gb: float | None) -> None:
    """--cache-gb and --host-cache-gb against this machine's memories (one line, exit 2)."""
    from mlx_tier.engine.budgets import probe

    checks.gib("--cache-gb", cache_gb, most=math.inf)  # then against this machine's memory, below
    checks.gib("--host-cache-gb", host_cache_gb, zero_ok=True)
    mem = probe()
    if host_cache_gb is not None and mem.unified:  # one memory: a warm tier would count it twice
        fail(f"--host-cache-gb needs a CUDA GPU (hot tier in GPU memory, warm in host memory); on the "
             f"{mem.backend} backend experts live in one memory: size it with --cache-gb alone")
    host = (f"the memory this process may use ({mem.limit.source})" if mem.limit is not None and mem.limit.limited
            else "this machine's memory")
    where, memory = ("the GPU's memory", mem.device_total) if not mem.unified else (host, mem.host_total)
    if cache_gb is not None and memory is not None and cache_gb > memory / 2**30:
        fail(f"--cache-gb {cache_gb:g} is more than {where} ({memory / 2**30:.1f} GiB)")


def command_args(ctx: typer.Context, drop: tuple[str, ...] = ()) -> list[str]:
    """The arguments that repeat this command: every parameter given on the command line
    (not defaults), as parsed, except those named in ``drop``; an INPUT starting with ``-``
    (not ``-``, stdin) as ``./-...``, so that it is not read as an option."""
    args: list[str] = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)  # click's ParameterSource (Typer may bring its own copy)
        if p.name in drop or source is None or source.name in ("DEFAULT", "DEFAULT_MAP"):
            continue
        value = ctx.params[p.name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if p.param_type_name == "argument":  # a path like "-notes" would read as an option: "./-notes"
            args += [f"./{v}" if str(v).startswith("-") and str(v) != "-" else str(v) for v in values]
        elif getattr(p, "is_flag", False) and isinstance(value, bool):
            if value or p.secondary_opts:
                args.append(p.opts[0] if value else p.secondary_opts[0])
        else:
            for v in values:
                args += [p.opts[0], str(v)]
    return args


# Options a resume command leaves out: --background (the resume runs where it is typed) and
# --retry-failed (it tries failed documents only and leaves pending ones as they are: repeated,
# it never summarises them; mlx_tier.messages.retry_command adds it back to retry). Kept:
# --redo-changed (a summary redone is no longer "changed", so repeating it redoes nothing twice,
# while a stopped run's summaries not yet redone still need it), --save-profile (each run adds
# its own counts) and --trace (each run writes its own: the resumed run's replaces the file).
RESUME_DROPS = ("background", "retry_failed")


def resume_command(ctx: typer.Context, out_dir: Path, from_stdin: bool) -> str:
    """The exact shell command that resumes this run: its options but
    :data:`RESUME_DROPS` (a stdin list is read back from OUT_DIR/inputs.txt)."""
    import shlex

    from mlx_tier.outdir.layout import INPUT_LIST

    line = shlex.join(["mlx-tier", ctx.info_name or "run", *command_args(ctx, drop=RESUME_DROPS)])
    return line + (f" < {shlex.quote(str(out_dir / INPUT_LIST))}" if from_stdin else "")


def _raise_interrupted(signum, frame) -> None:
    from mlx_tier.job.stopflag import Interrupted, hung_up

    if signum == getattr(signal, "SIGHUP", None):
        hung_up()  # the terminal is gone: what follows is said to the null device
    raise Interrupted(signum)


@contextlib.contextmanager
def _sigterm_interrupts():
    """SIGTERM and SIGHUP raise ``Interrupted`` (until the job installs its own stop
    handler), so a run terminated or hung up while loading its model also exits 143 or 129
    with the resume line; a SIGHUP ignored (``nohup``) stays ignored."""
    from mlx_tier.job.stopflag import STOP_SIGNALS

    taken = [sig for sig in STOP_SIGNALS if sig != signal.SIGINT and signal.getsignal(sig) is not signal.SIG_IGN]
    try:
        old = {sig: signal.signal(sig, _raise_interrupted) for sig in taken}
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _run_job_and_exit(config, out_dir: Path, command: str) -> None:
    """Run the job with the live display; map its ends to one line and an exit code
    (2 bad input, 3 job error, 130/143 signals, 1 failed documents). A stop gives the
    command that resumes (after ``--retry-failed``, also the one that retries); a
    ``--retry-failed`` run that left documents pending, the plain rerun."""
    from mlx_tier.errors import JobError, MlxTierError
    from mlx_tier.job.run import run_job

    reporter, retry = RichReporter(), config.retry_failed
    try:
        with _sigterm_interrupts():
            report = run_job(config, reporter)
    except MlxTierError as e:  # bad input, checkpoint, budget, profile, setting: one line, exit 2
        reporter.close()
        fail(e)
    except (JobError, OSError) as e:  # disk full, checkpoint unreadable: finished work is kept
        reporter.close()
        reason = str(e) if isinstance(e, JobError) else f"{e.filename or out_dir}: {e.strerror or e}"
        print_resume(err, f"{reason}. Finished summaries are kept; resume with:", command, retry, label="error:")
        raise typer.Exit(EXIT_JOB_ERROR)
    except KeyboardInterrupt as e:
        reporter.close()
        word, code = stopped_by(getattr(e, "signum", signal.SIGINT))
        # before the job started (loading its model), the folder was never made: nothing to resume
        what, again = ("finished summaries are kept", "Resume with:") if out_dir.is_dir() else \
            ("the job had not started, nothing was written", "Run it again with:")
        print_resume(err, f"{word}; {what}. {again}", command, retry)
        raise typer.Exit(code)
    print_summary(report, out_dir)
    if report.interrupted:
        name = signal.Signals(report.stop_signal or signal.SIGINT).name
        print_resume(err, f"stopped ({name}); {stop_outcome(report)}. Resume with:", command, retry)
        raise typer.Exit(stopped_by(report.stop_signal)[1])
    print_left_pending(report, command)
    failed = report.count("failed")
    if failed:
        from mlx_tier.messages import retry_command

        what = count_text(failed, report.noun)
        print_with_command(err, f"{what} failed (why: in the table above); retry {'it' if failed == 1 else 'them'} "
                           "with:", retry_command(command))
        raise typer.Exit(EXIT_FAILED_DOCS)


def _start_background(config, argv: list[str]) -> None:
    """Start the run detached (:func:`mlx_tier.job.run.start_detached`: bad input exits 2 now,
    not in a log), wait until it journals its first record (its settings checked, its model
    loaded) or :data:`~mlx_tier.outdir.jobdir.BACKGROUND_CHECK_SECONDS` pass, and say where
    to watch it; a run that exited in the meantime exits this command with its code, its
    ``error:`` lines said here."""
    import shlex

    from mlx_tier.errors import InputError
    from mlx_tier.job.run import start_detached
    from mlx_tier.outdir.jobdir import file_size, first_moments
    from mlx_tier.outdir.layout import JOURNAL, LOG_FILE, PID_FILE

    out_dir = config.out_dir
    existed = out_dir.exists()
    log_from, journal_from = file_size(out_dir / LOG_FILE), file_size(out_dir / JOURNAL)
    try:
        pid = start_detached(config, argv)
    except InputError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{out_dir}: cannot start the background run ({e.strerror or e})")
    early = first_moments(pid, out_dir, log_from, journal_from)
    if early is not None:
        if early[0] not in (0, EXIT_FAILED_DOCS):  # refused: leave no trace of a job that never started
            _discard_background(out_dir, existed)
        _ended_early(*early, out_dir / LOG_FILE)
    out.print(f"started in the background: pid {pid} (also in {out_dir / PID_FILE}), log {out_dir / LOG_FILE}",
              highlight=False, soft_wrap=True)
    print_with_command(out, "watch it with:", f"mlx-tier status {shlex.quote(str(out_dir))}")


def _discard_background(out_dir: Path, existed: bool) -> None:
    """After a background run refused at once: its pid file goes (the process is gone); a
    folder it created holding nothing but its lock, log and pid file goes whole, as a
    refused run in the terminal leaves none (its error was said here)."""
    from mlx_tier.outdir.layout import LOCK, LOG_FILE, PID_FILE

    (out_dir / PID_FILE).unlink(missing_ok=True)
    if existed or not out_dir.is_dir() or {p.name for p in out_dir.iterdir()} - {LOCK, LOG_FILE}:
        return
    for name in (LOCK, LOG_FILE):
        (out_dir / name).unlink(missing_ok=True)
    out_dir.rmdir()


def _ended_early(code: int, errors: list[str], log: Path) -> None:
    """A background run that exited before journalling anything (or finished already): its
    ``error:`` lines (or where its output is) and its exit code, as the run in this terminal
    would have ended."""
    if code in (0, EXIT_FAILED_DOCS):
        out.print(f"the background run finished already (exit code {code}); its output: {log}", highlight=False,
                  soft_wrap=True)
    else:
        for line in errors or [f"error: the background run stopped at once (exit code {code}); see {log}"]:
            err.print(line, highlight=False, markup=False, soft_wrap=True)
    raise typer.Exit(code)
