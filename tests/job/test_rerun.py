"""Every summary matches the document, model and prompt it claims: a rerun notices a
document changed since its summary and redoes it (the old summary kept until the new
one is complete), takes a ``touch`` or a rename for what they are (no change), keeps
summaries written with another model or prompt and says so in one line (or redoes
them with ``--redo-changed``), and the report, ``mlx-tier status`` and the page show
what was redone and which model and prompt wrote each summary.
"""

import hashlib
import json
import os
import shutil
from collections import Counter

import pytest
from support.checkpoints import make_mixtral
from support.jobs import _short_context, done_lines, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

import mlx_tier.cli.render as render
from mlx_tier.cli.main import app
from mlx_tier.job.provenance import Settings, prompt_hash
from mlx_tier.job.triage import OutputState, triage
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.journal import Journal

runner = CliRunner()
OLD_A = "The board approved the merger. Revenue grew in spring and the farmers planted seed."
NEW_A = "REJECTED: the board voted the merger down and fired the CFO after the river flood."
FRENCH = "Translate the text below into French."


@pytest.fixture
def s1(tmp_path):
    folder = tmp_path / "s1"
    folder.mkdir()
    (folder / "a.txt").write_text(OLD_A)
    (folder / "b.txt").write_text("The library opens at nine; bees carry pollen to the flower and fruit.")
    return folder


def run(*args):
    r = runner.invoke(app, ["run", *map(str, args)])
    return r.exit_code, " ".join(r.output.split())  # words, whatever the wrapping


def last_record(out, doc_id):
    return [r for r in Journal(out).entries() if r.get("id") == doc_id][-1]


def report(out):
    return json.loads((out / "report.json").read_text())


def test_a_rewritten_document_is_redone_and_every_view_says_so(s1, tmp_path, small_moe, monkeypatch):  # noqa: F811
    """The issue's example: a.txt rewritten after its summary; the same command again used to
    skip it ("skipping 2 documents already done") and keep the old summary."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5", "--batch-size", "1")
    code, output = run(*args)
    assert code == 0, output
    old_a, b_mtime = (out / "a.md").read_text(), (out / "b.md").stat().st_mtime_ns
    made = last_record(out, "a")["made_from"]
    assert made == {"sha256": hashlib.sha256(OLD_A.encode()).hexdigest(), "size": len(OLD_A),
                    "mtime": round((s1 / "a.txt").stat().st_mtime, 3), "hashed": "bytes"}

    (s1 / "a.txt").write_text(NEW_A)
    seen = []  # a.md as each engine step of the redo finds it
    working = render.RichReporter.working
    monkeypatch.setattr(render.RichReporter, "working",
                        lambda self, activity: (seen.append((out / "a.md").read_text()), working(self, activity)))
    code, output = run(*args)
    assert code == 0, output
    assert "skipping 1 document already done" in output
    assert "1 document changed since summarised (stale): redoing it; its old summary stays until the new" in output
    assert seen and set(seen) == {old_a}  # the old summary stays until the new one is complete
    assert done_lines(out) == Counter({"a": 2, "b": 1})  # a redone, b untouched
    assert (out / "b.md").stat().st_mtime_ns == b_mtime
    assert last_record(out, "a")["made_from"]["sha256"] == hashlib.sha256(NEW_A.encode()).hexdigest()
    assert last_record(out, "a")["redo"] == "stale"
    assert "redone 1 stale (document changed)" in output  # the terminal's last lines

    rep = report(out)
    assert rep["runs"][-1]["redone_stale"] == 1 and rep["runs"][-1]["stale_left"] == 0
    docs = {d["id"]: d for d in rep["documents"]}
    assert docs["a"]["redo"] == "stale" and not docs["a"]["earlier_run"] and docs["b"]["earlier_run"]
    st = read_status(out)
    assert (st.redone_stale, st.done, st.done_this_run) == (1, 2, 1)
    r = runner.invoke(app, ["status", str(out)])
    assert "1 stale (document changed)" in " ".join(r.output.split()), r.output
    page = (out / "report.html").read_text()
    assert 'id="n-redone-stale" data-value="1"' in page and "redone: its document changed" in page

    code, output = run(*args)  # now current: nothing to do
    assert code == 0 and "stale" not in output and done_lines(out)["a"] == 2, output


def test_a_touch_or_a_rename_is_not_a_change(s1, tmp_path, small_moe):  # noqa: F811
    """Only the content decides: a touch changes nothing; a renamed document gets the summary
    of its content under its new name, copied, not generated again; the old output stays."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    before = {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in out.glob("*.md")}

    os.utime(s1 / "b.txt", (1e9, 1e9))  # touched (to another time)
    code, output = run(*args)
    assert code == 0 and "skipping 2 documents already done" in output and "stale" not in output, output
    assert not report(out)["runs"][-1]["loaded_model"]  # nothing to do: no model loaded

    (s1 / "a.txt").rename(s1 / "c.txt")
    code, output = run(*args)
    assert code == 0, output
    assert "1 document renamed or copied: the summary of the same content copied under the new name" in output
    assert not report(out)["runs"][-1]["loaded_model"]  # nothing generated
    # a user trial: "2 done (2 by earlier runs)" of a run that copied one of them
    assert "job: 2 done (2 by earlier runs, 1 of them copied now under a new name)" in output, output
    assert (out / "c.md").read_text() == before["a.md"][0]
    assert {p.name: (p.read_text(), p.stat().st_mtime_ns) for p in out.glob("[ab].md")} == before  # a.md kept
    rec = last_record(out, "c")
    assert rec["reused"] == "a" and rec["name"] == "c.txt" and rec["made_from"] == last_record(out, "a")["made_from"]
    docs = {d["id"]: d for d in report(out)["documents"]}
    assert set(docs) == {"b", "c"} and docs["c"]["reused"] == "a" and docs["c"]["status"] == "done"
    st = read_status(out)
    assert (st.total, st.done, st.pending) == (2, 2, 0)

    shutil.copy(s1 / "b.txt", s1 / "d.txt")  # a copy beside its original: the same content, twice
    code, output = run(*args)
    assert code == 0 and (out / "d.md").read_text() == before["b.md"][0], output
    assert last_record(out, "d")["reused"] == "b" and not report(out)["runs"][-1]["loaded_model"]


def test_the_same_bytes_read_another_way_are_another_document(tmp_path, small_moe):  # noqa: F811
    """A review: `d.html`, a copy of `c.txt`'s bytes, got c's summary (made from the raw
    markup read as text), though the HTML converter reads it as another text. A summary is
    copied only to the same bytes read the same way (`.htm` and `.html`: one converter)."""
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    page = "<html><body><p>Meeting notes: the budget was approved and the bridge repaired.</p></body></html>"
    (docs / "c.txt").write_text(page)
    args = (docs, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    shutil.copy(docs / "c.txt", docs / "d.html")
    code, output = run(*args)
    assert code == 0 and "renamed or copied" not in output, output
    rec = last_record(out, "d")
    assert "reused" not in rec and "Html" in rec["converter"] and report(out)["runs"][-1]["loaded_model"], rec
    shutil.copy(docs / "d.html", docs / "e.htm")
    code, output = run(*args)
    assert code == 0 and "1 document renamed or copied" in output, output
    assert last_record(out, "e")["reused"] == "d" and (out / "e.md").read_text() == (out / "d.md").read_text()


def test_a_document_changed_to_a_text_summarised_already_is_said_copied_not_redone(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: four copies edited to one new text, two summarised from it before a
    stop; the rerun said "2 documents changed since summarised (stale): redoing them" and
    then copied the summaries of the other two, redoing nothing. The line says what is done."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    (s1 / "c.txt").write_text(NEW_A)
    assert run(*args)[0] == 0  # c summarised from the new text
    (s1 / "a.txt").write_text(NEW_A)  # a changed to c's text
    code, output = run(*args)
    assert code == 0 and "redoing" not in output and "renamed or copied" not in output, output
    assert "1 document changed since summarised to a text summarised already: that summary copied, not " \
           "written again" in output, output
    assert (out / "a.md").read_text() == (out / "c.md").read_text() and last_record(out, "a")["reused"] == "c"
    assert report(out)["runs"][-1]["stale_left"] == 0  # copied: no stale summary left
    (s1 / "a.txt").write_text(OLD_A)  # back to a text no summary of the job's is of now: redone
    (s1 / "d.txt").write_text((s1 / "b.txt").read_text())  # and a copy
    code, output = run(*args)
    assert code == 0 and "1 document changed since summarised (stale): redoing it" in output, output
    assert "1 document renamed or copied" in output and "to a text summarised already" not in output, output


def test_a_deleted_summary_is_written_again_and_said(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: a deleted a.md was regenerated without a word. The rerun says it; a
    deleted summary whose content another document's summary holds is copied (said so)."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    (out / "a.md").unlink()
    code, output = run(*args)
    assert code == 0 and "1 summary of earlier runs missing (deleted since): writing it again" in output, output
    assert (out / "a.md").exists() and "stale" not in output
    shutil.copy(s1 / "b.txt", s1 / "c.txt")
    assert run(*args)[0] == 0  # c: b's summary copied
    (out / "c.md").unlink()
    code, output = run(*args)
    assert code == 0 and "missing" not in output and "1 document renamed or copied" in output, output
    (out / "a.md").unlink()
    code, output = run(*args, "--retry-failed")  # a plain rerun's work: left as it is
    assert code == 0 and "missing" not in output and not (out / "a.md").exists(), output


def test_same_size_rewrite_with_the_old_mtime_put_back_is_still_noticed(s1, tmp_path, small_moe):  # noqa: F811
    """The hash decides, not size and mtime: a rewrite of the same length whose mtime is
    set back to the old one (as `cp -p` or an editor restoring times would) is redone."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    st = (s1 / "b.txt").stat()
    text = (s1 / "b.txt").read_text()
    (s1 / "b.txt").write_text(text.replace("nine", "ten!"))  # same size
    os.utime(s1 / "b.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (s1 / "b.txt").stat().st_size == st.st_size and (s1 / "b.txt").stat().st_mtime_ns == st.st_mtime_ns
    code, output = run(*args)
    assert code == 0 and "1 document changed since summarised (stale)" in output, output
    assert done_lines(out) == Counter({"a": 1, "b": 2})


@pytest.mark.parametrize("now", [b"\x00\x01binary now\xff", b"  \n"])
def test_a_failed_redo_of_a_changed_document_leaves_no_stale_summary(s1, tmp_path, small_moe, now):  # noqa: F811
    """A user trial: an edited document that now fails (binary, empty) kept the summary of
    its earlier text as ``a.md``, beside a ``failed`` record (a request file's answer, and a
    summaries.jsonl line, went). The stale summary goes; the other document's stays."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    old_b = (out / "b.md").read_text()
    (s1 / "a.txt").write_bytes(now)  # its redo fails
    code, output = run(*args)
    assert code == 1 and "failed a" in output, output
    assert not (out / "a.md").exists() and (out / "b.md").read_text() == old_b
    assert last_record(out, "a")["status"] == "failed"
    code, output = run(*args)  # a plain rerun leaves it failed (not recovered from the old output)
    assert code == 1 and "1 document failed in an earlier run" in output, output
    assert last_record(out, "a")["status"] == "failed" and read_status(out).failed == 1


def test_a_journal_of_an_older_version_keeps_working(s1, tmp_path, small_moe):  # noqa: F811
    """Records written before summaries recorded their source, model and prompt are taken
    as current, with one note; nothing is regenerated."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    old = ("made_from", "model", "prompt", "prompt_text", "run", "run_t", "mono", "host", "source")
    lines = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    (out / "journal.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k not in old}) + "\n"
                                               for r in lines))
    (s1 / "a.txt").write_text(NEW_A)  # unknowable now: no hash was recorded
    code, output = run(*args)
    assert code == 0, output
    assert "2 summaries from an older mlx-tier record no source hash, model or prompt: taken as current" in output
    assert done_lines(out) == Counter({"a": 1, "b": 1}) and report(out)["runs"][-1]["unstamped"] == 2
    st = read_status(out)
    assert (st.done, st.pending) == (2, 0)


def test_jsonl_output_replaces_the_line_of_a_redone_summary(s1, tmp_path, small_moe):  # noqa: F811
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5", "--format", "jsonl")
    assert run(*args)[0] == 0
    (s1 / "a.txt").write_text(NEW_A)
    assert run(*args)[0] == 0
    lines = [json.loads(x) for x in (out / "summaries.jsonl").read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == ["a", "b"]  # one line each, never two
    assert {x["id"]: x["summary"] for x in lines}["a"] == (out / "a.md").read_text().removesuffix("\n")


def test_summaries_jsonl_follows_the_md_files_whatever_the_format_of_later_runs(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: a redo by a `--format md` rerun left summaries.jsonl with the old summary,
    and a redo that failed kept its old line while report.json said failed. The file, once it
    exists, follows the .md files in every run; a failed document has no line."""
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5", "--format", "jsonl")[0] == 0
    (s1 / "a.txt").write_text(NEW_A)
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0  # --format md
    lines = {x["id"]: x for x in map(json.loads, (out / "summaries.jsonl").read_text().splitlines())}
    assert lines["a"]["summary"] == (out / "a.md").read_text().removesuffix("\n") and len(lines) == 2
    (s1 / "b.txt").write_text("   \n")  # its redo fails: empty document
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert code == 1 and "failed b: empty document (its summary of the earlier text was removed)" in output, output
    lines = [json.loads(x) for x in (out / "summaries.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines] == ["a"] and report(out)["totals"]["failed"] == 1
    assert not (out / "b.md").exists()  # nor its .md: the summary of its earlier text
    other = tmp_path / "md-only"  # a job that never asked for it gets none
    assert run(s1, "--out", other, "--model", small_moe, "--max-tokens", "5")[0] == 1
    assert not (other / "summaries.jsonl").exists()


@pytest.fixture(scope="module")
def other_moe(small_moe, tmp_path_factory):  # noqa: F811
    """Another model of the same shapes (another seed): same safetensors headers, other weights."""
    return make_mixtral(tmp_path_factory.mktemp("other") / "moe", small_moe.parent / "tokenizer", quantized=True,
                        vocab_size=320, seed=1)


def test_another_prompt_keeps_the_old_summaries_and_the_report_shows_the_mix(s1, tmp_path, small_moe):  # noqa: F811
    """The issue's example: the same OUT_DIR rerun with another --prompt and a new document."""
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    (s1 / "new.txt").write_text("A new document: the river floods and the farmer plants seed.")
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5", "--prompt", FRENCH)
    assert code == 0, output
    assert "keeping 2 summaries written with another prompt; redo them with --redo-changed" in output
    rep = report(out)
    docs = {d["id"]: d for d in rep["documents"]}
    assert docs["new"]["prompt"] == prompt_hash(FRENCH) != docs["a"]["prompt"] == docs["b"]["prompt"]
    assert {d["model"]["name"] for d in docs.values()} == {str(small_moe)}
    assert rep["prompts"][prompt_hash(FRENCH)] == FRENCH and rep["prompts"][docs["a"]["prompt"]].startswith("Summar")
    assert sorted(w["documents"] for w in rep["written_by"]) == [1, 2]
    assert rep["runs"][-1]["prompt"] == prompt_hash(FRENCH) and rep["runs"][-1]["kept_changed"] == 2
    assert rep["runs"][0]["prompt"] == docs["a"]["prompt"]
    r = runner.invoke(app, ["status", str(out)])
    words = " ".join(r.output.split())
    assert "written by" in words and "Translate the text below" in words, r.output
    page = (out / "report.html").read_text()
    assert 'id="written-by"' in page and FRENCH in page


def test_another_model_is_kept_then_redone_with_redo_changed(s1, tmp_path, small_moe, other_moe):  # noqa: F811
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("*.md")}
    code, output = run(s1, "--out", out, "--model", other_moe, "--max-tokens", "5")
    assert code == 0 and "keeping 2 summaries written with another model; redo them with --redo-changed" in output
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.md")} == before

    code, output = run(s1, "--out", out, "--model", other_moe, "--max-tokens", "5", "--redo-changed")
    assert code == 0 and "--redo-changed: redoing 2 summaries written with another model" in output, output
    rep = report(out)
    assert rep["runs"][-1]["redone_changed"] == 2 and "redone 2 written with other settings" in output
    weights = {d["model"]["weights"] for d in rep["documents"]}
    assert weights == {rep["runs"][-1]["model"]["weights"]} and len(rep["written_by"]) == 1
    assert read_status(out).redone_changed == 2
    code, output = run(s1, "--out", out, "--model", other_moe, "--max-tokens", "5", "--redo-changed")
    assert code == 0 and "redoing" not in output  # once redone, they are current


def test_a_change_of_a_few_weights_is_another_model(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A review: the fingerprint hashed each shard's header and 16 sampled blocks, so
    flipping every attention weight the blocks missed (a LoRA fused into the attention
    layers, the shapes unchanged) kept it, and a rerun took the old summaries as current.
    Every byte counts now; each file's digest is kept by its identity, so an unchanged
    file is read once, and one rewritten in place, its times set back, is read again."""
    import mlx.core as mx

    from mlx_tier.engine.checkpoint import weight_files
    from mlx_tier.engine.fingerprints import weights_fingerprint
    from mlx_tier.fsio import kept_sha256

    tuned = tmp_path / "tuned"
    shutil.copytree(small_moe, tuned)
    before = weights_fingerprint(tuned)
    assert all(kept_sha256(p) for p in weight_files(tuned))  # kept: the next fingerprint reads nothing
    (shard,) = weight_files(tuned)
    weights = mx.load(str(shard))
    name = next(k for k in sorted(weights) if "self_attn.o_proj.weight" in k)
    st = shard.stat()
    with open(shard, "r+b") as f:  # one weight of one layer, in place, its size and times kept
        header = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(header))
        f.seek(8 + header + meta[name]["data_offsets"][0])
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert kept_sha256(shard) is None  # its change time moved
    said = []
    monkeypatch.setattr("mlx_tier.engine.fingerprints.SAY_FINGERPRINT_BYTES", 1000)  # as a large checkpoint
    assert weights_fingerprint(tuned, said.append) != before
    assert len(said) == 1 and said[0].startswith("fingerprinting the model's weights (0.0 GiB, once")
    assert weights_fingerprint(tuned, said.append) == weights_fingerprint(tuned) and len(said) == 1  # kept now


def test_a_digest_cache_that_cannot_be_written_says_so_and_reads_once_a_process(tmp_path, small_moe,  # noqa: F811
                                                                                 monkeypatch):
    """A review: with a cache folder that cannot be written, each fingerprint read all the
    weights again under a message saying "once". The digest is kept for the process, and
    the message says the weights are read again each run, and why."""
    import hashlib

    from mlx_tier.engine import fingerprints

    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("MLX_TIER_CACHE", str(blocked))
    model = tmp_path / "model"
    shutil.copytree(small_moe, model)
    reads, real = [], hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda f, name: (reads.append(f.name), real(f, name))[1])
    monkeypatch.setattr(fingerprints, "SAY_FINGERPRINT_BYTES", 1000)
    said = []
    for _ in range(3):
        fingerprints.weights_fingerprint(model, said.append)
    assert len(reads) == 1 and len(said) == 1
    assert "again each run:" in said[0] and "cannot be written" in said[0] and "once" not in said[0]


def test_the_same_weights_elsewhere_are_the_same_model(s1, tmp_path, small_moe, other_moe):  # noqa: F811
    """The model is told by its weights' fingerprint, not by where it lies: a copy is the
    same model; another seed of the same shapes (identical headers) is not."""
    from mlx_tier.engine.fingerprints import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(small_moe, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(small_moe) != weights_fingerprint(other_moe)
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    code, output = run(s1, "--out", out, "--model", copy, "--max-tokens", "5")
    assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output


def test_summaries_of_the_first_fingerprint_version_stay_the_same_models(s1, tmp_path, small_moe,  # noqa: F811
                                                                         other_moe):
    """Records written before the fingerprints read every byte carry the first version's (bare
    hex); they are compared with the same model's fingerprints of that version, so an
    upgrade alone never says "written with another model" (and another model still is)."""
    from mlx_tier.engine.fingerprints import TAG, config_v1, weights_v1

    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    path = out / "journal.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()]
    for rec in records:  # as the first version wrote them
        if isinstance(rec.get("model"), dict) and rec["model"].get("weights"):
            assert rec["model"]["weights"].startswith(TAG) and rec["model"]["config"].startswith(TAG)
            rec["model"] = {"name": rec["model"]["name"], "weights": weights_v1(small_moe),
                            "config": config_v1(small_moe)}
            if "generation" in rec:
                rec["generation"]["context"] = None  # as the first version recorded a context not asked for
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert code == 0 and "another model" not in output and "skipping 2 documents" in output, output
    # a review: status, report.json and the page showed the old records and a new one as two models
    (s1 / "c.txt").write_text("Rivers run to the sea; the library opens at nine.")
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    (group,) = read_status(out).written_by
    assert group["documents"] == 3 and group["weights"].startswith(TAG), group
    assert len(json.loads((out / "report.json").read_text())["written_by"]) == 1
    from mlx_tier.monitor.view import build_view

    assert len({(d["weights"], tuple(sorted(d["options"].items()))) for d in build_view(out)["documents"]}) == 1
    r = runner.invoke(app, ["status", str(out)], env={"COLUMNS": "100"}, terminal_width=100)
    assert r.output.count("written by") <= 1 and "[v2-" not in r.output, r.output
    code, output = run(s1, "--out", out, "--model", other_moe, "--max-tokens", "5")
    assert "keeping 3 summaries written with another model" in output, output


def test_summaries_kept_with_another_max_tokens_show_as_a_mix_naming_it(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: two summaries kept from a `--max-tokens 4` run beside a new one written
    at 6 were shown as one model and prompt (status, report and page said no mix) while
    the run said "keeping 2 summaries written with another --max-tokens"."""
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "4")[0] == 0
    (s1 / "c.txt").write_text("A new document: the river floods and the farmer plants seed.")
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "6")
    assert code == 0 and "keeping 2 summaries written with another --max-tokens" in output, output
    groups = report(out)["written_by"]
    assert [(g["documents"], g["options"]["max_tokens"]) for g in groups] == [(2, 4), (1, 6)]
    words = " ".join(runner.invoke(app, ["status", str(out)], env={"COLUMNS": "250"}).output.split())
    assert "written by" in words and ", max_tokens 4" in words and ", max_tokens 6" in words, words
    page = (out / "report.html").read_text()
    assert 'id="written-by"' in page and "max_tokens 4" in page and "max_tokens 6" in page


def test_triage_of_earlier_summaries_from_plain_data():
    """The decision alone: stale (hash changed) is redone, or left done with retry_failed;
    another model or prompt is kept unless redo_changed; an unstamped record is current;
    a pending document with a summarised content reuses that summary (same settings only)."""
    here = Settings("m", "w1", "p1")
    made = lambda h: {"sha256": h, "size": 1, "mtime": 0.0, "hashed": "bytes"}  # noqa: E731
    records = {
        "stale": {"status": "done", "made_from": made("h0"), "model": {"name": "m", "weights": "w1"}, "prompt": "p1"},
        "prompt": {"status": "done", "made_from": made("h2"), "model": {"name": "m", "weights": "w1"}, "prompt": "p0"},
        "model": {"status": "done", "made_from": made("h3"), "model": {"name": "m", "weights": "w0"}, "prompt": "p1"},
        "old": {"status": "done"},
        "gone": {"status": "done", "made_from": made("h5"), "model": {"name": "m", "weights": "w1"}, "prompt": "p1"},
    }
    ids = ["stale", "prompt", "model", "old", "new", "twin"]
    outputs = {i: OutputState(True, True) for i in records}
    current = {"stale": "h1", "prompt": "h2", "model": "h3", "old": "h4", "new": "h5", "twin": "h3"}
    t = triage(ids, records, outputs, current=current, settings=here)
    assert (t.stale, t.kept_changed, t.unstamped, t.changed) == (["stale"], ["prompt", "model"], ["old"], [])
    assert t.pending == ["stale", "twin"] and sorted(t.done) == ["model", "old", "prompt"]
    assert t.reused == {"new": "gone"}  # "twin" has model's content, but model was written with other weights
    t = triage(ids, records, outputs, current=current, settings=here, redo_changed=True)
    assert t.changed == ["prompt", "model"] and t.pending == ["stale", "prompt", "model", "twin"]
    t = triage(ids, records, outputs, current=current, settings=here, retry_failed=True)
    assert t.stale == ["stale"] and "stale" in t.left and "stale" not in t.done  # pending for a plain rerun
    assert t.pending == [] and t.reused == {}
    by_name = Settings("m", None, "p1")  # the model not on this machine yet: compared by name
    assert not by_name.differs(records["model"]) and Settings("x", None, "p1").differences(records["model"]) == ["model"]
    # KV caches quantized (`kv_bits`): a stamped record without it was generated unquantized
    q8 = Settings("m", "w1", "p1", kv_bits=8)
    assert q8.differences(records["gone"]) == ["kv_bits"] and not q8.differs(records["old"])
    assert q8.fields()["kv_bits"] == 8 and "kv_bits" not in here.fields()
    assert here.differences({**records["gone"], "kv_bits": 8}) == ["kv_bits"]
    assert not q8.differs({**records["gone"], **q8.fields()})
    # generation options and the model's config: compared where the record keeps them
    gen = {"max_tokens": 16, "repetition_penalty": 1.1, "context": None}
    longer = Settings("m", "w1", "p1", config="c1", generation={**gen, "max_tokens": 40})
    assert longer.differences({**records["gone"], "generation": gen}) == ["max_tokens"]
    assert not longer.differs(records["gone"])  # an older record keeps neither
    assert longer.differences({**records["gone"], "model": {"name": "m", "weights": "w1", "config": "c0"}}) == ["model"]
    assert longer.fields()["model"]["config"] == "c1" and longer.fields()["generation"]["max_tokens"] == 40
    assert not longer.differs({**records["gone"], **longer.fields()})
    # the kernel and cast: compared where the record keeps them
    cpu = Settings("m", "w1", "p1", compute={"kernel": "cpu", "dtype": "float32"})
    assert cpu.differences({**records["gone"], "compute": {"kernel": "mlx", "dtype": "float32"}}) == ["kernel"]
    assert cpu.differences({**records["gone"], "compute": {"kernel": "cpu", "dtype": "as stored"}}) == ["kernel"]
    assert not cpu.differs(records["gone"]) and not cpu.differs({**records["gone"], **cpu.fields()})
    assert not here.differs({**records["gone"], **cpu.fields()})  # a run that does not know its kernel
    assert "compute" not in here.fields() and cpu.fields()["compute"] == {"kernel": "cpu", "dtype": "float32"}


def test_other_generation_options_are_kept_said_and_redone_on_request(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: `--max-tokens 16`, then `--max-tokens 40 --redo-changed --repetition-penalty 1.0
    --context 128` said "nothing to do" and kept the 16-token summaries. Each option that can change
    a summary is recorded with it; another value keeps them with a note, `--redo-changed` redoes them."""
    from mlx_tier.engine.checkpoint import context_length
    from mlx_tier.job import model_setup

    ctx = context_length(small_moe, model_setup.FALLBACK_CONTEXT)  # a context not asked for: the model's
    out = tmp_path / "out"
    base = (s1, "--out", out, "--model", small_moe)
    assert run(*base, "--max-tokens", "4")[0] == 0
    before = {p.name: p.read_bytes() for p in out.glob("*.md")}
    assert last_record(out, "a")["generation"] == {"max_tokens": 4, "repetition_penalty": 1.1, "context": ctx}
    code, output = run(*base, "--max-tokens", "6")
    assert code == 0 and "keeping 2 summaries written with another --max-tokens; redo them with --redo-changed" \
        in output, output
    assert {p.name: p.read_bytes() for p in out.glob("*.md")} == before
    code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0", "--redo-changed")
    assert code == 0 and "--redo-changed: redoing 2 summaries written with another --max-tokens or " \
        "--repetition-penalty" in output, output
    assert last_record(out, "b")["generation"] == {"max_tokens": 6, "repetition_penalty": 1.0, "context": ctx}
    assert last_record(out, "b")["output_tokens"] > 4  # written again, not kept
    code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0", "--context", "200")
    assert code == 0 and "written with another --context" in output, output  # the model's is 256
    code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0")
    assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output
    # a user trial: the model's own context asked for, or one beyond it (lowered to it), was
    # "another --context" beside the default, and report.json kept the 10000000 asked
    for asked in (str(ctx), "10000000"):
        code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0", "--context", asked)
        assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output
    old = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    for rec in old:  # as a version that recorded the context as asked wrote them
        if isinstance(rec.get("generation"), dict):
            rec["generation"]["context"] = None if rec.get("id") == "a" else 10_000_000
    (out / "journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0", "--context", str(ctx))
    assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output
    code, output = run(*base, "--max-tokens", "6", "--repetition-penalty", "1.0", "--context", "200",
                       "--redo-changed")
    assert code == 0 and "redoing 2 summaries written with another --context" in output, output
    assert json.loads((out / "report.json").read_text())["documents"][0]["generation"]["context"] == 200


def test_a_summary_written_by_another_kernel_is_kept_said_and_redone_on_request(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a summary written with `--kernel mlx` was kept as current by a run with the CPU
    kernel (`auto` here), whose logits are within a bound of MLX's, not equal. The kernel and
    cast are recorded with each summary as the run resolved them, compared before the load."""
    out = tmp_path / "out"
    base = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert run(*base, "--kernel", "mlx")[0] == 0
    assert last_record(out, "a")["compute"] == {"kernel": "mlx", "dtype": "float32"}
    before = {p.name: p.read_bytes() for p in out.glob("*.md")}
    code, output = run(*base)  # `auto`: the CPU kernel on this backend
    assert code == 0 and "keeping 2 summaries written with another --kernel; redo them with --redo-changed" \
        in output, output
    assert {p.name: p.read_bytes() for p in out.glob("*.md")} == before
    assert [g["options"]["kernel"] for g in report(out)["written_by"]] == ["mlx/float32"]
    code, output = run(*base, "--redo-changed")
    assert code == 0 and "redoing 2 summaries written with another --kernel" in output, output
    assert last_record(out, "b")["compute"] == {"kernel": "cpu", "dtype": "float32"}
    code, output = run(*base, "--kernel", "cpu")  # what `auto` resolved to: the same
    assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output


def test_a_model_whose_config_or_tokenizer_changed_is_another_model(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: a copy of the model with `num_experts_per_tok` edited in config.json (the
    weights as they were) counted as the same model and its stale summaries were kept silently.
    The same for the chat template; a file that does not decide tokens (a saved profile) is not
    a change."""
    copy = tmp_path / "copy"
    shutil.copytree(small_moe, copy)
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", copy, "--max-tokens", "4")[0] == 0
    (copy / "mlx-tier-profile.json").write_text("{}")
    code, output = run(s1, "--out", out, "--model", copy, "--max-tokens", "4")
    assert code == 0 and "keeping" not in output and "skipping 2 documents" in output, output
    config = json.loads((copy / "config.json").read_text())
    config["num_experts_per_tok"] = 1
    (copy / "config.json").write_text(json.dumps(config))
    code, output = run(s1, "--out", out, "--model", copy, "--max-tokens", "4")
    assert code == 0 and "keeping 2 summaries written with another model" in output, output
    code, output = run(s1, "--out", out, "--model", copy, "--max-tokens", "4", "--redo-changed")
    assert code == 0 and "redoing 2 summaries written with another model" in output, output
    tok = copy / "tokenizer_config.json"
    tok.write_text(json.dumps({**json.loads(tok.read_text()), "chat_template": "{{ messages[0]['content'] }}"}))
    code, output = run(s1, "--out", out, "--model", copy, "--max-tokens", "4")
    assert code == 0 and "keeping 2 summaries written with another model" in output, output


def _lose_done_record(out, doc_id):
    """A crash between a summary's rename and its ``done`` record: the record is not there."""
    path = out / "journal.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    keep = [x for x in lines if not (json.loads(x).get("id") == doc_id and json.loads(x).get("status") == "done")]
    assert len(keep) == len(lines) - 1
    path.write_text("".join(keep))


def test_a_recovered_summary_keeps_its_figures(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a summary recovered after a crash (renamed into place, its done record lost) was
    reported with 0 input and 0 output tokens, and the job's totals dropped its tokens. The writing
    record journalled before the rename carries the figures; the recovery takes them from it."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert run(*args)[0] == 0
    figures = lambda: {d["id"]: (d["input_tokens"], d["output_tokens"], d["finish_reason"])  # noqa: E731
                       for d in report(out)["documents"]}
    before, totals = figures(), report(out)["totals"]
    _lose_done_record(out, "b")
    (out / "report.json").unlink()  # the crashed run wrote none
    code, output = run(*args)
    assert code == 0 and "skipping 2 documents" in output, output
    assert figures() == before and before["b"][1] > 0
    assert (report(out)["totals"]["input_tokens"], report(out)["totals"]["output_tokens"]) == \
        (totals["input_tokens"], totals["output_tokens"])
    rec = last_record(out, "b")
    assert rec["recovered"] and (rec["input_tokens"], rec["output_tokens"]) == before["b"][:2]
    assert read_status(out).output_tokens == totals["output_tokens"]
    # the crashed run wrote b (its writing record says so), the rerun did not
    runs = report(out)["runs"]
    assert [(r["done"], "ended" in r) for r in runs] == [(2, True), (0, False)], runs
    assert runs[0]["output_tokens"] == totals["output_tokens"] == report(out)["totals"]["runs_output_tokens"]


def test_an_unrecorded_output_is_adopted_only_for_the_source_it_was_made_from(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: b's done record lost (a crash after the rename), then b.txt rewritten: the
    rerun recorded the old summary as b's, stamped with the new text's hash. Now the run journals
    what it is about to rename (source hash, output hash) first, and a rerun adopts an unrecorded
    output only when both still match: the same source is adopted as it is (not regenerated), a
    rewritten one is redone as stale, an output whose bytes no run wrote is redone."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert run(*args)[0] == 0
    old_b = (out / "b.md").read_bytes()
    made = last_record(out, "b")["made_from"]
    _lose_done_record(out, "b")
    code, output = run(*args)  # nothing changed: adopted, with what it was made from
    assert code == 0 and "skipping 2 documents" in output, output
    rec = last_record(out, "b")
    assert rec["recovered"] and rec["made_from"] == made and (out / "b.md").read_bytes() == old_b

    _lose_done_record(out, "b")
    (s1 / "b.txt").write_text("Sales report: the shop sold four hundred bicycles in May, up from ninety.")
    code, output = run(*args)
    assert code == 0 and "1 document changed since summarised (stale): redoing it" in output, output
    rec = last_record(out, "b")
    assert "recovered" not in rec and rec["made_from"]["sha256"] == hashlib.sha256((s1 / "b.txt").read_bytes()
                                                                                    ).hexdigest()

    _lose_done_record(out, "b")  # with --retry-failed: said, left for a plain rerun, not redone (a review)
    (s1 / "b.txt").write_text("Sales report, revised: the shop sold five hundred bicycles in May.")
    before = (out / "b.md").read_bytes()
    code, output = run(*args, "--retry-failed")
    assert code == 0 and "1 document changed since summarised (stale): left for a plain rerun" in output, output
    assert (out / "b.md").read_bytes() == before  # not regenerated, and not recorded as current:
    assert not [r for r in Journal(out).entries() if r.get("id") == "b" and r.get("status") == "done"]
    code, output = run(*args)
    assert code == 0 and "redoing it" in output and (out / "b.md").read_bytes() != before, output

    _lose_done_record(out, "a")
    (out / "a.md").write_text("not what any run wrote\n")
    code, output = run(*args)
    assert code == 0 and "recovered" not in last_record(out, "a") and last_record(out, "a")["status"] == "done"
    assert (out / "a.md").read_text() != "not what any run wrote\n"


def test_a_failed_document_fixed_since_is_tried_again(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: empty.txt failed ("empty document"), then got its text; a plain rerun kept it
    failed with the old reason. A failure stands for the content it failed on: a changed source
    is tried again; an unchanged one (a `touch`) stays failed until --retry-failed."""
    (s1 / "empty.txt").write_text("")
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert run(*args)[0] == 1 and last_record(out, "empty")["status"] == "failed"  # 1: a document failed
    os.utime(s1 / "empty.txt")
    code, output = run(*args)
    assert code == 1 and "1 document failed in an earlier run; not retried" in output, output
    (s1 / "empty.txt").write_text("The river flooded the farm; the farmer planted seed again in May.")
    code, output = run(*args)
    assert code == 0 and "1 document that failed in an earlier run changed since: trying it again" in output, output
    assert last_record(out, "empty")["status"] == "done" and (out / "empty.md").is_file()
    assert read_status(out).failed == 0


def test_summaries_of_documents_not_in_this_input_are_said(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: another input run into an existing output folder; the earlier summaries
    quietly dropped out of the job. Now one line says how many are left out (and a rename,
    whose summary moves with it, is not counted)."""
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "4")[0] == 0
    (s1 / "a.txt").rename(s1 / "c.txt")  # a rename: said as such, not as left out
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert code == 0 and "renamed or copied" in output and "not in this input" not in output, output
    s2 = tmp_path / "s2"
    s2.mkdir()
    (s2 / "d.txt").write_text("The orchard's apples ripened early after the warm spring.")
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "4")  # a later plain rerun
    assert code == 0 and "not in this input" not in output, output  # a's content is c's: not left out
    code, output = run(s2, "--out", out, "--model", small_moe, "--max-tokens", "4")
    assert code == 0 and "3 summaries of earlier runs are of documents not in this input (another input, " \
        "or removed): left on disk, not part of this job" in output, output
    assert (out / "a.md").is_file() and (out / "b.md").is_file() and (out / "d.md").is_file()


def test_the_config_fingerprint_covers_what_decides_tokens_only(tmp_path):
    """config_fingerprint: config, tokenizer files, tiktoken vocabularies and a remote-code
    tokenizer count; a README or a saved profile does not."""
    from mlx_tier.engine.fingerprints import config_fingerprint

    (tmp_path / "config.json").write_text('{"num_experts_per_tok": 2}')
    base = config_fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "mlx-tier-profile.json").write_text("{}")
    assert config_fingerprint(tmp_path) == base
    (tmp_path / "additional_chat_templates").mkdir()
    for name in ("vocab.tiktoken", "tokenization_custom.py", "tokenizer_config.json",
                 # a review: Mistral's tekken.json and other-named tokenizers were left out
                 "tekken.json", "spiece.model", "tokenizer.model.v3", "vocab.txt", "additional_chat_templates/rag.jinja"):
        (tmp_path / name).write_text("x")
        assert config_fingerprint(tmp_path) != base, name
        base = config_fingerprint(tmp_path)


def _lose_last_done_record(out, doc_id):
    """A crash after a redo's rename, before its ``done`` record: the earlier record stays last."""
    path = out / "journal.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    last = max(n for n, x in enumerate(lines) if json.loads(x).get("id") == doc_id
               and json.loads(x).get("status") == "done")
    path.write_text("".join(x for n, x in enumerate(lines) if n != last))


def test_a_redo_renamed_but_not_recorded_is_judged_by_what_it_was_made_from(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a redo of b (its text changed) renamed its new summary into place, then the run
    died before the done record; b's earlier record (the old text's) stayed last. With b.txt
    reverted to the old text the rerun kept the new text's summary as current. Now the writing
    record tells: reverted, it is stale and redone; not reverted, the new summary is adopted
    with the new text's hash (not written again)."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    old_text = (s1 / "b.txt").read_text()
    assert run(*args)[0] == 0
    old_summary = (out / "b.md").read_bytes()
    (s1 / "b.txt").write_text("A sales report: the shop sold four hundred bicycles in May, up from ninety.")
    assert run(*args)[0] == 0
    new_summary = (out / "b.md").read_bytes()
    assert new_summary != old_summary
    _lose_last_done_record(out, "b")
    code, output = run(*args)  # not reverted: the new summary is b's, adopted
    assert code == 0 and "skipping 2 documents" in output, output
    rec = last_record(out, "b")
    assert rec["recovered"] and rec["made_from"]["sha256"] == hashlib.sha256((s1 / "b.txt").read_bytes()).hexdigest()
    assert rec["model"]["name"] == str(small_moe) and rec["generation"]["max_tokens"] == 4
    assert (out / "b.md").read_bytes() == new_summary

    _lose_last_done_record(out, "b")  # the adoption's record
    _lose_last_done_record(out, "b")  # and the redo's: the old text's record is last again
    (s1 / "b.txt").write_text(old_text)  # reverted
    code, output = run(*args)
    assert code == 0 and "1 document changed since summarised (stale): redoing it" in output, output
    assert "recovered" not in last_record(out, "b") and (out / "b.md").read_bytes() != new_summary


def test_status_counts_the_documents_a_run_with_nothing_to_do_found(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a copy added and given its summary by a rerun with nothing to generate, or a
    document deleted, left `status` and the page counting the documents of the last run
    that generated (report.json counted the new ones)."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    shutil.copy(s1 / "b.txt", s1 / "c.txt")
    code, output = run(*args)
    assert code == 0 and not report(out)["runs"][-1]["loaded_model"], output
    st = read_status(out)
    assert (st.total, st.done, st.pending, st.state) == (3, 3, 0, "finished") == \
        (report(out)["totals"]["documents"], report(out)["totals"]["done"], 0, "finished")
    # a trial: its "this run" row described the run before (1 done, its redone count), where the
    # terminal and report.json's last run said nothing to do
    r = runner.invoke(app, ["status", str(out)])
    assert read_status(out).idle_rerun and "│ this run   │ nothing to do (model not loaded); the rows" in r.output
    assert "│ run before │ 2 done" in r.output and "output tok/s that run" in " ".join(r.output.split()), r.output
    (s1 / "a.txt").unlink()
    assert run(*args)[0] == 0
    assert (read_status(out).total, report(out)["totals"]["documents"]) == (2, 2)


def test_a_summary_edited_by_hand_is_kept_apart_before_its_redo(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: owl.md, edited by hand, was deleted when owl.txt was emptied (its redo
    failed: "empty document"). A summary no run wrote is moved to `edited/<id>.md` before a
    redo (or a copy) would remove or overwrite it; one the journal vouches for (written, or
    copied, by a run) is replaced as before. A review: a document `a.edited.txt` took the
    first name this used (`a.edited.md`); a `--retry-failed` run moved one it then left; a
    copied summary was taken for an edit."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    assert run(*args)[0] == 0
    (out / "a.md").write_text("MY HAND-WRITTEN NOTES - important\n")
    (s1 / "a.txt").write_text("")
    (s1 / "b.txt").write_text(NEW_A)  # b's own summary, as written: replaced by its redo
    code, output = run(*args, "--retry-failed")  # leaves stale summaries for a plain rerun: nothing moved
    assert "kept apart" not in output and (out / "a.md").read_text().startswith("MY HAND"), output
    (s1 / "a.edited.txt").write_text(OLD_A)  # a document whose output takes that name
    code, output = run(*args)
    assert code == 1 and "failed a: empty document" in output, output
    assert "1 summary edited since written, whose document or settings changed, kept apart before the redo: " \
        "edited/a.md" in output, output
    assert (out / "edited" / "a.md").read_text() == "MY HAND-WRITTEN NOTES - important\n" and not (out / "a.md").exists()
    assert last_record(out, "a.edited")["status"] == "done" and (out / "a.edited.md").exists()
    assert not (out / "edited" / "b.md").exists() and last_record(out, "b")["redo"] == "stale"
    (s1 / "a.txt").write_text(OLD_A)
    code, output = run(*args)  # a summarised again; the kept notes are left alone
    assert code == 0 and (out / "a.md").exists() and (out / "edited" / "a.md").read_text().startswith("MY HAND"), output
    (out / "a.md").write_text("more notes\n")  # edited again, then a changed to b's text: a copy would replace it
    (s1 / "a.txt").write_text(NEW_A)
    code, output = run(*args)
    assert code == 0 and "kept apart before the redo: edited/a-2.md" in output, output
    assert (out / "edited" / "a-2.md").read_text() == "more notes\n" and (out / "a.md").read_text() == (out / "b.md").read_text()
    (s1 / "a.txt").write_text("The mill burned down in October; the village rebuilt it by spring.")  # the copy: a run's
    code, output = run(*args)
    assert code == 0 and "kept apart" not in output and not (out / "edited" / "a-3.md").exists(), output

def test_a_document_that_could_not_be_read_is_tried_again_once_it_can(s1, tmp_path, small_moe, monkeypatch):  # noqa: F811
    """A user trial: a file removed mid-run failed ("cannot read: No such file or directory");
    restored, a plain rerun kept it failed ("not retried"): its failure recorded no hash to
    compare with. It records that the file could not be read: readable since, it is a change."""
    import mlx_tier.job.run as job_run

    gone, text = s1 / "gone.txt", "The harbour froze in January; the boats waited for the thaw."
    gone.write_text(text)
    found = job_run.find_documents

    def then_removed(*a, **k):  # found by the walk, gone before it is read
        docs = found(*a, **k)
        gone.unlink(missing_ok=True)
        return docs

    monkeypatch.setattr(job_run, "find_documents", then_removed)
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "4")
    code, output = run(*args)
    assert code == 1 and "cannot read" in last_record(out, "gone")["error"], output
    assert last_record(out, "gone")["made_from"] == {"unreadable": True}
    monkeypatch.setattr(job_run, "find_documents", found)
    code, output = run(*args)  # not there now: not part of the job, its failure stays
    assert code == 0 and "nothing to do" in output and last_record(out, "gone")["status"] == "failed", output
    gone.write_text(text)  # restored
    code, output = run(*args)
    assert "1 document that failed in an earlier run changed since: trying it again" in output, output
    assert last_record(out, "gone")["status"] == "done"


@pytest.mark.parametrize("changed", [("--max-tokens", "9"), ("--repetition-penalty", "1.3")])
def test_a_redo_for_other_settings_killed_after_its_rename_is_adopted_with_its_settings(
        s1, tmp_path, small_moe, changed):  # noqa: F811
    """A review: a `--redo-changed` run renamed its new summary into place and was killed before
    its done record. Its source unchanged, the next run kept the old done record, so report.json,
    status and a third run named the first settings for a summary of the second. The redo's
    writing record vouches for the bytes: the summary is adopted with its own settings."""
    out = tmp_path / "out"
    base = (s1, "--out", out, "--model", small_moe, "--batch-size", "1")
    assert run(*base, "--max-tokens", "5")[0] == 0
    assert run(*base, "--max-tokens", "5", *changed, "--redo-changed")[0] == 0
    second = (out / "a.md").read_bytes()
    lines = (out / "journal.jsonl").read_text().splitlines(keepends=True)
    k = max(n for n, line in enumerate(lines) if json.loads(line).get("id") == "a"
            and json.loads(line).get("status") == "done")
    (out / "journal.jsonl").write_text("".join(lines[:k] + lines[k + 1:]))  # killed between rename and record
    code, output = run(*base, "--max-tokens", "5")
    assert code == 0 and (out / "a.md").read_bytes() == second, output
    rec = last_record(out, "a")
    key, value = changed[0].removeprefix("--").replace("-", "_"), float(changed[1])
    assert rec["status"] == "done" and rec.get("recovered") and rec["generation"][key] == value, rec
    code, output = run(*base, "--max-tokens", "5")  # now judged as any summary of other settings
    assert code == 0 and "keeping 2 summaries written with another" in output, output  # b's too (1 before)


def test_a_stale_summary_a_retry_failed_run_leaves_is_pending_in_every_view(s1, tmp_path, small_moe):  # noqa: F811
    """A user trial: a.txt changed, b.txt fixed; `--retry-failed` said "1 document changed since
    summarised (stale): left for a plain rerun", then reported a as done, 0 pending, the job
    "finished" (status, report.json, the table). It is pending until a plain rerun redoes it,
    also when the retry run had nothing failed to retry (no run starts)."""
    out = tmp_path / "out"
    args = (s1, "--out", out, "--model", small_moe, "--max-tokens", "5")
    (s1 / "b.txt").write_bytes(bytes(range(256)) * 2)  # fails: binary
    assert run(*args)[0] == 1
    (s1 / "a.txt").write_text(NEW_A)
    (s1 / "b.txt").write_text("The library opens at nine; bees carry pollen to the flower and fruit.")
    code, output = run(*args, "--retry-failed")
    assert code == 0 and "(stale): left for a plain rerun" in output, output
    assert "job: 1 done (0 by earlier runs), 0 failed, 1 pending" in output, output
    docs = {d["id"]: d for d in report(out)["documents"]}
    assert (docs["a"]["status"], docs["a"].get("redo")) == ("pending", "stale") and docs["b"]["status"] == "done"
    assert report(out)["totals"]["pending"] == 1
    s = read_status(out)
    assert (s.done, s.pending, s.state) == (1, 1, "ended"), s
    (s1 / "a.txt").write_text(OLD_A + " And again.")  # still changed; nothing failed to retry now
    code, output = run(*args, "--retry-failed")
    assert code == 0 and "1 pending" in output and report(out)["totals"]["pending"] == 1, output
    s = read_status(out)
    assert (s.done, s.pending) == (1, 1), s
    code, output = run(*args)  # the plain rerun redoes it
    assert code == 0 and "0 pending" in output and last_record(out, "a")["status"] == "done", output
    assert read_status(out).pending == 0


def test_retry_failed_with_redo_changed_leaves_other_settings_done_in_every_view(s1, tmp_path, small_moe):  # noqa: F811
    """A review: `--retry-failed --redo-changed` with another --max-tokens put a's summary in the
    report as pending while status said done, and said "redoing 1 summary" that it left."""
    out = tmp_path / "out"
    (s1 / "b.txt").write_bytes(bytes(range(256)) * 2)  # fails: binary
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 1
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "6", "--retry-failed", "--redo-changed")
    assert code == 1 and "leaving 1 summary written with another --max-tokens for a rerun without " \
                         "--retry-failed" in output, output
    docs = {d["id"]: d["status"] for d in report(out)["documents"]}
    s = read_status(out)
    assert docs == {"a": "done", "b": "failed"} and (s.done, s.failed, s.pending) == (1, 1, 0), (docs, s)


def test_a_first_run_with_retry_failed_has_nothing_to_do_not_failures(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a first `--retry-failed` run (nothing failed yet) read in status as "0 failed as
    read; no model loaded"."""
    out = tmp_path / "out"
    code, output = run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5", "--retry-failed")
    assert code == 0 and "nothing to do (model not loaded)" in output, output
    assert not read_status(out).no_model
    said = " ".join(runner.invoke(app, ["status", str(out)]).output.split())
    assert "failed as read" not in said, said


def test_a_rerun_with_a_wrong_model_is_one_error_line(s1, tmp_path, small_moe):  # noqa: F811
    """A review: a rerun's notes ("1 document changed since summarised...") came before the
    error of a --model that is no model: bad input is one error line."""
    out = tmp_path / "out"
    assert run(s1, "--out", out, "--model", small_moe, "--max-tokens", "5")[0] == 0
    (s1 / "a.txt").write_text(NEW_A)
    (tmp_path / "empty-model").mkdir()
    r = runner.invoke(app, ["run", str(s1), "--out", str(out), "--model", str(tmp_path / "empty-model")])
    assert r.exit_code == 2 and r.output.startswith("error:") and "changed since" not in r.output, r.output


def test_a_long_documents_kept_calls_keep_their_name_when_the_kernel_is_recorded():
    """Calls kept for a long document are named by the kernel and cast the load chose (``computes``);
    the summary's ``compute`` field says the same again and must not rename them: a document stopped
    midway by an earlier version resumes from its last call."""
    from mlx_tier.job.kept_parts import call_identity

    computes = {"kernel": "cpu", "dtype": "float32", "dense_kernel": None, "attention_kernel": None}
    before = call_identity(Settings("m", "w1", "p1"), computes)
    assert call_identity(Settings("m", "w1", "p1", compute={"kernel": "cpu", "dtype": "float32"}), computes) == before


def test_each_earlier_versions_records_and_an_unknown_context_compare_as_the_same_settings():
    """A review: records of a version that hashed every weight byte without the v2- tag read
    as another model; a rerun before the model was on this machine said "another --context"
    (its context unknown); and the display grouping capped a 32768-token copy's records to an
    8192-token copy's context (keyed by weights alone)."""
    from dataclasses import replace

    from mlx_tier.outdir.journal import as_written

    gen = {"max_tokens": 4, "repetition_penalty": 1.1}
    here = Settings("m", "v2-aaaa", "p", config="v2-cccc", generation={**gen, "context": 256},
                    earlier=(("s1", "c1"), ("aaaa", "c1")), model_context=256)

    def rec(weights, config, context):
        return {"model": {"name": "m", "weights": weights, "config": config}, "prompt": "p",
                "generation": {**gen, "context": context}}

    assert here.differences(rec("s1", "c1", None)) == []  # the first version's
    assert here.differences(rec("aaaa", "c1", None)) == []  # every byte hashed, untagged
    assert here.differences(rec("aaaa", "c2", None)) == ["model"]
    assert here.differences(rec("v2-aaaa", "v2-cccc", 10_000_000)) == []  # asked beyond the model's: ran at 256
    assert here.differences(rec("v2-aaaa", "v2-cccc", 128)) == ["context"]
    unknown = replace(here, model_context=None, generation={**gen, "context": None})
    assert unknown.differences(rec("v2-aaaa", "v2-cccc", 256)) == []  # the model not here yet: not compared

    def new(config, context, old_config):
        return {"model": {"name": "m", "weights": "v2-w", "config": config, "context": context,
                          "earlier": [{"weights": "w1", "config": old_config}]},
                "generation": {**gen, "context": context}}

    big, small = new("v2-big", 32768, "c-big"), new("v2-small", 8192, "c-small")
    old = {"model": {"name": "m", "weights": "w1", "config": "c-big"}, "generation": {**gen, "context": None}}
    now = as_written([big, small, old])
    assert now(big) is big and now(small) is small  # this version's records: as written
    assert now(old)["model"]["config"] == "v2-big" and now(old)["generation"]["context"] == 32768
    assert old["model"]["weights"] == "w1" and old["generation"]["context"] is None  # not changed in place
