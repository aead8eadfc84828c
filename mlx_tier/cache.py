"""Hot tier: per-layer slabs of expert slots, an expert -> slot table, counters.

For each MoE layer and each stacked expert tensor (``weight``, ``scales``,
``biases``, per-expert ``bias``) the cache owns a slab ``[S, ...]`` holding S
experts. The expert blocks then run mlx-lm's own ``gather_qmm``/``gather_mm``
on the slab with *slot* indices instead of expert indices: identical math to
the fully resident model.

Mechanism only: which expert leaves a slot is the policy's choice
(:mod:`mlx_tier.policy`); what is read and how is the store's
(:mod:`mlx_tier.store`).

Lazy-graph hazard: MLX evaluates lazily, so a slot must not be overwritten
before the computation that reads its old contents is evaluated. Every write
first evaluates the layer's last pending output (:meth:`LayerCache.settle`).
In-place slot writes stay cheap only while no other array references the slab,
so nothing outside this module holds a slab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .policy import make_policy
from .store import ExpertStore, ReadStats, TensorInfo


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
    read_seconds: float = 0.0  # wall time spent waiting on reads
    rounds: int = 0  # extra expert-block passes when a layer needed more experts than slots

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(frozen=True)
class SlabTensor:
    """One stacked expert tensor of one layer and where its slab lives.

    Attributes:
        module: the mlx-lm (Quantized)SwitchLinear that reads the slab.
        attr: its attribute name (``"weight"``, ``"scales"``, ``"biases"``, ``"bias"``).
        info: the stacked tensor on disk, shape ``[E, ...]``.
        dtype: dtype of the slab (the compute dtype for floating tensors).
    """

    module: nn.Module
    attr: str
    info: TensorInfo
    dtype: mx.Dtype

    def slot_nbytes(self) -> int:
        return int(np.prod(self.info.shape[1:])) * self.dtype.size


def _to_mx(buf: np.ndarray, info: TensorInfo, dtype: mx.Dtype) -> mx.array:
    a = mx.array(buf)
    if info.dtype == "BF16":
        a = a.view(mx.bfloat16)
    return a if a.dtype == dtype else a.astype(dtype)


class LayerCache:
    """The resident experts of one MoE layer.

    Args:
        layer: index among the model's MoE layers (for reporting).
        tensors: name on disk -> SlabTensor, every stacked tensor of the layer.
        num_experts: E.
        num_slots: S, 1 <= S <= E.
        store: the cold tier.
        stats: shared counters.
        policy: eviction policy name (:func:`mlx_tier.policy.make_policy`).
    """

    def __init__(
        self,
        layer: int,
        tensors: dict[str, SlabTensor],
        num_experts: int,
        num_slots: int,
        store: ExpertStore,
        stats: CacheStats,
        policy: str = "lru",
    ):
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"slots must be in [1, {num_experts}], got {num_slots}")
        self.layer = layer
        self.tensors = tensors
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.store = store
        self.policy_name = policy
        self.policy = make_policy(policy, num_slots)
        self.stats = stats
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)  # expert -> slot
        self.free = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.pending: mx.array | None = None  # last output that read the slabs
        # Once every expert is resident nothing can miss: the expert -> slot
        # remap then runs lazily on the device (no host sync per layer), and
        # the router outputs are kept to count hits later, off the hot path.
        self.lut: mx.array | None = None  # [E] uint32 slot of each expert
        self.recorder = None  # a TraceRecorder while a routing trace is recorded
        self._uncounted: list[mx.array] = []
        for t in tensors.values():
            # Lazy zeros: memory is taken at the first write, not at load.
            setattr(t.module, t.attr, mx.zeros((num_slots, *t.info.shape[1:]), dtype=t.dtype))

    @property
    def slot_nbytes(self) -> int:
        """Resident bytes of one expert (all its tensors, compute dtype)."""
        return sum(t.slot_nbytes() for t in self.tensors.values())

    @property
    def resident_bytes(self) -> int:
        return self.num_slots * self.slot_nbytes

    def resident_experts(self) -> list[int]:
        return [int(e) for e in np.flatnonzero(self.slot_of >= 0)]

    def all_resident(self) -> bool:
        return self.lut is not None and self.recorder is None

    def defer_count(self, indices: mx.array) -> None:
        """Remember a fully-resident call's router output; counted in :meth:`count_deferred`."""
        self._uncounted.append(indices)
        if len(self._uncounted) >= 256:
            self.count_deferred()

    def count_deferred(self) -> None:
        """Count the hits of remembered fully-resident calls (may evaluate them)."""
        for a in self._uncounted:
            self.stats.hits += len(np.unique(np.array(a)))
        self._uncounted.clear()

    def settle(self) -> None:
        """Evaluate the last computation that read the slabs (see module doc)."""
        if self.pending is not None:
            mx.eval(self.pending)
            self.pending = None

    def _ensure(self, group: list[int]) -> None:
        """Make every expert in ``group`` resident (``len(group) <= S``).

        The experts are read before any bookkeeping changes, so a failed read
        leaves the table as it was; a failed write resets the layer (nothing
        is ever marked resident over stale slot contents).
        """
        missing = []
        for e in group:
            if self.slot_of[e] >= 0:
                self.stats.hits += 1
                self.policy.access(e)
            else:
                missing.append(e)
        if not missing:
            return
        if self.num_slots == self.num_experts:
            # Room for every expert: read the whole layer now, in one batch, so
            # the layer turns fully resident (lazy remap, no host sync) at once.
            missing = [e for e in range(self.num_experts) if self.slot_of[e] < 0]
        raw = self.store.read_experts(list(self.tensors), missing)
        self.settle()
        slots = []
        for e in missing:
            if self.free:
                s = self.free.pop()
            else:
                victim = self.policy.evict(protected=group)
                s = int(self.slot_of[victim])
                self.slot_of[victim] = -1
                self.stats.evictions += 1
            self.slot_of[e] = s
            self.policy.insert(e)
            slots.append(s)
        self.stats.misses += len(missing)
        try:
            written = []
            for name, t in self.tensors.items():
                slab = t.module[t.attr]
                new = _to_mx(raw[name], t.info, t.dtype)  # [len(missing), ...]
                for i, s in enumerate(slots):
                    # In place (the module holds `slab`); a slice write is ~10x
                    # cheaper than a scatter with an index array on the CPU backend.
                    slab[s : s + 1] = new[i : i + 1]
                written.append(slab)
            mx.eval(written)
        except BaseException:
            self.reset()
            raise
        if not self.free and self.num_slots == self.num_experts:
            self.lut = mx.array(self.slot_of.astype(np.uint32))

    def reset(self) -> None:
        """Forget every resident expert (slab contents are then unused)."""
        self.slot_of[:] = -1
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.policy = make_policy(self.policy_name, self.num_slots)
        self.lut = None

    def assign(self, idx: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Make the experts in ``idx`` resident and yield slot indices.

        Args:
            idx: router top-k expert ids, any shape ``[..., k]``, integer.

        Yields:
            ``(slots, mask)``: ``slots`` has ``idx``'s shape and dtype and gives
            each entry's slot. ``mask`` is ``None`` when every needed expert fit
            at once (one pass). Otherwise the needed experts exceed S and are
            served in rounds: ``mask`` marks the entries valid in this round
            (other entries point at an arbitrary slot). The caller must use the
            round's result, and set :attr:`pending`, before asking for the next.
        """
        if self.recorder is not None:
            self.recorder.add(self.layer, idx)
        need = np.unique(idx).tolist()
        if len(need) <= self.num_slots:
            self._ensure(need)
            yield self.slot_of[idx].astype(idx.dtype), None
            return
        # Resident experts first, so the first round reads nothing.
        order = [e for e in need if self.slot_of[e] >= 0] + [e for e in need if self.slot_of[e] < 0]
        for i in range(0, len(order), self.num_slots):
            group = order[i : i + self.num_slots]
            self._ensure(group)
            self.stats.rounds += 1
            mask = np.isin(idx, group)
            yield np.where(mask, self.slot_of[idx], 0).astype(idx.dtype), mask


class ExpertCache:
    """All layers' caches of one model, their budget and shared counters.

    Attributes:
        layers: one LayerCache per MoE layer, in model order.
        stats: counters summed over layers.
        budget_bytes: the configured budget; resident expert bytes never exceed it.
    """

    def __init__(self, layers: list[LayerCache], stats: CacheStats, budget_bytes: int, store: ExpertStore):
        self.layers = layers
        self._stats = stats
        self.budget_bytes = budget_bytes
        self.store = store
        assert self.resident_bytes <= budget_bytes, "slab sizing exceeded the budget"

    @property
    def stats(self) -> CacheStats:
        """The shared counters, with every deferred hit counted and the
        store's read totals (the store serves only this cache)."""
        for layer in self.layers:
            layer.count_deferred()
        self._stats.bytes_read = self.store.stats.bytes_read
        self._stats.read_seconds = self.store.stats.read_seconds
        return self._stats

    @property
    def slots_per_layer(self) -> int:
        return self.layers[0].num_slots

    @property
    def num_experts(self) -> int:
        return self.layers[0].num_experts

    @property
    def resident_bytes(self) -> int:
        """Bytes of all slabs once allocated (the most the cache can hold)."""
        return sum(layer.resident_bytes for layer in self.layers)

    def start_trace(self, source: str = ""):
        """Record the router's top-k of every layer call until :meth:`stop_trace`.

        Recording needs the expert ids on the host, so fully resident layers
        leave their lazy path meanwhile (one sync per layer per step).
        """
        from .trace import TraceRecorder

        rec = TraceRecorder(len(self.layers), self.num_experts, source=source)
        for layer in self.layers:
            layer.recorder = rec
        return rec

    def stop_trace(self):
        """Stop recording; returns the :class:`~mlx_tier.trace.Trace`."""
        rec = self.layers[0].recorder
        for layer in self.layers:
            layer.recorder = None
        return rec.trace() if rec is not None else None

    def reset_stats(self) -> None:
        stats = self.stats
        for k, v in asdict(CacheStats()).items():
            setattr(stats, k, v)
        self.store.stats = ReadStats()
