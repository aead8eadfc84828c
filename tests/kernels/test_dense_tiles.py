"""A dense quantized layer computed by the CPU kernel for several rows (a decode step of a
batch) holds a bounded tile of dequantised weight per thread, never the whole layer: an
output layer of vocab x hidden in float32 was 0.2-1.2 GB per step, enough to push a run
over its memory limit. The result is the same as MLX's own op."""

from __future__ import annotations

import tracemalloc

import mlx.core as mx
import numpy as np
from mlx import nn

from mlx_tier.engine import footprint
from mlx_tier.kernels import cpu, cpu_dense


def test_a_large_output_layer_is_dequantised_in_tiles():
    out_dims, in_dims = 16384, 1024  # float32 whole: 64 MiB
    layer = nn.QuantizedLinear(in_dims, out_dims, bias=False, group_size=64, bits=4)
    layer.set_dtype(mx.float32)
    mx.eval(layer.parameters())
    rows = cpu._Quant(layer, stacked=False).gemm_min_rows  # the fewest that take the GEMM path
    x = mx.random.normal((rows, in_dims))
    want = np.array(nn.QuantizedLinear.__call__(layer, x))
    cpu_dense.quantized_matmul(layer, x)  # first call: the kernel's loops compiled, host copies of scales made
    tracemalloc.start()
    got = np.array(cpu_dense.quantized_matmul(layer, x))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    whole = out_dims * in_dims * 4
    assert peak < cpu.THREADS * cpu_dense.DENSE_TILE_BYTES + 4 * rows * out_dims * 4 + (4 << 20) < whole
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert footprint.DENSE_TILE_BYTES == cpu_dense.DENSE_TILE_BYTES  # the memory split counts the same tile
