"""Durable job state: an fsync'ed append-only journal and atomic output writes.

Invariant: a finished output is never lost or rewritten. An output file is
written to a temporary name, fsync'ed and renamed into place, so it exists
only when complete; then a ``done`` record is appended to ``journal.jsonl``
and fsync'ed. After a crash between the two, the rerun finds the complete
output without its record and records it instead of regenerating it.

With ``--format jsonl`` a :class:`JsonlSummaries` also appends each finished
summary to ``summaries.jsonl`` (fsync'ed, before the journal record), one line
per document id, never two.

Nothing here follows a link planted in the output folder: appends open with
``O_NOFOLLOW``, outputs are renamed into place (a rename replaces a link, it
never writes through it), and :func:`check_out_dir` refuses a folder whose
job files are links. A failed append (disk full) is cut back, so the file
holds only whole records; the error names the file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from .documents import Document
from .errors import JobError  # noqa: F401 - importable from here too
from .fsio import (  # noqa: F401 - the file primitives, importable from here too
    _NOFOLLOW,
    DISK_FULL,
    _append_line,
    fsync_dir,
    named,
    read_nofollow,
    remove_stale_temps,
    write_atomic,
)
from .rankfiles import merged, rank_journals

JOURNAL = "journal.jsonl"
SUMMARIES = "summaries.jsonl"
_NUMBER = (int, float)
# Field -> the types a record may give it (others: any JSON value).
_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "status": (str,), "event": (str,), "name": (str,), "time": _NUMBER, "seconds": _NUMBER,
    "throttled_seconds": _NUMBER, "input_tokens": (int,), "output_tokens": (int,), "parts": (int,),
    "error": (str, type(None)), "output": (str, type(None)), "finish_reason": (str, type(None)),
    "started": _NUMBER, "pid": (int,), "ids": (list,), "todo": (list,), "command": (str, type(None)),
    "input": (str,), "output_format": (str,),
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
        distributed runs, all in time order (:mod:`mlx_tier.rankfiles`)."""
        # issue 16: a distributed run's ranks each append to their own journal; readers see them merged.
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
        so a rerun gives each document the same output name (:mod:`mlx_tier.naming`)."""
        return {rec["name"]: rec["id"] for rec in self.entries() if "id" in rec and "name" in rec}

    def append(self, record: dict) -> None:
        """Durably append one record (``time`` is added); the state change is on disk when this returns."""
        record = {**record, "time": round(time.time(), 3)}
        if self.on_done is not None and record.get("status") == "done":
            self.on_done(record)
        # ASCII JSON: a file name that is not valid UTF-8 (a lone surrogate
        # after decoding) round-trips as \udcXX instead of failing the append.
        _append_line(self.path, (json.dumps(record) + "\n").encode("ascii"))


class JsonlSummaries:
    """``OUT_DIR/summaries.jsonl``: one line per finished document (``--format jsonl``).

    Each line: the document's key as the input gave it (``"custom_id"`` or
    ``"id"`` from JSONL; ``"id"`` and ``"source"`` for files), ``"summary"``
    (the text of ``OUT_DIR/<id>.md``, which stays the durable unit the journal
    recovers from), ``"output"`` and the token counts when known. Lines are
    appended and fsync'ed; an id already present is never written again, and
    a torn last line (crash mid-append) is cut off when the file is opened.
    Order is completion order; match lines by key.

    Args:
        out_dir: the job's output folder.
        docs: the job's documents (for their keys).

    Raises:
        OSError: the file cannot be read or repaired.
    """

    FIELDS = ("input_tokens", "output_tokens", "finish_reason")

    def __init__(self, out_dir: Path, docs: list[Document]):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / SUMMARIES
        self.docs: Mapping[str, Document] = {d.id: d for d in docs}
        self.ids: set[str] = set()  # document ids (file stems) already in the file
        try:
            fd = os.open(self.path, os.O_RDWR | _NOFOLLOW)
        except FileNotFoundError:
            return
        except OSError as e:
            raise named(e, self.path) from None
        with os.fdopen(fd, "r+b") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end < len(data):  # torn last line: cut it off (its document gets its line again)
                f.truncate(end)
                os.fsync(f.fileno())
        for line in data[:end].split(b"\n"):
            try:
                self.ids.add(json.loads(line)["output"].removesuffix(".md"))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue

    def add(self, record: dict) -> None:
        """Append the line of the finished document ``record["id"]`` unless it is there already.

        Raises:
            OSError: its ``<id>.md`` cannot be read, or the disk is full.
        """
        doc_id = record["id"]
        if doc_id in self.ids:
            return
        name = f"{doc_id}.md"
        summary = read_nofollow(self.out_dir / name).decode("utf-8").removesuffix("\n")  # bytes: no newline translation
        doc = self.docs.get(doc_id)
        if doc is not None and doc.key is not None:
            line = {doc.key[0]: doc.key[1]}
        else:
            line = {"id": doc_id, "source": doc.source if doc is not None else None}
            if doc is not None and doc.name != doc_id:  # the output name differs from the original
                line["name"] = doc.name
        line |= {"summary": summary, "output": name} | {k: record[k] for k in self.FIELDS if k in record}
        _append_line(self.path, (json.dumps(line) + "\n").encode("ascii"))  # as Journal.append
        self.ids.add(doc_id)

    def sync(self, records: Mapping[str, dict]) -> None:
        """Add every job document that is ``done`` in ``records`` and has its ``.md`` but no line yet
        (a crash between the two, or an earlier run without ``--format jsonl``)."""
        for doc_id in self.docs:
            rec = records.get(doc_id)
            if rec is not None and rec.get("status") == "done" and (self.out_dir / f"{doc_id}.md").exists():
                self.add({**rec, "id": doc_id})
