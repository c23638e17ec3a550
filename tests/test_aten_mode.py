"""hal.aten_mode(): every overload of the ops it intercepts (functional, in place, out=), reentrancy from
lockstep's own kernels (the exact policy's special-value pass), and torch.compile with Inductor.

Every comparison is of raw bits; each has a negative control (stock torch, or the old behaviour
rebuilt from the outside by patching the module)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import hal

am = importlib.import_module("hal.aten_mode")  # hal.aten_mode is the context manager itself
aten = torch.ops.aten


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


# ---------------------------------------------------------------- one table: every overload

M, K, N = 9, 200, 24


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 3  # noqa: E731
    return {"a": r(M, K), "b": r(K, N), "bias": r(N), "bias2": r(M, N), "a3": r(3, M, K), "b3": r(3, K, N),
            "x": r(M, 333), "xm": r(64, 1000) + 100}  # xm: a mean of all 64,000 elements (one value), far from 0


def _lockstep(op, t):
    """Lockstep's bits for ``op`` on the table's inputs, built from hal's public ops (not from aten_mode)."""
    a, b, x = t["a"], t["b"], t["x"]
    return {
        "mm": lambda: hal.matmul(a, b),
        "addmm": lambda: hal.linear(a, b.t(), t["bias"]),
        "addmm2": lambda: hal.linear(a, b.t(), t["bias2"][0]),  # rows of bias2 are all bias2[0] (see below)
        "bmm": lambda: torch.stack([hal.matmul(t["a3"][i], t["b3"][i]) for i in range(3)]),
        "_softmax": lambda: hal.softmax(x, -1),
        "_log_softmax": lambda: hal.log_softmax(x, -1),
        "mean.dim": lambda: (hal.matmul(x, torch.ones(x.shape[1], 1)) / x.shape[1]).reshape(M),
        "mean": lambda: (hal.matmul(t["xm"].reshape(1, -1), torch.ones(t["xm"].numel(), 1))
                         / t["xm"].numel()).reshape(()),
        "sigmoid": lambda: hal.sigmoid(x), "silu": lambda: hal.silu(x), "softplus": lambda: hal.softplus(x),
    }[op]()


def _call(name: str, t):
    """Call aten overload ``name`` on the table's inputs: (result, what lockstep gives)."""
    t = {k: v.clone() for k, v in t.items()}
    t["bias2"] = t["bias2"][:1].expand(M, N).contiguous()
    op, _, overload = name.partition(".")
    packet = getattr(aten, op)
    fn = getattr(packet, overload or "default")
    inplace = op.endswith("_")
    base = op[:-1] if inplace else op
    kw = {"out": torch.empty(0)} if "out" in [a.name for a in fn._schema.arguments] else {}
    dtype = {"out_dtype": torch.float32} if "out_dtype" in [a.name for a in fn._schema.arguments] else None
    if base in ("mm", "bmm"):
        args, key = ((t["a"], t["b"]) if base == "mm" else (t["a3"], t["b3"])), base
    elif base == "addmm":
        args, key = ((t["bias2"], t["a"], t["b"]), "addmm2") if inplace else ((t["bias"], t["a"], t["b"]), "addmm")
    elif base in ("_softmax", "_log_softmax"):
        args, key = (t["x"], -1, False), base
    elif base == "mean":
        full = overload in ("", "dtype_out")
        args, key = ((t["xm"],) if full else (t["x"], [1])), ("mean" if full else "mean.dim")
    else:
        args, key = (t["x"],), base
    if dtype:
        args = args[:3 if base == "addmm" else 2] + (torch.float32,) + args[3 if base == "addmm" else 2:]
    want = _lockstep(key, t)  # before the call: an in-place overload overwrites its input
    y = fn(*args, **kw)
    if inplace:
        assert y is args[0]
    if kw:
        assert y is kw["out"]
    return y, want


def _all_overloads():
    """Enumerated from torch itself, not from aten_mode's table: every overload of each intercepted op
    and of its in-place op."""
    names = []
    for op in am.OVERRIDDEN:
        for name in (op, op + "_"):
            packet = getattr(aten, name, None)
            for o in packet.overloads() if packet is not None else ():
                names.append(name if o == "default" else f"{name}.{o}")
    return names


def test_table_covers_every_overload_with_a_cpu_kernel():
    names = _all_overloads()
    assert {"silu_", "sigmoid_", "addmm_", "mm.out", "addmm.out", "silu.out", "_softmax.out"} <= set(names)
    has_cpu = {n for n in names if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{n}", "CPU")}
    assert {n for n, _, _ in am.OVERLOADS} == has_cpu


@pytest.mark.parametrize("name", _all_overloads())
def test_every_overload_is_routed_or_refused(name):
    t = _inputs()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU") and \
            not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CompositeExplicitAutograd"):
        with hal.aten_mode(), pytest.raises(NotImplementedError):  # the out_dtype overloads: no CPU kernel
            _call(name, t)
        return
    stock, want = _call(name, t)
    with hal.aten_mode():
        got, _ = _call(name, t)
    assert same(got, want), f"{name}: {(bits(got) != bits(want)).sum()} elements are not lockstep's"
    # negative control: stock torch's bits are not lockstep's here, so the check above can fail
    assert not same(stock, want), f"{name}: stock torch gives lockstep's bits on these inputs"


def test_inplace_activation_modules_give_lockstep_bits():
    """The issue's forms: F.silu(inplace=True), nn.SiLU(inplace=True), x.sigmoid_()."""
    x = _inputs()["x"]
    forms = {"F.silu(inplace)": (lambda v: F.silu(v, inplace=True), hal.silu),
             "nn.SiLU(inplace)": (torch.nn.SiLU(inplace=True), hal.silu),
             "sigmoid_": (lambda v: v.sigmoid_(), hal.sigmoid)}
    for what, (f, ref) in forms.items():
        stock = f(x.clone())
        with hal.aten_mode():
            got = f(x.clone())
        assert same(got, ref(x)), what
        assert not same(stock, ref(x)), what  # negative control: torch's own kernel


def test_out_of_wrong_dtype_is_refused_and_left_alone():
    a, b = _inputs()["a"], _inputs()["b"]
    out = torch.zeros(M, N, dtype=torch.float64)
    with hal.aten_mode(), pytest.raises(hal.InputError, match="out has dtype torch.float64"):
        torch.mm(a, b, out=out)
    assert torch.equal(out, torch.zeros(M, N, dtype=torch.float64))


def test_unhandled_arguments_run_torchs_kernel_without_recursion():
    """float64 (not routed) through every form reaches torch's captured kernel: torch's bits."""
    x = _inputs()["x"].double()
    with hal.aten_mode():
        got = (torch.sigmoid(x), x.clone().sigmoid_(), torch.sigmoid(x, out=torch.empty(0, dtype=torch.float64)))
    for g in got:
        assert torch.equal(g.view(torch.int64), torch.sigmoid(x).view(torch.int64))


def test_mean_over_several_dims_is_batch_invariant():
    x = _inputs()["a3"]
    with hal.aten_mode():
        full = x.mean(dim=(0, 2))
        part = x[:, :4].mean(dim=(0, 2))
    assert same(full[:4], part)
    assert not same(x.mean(dim=(0, 2))[:4], x[:, :4].mean(dim=(0, 2))) or \
        not same(x.mean(dim=(0, 2)), full)  # negative control: stock torch


# ---------------------------------------------------------------- reentrancy

_REENTRANT = textwrap.dedent("""
    import threading, torch, hal
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(1))
    w = torch.randn(20, 48, generator=torch.Generator().manual_seed(2))
    x[1, 3], x[4, 0], w[5, 7] = float("nan"), float("inf"), float("-inf")
    spec = "matmul.exact.s4.v2"
    want = hal.linear(x, w, spec=spec)  # outside aten_mode
    with hal.aten_mode():                 # 1. the same thread: the special-value pass's float32 @
        same_thread = hal.linear(x, w, spec=spec)
    entered, done, other = threading.Event(), threading.Event(), {}
    def holder():                         # 2. another thread holds aten_mode on
        with hal.aten_mode():
            entered.set()
            done.wait(300)
    def caller():
        other["y"] = hal.linear(x, w, spec=spec)
    h = threading.Thread(target=holder); h.start(); entered.wait(300)
    c = threading.Thread(target=caller); c.start(); c.join(240)
    done.set(); h.join(60)
    assert not c.is_alive(), "the other thread's exact linear hangs"
    b = lambda t: t.view(torch.int32)
    assert torch.equal(b(same_thread), b(want)) and torch.equal(b(other["y"]), b(want))
    assert torch.isnan(want).any() and torch.isinf(want).any()
    print("OK")
""")


def test_exact_linear_with_nan_inf_under_aten_mode_does_not_deadlock():
    """A hang is a failure (subprocess timeout), not a stuck test run."""
    try:
        r = subprocess.run([sys.executable, "-c", _REENTRANT], capture_output=True, text=True, timeout=540)
    except subprocess.TimeoutExpired:
        pytest.fail("hal.linear (exact spec, NaN/inf input) under hal.aten_mode() deadlocked")
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_backend_ops_mark_the_thread_as_inside_lockstep():
    seen = []
    real = am.ROUTES["mm"]
    am.ROUTES["mm"] = lambda a, b: seen.append(a.shape) or real(a, b)
    try:
        x, w = torch.randn(4, 8), torch.randn(8, 8)
        with hal.aten_mode():
            hal.linear(x, w, backend="stock")  # the stock backend's F.linear is lockstep's internal call
            torch.mm(x, w)
    finally:
        am.ROUTES["mm"] = real
    assert seen == [torch.Size([4, 8])]  # only the user's own torch.mm was routed


# ---------------------------------------------------------------- torch.compile (Inductor)


def _glue(x, w1, w2, g):
    h = F.silu(x @ w1)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g  # rms_norm written as glue
    return torch.softmax(F.linear(h, w2), dim=-1)


def test_inductor_compiled_code_under_aten_mode_gives_lockstep_bits():
    gen = torch.Generator().manual_seed(3)
    x, w1, w2, g = (torch.randn(*s, generator=gen) for s in ((7, 96), (96, 160), (64, 160), (160,)))
    compiled = torch.compile(_glue, backend="inductor", fullgraph=True)
    stock_compiled = compiled(x, w1, w2, g)  # compiled outside: Inductor's own code
    with hal.aten_mode():
        want = _glue(x, w1, w2, g)           # eager under aten_mode: lockstep's bits
        got = compiled(x, w1, w2, g)         # the graph compiled above, called inside
        fresh = torch.compile(lambda *a: _glue(*a) * 1, backend="inductor")(x, w1, w2, g)  # compiled inside
    assert same(got, want) and same(fresh, want)
    assert not same(stock_compiled, want)  # negative control: Inductor's bits are not lockstep's
    assert same(compiled(x, w1, w2, g), stock_compiled)  # outside again: the compiled graph runs


def test_inductor_without_the_eager_stance_would_give_stock_bits(monkeypatch):
    """The old behaviour rebuilt from the outside (no stance change): Inductor's generated code bypasses
    the overrides, so this is what the stance prevents."""
    gen = torch.Generator().manual_seed(3)
    x, w1, w2, g = (torch.randn(*s, generator=gen) for s in ((7, 96), (96, 160), (64, 160), (160,)))

    class _NoStance:
        def __exit__(self, *exc):
            return None
    monkeypatch.setattr(am, "_force_eager", lambda: _NoStance())
    compiled = torch.compile(_glue, backend="inductor", fullgraph=True)
    with hal.aten_mode():
        want = _glue(x, w1, w2, g)
        got = compiled(x, w1, w2, g)
    assert not same(got, want)


def test_entering_aten_mode_inside_a_compiled_function_fails_and_changes_nothing():
    from torch._dynamo import eval_frame

    def f(x):
        with hal.aten_mode():
            return F.silu(x) * 2
    x = _inputs()["x"]
    with pytest.raises(Exception, match="set_stance"):
        torch.compile(f, backend="inductor")(x)
    assert eval_frame._stance.stance == "default" and am._active["depth"] == 0
    assert not same(F.silu(x), hal.silu(x))  # no override was left installed: torch's own bits
    with hal.aten_mode():  # and the mode still works afterwards
        assert same(F.silu(x), hal.silu(x))
