"""Deprecated: the conformance suite protocol is :mod:`hal.conformance.suite` (``Family`` is now ``Suite``).

Kept one release (removed in hal.deprecation.REMOVED_IN) for out-of-tree code: the names here are the very
objects of ``hal.conformance.suite``; importing this module warns once.
"""
from __future__ import annotations

from hal.deprecation import warn_moved

from .suite import (DTYPE_NAMES, DTYPES, Case, Check, Pair, Suite, autograd_check,  # noqa: F401
                    extreme_rows, half_ulp, rowwise_checks)

Family = Suite

warn_moved("hal.conformance.family", "hal.conformance.suite (Family is now Suite)")
