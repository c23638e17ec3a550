"""Eight-float vectors for numba kernels: a numba type lowered to LLVM's ``<8 x float>``.

numba vectorises loops, not straight-line code (its SLP vectoriser is off), and arrays in a loop
are reloaded and stored on every pass (no alias information). A kernel that keeps a register tile
of accumulators across a whole reduction (matmul.py's gemm) says so with these values: each
``f32x8`` local is one 256-bit register. The arithmetic is lane-wise IEEE float32 exactly as the
scalar code: :func:`vfma` is ``llvm.fma.v8f32`` (one rounding per lane, ``vfmadd...ps``),
:func:`vadd` a lane-wise ``fadd``; no fastmath, nothing reassociated.

Loads and stores are unchecked (no bounds, no negative-index wraparound): callers index arrays
they allocated to fit.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 8
_VEC = ir.VectorType(ir.FloatType(), LANES)


class F32x8(types.Type):
    def __init__(self):
        super().__init__(name="f32x8")


f32x8 = F32x8()


@register_model(F32x8)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC)


def _is_f32_array(arr, i):
    return isinstance(arr, types.Array) and arr.dtype == types.float32 and isinstance(i, types.Integer)


def _lane_pointer(context, builder, arrty, arr, i):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [i]), _VEC.as_pointer())


@intrinsic
def vzero(typingctx):
    """Eight +0.0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC, [0.0] * LANES)
    return f32x8(), codegen


@intrinsic
def vsplat(typingctx, x):
    """x in every lane (a broadcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        one = builder.insert_element(ir.Constant(_VEC, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(_VEC, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))
    return f32x8(x), codegen


@intrinsic
def vload(typingctx, arr, i):
    """arr.flat[i : i + 8] of a C-contiguous float32 array (unchecked)."""
    if not _is_f32_array(arr, i):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(_lane_pointer(context, builder, sig.args[0], *args), align=4)
    return f32x8(arr, i), codegen


@intrinsic
def vstore(typingctx, arr, i, v):
    """arr.flat[i : i + 8] = v (unchecked)."""
    if not (_is_f32_array(arr, i) and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        builder.store(args[2], _lane_pointer(context, builder, sig.args[0], args[0], args[1]), align=4)
        return context.get_dummy_value()
    return types.none(arr, i, v), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """Lane-wise a*b + c rounded once (IEEE fusedMultiplyAdd per lane)."""
    if not (a == f32x8 and b == f32x8 and c == f32x8):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32")
        return builder.call(fn, args)
    return f32x8(f32x8, f32x8, f32x8), codegen


@intrinsic
def vadd(typingctx, a, b):
    """Lane-wise a + b."""
    if not (a == f32x8 and b == f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(*args)
    return f32x8(f32x8, f32x8), codegen


@intrinsic
def vcanon(typingctx, v):
    """v with every NaN lane replaced by the canonical NaN (0x7FC00000): a compare and a blend."""
    if v != f32x8:
        return None

    def codegen(context, builder, sig, args):
        nan = builder.bitcast(ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0x7FC00000] * LANES), _VEC)
        return builder.select(builder.fcmp_unordered("uno", args[0], args[0]), nan, args[0])
    return f32x8(f32x8), codegen
