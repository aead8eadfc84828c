"""End to end: `mlx-tier run` on the documents people have gives one summary per
real document (converted or decoded, AppleDouble and lock files skipped), distinct outputs
for distinct documents with their original ids recorded, and the same output names on resume.
Uses the tiny MoE of test_crash (byte-level tokenizer: any text tokenises).
"""

import codecs
import json

from support import docmaker
from support.jobs import _short_context, done_lines, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app

runner = CliRunner()


def test_folder_of_mixed_documents(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    docmaker.pdf(docs / "report.pdf", ["The river flooded in spring.", "Farmers planted seed."])
    docmaker.docx(docs / "minutes.docx", ["# Minutes", "The bee visits the flower for pollen."])
    (docs / "page.html").write_text("<html><body><h1>Library</h1><p>A book on fruit.</p></body></html>")
    (docs / "wide.txt").write_bytes(codecs.BOM_UTF16_LE + "The seed grows into a plant.".encode("utf-16-le"))
    (docs / "windows.txt").write_bytes("Café notes: the flower’s pollen — 5 €.".encode("cp1252"))
    (docs / "plain.md").write_text("A river, a book, a farmer.")
    (docs / "._plain.md").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(40))
    (docs / "~$minutes.docx").write_bytes(b"lock")
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    ids = ["minutes", "page", "plain", "report", "wide", "windows"]
    assert sorted(p.stem for p in out.glob("*.md")) == ids  # one summary per real document, no plain-2
    report = json.loads((out / "report.json").read_text())
    got = {d["id"]: (d["status"], d["name"], d["converter"].split(" ")[0]) for d in report["documents"]}
    assert got == {
        "minutes": ("done", "minutes.docx", "markitdown"), "page": ("done", "page.html", "markitdown"),
        "plain": ("done", "plain.md", "text"), "report": ("done", "report.pdf", "markitdown"),
        "wide": ("done", "wide.txt", "text"), "windows": ("done", "windows.txt", "text"),
    }
    converters = {d["id"]: d["converter"] for d in report["documents"]}
    assert converters["wide"] == "text (utf-16-le, BOM)" and converters["windows"] == "text (cp1252)"
    assert converters["report"].endswith(" PdfConverter") and converters["minutes"].endswith(" DocxConverter")


def test_jsonl_ids_distinct_and_original_ids_recorded(tmp_path, small_moe):  # noqa: F811
    f, out = tmp_path / "in.jsonl", tmp_path / "out"
    rows = ['{"custom_id": "会议纪要", "text": "river flood"}', '{"custom_id": "季度报告", "text": "seed plant"}',
            '{"custom_id": 1e400, "text": "bee pollen"}', '{"custom_id": "a/b", "text": "book"}',
            '{"custom_id": "a\\\\b", "text": "fruit"}', '{"custom_id": "", "text": "flower"}']
    f.write_text("\n".join(rows) + "\n")
    args = ["run", str(f), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8", "--format", "jsonl"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    lines = (out / "summaries.jsonl").read_text().splitlines()
    assert all("Infinity" not in x for x in lines)
    by_key = {json.loads(x)["custom_id"]: json.loads(x)["output"] for x in lines}
    assert by_key == {"会议纪要": "会议纪要.md", "季度报告": "季度报告.md", "1e400": "1e400.md", "a/b": "a__b.md",
                      "a\\b": "a__b-2.md", "": "doc.md"}
    names = {d["id"]: d["name"] for d in json.loads((out / "report.json").read_text())["documents"]}
    assert names["a__b-2"] == "a\\b" and names["doc"] == ""
    journal = {r["id"]: r["name"] for r in map(json.loads, (out / "journal.jsonl").read_text().splitlines()) if "id" in r}
    assert journal == names


def test_resume_keeps_each_documents_output_name(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "a b.txt").write_text("river flood")
    args = ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"]
    assert runner.invoke(app, args).exit_code == 0
    first = (out / "a_b.md").stat().st_mtime_ns
    # The newcomer a_b.txt makes the stems collide: named afresh, "a b.txt" would become a_b.txt-2
    # and be summarised again; the journal keeps it at a_b.
    (docs / "a_b").mkdir()
    (docs / "a_b" / "x.txt").write_text("unrelated")
    (docs / "a_b.txt").write_text("seed plant")
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (out / "a_b.md").stat().st_mtime_ns == first  # not regenerated, not overwritten
    names = {d["name"]: (d["id"], d["status"], d["earlier_run"])
             for d in json.loads((out / "report.json").read_text())["documents"]}
    assert names == {"a b.txt": ("a_b", "done", True), "a_b.txt": ("a_b.txt", "done", False),
                     "a_b/x.txt": ("a_b__x", "done", False)}
    assert done_lines(out) == {"a_b": 1, "a_b.txt": 1, "a_b__x": 1}


def test_file_name_that_is_not_utf8_is_summarised_and_resumes(tmp_path, small_moe):  # noqa: F811
    """A name with a raw Latin-1 byte (not UTF-8) must not crash the journal, on the run or the rerun."""
    import os

    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    bad = os.fsdecode(b"caf\xe9.txt")
    (docs / bad).write_text("The river flooded in spring.")
    (docs / "plain.txt").write_text("A book on fruit.")
    args = ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (out / "caf.md").is_file() and (out / "plain.md").is_file()  # the raw byte is not kept in the id
    (out / "journal.jsonl").read_bytes().decode("ascii")  # every journal line is plain JSON text
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "2 documents already done" in r.output, r.output
    # The same file listed on stdin (raw bytes) also runs.
    r = runner.invoke(app, ["run", "-", "--out", str(tmp_path / "out2"), "--model", str(small_moe), "--max-tokens", "8"],
                      input=bytes(docs) + b"/caf\xe9.txt\n")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out2" / "inputs.txt").read_bytes() == bytes(docs) + b"/caf\xe9.txt\n"


def test_a_users_own_file_in_the_output_folder_is_never_taken_as_a_summary(tmp_path, small_moe):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    out.mkdir()
    (docs / "notes.txt").write_text("The bee visits the flower for pollen.")
    (out / "notes.md").write_text("my own notes, not a summary\n")
    (out / "draft.md").mkdir()  # not even a file
    (docs / "draft.txt").write_text("A river, a book, a farmer.")
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    assert r.exit_code == 0, r.output
    assert (out / "notes.md").read_text() == "my own notes, not a summary\n"  # untouched
    report = json.loads((out / "report.json").read_text())
    got = {d["name"]: (d["id"], d["status"], d.get("earlier_run", False)) for d in report["documents"]}
    assert got == {"notes.txt": ("notes-2", "done", False), "draft.txt": ("draft-2", "done", False)}
    assert (out / "notes-2.md").is_file() and (out / "draft-2.md").is_file()
    # a user trial: the outputs were named otherwise without a word
    said = " ".join(r.output.split())
    assert "2 summaries named otherwise (draft-2.md, notes-2.md): the output folder holds files of their names" in said \
        or "2 summaries named otherwise (notes-2.md, draft-2.md): the output folder holds files of their names" in said, said
    again = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    assert again.exit_code == 0 and "summaries named otherwise" not in again.output, again.output  # said once
    (docs / "new.txt").write_text("Seed and fruit.")
    (out / "new.md").write_text("mine\n")
    again = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    said = " ".join(again.output.split())
    assert "1 summary named otherwise (new-2.md): the output folder holds a file of its name" in said, said
    # a review: a document whose own name ends in -2 was said to be named otherwise
    (docs / "memo-2.txt").write_text("The farmer reads a book.")
    (out / "memo.md").write_text("mine too\n")
    again = runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"])
    assert again.exit_code == 0 and "named otherwise" not in " ".join(again.output.split()).replace(
        "is named otherwise. in tok", ""), again.output
    assert (out / "memo-2.md").is_file()


def test_listed_files_of_the_same_name_in_other_folders_get_their_own_outputs(tmp_path, small_moe):  # noqa: F811
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    a.mkdir()
    b.mkdir()
    (a / "x.txt").write_text("The river flooded in spring.")
    (b / "x.txt").write_text("Farmers planted seed.")
    base = ["run", "-", "--out", str(out), "--model", str(small_moe), "--max-tokens", "8"]
    r = runner.invoke(app, base, input=f"{a / 'x.txt'}\n")
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, base, input=f"{b / 'x.txt'}\n")
    assert r.exit_code == 0, r.output
    report = json.loads((out / "report.json").read_text())
    got = {d["name"]: (d["id"], d["status"], d.get("earlier_run", False)) for d in report["documents"]}
    assert got == {str(b / "x.txt"): ("x-2", "done", False)}  # summarised, not taken for a/x.txt's output
    assert (out / "x.md").is_file() and (out / "x-2.md").is_file()
