"""vLLM (CPU build, 0.32) samples with lockstep's bits: the log-probs it records are the trainer's.

Registered through vLLM's ``vllm.general_plugins`` entry point (pyproject.toml), which vLLM calls once in
every process it starts (front end, engine core, each worker) and in a process that builds an in-process
engine. The plugin is switched on by ``LOCKSTEP_VLLM=1`` in the environment (or :func:`enable` before the
first engine of the process is built). Off, it changes nothing in vLLM's bits; it only guards llvmlite
against vLLM's module scan (:mod:`.numba_guard`), a crash fix that computes nothing.

On (:mod:`.plugin`): every computation that decides a recorded bit is lockstep's -- RMSNorm with HF's
add-then-round residual, every linear (merged QKV / gate-up, the LM head), rotary from integer positions,
SiLU-mul, q/k norms, attention over vLLM's own paged KV cache, sampling and the recorded log-probs -- or the
engine refuses to start (or the request is refused) naming what it cannot cover. See docs/integrations.md.
"""
from __future__ import annotations

import os

ENV = "LOCKSTEP_VLLM"
ENV_VALUES = {"1": True, "0": False, "": False}  # the switch's accepted values; anything else is refused by name
_forced: bool | None = None  # set by enable(): wins over the environment


def enabled() -> bool:
    """Whether lockstep's plugin is on in this process (``enable()``, else ``LOCKSTEP_VLLM=1``; ``0`` or unset:
    off). Any other value (``true``, ``yes``, ``on``, ...) raises InputError naming the variable: a user who meant
    "on" must not get stock vLLM without a word."""
    if _forced is not None:
        return _forced
    value = os.environ.get(ENV, "")
    if value.strip() not in ENV_VALUES:
        from ...errors import InputError
        raise InputError(f"{ENV}={value!r}: lockstep's vLLM plugin is switched by {ENV}=1 (on) or {ENV}=0 / unset "
                         "(off); no other value is accepted, so the plugin is neither silently off nor on")
    return ENV_VALUES[value.strip()]


def enable(on: bool = True) -> None:
    """The Python-level switch: call before the process builds its first engine. Worker processes vLLM
    starts inherit the environment, so for a multiprocess engine this also sets ``LOCKSTEP_VLLM``."""
    global _forced
    _forced = bool(on)
    os.environ[ENV] = "1" if on else "0"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (once per process, before vLLM builds workers or models)."""
    from .numba_guard import guard_llvmlite
    guard_llvmlite()
    from .gdn import install_text_only_stand_in, text_only_requested
    if text_only_requested():  # Qwen3.5's text model without torchvision (gdn.py; the tests set it)
        install_text_only_stand_in()
    if enabled():
        from .plugin import install
        install()
