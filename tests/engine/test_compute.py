"""What will compute a tiered model, known before it loads (mlx_tier.engine.compute)."""

import json

import mlx.core as mx
import pytest

from mlx_tier.engine.compute import (
    compute_fields,
    cpu_kernel_lacks,
    dtype_name,
    planned_compute,
)
from mlx_tier.kernels import cpu
from mlx_tier.kernels.warmup import SUPPORTED_MODES

on_cpu = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="resolves `auto` as MLX's CPU backend does")


def _model(tmp_path, quantization):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", **quantization}))
    return tmp_path


def test_the_modes_the_warmup_compiles_are_the_kernels():
    assert set(SUPPORTED_MODES) == set(cpu.MODES)


def test_a_mode_the_cpu_kernel_lacks_is_seen_in_config_json(tmp_path):
    affine = {"quantization": {"group_size": 64, "bits": 4}}
    assert not cpu_kernel_lacks(_model(tmp_path / "a", affine))
    assert cpu_kernel_lacks(_model(tmp_path / "b", {"quantization": {"group_size": 32, "bits": 8, "mode": "mxfp8"}}))
    # mlx-lm's mixed quantization: one module's own mode
    mixed = {"quantization": {"group_size": 64, "bits": 4, "model.layers.0.mlp": {"bits": 4, "mode": "nvfp4"}}}
    assert cpu_kernel_lacks(_model(tmp_path / "c", mixed))
    assert not cpu_kernel_lacks(_model(tmp_path / "d", {}))  # unquantized: float experts
    assert not cpu_kernel_lacks(tmp_path / "none") and not cpu_kernel_lacks(None)  # the load says what is wrong
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text("{not json")
    assert not cpu_kernel_lacks(tmp_path / "e")


@on_cpu
def test_planned_compute_follows_the_loads_choice(tmp_path):
    affine = _model(tmp_path / "a", {"quantization": {"group_size": 64, "bits": 4}})
    fp8 = _model(tmp_path / "b", {"quantization": {"group_size": 32, "bits": 8, "mode": "mxfp8"}})
    assert planned_compute("auto", mx.float32, None, affine) == {"kernel": "cpu", "dtype": "float32"}
    assert planned_compute("auto", mx.float32, None, fp8) == {"kernel": "mlx", "dtype": "float32"}
    assert planned_compute("mlx", None, None, affine) == {"kernel": "mlx", "dtype": "as stored"}
    assert planned_compute(None, None, None, affine) == {"kernel": "mlx", "dtype": "as stored"}  # load()'s own
    # the CPU kernel computes in float32 on the CPU backend, whatever was asked
    assert planned_compute("cpu", None, None, affine) == {"kernel": "cpu", "dtype": "float32"}
    # a warm tier (host_cache_gb): `auto` is the CPU kernel's wherever it can serve
    assert planned_compute("auto", None, 1.0, affine)["kernel"] == "cpu"
    with pytest.raises(ValueError, match="kernel must be one of"):
        planned_compute("gpu", None, None, affine)


def test_compute_fields_name_the_cast():
    assert compute_fields("cpu", mx.float32) == {"kernel": "cpu", "dtype": "float32"}
    assert compute_fields("mlx", None) == {"kernel": "mlx", "dtype": "as stored"}
    assert compute_fields("mlx", "bfloat16") == {"kernel": "mlx", "dtype": "bfloat16"}
    assert dtype_name(mx.bfloat16) == "bfloat16"


@on_cpu
def test_a_mode_on_a_layer_that_is_no_experts_leaves_the_cpu_kernel_as_the_load_does(tmp_path, monkeypatch):
    """A review: `config.json` naming mxfp8 for one attention projection (the experts affine 4-bit)
    was planned as MLX's kernel while the load, which looks at the expert blocks, chose the CPU
    kernel: every rerun would have said "written with another --kernel". Where config.json names
    such a mode, the expert blocks decide, opened lazily as the load opens them."""
    from types import SimpleNamespace

    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    import mlx_tier.engine.checkpoint as checkpoint
    from mlx_tier.kernels.registry import choose

    mixed = _model(tmp_path / "m", {"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                                                     "model.layers.0.self_attn.q_proj": {"bits": 8, "mode": "mxfp8"}}})
    affine = SwitchGLU(128, 256, 4)
    nn.quantize(affine, group_size=64, bits=4)
    fp8 = SwitchGLU(128, 256, 4)
    nn.quantize(fp8, group_size=32, bits=8, mode="mxfp8")
    for block in (affine, fp8):
        monkeypatch.setattr(checkpoint, "open_checkpoint", lambda path, b=block: SimpleNamespace(blocks=[("e", b)]))
        assert planned_compute("auto", mx.float32, None, mixed)["kernel"] == choose("auto", [block], False)
    assert choose("auto", [affine], False) == "cpu" and choose("auto", [fp8], False) == "mlx"
