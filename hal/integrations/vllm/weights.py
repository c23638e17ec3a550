"""Weights entering a running engine, and the prefix cache blocks they make stale.

vLLM keeps its prefix cache in the scheduler (the engine-core process) and the model in a worker; stock vLLM
keeps blocks computed with the old weights after any weight update until the user calls ``reset_prefix_cache()``.
With the plugin on, the worker watches its model's weights with lockstep's weight-change detector
(hal/weight_watch.py ``ModelWeights``: a stamp taken when the model is loaded, compared with the weights' bits),
and the engine core asks it (:func:`check_weights`) at the boundaries where stale blocks could be reused:

* full check (hash of the weights' bits) before requests are admitted (once per admission burst: the first
  ``add_request`` after a step) and after every ``collective_rpc`` (``reload_weights``, a worker extension's
  own sync method): sees every write, ``p.data.copy_`` and broadcasts into ``p.data`` included, whether it came
  through an RPC or from a colocated trainer calling the in-process engine's ``model.load_weights`` directly;
* cheap check (no data read) before each schedule, a full one only when it says "maybe".

A change evicts the prefix cache; a change while requests hold blocks is refused (their KV was computed with
the old weights). No per-step hash of the whole model.
"""
from __future__ import annotations

from ...errors import UnsupportedError
from ...weight_watch import ModelWeights

_WATCH = "_lockstep_weight_watch"


def watch_weights(model) -> None:
    """In the worker, after the model is loaded: the detector over its parameters and the stamp it starts from."""
    if _WATCH not in model.__dict__:
        watch = ModelWeights(model)
        model.__dict__[_WATCH] = [watch, watch.stamp()]


def weights_changed(model, full: bool) -> bool:
    """THE place the plugin asks "did the weights change since the last answer?" (the detector of
    hal/weight_watch.py). ``full``: compare the bits; else the cheap check first (a full one if it says maybe)."""
    entry = model.__dict__.get(_WATCH)
    if entry is None:  # before the model is loaded
        return False
    watch, seen = entry
    if not full and not watch.quick_changed(seen):
        return False
    now = watch.stamp()
    entry[1] = now
    return not now.same_bits(seen)


def worker_weights_changed(worker, full: bool) -> bool:
    """The worker method ``lockstep_weights_changed`` (added to vLLM's CPU worker; called by collective_rpc)."""
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    return False if model is None else weights_changed(model, full)


def check_weights(core, full: bool) -> None:
    """In the engine core: evict the prefix cache when a worker's weights changed (see the module docstring)."""
    if not any(core.model_executor.collective_rpc("lockstep_weights_changed", args=(full,))):
        return
    if not core.scheduler.reset_prefix_cache():  # False while running requests hold blocks
        raise UnsupportedError("the model's weights changed while the engine had running requests: their KV was "
                               "computed with the old weights. Update weights between generate calls.")
