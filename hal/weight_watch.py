"""The weight-change detector: "did these weights change since I computed this?", for every cache of
weight-derived state.

Users (each keeps a stamp taken when it computed its state and compares it before reusing that state):

* prepared exact weights, ``hal.exact_weight`` (kernels/exact/prepared.py ``ExactWeight``): one
  :class:`TensorStamp`, checked in full on every use (every op call that takes it);
* the HF patch's exact slices (hal/integrations/transformers/matmul.py ``PatchMatmul``): the same ExactWeight
  check, on every forward of each linear;
* transformers' continuous-batching engine (hal/integrations/transformers/engine.py ``_EngineState``): one
  :class:`ModelWeights` over the model's parameters, checked in full before the scheduler admits
  requests (a generate call's requests, the only moment prefix blocks are reused), and cheaply after
  every step's forward (a full check only when the cheap one says "maybe"); a change evicts the prefix
  cache when no request is running and is refused when requests are running (their KV was computed
  with the old weights);
* any other engine (vLLM): ``watch = ModelWeights(model)``, ``seen = watch.stamp()`` when the cached
  state is computed, ``watch.changed(seen)`` before it is reused.

Why the bits, not torch's counters. torch's version counter does not see every write: fused optimizer
steps (``AdamW/Adam/SGD/Adagrad(fused=True)``), ``p.data.copy_(t)``, a ``torch.distributed`` broadcast
into ``p.data``, ``p.data = t`` rebound back onto the old address leave ``(data_ptr, _version)`` as it
was, and inference tensors have no counter. So the full check hashes the bits.

Two checks:

* **full** (:meth:`TensorStamp.same_bits`, :meth:`ModelWeights.changed`): shape, dtype and a 64-bit
  hash of the raw bits of every tensor. Sound for every write. Cost: one read of every byte and a
  64-bit multiply per 16-bit lane (numba on CPU, threads for large tensors; on other devices torch
  integer ops): a 4096 x 4096 bf16 weight 9-18 ms on one core of the CI machine, a 156 M-parameter
  model about 1.1x (bf16) to 1.6-2.4x (fp32) of one decode-shaped forward; docs/integrations.md
  ("Weight changes"), benchmarks/weight_watch.py.
* **cheap** (:meth:`TensorStamp.same_tensor`, :meth:`ModelWeights.quick_changed`): the quick stamp
  (version counter, storage address, shape, strides, dtype, device) and, for a set of weights, the
  process's optimizer step count (:func:`optimizer_steps`: every ``torch.optim.Optimizer`` step, fused
  ones included); no read of the data: microseconds per tensor. A difference means "maybe changed"
  (re-check or re-compute); no difference proves nothing (``p.data.copy_``, a broadcast into
  ``p.data``, a write to an inference tensor), so it never replaces the full check where stale state
  would be reused.

Where each runs: the full check wherever weights can enter state that is about to be *reused*; the cheap
one between those boundaries. For an ExactWeight that is every op call (a training loop writes between
any two calls: cheap, then full). For a serving engine the boundary is admission: the scheduler reuses
prefix blocks only when it admits requests, and a generate call's requests are admitted there, so a full
check before admission sees every write made between generate calls. While requests run, a write is
seen at the next step by the cheap check when it is an optimizer step (any kind), ``load_state_dict``,
an in-place op on the parameter or ``p.data = t``; a raw ``p.data.copy_`` or collective into running
requests' weights is seen at the next admission (then refused if those requests still run). Hashing
the whole model every decode step would be a second full read of the weights per token (1.1-2.4x of a
decode forward here: docs/integrations.md, "Weight changes"), the price this split avoids.

The hash (one definition, two implementations with the same value): the tensor read as rows of lanes
(:func:`lanes`: int16 lanes for elements of 2+ bytes, int8 for 1-byte elements, in row-major order; a 2-D
tensor [N, K] gives N rows, a 1-D or 0-D tensor one row, an n-D tensor ``prod(shape[:-1])`` rows), each
lane sign-extended to int64; ``h = sum_r b[r] * sum_j a[j] * lane[r, j]`` modulo 2**64. The coefficients
``a``, ``b`` come from torch's generator seeded with 63 bits from ``secrets``, drawn once per process at
import (:class:`ProcessKey`; the seeds never leave the process: a stamp holds only the key's id), so no
one outside the process knows them: for a given change of the bits (a nonzero difference ``D`` of lane
values, every ``|D| < 2**16``, so at most 15 trailing zero bits) a row sum misses it with probability at
most 2**-49 over the coefficients, and the sum over rows again: a change -- any change, crafted or not,
since it cannot depend on coefficients it cannot see -- goes unseen with probability about 2**-43 or
less. With fixed, public coefficients that bound would be false: a short vector of the lattice
``{D : sum a[j] D[j] = 0 mod 2**64}`` (10 values moved by a few ulp) keeps the hash.

A stamp is meaningful only under the key it was taken with, so it is never compared across processes:
every stamp carries its key's id and comparing a stamp of another key (an ExactWeight pickled in one
process and used in another, another rank's stamp) raises InputError by name. A forked child inherits
its parent's key (same coefficients), so its parent's stamps stay valid there.

``hash_torch`` is the readable definition and runs on every device; CPU tensors use kernels/cpu/weight_hash.py (numba,
one pass, no temporaries; blocks of rows on lockstep's own threads, kernels/cpu/pool.py, for large tensors):
tests/test_weight_watch.py checks that they give the same value under the process key.
"""
from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .errors import InputError


# ---------------------------------------------------------------- the per-process key


@dataclass(frozen=True)
class ProcessKey:
    """The seeds of the hash coefficients (secret: never stored in a stamp) and a public id that stamps carry."""
    seed_a: int
    seed_b: int
    id: int

    @staticmethod
    def draw() -> "ProcessKey":
        return ProcessKey(secrets.randbits(63), secrets.randbits(63), secrets.randbits(64))


_key = ProcessKey.draw()  # at import: one key per process, no first-use race between threads


def process_key() -> ProcessKey:
    """This process's key."""
    return _key


# ---------------------------------------------------------------- the hash


_CHUNK = {"cpu": 1 << 18}  # lanes per torch pass: a CPU's chunk of int64 products stays in cache
_CHUNK_OTHER = 1 << 24  # an accelerator: few launches (a 128 MiB temporary)


@functools.lru_cache(maxsize=256)
def _coefficients(n: int, seed: int, device: torch.device) -> torch.Tensor:
    # a function of (n, seed) only: an entry dropped from the cache comes back with the same values
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=g, dtype=torch.int64).to(device)


def lanes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as a 2-D int16 (int8 for 1-byte elements) tensor [rows, lanes per row], row-major
    element order (a view when the tensor's layout allows, else a copy). See the module docstring."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dim() == 0:
        t = t.reshape(1, 1)
    elif t.dim() == 1:
        t = t.reshape(1, -1)
    elif t.dim() > 2:
        t = t.reshape(-1, t.shape[-1])
    if t.stride(-1) != 1:
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(torch.int8 if t.element_size() == 1 else torch.int16)


def hash_torch(lane: torch.Tensor) -> int:
    """The definition, in torch integer ops (int64 arithmetic wraps modulo 2**64)."""
    key = process_key()
    n, length = lane.shape
    a = _coefficients(length, key.seed_a, lane.device)
    b = _coefficients(n, key.seed_b, lane.device)
    rows = torch.empty(n, dtype=torch.int64, device=lane.device)
    step = max(1, _CHUNK.get(lane.device.type, _CHUNK_OTHER) // max(length, 1))
    for r in range(0, n, step):
        torch.sum(lane[r:r + step].to(torch.int64) * a, dim=1, out=rows[r:r + step])
    return int((rows * b).sum())


def content_hash(t: torch.Tensor) -> int:
    """The 64-bit fingerprint of a tensor's bits under this process's key (any shape and dtype; inference
    tensors included). Equal bits and shape give equal values; see the module docstring for the bound."""
    if t.numel() == 0:
        return 0
    lane = lanes(t)
    if lane.device.type != "cpu":
        return hash_torch(lane)
    from hal.kernels.cpu.weight_hash import lane_hash
    key = process_key()
    n, length = lane.shape
    return lane_hash(np.from_dlpack(lane), _coefficients(length, key.seed_a, lane.device).numpy(),
                     _coefficients(n, key.seed_b, lane.device).numpy())


# ---------------------------------------------------------------- one tensor


def quick_stamp(t: torch.Tensor) -> tuple:
    """What says for free that a tensor may have changed: torch's in-place version counter (none on
    inference tensors), its storage address, shape, strides, dtype and device."""
    version = None if t.is_inference() else t._version
    return version, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


def _check_key(key_id: int, what: str) -> None:
    if key_id != process_key().id:
        raise InputError(f"{what}: this weight stamp was taken in another process (pickled, or sent from another "
                         "rank); stamps are keyed per process and never compared across processes. Compute the "
                         "weight-derived state again in this process (e.g. hal.exact_weight(weight, spec=...))")


@dataclass(frozen=True)
class TensorStamp:
    """A tensor's quick stamp, shape, dtype and content hash, under the key ``key_id``."""
    quick: tuple
    shape: tuple
    dtype: torch.dtype
    digest: int
    key_id: int

    @staticmethod
    def of(t: torch.Tensor) -> "TensorStamp":
        """The full stamp (hashes every byte of ``t``)."""
        return TensorStamp(quick_stamp(t), tuple(t.shape), t.dtype, content_hash(t), process_key().id)

    def same_tensor(self, t: torch.Tensor, what: str = "weight") -> bool:
        """Cheap check: the quick stamp is unchanged. False: maybe changed; True proves nothing about the bits.
        InputError if the stamp is of another process's key (its addresses mean nothing here)."""
        _check_key(self.key_id, what)
        return quick_stamp(t) == self.quick

    def same_bits(self, t: torch.Tensor, what: str = "weight") -> bool:
        """Full check: ``t`` has this stamp's shape, dtype and bits (hashes every byte of ``t``).
        InputError if the stamp is of another process's key."""
        _check_key(self.key_id, what)
        return tuple(t.shape) == self.shape and t.dtype == self.dtype and content_hash(t) == self.digest

    def bits_equal(self, other: "TensorStamp", what: str = "weight") -> bool:
        """Two stamps of the same key describe the same shape, dtype and bits (no tensor read)."""
        _check_key(self.key_id, what)
        _check_key(other.key_id, what)
        return (self.shape, self.dtype, self.digest) == (other.shape, other.dtype, other.digest)


# ---------------------------------------------------------------- a set of named tensors


# Every optimizer step -- fused, foreach or loop, torch's or a subclass of torch.optim.Optimizer -- runs
# the global step post-hooks: counting them gives the cheap check a signal for the writes the version
# counter misses most often in RL (a fused AdamW step moves every weight and bumps no counter).
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps() -> int:
    """How many ``torch.optim.Optimizer`` steps this process has taken (any optimizer, any parameters)."""
    return _optimizer_steps


@dataclass(frozen=True)
class WeightsStamp:
    """Stamps of named tensors (``ModelWeights.stamp()``), in the order they were read, and the
    process's optimizer step count when they were taken (part of the cheap check)."""
    tensors: tuple  # ((name, TensorStamp), ...)
    optimizer_steps: int = 0

    def same_bits(self, other: "WeightsStamp", what: str = "weights") -> bool:
        """The same names, shapes, dtypes and bits (no tensor read): what the full check compares."""
        if [n for n, _ in self.tensors] != [n for n, _ in other.tensors]:
            return False
        return all(a.bits_equal(b, what) for (_, a), (_, b) in zip(self.tensors, other.tensors))

    def changed_names(self, other: "WeightsStamp") -> list[str]:
        """Names whose bits (or presence) differ between the two stamps (for error messages)."""
        mine, theirs = dict(self.tensors), dict(other.tensors)
        return sorted(n for n in mine.keys() | theirs.keys()
                      if n not in mine or n not in theirs or not mine[n].bits_equal(theirs[n]))


class ModelWeights:
    """The weights a cache depends on, read afresh at each check (a module's parameters may be replaced).

    ``source``: an ``nn.Module`` (its ``named_parameters()``, tied weights once), a mapping name -> tensor,
    or a callable returning ``(name, tensor)`` pairs (e.g. parameters plus chosen buffers; for DTensor
    parameters, each rank's local shards: a stamp is per process anyway).

    * ``stamp()`` -> :class:`WeightsStamp`: the full stamp (hashes every tensor).
    * ``changed(since)``: full check, True iff a name, shape, dtype or bit differs from ``since``.
    * ``quick()`` / ``quick_changed(since)``: cheap check (no data read); True = maybe changed, False
      proves nothing (see the module docstring).
    """

    def __init__(self, source):
        if isinstance(source, torch.nn.Module):
            self._named = source.named_parameters
        elif isinstance(source, Mapping):
            self._named = lambda: source.items()
        elif callable(source):
            self._named = source
        else:
            raise InputError(f"ModelWeights takes an nn.Module, a mapping name -> tensor or a callable returning "
                             f"(name, tensor) pairs, got {type(source).__name__}")

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in self._named()]

    def stamp(self) -> WeightsStamp:
        steps = optimizer_steps()  # before reading: a step taken while hashing shows as a change
        return WeightsStamp(tuple((n, TensorStamp.of(t)) for n, t in self.named()), steps)

    def changed(self, since: WeightsStamp) -> bool:
        return not self.stamp().same_bits(since)

    def quick(self) -> tuple:
        return tuple((n, quick_stamp(t)) for n, t in self.named())

    def quick_changed(self, since: WeightsStamp) -> bool:
        """True if any quick stamp differs or an optimizer step was taken since ``since``."""
        return (optimizer_steps() != since.optimizer_steps
                or self.quick() != tuple((n, s.quick) for n, s in since.tensors))
