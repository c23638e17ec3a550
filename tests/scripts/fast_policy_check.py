"""Fast-policy Triton kernels (tensor-core tl.dot) in the interpreter: structure checks on raw bits.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_fast_policy.py. The interpreter's ``tl.dot``
is replaced by the deterministic stand-in of kernels/triton/interpreter_dot.py (per output element:
its row, its column, the accumulator, the K tile), so these check what the kernel decides: which
tiles, in which order, chosen by what. Usage: python tests/scripts/fast_policy_check.py [CHECK...];
prints "CHECK: ok ..." / "CHECK: FAIL ..." lines. LOCKSTEP_FULL=1 runs every spec x dtype.
"""
from __future__ import annotations

import dataclasses
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402

import hal  # noqa: E402
from hal.kernels.triton import fast_matmul  # noqa: E402
from hal.spec import FastAttentionSpec, FastMatmulSpec, FastMatmulV3Spec  # noqa: E402
from _check_cli import main, skip_without_interpreter  # noqa: E402
from triton_seq_check import FAILED, _differs, _gen, _pick, _same  # noqa: E402
from _variants import kernel_variant  # noqa: E402

SMALL = FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
MM_CASES = [(SMALL, torch.bfloat16), (FastMatmulSpec(), torch.float16), (SMALL, torch.float16),
            (FastMatmulSpec(), torch.bfloat16)]
# M = 150 rows: 3 row tiles of 64 (SMALL), 2 of 128 (default); K = 100: a short last K tile for both
M, K, N = 150, 100, 40


def _inputs(dt, seed=0):
    r = _gen(seed)
    return r(M, K).to(dt), r(N, K, scale=K ** -0.5).to(dt), r(N).to(dt)


def _acc(x, w, b, spec):
    """The kernel's float32 accumulator (+ bias) before the output rounding: the bits its structure decides
    (rounding to bf16/fp16 would hide most one-ulp float32 differences)."""
    return fast_matmul._mm2d(x, w.t(), b, spec, torch.float32)


def _subsets():
    g = torch.Generator().manual_seed(1)
    return {"row-7-alone": [7], "first-3": [0, 1, 2], "random-17": sorted(torch.randperm(M, generator=g)[:17].tolist()),
            "rows-60-to-189-wrapped": [(60 + i) % M for i in range(130)], "reversed": list(range(M - 1, -1, -1))}


def mm_batch_invariance():
    """L1: a row's bits do not depend on the batch (size, position, neighbours) nor on the public op used."""
    for spec, dt in _pick(MM_CASES):
        x, w, b = _inputs(dt)
        base = hal.linear(x, w, b, spec=spec, backend="triton")
        pairs = []
        acc = _acc(x, w, b, spec)
        for name, idx in _subsets().items():
            i = torch.tensor(idx)
            pairs.append((name, base[i], hal.linear(x[i], w, b, spec=spec, backend="triton")))
            pairs.append((f"{name}:float32-accumulator", acc[i], _acc(x[i], w, b, spec)))
        nob = hal.linear(x, w, None, spec=spec, backend="triton")
        pairs.append(("matmul-3d-vs-linear", nob.reshape(3, 50, N),
                      hal.matmul(x.reshape(3, 50, K), w.t(), spec=spec, backend="triton")))
        pairs.append(("repeat", base, hal.linear(x, w, b, spec=spec, backend="triton")))
        _same(f"mm-batch-invariance[{spec.id},{dt}]", pairs)


def mm_tiles_from_batch_negative():
    """Negative control: block_k chosen from the batch size (as a library heuristic would) is caught."""
    for spec, dt in _pick(MM_CASES):
        x, w, b = _inputs(dt)
        def heuristic(rows):  # noqa: E306 -- the wrong variant: small batches get a shorter K tile
            s = spec if rows.shape[0] > 16 else FastMatmulSpec(block_m=spec.block_m, block_n=spec.block_n,
                                                                block_k=spec.block_k // 2)
            return _acc(rows, w, b, s)
        base = heuristic(x)
        idx = torch.tensor(_subsets()["random-17"][:8])
        _differs(f"mm-block-k-from-batch-negative[{spec.id},{dt}]", [("rows", base[idx], heuristic(x[idx]))])


def mm_split_k_negative():
    """Negative control: split-K for small batches (two K halves accumulated apart, then added) is caught."""
    for spec, dt in _pick(MM_CASES):
        x, w, _ = _inputs(dt)
        base = _acc(x, w, None, spec)
        rows = x[:4]
        h = K // 2  # split-K in two halves, as a library picks for few rows (not on the spec's K-tile grid)
        parts = [_acc(rows[:, s].contiguous(), w[:, s].contiguous(), None, spec) for s in (slice(0, h), slice(h, K))]
        split = parts[0] + parts[1]
        _differs(f"mm-split-k-negative[{spec.id},{dt}]", [("rows", base[:4], split)])


def mm_nonfinite():
    """NaN / inf inputs: canonical NaN, the same bits alone and in a batch."""
    for spec, dt in _pick(MM_CASES):
        x, w, b = _inputs(dt)
        x[3, 5], x[9, 90], w[2, 7] = float("nan"), float("inf"), float("-inf")
        y = hal.linear(x, w, b, spec=spec, backend="triton")
        nan_bits = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}[dt]
        raw = y.view(torch.int16).int() & 0xFFFF
        ok = bool((raw[torch.isnan(y)] == nan_bits).all()) and bool(torch.isnan(y[3]).all()) and not bool(torch.isfinite(y[:, 2]).any())
        if not ok:
            FAILED.append("mm-nonfinite")
            print(f"mm-nonfinite[{spec.id},{dt}]: FAIL (NaN not canonical, or row 3 not NaN, or column 2 finite)")
        _same(f"mm-nonfinite[{spec.id},{dt}]", [("rows-3-9", y[[3, 9]], hal.linear(x[[3, 9]], w, b, spec=spec,
                                                                                       backend="triton"))])


def mm_v3_table_same_bits():
    """v3 in the interpreter (its stand-in chains per k16 step, v3's rule): every launch of the table gives the float32
    accumulator bits of the reference launch (v2's default 128 x 128 x 64 under v3's rule), bf16 and fp16, K = 200
    (short last tiles of 64, 128 and 256; rows of 400 bytes, so TMA can describe them). Negative controls: the same
    launches under v2's stand-in (a chain per K tile: block_k decides) differ where block_k is not 64, and split-K
    in two programs differs."""
    ref = fast_matmul.launch_of_spec(FastMatmulSpec())
    table = fast_matmul.table_launches()
    for dt in (torch.bfloat16, torch.float16):
        r = _gen(3)
        x, w = r(M, 200).to(dt), r(N, 200, scale=200 ** -0.5).to(dt)
        def run(lt, a=x, b=w, step=16):
            return fast_matmul.run_launch(a, b.t(), None, lt, torch.float32, k_step=step)
        base = run(ref)
        _same(f"mm-v3-table[{dt}]", [(name, base, run(lt)) for name, lt in table])
        _differs(f"mm-v3-table-under-a-per-tile-rule-negative[{dt}]",
                 [(name, run(ref, step=None), run(lt, step=None)) for name, lt in table if lt.block_k != ref.block_k])
        h = 64  # split-K at a tile boundary, two programs' partials added
        split = run(ref, x[:, :h].contiguous(), w[:, :h].contiguous()) + run(ref, x[:, h:].contiguous(),
                                                                             w[:, h:].contiguous())
        _differs(f"mm-v3-split-k-negative[{dt}]", [("split", base, split)])
    # the public op picks the entry from the rows (1, 100, 300), K = 100: the prefill entry's pointer-load twin
    x, w, b = (t.to(torch.bfloat16) for t in (_gen(4)(300, K), _gen(5)(N, K, scale=K ** -0.5), _gen(6)(N)))
    spec = FastMatmulV3Spec()
    y = hal.linear(x, w, b, spec=spec, backend="triton")
    _same("mm-v3-rows-alone-vs-batch", [("row-0", y[:1], hal.linear(x[:1], w, b, spec=spec, backend="triton")),
                                        ("rows-0-99", y[:100], hal.linear(x[:100], w, b, spec=spec, backend="triton"))])


# ------------------------------------------------------------------ attention

ATTN_SMALL = FastAttentionSpec(block_m=16, kv_block=16, kv_split=32, num_warps=4)
ATTN_CASES = [(ATTN_SMALL, torch.bfloat16, 24), (FastAttentionSpec(block_m=32, kv_block=16, kv_split=48), torch.float16, 40)]
L_SEQ, HQ, HKV = 70, 4, 2  # 70 keys: 5 blocks of 16 (the last short), 3 splits of 32 / 2 of 48


def _attn_inputs(dt, d, seed=5):
    r = _gen(seed)
    return r(L_SEQ, HQ, d).to(dt), r(L_SEQ, HKV, d).to(dt), r(L_SEQ, HKV, d).to(dt)


def _prefill(q, k, v, spec):
    cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    return hal.flash_attn_varlen_func(q, k, v, cu, cu, q.shape[0], q.shape[0], causal=True, return_lse=True,
                                      spec=spec, backend="triton")


def _from_cache(q, k, v, n_keys, spec, num_splits=0, page=None):
    """Rows q against the first n_keys keys held in a KV cache (contiguous, or paged with pages of ``page``)."""
    kc, vc = k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()
    table = None
    if page:
        n_pages = -(-L_SEQ // page)
        pad = n_pages * page - L_SEQ
        kp = torch.cat([kc[0], kc[0][:pad]]).reshape(n_pages, page, HKV, -1)
        vp = torch.cat([vc[0], vc[0][:pad]]).reshape(n_pages, page, HKV, -1)
        perm = torch.randperm(n_pages, generator=torch.Generator().manual_seed(3))
        kc, vc = kp[perm].contiguous(), vp[perm].contiguous()  # shuffled pages: logical page i is at inv[i]
        table = torch.argsort(perm).to(torch.int32).unsqueeze(0)
    out, lse = hal.flash_attn_with_kvcache(q.unsqueeze(0), kc, vc, cache_seqlens=torch.tensor([n_keys], dtype=torch.int32),
                                           block_table=table, causal=True, num_splits=num_splits, return_lse=True,
                                           spec=spec, backend="triton")
    return out[0], lse[0]


def attn_split_invariance():
    """L2: prefill == chunked prefill at block / split boundaries == decode with 1 and 8 splits ==
    paged (shuffled pages of 7); out (input dtype) and lse (float32) in raw bits."""
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _attn_inputs(dt, d)
        out, lse = _prefill(q, k, v, spec)
        pairs = []
        for c in sorted({1, spec.kv_block, spec.kv_split + 1}):
            o, l = _from_cache(q[c:], k, v, L_SEQ, spec)
            pairs += [(f"chunk-from-{c}:out", out[c:], o), (f"chunk-from-{c}:lse", lse[:, c:], l)]
        for t in (spec.kv_split, L_SEQ - 1):
            for ns in (1, 8):
                o, l = _from_cache(q[t:t + 1], k, v, t + 1, spec, num_splits=ns)
                pairs += [(f"decode-{t}-splits{ns}:out", out[t:t + 1], o), (f"decode-{t}-splits{ns}:lse", lse[:, t:t + 1], l)]
        o, l = _from_cache(q[40:], k, v, L_SEQ, spec, page=7)
        pairs += [("paged-7:out", out[40:], o), ("paged-7:lse", lse[:, 40:], l)]
        _same(f"attn-split-invariance[{spec.id},{dt}]", pairs)


def attn_batch_invariance():
    """L1: a sequence alone == packed after another sequence and among NaN neighbours (varlen)."""
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _attn_inputs(dt, d)
        out, lse = _prefill(q, k, v, spec)
        q2, k2, v2 = _attn_inputs(dt, d, seed=9)
        nan = torch.full((5, HQ, d), float("nan"), dtype=dt)
        nan_kv = torch.full((5, HKV, d), float("nan"), dtype=dt)
        qq, kk, vv = torch.cat([q2[:33], nan, q]), torch.cat([k2[:33], nan_kv, k]), torch.cat([v2[:33], nan_kv, v])
        cu = torch.tensor([0, 33, 38, 38 + L_SEQ], dtype=torch.int32)
        o, l = hal.flash_attn_varlen_func(qq, kk, vv, cu, cu, L_SEQ, L_SEQ, causal=True, return_lse=True, spec=spec,
                                          backend="triton")
        _same(f"attn-batch-invariance[{spec.id},{dt}]", [("packed:out", out, o[38:]), ("packed:lse", lse, l[:, 38:])])


def attn_reverse_merge_negative():
    """Negative control: split partials merged in reverse order (split-KV decode path) is caught."""
    from hal.kernels.triton import attention_kernel
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _attn_inputs(dt, d)
        out, lse = _prefill(q, k, v, spec)
        with kernel_variant(attention_kernel, "_merge_kernel",
                            "w = _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits)",
                            "w = _ws_offsets(b * HQ + h, i, n_own - 1 - sp, n_ws_rows, n_ws_splits)"):
            o, l = _from_cache(q[40:], k, v, L_SEQ, spec, num_splits=8)  # 30 rows x 4 heads, 2-3 splits each
            pairs = [("rows-40-69:lse", lse[:, 40:], l), ("rows-40-69:out", out[40:], o)]
        _differs(f"attn-reverse-merge-negative[{spec.id},{dt}]", pairs)


def attn_wrong_head_negative():
    """Negative control: decode tiles that pack a GQA group's heads reading the q of the next head are caught
    (the packed rows are checked against one-head-per-program prefill by attn_split_invariance)."""
    from hal.kernels.triton import fast_attention
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _attn_inputs(dt, d)
        out, lse = _prefill(q, k, v, spec)
        with kernel_variant(fast_attention, "_fast_attn_kernel", "qr_off = q_off  # where rows read q (out and lse go to q_off)",
                            "qr_off = _q_offsets(Q_ROW0, b, i, g * PACK + (h + 1) % PACK, stride_qt, stride_qh)"):
            o, l = _from_cache(q[60:61], k, v, 61, spec, num_splits=1)  # one row: the group's 2 heads packed
        _differs(f"attn-wrong-head-negative[{spec.id},{dt}]", [("out", out[60:61], o), ("lse", lse[:, 60:61], l)])


#: the attention_fast suite's L2 checks run on the decode-tile case in CI (~7 s after its 8 s prefill here): all but
#: chunked prefill at every cut through varlen and a paged cache (chunks of up to 500 rows: 30 s in the interpreter)
#: and paged vs contiguous (decode and prefix reuse run on shuffled pages already); LOCKSTEP_FULL=1 and the suite's
#: quick set run every one
DECODE_TILE_L2_CI = ("mixed-prefill-decode", "prefix-cache-reuse", "decode", "num-splits")


def attn_decode_tile():
    """The decode-tile spec (hal.spec.FAST_ATTENTION_DECODE: 16-row tiles, 4 warps) through the attention_fast suite's
    own L2 checks on its quick case (530 keys across the 512-key split; a GQA group of 4, which decode tiles pack into
    the 16 rows), raw bits of out and float32 lse against the spec's own prefill (the suite's base call): a 29-row
    chunk across the split (prefill-sized tiles, the interior path) in a call with decoding rows, a 10-row chunk on
    shared paged prefix pages, decode token by token across the split (paged, page 5), num_splits 1..8.
    Negative control: decode tiles reading the next packed head's q, caught by the prefix-reuse rows (a 10-row chunk:
    4 heads x 4 rows in a tile). (In the interpreter
    the spec gives the default spec's bits: neither the tl.dot stand-in nor the interpreter's row sum depends on the
    tile's rows, so no check here can show the two specs differ; only a GPU can.)"""
    from hal.conformance import suites
    from hal.kernels.triton import fast_attention
    from hal.spec import FAST_ATTENTION_DECODE
    suite = suites.get("attention_fast")
    case = next(c for c in suite.quick_cases() if c.spec is FAST_ATTENTION_DECODE)
    be = hal.get_backend("triton")
    inputs = suite.make_inputs(case)
    base = suite.run(be, case, inputs)
    checks = dict(suite.checks["L2"])
    names = list(checks) if os.environ.get("LOCKSTEP_FULL", "") not in ("", "0") else DECODE_TILE_L2_CI
    label = f"attn-decode-tile[{case.spec.id},{case.dtype}]"
    _same(label, [pair for name in names for pair in checks[name](be, case, inputs, base)])
    with kernel_variant(fast_attention, "_fast_attn_kernel",
                        "qr_off = q_off  # where rows read q (out and lse go to q_off)",
                        "qr_off = _q_offsets(Q_ROW0, b, i, g * PACK + (h + 1) % PACK, stride_qt, stride_qh)"):
        wrong = list(checks["prefix-cache-reuse"](be, case, inputs, base))
    _differs(f"attn-decode-tile-wrong-head-negative[{case.spec.id},{case.dtype}]", wrong)


def attn_block_from_length_negative():
    """Negative control: the key block chosen from the query count (short chunks get bigger blocks) is caught."""
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _attn_inputs(dt, d)
        out, lse = _prefill(q, k, v, spec)
        wrong = dataclasses.replace(spec, kv_block=spec.kv_block * 2, kv_split=spec.kv_split * 2)
        o, l = _from_cache(q[50:], k, v, L_SEQ, wrong)
        _differs(f"attn-block-from-length-negative[{spec.id},{dt}]", [("lse", lse[:, 50:], l), ("out", out[50:], o)])


def _interior_inputs(dt, d, kind):
    """q, k, v of the interior-path checks: "finite"; "nonfinite" (a NaN q row, an inf K element of key 20, a -inf V
    element of key 45, -0.0 in q, k and a whole V head); "huge" (K of keys 24-39 times 2^100: finite scores near
    2^105, the bound still passes, so interior blocks run on them); "overflow" (K of keys 24-39 times 2^124: the bound
    fails and some scores overflow to +-inf in float32)."""
    q, k, v = _attn_inputs(dt, d, seed=11)
    if kind == "nonfinite":
        q[50, 1] = float("nan")
        k[20, 0, 3] = float("inf")
        v[45, 1, 2] = float("-inf")
        q[5:9, :, :4] = -0.0
        k[30:34, :, 1:5] = -0.0
        v[:, 1] = -0.0
    elif kind in ("huge", "overflow"):
        k[24:40] = (k[24:40].float() * 2.0 ** (100 if kind == "huge" else 124)).to(dt)
    return q, k, v


def _paths(fn, **new_path):
    """fn() on the interior-block path (the default, or with fast_attention's ``new_path`` constants) and on the
    general block step for every block (FAST_BLOCK_PATH False)."""
    from hal.kernels.triton import fast_attention

    def under(constants):
        saved = {k: getattr(fast_attention, k) for k in constants}
        for k, v in constants.items():
            setattr(fast_attention, k, v)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                setattr(fast_attention, k, v)
    return under(new_path), under(dict(FAST_BLOCK_PATH=False))


def _interior_pairs(q, k, v, spec, full):
    """(name, old, new) raw-bit pairs of prefill, chunked prefill (num_splits 1 / 4 / 8), a paged chunk and decode
    rows (num_splits 1 / 4 / 8), causal, windowed causal and non-causal prefill; full: also prefill with a block loop
    per split (FLAT_SPLITS False)."""
    calls = [("prefill", lambda: _prefill(q, k, v, spec)),
             ("chunk-30-splits4", lambda: _from_cache(q[30:], k, v, L_SEQ, spec, num_splits=4)),
             ("decode-69-splits8", lambda: _from_cache(q[69:], k, v, L_SEQ, spec, num_splits=8))]
    if full:
        cu = torch.tensor([0, L_SEQ], dtype=torch.int32)
        calls += [("chunk-30-splits1", lambda: _from_cache(q[30:], k, v, L_SEQ, spec, num_splits=1)),
                  ("chunk-30-splits8", lambda: _from_cache(q[30:], k, v, L_SEQ, spec, num_splits=8)),
                  ("paged-7-chunk-20-splits4", lambda: _from_cache(q[20:], k, v, L_SEQ, spec, num_splits=4, page=7)),
                  ("decode-50-splits1", lambda: _from_cache(q[50:51], k, v, 51, spec, num_splits=1)),
                  ("decode-50-splits4-paged-7", lambda: _from_cache(q[50:51], k, v, 51, spec, num_splits=4, page=7)),
                  ("window-20-5", lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, L_SEQ, L_SEQ, causal=False,
                                                                      window_size=(20, 5), return_lse=True, spec=spec,
                                                                      backend="triton")),
                  ("causal-window-33", lambda: hal.flash_attn_varlen_func(q, k, v, cu, cu, L_SEQ, L_SEQ, causal=True,
                                                                           window_size=(33, -1), return_lse=True,
                                                                           spec=spec, backend="triton"))]
    pairs = []
    for name, fn in calls:
        (o, l), (o0, l0) = _paths(fn)
        pairs += [(f"{name}:out", o0, o), (f"{name}:lse", l0, l)]
    if full:  # the interior path with a block loop per split (FLAT_SPLITS False) too
        for name, fn in calls[:1]:
            (o, l), (o0, l0) = _paths(fn, FLAT_SPLITS=False)
            pairs += [(f"{name}-per-split:out", o0, o), (f"{name}-per-split:lse", l0, l)]
    return pairs


def attn_interior_path():
    """Interior key blocks as plain flash steps (after the key-bound pre-pass), heaviest tiles first, one pass over a
    tile's splits, the merge on the rows that exist == the general block step everywhere, a block loop per split
    (fast_attention.FAST_BLOCK_PATH False), raw bits of out and
    lse, on NaN / +-inf / -0.0 (interior blocks still run away from them), finite, huge-score and overflowing inputs
    (CI: the first, three calls)."""
    full = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")
    for spec, dt, d in _pick(ATTN_CASES):
        for kind in ("nonfinite", "finite", "huge", "overflow")[:None if full else 1]:
            q, k, v = _interior_inputs(dt, d, kind)
            _same(f"attn-interior-path[{spec.id},{dt},{kind}]", _interior_pairs(q, k, v, spec, full))


def attn_interior_negative():
    """Negative controls of attn_interior_path, each caught: interior blocks without the scale; diagonal blocks
    classified interior (the causal bound from the tile's last row, not its first); the key bound ignored (a -inf V
    element reaches an interior block's dot instead of making the row NaN); the one-pass block loop closing each
    split a block late (its first block merged with the previous split)."""
    from hal.kernels.triton import fast_attention
    variants = [("no-scale", "_interior_blocks", "s = tl.dot(q, tl.trans(k)) * scale", "s = tl.dot(q, tl.trans(k))"),
                ("diagonal-as-interior", "_interior_run", "i_hi = tl.minimum(i_hi, p_min + 1)",
                 "i_hi = tl.minimum(i_hi, p_max + 1)"),
                ("bound-ignored", "_interior_run", "run = (f_lo < f_hi) & (q_bound * k_bound < SCORE_BOUND)",
                 "run = f_lo < f_hi"),
                ("split-closed-a-block-late", "_interior_blocks", "if kb0 % KS == 0:", "if kb0 % KS == KB:")]
    for spec, dt, d in _pick(ATTN_CASES):
        q, k, v = _interior_inputs(dt, d, "nonfinite")
        out, lse = _paths(lambda: _prefill(q, k, v, spec))[1]
        for name, fn_name, old, new in variants:
            with kernel_variant(fast_attention, fn_name, old, new):
                o, l = _prefill(q, k, v, spec)
            _differs(f"attn-interior-negative[{spec.id},{dt},{name}]", [("out", out, o), ("lse", lse, l)])


CHECKS = {f.__name__: f for f in (mm_batch_invariance, mm_tiles_from_batch_negative, mm_split_k_negative,
                                  mm_nonfinite, mm_v3_table_same_bits, attn_split_invariance, attn_batch_invariance,
                                  attn_reverse_merge_negative, attn_wrong_head_negative, attn_decode_tile,
                                  attn_block_from_length_negative, attn_interior_path, attn_interior_negative)}

if __name__ == "__main__":
    skip_without_interpreter()
    main(CHECKS)
