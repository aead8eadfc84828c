"""The resumable side of benches/peers.py: results folder, plan, time limit, progress.

A seed-caliber pass (9 rounds x 5 engines x 256 tokens under a 2 GiB cap)
takes hours on a shared machine, longer than one sitting. So:
- ``OUT/plan.json`` holds the fingerprint of the command (checkpoint, prompt
  ids, tokens, cap, caliber, engines, limit, ...); a rerun with another
  fingerprint is refused (``Mismatch``), the same one continues.
- ``OUT/runs.jsonl`` gets one line per finished run, appended and fsynced at
  once; a line cut short by a crash is ignored. Ctrl-C loses only the run in
  flight. The table and headline are computed from this file alone.
- The plan is the interleaved order of ``(round, engine, temperature)``
  slots; a rerun skips the slots recorded and continues in the same order.
- An engine whose first recorded run was OOM-killed or stopped at the
  per-run limit is dropped: its later slots are not run (``dropped``).
- ``watch`` runs one worker process with a time limit, reading its JSON events
  as they come, and calls back every second for the progress line.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PLAN_FILE, RUNS_FILE = "plan.json", "runs.jsonl"


class Mismatch(ValueError):
    """``OUT`` holds runs of another command; the message is one line naming what differs."""


# ------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Slot:
    """One planned run: its place in the interleaved order (0-based ``index``)."""

    index: int
    round: int
    engine: str
    temp: str


def slots(engines: tuple[str, ...], temps: tuple[str, ...], rounds: int) -> list[Slot]:
    """Every run of the pass in order: round r runs every engine, the order rotated by r, each per temperature."""
    out: list[Slot] = []
    for r in range(rounds):
        k = r % len(engines)
        for e in engines[k:] + engines[:k]:
            for t in temps:
                out.append(Slot(len(out), r, e, t))
    return out


def is_bound(run: dict) -> bool:
    """Whether ``run`` was stopped at the per-run time limit (so it measured only a bound)."""
    return run["outcome"].startswith("over")


def dropped(recorded: list[dict]) -> dict[str, str]:
    """Engines not run again: ``{engine: why}`` for those whose first recorded run was OOM-killed or over the limit.

    Args:
        recorded: run dicts with ``slot`` (plan index), ``engine``, ``outcome``.
    """
    first: dict[str, dict] = {}
    for run in sorted(recorded, key=lambda r: r["slot"]):
        first.setdefault(run["engine"], run)
    return {e: ("OOM-killed" if r["outcome"].startswith("OOM") else "over the limit")
            for e, r in first.items() if r["outcome"].startswith("OOM") or is_bound(r)}


def pending(plan: list[Slot], recorded: list[dict]) -> list[Slot]:
    """The slots still to run: not recorded, and not of a dropped engine."""
    done = {r["slot"] for r in recorded}
    gone = dropped(recorded)
    return [s for s in plan if s.index not in done and s.engine not in gone]


def estimate_s(todo: list[Slot], recorded: list[dict], limit_s: float) -> tuple[float, float]:
    """Wall time of ``todo``, seconds: ``(expected, at_most)``.

    ``at_most`` = runs x limit (each run is stopped there). ``expected`` uses
    each engine's median recorded wall time, the limit for an engine not yet
    recorded.
    """
    walls: dict[str, list[float]] = {}
    for r in recorded:
        if r.get("wall_s") is not None:
            walls.setdefault(r["engine"], []).append(r["wall_s"])
    expected = sum(min(statistics.median(walls[s.engine]), limit_s) if s.engine in walls else limit_s
                   for s in todo)
    return expected, len(todo) * limit_s


def duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.4 h``: a span, short."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 6000:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def clock(seconds: float) -> str:
    """``1:02:09``: elapsed time, hours:minutes:seconds."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# ------------------------------------------------------------ results folder
def open_results(out: Path, fingerprint: dict) -> list[dict]:
    """Make or reopen ``out``; the runs already recorded there.

    Raises:
        Mismatch: ``out`` was made by a command with another fingerprint.
    """
    plan = out / PLAN_FILE
    if plan.is_file():
        stored = json.loads(plan.read_text())["fingerprint"]
        if stored != fingerprint:
            key = next(k for k in sorted(set(stored) | set(fingerprint)) if stored.get(k) != fingerprint.get(k))
            raise Mismatch(f"{out} holds runs of another command ({key}: {_short(stored.get(key))} there, "
                           f"{_short(fingerprint.get(key))} here); rerun it as before or use another --out")
        return load_runs(out)
    out.mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps({"fingerprint": fingerprint}, indent=1))
    return []


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:21] + "..."


def save_meta(out: Path, meta: dict) -> None:
    """Store what the report needs besides the runs (caliber header, notes) in ``plan.json``."""
    plan = out / PLAN_FILE
    data = json.loads(plan.read_text())
    data["meta"] = meta
    plan.write_text(json.dumps(data, indent=1, default=str))


def load_plan(out: Path) -> dict:
    """``plan.json`` of ``out``: ``fingerprint`` and, once a run started, ``meta``."""
    return json.loads((out / PLAN_FILE).read_text())


def load_runs(out: Path) -> list[dict]:
    """The runs recorded in ``out``, in file order; a last line cut short (killed mid-write) is skipped."""
    path = out / RUNS_FILE
    if not path.is_file():
        return []
    runs = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            runs.append(json.loads(line))
    return runs


def append_run(out: Path, run: dict) -> None:
    """Append one finished run to ``out/runs.jsonl`` and flush it to disk before returning.

    A last line cut short by a crash is ended first, so it cannot swallow this one.
    """
    path = out / RUNS_FILE
    cut = False
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            cut = fh.read(1) != b"\n"
    with open(path, "a") as fh:
        fh.write(("\n" if cut else "") + json.dumps(run, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


# ---------------------------------------------------------- one watched run
@dataclass
class Watched:
    """What ``watch`` saw of one process.

    Attributes:
        events: its JSON events (stdout lines that parse), in order.
        stderr: its standard error.
        stopped: it was killed at the time limit.
        wall_s: seconds from start to exit (or kill).
        decode_s: seconds from its first token (as seen here) to exit or kill;
            ``None`` when no token came.
    """

    events: list[dict]
    stderr: str
    stopped: bool
    wall_s: float
    decode_s: float | None


def watch(cmd: list[str], limit_s: float, tick: Callable[[float, dict], None], cwd: Path | None = None,
          on_start: Callable[[int], None] = lambda pid: None) -> tuple[Watched, int]:
    """Run ``cmd``, stopping it after ``limit_s`` seconds; ``(what it did, exit code)``.

    ``tick(elapsed_s, last_event)`` is called about once a second while it
    runs. On KeyboardInterrupt the process is killed and the interrupt raised.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    on_start(proc.pid)
    events: list[dict] = []
    err: list[str] = []
    first_token: list[float] = []
    t0 = time.monotonic()

    def read_out() -> None:
        for line in proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
                if not first_token and events[-1].get("phase") == "progress":
                    first_token.append(time.monotonic())

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)]
    for t in readers:
        t.start()
    stopped = False
    try:
        while proc.poll() is None:
            elapsed = time.monotonic() - t0
            if elapsed >= limit_s:
                proc.kill()
                stopped = True
                break
            tick(elapsed, events[-1] if events else {})
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(1.0, max(limit_s - elapsed, 0.01)))
    except KeyboardInterrupt:
        proc.kill()
        proc.wait()
        raise
    code = proc.wait()
    end = time.monotonic()
    for t in readers:
        t.join(timeout=5)
    decode = end - first_token[0] if first_token else None
    return Watched(events, "".join(err), stopped, end - t0, decode), code


def bound_fields(w: Watched, max_tokens: int) -> dict:
    """What a run stopped at the limit still tells, for its record.

    ``tok_s_below``: its decode rate was under ``(max_tokens - 1) / decode_s``
    (it had not produced ``max_tokens`` tokens when stopped ``decode_s`` after
    the first one), ``None`` when no token came; ``tokens_done``,
    ``rate_so_far`` (tokens after the first / their time, from its last
    progress event) and ``ttft`` where it reported them.
    """
    out: dict = {"tok_s_below": (max_tokens - 1) / w.decode_s if w.decode_s else None}
    progress = [e for e in w.events if e.get("phase") == "progress"]
    if progress:
        last = progress[-1]
        out.update(tokens_done=last["tokens"], ttft=last["ttft"])
        if last["tokens"] > 1 and last["decode_s"] > 0:
            out["rate_so_far"] = (last["tokens"] - 1) / last["decode_s"]
    return out


# ------------------------------------------------------------------ progress
class Progress:
    """The progress line: which run of how many, its phase and tokens, elapsed.

    On a terminal the line is rewritten in place at most every ``every``
    seconds (79 columns); elsewhere (a log file) a line is printed every
    ``log_every`` seconds.
    """

    def __init__(self, stream=None, every: float = 2.0, log_every: float = 60.0):
        self.stream = stream = stream or sys.stdout
        self.tty = stream.isatty()
        self.every = every if self.tty else log_every
        self.t0 = time.monotonic()
        self._last = -1e9
        self.head = ""

    def start(self, head: str) -> None:
        """A new run begins: ``head`` names it (e.g. ``run 3/45 nunspark warm``)."""
        self.head, self._last = head, -1e9

    def tick(self, elapsed: float, event: dict) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            return
        self._last = now
        phase = event.get("phase", "starting")
        if phase == "progress":
            phase = f"{event['tokens']} tok"
        line = f"{self.head}: {phase}, {clock(elapsed)}; total {clock(now - self.t0)}"[:79]
        if self.tty:
            self.stream.write("\r" + line.ljust(79))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def line(self, text: str) -> None:
        """A finished run's line (clears the in-place line first)."""
        if self.tty:
            self.stream.write("\r" + " " * 79 + "\r")
        self.stream.write(text[:79] + "\n")
        self.stream.flush()
