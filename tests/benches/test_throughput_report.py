"""benches/throughput.py's report of where a run's missed experts came from.

The invariants it guards: the share printed beside a kind of step is the bytes
the process fetched from storage over those steps' missed expert bytes, and
nothing is printed for a run recorded without the storage counter; the
roofline prices a step's reads at what storage gave it, not at its misses;
the `throughput-bN` schedules fix the decode pool at N.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("throughput.py", "throughput_bench")


def _run(rows, misses=100, expert_bytes=100 * 2**20):
    return {"steps_log": rows, "misses": misses, "expert_bytes_read": expert_bytes}


def test_storage_share_is_fetched_over_missed_bytes(bench):
    # 1 MiB an expert; two decode steps miss 10 and 30 experts, storage gave 8 and 24 MiB
    rows = [[0.5, 0, 0, 4, 0, 10, 0.0, 8.0], [0.5, 0, 0, 4, 0, 30, 0.0, 24.0]]
    assert bench.storage_share(_run(rows), rows) == ", from storage  80%"
    # page cache served nothing, readahead read more: above 100%
    assert bench.storage_share(_run(rows[:1]), [[0.5, 0, 0, 4, 0, 10, 0.0, 12.0]]) == ", from storage 120%"


def test_storage_share_absent_without_the_counter(bench):
    old = [[0.5, 0, 0, 4, 0, 10, 0.0]]  # a run recorded before the column existed
    assert bench.storage_share(_run(old), old) == ""
    unread = [[0.5, 0, 0, 4, 0, 10, 0.0, None]]  # /proc/self/io unreadable
    assert bench.storage_share(_run(unread), unread) == ""
    assert bench.storage_share({"steps_log": [], "misses": 0}, []) == ""


def test_step_kinds_prints_the_share(bench):
    rows = [[0.5, 0, 0, 4, 0, 10, 0.0, 5.0]]
    (line,) = bench.step_kinds(_run(rows))
    assert line.startswith("  decode only") and line.endswith(", from storage  50%")


def test_storage_read_bytes_counts_or_says_none(bench):
    got = bench.storage_read_bytes()
    if Path("/proc/self/io").exists():
        assert isinstance(got, int) and got >= 0
    else:
        assert got is None


def _synth():
    from mlx_tier.tools.pools import Rates, Shape

    rates = Rates(disk_gbps=1.0, gemm_gflops=40.0, matvec_gbps=8.0, dequant_gbps=8.0, attention_gflops=20.0)
    shape = Shape(layers=24, experts=128, top_k=8, slots=3, expert_bytes=2_650_000, expert_flops=2 * 3 * 768 * 2048,
                  dense_bytes=6_000_000, dense_flops=2 * 2048 * 6144, attn_flops=4 * 32 * 128, kv_bytes=98_304.0,
                  heads=32)
    return shape, rates


def _compute(shape, rates, rows, context, sequences=None):
    from dataclasses import replace

    from mlx_tier.tools.pools import layer_step_seconds

    parts = layer_step_seconds(shape, replace(rates, overhead_s=0.0, per_expert_s=0.0), rows, context, sequences)
    return shape.layers * (parts["expert"] + parts["dense"] + parts["attn"]), shape.layers * parts["read"]


def test_roofline_prices_what_storage_gave(bench):
    shape, rates = _synth()
    decode, _ = _compute(shape, rates, 4, 500)
    # a decode step of 4 sequences whose misses storage served (1 GiB at 1 GB/s): read-bound
    assert bench.roofline_seconds(shape, rates, [[2.0, 0, 0, 4, 0, 400, 0.5, 1024.0]], 500) == \
        pytest.approx(max(decode, 2**30 / 1e9))
    # the same misses served by the page cache: the step's compute alone
    assert bench.roofline_seconds(shape, rates, [[2.0, 0, 0, 4, 0, 400, 0.5, 0.0]], 500) == pytest.approx(decode)


def test_roofline_prefill_rows_and_old_logs(bench):
    shape, rates = _synth()
    # a prefill step of 250 prompt tokens of 2 prompts with 6 tokens riding: 256 rows of 8 sequences
    step, _ = _compute(shape, rates, 256, 250, 8)
    assert bench.roofline_seconds(shape, rates, [[7.0, 250, 2, 6, 1, 900, 0.1, 0.0]], 500) == pytest.approx(step)
    # a decode step logged before the storage column: its misses priced as the pool model
    # does (every one from storage: here more than its compute)
    decode, model_read = _compute(shape, rates, 4, 500)
    assert model_read > decode
    for old in ([2.0, 0, 0, 4, 0, 400, 0.5], [2.0, 0, 0, 4, 0, 400, 0.5, None]):
        assert bench.roofline_seconds(shape, rates, [old], 500) == pytest.approx(model_read)
    # a step that carried nothing (all its sequences finished) costs nothing at the roofline
    assert bench.roofline_seconds(shape, rates, [[0.1, 0, 0, 0, 0, 0, 0.0, 0.0]], 500) == 0.0


def test_fixed_pool_schedules(bench):
    assert bench._pool_given("throughput-b1") == 1 and bench._pool_given("throughput-b2") == 2
    for other in ("throughput", "throughput-separate", "throughput-no-ahead", "batch1", "paced", "throughput-bad2",
                  "throughput-b0", "throughput-b"):
        assert bench._pool_given(other) is None
    assert {"throughput-b1", "throughput-b2"} <= set(bench.SCHEDULES)


def test_roofline_sums_the_steps(bench):
    shape, rates = _synth()
    decode, _ = _compute(shape, rates, 4, 500)
    prefill, _ = _compute(shape, rates, 256, 250, 8)
    log = [[7.0, 250, 2, 6, 1, 900, 0.1, 0.0], [2.0, 0, 0, 4, 0, 400, 0.5, 1024.0], [2.0, 0, 0, 4, 0, 400, 0.5, 0.0]]
    assert bench.roofline_seconds(shape, rates, log, 500) == pytest.approx(prefill + max(decode, 2**30 / 1e9) + decode)


def test_unknown_schedule_is_refused(bench, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["throughput.py", "--out", "x", "--schedules", "throughput,throughput-bogus"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "unknown schedule throughput-bogus" in capsys.readouterr().err
