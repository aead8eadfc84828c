"""Prefetch: predict the next MoE layer's experts and read them while this layer computes.

Technique ("speculative expert loading", Eliseev & Mazur, *Fast Inference of
Mixture-of-Experts Language Models with Offloading*, arXiv:2312.17238): the
hidden state changes little from one layer to the next, so applying layer
l+1's router to layer l's expert-block input ``x_l`` predicts layer l+1's
top-k experts before layer l+1 runs. Reads of the predicted experts that are
not resident in layer l+1 start on a background thread at layer l; layer l's
expert compute and layer l+1's attention run while they proceed (``mx.eval``
releases the GIL, and ``os.preadv`` does too).

Only *bytes* are fetched here. Slot assignment, eviction and hit/miss counts
stay in :meth:`mlx_tier.engine.cache.LayerCache._ensure` exactly as without prefetch
(a prefetched expert still counts as a miss: it was read from the cold tier,
only earlier), so the routing simulator stays exact and the greedy tokens are
unchanged whatever the prediction. Prediction quality shows in
``CacheStats.prefetch_*``.

Temporary memory: at most one batch of predicted experts per layer call is in
flight or waiting, capped at the next layer's slot count (decode: top-k
experts, in their on-disk dtype); it is dropped at the end of that layer's call.

Mechanism only: *whether* to prefetch is ``TierConfig.prefetch``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

# Router = x [..., D] -> logits [..., E]
Router = Callable[[mx.array], mx.array]

# Words that name a router in mlx-lm's MoE blocks (gate, router, wg, classifier);
# a shape match under one of these names is preferred over any other.
_ROUTER_WORDS = ("gate", "router", "wg", "classifier")


@dataclass
class PrefetchedRead:
    """A background read of experts for one layer: predicted ones, or the next
    round's (:meth:`mlx_tier.engine.cache.LayerCache.assign`).

    Attributes:
        experts: expert ids, in the row order of the read.
        future: resolves to name -> numpy array ``[len(experts), ...]`` (raw
            on-disk dtype), as :meth:`mlx_tier.engine.store.ExpertStore.read_experts`.
        expert_nbytes: raw bytes of one expert (all its tensors).
        predicted: a prediction (counted in ``CacheStats.prefetch_*``), not a
            round's known experts read ahead.
    """

    experts: list[int]
    future: Future
    expert_nbytes: int
    predicted: bool = True

    def result(self) -> dict[str, np.ndarray] | None:
        """Wait for the read; ``None`` if it failed (the caller reads normally)."""
        try:
            return self.future.result()
        except (OSError, ValueError):  # CheckpointError too; a failed prefetch only loses the head start
            return None


class BackgroundReader:
    """One thread that runs the store's batched reads off the forward pass.

    A single dispatcher keeps at most one prefetch batch in flight; the batch
    itself fans out over the store's read pool. Each layer resolves its own
    batch before it reads anything else, so the store never serves two
    batches at once (its counters are not locked).
    """

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-tier-prefetch")

    def __deepcopy__(self, memo) -> BackgroundReader:
        return BackgroundReader()  # a copied model prefetches on a thread of its own

    def submit(self, store, names: list[str], experts: list[int], out: dict | None = None) -> Future:
        """Start ``store.read_experts(names, experts, out=out)``; returns its future."""
        if out is None:
            return self._pool.submit(store.read_experts, names, experts)
        return self._pool.submit(store.read_experts, names, experts, out=out)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _MatmulRouter:
    """A router module whose ``__call__`` is not a plain projection (e.g.
    DeepSeek's ``MoEGate`` returns ids and scores): ``x @ weight.T``."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, x: mx.array) -> mx.array:
        w = self.module["weight"]  # [E, D], read at call time (dtype may change after load)
        return x @ w.T.astype(x.dtype)


def find_router(moe: nn.Module, num_experts: int, input_dims: int) -> Router | None:
    """The router of an MoE block, found by shape.

    Searches the modules under ``moe`` (the parent of the expert block) for a
    2-D ``weight`` with E output rows: an ``nn.Linear``/``nn.QuantizedLinear``
    is called as is (bias included); another module (DeepSeek's ``MoEGate``,
    ``BailingGate``...) is applied as ``x @ weight.T``. Names containing
    ``shared`` are skipped; names with gate/router/wg/classifier are preferred.

    Args:
        moe: the module holding the expert block.
        num_experts: E.
        input_dims: D, the expert block's input width.

    Returns:
        ``x [..., D] -> logits [..., E]``, or ``None`` when nothing fits
        (prefetch is then off for that layer). In mlx-lm 0.32: gemma4_text
        (its router sits outside the block and reads another hidden state),
        kimi_k3 (experts see a down-projected x, the router the full one),
        longcat_flash (its router scores E + "zero" experts).
    """
    found = []
    for name, m in moe.named_modules():
        w = m.get("weight") if m is not moe else None
        if not isinstance(w, mx.array) or w.ndim != 2 or w.shape[0] != num_experts or "shared" in name:
            continue
        if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
            router = m
        elif mx.issubdtype(w.dtype, mx.floating) and w.shape[1] == input_dims:
            router = _MatmulRouter(m)
        else:
            continue
        try:  # shapes are checked when the graph is built; nothing is evaluated
            if router(mx.zeros((1, input_dims))).shape != (1, num_experts):
                continue
        except ValueError:
            continue
        found.append((not any(word in name.lower() for word in _ROUTER_WORDS), len(found), router))
    return min(found, key=lambda f: f[:2])[2] if found else None


class NextLayerPrefetch:
    """Layer l's link to layer l+1: predicts l+1's experts and starts their reads.

    Args:
        router: layer l+1's router (:func:`find_router`).
        next_cache: layer l+1's :class:`~mlx_tier.engine.cache.LayerCache`.
        reader: the shared background reader.
    """

    def __init__(self, router: Router, next_cache, reader: BackgroundReader):
        self.router = router
        self.next_cache = next_cache
        self.reader = reader
        self._names = list(next_cache.tensors)
        self._expert_nbytes = next_cache.raw_expert_nbytes

    def predict(self, x: mx.array, k: int) -> mx.array | None:
        """Lazy top-k expert ids ``[..., k]`` (uint32) of layer l+1's router on
        ``x`` ``[..., D]``; ``None`` when nothing can miss in layer l+1."""
        if self.next_cache.all_resident():
            return None
        logits = self.router(x)  # [..., E]
        return mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]

    def wanted(self, experts: list[int]) -> list[int]:
        """Of the predicted experts (most voted first), those to read: not
        resident in layer l+1, at most its slot count."""
        cache = self.next_cache
        return [e for e in experts if cache.slot_of[e] < 0][: cache.num_slots]

    def issue(self, predicted: np.ndarray) -> None:
        """Start reading the predicted experts not resident in layer l+1.

        At most S (layer l+1's slots) experts are read, the most voted first.
        Any earlier batch of layer l+1 is dropped first (at most one per layer).
        """
        cache = self.next_cache
        cache.end_call()  # drop an unused earlier batch before choosing what is missing
        if cache.recorder is not None:  # a routing trace keeps the prediction (mlx_tier.routing.trace)
            cache.recorder.predict(cache.layer, predicted)
        ids, votes = np.unique(predicted, return_counts=True)
        order = np.argsort(-votes, kind="stable")
        experts = self.wanted([int(e) for e in ids[order]])
        if not experts:
            return
        future = self.reader.submit(cache.store, self._names, experts)
        cache.accept_prefetch(PrefetchedRead(experts, future, self._expert_nbytes))


def expert_input_dims(block: nn.Module) -> int | None:
    """D of an mlx-lm ``SwitchGLU`` (``gate_proj``) or ``SwitchMLP`` (``fc1``), else None."""
    first = block.get("gate_proj", block.get("fc1"))
    return getattr(first, "input_dims", None)


def link_layers(parents: list[nn.Module], blocks: list[nn.Module], caches: list, reader: BackgroundReader) -> list:
    """For each MoE layer l, its link to layer l+1's router and cache.

    Args:
        parents: the module holding each expert block, in model order.
        blocks: the mlx-lm expert blocks (for D), same order.
        caches: each layer's :class:`~mlx_tier.engine.cache.LayerCache`, same order.
        reader: the background reader all links share.

    Returns:
        One :class:`NextLayerPrefetch` or ``None`` per layer: ``None`` for the
        last layer and where layer l+1 has no router :func:`find_router` finds.
    """
    links = []
    for nxt in range(1, len(caches)):
        dims = expert_input_dims(blocks[nxt])
        router = find_router(parents[nxt], caches[nxt].num_experts, dims) if dims else None
        links.append(NextLayerPrefetch(router, caches[nxt], reader) if router is not None else None)
    return links + [None]
