"""What a new user sees: a progress line that fits 80 columns with done/total and ETA
first; help that wraps at 80 columns without cutting option names; usage errors as
one ``error:`` line with exit code 2 (like the CLI's own); a final line that says
why more bytes were read than the experts' size; a rerun with nothing to do that
does not load the model.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.cli.render import (
    format_duration,
    in_flight_rows,
    progress_line,
    summary_line,
)
from mlx_tier.job.report import DocResult, JobReport
from mlx_tier.job.run import Activity
from mlx_tier.monitor.status import describe_throttle

runner = CliRunner()
LONG = "bill_of_rights_amendments_1_to_5_with_a_very_long_file_name"


def reading(name=LONG, read=312, length=1204):
    return Activity([name, "other"], (name, read, length), [("other", 17)], 3.14, 4.2, 0.9612)


@pytest.mark.parametrize("width", [80, 60])
def test_progress_line_fits_with_count_and_eta_first(width):
    line = progress_line(2, 7, 754.0, 1380.0, reading(), width)
    assert len(line) <= width
    assert line.startswith("2/7 done  ETA 23m00s  12m34s  reading bill_of_")
    assert "312/1,204" + (" prompt tokens" if width >= 80 else "") in line  # the prompt's progress stays
    assert "…" in line  # the name was cut to fit, not the count or the token progress


def test_progress_line_cases():
    wide = progress_line(2, 7, 5.0, None, reading("gettysburg"), 120)
    assert wide == "2/7 done  ETA estimating  5s  reading gettysburg 312/1,204 prompt tokens  3.1 tok/s  hit 96%"
    writing = Activity(["a", "b"], None, [("a", 12), ("b", 3)], 1.0, 0.0, 0.5)
    assert progress_line(0, 2, 3725.0, 60.0, writing, 80) == (
        "0/2 done  ETA 1m00s  1h02m  writing a +1 more, 12 tokens  1.0 tok/s  hit 50%")
    assert progress_line(0, 2, 1.0, None, None, 80) == "0/2 done  ETA estimating  1s"
    # Another case: after a first Ctrl-C the job's ETA no longer applies: the line says so.
    stopping = Activity(["a"], None, [("a", 12)], 1.0, 0.0, 0.5, 40.0, stopping=True)
    assert progress_line(1, 2, 65.0, 40.0, stopping, 80) == "1/2 done  stopping  1m05s  writing a, 12 tokens  1.0 tok/s  hit 50%"
    one = Activity(["a"], None, [("a", 1)], 1.0, 0.0, 0.5)  # a user trial: "1 tokens"
    assert "writing a, 1 token  " in progress_line(0, 1, 1.0, None, one, 80)
    assert len(progress_line(1, 2, 1.0, None, reading(), 30)) <= 30  # too narrow for any name: count first


def test_format_duration():
    assert [format_duration(s) for s in (None, 0, 59.9, 61, 3600, 7325)] == ["?", "0s", "59s", "1m01s", "1h00m",
                                                                            "2h02m"]


@pytest.mark.parametrize("command", ["run", "plan", "status", "watch", "convert", "trace-sim", "trace-stats",
                                     "profile", "thermal"])
def test_help_reads_at_80_columns(command):
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(x) for x in lines) <= 80, max(lines, key=len)
    # never cut after a hyphen inside a word (`--retry-` / `failed`, `mlx-` / `community/...`)
    assert not [x for x in lines if re.search(r"[A-Za-z]-$", x)], [x for x in lines if re.search(r"[A-Za-z]-$", x)]
    assert "…" not in r.output and "╭" not in r.output
    import typer.main

    from mlx_tier.cli.main import app as typer_app

    cmd = typer.main.get_command(typer_app).commands[command]
    for p in cmd.params:
        for opt in p.opts + p.secondary_opts:
            if opt.startswith("-"):
                assert opt in r.output, opt  # every option name whole
    helps = [p.help for p in cmd.params if getattr(p, "help", None)]
    longest = max(helps, key=len).split()
    assert " ".join(longest[-3:]).rstrip(".") in " ".join(r.output.split())  # descriptions wrap, not cut


@pytest.mark.parametrize("args, message", [
    (["run", "docs", "--out", "o", "--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["run", "docs", "--out", "o", "--nice", "99"], "Invalid value for '--nice'"),
    (["run", "docs"], "Missing option '--out'"),
    (["plan", "m", "--context", "0"], "Invalid value for '--context'"),
    (["run", "docs", "--out", "o", "--no-such-option"], "No such option"),
])
def test_usage_errors_are_one_line_exit_2(args, message):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert [x for x in r.output.splitlines() if x.strip()] == [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(r.output.strip().splitlines()) == 1 and message in r.output, r.output


def report_with(bytes_read, experts=100 * 2**20, earlier=2, evictions=40, ranks=None):
    results = [DocResult(f"d{i}", "done", earlier_run=i < earlier) for i in range(3)] + [DocResult("p", "pending")]
    run = {"already_done": earlier, "loaded_model": True, "output_tok_per_s": 1.5, "throttled_seconds": 0.0,
           "cache": {"bytes_read": bytes_read, "hit_rate": 0.8, "evictions": evictions}}
    setup = {"expert_bytes_on_disk": experts} | ({"distributed": {"ranks": ranks}} if ranks else {})
    return JobReport(results=results, runs=[run], setup=setup)


def test_summary_line_explains_rereads(tmp_path):
    line = summary_line(report_with(21248 * 2**20), tmp_path)
    assert line.startswith("job: 3 done (2 by earlier runs), 0 failed, 1 pending")
    assert ("read 21248 MiB = 212.5x the experts' 100 MiB on disk: experts evicted from the cache are read "
            "again when next needed") in line
    assert "x the experts'" not in summary_line(report_with(50 * 2**20), tmp_path)  # less than the experts: no note


def test_long_documents_that_failed_are_not_said_summarised_in_parts(tmp_path):
    """A user trial: two long documents failed ("part results do not shrink") and the end line
    said "0 done ..., 2 failed, 0 pending (2 long, summarised in parts)"."""
    report = report_with(0)
    report.results += [DocResult("long1", "failed", parts=3), DocResult("long2", "failed", parts=2),
                       DocResult("long3", "done", parts=4)]
    assert "(1 long, summarised in parts)" in summary_line(report, tmp_path)


def test_summary_line_says_why_ranks_read_more_without_inventing_evictions(tmp_path):
    """A user trial: `--ranks 2` printed "read 759 MiB = 2.0x ...: experts evicted from the cache are
    read again" with no eviction at all: each rank had loaded its own copy."""
    line = summary_line(report_with(200 * 2**20, evictions=0, ranks=2), tmp_path)
    assert "= 2.0x the experts' 100 MiB on disk: each of the 2 ranks reads its own copy," in line, line
    assert "evicted" not in line
    both = summary_line(report_with(500 * 2**20, evictions=7, ranks=2), tmp_path)
    assert "each of the 2 ranks reads its own copy; experts evicted from the cache are read again" in both
    bare = summary_line(report_with(150 * 2**20, evictions=0), tmp_path)  # one process, no eviction: no guess
    assert "= 1.5x the experts' 100 MiB on disk," in bare and "evicted" not in bare and "ranks" not in bare


def test_a_run_that_routed_no_token_says_so_not_a_zero_hit_rate(tmp_path):
    """A run stopped before its first step had no expert lookups: "hit rate 0.0%" read as a
    cache that missed everything."""
    report = report_with(0)
    report.runs[-1]["cache"] |= {"hits": 0, "misses": 0, "hit_rate": 0.0}
    line = summary_line(report, tmp_path)
    assert "no expert lookups" in line and "hit rate" not in line, line
    report.runs[-1]["cache"] |= {"hits": 0, "misses": 3}  # lookups that all missed: a real 0%
    assert "hit rate 0.0%" in summary_line(report, tmp_path)


@pytest.mark.parametrize("width", [80, 60])
def test_end_of_run_lines_wrap_between_words(tmp_path, monkeypatch, width):
    """The totals after a run: job, this run, report each start a line; none is cut mid-word."""
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    report = report_with(21248 * 2**20)
    tmp_path = tmp_path.relative_to(tmp_path.parent.parent)  # a path that fits the width (longer ones fold)
    render.print_summary(report, tmp_path)
    text = console.export_text()
    lines = text[text.index("job: "):].splitlines()
    assert max(map(len, lines)) <= width
    words = summary_line(report, tmp_path).replace(" | ", " ").split()
    assert " ".join(lines).split() == words  # every word whole, in order
    assert [x.split(":")[0] for x in lines if x.startswith(("job:", "this run:", "report:"))] == [
        "job", "this run", "report"]


def test_a_rerun_table_keeps_document_names_whole_at_80_columns(monkeypatch):
    """Documents done by an earlier run are marked with a short `done*`, so a 34-character
    name (the shipped examples') still fits beside the other columns."""
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    name = "constitution_preamble_and_article_1"
    report = report_with(0)
    report.results[0] = DocResult(name, "done", earlier_run=True, input_tokens=271, output_tokens=102,
                                  doc_seconds=36.2)
    render.print_summary(report, Path("out"))
    text = console.export_text()
    assert name in text and "done*" in text and "*: by an earlier run" in " ".join(text.split())
    assert max(len(x) for x in text.splitlines()) <= 80


def test_runner_messages_wrap_between_words_keeping_a_path_whole(monkeypatch):
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "err", console)
    path = "/home/someone/.cache/mlx-tier/smollm2-135m-moe-8x-top2-v2"
    render.RichReporter().message(f"building the demo model (SmolLM2-135M, 8-expert MoE) in {path}")
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80 and lines[-1] == path, lines


def test_the_legend_explains_a_star_only_when_a_row_has_one(monkeypatch):
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    report = report_with(0)
    report.results = [r for r in report.results if not r.earlier_run]
    render.print_summary(report, Path("out"))
    text = " ".join(console.export_text().split())
    assert "*" not in text and "in tok: the document with the instruction" in text


def test_the_results_table_names_documents_as_the_input_does(monkeypatch):
    """A user trial: the table's rows were output ids (`x__a.txt-2` for x/a.txt, `a.txt-2` for
    a.txt beside an a.md): with clashes no row could be told apart. A row now shows the
    document's name, and its output where that is named otherwise; a batch shows the
    request's id, and the caption speaks of requests."""
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=100, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    report = report_with(0, earlier=0)
    report.results = [DocResult("x__a", "done", name="x/a.txt"), DocResult("a.txt-2", "done", name="a.txt"),
                      DocResult("a", "done", name="a.md"), DocResult("old", "done"),  # old: no name recorded
                      DocResult("report.v2", "done", name="report.v2")]  # a JSONL line's id: no suffix to drop
    render.print_summary(report, Path("out"))
    rows = [line.split("│")[1].strip() for line in console.export_text().splitlines() if line.startswith("│")]
    assert rows == ["x/a.txt", "a.txt → a.txt-2.md", "a.md", "old", "report.v2"]
    # A user trial: a.md beside a.txt is a.md.md (a.md holds a.txt's summary), and A.TXT is
    # A.TXT.md, with no arrow: a file's own name was taken as its natural output name.
    console = Console(width=100, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    report.results = [DocResult("a", "done", name="a.txt", source="/d/a.txt"),
                      DocResult("a.md", "done", name="a.md", source="/d/a.md"),
                      DocResult("A.TXT", "done", name="A.TXT", source="/d/A.TXT"),
                      DocResult("report.v2", "done", name="report.v2", source="/d/x.jsonl:3")]
    render.print_summary(report, Path("out"))
    rows = [line.split("│")[1].strip() for line in console.export_text().splitlines() if line.startswith("│")]
    assert rows == ["a.txt", "a.md → a.md.md", "A.TXT → A.TXT.md", "report.v2"], rows
    console = Console(width=100, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    report.setup["batch_requests"] = True
    report.results = [DocResult("req__1", "done", name="req/1")]
    render.print_summary(report, Path("out"))
    text = console.export_text()
    assert "│ req/1 " in text and "in tok: the request with its messages" in " ".join(text.split())


def test_the_demo_build_lines_fit_80_columns(monkeypatch):
    """Each line the demo build prints (routers, layers) is at most 80 characters, with
    its counts at four digits (the line naming the cache folder is wrapped before the
    path: see the next test)."""
    import inspect

    from mlx_tier.tools import demo_model

    typical = {"{NUM_EXPERTS}": str(demo_model.NUM_EXPERTS), "{target}": ""}
    source = inspect.getsource(demo_model)
    lines = [re.sub(r"\{[^}]*\}", lambda m: typical.get(m.group(), "9999"), literal)
             for literal in re.findall(r'progress\(f?"([^"]*)"', source)]
    assert len(lines) >= 3 and all(len(x) <= 80 for x in lines), [x for x in lines if len(x) > 80]


def test_throttle_and_in_flight_in_plain_words():
    assert describe_throttle({"t": 0, "thermal": "unknown", "mode": "full", "duty": 1.0, "reason": "nominal"}) == (
        "full speed from 0.0 s into the run: nothing limits it (thermal state: not reported by any sensor here; "
        "see `mlx-tier thermal`)")
    assert describe_throttle({"t": 65.4, "thermal": "serious", "mode": "slow", "duty": 0.25,
                              "reason": "thermal state serious (pmset)"}) == (
        "slowed to 25% of the time from 65 s into the run: thermal state serious (pmset) (thermal state: serious)")
    # a user trial: "full speed ... nothing limits it" while --max-tok-s throttled the run
    assert describe_throttle({"t": 0, "thermal": "nominal", "mode": "full", "duty": 1.0, "reason": "nominal",
                              "max_tok_s": 2.0}) == (
        "capped at 2 tok/s from 0.0 s into the run: `max_tok_s` (thermal state: nominal)")
    # a review: `t` counts from the throttle's first step; the journal's record says when in the run
    assert describe_throttle({"t": 0, "run_t": 59.4, "thermal": "nominal", "mode": "full", "duty": 1.0,
                              "reason": "nominal"}).startswith("full speed from 59 s into the run")
    rows = in_flight_rows({"time": 0, **reading("a.txt").as_dict(), "in_flight": ["a.txt", "other", "c"]})
    assert rows[:3] == [("reading", "a.txt: 312/1,204 prompt tokens (4.2 prompt tok/s)"),
                        ("writing", "other: 17 tokens so far"), ("waiting", "c (not started)")]
    assert in_flight_rows(None) == []
    # a trial: a throughput step reading two prompts listed the first as "waiting"
    two = Activity(["a", "b", "c"], ("b", 40, 300), [], 1.0, 4.2, 0.5, also_reading=(("a", 250, 900),))
    rows = in_flight_rows({"time": 0, **two.as_dict()})
    assert rows[:3] == [("reading", "a: 250/900 prompt tokens"), ("reading", "b: 40/300 prompt tokens (4.2 prompt tok/s)"),
                        ("waiting", "c (not started)")], rows
    # a user trial: a prompt read before this step, and one read in part, were "waiting" as one never started
    turns = Activity(["a", "b", "c", "d"], ("d", 10, 90), [], 1.0, 4.2, 0.5, read={"a": (273, 273), "b": (235, 1273)})
    assert in_flight_rows({"time": 0, **turns.as_dict()})[1] == (
        "waiting", "a (prompt read), b (235/1,273 read), c (not started)")


def test_rerun_with_nothing_pending_does_not_load_the_model(tmp_path, tiny_moe, monkeypatch):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    out = tmp_path / "out"
    args = ["run", str(docs), "--out", str(out), "--model", str(tiny_moe), "--max-tokens", "4"]
    assert runner.invoke(app, args).exit_code == 0
    first_report = (out / "report.json").read_text()

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mlx_tier.engine.load.load", no_load)
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "this run: nothing to do (model not loaded)" in " ".join(r.output.split())
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["done"] == 1 and report["runs"][-1]["loaded_model"] is False
    assert report["cache"]["misses"] == report["runs"][0]["cache"]["misses"]  # the first run's counters kept
    first = json.loads(first_report)
    kept = {k: v for k, v in first.items() if k not in ("documents", "totals", "cache", "runs", "machine", "python")}
    assert {k: report[k] for k in kept} == kept  # setup (generation, memory, kernel, ...) and throttle kept
    r = runner.invoke(app, ["status", str(out)])
    assert r.exit_code == 0 and "0 finished or failed" not in r.output, r.output  # status still shows the real run


def test_progress_line_counts_failures_apart_from_done():
    from mlx_tier.cli.render import progress_line

    line = progress_line(1, 2, 30.0, None, None, 80, failed=1)
    assert line.startswith("1/2 done, 1 failed") and len(line) <= 80
    assert progress_line(2, 2, 30.0, None, None, 80).startswith("2/2 done  ETA")


def test_the_progress_count_is_the_jobs_on_every_run(tmp_path, tiny_moe):
    """A user trial: 11 documents, 3 failing: the first run counted to N = 11, the rerun to
    N = 10 (failures not retried left out). N is every document of the job on each run (but
    those a --retry-failed run leaves for a plain rerun), earlier failures counted failed."""
    from mlx_tier.job.run import JobConfig, Reporter, run_job
    from mlx_tier.job.scheduler import GenerationConfig

    class Starts(Reporter):
        def __init__(self):
            self.starts = []

        def start(self, total, skipped, failed=0):
            self.starts.append((total, skipped, failed))

    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in (("a.txt", "The river floods every spring."), ("b.txt", "Bees carry pollen."), ("e.txt", " ")):
        (docs / name).write_text(text)
    config = JobConfig(input=docs, out_dir=tmp_path / "out", model=tiny_moe, generation=GenerationConfig(max_tokens=3))
    seen = Starts()
    run_job(config, seen)
    (docs / "c.txt").write_text("The library opens at nine.")
    run_job(config, seen)
    run_job(config, seen)  # nothing to do
    run_job(replace(config, retry_failed=True), seen)
    assert seen.starts == [(3, 0, 0), (4, 2, 1), (4, 3, 1), (4, 3, 0)]  # the last retries e


def _failure_messages(tmp_path) -> dict[str, str]:
    """Each kind of per-document failure, with the message the code really gives where it
    is cheap to provoke (converters, JSONL), else as the scheduler and runner word it."""
    import json

    from mlx_tier.job.doc_text import convert_file, decode_text
    from mlx_tier.job.documents import discover

    (tmp_path / "inside").mkdir()
    (tmp_path / "outside.txt").write_text("secret")
    (tmp_path / "inside" / "link.txt").symlink_to(tmp_path / "outside.txt")
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(json.dumps({"id": "e", "text": ""}) + "\n")
    return {
        "empty": decode_text(b"  \n").error,  # a user trial: a blank file's row said "empty file"
        "empty text": discover(jsonl)[0].error,
        "binary file": decode_text(bytes(range(256)) * 8).error,
        "bad text": decode_text(b"\xff\xfe" + b"\x00\xd8").error,
        "unreadable": convert_file(tmp_path / "missing.txt").error,
        "bad link": convert_file(tmp_path / "inside" / "link.txt", inside=(tmp_path / "inside").resolve()).error,
        "needs extra": ".pdf files need the document converters: pip install 'mlx-tier[documents]'",
        "conversion": "cannot convert (ValueError): broken xref table",
        "no text": "no text found (a scanned PDF needs OCR first)",
        "too long": "document too long for the usable context of 2048 tokens: its parts' summaries do not fit",
        "no summary": "no summary within `max_tokens` 160; retry with a larger `max_tokens` and `retry_failed`",
        "write error": "cannot write the summary: PermissionError: [Errno 13] Permission denied",
        "no memory": "RuntimeError: [metal::malloc] Attempting to allocate 1073741824 bytes",
        "ValueError": "ValueError: tokenizer refused the text",
    }


def test_every_kind_of_failure_has_a_short_reason(tmp_path):
    from mlx_tier.messages import SHORT_REASON_CHARS, short_reason

    for short, message in _failure_messages(tmp_path).items():
        assert short_reason(message) == short, (short, message)
        assert len(short) <= SHORT_REASON_CHARS
    assert short_reason("MemoryError: std::bad_alloc") == "no memory"
    # a folder swapped for a link between the check and the open (converters.convert_file)
    assert short_reason("cannot read: now outside the input folder") == "bad link"
    assert short_reason("cannot read: Permission denied") == "unreadable"
    assert short_reason("AVeryLongExceptionNameError: x") == "AVeryLongE…"
    assert short_reason(None) == short_reason("something odd happened") == "error"
    from mlx_tier.job.documents import discover

    surrogate = tmp_path / "s.jsonl"  # a JSONL text with a lone surrogate (JSON's "\ud800")
    surrogate.write_text('{"id": "s", "text": "Owls \\ud800 hoot."}\n')
    assert short_reason(discover(surrogate)[0].error) == "bad text"

    # a user trial: a request refused for an unsupported parameter showed "failed: error"
    from mlx_tier.job import batch_api

    codes = {"unsupported_parameter", "unsupported_value", "invalid_type", "invalid_value",
             "missing_required_parameter", "context_length_exceeded"}
    source = Path(batch_api.__file__).read_text()
    assert codes - {"context_length_exceeded"} <= set(re.findall(r'"((?:unsupported|invalid|missing)_[a-z_]+)"', source))
    for code in codes:
        short = short_reason("`logprobs` is not supported", code)
        assert short != "error" and len(short) <= SHORT_REASON_CHARS, code
    assert short_reason("`logprobs` is not supported", "unsupported_parameter") == "unsupported"
    assert short_reason("RuntimeError: [malloc] out", batch_api.SERVER_ERROR) == "no memory"


def test_results_table_shows_why_each_document_failed_at_80_columns(tmp_path, monkeypatch):
    """`failed:` then the short reason under it; the shipped examples' longest name stays whole."""
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "out", console)
    messages = _failure_messages(tmp_path)
    report = report_with(0)
    name = "constitution_preamble_and_article_1"
    report.results[0] = DocResult(name, "done", input_tokens=271, output_tokens=102, doc_seconds=36.2)
    report.results += [DocResult(f"f{i}", "failed", error=m, earlier_run=i == 0) for i, m in enumerate(messages.values())]
    render.print_summary(report, Path("out"))
    text = console.export_text()
    assert max(len(x) for x in text.splitlines()) <= 80 and name in text
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    for i, short in enumerate(messages):  # the row of f{i}, then the reason on the line under it
        row = next(k for k, c in enumerate(cells) if c[0] == f"f{i}")
        assert cells[row][1] == ("failed*:" if i == 0 else "failed:") and cells[row + 1][1] == short, cells[row:row + 2]


def test_run_output_lines_wrap_between_words_at_80_columns(monkeypatch):
    """A log's failure lines and per-document lines fit 80 columns, broken between words (a
    soft-wrapped line is cut mid-word by the terminal); every word is kept."""
    from rich.console import Console

    import mlx_tier.cli.render as render

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "err", console)
    reporter = render.RichReporter()
    reporter.total = 7
    pdf = ("cannot convert (FileConversionException): PdfConverter threw PDFSyntaxError with message "
           "No /Root object! - Is this really a PDF?")
    reporter.finished(DocResult("ok", "failed", error=pdf), {"hit_rate": 0.9})
    name = "constitution_preamble_and_article_1"
    reporter.finished(DocResult(name, "done", output_tokens=102, doc_seconds=36.2), {"hit_rate": 0.986})
    reporter.finished(DocResult("a_file_name_" * 8, "failed", error="empty document"), {"hit_rate": 0.9})
    lines = console.export_text().splitlines()
    assert all(len(x) <= 80 for x in lines if "a_file_name_" not in x), lines
    assert "a_file_name_" * 8 in "".join(lines)  # a word wider than the screen stays whole
    text = " ".join(lines)
    assert f"failed ok: {pdf}" in text
    assert f"1/7 {name}: 102 tokens, 36.2 s of its own, hit rate so far 98.6%" in text
    assert len(lines) >= 7


@pytest.mark.parametrize("body,field", [({"max_tokens": 0}, "max_tokens"),
                                        ({"max_completion_tokens": True}, "max_completion_tokens")])
def test_a_refused_requests_line_names_its_field_not_a_flag(monkeypatch, body, field):
    """The issue: a request with `"max_tokens": 0` was shown as "--max-tokens must be at least 1,
    got 0", naming the command-line flag; errors.jsonl named the request's field. The terminal
    names the field of that request too; a document's error still names the flag."""
    from rich.console import Console

    import mlx_tier.cli.render as render
    from mlx_tier.errors import RequestError
    from mlx_tier.job.batch_api import CHAT, plan

    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(render, "err", console)
    with pytest.raises(RequestError) as e:
        plan(CHAT, {"messages": [{"role": "user", "content": "Hi."}], **body})
    assert e.value.field == field
    reporter = render.RichReporter()
    reporter.total = 2
    reporter.finished(DocResult("req_1", "failed", error=str(e.value), error_code=e.value.code,
                                error_param=e.value.field, name="req/1"), {"hit_rate": 0.0})
    reporter.finished(DocResult("doc", "failed", error="no summary within `max_tokens` 160"), {"hit_rate": 0.0})
    lines = console.export_text().splitlines()
    assert lines[0].startswith(f"failed req_1: `{field}` of request req/1 must be ") and "--" not in lines[0], lines
    assert lines[1] == "failed doc: no summary within --max-tokens 160", lines


def test_a_plan_range_of_one_value_prints_once():
    """A user trial: `plan` printed "16.76-16.76 tok/s"."""
    from mlx_tier.cli.plan_cmd import _span

    assert _span(16.761, 16.759, ".2f") == "16.76" and _span(0.5, 0.504, ".0%") == "50%"
    assert _span(3.2, 16.76, ".2f") == "3.20-16.76"


def test_an_error_is_wrapped_on_a_terminal_and_one_line_in_a_log(monkeypatch):
    """A user trial: `--memory-gb 0.1` printed a 233-character error line on an 80-column
    terminal (cut mid-word by the terminal). On a terminal it is wrapped between words; to a
    file or pipe it stays one line, to find with grep."""
    import io

    from rich.console import Console

    import mlx_tier.cli.render as render

    message = ("0.10 GiB (--memory-gb) is too little for this model: it needs runtime 0.39 + dense part 0.05 + "
               "workspace 0.08 + MLX buffers 0.03 + margin 0.12 + KV of one 512-token sequence 0.03 + one expert "
               "slot per MoE layer 0.06 = 0.76 GiB")
    for terminal, lines in ((True, 3), (False, 1)):
        buf = io.StringIO()
        monkeypatch.setattr(render, "err", Console(file=buf, width=80, force_terminal=terminal, color_system=None))
        render.print_error(message)
        said = buf.getvalue().splitlines()
        assert len(said) == lines and all(len(x) <= 80 for x in said[:lines if terminal else 0]), said
        assert " ".join(" ".join(said).split()) == f"error: {message}"
