"""Tiny checkpoints written by mlx-lm's own classes (the fixtures in tests/conftest.py use them)."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx_lm.models import mixtral
from mlx_lm.utils import save_config, save_model

TINY_MIXTRAL = dict(
    model_type="mixtral",
    vocab_size=49152,  # the SmolLM2 tokenizer's
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def write_checkpoint(path: Path, model: nn.Module, config: dict, tokenizer_dir: Path) -> Path:
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


def make_mixtral(path: Path, tokenizer_dir: Path, *, quantized: bool, seed: int = 0, **overrides) -> Path:
    """A tiny random Mixtral-layout MoE in mlx-lm format (float32 weights).

    Quantised: experts and attention at 4 bits (group 32), router left in float
    (mlx-lm's own rule for routers is to keep them at high precision).
    """
    config = {**TINY_MIXTRAL, **overrides}
    mx.random.seed(seed)
    model = mixtral.Model(mixtral.ModelArgs.from_dict(config))
    # Larger router logits than the default init: routing then varies by token.
    for layer in model.layers:
        layer.block_sparse_moe.gate.weight = layer.block_sparse_moe.gate.weight * 8
    if quantized:
        nn.quantize(
            model,
            group_size=32,
            bits=4,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith(".gate"),
        )
        config["quantization"] = {"group_size": 32, "bits": 4}
    return write_checkpoint(path, model, config, tokenizer_dir)
