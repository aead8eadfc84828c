"""The expert cache's counters: hits, misses, reads, rounds, prefetch, stalls.

Counted by each layer's cache (:class:`mlx_tier.engine.cache.LayerCache`) into
one :class:`CacheStats` per model (:class:`mlx_tier.engine.expert_cache.ExpertCache`);
``later - earlier`` of two snapshots measures a phase.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class CacheStats:
    """Counters over all MoE layers; read them outside the decode loop.

    A *hit* or *miss* is counted once per distinct expert needed by one layer
    in one forward call (one decode step, or one prefill chunk): that is the
    unit that costs a read.
    """

    hits: int = 0
    misses: int = 0  # experts read from the cold tier
    evictions: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time of the store's reads (with prefetch, background ones too)
    rounds: int = 0  # extra expert-block passes when a layer needed more experts than slots
    prewarmed: int = 0  # experts read at load from a profile (not misses; their bytes are not in bytes_read)
    prewarm_bytes: int = 0
    prewarm_seconds: float = 0.0
    # Prefetch (mlx_tier.engine.prefetch). A prefetched expert that serves a miss is
    # still a miss (read from the cold tier, only earlier); with prefetch,
    # read_seconds also holds the background reads' wall time.
    prefetch_predicted: int = 0  # predicted non-resident experts whose read was issued
    prefetch_used: int = 0  # of those, experts that then served a miss
    prefetch_wasted_bytes: int = 0  # bytes prefetched and dropped unused
    # Experts of a layer's next round read while its current round computed
    # (LayerCache.assign: more experts needed than slots); misses all the same.
    read_ahead: int = 0
    # Wall time the forward pass blocked on reads (its own, and waiting for
    # in-flight prefetches), as opposed to read_seconds, the reads' total.
    stall_seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def prefetch_precision(self) -> float:
        """Prefetched experts that served a miss / prefetched experts."""
        return self.prefetch_used / self.prefetch_predicted if self.prefetch_predicted else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Misses served by a prefetch / all misses."""
        return self.prefetch_used / self.misses if self.misses else 0.0

    def __sub__(self, earlier: CacheStats) -> CacheStats:
        """Counters of the phase between two snapshots: ``later - earlier``."""
        return CacheStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["prefetch_precision"] = self.prefetch_precision
        d["prefetch_recall"] = self.prefetch_recall
        return d
