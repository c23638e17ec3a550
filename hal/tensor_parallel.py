"""DTensor inputs to lockstep's ops: row-wise sharding, and tensor-parallel linears.

A public op's routing check (``hal.ops_registry.routing``: a type check per argument) sends a call with a
DTensor here (the ops in ``hal.ops_registry.DTENSOR_RULES``); the rule runs the op itself on the local
tensors and wraps the result with the placements it has. Only placements under which that is bitwise the
unsharded op are taken; anything else raises UnsupportedError naming the placement -- never a silent
gather or a stock computation.

* Row-wise ops (linear, rms_norm, softmax, log_softmax, silu_mul, token_logprobs, apply_rotary): the
  row tensors may be ``Shard(d)`` on a batch dim (not the reduced / feature dim) or ``Replicate``; the
  weights ``Replicate``. A row's bits do not depend on the other rows in the call (level L1), so each
  rank computes exactly its rows of the unsharded result. A replicated weight's gradient comes back
  ``Partial`` (each rank saw its rows only).
* ``ColwiseParallel`` linear (weight ``Shard(0)``, x replicated): each output channel needs only its
  weight row, so the local result is the unsharded one's columns (output ``Shard(-1)``).
* ``RowwiseParallel`` linear (weight ``Shard(1)``, x ``Shard(-1)``): the reduction axis is split across
  ranks. Under the exact policy (``ExactMatmulSpec``) the partial dots are summed as integers and rounded
  once (:func:`hal.distributed.row_parallel_linear`): TP = 2 gives TP = 1's bits (output ``Replicate``).
  Under the strict or fast policy the only way is float partial sums all-reduced, which rounds
  differently for every TP degree; that is refused unless the caller opts in with
  :func:`float_partial_sums` (documented not invariant; the tests use it as the negative control).

Under torch.compile the same rules run: ``hal.ops_registry.routing`` sends a DTensor call here while Dynamo
traces too, so the rule's checks run at trace time on the placements (constants Dynamo guards on: another
placement retraces and meets the rule again) and its local calls become ``torch.ops.lockstep.*`` on the local
tensors. The two steps a graph cannot trace are torch ops of their own (registered in hal/torch_ops.py): the
exact row-parallel linear (collectives and host decisions on the reduced exponents) and the float partial
sums' opt-in, read when the graph runs (as ``hal.use`` is), so a graph traced with the opt-in never serves a
call made without it.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from .errors import UnsupportedError
from .ops_registry import NAMESPACE, tracing
from .ops_registry import dtensor_class as _dtensor, has_dtensor  # noqa: F401 (has_dtensor: re-exported)
from .torch_ops import HelperOp, register

#: what a record's ``sharding`` says of the rules here (hal/ops_registry.py OpRecord)
ROWWISE = "row-wise: row tensors Shard(batch dim) or Replicate, weights Replicate (rowwise)"
TP_LINEAR = ROWWISE + "; ColwiseParallel / RowwiseParallel weights (linear)"

_float_partials = contextvars.ContextVar("lockstep_float_partial_sums", default=False)


@contextlib.contextmanager
def float_partial_sums():
    """Allow a RowwiseParallel linear under a strict/fast spec: float32 partials all-reduced (stock TP).

    Its bits depend on the TP degree (not lockstep's guarantee); use the exact policy to keep them."""
    token = _float_partials.set(True)
    try:
        yield
    finally:
        _float_partials.reset(token)


# ---------------------------------------------------------------- placements


def _names(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def _split(op: str, tensors: dict):
    """The DTensors' common mesh; refuses plain tensors mixed in and DTensors on different meshes."""
    plain = [k for k, t in tensors.items() if t is not None and not isinstance(t, _dtensor())]
    if plain:
        raise UnsupportedError(f"{op}: got DTensor and plain torch.Tensor arguments ({', '.join(plain)} plain); "
                               "pass every tensor as a DTensor on one mesh (e.g. weights as Replicate())")
    meshes = {t.device_mesh for t in tensors.values() if t is not None}
    if len(meshes) != 1:
        raise UnsupportedError(f"{op}: the DTensor arguments live on {len(meshes)} different device meshes; "
                               "put them on one")
    return meshes.pop()


def _shard_dim(p, ndim: int) -> int | None:
    """The dim a Shard placement splits (normalised), None for Replicate; refuses any other placement."""
    from torch.distributed.tensor import Replicate, Shard
    if isinstance(p, Replicate):
        return None
    if type(p) is Shard:  # not _StridedShard / a custom subclass
        return p.dim % ndim
    raise UnsupportedError(f"placement {p} is not supported by lockstep's DTensor ops (only Shard(d) of a batch dim "
                           "and Replicate() run locally with the unsharded bits); redistribute first")


def _check_rows(op: str, rows: dict, free_dims: dict[str, set[int]]):
    """The reference row tensor's placements; every other row tensor must be sharded the same (aligned from the
    right over the batch dims) or replicated where it broadcasts. ``free_dims``: per row tensor, the dims that may
    not be sharded (feature / reduced dims)."""
    ref_name = next(k for k, t in rows.items() if t is not None)
    ref = rows[ref_name]
    ref_batch = ref.ndim - len(free_dims[ref_name])
    for name, t in rows.items():
        if t is None:
            continue
        batch = t.ndim - len(free_dims[name])
        for i, (p, pr) in enumerate(zip(t.placements, ref.placements)):
            d, dr = _shard_dim(p, t.ndim), _shard_dim(pr, ref.ndim)
            if d is not None and d in free_dims[name]:
                raise UnsupportedError(f"{op}: {name} is {p} on mesh dim {i}, which splits dim {d} -- the dim the op "
                                       f"reduces over or its feature dim; only batch dims may be sharded "
                                       f"(got placements {_names(t.placements)})")
            if name == ref_name:
                continue
            aligned = None if dr is None else dr - (ref_batch - batch)
            broadcast = aligned is not None and (aligned < 0 or t.shape[aligned] == 1)
            if d != aligned and not (d is None and broadcast):
                raise UnsupportedError(f"{op}: {name} placements {_names(t.placements)} do not match "
                                       f"{ref_name}'s {_names(ref.placements)} on mesh dim {i} (expected "
                                       f"{'Replicate()' if aligned is None else f'Shard({aligned})'}, the same batch "
                                       f"dim aligned from the right); shard them alike")
    return ref


def _check_replicated(op: str, weights: dict):
    for name, t in weights.items():
        if t is not None and any(_shard_dim(p, t.ndim) is not None for p in t.placements):
            raise UnsupportedError(f"{op}: {name} must be Replicate() on every mesh dim for a row-wise op, got "
                                   f"{_names(t.placements)}")


def _local_weight(t, ref):
    """A replicated weight's local tensor; its gradient is Partial where the rows are sharded."""
    from torch.distributed.tensor import Partial, Replicate
    grad = [Partial() if _shard_dim(p, ref.ndim) is not None else Replicate() for p in ref.placements]
    return t.to_local(grad_placements=grad)


def _wrap(out: torch.Tensor, mesh, placements, global_lead: tuple[int, ...]):
    """A local output whose leading dims are the rows' -> a DTensor of those placements and the global shape."""
    from torch.distributed.tensor import DTensor
    out = out.contiguous()  # from_local gets the contiguous global stride below
    shape = (*global_lead, *out.shape[len(global_lead):])
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def rowwise(op: str, call, rows: dict, weights: dict, free_dims: dict[str, set[int]], lead: int):
    """Run ``call(**local tensors)`` on each rank's rows; outputs (a tensor or a tuple) get the reference row
    tensor's placements. ``lead``: how many leading dims of the outputs are the reference's (its batch dims)."""
    mesh = _split(op, {**rows, **weights})
    ref = _check_rows(op, rows, free_dims)
    _check_replicated(op, weights)
    local = {k: None if t is None else t.to_local() for k, t in rows.items()}
    local.update({k: None if t is None else _local_weight(t, ref) for k, t in weights.items()})
    out = call(**local)
    lead_shape = tuple(ref.shape[:lead])
    if isinstance(out, tuple):
        return tuple(_wrap(o, mesh, ref.placements, lead_shape) for o in out)
    return _wrap(out, mesh, ref.placements, lead_shape)


# ---------------------------------------------------------------- linear: row-wise, colwise and rowwise TP


def linear(call, x, weight, bias, spec):
    """``hal.linear`` with DTensor arguments; ``call(x, weight, bias)`` is the op on local tensors."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    op = "linear"
    mesh = _split(op, {"x": x, "weight": weight, "bias": bias})
    wdims = [_shard_dim(p, 2) for p in weight.placements]
    if all(d is None for d in wdims):  # replicated weight: a row-wise op
        return rowwise(op, lambda x, weight, bias: call(x, weight, bias), {"x": x}, {"weight": weight, "bias": bias},
                       {"x": {x.ndim - 1}}, x.ndim - 1)
    if mesh.ndim != 1:
        raise UnsupportedError(f"linear: a sharded weight ({_names(weight.placements)}) is supported on a 1-D mesh "
                               f"only (tensor parallelism), got a {mesh.ndim}-D mesh")
    xd, bd = _shard_dim(x.placements[0], x.ndim), None if bias is None else _shard_dim(bias.placements[0], 1)
    if wdims[0] == 0:  # ColwiseParallel: output channels split
        if xd is not None or (bias is not None and bd != 0):
            raise UnsupportedError(f"linear: a Shard(0) weight (ColwiseParallel) needs x Replicate() and bias Shard(0), "
                                   f"got x {x.placements[0]}, bias {None if bias is None else bias.placements[0]}")
        out = call(x.to_local(), weight.to_local(), None if bias is None else bias.to_local())
        return _wrap(out, mesh, [Shard(out.ndim - 1)], (*x.shape[:-1], weight.shape[0]))
    # wdims[0] == 1: RowwiseParallel, the reduction axis split
    if xd != x.ndim - 1 or (bias is not None and bd is not None):
        raise UnsupportedError(f"linear: a Shard(1) weight (RowwiseParallel) needs x Shard(-1) and bias Replicate(), "
                               f"got x {x.placements[0]}, bias {None if bias is None else bias.placements[0]}")
    if x.shape[-1] != weight.shape[1]:
        raise UnsupportedError(f"linear: x.shape[-1] ({x.shape[-1]}) != weight.shape[1] ({weight.shape[1]})")
    from . import dispatch, spec as specs
    # no spec: the policy switch's (hal.use(policy=...)); while Dynamo traces, the switch cannot be read (a ContextVar)
    # and a graph outlives the with-block it was traced in, so the gate reads it when the graph runs
    s = None if spec is None and tracing() else dispatch.call_spec("linear", spec)
    xl, wl = x.to_local(), weight.to_local()
    if s is not None and s.policy == specs.EXACT:
        bl = None if bias is None else bias.to_local()
        out = _RowParallelExact.apply(xl, wl, bl, s, mesh.get_group(0).group_name)
        return _wrap(out, mesh, [Replicate()], (*x.shape[:-1], weight.shape[0]))
    if tracing():  # the opt-in is read when the graph runs (a graph outlives the with-block it was traced in)
        partials = _FloatPartialsGate.apply(call(xl, wl, None), "" if s is None else s.id)
    else:
        require_float_partial_sums(s)
        partials = call(xl, wl, None)
    part = _wrap(partials, mesh, [Partial()], (*x.shape[:-1], weight.shape[0]))
    full = part.redistribute(mesh, [Replicate()])
    return full if bias is None else full + bias


def require_float_partial_sums(s) -> None:
    """Refuses a RowwiseParallel linear under a strict / fast spec ``s`` unless :func:`float_partial_sums` is on."""
    if not _float_partials.get():
        raise UnsupportedError(f"linear: a Shard(1) weight (RowwiseParallel) under the {s.policy} policy ({s.id}) would "
                               "sum float partial products across ranks, whose bits depend on the TP degree; use an "
                               "exact spec (hal.spec.ExactMatmulSpec, integer partial sums, the TP = 1 bits) or opt "
                               "in to stock bits with hal.tensor_parallel.float_partial_sums()")


# ---------------------------------------------------------------- the torch ops' kernels (hal/torch_ops.py)


def _spec(spec_id: str):
    from . import spec as specs
    from .ops_registry import OPS
    return specs.resolve(OPS["linear"], spec_id)


def row_parallel_linear_kernel(x, weight, bias, group_name: str, spec):
    """``torch.ops.lockstep.row_parallel_linear``: the exact row-parallel linear on the group named ``group_name``
    (``spec``: an exact matmul spec or its id; eagerly, ``_RowParallelExact`` calls this directly)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from .distributed import row_parallel_linear
    return row_parallel_linear(x, weight, bias, _spec(spec), group=_resolve_process_group(group_name))


def float_partials_gate_kernel(partials, spec: str):
    """``torch.ops.lockstep.float_partials_gate``: ``partials`` if the float partial sums' opt-in is on now
    (``spec`` "": traced without ``spec=``, so the policy switch in force now names the spec)."""
    from . import dispatch, spec as specs
    s = dispatch.call_spec("linear", None) if not spec else _spec(spec)
    if s.policy == specs.EXACT:  # the traced graph sums float partials: it cannot follow an exact switch
        raise UnsupportedError(f"linear: a RowwiseParallel linear compiled without spec= runs under "
                               f"hal.use(policy='exact') ({s.id}), but its graph was traced with float partial "
                               "sums; pass spec= (an ExactMatmulSpec) to the linear it traces")
    require_float_partial_sums(s)
    return partials.clone()


class _FloatPartialsGate(torch.autograd.Function):
    """The traced opt-in check: the torch op forward (refuses at run time), the gradient passes through."""

    @staticmethod
    def forward(ctx, partials, spec_id):
        return getattr(torch.ops, NAMESPACE).float_partials_gate(partials, spec_id)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _RowParallelExact(torch.autograd.Function):
    """The exact row-parallel linear on local shards; backward: ordinary float32 math on the local shards."""

    @staticmethod
    def forward(ctx, x, weight, bias, s, group_name):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if tracing():  # collectives and host decisions: one opaque op in the graph
            return getattr(torch.ops, NAMESPACE).row_parallel_linear(x, weight, bias, group_name, s.id)
        return row_parallel_linear_kernel(x, weight, bias, group_name, s)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g32 = g.float()
        g2 = g32.reshape(-1, g.shape[-1])
        gx = (g32 @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g2.transpose(0, 1) @ x.reshape(-1, x.shape[-1]).float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0).to(w.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


# the rule's two steps a graph cannot trace, as torch ops (their gradients: the autograd.Functions above)
register(HelperOp("row_parallel_linear(Tensor x, Tensor weight, Tensor? bias, str group_name, str spec) -> Tensor",
                  row_parallel_linear_kernel,
                  lambda x, weight, bias, group_name, spec: x.new_empty((*x.shape[:-1], weight.shape[0])), direct=True))
register(HelperOp("float_partials_gate(Tensor partials, str spec) -> Tensor", float_partials_gate_kernel,
                  lambda partials, spec: partials.new_empty(partials.shape), direct=True))
