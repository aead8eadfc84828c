"""The CPU expert kernel computes what MLX computes, to fp32 rounding.

Invariant 1 on own kernels (docs/architecture.md): outputs and logits stay within
``max|Δ| <= BOUND * max|reference|`` of the MLX path, and greedy tokens equal
mlx-lm's, for every expert format (affine 2-8 bits at group sizes 32/64/128,
mxfp4, float experts, per-expert biases), both block kinds (SwitchGLU,
SwitchMLP) and both kernel paths (fused matvec for few rows per expert,
dequantise + BLAS GEMM for many), at 1, top-k and E slots per layer.
"""

import importlib
import itertools
import threading
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear, SwitchMLP
from support.arch_configs import BASE, CONFIGS, E, K
from support.checkpoints import write_checkpoint
from support.exactness import BOUND, assert_cpu_kernel_agrees, close, greedy_ids

import mlx_tier
from mlx_tier import TierConfig
from mlx_tier.kernels import cpu as cpu_kernel
from mlx_tier.kernels import cpu_dense, cpu_vnni, simd
from mlx_tier.kernels import registry as kernels


def block(kind, D=64, H=32, experts=6, bias=True, **quant):
    """A random expert block with nonzero per-expert biases, quantized when ``quant`` is given."""
    mx.random.seed(1)
    b = (SwitchGLU if kind == "glu" else SwitchMLP)(D, H, experts, bias=bias)
    if bias:
        for leaf in b.children().values():
            if isinstance(leaf, SwitchLinear):
                leaf.bias = mx.random.normal(leaf.bias.shape) * 0.1
    if quant:
        nn.quantize(b, **quant)
    mx.eval(b.parameters())
    return b


def check_block(b, T, k=3, D=64, experts=6):
    x = mx.random.normal((T, D))
    idx = mx.random.randint(0, experts, (T, k)).astype(mx.uint32)
    ref = b(x, idx)
    got = cpu_kernel.expert_forward(b, x, idx)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert close(ref, got) <= BOUND


# T=1: decode (fused matvec); T=40 with 3 of 6 experts: ~20 rows per expert (the GEMM
# path on the float32 loops, the matvec on the VNNI loops); T=160: ~80 (GEMM on both).
@pytest.mark.parametrize("T", [1, 40, 160])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_affine_glu_block_matches_mlx(bits, group_size, T, row_loops):
    b = block("glu", D=128, H=128, bits=bits, group_size=group_size)
    check_block(b, T, D=128)


@pytest.mark.parametrize("T", [1, 40])
@pytest.mark.parametrize(
    "kind, quant",
    [("mlp", dict(bits=4, group_size=32)), ("glu", dict(mode="mxfp4", bits=4, group_size=32)),
     ("glu", {}), ("mlp", {})],
    ids=["mlp-q4", "glu-mxfp4", "glu-float", "mlp-float"],
)
def test_other_formats_match_mlx(kind, quant, T):
    check_block(block(kind, **quant), T)


@pytest.mark.parametrize("D, group_size", [(128, 32), (96, 32), (192, 64), (384, 128), (160, 32)],
                         ids=["g32-even", "g32-odd-groups", "g64-odd-groups", "g128-odd-groups", "g32-5-groups"])
def test_4bit_row_loops_match_mlx_and_the_generic_loop(D, group_size):
    """Decode's group-size-specialised 4-bit row loops (an odd group count at g32 takes the
    generic loop): the block matches MLX, and each specialised loop equals the generic one
    to fp32 rounding on the same rows."""
    b = block("glu", D=D, H=max(64, group_size), bits=4, group_size=group_size)
    check_block(b, 1, D=D)
    q = cpu_kernel._Quant(b.gate_proj, stacked=True)
    loop = cpu_kernel._row_loop(4, group_size, 0, D // group_size)
    assert (loop == 0) == (group_size == 32 and (D // group_size) % 2 == 1)
    if not loop:
        return
    x = np.random.default_rng(0).standard_normal((1, D)).astype(np.float32)
    xd, xs = cpu_kernel._deinterleave(x, 4, 0), x.reshape(1, -1, group_size).sum(-1)
    tok, slots = np.zeros(3, np.int64), np.array([0, 4, 2])
    want, got = np.empty((3, q.out_dims), np.float32), np.empty((3, q.out_dims), np.float32)
    cpu_kernel._qmv(q.w, q.scales, q.biases, 4, group_size, 0, xd, xs, tok, slots, want, 0, want.size)
    cpu_kernel._qmv4(loop, q.w, q.scales, q.biases, xd, xs, tok, slots, got, 0, got.size)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("group_size, cuts", [(64, [0, 1, 127, 128, 129, 400, 640]), (32, [0, 37, 256, 383, 640]),
                                               (128, [0, 128, 129, 130, 640])])
def test_4bit_row_loop_shares_cut_anywhere(group_size, cuts, row_loops):
    """A thread's share [f0, f1) of the flat (pair, row) range may start and end inside a
    pair (_parallel cuts by row count): the shares together fill exactly what one call
    over the whole range fills, bit for bit, touching nothing outside their range
    (both row loops; the VNNI one strides its four rows by a quarter of the share)."""
    vnni = row_loops == "vnni"
    b = block("glu", D=256, H=128, bits=4, group_size=group_size)
    q = cpu_kernel._Quant(b.up_proj, stacked=True)  # O=128 rows of I=256 per pair
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    kind, *xp = q.prepare(x)
    assert kind == ("vnni" if vnni else "f32")
    loop = (lambda *a: cpu_vnni.qmv4(group_size, *a)) if vnni else (lambda *a: cpu_kernel._qmv4(group_size, *a))
    tok, slots = np.array([0, 1, 1, 0, 1]), np.array([5, 0, 3, 3, 1])  # 5 pairs, 640 rows
    whole = np.full((5, 128), np.nan, np.float32)
    loop(q.w, q.scales, q.biases, *xp, tok, slots, whole, 0, whole.size)
    shares = np.empty(whole.size, np.float32)
    for f0, f1 in itertools.pairwise(cuts):
        one = np.full((5, 128), np.nan, np.float32)
        loop(q.w, q.scales, q.biases, *xp, tok, slots, one, f0, f1)
        filled = ~np.isnan(one.reshape(-1))
        assert filled[f0:f1].all() and filled.sum() == f1 - f0  # this share's rows, no others
        shares[f0:f1] = one.reshape(-1)[f0:f1]
    assert np.array_equal(shares.reshape(whole.shape), whole) and not np.isnan(whole).any()


@pytest.mark.parametrize("T, k", [(1, 2), (1, 4), (2, 3)])
def test_decode_by_whole_pairs_equals_the_per_projection_path(T, k, row_loops, monkeypatch):
    """Decode of a bias-free 4-bit SwiGLU block with the pairs split evenly among the threads
    runs each pair whole on one thread: bit-equal to the per-projection path (same row
    loops), within the bound of MLX's block. (H=64 keeps down off the VNNI loops, so no
    share is fused: test_cpu_vnni checks the fused share, equal to fp32 rounding.)"""
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    b = block("glu", D=128, H=64, bias=False, bits=4, group_size=32)
    x = mx.random.normal((T, 128))
    idx = mx.array(np.random.default_rng(T * k).choice(6, (T, k)).astype(np.uint32))
    assert cpu_kernel._by_pairs(b, np.asarray(idx).reshape(-1))
    got = cpu_kernel.expert_forward(b, x, idx)
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    assert mx.array_equal(got, cpu_kernel.expert_forward(b, x, idx))
    assert close(b(x, idx), got) <= BOUND


@pytest.mark.parametrize("by_pairs", [True, False], ids=["by-pairs", "per-projection"])
@pytest.mark.parametrize("up_quant", [{"bits": 4, "group_size": 32}, {"bits": 8, "group_size": 64}], ids=["up-g32", "up-8bit"])
def test_gate_and_up_of_different_layouts(up_quant, by_pairs, monkeypatch):
    """Gate and up share their prepared input only when their layouts match: a block whose
    up projection is quantized otherwise than gate (4-bit g64) still matches MLX's, on
    both decode paths."""
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    mx.random.seed(1)
    b = SwitchGLU(128, 128, 6, bias=False)
    nn.quantize(b, class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and (up_quant if p == "up_proj" else {"bits": 4, "group_size": 64}))
    mx.eval(b.parameters())
    x, idx = mx.random.normal((1, 128)), mx.array([[0, 3]], dtype=mx.uint32)
    if not by_pairs:
        monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    assert cpu_kernel._by_pairs(b, np.array([0, 3])) == by_pairs
    assert close(b(x, idx), cpu_kernel.expert_forward(b, x, idx)) <= BOUND


def test_decode_by_whole_pairs_only_where_it_fits(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    plain, biased = block("glu", bias=False, bits=4, group_size=32), block("glu", bias=True, bits=4, group_size=32)
    assert cpu_kernel._by_pairs(plain, np.array([0, 3]))
    assert not cpu_kernel._by_pairs(plain, np.array([0, 3, 5]))  # 3 pairs on 2 threads: rows instead
    assert not cpu_kernel._by_pairs(biased, np.array([0, 3]))  # up/gate biases come before the activation
    assert not cpu_kernel._by_pairs(plain, np.zeros(8, np.int64))  # 8 rows of one expert: the GEMM path
    assert not cpu_kernel._by_pairs(block("mlp", bias=False, bits=4, group_size=32), np.array([0, 3]))


def test_qwen3_30b_expert_shape_one_token():
    """The bench's shapes (Qwen3-30B-A3B): 4-bit g64, D=2048, H=768, k=8, one token."""
    b = block("glu", D=2048, H=768, experts=8, bias=False, bits=4, group_size=64)
    check_block(b, 1, k=8, D=2048, experts=8)


def test_bfloat16_slabs_compute_in_float32():
    b = block("glu", bits=4, group_size=32)
    b.set_dtype(mx.bfloat16)
    x = mx.random.normal((2, 64)).astype(mx.bfloat16)
    idx = mx.array([[0, 5, 2], [1, 1, 3]], dtype=mx.uint32)
    got = cpu_kernel.expert_forward(b, x, idx)
    assert got.dtype == mx.bfloat16
    b.set_dtype(mx.float32)  # the same (bf16-representable) values, computed in float32
    assert close(b(x.astype(mx.float32), idx), got) <= 2**-7  # only the bf16 rounding of the output


@pytest.mark.parametrize("mode, bits, group_size", [("affine", 4, 32), ("affine", 8, 64), ("mxfp4", 4, 32)])
@pytest.mark.parametrize("T", [1, 12])
def test_dense_quantized_layers_served(mode, bits, group_size, T):
    mx.random.seed(2)
    lin = nn.QuantizedLinear(128, 96, bias=True, group_size=group_size, bits=bits, mode=mode)
    lin.bias = mx.random.normal((96,))
    emb = nn.QuantizedEmbedding(96, 128, group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((2, T, 128))
    want = lin(x), emb.as_linear(x), emb(mx.array([3, 7]))
    model = nn.Sequential(lin, emb)
    keys = [k for k, _ in nn.utils.tree_flatten(model.parameters())]
    assert cpu_dense.serve_dense(model) == 2
    assert isinstance(lin, cpu_dense.CpuQuantizedLinear)
    assert [k for k, _ in nn.utils.tree_flatten(model.parameters())] == keys
    got = lin(x), emb.as_linear(x), emb(mx.array([3, 7]))
    assert close(want[0], got[0]) <= BOUND and close(want[1], got[1]) <= BOUND
    assert mx.array_equal(want[2], got[2])  # lookups stay MLX's


@pytest.mark.parametrize("tied", [True, False], ids=["tied-embedding", "lm_head"])
def test_output_layer_leaves_prompt_positions_to_mlx(tied, monkeypatch):
    """The output layer computes one position per sequence (decode, a batch of 3) with the
    kernel and a prompt's positions with MLX's lazy op (mlx-lm never evaluates prefill
    logits, so they cost nothing); other dense layers use the kernel for both."""
    mx.random.seed(5)
    model = nn.Module()
    model.embed = nn.QuantizedEmbedding(96, 128, group_size=32, bits=8)
    model.lm_head = nn.QuantizedLinear(128, 96, bias=False, group_size=64, bits=4)
    model.q_proj = nn.QuantizedLinear(128, 96, bias=False, group_size=64, bits=4)
    out = (lambda x: model.embed.as_linear(x)) if tied else (lambda x: model.lm_head(x))
    prompt, step = mx.random.normal((3, 7, 128)), mx.random.normal((3, 1, 128))
    want = out(prompt), out(step), model.q_proj(prompt)
    assert cpu_dense.serve_dense(model) == 3
    assert type(model.lm_head) is cpu_dense.CpuOutputLinear
    assert type(model.q_proj) is cpu_dense.CpuQuantizedLinear
    calls = []
    kernel = cpu_dense.quantized_matmul
    monkeypatch.setattr(cpu_dense, "quantized_matmul", lambda layer, x: calls.append(x.shape) or kernel(layer, x))
    assert mx.array_equal(out(prompt), want[0]) and calls == []  # MLX's op: bit-equal, no kernel call
    assert close(want[1], out(step)) <= BOUND and calls == [(3, 1, 128)]
    assert close(want[2], model.q_proj(prompt)) <= BOUND and calls[-1] == (3, 7, 128)


@pytest.mark.parametrize("T", [1, 12])
def test_float_linear_layers_served(T, monkeypatch):
    """Float32 ``nn.Linear`` layers (an unquantized router gate) and a tied float
    embedding's output layer go through numpy's matmul, within the kernel bound; the
    output layer leaves a prompt's positions to MLX's lazy op (bit-equal); lookups stay
    MLX's."""
    mx.random.seed(3)
    model = nn.Module()
    model.gate = nn.Linear(128, 16, bias=False)
    model.proj = nn.Linear(128, 96, bias=True)
    model.embed = nn.Embedding(96, 128)
    model.lm_head = nn.Linear(128, 96, bias=False)
    mx.eval(model.parameters())
    x = mx.random.normal((3, T, 128))
    layers = [model.gate, model.proj, model.embed.as_linear, model.lm_head]
    want = [f(x) for f in layers]
    lookup = model.embed(mx.array([3, 7]))
    assert cpu_dense.serve_dense(model) == 4
    assert type(model.gate) is cpu_dense.CpuLinear and type(model.lm_head) is cpu_dense.CpuFloatOutputLinear
    calls = []
    real = cpu_dense.float_matmul
    monkeypatch.setattr(cpu_dense, "float_matmul", lambda layer, x: calls.append(layer) or real(layer, x))
    layers = [model.gate, model.proj, model.embed.as_linear, model.lm_head]
    for i, (f, w) in enumerate(zip(layers, want)):
        got = f(x)
        if i >= 2 and T > 1:  # the output layer over a prompt: MLX's op
            assert mx.array_equal(got, w)
        else:
            assert got.shape == w.shape and close(w, got) <= BOUND
    assert len(calls) == (4 if T == 1 else 2)
    assert mx.array_equal(model.embed(mx.array([3, 7])), lookup)


def test_float_linear_in_bfloat16_keeps_mlx_op():
    """numpy has no bfloat16: a bf16 layer (or input) is MLX's own op, bit-equal."""
    mx.random.seed(4)
    lin = nn.Linear(64, 32)
    lin.set_dtype(mx.bfloat16)
    x = mx.random.normal((2, 5, 64)).astype(mx.bfloat16)
    want = lin(x)
    model = nn.Sequential(lin)
    assert cpu_dense.serve_dense(model) == 1
    assert mx.array_equal(lin(x), want) and lin(x).dtype == mx.bfloat16


def test_a_slot_carrying_most_pairs_is_shared_by_the_threads(monkeypatch, row_loops):
    """Skewed routing (a prompt pool's busiest expert takes every token, the others a
    few): each thread dequantises its share of the busy slot's output rows, so neither
    idles while the other computes it; the block stays within the bound."""
    b = block("glu", D=128, H=128, experts=4, bias=False, bits=4, group_size=64)
    monkeypatch.setattr(cpu_kernel, "THREADS", 2)
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    shares = []
    real = cpu_kernel._Quant.dense
    monkeypatch.setattr(cpu_kernel._Quant, "dense",
                        lambda q, s, o0=0, o1=None: shares.append((s, o0, o1)) or real(q, s, o0, o1))
    T = 160
    x = mx.random.normal((T, 128))
    idx = mx.concatenate([mx.zeros((T, 1), mx.uint32), mx.random.randint(1, 4, (T, 1)).astype(mx.uint32)], axis=1)
    assert close(b(x, idx), cpu_kernel.expert_forward(b, x, idx)) <= BOUND
    busy = [(o0, o1) for s, o0, o1 in shares if s == 0]
    assert busy and set(busy) == {(0, 64), (64, 128)}  # gate, up and down: each half by one thread


def test_wrong_slot_is_detected():
    """The comparison can fail: reading another slot's weights breaks the bound."""
    b = block("glu", bits=4, group_size=32)
    x = mx.random.normal((1, 64))
    idx = mx.array([[0, 1, 2]], dtype=mx.uint32)
    assert close(b(x, idx), cpu_kernel.expert_forward(b, x, idx + 1)) > 0.01


def test_kernel_names():
    assert kernels.kernel_for("mlx") is kernels.kernel_for("mlx")
    assert kernels.kernel_for("cpu") is cpu_kernel.expert_forward
    assert kernels.resolve("auto") == ("cpu" if mx.default_device() == mx.cpu else "mlx")
    with pytest.raises(ValueError, match="kernel must be one of mlx, cpu, metal, auto; got 'gpu'"):
        kernels.kernel_for("gpu")
    with pytest.raises(ValueError, match="kernel must be one of"):
        TierConfig(kernel="fast")


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the refusal without Metal")
def test_metal_kernel_refused_without_metal():
    with pytest.raises(ValueError, match="kernel 'metal' needs Apple Metal"):
        kernels.kernel_for("metal")


# --- tiered models: logits within the bound, greedy tokens equal ---------------------------

# One model per block kind and bias style runs by default; the whole matrix is slow.
DEFAULT_ARCHS = ["mixtral", "gpt_oss", "phixtral", "qwen3_moe"]
ARCHS = [a if a in DEFAULT_ARCHS else pytest.param(a, marks=pytest.mark.slow) for a in sorted(CONFIGS)]





@pytest.mark.parametrize("name", ARCHS)
def test_architecture_matrix_on_cpu_kernel(name, tmp_path, tokenizer_dir):
    """Each mlx-lm MoE type, 4-bit g32 experts at 1, top-k and E slots; float experts at 1 (default subset)."""
    config = {**BASE, "model_type": name, **CONFIGS[name]}
    module = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    fp = write_checkpoint(tmp_path / "fp32", model, config, tokenizer_dir)
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    q4 = write_checkpoint(tmp_path / "q4", model, {**config, "quantization": {"group_size": 32, "bits": 4}},
                          tokenizer_dir)
    assert_cpu_kernel_agrees(q4, (1, K, E))
    if name in DEFAULT_ARCHS:  # float experts: the same SwitchLinear code in every architecture
        assert_cpu_kernel_agrees(fp, (1,))


QUANTS = [dict(mode="affine", bits=b, group_size=g) for b, g in ((2, 64), (3, 32), (5, 64), (6, 64), (8, 32))]


@pytest.mark.parametrize("quant", [*QUANTS, dict(mode="mxfp4", bits=4, group_size=32)],
                         ids=lambda q: f"{q['mode']}{q['bits']}g{q['group_size']}")
def test_expert_formats_on_cpu_kernel(quant, tmp_path, tokenizer_dir):
    config = {**BASE, "model_type": "gpt_oss", **CONFIGS["gpt_oss"]}
    module = importlib.import_module("mlx_lm.models.gpt_oss")
    mx.random.seed(4)
    model = module.Model(module.ModelArgs.from_dict(config))
    nn.quantize(model, **quant, class_predicate=lambda p, m: isinstance(m, SwitchLinear))
    path = write_checkpoint(tmp_path / "ckpt", model, {**config, "quantization": dict(quant)}, tokenizer_dir)
    assert_cpu_kernel_agrees(path, (1, E))


@pytest.mark.slow
def test_demo_model_on_cpu_kernel(demo_model):
    """SmolLM2 demo MoE, dense 4-bit layers served too: logits within the bound, same greedy
    text, against the MLX path in float32 (the CPU kernel's compute dtype; the demo is
    stored in float16, which ``load`` keeps by default)."""
    prompts = ([1, 1812, 314, 253], list(range(100, 140)))  # the long one takes the GEMM path
    ref, _ = mlx_tier.load(demo_model, config=TierConfig(slots_per_layer=8, dtype=mx.float32))
    want_logits = ref(mx.array(prompts[1])[None])
    want = [greedy_ids(ref, p, n=12) for p in prompts]
    for slots in (1, 2, 8):  # 1, top-k, E
        model, _ = mlx_tier.load(demo_model, config=TierConfig(slots_per_layer=slots, kernel="cpu"))
        assert close(want_logits, model(mx.array(prompts[1])[None])) <= BOUND
        assert [greedy_ids(model, p, n=12) for p in prompts] == want


def test_auto_kernel_falls_back_where_the_cpu_kernel_cannot_serve_and_cpu_is_refused():
    """`auto` must never pick the CPU kernel for experts it cannot compute (every
    document would fail mid-job); an explicit `cpu` is one error at load."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_tier.errors import CheckpointError, ConfigError
    from mlx_tier.kernels.registry import choose

    affine, mxfp8 = SwitchGLU(32, 64, 4), SwitchGLU(32, 64, 4)
    nn.quantize(affine, group_size=32, bits=4)
    nn.quantize(mxfp8, group_size=32, bits=8, mode="mxfp8")
    assert choose("auto", [affine]) == "cpu"
    assert choose("auto", [affine, mxfp8]) == "mlx"
    # Two tiers: the name is the warm tier's kernel (computed on the CPU on every backend).
    assert choose("auto", [affine], host_tier=True) == "cpu"
    assert choose("cpu", [affine], host_tier=True) == "cpu"
    assert choose("auto", [mxfp8], host_tier=True) == "mlx"
    with pytest.raises(CheckpointError, match="mxfp8"):
        choose("cpu", [mxfp8])
    with pytest.raises(ConfigError, match="two-tier"):
        choose("metal", [affine], host_tier=True)
    assert choose("mlx", [mxfp8]) == "mlx"


@pytest.mark.parametrize("mode, bits, group_size", [("affine", 2, 64), ("affine", 3, 32), ("affine", 4, 32),
                                                     ("affine", 5, 64), ("affine", 6, 64), ("affine", 8, 32),
                                                     ("affine", 8, 128), ("mxfp4", 4, 32)])
def test_dequantised_rows_equal_mlx_dequantize(mode, bits, group_size):
    """The GEMM path's dequantised weight (:meth:`_Quant.dense`, whole and by row tiles) is
    ``mx.dequantize``'s, in natural column order, for every format the kernel serves
    (4- and 8-bit affine rows have their own loops, the others one loop of 8-code blocks)."""
    mx.random.seed(3)
    lin = nn.QuantizedLinear(256, 40, bias=False, group_size=group_size, bits=bits, mode=mode)
    want = np.asarray(mx.dequantize(lin.weight, lin.scales, lin.get("biases"), group_size=group_size, bits=bits,
                                    mode=mode).astype(mx.float32))
    quant = cpu_kernel._Quant(lin, stacked=False)
    np.testing.assert_allclose(quant.dense(0), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(quant.dense(0, 7, 29), want[7:29], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode, bits, group_size", [("affine", 2, 64), ("affine", 3, 32), ("affine", 5, 64),
                                                     ("affine", 6, 128), ("affine", 8, 32), ("mxfp4", 4, 32)])
def test_row_loops_of_every_format_match_mlx(mode, bits, group_size):
    """The matvec rows (:meth:`_Quant.matvec`) of each format equal ``mx.quantized_matmul``
    within the kernel bound; the 2/3/5/6-bit and mxfp4 ones (blocks of 8 codes) serve the
    few-row slots of a GEMM call, where MLX's op serves calls of few rows."""
    mx.random.seed(5)
    lin = nn.QuantizedLinear(256, 48, bias=False, group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((3, 256))
    want = mx.quantized_matmul(x, lin.weight, lin.scales, lin.get("biases"), transpose=True,
                               group_size=group_size, bits=bits, mode=mode)
    quant = cpu_kernel._Quant(lin, stacked=False)
    got = quant.matvec(np.asarray(x), np.arange(3), np.zeros(3, np.int64))
    assert close(want, mx.array(got)) <= BOUND


@pytest.mark.parametrize("mode, bits", [("affine", 3), ("affine", 6), ("mxfp4", 4), ("affine", 4)])
def test_few_rows_of_formats_without_fast_loops_go_to_mlx(mode, bits, monkeypatch):
    """A decode call (few rows a slot) of a format whose rows MLX computes faster runs
    MLX's op; a prompt-sized call (GEMM) and the 4-bit affine rows stay in the kernel."""
    b = block("glu", D=128, H=64, bits=bits, group_size=32, mode=mode)
    used = []
    real = cpu_kernel.switch_linears
    monkeypatch.setattr(cpu_kernel, "switch_linears", lambda *a: used.append(1) or real(*a))
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    check_block(b, 1, D=128)
    assert bool(used) == ((mode, bits) == ("affine", 4))
    used.clear()
    check_block(b, 64, D=128)
    assert used


@pytest.mark.parametrize("kind", ["expert", "dense"])
def test_the_gemm_path_starts_at_the_layouts_own_row_count(kind, row_loops, monkeypatch):
    """A slot of an expert block (or a dense layer) is dequantised and multiplied with
    BLAS from ``gemm_min_rows`` rows on: 64 where the rows take the VNNI loops (a pair
    there costs less than a share of the expert's dequantisation up to that), 16 where
    those loops run on AVX2, 8 on the float32 loops. Fewer rows take the fused matvec;
    both sides match MLX."""
    integer = cpu_kernel.VNNI_GEMM_MIN_ROWS if simd.NATIVE else cpu_kernel.AVX2_GEMM_MIN_ROWS
    want = integer if row_loops == "vnni" else cpu_kernel.GEMM_MIN_ROWS
    dequantised = []
    real = cpu_kernel._Quant.dense
    monkeypatch.setattr(cpu_kernel._Quant, "dense", lambda q, *a: dequantised.append(1) or real(q, *a))
    if kind == "expert":
        b = block("glu", D=128, H=128, experts=2, bias=False, bits=4, group_size=32)
        assert cpu_kernel._Quant(b.gate_proj, stacked=True).gemm_min_rows == want
        monkeypatch.setattr(cpu_kernel, "THREADS", 2)
        assert cpu_kernel._by_pairs(b, np.zeros(want - 2, np.int64))  # whole pairs below it
        assert not cpu_kernel._by_pairs(b, np.zeros(want, np.int64))
        monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)

        def run(rows):
            x, idx = mx.random.normal((rows, 128)), mx.zeros((rows, 1), mx.uint32)  # every row on slot 0
            assert close(b(x, idx), cpu_kernel.expert_forward(b, x, idx)) <= BOUND
    else:
        lin = nn.QuantizedLinear(128, 96, bias=False, group_size=32, bits=4)
        mx.eval(lin.parameters())
        assert cpu_kernel._Quant(lin, stacked=False).gemm_min_rows == want

        def run(rows):
            x = mx.random.normal((rows, 128))
            assert close(lin(x), cpu_dense.quantized_matmul(lin, x)) <= BOUND
    run(want - 1)
    assert not dequantised  # the matvec
    run(want)
    assert dequantised  # dequantised once, BLAS


def test_matvec_pairs_beside_gemm_slots_are_what_they_are_alone(row_loops, monkeypatch):
    """A call whose busy experts take the GEMM path prepares only the rows its few-row
    experts read for their matvec: each of those pairs equals the same pair computed in
    a call of its own (rows are prepared one by one), and the block stays within the bound."""
    b = block("glu", D=128, H=128, experts=4, bias=False, bits=4, group_size=64)
    monkeypatch.setattr(cpu_kernel, "_by_pairs", lambda *a: False)
    T = 160
    x = mx.random.normal((T, 128))
    idx = mx.concatenate([mx.zeros((T, 1), mx.uint32), mx.full((T, 1), 3, mx.uint32)], axis=1)
    idx[:3, 1] = mx.array([1, 2, 1], dtype=mx.uint32)  # experts 1 and 2: 3 pairs, the matvec path
    prepared = []
    real = cpu_kernel._Quant.prepare
    monkeypatch.setattr(cpu_kernel._Quant, "prepare", lambda q, xs: prepared.append(len(xs)) or real(q, xs))
    got = cpu_kernel.expert_forward(b, x, idx)
    assert prepared and max(prepared) == 3  # the three rows, not the call's 160
    alone = cpu_kernel.expert_forward(b, x[:3], idx[:3, 1:])
    assert mx.array_equal(got[:3, 1], alone[:, 0]).item()
    assert close(b(x, idx), got) <= BOUND


@pytest.mark.parametrize("rows", [1, 3, 700, 2049])
def test_swiglu_shared_among_threads_is_bit_equal_to_the_plain_expression(rows):
    """:func:`cpu._swiglu` (rows split among the pool's threads, computed in place) gives
    the plain ``gate / (1 + exp(-gate)) * up`` bit for bit, overflowing gates (-> -0) and
    products (-> inf) included, with no warning, at row counts one thread takes alone and ones split unevenly."""
    rng = np.random.default_rng(rows)
    gate = (rng.standard_normal((rows, 96)) * 40).astype(np.float32)  # |gate| > 88: exp overflows
    up = rng.standard_normal((rows, 96)).astype(np.float32)
    up[-1, :2], gate[-1, :2] = 3e38, 10.0  # the product overflows (-> inf), silently as before
    with np.errstate(over="ignore"):
        want = gate / (np.float32(1.0) + np.exp(-gate)) * up
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cpu_kernel._swiglu(up, gate)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_a_share_that_shares_again_runs_alone_instead_of_waiting_on_the_pool():
    """A :func:`cpu._parallel` call made from inside a share (a pair's SwiGLU inside a
    decode share) runs on that share's thread, the calling thread's share included: a
    pool thread that waited on the pool would wait on itself when the pool has one
    thread, and the calling thread would wait for the other shares to end. Run in a
    thread with a time limit, so that a regression fails instead of hanging."""
    seen = []

    def inner(a, b):
        seen.append((threading.get_ident(), a, b))

    def outer(a, b):
        cpu_kernel._parallel(inner, 1 << 20, grain=1)

    errors = []

    def top():
        try:
            cpu_kernel._parallel(outer, 1 << 20, grain=1)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    runner = threading.Thread(target=top, daemon=True)
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "a nested _parallel call waited on the pool"
    assert not errors, errors
    # Each share's nested call covered the whole range, on the share's own thread.
    per_thread = {}
    for t, a, b in seen:
        per_thread[t] = per_thread.get(t, 0) + b - a
    assert sorted(per_thread.values()) == [1 << 20] * min(cpu_kernel.THREADS, 1 << 20)
