"""Which code computes a tiered block's experts: MLX's ops, the CPU kernel, or Metal kernels.

A kernel is a callable ``(inner, x, slots) -> [..., k, D]`` with ``inner``
the wrapped mlx-lm ``SwitchGLU``/``SwitchMLP`` whose leaves hold the slot
slabs, ``x`` ``[..., D]`` and ``slots`` ``[..., k]`` slot ids.

- ``mlx``: the block itself (``gather_qmm``/``gather_mm``), lazy; greedy
  tokens equal mlx-lm's exactly (docs/architecture.md, invariant 1).
- ``cpu``: :func:`mlx_tier.kernels.cpu.expert_forward`, eager, within fp32
  rounding of the MLX path.
- ``metal``: ``mlx_tier.kernels.metal.metal_expert_forward`` (needs Metal).
- ``auto``: ``cpu`` on MLX's CPU backend, ``mlx`` elsewhere (the Metal
  kernels are not yet measured on a Mac); for the two-tier cache's warm
  tier, ``cpu`` on every backend (:func:`choose`).

A fully resident layer maps expert ids to slot ids lazily on the device. Its
remap (:func:`remap_for`) is ``None`` (an MLX take ``lut[ids]``; the router
outputs are kept and counted on the host later) except with ``metal``, where
the ``slot_remap`` kernel also counts each expert's uses on the device, so the
layer keeps only ``[E]`` counts.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx import nn

from mlx_tier.kernels import KERNELS

Kernel = Callable[[nn.Module, mx.array, mx.array], mx.array]
# (expert ids [N] uint32, lut [E] slot of each expert) -> (slots [N] uint32,
# uses [E] uint32): mlx_tier.kernels.metal.slot_remap's contract.
Remap = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]


def resolve(name: str) -> str:
    """``name`` with ``auto`` replaced by the kernel for the default device.

    Raises:
        ValueError: an unknown name.
    """
    if name not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {name!r}")
    if name == "auto":
        return "cpu" if mx.default_device() == mx.cpu else "mlx"
    return name


def _mlx(inner: nn.Module, x: mx.array, slots: mx.array) -> mx.array:
    return inner(x, slots)


def kernel_for(name: str) -> Kernel:
    """The expert kernel called ``name`` (one of :data:`KERNELS`).

    Raises:
        ValueError: an unknown name, or ``metal`` where Metal (or the Metal
            kernel module) is not available.
    """
    name = resolve(name)
    if name == "mlx":
        return _mlx
    if name == "cpu":
        from mlx_tier.kernels.cpu import expert_forward

        return expert_forward
    if not mx.metal.is_available():
        raise ValueError("kernel 'metal' needs Apple Metal, which this machine's MLX does not have")
    try:
        from mlx_tier.kernels.metal import metal_expert_forward
    except ImportError as e:
        raise ValueError(f"kernel 'metal' is not available in this build of mlx-tier: {e}") from None
    return metal_expert_forward


def remap_for(name: str, launch=None) -> Remap | None:
    """The device-side remap of fully resident layers for kernel ``name``:
    ``metal`` gives :func:`mlx_tier.kernels.metal.slot_remap` (slots and
    per-expert use counts in one dispatch); the others ``None`` (the layer's
    MLX take, router outputs counted on the host later).

    Args:
        name: one of :data:`KERNELS` (``auto`` resolved for the default device).
        launch: how the Metal kernel runs (a
            :data:`mlx_tier.kernels.metal.Launcher`); ``None``: on Metal
            (``mx.fast.metal_kernel``, which raises RuntimeError without Metal).
            Tests pass the harness that runs the same body compiled with g++.

    Raises:
        ValueError: an unknown name.
    """
    if resolve(name) != "metal":
        return None
    from mlx_tier.kernels import metal as metal_kernels

    launch = launch or metal_kernels.metal_launcher
    return lambda inds, lut: metal_kernels.slot_remap(inds, lut, launch)


def choose(name: str, blocks: list[nn.Module], host_tier: bool = False) -> str:
    """The kernel a tiered model will use: ``name`` resolved for the device and
    checked against the model. ``auto`` falls back to ``mlx`` where the CPU
    kernel cannot serve (an expert format it lacks); an explicit ``cpu`` there
    is refused.

    With the two-tier cache (the CUDA path) the name is the *warm* tier's
    kernel: its experts are computed on the CPU where they lie, so ``auto``
    means the CPU kernel on every backend where it can serve them (else MLX's
    ops on a CPU stream); the hot tier always runs MLX's ops (the GPU).

    Args:
        blocks: the model's mlx-lm expert blocks.
        host_tier: the two-tier (CUDA path) cache is used.

    Raises:
        ValueError: an unknown name.
        CheckpointError: ``cpu`` asked for experts it cannot compute.
        ConfigError: ``metal`` asked together with a host tier.
    """
    from mlx_tier.errors import CheckpointError, ConfigError

    if host_tier and name == "metal":
        raise ConfigError("kernel 'metal' does not serve the two-tier (host_cache_gb) cache, whose warm tier "
                          "computes on the CPU; use kernel 'cpu' or 'mlx'", field="kernel")
    chosen = "cpu" if host_tier and name == "auto" else resolve(name)
    if chosen != "cpu":
        return chosen
    from mlx_tier.kernels.cpu import unsupported

    why = next((w for w in map(unsupported, blocks) if w is not None), None)
    if why is not None and name == "cpu":
        raise CheckpointError(f"kernel 'cpu' cannot compute these experts ({why}); use kernel 'mlx'", field="kernel")
    return "mlx" if why is not None else "cpu"
