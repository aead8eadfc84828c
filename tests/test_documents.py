"""Job input: every readable document is found once; bad ones fail alone, bad inputs fail whole."""

import json

import pytest

from mlx_tier.documents import InputError, discover, safe_id


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


def test_jsonl(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "x/1", "text": "one"}) + "\n\n" + json.dumps({"id": 2, "text": ""}) + "\n")
    docs = discover(f)
    assert [(d.id, d.text, d.error) for d in docs] == [("x__1", "one", None), ("2", None, "empty document")]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"id": "a", "text": "ok"}\n{"id": "b", "text": \n', "in.jsonl:2: malformed JSON"),
        ('{"id": "a", "text": "ok"}\n["no"]\n', 'in.jsonl:2: each line needs an object with "id" and "text"'),
        ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "in.jsonl:2: duplicate id 'a' (first on line 1)"),
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
