"""Two-tier placement of one MoE layer's experts: hot (GPU slots), warm (host slots), cold (SSD).

Backend-free (plain Python/numpy): the live two-tier cache
(:mod:`mlx_tier.engine.two_tier`) and the simulator (:mod:`mlx_tier.routing.simulate_tiers`)
drive the same :class:`TierIndex`, so a replayed trace predicts the live
hit/miss/promotion sequence. Mechanism (moving bytes, computing) is not here.

Rules, per layer call (one decode step or prefill chunk):

- Tiers are exclusive: an expert is hot, warm or cold. Each tier has its own
  policy object, made by the same :class:`mlx_tier.policy.eviction.PolicySpec` as the
  single-tier cache (same ``access``/``insert``/``evict``).
- The call's distinct experts are served in rounds of at most H + W (hot +
  warm slots), hot ones first, then warm, then cold, each in id order; the
  experts of a round are protected from eviction in both tiers.
- Hot experts: a hot hit (``hot`` policy access), computed on the GPU.
- Other experts lie in host memory (warm, or read from SSD into it): copied
  to the hot tier when :func:`mlx_tier.policy.cost_model.goes_to_hot` says so (a free
  hot slot, or enough tokens on the expert) — a *promotion* for a warm one —,
  else computed on the CPU from the warm tier (a warm hit, or a cold read
  placed in the warm tier). When the warm tier has no room (W = 0, or all its
  experts are in this round) a cold read goes to the hot tier.
- An expert evicted from the hot tier is *demoted* to the warm tier (its
  policy evicts there if full); with no room it is *dropped* (to cold), as is
  an expert evicted from the warm tier.

Between calls (:meth:`TierIndex.promote_ahead`, warm -> hot prefetch): the
experts the previous layer's prediction names for this layer's next call
(:mod:`mlx_tier.engine.prefetch`), most voted first, that lie in the warm tier are
*promoted ahead* into the hot tier when :func:`mlx_tier.policy.cost_model.copy_ahead_pays`
says so, each hot victim chosen by the hot policy among the experts not
predicted (and demoted as above). At load (:meth:`TierIndex.prewarm`) a
profile's experts fill the hot tier, then the warm tier, hottest first.

With W = 0 this is exactly the single-tier cache (:class:`mlx_tier.engine.cache.LayerCache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mlx_tier.policy.cost_model import TransferCosts, copy_ahead_pays, goes_to_hot
from mlx_tier.policy.eviction import PolicySpec

# Event kinds, in the order they are logged within a round.
HOT_HIT = "hot_hit"  # hot, computed on the GPU
WARM_HIT = "warm_hit"  # warm, computed on the CPU in place
PROMOTE = "promote"  # warm -> hot copy, computed on the GPU
MISS_HOT = "miss_hot"  # cold read placed in the hot tier
MISS_WARM = "miss_warm"  # cold read placed in the warm tier, computed on the CPU
DEMOTE = "demote"  # evicted from hot, moved to warm
DROP = "drop"  # left both tiers (back to cold)
PROMOTE_AHEAD = "promote_ahead"  # warm -> hot copy before the call, on a prediction (prefetch)
KINDS = (HOT_HIT, WARM_HIT, PROMOTE, MISS_HOT, MISS_WARM, DEMOTE, DROP, PROMOTE_AHEAD)


@dataclass
class Moves:
    """The byte moves one round needs, in the order they were decided.

    Each entry is ``(kind, expert, source slot, destination slot)``: ``read``
    (source -1: from SSD) into ``"hot"``/``"warm"``, ``promote`` (warm slot ->
    hot slot), ``demote`` (hot slot -> warm slot). Every source is read
    before any destination is written (sources always hold pre-round contents).
    """

    reads: list[tuple[int, str, int]] = field(default_factory=list)  # (expert, tier, slot)
    copies: list[tuple[str, int, int, int]] = field(default_factory=list)  # (kind, expert, src, dst)


class TierIndex:
    """Which expert is in which tier and slot, for one MoE layer.

    Args:
        layer: MoE layer index (pinned policies read its frequencies).
        num_experts: E.
        hot_slots: H >= 1.
        warm_slots: W >= 0 (0: the warm tier is off; copy on every miss).
        policy: how both tiers' policies are made.
        costs: bandwidths of the placement rule.
        expert_nbytes: resident bytes of one expert (the cost model's bytes).

    Attributes:
        hot_slot / warm_slot: ``[E]`` int64, the expert's slot in that tier or -1.
        log: ``None``, or a list that receives ``(kind, expert)`` events.
        counts: events so far, by kind.
    """

    def __init__(self, layer: int, num_experts: int, hot_slots: int, warm_slots: int, policy: PolicySpec,
                 costs: TransferCosts, expert_nbytes: int):
        if not 1 <= hot_slots <= num_experts or not 0 <= warm_slots <= num_experts - hot_slots:
            raise ValueError(f"need 1 <= hot slots and 0 <= warm slots with hot + warm <= {num_experts}, "
                             f"got {hot_slots} + {warm_slots}")
        self.layer, self.num_experts = layer, num_experts
        self.H, self.W = hot_slots, warm_slots
        self.spec, self.costs, self.expert_nbytes = policy, costs, expert_nbytes
        self.log: list[tuple[str, int]] | None = None
        self.counts = dict.fromkeys(KINDS, 0)
        self.reset()

    def reset(self) -> None:
        """Both tiers empty (slot contents are then unused)."""
        self.hot_slot = np.full(self.num_experts, -1, dtype=np.int64)
        self.warm_slot = np.full(self.num_experts, -1, dtype=np.int64)
        self.hot_free = list(range(self.H - 1, -1, -1))  # pop() gives slot 0 first
        self.warm_free = list(range(self.W - 1, -1, -1))
        self.hot_policy = self.spec.make(self.layer, self.H)
        self.warm_policy = self.spec.make(self.layer, self.W) if self.W else None

    def _event(self, kind: str, expert: int) -> None:
        self.counts[kind] += 1
        if self.log is not None:
            self.log.append((kind, expert))

    def rounds(self, need: list[int]) -> list[list[int]]:
        """Split a call's distinct experts (ascending) into rounds: hot, warm, cold first."""
        order = ([e for e in need if self.hot_slot[e] >= 0] + [e for e in need if self.warm_slot[e] >= 0]
                 + [e for e in need if self.hot_slot[e] < 0 and self.warm_slot[e] < 0])
        size = self.H + self.W
        return [order[i : i + size] for i in range(0, len(order), size)]

    def place(self, group: list[int], uses: np.ndarray) -> Moves:
        """Decide one round: every expert of ``group`` ends hot or warm.

        Args:
            group: a round from :meth:`rounds` (at most H + W experts).
            uses: ``[E]`` (token, k) entries of this call routed to each expert.

        Returns:
            The moves the mechanism must make before computing the round.
        """
        moves = Moves()
        protected = set(group)
        for e in group:
            if self.hot_slot[e] >= 0:
                self.hot_policy.access(e)
                self._event(HOT_HIT, e)
        for e in group:
            if self.hot_slot[e] < 0:
                self._place_host_expert(e, int(uses[e]), protected, moves)
        return moves

    def prewarm(self, ranked: list[int]) -> Moves:
        """Fill the free slots before any use: ``ranked`` (hottest first, e.g.
        :meth:`mlx_tier.routing.profile.Profile.hottest`) into the hot tier, then the
        warm tier. Experts already placed are skipped. Each tier's policy gets
        its experts coldest first (the hottest is the most recent), as
        :meth:`mlx_tier.engine.cache.LayerCache.prewarm`. Neither hits nor misses: no event.

        Returns:
            The cold reads to make (``Moves.reads``).
        """
        moves = Moves()
        todo = [int(e) for e in ranked if self.hot_slot[e] < 0 and self.warm_slot[e] < 0]
        hot = todo[: len(self.hot_free)]
        warm = todo[len(hot) : len(hot) + len(self.warm_free)]
        for e in hot:
            self.hot_slot[e] = self.hot_free.pop()
            moves.reads.append((e, "hot", int(self.hot_slot[e])))
        for e in warm:
            self.warm_slot[e] = self.warm_free.pop()
            moves.reads.append((e, "warm", int(self.warm_slot[e])))
        for e in reversed(hot):
            self.hot_policy.insert(e)
        for e in reversed(warm):
            self.warm_policy.insert(e)
        return moves

    def promote_ahead(self, predicted: np.ndarray) -> Moves:
        """Warm -> hot prefetch for the next call, from a prediction of its experts.

        Args:
            predicted: ``[..., k]`` expert ids the previous layer's router
                predicts for this layer's next call (:mod:`mlx_tier.engine.prefetch`).

        Returns:
            The copies to make (promotions, and the demotions they cause),
            decided most voted expert first (ties: lower id). Predicted experts
            are protected: a promotion never displaces another predicted one.
        """
        moves = Moves()
        ids, votes = np.unique(np.asarray(predicted).reshape(-1), return_counts=True)
        order = np.argsort(-votes, kind="stable")
        protected = {int(e) for e in ids}
        for e, v in zip(ids[order].tolist(), votes[order].tolist()):
            if self.warm_slot[e] < 0 or not self._hot_has_room(protected):
                continue
            if not (self.hot_free or copy_ahead_pays(self.costs, self.expert_nbytes, v)):
                continue
            self._promote(e, protected, moves)
            self.hot_policy.insert(e)
            self._event(PROMOTE_AHEAD, e)
        return moves

    def _promote(self, e: int, protected: set[int], moves: Moves) -> int:
        """Move warm expert ``e`` to a hot slot (its warm slot is freed first: a
        demoted victim may take it, a swap); returns the hot slot."""
        w = int(self.warm_slot[e])
        self.warm_slot[e] = -1
        self.warm_policy.remove(e)
        self.warm_free.append(w)
        s = self._take_hot_slot(protected, moves)
        moves.copies.append(("promote", e, w, s))
        self.hot_slot[e] = s
        return s

    def _place_host_expert(self, e: int, tokens: int, protected: set[int], moves: Moves) -> None:
        warm = self.warm_slot[e] >= 0
        want_hot = goes_to_hot(self.costs, self.expert_nbytes, tokens, bool(self.hot_free))
        if want_hot and self._hot_has_room(protected):
            if warm:
                self._promote(e, protected, moves)
                self._event(PROMOTE, e)
            else:
                s = self._take_hot_slot(protected, moves)
                moves.reads.append((e, "hot", s))
                self._event(MISS_HOT, e)
                self.hot_slot[e] = s
            self.hot_policy.insert(e)
        elif warm:
            self.warm_policy.access(e)
            self._event(WARM_HIT, e)
        elif self._warm_has_room(protected):
            w = self._take_warm_slot(protected)
            self.warm_slot[e] = w
            self.warm_policy.insert(e)
            moves.reads.append((e, "warm", w))
            self._event(MISS_WARM, e)
        else:  # no room in the warm tier: the hot tier has some (see rounds)
            s = self._take_hot_slot(protected, moves)
            self.hot_slot[e] = s
            self.hot_policy.insert(e)
            moves.reads.append((e, "hot", s))
            self._event(MISS_HOT, e)

    def _hot_has_room(self, protected: set[int]) -> bool:
        resident = int(np.count_nonzero(self.hot_slot >= 0))
        return bool(self.hot_free) or resident > sum(1 for e in protected if self.hot_slot[e] >= 0)

    def _warm_has_room(self, protected: set[int]) -> bool:
        if self.W == 0:
            return False
        resident = int(np.count_nonzero(self.warm_slot >= 0))
        return bool(self.warm_free) or resident > sum(1 for e in protected if self.warm_slot[e] >= 0)

    def _take_hot_slot(self, protected: set[int], moves: Moves) -> int:
        """A hot slot for a new expert; an evicted victim is demoted (or dropped)."""
        if self.hot_free:
            return self.hot_free.pop()
        victim = self.hot_policy.evict(protected=protected)
        s = int(self.hot_slot[victim])
        self.hot_slot[victim] = -1
        if self._warm_has_room(protected):
            w = self._take_warm_slot(protected)
            self.warm_slot[victim] = w
            self.warm_policy.insert(victim)
            moves.copies.append(("demote", victim, s, w))
            self._event(DEMOTE, victim)
        else:
            self._event(DROP, victim)
        return s

    def _take_warm_slot(self, protected: set[int]) -> int:
        if self.warm_free:
            return self.warm_free.pop()
        victim = self.warm_policy.evict(protected=protected)
        w = int(self.warm_slot[victim])
        self.warm_slot[victim] = -1
        self._event(DROP, victim)
        return w
