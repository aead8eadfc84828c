"""benches/peers.py's logic, without the peers installed: skip lines, load guard, medians, table.

The invariant it guards: the side-by-side bench never prints a headline ratio
when the machine's load moved between runs, says how to install a missing
peer instead of failing, and fits its table in 80 columns.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def peers(load_bench):
    return load_bench("peers.py", "peers_bench")


def run(outcome="ok", **kw):
    return {"outcome": outcome, **kw}


def test_missing_peer_is_skipped_with_how_to_install(peers):
    line = peers.install_hint("nunspark", has_module=lambda m: False)
    assert line.startswith("nunspark: skipped, nunspark not installed")
    assert "pip install nunspark" in line
    # llama.cpp needs two modules: only the missing one is named
    line = peers.install_hint("llama.cpp repack", has_module=lambda m: m != "gguf")
    assert "gguf not installed" in line and "llama_cpp" not in line.split(":")[1]
    assert "pip install llama-cpp-python gguf" in line
    assert peers.install_hint("nunspark", has_module=lambda m: True) is None
    assert peers.install_hint("mlx-tier", has_module=lambda m: False) is None  # ours: never skipped


def test_load_guard_refuses_when_the_load_moved(peers):
    # The case: other jobs finished over three rounds (load 3.0 -> 0.5).
    assert peers.load_guard([3.0, 2.0, 0.5], tolerance=0.5) == (False, 2.5)
    ok, spread = peers.load_guard([1.0, 1.2, 1.1], tolerance=0.5)
    assert ok and spread == pytest.approx(0.2)
    assert peers.load_guard([2.0, 2.6], tolerance=0.5) == (False, pytest.approx(0.6))
    assert peers.load_guard([], tolerance=0.5) == (False, 0.0)


def test_run_load_prefers_others_runnable_tasks(peers):
    assert peers.run_load({"others": 0.4, "load1_start": 5.0, "load1_end": 7.0}) == 0.4
    assert peers.run_load({"others": None, "load1_start": 5.0, "load1_end": 7.0}) == 6.0
    assert peers.run_load({}) is None


def test_summary_takes_medians_of_completed_runs_and_counts_the_rest(peers):
    s = peers.summarise([run(tok_s=1.0, ttft=4.0), run(tok_s=3.0, ttft=2.0), run(tok_s=2.0, ttft=9.0),
                         run("OOM-killed while loading")])
    assert (s["runs"], s["ok"], s["oom"], s["over"], s["failed"]) == (4, 3, 1, 0, 0)
    assert s["tok_s"] == 2.0 and s["ttft"] == 4.0
    even = peers.summarise([run(tok_s=v) for v in (1.0, 2.0, 3.0, 4.0)])
    assert even["tok_s"] == 2.5
    timed = peers.summarise([run("over the 900 s limit while generating", tok_s_below=0.2, rate_so_far=0.1),
                             run("over the 900 s limit while generating", tok_s_below=0.4, rate_so_far=0.3),
                             run("failed while loading: boom")])
    # every stopped run was slower than its bound, so all were slower than the largest
    assert "tok_s" not in timed and timed["tok_s_below"] == 0.4 and timed["rate_so_far"] == pytest.approx(0.2)
    assert (timed["over"], timed["failed"]) == (2, 1)
    assert peers.outcome_cell(timed) == "0/3 2 over, 1 failed"
    # a bound is never pooled with completed runs: one completed run gives the medians
    mixed = peers.summarise([run(tok_s=1.5), run("over the 900 s limit while generating", tok_s_below=0.1)])
    assert mixed["tok_s"] == 1.5 and "tok_s_below" not in mixed and peers.outcome_cell(mixed) == "1/2 1 over"


def sample_summary(peers):
    return {
        ("mlx-tier", "warm"): peers.summarise([run(tok_s=2.0, ttft=3.0, hit_rate=0.8, peak_rss=1.5 * 2**30)] * 3),
        ("mlx-lm", "warm"): peers.summarise([run("OOM-killed while loading")] * 3),
        ("nunspark", "warm"): peers.summarise([run(tok_s=1.0, ttft=5.0, hit_rate=0.9, peak_rss=2**30)] * 3),
        ("llama.cpp repack", "warm"): peers.summarise([run("over the 1800 s limit while generating",
                                                           tok_s_below=0.21)], "over the limit"),
    }


def test_table_fits_80_columns_with_ratios_to_mlx_tier(peers):
    lines = peers.table(sample_summary(peers))
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    rows = {line[:16].strip(): line for line in lines[2:]}  # the engine column
    assert rows["mlx-tier"].endswith("1.00x") and " 2.00 " in rows["mlx-tier"] and "80%" in rows["mlx-tier"]
    assert rows["nunspark"].endswith("0.50x") and " 1.00 " in rows["nunspark"]
    assert "0/3 3 OOM" in rows["mlx-lm"] and rows["mlx-lm"].endswith("-")
    # stopped at the limit: a bound on tok/s and on the ratio, and the engine dropped
    assert " <0.21 " in rows["llama.cpp repack"] and rows["llama.cpp repack"].endswith("<0.10x")
    assert "0/1 1 over, dropped" in rows["llama.cpp repack"]
    # a fast engine's bound keeps to its 6 columns; completed rows print no "<"
    assert peers.speed_cells({"tok_s_below": 613.02}, 121.5) == ("<613", "<5.05x")
    assert peers.speed_cells({"tok_s": 135.6}, 121.5) == ("136", "1.12x")


def test_headline_only_when_the_load_held(peers):
    summary = sample_summary(peers)
    refused = peers.headline(summary, "warm", [3.0, 2.0, 0.5], 0.5, "load average")
    assert refused.startswith("no headline ratio: the load moved by 2.50")
    assert "0.50-3.00" in refused and "x" not in refused.split("moved")[0]
    printed = peers.headline(summary, "warm", [1.0, 1.1], 0.5, "load average")
    assert "mlx-tier 2.00 tok/s" in printed and "nunspark 0.50x" in printed and "mlx-lm 0/3 3 OOM" in printed
    assert "llama.cpp repack <0.10x (stopped at the limit, a bound)" in printed
    assert peers.headline({}, "warm", [1.0], 0.5, "x") == "no headline ratio: mlx-tier completed no run"


def test_outcome_names_oom_timeout_and_failure(peers):
    ev = [{"phase": "loading"}, {"phase": "generating"}]
    assert peers._outcome(ev + [{"phase": "done"}], False, 0, "", 0, 60) == "ok"
    assert peers._outcome(ev, False, 1, "", -9, 60) == "OOM-killed while generating"
    assert peers._outcome(ev, True, 0, "", -9, 60) == "over the 60 s limit while generating"
    assert peers._outcome(ev + [{"phase": "progress"}], True, 1, "", -9, 60) == "over the 60 s limit while generating"
    assert peers._outcome([], False, 0, "x\nValueError: bad\n", 1, 60) == "failed while starting: ValueError: bad"
    assert peers._events('{"phase": "loading"}\nnot json\n{"phase": "done"}') == [{"phase": "loading"},
                                                                                {"phase": "done"}]


def test_token_agreement_names_engines_that_differ(peers):
    runs = {("mlx-tier", "warm"): [run(token_ids=[1, 2, 3])], ("mlx-lm", "warm"): [run(token_ids=[1, 2, 3])],
            ("nunspark", "warm"): [run(token_ids=[1, 2, 4])], ("llama.cpp", "warm"): [run("OOM-killed")]}
    assert peers.token_agreement(runs) == "greedy tokens vs mlx-tier: mlx-lm same, nunspark differ"


def test_seed_caliber_and_bad_arguments(peers, tmp_path, capsys):
    args = peers.parse_args(["--caliber", "seed"])
    assert (args.runs, args.tokens, args.temps, args.run_limit_s) == (9, 256, ("warm",), 2400)
    assert peers.parse_args(["--caliber", "seed", "--run-limit-s", "60"]).run_limit_s == 60
    assert peers.parse_args([]).run_limit_s == 900
    assert peers.parse_args([]).temps == ("cold", "warm")
    assert peers.main(["--engines", "mlx-tier,vllm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown engine 'vllm'" in err
    assert peers.main(["--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert peers.main(["--temps", "hot"]) == 2


def test_dense_bytes_counts_everything_but_experts(peers, tmp_path):
    import mlx.core as mx

    mx.save_safetensors(str(tmp_path / "a.safetensors"), {
        "model.layers.0.mlp.switch_mlp.up_proj.weight": mx.zeros((4, 8, 2), dtype=mx.uint32),  # 256 B
        "model.layers.0.self_attn.q_proj.weight": mx.zeros((8, 2), dtype=mx.uint32),  # 64 B
        "model.norm.weight": mx.zeros((8,), dtype=mx.bfloat16),  # 16 B
    })
    assert peers.dense_bytes(tmp_path) == 80


def test_caliber_header_names_machine_cap_model_tokens_runs_and_load(peers, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 24,
                                                      "num_experts": 128, "num_experts_per_tok": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    runs = {("mlx-tier", "warm"): [run(load1_start=6.2, load1_end=7.0, others=4.0)],
            ("nunspark", "warm"): [run(load1_start=9.5, load1_end=12.2, others=10.0)]}
    args = peers.parse_args(["--caliber", "seed", "--cap-gb", "2"])
    fp = peers.fingerprint(args, tmp_path, ["mlx-tier", "nunspark"], [1, 2, 3], True, 0.8, 1_240_000_000)
    meta = {"machine": "x86_64 Linux, 2 cores, 24 GiB, MLX cpu", "model": peers.model_meta(tmp_path)}
    lines = peers.caliber_lines(fp, meta, runs)
    text = " ".join(line.strip() for line in lines)
    assert all(len(line) <= 80 for line in lines)
    assert "cap: 2 GiB cgroup v1" in text and "cores" in text
    assert "24 layers x 128 experts, top-8" in text
    assert "256 greedy tokens; 9 runs x warm" in text and "each run stopped at 2400 s" in text
    assert "load average (1 min) 6.2-12.2" in text and "others' runnable tasks 4.0-10.0" in text
    one = peers.parse_args(["--cap-gb", "0", "--runs", "1"])
    uncapped = " ".join(peers.caliber_lines(peers.fingerprint(one, tmp_path, ["mlx-tier"], [1], False, 0.8, 1),
                                            meta, runs))
    assert "NONE (runs uncapped)" in uncapped and "the cap" not in uncapped.split("cap:")[1] and "1 run x" in uncapped


# ------------------------------------------- resumable runs (benches/peers_runs.py)
@pytest.fixture()
def runs_mod(peers):
    import peers_runs

    return peers_runs


class ScriptedRunner:
    """Stands in for ``run_once``: each engine's outcomes in turn (``enqueue``); records what it was asked to run.

    An outcome ``"interrupt"`` raises KeyboardInterrupt, as Ctrl-C during that run would.
    """

    def __init__(self):
        self.queues: dict[str, list[dict]] = {}
        self.calls: list[tuple[str, int]] = []

    def enqueue(self, engine: str, *runs: dict) -> None:
        self.queues.setdefault(engine, []).extend(runs)

    def __call__(self, spec, cgroup, limit_s, tick) -> dict:
        self.calls.append((spec.engine, spec.max_tokens))
        tick(1.0, {"phase": "generating"})
        result = self.queues[spec.engine].pop(0) if self.queues.get(spec.engine) else run(tok_s=1.0, wall_s=5.0)
        if result["outcome"] == "interrupt":
            raise KeyboardInterrupt
        return {"engine": spec.engine, **result}


def specs_for(*engines, tokens=8):
    from peers_engines import RunSpec

    return {e: RunSpec(engine=e, model="m", prompt=(1, 2), max_tokens=tokens) for e in engines}


def test_plan_interleaves_rotating_the_engine_order(runs_mod):
    plan = runs_mod.slots(("a", "b", "c"), ("cold", "warm"), 2)
    assert [(s.round, s.engine, s.temp) for s in plan[:6]] == [
        (0, "a", "cold"), (0, "a", "warm"), (0, "b", "cold"), (0, "b", "warm"), (0, "c", "cold"), (0, "c", "warm")]
    assert [s.engine for s in plan[6::2]] == ["b", "c", "a"]
    assert [s.index for s in plan] == list(range(12))
    seed = runs_mod.slots(tuple("abcde"), ("warm",), 9)
    assert len(seed) == 45 and [s.engine for s in seed[40:]] == list("deabc")  # round 9 starts at the 4th


def test_resume_skips_the_runs_recorded_and_continues_the_order(peers, runs_mod, tmp_path):
    plan = runs_mod.slots(("a", "b"), ("cold",), 3)
    runs_mod.open_results(tmp_path, {"k": 1})
    first = ScriptedRunner()
    first.enqueue("a", run(tok_s=2.0), run("interrupt"))  # Ctrl-C in a's second run (slot 3)
    with pytest.raises(KeyboardInterrupt):
        peers.run_plan(specs_for("a", "b"), plan, tmp_path, [], None, 60, ("cold",), runner=first,
                       drop_pages=lambda files: None)
    assert [r["slot"] for r in runs_mod.load_runs(tmp_path)] == [0, 1, 2]  # only the run in flight is lost
    # a crash mid-write leaves a cut line: ignored, that run is simply run again
    with open(tmp_path / "runs.jsonl", "a") as fh:
        fh.write('{"engine": "a", "slot": 3, "outc')
    second = ScriptedRunner()
    recorded = peers.run_plan(specs_for("a", "b"), plan, tmp_path, [], None, 60, ("cold",), runner=second,
                              drop_pages=lambda files: None)
    assert second.calls == [("a", 8), ("a", 8), ("b", 8)]  # slots 3, 4, 5: end of round 1 (b, a), round 2
    assert sorted(r["slot"] for r in recorded) == list(range(6))
    assert [r["slot"] for r in runs_mod.load_runs(tmp_path)] == list(range(6))
    assert runs_mod.pending(plan, recorded) == []
    third = ScriptedRunner()  # nothing left: runs nothing
    peers.run_plan(specs_for("a", "b"), plan, tmp_path, [], None, 60, ("cold",), runner=third,
                   drop_pages=lambda files: None)
    assert third.calls == []


def test_warm_only_primes_each_engine_still_to_run(peers, runs_mod, tmp_path):
    plan = runs_mod.slots(("a", "b"), ("warm",), 2)
    runs_mod.open_results(tmp_path, {"k": 1})
    runs_mod.append_run(tmp_path, {"engine": "a", "slot": 0, "temp": "warm", "outcome": "ok", "tok_s": 1.0})
    runs_mod.append_run(tmp_path, {"engine": "b", "slot": 1, "temp": "warm", "outcome": "OOM-killed while loading"})
    runner = ScriptedRunner()
    peers.run_plan(specs_for("a", "b", tokens=256), plan, tmp_path, [], None, 60, ("warm",), runner=runner)
    # b was OOM-killed in its first run: neither primed nor run again; priming is 16 tokens, not recorded
    assert runner.calls == [("a", 16), ("a", 256)]
    assert len(runs_mod.load_runs(tmp_path)) == 3


def test_under_a_cap_every_file_is_evicted_once_before_priming(peers, runs_mod, tmp_path):
    # A page stays charged to the cgroup that first read it: a GGUF written just before the pass was
    # outside the 2 GiB cap, and llama.cpp's mmap reached a peak RSS of 4.85 GiB under it.
    plan = runs_mod.slots(("a", "b"), ("warm",), 1)
    events = []

    def runner(spec, cgroup, limit_s, tick):
        events.append(("run", spec.engine, spec.max_tokens))
        return {"engine": spec.engine, **run(tok_s=1.0)}

    files = [tmp_path / "model.safetensors", tmp_path / "model.gguf"]
    for folder, cgroup in ((tmp_path / "capped", object()), (tmp_path / "uncapped", None)):
        runs_mod.open_results(folder, {"k": 1})
        events.clear()
        peers.run_plan(specs_for("a", "b", tokens=256), plan, folder, files, cgroup, 60, ("warm",), runner=runner,
                       drop_pages=lambda fs: events.append(("evict", tuple(fs))))
        evicted = [("evict", tuple(files))] if cgroup is not None else []
        assert events == [*evicted, ("run", "a", 16), ("run", "b", 16), ("run", "a", 256), ("run", "b", 256)]
    events.clear()  # the pass complete: nothing evicted, nothing run
    peers.run_plan(specs_for("a", "b"), plan, tmp_path / "capped", files, object(), 60, ("warm",), runner=runner,
                   drop_pages=lambda fs: events.append(("evict", tuple(fs))))
    assert events == []


def test_load_guard_counts_only_runs_that_give_a_rate(peers, runs_mod, tmp_path, capsys):
    # Seed pass, 2026-12-01: mlx-lm OOM-killed while loading in 2 s (others 0.00) was the low end of the
    # spread; a run with no rate enters no ratio. A stopped run's bound does enter one.
    engines = ("mlx-tier", "mlx-lm", "nunspark", "llama.cpp")
    runs_mod.open_results(tmp_path, {"engines": list(engines), "temps": ["warm"], "runs": 2, "tokens": 256,
                                     "run_limit_s": 2400})
    records = [("mlx-tier", run(tok_s=6.8, others=0.4)), ("mlx-lm", run("OOM-killed while loading", others=0.0)),
               ("nunspark", run(tok_s=0.6, others=0.1)), ("llama.cpp", run(tok_s=0.25, others=0.3)),
               ("mlx-tier", run(tok_s=6.6, others=0.5)), ("nunspark", run(tok_s=0.6, others=0.1)),
               ("llama.cpp", run("over the 2400 s limit while generating", tok_s_below=0.1, others=0.2))]
    for slot, (engine, r) in enumerate(records):
        runs_mod.append_run(tmp_path, {"engine": engine, "slot": slot, "round": 0, "temp": "warm", **r})
    assert peers.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "headline (warm, load moved 0.40 <= 0.50): mlx-tier 6.70 tok/s" in out
    runs_mod.append_run(tmp_path, {"engine": "mlx-tier", "slot": 7, "round": 1, "temp": "warm",
                                   **run(tok_s=7.0, others=0.7)})  # a run with a rate does move it
    assert peers.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert "no headline ratio: the load moved by 0.60" in " ".join(capsys.readouterr().out.split())


def test_fingerprint_mismatch_is_refused_in_one_line(runs_mod, tmp_path):
    fp = {"tokens": 256, "cap_gb": 2.0, "caliber": "seed"}
    assert runs_mod.open_results(tmp_path, fp) == []
    runs_mod.append_run(tmp_path, {"engine": "a", "slot": 0, "outcome": "ok"})
    assert runs_mod.open_results(tmp_path, dict(fp)) == [{"engine": "a", "slot": 0, "outcome": "ok"}]
    with pytest.raises(runs_mod.Mismatch) as e:
        runs_mod.open_results(tmp_path, {**fp, "tokens": 32})
    assert "(tokens: 256 there, 32 here)" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(runs_mod.Mismatch, match="cap_gb: 2.0 there, 0 here"):
        runs_mod.open_results(tmp_path, {**fp, "cap_gb": 0})


def test_main_refuses_another_commands_out_folder_with_exit_2(peers, tiny_moe, tmp_path, capsys):
    argv = ["--model", str(tiny_moe), "--engines", "mlx-tier", "--cap-gb", "0", "--runs", "2", "--out",
            str(tmp_path / "out"), "--cache-gb", "0.5", "--budget-gb", "1"]
    args = peers.parse_args(argv + ["--tokens", "16"])
    fp = peers.fingerprint(args, tiny_moe.resolve(), ["mlx-tier"], peers.prompt_ids(tiny_moe, 32), False, 0.5,
                           10**9)
    import peers_runs

    peers_runs.open_results(tmp_path / "out", fp)
    assert peers.main(argv + ["--tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(tokens: 16 there, 8 here)" in err
    assert not (tmp_path / "out" / "runs.jsonl").exists()
    assert peers.main(["--report-only", "--out", str(tmp_path / "nothing")]) == 2
    assert "--report-only needs --out" in capsys.readouterr().err


def test_time_limited_run_is_stopped_and_kept_as_a_bound(peers, runs_mod):
    # a worker that reports its first token and 8 more, then stalls (as llama.cpp with mmap under the cap)
    script = ("import json, time\n"
              "for e in [{'phase': 'loading'}, {'phase': 'generating', 'load_s': 0.1},\n"
              "          {'phase': 'progress', 'tokens': 1, 'ttft': 0.2, 'decode_s': 0.0},\n"
              "          {'phase': 'progress', 'tokens': 9, 'ttft': 0.2, 'decode_s': 0.4}]:\n"
              "    print(json.dumps(e), flush=True)\n"
              "time.sleep(30)\n")
    ticks = []
    w, code = runs_mod.watch([sys.executable, "-c", script], 1.5, lambda s, e: ticks.append(e.get("phase")))
    assert w.stopped and code != 0 and 1.5 <= w.wall_s < 10 and 0 < w.decode_s <= w.wall_s
    assert "progress" in ticks
    fields = runs_mod.bound_fields(w, 256)
    assert fields["tok_s_below"] == pytest.approx(255 / w.decode_s)
    assert (fields["tokens_done"], fields["rate_so_far"]) == (9, pytest.approx(20.0))
    assert peers._outcome(w.events, w.stopped, 0, w.stderr, code, 2) == "over the 2 s limit while generating"
    # stopped before any token: no bound on tok/s, only "over N s"
    w2, _ = runs_mod.watch([sys.executable, "-c", "import time; print('{\"phase\": \"loading\"}', flush=True); "
                            "time.sleep(30)"], 1.0, lambda s, e: None)
    assert w2.stopped and w2.decode_s is None and runs_mod.bound_fields(w2, 256) == {"tok_s_below": None}
    assert peers._outcome(w2.events, True, 0, "", -9, 1) == "over the 1 s limit while loading"
    s = peers.summarise([{"outcome": "over the 1 s limit while loading", "tok_s_below": None}], "over the limit")
    assert peers.speed_cells(s, 2.0) == ("-", "-") and peers.outcome_cell(s) == "0/1 1 over, dropped"
    # one that finishes in time is not stopped
    w3, code3 = runs_mod.watch([sys.executable, "-c", "print('{\"phase\": \"done\"}')"], 30, lambda s, e: None)
    assert not w3.stopped and code3 == 0 and w3.events == [{"phase": "done"}]


def test_engine_dropped_after_its_first_run_oom_or_over_the_limit(peers, runs_mod, tmp_path, capsys):
    engines = ("mlx-tier", "mlx-lm", "llama.cpp", "nunspark")
    plan = runs_mod.slots(engines, ("cold",), 3)
    runs_mod.open_results(tmp_path, {"engines": list(engines), "temps": ["cold"], "runs": 3, "tokens": 256,
                                     "run_limit_s": 1800})
    runner = ScriptedRunner()
    runner.enqueue("mlx-tier", *[run(tok_s=2.0, wall_s=150.0, others=1.0)] * 3)
    runner.enqueue("mlx-lm", run("OOM-killed while loading", others=1.0))
    runner.enqueue("llama.cpp", run("over the 1800 s limit while generating", tok_s_below=0.15, rate_so_far=0.05,
                                    others=1.0))
    # nunspark: over the limit in a later run only: kept, and that run counted as over, not completed
    over = run("over the 1800 s limit while generating", tok_s_below=0.3, others=1.0)
    runner.enqueue("nunspark", run(tok_s=0.2, others=1.0), over, run(tok_s=0.4, others=1.0))
    peers.run_plan(specs_for(*engines, tokens=256), plan, tmp_path, [], None, 1800, ("cold",), runner=runner,
                   drop_pages=lambda files: None)
    assert [e for e, _ in runner.calls].count("mlx-lm") == 1 and [e for e, _ in runner.calls].count("llama.cpp") == 1
    assert [e for e, _ in runner.calls].count("nunspark") == 3
    assert runs_mod.dropped(runs_mod.load_runs(tmp_path)) == {"mlx-lm": "OOM-killed", "llama.cpp": "over the limit"}
    out = capsys.readouterr().out
    assert "mlx-lm: OOM-killed in its first run, not run again" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    # the table, from the file alone
    assert peers.main(["--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {line[:16].strip(): line for line in out.splitlines() if line[21:22] == " " and "cold" in line[17:21]}
    assert rows["mlx-tier"].endswith("1.00x") and "3/3" in rows["mlx-tier"]
    assert "0/1 1 OOM, dropped" in rows["mlx-lm"]
    assert " <0.15 " in rows["llama.cpp"] and rows["llama.cpp"].endswith("<0.07x")
    assert "0/1 1 over, dropped" in rows["llama.cpp"]
    assert " 0.30 " in rows["nunspark"] and "2/3 1 over" in rows["nunspark"] and "dropped" not in rows["nunspark"]
    assert "llama.cpp: over the limit in its first run, not run again" in out
    assert "llama.cpp <0.07x (stopped at the limit, a bound)" in out
    assert "llama.cpp cold: 0.05 tok/s over the tokens it decoded before the stop" in out
    assert "8 run(s) recorded, the pass is complete" in " ".join(out.split())
    assert all(len(line) <= 80 for line in out.splitlines())


def test_plan_estimate_is_runs_times_the_limit_then_learns_from_recorded_runs(peers, runs_mod):
    fp = {"engines": list(peers.ENGINES), "temps": ["warm"], "runs": 9, "tokens": 256, "run_limit_s": 1800}
    plan = peers.slots_of(fp)
    text = " ".join(" ".join(peers.plan_lines(fp, plan, [])).split())
    assert "5 engine(s) x 9 rounds x warm = 45 runs of 256 tokens; 0 recorded, 45 to go" in text
    assert "at most 25.0 h (45 runs + 5 priming x the 30 min limit)" in text and "expected 22.5 h" in text
    recorded = [{"engine": "mlx-tier", "slot": 0, "outcome": "ok", "wall_s": 180.0},
                {"engine": "mlx-lm", "slot": 1, "outcome": "OOM-killed while loading", "wall_s": 60.0},
                {"engine": "nunspark", "slot": 2, "outcome": "ok", "wall_s": 1260.0},
                {"engine": "llama.cpp", "slot": 3, "outcome": "over the 1800 s limit", "wall_s": 1800.0},
                {"engine": "llama.cpp repack", "slot": 4, "outcome": "OOM-killed while loading", "wall_s": 90.0}]
    todo = runs_mod.pending(plan, recorded)
    assert len(todo) == 16 and {s.engine for s in todo} == {"mlx-tier", "nunspark"}
    assert runs_mod.estimate_s(todo, recorded, 1800) == (8 * 180 + 8 * 1260, 16 * 1800)
    text = " ".join(" ".join(peers.plan_lines(fp, plan, recorded)).split())
    assert "5 recorded, 16 to go (mlx-lm, llama.cpp, llama.cpp repack dropped)" in text
    assert "expected 3.2 h" in text and "at most 9.0 h (16 runs + 2 priming" in text
    assert all(len(line) <= 80 for line in peers.plan_lines(fp, plan, recorded))


def test_progress_line_says_which_run_of_how_many_and_elapsed(runs_mod):
    import io

    stream = io.StringIO()
    p = runs_mod.Progress(stream=stream, log_every=0.0)
    p.start("run 13/45 llama.cpp repack warm")
    p.tick(192.0, {"phase": "progress", "tokens": 40})
    p.tick(193.0, {"phase": "loading"})
    p.line("run 13/45 llama.cpp repack warm: ok, 0.20 tok/s")
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("run 13/45 llama.cpp repack warm: 40 tok, 0:03:12; total 0:00:")
    assert lines[1].startswith("run 13/45 llama.cpp repack warm: loading, 0:03:13")
    assert all(len(line) <= 79 for line in lines) and len(lines) == 3
    quiet = io.StringIO()
    slow = runs_mod.Progress(stream=quiet, log_every=60.0)
    slow.start("run 1/45 mlx-tier warm")
    for s in range(5):
        slow.tick(float(s), {})
    assert quiet.getvalue().count("\n") == 1  # a log file gets a line a minute, not one a second
    assert runs_mod.duration(42) == "42 s" and runs_mod.duration(1800) == "30 min"
    assert runs_mod.duration(81000) == "22.5 h" and runs_mod.clock(3729) == "1:02:09"


class ScriptedPass:
    """Stands in for main's ``start`` and ``report``: ``start`` ends as scripted
    (``"ok"``, ``"interrupt"``: Ctrl-C, ``"sigterm"``: a real SIGTERM to this
    process), as while nunspark packs the model; ``report`` records its calls."""

    def __init__(self, out: Path, start="ok"):
        self.out, self.how, self.reports = out, start, []

    def start(self, args, notes, stack):
        import os
        import signal
        from types import SimpleNamespace

        if self.how == "interrupt":
            raise KeyboardInterrupt
        if self.how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        fp = {"engines": ["a"], "temps": ["cold"], "runs": 2}
        return fp, self.out, None, specs_for("a"), SimpleNamespace(files=list)

    def report(self, out, tolerance):
        self.reports.append(out)


@pytest.mark.parametrize("how,code", [("interrupt", 130), ("sigterm", 143)])
def test_interrupted_while_preparing_is_one_line_and_its_exit_code(peers, tmp_path, monkeypatch, capsys, how,
                                                                   code):
    import signal

    fake = ScriptedPass(tmp_path, start=how)
    monkeypatch.setattr(peers, "start", fake.start)
    monkeypatch.setattr(peers, "report", fake.report)
    before = signal.getsignal(signal.SIGTERM)
    assert peers.main(["--engines", "mlx-tier", "--cap-gb", "0"]) == code
    out, err = capsys.readouterr()
    assert err.strip() == "interrupted while preparing: no run was started; the same command starts again"
    assert "Traceback" not in out + err and fake.reports == []
    assert signal.getsignal(signal.SIGTERM) is before  # main leaves the handler as it found it


@pytest.mark.parametrize("how,code", [("interrupt", 130), ("sigterm", 143)])
def test_interrupted_run_exits_130_after_ctrl_c_and_143_after_sigterm(peers, tmp_path, monkeypatch, capsys,
                                                                      how, code):
    import os
    import signal

    calls = []

    def runner(spec, cgroup, limit_s, tick):  # the first run completes; the second is interrupted
        calls.append(spec.engine)
        if len(calls) == 2 and how == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # `kill PID` of the pass
        elif len(calls) == 2:
            raise KeyboardInterrupt
        return {"engine": spec.engine, **run(tok_s=1.0)}

    from peers_runs import load_runs

    real_run_plan = peers.run_plan
    monkeypatch.setattr(peers, "run_plan", lambda *a: real_run_plan(*a, runner=runner, drop_pages=lambda f: None))
    fake = ScriptedPass(tmp_path)
    monkeypatch.setattr(peers, "start", fake.start)
    monkeypatch.setattr(peers, "report", fake.report)
    assert peers.main(["--engines", "mlx-tier", "--cap-gb", "0"]) == code
    out = capsys.readouterr().out
    assert "interrupted: the run in flight is lost" in out and fake.reports == [tmp_path]
    assert calls == ["a", "a"] and [r["slot"] for r in load_runs(tmp_path)] == [0]  # the first run is kept
