"""The VNNI row loops: x's digits are exact, the integer dot products join to what the
float32 loops compute within fp32 rounding, and everything else falls back.

The digit decomposition, :func:`cpu_vnni.reference` and the layout rule run on any
CPU; the loops themselves need AVX-512 VNNI or AVX2 (vpdpbusd emulated) and are
skipped elsewhere (the marker says so). Tests taking ``row_loops``
(tests/kernels/conftest.py) run with the float32 loops too, which is what an Arm
CPU computes.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_tier.kernels import cpu as cpu_kernel
from mlx_tier.kernels import cpu_dense, cpu_vnni, simd

needs_vnni = pytest.mark.skipif(
    not simd.AVAILABLE, reason="needs an x86 CPU with AVX-512 VNNI or AVX2 (vpdpbusd, or vpmaddubsw + vpmaddwd)")
REL = 2e-6  # max|Δ| / max|exact| of one matvec, float64 exact reference (float32 loops: ~3e-7)


def awkward_x(rng, R: int, I: int) -> np.ndarray:
    """Rows with outliers (x100), a zero run, tiny and huge values, negatives."""
    x = rng.standard_normal((R, I)) * np.where(rng.random((R, I)) < 0.02, 100.0, 1.0)
    x[0, :8] = 0.0
    x[-1, 8:16] = [1e-30, -3e-38, 5e-20, 0, 1, -1, 2e-30, 7e-31]
    x[-1, 16:24] *= 1e30
    x[-1, 24:32] = [8323071, -8323071, 8323072, 1, -8323071.5, 0.5, 4161535.5, -4161536]  # at LIMB_MAX
    return x.astype(np.float32)


def quantized(S: int, O: int, I: int, gs: int):
    """Random 4-bit affine slots: (w [S, O, I/2] uint8, scales, biases [S, O, G], dequantised float64)."""
    wq, sc, bi = mx.quantize(mx.random.normal((S, O, I), key=mx.random.key(gs)), group_size=gs, bits=4)
    deq = np.asarray(mx.dequantize(wq, sc, bi, group_size=gs, bits=4)).astype(np.float64)
    return np.asarray(wq).view(np.uint8), np.asarray(sc), np.asarray(bi), deq


def test_digits_are_exact_base_256_of_x_at_23_bits():
    x = awkward_x(np.random.default_rng(0), 3, 256)
    xl, ex, xs = cpu_vnni.prepare(x, 64)
    d = xl.astype(np.int64)  # [R, 3, 2, I/2]
    m = (d[:, 0] * 65536 + d[:, 1] * 256 + d[:, 2]).transpose(0, 2, 1).reshape(3, -1)  # back to input order
    e = np.repeat(ex, 8, axis=1).astype(np.float64)  # each input's 2**e
    assert (np.abs(m) <= cpu_vnni.LIMB_MAX).all()
    assert np.array_equal(m, np.rint(x / e))  # the digits hold x / 2**e rounded, nothing lost
    err = np.abs(m * e - x).reshape(3, -1, 8).max(-1)  # per run of 8 inputs
    peak = np.abs(x).reshape(3, -1, 8).max(-1)
    assert (err <= peak / cpu_vnni.LIMB_MAX).all()  # ~23 bits (127 * 2**16) of the run's largest |x|
    assert np.allclose(xs, x.reshape(3, -1, 64).sum(-1, dtype=np.float64), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_reference_is_within_fp32_rounding_of_the_exact_matvec(gs):
    """The decomposition itself (numpy, any CPU) against float64."""
    w, sc, bi, deq = quantized(1, 24, 512, gs)
    x = awkward_x(np.random.default_rng(gs), 1, 512)[0]
    exact = deq[0] @ x.astype(np.float64)
    got = cpu_vnni.reference(w[0], sc[0], bi[0], x, gs)
    assert np.abs(got - exact).max() <= REL * np.abs(exact).max()


@needs_vnni
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("O", [37, 64])  # 37: tail rows after the blocks of four
def test_vnni_rows_match_the_reference_and_the_exact_matvec(gs, O):
    w, sc, bi, deq = quantized(3, O, 768, gs)
    x = awkward_x(np.random.default_rng(O), 2, 768)
    tok, slots = np.array([0, 1, 1, 0], np.int64), np.array([2, 0, 1, 2], np.int64)
    out = np.full((4, O), np.nan, np.float32)
    cpu_vnni.qmv4(gs, w, sc, bi, *cpu_vnni.prepare(x, gs), tok, slots, out, 0, out.size)
    for n, (t, s) in enumerate(zip(tok, slots)):
        exact = deq[s] @ x[t].astype(np.float64)
        assert np.abs(out[n] - exact).max() <= REL * np.abs(exact).max()
        ref = cpu_vnni.reference(w[s], sc[s], bi[s], x[t], gs)
        assert np.abs(out[n] - ref).max() <= 1e-6 * np.abs(ref).max()  # same integer sums, float joins differ


def test_block_equals_mlx_within_the_kernel_bound(row_loops):
    """The whole SwiGLU block at the bench's shapes (D=2048, H=768, 4-bit g64) through
    either row loops: within test_cpu_kernel's BOUND of MLX's block."""
    mx.random.seed(3)
    b = SwitchGLU(2048, 768, 8, bias=False)
    nn.quantize(b, group_size=64, bits=4)
    x, idx = mx.random.normal((2, 2048)), mx.array([[0, 5, 7], [2, 5, 1]], dtype=mx.uint32)
    ref = b(x, idx)
    assert cpu_kernel._Quant(b.gate_proj, stacked=True).vnni == (row_loops == "vnni")
    got = cpu_kernel.expert_forward(b, x, idx)
    assert mx.abs(ref - got).max().item() <= 1e-4 * mx.abs(ref).max().item()


@needs_vnni
def test_vnni_block_is_as_close_to_mlx_as_the_float32_loops(monkeypatch):
    """The VNNI loops lose nothing against the float32 loops: their error against MLX's
    block is within a factor of 4 of the float32 loops' error."""
    mx.random.seed(3)
    b = SwitchGLU(2048, 768, 8, bias=False)
    nn.quantize(b, group_size=64, bits=4)
    x, idx = mx.random.normal((2, 2048)), mx.array([[0, 5, 7], [2, 5, 1]], dtype=mx.uint32)
    ref = b(x, idx)
    got = cpu_kernel.expert_forward(b, x, idx)
    monkeypatch.setattr(cpu_vnni, "ENABLED", False)
    f32 = cpu_kernel.expert_forward(b, x, idx)
    scale = mx.abs(ref).max().item()
    err, err32 = (mx.abs(ref - y).max().item() / scale for y in (got, f32))
    assert err <= 4 * max(err32, 1e-7)


def test_other_layouts_and_shapes_use_the_float32_loops(monkeypatch):
    """The layout rule is the same on every CPU; the loops serve a layout only where the CPU
    has them and they are switched on."""
    assert cpu_vnni.layout_fits(4, 64, 0, 2048)
    assert not cpu_vnni.layout_fits(4, 64, 0, 576)  # rows not a multiple of 128 inputs (the demo's D)
    assert not cpu_vnni.layout_fits(8, 64, 0, 2048) and not cpu_vnni.layout_fits(4, 64, 1, 2048)  # 8-bit, mxfp4
    assert not cpu_vnni.layout_fits(4, 16, 0, 2048)
    monkeypatch.setattr(cpu_vnni, "ENABLED", True)
    assert cpu_vnni.usable(4, 64, 0, 2048) == simd.AVAILABLE  # never on a CPU without VNNI or AVX2
    monkeypatch.setattr(cpu_vnni, "ENABLED", False)
    assert not cpu_vnni.usable(4, 64, 0, 2048)  # MLX_TIER_VNNI=0


@pytest.mark.parametrize("scale", [1e-33, 1e-38])
def test_rows_of_only_tiny_values_take_the_float32_loops(scale):
    """Below 2**-80 a row's 2**e (and scale * 2**e) would leave float32's normal range
    and lose precision: such rows are declined, where a row mixing tiny and normal
    values is not (its tiny runs add nothing that float32 could show)."""
    x = awkward_x(np.random.default_rng(7), 2, 256)
    assert cpu_vnni.prepare(x, 64) is not None
    x[1] = np.random.default_rng(8).standard_normal(256) * scale
    assert cpu_vnni.prepare(x, 64) is None
    assert cpu_vnni.prepare(np.zeros((1, 256), np.float32), 64) is not None  # zeros are exact


def test_dense_quantized_layer_through_either_row_loops(row_loops):
    """A dense 4-bit layer (one always-resident expert, ``stacked=False``) for a decode
    position: within the kernel bound of MLX's op."""
    mx.random.seed(9)
    layer = nn.QuantizedLinear(256, 96, bias=False, group_size=64, bits=4)
    mx.eval(layer.parameters())
    assert cpu_kernel._Quant(layer, stacked=False).vnni == (row_loops == "vnni")
    x = mx.random.normal((1, 1, 256))
    ref = layer(x)
    got = cpu_dense.quantized_matmul(layer, x)
    assert got.shape == ref.shape and mx.abs(got - ref).max().item() <= 1e-5 * mx.abs(ref).max().item()


@needs_vnni
def test_fused_share_with_down_in_another_group_size(monkeypatch):
    """gate/up 4-bit g64, down 4-bit g128: glu_pairs prepares the hidden rows for down's."""
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    mx.random.seed(10)
    b = SwitchGLU(256, 256, 6, bias=False)
    nn.quantize(b, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and {"bits": 4, "group_size": 128 if p == "down_proj" else 64})
    mx.eval(b.parameters())
    x, idx = mx.random.normal((1, 256)), mx.array([[1, 4]], dtype=mx.uint32)
    calls = []
    fused = cpu_vnni.glu_pairs
    monkeypatch.setattr(cpu_vnni, "glu_pairs", lambda *a: calls.append(1) or fused(*a))
    got = cpu_kernel.expert_forward(b, x, idx)
    assert len(calls) == 2
    assert mx.abs(got - b(x, idx)).max().item() <= 1e-4 * mx.abs(got).max().item()


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_input_takes_the_float32_loops(bad, monkeypatch):
    """inf/NaN cannot be written in digits: prepare says so and the block computes through
    the float32 loops, giving what they give (NaN/inf propagated as in MLX)."""
    mx.random.seed(4)
    b = SwitchGLU(256, 128, 4, bias=False)
    nn.quantize(b, group_size=64, bits=4)
    x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
    x[0, 3] = bad
    assert cpu_vnni.prepare(x, 64) is None
    assert cpu_kernel._Quant(b.up_proj, stacked=True).prepare(x)[0] == "f32"
    idx = mx.array([[0, 2]], dtype=mx.uint32)
    got = np.asarray(cpu_kernel.expert_forward(b, mx.array(x), idx))
    monkeypatch.setattr(cpu_vnni, "ENABLED", False)
    want = np.asarray(cpu_kernel.expert_forward(b, mx.array(x), idx))
    assert np.array_equal(got, want, equal_nan=True) and not np.isfinite(got).all()


def glu_block(seed: int = 5):
    mx.random.seed(seed)
    b = SwitchGLU(256, 128, 6, bias=False)
    nn.quantize(b, group_size=64, bits=4)
    mx.eval(b.parameters())
    return b


@needs_vnni
@pytest.mark.parametrize("T, k", [(1, 2), (1, 4), (2, 3)])
def test_fused_share_equals_the_per_projection_path_to_fp32_rounding(T, k, monkeypatch):
    """Each thread's share as one GIL-free call (glu_pairs) against the same block through
    the per-projection path: the same integer sums; only the SwiGLU's exp differs."""
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    b = glu_block()
    x = mx.random.normal((T, 256))
    idx = mx.array(np.random.default_rng(T * k).choice(6, (T, k)).astype(np.uint32))
    calls = []
    fused = cpu_vnni.glu_pairs
    monkeypatch.setattr(cpu_vnni, "glu_pairs", lambda *a: calls.append(1) or fused(*a))
    got = cpu_kernel.expert_forward(b, x, idx)
    assert len(calls) == 2  # one call per thread's share
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    want = cpu_kernel.expert_forward(b, x, idx)
    assert mx.abs(got - want).max().item() <= 1e-6 * mx.abs(want).max().item()
    assert mx.abs(got - b(x, idx)).max().item() <= 1e-4 * mx.abs(want).max().item()


@needs_vnni
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the float32 path's sums of inf
def test_fused_share_hands_overflowing_hidden_rows_to_the_float32_loops(monkeypatch):
    """Finite x whose hidden rows overflow (h = inf): glu_pairs declines, and the share is
    computed as the per-projection path computes it."""
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    b = glu_block()
    x, idx = mx.random.normal((1, 256)) * 1e20, mx.array([[0, 3]], dtype=mx.uint32)
    got = np.asarray(cpu_kernel.expert_forward(b, x, idx))
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    want = np.asarray(cpu_kernel.expert_forward(b, x, idx))
    assert not np.isfinite(want).all() and np.array_equal(got, want, equal_nan=True)


@pytest.mark.parametrize("name, gs", [("mixtral", 64), ("qwen3_moe", 128), ("gpt_oss", 32)])
def test_whole_models_through_either_row_loops_keep_mlx_lms_greedy_tokens(name, gs, row_loops, tmp_path,
                                                                         tokenizer_dir, monkeypatch):
    """Invariant 1 on own kernels with the VNNI loops, or the float32 loops an Arm CPU
    runs, doing the experts' matvecs (dims of 128, so every projection would qualify for
    VNNI): logits within BOUND of mlx-lm's, greedy tokens equal, at 1, top-k and E slots.
    gpt_oss: per-expert biases and its own activation."""
    import importlib

    from mlx_lm.models.switch_layers import SwitchLinear
    from support.arch_configs import BASE, CONFIGS, E, K
    from support.checkpoints import write_checkpoint
    from support.exactness import assert_cpu_kernel_agrees

    wide = {"hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 128, "head_dim": 32}
    config = {**BASE, "model_type": name, **CONFIGS[name], **wide}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(6)
    model = module.Model(module.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=gs, bits=4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    path = write_checkpoint(tmp_path / "q4", model, {**config, "quantization": {"group_size": gs, "bits": 4}},
                            tokenizer_dir)
    calls = []
    for fn in ("qmv4", "glu_pairs"):
        real = getattr(cpu_vnni, fn)
        monkeypatch.setattr(cpu_vnni, fn, lambda *a, real=real, fn=fn: calls.append(fn) or real(*a))
    assert_cpu_kernel_agrees(path, (1, K, E))
    assert bool(calls) == (row_loops == "vnni")  # the VNNI loops computed experts, or never ran


@needs_vnni
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("O", [37, 64])  # 37: tail rows after the blocks of four
def test_pairs_sharing_a_slot_equal_each_pair_alone_bit_for_bit(gs, O):
    """Two pairs of one slot take the GEMM-shaped step (weights unpacked once for both
    tokens); a pair alone, or cut by a thread's share, takes the one-token rows. The
    same sums in the same order: bit-equal outputs, wherever the shares are cut."""
    w, sc, bi, _ = quantized(3, O, 768, gs)
    x = awkward_x(np.random.default_rng(O + gs), 5, 768)
    prep = cpu_vnni.prepare(x, gs)
    tok = np.array([3, 0, 1, 4, 2, 0, 4], np.int64)
    slots = np.array([1, 1, 1, 0, 0, 2, 2], np.int64)  # runs of 3, 2 and 2 pairs
    alone = np.empty((len(tok), O), np.float32)
    for n in range(len(tok)):
        cpu_vnni.qmv4(gs, w, sc, bi, *prep, tok[n:n + 1], slots[n:n + 1], alone[n:n + 1], 0, O)
    N = len(tok) * O
    for cuts in ([0, N], [0, O + 5, N], [0, 2 * O, 3 * O - 1, N], [0, 1, 4 * O, N - 3, N]):
        out = np.full((len(tok), O), np.nan, np.float32)
        for f0, f1 in zip(cuts[:-1], cuts[1:]):
            cpu_vnni.qmv4(gs, w, sc, bi, *prep, tok, slots, out, f0, f1)
        assert np.array_equal(out, alone), cuts


def test_the_integer_loops_run_natively_or_emulated_never_both():
    """VNNI's vpdpbusd where the CPU has it, else its AVX2 pair where that exists; the
    loops are available exactly when one of them is, and take BLAS from their own row
    count."""
    assert not (simd.NATIVE and simd.EMULATED)
    assert simd.AVAILABLE == (simd.NATIVE or simd.EMULATED)
    assert cpu_kernel.integer_min_rows() == (64 if simd.NATIVE else 16)


def test_no_integer_loops_when_numba_drops_avx(monkeypatch):
    """NUMBA_ENABLE_AVX=0 makes Numba's target drop every avx* feature: LLVM could lower
    neither vpdpbusd nor its AVX2 pair, so the loops must not be offered."""
    from numba import config

    monkeypatch.setattr(config, "ENABLE_AVX", False)
    assert not simd._host_has("avx2", "fma") and not simd._host_has("avx512vnni")
