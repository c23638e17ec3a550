"""Triton elementwise / rotary kernels == the reference, bit for bit (run under TRITON_INTERPRET=1).

Run by tests/test_triton_elementwise.py in a subprocess (Triton decides interpreter or compiler when a
kernel module is imported). Usage: python tests/scripts/triton_elementwise_check.py [--npu]; prints
"CHECK: ok ..." / "CHECK: FAIL ..." lines, exits 1 on any differing bit. --npu: the Ascend variant.
Negative controls: torch's own sigmoid / silu / softplus, an HF-style rotation (x * cos and rotated * sin
rounded separately) and torch's cos / sin tables must be seen to differ by the same comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from hal.conformance.bits import first_divergence  # noqa: E402
from hal.conformance.suites.elementwise import edge_values  # noqa: E402
from hal.kernels.reference import elementwise as ref  # noqa: E402
from hal.kernels.triton import ascend_launch, elementwise as tri  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FAILED = []


def _same(label, expected, got):
    d = first_divergence(label, expected, got)
    FAILED.extend([label] if d else [])
    print(f"{label}: FAIL {d}" if d else f"{label}: ok", flush=True)


def _differs(label, expected, got):
    caught = first_divergence(label, expected, got) is not None
    FAILED.extend([] if caught else [label])
    print(f"{label}: ok (wrong variant caught)" if caught else f"{label}: FAIL (wrong variant NOT caught)", flush=True)


def _values(dtype, n, seed):
    """Edge values (NaN payload, +-inf, +-0, subnormals, +-88, +-100, max) at the start and in the tail."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 6).to(dtype)
    e = edge_values(dtype)
    x[: e.numel()] = e
    x[-e.numel():] = e.flip(0)
    return x


def elementwise():
    for dt in DTYPES:
        x, b = _values(dt, 1500, 1), _values(dt, 1500, 2).roll(7)  # 1500: a full 1024 block and a short tail
        for op in ("sigmoid", "silu", "softplus"):
            _same(f"{op}[{dt}]", getattr(ref, op)(x), getattr(tri, op)(x))
        _same(f"silu_mul[{dt}]", ref.silu_mul(x, b), tri.silu_mul(x, b))
        xt = x[:1496].reshape(22, 68).t()  # a non-contiguous view
        _same(f"silu[{dt},transposed]", ref.silu(xt), tri.silu(xt))
    # the GDN conv1d's activation is the same silu: silu(-inf) = -0.0 there too (it was NaN before)
    from hal.kernels.reference import gdn_layer as ref_layer
    from hal.kernels.triton import gdn_layer as tri_layer
    xc = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(5))
    xc[0, 2, 1] = float("-inf")
    wc = torch.rand(4, 3, generator=torch.Generator().manual_seed(6)) + 0.1
    _same("gdn_causal_conv1d[silu(-inf)]", ref_layer.causal_conv1d(xc, wc, None, None, "silu", None)[0],
          tri_layer.causal_conv1d(xc, wc, None, None, "silu", None)[0])
    x = _values(torch.float32, 1500, 3)
    _differs("negative:torch.sigmoid", tri.sigmoid(x), ref.canonical_nan(torch.sigmoid(x)))
    _differs("negative:torch.softplus", tri.softplus(x), ref.canonical_nan(torch.nn.functional.softplus(x)))


def rotary():
    g = torch.Generator().manual_seed(4)
    pos = torch.cat([torch.tensor([0, 1, -1, 2 ** 24 - 1, -(2 ** 24 - 1), 2 ** 23 + 1, 1000003]),
                     torch.randint(-2 ** 24 + 1, 2 ** 24, (38,), generator=g)]).reshape(3, 15)
    for r, base in ((64, 10000.0), (6, 500000.0), (200, 1e6)):  # R/2 = 100 crosses the 64-wide blocks
        c, s = ref.rotary_cos_sin(pos, r, base, None)
        tc, ts = tri.rotary_cos_sin(pos.to(torch.int32), r, base, None)
        _same(f"rotary_cos_sin[R={r},base={base:g}]", torch.stack([c, s]), torch.stack([tc, ts]))
    f = torch.rand(48, generator=g)
    c, s = ref.rotary_cos_sin(pos, 96, 1.0, f)
    _same("rotary_cos_sin[inv_freq]", torch.stack([c, s]), torch.stack(tri.rotary_cos_sin(pos, 96, 1.0, f)))
    ang = pos.float()[..., None] * ref.inv_freq(64, 10000.0)
    _differs("negative:torch.cos/sin tables", torch.stack(tri.rotary_cos_sin(pos, 64, 10000.0, None)),
             torch.stack([torch.cos(ang), torch.sin(ang)]))
    c, s = ref.rotary_cos_sin(torch.arange(9) + 5, 40, 10000.0, None)
    for dt in DTYPES:
        for inter in (False, True):
            x = (torch.randn(9, 3, 88, generator=g) * 2).to(dt)  # D = 88 > R = 40: pass-through dims
            x.view(-1)[:31] = edge_values(dt)
            args = (c[:, None, :], s[:, None, :], inter)
            _same(f"apply_rotary[{dt},interleaved={inter}]", ref.apply_rotary(x, *args), tri.apply_rotary(x, *args))
        # table in another dtype, x a [H, T, D] view, and six leading dims (the materialised-table path)
        xv = x.transpose(0, 1)
        args = (c[None].to(torch.bfloat16), s[None].to(torch.bfloat16), False)
        _same(f"apply_rotary[{dt},view,bf16 table]", ref.apply_rotary(xv, *args), tri.apply_rotary(xv, *args))
        x6 = x.reshape(1, 3, 3, 1, 1, 3, 88)
        args = (c.reshape(1, 3, 3, 1, 1, 1, 20), s.reshape(1, 3, 3, 1, 1, 1, 20), True)
        _same(f"apply_rotary[{dt},6 leading dims]", ref.apply_rotary(x6, *args), tri.apply_rotary(x6, *args))
    x = (torch.randn(9, 3, 40, generator=g)).to(torch.bfloat16)
    x1, x2 = x[..., :20].float(), x[..., 20:].float()
    cb, sb = c[:, None, :], s[:, None, :]
    hf = torch.cat([(x1 * cb).to(torch.bfloat16) - (x2 * sb).to(torch.bfloat16),
                    (x2 * cb).to(torch.bfloat16) + (x1 * sb).to(torch.bfloat16)], -1)  # HF rotate_half: 2 roundings
    _differs("negative:HF rotate_half", tri.apply_rotary(x, cb, sb, False), hf)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--npu", action="store_true", help="the Ascend variant (persistent grid, NPU substitutes)")
    args = ap.parse_args()
    with ascend_launch.variant("cpu") if args.npu else contextlib.nullcontext():
        elementwise()
        rotary()
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
