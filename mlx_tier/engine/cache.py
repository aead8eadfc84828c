"""Hot tier: per-layer slabs of expert slots, an expert -> slot table, counters.

For each MoE layer and each stacked expert tensor (``weight``, ``scales``,
``biases``, per-expert ``bias``) the cache owns a slab ``[S, ...]`` holding S
experts. The expert blocks then run mlx-lm's own ``gather_qmm``/``gather_mm``
on the slab with *slot* indices instead of expert indices: identical math to
the fully resident model.

Mechanism only: which expert leaves a slot is the policy's choice
(:mod:`mlx_tier.policy.eviction`); what is read and how is the store's
(:mod:`mlx_tier.engine.store`).

Lazy-graph hazard: MLX evaluates lazily, so a slot must not be overwritten
before the computation that reads its old contents is evaluated. Every write
first evaluates the layer's last pending output (:meth:`LayerCache.settle`), and
a layer call settles the one its own output replaces, so no reader of the
slots is left unevaluated and unknown.
In-place slot writes stay cheap only while no other array references the slab,
so nothing outside this module holds a slab. On MLX's CPU backend a slot is
written through a numpy view of the slab's buffer (one copy, no MLX op), once the
slab is a buffer no other array shares (:meth:`LayerCache._host_slab`); the
casts numpy makes as MLX does are made there (:func:`mlx_tier.engine.slabs.host_cast`), the others
and other devices write through MLX.

Wide rounds: when a layer call needs more experts than its slots and a host
kernel computes them (the CPU kernel: eager), rounds after the first hold
:attr:`LayerCache.width` experts in scratch slabs shared by the owner's layers
(:meth:`LayerCache.assign_wide`) instead of S through the slots; the last
round's experts then enter the slots. The scratch has two halves: the next
round is read into one (tensors kept as on disk read in place, no copy) while
the round computes from the other.

Dtypes follow the model's: a slab holds its experts as the resident mlx-lm
model would (as stored, or through the casts made since:
:mod:`mlx_tier.engine.dtypes`), and :meth:`LayerCache.cast` casts a layer's
slabs when the model is cast after load, so experts read later go through the
same casts as those already resident.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from mlx_tier.engine.cache_stats import CacheStats
from mlx_tier.engine.prefetch import PrefetchedRead
from mlx_tier.engine.slabs import SlabTensor, host_cast, slab_role, to_mx
from mlx_tier.engine.store import ExpertStore
from mlx_tier.policy.eviction import DEFAULT_POLICY, PolicySpec

if TYPE_CHECKING:  # the owner of a layer's cache (it imports this module)
    from mlx_tier.engine.expert_cache import ExpertCache


class LayerCache:
    """The resident experts of one MoE layer.

    Args:
        layer: index among the model's MoE layers (for reporting).
        tensors: name on disk -> SlabTensor, every stacked tensor of the layer.
        num_experts: E.
        num_slots: S, 1 <= S <= E.
        store: the cold tier.
        stats: shared counters.
        policy: how this layer's eviction policy is made (:class:`mlx_tier.policy.eviction.PolicySpec`).

    Attributes:
        owner: the :class:`~mlx_tier.engine.expert_cache.ExpertCache` whose budget the slabs count against
            (set by it; ``None`` for a layer on its own).
    """

    def __init__(
        self,
        layer: int,
        tensors: dict[str, SlabTensor],
        num_experts: int,
        num_slots: int,
        store: ExpertStore,
        stats: CacheStats,
        policy: PolicySpec | None = None,
    ):
        if not 1 <= num_slots <= num_experts:
            raise ValueError(f"slots must be in [1, {num_experts}], got {num_slots}")
        self.layer = layer
        self.tensors = tensors
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.store = store
        self.policy_spec = policy or PolicySpec(DEFAULT_POLICY)
        self.policy = self.policy_spec.make(layer, num_slots)
        # Uses of each expert, one per (token, k) entry routed to it: the unit
        # of a profile (mlx_tier.routing.profile). Counted per call, off the slab path.
        self.counts = np.zeros(num_experts, dtype=np.int64)
        self.stats = stats
        self.slot_of = np.full(num_experts, -1, dtype=np.int64)  # expert -> slot
        self.free = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.pending: mx.array | None = None  # last output that read the slabs
        # Called with the layer index before the layer computes (ExpertCache.set_layer_hook).
        self.hook = None
        # Once every expert is resident nothing can miss: the expert -> slot
        # remap then runs lazily on the device (no host sync per layer), and
        # the router outputs are kept to count hits later, off the hot path --
        # or, with a device-side remap (mlx_tier.kernels.registry.remap_for), only its
        # per-call [E] counts, summed on the device (add_device_counts).
        self.lut: mx.array | None = None  # [E] uint32 slot of each expert
        self.recorder = None  # a TraceRecorder while a routing trace is recorded
        self._uncounted: list[mx.array] = []
        self._device_uses: mx.array | None = None  # [E] uint32 uses summed over calls, lazy
        self._device_hits: mx.array | None = None  # [] uint32 sum over calls of experts used
        self._device_calls = 0  # calls summed since the last count_deferred
        # Prefetch (mlx_tier.engine.prefetch): a background read of predicted experts
        # started by the previous layer, or of the next round's experts (read
        # ahead, see assign), then, once waited for, the rows of each read not
        # yet used: [(raw arrays, expert -> row, raw bytes of one expert, predicted)].
        self.incoming = None  # a PrefetchedRead or None
        self._prefetched: list[tuple[dict[str, np.ndarray], dict[int, int], int, bool]] = []
        # Reads the next round's experts while a round computes (assign); None: off.
        self.reader = None  # a mlx_tier.engine.prefetch.BackgroundReader
        self.owner: ExpertCache | None = None
        self._private: dict[str, mx.array] = {}  # name -> the slab whose buffer no other array shares
        # Experts a round computes (assign_wide); num_slots: rounds of slots only (assign).
        self.width = num_slots
        self._scratch: dict = {}  # a layer's own scratch slabs when it has no owner (scratch())
        for name, t in tensors.items():
            # Lazy zeros: memory is taken at the first write, not at load.
            setattr(t.module, t.attr, mx.zeros((num_slots, *t.info.shape[1:]), dtype=t.dtype))
            self._private[name] = t.module[t.attr]

    @property
    def slot_nbytes(self) -> int:
        """Resident bytes of one expert (all its tensors, compute dtype)."""
        return sum(t.slot_nbytes() for t in self.tensors.values())

    @property
    def raw_expert_nbytes(self) -> int:
        """Bytes of one expert as stored on disk (all its tensors): what a read of it holds."""
        return sum(t.info.expert_nbytes() for t in self.tensors.values())

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

    def add_device_counts(self, uses: mx.array) -> None:
        """Remember a fully-resident call's per-expert uses without a host sync.

        Args:
            uses: ``[E]`` uint32, entries of this call routed to each expert
                (the ``counts`` output of :func:`mlx_tier.kernels.metal.slot_remap`).

        Two lazy device arrays hold the running sums: the uses, and the hits
        (experts used by each call, summed over calls: the unit of
        :class:`~mlx_tier.engine.cache_stats.CacheStats`, as :meth:`count_deferred` counts router outputs).
        Every 256 calls their graph is handed to ``mx.async_eval``, which
        evaluates it without waiting, so it stays short. uint32 sums: exact
        until 2**32 entries of one layer between two reads of the stats.
        """
        hits = (uses > 0).astype(mx.uint32).sum()  # [] experts this call used
        if self._device_uses is None:
            self._device_uses, self._device_hits = uses, hits
        else:
            self._device_uses, self._device_hits = self._device_uses + uses, self._device_hits + hits
        self._device_calls += 1
        if self._device_calls % 256 == 0:
            mx.async_eval(self._device_uses, self._device_hits)

    def deferred_arrays(self) -> list[mx.array]:
        """The lazy arrays :meth:`count_deferred` would read: remembered router
        outputs and the device-side sums. Evaluating every layer's in one
        ``mx.eval`` (:attr:`ExpertCache.stats`) waits for the device once, not
        twice per layer."""
        device = [self._device_uses, self._device_hits] if self._device_uses is not None else []
        return [*self._uncounted, *device]

    def count_deferred(self) -> None:
        """Count the hits and uses of remembered fully-resident calls (router
        outputs and device-side counts; evaluates them unless already
        evaluated: see :meth:`deferred_arrays`)."""
        for a in self._uncounted:
            uses = np.bincount(np.array(a).reshape(-1), minlength=self.num_experts)
            self.stats.hits += int(np.count_nonzero(uses))
            self.counts += uses
        self._uncounted.clear()
        if self._device_uses is not None:
            self.stats.hits += int(self._device_hits.item())
            self.counts += np.array(self._device_uses).astype(np.int64)
            self._device_uses = self._device_hits = None
            self._device_calls = 0

    def accept_prefetch(self, read) -> None:
        """Hand this layer an in-flight background read of predicted experts
        (a :class:`mlx_tier.engine.prefetch.PrefetchedRead`); its rows serve the next
        call's misses. Any earlier unused batch is dropped first."""
        self.end_call()
        self.stats.prefetch_predicted += len(read.experts)
        self.incoming = read

    def discard_pending(self) -> None:
        """Forget the last output that read the slabs without evaluating it
        (after a failed step: evaluating it would fail again)."""
        self.pending = None

    def settle(self) -> None:
        """Evaluate the last computation that read the slabs (see module doc).

        One that fails (a step that raised, e.g. a dtype MLX cannot compute) is
        dropped: it can never read the slots, and its error was the caller's.
        """
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                mx.eval(pending)
            except RuntimeError:
                pass

    def _ensure(self, group: list[int]) -> None:
        """Make every expert in ``group`` resident (``len(group) <= S``).

        The experts are read before any bookkeeping changes, so a failed read
        leaves the table as it was; a failed write resets the layer (nothing
        is ever marked resident over stale slot contents).
        """
        missing = self._hits(group)
        if not missing:
            return
        if self.num_slots == self.num_experts:
            # Room for every expert: read the whole layer now, in one batch, so
            # the layer turns fully resident (lazy remap, no host sync) at once.
            missing = [e for e in range(self.num_experts) if self.slot_of[e] < 0]
        batches = self._read(missing)
        self.settle()
        slots = []
        for e in missing:
            s = self._take_slot(protected=group)
            self.slot_of[e] = s
            self.policy.insert(e)
            slots.append(s)
        self.stats.misses += len(missing)
        self._write(batches, dict(zip(missing, slots)))
        self._update_lut()

    def _hits(self, group: list[int]) -> list[int]:
        """Count ``group``'s resident experts as hits (the policy told); returns the others."""
        missing = []
        for e in group:
            if self.slot_of[e] >= 0:
                self.stats.hits += 1
                self.policy.access(e)
            else:
                missing.append(e)
        return missing

    def _take_slot(self, protected: list[int]) -> int:
        """A free slot, else the slot of the policy's victim (evicted and counted)."""
        if self.free:
            return self.free.pop()
        victim = self.policy.evict(protected=protected)
        s = int(self.slot_of[victim])
        self.slot_of[victim] = -1
        self.stats.evictions += 1
        return s

    def _write(self, batches, slot_of_new: dict[int, int]) -> None:
        """Copy read experts into their slots: ``batches`` as :meth:`_read` returns
        them, ``slot_of_new`` expert -> slot. A failed write resets the layer."""
        try:
            written = []
            for name, t in self.tensors.items():
                cast = host_cast(t.info, t.casts)
                host = self._host_slab(name) if cast is not None else None
                slab = t.module[t.attr]
                for raw, rows in batches:
                    if host is not None:
                        for i, e in rows:  # one copy a row, no MLX op (the CPU kernel reads these views)
                            host[slot_of_new[e]] = cast(raw[name][i])
                        continue
                    new = to_mx(raw[name], t.info, t.casts)  # [rows in raw, ...]
                    for i, e in rows:
                        s = slot_of_new[e]
                        # In place (the module holds `slab`); a slice write is ~10x
                        # cheaper than a scatter with an index array on the CPU backend.
                        slab[s : s + 1] = new[i : i + 1]
                written.append(slab)
            mx.eval(written)
        except BaseException:
            self.reset()
            raise

    def _host_slab(self, name: str) -> np.ndarray | None:
        """A writable numpy view of slab ``name``, on MLX's CPU backend only: a slot is then
        written with one copy and no MLX op. The slab is first made a buffer of this
        cache's own (MLX shares buffers among arrays: a ``copy.deepcopy`` of the model,
        a no-op ``astype``), once, and known by identity after: a slab replaced since
        (a cast) is made its own again."""
        t = self.tensors[name]
        slab = t.module[t.attr]
        if mx.default_device() != mx.cpu or slab.dtype == mx.bfloat16:  # numpy has no bfloat16
            return None
        if self._private.get(name) is not slab:
            mx.eval(slab)
            slab = mx.array(np.asarray(slab))  # a copy: its buffer is referenced by no other array
            setattr(t.module, t.attr, slab)
            self._private[name] = slab
        view = np.asarray(slab)
        return view if view.flags.c_contiguous and view.flags.writeable else None

    def _update_lut(self) -> None:
        """Once every expert is resident, switch to the lazy device-side remap."""
        if not self.free and self.num_slots == self.num_experts:
            self.lut = mx.array(self.slot_of.astype(np.uint32))

    def _read(self, missing: list[int], into: dict[str, np.ndarray] | None = None
              ) -> list[tuple[dict[str, np.ndarray], list[tuple[int, int]]]]:
        """Raw bytes of ``missing``: from the prefetched or read-ahead batches where
        they hold them (waiting for one in flight), the rest read now (into ``into``'s
        rows, name -> ``[>= len(missing), ...]``, when the rest are all of ``missing``:
        its rows are then ``missing``'s order). The wait and the read are the forward
        pass's stall (``stats.stall_seconds``).

        Returns:
            ``[(name -> raw array [R, ...], [(row, expert), ...])]``: which row
            of which batch holds each missing expert.

        Raises:
            CheckpointError, OSError: the store's read failed (a failed
            prefetch is not an error: those experts are read now).
        """
        t0 = time.perf_counter()
        if self.incoming is not None:
            self._take_incoming()
        batches = []
        rest = missing
        for raw, row_of, _, predicted in self._prefetched:
            used = [(row_of.pop(e), e) for e in rest if e in row_of]  # a row serves one miss
            if used:
                batches.append((raw, used))
                self.stats.prefetch_used += len(used) if predicted else 0
                taken = {e for _, e in used}
                rest = [e for e in rest if e not in taken]
        self._prefetched = [b for b in self._prefetched if b[1]]  # spent reads freed at once
        if rest:
            names = list(self.tensors)
            raw = (self.store.read_experts(names, rest, out=into) if into and len(rest) == len(missing)
                   else self.store.read_experts(names, rest))
            batches.append((raw, list(enumerate(rest))))
        self.stats.stall_seconds += time.perf_counter() - t0
        return batches

    def _take_incoming(self) -> None:
        """Wait for the in-flight read; keep its rows (none if it failed)."""
        pending, self.incoming = self.incoming, None
        raw = pending.result()
        if raw is not None:
            self._prefetched.append((raw, {e: i for i, e in enumerate(pending.experts)}, pending.expert_nbytes,
                                     pending.predicted))

    def _read_ahead(self, experts: list[int], into: dict[str, np.ndarray] | None = None) -> None:
        """Start reading ``experts`` (the next round's, none resident) on :attr:`reader`
        (into ``into``'s rows, in order, when no prefetch holds any of them);
        :meth:`_read` serves them from it. Bytes only: slots, the policy and the
        hit/miss counts change when the round comes (:meth:`_ensure`), as without."""
        if self.reader is None or not experts:
            return
        if self.incoming is not None:  # at most one read in flight (BackgroundReader)
            t0 = time.perf_counter()
            self._take_incoming()
            self.stats.stall_seconds += time.perf_counter() - t0
        wanted = experts
        experts = [e for e in experts if not any(e in row_of for _, row_of, _, _ in self._prefetched)]
        if not experts:  # a prefetch holds them all already
            return
        self.stats.read_ahead += len(experts)
        out = into if len(experts) == len(wanted) else None
        self.incoming = PrefetchedRead(experts, self.reader.submit(self.store, list(self.tensors), experts, out),
                                       self.raw_expert_nbytes, predicted=False)

    def end_call(self) -> None:
        """Drop the prefetched experts this layer call did not use.

        Counts their bytes in ``stats.prefetch_wasted_bytes``; a read still in
        flight is waited for first (counted as stall), so that at most one
        batch is ever in flight (see :class:`mlx_tier.engine.prefetch.BackgroundReader`).
        """
        if self.incoming is not None:
            t0 = time.perf_counter()
            self._take_incoming()
            self.stats.stall_seconds += time.perf_counter() - t0
        for _, row_of, expert_nbytes, _ in self._prefetched:
            self.stats.prefetch_wasted_bytes += len(row_of) * expert_nbytes
        self._prefetched = []

    def reset(self) -> None:
        """Forget every resident expert (slab contents are then unused)."""
        self.slot_of[:] = -1
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.policy = self.policy_spec.make(self.layer, self.num_slots)
        self.lut = None

    def resize(self, num_slots: int) -> None:
        """Hold ``num_slots`` slots from now on (``1 <= num_slots <= E``).

        Growing keeps every resident expert in its slot and adds free slots;
        shrinking forgets the experts of the slots dropped (neither hits nor
        evictions: the caller lends and takes back room, see
        :meth:`mlx_tier.engine.expert_cache.ExpertCache.lend_slots`). Every slab is
        first made anew at its new size, its kept rows copied into a buffer of its
        own (the old one is freed once its readers are done: :meth:`settle` first);
        only then are they swapped in, so a failed allocation leaves the layer as it
        was. The policy is made anew for the new count, the kept experts inserted in
        slot order (their use counts start again). Which slot holds an expert never
        changes what a kernel computes from it; the CPU kernel's rounds follow the
        slot count, so it sums a token's experts in another order after a resize
        (within its bound).

        Raises:
            ValueError: ``num_slots`` outside ``[1, E]``.
        """
        if not 1 <= num_slots <= self.num_experts:
            raise ValueError(f"slots must be in [1, {self.num_experts}], got {num_slots}")
        if num_slots == self.num_slots:
            return
        self.settle()
        self._end_read_ahead()
        slabs = {name: self._resized(name, num_slots) for name in self.tensors}
        mx.eval(list(slabs.values()))
        for name, new in slabs.items():  # nothing below allocates: the swap does not fail half way
            t = self.tensors[name]
            setattr(t.module, t.attr, new)
            self._private[name] = new
        self.slot_of[self.slot_of >= num_slots] = -1
        self.num_slots = num_slots
        kept = sorted(np.flatnonzero(self.slot_of >= 0).tolist(), key=lambda e: self.slot_of[e])
        used = {int(self.slot_of[e]) for e in kept}
        self.free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self.policy = self.policy_spec.make(self.layer, num_slots)
        for e in kept:
            self.policy.insert(e)
        self.lut = None
        self._update_lut()

    def _resized(self, name: str, num_slots: int) -> mx.array:
        """Slab ``name`` at ``num_slots`` slots, its first ``min(num_slots, S)`` rows copied
        from the current one, in a buffer no other array shares (lazy on the MLX path)."""
        t = self.tensors[name]
        old = t.module[t.attr]
        keep = min(num_slots, self.num_slots)
        host = self._host_slab(name)
        if host is not None:  # the kept rows copied through a host view, no MLX op (CPU backend)
            new = mx.zeros((num_slots, *old.shape[1:]), old.dtype)
            mx.eval(new)
            view = np.asarray(new)
            if view.flags.c_contiguous and view.flags.writeable:
                view[:keep] = host[:keep]
                return new
        rows = old[mx.arange(keep)]  # a gather: a copy (a slice would be a view of the old buffer)
        if num_slots > keep:
            rows = mx.concatenate([rows, mx.zeros((num_slots - keep, *old.shape[1:]), old.dtype)])
        return rows

    def slot_nbytes_as(self, dtypes: dict[str, mx.Dtype]) -> int:
        """Bytes of one expert with the tensors named in ``dtypes`` in those dtypes."""
        return sum(t.slot_nbytes(dtypes.get(name)) for name, t in self.tensors.items())

    def cast(self, dtypes: dict[str, mx.Dtype]) -> None:
        """Cast the slabs named in ``dtypes`` (name on disk -> dtype), resident
        experts included, as the model's parameters were cast; experts read
        later go through the same cast (:attr:`SlabTensor.casts`). The owner's
        budget is checked first (:meth:`mlx_tier.engine.expert_cache.ExpertCache.admit_cast`).

        Raises:
            BudgetError: the cast slabs would exceed a byte budget.
        """
        if self.owner is not None:
            self.owner.admit_cast(self, dtypes)
        self.settle()  # the old slabs' last readers first
        slabs = []
        for name, dtype in dtypes.items():
            t = self.tensors[name] = self.tensors[name].cast_to(dtype)
            setattr(t.module, t.attr, t.module[t.attr].astype(dtype))
            self._private.pop(name, None)  # the old slab freed; the new one is made its own at a write
            slabs.append(t.module[t.attr])
        mx.eval(slabs)
        pool = self._scratch_pool()
        roles = {slab_role(name) for name in dtypes}
        for key in [k for k in pool if k[0] in roles]:  # scratch of the old dtypes: made anew at use
            del pool[key]

    def __deepcopy__(self, memo) -> LayerCache:
        """A copy with the same resident experts (slabs copied) and counters; the
        last output that read the slabs, and an unfinished or unused prefetch,
        stay with the original (the copy reads those experts itself)."""
        new = copy.copy(self)
        memo[id(self)] = new
        skip = {"incoming": None, "_prefetched": [], "pending": None, "_private": {}, "_scratch": {}}
        for key, value in vars(self).items():
            setattr(new, key, skip[key] if key in skip else copy.deepcopy(value, memo))
        self._private = {}  # the copy's slabs share these buffers: neither writes them in place now
        return new

    def prewarm(self, experts: list[int]) -> int:
        """Read ``experts`` (hottest first) into free slots before any use.

        Only experts not yet resident, and at most as many as there are free
        slots, are read; they enter the policy coldest first, so the hottest
        is the most recently used. :func:`mlx_tier.routing.simulate.simulate_layer`
        mirrors this (its ``prewarm``). Not hits nor misses. Returns how many
        experts were read.

        Raises:
            CheckpointError, OSError: a failed read (nothing is marked resident).
        """
        experts = [int(e) for e in experts if self.slot_of[e] < 0][: len(self.free)]
        if not experts:
            return 0
        raw = self.store.read_experts(list(self.tensors), experts)
        self.settle()
        slots = [self.free.pop() for _ in experts]
        self._write([(raw, list(enumerate(experts)))], dict(zip(experts, slots)))
        for e, s in zip(experts, slots):
            self.slot_of[e] = s
        for e in reversed(experts):
            self.policy.insert(e)
        self._update_lut()
        return len(experts)

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
        self._drop_scratch_reads()
        need = self._need(idx)
        if len(need) <= self.num_slots:
            self._ensure(need)
            yield self.slot_of[idx].astype(idx.dtype), None
            return
        # Resident experts first, so the first round reads nothing.
        order = [e for e in need if self.slot_of[e] >= 0] + [e for e in need if self.slot_of[e] < 0]
        S = self.num_slots
        try:
            for i in range(0, len(order), S):
                group = order[i : i + S]
                self._ensure(group)
                self.stats.rounds += 1
                # The next round's experts are read while this one computes (none of them
                # is resident: resident experts all come first, and there are at most S).
                self._read_ahead(order[i + S : i + 2 * S])
                mask = np.isin(idx, group)
                yield np.where(mask, self.slot_of[idx], 0).astype(idx.dtype), mask
        finally:  # a call abandoned between rounds (an error): its read ahead ends here, unused
            self._end_read_ahead()

    def _end_read_ahead(self) -> None:
        """Wait for a read of a next round still in flight and forget it (a prediction's stays)."""
        if self.incoming is not None and not self.incoming.predicted:
            self.incoming.result()
            self.incoming = None

    def _drop_scratch_reads(self) -> None:
        """Forget reads into the scratch left by a call abandoned between rounds (its
        generator not closed): the halves are shared and rewritten by other layers since.
        A read of the next round still in flight is waited for first."""
        self._end_read_ahead()
        pool = self._scratch_pool()
        if self._prefetched and pool:
            views = [got[1] for got in pool.values()]
            self._prefetched = [b for b in self._prefetched if not any(a.base is v for a in b[0].values() for v in views)]

    def _need(self, idx: np.ndarray) -> list[int]:
        """The distinct experts of ``idx`` (router top-k ids ``[..., k]``), ascending; the
        call's uses counted (and recorded in a trace)."""
        if self.recorder is not None:
            self.recorder.add(self.layer, idx)
        uses = np.bincount(idx.reshape(-1), minlength=self.num_experts)  # [E] uses in this call
        self.counts += uses
        return np.flatnonzero(uses).tolist()  # distinct experts, ascending (as np.unique gave)

    def widens(self) -> bool:
        """Whether :meth:`assign_wide` serves this layer: :attr:`width` is above the slots,
        and every slab is written from the host (MLX's CPU backend, casts numpy makes)."""
        return (self.width > self.num_slots and mx.default_device() == mx.cpu
                and all(host_cast(t.info, t.casts) is not None and t.dtype != mx.bfloat16
                        for t in self.tensors.values()))

    def _scratch_pool(self) -> dict:
        """Scratch slabs by (role in the block, shape, dtype): the owner's, shared by its layers."""
        return self.owner._scratch if self.owner is not None else self._scratch

    def scratch(self, name: str, half: int = 0) -> tuple[mx.array, np.ndarray]:
        """Scratch slab ``half`` (0 or 1: consecutive rounds alternate) ``[width, ...]`` of
        tensor ``name`` (shared by the owner's layers of the same shape: one layer
        computes at a time) and a writable numpy view of it."""
        t = self.tensors[name]
        slab = t.module[t.attr]
        pool = self._scratch_pool()
        key = (slab_role(name), tuple(slab.shape[1:]), slab.dtype, half)
        got = pool.get(key)
        if got is None or got[0].shape[0] < self.width:
            host = self._host_slab(name)
            arr = mx.array(np.zeros((self.width, *host.shape[1:]), host.dtype))  # its own buffer
            mx.eval(arr)
            view = np.asarray(arr)
            if not (view.flags.c_contiguous and view.flags.writeable):
                raise RuntimeError("a scratch slab has no writable host view")
            got = pool[key] = (arr, view)
        return got

    def _stored_as_is(self) -> list[str]:
        """The tensors whose slabs hold the bytes on disk unchanged (no cast): those a
        wide round reads straight into its scratch slab."""
        return [name for name, t in self.tensors.items()
                if t.info.dtype != "BF16" and t.dtype == t.info.mx_dtype]

    def _destination(self, half: int) -> dict[str, np.ndarray]:
        """Scratch ``half``'s views of the tensors read into it as they are on disk."""
        return {name: self.scratch(name, half)[1] for name in self._stored_as_is()}

    def assign_wide(self, idx: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray | None, dict | None]]:
        """:meth:`assign` for a host kernel, in rounds of :attr:`width` experts.

        When the call needs more experts than the slots, the first round is
        :meth:`assign`'s (as many experts as the slots, the resident ones first, made
        resident in the slots), each later round ``width`` more, read into a scratch half
        (:meth:`scratch`; the tensors stored as on disk in place, the others cast there)
        and computed from there; after the last
        round, its last experts (as many as there are slots) enter the slots, evicting
        as :meth:`assign`'s last round does. Each distinct expert is a hit or a miss
        once, as in :meth:`assign`.

        Yields:
            ``(ids, mask, slabs)``: ``ids`` as :meth:`assign`'s slots, into ``slabs``
            (name on disk -> scratch slab) or, when ``slabs`` is ``None``, into the
            layer's own slabs; ``mask`` as :meth:`assign`'s (``None``: every needed
            expert resident at once, one pass). The caller computes each round
            before asking for the next, and asks until the rounds end (the last
            missing experts are written into slots then).

        Raises:
            CheckpointError, OSError: a failed read (the slots stay as they were).
        """
        self._drop_scratch_reads()
        need = self._need(idx)
        if len(need) <= self.num_slots:
            self._ensure(need)
            yield self.slot_of[idx].astype(idx.dtype), None, None
            return
        order = [e for e in need if self.slot_of[e] >= 0] + [e for e in need if self.slot_of[e] < 0]
        # The first round is assign's (the resident experts first: little or nothing to read),
        # the next ones `width` wide, each read while the round before computes.
        # A wide round's experts are read into its scratch half (ahead, while the round
        # before computes from the other half), each tensor kept as on disk read in place.
        bounds = [0, *range(self.num_slots, len(order), self.width), len(order)]
        local, group, half = np.zeros(self.num_experts, np.int64), [], 1
        try:
            for a, b, c in zip(bounds, bounds[1:], [*bounds[2:], len(order)]):
                group = order[a:b]
                if a == 0:  # assign's first round, through the slots
                    self._ensure(group)
                    ids, slabs = self.slot_of, None
                else:
                    half = 1 - half
                    slabs = self._fill(group, half)
                    local[group] = np.arange(len(group))
                    ids = local
                self.stats.rounds += 1
                self._read_ahead(order[b:c], self._destination(1 - half))  # none resident: all first
                mask = np.isin(idx, group)
                yield np.where(mask, ids[idx], 0).astype(idx.dtype), mask, slabs
            self._keep(group[-self.num_slots :], group, half)
        finally:  # a call abandoned between rounds: its read ahead ends here, unused
            self._end_read_ahead()

    def _fill(self, group: list[int], half: int) -> dict[str, mx.array]:
        """Read ``group``'s experts (none resident: the resident ones all go in the first
        round) into scratch ``half``, in order (the tensors kept as on disk read there in
        place, by the read ahead or now; the others cast from their reads); misses.
        Returns name -> scratch slab."""
        into = self._destination(half)
        batches = self._read(group, into)
        pos = {e: j for j, e in enumerate(group)}
        slabs = {}
        for name, t in self.tensors.items():
            slabs[name], view = self.scratch(name, half)
            cast = host_cast(t.info, t.casts)
            for raw, rows in batches:
                src, dst = [i for i, _ in rows], [pos[e] for _, e in rows]
                if raw[name].base is view and src == dst:
                    continue  # read in place
                view[dst] = cast(raw[name][src])  # one cast a batch
        self.stats.misses += len(group)
        return slabs

    def _keep(self, keep: list[int], group: list[int], half: int) -> None:
        """Make ``keep`` (experts of the last round ``group``, in scratch ``half``, none
        resident) resident, copied from there; a failed write resets the layer."""
        if not keep:
            return
        self.settle()
        slot_of_new = {e: self._take_slot(protected=keep) for e in keep}
        try:
            for name in self.tensors:
                host, (_, view) = self._host_slab(name), self.scratch(name, half)
                for e, s in slot_of_new.items():
                    host[s] = view[group.index(e)]
        except BaseException:
            self.reset()
            raise
        for e, s in slot_of_new.items():
            self.slot_of[e] = s
            self.policy.insert(e)
        self._update_lut()
