"""The job's output folder as one resource: prepared, locked, cleaned, released.

:class:`JobDir` is a context manager: entering creates ``OUT_DIR`` (or checks
an existing one is a writable folder), takes its run lock (a second run on the
same folder is refused) and removes the stale temporary files of a run that
was killed mid-write (those older than 2 minutes,
:data:`mlx_tier.fsio.STALE_AFTER_S`: a younger one may be a live
writer's) and the progress files it left (:func:`mlx_tier.status.clear_progress`:
a rerun with nothing pending would otherwise still read as interrupted); leaving releases the lock, whatever happened. It knows the paths
the runner writes: each document's ``<id>.md`` and the journal (one
name per process, so that several processes of one job can each keep
their own; the default is the job's one journal).

A ``part`` (one rank of a distributed run, issue 16) holds the folder
otherwise: its launcher has taken the run lock and cleaned up before any rank
started, so a part locks only its own journal (``<journal>.lock``, against a
second process taking the same rank) and removes nothing (the other ranks'
temporary files are live).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Self

from .errors import InputError
from .fsio import remove_stale_temps
from .journal import JOURNAL, Journal
from .status import LOCK, clear_progress


def prepare_out_dir(out_dir: Path) -> bool:
    """Create ``out_dir`` and check it is writable.

    Returns:
        whether it was created now.
    Raises:
        InputError: it cannot be created or written.
    """
    created = not out_dir.exists()
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir}: is a file; the output must be a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir) as probe:  # a fresh name: no planted link is followed
            probe.write(b"ok")
    except OSError as e:
        raise InputError(f"{out_dir}: output folder not writable ({e.strerror or e})") from None
    return created


def lock_out_dir(out_dir: Path):
    """An exclusive lock on ``OUT_DIR`` (``flock``): a second run on the same
    folder while one is active is refused. Released when the file is closed
    or the process ends (even by SIGKILL).

    Raises:
        InputError: another run holds it.
    """
    return lock_file(out_dir / LOCK, "another mlx-tier run is using this output folder", out_dir)


def lock_file(path: Path, holder: str, name: Path | None = None):
    """An open file holding an exclusive ``flock`` on ``path`` (created if missing, never
    through a link); released when closed or when the process ends (even by SIGKILL).

    Raises:
        InputError: ``"<name or path>: <holder>"`` when another process holds it.
    """
    f = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o666), "a")
    try:
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # no flock (Windows): no protection
        pass
    except OSError:
        f.close()
        raise InputError(f"{name or path}: {holder}") from None
    return f


class JobDir:
    """``OUT_DIR`` held for one run (module doc).

    Args:
        path: the output folder.
        journal_name: the journal's file name inside it (default: the job's
            journal); a relative path for a rank's (``ranks/<run id>/journal-<k>.jsonl``).
        part: one rank of a distributed run (module doc).

    Attributes:
        path: the folder.
        created: whether this run created it (set on entering).
        journal_path: where this process journals its documents.

    Raises (on entering):
        InputError: not a folder, not writable, or another run holds it.
    """

    def __init__(self, path: Path, journal_name: str = JOURNAL, part: bool = False) -> None:
        self.path = Path(path)
        self.journal_name = journal_name
        self.journal_path = self.path / journal_name
        self.part = part
        self.created = False
        self._lock = None

    def __enter__(self) -> Self:
        self.created = prepare_out_dir(self.path)
        if self.part:
            self._lock = lock_file(self.journal_path.with_suffix(".lock"), "another process runs this rank")
            return self
        self._lock = lock_out_dir(self.path)
        remove_stale_temps(self.path)  # a killed run's half-written outputs
        clear_progress(self.path)  # a killed run's progress: this run is not it
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Free the folder for the next run (idempotent)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def discard_if_unused(self) -> None:
        """Release, and remove the folder when this run created it and left nothing
        in it but its lock: a run that never started leaves no trace."""
        self.release()
        if self.created and [p.name for p in self.path.iterdir()] == [LOCK]:
            (self.path / LOCK).unlink()
            self.path.rmdir()

    def journal(self, on_done=None) -> Journal:
        """The journal this process appends to (:class:`mlx_tier.journal.Journal`)."""
        return Journal(self.path, on_done=on_done, name=self.journal_name)

    def view(self) -> Journal:
        """The job's journal as every reader sees it (``journal.jsonl`` with the rank
        journals of distributed runs merged in): what a run triages from."""
        return Journal(self.path)

    def output(self, doc_id: str) -> Path:
        """Where the summary of document ``doc_id`` goes."""
        return self.path / f"{doc_id}.md"
