"""Documents seen unusable without the model (empty, blank, unreadable) fail as the run
starts: a job of nothing else never loads the model (a user trial: an empty file loaded the
model only to fail it, and the run predicted documents/hour for its size), and a mixed one
prices and sizes only the documents it can summarise."""

import json
import os

import pytest
from support.jobs import _short_context, folder, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.job.documents import SMALL_TEXT_BYTES, discover, fails_unread
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.journal import Journal

runner = CliRunner()


def run(*args):
    r = runner.invoke(app, ["run", *map(str, args)])
    return r.exit_code, " ".join(r.output.split())


def test_which_documents_fail_unread(tmp_path):
    src = folder(tmp_path / "in", **{"blank.md": " \n\t\n", "text.txt": "The river rose in spring.",
                                     "big.txt": " " * (SMALL_TEXT_BYTES + 1)})
    (src / "empty.txt").write_bytes(b"")
    (src / "zero.pdf").write_bytes(b"")  # no PDF has no bytes: not handed to the converter
    (src / "bin.txt").write_bytes(b"\x00\x01\x02\x03" * 50)
    (src / "bom.txt").write_bytes(b"\xef\xbb\xbf  \n")  # a byte-order mark and blanks
    (src / "tiny.pdf").write_bytes(b"%PDF")  # a converted kind with bytes: read at its turn
    docs = {d.id: d for d in discover(src)}
    seen = {i for i, d in docs.items() if fails_unread(d)}
    assert seen == {"blank", "empty", "zero", "bin", "bom"}
    assert docs["zero"].error == "empty document (0 bytes)" and docs["blank"].error == "empty document"
    assert "binary" in docs["bin"].error
    assert docs["big"].error == "empty document"  # larger: the same failure, at its turn
    assert "_converted" not in vars(docs["text"])  # a readable one is converted at its turn, not here
    gone = {d.id: d for d in discover(src)}["text"]
    os.unlink(src / "text.txt")  # gone since it was found: cannot be read
    assert fails_unread(gone) and gone.error.startswith("cannot")


def test_a_job_of_empty_documents_never_loads_the_model(tmp_path, small_moe, monkeypatch):  # noqa: F811
    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("mlx_tier.job.model_setup.load_model", no_load)
    src = folder(tmp_path / "in", **{"blank.md": "   \n\n"})
    (src / "empty.txt").write_bytes(b"")
    (src / "zero.pdf").write_bytes(b"")
    out = tmp_path / "out"
    code, output = run(src, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert code == 1, output
    assert "failed blank: empty document" in output and "failed zero: empty document (0 bytes)" in output
    assert "this run: 3 failed as read (empty or unreadable); no model loaded" in output
    assert "predicted" not in output and "documents/hour" not in output
    rep = json.loads((out / "report.json").read_text())
    assert rep["totals"]["failed"] == 3 and rep["runs"][-1]["loaded_model"] is False
    assert rep["runs"][-1]["failed"] == 3 and rep["runs"][-1]["generation_seconds"] == 0.0  # none: no model
    records = [r for r in Journal(out).entries() if "id" in r]
    assert {r["id"]: r["error"] for r in records} == {"blank": "empty document", "empty": "empty document",
                                                      "zero": "empty document (0 bytes)"}
    assert all(r["made_from"].get("sha256") for r in records)  # a rerun retries each once it changes
    s = read_status(out)
    assert s.no_model and s.failed == 3 and s.finished_this_run == 3
    status = runner.invoke(app, ["status", str(out)])
    words = " ".join(status.output.split())
    assert "3 failed as read (empty or unreadable); no model loaded" in words, words
    assert "none this run (no model loaded)" in words and "documents/hour" not in words
    # given text, a plain rerun summarises it (and loads the model)
    monkeypatch.undo()
    (src / "blank.md").write_text("The river rose in spring and the farmer planted seed.")
    code, output = run(src, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert code == 1 and (out / "blank.md").exists(), output  # the two empty files still fail
    assert not read_status(out).no_model


def test_a_mixed_job_fails_the_empty_ones_first_and_sizes_the_rest(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """Only the document it can summarise is sized for the schedule's prediction and counted
    in the progress; the blank one's failure is journalled before any summary."""
    sized = []
    import mlx_tier.job.run as run_module

    real_sizes = run_module._sizes
    monkeypatch.setattr(run_module, "_sizes", lambda pending: sized.append([d.id for d in pending])
                        or real_sizes(pending))
    src = folder(tmp_path / "in", **{"a.txt": "The river rose in spring and the farmer planted seed.",
                                     "b.md": "\n \n"})
    out = tmp_path / "out"
    code, output = run(src, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert code == 1 and (out / "a.md").exists() and "failed b: empty document" in output, output
    assert sized and all(ids == ["a"] for ids in sized)
    order = [r["id"] for r in Journal(out).entries() if r.get("status") in ("done", "failed")]
    assert order == ["b", "a"]


@pytest.mark.parametrize("text", ["", "  \n"])
def test_a_jsonl_line_without_text_fails_first(tmp_path, small_moe, monkeypatch, text):  # noqa: F811
    monkeypatch.setattr("mlx_tier.job.model_setup.load_model", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("the model was loaded")))
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"id": "x", "text": text}) + "\n")
    code, output = run(src, "--out", tmp_path / "out", "--model", small_moe, "--max-tokens", "5")
    assert code == 1 and "failed x: empty text" in output, output


def test_a_jsonl_line_that_failed_empty_is_retried_once_its_text_is_given(tmp_path, small_moe):  # noqa: F811
    """A review: a JSONL line that failed as empty stayed "failed: empty text" on every plain rerun
    after its text was given (a file fixed the same way was retried): its failure recorded no hash.
    A line left as it was (blank again, or blank otherwise: a case of our own) stays failed."""
    text = "The river rose in spring and the farmers planted late; the bees came with the fruit flowers."
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    lines = lambda b: "".join(json.dumps(x) + "\n" for x in ({"id": "a", "text": text}, {"id": "b", "text": b}))  # noqa: E731
    src.write_text(lines("   "))
    args = (src, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert run(*args)[0] == 1
    code, output = run(*args)  # unchanged: stays failed, not retried
    assert code == 1 and "skipping" in output and read_status(out).failed == 1, output
    src.write_text(lines(" \t "))  # blank otherwise: retried, fails again as empty
    code, output = run(*args)
    assert code == 1 and "failed b: empty text" in output, output
    src.write_text(lines(text + " Bees."))
    code, output = run(*args)
    s = read_status(out)
    assert code == 0 and (s.done, s.failed) == (2, 0), output
    assert (out / "b.md").read_text().strip()


def test_a_jsonl_text_that_is_not_unicode_fails_alone_and_an_id_that_is_not_is_refused(tmp_path, small_moe):  # noqa: F811
    """A user trial: a JSONL line whose text held a lone surrogate (JSON's "\\ud800" escape, no
    UTF-8 encodes it) ended the run in a traceback, before anything was written. That document
    now fails alone as the run starts; an id holding one (it names the summary's file) is
    refused with one line."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    src.write_text('{"id": "s1", "text": "Owls \\ud800 hoot."}\n'
                   '{"id": "s2", "text": "Owls hoot at night in the old barn near the river."}\n')
    code, output = run(src, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert code == 1 and "failed s1: text not valid Unicode: a lone surrogate ('\\ud800') at character 6" in output, \
        output
    assert (out / "s2.md").exists() and read_status(out).failed == 1
    for line, said in [('{"id": "a\\udc80", "text": "abc"}', '"id" is not valid Unicode'),
                       ('{"custom_id": "\\ud83d", "text": "abc"}', '"custom_id" is not valid Unicode')]:
        src.write_text(line + "\n")
        r = runner.invoke(app, ["run", str(src), "--out", str(tmp_path / "o2"), "--model", str(small_moe)])
        errors = [x for x in r.output.splitlines() if x.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1 and said in errors[0], r.output
