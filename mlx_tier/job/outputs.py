"""Output files of a job beside the ``<id>.md`` summaries: ``summaries.jsonl``
(``--format jsonl``), and a batch request file's ``output.jsonl`` and ``errors.jsonl``.

The ``<id>.md`` file stays the durable unit the journal
(:mod:`mlx_tier.outdir.journal`) recovers from; ``summaries.jsonl`` lines are derived
from it, appended and fsync'ed before the document's journal record, one line per
document id, never two. A summary redone (its document changed, or its model
or prompt with ``redo_changed``) replaces its line: the file is rewritten
whole, atomically, so the old line stays until the new one is in. A batch
request's durable unit is its ``output.jsonl`` line (:class:`BatchOutputs`),
replaced the same way when the request changed since its answer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from mlx_tier.fsio import _NOFOLLOW, _append_line, named, read_nofollow, write_atomic
from mlx_tier.job.documents import Document
from mlx_tier.outdir.layout import BATCH_ERRORS, BATCH_OUTPUT, SUMMARIES


def keeps_jsonl(out_dir: Path, output_format: str) -> bool:
    """Whether a run keeps ``summaries.jsonl``: with ``--format jsonl``, and whenever the
    file exists (an earlier run's), so that a ``--format md`` run never leaves its lines
    behind the ``.md`` files."""
    return output_format == "jsonl" or (Path(out_dir) / SUMMARIES).exists()


class JsonlSummaries:
    """``OUT_DIR/summaries.jsonl``: one line per finished document (``--format jsonl``).

    Each line: the document's key as the input gave it (``"custom_id"`` or
    ``"id"`` from JSONL; ``"id"`` and ``"source"`` for files), ``"summary"``
    (the text of ``OUT_DIR/<id>.md``, which stays the durable unit the journal
    recovers from), ``"output"`` and the token counts when known. Lines are
    appended and fsync'ed; an id already present is written again only when its
    line changed (then replaced), and a torn last line (crash mid-append) is cut
    off when the file is opened.
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
        self.summaries: dict[str, str | None] = {}  # document id (file stem) -> the summary its line holds
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
                parsed = json.loads(line)
                self.summaries[parsed["output"].removesuffix(".md")] = parsed.get("summary")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue

    def add(self, record: dict) -> None:
        """Write the line of the finished document ``record["id"]``: appended when it has
        none, replaced when its line holds another summary than its ``.md`` (module doc),
        left alone when it holds the same.

        Raises:
            OSError: its ``<id>.md`` cannot be read, or the disk is full.
        """
        doc_id = record["id"]
        name = f"{doc_id}.md"
        # bytes: no newline translation; an .md edited by hand in another encoding: its stray bytes as U+FFFD
        summary = read_nofollow(self.out_dir / name).decode("utf-8", errors="replace").removesuffix("\n")
        if doc_id in self.summaries and self.summaries[doc_id] == summary:  # its line holds it already
            return
        doc = self.docs.get(doc_id)
        if doc is not None and doc.key is not None:
            line = {doc.key[0]: doc.key[1]}
        else:
            line = {"id": doc_id, "source": doc.source if doc is not None else None}
            if doc is not None and doc.name != doc_id:  # the output name differs from the original
                line["name"] = doc.name
        line |= {"summary": summary, "output": name} | {k: record[k] for k in self.FIELDS if k in record}
        data = (json.dumps(line) + "\n").encode("ascii")  # as Journal.append
        if doc_id in self.summaries:
            self._replace(name, data)
        else:
            _append_line(self.path, data)
        self.summaries[doc_id] = summary

    def drop(self, record: dict) -> None:
        """Remove the line of ``record["id"]``, a document that failed, if it has one and its
        ``redo`` was ``stale`` (the line held the summary of an earlier version of its text,
        as its ``.md`` did: :func:`mlx_tier.job.run._record` removes that); a redo for other
        settings that failed keeps it, of the same text.

        Raises:
            OSError: the file cannot be rewritten.
        """
        if record["id"] in self.summaries and record.get("redo") == "stale":
            del self.summaries[record["id"]]
            self._replace(f"{record['id']}.md", b"")

    def _replace(self, name: str, data: bytes) -> None:
        """Rewrite the file (atomically) with the line of output ``name`` replaced by ``data``
        (``b""``: removed)."""
        kept = []
        for line in read_nofollow(self.path).splitlines(keepends=True):
            try:
                if json.loads(line)["output"] == name:
                    continue
            except (ValueError, KeyError, TypeError):
                pass
            kept.append(line)
        write_atomic(self.path, b"".join(kept) + data)

    def sync(self, records: Mapping[str, dict]) -> None:
        """Write the line of every job document that is ``done`` in ``records`` and has its
        ``.md`` (:meth:`add`): a missing line (a crash between the two, or an earlier run
        without ``--format jsonl``) appended, a line that says otherwise replaced; drop the
        line of one that ``failed`` (:meth:`drop`)."""
        for doc_id in self.docs:
            rec = records.get(doc_id)
            if rec is not None and rec.get("status") == "done" and (self.out_dir / f"{doc_id}.md").exists():
                self.add({**rec, "id": doc_id})
            elif rec is not None and rec.get("status") == "failed":
                self.drop({**rec, "id": doc_id})


def _whole_lines(path: Path) -> list[bytes]:
    """The complete lines of a JSONL file, without their newlines; a torn last line (a
    crash mid-append) is left out (the next append cuts it off). ``[]`` when the file
    is missing. Never read through a link.

    Raises:
        OSError: unreadable, or a link (``ELOOP``), naming the file.
    """
    try:
        data = read_nofollow(path)
    except FileNotFoundError:
        return []
    return data[: data.rfind(b"\n") + 1].split(b"\n")[:-1]


def _custom_id(line: bytes) -> str | None:
    try:
        value = json.loads(line)["custom_id"]
    except (ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) else None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def line_bytes(line: dict) -> bytes:
    """A batch output or error line as written, without its newline: ASCII JSON, as the
    journal (any text survives)."""
    return json.dumps(line).encode("ascii")


class BatchOutputs:
    """``OUT_DIR/output.jsonl`` and ``OUT_DIR/errors.jsonl``: the Batch API's output and
    error files of a batch request file (lines from :mod:`mlx_tier.job.batch_api`).

    An ``output.jsonl`` line is the durable unit of a finished request, as ``<id>.md``
    is of a summary: its ``writing`` record journalled, then the line appended and
    fsync'ed, then the ``done`` record; a rerun that finds a line whose done record was
    lost (a crash between the two) records it instead of running the request again,
    when the writing record vouches for that line and for the request as it is now
    (:func:`~mlx_tier.job.rerun.doubt_answers`); else the request runs again. ``done``:
    ``custom_id ->`` the sha256 of its answer's line. A line is rewritten only when its request
    changed since (a *stale* answer, :mod:`mlx_tier.job.provenance`) and is redone: the
    file is rewritten whole, atomically, with the new answer in place of the old one's
    line, so the old line stays until the new one is complete; a redo that fails drops
    the old answer's line (atomically) before its error's line is appended (the old
    answer was to another request). ``errors.jsonl`` holds one
    line per request that stays failed: a failure's line is appended before its
    ``failed`` record, and when a run starts :meth:`keep_errors` makes the file hold
    exactly the failures that stand (a request retried by ``retry_failed`` loses its
    line until it fails again; a line whose record was lost is dropped and the
    request runs again). So a ``custom_id`` is in one line of the two files at most,
    whatever crashes and reruns come between. Lines are in completion order; match
    them by ``custom_id``.

    Args:
        out_dir: the job's output folder.

    Raises:
        OSError: a file cannot be read (a link is refused).
    """

    def __init__(self, out_dir: Path):
        self.output_path, self.errors_path = Path(out_dir) / BATCH_OUTPUT, Path(out_dir) / BATCH_ERRORS
        # custom_id -> the sha256 of its answer's line: what a writing record vouches for
        self.done: dict[str, str] = {c: _digest(line) for line in _whole_lines(self.output_path)
                                     if (c := _custom_id(line)) is not None}
        self.errors: dict[str, bytes] = {c: line for line in _whole_lines(self.errors_path)
                                         if (c := _custom_id(line)) is not None}

    def add_output(self, custom_id: str, line: dict, redo: bool = False) -> None:
        """Append a finished request's line (:func:`~mlx_tier.job.batch_api.output_line`)
        unless its ``custom_id`` has one already; ``redo`` (its request changed since that
        one): the file is rewritten atomically with the new line in place of the old.

        Raises:
            OSError: the disk is full, or the file cannot be written.
        """
        data = line_bytes(line)
        if custom_id in self.done and redo:
            self._rewrite_output(custom_id, data + b"\n")
        elif custom_id not in self.done:
            _append_line(self.output_path, data + b"\n")
        else:
            return
        self.done[custom_id] = _digest(data)

    def add_error(self, custom_id: str, line: dict, redo: bool = False) -> None:
        """Append a failed request's line (:func:`~mlx_tier.job.batch_api.error_line`) unless
        its ``custom_id`` has a line in either file already; ``redo`` (its request changed
        since its answer): the old answer's line is dropped first (atomically: a crash
        between the two leaves no line, and the request, still recorded ``done`` with its
        old request's hash, runs again).

        Raises:
            OSError: the disk is full, or the file cannot be written.
        """
        if custom_id in self.done and redo:
            self._rewrite_output(custom_id, b"")
            del self.done[custom_id]
        if custom_id not in self.done and custom_id not in self.errors:
            data = line_bytes(line)
            _append_line(self.errors_path, data + b"\n")
            self.errors[custom_id] = data

    def _rewrite_output(self, custom_id: str, line: bytes) -> None:
        """Rewrite ``output.jsonl`` atomically without ``custom_id``'s line, ``line`` (whole,
        or ``b""``) at its end: the old line stays until the new file is complete.

        Raises:
            OSError: the disk is full, or the file cannot be written.
        """
        kept = [x + b"\n" for x in _whole_lines(self.output_path) if _custom_id(x) != custom_id]
        write_atomic(self.output_path, b"".join(kept) + line)

    def keep_errors(self, standing: Mapping[str, Callable[[], dict]]) -> None:
        """Make ``errors.jsonl`` hold one line for each ``custom_id`` of ``standing`` and no
        other: a line already there is kept as it is, a missing one is made by
        ``standing[custom_id]()``. Rewritten atomically, only when that changes it.

        Raises:
            OSError: the file cannot be written.
        """
        if set(standing) == set(self.errors):
            return
        lines = {c: self.errors[c] if c in self.errors else line_bytes(make()) for c, make in standing.items()}
        write_atomic(self.errors_path, b"".join(v + b"\n" for v in lines.values()))
        self.errors = lines
