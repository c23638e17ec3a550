"""One switch for a whole model: ``hal.use(policy=...)``, ``lt.patch(model, policy=...)`` (docs/fast_policy.md).

* the table (hal.spec.POLICY_SPECS): the fast matmul and attention specs, the exact matmul and log-prob, every
  other family strict;
* refusals by name (UnsupportedError naming the policy and the device) on this CPU without the interpreter, and
  on the stock control anywhere; a refused lt.patch leaves the model as it was;
* strict changes nothing; exact runs the exact specs;
* ``specs=`` (hal.use, lt.patch) puts a chosen spec of the policy in its table (the decode-tile attention spec),
  refused by name otherwise, the model unchanged;
* in the Triton interpreter (tests/scripts/fast_switch_check.py): a fast-patched tiny Llama runs its linears and
  attention on the fast specs (the dispatch log), the trainer's forward == generate == the continuous-batching
  engine in raw bits (negative controls: the strict-patched model's bits differ, a strict patch is flagged by
  the dispatch-log check), and the patch's fingerprint; a patch with the decode-tile attention spec (its log, trainer ==
  generate, its fingerprint; negative control: the default patch's log is flagged); LOCKSTEP_FULL=1 adds the Gated DeltaNet hybrids (Qwen3-Next
  with its MoE, Qwen3.5: linears and attention fast, the GDN strict).
"""
from __future__ import annotations

import os

import pytest
import torch

import hal
from hal import dispatch
from hal.conformance.bits import same_bits
from hal.errors import InputError, SpecError, UnsupportedError
from hal.kernels.triton.versions import interpreting
from hal.spec import (DEFAULTS, FAST_ATTENTION_DECODE, POLICY_SPECS, ExactMatmulSpec, FastAttentionSpec,
                      FastGatedDeltaRuleSpec, FastMatmulSpec, FastMatmulV3Spec, TokenLogprobsSpec, policy_spec,
                      policy_specs)

from _triton_seq_run import ROOT, needs_interpreter, run_checks

SCRIPT = os.path.join(ROOT, "tests", "scripts", "fast_switch_check.py")
no_interpreter = pytest.mark.skipif(interpreting() or torch.cuda.is_available(),
                                    reason="the refusal on a machine where no backend claims the fast specs")


def _xw():
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 32, generator=g).bfloat16(), torch.randn(8, 32, generator=g).bfloat16()


def test_policy_table():
    assert POLICY_SPECS["fast"] == {"matmul": FastMatmulSpec(), "attention": FastAttentionSpec(),
                                    "gated_delta_rule": FastGatedDeltaRuleSpec(),
                                    "token_logprobs": TokenLogprobsSpec(matmul=FastMatmulSpec())}
    assert policy_spec("matmul", "fast") == FastMatmulSpec()
    assert policy_spec("token_logprobs", "fast").matmul == FastMatmulSpec()  # fast logits, strict log-softmax
    assert policy_spec("rms_norm", "fast") is DEFAULTS["rms_norm"]
    assert policy_spec("matmul", "exact") == ExactMatmulSpec(slices=4)
    assert policy_spec("token_logprobs", "exact").matmul == ExactMatmulSpec(slices=4)
    assert all(policy_spec(f, "strict") is s for f, s in DEFAULTS.items())
    with pytest.raises(SpecError, match="policy must be one of"):
        policy_spec("matmul", "turbo")


def test_the_gdn_family_entry_reaches_the_delta_rule_not_the_layer_ops():
    """One family entry, per op: the delta rule's two ops take the fast GDN spec, the layer ops of the same family
    (no fast spec: they refuse one) their strict default, under hal.use and check_policy alike."""
    fast_gdn, strict_gdn = FastGatedDeltaRuleSpec(), DEFAULTS["gated_delta_rule"]
    for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        assert dispatch.switched_spec(op, "fast") == fast_gdn and dispatch.switched_spec(op, "strict") is strict_gdn
    for op in ("gdn_gating", "gdn_causal_conv1d"):
        assert dispatch.switched_spec(op, "fast") is strict_gdn
        assert dispatch.check_policy("fast", torch.device("cpu"), torch.bfloat16, (op,))[op] == (strict_gdn, None)
    with hal.use(policy="fast"):
        assert dispatch.call_spec("chunk_gated_delta_rule", None) == fast_gdn
        assert dispatch.call_spec("gdn_gating", None) is strict_gdn
        a = torch.linspace(-2, 2, 6).reshape(2, 3)
        g, beta = hal.gdn_gating(torch.zeros(3), a, torch.zeros(3), a)  # runs strict under the switch
    assert all(same_bits(x, y) for x, y in zip((g, beta), hal.gdn_gating(torch.zeros(3), a, torch.zeros(3), a)))
    with pytest.raises(UnsupportedError, match=r"gdn_gating.*gated_delta_rule\.fast"):  # an explicit fast spec: refused
        hal.gdn_gating(torch.zeros(3), a, torch.zeros(3), a, spec=fast_gdn)


def test_use_needs_a_backend_or_a_known_policy():
    with pytest.raises(InputError, match="needs a backend name, a policy= or both"):
        with hal.use():
            pass
    with pytest.raises(InputError, match="policy must be one of"):
        with hal.use(policy="turbo"):
            pass
    assert hal.policy_in_force() == "strict"
    with hal.use(policy="fast"):
        assert hal.policy_in_force() == "fast"
        with hal.use("cpu"):  # a backend alone keeps the policy
            assert hal.policy_in_force() == "fast"
    assert hal.policy_in_force() == "strict"


def test_the_switch_takes_a_chosen_spec_of_its_policy():
    """specs= replaces entries of the policy's table for hal.use (nested: an inner policy brings its own table; a
    backend alone keeps it) and check_policy; a spec that is not the policy's, of another family, for a family the
    table lacks, or specs= without a policy is refused by name and changes nothing."""
    attn_ops = ("flash_attn_varlen_func", "flash_attn_with_kvcache")
    chosen = {"attention": FAST_ATTENTION_DECODE.id}  # by id or object
    assert FAST_ATTENTION_DECODE.id == "attention.fast.m16.b64.s512.w8.st2.v2" != FastAttentionSpec().id
    table = policy_specs("fast", chosen)
    assert table == dict(POLICY_SPECS["fast"], attention=FAST_ATTENTION_DECODE)
    assert POLICY_SPECS["fast"]["attention"] == FastAttentionSpec()  # the registered table is untouched
    assert policy_specs("fast", {"matmul": FastMatmulV3Spec()})["matmul"] == FastMatmulV3Spec()
    with hal.use(policy="fast", specs=chosen):
        assert all(dispatch.call_spec(op, None) is FAST_ATTENTION_DECODE for op in attn_ops)
        assert dispatch.call_spec("linear", None) == FastMatmulSpec() and dispatch.call_spec("rms_norm", None) is \
            DEFAULTS["rms_norm"]
        assert dispatch.call_spec("flash_attn_varlen_func", FastAttentionSpec()) == FastAttentionSpec()  # explicit wins
        with hal.use("cpu"):
            assert dispatch.call_spec("flash_attn_with_kvcache", None) is FAST_ATTENTION_DECODE
        with hal.use(policy="fast"):
            assert dispatch.call_spec("flash_attn_with_kvcache", None) == FastAttentionSpec()
        assert dispatch.call_spec("flash_attn_varlen_func", None) is FAST_ATTENTION_DECODE
    assert dispatch.call_spec("flash_attn_varlen_func", None) is DEFAULTS["attention"]
    for op in attn_ops:
        assert dispatch.switched_spec(op, "fast", table) is FAST_ATTENTION_DECODE
        assert dispatch.switched_spec(op, "fast") == FastAttentionSpec()
    assert dispatch.check_policy("fast", torch.device("cpu"), torch.bfloat16, ("rms_norm",), table)["rms_norm"] == \
        (DEFAULTS["rms_norm"], None)
    refused = [(InputError, "specs= changes a policy switch's table; pass the policy too", dict(specs=chosen)),
               (SpecError, "policy 'strict' has no 'attention' spec to replace", dict(policy="strict", specs=chosen)),
               (SpecError, "policy 'fast' has no 'rms_norm' spec to replace",
                dict(policy="fast", specs={"rms_norm": DEFAULTS["rms_norm"]})),
               (SpecError, r"not a 'fast' spec \(it uses strict\); the fast switch's attention spec is "
                           r"attention\.fast\.m128", dict(policy="fast", specs={"attention": DEFAULTS["attention"]})),
               (SpecError, "is for 'matmul' ops", dict(policy="fast", specs={"attention": FastMatmulSpec()})),
               (SpecError, "unknown spec id 'attention.fast.m8'", dict(policy="fast", specs={"attention": "attention.fast.m8"})),
               (SpecError, "specs= must be a dict", dict(policy="fast", specs=[FAST_ATTENTION_DECODE]))]
    for error, message, kwargs in refused:
        with pytest.raises(error, match=message):
            with hal.use(**kwargs):
                pass
        assert hal.policy_in_force() == "strict" and dispatch.call_spec("flash_attn_varlen_func", None) is \
            DEFAULTS["attention"]


@no_interpreter
def test_fast_switch_refused_on_cpu():
    x, w = _xw()
    with hal.use(policy="fast"):
        with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: no backend that claims "
                                                   r"'matmul_fast' can run linear") as e:
            hal.linear(x, w)
        assert any("TRITON_INTERPRET=1" in r for r in e.value.reasons)
        q = torch.ones(4, 2, 16, dtype=torch.bfloat16)
        cu = torch.tensor([0, 4], dtype=torch.int32)
        with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: .*'attention_fast'"):
            hal.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True)
        # a family without a fast spec runs strict, as without the switch
        y = hal.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    assert same_bits(y, hal.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6))
    with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu"):
        hal.fast_fingerprint()


def test_fast_switch_never_runs_on_stock():
    x, w = _xw()
    assert hal.get_backend("stock").supports("linear", FastMatmulSpec(), torch.bfloat16, torch.device("cpu")) == []
    with hal.use("stock", policy="fast"):  # stock accepts every spec (the control) but claims nothing: refused
        with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: the requested backend 'stock' claims "
                                                   r"no level of conformance suite 'matmul_fast'"):
            hal.linear(x, w)
    with hal.use(policy="fast"):
        with pytest.raises(UnsupportedError, match="policy 'fast' on device cpu"):
            hal.linear(x, w, backend="stock")
    with pytest.raises(UnsupportedError, match="the requested backend 'stock'"):
        hal.fast_fingerprint("cpu", backend="stock")


class _ClaimsFast(hal.Backend):
    """A backend that serves CPU linears under the fast matmul spec and claims matmul_fast (a stand-in for a vendor
    backend): its result marks that it ran."""
    name, device_types, priority = "claims-fast", ("cpu",), 100
    policies = ("strict", "fast")
    claims = True

    def claimed_levels(self, suite, spec):
        return frozenset({"L0", "L1"}) if self.claims and suite == "matmul_fast" else frozenset()

    def linear(self, x, weight, bias, spec):
        return torch.full((*x.shape[:-1], weight.shape[0]), 7.0, dtype=x.dtype)


def test_the_switch_picks_the_backend_that_claims_the_suite():
    x, w = _xw()
    assert dispatch.suite_of("linear", FastMatmulSpec()) == "matmul_fast"
    assert dispatch.suite_of("flash_attn_with_kvcache", FastAttentionSpec()) == "attention_fast"
    assert dispatch.suite_of("token_logprobs", policy_spec("token_logprobs", "exact")) == "token_logprobs_exact"
    assert dispatch.suite_of("token_logprobs", policy_spec("token_logprobs", "fast")) == "token_logprobs_fast"
    fake = _ClaimsFast()
    hal.register_backend(fake)
    try:
        with hal.use(policy="fast"):
            assert (hal.linear(x, w) == 7).all()  # the first by priority that serves the call and claims it
            fake.claims = False  # the memo is checked again after a registry change
            hal.register_backend(fake)
            if not (interpreting() or torch.cuda.is_available()):
                with pytest.raises(UnsupportedError, match="claims-fast: claims no level of conformance suite"):
                    hal.linear(x, w)
    finally:
        hal.unregister_backend(fake.name)
    assert not (hal.linear(x, w) == 7).all()


def test_strict_switch_changes_nothing_and_exact_runs_exact():
    x, w = _xw()
    base = hal.linear(x, w)
    with hal.use(policy="strict"):
        assert dispatch.call_spec("matmul", None) is DEFAULTS["matmul"]
        assert same_bits(hal.linear(x, w), base)
    with hal.use(policy="exact"):
        assert dispatch.call_spec("matmul", None) == ExactMatmulSpec(slices=4)
        assert dispatch.call_spec("rms_norm", None) is DEFAULTS["rms_norm"]
        assert dispatch.call_spec("matmul", "matmul.strict.k64.v2") is DEFAULTS["matmul"]  # an explicit spec wins
        y = hal.linear(x, w)
    assert same_bits(y, hal.linear(x, w, spec=ExactMatmulSpec(slices=4)))
    with hal.use("stock", policy="exact"):
        with pytest.raises(UnsupportedError, match="policy 'exact' on device cpu: the requested backend 'stock'"):
            hal.linear(x, w)


def test_a_compiled_call_follows_the_switch_when_it_runs():
    """Under torch.compile a call given no spec crosses the torch op without one: the switch in force when the graph
    runs decides (as hal.use(name) does), never the one at trace time."""
    x, w = (t.float() for t in _xw())  # float32: the exact and the strict bits differ here (checked below)
    frames = []
    f = torch.compile(lambda x, w: hal.linear(x, w), fullgraph=True,
                      backend=lambda gm, inputs: frames.append(gm) or gm.forward)
    strict = f(x, w)  # traced here, outside any switch
    with hal.use(policy="exact"):
        exact = f(x, w)  # the same graph
    assert len(frames) == 1
    assert same_bits(strict, hal.linear(x, w))
    assert same_bits(exact, hal.linear(x, w, spec=ExactMatmulSpec(slices=4)))
    assert not same_bits(exact, strict)


# ---------------------------------------------------------------- lt.patch(model, policy=...)


@pytest.fixture(scope="module")
def lt():
    pytest.importorskip("transformers")
    from hal.integrations import transformers as lt
    lt.register()
    return lt


def _tiny(dtype=torch.bfloat16, kind="llama"):
    from hal.integrations.transformers.testing import tiny_model
    return tiny_model(kind, dtype=dtype)


def _state(model):
    """Every module's instance attributes (what a patch writes) by identity, and the parameters' bits."""
    return ({n: {k: id(v) for k, v in m.__dict__.items()} for n, m in model.named_modules()},
            {n: p.detach().clone() for n, p in model.named_parameters()})


@no_interpreter
def test_patch_fast_refused_on_cpu_leaves_the_model_unchanged(lt):
    from hal.integrations.transformers.modules import patch_owner
    m = _tiny()
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before_logits = m(ids).logits
    attrs, params = _state(m)
    with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu") as e:
        lt.patch(m, policy="fast")
    assert "matmul_fast" in str(e.value)
    attrs_after, params_after = _state(m)
    assert attrs_after == attrs and all(same_bits(params[n], params_after[n]) for n in params)
    assert all(patch_owner(mod) is None for mod in m.modules())
    with torch.no_grad():
        assert same_bits(m(ids).logits, before_logits)
    with lt.patch(m) as p:  # the model still takes a (strict) patch
        assert p.policy == "strict" and p.fingerprint is None


class _ClaimsFastLinearsAndAttention(_ClaimsFast):
    """Claims the fast matmul, attention and token_logprobs suites on CPU, not the fast GDN one: a hybrid's check
    reaches its rule."""

    def claimed_levels(self, suite, spec):
        return frozenset({"L0", "L1"}) if suite in ("matmul_fast", "attention_fast", "token_logprobs_fast") \
            else frozenset()

    def flash_attn_varlen_func(self, *args, **kwargs):
        raise AssertionError("never run: the patch is refused before any forward")

    token_logprobs = flash_attn_varlen_func


@no_interpreter
def test_patch_fast_refuses_a_hybrid_whose_gdn_rule_no_backend_claims(lt):
    """On CPU without the interpreter, a Qwen3-Next's fast patch is refused by the delta rule's name even where its
    linears and attention would be served (a stand-in backend claims those): checked up front, the model unchanged."""
    m = _tiny(kind="qwen3_next")
    attrs, params = _state(m)
    fake = _ClaimsFastLinearsAndAttention()
    hal.register_backend(fake)
    try:
        with pytest.raises(UnsupportedError, match=r"policy 'fast' on device cpu: no backend that claims "
                                                   r"'gated_delta_rule_fast' can run chunk_gated_delta_rule"):
            lt.patch(m, policy="fast")
        attrs_after, params_after = _state(m)
        assert attrs_after == attrs and all(same_bits(params[n], params_after[n]) for n in params)
        assert dispatch.check_policy("fast", torch.device("cpu"), torch.bfloat16, ("linear",))["linear"][1] is fake
    finally:
        hal.unregister_backend(fake.name)


def test_patch_fast_refused_on_stock(lt):
    m = _tiny()
    attrs, _ = _state(m)
    with hal.use("stock"):
        with pytest.raises(UnsupportedError, match="policy 'fast' on device cpu: the requested backend 'stock'"):
            lt.patch(m, policy="fast")
    assert _state(m)[0] == attrs


def test_patch_policy_arguments(lt):
    m = _tiny(torch.float32)  # float32 outputs: the exact and the strict dots' bits differ (in bf16 they may not)
    with pytest.raises(InputError, match="policy must be one of"):
        lt.patch(m, policy="turbo")
    attrs, _ = _state(m)
    for policy, chosen, message in (("strict", {"attention": FAST_ATTENTION_DECODE}, "policy 'strict' has no 'attention'"),
                                    ("fast", {"attention": DEFAULTS["attention"]}, "not a 'fast' spec"),
                                    ("exact", {"attention": FAST_ATTENTION_DECODE}, "policy 'exact' has no 'attention'")):
        with pytest.raises(SpecError, match=message):  # before anything is patched
            lt.patch(m, policy=policy, specs=chosen)
        assert _state(m)[0] == attrs
    with pytest.raises(InputError, match="not both"):
        lt.patch(m, policy="exact", matmul_spec=ExactMatmulSpec(slices=4))
    with lt.patch(m, policy="exact") as p:
        assert p.matmul.spec == ExactMatmulSpec(slices=4) and p.matmul.logprobs_spec == policy_spec("token_logprobs",
                                                                                                    "exact")
        assert p.policy == "exact" and p.fingerprint is None and p.matmul.backend == "cpu"
        with torch.no_grad():
            exact = m(torch.tensor([[3, 1, 4]])).logits
    with lt.patch(m, matmul_spec=ExactMatmulSpec(slices=4)):
        with torch.no_grad():
            assert same_bits(m(torch.tensor([[3, 1, 4]])).logits, exact)
    with lt.patch(m):
        with torch.no_grad():
            strict = m(torch.tensor([[3, 1, 4]])).logits
    assert not same_bits(strict, exact)  # the check above can fail: the policies' bits differ


@needs_interpreter
def test_fast_switch_whole_model_in_interpreter():
    pytest.importorskip("transformers")
    full = os.environ.get("LOCKSTEP_FULL", "") not in ("", "0")
    names = ("switch-runs-fast-specs", "switch-trainer-equals-generate", "switch-engine-equals-trainer",
             "switch-fingerprint", "switch-decode-tile", "switch-gdn-engine") + (("switch-gdn-hybrids",) if full else ())
    out = run_checks(*names, script=SCRIPT)  # ~30 s here (generate, the engines, the fingerprints); full: +15 s
    assert out.count("wrong variant caught") == 5 + 4 * full and out.count("identical") == 4 + 2 * full
    assert "switch-decode-tile-fingerprint: ok" in out
