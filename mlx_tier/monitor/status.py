"""State of a job from outside: ``mlx-tier status OUT_DIR`` on a running or finished job.

Reads only files: ``journal.jsonl`` (a ``start`` record that
:func:`mlx_tier.job.run.run_job` appends when a run starts: its document ids, what
it set out to do, when, which process; then every finished or failed document,
with its figures and any ``throttled_seconds``), ``run.pid`` (``--background``)
and the output folder's lock. A run is *running* while another process holds the lock: probed with a
non-blocking shared ``flock``, released at once, so the probe never blocks a
run (a run starting in the same microseconds may find it held and refuse).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlx_tier.errors import InputError
from mlx_tier.outdir.journal import JobInfo, Journal
from mlx_tier.outdir.layout import (
    LOCK,
    PID_FILE,
    lock_held,
    pid_file_pid,
    progress_files,
)


def read_progress(out_dir: Path, since: float | None = None) -> dict | None:
    """The last progress snapshot of ``out_dir``: the freshest of its progress files, with
    the ``in_flight`` and ``writing`` lists of all of them (a distributed run's ranks)
    merged. A snapshot from before ``since`` (Unix seconds: the last run's start) was left
    by an earlier run and is ignored. ``None`` when none is left (absent, unreadable, old)."""
    snaps = []
    for path in progress_files(out_dir):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (since is None or (_number(data, "time") or 0.0) >= since):
            snaps.append(data)
    if len(snaps) <= 1:
        return snaps[0] if snaps else None
    merged = dict(max(snaps, key=lambda d: _number(d, "time") or 0.0))
    for key in ("in_flight", "writing"):
        merged[key] = [x for d in snaps if isinstance(d.get(key), list) for x in d[key]]
    return merged


def describe_throttle(change: dict) -> str:
    """A throttle state change (a ``thermal`` journal record) in plain words, e.g.
    ``"full speed from 0 s into the run: nothing limits it (thermal state: not
    reported by any sensor here; see `mlx-tier thermal`)"``."""
    mode, duty = change.get("mode"), change.get("duty")
    doing = {"full": "full speed", "paused": "paused"}.get(
        mode, f"slowed to {duty:.0%} of the time" if isinstance(duty, (int, float)) else str(mode))
    reason = change.get("reason") or ""
    why = "nothing limits it" if reason in ("", "nominal") else reason
    thermal = change.get("thermal")
    state = ("not reported by any sensor here; see `mlx-tier thermal`" if thermal in (None, "unknown")
             else str(thermal))
    return f"{doing} from {change.get('t', 0):.0f} s into the run: {why} (thermal state: {state})"


def read_pid(out_dir: Path) -> int | None:
    """The pid in ``run.pid`` (``--background``), else the one of the last ``start`` record."""
    pid = pid_file_pid(out_dir)
    if pid is None:
        info = JobInfo.last(list(Journal(out_dir).entries()))
        pid = info.pid if info is not None else None
    return pid


RUNNING, INTERRUPTED, STOPPED, FINISHED = "running", "interrupted", "stopped", "finished"


def job_state(running: bool, progress_left: bool, pending: int | None) -> str:
    """The job's state in one word, from its files.

    Args:
        running: a process holds the folder's lock.
        progress_left: a progress file of the last run exists (:func:`read_progress`).
            A run removes it when its generation loop ends (and any left behind when
            it takes the lock), so one left while no process holds the lock was
            written by a run that ended mid-work: a second Ctrl-C (stop at once),
            a kill or a crash.
        pending: documents of the job neither done nor failed (``None``: unknown).

    Returns:
        ``"running"``; ``"interrupted"`` (ended mid-work, see above);
        ``"stopped"`` (ended cleanly with documents left: a first Ctrl-C, or
        a rerun still to do); ``"finished"`` (nothing pending).
    """
    if running:
        return RUNNING
    if progress_left:
        return INTERRUPTED
    return FINISHED if pending == 0 else STOPPED


def _clock(t: float, now: float) -> str:
    """Local time of day, with the date when not today."""
    same_day = time.localtime(t)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", time.localtime(t))


def describe_state(status: JobStatus, now: float | None = None) -> str:
    """``status.state`` in plain words for ``mlx-tier status`` and the job page, e.g.
    ``"interrupted at 17:57:52: its process ended mid-run (a second Ctrl-C, a kill or a
    crash); 7 documents left"``."""
    now = time.time() if now is None else now
    left = f"{status.pending} document(s) left" if status.pending is not None else "documents left"
    if status.state == RUNNING:
        if (status.progress or {}).get("stopping"):
            return (f"stopping (pid {status.pid}): asked to stop; finishing the summaries being written, "
                    "then it ends")
        return f"running (pid {status.pid})"
    if status.state == INTERRUPTED:
        when = f" at {_clock(status.stopped_at, now)}" if status.stopped_at is not None else ""
        return f"interrupted{when}: its process ended mid-run (a second Ctrl-C, a kill or a crash); {left}"
    if status.state == STOPPED:
        return f"stopped, not running; {left}"
    return "finished, not running"


@dataclass(frozen=True)
class JobStatus:
    """A job's progress, from its files.

    Attributes:
        running: a run holds the folder's lock now.
        state: :func:`job_state`: ``running``, ``interrupted``, ``stopped`` or ``finished``.
        stopped_at: Unix seconds an interrupted run was last seen working (its
            ``progress.json``); ``None`` otherwise.
        pid: the (last) run's process id.
        total: documents in the job (``None``: no ``start`` record, an older run).
        done, failed: documents whose latest journal record says so.
        pending: ``total - done - failed`` (``None`` without ``total``).
        todo_left: documents this run set out to do and has not finished or failed yet.
        output_tokens: summed over finished documents' records.
        run_output_tokens: tokens generated by the (last) run.
        throttled_seconds: sum of ``throttled_seconds`` over all journal records (0 if none).
        thermal: the (last) run's throttle state changes, ``{"t", "thermal", "mode",
            "duty", "reason", "time"}`` records, oldest first.
        started: Unix seconds the (last) run started generating.
        elapsed_seconds: from ``started`` to now (running), to when it was last
            seen working (interrupted) or to its last record.
        finished_this_run: documents finished or failed since ``started``.
        eta_seconds: while running, the run's own estimate in ``progress.json``
            (:mod:`mlx_tier.job.eta`, from tokens left and rates measured) less the
            snapshot's age; without one (a run of an older version), ``todo_left``
            at this run's wall-clock rate; ``None`` when not running or not
            measured yet.
        command: the command that resumes the job (from the ``start`` record).
        failures: ``(id, error)`` of failed documents.
        progress: while running (and, for an interrupted run, as it was last
            written), ``progress.json``: ``in_flight`` ids, ``reading``
            ``[id, prompt tokens read, prompt length]`` or ``None``, ``writing``
            ``[[id, tokens so far], ...]``, ``decode_tok_s``, ``prompt_tok_s``,
            ``hit_rate``, ``time`` (Unix seconds it was written).
        warnings: journal lines skipped as unusable (``journal.jsonl:N: skipped (why)``).
    """

    out_dir: Path
    running: bool
    state: str
    stopped_at: float | None
    pid: int | None
    total: int | None
    done: int
    failed: int
    pending: int | None
    todo_left: int | None
    output_tokens: int
    run_output_tokens: int
    throttled_seconds: float
    started: float | None
    elapsed_seconds: float
    finished_this_run: int
    eta_seconds: float | None
    command: str | None
    failures: list[tuple[str, str]] = field(default_factory=list)
    thermal: list[dict] = field(default_factory=list)
    progress: dict | None = None  # the running job's last progress snapshot (:class:`ProgressFile`)
    warnings: list[str] = field(default_factory=list)

    @property
    def output_tok_per_s(self) -> float:
        """This run's output tokens per second of wall clock (documents of a batch overlap; 0 when none)."""
        return self.run_output_tokens / self.elapsed_seconds if self.elapsed_seconds else 0.0

    @property
    def documents_per_hour(self) -> float:
        """This run's wall-clock rate, throttle pauses included (0 when none)."""
        return self.finished_this_run / self.elapsed_seconds * 3600 if self.elapsed_seconds else 0.0

    def as_dict(self) -> dict:
        """JSON-ready fields (``mlx-tier status --json``), rates included."""
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["failures"] = [{"id": i, "error": e} for i, e in self.failures]
        return d | {"output_tok_per_s": round(self.output_tok_per_s, 3),
                    "documents_per_hour": round(self.documents_per_hour, 3)}


def _run_timing(this_run: list[dict], info: JobInfo | None, running: bool, now: float,
                progress: dict | None):
    """``(elapsed seconds, documents of its list left, ETA seconds or None)`` of the last run,
    from its finished or failed records ``this_run`` and its last ``progress`` snapshot."""
    started = info.started if info is not None else None
    seen = _number(progress, "time")  # when the run last reported its work
    if started is None:
        elapsed = 0.0
    elif running:
        elapsed = max(now - started, 0.0)
    else:
        last = max([r["time"] for r in this_run] + [seen or started, started])
        elapsed = max(last - started, 0.0)
    todo_left = None
    if info is not None:
        finished_ids = {r["id"] for r in this_run}
        todo_left = sum(i not in finished_ids for i in info.todo)
    eta = None
    if running and progress is not None and "eta_seconds" in progress:  # the run's own estimate
        left = _number(progress, "eta_seconds")
        eta = max(left - max(now - (seen or now), 0.0), 0.0) if left is not None else None
    elif running and this_run and elapsed > 0 and todo_left is not None:  # an older run: documents' pace
        eta = todo_left / (len(this_run) / elapsed)
    return elapsed, todo_left, eta


def _number(d: dict | None, key: str) -> float | None:
    value = (d or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_status(out_dir: Path, now: float | None = None) -> JobStatus:
    """The status of the job in ``out_dir``.

    Args:
        out_dir: a ``mlx-tier run`` output folder.
        now: Unix seconds to measure elapsed time against (default: the clock).

    Raises:
        InputError: ``out_dir`` is missing or holds no ``journal.jsonl`` (nor the
            lock or pid file of a run that is still loading its model).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise InputError(f"{out_dir}: no such folder")
    journal = Journal(out_dir)
    if not any((out_dir / name).exists() for name in (journal.path.name, LOCK, PID_FILE)):
        raise InputError(f"{out_dir}: not an mlx-tier output folder (no journal.jsonl)")
    now = time.time() if now is None else now
    entries = list(journal.entries())
    info = JobInfo.last(entries)
    latest = {rec["id"]: rec for rec in entries if "id" in rec}
    ids = info.ids if info is not None else list(latest)
    states = [latest.get(i, {}).get("status") for i in ids]
    done = [latest[i] for i, s in zip(ids, states) if s == "done"]
    failures = [(i, str(latest[i].get("error", ""))) for i, s in zip(ids, states) if s == "failed"]
    throttled = sum(r["throttled_seconds"] for r in entries if isinstance(r.get("throttled_seconds"), (int, float)))

    running = lock_held(out_dir)
    started = info.started if info is not None else None
    # read after the lock probe (a run ending now removes it first); one older than the last
    # start record is an earlier run's, not this one's
    progress = read_progress(out_dir, started)
    this_run = [r for r in latest.values() if started is not None and r.get("time", 0) >= started and "status" in r]
    elapsed, todo_left, eta = _run_timing(this_run, info, running, now, progress)
    pending = len(ids) - len(done) - len(failures) if info is not None else None
    state = job_state(running, progress is not None, pending)
    return JobStatus(
        out_dir=out_dir,
        running=running,
        state=state,
        stopped_at=_number(progress, "time") if state == INTERRUPTED else None,
        pid=read_pid(out_dir),
        total=len(ids) if info is not None else None,
        done=len(done),
        failed=len(failures),
        pending=pending,
        todo_left=todo_left,
        output_tokens=sum(int(r.get("output_tokens", 0)) for r in done),
        run_output_tokens=sum(int(r.get("output_tokens", 0)) for r in this_run if r.get("status") == "done"),
        throttled_seconds=round(float(throttled), 3),
        thermal=[r for r in entries if r.get("event") == "thermal" and r.get("time", 0) >= (started or 0)],
        started=started,
        elapsed_seconds=round(elapsed, 3),
        finished_this_run=len(this_run),
        eta_seconds=round(eta, 1) if eta is not None else None,
        command=info.command if info is not None else None,
        failures=failures,
        progress=progress if running or state == INTERRUPTED else None,
        warnings=list(journal.warnings.values()),
    )
