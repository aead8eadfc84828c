"""Replay a routing trace against the two-tier cache (hot GPU slots + warm host slots), without the model.

Drives the same :class:`mlx_tier.policy.placement.TierIndex` as the live two-tier cache
(:mod:`mlx_tier.engine.two_tier`), one call per trace record (one token of one layer),
as :func:`mlx_tier.routing.simulate.simulate` does for one tier. So users can size both
budgets (``mlx-tier trace-sim --warm-slots``) without a GPU. Pre-warm and the
warm -> hot prefetch are replayed as the live cache makes them: the profile's
hottest experts into hot then warm slots, and, before each call, the
promotions its recorded prediction leads to (a trace recorded with prefetch on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlx_tier.policy.cost_model import TransferCosts
from mlx_tier.policy.eviction import PolicySpec
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
    TierIndex,
)
from mlx_tier.routing.profile import from_trace
from mlx_tier.routing.trace import Trace


@dataclass(frozen=True)
class TwoTierResult:
    """One two-tier replay; counts are per distinct expert per call, summed over layers.

    Attributes:
        counts: events by kind (:data:`mlx_tier.policy.placement.KINDS`).
        events: per layer, the ``(kind, expert)`` sequence (only when asked for).
    """

    policy: str
    hot_slots: int
    warm_slots: int
    counts: dict
    events: tuple = ()

    @property
    def accesses(self) -> int:
        c = self.counts
        return c[HOT_HIT] + c[WARM_HIT] + c[PROMOTE] + c[MISS_HOT] + c[MISS_WARM]

    def rate(self, *kinds: str) -> float:
        """Share of accesses that were any of ``kinds``."""
        return sum(self.counts[k] for k in kinds) / self.accesses if self.accesses else 0.0

    @property
    def hot_hit_rate(self) -> float:
        return self.rate(HOT_HIT)

    @property
    def warm_hit_rate(self) -> float:
        """Accesses found in the warm tier (computed there or promoted)."""
        return self.rate(WARM_HIT, PROMOTE)

    @property
    def miss_rate(self) -> float:
        return self.rate(MISS_HOT, MISS_WARM)

    @property
    def cpu_share(self) -> float:
        """Accesses computed on the CPU (warm hits and misses placed warm)."""
        return self.rate(WARM_HIT, MISS_WARM)

    def as_dict(self) -> dict:
        return {"policy": self.policy, "hot_slots": self.hot_slots, "warm_slots": self.warm_slots,
                **self.counts, "accesses": self.accesses, "hot_hit_rate": self.hot_hit_rate,
                "warm_hit_rate": self.warm_hit_rate, "miss_rate": self.miss_rate, "cpu_share": self.cpu_share,
                "demotions": self.counts[DEMOTE], "drops": self.counts[DROP],
                "promotions_ahead": self.counts[PROMOTE_AHEAD]}


def replay_layer(index: TierIndex, calls: Sequence[np.ndarray], predictions: Sequence | None = None) -> None:
    """Feed one layer's calls (each ``[..., k]`` expert ids) to ``index``, as the live cache does.

    ``predictions``: per call, the prefetch's prediction ``[..., k]`` made
    before it (negative ids: none), replayed as warm -> hot promotions first.
    """
    for i, idx in enumerate(calls):
        if predictions is not None and np.min(predictions[i]) >= 0:
            index.promote_ahead(np.asarray(predictions[i]))
        uses = np.bincount(np.asarray(idx).reshape(-1), minlength=index.num_experts)
        need = np.flatnonzero(uses).tolist()
        for group in index.rounds(need):
            index.place(group, uses)


def simulate_two_tier(trace: Trace, policy: str, hot_slots: int, warm_slots: int,
                      costs: TransferCosts | None = None, expert_nbytes: int = 1, profile=None,
                      keep_events: bool = False, prewarm: bool = False, prefetch: bool = False) -> TwoTierResult:
    """Replay ``trace`` one record per call with ``hot_slots`` + ``warm_slots`` per layer.

    Args:
        costs: the placement rule's bandwidths (default :class:`TransferCosts`();
            one token per call, so only its token threshold matters).
        expert_nbytes: resident bytes of one expert (cancels out of the rule).
        profile: frequencies for ``pinned`` and ``prewarm`` (default: the trace's own counts).
        keep_events: keep every layer's ``(kind, expert)`` sequence.
        prewarm: start each layer with the profile's hottest experts in hot, then warm slots.
        prefetch: replay the trace's recorded predictions as warm -> hot promotions.

    Raises:
        ValueError: an unknown or offline policy (Belady has no two-tier form
            here), slots outside ``1 <= H``, ``0 <= W``, ``H + W <= E``, or
            ``prefetch`` on a trace without predictions.
    """
    spec = PolicySpec(policy)
    if not spec.live:
        raise ValueError(f"policy {policy!r} is single-tier only in this simulator")
    if prefetch and trace.predicted is None:
        raise ValueError("this trace has no prefetch predictions: record it from a run with prefetch on")
    if spec.needs_profile or prewarm:
        profile = profile or from_trace(trace, trace.num_layers, trace.num_experts)
        spec = PolicySpec(policy, profile)
    costs = costs or TransferCosts()
    counts = dict.fromkeys(KINDS, 0)
    events = []
    predictions = trace.layer_predictions() if prefetch else None
    for lay, seq in enumerate(trace.layer_sequences()):
        index = TierIndex(lay, trace.num_experts, hot_slots, warm_slots, spec, costs, expert_nbytes)
        index.log = [] if keep_events else None
        if prewarm:
            index.prewarm(profile.hottest(lay, hot_slots + warm_slots))
        replay_layer(index, [np.array([row]) for row in seq],
                     [np.array([row]) for row in predictions[lay]] if predictions else None)
        for k, v in index.counts.items():
            counts[k] += v
        events.append(tuple(index.log or ()))
    return TwoTierResult(policy, hot_slots, warm_slots, counts, tuple(events) if keep_events else ())
