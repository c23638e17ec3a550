"""token_logprobs with exact LM-head logits (TokenLogprobsSpec.matmul set) on the cpu backend.

The logits are the exact policy's dot rounded once to float32 (``hal.kernels.exact.cpu``:
``torch._int_mm`` slice products, the reference's bits); the temperature and the strict
log-softmax are the cpu backend's compiled rows (``softmax.logprob_rows``). The weight is sliced
once per call, one vocab tile at a time, unless it comes prepared (``hal.exact_weight``: its slices
are read a vocab tile at a time); the logits exist for at most ``softmax._ROW_CHUNK`` tokens x one
vocab tile of products, then chunk x V float32, never [N, V].
"""
from __future__ import annotations

import numpy as np
import torch

from hal.kernels.exact import core
from hal.kernels.exact.prepared import unpack

from .exact_slice import products, slice_rows
from .host import F32, array
from .softmax import _ROW_CHUNK, candidate_rows, logprob_rows

VOCAB_TILE = 8192  # weight rows per slicing / product step: 64 x 8192 x s^2 int64 products at most


def token_logprobs(hidden, weight, tokens, temperature, spec):
    """float32 log p(tokens | hidden) for hidden [..., H], weight [V, H] (or a prepared ExactWeight),
    tokens [...] (hidden's lead shape) or [N, K] for hidden [N, H] (K tokens of each row)."""
    mm = spec.matmul
    core.check_k("hidden", hidden.shape[-1])
    w_all, prepared = unpack(weight, mm)
    (n, k), v = candidate_rows(hidden, tokens), w_all.shape[0]
    h2 = hidden.reshape(n, hidden.shape[-1])
    tiles = [(v0, w_all[v0:v0 + VOCAB_TILE]) for v0 in range(0, v, VOCAB_TILE)]
    sliced = [prepared.rows(v0, v0 + w.shape[0]) if prepared is not None else slice_rows(w, mm.slices)
              for v0, w in tiles]
    tok = array(tokens.reshape(n, k).to(torch.int64).contiguous())
    out = torch.empty((n, k), dtype=F32)
    temp = np.float32(temperature)
    for c0 in range(0, n, _ROW_CHUNK):
        rows = h2[c0:c0 + _ROW_CHUNK]
        logits = torch.empty((rows.shape[0], v), dtype=F32)  # [chunk, V]: the compiled rows' layout
        for (v0, w), ws in zip(tiles, sliced):
            logits[:, v0:v0 + w.shape[0]] = core.exact_linear(rows, w, None, mm.slices, products, ws,
                                                              out_dtype=F32, slicer=slice_rows)
        logprob_rows(array(logits), c0, tok, temp, temperature != 1.0, spec.vocab_tile, array(out))
    return out.reshape(tokens.shape)
