"""Words for a terminal: messages that carry a command, the commands that resume or
retry a job, and short failure reasons.

A message that tells the user a command to run ("Resume with: mlx-tier run
...") is laid out as the prose, word-wrapped to the terminal's width, then the
command alone on the next line: a terminal that soft-wraps one long line cuts
it mid-word at column 80, and a command folded by inserted newlines no longer
pastes. The command line is never wrapped by us (the terminal folds it only if
it is itself wider than the screen) and carries no indent (a leading space keeps
a pasted command out of bash's history under ``HISTCONTROL=ignorespace``).

:func:`short_reason` names each kind of per-document failure in a few words
for the results table (``failed: empty``); the full message stays in the
journal, report.json and ``mlx-tier status``.
"""

from __future__ import annotations

import os
import shlex
import textwrap

DEFAULT_WIDTH = 80


def terminal_width(fd: int = 2, default: int = DEFAULT_WIDTH) -> int:
    """Columns of the terminal on ``fd`` (``COLUMNS`` first, as Rich and shutil read it),
    else ``default`` (a log file, a pipe)."""
    try:
        columns = int(os.environ.get("COLUMNS", ""))
        if columns > 0:
            return columns
    except ValueError:
        pass
    try:
        return os.get_terminal_size(fd).columns or default
    except OSError:
        return default


INSTALL = ": pip install "  # a message ending with the command it introduces (a missing extra)


def _ending_command(text: str) -> tuple[str, str] | None:
    """``(prose, command)`` of a text whose prose ends with a colon and a ``pip install``
    command that ends the text; ``None`` otherwise."""
    head, sep, command = text.rpartition(INSTALL)
    return (head + ":", "pip install " + command) if sep and head.strip() else None


def wrap_words(text: str, width: int) -> str:
    """``text`` word-wrapped to ``width`` columns; a word wider than that (a long path)
    stays whole on its own line rather than being cut, and hyphens never break. A text
    that ends with a ``pip install`` command its prose introduces (``...: pip install X``)
    and does not fit on one line gets the command whole on its last line."""
    width = max(width, 20)
    ending = _ending_command(text)
    if ending is not None and len(text) > width:
        return f"{wrap_words(ending[0], width)}\n{ending[1]}"
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def command_apart(text: str) -> str:
    """``text`` with the ``pip install`` command it ends with (``...: pip install X``) on a
    line of its own (for a table cell, which wraps at any space)."""
    ending = _ending_command(text)
    return "\n".join(ending) if ending is not None else text


def with_command(prose: str, command: str, width: int = DEFAULT_WIDTH) -> str:
    """A message that ends with a command to copy: ``prose`` word-wrapped to ``width``
    columns, then ``command`` alone on the last line, unwrapped.

    Args:
        prose: the sentence(s), ending with what introduces the command
            (``"... Resume with:"``).
        command: the exact shell command.
        width: the terminal's columns (:func:`terminal_width`).

    Returns:
        the lines joined by ``\\n`` (no trailing newline).
    """
    return f"{wrap_words(prose, width)}\n{command}"


RETRY_FAILED = "--retry-failed"


def retry_command(command: str | None) -> str:
    """The exact command that retries only the failed documents (``--retry-failed`` added
    before a ``< inputs.txt`` redirection), or a sentence when the run left no command."""
    if not command:
        return f"the same mlx-tier run command plus {RETRY_FAILED}"
    head, sep, tail = _redirect(command)
    try:
        words = shlex.split(head)
    except ValueError:  # not a command this program wrote
        words = []
    return command if RETRY_FAILED in words else f"{head} {RETRY_FAILED}{sep}{tail}"


LIST_FILE = "inputs.txt"  # OUT_DIR's copy of a stdin list, which resume commands read (layout.INPUT_LIST)


def _redirect(command: str) -> tuple[str, str, str]:
    """``(command, " < ", file)`` split at the ``< OUT_DIR/inputs.txt`` a resume command of a
    stdin list ends with, else ``(command, "", "")``: a ``<`` inside a quoted option (a
    prompt saying "in < 100 words") is no redirection."""
    head, sep, tail = command.rpartition(" < ")
    try:
        target = shlex.split(tail) if sep else []
    except ValueError:
        target = []
    if len(target) == 1 and (target[0] == LIST_FILE or target[0].endswith("/" + LIST_FILE)):
        return head, sep, tail
    return command, "", ""


def plain_rerun(command: str | None) -> str | None:
    """``command`` without ``--retry-failed``: the rerun that resumes a job's pending
    documents (a run with the flag retries failed ones only and leaves pending ones as
    they are, so repeating it never summarises them). For the command a journal's start
    record holds: one of an older version may carry the flag. ``None`` stays ``None``."""
    if not command:
        return command
    head, sep, tail = _redirect(command)  # a stdin list stays at the end
    try:
        words = shlex.split(head)
    except ValueError:  # not a command this program wrote: leave it as it is
        return command
    return command if RETRY_FAILED not in words else shlex.join(w for w in words if w != RETRY_FAILED) + sep + tail


# (a substring of the full error, its short form), first match wins. Each full
# message comes from mlx_tier.job.doc_text, documents, scheduler or jobs.
_REASONS = (
    ("empty document", "empty"),  # a blank file is not an empty file: the run line says "empty document"
    ("empty text", "empty text"),
    ("not valid Unicode", "bad text"),
    ("binary file", "binary file"),
    ("byte-order mark", "bad text"),
    ("outside the input folder", "bad link"),  # a link found at the check, or swapped in after it
    ("cannot read", "unreadable"),
    ("need the document converters", "needs extra"),
    ("cannot convert", "conversion"),
    ("no text found", "no text"),
    ("too long for the usable context", "too long"),
    ("no summary", "no summary"),
    ("cannot write the summary", "write error"),
    ("MemoryError", "no memory"),
    ("malloc", "no memory"),
)
# The longest short reason: with it, the results table's status column stays
# within "binary file", so at 80 columns the shipped examples' 35-character
# names keep their width.
SHORT_REASON_CHARS = 11


# A failed batch request's API error code -> its short reason (server_error: by its message).
_CODES = {
    "unsupported_parameter": "unsupported", "unsupported_value": "unsupported", "invalid_type": "bad value",
    "invalid_value": "bad value", "missing_required_parameter": "missing", "context_length_exceeded": "too long",
}


def short_reason(error: str | None, code: str | None = None) -> str:
    """A few words (at most :data:`SHORT_REASON_CHARS`) for why a document failed,
    e.g. ``"empty"``, ``"binary file"``, ``"too long"``, ``"no memory"``; a batch
    request by its API error ``code`` (``"unsupported"``, ``"bad value"``); an unknown
    error by its exception name (``"RuntimeError"``) or ``"error"``."""
    if code in _CODES:
        return _CODES[code]
    text = error or ""
    for needle, short in _REASONS:
        if needle in text:
            return short
    head = text.split(":", 1)[0].strip()
    if head.isidentifier() and (head.endswith(("Error", "Exception")) or head[:1].isupper()):
        return head if len(head) <= SHORT_REASON_CHARS else head[: SHORT_REASON_CHARS - 1] + "…"
    return "error"


def in_request_words(error: str, param: str | None, name: str) -> str:
    """A failed batch request's error naming the field of its body at fault as such
    (```max_tokens` of request <name>``, as ``errors.jsonl`` says it), never as a flag."""
    if not param:
        return error
    field = f"`{param}`"
    return error.replace(field, f"{field} of request {name}", 1)
