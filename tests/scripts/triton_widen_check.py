"""bfloat16 subnormal inputs through the strict Triton kernels == the reference bits (Triton interpreter).

The Triton 3.9 interpreter's bfloat16 -> float32 cast mangles subnormals (0x0016 became 0x00300000);
the kernels widen bfloat16 through its bits (strict_math.widen), exact everywhere. Run by
tests/test_triton_widen.py with TRITON_INTERPRET=1. Prints one line per check; exit 1 on a failure.
1. negative control: a kernel that loads bf16 with the plain cast differs from torch's exact widening
   (so the comparison below would catch the old kernels); the same kernel with ``widen`` does not;
2. matmul and rms_norm on the triton backend with bf16 subnormal inputs == the reference backend's bits.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import hal  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.triton import strict_math as sm  # noqa: E402


@triton.jit
def _load(X, Y, n, WIDEN: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0)
    tl.store(Y + i, sm.widen(x) if WIDEN else x.to(tl.float32), mask=i < n)


def subnormals() -> torch.Tensor:
    """Every positive and negative bfloat16 subnormal (0x0001..0x007F, 0x8001..0x807F)."""
    bits = torch.cat([torch.arange(1, 0x80), torch.arange(0x8001, 0x8080) - 0x10000]).to(torch.int16)
    return bits.view(torch.bfloat16)


def main() -> int:
    bad = 0
    x = subnormals()
    for widen in (False, True):
        y = torch.empty(x.shape, dtype=torch.float32)
        _load[(1,)](x, y, x.numel(), WIDEN=widen, BLOCK=triton.next_power_of_2(x.numel()))
        n_diff = int((y.view(torch.int32) != x.float().view(torch.int32)).sum())
        ok = (n_diff == 0) if widen else (n_diff > 0)
        bad += not ok
        print(f"load bf16 {'widen' if widen else 'plain cast (negative control)'}: {n_diff} of {x.numel()} differ "
              f"from torch's exact widening: {'ok' if ok else 'FAIL'}")
    g = torch.Generator().manual_seed(3)
    a = x[torch.randperm(x.numel(), generator=g)[:96]].reshape(8, 12)
    b = (torch.randn(12, 5, generator=g) * 2.0 ** 100).to(torch.bfloat16)  # products land in the normal range
    w = torch.randn(12, generator=g).to(torch.bfloat16)
    for name, fn in (("matmul", lambda **kw: hal.matmul(a, b, **kw)),
                     ("rms_norm", lambda **kw: hal.rms_norm(a, w, 1e-6, **kw))):
        want, got = fn(backend="reference"), fn(backend="triton")
        d = first_divergence(name, want, got)
        zero = bool((want.float() == 0).all())  # the inputs must reach the output, or the check proves nothing
        bad += d is not None or zero
        print(f"{name}[bf16 subnormal inputs]: {'same bits' if d is None else d}{' (output all zero: FAIL)' if zero else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
