"""Who runs on the engine's cores while it computes: lockstep's worker threads, with torch on one thread.

With the plugin on, every heavy op of a step (the linears, attention, the norms, the LM head) is lockstep's and
runs on lockstep's own threads (kernels/cpu/pool.py, counted by hal.kernel_threads); torch runs only the small ops between them (copies,
gathers, index writes, the greedy argmax). Left at vLLM-CPU's default, torch keeps an OpenMP thread per core,
and every one of those small ops big enough to be split leaves torch's workers spin-waiting for the next: one
of them keeps a core busy for the whole step, the core lockstep's second thread needs (measured on 2 cores,
8 greedy sequences: torch's OpenMP worker used 33.5 ms of CPU in a 34.4 ms step). vLLM means torch to run on one
thread while it serves, for this reason (``vllm.utils.torch_utils.set_torch_threads_for_runtime``), but
vLLM-CPU's worker replaces ``torch.set_num_threads`` with a warning before that runs.

:func:`lockstep_takes_the_cores` does it around each worker call that runs the model (:data:`MODEL_CALLS`):
lockstep's pool takes torch's thread count and torch runs on one thread (``torch._C.set_num_threads``, the
function vLLM's wrapper hides); both are put back after the call, so a process that colocates the engine
(a trainer beside an in-process engine) has its threads back between steps. Neither count changes a bit: the
pool's split never does, and what torch still runs is copies, index ops and an argmax (its first maximum).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from ... import kernel_threads

#: the vLLM worker's methods that run the model (compiled graphs are traced inside them too, so inductor's
#: kernels are built for one torch thread)
MODEL_CALLS = ("determine_available_memory", "compile_or_warm_up_model", "execute_model", "sample_tokens",
               "execute_dummy_batch")


@contextlib.contextmanager
def lockstep_takes_the_cores():
    """Inside: torch on one thread, lockstep's kernels on the threads torch had (its own count, if it was
    given one). A no-op where torch already runs on one thread (nested calls included)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    before = kernel_threads.own()
    kernel_threads.set_own(before or n)
    torch._C.set_num_threads(1)
    try:
        yield
    finally:
        torch._C.set_num_threads(n)
        kernel_threads.set_own(before)


def _on_lockstep_threads(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with lockstep_takes_the_cores():
            return fn(*args, **kwargs)
    return wrapper


def install(worker_cls) -> None:
    """Each of :data:`MODEL_CALLS` on ``worker_cls`` (vLLM's CPUWorker) inside :func:`lockstep_takes_the_cores`."""
    for name in MODEL_CALLS:
        setattr(worker_cls, name, _on_lockstep_threads(getattr(worker_cls, name)))
