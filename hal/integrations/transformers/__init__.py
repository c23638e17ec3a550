"""Make an unmodified Hugging Face transformers model compute lockstep's bits.

    from hal.integrations import transformers as lt
    lt.register()                                     # attention + mask function "lockstep"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="lockstep")
    with lt.patch(model):                             # or p = lt.apply(model); ...; p.revert()
        out = model.generate(...)                     # sampler
        loss.backward()                               # trainer
    lt.patch(model, matmul_spec=ExactMatmulSpec(slices=4))  # linears under the exact policy, weights prepared
    p = lt.patch(model, policy="fast")                # linears + attention on tensor cores (one GPU model's bits);
    p.fingerprint                                     #   compare with the trainer's hal.fast_fingerprint()
    report = lt.verify(model, vocab_size)             # alone vs padded vs packed; decode vs teacher-forced
    lt.audit(model, input_ids)                        # what still computes outside hal
    ref = copy.deepcopy(model)                        # an independent patched copy; lt.revert(ref) unpatches it

Modules attached after the patch (PEFT's LoRA, resize_token_embeddings) are patched on their first
forward or refused by name; nested patches and pickling are refused (see :class:`Patch`).

Supported model code: Llama, Qwen3, Qwen3-Next (gated attention, Gated DeltaNet, MoE), Qwen3.5
(``qwen3_5``: text-only ``Qwen3_5ForCausalLM``; its MoE sibling ``Qwen3_5MoeForCausalLM``) -- the full test
set -- and Qwen2, Mistral (no sliding window) -- checked with verify -- of the transformers versions
in ``SUPPORTED``. transformers is imported only
when one of these functions is called, never at ``import hal``. See docs/integrations.md.
"""
from __future__ import annotations

import copy
import os

import torch

import hal
from ...errors import InputError, UnsupportedError
from . import modules as M
from .modules import OWNER_ATTR, patch_owner
from .matmul import PatchMatmul
from .policy import PatchPolicy
from .attention import NAME, attention_forward, mask_function
from . import engine, engine_install  # noqa: F401 -- engine: trl.py reads it (the engine's build)
from ...sampling import Sampling, recorded_logprobs, sampling_scores

__all__ = ["register", "patch", "apply", "revert", "Patch", "token_logprobs", "verify", "audit", "check_version",
           "SUPPORTED", "NAME"]

# The transformers releases lockstep supports: a range, each release in it checked at lt.register / lt.patch by
# the source hash of every function lockstep mirrors (mirrored.py: each must equal its source in a release the full
# HF integration tests ran on, mirrored_table.TESTED); a release outside the range, or whose mirrored source differs,
# is refused by name. Which releases pass: docs/integrations.md.
SUPPORTED = ((5, 17), (5, 26))
_ENV_ANY = "LOCKSTEP_HF_ANY_VERSION"


def check_version(allow_untested: bool = False) -> str:
    """The installed transformers version; raises UnsupportedError outside ``SUPPORTED`` or when a function
    lockstep mirrors differs from its source in every tested release (mirrored.check_sources, naming it).

    The adapters re-implement HF forwards; another release may change them (new kwargs, different
    op order) and silently compute other bits. ``allow_untested=True`` (or the environment variable
    LOCKSTEP_HF_ANY_VERSION=1) skips both checks at the caller's risk.
    """
    import transformers

    from .._versions import check_supported
    from .mirrored import check_sources
    allow = allow_untested or os.environ.get(_ENV_ANY) == "1"
    version = check_supported("transformers", transformers.__version__, SUPPORTED, "lockstep's integration",
                              "; its model code may differ from the forwards lockstep mirrors. "
                              f"Set {_ENV_ANY}=1 to try anyway and run lt.verify(model).", allow)
    if not allow:
        check_sources(version, hint=f" Set {_ENV_ANY}=1 to try anyway and run lt.verify(model).")
    return version


def register(allow_untested: bool = False) -> None:
    """Register attention function and mask function ``"lockstep"`` with transformers (idempotent)."""
    check_version(allow_untested)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)


# ---------------------------------------------------------------- which forward each module class gets

_NORM_W = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
_NORM_ONE_PLUS = {"Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm"}
_NORM_GATED = {"Qwen3NextRMSNormGated", "Qwen3_5RMSNormGated", "Qwen3_5MoeRMSNormGated"}
_ATTENTION = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "Qwen3NextAttention",
              "Qwen3_5Attention", "Qwen3_5MoeAttention"}
_MLP = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Qwen3NextMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP"}
_ROTARY = {"LlamaRotaryEmbedding", "Qwen2RotaryEmbedding", "Qwen3RotaryEmbedding", "MistralRotaryEmbedding",
           "Qwen3NextRotaryEmbedding"}
_ROTARY_MROPE = {"Qwen3_5TextRotaryEmbedding", "Qwen3_5MoeTextRotaryEmbedding"}  # interleaved t/h/w tables
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq fixed at init (dynamic ones change with length)
_GDN = {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}
_MOE = {"Qwen3NextSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock"}
_ROUTER = {"Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter"}
_EXPERTS = {"Qwen3NextExperts", "Qwen3_5MoeExperts"}
_DECODER_WITH_GDN = {"Qwen3NextDecoderLayer", "Qwen3_5DecoderLayer", "Qwen3_5MoeDecoderLayer"}
# Modules whose forward is exact as it stands (gathers, residual adds) or never runs once the
# parent is patched (the GDN's conv1d holds weights; activation modules inside patched MLPs).
_EXACT = {"Embedding", "ModuleList", "Dropout", "Identity", "SiLUActivation", "SiLU"}
_MLP_ACTS = {"silu", "swish"}


def _kind(mod) -> str | None:
    name = type(mod).__name__
    if isinstance(mod, torch.nn.Linear):
        return "linear"
    for kind, names in (("norm", _NORM_W), ("norm1p", _NORM_ONE_PLUS), ("norm_gated", _NORM_GATED),
                        ("attention", _ATTENTION), ("mlp", _MLP), ("rotary", _ROTARY), ("rotary_mrope", _ROTARY_MROPE),
                        ("gdn", _GDN),
                        ("moe", _MOE), ("router", _ROUTER), ("experts", _EXPERTS)):
        if name in names:
            return kind
    return None


_FORWARDS = {"linear": M.linear, "norm": M.rms_norm, "norm1p": M.rms_norm_one_plus,
             "norm_gated": M.rms_norm_gated, "attention": M.attention, "mlp": M.mlp, "rotary": M.rotary,
             "rotary_mrope": M.rotary_mrope,
             "gdn": M.gated_delta_net, "moe": M.sparse_moe_block, "router": M.router, "experts": M.experts}

_USES_MATMUL = {"linear", "router", "experts"}  # forwards that call hal.linear themselves: given the patch's matmul


class _Missing:
    """"No instance attribute was there" in an undo record; copy.deepcopy keeps it the one sentinel."""

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self):
        return "<no instance attribute>"


_MISSING = _Missing()



def _refuse_pickle(self, protocol=None):
    raise UnsupportedError(
        "a lockstep-patched model cannot be pickled (torch.save(model), pickle.dumps): its forwards are lockstep's "
        "per-instance functions. Save model.state_dict() instead, or lt.revert(model) before saving and patch the "
        "loaded model again; copy.deepcopy(model) works on a patched model.")


class _PatchObject:
    """State installed in a module's ``__dict__`` by a patch. An object (not a closure) so that
    ``copy.deepcopy(model)`` binds the copy's attributes to the copied modules and patch; never pickled."""

    __reduce_ex__ = _refuse_pickle

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new


class _Forward(_PatchObject):
    """A patched module's forward: lockstep's mirror ``fn`` of its class's forward, called on ``mod``."""

    def __init__(self, patch, mod, fn, kind):
        self.patch, self.mod, self.fn, self.__lockstep__ = patch, mod, fn, kind

    def __call__(self, *args, **kwargs):
        p = self.patch
        if p.stale:  # a module was attached to the tree since the last walk: patch it before computing
            p.refresh()
        if self.__lockstep__ in _USES_MATMUL:
            return self.fn(self.mod, *args, mm=p.matmul, **kwargs)
        if self.__lockstep__ == "attention":
            return self.fn(self.mod, *args, attention_choice=p.switch.attention, **kwargs)
        if self.__lockstep__ == "gdn":
            return self.fn(self.mod, *args, rule_choice=p.switch.gdn, **kwargs)
        return self.fn(self.mod, *args, **kwargs)


class _Pending(_PatchObject):
    """The forward of a module attached to a patched tree after the patch: its first call walks the
    tree (Patch.refresh: patch what is new, or refuse it by name), then runs the module's new forward."""

    def __init__(self, patch, mod):
        self.patch, self.mod = patch, mod

    def __call__(self, *args, **kwargs):
        self.patch.refresh()
        return self.mod.forward(*args, **kwargs)


class _GuardedGenerate(_PatchObject):
    """``model.generate`` refusing beam search (its cache reordering would not move lockstep's GDN states)."""

    def __init__(self, model, generate):
        self.model, self.generate = model, generate

    def __call__(self, *args, **kwargs):
        gc = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1) if gc is not None else 1)
        if beams is not None and int(beams) > 1:
            raise UnsupportedError(f"beam search (num_beams={beams}) is not supported on a lockstep-patched model: "
                                   "HF reorders its cache between beams but not lockstep's Gated DeltaNet states, "
                                   "and beams are not a sampler's on-policy path. Use sampling or greedy decoding.")
        return self.generate(*args, **kwargs)


def _on_module_registered(parent, name, sub):
    """torch's global hook on every ``parent.name = sub`` / ``add_module`` (before torch stores it): a
    module attached to a patched tree gets a pending forward (patched, or refused by name, when it first
    runs); one holding another patch's modules is refused now, before the assignment."""
    p = patch_owner(parent)
    if p is None or sub is None or sub.__dict__.get(OWNER_ATTR) is p:
        return None
    for sname, mod in sub.named_modules():
        other = patch_owner(mod)
        if other is not None and other is not p:
            where = f"{name}.{sname}" if sname else name
            raise InputError(f"cannot attach {where!r} ({type(mod).__name__}) to a module of a lockstep-patched "
                             f"{type(p.model).__name__}: it is already patched by another lockstep patch (applied "
                             f"to a {type(other.model).__name__}); revert() that patch first")
    p._attached(sub)
    return None


_registration_hook = None


def _watch_registrations():
    global _registration_hook
    if _registration_hook is None:
        from torch.nn.modules.module import register_module_module_registration_hook
        _registration_hook = register_module_module_registration_hook(_on_module_registered)


class Patch:
    """Handle of an applied patch: ``revert()`` puts every module's forward back as it was.

    Also a context manager (``with lt.patch(model): ...``). ``patched`` lists (module name, kind);
    ``matmul`` (matmul.PatchMatmul) holds the matmul spec of every patched linear
    (``matmul.spec``), the LM head's token_logprobs spec (``matmul.logprobs_spec``) and, under the
    exact policy, the weights prepared for them; ``policy`` the policy switch (``lt.patch(model, policy=...)``)
    and ``fingerprint`` (under fast) :func:`hal.fast_fingerprint` of what the patched model's bits depend on:
    a trainer and an engine compare theirs (docs/fast_policy.md).

    Lifecycle: a module attached to the tree after the patch (PEFT's LoRA adapters,
    ``resize_token_embeddings``' new head, any ``parent.x = module``) is patched on its first forward,
    or refused there by name. ``copy.deepcopy(model)`` gives an independent copy patched by its own
    Patch (``model.__dict__["_lockstep_patch"]``), revertible on its own; pickling is refused.
    """

    def __init__(self, model, matmul: PatchMatmul | None = None, unknown: str = "raise",
                 switch: PatchPolicy | None = None):
        self.model = model
        self.matmul = matmul if matmul is not None else PatchMatmul()
        self.switch = switch if switch is not None else PatchPolicy(model)
        self.policy, self.fingerprint = self.switch.policy, self.switch.fingerprint
        self.unknown = unknown
        self.patched: list[tuple[str, str]] = []
        self._undo: list[tuple[torch.nn.Module, str, object]] = []
        self._hooks = []
        self._pending: list[torch.nn.Module] = []
        self.active = False
        self.stale = False  # a module was attached since the last walk (see refresh)

    __reduce_ex__ = _refuse_pickle

    def __deepcopy__(self, memo):
        new = object.__new__(Patch)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k != "matmul"}
        new.__dict__.update(copy.deepcopy(state, memo))
        new.matmul = self.matmul.fresh()  # the copy's weights are other tensors: prepared afresh
        return new

    def _set_attr(self, mod, attr, value):
        self._undo.append((mod, attr, mod.__dict__.get(attr, _MISSING)))
        mod.__dict__[attr] = value

    def _set_forward(self, mod, fn, kind, name):
        self._set_attr(mod, "forward", _Forward(self, mod, fn, kind))
        self.patched.append((name, kind))

    def _take(self, modules) -> None:
        """Mark ``[(name, module)]`` as this patch's and give each its lockstep forward (all checked before)."""
        for name, mod in modules:
            self._set_attr(mod, OWNER_ATTR, self)
            kind = _kind(mod)
            if kind is not None:
                self._set_forward(mod, _FORWARDS[kind], kind, name)
            if type(mod).__name__ in _DECODER_WITH_GDN:
                self._hooks.append(mod.register_forward_pre_hook(M.decoder_position_hook, with_kwargs=True))

    def _attached(self, sub) -> None:
        self._set_attr(sub, "forward", _Pending(self, sub))
        self._pending.append(sub)
        self.stale = True

    def refresh(self) -> None:
        """Patch the modules attached to the tree since the last walk; refuse them by name (UnsupportedError,
        InputError for another patch's modules) before changing anything. Runs by itself on the next forward."""
        if not self.active:
            return
        new = [(n, m) for n, m in self.model.named_modules() if m.__dict__.get(OWNER_ATTR) is not self]
        _check_modules(self.model, new, self.unknown, self.matmul)
        self._take(new)
        for mod in self._pending:  # pending forwards of modules with no lockstep forward of their own
            if isinstance(mod.__dict__.get("forward"), _Pending):
                mod.__dict__.pop("forward")
        self._pending, self.stale = [], False

    def revert(self) -> None:
        for mod, attr, old in reversed(self._undo):
            if old is _MISSING:
                mod.__dict__.pop(attr, None)
            else:
                mod.__dict__[attr] = old
        for h in self._hooks:
            h.remove()
        for _, mod in self.model.named_modules():
            mod.__dict__.pop("_lockstep_position_ids", None)
        self._undo, self._hooks, self._pending, self.active, self.stale = [], [], [], False, False
        self.matmul.clear()  # the prepared slices (as much memory as the weights under s = 4 and float32)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()
        return False


def _validate(model, unknown: str, matmul: PatchMatmul):
    """Everything that can refuse, checked before any module is touched."""
    if unknown not in ("raise", "ignore"):
        raise InputError(f"unknown must be 'raise' or 'ignore', got {unknown!r}")
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    cfg = getattr(model, "config", None)
    problems = []
    if cfg is not None:
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t in ("sliding_attention", "chunked_attention") for t in layer_types) or \
                getattr(cfg, "use_sliding_window", False):
            problems.append("sliding-window / chunked attention layers (caches that evict keys)")
        act = getattr(cfg, "hidden_act", "silu")
        if act not in _MLP_ACTS:
            problems.append(f"hidden_act={act!r} (only silu MLPs are mirrored)")
    if problems:
        raise UnsupportedError("lockstep cannot patch this model: " + "; ".join(problems), problems)
    _check_modules(model, list(model.named_modules()), unknown, matmul)


def _check_modules(model, modules, unknown: str, matmul: PatchMatmul):
    """Refuse ``[(name, module)]`` of ``model`` that a patch cannot take: another patch's modules (nested or
    overlapping patches), weights the matmul spec cannot take, dynamic RoPE, unknown classes."""
    for name, mod in modules:
        other = patch_owner(mod)
        if other is not None:
            raise InputError(f"module {name or '(root)'!r} ({type(mod).__name__}) is already patched by lockstep "
                             f"(a patch applied to a {type(other.model).__name__}); nested or overlapping patches "
                             "are refused: revert() that patch first, or patch only the outermost model")
    problems, unknown_mods = [], []
    for name, mod in modules:
        kind = _kind(mod)
        if kind in _USES_MATMUL:
            for pname, prm in mod.named_parameters(recurse=False):
                matmul.check_weight(f"{name}.{pname}", prm)
        if kind in ("rotary", "rotary_mrope"):
            rt = getattr(mod, "rope_type", "default")
            if rt not in _STATIC_ROPE:
                problems.append(f"{name}: rope_type {rt!r} (its inv_freq changes with the sequence length)")
        if kind is None and type(mod).__name__ not in _EXACT:
            own = [n for n, _ in mod.named_parameters(recurse=False)]
            if own and not _inside_handled(model, name):
                unknown_mods.append(f"{name} ({type(mod).__name__})")
            elif ("Norm" in type(mod).__name__) and not _inside_handled(model, name):
                unknown_mods.append(f"{name} ({type(mod).__name__})")
    if problems:
        raise UnsupportedError("lockstep cannot patch this model: " + "; ".join(problems), problems)
    if unknown_mods and unknown == "raise":
        raise UnsupportedError("modules of unknown classes would keep computing stock bits: "
                               + ", ".join(unknown_mods[:8]) + (" ..." if len(unknown_mods) > 8 else "")
                               + ". Pass unknown='ignore' to patch the rest anyway (lt.audit lists what is left).",
                               unknown_mods)


def _inside_handled(model, name: str) -> bool:
    """True when a parent of module ``name`` gets a whole-module forward (its children never run)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = model.get_submodule(".".join(parts[:i]))
        if _kind(parent) in ("gdn", "experts"):
            return True
    return False


def apply(model, *, policy: str = "strict", specs: dict | None = None, matmul_spec=None, unknown: str = "raise",
          allow_untested: bool = False) -> Patch:
    """Patch ``model`` in place (per-instance forwards); returns a :class:`Patch` with ``revert()``.

    ``policy``: "strict" (default: every op on its strict spec, the same bits on every backend), "fast" (linears,
    attention and a Gated DeltaNet hybrid's gated delta rule on their fast specs, tensor cores: the same bits on one
    GPU model with one Triton version; every other op strict, the GDN layer's conv and gates included) or "exact" (linears and the log-prob's logits on the exact matmul, 4 slices):
    ``hal.spec.POLICY_SPECS``. Refused by name (UnsupportedError naming the policy and the device), before
    anything is patched, unless the backend that would run each of the policy's ops claims it on the model's
    device (fast: triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``); ``Patch.fingerprint`` then says
    what fast bits depend on (docs/fast_policy.md).
    ``specs``: family -> spec (or id) in place of the policy table's, e.g. ``{"attention": FAST_ATTENTION_DECODE}``
    (hal.spec: fast attention on 16-row query tiles, for decode; the patch's prefill runs it too, so a trainer
    must pick the same); refused by name (SpecError) unless it is the policy's own spec of a family in its table.
    ``matmul_spec``: the spec of every linear (LM head, router and experts included) -- None for the
    default strict spec, or a matmul spec / its id, e.g. ``ExactMatmulSpec(slices=4)``
    ("matmul.exact.s4.v2"), whose bits do not depend on tiling, split-K, threads or TP degree. Under
    an exact spec each weight is sliced once and re-sliced when torch reports it changed (an
    optimizer step); :func:`token_logprobs` then uses the matching exact token_logprobs spec.
    Refuses (before touching anything) models with sliding-window attention, dynamic RoPE, non-SiLU
    MLPs, and modules of classes it does not know (norms included) unless ``unknown='ignore'``.
    Beam search is refused at ``generate`` time (its cache reordering would not move lockstep's
    Gated DeltaNet states). Refuses (InputError) a model any of whose modules another patch holds:
    nested or overlapping patches (``lt.apply(model.model)`` then ``lt.apply(model)``).
    Modules attached later are patched (or refused by name) on their first forward; see :class:`Patch`.
    """
    switch = PatchPolicy(model, policy, matmul_spec, specs)  # a policy's refusals by name, before anything changes
    spec, backend = switch.matmul
    matmul = PatchMatmul(spec, switch.logprobs[0], backend)  # a bad spec is a SpecError before anything else
    check_version(allow_untested)
    _validate(model, unknown, matmul)
    p = Patch(model, matmul, unknown, switch)
    p._take(list(model.named_modules()))
    if hasattr(model, "generate"):
        p._set_attr(model, "generate", _GuardedGenerate(model, model.generate))
    p.active = True
    _watch_registrations()
    # transformers' continuous-batching engine runs a patched model on lockstep
    engine_install.install(patch_owner, token_logprobs, allow_untested or os.environ.get(_ENV_ANY) == "1")
    return p


def patch(model, **kwargs) -> Patch:
    """Context-manager form of :func:`apply`: ``with lt.patch(model): ...`` reverts on exit."""
    return apply(model, **kwargs)


def revert(model) -> None:
    """Revert the patch applied to ``model`` (the same as its handle's ``revert()``): e.g. on a
    ``copy.deepcopy`` of a patched model, whose copy of the patch has no other handle."""
    p = patch_owner(model) if isinstance(model, torch.nn.Module) else None
    if p is None:
        raise InputError(f"model ({type(model).__name__}) is not patched by lockstep: nothing to revert")
    if p.model is not model:
        raise InputError(f"model ({type(model).__name__}) is part of a patch applied to a {type(p.model).__name__}: "
                         "revert that model (or its handle) instead")
    p.revert()


# ---------------------------------------------------------------- log-probs


def token_logprobs(model, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """float32 ``log p(tokens | hidden)`` with the model's LM head (hal.token_logprobs).

    ``top_k`` / ``top_p``: the log-prob under the distribution top-k / top-p (nucleus) sampling draws
    from -- softmax(logits / temperature) renormalised over each row's kept set, decided by
    ``hal.sampling.kept_set`` (top-k: the k highest scores, ties kept; top-p, after top-k: the smallest set of
    most probable tokens whose lockstep-softmax mass reaches top_p, summed exactly, ties kept), the value
    the continuous-batching engine records under lockstep (``hal.sampling.recorded_logprobs``). A token outside its
    row's kept set is refused (InputError).

    ``hidden [..., H]`` are final-normed hidden states (``model.model(...).last_hidden_state`` or
    ``output_hidden_states=True``'s last entry); ``tokens [...]`` the next tokens (or ``[..., K]``: K tokens of
    each row, each value the bits it has asked alone: how a trainer recomputes vLLM's ``logprobs=N``
    alternatives). On a model patched with ``matmul_spec``, the token_logprobs spec whose logits use that dot
    (exact s -> ``TokenLogprobsSpec(matmul=ExactMatmulSpec(s))``, with the patch's prepared LM head); else the default.
    """
    sampling = Sampling(temperature, top_k, top_p)
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise InputError("model has no output embedding (LM head) with a weight")
    if getattr(head, "bias", None) is not None:
        raise UnsupportedError("LM heads with a bias are not supported by hal.token_logprobs")
    pending = head.__dict__.get("forward")
    if isinstance(pending, _Pending):  # a head attached since the patch (resize_token_embeddings): patch it first
        pending.patch.refresh()
    p = patch_owner(head)
    weight, spec, backend = (head.weight, None, None) if p is None else (
        p.matmul.weight(head.weight, (id(head), "weight")), p.matmul.logprobs_spec, p.switch.logprobs[1])
    scores = None
    if sampling.filters:  # the kept set is decided on the logits the model's own LM head computes
        with torch.no_grad():
            scores = sampling_scores(head(hidden.reshape(-1, hidden.shape[-1])), temperature)
    return recorded_logprobs(weight, hidden, tokens, sampling, spec=spec, scores=scores, backend=backend)


from .verify import audit, verify  # noqa: E402  (verify uses the names above)
