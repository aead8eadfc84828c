"""Warm tier: a bounded pool of expert buffers in host memory, computed in place on the CPU.

For each stacked expert tensor of one MoE layer the pool owns a buffer
``[W, ...]`` of W warm slots in the compute dtype, laid out as the hot tier's
slabs (:mod:`mlx_tier.engine.cache`), so the mlx-lm expert block runs on it unchanged
with warm-slot indices. Which expert is in which slot is
:class:`mlx_tier.policy.placement.TierIndex`'s business; this module only owns the memory
and the compute.

On a CUDA machine the hot slabs live on the GPU and these buffers are computed
on the CPU: the CPU computes a warm expert where it lies instead of copying it
over PCIe (docs/architecture.md, "CUDA tiers"). Either by the CPU expert kernel
(:func:`mlx_tier.kernels.cpu.expert_forward`, eager, within fp32 rounding), or
by mlx-lm's own block on the pool's own CPU stream (``mx.new_stream(mx.cpu)``,
started with ``mx.async_eval``): never the default stream, so the warm work
runs beside the default stream's (the GPU's; here, the CPU backend's other
thread). On the CPU backend both tiers are host memory, which is how the tier
logic is tested here.

Dtypes: with the CPU kernel the pool keeps its floating tensors (scales,
biases, unquantized weights) in float32, converted once as an expert enters
the pool, because the kernel computes in float32 and numpy has no bfloat16:
a pool in the checkpoint's bf16/fp16 (the GPU's dtype) would be converted on
every call (:func:`pool_dtype`). The pool's bytes and the warm budget count
the float32 copies. With MLX's ops the pool keeps the hot slabs' dtypes.

Placement on CUDA: every write to a pool runs on the pool's CPU stream, so its
buffers stay host memory. Since MLX 0.29.4 (PR #2725) GPU ops get device
memory, and a buffer is copied into managed (or pinned host) memory the first
time the CPU reads it: a pool written by a GPU op would become device memory
and be copied back, whole, at the next CPU read.

Lazy-graph hazard, as for the hot slabs: a warm slot must not be overwritten
before the computation reading it is evaluated; the owner settles first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.engine.slabs import SlabTensor


def pool_dtype(dtype: mx.Dtype, host_kernel: bool) -> mx.Dtype:
    """The dtype a warm pool keeps a tensor in whose hot slab is ``dtype``:
    float32 for a floating tensor when the CPU kernel (``host_kernel``) computes
    the pool, else ``dtype``."""
    return mx.float32 if host_kernel and mx.issubdtype(dtype, mx.floating) else dtype


def warm_slot_nbytes(tensors: Iterable[tuple[int, mx.Dtype]], host_kernel: bool) -> int:
    """Bytes of one warm slot: ``tensors`` are ``(elements of one expert, hot slab
    dtype)`` pairs, each kept in :func:`pool_dtype`'s dtype. The one rule for a
    run's pools (:func:`pool_slot_nbytes`) and the plan's warm expert
    (:func:`mlx_tier.tools.plan.make_plan`)."""
    return sum(int(n) * pool_dtype(dtype, host_kernel).size for n, dtype in tensors)


def pool_slot_nbytes(tensors: dict[str, SlabTensor], host_kernel: bool, dtypes: dict | None = None) -> int:
    """Bytes of one warm slot of a layer's ``tensors`` (:func:`warm_slot_nbytes`),
    the hot slabs in their dtypes or, for those named in ``dtypes``, in those."""
    dtypes = dtypes or {}
    return warm_slot_nbytes(((np.prod(t.info.shape[1:]), dtypes.get(name, t.dtype)) for name, t in tensors.items()),
                            host_kernel)


class WarmPool:
    """Host-memory slots of one MoE layer.

    Args:
        tensors: name on disk -> the hot tier's SlabTensor (shapes and dtypes).
        num_slots: W >= 0.
        kernel: the CPU kernel, ``(block, x, slots) -> [..., k, D]``, which
            computes warm experts eagerly in float32 (:mod:`mlx_tier.kernels.registry`;
            the pool's floating tensors are then float32), or ``None``:
            mlx-lm's block on ``stream``, in the hot slabs' dtypes.
        stream: a CPU stream that is not the default one (one per model:
            ``mx.new_stream(mx.cpu)``; ``None``: a new one).

    Attributes:
        arrays: name -> ``[W, ...]`` buffer in ``dtypes[name]`` (lazy zeros
            until first written).
        dtypes: name -> the buffer's dtype (:func:`pool_dtype`).
    """

    def __init__(self, tensors: dict[str, SlabTensor], num_slots: int, kernel=None, stream=None):
        self.tensors = tensors
        self.num_slots = num_slots
        self.kernel = kernel
        self.stream = stream if stream is not None else mx.new_stream(mx.cpu)
        self.dtypes = {name: pool_dtype(t.dtype, kernel is not None) for name, t in tensors.items()}
        self.arrays = {name: mx.zeros((num_slots, *t.info.shape[1:]), dtype=self.dtypes[name], stream=self.stream)
                       for name, t in tensors.items()} if num_slots else {}

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot, every tensor in the pool's dtype."""
        return pool_slot_nbytes(self.tensors, self.kernel is not None)

    @property
    def resident_bytes(self) -> int:
        """Bytes of the buffers once written (the most the pool holds)."""
        return self.num_slots * self.slot_nbytes

    def slot_nbytes_as(self, dtypes: dict[str, mx.Dtype]) -> int:
        """Bytes of one slot once the hot slabs named in ``dtypes`` are cast to those."""
        return pool_slot_nbytes(self.tensors, self.kernel is not None, dtypes)

    def cast(self, dtypes: dict[str, mx.Dtype]) -> None:
        """Cast the buffers of the tensors named in ``dtypes`` as their hot slabs were
        (name -> the slab's new dtype): a float32 pool of the CPU kernel keeps float32,
        its values rounded through the new dtype. The owner settles first."""
        for name, dtype in dtypes.items():
            self.dtypes[name] = pool_dtype(dtype, self.kernel is not None)
            if name in self.arrays:
                with mx.stream(self.stream):
                    self.arrays[name] = self.arrays[name].astype(dtype).astype(self.dtypes[name])
        mx.eval(list(self.arrays.values()))

    def __deepcopy__(self, memo) -> WarmPool:
        """A copy with its own buffers on the same CPU stream (streams are not copied)."""
        new = copy.copy(self)
        memo[id(self)] = new
        new.tensors = copy.deepcopy(self.tensors, memo)
        new.arrays = copy.deepcopy(self.arrays, memo)
        new.dtypes = dict(self.dtypes)  # dtypes are immutable and cannot be copied
        return new

    def rows(self, x: mx.array, rows: np.ndarray) -> mx.array:
        """``x`` ``[..., D]``'s rows ``rows`` ``[n]`` (of ``x`` as ``[T, D]``), gathered on
        :attr:`stream` and evaluated now: ``[n, D]`` in host memory, the input of
        :meth:`compute`.

        Called before the layer's hot share is started: on CUDA the CPU's first
        read of a GPU-made buffer moves it into host-readable memory with a
        synchronous copy, which in MLX 0.29.4-0.30.4 also frees the old buffer
        with ``cudaFree`` and so waits for the whole device (``copy_to_managed``,
        MLX PR #2725); done while the hot share runs, it would wait for it.
        """
        D = x.shape[-1]
        xs = mx.take(x.reshape(-1, D, stream=self.stream), mx.array(rows), axis=0, stream=self.stream)
        mx.eval(xs)
        return xs

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
