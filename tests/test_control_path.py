"""The job's control path (issue 11): the triage decides from plain data alone; a run
converts only the documents it runs, each when its turn comes (a rerun never converts
the documents already done, and `--background` converts nothing before detaching); a
document the process does not claim stays pending; the job folder is held while the
run works and freed after, whatever happens.
"""

import json

import pytest
from mlx_tier.cli.main import app
from test_crash import _short_context, make_docs, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier import documents
from mlx_tier.errors import InputError
from mlx_tier.jobdir import JobDir
from mlx_tier.jobs import JobConfig, run_job
from mlx_tier.scheduler import GenerationConfig
from mlx_tier.status import LOCK, lock_held
from mlx_tier.triage import OutputState, triage

runner = CliRunner()
FILE, LINK = OutputState(True, True), OutputState(True, False)


def test_triage_sorts_documents_by_journal_state_alone():
    records = {"a": {"status": "done"}, "b": {"status": "failed", "error": "x"}, "c": {"status": "done"},
               "f": {"status": "failed"}}
    outputs = {"a": FILE, "d": FILE, "e": FILE, "f": LINK}
    t = triage(["a", "b", "c", "d", "e", "f"], records, outputs, attempted={"d", "f"})
    assert list(t.done) == ["a"]  # done and its output is there
    assert t.recovered == ["d"]  # an earlier run's output, unrecorded (crash after the rename)
    assert list(t.failed) == ["b", "f"]  # a link is never adopted as a finished output
    assert t.pending == ["c", "e"]  # c's output is gone; e's file is the user's own (never attempted)
    retry = triage(["a", "b", "c"], records, outputs, retry_failed=True)
    assert (list(retry.done), retry.pending, retry.left) == (["a"], ["b"], ["c"])


def test_job_dir_is_held_while_entered_and_left_clean_when_unused(tmp_path):
    out = tmp_path / "out"
    with JobDir(out) as job:
        assert job.created and lock_held(out) and job.journal_path == out / "journal.jsonl"
        with pytest.raises(InputError, match="another mlx-tier run"), JobDir(out):
            pass
        job.discard_if_unused()  # nothing written: the folder this run created goes
        assert not out.exists()
    (out / "keep").mkdir(parents=True)
    with JobDir(out) as job:
        (out / ".x.md.abcd_123.tmp").write_text("half")
    assert not lock_held(out) and not job.created
    with JobDir(out) as job:  # a killed run's temp file is removed on entering
        assert sorted(p.name for p in out.iterdir()) == [LOCK, "keep"]


@pytest.fixture
def conversions(monkeypatch):
    """The names of the files converted, in order."""
    seen = []
    real = documents.convert_file

    def counting(path):
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(documents, "convert_file", counting)
    return seen


def test_a_rerun_converts_only_the_documents_it_runs(tmp_path, small_moe, conversions):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    assert run_job(config).count("done") == 2
    assert sorted(conversions) == ["doc00.txt", "doc01.txt"]
    conversions.clear()
    (docs / "new.txt").write_text("river flood spring farmer.")
    report = run_job(config)
    assert report.count("done") == 3 and conversions == ["new.txt"]  # done ones are not read again
    conversions.clear()
    assert run_job(config).count("done") == 3 and conversions == []  # nothing to do: nothing converted
    converters = {d["id"]: d["converter"] for d in json.loads((out / "report.json").read_text())["documents"]}
    assert converters == dict.fromkeys(["doc00", "doc01", "new"], "text (utf-8)")  # kept from the journal


def test_a_document_not_claimed_stays_pending_unread(tmp_path, small_moe, conversions):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 3)
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    report = run_job(config, claim=lambda doc_id: doc_id != "doc01")
    assert {r.id: r.status for r in report.results} == {"doc00": "done", "doc01": "pending", "doc02": "done"}
    assert "doc01.txt" not in conversions and not (out / "doc01.md").exists()


def test_background_start_converts_nothing(tmp_path, monkeypatch, conversions):
    from mlx_tier import status

    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    started = []
    monkeypatch.setattr(status, "start_background", lambda argv, out_dir, stdin: started.append(argv) or 4242)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--background"])
    assert r.exit_code == 0, r.output
    assert "pid 4242" in r.output and len(started) == 1 and conversions == []
