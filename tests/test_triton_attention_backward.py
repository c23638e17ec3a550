"""Triton attention backward kernels in the Triton interpreter (CPU), through hal's autograd.

Checks (tests/scripts/triton_attn_backward_check.py): varlen with empty sequences, padding rows, Tq < Tk and a
sequence with more queries than keys (rows that see no key), GQA / MQA, causal, causal + sliding window,
a non-causal (left, right) window, an lse gradient, fp32 / bf16 / fp16: gradients within a dtype tolerance
of hal's float64 torch backward (backward bits are not a spec); a second run gives the same raw bits;
exact zeros on padding rows and rows that see no key. Negative control: kernels that drop the dlse term
fail the same closeness check. Default: three cases (CI, ~50 s); LOCKSTEP_FULL=1 adds head dims 24-64
(~110 s). Without the interpreter: autograd takes a backend's ``flash_attn_varlen_backward`` (its None
means hal's torch backward) and double backward (create_graph) never calls it.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")
SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_attn_backward_check.py")


def test_gradients_close_to_float64_deterministic_zero_rows():
    out = run_checks("grads", script=SCRIPT)
    assert "close to float64 oracle: ok" in out and "second run same bits: ok" in out


def test_negative_control_dropped_dlse_is_caught():
    out = run_checks("negative", script=SCRIPT)
    assert "wrong variant caught" in out


def test_gpu_benchmark_fails_cleanly_without_cuda():
    import subprocess
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run (benchmarks/gpu_check.sh step attn-train)")
    r = subprocess.run([sys.executable, "-m", "benchmarks.attn_train_bench"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr, (r.returncode, r.stderr[-2000:])


# ------------------------------------------------------------------ the autograd hook (no interpreter)


def _hooked(answer):
    """A reference backend whose flash_attn_varlen_backward records its calls and returns ``answer(...)``."""
    from hal.backends.reference import ReferenceBackend

    class Hooked(ReferenceBackend):
        name = "reference-hooked"
        calls = 0

        def flash_attn_varlen_backward(self, q, k, *args):
            type(self).calls += 1
            return answer(q, k)
    return Hooked()


def _small():
    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 8, generator=g, requires_grad=True) for h in (2, 1, 1))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return q, k, v, cu


def test_autograd_takes_the_backend_hook_and_its_none_fallback():
    import torch

    import hal
    from hal.conformance.bits import assert_same_bits
    q, k, v, cu = _small()
    marker = lambda q, k: (torch.full_like(q, 7.0), torch.full_like(k, 8.0), torch.full_like(k, 9.0))  # noqa: E731
    be = _hooked(marker)
    out = hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, backend=be)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert be.calls == 1 and float(gq[0, 0, 0]) == 7.0 and float(gv[0, 0, 0]) == 9.0  # the hook's values
    # None back: hal's torch backward, the same bits as a backend without the hook
    none = _hooked(lambda q, k: None)
    got = torch.autograd.grad(hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, backend=none).sum(),
                              (q, k, v))
    want = torch.autograd.grad(hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True,
                                                          backend="reference").sum(), (q, k, v))
    assert none.calls == 1
    for name, a, b in zip(("dq", "dk", "dv"), want, got):
        assert_same_bits(a, b, name)


def test_double_backward_skips_the_kernels():
    import torch

    import hal
    q, k, v, cu = _small()
    be = _hooked(lambda q, k: (_ for _ in ()).throw(AssertionError("kernels called under create_graph")))
    out = hal.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, backend=be)
    gq, = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    assert gq.grad_fn is not None and be.calls == 0  # differentiable torch math, not the kernels
