"""The one place deprecated names are announced: every alias lockstep keeps after a rename warns through here, so
each warning (and the docs that list the aliases) states the same release that removes it.

The aliases are kept for one release: those deprecated during 0.2.x go in ``REMOVED_IN``.
tests/test_deprecated_aliases.py checks that this release is still ahead of the package's version (pyproject.toml), so the release that reaches it
fails until the aliases are gone.
"""
from __future__ import annotations

import warnings

__all__ = ["REMOVED_IN", "warn_moved"]

#: the release that removes every alias deprecated so far
REMOVED_IN = "0.3.0"


def warn_moved(old: str, new: str, *, stacklevel: int = 3) -> None:
    """DeprecationWarning ``"<old> is deprecated: use <new> (<old> is removed in lockstep REMOVED_IN)"``; the default
    ``stacklevel`` points at the caller of the function (or module ``__getattr__``) that calls this."""
    warnings.warn(f"{old} is deprecated: use {new} ({old} is removed in lockstep {REMOVED_IN})", DeprecationWarning,
                  stacklevel=stacklevel)
