"""transformers' continuous-batching engine samples, TorchTitan trains: the engine's recorded log-probs == the
log-probs of TorchTitan's packed training forward (its LM head through ``hal.token_logprobs``), raw bits.

The engine runs a hard schedule (4-token budget, chunked prefill, requests joining a decoding batch, small pages);
TorchTitan packs every prompt + response into one row with its own document masks. Qwen3 and Qwen3.5 in float32.
Negative control, asserted here: the stock engine (sdpa, transformers' own kernels) against the same trainer differs.
"""
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples import torchtitan_parity as ex  # noqa: E402
from examples.engine_parity import GDN_HARD, HARD, HARD_ORDER, PROMPTS, run_engine  # noqa: E402
from hal.integrations import torchtitan as ltt  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402

BUILD = {"qwen3": (ex.hf_qwen3, ex.titan_qwen3, HARD), "qwen3_5": (ex.hf_qwen3_5, ex.titan_qwen3_5, GDN_HARD)}


def trainer_logprobs(tt, results):
    """TorchTitan's packed forward over every prompt + response, the LM head as hal.token_logprobs:
    {prompt index: float32 log-probs of its response tokens}."""
    order = sorted(results)
    prompts = [torch.tensor(PROMPTS[i]) for i in order]
    responses = [torch.tensor(results[i][0]) for i in order]
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses)]
    tokens = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    tt._skip_lm_head = True
    try:
        with torch.no_grad():
            hidden = ltt.forward(tt, tokens, positions)[0]
    finally:
        tt._skip_lm_head = False
    out, start = {}, 0
    for i, p, r, s in zip(order, prompts, responses, seqs):
        rows = torch.arange(start + len(p) - 1, start + len(s) - 1)
        out[i] = ltt.token_logprobs(tt, hidden[rows], r)
        start += len(s)
    return out


def differing(engine, trainer) -> int:
    return sum(int((engine[i][1].view(torch.int32) != trainer[i].view(torch.int32)).sum()) for i in engine)


@pytest.mark.parametrize("kind", sorted(BUILD))
def test_engine_logprobs_equal_torchtitan_packed_forward(kind):
    lt.register()
    hf_build, tt_build, schedule = BUILD[kind]
    hf = hf_build(torch.float32)
    tt = tt_build(hf)
    with lt.patch(hf):
        engine, steps, _ = run_engine(hf, PROMPTS, schedule, order=HARD_ORDER)
    assert len(steps) > len(PROMPTS) * 3 and sum(len(r[0]) for r in engine.values()) > 0  # a real schedule ran
    assert differing(engine, trainer_logprobs(tt, engine)) == 0
    # negative control: the stock engine (transformers' own kernels) against the same lockstep trainer
    if kind == "qwen3":
        stock = ex.hf_qwen3(torch.float32, attn="sdpa")
        stock_run, _, _ = run_engine(stock, PROMPTS, schedule, order=HARD_ORDER)
        assert differing(stock_run, trainer_logprobs(tt, stock_run)) > 0
