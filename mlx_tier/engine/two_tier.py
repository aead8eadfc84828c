"""The CUDA path's expert cache: hot slots (GPU), warm slots (host), cold shards (SSD).

Each MoE layer keeps its hot slabs (:class:`mlx_tier.engine.cache.LayerCache`, on the
GPU on a CUDA machine), a :class:`mlx_tier.engine.warm_pool.WarmPool` in host memory and a
:class:`mlx_tier.policy.placement.TierIndex` that decides, with the layer's policy
objects and the cost model (:mod:`mlx_tier.policy.cost_model`), which expert is where.
Per layer call the experts found hot run through mlx-lm's own expert block on
the slabs; the warm ones run through the same block on the warm buffers on the
CPU stream (:meth:`WarmPool.compute`); the two outputs are combined into the
``[..., k, D]`` mlx-lm returns. MLX schedules the GPU and CPU streams
concurrently when the layer's output is evaluated.

Overlap: per round, the hot share is issued on the default (GPU) stream and
started (``mx.async_eval``), then the warm share is started on its own CPU
stream (``mx.new_stream(mx.cpu)``, ``mx.async_eval``) or computed eagerly by
the CPU expert kernel; the two run concurrently and are combined.

Built by :func:`mlx_tier.engine.load.tier_model` on CUDA (always) and elsewhere
when ``TierConfig.host_cache_gb`` is set; on Metal and the CPU backend nothing
else changes. Here (no GPU) the "GPU" slabs live on the CPU, which tests the
tier logic and the exactness of the combined outputs.

Prefetch (:mod:`mlx_tier.engine.prefetch`'s predictor, ``TierConfig.prefetch``): at
layer l the predicted experts of layer l+1 that are warm are promoted to hot
slots ahead of use (:meth:`mlx_tier.policy.placement.TierIndex.promote_ahead`: the copies
start at once, ``mx.async_eval``, overlapping layer l's compute); those in
neither tier are read ahead from SSD (bytes only, placed by the index when
layer l+1 runs). The predictions are recorded in a routing trace, so the
simulator replays the promotions exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.engine.budgets import widen_memory_limit
from mlx_tier.engine.cache import LayerCache
from mlx_tier.engine.cache_stats import CacheStats
from mlx_tier.engine.dtypes import then
from mlx_tier.engine.expert_cache import ExpertCache
from mlx_tier.engine.prefetch import BackgroundReader, NextLayerPrefetch, link_layers
from mlx_tier.engine.slabs import StandIns, to_mx
from mlx_tier.engine.warm_pool import WarmPool, pool_slot_nbytes
from mlx_tier.errors import BudgetError
from mlx_tier.policy.cost_model import TransferCosts
from mlx_tier.policy.placement import (
    DEMOTE,
    DROP,
    HOT_HIT,
    KINDS,
    MISS_HOT,
    MISS_WARM,
    PROMOTE,
    PROMOTE_AHEAD,
    WARM_HIT,
    Moves,
    TierIndex,
)

# Per-tier counters that report.json sums over runs (mlx_tier.job.run.sum_cache).
TIER_COUNTERS = ("hot_hits", "warm_hits", "promotions", "misses_hot", "misses_warm", "demotions",
                 "cpu_entries", "gpu_entries", "promotions_ahead")


@dataclass
class TwoTierStats(CacheStats):
    """:class:`~mlx_tier.engine.cache_stats.CacheStats` plus per-tier counts (per distinct
    expert per layer call, as hits and misses). ``hits`` = hot + warm hits +
    promotions, ``misses`` = cold reads, ``evictions`` = experts dropped from
    both tiers.

    Attributes:
        warm_hits: warm experts computed on the CPU where they lie.
        promotions: warm experts copied to the hot tier (the cost model said so).
        misses_hot / misses_warm: cold reads placed in the hot / warm tier.
        demotions: experts evicted from the hot tier into the warm tier.
        cpu_entries / gpu_entries: (token, k) entries computed on the CPU / GPU.
        promotions_ahead: warm experts copied to the hot tier before their call
            on a prediction (warm -> hot prefetch); not accesses.
    """

    hot_hits: int = 0
    warm_hits: int = 0
    promotions: int = 0
    misses_hot: int = 0
    misses_warm: int = 0
    demotions: int = 0
    cpu_entries: int = 0
    gpu_entries: int = 0
    promotions_ahead: int = 0

    def __sub__(self, earlier: CacheStats) -> TwoTierStats:
        return TwoTierStats(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> dict:
        d = super().as_dict()
        seen = self.hits + self.misses
        d["hot_hit_rate"] = self.hot_hits / seen if seen else 0.0
        d["warm_hit_rate"] = (self.warm_hits + self.promotions) / seen if seen else 0.0
        d["cpu_share"] = (self.warm_hits + self.misses_warm) / seen if seen else 0.0  # experts computed on the CPU
        return d


class TwoTierLayer:
    """One MoE layer's hot slabs, warm pool and tier index.

    The hot :class:`LayerCache` keeps its slabs, store, prefetch intake and
    counters; its expert -> slot table, free list and policy are the index's
    (shared objects), so reporting and prefetch see the hot tier as it is.
    """

    def __init__(self, hot: LayerCache, warm_slots: int, costs: TransferCosts, warm_kernel=None,
                 warm_stream=None):
        self.hot = hot
        self.warm = WarmPool(hot.tensors, warm_slots, warm_kernel, warm_stream)
        self.index = TierIndex(hot.layer, hot.num_experts, hot.num_slots, warm_slots, hot.policy_spec, costs,
                               hot.slot_nbytes)
        self.entries = {"cpu": 0, "gpu": 0}
        self._share()

    def _share(self) -> None:
        self.hot.slot_of, self.hot.free, self.hot.policy = self.index.hot_slot, self.index.hot_free, self.index.hot_policy
        self.hot.lut = None  # never the lazy all-resident path: every call is placed by the index

    def reset(self) -> None:
        """Forget both tiers (after a failed read or write)."""
        self.index.reset()
        self._share()

    def cast(self, dtypes: dict[str, mx.Dtype]) -> None:
        """Cast both tiers' buffers named in ``dtypes`` (name on disk -> dtype), as
        the model's parameters were cast (:meth:`LayerCache.cast`, :meth:`WarmPool.cast`).

        Raises:
            BudgetError: a tier over a byte budget (:meth:`TwoTierCache.admit_cast`).
        """
        self.hot.cast(dtypes)
        self.warm.cast(dtypes)
        self.index.expert_nbytes = self.hot.slot_nbytes  # what a copy moves now (the cost model's bytes)

    def assign(self, idx: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Place the experts of ``idx`` ``[..., k]`` round by round.

        Yields:
            ``(hot_slots, hot_mask, warm_slots, warm_mask)``, each of ``idx``'s
            shape: the entries of this round computed from the hot slabs and
            from the warm pool, and their slots (0 elsewhere). The caller must
            set ``hot.pending`` to what read the slots before the next round.
        """
        hot, index = self.hot, self.index
        if hot.recorder is not None:
            hot.recorder.add(hot.layer, idx)
        uses = np.bincount(idx.reshape(-1), minlength=hot.num_experts)  # [E]
        hot.counts += uses
        rounds = index.rounds(np.flatnonzero(uses).tolist())
        for group in rounds:
            self._apply(index.place(group, uses))
            if len(rounds) > 1:
                hot.stats.rounds += 1
            in_group = np.isin(idx, group)
            hot_mask = in_group & (index.hot_slot[idx] >= 0)
            warm_mask = in_group & (index.warm_slot[idx] >= 0)
            self.entries["gpu"] += int(hot_mask.sum())
            self.entries["cpu"] += int(warm_mask.sum())
            yield (np.where(hot_mask, index.hot_slot[idx], 0).astype(np.uint32), hot_mask,
                   np.where(warm_mask, index.warm_slot[idx], 0).astype(np.uint32), warm_mask)

    def _apply(self, moves: Moves, read=None, wait: bool = True) -> None:
        """Make the round's byte moves: copies (from pre-round contents), then cold reads.

        Args:
            read: ``experts -> batches`` as :meth:`LayerCache._read` (the default:
                prefetched rows first, counted as stall).
            wait: evaluate the writes before returning; else only start them
                (``mx.async_eval``: warm -> hot prefetch overlapping compute).

        Raises:
            CheckpointError, OSError: a failed read (both tiers are reset).
        """
        if not moves.reads and not moves.copies:
            return
        try:
            cold = [e for e, _, _ in moves.reads]
            batches = (read or self.hot._read)(cold) if cold else []
            where = {e: (b, i) for b, (_, rows) in enumerate(batches) for i, e in rows}
            self.hot.settle()  # nothing unevaluated may still read a slot we overwrite
            written = []
            for name, t in self.hot.tensors.items():
                # Every source holds pre-round contents: take them all before any write, as
                # evaluated copies (a live view of a slab makes each write a full-slab copy:
                # 120 ms instead of 0.09 ms for a 64 MiB slab on the CPU backend).
                src = [self._source(name, kind == "promote", a) for kind, _, a, _ in moves.copies]
                mx.eval(src)
                for (kind, _, _, b), rows in zip(moves.copies, src):
                    self._write(name, "hot" if kind == "promote" else "warm", b, rows)
                for e, tier, slot in moves.reads:  # read slots are never reused within the round
                    b, i = where[e]
                    self._write(name, tier, slot, batches[b][0][name][i : i + 1])
                written += [t.module[t.attr]] + ([self.warm.arrays[name]] if name in self.warm.arrays else [])
            (mx.eval if wait else mx.async_eval)(written)
        except BaseException:
            self.reset()
            raise

    def _source(self, name: str, promote: bool, slot: int) -> mx.array:
        """A copy of slot ``slot`` ``[1, ...]`` of tensor ``name`` (lazy): of the warm pool for a
        promotion, made on the warm tier's CPU stream in the slab's dtype (the host -> GPU
        move is then the slab write, started, not waited for, by warm -> hot prefetch); of
        the hot slab for a demotion, a copy on the GPU (the pool write converts it)."""
        t = self.hot.tensors[name]
        array = self.warm.arrays[name] if promote else t.module[t.attr]
        with mx.stream(self.warm.stream if promote else mx.default_stream(mx.default_device())):
            rows = array[slot : slot + 1]
            return rows.astype(t.dtype) if rows.dtype != t.dtype else rows + 0

    def _write(self, name: str, tier: str, slot: int, rows) -> None:
        """Write ``rows`` (``[1, ...]``: an mx.array, or the bytes of a cold read as numpy)
        into slot ``slot`` of ``tier``'s buffer of tensor ``name``, converted to its dtype.
        A warm write runs on the warm tier's CPU stream, so the pool stays host memory."""
        t = self.hot.tensors[name]
        host = tier != "hot"
        with mx.stream(self.warm.stream if host else mx.default_stream(mx.default_device())):
            if not isinstance(rows, mx.array):  # the slab's casts, then the pool's dtype
                rows = to_mx(rows, t.info, then(t.casts, self.warm.dtypes[name]) if host else t.casts)
            (self.warm.arrays[name] if host else t.module[t.attr])[slot : slot + 1] = rows

    def prewarm(self, ranked: list[int]) -> int:
        """Read ``ranked`` (hottest first) into the free hot, then warm, slots
        (:meth:`TierIndex.prewarm`); returns how many experts were read."""
        moves = self.index.prewarm(ranked)
        names = list(self.hot.tensors)
        self._apply(moves, read=lambda es: [(self.hot.store.read_experts(names, es), list(enumerate(es)))])
        return len(moves.reads)

    def promote_ahead(self, predicted: np.ndarray) -> None:
        """Warm -> hot prefetch: promote the predicted warm experts of the next
        call (:meth:`TierIndex.promote_ahead`); the copies are started, not waited for."""
        self._apply(self.index.promote_ahead(predicted), wait=False)

    def forward(self, block: nn.Module, x: mx.array, idx: np.ndarray) -> mx.array:
        """The expert block's output ``[..., k, D]`` for ``x`` ``[..., D]`` and
        router top-k ``idx`` ``[..., k]``: per round the warm entries' rows are
        taken to the CPU (:meth:`WarmPool.rows`), the hot entries start on the
        default stream (``mx.async_eval``), the warm ones on the CPU
        (:meth:`WarmPool.compute`), running concurrently; then combined."""
        k, D = idx.shape[-1], x.shape[-1]
        out = None
        for hot_slots, hot_mask, warm_slots, warm_mask in self.assign(idx):
            if out is None and hot_mask.all():  # one round, every entry hot: mlx-lm's own call
                out = block(x, mx.array(hot_slots))
                self.hot.pending = out
                return out
            if out is None:
                out = mx.zeros((idx.size, D), dtype=x.dtype)  # [T*k, D]
            rows = x.reshape(-1, D)
            hot_pairs = np.flatnonzero(hot_mask.reshape(-1))  # rows of [T*k]
            warm_pairs = np.flatnonzero(warm_mask.reshape(-1))
            # The warm share's rows first, on the CPU, while nothing of this layer runs on the GPU
            # (WarmPool.rows: on CUDA the CPU's first read of GPU memory is a synchronous copy).
            xs = self.warm.rows(x, warm_pairs // k) if warm_pairs.size else None  # [n, D]
            y_hot = None
            if hot_pairs.size:  # issued before the warm share: an eager CPU kernel would otherwise run first
                y_hot = block(rows[mx.array(hot_pairs // k)], mx.array(hot_slots.reshape(-1)[hot_pairs])[:, None])
                mx.async_eval(y_hot)  # [n, 1, D] on the default (GPU) stream
            y_warm = self.warm.compute(block, xs, warm_slots.reshape(-1)[warm_pairs]) if xs is not None else None
            for pairs, y in ((hot_pairs, y_hot), (warm_pairs, y_warm)):
                if y is not None:
                    out[mx.array(pairs)] = y.squeeze(1)
            self.hot.pending = out  # the next round's writes evaluate it first
        return out.reshape(*idx.shape, D)


class TwoTierExperts(nn.Module):
    """Drop-in for an mlx-lm expert block served by a :class:`TwoTierLayer`.

    Called like ``SwitchGLU``: ``x`` ``[..., D]``, ``indices`` ``[..., k]``
    (uint32) -> ``[..., k, D]``. The router output is evaluated (the host
    places the experts), as in :class:`mlx_tier.engine.load.TieredExperts`.
    """

    def __init__(self, inner: nn.Module, layer: TwoTierLayer):
        super().__init__()
        self._inner = inner  # leading underscore: hidden from parameters()
        self._layer = layer
        self._prefetch = None  # WarmAwarePrefetch when prefetch is on
        self._stand_ins: StandIns | None = None  # the experts as parameters (show())

    @property
    def cache(self) -> LayerCache:
        return self._layer.hot

    def show(self, path: str) -> None:
        """Show the layer's experts as this module's parameters, the block being at ``path``."""
        self._stand_ins = StandIns.show(self, path, self._layer.hot.tensors)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        changed = self._stand_ins.changed(self, self._layer.hot.tensors) if self._stand_ins is not None else None
        if changed:  # the model was cast since the last call
            self._layer.cast(changed)
        ahead = self._prefetch.predict(x, indices.shape[-1]) if self._prefetch is not None else None
        if ahead is None:
            mx.eval(indices)
        else:
            mx.eval(indices, ahead)
        out = self._layer.forward(self._inner, x, np.array(indices))
        self._layer.hot.end_call()  # drop this layer's unused prefetched experts
        if ahead is not None:
            self._prefetch.issue(np.array(ahead))
        return out


class WarmAwarePrefetch(NextLayerPrefetch):
    """Prefetch into a two-tier layer: promotes the predicted warm experts to
    hot slots ahead of use, then reads ahead those in neither tier (at most
    H + W of them)."""

    def __init__(self, link: NextLayerPrefetch, next_layer: TwoTierLayer):
        super().__init__(link.router, link.next_cache, link.reader)
        self.next_layer = next_layer
        self.index = next_layer.index

    def issue(self, predicted: np.ndarray) -> None:
        """Warm -> hot promotions (:meth:`TwoTierLayer.promote_ahead`), then cold reads."""
        self.next_layer.promote_ahead(predicted)
        super().issue(predicted)

    def wanted(self, experts: list[int]) -> list[int]:
        ix = self.index
        return [e for e in experts if ix.hot_slot[e] < 0 and ix.warm_slot[e] < 0][: ix.H + ix.W]


class TwoTierCache(ExpertCache):
    """:class:`~mlx_tier.engine.expert_cache.ExpertCache` of a two-tier model: ``layers`` are
    the hot tiers, ``tier_layers`` the full layers; each tier's budget is
    checked (invariant 2, docs/architecture.md). Lends no slots (its index shares
    the hot tiers' slot tables): :attr:`can_lend` is false.

    Raises:
        BudgetError: the hot slabs or the warm pools exceed their budget.
    """

    can_lend = False

    def __init__(self, tier_layers: list[TwoTierLayer], stats: TwoTierStats, budget_bytes: int,
                 warm_budget_bytes: int, store, budget_in_slots: bool = False):
        super().__init__([t.hot for t in tier_layers], stats, budget_bytes, store, budget_in_slots)
        self.tier_layers = tier_layers
        self.warm_budget_bytes = warm_budget_bytes
        if self.warm_resident_bytes > warm_budget_bytes:
            raise BudgetError(f"warm pools of {self.warm_resident_bytes} bytes exceed the host cache budget "
                              f"of {warm_budget_bytes} bytes")

    def admit_cast(self, layer: LayerCache, dtypes: dict[str, mx.Dtype]) -> None:
        """:meth:`ExpertCache.admit_cast` for the hot tier; the warm tier's budget
        is bytes (host memory), so a cast that grows its pools past it is refused.

        Raises:
            BudgetError: a tier over its byte budget.
        """
        super().admit_cast(layer, dtypes)
        warm = next(t.warm for t in self.tier_layers if t.hot is layer)
        grow = warm.num_slots * (warm.slot_nbytes_as(dtypes) - warm.slot_nbytes)
        if self.warm_resident_bytes + grow > self.warm_budget_bytes:
            raise BudgetError(f"casting the experts needs {(self.warm_resident_bytes + grow) / 2**30:.3f} GiB of "
                              f"warm slots, over the host cache budget of {self.warm_budget_bytes / 2**30:.3f} GiB: "
                              "load with TierConfig(dtype=...) so that the budgets plan for it", "dtype")

    @property
    def warm_resident_bytes(self) -> int:
        """Bytes of all warm pools once written (the most the warm tier holds)."""
        return sum(t.warm.resident_bytes for t in self.tier_layers)

    @property
    def warm_slots(self) -> tuple[int, ...]:
        return tuple(t.index.W for t in self.tier_layers)

    @property
    def stats(self) -> TwoTierStats:
        """The live counters, per-tier counts summed over layers (see :class:`TwoTierStats`)."""
        s = super().stats
        c = {k: sum(t.index.counts[k] for t in self.tier_layers) for k in KINDS}
        s.hot_hits, s.warm_hits, s.promotions = c[HOT_HIT], c[WARM_HIT], c[PROMOTE]
        s.misses_hot, s.misses_warm, s.demotions = c[MISS_HOT], c[MISS_WARM], c[DEMOTE]
        s.hits, s.misses, s.evictions = c[HOT_HIT] + c[WARM_HIT] + c[PROMOTE], c[MISS_HOT] + c[MISS_WARM], c[DROP]
        s.promotions_ahead = c[PROMOTE_AHEAD]
        s.cpu_entries = sum(t.entries["cpu"] for t in self.tier_layers)
        s.gpu_entries = sum(t.entries["gpu"] for t in self.tier_layers)
        return s

    def reset_stats(self) -> None:
        for t in self.tier_layers:
            t.index.counts = dict.fromkeys(KINDS, 0)
            t.entries = {"cpu": 0, "gpu": 0}
        super().reset_stats()

    def _prewarm_layer(self, i: int, profile) -> int:
        """Pre-warm fills the hot tier, then the warm tier, by profile rank."""
        t = self.tier_layers[i]
        return t.prewarm(profile.hottest(i, t.index.H + t.index.W))


def warm_slots_for(warm_budget_bytes: int, hot_slots: list[int], experts: list[int], slot_nbytes: int) -> list[int]:
    """Warm slots of each layer: the same count everywhere that ``warm_budget_bytes``
    holds at ``slot_nbytes`` a warm slot (:func:`mlx_tier.engine.warm_pool.pool_slot_nbytes`),
    each capped at the layer's experts not in its hot tier."""
    per_layer = int(warm_budget_bytes) // (len(hot_slots) * slot_nbytes)
    return [min(per_layer, e - h) for h, e in zip(hot_slots, experts)]


def build_two_tier(blocks: list[tuple[str, nn.Module]], parents: list[nn.Module], layers: list[LayerCache],
                   budgets: tuple[int, int, bool], store, config, warm_kernel,
                   replace: Callable[[str, nn.Module], None]) -> TwoTierCache:
    """Turn single-tier layers into two-tier ones and swap the model's expert blocks.

    Args:
        blocks: ``(path, mlx-lm expert block)`` per MoE layer.
        parents: the module holding each block (prefetch finds the router there).
        layers: the hot tiers, as :func:`mlx_tier.engine.load.tier_model` built them.
        budgets: the hot and warm budgets in bytes
            (:func:`mlx_tier.engine.budgets.tier_budgets`), and whether the hot
            one was configured as slots (:attr:`ExpertCache.budget_in_slots`).
        config: the :class:`mlx_tier.engine.load.TierConfig` (``transfer_costs``, ``prefetch``).
        warm_kernel: what computes warm experts (:mod:`mlx_tier.kernels.registry`; ``None``: MLX ops).
        replace: sets the module at a parameter path.

    Raises:
        BudgetError: a tier over its budget.
    """
    budget_bytes, warm_budget_bytes, in_slots = budgets
    slot_nbytes = max(pool_slot_nbytes(layer.tensors, warm_kernel is not None) for layer in layers)  # warm dtypes
    warm = warm_slots_for(warm_budget_bytes, [x.num_slots for x in layers], [x.num_experts for x in layers],
                          slot_nbytes)
    stats = TwoTierStats()
    costs = config.transfer_costs or TransferCosts()
    tier_layers = []
    stream = mx.new_stream(mx.cpu)  # the warm tier's, beside the default stream (one for all layers)
    for layer, w in zip(layers, warm):
        layer.stats = stats
        tier_layers.append(TwoTierLayer(layer, w, costs, warm_kernel, stream))
    wrappers = [TwoTierExperts(block, t) for (_, block), t in zip(blocks, tier_layers)]
    for (path, _), wrapper in zip(blocks, wrappers):
        replace(path, wrapper)
        wrapper.show(path)
    widen_memory_limit(sum(t.warm.resident_bytes for t in tier_layers))
    if config.prefetch:
        links = link_layers(parents, [b for _, b in blocks], layers, BackgroundReader())
        for i, (wrapper, link) in enumerate(zip(wrappers, links)):
            wrapper._prefetch = WarmAwarePrefetch(link, tier_layers[i + 1]) if link is not None else None
    return TwoTierCache(tier_layers, stats, budget_bytes, warm_budget_bytes, store, in_slots)
