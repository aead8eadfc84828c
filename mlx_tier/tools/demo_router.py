"""Routers for the demo MoE fitted to route like a trained MoE.

The demo's first router (v1) was a random projection of each layer's MoE
input. Measured on held-out example documents it is far from a trained
router of its shape (8 experts, top-2): one expert takes ~29% of a layer's
uses (trained: ~17%) and consecutive tokens share an expert ~78% of the time
(Mixtral 8x7B: 48-64%, Jiang et al. 2024, arXiv 2401.04088, Table 5). Both
come from the hidden states, not from the projection being random: their mean
is far from zero (a constant per-expert offset: skew) and most of their
variance lies in slowly varying directions (consecutive tokens alike: reuse).

The fit, per layer, from the MoE inputs ``h_t`` of a calibration text:

1. centre: the router is made orthogonal to the mean ``mu`` of ``h_t``, so no
   expert gets a constant head start (near-uniform popularity, as a
   load-balanced trained router);
2. whiten in the top principal directions of ``h_t - mu`` and sort them by
   lag-1 autocorrelation ``rho`` (eigenvectors of the symmetrised lag-1
   covariance of the whitened states: a slow-feature analysis, Wiskott &
   Sejnowski 2002, "Slow Feature Analysis");
3. router = seeded Gaussian ``R [E, m]`` x ``diag(exp(-beta * rho))`` x those
   directions, with ``beta`` chosen by bisection so that the share of
   consecutive tokens sharing an expert on the calibration text equals
   Mixtral's at that depth (Table 5's "first or second choice", layers
   0/15/31 interpolated to the demo's depth). ``beta > 0`` weights fast
   directions (less reuse), ``beta < 0`` slow ones (more).

Mixtral's gate has no bias, so the fit changes only the gate's weight. Each
expert's row is scaled so its logits have unit standard deviation on the
calibration text: no expert wins by the scale of its row (with the centring,
this keeps use near-uniform), and the top-k's softmax weights stay moderate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_tier.routing.stats import membership, popularity, reuse_stats
from mlx_tier.routing.synthetic import MIXTRAL_OVERLAP_ANY, at_mixtral_depths

COMPONENTS = 64  # principal directions kept (the calibration text has a few hundred tokens)
BETA_RANGE = (-40.0, 40.0)


@dataclass(frozen=True)
class FittedRouter:
    """One layer's fitted router and what it does on the calibration text.

    ``weight`` is ``[E, D]`` float32; ``overlap_any`` is P(consecutive tokens
    share an expert) and ``top_share`` the most used expert's share, both on
    the calibration tokens; ``target`` is the ``overlap_any`` aimed at.
    """

    weight: np.ndarray
    beta: float
    overlap_any: float
    top_share: float
    target: float


def top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """``[T, E]`` router logits → ``[T, k]`` int64 expert ids, highest logit first (mlx-lm's
    gate picks the same set, in no particular order)."""
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def overlap_any(ids: np.ndarray, num_experts: int) -> float:
    """P(two consecutive tokens share an expert) of ``[T, k]`` ids (``routing_stats``' ``overlap_any``)."""
    return reuse_stats(ids, membership(ids, num_experts), ordered=False)[2]


def mixtral_overlap_targets(num_layers: int) -> tuple[float, ...]:
    """Mixtral 8x7B's "first or second choice" repetition (Table 5 of arXiv
    2401.04088, layers 0/15/31) interpolated to ``num_layers`` layers."""
    return at_mixtral_depths(MIXTRAL_OVERLAP_ANY, num_layers)


def slow_directions(hidden: np.ndarray, components: int = COMPONENTS) -> tuple[np.ndarray, np.ndarray]:
    """Whitened principal directions of ``hidden`` sorted by lag-1 autocorrelation.

    Args:
        hidden: ``[T, D]`` MoE inputs in token order (T >= 3).
        components: principal directions kept (at most T - 1).
    Returns:
        ``(directions [m, D] float64, rho [m])``: ``(h - mu) @ directions.T``
        has unit-variance, uncorrelated coordinates whose lag-1
        autocorrelations are ``rho`` (ascending: fastest first). Every
        direction is orthogonal to the mean ``mu``; each direction's sign is
        fixed (its largest entry positive), so the sign choices of the SVD and
        eigensolver (which vary with the LAPACK build) do not change it.
    Raises:
        ValueError: fewer than 3 tokens, or states that do not vary.
    """
    h = np.asarray(hidden, dtype=np.float64)
    if len(h) < 3:
        raise ValueError(f"need at least 3 tokens to fit a router, got {len(h)}")
    mu = h.mean(axis=0)
    u = mu / (np.linalg.norm(mu) or 1.0)
    hc = h - mu
    hc -= np.outer(hc @ u, u)  # no direction along the mean: no constant per-expert offset
    _, s, vt = np.linalg.svd(hc, full_matrices=False)
    m = int(min(components, len(h) - 1, (s > s[0] * 1e-6).sum())) if s.size and s[0] > 0 else 0
    if m == 0:
        raise ValueError("the hidden states do not vary apart from their mean: no router can be fitted")
    basis = vt[:m] / (s[:m, None] / np.sqrt(len(h)))  # whitening: unit variance per coordinate
    z = hc @ basis.T
    lag = (z[:-1].T @ z[1:] + z[1:].T @ z[:-1]) / (2 * (len(z) - 1))
    rho, q = np.linalg.eigh(lag)
    dirs = q.T @ basis
    dirs *= np.sign(dirs[np.arange(len(dirs)), np.abs(dirs).argmax(axis=1)])[:, None]
    return dirs, rho


def fit_router(hidden: np.ndarray, rng: np.random.Generator, num_experts: int, k: int,
               target: float) -> FittedRouter:
    """Fit one layer's router so its calibration routing shares an expert between
    consecutive tokens ``target`` of the time (see module doc).

    Args:
        hidden: ``[T, D]`` the layer's MoE inputs on the calibration text, in order.
        rng: seeded generator for the Gaussian mixing ``[E, m]``.
        num_experts, k: E and top-k.
        target: ``overlap_any`` aimed at; out of reach, the nearest end of
            ``BETA_RANGE`` is kept.
    Returns:
        :class:`FittedRouter`.
    Raises:
        ValueError: fewer than 3 tokens.
    """
    dirs, rho = slow_directions(hidden)
    mix = rng.standard_normal((num_experts, len(rho)))
    h = np.asarray(hidden, dtype=np.float64)

    def at(beta: float) -> tuple[np.ndarray, np.ndarray]:
        w = (mix * np.exp(-beta * (rho - rho.mean()))[None, :]) @ dirs
        spread = (h @ w.T).std(axis=0)  # [E]: each expert's logits to unit spread, so none wins by scale
        w /= np.where(spread > 0, spread, 1.0)[:, None]
        return w, top_k(h @ w.T, k)

    lo, hi = BETA_RANGE  # overlap falls as beta rises
    for _ in range(40):
        mid = (lo + hi) / 2
        if overlap_any(at(mid)[1], num_experts) > target:
            lo = mid
        else:
            hi = mid
    beta = (lo + hi) / 2
    w, ids = at(beta)
    return FittedRouter(w.astype(np.float32), beta, overlap_any(ids, num_experts),
                        popularity(membership(ids, num_experts))[1], target)


CHUNK = 32  # calibration tokens per forward step: a progress line every few seconds on a slow CPU


def moe_inputs(model_dir: Path, text: str | None = None,
               progress: Callable[[int, int], None] = lambda done, total: None) -> list[np.ndarray]:
    """Each layer's MoE inputs (after ``post_attention_layernorm``) on ``text``, by plain mlx-lm.

    The inputs are captured by replacing each decoder layer's
    ``block_sparse_moe`` with a recording wrapper (mlx-lm's Mixtral layer calls
    ``self.block_sparse_moe(self.post_attention_layernorm(h))``). The text is
    read in steps of ``CHUNK`` tokens with a KV cache, as a prompt is, so that
    ``progress(tokens_done, tokens_total)`` is called every few seconds (the
    whole text in one step took ~60 s, silent, on a 2-core CPU).

    Args:
        model_dir: a Mixtral-layout checkpoint (the demo's).
        text: the text read; default the packaged calibration text
            (``mlx_tier/data/calibration.txt``, the Gettysburg Address).
        progress: called after each step.
    Returns:
        per layer ``[T, D]`` float32, T = the text's token count, in order.
    Raises:
        FileNotFoundError, ValueError: what ``mlx_lm.load`` raises for a missing
            or unsupported checkpoint.
    """
    from importlib import resources

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    if text is None:
        text = resources.files("mlx_tier.data").joinpath("calibration.txt").read_text(encoding="utf-8")
    model, tokenizer = load(str(model_dir))
    seen: list[list[mx.array]] = []
    for layer in model.model.layers:
        inner, store = layer.block_sparse_moe, []
        seen.append(store)

        def capture(x, inner=inner, store=store):
            store.append(x.astype(mx.float32))
            return inner(x)

        layer.block_sparse_moe = capture
    ids, cache = tokenizer.encode(text), make_prompt_cache(model)
    for start in range(0, len(ids), CHUNK):
        mx.eval(model.model(mx.array([ids[start:start + CHUNK]]), cache=cache), [s[-1] for s in seen])
        progress(min(start + CHUNK, len(ids)), len(ids))
    return [np.array(mx.concatenate(s, axis=1)[0]) for s in seen]
