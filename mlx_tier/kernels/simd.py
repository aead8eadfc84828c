"""The few AVX-512 vector values and ops the VNNI row loops need, as Numba intrinsics.

Numba has no vector types, and its loop vectoriser cannot emit VNNI's integer
dot products (``vpdpbusd``), so :mod:`mlx_tier.kernels.cpu_vnni` writes its inner
loop with these: two value types that lower to LLVM's ``<16 x i32>`` and
``<16 x float>`` (one zmm register each), and one intrinsic per instruction.
Loop control, indexing and the arrays stay ordinary Numba code; the values
live in registers (the technique: Numba's ``@intrinsic`` + ``PrimitiveModel``,
numba docs "Low-level extension API").

Only call these where :data:`AVAILABLE` is true: LLVM cannot lower the VNNI
intrinsic for a CPU without AVX-512 VNNI, and its error ends the process.
The loads take contiguous 1-D arrays only (the typing refuses others).

Numba's cache (``cache=True`` in cpu_vnni) is invalidated by its own file's
changes only: after editing this file, touch ``cpu_vnni.py`` (or clear its
``__pycache__``) so the loops are compiled again with the new intrinsics.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import config, types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model


def _host_has_vnni() -> bool:
    """AVX-512 F/BW/VNNI on this CPU, and Numba compiling for this CPU (``NUMBA_CPU_NAME``
    set to a generic target would leave the instructions out)."""
    if config.CPU_NAME not in (None, "host") or config.CPU_FEATURES or config.DISABLE_JIT:
        return False
    try:
        feats = llvm.get_host_cpu_features()
    except RuntimeError:  # a host LLVM cannot describe (e.g. some emulators)
        return False
    return all(feats.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni"))


AVAILABLE = _host_has_vnni()


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
    unsigned bytes of ``u`` and signed bytes of ``s`` (AVX-512 VNNI)."""
    def codegen(context, builder, sig, args):
        return builder.call(_fn(builder, "llvm.x86.avx512.vpdpbusd.512", _LI, [_LI] * 3), list(args))
    return I16(I16, I16, I16), codegen


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

