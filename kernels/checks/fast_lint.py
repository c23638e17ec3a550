"""Lint of the fast-policy Triton kernels without a GPU: compiled for sm_80 / sm_90, they must USE tensor cores.

    python -m hal.kernels.checks.fast_lint

The strict lint (lint.py) rejects tensor cores and must never be applied to these kernels; this one
requires them: a fast kernel whose ``tl.dot`` fell back to FMA units (an fp32 operand, a tile too small
for the target's instruction) would be correct but pointless. Rules:
  PTX: ``wgmma`` (sm_90) / ``mma`` (sm_80) present (``mma`` on sm_90 for a dot tile of fewer than 64 rows, where
  wgmma cannot go: the decode-tile attention spec's 16 rows); no float atomics (``atom``/``red`` on floats:
  an order that changes from run to run would break L0).
  TTIR: a ``tt.dot``; compiled with the launch options of the fast kernels (the spec's warps, stages).
Negative control (tests/test_fast_policy.py): the strict matmul kernel fails it.

FastMatmulV3Spec's table (``--table``; ``--triton-venv /work/triton36`` for the GPU image's Triton 3.6): every
launch compiled for sm_90 must lower its dot to ``wgmma.mma_async``, have no local stack (spills), and load by
asynchronous copies (TMA for the TMA launch, cp.async otherwise). Negative control: a BLOCK_M 32 launch (mma.sync).
"""
from __future__ import annotations

import re
import sys

import triton.language as tl

from ..triton.launch import STRICT_OPTIONS
from .lint import PTX_RULES, KernelCase, _ints, _ptrs, compile_case, run_cases

_TENSOR_CORE = {"sm90": ("wgmma.mma_async", re.compile(r"^\s*(?:@!?%p\d+\s+)?wgmma\.mma_async\b", re.M)),
                "sm80": ("mma.sync.aligned", re.compile(r"^\s*(?:@!?%p\d+\s+)?mma\.sync\.aligned\b", re.M))}
_FLOAT_ATOMIC = dict(PTX_RULES)["float atomic (order-dependent sum)"]


#: wgmma's M: a dot tile of fewer rows lowers to mma.sync on sm_90 too
WGMMA_MIN_ROWS = 64


def fast_problems(ttir: str, ptx: str, target: str, rows: int | None = None) -> list[str]:
    """``rows``: the dot tile's rows, where known (fewer than WGMMA_MIN_ROWS: the sm_80 instruction on sm_90 too)."""
    out = []
    if "tt.dot" not in ttir:
        out.append("no tt.dot in the TTIR: the kernel does not use the matrix unit")
    name, rx = _TENSOR_CORE["sm80" if rows is not None and rows < WGMMA_MIN_ROWS else target]
    if not rx.search(ptx):
        out.append(f"no tensor-core instruction ({name}) in the PTX for {target}: tl.dot did not reach the "
                   "tensor cores")
    m = _FLOAT_ATOMIC.search(ptx)
    if m:
        out.append(f"float atomic (order-dependent sum): {m.group(0).strip()}")
    return out


def lint(case: KernelCase, target: str, num_warps: int = 4, num_stages: int = 3) -> list[str]:
    k = compile_case(case, target, STRICT_OPTIONS["enable_fp_fusion"], num_warps, num_stages)
    return fast_problems(k.asm["ttir"], k.asm["ptx"], target, case.constexprs.get("BLOCK_M"))


def fast_matmul_case(launch, dt: str, logits: bool = False) -> KernelCase:
    """The fast matmul kernel under one launch (kernels/triton/fast_matmul.Launch) for dtype dt, in linear's layout
    as a launch specializes it: x [M, K] and weight [N, K] rows contiguous (unit strides along K are constants 1 to
    Triton, so the loads vectorize and pipeline), the output's columns contiguous; TMA launches take tensor
    descriptors of x and weight (the host-side TensorDescriptor of triton.tools.tensor_descriptor). ``logits``: as
    token_logprobs launches it under a fast matmul spec (no bias, float32 out, divided by the temperature)."""
    from ..triton import fast_matmul as fm
    tdt = {"bf16": tl.bfloat16, "fp16": tl.float16}[dt]
    sig = {**_ptrs(dt, "a_ptr", "b_ptr", "bias_ptr"), **_ptrs("fp32" if logits else dt, "out_ptr"),
           **_ints("M", "N", "K", "sa_m", "sb_n", "so_m", "n_programs"), "temp": "fp32"}
    consts = {"HAS_BIAS": not logits, "HAS_TEMP": logits, "OUT_DTYPE": tl.float32 if logits else tdt,
              "BM": launch.block_m, "BN": launch.block_n, "BK": launch.block_k,
              "GROUP": fm.GROUP_M, "PERSISTENT": launch.persistent, "TMA": launch.tma, "B_NK": launch.tma,
              "sa_k": 1, "sb_k": 1, "so_n": 1}
    if launch.tma:
        sig.update(a_desc=f"tensordesc<{dt}[{launch.block_m}, {launch.block_k}]>",
                   b_desc=f"tensordesc<{dt}[{launch.block_n}, {launch.block_k}]>")
    else:
        consts.update(a_desc=None, b_desc=None)
    return KernelCase(f"fast_matmul[{dt},{launch.label}" + (",logits]" if logits else "]"), fm._fast_matmul_kernel, sig,
                      consts,
                      divisible=("K", "sa_m", "sb_n", "so_m"))


def table_problems(launch, dt: str, target: str = "sm90") -> list[str]:
    """What keeps one launch of FastMatmulV3Spec's table out of it, compiled for ``target`` by this Triton: its dot
    not on ``wgmma`` (v3's one instruction family), spills (local stack), or loads that are not asynchronous copies
    into shared memory (TMA ``cp.async.bulk.tensor`` for a TMA launch, ``cp.async`` / LDGSTS otherwise: no pipeline)."""
    from .sass_profile import profile
    case = fast_matmul_case(launch, dt)
    k = compile_case(case, target, STRICT_OPTIONS["enable_fp_fusion"], launch.num_warps, launch.num_stages,
                     aligned=True)
    ptx, p = k.asm["ptx"], profile(k)
    out = fast_problems(k.asm["ttir"], ptx, target)
    if p.stack:
        out.append(f"spills: {p.stack} bytes of local stack per thread ({p.registers} registers)")
    if launch.tma and "cp.async.bulk.tensor" not in ptx:
        out.append("a TMA launch without cp.async.bulk.tensor loads")
    if not launch.tma and not p.async_copies:
        out.append("no cp.async (LDGSTS) loads: the K loop is not pipelined")
    return out


def fast_kernels():
    """(case, num_warps, num_stages) of every fast kernel, with the default specs' tiles."""
    from hal.spec import FastMatmulSpec
    from ..triton import fast_matmul as fm
    s = FastMatmulSpec()
    out = []
    for dt in ("bf16", "fp16"):
        out.append((fast_matmul_case(fm.launch_of_spec(s), dt), s.num_warps, s.num_stages))
    # token_logprobs' logits under its fast spec (hal.spec.POLICY_SPECS["fast"]): the same kernel, float32 out
    out.append((fast_matmul_case(fm.launch_of_spec(s), "bf16", logits=True), s.num_warps, s.num_stages))
    from hal.spec import FastGatedDeltaRuleSpec
    from ..triton import fast_gated_delta_rule as fg
    from .seq_lint_cases import _sig
    g = FastGatedDeltaRuleSpec()
    consts = dict(H=16, HV=32, DK=128, DV=128, C=g.chunk, BDK=128, BDV=g.block_dv, WANT_FINAL=True, NPU=False)
    types = {"OPENED": "*i32", "TOTAL": "*i32", **{n: "i32" for n in ("n_rows", "lmax", "n_work", "n1", "n2")}}
    sig = {k: v for k, v in _sig(fg._fast_chunked_kernel, types, "*fp32").items() if k not in consts}
    # Qwen3-Next / Qwen3.5 GDN heads (16 q/k, 32 value heads, d 128); launched without num_stages: Triton's 3
    out.append((KernelCase("fast_gdn_chunked[H16/32,d128]", fg._fast_chunked_kernel, sig, consts), g.num_warps, 3))
    from hal.spec import FAST_ATTENTION_DECODE, FastAttentionSpec
    from ..triton import fast_attention as fa
    i32 = "i32"
    types = {n: "*i32" for n in ("WN", "Q_ROW0", "QLEN", "KLEN", "K_ROW0", "BT", "LSE_ROW0")}
    types.update({n: i32 for n in ("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_lh",
                                   "bt_stride", "page", "causal", "left", "right", "n_ws_rows", "n_ws_splits",
                                   "n_work", "n1", "n2", "n_kb")})
    types.update(scale="fp32", Q="*bf16", K="*bf16", V="*bf16", O="*bf16")
    for a, tag in ((FastAttentionSpec(), ""), (FAST_ATTENTION_DECODE, ",m16")):  # the default; the decode tile
        for paged, one in ((False, False), (True, True)):  # varlen prefill; paged split-KV decode (a GQA group packed)
            pack = 4 if one else 1
            # as attend launches them: prefill-sized tiles with the interior path (fast_attention.launch_config)
            consts = dict(HQ=32, GROUP=4, D=128, BLOCK_M=a.block_m, ROWS=a.block_m // pack, PACK=pack, BLOCK_D=128,
                          KB=a.kv_block, KS=a.kv_split, NKB=a.kv_split // a.kv_block, OUT=tl.bfloat16, PAGED=paged,
                          ONE_SPLIT=one, NPU=False, INTERIOR=not one, HEAVY_FIRST=True, FLAT=True)
            sig = {k: v for k, v in _sig(fa._fast_attn_kernel, types, "*fp32").items() if k not in consts}
            out.append((KernelCase(f"fast_attention[bf16,paged={paged}{tag}]", fa._fast_attn_kernel, sig, consts),
                        a.num_warps, a.num_stages))
    return out


def table_lint(dtypes=("bf16", "fp16")) -> int:
    """Every launch of FastMatmulV3Spec's table, sm_90 under this Triton (the GPU image's is 3.6: --triton-venv)."""
    import triton

    from ..triton import fast_matmul as fm
    print(f"# v3 launch table, sm_90, triton {triton.__version__}", flush=True)
    bad = 0
    for name, launch in fm.table_launches():
        for dt in dtypes:
            problems = table_problems(launch, dt)
            bad += bool(problems)
            print(f"{'ok' if not problems else 'FAIL':4} {name:<28} {launch.label:<30} {dt} sm90", flush=True)
            for pr in problems:
                print(f"     - {pr}")
    return bad


def _rerun_in(venv: str, argv: list[str]) -> int:
    """This lint again under ``venv``'s Triton: its python, PYTHONPATH its site-packages (triton first), this
    checkout, then this interpreter's path (torch: such a venv may hold triton alone)."""
    import glob
    import os
    import subprocess
    python = os.path.join(venv, "bin", "python")
    site = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
    if not os.access(python, os.X_OK) or not site:
        print(f"# --triton-venv {venv}: no python / site-packages there", flush=True)
        return 1
    checkout = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site[0], checkout, *[p for p in sys.path if p]])}
    env.pop("TRITON_INTERPRET", None)
    sys.stdout.flush()
    return subprocess.run([python, "-m", "hal.kernels.checks.fast_lint", *argv], env=env, cwd=checkout).returncode


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m hal.kernels.checks.fast_lint", description=__doc__.split("\n")[0])
    ap.add_argument("--table", action="store_true", help="only FastMatmulV3Spec's launch table (sm_90)")
    ap.add_argument("--triton-venv", default=None, metavar="VENV", help="run under VENV's Triton (e.g. 3.6)")
    args = ap.parse_args(argv)
    if args.triton_venv:
        return _rerun_in(args.triton_venv, ["--table"] if args.table else [])
    bad = table_lint()
    if not args.table:
        options = {case: (warps, stages) for case, warps, stages in fast_kernels()}
        bad += run_cases([(case, "") for case in options], lambda case, target: lint(case, target, *options[case]),
                         width=36)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
