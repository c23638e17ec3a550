"""Prepared weights of the exact matmul policy: a constant weight sliced once, not in every call.

Slicing a weight (``core.slice_rows``: per-channel exponent, s int8 digit planes) costs far more than
the int8 products of a small batch (a 4096 x 4096 weight: 0.31 s compiled, docs/exact_matmul.md).
Weights are constant across inference calls and across a training step's micro-batches, so
:class:`ExactWeight` keeps the slices with the tensor they came from. It is a cache, not a new
computation: the exact policy's bits are a function of the weight's values, so a call with an
``ExactWeight`` gives the bits of the same call with the plain tensor (tests/test_exact_weight.py).

``hal.exact_weight`` (hal/ops.py) makes one; kernels take it wherever they take an exact weight in
linear orientation ([N, K]) and read it through :func:`unpack`.
"""
from __future__ import annotations

import torch

from hal.errors import InputError
from hal.spec import EXACT
from hal.weight_watch import TensorStamp

from . import core

LAYOUTS = {"linear": "weight [N, K] (hal.linear; the LM head [V, H] of token_logprobs)",
           "matmul": "b [K, N] (hal.matmul)"}


def stamp_of(t: torch.Tensor) -> TensorStamp:
    """What an ExactWeight compares on each use: the weight detector's full stamp (hal/weight_watch.py)."""
    return TensorStamp.of(t)


class ExactWeight:
    """A weight sliced once for one exact matmul spec.

    Layout (every backend reads this one): ``sliced.digits`` int8 [s, N, K], digit plane t of output
    channel n over K, most significant first; ``sliced.exp`` int64 [N], the channel exponents E;
    ``sliced.finite``, whether the weight has no NaN/inf (``core.Sliced``). N is the output axis
    whatever the source's ``layout``: "linear" (source [N, K]) or "matmul" (source b [K, N], sliced
    as b^T). Memory: s bytes per weight value, on the source's device.

    ``source`` is the tensor itself (kept, not copied): NaN/inf inputs read it (special values are
    not in the slices), backends that do not read slices get it, and autograd's weight gradient
    lands on it. Any use after the source's bits changed raises InputError, however they changed
    (an optimizer step fused or not, ``.data`` writes, a rebound storage, a broadcast): each use
    compares the source's stamp -- its quick stamp, then the hash of its bits -- with the one taken
    when it was sliced (hal/weight_watch.py, the one weight-change detector; cost in docs/exact_matmul.md).
    The stamp is keyed per process: an ExactWeight unpickled in another process is refused by name.
    """

    __slots__ = ("source", "spec", "layout", "sliced", "_stamp", "_checked", "_trusted")

    def __init__(self, source: torch.Tensor, spec, layout: str, sliced: core.Sliced, source_stamp=None):
        """``source_stamp``: the stamp of the bits ``sliced`` was cut from (default: ``source``'s now)."""
        self.source, self.spec, self.layout, self.sliced = source, spec, layout, sliced
        self._stamp = stamp_of(source) if source_stamp is None else source_stamp
        self._checked = False
        self._trusted = False

    def over(self, source: torch.Tensor) -> "ExactWeight":
        """The same slices and stamp over another tensor object with the same values (a new view of the
        same weight, so that autograd reaches the caller's tensor); its next use checks it as usual."""
        return ExactWeight(source, self.spec, self.layout, self.sliced, self._stamp)

    def checked(self) -> "ExactWeight":
        """A copy whose next ``check_fresh`` is skipped once: for a caller that has just checked this
        weight and hands it straight to one op (the op and its kernel would hash the same bits again)."""
        ew = self.over(self.source)
        ew._checked = True
        return ew

    def trusted(self) -> "ExactWeight":
        """A copy that never checks again: for a launch path's replay (backends/triton.launch_path), which repeats
        an eager call that checked this weight and reads no value on the host (a hash compare would); a replay
        trusts its inputs as they are then, as it does every other input's values."""
        ew = self.over(self.source)
        ew._trusted = True
        return ew

    def is_fresh(self, name: str = "weight") -> bool:
        """Whether the source still holds the bits the slices were cut from (the hash is read only when
        the quick stamp matches: a quick-stamp change is a change). InputError for a stamp of another
        process (a pickled ExactWeight)."""
        return self._stamp.same_tensor(self.source, name) and self._stamp.same_bits(self.source, name)

    @property
    def rows(self) -> torch.Tensor:
        """The source as [N, K] (output channels as rows: the orientation of the slices)."""
        return self.source if self.layout == "linear" else self.source.transpose(0, 1)

    @property
    def shape(self) -> torch.Size:
        return self.source.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def slices(self) -> int:
        return self.spec.slices

    def __repr__(self):
        return (f"ExactWeight({self.spec.id}, layout={self.layout!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device})")

    def check_fresh(self, name: str = "weight") -> None:
        if self._trusted:
            return
        if self._checked:
            self._checked = False
            return
        if not self.is_fresh(name):
            raise InputError(f"{name}: weight changed since exact_weight(...) (its bits or its storage differ "
                             "from those it was sliced from, so its slices are stale); prepare it again with "
                             "hal.exact_weight(weight, spec=...)")

    def check_layout(self, name: str, layout: str) -> None:
        if self.layout != layout:
            raise InputError(f"{name}: this ExactWeight was prepared from {LAYOUTS[self.layout]}, but this "
                             f"argument is {LAYOUTS[layout]}; prepare it with layout={layout!r}")

    def check_spec(self, name: str, exact_spec, call_spec_id: str) -> None:
        """``exact_spec``: the call's matmul spec (None when the call's spec ``call_spec_id`` uses none; a fast one is
        refused like None)."""
        if exact_spec is None or exact_spec.policy != EXACT:  # no matmul, or a fast one
            raise InputError(f"{name}: an ExactWeight holds slices for {self.spec.id}, but the call's spec "
                             f"{call_spec_id} does not use the exact policy; pass an exact spec or the plain tensor")
        if exact_spec != self.spec:
            raise InputError(f"{name}: this ExactWeight was prepared for {self.spec.id}, but the call uses "
                             f"{exact_spec.id} ({exact_spec.slices} slices); prepare it for that spec")


def prepare(weight: torch.Tensor, spec, layout: str = "linear", slicer=None) -> ExactWeight:
    """Slice ``weight`` once (``slicer``: a compiled ``core.slice_rows`` with the same bits; default the core's)."""
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    rows = weight if layout == "linear" else weight.transpose(0, 1)
    core.check_k("weight", rows.shape[1])
    with torch.no_grad():
        source_stamp = stamp_of(weight)  # before slicing: a change while slicing then shows as stale
        sliced = (slicer or core.slice_rows)(rows.detach(), spec.slices)
    return ExactWeight(weight, spec, layout, sliced, source_stamp)


def unpack(weight, spec) -> tuple[torch.Tensor, core.Sliced | None]:
    """A kernel's weight argument -> (weight [N, K], its slices or None to slice in this call).

    A plain tensor is sliced per call; an ExactWeight must be fresh and made for ``spec``."""
    if not isinstance(weight, ExactWeight):
        return weight, None
    weight.check_fresh()
    weight.check_spec("weight", spec, spec.id)
    return weight.rows, weight.sliced
