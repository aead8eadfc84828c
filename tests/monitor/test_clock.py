"""A step of the wall clock changes no duration, rate, ETA or order: a run's records are
found by its run id and timed on its monotonic clock (``run_t``), the journal is read in
file order, and the rank journals of a distributed run are spliced in after its start
record (never sorted by wall time). The clock is faked (``time.time`` monkeypatched);
no real clock is changed.
"""

import functools
import json
import socket
import time

from support.jobs import _short_context, make_docs, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

import mlx_tier.cli.render as render
from mlx_tier.cli.main import app
from mlx_tier.job.eta import EtaTracker
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir import jobdir
from mlx_tier.outdir.jobdir import lock_out_dir
from mlx_tier.outdir.journal import JobInfo, Journal

runner = CliRunner()
HOUR = 3600.0


def test_status_counts_the_run_after_the_wall_clock_stepped_back_an_hour(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """The issue's example: with the clock stepped back mid-run, status said "1 finished … in
    0 s (0.0 documents/hour), 11 left" and the ETA stayed "estimating", even after the end."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 6)
    real_time, step = time.time, [0.0]
    monkeypatch.setattr(time, "time", lambda: real_time() + step[0])
    monkeypatch.setattr(jobdir.ProgressFile, "__init__",  # a snapshot, and an estimate, after every engine step
                        functools.partialmethod(jobdir.ProgressFile.__init__, every=0.0))
    monkeypatch.setattr(EtaTracker, "every", functools.partialmethod(EtaTracker.every, seconds=0.0))
    finished, during = [], []
    on_finished, on_working = render.RichReporter.finished, render.RichReporter.working

    def finished_then_step_back(self, result, cache):
        on_finished(self, result, cache)
        finished.append(result.id)
        if len(finished) == 1:
            step[0] = -HOUR  # the wall clock is set back an hour

    def working_then_status(self, activity):
        on_working(self, activity)
        if len(finished) >= 2:
            during.append(read_status(out))

    monkeypatch.setattr(render.RichReporter, "finished", finished_then_step_back)
    monkeypatch.setattr(render.RichReporter, "working", working_then_status)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "4",
                            "--batch-size", "1"])
    assert r.exit_code == 0, r.output
    assert during, "no engine step after the second document"
    assert all(s.running and s.finished_this_run >= 2 and s.elapsed_seconds > 0 for s in during)
    assert all(s.documents_per_hour > 0 and s.output_tok_per_s > 0 for s in during)
    assert all(s.todo_left == 6 - s.finished_this_run for s in during)
    assert any(s.eta_seconds is not None for s in during)  # the run's own estimate, aged on the monotonic clock

    st = read_status(out)  # after the end, still an hour "earlier" than the run's start
    assert (st.state, st.finished_this_run, st.done_this_run, st.todo_left) == ("finished", 6, 6, 0)
    assert st.elapsed_seconds > 0 and st.documents_per_hour > 0 and st.output_tok_per_s > 0
    words = " ".join(runner.invoke(app, ["status", str(out)]).output.split())
    assert "6 done, 0 failed in" in words and " 0.0 documents/hour" not in words, words
    report = json.loads((out / "report.json").read_text())
    assert report["runs"][-1]["documents_per_hour"] > 0 and report["totals"]["generation_seconds"] > 0


def write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


def test_run_ids_and_the_monotonic_clock_decide_whatever_the_wall_times(tmp_path):
    """A running job whose records' wall times jump back and forth: this run's documents are
    its run id's, its generation time is on the monotonic clock of this machine (from the
    start record's reading), and the ETA is aged on it too."""
    out, host, mono = tmp_path / "out", socket.gethostname(), 1_000.0
    out.mkdir()
    JobInfo(input="docs", ids=["a", "b", "c", "d"], todo=["b", "c", "d"], started=2e9, pid=1, run="R2",
            run_t=12.0, mono=mono, host=host).write(Journal(out))  # started "in 2033"
    write(out / "journal.jsonl", [
        {"id": "a", "status": "done", "output_tokens": 9, "run": "R1", "run_t": 30.0, "time": 1.9e9},  # earlier run
        {"id": "b", "status": "done", "output_tokens": 10, "run": "R2", "run_t": 40.0, "time": 1.0},  # clock reset
        {"id": "c", "status": "done", "output_tokens": 20, "run": "R2", "run_t": 72.0, "time": 3e9},  # then ahead
    ])
    (out / "progress.json").write_text(json.dumps({
        "time": 5.0, "run": "R2", "run_t": 80.0, "mono": mono + 68.0, "host": host, "eta_seconds": 100.0,
        "in_flight": ["d"], "reading": None, "writing": [["d", 3]], "decode_tok_s": 1.0, "prompt_tok_s": 1.0,
        "hit_rate": 1.0}))
    held = lock_out_dir(out)
    try:
        s = read_status(out, now=0.0, now_mono=mono + 78.0)  # the wall clock says 1970
    finally:
        held.close()
    assert (s.finished_this_run, s.todo_left, s.run_output_tokens) == (2, 1, 30)
    assert s.elapsed_seconds == 78.0 and s.load_seconds == 12.0  # generation: loaded at mono, now mono + 78
    assert s.eta_seconds == 90.0  # the snapshot's 100 s, written 10 s ago on the monotonic clock
    assert s.documents_per_hour == round(2 / 78 * 3600, 3)
    (out / "progress.json").unlink()
    s = read_status(out, now=0.0, now_mono=mono + 500)
    assert s.state == "stopped" and s.elapsed_seconds == 60.0  # not running: to its last document (72 - 12)


def test_rank_journals_are_spliced_after_their_runs_start_record_not_sorted_by_wall_time(tmp_path):
    """Run R1 (two ranks) failed x; run R2 (one process) then finished it. The ranks' clocks
    were a day ahead: sorted by wall time, R1's failure came last and won."""
    out, day = tmp_path / "out", 86_400.0
    out.mkdir()
    JobInfo(input="docs", ids=["x", "y"], todo=["x", "y"], started=100.0, pid=1, run="R1",
            run_t=0.0).write(Journal(out))
    write(out / "ranks" / "R1" / "journal-0.jsonl", [
        {"event": "rank", "rank": 0, "run": "R1", "time": 110 + day},
        {"id": "y", "status": "done", "output_tokens": 5, "run": "R1", "run_t": 20.0, "time": 130 + day}])
    write(out / "ranks" / "R1" / "journal-1.jsonl", [
        {"event": "rank", "rank": 1, "run": "R1", "time": 111 + day},
        {"id": "x", "status": "failed", "error": "boom", "run": "R1", "run_t": 10.0, "time": 120 + day}])
    JobInfo(input="docs", ids=["x", "y"], todo=["x"], started=200.0, pid=2, run="R2",
            run_t=1.0).write(Journal(out))
    write(out / "journal.jsonl", [{"id": "x", "status": "done", "output_tokens": 7, "run": "R2", "run_t": 9.0,
                                   "time": 210.0}])
    entries = list(Journal(out).entries())
    assert [(e.get("event"), e.get("id")) for e in entries] == [
        ("start", None), ("rank", None), ("rank", None), (None, "x"), (None, "y"), ("start", None), (None, "x")]
    assert Journal(out).records()["x"]["status"] == "done"
    s = read_status(out)
    assert (s.done, s.failed, s.finished_this_run, s.elapsed_seconds) == (2, 0, 1, 8.0)
