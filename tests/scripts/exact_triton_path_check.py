"""The exact policy's Triton path (kernels/exact/triton_matmul.py) under the interpreter, checks by name:

* diagonal: the one-pass products kernel (int32 accumulator per diagonal) against the per-pair one and core.combine,
  and at its bound; a missing diagonal term as the caught control;
* slicer: the slicing kernel's digits, exponents and non-finite row flags are core.slice_rows's, every dtype,
  s = 2..4, subnormals, +-0, NaN/inf, rows without a finite non-zero; round-to-nearest digits are caught;
* bits: the device-side path (slicing kernel; the fused kernel, and the two-kernel path with the finish kernel; special
  values selected per tile) gives core.exact_linear's raw bits on random, subnormal, overflowing (to +-inf), NaN and
  inf inputs, with and without a bias, float32 logits of bf16 inputs, a prepared weight with NaN, K past one int32
  piece and a multiple of no block; a finish that skips the special values is caught;
* fused: the integer epilogue against core's rounding on ties and their neighbours (every output format), the int8
  probe through the fused kernel; float32 / float64 epilogues, an int16-saturating combine and an int32-saturating
  accumulator over K in one piece are caught;
* source: WEIGHT_SOURCE (the fused kernel slicing the weight's own tensor in registers) gives core.exact_linear's and
  the planes path's raw bits on 1-64 rows, every dtype, the adversarial inputs, K past a piece and a multiple of no
  block, plain, prepared and matmul-layout weights; refused where only planes serve; a dropped digit and exponents off
  by one are caught;
* nosync: the path reads no tensor value on the host (no syncing aten op -- bool(), .item(), nonzero, ... -- and no
  Tensor.item / tolist / numpy / cpu / __bool__ call), so its launches can be captured in a CUDA graph; the earlier
  torch glue (glue="torch") and an .item() / .tolist() added to the path are caught by the same check;
* replay: launch_path's replay of hal.linear with a prepared weight reads nothing on the host and skips the
  weight's staleness check (the eager call's), same bits;
* probe: the int8 accumulation probe (kernels/exact/probe.py) passes the Triton kernel and torch._int_mm and
  catches three inexact accumulators.

Run: TRITON_INTERPRET=1 python tests/scripts/exact_triton_path_check.py [NAME ...] (default: every check)
Each check prints "<name>: ok" or "<name>: FAIL ...".
"""
from __future__ import annotations

import random
import sys

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

from hal import errors as hal_errors
from hal.conformance.bits import first_divergence, same_bits
from hal.kernels.exact import core, prepared, triton_matmul as tx
from hal.kernels.exact.cpu import products_int_mm
from hal.kernels.triton import strict_math as sm
from hal.spec import ExactMatmulSpec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _hostile(m: int, k: int, dtype, seed: int, overflow: bool = False) -> torch.Tensor:
    """Values over a wide exponent range, subnormals of the dtype, +-0, and (overflow) values near its maximum."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (m, k), generator=g)
                                                                         .double())
    sub = torch.rand(m, k, generator=g) < 0.15
    x = torch.where(sub, torch.randn(m, k, generator=g, dtype=torch.float64) * info.smallest_normal * 0.3, x)
    x = torch.where(torch.rand(m, k, generator=g) < 0.05, -0.0, x)
    if overflow:
        x = x.clamp(-1, 1) * info.max * 0.9
    return x.clamp(-info.max, info.max).to(dtype)


def check_slicer() -> list[str]:
    bad = []
    for i, dtype in enumerate(DTYPES):
        x = _hostile(6, 300, dtype, i)
        x[1, 7], x[2, 9], x[3] = float("nan"), float("-inf"), 0.0
        x[4] = torch.finfo(dtype).smallest_normal / 4  # a row of subnormals only (float32: a float32 subnormal)
        for s in (2, 3, 4):
            got, flags = tx.slice_rows(x, s)
            want = core.slice_rows(x, s)
            if not (torch.equal(got.digits, want.digits) and torch.equal(got.exp, want.exp)):
                bad.append(f"{dtype} s{s}: digits/exponents differ")
            if flags.tolist() != [0, 1, 1, 0, 0, 0]:
                bad.append(f"{dtype} s{s}: flags {flags.tolist()}")
            if tx.prepared_slices(x, s).finite is not False or tx.prepared_slices(x[3:], s).finite is not True:
                bad.append(f"{dtype} s{s}: prepared finite flag")
    # negative control: digits rounded to nearest instead of truncated differ from the kernel's
    x = _hostile(4, 64, torch.float32, 9)
    t = torch.round(x.double() * torch.exp2(20 - core.row_exponents(x).double()).unsqueeze(-1))
    trunc = torch.trunc(x.double() * torch.exp2(20 - core.row_exponents(x).double()).unsqueeze(-1))
    got = tx.slice_rows(x, 3)[0].digits
    rebuilt = sum(got[i].double() * 128.0 ** (2 - i) for i in range(3))
    if not torch.equal(rebuilt, trunc) or torch.equal(rebuilt, t):
        bad.append("control: the digits are not the truncation, or rounding is not told apart")
    return bad


def _cases():
    for i, dtype in enumerate(DTYPES):
        m, k, n = 7, 150, 11
        x, w = _hostile(m, k, dtype, 10 + i), _hostile(n, k, dtype, 20 + i)
        yield f"random {dtype}", x, w, None, None
        yield f"bias {dtype}", x, w, torch.randn(n, generator=torch.Generator().manual_seed(i)).to(dtype), None
        xo, wo = _hostile(m, k, dtype, 30 + i, overflow=True), _hostile(n, k, dtype, 40 + i, overflow=True)
        yield f"overflow {dtype}", xo, wo, None, None  # sums past the dtype's max: +-inf from the rounding
        xs, ws = x.clone(), w.clone()
        xs[0, 3], xs[2, 5], xs[4, :] = float("inf"), float("nan"), 0.0
        xs[4, 8] = float("-inf")
        ws[1, 8], ws[3, 3], ws[5, 9] = 0.0, float("-inf"), float("inf")
        xs[5, 9], ws[6, 10] = float("inf"), float("nan")
        yield f"nonfinite {dtype}", xs, ws, None, None
        yield f"nonfinite bias {dtype}", xs, ws, torch.randn(n).to(dtype), None
    xb, wb = _hostile(5, 70, torch.bfloat16, 50), _hostile(9, 70, torch.bfloat16, 51)
    xb[1, 2] = float("inf")
    yield "float32 logits of bf16", xb, wb, None, torch.float32


def _past_a_piece():
    """K past one piece (s = 4: 32,768) and a multiple of no block, a NaN / inf / subnormal among the values."""
    k = tx.piece_k(4) + 13
    x, w = _hostile(3, k, torch.bfloat16, 80), _hostile(5, k, torch.bfloat16, 81)
    x[1, k - 1], w[2, 5] = float("nan"), float("-inf")
    return "K past a piece bf16", x, w, torch.randn(5).to(torch.bfloat16), None


def _fused_cases():
    """_cases plus K past one piece (_past_a_piece)."""
    yield from _cases()
    yield _past_a_piece()


def check_bits() -> list[str]:
    """Raw bits against core.exact_linear on _fused_cases, s = 3 and 4 (K past a piece: s = 4): the fused kernel (split_k 1) with the
    weight's tensor, at a block whose K step divides no case's K (32, or 2048 past a piece), and (s = 4) with the
    prepared weight at the default block; the two-kernel path (split_k 2: products kernel, finish kernel) with the
    tensor at s = 3."""
    bad, specials = [], 0
    for name, x, w, b, out_dtype in _fused_cases():
        for s in (3, 4) if x.shape[1] < tx.piece_k(4) else (4,):  # past s = 4's piece (s = 3's is longer)
            spec = ExactMatmulSpec(slices=s)
            want = core.exact_linear(x, w, b, s, products_int_mm, out_dtype=out_dtype)
            specials += int((~torch.isfinite(want)).sum())
            block = (16, 16, 32) if x.shape[1] < 1024 else None  # K past a piece: the interpreter's K step, 2048
            runs = [("fused tensor", w, block, 1)]
            runs += [("two-kernel tensor", w, block, 2)] if s == 3 else \
                [("fused prepared", prepared.prepare(w, spec, slicer=tx.prepared_slices), None, 1)]
            for label, weight, block, split in runs:
                got = tx.exact_linear_triton(x, weight, b, spec, block, split, out_dtype=out_dtype)
                d = first_divergence(f"{name} s{s} {label}", want, got)
                if d is not None:
                    bad.append(str(d))
    if specials < 20:
        bad.append(f"only {specials} non-finite outputs: the special-value cases do not exercise the select")
    # negative control: a finish kernel whose tiles never take the special path (flags ignored) is caught
    name, x, w, b, _ = next(c for c in _cases() if c[0].startswith("nonfinite"))
    spec = ExactMatmulSpec(slices=3)
    want = core.exact_linear(x, w, b, 3, products_int_mm)
    sw, _ = tx.slice_rows(w, 3)
    out = torch.empty_like(want)
    real = tx.slice_rows
    try:
        tx.slice_rows = lambda t, s: (real(t, s)[0], torch.zeros(t.shape[0], dtype=torch.int8))
        tx.linear_sliced(x, w, sw, torch.zeros(w.shape[0], dtype=torch.int8), b, 3, out)
    finally:
        tx.slice_rows = real
    if same_bits(want, out):
        bad.append("control: a finish without the special values was not caught")
    return bad


def _source_cases():
    """_cases (7 rows: random, bias, overflowing, NaN / inf / -0.0 / subnormal, float32 logits) plus 1 and 64 rows
    of every dtype at a K no block divides, and K past one piece (s = 4) with a NaN and an -inf."""
    yield from _cases()
    for i, dtype in enumerate(DTYPES):
        for m in (1, 64):
            yield f"rows {m} {dtype}", _hostile(m, 200, dtype, 90 + i), _hostile(13, 200, dtype, 95 + i), None, None
    yield _past_a_piece()


@triton.jit
def _digit_1_dropped(w_ptr, u: tl.constexpr, sw_s, w_offs, w_mask, w_mag, w_neg,
                     S: tl.constexpr, DIGIT: tl.constexpr, W_SOURCE: tl.constexpr):
    """Control: the weight's second digit cut as 0 (a digit dropped by the in-kernel slicing)."""
    w = _real_weight_digit(w_ptr, u, sw_s, w_offs, w_mask, w_mag, w_neg, S, DIGIT, W_SOURCE)
    if u == 1:
        w = w * 0
    return w


_real_weight_digit = tx._weight_digit


def check_source() -> list[str]:
    """WEIGHT_SOURCE (the fused kernel reading the weight's own tensor, cutting each tile into digits in registers):
    raw bits against core.exact_linear and against the planes path (the default) on _source_cases, s = 3 and 4 (K past
    a piece: s = 4), float32 / bf16 / fp16 weights, a block whose K step divides no K; with a prepared weight (its
    planes unread) and a prepared matmul-layout weight (a transposed source: other strides); the exponents-only slicer
    against the full one. Refusals: split_k > 1, FUSED = False, glue="torch". Controls, each caught by the same
    comparison: the weight's digit 1 dropped in the kernel, the weight sliced with its exponents off by one."""
    bad, specials = [], 0
    source = _with(WEIGHT_SOURCE=True)
    for name, x, w, b, out_dtype in _source_cases():
        for s in (3, 4) if x.shape[1] < tx.piece_k(4) else (4,):
            spec = ExactMatmulSpec(slices=s)
            want = core.exact_linear(x, w, b, s, products_int_mm, out_dtype=out_dtype)
            specials += int((~torch.isfinite(want)).sum())
            block = (16, 16, 32) if x.shape[1] < 1024 else None
            planes = tx.exact_linear_triton(x, w, b, spec, block, out_dtype=out_dtype)
            got = source(lambda: tx.exact_linear_triton(x, w, b, spec, block, out_dtype=out_dtype))
            for label, other in (("core.exact_linear", want), ("the planes path", planes)):
                d = first_divergence(f"{name} s{s} weight source vs {label}", other, got)
                bad += [] if d is None else [str(d)]
            if s == 4 and x.shape[1] < 1024:
                ew = prepared.prepare(w, spec, slicer=tx.prepared_slices)
                d = first_divergence(f"{name} s4 weight source, prepared", want,
                                     source(lambda: tx.exact_linear_triton(x, ew, b, spec, out_dtype=out_dtype)))
                bad += [] if d is None else [str(d)]
    if specials < 20:
        bad.append(f"only {specials} non-finite outputs: the special-value cases do not exercise the select")
    x, w = _hostile(6, 90, torch.float16, 100), _hostile(90, 10, torch.float16, 101)  # matmul: b [K, N]
    spec = ExactMatmulSpec(slices=4)
    want = core.exact_linear(x, w.T, None, 4, products_int_mm)
    ew = prepared.prepare(w, spec, layout="matmul", slicer=tx.prepared_slices)
    for label, b in (("tensor", w.T), ("prepared", ew)):
        got = source(lambda: tx.exact_linear_triton(x, b, None, spec))
        d = first_divergence(f"matmul layout {label} weight source", want, got)
        bad += [] if d is None else [str(d)]
    for dtype in DTYPES:  # the exponents-only slicer (digits=False) gives the full slicer's exponents and flags
        v = _hostile(5, 300, dtype, 102)
        v[1, 3], v[3] = float("inf"), 0.0
        (full, f_bad), (lean, l_bad) = tx.slice_rows(v, 3), tx.slice_rows(v, 3, digits=False)
        if lean.digits is not None or not (torch.equal(full.exp, lean.exp) and torch.equal(f_bad, l_bad)):
            bad.append(f"exponents-only slicer {dtype}: exponents or flags differ")
    for label, constants, kw in (("split_k 2", {}, {"split_k": 2}), ("glue torch", {}, {"glue": "torch"}),
                                 ("FUSED False", {"FUSED": False}, {})):
        try:
            _with(WEIGHT_SOURCE=True, **constants)(lambda: tx.exact_linear_triton(x, w.T, None, spec, **kw))
            bad.append(f"WEIGHT_SOURCE with {label} was not refused")
        except hal_errors.UnsupportedError as e:
            bad += [] if "WEIGHT_SOURCE" in str(e) else [f"{label}: the refusal does not name WEIGHT_SOURCE: {e}"]
    # controls: a wrong in-kernel slicing of the weight is caught by the raw bits
    x, w = _hostile(5, 150, torch.float32, 103), _hostile(9, 150, torch.float32, 104)
    spec = ExactMatmulSpec(slices=3)
    want = core.exact_linear(x, w, None, 3, products_int_mm)
    if same_bits(want, _with(WEIGHT_SOURCE=True, _weight_digit=_digit_1_dropped)(
            lambda: tx.exact_linear_triton(x, w, None, spec))):
        bad.append("control: a dropped weight digit was not caught")
    sw, wbad = tx.slice_rows(w, 3, digits=False)
    off = torch.empty_like(want)
    tx.linear_sliced(x, w, sw._replace(exp=sw.exp + 1), wbad, None, 3, off, weight_source=True)
    if same_bits(want, off):
        bad.append("control: the weight sliced with its exponents off by one was not caught")
    return bad


#: aten ops that make the host wait for the device (a value read back, or an output size only the data decides)
_SYNCING_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim",
                "unique_consecutive", "repeat_interleave")
#: Tensor methods that hand a value to Python (tolist / numpy on a CPU tensor read memory without an aten op)
_READING_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


class _HostReads(TorchDispatchMode):
    """Records every read of a tensor value on the host: the syncing aten ops (bool(t), t.item(), int(t), nonzero,
    ...) by dispatch, and the Tensor methods that give Python a value, patched for the duration (calls from Triton's
    interpreter, which stands in for the device and copies storages itself, are not the launch path's)."""

    def __init__(self):
        super().__init__()
        self.reads, self.names = 0, []

    def _seen(self, name):
        self.reads += 1
        self.names.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNCING_OPS:
            self._seen(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in _READING_METHODS}
        for name, real in self._saved.items():
            def method(t, *a, _real=real, _name=name, **k):
                if not sys._getframe(1).f_globals.get("__name__", "").startswith("triton"):
                    self._seen(f"Tensor.{_name}")
                return _real(t, *a, **k)
            setattr(torch.Tensor, name, method)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)


def check_nosync() -> list[str]:
    """The launch path (slicing, the fused kernel -- planes or weight source -- or the two-kernel path, plain or
    prepared weight) makes no host read. Controls, each seen: the earlier torch glue (bool of flags), an .item() and a
    .tolist() added to the path."""
    bad = []
    spec = ExactMatmulSpec(slices=4)
    x, w = _hostile(5, 96, torch.bfloat16, 60), _hostile(7, 96, torch.bfloat16, 61)
    x[1, 4] = float("nan")
    ew = prepared.prepare(w, spec, slicer=tx.prepared_slices)
    ew_w, sw, wbad = tx.weight_slices(ew, spec)  # the op's staleness check (hashes, a host compare) comes first
    out = torch.empty(5, 7, dtype=torch.bfloat16)
    source = _with(WEIGHT_SOURCE=True)
    runs = (("fused, prepared", lambda: tx.linear_sliced(x, ew_w, sw, wbad, None, 4, out)),
            ("two-kernel, prepared", lambda: tx.linear_sliced(x, ew_w, sw, wbad, None, 4, out, split_k=2)),
            ("fused, plain weight", lambda: tx.exact_linear_triton(x, w, None, spec)),
            ("two-kernel, plain weight", lambda: tx.exact_linear_triton(x, w, None, spec, split_k=2)),
            ("fused, weight source", lambda: source(lambda: tx.exact_linear_triton(x, w, None, spec))),
            ("fused, weight source, prepared",
             lambda: tx.linear_sliced(x, ew_w, sw, wbad, None, 4, out, weight_source=True)))
    for label, run in runs:
        with _HostReads() as mode:
            run()
        if mode.reads:
            bad.append(f"{label}: {mode.reads} host reads {mode.names}")
    real = tx.linear_from_slices
    controls = {"the torch glue": lambda: tx.exact_linear_triton(x, w, None, spec, glue="torch"),
                "an added .item()": lambda: _with(linear_from_slices=lambda *a, **k: (int(a[1].exp.max().item()),
                                                                                     real(*a, **k))[1])(runs[2][1]),
                "an added .tolist()": lambda: _with(linear_from_slices=lambda *a, **k: (a[2].tolist(),
                                                                                       real(*a, **k))[1])(runs[2][1])}
    for label, run in controls.items():
        with _HostReads() as mode:
            run()
        if not mode.reads:
            bad.append(f"control: {label}'s host reads were not seen")
    return bad


def check_probe() -> list[str]:
    """kernels/exact/probe.py: the Triton products kernel (one program's K and split-K) and torch._int_mm with K
    pieces accumulate exactly; a path without K pieces (int32 wraps), a saturating int32 accumulator and a float32
    accumulator are each caught."""
    from hal.kernels.exact import probe
    bad = []
    for name, sums in (("int_mm", probe.int_mm_sums), ("triton", probe.triton_sums),
                       ("triton split 3", lambda a, w: probe.triton_sums(a, w, split_k=3))):
        bad += [f"{name}: {p}" for p in probe.accumulation_problems(sums, "cpu")]
    controls = {"no K pieces": lambda a, w: torch._int_mm(a[0], w[0].T),
                "saturating int32": lambda a, w: (a[0].long() @ w[0].long().T).clamp(-2 ** 31, 2 ** 31 - 1),
                "float32 accumulator": lambda a, w: (a[0].float() @ w[0].float().T).long()}
    bad += [f"control {name} not caught" for name, sums in controls.items()
            if not probe.accumulation_problems(sums, "cpu")]
    return bad


def check_replay() -> list[str]:
    """backends/triton.launch_path over hal.linear(spec=exact) with a prepared weight: the replay gives the eager
    call's bits, reads nothing on the host and does not check the weight's staleness again (a hash compared on the
    host, on a GPU a sync); the eager call does check it (the control) and still refuses a stale weight."""
    import hal
    from hal.backends.triton import launch_path
    bad = []
    spec = ExactMatmulSpec(slices=3)
    x, w = _hostile(4, 64, torch.bfloat16, 70), _hostile(6, 64, torch.bfloat16, 71)
    b = torch.randn(6).to(torch.bfloat16)
    ew = hal.exact_weight(w, spec=spec, backend="triton")
    checks, real = [], prepared.ExactWeight.is_fresh

    def counted(self, name="weight"):
        checks.append(name)
        return real(self, name)
    prepared.ExactWeight.is_fresh = counted
    try:
        replay, eager = launch_path(lambda: hal.linear(x, ew, b, spec=spec, backend="triton"))
        eager_checks = len(checks)
        with _HostReads() as replay_reads:
            again = replay()
            again = replay()
        replay_checks = len(checks) - eager_checks
    finally:
        prepared.ExactWeight.is_fresh = real
    if replay.ops != ("linear",) or not same_bits(eager, again):
        bad.append(f"replay {replay.ops}: bits differ from the eager call")
    if not same_bits(eager, core.exact_linear(x, w, b, 3, products_int_mm)):
        bad.append("eager: bits differ from core.exact_linear")
    if replay_reads.reads or replay_checks:
        bad.append(f"replay: {replay_reads.reads} host reads, {replay_checks} staleness checks")
    if not eager_checks:
        bad.append("control: the eager call's staleness check was not seen")
    w.data[0, 0] += 1
    try:
        hal.linear(x, ew, b, spec=spec, backend="triton")
        bad.append("a stale prepared weight was not refused by the eager call")
    except hal.InputError:
        pass
    return bad


def check_diagonal() -> list[str]:
    """The one-pass products kernel (an int32 accumulator per diagonal t + u) gives the per-pair kernel's limbs and
    core.combine's, s = 1..4, any block and split; every digit at +-127 over two pieces (the first at the diagonal's
    int32 bound: kernels/exact/probe.diagonal_problems) exact. Control: the kernel told S = 3 on 4 planes (a
    diagonal's terms missing) is caught. (The interpreter's int32 dot does not wrap -- one piece past the bound
    came out exact here -- so an overflow itself shows only on a device: the probe row of benchmarks/gpu_perf.py.)"""
    from hal.kernels.exact import probe
    bad = []
    for s in (1, 2, 3, 4):
        g = torch.Generator().manual_seed(s)
        for m, n, k, block, split in ((5, 7, 300, None, 1), (3, 9, 1000, (16, 16, 32), 3)):
            da = torch.randint(-127, 128, (s, m, k), generator=g, dtype=torch.int8)
            dw = torch.randint(-127, 128, (s, n, k), generator=g, dtype=torch.int8)
            pairs = tx.limbs(da, dw, block, split, products="pairs")
            diag = tx.limbs(da, dw, block, split, products="diagonal")
            want = core.combine(torch.einsum("tmk,unk->tumn", da.long(), dw.long()), s)
            if not (all(map(torch.equal, pairs, want)) and all(map(torch.equal, diag, want))):
                bad.append(f"s{s} {m}x{k}x{n} block {block} split {split}")
    bad += probe.diagonal_problems(lambda da, dw: tx.limbs(da, dw, products="diagonal"), "cpu")

    def three_planes(da, dw):
        hi, lo = (torch.zeros(da.shape[1], dw.shape[1], dtype=torch.int64) for _ in range(2))
        tx._diagonal_limbs_kernel[(1, 1, 1)](da, dw, hi, lo, da.shape[1], dw.shape[1], da.shape[2], da.shape[2],
                                             *da.stride(), *dw.stride(), S=3, DIGIT=core.DIGIT, LIMB=core.LIMB,
                                             BM=32, BN=16, BK=2048, ATOMIC=False)
        return hi, lo
    if not probe.diagonal_problems(three_planes, "cpu"):
        bad.append("control: a missing diagonal term was not caught")
    return bad


# ---------------------------------------------------------------- the fused kernel and its integer epilogue

@triton.jit
def _round_kernel(hi_ptr, lo_ptr, q_ptr, out_ptr, n, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                  B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    ok = i < n
    y = tx._round_limbs(tl.load(hi_ptr + i, mask=ok, other=0), tl.load(lo_ptr + i, mask=ok, other=0),
                        tl.load(q_ptr + i, mask=ok, other=0), P, EMIN, EMAX, core.LIMB)
    tl.store(out_ptr + i, y, mask=ok)


#: (dtype, P, EMIN, EMAX) of the three roundings the epilogue does
FORMATS = ((torch.float32, 24, -126, 127), (torch.bfloat16, 8, -126, 127), (torch.float16, 11, -14, 15))


def _limb_cases(p: int, emin: int, emax: int, seed: int):
    """(hi, lo, q) int64: random sums over the exact policy's ranges, then for this format exact ties and their
    neighbours (one unit of S either side) among normals, subnormals, at the overflow threshold and at half the
    smallest subnormal, either sign, with lo not normalised (hi moved by a few units of 2**28 into lo)."""
    g = torch.Generator().manual_seed(seed)
    n = 4000
    hi = torch.randint(-2 ** 52, 2 ** 52, (n,), generator=g) >> torch.randint(0, 53, (n,), generator=g)
    lo = torch.randint(-2 ** 40, 2 ** 40, (n,), generator=g) >> torch.randint(0, 41, (n,), generator=g)
    q = torch.randint(-360, 256, (n,), generator=g)
    rng = random.Random(seed)
    rows = []
    for _ in range(1500):
        sh = rng.randint(0, 78 - p)
        odd = rng.randrange(2 ** p, 2 ** (p + 1)) | 1  # P + 1 bits, the last one set: a tie when rounded to P
        kind = rng.choice(["normal", "subnormal", "overflow", "zero"])
        if kind == "normal":
            s, qq = odd << sh, rng.randint(emin, emax) - p - sh
        elif kind == "subnormal":  # half a subnormal quantum: S = odd * 2**(EMIN - P)
            s, qq = (rng.randrange(1, 2 ** p) | 1) << sh, emin - p - sh
        elif kind == "overflow":  # halfway between the largest finite value and 2**(EMAX + 1)
            s, qq = (2 ** (p + 1) - 1) << sh, emax - p - sh
        else:  # half the smallest subnormal: ties to +-0
            s, qq = 1 << sh, emin - p - sh
        for d in (-1, 0, 1):
            v = rng.choice([1, -1]) * (s + d)
            move = rng.randint(-1000, 1000)
            rows.append(((v >> core.LIMB) - move, (v & ((1 << core.LIMB) - 1)) + (move << core.LIMB), qq))
    # zeros (whatever q), deep underflow of either sign, a zero from limbs that cancel
    rows += [(0, 0, 0), (0, 0, 250), (0, 0, -300), (0, 1, -400), (0, -1, -400), (1, -(1 << core.LIMB), 5)]
    t = torch.tensor(rows, dtype=torch.int64)
    return torch.cat([hi, t[:, 0]]), torch.cat([lo, t[:, 1]]), torch.cat([q, t[:, 2]])


def epilogue_problems() -> list[str]:
    """tx._round_limbs against core's rounding (round to odd in float64, then to nearest), bit for bit, for each
    output format on _limb_cases."""
    bad = []
    for i, (dtype, p, emin, emax) in enumerate(FORMATS):
        hi, lo, q = _limb_cases(p, emin, emax, i)
        want = core.round_from_f64_odd(core.to_f64_odd(hi, lo, q), dtype).to(torch.float32)
        got = torch.empty(hi.shape[0])
        _round_kernel[(triton.cdiv(hi.shape[0], 1024),)](hi, lo, q, got, hi.shape[0], P=p, EMIN=emin, EMAX=emax,
                                                         B=1024)
        differ = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
        if len(differ):
            j = int(differ[0])
            bad.append(f"{dtype}: {len(differ)} of {len(hi)} differ, e.g. hi {int(hi[j])} lo {int(lo[j])} "
                       f"q {int(q[j])}: {float(got[j])!r} for {float(want[j])!r}")
    return bad


@triton.jit
def _float32_epilogue(hi, lo, q, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, LIMB: tl.constexpr):
    """Control: the limbs added in float32 (rounded twice), then scaled in float64 and rounded to float32."""
    v = (hi.to(tl.float32) * (1 << LIMB) + lo.to(tl.float32)).to(tl.float64)
    return (v * ((q + 1023) << 52).to(tl.float64, bitcast=True)).to(tl.float32)


@triton.jit
def _float64_epilogue(hi, lo, q, P: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, LIMB: tl.constexpr):
    """Control: S rounded to nearest in float64, then to the format (two roundings: wrong on ties only)."""
    v = (hi.to(tl.float64) * (1 << LIMB) + lo.to(tl.float64)) * ((q + 1023) << 52).to(tl.float64, bitcast=True)
    y = v.to(tl.float32)
    if P == 8:
        y = sm.round_to_bf16(y).to(tl.float32)
    elif P == 11:
        y = sm.round_to_fp16(y).to(tl.float32)
    return y


@triton.jit
def _int16_add_diagonal(hi, lo, g, d: tl.constexpr, S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr):
    """Control: a diagonal sum saturated to int16 before the combine (an int16 intermediate)."""
    return _real_add_diagonal(hi, lo, tl.minimum(tl.maximum(g, -32768), 32767), d, S, DIGIT, LIMB)


@triton.jit
def _int32_add_diagonal(hi, lo, g, d: tl.constexpr, S: tl.constexpr, DIGIT: tl.constexpr, LIMB: tl.constexpr):
    """Control (with K in one piece): a diagonal sum saturated to int32 (Triton's int8 mma is .satfinite; the
    interpreter's int32 dot does not wrap, so the saturation is applied here)."""
    g64 = g.to(tl.int64)
    return _real_add_diagonal(hi, lo, tl.minimum(tl.maximum(g64, -2 ** 31), 2 ** 31 - 1), d, S, DIGIT, LIMB)


_real_add_diagonal = tx._add_diagonal


def _with(**patches):
    """Run a thunk with attributes of triton_matmul replaced (the interpreter looks jit helpers up at call time)."""
    def run(thunk):
        saved = {k: getattr(tx, k) for k in patches}
        try:
            for k, v in patches.items():
                setattr(tx, k, v)
            return thunk()
        finally:
            for k, v in saved.items():
                setattr(tx, k, v)
    return run


def check_fused() -> list[str]:
    """The fast path (_fused_linear_kernel: diagonal int32 sums, K pieces added as int64 limbs in registers, the
    integer epilogue; its raw bits on the adversarial cases are check_bits'): its rounding against core's on ties
    and their neighbours (every format, overflow, subnormals, +-0), and the int8 probe through it (every digit 127
    over a full piece, past it, past what an int32 holds). Controls, each caught: a float32 epilogue (by the raw
    bits), a float64 epilogue (rounding twice: by the ties), an int16-saturating combine (raw bits and probe), an
    int32-saturating accumulator over K in one piece (probe)."""
    from hal.kernels.exact import probe
    bad = epilogue_problems()
    bad += probe.fused_problems(probe.triton_fused_linear, "cpu")
    name, x, w, b, _ = next(c for c in _cases() if c[0] == "random torch.float32")
    want = core.exact_linear(x, w, b, 3, products_int_mm)
    spec = ExactMatmulSpec(slices=3)
    if same_bits(want, _with(_round_limbs=_float32_epilogue)(lambda: tx.exact_linear_triton(x, w, b, spec))):
        bad.append("control: a float32 epilogue was not caught by the raw bits")
    if not _with(_round_limbs=_float64_epilogue)(epilogue_problems):
        bad.append("control: a float64 epilogue (rounding twice) was not caught on the ties")
    if same_bits(want, _with(_add_diagonal=_int16_add_diagonal)(lambda: tx.exact_linear_triton(x, w, b, spec))):
        bad.append("control: an int16-saturating combine was not caught by the raw bits")
    if not _with(_add_diagonal=_int16_add_diagonal)(lambda: probe.fused_problems(probe.triton_fused_linear, "cpu",
                                                                                 ks=probe.FUSED_K[:1])):
        bad.append("control: an int16-saturating combine was not caught by the probe")
    no_pieces = _with(_add_diagonal=_int32_add_diagonal, piece_k=lambda s, bk=None, products="diagonal": 2 ** 40)
    if not no_pieces(lambda: probe.fused_problems(probe.triton_fused_linear, "cpu", ks=probe.FUSED_K[2:])):
        bad.append("control: a saturating int32 accumulator over K in one piece was not caught by the probe")
    return bad


CHECKS = {"diagonal": check_diagonal, "slicer": check_slicer, "bits": check_bits, "fused": check_fused,
          "source": check_source, "nosync": check_nosync, "probe": check_probe, "replay": check_replay}

if __name__ == "__main__":
    failed = False
    for name in sys.argv[1:] or list(CHECKS):
        problems = CHECKS[name]()
        print(f"{name}: ok" if not problems else f"{name}: FAIL " + "; ".join(problems[:8]))
        failed |= bool(problems)
    raise SystemExit(1 if failed else 0)
