"""A quantized KV cache for mlx-lm's batch primitives (the throughput schedule's pools).

Why: under a memory cap the KV caches bound the pools. On MLX's CPU backend
they are float32 (the job computes in float32): 98 KB a token on a model of
24 layers x 4 key/value heads x 128. mlx-lm quantizes a lone sequence's cache
(``QuantizedKVCache``, ``--kv-bits``), but its batched cache
(``BatchKVCache``: merge, extend, filter, extract, padding) has no quantized
form in mlx-lm 0.32, so a pool could not use it.

:class:`BatchQuantizedKVCache` is ``BatchKVCache`` with keys and values stored
as ``mx.quantize`` triples (packed codes, scales, biases: mlx-lm's
``QuantizedKVCache`` layout, groups along the head dim), so mlx-lm's attention
takes its quantized path (``quantized_scaled_dot_product_attention``, chosen
by the cache's ``bits``) and the CPU attention
(:mod:`mlx_tier.kernels.cpu_attention`) dequantizes them. Bytes per cached
element: :func:`mlx_tier.engine.footprint.kv_element_bytes` (8 bits, float32
scales, groups of 64: 1.125 of float32's 4, 0.28x).

Numerics: each token's keys and values are quantized on their own (groups of
``group_size`` along the head dim), so what a sequence's cache holds does not
depend on the other sequences of its pool; but they are not the float values:
tokens may differ from mlx-lm's unquantized cache. The effect is measured in
benches/results/kv-quant/NOTES.md; the job uses it only when asked
(``--kv-bits``).

:func:`quantizing` marks a sequence's own (float) ``KVCache`` list so that
mlx-lm's ``PromptProcessingBatch`` merges it into a
:class:`BatchQuantizedKVCache`; other cache kinds (rotating, SSM state) keep
their own batch classes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

from mlx_tier.defaults import KV_GROUP_SIZE
from mlx_tier.engine.footprint import check_kv_bits


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` over quantized keys and values (module doc).

    ``keys``/``values`` are ``None`` or triples ``(codes uint32 [B, Hk, L, D * bits / 32],
    scales [B, Hk, L, D / group_size], biases [same])``; everything else (offsets,
    left padding, masks, trimming) is ``BatchKVCache``'s.
    """

    def __init__(self, left_padding: list[int], group_size: int = KV_GROUP_SIZE, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def _quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def _empty(self, B: int, H: int, L: int, D: int, dtype: mx.Dtype) -> tuple:
        per_int = 32 // self.bits
        return (mx.zeros((B, H, L, D // per_int), mx.uint32), mx.zeros((B, H, L, D // self.group_size), dtype),
                mx.zeros((B, H, L, D // self.group_size), dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self._idx
        n = keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            B, H = keys.shape[:2]
            grow = (self.step + n - 1) // self.step * self.step
            new_k = self._empty(B, H, grow, keys.shape[3], keys.dtype)
            new_v = self._empty(B, H, grow, values.shape[3], values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                old = tree_map(lambda a: a[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b], axis=2), old, (new_k, new_v))
        self.offset = self.offset + n
        self._idx += n
        for store, new in ((self.keys, self._quantize(keys)), (self.values, self._quantize(values))):
            for a, b in zip(store, new):
                a[..., prev : self._idx, :] = b
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda a: a[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys, self.values = tree_map(lambda a: dynamic_roll(a, shift, axis=2), (self.keys, self.values))
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda a: a[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())  # drop the padding every sequence has
        if shift > 0:
            if self.keys is not None:
                # a copy, not a view: a view would keep the whole gathered buffer alive
                self.keys, self.values = tree_map(lambda a: mx.contiguous(a[..., shift:, :]), (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache):
        """Append ``other``'s sequences (right-justified to the longer of the two)."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = (self if self.keys is not None else other)

        def justified(c):
            if c.keys is None:
                B = c.offset.shape[0]
                kv = tuple(tuple(mx.zeros((B, a.shape[1], 0, a.shape[3]), a.dtype) for a in t)
                           for t in (like.keys, like.values))
            else:
                kv = (c.keys, c.values)
            left = idx - c._idx
            L = kv[0][0].shape[2]
            right = size - L - left
            if right < 0:
                kv, right = tree_map(lambda a: a[..., :right, :], kv), 0
            if left or right:
                kv = tree_map(lambda a: mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)]), kv)
            return kv, c.offset, c.left_padding + left

        (ka, va), oa, la = justified(self)
        (kb, vb), ob, lb = justified(other)
        cat = lambda a, b: mx.concatenate([a, b])  # noqa: E731
        self.keys, self.values = tree_map(cat, ka, kb), tree_map(cat, va, vb)
        self.offset, self.left_padding = cat(oa, ob), cat(la, lb)
        self._idx = idx

    def extract(self, idx: int) -> QuantizedKVCache:
        """Sequence ``idx``'s cache on its own (mlx-lm's ``QuantizedKVCache``)."""
        c = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        pad = self.left_padding.tolist()[idx]
        c.keys, c.values = tree_map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]),
                                    (self.keys, self.values))
        c.offset = self._idx - pad
        return c

    @classmethod
    def merge(cls, caches: list, group_size: int = KV_GROUP_SIZE, bits: int = 8) -> BatchQuantizedKVCache:
        """One batch cache of float ``KVCache`` s (a shared prefix copied into each), quantized,
        left-padded to the longest."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], group_size, bits)
        if longest == 0:
            return batch
        first = next(c for c in caches if c.keys is not None)
        B, (H, D), Dv = len(caches), (first.keys.shape[1], first.keys.shape[3]), first.values.shape[3]
        keys = mx.zeros((B, H, longest, D), first.keys.dtype)
        values = mx.zeros((B, H, longest, Dv), first.values.dtype)
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                keys[i : i + 1, :, longest - n :] = c.keys[..., :n, :]
                values[i : i + 1, :, longest - n :] = c.values[..., :n, :]
        batch.keys, batch.values = batch._quantize(keys), batch._quantize(values)
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)


def quantized_copy(cache: list, bits: int | None) -> list:
    """A sequence's filled prompt cache as it would be stored with ``bits`` (each plain
    ``KVCache`` as mlx-lm's ``QuantizedKVCache``), to measure its bytes; ``cache`` itself
    when ``bits`` is None.

    Raises:
        ConfigError: ``bits`` not in :data:`~mlx_tier.defaults.KV_BITS`, or a head dim the
            group size does not divide (:func:`~mlx_tier.engine.footprint.check_kv_bits`).
    """
    if bits is None:
        return cache
    out = []
    for c in cache:
        if type(c) is KVCache and c.keys is not None:
            check_kv_bits(bits, c.keys.shape[-1])
            c = c.to_quantized(group_size=KV_GROUP_SIZE, bits=bits)
        out.append(c)
    return out


class _Quantizing(KVCache):
    """A sequence's float ``KVCache`` that merges into a :class:`BatchQuantizedKVCache`."""

    kv_bits = 8
    kv_group_size = KV_GROUP_SIZE

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedKVCache.merge(caches, cls.kv_group_size, cls.kv_bits)


_MARKED: dict[tuple[int, int], type] = {}


def quantizing(cache: list, bits: int | None, group_size: int = KV_GROUP_SIZE) -> list:
    """``cache`` (a sequence's mlx-lm prompt cache) with each plain ``KVCache`` marked to
    merge into a :class:`BatchQuantizedKVCache` of ``bits``; unchanged when ``bits`` is None.
    In place; returns ``cache``."""
    if bits is None:
        return cache
    cls = _MARKED.get((bits, group_size))
    if cls is None:
        cls = _MARKED[(bits, group_size)] = type(f"Quantizing{bits}KVCache", (_Quantizing,),
                                                 {"kv_bits": bits, "kv_group_size": group_size})
    for c in cache:
        if type(c) is KVCache:
            c.__class__ = cls
    return cache
