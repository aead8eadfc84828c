"""``mlx-tier convert``: Hugging Face MoE checkpoint -> mlx-lm format, router-safe.

Built on ``mlx_lm.convert.convert`` with a quantisation predicate: routed
experts at ``bits``; routers/gates and shared experts at ``router_bits`` /
``shared_expert_bits`` (8 or more by default). A quantised router flips the
top-k choice and breaks output while perplexity looks fine, so it is never
quantised below 8 bits unless asked. The model's own predicate (for example
qwen3_moe's 8-bit gate) is combined with ours: the more precise setting wins.

After converting, every MoE layer is checked to hold all E experts with the
expected shapes, and *router agreement* is reported: the fraction of
(token, layer) top-k sets equal between the converted and the unquantised
model on a calibration text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models.switch_layers import SwitchLinear

from mlx_tier.engine.checkpoint import (
    find_expert_blocks,
    index_checkpoint,
    open_checkpoint,
    set_child,
)
from mlx_tier.errors import CheckpointError
from mlx_tier.tools import QUANT_BITS, QUANT_MODES

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
SHARED_MARKERS = ("shared_expert", "shared_experts", "shared_mlp")
ROUTER_SUFFIXES = (".gate", ".router", ".gate.wg", ".router.layer")


@dataclass(frozen=True)
class ConvertConfig:
    """Settings of one conversion.

    Attributes:
        bits: routed experts' bits, one of :data:`~mlx_tier.tools.QUANT_BITS`.
        group_size: quantisation group size (``None``: the mode's default).
        mode: one of :data:`~mlx_tier.tools.QUANT_MODES` (``"affine"``, ``"mxfp4"``).
        router_bits: 8, or 16 to keep routers unquantised.
        shared_expert_bits: shared experts' bits (``None``: max(8, bits)); 16 keeps them unquantised.
        dense_bits: attention/embeddings bits (``None``: same as ``bits``).
    """

    bits: int = 4
    group_size: int | None = None
    mode: str = "affine"
    router_bits: int = 8
    shared_expert_bits: int | None = None
    dense_bits: int | None = None


@dataclass(frozen=True)
class ConvertReport:
    out_dir: Path
    moe_layers: int
    experts_per_layer: int
    router_agreement: float  # fraction of (token, layer) top-k sets unchanged
    calibration_tokens: int


def _num_experts(config: dict) -> int | None:
    for src in (config, config.get("text_config") or {}):
        for k in EXPERT_COUNT_KEYS:
            if isinstance(src.get(k), int):
                return src[k]
    return None


def _spec(bits: int, group_size: int | None, mode: str) -> dict | bool:
    if bits >= 16:
        return False
    if mode != "affine" and bits != 4:
        mode = "affine"  # mxfp4 is 4-bit only; higher precision parts use affine
    return {"group_size": group_size or (32 if mode != "affine" else 64), "bits": bits, "mode": mode}


def _more_precise(a, b):
    """The setting that keeps more precision (``False`` = unquantised wins)."""
    if a is False or b is False:
        return False
    if a is True:
        return b
    if b is True:
        return a
    return a if a["bits"] >= b["bits"] else b


class RouterSafePredicate:
    """``quant_predicate(path, module)`` for ``mlx_lm`` quantisation.

    Routers are recognised as ``nn.Linear`` layers with E outputs (or named
    ``*.gate``/``*.router``); shared experts by name; routed experts as
    ``SwitchLinear``.
    """

    def __init__(self, cfg: ConvertConfig, num_experts: int, own=None):
        self.cfg = cfg
        self.num_experts = num_experts
        self.own = own

    def kind(self, path: str, module: nn.Module) -> str:
        if isinstance(module, SwitchLinear):
            return "expert"
        if any(m in path for m in SHARED_MARKERS):
            return "shared"
        out_dim = module.weight.shape[0] if "weight" in module else None
        if path.endswith(ROUTER_SUFFIXES) or (isinstance(module, nn.Linear) and out_dim == self.num_experts):
            return "router"
        return "dense"

    def __call__(self, path: str, module: nn.Module):
        c = self.cfg
        kind = self.kind(path, module)
        bits = {
            "expert": c.bits,
            "router": c.router_bits,
            "shared": c.shared_expert_bits if c.shared_expert_bits is not None else max(8, c.bits),
            "dense": c.dense_bits if c.dense_bits is not None else c.bits,
        }[kind]
        ours = _spec(bits, c.group_size, c.mode)
        if self.own is None:
            return ours
        own = self.own(path, module)
        if own is False:
            return False
        return _more_precise(own, ours)


def _own_predicate(config: dict):
    """The model class's own quant_predicate, from a lazily built instance (no weights)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return getattr(model, "quant_predicate", None)


def verify_experts(out_dir: Path) -> tuple[int, int]:
    """Check every MoE layer of a converted checkpoint holds all E experts.

    Returns:
        ``(moe_layers, experts_per_layer)``.
    Raises:
        CheckpointError: a layer lacks expert tensors or has the wrong count/shape.
    """
    ckpt = open_checkpoint(out_dir)
    E = _num_experts(ckpt.config)
    for path, n, _ in ckpt.experts():
        if E is not None and n != E:
            raise CheckpointError(f"{out_dir}: {path} holds {n} experts, expected {E}")
    return len(ckpt.blocks), E or 0


class _Recorder(nn.Module):
    """Wraps an expert block to record its router top-k indices."""

    def __init__(self, inner, log: list):
        super().__init__()
        self._inner = inner
        self._log = log

    def __call__(self, x, indices):
        self._log.append(indices)
        return self._inner(x, indices)


def routing_sets(model: nn.Module, tokens: list[int]) -> list[list[frozenset]]:
    """Per MoE layer, per token: the set of top-k expert ids on ``tokens``."""
    blocks = find_expert_blocks(model)
    logs = [[] for _ in blocks]
    for (path, block), log in zip(blocks, logs):
        set_child(model, path, _Recorder(block, log))
    try:
        mx.eval(model(mx.array(tokens)[None]))
    finally:
        for path, block in blocks:
            set_child(model, path, block)
    out = []
    for log in logs:
        idx = mx.concatenate([a.reshape(-1, a.shape[-1]) for a in log]).tolist()
        out.append([frozenset(row) for row in idx])
    return out


def router_agreement(reference_dir: Path, converted_dir: Path, text: str) -> tuple[float, int]:
    """Fraction of (token, layer) top-k sets equal between two checkpoints.

    Both run in float32; the tokenizer is the reference's.
    """
    from mlx_lm import load

    ref, tok = load(str(reference_dir))
    ref.set_dtype(mx.float32)
    tokens = tok.encode(text)[:512]
    if not tokens:
        raise CheckpointError("calibration text is empty")
    vocab = getattr(getattr(ref, "args", None), "vocab_size", None)
    if vocab is not None and max(tokens) >= vocab:
        raise CheckpointError(f"{reference_dir}: tokenizer ids exceed the model's vocabulary ({vocab})")
    a = routing_sets(ref, tokens)
    del ref
    conv, _ = load(str(converted_dir))
    conv.set_dtype(mx.float32)
    b = routing_sets(conv, tokens)
    same = sum(x == y for la, lb in zip(a, b) for x, y in zip(la, lb))
    total = sum(len(la) for la in a)
    return (same / total if total else 1.0), len(tokens)


def calibration_text(path: Path | None) -> str:
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read calibration text ({e})") from None
    return resources.files("mlx_tier.data").joinpath("calibration.txt").read_text(encoding="utf-8")


_PER_EXPERT = re.compile(r"^(?P<block>.+?\.experts)\.(?P<e>\d+)\.(?P<leaf>.+)$")


def missing_experts(names, num_experts: int) -> list[str]:
    """The per-expert tensors a Hugging Face checkpoint lacks, by the names it has.

    Per-expert tensors are named ``<block>.experts.<e>.<leaf>`` (``mlp.experts.3.up_proj.weight``,
    ``block_sparse_moe.experts.0.w1.weight``). Every block that has any must have every
    leaf it has for some expert, for each of the ``num_experts`` experts: an expert
    missing whole (all its tensors) is found as well as one missing a single tensor.

    Returns:
        the missing names, sorted by block, expert and leaf (``[]``: complete).
    """
    leaves: dict[str, set[str]] = {}
    have: set[tuple[str, int, str]] = set()
    for name in names:
        m = _PER_EXPERT.match(name)
        if m:
            leaves.setdefault(m["block"], set()).add(m["leaf"])
            have.add((m["block"], int(m["e"]), m["leaf"]))
    return [f"{block}.{e}.{leaf}" for block in sorted(leaves) for e in range(num_experts)
            for leaf in sorted(leaves[block]) if (block, e, leaf) not in have]


def _check_expert_set(hf_dir: Path, num_experts: int) -> None:
    """Refuse a checkpoint whose per-expert tensors are incomplete, naming what is missing.

    Raises:
        CheckpointError: the first missing tensors (and how many in all).
    """
    missing = missing_experts(index_checkpoint(hf_dir), num_experts)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"{hf_dir}: missing expert tensor(s) {shown} (partial expert set: an "
                              "incomplete download?)")


def convert(hf_dir: Path, out_dir: Path, cfg: ConvertConfig = ConvertConfig(), calib: Path | None = None) -> ConvertReport:
    """Convert and quantise a Hugging Face MoE checkpoint into ``out_dir``.

    Raises:
        CheckpointError: missing config, unknown model type, missing expert
            tensors, or a partial expert set; ``out_dir`` is then not created.
        FileExistsError: ``out_dir`` exists.
        OSError: disk full (``out_dir`` not created).
    """
    from mlx_lm.convert import convert as mlx_convert
    from mlx_lm.utils import _get_classes

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists; choose a new output folder")
    if not (hf_dir / "config.json").is_file():
        from mlx_tier.engine.checkpoint import not_a_folder

        raise CheckpointError(f"{hf_dir}: {not_a_folder(hf_dir) or 'no config.json'} (not a Hugging Face "
                              "checkpoint directory)")
    if cfg.bits not in QUANT_BITS:
        raise CheckpointError(f"`bits` must be one of {', '.join(map(str, QUANT_BITS))}; got {cfg.bits}", "bits")
    if cfg.mode not in QUANT_MODES:
        raise CheckpointError(f"`mode` must be {' or '.join(QUANT_MODES)}; got {cfg.mode}", "mode")
    if cfg.mode == "mxfp4" and cfg.bits != 4:
        raise CheckpointError("mxfp4 is a 4-bit format: use `bits` 4", "bits")
    config = json.loads((hf_dir / "config.json").read_text())
    try:
        _get_classes(config)
    except ValueError:
        raise CheckpointError(f"{hf_dir}: model type {config.get('model_type')!r} is not supported by mlx-lm") from None
    text = calibration_text(calib)
    E = _num_experts(config)
    if E is None:
        raise CheckpointError(f"{hf_dir}: config states no expert count ({', '.join(EXPERT_COUNT_KEYS)}): not an MoE")
    _check_expert_set(hf_dir, E)
    predicate = RouterSafePredicate(cfg, E, _own_predicate(config))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        staged = tmp / "model"
        try:
            mlx_convert(
                str(hf_dir),
                mlx_path=str(staged),
                quantize=True,
                q_group_size=cfg.group_size,
                q_bits=cfg.bits,
                q_mode=cfg.mode,
                quant_predicate=predicate,
            )
        except KeyError as e:
            raise CheckpointError(f"{hf_dir}: missing expert tensor {e} (partial expert set)") from None
        except ValueError as e:
            if "Missing" in str(e) or "parameters" in str(e):
                raise CheckpointError(f"{hf_dir}: checkpoint does not match its config: {str(e)[:300]}") from None
            raise
        layers, experts = verify_experts(staged)
        agreement, n_tokens = router_agreement(hf_dir, staged, text)
        os.rename(staged, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ConvertReport(out_dir, layers, experts, agreement, n_tokens)
