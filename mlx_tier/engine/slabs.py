"""What a slab holds: one stacked expert tensor of a layer, its dtype casts, and
the zero-row stand-ins that show a tiered block's experts as its parameters.

Also the two conversions of raw expert rows read from disk: to an MLX array
through the model's casts (:func:`to_mx`), and the same casts made in numpy
where numpy makes them as MLX does (:func:`host_cast`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.engine.checkpoint import TensorInfo
from mlx_tier.engine.dtypes import Casts, apply_casts, then


@dataclass(frozen=True)
class SlabTensor:
    """One stacked expert tensor of one layer and where its slab lives.

    Attributes:
        module: the mlx-lm (Quantized)SwitchLinear that reads the slab.
        attr: its attribute name (``"weight"``, ``"scales"``, ``"biases"``, ``"bias"``).
        info: the stacked tensor on disk, shape ``[E, ...]``.
        casts: the casts an expert goes through after it is read, in order
            (:mod:`mlx_tier.engine.dtypes`); ``()``: kept as stored.
    """

    module: nn.Module
    attr: str
    info: TensorInfo
    casts: Casts = ()

    @property
    def dtype(self) -> mx.Dtype:
        """The slab's dtype: the last cast's, else as stored."""
        return self.casts[-1] if self.casts else self.info.mx_dtype

    def slot_nbytes(self, dtype: mx.Dtype | None = None) -> int:
        """Bytes of one slot, in ``dtype`` (``None``: the slab's)."""
        return int(np.prod(self.info.shape[1:])) * (dtype or self.dtype).size

    def cast_to(self, dtype: mx.Dtype) -> SlabTensor:
        """This tensor after one more cast, to ``dtype``."""
        return replace(self, casts=then(self.casts, dtype))

    def __deepcopy__(self, memo) -> SlabTensor:
        # Dtypes cannot be copied (MLX does not pickle them); they are immutable anyway.
        return replace(self, module=copy.deepcopy(self.module, memo))


class StandIns:
    """A tiered expert block's experts shown as its parameters.

    For each stacked expert tensor the block holds, at the path the resident
    mlx-lm block has it (``gate_proj.scales`` under the block), a zero-row
    array ``[0, ...]`` in the slab's dtype. Whatever is done to a model's
    parameters -- ``set_dtype``, ``update`` with ``astype`` (as mlx-lm's own
    model tests do), ``apply``, :func:`mlx_tier.engine.dtypes.cast_model` -- reaches
    them, with mlx-lm's paths for ``cast_predicate``; before each call the
    block casts its slabs to their dtypes (:meth:`changed`,
    :meth:`mlx_tier.engine.cache.LayerCache.cast`). Zero rows: ``parameters()`` counts no expert
    bytes, and weights saved from a tiered model (no experts) cannot load as a
    checkpoint. Only the dtype is followed, not the values or shape.

    Args:
        keys: name on disk -> the keys leading to its stand-in in the block.
    """

    def __init__(self, keys: dict[str, tuple[str, ...]]):
        self.keys = keys

    @classmethod
    def show(cls, block: nn.Module, path: str, tensors: dict[str, SlabTensor]) -> StandIns:
        """Put a stand-in for each of ``tensors`` (name on disk -> SlabTensor, the
        experts of the block at parameter path ``path``) into ``block``."""
        keys = {}
        for name, t in tensors.items():
            *parents, leaf = keys[name] = tuple(name.removeprefix(path + ".").split("."))
            node = block
            for k in parents:
                node = node.setdefault(k, {})
            node[leaf] = mx.zeros((0, *t.info.shape[1:]), dtype=t.dtype)
        return cls(keys)

    def changed(self, block: nn.Module, tensors: dict[str, SlabTensor]) -> dict[str, mx.Dtype]:
        """name -> its stand-in's dtype, for each of ``tensors`` whose slab's dtype differs."""
        out = {}
        for name, keys in self.keys.items():
            node = block
            for k in keys:
                node = node[k]
            if node.dtype != tensors[name].dtype:
                out[name] = node.dtype
        return out


def to_mx(buf: np.ndarray, info: TensorInfo, casts: Casts) -> mx.array:
    """Raw bytes of ``info``'s experts (numpy, bfloat16 as uint16) through ``casts``."""
    a = mx.array(buf)
    if info.dtype == "BF16":
        a = a.view(mx.bfloat16)
    return apply_casts(a, casts)


def host_cast(info: TensorInfo, casts: Casts):
    """A numpy function taking raw rows of ``info`` (bfloat16 as uint16) to the slab's
    dtype exactly as ``casts`` do in MLX, or ``None`` where only MLX casts them alike.
    Kept as stored, or widened once to float32: bfloat16's 16 bits are float32's top
    half, float16 -> float32 is exact."""
    chain, cur = [], info.mx_dtype
    for d in casts:  # the casts apply_casts makes (one to the current dtype is none)
        if d != cur:
            chain.append(cur := d)
    if not chain:
        return None if info.dtype == "BF16" else (lambda rows: rows)
    if chain != [mx.float32] or info.dtype not in ("BF16", "F16"):
        return None
    if info.dtype == "BF16":
        return lambda rows: (rows.astype(np.uint32) << 16).view(np.float32)
    return lambda rows: rows.astype(np.float32)


def slab_role(name: str) -> str:
    """A stacked expert tensor's role in its block, the same in every layer: the last two
    parts of its name on disk (``...switch_mlp.gate_proj.weight`` -> ``gate_proj.weight``)."""
    return ".".join(name.split(".")[-2:])
