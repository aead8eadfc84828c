"""Statistics of a routing trace: how far is its routing from a trained MoE's?

Three families, per MoE layer, for a :class:`mlx_tier.routing.trace.Trace` (E experts,
top-k per (token, layer) record; a layer's records in order are its tokens):

* **popularity** — how unevenly a layer's expert uses are spread:
  ``entropy`` (Shannon entropy of the use shares divided by log E: 1 = every
  expert used equally, 0 = one expert only), ``top_share`` (the most used
  expert's share of the layer's uses; uniform = 1/E) and ``coverage90`` (the
  fraction of experts that, hottest first, cover 90% of the uses). The same
  measures as a published Qwen3-30B-A3B routing study (see
  :mod:`mlx_tier.routing.synthetic`); ``1 - entropy`` is its "concentration".
* **step-to-step reuse** — consecutive tokens at one layer: ``reuse`` = mean
  |S_t ∩ S_t+1| / k (the share of a token's experts chosen again by the next
  token), against two baselines for independent picks: ``reuse_uniform`` =
  k/E and ``reuse_indep`` = Σ_e q_e² / k with q_e the layer's inclusion rate
  of expert e (independent picks with the trace's own popularity);
  ``overlap_any`` = P(S_t ∩ S_t+1 ≠ ∅) against ``overlap_uniform`` = 1 −
  C(E−k, k)/C(E, k) — the "first or second choice" repetition of Mixtral's
  routing analysis (Jiang et al. 2024, arXiv 2401.04088, §5 and Table 5; 46%
  for top-2 of 8). With ``ordered=True`` (column 0 is the router's first
  choice) also ``first_repeat`` = P(first_t = first_t+1) (Table 5's "first
  choice", uniform 1/E).
* **cross-layer predictability** — how well layer l's choice predicts layer
  l+1's, with a count table fitted on the first half of the tokens and scored
  on the second half (held out): ``cross_recall`` = mean |P ∩ S_l+1| / k where
  P is the k experts of layer l+1 most often chosen together with the experts
  of S_l (summed votes); ``cross_recall_static`` = the same for P = layer
  l+1's k most used experts (no conditioning); the uniform baseline is k/E.
  With ``ordered=True`` also ``cross_top1`` = P(table[first_l] = first_l+1),
  the "(Layer, Expert) → next expert" lookup-table accuracy a public Mixtral
  trace study reports.

Records of one layer are taken in trace order; a trace of several documents
is treated as one stream (a document boundary counts as one more step). A
trace recorded with batches of several sequences interleaves them, so its
"next token" is often another sequence's: record one sequence at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

import numpy as np

from mlx_tier.routing.trace import Trace


@dataclass(frozen=True)
class LayerStats:
    """Statistics of one MoE layer (fractions in [0, 1]; NaN where undefined,
    e.g. cross-layer values of the last layer)."""

    entropy: float
    top_share: float
    coverage90: float
    reuse: float
    reuse_indep: float
    overlap_any: float
    first_repeat: float
    cross_recall: float
    cross_recall_static: float
    cross_top1: float


@dataclass(frozen=True)
class RoutingStats:
    """Per-layer statistics of a trace plus its shape.

    Attributes:
        layers: one :class:`LayerStats` per MoE layer, model order.
        num_experts, top_k, tokens: E, k, and tokens per layer (the shortest layer).
        reuse_uniform, overlap_uniform: the uniform independent-pick baselines.
    """

    layers: tuple[LayerStats, ...]
    num_experts: int
    top_k: int
    tokens: int
    reuse_uniform: float
    overlap_uniform: float

    def mean(self, name: str) -> float:
        """Mean of a :class:`LayerStats` field over the layers where it is defined."""
        vals = [getattr(s, name) for s in self.layers]
        vals = [v for v in vals if not np.isnan(v)]
        return float(np.mean(vals)) if vals else float("nan")

    def as_dict(self) -> dict:
        fields = LayerStats.__dataclass_fields__
        return {"num_experts": self.num_experts, "top_k": self.top_k, "tokens": self.tokens,
                "reuse_uniform": self.reuse_uniform, "overlap_uniform": self.overlap_uniform,
                "mean": {f: self.mean(f) for f in fields},
                "per_layer": [{f: getattr(s, f) for f in fields} for s in self.layers]}


def layer_matrices(trace: Trace) -> list[np.ndarray]:
    """Per layer, its records' expert ids ``[T_l, k]`` int64, in trace order."""
    return [trace.experts[trace.layer == lay].astype(np.int64) for lay in range(trace.num_layers)]


def membership(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``[T, k]`` expert ids → ``[T, E]`` bool, True where the token chose the expert."""
    m = np.zeros((len(ids), num_experts), dtype=bool)
    np.put_along_axis(m, ids, True, axis=1)
    return m


def popularity(member: np.ndarray) -> tuple[float, float, float]:
    """``(entropy, top_share, coverage90)`` of one layer's ``[T, E]`` membership."""
    E = member.shape[1]
    uses = member.sum(axis=0).astype(np.float64)
    if uses.sum() == 0:
        return float("nan"), float("nan"), float("nan")
    share = uses / uses.sum()
    nz = share[share > 0]
    entropy = float(-(nz * np.log(nz)).sum() / np.log(E)) if E > 1 else 1.0
    cum = np.cumsum(np.sort(share)[::-1])
    coverage = (int(np.searchsorted(cum, 0.9 - 1e-12)) + 1) / E
    return entropy, float(share.max()), coverage


def reuse_stats(ids: np.ndarray, member: np.ndarray, ordered: bool) -> tuple[float, float, float, float]:
    """``(reuse, reuse_indep, overlap_any, first_repeat)`` of one layer (see module doc)."""
    T, k = ids.shape
    if T < 2:
        return (float("nan"),) * 4
    shared = (member[:-1] & member[1:]).sum(axis=1)  # [T-1] experts in common
    q = member.mean(axis=0)
    first = float((ids[:-1, 0] == ids[1:, 0]).mean()) if ordered else float("nan")
    return float(shared.mean() / k), float((q**2).sum() / k), float((shared > 0).mean()), first


def cross_stats(ids_a: np.ndarray, mem_a: np.ndarray, ids_b: np.ndarray, mem_b: np.ndarray,
                ordered: bool) -> tuple[float, float, float]:
    """``(cross_recall, cross_recall_static, cross_top1)`` of layer a → the next layer b,
    table fitted on the first half of the tokens, scored on the second half."""
    T = min(len(ids_a), len(ids_b))
    k, E = ids_b.shape[1], mem_b.shape[1]
    fit = T // 2
    if fit < 1 or T - fit < 1:
        return (float("nan"),) * 3
    table = mem_a[:fit].T.astype(np.int64) @ mem_b[:fit].astype(np.int64)  # [E, E] co-use counts a→b
    test_a, test_b = mem_a[fit:T], mem_b[fit:T]
    votes = test_a.astype(np.int64) @ table  # [T', E]
    votes = votes + 1e-6 * mem_b[:fit].sum(axis=0)  # ties → the more used expert
    pred = np.argsort(-votes, axis=1, kind="stable")[:, :k]
    recall = float(np.take_along_axis(test_b, pred, axis=1).sum(axis=1).mean() / k)
    static = np.argsort(-mem_b[:fit].sum(axis=0), kind="stable")[:k]
    recall_static = float(test_b[:, static].sum(axis=1).mean() / k)
    top1 = float("nan")
    if ordered:
        first = np.zeros((E, E), dtype=np.int64)
        np.add.at(first, (ids_a[:fit, 0], ids_b[:fit, 0]), 1)
        guess = np.argmax(first + 1e-6 * first.sum(axis=0), axis=1)  # unseen rows → most common first
        top1 = float((guess[ids_a[fit:T, 0]] == ids_b[fit:T, 0]).mean())
    return recall, recall_static, top1


def routing_stats(trace: Trace, ordered: bool | None = None) -> RoutingStats:
    """Popularity, step-to-step reuse and cross-layer predictability of ``trace``, per layer.

    Args:
        trace: any trace; each layer's records in order are its tokens (a
            layer may have fewer records than another: cross-layer statistics
            use the tokens both have, from the first).
        ordered: column 0 of ``experts`` is the router's first choice (enables
            ``first_repeat`` and ``cross_top1``). Default: ``trace.meta["ordered"]``
            (mlx-lm's top-k comes from ``argpartition``: not ordered).
    Returns:
        :class:`RoutingStats`; O(T·E) memory per layer, O(T·E²) time per layer pair.
    Raises:
        ValueError: an empty trace.
    """
    if not len(trace.layer):
        raise ValueError("empty trace: no routing records")
    if ordered is None:
        ordered = bool(trace.meta.get("ordered", False))
    E, k = trace.num_experts, int(trace.experts.shape[1])
    ids = layer_matrices(trace)
    mem = [membership(a, E) for a in ids]
    rows = []
    for lay in range(len(ids)):
        pop = popularity(mem[lay])
        reu = reuse_stats(ids[lay], mem[lay], ordered)
        if lay + 1 < len(ids):
            cross = cross_stats(ids[lay], mem[lay], ids[lay + 1], mem[lay + 1], ordered)
        else:
            cross = (float("nan"),) * 3
        rows.append(LayerStats(*pop, *reu, *cross))
    tokens = min(len(a) for a in ids)
    overlap_uniform = 1.0 - comb(E - k, k) / comb(E, k) if E >= 2 * k else 1.0
    return RoutingStats(tuple(rows), E, k, tokens, k / E, overlap_uniform)


def summary_rows(s: RoutingStats) -> list[tuple[str, str, str]]:
    """``(measure, value, independent-pick baseline)`` rows of the layer means, for display."""
    def pct(x: float) -> str:
        return "-" if np.isnan(x) else f"{x:.1%}"

    m = s.mean
    return [
        ("expert use entropy (1 = uniform)", f"{m('entropy'):.3f}", "1.000"),
        ("top expert's share of uses", pct(m("top_share")), pct(1 / s.num_experts)),
        ("experts covering 90% of uses", pct(m("coverage90")), "~90%"),
        ("experts reused at the next token", pct(m("reuse")),
         f"{pct(m('reuse_indep'))} (same popularity), {pct(s.reuse_uniform)} (uniform)"),
        ("next token shares an expert", pct(m("overlap_any")), pct(s.overlap_uniform)),
        ("first choice repeated (ordered traces)", pct(m("first_repeat")), pct(1 / s.num_experts)),
        ("layer l+1 recall, table from layer l", pct(m("cross_recall")),
         f"{pct(m('cross_recall_static'))} (most used), {pct(s.reuse_uniform)} (uniform)"),
        ("layer l+1 first choice from l's (ordered)", pct(m("cross_top1")), pct(1 / s.num_experts)),
    ]
