"""Durable job state: an fsync'ed append-only journal and atomic output writes.

Invariant: a finished output is never lost or rewritten. An output file is
written to a temporary name, fsync'ed and renamed into place, so it exists
only when complete; then a ``done`` record is appended to ``journal.jsonl``
and fsync'ed. After a crash between the two, the rerun finds the complete
output without its record and records it instead of regenerating it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

JOURNAL = "journal.jsonl"


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


class Journal:
    """Append-only record of document states in ``OUT_DIR/journal.jsonl``.

    Each line is one JSON object with at least ``id``, ``status`` (``done`` or
    ``failed``) and ``time`` (Unix seconds). The last record of an id wins. A
    torn last line (crash mid-append) is ignored.
    """

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL

    def records(self) -> dict[str, dict]:
        """The latest record of each document id."""
        latest: dict[str, dict] = {}
        if not self.path.exists():
            return latest
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # torn write at the end of a crashed run
                if isinstance(rec, dict) and "id" in rec:
                    latest[rec["id"]] = rec
        return latest

    def append(self, record: dict) -> None:
        """Durably append one record (``time`` is added)."""
        record = {**record, "time": round(time.time(), 3)}
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "ab+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a torn line: start a fresh one
                    line = "\n" + line
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
