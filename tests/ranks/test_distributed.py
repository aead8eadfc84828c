"""One job over several ranks: every document is written by exactly one rank
(disjoint shares, exclusive claims), the job's journal view merges every rank's, a rank
killed with SIGKILL stops nobody and a rerun with another number of ranks completes
the job, and greedy outputs equal those of a one-process run.

The end-to-end tests start real ranks with ``mlx.launch`` (ring backend, localhost).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from support.jobs import WORDS, _short_context, small_moe  # noqa: F401 - fixtures
from support.output import command_after
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.errors import InputError
from mlx_tier.monitor.status import read_status
from mlx_tier.outdir.journal import Journal
from mlx_tier.outdir.layout import rank_journal_name, rank_journals
from mlx_tier.policy.eviction import PolicySpec
from mlx_tier.ranks.launcher import read_hosts
from mlx_tier.ranks.stealing import Claims, rank_order, shares, steal_from

runner = CliRunner()


def test_shares_are_disjoint_cover_everything_and_differ_by_one_at_most():
    for n, ranks in [(10, 3), (2, 3), (7, 1), (100, 4)]:
        todo = [f"d{i}" for i in range(n)]
        parts = shares(todo, ranks)
        assert len(parts) == ranks and sum(parts, []) == todo  # disjoint, in order, nothing lost
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert parts == shares(list(todo), ranks)  # deterministic: every rank computes the same


def test_a_rank_steals_from_the_end_of_the_slowest_started_share():
    todo = [f"d{i}" for i in range(9)]  # shares: d0-d2 | d3-d5 | d6-d8
    claimed = {"d0", "d1", "d2", "d3", "d4", "d6"}  # rank 1 has d5 left, rank 2 has d7, d8
    assert steal_from(todo, 0, 3, claimed) == ["d8", "d7"]
    assert steal_from(todo, 2, 3, claimed) == ["d5"]
    assert steal_from(todo, 0, 3, set(todo)) == []
    # Another case: rank 2 has not started (still loading its model): its share is left to it.
    assert steal_from(todo, 0, 3, {"d0", "d1", "d2", "d3"}) == ["d5", "d4"]
    assert steal_from(todo, 1, 3, {"d0", "d3", "d4", "d5"}) == ["d2", "d1"]


def test_an_unstarted_share_is_taken_from_its_end_once_started_shares_are_used_up():
    """A rank that died before claiming anything: the others finish its share."""
    todo = [f"d{i}" for i in range(9)]  # shares: d0-d2 | d3-d5 | d6-d8
    assert steal_from(todo, 0, 3, {"d0", "d1", "d2", "d3", "d4", "d5"}) == ["d8", "d7", "d6"]
    assert steal_from(todo, 0, 3, {"d0", "d1", "d2"}) == ["d5", "d4", "d3"]  # neither started: a tie, the lower rank
    assert steal_from(todo, 0, 3, {"d0", "d1", "d2", "d3", "d8"}) == ["d5", "d4"]  # d8: a thief's, not started
    claimed = {"d0", "d1", "d2", "d3", "d4", "d5"}
    pulls = rank_order(todo, 1, 3, lambda: set(claimed))(["d6", "d7", "d8"])
    assert list(pulls) == ["d8", "d7", "d6"]


def test_a_rank_tries_its_share_then_steals_from_the_slowest_end():
    todo = [f"d{i}" for i in range(9)]  # shares: d0-d2 | d3-d5 | d6-d8
    claimed: set[str] = set()
    pulls = rank_order(todo, 0, 3, lambda: set(claimed))(list(todo))
    assert [next(pulls) for _ in range(3)] == ["d0", "d1", "d2"]  # its own share first, in order
    claimed |= {"d0", "d1", "d2", "d3", "d4", "d6"}  # rank 1 has d5 left, rank 2 has d7, d8
    assert [next(pulls), next(pulls)] == ["d8", "d7"]  # the slowest's, from its end
    claimed |= {"d7", "d8"}
    assert list(pulls) == ["d5"]  # then the next slowest; then nothing is left
    # Another case: documents done meanwhile (not pending for this rank) are never tried.
    pulls = rank_order(todo, 2, 3, lambda: {"d6"})(["d1", "d2", "d4", "d7", "d8"])
    assert list(pulls) == ["d7", "d8", "d2", "d1", "d4"]  # own; rank 0's (2 left), from the end; rank 1's


def test_a_fast_rank_steals_a_slow_ranks_tail_and_every_document_goes_to_one_rank(tmp_path):
    """Two ranks pulling through their orders and one claims folder, rank 1 three times
    as fast: each document is claimed once, and rank 1 finishes rank 0's share from its end."""
    todo = [f"d{i:02d}" for i in range(12)]
    claims = [Claims(tmp_path, r) for r in range(2)]
    pulls = [rank_order(todo, r, 2, claims[r].claimed)(list(todo)) for r in range(2)]
    live = [True, True]
    step = 0
    while any(live):
        r = 0 if step % 4 == 0 else 1  # rank 0 takes a turn for every three of rank 1's
        step += 1
        for i in pulls[r] if live[r] else ():
            if claims[r].claim(i):
                break  # one document started per turn
        else:
            live[r] = False
    assert sorted(claims[0].taken + claims[1].taken) == todo  # each exactly once
    assert claims[0].taken == ["d00", "d01", "d02"]  # the slow rank got through the start of its share
    assert claims[1].taken == todo[6:] + ["d05", "d04", "d03"]  # the fast one: its own, then the tail


def test_a_rank_runs_the_job_runner_beside_the_launchers_lock(tmp_path, small_moe):  # noqa: F811
    """A rank is `run_job` with a part's Share: it runs while the launcher holds OUT_DIR,
    journals to its own file, and writes no start record, report.json or report.html."""
    from mlx_tier.errors import InputError as AnyInputError
    from mlx_tier.job.run import JobConfig, Share, run_job
    from mlx_tier.job.scheduler import GenerationConfig
    from mlx_tier.outdir.jobdir import JobDir

    ids = make_docs(tmp_path / "docs", 4)
    out = tmp_path / "out"
    (out / "ranks" / "r1").mkdir(parents=True)
    config = JobConfig(input=tmp_path / "docs", out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    name = rank_journal_name("r1", 1)
    claims = Claims(out / "ranks" / "r1" / "claims", 1)  # this is rank 1 of 2: its share doc02, doc03
    for i in ("doc00", "doc02"):  # rank 0 started its own doc00 and has stolen doc02
        Claims(out / "ranks" / "r1" / "claims", 0).claim(i)
    share = Share(claim=claims.claim, journal_name=name, part=True, order=rank_order(ids, 1, 2, claims.claimed))
    with JobDir(out):  # the launcher's lock
        with pytest.raises(AnyInputError, match="another process runs this rank"), \
                JobDir(out, name, part=True), JobDir(out, name, part=True):
            pass
        report = run_job(config, share=share)
    assert {r.id: r.status for r in report.results} == {"doc00": "pending", "doc01": "done", "doc02": "pending",
                                                         "doc03": "done"}  # its share's doc03, then stole doc01
    assert claims.taken == ["doc03", "doc01"] and report.runs[-1]["done"] == 2
    assert {r["id"] for r in Journal(out, name=name).entries() if r.get("status") == "done"} == {"doc01", "doc03"}
    assert sorted(p.name for p in out.iterdir()) == [".mlx-tier.lock", "doc01.md", "doc03.md", "ranks"]


def test_a_rank_finishes_the_share_of_a_rank_that_never_started(tmp_path, small_moe):  # noqa: F811
    """Rank 0 of 2 died before claiming anything: rank 1 does its own share, then
    rank 0's from the end; nothing is left to the next run."""
    from mlx_tier.job.run import JobConfig, Share, run_job
    from mlx_tier.job.scheduler import GenerationConfig
    from mlx_tier.outdir.jobdir import JobDir

    ids = make_docs(tmp_path / "docs", 4)
    out = tmp_path / "out"
    (out / "ranks" / "r1").mkdir(parents=True)
    config = JobConfig(input=tmp_path / "docs", out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    claims = Claims(out / "ranks" / "r1" / "claims", 1)
    share = Share(claim=claims.claim, journal_name=rank_journal_name("r1", 1), part=True,
                  order=rank_order(ids, 1, 2, claims.claimed))
    with JobDir(out):
        report = run_job(config, share=share)
    assert claims.taken == ["doc02", "doc03", "doc01", "doc00"]
    assert {r.status for r in report.results} == {"done"}


def test_a_rank_redoes_an_unrecorded_output_its_source_changed_since(tmp_path, small_moe):  # noqa: F811
    """A review: a crash after doc01's rename lost its done record, then doc01.txt was rewritten;
    the launcher decided to redo it, but each rank triaged it as recovered and none took it. A
    rank decides as its launcher does: the output made from the old text is pending, redone."""
    from mlx_tier.job.run import JobConfig, Share, run_job
    from mlx_tier.job.scheduler import GenerationConfig
    from mlx_tier.outdir.jobdir import JobDir

    ids = make_docs(tmp_path / "docs", 3)
    out = tmp_path / "out"
    config = JobConfig(input=tmp_path / "docs", out_dir=out, model=small_moe, generation=GenerationConfig(max_tokens=4))
    run_job(config)
    journal = out / "journal.jsonl"
    journal.write_text("".join(x for x in journal.read_text().splitlines(keepends=True)
                               if not (json.loads(x).get("id") == "doc01" and json.loads(x).get("status") == "done")))
    (tmp_path / "docs" / "doc01.txt").write_text("The ferry crossed the bay at dawn carrying forty cars.")
    (out / "ranks" / "r1").mkdir(parents=True)
    claims = Claims(out / "ranks" / "r1" / "claims", 1)
    name = rank_journal_name("r1", 1)
    share = Share(claim=claims.claim, journal_name=name, part=True, order=rank_order(ids, 1, 2, claims.claimed))
    with JobDir(out):  # the launcher's lock
        report = run_job(config, share=share)
    assert claims.taken == ["doc01"] and {r.id: r.status for r in report.results}["doc01"] == "done"
    done = [r for r in Journal(out, name=name).entries() if r.get("status") == "done"]
    assert [r["id"] for r in done] == ["doc01"] and "recovered" not in done[0]


def _claim_all(folder: str, rank: int, ids: list[str], queue) -> None:
    claims = Claims(Path(folder), rank)
    for i in ids:
        claims.claim(i)
    queue.put(claims.taken)


def test_claims_are_exclusive_between_processes_racing_for_the_same_documents(tmp_path):
    ids = [f"doc{i:03d}" for i in range(300)]
    queue = multiprocessing.get_context("spawn").Queue()
    procs = [multiprocessing.get_context("spawn").Process(target=_claim_all, args=(str(tmp_path), r, ids, queue))
             for r in range(3)]
    for p in procs:
        p.start()
    taken = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    assert Counter(i for t in taken for i in t) == Counter(ids)  # each document claimed exactly once
    assert Claims(tmp_path, 9).claim("doc000") is False
    assert Claims(tmp_path, 9).claimed() == set(ids)


def test_the_journal_view_merges_every_ranks_journal_in_time_order(tmp_path):
    out = tmp_path / "out"
    (out / "ranks" / "r1").mkdir(parents=True)
    lines = {
        out / "journal.jsonl": [{"event": "start", "input": "x", "ids": ["a", "b", "c"], "todo": ["a", "b", "c"],
                                 "started": 100.0, "pid": 1, "time": 100.0},
                                {"id": "c", "status": "done", "output": "c.md", "time": 300.0}],
        out / "ranks" / "r1" / "journal-0.jsonl": [{"id": "a", "status": "done", "output_tokens": 5, "time": 110.0},
                                                   {"id": "c", "status": "failed", "error": "x", "time": 120.0}],
        out / "ranks" / "r1" / "journal-1.jsonl": [{"id": "b", "status": "failed", "error": "oom", "time": 115.0}],
    }
    for path, recs in lines.items():
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    for doc in "ac":
        (out / f"{doc}.md").write_text("summary\n")
    assert len(rank_journals(out)) == 2
    records = Journal(out).records()
    assert {i: r["status"] for i, r in records.items()} == {"a": "done", "b": "failed", "c": "done"}  # c: later wins
    st = read_status(out)
    assert (st.total, st.done, st.failed, st.pending, st.output_tokens) == (3, 2, 1, 0, 5)


def test_hosts_file_and_option_errors_are_one_line_exit_2(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2"}]))
    with pytest.raises(InputError, match="host mac2 needs \"ips\""):
        read_hosts(hosts)
    hosts.write_text(json.dumps({"hosts": [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]}))
    assert read_hosts(hosts) == ["mac1", "mac2"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("text")
    base = ["run", str(docs), "--out", str(tmp_path / "out")]
    for extra, message in [(["--ranks", "2", "--hosts", str(hosts)], "give one"),
                           (["--ranks", "2", "--trace", str(tmp_path / "t.npz")], "without --ranks/--hosts"),
                           (["--ranks", "2", "--background"], "not supported"),
                           (["--ranks", "0"], "--ranks")]:
        r = runner.invoke(app, base + extra)
        assert r.exit_code == 2 and message in r.output, r.output
    tmp = tmp_path / "bad.json"
    tmp.write_text("{")
    r = runner.invoke(app, base + ["--hosts", str(tmp)])
    assert r.exit_code == 2 and "not a readable hosts file" in r.output
    assert not (tmp_path / "out").exists()  # nothing written for bad input
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ranks").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    r = runner.invoke(app, base + ["--ranks", "2"])
    assert r.exit_code == 2 and "is a link" in r.output, r.output
    assert not (tmp_path / "elsewhere").exists()  # invariant 3: nothing written outside OUT_DIR


def _settings(config, default=None) -> set[str]:
    """Dotted names of the settings (nested dataclass fields) of ``config``; with ``default``,
    only those where ``config`` differs from it."""
    names = set()
    for f in fields(config):
        mine = getattr(config, f.name)
        base = getattr(default, f.name) if default is not None else None
        if is_dataclass(mine) and not isinstance(mine, PolicySpec) and (default is None or is_dataclass(base)):
            names |= {f"{f.name}.{n}" for n in _settings(mine, base)}
        elif default is None or (mine is None) != (base is None) or (mine is not None and mine != base):
            names.add(f.name)  # (an MLX dtype cannot be compared with None)
    return names


def test_the_plan_carries_every_setting_to_the_ranks(tmp_path):
    import math

    import mlx.core as mx

    from mlx_tier.engine.load import TierConfig
    from mlx_tier.job.convert_limits import ConversionLimits
    from mlx_tier.job.run import JobConfig
    from mlx_tier.job.scheduler import GenerationConfig
    from mlx_tier.job.throttle import ThrottleConfig
    from mlx_tier.policy.cost_model import TransferCosts
    from mlx_tier.ranks.launcher import config_from_json, config_to_json

    configs = [
        JobConfig(input=Path("-"), out_dir=tmp_path, input_paths=("a.txt", "b c.pdf"), output_format="jsonl",
                  generation=GenerationConfig(max_tokens=7, repetition_penalty=1.3, prefill_step_size=64,
                                              schedule="paced", pool_tokens=256, prefill_batch=3),
                  throttle=ThrottleConfig(max_temp=80.0, max_tok_s=3.5, pause_on_battery=True, min_battery=20.0,
                                          poll_seconds=2.0, fair_duty=0.7, serious_duty=0.3, hot_duty=0.45,
                                          temp_hysteresis=2.0, battery_hysteresis=4.0, resume_after=9.0,
                                          stop_check_seconds=0.5),
                  tier=TierConfig(policy="lru", kernel="mlx", dtype=mx.bfloat16, layer_slots=(2, 3),
                                  read_threads=2, read_method="mmap", page_cache="drop", dense_kernel=False,
                                  attention_kernel=False, read_ahead=False,
                                  transfer_costs=TransferCosts(cpu_gbps=math.inf), host_cache_gb=0.5),
                  command="mlx-tier run - --out x < x/inputs.txt", nice=3, background_qos=True, save_profile=True,
                  memory_gb=3.5),
        JobConfig(input=tmp_path / "docs", out_dir=tmp_path / "out", model="org/repo", trace=tmp_path / "t.npz",
                  tier=TierConfig(cache_gb=1.5, slots_per_layer=4, prefetch=True, split="adaptive",
                                  profile=tmp_path / "p.json", prewarm=False),
                  generation=GenerationConfig("Say it \u00e9", batch_size=2, context=512, reuse_prefix=False,
                                              kv_bits=8),
                  retry_failed=True, follow_links=True, redo_changed=True,
                  conversion=ConversionLimits(memory_mb=512, seconds=30.0, seconds_per_mb=5.0, isolate=False)),
    ]
    default = JobConfig(input=Path("x"), out_dir=Path("y"))
    changed = _settings(configs[0], default) | _settings(configs[1], default)
    assert _settings(default) - changed == set(), "give each setting a value other than its default here"
    for config in configs:
        plan = json.loads(json.dumps(config_to_json(config)))  # what plan.json holds
        assert config_from_json(plan) == config
    assert config_from_json(json.loads(json.dumps(config_to_json(configs[0])))).tier.dtype == mx.bfloat16


# End to end: real ranks under mlx.launch.

def make_docs(folder: Path, n: int) -> list[str]:
    folder.mkdir()
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(9)) + ".")
    return [f"doc{i:02d}" for i in range(n)]


def mlx_tier(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_tier.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def done_records(out: Path) -> Counter:
    """``done`` records per document over the main and every rank journal (2 = written twice)."""
    paths = [out / "journal.jsonl", *rank_journals(out)]
    return Counter(r["id"] for p in paths if p.exists() for r in map(json.loads, p.read_text().splitlines())
                   if r.get("status") == "done")


def summaries(out: Path) -> dict[str, str]:
    return {p.stem: p.read_text() for p in out.glob("*.md")}


def test_two_ranks_write_every_document_once_and_match_one_process(tmp_path, small_moe):  # noqa: F811
    ids = make_docs(tmp_path / "docs", 6)
    common = ["--model", str(small_moe), "--max-tokens", "12", "--repetition-penalty", "1.0", "--batch-size", "1"]
    one = mlx_tier("run", str(tmp_path / "docs"), "--out", str(tmp_path / "one"), *common)
    assert one.returncode == 0, one.stderr
    two = mlx_tier("run", str(tmp_path / "docs"), "--out", str(tmp_path / "two"), "--ranks", "2", *common)
    assert two.returncode == 0, two.stdout + two.stderr
    out = tmp_path / "two"
    assert done_records(out) == Counter(ids)  # every document summarised exactly once
    assert summaries(out) == summaries(tmp_path / "one")  # greedy: the same text as one process
    report = json.loads((out / "report.json").read_text())
    ranks = report["runs"][-1]["ranks"]
    assert [a["rank"] for a in ranks] == [0, 1] and all(a["ended"] == "finished" for a in ranks)
    assert sum(a["done"] for a in ranks) == report["totals"]["done"] == 6
    assert sum(a["output_tokens"] for a in ranks) == report["totals"]["output_tokens"] > 0
    assert all(a["output_tok_per_s"] > 0 for a in ranks if a["done"])
    assert report["distributed"]["ranks"] == 2
    # each document's settings as one process records them: one "written by" group, not a split one
    one_report = json.loads((tmp_path / "one" / "report.json").read_text())
    recorded = ("model", "prompt", "kv_bits", "generation", "compute", "kept_tokens", "parts_kept")
    assert [{k: d[k] for k in recorded} for d in report["documents"]] == \
        [{k: d[k] for k in recorded} for d in one_report["documents"]]
    assert len(report["written_by"]) == len(one_report["written_by"]) == 1
    settings = ("model", "prompt", "kv_bits", "generation", "compute")  # and the run's record names them as well
    assert {k: report["runs"][-1].get(k) for k in settings} == {k: one_report["runs"][-1].get(k) for k in settings}
    assert report["runs"][-1]["generation"]["max_tokens"] == 12
    started = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines() if '"start"' in x]
    assert report["runs"][-1]["run"] == started[-1]["run"]  # the id its records carry (was none)
    st = read_status(out)
    assert (st.running, st.done, st.pending) == (False, 6, 0)
    # the run's records are its ranks' (by the launcher's run id), timed on the ranks' monotonic clocks
    assert st.finished_this_run == 6 and st.elapsed_seconds > 0 and st.documents_per_hour > 0
    run = report["runs"][-1]
    assert run["generation_seconds"] == max(a["generation_seconds"] for a in ranks) > 0
    assert "rank 0 (" in two.stdout and "rank 1 (" in two.stdout
    # a user trial: each rank split the whole machine's memory (22.3 GiB each of 23.5): the two share it
    said = " ".join((two.stdout + two.stderr).split())
    each = re.search(r"memory: ([\d.]+) GiB for each of the 2 ranks on this machine \(([\d.]+) GiB in all\)", said)
    assert each is not None and float(each[1]) == pytest.approx(float(each[2]) / 2, abs=0.01), two.stdout
    rank_totals = re.findall(r"\[rank \d\] memory: ([\d.]+) GiB", two.stdout + two.stderr)
    assert len(rank_totals) == 2 and all(float(t) == pytest.approx(float(each[1]), abs=0.01) for t in rank_totals)
    # a user trial: the ranks' speed lines and the rank summaries ran to 200 columns in a log file
    wide = [x for x in (two.stdout + two.stderr).splitlines() if len(x) > 80]
    assert not wide, wide
    assert not list((out / "ranks").glob("*/claims"))  # claims are dropped with their run
    plain = runner.invoke(app, ["run", str(tmp_path / "docs"), "--out", str(out), *common])  # one process now
    assert plain.exit_code == 0 and "nothing to do" in plain.output, plain.output
    assert done_records(out) == Counter(ids)


def _rank_pid(out: Path, rank: int) -> int | None:
    for path in rank_journals(out):
        if path.name == f"journal-{rank}.jsonl":
            for rec in map(json.loads, path.read_text().splitlines()):
                if rec.get("event") == "rank":
                    return rec["pid"]
    return None


def _claims(out: Path) -> dict[str, int]:
    """Document id -> the rank that claimed it, in the running run."""
    owners = {}
    for claim in out.glob("ranks/*/claims/*"):
        try:
            owners[claim.name] = json.loads(claim.read_text())["rank"]
        except (OSError, ValueError, KeyError):
            continue  # being written
    return owners


def _claimers(out: Path) -> set[int]:
    return set(_claims(out).values())


def _started_not_done(out: Path, rank: int) -> set[str]:
    """Documents ``rank`` has claimed and not yet recorded (in flight)."""
    return {i for i, r in _claims(out).items() if r == rank} - set(done_records(out))


def test_a_rank_killed_stops_nobody_and_a_rerun_with_three_ranks_completes(tmp_path, small_moe):  # noqa: F811
    ids = make_docs(tmp_path / "docs", 10)
    out = tmp_path / "out"
    args = ["run", str(tmp_path / "docs"), "--out", str(out), "--model", str(small_moe), "--max-tokens", "48",
            "--batch-size", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "mlx_tier.cli.main", *args, "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not (_rank_pid(out, 1) and done_records(out) and _started_not_done(out, 1)):  # rank 1 mid-document
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        os.kill(_rank_pid(out, 1), signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((out / "report.json").read_text())
    ranks = report["runs"][-1]["ranks"]
    assert ranks[1]["ended"] == "killed (SIGKILL)" and ranks[0]["ended"] == "finished", output
    assert report["totals"]["done"] + report["totals"]["pending"] == 10
    assert report["totals"]["pending"] >= 1 and proc.returncode == 3, output  # what rank 1 had started
    assert "resume with any number of ranks:" in " ".join(output.split())
    assert ranks[1]["done"] < 5, output  # the kill landed before rank 1 finished its share
    assert ranks[0]["done"] >= 5  # rank 0 went on, and took what rank 1 had not started
    finished = {i: (out / f"{i}.md").stat().st_mtime_ns for i in done_records(out)}

    hosts = tmp_path / "hosts.json"  # mlx.launch's hosts file; 127.0.0.1 runs without ssh
    hosts.write_text(json.dumps([{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 3))
    again = mlx_tier(*args, "--hosts", str(hosts))  # the rerun: 3 ranks
    assert again.returncode == 0, again.stdout + again.stderr
    assert done_records(out) == Counter(ids)  # one done record each (a kill after the rename: "recovered")
    assert {i: (out / f"{i}.md").stat().st_mtime_ns for i in finished} == finished  # never rewritten
    st = read_status(out)
    assert (st.done, st.pending, st.failed) == (10, 0, 0)
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert len(json.loads((out / "report.json").read_text())["runs"][-1]["ranks"]) == 3


@pytest.mark.slow
def test_demo_model_on_two_ranks_equals_one_process(tmp_path, demo_model):
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = ["The river flooded in spring. Farmers planted seeds after the water went down.",
             "Bees carry pollen between flowers, and the flowers become fruit.",
             "The town library opens at nine and lends books to every child in the valley.",
             "A storm closed the harbour for two days; the boats stayed tied to the pier."]
    for i, t in enumerate(texts):
        (docs / f"n{i}.txt").write_text(t)
    common = ["--max-tokens", "24", "--batch-size", "1", "--repetition-penalty", "1.0"]
    one = mlx_tier("run", str(docs), "--out", str(tmp_path / "one"), *common)
    two = mlx_tier("run", str(docs), "--out", str(tmp_path / "two"), "--ranks", "2", *common)
    assert one.returncode == 0 and two.returncode == 0, two.stdout + two.stderr
    assert done_records(tmp_path / "two") == Counter(f"n{i}" for i in range(4))
    assert summaries(tmp_path / "two") == summaries(tmp_path / "one")


def test_ctrl_c_stops_every_rank_after_the_summaries_being_written(tmp_path, small_moe):  # noqa: F811
    ids = make_docs(tmp_path / "docs", 8)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mlx_tier.cli.main", "run", str(tmp_path / "docs"), "--out",
                             str(out), "--model", str(small_moe), "--max-tokens", "48", "--batch-size", "1",
                             "--ranks", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while not (done_records(out) and _claimers(out) == {0, 1}):  # both ranks past loading, generating
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the launcher and every rank
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted; finished summaries are kept. Resume with:" in output, output
    assert command_after(output, "Resume with:").startswith("mlx-tier run "), output
    report = json.loads((out / "report.json").read_text())
    assert all(a["ended"] == "stopped (signal)" for a in report["runs"][-1]["ranks"]), output
    assert 0 < report["totals"]["done"] < len(ids) and report["totals"]["interrupted"]
    # mlx.launch, not interrupted, forwarded every rank's lines to the end: each summary finished is announced
    announced = {line.split("done: ")[1].split()[0] for line in output.splitlines() if "] done: " in line}
    assert announced == {i for i in ids if (out / f"{i}.md").exists()}, output
    assert "Traceback" not in output, output
    assert done_records(out) == Counter({i: 1 for i in ids if (out / f"{i}.md").exists()})
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_ranks_on_one_machine_share_the_memory_and_cache_given(tmp_path):
    """A review: `--memory-gb 16 --cache-gb 10 --ranks 2` gave each rank 8 GiB but the whole
    10 GiB cache. Both totals are split among the ranks of one machine; ranks elsewhere
    size their own machines."""
    from mlx_tier.engine.load import TierConfig
    from mlx_tier.job.run import JobConfig
    from mlx_tier.ranks.launcher import Launch, _shared_memory

    said = []
    reporter = type("R", (), {"message": lambda self, text: said.append(text)})()
    config = JobConfig(input=tmp_path, out_dir=tmp_path / "out", memory_gb=16.0, tier=TierConfig(cache_gb=10.0))
    each = _shared_memory(config, Launch(ranks=2), 2, reporter)
    assert (each.memory_gb, each.tier.cache_gb) == (8.0, 5.0)
    assert said == ["memory: 8.00 GiB for each of the 2 ranks on this machine (16.00 GiB in all), an expert cache "
                    "of 5.00 GiB each (10 GiB in all)"]
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]))
    assert _shared_memory(config, Launch(hosts=hosts), 2, reporter) is config
