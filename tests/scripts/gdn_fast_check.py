"""The fast gated delta rule (FastGatedDeltaRuleSpec) in the Triton interpreter: negative controls of its L2 checks.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_gated_delta_rule_fast.py (Triton decides interpreter or
compiler when a kernel module is imported). Usage: python tests/scripts/gdn_fast_check.py CHECK...; prints
"CHECK: ok ..." / "CHECK: FAIL ..." lines.

gdn-fast-restart: the triton backend with the chunk grid restarted at every call (the open chunk dropped, the
call continued from the FLA state after the last token, a fresh grid at its first token) runs the
gated_delta_rule_fast suite's L2 checks on the quick case: the split checks must fail at cuts that are not a
multiple of the chunk, the same checks on the real backend pass (the quick conformance run shows every level).
gdn-fast-causal-mask: the kernel with P's entries past the diagonal kept (a later row read by an earlier one, only
when it is present) fails the same L2 checks.
gdn-fast-wide-head: d_k = 264 (past the kernel's one dot over the padded head dim) is refused by name.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _variants
import torch  # noqa: E402

from hal.backends.triton import TritonBackend  # noqa: E402
from hal.conformance import runner, suites  # noqa: E402
from hal.kernels.layout import Parts  # noqa: E402

FAILED = []


class RestartsGrid(TritonBackend):
    """A plausible bug: the state handed over between calls is the state after the last token, the next call's chunk
    grid starts at its first token (what a bare FLA tensor gives; transformers' chunk form does this)."""
    name = "triton-restarts-grid"

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final):
        if state.open_k is not None:
            S = state.final if state.final is not None else state.S
            state = Parts(state.position, S, None, None, None, None, S)
        return super().chunk_gated_delta_rule(q, k, v, g, beta, scale, state, cu_seqlens, l2, spec, want_final)

    def fused_recurrent_gated_delta_rule(self, *args):
        return self.chunk_gated_delta_rule(*args)


def _l2(backend, case):
    fam = suites.get("gated_delta_rule_fast")
    out = {"L2": runner._Outcome()}
    runner.run_case(fam, backend, case, torch.device("cpu"), ("L2",), out)
    return [d.label for _, d in out["L2"].failures]


def check_restart():
    fam = suites.get("gated_delta_rule_fast")
    case = next(c for c in fam.cases() if c.id == fam.quick[0])
    labels = _l2(RestartsGrid(), case)
    cuts = [lab for lab in labels if lab.startswith("split-sweep/split-at-")]
    label = "gdn-fast-restart[chunk grid restarted at each call]"
    if cuts:
        print(f"{label}: ok (wrong variant caught: {len(labels)} L2 failures, first {labels[0]})", flush=True)
    else:
        FAILED.append(label)
        print(f"{label}: FAIL (not caught: {labels})", flush=True)


def check_causal_mask():
    """A kernel whose P keeps the entries past the diagonal (f_ij = 1 there, so P_ij = QK_ij for j > i: a later
    row leaks into an earlier row's output, but only when that row is present): the split and decode checks catch
    it, since a cut removes the later rows."""
    from _variants import kernel_variant
    from hal.kernels.triton import fast_gated_delta_rule as fg
    fam = suites.get("gated_delta_rule_fast")
    case = next(c for c in fam.cases() if c.id == fam.quick[0])
    with kernel_variant(fg, "_fast_chunked_item", "tl.where(ri[:, None] == ri[None, :], QK, 0.0)",
                        "tl.where(ri[:, None] == ri[None, :], QK, F * QK)"):
        labels = _l2(TritonBackend(), case)
    label = "gdn-fast-causal-mask[P not zeroed past the diagonal]"
    if any(lab.startswith(("split-sweep/", "decode/")) for lab in labels):
        print(f"{label}: ok (wrong variant caught: {len(labels)} L2 failures, first {labels[0]})", flush=True)
    else:
        FAILED.append(label)
        print(f"{label}: FAIL (not caught: {labels})", flush=True)


def check_wide_head():
    """d_k past the kernel's one-dot tile is refused by name before any launch."""
    import hal
    q = torch.zeros(1, 2, 1, 264, dtype=torch.bfloat16)
    v = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    label = "gdn-fast-wide-head[d_k 264 refused]"
    try:
        hal.chunk_gated_delta_rule(q, q, v, torch.zeros(1, 2, 1), torch.zeros(1, 2, 1), spec=hal.spec.GDN_FAST,
                                   backend="triton")
    except hal.UnsupportedError as e:
        ok = "d_k = 264 > 256" in str(e)
    else:
        ok = False
    if ok:
        print(f"{label}: ok", flush=True)
    else:
        FAILED.append(label)
        print(f"{label}: FAIL (not refused by name)", flush=True)


CHECKS = {"gdn-fast-restart": check_restart, "gdn-fast-causal-mask": check_causal_mask,
          "gdn-fast-wide-head": check_wide_head}

if __name__ == "__main__":
    names = sys.argv[1:] or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        sys.exit(f"unknown checks {unknown}; known: {list(CHECKS)}")
    for name in names:
        CHECKS[name]()
    sys.exit(1 if FAILED else 0)
