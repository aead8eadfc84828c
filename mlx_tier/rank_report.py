"""report.json of a distributed run (issue 16): the job's documents from the merged
journal, and this run's record with one account per rank.

A rank's account comes from its own files (:mod:`mlx_tier.rankfiles`): the
``rank-<k>.json`` it writes when it ends normally, else its journal; and how
its process ended from ``exit-<k>.json`` (its supervisor's).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from .journal import Journal, JsonlSummaries, write_atomic
from .rankfiles import CLAIMS

# Per-document fields a journal record gives a DocResult.
_DOC_FIELDS = ("input_tokens", "output_tokens", "doc_seconds", "finish_reason", "parts", "error", "output")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ending(end: dict, record: dict) -> str:
    """How a rank ended, in words: ``finished``, ``stopped (SIGINT)``, ``killed (SIGKILL)``, ``exit code 1``..."""
    if not end:
        return "unknown (no word from its supervisor: host lost?)"
    if end.get("signal"):
        return f"killed ({end['signal']})"
    if end.get("returncode"):
        return f"exit code {end['returncode']}"
    return "stopped (signal)" if record.get("interrupted") else "finished"


def rank_account(folder: Path, rank: int) -> dict:
    """What rank ``rank`` of the run in ``folder`` did: documents done and failed, output tokens,
    seconds from start to end, output tok/s over them, documents stolen, how it ended, its cache."""
    from .distributed import RankJournal

    record, end = _read_json(folder / f"rank-{rank}.json"), _read_json(folder / f"exit-{rank}.json")
    entries = list(RankJournal(folder / f"journal-{rank}.jsonl").entries())
    docs = [e for e in entries if "id" in e]
    tokens = sum(e.get("output_tokens", 0) for e in docs if e.get("status") == "done")
    throttled = sum(e.get("throttled_seconds", 0) for e in docs)
    times = [e["time"] for e in entries if isinstance(e.get("time"), (int, float))]
    seconds = record.get("seconds") or (end["ended"] - end["started"] if end.get("ended") else
                                        (max(times) - min(times) if times else 0.0))
    head = next((e for e in entries if e.get("event") == "rank"), {})
    return {
        "rank": rank, "host": record.get("host") or end.get("host") or head.get("host"),
        "pid": head.get("pid", end.get("pid")), "seconds": round(seconds, 3),
        "done": sum(e.get("status") == "done" for e in docs), "failed": sum(e.get("status") == "failed" for e in docs),
        "stolen": record.get("stolen"), "output_tokens": tokens,
        "output_tok_per_s": round(tokens / seconds, 3) if seconds else 0.0,
        "throttled_seconds": round(throttled, 3), "ended": _ending(end, record), "cache": record.get("cache", {}),
    }


def _update_results(prep, config, folder: Path, ranks: int, t_wall: float) -> None:
    """This run's documents' results: from this run's rank journals (whatever the ranks'
    clocks say), else from the merged journal after ``t_wall`` (recovered by the launcher)."""
    from .distributed import RankJournal

    mine: dict[str, dict] = {}
    for k in range(ranks):
        mine.update(RankJournal(folder / f"journal-{k}.jsonl").records())
    records = Journal(config.out_dir).records()
    for doc_id in prep.todo:
        rec, res = mine.get(doc_id) or records.get(doc_id), prep.results[doc_id]
        if rec is None or rec.get("status") not in ("done", "failed"):
            continue
        if doc_id not in mine and rec.get("time", 0) < t_wall:
            continue
        if rec["status"] == "done" and not (config.out_dir / f"{doc_id}.md").is_file():
            continue
        res.__dict__.update(status=rec["status"], **{k: rec[k] for k in _DOC_FIELDS if k in rec})


def _run_record(report, accounts: list[dict], t_wall: float, prep) -> dict:
    from .jobs import COUNTERS

    tokens = report.output_tokens
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_wall)),
        "seconds": round(report.seconds, 3), "done": report.this_run("done"), "failed": report.this_run("failed"),
        "already_done": sum(r.status == "done" and r.earlier_run for r in report.results),
        "left_failed": len(prep.failed_earlier), "loaded_model": True, "output_tokens": tokens,
        "output_tok_per_s": round(tokens / report.seconds, 3) if report.seconds else 0.0,
        "throttled_seconds": round(sum(a["throttled_seconds"] for a in accounts), 3),  # all ranks' together
        "ranks": accounts,
        "cache": _summed(accounts, COUNTERS),
    }


def _summed(accounts: list[dict], counters) -> dict:
    """The ranks' cache counters added up, hit rate recomputed."""
    total = {k: sum(a["cache"].get(k, 0) for a in accounts) for k in counters}
    seen = total["hits"] + total["misses"]
    return total | {"hit_rate": total["hits"] / seen if seen else 0.0}


def finish(config, prep, plan_path: Path, t_start: float, t_wall: float, stopped):
    """Write report.json (and summaries.jsonl, report.html) after the ranks ended; returns the JobReport.

    Raises:
        OSError: report.json cannot be written (disk full).
    """
    from .jobs import REPORT, JobReport, _earlier_setup, machine_info, previous_runs, sum_cache
    from .status import PROGRESS_FILE

    folder = plan_path.parent
    plan = _read_json(plan_path)
    _update_results(prep, config, folder, plan.get("ranks", 0), t_wall)
    report = JobReport(results=list(prep.results.values()))
    report.seconds = time.perf_counter() - t_start
    accounts = [rank_account(folder, k) for k in range(plan.get("ranks", 0))]
    setups = [_read_json(folder / f"rank-{k}.json").get("setup") for k in range(plan.get("ranks", 0))]
    setup = next((s for s in setups if s), None)
    report.setup = {**setup, **machine_info()} if setup else _earlier_setup(config)[0]
    report.setup["distributed"] = {"ranks": plan.get("ranks"), "hosts": plan.get("hosts"), "run_id": plan.get("run_id")}
    # the launcher's own Ctrl-C, else a signal a rank was stopped by (SIGINT to its group, SIGTERM from mlx.launch)
    stopped = stopped or next((r["stop_signal"] for r in map(_read_json, folder.glob("rank-*.json"))
                               if r.get("stop_signal")), None)
    report.interrupted = stopped is not None and any(r.status == "pending" for r in report.results)
    report.stop_signal = stopped
    report.runs = previous_runs(config.out_dir / REPORT) + [_run_record(report, accounts, t_wall, prep)]
    report.cache = sum_cache(report.runs)
    if config.output_format == "jsonl":
        JsonlSummaries(config.out_dir, prep.docs).sync(Journal(config.out_dir).records())
    (config.out_dir / PROGRESS_FILE).unlink(missing_ok=True)
    shutil.rmtree(folder / CLAIMS, ignore_errors=True)  # claims hold only for their run
    write_atomic(config.out_dir / REPORT, json.dumps(report.as_dict(), indent=2) + "\n")
    return report
