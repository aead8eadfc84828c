"""All MoE layers' caches of one model: their budget, shared counters, the
layer hook a long step stops at, prewarming from a profile and routing traces.

Each layer's slabs and slot table are :class:`mlx_tier.engine.cache.LayerCache`'s;
this is what a model's ``expert_cache`` holds.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, replace

import mlx.core as mx
import numpy as np

from mlx_tier.engine.cache import LayerCache
from mlx_tier.engine.cache_stats import CacheStats
from mlx_tier.engine.store import ExpertStore, ReadStats
from mlx_tier.errors import BudgetError


class ExpertCache:
    """All layers' caches of one model, their budget and shared counters.

    Attributes:
        layers: one LayerCache per MoE layer, in model order.
        stats: counters summed over layers.
        budget_bytes: the configured budget; resident expert bytes never exceed it.
        budget_in_slots: the budget was configured as slots (``slots_per_layer``,
            ``layer_slots``): a cast after load keeps the slots and restates
            ``budget_bytes`` in the new dtypes. Otherwise it is bytes, and a
            cast that would need more is refused (:meth:`admit_cast`).
        kernel, dtype_name: what computes the experts and the cast made at load
            (``"as stored"`` for none), set by :func:`mlx_tier.engine.load.tier_model`
            for reports.
    """

    can_lend = True  # lend_slots resizes every layer (a two-tier cache's hot tier does not)

    def __init__(self, layers: list[LayerCache], stats: CacheStats, budget_bytes: int, store: ExpertStore,
                 budget_in_slots: bool = False):
        self.layers = layers
        self._stats = stats
        self.budget_bytes = budget_bytes
        self.budget_in_slots = budget_in_slots
        self.store = store
        if self.resident_bytes > budget_bytes:  # invariant 2 (docs/architecture.md): checked, not assumed
            raise BudgetError(
                f"slabs of {self.resident_bytes} bytes exceed the cache budget of {budget_bytes} bytes"
            )
        for layer in layers:
            layer.owner = self
        self._scratch: dict = {}  # the layers' scratch slabs (LayerCache.scratch)
        self._base_slots: tuple[int, ...] | None = None  # each layer's slots as loaded, once some are lent
        self.lent = 0  # slots each layer holds beyond those (lend_slots)

    def __deepcopy__(self, memo) -> ExpertCache:
        """A copy whose layers get scratch slabs of their own (a copied slab shares its
        buffer with the original's, and the scratch slabs are written in place)."""
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in vars(self).items():
            setattr(new, key, {} if key == "_scratch" else copy.deepcopy(value, memo))
        return new

    def admit_cast(self, layer: LayerCache, dtypes: dict[str, mx.Dtype]) -> None:
        """Check the budget before ``layer``'s slabs are cast to ``dtypes`` (name -> dtype).

        Raises:
            BudgetError: a byte budget the cast slabs would exceed (invariant 2).
        """
        grow = layer.num_slots * (layer.slot_nbytes_as(dtypes) - layer.slot_nbytes)
        if self.budget_in_slots:
            self.budget_bytes += grow
        elif self.resident_bytes + grow > self.budget_bytes:
            names = ", ".join(sorted({str(d).removeprefix("mlx.core.") for d in dtypes.values()}))
            raise BudgetError(
                f"casting the experts to {names} needs {(self.resident_bytes + grow) / 2**30:.3f} GiB of slots, "
                f"over the cache budget of {self.budget_bytes / 2**30:.3f} GiB: load with "
                "TierConfig(dtype=...) so that the budget plans for it, or give a larger cache_gb", "dtype"
            )

    @property
    def stats(self) -> CacheStats:
        """The live counters (mutated as the model runs), with every deferred
        hit counted and the store's read totals (the store serves only this
        cache). Counting deferred hits reads router outputs that the step that
        made them has already evaluated. For a value that does not move, take
        :meth:`snapshot`."""
        self._count_deferred()
        self._stats.bytes_read = self.store.stats.bytes_read
        self._stats.read_seconds = self.store.stats.read_seconds
        return self._stats

    def _count_deferred(self) -> None:
        """Every layer's deferred counts, their lazy arrays evaluated in one
        ``mx.eval`` (with kernel ``metal``: one wait for the device per read of
        the stats instead of two per MoE layer)."""
        pending = [a for layer in self.layers for a in layer.deferred_arrays()]
        if pending:
            mx.eval(*pending)
        for layer in self.layers:
            layer.count_deferred()

    def set_layer_hook(self, hook) -> None:
        """Call ``hook(layer index)`` before each MoE layer computes, ``None`` to stop.

        Between layers is where a long step can react: the job's throughput
        schedule checks for a stop there (the hook raises to abandon the step,
        :mod:`mlx_tier.job.pool_engine`). With a lazy kernel on fully resident
        layers the calls come while the graph is built, before it is computed.
        """
        for layer in self.layers:
            layer.hook = hook

    def snapshot(self) -> CacheStats:
        """A copy of the counters now; ``later - earlier`` measures a phase."""
        return replace(self.stats)

    @property
    def slots_per_layer(self) -> int | None:
        """Slots of every layer when they are all equal, else ``None`` (an
        adaptive split or per-layer counts: see :attr:`layer_slots`)."""
        counts = set(self.layer_slots)
        return counts.pop() if len(counts) == 1 else None

    @property
    def layer_slots(self) -> tuple[int, ...]:
        """Slots of each layer (they differ under an adaptive split)."""
        return tuple(layer.num_slots for layer in self.layers)

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    def profile_counts(self) -> np.ndarray:
        """Expert uses since load, ``[L, E]`` int64 (a copy): one per (token, k)
        entry routed to the expert, prefill and decode — the unit of a
        :class:`~mlx_tier.routing.profile.Profile` (``mlx_tier.routing.profile.from_counts``).
        Layers with fewer experts than the widest are zero-padded."""
        out = np.zeros((len(self.layers), max(layer.num_experts for layer in self.layers)), np.int64)
        self._count_deferred()
        for i, layer in enumerate(self.layers):
            out[i, : layer.num_experts] = layer.counts
        return out

    def prewarm(self, profile) -> int:
        """Fill each layer's free slots with ``profile``'s most used experts
        (:meth:`LayerCache.prewarm`). The reads are counted in
        ``stats.prewarmed``/``prewarm_bytes``/``prewarm_seconds``, not in
        ``bytes_read``. Returns the number of experts read.

        Args:
            profile: a :class:`~mlx_tier.routing.profile.Profile` of this model's shape.
        """
        before, self.store.stats = self.store.stats, ReadStats()
        try:
            n = sum(self._prewarm_layer(i, profile) for i in range(len(self.layers)))
            self._stats.prewarmed += n
            self._stats.prewarm_bytes += self.store.stats.bytes_read
            self._stats.prewarm_seconds += self.store.stats.read_seconds
        finally:
            self.store.stats = before  # prewarm reads are never counted as bytes_read
        return n

    def _prewarm_layer(self, i: int, profile) -> int:
        layer = self.layers[i]
        return layer.prewarm(profile.hottest(i, layer.num_slots))

    @property
    def lendable(self) -> int:
        """The most slots :meth:`lend_slots` can lend: every layer's experts beyond the slots
        it was loaded with, the least of them."""
        base = self._base_slots or self.layer_slots
        return min(layer.num_experts - n for n, layer in zip(base, self.layers))

    @property
    def slot_row_bytes(self) -> int:
        """Bytes of one slot in every layer: what each slot lent holds."""
        return sum(layer.slot_nbytes for layer in self.layers)

    def lend_slots(self, extra: int) -> None:
        """Give every layer ``extra`` slots beyond the ones it was loaded with (``0``:
        back to those), for room its caller knows is idle meanwhile: the job's
        throughput schedule lends a prompt step's workspace, and KV room no sequence
        will hold, to its decode steps
        (:class:`mlx_tier.job.pool_engine.PoolEngine`'s ``decode_slots``; MoE-Gen,
        arXiv 2503.09716, sizes prefill and decode apart). The budget moves with the
        lent slots: lent bytes are the caller's to account for. Taking them back
        forgets the experts in them (:meth:`LayerCache.resize`). A layer that fails to
        resize (memory) puts every layer back to the slots lent before, then the error
        is raised: the layers never disagree with :attr:`lent`.

        Raises:
            ValueError: ``extra`` below 0, a layer that would exceed its experts, or a
                cache that does not lend (:attr:`can_lend`).
        """
        if not self.can_lend:
            raise ValueError(f"{type(self).__name__} does not lend slots")
        if extra < 0:
            raise ValueError(f"extra slots must be >= 0, got {extra}")
        base = self._base_slots = self._base_slots or self.layer_slots
        if any(n + extra > layer.num_experts for n, layer in zip(base, self.layers)):
            raise ValueError(f"{extra} extra slots exceed a layer's experts")
        before, lent = self.resident_bytes, self.lent
        try:
            for n, layer in zip(base, self.layers):
                layer.resize(n + extra)
            self.lent = extra
        except BaseException:
            for n, layer in zip(base, self.layers):  # back as lent before (shrinking frees first)
                layer.resize(n + lent)
            raise
        finally:
            self.budget_bytes += self.resident_bytes - before

    @property
    def lent_bytes(self) -> int:
        """Bytes of the slots lent now (:meth:`lend_slots`), 0 when none."""
        return self.lent * self.slot_row_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of all slabs once allocated (the most the cache can hold)."""
        return sum(layer.resident_bytes for layer in self.layers)

    def start_trace(self, source: str = ""):
        """Record the router's top-k of every layer call until :meth:`stop_trace`.

        Recording needs the expert ids on the host, so fully resident layers
        leave their lazy path meanwhile (one sync per layer per step).
        """
        from mlx_tier.routing.trace import TraceRecorder

        rec = TraceRecorder(len(self.layers), self.num_experts, source=source)
        for layer in self.layers:
            layer.recorder = rec
        return rec

    def stop_trace(self):
        """Stop recording; returns the :class:`~mlx_tier.routing.trace.Trace`."""
        rec = self.layers[0].recorder
        for layer in self.layers:
            layer.recorder = None
        return rec.trace() if rec is not None else None

    def reset_stats(self) -> None:
        stats = self.stats
        for k, v in asdict(CacheStats()).items():
            setattr(stats, k, v)
        self.store.stats = ReadStats()
