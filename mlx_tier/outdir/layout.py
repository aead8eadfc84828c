"""Every file name in a job's output folder, and the probes that read them.

The one owner of OUT_DIR's layout: the job (writer), the monitor (reader) and
the ranks of a distributed run take their names from here::

    OUT_DIR/<id>.md                           one summary per document
    OUT_DIR/journal.jsonl                     the job's durable record (outdir.journal)
    OUT_DIR/summaries.jsonl                   --format jsonl: every summary, one line each
    OUT_DIR/parts.jsonl                       long documents' finished calls (outdir.parts)
    OUT_DIR/output.jsonl                      a batch request file's answers (Batch API output lines)
    OUT_DIR/errors.jsonl                      its requests that failed (Batch API error lines)
    OUT_DIR/report.json, report.html          the job's report and page, rewritten per run
    OUT_DIR/progress.json                     a running job's documents in flight
    OUT_DIR/progress-<k>.json                 the same, of rank k of a distributed run
    OUT_DIR/.mlx-tier.lock                    the run lock (outdir.jobdir takes it)
    OUT_DIR/run.pid, run.log                  --background: the process and its output
    OUT_DIR/inputs.txt                        `mlx-tier run -`: the paths read from stdin
    OUT_DIR/edited/<id>.md                    a summary edited by hand, moved before its redo
    OUT_DIR/ranks/<run_id>/plan.json          what a distributed run's launcher decided
    OUT_DIR/ranks/<run_id>/journal-<k>.jsonl  rank k's journal (only rank k appends to it)
    OUT_DIR/ranks/<run_id>/parts-<k>.jsonl    rank k's kept calls of long documents
    OUT_DIR/ranks/<run_id>/claims/<id>        which rank took document <id>
    OUT_DIR/ranks/<run_id>/rank-<k>.json      rank k's own account, written when it ends
    OUT_DIR/ranks/<run_id>/exit-<k>.json      how rank k's process ended

Nothing here writes a file: probes only (is the lock held, which pid, is the
folder safe to write in). Writing is :mod:`mlx_tier.outdir.jobdir`'s and
:mod:`mlx_tier.outdir.journal`'s.

Invariant (docs/architecture.md): nothing is written outside OUT_DIR. A link
planted in OUT_DIR under a name the job writes (``journal.jsonl`` ->
``~/.bashrc``) would make an append land elsewhere, so such a folder is refused
whole, with one line. OUT_DIR equal to INPUT, or holding it, would mix
summaries with documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from mlx_tier.errors import InputError
from mlx_tier.messages import LIST_FILE

JOURNAL = "journal.jsonl"
SUMMARIES = "summaries.jsonl"
PARTS = "parts.jsonl"
BATCH_OUTPUT = "output.jsonl"
BATCH_ERRORS = "errors.jsonl"
REPORT = "report.json"
REPORT_HTML = "report.html"
PROGRESS_FILE = "progress.json"
# The journal record keeping a killed run's last progress snapshot (jobdir.journal_last_progress).
LAST_PROGRESS = "last_progress"
LOCK = ".mlx-tier.lock"
PID_FILE = "run.pid"
LOG_FILE = "run.log"
INPUT_LIST = LIST_FILE  # named where resume commands are parsed (mlx_tier.messages)
RANKS_DIR = "ranks"
EDITED_DIR = "edited"  # summaries edited by hand, moved there before a redo would replace them
PLAN = "plan.json"
CLAIMS = "claims"

# What a job writes per document (run --format): md, one <id>.md each; jsonl, also every
# summary as a line of SUMMARIES.
OUTPUT_FORMATS = ("md", "jsonl")

# Files a run writes in OUT_DIR besides the <id>.md summaries.
JOB_FILES = (JOURNAL, SUMMARIES, PARTS, BATCH_OUTPUT, BATCH_ERRORS, LOCK, REPORT, REPORT_HTML, PROGRESS_FILE,
             PID_FILE, LOG_FILE, INPUT_LIST)


def run_dir(out_dir: Path, run_id: str) -> Path:
    """``OUT_DIR/ranks/<run_id>``: the files of one distributed run."""
    return Path(out_dir) / RANKS_DIR / run_id


def rank_journal_name(run_id: str, rank: int) -> str:
    """Rank ``rank``'s journal of run ``run_id``, relative to OUT_DIR (a journal name for
    :class:`~mlx_tier.outdir.jobdir.JobDir` and :class:`~mlx_tier.outdir.journal.Journal`)."""
    return f"{RANKS_DIR}/{run_id}/journal-{rank}.jsonl"


def rank_parts(journal_name: str) -> str:
    """The parts file (:mod:`mlx_tier.outdir.parts`) of the process journalling to
    ``journal_name``: :data:`PARTS` for the job's journal, ``ranks/<run>/parts-<k>.jsonl``
    beside rank k's journal."""
    if journal_name == JOURNAL:
        return PARTS
    folder, _, name = journal_name.rpartition("/")
    return f"{folder}/{name.replace('journal-', 'parts-', 1)}"


def rank_account_name(rank: int) -> str:
    """Rank ``rank``'s own account in its run folder, written when the rank ends."""
    return f"rank-{rank}.json"


def rank_exit_name(rank: int) -> str:
    """How rank ``rank``'s process ended, in its run folder (its supervisor writes it)."""
    return f"exit-{rank}.json"


def rank_journals(out_dir: Path) -> list[Path]:
    """Every rank journal of every distributed run of the job (none for a one-process job)."""
    return _rank_files(out_dir, "journal-*.jsonl")


def rank_part_files(out_dir: Path) -> list[Path]:
    """Every rank's kept calls of long documents (:func:`rank_parts`), of every distributed run."""
    return _rank_files(out_dir, "parts-*.jsonl")


def _rank_files(out_dir: Path, pattern: str) -> list[Path]:
    """The regular files ``OUT_DIR/ranks/<run>/<pattern>`` (no link followed)."""
    root = Path(out_dir) / RANKS_DIR
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted(p for p in root.glob(f"*/{pattern}") if p.is_file() and not p.is_symlink())


def rank_progress_name(rank: int) -> str:
    """The progress file of rank ``rank`` of a distributed run (each rank its own: the
    first rank to finish would otherwise remove the file the others still write)."""
    return f"progress-{rank}.json"


def progress_files(out_dir: Path) -> list[Path]:
    """The progress files ``out_dir`` may hold: the run's, then its ranks'."""
    out_dir = Path(out_dir)
    return [out_dir / PROGRESS_FILE, *sorted(out_dir.glob("progress-*.json"))]


def is_job_folder(folder: Path) -> bool:
    """Whether ``folder`` is an mlx-tier job's output folder: its ``journal.jsonl`` is a
    regular file whose first line is a journal record (a JSON object with ``run``,
    ``event`` or ``status``), not merely a file of that name. Reads one line."""
    path = Path(folder) / JOURNAL
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline(1 << 16) or b"null")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and any(k in first for k in ("run", "event", "status"))


def lock_held(out_dir: Path) -> bool:
    """Whether another process holds ``out_dir``'s run lock (a run is active).

    Probed with a non-blocking shared ``flock``, released at once, so the probe
    never blocks a run (a run starting in the same microseconds may find it
    held and refuse). Without ``flock`` (not POSIX) falls back to whether the
    process in ``run.pid`` is alive.
    """
    path = Path(out_dir) / LOCK
    try:
        import fcntl
    except ImportError:
        return _pid_alive(out_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: no run ever started here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def lock_holder(out_dir: Path) -> dict | None:
    """Who took ``out_dir``'s run lock last: ``{"pid", "host", "time"}`` (Unix seconds) as
    that run wrote them into the lock file on taking it (:class:`~mlx_tier.outdir.jobdir.JobDir`);
    ``None`` without (a lock of an older version, an unreadable file). Whether it still holds
    it is :func:`lock_held`'s answer."""
    try:
        holder = json.loads((Path(out_dir) / LOCK).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(holder, dict) and isinstance(holder.get("pid"), int) and \
        isinstance(holder.get("time"), (int, float))
    return holder if ok else None


def pid_file_pid(out_dir: Path) -> int | None:
    """The pid in ``OUT_DIR/run.pid`` (``--background``), ``None`` without one."""
    try:
        return int((Path(out_dir) / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _pid_alive(out_dir: Path) -> bool:
    import psutil

    pid = pid_file_pid(out_dir)
    return pid is not None and psutil.pid_exists(pid)


def check_out_dir(out_dir: Path, input: Path | None = None) -> None:
    """Refuse an output folder the job must not write in.

    Args:
        out_dir: the job's output folder (it need not exist yet).
        input: the job's INPUT when it is a folder or file (``None`` for a path list).

    Raises:
        InputError: ``out_dir`` is the input folder or contains it (or the input
            file), or a job file or a ``.md`` output in it is a symbolic link.
    """
    out_dir = Path(out_dir)
    if input is not None and Path(input).is_dir():
        out, inp = out_dir.resolve(), Path(input).resolve()
        if out == inp:
            raise InputError(f"{out_dir}: the output folder is the input folder; summaries would mix "
                             "with the documents (choose another folder)")
        if inp.is_relative_to(out):
            raise InputError(f"{out_dir}: the output folder contains the input folder {input}; "
                             "choose a folder outside it")
        if out.is_relative_to(inp) and (n := _others_files_under(out)):
            raise InputError(f"{out_dir}: the output folder, inside INPUT, holds {n} file{'s' if n > 1 else ''} "
                             "of no mlx-tier job: an output folder is not read as input, so they would not be "
                             "summarised (choose a new folder)")
    elif input is not None and Path(input).is_file() and Path(input).resolve().is_relative_to(out_dir.resolve()):
        raise InputError(f"{out_dir}: the output folder holds the input file {input}; its summary and reports "
                         "would mix with your documents (choose another folder)")
    if not out_dir.is_dir():
        return
    for entry in sorted(out_dir.iterdir()):
        if entry.is_symlink() and (entry.name in JOB_FILES or entry.suffix == ".md"):
            raise InputError(f"{entry}: is a symbolic link; refusing to write through it "
                             "(remove it, or choose another output folder)")
    _check_others_files(out_dir)


def _others_files_under(folder: Path, most: int = 1000) -> int:
    """How many files (up to ``most``) ``folder`` holds, at any depth, when it is not an
    mlx-tier job's folder (:func:`is_job_folder`): 0 for a job's folder, a missing or empty
    one, or one holding only a job's own files and hidden ones (a run that stopped before
    its journal)."""
    if not folder.is_dir() or is_job_folder(folder):
        return 0
    n = 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        n += sum(1 for f in files if not f.startswith(".") and not (Path(root) == folder and f in JOB_FILES))
        if n >= most:
            break
    return n


# Files a job replaces or appends to that only a job's own run leaves (run.pid and run.log are
# written by `--background` before its run journals anything).
_JOBS_OWN = (SUMMARIES, PARTS, BATCH_OUTPUT, BATCH_ERRORS, REPORT, REPORT_HTML, PROGRESS_FILE, INPUT_LIST)


def _torn_record(path: Path) -> bool:
    """Whether ``path`` holds only the start of a journal record torn by a crash during a
    run's first append (no whole line; it begins as a run's records do), which the journal's
    reader skips and its next append cuts: the job's own, not someone's file."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError:
        return False
    return b"\n" not in data and data.startswith((b'{"event": ', b'{"id": '))


def _check_others_files(out_dir: Path) -> None:
    """Refuse a folder holding a file of a job's names that no job of it wrote: a
    ``journal.jsonl`` that is no journal, or a job's file beside no journal at all (a
    user's own ``report.json`` would be replaced, their ``summaries.jsonl`` cut and
    appended to)."""
    journal = out_dir / JOURNAL
    size = journal.stat().st_size if journal.is_file() else 0
    if size and not is_job_folder(out_dir) and not _torn_record(journal):
        raise InputError(f"{journal}: is not an mlx-tier journal, and a run would append to it "
                         "(move the file, or choose another output folder)")
    if size or (out_dir / RANKS_DIR).exists():  # an empty journal (a crash before its first record) vouches for none
        return
    theirs = [name for name in _JOBS_OWN if (out_dir / name).exists()]
    if theirs:
        raise InputError(f"{out_dir / theirs[0]}: not written by an mlx-tier job ({out_dir} holds no job's {JOURNAL}), "
                         "and a run would replace it (move the file, or choose another output folder)")
