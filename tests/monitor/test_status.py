"""`mlx-tier status` reads a job's files only: counts, throughput, throttle time and
ETA come from the journal (its run ``start`` record and document records); "running" means another open file holds
the folder's lock (the lock every `mlx-tier run` takes).
"""

import json
import os
import time

import pytest
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.jobdir import lock_out_dir
from mlx_tier.outdir.journal import JobInfo, Journal
from mlx_tier.outdir.layout import lock_held

runner = CliRunner()
T0 = 1_700_000_000.0


def make_job(out, started=T0):
    """Six documents: an earlier run finished d0 and failed d1; this run (started at
    ``started``) set out to do d2..d5 and has finished d2 and d3 by ``started + 100``."""
    out.mkdir()
    JobInfo(input="docs", ids=[f"d{i}" for i in range(6)], todo=["d2", "d3", "d4", "d5"], started=started,
            pid=4321, command="mlx-tier run docs --out out").write(Journal(out))
    lines = [
        {"id": "d0", "status": "done", "output_tokens": 40, "seconds": 10.0, "time": started - 500},
        {"id": "d1", "status": "failed", "error": "RuntimeError: [metal::malloc] out of memory", "time": started - 400},
        {"event": "throttle", "throttled_seconds": 12.5, "time": started + 10},  # no id: counted, not a document
        {"id": "d2", "status": "done", "output_tokens": 60, "seconds": 20.0, "throttled_seconds": 3.0, "time": started + 50},
        # d3 resumed from calls an earlier run kept: 5 of its 25 tokens were written then
        {"id": "d3", "status": "done", "output_tokens": 25, "kept_tokens": 5, "seconds": 10.0, "time": started + 100},
    ]
    with open(out / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines) + '{"id": "d4", "sta')  # torn


def test_finished_job(tmp_path):
    out = tmp_path / "out"
    make_job(out)
    s = read_status(out, now=T0 + 5000)
    assert not s.running and s.pid == 4321
    assert (s.total, s.done, s.failed, s.pending, s.todo_left) == (6, 3, 1, 2, 2)
    # this run: d2 + d3 = 80 tokens generated over 100 s of wall clock (batched documents overlap);
    # the job's documents hold 125 (d3's kept calls' too)
    assert s.output_tokens == 125 and s.run_output_tokens == 80 and s.output_tok_per_s == 0.8
    assert s.throttled_seconds == 15.5
    assert s.finished_this_run == 2 and s.elapsed_seconds == 100  # up to its last record, not to "now"
    assert s.documents_per_hour == 72.0 and s.eta_seconds is None  # not running: no ETA
    assert s.failures == [("d1", "RuntimeError: [metal::malloc] out of memory", False)]


def test_a_failed_request_names_the_field_of_its_body_not_a_flag(tmp_path):
    """A user trial: status said "--max-tokens must be at least 1, got 0" of a batch request
    whose body's `max_tokens` was 0 (the run itself said "`max_tokens` of request mt0")."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="req.jsonl", ids=["mt0", "d"], todo=["mt0", "d"], started=T0, pid=1,
            command="mlx-tier run req.jsonl --out out").write(Journal(out))
    Journal(out).append({"id": "mt0", "name": "mt/0", "status": "failed", "error": "`max_tokens` must be at least 1, "
                         "got 0", "error_code": "invalid_value", "error_param": "max_tokens"})
    Journal(out).append({"id": "d", "status": "failed", "error": "no summary within `max_tokens` 4"})
    assert [tuple(f) for f in read_status(out, now=T0 + 10).failures] == [
        ("mt0", "`max_tokens` of request mt/0 must be at least 1, got 0", True),
        ("d", "no summary within `max_tokens` 4", False)]
    words = " ".join(runner.invoke(app, ["status", str(out)]).output.split())
    assert "`max_tokens` of request mt/0 must be at least 1" in words and "no summary within --max-tokens 4" in words


def test_running_job_eta_and_cli(tmp_path):
    out = tmp_path / "out"
    make_job(out)
    assert not lock_held(out)
    held = lock_out_dir(out)  # what a run holds while it works
    try:
        assert lock_held(out)
        s = read_status(out, now=T0 + 200)
        assert s.running and s.elapsed_seconds == 200 and s.eta_seconds == 200.0  # 2 left at 2 per 200 s
        r = runner.invoke(app, ["status", str(out)])
        assert r.exit_code == 0, r.output
        assert "running (pid 4321)" in r.output and "3 done, 1 failed, 2 pending" in r.output
        assert "15.5 s" in r.output  # throttled
        r = runner.invoke(app, ["status", str(out), "--json"])
        assert json.loads(r.stdout)["eta_seconds"] > 0
        # the documents in flight, from the progress file the run rewrites every few seconds
        (out / "progress.json").write_text(json.dumps({
            "time": T0 + 198, "in_flight": ["d4", "d5"], "reading": ["d5", 312, 1204], "writing": [["d4", 17]],
            "decode_tok_s": 2.5, "prompt_tok_s": 3.9, "hit_rate": 0.9}))
        assert read_status(out).progress["reading"] == ["d5", 312, 1204]
        r = runner.invoke(app, ["status", str(out)])
        assert "d5: 312/1,204 prompt tokens" in r.output and "d4: 17 tokens so far" in r.output, r.output
        # a user trial: documents done since the snapshot was written were shown as waiting or writing
        (out / "progress.json").write_text(json.dumps({
            "time": T0 + 198, "in_flight": ["d3", "d4", "d5"], "reading": ["d3", 10, 20],
            "writing": [["d2", 9], ["d4", 17]], "decode_tok_s": 2.5, "prompt_tok_s": 3.9, "hit_rate": 0.9}))
        p = read_status(out).progress
        assert (p["in_flight"], p["writing"], p["reading"]) == (["d4", "d5"], [["d4", 17]], None)
        r = runner.invoke(app, ["status", str(out)])
        assert "d2" not in r.output and "d3:" not in r.output and "d4: 17 tokens so far" in r.output, r.output
    finally:
        held.close()
    assert not lock_held(out)  # released: the probe itself never keeps it
    lock_out_dir(out).close()  # and a new run can take it
    # the lock is free but the run's progress file is left: its process ended mid-work
    s = read_status(out)
    assert (s.running, s.state, s.stopped_at, s.eta_seconds) == (False, "interrupted", T0 + 198, None)
    r = runner.invoke(app, ["status", str(out)])
    assert "interrupted at" in r.output and "running (pid" not in r.output, r.output
    assert "d5: 312/1,204" not in r.output  # what it was doing is not shown as going on
    lines = r.output.splitlines()
    assert lines[lines.index("resume with:") + 1] == "mlx-tier run docs --out out"
    assert lines[lines.index("retry the failed ones with:") + 1] == "mlx-tier run docs --out out --retry-failed"
    (out / "progress.json").unlink()  # a run that ended cleanly removes it
    assert read_status(out).state == "stopped"


def test_status_bad_folder_exit_2(tmp_path):
    (tmp_path / "a.md").write_text("a summary\n")  # a user trial: a file was called "no such folder"
    for path, message in [(tmp_path / "nope", "no such folder"), (tmp_path, "not an mlx-tier output folder (no journal.jsonl)"),
                          (tmp_path / "a.md", "is a file, not a job's output folder")]:
        r = runner.invoke(app, ["status", str(path)])
        lines = [x for x in r.output.splitlines() if x.startswith("error:")]
        assert r.exit_code == 2 and len(lines) == 1 and message in lines[0], r.output


def test_journal_without_start_record(tmp_path):
    Journal(tmp_path).append({"id": "a", "status": "done", "output_tokens": 5, "seconds": 1.0})
    s = read_status(tmp_path)
    assert (s.total, s.done, s.pending, s.eta_seconds) == (None, 1, None, None)


def test_run_still_loading_its_model(tmp_path):
    (tmp_path / "run.pid").write_text("999999\n")  # --background started it; no journal yet
    held = lock_out_dir(tmp_path)
    try:
        s = read_status(tmp_path)
        assert s.running and s.pid == 999999 and (s.total, s.done) == (None, 0)
    finally:
        held.close()


def test_job_state_from_the_lock_the_progress_file_and_what_is_left():
    from mlx_tier.monitor.status import job_state

    assert job_state(True, True, 3) == job_state(True, False, None) == "running"
    assert job_state(False, True, 3) == job_state(False, True, 0) == "interrupted"  # its writer is gone
    assert job_state(False, False, 3) == job_state(False, False, None) == "stopped"
    assert job_state(False, False, 0) == "finished"


def test_hard_stopped_run_reads_as_interrupted_with_its_real_time_and_the_resume_command(tmp_path):
    """What a second Ctrl-C leaves: journal records up to the stop, progress.json as the killed
    process last wrote it, no lock held. Status says interrupted (not running), when, how long the
    run really worked (to its last progress, not to its last finished document), and how to resume."""
    out = tmp_path / "out"
    make_job(out)
    (out / "progress.json").write_text(json.dumps({
        "time": T0 + 160, "in_flight": ["d4"], "reading": None, "writing": [["d4", 9]], "decode_tok_s": 2.0,
        "prompt_tok_s": 5.0, "hit_rate": 0.5, "eta_seconds": 70.0}))
    s = read_status(out, now=T0 + 5000)
    assert (s.state, s.running, s.elapsed_seconds, s.eta_seconds) == ("interrupted", False, 160, None)
    r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0 and "interrupted at" in r.output and "in 160 s" in r.output, r.output
    assert max(map(len, r.output.splitlines())) <= 80
    r = runner.invoke(app, ["status", str(out), "--json"])
    assert json.loads(r.stdout)["state"] == "interrupted"


@pytest.mark.parametrize("finished", [0, 1])
def test_a_cleanly_stopped_run_is_timed_to_its_stop(tmp_path, finished):
    """A user trial: after a first Ctrl-C that left every document (none could finish in the
    grace), status said "0 done in 0.0 s of generation": a clean stop removes progress.json,
    and nothing dated the stop. The run's ``stopped`` record does, with or without a
    document finished before it; a complete run is still timed to its last document."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a", "b"], todo=["a", "b"], started=T0, pid=1, run="r1", run_t=4.0,
            mono=1.0, host="elsewhere", command="mlx-tier run docs --out out").write(Journal(out))
    lines = [{"id": "a", "status": "done", "output_tokens": 8, "run": "r1", "run_t": 30.0, "time": T0 + 30}][:finished]
    lines.append({"event": "stopped", "run": "r1", "run_t": 94.0, "time": T0 + 94})
    lines.append({"event": "stopped", "run": "r0", "run_t": 900.0, "time": T0 - 9})  # another run's
    with open(out / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    s = read_status(out, now=T0 + 500)
    assert (s.state, s.done, s.elapsed_seconds, s.todo_left) == ("stopped", finished, 90.0, 2 - finished)
    r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
    assert "in 90 s of generation" in " ".join(r.output.replace("│", " ").split()), r.output


def test_status_html_of_a_hard_stopped_run_says_interrupted_and_how_to_resume(tmp_path):
    import re

    from mlx_tier.monitor.page import write_report_html

    out = tmp_path / "out"
    make_job(out)
    (out / "progress.json").write_text(json.dumps({"time": T0 + 160, "in_flight": ["d4"], "reading": None,
                                                   "writing": [], "decode_tok_s": 0, "prompt_tok_s": 0,
                                                   "hit_rate": 0}))
    page = write_report_html(out).read_text()
    assert re.search(r'id="n-state" data-value="interrupted"', page)
    assert re.search(r'<p id="state-note">interrupted at [^<]*2 documents left\. Resume with:</p>', page)
    assert '<pre id="resume-command">mlx-tier run docs --out out</pre>' in page
    assert 'data-value="running' not in page


def test_running_eta_is_the_runs_own_estimate_less_its_age(tmp_path):
    out = tmp_path / "out"
    make_job(out)
    held = lock_out_dir(out)
    try:
        (out / "progress.json").write_text(json.dumps({"time": T0 + 190, "eta_seconds": 70.0, "in_flight": []}))
        assert read_status(out, now=T0 + 200).eta_seconds == 60.0  # written 10 s ago
        (out / "progress.json").write_text(json.dumps({"time": T0 + 190, "eta_seconds": None, "in_flight": []}))
        assert read_status(out, now=T0 + 200).eta_seconds is None  # the run is still estimating
        r = runner.invoke(app, ["status", str(out)])
        assert "estimating" in r.output, r.output
    finally:
        held.close()


def test_the_eta_is_aged_from_when_it_was_measured_not_from_a_rewrite_during_a_long_step(tmp_path):
    """A review: the heartbeat and the layer updates rewrite the last step's estimate with a fresh
    time, so during a long step the ETA stood still (600 s for 8 minutes), then dropped at once."""
    from mlx_tier.cli.render import in_flight_rows
    from mlx_tier.monitor.status import estimate_age

    out = tmp_path / "out"
    make_job(out)
    held = lock_out_dir(out)
    try:
        host, mono = "another-host", 5000.0  # the writer's monotonic clock, 480 s after its step's end
        snap = {"time": T0 + 190, "mono": mono, "host": host, "measured_mono": mono - 480, "eta_seconds": 600.0,
                "in_flight": [], "decode_tok_s": 2.0, "hit_rate": 0.5}
        (out / "progress.json").write_text(json.dumps(snap))
        assert read_status(out, now=T0 + 200).eta_seconds == 110.0  # 600 - 480 - the file's 10 s
        assert estimate_age(snap, T0 + 200, 0.0) == 490.0  # the file by wall time (another clock), then the 480
        assert estimate_age(snap | {"measured_mono": mono + 1}, T0 + 200, 0.0) == 10.0  # never negative
        assert estimate_age({k: v for k, v in snap.items() if k != "measured_mono"}, T0 + 200, 0.0) == 10.0
        rows = dict(in_flight_rows(snap | {"time": time.time()}))
        assert "(as of 480 s ago)" in rows["rates"], rows
    finally:
        held.close()


def test_a_progress_file_older_than_the_last_start_is_an_earlier_runs(tmp_path):
    """A progress file from before the journal's last start record was left by an earlier
    run (killed), not by this one: it neither makes the job "interrupted" nor shows as work."""
    out = tmp_path / "out"
    make_job(out)  # this run started at T0, ended cleanly with 2 pending
    (out / "progress.json").write_text(json.dumps({"time": T0 - 60, "in_flight": ["d1"], "writing": []}))
    s = read_status(out, now=T0 + 5000)
    assert (s.state, s.progress, s.stopped_at) == ("stopped", None, None)
    (out / "progress-2.json").write_text(json.dumps({"time": T0 - 1, "in_flight": ["d4"], "writing": []}))
    assert read_status(out, now=T0 + 5000).state == "stopped"  # a rank's file alike
    (out / "progress-2.json").write_text(json.dumps({"time": T0 + 150, "in_flight": ["d4"], "writing": []}))
    s = read_status(out, now=T0 + 5000)  # this run's rank, killed mid-work
    assert (s.state, s.stopped_at) == ("interrupted", T0 + 150)


def test_ranks_progress_files_merge_into_one_view(tmp_path):
    """Each rank rewrites its own progress-<k>.json (a shared file was removed by the first
    rank to finish while the others worked); status shows the documents of all of them,
    the freshest file's rates and estimate."""
    from mlx_tier.monitor.status import read_progress
    from mlx_tier.outdir.layout import progress_files, rank_progress_name

    out = tmp_path / "out"
    make_job(out)
    (out / rank_progress_name(0)).write_text(json.dumps({
        "time": T0 + 190, "in_flight": ["d4"], "reading": None, "writing": [["d4", 17]], "eta_seconds": 80.0}))
    (out / rank_progress_name(1)).write_text(json.dumps({
        "time": T0 + 195, "in_flight": ["d5"], "reading": ["d5", 10, 300], "writing": [], "eta_seconds": 60.0}))
    assert [p.name for p in progress_files(out)] == ["progress.json", "progress-0.json", "progress-1.json"]
    p = read_progress(out, since=T0)
    assert (sorted(p["in_flight"]), p["writing"], p["reading"], p["eta_seconds"]) == (
        ["d4", "d5"], [["d4", 17]], ["d5", 10, 300], 60.0)
    assert read_progress(out, since=T0 + 192)["in_flight"] == ["d5"]  # rank 0's is older than that start
    held = lock_out_dir(out)
    try:
        r = runner.invoke(app, ["status", str(out)])
        assert "d4: 17 tokens so far" in r.output and "d5: 10/300 prompt tokens" in r.output, r.output
    finally:
        held.close()
    (out / rank_progress_name(0)).write_text(json.dumps({  # rank 0 reads two prompts in one step
        "time": T0 + 190, "in_flight": ["d4", "d6"], "reading": ["d4", 5, 90], "also_reading": [["d6", 7, 80]],
        "writing": []}))
    p = read_progress(out, since=T0)
    assert p["reading"] == ["d5", 10, 300] and p["also_reading"] == [["d4", 5, 90], ["d6", 7, 80]]
    from mlx_tier.monitor.status import _without
    assert _without(p, {"d6"})["also_reading"] == [["d4", 5, 90]]  # finished since: not being read
    # the prompt rate is the freshest snapshot's: on its own prompt, never on another rank's
    from mlx_tier.cli.render import in_flight_rows

    rows = dict.fromkeys(text for label, text in in_flight_rows({**p, "prompt_tok_s": 3.5}) if label == "reading")
    assert list(rows) == ["d4: 5/90 prompt tokens", "d6: 7/80 prompt tokens",
                          "d5: 10/300 prompt tokens (3.5 prompt tok/s)"]
    decoding = {**p, "reading": None, "prompt_tok_s": 3.5}  # the freshest rank decodes: no prompt of its own
    assert not [t for label, t in in_flight_rows(decoding) if "tok/s" in t and label == "reading"]


def test_taking_the_folder_removes_earlier_progress_files_a_rank_does_not(tmp_path):
    from mlx_tier.outdir.jobdir import JobDir

    out = tmp_path / "out"
    make_job(out)
    names = ["progress.json", "progress-0.json", "progress-7.json"]
    for name in names:
        (out / name).write_text("{}")
    (out / "ranks" / "r1").mkdir(parents=True)
    with JobDir(out, "ranks/r1/journal-0.jsonl", part=True):  # the other ranks' files are live
        assert all((out / n).exists() for n in names)
    with JobDir(out):
        assert not list(out.glob("progress*.json"))


def test_a_run_asked_to_stop_reads_as_stopping_not_with_its_eta(tmp_path):
    """After a first Ctrl-C the run finishes the summaries being written: status says it is
    stopping and shows no ETA for the whole job (a new-user trial saw "running", "ETA 51s")."""
    out = tmp_path / "out"
    make_job(out)
    progress = {"time": T0 + 160, "in_flight": ["d4"], "reading": None, "writing": [["d4", 9]],
                "decode_tok_s": 2.0, "prompt_tok_s": 5.0, "hit_rate": 0.5, "eta_seconds": 70.0}
    held = lock_out_dir(out)
    try:
        for stopping, state in ((True, "stopping (pid"), (False, "running (pid")):
            (out / "progress.json").write_text(json.dumps({**progress, "stopping": stopping}))
            r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
            assert r.exit_code == 0 and state in r.output, r.output
            eta_line = next(x for x in r.output.splitlines() if x.strip("│ ").startswith("ETA"))
            assert ("none: stopping" in eta_line) == stopping, r.output
            assert max(map(len, r.output.splitlines())) <= 80
    finally:
        held.close()


def test_a_long_step_reads_as_running_with_how_long_it_has_run(tmp_path):
    """The run's heartbeat rewrites progress.json during a step that runs long (deep in MLX
    or the kernel, near a memory limit): status says how long, instead of a stale snapshot."""
    out = tmp_path / "out"
    make_job(out)
    progress = {"time": T0 + 160, "in_flight": ["d4"], "reading": ["d4", 100, 900], "writing": [],
                "decode_tok_s": 2.0, "prompt_tok_s": 5.0, "hit_rate": 0.5, "eta_seconds": 70.0,
                "busy_seconds": 42.4, "rss_bytes": 2**30, "memory_available": 2**28, "stopping": False}
    held = lock_out_dir(out)
    try:
        (out / "progress.json").write_text(json.dumps(progress))
        r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
        assert r.exit_code == 0 and "its current step has run 42 s" in " ".join(r.output.split()), r.output
    finally:
        held.close()


def test_rate_charts_say_why_they_have_fewer_points_than_documents():
    """A user trial: the hit-rate and read charts said "5 points, one per finished or failed
    document" for a 10-document job: documents finishing in the same step read nothing in
    between, so they add no rate point. The caption says so; the memory chart keeps one per
    document."""
    from mlx_tier.monitor.page import charts_section
    from mlx_tier.monitor.view import samples

    entries = [{"event": "start"}]
    for i in range(4):  # two steps, two documents finishing in each
        step = i // 2 + 1
        entries.append({"id": f"d{i}", "status": "done", "time": float(i),
                        "sample": {"decode_tok_s": 5.0, "tokens": 10 * step, "hits": 8 * step, "misses": 2 * step,
                                   "bytes_read": 2**20 * step, "rss_bytes": 2**30, "resident_bytes": 1, "budget_bytes": 2}})
    points = samples(entries)
    assert sum(p["hit_rate"] is not None for p in points) == 2 and len(points) == 4
    html = charts_section({"samples": points, "throttle": {}, "thermal": [], "throttle_time": []})
    hit = html[html.index('id="chart-hit-rate"'):]
    assert "2 points, documents finishing in the same step share one point" in hit[:hit.index("</figure>")]
    memory = html[html.index('id="chart-memory"'):]
    assert "4 points, one per finished or failed document" in memory[:memory.index("</figure>")]


def test_the_resume_command_runs_from_another_folder(tmp_path, monkeypatch):
    """A user trial: status printed `mlx-tier run odd.jsonl --out o_odd` from another folder,
    where neither path exists. The run's folder is recorded; status adds `cd FOLDER &&`
    when it is read elsewhere (the page, its retry command, likewise)."""
    job = tmp_path / "work dir"
    job.mkdir()
    out = job / "o"
    out.mkdir()
    JobInfo(input="in", ids=["a"], todo=["a"], started=T0, pid=1, command="mlx-tier run in --out o",
            cwd=str(job)).write(Journal(out))
    Journal(out).append({"id": "a", "status": "failed", "error": "empty document"})
    monkeypatch.chdir(job)
    assert read_status(out, now=T0 + 1).command == "mlx-tier run in --out o"
    monkeypatch.chdir(tmp_path)
    assert read_status(out, now=T0 + 1).command == f"cd '{job}' && mlx-tier run in --out o"
    r = runner.invoke(app, ["status", str(out)])
    assert f"cd '{job}' && mlx-tier run in --out o --retry-failed" in r.output, r.output


def test_a_stopped_redo_is_pending_not_done(tmp_path):
    """A user trial: a rerun redoing a changed document (its earlier summary stale) was
    stopped before writing it; status said "finished, 1 done" with its resume command, as
    the earlier run's ``done`` record was taken for this run's. A document the last run set
    out to do is pending until that run writes it; a failed one it retries stays failed
    (a plain rerun would not retry it); one it did not set out to do keeps its record."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["x", "y", "f"], todo=["x", "y", "f", "g"], started=T0 - 600, pid=1, run="r1",
            command="mlx-tier run docs --out out").write(Journal(out))
    lines = [{"id": i, "status": "done", "output_tokens": 8, "run": "r1", "time": T0 - 500} for i in ("x", "y")]
    lines.append({"id": "f", "status": "failed", "error": "too long", "run": "r1", "time": T0 - 400})
    with open(out / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    JobInfo(input="docs", ids=["x", "y", "f"], todo=["x", "f"], started=T0, pid=2, run="r2",
            command="mlx-tier run docs --out out").write(Journal(out))  # x changed since; f retried
    s = read_status(out, now=T0 + 100)
    assert (s.state, s.done, s.failed, s.pending, s.redoing) == ("stopped", 1, 1, 1, ["x"])
    from mlx_tier.monitor.view import build_view

    shown = {d["id"]: (d["status"], d["summary"]) for d in build_view(out, now=T0 + 100)["documents"]}
    assert shown["x"] == ("pending", None) and shown["y"][0] == "done"  # the page: no stale summary shown as done
    with open(out / "journal.jsonl", "a") as f:
        f.write(json.dumps({"id": "x", "status": "done", "output_tokens": 9, "run": "r2", "time": T0 + 50}) + "\n")
    s = read_status(out, now=T0 + 100)
    assert (s.state, s.done, s.pending, s.done_this_run) == ("finished", 2, 0, 1)  # f stays failed


def test_a_failed_document_a_plain_run_set_out_to_retry_is_pending_until_tried(tmp_path):
    """A review: y failed (empty); written since, a plain rerun set out to retry it and was
    stopped while reading it. Status said "finished, not running, 1 failed: y: empty
    document" with a --retry-failed command, where report.json said 1 pending: a plain
    rerun retries it. (Retried by --retry-failed and stopped, it stays failed: a plain rerun
    would leave it.)"""
    for retry, want in ((False, ("stopped", 1, 0, 1)), (True, ("finished", 1, 1, 0))):
        out = tmp_path / f"out-{retry}"
        out.mkdir()
        JobInfo(input="docs", ids=["x", "y"], todo=["x", "y"], started=T0 - 600, pid=1, run="r1",
                command="mlx-tier run docs --out out").write(Journal(out))
        lines = [{"id": "x", "status": "done", "output_tokens": 8, "run": "r1", "time": T0 - 500},
                 {"id": "y", "status": "failed", "error": "empty document", "run": "r1", "time": T0 - 400}]
        with open(out / "journal.jsonl", "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in lines))
        JobInfo(input="docs", ids=["x", "y"], todo=["y"], started=T0, pid=2, run="r2", retry_failed=retry,
                command="mlx-tier run docs --out out").write(Journal(out))
        s = read_status(out, now=T0 + 100)
        assert (s.state, s.done, s.failed, s.pending) == want, retry
        from mlx_tier.monitor.view import build_view

        shown = {d["id"]: d["status"] for d in build_view(out, now=T0 + 100)["documents"]}
        assert shown["y"] == ("failed" if retry else "pending")


def test_a_request_files_job_speaks_of_requests(tmp_path):
    """A user trial: `status` of a batch request file's job said "2 documents left". Its
    answers file tells it apart."""
    from mlx_tier.monitor.status import describe_state

    out = tmp_path / "out"
    make_job(out)
    assert read_status(out, now=T0 + 5000).noun == "document"
    (out / "output.jsonl").write_text("")
    s = read_status(out, now=T0 + 5000)
    assert s.noun == "request" and s.pending == 2 and "2 requests left" in describe_state(s, T0 + 5000)
    r = runner.invoke(app, ["status", str(out)])
    assert r.exit_code == 0 and "6 total: 3 done, 1 failed, 2 pending" in r.output, r.output
    assert "requests" in r.output and "2 of its requests left" in " ".join(r.output.split()), r.output
    assert "requests/hour" in r.output and "documents" not in r.output, r.output
    # a user trial: the page said "Documents", "Documents / hour", "Redone: document changed"
    from mlx_tier.monitor.page import numbers_section
    from mlx_tier.monitor.view import build_view

    html = numbers_section(build_view(out, now=T0 + 5000))
    assert "Requests / hour" in html and "Redone: request changed" in html and "requests answered" in html
    assert "Document" not in html and "document changed" not in html, html


def test_the_speed_row_says_it_counts_finished_summaries(tmp_path):
    """A user trial: 20 s into a run, status said "0.00 output tok/s this run ...; 0 tokens in
    all" beside seven summaries being written (19 tokens each so far). The figures are of
    finished summaries, and say so; the tokens being written are in the writing rows."""
    out = tmp_path / "out"
    make_job(out)
    held = lock_out_dir(out)
    try:
        (out / "progress.json").write_text(json.dumps({"time": T0 + 190, "eta_seconds": 70.0, "in_flight": ["d4"],
                                                       "writing": [["d4", 19]]}))
        r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
    finally:
        held.close()
    words = " ".join(r.output.replace("│", " ").split())
    # a trial: its tok/s also counts the calls a stopped run kept of a long document not finished
    assert "this run (its finished documents and the tokens it generated, over its generation time); 125 " \
           "tokens in the job's finished documents" in words, r.output
    assert "19 tokens so far" in words and max(map(len, r.output.splitlines())) <= 80, r.output


def test_a_summary_copied_by_a_run_with_nothing_to_do_is_done(tmp_path):
    """A user trial: a document edited to another's text was given that summary by a rerun
    with nothing to generate (no start record); status then took it for a redo of the last
    run left undone: "stopped, 1 document left", where report.json said 3 done."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["x", "y"], todo=["x", "y"], started=T0, pid=1, run="r1",
            command="mlx-tier run docs --out out").write(Journal(out))
    lines = [{"id": i, "status": "done", "output_tokens": 8, "run": "r1", "time": T0 + 10} for i in ("x", "y")]
    lines.append({"id": "y", "status": "done", "output_tokens": 8, "run": "r2", "reused": "x", "time": T0 + 99})
    with open(out / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    s = read_status(out, now=T0 + 100)
    assert (s.state, s.done, s.pending, s.redoing) == ("finished", 2, 0, [])


def test_a_run_with_nothing_to_do_sets_the_jobs_documents_and_ends_a_stopped_redo(tmp_path):
    """A review: after a rerun that only copied summaries (a document added as a copy), status
    said "3 total" where report.json said 5; after a stopped `--redo-changed` run, a plain
    run that kept both summaries left status saying "stopped, 2 documents left". A run with
    nothing to generate journals the job's documents as it found them (``triaged``)."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["x", "y"], todo=["x", "y"], started=T0 - 600, pid=1, run="r1",
            command="mlx-tier run docs --out out").write(Journal(out))
    lines = [{"id": i, "status": "done", "output_tokens": 8, "run": "r1", "time": T0 - 500} for i in ("x", "y")]
    with open(out / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    JobInfo(input="docs", ids=["x", "y"], todo=["x", "y"], started=T0 - 100, pid=2, run="r2",
            command="mlx-tier run docs --out out --redo-changed").write(Journal(out))  # stopped before writing
    s = read_status(out, now=T0)
    assert (s.state, s.pending, s.redoing) == ("stopped", 2, ["x", "y"])
    with open(out / "journal.jsonl", "a") as f:  # a plain rerun keeps both; a copy z of x was added
        f.write(json.dumps({"id": "z", "status": "done", "output_tokens": 8, "reused": "x", "run": "r3"}) + "\n")
        f.write(json.dumps({"event": "triaged", "ids": ["x", "y", "z"], "todo": [], "run": "r3"}) + "\n")
    s = read_status(out, now=T0)
    assert (s.state, s.total, s.done, s.pending, s.redoing) == ("finished", 3, 3, 0, [])
    from mlx_tier.monitor.view import build_view

    assert [d["id"] for d in build_view(out, now=T0)["documents"]] == ["x", "y", "z"]


def test_the_throttled_time_is_the_last_runs_as_the_figures_beside_it(tmp_path):
    """A review: a run capped by `--max-tok-s` (6.4 s throttled), then a rerun at full speed:
    status said "throttled 6.4 s" among the last run's figures, beside its throttle row
    saying "full speed"."""
    out = tmp_path / "out"
    out.mkdir()
    for run, seconds in (("r1", 6.4), ("r2", 0.0)):
        JobInfo(input="docs", ids=["x", "y"], todo=["x"] if run == "r1" else ["y"], started=T0, pid=1, run=run,
                command="mlx-tier run docs --out out").write(Journal(out))
        with open(out / "journal.jsonl", "a") as f:
            f.write(json.dumps({"id": "x" if run == "r1" else "y", "status": "done", "output_tokens": 8,
                                "throttled_seconds": seconds, "run": run, "time": T0 + 10}) + "\n")
    assert read_status(out, now=T0 + 100).throttled_seconds == 0.0


def test_a_distributed_runs_loading_time_is_its_ranks_not_its_launchers(tmp_path):
    """A user trial: `--ranks 2` said "loading 5.4 s apart" and report.json 5.389, while status
    said 0.0 s (0.017: the launcher's start record, written before its ranks load) and the page
    "Loading time 0 s"."""
    out = tmp_path / "out"
    out.mkdir()
    lines = [{"event": "start", "input": "docs", "ids": ["a", "b"], "todo": ["a", "b"], "started": T0, "pid": 1,
              "run": "r1", "run_t": 0.017, "writes": True},
             {"event": "loaded", "run": "r1", "run_t": 5.6}, {"event": "loaded", "run": "r1", "run_t": 5.389},
             {"id": "a", "status": "done", "output": "a.md", "run": "r1", "run_t": 9.0, "time": T0 + 9}]
    (out / "journal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_status(out, now=T0 + 20).load_seconds == 5.6  # the last rank's, as report.json counts it
    lines[1:3] = []  # a one-process run: its start record is written once its model is loaded
    (out / "journal.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_status(out, now=T0 + 20).load_seconds == 0.017


def test_a_run_ending_while_its_journal_is_read_reads_as_finished(tmp_path, monkeypatch):
    """A review: status read the journal, then probed the lock. A run that wrote its last record
    and released the lock in between read as "stopped, 1 document left" with a resume command."""
    import mlx_tier.monitor.status as status_mod

    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a", "b"], todo=["a", "b"], started=T0, pid=4321, command="mlx-tier run docs").write(
        Journal(out))
    Journal(out).append({"id": "a", "status": "done", "output_tokens": 5, "time": T0 + 10})
    held = [lock_out_dir(out)]
    real = status_mod.lock_held

    def probe(path):  # the first probe finds the run; then it writes b's record and ends
        running = real(path)
        if held:
            Journal(out).append({"id": "b", "status": "done", "output_tokens": 5, "time": T0 + 20})
            held.pop().close()
        return running

    monkeypatch.setattr(status_mod, "lock_held", probe)
    s = read_status(out, now=T0 + 30)
    assert (s.state, s.done, s.pending, s.running) == ("finished", 2, 0, False), s


def test_a_rerun_loading_its_model_is_starting_not_the_last_run_still_running(tmp_path):
    """A review: while a rerun found its documents and loaded its model (its start record is written
    once the model is loaded), status showed the run before it as running: its pid, and a generation
    time, rate and ETA counted from its start a day before. The run now says in the lock file when it
    took it; status names it starting, and the figures are the last run's as it ended."""
    from mlx_tier.monitor.page import numbers_section
    from mlx_tier.monitor.view import build_view
    from mlx_tier.outdir.jobdir import JobDir

    out = tmp_path / "out"
    make_job(out)
    JobInfo(input="docs", ids=["a"], todo=["a"], started=time.time() - 86_400, pid=4321, host=_host()).write(
        Journal(out))
    Journal(out).append({"id": "a", "status": "done", "output_tokens": 50, "time": time.time() - 86_300})
    ended = read_status(out)
    assert ended.state == "finished"
    with JobDir(out):  # a rerun takes the folder, then finds, hashes and loads
        s = read_status(out)
        assert (s.state, s.running, s.pid, s.eta_seconds) == ("starting", True, os.getpid(), None)
        assert (s.elapsed_seconds, s.documents_per_hour, s.done) == (ended.elapsed_seconds,
                                                                     ended.documents_per_hour, 1)
        r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "200"})
        words = " ".join(r.output.split())
        assert f"starting (pid {os.getpid()}): finding the documents and loading the model" in words, words
        assert "loading its model; the rows below are of the run before it" in words and "run before" in words
        assert "resume with" not in words
        assert "starting (pid" in numbers_section(build_view(out))
        # once it has started (its start record written), it is the running run
        JobInfo(input="docs", ids=["a"], todo=[], started=time.time(), pid=os.getpid(), host=_host()).write(
            Journal(out))
        assert read_status(out).state == "running"
    assert read_status(out).state == "finished"


def test_a_first_run_loading_its_model_is_starting_with_no_run_before_it(tmp_path):
    from mlx_tier.outdir.jobdir import JobDir

    out = tmp_path / "out"
    with JobDir(out):  # created now: no journal yet
        s = read_status(out)
        assert (s.state, s.pid, s.total) == ("starting", os.getpid(), None)
        words = " ".join(runner.invoke(app, ["status", str(out)], env={"COLUMNS": "200"}).output.split())
        assert "loading its model" in words and "run before" not in words, words
        assert "finding the documents and loading the model" in words and "figures below" not in words
        assert "none yet (its model is loading)" in words and "that run" not in words, words  # a review
        from mlx_tier.monitor.page import render_page
        from mlx_tier.monitor.view import build_view

        page = render_page(build_view(out))
        assert "no rates yet" in page and "the rates of the run before it" not in page


def test_a_run_loading_after_an_idle_rerun_is_this_run_not_the_idle_one(tmp_path):
    """A review: status showed two "this run" rows, "nothing to do" and "loading its model"."""
    from mlx_tier.outdir.jobdir import JobDir

    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a"], todo=["a"], started=time.time() - 100, pid=4321, host=_host()).write(
        Journal(out))
    Journal(out).append({"id": "a", "status": "done", "output_tokens": 5, "time": time.time() - 90})
    Journal(out).append({"event": "triaged", "ids": ["a"], "todo": []})  # a rerun with nothing to do
    assert read_status(out).idle_rerun
    with JobDir(out):
        s = read_status(out)
        assert (s.state, s.idle_rerun, s.starting) == ("starting", False, True)
        r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "200"})
        assert "nothing to do" not in r.output and "loading its model" in r.output, r.output


def test_a_lock_of_an_older_version_or_another_host_reads_as_running(tmp_path):
    """A lock file that says nothing (an older version's) or a start record of another host (a
    distributed run's rank, another clock): no claim that a run is still loading."""
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["a"], todo=["a"], started=time.time() + 3600, pid=1, host="rank-host").write(
        Journal(out))
    from mlx_tier.outdir.jobdir import JobDir

    with JobDir(out):
        assert read_status(out).state == "running"
    held = lock_out_dir(out)  # a lock taken without saying who: an older version's
    try:
        (out / ".mlx-tier.lock").write_text("")
        assert read_status(out).state == "running"
    finally:
        held.close()


def _host():
    import socket

    return socket.gethostname()


def test_a_killed_runs_time_reads_the_same_before_and_after_the_rerun_rebuilds_it(tmp_path):
    """A user trial: `status` timed a killed run to its last progress snapshot (15 s of
    generation), and once a rerun had cleared that snapshot, the run's rebuilt record timed
    it to its last journal record (11 s). The rerun now journals the snapshot's clock in
    the killed run's name before clearing it, so both read 15 s (a rank's file too)."""
    from mlx_tier.job.report import unreported_runs
    from mlx_tier.outdir.jobdir import JobDir

    out = tmp_path / "out"
    out.mkdir()
    import socket

    JobInfo(input="docs", ids=["a", "b"], todo=["a", "b"], started=T0, pid=4321, run="killed", run_t=2.0,
            reports=True, host=socket.gethostname()).write(Journal(out))
    Journal(out).append({"id": "a", "status": "done", "output_tokens": 30, "run": "killed", "run_t": 11.0})
    (out / "progress.json").write_text(json.dumps({"time": T0 + 15, "run": "killed", "run_t": 17.0,
                                                   "in_flight": ["b"]}))
    (out / "progress-1.json").write_text(json.dumps({"time": T0 + 14, "run": "killed", "run_t": 16.0}))
    (out / "progress-2.json").write_text("{torn")  # skipped
    before = read_status(out, now=T0 + 500)
    assert (before.state, before.elapsed_seconds) == ("interrupted", 15.0)
    with JobDir(out):  # a rerun takes the folder
        assert not (out / "progress.json").exists()
        entries = list(Journal(out).entries())
        (rebuilt,) = unreported_runs(entries, set())
        assert (rebuilt["generation_seconds"], rebuilt["seconds"]) == (15.0, 17.0)
        loading = read_status(out, now=T0 + 600)  # the rerun loading its model: the killed run's figures
        assert (loading.starting, loading.elapsed_seconds) == (True, 15.0)
    assert [r for r in entries if r.get("event") == "last_progress"] == [
        {"event": "last_progress", "run": "killed", "run_t": 17.0, "time": entries[-1]["time"]}]
