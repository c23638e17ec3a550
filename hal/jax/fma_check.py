"""Check hal.jax's fma against hal's exact fma (kernels/reference/strict_math.fma_exact, torch).

    python -m hal.jax.fma_check [--random 1000000] [--eager] [--variant strict|xla-convert|no-odd]

prints one JSON line: cases, mismatches, first mismatch. Run it under other XLA_FLAGS (e.g.
``--xla_cpu_max_isa=SSE4_2``) in a fresh process: XLA reads its flags once. The ``variant``s other
than ``strict`` are deliberately wrong (XLA's own converts, which flush subnormals; no round-to-odd
step) and exist to show that the crafted cases catch them.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

F32 = np.float32


def _f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(F32)


def crafted() -> np.ndarray:
    """[n, 3] float32 triples (a, b, c) aimed at the hard cases of a single-rounding fma."""
    rows = []
    ulp = 2.0 ** -23
    m = np.arange(1, 64, dtype=np.float64)
    # 1. double rounding: p = a*b = 2**s * (1 - u*u * 2**-46) with c's half ulp = 2**s, so that
    #    p + c = (c + half ulp) - tiny: float64 rounds it onto the float32 midpoint (ties-to-even then
    #    goes up for an odd c), the exact sum is below it (rounds to c).
    u = np.arange(1, 41, dtype=np.float64)
    for s in (-40, -3, 0, 7, 30):
        for mc in (1, 3, 5, 0x7FFFFF, 0x2AAAAB):
            c = (1 + mc * ulp) * 2.0 ** (s + 24)
            for sa, sc in ((1, 1), (-1, -1), (1, -1), (-1, 1)):
                rows.append(np.stack([sa * (1 + u * ulp) * 2.0 ** s, 1 - u * ulp,
                                      np.full(u.size, sc * c)], 1))
    # 1b. products with bits far below float32's ulp against c at many scales
    a = np.broadcast_to((1 + m[:16, None] * ulp), (16, 16)).reshape(-1)
    b = np.broadcast_to((1 + m[None, :16] * ulp * 3), (16, 16)).reshape(-1)
    for k in list(range(-60, -20, 3)) + list(range(20, 40, 3)):
        for sign in (1.0, -1.0):
            rows.append(np.stack([a, b, np.full(a.size, sign * 2.0 ** k)], 1))
    # 2. exact midpoints: c = -(float32 value) + half ulp patterns
    for h in (0.5, 1.5, -0.5, -1.5):
        rows.append(np.stack([np.ones(m.size), 1 + m * ulp, np.full(m.size, h * ulp)], 1))
        rows.append(np.stack([1 + m * ulp, 1 + m * ulp, np.full(m.size, h * ulp * 2 ** -20)], 1))
    # 3. cancellation: c = -round32(a*b), the exact residual
    rng = np.random.default_rng(1)
    ra, rb = _f32(rng.standard_normal(4096)), _f32(rng.standard_normal(4096))
    rows.append(np.stack([ra, rb, -(ra.astype(np.float64) * rb).astype(F32)], 1))
    # 4. subnormal results, subnormal operands, the normal/subnormal boundary
    sub = (np.arange(1, 200, dtype=np.float64) * 3 + 1) * 2.0 ** -149
    for s in (1.0, -1.0):
        rows.append(np.stack([sub, np.full(sub.size, 0.5 * s), np.zeros(sub.size)], 1))
        rows.append(np.stack([sub, np.full(sub.size, 0.75), np.full(sub.size, s * 2.0 ** -149)], 1))
        rows.append(np.stack([np.full(sub.size, 2.0 ** -70), sub * 2.0 ** 80, np.full(sub.size, s * 2.0 ** -126)], 1))
        rows.append(np.stack([1 + m * ulp, np.full(m.size, 2.0 ** -127), np.full(m.size, s * 2.0 ** -149)], 1))
        rows.append(np.stack([1 + m * ulp, np.full(m.size, s * 2.0 ** -75), np.full(m.size, 2.0 ** -126 * (1 - ulp))], 1))
        rows.append(np.stack([2.0 ** -60 * (1 + m * ulp), np.full(m.size, s * 2.0 ** -66 * 3), -sub[:m.size]], 1))
    # 5. specials: zeros of both signs, inf, NaN, overflow, the largest float32
    big = float(np.finfo(F32).max)
    sp = [0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, big, -big, 2.0 ** -149, -(2.0 ** -149), 2.0 ** 64]
    grid = np.array(np.meshgrid(sp, sp, sp, indexing="ij")).reshape(3, -1).T
    rows.append(grid)
    return _f32(np.concatenate(rows, 0))


def random_triples(n: int, seed: int = 0) -> np.ndarray:
    """Random float32 triples: a third any bit pattern, a third normal values, a third with c close to
    -a*b (long cancellations)."""
    rng = np.random.default_rng(seed)
    k = n // 3
    bits = rng.integers(0, 2 ** 32, (k, 3), dtype=np.uint64).astype(np.uint32).view(F32)
    nrm = _f32(rng.standard_normal((k, 3)) * np.exp2(rng.integers(-70, 70, (k, 3))))
    rest = n - 2 * k
    ab = _f32(rng.standard_normal((rest, 2)))
    c = -_f32(ab[:, 0].astype(np.float64) * ab[:, 1] * (1 + rng.standard_normal(rest) * 2.0 ** -20))
    return np.concatenate([bits, nrm, np.concatenate([ab, c[:, None]], 1)], 0)


def expected(t: np.ndarray) -> np.ndarray:
    """uint32 bits of hal's exact fma (torch), NaN canonical (the strict policy's one NaN)."""
    import torch
    from hal.kernels.reference.strict_math import fma_exact
    x = torch.from_numpy(np.ascontiguousarray(t))
    r = fma_exact(x[:, 0], x[:, 1], x[:, 2]).numpy()
    return np.where(np.isnan(r), np.uint32(0x7FC00000), r.view(np.uint32))


def _variant(name: str):
    import jax.numpy as jnp
    from . import strict_math as sm
    if name == "strict":
        return lambda a, b, c: sm.narrow(sm.fma(sm.widen(a), sm.widen(b), sm.widen(c)))
    if name == "xla-convert":  # XLA's own converts: subnormal inputs and results flushed
        return lambda a, b, c: sm.fma(a.astype(jnp.float64), b.astype(jnp.float64), c.astype(jnp.float64)).astype(jnp.float32)
    if name == "no-odd":  # float64 sum rounded to float32 directly: double rounding
        return lambda a, b, c: sm.narrow(sm.widen(a) * sm.widen(b) + sm.widen(c))
    raise ValueError(name)


def run(t: np.ndarray, eager: bool = False, variant: str = "strict") -> np.ndarray:
    """uint32 bits of hal.jax's fma over the triples (jitted unless eager)."""
    import jax
    import jax.numpy as jnp
    from . import strict_math as sm
    f = _variant(variant)
    with sm.x64():
        args = [jnp.asarray(np.ascontiguousarray(t[:, i])) for i in range(3)]
        if eager:
            with jax.disable_jit():
                out = f(*args)
        else:
            out = jax.jit(f)(*args)
        return np.asarray(out).view(np.uint32)


def compare(t: np.ndarray, got: np.ndarray, want: np.ndarray) -> dict:
    bad = np.nonzero(got != want)[0]
    first = None
    if bad.size:
        i = int(bad[0])
        first = {"a": t[i, 0].view(np.uint32).item(), "b": t[i, 1].view(np.uint32).item(),
                 "c": t[i, 2].view(np.uint32).item(), "want": int(want[i]), "got": int(got[i])}
    return {"cases": int(t.shape[0]), "mismatches": int(bad.size), "first": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hal.jax.fma_check")
    ap.add_argument("--random", type=int, default=0, help="random triples besides the crafted ones")
    ap.add_argument("--no-crafted", action="store_true")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--variant", default="strict", choices=("strict", "xla-convert", "no-odd"))
    args = ap.parse_args(argv)
    parts = [] if args.no_crafted else [crafted()]
    if args.random:
        parts.append(random_triples(args.random))
    t = np.concatenate(parts, 0)
    res = compare(t, run(t, args.eager, args.variant), expected(t))
    import os
    res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    res["variant"], res["eager"] = args.variant, args.eager
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
