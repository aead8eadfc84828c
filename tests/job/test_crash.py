"""Invariant 3 under crashes and signals: a run killed with SIGKILL mid-job and rerun
leaves every document with exactly one complete output, never regenerates a
finished one and leaves no temporary files; SIGTERM exits 143 with the exact
command that resumes; one document failing (MLX out-of-memory errors included)
fails alone, and only `--retry-failed` runs it again.
"""

import json
import os
import shlex
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from support.jobs import WORDS, _short_context, done_lines, make_docs, small_moe  # noqa: F401 - fixtures
from support.output import command_after
from typer.testing import CliRunner

import mlx_tier.cli.render as render
from mlx_tier.cli.main import app
from mlx_tier.job.report import UNREPORTED
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import lock_held

runner = CliRunner()










def test_sigkill_mid_run_then_rerun(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    ids = [p.stem for p in make_docs(docs, 6)]
    # Two documents at a time: documents of one length decoded in one pool finish in the same step.
    args = ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "16", "--format", "jsonl",
            "--batch-size", "2"]
    r = runner.invoke(app, [*args, "--background"])
    assert r.exit_code == 0, r.output
    assert command_after(r.output, "watch it with:") == f"mlx-tier status {out}"
    pid = int((out / "run.pid").read_text())

    def wait_for(condition):
        deadline = time.monotonic() + 120
        while not condition():
            exited = os.waitpid(pid, os.WNOHANG)[0] == pid
            assert not exited and time.monotonic() < deadline, (out / "run.log").read_text()
            time.sleep(0.01)

    try:
        wait_for(lambda: lock_held(out))
        # While it is active (loading the model), a second run on the folder is refused: exit 2, nothing loaded.
        second = runner.invoke(app, args)
        assert second.exit_code == 2 and "another mlx-tier run is using this output folder" in second.output
        assert runner.invoke(app, [*args, "--background"]).exit_code == 2
        wait_for(lambda: bool(done_lines(out)))
        os.kill(pid, signal.SIGKILL)
        st = read_status(out)
        assert st.pid == pid and st.total == 6
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    finished = {i: (out / f"{i}.md").stat().st_mtime_ns for i in done_lines(out)}
    assert 0 < len(finished) < len(ids), "the kill did not land mid-run"
    assert not read_status(out).running  # the lock died with the process
    assert read_status(out).state == "interrupted"  # its progress file outlived it: not a clean stop
    r = runner.invoke(app, ["status", str(out)])
    assert "interrupted at" in r.output and command_after(r.output, "resume with:").startswith("mlx-tier run "), r.output
    half = out / f".{ids[-1]}.md.a1b2c3d4.tmp"  # as a kill inside write_atomic leaves it
    half.write_text("half a summ")
    # Younger ones are spared (a `status --html` may be writing): age this one, and any the
    # kill itself left (documents decoded together finish together, so it may land mid-write).
    for tmp in out.glob(".*.tmp"):
        os.utime(tmp, (0, time.time() - 3600))

    r = runner.invoke(app, args)  # the same command, in the foreground
    assert r.exit_code == 0, r.output
    assert done_lines(out) == Counter(ids)  # exactly one done record each: nothing finished was regenerated
    assert {i: (out / f"{i}.md").stat().st_mtime_ns for i in finished} == finished
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    lines = [json.loads(x) for x in (out / "summaries.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == ids  # one line per document, none twice
    assert all(x["summary"] == (out / f"{x['id']}.md").read_bytes().decode().removesuffix("\n") for x in lines)
    st = read_status(out)
    assert (st.running, st.done, st.pending, st.failed) == (False, 6, 0, 0)
    assert f"loading {small_moe}" in (out / "run.log").read_text()  # the background run's output went to its log
    # The killed run wrote no report.json: its record is rebuilt from the journal, so the job's
    # time and tokens keep it; a later rerun does not count it twice.
    killed, now = json.loads((out / "report.json").read_text())["runs"]
    assert killed["ended"] == UNREPORTED and killed["run"] != now["run"]
    # a kill between a rename and its done record: the rerun recovers that summary, the killed run's work
    recovered = [r for r in Journal(out).entries() if r.get("recovered")]
    assert (killed["done"], now["done"]) == (len(finished) + len(recovered), 6 - len(finished) - len(recovered))
    mine = [r for r in Journal(out).entries() if r.get("run") == killed["run"] and r.get("status") == "done"]
    assert killed["output_tokens"] == sum(r["output_tokens"] for r in mine + recovered) > 0
    assert 0 < killed["load_seconds"] < killed["seconds"] and killed["generation_seconds"] > 0
    assert runner.invoke(app, args).exit_code == 0  # nothing to do
    report = json.loads((out / "report.json").read_text())
    assert [r.get("run") for r in report["runs"][:2]] == [killed["run"], now["run"]] and len(report["runs"]) == 3
    assert report["totals"]["output_tokens"] == sum(r["output_tokens"] for r in report["runs"])


def test_sigterm_exits_143_with_the_resume_command(tmp_path, small_moe, monkeypatch):  # noqa: F811
    paths = make_docs(tmp_path / "docs", 4)
    out = tmp_path / "out"
    signals: list[int] = []  # signals to send after the next document finishes
    finished = render.RichReporter.finished

    def finished_then_signal(self, result, cache):
        finished(self, result, cache)
        while signals:
            os.kill(os.getpid(), signals.pop())

    monkeypatch.setattr(render.RichReporter, "finished", finished_then_signal)
    stdin = "\n".join(str(p) for p in paths) + "\n"
    signals[:] = [signal.SIGTERM]
    # One document at a time, so that a stop leaves documents pending.
    r = runner.invoke(app, ["run", "-", "--out", str(out), "--model", str(small_moe), "--max-tokens", "4",
                            "--batch-size", "1"], input=stdin)
    assert r.exit_code == 143, r.output
    resume = command_after(r.output, "Resume with:")
    assert resume == (f"mlx-tier run - --out {out} --model {small_moe} --max-tokens 4 --batch-size 1 "
                      f"< {out / 'inputs.txt'}")
    assert len(done_lines(out)) == 1

    command, stdin_file = resume.split(" < ")
    signals[:] = [signal.SIGTERM, signal.SIGTERM]  # a second one abandons the step at once
    r = runner.invoke(app, shlex.split(command)[1:], input=Path(stdin_file).read_text())
    assert r.exit_code == 143 and "terminated; finished summaries are kept. Resume with:" in r.output
    assert command_after(r.output, "Resume with:") == resume
    assert len(done_lines(out)) == 2

    r = runner.invoke(app, shlex.split(command)[1:], input=Path(stdin_file).read_text())
    assert r.exit_code == 0, r.output
    assert done_lines(out) == Counter(p.stem for p in paths)


class FaultyModel:
    """The tiered model, raising MLX's out-of-memory errors on prompts that contain a marker word."""

    def __init__(self, model, faults: dict[tuple[int, ...], BaseException]):
        self._model, self._faults = model, faults

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, inputs, cache=None):
        rows = inputs.tolist() if inputs.ndim == 2 else [inputs.tolist()]
        for marker, error in self._faults.items():
            if any(row[i:i + len(marker)] == list(marker) for row in rows for i in range(len(row))):
                raise error
        return self._model(inputs, cache=cache)


def test_failing_documents_fail_alone_and_retry_failed_reruns_only_them(tmp_path, small_moe, monkeypatch):  # noqa: F811
    from mlx_tier.engine import load as tiered

    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(o) + "\n" for o in [
        {"custom_id": "req/ok", "text": "Bees carry pollen between flowers."},
        {"custom_id": "req/metal", "text": "Zyxwv the river floods every spring."},
        {"custom_id": "req/alloc", "text": "Qjqkx the library opens at nine."},
    ]))
    out = tmp_path / "out"
    args = ["run", str(inp), "--out", str(out), "--model", str(small_moe), "--max-tokens", "3", "--format", "jsonl"]
    load = tiered.load

    def faulty_load(path, cache_gb=None, **kw):
        model, tok = load(path, cache_gb=cache_gb, **kw)
        faults = {
            tuple(tok.encode("Zyxwv")): RuntimeError("[metal::malloc] Attempting to allocate 68719476736 bytes "
                                                     "which is greater than the maximum allowed buffer size"),
            tuple(tok.encode("Qjqkx")): MemoryError("std::bad_alloc"),
        }
        return FaultyModel(model, faults), tok

    monkeypatch.setattr(tiered, "load", faulty_load)
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    docs = {d["id"]: d for d in json.loads((out / "report.json").read_text())["documents"]}
    assert docs["req__ok"]["status"] == "done"
    assert docs["req__metal"]["error"].startswith("RuntimeError: [metal::malloc]")
    assert docs["req__alloc"]["error"] == "MemoryError: std::bad_alloc"
    ok_mtime = (out / "req__ok.md").stat().st_mtime_ns

    monkeypatch.setattr(tiered, "load", load)  # the memory is back
    records_before = [e for e in Journal(out).entries() if "id" in e]
    r = runner.invoke(app, args)  # a plain rerun leaves failed documents failed
    assert r.exit_code == 1 and "2 documents failed in an earlier run; not retried" in r.output, r.output
    assert [e for e in Journal(out).entries() if "id" in e] == records_before  # nothing was run

    r = runner.invoke(app, [*args, "--retry-failed"])
    assert r.exit_code == 0, r.output
    assert "retrying 2 failed documents" in r.output
    assert (out / "req__ok.md").stat().st_mtime_ns == ok_mtime
    assert done_lines(out) == Counter(["req__ok", "req__metal", "req__alloc"])
    lines = [json.loads(x) for x in (out / "summaries.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["req/ok", "req/metal", "req/alloc"]  # as given, once each


def test_sigterm_while_loading_the_model_exits_143(tmp_path, monkeypatch, small_moe):  # noqa: F811
    from mlx_tier.engine import load as tiered
    from mlx_tier.job import model_setup

    def load_then_terminated(path, cache_gb=None, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(tiered, "load", load_then_terminated)
    monkeypatch.setattr(model_setup, "run_budget", lambda *a: None)  # the memory split reads the checkpoint first
    make_docs(tmp_path / "docs", 1)
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", str(tmp_path / "docs"), "--out", str(out), "--model", str(small_moe),
                                 "--max-tokens", "8"])
    assert r.exit_code == 143, r.output
    # a user trial: "finished summaries are kept. Resume with:" of a job that never started
    assert "terminated; the job had not started, nothing was written. Run it again with:" in r.output
    assert command_after(r.output, "Run it again with:") == (f"mlx-tier run {tmp_path / 'docs'} --out {out} "
                                                       f"--model {small_moe} --max-tokens 8")
    assert not out.exists()  # a run that never started leaves no folder
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is restored


def test_a_rerun_with_nothing_pending_clears_an_earlier_runs_progress_file(tmp_path, small_moe):  # noqa: F811
    """The review's case: a progress file left by a hard stop kept a finished job reading
    "interrupted" after a later clean run that had nothing to do (it never reached the end
    of the generation loop, where the file was removed). A run taking the folder's lock
    removes it, a distributed run's rank files too."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    args = ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "3"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert not (out / "progress.json").exists()  # a clean end removes it
    assert read_status(out).state == "finished"
    for name in ("progress.json", "progress-1.json"):  # as a hard stop leaves it: after the run's start
        (out / name).write_text(json.dumps({"time": time.time(), "in_flight": ["doc00"], "writing": []}))
    assert read_status(out).state == "interrupted"
    r = runner.invoke(app, args)  # nothing pending
    assert r.exit_code == 0, r.output
    s = read_status(out)
    assert (s.state, s.pending) == ("finished", 0)
    assert not list(out.glob("progress*.json"))


@pytest.mark.parametrize("error, left", [(RuntimeError("a bug"), True), ("disk full", False)])
def test_a_crash_leaves_the_progress_file_a_full_disk_does_not(tmp_path, small_moe, monkeypatch, error, left):  # noqa: F811
    """docs/cli.md: a progress file left while no process holds the lock means a run that ended
    mid-work (a crash: "interrupted"); a full disk is a clean stop ("stopped")."""
    from mlx_tier.errors import JobError
    from mlx_tier.job import run as jobs

    def work_then_fail(p, *args):
        progress = p.progress
        progress.update(jobs.Activity(["doc00"], None, [("doc00", 1)], 1.0, 1.0, 1.0, None))
        raise error if isinstance(error, Exception) else JobError(error)

    monkeypatch.setattr(jobs, "_summarise_all", work_then_fail)
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "3"])
    assert r.exit_code != 0
    assert (out / "progress.json").exists() == left
    assert read_status(out).state == ("interrupted" if left else "stopped")


def test_background_says_a_setting_its_run_refuses_and_exits_with_its_code(tmp_path, small_moe):  # noqa: F811
    """A user trial: `run --background --memory-gb 0.1` said "started in the background", exit
    0; the run died at once with its `error:` in run.log, and `status` never said why. The
    command now waits for the run's first journal record: a run that exits before it gives
    its error line and its exit code here."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 1)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--background",
                            "--memory-gb", "0.01"])
    words = " ".join(r.output.split())
    assert r.exit_code == 2 and "error: 0.01 GiB (--memory-gb) is too little" in words, r.output
    assert "started in the background" not in words
    assert not out.exists()  # a trial: its lock, log and pid file made `status` describe a job that never was
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--background",
                            "--max-tokens", "8"])
    assert r.exit_code == 0 and "started in the background" in r.output, r.output
    pid = int((out / "run.pid").read_text())
    try:
        assert any(rec.get("event") == "start" for rec in Journal(out).entries())  # it returned once under way
    finally:
        os.waitpid(pid, 0)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--background",
                            "--max-tokens", "8"])  # nothing to do: it has finished when the command returns
    assert r.exit_code == 0 and "the background run finished already (exit code 0)" in r.output, r.output
