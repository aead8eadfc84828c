"""One job over several ranks (processes, or Macs) with MLX's own launcher (issue 16).

``mlx-tier run INPUT --out OUT --ranks N`` (N processes here) or ``--hosts
hosts.json`` (mlx.launch's hosts file: one rank per entry, over ssh) calls
:func:`run_distributed`, which

1. under OUT_DIR's lock, sorts the job's documents by the journal as a
   one-process run does and writes the plan (``OUT/ranks/<run_id>/plan.json``:
   the settings and the documents to do, in order);
2. runs ``mlx.launch`` (ring backend over TCP unless the hosts file names
   another) with :mod:`mlx_tier.rank_worker` as the command: each rank joins
   the group with ``mx.distributed.init``, loads the model tiered on its own
   machine, takes its share of the documents and then, by exclusive claim
   files, the ones other ranks have not started (:mod:`mlx_tier.rankfiles`),
   writing summaries into OUT_DIR and records into its own journal;
3. when mlx.launch returns (every rank finished, died or was stopped), writes
   ``report.json``: the job's documents from the merged journal, and this run's
   record with one entry per rank (documents, tokens, seconds, tok/s, how it ended).

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
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from .documents import Document, InputError, discover, discover_list
from .journal import Journal
from .rankfiles import CLAIMS, PLAN, RANKS_DIR, Claims, run_dir, shares, steal_from
from .throttle import ThrottleConfig

RANK_COMMAND = ["-m", "mlx_tier.rank_worker", "supervise"]


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


class RankJournal(Journal):
    """A rank's own journal file (``OUT/ranks/<run_id>/journal-<k>.jsonl``): only this rank appends."""

    def __init__(self, path: Path) -> None:
        super().__init__(Path(path).parent)
        self.path = Path(path)


class Share:
    """A rank's part of a distributed run, as the scheduler sees it (its ``share`` hook).

    Args:
        todo: the plan's documents to do, in order (the same on every rank).
        rank, ranks: this rank and how many there are.
        docs: the documents by id.
        claims: the run's :class:`~mlx_tier.rankfiles.Claims` for this rank.
    """

    def __init__(self, todo: list[str], rank: int, ranks: int, docs: dict[str, Document], claims: Claims) -> None:
        self.todo, self.rank, self.ranks, self.docs, self.claims = todo, rank, ranks, docs, claims
        self.own = shares(todo, ranks)[rank]

    def claim(self, doc_id: str) -> bool:
        """Take ``doc_id`` (``False``: another rank has it)."""
        return self.claims.claim(doc_id)

    def more(self) -> list[Document]:
        """Other ranks' unstarted documents, the slowest rank's first (:func:`~mlx_tier.rankfiles.steal_from`)."""
        return [self.docs[i] for i in steal_from(self.todo, self.rank, self.ranks, self.claims.claimed())]

    @property
    def stolen(self) -> int:
        own = set(self.own)
        return sum(i not in own for i in self.claims.taken)


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


def config_to_json(config) -> dict:
    """A :class:`~mlx_tier.jobs.JobConfig` as JSON (paths as strings) for the plan."""
    d = asdict(config)
    for k in ("input", "out_dir", "model", "trace"):
        d[k] = None if d[k] is None else str(d[k])
    return d


def config_from_json(d: dict):
    """The :class:`~mlx_tier.jobs.JobConfig` of :func:`config_to_json`."""
    from .jobs import JobConfig

    d = {f.name: d[f.name] for f in fields(JobConfig) if f.name in d}
    d["input"], d["out_dir"] = Path(d["input"]), Path(d["out_dir"])
    d["trace"] = Path(d["trace"]) if d.get("trace") else None
    d["throttle"] = ThrottleConfig(**d["throttle"])
    d["input_paths"] = tuple(d["input_paths"]) if d.get("input_paths") is not None else None
    return JobConfig(**d)


def _discover(config, previous: dict[str, str]) -> list[Document]:
    if config.input_paths is not None:
        return discover_list(config.input_paths, exclude=config.out_dir, previous=previous)
    return discover(config.input, exclude=config.out_dir, follow_links=config.follow_links, previous=previous)


def plan_documents(config, plan: dict) -> dict[str, Document]:
    """The plan's documents to do, read on this rank, by id (names keep the launcher's ids).

    Raises:
        InputError: INPUT differs here (a document of the plan is missing).
    """
    docs = {d.id: d for d in _discover(config, plan["names"])}
    missing = [i for i in plan["todo"] if i not in docs]
    if missing:
        raise InputError(f"{config.input}: {len(missing)} document(s) of the plan not found on "
                         f"{socket.gethostname()} (e.g. {missing[0]}); INPUT must be the same path on every host")
    return docs


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
        raise InputError("mlx.launch not found: --ranks and --hosts need MLX's launcher (pip install 'mlx>=0.29')")
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


@dataclass
class Prepared:
    """The launcher's view at the start of a run (under OUT_DIR's lock)."""

    docs: list[Document]
    results: dict  # id -> DocResult, earlier documents filled in by the triage
    todo: list[str]
    failed_earlier: list[str]
    lock: object


def _prepare(config, reporter) -> Prepared:
    """Check, lock OUT_DIR and sort the documents by the (merged) journal, as a one-process run does."""
    from .jobs import (DocResult, _attempted_ids, _foreign_outputs, _triage, lock_out_dir,
                       prepare_out_dir)
    from .journal import remove_stale_temps
    from .outdir import check_out_dir

    check_out_dir(config.out_dir, config.input if config.input_paths is None else None)
    if (config.out_dir / RANKS_DIR).is_symlink():  # invariant 3: nothing written outside OUT_DIR
        raise InputError(f"{config.out_dir / RANKS_DIR}: is a link; remove it (ranks write their files there)")
    earlier = Journal(config.out_dir) if config.out_dir.is_dir() else None
    attempted = _attempted_ids(earlier)
    previous = {**(earlier.names() if earlier is not None else {}), **_foreign_outputs(config.out_dir, attempted)}
    docs = _discover(config, previous)
    prepare_out_dir(config.out_dir)
    lock = lock_out_dir(config.out_dir)  # held by this process until the ranks are done
    remove_stale_temps(config.out_dir)  # no rank runs yet: any temporary file is a dead run's
    journal = Journal(config.out_dir)
    for warning in journal.warnings.values():
        reporter.message(f"journal: {warning}")
    results = {d.id: DocResult(d.id, "pending", d.source, name=d.name, converter=d.converter) for d in docs}
    todo, failed_earlier = _triage(docs, journal.records(), config, journal, results, attempted)
    return Prepared(docs, results, [d.id for d in todo], failed_earlier, lock)


def _write_plan(config, prep: Prepared, launch: Launch, ranks: int) -> Path:
    """``OUT/ranks/<run_id>/plan.json``; returns its path."""
    from .tiered import DEFAULT_PREFETCH

    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + secrets.token_hex(3)
    folder = run_dir(config.out_dir, run_id)
    (folder / CLAIMS).mkdir(parents=True)
    plan = {"run_id": run_id, "ranks": ranks, "hosts": str(launch.hosts) if launch.hosts else None,
            "started": time.time(), "config": config_to_json(config), "todo": prep.todo,
            "names": {d.name: d.id for d in prep.docs},
            "prefetch": DEFAULT_PREFETCH if config.prefetch is None else config.prefetch}
    from .fsio import write_atomic

    write_atomic(folder / PLAN, json.dumps(plan) + "\n")
    return folder / PLAN


def _wait(proc: subprocess.Popen, reporter) -> int | None:
    """Wait for mlx.launch; after a Ctrl-C (which the local ranks get too: they finish the
    summaries being written) wait on; after a second, end mlx.launch (the local ranks got it
    too and stop at once). Returns the signal that stopped the run, if any."""
    import signal

    stopped = None
    while True:
        try:
            proc.wait()
            return stopped
        except KeyboardInterrupt:
            if stopped is not None:
                proc.terminate()
            stopped = signal.SIGINT
            reporter.message("stopping: the ranks finish the summaries being written (interrupt again to stop now)")


def run_distributed(config, launch: Launch, reporter=None):
    """Run the job over ``launch``'s ranks; returns its :class:`~mlx_tier.jobs.JobReport`
    (``runs[-1]["ranks"]``: one account per rank).

    Raises:
        InputError: bad input or output folder, a bad hosts file, a setting ranks
            cannot share (``trace``, ``save_profile``), mlx.launch missing.
        mlx_tier.CheckpointError: the demo or hub model cannot be prepared here.
    """
    from .jobs import Reporter, run_job
    from .status import JobInfo, write_input_list

    reporter = reporter or Reporter()
    if config.trace is not None or config.save_profile:
        raise InputError("--trace and --save-profile record one process's cache; run them without --ranks/--hosts")
    ranks = len(read_hosts(launch.hosts)) if launch.hosts is not None else launch.ranks
    config = _absolute(config)
    launcher()  # fail now, before OUT_DIR is touched, when mlx.launch is missing
    prep = _prepare(config, reporter)
    if not prep.todo:  # nothing to do: the one-process path writes the job's report without loading a model
        prep.lock.close()
        return run_job(config, reporter)
    try:
        if launch.hosts is None:
            _ensure_model(config, reporter)  # one build or download here, not one per rank at once
        t_start, t_wall = time.perf_counter(), time.time()
        JobInfo(input=str(config.input), ids=[d.id for d in prep.docs], todo=prep.todo, started=t_wall,
                pid=os.getpid(), command=config.command, output_format=config.output_format).write(Journal(config.out_dir))
        if config.input_paths is not None:
            write_input_list(config.out_dir, prep.docs)
        plan_path = _write_plan(config, prep, launch, ranks)
        command = launch_command(launch, plan_path)
        reporter.message(f"{ranks} rank(s), {len(prep.todo)} document(s) to do; run {plan_path.parent.name}")
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        stopped = _wait(proc, reporter)
        from .rank_report import finish

        report = finish(config, prep, plan_path, t_start, t_wall, stopped)
    finally:
        prep.lock.close()
    from .jobs import _write_report_page

    _write_report_page(config.out_dir, reporter)  # after the lock: the page reads the job as not running
    return report


def _ensure_model(config, reporter) -> None:
    from .demo_model import ensure_demo_model
    from .hub import resolve_model

    if config.model is None:
        ensure_demo_model(reporter.message)
    else:
        resolve_model(config.model)
