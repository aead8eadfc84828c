"""Invariant 3: outputs appear only complete; the journal survives a torn last line."""

import json
import os
import time

import pytest

from mlx_tier.fsio import write_atomic
from mlx_tier.outdir.journal import Journal


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
    assert {k: v["status"] for k, v in j.records().items()} == {"a": "done"}  # read before any append
    j.append({"id": "c", "status": "done"})
    recs = j.records()
    assert {k: v["status"] for k, v in recs.items()} == {"a": "done", "c": "done"}


def test_a_torn_tail_is_cut_off_when_the_journal_is_appended_to(tmp_path):
    """A power cut mid-line leaves a fragment; the next append removes it, so the file is
    whole JSON lines (``jq`` reads it) and no later reader warns about it."""
    j = Journal(tmp_path)
    j.append({"id": "a", "status": "done"})
    with open(j.path, "ab") as f:
        f.write(b'{"id": "b", "status": "do')  # the power went here
    j.append({"id": "b", "status": "done"})
    lines = j.path.read_bytes().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"]
    assert Journal(tmp_path).records().keys() == {"a", "b"} and not j.warnings


def test_a_journal_that_is_only_a_fragment_starts_afresh(tmp_path):
    (tmp_path / "journal.jsonl").write_bytes(b'{"id": "a", "sta')  # killed during its first append
    j = Journal(tmp_path)
    j.append({"id": "a", "status": "done"})
    assert [json.loads(x)["id"] for x in j.path.read_bytes().splitlines()] == ["a"]


def test_stale_temps_of_a_killed_run_are_removed(tmp_path):
    from mlx_tier.fsio import remove_stale_temps

    old = tmp_path / ".one.md.k3j_x9q2.tmp"  # write_atomic's name for one.md
    old.write_text("half a summ")
    os.utime(old, (0, time.time() - 3600))  # a killed run's, an hour ago
    live = tmp_path / ".report.html.a1b2c3d4.tmp"  # a concurrent `status --html` is writing it now
    live.write_text("<html>")
    (tmp_path / "one.md").write_text("kept")
    (tmp_path / ".notes.tmp").write_text("not ours")
    assert remove_stale_temps(tmp_path) == [".one.md.k3j_x9q2.tmp"]
    assert sorted(os.listdir(tmp_path)) == [".notes.tmp", ".report.html.a1b2c3d4.tmp", "one.md"]
    assert remove_stale_temps(tmp_path, older_than_s=0) == [".report.html.a1b2c3d4.tmp"]


def test_write_atomic_never_touches_the_process_umask(tmp_path, monkeypatch):
    """Reading the umask sets it, process-wide, for a moment: other threads would create files with 0."""
    from mlx_tier.fsio import write_atomic

    before = os.umask(0o027)
    try:
        def no_umask(mask):
            raise AssertionError("write_atomic changed the umask")

        monkeypatch.setattr(os, "umask", no_umask)
        write_atomic(tmp_path / "a.md", "x")
        monkeypatch.undo()
        assert (tmp_path / "a.md").stat().st_mode & 0o777 == 0o640  # the kernel applied the umask
    finally:
        os.umask(before)


def test_jsonl_summaries_one_line_per_id_survives_torn_tail(tmp_path):
    import json

    from mlx_tier.job.documents import Document
    from mlx_tier.job.outputs import JsonlSummaries

    docs = [Document("req__1", "in.jsonl:1", "t", key=("custom_id", "req/1")), Document("b", "/d/b.txt", "t")]
    (tmp_path / "req__1.md").write_text("First summary.\n")
    (tmp_path / "b.md").write_text("Second.\n")
    s = JsonlSummaries(tmp_path, docs)
    j = Journal(tmp_path, on_done=s.add)
    j.append({"id": "req__1", "status": "done", "output": "req__1.md", "output_tokens": 3})
    j.append({"id": "req__1", "status": "done", "output": "req__1.md"})  # a second done record: no second line
    j.append({"id": "b", "status": "failed", "error": "x"})  # failures are not exported
    lines = [json.loads(x) for x in s.path.read_text().splitlines()]
    assert lines == [{"custom_id": "req/1", "summary": "First summary.", "output": "req__1.md", "output_tokens": 3}]

    with open(s.path, "a") as f:
        f.write('{"id": "b", "summ')  # crash mid-append
    s = JsonlSummaries(tmp_path, docs)  # reopened by the rerun: torn tail cut off
    s.sync({"req__1": {"status": "done"}, "b": {"id": "b", "status": "done"}})  # b finished, its line lost
    lines = [json.loads(x) for x in s.path.read_text().splitlines()]
    assert [x.get("custom_id", x.get("id")) for x in lines] == ["req/1", "b"]
    assert lines[1] == {"id": "b", "source": "/d/b.txt", "summary": "Second.", "output": "b.md"}


def test_a_jsonl_line_that_no_longer_holds_its_summary_is_replaced_whatever_the_record_says(tmp_path):
    """The line is derived from the .md: a summary rewritten without a `redo` flag on its
    record (a redo a crash left unrecorded, then recovered; an .md edited by hand) had kept
    its old line in summaries.jsonl for good. Each run's start (sync) and each record now
    replace a line whose summary differs, and leave one that holds it."""
    import json

    from mlx_tier.job.documents import Document
    from mlx_tier.job.outputs import JsonlSummaries

    docs = [Document("a", "/d/a.txt", "t"), Document("b", "/d/b.txt", "t")]
    (tmp_path / "a.md").write_text("Old summary of a.\n")
    (tmp_path / "b.md").write_text("Summary of b.\n")
    s = JsonlSummaries(tmp_path, docs)
    s.sync({"a": {"status": "done", "output_tokens": 5}, "b": {"status": "done", "output_tokens": 4}})
    before = s.path.read_bytes()
    (tmp_path / "a.md").write_text("New summary of a.\n")  # rewritten, its record as it was (no redo flag)
    s = JsonlSummaries(tmp_path, docs)  # the next run
    s.sync({"a": {"status": "done", "output_tokens": 5}, "b": {"status": "done", "output_tokens": 4}})
    lines = {x["id"]: x for x in map(json.loads, s.path.read_text().splitlines())}
    assert lines["a"]["summary"] == "New summary of a." and len(lines) == 2
    assert lines["b"] == json.loads(before.splitlines()[1])  # untouched
    after = s.path.read_bytes()
    s.add({"id": "b", "status": "done", "output_tokens": 9, "redo": "stale"})  # the same text: nothing to write
    assert s.path.read_bytes() == after
    (tmp_path / "b.md").write_bytes("Édité à la main.\n".encode("cp1252"))  # a review: this raised at every start
    JsonlSummaries(tmp_path, docs).sync({"b": {"status": "done"}})
    assert {x["id"]: x for x in map(json.loads, s.path.read_text().splitlines())}["b"]["summary"] == \
        "\ufffddit\ufffd \ufffd la main."


def test_export_failure_keeps_the_record_out_and_id_less_records_are_entries(tmp_path):
    def broken(record):
        raise OSError(28, "No space left on device")

    j = Journal(tmp_path, on_done=broken)
    with pytest.raises(OSError):
        j.append({"id": "a", "status": "done"})
    j.append({"event": "throttle", "throttled_seconds": 2.5})
    j.append({"id": "c", "status": "failed", "throttled_seconds": 1.0})
    assert j.records().keys() == {"c"}  # "a" was not recorded as done: the rerun redoes or recovers it
    assert sum(e.get("throttled_seconds", 0) for e in j.entries()) == 3.5


def test_records_of_the_wrong_types_are_skipped_with_a_warning(tmp_path):
    lines = ['{"id": "a", "status": "done", "time": 1.5, "output_tokens": 3}',
             '{"id": ["x"], "status": "done"}', '{"id": "b", "status": "done", "time": "yesterday"}',
             '{"id": "c", "status": "done", "output_tokens": true}', '{"id": "d"}', '[1, 2]',
             '{"event": "start", "ids": ["a", 7], "todo": []}', '{"id": "e", "status": "failed", "error": "x"}']
    (tmp_path / "journal.jsonl").write_text("\n".join(lines) + "\n")
    j = Journal(tmp_path)
    assert sorted(j.records()) == ["a", "e"]
    assert [w.split(": ", 1)[1] for w in j.warnings.values()] == [
        'skipped ("id" is ["x"], not str)', 'skipped ("time" is "yesterday", not int or float)',
        'skipped ("output_tokens" is true, not int)', 'skipped (a document record needs a "status")',
        "skipped (not an object)", 'skipped ("ids" must list strings)']
    assert list(j.warnings) == [2, 3, 4, 5, 6, 7]  # line numbers


def test_a_failed_append_leaves_whole_lines(tmp_path, monkeypatch):
    import errno

    j = Journal(tmp_path)
    j.append({"id": "a", "status": "done"})
    before = j.path.read_bytes()
    real = os.write

    def full(fd, data):
        real(fd, bytes(data)[:5])  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as e:
        j.append({"id": "b", "status": "done"})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(j.path)
    assert j.path.read_bytes() == before
    with pytest.raises(OSError):
        write_atomic(tmp_path / "report.json", "{}")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["journal.jsonl"]  # no report, no temp file


def test_written_by_groups_by_every_recorded_setting_and_shows_only_what_differs():
    """Summaries kept with another --max-tokens (or KV bits, or model config) are a mix of
    their own: status, report and page show them apart, naming only the options that
    differ; a summary of a version that recorded no options says so."""
    from mlx_tier.cli.render import mix_lines
    from mlx_tier.outdir.journal import options_apart, written_by

    model = {"name": "demo", "weights": "w" * 16, "config": "c" * 16}
    gen = {"max_tokens": 4, "repetition_penalty": 1.1, "context": None}
    rec = lambda **kw: {"event": "done", "model": model, "prompt": "p" * 16, "generation": gen, **kw}  # noqa: E731
    records = [rec(), rec(), rec(generation={**gen, "max_tokens": 6})]
    groups = written_by(records)
    assert [(g["documents"], g["options"]["max_tokens"]) for g in groups] == [(2, 4), (1, 6)]
    assert groups[0]["options"] == {"max_tokens": 4, "repetition_penalty": 1.1, "config": "cccccccc"}
    assert [options_apart(groups, g["options"]) for g in groups] == ["max_tokens 4", "max_tokens 6"]
    assert mix_lines(groups, {}) == ["2 by demo [wwwwwwww], prompt pppppppp, max_tokens 4",
                                     "1 by demo [wwwwwwww], prompt pppppppp, max_tokens 6"]
    # my own case: quantized KV caches and a config edited, beside a summary that recorded no options
    old = {"event": "done", "model": {"name": "demo", "weights": "w" * 16}, "prompt": "p" * 16}
    groups = written_by([rec(), rec(kv_bits=8, model={**model, "config": "d" * 16}), old])
    texts = sorted(options_apart(groups, g["options"]) for g in groups)
    assert texts == ["config cccccccc", "config dddddddd, kv_bits 8", "options not recorded"]
    assert len(written_by([rec(), rec()])) == 1 and options_apart(written_by([rec()]), gen) == ""
