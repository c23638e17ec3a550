"""A deliberately wrong Triton backend for the conformance negative control (run under TRITON_INTERPRET=1).

``triton-treesum`` is the triton backend except that softmax / log_softmax / logsumexp sum exp(x - M)
with ``tl.sum`` (a tree: numpy pairwise in the interpreter, shuffles on the GPU) instead of the spec's
tiled sequential order. Everything else (lsm1 exp/log, max, rounding, canonical NaN) is the real code,
so only the summation order differs, and the conformance suite must see it (L4 against the goldens).

    TRITON_INTERPRET=1 python tests/scripts/triton_negative_backend.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import hal  # noqa: E402
from hal.backends.triton import TritonBackend  # noqa: E402
from hal.kernels.triton import common, strict_math as sm  # noqa: E402
from hal.kernels.triton.dtypes import tl_dtype  # noqa: E402
from hal.kernels.triton.launch import launch  # noqa: E402


@triton.jit
def _treesum_kernel(x_ptr, out_ptr, R, n, MODE: tl.constexpr, OUT_DTYPE: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BC)
    ok = (rows < R)[:, None] & (cols < n)[None, :]
    offs = rows.to(tl.int64)[:, None] * n + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    m, bad, pz = common.row_max(x, ok)
    m = common.finish_max(m, bad, pz)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    shifted = x - m_safe[:, None]
    s = tl.sum(tl.where(ok, sm.exp(shifted), 0.0), axis=1)  # WRONG on purpose: a tree, not the spec's order
    if MODE == 2:
        out = tl.where(empty, float("-inf"), m_safe + sm.log(s))
        tl.store(out_ptr + rows, sm.round_out(out, OUT_DTYPE), mask=rows < R)
    else:
        if MODE == 1:
            out = tl.where(empty[:, None], float("-inf"), shifted - sm.log(s)[:, None])
        else:
            out = tl.where(empty[:, None], 0.0, sm.div(sm.exp(shifted), s[:, None]))
        tl.store(out_ptr + offs, sm.round_out(out, OUT_DTYPE), mask=ok)


def _run(x, mode):
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty((x2.shape[0],) if mode == 2 else x2.shape, dtype=x.dtype)
    launch(_treesum_kernel, (1,), x2, out, x2.shape[0], n, MODE=mode, OUT_DTYPE=tl_dtype(x.dtype),
           BR=triton.next_power_of_2(x2.shape[0]), BC=triton.next_power_of_2(n))
    return out.reshape(x.shape[:-1] if mode == 2 else x.shape)


class TreeSumBackend(TritonBackend):
    name = "triton-treesum"

    def softmax(self, x, spec):
        return _run(x, 0)

    def log_softmax(self, x, spec):
        return _run(x, 1)

    def logsumexp(self, x, spec):
        return _run(x, 2)


if __name__ == "__main__":
    from hal.conformance import runner
    hal.register_backend(TreeSumBackend())
    records = runner.run(["triton-treesum"], ["softmax"], device="cpu", quick=True)
    with open(sys.argv[1], "w") as f:
        json.dump([r.to_dict() for r in records], f)
    sys.exit(runner.exit_status(records))
