"""The job's control path: the triage decides from plain data alone; a run
converts only the documents it runs, each when its turn comes (a rerun never converts
the documents already done, and `--background` converts nothing before detaching); a
document the process does not claim stays pending; the job folder is held while the
run works and freed after, whatever happens.
"""

import json
import os
import time
from dataclasses import replace

import pytest
from support.jobs import _short_context, make_docs, small_moe  # noqa: F401 - fixtures
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import InputError
from mlx_tier.job import documents
from mlx_tier.job.run import JobConfig, Share, run_job
from mlx_tier.job.scheduler import GenerationConfig
from mlx_tier.job.triage import OutputState, triage
from mlx_tier.outdir.jobdir import JobDir
from mlx_tier.outdir.layout import LOCK, lock_held

runner = CliRunner()
FILE, LINK = OutputState(True, True), OutputState(True, False)


def test_triage_sorts_documents_by_journal_state_alone():
    records = {"a": {"status": "done"}, "b": {"status": "failed", "error": "x"}, "c": {"status": "done"},
               "f": {"status": "failed"}}
    outputs = {"a": FILE, "d": FILE, "e": FILE, "f": LINK}
    t = triage(["a", "b", "c", "d", "e", "f"], records, outputs, attempted={"d", "f"})
    assert list(t.done) == ["a"]  # done and its output is there
    assert t.recovered == ["d"]  # an earlier run's output, unrecorded (crash after the rename)
    assert list(t.failed) == ["b", "f"]  # a link is never adopted as a finished output
    assert t.pending == ["c", "e"]  # c's output is gone; e's file is the user's own (never attempted)
    retry = triage(["a", "b", "c"], records, outputs, retry_failed=True)
    assert (list(retry.done), retry.pending, retry.left) == (["a"], ["b"], ["c"])


def test_job_dir_is_held_while_entered_and_left_clean_when_unused(tmp_path):
    out = tmp_path / "out"
    with JobDir(out) as job:
        assert job.created and lock_held(out) and job.journal_path == out / "journal.jsonl"
        with pytest.raises(InputError, match="another mlx-tier run"), JobDir(out):
            pass
        job.discard_if_unused()  # nothing written: the folder this run created goes
        assert not out.exists()
    (out / "keep").mkdir(parents=True)
    with JobDir(out) as job:
        (out / ".x.md.abcd_123.tmp").write_text("half")
        os.utime(out / ".x.md.abcd_123.tmp", (0, time.time() - 3600))  # younger ones may be a live writer's
    assert not lock_held(out) and not job.created
    with JobDir(out) as job:  # a killed run's temp file is removed on entering
        assert sorted(p.name for p in out.iterdir()) == [LOCK, "keep"]


@pytest.fixture
def conversions(monkeypatch):
    """The names of the files converted, in order."""
    seen = []
    real = documents.convert_file

    def counting(path, inside=None, **limits):
        seen.append(path.name)
        return real(path, inside, **limits)

    monkeypatch.setattr(documents, "convert_file", counting)
    return seen


def test_a_rerun_converts_only_the_documents_it_runs(tmp_path, small_moe, conversions):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    assert run_job(config).count("done") == 2
    assert sorted(conversions) == ["doc00.txt", "doc01.txt"]
    conversions.clear()
    (docs / "new.txt").write_text("river flood spring farmer.")
    report = run_job(config)
    assert report.count("done") == 3 and conversions == ["new.txt"]  # done ones are not read again
    conversions.clear()
    assert run_job(config).count("done") == 3 and conversions == []  # nothing to do: nothing converted
    converters = {d["id"]: d["converter"] for d in json.loads((out / "report.json").read_text())["documents"]}
    assert converters == dict.fromkeys(["doc00", "doc01", "new"], "text (utf-8)")  # kept from the journal


def test_a_document_not_claimed_stays_pending_unread_and_the_journal_is_the_shares(tmp_path, small_moe, conversions):  # noqa: F811
    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 3)
    config = JobConfig(input=docs, out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    report = run_job(config, share=Share(claim=lambda doc_id: doc_id != "doc01", journal_name="journal.r1.jsonl"))
    assert {r.id: r.status for r in report.results} == {"doc00": "done", "doc01": "pending", "doc02": "done"}
    assert "doc01.txt" not in conversions and not (out / "doc01.md").exists()
    assert (out / "journal.r1.jsonl").is_file() and not (out / "journal.jsonl").exists()  # this process's journal


def test_background_start_converts_nothing(tmp_path, monkeypatch, conversions):
    from mlx_tier.outdir import jobdir

    docs, out = tmp_path / "docs", tmp_path / "out"
    make_docs(docs, 2)
    started = []
    monkeypatch.setattr(jobdir, "start_background", lambda argv, out_dir, stdin: started.append(argv) or 4242)
    r = runner.invoke(app, ["run", str(docs), "--out", str(out), "--background"])
    assert r.exit_code == 0, r.output
    assert "pid 4242" in r.output and len(started) == 1 and conversions == []


def test_settings_reach_the_model_and_scheduler_whole(tmp_path, small_moe, monkeypatch):  # noqa: F811
    """Nothing downstream rebuilds a config: load gets JobConfig.tier itself, the
    Scheduler JobConfig.generation itself, and the policy spec made at the edge arrives."""
    import mlx_tier.job.run as jobs
    from mlx_tier.engine import load as tiered
    from mlx_tier.job.throttle import ThrottleConfig
    from mlx_tier.policy.eviction import PolicySpec

    seen = {}
    real_load, real_scheduler = tiered.load, jobs.Scheduler

    def load(path, cache_gb=None, *, config=None):
        seen["tier"], seen["cache_gb"] = config, cache_gb
        return real_load(path, cache_gb, config=config)

    class Scheduler(real_scheduler):
        def __init__(self, model, tokenizer, model_dir, model_context, config, longest_chars=None, probes=None,
                     typical_chars=None, documents=None, memory=None, samples=None, parts=None, max_tok_s=None):
            seen["generation"], seen["longest_chars"], seen["memory"] = config, longest_chars, memory
            seen["max_tok_s"] = max_tok_s
            super().__init__(model, tokenizer, model_dir, model_context, config, longest_chars, probes,
                             typical_chars, documents, memory, samples, parts, max_tok_s)
            seen["batch_size"] = self.batch_size

    monkeypatch.setattr(tiered, "load", load)
    monkeypatch.setattr(jobs, "Scheduler", Scheduler)
    docs = tmp_path / "docs"
    make_docs(docs, 2)
    spec = PolicySpec("lru")
    config = JobConfig(input=docs, out_dir=tmp_path / "out", model=small_moe,
                       tier=tiered.TierConfig(cache_gb=0.01, policy=spec),
                       generation=GenerationConfig(max_tokens=4, batch_size=2),
                       throttle=ThrottleConfig(max_tok_s=1e4))
    report = run_job(config)
    from mlx_tier.engine.dtypes import job_compute_dtype

    # whole, with only the job's dtype default filled in (float32 on the CPU backend), and the cache
    # cut to every expert's bytes where --cache-gb asks more (this model's experts are smaller)
    experts = report.as_dict()["memory_budget"]["experts"] / 2**30
    assert experts < 0.01 and seen["tier"].cache_gb == experts
    assert seen["tier"] == replace(config.tier, dtype=job_compute_dtype(), cache_gb=experts)
    assert seen["tier"].policy is spec
    assert seen["cache_gb"] is None
    assert seen["generation"] is config.generation and seen["batch_size"] == 2
    assert seen["max_tok_s"] == 1e4  # the throttle's cap, which the pools price
    assert seen["longest_chars"] == max(p.stat().st_size for p in docs.iterdir())  # sized without converting
    assert report.setup["policy"] == "lru" and report.setup["generation"]["batch_size"] == 2
    assert seen["memory"].cache == round(experts * 2**30) and seen["memory"].cache_given  # the run's split, whole


def test_library_errors_name_settings_and_the_cli_names_flags():
    from mlx_tier.cli.render import as_flags
    from mlx_tier.errors import ConfigError
    from mlx_tier.job.throttle import ThrottleConfig

    with pytest.raises(ConfigError) as e:
        ThrottleConfig(max_tok_s=0)
    assert e.value.field == "max_tok_s" and "--" not in str(e.value)
    assert as_flags(str(e.value)) == "--max-tok-s must be a positive number, got 0"
    assert as_flags("raise `context` or lower `max_tokens`") == "raise --context or lower --max-tokens"
    assert as_flags("`unknown_setting` stays") == "`unknown_setting` stays"


def test_progress_moves_inside_long_prompt_steps_and_predicted_beside_achieved(tmp_path, small_moe,  # noqa: F811
                                                                                monkeypatch):
    """Throughput schedule: between MoE layers of a prefill step the last activity is sent
    again (at most every LAYER_PROGRESS_SECONDS: 0 here), the prompt read advanced; the run
    announces its pools with a predicted documents/hour and reports the achieved one."""
    import mlx_tier.job.activity as activity
    import mlx_tier.job.run as jobs
    from mlx_tier.job.run import Reporter

    monkeypatch.setattr(activity, "LAYER_PROGRESS_SECONDS", 0.0)
    beats = []

    class Beat(activity.LayerProgress):
        def layer(self, layer, reading):
            before = self.sent
            super().layer(layer, reading)
            if self.sent != before:
                beats.append(layer)

    monkeypatch.setattr(jobs, "LayerProgress", Beat)

    class Seen(Reporter):
        def __init__(self):
            self.activities, self.messages = [], []

        def working(self, activity):
            self.activities.append(activity)

        def message(self, text):
            self.messages.append(text)

    docs = tmp_path / "docs"
    make_docs(docs, 3)
    seen = Seen()
    report = run_job(JobConfig(input=docs, out_dir=tmp_path / "out", model=small_moe,
                               generation=GenerationConfig(max_tokens=4, pool_tokens=16, prefill_batch=2)), seen)
    assert report.setup["generation"]["schedule"] == "throughput"
    steps = [a for a in seen.activities if a.reading is not None]
    assert beats and len(seen.activities) >= len(beats) + 1  # sent from inside prefill steps, beside the steps'
    assert any("predicted" in m and "documents/hour" in m for m in seen.messages)
    assert any(m.startswith("achieved") and "predicted" in m for m in seen.messages)
    assert report.setup["generation"]["achieved_docs_per_hour"] > 0 and steps
    assert report.setup["generation"]["chars_per_token"] > 1  # measured on the documents, not assumed
