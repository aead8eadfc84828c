"""benches/peers_gguf.py: the synthetic qwen3_moe as a GGUF llama.cpp can read, same shapes and weights.

The invariant it guards: llama.cpp in benches/peers.py runs the same model as
mlx-tier -- every tensor present under llama.cpp's qwen3moe name, in ggml's
shape order, and each weight within Q4_0's rounding of the checkpoint's.
Skipped where the ``gguf`` package (the ``peers`` extra) is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.slow  # builds a small checkpoint (seconds on a quiet machine)
BENCHES = Path(__file__).resolve().parents[2] / "benches"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    sys.path.insert(0, str(BENCHES))
    try:
        synth, conv = _load("make_synthetic_moe"), _load("peers_gguf")
        root = tmp_path_factory.mktemp("peers_gguf")
        spec = synth.SyntheticSpec(num_layers=2, num_experts=8, top_k=2, hidden_size=256, moe_intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        model = synth.make_synthetic_moe(root / "model", spec, progress=lambda s: None)
        out = conv.write_gguf(model, root / "model.gguf", progress=lambda s: None)
        yield model, out, conv
    finally:
        sys.path.remove(str(BENCHES))


def test_names_follow_llama_cpp_qwen3moe(tiny_gguf):
    _, _, conv = tiny_gguf
    assert conv.gguf_name("model.layers.3.mlp.switch_mlp.down_proj") == "blk.3.ffn_down_exps"
    assert conv.gguf_name("model.layers.0.mlp.gate") == "blk.0.ffn_gate_inp"
    assert conv.gguf_name("lm_head") == "output"
    with pytest.raises(KeyError):
        conv.gguf_name("model.vision_tower.proj")


def test_every_tensor_written_in_ggml_shape_order(tiny_gguf):
    model, out, _ = tiny_gguf
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 * 12 + 3  # 12 per layer, embedding, final norm, lm_head
    assert not out.with_name(out.name + ".partial").exists()
    experts = tensors["blk.1.ffn_gate_exps.weight"]
    assert experts.tensor_type == gguf.GGMLQuantizationType.Q4_0
    assert list(experts.shape) == [256, 128, 8]  # ggml order: in, out, experts
    assert list(tensors["blk.0.ffn_gate_inp.weight"].shape) == [256, 8]
    assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    assert reader.fields["general.architecture"].contents() == "qwen3moe"
    assert reader.fields["qwen3moe.expert_used_count"].contents() == 2
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_weights_within_q4_0_rounding_of_the_checkpoint(tiny_gguf):
    import mlx.core as mx

    model, out, _ = tiny_gguf
    parts = {k.rsplit(".", 1)[1]: v for k, v in mx.load(str(next(model.glob("model-00002-*.safetensors")))).items()
             if ".down_proj." in k}
    want = np.array(mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group_size=64, bits=4)
                    .astype(mx.float32))  # [8 experts, 256 out, 128 in]
    t = next(t for t in gguf.GGUFReader(str(out)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    got = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(want.shape)
    # Q4_0: d = max|w| / 8 per 32 weights, codes -8..7: the side opposite the
    # largest magnitude tops out at 7d, so the error is <= d (+ fp16 rounding of d)
    blocks = want.reshape(-1, 32)
    bound = np.abs(blocks).max(axis=1, keepdims=True) / 8 * 1.01 + 1e-6
    assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= bound)
    assert not np.allclose(got[0], got[1])  # experts differ: the wrong expert would be detected
