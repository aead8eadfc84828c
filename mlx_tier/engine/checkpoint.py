"""A checkpoint folder as a download leaves it: which file holds each tensor,
the model built lazily by mlx-lm, its expert blocks and their tensors.

The one place that opens a checkpoint (``tiered``, ``plan``, ``profile`` and
``convert`` all come here). Nothing in it reads a weight: sizes and offsets
come from the safetensors headers (8-byte little-endian length, then a JSON
header with ``dtype``, ``shape`` and ``data_offsets``), and the model graph is
built with ``mlx_lm.utils.load_model(lazy=True)``.

Which file holds a tensor (as Hugging Face loaders decide it): when
``model.safetensors.index.json`` exists, its ``weight_map``; else the one
``*.safetensors`` file whose header names it (a tensor in two files is
refused). mlx-lm's own loader merges every ``model*.safetensors`` in the
folder, so when that set differs from the resolved files (a stale
``model.safetensors`` beside complete shards) mlx-lm is given a view of the
folder holding only the resolved files.

Every fault of a folder is a :class:`CheckpointError` with one line naming
the file: a shard the index names but the folder lacks, a truncated shard, a
corrupt header, offsets past the end of the file, no weights, a dense model,
an unknown or mismatched ``model_type``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from mlx_lm.utils import load_model

from mlx_tier.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")

EXPERT_BLOCKS = (SwitchGLU, SwitchMLP)
# MoE architectures in mlx-lm whose experts do not run through switch_layers,
# and why they cannot be tiered (yet).
REFUSED = {
    "dbrx": "its experts are a model-specific module in mlx_lm/models/dbrx.py (not switch_layers), "
    "computed with per-expert matmuls that a slot cache cannot serve",
}

# safetensors dtype -> numpy dtype used to hold the raw bytes. bfloat16 has no
# numpy dtype: it travels as uint16 and is reinterpreted by the caller.
_NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk.

    Attributes:
        file: shard path.
        dtype: safetensors dtype string (``"U32"``, ``"BF16"``, ...).
        shape: full tensor shape.
        start: absolute byte offset of the first element in ``file``.
        nbytes: size of the whole tensor in bytes.
    """

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(_NP_DTYPES[self.dtype])

    @property
    def mx_dtype(self) -> mx.Dtype:
        """The MLX dtype it is stored in (``BF16`` -> ``mx.bfloat16``)."""
        special = {"BF16": mx.bfloat16, "BOOL": mx.bool_}
        return special.get(self.dtype) or getattr(mx, self.np_dtype.name)

    def expert_nbytes(self) -> int:
        """Bytes of one slice along axis 0 (one expert of a stacked tensor)."""
        return self.nbytes // self.shape[0]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors file header.

    Returns:
        tensor name -> TensorInfo (``__metadata__`` dropped).

    Raises:
        CheckpointError: the file is unreadable or too short, its header is
            not valid JSON, or a tensor lies outside the file (truncated).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise CheckpointError(f"{path}: header runs past the end of the file (truncated download?)")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: bad safetensors header ({e})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: bad safetensors header (not an object)")
    return {name: _tensor_info(path, name, meta, 8 + n, size) for name, meta in header.items() if name != "__metadata__"}


def _tensor_info(path: Path, name: str, meta, base: int, size: int) -> TensorInfo:
    try:
        begin, end = meta["data_offsets"]
        dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: bad safetensors header entry for {name!r}") from None
    if dtype not in _NP_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, which mlx-tier cannot read")
    if not (isinstance(begin, int) and isinstance(end, int)) or not 0 <= begin <= end or base + end > size:
        raise CheckpointError(f"{path}: tensor {name!r} lies outside the file (truncated download?)")
    return TensorInfo(path, dtype, shape, base + begin, end - begin)


def _read_index(model_dir: Path) -> dict[str, str]:
    """``weight_map`` of the folder's index file: tensor name -> file name."""
    path = model_dir / INDEX_FILE
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: weight_map is not a mapping of tensor names to file names")
    outside = next((v for v in weight_map.values() if v in ("", ".", "..") or Path(v).name != v), None)
    if outside is not None:
        raise CheckpointError(f"{path}: names {outside!r}, which is not a file in the checkpoint folder")
    return weight_map


_SHARD = re.compile(r"^(?P<stem>.+)-(?P<k>\d+)-of-(?P<n>\d+)\.safetensors$")


def check_shard_set(model_dir: Path, names: list[str]) -> None:
    """Refuse weight files that are not one complete checkpoint: shard names
    (``model-00001-of-00003.safetensors``) of two different sets (another stem or
    count, or a single-file checkpoint beside shards: a new download half done
    beside an old one), or a set with a member missing.

    Raises:
        CheckpointError: naming two files of different sets, or the first missing shard.
    """
    sets: dict[tuple[str, int] | None, list[tuple[int, str]]] = {}
    for name in names:
        m = _SHARD.match(name)
        if m is None and name != "model.safetensors":
            continue  # another file (an adapter, an extra): its tensors are checked by name
        key = (m["stem"], int(m["n"])) if m else None
        sets.setdefault(key, []).append((int(m["k"]) if m else 0, name))
    if not sets:
        return
    if len(sets) > 1:
        a, b = (members[0][1] for members in list(sets.values())[:2])
        raise CheckpointError(f"{model_dir}: {a} and {b} belong to two different checkpoints (another shard "
                              "count or name): remove the files of the old one, or download the model again")
    (key, members), = sets.items()
    if key is None:
        return
    stem, n = key
    have = {k for k, _ in members}
    missing = [k for k in range(1, n + 1) if k not in have]
    if missing:
        width = len(_SHARD.match(members[0][1])["k"])
        first = f"{stem}-{missing[0]:0{width}d}-of-{_SHARD.match(members[0][1])['n']}.safetensors"
        more = f" (and {len(missing) - 1} more of the {n})" if len(missing) > 1 else ""
        raise CheckpointError(f"{model_dir / first}: missing{more}; the checkpoint is incomplete "
                              "(an interrupted download?)")


def weight_files(model_dir: Path) -> list[Path]:
    """The files the checkpoint's weights come from, sorted: those the index
    names when ``model.safetensors.index.json`` exists, else every ``*.safetensors``.

    Raises:
        CheckpointError: no weight file; a file the index names is missing;
            the index is unreadable; without an index, files of two shard sets
            or a set with a member missing (:func:`check_shard_set`).
    """
    model_dir = Path(model_dir)
    if not (model_dir / INDEX_FILE).exists():
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{model_dir}: no .safetensors files")
        check_shard_set(model_dir, [f.name for f in files])
        return files
    names = sorted(set(_read_index(model_dir).values()))
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"{model_dir / missing[0]}: missing, but {INDEX_FILE} names it{more} "
                              "(incomplete download?)")
    if not names:
        raise CheckpointError(f"{model_dir / INDEX_FILE}: weight_map is empty")
    return [model_dir / n for n in names]


def index_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """Where every tensor of the checkpoint lives: tensor name -> TensorInfo.

    With an index file its ``weight_map`` decides (files it does not name are
    ignored); without one each
    tensor must be in exactly one ``*.safetensors`` file. Every header read is
    checked (:func:`read_header`).

    Raises:
        CheckpointError: as :func:`weight_files` and :func:`read_header`; a
            tensor the index places in a file that lacks it; without an index,
            a tensor found in two files (both named).
    """
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    headers = {f.name: read_header(f) for f in files}
    if (model_dir / INDEX_FILE).exists():
        weight_map = _read_index(model_dir)
        index = {}
        for name, file in weight_map.items():
            if name not in headers[file]:
                raise CheckpointError(f"{model_dir / file}: holds no tensor {name!r}, which {INDEX_FILE} places there")
            index[name] = headers[file][name]
        for file, header in headers.items():
            # mlx-lm loads whole files: a tensor the index places elsewhere must not be here too.
            other = next((n for n in header if weight_map.get(n, file) != file), None)
            if other is not None:
                raise CheckpointError(f"{model_dir}: tensor {other!r} is in both {file} and {weight_map[other]} "
                                      f"({INDEX_FILE} names {weight_map[other]}); mlx-lm would mix them")
        return index
    index: dict[str, TensorInfo] = {}
    for header in headers.values():
        for name, info in header.items():
            if name in index:
                raise CheckpointError(f"{model_dir}: tensor {name!r} is in both {index[name].file.name} and "
                                      f"{info.file.name}, and no {INDEX_FILE} says which to use")
            index[name] = info
    return index


def context_length(model_dir: Path, default: int | None = None) -> int | None:
    """The checkpoint's context length in tokens, from its config.json
    (the first of :data:`CONTEXT_KEYS` it states; ``default`` when none).

    Raises:
        CheckpointError: config.json missing or not a JSON object.
    """
    config = _read_config(Path(model_dir))
    return next((config[k] for k in CONTEXT_KEYS if isinstance(config.get(k), int)), default)


def module_at(model: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted parameter path (``model.layers.3.mlp``)."""
    node = model
    for p in path.split(".") if path else []:
        node = node[int(p)] if isinstance(node, list) else node[p]
    return node


def set_child(model: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the submodule at ``path`` by ``new``."""
    parent, _, last = path.rpartition(".")
    module_at(model, parent)[last] = new


def find_expert_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(parameter path, block)`` of every mlx-lm expert block, in model order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, EXPERT_BLOCKS)][::-1]


@dataclass(frozen=True)
class ExpertTensor:
    """One stacked ``[E, ...]`` array of an expert block and where it lies on disk.

    Attributes:
        leaf: the block's submodule holding it (e.g. ``gate_proj``).
        attr: its attribute there (``weight``, ``scales``, ``biases``, ``bias``, ...).
        info: its place in the checkpoint.
    """

    leaf: nn.Module
    attr: str
    info: TensorInfo

    @property
    def array(self) -> mx.array:
        return self.leaf[self.attr]


def expert_tensors(path: str, block: nn.Module, index: dict, model_dir: Path) -> tuple[int, dict[str, ExpertTensor]]:
    """The stacked expert tensors of one expert block, checked against the shard headers.

    Args:
        path: the block's parameter path (``model.layers.3.mlp.switch_mlp``).
        index: tensor name -> TensorInfo (:func:`index_checkpoint`).

    Returns:
        ``(E, {name on disk: ExpertTensor})``.
    Raises:
        CheckpointError: a tensor missing, not stacked ``[E, ...]``, or of
            another shape than the model expects; a block without weights.
    """
    tensors, num_experts = {}, None
    for sub, leaf in block.named_modules():
        if leaf is block or leaf.children():
            continue
        for attr, arr in leaf.items():
            if not isinstance(arr, mx.array):
                continue  # every array of a switch layer is per expert: [E, ...]
            name = f"{path}.{sub}.{attr}"
            info = index.get(name)
            if info is None:
                raise CheckpointError(
                    f"{model_dir}: expert tensor {name!r} is not stored stacked [E, ...] "
                    "(mlx-lm format expected; convert the checkpoint with mlx_lm.convert)"
                )
            if tuple(info.shape) != tuple(arr.shape) or info.shape[0] != (num_experts or info.shape[0]):
                raise CheckpointError(f"{name}: shape on disk {info.shape} != model {tuple(arr.shape)}")
            num_experts = num_experts or info.shape[0]
            tensors[name] = ExpertTensor(leaf, attr, info)
    if not tensors:
        raise CheckpointError(f"{path}: expert block holds no weights")
    return num_experts, tensors


def not_a_folder(path: Path) -> str | None:
    """``"is a file"`` or ``"no such folder"`` for a checkpoint path that is no folder, else ``None``."""
    if path.is_dir():
        return None
    return "is a file, not a folder" if path.exists() else "no such folder"


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: {not_a_folder(model_dir) or 'no config.json'} "
                              "(not an mlx-lm checkpoint directory)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def _mlx_lm_error(model_dir: Path, model_type, e: Exception) -> CheckpointError:
    """One line for an mlx-lm build/load failure (its messages may list hundreds of names)."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    first = lines[0].rstrip(": ")
    if first.startswith(("Received", "Missing")) and "parameters" in first:
        example = lines[1].strip().strip("{},'\" ")[:80] if len(lines) > 1 else ""
        return CheckpointError(
            f"{model_dir}: the weights do not fit a {model_type!r} model as config.json describes it "
            f"({first[:120]}{', e.g. ' + example if example else ''})"
        )
    if first.startswith("Model type") and "not supported" in first:
        return CheckpointError(f"{model_dir}: model type {model_type!r} is not supported by mlx-lm")
    return CheckpointError(f"{model_dir}: cannot build the model with mlx-lm: {first[:200]}")


def build_lazily(model_dir: Path, files: list[Path] | None = None, strict: bool = True) -> tuple[nn.Module, dict]:
    """The mlx-lm model of a checkpoint, its weights loaded lazily (none read).

    mlx-lm merges every ``model*.safetensors`` it finds; when that is not
    ``files`` (the resolved :func:`weight_files`), it is given a temporary
    folder of links to config files and ``files`` only. (The arrays keep their
    files open, so the folder can go once the model is built.)

    Returns:
        ``(model, config)`` as ``mlx_lm.utils.load_model`` returns them.
    Raises:
        CheckpointError: no config.json, an unknown model type, weights that
            do not fit the model the config describes (one line).
    """
    model_dir = Path(model_dir)
    model_type = _read_config(model_dir).get("model_type")
    files = weight_files(model_dir) if files is None else files
    globbed = sorted(model_dir.glob("model*.safetensors"))
    try:
        if {f.resolve() for f in globbed} == {f.resolve() for f in files}:
            return load_model(model_dir, lazy=True, strict=strict)
        with tempfile.TemporaryDirectory(prefix="mlx-tier-view-") as view:
            view = Path(view)
            for entry in model_dir.iterdir():
                if entry.suffix != ".safetensors" and entry.name != INDEX_FILE:
                    os.symlink(entry.resolve(), view / entry.name)
            for i, f in enumerate(files):
                os.symlink(f.resolve(), view / f"model-{i:05d}.safetensors")
            return load_model(view, lazy=True, strict=strict)
    except (FileNotFoundError, ValueError, KeyError, RuntimeError, TypeError, AttributeError) as e:
        raise _mlx_lm_error(model_dir, model_type, e) from None


@dataclass(frozen=True)
class Checkpoint:
    """An MoE checkpoint opened lazily: no weight read.

    Attributes:
        path: the folder.
        config: config.json as mlx-lm read it.
        model: the mlx-lm model, weights loaded lazily.
        index: tensor name -> TensorInfo (:func:`index_checkpoint`).
        blocks: ``(parameter path, block)`` of every expert block, in model order.
    """

    path: Path
    config: dict
    model: nn.Module
    index: dict[str, TensorInfo]
    blocks: list[tuple[str, nn.Module]]

    def experts(self) -> list[tuple[str, int, dict[str, ExpertTensor]]]:
        """``(block path, E, tensors)`` per MoE layer (:func:`expert_tensors`)."""
        return [(p, *expert_tensors(p, b, self.index, self.path)) for p, b in self.blocks]


def open_checkpoint(model_dir: Path, strict: bool = True) -> Checkpoint:
    """Open an mlx-lm MoE checkpoint lazily: resolve its files, check every
    header, build the model, find its expert blocks.

    Raises:
        CheckpointError: a bad folder (module doc), or a model without mlx-lm
            expert blocks (dense, or an MoE mlx-tier cannot tier: :data:`REFUSED`).
    """
    model_dir = Path(model_dir)
    _read_config(model_dir)
    index = index_checkpoint(model_dir)  # every header checked before mlx-lm opens a file
    model, config = build_lazily(model_dir, sorted({i.file for i in index.values()}), strict)
    return Checkpoint(model_dir, config, model, index, moe_blocks(model, model_dir))


def moe_blocks(model: nn.Module, model_dir: Path) -> list[tuple[str, nn.Module]]:
    """:func:`find_expert_blocks`, refusing a model without any.

    Raises:
        CheckpointError: a dense model, or an MoE whose experts mlx-tier cannot
            tier (:data:`REFUSED`).
    """
    blocks = find_expert_blocks(model)
    model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "?")
    if not blocks and model_type in REFUSED:
        raise CheckpointError(f"{model_dir}: model type {model_type!r} cannot be tiered: {REFUSED[model_type]}")
    if not blocks:
        raise CheckpointError(f"{model_dir}: not a Mixture-of-Experts checkpoint "
                              f"(model type {model_type!r} has no mlx-lm expert blocks)")
    return blocks


def model_shape(model_dir: Path) -> tuple[int, int]:
    """``(MoE layers, experts per layer)`` of an mlx-lm checkpoint, from its
    config and shard headers (no weight is read).

    Raises:
        CheckpointError: not an mlx-lm MoE checkpoint with stacked experts.
    """
    experts = open_checkpoint(model_dir).experts()
    return len(experts), max(n for _, n, _ in experts)

