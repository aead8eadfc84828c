"""The job's output folder as one resource: prepared, locked, cleaned, released;
and the writes that belong to the folder rather than to a document (progress,
the stdin path list, a detached start).

:class:`JobDir` is a context manager: entering creates ``OUT_DIR`` (or checks
an existing one is a writable folder), takes its run lock (a second run on the
same folder is refused) and removes the stale temporary files of a run that
was killed mid-write (those older than 2 minutes,
:data:`mlx_tier.fsio.STALE_AFTER_S`: a younger one may be a live
writer's) and the progress files it left (:func:`clear_progress`:
a rerun with nothing pending would otherwise still read as interrupted); leaving releases the lock, whatever happened. It knows the paths
the runner writes: each document's ``<id>.md`` and the journal (one
name per process, so that several processes of one job can each keep
their own; the default is the job's one journal).

A ``part`` (one rank of a distributed run, docs/distributed.md) holds the folder
otherwise: its launcher has taken the run lock and cleaned up before any rank
started, so a part locks only its own journal (``<journal>.lock``, against a
second process taking the same rank) and removes nothing (the other ranks'
temporary files are live).
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Self

from mlx_tier.errors import InputError
from mlx_tier.fsio import remove_stale_temps, write_atomic
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import (
    INPUT_LIST,
    JOURNAL,
    LAST_PROGRESS,
    LOCK,
    LOG_FILE,
    PID_FILE,
    PROGRESS_FILE,
    lock_held,
    progress_files,
)

if TYPE_CHECKING:
    from mlx_tier.job.documents import Document


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


def _say_holder(lock) -> None:
    """Write who holds the run lock into its file (``lock``: the open lock file): this
    process's pid, host and the Unix time, so that `status` tells a run still loading its
    model (no ``start`` record yet) from the last run that started
    (:func:`~mlx_tier.outdir.layout.lock_holder`). Best effort: a failed write says nothing."""
    try:
        lock.truncate(0)
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
        lock.flush()
    except OSError:
        pass


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
        _say_holder(self._lock)
        remove_stale_temps(self.path)  # a killed run's half-written outputs
        journal_last_progress(self.path, self.journal_path)  # how far a killed run got, before
        clear_progress(self.path)  # its progress is cleared: this run is not it
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

    def journal(self, on_done=None, clock=None, on_failed=None) -> Journal:
        """The journal this process appends to (:class:`mlx_tier.outdir.journal.Journal`;
        ``clock``: the run's :class:`~mlx_tier.outdir.journal.RunClock`, stamped on each record)."""
        return Journal(self.path, on_done=on_done, name=self.journal_name, clock=clock, on_failed=on_failed)

    def view(self) -> Journal:
        """The job's journal as every reader sees it (``journal.jsonl`` with the rank
        journals of distributed runs merged in): what a run triages from."""
        return Journal(self.path)

    def output(self, doc_id: str) -> Path:
        """Where the summary of document ``doc_id`` goes."""
        return self.path / f"{doc_id}.md"


class ProgressFile:
    """``OUT_DIR/progress.json`` (a rank of a distributed run: its own
    ``progress-<k>.json``, :func:`rank_progress_name`): what a running job is doing now
    (the documents in flight, the prompt being read and how far, tokens written so far,
    rates), rewritten atomically at most every ``every`` seconds and removed when the
    run ends cleanly; ``mlx-tier status`` shows it while the run holds the lock.

    Progress is best effort: a write that fails (disk full) is skipped, never
    fatal to the job. :meth:`beat` rewrites the last snapshot from another thread
    while a step runs long (:class:`mlx_tier.job.heartbeat.Heartbeat`).
    """

    def __init__(self, out_dir: Path, every: float = 2.0, name: str = PROGRESS_FILE, clock=None) -> None:
        self.path, self.every, self._last = Path(out_dir) / name, every, float("-inf")
        self.clock = clock  # the run's RunClock: its id and clock go with each snapshot
        self._snapshot: dict = {}  # the last activity given, as a dict
        self._lock = threading.Lock()  # update (main thread) and beat (the heartbeat's)
        self._cleared = False

    def update(self, activity) -> None:
        """Write ``activity`` (anything with ``as_dict()``, e.g. :class:`mlx_tier.job.run.Activity`)
        if ``every`` seconds have passed since the last write, with ``time`` (Unix
        seconds, for people) and, given a clock, the run's id (``run``), its clock
        (``run_t``) and this machine's monotonic clock (``mono`` on ``host``), by which a
        reader on the same machine ages the snapshot whatever the wall clock does."""
        with self._lock:
            self._snapshot = activity.as_dict()
            self._write(self.every)

    def beat(self, fields: dict, every: float) -> None:
        """Rewrite the last snapshot with ``fields`` added (e.g. how long the step in progress
        has run) if ``every`` seconds have passed since the last write; nothing once cleared."""
        with self._lock:
            self._write(every, fields)

    def _write(self, every: float, fields: dict | None = None) -> None:
        now = time.monotonic()
        if now - self._last < every or self._cleared:
            return
        self._last = now
        stamp = {"time": time.time()}
        if self.clock is not None:
            stamp |= {"run": self.clock.id, "run_t": round(self.clock.t(), 3), "mono": now,
                      "host": socket.gethostname()}
        try:
            write_atomic(self.path, json.dumps({**stamp, **self._snapshot, **(fields or {})}) + "\n")
        except OSError:
            pass

    def clear(self) -> None:
        with self._lock:
            self._cleared = True
            self.path.unlink(missing_ok=True)


def journal_last_progress(out_dir: Path, journal_path: Path) -> None:
    """Keep how far a run that left its progress files got (a kill: a run ending otherwise
    removes them) in ``journal_path``: one ``last_progress`` record in its name, with its
    last snapshot's clock (``run_t``), so that its time is counted to there when its record
    is rebuilt (:func:`mlx_tier.job.report.unreported_runs`), as `status` counted it before
    this run cleared the snapshot. Best effort: unreadable snapshots are skipped."""
    last: dict[str, float] = {}
    for path in progress_files(out_dir):
        try:
            snap = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        run, t = (snap.get("run"), snap.get("run_t")) if isinstance(snap, dict) else (None, None)
        if isinstance(run, str) and isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            last[run] = max(t, last.get(run, t))
    if not last or not journal_path.is_file():
        return
    journal = Journal(journal_path.parent, name=journal_path.name)
    for run, t in last.items():
        journal.append({"event": LAST_PROGRESS, "run": run, "run_t": round(t, 3)})


def clear_progress(out_dir: Path) -> None:
    """Remove every progress file of ``out_dir``: a run taking the folder's lock removes
    those an earlier run left (a crash, a kill), which would read as this run's."""
    for path in progress_files(out_dir):
        path.unlink(missing_ok=True)


def write_input_list(out_dir: Path, docs: list[Document]) -> Path:
    """Keep the file paths of a stdin list in ``out_dir/inputs.txt`` (one absolute path a line)
    so the job can be resumed with ``mlx-tier run - ... < OUT_DIR/inputs.txt``.

    Raises:
        OSError: not writable, disk full.
    """
    path = Path(out_dir) / INPUT_LIST
    write_atomic(path, "".join(f"{d.source}\n" for d in docs))
    return path


# How long `run --background` waits for its run to journal something (its checks passed, its
# model loaded) before it returns: a setting refused there (too little --memory-gb, a
# --max-tokens beyond the context, a missing model) is said here, not only in run.log.
BACKGROUND_CHECK_SECONDS = 30.0


def file_size(path: Path) -> int:
    """``path``'s size in bytes, 0 when it is missing."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def first_moments(pid: int, out_dir: Path, log_from: int, journal_from: int,
                  seconds: float = BACKGROUND_CHECK_SECONDS) -> tuple[int, list[str]] | None:
    """Wait for the detached run ``pid`` (this process's child) to journal its ``start``
    (past byte ``journal_from``: its settings checked, its model loaded), to exit, or
    ``seconds`` to pass. A run with nothing to do (its ``triaged`` record) is waited for
    to its exit.

    Returns:
        ``(exit code, its error: lines in run.log past byte log_from)`` when it exited
        first (a signal: 128 + its number); ``None`` when it is under way, or ``pid`` is no
        child of this process.
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done == pid:
            code = os.waitstatus_to_exitcode(status)
            return (128 - code if code < 0 else code), _error_lines(Path(out_dir) / LOG_FILE, log_from)
        if _started(Path(out_dir) / JOURNAL, journal_from) or time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _started(journal: Path, start: int) -> bool:
    """Whether ``journal`` holds a run's ``start`` record past byte ``start``."""
    if file_size(journal) <= start:
        return False
    try:
        with open(journal, "rb") as f:
            f.seek(start)
            lines = f.read().splitlines()
    except OSError:
        return False
    for line in lines:
        try:
            if json.loads(line).get("event") == "start":
                return True
        except (ValueError, AttributeError):
            continue
    return False


def _error_lines(log: Path, start: int) -> list[str]:
    """The ``error:`` lines (with the lines that continue them) of ``log`` past byte ``start``."""
    try:
        with open(log, "rb") as f:
            f.seek(start)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    first = next((k for k, line in enumerate(lines) if line.startswith("error:")), None)
    return [] if first is None else [line for line in lines[first:] if line.strip()]


def start_background(argv: list[str], out_dir: Path, stdin: Path | None = None) -> int:
    """Start a run detached from this terminal and return at once.

    The process gets its own session (no SIGHUP when the terminal closes, no
    Ctrl-C from it), its stdout and stderr are appended to ``OUT_DIR/run.log``
    and its pid is written to ``OUT_DIR/run.pid``. The run itself takes the
    folder's lock, so a second run there is refused while it is active.

    Args:
        argv: the full command, e.g. ``[sys.executable, "-m",
            "mlx_tier.cli.main", "run", ...]`` (without ``--background``).
        out_dir: the job's output folder (created if missing).
        stdin: a file to give the process as its standard input (a path list).

    Returns:
        the process id.

    Raises:
        InputError: another run is active in ``out_dir``.
        OSError: ``out_dir`` not writable, or ``argv`` cannot be started.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if lock_held(out_dir):
        raise InputError(f"{out_dir}: another mlx-tier run is using this output folder")
    log_fd = os.open(out_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o666)
    with os.fdopen(log_fd, "ab") as log, open(stdin if stdin is not None else os.devnull, "rb") as inp:
        proc = subprocess.Popen(argv, stdin=inp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    write_atomic(out_dir / PID_FILE, f"{proc.pid}\n")
    return proc.pid
