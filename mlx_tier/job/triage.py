"""Which of a job's documents this run does: a pure decision over plain data.

The runner gathers the facts (the journal's last record per id, which ids an
earlier run named, which outputs exist) and :func:`triage` sorts the
documents into done / recovered / failed / pending without touching a file
or converting a document (vLLM v1's split: the scheduler decides from plain
data, the runner executes). Pending ids come back in input order; the
runner converts each only when its turn comes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# What a done / failed record of an earlier run keeps in this run's results.
DONE_KEEPS = ("input_tokens", "output_tokens", "doc_seconds", "finish_reason", "parts", "converter")
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
        pending: ids to run now, in input order.
        left: ids neither done nor failed that ``retry_failed`` leaves for a plain rerun.
    """

    done: dict[str, dict] = field(default_factory=dict)
    recovered: list[str] = field(default_factory=list)
    failed: dict[str, dict] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def triage(ids: Sequence[str], records: Mapping[str, dict], outputs: Mapping[str, OutputState],
           attempted: set[str] = frozenset(), retry_failed: bool = False) -> Triage:
    """Sort a job's documents by their journal state and outputs (pure).

    Args:
        ids: every document of the job, in input order.
        records: the journal's last record per id (:meth:`mlx_tier.outdir.journal.Journal.records`).
        outputs: the state of each id's output file (missing ids: no output).
        attempted: ids an earlier run of this job named or recorded; only
            their unrecorded outputs are adopted (a user's own file never is).
        retry_failed: run only the documents that failed earlier.
    """
    t = Triage()
    for i in ids:
        rec, out = records.get(i) or {}, outputs.get(i, OutputState())
        status = rec.get("status")
        if status == "done" and out.exists:
            t.done[i] = rec
        elif i in attempted and out.regular:
            t.recovered.append(i)
        elif status == "failed" and not retry_failed:
            t.failed[i] = rec  # stays failed until --retry-failed
        elif retry_failed and status != "failed":
            t.left.append(i)
        else:
            t.pending.append(i)
    return t


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
