"""Warm tier: a bounded pool of expert buffers in host memory, computed in place on the CPU.

For each stacked expert tensor of one MoE layer the pool owns a buffer
``[W, ...]`` of W warm slots in the compute dtype, laid out as the hot tier's
slabs (:mod:`mlx_tier.cache`), so the mlx-lm expert block runs on it unchanged
with warm-slot indices. Which expert is in which slot is
:class:`mlx_tier.tiers.TierIndex`'s business; this module only owns the memory
and the compute.

On a CUDA machine the hot slabs live on the GPU and these buffers are computed
on the CPU: the CPU computes a warm expert where it lies instead of copying it
over PCIe (DESIGN.md, "CUDA tiers"). Either by the CPU expert kernel
(:func:`mlx_tier.cpu_kernel.expert_forward`, eager, within fp32 rounding), or
by mlx-lm's own block on the pool's own CPU stream (``mx.new_stream(mx.cpu)``,
started with ``mx.async_eval``): never the default stream, so the warm work
runs beside the default stream's (the GPU's; here, the CPU backend's other
thread). On the CPU backend both tiers are host memory, which is how the tier
logic is tested here.

Lazy-graph hazard, as for the hot slabs: a warm slot must not be overwritten
before the computation reading it is evaluated; the owner settles first.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from .cache import SlabTensor


class WarmPool:
    """Host-memory slots of one MoE layer.

    Args:
        tensors: name on disk -> the hot tier's SlabTensor (shapes and dtypes).
        num_slots: W >= 0.
        kernel: ``(block, x, slots) -> [..., k, D]`` that computes warm experts
            eagerly (:mod:`mlx_tier.kernels`), or ``None``: mlx-lm's block on
            ``stream``.
        stream: a CPU stream that is not the default one (one per model:
            ``mx.new_stream(mx.cpu)``; ``None``: a new one).

    Attributes:
        arrays: name -> ``[W, ...]`` buffer (lazy zeros until first written).
    """

    def __init__(self, tensors: dict[str, SlabTensor], num_slots: int, kernel=None, stream=None):
        self.tensors = tensors
        self.num_slots = num_slots
        self.kernel = kernel
        self.stream = stream if stream is not None else mx.new_stream(mx.cpu)
        self.arrays = {name: mx.zeros((num_slots, *t.info.shape[1:]), dtype=t.dtype, stream=mx.cpu)
                       for name, t in tensors.items()} if num_slots else {}

    @property
    def slot_nbytes(self) -> int:
        return sum(t.slot_nbytes() for t in self.tensors.values())

    @property
    def resident_bytes(self) -> int:
        """Bytes of the buffers once written (the most the pool holds)."""
        return self.num_slots * self.slot_nbytes

    def compute(self, block: nn.Module, x: mx.array, slots: np.ndarray) -> mx.array:
        """The expert block on warm slots, on the CPU: the CPU kernel (eager),
        or MLX's ops started on :attr:`stream` (``mx.async_eval``).

        Args:
            block: the mlx-lm expert block (``SwitchGLU``/``SwitchMLP``) whose
                leaves normally hold the hot slabs.
            x: ``[n, D]`` rows, one per (token, k) entry computed here.
            slots: ``[n]`` warm slot of each row's expert.

        Returns:
            ``[n, 1, D]``, as the block returns for one expert per row.
        """
        hot = {name: t.module[t.attr] for name, t in self.tensors.items()}
        try:
            for name, t in self.tensors.items():  # the block reads the warm buffers for this call only
                setattr(t.module, t.attr, self.arrays[name])
            with mx.stream(self.stream):  # whatever MLX work either way makes stays off the default stream
                if self.kernel is not None:
                    return self.kernel(block, x, slots.astype(np.int64)[:, None])
                y = block(x, mx.array(slots.astype(np.uint32))[:, None])
            mx.async_eval(y)
            return y
        finally:
            for name, t in self.tensors.items():
                setattr(t.module, t.attr, hot[name])
