"""Eight-float vectors for numba kernels: a numba type lowered to LLVM's ``<8 x float>``.

numba vectorises loops, not straight-line code (its SLP vectoriser is off), and arrays in a loop
are reloaded and stored on every pass (no alias information). A kernel that keeps a register tile
of accumulators across a whole reduction (matmul.py's gemm) says so with these values: each
``f32x8`` local is one 256-bit register, each ``f32x16`` one 512-bit register (AVX-512; LLVM splits
it in two elsewhere, same bits). The arithmetic is lane-wise IEEE float32 exactly as the
scalar code: :func:`vfma` is ``llvm.fma.v8f32`` (one rounding per lane, ``vfmadd...ps``),
:func:`vadd` a lane-wise ``fadd``; no fastmath, nothing reassociated.

Loads and stores are unchecked (no bounds, no negative-index wraparound): callers index arrays
they allocated to fit.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
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


class F32x16(types.Type):
    def __init__(self):
        super().__init__(name="f32x16")


f32x16 = F32x16()
_VEC16 = ir.VectorType(ir.FloatType(), 2 * LANES)


@register_model(F32x16)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VEC16)


_VECTORS = {f32x8: _VEC, f32x16: _VEC16}  # the lane-wise ops below take either width


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
    """Lane-wise a*b + c rounded once (IEEE fusedMultiplyAdd per lane), eight or sixteen lanes."""
    if not (a in _VECTORS and b == a and c == a):
        return None
    vec = _VECTORS[a]

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3),
                                            f"llvm.fma.v{vec.count}f32")
        return builder.call(fn, args)
    return a(a, a, a), codegen


@intrinsic
def vadd(typingctx, a, b):
    """Lane-wise a + b (eight or sixteen lanes)."""
    if not (a in _VECTORS and b == a):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(*args)
    return a(a, a), codegen


@intrinsic
def vmax(typingctx, m, v):
    """Lane-wise v if v > m else m (an ordered compare: a NaN lane of v leaves m as it was)."""
    if not (m == f32x8 and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[1], args[0]), args[1], args[0])
    return f32x8(f32x8, f32x8), codegen


@intrinsic
def vkeep_nan(typingctx, acc, v):
    """Lane-wise v if v is NaN else acc: acc ends NaN in every lane where some v was."""
    if not (acc == f32x8 and v == f32x8):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_unordered("uno", args[1], args[1]), args[1], args[0])
    return f32x8(f32x8, f32x8), codegen


@intrinsic
def vlane(typingctx, v, i):
    """Lane i of v (a float32)."""
    if not (v == f32x8 and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])
    return types.float32(f32x8, i), codegen


@intrinsic
def vcanon(typingctx, v):
    """v with every NaN lane replaced by the canonical NaN (0x7FC00000): a compare and a blend."""
    if v not in _VECTORS:
        return None
    n = _VECTORS[v].count

    def codegen(context, builder, sig, args):
        nan = builder.bitcast(ir.Constant(ir.VectorType(ir.IntType(32), n), [0x7FC00000] * n), _VECTORS[v])
        return builder.select(builder.fcmp_unordered("uno", args[0], args[0]), nan, args[0])
    return v(v), codegen


@intrinsic
def vload_wide(typingctx, arr, i):
    """arr.flat[i : i + 8] widened exactly to float32 (unchecked): float32 as is, bf16 bits (int16)
    shifted into the high half, fp16 bits (uint16) by ``fpext`` (strict_math.widen, eight at once)."""
    if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)
            and arr.dtype in (types.float32, types.int16, types.uint16)):
        return None
    dtype = arr.dtype

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(data, [args[1]])
        if dtype == types.float32:
            return builder.load(builder.bitcast(ptr, _VEC.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
        if dtype == types.int16:
            i32 = ir.VectorType(ir.IntType(32), LANES)
            return builder.bitcast(builder.shl(builder.zext(bits, i32), ir.Constant(i32, [16] * LANES)), _VEC)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _VEC)
    return f32x8(arr, i), codegen


def _shuffle(mask):
    """An intrinsic picking lanes of (a, b) by ``mask`` (0-7: a's lanes, 8-15: b's)."""
    @intrinsic
    def shuffle(typingctx, a, b):
        if not (a == f32x8 and b == f32x8):
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(ir.IntType(32), LANES), mask))
        return f32x8(f32x8, f32x8), codegen
    return shuffle


_lo32, _hi32 = _shuffle([0, 8, 1, 9, 4, 12, 5, 13]), _shuffle([2, 10, 3, 11, 6, 14, 7, 15])
_lo64, _hi64 = _shuffle([0, 1, 8, 9, 4, 5, 12, 13]), _shuffle([2, 3, 10, 11, 6, 7, 14, 15])
_lo128, _hi128 = _shuffle([0, 1, 2, 3, 8, 9, 10, 11]), _shuffle([4, 5, 6, 7, 12, 13, 14, 15])


@njit(inline="always", cache=True)
def transpose8(r0, r1, r2, r3, r4, r5, r6, r7):
    """The 8x8 transpose of eight row vectors: lane i of result j is lane j of row i (24 shuffles,
    moves only: no arithmetic)."""
    t0, t1, t2, t3 = _lo32(r0, r1), _hi32(r0, r1), _lo32(r2, r3), _hi32(r2, r3)
    t4, t5, t6, t7 = _lo32(r4, r5), _hi32(r4, r5), _lo32(r6, r7), _hi32(r6, r7)
    u0, u1, u2, u3 = _lo64(t0, t2), _hi64(t0, t2), _lo64(t1, t3), _hi64(t1, t3)
    u4, u5, u6, u7 = _lo64(t4, t6), _hi64(t4, t6), _lo64(t5, t7), _hi64(t5, t7)
    return (_lo128(u0, u4), _lo128(u1, u5), _lo128(u2, u6), _lo128(u3, u7),
            _hi128(u0, u4), _hi128(u1, u5), _hi128(u2, u6), _hi128(u3, u7))


# ---------------------------------------------------------------- sixteen lanes (one AVX-512 register)
# For kernels whose sixteen lanes are sixteen independent chains (matmul.py's weight-streaming linear):
# the lane-wise arithmetic above (vfma, vadd, vcanon) takes these too.

_I32X16 = ir.VectorType(ir.IntType(32), 2 * LANES)


@intrinsic
def vzero16(typingctx):
    """Sixteen +0.0."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VEC16, [0.0] * (2 * LANES))
    return f32x16(), codegen


@intrinsic
def vsplat16(typingctx, x):
    """x in all sixteen lanes."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        one = builder.insert_element(ir.Constant(_VEC16, ir.Undefined), args[0], ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(_VEC16, ir.Undefined), ir.Constant(_I32X16, [0] * (2 * LANES)))
    return f32x16(x), codegen


@intrinsic
def vload16(typingctx, arr, i):
    """arr.flat[i : i + 16] of a C-contiguous float32 array (unchecked)."""
    if not _is_f32_array(arr, i):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load(builder.bitcast(builder.gep(data, [args[1]]), _VEC16.as_pointer()), align=4)
    return f32x16(arr, i), codegen


@intrinsic
def vstore16(typingctx, arr, i, v):
    """arr.flat[i : i + 16] = v (unchecked)."""
    if not (_is_f32_array(arr, i) and v == f32x16):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.store(args[2], builder.bitcast(builder.gep(data, [args[1]]), _VEC16.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(arr, i, v), codegen


_JOIN = ir.Constant(_I32X16, list(range(2 * LANES)))


@intrinsic
def vload2_words(typingctx, arr, i, j):
    """The sixteen 16-bit values arr.flat[i : i + 16] as eight 32-bit words in lanes 0-7 and those at j in
    lanes 8-15, unconverted (unchecked; the lanes hold bit patterns, not floats, until :func:`bf16_even` /
    :func:`bf16_odd`): word w of a row holds steps 2w (low half) and 2w + 1 (high half). Moves only."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int16
            and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        lo, hi = (builder.load(builder.bitcast(builder.gep(data, [k]), _VEC.as_pointer()), align=2)
                  for k in (args[1], args[2]))
        return builder.shuffle_vector(lo, hi, _JOIN)
    return f32x16(arr, i, j), codegen


def _bf16_half(high: bool):
    @intrinsic
    def half(typingctx, v):
        if v != f32x16:
            return None

        def codegen(context, builder, sig, args):
            w = builder.bitcast(args[0], _I32X16)
            if high:  # the word's high half is already a float32's high half
                w = builder.and_(w, ir.Constant(_I32X16, [-65536] * (2 * LANES)))
            else:
                w = builder.shl(w, ir.Constant(_I32X16, [16] * (2 * LANES)))
            return builder.bitcast(w, _VEC16)
        return f32x16(f32x16), codegen
    return half


#: The bf16 in each word's low half (the even step) / high half (the odd step), as float32: exact, as widen.
bf16_even, bf16_odd = _bf16_half(False), _bf16_half(True)


def _shuffle16(mask8):
    """An intrinsic applying the two-source eight-lane ``mask8`` in each 256-bit half of (a, b)."""
    mask = [(x if x < LANES else 2 * LANES + x - LANES) + h * LANES for h in (0, 1) for x in mask8]

    @intrinsic
    def shuffle(typingctx, a, b):
        if not (a == f32x16 and b == f32x16):
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[1], ir.Constant(_I32X16, mask))
        return f32x16(f32x16, f32x16), codegen
    return shuffle


_lo32x2, _hi32x2 = _shuffle16([0, 8, 1, 9, 4, 12, 5, 13]), _shuffle16([2, 10, 3, 11, 6, 14, 7, 15])
_lo64x2, _hi64x2 = _shuffle16([0, 1, 8, 9, 4, 5, 12, 13]), _shuffle16([2, 3, 10, 11, 6, 7, 14, 15])
_lo128x2, _hi128x2 = _shuffle16([0, 1, 2, 3, 8, 9, 10, 11]), _shuffle16([4, 5, 6, 7, 12, 13, 14, 15])


@njit(inline="always", cache=True)
def transpose8x2(r0, r1, r2, r3, r4, r5, r6, r7):
    """:func:`transpose8` in each 256-bit half of eight sixteen-lane vectors: lane i of result j is lane j
    of row i, lane 8 + i of result j lane 8 + j of row i (24 shuffles, moves only: any bit pattern)."""
    t0, t1, t2, t3 = _lo32x2(r0, r1), _hi32x2(r0, r1), _lo32x2(r2, r3), _hi32x2(r2, r3)
    t4, t5, t6, t7 = _lo32x2(r4, r5), _hi32x2(r4, r5), _lo32x2(r6, r7), _hi32x2(r6, r7)
    u0, u1, u2, u3 = _lo64x2(t0, t2), _hi64x2(t0, t2), _lo64x2(t1, t3), _hi64x2(t1, t3)
    u4, u5, u6, u7 = _lo64x2(t4, t6), _hi64x2(t4, t6), _lo64x2(t5, t7), _hi64x2(t5, t7)
    return (_lo128x2(u0, u4), _lo128x2(u1, u5), _lo128x2(u2, u6), _lo128x2(u3, u7),
            _hi128x2(u0, u4), _hi128x2(u1, u5), _hi128x2(u2, u6), _hi128x2(u3, u7))


@intrinsic
def vload16_wide(typingctx, arr, i):
    """arr.flat[i : i + 16] widened exactly to float32 (unchecked): float32 as is, fp16 bits (uint16) by
    ``fpext`` (bf16 weights are read as words: :func:`vload2_words`)."""
    if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)
            and arr.dtype in (types.float32, types.uint16)):
        return None
    dtype = arr.dtype

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        ptr = builder.gep(data, [args[1]])
        if dtype == types.float32:
            return builder.load(builder.bitcast(ptr, _VEC16.as_pointer()), align=4)
        bits = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 2 * LANES).as_pointer()), align=2)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), 2 * LANES)), _VEC16)
    return f32x16(arr, i), codegen


def _butterfly(d: int, high: bool):
    """Stage ``d`` of the 16x16 transpose: rows (a, b) = (i, i + d) swap their off-diagonal d x d blocks."""
    n = 2 * LANES
    mask = [(j + d if not j & d else n + j) if high else (j if not j & d else n + j - d) for j in range(n)]

    @intrinsic
    def stage(typingctx, a, b):
        if not (a == f32x16 and b == f32x16):
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[1], ir.Constant(_I32X16, mask))
        return f32x16(f32x16, f32x16), codegen
    return stage


_B1L, _B1H, _B2L, _B2H = _butterfly(1, False), _butterfly(1, True), _butterfly(2, False), _butterfly(2, True)
_B4L, _B4H, _B8L, _B8H = _butterfly(4, False), _butterfly(4, True), _butterfly(8, False), _butterfly(8, True)


@njit(inline="always", cache=True)
def transpose16(r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15):
    """The 16x16 transpose of sixteen row vectors: lane i of result j is lane j of row i (four stages of
    block swaps, 64 shuffles, moves only: any bit pattern)."""
    r0, r1, r2, r3 = _B1L(r0, r1), _B1H(r0, r1), _B1L(r2, r3), _B1H(r2, r3)
    r4, r5, r6, r7 = _B1L(r4, r5), _B1H(r4, r5), _B1L(r6, r7), _B1H(r6, r7)
    r8, r9, r10, r11 = _B1L(r8, r9), _B1H(r8, r9), _B1L(r10, r11), _B1H(r10, r11)
    r12, r13, r14, r15 = _B1L(r12, r13), _B1H(r12, r13), _B1L(r14, r15), _B1H(r14, r15)
    r0, r2, r1, r3 = _B2L(r0, r2), _B2H(r0, r2), _B2L(r1, r3), _B2H(r1, r3)
    r4, r6, r5, r7 = _B2L(r4, r6), _B2H(r4, r6), _B2L(r5, r7), _B2H(r5, r7)
    r8, r10, r9, r11 = _B2L(r8, r10), _B2H(r8, r10), _B2L(r9, r11), _B2H(r9, r11)
    r12, r14, r13, r15 = _B2L(r12, r14), _B2H(r12, r14), _B2L(r13, r15), _B2H(r13, r15)
    r0, r4, r1, r5 = _B4L(r0, r4), _B4H(r0, r4), _B4L(r1, r5), _B4H(r1, r5)
    r2, r6, r3, r7 = _B4L(r2, r6), _B4H(r2, r6), _B4L(r3, r7), _B4H(r3, r7)
    r8, r12, r9, r13 = _B4L(r8, r12), _B4H(r8, r12), _B4L(r9, r13), _B4H(r9, r13)
    r10, r14, r11, r15 = _B4L(r10, r14), _B4H(r10, r14), _B4L(r11, r15), _B4H(r11, r15)
    r0, r8, r1, r9 = _B8L(r0, r8), _B8H(r0, r8), _B8L(r1, r9), _B8H(r1, r9)
    r2, r10, r3, r11 = _B8L(r2, r10), _B8H(r2, r10), _B8L(r3, r11), _B8H(r3, r11)
    r4, r12, r5, r13 = _B8L(r4, r12), _B8H(r4, r12), _B8L(r5, r13), _B8H(r5, r13)
    r6, r14, r7, r15 = _B8L(r6, r14), _B8H(r6, r14), _B8L(r7, r15), _B8H(r7, r15)
    return r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15
