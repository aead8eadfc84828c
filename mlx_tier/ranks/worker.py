"""One rank of a distributed run: ``python -m mlx_tier.ranks.worker supervise PLAN``.

``mlx.launch`` starts this command once per rank (it sets ``MLX_RANK`` and,
for the ring backend, ``MLX_HOSTFILE``). ``supervise`` starts the worker as a
child and always exits 0, writing how the worker ended to ``exit-<k>.json``:
mlx.launch ends every rank as soon as one exits non-zero, and a rank that dies
must not stop the others. ``work`` joins the group (``mx.distributed.init``),
and runs the job runner on its part of the job (:func:`work`): the documents of
:func:`mlx_tier.ranks.stealing.rank_order` it can claim, outputs into the shared
OUT_DIR, records into its own journal.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlx_tier.fsio import write_atomic
from mlx_tier.outdir.layout import CLAIMS, rank_journal_name
from mlx_tier.ranks.stealing import Claims, rank_order, shares
from mlx_tier.rates import generated_tokens
from mlx_tier.units import count_text


def _rank_env() -> int:
    return int(os.environ.get("MLX_RANK", "0"))


def supervise(plan_path: Path, command: list[str] | None = None) -> int:
    """Run the worker, record its end in ``exit-<rank>.json``, return 0 whatever happened.

    SIGTERM (mlx.launch stopping the job) is passed on to the worker, which then
    finishes the summaries being written; SIGINT from the terminal reaches the
    worker directly (same process group), so it is not acted on here. The
    supervisor may start with SIGINT ignored (the launcher starts mlx.launch
    so); its handler is set before the worker starts, so the worker starts with
    SIGINT's default (an ignored signal would stay ignored across ``exec``).
    ``command``: the worker's command line (default: ``worker work PLAN``).
    """
    rank = _rank_env()
    started = time.time()
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    child = subprocess.Popen(command or [sys.executable, "-m", "mlx_tier.ranks.worker", "work", str(plan_path)])
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    end = {"rank": rank, "host": socket.gethostname(), "pid": child.pid, "returncode": code,
           "signal": signal.Signals(-code).name if code < 0 else None,
           "started": round(started, 3), "ended": round(time.time(), 3)}
    try:
        write_atomic(Path(plan_path).parent / f"exit-{rank}.json", json.dumps(end) + "\n")
    except OSError as e:
        print(f"[rank {rank}] could not record its end: {e}", file=sys.stderr)
    return 0


class LineReporter:
    """Progress of one rank as plain lines (mlx.launch interleaves the ranks' output)."""

    def __init__(self, rank: int) -> None:
        self.prefix = f"[rank {rank}]"

    def message(self, text: str) -> None:
        self._lines(text)

    def _lines(self, text: str) -> None:
        """``text`` wrapped to 80 columns with the rank's prefix on each line (a log file's
        width: the launcher relays the lines as they are)."""
        from mlx_tier.messages import wrap_words

        for line in wrap_words(text, 80 - len(self.prefix) - 1).splitlines():
            print(f"{self.prefix} {line}", flush=True)

    def start(self, total: int, skipped: int, failed: int = 0) -> None: ...
    def working(self, activity) -> None: ...
    def close(self) -> None: ...

    def finished(self, result, cache: dict) -> None:
        what = (f"{result.output_tokens} tokens, {result.doc_seconds:.1f} s" if result.status == "done"
                else result.error)
        self._lines(f"{result.status}: {result.id} ({what})")


def _join_group(ranks: int) -> tuple[int, int]:
    """``(rank, size)`` from ``mx.distributed.init`` (ring over TCP with mlx.launch's hostfile).

    Raises:
        RuntimeError: the group's size is not the plan's (launched by hand, or a wrong hosts file).
    """
    import mlx.core as mx

    if ranks == 1:  # mlx.launch gives one rank an empty hostfile, which init cannot parse: no group needed
        return 0, 1
    group = mx.distributed.init(strict=True)
    if group.size() != ranks:
        raise RuntimeError(f"joined a group of {group.size()} ranks, the plan has {ranks}: start it with "
                           "`mlx-tier run --ranks/--hosts`, not by hand")
    return group.rank(), group.size()


def work(plan_path: Path) -> int:
    """Run the job runner on this rank's part of the plan (:func:`mlx_tier.job.run.run_job`
    with a rank's :class:`~mlx_tier.job.run.Share`); writes ``rank-<k>.json`` at the end.

    Returns:
        0 (documents that fail are journalled as failed, as in a one-process run).
    Raises:
        InputError: INPUT is not the same here (a document of the plan missing or named otherwise).
        RuntimeError: the group is not the plan's.
    """
    from mlx_tier.job.run import Share, run_job
    from mlx_tier.outdir.journal import Journal
    from mlx_tier.outdir.layout import rank_progress_name
    from mlx_tier.ranks.launcher import config_from_json

    plan = json.loads(Path(plan_path).read_text())
    rank, size = _join_group(plan["ranks"])
    config = config_from_json(plan["config"])
    name = rank_journal_name(plan["run_id"], rank)
    Journal(config.out_dir, name=name).append({"event": "rank", "rank": rank, "ranks": size, "pid": os.getpid(),
                                               "host": socket.gethostname(), "run": plan["run_id"]})
    _check_documents(config, plan)
    claims = Claims(Path(plan_path).parent / CLAIMS, rank)
    share = Share(claim=claims.claim, journal_name=name, part=True, run_id=plan["run_id"],
                  order=rank_order(plan["todo"], rank, size, claims.claimed), progress_name=rank_progress_name(rank))
    t0 = time.perf_counter()
    report = run_job(config, LineReporter(rank), share)
    write_atomic(Path(plan_path).parent / f"rank-{rank}.json",
                 json.dumps(_account(rank, plan, claims, report, time.perf_counter() - t0), indent=1) + "\n")
    return 0


def _check_documents(config, plan: dict) -> None:
    """The plan's documents are this rank's INPUT's, under the same ids (cheap: nothing converted).

    Raises:
        InputError: one is missing or named otherwise here.
    """
    from mlx_tier.errors import InputError
    from mlx_tier.job.run import find_documents

    here = {d.id: d.name for d in find_documents(config)}
    wrong = [i for i in plan["todo"] if here.get(i) != plan["names"].get(i)]
    if wrong:
        raise InputError(f"{config.input}: {count_text(len(wrong), 'document')} of the plan not found on "
                         f"{socket.gethostname()} (e.g. {wrong[0]}); INPUT must be the same path on every host")


def _account(rank: int, plan: dict, claims: Claims, report, seconds: float) -> dict:
    """What this rank did (``rank-<k>.json``): its claimed documents, tokens, cache counters, setup,
    the settings its run record names."""
    from mlx_tier.job.provenance import SETTINGS_FIELDS

    results = {r.id: r for r in report.results}
    mine = [results[i] for i in claims.taken if i in results]
    own = set(shares(plan["todo"], plan["ranks"])[rank])
    tokens = sum(map(generated_tokens, mine))
    run = report.runs[-1] if report.runs else {}
    return {
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "seconds": round(seconds, 3),
        "claimed": len(claims.taken), "stolen": sum(i not in own for i in claims.taken),
        "done": sum(r.status == "done" for r in mine), "failed": sum(r.status == "failed" for r in mine),
        "output_tokens": tokens, "load_seconds": run.get("load_seconds"),
        "generation_seconds": run.get("generation_seconds", seconds), "output_tok_per_s": run.get("output_tok_per_s", 0.0),
        **{k: run.get(k) for k in SETTINGS_FIELDS},  # what its run record says of its settings
        "partial_tokens": report.partial_tokens,  # long documents' calls kept, the documents not finished
        "interrupted": report.interrupted, "stop_signal": report.stop_signal, "cache": run.get("cache", {}),
        "throttle": report.throttle, "setup": report.setup,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("supervise", "work"):
        print("usage: python -m mlx_tier.ranks.worker supervise|work PLAN (started by `mlx-tier run --ranks`)",
              file=sys.stderr)
        return 2
    if argv[0] == "supervise":
        return supervise(Path(argv[1]))
    from mlx_tier.errors import MlxTierError

    try:
        return work(Path(argv[1]))
    except (MlxTierError, RuntimeError, OSError) as e:  # bad model, budget, group: one line, the others go on
        print(f"[rank {_rank_env()}] error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
