"""The ascend backend: the strict Triton kernels (kernels/triton) on Ascend NPUs through triton-ascend.

One kernel source: the Triton backend's kernels, launched as the Ascend variant
(kernels/triton/ascend_launch.py: grid capped at the vector-core count with persistent loops over
work items, GPU-layout tiles that fit the unified buffer, fma/int64 substitutes for division and
square root, fp16 rounding without tensor shifts). docs/ascend.md lists what triton-ascend
documents and what is verified where.

Serves ``npu`` tensors (chosen automatically for them). Under ``TRITON_INTERPRET=1`` (community
Triton >= 3.9) it also serves CPU tensors when named explicitly, so the Ascend variant of every
kernel runs through the conformance suite on a machine without an NPU; it is never chosen
automatically for CPU tensors.

Importing this module imports neither torch_npu nor triton. ``unavailable_reason`` inspects
packages, environment and device files first and imports torch_npu only when everything else is in
place (an NPU device file exists), because importing torch_npu without CANN fails.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
from importlib import metadata

import torch

from hal import fp_env
from hal.backend import Backend

from hal.kernels.triton.versions import installed_triton, interpreter_too_old, interpreting

from .triton import ElementwiseOps, FoundationOps
from .triton_seq import SequenceOps

DEVICE_GLOB = "/dev/davinci[0-9]*"  # one device file per NPU, created by the Ascend driver
CANN_ENV = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")  # exported by CANN's set_env.sh


@functools.lru_cache(maxsize=None)
def triton_owners() -> list[str]:
    """Installed distributions that provide the top-level ``triton`` package (``triton`` is community
    Triton, ``triton-ascend`` Huawei's; both install into the same ``triton`` directory)."""
    owners = metadata.packages_distributions().get("triton", [])
    return sorted({o.lower().replace("_", "-") for o in owners})


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def cann_home() -> str | None:
    """The CANN toolkit directory named by set_env.sh's variables, if it exists."""
    for var in CANN_ENV:
        path = os.environ.get(var)
        if path and os.path.isdir(path):
            return path
    return None


def npu_device_files() -> list[str]:
    return sorted(glob.glob(DEVICE_GLOB))


def _interpreter_reason() -> str | None:
    version = installed_triton()  # asked once per process (dispatch asks on every call)
    if version is None:
        return "TRITON_INTERPRET=1 needs community triton >= 3.9 (pip install 'lockstep[triton]')"
    from hal.kernels.triton.launch import interpreter_problem
    # the interpreter computes with numpy on the calling thread, under its FP control bits
    return interpreter_too_old(version, "community triton") or interpreter_problem() or fp_env.flush_reason("ascend", ())


def _npu_reason() -> str | None:
    """Why the NPU path cannot run, checked without importing torch_npu until a device is present."""
    if importlib.util.find_spec("torch_npu") is None:
        return ("torch_npu is not installed (it needs the CANN toolkit; see docs/ascend.md). To verify the "
                "Ascend kernel variants without an NPU: TRITON_INTERPRET=1 with backend='ascend' on CPU tensors")
    if cann_home() is None:
        return ("CANN toolkit not found: neither ASCEND_TOOLKIT_HOME nor ASCEND_HOME_PATH names a directory "
                "(source /usr/local/Ascend/ascend-toolkit/set_env.sh; without CANN, `import torch` itself fails "
                "once torch_npu is installed unless TORCH_DEVICE_BACKEND_AUTOLOAD=0)")
    owners = triton_owners()
    if "triton-ascend" not in owners:
        if "triton" in owners:
            return (f"community triton {_dist_version('triton')} owns the `triton` package; the NPU needs "
                    "triton-ascend (pip uninstall -y triton && pip install triton-ascend)")
        return "triton-ascend is not installed (pip install triton-ascend)"
    if "triton" in owners:
        return ("both community triton and triton-ascend are installed and share the `triton` directory, so "
                "either may be the one imported: pip uninstall -y triton triton-ascend && pip install triton-ascend")
    if not npu_device_files():
        return f"no Ascend NPU device ({DEVICE_GLOB} absent)"
    try:
        import torch_npu  # noqa: F401  (registers the npu device type and torch.npu)
    except Exception as exc:  # a broken CANN / driver install surfaces here
        return f"import torch_npu failed: {type(exc).__name__}: {exc}"
    if not torch.npu.is_available() or torch.npu.device_count() == 0:
        return "torch_npu sees no NPU (torch.npu.is_available() is False)"
    return None


def enable_npu() -> None:
    """Import torch_npu so that torch.device('npu') exists; raises with the precise reason if it cannot.
    Called by `hal conformance run --device npu` and by benchmarks (never by ``import hal``)."""
    why = _npu_reason()
    if why:
        from hal.errors import BackendUnavailable
        raise BackendUnavailable(f"ascend: {why}")


@contextlib.contextmanager
def _on(t: torch.Tensor):
    """Launch on the tensor's NPU as the Ascend variant of the kernels."""
    from hal.kernels.triton import ascend_launch
    with ascend_launch.variant(t.device.type):
        if t.device.type == "npu":
            with torch.npu.device(t.device):
                yield
        else:
            yield


class AscendBackend(ElementwiseOps, SequenceOps, FoundationOps, Backend):
    name = "ascend"
    device_types = ("npu",)
    priority = 10
    description = ("strict specs as the Triton kernels' Ascend variant through triton-ascend (persistent grid "
                   "<= vector cores, fma/int64 division and sqrt); NPU, or CPU through TRITON_INTERPRET=1")
    launch_on = staticmethod(_on)

    def unavailable_reason(self) -> str | None:
        return _interpreter_reason() if interpreting() else _npu_reason()
