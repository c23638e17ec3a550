"""token_logprobs under a fast matmul spec (TokenLogprobsSpec(matmul=FastMatmulSpec)) in the Triton interpreter.

Run in a subprocess with TRITON_INTERPRET=1 by tests/test_token_logprobs_fast.py. In the interpreter ``tl.dot`` is the
deterministic stand-in of kernels/triton/interpreter_dot.py (per output element: a chain per K tile), so the checks
test what the kernels decide: that the logits are the fast matmul kernel's float32 accumulator under the spec's launch
and the log-softmax is the strict one; that a launch chosen from the batch is caught; that the policy switch runs
it. (The v2 default's stand-in chain, K tiles of 64, is the strict k64 chain's arithmetic: in the interpreter the
fast and strict specs agree at hidden_tile 64, so the negative controls use another launch, never strict.)
Usage: python tests/scripts/token_logprobs_fast_check.py [CHECK...]; prints "CHECK: ok ..." / "CHECK: FAIL ..."
lines. LOCKSTEP_FULL=1 runs every spec x dtype.
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
from hal.spec import POLICY_SPECS, FastMatmulSpec, FastMatmulV3Spec, TokenLogprobsSpec  # noqa: E402
from _check_cli import main, skip_without_interpreter  # noqa: E402
from triton_seq_check import FAILED, _differs, _gen, _pick, _same, dispatch_log  # noqa: E402

FAST = POLICY_SPECS["fast"]["token_logprobs"]
SMALL = TokenLogprobsSpec(matmul=FastMatmulSpec(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2))
CASES = [(FAST, torch.bfloat16), (SMALL, torch.float16), (TokenLogprobsSpec(matmul=FastMatmulV3Spec()), torch.bfloat16),
         (FAST, torch.float16)]
N, H, V = 6, 100, 300  # H = 100: a short last K tile for every launch; V = 300: a short last vocab tile


def _inputs(dt, seed=0):
    r = _gen(seed)
    h, w = r(N, H).to(dt), r(V, H, scale=4 * H ** -0.5).to(dt)
    h[1, 7] = float("nan")  # a NaN row: its log-probs are the canonical NaN
    return h, w, torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed))


def _composed(h, w, t, temperature, matmul_spec):
    """The spec written out of other public pieces: the fast matmul kernel's float32 accumulator under the matmul spec's
    launch (fast_matmul._mm2d, what a linear runs before its output rounding), divided by T in float32 (one IEEE
    division), the strict log-softmax of the reference backend (strict bits are the same everywhere), gathered."""
    logits = fast_matmul._mm2d(h, w.t(), None, matmul_spec, torch.float32)
    if temperature != 1.0:
        logits = logits / torch.tensor(temperature, dtype=torch.float32)
    return hal.log_softmax(logits, -1, backend="reference").gather(-1, t.long().unsqueeze(-1)).squeeze(-1)


def tlp_fast_is_fast_logits_then_strict_log_softmax():
    """hal.token_logprobs under the fast spec == the fast matmul's float32 logits + the strict log-softmax, T 1 and 0.7,
    one token and K tokens per row. Negative control: the same composition with another launch's logits."""
    for spec, dt in _pick(CASES):
        h, w, t = _inputs(dt)
        pairs = []
        for temp in (1.0, 0.7):
            got = hal.token_logprobs(h, w, t, temp, spec=spec, backend="triton")
            pairs.append((f"T{temp}", _composed(h, w, t, temp, spec.matmul), got))
        many = torch.stack([t, torch.zeros_like(t), t.flip(0)], 1)
        pairs.append(("k-tokens", torch.stack([_composed(h, w, c, 1.0, spec.matmul) for c in many.unbind(1)], 1),
                      hal.token_logprobs(h, w, many, spec=spec, backend="triton")))
        _same(f"tlp-fast-composes[{spec.id},{dt}]", pairs)
        other = SMALL.matmul if spec.matmul != SMALL.matmul else FAST.matmul
        _differs(f"tlp-fast-composes-other-launch-negative[{spec.id},{dt}]",
                 [("T1.0", _composed(h, w, t, 1.0, other), pairs[0][2])])


class _BatchTiled(type(hal.get_backend("triton"))):
    """The wrong variant: the logits' launch chosen from the batch (a library heuristic: few rows get short K tiles).
    It claims what triton claims, so the conformance suite must fail it."""
    name = "fast-batch-tiled"
    auto = False

    def token_logprobs(self, hidden, weight, tokens, temperature, spec):
        if hidden.shape[0] < 4:
            spec = dataclasses.replace(spec, matmul=SMALL.matmul if spec.matmul != SMALL.matmul else FAST.matmul)
        return super().token_logprobs(hidden, weight, tokens, temperature, spec)


def tlp_fast_suite_catches_a_launch_from_the_batch():
    """The token_logprobs_fast suite's L1 on one quick case: triton passes, the batch-tiled variant fails."""
    from hal.conformance import runner, suites
    suite = suites.get("token_logprobs_fast")
    case = next(c for c in suite.quick_cases() if c.spec == FAST)
    results = {}
    for backend in (hal.get_backend("triton"), _BatchTiled()):
        outcomes = {"L1": runner._Outcome()}
        runner.run_case(suite, backend, case, torch.device("cpu"), ("L1",), outcomes)
        results[backend.name] = outcomes["L1"]
    ok, bad = results["triton"], results["fast-batch-tiled"]
    if ok.failures or not ok.checks:
        FAILED.append("tlp-fast-suite-triton-L1")
        print(f"tlp-fast-suite-triton-L1: FAIL {ok.failures[:1]} ({ok.checks} checks)", flush=True)
    else:
        print(f"tlp-fast-suite-triton-L1: ok ({ok.checks} outputs identical)", flush=True)
    if bad.failures:
        print(f"tlp-fast-suite-batch-tiled-negative: ok (wrong variant caught: {bad.failures[0][1].label})", flush=True)
    else:
        FAILED.append("tlp-fast-suite-batch-tiled-negative")
        print("tlp-fast-suite-batch-tiled-negative: FAIL (wrong variant NOT caught)", flush=True)


def tlp_fast_switch():
    """hal.use(policy="fast") runs hal.token_logprobs (no spec=, no backend=) on the fast spec on triton, with the bits
    of the explicit call; float32 is refused by name. Negative control: without the switch the strict spec runs."""
    h, w, t = _inputs(torch.bfloat16)
    with dispatch_log() as switched, hal.use(policy="fast"):
        got = hal.token_logprobs(h, w, t, 0.7)
        try:
            hal.token_logprobs(h.float(), w.float(), t)
            refused = "not refused"
        except hal.UnsupportedError as e:
            refused = str(e) + " ".join(e.reasons)
    with dispatch_log() as strict:
        hal.token_logprobs(h, w, t, 0.7, backend="triton")
    _same("tlp-fast-switch-bits", [("T0.7", hal.token_logprobs(h, w, t, 0.7, spec=FAST, backend="triton"), got)])
    want = [("token_logprobs", FAST.id, "triton")]
    ok = switched[:1] == want and "policy 'fast'" in refused and "float32" in refused
    print(f"tlp-fast-switch-runs-fast: {'ok' if ok else 'FAIL'} {switched[:1]}; float32: {refused[:160]}", flush=True)
    if not ok:
        FAILED.append("tlp-fast-switch-runs-fast")
    if strict[:1] != want:
        print(f"tlp-fast-switch-negative-control: ok (wrong variant caught: outside the switch {strict[:1]})",
              flush=True)
    else:
        FAILED.append("tlp-fast-switch-negative-control")
        print("tlp-fast-switch-negative-control: FAIL (wrong variant NOT caught)", flush=True)


CHECKS = {f.__name__: f for f in (tlp_fast_is_fast_logits_then_strict_log_softmax,
                                  tlp_fast_suite_catches_a_launch_from_the_batch, tlp_fast_switch)}

if __name__ == "__main__":
    skip_without_interpreter()
    main(CHECKS)
