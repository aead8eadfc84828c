"""One job over several ranks (processes, or Macs) with MLX's own launcher.

``mlx-tier run INPUT --out OUT --ranks N`` (N processes here) or ``--hosts
hosts.json`` (mlx.launch's hosts file: one rank per entry, over ssh) calls
:func:`run_distributed`, which

1. holds OUT_DIR as a one-process run does (:class:`~mlx_tier.outdir.jobdir.JobDir`:
   its lock, a killed run's temporary files removed), triages the documents
   from the job's journal (:func:`mlx_tier.job.run.start_run`) and writes the
   plan (``OUT/ranks/<run_id>/plan.json``: the settings and the documents to
   do, in order);
2. runs ``mlx.launch`` (ring backend over TCP unless the hosts file names
   another) with :mod:`mlx_tier.ranks.worker` as the command: each rank joins
   the group with ``mx.distributed.init`` and runs the normal job runner
   (:func:`mlx_tier.job.run.run_job`) on its part of the job: its own share
   first, then the other ranks' unstarted documents, each taken by an
   exclusive claim file (:func:`mlx_tier.ranks.stealing.rank_order`), writing
   summaries into OUT_DIR and records into its own journal;
3. when mlx.launch returns (every rank finished, died or was stopped), writes
   ``report.json`` (:mod:`mlx_tier.ranks.report`): the job's documents, and
   this run's record with one entry per rank.

No collective runs after ``init``: a rank that dies stops nobody. What it had
started stays pending for the next run, with any number of ranks (its claims
belong to the old run id).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import types
import typing
from collections import Counter
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path

import mlx.core as mx

from mlx_tier.errors import InputError
from mlx_tier.fsio import current_folder
from mlx_tier.outdir.layout import CLAIMS, PLAN, RANKS_DIR, run_dir
from mlx_tier.policy.eviction import PolicySpec
from mlx_tier.units import count_text

RANK_COMMAND = ["-m", "mlx_tier.ranks.worker", "supervise"]


@dataclass(frozen=True)
class Launch:
    """Where the ranks run.

    Attributes:
        ranks: processes on this machine (``hosts`` is ``None``), at least 1.
        hosts: an mlx.launch hosts file (JSON: ``[{"ssh": NAME, "ips": [IP]}, ...]``
            or ``{"backend": ..., "envs": [...], "hosts": [...]}``); one rank per entry.
    """

    ranks: int = 1
    hosts: Path | None = None


def read_hosts(path: Path) -> list[str]:
    """The ssh names of an mlx.launch hosts file, checked.

    Raises:
        InputError: unreadable, not JSON, no hosts, an entry without ``ssh``, or
            (ring backend) without ``ips``.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable hosts file ({e})") from None
    hosts = data.get("hosts") if isinstance(data, dict) else data
    backend = data.get("backend", "ring") if isinstance(data, dict) else "ring"
    if not isinstance(hosts, list) or not hosts:
        raise InputError(f"{path}: expected a list of hosts ([{{\"ssh\": \"mac1\", \"ips\": [\"192.168.1.2\"]}}, ...])")
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not h["ssh"]:
            raise InputError(f"{path}: host {i} needs an \"ssh\" name")
        ips = h.get("ips")
        if backend == "ring" and not (isinstance(ips, list) and ips and all(isinstance(x, str) for x in ips)):
            raise InputError(f"{path}: host {h['ssh']} needs \"ips\" (the ring backend connects by IP address)")
    return [h["ssh"] for h in hosts]


def config_to_json(config) -> object:
    """A :class:`~mlx_tier.job.config.JobConfig` (nested frozen dataclasses) as JSON data for the
    plan: dataclasses as objects, paths as strings, tuples as lists, an MLX dtype by name,
    a :class:`~mlx_tier.policy.eviction.PolicySpec` by name.

    Raises:
        InputError: a policy with a profile bound in Python (ranks bind theirs at load).
    """
    if isinstance(config, PolicySpec):
        if config.profile is not None:
            raise InputError("a policy with a profile object cannot be sent to ranks; give its name")
        return config.name
    if is_dataclass(config):
        return {f.name: config_to_json(getattr(config, f.name)) for f in fields(config) if f.init}
    if isinstance(config, Path):
        return str(config)
    if isinstance(config, tuple):
        return [config_to_json(x) for x in config]
    if isinstance(config, mx.Dtype):
        return str(config).removeprefix("mlx.core.")
    return config  # str, int, float, bool, None


def config_from_json(data: dict):
    """The :class:`~mlx_tier.job.config.JobConfig` of :func:`config_to_json`, rebuilt by its
    fields' declared types (settings unknown to this version are ignored)."""
    from mlx_tier.job.config import JobConfig

    return _decode(JobConfig, data)


def _decode(tp, value):
    """``value`` (JSON data) as the declared type ``tp``."""
    if value is None:
        return None
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if isinstance(value, str) and str in options:
            return value  # a name stays a name (TierConfig makes a policy name a spec)
        kind = next((a for a in options if is_dataclass(a)), options[0]) if isinstance(value, dict) else options[0]
        return _decode(kind, value)
    if tp is PolicySpec:
        return PolicySpec(value)
    if is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _decode(hints[f.name], value[f.name]) for f in fields(tp) if f.init and f.name in value})
    if typing.get_origin(tp) is tuple:
        return tuple(_decode(typing.get_args(tp)[0], x) for x in value)
    if tp is Path:
        return Path(value)
    if tp is mx.Dtype:
        return getattr(mx, value)
    return float(value) if tp is float else value


def _absolute(config):
    """``config`` with INPUT, OUT_DIR and a model folder as absolute paths (the same on every host)."""
    model = config.model
    if model is not None and Path(model).exists():  # a folder here, not a repo id
        model = str(Path(model).absolute())
    return replace(config, input=config.input if config.input_paths is not None and str(config.input) == "-"
                   else Path(config.input).absolute(), out_dir=Path(config.out_dir).absolute(), model=model)


def _free_ports(n: int) -> int:
    """A first port of ``n`` consecutive free TCP ports on 127.0.0.1 (for the ring backend)."""
    for _ in range(50):
        base = 20000 + secrets.randbelow(30000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError("no free ports for the ranks")


def launcher() -> str:
    """The ``mlx.launch`` script of this Python environment (or on PATH).

    Raises:
        InputError: not found (MLX is too old or not installed with its scripts).
    """
    here = Path(sys.executable).parent / "mlx.launch"
    found = str(here) if here.exists() else shutil.which("mlx.launch")
    if found is None:
        raise InputError("mlx.launch not found: --ranks and --hosts need MLX's launcher; install it with:",
                         command="pip install 'mlx>=0.29'")
    return found


def launch_command(launch: Launch, plan_path: Path) -> list[str]:
    """The mlx.launch command line that starts every rank on ``plan_path``."""
    rank = [sys.executable, *RANK_COMMAND, str(plan_path)]
    if launch.hosts is not None:
        data = json.loads(Path(launch.hosts).read_text())
        backend = (data.get("backend") if isinstance(data, dict) else None) or "ring"
        return [launcher(), "--backend", backend, "--hostfile", str(launch.hosts), "--", *rank]
    return [launcher(), "--backend", "ring", "--hosts", "127.0.0.1", "-n", str(launch.ranks),
            "--starting-port", str(_free_ports(launch.ranks)), "--", *rank]


def _write_plan(config, docs, todo: list[str], launch: Launch, ranks: int, run_id: str) -> Path:
    """``OUT/ranks/<run_id>/plan.json`` (and the run's ``claims`` folder); returns its path.
    ``run_id``: the run's (:class:`~mlx_tier.outdir.journal.RunClock`), which its ranks take."""
    from mlx_tier.fsio import write_atomic

    folder = run_dir(config.out_dir, run_id)
    (folder / CLAIMS).mkdir(parents=True)
    names = {d.id: d.name for d in docs}
    plan = {"run_id": run_id, "ranks": ranks, "hosts": str(launch.hosts) if launch.hosts else None,
            "started": time.time(), "config": config_to_json(config), "todo": todo,
            "names": {i: names[i] for i in todo}}
    write_atomic(folder / PLAN, json.dumps(plan) + "\n")
    return folder / PLAN


def all_local(launch: Launch) -> bool:
    """Every rank runs on this machine, started by mlx.launch itself (``--ranks``, or a ring
    hosts file of ``127.0.0.1`` only, which it starts without ssh): a Ctrl-C in the terminal
    reaches each of them. Other backends (``mpirun``...) start ranks their own way: no."""
    if launch.hosts is None:
        return True
    data = json.loads(Path(launch.hosts).read_text())
    backend = (data.get("backend") if isinstance(data, dict) else None) or "ring"
    return backend == "ring" and all(h == "127.0.0.1" for h in read_hosts(launch.hosts))


def start_launcher(command: list[str], local: bool) -> subprocess.Popen:
    """Start mlx.launch; with ``local`` ranks, with SIGINT ignored.

    A Ctrl-C then reaches the ranks alone (same process group): they finish the
    summaries being written while mlx.launch forwards their output and returns
    after the last one. Interrupted itself, mlx.launch stops forwarding output and
    can return before its ranks end (a KeyboardInterrupt inside ``Thread.is_alive``
    marks a running thread stopped: python/cpython#90882), so the report would
    miss how they ended. Ranks over ssh keep today's behaviour: mlx.launch is
    what stops them. The disposition is inherited through ``exec`` and restored
    here at once; a Ctrl-C in those few milliseconds is not seen by this process.
    """
    import signal

    unchanged = object()
    old = unchanged
    if local:
        try:
            old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: no handlers to change, nothing to restore
            pass
    try:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)
    finally:
        if old is not unchanged:  # None: a handler set from C, which Python cannot restore
            signal.signal(signal.SIGINT, signal.default_int_handler if old is None else old)


def _wait(proc: subprocess.Popen, reporter, local: bool) -> int | None:
    """Wait for mlx.launch. A first Ctrl-C: the ranks finish the summaries being written.
    A second stops them now: ``local`` ranks got it themselves; mlx.launch is ended for
    ranks over ssh (``local``: at a third). Returns the signal that stopped the run, if any."""
    import signal

    stopped, presses = None, 0
    while True:
        try:
            proc.wait()
            return stopped
        except KeyboardInterrupt:
            presses += 1
            stopped = signal.SIGINT
            if presses == 1:
                reporter.message("stopping: the ranks finish the summaries being written "
                                 "(interrupt again to stop now)")
            elif presses > (2 if local else 1):
                reporter.message("stopping now: mlx.launch is ended")
                proc.terminate()
            else:
                reporter.message("stopping now: the summaries being written are left for the next run")


def run_distributed(config, launch: Launch, reporter=None):
    """Run the job over ``launch``'s ranks; returns its :class:`~mlx_tier.job.run.JobReport`
    (``runs[-1]["ranks"]``: one account per rank).

    Raises:
        InputError: bad input or output folder, a bad hosts file, a setting ranks
            cannot share (``trace``, ``save_profile``), a batch request file, mlx.launch missing.
        mlx_tier.CheckpointError: the demo or hub model cannot be prepared here.
    """
    from mlx_tier.job.documents import link_hint, skip_note
    from mlx_tier.job.model_setup import planned_compute_of
    from mlx_tier.job.rerun import locate_model, rerun_notes, run_settings
    from mlx_tier.job.run import (
        Reporter,
        find_documents,
        run_job,
        start_run,
        write_report_page,
    )
    from mlx_tier.outdir.jobdir import JobDir
    from mlx_tier.outdir.journal import RunClock

    reporter = reporter or Reporter()
    if config.trace is not None or config.save_profile:
        raise InputError("--trace and --save-profile record one process's cache; run them without --ranks/--hosts")
    ranks = len(read_hosts(launch.hosts)) if launch.hosts is not None else launch.ranks
    config = _absolute(config)
    launcher()  # fail now, before OUT_DIR is touched, when mlx.launch is missing
    skipped: Counter = Counter()
    notes: list[str] = []
    docs = find_documents(config, skipped, notes)
    if docs and docs[0].request is not None:  # one process appends output.jsonl and errors.jsonl
        raise InputError(f"{config.input}: a batch request file runs in one process; run it without --ranks/--hosts")
    if (config.out_dir / RANKS_DIR).is_symlink():  # invariant 3: nothing written outside OUT_DIR
        raise InputError(f"{config.out_dir / RANKS_DIR}: is a link; remove it (ranks write their files there)")
    started, clock = (time.perf_counter(), time.time()), RunClock()
    with JobDir(config.out_dir) as job:
        model_dir = locate_model(config.model)
        settings = run_settings(config.model, config.generation, model_dir,
                                compute=planned_compute_of(config, model_dir))
        _, records, tri = start_run(job, docs, config, reporter, clock=clock, settings=settings)
        if skipped and tri.pending:  # else the one-process run below says it
            reporter.message(skip_note(skipped))
            if hint := link_hint(skipped):
                reporter.message(hint)
        for note in (notes if tri.pending else []) + rerun_notes(tri, records, settings, config.retry_failed,
                                                                 [d.id for d in docs]):
            reporter.message(note)
        report = (_launch(config, launch, ranks, job, docs, (tri, records), reporter, started, clock, skipped)
                  if tri.pending else None)
        if report is not None:  # the ranks are done: the kept calls of what they finished go
            _forget_parts(job, clock.id, reporter)
    if report is None:  # nothing to do: the one-process path writes the job's report, loading no model
        return run_job(config, reporter)
    write_report_page(config.out_dir, reporter)  # after the lock: the page reads the job as not running
    return report


def _forget_parts(job, run_id: str, reporter) -> None:
    """Drop the kept calls (:mod:`mlx_tier.outdir.parts`) of the documents the run ``run_id``'s
    ranks finished; a file that cannot be rewritten is said, not raised."""
    from mlx_tier.job.kept_parts import forget_finished

    done = [i for i, r in job.view().records().items() if r.get("status") == "done" and r.get("run") == run_id]
    for note in forget_finished(job.path, done):
        reporter.message(note)


def _launch(config, launch: Launch, ranks: int, job, docs, triaged, reporter, started: tuple[float, float], clock,
            skipped: Counter):
    """Under OUT_DIR's lock: record the run's start (under the run id ``clock.id``, the
    ranks' too), write the plan, run the ranks, write the report. ``triaged``: the
    launcher's ``(triage, journal records)``; ``skipped``: the files INPUT's walk left out."""
    import socket

    from mlx_tier.job.provenance import prompt_hash
    from mlx_tier.outdir.jobdir import write_input_list
    from mlx_tier.outdir.journal import JobInfo
    from mlx_tier.ranks.report import finish

    tri, _ = triaged
    if launch.hosts is None:
        try:
            _ensure_model(config, reporter)  # one build or download here, not one per rank at once
        except BaseException:
            job.discard_if_unused()
            raise
    instruction = config.generation.instruction
    JobInfo(input=str(config.input), ids=[d.id for d in docs], todo=tri.pending, started=time.time(), writes=True,
            pid=os.getpid(), command=config.command, cwd=current_folder(), output_format=config.output_format, mono=time.monotonic(),
            host=socket.gethostname(), prompt=prompt_hash(instruction), prompt_text=instruction,
            left=[i for i in tri.left if i in tri.stale] or None).write(job.journal(clock=clock))
    if config.input_paths is not None:
        write_input_list(config.out_dir, docs)
    config = _shared_memory(config, launch, ranks, reporter)
    plan_path = _write_plan(config, docs, tri.pending, launch, ranks, clock.id)
    reporter.message(f"{count_text(ranks, 'rank')}, {count_text(len(tri.pending), 'document')} to do; run {plan_path.parent.name}")
    local = all_local(launch)
    stopped = _wait(start_launcher(launch_command(launch, plan_path), local), reporter, local)
    return finish(config, docs, triaged, plan_path, started, stopped, skipped)


def _shared_memory(config, launch: Launch, ranks: int, reporter):
    """``config`` with ``memory_gb`` (and ``cache_gb``, when given) each rank takes when all
    ``ranks`` run on this machine: the run's total (``--memory-gb``, else what this process
    may use now) split evenly, so that the ranks' splits add up to the machine's, not each
    to all of it (an OOM kill).
    Unchanged for ranks on other hosts (each sizes its own machine) or on CUDA (no one
    host total)."""
    from dataclasses import replace

    from mlx_tier.engine import budgets
    from mlx_tier.engine.sizes import may_use_now
    from mlx_tier.units import GIB

    mem = budgets.probe()
    if ranks < 2 or not all_local(launch) or not mem.unified:
        return config
    total = config.memory_gb * GIB if config.memory_gb is not None else may_use_now(mem.host_available,
                                                                                      mem.host_total)
    each = total / ranks / GIB
    cache = config.tier.cache_gb
    reporter.message(f"memory: {each:.2f} GiB for each of the {ranks} ranks on this machine "
                     f"({total / GIB:.2f} GiB in all)" + (f", an expert cache of {cache / ranks:.2f} GiB each "
                                                          f"({cache:g} GiB in all)" if cache is not None else ""))
    tier = replace(config.tier, cache_gb=cache / ranks) if cache is not None else config.tier
    return replace(config, memory_gb=each, tier=tier)


def _ensure_model(config, reporter) -> None:
    from mlx_tier.tools.demo_model import resolve

    resolve(config.model, reporter.message)
