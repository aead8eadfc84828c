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

Policies (docs/architecture.md, "Hot tier"): W-TinyLFU, the default, admits an
expert into its main area only when it was used more than the one it would
replace, so scans and loops larger than the cache do not flush it; LRU is the
baseline and was strong in published measurements; LFU with dynamic aging
closed ~24% of the LRU->Belady gap there, but a loop over more experts than
slots, or a hot set beside short bursts of other experts, defeats it; a
scan-resistant 2Q keeps one-off experts from flushing the hot set; frequency
pinning keeps the experts a saved profile says are hot; Belady's optimal
(evict the expert used farthest in the future) needs the whole trace and is
the simulator's ceiling. Measured against each other:
benches/results/policies/NOTES.md.
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


def _oldest(segment: OrderedDict[int, None], protected: set[int]) -> int | None:
    """The oldest expert of ``segment`` not in ``protected``, or ``None``."""
    return next((e for e in segment if e not in protected), None)


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


class WTinyLFUPolicy:
    """W-TinyLFU: a small LRU window in front of a main area that admits by use counts.

    A new expert enters the window. When a slot is needed and the window is
    full, the window's oldest expert (the candidate) competes with the main
    area's victim: the one used more often in the recent past stays, a tie
    keeps the resident one. So experts seen once (a scan) or a loop larger than
    the cache cannot flush the main area, while an expert that comes back often
    gets in. The main area is a segmented LRU: an expert used again while on
    probation moves to the protected segment (:data:`PROTECTED_SHARE` of the
    main area); the victim is probation's oldest.

    Sizes, in slots: the window holds :data:`WINDOW_SHARE` of the slots, and at
    least as many as the caller protects at once (one token's experts, or a
    prefill round's), so that a token's own new experts never go untested into
    the main area. Counts are exact per expert (a layer has at most a few hundred),
    halved every :data:`SAMPLE_FACTOR` x slots counted uses (TinyLFU's reset),
    so popularity that changes is followed.

    Source: Einziger, Friedman & Manes, "TinyLFU: A Highly Efficient Cache
    Admission Policy", ACM Transactions on Storage 13(4), 2017 (W-TinyLFU, the
    1% window, the segmented main area, the reset); the sizes are theirs and
    Caffeine's defaults. Measured against LRU, LFU and Belady on trained-like,
    cyclic and hot-plus-scan routing: benches/results/policies/NOTES.md.
    """

    WINDOW_SHARE = 0.01
    PROTECTED_SHARE = 0.8
    SAMPLE_FACTOR = 10

    def __init__(self, slots: int = 1) -> None:
        self.slots = max(1, slots)
        self._min_window = max(1, round(self.WINDOW_SHARE * self.slots))
        self._window_size = self._min_window  # grows to the protected group (evict)
        self._period = self.SAMPLE_FACTOR * self.slots  # counted uses between halvings
        self._uses: dict[int, int] = {}
        self._counted = 0
        self._window: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()

    def _count(self, expert: int) -> None:
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._counted += 1
        if self._counted >= self._period:  # TinyLFU's reset: halve every count
            self._counted //= 2
            self._uses = {e: n // 2 for e, n in self._uses.items() if n >= 2}

    def _main_size(self) -> int:
        return len(self._probation) + len(self._protected)

    def access(self, expert: int) -> None:
        self._count(expert)
        if expert in self._window:
            self._window.move_to_end(expert)
        elif expert in self._probation:
            del self._probation[expert]
            self._protected[expert] = None
            limit = round(self.PROTECTED_SHARE * (self.slots - self._window_size))
            while len(self._protected) > max(limit, 0):  # the oldest protected goes back on probation
                self._probation[self._protected.popitem(last=False)[0]] = None
        else:
            self._protected.move_to_end(expert)

    def insert(self, expert: int) -> None:
        self._count(expert)
        self._window[expert] = None
        # While the main area has room (filling up, or after remove), the window's
        # oldest moves there freely; otherwise evict() tests it for admission.
        while len(self._window) > self._window_size and self._main_size() < self.slots - self._window_size:
            self._probation[self._window.popitem(last=False)[0]] = None

    def _contenders(self, protected: set[int]) -> tuple[int | None, int | None]:
        """``(candidate, victim)``: the window's oldest when the window is full, and
        the main area's victim (probation's oldest, else protected's), unprotected."""
        self._window_size = max(1, min(self.slots - 1, max(self._min_window, len(protected))))
        candidate = _oldest(self._window, protected) if len(self._window) >= self._window_size else None
        victim = _oldest(self._probation, protected)
        if victim is None:
            victim = _oldest(self._protected, protected)
        if candidate is None and victim is None:
            candidate = _oldest(self._window, protected)
        return candidate, victim

    def evict(self, protected: Iterable[int] = ()) -> int:
        """Remove and return the candidate or the main victim, whichever was used less
        (class doc); a candidate that wins moves to probation.

        Raises:
            RuntimeError: every resident expert is protected.
        """
        candidate, victim = self._contenders(set(protected))
        if candidate is None and victim is None:
            raise _no_victim()
        if victim is None or (candidate is not None and self._uses.get(candidate, 0) <= self._uses.get(victim, 0)):
            del self._window[candidate]
            return candidate
        (self._probation if victim in self._probation else self._protected).pop(victim)
        if candidate is not None:  # admitted
            del self._window[candidate]
            self._probation[candidate] = None
        return victim

    def remove(self, expert: int) -> None:
        for segment in (self._window, self._probation, self._protected):
            if expert in segment:
                del segment[expert]
                return
        raise KeyError(expert)

    def __len__(self) -> int:
        return len(self._window) + self._main_size()


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


POLICIES = {"tinylfu": WTinyLFUPolicy, "lru": LRUPolicy, "lfu": LFUAgingPolicy, "2q": TwoQPolicy,
            "pinned": PinnedPolicy}
# The one default (TierConfig, JobConfig, the CLI), and why: mlx_tier.defaults.
DEFAULT_POLICY = defaults.DEFAULT_POLICY
OFFLINE_POLICIES = {"belady": BeladyPolicy}


def make_policy(name: str, slots: int = 1, **kwargs) -> EvictionPolicy:
    """A fresh policy object by name: ``tinylfu`` (W-TinyLFU), ``lru``, ``lfu``
    (with aging), ``2q``, ``pinned`` (``frequencies=``), or ``belady``
    (``future=``; offline only).

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
        name: ``tinylfu``, ``lru``, ``lfu``, ``2q``, ``pinned`` (live) or ``belady`` (offline).
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
