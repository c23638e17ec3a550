"""The exact policy's Triton path (kernels/exact/triton_matmul.py) under the interpreter, checks by name:

* diagonal: the one-pass products kernel (int32 accumulator per diagonal) against the per-pair one and core.combine,
  and at its bound; a missing diagonal term as the caught control;
* slicer: the slicing kernel's digits, exponents and non-finite row flags are core.slice_rows's, every dtype,
  s = 2..4, subnormals, +-0, NaN/inf, rows without a finite non-zero; round-to-nearest digits are caught;
* bits: the device-side path (slicing kernel, products, finish kernel with the special values selected per tile)
  gives core.exact_linear's raw bits on random, subnormal, overflowing (to +-inf), NaN and inf inputs, with and
  without a bias, float32 logits of bf16 inputs, a prepared weight with NaN; a finish that skips the special
  values is caught;
* nosync: the path reads no tensor value on the host (no aten._local_scalar_dense: bool(), .item(), .tolist()),
  so its launches can be captured in a CUDA graph; the earlier torch glue (glue="torch") is caught by the same check;
* replay: launch_path's replay of hal.linear with a prepared weight reads nothing on the host and skips the
  weight's staleness check (the eager call's), same bits;
* probe: the int8 accumulation probe (kernels/exact/probe.py) passes the Triton kernel and torch._int_mm and
  catches three inexact accumulators.

Run: TRITON_INTERPRET=1 python tests/scripts/exact_triton_path_check.py [NAME ...] (default: every check)
Each check prints "<name>: ok" or "<name>: FAIL ...".
"""
from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hal.conformance.bits import first_divergence, same_bits
from hal.kernels.exact import core, prepared, triton_matmul as tx
from hal.kernels.exact.cpu import products_int_mm
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


def check_bits() -> list[str]:
    bad, specials = [], 0
    for name, x, w, b, out_dtype in _cases():
        for s in (3, 4):
            spec = ExactMatmulSpec(slices=s)
            want = core.exact_linear(x, w, b, s, products_int_mm, out_dtype=out_dtype)
            specials += int((~torch.isfinite(want)).sum())
            for label, weight in (("tensor", w), ("prepared", prepared.prepare(w, spec, slicer=tx.prepared_slices))):
                got = tx.exact_linear_triton(x, weight, b, spec, (16, 16, 32), 2, out_dtype=out_dtype)
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


class _HostReads(TorchDispatchMode):
    """Records every read of a tensor value on the host (aten._local_scalar_dense: bool(t), t.item(), int(t))."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def check_nosync() -> list[str]:
    bad = []
    spec = ExactMatmulSpec(slices=4)
    x, w = _hostile(5, 96, torch.bfloat16, 60), _hostile(7, 96, torch.bfloat16, 61)
    x[1, 4] = float("nan")
    ew = prepared.prepare(w, spec, slicer=tx.prepared_slices)
    ew_w, sw, wbad = tx.weight_slices(ew, spec)  # the op's staleness check (hashes, a host compare) comes first
    out = torch.empty(5, 7, dtype=torch.bfloat16)
    for label, run in (("linear_sliced", lambda: tx.linear_sliced(x, ew_w, sw, wbad, None, 4, out)),
                       ("plain weight", lambda: tx.exact_linear_triton(x, w, None, spec))):
        with _HostReads() as mode:
            run()
        if mode.reads:
            bad.append(f"{label}: {mode.reads} host reads")
    with _HostReads() as mode:  # negative control: the earlier glue reads flags on the host
        tx.exact_linear_triton(x, w, None, spec, glue="torch")
    if not mode.reads:
        bad.append("control: the torch glue's host reads were not seen")
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


CHECKS = {"diagonal": check_diagonal, "slicer": check_slicer, "bits": check_bits, "nosync": check_nosync,
          "probe": check_probe,
          "replay": check_replay}

if __name__ == "__main__":
    failed = False
    for name in sys.argv[1:] or list(CHECKS):
        problems = CHECKS[name]()
        print(f"{name}: ok" if not problems else f"{name}: FAIL " + "; ".join(problems[:8]))
        failed |= bool(problems)
    raise SystemExit(1 if failed else 0)
