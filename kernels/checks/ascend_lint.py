"""Lint of the strict kernels' Ascend variant: only Triton APIs that triton-ascend documents as
supported (with the dtypes the kernels use) may be reachable when ``NPU=True``.

    python -m hal.kernels.checks.ascend_lint

No compiler is needed (triton-ascend cannot be installed beside community Triton): the lint reads the
kernel sources (AST), follows calls from each persistent kernel into the jit helpers of
kernels/triton, takes the ``NPU=True`` side of every ``if NPU:`` and checks what it reaches:

* every ``tl.*`` / ``tl.math.*`` call is in ``SUPPORTED`` (triton-ascend docs/zh/triton_api, see
  docs/ascend.md for the per-API dtype tables) and not in ``FORBIDDEN``;
* shifts ``<<`` / ``>>`` have a literal right operand (triton-ascend: a tensor shift amount is
  unsupported); tensor methods are ``.to`` only;
* a helper with an ``NPU`` parameter gets ``NPU`` passed on (left at its default, the GPU side, e.g.
  ``div_rn``, would run on Ascend while the lint reads the NPU side).
"""
from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass

#: documented as supported on Atlas A2/A3 (docs/zh/triton_api/<group>/<name>.md), with the dtypes used
SUPPORTED = {
    "program_id": "int32", "num_programs": "int32", "arange": "int32", "zeros": "fp32/int32",
    "zeros_like": "fp32", "full": "fp32/int32", "load": "fp32/bf16/fp16/int32/int64",
    "store": "fp32/bf16/fp16/int32", "where": "fp32/int32/int64/bool", "maximum": "fp32/int32/int64",
    "minimum": "fp32/int32/int64", "max": "fp32/int32", "sum": "int32/int64 only in strict kernels (exact)",
    "fma": "fp32", "sqrt": "fp32 (seed of sqrt_exact only)", "reshape": "fp32/bool (can_reorder=False)",
    "static_range": "-", "range": "-",
    "debug_barrier": "orders a program's stores before its later loads (Compiler_Hint_Ops/debug_barrier.md)",
}
#: reachable on Ascend would break the bits or is not documented for strict use
FORBIDDEN = {
    "div_rn": "rounding of Ascend's division is not documented: use strict_math.div_exact",
    "sqrt_rn": "rounding of Ascend's square root is not documented: use strict_math.sqrt_exact",
    "dot": "cube unit tree sums (and fp32 inputs run as hf32 when allowed): not an fma chain",
    "exp": "not lsm1", "log": "not lsm1", "exp2": "not lsm1", "log2": "not lsm1", "rsqrt": "not correctly rounded",
    "atomic_add": "order-dependent float sums", "atomic_max": "order-dependent", "atomic_min": "order-dependent",
    "atomic_cas": "order-dependent", "atomic_xchg": "order-dependent",
    "floor": "use floor_small (exact)", "cumsum": "scan order is the compiler's", "reduce": "tree order",
    "associative_scan": "tree order", "inline_asm_elementwise": "no asm on Ascend",
}
METHODS = {"to"}


@dataclass
class Problem:
    where: str
    what: str

    def __str__(self):
        return f"{self.where}: {self.what}"


def _modules():
    from ..triton import (attention_kernel, common, elementwise, gated_delta_rule, matmul, rms_norm, softmax,
                          strict_math, token_logprobs)
    return {"common": common, "sm": strict_math, "strict_math": strict_math, "matmul": matmul,
            "rms_norm": rms_norm, "softmax": softmax, "token_logprobs": token_logprobs, "elementwise": elementwise,
            "ew": elementwise, "attention_kernel": attention_kernel, "gated_delta_rule": gated_delta_rule}


def _source_ast(fn) -> ast.FunctionDef:
    src = inspect.getsource(getattr(fn, "fn", fn))
    return ast.parse(inspect.cleandoc("\n" + src) if src.startswith(" ") else src).body[0]


def _resolve(call: ast.expr, module, mods):
    """The jit function a call names (module-local name or sm./common. attribute), else None."""
    if isinstance(call, ast.Name):
        obj = getattr(module, call.id, None)
    elif isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name) and call.value.id in mods:
        obj = getattr(mods[call.value.id], call.attr, None)
    else:
        return None
    return obj if hasattr(obj, "fn") else None


def _tl_name(func: ast.expr) -> str | None:
    """'fma' for tl.fma, 'div_rn' for tl.math.div_rn; None for anything else."""
    if isinstance(func, ast.Attribute):
        v = func.value
        if isinstance(v, ast.Name) and v.id == "tl":
            return func.attr
        if isinstance(v, ast.Attribute) and v.attr == "math" and isinstance(v.value, ast.Name) and v.value.id == "tl":
            return func.attr
    return None


def _npu_test(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "NPU"


def _passes_npu(call: ast.Call, target) -> bool:
    """Whether a call of a jit helper passes NPU on (vacuously true for helpers without an NPU parameter)."""
    params = [a.arg for a in _source_ast(target).args.args]
    if "NPU" not in params:
        return True
    given = [kw.value for kw in call.keywords if kw.arg == "NPU"]
    i = params.index("NPU")
    given += call.args[i:i + 1]
    return any(isinstance(v, ast.Name) and v.id == "NPU" for v in given)


def lint_function(fn, module=None, seen=None) -> list[Problem]:
    """Problems in everything ``fn`` reaches with NPU=True."""
    mods = _modules()
    module = module or sys.modules[getattr(fn, "fn", fn).__module__]
    seen = set() if seen is None else seen
    key = (module.__name__, getattr(fn, "fn", fn).__name__)
    if key in seen:
        return []
    seen.add(key)
    tree = _source_ast(fn)
    name = f"{module.__name__.rsplit('.', 1)[-1]}.{tree.name}"
    problems: list[Problem] = []

    def visit(node):
        if isinstance(node, ast.If) and _npu_test(node.test):
            for n in node.body:  # the NPU=True side only
                visit(n)
            return
        if isinstance(node, ast.Call):
            tl_name = _tl_name(node.func)
            target = _resolve(node.func, module, mods)
            if tl_name is not None:
                if tl_name in FORBIDDEN:
                    problems.append(Problem(f"{name}:{node.lineno}", f"tl.{tl_name}: {FORBIDDEN[tl_name]}"))
                elif tl_name not in SUPPORTED:
                    problems.append(Problem(f"{name}:{node.lineno}", f"tl.{tl_name} is outside the documented subset"))
            elif target is not None:
                if not _passes_npu(node, target):
                    problems.append(Problem(f"{name}:{node.lineno}", f"{ast.unparse(node.func)}(...) without NPU: "
                                                                     "its GPU side would run on Ascend"))
                tmod = sys.modules[target.fn.__module__]
                problems.extend(lint_function(target, tmod, seen))
            elif isinstance(node.func, ast.Attribute) and not (isinstance(node.func.value, ast.Name)
                                                               and node.func.value.id in mods):
                if node.func.attr not in METHODS:
                    problems.append(Problem(f"{name}:{node.lineno}", f"tensor method .{node.func.attr}()"))
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.RShift)):
            if not isinstance(node.right, ast.Constant):
                problems.append(Problem(f"{name}:{node.lineno}",
                                        f"shift by a tensor amount ({ast.unparse(node)}): scalar shifts only"))
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in tree.body:
        visit(stmt)
    return problems


def ascend_kernels() -> list:
    """Every kernel the ascend backend launches (all persistent)."""
    from ..triton import attention_kernel as attn, elementwise as ew, gated_delta_rule as gdn, matmul, rms_norm
    from ..triton import gdn_layer, softmax, token_logprobs as tlp
    return [ew._unary_kernel, ew._cos_sin_kernel, ew._rotary_kernel, matmul._matmul_kernel, matmul._gemv_partials_kernel,
            matmul._gemv_combine_kernel, rms_norm._rms_norm_kernel, softmax._softmax_kernel,
            softmax._chunk_max_kernel, softmax._split_finish_kernel, softmax._split_out_kernel, tlp._max_kernel,
            softmax.chunk_stats_kernel, softmax.tile_sums_kernel, tlp._finish_kernel, attn._attn_kernel, attn._merge_kernel,
            gdn._prep_kernel, gdn._state_copy_kernel, gdn._serial_kernel, gdn._chunked_kernel, gdn_layer._gating_kernel, gdn_layer._conv_kernel]


def lint_all() -> dict[str, list[Problem]]:
    return {k.fn.__name__: lint_function(k) for k in ascend_kernels()}


def main() -> int:
    bad = 0
    for kernel, problems in lint_all().items():
        print(f"{'ok' if not problems else 'FAIL':4} {kernel}")
        for p in problems:
            print(f"     - {p}")
        bad += bool(problems)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
