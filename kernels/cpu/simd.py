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


def _transposed16(builder, rows):
    """LLVM IR: the 16x16 transpose of 16 sixteen-lane vectors (lane i of result j is lane j of row i): four
    stages in which rows (i, i + d) swap their off-diagonal d x d blocks, 64 shuffles, moves only (any bit
    pattern)."""
    n = 2 * LANES
    rows = list(rows)
    for d in (1, 2, 4, 8):
        low = ir.Constant(_I32X16, [j if not j & d else n + j - d for j in range(n)])
        high = ir.Constant(_I32X16, [j + d if not j & d else n + j for j in range(n)])
        for i in range(n):
            if not i & d:
                a, b = rows[i], rows[i + d]
                rows[i], rows[i + d] = builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high)
    return rows


_RUN = types.UniTuple(f32x16, 2 * LANES)  # 16 vectors: one per step of a block, over 16 weight rows


@intrinsic
def vsteps16(typingctx, arr, rows, k):
    """A 64-byte block from element k of each of 16 rows of a weight (row offsets in ``rows``, 16 uint64:
    elements from arr's start; unchecked), as one float32 vector per step over the 16 rows (lane l: row l),
    widened exactly and transposed in registers, in runs of 16 steps (a tuple of runs, each 16 vectors).

    bf16 (int16 bits): 32 steps, two runs. A row's 64 bytes are sixteen 32-bit words (word w: steps 2w and
    2w + 1), transposed as words, then split: a word's low half shifted up is the even step's float32, its
    high half masked the odd step's (exact, as strict_math.widen). float32: 16 steps, one run (one line per
    row). fp16 (uint16 bits): 16 steps, one run (32 bytes per row, ``fpext``). Moves, shifts, masks and
    conversions only: every bit pattern, NaN payloads included, widens as ``widen`` does. One intrinsic, so
    numba types one call per block instead of ~100."""
    if not (isinstance(arr, types.Array) and arr.dtype in (types.int16, types.float32, types.uint16)
            and isinstance(rows, types.Array) and rows.dtype == types.uint64 and isinstance(k, types.Integer)):
        return None
    dtype = arr.dtype
    runs = 2 if dtype == types.int16 else 1
    ret = types.UniTuple(_RUN, runs)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        offs = context.make_array(sig.args[1])(context, builder, args[1]).data
        k64 = context.cast(builder, args[2], sig.args[2], types.uint64)
        loaded = []
        for l in range(2 * LANES):
            row = builder.load(builder.gep(offs, [ir.Constant(ir.IntType(64), l)]))
            ptr = builder.gep(data, [builder.add(row, k64)])
            if dtype == types.uint16:
                half = ir.VectorType(ir.HalfType(), 2 * LANES)
                v = builder.fpext(builder.load(builder.bitcast(ptr, half.as_pointer()), align=2), _VEC16)
                loaded.append(builder.bitcast(v, _I32X16))
            else:
                loaded.append(builder.load(builder.bitcast(ptr, _I32X16.as_pointer()), align=2))
        cols = _transposed16(builder, loaded)
        if dtype == types.int16:
            sixteen = ir.Constant(_I32X16, [16] * (2 * LANES))
            mask = ir.Constant(_I32X16, [-65536] * (2 * LANES))
            steps = []
            for w in cols:
                steps += [builder.shl(w, sixteen), builder.and_(w, mask)]
        else:
            steps = cols
        steps = [builder.bitcast(v, _VEC16) for v in steps]
        out = [context.make_tuple(builder, _RUN, steps[16 * r:16 * (r + 1)]) for r in range(runs)]
        return context.make_tuple(builder, ret, out)
    return ret(arr, rows, k), codegen


@intrinsic
def vchains(typingctx, x, xo, k, v, acc):
    """Chains advanced in k order over a block of steps: acc[m] + x.flat[xo[m] + k + j] * v_j for j = 0, 1, ..
    in turn, one rounding per lane (the float32 x value in all sixteen lanes; unchecked). acc: a tuple of
    sixteen-lane vectors, one per row of x (row m's element offsets from xo[m], uint64); v: one vector (one
    step) or :func:`vsteps16`'s runs of 16 (steps k, k + 1, ..). Returns the advanced tuple. One intrinsic
    for up to 8 x 32 splats and fmas: numba types every call it compiles (~1 ms apiece), and the decode
    kernel written as one call per fma took ~25 CPU s to compile per weight dtype (now ~4.5)."""
    if not (_is_f32_array(x, k) and isinstance(xo, types.Array) and xo.dtype == types.uint64
            and isinstance(acc, types.UniTuple) and acc.dtype == f32x16):
        return None
    if v == f32x16:
        steps_of = None
    elif isinstance(v, types.UniTuple) and v.dtype == _RUN:
        steps_of = v.count
    else:
        return None

    def codegen(context, builder, sig, args):
        xs, offs = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args[:2], args[:2]))
        k64 = context.cast(builder, args[2], sig.args[2], types.uint64)
        if steps_of is None:
            steps = [args[3]]
        else:
            steps = [builder.extract_value(builder.extract_value(args[3], r), j)
                     for r in range(steps_of) for j in range(2 * LANES)]
        rows = [builder.extract_value(args[4], m) for m in range(acc.count)]
        base = [builder.add(builder.load(builder.gep(offs, [ir.Constant(ir.IntType(64), m)])), k64)
                for m in range(acc.count)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC16, [_VEC16] * 3),
                                             "llvm.fma.v16f32")
        lane0, splat = ir.Constant(ir.IntType(32), 0), ir.Constant(_I32X16, [0] * (2 * LANES))
        for j, w in enumerate(steps):
            for m in range(acc.count):
                xv = builder.load(builder.gep(xs, [builder.add(base[m], ir.Constant(ir.IntType(64), j))]))
                one = builder.insert_element(ir.Constant(_VEC16, ir.Undefined), xv, lane0)
                rows[m] = builder.call(fma, [builder.shuffle_vector(one, ir.Constant(_VEC16, ir.Undefined), splat),
                                             w, rows[m]])
        return context.make_tuple(builder, sig.return_type, rows)
    return acc(x, xo, k, v, acc), codegen


# ---------------------------------------------------------------- software prefetch

_I8P = ir.IntType(8).as_pointer()


@intrinsic
def prefetch(typingctx, arr, i):
    """A hint that arr.flat[i]'s cache line will be read soon (``llvm.prefetch``: read, keep in all
    levels, data). Never faults, changes no value; for a kernel that reads a weight in an order the
    hardware prefetchers follow badly (matmul.py's streaming linear: 16 rows at once), the next task's
    lines in memory order."""
    if not (isinstance(arr, types.Array) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [_I8P, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), _I8P), ir.Constant(i32, 0),
                          ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, i), codegen


