"""The VNNI rows' GEMM-shaped step (two tokens of one slot) against one token at a time.

Question: how much does computing two (token, expert) pairs of the same slot in
one pass over the slot's rows (each 64-byte step loaded, unpacked and scaled once
for both tokens) save over the one-token rows, at the rows per expert a pool
sends? The same pairs sorted by slot, the same weights, one thread, one
process, interleaved rounds: ``qmv4(..., two=True)`` (adjacent pairs of a slot
take the two-token step: what a pool runs) against ``two=False`` (the one-token
rows, ``cpu_vnni.TWO_TOKEN`` off). The outputs must be bit-equal; the bench
says so.

    python benches/vnni_pairs.py [--rounds 7]

Prints microseconds per pair (medians) and the ratio, per shape and rows per
expert. Needs an x86 CPU with AVX-512 VNNI or AVX2 (vpdpbusd emulated).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import mlx.core as mx
import numpy as np

from mlx_tier.kernels import cpu_vnni

# (name, O, I, group size, experts): a projection's output rows and input width
SHAPES = [("qwen3 gate/up", 768, 2048, 64, 16), ("qwen3 down", 2048, 768, 64, 16),
          ("demo down", 576, 1536, 32, 8)]
ROWS = (2, 4, 16)


def measure(O: int, I: int, gs: int, experts: int, rows: int, rounds: int) -> tuple[float, float, bool]:
    """Medians of microseconds per pair ``(two-token, one-token)`` for ``experts * rows``
    tokens, ``rows`` a slot, and whether the outputs are bit-equal."""
    wq, sc, bi = mx.quantize(mx.random.normal((experts, O, I), key=mx.random.key(O)), group_size=gs, bits=4)
    w, sc, bi = np.asarray(wq).view(np.uint8), np.asarray(sc), np.asarray(bi)
    T = experts * rows
    slots = np.repeat(np.arange(experts), rows).astype(np.int64)
    tok = np.random.default_rng(1).permutation(T).astype(np.int64)
    prep = cpu_vnni.prepare(np.random.default_rng(0).standard_normal((T, I)).astype(np.float32), gs)
    times: dict[bool, list[float]] = {True: [], False: []}
    outs = {two: np.empty((T, O), np.float32) for two in times}
    for two in times:  # compile both
        cpu_vnni.qmv4(gs, w, sc, bi, *prep, tok, slots, outs[two], 0, T * O, two)
    for _ in range(rounds):
        for two in times:
            t = time.perf_counter()
            cpu_vnni.qmv4(gs, w, sc, bi, *prep, tok, slots, outs[two], 0, T * O, two)
            times[two].append((time.perf_counter() - t) / T * 1e6)
    same = np.array_equal(outs[True], outs[False])
    return float(np.median(times[True])), float(np.median(times[False])), same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians reported")
    args = ap.parse_args()
    if not cpu_vnni.usable(4, 64, 0, 128):
        raise SystemExit("needs an x86 CPU with AVX-512 VNNI (and MLX_TIER_VNNI not 0)")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one thread, "
          f"{args.rounds} rounds, medians")
    print(f"{'shape':<14} {'rows/expert':>11} {'two-token us':>12} {'one-token us':>12} {'ratio':>6} {'bit-equal':>9}")
    for name, O, I, gs, experts in SHAPES:
        for rows in ROWS:
            a, b, same = measure(O, I, gs, experts, rows, args.rounds)
            print(f"{name:<14} {rows:>11} {a:>12.1f} {b:>12.1f} {b / a:>6.2f} {str(same):>9}")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
