"""Which Triton is installed and whether its CPU interpreter is on: the one home of those checks.

The triton and ascend backends ask these on every dispatch (``unavailable_reason``) and launch.py before
its interpreter probe. Importing this module does not import triton (the backends must stay importable
without it), so the version is read from the installed distribution's metadata.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from importlib import metadata

MIN_TRITON = (3, 6)        # GPU: enable_fp_fusion launch option, tl.fma, div_rn, sqrt_rn
MIN_INTERPRETER = (3, 9)   # CPU interpreter: tl.fma rounds once only since 3.9


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string; the digits of each part ("3.9.0rc1" -> (3, 9), "3" -> (3, 0))."""
    parts = (text.split(".") + ["0"])[:2]
    return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET, read by Triton at decoration time)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def installed_triton() -> tuple[int, int] | None:
    """The installed triton's (major, minor), None when absent; (0, 0) without metadata. Asked once per process:
    dispatch asks ``unavailable_reason`` on every call, and the package lookup plus metadata read cost
    milliseconds (2.5 ms per call measured on a busy CPU, the bulk of the per-call host time)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return parse_version(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        return (0, 0)


def interpreter_too_old(version: tuple[int, int], what: str = "triton") -> str | None:
    """Why ``TRITON_INTERPRET=1`` cannot serve strict kernels with this Triton version, or None."""
    if version < MIN_INTERPRETER:
        return (f"TRITON_INTERPRET=1 needs {what} >= {version_text(MIN_INTERPRETER)} (older interpreters round "
                f"tl.fma twice); installed: {version_text(version)}")
    return None
