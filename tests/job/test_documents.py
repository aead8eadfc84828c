"""Job input: every readable document is found once; bad ones fail alone, bad inputs fail whole."""

import json
import os
from pathlib import Path

import pytest

from mlx_tier.errors import InputError
from mlx_tier.job.documents import discover, discover_list, link_hint, skip_note
from mlx_tier.job.naming import safe_id


def test_folder_recursive_with_bad_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "a.md").write_text("alpha markdown")
    (tmp_path / "sub" / "b c.md").write_text("beta")
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF")
    (tmp_path / "ignored.csv").write_text("a,b")
    docs = {d.id: d for d in discover(tmp_path)}
    assert set(docs) == {"a.md", "a.txt", "sub__b_c", "bin", "latin1", "empty", "broken"}
    assert docs["sub__b_c"].text == "beta" and docs["sub__b_c"].error is None
    assert docs["sub__b_c"].name == "sub/b c.md" and docs["sub__b_c"].converter == "text (utf-8)"
    assert "binary" in docs["bin"].error
    assert docs["latin1"].text == "café" and docs["latin1"].converter == "text (cp1252)"
    assert docs["empty"].error == "empty document"
    assert docs["broken"].error.startswith("cannot convert")


def test_jsonl_gives_one_document_per_line_and_flags_empty_text(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "x/1", "text": "one"}) + "\n\n" + json.dumps({"id": 2, "text": ""}) + "\n")
    docs = discover(f)
    assert [(d.id, d.text, d.error) for d in docs] == [("x__1", "one", None), ("2", None, "empty text")]  # a line, not a file


def test_jsonl_custom_id_kept_as_given(tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in [
        {"custom_id": "req/1", "text": "one"},
        {"custom_id": 7, "id": "ignored", "text": "two"},
        {"id": "plain", "text": "three"},
    ]))
    docs = discover(f)
    assert [(d.id, d.key) for d in docs] == [("req__1", ("custom_id", "req/1")), ("7", ("custom_id", "7")),
                                             ("plain", ("id", "plain"))]


def test_path_list(tmp_path, monkeypatch):
    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x" / "one.txt").write_text("one")
    (tmp_path / "a" / "one.txt").write_text("top")
    (tmp_path / "b" / "two.pdf").write_bytes(b"%PDF\x00")  # listed explicitly: taken, fails alone
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "one.md").write_text("an earlier summary")
    (tmp_path / "out" / "journal.jsonl").write_text('{"id": "one", "status": "done"}\n')  # the job's folder
    (tmp_path / ".hidden.txt").write_text("a dot-file")
    (tmp_path / "alias.txt").symlink_to(tmp_path / "a" / "one.txt")
    monkeypatch.chdir(tmp_path)
    lines = ["a/x/one.txt", "", str(tmp_path / "a" / "one.txt"), "b/two.pdf", "out/one.md"]
    docs = discover_list(lines, exclude=tmp_path / "out")
    assert [d.id for d in docs] == ["a__x__one", "a__one", "b__two"]  # relative to the common folder
    assert docs[0].text == "one" and docs[0].source == str(tmp_path / "a" / "x" / "one.txt")
    assert docs[2].error == "cannot convert (FileConversionException): PdfConverter threw PDFSyntaxError with " \
                            "message: No /Root object! - Is this really a PDF?"
    for bad, message in [
        (["a/one.txt", "missing.txt"], "stdin:2: missing.txt: no such file"),
        (["a"], "stdin:1: a is a folder"),
        (["a/one.txt", "./a/one.txt"], "stdin:2: ./a/one.txt is listed twice (first on line 1)"),
        # a user trial: a link to a listed file was "listed twice" with no word of the link
        (["a/one.txt", "alias.txt"], "stdin:2: alias.txt is the same file as a/one.txt on line 1 (a link or "
                                     "another path to it: listed twice)"),
        (["", " "], "stdin: no file paths given"),
        # a user trial: a list naming only a dot-file said "no file paths given"; it names why now
        ([".hidden.txt"], "stdin: no documents: skipped 1 file: hidden file 1"),
    ]:
        with pytest.raises(InputError) as e:
            discover_list(bad)
        assert str(e.value).startswith(message), e.value


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "in.jsonl:2: malformed JSON at column 21 (Expecting value)"),
        # a user trial: "malformed JSON (Unterminated string starting at)", the place lost
        ('{"id": "a", "text": "ok}\n', "in.jsonl:1: malformed JSON at column 21 (Unterminated string starting)"),
        ('{"id": "a", "text": "ok"}\n["no"]\n', 'in.jsonl:2: each line needs an object with "custom_id" (or "id") and "text"'),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "in.jsonl:2: duplicate id 'a' (first on line 1)"),
        ('{"custom_id": "r/1", "text": "x"}\n{"custom_id": "r/1", "text": "y"}\n', "in.jsonl:2: duplicate custom_id 'r/1' (first on line 1)"),
        ('{"custom_id": 7, "text": "x"}\n{"custom_id": "7", "text": "y"}\n', "in.jsonl:2: duplicate custom_id '7' (first on line 1)"),
        ('{"custom_id": "a", "body": {"messages": [{"role": "system", "content": "x"}]}}\n', 'in.jsonl:1: the request has no "method"'),
        ('{"custom_id": ["a"], "text": "x"}\n', 'in.jsonl:1: "custom_id" must be a string or a number'),
        ("", "no documents"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, content, message):
    f = tmp_path / "in.jsonl"
    f.write_text(content)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        discover(f)


def test_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        discover(tmp_path / "missing")
    with pytest.raises(InputError, match=r"no documents found: the folder is empty; mlx-tier run --help lists"):
        discover(tmp_path)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="expected a folder"):
        discover(tmp_path / "x.csv")


def test_no_documents_says_what_was_skipped(tmp_path):
    """An input folder with files but no document names what it skipped, most frequent first, in one line."""
    for i in range(3):
        (tmp_path / f"t{i}.csv").write_text("a,b")
    (tmp_path / "run.exe").write_bytes(b"MZ")
    (tmp_path / "NOTES").write_text("no suffix")
    (tmp_path / ".hidden.txt").write_text("x")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.txt").write_text("never walked")
    (tmp_path / "a.bak").write_text("x")
    with pytest.raises(InputError) as e:
        discover(tmp_path)
    assert str(e.value) == (f"{tmp_path}: no documents found: skipped 7 files, 1 folder: .csv 3, .exe 1, "
                            "hidden file 1, other 3; mlx-tier run --help lists the kinds it reads")
    only_output = tmp_path / "only-output"
    (only_output / "out").mkdir(parents=True)
    (only_output / "out" / "summary.md").write_text("an earlier run's output")
    (only_output / "__MACOSX").mkdir()
    with pytest.raises(InputError, match="skipped 2 folders: metadata folder 1, output folder 1;"):
        discover(only_output, exclude=only_output / "out")
    # my own: an INPUT whose documents are all behind a link to another folder says what reads them
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "papers").symlink_to(only_output / "out", target_is_directory=True)
    with pytest.raises(InputError) as e:
        discover(linked)
    assert str(e.value) == (f"{linked}: no documents found: skipped 1 folder: link to a folder out of INPUT 1; "
                            "links out of INPUT are not read: --follow-links reads them, and mlx-tier run --help "
                            "lists the kinds it reads")
    assert [d.name for d in discover(linked, follow_links=True)] == ["papers/summary.md"]


def test_safe_id():
    assert safe_id("a/b c?.txt") == "a__b_c_.txt"
    assert safe_id("../..") == "doc"
    assert safe_id("会议纪要") == "会议纪要" and safe_id("Café") == "Café"


def test_long_ids_are_cut_with_a_hash_and_stay_unique():
    from mlx_tier.job.naming import MAX_ID_BYTES, safe_id

    a, b = safe_id("x" * 300), safe_id("x" * 299 + "y")
    assert len(a) == len(b) == MAX_ID_BYTES and a != b
    assert safe_id("short name.txt") == "short_name.txt"


# --- Documents people have; ids and output names -----------------------------------

import codecs

from support import docmaker

from mlx_tier.job.doc_text import decode_text
from mlx_tier.job.naming import assign, fold


@pytest.mark.parametrize("data, text, converter", [
    (codecs.BOM_UTF16_LE + "Hello wörld, 会议.\n".encode("utf-16-le"), "Hello wörld, 会议.\n", "text (utf-16-le, BOM)"),
    (codecs.BOM_UTF16_BE + "Big end.".encode("utf-16-be"), "Big end.", "text (utf-16-be, BOM)"),
    (codecs.BOM_UTF8 + "Résumé".encode(), "Résumé", "text (utf-8, BOM)"),  # the BOM is not text
    ("Café crème — “quoted”, 50 €.".encode("cp1252"), "Café crème — “quoted”, 50 €.", "text (cp1252)"),
    ("Grüße aus Köln".encode("latin-1"), "Grüße aus Köln", "text (cp1252)"),
    ("Это простой текст на русском языке для проверки.".encode("cp1251"),
     "Это простой текст на русском языке для проверки.", "text (cp1251)"),
    ("これは日本語のテキストです。文字コードの確認。".encode("shift_jis"), "これは日本語のテキストです。文字コードの確認。", "text (cp932)"),
])
def test_text_in_any_common_encoding(data, text, converter):
    got = decode_text(data)
    assert (got.text, got.error, got.converter) == (text, None, converter)


@pytest.mark.parametrize("data, text, strays", [
    # a user trial: one stray byte in UTF-8 text had the whole file read as hp_roman8, cp1257, cp1250 or
    # iso8859_10, every accented letter garbled into the summary ("Le café fermûˋ est")
    (("Le café est fermé. " * 3).encode() + b"Prix: 5\x80.", "Le café est fermé. " * 3 + "Prix: 5€.", 1),
    ("Naïve café résumé, São Paulo. ".encode() + b"He said \x93hello\x94.",
     "Naïve café résumé, São Paulo. He said “hello”.", 2),
    ("Straße München Größe. ".encode() + b"a \x96 b", "Straße München Größe. a – b", 1),
    ("Résumé ".encode() + "été".encode("latin-1"), "Résumé été", 2),
    ("UTF8 part: café. ".encode() + "latin part: café".encode("latin-1"), "UTF8 part: café. latin part: café", 1),
    # my own: a Windows right quote in an otherwise UTF-8 CJK text
    ("会议纪要：预算通过。".encode() + b"It\x92s done.", "会议纪要：预算通过。It’s done.", 1),
])
def test_utf8_text_with_a_few_stray_bytes_is_read_as_utf8(data, text, strays):
    got = decode_text(data)
    assert (got.text, got.error) == (text, None)
    assert got.converter == f"text (utf-8, {strays} byte{'' if strays == 1 else 's'} not UTF-8 read as cp1252)"


@pytest.mark.parametrize("text", ["He wrote “Fuß” in the “CAFÉ” sign.", "Ça coûte 5 €, « très » cher."])
def test_a_cp1252_file_whose_letter_and_quote_look_like_one_utf8_character_stays_cp1252(text):
    """A review: `É”` (C9 94) and `ß”` (DF 94) are valid 2-byte UTF-8, so one such pair beside
    one stray byte had a cp1252 file read as UTF-8 ("CAFɔ"). Such pairs are no evidence of
    UTF-8; the file goes to detection, as before."""
    got = decode_text(text.encode("cp1252"))
    assert (got.text, got.converter) == (text, "text (cp1252)")


@pytest.mark.parametrize("text", [
    "Invoice total: €120 for the café renovation, paid on Monday.\n",  # a user trial: read as cp775, "Ć120 ... cafķ"
    "Ticket €5 – café entry\n",
    "“fancy” €5 café\n",
    "coffee €3, café au lait €4, crème brûlée €6, pâté €7\n",
    "Grüße aus Köln, 20 € bitte – danke. Ärger über Öl: Straße gesperrt.\n",  # my own
])
def test_western_text_with_a_euro_sign_is_read_as_cp1252(text):
    got = decode_text(text.encode("cp1252"))
    assert (got.text, got.converter) == (text, "text (cp1252)")


@pytest.mark.parametrize("text, encoding", [
    ("Zażółć gęślą jaźń, powiedział pan Kowalski. Więcej informacji jutro.", "cp1250"),
    ("Příliš žluťoučký kůň úpěl ďábelské ódy. Zítra budeme v Praze.", "cp1250"),
    ("Привет, как дела? Всё хорошо, спасибо.", "cp1251"),
    ("Καλημέρα κόσμε, τι κάνεις σήμερα;", "cp1253"),
    # a review: a few Russian words in an English text (each a run of accented letters read as cp1252)
    ("The quarterly meeting reviewed the budget and the hiring plan. Our partners call the project "
     "«Северный поток» and the report «Годовой отчёт». Everyone agreed to revisit the numbers.", "cp1251"),
    ("The meeting reviewed the budget and the plan for the year. Итоги: продажи выросли, прибыль тоже. "
     "Everyone agreed to revisit the numbers in two weeks and to share the draft.", "cp1251"),
])
def test_other_8_bit_texts_are_not_taken_for_cp1252(text, encoding):
    """Cyrillic or Greek read as cp1252 is all accented letters; Polish has signs between letters."""
    got = decode_text(text.encode(encoding))
    assert got.text == text and got.converter != "text (cp1252)"


def test_the_encoding_named_by_its_python_codec_name():
    assert decode_text(b"abc\x00def").converter == "text (utf-8)"  # was "utf_8" beside "utf-8"


@pytest.mark.parametrize("data", [b"\x00\x01\x02\x03" * 50, bytes(range(256)) * 4, b"\x7fELF\x02\x01\x01" + bytes(200)])
def test_only_really_binary_files_fail(data):
    got = decode_text(data)
    assert got.text is None and got.error.startswith("binary file, not text (")


@pytest.mark.parametrize("data", [
    b"\x00\x01\x02\xff\xfe\x00binary",  # a user trial: "summarised" as text (utf-16-le)
    bytes(range(256)) + b"\x00\x00" * 3 + bytes(range(255, -1, -1)),
    b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x01\x00" + bytes(range(1, 255, 3)) * 4,
])
def test_binary_bytes_that_fit_utf16_without_a_byte_order_mark_fail(data):
    got = decode_text(data)
    assert got.text is None and got.error.startswith("binary file, not text ("), got


@pytest.mark.parametrize("text, codec", [
    ("Hello world, this is text.\nSecond line.", "utf-16-le"),
    # a review: short texts with no space, JSON, CJK with full-width punctuation only
    ("Introduction", "utf-16-le"), ('{"a":1,"b":[1,2,3],"c":"xyz"}', "utf-16-be"),
    ("すごい！本当に？ありがとう！" * 3, "utf-16-le"), ("你好,世界.今天很好!", "utf-32-le"),
    ("日本語のテキストです。これは二行目です。\n三行目。", "utf-16-le"),
    ("Привет мир. Это текст на русском языке.", "utf-16-be"),
])
def test_utf16_text_without_a_byte_order_mark_is_read(text, codec):
    got = decode_text(text.encode(codec))
    assert got.text == text and got.converter == f"text ({codec})", got


def test_converted_formats(tmp_path):
    files = [
        docmaker.pdf(tmp_path / "r.pdf", ["Quarterly report", "Revenue grew 4.81 percent."]),
        docmaker.docx(tmp_path / "m.docx", ["# Minutes", "The board met on Monday."]),
        docmaker.pptx(tmp_path / "s.pptx", [("Plan", "Ship in May")]),
        docmaker.xlsx(tmp_path / "t.xlsx", [["city", "population"], ["Oslo", 700000]]),
        docmaker.epub(tmp_path / "b.epub", "Book", ["Chapter one.", "Chapter two."]),
    ]
    (tmp_path / "n.html").write_text("<html><head><script>var x;</script></head><body><h1>News</h1>"
                                      "<p>Rain in <b>Paris</b>.</p></body></html>")
    (tmp_path / "j.ipynb").write_text(json.dumps({
        "cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Analysis\n", "Sales rose."]},
                  {"cell_type": "code", "metadata": {}, "source": ["print(1)"], "outputs": [], "execution_count": 1}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    docs = {d.id: d for d in discover(tmp_path)}
    assert {i: d.error for i, d in docs.items()} == dict.fromkeys(["r", "m", "s", "t", "b", "n", "j"])
    assert "# Analysis\nSales rose." in docs["j"].text and "print(1)" in docs["j"].text
    assert docs["r"].text.split() == ["Quarterly", "report", "Revenue", "grew", "4.81", "percent."]
    assert docs["m"].text == "# Minutes\n\nThe board met on Monday."
    assert "# Plan\nShip in May" in docs["s"].text
    assert "| Oslo | 700000 |" in docs["t"].text
    assert docs["b"].text.endswith("Chapter one.\n\nChapter two.")
    assert docs["n"].text == "# News\n\nRain in **Paris**."  # no script text
    assert docs["r"].converter.startswith("markitdown ") and docs["r"].converter.endswith(" PdfConverter")
    assert docs["n"].converter.endswith(" HtmlConverter")
    assert len(files) == 5


@pytest.mark.parametrize("kind", ["docx", "xlsx"])
def test_a_password_protected_office_file_says_so(tmp_path, kind):
    """Saved with a password, a .docx/.xlsx is an encrypted OLE package, not a zip:
    the reason says password-protected, not "File is not a zip file"."""
    import io

    from msoffcrypto.format.ooxml import OOXMLFile

    plain = (docmaker.docx(tmp_path / "p.docx", ["Secret minutes."]) if kind == "docx"
             else docmaker.xlsx(tmp_path / "p.xlsx", [["a"], [1]]))
    sealed = io.BytesIO()
    OOXMLFile(io.BytesIO(plain.read_bytes())).encrypt("s3cret", sealed)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / f"locked.{kind}").write_bytes(sealed.getvalue())
    (doc,) = discover(folder)
    assert doc.error is not None and doc.error.startswith("password-protected"), doc.error


@pytest.mark.parametrize("where", ["not installed", "fails to import"])
def test_missing_converters_name_the_extra(tmp_path, monkeypatch, where):
    import mlx_tier.job.doc_text as conv
    from mlx_tier.job.convert_limits import ConversionLimits

    def missing(kind):
        raise ImportError("No module named 'markitdown'")

    if where == "not installed":  # found missing here, before any converter process starts
        monkeypatch.setattr(conv, "_converters_installed", lambda: False)
    else:  # found missing by the conversion itself (in this process, so that the fake applies)
        monkeypatch.setattr(conv, "_markitdown", missing)
    docmaker.docx(tmp_path / "m.docx", ["Text."])
    (tmp_path / "plain.txt").write_text("still read")
    docs = {d.id: d for d in discover(tmp_path, limits=ConversionLimits(isolate=where == "not installed"))}
    assert docs["m"].error == ".docx files need the document converters: pip install 'mlx-tier[documents]'"
    assert docs["plain"].text == "still read"


def test_non_documents_are_skipped_and_appledouble_steals_no_id(tmp_path):
    (tmp_path / "report.txt").write_text("the real report")
    (tmp_path / "._report.txt").write_bytes(b"\x00\x05\x16\x07" + bytes(60))  # AppleDouble
    for name in [".DS_Store", ".hidden.md", ".#notes.txt", "~$minutes.docx", "notes.txt~", "#notes.txt#",
                 ".notes.txt.swp", "draft.txt.bak"]:
        (tmp_path / name).write_bytes(b"junk")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "README.md").write_text("not mine")
    (tmp_path / "__MACOSX").mkdir()
    (tmp_path / "__MACOSX" / "report.txt").write_text("zip metadata")
    docs = discover(tmp_path)
    assert [(d.id, d.text) for d in docs] == [("report", "the real report")]


def test_links_out_of_input_are_not_followed_unless_asked(tmp_path):
    from collections import Counter

    inp, outside = tmp_path / "in", tmp_path / "secret"
    inp.mkdir()
    outside.mkdir()
    (outside / "passwd.txt").write_text("root:x:0:0")
    (outside / "more").mkdir()
    (outside / "more" / "deep.txt").write_text("deep secret")
    (inp / "own.txt").write_text("mine")
    (inp / "hid").mkdir()
    (inp / "hid" / ".own.txt").write_text("hidden")
    (inp / "alias.txt").symlink_to(inp / "hid" / ".own.txt")  # inside INPUT, the only way to a dot-file: read
    (inp / "passwd.txt").symlink_to(outside / "passwd.txt")
    (inp / "dir").symlink_to(outside / "more", target_is_directory=True)
    skipped = Counter()
    assert sorted(d.name for d in discover(inp, skipped=skipped)) == ["alias.txt", "own.txt"]
    # a user trial: the folder link was passed by without a word; both are said, and what reads them
    assert (skipped["link out of INPUT"], skipped["link to a folder out of INPUT"]) == (1, 1)
    assert skip_note(skipped).startswith("skipped 2 files, 1 folder:") and link_hint(skipped)  # and .own.txt
    followed = {d.name: d.text for d in discover(inp, follow_links=True)}
    assert followed == {"alias.txt": "hidden", "own.txt": "mine", "passwd.txt": "root:x:0:0",
                        "dir/deep.txt": "deep secret"}


def test_a_file_or_folder_inside_input_is_one_document_whatever_links_lead_to_it(tmp_path):
    """A user trial: `link.txt -> a.txt` inside INPUT was summarised twice (a.md and link.md);
    with --follow-links, `sublink -> sub` named sub/s.txt `sublink__s` (whichever the
    directory listing gave first). Each file is read once, by its own path; the links are
    counted as skipped."""
    from collections import Counter

    inp = tmp_path / "docs"
    (inp / "sub").mkdir(parents=True)
    (inp / "a.txt").write_text("lions")
    (inp / "sub" / "s.txt").write_text("zebras")
    (inp / "link.txt").symlink_to("a.txt")
    (inp / "sublink").symlink_to("sub", target_is_directory=True)
    (inp / "b.txt").symlink_to("sub/s.txt")  # my own: a link sorting before its file's folder
    for follow in (False, True):
        skipped = Counter()
        assert sorted(d.name for d in discover(inp, follow_links=follow, skipped=skipped)) == ["a.txt", "sub/s.txt"]
        assert skipped["link to a document read by its own path"] == 2
        assert skipped["link to a folder in INPUT"] == 1  # not followed, or followed to a folder walked already
    # a review: a link to a hidden folder inside INPUT is the only way to its files: followed, it is read
    (inp / ".archive" / "2024").mkdir(parents=True)
    (inp / ".archive" / "2024" / "minutes.md").write_text("minutes")
    (inp / "current").symlink_to(".archive/2024", target_is_directory=True)
    assert "current/minutes.md" in {d.name for d in discover(inp, follow_links=True)}
    skipped = Counter()
    assert "current/minutes.md" not in {d.name for d in discover(inp, skipped=skipped)}
    # a review: not followed, it was said as a link to a folder read by its own path (it is not read)
    assert skipped["link to a skipped folder in INPUT"] == 1 and skipped["link to a folder in INPUT"] == 1
    assert "--follow-links" in link_hint(skipped)
    assert skip_note(skipped).startswith("skipped 2 files, 3 folders:")  # the link counted as a folder
    # my own: the same link to a folder the walk skips for another reason (a metadata folder)
    (inp / "__MACOSX" / "x").mkdir(parents=True)
    (inp / "__MACOSX" / "x" / "n.txt").write_text("note")
    (inp / "current").unlink()
    (inp / "current").symlink_to("__MACOSX/x", target_is_directory=True)
    skipped = Counter()
    discover(inp, skipped=skipped)
    assert skipped["link to a skipped folder in INPUT"] == 1 and link_hint(skipped)


def test_jsonl_bom_and_line_separators(tmp_path):
    f = tmp_path / "batch.jsonl"
    lines = [
        json.dumps({"custom_id": "a", "text": "one\u2028two\u2029three\x85four"}, ensure_ascii=False),
        json.dumps({"custom_id": "b", "text": "Summarise: the sky is blue."}),
    ]
    f.write_bytes(codecs.BOM_UTF8 + "\r\n".join(lines).encode() + b"\r\n")
    docs = discover(f)
    assert [(d.id, d.text, d.request) for d in docs] == [
        ("a", "one\u2028two\u2029three\x85four", None), ("b", "Summarise: the sky is blue.", None),
    ]


def test_output_names_distinct_for_distinct_files(tmp_path):
    for name in ["a b.txt", "a_b.txt", "a_b.txt-2.txt", "会议纪要.txt", "季度报告.txt", "A.md", "a.txt"]:
        (tmp_path / name).write_text(f"text of {name}")
    docs = discover(tmp_path)
    ids = {d.name: d.id for d in docs}
    # Stems collide (a_b): full names, and "a b.txt", changed by sanitising, yields to the others.
    assert ids == {"a b.txt": "a_b.txt-3", "a_b.txt": "a_b.txt", "a_b.txt-2.txt": "a_b.txt-2", "会议纪要.txt": "会议纪要",
                   "季度报告.txt": "季度报告", "A.md": "A.md", "a.txt": "a.txt"}
    assert len({fold(i) for i in ids.values()}) == len(docs)  # distinct on a case-insensitive disk too


def test_jsonl_ids_distinct_and_kept(tmp_path):
    values = ["会议纪要", "季度报告", "", "..", "a/b", "a\\b", "a b", "a_b", "doc", "X", "x"]
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(json.dumps({"id": v, "text": "t"}) for v in values) + '\n{"id": 1e400, "text": "t"}\n'
                 '{"id": 12, "text": "t"}\n')
    docs = discover(f)
    assert [d.id for d in docs] == ["会议纪要", "季度报告", "doc-2", "doc-3", "a__b", "a__b-2", "a_b-2", "a_b", "doc",
                                    "X", "x-2", "1e400", "12"]
    assert [d.key for d in docs[-2:]] == [("id", "1e400"), ("id", "12")]  # numbers as their literal text
    assert [d.name for d in docs[:-2]] == values


def test_assign_keeps_earlier_runs_names_and_every_suffix_is_checked():
    assert assign(["a b", "a_b", "a_b-2"]) == ["a_b-3", "a_b", "a_b-2"]
    # An earlier run gave "a b" the id "a_b" (before "a_b" existed): it keeps it; the
    # newcomer gets a fresh one; an id of a document now gone is not handed out again.
    previous = {"a b": "a_b", "gone": "c"}
    assert assign(["a_b", "a b", "c"], previous=previous) == ["a_b-2", "a_b", "c-2"]
    long_names = ["x" * 300 + "1", "x" * 300 + "2"]
    ids = assign(long_names, wished=["y" * 200, "y" * 200])
    assert ids[0] == "y" * 200 and ids[1] == "y" * 198 + "-2"


def _swap_for_link(folder: Path, target: Path) -> None:
    """Replace ``folder`` by a link to ``target`` (what a racing process could do)."""
    import shutil

    shutil.rmtree(folder)
    folder.symlink_to(target, target_is_directory=True)


@pytest.mark.parametrize("name", ["notes.txt", "page.html"])
def test_a_folder_swapped_for_a_link_after_the_check_is_not_followed(tmp_path, monkeypatch, name):
    """The link check and the open are two steps: a folder of INPUT swapped for a
    link out of it between them must not be read through (text and converted kinds)."""
    from mlx_tier.job import doc_text as converters

    docs, outside = tmp_path / "docs", tmp_path / "outside"
    (docs / "sub").mkdir(parents=True)
    outside.mkdir()
    (docs / "sub" / name).write_text("<p>river flood</p>")
    (outside / name).write_text("<p>the secret words: zebra quokka</p>")
    real_check = converters._escaped

    def check_then_swap(path, inside):
        verdict = real_check(path, inside)  # passes: the file is inside INPUT now
        _swap_for_link(docs / "sub", outside)
        return verdict

    monkeypatch.setattr(converters, "_escaped", check_then_swap)
    got = converters.convert_file(docs / "sub" / name, inside=docs.resolve())
    assert got.text is None and got.error.startswith("cannot read"), got
    assert "zebra" not in (got.error or "")


def test_open_inside_reads_real_paths_and_refuses_links_on_the_way(tmp_path):
    import errno

    from mlx_tier.fsio import open_inside

    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.txt").write_text("deep")
    (root / "top.txt").write_text("top")
    (root / "link.txt").symlink_to(root / "top.txt")
    real = root.resolve()
    for rel, want in (("a/b/f.txt", b"deep"), ("top.txt", b"top")):
        with os.fdopen(open_inside(real, real / rel), "rb") as f:
            assert f.read() == want
    with pytest.raises(OSError) as e:
        open_inside(real, real / "link.txt")  # a final link
    assert e.value.errno == errno.ELOOP and "link.txt" in str(e.value)
    (tmp_path / "elsewhere" / "b").mkdir(parents=True)
    (tmp_path / "elsewhere" / "b" / "f.txt").write_text("outside")
    _swap_for_link(root / "a", tmp_path / "elsewhere")
    with pytest.raises(OSError) as e:
        open_inside(real, real / "a" / "b" / "f.txt")  # a link on the way
    assert e.value.errno in (errno.ELOOP, errno.ENOTDIR)
    with pytest.raises(ValueError):
        open_inside(real, tmp_path / "elsewhere" / "b" / "f.txt")


def test_the_xml_parser_word_conversion_needs_keeps_namespace_prefixes():
    """MarkItDown's Word converter parses word/document.xml with BeautifulSoup's
    lxml-backed XML parser and writes it back; where that drops the ``w:``
    prefixes (lxml 6.2.0), every .docx fails. pyproject.toml keeps lxml below 6.2."""
    from bs4 import BeautifulSoup

    xml = ('<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w='
           '"http://schemas.openxmlformats.org/wordprocessingml/2006/main"><w:body><w:p/></w:body></w:document>')
    assert "<w:body>" in str(BeautifulSoup(xml, features="xml")), "this lxml drops namespace prefixes"


def test_another_jobs_output_folder_inside_the_input_is_not_read(tmp_path):
    """A user trial: `run D --out D/out`, then `run D --out other` summarised D/out's summaries
    and its report.html as documents (out__a, out__report). A folder that is an mlx-tier job's
    output (its journal.jsonl starts with a journal record) is skipped wherever it lies; a
    user's own file named journal.jsonl does not make a folder an output folder."""
    (tmp_path / "a.txt").write_text("The river flooded the farm.")
    out = tmp_path / "out"
    out.mkdir()
    (out / "journal.jsonl").write_text(json.dumps({"event": "start", "run": "20261205T080000-abcdef"}) + "\n")
    (out / "a.md").write_text("A summary of a.txt.\n")
    (out / "report.html").write_text("<html><body>report</body></html>")
    deep = tmp_path / "old" / "runs"
    deep.mkdir(parents=True)
    (deep / "journal.jsonl").write_text(json.dumps({"id": "x", "status": "done"}) + "\n")  # an older version's
    (deep / "x.md").write_text("A summary.\n")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "journal.jsonl").write_text('["my diary", "day 1"]\n')
    (notes / "day1.md").write_text("Day one: rain.\n")
    assert sorted(d.source.removeprefix(str(tmp_path) + os.sep) for d in discover(tmp_path)) == [
        "a.txt", os.path.join("notes", "day1.md")]


def test_a_lone_surrogate_a_converter_gives_is_read_as_the_replacement_character(tmp_path):
    """A user trial (the kind): a notebook whose cell holds JSON's "\\ud800" escape gave text no
    UTF-8 encodes, and the run ended in a traceback. It is read as U+FFFD, as an HTML parser
    reads &#xD800;, and the converter says so."""
    (tmp_path / "j.ipynb").write_text('{"cells": [{"cell_type": "markdown", "metadata": {}, "source": '
                                      '["Owls \\ud800 hoot at night."]}], "metadata": {}, "nbformat": 4, '
                                      '"nbformat_minor": 5}')
    (tmp_path / "h.html").write_text("<html><body><p>Owls &#xD800; hoot.</p></body></html>")  # my own
    docs = {d.id: d for d in discover(tmp_path)}
    assert docs["j"].text == "Owls \ufffd hoot at night." and docs["j"].error is None
    assert docs["j"].converter.endswith("IpynbConverter, 1 lone surrogate read as U+FFFD")
    assert docs["h"].text == "Owls \ufffd hoot." and docs["h"].converter.endswith("HtmlConverter")


def test_every_link_hint_fits_a_terminal_line():
    """A user trial: the hint for links out of INPUT and to skipped folders ran to 84 columns."""
    from collections import Counter

    reasons = ("link out of INPUT", "link to a folder out of INPUT", "link to a skipped folder in INPUT")
    for n in range(1, 1 << len(reasons)):
        hint = link_hint(Counter({r: 1 for i, r in enumerate(reasons) if n >> i & 1}))
        assert hint and "--follow-links" in hint and len(hint) <= 80, hint
