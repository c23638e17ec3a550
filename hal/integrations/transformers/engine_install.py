"""Installing lockstep into transformers' continuous-batching engine: its wrapped entry points.

``install`` (called by ``lt.patch``, hal/integrations/transformers/__init__.py) replaces, once per process, six entry points of
the engine's ``ContinuousBatchingManager`` and its initialisation (``__init__``, ``switch_to_cb_friendly_attn``,
``_create_batch_processor``, ``add_request``, ``ensure_decode_fast_path_is_available``, ``group_layers_by_attn_type``)
with wrappers that act only for a lockstep-patched model (every other model sees transformers' own): they refuse by
name what lockstep cannot run exactly, show the engine an attention name it accepts, keep its decode fast path on,
leave a GDN hybrid's linear-attention layers out of its pages, and hand each new batch processor to
hal/integrations/transformers/engine.py (``attach``), which holds what then runs inside the engine.
"""
from __future__ import annotations

import math
import threading
import weakref

from ...errors import UnsupportedError
from .engine import GDN_LAYER_TYPES, attach, check_engine_model, is_gdn_model, sampling_settings

# the attention name the engine is shown while a lockstep-patched model runs in it: HF's engine
# accepts only paged|eager, sdpa and flash names, and a patched attention never consults it
_ENGINE_ATTN = "paged|eager"
#: id(config) -> weakref to a lockstep-patched GDN model's config shown to the engine (switch_to_cb_friendly_attn)
_gdn_engine_configs: dict = {}


def _without_gdn_layers(groups_fn, allocators):
    """The engine's layer grouping, with a lockstep GDN hybrid's linear-attention layers left out: the engine
    allocates pages for the attention layers only; lockstep keeps the GDN states (GdnEngineStates).
    ``allocators``: the engine's layer type -> cache allocator (transformers 5.18+, whose grouping is
    ``{type: [layer]}``); None on 5.17, whose grouping is ``(groups, group_types)``: each type's layers cut into
    groups of the gcd of the types' layer counts, as that release's own grouping cuts them."""
    def group_layers_by_attn_type(config):
        ref = _gdn_engine_configs.get(id(config))
        if ref is None or ref() is not config:
            return groups_fn(config)
        groups: dict = {}
        for i, t in enumerate(config.layer_types):
            if t in GDN_LAYER_TYPES:
                continue
            if t not in (allocators if allocators is not None else _ENGINE_5_17_LAYER_TYPES):
                raise UnsupportedError(f"layer {i} of type {t!r}: the continuous-batching engine has no cache for it")
            groups.setdefault(t, []).append(i)
        if allocators is not None:
            return groups
        size = math.gcd(*(len(layers) for layers in groups.values()))
        cut = [(t, layers[j:j + size]) for t, layers in groups.items() for j in range(0, len(layers), size)]
        return [layers for _, layers in cut], [t for t, _ in cut]
    return group_layers_by_attn_type


_ENGINE_5_17_LAYER_TYPES = ("full_attention", "sliding_attention")  # the layer types 5.17's engine caches


def _engine_refusal():
    """The UnsupportedError naming the engine functions of the installed release that differ, or None."""
    import transformers

    from .mirrored import check_sources
    try:
        check_sources(transformers.__version__, "engine",
                      hint=" Its continuous-batching engine cannot run a lockstep-patched model; model.generate and "
                           "the trainer's forward can.")
    except UnsupportedError as e:
        return e
    return None


def _install_refusal(Manager, refusal) -> None:
    init_manager = Manager.__init__

    def __init__(self, model, *args, **kwargs):
        if _lockstep_model(model):
            raise UnsupportedError(str(refusal))
        init_manager(self, model, *args, **kwargs)
    Manager.__init__ = __init__


_installed = False
_building = threading.local()  # .lockstep: a lockstep model's engine is being configured (this thread)


def _lockstep_model(model) -> bool:
    return _hooks["owner"](model) is not None


_hooks: dict = {}  # "owner": a module's lockstep patch or None; "token_logprobs": lt.token_logprobs


def install(owner, token_logprobs, allow_untested: bool = False) -> None:
    """Wrap the engine's entry points (once per process); models without a lockstep patch see HF's own.
    ``owner`` and ``token_logprobs`` come from hal.integrations.transformers (which imports this module).

    On a release whose engine functions differ from every release lockstep's engine support was tested with
    (mirrored.check_sources, part "engine"), only the manager's ``__init__`` is wrapped: it refuses a lockstep
    model's engine by name (``allow_untested``: wrap everything anyway, at the caller's risk)."""
    global _installed
    _hooks.update(owner=owner, token_logprobs=token_logprobs)
    if _installed:
        return
    from transformers.generation.continuous_batching import continuous_api as api
    Manager = api.ContinuousBatchingManager
    refusal = None if allow_untested else _engine_refusal()
    if refusal is not None:
        _install_refusal(Manager, refusal)
        _installed = True
        return
    switch, create = Manager.switch_to_cb_friendly_attn, Manager._create_batch_processor

    # The engine offers its decode fast path (block tables) only to flash attention on CUDA/XPU; lockstep's
    # serving core serves it on any device (serving.paged_attention), so it stays on for a lockstep model's engine.
    from transformers.generation.continuous_batching import initialization as init
    ensure_fast_path = init.ensure_decode_fast_path_is_available

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if not getattr(_building, "lockstep", False):
            return ensure_fast_path(config, cb_config, user_requested)
        allocators = getattr(init, "ATTN_TYPE_TO_ALLOCATOR", None)  # 5.18+ (5.17's cache checks its layer types)
        if allocators is not None and not all(allocators[t].supports_block_table
                                              for t in init.group_layers_by_attn_type(config)):
            cb_config.max_blocks_per_request = 0

    init_manager = Manager.__init__

    def __init__(self, model, generation_config, *args, **kwargs):
        _building.lockstep = _lockstep_model(model)
        try:
            if _building.lockstep:  # before the engine drops the processors it does not support (it would
                sampling_settings(model._get_logits_processor(generation_config))  # sample without them)
            init_manager(self, model, generation_config, *args, **kwargs)
        finally:
            _building.lockstep = False

    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):  # 5.19+ adds auto_switch_to_flash
        if not _lockstep_model(model):
            return switch(self, model, *args, **kwargs)
        if is_gdn_model(model):
            cfg = model.config.get_text_config()
            _gdn_engine_configs[id(cfg)] = weakref.ref(cfg)
        current = model.config._attn_implementation
        if current != _ENGINE_ATTN:
            if self._original_attn_impl is None:
                self._original_attn_impl = current  # restored by the engine's stop()
            model.set_attn_implementation(_ENGINE_ATTN)

    def _create_batch_processor(self):
        if _lockstep_model(self.model):
            check_engine_model(self.model, self.continuous_batching_config)
        processor = create(self)
        if not _lockstep_model(self.model):
            return processor
        cfg = self.continuous_batching_config
        if cfg.varlen_compile_config is not None or cfg.decode_compile_config is not None:
            raise UnsupportedError("torch.compile of the continuous-batching step (varlen/decode compile config) "
                                   "on a lockstep-patched model is not supported")
        if any(cfg.cuda_graph_booleans):
            raise UnsupportedError("CUDA graphs in the continuous-batching engine are not supported with lockstep")
        sampling_settings(self.logit_processor)  # refuse unsupported processors before any request runs
        attach(processor, self.model, _hooks["token_logprobs"])
        return processor

    init.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available
    from transformers.generation.continuous_batching import cache as engine_cache
    grouping = _without_gdn_layers(engine_cache.group_layers_by_attn_type,
                                   getattr(engine_cache, "ATTN_TYPE_TO_ALLOCATOR", None))
    engine_cache.group_layers_by_attn_type = grouping
    if hasattr(init, "group_layers_by_attn_type"):  # 5.18+ imports it there too
        init.group_layers_by_attn_type = grouping
    Manager.__init__ = __init__
    add_request = Manager.add_request

    def add_request_checked(self, input_ids, *args, **logit_processor_kwargs):
        known = {"request_id", "max_new_tokens", "streaming", "record_timestamps", "eos_token_id"}
        per_request = sorted(set(logit_processor_kwargs) - known)
        if per_request and _lockstep_model(self.model):
            raise UnsupportedError(f"per-request sampling settings {per_request} in the engine: lockstep records "
                                   "log-probs with the engine-wide settings (generation_config) only")
        return add_request(self, input_ids, *args, **logit_processor_kwargs)

    Manager.add_request = add_request_checked
    Manager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    Manager._create_batch_processor = _create_batch_processor
    _installed = True
