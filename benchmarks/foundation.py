"""Benchmark rows for matmul / linear / rms_norm / softmax family / token_logprobs on CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import hal


def _r(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def rows(quick: bool):
    m, k, n = (16, 256, 256) if quick else (64, 1024, 1024)
    hn, hh = (16, 1024) if quick else (256, 4096)
    sr, sv = (8, 4096) if quick else (32, 32768)
    tn, th, tv = (8, 128, 4096) if quick else (32, 512, 32000)
    a, b = _r(m, k), _r(k, n, seed=1)
    x, w = _r(hn, hh), _r(hh, seed=2)
    s = _r(sr, sv)
    h, W, tok = _r(tn, th), _r(tv, th, seed=3), torch.arange(tn) * 13 % tv
    return [
        ("matmul", f"{m}x{k}x{n} fp32", lambda: hal.matmul(a, b), lambda: a @ b),
        ("linear", f"{m}x{k}x{n} fp32", lambda: hal.linear(a, b.t()), lambda: F.linear(a, b.t())),
        ("rms_norm", f"{hn}x{hh} fp32", lambda: hal.rms_norm(x, w), lambda: F.rms_norm(x, (hh,), w, 1e-6)),
        ("log_softmax", f"{sr}x{sv} fp32", lambda: hal.log_softmax(s), lambda: torch.log_softmax(s, -1)),
        ("softmax", f"{sr}x{sv} fp32", lambda: hal.softmax(s), lambda: torch.softmax(s, -1)),
        ("token_logprobs", f"N{tn} H{th} V{tv} fp32", lambda: hal.token_logprobs(h, W, tok),
         lambda: torch.log_softmax(F.linear(h, W), -1).gather(-1, tok[:, None])),
    ]
