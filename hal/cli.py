"""The ``hal`` command: backends, specs, and the conformance suite.

    hal info                                   backends here, and why the others are not
    hal spec list | hal spec show ID           specs, in words
    hal conformance run [--backend NAME|auto|all] [--device DEV] [--ops ...] [--quick] [--json F] [--junit F]
    hal conformance generate [--ops ...]       write golden files from the reference backend
    hal rl report LOGPROBS.npz [--json F]      sampler/trainer mismatch metrics of saved log-probs
    hal warmup [--ops ...] [--dtypes ...]      compile the cpu backend's kernels ahead of time
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch


def _info(args) -> int:
    from . import dispatch, spec as specs
    from .backend import LEVELS
    from .ops_registry import OPS
    print(f"lockstep {__import__('hal').__version__}  torch {torch.__version__}  python {platform.python_version()}  "
          f"{platform.machine()}")
    for name, b in dispatch.backends().items():
        why = b.unavailable_reason()
        state = "available" if not why else f"not available: {why}"
        claimed = set()
        for op in b.ops():
            family = OPS[op]
            if family in specs.DEFAULTS:
                claimed |= set(b.claimed_levels(family, specs.DEFAULTS[family]))
        claims = f"claims {' '.join(l for l in LEVELS if l in claimed)}" if claimed else "claims no level"
        print(f"  {name:<10} devices {','.join(b.device_types):<22} {state}; {claims}")
        print(f"  {'':<10} {b.description}")
        print(f"  {'':<10} ops: {', '.join(b.ops())}")
    for name, err in dispatch.load_errors().items():
        print(f"  {name:<10} not available: {err}")
    return 0


def _spec(args) -> int:
    from . import spec as specs
    if args.spec_cmd == "list":
        for s in specs.all_specs():
            default = " (default)" if specs.DEFAULTS.get(s.family) == s else ""
            print(f"{s.id}{default}")
        return 0
    s = specs.get(args.id)
    print(s.id)
    print(f"  family: {s.family}")
    for line in s.describe():
        print(f"  - {line}")
    return 0


def _families(ops):
    from hal.conformance import families
    names = families.names()
    if not ops:
        return names
    unknown = [o for o in ops if o not in names]
    if unknown:
        raise SystemExit(f"hal: unknown op family {', '.join(unknown)}; known: {', '.join(names)}")
    return ops


def _conformance_run(args) -> int:
    from hal.conformance import report, runner
    from . import dispatch
    from .errors import BackendUnavailable
    if args.device.split(":")[0] == "npu":  # torch knows the npu device type only once torch_npu is imported
        from hal.backends.ascend import enable_npu
        try:
            enable_npu()
        except BackendUnavailable as exc:
            print(f"hal: --device npu: {exc}", file=sys.stderr)
            return 2
    device = torch.device(args.device)
    if args.backend == "all":
        names = [n for n, b in dispatch.backends().items() if not b.unavailable_reason()]
    elif args.backend == "auto":
        cands = sorted((b for b in dispatch.backends().values()
                        if b.auto and device.type in b.device_types and not b.unavailable_reason()),
                       key=lambda b: -b.priority)
        if not cands:
            print(f"hal: no available backend serves device {device.type!r}; `hal info` says why", file=sys.stderr)
            return 2
        names = [cands[0].name]
    else:
        names = [n.strip() for n in args.backend.split(",")]
        for n in names:
            try:
                b = dispatch.get_backend(n)
            except BackendUnavailable as e:
                print(f"hal: {e}", file=sys.stderr)
                return 2
            why = b.unavailable_reason()
            if why:
                print(f"hal: backend {n!r} is not available here: {why}", file=sys.stderr)
                return 2
    fams = _families(args.ops)
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    t0 = time.time()
    quick = args.quick or os.environ.get("LOCKSTEP_QUICK", "") not in ("", "0")
    records = runner.run(names, fams, device=args.device, dtypes=args.dtypes, progress=progress, quick=quick)
    print(report.table(records))
    fails = report.failures(records)
    if fails:
        print("\nFirst divergences:")
        print(fails)
    meta = {"backends": names, "ops": fams, "device": args.device, "quick": quick, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "seconds": round(time.time() - t0, 1)}
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json(records, meta))
    if args.junit:
        with open(args.junit, "w") as f:
            f.write(report.to_junit(records))
    status = runner.exit_status(records)
    print(f"\n{'FAILED: a level a backend claims does not hold' if status else 'OK: every claimed level holds'} "
          f"({meta['seconds']} s)")
    return status


def _conformance_generate(args) -> int:
    from hal.conformance import families, golden
    from . import dispatch
    ref = dispatch.get_backend("reference")
    for name in _families(args.ops):
        fam = families.get(name)
        if "L4" not in fam.levels:  # e.g. the fast-policy families: bits of one GPU model, no goldens
            print(f"{name}: no golden bits (the family has no L4)", file=sys.stderr)
            continue
        results = []
        for case in fam.cases():
            inputs = fam.make_inputs(case)
            with torch.no_grad():
                results.append((case, inputs, fam.run(ref, case, inputs)))
            print(f"{name} {case.spec.id} {case.id}", file=sys.stderr, flush=True)
        print(f"wrote {golden.write(fam, results)} ({len(results)} cases)")
    return 0


def _warmup(args) -> int:
    """Compile (or load) the cpu backend's numba kernels ahead of time, e.g. while building an image or in
    CI: each family's quick conformance cases on the cpu backend, which call every kernel the way real
    calls do (both drivers, every dtype). A progress bar per (family, dtype) on stderr."""
    from hal.conformance import families, runner
    from hal.conformance.family import DTYPE_NAMES
    from . import dispatch
    cpu = dispatch.get_backend("cpu")
    why = cpu.unavailable_reason()
    if why:
        print(f"hal warmup: backend 'cpu' is not available here: {why}", file=sys.stderr)
        return 2
    fams = _families(args.ops)
    units = [(f, d) for f in fams for d in (args.dtypes or ["fp32", "bf16", "fp16"])
             if any(DTYPE_NAMES[c.dtype] == d for c in families.get(f).quick_cases())]
    t0, failed, width = time.time(), [], 30
    for i, (fam, dt) in enumerate(units):
        done = width * i // len(units)
        print(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{len(units)} {fam} {dt} ({time.time() - t0:.0f} s)\x1b[K",
              end="", file=sys.stderr, flush=True)
        if runner.exit_status(runner.run(["cpu"], [fam], dtypes=[dt], quick=True)):
            failed.append(f"{fam} {dt}")
    print(f"\r[{'#' * width}] {len(units)}/{len(units)} ({time.time() - t0:.0f} s)\x1b[K", file=sys.stderr)
    from hal.kernels import cpu as kernels
    print(f"warm: the cpu backend's kernels for {', '.join(fams)} are in {kernels.cache_location()}")
    if failed:
        print(f"hal warmup: conformance failures in {', '.join(failed)}: run `hal conformance run --backend cpu`",
              file=sys.stderr)
        return 1
    return 0


def _rl_report(args) -> int:
    """Metrics for arrays saved from any engine: npz with ``trainer`` and ``sampler`` log-probs ([B, T] or
    packed [N]) and optionally ``mask`` and ``cu_seqlens``."""
    import json

    import numpy as np

    from . import rl
    from .errors import InputError
    try:
        data = np.load(args.file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {args.file} as an .npz of arrays ({e})") from None
    if not hasattr(data, "files"):  # a bare .npy array loads as an ndarray, not an archive of named arrays
        raise InputError(f"{args.file} is a single array, not an .npz archive; save it with "
                         "numpy.savez(path, trainer=..., sampler=...)")
    missing = [k for k in ("trainer", "sampler") if k not in data.files]
    if missing:
        raise InputError(f"{args.file} has no array named {', '.join(missing)} (found: {', '.join(data.files)}); "
                         "save trainer= and sampler= log-probs, optionally mask= and cu_seqlens=")
    get = lambda k: torch.from_numpy(data[k]) if k in data.files else None  # noqa: E731
    m = rl.mismatch_metrics(get("trainer"), get("sampler"), mask=get("mask"), cu_seqlens=get("cu_seqlens"))
    print(m.table())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(m.to_dict(), f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hal", description="lockstep: bitwise-identical ops; backends, specs, conformance")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="list backends, which are available here and why the others are not")
    sp = sub.add_parser("spec", help="list specs or show one in words")
    ssub = sp.add_subparsers(dest="spec_cmd", required=True)
    ssub.add_parser("list")
    show = ssub.add_parser("show")
    show.add_argument("id")
    cp = sub.add_parser("conformance", help="run the conformance suite or regenerate golden files")
    csub = cp.add_subparsers(dest="conf_cmd", required=True)
    run = csub.add_parser("run")
    run.add_argument("--backend", default="auto", help="backend name(s, comma separated), 'auto' (by device) or 'all'")
    run.add_argument("--device", default="cpu")
    run.add_argument("--ops", nargs="*", help="op families (default: all)")
    run.add_argument("--dtypes", nargs="*", choices=["fp32", "bf16", "fp16"])
    run.add_argument("--json", help="write the JSON report here")
    run.add_argument("--junit", help="write a JUnit XML report here")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--quick", action="store_true",
                     help="each family's quick case set (still crosses every tile/split boundary); also LOCKSTEP_QUICK=1")
    gen = csub.add_parser("generate")
    gen.add_argument("--ops", nargs="*")
    rp = sub.add_parser("rl", help="RL mismatch toolkit")
    rsub = rp.add_subparsers(dest="rl_cmd", required=True)
    rep = rsub.add_parser("report", help="mismatch metrics of sampler/trainer log-probs saved in an .npz")
    rep.add_argument("file")
    rep.add_argument("--json", help="also write the metrics as JSON here")
    wp = sub.add_parser("warmup", help="compile the cpu backend's kernels ahead of time (images, CI)")
    wp.add_argument("--ops", nargs="*", help="op families (default: all)")
    wp.add_argument("--dtypes", nargs="*", choices=["fp32", "bf16", "fp16"])
    args = p.parse_args(argv)
    try:
        if args.cmd == "info":
            return _info(args)
        if args.cmd == "spec":
            return _spec(args)
        if args.cmd == "rl":
            return _rl_report(args)
        if args.cmd == "warmup":
            return _warmup(args)
        if args.conf_cmd == "run":
            return _conformance_run(args)
        return _conformance_generate(args)
    except __import__("hal").HalError as e:
        print(f"hal: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
