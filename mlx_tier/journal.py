"""Durable job state: an fsync'ed append-only journal and atomic output writes.

Invariant: a finished output is never lost or rewritten. An output file is
written to a temporary name, fsync'ed and renamed into place, so it exists
only when complete; then a ``done`` record is appended to ``journal.jsonl``
and fsync'ed. After a crash between the two, the rerun finds the complete
output without its record and records it instead of regenerating it.

With ``--format jsonl`` a :class:`JsonlSummaries` also appends each finished
summary to ``summaries.jsonl`` (fsync'ed, before the journal record), one line
per document id, never two.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from .documents import Document

JOURNAL = "journal.jsonl"
SUMMARIES = "summaries.jsonl"
# write_atomic's temporary names: ".<name>.<8 random chars>.tmp" (tempfile.mkstemp).
_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` so that it exists only when complete.

    Raises:
        OSError: the directory is not writable or the disk is full; ``path``
            is then untouched and no temporary file is left.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs get the usual mode
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def remove_stale_temps(out_dir: Path) -> list[str]:
    """Delete :func:`write_atomic` temporary files a killed run left in ``out_dir``.

    Call only while holding the folder's lock (no other writer is active).

    Returns:
        the names removed.
    """
    removed = []
    for p in Path(out_dir).iterdir():
        if _TEMP.match(p.name) and p.is_file():
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed


def _append_line(path: Path, line: bytes) -> None:
    """Append one line and fsync; a torn last line (no newline) is closed first."""
    with open(path, "ab+") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a torn line: start a fresh one
                line = b"\n" + line
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


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
    """

    def __init__(self, out_dir: Path, on_done: Callable[[dict], None] | None = None):
        self.path = Path(out_dir) / JOURNAL
        self.on_done = on_done

    def entries(self) -> Iterator[dict]:
        """Every readable record in file order (torn lines skipped)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # torn write at the end of a crashed run
                if isinstance(rec, dict):
                    yield rec

    def records(self) -> dict[str, dict]:
        """The latest record of each document id."""
        return {rec["id"]: rec for rec in self.entries() if "id" in rec}

    def append(self, record: dict) -> None:
        """Durably append one record (``time`` is added); the state change is on disk when this returns."""
        record = {**record, "time": round(time.time(), 3)}
        if self.on_done is not None and record.get("status") == "done":
            self.on_done(record)
        _append_line(self.path, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))


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
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # torn last line: cut it off (its document gets its line again)
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        for line in data[:end].splitlines():
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
        summary = (self.out_dir / name).read_bytes().decode("utf-8").removesuffix("\n")  # bytes: no newline translation
        doc = self.docs.get(doc_id)
        if doc is not None and doc.key is not None:
            line = {doc.key[0]: doc.key[1]}
        else:
            line = {"id": doc_id, "source": doc.source if doc is not None else None}
        line |= {"summary": summary, "output": name} | {k: record[k] for k in self.FIELDS if k in record}
        _append_line(self.path, (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8"))
        self.ids.add(doc_id)

    def sync(self, records: Mapping[str, dict]) -> None:
        """Add every job document that is ``done`` in ``records`` and has its ``.md`` but no line yet
        (a crash between the two, or an earlier run without ``--format jsonl``)."""
        for doc_id in self.docs:
            rec = records.get(doc_id)
            if rec is not None and rec.get("status") == "done" and (self.out_dir / f"{doc_id}.md").exists():
                self.add({**rec, "id": doc_id})
