"""What the compiled strict kernels do with memory, read from their machine code (no GPU needed).

    python -m hal.kernels.checks.sass_profile            # the CI kernel set on sm_90
    python -m hal.kernels.checks.sass_profile --full --targets sm80 sm90
    python -m hal.kernels.checks.sass_profile --triton-venv /work/triton36   # and again under that venv's Triton

``--triton-venv VENV`` (repeatable) reruns the same report with ``VENV/bin/python`` and this checkout on
PYTHONPATH after the installed Triton's, so a Triton the GPU machine runs (3.6) is profiled beside the
installed one; the venv needs triton, torch, numpy and numba (docs/gpu_profile_triton36.md). Every report
starts with a line naming its Triton version.

Each kernel is compiled as a launch with aligned tensors would compile it (pointers and the row strides /
lengths in ``KernelCase.divisible`` carry Triton's divisibility-by-16 hint), its cubin is disassembled
with the ``nvdisasm`` that ships with Triton, and the instructions that decide memory efficiency are
counted: global loads by width (``LDG.E.128`` moves 16 bytes per thread, ``LDG.E.U16`` two), shared-memory
traffic and barriers (layout conversions that Triton routes through shared memory), warp shuffles, fp32
FMAs, registers and stack (spills). Counts are of the static code, not of executed instructions: they
show the structure of a kernel (vector loads, conversions inside the chain loop), not its speed, which
only a GPU measures (benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton

from .lint import TARGETS, compile_case, strict_kernels

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)", re.M)


@dataclass(frozen=True)
class Profile:
    registers: int
    stack: int                   # bytes of local stack per thread (spills)
    global_loads: dict           # LDG opcode (with its width suffix) -> count
    shared: int                  # LDS/STS/LDSM instructions (layout conversions through shared memory)
    barriers: int                # BAR instructions
    shuffles: int                # SHFL instructions
    ffma: int                    # fp32 fma instructions
    total: int                   # all instructions

    @property
    def vector_loads(self) -> int:
        """Global loads of 16 bytes per thread."""
        return sum(n for op, n in self.global_loads.items() if ".128" in op)

    @property
    def narrow_loads(self) -> int:
        """Global loads of at most 2 bytes per thread (one bf16/fp16 element)."""
        return sum(n for op, n in self.global_loads.items() if op.endswith((".U16", ".S16", ".U8", ".S8")))


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(_BIN, name), *args], capture_output=True, text=True, check=True).stdout


def profile(compiled) -> Profile:
    """The instruction profile of one compiled kernel (``triton.compile``'s result)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = _tool("nvdisasm", "-c", path)
        usage = _tool("cuobjdump", "-res-usage", path)
    ops = collections.Counter(_OPCODE.findall(sass))

    def count(*prefixes):
        return sum(n for op, n in ops.items() if op.startswith(prefixes))
    return Profile(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                   stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                   global_loads={op: n for op, n in sorted(ops.items()) if op.startswith("LDG")},
                   shared=count("LDS", "STS", "LDSM"), barriers=count("BAR"), shuffles=count("SHFL"),
                   ffma=count("FFMA"), total=sum(ops.values()))


def profile_case(case, target: str = "sm90") -> Profile:
    """The profile of a lint ``KernelCase``, compiled as an aligned launch with the strict options."""
    return profile(compile_case(case, target, aligned=True))


def _row(name: str, target: str, p: Profile) -> str:
    loads = " ".join(f"{op.removeprefix('LDG.E')or'.32'}:{n}" for op, n in p.global_loads.items()) or "-"
    return (f"{name:<40} {target}  regs {p.registers:>3}  stack {p.stack:>3}  LDG {loads:<28} shared {p.shared:>4}  "
            f"bar {p.barriers:>3}  shfl {p.shuffles:>3}  ffma {p.ffma:>5}  instr {p.total:>5}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.kernels.checks.sass_profile", description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="every strict kernel and dtype/mode variant")
    ap.add_argument("--targets", nargs="*", default=["sm90"], choices=list(TARGETS))
    ap.add_argument("--only", nargs="*", default=None, help="kernels whose name contains one of these")
    ap.add_argument("--triton-venv", action="append", default=[], metavar="VENV",
                    help="then the same report under VENV/bin/python (e.g. a venv with triton==3.6.0)")
    args = ap.parse_args(argv)
    print(f"# sass_profile: triton {triton.__version__} ({os.path.dirname(triton.__file__)}), python "
          f"{sys.version.split()[0]}, targets {' '.join(args.targets)}", flush=True)
    for case in strict_kernels(args.full):
        if args.only and not any(s in case.name for s in args.only):
            continue
        for target in args.targets:
            print(_row(case.name, target, profile_case(case, target)), flush=True)
    status = 0
    for venv in args.triton_venv:
        status |= _rerun_in(venv, argv if argv is not None else sys.argv[1:])
    return status


def _rerun_in(venv: str, argv: list[str]) -> int:
    """This report again with ``venv``'s python (its Triton), this checkout first on PYTHONPATH."""
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        print(f"# --triton-venv {venv}: no {python}", flush=True)
        return 1
    rest, skip = [], False
    for a in argv:  # the same arguments, without --triton-venv (no recursion)
        if skip:
            skip = False
        elif a == "--triton-venv":
            skip = True
        elif not a.startswith("--triton-venv="):
            rest.append(a)
    checkout = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
    env = {**os.environ, "PYTHONPATH": checkout + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    sys.stdout.flush()
    return subprocess.run([python, "-m", "hal.kernels.checks.sass_profile", *rest], env=env, cwd=checkout).returncode


if __name__ == "__main__":
    sys.exit(main())
