"""4-bit affine matvec rows on integer dot products: AVX-512 VNNI's, or AVX2's pair (decode path).

Why: the float32 row loops of :mod:`mlx_tier.kernels.cpu` spend ~3.5 vector ops
per 8 weights (widen, convert, FMA...) and run at the FP pipes' limit, ~40% of
this machine's streaming read (benches/kernel.py, docs/kernels.md).
``vpdpbusd`` multiplies 64 unsigned bytes by 64 signed bytes and sums them by
fours into 16 int32 lanes in one instruction, so the 4-bit codes are used as
bytes and never converted to float one by one.

How (the decomposition of llama.cpp's q4/q8 dot products, made exact): x is
written per run of 8 inputs (one int32 lane's) as ``2**e * m`` with integers
``|m| <= 127 * 2**16`` (23 bits relative to the run's largest |x|), and ``m``
as three signed base-256 digits ``m = d0 2**16 + d1 2**8 + d2``. Then a lane's
``q . x = 2**e (2**16 (q.d0) + 2**8 (q.d1) + q.d2)``: three exact integer dot
products, chained through one int32 accumulator (shifted a digit's place between
them; every partial sum stays below 2**30) and rounded once to float32. Each row
sums ``scale_g * (q . x)_g`` over its groups plus ``bias_g * sum(x_g)``. The only
rounding beyond float32 sums is x's to 23 bits of its run's largest value
(tests/kernels/test_cpu_vnni.py bounds both).

Loop: 64 bytes of a row (128 codes, 1-4 groups) per step; four rows at a time
share the loads of x's digits, the four a quarter of the share's rows apart
(long sequential streams for the hardware prefetcher: docs/kernels.md). Two
pairs of the same slot side by side (a pool's tokens of one expert, sorted by
slot) take a GEMM-shaped step: each step of the four rows is loaded, unpacked
and scaled once for both tokens (the register blocking of a GEMM micro-kernel:
Goto and van de Geijn, "Anatomy of high-performance matrix multiplication",
2008), each (row, token) summing the same terms in the same order, so bit-equal
to the one-token rows. Needs the row length ``I`` a multiple of 128; other
shapes, other bit widths, non-finite x and rows whose largest |x| is below
2**-80 (their 2**e would leave float32's normal range) use the float32 loops.

On a CPU with AVX2 but no VNNI the same loops run with ``vpdpbusd`` written as
``vpmaddubsw`` + ``vpmaddwd`` (:mod:`mlx_tier.kernels.simd`): bit-identical
results, 1.5-1.7x the float32 loops' speed on a projection and a decode step
1.18-1.25x faster on an AVX2-only EPYC (benches/results/kernel-avx2/NOTES.md).

Off switch: ``MLX_TIER_VNNI=0`` in the environment (or :data:`ENABLED` = False).
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import njit

from mlx_tier.kernels.simd import (
    AVAILABLE,
    dpbusd,
    fma,
    fzero,
    hsum,
    izero,
    load_f,
    load_i,
    mul,
    nibbles,
    shl8,
    spread,
    to_float,
)

ENABLED = AVAILABLE and os.environ.get("MLX_TIER_VNNI", "1") != "0"
TWO_TOKEN = True  # the two-token step for pairs of one slot; False: one token at a time (benches compare)
LIMB_MAX = 127 * 2**16  # the largest |m|: its top digit stays within int8
TINY = 2.0**-80  # a row's largest |x| below this (and not 0) takes the float32 loops
CHUNK = 64  # bytes of a packed row per step (128 4-bit codes)
GROUP_SIZES = (32, 64, 128)
FM = {"reassoc", "contract"}


def layout_fits(bits: int, gs: int, mode: int, in_dims: int) -> bool:
    """Whether :func:`qmv4`'s loops can serve this layout on a CPU that has them: affine
    ``mode`` 0, 4-bit, group size 32/64/128, ``in_dims`` a multiple of 128. The same
    answer on every machine."""
    return (bits, mode) == (4, 0) and gs in GROUP_SIZES and in_dims % (2 * CHUNK) == 0


def usable(bits: int, gs: int, mode: int, in_dims: int) -> bool:
    """Whether :func:`qmv4` serves this layout on this machine: the layout fits
    (:func:`layout_fits`), the CPU has AVX-512 VNNI or AVX2 (:data:`AVAILABLE`) and the loops
    are not switched off (:data:`ENABLED`)."""
    return AVAILABLE and ENABLED and layout_fits(bits, gs, mode, in_dims)


@njit(nogil=True, cache=True)
def _fits(x):
    """x [R, I] can be written in digits: finite, and each row's largest |x| is 0 or at
    least :data:`TINY` (so every 2**e and scale * 2**e stays a normal float32)."""
    for r in range(x.shape[0]):
        m = 0.0
        for i in range(x.shape[1]):
            v = abs(np.float64(x[r, i]))
            if not np.isfinite(v):
                return False
            m = max(m, v)
        if 0.0 < m < TINY:
            return False
    return True


@njit(nogil=True, cache=True)
def _digits(x, gs, xl, ex, xs):
    """Fill xl [R, 3, 2, I/2] int8 (digit, parity, i // 2), ex [R, I/8] float32 (2**e of
    each run of 8 inputs: one vector lane's) and xs [R, G] float32 (group sums) from
    x [R, I] float32."""
    R, I = x.shape
    for r in range(R):
        for g in range(I // gs):
            s = 0.0
            for i in range(g * gs, (g + 1) * gs):
                s += x[r, i]
            xs[r, g] = s
        for j in range(I // 8):
            m = 0.0
            for i in range(8 * j, 8 * j + 8):
                m = max(m, abs(np.float64(x[r, i])))
            e = 0 if m == 0.0 else math.frexp(m / LIMB_MAX)[1]  # m * 2**-e < LIMB_MAX
            ex[r, j] = math.ldexp(1.0, e)
            scale = math.ldexp(1.0, -e)
            for i in range(8 * j, 8 * j + 8):
                q = np.int64(np.rint(np.float64(x[r, i]) * scale))
                d2 = ((q + 128) & 255) - 128
                q = (q - d2) >> 8
                d1 = ((q + 128) & 255) - 128
                xl[r, 0, i & 1, i >> 1] = (q - d1) >> 8
                xl[r, 1, i & 1, i >> 1] = d1
                xl[r, 2, i & 1, i >> 1] = d2


def prepare(x: np.ndarray, gs: int) -> tuple | None:
    """:func:`qmv4`'s input for x ``[R, I]`` float32: ``(xl [R, 3, 2, I/2] int8, ex
    [R, I/8] float32, xs [R, G] float32)`` (see :func:`_digits`), or ``None`` when x
    holds inf/NaN (the float32 loops then propagate them as MLX does) or a row too
    small for float32 exponents (:func:`_fits`)."""
    x = np.ascontiguousarray(x, np.float32)
    if not _fits(x):
        return None
    R, I = x.shape
    xl = np.empty((R, 3, 2, I // 2), np.int8)
    ex = np.empty((R, I // 8), np.float32)
    xs = np.empty((R, I // gs), np.float32)
    _digits(x, gs, xl, ex, xs)
    return xl, ex, xs


@njit(nogil=True, inline="always")
def _dots(lo, hi, xr, b):
    """One 64-byte step's 16 lanes against x's digits ``xr`` [3, 2, I/2] at byte ``b``,
    each the exact ``2**16 (q.d0) + 2**8 (q.d1) + q.d2`` of its 8 codes, as float32.
    The digits' dot products are chained through one int32 accumulator, shifted a
    digit's place between them: every partial sum stays below 2**30 (8 codes of at
    most 15 times digits of at most 128: 15,360 a digit), so the join is exact in
    integers and rounded once, in the conversion."""
    a = dpbusd(dpbusd(izero(), lo, load_i(xr[0, 0], b)), hi, load_i(xr[0, 1], b))
    a = dpbusd(dpbusd(shl8(a), lo, load_i(xr[1, 0], b)), hi, load_i(xr[1, 1], b))
    a = dpbusd(dpbusd(shl8(a), lo, load_i(xr[2, 0], b)), hi, load_i(xr[2, 1], b))
    return to_float(a)


@njit(nogil=True, inline="always")
def _bias(br, xs):
    """sum_g bias_g * sum(x_g) of one row."""
    acc = np.float32(0.0)
    for g in range(xs.shape[0]):
        acc += br[g] * xs[g]
    return acc


@njit(nogil=True, inline="always")
def _rows4(w, s, bi, xr, er, xsr, out, o, q, per, lanes):
    """out[o + i*q] for i = 0..3: four rows of one slot, ``q`` rows apart (four long
    sequential streams through the slot, which the hardware prefetcher follows; four
    adjacent rows read 1 KiB runs and ran at half the speed from memory, benches/results/kernel-vnni/NOTES.md)."""
    acc0, acc1, acc2, acc3 = fzero(), fzero(), fzero(), fzero()
    w0, w1, w2, w3 = w[o], w[o + q], w[o + 2 * q], w[o + 3 * q]
    s0, s1, s2, s3 = s[o], s[o + q], s[o + 2 * q], s[o + 3 * q]
    for c in range(w0.shape[0] // CHUNK):
        b, g0 = c * CHUNK, c * per
        e = load_f(er, c * 16)
        lo, hi = nibbles(load_i(w0, b))
        acc0 = fma(_dots(lo, hi, xr, b), mul(spread(s0, g0, lanes), e), acc0)
        lo, hi = nibbles(load_i(w1, b))
        acc1 = fma(_dots(lo, hi, xr, b), mul(spread(s1, g0, lanes), e), acc1)
        lo, hi = nibbles(load_i(w2, b))
        acc2 = fma(_dots(lo, hi, xr, b), mul(spread(s2, g0, lanes), e), acc2)
        lo, hi = nibbles(load_i(w3, b))
        acc3 = fma(_dots(lo, hi, xr, b), mul(spread(s3, g0, lanes), e), acc3)
    out[o] = hsum(acc0) + _bias(bi[o], xsr)
    out[o + q] = hsum(acc1) + _bias(bi[o + q], xsr)
    out[o + 2 * q] = hsum(acc2) + _bias(bi[o + 2 * q], xsr)
    out[o + 3 * q] = hsum(acc3) + _bias(bi[o + 3 * q], xsr)


@njit(nogil=True, inline="always")
def _step2(wr, sr, b, g0, lanes, xa, xb, e_a, e_b, acc_a, acc_b):
    """One 64-byte step of row ``wr`` (scales ``sr``) for two tokens: the codes unpacked and
    the scales spread once, then each token's lanes added to its accumulator."""
    sc = spread(sr, g0, lanes)
    lo, hi = nibbles(load_i(wr, b))
    return fma(_dots(lo, hi, xa, b), mul(sc, e_a), acc_a), fma(_dots(lo, hi, xb, b), mul(sc, e_b), acc_b)


@njit(nogil=True, inline="always")
def _rows4x2(w, s, bi, xa, ea, xsa, xb, eb, xsb, outa, outb, o, q, per, lanes):
    """:func:`_rows4`'s four rows for two tokens ``a`` and ``b`` of the same slot: each
    weight step is loaded, unpacked and scaled once for both tokens, x's digits once
    for the four rows (the GEMM-shaped share). Each (row, token) sums the same terms
    in the same order as :func:`_rows4`, so the results are bit-equal to it."""
    a0, a1, a2, a3 = fzero(), fzero(), fzero(), fzero()
    b0, b1, b2, b3 = fzero(), fzero(), fzero(), fzero()
    w0, w1, w2, w3 = w[o], w[o + q], w[o + 2 * q], w[o + 3 * q]
    s0, s1, s2, s3 = s[o], s[o + q], s[o + 2 * q], s[o + 3 * q]
    for c in range(w0.shape[0] // CHUNK):
        b, g0 = c * CHUNK, c * per
        e_a, e_b = load_f(ea, c * 16), load_f(eb, c * 16)
        a0, b0 = _step2(w0, s0, b, g0, lanes, xa, xb, e_a, e_b, a0, b0)
        a1, b1 = _step2(w1, s1, b, g0, lanes, xa, xb, e_a, e_b, a1, b1)
        a2, b2 = _step2(w2, s2, b, g0, lanes, xa, xb, e_a, e_b, a2, b2)
        a3, b3 = _step2(w3, s3, b, g0, lanes, xa, xb, e_a, e_b, a3, b3)
    outa[o] = hsum(a0) + _bias(bi[o], xsa)
    outb[o] = hsum(b0) + _bias(bi[o], xsb)
    outa[o + q] = hsum(a1) + _bias(bi[o + q], xsa)
    outb[o + q] = hsum(b1) + _bias(bi[o + q], xsb)
    outa[o + 2 * q] = hsum(a2) + _bias(bi[o + 2 * q], xsa)
    outb[o + 2 * q] = hsum(b2) + _bias(bi[o + 2 * q], xsb)
    outa[o + 3 * q] = hsum(a3) + _bias(bi[o + 3 * q], xsa)
    outb[o + 3 * q] = hsum(b3) + _bias(bi[o + 3 * q], xsb)


@njit(nogil=True, inline="always")
def _row(w, s, bi, xr, er, xsr, out, o, per, lanes):
    """out[o] for row o alone (the rows left after the blocks of four)."""
    acc = fzero()
    for c in range(w.shape[1] // CHUNK):
        lo, hi = nibbles(load_i(w[o], c * CHUNK))
        acc = fma(_dots(lo, hi, xr, c * CHUNK), mul(spread(s[o], c * per, lanes), load_f(er, c * 16)), acc)
    out[o] = hsum(acc) + _bias(bi[o], xsr)


@njit(nogil=True, inline="always")
def _pair(sw, ss, sb, xr, er, xsr, on, o0, o1, per, lanes):
    """Rows o0..o1 of one (token, slot) pair."""
    q = (o1 - o0) // 4
    for o in range(o0, o0 + q):
        _rows4(sw, ss, sb, xr, er, xsr, on, o, q, per, lanes)
    for o in range(o0 + 4 * q, o1):
        _row(sw, ss, sb, xr, er, xsr, on, o, per, lanes)


@njit(nogil=True, inline="always")
def _two_pairs(sw, ss, sb, xl, ex, xs, ta, tb, outa, outb, per, lanes):
    """All rows of two pairs that share a slot (tokens ``ta``, ``tb``)."""
    O = outa.shape[0]
    q = O // 4
    xa, ea, xsa, xb, eb, xsb = xl[ta], ex[ta], xs[ta], xl[tb], ex[tb], xs[tb]
    for o in range(q):
        _rows4x2(sw, ss, sb, xa, ea, xsa, xb, eb, xsb, outa, outb, o, q, per, lanes)
    for o in range(4 * q, O):
        _row(sw, ss, sb, xa, ea, xsa, outa, o, per, lanes)
        _row(sw, ss, sb, xb, eb, xsb, outb, o, per, lanes)


@njit(nogil=True, inline="always")
def _pairs(w, scales, biases, xl, ex, xs, tok, slots, out, f0, f1, per, lanes, two):
    O = out.shape[1]
    n, n1 = f0 // O, (f1 + O - 1) // O
    while n < n1:
        sw, ss, sb = w[slots[n]], scales[slots[n]], biases[slots[n]]
        o0, o1 = max(f0 - n * O, 0), min(f1 - n * O, O)
        whole = o0 == 0 and o1 == O
        if two and whole and n + 1 < n1 and slots[n + 1] == slots[n] and f1 >= (n + 2) * O:  # a GEMM-shaped step
            _two_pairs(sw, ss, sb, xl, ex, xs, tok[n], tok[n + 1], out[n], out[n + 1], per, lanes)
            n += 2
            continue
        _pair(sw, ss, sb, xl[tok[n]], ex[tok[n]], xs[tok[n]], out[n], o0, o1, per, lanes)
        n += 1


@njit(fastmath=FM, nogil=True, cache=True)
def qmv4(gs, w, scales, biases, xl, ex, xs, tok, slots, out, f0, f1, two=True):
    """out[n, o] = dequant(w[slots[n], o]) . x[tok[n]] for flat f = n*O + o in [f0, f1).

    w [S, O, I/2] uint8 (4-bit affine codes, rows contiguous); scales, biases [S, O, G]
    float32; xl, ex, xs: :func:`prepare`'s arrays; tok, slots [N] int64; out [N, O]
    float32; ``two``: adjacent pairs of one slot take the two-token step (bit-equal
    either way; :data:`TWO_TOKEN`). Call only where :func:`usable` (AVX-512 VNNI or AVX2).
    """
    if gs != 32 and gs != 64 and gs != 128:
        raise ValueError("qmv4: group size must be 32, 64 or 128")
    if gs == 32:
        _pairs(w, scales, biases, xl, ex, xs, tok, slots, out, f0, f1, 4, 4, two)
    elif gs == 64:
        _pairs(w, scales, biases, xl, ex, xs, tok, slots, out, f0, f1, 2, 8, two)
    else:
        _pairs(w, scales, biases, xl, ex, xs, tok, slots, out, f0, f1, 1, 16, two)


@njit(fastmath=FM, nogil=True, cache=True)
def glu_pairs(gate, up, down, xl, ex, xs, tok, slots, y, two=True):
    """y[n] = down(silu(gate x) * up x) for the pairs of a bias-free 4-bit SwiGLU block, in
    one call without the GIL: a thread's whole share of the block's decode (gate and up
    of one layout, so x's digits serve both); ``two``: as :func:`qmv4`'s.

    gate, up, down: ``(group size, w [S, O, I/2] uint8, scales, biases [S, O, G])``;
    xl, ex, xs: :func:`prepare`'s arrays of x; tok, slots [N] int64; y [N, D] float32.
    Returns False, leaving y unfinished, when the hidden rows cannot be written in
    digits (:func:`_fits`: overflow, or all tiny); the caller then takes the float32
    loops.
    """
    N, H = slots.shape[0], gate[1].shape[1]
    g = np.empty((N, H), np.float32)
    u = np.empty((N, H), np.float32)
    qmv4(gate[0], gate[1], gate[2], gate[3], xl, ex, xs, tok, slots, g, 0, N * H, two)
    qmv4(up[0], up[1], up[2], up[3], xl, ex, xs, tok, slots, u, 0, N * H, two)
    h = g / (np.float32(1.0) + np.exp(-g)) * u  # mlx-lm's SwiGLU: silu(gate) * up
    if not _fits(h):
        return False
    gs = down[0]
    hl = np.empty((N, 3, 2, H // 2), np.int8)
    he = np.empty((N, H // 8), np.float32)
    hs = np.empty((N, H // gs), np.float32)
    _digits(h, gs, hl, he, hs)
    qmv4(gs, down[1], down[2], down[3], hl, he, hs, np.arange(N), slots, y, 0, N * y.shape[1], two)
    return True


def reference(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, x: np.ndarray, gs: int) -> np.ndarray:
    """What :func:`qmv4` computes, in numpy (float64 sums of the same exact integer dot
    products): rows w [O, I/2] uint8, scales/biases [O, G], x [I] -> [O]. Tests the
    digit decomposition on any CPU."""
    xl, ex, xs = prepare(x[None], gs)
    q = np.stack([w & 15, w >> 4], axis=1).astype(np.int64)  # [O, 2, I/2]: even, odd codes
    d = xl[0].astype(np.int64)  # [3, 2, I/2]
    runs = [(q * d[k][None]).reshape(w.shape[0], 2, -1, 4).sum((1, 3)) for k in range(3)]  # [O, I/8]
    lanes = (runs[0] * 65536.0 + runs[1] * 256.0 + runs[2]) * ex[0]  # each run of 8 inputs
    dots = lanes.reshape(w.shape[0], -1, gs // 8).sum(-1)  # [O, G]
    return (dots * scales + biases * xs[0]).sum(-1)
