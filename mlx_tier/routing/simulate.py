"""Replay a routing trace against a policy and a cache size, without the model.

Each layer has its own slots (the same N everywhere, or one count per layer).
Every (token, layer) record accesses its k experts in order; an access is a
hit when the expert is resident. While a token's experts are being served they
are protected from eviction (when N >= k), as in the live cache. Hit rate =
accesses found resident / all accesses. Optionally each layer starts
pre-warmed with a profile's hottest experts, as the live cache does at load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_tier.policy.eviction import PolicySpec
from mlx_tier.routing.profile import Profile, from_trace
from mlx_tier.routing.trace import Trace


@dataclass(frozen=True)
class SimResult:
    """One replay.

    Attributes:
        slots: the slots per layer asked for (for a per-layer split: the mean,
            i.e. the uniform cache of the same total size).
        layer_slots: the slots each layer had.
    """

    policy: str
    slots: int
    hits: int
    accesses: int
    per_layer: tuple[float, ...]  # hit rate of each layer
    layer_slots: tuple[int, ...] = ()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


def simulate_layer(seq: list[list[int]], policy: str | PolicySpec, slots: int, prewarm: Sequence[int] = (),
                   layer: int = 0) -> tuple[int, int]:
    """``(hits, accesses)`` of one layer's top-k sequence under ``policy`` with ``slots``.

    Mirrors :meth:`mlx_tier.engine.cache.LayerCache.assign` for one token per call:
    the token's distinct experts in id order, resident ones first; when more
    are needed than there are slots, they are served in rounds of ``slots``.

    Args:
        prewarm: experts resident before the first access, hottest first (at
            most ``slots`` are used); inserted into the policy coldest first,
            as :meth:`mlx_tier.engine.cache.LayerCache.prewarm` does. For Belady the
            pre-warm inserts count as uses before the sequence.
        layer: which layer ``seq`` is (a pinned policy's frequencies).
    """
    spec = policy if isinstance(policy, PolicySpec) else PolicySpec(policy)
    warm = list(prewarm)[:slots]
    flat = [e for row in seq for e in sorted(set(row))]
    p = spec.make(layer, slots, future=warm[::-1] + flat)
    resident: set[int] = set()
    for e in reversed(warm):
        resident.add(e)
        p.insert(e)
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


def _layer_slots(slots: int | Sequence[int], num_layers: int, num_experts: int) -> tuple[int, ...]:
    per = (slots,) * num_layers if isinstance(slots, int) else tuple(int(n) for n in slots)
    if len(per) != num_layers or not all(1 <= n <= num_experts for n in per):
        raise ValueError(f"slots must be {num_layers} counts in [1, {num_experts}], got {per}")
    return per


def simulate(trace: Trace, policy: str, slots: int | Sequence[int], profile: Profile | None = None,
             prewarm: bool = False) -> SimResult:
    """Hit rate of ``policy`` on ``trace`` with ``slots`` per layer (one count
    for all layers, or one per layer).

    Args:
        profile: expert counts ``[L, E]`` for ``pinned`` and for pre-warm
            (default: the trace's own counts — an upper bound for a profile
            from other runs).
        prewarm: start each layer with the profile's hottest experts resident.

    Raises:
        ValueError: per-layer slots of the wrong length or outside [1, E];
            a profile of another shape than the trace.
    """
    seqs = trace.layer_sequences()
    per = _layer_slots(slots, len(seqs), trace.num_experts)
    if profile is None and (PolicySpec(policy).needs_profile or prewarm):
        profile = from_trace(trace, len(seqs), trace.num_experts)
    if profile is not None:
        profile.check(len(seqs), trace.num_experts, "simulate")
    spec = PolicySpec(policy, profile)
    hits = accesses = 0
    per_layer = []
    for lay, (seq, n) in enumerate(zip(seqs, per)):
        warm = profile.hottest(lay, n) if prewarm else ()
        h, a = simulate_layer(seq, spec, n, warm, layer=lay)
        hits, accesses = hits + h, accesses + a
        per_layer.append(h / a if a else 0.0)
    mean = slots if isinstance(slots, int) else round(sum(per) / len(per))
    return SimResult(policy, mean, hits, accesses, tuple(per_layer), per)


def miss_curves(trace: Trace, policy: str, profile: Profile | None = None, prewarm: bool = False) -> list[list[int]]:
    """Per layer, the misses with 1..E slots: ``curves[l][n - 1]`` (E simulations per layer)."""
    seqs = trace.layer_sequences()
    E = trace.num_experts
    if profile is None and (PolicySpec(policy).needs_profile or prewarm):
        profile = from_trace(trace, len(seqs), E)
    spec = PolicySpec(policy, profile)
    curves = []
    for lay, seq in enumerate(seqs):
        row = []
        for n in range(1, E + 1):
            h, a = simulate_layer(seq, spec, n, profile.hottest(lay, n) if prewarm else (), layer=lay)
            row.append(a - h)
        curves.append(row)
    return curves


def split_by_curves(curves: Sequence[Sequence[int]], total_slots: int) -> tuple[int, ...]:
    """Greedy split of ``total_slots`` across layers by marginal miss reduction.

    Each layer starts with 1 slot. Each step gives the layer with the largest
    miss reduction per added slot, ``(m[n] - m[n + j]) / j`` over every step
    size j that fits (so a flat stretch of a non-convex curve does not stop
    it), its j slots. Slots that buy no reduction on this curve are spread
    evenly (fewest slots first), so the whole budget is used.

    Args:
        curves: ``curves[l][n - 1]`` misses of layer l with n slots (:func:`miss_curves`).
        total_slots: the budget, sum over layers.
    Returns:
        slots per layer, each in [1, E], summing to ``min(total_slots, L * E)``.
    Raises:
        ValueError: ``total_slots`` < L.
    """
    L = len(curves)
    if total_slots < L:
        raise ValueError(f"{total_slots} slots cannot give each of {L} layers one")
    slots = [1] * L
    left = min(total_slots, sum(len(c) for c in curves)) - L

    def best_step(lay: int) -> tuple[float, int]:
        m, n = curves[lay], slots[lay]
        steps = [((m[n - 1] - m[n - 1 + j]) / j, -j) for j in range(1, min(left, len(m) - n) + 1)]
        gain, neg_j = max(steps, default=(0.0, 0))
        return gain, -neg_j

    while left > 0:
        steps = [best_step(i) for i in range(L)]
        lay = max(range(L), key=lambda i: (steps[i][0], -steps[i][1], -i))  # most gain, smaller step, lower layer
        gain, j = steps[lay]
        if gain <= 0:
            break
        slots[lay] += j
        left -= j
    while left > 0:  # no measured gain left: spread the rest evenly
        lay = min((s, i) for i, s in enumerate(slots) if s < len(curves[i]))[1]
        slots[lay] += 1
        left -= 1
    return tuple(slots)


def adaptive_split(trace: Trace, policy: str, total_slots: int, profile: Profile | None = None,
                   prewarm: bool = False) -> tuple[int, ...]:
    """Slots per layer for ``policy`` on ``trace``: :func:`split_by_curves` of
    :func:`miss_curves` (measured in this simulator)."""
    return split_by_curves(miss_curves(trace, policy, profile, prewarm), total_slots)


def zipf_trace(num_layers: int, num_experts: int, top_k: int, tokens: int, alpha: float = 1.1,
               reuse: float = 0.5, seed: int = 0) -> Trace:
    """A synthetic trace with locality: Zipf(``alpha``) expert popularity per
    layer (a random permutation of ranks per layer) plus temporal reuse (each
    of a token's k picks repeats one of the previous token's experts with
    probability ``reuse``). Documented in benches/ and used to compare policies.
    """
    import numpy as np

    from mlx_tier.routing.trace import DECODE

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


def curve_sizes(num_experts: int, points: int = 16) -> list[int]:
    """Cache sizes (slots per layer) for a hit-rate curve: every size from 1
    to E, or ``points`` of them spread evenly when E is larger."""
    if num_experts <= points:
        return list(range(1, num_experts + 1))
    return sorted({max(1, round(num_experts * i / points)) for i in range(1, points + 1)})


def plot_hit_rates(results: Sequence[SimResult], num_experts: int, path, title: str = "") -> None:
    """Write a PNG: hit rate vs cache size (slots per layer as a fraction of
    the experts), one line per policy, in the order first seen.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (``pip install 'mlx-tier[plot]'``).
        OSError: ``path`` cannot be written.
    """
    import io

    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    from mlx_tier.fsio import write_atomic

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.slots / num_experts, r.hit_rate) for r in results if r.policy == name)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                linestyle="--" if name == "belady" else "-", label=name)
    ax.set_xlabel("cache size (slots per layer / experts)")
    ax.set_ylabel("hit rate")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title, fontsize=9)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    write_atomic(path, buf.getvalue())


# How a cache of slots x layers is spread over the layers (Comparison.split).
SPLITS = ("uniform", "adaptive")
# Cache sizes trace-sim compares when none are given: these fractions of the experts.
DEFAULT_SIZE_FRACTIONS = (0.25, 0.5, 0.75)


@dataclass(frozen=True)
class Comparison:
    """Which policies and cache sizes :func:`compare` replays.

    Attributes:
        policies: policy names (live ones and ``belady``).
        slots: slots per layer to compare; empty: :data:`DEFAULT_SIZE_FRACTIONS` of the experts.
        split: ``uniform`` (every layer ``slots``) or ``adaptive`` (the same total,
            spread by each layer's simulated miss curve, :func:`adaptive_split`).
        prewarm: start each layer with the profile's most used experts resident.
        curve: also replay :func:`curve_sizes` (for a hit-rate plot).
    """

    policies: tuple[str, ...]
    slots: tuple[int, ...] = ()
    split: str = "uniform"
    prewarm: bool = False
    curve: bool = False

    def sizes(self, num_experts: int) -> list[int]:
        """The compared sizes (slots per layer), sorted.

        Raises:
            ConfigError: a size outside ``[1, num_experts]`` (``field``: ``slots``).
        """
        from mlx_tier.errors import ConfigError

        sizes = sorted(set(self.slots)) or sorted({max(1, round(num_experts * f)) for f in DEFAULT_SIZE_FRACTIONS})
        if any(not 1 <= n <= num_experts for n in sizes):
            raise ConfigError(f"`slots` must be between 1 and {num_experts} (the trace's experts per layer)", "slots")
        return sizes


def compare(trace: Trace, config: Comparison, profile: Profile | None = None) -> tuple[list[SimResult], list[SimResult]]:
    """Replay ``trace`` under each policy and size of ``config`` (``mlx-tier trace-sim``).

    Returns:
        ``(results, curve)``: one :class:`SimResult` per policy and compared size
        (policy-major), and when ``config.curve`` the results plus the curve's
        other sizes (else empty).
    Raises:
        ConfigError: a size out of range.
    """
    E, L = trace.num_experts, trace.num_layers
    sizes = config.sizes(E)

    def one(p: str, n: int) -> SimResult:
        per = adaptive_split(trace, p, n * L, profile, config.prewarm) if config.split == "adaptive" else n
        return simulate(trace, p, per, profile, config.prewarm)

    results = [one(p, n) for p in config.policies for n in sizes]
    curve = results + [one(p, n) for p in config.policies for n in curve_sizes(E) if n not in sizes] if config.curve else []
    return results, curve
