"""The matmul spec of a patched HF model, and its weights prepared once under the exact policy.

Every linear of a patched model (``nn.Linear`` incl. the LM head, the MoE router and experts) runs
``hal.linear(..., spec=matmul.spec)`` through one :class:`PatchMatmul`. Under an exact spec
(``ExactMatmulSpec``) a weight is sliced once (``hal.exact_weight``) and the slices are reused while
the weight holds the same bits: each call compares the weight's stamp (hal/weight_watch.py, the one
weight-change detector: its version counter and storage, then a hash of its bits) with the one it was
sliced from, so every
write is seen -- an optimizer step (fused, foreach or loop), ``load_state_dict``, ``w.data.copy_``,
``w.data = t``, a broadcast into the parameter -- and inference tensors (no version counter) work.
"""
from __future__ import annotations

import torch

import hal
from ... import spec as specs, tensor_parallel as _tp
from ...errors import InputError, SpecError
from ...kernels.exact import core as exact_core
from ...kernels.exact.prepared import ExactWeight
from ...ops_registry import tracing


def resolve(matmul_spec) -> specs.OpSpec:
    """``matmul_spec`` (None: the default strict spec; a matmul spec object or id) -> the spec; SpecError else."""
    if matmul_spec is not None and not isinstance(matmul_spec, (str, specs.OpSpec)):
        raise SpecError(f"matmul_spec must be a matmul spec (MatmulSpec / ExactMatmulSpec), its id string, or None, "
                        f"got {type(matmul_spec).__name__}")
    try:
        return specs.resolve("matmul", matmul_spec)
    except SpecError as e:
        raise SpecError(f"matmul_spec: {e}") from None


def logprobs_spec(matmul_spec: specs.OpSpec) -> specs.TokenLogprobsSpec:
    """The token_logprobs spec whose logits use the dot of ``matmul_spec``.

    Default strict matmul -> the default token_logprobs spec; ``ExactMatmulSpec(s)`` (or a fast matmul spec) ->
    ``TokenLogprobsSpec(matmul=matmul_spec)``; a strict ``MatmulSpec(k_tile=t)`` ->
    ``TokenLogprobsSpec(hidden_tile=t)``.
    """
    if matmul_spec == specs.DEFAULTS["matmul"]:
        return specs.DEFAULTS["token_logprobs"]
    if isinstance(matmul_spec, (specs.ExactMatmulSpec, specs.FastMatmulSpec, specs.FastMatmulV3Spec)):
        return specs.TokenLogprobsSpec(matmul=matmul_spec)
    if isinstance(matmul_spec, specs.MatmulSpec):
        return specs.TokenLogprobsSpec(policy=matmul_spec.policy, hidden_tile=matmul_spec.k_tile)
    raise SpecError(f"matmul_spec {matmul_spec.id}: no token_logprobs spec computes its logits with this dot")


class PatchMatmul:
    """One patch's matmul spec (``spec``), the matching ``logprobs_spec``, and its prepared weights.

    ``slicings`` counts the weights sliced so far (tests and docs read it).
    """

    def __init__(self, matmul_spec=None, logprobs=None, backend: str | None = None):
        self.spec = resolve(matmul_spec)
        #: the LM head's token_logprobs spec: ``logprobs`` (a policy switch names it: hal.spec.POLICY_SPECS), else
        #: the one whose logits use ``matmul_spec``'s dot
        self.logprobs_spec = logprobs if logprobs is not None else logprobs_spec(self.spec)
        #: the backend of every linear (a policy switch's, checked at patch time); None: dispatched per call
        self.backend = backend
        self.exact = self.spec.policy == specs.EXACT
        self._prepared: dict[object, ExactWeight] = {}
        self.slicings = 0

    def check_weight(self, name: str, w: torch.Tensor) -> None:
        """Refuse (at patch time) a weight the spec cannot take."""
        if self.exact and w.dtype not in exact_core.DTYPES:
            raise InputError(f"{name}: the exact matmul policy takes float32, bfloat16 or float16 weights, got "
                             f"{w.dtype}; convert the model or pass another matmul_spec")

    def weight(self, w: torch.Tensor, key):
        """What ``hal.linear`` gets for weight ``w`` (a parameter, or a fixed view of one named by ``key``).

        Not exact: ``w``. Exact: an ExactWeight over ``w`` whose slices are re-made only when ``w``'s
        bits (or storage) differ from those they were cut from; the result is checked, so the call it is
        handed to does not hash the weight again. ``key`` names the weight across calls (``w`` may be a
        new view object each call).
        """
        if not self.exact or _tp.has_dtensor(w):  # a DTensor shard (tensor parallelism): sliced per call
            return w
        if tracing():  # torch.compile / export: a prepared weight cannot cross the torch op (refused there);
            return w   # the weight itself gives the same bits, sliced inside the op's kernel each call
        ew = self._prepared.get(key)
        if ew is not None and ew.source is not w:  # same weight, another view object: autograd must reach w
            ew = ew.over(w)
        if ew is None or not ew.is_fresh():
            ew = hal.exact_weight(w, spec=self.spec, backend=self.backend)
            self.slicings += 1
        self._prepared[key] = ew
        return ew.checked()

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias=None, key=None) -> torch.Tensor:
        """``hal.linear`` under the patch's spec. ``key`` names a model weight (prepared once under an exact
        spec); None: a temporary (e.g. a dtype-converted weight), sliced in this call."""
        return hal.linear(x, w if key is None else self.weight(w, key), bias, spec=self.spec, backend=self.backend)

    def fresh(self) -> "PatchMatmul":
        """The same choices with no prepared weight (a copied model's weights are other tensors)."""
        return PatchMatmul(self.spec, self.logprobs_spec, self.backend)

    def clear(self) -> None:
        """Drop every prepared weight (frees their memory; never needed for correctness)."""
        self._prepared.clear()


DEFAULT = PatchMatmul()  # the default strict spec (never prepares): forwards called outside a patch
