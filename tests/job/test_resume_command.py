"""The command a job gives to resume it is a plain rerun, never with `--retry-failed`: a run
with that flag tries failed documents only and leaves pending ones as they are, so repeating
it would never summarise them. Wherever a resume command is said (the run's end, its stop
messages, `mlx-tier status`, report.html), a `--retry-failed` run's retry command is said
beside it, and a job whose last run did all it set out to do while documents are pending
reads as "ended with N documents pending", not as stopped mid-work.
"""

import json
import shlex
import signal

import pytest
from support.jobs import _short_context, small_moe  # noqa: F401 - fixtures
from support.output import WIDTH, command_after, eighty_columns  # noqa: F401 - a fixture
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.job.report import DocResult, JobReport
from mlx_tier.job.run import hard_stop_message
from mlx_tier.messages import plain_rerun
from mlx_tier.monitor.status import job_state, read_status
from mlx_tier.outdir.journal import JobInfo, Journal

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("eighty_columns")


def run(*args):
    r = runner.invoke(app, ["run", *map(str, args)])
    return r.exit_code, r.output


def status(out):
    r = runner.invoke(app, ["status", str(out)])
    assert r.exit_code == 0, r.output
    return r.output


def test_a_retry_failed_run_leaving_a_new_document_gives_the_plain_rerun(tmp_path, small_moe):  # noqa: F811
    """A user trial: bin.txt failed; new.txt was added; `--retry-failed` retried bin.txt only. Status
    and report.html said "stopped, not running; 1 document left" beside "0 left", and gave the
    same command with --retry-failed to resume: followed, it never summarised new.txt."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "bin.txt").write_bytes(bytes(range(256)) * 4)
    (docs / "good.txt").write_text("Good document about the river and the farmer.")
    args = [docs, "--out", out, "--model", small_moe, "--max-tokens", "4"]
    plain = shlex.join(["mlx-tier", "run", *map(str, args)])
    assert run(*args)[0] == 1  # bin.txt failed
    (docs / "new.txt").write_text("A new document about bees and the flower.")

    code, output = run(*args, "--retry-failed")
    assert code == 1, output  # bin.txt failed again
    assert command_after(output, "summarise it with:") == plain
    assert "1 document pending, left for a plain rerun" in " ".join(output.split())
    assert json.loads((out / "report.json").read_text())["runs"][-1]["left_pending"] == 1
    s = read_status(out)
    assert (s.state, s.pending, s.todo_left, s.command) == ("ended", 1, 0, plain)
    said = status(out)
    words = " ".join(said.replace("│", " ").split())
    assert "ended with 1 document pending, not running" in words and "stopped" not in words, said
    assert "0 of its documents left" in words, said  # this run's own list, not the job's
    assert command_after(said, "resume with:") == plain
    assert command_after(said, "retry the failed ones with:") == f"{plain} --retry-failed"
    page = (out / "report.html").read_text()  # written as the run ended
    assert 'data-value="ended"' in page and f'<pre id="resume-command">{plain}</pre>' in page

    code, output = run(*args)  # the advice followed
    assert code == 1 and (out / "new.md").is_file(), output
    assert read_status(out).state == "finished"


def test_status_of_an_older_run_drops_retry_failed_from_its_recorded_command(tmp_path):
    """A start record written before this fix holds the command with --retry-failed (a stdin
    list's redirection included): status and the page resume without it."""
    out = tmp_path / "out"
    out.mkdir()
    recorded = f"mlx-tier run - --out {out} --max-tokens 6 --retry-failed < {out}/inputs.txt"
    JobInfo(input="-", ids=["a", "b", "c"], todo=["a"], started=1.0, pid=1, command=recorded).write(Journal(out))
    Journal(out).append({"id": "a", "status": "failed", "error": "binary file"})
    Journal(out).append({"id": "b", "status": "done", "output": "b.md"})
    plain = f"mlx-tier run - --out {out} --max-tokens 6 < {out}/inputs.txt"
    said = status(out)
    assert command_after(said, "resume with:") == plain
    assert command_after(said, "retry the failed ones with:") == recorded
    assert plain_rerun(None) is None and plain_rerun("mlx-tier run d --out 'a b'") == "mlx-tier run d --out 'a b'"
    assert plain_rerun("mlx-tier run d --prompt 'keep --retry-failed' --retry-failed") == \
        "mlx-tier run d --prompt 'keep --retry-failed'"


def test_job_state_tells_a_run_that_did_its_list_from_one_stopped():
    assert job_state(False, False, 1, 0) == "ended"  # pending, but none of the run's own
    assert job_state(False, False, 1, 1) == job_state(False, False, 1) == "stopped"
    assert job_state(False, False, 0, 0) == "finished" and job_state(False, True, 1, 0) == "interrupted"


def _report(interrupted=False, stop_signal=None, pending=0, left_pending=0):
    results = [DocResult("a", "failed", error="binary file")] + [DocResult(f"p{i}", "pending")
                                                               for i in range(pending)]
    run = {"already_done": 0, "loaded_model": True, "output_tok_per_s": 1.0, "throttled_seconds": 0.0,
           "cache": {"bytes_read": 0, "hit_rate": 0.5}, "ranks": [], "left_pending": left_pending}
    return JobReport(results=results, runs=[run], interrupted=interrupted, stop_signal=stop_signal)


def test_a_stopped_retry_failed_run_resumes_plain_and_says_how_to_retry(tmp_path, monkeypatch):
    """Every stop message of a --retry-failed run: the plain rerun to resume, then the retry
    command; the command the job records keeps --redo-changed (repeated, it redoes nothing
    twice) and drops --background."""
    import mlx_tier.job.run

    seen = []

    def stopped(config, reporter):
        seen.append(config)
        return _report(True, signal.SIGINT, pending=2)

    monkeypatch.setattr(mlx_tier.job.run, "run_job", stopped)
    args = ["run", str(tmp_path / "docs"), "--out", str(tmp_path / "out"), "--max-tokens", "8", "--redo-changed"]
    plain = shlex.join(["mlx-tier", *args])
    r = runner.invoke(app, [*args, "--retry-failed"])
    assert r.exit_code == 130, r.output
    assert seen[0].command == plain and seen[0].retry_failed
    assert command_after(r.output, "Resume with:") == plain
    assert command_after(r.output, "retry the failed ones with:") == f"{plain} --retry-failed"
    text = hard_stop_message(signal.SIGINT, plain, WIDTH, retry_failed=True)
    assert command_after(text, "Resume with:") == plain
    assert command_after(text, "retry the failed ones with:") == f"{plain} --retry-failed"
    assert "retry the failed" not in hard_stop_message(signal.SIGINT, plain, WIDTH)


def test_ranks_leaving_documents_to_a_plain_rerun_is_no_rank_failure(tmp_path, monkeypatch):
    """Over ranks, the documents --retry-failed leaves pending are not "left by a rank that
    ended early" (exit 3): the run says the plain rerun and exits as for its failures."""
    import mlx_tier.ranks.launcher

    monkeypatch.setattr(mlx_tier.ranks.launcher, "run_distributed",
                        lambda config, launch, reporter: _report(pending=1, left_pending=1))
    args = ["run", str(tmp_path / "docs"), "--out", str(tmp_path / "out"), "--ranks", "2"]
    r = runner.invoke(app, [*args, "--retry-failed"])
    assert r.exit_code == 1 and "a rank ended early" not in r.output, r.output
    assert command_after(r.output, "summarise it with:") == shlex.join(["mlx-tier", *args])
    monkeypatch.setattr(mlx_tier.ranks.launcher, "run_distributed",
                        lambda config, launch, reporter: _report(pending=2, left_pending=1))
    r = runner.invoke(app, [*args, "--retry-failed"])
    assert r.exit_code == 3 and "1 document left pending (a rank ended early" in r.output, r.output


def test_a_prompt_holding_a_less_than_sign_or_the_flag_keeps_the_commands_right():
    """A review: the commands split at the first " < " (a prompt "in < 100 words" took the
    flag inside its quotes) and looked for the flag as a substring (a prompt naming it)."""
    from mlx_tier.messages import retry_command

    prompt = "mlx-tier run docs --out o --prompt 'Summarise in < 100 words'"
    assert retry_command(prompt) == prompt + " --retry-failed"
    assert plain_rerun(prompt + " --retry-failed") == prompt
    named = "mlx-tier run docs --out o --prompt 'never --retry-failed'"
    assert retry_command(named) == named + " --retry-failed"
    for listed in ("mlx-tier run - --out o < o/inputs.txt", "mlx-tier run - --out . < inputs.txt"):
        head, tail = listed.split(" < ")
        assert retry_command(listed) == f"{head} --retry-failed < {tail}"
        assert plain_rerun(f"{head} --retry-failed < {tail}") == listed


def test_the_resume_command_of_an_input_starting_with_a_dash_works(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A user trial: `mlx-tier run --out 'o weird' -- '-weird dir'` printed "mlx-tier run '-weird dir'
    --out ...", which fails: "No such option: -w". It is given as ./-weird dir; stdin's "-" stays."""
    monkeypatch.chdir(tmp_path)
    docs = tmp_path / "-weird dir"
    docs.mkdir()
    (docs / "bin.txt").write_bytes(bytes(range(256)) * 4)  # fails: the retry command is printed
    code, output = run("--out", "o weird", "--model", small_moe, "--max-tokens", "4", "--", "-weird dir")
    assert code == 1, output
    given = command_after(output, "retry it with:")
    assert shlex.split(given)[2] == "./-weird dir", given
    again = runner.invoke(app, shlex.split(given)[1:])  # the command as printed runs
    assert again.exit_code == 1 and "No such option" not in again.output, again.output
