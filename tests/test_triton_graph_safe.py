"""Every Triton op's launch path reads no tensor value on the host, so it can be captured in a CUDA graph (issue 23).

On CPU, in a ``TRITON_INTERPRET=1`` subprocess (this file run as a script): each public op is called once through
hal with ``backend="triton"`` and every kernel launch stubbed out (``kernel[grid](...)`` is a no-op), recording the
arguments hal hands the backend. hal's own validation reads values (cu_seqlens, cache_seqlens, token ids: bad
input gets a clear error there); the launch path is what a capture replays, so each recorded backend call is then
run again with ``Tensor.item / .cpu / .tolist / .numpy / __int__ / __bool__ / __float__ / __index__`` raising,
in the interpreter's block layout and in the GPU's (what a CUDA launch computes). Each call must reach at least
one launch and read nothing; its scratch buffers must come from the workspace cache (kernels/triton/workspace.py)
sized from shapes: a second call, or a decode call with other cache lengths, allocates none, and a capture that
meets an unwarmed shape raises. Replayed on "meta" tensors, no launch path may make a CPU tensor (on CUDA
it would be copied to the device, a sync) except the gated delta rule family's, which hal feeds host
positions and Python offsets (known, listed in GDN_HOST_TENSORS: those paths are not capturable yet).
Negative controls (same run): a launcher that reads a value back in each of those ways is caught, and so is
the old decode-attention path that sized its key splits from ``int(seqlens.max())``; the GDN paths are the
host-tensor check's. About 30 s here.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the tensor methods through which Python code reads a value back to the host
HOST_READS = ("item", "cpu", "tolist", "numpy", "__int__", "__bool__", "__float__", "__index__")
#: launch paths known to make host tensors (not capturable yet: docs/triton.md, "CUDA graphs")
GDN_HOST_TENSORS = ("gdn chunked", "gdn serial packed", "gdn chunked packed", "gdn backward", "gdn_causal_conv1d")


def test_triton_launch_paths_read_no_tensor_values():
    import pytest
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _triton_seq_run import interpreter_ok
    if not interpreter_ok():
        pytest.skip("the Triton interpreter before 3.9 rounds tl.fma twice")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    # every op the backend implements was replayed, in both layouts, and launched kernels
    assert report["missing"] == [], report
    assert report["calls"] >= 27 and len(report["replayed"]) == 2 * report["calls"] and all(n > 0 for n in report["replayed"].values()), report
    assert report["reads"] == {}, report["reads"]
    assert report["workspace"] == ["reused", "capacity-sized", "capture refuses unwarmed", "capture reuses warmed"]
    # no launch path makes a host tensor (copied to the device: a sync) but the gated delta rule family's: hal
    # hands them host positions (a fresh state's) and Python offsets; they are caught here, so the check bites
    assert sorted(report["host_tensors"]) == sorted(GDN_HOST_TENSORS), report["host_tensors"]
    # negative controls: each kind of host read, and the old seqlens.max() sizing, are caught
    assert sorted(report["caught"]) == sorted([*HOST_READS, "kvcache sized from int(seqlens.max())"]), report


def test_launch_path_refuses_a_call_that_reaches_no_triton_op():
    import pytest
    import torch
    import hal
    from hal.backends.triton import TritonBackend, _op_methods, launch_path
    before = dict(vars(TritonBackend))
    with pytest.raises(ValueError, match="launch_path: the call made no triton backend call"):
        launch_path(lambda: hal.rms_norm(torch.ones(2, 8), torch.ones(8), backend="reference"))
    assert dict(vars(TritonBackend)) == before and _op_methods()  # the backend's methods are back as they were


# ------------------------------------------------------------------ the subprocess (TRITON_INTERPRET=1)

class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads():
    """Tensor methods that read a value back to the host raise HostRead while active."""
    import torch
    saved = {n: getattr(torch.Tensor, n) for n in HOST_READS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} on a launch path")
        return method
    for n in HOST_READS:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@contextlib.contextmanager
def stubbed_launches():
    """``kernel[grid](...)`` launches nothing while active; yields the list of launched kernels' grids."""
    from triton.runtime.jit import KernelInterface  # base of JITFunction, InterpretedFunction, Autotuner
    real, launched = KernelInterface.__getitem__, []

    def no_launch(kernel, grid):
        return lambda *args, **kwargs: launched.append(grid)
    KernelInterface.__getitem__ = no_launch
    try:
        yield launched
    finally:
        KernelInterface.__getitem__ = real


@contextlib.contextmanager
def gpu_layout():
    """The launchers size blocks and grids as for a CUDA launch (not the interpreter's few large programs)."""
    from hal.kernels.triton import launch
    real = launch.interpreting
    launch.interpreting = lambda: False
    try:
        yield
    finally:
        launch.interpreting = real


def calls():
    """(name, thunk) of public op calls reaching every Triton backend op."""
    import torch
    import hal
    from hal.spec import POLICY_SPECS, FastMatmulSpec, FastMatmulV3Spec, GatedDeltaRuleSpec
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)
    tri = dict(backend="triton")
    bf = torch.bfloat16
    w, b = r(96, 64), r(96)
    q, k, v = r(17, 4, 32, dtype=bf), r(17, 2, 32, dtype=bf), r(17, 2, 32, dtype=bf)
    cu = torch.tensor([0, 5, 9, 17], dtype=torch.int32)
    kc, vc = r(3, 48, 2, 32, dtype=bf), r(3, 48, 2, 32, dtype=bf)
    pages_k, pages_v = r(8, 128, 2, 32, dtype=bf), r(8, 128, 2, 32, dtype=bf)  # 384 keys: 2 splits
    table = torch.tensor([[0, 3, 5], [1, 2, 4], [7, 6, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 7, 33], dtype=torch.int32)
    qd = r(3, 1, 4, 32, dtype=bf)
    gq, gk, gv = r(2, 20, 2, 16), r(2, 20, 2, 16), r(2, 20, 4, 16)
    gg, gbeta = -torch.rand(2, 20, 4, generator=g), torch.rand(2, 20, 4, generator=g)
    cu_g = torch.tensor([0, 7, 20], dtype=torch.int64)
    pos = torch.arange(6)
    cos, sin = r(6, 16), r(6, 16)

    def varlen_backward():
        qq = q.clone().requires_grad_()
        out = hal.flash_attn_varlen_func(qq, k, v, cu, cu, 8, 8, causal=True, **tri)
        out.float().sum().backward()

    def gdn_backward():
        qq = gq.clone().requires_grad_()
        o, _ = hal.chunk_gated_delta_rule(qq, gk, gv, gg, gbeta, spec=GatedDeltaRuleSpec(variant="chunked"), **tri)
        o.sum().backward()

    return [
        ("linear GEMV", lambda: hal.linear(r(1, 64, dtype=bf), w.to(bf), **tri)),
        ("linear + bias", lambda: hal.linear(r(40, 64), w, b, **tri)),
        ("matmul", lambda: hal.matmul(r(2, 5, 64), w.t(), **tri)),
        ("fast linear", lambda: hal.linear(r(40, 64, dtype=bf), w.to(bf), spec=FastMatmulSpec(), **tri)),
        ("fast linear v3 decode", lambda: hal.linear(r(40, 64, dtype=bf), w.to(bf), spec=FastMatmulV3Spec(), **tri)),
        ("fast linear v3 prefill (persistent, TMA)", lambda: hal.linear(r(300, 64, dtype=bf), w.to(bf),
                                                                         spec=FastMatmulV3Spec(), **tri)),
        ("rms_norm", lambda: hal.rms_norm(r(3, 64), r(64), 1e-6, **tri)),
        ("rms_norm + residual", lambda: hal.rms_norm(r(3, 64, dtype=bf), r(64, dtype=bf), 1e-6,
                                                     residual=r(3, 64, dtype=bf), **tri)),
        ("softmax", lambda: hal.softmax(r(4, 300), **tri)),
        ("log_softmax", lambda: hal.log_softmax(r(4, 300), **tri)),
        ("logsumexp", lambda: hal.logsumexp(r(4, 300), **tri)),
        ("token_logprobs", lambda: hal.token_logprobs(r(5, 64), w, torch.tensor([0, 3, 95, 7, 1]), 0.7, **tri)),
        ("fast token_logprobs", lambda: hal.token_logprobs(r(5, 64, dtype=bf), w.to(bf), torch.tensor([0, 3, 95, 7, 1]),
                                                           0.7, spec=POLICY_SPECS["fast"]["token_logprobs"], **tri)),
        ("sigmoid", lambda: hal.sigmoid(r(4, 50), **tri)),
        ("silu", lambda: hal.silu(r(4, 50), **tri)),
        ("softplus", lambda: hal.softplus(r(4, 50), **tri)),
        ("silu_mul", lambda: hal.silu_mul(r(4, 50), r(4, 50), **tri)),
        ("rotary_cos_sin", lambda: hal.rotary_cos_sin(pos, 32, 500000.0, **tri)),
        ("apply_rotary", lambda: hal.apply_rotary(r(1, 6, 4, 32), cos[None, :, None], sin[None, :, None], **tri)),
        ("attention varlen", lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True, **tri)),
        ("attention varlen backward", varlen_backward),
        ("attention decode", lambda: hal.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, **tri)),
        ("attention paged decode", lambda: hal.flash_attn_with_kvcache(qd, pages_k, pages_v, cache_seqlens=lens,
                                                                        block_table=table, num_splits=2, **tri)),
        ("attention paged decode, long", lambda: hal.flash_attn_with_kvcache(qd, pages_k, pages_v,
                                                                              cache_seqlens=lens * 9, block_table=table,
                                                                              **tri)),
        ("gdn chunked", lambda: hal.chunk_gated_delta_rule(gq, gk, gv, gg, gbeta, output_final_state=True, **tri)),
        ("gdn serial packed", lambda: hal.fused_recurrent_gated_delta_rule(
            gq.reshape(1, 40, 2, 16), gk.reshape(1, 40, 2, 16), gv.reshape(1, 40, 4, 16), gg.reshape(1, 40, 4),
            gbeta.reshape(1, 40, 4), cu_seqlens=torch.tensor([0, 11, 40]), spec=GatedDeltaRuleSpec(variant="serial"),
            **tri)),
        ("gdn chunked packed", lambda: hal.chunk_gated_delta_rule(
            gq.reshape(1, 40, 2, 16), gk.reshape(1, 40, 2, 16), gv.reshape(1, 40, 4, 16), gg.reshape(1, 40, 4),
            gbeta.reshape(1, 40, 4), cu_seqlens=cu_g * 2, **tri)),
        ("gdn backward", gdn_backward),
        ("gdn_gating", lambda: hal.gdn_gating(r(4), r(3, 4), r(4), r(3, 4), **tri)),
        ("gdn_causal_conv1d", lambda: hal.gdn_causal_conv1d(r(2, 9, 24), r(24, 4), r(24), **tri)),
    ]


def backend_ops() -> set[str]:
    """The op methods the triton backend implements (its op mixins)."""
    from hal.backends.triton import _op_methods
    return set(_op_methods())


def launch_paths() -> dict:
    """{label: replay thunk}: each call made once through hal (launches stubbed), its backend calls kept."""
    from hal.backends.triton import launch_path
    with stubbed_launches():
        return {label: launch_path(call)[0] for label, call in calls()}


def replay(paths: dict, layout: str, reads: dict, launches: dict):
    for label, path in paths.items():
        key = f"{layout}: {label}"
        with (gpu_layout() if layout == "gpu" else contextlib.nullcontext()), stubbed_launches() as launched:
            try:
                with no_host_reads():
                    path()
            except HostRead as e:
                reads[key] = str(e)
        launches[key] = len(launched)


def host_tensors_made(paths: dict) -> list[str]:
    """Labels of the launch paths that make a CPU tensor when their inputs are on another device (replayed on
    "meta" tensors, launches stubbed): on CUDA that tensor is copied to the device, a host sync that a capture
    refuses (or bakes in)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    class HostMade(TorchDispatchMode):
        found = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.found |= any(isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs)
            return out

    def on_meta(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) \
            else x
    made = []
    for label, path in paths.items():
        mode = HostMade()
        with stubbed_launches(), mode:
            for backend, method, args, kwargs in path.calls:
                method(backend, *tree_map(on_meta, args), **tree_map(on_meta, kwargs))
        if mode.found:
            made.append(label)
    return made


def check_workspaces(paths: dict) -> list[str]:
    """Scratch comes from the cache, sized from shapes, and a capture never allocates one."""
    from hal.kernels.triton import workspace
    done = []
    decode, other_lengths = paths["attention paged decode"], paths["attention paged decode, long"]
    with stubbed_launches():
        workspace.clear()
        decode()
        before = {k: e.tensor for k, e in workspace._cache.items()}
        assert before, "the split-KV decode used no workspace"
        decode()
        assert {k: e.tensor for k, e in workspace._cache.items()} == before
        done.append("reused")
        other_lengths()
        assert set(workspace._cache) == set(before), "the workspace shapes followed the cache lengths"
        done.append("capacity-sized")
        real = workspace.capturing
        workspace.capturing = lambda device: True
        try:
            workspace.clear()
            try:
                decode()
            except RuntimeError as e:
                assert "was not allocated before this CUDA graph capture" in str(e), e
                done.append("capture refuses unwarmed")
            workspace.capturing = real
            decode()
            warmed = {k: e.tensor for k, e in workspace._cache.items()}
            workspace.capturing = lambda device: True
            decode()
            assert {k: e.tensor for k, e in workspace._cache.items()} == warmed
            assert all(e.pinned for e in workspace._cache.values())
            done.append("capture reuses warmed")
        finally:
            workspace.capturing = real
    return done


def negative_controls(paths: dict) -> list[str]:
    """Launchers that read a value back are caught by the same guard."""
    import torch
    from hal.kernels.triton import attention
    x = torch.arange(4, dtype=torch.int32)
    readers = {"item": lambda: x.max().item(), "cpu": lambda: x.cpu(), "tolist": lambda: x.tolist(),
               "numpy": lambda: x.numpy(), "__int__": lambda: int(x[0]), "__bool__": lambda: bool(x.any()),
               "__float__": lambda: float(x[0]), "__index__": lambda: range(x[0])}
    caught = []
    for name, read in readers.items():
        try:
            with no_host_reads():
                read()
        except HostRead:
            caught.append(name)
    # the old decode path: key splits sized from the longest cache length, read back to the host
    real_attend = attention.attend

    def old_attend(*a, max_k, **kw):
        return real_attend(*a, max_k=int(kw["klen"].max()), **kw)
    attention.attend = old_attend
    try:
        with stubbed_launches(), no_host_reads():
            paths["attention decode"]()
    except HostRead:
        caught.append("kvcache sized from int(seqlens.max())")
    finally:
        attention.attend = real_attend
    return caught


def main() -> int:
    from hal.kernels.triton.launch import interpreter_problem
    problem = interpreter_problem()  # checked once per process (it reads its probe back): before the guard
    assert problem is None, problem
    paths = launch_paths()
    missing = sorted(backend_ops() - {op for path in paths.values() for op in path.ops})
    reads, launches = {}, {}
    for layout in ("interpreter", "gpu"):
        replay(paths, layout, reads, launches)
    report = dict(calls=len(paths), missing=missing, replayed=launches, reads=reads, workspace=check_workspaces(paths),
                  host_tensors=host_tensors_made(paths), caught=negative_controls(paths))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
