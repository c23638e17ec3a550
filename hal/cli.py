"""The ``hal`` command: backends, specs, and the conformance suite.

    hal info                                   backends here, and why the others are not
    hal spec list | hal spec show ID           specs, in words
    hal conformance run [--backend NAME|auto|all] [--device DEV] [--ops ...] [--quick] [--json F] [--junit F]
    hal conformance generate [--ops ...]       write golden files from the reference backend
    hal rl report LOGPROBS.npz [--json F]      sampler/trainer mismatch metrics of saved log-probs
    hal warmup [--ops ...] [--dtypes ...]      compile the cpu backend's kernels ahead of time

Exit status: 0 done; 1 a conformance run whose claimed levels fail or compared nothing; 2 bad input
(`hal: <what and the fix>`, checked before any work: arguments, input files, output paths).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch


def _info(args) -> int:
    from hal.conformance import runner

    from . import dispatch
    from .backend import LEVELS
    print(f"lockstep {__import__('hal').__version__}  torch {torch.__version__}  python {platform.python_version()}  "
          f"{platform.machine()}")
    for name, b in dispatch.backends().items():
        why = b.unavailable_reason()
        state = "available" if not why else f"not available: {why}"
        # what a conformance run of the suites it serves holds it to (claimed_levels takes a suite, not an op)
        claimed = frozenset().union(*(runner.claims(b, suite) for suite in b.suites))
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


# ---------------------------------------------------------------- validate before work
# Every subcommand first checks its inputs, loads what it reads and opens what it writes (raising
# hal.InputError & co., which main() prints as `hal: ...` with exit status 2); only then does it work.
# A bad argument never costs a run, and a run's result is never lost to an output it cannot write.


class _Outputs:
    """The output files of one command, opened (created, not yet truncated) before the work starts.
    If the work raises, the files this created are removed again and existing ones keep their content."""

    def __init__(self, **paths):
        self._files = {}
        self._created = []
        try:
            for option, path in paths.items():
                if path is not None:
                    if not os.path.exists(path):
                        self._created.append(path)
                    self._files[option] = self._open(option, path)
        except BaseException:
            self.__exit__(True, None, None)
            raise

    @staticmethod
    def _open(option: str, path: str):
        from .errors import InputError
        flag = "--" + option
        if path == "":
            raise InputError(f"{flag} is empty; give a file path")
        if os.path.isdir(path):
            raise InputError(f"{flag} {path}: is a folder; give a file path")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise InputError(f"{flag} {path}: the folder {folder} does not exist; create it first")
        try:
            return open(path, "a", encoding="utf-8")  # append mode: an existing file is kept until the write
        except OSError as e:
            raise InputError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None

    def write(self, option: str, text: str) -> None:
        f = self._files.get(option)
        if f is not None:
            f.seek(0)
            f.truncate()
            f.write(text)
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.close()
        if exc_type is not None:
            for path in self._created:
                if os.path.exists(path):
                    os.remove(path)


def _device(text: str) -> torch.device:
    """``--device``: a device torch can name and make a tensor on here."""
    from .errors import InputError
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise InputError(f"--device {text!r} is not a device torch knows ({e}); e.g. cpu, cuda, cuda:1, npu") from None
    try:
        torch.empty(1, device=device)
    except Exception as e:  # noqa: BLE001 -- torch raises RuntimeError, AssertionError, ... per device type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"--device {text}: no such device here ({first}); `hal info` lists the backends and "
                         "their devices") from None
    return device


def _golden_root(must_exist: bool = True):
    """``LOCKSTEP_GOLDEN_DIR``, when set: a folder (an empty value would silently mean the current folder);
    ``must_exist=False`` for a folder that is about to be written."""
    from pathlib import Path

    from .errors import InputError
    value = os.environ.get("LOCKSTEP_GOLDEN_DIR")
    if value is None:
        return None
    if not value.strip():
        raise InputError("LOCKSTEP_GOLDEN_DIR is set but empty; unset it to use the packaged golden files, "
                         "or set it to the folder that holds them")
    if must_exist and not os.path.isdir(value):
        raise InputError(f"LOCKSTEP_GOLDEN_DIR={value}: no such folder")
    if os.path.exists(value) and not os.path.isdir(value):
        raise InputError(f"LOCKSTEP_GOLDEN_DIR={value}: not a folder")
    return Path(value)


def _suites(ops):
    from hal.conformance import suites

    from .errors import InputError
    names = suites.names()
    if ops is None:
        return names
    if not ops:
        raise InputError(f"--ops is given without a conformance suite; known: {', '.join(names)} (omit --ops for all)")
    unknown = [o for o in ops if o not in names]
    if unknown:
        raise InputError(f"unknown conformance suite {', '.join(unknown)}; known: {', '.join(names)}")
    return ops


def _dtypes(dtypes):
    from .errors import InputError
    if dtypes is not None and not dtypes:
        raise InputError("--dtypes is given without a dtype; name at least one of fp32, bf16, fp16 "
                         "(omit --dtypes for all)")
    return dtypes


def _backend_names(spec: str, device: torch.device) -> list[str]:
    from . import dispatch
    from .errors import InputError
    if spec == "all":
        return [n for n, b in dispatch.backends().items() if not b.unavailable_reason()]
    if spec == "auto":
        cands = sorted((b for b in dispatch.backends().values()
                        if b.auto and device.type in b.device_types and not b.unavailable_reason()),
                       key=lambda b: -b.priority)
        if not cands:
            raise InputError(f"no available backend serves device {device.type!r}; `hal info` says why")
        return [cands[0].name]
    names = [n.strip() for n in spec.split(",")]
    for n in names:
        why = dispatch.get_backend(n).unavailable_reason()  # BackendUnavailable for an unknown name
        if why:
            raise InputError(f"backend {n!r} is not available here: {why}")
    return names


# ---------------------------------------------------------------- progress output


class _Bar:
    """The progress of a long command on stderr. On a terminal one line redrawn in place: a bar, the
    count, what runs now and the elapsed time, plus "compiling ..." while numba compiles the cpu
    backend's kernels (a first run on this machine). Elsewhere (CI logs, pipes) a line at every tenth
    of the work, the compile notice once: a log stays a few lines long."""

    WIDTH = 30

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.time()
        self.done, self.total, self.label = 0, 0, ""
        self.compiling = None  # the kernel being compiled, shown on a terminal until the next case ends
        self._tenth = -1

    def _line(self, done, total, label):
        full = self.WIDTH * done // max(total, 1)
        return (f"[{'#' * full}{'.' * (self.WIDTH - full)}] {done}/{total} {label} "
                f"({time.time() - self.t0:.0f} s)")

    def update(self, done, total, label=""):
        self.done, self.total, self.label = done, total, label
        if self.tty:
            extra = f" - compiling {self.compiling} (first run on this machine)" if self.compiling else ""
            self.stream.write(f"\r{self._line(done, total, label)}{extra}\x1b[K")
            self.stream.flush()
        elif total and 10 * done // total > self._tenth:  # 0%, 10%, ..., 100%: eleven lines at most
            self._tenth = 10 * done // total
            self.stream.write(self._line(done, total, label) + "\n")
            self.stream.flush()

    def compile_started(self, kernel, notice):
        """hal.kernels.cpu's compile sink: the notice once (a line of its own), then the kernel on the bar."""
        if notice is not None:
            self.note(notice)
        self.compiling = kernel
        if self.tty:
            self.update(self.done, self.total, self.label)

    def note(self, text):
        """A line of its own above the bar (the bar is redrawn under it on a terminal)."""
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        if self.tty:
            self.update(self.done, self.total, self.label)
        self.stream.flush()

    def close(self, label=""):
        self.compiling = None
        if self.tty:
            self.stream.write(f"\r{self._line(self.total, self.total, label)}\x1b[K\n")
        elif self._tenth < 10:
            self.stream.write(self._line(self.total, self.total, label) + "\n")
        self.stream.flush()

    def __enter__(self):
        """While the bar is shown, the cpu backend's compile notice goes through it (not a stray line)."""
        kernels = _cpu_kernels()
        if kernels is not None:
            self._sink_before = kernels.compile_sink
            kernels.compile_sink = self.compile_started
        return self

    def __exit__(self, *exc):
        kernels = _cpu_kernels()
        if kernels is not None:
            kernels.compile_sink = self._sink_before


def _cpu_kernels():
    """hal.kernels.cpu (its compile notice), or None where it cannot load (it needs no numba to import)."""
    try:
        from hal.kernels import cpu
    except ImportError:
        return None
    return cpu


def _progress(bar, verbose):
    """The runner's progress callback: the bar, and with ``verbose`` a line per case with its time."""
    def progress(done, total, label, seconds):
        if seconds is not None:
            bar.compiling = None  # the case ended, and its compiles with it
            if verbose:
                bar.note(f"{label} {seconds:.1f}s")
        bar.update(done, total, label.split(" (")[0])
    return progress


def _conformance_run(args) -> int:
    from hal.conformance import report, runner
    from .errors import BackendUnavailable, InputError
    if args.device.split(":")[0] == "npu":  # torch knows the npu device type only once torch_npu is imported
        from hal.backends.ascend import enable_npu
        try:
            enable_npu()
        except BackendUnavailable as exc:
            raise InputError(f"--device npu: {exc}") from None
    device = _device(args.device)
    names = _backend_names(args.backend, device)
    suite_names = _suites(args.ops)
    dtypes = _dtypes(args.dtypes)
    if args.plan:
        return _conformance_plan(names, suite_names, device, dtypes, args)
    golden_root = _golden_root()
    with _Outputs(json=args.json, junit=args.junit) as outputs:
        t0 = time.time()
        quick = args.quick or os.environ.get("LOCKSTEP_QUICK", "") not in ("", "0")
        if args.quiet:
            records = runner.run(names, suite_names, device=args.device, dtypes=dtypes, quick=quick,
                                 golden_root=golden_root)
        else:
            with _Bar() as bar:
                records = runner.run(names, suite_names, device=args.device, dtypes=dtypes, quick=quick,
                                     golden_root=golden_root, progress=_progress(bar, args.verbose))
                bar.close("done")
        print(report.table(records))
        print(report.cases_table(records))
        fails = report.failures(records)
        if fails:
            print("\nFirst divergences:")
            print(fails)
        unserved = report.not_implemented(records)
        if unserved:
            print("\nNot implemented by the backend (not claimed; no divergence, nothing compared):")
            print(unserved)
        meta = {"backends": names, "ops": suite_names, "device": args.device, "quick": quick,
                "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                "seconds": round(time.time() - t0, 1)}
        outputs.write("json", report.to_json(records, meta))
        outputs.write("junit", report.to_junit(records))
    empty = runner.compared_nothing(records)
    if empty:
        print("\nCompared nothing:")
        print("\n".join(empty))
    unproven = report.unproven_suites(records, names, suite_names) if args.require_claims else []
    if unproven:
        print("\n--require-claims: a named suite proved nothing here:")
        print("\n".join(unproven))
    failed = any(r.status == "fail" and r.claimed for r in records)
    why = [w for w, bad in (("a level a backend claims does not hold", failed),
                            ("a claimed level (or the run) compared nothing", bool(empty)),
                            ("a named suite claims no level here or a claimed level compared 0 cases",
                             bool(unproven))) if bad]
    print(f"\n{'FAILED: ' + '; '.join(why) if why else 'OK: every claimed level holds'} ({meta['seconds']} s)")
    return 1 if unproven else runner.exit_status(records)


def _conformance_plan(names, suite_names, device, dtypes, args) -> int:
    """``--plan``: per backend and suite, the cases a run would take, the levels the backend claims and whether it
    serves the first case on this device; nothing is run. With ``--require-claims``: 1 when a named suite would
    prove nothing (no claimed level, no case, or its cases refused here)."""
    from hal import dispatch
    from hal.conformance import runner, suites
    from hal.conformance.suite import DTYPE_NAMES
    quick = args.quick or os.environ.get("LOCKSTEP_QUICK", "") not in ("", "0")
    unproven = []
    for bname in names:
        backend = dispatch.get_backend(bname)
        for sname in suite_names:
            suite = suites.get(sname)
            cases = [c for c in (suite.quick_cases() if quick else suite.cases())
                     if dtypes is None or DTYPE_NAMES[c.dtype] in dtypes]
            claimed = sorted(runner.claims(backend, sname), key=runner.LEVEL_ORDER.index)
            refused = sorted({r for c in cases[:1] for op in suite.ops
                              for r in backend.supports(op, c.spec, c.dtype, device)})
            print(f"plan: {bname} {sname}: {len(cases)} cases; claims {' '.join(claimed) or 'nothing'}; "
                  f"{'refused here: ' + '; '.join(refused) if refused else 'served here'}")
            if not claimed or not cases or refused:
                unproven.append(f"{bname} {sname}")
    if args.require_claims and unproven:
        print(f"FAILED (--require-claims): would prove nothing: {', '.join(unproven)}")
        return 1
    print("plan only: nothing was run")
    return 0


def _conformance_generate(args) -> int:
    from hal.conformance import golden, suites
    from . import dispatch
    root = _golden_root(must_exist=False)
    ref = dispatch.get_backend("reference")
    for name in _suites(args.ops):
        suite = suites.get(name)
        if "L4" not in suite.levels:  # e.g. the fast-policy suites: bits of one GPU model, no goldens
            print(f"{name}: no golden bits (the suite has no L4)", file=sys.stderr)
            continue
        results = []
        for case in suite.cases():
            inputs = suite.make_inputs(case)
            with torch.no_grad():
                results.append((case, inputs, suite.run(ref, case, inputs)))
            print(f"{name} {case.spec.id} {case.id}", file=sys.stderr, flush=True)
        print(f"wrote {golden.write(suite, results, root)} ({len(results)} cases)")
    return 0


_RL_ARRAYS = ("trainer", "sampler", "mask", "cu_seqlens")


def _load_logprobs(path: str) -> dict:
    """The arrays of an ``hal rl report`` file as tensors, every one read and checked (not lazily)."""
    import zipfile

    import numpy as np

    from .errors import InputError
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise InputError(f"cannot read {path} as an .npz of arrays ({e})") from None
    if not hasattr(data, "files"):  # a bare .npy array loads as an ndarray, not an archive of named arrays
        raise InputError(f"{path} is a single array, not an .npz archive; save it with "
                         "numpy.savez(path, trainer=..., sampler=...)")
    with data:
        missing = [k for k in ("trainer", "sampler") if k not in data.files]
        if missing:
            raise InputError(f"{path} has no array named {', '.join(missing)} (found: {', '.join(data.files)}); "
                             "save trainer= and sampler= log-probs, optionally mask= and cu_seqlens=")
        out = {}
        for name in _RL_ARRAYS:
            if name not in data.files:
                out[name] = None
                continue
            try:
                arr = data[name]  # a truncated member or an object (pickled) array fails here
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise InputError(f"{path}: cannot read array {name!r} ({e}); save plain numeric arrays with "
                                 "numpy.savez (no object arrays)") from None
            if arr.dtype.kind not in "biuf":
                raise InputError(f"{path}: array {name!r} has dtype {arr.dtype} ({arr.dtype.kind!r} kind); "
                                 "log-probs are floats, mask is bool or 0/1, cu_seqlens integers")
            if not arr.dtype.isnative:  # e.g. '>f4' from another machine: the same values in native order
                arr = arr.astype(arr.dtype.newbyteorder("="))
            arr = np.require(arr, requirements="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
            try:
                out[name] = torch.from_numpy(arr)
            except TypeError:  # a dtype torch has no type for, e.g. float128 (np.longdouble)
                raise InputError(f"{path}: array {name!r} has dtype {arr.dtype}, which torch cannot hold; save "
                                 "log-probs as float64, float32 or float16 (mask bool or 0/1, cu_seqlens "
                                 "integers)") from None
    return out


def _warmup(args) -> int:
    """Compile (or load) the cpu backend's numba kernels ahead of time, e.g. while building an image or in
    CI: each conformance suite's quick cases on the cpu backend, which call every kernel the way real
    calls do (both drivers, every dtype). A progress bar per (suite, dtype) on stderr."""
    from hal.conformance import runner, suites
    from hal.conformance.suite import DTYPE_NAMES
    from . import dispatch
    cpu = dispatch.get_backend("cpu")
    why = cpu.unavailable_reason()
    if why:
        print(f"hal warmup: backend 'cpu' is not available here: {why}", file=sys.stderr)
        return 2
    suite_names = _suites(args.ops)
    units = [(f, d) for f in suite_names for d in (args.dtypes or ["fp32", "bf16", "fp16"])
             if any(DTYPE_NAMES[c.dtype] == d for c in suites.get(f).quick_cases())]
    failed = []
    with _Bar() as bar:
        for i, (suite, dt) in enumerate(units):
            bar.update(i, len(units), f"{suite} {dt}")
            if runner.exit_status(runner.run(["cpu"], [suite], dtypes=[dt], quick=True)):
                failed.append(f"{suite} {dt}")
        bar.close()
    from hal.kernels import cpu as kernels
    print(f"warm: the cpu backend's kernels for {', '.join(suite_names)} are in {kernels.cache_location()}")
    if failed:
        print(f"hal warmup: conformance failures in {', '.join(failed)}: run `hal conformance run --backend cpu`",
              file=sys.stderr)
        return 1
    return 0


def _rl_report(args) -> int:
    """Metrics for arrays saved from any engine: npz with ``trainer`` and ``sampler`` log-probs ([B, T] or
    packed [N]) and optionally ``mask`` and ``cu_seqlens``."""
    from . import rl
    arrays = _load_logprobs(args.file)
    with _Outputs(json=args.json) as outputs:
        m = rl.mismatch_metrics(arrays["trainer"], arrays["sampler"], mask=arrays["mask"],
                                cu_seqlens=arrays["cu_seqlens"])
        print(m.table())
        outputs.write("json", m.to_json())
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
    run.add_argument("--ops", nargs="*", help="conformance suites (default: all)")
    run.add_argument("--dtypes", nargs="*", choices=["fp32", "bf16", "fp16"])
    run.add_argument("--json", help="write the JSON report here")
    run.add_argument("--junit", help="write a JUnit XML report here")
    run.add_argument("--quiet", action="store_true", help="no progress output")
    run.add_argument("--verbose", action="store_true", help="a line per case with its time, above the progress bar")
    run.add_argument("--plan", action="store_true",
                     help="print the cases, claims and device refusals per backend and suite; run nothing")
    run.add_argument("--require-claims", action="store_true",
                     help="fail unless every named backend claims at least one level of every suite in --ops here "
                          "and every claimed level compared at least one case (the device's verification call)")
    run.add_argument("--quick", action="store_true",
                     help="each conformance suite's quick case set (still crosses every tile/split boundary); "
                          "also LOCKSTEP_QUICK=1")
    gen = csub.add_parser("generate")
    gen.add_argument("--ops", nargs="*")
    rp = sub.add_parser("rl", help="RL mismatch toolkit")
    rsub = rp.add_subparsers(dest="rl_cmd", required=True)
    rep = rsub.add_parser("report", help="mismatch metrics of sampler/trainer log-probs saved in an .npz")
    rep.add_argument("file")
    rep.add_argument("--json", help="also write the metrics as JSON here")
    wp = sub.add_parser("warmup", help="compile the cpu backend's kernels ahead of time (images, CI)")
    wp.add_argument("--ops", nargs="*", help="conformance suites (default: all)")
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
