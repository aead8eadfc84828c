"""Compute dtypes: the ones mlx-lm would use, and the casts it makes.

``mlx_lm.load`` casts nothing: every tensor computes in the dtype the
checkpoint stores it in (a bf16 checkpoint computes in bf16, float32 scales
stay float32). A tiered model does the same by default, so its greedy tokens
equal ``mlx_lm.load``'s.

A cast is mlx-lm's own rule, as ``mlx_lm.convert --dtype`` applies it: every
floating parameter whose path the model's ``cast_predicate`` accepts (models
keep some in float32 on purpose: ``A_log``, ``dt_bias``,
``e_score_correction_bias``, attention ``sinks``...), integers (packed
weights) never. :func:`cast_model` is that rule; a tiered model loaded with
``TierConfig(dtype=d)`` equals mlx-lm's model put through ``cast_model(model, d)``.

On MLX's CPU backend bf16/fp16 matmuls are far slower than float32
(benches/results/cpu-dtype/NOTES.md), so the job runner and the CPU expert
kernel compute in float32 there (:func:`job_compute_dtype`,
:func:`compute_dtype`).

A tensor's *casts* are the dtypes it went through after being read, in
order: an expert read later from the SSD goes through the same ones as the
experts already resident (a resident mlx-lm model cast to bf16, then to
float16, holds ``f16(bf16(x))``, not ``f16(x)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_map_with_path

from mlx_tier.defaults import JOB_CPU_DTYPE

Casts = tuple[mx.Dtype, ...]


def cast_predicate(model: nn.Module) -> Callable[[str], bool]:
    """The model's rule for which parameter paths a cast may change (mlx-lm's
    ``Model.cast_predicate``; every path when the model has none)."""
    return getattr(model, "cast_predicate", lambda _: True)


def cast_model(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast ``model``'s parameters as ``mlx_lm.convert --dtype`` does, in place:
    floating ones whose path :func:`cast_predicate` accepts; the rest as they are.

    On a tiered model this reaches the expert slabs too (through the stand-ins of
    :class:`mlx_tier.engine.load.TieredExperts`), so a tiered model and mlx-lm's
    resident one cast alike stay equal.
    """
    keep = cast_predicate(model)

    def cast(path: str, a: mx.array) -> mx.array:
        return a.astype(dtype) if keep(path) and mx.issubdtype(a.dtype, mx.floating) else a

    model.update(tree_map_with_path(cast, model.parameters()))


def then(casts: Casts, dtype: mx.Dtype) -> Casts:
    """``casts`` followed by a cast to ``dtype`` (a repeat of the last one is no cast)."""
    return casts if casts and casts[-1] == dtype else (*casts, dtype)


def apply_casts(a: mx.array, casts: Casts) -> mx.array:
    """``a`` through each cast of ``casts`` in order (lazy); a cast to its own dtype is skipped."""
    for d in casts:
        if a.dtype != d:
            a = a.astype(d)
    return a


@functools.cache
def gather_mm_computes(dtype: mx.Dtype) -> bool:
    """Whether MLX's ``gather_mm`` (unquantized experts) computes ``dtype`` on the
    default device. MLX 0.32's CPU backend computes float32 only ("[GatherMM::eval]
    Currently only supports float32."), so mlx-lm cannot run bf16/fp16 unquantized
    experts there."""
    try:
        mx.eval(mx.gather_mm(mx.ones((1, 1, 2), dtype), mx.ones((1, 2, 2), dtype), rhs_indices=mx.array([0])))
        return True
    except RuntimeError:
        return False


def job_compute_dtype() -> mx.Dtype | None:
    """The job runner's compute dtype when none is set: float32 on MLX's CPU
    backend (:data:`mlx_tier.defaults.JOB_CPU_DTYPE`, for speed), ``None`` (the
    checkpoint's own dtypes) on a GPU."""
    return getattr(mx, JOB_CPU_DTYPE) if mx.default_device() == mx.cpu else None


def compute_dtype(dtype: mx.Dtype | None, kernel: str, two_tiers: bool) -> mx.Dtype | None:
    """The dtype a model is cast to at load (``None``: no cast).

    Args:
        dtype: ``TierConfig.dtype``; given, it decides.
        kernel: the kernel chosen (:func:`mlx_tier.kernels.registry.choose`).
            The CPU expert kernel computes in float32, so on MLX's CPU backend,
            with one tier and ``kernel == "cpu"``, the whole model computes in
            float32 (the kernel's claim is stated against the MLX path in
            float32: docs/kernels.md). With two tiers it is the warm tier's
            kernel, which keeps float32 copies of its own
            (:func:`mlx_tier.engine.warm_pool.pool_dtype`).
        two_tiers: the two-tier (CUDA path) cache is used.
    """
    if dtype is not None:
        return dtype
    cpu_kernel_on_cpu = kernel == "cpu" and not two_tiers and mx.default_device() == mx.cpu
    return mx.float32 if cpu_kernel_on_cpu else None
