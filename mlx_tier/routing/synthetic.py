"""Seeded routing traces whose statistics match those published for trained MoEs.

No routing trace of a trained MoE could be shipped with mlx-tier (the public
ones found have no licence, are Git LFS objects, or are Hugging Face datasets
not reachable from our build machines), so this module generates traces that
reproduce the statistics papers and public studies report for trained
routers, as measured by :mod:`mlx_tier.routing.stats`. Sources and targets
(each checked by tests/routing/test_routing_stats.py on the generated trace):

* Step-to-step reuse — Mixtral 8x7B (8 experts, top-2, 32 layers) on The Pile
  validation set: Jiang et al. 2024, "Mixtral of Experts", arXiv 2401.04088,
  §5, Table 5 (means of its 8 domains): first choice repeated at the next token
  14.1% / 26.4% / 22.7% at layers 0 / 15 / 31 (random 12.5%); first or second
  choice shared 48.0% / 63.7% / 50.9% (random 46%).
* Cross-layer predictability — Mixtral-8x7B-Instruct decoding HumanEval and
  GSM8K: a "(Layer, Expert) → next layer's expert" lookup table, fitted on 98%
  of the tokens, predicts the next layer's first expert 25.8% of the time on
  held-out tokens (random 12.5%) — github.com/Mario928/speculative-moe,
  experiment_and_evaluation/1_lookup_table/README.md (numbers cited; its data
  has no licence and is not shipped).
* Popularity — Qwen3-30B-A3B (128 experts, top-8, 48 layers), per-layer
  selection counts from llama.cpp's imatrix: concentration (1 − normalised
  entropy) 0.111 on a diverse ~1k-token workload and 0.154 on a narrow ~8k-token
  one, the top expert 4.3% / 6.3% of a layer's selections, 65 / 58 of 128
  experts (51% / 45%) for 90% of the selections — the gpu-container handbook,
  "Routing De-risk" (mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/).
  Mixtral's per-layer use is near-uniform (Jiang et al. 2024, Figure 7; no
  number is given, we take a mild skew).

Not known from a source, and therefore knobs that the benches sweep: reuse of
a 128-expert top-8 router and its cross-layer affinity.

Model (per layer l, token t; k picks, column 0 = first choice): pick j repeats
the previous token's j-th expert at this layer with probability
``stick_first[l]`` (j = 0) or ``stick_other[l]`` (j > 0); else the first pick
follows the cross-layer affinity with probability ``affinity`` (the expert of
the same popularity rank at layer l as this token's first expert at layer
l − 1: a rank-preserving map, so popularity is kept); else it is a fresh draw
without replacement from Zipf–Mandelbrot(``alpha[l]``, ``offset``) over a seeded per-layer
permutation of the experts (Plackett–Luce sampling by Gumbel keys). A
candidate already chosen falls through to a fresh draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_tier.routing.trace import DECODE, Trace

# Jiang et al. 2024 (arXiv 2401.04088) Table 5, mean over its 8 Pile domains, at layers 0, 15, 31.
MIXTRAL_FIRST_REPEAT = {0: 0.1409, 15: 0.2640, 31: 0.2268}
MIXTRAL_OVERLAP_ANY = {0: 0.4804, 15: 0.6369, 31: 0.5091}
MIXTRAL_CROSS_TOP1 = 0.258  # speculative-moe lookup table, (Layer, Expert) → next expert, held out
QWEN3_ENTROPY = (1 - 0.154, 1 - 0.111)  # gpu-container "Routing De-risk": concentration 0.154 / 0.111
QWEN3_TOP_SHARE = (0.043, 0.063)
QWEN3_COVERAGE90 = (0.45, 0.51)


@dataclass(frozen=True)
class RoutingModel:
    """Knobs of the generator (see module doc). Per-layer knobs are tuples of length L.

    Attributes:
        num_layers, num_experts, top_k: L, E, k.
        alpha: Zipf exponent of each layer's expert popularity (0 = uniform).
        stick_first: P(first pick repeats the previous token's first pick), per layer.
        stick_other: P(pick j > 0 repeats the previous token's j-th pick), per layer.
        affinity: P(first pick follows layer l − 1's first pick through the rank map).
        offset: Zipf–Mandelbrot offset c: popularity of rank r ∝ (r + c)^-alpha
            (0 = plain Zipf; a large c flattens the head and keeps a thin tail).
        name: a label for reports.
    """

    num_layers: int
    num_experts: int
    top_k: int
    alpha: tuple[float, ...]
    stick_first: tuple[float, ...]
    stick_other: tuple[float, ...]
    affinity: float
    offset: float = 0.0
    name: str = "trained-like"

    def __post_init__(self) -> None:
        L = self.num_layers
        for f in ("alpha", "stick_first", "stick_other"):
            if len(getattr(self, f)) != L:
                raise ValueError(f"{f}: {len(getattr(self, f))} values for {L} layers")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} not in [1, {self.num_experts}]")


def per_layer(points: dict[int, float], num_layers: int) -> tuple[float, ...]:
    """Piecewise-linear values at every layer through ``{layer: value}`` points
    (constant beyond the first and last point)."""
    xs = sorted(points)
    return tuple(float(np.interp(i, xs, [points[x] for x in xs])) for i in range(num_layers))


def at_mixtral_depths(values: dict[int, float], num_layers: int) -> tuple[float, ...]:
    """Values given at Mixtral 8x7B's layers 0 / 15 / 31 (of 32), placed at the same
    relative depths of ``num_layers`` layers and interpolated (:func:`per_layer`)."""
    if num_layers == 1:
        return (values[0],)
    mid, last = (num_layers - 1) * 15 / 31, num_layers - 1
    return per_layer({0: values[0], mid: values[15], last: values[31]}, num_layers)


def mixtral_like(num_layers: int = 32) -> RoutingModel:
    """8 experts, top-2, reuse and cross-layer predictability of Mixtral 8x7B
    (Table 5 of arXiv 2401.04088 at layers 0/15/31, scaled to ``num_layers``;
    the speculative-moe lookup-table accuracy). Knob values were tuned so that
    :func:`mlx_tier.routing.stats.routing_stats` of the generated trace meets
    those targets (tests/routing/test_routing_stats.py checks it). Popularity: no
    published number; ``alpha`` 0.3 gives a near-uniform use (entropy 0.99),
    as Figure 7 of the paper shows."""
    return RoutingModel(
        num_layers, 8, 2,
        alpha=(0.3,) * num_layers,
        stick_first=at_mixtral_depths({0: 0.02, 15: 0.15, 31: 0.11}, num_layers),
        stick_other=at_mixtral_depths({0: 0.0, 15: 0.17, 31: 0.0}, num_layers),
        affinity=0.16, name="mixtral-like")


def qwen3_like(num_layers: int = 48, stick: float = 0.3, affinity: float = 0.16) -> RoutingModel:
    """128 experts, top-8, per-layer popularity of Qwen3-30B-A3B (entropy,
    top share, 90% coverage from the gpu-container study; ``alpha`` 3.3 and
    ``offset`` 40 tuned to them, tests/routing/test_routing_stats.py checks it).
    ``stick`` (every pick's reuse probability) and ``affinity`` have no
    published value for this kind of router: benches/trained_routing.py
    sweeps ``stick``; ``affinity`` defaults to mixtral_like's."""
    return RoutingModel(num_layers, 128, 8, alpha=(3.3,) * num_layers, stick_first=(stick,) * num_layers,
                        stick_other=(stick,) * num_layers, affinity=affinity, offset=40.0,
                        name=f"qwen3-like (stick {stick}, affinity {affinity})")


def _fresh_order(rng: np.random.Generator, logp: np.ndarray, tokens: int, draws: int) -> np.ndarray:
    """``[tokens, draws]`` experts in Plackett–Luce order: the top ``draws`` of
    ``logp`` + Gumbel noise, i.e. sampling without replacement (the Gumbel-top-k
    trick, Kool et al. 2019, "Stochastic Beams and Where to Find Them")."""
    keys = logp[None, :] + rng.gumbel(size=(tokens, len(logp)))
    part = np.argpartition(-keys, draws - 1, axis=1)[:, :draws]
    order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


def generate(model: RoutingModel, tokens: int, seed: int = 0) -> Trace:
    """A trace of ``tokens`` decode tokens through every layer of ``model``.

    Returns:
        :class:`mlx_tier.routing.trace.Trace` with records token-major (all layers of
        token 0, then token 1, ...), ``experts`` ``[tokens * L, k]`` int32 with
        column 0 the first choice (``meta["ordered"] = True``), phase DECODE.
    Raises:
        ValueError: ``tokens`` < 1.
    """
    if tokens < 1:
        raise ValueError("tokens must be >= 1")
    L, E, k = model.num_layers, model.num_experts, model.top_k
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(E) for _ in range(L)])  # [L, E] rank → expert id
    rank = np.argsort(perm, axis=1)  # [L, E] expert id → rank
    ranks = np.arange(1, E + 1, dtype=np.float64)
    draws = min(E, 2 * k)  # enough fresh candidates: at most k - 1 collisions
    fresh = []
    for lay in range(L):
        logp = np.full(E, -np.inf)
        logp[perm[lay]] = -model.alpha[lay] * np.log(ranks + model.offset)
        fresh.append(_fresh_order(rng, logp, tokens, draws))
    u = rng.random((tokens, L, k, 2))  # [.., 0] stickiness draw, [.., 1] affinity draw
    out = np.empty((tokens, L, k), dtype=np.int32)
    for t in range(tokens):
        for lay in range(L):
            out[t, lay] = _pick(model, t, lay, out, fresh[lay][t], u[t, lay], perm, rank)
    token = np.repeat(np.arange(tokens), L)
    layer = np.tile(np.arange(L, dtype=np.int32), tokens)
    meta = {"num_layers": L, "num_experts": E, "top_k": k, "ordered": True,
            "source": f"{model.name}: mlx_tier.routing.synthetic.generate, seed {seed}"}
    return Trace(token, layer, np.full(len(token), DECODE, np.uint8), out.reshape(-1, k), meta)


def _pick(model: RoutingModel, t: int, lay: int, out: np.ndarray, fresh: np.ndarray, u: np.ndarray,
          perm: np.ndarray, rank: np.ndarray) -> list[int]:
    """The k experts of token t at layer ``lay`` (module doc's model)."""
    chosen: list[int] = []
    nxt = 0
    for j in range(model.top_k):
        cand = -1
        stick = model.stick_first[lay] if j == 0 else model.stick_other[lay]
        if t > 0 and u[j, 0] < stick:
            cand = int(out[t - 1, lay, j])
        elif j == 0 and lay > 0 and u[j, 1] < model.affinity:
            cand = int(perm[lay, rank[lay - 1, out[t, lay - 1, 0]]])
        if cand < 0 or cand in chosen:
            while int(fresh[nxt]) in chosen:
                nxt += 1
            cand = int(fresh[nxt])
            nxt += 1
        chosen.append(cand)
    return chosen



# Adversarial traces: access patterns that defeat recency or frequency, for
# checking that a policy is scan-resistant (benches/policy_scans.py). Not
# trained-like: no published routing statistic is matched.


def _one_layer_trace(rows: list[list[int]], num_experts: int, source: str) -> Trace:
    """A one-layer DECODE trace of ``rows`` (one list of k distinct experts per token)."""
    experts = np.asarray(rows, dtype=np.int32)
    n, k = experts.shape
    return Trace(np.arange(n), np.zeros(n, np.int32), np.full(n, DECODE, np.uint8), experts,
                 {"num_layers": 1, "num_experts": num_experts, "top_k": k, "source": source})


def cyclic(num_experts: int, top_k: int, span: int, tokens: int) -> Trace:
    """A loop: token t uses experts ``t*k .. t*k + k - 1`` modulo ``span``, so every one
    of the first ``span`` experts comes back after ``span / k`` tokens. With a cache
    of fewer than ``span`` slots, LRU (and any policy that keeps the most recent)
    misses every access; Belady keeps all but ~k of the cache.

    Raises:
        ValueError: ``span`` outside ``[top_k, num_experts]`` or ``tokens`` < 1.
    """
    if not top_k <= span <= num_experts or tokens < 1:
        raise ValueError(f"need top_k <= span <= num_experts and tokens >= 1, got {top_k}, {span}, {num_experts}, {tokens}")
    rows = [[(t * top_k + j) % span for j in range(top_k)] for t in range(tokens)]
    return _one_layer_trace(rows, num_experts, f"cyclic: loop over {span} experts, top-{top_k}")


def hot_and_scan(num_experts: int, top_k: int, hot: int, tokens: int, scan_share: float = 0.12,
                 burst: int = 3, width: int = 1, seed: int = 0) -> Trace:
    """A hot set used in turn plus a scan through the other experts.

    Each token starts a scan burst with probability ``scan_share`` (when none is
    running): for ``burst`` consecutive tokens, ``width`` of the token's k picks
    are the scan's next ``width`` experts (the same ones through the burst);
    every other pick is the next expert of the hot set (``hot`` experts, round
    robin). A scanned expert is thus used ``burst`` times in a row, then not
    for a long while. LRU keeps the hot set when it fits beside the scan's
    few recent experts; LFU with dynamic aging lets the bursts outrank hot
    experts and flushes them.

    Raises:
        ValueError: ``width`` not in ``[1, top_k]``, ``hot`` not in
            ``[top_k, num_experts - width]``, or ``tokens`` < 1.
    """
    if not 1 <= width <= top_k <= hot <= num_experts - width or tokens < 1:
        raise ValueError(f"need 1 <= width <= top_k <= hot <= num_experts - width and tokens >= 1, got "
                         f"width {width}, top_k {top_k}, hot {hot}, num_experts {num_experts}, tokens {tokens}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_experts)
    hot_set, cold = order[:hot].tolist(), order[hot:].tolist()
    rows, h, s, left = [], 0, 0, 0
    for _ in range(tokens):
        if left == 0 and rng.random() < scan_share:
            scan, s, left = [cold[(s + j) % len(cold)] for j in range(width)], s + width, burst
        row = list(scan) if left else []
        left = max(0, left - 1)
        while len(row) < top_k:
            e, h = hot_set[h % hot], h + 1
            if e not in row:
                row.append(e)
        rows.append(row)
    return _one_layer_trace(rows, num_experts, f"hot {hot} + scan (share {scan_share}, burst {burst}, "
                                               f"width {width}), seed {seed}")
