"""The built-in demo: SmolLM2-135M's real weights as an 8-expert top-2 MoE.

Guards: plain mlx-lm loads it and answers coherently; its experts differ (a
wrong expert changes the logits); the tiered model at 2 slots/layer produces
the same greedy tokens as plain mlx-lm; `mlx-tier run` summarises with it
under a cache smaller than its experts; v2's fitted routers route as fitted;
v1 is kept. Slow: builds the model once (~1.5 min with the router fit), and v1.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm import generate
from mlx_lm import load as mlx_load
from typer.testing import CliRunner

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.cli.main import app
from mlx_tier.tools.demo_model import NUM_EXPERTS, TOP_K

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France? Answer in one sentence."


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def plain(demo_model):
    model, tokenizer = mlx_load(str(demo_model))
    model.set_dtype(mx.float32)  # the tiered model's compute dtype on CPU
    return model, tokenizer


def test_checkpoint_layout(demo_model):
    config = json.loads((demo_model / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert config["num_local_experts"] == NUM_EXPERTS >= 8 and config["num_experts_per_tok"] == TOP_K == 2
    assert (demo_model / "tokenizer.json").exists() and (demo_model / "chat_template.jinja").exists()
    assert not [p for p in demo_model.parent.iterdir() if p.name.startswith(".")]  # no half-built dirs


def test_plain_mlx_lm_answers_coherently(plain):
    model, tokenizer = plain
    answer = generate(model, tokenizer, chat(tokenizer, QUESTION), max_tokens=20, verbose=False)
    assert "Paris" in answer


def test_experts_differ(plain):
    model, tokenizer = plain
    x = mx.array(chat(tokenizer, QUESTION))[None]
    before = model(x)
    proj = model.layers[3].block_sparse_moe.switch_mlp.up_proj
    w = proj.weight
    proj.weight = mx.concatenate([w[1:2], w[0:1], w[2:]])  # swap experts 0 and 1 in one layer
    after = model(x)
    proj.weight = w
    assert mx.abs(before - after).max().item() > 1e-2


def test_tiered_two_slots_equals_plain(plain, demo_model):
    model, tokenizer = plain
    prompt = chat(tokenizer, "Name three colours of the rainbow.")
    ref = generate(model, tokenizer, prompt, max_tokens=16, verbose=False)
    tiered, tok = mlx_tier.load(demo_model, config=TierConfig(slots_per_layer=2))
    assert generate(tiered, tok, prompt, max_tokens=16, verbose=False) == ref
    assert tiered.expert_cache.stats.evictions > 0


def test_run_with_demo_model_and_small_cache(tmp_path, demo_model):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "bees.txt").write_text(
        "Honey bees live in colonies with one queen, thousands of female workers and a few male drones. "
        "Workers collect nectar and pollen, and in doing so they pollinate many crops."
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", str(docs), "--out", str(out), "--cache-gb", "0.1", "--max-tokens", "24"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["slots_per_layer"] < report["experts_per_layer"]
    summary = (out / "bees.md").read_text()
    assert len(summary.split()) >= 5


def test_demo_build_reports_every_few_layers_not_each_one():
    from mlx_tier.tools.demo_model import _report_due

    assert [n for n in range(1, 31) if _report_due(n, 30)] == [5, 10, 15, 20, 25, 30]
    assert [n for n in range(1, 33) if _report_due(n, 32)][-2:] == [30, 32]  # the last layer always


def test_default_demo_routes_like_a_trained_moe_on_its_calibration_text(demo_model):
    # v2: routers fitted so consecutive tokens share an expert as often as in Mixtral 8x7B
    # (Table 5 of arXiv 2401.04088, interpolated over depth), with near-uniform use.
    import numpy as np

    from mlx_tier.routing.stats import membership, popularity
    from mlx_tier.tools.demo_model import DEMO_VERSION, demo_name
    from mlx_tier.tools.demo_router import (
        mixtral_overlap_targets,
        moe_inputs,
        overlap_any,
        top_k,
    )

    assert DEMO_VERSION == 2 and demo_model.name == demo_name() == "smollm2-135m-moe-8x-top2-v2"
    demo = json.loads((demo_model / "config.json").read_text())["mlx_tier_demo"]
    fit = demo["router_fit"]
    assert demo["routers"] == "fitted" and fit["calibration_tokens"] > 200
    assert fit["target_overlap_any"] == [round(t, 4) for t in mixtral_overlap_targets(30)]
    assert all(abs(got - want) < 0.02 for got, want in zip(fit["overlap_any"], fit["target_overlap_any"], strict=True))
    # What the built model does (its float16 gates, on its own MoE inputs, which the refit changed):
    gates = mx.load(str(demo_model / "model.safetensors"))
    for i, h in enumerate(moe_inputs(demo_model)):
        w = np.array(gates[f"model.layers.{i}.block_sparse_moe.gate.weight"].astype(mx.float32))
        ids = top_k(h @ w.T, TOP_K)
        # the refit moves later layers' inputs: measured within -3.7/+5.9 pp of the targets
        assert abs(overlap_any(ids, NUM_EXPERTS) - fit["target_overlap_any"][i]) < 0.08, i
        assert popularity(membership(ids, NUM_EXPERTS))[1] < 0.25, i  # uniform: 1/8; v1: ~29% held out


def test_version_one_keeps_the_random_routers_and_the_same_experts(demo_model):
    from mlx_tier.tools.demo_model import ensure_demo_model

    v1 = ensure_demo_model(version=1)
    assert v1.name == "smollm2-135m-moe-8x-top2-v1" and v1.parent == demo_model.parent
    assert json.loads((v1 / "config.json").read_text())["mlx_tier_demo"]["routers"] == "random"
    old, new = mx.load(str(v1 / "model.safetensors")), mx.load(str(demo_model / "model.safetensors"))
    assert old.keys() == new.keys()
    gates = {k for k in old if k.endswith("gate.weight")}
    assert len(gates) == 30 and all(not mx.array_equal(old[k], new[k]) for k in gates)
    assert all(mx.array_equal(old[k], new[k]) for k in old.keys() - gates)
    with pytest.raises(ValueError, match="no demo model version 3; versions: 1, 2"):
        ensure_demo_model(version=3)


def test_the_tests_reuse_a_demo_only_when_built_by_this_code(tmp_path):
    """The demo_model fixture copies the user's demo instead of building its own only when
    the recorded build fingerprint is the current code's: a changed build is rebuilt."""
    import json

    from support.demo import users_demo

    from mlx_tier.tools.demo_model import build_fingerprint, demo_name

    folder = tmp_path / demo_name()
    folder.mkdir()
    assert users_demo(tmp_path) is None  # nothing built
    for fingerprint, reused in ((build_fingerprint(), True), ("0123456789abcdef", False), (None, False)):
        (folder / "config.json").write_text(json.dumps({"mlx_tier_demo": {"build": fingerprint}}))
        assert (users_demo(tmp_path) == folder) is reused, fingerprint
