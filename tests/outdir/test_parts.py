"""The kept calls of long documents (OUT_DIR/parts.jsonl): a result is found again only for
the same prompt under the same identity, survives a new process, a torn last line and a
failed append; finished documents' lines are dropped; a rank's file is read by everyone."""

from __future__ import annotations

import json
import os

import pytest

from mlx_tier.outdir.layout import JOURNAL, PARTS, rank_journal_name, rank_parts
from mlx_tier.outdir.parts import KeptCall, PartStore, call_key, forget

IDENTITY = {"model": {"name": "m", "weights": "w1"}, "prompt": "p1", "kernel": "cpu"}


def test_a_kept_call_is_found_again_only_for_its_prompt_and_identity(tmp_path):
    store = PartStore(tmp_path, IDENTITY)
    store.keep([1, 2, 3], KeptCall("book", "Part one is about rivers.", "", 7, "stop"))
    assert store.get([1, 2, 3]).earlier is False  # this process's own
    again = PartStore(tmp_path, IDENTITY)  # a new run
    assert again.get([1, 2, 3]) == KeptCall("book", "Part one is about rivers.", "", 7, "stop", earlier=True)
    assert again.get([1, 2, 3, 4]) is None and again.get([1, 2]) is None
    assert again.get([12, 3]) is None  # token ids, not their digits run together
    assert PartStore(tmp_path, {**IDENTITY, "kernel": "mlx"}).get([1, 2, 3]) is None
    assert PartStore(tmp_path, {**IDENTITY, "model": {"name": "m", "weights": "w2"}}).get([1, 2, 3]) is None
    assert again.docs({"book": None}) == {"book": 1} and again.docs({"other": None}) == {}
    assert PartStore(tmp_path, {**IDENTITY, "kernel": "mlx"}).docs({"book": None}) == {}  # not under this identity


def test_a_documents_split_and_calls_are_its_source_s(tmp_path):
    """A resumed run splits a document as the run that kept its calls did (the memory it
    finds may allow a larger split), and counts only calls made from its source as it is."""
    store = PartStore(tmp_path, IDENTITY)
    store.keep([1], KeptCall("book", "one", limit=300, source="aa"))
    store.keep([2], KeptCall("book", "two", limit=300, source="aa"))
    again = PartStore(tmp_path, IDENTITY)
    assert again.limit("book", "aa") == 300 and again.limit("book", None) == 300
    assert again.limit("book", "bb") is None and again.limit("note", "aa") is None
    assert PartStore(tmp_path, {**IDENTITY, "prompt": "p2"}).limit("book", "aa") is None
    assert again.docs({"book": "aa"}) == {"book": 2} and again.docs({"book": "bb"}) == {}


def test_key_is_independent_of_key_order_but_not_of_values():
    assert call_key({"a": 1, "b": 2}, [5]) == call_key({"b": 2, "a": 1}, [5])
    assert call_key({"a": 1, "b": 2}, [5]) != call_key({"a": 1, "b": 3}, [5])


def test_a_torn_last_line_and_foreign_lines_are_skipped(tmp_path):
    store = PartStore(tmp_path, IDENTITY)
    store.keep([1], KeptCall("a", "one"))
    with open(tmp_path / PARTS, "ab") as f:
        f.write(b'["not a record"]\n{"doc": "a", "key": 5, "text": "x"}\n{"doc": "a", "key": "ab')  # torn
    again = PartStore(tmp_path, IDENTITY)
    assert again.get([1]).text == "one" and again.docs({"a": None}) == {"a": 1}
    again.keep([2], KeptCall("a", "two"))  # the torn line is cut before the append
    assert PartStore(tmp_path, IDENTITY).get([2]).text == "two"


def test_forget_drops_the_lines_of_finished_documents(tmp_path):
    store = PartStore(tmp_path, IDENTITY)
    store.keep([1], KeptCall("a", "one"))
    store.keep([2], KeptCall("b", "two"))
    assert forget(tmp_path, ["a", "zzz"]) == 1
    again = PartStore(tmp_path, IDENTITY)
    assert again.get([1]) is None and again.get([2]).text == "two"
    assert [json.loads(x)["doc"] for x in (tmp_path / PARTS).read_text().splitlines()] == ["b"]
    assert forget(tmp_path, ["a"]) == 0
    assert forget(tmp_path, ["b"]) == 1 and not (tmp_path / PARTS).exists()


def test_a_rank_keeps_its_own_file_and_every_run_reads_and_tidies_it(tmp_path):
    name = rank_parts(rank_journal_name("20261205T000000-abcdef", 1))
    assert name == "ranks/20261205T000000-abcdef/parts-1.jsonl" and rank_parts(JOURNAL) == PARTS
    (tmp_path / name).parent.mkdir(parents=True)
    PartStore(tmp_path, IDENTITY, name).keep([9], KeptCall("c", "nine"))
    assert not (tmp_path / PARTS).exists()
    store = PartStore(tmp_path, IDENTITY)
    assert store.get([9]).text == "nine"
    assert forget(tmp_path, ["c"]) == 1 and not (tmp_path / name).exists()
    assert PartStore(tmp_path, IDENTITY).get([9]) is None


@pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW"), reason="needs O_NOFOLLOW")
def test_a_failed_append_is_noted_not_raised_and_a_link_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me\n")
    (tmp_path / PARTS).symlink_to(target)
    store = PartStore(tmp_path, IDENTITY)
    store.keep([1], KeptCall("a", "one"))
    assert store.error and PARTS in store.error
    assert target.read_text() == "keep me\n" and store.get([1]) is None
