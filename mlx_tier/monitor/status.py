"""State of a job from outside: ``mlx-tier status OUT_DIR`` on a running or finished job.

Reads only files: ``journal.jsonl`` (a ``start`` record that
:func:`mlx_tier.job.run.run_job` appends when a run starts: its document ids, what
it set out to do, when, which process; then every finished or failed document,
with its figures and any ``throttled_seconds``), ``run.pid`` (``--background``)
and the output folder's lock. A run is *running* while another process holds the lock: probed with a
non-blocking shared ``flock``, released at once, so the probe never blocks a
run (a run starting in the same microseconds may find it held and refuse).

A run's records are found by its id (``run``), its durations and rates taken
on its monotonic clock (``run_t``; :mod:`mlx_tier.rates` defines the speeds), so a
step of the wall clock changes neither. Journals of older versions (no run
ids) are read as before: the run's records by wall time.
"""

from __future__ import annotations

import json
import shlex
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from mlx_tier.errors import InputError
from mlx_tier.fsio import current_folder
from mlx_tier.messages import in_request_words, plain_rerun
from mlx_tier.outdir.journal import JobInfo, Journal, prompt_texts, written_by
from mlx_tier.outdir.layout import (
    BATCH_ERRORS,
    BATCH_OUTPUT,
    LAST_PROGRESS,
    LOCK,
    PID_FILE,
    lock_held,
    lock_holder,
    pid_file_pid,
    progress_files,
)
from mlx_tier.rates import RunSpeed, generated_tokens
from mlx_tier.units import count_text, seconds_text


def read_progress(out_dir: Path, since: float | None = None, run: str | None = None) -> dict | None:
    """The last progress snapshot of ``out_dir``: the freshest of its progress files, with
    the ``in_flight`` and ``writing`` lists of all of them (a distributed run's ranks)
    merged. A snapshot of another run than ``run`` (the last run's id) was left by an
    earlier run and is ignored; one without a run id (an older version), when from before
    ``since`` (Unix seconds: the last run's start). ``None`` when none is left (absent,
    unreadable, an earlier run's)."""
    snaps = []
    for path in progress_files(out_dir):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and _of_run(data, since, run):
            snaps.append(data)
    if len(snaps) <= 1:
        return snaps[0] if snaps else None
    merged = dict(max(snaps, key=lambda d: _number(d, "time") or 0.0))
    for key in ("in_flight", "writing"):
        merged[key] = [x for d in snaps if isinstance(d.get(key), list) for x in d[key]]
    # every rank's prompts being read: the freshest one's "reading", the others beside it
    merged["also_reading"] = [r for d in snaps for r in [d.get("reading"), *(d.get("also_reading") or [])]
                              if isinstance(r, list) and r and r != merged.get("reading")]
    return merged


def _without(snapshot: dict | None, finished: set[str]) -> dict | None:
    """A progress snapshot without the documents the journal says are finished: the run
    rewrites it every few seconds, and a document done since the last write is no longer
    waiting, read or written."""
    if snapshot is None or not finished:
        return snapshot
    snapshot = dict(snapshot)
    if isinstance(snapshot.get("in_flight"), list):
        snapshot["in_flight"] = [i for i in snapshot["in_flight"] if i not in finished]
    if isinstance(snapshot.get("writing"), list):
        snapshot["writing"] = [w for w in snapshot["writing"] if not (isinstance(w, list) and w and w[0] in finished)]
    reading = snapshot.get("reading")
    if isinstance(reading, list) and reading and reading[0] in finished:
        snapshot["reading"] = None
    if isinstance(snapshot.get("also_reading"), list):
        snapshot["also_reading"] = [r for r in snapshot["also_reading"] if isinstance(r, list) and r
                                    and r[0] not in finished]
    return snapshot


def _of_run(snapshot: dict, since: float | None, run: str | None) -> bool:
    """Whether a progress snapshot is the run's: by its id when both have one, else by wall time."""
    if run is not None and isinstance(snapshot.get("run"), str):
        return snapshot["run"] == run
    return since is None or (_number(snapshot, "time") or 0.0) >= since


def snapshot_age(snapshot: dict, now: float, now_mono: float) -> float:
    """Seconds since a progress snapshot was written: on the monotonic clock when it was
    written on this machine (``mono``, ``host``), else by wall time, never negative."""
    mono = _number(snapshot, "mono")
    if mono is not None and snapshot.get("host") == socket.gethostname() and now_mono >= mono:
        return now_mono - mono
    return max(now - (_number(snapshot, "time") or now), 0.0)


def estimate_age(snapshot: dict, now: float, now_mono: float) -> float:
    """Seconds since a progress snapshot's rates and ETA were measured: its age
    (:func:`snapshot_age`) plus how long before its write they were measured (``mono`` less
    ``measured_mono``, both the writer's monotonic clock: an update sent again during a long
    step rewrites the last step's estimate)."""
    mono, measured = _number(snapshot, "mono"), _number(snapshot, "measured_mono")
    before = mono - measured if mono is not None and measured is not None and mono >= measured else 0.0
    return snapshot_age(snapshot, now, now_mono) + before


def describe_throttle(change: dict) -> str:
    """A throttle state change (a ``thermal`` journal record) in plain words, e.g.
    ``"full speed from 59.5 s into the run: nothing limits it (thermal state: not
    reported by any sensor here; see `mlx-tier thermal`)"``."""
    mode, duty, cap = change.get("mode"), change.get("duty"), change.get("max_tok_s")
    full = f"capped at {cap:g} tok/s" if isinstance(cap, (int, float)) else "full speed"
    doing = {"full": full, "paused": "paused"}.get(
        mode, f"slowed to {duty:.0%} of the time" if isinstance(duty, (int, float)) else str(mode))
    reason = change.get("reason") or ""
    nothing = "`max_tok_s`" if isinstance(cap, (int, float)) else "nothing limits it"
    why = nothing if reason in ("", "nominal") else reason
    thermal = change.get("thermal")
    state = ("not reported by any sensor here; see `mlx-tier thermal`" if thermal in (None, "unknown")
             else str(thermal))
    at = change.get("run_t", change.get("t", 0))  # the run's clock; ``t`` counts from the throttle's first step
    return f"{doing} from {seconds_text(at)} into the run: {why} (thermal state: {state})"


def read_pid(out_dir: Path) -> int | None:
    """The pid in ``run.pid`` (``--background``), else the one of the last ``start`` record."""
    return _pid(out_dir, JobInfo.last(list(Journal(out_dir).entries())))


def _pid(out_dir: Path, info: JobInfo | None) -> int | None:
    """:func:`read_pid` with the last ``start`` record (``info``) already read."""
    pid = pid_file_pid(out_dir)
    return pid if pid is not None else info.pid if info is not None else None


RUNNING, INTERRUPTED, STOPPED, ENDED, FINISHED = "running", "interrupted", "stopped", "ended", "finished"
STARTING = "starting"  # a run holds the lock and has not started generating yet (:func:`starting_run`)


def starting_run(holder: dict | None, info: JobInfo | None) -> bool:
    """Whether the run holding the lock (``holder``: :func:`~mlx_tier.outdir.layout.lock_holder`)
    is still finding its documents and loading its model: it took the lock after the last
    ``start`` record (``info``) was written, on the same machine's clock, or no run has
    started yet. A run writes its ``start`` record once its model is loaded, so until then
    the last one is an earlier run's. ``False`` when unknown (a lock of an older version,
    a start record of another host: a distributed run's rank)."""
    if holder is None:
        return False
    if info is None:
        return True
    return holder.get("host") == info.host and holder["time"] > info.started


def job_state(running: bool, progress_left: bool, pending: int | None, todo_left: int | None = None) -> str:
    """The job's state in one word, from its files.

    Args:
        running: a process holds the folder's lock.
        progress_left: a progress file of the last run exists (:func:`read_progress`).
            A run removes it when its generation loop ends (and any left behind when
            it takes the lock), so one left while no process holds the lock was
            written by a run that ended mid-work: a second Ctrl-C (stop at once),
            a kill or a crash.
        pending: documents of the job neither done nor failed (``None``: unknown).
        todo_left: documents the last run set out to do and neither finished nor
            failed (``None``: unknown).

    Returns:
        ``"running"``; ``"interrupted"`` (ended mid-work, see above);
        ``"stopped"`` (ended cleanly with documents of its own left: a first
        Ctrl-C, a full disk); ``"ended"`` (the run tried every document it set
        out to, yet others are pending: a ``--retry-failed`` run tries failed
        documents only and leaves pending ones for a plain rerun);
        ``"finished"`` (nothing pending).
    """
    if running:
        return RUNNING
    if progress_left:
        return INTERRUPTED
    if pending == 0:
        return FINISHED
    return ENDED if todo_left == 0 and pending else STOPPED


def _clock(t: float, now: float) -> str:
    """Local time of day, with the date when not today."""
    same_day = time.localtime(t)[:3] == time.localtime(now)[:3]
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", time.localtime(t))


def describe_state(status: JobStatus, now: float | None = None) -> str:
    """``status.state`` in plain words for ``mlx-tier status`` and the job page, e.g.
    ``"interrupted at 17:57:52: its process ended mid-run (a second Ctrl-C, a kill or a
    crash); 7 documents left"``."""
    now = time.time() if now is None else now
    noun = status.noun
    left = f"{count_text(status.pending, noun)} left" if status.pending is not None else f"{noun}s left"
    if status.state == STARTING:
        return (f"starting (pid {status.pid}): finding the {noun}s and loading the model"
                + ("; the figures below are of the run before it" if status.started is not None else ""))
    if status.state == RUNNING:
        progress = status.progress or {}
        if progress.get("stopping"):
            return (f"stopping (pid {status.pid}): asked to stop; finishing the summaries being written for a "
                    "few seconds at most, then it ends")
        busy = progress.get("busy_seconds")  # the run's heartbeat during a long step (mlx_tier.job.heartbeat)
        return f"running (pid {status.pid})" + (f"; its current step has run {busy:.0f} s" if busy else "")
    if status.state == INTERRUPTED:
        when = f" at {_clock(status.stopped_at, now)}" if status.stopped_at is not None else ""
        return f"interrupted{when}: its process ended mid-run (a second Ctrl-C, a kill or a crash); {left}"
    if status.state == STOPPED:
        return f"stopped, not running; {left}"
    if status.state == ENDED:
        return (f"ended with {count_text(status.pending, noun)} pending, not running: the last run tried "
                f"failed {noun}s only (--retry-failed); a plain rerun "
                f"{'answers' if noun == 'request' else 'summarises'} {'it' if status.pending == 1 else 'them'}")
    return "finished, not running"


class Failure(NamedTuple):
    """A failed document as `status` shows it: its ``error`` names settings in backquotes
    (`max_tokens`: the terminal shows flags); a batch request's (``request``) names the
    field of its body instead (```max_tokens` of request <id>``: no flag)."""

    id: str
    error: str
    request: bool = False


def _from_here(command: str | None, cwd: str | None) -> str | None:
    """``command`` as it runs from this process's folder: after ``cd CWD &&`` when it was
    given in another (``cwd``; ``None``: not recorded) and may name paths relative to it."""
    if not command or not cwd or cwd == current_folder():
        return command
    return f"cd {shlex.quote(cwd)} && {command}"


def _failure(doc_id: str, rec: dict) -> Failure:
    error, code = str(rec.get("error", "")), rec.get("error_code")
    if code is None:
        return Failure(doc_id, error)
    param = rec.get("error_param")
    return Failure(doc_id, in_request_words(error, param if isinstance(param, str) else None,
                                            str(rec.get("name") or doc_id)), True)


@dataclass(frozen=True)
class JobStatus:
    """A job's progress, from its files.

    Attributes:
        running: a run holds the folder's lock now.
        state: :func:`job_state`: ``running``, ``interrupted``, ``stopped``, ``ended`` or ``finished``;
            or ``starting`` (:func:`starting_run`).
        stopped_at: Unix seconds an interrupted run was last seen working (its
            ``progress.json``); ``None`` otherwise.
        pid: the (last) run's process id.
        total: documents in the job (``None``: no ``start`` record, an older run).
        done, failed: documents whose latest journal record says so (a ``done`` one the
            last run set out to redo counts once that run wrote it: ``redoing``).
        pending: ``total - done - failed`` (``None`` without ``total``).
        noun: what the job's items are: ``"document"``, or ``"request"`` for a batch request
            file's (``output.jsonl`` or ``errors.jsonl`` exists).
        redoing: documents the last run set out to redo (source or settings changed) and
            has not written: their earlier summary is stale (or their failure, when a plain
            run retries one whose source changed), they are pending.
        todo_left: documents this run set out to do and has not finished or failed yet.
        output_tokens: summed over finished documents' records.
        run_output_tokens: tokens generated by the (last) run.
        throttled_seconds: the last run's time slowed, paused or capped by the throttle: the
            ``throttled_seconds`` of its records (0 if none), as its other figures are its own.
        thermal: the (last) run's throttle state changes, ``{"t", "thermal", "mode",
            "duty", "reason", "time"}`` records, oldest first.
        started: Unix seconds the (last) run started generating (for people).
        elapsed_seconds: the run's generation time (:mod:`mlx_tier.rates`): from its
            model loaded to now (running), to when it was last seen working
            (interrupted) or to its last document; monotonic (a journal of an older
            version: by wall time).
        load_seconds: the run's loading time (``None``: not recorded).
        finished_this_run: documents finished or failed by the (last) run.
        done_this_run: documents it finished (the documents/hour count these).
        redone_stale, redone_changed: summaries it rewrote because their document
            changed, or (asked to) because they were written with other settings.
        eta_seconds: while running, the run's own estimate in ``progress.json``
            (:mod:`mlx_tier.job.eta`, from tokens left and rates measured) less the
            estimate's age (:func:`estimate_age`); without one (a run of an older
            version), ``todo_left`` at this run's pace; ``None`` when not running or
            not measured yet.
        command: the command that resumes the job: the ``start`` record's, never with
            ``--retry-failed`` (:func:`mlx_tier.messages.plain_rerun`; the command
            that retries failed documents is :func:`mlx_tier.messages.retry_command`'s),
            after ``cd FOLDER &&`` when it was given in another folder than this one.
        failures: ``(id, error, request)`` of failed documents (:class:`Failure`).
        written_by: the models and prompts the job's summaries were written with
            (:func:`mlx_tier.outdir.journal.written_by`); more than one: a mix.
        prompts: prompt hash -> instruction text (the runs' start records).
        progress: while running (and, for an interrupted run, as it was last
            written), ``progress.json``: ``in_flight`` ids, ``reading``
            ``[id, prompt tokens read, prompt length]`` or ``None``, ``writing``
            ``[[id, tokens so far], ...]``, ``decode_tok_s``, ``prompt_tok_s``,
            ``hit_rate``, ``time`` (Unix seconds it was written).
        warnings: journal lines skipped as unusable (``journal.jsonl:N: skipped (why)``).
        no_model: the last run loaded no model (every document it tried failed as it was
            read: empty, unreadable); its speeds are none.
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
    failures: list[Failure] = field(default_factory=list)
    thermal: list[dict] = field(default_factory=list)
    progress: dict | None = None  # the running job's last progress snapshot (:class:`ProgressFile`)
    warnings: list[str] = field(default_factory=list)
    load_seconds: float | None = None
    done_this_run: int = 0
    redone_stale: int = 0
    redone_changed: int = 0
    written_by: list[dict] = field(default_factory=list)
    prompts: dict[str, str] = field(default_factory=dict)
    redoing: list[str] = field(default_factory=list)
    noun: str = "document"  # "request": a batch request file's job (its answers file exists)
    idle_rerun: bool = False  # the last run had nothing to generate: "this run" figures are of the one before
    starting: bool = False  # a run is loading (state STARTING): "this run" figures are of the one before
    no_model: bool = False  # the last run loaded no model: each document it tried failed as it was read (empty...)

    @property
    def speed(self) -> RunSpeed:
        """This run's speeds (:mod:`mlx_tier.rates`)."""
        return RunSpeed(self.run_output_tokens, self.done_this_run, self.elapsed_seconds, self.load_seconds)

    @property
    def output_tok_per_s(self) -> float:
        """This run's output tokens per second of generation (:mod:`mlx_tier.rates`; 0 when none)."""
        return self.speed.output_tok_per_s

    @property
    def documents_per_hour(self) -> float:
        """This run's documents summarised per hour of generation (:mod:`mlx_tier.rates`; 0 when none)."""
        return self.speed.documents_per_hour

    def as_dict(self) -> dict:
        """JSON-ready fields (``mlx-tier status --json``), rates included."""
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["failures"] = [{"id": f.id, "error": f.error} for f in self.failures]
        return d | {"output_tok_per_s": self.output_tok_per_s, "documents_per_hour": self.documents_per_hour}


@dataclass(frozen=True)
class _Clocks:
    """When status is read: wall (Unix seconds) and monotonic (this machine's ``time.monotonic()``)."""

    wall: float
    mono: float


def _this_run(latest: dict[str, dict], info: JobInfo | None) -> list[dict]:
    """The document records the last run wrote itself (not the summaries it recovered or
    reused): by its id; in a journal of an older version (no run ids), by wall time."""
    if info is None:
        return []
    if info.run is not None:
        return [r for r in latest.values() if r.get("run") == info.run and "status" in r
                and not r.get("recovered") and "reused" not in r]
    return [r for r in latest.values() if r.get("time", 0) >= info.started and "status" in r]


def _run_clock_now(info: JobInfo, progress: dict | None, clocks: _Clocks) -> float | None:
    """The run's clock (seconds since it started) now: from its start record's monotonic
    reading when read on the same machine, else from its last progress snapshot."""
    if info.mono is not None and info.run_t is not None and info.host == socket.gethostname() \
            and clocks.mono >= info.mono:
        return info.run_t + clocks.mono - info.mono
    t = _number(progress, "run_t")
    return t + snapshot_age(progress, clocks.wall, clocks.mono) if t is not None else None


def _generation_seconds(this_run: list[dict], entries: list[dict], info: JobInfo, running: bool,
                        progress: dict | None, clocks: _Clocks, complete: bool = False) -> float:
    """The run's generation time (:mod:`mlx_tier.rates`) on its monotonic clock ``run_t``: from its
    model loaded (its start record, or its ranks' ``loaded`` records) to now (running), to
    its last document (``complete``: every document of its list finished, as the run's
    report counts it), or to the latest of that, its ``stopped`` record (a first signal)
    and its last progress (a hard stop: its snapshot, or the ``last_progress`` record a
    later run kept of it)."""
    def clock(event: str) -> list[float]:  # this run's (or its ranks') records of an event, on its clock
        return [r["run_t"] for r in entries if r.get("event") == event and r.get("run") == info.run
                and isinstance(r.get("run_t"), (int, float))]

    loaded = clock("loaded")
    load_t = min(loaded) if loaded else info.run_t
    if running:
        now = _run_clock_now(info, progress, clocks)
    else:  # a clean stop removed its progress: its "stopped" record dates the stop
        last = [r["run_t"] for r in this_run if isinstance(r.get("run_t"), (int, float))]
        now = max(last if complete and last else last + clock("stopped") + clock(LAST_PROGRESS)
                  + [_number(progress, "run_t") or load_t])
    return max((now if now is not None else load_t) - load_t, 0.0)


def _load_seconds(entries: list[dict], info: JobInfo | None) -> float | None:
    """The last run's loading time on its clock: to its model loaded (its start record's
    ``run_t``; a distributed run's launcher starts before its ranks load: to the last rank's
    ``loaded`` record, as report.json counts it); ``None`` when not recorded (an older
    version's run). Its generation time starts at the first rank's (:func:`_generation_seconds`)."""
    if info is None or info.run is None or info.run_t is None:
        return None
    loaded = [r["run_t"] for r in entries if r.get("event") == "loaded" and r.get("run") == info.run
              and isinstance(r.get("run_t"), (int, float))]
    return max(loaded) if loaded else info.run_t


def _wall_seconds(this_run: list[dict], info: JobInfo, running: bool, progress: dict | None, now: float) -> float:
    """A run of an older version (no monotonic clock in its records): its time by wall clock."""
    seen = _number(progress, "time")  # when the run last reported its work
    if running:
        return max(now - info.started, 0.0)
    last = max([r["time"] for r in this_run] + [seen or info.started, info.started])
    return max(last - info.started, 0.0)


def _run_timing(this_run: list[dict], entries: list[dict], info: JobInfo | None, running: bool,
                progress: dict | None, clocks: _Clocks):
    """``(generation seconds, documents of its list left, ETA seconds or None)`` of the last run,
    from its finished or failed records ``this_run`` and its last ``progress`` snapshot."""
    if info is None:
        return 0.0, None, None
    finished_ids = {r["id"] for r in this_run}
    todo_left = sum(i not in finished_ids for i in info.todo)
    if info.run is not None and info.run_t is not None:
        elapsed = _generation_seconds(this_run, entries, info, running, progress, clocks, complete=not todo_left)
    else:
        elapsed = _wall_seconds(this_run, info, running, progress, clocks.wall)
    eta = None
    if running and progress is not None and "eta_seconds" in progress:  # the run's own estimate
        left = _number(progress, "eta_seconds")
        eta = max(left - estimate_age(progress, clocks.wall, clocks.mono), 0.0) if left is not None else None
    elif running and this_run and elapsed > 0:  # an older run: documents' pace
        eta = todo_left / (len(this_run) / elapsed)
    return elapsed, todo_left, eta


def _number(d: dict | None, key: str) -> float | None:
    value = (d or {}).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _journal_of(out_dir: Path) -> Journal:
    """The journal of the job in ``out_dir``. Raises InputError: not a job's output folder
    (:func:`read_status`)."""
    if not out_dir.is_dir():
        raise InputError(f"{out_dir}: is a file, not a job's output folder" if out_dir.exists()
                         else f"{out_dir}: no such folder")
    journal = Journal(out_dir)
    if not any((out_dir / name).exists() for name in (journal.path.name, LOCK, PID_FILE)):
        raise InputError(f"{out_dir}: not an mlx-tier output folder (no journal.jsonl)")
    return journal


def _last_start(entries: list[dict]) -> int:
    """Index of the last ``start`` record in ``entries`` (-1: none)."""
    return max((k for k, r in enumerate(entries) if r.get("event") == "start"), default=-1)


def _as_triaged(info: JobInfo | None, entries: list[dict]) -> tuple[JobInfo | None, bool]:
    """``(info, idle)``: the last run's ``start`` record ``info`` with the job's documents as
    the last run saw them, and whether that run had nothing to generate: such a run writes no
    start but a ``triaged`` record (``ids``, an empty ``todo``: a document added and copied,
    renamed or deleted since, a redo left by a stopped run that a plain run keeps)."""
    if info is None:
        return None, False
    start = _last_start(entries)
    later = [r for r in entries[start + 1:] if r.get("event") == "triaged"]
    if later and isinstance(later[-1].get("ids"), list):
        return replace(info, ids=later[-1]["ids"], todo=[]), True
    return info, False


def _throttled_seconds(entries: list[dict], info: JobInfo | None) -> float:
    """Seconds the last run was throttled or paused, from its records' ``throttled_seconds``."""
    return round(float(sum(r["throttled_seconds"] for r in _run_records(entries, info)
                           if isinstance(r.get("throttled_seconds"), (int, float)))), 3)


def _partial_tokens(entries: list[dict], info: JobInfo | None) -> int:
    """Tokens the last run wrote for long documents it stopped before finishing (its
    ``stopped`` record's ``partial_tokens``): in its speeds, as in report.json's."""
    return sum(int(r["partial_tokens"]) for r in _run_records(entries, info)
               if r.get("event") == "stopped" and isinstance(r.get("partial_tokens"), int))


def _run_records(entries: list[dict], info: JobInfo | None) -> list[dict]:
    """The records the last run (``info``: its start) wrote: by its id; in a journal of an
    older version (no run ids), those after its start record."""
    if info is None:
        return []
    if info.run is not None:
        return [r for r in entries if r.get("run") == info.run]
    start = _last_start(entries)
    return entries[start + 1:]


def job_ids(entries: list[dict]) -> list[str] | None:
    """The job's documents as the last run saw them (its ``start`` or ``triaged`` record), or
    ``None`` when no run has recorded them."""
    rec = next((r for r in reversed(entries) if r.get("event") in ("start", "triaged")), None)
    return rec["ids"] if rec is not None and isinstance(rec.get("ids"), list) else None


def _redoing(entries: list[dict], latest: dict[str, dict], info: JobInfo | None, ran: set[int]) -> set[str]:
    """Documents the last run set out to redo (their source or settings changed) and has not
    written: pending, their earlier summary not done (a stopped redo left it stale). A record
    after that run's start is no earlier summary (a later run with nothing to do copied it);
    ``ran``: ``id()`` of the run's own records."""
    if info is None:
        return set()
    start = _last_start(entries)
    since = {id(r) for r in entries[start + 1:]}
    return {i for i in info.todo if i in latest and id(latest[i]) not in ran and id(latest[i]) not in since}


def _left_stale(entries: list[dict], latest: dict[str, dict]) -> set[str]:
    """Documents the last run (its ``start`` or ``triaged`` record) left for a plain rerun
    though summarised (``left``: a ``--retry-failed`` run's stale ones) and not written
    since: pending, their summary of an earlier text."""
    at = next((n for n in range(len(entries) - 1, -1, -1) if entries[n].get("event") in ("start", "triaged")), None)
    if at is None or not isinstance(entries[at].get("left"), list):
        return set()
    before = {id(r) for r in entries[:at]}
    return {i for i in entries[at]["left"] if isinstance(i, str) and i in latest and id(latest[i]) in before}


def read_status(out_dir: Path, now: float | None = None, now_mono: float | None = None) -> JobStatus:
    """The status of the job in ``out_dir`` (:func:`status_and_journal`'s, alone)."""
    return status_and_journal(out_dir, now, now_mono)[0]


def _journal_and_lock(journal: Journal, out_dir: Path) -> tuple[list[dict], bool]:
    """The journal's records and whether a run holds the folder's lock, agreeing: the lock
    probed before and after the read, and the journal read again when the run ended in
    between (its last records are there now: not "stopped, 1 document left")."""
    was_running = lock_held(out_dir)
    entries = list(journal.entries())
    running = lock_held(out_dir)
    return (list(journal.entries()) if was_running and not running else entries), running


def status_and_journal(out_dir: Path, now: float | None = None,
                       now_mono: float | None = None) -> tuple[JobStatus, list[dict]]:
    """The status of the job in ``out_dir``, and the journal's records it was read from (a
    page built from both never shows two readings of a journal a run is writing).

    Args:
        out_dir: a ``mlx-tier run`` output folder.
        now: Unix seconds now (default: the clock), for the age of what only wall
            times date.
        now_mono: ``time.monotonic()`` now (default: the clock): a run on this machine
            is timed on it.

    Raises:
        InputError: ``out_dir`` is missing or holds no ``journal.jsonl`` (nor the
            lock or pid file of a run that is still loading its model).
    """
    out_dir = Path(out_dir)
    journal = _journal_of(out_dir)
    clocks = _Clocks(time.time() if now is None else now, time.monotonic() if now_mono is None else now_mono)
    entries, running = _journal_and_lock(journal, out_dir)
    info, idle = _as_triaged(JobInfo.last(entries), entries)
    holder = lock_holder(out_dir) if running else None
    starting = running and starting_run(holder, info)  # the figures are of the run before it
    latest = {rec["id"]: rec for rec in entries if "id" in rec}
    ids = info.ids if info is not None else list(latest)
    this_run = _this_run(latest, info)
    ran = {id(r) for r in this_run}
    redoing = _redoing(entries, latest, info, ran) | _left_stale(entries, latest)
    states = [latest.get(i, {}).get("status") for i in ids]
    done = [latest[i] for i, s in zip(ids, states) if s == "done" and i not in redoing]
    # a failed document a plain run set out to retry (its source changed) is pending until tried
    retried = redoing if info is not None and info.retry_failed is False else set()
    failures = [_failure(i, latest[i]) for i, s in zip(ids, states) if s == "failed" and i not in retried]
    started = info.started if info is not None else None
    # read after the lock probe (a run ending now removes it first); one of an earlier run is not this one's
    progress = read_progress(out_dir, started, info.run if info is not None else None) if not starting else None
    progress = _without(progress, {i for i, r in latest.items() if id(r) in ran})
    mine = [r for r in this_run if r.get("status") == "done"]
    elapsed, todo_left, eta = _run_timing(this_run, entries, info, running and not starting, progress, clocks)
    pending = len(ids) - len(done) - len(failures) if info is not None else None
    state = STARTING if starting else job_state(running, progress is not None, pending, todo_left)
    status = JobStatus(
        out_dir=out_dir,
        running=running,
        state=state,
        stopped_at=_number(progress, "time") if state == INTERRUPTED else None,
        pid=holder["pid"] if starting else _pid(out_dir, info),
        total=len(ids) if info is not None else None,
        done=len(done),
        failed=len(failures),
        pending=pending,
        todo_left=todo_left,
        output_tokens=sum(int(r.get("output_tokens", 0)) for r in done),
        run_output_tokens=sum(map(generated_tokens, mine)) + _partial_tokens(entries, info),
        throttled_seconds=_throttled_seconds(entries, info),
        thermal=_thermal(entries, info),
        started=started,
        elapsed_seconds=round(elapsed, 3),
        finished_this_run=len(this_run),
        eta_seconds=round(eta, 1) if eta is not None else None,
        command=_from_here(plain_rerun(info.command), info.cwd) if info is not None else None,
        failures=failures,
        progress=progress if running or state == INTERRUPTED else None,
        warnings=list(journal.warnings.values()),
        load_seconds=_load_seconds(entries, info),
        done_this_run=len(mine),
        redone_stale=sum(r.get("redo") == "stale" for r in mine),
        redone_changed=sum(r.get("redo") == "changed" for r in mine),
        written_by=written_by(done),
        prompts=prompt_texts(entries),
        redoing=[i for i in ids if i in redoing and (latest[i].get("status") == "done" or i in retried)],
        noun="request" if any((out_dir / name).exists() for name in (BATCH_OUTPUT, BATCH_ERRORS)) else "document",
        idle_rerun=idle and not starting,  # a run loading now is "this run", not the idle one before it
        starting=starting,
        # a start record of this version (``reports``) names the model it loaded; a run that loaded none names none
        no_model=info is not None and info.reports is True and info.model is None and bool(info.todo) and not idle,
    )
    return status, entries


def _thermal(entries: list[dict], info: JobInfo | None) -> list[dict]:
    """The last run's throttle state changes: by its id (an older journal: by wall time)."""
    if info is not None and info.run is not None:
        return [r for r in entries if r.get("event") == "thermal" and r.get("run") == info.run]
    started = info.started if info is not None else 0
    return [r for r in entries if r.get("event") == "thermal" and r.get("time", 0) >= started]
