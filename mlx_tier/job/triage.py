"""Which of a job's documents this run does: a pure decision over plain data.

The runner gathers the facts (the journal's last record per id, which ids an
earlier run named, which outputs exist, the hash of each document's source
now, this run's model and prompt) and :func:`triage` sorts the documents into
done / recovered / reused / failed / pending without touching a file or
converting a document (vLLM v1's split: the scheduler decides from plain
data, the runner executes). Pending ids come back in input order; the
runner converts each only when its turn comes. What a summary's record keeps
of its source, model and prompt, and why: :mod:`mlx_tier.job.provenance`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlx_tier.job.doc_text import reading_route
from mlx_tier.job.provenance import (
    SETTINGS_FIELDS,
    Settings,
    recorded_hash,
    was_unreadable,
)

# A summary's figures, as its done record (and the writing record before it) keeps them.
FIGURES = ("input_tokens", "output_tokens", "doc_seconds", "finish_reason", "parts", "parts_kept", "kept_tokens",
           "converter")
# What a done / failed record of an earlier run keeps in this run's results.
DONE_KEEPS = (*FIGURES, "made_from", *SETTINGS_FIELDS, "reused")
FAILED_KEEPS = ("input_tokens", "doc_seconds", "converter", "error_code", "error_param")


@dataclass(frozen=True)
class OutputState:
    """What ``OUT_DIR/<id>.md`` is now.

    Attributes:
        exists: it exists (a link counts when its target exists).
        regular: a regular file, not a link: complete, since outputs are
            written atomically (a crash after the rename left it unrecorded).
    """

    exists: bool = False
    regular: bool = False

    @classmethod
    def of(cls, path: Path) -> OutputState:
        return cls(path.exists(), path.is_file() and not path.is_symlink())


@dataclass(frozen=True)
class Triage:
    """Each document of the job by what this run does with it.

    Attributes:
        done: ``id -> journal record`` of documents done by earlier runs.
        recovered: ids whose output is complete but unrecorded (a crash after
            the rename): done; the runner records them, never regenerates them.
        failed: ``id -> journal record`` failed earlier and not retried now.
        pending: ids to run now, in input order (the ``stale`` and ``changed`` ones among them).
        left: ids ``retry_failed`` leaves for a plain rerun: never finished, or stale (their
            summary is of an earlier text; one of other settings stays done).
        stale: done ids whose source changed since their summary: pending (redone),
            or ``left`` with ``retry_failed`` (pending too: their summary is stale).
        changed: done ids written with other settings (model, prompt, generation options), pending because
            ``redo_changed`` asked for them.
        kept_changed: done ids written with other settings, kept (no ``redo_changed``).
        unstamped: done ids whose record keeps no source hash (an older version): taken as current.
        reused: ``id -> done id`` whose summary this document gets as its own (the same
            content under another name: a rename or a copy; same model and prompt):
            copied by the runner, not generated again.
        failed_changed: ids that failed on another version of their source (pending:
            a failure stands for the content it failed on only).
        missing: done ids whose output is gone (deleted since written): pending, written again.
        recovered_from: ``id -> writing record`` of recovered outputs: the record the run
            that wrote them journalled before the rename, its ``made_from`` and settings
            (filled by :func:`~mlx_tier.job.rerun.doubt_unrecorded`, which reads them).
    """

    done: dict[str, dict] = field(default_factory=dict)
    recovered: list[str] = field(default_factory=list)
    failed: dict[str, dict] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    kept_changed: list[str] = field(default_factory=list)
    unstamped: list[str] = field(default_factory=list)
    reused: dict[str, str] = field(default_factory=dict)
    recovered_from: dict[str, dict] = field(default_factory=dict)
    failed_changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def copied(self) -> list[str]:
        """Stale ids changed to a text another summary of the job holds: given that summary
        (:attr:`reused`), not redone."""
        return [i for i in self.stale if i in self.reused]


def triage(ids: Sequence[str], records: Mapping[str, dict], outputs: Mapping[str, OutputState],
           attempted: set[str] = frozenset(), retry_failed: bool = False,
           current: Mapping[str, str | None] | None = None, settings: Settings | None = None,
           redo_changed: bool = False, reuse: bool = True, routes: Mapping[str, str] | None = None) -> Triage:
    """Sort a job's documents by their journal state and outputs (pure).

    Args:
        ids: every document of the job, in input order.
        records: the journal's last record per id (:meth:`mlx_tier.outdir.journal.Journal.records`),
            ids no longer in the job included (a renamed document's old name).
        outputs: the state of each id's output file (missing ids: no output).
        attempted: ids an earlier run of this job named or recorded; only
            their unrecorded outputs are adopted (a user's own file never is).
        retry_failed: run only the documents that failed earlier (without it, one that
            failed is run again only when its source changed since).
        current: the sha256 of each document's source now
            (:class:`~mlx_tier.job.provenance.SourceStamp`; ``None`` or missing:
            unknown, the summary is taken as current).
        settings: this run's model and prompt (``None``: not compared).
        redo_changed: also redo summaries written with other settings
            (:meth:`~mlx_tier.job.provenance.Settings.differences`).
        reuse: give a pending document the summary of the same content under another
            name (``False`` for a request file: its answers are lines, not files).
        routes: how each document's text is read
            (:func:`~mlx_tier.job.doc_text.reading_route`; missing: ``"text"``): a summary
            is given only to the same bytes read the same way.
    """
    t, current = Triage(), current or {}
    for i in ids:
        rec, out = records.get(i) or {}, outputs.get(i, OutputState())
        status = rec.get("status")
        if status == "done" and out.exists:
            _sort_done(t, i, rec, current.get(i), settings, redo_changed, retry_failed)
        elif i in attempted and out.regular and status != "failed":  # failed: a redo's old summary is left
            t.recovered.append(i)
        elif status == "failed" and not retry_failed and _changed(rec, current.get(i)):
            t.pending.append(i)  # failed on another version of its source: this one is tried
            t.failed_changed.append(i)
        elif status == "failed" and not retry_failed:
            t.failed[i] = rec  # stays failed until --retry-failed
        elif retry_failed and status != "failed":
            t.left.append(i)
        else:
            t.pending.append(i)
            if status == "done":  # its output deleted since
                t.missing.append(i)
    if settings is not None and reuse and not retry_failed:
        _reuse(t, records, outputs, current, settings, routes or {})
    return t


def _changed(rec: dict, now: str | None) -> bool:
    """Whether the source ``rec`` was made (or failed) from hashed otherwise than ``now`` (both
    known), or could not be read then and can now."""
    if was_unreadable(rec):
        return now is not None
    was = recorded_hash(rec)
    return was is not None and now is not None and now != was


def _sort_done(t: Triage, i: str, rec: dict, now: str | None, settings: Settings | None, redo_changed: bool,
               retry_failed: bool) -> None:
    """File the done document ``i`` (record ``rec``, source hash ``now``) in ``t``: kept, or
    redone because its source changed or (``redo_changed``) its model or prompt did."""
    other = settings is not None and settings.differs(rec)
    if recorded_hash(rec) is None:
        t.unstamped.append(i)
    if _changed(rec, now):
        t.stale.append(i)
    elif other and redo_changed:
        t.changed.append(i)
    else:
        if other:
            t.kept_changed.append(i)
        t.done[i] = rec
        return
    if retry_failed and i in t.stale:  # left for a plain rerun: pending (its summary is of an earlier text)
        t.left.append(i)
    elif retry_failed:  # other settings, left as they are (current for its text) for a plain rerun
        t.done[i] = rec
    else:
        t.pending.append(i)


def _reuse(t: Triage, records: Mapping[str, dict], outputs: Mapping[str, OutputState],
           current: Mapping[str, str | None], settings: Settings, routes: Mapping[str, str]) -> None:
    """Move to ``t.reused`` the pending documents whose source hash equals that of a summary
    written with these settings whose output is there (a rename, a copy), read the same
    way (``routes``; a record's from the suffix of its ``source``)."""
    by_hash = {}
    for j, rec in records.items():
        h = recorded_hash(rec)
        if rec.get("status") == "done" and h is not None and outputs.get(j, OutputState()).regular \
                and not settings.differs(rec) and current.get(j, h) == h:
            by_hash.setdefault((h, reading_route(rec.get("source"))), j)
    for i in list(t.pending):
        j = by_hash.get((current.get(i) or "", routes.get(i, "text")))
        if j is not None and j != i and i not in t.changed:
            t.pending.remove(i)
            t.reused[i] = j


def attempted_ids(entries) -> set[str]:
    """Ids an earlier run of this job named (its start record) or recorded, from journal entries."""
    ids: set[str] = set()
    for rec in entries:
        ids.update(x for x in (rec.get("ids") or []) + (rec.get("todo") or []) if isinstance(x, str))
        if isinstance(rec.get("id"), str):
            ids.add(rec["id"])
    return ids


def foreign_outputs(out_dir: Path, attempted: set[str]) -> dict[str, str]:
    """``<stem>.md`` entries in ``out_dir`` that no run of this job wrote (a user's
    own files), as reserved names for :func:`mlx_tier.job.naming.assign` (keys no
    document can have), so that no document's output is named after them."""
    if not out_dir.is_dir():
        return {}
    return {f"\0{p.name}": p.stem for p in out_dir.glob("*.md") if p.stem not in attempted}
