"""MLX's memory controls for a tiered model: the wired limit and the buffer cache.

Why (from public reports on Macs): weights that are not wired decoded
up to 40x slower; a batched path without a wired limit ~10x slower; MLX's
default buffer cache (as large as the memory limit) let a 10 GB model on a 16 GB
Mac write ~1 TB/day to swap. A slot cache reads misses into fresh buffers and
frees them all night, so an unbounded cache hoards them.

What mlx-tier does, on every backend, for the whole job:
- wired limit (Metal only): the resident set -- dense part + expert slabs +
  a KV-cache estimate -- plus a margin, at most the device's
  ``max_recommended_working_set_size`` (MLX refuses more). MLX wires only
  Metal buffers, so on the CPU and CUDA backends nothing is set and the report
  says why. mlx-lm's own generators raise it to the recommended maximum while
  they run and put ours back when they close.
- cache limit (every backend): room to recycle :data:`CACHE_SLOTS` freed
  slot-sized buffers, at least :data:`CACHE_FLOOR`, at most the buffers' share
  of a run's memory split (:func:`mlx_tier.engine.footprint.split`) when there
  is one, and never above the limit already in force.
Both are restored on exit (:func:`memory_controls`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_tier.engine.budgets import backend_of
from mlx_tier.units import GIB

WIRED_MARGIN = 0.10  # over the resident set: activations and one step's temporaries
CACHE_SLOTS = 16  # freed slot-sized buffers kept for reuse: twice a top-8 layer's misses
CACHE_FLOOR = 256 << 20  # bytes; small models still recycle their activations


@dataclass(frozen=True)
class ResidentSet:
    """Bytes a tiered model keeps resident for a whole job.

    Attributes:
        dense_bytes: every model array outside the expert slabs (attention,
            embeddings, norms, routers, shared experts).
        slab_bytes: all expert slots of all layers (``ExpertCache.resident_bytes``).
        kv_bytes: KV-cache estimate for the batch at the usable context.
        slot_bytes: one expert slot, the unit the cache frees and allocates.
    """

    dense_bytes: int
    slab_bytes: int
    kv_bytes: int
    slot_bytes: int

    @property
    def total(self) -> int:
        return self.dense_bytes + self.slab_bytes + self.kv_bytes


@dataclass(frozen=True)
class MemorySettings:
    """Limits chosen for a job, and why. Bytes throughout.

    Attributes:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        wired_limit: the wired limit to set; ``None`` where it does not apply.
        wired_max: the device's ``max_recommended_working_set_size`` (``None`` off Metal).
        wired_covers_resident: the limit covers the resident set plus margin
            (``None`` off Metal).
        cache_target: the buffer-cache limit wanted (the one set is never higher
            than the limit in force before).
        note: one line on what was done.
    """

    backend: str
    resident: ResidentSet
    wired_limit: int | None
    wired_max: int | None
    wired_covers_resident: bool | None
    cache_target: int
    note: str


def kv_bytes_estimate(args, context: int, batch: int, itemsize: int) -> int:
    """Standard-attention KV cache of ``batch`` sequences of ``context`` tokens:
    ``2 x layers x kv_heads x head_dim x itemsize x context x batch`` (an upper
    bound for sliding-window and linear-attention layers; 0 if ``args`` lacks
    the attention shape)."""
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(args, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(args, "head_dim", 0) or (getattr(args, "hidden_size", 0) // heads if heads else 0))
    layers = int(getattr(args, "num_hidden_layers", 0) or 0)
    return 2 * layers * kv_heads * head_dim * itemsize * context * batch


def _activation_itemsize(arrays: list[mx.array]) -> int:
    """Bytes per element of a model's activations, and so of its KV cache: those
    of the floating dtype that holds most of its parameter bytes (2 if none)."""
    held: dict[mx.Dtype, int] = {}
    for a in arrays:
        if mx.issubdtype(a.dtype, mx.floating):
            held[a.dtype] = held.get(a.dtype, 0) + a.nbytes
    return max(held, key=held.get).size if held else 2


def resident_set(model, context: int, batch: int) -> ResidentSet:
    """The :class:`ResidentSet` of a model from :func:`mlx_tier.load`."""
    cache = model.expert_cache
    slabs = {id(getattr(t.module, t.attr)) for layer in cache.layers for t in layer.tensors.values()}
    arrays = [a for _, a in tree_flatten(model.parameters()) if isinstance(a, mx.array)]
    dense = sum(a.nbytes for a in arrays if id(a) not in slabs)
    kv = kv_bytes_estimate(getattr(model, "args", None), context, batch, _activation_itemsize(arrays))
    slot = max(layer.slot_nbytes for layer in cache.layers)
    return ResidentSet(int(dense), int(cache.resident_bytes), int(kv), int(slot))


def plan_memory(resident: ResidentSet, backend: str, device_info: dict, buffers: int | None = None) -> MemorySettings:
    """Choose the limits for ``resident`` (pure: no MLX call).

    Args:
        backend: ``"metal"``, ``"cuda"`` or ``"cpu"``.
        device_info: ``mx.device_info()``; on Metal it holds
            ``max_recommended_working_set_size``.
        buffers: bytes of a run's memory split left to MLX's buffer cache
            (:class:`mlx_tier.engine.footprint.MemoryBudget`); ``None``: no split.
    """
    cache_target = max(CACHE_FLOOR, CACHE_SLOTS * resident.slot_bytes)
    if buffers is not None:
        cache_target = min(cache_target, buffers)
    wired_max = device_info.get("max_recommended_working_set_size") if backend == "metal" else None
    if wired_max is None:
        why = "MLX wires only Metal buffers" if backend != "metal" else "the device reports no recommended size"
        return MemorySettings(backend, resident, None, None, None, cache_target, f"no wired limit: {why}")
    want = int(resident.total * (1 + WIRED_MARGIN))
    limit = min(want, int(wired_max))
    covers = want <= wired_max
    note = (f"wired {limit / GIB:.2f} GiB covers the resident set {resident.total / GIB:.2f} GiB + margin"
            if covers else
            f"resident set {resident.total / GIB:.2f} GiB + margin exceeds the recommended maximum "
            f"{wired_max / GIB:.2f} GiB: wired at the maximum; a smaller `cache_gb` avoids paging")
    return MemorySettings(backend, resident, limit, int(wired_max), covers, cache_target, note)


@contextmanager
def memory_controls(settings: MemorySettings, api=mx) -> Iterator[dict]:
    """Apply ``settings`` with ``api`` (``mlx.core``, or a fake in tests);
    restore the previous limits on exit, after the device has finished.

    Yields:
        the report dict: the settings plus ``cache_limit`` (the one set),
        ``previous_cache_limit``, ``previous_wired_limit``.
    """
    previous_cache = int(api.set_cache_limit(settings.cache_target))
    cache_limit = settings.cache_target
    if previous_cache < cache_limit:  # never raise it: keep the stricter limit
        api.set_cache_limit(previous_cache)
        cache_limit = previous_cache
    previous_wired = None
    if settings.wired_limit is not None:
        previous_wired = int(api.set_wired_limit(settings.wired_limit))
    report = {**asdict(settings), "resident_total": settings.resident.total, "cache_limit": cache_limit,
              "previous_cache_limit": previous_cache, "previous_wired_limit": previous_wired}
    try:
        yield report
    finally:
        api.synchronize()  # the wired limit must not change under a running evaluation
        if previous_wired is not None:
            api.set_wired_limit(previous_wired)
        api.set_cache_limit(previous_cache)


def model_memory_controls(model, context: int, batch: int, api=mx, buffers: int | None = None):
    """:func:`memory_controls` sized for a model from :func:`mlx_tier.load`
    serving ``batch`` sequences of up to ``context`` tokens (``buffers``: :func:`plan_memory`)."""
    backend = backend_of(api)
    return memory_controls(plan_memory(resident_set(model, context, batch), backend, api.device_info(), buffers), api)
