"""CPU attention: scaled dot-product attention on numpy's BLAS, for MLX's CPU backend.

Why: on the Linux ``mlx[cpu]`` wheel, MLX's matmuls run on the reference BLAS
it bundles; its ``scaled_dot_product_attention`` measured 0.8-2.4 GFLOP/s on
the build machine (2 cores, shared), where numpy's OpenBLAS runs a float32
GEMM at 20-45 GFLOP/s. Attention grows with the context, so on documents of
hundreds of tokens it became the largest part of a layer step once experts
were computed by the CPU kernel (benches/results/throughput/NOTES.md).

Dimension legend: B sequences, H query heads, Hk key/value heads (H = Hk x G),
Lq queries, Lk keys, D head dim.

What it computes is ``mx.fast.scaled_dot_product_attention(q, k, v, scale,
mask)``: softmax(scale * q k^T + mask) v, in float32, per (sequence, key/value
head) on the kernel's threads (BLAS single-threaded inside them, as the
expert kernel does), queries in blocks so that the scores stay small. Masks as
mlx-lm makes them: ``None``, ``"causal"`` (the last Lq of Lk positions), a
boolean array (``True`` = attend) or an additive float array, broadcastable
to ``[B, H, Lq, Lk]``. Keys a sequence's mask never attends (a batch's left
padding: mlx-lm pads each sequence to the longest) are left out of its work,
and so are the keys none of a block of queries attends (a causal mask's later
keys: about half of a long prompt chunk's scores, :func:`_block_spans`);
in a decode pool (one query a sequence, more sequences than threads) all
heads of a sequence go in one batched product. On 32 sequences of 300-1,500
tokens the two halve a decode step's attention (benches/results/throughput/
NOTES.md). A quantized KV cache (``bits``: mlx-lm's ``QuantizedKVCache``,
:class:`mlx_tier.job.quantized_kv.BatchQuantizedKVCache`) is dequantized to
float32 as it is read, a sequence's attended keys at a time, on the same threads
(4 and 8 bits; mlx-lm's other ``kv_bits`` keep MLX's path). Attention sinks keep MLX's path. Numerics: fp32 in another summation order than MLX, so equal within
fp32 rounding (tests/kernels/test_cpu_attention.py), not bit for bit.

How it is used: :func:`serve_attention` gives each attention module of a
model a subclass that marks its calls, and replaces the architecture
module's ``scaled_dot_product_attention`` (mlx-lm's ``models.base`` function,
imported by each architecture) with a dispatcher that sends only marked
calls here: other models in the process keep MLX's attention.
"""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.kernels import cpu

# Queries per block: the scores of a block are G x QUERY_BLOCK x Lk float32.
QUERY_BLOCK = 256
# A quantized KV cache's bits read here (whole codes in a byte); others keep MLX's path.
QUANTIZED_BITS = (4, 8)
_MARK = threading.local()  # .on: inside an attention module served here


def _mask_array(mask, B: int, H: int, Lq: int, Lk: int) -> np.ndarray | None:
    """``mask`` as a numpy array broadcastable to ``[B, H, Lq, Lk]`` (bool: attend; float:
    added), or ``None``."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        rows = np.arange(Lk - Lq, Lk)[:, None]
        return rows >= np.arange(Lk)[None]  # [Lq, Lk]
    m = np.asarray(mask.astype(mx.float32) if mask.dtype not in (mx.bool_, mx.float32) else mask)
    while m.ndim < 4:
        m = m[None]
    return m


class _HostKV:
    """Keys or values on the host, read a sequence's slice at a time: float32
    ``[B, Hk, Lk, D]`` as a numpy view, or ``mx.quantize`` triples (a quantized KV
    cache: codes, scales, biases) dequantized slice by slice on the kernel's
    threads, only the keys a sequence attends (MLX's CPU ``dequantize`` of the
    whole cache each layer tripled a decode step's cost)."""

    def __init__(self, t, group_size: int | None = None, bits: int | None = None):
        if isinstance(t, (tuple, list)):
            codes, scales, biases = np.asarray(t[0]), cpu._host(t[1]), cpu._host(t[2])  # bf16 scales: float32
            self.parts = (codes.view(np.uint8), scales, biases)
            self.group_size, self.bits = group_size, bits
            B, Hk, Lk = codes.shape[:3]
            self.shape = (B, Hk, Lk, scales.shape[-1] * group_size)
            self.full = None
        else:
            self.full = cpu._host(t)
            self.shape = self.full.shape

    def rows(self, b: int, h: int | None, k0: int, k1: int) -> np.ndarray:
        """Sequence ``b``'s keys ``k0:k1`` of head ``h`` (``[n, D]``) or of every head
        (``h`` None: ``[Hk, n, D]``), float32."""
        heads = slice(None) if h is None else h
        if self.full is not None:
            return self.full[b, heads, k0:k1]
        codes, scales, biases = (a[b, heads, k0:k1] for a in self.parts)
        if self.bits == 4:  # two codes a byte, the low nibble first (mx.quantize's packing)
            codes = np.stack([codes & 15, codes >> 4], -1).reshape(*codes.shape[:-1], -1)
        g = codes.reshape(*codes.shape[:-1], -1, self.group_size).astype(np.float32)
        g *= scales[..., None]
        g += biases[..., None]
        return g.reshape(*codes.shape[:-1], -1)


def sdpa(q: mx.array, k, v, scale: float, mask=None, group_size: int | None = None,
         bits: int | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` on numpy's BLAS.

    Args:
        q: ``[B, H, Lq, D]``; k, v: ``[B, Hk, Lk, D]`` (``H`` a multiple of ``Hk``), or
            each a quantized cache's ``(codes, scales, biases)`` of ``mx.quantize``
            with ``group_size`` and ``bits`` (dequantized as they are read).
        scale: multiplies ``q k^T``.
        mask: ``None``, ``"causal"``, or a bool/additive array broadcastable to ``[B, H, Lq, Lk]``.

    Returns:
        ``[B, H, Lq, D]`` in ``q.dtype``, evaluated.

    Raises:
        ValueError: ``H`` not a multiple of ``Hk``, or an unknown mask string.
    """
    mx.eval(q, k, v)
    B, H, Lq, D = q.shape
    ks, vs = _HostKV(k, group_size, bits), _HostKV(v, group_size, bits)
    Hk, Lk = ks.shape[1], ks.shape[2]
    if H % Hk:
        raise ValueError(f"{H} query heads do not group over {Hk} key/value heads")
    G = H // Hk
    qs = cpu._host(q).reshape(B, Hk, G, Lq, D)
    m = _mask_array(mask, B, H, Lq, Lk)
    spans = _key_spans(m, B, Lk)
    blocks = _block_spans(m, B, Lq, Lk, spans) if Lq > 1 else None
    masked = _masked_from(m, B, Lq, blocks)
    out = np.empty((B, Hk, G, Lq, D), np.float32)
    s = np.float32(scale)

    def work(j0, j1):
        for j in range(j0, j1):
            b, h = divmod(j, Hk)
            k0, k1 = spans[b]
            kb, vb = ks.rows(b, h, k0, k1), vs.rows(b, h, k0, k1)  # [k1 - k0, D]
            for i, r0 in enumerate(range(0, Lq, QUERY_BLOCK)):
                r1 = min(Lq, r0 + QUERY_BLOCK)
                c0, c1 = blocks[b][i] if blocks is not None else (k0, k1)  # the keys the block attends
                scores = (qs[b, h, :, r0:r1] * s) @ kb[c0 - k0:c1 - k0].T  # [G, r, c1 - c0]
                if masked is not None:  # a boolean mask, only on the keys some query leaves out
                    f = masked[b][i]
                    if f < c1:
                        mb = _block_mask(m, b, h, G, r0, r1)[..., f:c1]
                        np.copyto(scores[..., f - c0:], -np.inf, where=~mb)
                elif m is not None:
                    mb = _block_mask(m, b, h, G, r0, r1)
                    mb = mb[..., c0:c1] if mb.shape[-1] > 1 else mb
                    scores = np.where(mb, scores, -np.inf) if mb.dtype == np.bool_ else scores + mb
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=-1, keepdims=True)
                out[b, h, :, r0:r1] = scores @ vb[c0 - k0:c1 - k0]

    with cpu._BLAS.limit(limits=1, user_api="blas"):
        if Lq == 1 and m is not None and m.ndim == 4 and B >= 2 * cpu.THREADS:
            cpu._parallel(lambda b0, b1: _decode(qs, ks, vs, m, spans, s, out, b0, b1), B, grain=1)
        else:
            cpu._parallel(work, B * Hk, grain=1)
    y = mx.array(out.reshape(B, H, Lq, D))
    return y if q.dtype == mx.float32 else y.astype(q.dtype)


def _decode(qs, ks, vs, m, spans, s, out, b0: int, b1: int) -> None:
    """:func:`sdpa`'s decode pool (one query a sequence): sequences ``b0:b1``, all heads of
    a sequence in one batched matmul, into ``out`` (``[B, Hk, G, 1, D]``)."""
    Hk, G = qs.shape[1], qs.shape[2]
    for b in range(b0, b1):
        k0, k1 = spans[b]
        scores = (qs[b] * s) @ ks.rows(b, None, k0, k1)[:, None].swapaxes(-1, -2)  # [Hk, G, 1, k1 - k0]
        if m is not None:
            mb = m[b if m.shape[0] > 1 else 0]  # [H or 1, 1, Lk or 1]
            if mb.shape[0] > 1:
                mb = mb.reshape(Hk, G, 1, -1)
            if mb.shape[-1] > 1:
                mb = mb[..., k0:k1]
            if mb.dtype != np.bool_:
                scores = scores + mb
            elif not mb.all():  # a sequence's span attended throughout (its left padding): no mask
                scores = np.where(mb, scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[b] = scores @ vs.rows(b, None, k0, k1)[:, None]


def _key_spans(m: np.ndarray | None, B: int, Lk: int) -> list[tuple[int, int]]:
    """Per sequence, the keys ``[k0, k1)`` outside of which its mask attends to none (a
    batch's left padding: mlx-lm's ``BatchKVCache`` pads each sequence to the longest).
    Leaving those keys out changes nothing (their weights are exactly 0) and saves their
    share of the work: in a decode pool of documents of 300-1,500 tokens, about a third.
    A sequence that attends to no key keeps them all (its rows come out NaN; MLX's CPU
    kernel gives finite values there: rows of padding, which no query reads)."""
    if m is None or m.ndim < 4 or m.shape[-1] == 1:
        return [(0, Lk)] * B
    spans = []
    for b in range(B):
        mb = m[b if m.shape[0] > 1 else 0]
        cols = (mb if mb.dtype == np.bool_ else mb != -np.inf).reshape(-1, mb.shape[-1]).any(axis=0)
        hit = np.flatnonzero(cols)
        spans.append((int(hit[0]), int(hit[-1]) + 1) if hit.size else (0, Lk))
    return spans


def _block_spans(m: np.ndarray | None, B: int, Lq: int, Lk: int,
                 spans: list[tuple[int, int]]) -> list[list[tuple[int, int]]] | None:
    """Per sequence and block of :data:`QUERY_BLOCK` queries, the keys ``[c0, c1)`` (within
    the sequence's span) outside of which no query of the block attends: a causal mask's
    later keys. A prompt chunk of Lq queries over Lk keys then does ~Lq/2 fewer keys'
    work a query (FlashAttention's skipping of fully masked blocks, arXiv 2205.14135);
    the keys left out have weight exactly 0. A block that attends to no key keeps its
    sequence's span (its rows come out NaN as before: a batch's padding, never read).
    ``None``: no mask, every block all keys."""
    if m is None or m.shape[-1] == 1:
        return None
    out = []
    for b in range(B):
        mb = m if m.ndim == 2 else m[b if m.shape[0] > 1 else 0]  # [(H or 1,) Lq or 1, Lk]
        attend = (mb if mb.dtype == np.bool_ else mb != -np.inf).reshape(-1, *mb.shape[-2:]).any(axis=0)
        if attend.shape[0] == 1:  # one row for every query
            attend = np.broadcast_to(attend, (Lq, Lk))
        k0, k1 = spans[b]
        row = []
        for r0 in range(0, Lq, QUERY_BLOCK):
            cols = np.flatnonzero(attend[r0:r0 + QUERY_BLOCK].any(axis=0))
            row.append((max(k0, int(cols[0])), min(k1, int(cols[-1]) + 1)) if cols.size else (k0, k1))
        out.append(row)
    return out


def _masked_from(m: np.ndarray | None, B: int, Lq: int,
                 blocks: list[list[tuple[int, int]]] | None) -> list[list[int]] | None:
    """Per sequence and block of :data:`QUERY_BLOCK` queries (spans from :func:`_block_spans`),
    the first key of the block's span that some query or head of the block does not attend:
    before it the mask changes no score, so it is applied from there on only (a causal
    chunk over a cache: the last ~``QUERY_BLOCK`` keys of each block, instead of all of
    them). ``None`` for other than a boolean mask over the keys."""
    if m is None or blocks is None or m.dtype != np.bool_ or m.shape[-1] == 1:
        return None
    out = []
    for b in range(B):
        mb = m if m.ndim == 2 else m[b if m.shape[0] > 1 else 0]  # [(H or 1,) Lq or 1, Lk]
        every = mb.reshape(-1, *mb.shape[-2:]).all(axis=0)  # attended by every head
        if every.shape[0] == 1:  # one row for every query
            every = np.broadcast_to(every, (Lq, every.shape[-1]))
        row = []
        for (c0, c1), r0 in zip(blocks[b], range(0, Lq, QUERY_BLOCK)):
            left_out = np.flatnonzero(~every[r0:r0 + QUERY_BLOCK, c0:c1].all(axis=0))
            row.append(c0 + int(left_out[0]) if left_out.size else c1)
        out.append(row)
    return out


def _block_mask(m: np.ndarray, b: int, h: int, G: int, r0: int, r1: int) -> np.ndarray:
    """The mask for sequence ``b``, key/value head ``h``'s ``G`` query heads, queries ``r0:r1``:
    broadcastable to ``[G, r1 - r0, Lk]``."""
    if m.ndim == 2:
        return m[r0:r1]
    mb = m[b if m.shape[0] > 1 else 0]  # [H or 1, Lq or 1, Lk]
    if mb.shape[0] > 1:
        mb = mb[h * G:(h + 1) * G]
    return mb[:, r0:r1] if mb.shape[1] > 1 else mb


def _dispatch(original):
    """A ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None)``
    that runs :func:`sdpa` for calls from served modules, else ``original``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if getattr(_MARK, "on", False) and sinks is None:
            bits = getattr(cache, "bits", None)
            if bits is None:
                return sdpa(queries, keys, values, scale, mask)
            if bits in QUANTIZED_BITS:  # a quantized cache: (codes, scales, biases) triples
                return sdpa(queries, keys, values, scale, mask, cache.group_size, bits)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.cpu_attention_original = original
    return scaled_dot_product_attention


def _served(cls: type) -> type:
    """A subclass of attention class ``cls`` whose calls are marked for :func:`sdpa`."""

    def __call__(self, *args, **kwargs):
        before = getattr(_MARK, "on", False)
        _MARK.on = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _MARK.on = before

    return type(f"Cpu{cls.__name__}", (cls,), {"__call__": __call__, "cpu_attention": True})


def serve_attention(model: nn.Module) -> int:
    """Compute ``model``'s attention with :func:`sdpa`; returns how many modules.

    Serves every module whose architecture module (``type(m).__module__``)
    calls mlx-lm's ``scaled_dot_product_attention`` and that has ``q_proj``
    (an attention block); the architecture module's function is replaced once
    by a dispatcher that keeps MLX's path for every call not marked.
    """
    n, made = 0, {}
    for _, m in model.named_modules():
        arch = sys.modules.get(type(m).__module__)
        fn = getattr(arch, "scaled_dot_product_attention", None)
        if fn is None or "q_proj" not in m or getattr(type(m), "cpu_attention", False):
            continue
        if not hasattr(fn, "cpu_attention_original"):
            arch.scaled_dot_product_attention = _dispatch(fn)
        cls = type(m)
        m.__class__ = made.setdefault(cls, _served(cls))
        n += 1
    return n
