"""Warm tier: a bounded pool of expert buffers in host memory, computed in place on the CPU.

For each stacked expert tensor of one MoE layer the pool owns a buffer
``[W, ...]`` of W warm slots in the compute dtype, laid out as the hot tier's
slabs (:mod:`mlx_tier.cache`), so the mlx-lm expert block runs on it unchanged
with warm-slot indices. Which expert is in which slot is
:class:`mlx_tier.tiers.TierIndex`'s business; this module only owns the memory
and the compute.

On a CUDA machine the hot slabs live on the GPU and these buffers are computed
on ``mx.stream(mx.cpu)``: the CPU computes a warm expert where it lies instead
of copying it over PCIe (DESIGN.md, "CUDA tiers"). On the CPU backend both
tiers are host memory, which is how the tier logic is tested here.

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

    Attributes:
        arrays: name -> ``[W, ...]`` buffer (lazy zeros until first written).
    """

    def __init__(self, tensors: dict[str, SlabTensor], num_slots: int):
        self.tensors = tensors
        self.num_slots = num_slots
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
        """The expert block on warm slots, on the CPU stream.

        This is the one place the warm tier computes: the CPU expert kernel
        (the own-kernels issue) is meant to replace the body of this function.

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
            with mx.stream(mx.cpu):
                return block(x, mx.array(slots.astype(np.uint32))[:, None])
        finally:
            for name, t in self.tensors.items():
                setattr(t.module, t.attr, hot[name])
