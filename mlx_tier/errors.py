"""Every error mlx-tier raises on purpose, in one place.

Each is a ``ValueError`` (mlx-lm's style at the edges) carrying one readable
line. Where a setting is at fault, ``field`` names it as the library knows
it (``max_tokens``, ``cache_gb``); the CLI maps fields to its flags, so the
library never speaks in flag names. The CLI turns any :class:`MlxTierError`
into one ``error:`` line and exit code 2; a :class:`JobError` (not bad input:
the job stopped part-way) into one line and exit code 3.
"""

from __future__ import annotations


class MlxTierError(ValueError):
    """Base class. ``field``: the setting at fault, if one is (else ``None``).
    ``command``: a shell command that fixes it (``pip install ...``), if one does:
    ``str(e)`` is the message followed by it; the CLI prints ``prose`` (the message
    alone) and then the command on a line of its own, to copy."""

    def __init__(self, message: str, field: str | None = None, command: str | None = None):
        super().__init__(f"{message} {command}" if command else message)
        self.field, self.command, self.prose = field, command, message


class ConfigError(MlxTierError):
    """A setting has an impossible value (``field`` names it)."""


class CheckpointError(MlxTierError):
    """A checkpoint is missing, malformed, or not in the layout mlx-tier reads."""


class BudgetError(MlxTierError):
    """The cache budget cannot hold the slots asked for (one per MoE layer at least)."""


class ProfileError(MlxTierError):
    """A profile is missing, malformed, or does not fit the model."""


class TraceError(MlxTierError):
    """A trace file is missing or malformed."""


class InputError(MlxTierError):
    """The job's input as a whole cannot be used."""


class TooLong(MlxTierError):
    """Even one part cannot fit: the usable context is too small for the instruction."""


class RequestError(MlxTierError):
    """One batch request cannot run as written: its line goes to ``errors.jsonl``
    and the other requests run (never the whole job's error).

    ``field``: the body parameter at fault (the API's ``param``), ``None`` when
    none is; ``code``: the API's error code (``unsupported_parameter``,
    ``invalid_value``, ``context_length_exceeded``...)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_value"):
        super().__init__(message, field)
        self.code = code


class DemoModelError(MlxTierError):
    """The demo model cannot be built (source package missing, disk full...)."""


class JobError(RuntimeError):
    """The job cannot go on (disk full, checkpoint unreadable mid-job): finished
    work is kept, the journal is consistent, documents not attempted stay
    pending; the rerun resumes. One clear line (CLI exit code 3)."""
