"""Deprecated: the conformance suite protocol is :mod:`hal.conformance.suite` (``Family`` is now ``Suite``).

Kept one release for out-of-tree code: the names here are the very objects of ``hal.conformance.suite``;
importing this module warns once.
"""
from __future__ import annotations

import warnings

from .suite import (DTYPE_NAMES, DTYPES, Case, Check, Pair, Suite, autograd_check,  # noqa: F401
                    extreme_rows, half_ulp, rowwise_checks)

Family = Suite

warnings.warn("hal.conformance.family is deprecated: import from hal.conformance.suite (Family is now Suite)",
              DeprecationWarning, stacklevel=2)
