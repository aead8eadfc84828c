"""`mlx-tier convert`: HF-layout MoE checkpoints (per-expert tensors) -> mlx-lm
format with router-safe quantisation; the result loads tiered and matches mlx-lm.
"""

import importlib
import json
import os

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load_model
from support.arch_configs import BASE, CONFIGS, E, K
from support.exactness import PROMPTS, greedy_ids
from typer.testing import CliRunner

import mlx_tier
from mlx_tier import CheckpointError, TierConfig
from mlx_tier.cli.main import app
from mlx_tier.tools.convert import (
    ConvertConfig,
    convert,
    missing_experts,
    router_agreement,
)

# How each family names expert e's projections in its Hugging Face checkpoint.
MIXTRAL_STYLE = ("block_sparse_moe.switch_mlp", "block_sparse_moe.experts.{e}", {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"})
QWEN_STYLE = ("mlp.switch_mlp", "mlp.experts.{e}", {})
HF_LAYOUT = {
    "mixtral": MIXTRAL_STYLE,
    "phimoe": MIXTRAL_STYLE,
    "qwen2_moe": QWEN_STYLE,
    "qwen3_moe": QWEN_STYLE,
    "olmoe": QWEN_STYLE,
    "deepseek": QWEN_STYLE,
    "deepseek_v2": QWEN_STYLE,
    "deepseek_v3": QWEN_STYLE,
    "glm4_moe": QWEN_STYLE,
}


def write_hf(path, name, tokenizer_dir, drop=None, drop_all=None):
    """A tiny float32 checkpoint in HF naming: experts unstacked, one tensor each."""
    import shutil

    # The real tokenizer's vocabulary, so calibration text maps to valid ids.
    config = {**BASE, "model_type": name, **CONFIGS[name], "torch_dtype": "float32", "vocab_size": 49152}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(5)
    model = module.Model(module.ModelArgs.from_dict(config))
    stacked, per_expert, renames = HF_LAYOUT[name]
    weights = {}
    for k, v in tree_flatten(model.parameters()):
        if f".{stacked}." in k:
            head, tail = k.split(f".{stacked}.")
            proj, param = tail.split(".")
            for e in range(v.shape[0]):
                weights[f"{head}.{per_expert.format(e=e)}.{renames.get(proj, proj)}.{param}"] = v[e]
        else:
            weights[k] = v
    if drop:
        del weights[next(k for k in weights if drop in k)]
    for k in [k for k in weights if drop_all and drop_all in k]:
        del weights[k]
    path.mkdir(parents=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    shutil.copytree(tokenizer_dir, path, dirs_exist_ok=True)
    return path


@pytest.mark.parametrize("name", sorted(HF_LAYOUT))
def test_convert_round_trip(name, tmp_path, tokenizer_dir):
    hf = write_hf(tmp_path / "hf", name, tokenizer_dir)
    out = tmp_path / "out"
    report = convert(hf, out, ConvertConfig(bits=4, group_size=32))
    assert report.experts_per_layer == E and report.moe_layers >= 1
    assert 0.0 <= report.router_agreement <= 1.0 and report.calibration_tokens > 100
    assert (out / "tokenizer.json").exists() and (out / "chat_template.jinja").exists()  # they travel
    ref, _ = load_model(out)
    modules = dict(ref.named_modules())
    routers = [m for p, m in modules.items() if p.endswith((".gate", ".router"))]
    assert routers and all(m.bits >= 8 for m in routers if isinstance(m, nn.QuantizedLinear))
    experts = [m for m in modules.values() if isinstance(m, QuantizedSwitchLinear)]
    assert experts and all(m.bits == 4 for m in experts)
    shared = [m for p, m in modules.items() if "shared_expert" in p and isinstance(m, nn.QuantizedLinear)]
    assert all(m.bits >= 8 for m in shared)
    want = [greedy_ids(ref, p) for p in PROMPTS]
    for slots in (1, K, E):
        model, _ = mlx_tier.load(out, config=TierConfig(slots_per_layer=slots))
        assert [greedy_ids(model, p) for p in PROMPTS] == want, (name, slots)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_router_agreement_of_a_model_with_itself(tmp_path, tokenizer_dir):
    hf = write_hf(tmp_path / "hf", "qwen3_moe", tokenizer_dir)
    assert router_agreement(hf, hf, "The quick brown fox jumps over the lazy dog. " * 5)[0] == 1.0


def test_partial_expert_set_is_refused(tmp_path, tokenizer_dir):
    hf = write_hf(tmp_path / "hf", "qwen3_moe", tokenizer_dir, drop="experts.3.up_proj")
    with pytest.raises(CheckpointError, match="missing expert tensor"):
        convert(hf, tmp_path / "out", ConvertConfig(bits=4, group_size=32))
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # nothing half-written


def test_a_whole_missing_expert_is_named(tmp_path, tokenizer_dir):
    """Every tensor of expert 0 of layer 1 missing: the error names expert 0's tensors
    (not the experts that are there), whole."""
    hf = write_hf(tmp_path / "hf", "qwen3_moe", tokenizer_dir, drop_all="layers.1.mlp.experts.0.")
    with pytest.raises(CheckpointError) as e:
        convert(hf, tmp_path / "out", ConvertConfig(bits=4, group_size=32))
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in str(e.value), e.value
    assert "experts.1." not in str(e.value) and "and 0 more" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_missing_experts_by_name():
    names = [f"m.l.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in ("up", "down")
             if (e, p) != (2, "down")] + ["m.l.1.mlp.experts.1.up.weight", "m.l.0.attn.q.weight"]
    assert missing_experts(names, 4) == ["m.l.0.mlp.experts.2.down.weight", "m.l.1.mlp.experts.0.up.weight",
                                         "m.l.1.mlp.experts.2.up.weight", "m.l.1.mlp.experts.3.up.weight"]
    assert missing_experts(["a.b.weight"], 8) == []



def said(result) -> str:
    """A command's output with its line wrapping undone (where a message wraps depends on
    the lengths of the paths in it)."""
    return " ".join(result.output.split())

def test_cli_convert_errors_and_success(tmp_path, tokenizer_dir):
    runner = CliRunner()
    r = runner.invoke(app, ["convert", str(tmp_path / "nope"), str(tmp_path / "o")])
    assert r.exit_code == 2 and "nope: model folder not found" in said(r)  # neither a folder nor a repo id
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["convert", str(tmp_path / "empty"), str(tmp_path / "o")])
    assert r.exit_code == 2 and "no config.json" in said(r)
    bad = tmp_path / "unknown"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    r = runner.invoke(app, ["convert", str(bad), str(tmp_path / "o")])
    assert r.exit_code == 2 and "not supported by mlx-lm" in said(r)
    hf = write_hf(tmp_path / "hf", "mixtral", tokenizer_dir)
    r = runner.invoke(app, ["convert", str(hf), str(tmp_path / "o"), "--bits", "8", "--group-size", "32"])
    assert r.exit_code == 0, r.output
    assert "router agreement" in said(r), r.output
    r = runner.invoke(app, ["convert", str(hf), str(tmp_path / "o")])
    assert r.exit_code == 2 and "already exists" in said(r)


def test_disk_full_leaves_nothing(tmp_path, tokenizer_dir, monkeypatch):
    import errno

    hf = write_hf(tmp_path / "hf", "mixtral", tokenizer_dir)

    def full_disk(hf_path, mlx_path, **kw):
        os.makedirs(mlx_path)
        open(os.path.join(mlx_path, "model.safetensors"), "wb").write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(importlib.import_module("mlx_lm.convert"), "convert", full_disk)
    r = CliRunner().invoke(app, ["convert", str(hf), str(tmp_path / "out"), "--group-size", "32"])
    assert r.exit_code == 2 and "No space left on device" in r.output
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_convert_mxfp4_experts(tmp_path, tokenizer_dir):
    hf = write_hf(tmp_path / "hf", "qwen3_moe", tokenizer_dir)
    out = tmp_path / "out"
    convert(hf, out, ConvertConfig(bits=4, mode="mxfp4"))
    ref, _ = load_model(out)
    experts = [m for m in dict(ref.named_modules()).values() if isinstance(m, QuantizedSwitchLinear)]
    assert experts and all(m.mode == "mxfp4" for m in experts)
    gates = [m for p, m in ref.named_modules() if p.endswith("mlp.gate")]
    assert gates and all(m.bits == 8 and m.mode == "affine" for m in gates)  # router stays 8-bit affine
    want = [greedy_ids(ref, p) for p in PROMPTS]
    model, _ = mlx_tier.load(out, config=TierConfig(slots_per_layer=1))
    assert [greedy_ids(model, p) for p in PROMPTS] == want
