"""TRL's GRPO with transformers' continuous-batching engine as sampler, keeping the engine's log-probs.

    from hal.integrations.trl import GRPOTrainer          # a subclass of trl.GRPOTrainer (TRL 1.16.x)
    args = GRPOConfig(..., use_transformers_continuous_batching=True, beta=0.04)
    trainer = GRPOTrainer(model=path, args=args, ..., lockstep=True)   # lt.patch on policy and reference
    trainer.train()
    trainer.mismatch_records       # per generation: sampler and trainer log-probs (raw tensors), mask, hal.rl metrics

TRL 1.16 samples with ``model.generate_batch`` when ``use_transformers_continuous_batching=True`` but
drops the log-probs the engine recorded (``logprobs = None`` after ``generate_batch`` in
``GRPOTrainer._generate_single_turn``); it keeps sampler log-probs only from vLLM, and its
importance-sampling correction and mismatch metrics (``sampling/sampling_logp_difference/*``,
``sampling/importance_sampling_ratio/*``) run only under ``use_vllm``. This subclass:

1. asks the engine to record log-probs (``ContinuousBatchingConfig(return_logprobs=True)``) and keeps
   them: a recorder around ``generate_batch`` reads each request's ``GenerationOutput.logprobs``
   (the engine's float32 values) and returns them where TRL's vLLM path returns its own;
2. opens TRL's own correction for them: TRL tests ``self.use_vllm`` to decide whether the sampler's
   log-probs exist, so the trainer sets it while it scores a batch and computes the loss (and only
   there; sampling and everything else see the configured value). TRL then computes
   ``old_per_token_logps`` at the sampler's weights, its IS ratio (``vllm_importance_sampling_mode``,
   ``vllm_importance_sampling_clip_*``), applies it to the loss and logs its metrics;
3. logs hal.rl's metrics of the same pair every step, under ``lockstep/`` (:data:`METRICS`).

On a lockstep-patched policy (``lockstep=True``, or a policy patched before) the reference model is
patched too, and the trainer's log-probs (policy, at the sampler's weights, and reference) are
``lt.token_logprobs(model, hidden, tokens, temperature)`` of a teacher-forced forward with each
request's own positions -- the value the engine records under lockstep -- instead of TRL's fused LM
head (torch's log-softmax). On a stock model TRL's computation is unchanged.

Temperature: both sides use ``args.temperature`` (the engine's logits processor and the trainer's
``logits / temperature``). top-k, top-p, min-p, a repetition penalty and extra ``generation_kwargs``
change the distribution the engine samples from but not the one TRL's trainer scores, so they are
refused by name. Refused too: vLLM, tools, ``rollout_func``, multimodal inputs (no engine log-probs
to keep, or a different sampler). The TRL versions in :data:`SUPPORTED` are tested; others are
refused by name (``allow_untested=True`` at the caller's risk): this module relies on where TRL
reads ``use_vllm`` and on the signature of ``_get_per_token_logps_and_entropies``.
"""
from __future__ import annotations

import contextlib

import torch
import trl

from .. import rl
from ..errors import InputError, UnsupportedError
from . import transformers as lt
from .transformers.modules import patch_owner

__all__ = ["GRPOTrainer", "check_version", "teacher_forced_logprobs", "engine_supports_lockstep", "SUPPORTED",
           "METRICS"]

SUPPORTED = ((1, 16), (1, 17))  # [low, high): TRL 1.16.x (tested: 1.16.0)

# hal.rl.mismatch_metrics fields logged every step as "lockstep/<name>" (trainer at the sampler's weights vs engine)
METRICS = ("max_abs_log_ratio", "mean_abs_log_ratio", "share_bits_differ", "k1", "k3", "ess_tokens",
           "ess_sequences")

# GRPOConfig fields that change what the engine samples from, with the value that leaves it alone
_SAMPLING_DEFAULTS = {"top_k": (0, None), "top_p": (1.0,), "min_p": (None, 0.0), "repetition_penalty": (1.0,),
                      "generation_kwargs": (None,)}


def check_version(allow_untested: bool = False) -> str:
    """The installed TRL version; UnsupportedError naming it outside :data:`SUPPORTED`."""
    from ._versions import check_supported
    return check_supported("TRL", trl.__version__, SUPPORTED, "hal.integrations.trl",
                           ": it hooks GRPOTrainer internals (where the engine's log-probs are dropped, where use_vllm "
                           "gates the IS correction) that another release may move. Install trl==1.16.0, or pass "
                           "allow_untested=True at your own risk.", allow_untested)


def _check_args(args) -> None:
    """Refuse (InputError, nothing built) a configuration whose sampler log-probs this trainer cannot keep exactly."""
    if args is None or not getattr(args, "use_transformers_continuous_batching", False):
        raise InputError("hal.integrations.trl.GRPOTrainer keeps the log-probs of transformers' continuous-batching "
                         "engine: set GRPOConfig(use_transformers_continuous_batching=True)")
    if args.use_vllm:
        raise InputError("hal.integrations.trl.GRPOTrainer: use_vllm=True already keeps vLLM's log-probs in TRL; "
                         "this trainer is for use_transformers_continuous_batching=True")
    if not args.vllm_importance_sampling_correction:
        raise InputError("hal.integrations.trl.GRPOTrainer feeds the engine's log-probs to TRL's importance-sampling "
                         "correction: vllm_importance_sampling_correction=False would drop them again")
    for name, neutral in _SAMPLING_DEFAULTS.items():
        value = getattr(args, name)
        if value not in neutral:
            raise InputError(f"GRPOConfig({name}={value!r}) is not supported by hal.integrations.trl: it changes the "
                             "distribution the engine samples from (and records log-probs of) but not the one "
                             f"TRL's trainer scores, so the two would differ by construction; leave {name} at "
                             f"{neutral[0]!r} (temperature is supported)")
    cb = dict(args.transformers_continuous_batching_config or {})
    if cb.get("return_logprobs", True) is not True:
        raise InputError("transformers_continuous_batching_config has return_logprobs=False: the engine would "
                         "record no log-probs to keep")
    cb["return_logprobs"] = True
    args.transformers_continuous_batching_config = cb


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` that keeps the continuous-batching engine's log-probs (see the module docstring).

    ``lockstep=True`` patches the policy (``lt.apply``) before training; the reference model is patched
    whenever the policy is (same matmul spec). ``mismatch_records`` holds, per generated batch, the
    engine's log-probs ``sampler`` and the trainer's at the same weights ``trainer`` ([B, T] float32),
    the completion ``mask`` and the :class:`hal.rl.MismatchMetrics`.
    """

    def __init__(self, *args, lockstep: bool = False, allow_untested: bool = False, **kwargs):
        check_version(allow_untested)
        if args:
            raise InputError("hal.integrations.trl.GRPOTrainer takes keyword arguments only (model=, args=, ...)")
        _check_args(kwargs.get("args"))
        for name in ("rollout_func", "tools", "environment_factory"):
            if kwargs.get(name) is not None:
                raise InputError(f"hal.integrations.trl.GRPOTrainer does not support {name}: its completions do "
                                 "not all come from one generate_batch call whose log-probs can be kept")
        super().__init__(**kwargs)
        self.mismatch_records: list[dict] = []
        self._patches = []
        if lockstep and patch_owner(self.model) is None:
            self._patches.append(lt.apply(self.model))
        policy = patch_owner(self.model)
        if policy is not None and self.ref_model is not None and patch_owner(self.ref_model) is None:
            same = dict(matmul_spec=policy.matmul.spec) if policy.policy == "strict" else dict(policy=policy.policy)
            self._patches.append(lt.apply(self.ref_model, **same))  # the policy model's specs

    # ------------------------------------------------------------ keeping the engine's log-probs

    @contextlib.contextmanager
    def _sampler_logprobs_gate(self, on: bool):
        """TRL reads ``use_vllm`` as "the sampler's log-probs exist": set it to ``on`` for the block."""
        before = self.use_vllm
        self.use_vllm = on
        try:
            yield
        finally:
            self.use_vllm = before

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        model = self.accelerator.unwrap_model(self.model_wrapped)
        outputs = []
        had = "generate_batch" in model.__dict__
        engine = model.generate_batch

        def recording(*a, **k):
            out = engine(*a, **k)
            outputs.append(out)
            return out

        model.__dict__["generate_batch"] = recording
        try:
            with self._sampler_logprobs_gate(False):
                completion_ids, dropped = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        finally:
            if had:
                model.__dict__["generate_batch"] = engine
            else:
                model.__dict__.pop("generate_batch", None)
        if len(outputs) != 1:
            raise RuntimeError(f"expected TRL to sample with one generate_batch call on the policy, saw {len(outputs)}:"
                               " this TRL version samples differently (hal.integrations.trl.SUPPORTED)")
        results = list(outputs[0].values())  # the order TRL takes its completion_ids in
        logprobs = []
        for i, (res, ids) in enumerate(zip(results, completion_ids, strict=True)):
            if list(res.generated_tokens) != list(ids):
                raise RuntimeError(f"request {i}: the engine's tokens are not TRL's completion {i}")
            if res.error is not None or len(res.logprobs) != len(res.generated_tokens):
                raise RuntimeError(f"request {res.request_id}: the engine recorded {len(res.logprobs)} log-probs for "
                                   f"{len(res.generated_tokens)} tokens (error: {res.error})")
            logprobs.append(list(res.logprobs))
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        with self._sampler_logprobs_gate(True):
            out = super()._generate_and_score_completions(inputs)
        self._record_mismatch(out)
        return out

    def _compute_loss(self, model, inputs):
        with self._sampler_logprobs_gate(True):
            return super()._compute_loss(model, inputs)

    def _record_mismatch(self, out) -> None:
        q, p = out.get("sampling_per_token_logps"), out.get("old_per_token_logps")
        if q is None or p is None:
            raise RuntimeError("TRL computed no sampler/trainer log-prob pair for this batch (TRL version changed?)")
        mask = out["completion_mask"].bool()
        p = p.float()
        m = rl.mismatch_metrics(p, q, mask=mask)
        mode = "train" if self.model.training else "eval"
        for name in METRICS:
            self._metrics[mode][f"lockstep/{name}"].append(getattr(m, name))
        self._metrics[mode]["lockstep/bits_differ"].append(round(m.share_bits_differ * m.tokens))
        self._metrics[mode]["lockstep/tokens"].append(m.tokens)
        self.mismatch_records.append(dict(step=self.state.global_step, sampler=q.detach().cpu(),
                                          trainer=p.detach().cpu(), mask=mask.cpu(),
                                          is_ratio=out["importance_sampling_ratio"].detach().cpu(), metrics=m))

    # ------------------------------------------------------------ the trainer's log-probs under lockstep

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        inner = self.accelerator.unwrap_model(model)
        if patch_owner(inner) is None:
            if any(patch_owner(m) is not None for m in inner.modules()):  # e.g. PEFT around a patched model
                raise UnsupportedError(f"hal.integrations.trl: the trainer's model ({type(inner).__name__}) wraps a "
                                       "lockstep-patched model; its log-probs would be TRL's stock ones. Patch the "
                                       "model the trainer holds (lockstep=True), without PEFT around it")
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        if any(v is not None for v in multimodal.values()) or compute_aux_loss:
            raise UnsupportedError("hal.integrations.trl: multimodal inputs and the MoE aux loss are not supported "
                                   "on a lockstep-patched policy")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            lp, ent = teacher_forced_logprobs(inner, input_ids[rows], attention_mask[rows], logits_to_keep,
                                              self.temperature, compute_entropy)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None

    def revert_patches(self) -> None:
        """Revert the lockstep patches this trainer applied (policy and/or reference model)."""
        for p in reversed(self._patches):
            p.revert()
        self._patches = []


def teacher_forced_logprobs(model, input_ids, attention_mask, logits_to_keep: int, temperature: float,
                            compute_entropy: bool = False):
    """The trainer's log-probs on a lockstep-patched model: float32 ``[B, logits_to_keep]`` of the last
    ``logits_to_keep`` tokens of each row, ``lt.token_logprobs`` over ``logits / temperature``.

    Rows are TRL's: left-padded prompt + right-padded completion with ``attention_mask``. Positions are
    each request's own (``cumsum(mask) - 1``), as the engine gives them; TRL's default (``0 .. L-1`` over
    the padded row) would shift a padded prompt's rotary angles and change the bits. Entropy (optional,
    a metric and TRL's entropy mask, not part of the sampler/trainer match) is computed without grad.
    """
    pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                              use_cache=False).last_hidden_state
    h, tgt = hidden[:, -logits_to_keep - 1:-1], input_ids[:, -logits_to_keep:]
    lp = lt.token_logprobs(model, h, tgt, temperature=temperature)
    entropy = None
    if compute_entropy:
        with torch.no_grad():
            logp = torch.log_softmax(model.get_output_embeddings()(h).float() / temperature, -1)
            entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


def engine_supports_lockstep() -> bool:
    """Whether hal.integrations.transformers runs transformers' continuous-batching engine on lockstep: its
    ``ENGINE_SUPPORTED`` flag, or the engine adapter (``hal.integrations.transformers.engine``) it installs on patch."""
    return bool(getattr(lt, "ENGINE_SUPPORTED", False)) or hasattr(lt, "engine")

