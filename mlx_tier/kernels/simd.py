"""The few 512-bit vector values and ops the integer row loops need, as Numba intrinsics.

Numba has no vector types, and its loop vectoriser cannot emit VNNI's integer
dot products (``vpdpbusd``), so :mod:`mlx_tier.kernels.cpu_vnni` writes its inner
loop with these: two value types that lower to LLVM's ``<16 x i32>`` and
``<16 x float>`` (one zmm register each, or two ymm registers on AVX2), and one
intrinsic per instruction. Loop control, indexing and the arrays stay ordinary
Numba code; the values live in registers (the technique: Numba's ``@intrinsic``
+ ``PrimitiveModel``, numba docs "Low-level extension API").

On a CPU with AVX2 and FMA but no AVX-512 VNNI (:data:`EMULATED`), :func:`dpbusd`
is two AVX2 instructions a 256-bit half: ``vpmaddubsw`` (unsigned by signed
bytes, adjacent pairs summed to int16) then ``vpmaddwd`` by ones (int16 pairs
summed to int32), added to the accumulator: the same sums (the row loops' bytes
are 4-bit codes of at most 15 and digits of at most 128 in magnitude, so a pair
is at most 3,840 and int16 never saturates), so the loops' results are
bit-identical to VNNI's (llama.cpp's AVX2 q4/q8 dot products use the same pair).

Only call these where :data:`AVAILABLE` is true: LLVM cannot lower the
intrinsics for a CPU without them, and its error ends the process.
The loads take contiguous 1-D arrays only (the typing refuses others).

Numba's cache (``cache=True`` in cpu_vnni) is invalidated by its own file's
changes only: after editing this file, touch ``cpu_vnni.py`` (or clear its
``__pycache__``) so the loops are compiled again with the new intrinsics. (Its
index is keyed by the CPU, so a native and an emulated build never mix.)
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def _host_has(*features: str) -> bool:
    """All of ``features`` on this CPU, and Numba compiling for this CPU (``NUMBA_CPU_NAME``
    set to a generic target would leave the instructions out)."""
    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES or config.DISABLE_JIT:
        return False
    if not config.ENABLE_AVX:  # NUMBA_ENABLE_AVX=0: Numba's target drops every avx* feature
        return False
    try:
        feats = llvm.get_host_cpu_features()
    except RuntimeError:  # a host LLVM cannot describe (e.g. some emulators)
        return False
    return all(feats.get(f, False) for f in features)


NATIVE = _host_has("avx512f", "avx512bw", "avx512vnni")  # vpdpbusd itself
EMULATED = not NATIVE and _host_has("avx2", "fma")  # vpdpbusd as vpmaddubsw + vpmaddwd (module doc)
AVAILABLE = NATIVE or EMULATED
# What computes the integer loops' dot products here, in words (the benches' captions).
DOT = "AVX-512 VNNI" if NATIVE else "AVX2 (vpdpbusd emulated)" if EMULATED else "none"


class Vec16(types.Type):
    """A 16-lane vector value: ``kind`` "i" (int32 lanes) or "f" (float32 lanes)."""

    def __init__(self, kind: str):
        self.kind = kind
        super().__init__(name=f"Vec16{kind}")


I16, F16 = Vec16("i"), Vec16("f")
_LI = ir.VectorType(ir.IntType(32), 16)
_LF = ir.VectorType(ir.FloatType(), 16)
_MASK_TY = ir.VectorType(ir.IntType(32), 16)


@register_model(Vec16)
class _Vec16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _LI if fe_type.kind == "i" else _LF)


def _splat(ty: ir.VectorType, v) -> ir.Constant:
    return ir.Constant(ty, [v] * 16)


def _at(context, builder, aty, arr, idx):
    """Pointer to element ``idx`` of a 1-D array value."""
    return builder.gep(context.make_array(aty)(context, builder, arr).data, [idx])


def _row(arr, dtypes) -> bool:
    """``arr`` types as a contiguous 1-D array of one of ``dtypes`` (what the loads read)."""
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C" and arr.dtype in dtypes


def _fn(builder, name: str, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _load(arr, idx, dtypes, vec: ir.VectorType, ret: Vec16, align: int):
    """Signature and codegen of a vector load from a 1-D array of ``dtypes`` (or None:
    Numba then reports no matching implementation)."""
    if not _row(arr, dtypes):
        return None

    def codegen(context, builder, sig, args):
        p = _at(context, builder, sig.args[0], *args)
        return builder.load(builder.bitcast(p, vec.as_pointer()), align=align)
    return ret(arr, idx), codegen


@intrinsic
def load_i(typingctx, arr, idx):
    """64 bytes of a contiguous 1-D uint8/int8 array from element ``idx`` (unaligned)."""
    return _load(arr, idx, (types.uint8, types.int8), _LI, I16, 1)


@intrinsic
def load_f(typingctx, arr, idx):
    """16 float32 of a contiguous 1-D float32 array from element ``idx``."""
    return _load(arr, idx, (types.float32,), _LF, F16, 4)


@intrinsic
def nibbles(typingctx, v):
    """``(v & 0x0F, v >> 4 & 0x0F)`` per byte: the low and high 4-bit codes of 64 bytes."""
    def codegen(context, builder, sig, args):
        m = _splat(_LI, 0x0F0F0F0F)
        lo = builder.and_(args[0], m)
        hi = builder.and_(builder.lshr(args[0], _splat(_LI, 4)), m)
        return context.make_tuple(builder, sig.return_type, (lo, hi))
    return types.UniTuple(I16, 2)(I16), codegen


@intrinsic
def izero(typingctx):
    """An all-zero int32 vector."""
    return I16(), lambda context, builder, sig, args: _splat(_LI, 0)


@intrinsic
def fzero(typingctx):
    """An all-zero float32 vector."""
    return F16(), lambda context, builder, sig, args: _splat(_LF, 0.0)


@intrinsic
def dpbusd(typingctx, acc, u, s):
    """``vpdpbusd``: each int32 lane of ``acc`` plus the sum of its 4 products of
    unsigned bytes of ``u`` and signed bytes of ``s`` (AVX-512 VNNI; on AVX2,
    :func:`_dpbusd_avx2`: exact while no adjacent pair of products leaves int16)."""
    def codegen(context, builder, sig, args):
        if not NATIVE:
            return _dpbusd_avx2(builder, *args)
        return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _LI, [_LI] * 3), list(args))
    return I16(I16, I16, I16), codegen


def _dpbusd_avx2(builder, acc, u, s):
    """:func:`dpbusd` on AVX2, per 256-bit half: ``vpmaddubsw`` (u8 x s8, adjacent pairs
    summed with int16 saturation), ``vpmaddwd`` by ones (int16 pairs to int32), added."""
    i8, i16, i32 = (ir.VectorType(ir.IntType(b), n) for b, n in ((8, 32), (16, 16), (32, 8)))
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", i16, [i8, i8])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", i32, [i16, i16])
    undef, ones = ir.Constant(_LI, ir.Undefined), ir.Constant(i16, [1] * 16)
    halves = []
    for h in range(2):
        lanes = ir.Constant(i32, list(range(8 * h, 8 * h + 8)))
        uh, sh, ah = (builder.shuffle_vector(v, undef, lanes) for v in (u, s, acc))
        pairs = builder.call(maddubs, [builder.bitcast(uh, i8), builder.bitcast(sh, i8)])
        halves.append(builder.add(ah, builder.call(maddwd, [pairs, ones])))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_MASK_TY, list(range(16))))


@intrinsic
def shl8(typingctx, v):
    """Each int32 lane shifted left by 8 bits (times 256: the next base-256 digit's place)."""
    return I16(I16), lambda context, builder, sig, args: builder.shl(args[0], _splat(_LI, 8))


@intrinsic
def to_float(typingctx, v):
    """Each int32 lane converted to float32 (rounded to nearest, ties to even)."""
    return F16(I16), lambda context, builder, sig, args: builder.sitofp(args[0], _LF)


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` per lane, one rounding."""
    def codegen(context, builder, sig, args):
        return builder.call(_fn(builder, "llvm.fma.v16f32", _LF, [_LF] * 3), list(args))
    return F16(F16, F16, F16), codegen


@intrinsic
def mul(typingctx, a, b):
    """``a * b`` per lane."""
    return F16(F16, F16), lambda context, builder, sig, args: builder.fmul(*args)


@intrinsic
def spread(typingctx, arr, g0, lanes):
    """``arr[g0 + j // lanes]`` for lanes j = 0..15 of a float32 array: one value per
    run of ``lanes`` lanes (``lanes``: a compile-time 4, 8 or 16; reads 16 / lanes
    elements)."""
    if not _row(arr, (types.float32,)):
        return None
    if not isinstance(lanes, types.IntegerLiteral):
        return None  # Numba retries with the literal
    n = lanes.literal_value
    if n not in (4, 8, 16):
        raise ValueError(f"spread: lanes must be 4, 8 or 16, not {n}")

    def codegen(context, builder, sig, args):
        p = _at(context, builder, sig.args[0], args[0], args[1])
        vt = ir.VectorType(ir.FloatType(), 16 // n)
        v = builder.load(builder.bitcast(p, vt.as_pointer()), align=4)
        mask = ir.Constant(_MASK_TY, [j // n for j in range(16)])
        return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), mask)
    return F16(arr, g0, lanes), codegen


@intrinsic
def hsum(typingctx, v):
    """The sum of the 16 lanes (any order) as float32."""
    def codegen(context, builder, sig, args):
        fn = _fn(builder, "llvm.vector.reduce.fadd.v16f32", ir.FloatType(), [ir.FloatType(), _LF])
        return builder.call(fn, [ir.Constant(ir.FloatType(), 0.0), args[0]], fastmath=("reassoc",))
    return types.float32(F16), codegen

