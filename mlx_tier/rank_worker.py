"""One rank of a distributed run (issue 16): ``python -m mlx_tier.rank_worker supervise PLAN``.

``mlx.launch`` starts this command once per rank (it sets ``MLX_RANK`` and,
for the ring backend, ``MLX_HOSTFILE``). ``supervise`` starts the worker as a
child and always exits 0, writing how the worker ended to ``exit-<k>.json``:
mlx.launch ends every rank as soon as one exits non-zero, and a rank that dies
must not stop the others. ``work`` joins the group (``mx.distributed.init``),
loads the model tiered on this machine and summarises the documents of
:func:`mlx_tier.rankfiles.rank_order` it can claim, writing outputs into the
shared OUT_DIR and records into its own journal.
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

from .fsio import write_atomic
from .rankfiles import CLAIMS, Claims, rank_journal


def _rank_env() -> int:
    return int(os.environ.get("MLX_RANK", "0"))


def supervise(plan_path: Path) -> int:
    """Run the worker, record its end in ``exit-<rank>.json``, return 0 whatever happened.

    SIGTERM (mlx.launch stopping the job) is passed on to the worker, which then
    finishes the summaries being written; SIGINT from the terminal reaches the
    worker directly (same process group), so it is not acted on here.
    """
    rank = _rank_env()
    started = time.time()
    child = subprocess.Popen([sys.executable, "-m", "mlx_tier.rank_worker", "work", str(plan_path)])
    signal.signal(signal.SIGINT, lambda signum, frame: None)
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
        print(f"{self.prefix} {text}", flush=True)

    def start(self, total: int, skipped: int) -> None: ...
    def working(self, activity) -> None: ...
    def close(self) -> None: ...

    def finished(self, result, cache: dict) -> None:
        what = (f"{result.output_tokens} tokens, {result.doc_seconds:.1f} s" if result.status == "done"
                else result.error)
        print(f"{self.prefix} {result.status}: {result.id} ({what})", flush=True)


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
    """Summarise this rank's claimable documents of the plan; writes ``rank-<k>.json`` at the end.

    Returns:
        0 (documents that fail are journalled as failed, as in a one-process run).
    """
    from . import distributed
    from .jobs import DocResult, JobReport, _load_model, _run_todo, _setup

    plan = json.loads(Path(plan_path).read_text())
    rank, size = _join_group(plan["ranks"])
    config = distributed.config_from_json(plan["config"])
    reporter = LineReporter(rank)
    journal = distributed.RankJournal(rank_journal(config.out_dir, plan["run_id"], rank))
    journal.append({"event": "rank", "rank": rank, "ranks": size, "pid": os.getpid(), "host": socket.gethostname()})
    docs = distributed.plan_documents(config, plan)
    claims = Claims(Path(plan_path).parent / CLAIMS, rank)
    share = distributed.Share(plan["todo"], rank, size, docs, claims)
    t0, results = time.perf_counter(), {i: DocResult(i, "pending", docs[i].source, name=docs[i].name,
                                                     converter=docs[i].converter) for i in plan["todo"]}
    model, tokenizer, model_dir = _load_model(config, reporter, plan["prefetch"])
    report = JobReport(results=list(results.values()))
    report.setup = _setup(model_dir, model.expert_cache, config, plan["prefetch"])
    with open(Path(plan_path).parent / f"rank-{rank}.lock", "w") as lock:  # _run_todo closes it on an error
        _run_todo([docs[i] for i in share.own], results, config, model, tokenizer, model_dir, journal, reporter,
                  report, lock, share=share)
    seconds = time.perf_counter() - t0
    mine = [results[i] for i in claims.taken]
    tokens = sum(r.output_tokens for r in mine if r.status == "done")
    record = {
        "rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "seconds": round(seconds, 3),
        "claimed": len(claims.taken), "stolen": share.stolen,
        "done": sum(r.status == "done" for r in mine), "failed": sum(r.status == "failed" for r in mine),
        "output_tokens": tokens, "output_tok_per_s": round(tokens / seconds, 3) if seconds else 0.0,
        "interrupted": report.interrupted, "stop_signal": report.stop_signal, "cache": model.expert_cache.stats.as_dict(), "setup": report.setup,
    }
    write_atomic(Path(plan_path).parent / f"rank-{rank}.json", json.dumps(record, indent=1) + "\n")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("supervise", "work"):
        print("usage: python -m mlx_tier.rank_worker supervise|work PLAN (started by `mlx-tier run --ranks`)",
              file=sys.stderr)
        return 2
    if argv[0] == "supervise":
        return supervise(Path(argv[1]))
    from .errors import MlxTierError

    try:
        return work(Path(argv[1]))
    except (MlxTierError, RuntimeError, OSError) as e:  # bad model, budget, group: one line, the others go on
        print(f"[rank {_rank_env()}] error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
