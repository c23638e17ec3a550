"""Weights entering a running engine, and the prefix cache blocks they make stale.

vLLM keeps its prefix cache in the scheduler (the engine-core process) and the model in a worker; stock vLLM
keeps blocks computed with the old weights after any weight update until the user calls ``reset_prefix_cache()``.
With the plugin on, every way weights enter the engine goes through the model's ``load_weights``:
``collective_rpc("reload_weights", ...)`` (vLLM's model loader calls it), a worker extension's own method
(verl / OpenRLHF call ``model_runner.model.load_weights``), a colocated trainer calling it on an in-process
engine's model directly (TRL, verl). :func:`watch_load_weights` counts those calls on the worker's model; before
each schedule the engine core asks the workers :func:`weights_epoch` (:func:`check_weights`) and evicts the prefix cache when it moved.

Not seen: a write into a parameter that bypasses ``load_weights`` (``p.data.copy_`` by hand). The weight-change
detector of the reliability issue (branch ``detector``) is to replace :func:`weights_epoch`'s body -- the one
place the plugin asks "did the weights change?" -- and will see those too.
"""
from __future__ import annotations

from ...errors import UnsupportedError

_EPOCH = "_lockstep_weight_epoch"


def watch_load_weights(model) -> None:
    """Count ``model.load_weights`` calls on the model instance (in the worker, after the model is loaded)."""
    if _EPOCH in model.__dict__:
        return
    load = model.load_weights
    model.__dict__[_EPOCH] = 0

    def load_weights(*args, **kwargs):
        try:
            return load(*args, **kwargs)
        finally:
            model.__dict__[_EPOCH] += 1

    model.load_weights = load_weights


def weights_epoch(model) -> int:
    """THE call site where the plugin asks "did the weights change?": a number that moves whenever the model's
    weights may have changed. Stand-in: the count of ``load_weights`` calls. Switch this to the reliability
    issue's weight-change detector (branch ``detector``) when it lands; no per-step hash of the whole model."""
    return int(model.__dict__.get(_EPOCH, 0))


def worker_weights_epoch(worker) -> int:
    """The worker method ``lockstep_weights_epoch`` (added to vLLM's CPU worker; called by collective_rpc)."""
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    return 0 if model is None else weights_epoch(model)  # 0 before the model is loaded


def check_weights(core) -> None:
    """In the engine core -- after every ``collective_rpc``, before a request is added and before each schedule:
    when the workers' weights moved, evict the prefix cache (blocks computed with the old weights). Refused
    when requests still hold blocks computed with the old weights (weights changed mid-generation)."""
    epoch = max(core.model_executor.collective_rpc("lockstep_weights_epoch"))
    seen = core.__dict__.setdefault("_lockstep_weights_seen", epoch)
    if epoch == seen:
        return
    if not core.scheduler.reset_prefix_cache():  # False while running requests hold blocks
        raise UnsupportedError("the model's weights changed while the engine had running requests: their KV was "
                               "computed with the old weights. Update weights between generate calls.")
    core.__dict__["_lockstep_weights_seen"] = epoch
