"""TorchTitan trains, transformers samples: one model in two codebases, the same bits.

    from hal.integrations import torchtitan as ltt
    from hal.integrations import transformers as lt
    cfg = ltt.LockstepConverter.Config().build().convert(ltt.qwen3_config_from_hf(hf_model.config))
    #   or: torchtitan.models.qwen3.model_registry(flavor, converters=[ltt.LockstepConverter.Config()])
    #   LockstepConverter.Config(policy="fast"): linears, attention, the GDN rule on the fast specs (lt.patch(hf_model, policy="fast"))
    trainer = cfg.build()                                  # TorchTitan's own Qwen3 model code
    ltt.load_from_hf(trainer, hf_model)                    # TorchTitan's Qwen3StateDictAdapter.from_hf
    with lt.patch(hf_model):                               # the HF sampler
        out = hf_model.generate(...)
    logits = ltt.forward(trainer, tokens, positions)       # TorchTitan's document packing (its own masks)
    loss.backward(); opt.step()
    ltt.sync_to_hf(trainer, hf_model)                      # the RL weight sync (adapter.to_hf), refuses to lose a head

:class:`LockstepConverter` is a TorchTitan ``ModelConfigConverter``: it swaps the *leaf* configs of a
model config (linears, RMSNorms, cos/sin RoPE, varlen attention, SwiGLU feed-forward) for lockstep
subclasses (torchtitan/modules.py), so TorchTitan's decoder, blocks and attention module keep running.
Supported: TorchTitan's dense Qwen3 and text Qwen3.5 (Gated DeltaNet hybrid, ``qwen3_5_config_from_hf``;
its leaves in torchtitan/qwen35_modules.py) of the versions in ``SUPPORTED``; MoE configs are refused by path.
:func:`compile_blocks` is TorchTitan's per-block compile. torchtitan is imported only when one of these
functions is called (TorchTitan's qwen3_5, which imports ``fla``, only for Qwen3.5 configs).
"""
from __future__ import annotations

import dataclasses
import os

import torch

import hal
from ...conformance.bits import same_bits
from ...errors import InputError, UnsupportedError
from ...spec import STRICT

__all__ = ["check_version", "SUPPORTED", "convert", "qwen3_config_from_hf", "qwen3_5_config_from_hf", "forward",
           "compile_blocks",
           "load_from_hf",
           "to_hf_state_dict", "sync_to_hf", "token_logprobs", "first_divergence"]

SUPPORTED = ((0, 3), (0, 4))  # [low, high): the TorchTitan releases whose module forwards torchtitan/modules.py mirrors
_ENV_ANY = "LOCKSTEP_TORCHTITAN_ANY_VERSION"


def check_version(allow_untested: bool = False) -> str:
    """The installed torchtitan version; raises UnsupportedError outside ``SUPPORTED``.

    The lockstep modules subclass TorchTitan's and rely on its forwards' signatures and on which
    leaf computes what; another release may change either. ``allow_untested=True`` (or
    LOCKSTEP_TORCHTITAN_ANY_VERSION=1) skips the check at the caller's risk."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("torchtitan")
    except PackageNotFoundError:
        raise UnsupportedError("torchtitan is not installed: pip install 'lockstep[torchtitan]'") from None
    from .._versions import check_supported
    return check_supported("torchtitan", v, SUPPORTED, "lockstep's integration",
                           "; its module forwards may differ from the ones lockstep replaces. "
                           f"Set {_ENV_ANY}=1 to try anyway and check parity with first_divergence().",
                           allow_untested or os.environ.get(_ENV_ANY) == "1")


# ---------------------------------------------------------------- the converter


def _config_children(cfg):
    """(name, value) of a config's fields that hold configs or lists of configs."""
    for f in dataclasses.fields(cfg):
        yield f.name, getattr(cfg, f.name)


def _is_qwen3_5(model_config) -> bool:
    return type(model_config).__module__.startswith("torchtitan.models.qwen3_5")


def _exact_config_types(qwen3_5: bool):
    """Configs whose own forward is exact (gathers, views, splits, residual adds) or only calls its children."""
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear
    from torchtitan.models.common.embedding import Embedding
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
    exact = (Embedding.Config, GQAttention.Config, FusedQKVLinear.Config, QKVLinear.Config, Qwen3Model.Config,
             Qwen3TransformerBlock.Config)
    if qwen3_5:
        from torchtitan.models.qwen3_5.model import Qwen35Model, Qwen35TransformerBlock
        exact += (Qwen35Model.Config, Qwen35TransformerBlock.Config)
    return exact


def _replacements(qwen3_5: bool):
    """(stock config -> lockstep config, configs only read for weights by their lockstep parent, vision configs)."""
    from . import modules as tm
    if not qwen3_5:  # Qwen3.5's modules import TorchTitan's qwen3_5 package, which imports fla: only when needed
        return dict(tm.REPLACEMENTS), (), {}
    from torchtitan.models.common import Conv1d
    from . import qwen35_modules as tq
    return {**tm.REPLACEMENTS, **tq.REPLACEMENTS}, ((Conv1d.Config, tq.WEIGHT_HOLDERS),), tq.VISION


# config fields whose module the parent builds under another attribute name (stock= takes module paths)
_MODULE_NAMES = {("Qwen35TransformerBlock.Config", "attention"): "attn",
                 ("Qwen35TransformerBlock.Config", "delta_net"): "attn"}


def _child_path(kind, path, field):
    name = _MODULE_NAMES.get((kind.__qualname__, field), field)
    return f"{path}.{name}" if path else name


def convert(model_config, stock=(), allow_untested: bool = False, policy: str = "strict"):
    """A copy of TorchTitan ``model_config`` whose leaves compute with lockstep's ops.

    ``policy``: "strict" (default), "fast" or "exact", as ``lt.patch(model, policy=...)``: the linears, the varlen
    attention and Qwen3.5's gated delta rule kernel take their op's spec under it (``hal.spec.POLICY_SPECS``,
    ``hal.dispatch.switched_spec``; the other leaves, the GDN conv and gates included, stay strict),
    on the backend that claims it for the device and dtype they run on: checked at every eager call (the device is
    not known here), refused by name (UnsupportedError naming the policy and the device).

    ``stock``: module paths (TorchTitan FQNs, e.g. ``"layers.1.ffn_norm"``) left as they are, everything
    inside them included, for bisecting a divergence and for negative controls. Refuses (UnsupportedError naming every path)
    configs it does not know: MoE, Gated DeltaNet (Qwen3.5), complex RoPE, SDPA, ...
    TorchTitan's FlexAttention (the block-causal document mask of its language models) becomes
    lockstep's varlen attention over the same documents; the decoder then builds varlen metadata.
    """
    if policy not in hal.spec.POLICY_SPECS:
        raise InputError(f"policy must be one of {tuple(hal.spec.POLICY_SPECS)}, got {policy!r}")
    check_version(allow_untested)
    from torchtitan.models.common.attention import FlexAttention
    from . import modules as tm
    stock = set(stock)
    qwen3_5 = _is_qwen3_5(model_config)
    exact = _exact_config_types(qwen3_5)
    replacements, weight_holders, vision = _replacements(qwen3_5)
    unknown, used = [], set()

    def walk(cfg, path):
        if isinstance(cfg, list):
            return [walk(c, f"{path}.{i}" if path else str(i)) for i, c in enumerate(cfg)]
        if not dataclasses.is_dataclass(cfg) or not hasattr(cfg, "build"):
            return cfg
        if path in stock:
            used.add(path)
            return cfg
        kind = type(cfg)
        if kind in vision:  # kept as built (weights only): its lockstep subclass refuses to run
            return vision[kind](**dict(_config_children(cfg)))
        if kind in vision.values():
            return cfg
        if any(kind is k and path.rsplit(".", 1)[-1] in names for k, names in weight_holders):
            return cfg
        kids = {name: walk(val, _child_path(kind, path, name)) for name, val in _config_children(cfg)}
        if kind in replacements:
            return _with_policy(replacements[kind], kids, policy)
        if kind is FlexAttention.Config:
            return tm.LockstepVarlenAttention.Config(policy=policy)
        if kind in replacements.values():  # converted already
            return dataclasses.replace(cfg, **kids, **({"policy": policy} if _has_policy(kind) else {}))
        if kind not in exact:
            unknown.append(f"{path or '(root)'} ({kind.__qualname__})")
            return cfg
        return dataclasses.replace(cfg, **kids)

    out = walk(model_config, "")
    if unknown:
        raise UnsupportedError("lockstep's TorchTitan converter does not know these configs (they would keep "
                               "computing stock bits): " + ", ".join(unknown[:8]) + (" ..." if len(unknown) > 8 else ""),
                               unknown)
    missing = stock - used
    if missing:
        raise InputError(f"stock= names paths that are not modules of this config: {sorted(missing)}")
    return out


def _has_policy(config_class) -> bool:
    """Whether a lockstep leaf's config takes the converter's policy (its linears and its varlen attention)."""
    return any(f.name == "policy" for f in dataclasses.fields(config_class))


def _with_policy(config_class, kids: dict, policy: str):
    return config_class(**kids, **({"policy": policy} if _has_policy(config_class) else {}))


def _converter_class():
    from torchtitan.protocols.model import ModelConfigConverter

    class LockstepConverter(ModelConfigConverter):
        """TorchTitan ``ModelConfigConverter``: ``model_registry(flavor, converters=[LockstepConverter.Config()])``."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            stock: tuple = ()  # module paths left stock (see convert)
            allow_untested: bool = False
            policy: str = "strict"  # "fast" / "exact": the linears' and attention's specs (see convert)

        def __init__(self, config):
            self.config = config

        def convert(self, model_config):
            return convert(model_config, self.config.stock, self.config.allow_untested, self.config.policy)

    LockstepConverter.__module__ = __name__
    return LockstepConverter


def __getattr__(name):  # LockstepConverter subclasses a TorchTitan class: built on first use (so not in __all__)
    if name == "LockstepConverter":
        cls = _converter_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# ---------------------------------------------------------------- configs and weights from / to HF


def qwen3_config_from_hf(hf_config, allow_untested: bool = False):
    """TorchTitan's (stock) Qwen3 config for an HF ``Qwen3Config``, built with TorchTitan's own Qwen3 builders.

    Maps hidden_size -> dim, heads, head_dim (also the RoPE dim), intermediate_size -> hidden_dim,
    rope_theta, max_position_embeddings, rms_norm_eps (TorchTitan's builder fixes 1e-6: set on every
    norm), tie_word_embeddings -> enable_weight_tying. Varlen attention (packed documents)."""
    check_version(allow_untested)
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models import qwen3 as tq
    if getattr(hf_config, "model_type", None) != "qwen3":
        raise UnsupportedError(f"qwen3_config_from_hf needs an HF Qwen3Config, got model_type "
                               f"{getattr(hf_config, 'model_type', None)!r}")
    problems = []
    if getattr(hf_config, "use_sliding_window", False):
        problems.append("use_sliding_window=True")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}")
    if getattr(hf_config, "attention_bias", False):
        problems.append("attention_bias=True (TorchTitan's Qwen3 has no q/k/v biases)")
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r}")
    if problems:
        raise UnsupportedError("this Qwen3 config has no TorchTitan counterpart: " + "; ".join(problems), problems)
    c = hf_config
    head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    cfg = tq.Qwen3Model.Config(
        vocab_size=c.vocab_size, dim=c.hidden_size, norm=RMSNorm.Config(normalized_shape=c.hidden_size),
        enable_weight_tying=bool(c.tie_word_embeddings),
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=c.hidden_size),
        lm_head=Linear.Config(in_features=c.hidden_size, out_features=c.vocab_size),
        layers=tq._build_qwen3_layers(
            fuse_qkv=True, n_layers=c.num_hidden_layers, dim=c.hidden_size, n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads, head_dim=head_dim, hidden_dim=c.intermediate_size,
            attn_backend="varlen", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=c.max_position_embeddings,
                                                          theta=theta)))
    _set_norm_eps(cfg, float(c.rms_norm_eps))
    return cfg


def qwen3_5_config_from_hf(hf_config, allow_untested: bool = False):
    """TorchTitan's (stock) Qwen3.5 config for an HF ``Qwen3_5TextConfig`` (text ``Qwen3_5ForCausalLM``), built
    with TorchTitan's own Qwen3.5 builders (``_build_qwen35_layers``: GDN and full-attention layers, varlen).

    Maps the attention and Gated DeltaNet shapes (``linear_num_key_heads`` -> ``n_key_heads``, ...), the rotary
    dim ``head_dim * partial_rotary_factor``, rope_theta, mrope_section and rms_norm_eps. TorchTitan knows one
    layer pattern, a full-attention layer every ``full_attention_interval``: other ``layer_types`` are refused.
    The vision encoder TorchTitan always builds is the smallest it allows (text only: it never runs)."""
    check_version(allow_untested)
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models import qwen3_5 as tq
    from torchtitan.models.qwen3_5.rope import MRoPE
    c = getattr(hf_config, "text_config", hf_config)
    if getattr(c, "model_type", None) != "qwen3_5_text":
        raise UnsupportedError(f"qwen3_5_config_from_hf needs an HF Qwen3.5 text config, got model_type "
                               f"{getattr(c, 'model_type', None)!r}")
    types_ = list(c.layer_types)
    problems = []
    interval = types_.index("full_attention") + 1 if "full_attention" in types_ else len(types_) + 1
    want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types_))]
    if types_ != want:
        problems.append(f"layer_types {types_} (TorchTitan: a full-attention layer every N layers)")
    if getattr(c, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={c.hidden_act!r}")
    if getattr(c, "attention_bias", False):
        problems.append("attention_bias=True")
    if getattr(c, "linear_conv_kernel_dim", 4) != 4:
        problems.append(f"linear_conv_kernel_dim={c.linear_conv_kernel_dim} (TorchTitan's builder: 4)")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r}")
    if problems:
        raise UnsupportedError("this Qwen3.5 config has no TorchTitan counterpart: " + "; ".join(problems), problems)
    rotary_dim = int(c.head_dim * float(rope.get("partial_rotary_factor", 0.25)))
    vision = tq._qwen35_vision_encoder_config(dim=16, ffn_dim=16, num_layers=1, num_heads=1, patch_size=2,
                                              temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=c.hidden_size,
                                              num_position_embeddings=4)
    cfg = tq.Qwen35Model.Config(
        vocab_size=c.vocab_size, dim=c.hidden_size, norm=tq._offset_norm(c.hidden_size),
        tok_embeddings=Embedding.Config(num_embeddings=c.vocab_size, embedding_dim=c.hidden_size),
        lm_head=Linear.Config(in_features=c.hidden_size, out_features=c.vocab_size),
        layers=tq._build_qwen35_layers(
            rope=MRoPE.Config(dim=rotary_dim, max_seq_len=c.max_position_embeddings,
                              theta=float(rope.get("rope_theta", 10000.0)),
                              mrope_section=list(rope.get("mrope_section", [11, 11, 10]))),
            attn_backend="varlen", n_layers=c.num_hidden_layers, dim=c.hidden_size, n_heads=c.num_attention_heads,
            n_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rotary_dim=rotary_dim,
            hidden_dim=c.intermediate_size, n_key_heads=c.linear_num_key_heads,
            n_value_heads=c.linear_num_value_heads, key_head_dim=c.linear_key_head_dim,
            value_head_dim=c.linear_value_head_dim, full_attention_interval=interval),
        vision_encoder=vision)
    _set_norm_eps(cfg, float(c.rms_norm_eps))
    return cfg


def _set_norm_eps(cfg, eps):
    from torchtitan.models.common.nn_modules import RMSNorm
    if isinstance(cfg, list):
        for c in cfg:
            _set_norm_eps(c, eps)
        return
    if not dataclasses.is_dataclass(cfg):
        return
    if isinstance(cfg, RMSNorm.Config) or type(cfg).__qualname__ in ("OffsetRMSNorm.Config", "RMSNormGated.Config"):
        cfg.eps = eps
    for _, val in _config_children(cfg):
        _set_norm_eps(val, eps)


def _is_qwen3_5_model(model) -> bool:
    return type(model).__module__.startswith("torchtitan.models.qwen3_5")


def _adapter(model):
    """TorchTitan's own HF state-dict adapter for ``model`` (Qwen3 or Qwen3.5)."""
    if _is_qwen3_5_model(model):
        from torchtitan.models.qwen3_5.model import Qwen35Model
        from torchtitan.models.qwen3_5.state_dict_adapter import Qwen35StateDictAdapter
        if isinstance(model, Qwen35Model):
            return Qwen35StateDictAdapter(model.config, None)
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    if not isinstance(model, Qwen3Model):
        raise UnsupportedError(f"weights move only for TorchTitan's Qwen3Model and Qwen35Model here, got "
                               f"{type(model).__name__}")
    return Qwen3StateDictAdapter(model.config, None)


# TorchTitan's Qwen3.5 adapter speaks the multimodal checkpoint's names (model.language_model.*); a text
# Qwen3_5ForCausalLM names its decoder model.*
_QWEN35_HF_PREFIX = ("model.", "model.language_model.")


def _hf_state_dict(hf_model, model=None):
    sd = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("inv_freq")}
    if model is not None and _is_qwen3_5_model(model) and not any(k.startswith(_QWEN35_HF_PREFIX[1]) for k in sd):
        old, new = _QWEN35_HF_PREFIX
        sd = {(new + k[len(old):] if k.startswith(old) else k): v for k, v in sd.items()}
    return sd


def _from_adapter_names(model, hf_model, sd):
    """``to_hf``'s names back to ``hf_model``'s own (a text Qwen3.5 has no ``language_model`` level)."""
    if not _is_qwen3_5_model(model) or any(k.startswith(_QWEN35_HF_PREFIX[1]) for k in hf_model.state_dict()):
        return sd
    new, old = _QWEN35_HF_PREFIX
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in sd.items()}


def _check_tying(model, hf_model):
    hf_tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    if hf_tied != bool(model.enable_weight_tying):
        raise UnsupportedError(f"the HF model {'ties' if hf_tied else 'does not tie'} its LM head to the embedding "
                               f"but the TorchTitan model {'does' if model.enable_weight_tying else 'does not'}: a sync "
                               "would lose one of the two heads. Build both with the same tie_word_embeddings "
                               "(TorchTitan's Qwen3.5 never ties: use an untied HF Qwen3.5).")


def load_from_hf(model, hf_model) -> None:
    """Copy an HF Qwen3 model's weights into TorchTitan ``model`` with TorchTitan's ``Qwen3StateDictAdapter.from_hf``
    (fused QKV merged by TorchTitan's own load hook). Every TorchTitan parameter must be filled; the HF model's
    RoPE table must be the float32 one (:func:`check_rotary_table`)."""
    _check_tying(model, hf_model)
    check_rotary_table(hf_model)
    sd = _adapter(model).from_hf(_hf_state_dict(hf_model, model))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith("vision_encoder.")]  # text-only HF Qwen3.5: never runs
    if unexpected or missing:
        raise InputError(f"HF weights do not fill the TorchTitan model: missing {missing}, unexpected {unexpected}")


def to_hf_state_dict(model) -> dict:
    """TorchTitan ``model``'s weights under HF names (``Qwen3StateDictAdapter.to_hf``; fused QKV split by its hook)."""
    return _adapter(model).to_hf(model.state_dict())


def sync_to_hf(model, hf_model) -> None:
    """The RL weight sync: the trainer's weights into the HF sampler, in place (``copy_``, so a lockstep patch
    on ``hf_model`` keeps its modules). Refuses a sync that would lose the tied / untied LM head, and one that
    leaves an HF weight unset or changes a shape or dtype."""
    _check_tying(model, hf_model)
    check_rotary_table(hf_model)
    sd = _from_adapter_names(model, hf_model, to_hf_state_dict(model))
    target = dict(hf_model.named_parameters())
    if not any(k.startswith("model.visual.") for k in target):
        sd = {k: v for k, v in sd.items() if not k.startswith("model.visual.")}
    if hf_model.config.tie_word_embeddings:
        target.pop("lm_head.weight", None)
    missing, extra = sorted(set(target) - set(sd)), sorted(set(sd) - set(target))
    if missing or extra:
        raise InputError(f"trainer and sampler weights do not match: not in the trainer {missing}, not in the sampler "
                         f"{extra}")
    for k, t in target.items():
        if sd[k].shape != t.shape or sd[k].dtype != t.dtype:
            raise InputError(f"weight {k}: trainer {tuple(sd[k].shape)} {sd[k].dtype}, sampler {tuple(t.shape)} "
                             f"{t.dtype}")
    with torch.no_grad():
        for k, t in target.items():
            t.copy_(sd[k])


def check_rotary_table(hf_model) -> None:
    """Refuse an HF model whose RoPE ``inv_freq`` is not the float32 table TorchTitan's side computes:
    ``model.to(torch.bfloat16)`` rounds HF's ``inv_freq`` buffer to bf16 (``from_pretrained(dtype=...)``
    and :func:`cast_hf` keep it float32), which would rotate by other angles."""
    from .modules import torch_inv_freq
    for name, buf in hf_model.named_buffers():
        if name.endswith("rotary_emb.inv_freq"):
            cfg = getattr(hf_model.config, "text_config", hf_model.config)
            rope = getattr(cfg, "rope_parameters", None) or {}
            dim = int((cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads)
                      * float(rope.get("partial_rotary_factor", 1.0)))
            want = torch_inv_freq(dim, float(rope.get("rope_theta", 10000.0)))
            if buf.dtype != torch.float32 or not torch.equal(buf.cpu().view(torch.int32), want.view(torch.int32)):
                raise UnsupportedError(f"{name} is not the float32 table theta ** (-2i/d) ({buf.dtype}); was the model "
                                       "cast with .to(dtype)? Build it with from_pretrained(dtype=...) or use "
                                       "hal.integrations.torchtitan.cast_hf(model, dtype)")


def cast_hf(hf_model, dtype):
    """``hf_model.to(dtype)`` keeping the RoPE ``inv_freq`` buffers float32 (as ``from_pretrained(dtype=)`` does)."""
    keep = {n: b.clone() for n, b in hf_model.named_buffers() if n.endswith("inv_freq")}
    hf_model.to(dtype)
    for n, b in keep.items():
        owner, attr = n.rsplit(".", 1)
        setattr(hf_model.get_submodule(owner), attr, b)
    return hf_model


# ---------------------------------------------------------------- torch.compile


def compile_blocks(model, backend: str = "inductor") -> None:
    """TorchTitan's per-block compile (``torchtitan.distributed.compile.apply_compile``: every transformer block
    ``compile(fullgraph=True)``) on one device, without data or tensor parallelism. lockstep's ops are torch custom
    ops (``torch.ops.lockstep.*``): Inductor compiles the glue around them and keeps their bits."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend), parallel_dims=dims)


# ---------------------------------------------------------------- log-probs and divergence


def token_logprobs(model, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float32 ``log p(tokens | hidden)`` with the TorchTitan model's LM head (``hal.token_logprobs``).

    ``hidden``: the final-normed hidden states (the model's forward with ``model._skip_lm_head = True``,
    as TorchTitan's chunked loss does). The same call as ``lt.token_logprobs`` on the HF side: under the converter's
    policy (the LM head's, ``LockstepConverter.Config(policy=)``) the policy's token_logprobs spec, as an HF model
    patched with that policy records (refused by name where no backend claims it)."""
    from .modules import switched
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "bias", None) is not None:
        raise UnsupportedError("token_logprobs needs a TorchTitan model with a bias-free lm_head")
    spec, backend = switched(getattr(head, "policy", STRICT), "token_logprobs", hidden)
    return hal.token_logprobs(hidden, head.weight, tokens, temperature, spec=spec, backend=backend)


# Qwen3.5 modules without an HF counterpart (HF fuses q/k/v projections and convs, has no kernel module)
_HF_LAYER_NAMES = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                   "attention": "self_attn", "attention.q_norm": "self_attn.q_norm",
                   "attention.k_norm": "self_attn.k_norm", "attention.wo": "self_attn.o_proj", "feed_forward": "mlp",
                   "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                   "feed_forward.w2": "mlp.down_proj",
                   # Qwen3.5: ``attn`` is the full attention (self_attn) or the Gated DeltaNet (linear_attn)
                   "attn:full": "self_attn", "attn.q_norm:full": "self_attn.q_norm",
                   "attn.k_norm:full": "self_attn.k_norm", "attn.wo:full": "self_attn.o_proj",
                   "attn:linear": "linear_attn", "attn.in_proj_z:linear": "linear_attn.in_proj_z",
                   "attn.in_proj_a:linear": "linear_attn.in_proj_a", "attn.in_proj_b:linear": "linear_attn.in_proj_b",
                   "attn.norm:linear": "linear_attn.norm", "attn.out_proj:linear": "linear_attn.out_proj"}


def _hf_name(tt_name: str, linear_layers=()) -> str | None:
    """The HF module computing what TorchTitan module ``tt_name`` computes (None: no counterpart).

    ``linear_layers``: indices of Qwen3.5's Gated DeltaNet layers (the others' ``attn`` is full attention)."""
    fixed = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "lm_head": "lm_head"}
    if tt_name in fixed:
        return fixed[tt_name]
    parts = tt_name.split(".")
    if parts[0] != "layers" or len(parts) < 3:
        return None
    rest = ".".join(parts[2:])
    if parts[2] == "attn":
        rest += ":linear" if int(parts[1]) in linear_layers else ":full"
    hf = _HF_LAYER_NAMES.get(rest)
    return None if hf is None else f"model.layers.{parts[1]}.{hf}"


def _linear_layers(model) -> set:
    return {int(name) for name, layer in getattr(model, "layers").items()
            if getattr(layer, "full_attn", True) is False}


_NO_VISION = {"image_id": -1, "video_id": -1}  # Qwen3.5's forward reads these ids even for text batches


def forward(model, tokens: torch.Tensor, positions: torch.Tensor, attention_masks=None):
    """TorchTitan ``model``'s packed training forward on ``tokens, positions [1, T]`` (positions restarting at 0
    per document), with its own document masks (``get_attention_masks``) unless given: the one call for Qwen3
    (``model(tokens, positions, masks)``) and Qwen3.5 (keywords, text only)."""
    masks = model.get_attention_masks(positions) if attention_masks is None else attention_masks
    if _is_qwen3_5_model(model):
        return model(tokens, attention_masks=masks, positions=positions, special_tokens=_NO_VISION)
    return model(tokens, positions, masks)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _main_input(args, kwargs):
    """The hidden-state input of a module call (HF's decoder passes ``hidden_states=`` by keyword)."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key]
    return None


def first_divergence(model, hf_model, tokens: torch.Tensor, positions: torch.Tensor):
    """Run TorchTitan ``model`` (packed, its varlen metadata) and ``hf_model`` (packed row, ``position_ids``) on the
    same tokens and return ``(torchtitan_name, hf_name)`` of the module that introduced the first difference: the
    first, in TorchTitan's order of completion, whose input bits agree with its HF counterpart's and whose output
    bits do not. None when every compared output agrees.

    ``tokens``, ``positions``: ``[1, T]``, positions restarting at 0 for each packed document."""
    seen = {"tt": {}, "hf": {}}
    order, hooks = [], []
    hf_mods = dict(hf_model.named_modules())

    def record(side, name):
        def hook(mod, args, kwargs, out):
            x = _main_input(args, kwargs)
            seen[side][name] = (None if x is None else x.detach().reshape(-1), _first(out).detach().reshape(-1))
            if side == "tt":
                order.append(name)
        return hook

    linear = _linear_layers(model)
    for name, mod in model.named_modules():
        hf = _hf_name(name, linear)
        if hf is None or hf not in hf_mods:
            continue
        hooks.append(mod.register_forward_hook(record("tt", name), with_kwargs=True))
        hooks.append(hf_mods[hf].register_forward_hook(record("hf", name), with_kwargs=True))
    try:
        with torch.no_grad():
            forward(model, tokens, positions)
            hf_model(input_ids=tokens, position_ids=positions, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    differing = []
    for name in order:
        (xa, ya), (xb, yb) = seen["tt"][name], seen["hf"].get(name, (None, None))
        if yb is None or not same_bits(ya, yb):
            differing.append(name)
            if xa is not None and xb is not None and same_bits(xa, xb):
                return name, _hf_name(name, linear)
    return (differing[0], _hf_name(differing[0], linear)) if differing else None
