"""``mlx-tier``: the command line. One module per command group, each parsing its
options, building one config, calling one library function and printing
(:mod:`~mlx_tier.cli.render`); here only the Typer app and the list of commands.

Modules: ``run_cmd`` (run; ``ranks_cmd`` for --ranks/--hosts), ``status_cmd``
(status, thermal), ``watch_cmd`` (watch), ``plan_cmd`` (plan, convert),
``trace_cmd`` (trace-sim, trace-stats, profile); ``render`` (what is printed) and
``exits`` (exit codes, one-line errors). Nothing imports this module back.
"""

from __future__ import annotations

import importlib
import sys

import typer

from mlx_tier.cli import plan_cmd, run_cmd, status_cmd, trace_cmd, watch_cmd
from mlx_tier.cli.exits import OneLineErrors
from mlx_tier.cli.render import EXIT_CLOSED_PIPE, out


def _wrap_between_words() -> None:
    """Make the help wrapper break lines only between words: its default also breaks
    after a hyphen, which cut ``--retry-`` / ``failed`` and ``mlx-`` /
    ``community/Qwen3...`` apart, so neither reads nor pastes as one name. The
    wrapper is click's (``click._textwrap``; Typer 0.29+ vendors it as
    ``typer._click._textwrap``); ``wrap_text`` looks the class up on each call.
    tests/cli/test_display.py checks every command's help for such a cut."""
    for name in ("typer._click._textwrap", "click._textwrap"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        base = module.TextWrapper
        if not getattr(base, "whole_words", False):
            module.TextWrapper = type("TextWrapper", (base,), {
                "whole_words": True,
                "__init__": lambda self, *a, _base=base, **k: _base.__init__(self, *a, break_on_hyphens=False, **k),
            })


_wrap_between_words()

app = typer.Typer(
    help="Run Mixture-of-Experts models larger than memory: experts stream from disk into a bounded cache.",
    no_args_is_help=True,
    add_completion=False,
    cls=OneLineErrors,
    rich_markup_mode=None,  # click's plain help: wraps to the terminal, never cuts an option name
)


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


# In this order in `mlx-tier --help`.
app.command()(run_cmd.run)
app.command()(status_cmd.status)
app.command()(watch_cmd.watch)
app.command()(plan_cmd.plan)
app.command()(plan_cmd.convert)
app.command("trace-sim")(trace_cmd.trace_sim)
app.command("trace-stats")(trace_cmd.trace_stats)
app.command("profile")(trace_cmd.profile_cmd)
app.command()(status_cmd.thermal)


def main() -> None:
    try:
        app()
    except SystemExit as e:
        # Click answers EPIPE (its own output: --help) with exit code 1 after muting stdout and
        # stderr (its PacifyFlushWrapper); Rich's consoles exit EXIT_CLOSED_PIPE themselves
        if e.code == 1 and "PacifyFlushWrapper" in type(sys.stdout).__name__:
            raise SystemExit(EXIT_CLOSED_PIPE) from None
        raise


if __name__ == "__main__":
    sys.exit(main())
