"""Triton sequence kernels (attention, gated delta rule, GDN layer) == the reference, bit for bit.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_triton_attention.py and
tests/test_triton_gdn.py (Triton decides interpreter or compiler when a kernel module is imported).
Usage: python tests/scripts/triton_seq_check.py [--ascend] CHECK...; prints "CHECK: ok ..." / "CHECK: FAIL ..." lines.
CI runs the first case of each check; LOCKSTEP_FULL=1 runs every dtype / mode.
--ascend: the same checks on the kernels' Ascend variant (persistent grid on the interpreter's 3 fake
cores, NPU substitutes; with LOCKSTEP_ASCEND_NPU_LAYOUT=1 also its unified-buffer block sizes), run by
tests/test_ascend.py; ``persistent-negative`` is its negative control (the last work item dropped).
Shapes are small but cross every block, split, dot tile and chunk boundary of the specs used.
"""
from __future__ import annotations

import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal, not an installed one
import torch  # noqa: E402

from hal import dispatch  # noqa: E402
from hal.conformance.bits import first_divergence  # noqa: E402
from hal.kernels.reference import attention as ref_attn  # noqa: E402
from hal.kernels.reference import gated_delta_rule as ref_gdn  # noqa: E402
from hal.kernels.reference import gdn_layer as ref_layer  # noqa: E402
from hal.kernels.reference.strict_math import canonical_nan  # noqa: E402
from hal.kernels.triton import ascend_launch  # noqa: E402
from hal.kernels.triton import attention as tri_attn  # noqa: E402
from hal.kernels.triton import attention_kernel as tri_kernel  # noqa: E402
from hal.kernels.triton import gated_delta_rule as tri_gdn, gdn_layer as tri_layer  # noqa: E402
from _check_cli import FAILED, main, skip_without_interpreter  # noqa: E402
from _swapped_chain import swapped_neighbours  # noqa: E402
from _variants import dropped_last_work_item, kernel_variant, two_rounding_dot  # noqa: E402
from hal.spec import AttentionSpec, GatedDeltaRuleSpec  # noqa: E402

#: LOCKSTEP_FULL=1: every case of each check (all dtypes / modes); default: the first case of each,
#: which still crosses every block, split, dot-tile and chunk boundary (the CI set).
FULL = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")


def _pick(cases):
    return cases if FULL else cases[:1]


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=g) * scale


def _same(label, pairs):
    """Every (name, expected, got) pair has identical raw bits."""
    bad = [d for d in (first_divergence(f"{label}:{n}", e, g) for n, e, g in pairs) if d is not None]
    if bad:
        FAILED.append(label)
        print(f"{label}: FAIL {bad[0]}", flush=True)
    else:
        print(f"{label}: ok ({len(pairs)} outputs identical)", flush=True)


def _differs(label, pairs):
    """Negative control: at least one pair must differ (the check catches the wrong variant)."""
    if any(first_divergence(n, e, g) is not None for n, e, g in pairs):
        print(f"{label}: ok (wrong variant caught)", flush=True)
    else:
        FAILED.append(label)
        print(f"{label}: FAIL (wrong variant NOT caught)", flush=True)


@contextlib.contextmanager
def dispatch_log():
    """Every dispatch decision made inside: (op, spec id, backend name) -- what actually ran."""
    log, real = [], dispatch.select

    def select(op, spec, dtype, device, backend=None):
        chosen = real(op, spec, dtype, device, backend)
        log.append((op, spec.id, chosen.name))
        return chosen
    dispatch.select = select
    try:
        yield log
    finally:
        dispatch.select = real


# ------------------------------------------------------------------ attention

ATTN_SMALL = AttentionSpec(kv_block=8, kv_split=16, dot_tile=4)
ATTN_CASES = [  # spec, dtype, causal, window, Hq, Hkv, D (10: a short last dot tile)
    (ATTN_SMALL, torch.float32, True, (-1, -1), 2, 1, 10),
    (AttentionSpec(kv_block=8, kv_split=16, dot_tile=4, p_precision="input"), torch.bfloat16, True, (11, -1), 2, 2, 8),
    (ATTN_SMALL, torch.float16, False, (9, 5), 2, 1, 8),
]


def _varlen_inputs(rnd, dt, hq, hkv, d, lens_q=(19, 3, 0, 9), lens_k=(37, 3, 2, 20)):
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = rnd(int(cq[-1]) + 2, hq, d).to(dt)  # two padding rows past cu_q[-1]
    k, v = rnd(int(ck[-1]), hkv, d).to(dt), rnd(int(ck[-1]), hkv, d).to(dt)
    return q, k, v, cq, ck


def attn_varlen():
    for i, (spec, dt, causal, window, hq, hkv, d) in enumerate(_pick(ATTN_CASES)):
        q, k, v, cq, ck = _varlen_inputs(_gen(i), dt, hq, hkv, d)
        args = (q, k, v, cq, ck, 19, 37, 0.3, causal, window, spec)
        o1, l1 = ref_attn.flash_attn_varlen_func(*args)
        o2, l2 = tri_attn.flash_attn_varlen_func(*args)
        _same(f"attn-varlen[{spec.id},{dt},causal={causal},window={window}]", [("out", o1, o2), ("lse", l1, l2)])
        # the kernels trust the caller's max_q / max_k bounds (no host sync): larger ones give the same bits
        o3, l3 = tri_attn.flash_attn_varlen_func(q, k, v, cq, ck, 40, 300, *args[7:])
        _same(f"attn-varlen-loose-max[{spec.id},{dt}]", [("out", o1, o3), ("lse", l1, l3)])


def _paged_inputs(rnd, dt, hkv, d, page=7, bsz=3, sq=2):
    seqlens = torch.tensor([40, 2, 23])
    n_pages = bsz * 6 + 3
    kc, vc = rnd(n_pages, page, hkv, d).to(dt), rnd(n_pages, page, hkv, d).to(dt)
    table = torch.randperm(n_pages, generator=torch.Generator().manual_seed(5))[: bsz * 6].reshape(bsz, 6)
    return kc, vc, seqlens, table.to(torch.int32), sq


def attn_kvcache():
    for i, (spec, dt, causal, window, hq, hkv, d) in enumerate(_pick(ATTN_CASES[:2])):
        rnd = _gen(10 + i)
        kc, vc, seqlens, table, sq = _paged_inputs(rnd, dt, hkv, d)
        q = rnd(3, sq, hq, d).to(dt)
        o1, l1 = ref_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, causal, window, 0, spec)
        for ns in (0, 3):
            o2, l2 = tri_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, causal, window, ns, spec)
            _same(f"attn-paged[{dt},page=7,num_splits={ns}]", [("out", o1, o2), ("lse", l1, l2)])
        kc2, vc2 = rnd(3, 45, hkv, d).to(dt), rnd(3, 45, hkv, d).to(dt)
        q1 = q[:, -1:].contiguous()  # decode: one query row
        o1, l1 = ref_attn.flash_attn_with_kvcache(q1, kc2, vc2, seqlens, None, 0.25, causal, window, 0, spec)
        o2, l2 = tri_attn.flash_attn_with_kvcache(q1, kc2, vc2, seqlens, None, 0.25, causal, window, 2, spec)
        _same(f"attn-contiguous-decode[{dt},num_splits=2]", [("out", o1, o2), ("lse", l1, l2)])


def attn_negative():
    """Split partials merged in reverse order: the same comparison must catch it."""
    spec, dt, causal, window, hq, hkv, d = ATTN_CASES[0]
    rnd = _gen(20)
    kc, vc, seqlens, table, sq = _paged_inputs(rnd, dt, hkv, d)
    q = rnd(3, 1, hq, d).to(dt)
    o1, l1 = ref_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, causal, window, 0, spec)
    with kernel_variant(tri_kernel, "_merge_kernel", "w = _ws_offsets(b * HQ + h, i, sp, n_ws_rows, n_ws_splits)",
                        "w = _ws_offsets(b * HQ + h, i, n_own - 1 - sp, n_ws_rows, n_ws_splits)"):
        o2, l2 = tri_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, causal, window, 3, spec)
    _differs("attn-negative-control[reverse split merge]", [("out", o1, o2), ("lse", l1, l2)])


VECTOR_CASES = [  # spec, dtype, Hq, Hkv, D: head dims that are not multiples of VEC (8 bf16/fp16, 4 fp32) or DT
    (ATTN_SMALL, torch.bfloat16, 2, 1, 10),  # DT 4 < VEC 8: each vector feeds half a tile; the last runs past D
    (AttentionSpec(kv_block=8, kv_split=16, dot_tile=5), torch.float32, 4, 2, 13),  # DT 5: vectors straddle tiles
    (AttentionSpec(kv_block=8, kv_split=16, dot_tile=16, p_precision="input"), torch.float16, 2, 2, 20),  # 2 per tile
]


@contextlib.contextmanager
def _vector_scores(max_rows=64):
    """Every attention tile (prefill ones too) runs the GPU's vector score chains; yields the VECs launched."""
    vecs, real, real_rows = [], tri_attn._score_layout, tri_attn.VECTOR_MAX_ROWS

    def recorded(*args):
        vec, options = real(*args)
        vecs.append(vec)
        return vec, options
    tri_attn._score_layout, tri_attn.VECTOR_MAX_ROWS = recorded, max_rows
    try:
        yield vecs
    finally:
        tri_attn._score_layout, tri_attn.VECTOR_MAX_ROWS = real, real_rows


def _vector_pairs(spec, dt, hq, hkv, d, seed):
    """(name, reference, triton) pairs of varlen prefill (causal, sliding window) and paged decode / prefill
    (num_splits 0 and 3) with the vector score chains."""
    rnd = _gen(seed)
    q, k, v, cq, ck = _varlen_inputs(rnd, dt, hq, hkv, d)
    args = (q, k, v, cq, ck, 19, 37, 0.3, True, (11, -1), spec)
    o1, l1 = ref_attn.flash_attn_varlen_func(*args)
    o2, l2 = tri_attn.flash_attn_varlen_func(*args)
    pairs = [("varlen out", o1, o2), ("varlen lse", l1, l2)]
    kc, vc, seqlens, table, sq = _paged_inputs(rnd, dt, hkv, d)
    q = rnd(3, sq, hq, d).to(dt)
    for qq in (q, q[:, -1:].contiguous()):
        o1, l1 = ref_attn.flash_attn_with_kvcache(qq, kc, vc, seqlens, table, 0.25, True, (-1, -1), 0, spec)
        for ns in (0, 3):
            o2, l2 = tri_attn.flash_attn_with_kvcache(qq, kc, vc, seqlens, table, 0.25, True, (-1, -1), ns, spec)
            pairs += [(f"paged sq={qq.shape[1]} splits={ns} out", o1, o2), ("paged lse", l1, l2)]
    return pairs


def attn_vector():
    """The vector score chains (16-byte loads of head dims through common.eight / four) on every tile: head dims
    that are not multiples of VEC or of the dot tile, dot tiles smaller than, equal to and larger than VEC."""
    for i, (spec, dt, hq, hkv, d) in enumerate(VECTOR_CASES):
        with _vector_scores() as vecs:
            pairs = _vector_pairs(spec, dt, hq, hkv, d, 70 + i)
        want = 16 // dt.itemsize
        if set(vecs) != {want}:
            FAILED.append("attn-vector")
            print(f"attn-vector: FAIL launched VEC {sorted(set(vecs))}, want {want}", flush=True)
        _same(f"attn-vector[{spec.id},{dt},D={d},VEC={want}]", pairs)


def attn_vector_broadcast_q():
    """The vector score chains with q loaded as a broadcast [rows, keys, VEC] tile (attention.Q_BROADCAST_LOAD, the
    earlier kernel; the default loads each row's vector once): the same bits, and the launch took that path."""
    real = tri_attn.Q_BROADCAST_LOAD
    tri_attn.Q_BROADCAST_LOAD = True
    try:
        for i, (spec, dt, hq, hkv, d) in enumerate(VECTOR_CASES):
            qbs, launch = [], tri_attn.launch

            def recorded(kernel, *a, **kw):
                if "QB" in kw:
                    qbs.append(kw["QB"])
                return launch(kernel, *a, **kw)
            tri_attn.launch = recorded
            try:
                with _vector_scores():
                    pairs = _vector_pairs(spec, dt, hq, hkv, d, 70 + i)
            finally:
                tri_attn.launch = launch
            if not qbs or not all(qbs):
                FAILED.append("attn-vector-broadcast-q")
                print(f"attn-vector-broadcast-q: FAIL launched QB {qbs}", flush=True)
            _same(f"attn-vector-broadcast-q[{spec.id},{dt},D={d}]", pairs)
    finally:
        tri_attn.Q_BROADCAST_LOAD = real


def attn_vector_negative():
    """common.eight / four giving two neighbours swapped (the score chain adds head dim d+1 before d): the
    vector checks must catch it, for VEC 4 (fp32) and VEC 8 (fp16, whose dot tile of 16 runs all 8 steps)."""
    with swapped_neighbours():
        for i, (spec, dt, hq, hkv, d) in list(enumerate(VECTOR_CASES))[1:]:
            with _vector_scores():
                pairs = _vector_pairs(spec, dt, hq, hkv, d, 70 + i)
            _differs(f"attn-vector-negative-control[swapped neighbours,{dt}]", pairs)


GQA_SHAPES = ((2, 2), (4, 2), (8, 2), (3, 1))  # (Hq, Hkv): groups 1, 2, 4 and MQA with a group of 3 (padded tile)


def _packed(max_q, hq, hkv, d, spec):
    """The decode layout packs the whole GQA group into one program (else the check would miss the path)."""
    bm, rows, pack = tri_attn._tiles(max_q, hq // hkv, triton_next_pow2(d), spec.kv_block)
    assert pack == hq // hkv and rows * pack <= bm, (max_q, hq, hkv, bm, rows, pack)


def triton_next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def attn_gqa_packed():
    """Decode-sized query tiles with a GQA group packed into the tile rows: varlen decode (an empty cache, a
    cache shorter than a split, a 3-row verify step) and paged decode with num_splits 0 / 1 / 3."""
    spec, d = ATTN_SMALL, 6  # d 6: a full and a short dot tile
    dts = (torch.float32, torch.bfloat16) if FULL else (torch.float32,)
    for n, (hq, hkv) in enumerate(GQA_SHAPES):
        for dt in dts:
            rnd = _gen(30 + n)
            verify = FULL or hq // hkv == 4  # the 3-row verify step: group 4 in CI (interpreter time)
            for lens_q, max_q in (((1, 1, 1, 0), 1), ((1, 3, 0, 2), 3))[:2 if verify else 1]:
                _packed(max_q, hq, hkv, d, spec)
                q, k, v, cq, ck = _varlen_inputs(rnd, dt, hq, hkv, d, lens_q=lens_q, lens_k=(0, 5, 3, 20))
                args = (q, k, v, cq, ck, max_q, 20, 0.3, True, (-1, -1), spec)
                o1, l1 = ref_attn.flash_attn_varlen_func(*args)
                o2, l2 = tri_attn.flash_attn_varlen_func(*args)
                _same(f"attn-gqa-varlen[Hq={hq},Hkv={hkv},{dt},max_q={max_q}]", [("out", o1, o2), ("lse", l1, l2)])
            kc, vc, _, table, _ = _paged_inputs(rnd, dt, hkv, d)
            seqlens = torch.tensor([33, 0, 5])  # long, empty, shorter than a split
            q = rnd(3, 1, hq, d).to(dt)
            _packed(1, hq, hkv, d, spec)
            o1, l1 = ref_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, True, (-1, -1), 0, spec)
            for ns in (0, 1, 3) if FULL else (1, 3):  # 0 is the split-KV path of 3 here
                o2, l2 = tri_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, True, (-1, -1), ns, spec)
                _same(f"attn-gqa-paged[Hq={hq},Hkv={hkv},{dt},num_splits={ns}]", [("out", o1, o2), ("lse", l1, l2)])


def attn_gqa_negative():
    """Packed rows that read the q of the wrong head of their group: the same comparison must catch it."""
    spec, d, hq, hkv, dt = ATTN_SMALL, 6, 8, 2, torch.float32
    rnd = _gen(40)
    kc, vc, _, table, _ = _paged_inputs(rnd, dt, hkv, d)
    seqlens = torch.tensor([33, 0, 5])
    q = rnd(3, 1, hq, d).to(dt)
    o1, l1 = ref_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, True, (-1, -1), 0, spec)
    # packed rows read the q of the next head of their group (out and lse still go to their own head)
    with kernel_variant(tri_kernel, "_attn_kernel", "qr_off = q_off  # where rows read q (out and lse go to q_off)",
                        "qr_off = _q_offsets(Q_ROW0, b, i, g * PACK + (h + 1) % PACK, stride_qt, stride_qh)"):
        for ns in (1, 3):  # the in-kernel merge and the split-KV workspace + merge kernel
            o2, l2 = tri_attn.flash_attn_with_kvcache(q, kc, vc, seqlens, table, 0.25, True, (-1, -1), ns, spec)
            _differs(f"attn-gqa-negative-control[wrong head in group,num_splits={ns}]",
                     [("out", o1, o2), ("lse", l1, l2)])


# ------------------------------------------------------------------ gated delta rule


GDN_CASES = [  # dtype, H, HV, dk, dv, l2
    (torch.float32, 1, 2, 12, 10, True),
    (torch.bfloat16, 2, 2, 12, 8, False),
]


def _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, lens):
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T = cu[-1]
    q = rnd(1, T, h, dk).to(dt)
    k = rnd(1, T, h, dk, scale=1.0 if l2 else 0.3 / dk ** 0.5).to(dt)
    v = rnd(1, T, hv, dv).to(dt)
    g = -(rnd(1, T, hv).abs() ** 2)
    beta = torch.sigmoid(rnd(1, T, hv)).to(dt)
    return (q, k, v, g, beta), cu


def _parts_pairs(p1, p2):
    out = []
    for name in p1._fields:
        a, b = getattr(p1, name), getattr(p2, name)
        if a is None and b is None:
            continue
        if (a is None) != (b is None):
            return [(name, torch.zeros(1), torch.ones(1))]
        out.append((name, a, b))
    return out


def _gdn_two_calls(variant, chunk, label_extra=""):
    """Call 1 from a random initial state; call 2 continues from call 1's state (open rows crossing a
    chunk boundary, a 1-token decode, an empty sequence)."""
    for i, (dt, h, hv, dk, dv, l2) in enumerate(_pick(GDN_CASES)):
        spec = GatedDeltaRuleSpec(variant=variant, chunk=chunk, dk_tile=8)
        rnd = _gen(30 + i)
        x1, cu1 = _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, (21, 3, 9))
        x2, cu2 = _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, (3, 1, 25))
        S0 = rnd(3, hv, dk, dv, scale=0.1)
        parts = ref_gdn.Parts(torch.zeros(3, dtype=torch.int64), S0, None, None, None, None, None)
        o1, p1 = ref_gdn.gated_delta_rule(*x1, 0.3, parts, cu1, l2, spec, True)
        o2, p2 = tri_gdn.gated_delta_rule(*x1, 0.3, parts, cu1, l2, spec, True)
        _same(f"gdn-{variant}-call1[{dt},l2={l2}]{label_extra}", [("o", o1, o2), *_parts_pairs(p1, p2)])
        o1b, p1b = ref_gdn.gated_delta_rule(*x2, 0.3, p1, cu2, l2, spec, True)
        o2b, p2b = tri_gdn.gated_delta_rule(*x2, 0.3, p1, cu2, l2, spec, True)
        _same(f"gdn-{variant}-call2-continues[{dt},l2={l2}]{label_extra}", [("o", o1b, o2b), *_parts_pairs(p1b, p2b)])


def gdn_serial():
    _gdn_two_calls("serial", 64)


def gdn_chunked():
    _gdn_two_calls("chunked", 16, "(C=16)")


def gdn_chunked_decode():
    """C = 64: prefills and one-token decode steps that end inside a chunk run the kernel on row tiles
    smaller than C (16, 32; ``_row_tile``), one call crosses a boundary (tile C). Each call continues the
    last and every part of the state is compared. Control: a recurrent (serial-spec) step for the decode
    call differs from the chunked spec's bits, so the chunked decode must recompute the open chunk. Sequence 0's
    initial state holds a NaN that is not the canonical one (the state copy and the stored states canonicalise)."""
    dt, h, hv, dk, _, l2 = GDN_CASES[0]
    dv = 40  # full chunks: three 16-column blocks, the last partial (_full_chunk_tiles)
    spec = GatedDeltaRuleSpec(variant="chunked", chunk=64, dk_tile=8)
    rnd = _gen(50)
    S0 = rnd(3, hv, dk, dv, scale=0.1)
    S0[0, 1, 2, 3] = torch.tensor(-0x3FFEDD, dtype=torch.int32).view(torch.float32)  # NaN 0xFFC00123, not canonical
    parts = ref_gdn.Parts(torch.zeros(3, dtype=torch.int64), S0, None, None, None, None, None)
    tiles = []
    for step, lens in enumerate([(5, 1, 3), (1, 1, 1), (1, 20, 60), (1, 1, 1)]):
        x, cu = _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, lens)
        start = parts.position if parts.open_k is not None else torch.zeros_like(parts.position)
        tiles.append(tri_gdn._row_tile(64, int((start % 64).max()) + max(lens)))
        o1, p1 = ref_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, spec, True)
        o2, p2 = tri_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, spec, True)
        # the reference keeps NaN payloads; the triton entry point returns the canonical NaN everywhere (the
        # strict policy's last step, done at dispatch for the reference), which sequence 0's NaN checks
        _same(f"gdn-chunked-decode-call{step + 1}[lens={lens},row tile={tiles[-1]}]",
              [(n, canonical_nan(e), g) for n, e, g in [("o", o1, o2), *_parts_pairs(p1, p2)]])
        if step == 1:
            serial = GatedDeltaRuleSpec(variant="serial", dk_tile=8)
            recurrent = ref_gdn.Parts(parts.position, parts.final, None, None, None, None, None)
            o3, _ = tri_gdn.gated_delta_rule(*x, 0.3, recurrent, cu, l2, serial, True)
            _differs("gdn-chunked-decode-control[a recurrent step is not the chunked spec's decode]", [("o", o1, o3)])
        parts = p1
    assert tiles == [16, 16, 64, 32], tiles  # the row-tile sizes this check means to cross


@contextlib.contextmanager
def _gdn_products(fma_dot: bool, two_roundings: bool = False):
    """The chunked kernel's products as FMA dots or explicit chains (gated_delta_rule.FMA_DOT_PRODUCTS); with
    two_roundings, the interpreter's strict dot replaced by the fast kernels' stand-in (product rounded, then added)."""
    saved = tri_gdn.FMA_DOT_PRODUCTS
    tri_gdn.FMA_DOT_PRODUCTS = fma_dot
    try:
        with two_rounding_dot() if two_roundings else contextlib.nullcontext():
            yield
    finally:
        tri_gdn.FMA_DOT_PRODUCTS = saved


@contextlib.contextmanager
def _gdn_dot_k(full_dot_k: int, seen: list):
    """gated_delta_rule.FULL_DOT_K set to full_dot_k; each launch's (DTP, DOT_K) appended to seen."""
    saved, dot_k = tri_gdn.FULL_DOT_K, tri_gdn._dot_k

    def recorded(rt, C, dtp):
        seen.append((dtp, dot_k(rt, C, dtp)))
        return seen[-1][1]
    tri_gdn.FULL_DOT_K, tri_gdn._dot_k = full_dot_k, recorded
    try:
        yield
    finally:
        tri_gdn.FULL_DOT_K, tri_gdn._dot_k = saved, dot_k


def gdn_fma_dot():
    """The chunked products as float32 ieee dot tiles (issue 41 item 1): d_k = 12 on dk_tile 8 (16 dot lanes: the
    first tile 8 padded lanes, the second 12), d_v = 10 (the dot's 16 columns, 6 masked), row tiles 16 (C = 16)
    and 64 (C = 64, full chunks), from a random initial state (S0 products); and d_k = 40 on dk_tile 24 at C = 64
    (32 dot lanes: tiles of 24 and 16 valid lanes), as one dot per tile (FULL_DOT_K 0) and as two dots of 16 lanes
    each continuing the last one's accumulator (FULL_DOT_K 16: the first tile's second dot half padded, the
    second tile's all padded). Both the dot tiles and the explicit chains (the switch off) give the reference's
    bits; controls: the fast kernels' two-rounding stand-in in place of the strict dot is caught (the dots did
    run), and with the switch off it changes nothing (the chains ran); the lanes per dot are the ones meant."""
    dt, h, hv, dk, dv, l2 = GDN_CASES[0]
    if not tri_gdn._fma_dot_products(16):
        FAILED.append("gdn-fma-dot")
        print("gdn-fma-dot: FAIL the chunked products do not run as FMA dots here", flush=True)
        return
    configs = ((16, (21, 3, 9), dk, 8, tri_gdn.FULL_DOT_K, (16, 16)), (64, (70, 1, 64), dk, 8, tri_gdn.FULL_DOT_K, (16, 16)),
               (64, (70, 1, 64), 40, 24, 0, (32, 32)), (64, (70, 1, 64), 40, 24, 16, (32, 16)))
    for i, (chunk, lens, d_k, tile, full_dot_k, lanes) in enumerate(configs):
        spec = GatedDeltaRuleSpec(variant="chunked", chunk=chunk, dk_tile=tile)
        rnd = _gen(70 + i)
        x, cu = _gdn_inputs(rnd, dt, h, hv, d_k, dv, l2, lens)
        parts = ref_gdn.Parts(torch.zeros(3, dtype=torch.int64), rnd(3, hv, d_k, dv, scale=0.1), None, None, None,
                              None, None)
        o1, p1 = ref_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, spec, True)
        want = [("o", o1), ("S", p1.S), ("final", p1.final)]
        name = f"C={chunk},dk={d_k},dk_tile={tile},FULL_DOT_K={full_dot_k},{dt}"
        for label, dot, two in (("dots", True, False), ("chains", False, False), ("chains-two-rounding-dot", False, True),
                                ("dots-two-rounding-control", True, True)):
            seen = []
            with _gdn_products(dot, two), _gdn_dot_k(full_dot_k, seen):
                o2, p2 = tri_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, spec, True)
            pairs = [(n, e, g) for (n, e), g in zip(want, (o2, p2.S, p2.final))]
            (_differs if label.endswith("control") else _same)(f"gdn-fma-dot-{label}[{name}]", pairs)
            if dot and set(seen) != {lanes}:
                FAILED.append(f"gdn-fma-dot-lanes[{name}]")
                print(f"gdn-fma-dot-lanes[{name}]: FAIL (DTP, DOT_K) {sorted(set(seen))}, want {lanes}", flush=True)


def gdn_negative():
    """A chunk grid restarting at the call start (open rows dropped): the continuation check catches it."""
    dt, h, hv, dk, dv, l2 = GDN_CASES[1]
    spec = GatedDeltaRuleSpec(variant="chunked", chunk=16, dk_tile=8)
    rnd = _gen(40)
    x1, cu1 = _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, (21, 5))
    x2, cu2 = _gdn_inputs(rnd, dt, h, hv, dk, dv, l2, (9, 3))
    parts = ref_gdn.Parts(torch.zeros(2, dtype=torch.int64), torch.zeros(2, hv, dk, dv), None, None, None, None, None)
    _, p1 = ref_gdn.gated_delta_rule(*x1, 0.3, parts, cu1, l2, spec, True)
    o1, f1 = ref_gdn.gated_delta_rule(*x2, 0.3, p1, cu2, l2, spec, True)
    # the chunk grid restarted at the call: the kernel is handed the state without its open chunk rows
    o2, f2 = tri_gdn.gated_delta_rule(*x2, 0.3, p1._replace(open_k=None), cu2, l2, spec, True)
    _differs("gdn-negative-control[chunk grid restarts at the call]", [("o", o1, o2), ("final", f1.final, f2.final)])


def gdn_layer():
    for i, dt in enumerate(_pick([torch.float32, torch.bfloat16, torch.float16])):
        rnd = _gen(50 + i)
        A_log, dtb = rnd(6), rnd(6)
        a, b = rnd(2, 30, 6, scale=4.0).to(dt), rnd(2, 30, 6, scale=4.0).to(dt)
        a[0, 0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0]).to(dt)
        g1, b1 = ref_layer.gdn_gating(A_log, a, dtb, b)
        g2, b2 = tri_layer.gdn_gating(A_log, a, dtb, b)
        _same(f"gdn-gating[{dt}]", [("g", g1, g2), ("beta", b1, b2)])
        x, w, bias = rnd(1, 40, 24).to(dt), rnd(24, 4).to(dt), rnd(24).to(dt)
        state = rnd(3, 3, 24).to(dt)
        for args in ((x, w, bias, state, "silu", [0, 17, 18, 40]), (x.reshape(2, 20, 24), w, None, None, None, None)):
            y1, s1 = ref_layer.causal_conv1d(*args)
            y2, s2 = tri_layer.causal_conv1d(*args)
            _same(f"gdn-conv1d[{dt},state={args[3] is not None}]", [("y", y1, y2), ("state", s1, s2)])


def persistent_negative():
    """Persistent launches that skip their last work item: the varlen and chunked checks must catch it."""
    spec, dt, causal, window, hq, hkv, d = ATTN_CASES[0]
    q, k, v, cq, ck = _varlen_inputs(_gen(60), dt, hq, hkv, d)
    args = (q, k, v, cq, ck, 19, 37, 0.3, causal, window, spec)
    o1, l1 = ref_attn.flash_attn_varlen_func(*args)
    dt, h, hv, dk, dv, l2 = GDN_CASES[0]
    gspec = GatedDeltaRuleSpec(variant="chunked", chunk=16, dk_tile=8)
    x, cu = _gdn_inputs(_gen(61), dt, h, hv, dk, dv, l2, (21, 3, 9))
    parts = ref_gdn.Parts(torch.zeros(3, dtype=torch.int64), torch.zeros(3, hv, dk, dv), None, None, None, None, None)
    g1, f1 = ref_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, gspec, True)
    with dropped_last_work_item():
        o2, l2_ = tri_attn.flash_attn_varlen_func(*args)
        g2, f2 = tri_gdn.gated_delta_rule(*x, 0.3, parts, cu, l2, gspec, True)
    _differs("persistent-negative-control[attention: last work item dropped]", [("out", o1, o2), ("lse", l1, l2_)])
    _differs("persistent-negative-control[gdn chunked: last work item dropped]", [("o", g1, g2),
                                                                                ("final", f1.final, f2.final)])


CHECKS = {f.__name__.replace("_", "-"): f for f in (attn_varlen, attn_kvcache, attn_negative, attn_gqa_packed,
                                                     attn_gqa_negative, attn_vector, attn_vector_broadcast_q,
                                                     attn_vector_negative, gdn_serial, gdn_chunked, gdn_chunked_decode,
                                                     gdn_fma_dot, gdn_negative, gdn_layer, persistent_negative)}

if __name__ == "__main__":
    skip_without_interpreter()
    ascend = "--ascend" in sys.argv[1:]
    main(CHECKS, [a for a in sys.argv[1:] if a != "--ascend"],
         each=(lambda: ascend_launch.variant("cpu")) if ascend else contextlib.nullcontext,
         tag=" (ascend variant)" if ascend else "")
