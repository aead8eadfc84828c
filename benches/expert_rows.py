"""The CPU kernel's two expert paths against each other, by rows per expert.

Question: from how many rows (tokens) per expert should a slot be dequantised once
and multiplied with BLAS instead of running the fused matvec per (token, expert)
pair? The answer sets ``GEMM_MIN_ROWS`` / ``VNNI_GEMM_MIN_ROWS`` in
:mod:`mlx_tier.kernels.cpu`, and through them every prompt pool and every
decode pool of the overnight job (a pool of 32 sequences sends ~8 rows to each
of the demo's experts, a 256-token prompt pool ~16 to each of a 128-expert
model's).

For each shape and each kind of 4-bit row loop (VNNI where this CPU has it,
float32), in one process, interleaved rounds: ``expert_forward`` of a SwiGLU
block with every slot forced onto the matvec, every slot forced onto the GEMM,
and the kernel's own choice; microseconds per (token, expert) pair, medians.

    python benches/expert_rows.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import platform

import mlx.core as mx
import numpy as np
from kernel_formats import side_by_side
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_tier.kernels import cpu, cpu_vnni, simd

# (name, D, H, experts, top-k, group size, experts used per call)
SHAPES = [("qwen3-30b-a3b", 2048, 768, 32, 8, 64, 16), ("demo", 576, 1536, 8, 2, 32, 8)]
ROWS = (2, 4, 8, 16, 32, 64, 128)


def shape_rows(D: int, H: int, experts: int, k: int, gs: int, used: int, rows: int, rounds: int) -> dict:
    """Microseconds per (token, expert) pair of a 4-bit SwiGLU block (D wide, H inner, group
    size ``gs``) whose tokens route top-``k`` over ``used`` experts, ``rows`` rows an expert:
    ``{"matvec", "gemm", "kernel"}`` (every slot forced one way, or the kernel's choice)."""
    mx.random.seed(0)
    block = SwitchGLU(D, H, experts, bias=False)
    nn.quantize(block, group_size=gs, bits=4)
    tokens = rows * used // k
    rng = np.random.default_rng(0)
    idx = mx.array(np.stack([rng.permutation(used)[:k] for _ in range(tokens)]).astype(np.uint32))
    x = mx.random.normal((tokens, D))
    mx.eval(block.parameters(), x, idx)
    keep = cpu.GEMM_MIN_ROWS, cpu.VNNI_GEMM_MIN_ROWS, cpu.AVX2_GEMM_MIN_ROWS

    def run(threshold):
        def call():
            cpu.GEMM_MIN_ROWS, cpu.VNNI_GEMM_MIN_ROWS, cpu.AVX2_GEMM_MIN_ROWS = threshold or keep
            try:
                cpu.expert_forward(block, x, idx)
            finally:
                cpu.GEMM_MIN_ROWS, cpu.VNNI_GEMM_MIN_ROWS, cpu.AVX2_GEMM_MIN_ROWS = keep
        return call

    t = side_by_side({"matvec": run((1 << 30,) * 3), "gemm": run((1, 1, 1)), "kernel": run(None)}, rounds)
    return {name: s / (tokens * k) * 1e6 for name, s in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"caliber: {platform.machine()} {os.cpu_count()} cores, kernel threads {cpu.THREADS}, "
          f"load {os.getloadavg()[0]:.2f}, mlx {mx.__version__}, float32, 4-bit, median of {args.rounds} rounds; "
          f"thresholds: float32 loops {cpu.GEMM_MIN_ROWS}, integer loops {cpu.integer_min_rows()} rows "
          f"(integer dot products: {simd.DOT})")
    loops = ["vnni", "float32"] if cpu_vnni.AVAILABLE else ["float32"]
    for loop in loops:
        cpu_vnni.ENABLED = loop == "vnni"
        for name, D, H, experts, k, gs, used in SHAPES:
            print(f"\n{name} (D={D}, H={H}, top-{k} of {used} experts, g{gs}), {loop} loops: us per pair")
            print(f"{'rows/expert':>11} {'matvec':>8} {'gemm':>8} {'kernel':>8}  gemm/matvec")
            for rows in ROWS:
                r = shape_rows(D, H, experts, k, gs, used, rows, args.rounds)
                print(f"{rows:11d} {r['matvec']:8.1f} {r['gemm']:8.1f} {r['kernel']:8.1f}  {r['gemm'] / r['matvec']:6.2f}")
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
