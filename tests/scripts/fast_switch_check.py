"""The fast policy switch on a whole tiny HF model, in the Triton interpreter (TRITON_INTERPRET=1).

Run in a subprocess by tests/test_fast_switch.py. ``lt.patch(model, policy="fast")`` on a tiny bf16 Llama:
which spec every dispatched op ran under (the fast matmul / attention specs on triton, every other op strict,
never the stock control); the trainer's teacher-forced forward and the sampler's ``generate`` give the same
raw bits, with a negative control (the strict-patched model's logits must differ from the fast ones); the
patch's fingerprint; a patch whose table takes the decode-tile attention spec (``specs=``); a Gated DeltaNet
hybrid's delta rule on the fast GDN spec (its conv and gates strict) in the engine (CI) and in generate / the
trainer's forward (switch-gdn-hybrids, LOCKSTEP_FULL=1).
Usage: python tests/scripts/fast_switch_check.py [CHECK...]; prints "CHECK: ok ..." / "CHECK: FAIL ..." lines.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # this checkout's hal
import torch  # noqa: E402

import hal  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import tiny_model  # noqa: E402
from hal.spec import FAST_ATTENTION_DECODE, POLICY_SPECS, policy_specs  # noqa: E402
from _check_cli import main, skip_without_interpreter  # noqa: E402
from triton_seq_check import FAILED, _differs, _same, dispatch_log  # noqa: E402

PROMPT = [5, 17, 42, 9, 77]
NEW = 2  # generated tokens: one prefill + one decode step with the cache (the interpreter is slow)


def _model(kind="llama"):
    return tiny_model(kind, dtype=torch.bfloat16)


def _generate(m):
    ids = torch.tensor([PROMPT])
    out = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                     do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, 1)[0]  # [1, P + NEW], [NEW, V]


def _teacher_forced(m, seq):
    """The trainer's forward over the whole sequence: the logits that predicted each generated token."""
    with torch.no_grad():
        logits = m(seq).logits[0]
    return logits[len(PROMPT) - 1:len(PROMPT) - 1 + NEW]


def _off_the_switch(log, table=POLICY_SPECS["fast"]):
    """The dispatched calls of a fast-patched model that ran anything but the switch's choice: a linear, attention,
    gated delta rule or token_logprobs call off the fast table's spec (``table``: the patch's) or off triton, another
    op (the GDN conv and gates included) off its strict spec, anything on stock."""
    fast = {family: s.id for family, s in table.items()}
    want = {"linear": fast["matmul"], "matmul": fast["matmul"], "flash_attn_varlen_func": fast["attention"],
            "flash_attn_with_kvcache": fast["attention"], "chunk_gated_delta_rule": fast["gated_delta_rule"],
            "fused_recurrent_gated_delta_rule": fast["gated_delta_rule"], "token_logprobs": fast["token_logprobs"]}
    return [(op, sid, b) for op, sid, b in log
            if (op in want and (sid, b) != (want[op], "triton")) or (op not in want and ".strict." not in sid)
            or b == "stock"]


def _check_log(label, log, gdn=False, table=POLICY_SPECS["fast"]):
    """``gdn``: a hybrid's log must also show the delta rule, prefill and decode, and the layer ops (strict)."""
    wrong = _off_the_switch(log, table)
    linears = sum(op == "linear" for op, _, _ in log)
    attns = sum(op.startswith("flash_attn") for op, _, _ in log)
    rules = {op for op, _, _ in log if op.endswith("gated_delta_rule")}
    layer = {op for op, _, _ in log if op.startswith("gdn_")}
    missing = gdn and (rules != {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"}
                       or layer != {"gdn_gating", "gdn_causal_conv1d"})
    if wrong or not linears or not attns or missing:
        FAILED.append(label)
        print(f"{label}: FAIL off the switch: {wrong[:4]}; linears={linears} attention={attns} gdn rule={rules} "
              f"gdn layer={layer}", flush=True)
    else:
        print(f"{label}: ok ({linears} linear and {attns} attention calls on the fast specs; every call ran: "
              f"{sorted(set(log))})", flush=True)


def switch_runs_fast_specs():
    """Every linear and attention call of a fast-patched model's generate runs the fast table's spec on triton;
    every other op its strict spec; nothing on the stock control. Negative control: a strict patch is flagged."""
    m = _model()
    with lt.patch(m, policy="fast"), dispatch_log() as log:
        _generate(m)
    _check_log("switch-runs-fast-specs", log)
    with lt.patch(m), dispatch_log() as strict_log:
        _generate(m)
    if _off_the_switch(strict_log):
        print("switch-runs-fast-specs-negative-control: ok (wrong variant caught: a strict patch's linears)", flush=True)
    else:
        FAILED.append("switch-runs-fast-specs-negative-control")
        print("switch-runs-fast-specs-negative-control: FAIL (wrong variant NOT caught)", flush=True)


def switch_trainer_equals_generate():
    """The same bits from the trainer's teacher-forced forward and the sampler's generate (prefill, then decode
    from the KV cache), both of one fast-patched model; negative control: the strict-patched model's logits."""
    m = _model()
    with lt.patch(m, policy="fast"):
        seq, sampled = _generate(m)
        trained = _teacher_forced(m, seq)
    # generate hands out float32 logits (the bf16 head's output widened, exactly): compare them widened alike
    _same("switch-trainer-equals-generate", [(f"step-{i}", trained[i].float(), sampled[i]) for i in range(NEW)])
    with lt.patch(m):  # strict: same model, same sequence
        strict = _teacher_forced(m, seq)
    _differs("switch-strict-negative-control", [(f"step-{i}", trained[i], strict[i]) for i in range(NEW)])


def switch_engine_equals_trainer():
    """transformers' continuous-batching engine on a fast-patched model (chunked prefill over pages of 4, decode
    from the paged cache): each recorded log-prob has the bits of the trainer's teacher-forced lt.token_logprobs;
    negative control: the same tokens scored by the strict-patched model."""
    from examples.engine_parity import HARD, PROMPTS, gen_config, run_engine, teacher_forced
    m = _model()
    prompts = PROMPTS[1:2]  # 5 tokens: prefill in chunks of 4 (HARD's max_batch_tokens), pages of 4
    with lt.patch(m, policy="fast"), dispatch_log() as log:
        engine, _, _ = run_engine(m, prompts, HARD, gen=gen_config(new=NEW))
    _check_log("switch-engine-runs-fast-specs", log)  # its recorded log-prob too: the fast token_logprobs spec
    with lt.patch(m, policy="fast"):
        trainer = {i: teacher_forced(m, p, engine[i][0]) for i, p in enumerate(prompts)}
    _same("switch-engine-equals-trainer", [(f"prompt-{i}", trainer[i], engine[i][1]) for i in engine])
    with lt.patch(m):
        strict = {i: teacher_forced(m, p, engine[i][0]) for i, p in enumerate(prompts)}
    _differs("switch-engine-strict-negative-control", [(f"prompt-{i}", strict[i], engine[i][1]) for i in engine])


def switch_fingerprint():
    """The patch records hal.fast_fingerprint: the interpreter and its CPU, the Triton version, the spec ids."""
    import triton
    m = _model()
    with lt.patch(m, policy="fast") as p:
        fp = p.fingerprint
    expected_specs = {family: s.id for family, s in POLICY_SPECS["fast"].items()}
    ok = (fp == hal.fast_fingerprint("cpu") and fp["device"].startswith("triton interpreter on ")
          and fp["triton"] == triton.__version__ and fp["specs"] == expected_specs and fp["backend"] == "triton"
          and fp["compute_capability"] is None)
    if not ok:
        FAILED.append("switch-fingerprint")
    print(f"switch-fingerprint: {'ok' if ok else 'FAIL'} {fp}", flush=True)


def switch_decode_tile():
    """lt.patch(model, policy="fast", specs={"attention": FAST_ATTENTION_DECODE}): every attention call (prefill and the
    cached decode step) runs the decode-tile spec on triton, the linears the fast table's matmul; trainer forward ==
    generate in raw bits; the fingerprint names the decode tile, as hal.fast_fingerprint does under
    hal.use(policy="fast", specs=...). Negative control: the default fast patch's log is flagged (its attention ran
    the 128-row spec). (Both specs give the same bits in the interpreter: the logits cannot tell them apart here.)"""
    m = _model()
    chosen = {"attention": FAST_ATTENTION_DECODE}
    table = policy_specs("fast", chosen)
    with lt.patch(m, policy="fast", specs=chosen) as p, dispatch_log() as log:
        seq, sampled = _generate(m)
        trained = _teacher_forced(m, seq)
        fp = p.fingerprint
    _check_log("switch-decode-tile-runs-its-specs", log, table=table)
    _same("switch-decode-tile-trainer-equals-generate", [(f"step-{i}", trained[i].float(), sampled[i])
                                                         for i in range(NEW)])
    with lt.patch(m, policy="fast") as default_patch, dispatch_log() as default_log:
        _generate(m)
    if _off_the_switch(default_log, table):
        print("switch-decode-tile-log-negative-control: ok (wrong variant caught: the default patch's attention)",
              flush=True)
    else:
        FAILED.append("switch-decode-tile-log-negative-control")
        print("switch-decode-tile-log-negative-control: FAIL (wrong variant NOT caught)", flush=True)
    with hal.use(policy="fast", specs=chosen):
        in_force = hal.fast_fingerprint("cpu")
    ok = (fp["specs"]["attention"] == FAST_ATTENTION_DECODE.id and fp == in_force
          and {k: v for k, v in fp["specs"].items() if k != "attention"}
          == {k: v for k, v in default_patch.fingerprint["specs"].items() if k != "attention"}
          and default_patch.fingerprint["specs"]["attention"] != FAST_ATTENTION_DECODE.id)
    if not ok:
        FAILED.append("switch-decode-tile-fingerprint")
    print(f"switch-decode-tile-fingerprint: {'ok' if ok else 'FAIL'} {fp['specs']}", flush=True)


def switch_gdn_hybrids():
    """Qwen3-Next (Gated DeltaNet, MoE router and experts) and Qwen3.5 fast-patched: linears, attention and the
    gated delta rule (prefill: chunked, decode: recurrent) on the fast specs, the GDN conv and gates strict; trainer
    forward == generate in raw bits (the engine: switch-gdn-engine, in CI). Negative controls: a strict patch's delta rule is flagged off the switch; the same fast patch with its delta
    rule put back on the strict spec gives other logits (so the bits checks see the fast GDN). (LOCKSTEP_FULL=1.)"""
    for kind in ("qwen3_next", "qwen3_5"):
        m = _model(kind)
        with lt.patch(m, policy="fast") as p:
            with dispatch_log() as log:
                seq, sampled = _generate(m)  # prefill (chunked rule), then one decode step (recurrent rule)
                trained = _teacher_forced(m, seq)
            p.switch.gdn = (None, None)  # the wrong variant: this fast patch's delta rule on its strict default
            strict_rule = _teacher_forced(m, seq)
        _check_log(f"switch-runs-fast-specs[{kind}]", log, gdn=True)
        _same(f"switch-trainer-equals-generate[{kind}]", [(f"step-{i}", trained[i].float(), sampled[i])
                                                          for i in range(NEW)])
        _differs(f"switch-gdn-strict-rule-negative-control[{kind}]", [(f"step-{i}", trained[i], strict_rule[i])
                                                                      for i in range(NEW)])
        with lt.patch(m), dispatch_log() as strict_log:
            _teacher_forced(m, seq)
        if _off_the_switch([e for e in strict_log if e[0].endswith("gated_delta_rule")]):
            print(f"switch-gdn-log-negative-control[{kind}]: ok (wrong variant caught: a strict patch's delta rule)",
                  flush=True)
        else:
            FAILED.append(f"switch-gdn-log-negative-control[{kind}]")
            print(f"switch-gdn-log-negative-control[{kind}]: FAIL (wrong variant NOT caught)", flush=True)


def switch_gdn_engine():
    """transformers' continuous-batching engine on a fast-patched Qwen3-Next (chunked prefill over pages of 4, the
    engine's GDN step per request, decode): its delta rule on the fast spec, each recorded log-prob with the bits of
    the trainer's teacher-forced lt.token_logprobs; negative control: the same tokens scored strict."""
    from examples.engine_parity import GDN_HARD, PROMPTS, gen_config, run_engine, teacher_forced
    m = _model("qwen3_next")
    prompts = PROMPTS[1:2]
    with lt.patch(m, policy="fast"), dispatch_log() as log:
        engine, _, _ = run_engine(m, prompts, GDN_HARD, gen=gen_config(new=NEW))
    _check_log("switch-gdn-engine-runs-fast-specs", log, gdn=True)
    with lt.patch(m, policy="fast"):
        trainer = {i: teacher_forced(m, p, engine[i][0]) for i, p in enumerate(prompts)}
    _same("switch-gdn-engine-equals-trainer", [(f"prompt-{i}", trainer[i], engine[i][1]) for i in engine])
    with lt.patch(m):
        strict = {i: teacher_forced(m, p, engine[i][0]) for i, p in enumerate(prompts)}
    _differs("switch-gdn-engine-strict-negative-control", [(f"prompt-{i}", strict[i], engine[i][1]) for i in engine])


def switch_torchtitan():
    """TorchTitan converted with LockstepConverter.Config(policy="fast") (the trainer) and the HF model patched with
    policy="fast" (the sampler): the same logits' bits on one sequence; negative control: TorchTitan strict.
    (Needs torchtitan: run by tests/titan/test_torchtitan_fast_switch.py in the TorchTitan environment.)"""
    from examples import torchtitan_parity as ex
    from hal.integrations import torchtitan as ltt
    hf = ex.hf_qwen3(torch.bfloat16)
    cfg = ltt.LockstepConverter.Config(policy="fast").build().convert(ltt.qwen3_config_from_hf(hf.config))
    with torch.random.fork_rng(devices=[]):
        trainer = cfg.build()
    trainer.to(torch.bfloat16)
    ltt.load_from_hf(trainer, hf)
    tokens = torch.tensor([PROMPT])
    positions = torch.arange(len(PROMPT)).unsqueeze(0)
    with torch.no_grad(), dispatch_log() as log:
        trained = ltt.forward(trainer, tokens, positions)
    _check_log("switch-torchtitan-runs-fast-specs", log)
    with lt.patch(hf, policy="fast"), torch.no_grad():
        sampled = hf(tokens).logits
    _same("switch-torchtitan", [("logits", trained, sampled)])
    with torch.no_grad():
        strict = ltt.forward(ex.titan_qwen3(hf), tokens, positions)
    _differs("switch-torchtitan-strict-negative-control", [("logits", strict, sampled)])
    # the recorded log-prob's recomputation: ltt.token_logprobs on the trainer's final hidden states runs the fast
    # token_logprobs spec (the LM head's policy), as the fast-patched sampler's lt.token_logprobs does. In the
    # interpreter the v2 fast dot's stand-in is strict arithmetic, so the values alone cannot tell: the log does.
    targets = torch.tensor(PROMPT[1:])
    trainer._skip_lm_head = True
    with torch.no_grad(), dispatch_log() as log:
        h_tt = ltt.forward(trainer, tokens, positions)[0, :-1]
        lp_tt = ltt.token_logprobs(trainer, h_tt, targets)
    trainer._skip_lm_head = False
    ran = [(op, sid, b) for op, sid, b in log if op == "token_logprobs"]
    if ran != [("token_logprobs", POLICY_SPECS["fast"]["token_logprobs"].id, "triton")]:
        FAILED.append("switch-torchtitan-token-logprobs-spec")
        print(f"switch-torchtitan-token-logprobs-spec: FAIL {ran}", flush=True)
    else:
        print("switch-torchtitan-token-logprobs-spec: ok", flush=True)
    with lt.patch(hf, policy="fast"), torch.no_grad():
        h_hf = hf.model(input_ids=tokens, position_ids=positions, use_cache=False).last_hidden_state[0, :-1]
        lp_hf = lt.token_logprobs(hf, h_hf, targets)
    _same("switch-torchtitan-token-logprobs", [("hidden", h_tt, h_hf), ("logprobs", lp_tt, lp_hf)])


def switch_torchtitan_qwen3_5():
    """TorchTitan's Qwen3.5 converted with LockstepConverter.Config(policy="fast") (the trainer: its GatedDeltaKernel on
    the fast GDN spec, its conv and gates strict) and the HF Qwen3.5 patched with policy="fast" (the sampler): the
    same logits' bits; negative control: TorchTitan strict. (Needs torchtitan: tests/titan.)"""
    from examples import torchtitan_parity as ex
    from hal.integrations import torchtitan as ltt
    hf = ex.hf_qwen3_5(torch.bfloat16)
    trainer = ex.titan_qwen3_5(hf, policy="fast")
    tokens = torch.tensor([PROMPT])
    positions = torch.arange(len(PROMPT)).unsqueeze(0)
    with torch.no_grad(), dispatch_log() as log:
        trained = ltt.forward(trainer, tokens, positions)
    rules = {(op, sid, b) for op, sid, b in log if op.endswith("gated_delta_rule")}
    _check_log("switch-torchtitan-qwen3_5-runs-fast-specs", log)
    if rules != {("chunk_gated_delta_rule", POLICY_SPECS["fast"]["gated_delta_rule"].id, "triton")}:
        FAILED.append("switch-torchtitan-qwen3_5-gdn-rule")
        print(f"switch-torchtitan-qwen3_5-gdn-rule: FAIL {rules}", flush=True)
    with lt.patch(hf, policy="fast"), torch.no_grad():
        sampled = hf(tokens).logits
    _same("switch-torchtitan-qwen3_5", [("logits", trained, sampled)])
    with torch.no_grad():
        strict = ltt.forward(ex.titan_qwen3_5(hf), tokens, positions)
    _differs("switch-torchtitan-qwen3_5-strict-negative-control", [("logits", strict, sampled)])


CHECKS = {f.__name__.replace("_", "-"): f for f in (switch_runs_fast_specs, switch_trainer_equals_generate,
                                                     switch_engine_equals_trainer, switch_fingerprint,
                                                     switch_decode_tile, switch_gdn_engine)}
OPTIONAL = {"switch-torchtitan": switch_torchtitan, "switch-gdn-hybrids": switch_gdn_hybrids,  # when named
            "switch-torchtitan-qwen3_5": switch_torchtitan_qwen3_5}

if __name__ == "__main__":
    skip_without_interpreter()
    lt.register()
    main(CHECKS, optional=OPTIONAL)
