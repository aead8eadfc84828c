"""CPU expert kernel vs MLX's CPU ops vs this machine's memory bandwidth, side by side.

Question: how close to memory bandwidth does the CPU expert kernel run, and
how much faster than MLX's ``gather_qmm`` is it? One SwitchGLU block of
Qwen3-30B-A3B shapes (D=2048, H=768, 128 experts, 4-bit affine, group 64,
float32 scales as on the CPU backend), in one process:

- memory bandwidth: a streaming read (sum) of a 1 GiB buffer, one thread and
  all threads; the larger is the reference;
- decode: one token, k=8 distinct random experts per call (new ones every
  call, so weights come from memory, not cache): the kept kernel (Numba fused
  dequantise + matvec; on an AVX-512 VNNI CPU its 4-bit rows run on integer
  dot products, ``mlx_tier/kernels/cpu_vnni.py``), the same with its float32 row loops
  (``MLX_TIER_VNNI=0``; the only path on other CPUs), the same with the generic
  float32 row loop, the other build candidate (vectorised numpy dequantise
  + BLAS matvec) and MLX (``SwitchGLU`` -> ``gather_qmm``), in GB/s of expert
  weights (packed weights + scales + biases) read. The decode candidates and
  the streaming read run in interleaved rounds (one call of each per round),
  so a change in the machine's speed during the run reaches all of them;
- prefill: 512 tokens x top-8 over the 128 experts (random routing): the
  kernel (rows grouped by expert, dequantise + numpy's BLAS GEMM), the numpy
  candidate, and MLX's sorted ``gather_qmm`` (what SwitchGLU does for >= 64 pairs).

    python benches/kernel.py [--runs 9] [--mlx-prefill-runs 1]

Prints the caliber and the load average with every figure (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numba
import numpy as np
import psutil
from mlx import nn
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_tier.kernels import cpu as cpu_kernel
from mlx_tier.kernels import cpu_vnni, simd

D, H, E, K, BITS, GS = 2048, 768, 128, 8, 4, 64


def timed(fn, runs: int) -> tuple[float, str]:
    """Median seconds of ``runs`` calls (after one warm-up) and the load average at the end."""
    return rounds({"": fn}, runs)[""]


def rounds(fns: dict, runs: int) -> dict:
    """``{name: (median seconds, load average at the end)}`` of ``runs`` interleaved
    rounds, each calling every function once in turn (after one warm-up round)."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t)
    load = "load {:.1f} {:.1f} {:.1f}".format(*os.getloadavg())
    return {name: (statistics.median(v), load) for name, v in ts.items()}


def stream_reads(pool: ThreadPoolExecutor, threads: int) -> tuple[int, dict]:
    """Bytes of a 1 GiB buffer and ``{name: read it}`` for one thread and all threads
    (numpy's sum drops the GIL), for :func:`rounds`."""
    buf = np.ones(2**30 // 4, np.float32)
    parts = np.array_split(buf, threads)
    return buf.nbytes, {"read, 1 thread": buf.sum, "read, all threads": lambda: list(pool.map(np.sum, parts))}


def with_vnni(enabled: bool, fn):
    """``fn()`` with the VNNI row loops on or off (:data:`cpu_vnni.ENABLED`)."""
    keep = cpu_vnni.ENABLED
    cpu_vnni.ENABLED = enabled and keep
    try:
        return fn()
    finally:
        cpu_vnni.ENABLED = keep


def numpy_dequant(leaf, s: int) -> np.ndarray:
    """Build candidate B: slot ``s`` of a 4-bit layer dequantised with vectorised numpy, [O, I] float32."""
    w = np.asarray(leaf["weight"][s]).view(np.uint8)  # [O, I/2]
    q = np.stack([w & 15, w >> 4], axis=-1).reshape(w.shape[0], -1, GS).astype(np.float32)  # [O, G, gs]
    sc, bi = np.asarray(leaf["scales"][s]), np.asarray(leaf["biases"][s])
    return (q * sc[..., None] + bi[..., None]).reshape(w.shape[0], -1)


def numpy_block(blk, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Candidate B for a whole SwitchGLU: per expert, numpy dequantise + BLAS (one BLAS
    thread, as in the kernel: its spinning threads collapse on shared cores); ``[T*k, D]``."""
    with cpu_kernel._BLAS.limit(limits=1, user_api="blas"):
        return _numpy_block(blk, x, idx)


def _numpy_block(blk, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    T, k = idx.shape
    out = np.empty((T * k, D), np.float32)
    flat = idx.reshape(-1)
    for e in np.unique(flat):
        pairs = np.flatnonzero(flat == e)
        xs = x[pairs // k]
        g, u = xs @ numpy_dequant(blk.gate_proj, e).T, xs @ numpy_dequant(blk.up_proj, e).T
        h = g / (1 + np.exp(-g)) * u  # SwiGLU (silu(gate) * up)
        out[pairs] = h @ numpy_dequant(blk.down_proj, e).T
    return out


def generic_rows(fn):
    """``fn()`` with the kernel's group-size-specialised 4-bit row loops turned off (the
    runtime group-length loop the kernel used before them), for a side-by-side ratio."""
    keep = cpu_kernel._row_loop
    cpu_kernel._row_loop = lambda *a: 0
    try:
        return fn()
    finally:
        cpu_kernel._row_loop = keep


def expert_bytes(blk) -> float:
    """Bytes of one expert's packed weights, scales and biases (all three projections)."""
    return sum(v.nbytes for _, v in nn.utils.tree_flatten(blk.parameters())) / E


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--mlx-prefill-runs", type=int, default=1, help="MLX's prefill takes tens of seconds a run")
    args = ap.parse_args()

    mx.random.seed(0)
    blk = SwitchGLU(D, H, E)
    nn.quantize(blk, group_size=GS, bits=BITS)
    mx.eval(blk.parameters())
    rng = np.random.default_rng(0)
    per_expert = expert_bytes(blk)

    print("caliber:")
    print(f"  machine: {platform.machine()} {platform.system()}, {psutil.cpu_count()} cores "
          f"({platform.processor() or 'cpu'}), {psutil.virtual_memory().total / 2**30:.0f} GiB, shared")
    print(f"  MLX {mx.__version__} on {mx.default_device()}; numba {numba.__version__} "
          f"({cpu_kernel.THREADS} kernel threads); numpy {np.__version__}")
    print(f"  block: SwitchGLU D={D} H={H}, {E} experts, {BITS}-bit affine g{GS}, float32 scales; "
          f"{per_expert / 2**20:.2f} MiB per expert; medians of {args.runs} runs after a warm-up")
    print(f"  CPU: integer dot products {simd.DOT}, row loops: "
          f"{'integer where the layout allows' if cpu_vnni.ENABLED else 'float32'}")

    x = mx.random.normal((1, D))
    xs = np.asarray(x)

    def pick():
        return mx.array(rng.choice(E, K, replace=False)[None].astype(np.uint32))  # [1, k]

    def kernel():
        return cpu_kernel.expert_forward(blk, x, pick())

    vnni = "kernel, integer dots" if cpu_vnni.ENABLED else "kernel (no integer dots on this CPU)"
    decode = {
        vnni: kernel,
        "  float32 row loops": lambda: with_vnni(False, kernel),
        "  generic float32 row loop": lambda: with_vnni(False, lambda: generic_rows(kernel)),
        "numpy dequant + BLAS": lambda: numpy_block(blk, xs, np.asarray(pick())),
        "MLX gather_qmm": lambda: mx.eval(blk(x, pick())),
    }
    if not cpu_vnni.ENABLED:
        del decode["  float32 row loops"]
    with ThreadPoolExecutor(cpu_kernel.THREADS) as pool:
        nbytes, reads = stream_reads(pool, cpu_kernel.THREADS)
        res = rounds({**reads, **decode}, args.runs)
    bw = max(nbytes / res[name][0] for name in reads)
    print(f"\nmemory: streaming read of 1 GiB {bw / 1e9:6.1f} GB/s (better of 1 and {cpu_kernel.THREADS} threads, "
          f"interleaved with the decode calls below)")
    print(f"\ndecode: 1 token x top-{K} ({K * per_expert / 2**20:.1f} MiB of experts per call)")
    print(f"{'':28} {'ms':>8} {'GB/s':>7} {'of read bw':>10} {'vs MLX':>7}")
    mlx_t = res["MLX gather_qmm"][0]
    for name in decode:
        t, load = res[name]
        gbs = K * per_expert / t
        print(f"{name:28} {t * 1e3:8.2f} {gbs / 1e9:7.2f} {gbs / bw:10.1%} {mlx_t / t:7.1f}x   ({load})")
    share = K * per_expert / res[vnni][0] / bw
    print(f"target: kernel decode >= 40% of this run's streaming read: {share:.1%}, "
          f"{'pass' if share >= 0.4 else 'missed'}")

    T = 512
    xp = mx.random.normal((T, D))
    idx = mx.array(np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.uint32))  # [T, k] distinct per token
    xps, idxs = np.asarray(xp), np.asarray(idx)
    print(f"\nprefill: {T} tokens x top-{K} over {E} experts (random routing)")
    res = {
        "cpu kernel (dequant + GEMM)": timed(lambda: cpu_kernel.expert_forward(blk, xp, idx), max(3, args.runs // 3)),
        "numpy dequant + BLAS": timed(lambda: numpy_block(blk, xps, idxs), max(3, args.runs // 3)),
        "MLX sorted gather_qmm": timed(lambda: mx.eval(blk(xp, idx)), args.mlx_prefill_runs),
    }
    mlx_t = res["MLX sorted gather_qmm"][0]
    print(f"{'':28} {'s':>8} {'tok/s':>7} {'vs MLX':>7}")
    for name, (t, load) in res.items():
        print(f"{name:28} {t:8.2f} {T / t:7.1f} {mlx_t / t:7.1f}x   ({load})")
    ref = blk(xp[:64], idx[:64])
    got = cpu_kernel.expert_forward(blk, xp[:64], idx[:64])
    print(f"\nagreement (64 tokens): max|Δ|/max|ref| = {(mx.abs(ref - got).max() / mx.abs(ref).max()).item():.1e}")


if __name__ == "__main__":
    main()
