"""Runs conformance suites on backends and reports, per backend x op x dtype x spec, which levels hold.

Per case the runner makes the inputs, runs the base call once (inference, no autograd) and then:
  L0  the same call again, and with 1 and with 2 threads: same bits;
  L1, L2, L3  the suite's own checks (batch / split / training-path transforms): same bits;
  L4  the golden bits written from the reference backend: same bits;
  A   the float64 oracle: error within the suite's stated budget.
A level passes for a (backend, op, dtype, spec) when it holds for every case. A level the backend
claims holds only when it compared at least one case: a claimed level that compared nothing (the
backend refused every case, e.g. the wrong device) fails the run, and so does a run with no case.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from hal import dispatch
from hal.backend import Backend
from hal.errors import GoldenError, InputError

from . import suites as suite_registry
from . import golden
from .bits import Divergence, first_divergence
from .suite import DTYPE_NAMES, Case, Suite

LEVEL_ORDER = ("L0", "L1", "L2", "L3", "L4", "A")


@dataclass
class Record:
    backend: str
    op: str
    dtype: str
    spec_id: str
    level: str
    status: str  # pass | fail | unsupported
    detail: str
    first_divergence: dict | None
    claimed: bool
    cases: int = 0
    failed_cases: list[str] = field(default_factory=list)
    comparisons: int = 0
    elements: int = 0  # tensor elements compared (bits, or against the oracle for A)

    def to_dict(self):
        return asdict(self)


class _Outcome:
    """Accumulates one level's results over the cases of a group."""

    def __init__(self):
        self.cases = 0
        self.checks = 0
        self.elements = 0
        self.failures: list[tuple[str, Divergence]] = []
        self.unsupported: list[str] = []
        self.worst_budget_use: float | None = None  # A only: max error / budget over passing cases

    def fail(self, case_id: str, div: Divergence):
        self.failures.append((case_id, div))


def _to_device(inputs: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


def _compare_all(out: _Outcome, case: Case, pairs):
    for label, expected, got in pairs:
        out.checks += 1
        out.elements += expected.numel()
        div = first_divergence(label, expected, got)
        if div is not None:
            out.fail(case.id, div)
            return  # the first divergence of a check is what a reader needs


def _error(label: str, e: BaseException) -> Divergence:
    tb = traceback.format_exception_only(type(e), e)[-1].strip()
    return Divergence(label, None, None, None, None, None, None, 0, 0, note=f"raised {tb}")


def _with_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def _accuracy(suite: Suite, case: Case, inputs: dict, base: dict, out: _Outcome):
    inputs = _to_device(inputs, torch.device("cpu"))  # the oracle and the budget are float64 CPU math
    exact = suite.oracle(case, inputs)
    for name, ex in exact.items():
        got = base[name].detach().cpu().double()
        ex = ex.detach().cpu().double()
        out.checks += 1
        out.elements += ex.numel()
        fin = torch.isfinite(ex)
        nonfinite_ok = torch.where(torch.isnan(ex), torch.isnan(got), got == ex)
        bad = ~torch.where(fin, torch.isfinite(got), nonfinite_ok)
        allowed = suite.budget(case, name, inputs, torch.where(fin, ex, torch.zeros_like(ex))).expand_as(ex)
        err = (got - ex).abs()
        bad = bad | (fin & ~(err <= allowed))
        if bool(bad.any()):
            flat = int(bad.reshape(-1).nonzero()[0, 0])
            idx = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(ex.shape))] if ex.dim() else []
            note = (f"error {err.reshape(-1)[flat].item():.3e} > budget {allowed.reshape(-1)[flat].item():.3e} at "
                    f"{tuple(idx)}: exact {ex.reshape(-1)[flat].item()!r}, got {got.reshape(-1)[flat].item()!r}; "
                    f"{int(bad.sum())}/{bad.numel()} elements outside the budget")
            out.fail(case.id, Divergence(f"oracle:{name}", idx, None, None, None, None, None, int(bad.sum()),
                                         bad.numel(), note=note))
        else:
            ratio = (err / allowed.clamp_min(1e-300))[fin]
            worst = float(ratio.max()) if ratio.numel() else 0.0
            out.worst_budget_use = max(out.worst_budget_use or 0.0, worst)


def run_case(suite: Suite, backend: Backend, case: Case, device: torch.device, levels, outcomes: dict, golden_root=None):
    reasons = []
    for op in suite.ops:
        reasons += backend.supports(op, case.spec, case.dtype, device)
    if reasons:
        for lvl in levels:
            outcomes[lvl].unsupported = sorted(set(reasons))
        return
    inputs = _to_device(suite.make_inputs(case), device)

    def base_call():
        with torch.no_grad():
            return suite.run(backend, case, inputs)

    try:
        base = base_call()
    except Exception as e:
        for lvl in levels:
            outcomes[lvl].cases += 1
            outcomes[lvl].fail(case.id, _error("base call", e))
        return
    for lvl in levels:
        o = outcomes[lvl]
        o.cases += 1
        try:
            if lvl == "L0":
                for label, fn in (("repeat", base_call), ("1-thread", lambda: _with_threads(1, base_call)),
                                  ("2-threads", lambda: _with_threads(2, base_call))):
                    got = fn()
                    _compare_all(o, case, ((f"{label}:{k}", base[k], got[k]) for k in base))
            elif lvl == "L4":
                # The suite's outputs (not the manifest) say what must be compared.
                gold = golden.load(suite.name, case, suite.make_inputs(case), golden_root, outputs=list(base))
                _compare_all(o, case, ((f"golden:{k}", gold[k], base[k].detach().cpu()) for k in base))
            elif lvl == "A":
                _accuracy(suite, case, inputs, base, o)
            else:
                for name, check in suite.checks.get(lvl, []):
                    _compare_all(o, case, ((f"{name}/{lab}", e, g) for lab, e, g in check(backend, case, inputs, base)))
        except GoldenError as e:
            o.fail(case.id, Divergence("golden", None, None, None, None, None, None, 0, 0, note=str(e)))
        except Exception as e:
            o.fail(case.id, _error(lvl, e))


def run(backend_names: list[str], suite_names: list[str], device: str = "cpu", dtypes: list[str] | None = None,
        progress=None, golden_root=None, quick: bool = False) -> list[Record]:
    """``quick``: each suite's quick case set (Suite.quick_cases) instead of every case.

    ``progress(done, total, label, seconds)``, if given, is called before each case (``seconds`` None,
    ``done`` the cases finished so far) and after it (``seconds`` the case's wall time, ``done`` counting it),
    ``label`` naming backend, suite, spec and case: the CLI draws its progress bar from it."""
    dev = torch.device(device)
    if dtypes is not None:
        unknown = sorted(set(dtypes) - set(DTYPE_NAMES.values()))
        if unknown or not dtypes:
            raise InputError(f"dtypes must be a non-empty list of {', '.join(sorted(DTYPE_NAMES.values()))}, "
                             f"got {dtypes!r} (None: every dtype)")
    plan = []  # (backend name, backend, suite name, suite, {(dtype, spec id): cases}): the total comes first
    for bname in backend_names:
        backend = dispatch.get_backend(bname)
        for sname in suite_names:
            suite = suite_registry.get(sname)
            groups: dict[tuple, list[Case]] = {}
            for case in (suite.quick_cases() if quick else suite.cases()):
                if dtypes is not None and DTYPE_NAMES[case.dtype] not in dtypes:
                    continue
                groups.setdefault((DTYPE_NAMES[case.dtype], case.spec.id), []).append(case)
            plan.append((bname, backend, sname, suite, groups))
    total = sum(len(cases) for *_, groups in plan for cases in groups.values())
    done = 0
    records: list[Record] = []
    for bname, backend, sname, suite, groups in plan:
        for (dname, spec_id), cases in groups.items():
            outcomes = {lvl: _Outcome() for lvl in suite.levels}
            for i, case in enumerate(cases):
                label = f"{bname} {sname} {spec_id} {case.id} ({i + 1}/{len(cases)})"
                if progress:
                    progress(done, total, label, None)
                t0 = time.perf_counter()
                run_case(suite, backend, case, dev, suite.levels, outcomes, golden_root)
                done += 1
                if progress:
                    progress(done, total, label, time.perf_counter() - t0)
            claimed = _claimed_levels(backend, sname, cases[0].spec)
            for lvl in suite.levels:
                records.append(_record(bname, sname, dname, spec_id, lvl, outcomes[lvl], lvl in claimed))
    return records


def _claimed_levels(backend: Backend, suite: str, spec) -> frozenset[str]:
    """The levels the backend claims for ``suite`` under ``spec``. A backend implements only its
    policies (``supports`` refuses the others on every device), so it claims nothing for a spec that
    uses another policy (e.g. the reference backend and the fast specs); every other refusal (device,
    dtype, availability, a missing op) leaves the claim standing, and a claim that compared nothing fails."""
    if spec.policies_used() - set(backend.policies):
        return frozenset()
    return backend.claimed_levels(suite, spec)


def claims(backend: Backend, suite_name: str) -> frozenset[str]:
    """Every level a run of the suite holds ``backend`` to, over the specs its cases use (``hal info``)."""
    specs = {case.spec.id: case.spec for case in suite_registry.get(suite_name).cases()}
    return frozenset().union(*(_claimed_levels(backend, suite_name, spec) for spec in specs.values()))


def _record(bname, sname, dname, spec_id, lvl, o: _Outcome, claimed: bool) -> Record:
    if o.unsupported:
        return Record(bname, sname, dname, spec_id, lvl, "unsupported", "; ".join(o.unsupported), None, claimed)
    if not o.failures and o.cases and not o.checks:  # a level that compared nothing proves nothing
        o.fail("(all)", Divergence(lvl, None, None, None, None, None, None, 0, 0,
                                   note=f"{o.cases} cases ran but nothing was compared"))
    counts = dict(comparisons=o.checks, elements=o.elements)
    if o.failures:
        case_id, div = o.failures[0]
        fd = div.to_dict()
        fd["case"] = case_id
        failed = sorted({c for c, _ in o.failures})
        detail = f"{len(failed)}/{o.cases} cases fail; first: case {case_id}: {div}"
        return Record(bname, sname, dname, spec_id, lvl, "fail", detail, fd, claimed, o.cases, failed, **counts)
    detail = f"{o.cases} cases, {o.checks} comparisons, {_count(o.elements)} elements"
    if lvl == "A" and o.worst_budget_use is not None:
        detail += f"; worst error {o.worst_budget_use:.2f} of budget"
    return Record(bname, sname, dname, spec_id, lvl, "pass", detail, None, claimed, o.cases, **counts)


def _count(n: int) -> str:
    """1234 -> '1234', 1_234_567 -> '1.2M' (a reader wants the order of magnitude)."""
    for at, div, unit in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if n >= at:
            return f"{n / div:.1f}{unit}"
    return str(n)


def compared_nothing(records: list[Record]) -> list[str]:
    """Why the run proves less than it claims: one line per (backend, op, dtype, spec) whose claimed
    levels compared no case, naming the levels and every reason the backend gave; or one line when the
    run has no record at all."""
    if not records:
        return ["the run compared nothing: no case matched the backends, conformance suites and dtypes asked for"]
    empty: dict[tuple, list[Record]] = {}
    for r in records:
        if r.claimed and r.status == "unsupported":
            empty.setdefault((r.backend, r.op, r.dtype, r.spec_id, r.detail), []).append(r)
    return [f"{b} {op} {dt} {spec} {' '.join(r.level for r in rs)}: claimed, but compared nothing: {detail}"
            for (b, op, dt, spec, detail), rs in empty.items()]


def exit_status(records: list[Record]) -> int:
    """Non-zero when a level a backend claims fails or compared nothing, or the run compared nothing."""
    return 1 if compared_nothing(records) or any(r.status == "fail" and r.claimed for r in records) else 0
