"""``mlx-tier run`` end to end on tiny checkpoints: outputs, resume, report, and
bad input -> one clear error line and exit code 2, losing nothing already done.
"""

import json
import os
import re
import signal

import pytest
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.job.run import JobConfig, Reporter, run_job
from mlx_tier.job.scheduler import GenerationConfig

runner = CliRunner()


@pytest.fixture
def docs(tmp_path):
    d = tmp_path / "docs"
    (d / "more").mkdir(parents=True)
    (d / "one.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    (d / "two.md").write_text("# Notes\nThe library opens at nine and closes at five on weekdays.")
    (d / "more" / "three.txt").write_text("Bees carry pollen between flowers, which helps fruit to form.")
    return d


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run(*args):
    result = runner.invoke(app, ["run", *map(str, args)])
    return result.exit_code, result.output


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_run_resume_and_report(docs, tmp_path, tiny_moe):
    out = tmp_path / "out"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--cache-gb", "0.0001", "--max-tokens", "6")
    assert code == 0, output
    names = sorted(p.name for p in out.iterdir() if p.name != ".mlx-tier.lock")
    assert names == ["journal.jsonl", "more__three.md", "one.md", "report.html", "report.json", "two.md"]
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["done"] == 3 and report["totals"]["failed"] == 0
    assert report["slots_per_layer"] < report["experts_per_layer"]  # cache smaller than the experts
    assert report["cache"]["misses"] > 0 and 0 <= report["cache"]["hit_rate"] <= 1
    assert report["cache"]["resident_bytes_max"] <= report["cache"]["budget_bytes"]
    assert {"machine", "backend", "model", "cache_budget_gib"} <= set(report)
    doc = report["documents"][0]
    assert doc["input_tokens"] > 10 and 1 <= doc["output_tokens"] <= 6 and doc["doc_seconds"] > 0
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.md")}

    assert "1/3 " in output and "3/3 " in output  # not a terminal: one line per document
    assert "in tok: the document with the instruction, in tokens; out tok:" in " ".join(output.split())  # caption
    assert oct((out / "one.md").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    first_run = report["runs"][0]

    code, output = run(docs, "--out", out, "--model", tiny_moe, "--cache-gb", "0.0001", "--max-tokens", "6")
    assert code == 0, output
    assert "skipping 3 documents already done" in output
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.md")} == before  # never rewritten
    report = json.loads((out / "report.json").read_text())
    # The job's truth survives the rerun: every document done (by the earlier run), this run did nothing.
    assert report["totals"]["done"] == report["totals"]["documents"] == 3 and report["totals"]["output_tokens"] > 0
    assert all(d["status"] == "done" and d["earlier_run"] for d in report["documents"])
    assert report["documents"][0]["doc_seconds"] == doc["doc_seconds"]  # figures kept from the journal
    assert report["runs"][1]["done"] == 0 and report["runs"][1]["already_done"] == 3
    assert len(report["runs"]) == 2 and report["runs"][0] == first_run  # the first run's figures survive
    assert report["cache"]["misses"] == first_run["cache"]["misses"]  # summed over runs


def test_a_resumed_job_gives_the_eta_its_earlier_summary_lengths(docs, tmp_path, tiny_moe, monkeypatch):
    """A rerun with new documents starts the ETA from the lengths of the summaries already
    written (mlx_tier.job.eta: the max_tokens prior alone made early estimates ~2x high)."""
    from mlx_tier.job import run as jobs

    out = tmp_path / "out"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "6")
    assert code == 0, output
    written = sorted(d["output_tokens"] for d in json.loads((out / "report.json").read_text())["documents"])
    trackers, real = [], jobs.EtaTracker

    def tracker(*args):
        trackers.append(real(*args))
        return trackers[-1]

    monkeypatch.setattr(jobs, "EtaTracker", tracker)
    (docs / "four.txt").write_text("A new document added after the first run.")
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "6")
    assert code == 0, output
    assert len(trackers) == 1 and sorted(trackers[0].earlier) == written and all(written)
    assert list(trackers[0].docs) == ["four"]


def test_bad_documents_fail_alone(docs, tmp_path, tiny_moe):
    (docs / "bin.txt").write_bytes(b"\x00\x00\xff")
    (docs / "long.txt").write_text("word " * 400)
    out = tmp_path / "out"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4")
    assert code == 1, output
    assert not (out / "bin.md").exists()
    assert (out / "one.md").exists() and (out / "two.md").exists() and (out / "long.md").exists()
    full = json.loads((out / "report.json").read_text())
    report = {d["id"]: d for d in full["documents"]}
    assert "binary" in report["bin"]["error"]
    # Longer than the 256-token context: summarised in parts, never truncated.
    assert report["long"]["status"] == "done" and report["long"]["parts"] >= 2
    assert report["long"]["input_tokens"] > 256 and full["totals"]["chunked"] == 1
    assert "1 long, summarised in parts" in " ".join(output.split())  # the end-of-run lines wrap between words


@pytest.fixture(autouse=True)
def _short_context(request, monkeypatch):
    # The tiny checkpoints state no context length; give them a small one so
    # that a long document (map-reduce) is reachable with a short file.
    monkeypatch.setattr("mlx_tier.job.model_setup.FALLBACK_CONTEXT", 256)


def test_bad_input_exit_2(docs, tmp_path, tiny_moe, tiny_dense):
    cases = [
        ((tmp_path / "nope", "--out", tmp_path / "o"), "no such file or folder"),
        ((tmp_path / "emptydir", "--out", tmp_path / "o"), "no documents found"),
        ((docs, "--out", docs / "one.txt" / "sub"), "output folder not writable"),
        ((docs, "--out", tmp_path / "o", "--model", tmp_path / "no-model"), "model folder not found"),
        ((docs, "--out", tmp_path / "o", "--model", tmp_path / "emptydir"), "no config.json"),
        ((docs, "--out", tmp_path / "o", "--model", tiny_dense), "not a Mixture-of-Experts checkpoint"),
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--cache-gb", "1e-7"), "too small"),
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--cache-gb", "-1"), "must be a finite positive number"),
        ((docs, "--out", tmp_path / "o", "--prompt", "@" + str(tmp_path / "none.txt")), "cannot read prompt file"),
        # --background checks before detaching
        ((docs, "--out", tmp_path / "o", "--model", tmp_path / "no-model", "--background"), "model folder not found"),
        ((docs, "--out", tmp_path / "o", "--max-tok-s", "0", "--background"), "--max-tok-s must be a positive"),
        # a KV cache quantized to bits mx.quantize does not pack, or for the paced schedule
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--kv-bits", "3"), "--kv-bits must be one of 4, 8"),
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--kv-bits", "8", "--schedule", "paced"),
         "needs the throughput schedule"),
        # a context too small for --max-tokens and the instruction: refused before any document
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--context", "100"), "raise --context"),
    ]
    (tmp_path / "emptydir").mkdir()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "fine"}\n{oops}\n')
    cases.append(((bad, "--out", tmp_path / "o", "--model", tiny_moe), "bad.jsonl:2: malformed JSON"))
    for args, message in cases:
        code, output = run(*args)
        assert code == 2, (args, output)
        lines = error_lines(output)
        assert len(lines) == 1 and message in lines[0], (args, output)
        assert not (tmp_path / "o").exists(), args  # a run that never started leaves no folder
    # a user trial: a folder with files it skips printed "skipped ..." before a wrong model's error
    (docs / "table.csv").write_text("a,b\n")
    for model in (tmp_path / "no-model", tmp_path / "emptydir", tiny_dense):
        code, output = run(docs, "--out", tmp_path / "o", "--model", model)
        assert code == 2 and output.strip().startswith("error:") and "skipped" not in output, output
    code, output = run(docs, "--out", tmp_path / "o", "--model", tiny_moe, "--max-tokens", "4")
    assert "skipped 1 file: .csv 1" in output, output  # said once the model is loaded
    (docs / "table.csv").unlink()


def test_a_max_tokens_beyond_the_context_is_refused_before_anything_loads(docs, tmp_path, tiny_moe, monkeypatch):
    """A user trial: `--max-tokens 99999999999999999999` printed the memory split and
    "loading ..." before "error: a context of 8192 tokens is not enough". The model's
    context and tokenizer are read before the split is said or anything loaded."""
    import mlx_tier.engine.load as engine_load

    monkeypatch.setattr(engine_load, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    for tokens, more in (("99999999999999999999", ()), ("4096", ()), ("4096", ("--context", "20000"))):
        code, output = run(docs, "--out", tmp_path / "o", "--model", tiny_moe, "--max-tokens", tokens, *more)
        lines = error_lines(output)
        assert code == 2 and len(lines) == 1 and f"not enough for --max-tokens {tokens}" in lines[0], output
        assert "memory:" not in output and "loading" not in output, output
        assert not (tmp_path / "o").exists()
        # the model's own context (a --context above it is capped): raising --context cannot help
        assert "the model's context of" in lines[0] and lines[0].endswith("; lower --max-tokens"), lines


def test_prompt_from_file_and_jsonl(tmp_path, tiny_moe):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "q1", "text": "Cats sleep a lot."}) + "\n")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("List the nouns.")
    out = tmp_path / "out"
    code, output = run(inp, "--out", out, "--model", tiny_moe, "--prompt", f"@{prompt}", "--max-tokens", "3")
    assert code == 0, output
    assert json.loads((out / "report.json").read_text())["prompt"] == "List the nouns."
    assert (out / "q1.md").exists()


class InterruptAfterFirst(Reporter):
    """Sends this process SIGINT when the first document finishes, as Ctrl-C would."""

    def finished(self, result, cache):
        if not getattr(self, "sent", False):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize("batch", [1, 2])
def test_ctrl_c_stops_after_documents_in_progress_and_resume_finishes(docs, tmp_path, tiny_moe, batch):
    out = tmp_path / "out"
    config = JobConfig(input=docs, out_dir=out, model=tiny_moe,
                       generation=GenerationConfig(max_tokens=4, batch_size=batch))
    report = run_job(config, InterruptAfterFirst())
    assert report.interrupted
    # Those in flight at the signal finish (one, or the batch of two); the rest never start.
    assert [r.status for r in report.results].count("done") == batch
    assert [r.status for r in report.results].count("pending") == 3 - batch
    assert len(list(out.glob("*.md"))) == batch
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    entries = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    stopped = [r["run_t"] for r in entries if r.get("event") == "stopped"]  # dates the stop for `status`
    done_t = [r["run_t"] for r in entries if r.get("status") == "done"]
    assert len(stopped) == 1 and stopped[0] >= max(done_t)
    assert report.generation_seconds == pytest.approx(stopped[0] - report.load_seconds, abs=2e-3)  # to the stop
    # the achieved line and the run's record: one figure (the achieved one timed to the last document)
    assert report.setup["generation"]["achieved_docs_per_hour"] == report.runs[-1]["documents_per_hour"]
    report = run_job(config)
    assert not report.interrupted
    assert sorted(r.status for r in report.results) == ["done"] * 3
    assert sum(r.earlier_run for r in report.results) == batch  # the first run's, not regenerated


def test_a_stop_in_which_every_summary_finished_is_a_finished_run(docs, tmp_path, tiny_moe):
    """A user trial: Ctrl-C while the last summaries were being written exited 0, where the
    README said 130. What was being written finished, so nothing is left: the run is not
    interrupted (the README says so now), and journals no stop."""
    out = tmp_path / "out"
    config = JobConfig(input=docs, out_dir=out, model=tiny_moe, generation=GenerationConfig(max_tokens=4, batch_size=3))
    report = run_job(config, InterruptAfterFirst())
    assert not report.interrupted and report.stop_signal is not None
    assert sorted(r.status for r in report.results) == ["done"] * 3
    assert '"stopped"' not in (out / "journal.jsonl").read_text()


def test_crash_after_output_before_journal_is_recovered(docs, tmp_path, tiny_moe):
    from mlx_tier.outdir.journal import JobInfo, Journal

    out = tmp_path / "out"
    out.mkdir()
    # The killed run had journalled its start (which names "one"), written
    # one.md atomically, and died before journalling it as done.
    JobInfo(input=str(docs), ids=["one", "two"], todo=["one", "two"], started=0.0, pid=1).write(Journal(out))
    (out / "one.md").write_text("finished before the crash\n")
    report = run_job(JobConfig(input=docs, out_dir=out, model=tiny_moe, generation=GenerationConfig(max_tokens=3)))
    assert (out / "one.md").read_text() == "finished before the crash\n"
    one = {r.id: r for r in report.results}["one"]
    assert one.status == "done" and one.earlier_run


def test_a_users_file_under_an_output_name_of_a_stopped_run_is_not_a_summary(docs, tmp_path, tiny_moe):
    """A user trial: a run stopped before any summary; the user put their own one.md in the
    output folder; the rerun took it for a summary a crash left ("skipping 1 already done"),
    and the document was never summarised. A run of this version journals each output
    before its rename: an output of its documents that no record names is someone else's.
    The rerun refuses in one line and touches nothing; once the file is moved, it runs."""
    from mlx_tier.outdir.journal import JobInfo, Journal

    out = tmp_path / "out"
    out.mkdir()
    JobInfo(input=str(docs), ids=["one", "two"], todo=["one", "two"], started=0.0, pid=1, writes=True).write(
        Journal(out))
    (out / "one.md").write_text("my own notes\n")
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "3")
    lines = error_lines(output)
    assert code == 2 and len(lines) == 1 and f"{out / 'one.md'}: not written by mlx-tier" in lines[0], output
    assert (out / "one.md").read_text() == "my own notes\n" and not (out / "two.md").exists()
    (out / "one.md").rename(tmp_path / "mine.md")
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "3")
    assert code == 0 and (out / "one.md").exists(), output


def test_trim_to_sentence():
    from mlx_tier.job.prompts import trim_to_sentence

    assert trim_to_sentence("One. Two! Three is cut") == "One. Two!"
    assert trim_to_sentence("no sentence end") == "no sentence end…"  # kept, marked cut


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output.startswith("mlx-tier ")


def test_ids_unique_out_dir_inside_input_and_lock(tmp_path, tiny_moe):
    from mlx_tier.job.documents import discover
    from mlx_tier.outdir.jobdir import lock_out_dir
    from mlx_tier.outdir.layout import LOCK

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a b.txt").write_text("first")
    (docs / "a_b.txt").write_text("second")
    (docs / "Notes.txt").write_text("third")
    (docs / "notes.md").write_text("fourth")
    ids = [d.id for d in discover(docs)]
    assert len({i.casefold() for i in ids}) == 4, ids
    out = docs / "summaries"  # the output folder inside the input folder
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "2")
    assert code == 0, output
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "2")
    assert "skipping 4 documents" in output  # its summaries were not taken as new input
    held = lock_out_dir(out)
    try:
        code, output = run(docs, "--out", out, "--model", tiny_moe)
        assert code == 2 and "another mlx-tier run is using this output folder" in output
    finally:
        held.close()
    assert (out / LOCK).exists()


def test_nan_budget_and_unwritable_trace_path_exit_2_with_one_line(tmp_path, tiny_moe, docs):
    for args, message in [
        ((docs, "--out", tmp_path / "o", "--cache-gb", "nan"), "must be a finite positive number"),
        ((docs, "--out", tmp_path / "o", "--cache-gb", "inf"), "must be a finite positive number of GiB, got inf"),
        ((docs, "--out", tmp_path / "o", "--model", tiny_moe, "--trace", tmp_path / "no" / "t.npz"), "cannot write the trace"),
    ]:
        code, output = run(*args)
        assert code == 2 and message in output, output


def test_policy_profile_round_trip(docs, tmp_path, tiny_moe):
    """--policy pinned needs a saved profile (exit 2 saying how to make one);
    --save-profile records one next to the checkpoint; then pinned runs, pre-warmed."""
    import shutil

    model = shutil.copytree(tiny_moe, tmp_path / "model")
    code, output = run(docs, "--out", tmp_path / "o1", "--model", model, "--policy", "pinned")
    assert code == 2 and len(error_lines(output)) == 1 and "profile" in error_lines(output)[0]
    code, output = run(docs, "--out", tmp_path / "o1", "--model", model, "--policy", "nope")
    assert code == 2 and "--policy must be one of" in output
    code, output = run(docs, "--out", tmp_path / "o2", "--model", model, "--max-tokens", "3", "--cache-gb", "0.0001",
                       "--save-profile")
    assert code == 0, output
    assert (model / "mlx-tier-profile.json").exists()
    code, output = run(docs, "--out", tmp_path / "o3", "--model", model, "--max-tokens", "3", "--cache-gb", "0.0001",
                       "--policy", "pinned")
    assert code == 0, output
    report = json.loads((tmp_path / "o3" / "report.json").read_text())
    assert report["policy"] == "pinned" and report["cache"]["prewarmed"] > 0


def test_max_tok_s_caps_the_job_and_status_shows_throttle_time(docs, tmp_path, tiny_moe):
    from mlx_tier.job.throttle import ThrottleConfig
    from mlx_tier.monitor.status import read_status

    out = tmp_path / "out"
    config = JobConfig(input=docs, out_dir=out, model=tiny_moe, generation=GenerationConfig(max_tokens=4, batch_size=3),
                       throttle=ThrottleConfig(max_tok_s=20.0))
    report = run_job(config)
    tokens = report.output_tokens
    assert tokens >= 6 and report.throttle["capped_seconds"] > 0
    assert report.throttle["tokens"] == tokens
    # paced to the cap: the decode steps cannot have produced tokens faster than 20/s
    assert report.throttle["elapsed_seconds"] >= (tokens - 3) / 20.0
    st = read_status(out)
    assert st.throttled_seconds == pytest.approx(report.runs[-1]["throttled_seconds"], abs=0.01)
    assert st.thermal and st.thermal[0]["mode"] == "full"  # the throttle's state at start, journalled
    result = runner.invoke(app, ["status", str(out)])
    words = " ".join(result.output.split())
    at = re.search(r"capped at 20 tok/s from ([\d.]+) s into the run", words)
    assert result.exit_code == 0 and at, result.output
    assert float(at.group(1)) == pytest.approx(st.thermal[0]["run_t"], abs=0.06)  # the run's clock, not the throttle's


def test_kernel_option(docs, tmp_path, tiny_moe):
    """--kernel: bad names and metal without Metal exit 2 with one line; cpu and mlx write the same summaries."""
    import mlx.core as mx

    code, output = run(docs, "--out", tmp_path / "o0", "--model", tiny_moe, "--kernel", "gpu")
    assert code == 2 and "--kernel: kernel must be one of mlx, cpu, metal, auto; got 'gpu'" in output
    if not mx.metal.is_available():
        code, output = run(docs, "--out", tmp_path / "o0", "--model", tiny_moe, "--kernel", "metal")
        assert code == 2 and len(error_lines(output)) == 1 and "needs Apple Metal" in output
    texts = []
    for kernel in ("cpu", "mlx"):
        out = tmp_path / kernel
        code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4", "--kernel", kernel)
        assert code == 0, output
        texts.append(sorted((p.name, p.read_text()) for p in out.glob("*.md")))
        assert json.loads((out / "report.json").read_text())["kernel"] == kernel
    assert texts[0] == texts[1] and texts[0]


def test_kv_bits_runs_quantized_and_a_head_dim_it_cannot_group_exits_2(docs, tmp_path, tiny_moe, moe_head_dim_64):
    out = tmp_path / "out"
    code, output = run(docs, "--out", out, "--model", moe_head_dim_64, "--max-tokens", "8", "--kv-bits", "8")
    assert code == 0, output
    report = json.loads((out / "report.json").read_text())
    assert report["kv_bits"] == 8
    quantized = report["generation"]["kv_bytes_per_token"]
    code, output = run(docs, "--out", tmp_path / "plain", "--model", moe_head_dim_64, "--max-tokens", "8")
    assert code == 0, output
    unquantized = json.loads((tmp_path / "plain" / "report.json").read_text())
    assert unquantized["kv_bits"] is None
    # The summaries depend on the KV cache: a rerun without --kv-bits keeps them and says so
    code, output = run(docs, "--out", out, "--model", moe_head_dim_64, "--max-tokens", "8")
    assert code == 0 and "keeping 3 summaries written with another --kv-bits" in " ".join(output.split()), output
    code, output = run(docs, "--out", out, "--model", moe_head_dim_64, "--max-tokens", "8", "--redo-changed")
    assert code == 0 and "redoing 3 summaries written with another --kv-bits" in " ".join(output.split()), output
    # 8-bit codes and float32 scales and biases per group of 64: 1.125 bytes an element against 4
    assert quantized == pytest.approx(unquantized["generation"]["kv_bytes_per_token"] * 1.125 / 4, rel=0.01)
    # tiny_moe's head dim is 16: no group of 64 fits; refused before loading, no folder made
    code, output = run(docs, "--out", tmp_path / "o16", "--model", tiny_moe, "--max-tokens", "8", "--kv-bits", "8")
    lines = error_lines(output)
    assert code == 2 and len(lines) == 1 and "cannot be quantized (--kv-bits)" in lines[0], output
    assert "loading" not in output and not (tmp_path / "o16").exists()


def test_output_to_a_closed_pipe_exits_141_not_1(tmp_path, tiny_moe):
    """A user trial: `mlx-tier run ... | head -1` exited 1 ("some documents failed") after every
    summary was written: Rich's console (and click, for --help) answers a closed pipe with 1.
    It is 141, as for `yes | head`; the run's files are all written."""
    import subprocess
    import sys

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("The ferry crossed the bay at dawn and returned before the storm.")
    for args in (["--help"], ["run", str(docs), "--out", str(tmp_path / "out"), "--model", str(tiny_moe),
                              "--kernel", "mlx", "--max-tokens", "4"]):
        p = subprocess.Popen([sys.executable, "-m", "mlx_tier.cli.main", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        p.stdout.close()  # the reader is gone before the first line is written
        assert p.wait(timeout=300) == 141, args
    assert (tmp_path / "out" / "a.md").exists() and (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize("argv, said", [
    (["run", "", "--out", "o"], "argument 2 (after run) is empty"),  # a user trial: it summarised the current folder
    (["status", ""], "argument 2 (after status) is empty"),  # a user trial: read "." as the job
    (["plan", ""], "argument 2 (after plan) is empty"),
    (["run", "docs", "--out", ""], "--out is empty"),
    (["run", "docs", "--out="], "--out is empty"),
])
def test_an_empty_argument_is_refused_not_read_as_the_current_folder(argv, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, argv)
    errors = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and said in errors[0], r.output
    assert "an unset shell variable?" in " ".join(r.output.split())
    assert not list(tmp_path.iterdir())  # nothing read or written


def test_a_value_ending_in_an_equals_sign_is_not_empty():
    """A review: `--out=/tmp/x/b=` (a folder named `b=`) was refused as an empty --out."""
    from mlx_tier.cli.exits import _empty_argument

    assert _empty_argument(["run", "docs", "--out=/tmp/x/b=", "--prompt=Reply as key="]) is None
    assert _empty_argument(["run", "docs", "--", ""]) is None  # after `--`: not ours to judge
    assert "--out is empty" in _empty_argument(["run", "docs", "--out="])
