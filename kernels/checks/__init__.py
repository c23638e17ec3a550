"""Verification tools for the kernels, run from a checkout (not shipped in the wheel: pyproject's package list
leaves this package out): the strict Triton lint (``python -m hal.kernels.checks.lint``) and its attention /
GDN cases, the fast-policy lint (``fast_lint``), the Ascend variant's API lint (``ascend_lint``) and the
machine-code memory profile (``sass_profile``). They import the kernels; no kernel imports them."""
