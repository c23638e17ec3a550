"""token_logprobs: LM head in float32 + vocab-tiled log-softmax + gather (the RL log-prob)."""
from __future__ import annotations

import torch

import hal
from hal.spec import DEFAULTS

from .. import inputs as gen
from ..suite import DTYPES, Case, Suite, autograd_check, extreme_rows, rowwise_checks

# (tokens N, hidden H, vocab V, temperature)
SHAPES = [(1, 64, 1000, 1.0), (7, 129, 4097, 1.0), (5, 96, 515, 0.7), (4, 70, 300, 1.0)]
NAN_SHAPE = (4, 70, 300)  # hidden row 1 holds a NaN, row 2 an inf; vocab row 7 a NaN (every token's logits)
EPS32 = 2.0 ** -24


def run_token_logprobs(backend, case, x):
    """The case's token_logprobs call (shared with the exact LM-head suite)."""
    return {"logprobs": hal.token_logprobs(x["hidden"], x["weight"], x["tokens"], case.p["temperature"],
                                           spec=case.spec, backend=backend)}


def hostile_neighbours(name, n, x):
    """L1's neighbour rows: extreme values, and valid token ids (shared with the exact LM-head suite)."""
    if name == "tokens":  # neighbours' token ids only need to be valid
        return torch.full((n,), int(x.max()), dtype=x.dtype, device=x.device)
    return extreme_rows(n, x.shape[1:], x.dtype, x.device)


def _k_tokens_per_row(backend, case, inputs, base):
    """tokens [N, K] (hal.token_logprobs' second form): each row's K log-probs, read from its one log-softmax (or
    computed per token by a backend whose kernel takes one), must be the bits of each token asked alone. Column 0
    is the case's own tokens (against the base call); the others: the vocabulary's ends, a repeat, random ids."""
    n, v = inputs["tokens"].shape[0], case.p["v"]
    tok = inputs["tokens"].long()
    extra = gen.randint(case.key("k-tokens"), (n, 3), v).long().to(tok.device)
    cols = [tok, torch.zeros_like(tok), torch.full_like(tok, v - 1), tok, *extra.unbind(1)]
    many = torch.stack(cols, 1).to(inputs["tokens"].dtype)
    got = run_token_logprobs(backend, case, dict(inputs, tokens=many))["logprobs"]
    yield "k-tokens-per-row:column-0-vs-base:logprobs", base["logprobs"], got[:, 0].contiguous()
    for j in range(1, many.shape[1]):
        alone = run_token_logprobs(backend, case, dict(inputs, tokens=many[:, j].contiguous()))["logprobs"]
        yield f"k-tokens-per-row:column-{j}-vs-alone:logprobs", alone, got[:, j].contiguous()


K_TOKENS = [("k-tokens-per-row", _k_tokens_per_row)]


class TokenLogprobsSuite(Suite):
    def cases(self):
        return [Case("token_logprobs", f"n{n}_h{h}_v{v}_t{t}", dt, DEFAULTS["token_logprobs"],
                     (("n", n), ("h", h), ("v", v), ("temperature", t)))
                for n, h, v, t in SHAPES for dt in DTYPES]

    def make_inputs(self, case):
        n, h, v = case.p["n"], case.p["h"], case.p["v"]
        x = {"hidden": gen.randn(case.key("hidden"), (n, h), case.dtype),
             "weight": gen.randn(case.key("w"), (v, h), case.dtype, scale=4 * h ** -0.5),
             "tokens": gen.randint(case.key("tokens"), (n,), v)}
        if (n, h, v) == NAN_SHAPE:
            x["hidden"][1, 69] = float("nan")
            x["hidden"][2, 5] = float("inf")
        return x

    def run(self, backend, case, inputs):
        return run_token_logprobs(backend, case, inputs)

    def oracle(self, case, x):
        from hal.kernels import oracle
        return {"logprobs": oracle.token_logprobs(x["hidden"], x["weight"], x["tokens"], case.p["temperature"])}

    def budget(self, case, output, x, exact):
        h, v, temp = case.p["h"], case.p["v"], case.p["temperature"]
        th, tv = case.spec.hidden_tile, case.spec.vocab_tile
        mag = (x["hidden"].double().abs() @ x["weight"].double().abs().t()).amax(-1) / temp
        logits_err = (th + -(-h // th) + 2) * EPS32 * mag
        return 2 * logits_err + (tv + -(-v // tv) + 6) * EPS32 * (1 + exact.abs())


SUITE = TokenLogprobsSuite(
    # quick: H = 70 / 96 cross the hidden tile, V = 300 / 515 the vocab tile; NaN/inf rows; T = 0.7 (output float32)
    quick=("n4_h70_v300_t1.0.bf16", "n5_h96_v515_t0.7.fp16"),
    name="token_logprobs", ops=("token_logprobs",), levels=("L0", "L1", "L3", "L4", "A"),
    checks={"L1": rowwise_checks(run_token_logprobs, ("hidden", "tokens"), hostile=hostile_neighbours) + K_TOKENS,
            "L3": autograd_check(run_token_logprobs, ("hidden", "weight"))},
)
