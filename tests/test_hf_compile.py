"""Patched HF models under torch.compile(fullgraph=True) (Inductor) and torch.export give the eager patched
logits bit for bit, and their graphs hold every lockstep op call the eager forward makes.

One tiny model per dtype (Llama fp32, Qwen3 bf16), compiled once and shared by the asserts. The bf16 case
runs Inductor's default config (no ``emulate_precision_casts``): the patched forwards' stock glue is single
roundings (reshapes, residual adds, one product), which Inductor computes as eager does. Negative control:
the unpatched model compiled the same way holds no lockstep op and its logits differ from the patched ones.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import torch._inductor.config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402

from hal import torch_ops  # noqa: E402
from hal.integrations import transformers as lt  # noqa: E402
from hal.integrations.transformers.testing import VOCAB, tiny_model  # noqa: E402
from hal.conformance.bits import same_bits

lt.register()

pytestmark = pytest.mark.usefixtures("one_thread")

MODELS = {"llama-fp32": ("llama", torch.float32), "qwen3-bf16": ("qwen3", torch.bfloat16),
          "qwen3_next-fp32": ("qwen3_next", torch.float32), "qwen3_next-bf16": ("qwen3_next", torch.bfloat16),
          "qwen3_5-bf16": ("qwen3_5", torch.bfloat16)}
# Qwen3-Next's and Qwen3.5's (1 + w) norms widen their input (x.float()) right after a bf16 residual add: Inductor fuses the two
# and skips the add's bf16 rounding unless it emulates eager's casts (docs/integrations.md, measured: the
# default config gives other logits here; the control for the option is test_compile.py's glue test)
EMULATE_CASTS = {"qwen3_next-bf16", "qwen3_5-bf16"}
GDN_KINDS = {"qwen3_next", "qwen3_5"}  # one GatedDeltaNet layer, one attention layer


def lockstep_nodes(graph: torch.fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and str(n.target).startswith("lockstep."))


def inputs():
    """Two rows, the second left-padded by two: the mask plan (padding) runs inside the graph's op."""
    ids = torch.arange(14).reshape(2, 7) * 5 % VOCAB
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    return dict(input_ids=ids, attention_mask=mask, use_cache=False)


class Counting:
    """A Dynamo backend that counts each FX graph's lockstep nodes, then hands the graph to ``then``."""

    def __init__(self, then):
        self.then, self.graphs = then, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(lockstep_nodes(gm.graph))
        return self.then(gm, example_inputs)


@pytest.fixture(scope="module", params=list(MODELS))
def run(request):
    """Eager patched logits and op calls, Inductor-compiled and exported logits and their node counts."""
    kind, dtype = MODELS[request.param]
    model, kw = tiny_model(kind, dtype=dtype), inputs()
    torch._dynamo.reset()
    with lt.patch(model), torch.no_grad():
        eager = model(**kw).logits
        with torch_ops.routed(), torch_ops.op_calls() as calls:
            routed = model(**kw).logits
        backend = Counting(compile_fx)
        with inductor_config.patch(emulate_precision_casts=request.param in EMULATE_CASTS):
            compiled = torch.compile(model, fullgraph=True, backend=backend)(**kw).logits
        program = torch.export.export(model, (), kw)
        exported = program.module()(**kw).logits
    return dict(eager=eager, routed=routed, calls=calls, compiled=compiled, graphs=backend.graphs,
                exported=exported, exported_nodes=lockstep_nodes(program.graph), kind=kind, dtype=dtype)


def test_compiled_patched_model_gives_the_eager_patched_bits(run):
    assert same_bits(run["routed"], run["eager"])  # the torch ops are the eager path's bits
    assert same_bits(run["compiled"], run["eager"])


def test_the_compiled_graph_holds_every_lockstep_call_of_the_eager_forward(run):
    if run["kind"] in GDN_KINDS:  # the GatedDeltaNet layer's packing, conv and rule are one op, its gates another
        assert run["calls"]["hf_attention"] == 1 and run["calls"]["hf_gated_delta_net"] == 1
        assert run["calls"]["gdn_gating"] == 1
    else:
        assert run["calls"]["hf_attention"] == 2  # one per layer: the attention is in the count
    assert len(run["graphs"]) == 1 and run["graphs"][0] == sum(run["calls"].values())


def test_exported_program_holds_the_lockstep_ops_and_gives_the_eager_patched_bits(run):
    assert run["exported_nodes"] == sum(run["calls"].values())
    assert same_bits(run["exported"], run["eager"])


def test_negative_control_the_unpatched_compiled_model_has_no_lockstep_op_and_other_bits(run):
    stock = tiny_model(run["kind"], dtype=run["dtype"], attn_implementation="sdpa")  # same weights, stock kernels
    backend = Counting(lambda gm, example_inputs: gm.forward)
    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(stock, fullgraph=True, backend=backend)(**inputs()).logits
    assert backend.graphs == [0]
    assert not same_bits(logits, run["eager"])


def test_a_kv_cache_under_compile_is_refused_naming_the_feature():
    model = tiny_model("llama")
    torch._dynamo.reset()
    # Dynamo re-raises the error its trace met wrapped in its own type: the message is lockstep's
    with lt.patch(model), torch.no_grad(), pytest.raises(Exception, match="KV cache .* under torch.compile"):
        torch.compile(model, fullgraph=True, backend="eager")(**{**inputs(), "use_cache": True})


def test_a_cached_gated_delta_net_under_compile_is_refused_naming_the_feature():
    model = tiny_model("qwen3_5")
    torch._dynamo.reset()
    with lt.patch(model), torch.no_grad(), pytest.raises(Exception, match="cached GatedDeltaNet forward under torch"):
        torch.compile(model, fullgraph=True, backend="eager")(**{**inputs(), "use_cache": True})
