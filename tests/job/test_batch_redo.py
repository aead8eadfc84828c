"""A batch request changed since its answer is redone, as a changed document is.

Invariants guarded: a request whose url, messages, prompt or any body option
changed under the same ``custom_id`` is stale on the next run and answered again,
its new line in place of the old one in ``output.jsonl`` (the old line stays
until the new one is complete: the file is rewritten atomically); a request
unchanged, its body's keys reordered included, is skipped and its line left
byte for byte; each ``custom_id`` keeps one line across ``output.jsonl`` and
``errors.jsonl`` (a redo that fails moves it to ``errors.jsonl``); answers
recorded when only the messages' text was hashed are taken as current while
that text is unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.jobs import done_lines
from support.output import command_after
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.job.batch_api import CHAT, COMPLETIONS
from mlx_tier.job.documents import discover, with_default_limit
from mlx_tier.job.outputs import BatchOutputs
from mlx_tier.job.provenance import Settings, request_stamp, text_stamp
from mlx_tier.job.rerun import limit_note, request_hashes, rerun_notes
from mlx_tier.job.triage import OutputState, triage
from mlx_tier.outdir.journal import Journal

runner = CliRunner()
A = {"custom_id": "a", "method": "POST", "url": CHAT,
     "body": {"model": "gpt-4o-mini", "max_tokens": 6, "temperature": 0, "stop": ["\n"],
              "messages": [{"role": "user", "content": "The cat sleeps."}]}}
B = {"custom_id": "b", "method": "POST", "url": CHAT,
     "body": {"max_tokens": 4, "temperature": 0, "messages": [{"role": "system", "content": "Be brief."},
                                                             {"role": "user", "content": "Good morning."}]}}
C = {"custom_id": "c", "method": "POST", "url": COMPLETIONS,
     "body": {"max_tokens": 4, "temperature": 0, "prompt": "Once upon a time"}}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def raw_lines(path: Path) -> dict[str, bytes]:
    """``custom_id -> line`` of a JSONL output file, as written (``{}``: none)."""
    if not path.exists():
        return {}
    lines = path.read_bytes().splitlines()
    out = {json.loads(x)["custom_id"]: x for x in lines}
    assert len(out) == len(lines), "a custom_id has two lines"
    return out


def args(inp: Path, out: Path, model: Path) -> list[str]:
    return ["run", str(inp), "--out", str(out), "--model", str(model), "--kernel", "mlx"]


@pytest.fixture(scope="module")
def answered(tmp_path_factory, tiny_moe) -> Path:
    """An output folder where A, B and C were answered (copied by each test)."""
    root = tmp_path_factory.mktemp("answered")
    r = runner.invoke(app, args(write_jsonl(root / "requests.jsonl", [A, B, C]), root / "out", tiny_moe))
    assert r.exit_code == 0, r.output
    assert set(raw_lines(root / "out" / "output.jsonl")) == {"a", "b", "c"}
    return root / "out"


def test_a_request_files_report_names_no_summarise_instruction(answered):
    """Each request runs its own messages: report.json recorded the summarise instruction
    (`--prompt`'s default) as the run's prompt, which made none of its answers."""
    report = json.loads((answered / "report.json").read_text())
    assert report["batch_requests"] is True
    assert report["prompt"] is None and report["prompts"] == {}, (report["prompt"], report["prompts"])
    assert "Summarise" not in json.dumps(report)


def rerun_with(a: dict, answered: Path, tmp_path: Path, model: Path):
    """Copy the answered folder, rerun it with A replaced by ``a``; the CLI result, the folder
    and the output lines before."""
    out = shutil.copytree(answered, tmp_path / "out")
    before = raw_lines(out / "output.jsonl")
    r = runner.invoke(app, args(write_jsonl(tmp_path / "changed.jsonl", [a, B, C]), out, model))
    return r, out, before


def body_with(**change) -> dict:
    return {**A, "body": {**A["body"], **change}}


@pytest.mark.parametrize("a", [
    body_with(max_tokens=2),
    body_with(stop=["the"]),
    body_with(messages=[{"role": "user", "content": "The dog barks."}]),
    body_with(temperature=0.8, seed=5),
    {**A, "url": COMPLETIONS, "body": {"max_tokens": 6, "temperature": 0, "prompt": "The cat sleeps."}},
], ids=["max_tokens", "stop", "message_text", "sampling", "url"])
def test_a_changed_request_is_redone_and_its_line_replaced(a, answered, tmp_path, tiny_moe):
    r, out, before = rerun_with(a, answered, tmp_path, tiny_moe)
    text = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "1 request changed since answered (stale): redoing it" in text, r.output
    assert "redone 1 stale (request changed, or the --max-tokens of one without its own)" in text, r.output
    after = raw_lines(out / "output.jsonl")
    assert list(after) == ["b", "c", "a"]  # one line each, the new answer last (completion order)
    assert after["b"] == before["b"] and after["c"] == before["c"]  # the unchanged ones: left byte for byte
    assert json.loads(after["a"])["id"] != json.loads(before["a"])["id"]  # answered again
    assert not (out / "errors.jsonl").exists()
    assert done_lines(out) == {"a": 2, "b": 1, "c": 1}  # b and c not regenerated
    record = Journal(out).records()["a"]
    assert record["redo"] == "stale" and record["made_from"]["sha256"] == request_stamp(a["url"], a["body"]).sha256
    body = json.loads(after["a"])["response"]["body"]
    assert body["object"] == ("text_completion" if a["url"] == COMPLETIONS else "chat.completion")
    assert body["usage"]["completion_tokens"] <= a["body"]["max_tokens"]

    r = runner.invoke(app, args(tmp_path / "changed.jsonl", out, tiny_moe))  # now current: nothing to do
    assert r.exit_code == 0 and "nothing to do" in r.output and "stale" not in r.output, r.output
    assert raw_lines(out / "output.jsonl") == after


def test_reordered_keys_are_the_same_request_and_nothing_is_redone(answered, tmp_path, tiny_moe):
    out = shutil.copytree(answered, tmp_path / "out")
    before = (out / "output.jsonl").read_bytes()
    reordered = [{"body": dict(reversed(x["body"].items())), "url": x["url"], "method": "POST",
                  "custom_id": x["custom_id"]} for x in (C, A, B)]  # lines, keys and body keys in another order
    r = runner.invoke(app, args(write_jsonl(tmp_path / "reordered.jsonl", reordered), out, tiny_moe))
    assert r.exit_code == 0 and "nothing to do" in r.output and "stale" not in r.output, r.output
    assert (out / "output.jsonl").read_bytes() == before
    assert done_lines(out) == {"a": 1, "b": 1, "c": 1}


def test_a_redo_that_fails_moves_the_request_to_errors(answered, tmp_path, tiny_moe):
    r, out, before = rerun_with(body_with(logprobs=True), answered, tmp_path, tiny_moe)
    assert r.exit_code == 1, r.output  # the changed request cannot run as written
    words = " ".join(r.output.split())  # a user trial: exit 1 named no way to retry
    assert "1 request failed (why: in the table above); retry it with:" in words, words
    assert command_after(r.output, "retry it with:").endswith("--retry-failed")
    assert list(raw_lines(out / "output.jsonl")) == ["b", "c"]  # its old answer (to another request) is gone
    error = json.loads(raw_lines(out / "errors.jsonl")["a"])
    assert error["error"]["code"] == "unsupported_parameter"
    r = runner.invoke(app, args(tmp_path / "changed.jsonl", out, tiny_moe))  # failed stays failed: one line still
    assert r.exit_code == 1, r.output
    words = " ".join(r.output.split())  # a request file's runs speak of requests, in the singular for one
    assert "1 request failed in an earlier run; not retried (rerun with --retry-failed to retry only that one)" \
        in words and "skipping 2 requests already done" in words and "document" not in words, words
    assert list(raw_lines(out / "output.jsonl")) == ["b", "c"] and list(raw_lines(out / "errors.jsonl")) == ["a"]


def test_a_redone_line_replaces_the_old_one_only_once_complete(tmp_path, monkeypatch):
    out = BatchOutputs(tmp_path)
    for c in "abc":
        out.add_output(c, {"custom_id": c, "n": 1})
    out.add_output("b", {"custom_id": "b", "n": 2})  # not a redo: a second answer never lands
    before = (tmp_path / "output.jsonl").read_bytes()

    def crash(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mlx_tier.fsio.os.replace", crash)  # the rewrite dies before its rename
    with pytest.raises(OSError):
        out.add_output("b", {"custom_id": "b", "n": 2}, redo=True)
    assert (tmp_path / "output.jsonl").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "output.jsonl"]  # the old line stands, no temporary left
    monkeypatch.undo()
    out.add_output("b", {"custom_id": "b", "n": 2}, redo=True)
    assert [json.loads(x) for x in raw_lines(tmp_path / "output.jsonl").values()] == [
        {"custom_id": "a", "n": 1}, {"custom_id": "c", "n": 1}, {"custom_id": "b", "n": 2}]
    out.add_error("c", {"custom_id": "c", "error": 1}, redo=True)  # a redo that failed: its line moves
    assert list(raw_lines(tmp_path / "output.jsonl")) == ["a", "b"] and list(raw_lines(tmp_path / "errors.jsonl")) == [
        "c"]
    again = BatchOutputs(tmp_path)
    assert set(again.done) == {"a", "b"} and set(again.errors) == {"c"}


def test_the_request_stamp_covers_url_and_every_option_not_key_order():
    stamp = request_stamp(CHAT, A["body"]).sha256
    assert request_stamp(CHAT, dict(reversed(A["body"].items()))).sha256 == stamp
    for url, body in [(COMPLETIONS, A["body"]), (CHAT, {**A["body"], "max_tokens": 7}),
                      (CHAT, {**A["body"], "stop": ["\n", "."]}), (CHAT, {**A["body"], "model": "gpt-4o"}),
                      (CHAT, {**A["body"], "messages": [{"role": "system", "content": "The cat sleeps."}]})]:
        assert request_stamp(url, body).sha256 != stamp, body


def test_answers_recorded_with_the_text_hash_are_current_while_the_text_is(tmp_path):
    """Journals of versions that hashed a request's message text only: an unchanged text is taken
    as current (its options were not recorded), a changed one is stale; new records compare whole."""
    changed_text = {**A, "custom_id": "t", "body": {**A["body"], "messages": [{"role": "user", "content": "Hi."}]}}
    changed_option = {**B, "body": {**B["body"], "max_tokens": 9}}
    docs = discover(write_jsonl(tmp_path / "requests.jsonl", [A, changed_text, changed_option, C]))

    def done(text: str | None = None, request: dict | None = None) -> dict:
        stamp = text_stamp(text) if text is not None else request_stamp(request["url"], request["body"])
        return {"status": "done", "output": "output.jsonl", "made_from": stamp.as_dict()}

    records = {"a": done(text="The cat sleeps."), "t": done(text="The cat sleeps."), "b": done(request=B),
               "c": done(request=C)}
    tri = triage([d.id for d in docs], records, {d.id: OutputState(True, True) for d in docs},
                 current=request_hashes(docs, records))
    assert tri.stale == ["t", "b"] and tri.pending == ["t", "b"] and set(tri.done) == {"a", "c"}
    notes = rerun_notes(tri, records, Settings("demo", None, "0"), False, batch=True)
    assert notes[0].startswith("2 requests changed since answered (stale): redoing them")
    assert "1 answer from an older mlx-tier record the hash of the messages' text only" in notes[1]


def test_a_request_without_its_own_limit_is_redone_under_another_max_tokens(tmp_path, tiny_moe):
    """A user trial: a request that sets no token limit is answered within `--max-tokens`;
    a rerun with another `--max-tokens` kept its old answer as current ("skipping 1 already
    done", `--redo-changed` too). Its stamp now carries the default it was answered with."""
    free = {"custom_id": "free", "method": "POST", "url": CHAT,
            "body": {"temperature": 0, "messages": [{"role": "user", "content": "Describe the sea."}]}}
    inp, out = write_jsonl(tmp_path / "requests.jsonl", [free, B]), tmp_path / "out"
    assert runner.invoke(app, [*args(inp, out, tiny_moe), "--max-tokens", "3"]).exit_code == 0
    r = runner.invoke(app, [*args(inp, out, tiny_moe), "--max-tokens", "3"])
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
    r = runner.invoke(app, [*args(inp, out, tiny_moe), "--max-tokens", "5"])
    assert r.exit_code == 0 and "1 request changed since answered (stale): redoing it" in " ".join(r.output.split())
    assert done_lines(out) == {"free": 2, "b": 1}  # b sets its own limit: not redone
    usage = json.loads(raw_lines(out / "output.jsonl")["free"])["response"]["body"]["usage"]
    assert 3 < usage["completion_tokens"] <= 6  # up to 5 tokens and the stop token, as the API counts it


def test_an_answer_stamped_before_the_default_limit_was_is_current(tmp_path):
    free = {**B, "custom_id": "f", "body": {k: v for k, v in B["body"].items() if k != "max_tokens"}}
    docs = with_default_limit(discover(write_jsonl(tmp_path / "requests.jsonl", [free, B])), 16)
    assert docs[0].stamp.sha256 == request_stamp(CHAT, free["body"], 16).sha256 != request_stamp(CHAT, free["body"]).sha256
    assert docs[1].stamp.sha256 == request_stamp(CHAT, B["body"]).sha256  # its own limit: as before
    old = {"status": "done", "made_from": request_stamp(CHAT, free["body"]).as_dict()}
    assert request_hashes(docs, {"f": old})["f"] == old["made_from"]["sha256"]
    tri = triage([d.id for d in docs], {"f": old}, {d.id: OutputState(True, True) for d in docs},
                 current=request_hashes(docs, {"f": old}))
    assert "f" in tri.done and limit_note(docs, {"f": old}, tri) == [
        "1 answer of requests without a token limit from an older mlx-tier: the `max_tokens` they were answered "
        "within was not recorded; taken as current (delete one's line from output.jsonl to redo it)"]
    other = {"status": "done", "made_from": request_stamp(CHAT, free["body"], 8).as_dict()}
    assert request_hashes(docs, {"f": other})["f"] == docs[0].stamp.sha256  # another default: stale


def test_answers_of_another_model_are_kept_with_a_word_and_redone_with_redo_changed(answered, tmp_path, tiny_moe):
    """A review: a request file rerun with another `--model` printed only "skipping 2 requests
    already done", and `--redo-changed` redid nothing: answers were never compared by model.
    They are now, as summaries are (not by prompt: each request runs its own messages)."""
    out = shutil.copytree(answered, tmp_path / "out")
    inp = write_jsonl(tmp_path / "requests.jsonl", [A, B, C])
    other = shutil.copytree(tiny_moe, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (other / "config.json").write_text(json.dumps(config))
    before = raw_lines(out / "output.jsonl")
    r = runner.invoke(app, args(inp, out, other))
    words = " ".join(r.output.split())
    assert r.exit_code == 0 and "keeping 3 answers written with another model; redo them with --redo-changed" \
        in words, r.output
    assert raw_lines(out / "output.jsonl") == before
    r = runner.invoke(app, [*args(inp, out, other), "--prompt", "Translate:"])  # no prompt applies: nothing more
    words = " ".join(r.output.split())
    assert "keeping 3 answers written with another model;" in words and "another prompt" not in words, r.output
    r = runner.invoke(app, [*args(inp, out, other), "--redo-changed"])
    assert r.exit_code == 0 and "--redo-changed: redoing 3 answers written with another model" \
        in " ".join(r.output.split()), r.output
    assert done_lines(out) == {"a": 2, "b": 2, "c": 2}
    report = json.loads((out / "report.json").read_text())
    assert all(d["prompt"] is None and d.get("generation") is None for d in report["documents"])
    assert "prompt" not in report["runs"][-1] or report["runs"][-1]["prompt"] is None
    assert "generation" not in report["runs"][-1]
    r = runner.invoke(app, [*args(inp, out, other), "--max-tokens", "9"])  # nothing to redo: b and c set theirs,
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output  # a sets its own too


def test_a_request_file_run_into_a_folder_of_summaries_calls_them_summaries(answered, tmp_path, tiny_moe):
    """A user trial: a request file run into a folder holding document summaries said "5
    answers of earlier runs are of requests not in this file"."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "a.txt").write_text("The cat sleeps on the warm stones of the harbour wall.")
    assert runner.invoke(app, ["run", str(docs), "--out", str(out), "--model", str(tiny_moe), "--kernel", "mlx",
                               "--max-tokens", "4"]).exit_code == 0
    r = runner.invoke(app, args(write_jsonl(tmp_path / "requests.jsonl", [A]), out, tiny_moe))
    words = " ".join(r.output.split())
    assert "1 summary of earlier runs is of documents, not requests (another input, or removed)" in words, r.output
    assert "answers of earlier runs" not in words
