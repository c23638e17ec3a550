"""How many threads lockstep's own CPU kernels split a call over (kernels/cpu/pool.py): torch's intra-op count
(``torch.set_num_threads`` governs both) unless :func:`set_own` gave them a count of their own -- for a process
where lockstep runs every heavy op and torch's threads are set to one (hal.integrations.vllm.threads). Neither
count changes a bit: the kernels split work over independent outputs only."""
from __future__ import annotations

import torch

from .errors import InputError

_own: int | None = None


def count() -> int:
    """The thread count of a parallel kernel call."""
    return _own if _own is not None else max(1, torch.get_num_threads())


def own() -> int | None:
    """The count :func:`set_own` gave, or None (the kernels follow torch's)."""
    return _own


def set_own(n: int | None) -> None:
    """Run lockstep's parallel kernels on ``n`` threads whatever torch's count is; ``None``: follow torch's again."""
    global _own
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InputError(f"kernel_threads.set_own: a thread count must be an int >= 1 or None, got {n!r}")
    _own = n
