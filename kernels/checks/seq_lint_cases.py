"""Lint cases of the attention / gated-delta-rule kernels for kernels/checks/lint.py.

``cases(KernelCase, full)`` returns them in lint.py's own ``KernelCase`` type (passed in, so this
module does not import the linter): lint.py's ``strict_kernels`` adds ``seq_lint_cases.cases(KernelCase,
full)``. Representative Qwen-like shapes. The CI set (``full=False``) holds the split-KV paged attention
kernel, the merge kernel and the small GDN kernels; ``full`` adds the chunked GDN kernel (~30 s to
compile per target) and every attention mode and dtype. ``backward_cases``: the attention backward kernels
(deterministic, not strict: lint.py's backward rules), bf16 in CI, fp32 / fp16 with ``full``, and the GDN
backward's state-scan kernels (float32, d_k = d_v = 128).
"""
from __future__ import annotations

import triton.language as tl


def _sig(fn, types: dict, default: str) -> dict:
    return {n: types.get(n, default) for n in fn.arg_names}


def cases(KernelCase, full: bool = False, npu: bool = False) -> list:
    from ..triton import attention as A, attention_kernel as AK, gated_delta_rule as G, gdn_layer as GL
    i32 = "i32"
    attn_types = {n: "*i32" for n in ("WN", "Q_ROW0", "QLEN", "KLEN", "K_ROW0", "BT", "LSE_ROW0")}
    attn_types.update({n: i32 for n in ("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh", "stride_lh",
                                        "bt_stride", "page", "causal", "left", "right", "n_ws_rows", "n_ws_splits",
                                        "n_work", "n1", "n2")})
    attn_types["scale"] = "fp32"
    # multiples of 16 in a typical launch (head dim 128: row, head and page strides), as the launcher specializes them
    attn_divisible = ("stride_qt", "stride_qh", "stride_kp", "stride_kt", "stride_kh")
    out = []
    dtypes = (("bf16", tl.bfloat16),) + ((("fp32", tl.float32), ("fp16", tl.float16)) if full else ())
    modes = ((True, True),) + (((False, False), (True, False), (False, True)) if full else ())
    for dt, tdt in dtypes:
        types = dict(attn_types, Q=f"*{dt}", K=f"*{dt}", V=f"*{dt}", O=f"*{dt}")
        for paged, one in modes:
            # split-KV: the decode layout (a GQA group of 4 heads packed, one query row); else a prefill tile
            tiles = dict(BLOCK_M=4, ROWS=1, PACK=4) if one else dict(BLOCK_M=16, ROWS=16, PACK=1)
            vec, options = A._score_layout(tiles["BLOCK_M"], 64, tdt.primitive_bitwidth // 8)  # as attend launches
            # prefill tiles on NVIDIA: fp32 ieee dots (A._fma_dot_tiles); decode tiles, AMD and Ascend: the chains
            dot = not one and not npu
            consts = dict(HQ=32, GROUP=4, D=128, **tiles, BLOCK_D=128, KB=64, KS=256, DT=64, VEC=vec, P_IN=not one,
                          OUT=tdt, PAGED=paged, ONE_SPLIT=one, NPU=npu, FMA_DOT=dot, DTP=64,
                          DK=A.dot_k(64, 64), QB=vec > 1 and A.Q_BROADCAST_LOAD)
            sig = {k: v for k, v in _sig(AK._attn_kernel, types, "*fp32").items() if k not in consts}
            out.append(KernelCase(f"attention[{dt},paged={paged},one_split={one}]", AK._attn_kernel, sig, consts,
                                  divisible=attn_divisible,
                                  num_warps=A.DOT_WARPS if dot else options.get("num_warps")))
            if dot and full and not paged:  # the AMD variant of the prefill tile: no tt.dot may remain
                out.append(KernelCase(f"attention[{dt},paged={paged},one_split={one},hip]", AK._attn_kernel, sig,
                                      dict(consts, FMA_DOT=False), divisible=attn_divisible))
        consts = dict(HQ=32, D=128, BLOCK_M=4, ROWS=1, PACK=4, BLOCK_D=128, KS=256, OUT=tdt, NPU=npu)
        sig = {k: v for k, v in _sig(AK._merge_kernel, types, "*fp32").items() if k not in consts}
        out.append(KernelCase(f"attention.merge[{dt}]", AK._merge_kernel, sig, consts,
                              divisible=("stride_qt", "stride_qh")))
    gdn = [
        ("gdn.serial", G._serial_kernel, {"LEN": "*i32", "lmax": i32}, dict(H=16, HV=32, DK=128, DV=128, BDV=64, DT=64)),
        # full chunks: 16 columns on 8 warps (gated_delta_rule._full_chunk_tiles)
        # the d_k products as fp32 ieee dots on NVIDIA (gated_delta_rule._fma_dot_products), FULL_DOT_K lanes per dot on
        # the full chunk's tile, one per d_k tile on the decode tile (_dot_k); AMD / Ascend: the chains
        ("gdn.chunked", G._chunked_kernel, {"OPENED": "*i32", "TOTAL": "*i32", "n_rows": i32, "lmax": i32},
         dict(H=16, HV=32, DK=128, DV=128, C=64, BDK=128, BDV=64 if npu else 16, DT=64, WANT_FINAL=True, RT=64,
              STAGES=1, FMA_DOT=not npu, DTP=64, DOT_K=G._dot_k(64, 64, 64))),
        # a decode step into the open chunk: rows on a 16-row tile (gated_delta_rule._row_tile)
        ("gdn.chunked.decode", G._chunked_kernel, {"OPENED": "*i32", "TOTAL": "*i32", "n_rows": i32, "lmax": i32},
         dict(H=16, HV=32, DK=128, DV=128, C=64, BDK=128, BDV=64, DT=64, WANT_FINAL=True, RT=16, STAGES=3,
              FMA_DOT=not npu, DTP=64, DOT_K=G._dot_k(16, 64, 64))),
        ("gdn.state_copy", G._state_copy_kernel, {"n": i32}, dict(BLOCK=1024)),
        ("gdn.prep", G._prep_kernel, {"X": "*bf16", "n_rows": i32, "scale": "fp32"},
         dict(L2=True, SCALE=True, DK=128, BT=16, BDK=128, DT=64)),
        ("gdn.gating", GL._gating_kernel, {"A": "*bf16", "B": "*bf16", "n": i32}, dict(HV=32, BLOCK=256)),
        ("gdn.conv1d", GL._conv_kernel, {"ROWS": "*bf16", "W": "*bf16", "BIAS": "*bf16", "Y": "*bf16", "lmax": i32,
                                        "n_rows": i32},
         dict(D=1024, KW=4, HAS_BIAS=True, SILU=True, OUT=tl.bfloat16, BT=16, BD=128)),
    ]
    grid = {"n_work": i32, "n1": i32, "n2": i32}  # the persistent loop's counts (launch.persistent_args)
    for name, fn, types, consts in gdn:
        if name == "gdn.chunked" and not full:
            continue
        consts = dict(consts, NPU=npu)
        sig = {k: v for k, v in _sig(fn, dict(types, **grid), "*fp32").items() if k not in consts}
        warps = 8 if name == "gdn.chunked" and not npu else None
        out.append(KernelCase(name, fn, sig, consts, num_warps=warps))
        if full and consts.get("FMA_DOT"):  # the AMD variant (explicit chains): no tt.dot may remain
            out.append(KernelCase(f"{name}[hip]", fn, sig, dict(consts, FMA_DOT=False), num_warps=warps))
    return out


def _tiles(cfg: dict) -> dict:
    """The constexprs of a launch config (num_warps / num_stages are launch options, not kernel arguments)."""
    return {k: v for k, v in cfg.items() if k.startswith("BLOCK")}


def backward_cases(KernelCase, full: bool = False) -> list:
    """The attention backward kernels (kernels/triton/attention_backward.py) at D 128 with their GPU tiles."""
    from ..triton import attention_backward as B
    ints = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_t", "stride_h", "n_rows", "causal",
            "left", "right", "n_blk")
    types = {n: "*i32" for n in ("Q_ROW0", "QLEN", "KLEN", "K_ROW0")}
    types.update({n: "i32" for n in ints}, scale="fp32", LSE="*fp32", DELTA="*fp32", DLSE="*fp32")
    out = []
    dtypes = (("bf16", B.torch.bfloat16),) + ((("fp32", B.F32), ("fp16", B.torch.float16)) if full else ())
    for dt, torch_dt in dtypes:
        types.update({n: f"*{dt}" for n in ("Q", "K", "V", "DO", "O", "DK", "DV", "DQ")})
        cfg = B._config(128, torch_dt)
        meta = dict(GROUP=4, D=128, BLOCK_D=cfg["BLOCK_D"], IEEE=dt == "fp32")
        for name, fn, consts in (("attention_bwd.preprocess", B._preprocess_kernel,
                                  dict(HAS_DLSE=True, D=128, BLOCK_R=16, BLOCK_D=cfg["BLOCK_D"])),
                                 ("attention_bwd.dkdv", B._dkdv_kernel, dict(meta, **_tiles(cfg["kv"]))),
                                 ("attention_bwd.dq", B._dq_kernel, dict(meta, **_tiles(cfg["q"])))):
            sig = {k: v for k, v in _sig(fn, types, "*fp32").items() if k not in consts}
            out.append(KernelCase(f"{name}[{dt}]", fn, sig, consts, strict=False))
    from ..triton import gdn_backward as G
    tiles = dict(DK=128, DV=128, C=64, **{k: v for k, v in G._config(128, 128).items() if k.startswith("B")})
    for name, fn, consts in (("gdn_bwd.scan_fwd", G._scan_fwd_kernel, tiles),
                             ("gdn_bwd.scan_bwd", G._scan_bwd_kernel, dict(tiles, HAS_DSTARTS=True))):
        sig = {k: v for k, v in _sig(fn, {"nc": "i32", "n_ch": "i32"}, "*fp32").items() if k not in consts}
        out.append(KernelCase(name, fn, sig, consts, strict=False))
    return out
