"""Eviction policies: which resident expert gives up its slot.

Backend-free (plain Python), so the same objects drive the MLX CPU backend,
Metal unified memory and CUDA device memory, and a trace simulator.

Interface, per layer, keyed by expert id:
    access(e)           e was resident and used (a hit)
    insert(e)           e was just loaded into a slot
    evict(protected)    choose a resident expert not in ``protected`` and forget it
LRU is the baseline; published measurements found it strong (DESIGN.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol


class EvictionPolicy(Protocol):
    def access(self, expert: int) -> None: ...
    def insert(self, expert: int) -> None: ...
    def evict(self, protected: Iterable[int] = ()) -> int: ...


class LRUPolicy:
    """Least recently used: evict the expert whose last use is oldest."""

    def __init__(self) -> None:
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
        raise RuntimeError("no evictable expert: every resident expert is protected")

    def __len__(self) -> int:
        return len(self._order)


POLICIES = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy object by name (``"lru"``).

    Raises:
        ValueError: unknown name.
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
