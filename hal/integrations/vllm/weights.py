"""Weights entering a running engine: the prefix blocks they make stale, and the requests that ran across them.

vLLM keeps its prefix cache in the scheduler (the engine-core process) and the model in a worker; stock vLLM
keeps blocks computed with the old weights after any weight update until the user calls ``reset_prefix_cache()``,
and lets running requests go on with the new weights over KV computed with the old ones. With the plugin on, the
worker watches its model's weights with lockstep's weight-change detector (hal/weight_watch.py ``ModelWeights``)
against the stamp of the weights the engine's state was last made consistent with (the *handled* stamp), and the
engine core asks it (:func:`check_weights`, THE one answer to "did the weights change?") at every boundary:

* full check (hash of the weights' bits) before requests are admitted (once per admission burst: the first
  ``add_request`` after a step), after every ``collective_rpc`` (``reload_weights``, a worker extension's own
  sync method), and after every step in which a request finishes (before its last output leaves the engine
  core): sees every write, ``p.data.copy_`` and collectives into ``p.data`` included;
* cheap check (no data read) before and after every other step, a full one when it says "maybe" (an optimizer
  step of any kind, ``load_state_dict``, an in-place op, ``p.data = t``).

Each parameter is held at the precision the trainer computes with (:func:`hold_at_trainer_precision`, at load and
at every detected change, before the stamp is taken), under the convention :data:`TRAINER_DTYPE_ENV` names: the
default ``engine`` is a trainer loaded with ``from_pretrained(dtype=<engine dtype>)``, every parameter rounded to
the model dtype. vLLM creates some parameters wider than the model dtype whatever the checkpoint (the Gated
DeltaNet layer's float32 ``A_log``): they are rounded through the model dtype, as transformers rounds them, so a
float32 checkpoint (or a float32 sync) served in bfloat16 gives the bf16 trainer's bits. A parameter narrower than
the model dtype cannot hold the trainer's values and is refused by name.

A change is handled in one order (:func:`_handle_change`): every request that has computed anything (running,
or preempted with outputs) is finished with vLLM's error status, its output carrying :data:`WEIGHTS_CHANGED`
as ``stop_reason`` (``LLM.generate`` raises UnsupportedError naming them: plugin.py); the prefix cache is evicted
(nothing holds blocks any more); only then is the new stamp recorded as handled, so a change whose eviction did
not happen is seen again. A ``collective_rpc`` that changed the weights under running requests raises
UnsupportedError after that (the weights it loaded stay, the engine is consistent); an admission never raises
(the new request runs on the new weights: raising there would leave the front end waiting for a request the
core never admitted). No per-step hash of the whole model: a raw write that no cheap check sees is caught at
the next finishing step, admission or RPC, before any request that ran across it returns.
"""
from __future__ import annotations

import os

import torch

from ...errors import UnsupportedError
from ...weight_watch import ModelWeights

_WATCH = "_lockstep_weight_watch"
_PENDING = "_lockstep_weight_error_outputs"  # engine core: error outputs not yet returned by a step
WEIGHTS_CHANGED = "lockstep: the model's weights changed while this request ran (refused: its KV and tokens mix " \
                  "two weights)"


TRAINER_DTYPE_ENV = "LOCKSTEP_VLLM_TRAINER_DTYPE"
TRAINER_CONVENTIONS = {"engine": "the trainer loads with from_pretrained(dtype=<engine dtype>): every parameter "
                                 "rounded to the model dtype"}


def trainer_convention() -> str:
    """The convention the user names for the trainer's parameter precision (refused by name if unknown)."""
    value = os.environ.get(TRAINER_DTYPE_ENV, "engine")
    if value not in TRAINER_CONVENTIONS:
        raise UnsupportedError(f"{TRAINER_DTYPE_ENV}={value!r}: lockstep's vLLM plugin serves "
                               + "; ".join(f"{k!r} ({v})" for k, v in TRAINER_CONVENTIONS.items())
                               + ". A trainer that keeps the checkpoint's dtype (e.g. float32 master weights) is not "
                                 "served: vLLM holds its linear weights at the engine dtype")
    return value


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def hold_at_trainer_precision(model, dtype: torch.dtype) -> list[str]:
    """Every floating parameter wider than the model dtype rounded through it (its values become the trainer's:
    transformers rounds every parameter to the model dtype); returns their names. A parameter narrower than the
    model dtype (or another format of its width) is refused by name: it cannot hold the trainer's values."""
    trainer_convention()
    wider, narrower = [], []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if p.element_size() <= torch.empty((), dtype=dtype).element_size():
                narrower.append(f"{name} ({p.dtype})")
                continue
            wider.append(name)
            rounded = p.data.to(dtype).to(p.dtype)
            if not torch.equal(_raw(rounded), _raw(p.data)):
                p.data.copy_(rounded)
    if narrower:
        raise UnsupportedError(f"parameters held at another precision than the trainer's {dtype} (convention "
                               f"{TRAINER_DTYPE_ENV}=engine):", narrower)
    return wider


def watch_weights(model, dtype: torch.dtype) -> None:
    """In the worker, after the model is loaded: its parameters held at the trainer's precision, then the
    detector, the handled stamp and the last stamp seen."""
    if _WATCH not in model.__dict__:
        held = hold_at_trainer_precision(model, dtype)
        watch = ModelWeights(model)
        stamp = watch.stamp()
        model.__dict__[_WATCH] = dict(watch=watch, handled=stamp, seen=stamp, dtype=dtype, held=held)


def weights_changed(model, full: bool) -> bool:
    """Whether the weights differ from the handled stamp (``full``: compare the bits; else the cheap check first,
    a full one if it says maybe). Says True until :func:`weights_handled` records the change."""
    entry = model.__dict__.get(_WATCH)
    if entry is None:  # before the model is loaded
        return False
    if not full and not entry["watch"].quick_changed(entry["handled"]):
        return False
    entry["seen"] = entry["watch"].stamp()
    if entry["seen"].same_bits(entry["handled"]):  # the same bits: the state is consistent with them (fresh quick
        entry["handled"] = entry["seen"]  # stamps and step count, so an unrelated optimizer's steps cost one hash)
        return False
    hold_at_trainer_precision(model, entry["dtype"])  # new values (a float32 sync): the trainer's precision again
    entry["seen"] = entry["watch"].stamp()
    return True


def weights_handled(model) -> None:
    """The engine's state is consistent with the weights last seen (their eviction happened)."""
    entry = model.__dict__.get(_WATCH)
    if entry is not None:
        entry["handled"] = entry["seen"]


def _model(worker):
    return getattr(getattr(worker, "model_runner", None), "model", None)


def worker_weights_changed(worker, full: bool) -> bool:
    """The worker method ``lockstep_weights_changed`` (added to vLLM's CPU worker; called by collective_rpc)."""
    model = _model(worker)
    return False if model is None else weights_changed(model, full)


def worker_weights_handled(worker) -> None:
    """The worker method ``lockstep_weights_handled``."""
    model = _model(worker)
    if model is not None:
        weights_handled(model)


def _handle_change(core, finishing=()) -> list[str]:
    """Finish every request that ran across the change with an error (and turn the step outputs of requests that
    finished in this step, ``finishing``, into errors), evict the prefix cache, then record the change as handled.
    Returns the ids of the requests refused."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus
    sched = core.scheduler
    ran = [rid for rid, r in sched.requests.items()
           if not r.is_finished() and (r.num_computed_tokens > 0 or r.num_output_tokens > 0)]
    pending = core.__dict__.setdefault(_PENDING, [])
    for r in sched.finish_requests(ran, RequestStatus.FINISHED_ERROR):
        pending.append((r.client_index, EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ERROR,
                                                         stop_reason=WEIGHTS_CHANGED)))
    for out in finishing:
        out.finish_reason, out.stop_reason = FinishReason.ERROR, WEIGHTS_CHANGED
    if not sched.reset_prefix_cache():
        raise RuntimeError("lockstep's vLLM plugin: the prefix cache could not be evicted after every request that "
                           "held blocks was finished (a KV transfer in flight?); the change stays unhandled")
    core.model_executor.collective_rpc("lockstep_weights_handled")
    return ran + [o.request_id for o in finishing]


def check_weights(core, full: bool, when: str, outputs=None) -> None:
    """In the engine core, at ``when`` ("admission", "step", "rpc"): if a worker's weights changed since the last
    handled stamp, handle the change (module docstring). ``outputs``: a step's outputs (after the step), whose
    finishing requests are refused too."""
    if not any(core.model_executor.collective_rpc("lockstep_weights_changed", args=(full,))):
        return
    finishing = [o for eco in (outputs or {}).values() for o in eco.outputs if o.finish_reason is not None]
    refused = _handle_change(core, finishing)
    if refused and when == "rpc":
        raise UnsupportedError(f"the model's weights changed while {len(refused)} request(s) ran ({refused[:4]}): "
                               "they are finished with an error (their KV was computed with the old weights) and the "
                               "prefix cache is evicted; the new weights stay. Update weights between generate calls.",
                               refused)


def take_error_outputs(core, outputs):
    """After a step: the error outputs :func:`_handle_change` queued, merged into the step's outputs (per client)."""
    pending = core.__dict__.get(_PENDING)
    if not pending:
        return outputs
    from vllm.v1.engine import EngineCoreOutputs
    outputs = dict(outputs or {})
    for client, out in pending:
        eco = outputs.setdefault(client, EngineCoreOutputs())
        eco.outputs.append(out)
        eco.finished_requests = set(eco.finished_requests or ()) | {out.request_id}
    pending.clear()
    return outputs
