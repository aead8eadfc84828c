"""benches/throughput.py's report of where a run's missed experts came from.

The invariant it guards: the share printed beside a kind of step is the bytes
the process fetched from storage over those steps' missed expert bytes, and
nothing is printed for a run recorded without the storage counter.
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
