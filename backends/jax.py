"""The jax backend: hal's torch-facing ops computed by hal.jax (JAX/XLA) on the same bits.

Tensors cross by their raw bits (torch -> numpy view -> jax array, and back), never by a float
conversion: XLA:CPU's converts flush subnormals. It serves CPU tensors (and CUDA tensors when jax
has a GPU), is never chosen automatically ahead of ``reference`` (lower priority), and is meant to
be named: ``backend="jax"``, ``hal.use("jax")``, ``hal conformance run --backend jax``.
Ops hal.jax does not implement are not listed, so a named call to them raises UnsupportedError
with the reason instead of computing anything else.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import torch

from hal.backend import FLOAT_DTYPES, LEVELS, Backend
from hal.spec import EXACT, STRICT

_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
           torch.int64: torch.int64, torch.int32: torch.int32}
_JAX_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TORCH_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _probe() -> str | None:
    """Why hal.jax cannot compute the strict bits here (None when it can)."""
    if importlib.util.find_spec("jax") is None:
        return "jax is not installed (pip install 'lockstep[jax]')"
    try:
        from hal.jax import strict_math as sm
    except Exception as e:  # a broken jax install
        return f"importing jax failed: {type(e).__name__}: {e}"
    why = sm.check_environment()
    if why:
        return why
    return sm.self_test()


class JaxBackend(Backend):
    name = "jax"
    priority = -10  # below reference (0) and every native backend: never auto-picked for them
    dtypes = FLOAT_DTYPES
    policies = (STRICT, EXACT)  # exact: matmul / linear and token_logprobs' logits (hal/jax/exact.py)
    description = ("hal.jax on XLA: strict float32 emulated in float64 (exact fma, integer subnormal "
                   "handling); same bits as reference")

    def __init__(self):
        self._why: str | None = None
        self._checked = False

    device_types = ("cpu", "cuda")  # cuda only where jax itself has a GPU (supports() says so)

    def supports(self, op, spec, dtype, device):
        reasons = super().supports(op, spec, dtype, device)
        if not reasons and device.type == "cuda":
            import jax
            if not any(d.platform == "gpu" for d in jax.devices()):
                reasons.append(f"{self.name}: jax has no GPU here (jax devices: {jax.devices()})")
        return reasons

    def unavailable_reason(self):
        if not self._checked:
            self._why = _probe()
            self._checked = True
        return self._why

    def claimed_levels(self, suite, spec):
        return frozenset(LEVELS) if suite in self.suites else frozenset()

    # ---- conversion (bits only)

    @staticmethod
    def _j(t: torch.Tensor):
        import jax.numpy as jnp
        from jax import lax
        ints = t.detach().contiguous().cpu().view(_INT_OF[t.dtype]).numpy()
        if t.dtype in _JAX_NAME:
            return lax.bitcast_convert_type(jnp.asarray(ints), getattr(jnp, _JAX_NAME[t.dtype]))
        return jnp.asarray(ints.astype(np.int32))

    @staticmethod
    def _t(a, device) -> torch.Tensor:
        import jax.numpy as jnp
        from jax import lax
        name = jnp.dtype(a.dtype).name
        dt = _TORCH_OF[name]
        ints = np.asarray(lax.bitcast_convert_type(a, jnp.int32 if dt == torch.float32 else jnp.int16))
        return torch.from_numpy(ints.copy()).view(dt).to(device)

    def _hj(self):
        import hal.jax
        return hal.jax

    # ---- ops. Rows (and matmul columns) are independent in every spec, so the backend pads them to
    # a power of two: fewer distinct shapes, fewer XLA compilations, the same bits for every row.

    def matmul(self, a, b, spec):
        rows = a.reshape(-1, a.shape[-1])
        out = self._hj().matmul(self._j(_pad(rows, 0)), self._j(_pad(b, 1)), spec=spec)
        out = self._t(out, a.device)[: rows.shape[0], : b.shape[1]]
        return out.reshape(*a.shape[:-1], b.shape[1])

    def linear(self, x, weight, bias, spec):
        rows = x.reshape(-1, x.shape[-1])
        jb = None if bias is None else self._j(_pad(bias, 0))
        out = self._hj().linear(self._j(_pad(rows, 0)), self._j(_pad(weight, 0)), jb, spec=spec)
        out = self._t(out, x.device)[: rows.shape[0], : weight.shape[0]]
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x, weight, eps, residual, spec):
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        jr = None if residual is None else self._j(_pad(residual.reshape(-1, x.shape[-1]), 0))
        out = self._hj().rms_norm(self._j(_pad(rows, 0)), self._j(weight), eps, jr, spec=spec)
        if residual is None:
            return self._t(out, x.device)[:n].reshape(x.shape)
        return tuple(self._t(o, x.device)[:n].reshape(x.shape) for o in out)

    def _softmax_family(self, kind, x, spec):
        rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
        out = getattr(self._hj(), kind)(self._j(_pad(rows, 0)), spec=spec)
        out = self._t(out, x.device)[: rows.shape[0]]
        return out.reshape(x.shape[:-1] if kind == "logsumexp" else x.shape)

    def softmax(self, x, spec):
        return self._softmax_family("softmax", x, spec)

    def log_softmax(self, x, spec):
        return self._softmax_family("log_softmax", x, spec)

    def logsumexp(self, x, spec):
        return self._softmax_family("logsumexp", x, spec)

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        n = hidden.shape[0]
        out = self._hj().token_logprobs(self._j(_pad(hidden, 0)), self._j(weight), self._j(_pad(tokens, 0)),
                                        temperature, spec=spec)
        return self._t(out, hidden.device)[:n]

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, spec):
        max_q, max_k = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_q, cu_k))  # the real longest
        out, lse = self._hj().flash_attn_varlen_func(
            self._j(q), self._j(k), self._j(v), self._j(cu_q), self._j(cu_k), max_q, max_k, scale, causal,
            tuple(window), return_lse=True, spec=spec)
        return self._t(out, q.device), self._t(lse, q.device)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, seqlens_k, block_table, scale, causal, window,
                                num_splits, spec):
        max_k = int(seqlens_k.max()) if q.shape[0] else 0
        out, lse = self._hj().flash_attn_with_kvcache(
            self._j(q), self._j(k_cache), self._j(v_cache), self._j(seqlens_k),
            None if block_table is None else self._j(block_table), scale, causal, tuple(window), num_splits,
            return_lse=True, max_seqlen_k=max_k, spec=spec)
        return self._t(out, q.device), self._t(lse, q.device)

    # elementwise: every value is computed alone, so the flattened, padded tensor gives the same bits
    def sigmoid(self, x, spec):
        return self._t(self._hj().sigmoid(self._j(_pad(x.reshape(-1), 0)), spec=spec), x.device)[: x.numel()].reshape(x.shape)

    def silu(self, x, spec):
        return self._t(self._hj().silu(self._j(_pad(x.reshape(-1), 0)), spec=spec), x.device)[: x.numel()].reshape(x.shape)

    def softplus(self, x, spec):
        return self._t(self._hj().softplus(self._j(_pad(x.reshape(-1), 0)), spec=spec), x.device)[: x.numel()].reshape(x.shape)

    def silu_mul(self, a, b, spec):
        out = self._hj().silu_mul(self._j(_pad(a.reshape(-1), 0)), self._j(_pad(b.reshape(-1), 0)), spec=spec)
        return self._t(out, a.device)[: a.numel()].reshape(a.shape)

    def rotary_cos_sin(self, positions, rotary_dim, base, inv_freq, spec):
        c, s = self._hj().rotary_cos_sin(self._j(positions), rotary_dim, base,
                                         None if inv_freq is None else self._j(inv_freq.float()), spec=spec)
        return self._t(c, positions.device), self._t(s, positions.device)

    def apply_rotary(self, x, cos, sin, interleaved, spec):
        out = self._hj().apply_rotary(self._j(x), self._j(cos), self._j(sin), interleaved, spec=spec)
        return self._t(out, x.device)

    def gdn_gating(self, A_log, a, dt_bias, b, spec):
        g, beta = self._hj().gdn_gating(self._j(A_log), self._j(a), self._j(dt_bias), self._j(b), spec=spec)
        return self._t(g, a.device), self._t(beta, a.device)

    def gdn_causal_conv1d(self, x, weight, bias, conv_state, activation, cu_seqlens, spec):
        y, state = self._hj().gdn_causal_conv1d(
            self._j(x), self._j(weight), None if bias is None else self._j(bias),
            None if conv_state is None else self._j(conv_state.to(x.dtype)), activation, cu_seqlens, spec=spec)
        return self._t(y, x.device), self._t(state, x.device)

    # gated delta rule: computed in fixed blocks of sequences x tokens, continuing the exact state
    # between blocks (any split continues exactly, under both specs): one XLA compilation per
    # (spec, dtypes, head layout) instead of one per call shape.
    GDN_SEQS, GDN_TOKENS = 8, 64

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        from hal.kernels.layout import Parts, gdn_from_padded as from_padded, gdn_to_padded as to_padded
        from hal.jax.gated_delta_rule import GatedDeltaRuleState, gated_delta_rule_padded
        dev = v.device
        xs = [to_padded(x, cu_seqlens) for x in (q, k, v, g, beta)]
        n, lmax = xs[0].shape[:2]
        cu = cu_seqlens
        lengths = torch.full((n,), lmax, dtype=torch.int64) if cu is None else \
            torch.tensor([cu[i + 1] - cu[i] for i in range(n)], dtype=torch.int64)
        chunked = spec.variant == "chunked"
        H, dk, HV = q.shape[2], q.shape[3], v.shape[2]
        C = spec.chunk
        # a state without open rows (fresh, or a bare tensor) starts a fresh chunk grid: position 0
        start = state.position if state.open_k is not None else torch.zeros_like(state.position)
        opens = [None] * 4
        if chunked:
            shapes = ((C, H, dk), (C, HV, v.shape[3]), (C, HV), (C, HV))
            opens = [o if o is not None else torch.zeros((n, *sh), dtype=torch.float32)
                     for o, sh in zip((state.open_k, state.open_v, state.open_g, state.open_beta), shapes)]
        nb, tb = self.GDN_SEQS, self.GDN_TOKENS
        o = torch.zeros(xs[2].shape, dtype=v.dtype, device=dev)
        groups = []
        for a in range(0, n, nb):
            rows = slice(a, min(n, a + nb))
            j = lambda t: None if t is None else self._j(_pad_to(t[rows], 0, nb))  # noqa: E731
            st = GatedDeltaRuleState(j(start.to(torch.int32)), j(state.S), *(j(x) for x in opens), None)
            for t0 in range(0, lmax, tb):
                lens = (lengths - t0).clamp(0, tb)
                if not bool((lens[rows] > 0).any()):  # this group's sequences are done
                    break
                blk = [j(_pad_to(x[:, t0:t0 + tb], 1, tb)) for x in xs]
                ob, st = gated_delta_rule_padded(*blk, j(lens.to(torch.int32)), st, scale=float(scale), l2=bool(l2),
                                                 spec=spec, fresh=False)
                got = self._t(ob, dev)
                o[rows, t0:t0 + tb] = got[: rows.stop - a, : min(tb, lmax - t0)]
            groups.append([None if x is None else self._t(x, dev)[: rows.stop - a] for x in st[1:]])
        fields = [None if groups[0][i] is None else torch.cat([gr[i] for gr in groups]) for i in range(6)]
        return from_padded(o, cu), Parts(start + lengths, *fields)

    fused_recurrent_gated_delta_rule = chunk_gated_delta_rule


def _pad_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t with zeros appended along ``dim`` up to ``size``."""
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim)


def _bucket(n: int) -> int:
    from hal.jax._api import bucket
    return bucket(n)


def _pad(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with zeros appended along ``dim`` up to the next power of two (at least 1)."""
    return _pad_to(t, dim, _bucket(t.shape[dim]))

