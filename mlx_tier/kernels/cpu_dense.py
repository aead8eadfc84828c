"""Dense layers on the CPU kernel: a model's quantized and float linear layers
computed where they lie in host memory, for MLX's CPU backend.

MLX's CPU backend runs its matmuls on the reference BLAS of the Linux wheel
(~1 GFLOP/s for a float32 ``[256, 2048] x [2048, 128]`` router on a 2-core
Zen 4, against ~50 for numpy's optimized BLAS on one core). A dense quantized
layer is one always-resident expert (:class:`mlx_tier.kernels.cpu._Quant`:
the fused matvec for few rows, tiles dequantised once and multiplied with
BLAS for many); a float32 ``nn.Linear`` (an MoE router gate left
unquantized, a shared expert's gate) is one numpy matmul. Results agree with
MLX's to float32 rounding (the summation order differs), as the expert
kernel's do.

:func:`serve_dense` swaps the classes of a model's layers in place; the
output layer keeps MLX's lazy op for a prompt's positions, whose logits
mlx-lm never evaluates.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.kernels.cpu import (
    _BLAS,
    GEMM_MIN_ROWS,
    MODES,
    _host,
    _parallel,
    _Quant,
    _slow_rows,
)

# Most dequantised float32 weight bytes one thread holds at once in a dense layer's
# GEMM (quantized_matmul): an output layer is done in tiles of rows, never whole.
# Whole, a 49k x 2048 output layer took 0.4 GB per decode step of 8 sequences
# (151k x 2048: 1.2 GB), enough to push a run under a memory limit over it
# (benches/workspace.py, benches/results/memory/NOTES.md).
DENSE_TILE_BYTES = 8 << 20


def quantized_matmul(layer: nn.Module, x: mx.array) -> mx.array:
    """``x @ W.T`` for a dense quantized layer (``nn.QuantizedLinear`` weight layout).

    Args:
        layer: holds ``weight`` ``[O, I*bits/32]`` uint32, ``scales``/``biases`` ``[O, G]``.
        x: ``[..., I]``.

    Returns:
        ``[..., O]`` in ``x.dtype``, evaluated; no layer ``bias`` added.
    """
    T = math.prod(x.shape[:-1])
    if T < GEMM_MIN_ROWS and _slow_rows(layer):  # MLX's op is faster for these rows
        y = mx.quantized_matmul(x, layer["weight"], layer["scales"], layer.get("biases"), transpose=True,
                                group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        mx.eval(y)
        return y
    quant = _Quant(layer, stacked=False)
    xs = _host(x).reshape(-1, x.shape[-1])  # [T, I]; a numpy reshape: no MLX op to evaluate
    if T >= quant.gemm_min_rows:  # output rows shared among the threads, BLAS single-threaded (_gemm_slots)
        y = np.empty((T, quant.out_dims), np.float32)

        tile = max(1, DENSE_TILE_BYTES // (4 * quant.in_dims))  # output rows per dequantised tile

        def work(o0, o1):
            for a in range(o0, o1, tile):
                b = min(o1, a + tile)
                y[:, a:b] = xs @ quant.dense(0, a, b).T

        with _BLAS.limit(limits=1, user_api="blas"):
            _parallel(work, quant.out_dims, grain=256)
    else:
        y = quant.matvec(xs, np.arange(T), np.zeros(T, np.int64))
    y = mx.array(y).reshape(*x.shape[:-1], quant.out_dims)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)


class CpuQuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` computed by :func:`quantized_matmul` (same parameters)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(self, x)
        return y + self["bias"] if "bias" in self else y


def float_matmul(layer: nn.Linear, x: mx.array) -> mx.array:
    """``x @ W.T`` for a float32 ``nn.Linear`` weight ``[O, I]`` on numpy's BLAS (one thread).

    Args:
        layer: holds ``weight`` ``[O, I]`` float32.
        x: ``[..., I]`` float32.

    Returns:
        ``[..., O]`` float32, evaluated; no layer ``bias`` added.
    """
    xs = _host(x).reshape(-1, x.shape[-1])  # [T, I]; evaluates x
    with _BLAS.limit(limits=1, user_api="blas"):
        y = xs @ _host(layer["weight"]).T
    return mx.array(y).reshape(*x.shape[:-1], y.shape[-1])


class CpuLinear(nn.Linear):
    """``nn.Linear`` computed by :func:`float_matmul` when its weight and input are
    float32; other dtypes (numpy has no bfloat16) keep MLX's op."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32 or self["weight"].dtype != mx.float32:
            return super().__call__(x)
        y = float_matmul(self, x)
        return y + self["bias"] if "bias" in self else y


def _prompt_positions(x: mx.array) -> bool:
    """``x`` ``[B, L, D]`` holds several positions of each sequence (a prompt being read)."""
    return x.ndim >= 3 and x.shape[-2] > 1


class CpuOutputLinear(CpuQuantizedLinear):
    """A model's own quantized output layer (``lm_head``): one position per sequence
    (decode) through :func:`quantized_matmul`; several positions (a prompt) through
    MLX's op, lazily. mlx-lm reads a prompt in steps whose logits it never evaluates
    (``generate_step``'s prefill, the batch generator's), so a lazy op is skipped,
    where the eager kernel computed all of them: for the demo's 49k-row output
    layer, 128 prompt positions cost ~0.6 s. When those logits are evaluated
    (speculative decoding, scoring a text), they are MLX's own."""

    def __call__(self, x: mx.array) -> mx.array:
        if _prompt_positions(x):
            return nn.QuantizedLinear.__call__(self, x)
        return super().__call__(x)


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output layer) is
    :func:`quantized_matmul` for one position per sequence, MLX's lazy op for
    several (the rule and its reason: :class:`CpuOutputLinear`)."""

    def as_linear(self, x: mx.array) -> mx.array:
        if _prompt_positions(x):
            return super().as_linear(x)
        return quantized_matmul(self, x)


class CpuFloatOutputLinear(CpuLinear):
    """A float output layer (``lm_head``): one position per sequence through
    :func:`float_matmul`, a prompt's positions through MLX's lazy op (the rule and
    its reason: :class:`CpuOutputLinear`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if _prompt_positions(x):
            return nn.Linear.__call__(self, x)
        return super().__call__(x)


class CpuEmbedding(nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (a tied output layer) is :func:`float_matmul`
    for one float32 position per sequence, MLX's lazy op otherwise."""

    def as_linear(self, x: mx.array) -> mx.array:
        if _prompt_positions(x) or x.dtype != mx.float32 or self["weight"].dtype != mx.float32:
            return super().as_linear(x)
        return float_matmul(self, x)


# Served class of each exact layer class: (any layer, a module named lm_head).
_DENSE = {
    nn.QuantizedLinear: (CpuQuantizedLinear, CpuOutputLinear),
    nn.QuantizedEmbedding: (CpuQuantizedEmbedding, CpuQuantizedEmbedding),
    nn.Linear: (CpuLinear, CpuFloatOutputLinear),
    nn.Embedding: (CpuEmbedding, CpuEmbedding),
}


def serve_dense(model: nn.Module, float_layers: bool = True) -> int:
    """Serve ``model``'s dense layers through the CPU kernel; returns how many.

    Each exact ``nn.QuantizedLinear``/``nn.QuantizedEmbedding`` of a supported
    mode (affine, mxfp4) and each ``nn.Linear``/``nn.Embedding`` gets a subclass
    above as its class: parameters, names and ``parameters()`` stay as they
    were, only the matmul changes (a dense quantized layer is one
    always-resident expert; a float layer is numpy's matmul, float32 only;
    ``float_layers`` false leaves float layers to MLX: where MLX computes on a
    GPU). The output layer (a module named ``lm_head``, or a tied embedding's
    ``as_linear``) leaves prompt positions to MLX, lazily
    (:class:`CpuOutputLinear`). Subclasses of those layers (model-specific
    variants) are left alone.
    """
    n = 0
    for name, m in model.named_modules():
        served = _DENSE.get(type(m))
        if not float_layers and type(m) in (nn.Linear, nn.Embedding):
            continue
        if served is None or (isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                              and (m.mode not in MODES or m.get("global_scale") is not None)):
            continue
        m.__class__ = served[name.rsplit(".", 1)[-1] == "lm_head"]  # same instance dict: only the matmul changes
        n += 1
    return n
