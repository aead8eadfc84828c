"""An output holds the summary of one file: a run that would summarise a document over the
finished summary of another file (another input of the same names, run into the same
output folder) is refused before the model loads, with one ``error:`` line naming the
output and both files, exit code 2, and nothing written; the same file reached again, a
folder moved or renamed (its old path gone) and journals that record no source go on as
before.
"""

import json
import os
from collections import Counter

import pytest
from support.jobs import _short_context, done_lines, folder, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

import mlx_tier.job.run as job_run
from mlx_tier.cli.main import app
from mlx_tier.errors import InputError
from mlx_tier.job.documents import Document, FileDocument
from mlx_tier.job.rerun import other_files, refuse_other_files
from mlx_tier.outdir.journal import Journal

runner = CliRunner()
INVOICE = "Invoice from ACME: the farmer owes 500 dollars for seed by March."
NOTE = "Medical note: the patient is allergic to bee pollen and the spring flower."


def run(*args):
    r = runner.invoke(app, ["run", *map(str, args)])
    return r.exit_code, " ".join(r.output.split()), [x for x in r.output.splitlines() if x.startswith("error:")]


def snapshot(out):
    """Every file of the output folder: its bytes and mtime (a refused run changes none)."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.iterdir())}


def refused_run(monkeypatch, *args):
    """``run(*args)`` where a model load fails the test: a refused run stops before it."""
    with monkeypatch.context() as m:
        m.setattr(job_run, "model_for", lambda *a, **k: pytest.fail("the model was loaded"))
        return run(*args)


def assert_refused(result, output, earlier, this):
    code, words, errors = result
    assert code == 2 and len(errors) == 1 and words.startswith("error:"), words  # one error, nothing before it
    assert f"error: {output} holds the summary of {os.path.abspath(earlier)}, not of this input's " \
           f"{os.path.abspath(this)}, which has the same output name; nothing was run" in words, words
    assert "Give this input another --out, or list the files of both on stdin (mlx-tier run -)" in words, words


def test_another_folder_of_the_same_names_is_refused_and_nothing_is_lost(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """The user trial: inB run into inA's output folder redid report.md "as stale" with inB's
    summary, and said the document had changed."""
    in_a = folder(tmp_path / "inA", **{"report.txt": INVOICE, "plan.txt": "The library buys a book on fruit."})
    in_b = folder(tmp_path / "inB", **{"report.txt": NOTE})
    out, opts = tmp_path / "sums", ("--model", small_moe, "--max-tokens", "4")
    assert run(in_a, "--out", out, *opts)[0] == 0
    before = snapshot(out)

    assert_refused(refused_run(monkeypatch, in_b, "--out", out, *opts), out / "report.md", in_a / "report.txt",
                   in_b / "report.txt")
    code, words, errors = refused_run(monkeypatch, in_b, "--out", out, *opts, "--background")  # now, not in a log
    assert code == 2 and len(errors) == 1 and "holds the summary of" in words, words
    assert snapshot(out) == before  # no journal record, no file touched

    code, words, _ = run(in_a, "--out", out, *opts)  # inA's job goes on as it was
    assert code == 0 and "skipping 2 documents already done" in words and "stale" not in words, words
    assert done_lines(out) == Counter({"report": 1, "plan": 1})


def test_another_single_file_of_the_same_name_is_refused(tmp_path, small_moe, monkeypatch):  # noqa: F811
    alpha = folder(tmp_path / "docs", **{"alpha.txt": INVOICE}) / "alpha.txt"
    other = folder(tmp_path / "other", **{"alpha.txt": NOTE}) / "alpha.txt"
    out, opts = tmp_path / "o", ("--model", small_moe, "--max-tokens", "4")
    assert run(alpha, "--out", out, *opts)[0] == 0
    before = snapshot(out)
    assert_refused(refused_run(monkeypatch, other, "--out", out, *opts), out / "alpha.md", alpha, other)
    assert snapshot(out) == before


def test_the_same_file_reached_again_is_no_other_file(tmp_path, small_moe):  # noqa: F811
    """One file as INPUT, then its folder (the same path), then the folder through a link
    (another path to the same file): its summary is kept, not redone and not refused."""
    docs = folder(tmp_path / "docs", **{"alpha.txt": INVOICE})
    out, opts = tmp_path / "o", ("--model", small_moe, "--max-tokens", "4")
    assert run(docs / "alpha.txt", "--out", out, *opts)[0] == 0
    (docs / "beta.txt").write_text(NOTE)
    code, words, _ = run(docs, "--out", out, *opts)
    assert code == 0 and "skipping 1 document already done" in words, words
    (tmp_path / "link").symlink_to(docs, target_is_directory=True)
    code, words, _ = run(tmp_path / "link", "--out", out, *opts)
    assert code == 0 and "skipping 2 documents already done" in words, words
    assert done_lines(out) == Counter({"alpha": 1, "beta": 1})
    assert [r["source"] for r in Journal(out).entries() if r.get("id") == "alpha"] == [str(docs.resolve() / "alpha.txt")]


def test_a_moved_folder_keeps_its_summaries_and_their_content_logic(tmp_path, small_moe):  # noqa: F811
    """The old path gone: the summaries are the moved documents'; unchanged ones are kept, a
    renamed one gets its content's summary copied, a changed one is redone as stale."""
    in_a = folder(tmp_path / "inA", **{"a.txt": INVOICE, "b.txt": NOTE, "c.txt": "The river flooded in spring."})
    out, opts = tmp_path / "o", ("--model", small_moe, "--max-tokens", "4")
    assert run(in_a, "--out", out, *opts)[0] == 0
    moved = tmp_path / "inC"
    in_a.rename(moved)
    (moved / "b.txt").rename(moved / "renamed.txt")
    (moved / "c.txt").write_text("The farmer planted seed after the flood.")
    code, words, _ = run(moved, "--out", out, *opts)
    assert code == 0, words
    assert "skipping 2 documents already done" in words and "1 document renamed or copied" in words, words
    assert "1 document changed since summarised (stale): redoing it" in words, words
    assert done_lines(out) == Counter({"a": 1, "b": 1, "renamed": 1, "c": 2})
    assert (out / "renamed.md").read_text() == (out / "b.md").read_text()
    records = Journal(out).records()
    assert records["c"]["source"] == str(moved.resolve() / "c.txt")  # the redo names the file it is of now
    assert records["renamed"]["source"] == str(moved.resolve() / "renamed.txt")


def test_a_journal_that_records_no_source_keeps_working(tmp_path, small_moe):  # noqa: F811
    """Records of an older version keep no source: unknown, never another file (the run
    behaves as it did then)."""
    in_a = folder(tmp_path / "inA", **{"report.txt": INVOICE})
    in_b = folder(tmp_path / "inB", **{"report.txt": NOTE})
    out, opts = tmp_path / "o", ("--model", small_moe, "--max-tokens", "4")
    assert run(in_a, "--out", out, *opts)[0] == 0
    lines = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    assert any("source" in r for r in lines)
    (out / "journal.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "source"}) + "\n"
                                               for r in lines))
    code, words, _ = run(in_b, "--out", out, *opts)
    assert code == 0 and "changed since summarised (stale)" in words, words


def test_other_files_from_plain_records(tmp_path):
    """Which outputs hold another file's summary, case by case, with no model."""
    tmp_path = tmp_path.resolve()  # paths as records keep them: links resolved
    a, b = folder(tmp_path / "a", **{"x.txt": "one"}) / "x.txt", folder(tmp_path / "b", **{"x.txt": "two"}) / "x.txt"
    out = folder(tmp_path / "out", **{"x.md": "a summary\n"})
    doc = FileDocument("x", str(b), b, name="x.txt")

    def found(rec, docs=(doc,)):
        return other_files(list(docs), {"x": {"id": "x", "status": "done", **rec}}, out)

    assert found({"source": str(a)}) == [(str(out / "x.md"), str(a), str(b))]
    assert found({"source": str(b)}) == []  # the same file
    assert found({}) == []  # an older record: unknown
    assert found({"source": str(tmp_path / "gone" / "x.txt")}) == []  # moved away
    assert found({"source": str(a), "status": "failed"}) == []  # no finished summary to lose
    # a JSONL line's file is its JSONL file: a file's summary, or another JSONL file's, is another file's
    jsonl = folder(tmp_path / "j", **{"in.jsonl": '{"id": "x", "text": "three"}\n'}) / "in.jsonl"
    line = Document("x", f"{jsonl}:1", "three", key=("id", "x"))
    assert found({"source": str(a)}, [line]) == [(str(out / "x.md"), str(a), f"{jsonl}:1")]
    assert found({"source": str(jsonl)}, [line]) == []  # the same JSONL file: judged by content
    assert found({"source": str(jsonl)}) == [(str(out / "x.md"), str(jsonl), str(b))]
    (tmp_path / "hard.txt").hardlink_to(b)
    assert found({"source": str(tmp_path / "hard.txt")}) == []  # the same file by another name
    # a review: a copy of the folder (the same bytes) was refused; its summary is current
    assert found({"source": str(a), "made_from": {"sha256": doc.stamp.sha256, "hashed": "bytes"}}) == []
    # a review: INPUT given as a link later pointed elsewhere is the same path, judged by content
    (tmp_path / "current").symlink_to(tmp_path / "b", target_is_directory=True)
    via = FileDocument("x", str(tmp_path / "current" / "x.txt"), tmp_path / "current" / "x.txt", name="x.txt")
    assert found({"source": str(tmp_path / "current" / "x.txt")}, [via]) == []
    (out / "x.md").unlink()
    assert found({"source": str(a)}) == []  # its output gone: nothing to lose


def test_several_outputs_of_other_files_are_one_line(tmp_path):
    tmp_path = tmp_path.resolve()  # paths as records keep them: links resolved
    a, b = folder(tmp_path / "a", **{"x.txt": "1", "y.txt": "2"}), folder(tmp_path / "b", **{"x.txt": "3", "y.txt": "4"})
    out = folder(tmp_path / "out", **{"x.md": "x\n", "y.md": "y\n"})
    docs = [FileDocument(n, str(b / f"{n}.txt"), b / f"{n}.txt", name=f"{n}.txt") for n in ("x", "y")]
    records = {n: {"id": n, "status": "done", "source": str(a / f"{n}.txt")} for n in ("x", "y")}
    with pytest.raises(InputError) as e:
        refuse_other_files(docs, records, out)
    assert str(e.value).startswith(f"{out / 'x.md'} holds the summary of {a / 'x.txt'}, not of this input's "
                                   f"{b / 'x.txt'}, which has the same output name (1 more document of this "
                                   "input likewise); nothing was run. Give this input another `out_dir`")
    refuse_other_files(docs[:1], {}, out)  # a first run into the folder: nothing to refuse


def test_a_jsonl_line_and_a_file_of_the_same_name_never_share_an_output(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A review: a JSONL line whose key equals a file's relative name took that file's
    summary (JSONL lines kept no source), and a file took a JSONL line's; two JSONL files
    with the same key likewise. A JSONL line's file is its JSONL file; the same file edited
    is judged by content (its changed line redone as stale)."""
    docs = folder(tmp_path / "docs", **{"report.txt": INVOICE})
    one = folder(tmp_path / "j1", **{"in.jsonl": json.dumps({"id": "report.txt", "text": NOTE}) + "\n"}) / "in.jsonl"
    two = folder(tmp_path / "j2", **{"in.jsonl": json.dumps({"id": "report.txt", "text": INVOICE + " Paid."}) + "\n"})
    opts = ("--model", small_moe, "--max-tokens", "4")
    out = tmp_path / "files"
    assert run(docs, "--out", out, *opts)[0] == 0
    before = snapshot(out)
    assert_refused(refused_run(monkeypatch, one, "--out", out, *opts), out / "report.md", docs / "report.txt",
                   f"{one}:1")
    assert snapshot(out) == before

    out = tmp_path / "lines"
    assert run(one, "--out", out, *opts)[0] == 0
    assert Journal(out).records()["report.txt"]["source"] == os.path.abspath(one)  # named by its key
    before = snapshot(out)
    assert_refused(refused_run(monkeypatch, docs, "--out", out, *opts), out / "report.txt.md", one,
                   docs / "report.txt")
    assert_refused(refused_run(monkeypatch, two / "in.jsonl", "--out", out, *opts), out / "report.txt.md", one,
                   f"{two / 'in.jsonl'}:1")
    assert snapshot(out) == before
    one.write_text(json.dumps({"id": "report.txt", "text": NOTE + " Updated."}) + "\n")  # the same file, edited
    code, words, _ = run(one, "--out", out, *opts)
    assert code == 0 and "changed since summarised (stale)" in words, words


def test_a_single_file_into_a_folders_job_keeps_its_names(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A user trial: rA (report.txt, report.md: outputs report.txt.md, report.md.md) then
    rB/report.txt alone into the same folder: the single file took the id of its stem
    (report.md, a new output) while its name, report.txt, was rA's; rA's next run then
    took that id for its report.txt and was refused, naming rB's file. A single file is
    named as a folder's file is: the id an earlier run recorded for its name (so here it
    is refused, like the folder rB), and never an id the job or the user holds."""
    in_a = folder(tmp_path / "rA", **{"report.txt": INVOICE, "report.md": "The library buys a book on fruit."})
    in_b = folder(tmp_path / "rB", **{"report.txt": NOTE})
    out, opts = tmp_path / "oR", ("--model", small_moe, "--max-tokens", "4")
    assert run(in_a, "--out", out, *opts)[0] == 0
    before = snapshot(out)
    assert_refused(refused_run(monkeypatch, in_b / "report.txt", "--out", out, *opts), out / "report.txt.md",
                   in_a / "report.txt", in_b / "report.txt")
    assert snapshot(out) == before
    code, words, _ = run(in_a, "--out", out, *opts)  # rA's job goes on as it was
    assert code == 0 and "skipping 2 documents already done" in words, words
    # the same file alone: its own output, not a second one
    (in_a / "report.txt").write_text(INVOICE + " Paid in April.")
    code, words, _ = run(in_a / "report.txt", "--out", out, *opts)
    assert code == 0 and "1 document changed since summarised" in words, words
    assert sorted(p.name for p in out.glob("*.md")) == ["report.md.md", "report.txt.md"]


def test_a_single_file_never_takes_the_users_own_output_name(tmp_path, small_moe):  # noqa: F811
    """A file of the user's in OUT_DIR named as a single file's output stays theirs."""
    doc = folder(tmp_path / "in", **{"notes.txt": NOTE}) / "notes.txt"
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.md").write_text("my own notes\n")
    code, words, _ = run(doc, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert code == 0, words
    assert (out / "notes.md").read_text() == "my own notes\n" and (out / "notes-2.md").exists()
