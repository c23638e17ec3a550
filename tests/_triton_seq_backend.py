"""A test-only backend serving the Triton sequence kernels on CPU under TRITON_INTERPRET=1.

The ``triton`` backend (backends/triton.py) inherits the same methods (backends/triton_seq.py); this
stand-in lets the sequence ops be checked through hal's public ops and the conformance runner
independently of it.
"""
from __future__ import annotations

from hal.backend import LEVELS, Backend
from hal.backends.triton_seq import FAMILIES, SequenceOps
from hal.spec import STRICT


class InterpretedSequenceBackend(SequenceOps, Backend):
    name = "triton-seq-interpreter"
    device_types = ("cpu",)
    auto = False
    description = "Triton sequence kernels in the interpreter (tests only)"

    def claimed_levels(self, family, spec):
        return frozenset(LEVELS) if family in FAMILIES and spec.policy == STRICT else frozenset()
