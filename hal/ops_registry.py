"""The op table: every public op's spec family and the torch op (``torch.ops.lockstep.*``) it becomes.

``OPS`` (public op name -> spec family) is what dispatch and the conformance suite read. ``TORCH_OPS``
declares, once per torch op, its schema (tensors, ints, floats, bools; ``spec`` and ``backend`` as
``str?`` ids/names), the arguments it writes (``Tensor(a!)`` in the schema) and the public python
function its real kernel calls. hal/torch_ops.py registers every entry from this table.

Routing, one call at every public op's head: ``how = routing("linear", x, weight, bias)`` says how this
call runs, one of

* ``DIRECT``: the op's own eager path (validate, dispatch, kernel; the common case, ~0.5 us to decide);
* ``TORCH_OP``: Dynamo or torch.export is tracing the caller (or :func:`hal.torch_ops.routed` is on):
  the op calls :func:`route`, i.e. ``torch.ops.lockstep.<op>`` with the spec as its id and the backend
  as its name, and the op's kernel resolves the rest (``hal.use``, ``LOCKSTEP_BACKEND``, the default spec)
  when it runs, so a compiled graph never bakes a choice made at trace time;
* ``DTENSOR``: a tensor argument is a DTensor: the op applies its sharding rule (hal/tensor_parallel.py).
  Only the ops in ``DTENSOR_RULES`` have one; for any other op :func:`routing` raises UnsupportedError
  naming the op, never a DTensor run through plain-tensor code. This holds while tracing too: the rule is
  python that Dynamo traces (placements are trace-time constants it guards on; ``to_local`` /
  ``DTensor.from_local`` are graph ops), and its local calls, on plain tensors, then take ``TORCH_OP``. A
  DTensor handed to ``torch.ops.lockstep.*`` itself would meet DTensor's own dispatch, which knows no
  lockstep rule: compiled and eager calls take the same rule, its refusals and its bits.

A new public op starts with the same head::

    how = routing("my_op", x, w)          # every tensor argument, None allowed
    if how is TORCH_OP:
        return route("my_op", x, w, spec=spec, backend=backend)
    if how is DTENSOR:                    # only if "my_op" is in DTENSOR_RULES
        return tensor_parallel.rowwise(...)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from . import spec as specs
from .errors import SpecError, UnsupportedError

#: op name -> spec family
OPS: dict[str, str] = {
    "matmul": "matmul",
    "linear": "matmul",
    "rms_norm": "rms_norm",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "logsumexp": "softmax",
    "token_logprobs": "token_logprobs",
    "flash_attn_varlen_func": "attention",
    "flash_attn_with_kvcache": "attention",
    "chunk_gated_delta_rule": "gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "gated_delta_rule",
    "gdn_gating": "gated_delta_rule",
    "gdn_causal_conv1d": "gated_delta_rule",
    "sigmoid": "elementwise",
    "silu": "elementwise",
    "softplus": "elementwise",
    "silu_mul": "elementwise",
    "rotary_cos_sin": "rotary",
    "apply_rotary": "rotary",
}


def register_op(op: str, family: str) -> None:
    OPS[op] = family


NAMESPACE = "lockstep"
_CHOICE = "str? spec, str? backend"  # every torch op ends with these two


@dataclass(frozen=True)
class TorchOp:
    """One ``torch.ops.lockstep.<name>``: ``public`` (a key of OPS, the python function
    ``module:function`` its kernel calls with the schema's arguments by name, plus ``fixed``)."""
    name: str
    public: str
    function: str
    args: str  # the schema's arguments before ``spec, backend``
    returns: str
    fixed: tuple[tuple[str, object], ...] = ()  # keyword arguments the kernel adds (e.g. return_lse=True)

    @property
    def family(self) -> str:
        return OPS[self.public]

    @property
    def schema(self) -> str:
        return f"({self.args}, {_CHOICE}) -> {self.returns}"

    @property
    def mutates(self) -> tuple[str, ...]:
        """The arguments the op writes, read from the schema's ``(a!)`` annotations."""
        return tuple(a.split()[-1] for a in self.args.split(",") if "!)" in a)


TORCH_OPS: dict[str, TorchOp] = {op.name: op for op in (
    TorchOp("matmul", "matmul", "hal.ops:matmul", "Tensor a, Tensor b", "Tensor"),
    TorchOp("linear", "linear", "hal.ops:linear", "Tensor x, Tensor weight, Tensor? bias", "Tensor"),
    TorchOp("rms_norm", "rms_norm", "hal.ops:rms_norm", "Tensor x, Tensor weight, float eps", "Tensor"),
    TorchOp("rms_norm_residual", "rms_norm", "hal.ops:rms_norm",
            "Tensor x, Tensor weight, Tensor residual, float eps", "(Tensor, Tensor)"),
    TorchOp("softmax", "softmax", "hal.ops:softmax", "Tensor x, int dim", "Tensor"),
    TorchOp("log_softmax", "log_softmax", "hal.ops:log_softmax", "Tensor x, int dim", "Tensor"),
    TorchOp("logsumexp", "logsumexp", "hal.ops:logsumexp", "Tensor x, int dim", "Tensor"),
    TorchOp("token_logprobs", "token_logprobs", "hal.ops:token_logprobs",
            "Tensor hidden, Tensor lm_head_weight, Tensor tokens, float temperature", "Tensor"),
    TorchOp("sigmoid", "sigmoid", "hal.elementwise:sigmoid", "Tensor x", "Tensor"),
    TorchOp("silu", "silu", "hal.elementwise:silu", "Tensor x", "Tensor"),
    TorchOp("softplus", "softplus", "hal.elementwise:softplus", "Tensor x", "Tensor"),
    TorchOp("silu_mul", "silu_mul", "hal.elementwise:silu_mul", "Tensor a, Tensor b", "Tensor"),
    TorchOp("rotary_cos_sin", "rotary_cos_sin", "hal.elementwise:rotary_cos_sin",
            "Tensor positions, int rotary_dim, float base, Tensor? inv_freq", "(Tensor, Tensor)"),
    TorchOp("apply_rotary", "apply_rotary", "hal.elementwise:apply_rotary",
            "Tensor x, Tensor cos, Tensor sin, bool interleaved", "Tensor"),
    # attention: lse is always returned (the public op drops it unless asked); max_seqlen as SymInt
    TorchOp("flash_attn_varlen", "flash_attn_varlen_func", "hal.attention:flash_attn_varlen_func",
            "Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
            "SymInt max_seqlen_k, float? softmax_scale, bool causal, SymInt[] window_size", "(Tensor, Tensor)",
            fixed=(("return_lse", True),)),
    # appends k, v into the caches in place: the schema says so (a!), (b!)
    TorchOp("flash_attn_with_kvcache", "flash_attn_with_kvcache", "hal.attention:flash_attn_with_kvcache",
            "Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, Tensor? cache_seqlens, "
            "Tensor? block_table, float? softmax_scale, bool causal, SymInt[] window_size, int num_splits",
            "(Tensor, Tensor)", fixed=(("return_lse", True),)),
    # gated delta rule: a GatedDeltaRuleState crosses as tensors (its spec id, layout and Parts fields in;
    # o, final and the Parts fields out; empty where absent): hal/gated_delta_rule.py, "the torch ops"
    *(TorchOp(name, name, f"hal.gated_delta_rule:{kernel}",
              "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float? scale, Tensor? initial_state, "
              "str? state_spec, int[] state_layout, Tensor? state_position, Tensor? state_S, Tensor? open_k, "
              "Tensor? open_v, Tensor? open_g, Tensor? open_beta, Tensor? state_final, int output_final_state, "
              "SymInt open_rows, Tensor? cu_seqlens, bool use_qk_l2norm_in_kernel", "(" + ", ".join(["Tensor"] * 8) + ")")
      for name, kernel in (("chunk_gated_delta_rule", "_chunk_kernel"),
                           ("fused_recurrent_gated_delta_rule", "_fused_recurrent_kernel"))),
    TorchOp("gdn_gating", "gdn_gating", "hal.gated_delta_rule:gdn_gating",
            "Tensor A_log, Tensor a, Tensor dt_bias, Tensor b", "(Tensor, Tensor)"),
    TorchOp("gdn_causal_conv1d", "gdn_causal_conv1d", "hal.gated_delta_rule:gdn_causal_conv1d",
            "Tensor x, Tensor weight, Tensor? bias, Tensor? conv_state, str? activation, Tensor? cu_seqlens",
            "(Tensor, Tensor)"),
    # the patched HF GatedDeltaNet's mask / positions -> packed sequences (a plan that reads values), conv and
    # chunk rule in one kernel: o [B, T, HV, dv] with zeros at padding (hal/integrations/hf_modules.py)
    TorchOp("hf_gated_delta_net", "chunk_gated_delta_rule", "hal.integrations.hf_modules:packed_conv_and_rule",
            "Tensor mixed, Tensor g, Tensor beta, Tensor conv_weight, Tensor? conv_bias, Tensor? attention_mask, "
            "Tensor? position_ids, Tensor? cu_seq_lens_q, int key_dim, int head_k_dim, int head_v_dim", "Tensor"),
    # the patched HF attention: mask / positions -> sequences (a plan that reads values) + varlen attention,
    # all inside one kernel so that a traced model holds no data-dependent host code
    # (lse [B, Tq, Hq] is returned for the backward op, which gathers it as the varlen backward needs it)
    TorchOp("hf_attention", "flash_attn_varlen_func", "hal.integrations.hf_attention:masked_attention",
            "Tensor query, Tensor key, Tensor value, Tensor? attention_mask, Tensor? position_ids, "
            "Tensor? cu_seq_lens_q, Tensor? cu_seq_lens_k, bool causal, float? scaling", "(Tensor, Tensor)",
            fixed=(("return_lse", True),)),
)}


# ---------------------------------------------------------------- routing

DIRECT, TORCH_OP, DTENSOR = "direct", "torch_op", "dtensor"  # what routing() answers

#: public ops with a DTensor rule in hal/tensor_parallel.py (row-wise over a sharded batch; TP linears)
DTENSOR_RULES = frozenset({"linear", "rms_norm", "softmax", "log_softmax", "silu_mul", "token_logprobs",
                           "apply_rotary"})

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo knows the function, not the name


def tracing() -> bool:
    """True while Dynamo (torch.compile) or torch.export traces the caller (or under ``routed()``): then
    a public op becomes its torch op. One flag read (~0.25 us)."""
    return _is_compiling() or _route_all


_route_all = False  # set by hal.torch_ops.routed(): eager calls through the torch ops (tests, counting)


def routing(op: str, *tensors) -> str:
    """How public op ``op`` runs this call, given its tensor arguments: DIRECT, TORCH_OP or DTENSOR (the
    module docstring). Plain tensors and None cost one type check each (other values are allowed and
    never a DTensor); a DTensor wins over tracing (its sharding rule runs, traced, and calls the torch op
    on the local tensors)."""
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and _is_dtensor(t):
            if op not in DTENSOR_RULES:
                raise UnsupportedError(
                    f"{op}: DTensor arguments are not supported (lockstep's sharding rules cover "
                    f"{', '.join(sorted(DTENSOR_RULES))}); pass local tensors (DTensor.to_local()) or "
                    "redistribute to a plain tensor first")
            return DTENSOR
    if _is_compiling() or _route_all:
        return TORCH_OP
    return DIRECT


def dtensor_class():
    """The DTensor class, or None while torch.distributed.tensor was never imported (then no DTensor exists,
    and checking a tensor subclass such as a FakeTensor costs no import)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _is_dtensor(t) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def has_dtensor(*tensors) -> bool:
    """True if any argument is a DTensor (plain tensors and None cost one type check)."""
    for t in tensors:
        if t is not None and type(t) not in _PLAIN and _is_dtensor(t):
            return True
    return False


def _crossing(op: TorchOp, spec):
    """A spec object crosses the torch op as its id, and the kernel rebuilds it from that id (spec.from_id):
    refused now, with eager's refusal, when it is not a spec of this op's family or its id names no spec.
    (An id string crosses as it is: the kernel resolves it when it runs, and refuses it as eagerly.)"""
    spec = specs.resolve(op.family, spec)
    if specs.from_id(spec.id) != spec:
        raise SpecError(f"{op.public} under torch.compile / torch.export: spec {type(spec).__name__} crosses the torch op "
                        f"as its id {spec.id!r}, which names no spec of hal.spec's classes at their current version; "
                        "pass one of those (hal.spec.CLASSES) or call eagerly")
    return spec


def route(name: str, *args, spec=None, backend=None):
    """Call ``torch.ops.lockstep.<name>`` with the spec as its id and the backend as its name."""
    op = TORCH_OPS[name]
    for a in args:
        if isinstance(a, (list, tuple)) and all(isinstance(x, (int, torch.SymInt)) for x in a):
            continue  # int[] arguments (window_size)
        if not (a is None or isinstance(a, (torch.Tensor, bool, int, float, str, torch.SymInt, torch.SymFloat))):
            raise UnsupportedError(
                f"{op.public} under torch.compile / torch.export: an argument of type {type(a).__name__} cannot "
                f"cross the torch op boundary", [f"{type(a).__name__} is not a tensor or a number (a prepared "
                "hal.exact_weight is refused under compile: pass the weight tensor itself, same bits)"])
    if spec is not None and not isinstance(spec, str):
        spec = _crossing(op, spec)
    spec_id = spec if spec is None or isinstance(spec, str) else spec.id
    backend_name = backend if backend is None or isinstance(backend, str) else backend.name
    return getattr(getattr(torch.ops, NAMESPACE), name)(*args, spec_id, backend_name)
