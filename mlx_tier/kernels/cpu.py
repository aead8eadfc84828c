"""CPU expert kernel: MoE experts computed where they lie in host memory.

Replaces MLX's CPU ``gather_qmm``/``gather_mm`` (compute-bound at 1-3% of
memory bandwidth on the build machine, docs/kernels.md) for the
expert blocks of ``mlx_lm.models.switch_layers`` (a model's dense layers:
:mod:`mlx_tier.kernels.cpu_dense`).

Dimension legend: T tokens, k experts per token, N = T*k (token, expert)
pairs, S slots, O output features, I input features, G = I / group_size.

- Decode (few rows per expert): a fused dequantise + matvec, Numba-compiled,
  parallel over (pair, block of output rows), each weight byte read once per
  pair. Affine groups use ``sum_g scale_g * (q . x)_g + bias_g * sum(x_g)``,
  so the inner loop is integer unpack + FMA on de-interleaved activations
  (the standard trick of llama.cpp's q4_1 dot products); 4-bit rows have a
  loop per group size whose inner trip count is a compile-time constant. A
  bias-free SwiGLU block whose pairs split evenly among the threads is
  computed by whole pairs per thread (one hand-off per block). On an AVX-512
  VNNI or AVX2 CPU, 4-bit affine rows of 128-multiple length run on integer dot
  products instead (:mod:`mlx_tier.kernels.cpu_vnni`), and such a block's share is one
  GIL-free call.
- Prefill (many rows per expert): pairs grouped by slot; each slot's weight
  is dequantised once to float32 (each thread its share of the output rows)
  and fed to numpy's optimized BLAS GEMM.

Packing follows ``mx.quantize``: each row is a little-endian bit stream of
``bits``-bit codes (uint32 words); affine: ``w = scale * q + bias`` per group;
mxfp4: ``w = FP4_E2M1[q] * 2**(e - 127)`` with an 8-bit exponent per group
of 32 (OCP Microscaling spec v1.0). Everything computes in float32; the
summation order differs from MLX's, so results agree to fp32 rounding, not
bit for bit (docs/architecture.md, invariant 1).

Reading the slabs: ``np.asarray`` of an mx.array evaluates it and is a
zero-copy view on the CPU. Views are dropped before returning (a live view
would turn the cache's in-place slot writes into full-slab copies), and the
kernel computes eagerly, so no lazy reader of a slot outlives the call.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import psutil
from mlx import nn
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwiGLU,
    SwitchGLU,
    SwitchMLP,
)
from numba import njit
from threadpoolctl import ThreadpoolController

from mlx_tier.kernels import cpu_vnni, simd

# A slot used by at least this many pairs in one call is dequantised once and
# multiplied with BLAS; fewer pairs use the fused matvec. Where the rows take the
# float32 loops the two cost the same at 8-16 rows per expert; the VNNI loops
# compute a pair 2-3x faster than dequantising + BLAS up to 32 rows and as fast at
# 64 (an expert's dequantisation alone costs ~8 of its VNNI pairs), so their
# layouts take the matvec below 64 (benches/expert_rows.py,
# benches/results/expert-rows/NOTES.md). The same for dense layers.
GEMM_MIN_ROWS = 8
VNNI_GEMM_MIN_ROWS = 64
# The same loops on AVX2 (vpdpbusd as two instructions a half: kernels/simd.py)
# compute a pair ~1.5x faster than the float32 loops there, and as fast as
# dequantising + BLAS at 16 rows; at 32, BLAS is 1.4x faster (benches/expert_rows.py,
# benches/results/kernel-avx2/NOTES.md).
AVX2_GEMM_MIN_ROWS = 16
# Threads of the kernel: one per physical core this process may use (a second
# hardware thread of a core shares its vector units, which the matvec keeps
# busy). A Python pool over nogil Numba functions measured faster here than
# Numba's parallel=True (whose parfor lowering lost the inner loops'
# vectorisation: benches/kernel.py, benches/results/kernel/NOTES.md).
_USABLE = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = max(1, min(_USABLE, psutil.cpu_count(logical=False) or _USABLE))
_POOL = ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="mlx-tier-kernel")
_IN_SHARE = threading.local()  # .on: this thread runs a share of a _parallel call
# Least weight bytes a thread's share of a matvec gets: below it, handing work to
# another thread costs more than it saves (small attention projections).
SHARE_BYTES = 2**18
# Least elements of a thread's share of an elementwise pass over host rows (the SwiGLU):
# below it one thread does it all (a decode step's few rows).
ELEMENTWISE_GRAIN = 2**16
_BLAS = ThreadpoolController()  # numpy's BLAS, limited to one thread inside the pool's shares

MODES = {"affine": 0, "mxfp4": 1}
FP4_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


FM = {"reassoc", "contract"}  # reassociated sums vectorize (the order differs from MLX's anyway)


@njit(fastmath=FM, nogil=True, cache=True)
def _dot4(wr, sr, br, gs, xd, xs):
    """Affine 4-bit row . x: wr [I/2] uint8, sr/br [G], xd [2, I/2] (even, odd x), xs [G]."""
    bpg = gs // 2
    acc = np.float32(0.0)
    for g in range(sr.shape[0]):
        wg = wr[g * bpg:(g + 1) * bpg]
        xe = xd[0, g * bpg:(g + 1) * bpg]
        xo = xd[1, g * bpg:(g + 1) * bpg]
        dot = np.float32(0.0)
        for i in range(bpg):  # nibbles in float lanes: hi = floor(b/16), lo = b - 16 hi
            fb = np.float32(wg[i])
            hi = np.floor(fb * np.float32(0.0625))
            dot += (fb - np.float32(16.0) * hi) * xe[i] + hi * xo[i]
        acc += sr[g] * dot + br[g] * xs[g]
    return acc


# Row loops specialised by group size: an inner loop with a compile-time trip
# count is unrolled and vectorised whole by LLVM, where _dot4's runtime
# group-length loop (16-64 bytes) runs mostly in its scalar epilogue. Measured
# 1.3-1.7x faster per thread (benches/kernel.py, docs/kernels.md).
# Each is written out: variants sharing one loop with a computed scale index
# lost most of the gain, and the same constant-length loop for 8-bit rows ran
# 4x slower than _dot8's (measured; LLVM's choices, not a rule). Also measured
# slower here (third round, benches/results/kernel/NOTES.md): x' = odd x - 16 even x (one op fewer per
# byte), 128-byte steps with the scale multiplied in per code (one reduction per
# 4 groups), integer nibble shifts, a vector accumulator in a scratch array; and
# AVX2 code ran as fast as AVX-512: the loop's speed does not follow its op count.


@njit(fastmath=FM, nogil=True, cache=True)
def _dot4_g32(wr, sr, br, xd, xs):
    """:func:`_dot4` for group 32 and an even number of groups: 32-byte steps over two groups."""
    acc = np.float32(0.0)
    for p in range(sr.shape[0] // 2):
        wg = wr[p * 32:(p + 1) * 32]
        xe = xd[0, p * 32:(p + 1) * 32]
        xo = xd[1, p * 32:(p + 1) * 32]
        s0 = sr[2 * p]
        s1 = sr[2 * p + 1]
        dot = np.float32(0.0)
        for i in range(32):
            fb = np.float32(wg[i])
            hi = np.floor(fb * np.float32(0.0625))
            dot += (s0 if i < 16 else s1) * ((fb - np.float32(16.0) * hi) * xe[i] + hi * xo[i])
        acc += dot
    for g in range(sr.shape[0]):
        acc += br[g] * xs[g]
    return acc


@njit(fastmath=FM, nogil=True, cache=True)
def _dot4_g64(wr, sr, br, xd, xs):
    """:func:`_dot4` for group 64 (32 bytes a group)."""
    acc = np.float32(0.0)
    for g in range(sr.shape[0]):
        wg = wr[g * 32:(g + 1) * 32]
        xe = xd[0, g * 32:(g + 1) * 32]
        xo = xd[1, g * 32:(g + 1) * 32]
        dot = np.float32(0.0)
        for i in range(32):
            fb = np.float32(wg[i])
            hi = np.floor(fb * np.float32(0.0625))
            dot += (fb - np.float32(16.0) * hi) * xe[i] + hi * xo[i]
        acc += sr[g] * dot + br[g] * xs[g]
    return acc


@njit(fastmath=FM, nogil=True, cache=True)
def _dot4_g128(wr, sr, br, xd, xs):
    """:func:`_dot4` for group 128 (64 bytes a group)."""
    acc = np.float32(0.0)
    for g in range(sr.shape[0]):
        wg = wr[g * 64:(g + 1) * 64]
        xe = xd[0, g * 64:(g + 1) * 64]
        xo = xd[1, g * 64:(g + 1) * 64]
        dot = np.float32(0.0)
        for i in range(64):
            fb = np.float32(wg[i])
            hi = np.floor(fb * np.float32(0.0625))
            dot += (fb - np.float32(16.0) * hi) * xe[i] + hi * xo[i]
        acc += sr[g] * dot + br[g] * xs[g]
    return acc


def _row_loop(bits: int, gs: int, mode: int, groups: int) -> int:
    """Which specialised 4-bit row loop :func:`_qmv4` runs for this layout (its group
    size), or 0: none fits (then :func:`_qmv`)."""
    if (bits, mode) != (4, 0) or gs not in (32, 64, 128) or (gs == 32 and groups % 2):
        return 0
    return gs


@njit(nogil=True, cache=True)
def _qmv4(gs, w, scales, biases, xd, xsum, tok, slots, out, f0, f1):
    """:func:`_qmv` through the row loop for group size ``gs`` (32, 64, 128: one loop each,
    the branch outside it; dispatching per row inside _qmv measured 10-25% slower).
    Walks pairs, then rows: a pair's slices are taken once, and no row divides f by O
    (1.02-1.06x per thread, docs/kernels.md)."""
    O = out.shape[1]
    for n in range(f0 // O, (f1 + O - 1) // O):
        wn, sn, bn = w[slots[n]], scales[slots[n]], biases[slots[n]]
        xn, xs = xd[tok[n]], xsum[tok[n]]
        o0, o1 = max(f0 - n * O, 0), min(f1 - n * O, O)
        if gs == 32:
            for o in range(o0, o1):
                out[n, o] = _dot4_g32(wn[o], sn[o], bn[o], xn, xs)
        elif gs == 64:
            for o in range(o0, o1):
                out[n, o] = _dot4_g64(wn[o], sn[o], bn[o], xn, xs)
        else:
            for o in range(o0, o1):
                out[n, o] = _dot4_g128(wn[o], sn[o], bn[o], xn, xs)


@njit(fastmath=FM, nogil=True, cache=True)
def _dot8(wr, sr, br, gs, xd, xs):
    """Affine 8-bit row . x: wr [I] uint8, xd [1, I]."""
    acc = np.float32(0.0)
    for g in range(sr.shape[0]):
        wg = wr[g * gs:(g + 1) * gs]
        xg = xd[0, g * gs:(g + 1) * gs]
        dot = np.float32(0.0)
        for i in range(gs):
            dot += np.float32(wg[i]) * xg[i]
        acc += sr[g] * dot + br[g] * xs[g]
    return acc


@njit(fastmath=FM, nogil=True, cache=True)
def _dot_blocks(wr, sr, br, bits, gs, mode, xd, xs):
    """Any affine width or mxfp4 row . x: xd [8, I/8], code i multiplies xd[i % 8, i // 8].
    By blocks of 8 codes, each cut from one 64-bit word of ``bits`` bytes
    (:func:`_dequant_blocks`; per-code bit arithmetic took ~9 ns a weight, this 1-1.7)."""
    mask = np.uint64((1 << bits) - 1)
    per = gs // 8
    acc = np.float32(0.0)
    for g in range(sr.shape[0]):
        dot = np.float32(0.0)
        for blk in range(g * per, (g + 1) * per):
            v = np.uint64(0)
            for j in range(bits):
                v |= np.uint64(wr[blk * bits + j]) << np.uint64(8 * j)
            for c in range(8):
                q = (v >> np.uint64(bits * c)) & mask
                dot += (np.float32(q) if mode == 0 else FP4_E2M1[q]) * xd[c, blk]
        if mode == 0:
            acc += sr[g] * dot + br[g] * xs[g]
        else:
            acc += np.float32(math.ldexp(1.0, int(sr[g]) - 127)) * dot
    return acc


@njit(nogil=True, cache=True)
def _qmv(w, scales, biases, bits, gs, mode, xd, xsum, tok, slots, out, f0, f1):
    """out[n, o] = dequant(w[slots[n], o]) . x[tok[n]] for flat f = n*O + o in [f0, f1).

    w [S, O, I*bits/8] uint8; scales, biases [S, O, G] float32 (mxfp4: uint8
    exponents, biases unused); xd [R, p, I/p] float32, x de-interleaved by
    :func:`_deinterleave`; xsum [R, G] float32; tok, slots [N] int64; out [N, O].
    """
    O = out.shape[1]
    for f in range(f0, f1):
        n = f // O
        o = f - n * O
        s = slots[n]
        r = tok[n]
        bi = biases[s, o] if mode == 0 else biases[0, 0]
        if mode == 0 and bits == 4:
            out[n, o] = _dot4(w[s, o], scales[s, o], bi, gs, xd[r], xsum[r])
        elif mode == 0 and bits == 8:
            out[n, o] = _dot8(w[s, o], scales[s, o], bi, gs, xd[r], xsum[r])
        else:
            out[n, o] = _dot_blocks(w[s, o], scales[s, o], bi, bits, gs, mode, xd[r], xsum[r])


@njit(fastmath=FM, nogil=True, cache=True)
def _dequant4(wr, sr, br, gs, out):
    """Affine 4-bit row wr [I/2] uint8 -> out [I] float32 in natural column order (byte i
    holds code 2i in its low nibble, 2i + 1 in its high one; the paired stores vectorise),
    so a GEMM's input rows go to BLAS unpermuted."""
    bpg = gs // 2
    for g in range(sr.shape[0]):
        sc, bi = sr[g], br[g]
        wg = wr[g * bpg:(g + 1) * bpg]  # slices, not computed indices: the loop vectorises
        og = out[g * gs:(g + 1) * gs]
        for i in range(bpg):
            fb = np.float32(wg[i])
            hi = np.floor(fb * np.float32(0.0625))
            og[2 * i] = sc * (fb - np.float32(16.0) * hi) + bi
            og[2 * i + 1] = sc * hi + bi


@njit(fastmath=FM, nogil=True, cache=True)
def _dequant8(wr, sr, br, gs, out):
    """Affine 8-bit row wr [I] uint8 (one code per byte, in order) -> out [I] float32."""
    for g in range(sr.shape[0]):
        sc, bi = sr[g], br[g]
        wg = wr[g * gs:(g + 1) * gs]  # slices, not computed indices: the loop vectorises
        og = out[g * gs:(g + 1) * gs]
        for i in range(gs):
            og[i] = sc * np.float32(wg[i]) + bi


@njit(fastmath=FM, nogil=True, cache=True)
def _dequant_blocks(wr, sr, br, bits, gs, mode, out):
    """Any affine width or mxfp4 row wr (a little-endian bit stream) -> out [I] float32,
    in natural column order: 8 codes fill exactly ``bits`` bytes, so each block of 8 is
    one 64-bit word cut by shifts (per-code bit arithmetic took ~20 ns a weight); group
    sizes are multiples of 8, so a block lies in one group."""
    mask = np.uint64((1 << bits) - 1)
    for blk in range(out.shape[0] // 8):
        v = np.uint64(0)
        for j in range(bits):
            v |= np.uint64(wr[blk * bits + j]) << np.uint64(8 * j)
        g = blk * 8 // gs
        if mode == 0:
            sc, bi = sr[g], br[g]
            for c in range(8):
                out[blk * 8 + c] = sc * np.float32((v >> np.uint64(bits * c)) & mask) + bi
        else:
            sc = np.float32(math.ldexp(1.0, int(sr[g]) - 127))
            for c in range(8):
                out[blk * 8 + c] = sc * FP4_E2M1[(v >> np.uint64(bits * c)) & mask]


@njit(nogil=True, cache=True)
def _dequant(w, scales, biases, bits, gs, mode, s, out):
    """out [O, I] float32 = slot ``s``'s dequantised weight (layouts as in _qmv)."""
    for o in range(out.shape[0]):
        if mode == 0 and bits == 4:
            _dequant4(w[s, o], scales[s, o], biases[s, o], gs, out[o])
        elif mode == 0 and bits == 8:
            _dequant8(w[s, o], scales[s, o], biases[s, o], gs, out[o])
        else:
            _dequant_blocks(w[s, o], scales[s, o], biases[s, o] if mode == 0 else biases[0, 0], bits, gs, mode,
                            out[o])


def _deinterleave(x: np.ndarray, bits: int, mode: int) -> np.ndarray:
    """``[R, p, I/p]`` float32 copy of x ``[R, I]`` matching :func:`_qmv`'s row kernels."""
    p = {4: 2, 8: 1}.get(bits, 8) if mode == 0 else 8
    R, I = x.shape
    return np.ascontiguousarray(x.reshape(R, I // p, p).transpose(0, 2, 1))


def _parallel(fn, total: int, grain: int = 64) -> None:
    """Run ``fn(f0, f1)`` over [0, total) split among the pool's threads (Numba kernels and
    BLAS drop the GIL), at least ``grain`` items a share."""
    n = min(THREADS, max(1, total // grain))
    if n == 1 or getattr(_IN_SHARE, "on", False):  # inside a share: the other threads are busy with theirs
        fn(0, total)
        return
    step = -(-total // n)
    rest = [_POOL.submit(_share, fn, i * step, min(total, (i + 1) * step)) for i in range(1, n)]
    _share(fn, 0, step)  # the calling thread takes the first share
    for f in rest:
        f.result()


def _share(fn, f0: int, f1: int) -> None:
    """``fn(f0, f1)`` as one share of a :func:`_parallel` call: a call it makes in turn runs
    on its own thread (a pool thread that waited on the pool could wait on itself; the
    calling thread would wait for the other shares to end before its own could)."""
    _IN_SHARE.on = True
    try:
        fn(f0, f1)
    finally:
        _IN_SHARE.on = False


def _parallel_jobs(jobs: list, grain: int) -> None:
    """Run several ``(fn, total)`` jobs as one :func:`_parallel` call over their concatenated
    ranges (one hand-off to the pool for, e.g., a block's gate and up projections)."""
    if len(jobs) == 1:
        _parallel(*jobs[0], grain=grain)
        return
    starts = np.cumsum([0] + [t for _, t in jobs])

    def piece(a, b):
        for (fn, _), lo, hi in zip(jobs, starts[:-1], starts[1:]):
            if a < hi and b > lo:
                fn(max(a, lo) - lo, min(b, hi) - lo)

    _parallel(piece, int(starts[-1]), grain)


def _host(a: mx.array, float32: bool = True) -> np.ndarray:
    """A numpy view (zero-copy for evaluated float32/int arrays on the CPU)."""
    if float32 and mx.issubdtype(a.dtype, mx.floating) and a.dtype != mx.float32:
        a = a.astype(mx.float32)  # numpy has no bfloat16
    return np.asarray(a)


def _groups(slots: np.ndarray):
    """``(slot, pair indices)`` of each distinct slot of ``slots`` [N]."""
    order = np.argsort(slots, kind="stable")
    bounds = np.flatnonzero(np.diff(slots[order])) + 1
    return [(int(slots[p[0]]), p) for p in np.split(order, bounds)]


class _Quant:
    """The packed arrays of one quantized (switch) linear layer, as host views."""

    def __init__(self, leaf: nn.Module, stacked: bool):
        if leaf.mode not in MODES or leaf.get("global_scale") is not None:
            raise ValueError(f"CPU kernel: quantization mode {leaf.mode!r} is not supported (affine, mxfp4)")
        self.bits, self.gs, self.mode = leaf.bits, leaf.group_size, MODES[leaf.mode]
        bi = leaf.get("biases")
        self.w = _host(leaf["weight"]).view(np.uint8)  # [S, O, I*bits/8]
        self.scales = _host(leaf["scales"], float32=self.mode == 0)  # [S, O, G]
        self.biases = _host(bi) if bi is not None else np.zeros((1, 1, 1), np.float32)
        if not stacked:  # a dense layer is one always-resident expert (numpy views: free)
            self.w, self.scales = self.w[None], self.scales[None]
            self.biases = self.biases[None] if bi is not None else self.biases
        self.out_dims = self.w.shape[1]
        self.in_dims = self.scales.shape[2] * self.gs
        self.vnni = (cpu_vnni.usable(self.bits, self.gs, self.mode, self.in_dims) and self.w.strides[-1] == 1
                     and self.scales.strides[-1] == self.biases.strides[-1] == 4)  # rows read as vectors

    @property
    def gemm_min_rows(self) -> int:
        """Rows of one slot from which a call dequantises it and multiplies with BLAS
        (:func:`integer_min_rows` where the rows take the integer loops, else
        :data:`GEMM_MIN_ROWS`)."""
        return integer_min_rows() if self.vnni else GEMM_MIN_ROWS

    @property
    def arrays(self) -> tuple:
        """``(group size, w, scales, biases)``: the layer as :func:`cpu_vnni.glu_pairs` takes it."""
        return self.gs, self.w, self.scales, self.biases

    def matvec(self, x: np.ndarray, tok: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``[len(slots), O]`` float32: row n = W[slots[n]] @ x[tok[n]] (x [R, I] float32)."""
        out, job = self.matvec_job(x, tok, slots)
        _parallel_jobs([job], self.grain)
        return out

    @property
    def grain(self) -> int:
        """Output rows of a thread's least share of a matvec (:data:`SHARE_BYTES`)."""
        return max(1, SHARE_BYTES // (self.w.shape[2] + 2 * self.scales.shape[2] * self.scales.itemsize))

    def prepare(self, x: np.ndarray) -> tuple:
        """The row loops' input for x ``[R, I]`` float32: ``("vnni", xl, ex, xs)``
        (:func:`cpu_vnni.prepare`) where :attr:`vnni` and x is finite, else ``("f32",
        xd [R, p, I/p], xsum [R, G])`` (:func:`_deinterleave`, group sums); the same for
        every layer of the same :attr:`layout`, so a block's gate and up projections
        prepare x once."""
        digits = cpu_vnni.prepare(x, self.gs) if self.vnni else None
        if digits is not None:
            return ("vnni", *digits)
        xd = _deinterleave(x, self.bits, self.mode)
        return "f32", xd, x.reshape(x.shape[0], -1, self.gs).sum(-1, dtype=np.float32)

    @property
    def layout(self) -> tuple:
        """``(bits, group_size, mode, vnni)``: what :meth:`prepare`'s result depends on."""
        return self.bits, self.gs, self.mode, self.vnni

    def matvec_job(self, x: np.ndarray, tok: np.ndarray, slots: np.ndarray, prep: tuple | None = None):
        """:meth:`matvec`'s output ``[N, O]`` (empty) and the job ``(fn(f0, f1), N*O)`` filling
        it, f = n*O + o, for :func:`_parallel_jobs`; ``prep``: :meth:`prepare`'s result
        for ``x`` (computed here when ``None``)."""
        kind, *xp = self.prepare(x) if prep is None else prep
        out = np.empty((len(slots), self.out_dims), np.float32)
        tok, slots = tok.astype(np.int64, copy=False), slots.astype(np.int64, copy=False)
        w, sc, bi, gs = self.w, self.scales, self.biases, self.gs
        loop = _row_loop(self.bits, gs, self.mode, sc.shape[2])
        if kind == "vnni":
            def rows(f0, f1):
                cpu_vnni.qmv4(gs, w, sc, bi, *xp, tok, slots, out, f0, f1, cpu_vnni.TWO_TOKEN)
        elif loop:
            def rows(f0, f1):
                _qmv4(loop, w, sc, bi, *xp, tok, slots, out, f0, f1)
        else:
            def rows(f0, f1):
                _qmv(w, sc, bi, self.bits, gs, self.mode, *xp, tok, slots, out, f0, f1)
        return out, (rows, out.size)

    def dense(self, s: int, o0: int = 0, o1: int | None = None) -> np.ndarray:
        """``[o1 - o0, I]`` float32: rows o0..o1 of slot ``s``'s dequantised weight, columns
        in natural order (one thread)."""
        o1 = self.out_dims if o1 is None else o1
        out = np.empty((o1 - o0, self.in_dims), np.float32)
        _dequant(self.w[:, o0:o1], self.scales[:, o0:o1], self.biases[:, o0:o1] if self.mode == 0 else self.biases,
                 self.bits, self.gs, self.mode, s, out)
        return out


def _gemm_slots(quant: _Quant | None, weight, x, tok, groups, out) -> None:
    """out[p] = x[tok[p]] @ W[s].T for each ``(s, p)`` of ``groups``: each slot's output rows
    shared among the pool's threads (every thread dequantises its rows of every slot and
    calls BLAS single-threaded: BLAS's own threads spin-wait and collapse when the cores
    are shared, measured 1.5-150 ms for one call). Sharing rows, not slots, keeps the
    threads even when one slot carries most pairs (routing is skewed: a prompt pool's
    largest expert can take every token, the next few a handful)."""
    if not groups:
        return
    out_dims = out.shape[1]

    def work(o0, o1):
        for s, p in groups:  # a slot's input rows gathered by each thread: one slot's at a time held
            w = weight[s, o0:o1] if quant is None else quant.dense(s, o0, o1)  # [o1 - o0, I]
            out[p, o0:o1] = x[tok[p]] @ w.T

    with _BLAS.limit(limits=1, user_api="blas"):
        _parallel(work, out_dims, grain=64)


def switch_linear(leaf: nn.Module, x: np.ndarray, tok: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``leaf`` (``QuantizedSwitchLinear``/``SwitchLinear``) applied per pair.

    Args:
        leaf: holds ``weight`` ``[S, O, I]`` (packed uint32 ``[S, O, I*bits/32]``
            when quantized), ``scales``/``biases`` ``[S, O, G]``, optional ``bias`` ``[S, O]``.
        x: ``[R, I]`` float32 input rows.
        tok: ``[N]`` int, the row of ``x`` each pair reads.
        slots: ``[N]`` int, the slot each pair uses.

    Returns:
        ``[N, O]`` float32.

    Raises:
        ValueError: a quantization mode other than affine/mxfp4 (e.g. nvfp4 with
            a global scale).
    """
    return switch_linears([leaf], x, tok, slots)[0]


def switch_linears(leaves: list, x: np.ndarray, tok: np.ndarray, slots: np.ndarray) -> list[np.ndarray]:
    """:func:`switch_linear` of several leaves on the same input (a SwitchGLU's gate and
    up projections): the fused matvecs of all leaves run as one parallel call, so the
    pool is handed work once per call, not once per leaf. Returns ``[N, O_leaf]`` each."""
    groups = _groups(slots)
    outs, jobs, grains, preps = [], [], [], {}
    for leaf in leaves:
        quant = _Quant(leaf, stacked=True) if isinstance(leaf, QuantizedSwitchLinear) else None
        weight = None if quant is not None else _host(leaf["weight"])  # [S, O, I]
        out = np.empty((len(slots), quant.out_dims if quant is not None else weight.shape[1]), np.float32)
        big, pairs, part = groups, None, None
        if quant is not None:
            small = [p for s, p in groups if len(p) < quant.gemm_min_rows]
            big = [(s, p) for s, p in groups if len(p) >= quant.gemm_min_rows]
            pairs = np.concatenate(small) if small else None
        if pairs is not None:
            if quant.layout not in preps:  # the same pairs for every leaf of one layout
                preps[quant.layout] = _matvec_rows(quant, x, tok[pairs])
            xp, tp, prep = preps[quant.layout]
            part, job = quant.matvec_job(xp, tp, slots[pairs], prep)  # [len(pairs), O]
            jobs.append(job)
            grains.append(quant.grain)
        outs.append((out, part, pairs))
        _gemm_slots(quant, weight, x, tok, big, out)
    if jobs:
        _parallel_jobs(jobs, min(grains))
    result = []
    for leaf, (out, part, pairs) in zip(leaves, outs):
        if part is not None:
            if len(pairs) == len(slots) and (pairs == np.arange(len(slots))).all():
                out = part  # every pair took the matvec, in order: no scatter
            else:
                out[pairs] = part
        if "bias" in leaf:
            out += _host(leaf["bias"])[slots]
        result.append(out)
    return result


def _matvec_rows(quant: _Quant, x: np.ndarray, tok: np.ndarray) -> tuple:
    """``(rows, their index per pair, quant.prepare(rows))`` for matvec pairs reading rows
    ``tok`` of x ``[R, I]``: only the rows they read are prepared (a call whose other
    experts take the GEMM path reads few of x's rows); each row is prepared alone, so
    the values are those of preparing all of x."""
    rows, at = np.unique(tok, return_inverse=True)
    if len(rows) == len(x):
        return x, tok, quant.prepare(x)
    xp = x[rows]
    return xp, at.reshape(-1), quant.prepare(xp)


def unsupported(block: nn.Module) -> str | None:
    """Why the CPU kernel cannot compute this mlx-lm expert block, or ``None``
    when it can (affine and mxfp4 quantization, float weights; not mxfp8,
    nvfp4 or a per-expert global scale)."""
    for _, leaf in block.named_modules():
        mode = getattr(leaf, "mode", None)
        if mode is not None and (mode not in MODES or leaf.get("global_scale") is not None):
            return f"quantization mode {mode!r}" + (" with a global scale" if mode in MODES else "")
    return None


def _glu(activation: nn.Module, up: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """A SwitchGLU's ``activation(up, gate)`` on ``[N, H]`` float32 rows. mlx-lm's own
    ``SwiGLU`` (``silu(gate) * up``) is computed in numpy (:func:`_swiglu`), saving two MLX
    round trips per call; any other activation (gpt_oss's clamped variant...) runs as
    the block defines it."""
    if type(activation) is SwiGLU:
        return _swiglu(up, gate)
    return _host(activation(mx.array(up), mx.array(gate)))


def _swiglu(up: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """``gate / (1 + exp(-gate)) * up``, ``[N, H]`` float32, rows shared among the pool's
    threads (numpy's ufuncs drop the GIL), in place in one output array: the same float32
    operations in the same order as the plain expression, so bit-equal to it."""
    out = np.empty(gate.shape, np.float32)

    def rows(a, b):
        g, t = gate[a:b], out[a:b]
        with np.errstate(over="ignore"):  # exp(-gate) -> inf for gate << 0: silu -> -0, as in MLX
            np.exp(np.negative(g, out=t), out=t)
            t += np.float32(1.0)
            np.divide(g, t, out=t)
            t *= up[a:b]

    _parallel(rows, gate.shape[0], grain=ELEMENTWISE_GRAIN // max(gate.shape[1], 1) + 1)
    return out


def _leaf_min_rows(leaf: nn.Module) -> int:
    """:attr:`_Quant.gemm_min_rows` of a quantized leaf, from its attributes alone (no
    host views of its arrays)."""
    in_dims = leaf["scales"].shape[-1] * leaf.group_size
    vnni = cpu_vnni.usable(leaf.bits, leaf.group_size, MODES.get(leaf.mode, -1), in_dims)
    return integer_min_rows() if vnni else GEMM_MIN_ROWS


def integer_min_rows() -> int:
    """Rows of one slot from which a layout the integer loops serve takes dequantise + BLAS:
    :data:`VNNI_GEMM_MIN_ROWS` on AVX-512 VNNI, :data:`AVX2_GEMM_MIN_ROWS` where its
    instruction is emulated (:data:`mlx_tier.kernels.simd.EMULATED`)."""
    return VNNI_GEMM_MIN_ROWS if simd.NATIVE else AVX2_GEMM_MIN_ROWS


def _by_pairs(inner: nn.Module, slots: np.ndarray) -> bool:
    """Decode of a plain quantized SwiGLU block whose (token, expert) pairs split evenly
    among the threads: then :func:`_glu_by_pairs` serves it with one hand-off."""
    leaves = (inner.get("gate_proj"), inner.get("up_proj"), inner.get("down_proj"))
    return (isinstance(inner, SwitchGLU) and type(inner.activation) is SwiGLU and THREADS > 1
            and len(slots) > 0 and len(slots) % THREADS == 0
            and all(isinstance(q, QuantizedSwitchLinear) and "bias" not in q for q in leaves)
            and np.bincount(slots).max() < min(_leaf_min_rows(q) for q in leaves))  # no slot takes the GEMM path


def _glu_by_pairs(inner: nn.Module, x: np.ndarray, tok: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """``[N, D]`` float32: a bias-free quantized SwiGLU block, each thread computing whole
    pairs (gate, up, SwiGLU, down) — one hand-off to the threads per block instead of
    two, and no thread waits between the projections. Same row loops, same sums as
    the per-projection path, so bit-equal to it; where all three layers take the VNNI
    loops, a share is one GIL-free call (:func:`cpu_vnni.glu_pairs`: its SwiGLU is
    Numba's exp, not numpy's, so equal to fp32 rounding, not bit for bit)."""
    gate, up, down = (_Quant(inner[n], stacked=True) for n in ("gate_proj", "up_proj", "down_proj"))
    order = np.argsort(slots, kind="stable")  # pairs of a slot side by side: the rows' two-token steps
    tok, slots = tok[order], slots[order]
    y = np.empty((len(slots), down.out_dims), np.float32)

    prep = gate.prepare(x)  # x once for gate and up (and for both threads)
    uprep = prep if up.layout == gate.layout else None
    fused = prep[0] == "vnni" and uprep is not None and down.vnni

    def share(n0, n1):
        t, s = tok[n0:n1], slots[n0:n1]
        if fused and cpu_vnni.glu_pairs(gate.arrays, up.arrays, down.arrays, *prep[1:], t, s, y[n0:n1],
                                          cpu_vnni.TWO_TOKEN):
            return
        (g, gj), (u, uj) = gate.matvec_job(x, t, s, prep), up.matvec_job(x, t, s, uprep)
        gj[0](0, gj[1])
        uj[0](0, uj[1])
        h, hj = down.matvec_job(_glu(inner.activation, u, g), np.arange(n1 - n0), s)
        hj[0](0, hj[1])
        y[n0:n1] = h

    _parallel(share, len(slots), grain=len(slots) // THREADS)
    out = np.empty_like(y)
    out[order] = y
    return out


def _slow_rows(layer: nn.Module) -> bool:
    """Whether some quantized leaf of ``layer`` has no fast row loop: formats other than
    affine 4- and 8-bit, whose matvec rows (1.0-1.7 ns a weight) are slower than MLX's
    own op (0.4-0.9) on its CPU backend (benches/results/kernel-formats/NOTES.md); their
    few-row calls go to MLX, their GEMM calls (dequantised once) stay here. Asked on
    every call of a layer, so kept on the module (a plain attribute, not a parameter:
    a layer's format does not change)."""
    slow = getattr(layer, "_cpu_slow_rows", None)
    if slow is None:
        slow = any(getattr(m, "mode", None) in MODES and (MODES[m.mode], m.bits) not in ((0, 4), (0, 8))
                   for _, m in layer.named_modules())
        layer._cpu_slow_rows = slow
    return slow


def expert_forward(inner: nn.Module, x: mx.array, slots: mx.array | np.ndarray) -> mx.array:
    """An mlx-lm expert block computed by the CPU kernel, eagerly.

    Args:
        inner: ``SwitchGLU`` or ``SwitchMLP`` whose leaves hold the slot slabs.
        x: ``[..., D]`` activations.
        slots: ``[..., k]`` slot ids (the same leading shape as ``x``).

    Returns:
        ``[..., k, D]`` in ``x.dtype``, evaluated: what ``inner(x, slots)``
        returns, to fp32 rounding. The activation is the block's own
        (``inner.activation``), run by MLX on the ``[N, H]`` hidden rows;
        mlx-lm's plain ``SwiGLU`` is computed here in numpy (same formula).

    Raises:
        TypeError: ``inner`` is not a SwitchGLU/SwitchMLP.
        ValueError: an unsupported quantization mode.
    """
    mx.eval([x, slots] if isinstance(slots, mx.array) else x)  # one hand-off to MLX's thread, not two
    sl = np.asarray(slots).reshape(-1).astype(np.int64)  # [N]
    if _slow_rows(inner) and sl.size < GEMM_MIN_ROWS * len(np.unique(sl)):  # MLX's op is faster here
        y = inner(x, mx.array(slots) if isinstance(slots, np.ndarray) else slots)
        mx.eval(y)
        return y
    k, D = slots.shape[-1], x.shape[-1]
    xs = _host(x).reshape(-1, D)  # [T, D]; a numpy reshape: no MLX op to evaluate
    tok = np.arange(sl.size) // k  # [N] token of each pair
    pair = np.arange(sl.size)
    if _by_pairs(inner, sl):
        y = _glu_by_pairs(inner, xs, tok, sl)  # [N, D]
    elif isinstance(inner, SwitchGLU):
        up, gate = switch_linears([inner.up_proj, inner.gate_proj], xs, tok, sl)  # [N, H] each
        h = _glu(inner.activation, up, gate)
        y = switch_linear(inner.down_proj, h, pair, sl)  # [N, D]
    elif isinstance(inner, SwitchMLP):
        h = _host(inner.activation(mx.array(switch_linear(inner.fc1, xs, tok, sl))))
        y = switch_linear(inner.fc2, h, pair, sl)
    else:
        raise TypeError(f"CPU kernel: {type(inner).__name__} is not a SwitchGLU/SwitchMLP")
    y = mx.array(y).reshape(*slots.shape, D)
    return y if x.dtype == mx.float32 else y.astype(x.dtype)
