"""Eviction policies: which resident expert gives up its slot.

Backend-free (plain Python), so the same objects drive the live cache on the
MLX CPU backend, Metal unified memory and CUDA device memory, and the trace
simulator (:mod:`mlx_tier.routing.simulate`).

Interface, one object per layer, keyed by expert id:
    access(e)           e was resident and used (a hit)
    insert(e)           e was just loaded into a slot
    evict(protected)    choose a resident expert not in ``protected``, forget it, return it
    remove(e)           forget e without choosing it (it moved to another tier,
                        :mod:`mlx_tier.policy.placement`); no aging or ghost-list side effect

Policies (docs/architecture.md, "Hot tier"): LRU is the baseline and was strong in
published measurements; LFU with dynamic aging closed ~24% of the LRU->Belady
gap there; a scan-resistant 2Q keeps one-off experts from flushing the hot
set; frequency pinning keeps the experts a saved profile says are hot;
Belady's optimal (evict the expert used farthest in the future) needs the
whole trace and is the simulator's ceiling.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_tier import defaults


class EvictionPolicy(Protocol):
    def access(self, expert: int) -> None: ...
    def insert(self, expert: int) -> None: ...
    def evict(self, protected: Iterable[int] = ()) -> int: ...
    def remove(self, expert: int) -> None: ...


def _no_victim() -> RuntimeError:
    return RuntimeError("no evictable expert: every resident expert is protected")


def _evictable(resident: Iterable[int], protected: Iterable[int]) -> list[int]:
    """Resident experts not in ``protected``.

    Raises:
        RuntimeError: none.
    """
    protected = set(protected)
    candidates = [e for e in resident if e not in protected]
    if not candidates:
        raise _no_victim()
    return candidates


class LRUPolicy:
    """Least recently used: evict the expert whose last use is oldest."""

    def __init__(self, slots: int = 0) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def access(self, expert: int) -> None:
        self._order.move_to_end(expert)

    def insert(self, expert: int) -> None:
        self._order[expert] = None

    def evict(self, protected: Iterable[int] = ()) -> int:
        """Remove and return the least recently used expert not in ``protected``.

        Raises:
            RuntimeError: every resident expert is protected.
        """
        protected = set(protected)
        for e in self._order:
            if e not in protected:
                del self._order[e]
                return e
        raise _no_victim()

    def remove(self, expert: int) -> None:
        del self._order[expert]

    def __len__(self) -> int:
        return len(self._order)


class LFUAgingPolicy:
    """LFU with dynamic aging (LFU-DA): priority = uses + age at insertion.

    The age is the priority of the last evicted expert, so experts that were
    hot long ago lose to recently hot ones. Ties go to the least recently used.
    Source: Arlitt et al., "Evaluating content management techniques for Web
    proxy caches" (2000).
    """

    def __init__(self, slots: int = 0) -> None:
        self._prio: dict[int, float] = {}
        self._last: dict[int, int] = {}
        self._clock = 0
        self._age = 0.0

    def _tick(self, e: int) -> None:
        self._clock += 1
        self._last[e] = self._clock

    def access(self, expert: int) -> None:
        self._prio[expert] += 1
        self._tick(expert)

    def insert(self, expert: int) -> None:
        self._prio[expert] = self._age + 1
        self._tick(expert)

    def evict(self, protected: Iterable[int] = ()) -> int:
        victim = min(_evictable(self._prio, protected), key=lambda e: (self._prio[e], self._last[e]))
        self._age = self._prio.pop(victim)
        del self._last[victim]
        return victim

    def remove(self, expert: int) -> None:
        del self._prio[expert], self._last[expert]  # the age stays: nothing was evicted


class TwoQPolicy:
    """Scan-resistant 2Q: new experts enter a FIFO (A1in, 25% of slots); only
    experts seen again after leaving it (remembered in a ghost list A1out of
    50% of slots) enter the main LRU (Am).

    Source: Johnson & Shasha, "2Q: A Low Overhead High Performance Buffer
    Management Replacement Algorithm" (VLDB 1994).
    """

    def __init__(self, slots: int) -> None:
        self.kin = max(1, slots // 4)
        self.kout = max(1, slots // 2)
        self._a1in: OrderedDict[int, None] = OrderedDict()
        self._am: OrderedDict[int, None] = OrderedDict()
        self._a1out: OrderedDict[int, None] = OrderedDict()

    def access(self, expert: int) -> None:
        if expert in self._am:
            self._am.move_to_end(expert)
        # A hit in A1in changes nothing: correlated references don't promote.

    def insert(self, expert: int) -> None:
        if expert in self._a1out:
            del self._a1out[expert]
            self._am[expert] = None
        else:
            self._a1in[expert] = None

    def evict(self, protected: Iterable[int] = ()) -> int:
        protected = set(protected)
        queues = (self._a1in, self._am) if len(self._a1in) > self.kin else (self._am, self._a1in)
        for q in queues:
            for e in q:
                if e not in protected:
                    del q[e]
                    if q is self._a1in:
                        self._a1out[e] = None
                        while len(self._a1out) > self.kout:
                            self._a1out.popitem(last=False)
                    return e
        raise _no_victim()

    def remove(self, expert: int) -> None:
        (self._am if expert in self._am else self._a1in).pop(expert)  # not remembered in A1out


class PinnedPolicy:
    """Frequency pinning from a saved profile: evict the expert the profile
    says is least used (ties: least recently used). The profile's hottest
    experts therefore stay resident once loaded.

    Args:
        frequencies: expert id -> access count from earlier runs (this layer).
    """

    def __init__(self, slots: int = 0, frequencies: dict[int, float] | None = None) -> None:
        self.freq = dict(frequencies or {})
        self._lru = LRUPolicy()

    def access(self, expert: int) -> None:
        self._lru.access(expert)

    def insert(self, expert: int) -> None:
        self._lru.insert(expert)

    def evict(self, protected: Iterable[int] = ()) -> int:
        order = {e: i for i, e in enumerate(self._lru._order)}  # 0 = least recent
        victim = min(_evictable(order, protected), key=lambda e: (self.freq.get(e, 0.0), order[e]))
        del self._lru._order[victim]
        return victim

    def remove(self, expert: int) -> None:
        self._lru.remove(expert)


class BeladyPolicy:
    """Belady's optimal (MIN): evict the expert whose next use is farthest away.

    Offline only: it needs this layer's whole future, each expert's uses in
    order (``future``: the flattened access sequence). Each ``access``/
    ``insert`` of an expert consumes that expert's next listed use, so the
    order of experts within one token does not matter. Ties (never used again)
    go to the lowest id. Source: Belady, "A study of replacement algorithms
    for a virtual-storage computer" (IBM Systems Journal, 1966).
    """

    INF = float("inf")

    def __init__(self, slots: int = 0, future: Sequence[int] = ()) -> None:
        self._uses: dict[int, list[int]] = defaultdict(list)
        for i, e in enumerate(future):
            self._uses[e].append(i)
        self._ptr: dict[int, int] = defaultdict(int)  # next unconsumed use of each expert
        self._resident: set[int] = set()

    def _consume(self, expert: int) -> None:
        self._ptr[expert] += 1

    def _next_use(self, expert: int) -> float:
        uses, p = self._uses[expert], self._ptr[expert]
        return uses[p] if p < len(uses) else self.INF

    def access(self, expert: int) -> None:
        self._consume(expert)

    def insert(self, expert: int) -> None:
        self._resident.add(expert)
        self._consume(expert)

    def evict(self, protected: Iterable[int] = ()) -> int:
        victim = max(_evictable(self._resident, protected), key=lambda e: (self._next_use(e), -e))
        self._resident.remove(victim)
        return victim

    def remove(self, expert: int) -> None:
        self._resident.remove(expert)


POLICIES = {"lru": LRUPolicy, "lfu": LFUAgingPolicy, "2q": TwoQPolicy, "pinned": PinnedPolicy}
# The one default (TierConfig, JobConfig, the CLI), and why: mlx_tier.defaults.
DEFAULT_POLICY = defaults.DEFAULT_POLICY
OFFLINE_POLICIES = {"belady": BeladyPolicy}


def make_policy(name: str, slots: int = 1, **kwargs) -> EvictionPolicy:
    """A fresh policy object by name: ``lru``, ``lfu`` (with aging), ``2q``,
    ``pinned`` (``frequencies=``), or ``belady`` (``future=``; offline only).

    Raises:
        ValueError: unknown name.
    """
    cls = POLICIES.get(name) or OFFLINE_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES) + sorted(OFFLINE_POLICIES)}")
    return cls(slots, **kwargs)


@dataclass(frozen=True)
class PolicySpec:
    """Every layer's eviction policy, chosen once at the edge (config) and
    passed down whole: the one place that knows what each policy needs.

    Attributes:
        name: ``lru``, ``lfu``, ``2q``, ``pinned`` (live) or ``belady`` (offline).
        profile: for ``pinned``: any object with ``frequencies(layer) ->
            {expert: count}`` (a :class:`mlx_tier.routing.profile.Profile`).

    Raises:
        ValueError: an unknown name.
    """

    name: str
    profile: Any = None

    def __post_init__(self):
        if self.name not in POLICIES and self.name not in OFFLINE_POLICIES:
            raise ValueError(f"unknown policy {self.name!r}; choose from {sorted(POLICIES) + sorted(OFFLINE_POLICIES)}")

    @property
    def live(self) -> bool:
        """Usable in a running model (Belady needs the future)."""
        return self.name in POLICIES

    @property
    def needs_profile(self) -> bool:
        """Needs a saved frequency profile; such a policy also pre-warms by default."""
        return self.name == "pinned"

    def make(self, layer: int, slots: int, future: Sequence[int] = ()) -> EvictionPolicy:
        """A fresh policy for MoE layer ``layer`` with ``slots`` slots
        (``future``: the layer's access sequence, for Belady)."""
        if self.name == "pinned":
            freq = self.profile.frequencies(layer) if self.profile is not None else {}
            return PinnedPolicy(slots, frequencies=freq)
        if self.name == "belady":
            return BeladyPolicy(slots, future=future)
        return make_policy(self.name, slots)
