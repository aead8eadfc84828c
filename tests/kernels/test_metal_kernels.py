"""The Metal kernel bodies compute what their plain-MLX references compute.

Each ``mlx_tier/kernels/msl/*.metal`` body is compiled unchanged with g++ through
``tests/metal_shim.h`` (threads of a threadgroup run as lockstep fibers;
simdgroup reductions are exchanged between barriers) and run over the grid
its host code launches; outputs must equal the references in
``mlx_tier.kernels.metal`` to fp32 accumulation error, for every affine width
(2, 3, 4, 5, 6, 8 bits) and group size (32, 64, 128). The whole block (two
dispatches plus glue) is compared with mlx-lm's own ``SwitchGLU``/``SwitchMLP``.
Tests marked ``metal`` run the real kernels on a Mac and are skipped elsewhere.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP
from support.metal_harness import Harness, gxx_missing

from mlx_tier.kernels import metal as mk

pytestmark = pytest.mark.skipif(gxx_missing(), reason="g++ not found: cannot compile the Metal bodies on the CPU")

COMBOS = list(itertools.product(mk.SUPPORTED_BITS, mk.SUPPORTED_GROUPS))
T, K, S = 2, 2, 3
# Bound on |kernel - reference| relative to max(1, max |reference|): fp32 sums
# of a few hundred terms in a different order; float16 outputs add their rounding.
REL = {mx.float32: 2e-4, mx.float16: 2e-3, mx.bfloat16: 1e-2}
HALF_BITS = (3, 4, 8)


def _templates():
    gu = [[("BITS", b), ("GS", g), ("GLU", glu)] for b, g in COMBOS for glu in (0, 1)]
    dn = [[("T", mx.float32), ("BITS", b), ("GS", g), ("COMBINE", c)] for b, g in COMBOS for c in (0, 1)]
    dn += [[("T", mx.float16), ("BITS", b), ("GS", 64), ("COMBINE", 0)] for b in HALF_BITS]
    return {mk.GATE_UP.name: gu, mk.DOWN.name: dn, mk.REMAP.name: [[]]}


@pytest.fixture(scope="module")
def harness(request, tmp_path_factory):
    """Libraries cached across runs in pytest's cache folder (rebuilt when a source changes)."""
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("metal_harness") if cache is not None else tmp_path_factory.mktemp("metal_harness")
    return Harness(where, _templates())


def _quant(shape, bits, gs, seed) -> mk.QuantWeights:
    w = mx.random.normal(shape, key=mx.random.key(seed)) * 0.1
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return mk.QuantWeights(q, s, b, gs, bits)


def _close(got: mx.array, want: mx.array, dtype=mx.float32) -> None:
    got, want = np.array(got.astype(mx.float32), np.float64), np.array(want.astype(mx.float32), np.float64)
    assert got.shape == want.shape
    bound = REL[dtype] * max(1.0, np.abs(want).max())
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)


def _case(bits, gs, D=128, H=128, seed=0):
    x = mx.random.normal((T, D), key=mx.random.key(seed))
    slots = mx.array([[2, 0], [1, mk.NOT_RESIDENT]], dtype=mx.uint32)  # one pair not resident
    gate, up = _quant((S, H, D), bits, gs, seed + 1), _quant((S, H, D), bits, gs, seed + 2)
    dn = _quant((S, D, H), bits, gs, seed + 3)
    return x, slots, gate, up, dn


@pytest.mark.parametrize("bits,gs", COMBOS)
def test_gate_up_body_matches_reference(harness, bits, gs):
    x, slots, gate, up, _ = _case(bits, gs)
    for u in (up, None):  # SwiGLU fused, and one projection alone
        got = mk.gate_up(x, slots, gate, u, harness.launcher)
        want = mk.gate_up_reference(x, slots, gate, u)
        _close(got, want)
    assert float(mx.abs(got[3]).max()) == 0.0  # the pair with no slot gives zeros
    assert float(mx.abs(got[:3]).min(axis=1).max()) > 0.0


@pytest.mark.parametrize("bits,gs", COMBOS)
def test_down_body_matches_reference(harness, bits, gs):
    x, slots, gate, up, dn = _case(bits, gs)
    h = mk.gate_up_reference(x, slots, gate, up)
    scores = mx.array([[0.7, 0.3], [0.25, 0.75]])
    _close(mk.down(h, slots, dn, mx.float32, None, harness.launcher), mk.down_reference(h, slots, dn, mx.float32))
    _close(mk.down(h, slots, dn, mx.float32, scores, harness.launcher),
           mk.down_reference(h, slots, dn, mx.float32, scores))


def test_bodies_with_several_steps_per_lane(harness):
    """Wider rows than one pass of 32 lanes x 8 values, several groups each."""
    x, slots, gate, up, dn = _case(4, 64, D=512, H=256, seed=7)
    h = mk.gate_up(x, slots, gate, up, harness.launcher)
    _close(h, mk.gate_up_reference(x, slots, gate, up))
    _close(mk.down(h, slots, dn, mx.float32, None, harness.launcher), mk.down_reference(h, slots, dn, mx.float32))


@pytest.mark.parametrize("bits", HALF_BITS)
def test_bodies_with_float16_activations_and_scales(harness, bits):
    """Checkpoints keep fp16 scales on a GPU: x, scales, biases and y in float16."""
    x, slots, gate, up, dn = _case(bits, 64, seed=bits)
    half = [mk.QuantWeights(q.w, q.scales.astype(mx.float16), q.biases.astype(mx.float16), 64, bits)
            for q in (gate, up, dn)]
    x16 = x.astype(mx.float16)
    h = mk.gate_up(x16, slots, half[0], half[1], harness.launcher)
    _close(h, mk.gate_up_reference(x16, slots, half[0], half[1]))
    y = mk.down(h, slots, half[2], mx.float16, None, harness.launcher)
    assert y.dtype == mx.float16
    _close(y, mk.down_reference(h, slots, half[2], mx.float16), mx.float16)


def test_dequantisation_convention_matches_mlx(harness):
    """Kernel of one weight row against x = one-hot: recovers mx.dequantize's values."""
    for bits in mk.SUPPORTED_BITS:
        q = _quant((1, 32, 64), bits, 32, seed=bits)
        x = mx.eye(64)[:8]  # [8, 64]: picks the first 8 columns
        got = mk.gate_up(x, mx.zeros((8, 1), mx.uint32), q, None, harness.launcher)  # [8, 32]
        want = mx.dequantize(q.w[0], q.scales[0], q.biases[0], group_size=32, bits=bits)[:, :8].T
        _close(got, want)


@pytest.mark.parametrize("n,E", [(4, 8), (16, 128), (64, 32)])
def test_slot_remap_body_matches_reference(harness, n, E):
    rng = np.random.default_rng(n + E)
    inds = mx.array(rng.integers(0, E, n).astype(np.uint32))
    lut = np.full(E, -1, np.int32)
    resident = rng.choice(E, size=E // 2, replace=False)
    lut[resident] = np.arange(len(resident))
    got = mk.slot_remap(inds, mx.array(lut), harness.launcher)
    want = mk.slot_remap_reference(inds, mx.array(lut))
    for g, w in zip(got, want):
        assert np.array_equal(np.array(g), np.array(w))
    assert int(np.array(got[1]).sum()) == n
    missing = np.array(inds)[lut[np.array(inds)] < 0]
    assert np.all(np.array(got[0])[lut[np.array(inds)] < 0] == mk.NOT_RESIDENT) or missing.size == 0


class GeluGate(nn.Module):
    def __call__(self, x, gate):
        return nn.gelu(gate) * x


def _block(kind: str, bits: int, gs: int, bias: bool = False):
    D, H, E = 128, 128, 4
    mx.random.seed(bits * 1000 + gs)
    if kind == "glu":
        block = SwitchGLU(D, H, E, bias=bias)
    elif kind == "glu-gelu":  # a SwitchGLU whose activation is not mlx-lm's SwiGLU
        block = SwitchGLU(D, H, E, activation=GeluGate(), bias=bias)
    else:
        block = SwitchMLP(D, H, E, bias=bias)
    if bias:
        for name, p in nn.utils.tree_flatten(block.parameters()):
            if name.endswith("bias"):
                block.update(nn.utils.tree_unflatten([(name, mx.random.normal(p.shape) * 0.1)]))
    nn.quantize(block, group_size=gs, bits=bits)
    return block


@pytest.mark.parametrize("kind,bits,gs,bias", [("glu", 4, 64, False), ("glu", 3, 32, False), ("glu", 8, 128, True),
                                               ("glu-gelu", 5, 64, False), ("mlp", 4, 32, False),
                                               ("mlp", 6, 64, True)])
def test_block_matches_mlx_lm(harness, kind, bits, gs, bias):
    """metal_expert_forward through the emulated kernels == mlx-lm's block."""
    block = _block(kind, bits, gs, bias)
    x = mx.random.normal((1, 3, 128), key=mx.random.key(5))
    slots = mx.array([[[0, 3], [2, 1], [3, 3]]], dtype=mx.uint32)  # [1, 3, k=2]
    want = block(x, slots)
    launches = []

    def counting(spec, inputs, template, *rest):
        launches.append(dict(template).get("GLU"))
        return harness.launcher(spec, inputs, template, *rest)

    got = mk.metal_expert_forward(block, x, slots, counting)
    fused = kind == "glu" and not bias  # SwiGLU in the gate_up dispatch
    assert launches == ([1, None] if fused else [0, None] if kind == "mlp" else [0, 0, None])
    assert got.shape == want.shape == (1, 3, 2, 128)
    _close(got, want)
    scores = mx.softmax(mx.random.normal((1, 3, 2), key=mx.random.key(6)), axis=-1)
    combined = mk.metal_expert_combine(block, x, slots, scores, harness.launcher)
    _close(combined, (want * scores[..., None]).sum(axis=-2))


@pytest.mark.parametrize("kind", ["glu", "mlp"])
def test_block_pair_without_slot_gives_zeros(harness, kind):
    """A slot id >= S (expert not resident) contributes zeros, biases included."""
    block = _block(kind, 4, 32, bias=True)
    x = mx.random.normal((2, 128), key=mx.random.key(9))
    slots = mx.array([[1, mk.NOT_RESIDENT], [2, 0]], dtype=mx.uint32)
    got = mk.metal_expert_forward(block, x, slots, harness.launcher)  # [2, 2, 128]
    assert float(mx.abs(got[0, 1]).max()) == 0.0
    want = block(x, mx.array([[1, 1], [2, 0]], dtype=mx.uint32))
    _close(got[0, 0], want[0, 0])
    _close(got[1], want[1])


def test_prompt_sized_and_float_blocks_use_the_mlx_path():
    """No kernel launch (the launcher would fail) for a prompt or float experts."""

    def refuse(*args):
        raise AssertionError("kernel launched")

    block = _block("glu", 4, 64)
    x = mx.random.normal((40, 128))
    slots = mx.random.randint(0, 4, (40, 2)).astype(mx.uint32)  # 80 pairs >= DECODE_MAX_PAIRS
    assert mx.array_equal(mk.metal_expert_forward(block, x, slots, refuse), block(x, slots))
    dense = SwitchGLU(128, 128, 4)
    assert mx.array_equal(mk.metal_expert_forward(dense, x[:1], slots[:1], refuse), dense(x[:1], slots[:1]))


def test_emulator_barrier_and_simd_ops(harness, tmp_path):
    """The shim's lockstep emulation: a body that reverses a threadgroup's values
    through threadgroup memory is wrong without a working barrier."""
    body = tmp_path / "reverse.metal"
    body.write_text(
        "threadgroup float buf[64];\n"
        "const uint i = thread_index_in_threadgroup;\n"
        "buf[i] = inp[thread_position_in_grid.x];\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "const float r = buf[63 - i];\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
        "out[thread_position_in_grid.x] = r + (simd_sum(1.0f) - 32.0f) * 1000.0f\n"
        "    + simd_max(float(i)) - simd_min(float(i));\n"
    )
    spec = mk.KernelSpec("reverse", "reverse.metal", ("inp",), ("out",))
    x = mx.arange(128, dtype=mx.float32)
    (got,) = harness.run(spec, [x], [], (128, 1, 1), (64, 1, 1), [(128,)], [mx.float32], body_path=body)
    # reversed within each group of 64, plus max - min of each simdgroup's lanes (31)
    want = np.concatenate([np.arange(63, -1, -1), np.arange(127, 63, -1)]) + 31.0
    assert np.array_equal(np.array(got), want)


@pytest.mark.metal
@pytest.mark.skipif(not mk.metal_available(), reason="needs Apple Metal")
@pytest.mark.parametrize("bits,gs", COMBOS)
def test_metal_kernels_match_reference_on_a_mac(bits, gs):
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        x, slots, *qs = _case(bits, gs)
        x = x.astype(dtype)
        gate, up, dn = [mk.QuantWeights(q.w, q.scales.astype(dtype), q.biases.astype(dtype), gs, bits) for q in qs]
        h = mk.gate_up(x, slots, gate, up)
        _close(h, mk.gate_up_reference(x, slots, gate, up))
        _close(mk.down(h, slots, dn, dtype), mk.down_reference(h, slots, dn, dtype), dtype)
    inds, lut = mx.array([3, 1, 3, 0], dtype=mx.uint32), mx.array([1, -1, 2, 0], dtype=mx.int32)
    for g, w in zip(mk.slot_remap(inds, lut), mk.slot_remap_reference(inds, lut)):
        assert mx.array_equal(g, w)


BENCH = Path(__file__).resolve().parents[2] / "benches" / "metal_kernels.py"


@pytest.mark.skipif(mk.metal_available(), reason="Metal is available here")
def test_bench_refuses_without_metal():
    r = subprocess.run([sys.executable, str(BENCH), "--runs", "1"], check=False, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: this bench needs Apple Metal")
    assert r.stdout == ""


@pytest.mark.metal
@pytest.mark.skipif(not mk.metal_available(), reason="needs Apple Metal")
def test_bench_against_gather_qmm_on_a_mac():
    r = subprocess.run([sys.executable, str(BENCH), "--runs", "1", "--iters", "3"], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "caliber:" in r.stdout and r.stdout.count("speed-up") == 3
    assert float(r.stdout.rsplit(":", 1)[1]) < 0.05  # bf16 outputs of the two engines agree
