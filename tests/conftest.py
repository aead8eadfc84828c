"""Shared fixtures: tiny checkpoints written by mlx-lm's own classes, the demo model.

Nothing here touches the network or the user's cache directory: an autouse
fixture points ``MLX_TIER_CACHE`` at a per-session temporary folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.models import llama, mixtral
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


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx-tier-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache, monkeypatch):
    monkeypatch.setenv("MLX_TIER_CACHE", str(session_cache))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (from the GGUF metadata), built once."""
    from mlx_tier.demo_model import _save_tokenizer, gguf_path

    out = tmp_path_factory.mktemp("tokenizer")
    _, meta = mx.load(str(gguf_path()), return_metadata=True)
    _save_tokenizer(meta, out)
    return out


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


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory, tokenizer_dir) -> Path:
    return make_mixtral(tmp_path_factory.mktemp("tiny") / "moe-q4", tokenizer_dir, quantized=True)


@pytest.fixture(scope="session")
def tiny_moe_bf16(tmp_path_factory, tokenizer_dir) -> Path:
    """``tiny_moe`` with bf16 scales, biases and dense weights, as real checkpoints store them."""
    from mlx_lm.utils import load_model

    q4 = make_mixtral(tmp_path_factory.mktemp("tiny") / "moe-q4-for-bf16", tokenizer_dir, quantized=True)
    model, config = load_model(q4)
    model.set_dtype(mx.bfloat16)  # floating leaves only: packed weights stay uint32
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "moe-q4-bf16", model, config, tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_moe_fp(tmp_path_factory, tokenizer_dir) -> Path:
    return make_mixtral(tmp_path_factory.mktemp("tiny") / "moe-fp32", tokenizer_dir, quantized=False, seed=1)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny dense llama checkpoint: valid for mlx-lm, not an MoE."""
    config = dict(
        model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
    )
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "dense", model, config, tokenizer_dir)


@pytest.fixture(scope="session")
def demo_model(session_cache) -> Path:
    """The SmolLM2 8-expert demo MoE (v2, fitted routers), built once per session (~1.5 min)."""
    import os

    os.environ["MLX_TIER_CACHE"] = str(session_cache)
    from mlx_tier.demo_model import ensure_demo_model

    return ensure_demo_model()


def command_after(output: str, label: str) -> str:
    """The command a message gives after ``label`` (e.g. ``"Resume with:"``): the line
    after the word-wrapped prose that ends with it (:func:`mlx_tier.messages.with_command`).

    Raises:
        AssertionError: no line ends the label.
    """
    lines = output.splitlines()
    for i, line in enumerate(lines[:-1]):
        if " ".join(" ".join(lines[: i + 1]).split()).endswith(label) and line.rstrip().endswith(label.split()[-1]):
            return lines[i + 1]
    raise AssertionError(f"no {label!r} followed by a command in:\n{output}")
