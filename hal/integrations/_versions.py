"""The one version check every integration makes: the installed release of the library it hooks into must
be one lockstep was tested with, because each integration mirrors or hooks that library's internals and
another release may compute other bits (transformers.py, torchtitan.py, trl.py each name their range)."""
from __future__ import annotations

from ..errors import UnsupportedError


def release(version: str) -> tuple[int, ...]:
    """``"5.24.0.dev0"`` -> ``(5, 24)``: the (major, minor) a ``SUPPORTED`` range is written in."""
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


def check_supported(library: str, version: str, supported, integration: str, risk: str,
                    allow_untested: bool = False) -> str:
    """``version`` when its release is in ``supported`` or the caller allows an untested one; else
    UnsupportedError naming the library, the version, the tested releases and ``risk`` (what may differ and
    what to do; it follows the releases, with its own leading punctuation). ``supported``: a range
    ``(low, high)`` ([low, high) of (major, minor)), or a frozenset of the exact (major, minor) releases tested
    (when the ones between them were not: each listed, none claimed)."""
    if isinstance(supported, frozenset):
        if release(version) in supported or allow_untested:
            return version
        tested = ", ".join(f"{a}.{b}" for a, b in sorted(supported))
        raise UnsupportedError(f"{library} {version} is not supported by {integration} (tested: {tested}){risk}")
    lo, hi = supported
    if lo <= release(version) < hi or allow_untested:
        return version
    raise UnsupportedError(f"{library} {version} is not supported by {integration} (tested: >={lo[0]}.{lo[1]},"
                           f"<{hi[0]}.{hi[1]}){risk}")
