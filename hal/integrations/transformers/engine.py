"""transformers' continuous-batching engine on lockstep's bits: the transformers shim, inside the engine.

The engine (``model.generate_batch``, ``ContinuousBatchingManager``) packs requests into one varlen step
(prefill chunks cut by ``max_batch_tokens`` next to decode rows), keeps KV in pages shared across requests
(prefix cache) and offloads requests when blocks run out. What makes a request's bits independent of that
is engine-neutral: the serving core (hal/serving.py: batch metadata, attention over the engine's paged
cache, GDN state beside it) and the sampling module (hal/sampling.py: the kept set, the recorded log-prob).
The shim is two modules, the only ones that touch the engine's internals: hal/integrations/transformers/engine_install.py
wraps the engine's entry points (refusals before anything runs, the GDN layers left out of its pages) and hands
each new batch processor to :func:`attach`; this one holds what then runs inside the engine:
:func:`hf_paged_attention` (its steps' attention), :class:`_LockstepStep` (its forward step: one model call,
tokens drawn from lockstep's kept set, the recorded log-prob ``lt.token_logprobs`` of the hidden rows the LM
head saw), :class:`GdnEngineStates` (its rows -> the request-keyed ``serving.GdnStates`` on its cache),
:class:`_EngineState` (prefix blocks of older weights evicted, a change while requests run refused:
hal/weight_watch.py), and refusals by name (:func:`check_engine_model`, :func:`sampling_settings`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from ... import sampling as _sampling
from ...deprecation import warn_moved
from ...errors import InputError, UnsupportedError
from ...serving import (GdnStates, PagedKV, ServingBatch, decode_slot_mapping, paged_attention, request_kv,
                       varlen_attention, write_kv)
from ...weight_watch import ModelWeights

_STATE = "_lockstep_engine"  # attribute on the engine's batch processor


# ---------------------------------------------------------------- transformers shim


def is_engine_cache(cache) -> bool:
    return type(cache).__name__ == "PagedAttentionCache"


def hf_paged_attention(mod, q, k, v, cache, kwargs, spec=None, backend=None) -> torch.Tensor:
    """A patched attention layer's core inside HF's engine: ``q [1, Hq, T, D]``, new ``k/v [1, Hkv, T, D]``
    -> ``[1, T, Hq * Dv]`` (``spec``, ``backend``: the patch's attention choice, policy.PatchPolicy). Varlen steps:
    the engine's allocator writes and reads its cache (exact copies). Decode fast path (a block table, one new token
    per request): the serving core over the engine's cache."""
    keys, values, cu_k, table, pages = _engine_cache_step(mod.layer_idx, k, v, cache, kwargs)
    if table is None:
        batch = ServingBatch(query_start_loc=kwargs["cu_seq_lens_q"], seq_lens=cu_k[1:] - cu_k[:-1])
        out = varlen_attention(q[0].transpose(0, 1), keys, values, batch, mod.scaling, spec=spec, backend=backend)
    else:
        n = q.shape[2]  # decode only: one query per request
        lens = (cu_k[1:n + 1] - cu_k[:n]).to(torch.int64)
        paged = PagedKV(*pages)  # [pages, page_size, Hkv, D]
        slots = decode_slot_mapping(paged, table[:n], lens)
        batch = ServingBatch(query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=lens,
                             block_table=table[:n], slot_mapping=slots)
        write_kv(paged, k[0].transpose(0, 1), v[0].transpose(0, 1), slots)
        out = paged_attention(q[0].transpose(0, 1), paged, batch, mod.scaling, spec=spec, backend=backend)
    return out.reshape(1, out.shape[0], -1)


@lru_cache(maxsize=8)
def _update_takes_kwargs(cache_type) -> bool:
    return "kwargs" in inspect.signature(cache_type.update).parameters


def _engine_cache_step(layer_idx: int, k, v, cache, kwargs):
    """One attention layer's view of the engine's cache in this step, on each engine API lockstep supports:
    ``(keys, values [Tk, Hkv, D]`` (the new keys written, the request's keys read; None on the decode fast path:
    the serving core writes and reads the pages),
    ``cu_seq_lens_k`` of this layer, its block table (None: a varlen step) and the ``(k_cache, v_cache)`` page views
    ``[pages, page_size, Hkv, D]`` the block table indexes)``.

    ``update(k, v, layer_idx, kwargs)`` (transformers 5.19+) picks the layer's entries into ``kwargs`` itself;
    ``update(k, v, layer_idx, read_index, write_index)`` (5.17, 5.18) returns ``[Tk, Hkv, D]`` and leaves the
    layer's ``cu_seq_lens_k`` (per layer type) and block table (per layer group) to the attention function: they
    are picked here the way that release's own paged attention picks them."""
    if _update_takes_kwargs(type(cache)):
        keys, values = cache.update(k, v, layer_idx, kwargs)  # [1, Hkv, Tk, D]; untouched on the fast path
        table = kwargs.get("block_table")
        if table is not None:
            return None, None, kwargs["cu_seq_lens_k"], table, (kwargs["k_cache"], kwargs["v_cache"])
        return keys[0].transpose(0, 1), values[0].transpose(0, 1), kwargs["cu_seq_lens_k"], None, None
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):  # per layer type; a lockstep model has full attention only (sliding is refused)
        if set(cu_k) != {"full_attention"}:
            raise UnsupportedError(f"engine layer types {sorted(cu_k)}: lockstep runs full-attention layers only")
        cu_k = cu_k["full_attention"]
    cu_k = cu_k.to(torch.int32)
    table = kwargs.get("block_table")
    if table is None:
        keys, values = cache.update(key_states=k, value_states=v, layer_idx=layer_idx,
                                    read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        return keys, values, cu_k, None, None
    if hasattr(cache, "layer_to_allocator"):  # 5.18: per-type allocators hold the page views
        group, k_cache, v_cache = cache.get_cache_for_block_table(layer_idx)
    else:  # 5.17: one flat cache tensor per position in a layer group
        group, in_group = cache.layer_index_to_group_indices[layer_idx]
        shape = (-1, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        k_cache, v_cache = cache.key_cache[in_group].view(shape), cache.value_cache[in_group].view(shape)
    return None, None, cu_k, table[group], (k_cache, v_cache)


# ---------------------------------------------------------------- refusals


GDN_LAYER_TYPES = ("linear_attention",)  # the layer types lockstep keeps GDN state for, outside the pages


def is_gdn_model(model) -> bool:
    cfg = model.config.get_text_config()
    return any(t in GDN_LAYER_TYPES for t in (getattr(cfg, "layer_types", None) or []))


def check_engine_model(model, cb_config) -> None:
    """Engine features a Gated DeltaNet hybrid cannot run exactly are refused by name, before anything runs."""
    if not is_gdn_model(model):
        return
    name = type(model).__name__
    if cb_config.allow_block_sharing:
        raise UnsupportedError(
            f"block sharing (prefix caching) in the continuous-batching engine on a Gated DeltaNet model ({name}): "
            "a shared prefix would skip the tokens its linear-attention state is built from, and lockstep keeps no "
            "state snapshot at block boundaries. Pass ContinuousBatchingConfig(allow_block_sharing=False).")
    if cb_config.use_async_batching:
        raise UnsupportedError(f"asynchronous batching (use_async_batching=True) in the continuous-batching engine on "
                               f"a Gated DeltaNet model ({name}) is not supported by lockstep")


# ---------------------------------------------------------------- Gated DeltaNet state beside the engine's cache


_GDN_STATES = "_lockstep_gdn_states"  # attribute on the engine's PagedAttentionCache


class GdnEngineStates:
    """The engine's rows -> the request-keyed :class:`hal.serving.GdnStates` (``core``) on its cache.

    ``step_requests``: the request id of each row of the running step (set before the model runs);
    modules.py's GDN forward looks up and stores by row. Offloaded requests keep their states (a soft reset
    re-prefills from token 0, which restarts them); finished ones go after every scheduled step (:meth:`prune`).
    """

    def __init__(self):
        self.core = GdnStates()
        self.step_requests: list = []  # request ids of the running step, in the batch's row order
        self.check_positions = True  # False only in the negative-control test (states keyed by row)

    @property
    def states(self) -> dict:
        return self.core.states

    def key(self, row: int, request_id: str):
        return request_id

    def lookup(self, row: int, layer: int, start: int):
        """(conv_state, rule_state) for the chunk of batch row ``row`` starting at token ``start``; None: fresh."""
        key = self.key(row, self.step_requests[row])
        held = self.core.positions(key, layer)
        if start and not self.check_positions and held and start not in held:
            start = held[-1]  # the negative control: continue from whatever this key holds
        return self.core.lookup(key, layer, start)

    def store(self, row: int, layer: int, start: int, end: int, conv_state, rule_state) -> None:
        key = self.key(row, self.step_requests[row])
        if key not in self.core:
            self.core.start(key)
        self.core.advance(key, layer, start, end, conv_state, rule_state)

    def fork(self, parent_id: str, child_ids) -> None:
        self.core.fork(parent_id, child_ids)  # forked children (parallel sampling) continue their parent

    def prune(self, live_request_ids) -> None:
        live = {self.key(i, rid) for i, rid in enumerate(self.step_requests)} | set(live_request_ids)
        for key in [k for k in self.core.states if k not in live]:
            self.core.finish(key)


def gdn_engine_states(cache) -> GdnEngineStates:
    """The GDN states on an engine cache (created by the lockstep batch processor)."""
    states = cache.__dict__.get(_GDN_STATES)
    if states is None:
        raise InputError("this engine cache has no lockstep Gated DeltaNet states: the engine was not set up by "
                         "lockstep (lt.patch the model before init_continuous_batching / generate_batch)")
    return states


# transformers' temperature, top-k and top-p warpers (plain or per-request), in the order its
# _get_logits_processor builds them. Temperature and top-k are reproduced exactly; top-p's kept set is
# lockstep's (kept_set), and the engine samples from that set, never from transformers' own mask.
_WARPERS = {"TemperatureLogitsWarper": "temperature", "TopKLogitsWarper": "top_k", "TopPLogitsWarper": "top_p"}


def sampling_settings(processors) -> _sampling.Sampling:
    """The engine's sampling settings, read from its logits processors (a list, or the engine's
    ``ContinuousBatchingLogitsProcessorList``); any other processor, a warper out of transformers' order,
    or ``min_tokens_to_keep != 1`` is refused by name."""
    procs = list(getattr(processors, "logits_processor", processors))
    order = list(_WARPERS.values())
    found: dict = {}
    for proc in procs:
        name = type(proc).__name__
        setting = _WARPERS.get(name.removeprefix("ContinuousBatching"))
        if setting is None:
            dropped = (" (transformers' engine would drop it and sample without it)"
                       if getattr(proc, "supports_continuous_batching", None) is False else "")
            raise UnsupportedError(
                f"the engine's logits processor {name} is not supported by lockstep{dropped}: its scores are "
                "computed with torch ops a trainer cannot reproduce bit for bit (supported: temperature, top_k, "
                "top_p; repetition penalties, min_p, typical_p and the like are refused)")
        if setting in found or any(order.index(s) > order.index(setting) for s in found):
            raise UnsupportedError(f"the engine's logits processors {[type(p).__name__ for p in procs]} are not in "
                                   "transformers' order (temperature, top-k, top-p, each once)")
        if getattr(proc, "min_tokens_to_keep", 1) != 1:
            raise UnsupportedError(f"{name} with min_tokens_to_keep={proc.min_tokens_to_keep}: lockstep's trainer "
                                   "API (lt.token_logprobs) keeps one token at least")
        found[setting] = getattr(proc, setting)
    return _sampling.Sampling(temperature=float(found.get("temperature", 1.0)),
                              top_k=None if "top_k" not in found else int(found["top_k"]),
                              top_p=None if "top_p" not in found else float(found["top_p"]))


# ---------------------------------------------------------------- the engine step


@dataclass(frozen=True)
class EngineStep:
    """What one scheduled engine step holds: ``requests [(request_id, query_tokens, has_new_token)]``
    (has_new_token False: a prefill chunk that does not end its prompt), ``offloads`` so far, whether
    it took the engine's decode fast path (block table), and ``decoding``: the ids of the requests whose
    row is a decode row (one generated token fed back; every other row is a prompt's prefill chunk)."""
    requests: list
    offloads: int
    decode_fast_path: bool
    decoding: frozenset = frozenset()


def evict_prefix_cache(cache) -> None:
    """Drop every block the engine's prefix cache keeps for reuse (no request holds a block: the caller checked).
    transformers 5.18+ has ``evict_cached_blocks``; on 5.17 the block manager's own reclaim path frees them: asked for
    every block, it uninitialises each cached one (its hash leaves the table)."""
    if hasattr(cache, "evict_cached_blocks"):
        cache.evict_cached_blocks()
        return
    blocks = cache._block_manager
    blocks.has_enough_free_blocks(blocks.num_blocks)
    if blocks._hash_to_id:  # a block is still held: its reuse would serve KV of the old weights
        raise UnsupportedError(f"{len(blocks._hash_to_id)} prefix-cache block(s) of the engine are still held after "
                               "a weight change; they cannot be evicted")


class _EngineState:
    """lockstep's state on one engine batch processor: the weights its cached blocks were computed with,
    and the test/diagnostic hooks called once per scheduled step.

    The weight-change detector (hal/weight_watch.py; torch's version counter misses fused optimizer
    steps, ``p.data.copy_``, broadcasts) runs at two places:

    * before the scheduler admits requests (the only moment it reuses prefix blocks): the full check (a hash
      of every parameter); a change evicts the prefix cache, or is refused when requests are running;
    * after every step's forward, before its tokens and log-probs are delivered: the cheap check (quick
      stamps and the process's optimizer step count: no data read), and the full check only when it says
      "maybe"; a change is refused while requests run, so no result computed partly with the weights an
      optimizer step (any kind) or a load wrote is delivered.

    So a decode step hashes nothing unless the cheap signal fires, a step admitting requests hashes the
    weights once, an idle engine never. A raw write the cheap check cannot see (``p.data.copy_``, a
    collective into ``p.data``) while requests run is caught at the next admission."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor
        self.watch = ModelWeights(model)
        self.weights = self.watch.stamp()
        self.offloads = 0  # requests the engine offloaded (blocks ran out) so far
        self.invalidate_on_update = True  # False only in the negative-control test (stale prefix blocks)
        scheduler = processor.scheduler
        schedule, update = scheduler.schedule_batch, processor.update_batch

        def schedule_batch(*args, **kwargs):  # the new requests are already taken from the queue here
            if scheduler.waiting_requests:
                self.check_weights()
            return schedule(*args, **kwargs)

        def update_batch(*args, **kwargs):  # delivers the step's tokens and log-probs
            if self.watch.quick_changed(self.weights):
                self.check_weights()
            return update(*args, **kwargs)
        scheduler.schedule_batch, processor.update_batch = schedule_batch, update_batch

    def check_weights(self) -> None:
        """The full check: on a change, refuse if requests are running, else evict the prefix cache."""
        now = self.watch.stamp()
        if not now.same_bits(self.weights):
            if self.processor.scheduler.active_requests:
                names = now.changed_names(self.weights)
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                raise UnsupportedError(f"the model's weights changed while the engine had running requests ({shown}): "
                                       "their KV was computed with the old weights. Update weights between generate "
                                       "calls.")
            if self.invalidate_on_update:  # the prefix cache was computed with the old weights
                evict_prefix_cache(self.processor.cache)
        self.weights = now

    def count_offloads(self, offload):
        def offload_requests(*args, **kwargs):
            done = offload(*args, **kwargs)
            self.offloads += bool(done)
            return done
        return offload_requests

    def after_schedule(self) -> None:
        io = self.processor.inputs_and_outputs
        gdn = self.processor.cache.__dict__.get(_GDN_STATES)
        if gdn is not None:  # the finished requests' GDN states go (offloaded and waiting ones stay)
            sched = self.processor.scheduler
            gdn.prune([*sched.active_requests, *sched.waiting_requests])
        rows = io.requests_in_batch
        step = EngineStep([(fs.state.request_id, int(fs.query_length), bool(fs.has_new_token)) for fs in rows],
                          self.offloads, bool(io.use_block_table),
                          # a decode row: its request has a generated token to feed (the engine labels a prompt's
                          # last prefill chunk DECODING already; a soft-reset request re-prefills with none)
                          frozenset(fs.state.request_id for fs in rows
                                    if fs.state.status.name == "DECODING" and fs.state.generated_tokens))
        for fn in step_hooks(self.model):
            fn(step)


class _LockstepStep:
    """Replaces the engine's ``ModelRunner._forward_process_and_sample``: the same single forward and
    sampling, greedy by argmax of lockstep's logits, and the recorded log-prob lockstep's."""

    def __init__(self, runner, model, token_logprobs):
        self.runner, self.model, self.token_logprobs = runner, model, token_logprobs

    def __call__(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids):
        runner = self.runner
        runner.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        sampling = sampling_settings(runner.logit_processor)  # refuses other processors, greedy or not
        if not runner.do_sample:
            sampling = _sampling.Sampling()  # greedy: the recorded value is the temperature-1 full-vocabulary log-prob
        seen = []
        head = model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        gdn = batch_data["cache"].__dict__.get(_GDN_STATES) if "cache" in batch_data else None
        if gdn is not None:  # the GDN layers key their states by the request in each row of this step
            gdn.step_requests = [fs.state.request_id for fs in runner.inputs_and_outputs.requests_in_batch]
        try:
            logits = model(**batch_data).logits
        finally:
            handle.remove()
        idx = batch_data["logits_indices"]
        hidden = seen[-1][0].detach()
        if "logits_to_keep" not in batch_data:
            logits, hidden = logits[:, idx], hidden[idx]
        # lockstep's scores and kept set replace the engine's warpers: the sampler's mask IS kept_set's
        scores = _sampling.sampling_scores(logits[0], sampling.temperature)
        if runner.do_sample:
            probs = torch.softmax(_sampling.kept_scores(scores, sampling), dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(-1)
        else:
            tokens = torch.argmax(scores, dim=-1)  # lockstep's logits: no softmax rounding between them and argmax
        n = tokens.shape[0]
        output_ids[0, :n].copy_(tokens)
        if runner.return_logprobs:
            def logprobs(h, t, temperature):
                return self.token_logprobs(model, h, t, temperature)
            lp = (_sampling.kept_logprobs(model, hidden, tokens, sampling, logprobs, scores=scores) if sampling.filters
                  else logprobs(hidden, tokens, sampling.temperature))
            output_ids[1, :n].copy_(lp.view(torch.int32))


def attach(processor, model, token_logprobs) -> None:
    """lockstep on a new batch processor of a lockstep-patched ``model`` (once per processor): its
    :class:`_EngineState`, the GDN states on its cache (forked with their request), its forward step
    (:class:`_LockstepStep`, recording ``token_logprobs``' bits) and the per-step hooks after scheduling."""
    if processor.__dict__.get(_STATE) is not None:
        return
    state = processor.__dict__[_STATE] = _EngineState(model, processor)
    if is_gdn_model(model):
        cache = processor.cache
        gdn = cache.__dict__[_GDN_STATES] = GdnEngineStates()
        if hasattr(cache, "prepare_fork_request"):  # transformers 5.18+: it returns the children it forked
            prepare_fork = cache.prepare_fork_request

            def prepare_fork_request(src_state, dst_req_ids, copy_src_and_dst):
                forked = prepare_fork(src_state, dst_req_ids, copy_src_and_dst)
                gdn.fork(src_state.request_id, forked)
                return forked
            cache.prepare_fork_request = prepare_fork_request
        else:  # 5.17: fork_request forks every child it is given (the rest were queued as fresh requests)
            fork_blocks = cache.fork_request

            def fork_request(source_request_id, destination_request_ids):
                copies = fork_blocks(source_request_id, destination_request_ids)
                gdn.fork(source_request_id, destination_request_ids)
                return copies
            cache.fork_request = fork_request
    runner = processor.model_runner
    runner._forward_process_and_sample = _LockstepStep(runner, model, token_logprobs)
    prepare = processor.prepare_next_batch

    def prepare_next_batch(*args, **kwargs):
        ok = prepare(*args, **kwargs)
        if ok:
            state.after_schedule()
        return ok
    processor.prepare_next_batch = prepare_next_batch
    off = processor.offloading_manager
    off.offload_requests = state.count_offloads(off.offload_requests)


_HOOKS = "_lockstep_engine_step_hooks"


def step_hooks(model) -> list:
    """The model's list of engine step hooks (append ``fn(step)``): each scheduled step calls them with
    an :class:`EngineStep` (tests use it to prove a configuration exercised chunked prefill, mixed steps,
    offloading)."""
    return model.__dict__.setdefault(_HOOKS, [])


def engine_state(manager) -> _EngineState:
    """lockstep's state on a manager's batch processor (after its first batch or warmup)."""
    proc = getattr(manager, "batch_processor", None)
    state = None if proc is None else proc.__dict__.get(_STATE)
    if state is None:
        raise InputError("this engine has no lockstep state yet (not a lockstep-patched model, or not started)")
    return state


# ---------------------------------------------------------------- names that moved (issue 36 item 3)


def _gather_paged(k_cache, v_cache, k_new, v_new, batch):
    """The old ``gather_paged``: ``serving.write_kv`` of the new keys, then ``serving.request_kv``."""
    paged = PagedKV(k_cache, v_cache)
    write_kv(paged, k_new, v_new, batch.slot_mapping)
    return request_kv(paged, batch)


#: old name -> (its object now, its home): kept one release, each use warns (hal/deprecation.py)
_MOVED = {"EngineBatch": (ServingBatch, "hal.serving.ServingBatch"),
          "engine_attention": (varlen_attention, "hal.serving.varlen_attention"),
          "gather_paged": (_gather_paged, "hal.serving.write_kv and hal.serving.request_kv"),
          **{name: (getattr(_sampling, name), f"hal.sampling.{name}")
             for name in ("Sampling", "sampling_scores", "kept_set", "renormalise_kept", "kept_logprobs")}}


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_moved(f"hal.integrations.transformers.engine.{name}", _MOVED[name][1])
    return _MOVED[name][0]
