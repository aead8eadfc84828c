"""Whether a run reads its experts through the OS page cache or around it (O_DIRECT).

A run whose checkpoint's experts exceed all the memory the process may hold (a
memory cgroup's limit, or the host's memory) cannot have the page cache keep
them until their next read: under a cgroup limit the cache is charged to the
group and reclaimed as fast as it fills. Reading through it then buys nothing
and costs readahead beyond each expert's bytes and the kernel's reclaim, on the
same cores that compute. The throughput schedule reads each uncached expert
once a layer step for a whole pool, so such a run reads around the cache
(``O_DIRECT``); the paced schedule's small decode steps re-read experts evicted
moments before, which a page cache of even a few hundred MiB still serves, so
it keeps the cache. Measured on Linux only (benches/throughput.py, schedules
``throughput`` and ``throughput-keep``: benches/results/throughput/NOTES.md);
elsewhere (macOS's ``F_NOCACHE``) the page cache is kept.

Plain Python: the caller measures the bytes and the memory, and checks that the
checkpoint's filesystem accepts direct reads
(:func:`mlx_tier.engine.store.direct_reads_work`) before it takes ``"direct"``.
"""

from __future__ import annotations

import sys

KEEP = "keep"
DIRECT = "direct"


def page_cache_for(schedule: str, expert_bytes: int, memory_total: int, platform: str = sys.platform) -> str:
    """``TierConfig.page_cache`` for a job: ``"direct"`` or ``"keep"`` (module doc).

    Args:
        schedule: the job's ``"throughput"`` or ``"paced"``.
        expert_bytes: every expert of every MoE layer as stored (bytes).
        memory_total: all the process may hold (bytes): the smaller of the host's
            memory and a binding cgroup limit (:class:`mlx_tier.engine.limits.MemoryLimit`).
        platform: ``sys.platform``; only Linux reads around the cache.
    """
    if schedule != "throughput" or not platform.startswith("linux"):
        return KEEP
    return DIRECT if expert_bytes > memory_total else KEEP
