"""Metal kernels for tiered expert blocks, with a plain-MLX reference beside each.

Three kernel bodies live in ``mlx_tier/kernels/msl/`` (package ``mlx_tier.kernels.msl``)
and are compiled by ``mx.fast.metal_kernel``, which writes each signature from
the input/output names below:

- ``expert_gate_up.metal``: gather by slot id, dequantise, gate and up matvec,
  SwiGLU -> ``h [T*k, H]`` (or one projection without activation);
- ``expert_down.metal``: gather, dequantise, down matvec -> ``[T, k, D]``, or the
  router-weighted combine -> ``[T, D]``;
- ``slot_remap.metal``: expert id -> slot id through the layer's table, plus
  per-expert use counts, on the device; with kernel ``metal`` every fully
  resident layer remaps through it (:func:`mlx_tier.kernels.registry.remap_for`).

A grid-wide barrier does not exist inside one Metal dispatch, so the fused
expert block is two dispatches with ``h`` (k x H float32 per token) between
them. Dimension legend: T tokens, k experts per token, D model width, H expert
hidden width, S slots, E experts.

Factories return ``None`` without Metal (as mlx-lm's kernel factories do).
Without a Mac the bodies are compiled with g++ through ``tests/metal_shim.h``
and compared with the references here (tests/kernels/test_metal_kernels.py). No
speed-up is claimed: none has been measured on Apple hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files

import mlx.core as mx
from mlx import nn

# Affine widths and groups the kernels handle (every width mlx-tier converts to).
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUPS = (32, 64, 128)
# Below this many (token, expert) pairs the matvec kernels run; above it (a
# prompt) the block's own sorted gather_qmm path does (mlx-lm's sort threshold).
DECODE_MAX_PAIRS = 64
NOT_RESIDENT = 0xFFFFFFFF  # slot id of an expert that has no slot


@dataclass(frozen=True)
class KernelSpec:
    """One kernel body and the names MLX turns into its signature."""

    name: str
    file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


GATE_UP = KernelSpec("mlx_tier_expert_gate_up", "expert_gate_up.metal",
                     ("x", "slots", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b"), ("h",))
DOWN = KernelSpec("mlx_tier_expert_down", "expert_down.metal",
                  ("h", "slots", "scores", "down_w", "down_s", "down_b"), ("y",))
REMAP = KernelSpec("mlx_tier_slot_remap", "slot_remap.metal", ("inds", "lut"), ("slots", "counts"))
SPECS = (GATE_UP, DOWN, REMAP)


def kernel_source(spec: KernelSpec) -> str:
    """The body text of ``spec``, read from the installed package."""
    return files("mlx_tier.kernels.msl").joinpath(spec.file).read_text(encoding="utf-8")


def metal_available() -> bool:
    """True when MLX runs on Apple Metal here (``mx.metal.is_available()``)."""
    return bool(mx.metal.is_available())


@cache
def make_kernel(spec: KernelSpec):
    """``mx.fast.metal_kernel`` for ``spec``, or ``None`` without Metal."""
    if not metal_available():
        return None
    return mx.fast.metal_kernel(name=spec.name, input_names=list(spec.input_names),
                                output_names=list(spec.output_names), source=kernel_source(spec))


@dataclass(frozen=True)
class QuantWeights:
    """Affine-quantised stacked projection: ``w [S, out, in*bits/32]`` uint32,
    ``scales``/``biases`` ``[S, out, in/group_size]``."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @classmethod
    def of(cls, layer: nn.Module) -> QuantWeights | None:
        """From an mlx-lm ``QuantizedSwitchLinear``; ``None`` for any layer the
        kernels do not handle (float weights, mxfp4/nvfp4, a global scale,
        other widths or groups)."""
        if (getattr(layer, "mode", None) != "affine" or getattr(layer, "global_scale", None) is not None
                or layer.get("biases") is None or layer.bits not in SUPPORTED_BITS
                or layer.group_size not in SUPPORTED_GROUPS):
            return None
        return cls(layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)


# A launcher runs one kernel: (spec, inputs, template, grid, threadgroup,
# output shapes, output dtypes) -> outputs. On Metal it is the mx.fast kernel;
# tests pass one that runs the same body compiled with g++.
Launcher = Callable[[KernelSpec, list, list, tuple, tuple, list, list], list]


def metal_launcher(spec: KernelSpec, inputs, template, grid, threadgroup, shapes, dtypes) -> list:
    """Run ``spec`` with ``mx.fast.metal_kernel``.

    Raises:
        RuntimeError: Metal is not available here.
    """
    kernel = make_kernel(spec)
    if kernel is None:
        raise RuntimeError("mlx-tier's Metal kernels need Apple Metal (mx.metal.is_available() is False)")
    return kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                  output_shapes=shapes, output_dtypes=dtypes)


def _threadgroup(rows: int) -> tuple[int, int, int]:
    """32 lanes per row, up to 8 rows (simdgroups) per threadgroup, dividing ``rows``."""
    return (32 * next(n for n in (8, 4, 2, 1) if rows % n == 0), 1, 1)


def gate_up(x: mx.array, slots: mx.array, gate: QuantWeights, up: QuantWeights | None,
            launch: Launcher = metal_launcher) -> mx.array:
    """Kernel ``expert_gate_up``: ``x [T, D]``, ``slots [T, k]`` uint32 ->
    ``[T*k, H]`` float32: ``silu(x Wg^T) * (x Wu^T)`` with ``up``, else ``x Wg^T``."""
    T, K, H = x.shape[0], slots.shape[1], gate.w.shape[1]
    u = up if up is not None else gate
    tmpl = [("BITS", gate.bits), ("GS", gate.group_size), ("GLU", int(up is not None))]
    return launch(GATE_UP, [x, slots, gate.w, gate.scales, gate.biases, u.w, u.scales, u.biases], tmpl,
                  (32 * H, T * K, 1), _threadgroup(H), [(T * K, H)], [mx.float32])[0]


def down(h: mx.array, slots: mx.array, proj: QuantWeights, out_dtype: mx.Dtype, scores: mx.array | None = None,
         launch: Launcher = metal_launcher) -> mx.array:
    """Kernel ``expert_down``: ``h [T*k, H]`` float32, ``slots [T, k]`` ->
    ``[T*k, D]``, or with ``scores [T, k]`` the weighted sum ``[T, D]``."""
    (T, K), D = slots.shape, proj.w.shape[1]
    combine = scores is not None
    sc = scores.astype(mx.float32) if combine else mx.zeros((T, K), mx.float32)
    rows = T if combine else T * K
    tmpl = [("T", out_dtype), ("BITS", proj.bits), ("GS", proj.group_size), ("COMBINE", int(combine))]
    return launch(DOWN, [h, slots, sc, proj.w, proj.scales, proj.biases], tmpl,
                  (32 * D, rows, 1), _threadgroup(D), [(rows, D)], [out_dtype])[0]


def slot_remap(inds: mx.array, lut: mx.array, launch: Launcher = metal_launcher) -> tuple[mx.array, mx.array]:
    """Kernel ``slot_remap``: expert ids ``inds [N]`` and the table ``lut [E]``
    int32 (-1: no slot) -> ``(slots [N] uint32, counts [E] uint32)``; an id
    >= E gets slot :data:`NOT_RESIDENT`. One dispatch, lazy like any MLX op.

    Raises:
        RuntimeError: with the default ``launch``, Metal is not available.
    """
    n, E = inds.shape[0], lut.shape[0]
    width = -(-max(n, E) // 32) * 32
    return launch(REMAP, [inds.astype(mx.uint32), lut.astype(mx.int32)], [], (width, 1, 1), (32, 1, 1),
                  [(n,), (E,)], [mx.uint32, mx.uint32])


# ---- plain-MLX references (the kernels' specification) ----


def _gathered(q: QuantWeights, slots: mx.array) -> tuple[mx.array, mx.array]:
    """Dequantised float32 rows of ``slots [N]`` -> ``([N, out, in], valid [N])``."""
    S = q.w.shape[0]
    valid = slots < S
    s = mx.where(valid, slots, 0).astype(mx.uint32)
    w = mx.dequantize(q.w[s], q.scales[s].astype(mx.float32), q.biases[s].astype(mx.float32),
                      group_size=q.group_size, bits=q.bits)
    return w, valid


def gate_up_reference(x: mx.array, slots: mx.array, gate: QuantWeights, up: QuantWeights | None) -> mx.array:
    """What ``expert_gate_up`` computes, with ``mx.dequantize`` and a matmul."""
    K = slots.shape[1]
    flat = slots.reshape(-1)
    xs = mx.repeat(x.astype(mx.float32), K, axis=0)[:, :, None]  # [T*k, D, 1]
    wg, valid = _gathered(gate, flat)
    g = (wg @ xs).squeeze(-1)  # [T*k, H]
    if up is not None:
        wu, _ = _gathered(up, flat)
        g = nn.silu(g) * (wu @ xs).squeeze(-1)
    return mx.where(valid[:, None], g, 0.0)


def down_reference(h: mx.array, slots: mx.array, proj: QuantWeights, out_dtype: mx.Dtype,
                   scores: mx.array | None = None) -> mx.array:
    """What ``expert_down`` computes: ``[T*k, D]`` or, with ``scores``, ``[T, D]``."""
    T, K = slots.shape
    w, valid = _gathered(proj, slots.reshape(-1))
    y = mx.where(valid[:, None], (w @ h.astype(mx.float32)[:, :, None]).squeeze(-1), 0.0)
    if scores is not None:
        y = (y.reshape(T, K, -1) * scores.astype(mx.float32)[:, :, None]).sum(axis=1)
    return y.astype(out_dtype)


def slot_remap_reference(inds: mx.array, lut: mx.array) -> tuple[mx.array, mx.array]:
    """What ``slot_remap`` computes: ``lut[inds]`` as uint32 and a bincount."""
    E = lut.shape[0]
    slots = lut.astype(mx.int32)[inds.astype(mx.uint32)].astype(mx.uint32)
    counts = (inds.astype(mx.uint32)[:, None] == mx.arange(E, dtype=mx.uint32)[None, :]).sum(axis=0)
    return slots, counts.astype(mx.uint32)


# ---- the expert block ----


@dataclass(frozen=True)
class _Block:
    """An mlx-lm expert block as the kernels see it."""

    first: QuantWeights  # gate_proj (SwitchGLU) or fc1 (SwitchMLP)
    up: QuantWeights | None  # up_proj; None for SwitchMLP
    down: QuantWeights
    fused: bool  # SwiGLU without projection biases: one gate_up dispatch
    layers: tuple  # (first, up, down) modules, for their ``bias`` and activation


def _block(inner: nn.Module) -> _Block | None:
    """The kernels' view of ``inner``, or ``None`` when they do not handle it."""
    from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU, SwitchMLP

    if isinstance(inner, SwitchGLU):
        mods = (inner.gate_proj, inner.up_proj, inner.down_proj)
    elif isinstance(inner, SwitchMLP):
        mods = (inner.fc1, None, inner.fc2)
    else:
        return None
    q = [QuantWeights.of(m) if m is not None else None for m in mods]
    if q[0] is None or q[2] is None or (mods[1] is not None and q[1] is None):
        return None
    biased = any(m is not None and "bias" in m for m in mods)
    fused = mods[1] is not None and type(inner.activation) is SwiGLU and not biased
    return _Block(q[0], q[1], q[2], fused, mods)


def _bias(h: mx.array, layer: nn.Module | None, flat_slots: mx.array) -> mx.array:
    """``h [N, out]`` plus each slot's bias; a slot id >= S adds nothing (as in the kernels)."""
    if layer is None or "bias" not in layer:
        return h
    valid = flat_slots < layer["bias"].shape[0]
    bias = layer["bias"][mx.where(valid, flat_slots, 0)].astype(h.dtype)  # [N, out]
    return h + mx.where(valid[:, None], bias, 0)


def _hidden(inner: nn.Module, b: _Block, x: mx.array, slots: mx.array, launch: Launcher) -> mx.array:
    """``h [T*k, H]`` float32: the activation of the first projection(s)."""
    if b.fused:
        return gate_up(x, slots, b.first, b.up, launch)
    flat = slots.reshape(-1)
    first = _bias(gate_up(x, slots, b.first, None, launch), b.layers[0], flat)
    if b.up is None:  # SwitchMLP: activation(fc1(x))
        return inner.activation(first).astype(mx.float32)
    up = _bias(gate_up(x, slots, b.up, None, launch), b.layers[1], flat)
    return inner.activation(up, first).astype(mx.float32)  # SwitchGLU calls activation(x_up, x_gate)


def metal_expert_forward(inner: nn.Module, x: mx.array, slots: mx.array, launch: Launcher = metal_launcher) -> mx.array:
    """A tiered expert block's output computed by the Metal kernels.

    Args:
        inner: mlx-lm ``SwitchGLU`` or ``SwitchMLP`` whose projections are
            ``QuantizedSwitchLinear`` leaves over the slot slabs (``weight [S, out, in]``
            packed uint32, ``scales``, ``biases``, ``group_size``, ``bits``).
        x: activations ``[..., D]`` (float32, float16 or bfloat16).
        slots: slot ids ``[..., k]`` (any integer dtype; >= S: not resident,
            contributes zeros).
        launch: how a kernel runs (default: ``mx.fast.metal_kernel``).

    Returns:
        ``[..., k, D]`` in ``x``'s dtype, like the mlx-lm block. The kernels
        run for decode-sized calls (fewer than :data:`DECODE_MAX_PAIRS`
        (token, expert) pairs) on affine experts of the supported widths and
        groups; anything else (a prompt, float/mxfp4 experts) runs ``inner``'s
        own MLX path. Numerics: fp32 accumulation in a different order than
        ``gather_qmm``, so equal to it within fp32 rounding, not bit for bit.

    Raises:
        RuntimeError: a kernel is needed and Metal is not available.
    """
    b = _block(inner)
    if b is None or slots.size >= DECODE_MAX_PAIRS:
        return inner(x, slots)
    lead, D, K = x.shape[:-1], x.shape[-1], slots.shape[-1]
    x2, s2 = x.reshape(-1, D), slots.reshape(-1, K).astype(mx.uint32)  # [T, D], [T, k]
    y = down(_hidden(inner, b, x2, s2, launch), s2, b.down, x.dtype, None, launch)  # [T*k, D]
    y = _bias(y, b.layers[2], s2.reshape(-1))
    return y.reshape(*lead, K, D)


def metal_expert_combine(inner: nn.Module, x: mx.array, slots: mx.array, scores: mx.array,
                         launch: Launcher = metal_launcher) -> mx.array:
    """``(metal_expert_forward(...) * scores[..., None]).sum(-2)`` -> ``[..., D]``,
    with the weighted combine inside the down kernel when the down projection
    has no bias (the ``[T, k, D]`` intermediate is then never written).

    Raises:
        RuntimeError: a kernel is needed and Metal is not available.
    """
    b = _block(inner)
    if b is None or slots.size >= DECODE_MAX_PAIRS or "bias" in b.layers[2]:
        y = metal_expert_forward(inner, x, slots, launch)
        return (y * scores[..., None].astype(y.dtype)).sum(axis=-2)
    lead, D, K = x.shape[:-1], x.shape[-1], slots.shape[-1]
    x2, s2 = x.reshape(-1, D), slots.reshape(-1, K).astype(mx.uint32)
    y = down(_hidden(inner, b, x2, s2, launch), s2, b.down, x.dtype, scores.reshape(-1, K), launch)
    return y.reshape(*lead, D)
