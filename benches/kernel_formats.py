"""The CPU kernel against MLX's own ops for every quantization format, side by side.

Question: for which formats is the CPU kernel faster than MLX's CPU ops, and
where it is not, does the job still compute at MLX's speed? The job's default
kernel (``auto``) is the CPU kernel on MLX's CPU backend for every format it can
compute, so a format whose rows it computes slowly slows every document.

For each format (affine 2/3/4/5/6/8-bit, mxfp4), in one process, interleaved
rounds (one call of each candidate per round; the median is printed):

- dense: a 1536 x 2048 ``QuantizedLinear`` on one row (a decode step's
  projection): :func:`mlx_tier.kernels.cpu_dense.quantized_matmul` as the job calls it,
  its matvec rows forced (``_Quant.matvec``, what it ran before formats without
  fast loops were routed to MLX), and ``mx.quantized_matmul``;
- experts: a ``SwitchGLU`` of Qwen3-30B-A3B's expert shape (D=2048, H=768,
  32 experts, top-8) at T = 1, 4 and 64 tokens:
  :func:`mlx_tier.kernels.cpu.expert_forward` against the block's own call
  (``gather_qmm``).

    python benches/kernel_formats.py [--rounds 5]

Prints the caliber and the load average beside the figures (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_tier.kernels import cpu, cpu_dense

FORMATS = [("affine", 2, 64), ("affine", 3, 64), ("affine", 4, 64), ("affine", 5, 64), ("affine", 6, 64),
           ("affine", 8, 64), ("mxfp4", 4, 32)]


def side_by_side(candidates: dict, rounds: int) -> dict:
    """Median seconds of each candidate, measured in interleaved rounds."""
    for fn in candidates.values():
        fn()
    times = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in times.items()}


def dense_row(mode: str, bits: int, gs: int, rounds: int) -> dict:
    lin = nn.QuantizedLinear(2048, 1536, bias=False, group_size=gs, bits=bits, mode=mode)
    x = mx.random.normal((1, 2048))
    mx.eval(lin.parameters(), x)
    quant = cpu._Quant(lin, stacked=False)
    xs = np.asarray(x)
    return side_by_side({
        "kernel": lambda: cpu_dense.quantized_matmul(lin, x),
        "rows": lambda: quant.matvec(xs, np.arange(1), np.zeros(1, np.int64)),
        "mlx": lambda: mx.eval(mx.quantized_matmul(x, lin.weight, lin.scales, lin.get("biases"), transpose=True,
                                                   group_size=gs, bits=bits, mode=mode)),
    }, rounds)


def experts(mode: str, bits: int, gs: int, tokens: int, rounds: int) -> dict:
    block = SwitchGLU(2048, 768, 32, bias=False)
    nn.quantize(block, group_size=gs, bits=bits, mode=mode)
    x = mx.random.normal((tokens, 2048))
    idx = mx.random.randint(0, 32, (tokens, 8)).astype(mx.uint32)
    mx.eval(block.parameters(), x, idx)
    return side_by_side({"kernel": lambda: cpu.expert_forward(block, x, idx),
                         "mlx": lambda: mx.eval(block(x, idx))}, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"caliber: {platform.machine()} {os.cpu_count()} cores, kernel threads {cpu.THREADS}, "
          f"load {os.getloadavg()[0]:.2f}, mlx {mx.__version__}, float32, median of {args.rounds} rounds")
    print(f"{'format':<12} {'dense row: kernel / rows / mlx (ms)':>38} "
          f"{'experts T=1, 4, 64: kernel/mlx':>32}")
    for mode, bits, gs in FORMATS:
        d = dense_row(mode, bits, gs, args.rounds)
        e = [experts(mode, bits, gs, t, args.rounds) for t in (1, 4, 64)]
        name = f"{mode} {bits}b g{gs}" if mode == "affine" else f"{mode}"
        print(f"{name:<12} {d['kernel'] * 1e3:12.2f} {d['rows'] * 1e3:8.2f} {d['mlx'] * 1e3:8.2f}   "
              + "  ".join(f"{r['kernel'] / r['mlx']:6.2f}x" for r in e))
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
