"""Exact comparison of bit patterns, and the first divergence when they differ.

Never a tolerance: -0.0 differs from +0.0 and every NaN payload counts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    if t.dtype in _INT_OF:
        return t.view(_INT_OF[t.dtype])
    return t


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Map float bit patterns to integers whose difference counts ulps across the sign change."""
    width = bits.element_size() * 8
    i = bits.to(torch.int64)
    if width < 64:
        i = i & ((1 << width) - 1)
        sign = (i >> (width - 1)) & 1
        mag = i & ((1 << (width - 1)) - 1)
    else:
        sign = (i < 0).to(torch.int64)
        mag = i & 0x7FFFFFFFFFFFFFFF
    return torch.where(sign == 1, -mag, mag)


@dataclass
class Divergence:
    label: str
    index: list[int] | None
    expected_bits: str | None
    got_bits: str | None
    expected: str | None
    got: str | None
    ulp: int | None
    count: int
    total: int
    note: str = ""

    def to_dict(self):
        return asdict(self)

    def __str__(self):
        if self.note:
            return f"{self.label}: {self.note}"
        return (f"{self.label}: first divergence at index {tuple(self.index)}: expected {self.expected} "
                f"(bits {self.expected_bits}), got {self.got} (bits {self.got_bits}), {self.ulp} ulp; "
                f"{self.count}/{self.total} elements differ")


def first_divergence(label: str, expected: torch.Tensor, got: torch.Tensor) -> Divergence | None:
    """None when ``got`` has exactly the bits of ``expected`` (same dtype and shape), else where not."""
    if expected.dtype != got.dtype or tuple(expected.shape) != tuple(got.shape):
        return Divergence(label, None, None, None, None, None, None, 0, expected.numel(),
                          note=f"expected {expected.dtype}{list(expected.shape)}, got {got.dtype}{list(got.shape)}")
    e, g = raw_bits(expected), raw_bits(got)
    diff = e != g
    if not bool(diff.any()):
        return None
    flat = int(diff.reshape(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(expected.shape))] if expected.dim() else []
    width = e.element_size() * 2
    eb, gb = int(e.reshape(-1)[flat]), int(g.reshape(-1)[flat])
    mask = (1 << (e.element_size() * 8)) - 1
    ulp = None
    if expected.dtype in _INT_OF:
        ulp = int((_ordered(e.reshape(-1)[flat:flat + 1]) - _ordered(g.reshape(-1)[flat:flat + 1])).abs())
    ev = expected.detach().reshape(-1)[flat].item()
    gv = got.detach().reshape(-1)[flat].item()
    return Divergence(label, index, f"0x{eb & mask:0{width}x}", f"0x{gb & mask:0{width}x}", repr(ev), repr(gv),
                      ulp, int(diff.sum()), diff.numel())


def assert_same_bits(expected: torch.Tensor, got: torch.Tensor, label: str = "tensor") -> None:
    """Raise AssertionError naming the first divergence unless the raw bits (and dtype, shape) match.

    For tests that claim bitwise equality: unlike ``torch.equal`` it tells -0.0 from +0.0 and
    compares NaN payloads.
    """
    d = first_divergence(label, expected, got)
    if d is not None:
        raise AssertionError(str(d))


def same_bits(a, b) -> bool:
    """True when dtype, shape and every raw bit pattern match (-0.0 != +0.0; NaN payloads count). Tuples and
    lists of tensors (an op's several outputs) match when they have the same length and match item by item."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same_bits(x, y) for x, y in zip(a, b)))
    return first_divergence("", a, b) is None
