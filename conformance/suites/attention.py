"""attention: flash_attn_varlen_func and flash_attn_with_kvcache against one canonical computation.

Each case packs three sequences into one varlen call (the base call, "training / full prefill"):
seq 0 is long (it crosses the spec's block and split boundaries), seq 1 is short, seq 2 shares
its first P tokens with seq 0 (for prefix-cache reuse). Every transform below recomputes some
rows of those sequences another way and must give the base bits exactly:

L1  each sequence alone; reversed packing order; NaN/inf neighbour sequences and padding tokens.
L2  chunked prefill at the split points 1, B-1, B, B+1, S-1, S, S+1 and random ones (varlen, and a
    paged KV cache appended chunk by chunk); decode token by token in a batch whose membership
    changes; prefilling and decoding sequences mixed in one call; paged (shuffled block tables,
    page sizes 1, 7, 64) vs contiguous cache; num_splits 1..8; a second request reusing a
    cached prefix's pages.
L3  the autograd (training) forward of flash_attn_varlen_func.

For a non-causal case a "chunk" is a block of query rows against all of the sequence's keys
(the only split of a non-causal call that keeps its meaning).
"""
from __future__ import annotations

import torch

import hal
from hal.kv_cache import KVCache
from hal.spec import AttentionSpec, DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, half_ulp

EPS32 = 2.0 ** -24
SMALL = AttentionSpec(kv_block=16, kv_split=64)        # many blocks and splits at short lengths
P_ROUNDED = AttentionSpec(kv_block=16, kv_split=64, p_precision="input")

# name, spec, (len seq0, len seq1, shared prefix P, seq2 suffix), Hq, Hkv, D, causal, window, scale
CONFIGS = [
    ("gqa_h4kv2_d64_causal", None, (270, 21, 100, 37), 4, 2, 64, True, (-1, -1), None),
    ("mha_h2_d128_causal", SMALL, (150, 18, 45, 30), 2, 2, 128, True, (-1, -1), None),
    ("mqa_h3kv1_d40_window37", SMALL, (140, 25, 70, 20), 3, 1, 40, True, (37, -1), 0.2),
    ("gqa_h4kv2_d72_noncausal", SMALL, (100, 13, 40, 22), 4, 2, 72, False, (-1, -1), None),
    ("gqa_h2kv1_d64_prounded", P_ROUNDED, (110, 17, 50, 15), 2, 1, 64, True, (-1, -1), None),
    # NaN in a row's own visible inputs: a query of seq 0 (row 30) and key 20 of seq 0 (so every later
    # query of seq 0, and of seq 2 which shares that prefix, sees it); outputs must be the canonical NaN
    # whichever path (prefill, chunk, decode, split-KV) computes them
    ("nan_gqa_h2kv1_d32", SMALL, (90, 12, 40, 10), 2, 1, 32, True, (-1, -1), None),
    # signed zeros (_signed_zero_seq0): seq 0's output is -0.0 in head dim 0 only if every padded or skipped step
    # leaves a chain at -0.0 as it is (its last block ends past the sequence; head dim 40 off the 64 dot tile)
    ("signed_zero_h2kv1_d40_noncausal", SMALL, (170, 12, 40, 10), 2, 1, 40, False, (-1, -1), None),
]


def _signed_zero_seq0(q, k, v, scale: float):
    """Seq 0 (170 keys, kv_block 16, kv_split 64, non-causal) built so that head dim 0 of its output is -0.0, and
    +0.0 if a padded step or a skipped key added a +0.0 product to a chain at -0.0 (an FMA-dot tile padding with
    +0.0 where the spec's shorter chain keeps -0.0). A -0.0 survives only where the running value it is added to
    is exactly -0.0, so it is built up in the spec's order (scores: q = e_0, so s = scale * k[:, 0], either 0 or
    G ~ 100; V[:, 0] is -0.0 except three keys at minus the dtype's smallest subnormal, t):

    split 1 (keys 0-63, s = 0, V[5] = -t): ACC = -t;  split 2 (keys 64-127, s = G): ACC = -t * exp(-G) -> -0.0;
    split 3: block [128, 144) (s = 0, V[128] = -t) acc = -t; block [144, 160) (s = G) acc -> -0.0; block
    [160, 176): key 160 (s = 0: p = exp(-G)) adds p * -t -> -0.0, keys 161-169 add -0.0, keys 170-175 are past
    the sequence: the spec skips them; a kernel must add products equal to -0.0 there."""
    tiny = torch.finfo(v.dtype).smallest_normal * torch.finfo(v.dtype).eps  # the smallest subnormal
    q.zero_()
    q[..., 0] = 1.0
    k[..., 0] = 0.0
    k[64:128, :, 0] = 100.0 / scale
    k[144:170, :, 0] = 100.0 / scale
    k[160, :, 0] = 0.0
    v[..., 0] = -0.0
    v[[5, 128, 160], :, 0] = -tiny


# ------------------------------------------------------------------ helpers


def _opts(case):
    p = case.p
    return dict(causal=p["causal"], window_size=p["window"], softmax_scale=p["scale"])


def _lens(case):
    l0, l1, pre, suf = case.p["lens"]
    return [l0, l1, pre + suf]


def _rows(inputs, s):
    cu = inputs["cu"].tolist()
    return slice(cu[s], cu[s + 1])


def _seq(inputs, s):
    r = _rows(inputs, s)
    return inputs["q"][r], inputs["k"][r], inputs["v"][r]


def _base_rows(base, inputs, s, a=0, b=None):
    r = _rows(inputs, s)
    b = r.stop - r.start if b is None else b
    return {k: t[r.start + a:r.start + b] for k, t in base.items()}


def _kend(case, n, b):
    """Keys a chunk of query rows ending at b sees: up to b (causal), all n (non-causal)."""
    return b if case.p["causal"] else n


def _varlen(backend, case, parts):
    """One varlen call over parts = [(q, k, v), ...] -> [{"out", "lse"} per part] (lse token-major)."""
    cq = [0]
    ck = [0]
    for q, k, _ in parts:
        cq.append(cq[-1] + q.shape[0])
        ck.append(ck[-1] + k.shape[0])
    q = torch.cat([p[0] for p in parts])
    k = torch.cat([p[1] for p in parts])
    v = torch.cat([p[2] for p in parts])
    out, lse = hal.flash_attn_varlen_func(
        q, k, v, torch.tensor(cq, dtype=torch.int32, device=q.device), torch.tensor(ck, dtype=torch.int32, device=q.device),
        max(b - a for a, b in zip(cq, cq[1:])), max(b - a for a, b in zip(ck, ck[1:])),
        return_lse=True, spec=case.spec, backend=backend, **_opts(case))
    lse = lse.transpose(0, 1)
    return [{"out": out[a:b], "lse": lse[a:b]} for a, b in zip(cq, cq[1:])]


def _kv(cache, backend, case, q, k=None, v=None, rows=None, num_splits=0):
    out, lse = cache.attend(q, k, v, rows=rows, num_splits=num_splits, return_lse=True, spec=case.spec,
                            backend=backend, **_opts(case))
    return out, lse.transpose(1, 2)


def _perm(case, label, n):
    """A shuffled page order from the counter generator."""
    return torch.argsort(gen.rand(case.key("pages", label), (n,), torch.float64), stable=True).tolist()


def _paged(case, label, batch, cap, page, device):
    hkv, d = case.p["hkv"], case.p["d"]
    n_pages = batch * -(-cap // page) + 2
    return KVCache.paged(batch, cap, hkv, d, page, case.dtype, device=device, num_pages=n_pages,
                         page_order=_perm(case, label, n_pages))


def _pairs(label, expected: dict, got: dict):
    for k in expected:
        yield f"{label}:{k}", expected[k], got[k]


def _cat(chunks):
    return {k: torch.cat([c[k] for c in chunks]) for k in chunks[0]}


def _split_points(case, n):
    spec = case.spec
    b, s = spec.kv_block, spec.kv_split
    named = [1, b - 1, b, b + 1, s - 1, s, s + 1]
    rand = [int(x) + 1 for x in gen.randint(case.key("cuts"), (3,), n - 1)]
    return sorted({p for p in named if 0 < p < n}), rand


def _kv_prefill_chunks(backend, case, cache, row, q, k, v, cuts):
    """Prefill one sequence through the cache in chunks [cuts[i], cuts[i+1]): the engine's chunked prefill."""
    n = q.shape[0]
    bounds = [0, *cuts, n]
    if not case.p["causal"]:  # all keys first; then query chunks against them
        cache.write(k.unsqueeze(0), v.unsqueeze(0), rows=[row])
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        if case.p["causal"]:
            o, l = _kv(cache, backend, case, q[a:b].unsqueeze(0), k[a:b].unsqueeze(0), v[a:b].unsqueeze(0), rows=[row])
        else:
            o, l = _kv(cache, backend, case, q[a:b].unsqueeze(0), rows=[row])
        outs.append({"out": o[0], "lse": l[0]})
    return _cat(outs)


# ------------------------------------------------------------------ L1 checks


def _alone(backend, case, inputs, base):
    for s in range(3):
        got = _varlen(backend, case, [_seq(inputs, s)])[0]
        yield from _pairs(f"seq{s}-alone", _base_rows(base, inputs, s), got)


def _reversed(backend, case, inputs, base):
    got = _varlen(backend, case, [_seq(inputs, s) for s in (2, 1, 0)])
    for s, g in zip((2, 1, 0), got):
        yield from _pairs(f"reversed-order:seq{s}", _base_rows(base, inputs, s), g)


def _hostile(case, label, n, like):
    fi = torch.finfo(case.dtype)
    vals = torch.tensor([float("nan"), float("inf"), -fi.max, fi.max, float("-inf")], dtype=torch.float32)
    idx = gen.randint(case.key("hostile", label), (n, *like.shape[1:]), len(vals))
    return vals[idx].to(case.dtype).to(like.device)


def _padding(backend, case, inputs, base):
    """NaN/inf sequences between the real ones and NaN padding tokens past cu_seqlens[-1]."""
    parts = []
    for s in range(3):
        q, k, v = _seq(inputs, s)
        parts.append((_hostile(case, f"q{s}", 5, q), _hostile(case, f"k{s}", 6, k), _hostile(case, f"v{s}", 6, v)))
        parts.append((q, k, v))
    cq, ck = [0], [0]
    for q, k, _ in parts:
        cq.append(cq[-1] + q.shape[0])
        ck.append(ck[-1] + k.shape[0])
    pad_q = _hostile(case, "pad-q", 4, inputs["q"])
    pad_k = _hostile(case, "pad-k", 3, inputs["k"])
    q = torch.cat([p[0] for p in parts] + [pad_q])
    k = torch.cat([p[1] for p in parts] + [pad_k])
    v = torch.cat([p[2] for p in parts] + [_hostile(case, "pad-v", 3, inputs["v"])])
    lq = max(b - a for a, b in zip(cq, cq[1:]))
    lk = max(b - a for a, b in zip(ck, ck[1:]))
    cq_t, ck_t = (torch.tensor(c, dtype=torch.int32, device=q.device) for c in (cq, ck))
    out, lse = hal.flash_attn_varlen_func(q, k, v, cq_t, ck_t,
                                          lq, lk, return_lse=True, spec=case.spec, backend=backend, **_opts(case))
    lse = lse.transpose(0, 1)
    for s in range(3):
        a, b = cq[2 * s + 1], cq[2 * s + 2]
        yield from _pairs(f"among-hostile-sequences:seq{s}", _base_rows(base, inputs, s), {"out": out[a:b], "lse": lse[a:b]})


# ------------------------------------------------------------------ L2 checks


def _chunked_varlen(backend, case, inputs, base):
    """Two calls per split point: rows [0, p) then rows [p, n) (keys from 0), each point its own sequence."""
    q, k, v = _seq(inputs, 0)
    n = q.shape[0]
    named, rand = _split_points(case, n)
    points = [named[len(named) // 2], *rand[:2]]
    first = _varlen(backend, case, [(q[:p], k[:_kend(case, n, p)], v[:_kend(case, n, p)]) for p in points])
    second = _varlen(backend, case, [(q[p:], k, v) for p in points])
    for p, f, s in zip(points, first, second):
        yield from _pairs(f"varlen-split-at-{p}", _base_rows(base, inputs, 0), _cat([f, s]))


def _chunked_kvcache(backend, case, inputs, base):
    """seq 0 prefilled through a paged cache (page 7, shuffled) cut at every named and random split point."""
    q, k, v = _seq(inputs, 0)
    named, rand = _split_points(case, q.shape[0])
    cuts = sorted(set(named) | set(rand))
    cache = _paged(case, "chunked", 1, q.shape[0], 7, q.device)
    got = _kv_prefill_chunks(backend, case, cache, 0, q, k, v, cuts)
    yield from _pairs(f"kvcache-cuts-{cuts}", _base_rows(base, inputs, 0), got)


def _decode(backend, case, inputs, base):
    """Token-by-token decode of seq 1 (from an empty cache) alongside seq 0 decoding across a split or
    block boundary; a sequence leaves the batch when done, so the batch changes under both."""
    (q0, k0, v0), (q1, k1, v1) = _seq(inputs, 0), _seq(inputs, 1)
    n0, n1 = q0.shape[0], q1.shape[0]
    ks = case.spec.kv_split if n0 > case.spec.kv_split + 8 else case.spec.kv_block
    start0 = ks - 6
    n_dec0 = 14
    cache = _paged(case, "decode", 2, max(n0, n1), 5, q0.device)
    causal = case.p["causal"]
    if causal:
        cache.write(k0[None, :start0], v0[None, :start0], rows=[0])
    else:
        cache.write(k0[None], v0[None], rows=[0])
        cache.write(k1[None], v1[None], rows=[1])
    todo = {0: list(range(start0, start0 + n_dec0)), 1: list(range(n1))}
    got = {0: [], 1: []}
    while todo[0] or todo[1]:
        rows = [s for s in (0, 1) if todo[s]]
        pos = [todo[s].pop(0) for s in rows]
        qs = torch.stack([(q0, q1)[s][p] for s, p in zip(rows, pos)]).unsqueeze(1)
        if causal:
            ks_ = torch.stack([(k0, k1)[s][p] for s, p in zip(rows, pos)]).unsqueeze(1)
            vs_ = torch.stack([(v0, v1)[s][p] for s, p in zip(rows, pos)]).unsqueeze(1)
            o, l = _kv(cache, backend, case, qs, ks_, vs_, rows=rows)
        else:
            o, l = _kv(cache, backend, case, qs, rows=rows)
        for i, s in enumerate(rows):
            got[s].append({"out": o[i], "lse": l[i]})
    yield from _pairs(f"decode-seq0-rows-{start0}..{start0 + n_dec0 - 1}",
                      _base_rows(base, inputs, 0, start0, start0 + n_dec0), _cat(got[0]))
    yield from _pairs("decode-seq1-all-rows", _base_rows(base, inputs, 1), _cat(got[1]))


def _mixed(backend, case, inputs, base):
    """One varlen call: seq 0's last chunk (prefill), seq 1's last token (decode), seq 2's last 3 rows."""
    parts, expect = [], []
    for s, take in ((0, 29), (1, 1), (2, 3)):
        q, k, v = _seq(inputs, s)
        n = q.shape[0]
        parts.append((q[n - take:], k, v))
        expect.append(_base_rows(base, inputs, s, n - take, n))
    for s, e, g in zip((0, 1, 2), expect, _varlen(backend, case, parts)):
        yield from _pairs(f"mixed-call:seq{s}", e, g)


def _paged_vs_contiguous(backend, case, inputs, base):
    """seq 2 prefilled in one call into a contiguous cache and into paged caches (page 1, 7, 64, shuffled)."""
    q, k, v = _seq(inputs, 2)
    n = q.shape[0]
    layouts = [("contiguous", KVCache.contiguous(1, n + 3, case.p["hkv"], case.p["d"], case.dtype, q.device))]
    layouts += [(f"paged-{p}", _paged(case, f"pv{p}", 1, n, p, q.device)) for p in (1, 7, 64)]
    for label, cache in layouts:
        yield from _pairs(label, _base_rows(base, inputs, 2), _kv_prefill_chunks(backend, case, cache, 0, q, k, v, []))


def _num_splits(backend, case, inputs, base):
    """The last 3 tokens of seq 0 and seq 2 (one batch) with num_splits 1..8, appended to a cached prefix."""
    seqs = [_seq(inputs, 0), _seq(inputs, 2)]
    take = 3
    causal = case.p["causal"]
    for ns in range(1, 9):
        cache = KVCache.contiguous(2, max(s[0].shape[0] for s in seqs), case.p["hkv"], case.p["d"], case.dtype,
                                   seqs[0][0].device)
        for i, (q, k, v) in enumerate(seqs):
            n = q.shape[0]
            upto = n - take if causal else n
            cache.write(k[None, :upto], v[None, :upto], rows=[i])
        qs = torch.stack([q[q.shape[0] - take:] for q, _, _ in seqs])
        if causal:
            o, l = _kv(cache, backend, case, qs, torch.stack([k[k.shape[0] - take:] for _, k, _ in seqs]),
                       torch.stack([v[v.shape[0] - take:] for _, _, v in seqs]), num_splits=ns)
        else:
            o, l = _kv(cache, backend, case, qs, num_splits=ns)
        for i, s in enumerate((0, 2)):
            n = seqs[i][0].shape[0]
            yield from _pairs(f"num_splits={ns}:seq{s}", _base_rows(base, inputs, s, n - take, n),
                              {"out": o[i], "lse": l[i]})


def _prefix_reuse(backend, case, inputs, base):
    """seq 0 is cached; seq 2 maps seq 0's first P tokens (shared pages, partial page copied on write) and
    prefills only its own suffix."""
    (q0, k0, v0), (q2, k2, v2) = _seq(inputs, 0), _seq(inputs, 2)
    pre = case.p["lens"][2]
    cache = _paged(case, "prefix", 2, max(q0.shape[0], q2.shape[0]), 7, q0.device)
    cache.write(k0[None], v0[None], rows=[0])
    cache.share_prefix(0, 1, pre)
    if case.p["causal"]:
        o, l = _kv(cache, backend, case, q2[None, pre:], k2[None, pre:], v2[None, pre:], rows=[1])
        expect = _base_rows(base, inputs, 2, pre, q2.shape[0])
    else:
        cache.write(k2[None, pre:], v2[None, pre:], rows=[1])
        o, l = _kv(cache, backend, case, q2[None], rows=[1])
        expect = _base_rows(base, inputs, 2)
    yield from _pairs(f"prefix-{pre}-reused", expect, {"out": o[0], "lse": l[0]})
    # the shared pages must still hold seq 0's keys (copy-on-write protected them)
    yield "prefix-owner-keys-intact:k", k0, cache.keys(0)
    yield "prefix-owner-values-intact:v", v0, cache.values(0)


# ------------------------------------------------------------------ the suite


def _call(backend, case, x):
    n = x["q"].shape[0]
    lens = (x["cu"][1:] - x["cu"][:-1])
    out, lse = hal.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu"], x["cu"], int(lens.max()), int(lens.max()),
                                          return_lse=True, spec=case.spec, backend=backend, **_opts(case))
    assert out.shape[0] == n
    return {"out": out, "lse": lse.transpose(0, 1)}


class AttentionSuite(Suite):
    def cases(self):
        out = []
        for name, spec, lens, hq, hkv, d, causal, window, scale in CONFIGS:
            spec = spec or DEFAULTS["attention"]
            params = (("lens", lens), ("hq", hq), ("hkv", hkv), ("d", d), ("causal", causal), ("window", window),
                      ("scale", scale))
            out += [Case("attention", name, dt, spec, params) for dt in DTYPES]
        return out

    def make_inputs(self, case):
        l0, l1, pre, suf = case.p["lens"]
        hq, hkv, d = case.p["hq"], case.p["hkv"], case.p["d"]

        def mk(name, n, h, scale):
            return gen.randn(case.key(name), (n, h, d), case.dtype, scale=scale)

        seqs = []
        for s, n in ((0, l0), (1, l1), (2, suf)):
            seqs.append([mk(f"q{s}", n, hq, 1.5), mk(f"k{s}", n, hkv, 1.0), mk(f"v{s}", n, hkv, 1.0)])
        if case.name.startswith("nan_"):
            seqs[0][0][30, 1, 5] = float("nan")
            seqs[0][1][20, 0, 7] = float("nan")
        if case.name.startswith("signed_zero_"):
            _signed_zero_seq0(*seqs[0], case.p["scale"] or d ** -0.5)
        seqs[2] = [torch.cat([a[:pre], b]) for a, b in zip(seqs[0], seqs[2])]  # seq 2 = seq 0's prefix + suffix
        cu = torch.tensor([0, l0, l0 + l1, l0 + l1 + pre + suf], dtype=torch.int32)
        return {"q": torch.cat([s[0] for s in seqs]), "k": torch.cat([s[1] for s in seqs]),
                "v": torch.cat([s[2] for s in seqs]), "cu": cu}

    def run(self, backend, case, inputs):
        return _call(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels.oracle import attention as oa
        lens = x["cu"][1:] - x["cu"][:-1]
        scale = case.p["scale"] or case.p["d"] ** -0.5
        out, lse = oa.flash_attn_varlen_func(x["q"], x["k"], x["v"], x["cu"], x["cu"], int(lens.max()),
                                             int(lens.max()), scale, case.p["causal"], tuple(case.p["window"]))
        return {"out": out, "lse": lse.transpose(0, 1)}

    def budget(self, case, output, x, exact):
        """Error bound per row (query, head), from the computation's structure:

        score error E_s <= (dot_tile + n_dot_tiles + 2) eps * scale * sum_d |q_d k_d| (max over visible keys);
        p = exp(s - m) then carries a relative error <= 2 E_s + 3 eps (exp <= 1 ulp);
        sum_j p_j v_j / l: fma chains of <= n_visible + n_blocks + n_splits + 4 steps, each <= eps relative;
        P rounded to the input dtype ("input" spec): + 2 u_in relative; out rounded once: half an ulp.
        """
        from hal.attention import key_visibility, query_positions, varlen_to_padded, padded_to_varlen
        spec, d = case.spec, case.p["d"]
        scale = case.p["scale"] or d ** -0.5
        cu = x["cu"]
        lens = cu[1:] - cu[:-1]
        mx = int(lens.max())
        qp, qlen = varlen_to_padded(x["q"].double(), cu, mx)
        kp, klen = varlen_to_padded(x["k"].double(), cu, mx)
        vp, _ = varlen_to_padded(x["v"].double(), cu, mx)
        group = case.p["hq"] // case.p["hkv"]
        kp, vp = kp.repeat_interleave(group, 2), vp.repeat_interleave(group, 2)
        qpos, qvalid = query_positions(qlen, klen, mx)
        vis = key_visibility(qpos, qvalid, klen, mx, case.p["causal"], tuple(case.p["window"])).unsqueeze(2)
        vis = vis.squeeze(2)                                                          # [b, Q, K]
        vis4 = vis.unsqueeze(2)
        mag = torch.einsum("bqhd,bkhd->bqhk", qp.abs(), kp.abs()) * scale
        sc = torch.einsum("bqhd,bkhd->bqhk", qp, kp) * scale
        n_dot = spec.dot_tile + -(-d // spec.dot_tile) + 2
        e_s = (n_dot * EPS32 * torch.where(vis4, mag, 0.0)).amax(-1)                   # [b, Q, H]
        hi = torch.where(vis4, sc, float("-inf")).amax(-1, keepdim=True)
        spread = torch.where(vis4, hi - sc, 0.0).amax(-1)                              # max (m - s_j)
        n_vis = vis.sum(-1).double().unsqueeze(-1)                                     # [b, Q, 1]
        chain = n_vis + 2 * (n_vis / spec.kv_block + 1) + 2 * (n_vis / spec.kv_split + 1) + 6
        rel_p = 2 * e_s + (3 + 2 * spread) * EPS32
        if spec.p_precision == "input":
            rel_p = rel_p + 2 * torch.finfo(case.dtype).eps
        total = x["q"].shape[0]
        if output == "out":
            vrow = vp.abs().amax(-1)                                                   # [b, K, H]
            vmax = torch.where(vis.unsqueeze(-1), vrow.unsqueeze(1), 0.0).amax(-2)    # [b, Q, H]
            row = (2 * rel_p + chain * EPS32) * vmax
            return padded_to_varlen(row, cu, total).unsqueeze(-1) + 2 * half_ulp(exact, case.dtype)
        row = 3 * e_s + (chain + 2 * spread + 20) * EPS32
        return padded_to_varlen(row, cu, total) + 4 * half_ulp(exact, torch.float32)


SUITE = AttentionSuite(
    # quick: 90 keys cross the 16-key blocks and the 64-key split; NaN inputs; the Triton interpreter's set
    # signed_zero: an output whose -0.0 depends on the padded steps of the strict kernels' FMA-dot tiles
    quick=("nan_gqa_h2kv1_d32.fp32", "nan_gqa_h2kv1_d32.bf16", "signed_zero_h2kv1_d40_noncausal.fp32"),
    name="attention", ops=("flash_attn_varlen_func", "flash_attn_with_kvcache"),
    levels=("L0", "L1", "L2", "L3", "L4", "A"),
    checks={
        "L1": [("sequence-alone", _alone), ("reversed-order", _reversed), ("hostile-neighbours-and-padding", _padding)],
        "L2": [("chunked-prefill-varlen", _chunked_varlen), ("chunked-prefill-kvcache", _chunked_kvcache),
               ("decode", _decode), ("mixed-prefill-decode", _mixed), ("paged-vs-contiguous", _paged_vs_contiguous),
               ("num-splits", _num_splits), ("prefix-cache-reuse", _prefix_reuse)],
        "L3": autograd_check(_call, ("q", "k", "v")),
    },
)
