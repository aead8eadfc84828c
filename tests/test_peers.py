"""benches/peers.py's logic, without the peers installed: skip lines, load guard, medians, table.

The invariant it guards: the side-by-side bench never prints a headline ratio
when the machine's load moved between runs, says how to install a missing
peer instead of failing, and fits its table in 80 columns.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[1] / "benches"


@pytest.fixture(scope="module")
def peers():
    sys.path.insert(0, str(BENCHES))
    try:
        spec = importlib.util.spec_from_file_location("peers_bench", BENCHES / "peers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["peers_bench"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("peers_bench", None)
        sys.path.remove(str(BENCHES))


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
    assert (args.runs, args.tokens, args.temps, args.run_limit_s) == (9, 256, ("warm",), 1800)
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
    assert "256 greedy tokens; 9 runs x warm" in text and "each run stopped at 1800 s" in text
    assert "load average (1 min) 6.2-12.2" in text and "others' runnable tasks 4.0-10.0" in text
    one = peers.parse_args(["--cap-gb", "0", "--runs", "1"])
    uncapped = " ".join(peers.caliber_lines(peers.fingerprint(one, tmp_path, ["mlx-tier"], [1], False, 0.8, 1),
                                            meta, runs))
    assert "NONE (runs uncapped)" in uncapped and "the cap" not in uncapped.split("cap:")[1] and "1 run x" in uncapped
