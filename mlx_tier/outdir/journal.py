"""Durable job state: an fsync'ed append-only journal and atomic output writes.

Invariant: a finished output is never lost or rewritten. An output file is
written to a temporary name, fsync'ed and renamed into place, so it exists
only when complete; then a ``done`` record is appended to ``journal.jsonl``
and fsync'ed. After a crash between the two, the rerun finds the complete
output without its record and records it instead of regenerating it.

Nothing here follows a link planted in the output folder: appends open with
``O_NOFOLLOW``, outputs are renamed into place (a rename replaces a link, it
never writes through it), and :func:`mlx_tier.outdir.layout.check_out_dir` refuses a folder whose
job files are links. A failed append (disk full) is cut back, so the file
holds only whole records; the error names the file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_tier.fsio import _NOFOLLOW, _append_line, named
from mlx_tier.outdir.layout import JOURNAL, rank_journals

_NUMBER = (int, float)
# Field -> the types a record may give it (others: any JSON value).
_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "status": (str,), "event": (str,), "name": (str,), "time": _NUMBER, "seconds": _NUMBER,
    "throttled_seconds": _NUMBER, "input_tokens": (int,), "output_tokens": (int,), "parts": (int,),
    "error": (str, type(None)), "output": (str, type(None)), "finish_reason": (str, type(None)),
    "started": _NUMBER, "pid": (int,), "ids": (list,), "todo": (list,), "command": (str, type(None)),
    "input": (str,), "output_format": (str,), "error_code": (str, type(None)), "error_param": (str, type(None)),
}


def record_problem(rec: object) -> str | None:
    """Why a parsed journal line is not a usable record, or ``None`` when it is.

    A record is an object; each field of :data:`_TYPES` it has is of its type
    (``True`` is not a number; numbers are finite); ``ids``/``todo`` are lists
    of strings; a document record (``id``) has a ``status``.
    """
    if not isinstance(rec, dict):
        return "not an object"
    for key, types in _TYPES.items():
        if key not in rec:
            continue
        value = rec[key]
        if not isinstance(value, types) or isinstance(value, bool) or (
                isinstance(value, float) and not math.isfinite(value)):
            return f'"{key}" is {json.dumps(value)[:40]}, not {" or ".join(t.__name__ for t in types)}'
        if key in ("ids", "todo") and not all(isinstance(x, str) for x in value):
            return f'"{key}" must list strings'
    if "id" in rec and "status" not in rec:
        return 'a document record needs a "status"'
    return None


class Journal:
    """Append-only record of document states in ``OUT_DIR/journal.jsonl``.

    Each line is one JSON object with at least ``id``, ``status`` (``done`` or
    ``failed``) and ``time`` (Unix seconds). The last record of an id wins. A
    torn last line (crash mid-append) is ignored. Records without an ``id``
    (e.g. throttle events) are kept for :meth:`entries` only.

    Args:
        out_dir: the job's output folder.
        on_done: called with each ``done`` record before it is appended (the
            JSONL export, :meth:`JsonlSummaries.add`); if it raises, the
            record is not appended.
        name: the journal's file name in ``out_dir`` (default: the job's one journal).
    """

    def __init__(self, out_dir: Path, on_done: Callable[[dict], None] | None = None, name: str = JOURNAL):
        self.path = Path(out_dir) / name
        self.on_done = on_done
        self.warnings: dict[int | str, str] = {}  # line number (a rank journal's: path:line) -> why skipped

    def entries(self) -> Iterator[dict]:
        """Every usable record in file order. A torn line (crash mid-append) is
        skipped quietly; a whole line that is not a usable record
        (:func:`record_problem`) is skipped with a warning in :attr:`warnings`.

        The job's ``journal.jsonl`` also brings the rank journals of its
        distributed runs, all in time order (:mod:`mlx_tier.ranks.stealing`)."""
        # A distributed run's ranks each append to their own journal; readers see them merged.
        extra = rank_journals(self.path.parent) if self.path.name == JOURNAL else []
        if not extra:
            yield from self._read(self.path)
            return
        yield from merged([self._read(self.path), *(self._read(p) for p in extra)])

    def _read(self, path: Path) -> Iterator[dict]:
        """The usable records of one journal file (see :meth:`entries`)."""
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as e:
            raise named(e, path) from None
        key = (lambda n: n) if path == self.path else (lambda n: f"{path}:{n}")
        with os.fdopen(fd, "rb") as f:
            for n, line in enumerate(f, 1):
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if line.endswith(b"\n") and line.strip():
                        self.warnings[key(n)] = f"{path}:{n}: skipped (not JSON)"
                    continue  # a torn write at the end of a crashed run
                problem = record_problem(rec)
                if problem is not None:
                    self.warnings[key(n)] = f"{path}:{n}: skipped ({problem})"
                    continue
                yield rec

    def records(self) -> dict[str, dict]:
        """The latest record of each document id."""
        return {rec["id"]: rec for rec in self.entries() if "id" in rec}

    def names(self) -> dict[str, str]:
        """``name -> id`` of every document an earlier run recorded (done or failed),
        so a rerun gives each document the same output name (:mod:`mlx_tier.job.naming`)."""
        return {rec["name"]: rec["id"] for rec in self.entries() if "id" in rec and "name" in rec}

    def append(self, record: dict) -> None:
        """Durably append one record (``time`` is added); the state change is on disk when this returns."""
        record = {**record, "time": round(time.time(), 3)}
        if self.on_done is not None and record.get("status") == "done":
            self.on_done(record)
        # ASCII JSON: a file name that is not valid UTF-8 (a lone surrogate
        # after decoding) round-trips as \udcXX instead of failing the append.
        _append_line(self.path, (json.dumps(record) + "\n").encode("ascii"))


def merged(streams: Iterable[Iterable[dict]]) -> Iterator[dict]:
    """Journal records of several files as one stream, ordered by their ``time``
    (Unix seconds; stable, so records of one file keep their order at equal times)."""
    everything = [rec for stream in streams for rec in stream]
    everything.sort(key=lambda rec: rec.get("time", 0.0))
    return iter(everything)


@dataclass(frozen=True)
class JobInfo:
    """What a run set out to do: a ``{"event": "start", ...}`` record in the journal,
    appended when the run starts (the last one describes the current or last run).

    Attributes:
        input: the job's INPUT as given (``-`` for a list on stdin).
        ids: every document id of the job, in input order.
        todo: the ids this run will try (pending, or failed with ``--retry-failed``).
        started: Unix seconds when this run began generating (model loaded).
        pid: the process running it.
        command: the command line that resumes it, when the CLI gave one.
        output_format: ``md`` or ``jsonl``.
    """

    input: str
    ids: list[str]
    todo: list[str]
    started: float
    pid: int
    command: str | None = None
    output_format: str = "md"

    def write(self, journal: Journal) -> None:
        """Durably append this run's ``start`` record to ``journal``.

        Raises:
            OSError: not writable, disk full.
        """
        journal.append({"event": "start", **asdict(self)})

    @classmethod
    def last(cls, entries: list[dict]) -> JobInfo | None:
        """The last ``start`` record among journal ``entries``, or ``None``."""
        for rec in reversed(entries):
            if rec.get("event") == "start":
                try:
                    return cls(**{k: rec[k] for k in cls.__dataclass_fields__ if k in rec})
                except TypeError:
                    return None
        return None
