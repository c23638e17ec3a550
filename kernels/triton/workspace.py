"""Scratch buffers of the Triton launchers, reused across calls so a launch path can be captured in a CUDA graph.

A kernel's scratch (split-K partials, split-KV merge rows, token_logprobs' per-chunk maxima) is sized from the
call's shapes only, never from tensor values, and comes from one cache keyed by (name, shape, dtype, device):
the first eager call of a shape allocates it, every later call (eager or captured) reuses it. A capture that
meets a shape no eager call has warmed raises instead of allocating, because a buffer allocated inside a
capture belongs to that graph's private pool; the usual warm-up before ``torch.cuda.graph`` (one eager call of
the same shapes) fills the cache. A buffer a capture used is kept for the life of the process (the graph
holds its address); the others are dropped once the cache holds more than ``MAX_UNPINNED`` of them.

Reuse is safe on one stream (kernels run in launch order). When a later call comes from another stream, that
stream first waits, on the device, for the work already queued on the previous one (no host sync), so two
streams never race on a buffer; inside a capture no such wait is added (replays are ordered by whoever
replays them, as for any graph's static buffers).
"""
from __future__ import annotations

import collections

import torch

#: workspaces no capture has used that the cache keeps (the oldest go first)
MAX_UNPINNED = 64


class _Entry:
    __slots__ = ("tensor", "stream", "pinned")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.stream, self.pinned = tensor, None, False


_cache: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device`` is being captured into a graph (never for CPU tensors)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def workspace(name: str, shape: tuple, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """The scratch tensor ``name`` of this shape, dtype and device (contents undefined unless ``zero``)."""
    device = torch.device(device)
    key = (name, tuple(int(s) for s in shape), dtype, device)
    entry = _cache.get(key)
    in_capture = capturing(device)
    if entry is None:
        if in_capture:
            raise RuntimeError(
                f"lockstep triton: workspace {name!r} {tuple(key[1])} {dtype} on {device} was not allocated before "
                "this CUDA graph capture; run the call once eagerly with the same shapes before capturing it "
                "(a workspace allocated inside a capture would belong to that graph's memory pool)")
        entry = _cache[key] = _Entry(torch.empty(key[1], dtype=dtype, device=device))
        _evict()
    else:
        _cache.move_to_end(key)
    if in_capture:
        entry.pinned = True  # the graph keeps this address
    elif device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        if entry.stream is not None and entry.stream != stream:
            stream.wait_stream(entry.stream)  # the previous stream's kernels on this buffer come first
            entry.tensor.record_stream(stream)  # and an eviction cannot hand its memory on while this one runs
        entry.stream = stream
    if zero:
        entry.tensor.zero_()
    return entry.tensor


def _evict() -> None:
    unpinned = [k for k, e in _cache.items() if not e.pinned]
    for key in unpinned[:max(0, len(unpinned) - MAX_UNPINNED)]:
        del _cache[key]


def clear() -> None:
    """Drop every workspace no capture has used (tests; freeing memory between workloads)."""
    for key in [k for k, e in _cache.items() if not e.pinned]:
        del _cache[key]
