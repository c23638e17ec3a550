"""Lint of the strict Triton kernels without a GPU: compile to TTIR and PTX for sm_80 / sm_90, reject
what would break the bits.

    python -m hal.kernels.checks.lint            # CI set: a few kernels x 2 targets
    python -m hal.kernels.checks.lint --full     # every strict kernel and variant

PTX rules (a strict kernel may only use correctly rounded IEEE operations):
  ``.approx`` (ex2/lg2/sin/rcp/sqrt/rsqrt approximations, ``div.approx``), ``.ftz`` (flush to zero),
  ``div.full`` (what ``/`` lowers to: approximate), ``ex2``/``lg2`` (tl.exp/tl.log), ``mma``/``wgmma``
  (tensor cores: tree sums), float atomics (``atom``/``red`` on f16/bf16/f32/f64: order-dependent),
  and any float ``add/sub/mul/fma/mad`` without ``.rn`` (ptxas may contract those into an fma).
TTIR / metadata rules: compiled with fp fusion off (the launcher's options); a strict ``tt.dot`` (the NVIDIA
variant's K tiles, launch.fma_dot) must be float32 x float32 with ``ieee`` precision (NVIDIA's FMA dot lowering: one
fma chain per output, k in order; tf32 / bf16 operands would run on tensor cores) and start from a zero constant
accumulator (Triton's combiner folds ``acc + dot`` into one chain across tiles), and its PTX must hold the K tiles
as ``fma.rn.f32`` chains of the dot's K lanes from ``0f00000000`` (``fma_chains``); the AMD / Ascend variants
(``FMA_DOT=False``) hold no ``tt.dot`` at all.

Backward rules (deterministic, not strict: the attention backward kernels, ``KernelCase(strict=False)``,
compiled with Triton's default options as ``launch(strict=False)`` launches them): tensor cores, fusion
and approximations are allowed; float atomics are not (their sum order changes from run to run).

Needs triton only (no CUDA driver): ``triton.compile(ASTSource(...), target=GPUTarget(...))``.
Not available under TRITON_INTERPRET=1 (kernels are then interpreter objects, not compilable).
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from dataclasses import dataclass, field

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..triton.launch import STRICT_OPTIONS

TARGETS = {"sm80": GPUTarget("cuda", 80, 32), "sm90": GPUTarget("cuda", 90, 32)}

_FLOAT_TYPES = r"(?:f16|bf16|f32|f64|f16x2|bf16x2)"
PTX_RULES = [
    ("approximate instruction (.approx)", re.compile(r"\.approx\b")),
    ("flush to zero (.ftz)", re.compile(r"\.ftz\b")),
    ("approximate division (div.full)", re.compile(r"^\s*(?:@!?%p\d+\s+)?div\.full\b", re.M)),
    ("hardware exp2/log2 (ex2/lg2)", re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ex2|lg2)\.", re.M)),
    ("tensor-core instruction (mma/wgmma)", re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:wgmma|mma)\.", re.M)),
    ("float atomic (order-dependent sum)",
     re.compile(rf"^\s*(?:@!?%p\d+\s+)?(?:atom|red)(?:\.[a-z0-9_]+)*\.{_FLOAT_TYPES}\b", re.M)),
]
#: the one rule the deterministic, non-strict kernels keep
BACKWARD_PTX_RULES = [rule for rule in PTX_RULES if rule[0].startswith("float atomic")]
_ARITH = re.compile(rf"^\s*(?:@!?%p\d+\s+)?((?:add|sub|mul|fma|mad)(?:\.[a-z0-9_]+)*\.{_FLOAT_TYPES})\b", re.M)


def ptx_problems(ptx: str, strict: bool = True) -> list[str]:
    """Each rule the PTX breaks, with the first offending instruction (strict=False: the backward rules)."""
    out = []
    for what, rx in (PTX_RULES if strict else BACKWARD_PTX_RULES):
        m = rx.search(ptx)
        if m:
            line = ptx[ptx.rfind("\n", 0, m.start()) + 1: ptx.find("\n", m.end())].strip()
            out.append(f"{what}: {line}")
    for m in _ARITH.finditer(ptx) if strict else ():
        if ".rn." not in m.group(1) + ".":
            out.append(f"float arithmetic without .rn (may be contracted): {m.group(1)}")
            break
    return out


_FMA = re.compile(r"^\s*(?:@!?%p\d+\s+)?fma\.rn\.f32\s+(%r\d+),\s*([^,]+),\s*([^,]+),\s*([^;]+);", re.M)


def fma_chains(ptx: str) -> list[int]:
    """Lengths of the fma chains that start from +0.0 (``fma.rn.f32 d, a, b, 0f00000000``), each followed through
    the fma that takes the previous result as its addend (one per step, nothing else in between)."""
    fmas = _FMA.findall(ptx)
    by_addend = {}
    for d, _, _, c in fmas:
        by_addend.setdefault(c.strip(), []).append(d)
    out = []
    for d, _, _, c in fmas:
        if c.strip() != "0f00000000":
            continue
        n, reg = 1, d
        while len(by_addend.get(reg, [])) == 1:
            n, reg = n + 1, by_addend[reg][0]
        out.append(n)
    return out


def _dot_steps(case) -> set[int] | None:
    """The K lanes of an FMA-dot kernel's chains: matmul's K tile (KTP); attention's head-dim tile (DTP) for the scores
    and its key block (KB) for P.V and l (attention_kernel._scores_fma_dot / _block_fma_dot; each chain split over
    dots of DK lanes, each from the last one's accumulator, is still one chain of DTP / KB steps from +0.0); the GDN
    chunked kernel's d_k tile (DTP, no KB: gated_delta_rule._products_fma_dot; its state update chains from
    S0 * gamma, not from +0.0, and stays explicit fma)."""
    c = case.constexprs
    if "KTP" in c:
        return {c["KTP"]}
    if "DTP" in c and c.get("FMA_DOT") and "KB" not in c:
        return {c["DTP"]}
    if "DTP" in c and c.get("FMA_DOT"):
        # KB + 1: the spec's block update fma(acc, alpha, acc_blk) takes the P.V chain as its addend (one step, where
        # the layouts of acc and acc_blk agree); a dot chained across key blocks would be 2 KB long
        return {c["DTP"], c["KB"], c["KB"] + 1}
    return None


def dot_chain_problems(ptx: str, steps) -> list[str]:
    """An FMA-dot kernel's PTX must hold its K tiles as fma chains of ``steps`` (the dot's K lanes) from +0.0; a set:
    chains of those lengths only (a kernel whose dots have different K)."""
    lengths = fma_chains(ptx)
    ok = set(lengths) == {steps} if isinstance(steps, int) else set(lengths) <= set(steps)
    if not lengths or not ok:
        return [f"FMA dot: want fma chains of {steps} steps from +0.0, found lengths {sorted(set(lengths))[:8]} "
                f"({len(lengths)} chains)"]
    return []


_DOT = re.compile(r"tt\.dot\s+(%[\w#]+),\s*(%[\w#]+),\s*(%[\w#]+)([^:]*):\s*tensor<[^>]*x(\w+)>\s*\*\s*"
                  r"tensor<[^>]*x(\w+)>")


def ttir_problems(ttir: str, fp_fusion: bool, dots_allowed: bool = True) -> list[str]:
    """dots_allowed=False: the AMD / Ascend variant of a kernel (FMA_DOT=False), where no tt.dot may remain."""
    out = []
    if fp_fusion:
        out.append("compiled with fp fusion ON (a*b + c becomes one fma): launch with enable_fp_fusion=False")
    if re.search(r"-0\.0+e\+00\b", ttir):
        out.append("a float -0.0 constant: Triton 3.6 compiles it as +0.0 (tl.where's -0.0 and a load's other=-0.0 "
                   "alike); build it with strict_math.neg_zero_where")
    for m in _DOT.finditer(ttir):
        if not dots_allowed:
            out.append("tt.dot in a variant without FMA dots (AMD / Ascend: matrix units, not fma chains)")
        if "inputPrecision" in m.group(4):  # ieee is the default and is not printed
            out.append(f"tt.dot with{m.group(4).strip(' ,')}: not ieee (tensor cores)")
        if (m.group(5), m.group(6)) != ("f32", "f32"):
            out.append(f"tt.dot on {m.group(5)} x {m.group(6)}: strict dots take float32 operands (widened first)")
        acc = m.group(3)
        # its definition: the last one before the dot (MLIR reuses a name in sibling regions, e.g. two loops' bodies;
        # the one in scope at the dot is the nearest above it)
        defines = re.findall(rf"^\s*{re.escape(acc)}\s*=\s*(.*)$", ttir[:m.start()], re.M)
        rhs = defines[-1] if defines else ""
        # from zero, or from the dot before it: one K tile's chain split over narrower dots (attention.DOT_K); a chain
        # carried across K tiles this way is caught by the PTX chain lengths (dot_chain_problems)
        if not re.match(r"arith\.constant dense<0\.0+e\+00>|tt\.dot\s", rhs):
            out.append(f"tt.dot with a non-zero accumulator {acc} (= {rhs[:60] or 'block argument'}): "
                       "one fma chain across K tiles")
    return out


@dataclass(frozen=True, eq=False)  # hashed by identity (lru_cache of compiles)
class KernelCase:
    name: str
    fn: object
    signature: dict
    constexprs: dict = field(default_factory=dict)
    strict: bool = True  # False: a deterministic, non-strict kernel (the backward rules)
    #: int arguments that are multiples of 16 in a typical launch (row strides, K): with ``aligned`` they get
    #: the divisibility hint a real launch gives them, as do all pointers (torch allocations are 16-byte aligned)
    divisible: tuple = ()
    num_warps: int | None = None  # the warps the launcher uses, when not Triton's default (4)

    def source(self, aligned: bool = False) -> ASTSource:
        sig = dict(self.signature)
        sig.update({k: "constexpr" for k in self.constexprs})
        attrs = {}
        if aligned:  # what Triton's launcher specializes on (backends/compiler.py: "tt.divisibility", 16)
            names = [n for n, t in self.signature.items() if t.startswith("*")] + list(self.divisible)
            attrs = {(self.fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}
        return ASTSource(self.fn, sig, dict(self.constexprs), attrs)


@functools.lru_cache(maxsize=None)
def compile_case(case: KernelCase, target: str, fp_fusion: bool = False, num_warps: int | None = None,
                 num_stages: int | None = None, aligned: bool = False):
    """The compiled kernel of one case on one target (warps / stages: None keeps the case's / Triton's default; aligned:
    pointers and ``case.divisible`` ints carry the launcher's divisibility-by-16 hint)."""
    options = dict(STRICT_OPTIONS, enable_fp_fusion=fp_fusion)
    num_warps = case.num_warps if num_warps is None else num_warps
    options.update({k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None})
    return triton.compile(case.source(aligned), target=TARGETS[target], options=options)


def run_cases(items, check, targets=tuple(TARGETS), width: int = 28) -> int:
    """Lint each (case, note) of ``items`` on each target with ``check(case, target)`` (its problems), print a
    line each (and its problems); returns the number of failures (the CLI's exit status is ``bool`` of it)."""
    bad = 0
    for case, note in items:
        for target in targets:
            t0 = time.perf_counter()
            problems = check(case, target)
            bad += bool(problems)
            print(f"{'ok' if not problems else 'FAIL':4} {case.name:<{width}} {target}  "
                  f"({time.perf_counter() - t0:.1f} s){note}")
            for pr in problems:
                print(f"     - {pr}")
    return bad


def lint(case: KernelCase, target: str, options_fusion: bool | None = None) -> list[str]:
    """Problems of one kernel on one target (compiled with the launcher's options: STRICT_OPTIONS for a
    strict kernel, Triton's defaults (fusion on) for a non-strict one)."""
    if not case.strict:
        return ptx_problems(compile_case(case, target, True if options_fusion is None else options_fusion).asm["ptx"],
                            strict=False)
    fusion = STRICT_OPTIONS["enable_fp_fusion"] if options_fusion is None else options_fusion
    k = compile_case(case, target, fusion)
    steps = _dot_steps(case) if "tt.dot" in k.asm["ttir"] else None  # an FMA-dot kernel's K lanes
    chains = dot_chain_problems(k.asm["ptx"], steps) if steps else []
    return (ttir_problems(k.asm["ttir"], bool(k.metadata.enable_fp_fusion), case.constexprs.get("FMA_DOT", True))
            + ptx_problems(k.asm["ptx"]) + chains)


def _ptrs(dtype: str, *names: str) -> dict:
    return {n: f"*{dtype}" for n in names}


def _ints(*names: str) -> dict:
    return {n: "i32" for n in names}


def strict_kernels(full: bool = False, npu: bool = False) -> list[KernelCase]:
    """The strict kernels with representative constexprs; full adds every dtype / mode variant; npu: the
    Ascend variant (NPU=True: division / sqrt substitutes, fp16 rounding without tensor shifts)."""
    from ..triton import matmul, rms_norm, softmax, token_logprobs as tlp
    cases = []
    for dt, tdt in ((("bf16", tl.bfloat16),) + ((("fp32", tl.float32), ("fp16", tl.float16)) if full else ())):
        # a linear layer's launch: K contiguous in both operands (Triton specializes a stride of 1)
        mm_sig = {**_ptrs(dt, "a_ptr", "b_ptr", "bias_ptr", "out_ptr"),
                  **_ints("M", "N", "K", "sa_m", "sb_n", "so_m", "so_n", "n_work", "n1")}
        mm = {"HAS_BIAS": True, "KT": 64, "KTP": 64, "OUT_DTYPE": tdt, "NPU": npu, "sa_k": 1, "sb_k": 1}
        # NVIDIA: fp32 ieee dots on 64 x 32 tiles, 4 warps (launch.fma_dot); AMD / Ascend: the explicit chains
        cases.append(KernelCase(f"matmul[{dt}]", matmul._matmul_kernel, mm_sig,
                                {**mm, "BM": 32 if npu else 64, "BN": 64 if npu else 32, "FMA_DOT": not npu},
                                divisible=("K", "sa_m", "sb_n"), num_warps=None if npu else matmul._DOT_WARPS))
        if full and not npu:  # the AMD variant, at the blocks every GPU used before the FMA dots
            cases.append(KernelCase(f"matmul[{dt},hip]", matmul._matmul_kernel, mm_sig,
                                    {**mm, "BM": 64, "BN": 128, "FMA_DOT": False}, divisible=("K", "sa_m", "sb_n")))
        cases.append(KernelCase(
            f"matmul.gemv_partials[{dt}]", matmul._gemv_partials_kernel,
            {**_ptrs(dt, "a_ptr", "b_ptr"), "part_ptr": "*fp32",
             **_ints("M", "N", "K", "n_kt", "sa_m", "sa_k", "sb_k", "sb_n", "n_work", "n1")},
            {"KT": 64, "BM": 16, "BN": 32, "NKT": 8, "NPU": npu}, divisible=("K", "sa_m", "sb_n")))
        if not npu:  # the Ascend variant keeps the element-per-step kernel
            for bm in ((1,) + ((8,) if full else ())):
                cases.append(KernelCase(
                    f"matmul.gemv_vec[{dt},rows={bm}]", matmul._gemv_vec_kernel,
                    {**_ptrs(dt, "a_ptr", "b_ptr"), "part_ptr": "*fp32",
                     **_ints("M", "N", "K", "n_kt", "n_tb", "sa_m", "sb_n", "n_work", "n1")},
                    {"KT": 64, "VEC": 4 if dt == "fp32" else 8, "BM": bm,
                     **({"BN": 32, "NKT": 4} if matmul.GEMV_LANES == "cols" else {"BN": 16, "NKT": 8}),
                     "WORDS": matmul.WORDS_LAYOUT and bm > 1, "COLS_FAST": matmul.GEMV_LANES == "cols",
                     "EVEN": matmul.GEMV_EVEN_K, "NPU": npu},
                    divisible=("K", "sa_m", "sb_n")))
        if full:
            cases.append(KernelCase(
                f"matmul.gemv_combine[{dt}]", matmul._gemv_combine_kernel,
                {"part_ptr": "*fp32", **_ptrs(dt, "bias_ptr", "out_ptr"),
                 **_ints("M", "N", "n_kt", "so_m", "so_n", "n_work", "n1")},
                {"HAS_BIAS": True, "OUT_DTYPE": tdt, "BM": 16, "BN": 128 if matmul.COMBINE_UNROLL == 1 else 32,
                 "UNROLL": matmul.COMBINE_UNROLL, "NPU": npu}))
        cases.append(KernelCase(
            f"rms_norm[{dt},residual]", rms_norm._rms_norm_kernel,
            {**_ptrs(dt, "x_ptr", "r_ptr", "w_ptr", "y_ptr", "h_ptr"), **_ints("R", "H"), "h_float": "fp32",
             "eps": "fp32", "n_tiles": "i32", "n_work": "i32"},
            {"HAS_RES": True, "T": 256, "OUT_DTYPE": tdt, "BR": 8, "NTB": 16, "BH": 128,
             "VEC": 4 if dt == "fp32" else 8, "REG": False, "NPU": npu},
            divisible=("H",)))
        for mode in ((softmax.SOFTMAX,) + ((softmax.LOG_SOFTMAX, softmax.LOGSUMEXP) if full else ())):
            cases.append(KernelCase(
                f"softmax[{dt},mode{mode}]", softmax._softmax_kernel,
                {**_ptrs(dt, "x_ptr", "out_ptr"), **_ints("R", "n", "n_tiles", "n_work")},
                {"MODE": mode, "T": 256, "OUT_DTYPE": tdt, "BR": 4, "NTB": 32,
                 "BC": 128 if dt == "fp32" else 256, "VEC": 4 if dt == "fp32" else 8, "REG": False, "NPU": npu},
                divisible=("n",)))
    # softmax over a few long rows, split across the row (softmax._run_split: GPU blocks of _split_blocks)
    for dt, tdt in ((("bf16", tl.bfloat16),) + ((("fp32", tl.float32),) if full else ())):
        vec, bc = (4, 512) if dt == "fp32" else (8, 1024)
        cases.append(KernelCase(
            f"softmax.split_max[{dt}]", softmax._chunk_max_kernel,
            {**_ptrs(dt, "x_ptr"), "m_ptr": "*fp32", "p_ptr": "*i32", "z_ptr": "*i32",
             **_ints("R", "n", "sx", "n_chunks", "n_work", "n1")},
            {"CH": 2 * bc, "BR": 4 if npu else 1, "BC": 512 if npu else bc, "NPU": npu}, divisible=("n",)))
        cases.append(KernelCase(
            f"softmax.split_sum[{dt}]", softmax.tile_sums_kernel,
            {**_ptrs(dt, "lg_ptr"), **_ptrs("fp32", "shift_ptr", "part_ptr"),
             **_ints("R", "V", "sl", "sp", "n_tiles", "n_work", "n1")},
            {"VT": 256, "VTP": 256, "BR": 4 if npu else 1, "NTB": 1 if npu else 32, "VEC": vec, "ROW_PAD": False,
             "REG": False, "NPU": npu}, divisible=("V", "sl", "sp"), num_warps=None if npu else 1))
        for mode in ((softmax.SOFTMAX,) + ((softmax.LOG_SOFTMAX,) if full else ())):
            cases.append(KernelCase(
                f"softmax.split_out[{dt},mode{mode}]", softmax._split_out_kernel,
                {**_ptrs(dt, "x_ptr", "out_ptr"), **_ptrs("fp32", "shift_ptr"), "empty_ptr": "*i32",
                 "s_ptr": "*fp32", **_ints("R", "n", "n_work", "n1")},
                {"MODE": mode, "OUT_DTYPE": tdt, "CH": 2 * bc, "BR": 4 if npu else 1, "BC": 512 if npu else bc,
                 "NPU": npu}, divisible=("n",)))
        cases.append(KernelCase(
            f"softmax.split_finish[{dt}]", softmax._split_finish_kernel,
            {**_ptrs("fp32", "part_ptr", "shift_ptr"), "empty_ptr": "*i32", "s_ptr": "*fp32", **_ptrs(dt, "out_ptr"),
             **_ints("R", "sp", "n_tiles", "n_work")},
            {"MODE": softmax.LOGSUMEXP, "OUT_DTYPE": tdt, "BR": 4 if npu else 32, "NPU": npu}, divisible=("sp",),
            num_warps=None if npu else 1))
    dt = "bf16"
    lm = {**_ptrs(dt, "h_ptr", "w_ptr")}
    cases.append(KernelCase(
        "token_logprobs.finish", tlp._finish_kernel,
        {"lg_ptr": "*fp32", "tok_ptr": "*i64", **_ptrs("fp32", "shift_ptr"), "empty_ptr": "*i32", "part_ptr": "*fp32",
         "out_ptr": "*fp32", **_ints("R", "sl", "sp", "n_tiles", "n_work")},
        {"BR": 16 if npu else 32, "NPU": npu}, divisible=("sl", "sp"), num_warps=None if npu else 1))
    if full:
        blk = {"HAS_TEMP": True, "KT": 64, "BR": 16 if npu else 8, "NTB": 1, "VT": 256, "VTP": 256, "VEC": 8,
               "WORDS": matmul.WORDS_LAYOUT and not npu, "NPU": npu}
        cases.append(KernelCase(
            "token_logprobs.max", tlp._max_kernel,
            {**lm, "lg_ptr": "*fp32", "m_ptr": "*fp32", "p_ptr": "*i32", "z_ptr": "*i32",
             **_ints("R", "V", "H", "sh", "sw_v", "sl"), "temp": "fp32", "n_chunks": "i32", "n_work": "i32",
             "n1": "i32"}, blk, divisible=("H", "sh", "sw_v", "sl"),
            num_warps=None if npu else tlp.WORDS_WARPS if blk["WORDS"] else 8))
        if not npu:  # row blocks of >= 16 on NVIDIA: the logits as FMA-dot tiles
            cases.append(KernelCase(
                "token_logprobs.max_dot", tlp._max_dot_kernel,
                {**lm, "lg_ptr": "*fp32", "m_ptr": "*fp32", "p_ptr": "*i32", "z_ptr": "*i32",
                 **_ints("R", "V", "H", "sh", "sw_v", "sl"), "temp": "fp32", "n_chunks": "i32", "n_work": "i32",
                 "n1": "i32"}, {"HAS_TEMP": True, "KT": 64, "KTP": 64, "BR": tlp._DOT_TILE[0], "BV": tlp._DOT_TILE[1],
                                "NPU": npu}, divisible=("H", "sh", "sw_v", "sl"), num_warps=tlp._DOT_WARPS))
        cases.append(KernelCase(
            "token_logprobs.stats", softmax.chunk_stats_kernel,
            {"m_ptr": "*fp32", "p_ptr": "*i32", "z_ptr": "*i32", "shift_ptr": "*fp32", "empty_ptr": "*i32",
             **_ints("R", "n_chunks", "n_work")},  # softmax.run_chunk_stats' GPU block for 151,936 / 64 chunks
            {"BR": 16 if npu else 1, "BC": 64 if npu else 1024, "NPU": npu}))
        cases.append(KernelCase(
            "token_logprobs.sum", softmax.tile_sums_kernel,
            {**_ptrs("fp32", "lg_ptr", "shift_ptr", "part_ptr"), **_ints("R", "V", "sl", "sp", "n_tiles", "n_work", "n1")},
            {"VT": 256, "VTP": 256, "BR": 16 if npu else 4, "NTB": 1 if npu else 32, "VEC": 4, "ROW_PAD": True,
             "REG": False, "NPU": npu}, divisible=("sl", "sp")))
    from ..triton import elementwise as ew  # elementwise ops and rotary
    for dt, tdt in ((("bf16", tl.bfloat16),) + ((("fp32", tl.float32), ("fp16", tl.float16)) if full else ())):
        for op in ((ew.SOFTPLUS,) + ((ew.SIGMOID, ew.SILU) if full else ())):
            cases.append(KernelCase(
                f"elementwise[{dt},op{op},silu_mul={op == ew.SILU}]", ew._unary_kernel,
                {**_ptrs(dt, "X", "B", "Y"), **_ints("n", "n_work")},
                {"OP": op, "HAS_B": op == ew.SILU, "OUT": tdt, "BLOCK": ew.BLOCK, "NPU": npu}))
        cases.append(KernelCase(
            f"rotary.apply[{dt}]", ew._rotary_kernel,
            {**_ptrs(dt, "X", "Y"), **_ptrs("fp32", "C", "S"),
             **_ints("n_rows", "D", "half", "d1", "d2", "d3", "c0", "c1", "c2", "c3", "c4", "s0", "s1", "s2", "s3",
                     "s4", "n_work")},
            {"INTERLEAVED": False, "OUT": tdt, "BR": 16, "BH": 64, "NPU": npu}))
    for has_f in ((False,) + ((True,) if full else ())):
        cases.append(KernelCase(
            f"rotary.cos_sin[inv_freq={has_f}]", ew._cos_sin_kernel,
            {"P": "*i64", **_ptrs("fp32", "F", "COS", "SIN"), **_ints("n", "half"), "r_float": "fp32",
             "base32": "fp32", "n_work": "i32"}, {"HAS_F": has_f, "BP": 16, "BH": 64, "NPU": npu}))
    from . import seq_lint_cases  # attention and gated delta rule kernels
    cases += seq_lint_cases.cases(KernelCase, full, npu)
    return cases


def backward_kernels(full: bool = False) -> list[KernelCase]:
    """The deterministic, non-strict kernels (attention backward), linted with the backward rules."""
    from . import seq_lint_cases
    return seq_lint_cases.backward_cases(KernelCase, full)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hal.kernels.checks.lint", description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="every strict kernel and dtype/mode variant")
    p.add_argument("--targets", nargs="*", default=list(TARGETS), choices=list(TARGETS))
    args = p.parse_args(argv)
    cases = strict_kernels(args.full) + backward_kernels(args.full)
    bad = run_cases([(c, "" if c.strict else "  [backward rules]") for c in cases], lint, args.targets)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
