"""The protocol a conformance suite implements (one module each in suites/: matmul, rms_norm, attention, ...).

A :class:`Suite` names its cases (shapes x dtypes x specs), builds each case's inputs from the
counter-based generator, runs the base call on a backend, gives a float64 oracle with an error
budget, and lists the *checks* of the levels that are specific to it (L1 batch transforms, L2
split transforms, L3 training path). The runner adds the generic ones: L0 (repeat, 1 vs 2
threads), L4 (golden bits) and A (oracle within budget).

A check is a function ``check(backend, case, inputs, base) -> iterable of (label, expected, got)``:
``base`` holds the outputs of the base call; each pair must have identical bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from hal.backend import Backend
from hal.spec import OpSpec

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Pair = tuple[str, torch.Tensor, torch.Tensor]
Check = Callable[[Backend, "Case", dict, dict], Iterable[Pair]]


@dataclass(frozen=True)
class Case:
    suite: str
    name: str  # shape and options, e.g. "m7_k129_n33"
    dtype: torch.dtype
    spec: OpSpec
    params: tuple = ()  # (key, value) pairs; dict(case.params) to read

    @property
    def family(self) -> str:
        """Deprecated (hal/deprecation.py): the suite's name is :attr:`suite` (a spec's ``family`` is another thing)."""
        from hal.deprecation import warn_moved
        warn_moved("Case.family", "Case.suite")
        return self.suite

    @property
    def id(self) -> str:
        return f"{self.name}.{DTYPE_NAMES[self.dtype]}"

    @property
    def p(self) -> dict:
        return dict(self.params)

    def key(self, *parts) -> str:
        """Stream name for the input generator: unique per case and input."""
        return "/".join([self.suite, self.name, DTYPE_NAMES[self.dtype], *map(str, parts)])


@dataclass
class Suite:
    name: str = ""
    #: Public ops the suite calls (each must be supported by a backend for the suite to run).
    ops: tuple[str, ...] = ()
    #: Levels that apply to this suite.
    levels: tuple[str, ...] = ("L0", "L1", "L3", "L4", "A")
    #: Level -> list of (check name, check). The runner adds L0, L4 and A.
    checks: dict[str, list[tuple[str, Check]]] = field(default_factory=dict)

    def cases(self) -> list[Case]:
        raise NotImplementedError

    #: Case ids (``Case.id``) of the quick set: a few cases that still cross every tile / split
    #: boundary and cover each dtype, for slow backends (the Triton interpreter) in CI. Empty: all cases.
    quick: tuple[str, ...] = ()

    def quick_cases(self) -> list[Case]:
        """The quick subset of :meth:`cases` (``hal conformance run --quick``)."""
        if not self.quick:
            return self.cases()
        chosen = [c for c in self.cases() if c.id in self.quick]
        missing = set(self.quick) - {c.id for c in chosen}
        if missing:
            raise KeyError(f"suite {self.name}: quick case ids not among its cases: {sorted(missing)}")
        return chosen

    def make_inputs(self, case: Case) -> dict:
        raise NotImplementedError

    def run(self, backend: Backend, case: Case, inputs: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def oracle(self, case: Case, inputs: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def budget(self, case: Case, output: str, inputs: dict, exact: torch.Tensor) -> torch.Tensor:
        """Allowed absolute error per element of ``output`` against the float64 ``exact`` value."""
        raise NotImplementedError


# ------------------------------------------------------------------ helpers shared by suites


def half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of ``dtype`` at |x| (float64): the error of rounding x once to dtype."""
    fi = torch.finfo(dtype)
    mag = x.abs().clamp_min(fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps / 2


def extreme_rows(n: int, width_shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """n rows of hostile values (max, -max, +inf, -inf, NaN, tiny) for neighbour/padding checks."""
    fi = torch.finfo(dtype)
    vals = [fi.max, -fi.max, float("inf"), float("-inf"), float("nan"), fi.tiny]
    rows = [torch.full(tuple(width_shape), vals[i % len(vals)], dtype=dtype, device=device) for i in range(n)]
    return torch.stack(rows) if rows else torch.empty((0, *width_shape), dtype=dtype, device=device)


def rowwise_checks(call: Callable[[Backend, Case, dict], dict], row_inputs: tuple[str, ...],
                   hostile: Callable[[str, int, torch.Tensor], torch.Tensor] | None = None) -> list[tuple[str, Check]]:
    """L1 checks for ops whose outputs' leading dim matches the leading dim of ``row_inputs``.

    A row's outputs must not depend on which other rows are in the call, on its position, on
    padding rows, or on neighbours holding extreme values or NaN/Inf. Names absent from a case's
    inputs are ignored (e.g. an optional residual). ``hostile(name, n, x)`` makes
    n hostile rows for input ``name`` (default: :func:`extreme_rows`).
    """
    def mk_hostile(name, n, x):
        if hostile is not None:
            return hostile(name, n, x)
        return extreme_rows(n, x.shape[1:], x.dtype, x.device)

    def present(inputs):
        return [n for n in row_inputs if inputs.get(n) is not None]

    def with_rows(inputs, index):
        out = dict(inputs)
        for name in present(inputs):
            out[name] = inputs[name][index]
        return out

    def sub(base, index):
        return {k: v[index] for k, v in base.items()}

    def pairs(label, expected: dict, got: dict):
        for k in expected:
            yield f"{label}:{k}", expected[k], got[k]

    def subsets(backend, case, inputs, base):
        n = inputs[row_inputs[0]].shape[0]
        picks = {"first-row-alone": [0], "last-row-alone": [n - 1], "odd-rows": list(range(1, n, 2)) or [0],
                 "reversed": list(range(n - 1, -1, -1))}
        for label, idx in picks.items():
            idx_t = torch.tensor(idx, dtype=torch.long)
            yield from pairs(label, sub(base, idx_t), call(backend, case, with_rows(inputs, idx_t)))

    def padding(backend, case, inputs, base):
        n = inputs[row_inputs[0]].shape[0]
        padded = dict(inputs)
        for name in present(inputs):
            x = inputs[name]
            padded[name] = torch.cat([x, mk_hostile(name, 5, x)])
        got = call(backend, case, padded)
        yield from pairs("padded-with-hostile-rows", base, {k: v[:n] for k, v in got.items()})

    def neighbours(backend, case, inputs, base):
        n = inputs[row_inputs[0]].shape[0]
        target = n // 2
        mixed = dict(inputs)
        for name in present(inputs):
            x = inputs[name]
            h = mk_hostile(name, 2 * n + 1, x)
            mixed[name] = torch.cat([h[:n], x[target:target + 1], h[n:]])
        got = call(backend, case, mixed)
        yield from pairs(f"row-{target}-among-hostile-neighbours", sub(base, slice(target, target + 1)),
                         {k: v[n:n + 1] for k, v in got.items()})

    return [("row-subsets", subsets), ("padding", padding), ("hostile-neighbours", neighbours)]


def autograd_check(call: Callable[[Backend, Case, dict], dict], grad_inputs: tuple[str, ...]) -> list[tuple[str, Check]]:
    """L3: the autograd (training) forward gives the bits of the inference forward (the base call)."""
    def check(backend, case, inputs, base):
        train = dict(inputs)
        for name in (n for n in grad_inputs if inputs.get(n) is not None):
            train[name] = inputs[name].detach().clone().requires_grad_(True)
        with torch.enable_grad():
            got = call(backend, case, train)
        for k in base:
            yield f"autograd-forward:{k}", base[k], got[k].detach()
    return [("autograd-forward", check)]
