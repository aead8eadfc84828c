"""Job input: every readable document is found once; bad ones fail alone, bad inputs fail whole."""

import json

import pytest

from mlx_tier.documents import InputError, discover, discover_list, safe_id


def test_folder_recursive_with_bad_documents(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "a.md").write_text("alpha markdown")
    (tmp_path / "sub" / "b c.md").write_text("beta")
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "ignored.pdf").write_bytes(b"%PDF")
    docs = {d.id: d for d in discover(tmp_path)}
    assert set(docs) == {"a.md", "a.txt", "sub__b_c", "bin", "latin1", "empty"}
    assert docs["sub__b_c"].text == "beta" and docs["sub__b_c"].error is None
    assert "binary" in docs["bin"].error
    assert "not UTF-8" in docs["latin1"].error
    assert docs["empty"].error == "empty document"


def test_jsonl_gives_one_document_per_line_and_flags_empty_text(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "x/1", "text": "one"}) + "\n\n" + json.dumps({"id": 2, "text": ""}) + "\n")
    docs = discover(f)
    assert [(d.id, d.text, d.error) for d in docs] == [("x__1", "one", None), ("2", None, "empty document")]


def test_jsonl_custom_id_kept_as_given(tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text("\n".join(json.dumps(o) for o in [
        {"custom_id": "req/1", "text": "one"},
        {"custom_id": 7, "id": "ignored", "text": "two"},
        {"id": "plain", "text": "three"},
    ]))
    docs = discover(f)
    assert [(d.id, d.key) for d in docs] == [("req__1", ("custom_id", "req/1")), ("7", ("custom_id", 7)),
                                             ("plain", ("id", "plain"))]


def test_path_list(tmp_path, monkeypatch):
    (tmp_path / "a" / "x").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x" / "one.txt").write_text("one")
    (tmp_path / "a" / "one.txt").write_text("top")
    (tmp_path / "b" / "two.pdf").write_bytes(b"%PDF\x00")  # listed explicitly: taken, fails alone
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "one.md").write_text("an earlier summary")
    monkeypatch.chdir(tmp_path)
    lines = ["a/x/one.txt", "", str(tmp_path / "a" / "one.txt"), "b/two.pdf", "out/one.md"]
    docs = discover_list(lines, exclude=tmp_path / "out")
    assert [d.id for d in docs] == ["a__x__one", "a__one", "b__two"]  # relative to the common folder
    assert docs[0].text == "one" and docs[0].source == str(tmp_path / "a" / "x" / "one.txt")
    assert "binary" in docs[2].error
    for bad, message in [
        (["a/one.txt", "missing.txt"], "stdin:2: missing.txt: no such file"),
        (["a"], "stdin:1: a is a folder"),
        (["a/one.txt", "./a/one.txt"], "stdin:2: ./a/one.txt is listed twice (first on line 1)"),
        (["", " "], "stdin: no file paths given"),
    ]:
        with pytest.raises(InputError) as e:
            discover_list(bad)
        assert str(e.value).startswith(message), e.value


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "in.jsonl:2: malformed JSON"),
        ('{"id": "a", "text": "ok"}\n["no"]\n', 'in.jsonl:2: each line needs an object with "custom_id" (or "id") and "text"'),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "in.jsonl:2: duplicate id 'a' (first on line 1)"),
        ('{"custom_id": "r/1", "text": "x"}\n{"custom_id": "r__1", "text": "y"}\n', "in.jsonl:2: duplicate custom_id 'r__1' (first on line 1)"),
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
    with pytest.raises(InputError, match="no .txt or .md files"):
        discover(tmp_path)
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(InputError, match="expected a folder"):
        discover(tmp_path / "x.csv")


def test_safe_id():
    assert safe_id("a/b c?.txt") == "a__b_c_.txt"
    assert safe_id("../..") == "doc"


def test_long_ids_are_cut_with_a_hash_and_stay_unique():
    from mlx_tier.documents import MAX_ID_BYTES, safe_id

    a, b = safe_id("x" * 300), safe_id("x" * 299 + "y")
    assert len(a) == len(b) == MAX_ID_BYTES and a != b
    assert safe_id("short name.txt") == "short_name.txt"
