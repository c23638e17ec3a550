"""The policy switch of a patched HF model: ``lt.patch(model, policy="fast")`` (or "exact").

Every op a patched model's forwards run with the patch's specs -- its linears (LM head, router and experts
included), its attention (trainer forward, ``generate``, transformers' continuous-batching engine), the recorded
log-prob and, in a Gated DeltaNet hybrid (Qwen3-Next, Qwen3.5), its gated delta rule (prefill, decode, the
engine's step; the layer's conv and gates stay strict: ``hal.dispatch.switched_spec``) -- takes its family's spec under the policy (``hal.spec.POLICY_SPECS``; a family without
one keeps its strict default, e.g. rms_norm under fast) on the backend that claims it for the model's
device and dtype (``hal.dispatch.check_policy``), checked before the patch changes anything and refused by
name otherwise (UnsupportedError naming the policy and the device); ``specs=`` replaces entries of the policy's table
(``lt.patch(model, policy="fast", specs={"attention": FAST_ATTENTION_DECODE})``: hal.spec.policy_specs, refused
by name). The specs and the backend names are
handed to the ops explicitly (no context variable), so a compiled forward keeps them too. Under fast the
patch records ``hal.fast_fingerprint`` of what its bits depend on (``Patch.fingerprint``).
"""
from __future__ import annotations

import torch

from ... import dispatch, spec as specs
from ...errors import InputError, UnsupportedError
from .engine import is_gdn_model

#: The ops a patched model runs with the patch's own specs: what the switch checks before patching.
SWITCHED_OPS = ("linear", "flash_attn_varlen_func", "token_logprobs")
#: ... and those of a Gated DeltaNet hybrid's linear-attention layers (the chunked form for prefill, the recurrent
#: one for decode: one spec, the same bits), checked only on such a model.
GDN_SWITCHED_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")


def _placements(model) -> list[tuple[torch.device, torch.dtype]]:
    """The (device, dtype) pairs the switched ops will run on: those of the model's linear weights (attention runs
    on their outputs); of every floating-point parameter when it has no ``nn.Linear``. (Not every parameter: HF
    keeps some in float32 in a bf16 model, e.g. a Gated DeltaNet's ``A_log``, which no switched op reads.)"""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)] or list(model.parameters())
    seen = []
    for p in weights:
        if p.is_floating_point() and (p.device, p.dtype) not in seen:
            seen.append((p.device, p.dtype))
    return seen


class PatchPolicy:
    """One patch's policy: the (spec, backend name) of its linears (``matmul``), its attention (``attention``), its
    log-prob (``logprobs``) and its gated delta rule (``gdn``; a model without Gated DeltaNet layers: (None, None));
    backend None: dispatched per call as without a policy. ``fingerprint``: under fast,
    :func:`hal.fast_fingerprint` of the model's device (every fast spec of the table, as a trainer's own
    ``hal.fast_fingerprint()``, with the ids of ``chosen``'s specs); None otherwise. ``chosen``: family -> spec (or
    id) in place of the policy table's (hal.spec.policy_specs)."""

    def __init__(self, model, policy: str = specs.STRICT, matmul_spec=None, chosen=None):
        if policy not in specs.POLICY_SPECS:
            raise InputError(f"lt.patch: policy must be one of {tuple(specs.POLICY_SPECS)}, got {policy!r}")
        table = specs.policy_specs(policy, chosen)  # a spec that is not the policy's: SpecError, nothing patched
        self.policy = policy
        self.fingerprint = None
        if policy == specs.STRICT:  # what lt.patch did before the switch: nothing changes
            self.matmul, self.attention, self.logprobs = (matmul_spec, None), (None, None), (None, None)
            self.gdn = (None, None)
            return
        if matmul_spec is not None:
            raise InputError(f"lt.patch: pass policy={policy!r} or matmul_spec=, not both (the policy chooses every "
                             "linear's spec: hal.spec.POLICY_SPECS)")
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
        where = _placements(model) or [(torch.device("cpu"), torch.float32)]
        hybrid = getattr(model, "config", None) is not None and is_gdn_model(model)
        ops = SWITCHED_OPS + (GDN_SWITCHED_OPS if hybrid else ())
        chosen = {}
        for device, dtype in where:  # refuses by name, before anything is patched
            for op, (spec, backend) in dispatch.check_policy(policy, device, dtype, ops, table).items():
                name = None if backend is None else backend.name
                if chosen.setdefault(op, (spec, name)) != (spec, name):
                    raise UnsupportedError(f"lt.patch(policy={policy!r}): the model's parameters on {where} would run "
                                           f"{op} on different backends; put the model on one device")
        self.matmul, self.attention, self.logprobs = (chosen[op] for op in SWITCHED_OPS)
        self.gdn = chosen.get(GDN_SWITCHED_OPS[0], (None, None))
        if self.gdn != chosen.get(GDN_SWITCHED_OPS[1], (None, None)):  # the decode step continues the prefill's state
            raise UnsupportedError(f"lt.patch(policy={policy!r}): the chunked and the recurrent gated delta rule would "
                                   f"run {self.gdn} and {chosen[GDN_SWITCHED_OPS[1]]}; they must share one spec")
        if policy == specs.FAST:
            self.fingerprint = dispatch.fast_fingerprint(where[0][0], {f: s.id for f, s in table.items()})
