"""`mlx-tier run` on a document read in parts: a run that ends midway (killed, or stopped)
keeps the calls it finished (OUT_DIR/parts.jsonl); the rerun says so, generates only the
rest, and writes the summary an uninterrupted run writes; the kept lines go once the
document is done. Changed settings reuse nothing."""

from __future__ import annotations

import json

import pytest
from support.jobs import WORDS, _short_context, folder, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import PARTS
from mlx_tier.outdir.parts import PartStore

runner = CliRunner()
BOOK = "\n\n".join(" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(40)) + "." for i in range(12))


def make(tmp_path):
    return folder(tmp_path / "docs", **{"book.txt": BOOK, "note.txt": "Bees carry pollen between flowers."})


def args(docs, out, model, *extra, schedule="paced"):
    return ["run", str(docs), "--out", str(out), "--model", str(model), "--max-tokens", "8", "--kernel", "mlx",
            "--schedule", schedule, *extra]


def killed_after(monkeypatch, calls: int) -> None:
    """Runs end as a killed process would, right after their ``calls``-th call is kept."""
    real = PartStore.keep

    def keep(self, prompt, call):
        real(self, prompt, call)
        if len(self.path.read_text().splitlines()) >= calls:
            raise SystemExit(137)

    monkeypatch.setattr(PartStore, "keep", keep)
    return real


@pytest.mark.parametrize("schedule", ["paced", "throughput"])
def test_a_run_killed_inside_a_long_document_resumes_from_its_kept_calls(tmp_path, small_moe, monkeypatch,  # noqa: F811
                                                                         schedule):
    docs = make(tmp_path)
    whole = runner.invoke(app, args(docs, tmp_path / "whole", small_moe, schedule=schedule))
    assert whole.exit_code == 0, whole.output
    parts = Journal(tmp_path / "whole").records()["book"]["parts"]
    assert parts >= 3 and not (tmp_path / "whole" / PARTS).exists()  # the document is done: nothing kept

    out = tmp_path / "out"
    real = killed_after(monkeypatch, 2)
    killed = runner.invoke(app, args(docs, out, small_moe, schedule=schedule))
    assert killed.exit_code == 137 and not (out / "book.md").exists()
    killed_lines = (out / PARTS).read_text().splitlines()
    assert len(killed_lines) == 2
    monkeypatch.setattr(PartStore, "keep", real)

    resumed = runner.invoke(app, args(docs, out, small_moe, schedule=schedule))
    assert resumed.exit_code == 0, resumed.output
    assert "1 long document resumes from 2 finished calls an earlier run kept" in " ".join(resumed.output.split())
    record = Journal(out).records()["book"]
    assert record["parts_kept"] == 2 and record["parts"] == parts
    assert (out / "book.md").read_bytes() == (tmp_path / "whole" / "book.md").read_bytes()
    whole = json.loads((tmp_path / "whole" / "report.json").read_text())
    kept = [json.loads(line)["tokens"] for line in killed_lines]
    # A user trial: the document's tokens counted only this run's calls. Its out tok counts every
    # call's (as the uninterrupted run's), the run's own figures only the calls it generated.
    assert record["output_tokens"] == Journal(tmp_path / "whole").records()["book"]["output_tokens"]
    assert record["kept_tokens"] == sum(kept) > 0
    assert not (out / PARTS).exists()  # done: its kept calls are dropped
    report = json.loads((out / "report.json").read_text())
    assert {r["id"]: r.get("parts_kept") for r in report["documents"]}["book"] == 2
    assert report["runs"][-1]["output_tokens"] == whole["runs"][-1]["output_tokens"] - sum(kept)
    assert report["totals"]["output_tokens"] == whole["totals"]["output_tokens"]
    again = runner.invoke(app, args(docs, out, small_moe, schedule=schedule))  # nothing to do: the figures stay
    assert again.exit_code == 0 and "nothing to do" in again.output, again.output
    book = {r["id"]: r for r in json.loads((out / "report.json").read_text())["documents"]}["book"]
    assert (book["parts_kept"], book["kept_tokens"], book["earlier_run"]) == (2, sum(kept), True)


def test_a_changed_long_document_redone_resumes_too(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A review: the kept calls of a document being redone (its file changed since its
    summary) were dropped at the next start, its old ``done`` record taken for finished."""
    docs = make(tmp_path)
    out = tmp_path / "out"
    assert runner.invoke(app, args(docs, out, small_moe)).exit_code == 0
    (docs / "book.txt").write_text(BOOK.replace("river", "stream"))
    (tmp_path / "whole").mkdir()
    whole = runner.invoke(app, args(docs / "book.txt", tmp_path / "whole", small_moe))  # the new text, at once
    assert whole.exit_code == 0, whole.output
    real = killed_after(monkeypatch, 2)
    assert runner.invoke(app, args(docs, out, small_moe)).exit_code == 137
    monkeypatch.setattr(PartStore, "keep", real)
    resumed = runner.invoke(app, args(docs, out, small_moe))
    assert resumed.exit_code == 0, resumed.output
    words = " ".join(resumed.output.split())
    assert "1 long document resumes from 2 finished calls" in words and "stale" in words, words
    assert Journal(out).records()["book"]["parts_kept"] == 2
    assert (out / "book.md").read_bytes() == (tmp_path / "whole" / "book.md").read_bytes()


def test_kept_calls_are_not_reused_under_other_settings(tmp_path, small_moe, monkeypatch):  # noqa: F811
    docs = make(tmp_path)
    out = tmp_path / "out"
    real = killed_after(monkeypatch, 2)
    assert runner.invoke(app, args(docs, out, small_moe)).exit_code == 137
    monkeypatch.setattr(PartStore, "keep", real)
    (docs / "book.txt").write_text(BOOK.replace("river", "stream"))  # the document changed
    r = runner.invoke(app, args(docs, out, small_moe, "--max-tokens", "9"))  # and an option
    assert r.exit_code == 0, r.output
    assert "resume from" not in r.output  # a review: the note counted calls of other settings
    record = Journal(out).records()["book"]
    assert record["status"] == "done" and "parts_kept" not in record


def test_a_stopped_runs_record_counts_the_calls_it_kept(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A user trial: a run stopped inside a long document kept 6 finished calls (96 tokens) but
    its record said 16 output tokens: the kept calls' tokens were counted in no run (the run
    that finished the document counts only what it generated). The stopped run counts them."""
    import os
    import signal

    docs, out = make(tmp_path), tmp_path / "out"
    real = PartStore.keep

    def keep(self, prompt, call):
        real(self, prompt, call)
        if len(self.path.read_text().splitlines()) == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a first Ctrl-C: the run stops after this step

    monkeypatch.setattr(PartStore, "keep", keep)
    stopped = runner.invoke(app, args(docs, out, small_moe, "--batch-size", "1"))
    assert stopped.exit_code == 130 and not (out / "book.md").exists(), stopped.output
    kept = sum(json.loads(line)["tokens"] for line in (out / PARTS).read_text().splitlines())
    done = sum(r.get("output_tokens", 0) for r in Journal(out).records().values() if r.get("status") == "done")
    run = json.loads((out / "report.json").read_text())["runs"][-1]
    assert kept > 0 and run["output_tokens"] == kept + done, (run["output_tokens"], kept, done)
    # a user trial: the terminal and report.json said 7.23 output tok/s for such a run, `status` and the
    # page 0.00: they count the kept calls too, from the run's stopped record
    from mlx_tier.monitor.page import render_page
    from mlx_tier.monitor.view import build_view

    st = read_status(out)
    assert st.run_output_tokens == run["output_tokens"]
    assert st.output_tok_per_s == pytest.approx(run["output_tok_per_s"], rel=0.01)
    said = f"{st.output_tok_per_s:.2f} output tok/s"
    assert said in " ".join(runner.invoke(app, ["status", str(out)]).output.split())
    assert f">{st.output_tok_per_s:.2f}<" in render_page(build_view(out))
    assert st.output_tok_per_s > 0
