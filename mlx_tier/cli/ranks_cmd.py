"""``mlx-tier run ... --ranks N`` / ``--hosts hosts.json``: one job over several ranks
(docs/distributed.md).

Parses nothing itself: :func:`run_ranks` gets `run`'s config
(:mod:`mlx_tier.cli.run_cmd`), calls :func:`mlx_tier.ranks.launcher.run_distributed`
and renders the outcome.
"""

from __future__ import annotations

from pathlib import Path

import typer

from mlx_tier.cli.exits import (
    EXIT_FAILED_DOCS,
    EXIT_JOB_ERROR,
    fail,
    stopped_by,
)
from mlx_tier.cli.render import (
    err,
    out,
    print_left_pending,
    print_resume,
    print_summary,
    print_wrapped,
)
from mlx_tier.units import count_text, seconds_text


class _Lines:
    """The launcher's own messages (the ranks print theirs through mlx.launch)."""

    def __init__(self, err) -> None:
        self.err = err

    def message(self, text: str) -> None:
        print_wrapped(self.err, f"[launcher] {text}")

    def start(self, total: int, skipped: int, failed: int = 0) -> None: ...
    def working(self, activity) -> None: ...
    def finished(self, result, cache: dict) -> None: ...
    def close(self) -> None: ...


def rank_lines(run: dict) -> list[str]:
    """One line per rank of a run record: documents, tokens, tok/s over its generation time
    (:mod:`mlx_tier.rates`), how it ended."""
    return [f"rank {a['rank']} ({a.get('host') or '?'}): {a['done']} done, {a['failed']} failed"
            + (f" ({a['stolen']} taken from other ranks)" if a.get("stolen") else "")
            + f", {a['output_tokens']} tokens in "
            f"{seconds_text(a.get('generation_seconds', a['seconds']))} of generation = "
            f"{a['output_tok_per_s']:.2f} tok/s; {a['ended']}"
            for a in run.get("ranks", [])]


def check(ranks: int | None, hosts: Path | None, background: bool, trace, save_profile: bool) -> None:
    """Refuse option combinations the distributed run does not take (one line, exit 2)."""
    if ranks is not None and hosts is not None:
        fail("--ranks and --hosts: give one (--hosts runs one rank per entry of the file)")
    if background:
        fail("--background with --ranks/--hosts is not supported; run it under nohup or tmux")
    if trace is not None or save_profile:
        fail("--trace and --save-profile record one process's cache; run them without --ranks/--hosts")


def run_ranks(config, ranks: int | None, hosts: Path | None, command: str) -> None:
    """Run the job over the ranks and exit as `run` does (0 all done, 1 some failed, 2 bad input,
    3 documents left pending by a rank that died, 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP)."""
    from mlx_tier.errors import MlxTierError
    from mlx_tier.ranks.launcher import Launch, run_distributed

    try:
        report = run_distributed(config, Launch(ranks=ranks or 1, hosts=hosts), _Lines(err))
    except MlxTierError as e:
        fail(e)
    except OSError as e:
        fail(f"{e.filename or config.out_dir}: {e.strerror or e}")
    print_summary(report, config.out_dir)
    for line in rank_lines(report.runs[-1]):  # wrapped between words, as every message
        print_wrapped(out, line)
    pending = report.count("pending") - report.runs[-1].get("left_pending", 0)  # left by a rank, not by --retry-failed
    if report.interrupted:  # a stop that left documents pending (one after the last finished ends as done)
        word, code = stopped_by(report.stop_signal)
        print_resume(err, f"{word}; finished summaries are kept. Resume with:", command, config.retry_failed)
        raise typer.Exit(code)
    if pending:
        print_resume(err, f"{count_text(pending, 'document')} left pending (a rank ended early, see above). Finished "
                          "summaries are kept; resume with any number of ranks:", command, config.retry_failed)
        raise typer.Exit(EXIT_JOB_ERROR)
    print_left_pending(report, command)
    if report.count("failed"):
        raise typer.Exit(EXIT_FAILED_DOCS)
