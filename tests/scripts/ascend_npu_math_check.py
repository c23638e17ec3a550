"""The strict math on a real Ascend NPU against the reference bits (run by benchmarks/ascend_check.sh).

    python tests/scripts/ascend_npu_math_check.py [--device npu|cuda]

(--device cuda runs the same comparison through community Triton on a GPU: the substitutes compiled
by a real compiler, not the interpreter.)

Runs tests/scripts/triton_math_check.py's kernel on NPU tensors, twice: NPU=True (what the ascend backend
uses: fma/int64 division and sqrt, fp16 rounding without tensor shifts) and NPU=False (triton-ascend's
own div_rn / sqrt_rn), and prints the differing count per function. exp / log differing with NPU=True
would mean the compiler contracts a*b + c into an fma (triton-ascend accepts enable_fp_fusion but its
compiler does not read it; docs/ascend.md). Exit status 1 if the NPU=True side differs anywhere.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import argparse  # noqa: E402

import torch  # noqa: E402

import triton_math_check as mc  # noqa: E402
from hal.kernels.reference import strict_math as ref  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="npu", choices=["npu", "cuda"])
    dev = ap.parse_args().device
    if dev == "npu":
        from hal.backends.ascend import enable_npu
        enable_npu()
    mc.BLOCK = 256  # int64 temporaries of the substitutes: small blocks for the unified buffer
    x = mc.inputs()
    g = torch.Generator().manual_seed(9)
    y = torch.randint(-2 ** 31, 2 ** 31 - 1, x.shape, generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    pos = x.abs()
    dx, dy = mc.div_cases(g)
    want = {"exp": (x, None, mc.canon32(ref.exp(x))), "log": (pos, None, mc.canon32(ref.log(pos))),
            "div": (x, y, mc.canon32(x / y)), "div(subnormal results)": (dx, dy, mc.canon32(dx / dy)),
            "sqrt": (x, None, mc.canon32(torch.sqrt(x.double()).float())),
            "fma": (x, y, mc.canon32(ref.fma_exact(x, y, x))), "bf16": (x, None, mc.rne16_ref(x, torch.bfloat16)),
            "fp16": (x, None, mc.rne16_ref(x, torch.float16))}
    bad = 0
    for npu in (True, False):
        mc.NPU = npu
        for name, (a, b, w) in want.items():
            op = name.split("(")[0]
            got = mc.run(op, a.to(dev), None if b is None else b.to(dev)).cpu()
            diff = int((got != w).sum())
            bad += diff if npu else 0
            print(f"NPU={npu} {name}: {got.numel()} inputs, {diff} differ", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
