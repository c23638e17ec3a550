"""Lint of the fast-policy Triton kernels without a GPU: compiled for sm_80 / sm_90, they must USE tensor cores.

    python -m hal.kernels.checks.fast_lint

The strict lint (lint.py) rejects tensor cores and must never be applied to these kernels; this one
requires them: a fast kernel whose ``tl.dot`` fell back to FMA units (an fp32 operand, a tile too small
for the target's instruction) would be correct but pointless. Rules:
  PTX: ``wgmma`` (sm_90) / ``mma`` (sm_80) present; no float atomics (``atom``/``red`` on floats:
  an order that changes from run to run would break L0).
  TTIR: a ``tt.dot``; compiled with the launch options of the fast kernels (the spec's warps, stages).
Negative control (tests/test_fast_policy.py): the strict matmul kernel fails it.
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


def fast_problems(ttir: str, ptx: str, target: str) -> list[str]:
    out = []
    if "tt.dot" not in ttir:
        out.append("no tt.dot in the TTIR: the kernel does not use the matrix unit")
    name, rx = _TENSOR_CORE[target]
    if not rx.search(ptx):
        out.append(f"no tensor-core instruction ({name}) in the PTX for {target}: tl.dot did not reach the "
                   "tensor cores")
    m = _FLOAT_ATOMIC.search(ptx)
    if m:
        out.append(f"float atomic (order-dependent sum): {m.group(0).strip()}")
    return out


def lint(case: KernelCase, target: str, num_warps: int = 4, num_stages: int = 3) -> list[str]:
    k = compile_case(case, target, STRICT_OPTIONS["enable_fp_fusion"], num_warps, num_stages)
    return fast_problems(k.asm["ttir"], k.asm["ptx"], target)


def fast_kernels():
    """(case, num_warps, num_stages) of every fast kernel, with the default specs' tiles."""
    from hal.spec import FastMatmulSpec
    from ..triton import fast_matmul as fm
    s = FastMatmulSpec()
    out = []
    for dt, tdt in (("bf16", tl.bfloat16), ("fp16", tl.float16)):
        out.append((KernelCase(
            f"fast_matmul[{dt}]", fm._fast_matmul_kernel,
            {**_ptrs(dt, "a_ptr", "b_ptr", "bias_ptr", "out_ptr"),
             **_ints("M", "N", "K", "sa_m", "sa_k", "sb_k", "sb_n", "so_m", "so_n")},
            {"HAS_BIAS": True, "OUT_DTYPE": tdt, "BM": s.block_m, "BN": s.block_n, "BK": s.block_k,
             "GROUP": fm.GROUP_M}), s.num_warps, s.num_stages))
    from hal.spec import FastGatedDeltaRuleSpec
    from ..triton import fast_gated_delta_rule as fg
    from .seq_lint_cases import _sig
    g = FastGatedDeltaRuleSpec()
    consts = dict(H=16, HV=32, DK=128, DV=128, C=g.chunk, BDK=128, BDV=g.block_dv, WANT_FINAL=True, NPU=False)
    types = {"OPENED": "*i32", "TOTAL": "*i32", **{n: "i32" for n in ("n_rows", "lmax", "n_work", "n1", "n2")}}
    sig = {k: v for k, v in _sig(fg._fast_chunked_kernel, types, "*fp32").items() if k not in consts}
    # Qwen3-Next / Qwen3.5 GDN heads (16 q/k, 32 value heads, d 128); launched without num_stages: Triton's 3
    out.append((KernelCase("fast_gdn_chunked[H16/32,d128]", fg._fast_chunked_kernel, sig, consts), g.num_warps, 3))
    from hal.spec import FastAttentionSpec
    from ..triton import fast_attention as fa
    a = FastAttentionSpec()
    i32 = "i32"
    types = {n: "*i32" for n in ("WN", "Q_ROW0", "QLEN", "KLEN", "K_ROW0", "BT", "LSE_ROW0")}
    types.update({n: i32 for n in ("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_lh",
                                   "bt_stride", "page", "causal", "left", "right", "n_ws_rows", "n_ws_splits",
                                   "n_work", "n1", "n2")})
    types.update(scale="fp32", Q="*bf16", K="*bf16", V="*bf16", O="*bf16")
    for paged, one in ((False, False), (True, True)):  # varlen prefill; paged split-KV decode (a GQA group packed)
        pack = 4 if one else 1
        consts = dict(HQ=32, GROUP=4, D=128, BLOCK_M=a.block_m, ROWS=a.block_m // pack, PACK=pack, BLOCK_D=128,
                      KB=a.kv_block, KS=a.kv_split, OUT=tl.bfloat16, PAGED=paged, ONE_SPLIT=one, NPU=False)
        sig = {k: v for k, v in _sig(fa._fast_attn_kernel, types, "*fp32").items() if k not in consts}
        out.append((KernelCase(f"fast_attention[bf16,paged={paged}]", fa._fast_attn_kernel, sig, consts),
                    a.num_warps, a.num_stages))
    return out


def main(argv=None) -> int:
    options = {case: (warps, stages) for case, warps, stages in fast_kernels()}
    bad = run_cases([(case, "") for case in options], lambda case, target: lint(case, target, *options[case]),
                    width=36)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
