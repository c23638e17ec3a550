"""torch dtype -> Triton dtype for the output rounding (strict_math.round_out)."""
from __future__ import annotations

import torch
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    return _TL[dtype]
