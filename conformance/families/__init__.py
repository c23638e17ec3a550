"""Deprecated: the conformance suites moved to :mod:`hal.conformance.suites` (issue 22).

This alias package stays one release (removed in hal.deprecation.REMOVED_IN) for out-of-tree code.
``hal.conformance.families.<name>`` is the very module object ``hal.conformance.suites.<name>`` (registered in ``sys.modules`` here, never a second
copy that would hold its own suite objects), and each such module's ``FAMILY`` is its ``SUITE`` (the
name old code reads); importing this package warns once.
"""
from __future__ import annotations

import importlib
import sys

from hal.deprecation import warn_moved

from .. import suites as _suites
from ..suites import MODULES, get, names  # noqa: F401 -- the old package's public names

warn_moved("hal.conformance.families", "hal.conformance.suites (the same modules; read a module's SUITE, not FAMILY)")

for _name, _module_name in _suites.MODULES.items():
    _module = importlib.import_module(_module_name)
    _module.FAMILY = _module.SUITE
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
del _name, _module_name, _module
