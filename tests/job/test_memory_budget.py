"""`run` lives within the memory its process may use (a cgroup's limit here, scripted) or
the total `--memory-gb` gives: the split is said in the run's first lines and kept in
report.json with the peak resident set; a setting that cannot fit is one `error:` line
and exit code 2 before the model is loaded, naming the figures; the prompt step
shrinks when memory is short. `plan` reports the same limit and split.

The limit is a scripted :class:`~mlx_tier.engine.limits.MemoryLimit` standing in for a
cgroup (the real one: tests/job/test_memory_limit.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.engine import budgets, footprint, limits
from mlx_tier.engine.limits import MemoryLimit
from mlx_tier.job import batch_engine
from mlx_tier.tools import plan

GIB = 2**30
runner = CliRunner()
CGROUP = "cgroup v1 memory.limit_in_bytes"


@pytest.fixture
def one_gib_cgroup(monkeypatch):
    """This process lives in a 1 GiB memory cgroup with 0.9 GiB left (the host is larger)."""
    fake = MemoryLimit(GIB, int(0.9 * GIB), CGROUP, "/sys/fs/cgroup/memory/job", 24 * GIB, 20 * GIB)
    for module in (limits, budgets, batch_engine, plan):
        monkeypatch.setattr(module, "probe_limit", lambda proc=None: fake)
    return fake


@pytest.fixture
def docs(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "one.txt").write_text("The river floods every spring and the farmers plant after it recedes.")
    return d


def run(*args):
    r = runner.invoke(app, ["run", *map(str, args)])
    return r.exit_code, r.output


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_a_cache_that_cannot_fit_the_limit_is_refused_before_loading(one_gib_cgroup, docs, tmp_path, demo_model,
                                                                     monkeypatch):
    """The issue's example at small scale: --cache-gb 1.2 in a 2 GiB container was OOM-killed.
    (The demo: its 0.44 GiB of experts are more than 1 GiB leaves beside the rest; a cache
    above every expert is cut to them, so a model of tiny experts fits whatever is asked.)"""
    from mlx_tier.engine import load as tiered

    monkeypatch.setattr(tiered, "load", lambda *a, **k: pytest.fail("loaded a model that cannot fit"))
    code, output = run(docs, "--out", tmp_path / "o", "--model", demo_model, "--cache-gb", "0.4")
    assert code == 2, output
    (line,) = errors(output)
    assert f"--cache-gb 0.40 GiB does not fit in 1.00 GiB ({CGROUP}): the run also needs runtime" in line
    assert "GiB for the expert cache" in " ".join(output.split())
    assert not (tmp_path / "o").exists()


def test_a_total_above_the_limit_or_below_the_fixed_parts_is_refused(one_gib_cgroup, docs, tmp_path, tiny_moe):
    code, output = run(docs, "--out", tmp_path / "o", "--model", tiny_moe, "--memory-gb", "2")
    assert code == 2 and "--memory-gb 2 GiB is more than this process may use" in " ".join(output.split())
    assert f"({CGROUP}" in " ".join(output.split())
    code, output = run(docs, "--out", tmp_path / "o", "--model", tiny_moe, "--memory-gb", "0.3")
    assert code == 2 and len(errors(output)) == 1, output
    assert "0.30 GiB (--memory-gb) is too little for this model: it needs runtime" in " ".join(output.split())
    code, output = run(docs, "--out", tmp_path / "o", "--model", tiny_moe, "--memory-gb", "-1")
    assert code == 2 and "--memory-gb must be a finite positive number" in output
    assert not (tmp_path / "o").exists()


def test_default_run_takes_the_limit_and_says_so(one_gib_cgroup, docs, tmp_path, tiny_moe):
    out = tmp_path / "o"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4")
    assert code == 0, output
    text = " ".join(output.split())
    assert f"memory: 1.00 GiB ({CGROUP}) = runtime" in text and "memory: peak resident set" in text
    b = json.loads((out / "report.json").read_text())["memory_budget"]
    assert b["source"] == CGROUP and b["total"] == GIB and b["peak_rss"] > 0
    assert sum(b[k] for k in ("runtime", "dense_part", "experts", "KV", "workspace", "MLX_buffers", "margin")) == GIB


def test_a_cache_above_every_expert_gives_the_rest_to_the_kv_cache(one_gib_cgroup, docs, tmp_path, tiny_moe):
    """A user trial: `--cache-gb 5` on a model of 0.44 GiB of experts planned "experts 5.00 +
    KV 14.70" (19.48 without it); report.json's budget said 5 GiB, of which 0.44 were ever
    held. A cache holds every expert at most: the split and the cache say so."""
    out = tmp_path / "o"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4", "--cache-gb", "0.5")
    assert code == 0, output
    report = json.loads((out / "report.json").read_text())
    b, cache = report["memory_budget"], report["cache"]
    assert b["experts"] == cache["budget_bytes"] == cache["resident_bytes_max"] < 0.5 * GIB
    assert sum(b[k] for k in ("runtime", "dense_part", "experts", "KV", "workspace", "MLX_buffers", "margin")) == GIB


def test_plan_reports_the_limit_and_the_runs_split(one_gib_cgroup, tiny_moe):
    r = runner.invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert (p["memory_total"], p["memory_source"], p["memory_fit"]) == (GIB, CGROUP, None)
    assert p["memory_split"]["total"] <= GIB and p["memory_split"]["source"] == CGROUP
    r = runner.invoke(app, ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1"])
    assert "(cgroup v1" in r.output and "memory.limit_in_bytes)" in r.output  # the table wraps its cells
    r = runner.invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1",
                            "--memory-gb", "0.3"])
    p = json.loads(r.stdout)
    assert p["memory_split"] is None and "too little for this model" in p["memory_fit"]
    assert p["slots_per_layer"] == 0 and p["memory_source"] == "memory_gb"
    r = runner.invoke(app, ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1", "--memory-gb", "0.3"])
    assert "(--memory-gb;" in " ".join(r.output.split()) and "memory_gb" not in r.output  # the flag, as given


def test_a_plan_for_more_memory_than_here_says_so(one_gib_cgroup, tiny_moe):
    """A user trial: `plan --memory-gb 1e9` said "total / available 1000000000.0 /
    1000000000.0 GiB". A plan may be for another machine, so the total is as given (the
    split and the tiers are of it); the table says what this machine has available, and
    that a total beyond it is refused here."""
    args = ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1", "--memory-gb"]
    p = json.loads(runner.invoke(app, [*args, "1e5", "--json"]).stdout)  # (1e9: beyond any machine, refused)
    assert p["memory_total"] == int(1e5 * GIB)
    words = " ".join(runner.invoke(app, [*args, "1e5"]).output.replace("│", " ").split())
    from mlx_tier import TierConfig
    from mlx_tier.engine.budgets import probe
    from mlx_tier.engine.sizes import may_use_now, run_budget
    from mlx_tier.errors import BudgetError

    here = may_use_now(probe().host_available, probe().host_total) / GIB  # what `run --memory-gb` checks
    assert f"planned total 100000.0 GiB (--memory-gb; a run here may use {here:.1f} GiB: a plan for another " \
           "machine, `run` here refuses it)" in words, words
    words = " ".join(runner.invoke(app, [*args, "0.5"]).output.replace("│", " ").split())
    assert f"0.5 GiB (--memory-gb; a run here may use {here:.1f} GiB)" in words, words
    with pytest.raises(BudgetError, match="is more than this process may use"):  # and `run` does refuse it
        run_budget(tiny_moe, TierConfig(), 1e9, 512)


def test_plans_total_above_the_available_memory_says_why(one_gib_cgroup, tiny_moe):
    """A run's total is what its limit leaves plus what the process holds already (MLX
    loaded): above "available", which the plan says beside it (not with --memory-gb)."""
    args = ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1"]
    p = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    held = (p["memory_split"]["total"] - p["memory_available"]) / GIB
    assert held > 0.005
    words = " ".join(runner.invoke(app, args).output.split())
    assert f"(available 0.90 + {held:.2f} a process holds once MLX is loaded)" in words.replace("│ ", ""), words
    words = " ".join(runner.invoke(app, [*args, "--memory-gb", "0.8"]).output.split())
    assert "a process holds" not in words
    r = runner.invoke(app, [*args, "--context", "1"])  # no run takes such a context
    assert r.exit_code == 2 and "--context" in r.output
    for bad in ("inf", "nan", "0"):  # a user trial: `inf` was "must be positive", as `run` says otherwise
        r = runner.invoke(app, [*args, "--memory-gb", bad])
        assert r.exit_code == 2 and f"--memory-gb must be a finite positive number of GiB, got {bad}" in r.output
    for flag, bad in (("--disk-gbps", "-1"), ("--compute-gbps", "0"), ("--disk-gbps", "nan")):
        r = runner.invoke(app, [*args, flag, bad])  # a user trial: planned 364 documents/hour at 0 tok/s
        got = {"-1": "-1.0", "0": "0.0", "nan": "nan"}[bad]
        assert r.exit_code == 2 and f"{flag} must be a finite positive number of GB/s, got {got}" in r.output, r.output
    for flag, bad, most in (("--memory-gb", "1e30", "1,048,576 GiB"), ("--gpu-gb", "2e6", "1,048,576 GiB"),
                            ("--disk-gbps", "1e30", "100,000 GB/s"), ("--compute-gbps", "1e6", "100,000 GB/s")):
        r = runner.invoke(app, [*args, flag, bad])  # a user trial: a 31-digit GiB figure was planned for
        assert r.exit_code == 2 and f"{flag} {float(bad):g} is beyond any machine: at most {most}" in r.output, r.output


def test_plan_says_how_a_run_would_read_its_experts(one_gib_cgroup, tiny_moe, monkeypatch):
    """Through the page cache where it can hold the experts; around it (O_DIRECT) where they
    exceed all the process may hold, as `run` decides (mlx_tier.policy.reads)."""
    args = ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1"]
    assert json.loads(runner.invoke(app, [*args, "--json"]).stdout)["page_cache"] == "keep"
    assert "through the page cache" in " ".join(runner.invoke(app, args).output.split())
    monkeypatch.setattr(plan, "probe_limit", lambda proc=None: replace(one_gib_cgroup, total=2**10))
    assert json.loads(runner.invoke(app, [*args, "--json"]).stdout)["page_cache"] == "direct"
    words = " ".join(runner.invoke(app, args).output.split())
    assert "around the" in words and "O_DIRECT" in words and "through the page cache" not in words, words


def test_the_prompt_step_shrinks_when_memory_is_short(docs, tmp_path, tiny_moe, monkeypatch):
    """A total whose split leaves the prompt step less than --prefill-step: the run reads its
    prompt in steps of that size and finishes."""
    monkeypatch.setattr(footprint, "WORKSPACE_SHARE", 0.002)  # a tiny model's steps are small: make room short
    out = tmp_path / "o"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4", "--memory-gb", "2")
    assert code == 0, output
    report = json.loads((out / "report.json").read_text())
    step = report["memory_budget"]["prefill_step"]
    assert footprint.MIN_PROMPT_STEP <= step < 512 and report["generation"]["prefill_step_size"] == step
    assert report["totals"]["done"] == 1


def test_documents_starting_when_the_limit_is_nearly_spent_still_run(one_gib_cgroup, tmp_path, tiny_moe, monkeypatch):
    """Seen on the 8 GB synthetic in a 2 GiB cgroup: after the first summary every other document
    failed ("usable context of 0 tokens"), the group's page cache counted as used. A document that
    starts when the limit has nothing left gets the shortest sequence the split set aside."""
    spent = MemoryLimit(GIB, 1 << 20, CGROUP, "/sys/fs/cgroup/memory/job", 24 * GIB, 20 * GIB)
    monkeypatch.setattr(batch_engine, "probe_limit", lambda proc=None: spent)  # what sizes each new document
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"d{i}.txt").write_text(f"Document {i}: the library opens at nine and closes at five on weekdays.")
    out = tmp_path / "o"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4", "--batch-size", "1")
    assert code == 0, output
    assert json.loads((out / "report.json").read_text())["totals"]["done"] == 3


def test_a_throughput_run_under_a_cap_gives_slots_to_its_pools(one_gib_cgroup, docs, tmp_path, tiny_moe,
                                                                monkeypatch):
    """When the pool model prices fewer expert slots higher (tests/tools/test_pool_cache.py),
    the run loads that cache, gives the KV caches the rest and says so; the paced schedule
    (and a cache the user gives) keeps the split's."""
    from mlx_tier.tools import pool_cache
    from mlx_tier.tools.pools import PoolPlan

    asked = []

    def cheaper(model_dir, budget, prompt, output, documents, cap=None, max_tok_s=None):
        asked.append((prompt, output, documents, budget.cache_given))
        if budget.cache_given:
            return None  # as the real one does (tests/tools/test_pool_cache.py)
        plan = PoolPlan(64, 1, 2, 10.0, 1.0, 120.0, 100.0, "memory", prompt, output)
        return 1, plan, replace(plan, decode_pool=1, docs_per_hour=100.0)

    monkeypatch.setattr(pool_cache, "cache_for_pools", cheaper)
    out = tmp_path / "o"
    code, output = run(docs, "--out", out, "--model", tiny_moe, "--max-tokens", "4")
    assert code == 0, output
    text = " ".join(output.split())
    assert "(1 slot per layer) instead of" in text and "predicted 120 documents/hour against 100" in text
    assert asked and asked[0][1:] == (4, 1, False)  # the summary length, the pending documents, no cache given
    report = json.loads((out / "report.json").read_text())
    assert report["slots_per_layer"] == 1
    b = report["memory_budget"]
    assert sum(b[k] for k in ("runtime", "dense_part", "experts", "KV", "workspace", "MLX_buffers", "margin")) == GIB
    asked.clear()
    code, output = run(docs, "--out", tmp_path / "p", "--model", tiny_moe, "--max-tokens", "4", "--schedule", "paced")
    assert code == 0 and not asked and "per layer) instead of" not in output
    code, output = run(docs, "--out", tmp_path / "q", "--model", tiny_moe, "--max-tokens", "4", "--cache-gb", "0.001")
    assert code == 0 and asked[-1][3] and "per layer) instead of" not in output  # the user's cache kept


def test_plan_shows_the_cache_a_throughput_run_would_load(one_gib_cgroup, tiny_moe, monkeypatch):
    """`plan --doc-tokens` plans the job with the cache `run` would load (the same decision)."""
    from mlx_tier.tools import pool_cache
    from mlx_tier.tools.pools import PoolPlan

    plan_ = PoolPlan(64, 1, 2, 10.0, 1.0, 120.0, 100.0, "memory", 500, 32)
    monkeypatch.setattr(pool_cache, "cache_for_pools", lambda *a: (1, plan_, plan_))
    args = ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1", "--doc-tokens", "500"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["slots_per_layer"] == 1 and p["job"]["cache_for_pools"]["slots"] == 1
    assert p["memory_split"]["experts"] + p["memory_split"]["KV"] > p["memory_split"]["experts"] * 2
    # the decode steps' lent slots: the split's workspace they leave idle (MiBs: the tiny model's slot row is
    # ~27 KB), so as many as a layer's experts beyond its slots, the cap
    assert p["job"]["decode_slots"] == p["experts_per_layer"] - p["slots_per_layer"] > 0
    r = runner.invoke(app, args)
    assert "expert cache for pools" in r.output and "expert slots lent to decode steps" in r.output
    assert "1 slot per layer, not the split's" in " ".join(r.output.split())
    monkeypatch.setattr(footprint, "LEND_SLOTS", False)  # lending off: none shown, none priced
    r = runner.invoke(app, [*args, "--json"])
    assert json.loads(r.stdout)["job"]["decode_slots"] == 0
    assert "expert slots lent to decode steps" not in runner.invoke(app, args).output


def test_the_room_for_sequences_leaves_out_the_slots_lent_from_the_workspace(monkeypatch):
    """``sequence_room(budget, lent)``: bytes the expert cache holds as slots lent from the
    workspace are taken out of the resident set and given back to the limit's available
    memory before the split's reserve (the workspace among it) is taken, so they are not
    counted twice."""
    GIB = 2**30
    b = footprint.MemoryBudget(total=2 * GIB, source="memory_gb", runtime=0, dense=0, cache=0, kv=GIB,
                               workspace=GIB // 4, buffers=0, margin=0, prefill_step=128)

    class Proc:
        def memory_info(self):
            return type("M", (), {"rss": int(1.5 * GIB)})()

    monkeypatch.setattr(batch_engine.psutil, "Process", Proc)
    monkeypatch.setattr(batch_engine, "probe_limit", lambda: type("L", (), {"available": GIB // 2})())
    lent = GIB // 8
    assert batch_engine.sequence_room(b) == footprint.room_now(b, int(1.5 * GIB), GIB // 2) == GIB // 4
    assert batch_engine.sequence_room(b, lent) == footprint.room_now(b, int(1.5 * GIB) - lent, GIB // 2 + lent)
    assert batch_engine.sequence_room(b, lent) == GIB // 4 + lent


def test_a_throughput_run_of_a_model_larger_than_memory_reads_around_the_page_cache(one_gib_cgroup, docs, tmp_path,
                                                                                     tiny_moe, monkeypatch):
    """Its experts exceed all the process may hold: the page cache cannot keep them, so the
    reads go around it (O_DIRECT, said in one line and kept in report.json) where the
    filesystem allows, with the same summaries; the paced schedule keeps the cache."""
    from mlx_tier.engine.store import direct_reads_work

    code, output = run(docs, "--out", tmp_path / "kept", "--model", tiny_moe, "--max-tokens", "4")
    assert code == 0 and "reads:" not in output, output  # the tiny model fits in 1 GiB
    assert json.loads((tmp_path / "kept" / "report.json").read_text())["page_cache"] == "keep"
    small = replace(one_gib_cgroup, total=2**10)  # for the read mode only (the tiny experts: ~0.2 MB)
    monkeypatch.setattr(limits, "probe_limit", lambda proc=None: small)
    code, output = run(docs, "--out", tmp_path / "direct", "--model", tiny_moe, "--max-tokens", "4")
    assert code == 0, output
    text = " ".join(output.split())
    works = direct_reads_work(sorted(tiny_moe.glob("*.safetensors")))  # tmp filesystems may refuse it
    said = ("reads: around the page cache (O_DIRECT): its experts'" if works else
            "reads: through the page cache, though its experts'")
    assert said in text and "GiB this process may hold" in text
    report = json.loads((tmp_path / "direct" / "report.json").read_text())
    assert report["page_cache"] == ("direct" if works else "keep") and report["totals"]["done"] == 1
    assert (tmp_path / "direct" / "one.md").read_text() == (tmp_path / "kept" / "one.md").read_text()
    code, output = run(docs, "--out", tmp_path / "paced", "--model", tiny_moe, "--max-tokens", "4",
                       "--schedule", "paced")
    assert code == 0 and "reads:" not in output


def test_a_callers_own_read_settings_are_kept(one_gib_cgroup, tiny_moe, monkeypatch):
    """A review: with `TierConfig(read_method="mmap")` (the library's setting, no CLI flag) the
    job's choice of O_DIRECT made a TierConfig mmap cannot take, and a `page_cache="drop"` was
    replaced. The job chooses only where both were left at their defaults."""
    from mlx_tier import TierConfig
    from mlx_tier.job.activity import Reporter
    from mlx_tier.job.config import JobConfig
    from mlx_tier.job.model_setup import load_model

    monkeypatch.setattr(limits, "probe_limit", lambda proc=None: replace(one_gib_cgroup, total=2**10))
    for read_method, page_cache in (("mmap", "keep"), ("pread", "drop")):
        tier = TierConfig(kernel="cpu", read_method=read_method, page_cache=page_cache)
        loaded = load_model(JobConfig(input=".", out_dir="o", model=tiny_moe, tier=tier), Reporter())
        store = loaded.cache.store
        assert (store.read_method, store.page_cache) == (read_method, page_cache)


def test_plan_says_a_context_beyond_the_models(tiny_moe, tmp_path):
    """A user trial: `plan --context 99999999` priced a 4,291 GiB KV cache without a word
    that the model stops at 8,192 tokens (a run takes at most that)."""
    model = Path(shutil.copytree(tiny_moe, tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    args = ["plan", str(model), "--disk-gbps", "1", "--compute-gbps", "1", "--doc-tokens", "0"]
    words = " ".join(w for w in runner.invoke(app, [*args, "--context", "99999999"]).output.split() if w != "│")
    assert "(beyond the model's" in words and "4,096-token context: a run takes at most that)" in words, words
    assert json.loads(runner.invoke(app, [*args, "--json"]).stdout)["model_context"] == 4096
    assert "beyond the model's" not in " ".join(runner.invoke(app, [*args, "--context", "4096"]).output.split())
