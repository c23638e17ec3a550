"""Report formats: a terminal table, JSON records, JUnit XML."""
from __future__ import annotations

import json
from xml.sax.saxutils import escape, quoteattr

from .runner import LEVEL_ORDER, Record

_MARK = {"pass": "pass", "fail": "FAIL", "unsupported": "unsup"}


def table(records: list[Record]) -> str:
    rows: dict[tuple, dict[str, Record]] = {}
    for r in records:
        rows.setdefault((r.backend, r.op, r.dtype, r.spec_id), {})[r.level] = r
    head = ["backend", "op", "dtype", "spec", *LEVEL_ORDER]
    body = []
    for (b, op, dt, spec), levels in rows.items():
        cells = []
        for lvl in LEVEL_ORDER:
            r = levels.get(lvl)
            if r is None:
                cells.append("-")
            else:
                mark = _MARK[r.status]
                if r.status == "fail" and not r.claimed:
                    mark += "*"
                elif r.status == "unsupported" and r.claimed:
                    mark = "UNSUP!"
                cells.append(mark)
        body.append([b, op, dt, spec, *cells])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in body]
    out.append("")
    out.append("pass = bits identical in every case (A: within the error budget); FAIL* = fails a level the "
               "backend does not claim (expected of a negative control); unsup = backend cannot serve it; UNSUP! = the "
               "backend claims the level but served no case (fails the run); - = n/a")
    return "\n".join(out)


def cases_compared(records: list[Record]) -> dict[tuple[str, str, str], int]:
    """{(backend, suite, level): cases compared at that level under a spec the backend claims it for}, over
    dtypes and specs, for every level the backend claims somewhere in the suite (a refused case compares nothing)."""
    out: dict[tuple[str, str, str], int] = {}
    for r in records:
        if r.claimed:
            key = (r.backend, r.op, r.level)
            out[key] = out.get(key, 0) + (r.cases if r.status != "unsupported" else 0)
    return out


def cases_table(records: list[Record]) -> str:
    """One line per (backend, suite): the cases compared at each claimed level ("-": not claimed)."""
    counts = cases_compared(records)
    suites = dict.fromkeys((r.backend, r.op) for r in records)
    lines = ["cases compared per suite and claimed level (- = not claimed):"]
    for b, op in suites:
        cells = [f"{lvl} {counts[(b, op, lvl)]}" if (b, op, lvl) in counts else f"{lvl} -" for lvl in LEVEL_ORDER]
        lines.append(f"  {b:<10} {op:<22} " + "  ".join(cells))
    return "\n".join(lines)


def unproven_suites(records: list[Record], backends: list[str], suites: list[str]) -> list[str]:
    """``--require-claims``: one line per named (backend, suite) that claims no level here (the backend does not
    serve the suite on this device: nothing it promises was checked) or claims a level that compared no case."""
    counts = cases_compared(records)
    out = []
    for b in backends:
        for s in suites:
            levels = [lvl for lvl in LEVEL_ORDER if (b, s, lvl) in counts]
            if not levels:
                out.append(f"{b} {s}: the backend claims no level of this suite here (wrong backend or device?)")
            out += [f"{b} {s} {lvl}: claimed, 0 cases compared" for lvl in levels if counts[(b, s, lvl)] == 0]
    return out


def failures(records: list[Record]) -> str:
    """One line per failing level (a divergence or an error, claimed or not), with its first divergence."""
    return "\n".join(f"[{r.backend} {r.op} {r.dtype} {r.spec_id} {r.level}{'' if r.claimed else ' (not claimed)'}] "
                     f"{r.detail}" for r in records if r.status == "fail")


def not_implemented(records: list[Record]) -> str:
    """One line per (backend, op, dtype, spec) the backend refused without claiming it (e.g. the ``fast``
    policy on a backend that implements only strict), with the backend's reasons: no divergence, nothing
    compared. A claimed level that was refused is not listed here: it fails the run (runner.compared_nothing)."""
    return "\n".join(f"[{r.backend} {r.op} {r.dtype} {r.spec_id}] {r.detail}" for r in records
                     if r.status == "unsupported" and not r.claimed and r.level == "L0")


def to_json(records: list[Record], meta: dict) -> str:
    return json.dumps({"meta": meta, "records": [r.to_dict() for r in records]}, indent=1)


def to_junit(records: list[Record]) -> str:
    n_fail = sum(r.claimed and r.status != "pass" for r in records)
    n_skip = sum(not r.claimed and r.status != "pass" for r in records)
    out = ['<?xml version="1.0" encoding="utf-8"?>',
           f'<testsuite name="lockstep-conformance" tests="{len(records)}" failures="{n_fail}" skipped="{n_skip}">']
    for r in records:
        name = quoteattr(f"{r.op}.{r.dtype}.{r.level}")
        cls = quoteattr(f"{r.backend}.{r.spec_id}")
        out.append(f"  <testcase classname={cls} name={name}>")
        if r.status == "fail" and r.claimed:
            out.append(f"    <failure message={quoteattr(r.detail[:200])}>{escape(r.detail)}</failure>")
        elif r.status == "fail":
            out.append(f"    <skipped message={quoteattr('fails a level the backend does not claim: ' + r.detail[:150])}/>")
        elif r.status == "unsupported" and r.claimed:
            msg = "claimed, but compared nothing: " + r.detail
            out.append(f"    <failure message={quoteattr(msg[:200])}>{escape(msg)}</failure>")
        elif r.status == "unsupported":
            out.append(f"    <skipped message={quoteattr('unsupported: ' + r.detail[:200])}/>")
        out.append("  </testcase>")
    out.append("</testsuite>")
    return "\n".join(out) + "\n"
