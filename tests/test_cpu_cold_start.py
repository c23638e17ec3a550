"""Cold start of the cpu backend (issue 24): one compiled body for all three dtypes where the arithmetic is
the same after widening, one line when a process compiles, and `hal warmup` compiling ahead of time."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("numba")

import hal  # noqa: E402
from hal.kernels.cpu import attention, gated_delta_rule  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NOTICE = "lockstep: compiling the cpu backend's numba kernels"


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def test_attention_compiles_one_body_for_three_dtypes():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    for dt in DTYPES:
        q, k, v = (torch.randn(12, h, 16, generator=g).to(dt) for h in (4, 2, 2))
        out = hal.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, backend="cpu")
        ref = hal.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, backend="reference")
        assert torch.equal(_bits(out), _bits(ref)), dt
    # the task body: one float32 signature, whatever the input dtype (before: inlined into each driver, per dtype)
    # (0 where the drivers came from a warm disk cache: a cached caller links its callee without loading it)
    assert len(attention._attend_task.signatures) <= 1
    assert len(attention._attend_ser.signatures) <= 1


def test_gated_delta_rule_compiles_once_for_three_dtypes():
    g = torch.Generator().manual_seed(1)
    for dt in DTYPES:
        q, k = (torch.randn(1, 9, 2, 16, generator=g).to(dt) for _ in range(2))
        v = torch.randn(1, 9, 2, 16, generator=g).to(dt)
        gate = (-torch.rand(1, 9, 2, generator=g)).to(dt)
        beta = torch.rand(1, 9, 2, generator=g).to(dt)
        for spec in ("gated_delta_rule.strict.chunked.c64.d64.lsm1.v2", "gated_delta_rule.strict.serial.d64.lsm1.v2"):
            out, _ = hal.chunk_gated_delta_rule(q, k, v, gate, beta, spec=spec, backend="cpu")
            ref, _ = hal.chunk_gated_delta_rule(q, k, v, gate, beta, spec=spec, backend="reference")
            assert torch.equal(_bits(out), _bits(ref)), (dt, spec)
    # before: one compile of each per dtype (the tokens reached the kernels raw)
    assert len(gated_delta_rule._chunked_task.signatures) <= 1  # 0 from a warm cache, as above
    assert len(gated_delta_rule._serial.signatures) <= 1


def _python(code, cache, *args):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args] if args else [sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


_NORM_CALLS = """
import torch, hal
x = torch.linspace(-2, 2, 24).reshape(3, 8)
hal.rms_norm(x, torch.ones(8), backend="cpu")
hal.rms_norm(x.bfloat16(), torch.ones(8, dtype=torch.bfloat16), backend="cpu")  # compiles again: no second line
"""


def test_first_compile_prints_one_line_then_none_once_cached(tmp_path):
    cold = _python(_NORM_CALLS, tmp_path)
    assert cold.returncode == 0, cold.stderr
    lines = [ln for ln in cold.stderr.splitlines() if ln.startswith(NOTICE)]
    assert len(lines) == 1, cold.stderr
    # the first compile may be the FP-environment probe that runs at selection (hal.fp_env), before the op's
    # kernel: the line names whatever compiled first
    assert str(tmp_path) in lines[0] and "once per machine" in lines[0]
    warm = _python(_NORM_CALLS, tmp_path)  # the cache the first process left: loads, compiles nothing
    assert warm.returncode == 0, warm.stderr
    assert NOTICE not in warm.stderr, warm.stderr


def test_warmup_compiles_ahead_so_the_first_call_compiles_nothing(tmp_path):
    # control: without the warm-up the same first call compiles (and says so)
    control = _python(_NORM_CALLS.split("\nhal.rms_norm(x.bf")[0], tmp_path / "control")
    assert NOTICE in control.stderr, control.stderr
    w = _python(None, tmp_path / "warm", "-m", "hal.cli", "warmup", "--ops", "rms_norm", "--dtypes", "fp32", "bf16")
    assert w.returncode == 0, w.stdout + w.stderr
    assert "2/2" in w.stderr and "[" + "#" * 30 + "]" in w.stderr  # the progress bar, complete
    assert str(tmp_path / "warm") in w.stdout
    after = _python(_NORM_CALLS, tmp_path / "warm")
    assert after.returncode == 0, after.stderr
    assert NOTICE not in after.stderr, after.stderr


def test_warmup_rejects_an_unknown_family(tmp_path):
    r = _python(None, tmp_path, "-m", "hal.cli", "warmup", "--ops", "no_such_family")
    assert r.returncode != 0 and "unknown op family no_such_family" in r.stderr


def test_parallel_and_serial_drivers_share_one_compiled_body():
    import numpy as np

    from hal.kernels.cpu import rms_norm as k
    h = np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8)
    w = np.linspace(0.5, 2, 8, dtype=np.float32)
    par, ser = np.empty_like(h), np.empty_like(h)
    k._rms_par(h, w, np.float32(1e-6), 4, par)
    k._rms_ser(h, w, np.float32(1e-6), 4, ser)
    assert np.array_equal(par.view(np.int32), ser.view(np.int32))
    # prange's index is unsigned: passed as is, the row body would compile a second time for the parallel driver
    f32_rows = [s for s in k._rms_row.signatures if str(s[0]).startswith("array(float32")]
    assert len(f32_rows) <= 1, k._rms_row.signatures  # 0 where the drivers came from a warm disk cache


def test_row_wise_kernels_compile_one_body_for_three_dtypes():
    # softmax, elementwise, rotary and the GDN layer pieces read float32 copies (exact widening):
    # one signature each, where raw 16-bit inputs compiled once per dtype (gating: once per mix of dtypes)
    from hal.kernels.cpu import elementwise, qwen3_next, softmax
    g = torch.Generator().manual_seed(2)
    for dt in DTYPES:
        x = (torch.randn(6, 40, generator=g) * 4).to(dt)
        a, b = torch.randn(5, 4, generator=g).to(dt), torch.randn(5, 4, generator=g).to(dt)
        A_log, dt_bias = torch.randn(4, generator=g), torch.randn(4, generator=g)  # float32 beside dt
        cx = torch.randn(1, 7, 8, generator=g).to(dt)
        cw = torch.randn(8, 4, generator=g).to(dt)
        calls = [lambda be: hal.softmax(x, backend=be), lambda be: hal.log_softmax(x, backend=be),
                 lambda be: hal.logsumexp(x, backend=be),
                 lambda be: hal.silu(x, backend=be), lambda be: hal.silu_mul(x, x, backend=be),
                 lambda be: hal.gdn_gating(A_log, a, dt_bias, b, backend=be),
                 lambda be: hal.gdn_causal_conv1d(cx, cw, activation="silu", backend=be)]
        for i, call in enumerate(calls):
            got, ref = call("cpu"), call("reference")
            for o, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
                assert o.dtype == r.dtype and torch.equal(_bits(o), _bits(r)), (dt, i)
    for fn in (softmax._softmax_row, elementwise._map_unary_ser, elementwise._map_silu_mul_ser,
               qwen3_next._gating_par, qwen3_next._conv):
        assert len(fn.signatures) <= 1, (fn, fn.signatures)  # 0 from a warm cache, as above
