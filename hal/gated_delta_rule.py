"""Gated delta rule (Gated DeltaNet) ops with FLA-compatible signatures, and their recurrent state.

    o, st = hal.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state="state",
                                       use_qk_l2norm_in_kernel=True)        # prefill (any length)
    o1, st = hal.fused_recurrent_gated_delta_rule(q1, k1, v1, g1, b1, initial_state=st,
                                                  output_final_state=True)  # decode: exact continuation

Both ops compute the bits of one spec (``spec=`` or the default ``GatedDeltaRuleSpec``): the
trainer may call ``chunk_*`` and the sampler ``fused_recurrent_*`` and they agree bit for bit.

``initial_state`` is either
* a :class:`GatedDeltaRuleState` (what ``output_final_state="state"`` returns, and what a call
  given a state returns with ``output_final_state=True``): continuing from it is exact at ANY
  split point; or
* a bare FLA-style float32 tensor ``[N, HV, d_k, d_v]`` (what ``output_final_state=True``
  returns otherwise): a state at a chunk boundary, at the start of a fresh chunk grid. Under the
  ``chunked`` spec continuing from it is exact only when the split falls on a multiple of the
  chunk size (64); under ``serial`` at any split.

``g`` is the log of the decay. ``g > 0`` is allowed (the state grows; nothing checks it, since
that would be a data-dependent test); NaN or inf in a sequence's inputs propagate by IEEE rules
into that sequence's outputs and state only.
"""
from __future__ import annotations

import torch

from . import dispatch, spec as specs, validate as val
from .errors import InputError, UnsupportedError
from .op_call import needs_grad
from .ops_registry import OPS, TORCH_OP, route, routing
from .torch_ops import HelperOp, OpBackward, OpRecord, TorchOp, fake_grads, register

__all__ = ["GatedDeltaRuleState", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

F32, F64 = torch.float32, torch.float64


def _parts_type():
    from hal.kernels.layout import Parts
    return Parts


class GatedDeltaRuleState:
    """The exact recurrent state of N sequences under one gated delta rule spec.

    Fields: ``spec_id``; ``layout`` = (H, HV, d_k, d_v); ``position`` int64 [N] (tokens consumed);
    ``parts`` (the backend's view: the materialised float32 state ``S`` -- after the last token for
    ``serial``, at the last chunk boundary for ``chunked`` -- the unfinished chunk's rows for
    ``chunked``, and ``final``). ``final_state`` is the FLA tensor [N, HV, d_k, d_v]: the state after
    the last token. Treat it as immutable: every op returns a new state and leaves its input as it was.
    """

    def __init__(self, spec_id: str, layout: tuple[int, int, int, int], parts):
        self.spec_id = spec_id
        self.layout = tuple(int(x) for x in layout)
        self.parts = parts

    @property
    def batch_size(self) -> int:
        return int(self.parts.position.shape[0])

    @property
    def position(self) -> torch.Tensor:
        return self.parts.position

    @property
    def final_state(self) -> torch.Tensor:
        return self.parts.final if self.parts.final is not None else self.parts.S

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.S.dtype

    def _map(self, fn):
        P = type(self.parts)
        return GatedDeltaRuleState(self.spec_id, self.layout,
                                   P(*(None if x is None else fn(x) for x in self.parts)))

    def select(self, index) -> "GatedDeltaRuleState":
        """The states of some sequences (``index``: int, slice, list or index tensor), in that order."""
        n = self.batch_size
        if isinstance(index, bool):
            raise InputError(f"state.select: index must be an int, slice, list or index tensor, got {index!r}")
        if isinstance(index, int):
            index = [index]
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        if isinstance(index, torch.Tensor):
            if index.dtype not in (torch.int32, torch.int64) or index.dim() > 1:
                raise InputError(f"state.select: index must be a 1-D int tensor, got {index.dtype} "
                                 f"{tuple(index.shape)}")
            bad = index.reshape(-1)[(index.reshape(-1) < -n) | (index.reshape(-1) >= n)]
            if bad.numel():
                raise InputError(f"state.select: index {int(bad[0])} out of range for a state of {n} sequences")
            index = index.reshape(-1).to(torch.long)
        elif not isinstance(index, slice):
            raise InputError(f"state.select: index must be an int, slice, list or index tensor, got "
                             f"{type(index).__name__}")
        return self._map(lambda x: x[index])

    def clone(self) -> "GatedDeltaRuleState":
        return self._map(lambda x: x.clone())

    @staticmethod
    def cat(states: list["GatedDeltaRuleState"]) -> "GatedDeltaRuleState":
        """One state holding the sequences of ``states`` in order (same spec and layout)."""
        if not states:
            raise InputError("GatedDeltaRuleState.cat needs at least one state")
        first = states[0]
        for s in states[1:]:
            if s.spec_id != first.spec_id or s.layout != first.layout or s.dtype != first.dtype:
                raise InputError(f"cannot concatenate states of {s.spec_id} {s.layout} and {first.spec_id} "
                                 f"{first.layout}: spec, head layout and dtype must match")
        P = type(first.parts)
        fields = []
        for i, name in enumerate(P._fields):
            vals = [s.parts[i] for s in states]
            if name == "final":
                vals = [s.final_state for s in states]
            elif any(v is None for v in vals):
                like = next((v for v in vals if v is not None), None)
                if like is None:
                    fields.append(None)
                    continue
                # a state without open rows (fresh, or from a bare tensor) has none: zero rows
                vals = [v if v is not None else like.new_zeros((s.batch_size, *like.shape[1:]))
                        for v, s in zip(vals, states)]
            fields.append(torch.cat(vals))
        return GatedDeltaRuleState(first.spec_id, first.layout, P(*fields))

    def __repr__(self):
        return (f"GatedDeltaRuleState({self.spec_id}, sequences={self.batch_size}, layout(H, HV, dk, dv)="
                f"{self.layout}, position={self.position.tolist()})")


# ---------------------------------------------------------------- validation


def _check_inputs(q, k, v, g, beta):
    for name, t in (("q", q), ("k", k), ("v", v)):
        val.tensor(name, t, ndim=4)
        val.floating(name, t)
    for name, t in (("g", g), ("beta", beta)):
        val.tensor(name, t, ndim=3)
        val.floating(name, t)
    dtype = val.same_dtype(q=q, k=k, v=v)
    if tuple(k.shape) != tuple(q.shape):
        raise InputError(f"k shape {tuple(k.shape)} must equal q shape {tuple(q.shape)} ([B, T, H, d_k])")
    B, T, H, dk = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise InputError(f"v shape {tuple(v.shape)} must be [B, T, HV, d_v] with B, T = {B}, {T} as in q")
    HV = v.shape[2]
    if H < 1 or HV < 1:
        raise InputError(f"head counts must be >= 1: q/k heads H = {H} (q.shape[2]), value heads HV = {HV} "
                         "(v.shape[2])")
    if HV % H:
        raise InputError(f"value heads HV = {HV} must be a multiple of q/k heads H = {H} (GVA: value head j reads "
                         f"q/k head j // (HV/H))")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            raise InputError(f"{name} shape {tuple(t.shape)} must be [B, T, HV] = {(B, T, HV)} (one value per "
                             f"token and value head)")
        if (t.dtype == F64) != (dtype == F64):
            raise InputError(f"{name} is {t.dtype} but q/k/v are {dtype}: float64 runs the oracle and needs "
                             f"float64 everywhere; otherwise pass float32/bfloat16/float16")
    if dk == 0 or v.shape[3] == 0:
        raise InputError("head dims d_k and d_v must be >= 1")
    return dtype, (H, HV, dk, v.shape[3])


def _start_parts(initial_state, layout, n, dtype, device, s):
    """The incoming state as kernel Parts, after every check."""
    P = _parts_type()
    H, HV, dk, dv = layout
    sdtype = F64 if dtype == F64 else F32
    if initial_state is None or isinstance(initial_state, torch.Tensor):
        if initial_state is None:
            S = torch.zeros((n, HV, dk, dv), dtype=sdtype, device=device)
        else:
            S = initial_state
            if tuple(S.shape) != (n, HV, dk, dv):
                raise InputError(f"initial_state shape {tuple(S.shape)} must be [N, HV, d_k, d_v] = {(n, HV, dk, dv)}")
            if S.dtype != sdtype:
                raise InputError(f"initial_state must be {sdtype} (the state is kept in {sdtype}), got {S.dtype}")
            if S.device != device:
                raise InputError(f"initial_state is on {S.device}, inputs on {device}")
        return P(torch.zeros(n, dtype=torch.int64), S, None, None, None, None, S)
    _check_initial_state(initial_state)
    st = initial_state
    if st.spec_id != s.id:
        raise InputError(f"initial_state was made under spec {st.spec_id} but this call uses {s.id}; a state "
                         f"continues only under the spec that made it (pass spec={st.spec_id!r})")
    if st.layout != tuple(layout):
        raise InputError(f"initial_state has head layout (H, HV, d_k, d_v) = {st.layout}, "
                         f"this call has {tuple(layout)}")
    if st.batch_size != n:
        raise InputError(f"initial_state holds {st.batch_size} sequences, this call has {n} "
                         f"(use state.select(...) / GatedDeltaRuleState.cat(...) to match)")
    if st.dtype != sdtype:
        raise InputError(f"initial_state is {st.dtype}; with {dtype} inputs the state must be {sdtype}")
    if st.parts.S.device != device:
        raise InputError(f"initial_state is on {st.parts.S.device}, inputs on {device}")
    return st.parts


# ---------------------------------------------------------------- autograd


class _GDNFn(torch.autograd.Function):
    """Forward: the backend's bits. Backward (every backend): autograd through a chunked torch
    recompute in float32 (float64 for float64 inputs) -- correct and deterministic (hal/gdn_backward.py);
    its chunk-state scan runs in the backend's kernels when it offers them (``gdn_state_scan``: triton)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, op, impl, s, scale, parts, cu, l2, box):
        o, new = getattr(impl, op)(q, k, v, g, beta, scale, parts, cu, l2, s, True)
        box.append(new)
        ctx.save_for_backward(q, k, v, g, beta, S0)
        ctx.meta = (scale, parts, cu, l2)
        ctx.impl = impl
        return o, new.final

    @staticmethod
    def backward(ctx, do, dfinal):
        from .gdn_backward import grads
        q, k, v, g, beta, S0 = ctx.saved_tensors
        scale, parts, cu, l2 = ctx.meta
        out = grads((q, k, v, g, beta), S0, parts, scale, cu, l2, do, dfinal, ctx.impl)
        return (*out, None, None, None, None, None, None, None, None)


# ---------------------------------------------------------------- the two public ops


_FINAL_STATES = (False, True, "state")


def _check_final_state(output_final_state):
    if output_final_state not in _FINAL_STATES:
        raise InputError(f"output_final_state must be False, True (FLA tensor) or 'state' (exact state object), "
                         f"got {output_final_state!r}")


def _check_initial_state(initial_state):
    if not (initial_state is None or isinstance(initial_state, (torch.Tensor, GatedDeltaRuleState))):
        raise InputError(f"initial_state must be None, a float32 tensor [N, HV, d_k, d_v] or a GatedDeltaRuleState, "
                         f"got {type(initial_state).__name__}")


def _plan(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
          spec, backend):
    """Every check of a gated delta rule call, then its choices: (spec, backend, incoming Parts, cu list,
    float32 scale, layout). Shared by the forward and the backward torch op's kernel."""
    dtype, layout = _check_inputs(q, k, v, g, beta)
    cu = val.packed_offsets(cu_seqlens, q)
    n = q.shape[0] if cu is None else len(cu) - 1
    _check_final_state(output_final_state)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise InputError(f"use_qk_l2norm_in_kernel must be a bool, got {use_qk_l2norm_in_kernel!r}")
    dk = layout[2]
    scale = dk ** -0.5 if scale is None else val.scalar("scale", scale, positive=True)
    scale = float(torch.tensor(scale, dtype=F32))  # the spec's scale is a float32 number
    s = dispatch.call_spec(op, spec)  # no spec: the policy switch's (hal.use(policy=...))
    device = dispatch.common_device(dict(q=q, k=k, v=v, g=g, beta=beta))
    parts = _start_parts(initial_state, layout, n, dtype, device, s)
    impl = dispatch.select(op, s, dtype, device, backend)
    return s, impl, parts, cu, scale, layout


def _gdn(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
         spec, backend):
    if beta is None:
        val.tensor("g", g)
        beta = torch.ones(tuple(g.shape), dtype=g.dtype, device=g.device)
    if routing(op, q, k, v, g, beta, cu_seqlens) is TORCH_OP:
        return _routed_gdn(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           use_qk_l2norm_in_kernel, spec, backend)
    s, impl, parts, cu, scale, layout = _plan(op, q, k, v, g, beta, scale, initial_state, output_final_state,
                                              cu_seqlens, use_qk_l2norm_in_kernel, spec, backend)
    as_state = output_final_state == "state" or (output_final_state is True and
                                                 isinstance(initial_state, GatedDeltaRuleState))
    # Nothing to do (no token, or no sequence: batch 0): o is empty, the state unchanged (a copy: the
    # caller's tensors stay theirs; [0, HV, d_k, d_v] for batch 0). Decided here, before any backend,
    # so every backend gives the same answer.
    if q.shape[0] == 0 or q.shape[1] == 0:
        o = v.new_zeros(v.shape)
        parts = type(parts)(*(None if x is None else x.clone() for x in parts))
        final = GatedDeltaRuleState(s.id, layout, parts) if as_state else \
            (parts.final if parts.final is not None else parts.S) if output_final_state else None
        return o, final
    bare = initial_state if isinstance(initial_state, torch.Tensor) else None
    if needs_grad(q, k, v, g, beta, bare):
        box: list = []
        o, fin = _GDNFn.apply(q, k, v, g, beta, bare, op, impl, s, scale, parts, cu, use_qk_l2norm_in_kernel, box)
        new = box[0]
    else:
        o, new = getattr(impl, op)(q, k, v, g, beta, scale, parts, cu, use_qk_l2norm_in_kernel, s,
                                   bool(output_final_state))
        fin = new.final
    if as_state:
        return o, GatedDeltaRuleState(s.id, layout, new)
    return o, (fin if output_final_state else None)


# ---------------------------------------------------------------- the torch ops (hal/ops_registry.py rows)
# A state object crosses the op boundary as tensors: its spec id (``state_spec``), layout and the seven
# Parts fields go in as arguments, and the op returns (o, final, position, S, open_k, open_v, open_g,
# open_beta); the public function rebuilds the object outside the op. Fields a call does not return are
# empty [0] tensors, fields a spec has not (serial: no open rows) are [N, 0, ...]: the fake kernel knows
# every shape from the arguments alone (``output_final_state``: 0 none, 1 the FLA tensor, 2 the state).

_WANT = {0: False, 1: True, 2: "state"}


def _routed_gdn(op, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, spec, backend):
    """The call as ``torch.ops.lockstep.<op>`` (under torch.compile / torch.export, or hal.torch_ops.routed())."""
    _check_final_state(output_final_state)
    _check_initial_state(initial_state)
    state_in = isinstance(initial_state, GatedDeltaRuleState)
    want = 2 if output_final_state == "state" or (output_final_state is True and state_in) else int(output_final_state)
    if state_in:
        bare, state_spec, layout, parts = None, initial_state.spec_id, list(initial_state.layout), tuple(initial_state.parts)
    else:
        bare, state_spec, layout, parts = initial_state, None, [], (None,) * 7
    open_rows, s = 0, None
    if want == 2:  # the state's spec must be known here, not resolved when the graph runs (it shapes the outputs)
        named = spec if spec is not None else state_spec
        if named is None:  # (Dynamo shows a refusal met while tracing by this source line: keep it telling)
            raise UnsupportedError(f"{op}: a state object out under torch.compile / export needs its spec named: "
                                   "pass spec=<a gated_delta_rule spec id> (or an initial_state object, which "
                                   "carries its spec id)")
        s = specs.resolve(OPS[op], named)
        open_rows = s.chunk if s.variant == "chunked" else 0
    o, final, position, S, *opens = route(op, q, k, v, g, beta, scale, bare, state_spec, layout, *parts, want,
                                          open_rows, cu_seqlens, l2, spec=spec, backend=backend)
    if want < 2:
        return o, (final if want else None)
    P = _parts_type()
    return o, GatedDeltaRuleState(s.id, (q.shape[2], v.shape[2], q.shape[3], v.shape[3]),
                                  P(position, S, *(opens if open_rows else [None] * 4), final))


def _incoming(initial_state, state_spec, state_layout, parts):
    """The public ``initial_state`` argument rebuilt from the op's arguments."""
    if state_spec is None:
        return initial_state
    return GatedDeltaRuleState(state_spec, tuple(state_layout), _parts_type()(*parts))


def _rule_kernel(op, q, k, v, g, beta, scale, initial_state, state_spec, state_layout, state_position, state_S,
                 open_k, open_v, open_g, open_beta, state_final, output_final_state, open_rows, cu_seqlens,
                 use_qk_l2norm_in_kernel, spec, backend):
    """The real kernel of both rule ops: the public function, its results flattened to the op's outputs."""
    parts = (state_position, state_S, open_k, open_v, open_g, open_beta, state_final)
    o, final = _gdn(op, q, k, v, g, beta, scale, _incoming(initial_state, state_spec, state_layout, parts),
                    _WANT[output_final_state], cu_seqlens, use_qk_l2norm_in_kernel, spec, backend)
    fields = _rule_fake(q, v, beta, initial_state, state_S, output_final_state, open_rows, cu_seqlens)
    if output_final_state == 2:
        got = final.parts
        if open_rows != (0 if got.open_k is None else got.open_k.shape[1]):  # the fake's shapes would be wrong
            raise AssertionError(f"{op}: spec {final.spec_id} kept {got.open_k is not None and got.open_k.shape[1]} "
                                 f"open rows, the op expected {open_rows}")
        fin = final.final_state
        fin = fin.clone() if fin is got.S else fin  # serial: final is S; two outputs may not share storage
        return (o, fin, got.position, got.S, *(f if x is None else x for f, x in zip(fields[4:], got[2:6])))
    return (o, fields[1] if final is None else final, *fields[2:])


def _rule_fake(q, v, beta, initial_state, state_S, output_final_state, open_rows, cu_seqlens):
    """The outputs' shapes and dtypes (no data): (o, final, position, S, open_k, open_v, open_g, open_beta)."""
    B, _, H, dk = q.shape
    HV, dv = v.shape[2], v.shape[3]
    n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sdtype = F64 if v.dtype == F64 else F32
    state = (n, HV, dk, dv)

    def empty(shape=(0,), dtype=sdtype):
        return q.new_empty(shape, dtype=dtype)
    o = v.new_empty(v.shape)
    if output_final_state == 0:
        return (o, *(empty() for _ in range(7)))
    if output_final_state == 1:
        return (o, empty(state), *(empty() for _ in range(6)))
    opened = [(n, open_rows, H, dk), (n, open_rows, HV, dv), (n, open_rows, HV), (n, open_rows, HV)]
    return (o, empty(state), empty((n,), torch.int64), empty(state), *(empty(s, F32) for s in opened))


def _chunk_kernel(**args):
    return _rule_kernel("chunk_gated_delta_rule", **args)


def _fused_recurrent_kernel(**args):
    return _rule_kernel("fused_recurrent_gated_delta_rule", **args)


def _rule_backward_kernel(q, k, v, g, beta, scale, initial_state, state_spec, state_layout, state_position, state_S,
                          open_k, open_v, open_g, open_beta, state_final, cu_seqlens, use_qk_l2norm_in_kernel, do,
                          dfinal, op, spec, backend):
    """_GDNFn.backward (hal/gdn_backward.py) with spec and backend chosen now, as the forward's kernel chose
    them. Returns the grads of (q, k, v, g, beta, initial_state); [0] for an initial_state not given."""
    from .gdn_backward import grads
    parts = (state_position, state_S, open_k, open_v, open_g, open_beta, state_final)
    incoming = _incoming(initial_state, state_spec, state_layout, parts)
    _, impl, start, cu, scale, _ = _plan(op, q, k, v, g, beta, scale, incoming, False, cu_seqlens,
                                         use_qk_l2norm_in_kernel, spec, backend)
    with torch.no_grad():
        out = grads((q, k, v, g, beta), initial_state, start, scale, cu, use_qk_l2norm_in_kernel, do, dfinal, impl)
    return tuple((q.new_empty((0,)) if x is None else x.new_zeros(x.shape)) if gr is None else gr.contiguous()
                 for gr, x in zip(out, (q, k, v, g, beta, initial_state)))


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, spec=None, backend=None):
    """Gated delta rule over ``q, k [B, T, H, d_k]``, ``v [B, T, HV, d_v]``, ``g, beta [B, T, HV]``.

    Packed sequences: B = 1 and ``cu_seqlens`` (int, N+1 strictly increasing offsets). Returns
    ``(o [B, T, HV, d_v] in v's dtype, final)``; ``final`` is None, the FLA float32 tensor
    ``[N, HV, d_k, d_v]`` (``output_final_state=True``) or a :class:`GatedDeltaRuleState`
    (``output_final_state="state"``, or ``True`` when ``initial_state`` is a state object).
    The bits are those of ``spec`` (default: the registered default), whichever op is called.
    """
    return _gdn("chunk_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm_in_kernel, spec, backend)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta=None, scale=None, initial_state=None, output_final_state=False,
                                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, spec=None, backend=None):
    """Same arguments, results and bits as :func:`chunk_gated_delta_rule` (``beta=None`` means 1).

    The name is the one inference engines call for decode; under a spec both names compute the
    same canonical computation, so decode reproduces prefill and training bit for bit.
    """
    return _gdn("fused_recurrent_gated_delta_rule", q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, use_qk_l2norm_in_kernel, spec, backend)


# ---------------------------------------------------------------- the records (hal/torch_ops.py derives every table)
# Their backwards are ops too: the rule's reads cu_seqlens on the host and, like the conv's and the gates',
# differentiates a recompute with torch.autograd.grad, which must stay out of AOT autograd's trace.


_RULE_BACKWARD = HelperOp(
    "gated_delta_rule_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, "
    "Tensor? initial_state, str? state_spec, int[] state_layout, Tensor? state_position, Tensor? state_S, "
    "Tensor? open_k, Tensor? open_v, Tensor? open_g, Tensor? open_beta, Tensor? state_final, Tensor? cu_seqlens, "
    "bool use_qk_l2norm_in_kernel, Tensor do, Tensor dfinal, str op, str? spec, str? backend) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _rule_backward_kernel,
    lambda q, k, v, g, beta, scale, init, *rest: fake_grads(q, k, v, g, beta, init, fallback=q))


def _rule_setup(ctx, inputs, output):
    (q, k, v, g, beta, scale, init, state_spec, layout, *parts), rest = inputs[:16], inputs[16:]
    want, _, cu, l2, spec, backend = rest
    ctx.save_for_backward(q, k, v, g, beta, init, *parts, cu)
    ctx.rest = (scale, state_spec, list(layout), want, l2, spec, backend)


def _rule_backward(op):
    def backward(ctx, do, dfinal, *unused):
        q, k, v, g, beta, init, *parts, cu = ctx.saved_tensors
        scale, state_spec, layout, want, l2, spec, backend = ctx.rest
        n = q.shape[0] if cu is None else cu.shape[0] - 1
        if do is None:
            do = torch.zeros_like(v)
        if want == 0 or dfinal is None:  # no final state returned (an empty output): nothing flows from it
            dfinal = v.new_zeros((n, v.shape[2], q.shape[3], v.shape[3]), dtype=F64 if v.dtype == F64 else F32)
        grads = torch.ops.lockstep.gated_delta_rule_backward(
            q, k, v, g, beta, scale, init, state_spec, layout, *parts, cu, l2, do, dfinal, op, spec, backend)
        return (*grads[:5], None, grads[5] if init is not None else None, *[None] * 15)
    return backward


class _Contract:
    """The backend methods (hal/backend_contract.py): hal calls them with validated tensors and the resolved spec."""

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        """``(o, Parts)``: the chunked gated delta rule from ``state`` (kernels/layout.py ``Parts``)."""

    def fused_recurrent_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec,
                                         want_final):
        """``(o, Parts)``: the same rule, one token at a time (same bits as the chunked form)."""



# a GatedDeltaRuleState crosses as tensors (its spec id, layout and Parts fields in; o, final and the Parts
# fields out; empty where absent): "the torch ops" above
for _name, _kernel in (("chunk_gated_delta_rule", _chunk_kernel),
                       ("fused_recurrent_gated_delta_rule", _fused_recurrent_kernel)):
    register(OpRecord(_name, "gated_delta_rule", contract=getattr(_Contract, _name),
                      suites=(("gated_delta_rule", (specs.STRICT,)), ("gated_delta_rule_fast", (specs.FAST,))),
                      torch_ops=(TorchOp(
        _name, None, _kernel,
        "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, Tensor? initial_state, "
        "str? state_spec, int[] state_layout, Tensor? state_position, Tensor? state_S, Tensor? open_k, "
        "Tensor? open_v, Tensor? open_g, Tensor? open_beta, Tensor? state_final, int output_final_state, "
        "SymInt open_rows, Tensor? cu_seqlens, bool use_qk_l2norm_in_kernel", "(" + ", ".join(["Tensor"] * 8) + ")",
        fake=lambda q, k, v, g, beta, scale, initial_state, state_spec, state_layout, state_position, state_S, *rest:
            _rule_fake(q, v, beta, initial_state, state_S, rest[5], rest[6], rest[7]),
        backward=OpBackward(_RULE_BACKWARD, _rule_setup, _rule_backward(_name))),)))


def __getattr__(name):
    """``hal.gated_delta_rule.gdn_gating`` / ``gdn_causal_conv1d``: the layer ops' old home (hal/gdn_layer.py now)."""
    if name in ("gdn_gating", "gdn_causal_conv1d"):
        from . import gdn_layer
        from .deprecation import warn_moved
        warn_moved(f"hal.gated_delta_rule.{name}", f"hal.gdn_layer.{name} (or hal.{name})")
        return getattr(gdn_layer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
