"""The GDN backward's chunk-state scan as Triton kernels (kernels/triton/gdn_backward.py), in the interpreter.

Checks (tests/scripts/triton_gdn_backward_check.py, one subprocess each): the scan's outputs and gradients within 1e-5
(relative) of hal's torch scan in float64, with and without a gradient into S_starts, masked head dims in
LOCKSTEP_FULL=1; a second run gives the same raw bits; end to end, ``hal.chunk_gated_delta_rule(...,
backend="triton")`` gradients (varlen, GQA, initial state, L2 norm) within 1e-5 of the float64 token-by-token
oracle, the Triton scan counted, a second backward bit-identical; negative control: a backward that drops the
end_c decay of dS fails both checks. Default ~45 s (CI); LOCKSTEP_FULL=1 adds more cases.
Without the interpreter: the hook (a backend's ``gdn_state_scan`` is used, its None falls back to the torch
scan, LOCKSTEP_GDN_BACKWARD=recurrent / chunked-torch skip it) and the kernels' input checks.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from _triton_seq_run import ROOT, interpreter_ok, run_checks  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "scripts", "triton_gdn_backward_check.py")
needs_interpreter = pytest.mark.skipif(not interpreter_ok(), reason="needs the Triton 3.9+ interpreter")


@needs_interpreter
def test_scan_kernels_close_to_float64_torch_scan_and_deterministic():
    out = run_checks("scan", script=SCRIPT)
    assert "close to float64 torch scan: ok" in out and "second run same bits: ok" in out


@needs_interpreter
def test_triton_backend_gradients_close_to_float64_oracle_and_deterministic():
    out = run_checks("e2e", script=SCRIPT)
    assert "triton scan ran: ok" in out and "close to float64 oracle: ok" in out and "same bits: ok" in out


@needs_interpreter
def test_negative_control_dropped_decay_is_caught():
    out = run_checks("negative", script=SCRIPT)
    assert "caught by the scan check" in out and "caught by the e2e check" in out


# ------------------------------------------------------------------ the hook (no interpreter)

NAMES = ("q", "k", "v", "g", "beta", "S0")


def _hooked(answer):
    """A reference backend whose gdn_state_scan records its calls and returns ``answer(*args)``."""
    from hal.backends.reference import ReferenceBackend

    class Hooked(ReferenceBackend):
        name = "reference-hooked"
        calls = 0

        def gdn_state_scan(self, *args):
            type(self).calls += 1
            return answer(*args)
    return Hooked()


def _grads(backend):
    import hal
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(1, 100, 1, 8, generator=gen), torch.randn(1, 100, 1, 8, generator=gen),
         torch.randn(1, 100, 2, 8, generator=gen), -torch.rand(1, 100, 2, generator=gen),
         torch.rand(1, 100, 2, generator=gen), torch.randn(1, 2, 8, 8, generator=gen)]
    leaves = [t.requires_grad_(True) for t in x]
    o, fin = hal.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, backend=backend)
    return torch.autograd.grad((o * o).sum() + fin.sum(), leaves)


def test_backward_takes_the_backend_scan_and_its_none_fallback(monkeypatch):
    from hal import gdn_backward
    from hal.conformance.bits import assert_same_bits, same_bits
    want = _grads("reference")
    same = _hooked(gdn_backward.state_scan)  # the torch scan behind the hook: the reference's bits
    for n, a, b in zip(NAMES, want, _grads(same)):
        assert_same_bits(a, b, n)
    assert same.calls == 1
    none = _hooked(lambda *a: None)  # None back: the torch scan
    for n, a, b in zip(NAMES, want, _grads(none)):
        assert_same_bits(a, b, n)
    assert none.calls == 1
    # negative control: a hooked scan that answers differently changes the gradients (the hook's answer is used)
    half_s0 = _hooked(lambda U, W, kt, end, S0: gdn_backward.state_scan(U, W, kt, end, S0 * 0.5))
    assert not all(same_bits(a, b) for a, b in zip(want, _grads(half_s0)))
    # the token-by-token form has no scan; chunked-torch keeps the torch scan (the reference's bits)
    never = lambda *a: (_ for _ in ()).throw(AssertionError("backend scan called"))  # noqa: E731
    monkeypatch.setenv("LOCKSTEP_GDN_BACKWARD", "recurrent")
    rec = _hooked(never)
    _grads(rec)
    monkeypatch.setenv("LOCKSTEP_GDN_BACKWARD", "chunked-torch")
    for n, a, b in zip(NAMES, want, _grads(rec)):
        assert_same_bits(a, b, n)
    assert rec.calls == 0


def test_triton_backend_offers_the_scan_only_where_it_serves():
    from hal.backends.triton import TritonBackend
    from hal.errors import InputError
    from hal.kernels.triton import gdn_backward as kb
    from hal.kernels.triton.launch import interpreting
    U, W, kt = torch.zeros(1, 1, 2, 64, 16), torch.zeros(1, 1, 2, 64, 16), torch.zeros(1, 1, 2, 16, 64)
    end, S0 = torch.zeros(1, 1, 2), torch.zeros(1, 1, 16, 16)
    be = TritonBackend()
    assert be.gdn_state_scan(*(x.double() for x in (U, W, kt, end, S0))) is None  # float64: the torch scan
    big = torch.zeros(1, 1, 2, 64, 512)
    assert not kb.serves(big, W, torch.zeros(1, 1, 16, 512))  # d_v > 256
    assert kb.serves(U, W, S0) == interpreting()  # CPU tensors: the interpreter only
    with pytest.raises(InputError, match="kt must be"):
        kb.state_scan(U, W, kt.transpose(-1, -2), end, S0)
    with pytest.raises(InputError, match="end must be"):
        kb.state_scan(U, W, kt, end[..., :1], S0)
