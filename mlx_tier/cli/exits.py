"""How a command ends: the exit codes, :func:`fail` (one ``error:`` line, exit 2) and
:class:`OneLineErrors`, which gives Typer's own usage errors the same shape."""

from __future__ import annotations

import sys

import typer
import typer.core

try:  # Typer >= 0.24 carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older Typer on click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

from mlx_tier.cli.render import as_flags, err, print_error, print_with_command

EXIT_FAILED_DOCS = 1
EXIT_BAD_INPUT = 2
EXIT_JOB_ERROR = 3  # the job stopped early (disk full, checkpoint unreadable mid-job); rerun to resume
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM: 128 + 15, as a shell reports a process it ended


def stopped_by(signum: int | None) -> tuple[str, int]:
    """``(word, exit code)`` of a job a signal stopped: ``("interrupted", 130)`` for SIGINT
    (or none known), ``("terminated", 143)`` for SIGTERM, ``("hung up", 129)`` for SIGHUP
    (128 + the signal, as a shell reports a process it ended)."""
    import signal

    if signum == signal.SIGTERM:
        return "terminated", EXIT_TERMINATED
    if signum == getattr(signal, "SIGHUP", None):
        return "hung up", 128 + signum
    return "interrupted", EXIT_INTERRUPTED


def fail(message, command: str | None = None) -> None:
    """One clear error line (settings named by their flags) and exit code 2; a command that
    fixes it (given, or an :class:`~mlx_tier.errors.MlxTierError`'s ``command``) follows
    on its own line (:func:`~mlx_tier.cli.render.print_with_command`). ``message``: text
    or the error itself."""
    command = command or getattr(message, "command", None)
    text = as_flags(getattr(message, "prose", None) if command and not isinstance(message, str) else str(message))
    if command:
        print_with_command(err, text, command, label="error:")
    else:
        print_error(text)
    raise typer.Exit(EXIT_BAD_INPUT)


def _empty_argument(args: list[str]) -> str | None:
    """What is wrong with an empty argument among ``args`` (``""``, or ``--out=``), ``None``
    without one: no argument of this CLI may be empty (a path would be read as the current
    folder; a blank prompt or number is refused anyway)."""
    for k, arg in enumerate(args):
        if arg == "--":
            return None
        name, eq, value = arg.partition("=")
        flag = name if arg.startswith("--") and eq and not value else None  # `--out=`, not `--out=b=`
        if arg == "" or flag:
            after = flag or (args[k - 1] if k and args[k - 1].startswith("-") and args[k - 1] != "-" else None)
            what = f"{after} is empty" if after else \
                f"argument {k + 1} ({f'after {args[k - 1]}' if k else 'the first'}) is empty"
            return f"{what} (an unset shell variable?); give a path or value, or `.` for the current folder"
    return None


class OneLineErrors(typer.core.TyperGroup):
    """Usage errors (an option out of range, a missing argument) as one ``error:`` line and
    exit code 2, like the CLI's own errors, instead of a boxed usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        empty = _empty_argument(sys.argv[1:] if args is None else list(args))
        if empty is not None:  # Path("") is ".": `run "$DOCS"` with DOCS unset would read the current folder
            print_error(empty)
            sys.exit(EXIT_BAD_INPUT)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NoArgsIsHelpError as e:
            e.show()
            sys.exit(e.exit_code)
        except UsageError as e:
            where = f" (see: {e.ctx.command_path} --help)" if e.ctx is not None else ""
            print_error(e.format_message() + where)
            sys.exit(EXIT_BAD_INPUT)
        except ClickException as e:
            print_error(e.format_message())
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)
