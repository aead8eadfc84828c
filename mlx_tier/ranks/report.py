"""report.json of a distributed run: the job's documents from the merged
journal, and this run's record with one account per rank.

A rank's account comes from its own files (:mod:`mlx_tier.ranks.stealing`): the
``rank-<k>.json`` it writes when it ends normally, else its journal; and how
its process ended from ``exit-<k>.json`` (its supervisor's). The documents
of earlier runs keep the launcher's triage (:func:`mlx_tier.job.run.doc_results`);
this run's come from its rank journals.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from mlx_tier.fsio import write_atomic
from mlx_tier.job.outputs import JsonlSummaries, keeps_jsonl
from mlx_tier.job.provenance import SETTINGS_FIELDS
from mlx_tier.job.triage import DONE_KEEPS, FAILED_KEEPS
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import CLAIMS

# Per-document fields a rank's journal record gives this run's DocResult: what a one-process
# run's result holds (its figures, kept calls and settings, a failure's error), so the two
# runs' reports say the same of the same work.
_DOC_FIELDS = tuple(dict.fromkeys((*DONE_KEEPS, *FAILED_KEEPS, "error", "output")))


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


def _rank_journal(folder: Path, rank: int) -> Journal:
    return Journal(folder, name=f"journal-{rank}.jsonl")


def rank_account(folder: Path, rank: int) -> dict:
    """What rank ``rank`` of the run in ``folder`` did: documents done and failed, output tokens,
    seconds from start to end, its loading and generation time and its speeds over the
    latter (:mod:`mlx_tier.rates`; a rank that wrote no account: over its whole time),
    documents stolen, how it ended, its cache."""
    from mlx_tier.rates import RunSpeed, generated_tokens

    record, end = _read_json(folder / f"rank-{rank}.json"), _read_json(folder / f"exit-{rank}.json")
    entries = list(_rank_journal(folder, rank).entries())
    docs = [e for e in entries if "id" in e]
    tokens = sum(generated_tokens(e) for e in docs)
    throttled = sum(e.get("throttled_seconds", 0) for e in docs)
    times = [e["time"] for e in entries if isinstance(e.get("time"), (int, float))]
    seconds = record.get("seconds") or (end["ended"] - end["started"] if end.get("ended") else
                                        (max(times) - min(times) if times else 0.0))
    head = next((e for e in entries if e.get("event") == "rank"), {})
    done = sum(e.get("status") == "done" for e in docs)
    speed = RunSpeed(tokens, done, record.get("generation_seconds", seconds), record.get("load_seconds"))
    return {
        "rank": rank, "host": record.get("host") or end.get("host") or head.get("host"),
        "pid": head.get("pid", end.get("pid")), "seconds": round(seconds, 3),
        "done": done, "failed": sum(e.get("status") == "failed" for e in docs),
        "stolen": record.get("stolen"), "output_tokens": tokens, **speed.as_dict(),
        "throttled_seconds": round(throttled, 3), "ended": _ending(end, record), "cache": record.get("cache", {}),
    }


def _this_run(results: dict, todo: list[str], config, folder: Path, ranks: int) -> None:
    """Fill the results of this run's documents from its rank journals (whatever the ranks'
    clocks say); a ``done`` whose output is gone stays pending."""
    mine: dict[str, dict] = {}
    for k in range(ranks):
        mine.update(_rank_journal(folder, k).records())
    for doc_id in todo:
        rec, res = mine.get(doc_id), results[doc_id]
        if rec is None or rec.get("status") not in ("done", "failed"):
            continue
        if rec["status"] == "done" and not (config.out_dir / f"{doc_id}.md").is_file():
            continue
        res.__dict__.update(status=rec["status"], **{k: rec[k] for k in _DOC_FIELDS if k in rec})


def _partial_tokens(folder: Path, ranks: int) -> int:
    """Tokens of long documents' calls the ranks wrote and kept without finishing the documents
    (stopped, or failed): this run's work, counted in no document's figures. A rank's account
    says it (``rank-<k>.json``); for a rank that wrote none, its journal's ``stopped`` records."""
    total = 0
    for k in range(ranks):
        said = _read_json(folder / f"rank-{k}.json").get("partial_tokens")
        total += said if isinstance(said, int) else sum(
            e["partial_tokens"] for e in _rank_journal(folder, k).entries()
            if e.get("event") == "stopped" and isinstance(e.get("partial_tokens"), int))
    return total


def _run_record(report, accounts: list[dict], t_wall: float, tri, settings: dict, run: str | None) -> dict:
    """This run's entry of ``runs``: a :class:`~mlx_tier.job.report.RunRecord` with every rank's
    account (``ranks``), their cache counters added up and their throttled time, and the
    ``settings`` the ranks ran with (:func:`_settings_of`), under the ``run`` id its records
    carry. The ranks load and generate side by side: the run's loading and generation times
    are their longest."""
    from mlx_tier.job.report import COUNTERS, RunRecord, rerun_account
    from mlx_tier.job.rerun import rerun_counts

    report.load_seconds = max((a["load_seconds"] for a in accounts if a.get("load_seconds") is not None),
                              default=None)
    report.generation_seconds = max((a["generation_seconds"] for a in accounts), default=0.0)
    record = RunRecord.of(report, t_wall, None, len(tri.done) + len(tri.recovered) + len(tri.reused),
                          len(tri.failed), settings, rerun_account(report.results, rerun_counts(tri)),
                          len(tri.left), run).as_dict()
    return record | {
        "loaded_model": True,
        "throttled_seconds": round(sum(a["throttled_seconds"] for a in accounts), 3),  # all ranks' together
        "ranks": accounts,
        "cache": _summed(accounts, COUNTERS),
    }


def _settings_of(record: dict) -> dict:
    """The settings a rank's ``rank-<k>.json`` names for its run (its report's last run: model,
    prompt, KV bits, generation options, compute), as a one-process run's record holds them;
    ``{}`` if none (a rank that wrote no account, or had nothing to load)."""
    return {k: record[k] for k in SETTINGS_FIELDS if record.get(k) is not None}


def _summed(accounts: list[dict], counters) -> dict:
    """The ranks' cache counters added up, hit rate recomputed."""
    total = {k: sum(a["cache"].get(k, 0) for a in accounts) for k in counters}
    seen = total["hits"] + total["misses"]
    return total | {"hit_rate": total["hits"] / seen if seen else 0.0}


def _setup(folder: Path, ranks: int, plan: dict, config) -> dict:
    """The run's settings: the first rank's that loaded the model (else this machine's), and the ranks."""
    from mlx_tier.job.report import machine_info

    setups = [_read_json(folder / f"rank-{k}.json").get("setup") for k in range(ranks)]
    setup = next((s for s in setups if s), None) or {"model": str(config.model) if config.model else "demo"}
    return {**setup, **machine_info(),
            "distributed": {"ranks": ranks, "hosts": plan.get("hosts"), "run_id": plan.get("run_id")}}


def finish(config, docs, triaged, plan_path: Path, started: tuple[float, float], stopped,
           skipped: dict[str, int] | None = None):
    """Write report.json (and sync summaries.jsonl) after the ranks ended; returns the JobReport.

    Args:
        config, docs: the job and its documents.
        triaged: the launcher's ``(triage, journal records)`` (:func:`mlx_tier.job.run.start_run`).
        plan_path: the run's plan (its folder holds the ranks' files).
        started: ``(perf_counter, Unix time)`` at the run's start.
        stopped: the signal the launcher saw (Ctrl-C), if any.
        skipped: the files INPUT's walk left out, by reason or suffix (report.json ``skipped_files``).
    Raises:
        OSError: report.json cannot be written (disk full).
    """
    from mlx_tier.job.documents import by_count
    from mlx_tier.job.report import JobReport, previous_runs, sum_cache
    from mlx_tier.job.run import doc_results
    from mlx_tier.outdir.jobdir import clear_progress
    from mlx_tier.outdir.journal import prompt_texts
    from mlx_tier.outdir.layout import REPORT

    folder, plan = plan_path.parent, _read_json(plan_path)
    ranks, (tri, records) = plan.get("ranks", 0), triaged
    results = doc_results(docs, tri, records)
    _this_run(results, tri.pending, config, folder, ranks)
    report = JobReport(results=list(results.values()), seconds=time.perf_counter() - started[0],
                       prompts=prompt_texts(Journal(config.out_dir).entries()),
                       skipped_files=by_count(skipped or {}), partial_tokens=_partial_tokens(folder, ranks))
    accounts = [rank_account(folder, k) for k in range(ranks)]
    report.setup = _setup(folder, ranks, plan, config)
    # the launcher's own Ctrl-C, else a signal a rank was stopped by (SIGINT to its group, SIGTERM from mlx.launch)
    stopped = stopped or next((r["stop_signal"] for r in map(_read_json, folder.glob("rank-*.json"))
                               if r.get("stop_signal")), None)
    report.interrupted = stopped is not None and any(r.status == "pending" for r in report.results)
    report.stop_signal = stopped
    settings = next((s for k in range(ranks) if (s := _settings_of(_read_json(folder / f"rank-{k}.json")))), {})
    report.runs = previous_runs(config.out_dir / REPORT) + [_run_record(report, accounts, started[1], tri, settings,
                                                                             plan.get("run_id"))]
    report.cache = sum_cache(report.runs)
    if keeps_jsonl(config.out_dir, config.output_format):
        JsonlSummaries(config.out_dir, docs).sync(Journal(config.out_dir).records())
    clear_progress(config.out_dir)  # the ranks' progress files
    shutil.rmtree(folder / CLAIMS, ignore_errors=True)  # claims hold only for their run
    write_atomic(config.out_dir / REPORT, json.dumps(report.as_dict(), indent=2) + "\n")
    return report
