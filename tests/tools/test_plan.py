"""`mlx-tier plan`: the worksheet's figures equal the test's own arithmetic."""

import json

import pytest
from support.checkpoints import TINY_MIXTRAL
from typer.testing import CliRunner

from mlx_tier.cli.main import app
from mlx_tier.tools.plan import make_plan, predicted_tok_s


def expected(cfg):
    D, I, E, K, L, V = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_local_experts", "num_experts_per_tok", "num_hidden_layers", "vocab_size"))
    head = D // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    expert = 3 * D * I  # gate, up, down
    attn = 2 * D * D + 2 * D * kv  # q, o, k, v
    per_layer_dense = attn + E * D + 2 * D  # + router + two norms
    dense = L * per_layer_dense + 2 * V * D + D  # + embedding, lm_head, final norm
    return dict(total=dense + L * E * expert, active=dense + L * K * expert, expert=expert, L=L, E=E, K=K)


@pytest.mark.parametrize("which", ["tiny_moe", "tiny_moe_fp"])
def test_plan_matches_arithmetic(which, request):
    path = request.getfixturevalue(which)
    want = expected(TINY_MIXTRAL)
    p = make_plan(path, memory_gb=1.0, context_tokens=1000, disk_gbps=2.0, compute_gbps=1.0)
    assert (p.total_params, p.active_params, p.expert_params) == (want["total"], want["active"], want["expert"])
    assert (p.moe_layers, p.experts_per_layer, p.top_k) == (want["L"], want["E"], want["K"])
    if which == "tiny_moe_fp":  # float32 on disk: 4 bytes a parameter
        assert p.expert_bytes_disk == 4 * want["expert"] == p.expert_bytes_resident
    else:  # 4-bit, group 32, float32 scales and biases
        assert p.expert_bytes_disk == want["expert"] // 2 + 2 * 4 * want["expert"] // 32
    assert p.kv_bytes == 2 * 2 * 2 * 16 * 4 * 1000  # K and V, layers, kv heads, head dim, float32, tokens
    assert p.memory_total == 2**30 and p.slots_per_layer == p.experts_per_layer
    miss0 = p.moe_layers * p.top_k * p.expert_bytes_disk
    active = p.dense_bytes + miss0
    assert p.tok_s_low == pytest.approx(1 / (0 * miss0 / 2e9 + active / 1e9), rel=1e-3)
    assert predicted_tok_s(0.5, miss0, active, 2.0, 1.0) == pytest.approx(1 / (0.5 * miss0 / 2e9 + active / 1e9))


def test_plan_cli_json_and_errors(tiny_moe, tiny_dense, tmp_path):
    r = CliRunner().invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1", "--memory-gb", "0.001"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["total_params"] == expected(TINY_MIXTRAL)["total"] and "active_params" in data
    assert data["slots_per_layer"] == 0 and data["tok_s_high"] == 0.0  # 1 MiB holds no slot row
    r = CliRunner().invoke(app, ["plan", str(tiny_moe), "--disk-gbps", "1", "--compute-gbps", "1"])
    assert r.exit_code == 0 and "active parameters per token" in r.output
    for bad, msg in [(tiny_dense, "not a Mixture-of-Experts"), (tmp_path, "no config.json")]:
        r = CliRunner().invoke(app, ["plan", str(bad)])
        assert r.exit_code == 2 and msg in r.output
    r = CliRunner().invoke(app, ["plan", str(tiny_moe), "--kv-bits", "5"])
    assert r.exit_code == 2 and "--kv-bits must be one of 4, 8" in r.output
    r = CliRunner().invoke(app, ["plan", str(tiny_moe), "--kv-bits", "8"])  # head dim 16: no group of 64
    assert r.exit_code == 2 and "cannot be quantized (--kv-bits)" in r.output, r.output


def test_plan_for_a_quantized_kv_cache(moe_head_dim_64):
    """``--kv-bits``: the KV cache at its stored bytes (8-bit codes and a float32 scale and
    bias per group of 64), in the worksheet and its row."""
    args = dict(memory_gb=1.0, context_tokens=1000, disk_gbps=2.0, compute_gbps=1.0)
    plain, q8 = make_plan(moe_head_dim_64, **args), make_plan(moe_head_dim_64, kv_bits=8, **args)
    assert plain.kv_bytes == 2 * 2 * 1 * 64 * 4 * 1000  # K and V, layers, kv heads, head dim, float32, tokens
    assert q8.kv_bytes == 2 * 2 * 1 * 64 * (1 + 8 / 64) * 1000 and q8.kv_bits == 8
    r = CliRunner().invoke(app, ["plan", str(moe_head_dim_64), "--kv-bits", "8", "--disk-gbps", "1",
                                 "--compute-gbps", "1", "--doc-tokens", "0"])
    assert r.exit_code == 0 and "8-bit" in r.output, r.output


def test_bandwidth_probes_measure_something(tiny_moe_fp):
    from mlx_tier.tools.plan import measure_compute_gbps, measure_disk_gbps

    assert measure_disk_gbps(sorted(tiny_moe_fp.glob("*.safetensors")), total_mb=8) > 0
    assert measure_compute_gbps(out_dim=256, in_dim=256, reps=3) > 0


@pytest.mark.slow
def test_plan_names_the_demo_as_run_does(demo_model):
    """`run` uses the demo by default, so `plan demo` plans it (building it on first use)."""
    r = CliRunner().invoke(app, ["plan", "demo", "--json", "--disk-gbps", "1", "--compute-gbps", "1"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{"):])
    assert data["model"] == str(demo_model) and data["total_params"] > 0


def test_a_folder_called_demo_is_a_path_first(tiny_moe, tmp_path, monkeypatch):
    import shutil

    from mlx_tier.tools.demo_model import is_demo, resolve

    monkeypatch.chdir(tmp_path)
    assert is_demo(None) and is_demo("demo")
    shutil.copytree(tiny_moe, tmp_path / "demo")
    assert not is_demo("demo") and resolve("demo").resolve() == tmp_path / "demo"


def test_a_document_longer_than_the_context_is_planned_over_its_calls(tiny_moe):
    """A user trial: `plan demo --doc-tokens 100000` planned one call of 100,000 tokens (the
    context is 8,192) and printed "0" documents/hour where its JSON said 0.69; `--context 1024
    --doc-tokens 4337` one call too, where the run foresaw 6. Such a document is priced over
    its parts and combining calls, as a run prices it, and a rate below 10 keeps a decimal."""
    from mlx_tier.tools.calls import call_plan
    from mlx_tier.tools.plan import CALL_OVERHEAD
    from mlx_tier.units import rate_text as _rate

    def job(doc, context):
        r = CliRunner().invoke(app, ["plan", str(tiny_moe), "--json", "--disk-gbps", "1", "--compute-gbps", "1",
                                     "--doc-tokens", str(doc), "--summary-tokens", "16", "--context", str(context)])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["job"]

    short, long = job(200, 1024), job(4_000, 1024)
    calls = call_plan(4_000, 1024 - 16, 16, CALL_OVERHEAD, CALL_OVERHEAD)
    assert short["calls"] == 1 and long["calls"] == calls.calls > 2
    assert short["document_tokens"] == 200 and short["prompt_tokens"] == 200 + CALL_OVERHEAD  # the size asked
    assert long["document_tokens"] == 4_000 and long["prompt_tokens"] == calls.part_prompt
    assert long["docs_per_hour"] < short["docs_per_hour"] / 2
    assert (_rate(0.69), _rate(9.96), _rate(123.4)) == ("0.7", "10", "123")
