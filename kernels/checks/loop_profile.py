"""The loops of the fast attention kernels in their sm_90 machine code: instructions per iteration (one key block),
tensor-core and exp instructions, spills (no GPU needed).

    python -m hal.kernels.checks.loop_profile
    PYTHONPATH=$PWD:TORCH_SITE VENV/bin/python -m hal.kernels.checks.loop_profile   # under another Triton (3.6)

Each kernel is compiled as attend launches it (the spec's warps and stages, aligned pointers and strides) and
disassembled with the nvdisasm that ships with Triton; a loop is the code between a backward branch's target and
the branch. Counts are of the static code of one pass through the loop body (a branch inside it may skip some):
they show where the instructions of a key block go, not how fast it runs. docs/triton.md ("fast attention:
interior blocks") holds the report before and after issue 49.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import tempfile

import triton
import triton.language as tl

from .lint import KernelCase, compile_case
from .sass_profile import _tool, profile

_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*)", re.M)
_LABEL = re.compile(r"^(\.L_x_\d+):", re.M)
#: opcode families reported per loop (prefix match on the opcode)
FAMILIES = ("HGMMA", "MUFU", "FMUL", "FADD", "FFMA", "FMNMX", "FSETP", "FSEL", "LOP3", "ISETP", "PLOP3", "SEL",
            "IMAD", "SHFL", "LDGSTS", "LDG", "LDS", "STS", "LDL", "STL", "BAR")


def _sass(compiled) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return _tool("nvdisasm", "-c", path)


def loops(sass: str) -> list[tuple[int, collections.Counter, collections.Counter]]:
    """(instructions, opcode counts, opcode counts without the body's largest forward-branch region) of each loop
    body (backward branch target .. branch), smallest first. The region a conditional branch jumps over is code that
    runs on some iterations only (e.g. the split merge at a split boundary): the third item is the other
    iterations' path."""
    instrs, labels, pending = [], {}, []
    for line in sass.splitlines():
        lab = _LABEL.match(line.strip())
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.match(line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = len(instrs)
            pending = []
            instrs.append((addr, m.group(2), m.group(3)))
    found = []
    for idx, (_, op, rest) in enumerate(instrs):
        if op.startswith("BRA"):
            target = re.search(r"\(?(\.L_x_\d+)\)?", rest)
            if target and target.group(1) in labels and labels[target.group(1)] <= idx:
                start = labels[target.group(1)]
                body = instrs[start:idx + 1]
                skip = (0, 0)  # the largest [from, to) a forward branch inside the body jumps over
                for j, (_, op2, rest2) in enumerate(body):
                    t2 = re.search(r"(\.L_x_\d+)", rest2) if op2.startswith("BRA") else None
                    if t2 and t2.group(1) in labels and j < labels[t2.group(1)] - start <= len(body):
                        if labels[t2.group(1)] - start - j > skip[1] - skip[0]:
                            skip = (j + 1, labels[t2.group(1)] - start)
                rest = body[:skip[0]] + body[skip[1]:]
                found.append((len(body), collections.Counter(o for _, o, _ in body),
                              collections.Counter(o for _, o, _ in rest)))
    return sorted(found, key=lambda x: x[0])


def _family_counts(ops: collections.Counter) -> dict:
    return {f: sum(n for o, n in ops.items() if o.split(".")[0] == f) for f in FAMILIES}


def cases() -> list[tuple[KernelCase, int, int]]:
    """(case, warps, stages): fast_lint's fast attention cases (varlen prefill, paged split-KV decode), the prefill
    also with the general block step for every block and with a loop per split where the kernel has the interior
    path, its key-bound pre-pass, and the split-KV merge on the spec's 128-row tile and on the decode rows that exist
    (4: one query row x a packed GQA group)."""
    from ..triton import attention_kernel as AK
    from .fast_lint import fast_kernels
    from .seq_lint_cases import _sig
    divisible = ("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh")
    out = []
    for case, warps, stages in fast_kernels():
        if not case.name.startswith("fast_attention"):
            continue
        case = dataclasses.replace(case, divisible=divisible)
        if case.constexprs.get("INTERIOR"):  # also the kernel before, and the interior path with a loop per split
            general = dict(case.constexprs, INTERIOR=False, HEAVY_FIRST=False, FLAT=False)
            out.append((dataclasses.replace(case, name=case.name + "[general]", constexprs=general), warps, stages))
            per_split = dict(case.constexprs, FLAT=False)
            out.append((dataclasses.replace(case, name=case.name + "[interior,per_split]", constexprs=per_split),
                        warps, stages))
            case = dataclasses.replace(case, name=case.name + "[interior,one_pass]")
        out.append((case, warps, stages))
    from ..triton import fast_attention as fa
    kb_types = {"K": "*bf16", "V": "*bf16", "KLEN": "*i32", "K_ROW0": "*i32", "BT": "*i32"}
    kb_types.update({n: "i32" for n in ("bt_stride", "page", "stride_kp", "stride_kt", "stride_kh", "n_kb")})
    consts = dict(HKV=8, D=128, BLOCK_D=128, KB=64, PAGED=False)
    sig = {k: v for k, v in _sig(fa._key_bound_kernel, kb_types, "*fp32").items() if k not in consts}
    out.append((KernelCase("fast_attention.key_bounds[bf16]", fa._key_bound_kernel, sig, consts,
                           divisible=("stride_kt", "stride_kh")), 4, None))
    types = {n: "*i32" for n in ("WN", "Q_ROW0", "QLEN", "KLEN", "LSE_ROW0")}
    types.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_lh", "n_ws_rows", "n_ws_splits", "n_work",
                                     "n1")})
    types.update(O="*bf16")
    for bm, rows in ((128, 32), (4, 1)):
        consts = dict(HQ=32, D=128, BLOCK_M=bm, ROWS=rows, PACK=4, BLOCK_D=128, KS=512, OUT=tl.bfloat16, NPU=False)
        sig = {k: v for k, v in _sig(AK._merge_kernel, types, "*fp32").items() if k not in consts}
        out.append((KernelCase(f"merge[bf16,BLOCK_M={bm}]", AK._merge_kernel, sig, consts,
                               divisible=("stride_qt", "stride_qh")), 4, None))
    return out


def main(argv=None) -> int:
    print(f"# loop_profile: triton {triton.__version__}, sm_90", flush=True)
    for case, warps, stages in cases():
        compiled = compile_case(case, "sm90", False, warps, stages, aligned=True)
        p = profile(compiled)
        sass = _sass(compiled)
        hgmma = sum(1 for m in _LINE.finditer(sass) if m.group(2).startswith("HGMMA"))
        print(f"{case.name}: regs {p.registers} stack {p.stack} instr {p.total} HGMMA {hgmma} "
              f"wgmma-in-ptx {'wgmma.mma_async' in compiled.asm['ptx']}", flush=True)
        for n, ops, rest in [lp for lp in loops(sass) if _family_counts(lp[1])["HGMMA"] or "merge" in case.name][:6]:
            fam = {f: c for f, c in _family_counts(ops).items() if c}
            other = _family_counts(rest)
            print(f"    loop {n:5d} instr  " + " ".join(f"{f} {c}" for f, c in fam.items())
                  + f"  | without its largest branch region: {sum(rest.values())} instr, LDL {other['LDL']} "
                    f"STL {other['STL']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
