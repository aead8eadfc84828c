"""``mlx-tier status`` and ``mlx-tier thermal``: read-only views of a job and of the
machine's sensors. Neither loads MLX (:mod:`mlx_tier.monitor.status`,
:mod:`mlx_tier.job.sensors`), so both answer at once while a job runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from mlx_tier.cli import watch_cmd
from mlx_tier.cli.exits import fail
from mlx_tier.cli.render import (
    as_flags,
    err,
    format_duration,
    in_flight_rows,
    mix_lines,
    out,
    print_with_command,
    redone_text,
)
from mlx_tier.messages import command_apart
from mlx_tier.units import rate_text, seconds_text, tokens_text


def status(
    out_dir: Path = typer.Argument(..., metavar="OUT_DIR", help="Output folder of a running or finished `mlx-tier run`."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
    as_html: bool = typer.Option(False, "--html", help="Also write OUT_DIR/report.html: the job's page with charts, openable with no server."),
) -> None:
    """Progress of the job in OUT_DIR: running or not, done/failed/pending, throughput, throttle time, ETA."""
    from mlx_tier.errors import InputError
    from mlx_tier.monitor.status import read_status

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
    out.print(_status_table(s, out_dir))
    if not s.running and s.command and (s.pending or s.todo_left):
        print_with_command(out, "resume with:", s.command)
    if s.failed and not s.running:
        from mlx_tier.messages import retry_command

        print_with_command(out, "retry the failed ones with:", retry_command(s.command))


def _status_table(s, out_dir: Path) -> Table:
    """`status`'s table of a :class:`mlx_tier.monitor.status.JobStatus`: one row per figure."""
    from mlx_tier.monitor.status import describe_state, describe_throttle

    t = Table(title=f"mlx-tier status: {out_dir}", show_header=False)
    t.add_row("state", describe_state(s))
    t.add_row(f"{s.noun}s", f"{s.total if s.total is not None else '?'} total: {s.done} done, {s.failed} failed, "
                           f"{s.pending if s.pending is not None else '?'} pending")
    before = s.idle_rerun or s.starting  # a rerun with nothing to do, or one still loading: the one before it
    which = "that run" if before else "this run"
    if s.idle_rerun:
        t.add_row("this run", "nothing to do (model not loaded); the rows below are of the run before it")
    if s.starting:
        t.add_row("this run", "loading its model" + ("; the rows below are of the run before it" if s.started is not None
                                                    else ""))
    if s.started is not None:
        # the documents it set out to do: a --retry-failed run leaves pending ones for a plain rerun
        left = f", {s.todo_left} of its {s.noun}s left" if s.todo_left is not None else ""
        loading = f"; loading {seconds_text(s.load_seconds)} apart" if s.load_seconds is not None else ""
        if s.no_model:
            t.add_row("this run", f"{s.finished_this_run} failed as read (empty or unreadable); no model loaded{left}")
        else:
            t.add_row("run before" if before else "this run",
                      f"{s.done_this_run} done, {s.finished_this_run - s.done_this_run} failed in "
                      f"{seconds_text(s.elapsed_seconds)} of generation{loading}{left}")
    # finished summaries only: the tokens of those being written are in the "writing" rows
    speed = f"none {which} (no model loaded)" if s.no_model else "none yet (its model is loading)" \
        if s.starting and s.started is None else \
        (f"{rate_text(s.documents_per_hour)} {s.noun}s/hour, {s.output_tok_per_s:.2f} output tok/s {which} "
         f"(its finished {s.noun}s and the tokens it generated, over its generation time)")
    t.add_row("speed", f"{speed}; {tokens_text(s.output_tokens)} in the job's finished {s.noun}s")
    if s.redone_stale or s.redone_changed:
        t.add_row("redone", redone_text(s.redone_stale, s.redone_changed, s.noun))
    if len(s.written_by) > 1:  # summaries of more than one model or prompt
        for line in mix_lines(s.written_by, s.prompts):
            t.add_row("written by", Text(line))
    t.add_row("throttled", f"{s.throttled_seconds:.1f} s")
    for change in s.thermal[-5:]:  # the latest throttle state changes of this run
        t.add_row("throttle", as_flags(describe_throttle(change)))
    for label, text in in_flight_rows(s.progress if s.running else None):
        t.add_row(label, Text(text))
    eta = ("none: stopping" if s.running and (s.progress or {}).get("stopping")
           else format_duration(s.eta_seconds) if s.eta_seconds is not None
           else "estimating (until a prompt step and a decode step are measured)" if s.running else "not running")
    eta = "once its model is loaded and its steps measured" if s.starting else eta
    t.add_row("ETA", eta)
    for f in s.failures[:5]:
        t.add_row(f"failed: {f.id}", Text(command_apart(f.error if f.request else as_flags(f.error))))
    if len(s.failures) > 5:
        t.add_row("failed", f"... and {len(s.failures) - 5} more (report.json, journal.jsonl)")
    return t


def thermal(
    as_json: bool = typer.Option(False, "--json", help="Print every sensor's status and reading as JSON."),
) -> None:
    """Current readings from every sensor the throttle can use, and which are unavailable (and why)."""
    from mlx_tier.job.sensors import merge, survey

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
