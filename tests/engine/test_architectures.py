"""Every mlx-lm MoE architecture runs tiered and exact.

For each model type: a tiny random checkpoint made with mlx-lm's own
``ModelArgs``/``Model``, saved in mlx-lm format; greedy tokens of the tiered
model equal plain mlx-lm's for cache sizes 1, top-k and E slots per layer,
with the experts quantised (4-bit affine), and at 1 slot unquantised; a
batch of two prompts equals each alone.
"""

import importlib

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm.generate import batch_generate
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import load_model
from support.arch_configs import BASE, CONFIGS, E, K
from support.checkpoints import write_checkpoint
from support.exactness import PROMPTS, greedy_ids

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.engine.dtypes import cast_model, gather_mm_computes
from mlx_tier.errors import ConfigError


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch(request, tmp_path_factory, tokenizer_dir):
    name = request.param
    config = {**BASE, "model_type": name, **CONFIGS[name]}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    paths = {}
    root = tmp_path_factory.mktemp(name)
    paths["fp32"] = write_checkpoint(root / "fp32", model, config, tokenizer_dir)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    paths["q4"] = write_checkpoint(root / "q4", model, {**config, "quantization": {"group_size": 32, "bits": 4}}, tokenizer_dir)
    refs = {}
    for kind, path in paths.items():
        ref, _ = load_model(path)
        refs[kind] = [greedy_ids(ref, p) for p in PROMPTS]
    return name, paths, refs


# Slot counts exercise the cache (rounds at 1, full at E; top-k slots, one
# pass, in the batch test below); the float path (gather_mm) is independent
# of them, so it runs at 1 slot only.
CASES = [("q4", 1), ("q4", E), ("fp32", 1)]


@pytest.mark.parametrize("kind, slots", CASES, ids=[f"{k}-{s}" for k, s in CASES])
def test_tiered_equals_mlx_lm(arch, kind, slots):
    name, paths, refs = arch
    model, _ = mlx_tier.load(paths[kind], config=TierConfig(slots_per_layer=slots))
    assert [greedy_ids(model, p) for p in PROMPTS] == refs[kind], f"{name} {kind} slots={slots}"
    assert model.expert_cache.stats.misses > 0


def test_wrong_expert_changes_logits(arch):
    """The matrix can fail: serving another expert's weights changes the output."""
    name, paths, _ = arch
    model, _ = mlx_tier.load(paths["fp32"], config=TierConfig(slots_per_layer=E))
    x = mx.array(PROMPTS[1])[None]
    good = model(x)
    for layer in model.expert_cache.layers:  # each slot now holds another expert's weights
        for t in layer.tensors.values():
            setattr(t.module, t.attr, mx.roll(t.module[t.attr], 1, axis=0))
    assert not mx.allclose(good, model(x), atol=1e-5).item(), name


def until_eos(ids, eos):
    out = []
    for t in ids:
        if t in eos:
            break
        out.append(t)
    return out


def test_batch_of_two_equals_each_alone(arch):
    """At top-k slots: each prompt alone equals plain mlx-lm, and a batch equals each alone."""
    name, paths, refs = arch
    model, tokenizer = mlx_tier.load(paths["q4"], config=TierConfig(slots_per_layer=K))
    ids = [greedy_ids(model, p) for p in PROMPTS]
    assert ids == refs["q4"], f"{name} q4 slots={K}"
    alone = [until_eos(i, set(tokenizer.eos_token_ids)) for i in ids]
    batch = batch_generate(model, tokenizer, PROMPTS, max_tokens=8, return_token_ids=True)
    assert batch.token_ids == alone, name


QUANT_MODES = [
    *[dict(mode="affine", bits=b, group_size=32) for b in (2, 3, 4, 5, 6, 8)],
    dict(mode="mxfp4", bits=4, group_size=32),
    dict(dtype="float16"),
    dict(dtype="bfloat16"),
]


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("quant", QUANT_MODES, ids=lambda q: q.get("dtype") or f"{q['mode']}{q['bits']}")
def test_expert_formats(name, quant, tmp_path, tokenizer_dir):
    """Every expert format mlx-lm writes: affine 2-8 bits, mxfp4, unquantised fp16/bf16.

    By default the tiered model equals mlx-lm's model as loaded (nothing cast);
    with ``dtype=mx.float32``, mlx-lm's model cast to float32. Unquantised
    fp16/bf16 experts that MLX cannot compute here (its CPU backend's
    ``gather_mm`` is float32 only: mlx-lm's model fails at its first token)
    are refused at load, naming the fix.
    """
    config = {**BASE, "model_type": name, **CONFIGS[name]}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(4)
    model = module.Model(module.ModelArgs.from_dict(config))
    if "dtype" in quant:
        model.set_dtype(getattr(mx, quant["dtype"]))
    else:
        nn.quantize(model, **quant, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
        config["quantization"] = dict(quant)
    path = write_checkpoint(tmp_path / "ckpt", model, config, tokenizer_dir)
    ref, _ = load_model(path)
    if "dtype" in quant and not gather_mm_computes(getattr(mx, quant["dtype"])):
        with pytest.raises(ConfigError, match=f"unquantized experts are {quant['dtype']}.*dtype=mx.float32"):
            mlx_tier.load(path)
    else:
        assert_tiered_equals(ref, path, {}, (1, E))
    cast_model(ref, mx.float32)
    assert_tiered_equals(ref, path, {"dtype": mx.float32}, (1,))


def assert_tiered_equals(ref, path, settings: dict, slot_counts) -> None:
    """Greedy tokens of ``ref`` (an mlx-lm model) equal the tiered model's, loaded
    from ``path`` with ``TierConfig(**settings)`` at each of ``slot_counts``."""
    want = [greedy_ids(ref, p) for p in PROMPTS]
    for slots in slot_counts:
        tiered, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots, **settings))
        assert [greedy_ids(tiered, p) for p in PROMPTS] == want, (path, settings, slots)


def test_dbrx_is_refused_with_its_reason(tmp_path, tokenizer_dir):
    from mlx_lm.models import dbrx

    config = dict(
        model_type="dbrx", vocab_size=128, d_model=64, n_layers=1, n_heads=4,
        attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
    )
    model = dbrx.Model(dbrx.ModelArgs.from_dict(config))
    path = write_checkpoint(tmp_path / "dbrx", model, config, tokenizer_dir)
    with pytest.raises(mlx_tier.CheckpointError, match="'dbrx' cannot be tiered: its experts are a model-specific module"):
        mlx_tier.load(path)


def nvfp4_checkpoint(path, tokenizer_dir):
    from mlx_lm.utils import quantize_model

    config = {**BASE, "model_type": "mixtral", **CONFIGS["mixtral"]}
    mx.random.seed(6)
    mixtral = importlib.import_module("mlx_lm.models.mixtral")
    model = mixtral.Model(mixtral.ModelArgs.from_dict(config))
    model, config = quantize_model(
        model, config, 16, 4, mode="nvfp4", global_scale=True,
        quant_predicate=lambda p, m: isinstance(m, SwitchLinear),
    )
    return write_checkpoint(path, model, config, tokenizer_dir)


def test_nvfp4_global_scale_refused_on_cpu(tmp_path, tokenizer_dir):
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU-only refusal")
    path = nvfp4_checkpoint(tmp_path / "nvfp4", tokenizer_dir)
    with pytest.raises(mlx_tier.CheckpointError, match="nvfp4 experts with a per-expert global scale need a GPU"):
        mlx_tier.load(path)


@pytest.mark.skipif(mx.default_device() == mx.cpu, reason="needs a GPU: MLX's CPU backend has no nvfp4 global-scale gather_qmm")
def test_nvfp4_global_scale_exact_on_gpu(tmp_path, tokenizer_dir):
    path = nvfp4_checkpoint(tmp_path / "nvfp4", tokenizer_dir)
    ref, _ = load_model(path)
    want = [greedy_ids(ref, p) for p in PROMPTS]
    for slots in (1, E):
        model, _ = mlx_tier.load(path, config=TierConfig(slots_per_layer=slots))
        assert [greedy_ids(model, p) for p in PROMPTS] == want
