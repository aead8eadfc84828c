"""Replay a routing trace against a policy and a cache size, without the model.

Each layer has its own N slots. Every (token, layer) record accesses its k
experts in order; an access is a hit when the expert is resident. While a
token's experts are being served they are protected from eviction (when N >=
k), as in the live cache. Hit rate = accesses found resident / all accesses.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import make_policy
from .trace import Trace


@dataclass(frozen=True)
class SimResult:
    policy: str
    slots: int
    hits: int
    accesses: int
    per_layer: tuple[float, ...]  # hit rate of each layer

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def simulate_layer(seq: list[list[int]], policy: str, slots: int, **policy_kwargs) -> tuple[int, int]:
    """``(hits, accesses)`` of one layer's top-k sequence under ``policy`` with ``slots``.

    Mirrors :meth:`mlx_tier.cache.LayerCache.assign` for one token per call:
    the token's distinct experts in id order, resident ones first; when more
    are needed than there are slots, they are served in rounds of ``slots``.
    """
    flat = [e for row in seq for e in sorted(set(row))]
    if policy == "belady":
        policy_kwargs = {**policy_kwargs, "future": flat}
    p = make_policy(policy, slots, **policy_kwargs)
    resident: set[int] = set()
    hits = 0
    for row in seq:
        need = sorted(set(row))
        order = [e for e in need if e in resident] + [e for e in need if e not in resident]
        for i in range(0, len(order), slots):
            group = order[i : i + slots]
            for e in group:
                if e in resident:
                    hits += 1
                    p.access(e)
            for e in group:
                if e in resident:
                    continue
                if len(resident) >= slots:
                    resident.discard(p.evict(protected=group))
                resident.add(e)
                p.insert(e)
    return hits, len(flat)


def simulate(trace: Trace, policy: str, slots: int, profile: list[dict[int, float]] | None = None) -> SimResult:
    """Hit rate of ``policy`` with ``slots`` per layer on ``trace``.

    Args:
        profile: per layer expert frequencies, for ``pinned`` (default: the
            trace's own counts — an upper bound for a profile from other runs).
    """
    seqs = trace.layer_sequences()
    hits = accesses = 0
    per_layer = []
    for lay, seq in enumerate(seqs):
        kwargs = {}
        if policy == "pinned":
            if profile is not None:
                freq = profile[lay]
            else:
                freq = {}
                for row in seq:
                    for e in row:
                        freq[e] = freq.get(e, 0) + 1
            kwargs["frequencies"] = freq
        h, a = simulate_layer(seq, policy, slots, **kwargs)
        hits, accesses = hits + h, accesses + a
        per_layer.append(h / a if a else 0.0)
    return SimResult(policy, slots, hits, accesses, tuple(per_layer))


def zipf_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, alpha: float = 1.1,
               reuse: float = 0.5, seed: int = 0) -> Trace:
    """A synthetic trace with locality: Zipf(``alpha``) expert popularity per
    layer (a random permutation of ranks per layer) plus temporal reuse (each
    of a token's k picks repeats one of the previous token's experts with
    probability ``reuse``). Documented in benches/ and used to compare policies.
    """
    import numpy as np

    from .trace import DECODE

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    p = ranks ** -alpha
    p /= p.sum()
    perms = [rng.permutation(num_experts) for _ in range(num_layers)]
    prev = [None] * num_layers
    rows, layers, toks = [], [], []
    for t in range(tokens):
        for lay in range(num_layers):
            chosen: list[int] = []
            while len(chosen) < top_k:
                if prev[lay] is not None and rng.random() < reuse:
                    e = int(rng.choice(prev[lay]))
                else:
                    e = int(perms[lay][rng.choice(num_experts, p=p)])
                if e not in chosen:
                    chosen.append(e)
            prev[lay] = chosen
            rows.append(chosen)
            layers.append(lay)
            toks.append(t)
    return Trace(np.array(toks), np.array(layers, np.int32), np.full(len(rows), DECODE, np.uint8),
                 np.array(rows, np.int32), {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k,
                                            "source": f"zipf alpha={alpha} reuse={reuse} seed={seed}"})
