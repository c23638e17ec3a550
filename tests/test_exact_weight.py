"""Prepared exact weights (hal.exact_weight -> ExactWeight): a call with the prepared weight gives the raw
bits of the same call with the plain tensor (reference, cpu, jax backends; the Triton kernel under
TRITON_INTERPRET=1), for linear, matmul and token_logprobs, every dtype, s = 2..4, NaN/inf inputs;
gradients as with the plain weight; staleness and bad inputs raise clear errors; negative
controls (slices of a perturbed weight, stale slices re-stamped past the guard) are caught by the same check.
Every way of changing a weight is refused: tests/test_exact_fresh.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import hal
from hal.kernels.exact import core
from hal.kernels.exact.prepared import ExactWeight
from hal.spec import ExactMatmulSpec, TokenLogprobsSpec
from test_exact_matmul import DTYPES, _spread, assert_bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S4 = ExactMatmulSpec(slices=4)
TLP = TokenLogprobsSpec(matmul=S4)


def _xwb(dtype, m=(2, 3), k=70, n=9, seed=0, specials=False):
    x, w, b = _spread((*m, k), dtype, seed), _spread((n, k), dtype, seed + 1), _spread((n,), dtype, seed + 2)
    if specials:  # non-finite values are not in the slices: the prepared path reads the source for them
        x[0, 1, 4], w[3, 5], w[6, 7] = float("nan"), float("inf"), float("-inf")
    return x, w, b


@pytest.mark.parametrize("s", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_prepared_matches_per_call(dtype, s):
    spec = ExactMatmulSpec(slices=s)
    for specials, bias in ((False, True), (True, False)):
        x, w, b = _xwb(dtype, seed=s, specials=specials)
        b = b if bias else None
        for maker in ("reference", "cpu"):  # whose slicer prepared it: the same slices
            ew = hal.exact_weight(w, spec=spec, backend=maker)
            for be in ("reference", "cpu"):
                want = hal.linear(x, w, b, spec=spec, backend=be)
                assert_bits(f"{be} {dtype} s{s} by {maker}", want, hal.linear(x, ew, b, spec=spec, backend=be))
                assert_bits(f"{be} M=1", want[1, 2], hal.linear(x[1, 2], ew, b, spec=spec, backend=be))


def test_matmul_layout():
    a, b = _spread((4, 33), torch.bfloat16, 1), _spread((33, 6), torch.bfloat16, 2)
    eb = hal.exact_weight(b, spec=S4, layout="matmul")
    for be in ("reference", "cpu"):
        assert_bits(be, hal.matmul(a, b, spec=S4, backend=be), hal.matmul(a, eb, spec=S4, backend=be))
    with pytest.raises(hal.InputError, match=r"b: this ExactWeight was prepared from weight \[N, K\]"):
        hal.matmul(a, hal.exact_weight(b.T, spec=S4), spec=S4)
    with pytest.raises(hal.InputError, match=r"weight: this ExactWeight was prepared from b \[K, N\]"):
        hal.linear(a, eb, spec=S4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_logprobs_prepared_matches_per_call(monkeypatch, dtype):
    """cpu's vocab tiles forced small: a prepared LM head is read one tile (a strided view) at a time."""
    from hal.kernels.cpu import exact_logprobs
    monkeypatch.setattr(exact_logprobs, "VOCAB_TILE", 128)
    g = torch.Generator().manual_seed(5)
    hid = (torch.randn(6, 80, generator=g) * 3).to(dtype)
    w = (torch.randn(300, 80, generator=g) * 0.1).to(dtype)
    tok = torch.randint(0, 300, (6,), generator=g)
    hid[2, 9] = float("inf")
    ew = hal.exact_weight(w, spec=TLP.id)  # an exact token_logprobs spec (or its id) prepares its matmul's slices
    assert ew.spec == S4
    for be in ("reference", "cpu"):
        want = hal.token_logprobs(hid, w, tok, 0.7, spec=TLP, backend=be)
        assert_bits(f"{be} {dtype}", want, hal.token_logprobs(hid, ew, tok, 0.7, spec=TLP, backend=be))


def test_autograd_flows_to_the_source():
    """Gradients w.r.t. x and the source weight are those of the plain call (the weight's land on the source)."""
    x, w, b = _xwb(torch.float32, specials=False)
    results = []
    for prepared in (False, True):
        xp, wp, bp = (t.clone().requires_grad_() for t in (x, w, b))
        arg = hal.exact_weight(wp, spec=S4) if prepared else wp
        y = hal.linear(xp, arg, bp, spec=S4, backend="cpu")
        y.square().sum().backward()
        results.append((y.detach(), xp.grad, wp.grad, bp.grad))
    for name, want, got in zip(("y", "x.grad", "weight.grad", "bias.grad"), *results):
        assert_bits(name, want, got)
    hid, tok = x[0], torch.tensor([1, 2, 3])
    wp = w.clone().requires_grad_()
    hal.token_logprobs(hid, hal.exact_weight(wp, spec=TLP), tok, spec=TLP).sum().backward()
    assert wp.grad is not None and wp.grad.abs().sum() > 0


def test_stale_weight_is_refused():
    _, w, _ = _xwb(torch.float32)
    x = _spread((3, 70), torch.float32, 9)
    p = torch.nn.Parameter(w.clone())
    ew = hal.exact_weight(p, spec=S4)
    hal.linear(x, ew, spec=S4)  # fresh: fine
    with torch.no_grad():  # an optimizer step's in-place update (torch.optim costs seconds to import)
        p.sub_(0.1 * torch.ones_like(p))
    msg = r"weight: weight changed since exact_weight\(\.\.\.\).*prepare it again"
    for be in ("reference", "cpu", "stock"):
        with pytest.raises(hal.InputError, match=msg):
            hal.linear(x, ew, spec=S4, backend=be)
    with pytest.raises(hal.InputError, match="lm_head_weight: weight changed"):
        hal.token_logprobs(x, ew, torch.tensor([0, 1, 2]), spec=TLP)
    with pytest.raises(hal.InputError, match="weight changed"):  # kernel-level callers are guarded too
        from hal.kernels.exact import cpu
        cpu.linear(x, ew, None, S4)
    ew2 = hal.exact_weight(p, spec=S4)
    p.data = p.data.clone()  # storage replaced: the address changes
    with pytest.raises(hal.InputError, match="weight changed"):
        hal.linear(x, ew2, spec=S4)
    ew3 = hal.exact_weight(p, spec=S4)
    assert_bits("re-prepared", hal.linear(x, p.detach(), spec=S4), hal.linear(x, ew3, spec=S4))


def test_bad_inputs():
    x, w, _ = _xwb(torch.bfloat16, m=(3,))
    ew = hal.exact_weight(w, spec=S4)
    with pytest.raises(hal.InputError, match=r"weight: an ExactWeight holds slices for matmul.exact.s4.v2, but the "
                                             r"call's spec matmul.strict.k64"):
        hal.linear(x, ew)
    with pytest.raises(hal.InputError, match="weight: this ExactWeight was prepared for matmul.exact.s4.v2, but the "
                                             "call uses matmul.exact.s3.v2"):
        hal.linear(x, ew, spec="matmul.exact.s3.v2")
    with pytest.raises(hal.InputError, match="lm_head_weight: an ExactWeight .* token_logprobs.strict.h64"):
        hal.token_logprobs(x, ew, torch.tensor([0, 1, 2]))
    with pytest.raises(hal.InputError, match="dtypes differ"):
        hal.linear(x.float(), ew, spec=S4)
    with pytest.raises(hal.InputError, match=r"x.shape\[-1\] \(K\) vs weight.shape\[1\]"):
        hal.linear(x[:, :-1], ew, spec=S4)
    with pytest.raises(hal.InputError, match="different devices"):
        hal.linear(x.to("meta"), ew, spec=S4)
    with pytest.raises(hal.InputError, match="b: an ExactWeight"):
        hal.matmul(x, hal.exact_weight(w.T, spec=S4, layout="matmul"))
    with pytest.raises(hal.SpecError, match="spec: exact_weight needs an exact matmul spec"):
        hal.exact_weight(w, spec="matmul.strict.k64.v2")
    with pytest.raises(hal.SpecError, match="spec: exact_weight needs"):
        hal.exact_weight(w, spec=hal.spec.DEFAULTS["token_logprobs"])
    with pytest.raises(hal.InputError, match="weight: the exact policy takes"):
        hal.exact_weight(w.double(), spec=S4)
    with pytest.raises(hal.InputError, match="weight must be 2-D"):
        hal.exact_weight(w[0], spec=S4)
    with pytest.raises(hal.InputError, match="layout must be one of"):
        hal.exact_weight(w, spec=S4, layout="kn")
    with pytest.raises(hal.InputError, match="weight must be a torch.Tensor"):
        hal.exact_weight(ew, spec=S4)


def test_negative_controls_are_caught():
    """The prepared-vs-per-call check fails when the slices are not the weight's: slices of a weight with
    one value's sign flipped, and stale slices (of the weight before a ``.data`` write) re-stamped past the guard."""
    x, w, _ = _xwb(torch.float32, m=(4,))
    near = w.clone()
    j = int(w[2].abs().argmax())  # one value of the row (its largest) with the wrong sign
    near[2, j] = -near[2, j]
    wrong = ExactWeight(w, S4, "linear", core.slice_rows(near, 4))
    want = hal.linear(x, w, spec=S4, backend="reference")
    assert_bits("true slices", want, hal.linear(x, hal.exact_weight(w, spec=S4), spec=S4, backend="reference"))
    for be in ("reference", "cpu"):
        with pytest.raises(AssertionError):
            assert_bits(f"{be} perturbed slices", want, hal.linear(x, wrong, spec=S4, backend=be))
    p = w.clone()
    ew = hal.exact_weight(p, spec=S4)
    p.data.mul_(3)  # not counted by torch's version counter; the content stamp sees it
    stale = ExactWeight(p, S4, "linear", ew.sliced)  # the old bits' slices stamped with the new bits: unguarded
    with pytest.raises(AssertionError):
        assert_bits("stale via .data", hal.linear(x, p, spec=S4), hal.linear(x, stale, spec=S4))
    with pytest.raises(hal.InputError, match="weight changed"):
        hal.linear(x, ew, spec=S4)


def test_jax_backend_takes_prepared_weights():
    """The jax backend slices per call (it is given the source): the same bits as the prepared reference."""
    pytest.importorskip("jax", reason="jax is not installed")
    x, w, b = _xwb(torch.bfloat16, m=(2,), k=20, n=5)
    ew = hal.exact_weight(w, spec=S4)
    assert_bits("jax", hal.linear(x, ew, b, spec=S4, backend="reference"), hal.linear(x, ew, b, spec=S4, backend="jax"))


TRITON_SCRIPT = textwrap.dedent("""
    import torch, hal
    from hal.conformance.bits import first_divergence
    from hal.kernels.exact.triton_matmul import exact_linear_triton
    from hal.spec import ExactMatmulSpec
    from test_exact_matmul import _spread
    bad = []
    for i, (dtype, s) in enumerate([(torch.float32, 4), (torch.bfloat16, 3), (torch.float16, 2)]):
        spec = ExactMatmulSpec(slices=s)
        x, w, b = _spread((5, 90), dtype, i), _spread((11, 90), dtype, i + 1), _spread((11,), dtype, i + 2)
        w[4, 2] = float("-inf") if i == 1 else w[4, 2]
        ew = hal.exact_weight(w, spec=spec)  # the cpu backend's compiled slicer
        want = hal.linear(x, w, b, spec=spec, backend="reference")
        for got in (exact_linear_triton(x, ew, b, spec, (16, 16, 32), 3), exact_linear_triton(x, w, b, spec)):
            d = first_divergence(f"triton {dtype} s{s}", want, got)
            bad += [] if d is None else [str(d)]
    # negative control: slices of a weight with one sign flipped, passed as this weight's, are caught
    from hal.kernels.exact import core
    from hal.kernels.exact.prepared import ExactWeight
    near = w.clone()
    j = int(w[0].abs().argmax())  # one value of the row (its largest) with the wrong sign
    near[0, j] = -near[0, j]
    wrong = ExactWeight(w, spec, "linear", core.slice_rows(near, s))
    caught = first_divergence("control", want, exact_linear_triton(x, wrong, b, spec))
    print("control-caught" if caught is not None else "control-missed")
    print("\\n".join(bad) or "all-ok")
    raise SystemExit(1 if bad else 0)
""")


def test_triton_kernel_reads_prepared_weight():
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all-ok" in r.stdout and "control-caught" in r.stdout, r.stdout


def test_conformance_prepared_weight_check_catches_wrong_slices(monkeypatch):
    """The matmul_exact family's L2 'prepared-weight' check passes on the reference and catches slices
    prepared from a weight one value off (raw bits)."""
    from hal.conformance import suites
    from hal.conformance.bits import first_divergence
    fam = suites.get("matmul_exact")
    mod = sys.modules[type(fam).__module__]
    case = next(c for c in fam.cases() if c.id == "m7_k129_n33.fp32" and c.spec.slices == 4)
    x = fam.make_inputs(case)
    backend = hal.get_backend("reference")
    base = mod.run_matmul(backend, case, x)
    assert all(first_divergence(n, e, g) is None for n, e, g in mod._prepared_weight(backend, case, x, base))

    real = hal.exact_weight

    def off_by_one_value(w, **kw):
        w2 = w.clone()
        w2[0, 0] = -w2[0, 0]
        return real(w2, **kw)

    monkeypatch.setattr(hal, "exact_weight", off_by_one_value)
    assert any(first_divergence(n, e, g) is not None for n, e, g in mod._prepared_weight(backend, case, x, base))
