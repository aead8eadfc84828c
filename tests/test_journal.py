"""Invariant 3: outputs appear only complete; the journal survives a torn last line."""

import os

import pytest

from mlx_tier.journal import Journal, write_atomic


def test_write_atomic_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "x.md"
    write_atomic(p, "one")
    write_atomic(p, "two")
    assert p.read_text() == "two"
    assert os.listdir(tmp_path) == ["x.md"]


def test_write_atomic_failure_leaves_nothing(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "y.md", 42)  # not text: fails mid-write
    assert os.listdir(tmp_path) == []


def test_journal_last_record_wins_and_torn_line_is_skipped(tmp_path):
    j = Journal(tmp_path)
    j.append({"id": "a", "status": "failed"})
    j.append({"id": "a", "status": "done"})
    with open(j.path, "a") as f:
        f.write('{"id": "b", "sta')  # crash mid-append
    j.append({"id": "c", "status": "done"})
    recs = j.records()
    assert {k: v["status"] for k, v in recs.items()} == {"a": "done", "c": "done"}
