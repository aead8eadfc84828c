"""Invariant 3 at the output folder: nothing is written through a link planted in OUT_DIR;
a full disk at any write site stops the job with one line and exit 3, leaving the journal
whole and every finished summary kept, and the rerun finishes the job; unusable journal
lines are skipped with a warning naming them; a checkpoint that fails mid-job stops the
job with the documents not attempted still pending.
"""

import errno
import json
import os
import re
from pathlib import Path

import pytest
from support.jobs import _short_context, done_lines, make_docs, small_moe  # noqa: F401 - fixtures
from support.output import command_after
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import InputError
from mlx_tier.fsio import write_atomic
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import check_out_dir

runner = CliRunner()


@pytest.mark.parametrize("name", ["journal.jsonl", ".mlx-tier.lock", "summaries.jsonl", "report.json", "x.md"])
def test_links_planted_in_out_dir_refuse_the_folder(tmp_path, name):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious\n")
    (out / name).symlink_to(victim)
    with pytest.raises(InputError, match=re.escape(f"{out / name}: is a symbolic link; refusing to write through it")):
        check_out_dir(out)
    assert victim.read_text() == "precious\n"


def test_appends_never_follow_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "journal.jsonl").symlink_to(victim)
    with pytest.raises(OSError) as e:
        Journal(tmp_path).append({"id": "a", "status": "done"})
    assert e.value.errno == errno.ELOOP and e.value.filename == str(tmp_path / "journal.jsonl")
    write_atomic(tmp_path / "journal.jsonl", "replaced\n")  # a rename replaces the link itself
    assert victim.read_text() == "precious\n" and not (tmp_path / "journal.jsonl").is_symlink()


def test_out_dir_equal_to_or_above_input_is_refused(tmp_path):
    docs = tmp_path / "docs"
    make_docs(docs, 1)
    for out, message in [(docs, "the output folder is the input folder"),
                         (tmp_path, f"the output folder contains the input folder {docs}")]:
        r = runner.invoke(app, ["run", str(docs), "--out", str(out)])
        assert r.exit_code == 2 and message in r.output, r.output
    import psutil

    for too_much in ["1e9", str(psutil.virtual_memory().total / 2**30 + 1)]:
        r = runner.invoke(app, ["run", str(docs), "--out", str(docs / "summaries"), "--cache-gb", too_much])
        assert r.exit_code == 2 and "is more than this machine's memory" in r.output, r.output


def test_an_output_folder_holding_the_input_file_or_documents_inside_input_is_refused(tmp_path):
    """A user trial: `run notes/cats.txt --out notes` wrote cats.md and the reports among the
    documents (the next run of the folder summarised the summary), and `run notes --out
    notes/2024` silently left out the documents notes/2024 held. Both are refused, one line,
    exit 2, before anything is written; a job's own folder inside INPUT is still its output."""
    notes = tmp_path / "notes"
    make_docs(notes, 2)
    first = sorted(notes.iterdir())[0]
    before = sorted(p.name for p in notes.iterdir())
    for out in (notes, tmp_path):
        r = runner.invoke(app, ["run", str(first), "--out", str(out)])
        assert r.exit_code == 2 and r.output.count("error:") == 1, r.output
        assert "the output folder holds the input file" in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in notes.iterdir()) == before
    (notes / "2024").mkdir()
    (notes / "2024" / "budget.txt").write_text("The 2024 budget raised taxes on imported steel.")
    r = runner.invoke(app, ["run", str(notes), "--out", str(notes / "2024")])
    words = " ".join(r.output.split())
    assert r.exit_code == 2 and "holds 1 file of no mlx-tier job" in words, words
    assert sorted(p.name for p in (notes / "2024").iterdir()) == ["budget.txt"]


def test_run_refuses_a_folder_with_a_planted_link(tmp_path):
    docs, out, victim = tmp_path / "docs", tmp_path / "out", tmp_path / "bashrc"
    make_docs(docs, 1)
    out.mkdir()
    victim.write_text("precious\n")
    (out / ".mlx-tier.lock").symlink_to(tmp_path / "created-elsewhere")
    (out / "journal.jsonl").symlink_to(victim)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out)])
    assert r.exit_code == 2 and r.output.count("error:") == 1 and "is a symbolic link" in r.output, r.output
    assert victim.read_text() == "precious\n" and not (tmp_path / "created-elsewhere").exists()


@pytest.mark.parametrize("name, text", [
    ("report.json", '{"my": "own report"}\n'),
    ("summaries.jsonl", '{"mine": 1}\n{"mine": 2}'),  # its last line without a newline: it was cut
    ("output.jsonl", '{"custom_id": "x"}\n'),
    ("report.html", "<p>my page</p>"),
    ("journal.jsonl", "my own journal, line one\n"),  # a file of that name that is no journal
    ("journal.jsonl", "hello world"),  # a trial: one line, no newline: no record torn by a crash either
    ("journal.jsonl", '{"mine": 1}'),
])
def test_a_users_own_file_of_a_jobs_name_refuses_the_folder(tmp_path, name, text):
    """A review: a user's report.json in --out was replaced, their summaries.jsonl cut at its
    last line and appended to (their x.md was already kept apart). A folder holding such a
    file that no job wrote is refused, exit 2, nothing touched."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 1)
    out.mkdir()
    (out / name).write_text(text)
    (out / "x.md").write_text("my notes")
    r = runner.invoke(app, ["run", str(docs), "--out", str(out)])
    assert r.exit_code == 2 and r.output.count("error:") == 1 and str(out / name) in " ".join(r.output.split()), r.output
    assert sorted(p.name for p in out.iterdir()) == sorted([name, "x.md"]) and (out / name).read_text() == text


def test_a_journal_whose_first_record_was_torn_is_the_jobs_own(tmp_path, small_moe):  # noqa: F811
    """A review: a power cut during a run's first append leaves a journal of one torn line;
    the refusal of a journal that is no journal refused that job's own folder."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 1)
    out.mkdir()
    (out / "journal.jsonl").write_text('{"event": "start", "input": "in')  # no newline: torn
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert set(done_lines(out)) == {"doc00"}
    # a trial: an empty journal (no record) beside a user's report.json vouched for it: refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "journal.jsonl").write_text("")
    (other / "report.json").write_text('{"mine": 1}\n')
    r = runner.invoke(app, ["run", str(docs), "--out", str(other), "--model", str(small_moe)])
    assert r.exit_code == 2 and "not written by an mlx-tier job" in r.output, r.output
    assert (other / "report.json").read_text() == '{"mine": 1}\n'


def _disk_full_after(monkeypatch, matches, allowed: int):
    """Make ``os.write`` fail with ENOSPC on files whose name ``matches``, after ``allowed`` writes to them."""
    real, count = os.write, [0]

    def write(fd, data):
        if matches(Path(os.readlink(f"/proc/self/fd/{fd}")).name):
            count[0] += 1
            if count[0] > allowed:
                if count[0] == allowed + 1 and len(data) > 3:  # a torn write first: some bytes land
                    real(fd, bytes(data)[:3])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


SITES = {
    "summary": (lambda n: bool(re.match(r"^\..+\.md\.\w{8}\.tmp$", n)), 1),
    "journal": (lambda n: n == "journal.jsonl", 2),  # the start record and a first document
    "summaries.jsonl": (lambda n: n == "summaries.jsonl", 1),
    "report.json": (lambda n: n.startswith(".report.json."), 0),
}


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to tell which file a write goes to")
@pytest.mark.parametrize("site", list(SITES))
def test_full_disk_at_each_write_site(tmp_path, small_moe, monkeypatch, site):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    ids = [p.stem for p in make_docs(docs, 3)]
    args = ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8", "--format", "jsonl",
            "--batch-size", "1"]
    with monkeypatch.context() as m:
        _disk_full_after(m, *SITES[site])
        r = runner.invoke(app, args)
    assert r.exit_code == 3, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in " ".join(r.output.split()), r.output
    assert command_after(r.output, "resume with:").startswith("mlx-tier run "), r.output
    assert "Traceback" not in r.output
    lines = (out / "journal.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(x) for x in lines[:-1])  # whole records only
    for doc_id in done_lines(out):
        assert (out / f"{doc_id}.md").read_text().strip()  # every recorded summary is there
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert not (Journal(out).records().keys() - set(done_lines(out)))  # nothing marked failed

    r = runner.invoke(app, args)  # space freed: the same command finishes the job
    assert r.exit_code == 0, r.output
    assert set(done_lines(out)) == set(ids)
    summaries = [json.loads(x) for x in (out / "summaries.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in summaries) == ids
    assert json.loads((out / "report.json").read_text())["totals"]["failed"] == 0


def test_bad_journal_lines_are_skipped_with_a_warning(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    out.mkdir()
    (out / "journal.jsonl").write_text('{"id": ["x"], "status": "done"}\n{"id": "doc00", "status": "done", '
                                       '"time": "yesterday"}\n{"event": "start", "ids": "doc00", "todo": []}\n')
    warnings = [f"{out / 'journal.jsonl'}:1: skipped (\"id\" is [\"x\"], not str)",
                f"{out / 'journal.jsonl'}:2: skipped (\"time\" is \"yesterday\", not int or float)",
                f"{out / 'journal.jsonl'}:3: skipped (\"ids\" is \"doc00\", not list)"]
    r = runner.invoke(app, ["status", str(out)])
    assert r.exit_code == 0 and all(w in r.output for w in warnings), r.output
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    said = " ".join(r.output.split())  # the run's messages are wrapped between words
    assert r.exit_code == 0 and all(" ".join(w.split()) in said for w in warnings), r.output
    assert set(done_lines(out)) == {"doc00", "doc01"}
    r = runner.invoke(app, ["status", str(out), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout[r.stdout.index("{"):])["done"] == 2


def test_checkpoint_unreadable_mid_job_stops_with_the_rest_pending(tmp_path, small_moe, monkeypatch):  # noqa: F811
    import shutil

    from mlx_tier.job import run as jobs

    model, docs, out = tmp_path / "model", tmp_path / "docs", tmp_path / "out"
    shutil.copytree(small_moe, model)
    (shard,) = model.glob("*.safetensors")
    whole = shard.read_bytes()
    ids = [p.stem for p in make_docs(docs, 4)]
    real_record = jobs._record

    def record(outcome, res, out_dir, *rest):
        real_record(outcome, res, out_dir, *rest)
        if shard.stat().st_size == len(whole):
            os.truncate(shard, len(whole) // 2)  # after the first summary the shard is cut short

    monkeypatch.setattr(jobs, "_record", record)
    args = ["run", str(docs), "--out", str(out), "--model", str(model), "--max-tokens", "8", "--batch-size", "1",
            "--cache-gb", "0.00003"]  # about one expert slot per layer: reads go on all job long
    r = runner.invoke(app, args)
    assert r.exit_code == 3, r.output
    said = " ".join(r.output.split())  # wrapped between words, where depends on the paths' lengths
    assert "the checkpoint became unreadable" in said and "unexpected end of file" in said, r.output
    records = Journal(out).records()
    assert [i for i, rec in records.items() if rec["status"] == "done"] == [ids[0]]
    assert not [i for i, rec in records.items() if rec["status"] == "failed"]  # the rest stay pending
    monkeypatch.setattr(jobs, "_record", real_record)
    shard.write_bytes(whole)  # the disk is back
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert set(done_lines(out)) == set(ids)
