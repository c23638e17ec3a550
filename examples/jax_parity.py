"""A JAX trainer and a torch sampler that compute the same token log-prob bits.

    python -m examples.jax_parity                 # bf16 weights and activations
    python -m examples.jax_parity --dtype fp32

A tiny decoder-style model (embedding, two pre-norm MLP blocks with residuals, final norm, LM
head) is written twice from the same weights:

* **sampler** (torch): lockstep's torch ops (``hal.rms_norm``, ``hal.linear``,
  ``hal.token_logprobs``) on the reference backend, as an inference engine would call them;
* **trainer** (JAX): the same forward with ``hal.jax``'s functions on ``jax.Array``s, under
  ``jax.jit``, and ``jax.grad`` of the mean negative log-prob (what a JAX trainer needs).

It prints whether the two log-prob vectors have equal raw bits, and the same comparison for the
stock versions (``jax.numpy`` vs ``torch``), which differ. Exit status 1 if lockstep's bits
differ or the stock bits do not (the negative control must be caught).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import hal
from hal.conformance import inputs as gen
from hal.conformance.bits import first_divergence

V, H, FF, N_LAYERS, T = 512, 64, 128, 2, 24
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_weights(dtype):
    w = {"embed": gen.randn("jp.embed", (V, H), dtype), "final_norm": gen.rand("jp.fn", (H,), dtype, 0.5, 1.5),
         "lm_head": gen.randn("jp.lm", (V, H), dtype, scale=H ** -0.5)}
    for i in range(N_LAYERS):
        w[f"norm{i}"] = gen.rand(f"jp.n{i}", (H,), dtype, 0.5, 1.5)
        w[f"up{i}"] = gen.randn(f"jp.up{i}", (FF, H), dtype, scale=H ** -0.5)
        w[f"down{i}"] = gen.randn(f"jp.down{i}", (H, FF), dtype, scale=FF ** -0.5)
    return w


# ---------------------------------------------------------------- the model, twice


def forward(w, tokens, ops):
    """The model, for torch tensors or jax arrays alike; ops: rms_norm, linear, relu, token_logprobs."""
    h = w["embed"][tokens[:-1]]
    x, res = ops.rms_norm(h, w["norm0"]), h
    for i in range(N_LAYERS):
        m = ops.linear(ops.relu(ops.linear(x, w[f"up{i}"])), w[f"down{i}"])
        nxt = w[f"norm{i + 1}"] if i + 1 < N_LAYERS else w["final_norm"]
        x, res = ops.rms_norm(m, nxt, residual=res)  # res <- m + res, x <- norm(res)
    return ops.token_logprobs(x, w["lm_head"], tokens[1:])


class LockstepTorch:
    """The sampler's ops: lockstep on torch (reference backend: the golden bits)."""
    def rms_norm(self, x, w, residual=None):
        return hal.rms_norm(x, w, 1e-6, residual=residual, backend="reference")

    def linear(self, x, w):
        return hal.linear(x, w, backend="reference")

    def relu(self, x):  # a select: exact, and the same for -0.0 and NaN on both sides
        return torch.where(x > 0, x, torch.zeros((), dtype=x.dtype))

    def token_logprobs(self, x, w, t):
        return hal.token_logprobs(x, w, t, backend="reference")


class StockTorch:
    def rms_norm(self, x, w, residual=None):
        h = x if residual is None else x + residual
        y = torch.nn.functional.rms_norm(h, (h.shape[-1],), w, 1e-6)
        return y if residual is None else (y, h)

    def linear(self, x, w):
        return torch.nn.functional.linear(x, w)

    def relu(self, x):
        return torch.relu(x)

    def token_logprobs(self, x, w, t):
        lp = torch.log_softmax(x.float() @ w.float().T, -1)
        return lp.gather(-1, t[:, None]).squeeze(-1)


def _jax_ops(strict: bool):
    import jax
    import jax.numpy as jnp
    import hal.jax as hj

    class LockstepJax:
        def rms_norm(self, x, w, residual=None):
            return hj.rms_norm(x, w, 1e-6, residual=residual)

        def linear(self, x, w):
            return hj.linear(x, w)

        def relu(self, x):
            # The torch side's select, decided on the bits: XLA:CPU compares with denormals-are-zero,
            # so `x > 0` is False for a positive subnormal. 0 < bits <= +inf is "x > 0".
            ib = jnp.int32 if x.dtype == jnp.float32 else jnp.int16
            inf = 0x7F800000 if x.dtype == jnp.float32 else 0x7F80
            b = jax.lax.bitcast_convert_type(x, ib)
            return jnp.where((b > 0) & (b <= inf), x, jnp.zeros((), x.dtype))

        def token_logprobs(self, x, w, t):
            return hj.token_logprobs(x, w, t)

    class StockJax:
        def rms_norm(self, x, w, residual=None):
            h = x if residual is None else x + residual
            h32 = h.astype(jnp.float32)
            y = (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6) * w.astype(jnp.float32))
            y = y.astype(h.dtype)
            return y if residual is None else (y, h)

        def linear(self, x, w):
            return x @ w.T

        def relu(self, x):
            return jax.nn.relu(x)

        def token_logprobs(self, x, w, t):
            lp = jax.nn.log_softmax(x.astype(jnp.float32) @ w.astype(jnp.float32).T, -1)
            return jnp.take_along_axis(lp, t[:, None], -1)[:, 0]

    return LockstepJax() if strict else StockJax()


# ---------------------------------------------------------------- torch <-> jax by bits


def to_jax(t: torch.Tensor):
    import jax.numpy as jnp
    from jax import lax
    if not t.is_floating_point():
        return jnp.asarray(t.numpy().astype(np.int32))
    ints = t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy()
    return lax.bitcast_convert_type(jnp.asarray(ints), jnp.float32 if t.dtype == torch.float32 else jnp.bfloat16)


def from_jax(a) -> torch.Tensor:
    import jax.numpy as jnp
    from jax import lax
    return torch.from_numpy(np.asarray(lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)).copy()).view(torch.float32)


def run(dtype_name: str = "bf16", verbose: bool = True) -> dict:
    import jax
    dtype = DTYPES[dtype_name]
    w = make_weights(dtype)
    tokens = gen.randint("jp.tokens", (T + 1,), V)
    wj = {k: to_jax(v) for k, v in w.items()}
    tj = to_jax(tokens)
    results = {}
    for label, strict in (("lockstep", True), ("stock", False)):
        sampler = forward(w, tokens, LockstepTorch() if strict else StockTorch())
        jops = _jax_ops(strict)
        trainer = from_jax(jax.jit(lambda ww, tt: forward(ww, tt, jops))(wj, tj))
        div = first_divergence(f"{label}: trainer (jax) vs sampler (torch)", sampler, trainer)
        diff = (trainer.double() - sampler.double()).abs().max().item()
        results[label] = {"bitwise_equal": div is None, "max_abs_diff": diff, "divergence": div}
        if verbose:
            print(f"{label:9s} trainer (JAX) vs sampler (torch) token log-probs [{T}]: "
                  f"{'bitwise EQUAL' if div is None else 'DIFFER'}; max |diff| {diff:.3e}")
            if div is not None:
                print(f"          first divergence: {div}")
    # the trainer also differentiates through hal.jax (custom_vjp with float32 backward math)
    jops = _jax_ops(True)
    loss = lambda ww: -forward(ww, tj, jops).mean()  # noqa: E731
    g = jax.jit(jax.grad(loss))(wj)
    gnorm = float(sum(float((x.astype("float32") ** 2).sum()) for x in jax.tree_util.tree_leaves(g)) ** 0.5)
    results["grad_norm"] = gnorm
    if verbose:
        print(f"jax.grad of the mean NLL through hal.jax: gradient norm {gnorm:.4f} (finite: {np.isfinite(gnorm)})")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.jax_parity")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = ap.parse_args(argv)
    r = run(args.dtype)
    ok = r["lockstep"]["bitwise_equal"] and not r["stock"]["bitwise_equal"] and np.isfinite(r["grad_norm"])
    print("OK: lockstep equal, stock caught" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
