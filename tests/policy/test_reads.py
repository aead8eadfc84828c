"""Reads around the page cache only where it cannot keep the experts and the schedule
reads each expert once for a whole pool."""

from mlx_tier.policy.reads import DIRECT, KEEP, page_cache_for

GIB = 2**30


def test_a_throughput_run_of_a_model_larger_than_its_memory_reads_around_the_page_cache():
    assert page_cache_for("throughput", 8 * GIB, 2 * GIB, "linux") == DIRECT  # the 8 GB synthetic, 2 GiB cap
    assert page_cache_for("throughput", 2 * GIB + 1, 2 * GIB, "linux") == DIRECT


def test_the_page_cache_is_kept_where_it_can_hold_the_experts_or_serves_re_reads():
    assert page_cache_for("throughput", 2 * GIB, 2 * GIB, "linux") == KEEP  # they fit, just
    assert page_cache_for("throughput", GIB // 2, 24 * GIB, "linux") == KEEP  # the demo
    assert page_cache_for("paced", 8 * GIB, 2 * GIB, "linux") == KEEP  # its decode steps re-read evicted experts
    assert page_cache_for("throughput", 8 * GIB, 2 * GIB, "darwin") == KEEP  # F_NOCACHE: not measured
    assert page_cache_for("throughput", 0, 2 * GIB, "linux") == KEEP  # experts unknown
