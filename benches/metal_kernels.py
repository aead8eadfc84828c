"""mlx-tier's Metal expert kernels vs mlx-lm's expert block (gather_qmm), side by side.

Question: does the fused decode kernel (mlx_tier/kernels/msl/expert_gate_up.metal +
expert_down.metal) beat mlx-lm's SwitchGLU (three gather_qmm + SwiGLU) on one
decode token, and the device slot remap beat ``lut[indices]``? Published MLX
kernel kits report +2-12% for fused MoE decode; this script is how a Mac
checks it. Needs Apple Metal: elsewhere it prints one error line and exits 2.

    python benches/metal_kernels.py [--runs 9] [--iters 50] [--bits 4] [--group-size 64]
                                    [--dim 2048] [--hidden 768] [--slots 128] [--k 8]

Defaults are Qwen3-30B-A3B expert shapes (4-bit, group 64, bfloat16 scales and
activations, 128 slots, top-8). Engines interleaved per run, warm (after
warm-up calls), each figure the median over runs of the mean of ``iters``
evaluated calls. Prints the caliber, per-call microseconds, effective weight
GB/s, ratios and the largest output difference between the engines.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import mlx.core as mx
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_tier.kernels import metal as mk


def timed(fn, iters: int) -> float:
    """Mean seconds per evaluated call over ``iters`` calls."""
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(fn())
    return (time.perf_counter() - t0) / iters


def build(args):
    mx.random.seed(0)
    block = SwitchGLU(args.dim, args.hidden, args.slots)
    nn.quantize(block, group_size=args.group_size, bits=args.bits)
    for proj in (block.gate_proj, block.up_proj, block.down_proj):
        proj.scales, proj.biases = proj.scales.astype(mx.bfloat16), proj.biases.astype(mx.bfloat16)
    x = mx.random.normal((1, 1, args.dim)).astype(mx.bfloat16)
    slots = mx.random.permutation(args.slots)[: args.k].reshape(1, 1, args.k).astype(mx.uint32)
    scores = mx.softmax(mx.random.normal((1, 1, args.k)), axis=-1).astype(mx.bfloat16)
    mx.eval(block.parameters(), x, slots, scores)
    return block, x, slots, scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("runs", 9), ("iters", 50), ("bits", 4), ("group-size", 64), ("dim", 2048),
                          ("hidden", 768), ("slots", 128), ("k", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    if not mk.metal_available():
        print("error: this bench needs Apple Metal (mx.metal.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    block, x, slots, scores = build(args)
    lut = mx.array(list(range(args.slots)), dtype=mx.int32)
    inds = slots.reshape(-1)
    engines = {
        "mlx-lm block [T,k,D]": lambda: block(x, slots),
        "metal kernels [T,k,D]": lambda: mk.metal_expert_forward(block, x, slots),
        "mlx-lm block + combine": lambda: (block(x, slots) * scores[..., None]).sum(axis=-2),
        "metal kernels, combine fused": lambda: mk.metal_expert_combine(block, x, slots, scores),
        "remap lut[indices]": lambda: lut[inds],
        "remap kernel (+ counts)": lambda: mk.slot_remap(inds, lut),
    }
    for fn in engines.values():  # warm-up: compile kernels, fill caches
        timed(fn, 5)
    times = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, fn in engines.items():
            times[name].append(timed(fn, args.iters))
    med = {name: statistics.median(v) for name, v in times.items()}
    per_expert = 3 * args.hidden * args.dim * (args.bits / 8 + 2 * 2 / args.group_size)  # weights + bf16 scales/biases
    moved = args.k * per_expert
    diff = float(mx.abs(block(x, slots).astype(mx.float32)
                        - mk.metal_expert_forward(block, x, slots).astype(mx.float32)).max())
    info = mx.device_info()
    print(f"caliber: {platform.platform()}, {info.get('architecture', '?')}, "
          f"{info.get('memory_size', 0) / 2**30:.0f} GiB, MLX {mx.__version__} Metal; "
          f"experts {args.dim}x{args.hidden} {args.bits}-bit g{args.group_size} bf16, {args.slots} slots, "
          f"k={args.k}, 1 token; warm; median of {args.runs} runs x {args.iters} calls; "
          f"load average {os.getloadavg()[0]:.2f}")
    for name, t in med.items():
        gbs = f"{moved / t / 1e9:7.1f} GB/s" if "remap" not in name else ""
        print(f"  {name:30s} {t * 1e6:9.1f} us {gbs}")
    for a, b in (("mlx-lm block [T,k,D]", "metal kernels [T,k,D]"),
                 ("mlx-lm block + combine", "metal kernels, combine fused"),
                 ("remap lut[indices]", "remap kernel (+ counts)")):
        print(f"  speed-up {b} vs {a}: {med[a] / med[b]:.3f}x")
    print(f"  max |metal - mlx-lm| over [T,k,D]: {diff:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
