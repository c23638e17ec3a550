"""The package's layering, read from the source with ``ast`` (every static import, function-level ones too:
that is where import circles hide), and the backend contract's single homes.

Layers (docs/architecture.md):

* foundation: hal.spec, hal.errors, hal.validate, hal.backend, hal.dispatch, hal.ops_registry, hal.fp_env, hal.kernel_threads and the shared
  semantics below the ops, hal.kernels.layout: importable by everyone;
* public op modules: the ``hal`` package and the modules users call (hal.ops, hal.attention, ...): they
  validate and reach a backend through dispatch;
* implementations: hal.backends.*, hal.kernels.*, hal.jax.* (the JAX kernels behind backends/jax.py).

Rules: no import circles; implementations never import a public op module; public op modules reach no
implementation except through dispatch (a short, commented allow-list names what cannot hold yet); no module
outside hal.integrations imports or names (in a string: a module path) an integration -- the core knows none.
Each checker is run on a synthetic graph that breaks its rule, so a checker that cannot fail fails here.
"""
from __future__ import annotations

import ast
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: source folder -> the package it is installed as (pyproject's package-dir)
PACKAGES = {"hal": "hal", "kernels": "hal.kernels", "backends": "hal.backends", "conformance": "hal.conformance"}

FOUNDATION = {"hal.spec", "hal.errors", "hal.validate", "hal.deprecation",
              "hal.backend", "hal.dispatch", "hal.ops_registry", "hal.backend_contract",
              "hal.fp_env", "hal.kernel_threads", "hal.weight_watch", "hal.kernels.layout"}
IMPLEMENTATION = ("hal.backends", "hal.kernels", "hal.jax")
#: front ends and harnesses that are neither ops nor implementations: the CLI and the conformance suite
#: (which runs backends directly and compares them with the oracles)
OUTSIDE = ("hal.cli", "hal.conformance")

#: Public op module -> implementation module it still imports, and why the rule cannot hold there yet.
OP_TO_KERNEL_ALLOWED = {
    # The exact policy's prepared weight (hal.ExactWeight, returned by hal.exact_weight) and its slicing
    # arithmetic are one object shared by the op, the HF integration and the exact all-reduce; moving it
    # to the foundation is the exact-matmul area's change.
    ("hal.ops", "hal.kernels.exact.core"), ("hal.ops", "hal.kernels.exact.prepared"),
    ("hal.integrations.transformers.matmul", "hal.kernels.exact.core"),
    ("hal.integrations.transformers.matmul", "hal.kernels.exact.prepared"),
    ("hal.distributed", "hal.kernels.exact.core"), ("hal.distributed", "hal.kernels.exact.cpu"),
    # Backward passes that are not specs: autograd through the float64/float32 oracle formulas
    # (gdn_gating, gdn_causal_conv1d, the GDN backward) and the strict rotary table the op's input check
    # bounds angles with, plus rotary's pair split for its backward.
    ("hal.gdn_layer", "hal.kernels.oracle.gated_delta_rule"),
    ("hal.gdn_backward", "hal.kernels.oracle.gated_delta_rule"),
    ("hal.elementwise", "hal.kernels.reference.elementwise"),
}

INTEGRATIONS = "hal.integrations"
# ------------------------------------------------------------------ the graph


def modules(root: str = ROOT, packages: dict = PACKAGES) -> dict[str, tuple[str, bool]]:
    """module name -> (file, is a package's __init__) for every .py file of the packages."""
    out = {}
    for folder, pkg in packages.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if not f.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                is_pkg = parts[-1] == "__init__"
                name = ".".join([pkg] + (parts[:-1] if is_pkg else parts))
                out[name] = (os.path.join(dirpath, f), is_pkg)
    return out


def _known(name: str, mods) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(mods) -> dict[str, set[str]]:
    """module -> the modules of ours it imports anywhere in its source (module level or inside functions).

    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module, else ``pkg``. A
    submodule's implicit import of its parent packages is not counted (every module would reach hal/__init__).
    """
    graph = {}
    for name, (path, is_pkg) in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        package = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(_known(a.name, mods) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module
                for a in node.names:
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else _known(base, mods))
        targets.discard(None)
        targets.discard(name)  # a package naming its own submodules' attributes is no edge
        graph[name] = targets
    return graph


def named_modules(mods) -> dict[str, set[str]]:
    """module -> the modules of ours its code names in a string (``"hal.x.y"`` or ``"hal.x.y:attr"``, as an
    op table resolves by path); docstrings are prose and do not count."""
    out = {}
    for name, (path, _) in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        prose = {id(n.body[0].value) for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                 and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                for word in re.findall(r"hal(?:\.\w+)+", node.value):
                    targets.add(_known(word, mods))
        targets.discard(None)
        targets.discard(name)
        out[name] = targets
    return out


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def role(name: str) -> str:
    if name in FOUNDATION:
        return "foundation"
    if _in(name, IMPLEMENTATION):
        return "implementation"
    if _in(name, OUTSIDE):
        return "outside"
    return "op"


# ------------------------------------------------------------------ the checkers


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def implementation_imports_op(graph) -> list[tuple[str, str]]:
    """(implementation module, public op module it imports): kernels and backends never import an op module."""
    return sorted((m, t) for m, ts in graph.items() if role(m) == "implementation" for t in ts if role(t) == "op")


def op_imports_implementation(graph, allowed=frozenset()) -> list[tuple[str, str]]:
    """(public op module, implementation module it imports, not allow-listed): ops reach kernels via dispatch."""
    return sorted((m, t) for m, ts in graph.items() if role(m) == "op" for t in ts
                  if role(t) == "implementation" and (m, t) not in allowed)


def core_reaches_integration(graph, named, allowed=frozenset()) -> list[tuple[str, str]]:
    """(module outside hal.integrations, integration module it imports or names, not allow-listed)."""
    return sorted({(m, t) for edges in (graph, named) for m, ts in edges.items() if not _in(m, (INTEGRATIONS,))
                   for t in ts if _in(t, (INTEGRATIONS,)) and t != INTEGRATIONS and (m, t) not in allowed})


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


@pytest.fixture(scope="module")
def named():
    return named_modules(modules())


# ------------------------------------------------------------------ the rules on the package


def test_the_graph_sees_function_level_imports(graph):
    # KVCache.attend imports hal.attention inside the method; the reference backend imports its kernels inside
    # its methods: a graph of module-level imports only would miss both (and the circles they made).
    assert "hal.attention" in graph["hal.kv_cache"]
    assert "hal.kernels.reference.attention" in graph["hal.backends.reference"]
    assert "hal.kernels.layout" in graph["hal.kernels.cpu.attention"]


def test_no_import_circles(graph):
    assert cycles(graph) == []


def test_kernels_and_backends_never_import_a_public_op_module(graph):
    assert implementation_imports_op(graph) == []


def test_public_op_modules_reach_kernels_only_through_dispatch(graph):
    assert op_imports_implementation(graph, OP_TO_KERNEL_ALLOWED) == []


def test_the_allow_list_holds_only_edges_that_exist(graph):
    # a stale entry would let a future import through unseen
    stale = sorted((m, t) for m, t in OP_TO_KERNEL_ALLOWED if t not in graph.get(m, ()))
    assert stale == []


def test_the_core_never_reaches_an_integration(graph, named):
    # no exception: the integrations register their own torch ops (hal.torch_ops.register), the core names none
    assert core_reaches_integration(graph, named) == []
    # the serving core and the sampling module, which engine shims build on, reach no integration at all
    assert not [t for m in ("hal.serving", "hal.sampling") for t in graph[m] | named[m] if _in(t, (INTEGRATIONS,))]


def registrar_reaches_an_op(graph) -> list[str]:
    """The modules of ours the registrar (hal.torch_ops) imports that are not foundation: it knows no op's internals,
    every op hands it its record."""
    return sorted(t for t in graph.get("hal.torch_ops", ()) if role(t) != "foundation")


def test_the_registrar_knows_no_op(graph, named):
    assert registrar_reaches_an_op(graph) == [] and registrar_reaches_an_op(named) == []  # no import, no path string
    # negative control: the old registrar's reach into the op modules (the autograd table's Functions, the
    # attention backward's _VarlenFn, the GDN kernels by string, hf_attention's backward) is caught
    old = {"hal.torch_ops": {"hal.ops_registry", "hal.ops", "hal.elementwise", "hal.attention", "hal.gated_delta_rule",
                             "hal.integrations.transformers.attention"}}
    assert registrar_reaches_an_op(old) == ["hal.attention", "hal.elementwise", "hal.gated_delta_rule",
                                            "hal.integrations.transformers.attention", "hal.ops"]


# ------------------------------------------------------------------ negative controls for the checkers


def test_checkers_catch_synthetic_violations():
    circle = {"hal.attention": {"hal.kv_cache"}, "hal.kv_cache": {"hal.attention"}, "hal.spec": set()}
    assert cycles(circle) == [["hal.attention", "hal.kv_cache"]]
    long_circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(long_circle) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

    kernel_uses_op = {"hal.kernels.cpu.attention": {"hal.attention", "hal.kernels.layout"}}
    assert implementation_imports_op(kernel_uses_op) == [("hal.kernels.cpu.attention", "hal.attention")]
    backend_uses_package = {"hal.backends.stock": {"hal"}}
    assert implementation_imports_op(backend_uses_package) == [("hal.backends.stock", "hal")]

    op_uses_kernel = {"hal.gated_delta_rule": {"hal.kernels.reference.gated_delta_rule", "hal.kernels.layout"}}
    assert op_imports_implementation(op_uses_kernel) == [("hal.gated_delta_rule",
                                                          "hal.kernels.reference.gated_delta_rule")]


def test_core_to_integration_checker_catches_synthetic_edges(tmp_path):
    up = {"hal.serving": {"hal.kernels.layout", "hal.integrations.transformers.engine"}, "hal.integrations.transformers.engine": {"hal.serving"}}
    assert core_reaches_integration(up, {}) == [("hal.serving", "hal.integrations.transformers.engine")]
    assert core_reaches_integration({}, {"hal.backends.cpu": {"hal.integrations.vllm"}}) == [
        ("hal.backends.cpu", "hal.integrations.vllm")]
    assert core_reaches_integration(up, {}, {("hal.serving", "hal.integrations.transformers.engine")}) == []
    # a real source tree: a function-level import and an op-table-style path string are caught, a docstring
    # naming the integration is not, and integration -> core edges are the normal direction
    for folder in ("hal", "hal/integrations", "kernels"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "hal" / "integrations" / "hf_engine.py").write_text("from ..serving import paged_attention\n")
    (tmp_path / "hal" / "serving.py").write_text(
        '"""Used by hal.integrations.hf_engine (prose)."""\ndef f():\n    from .integrations import hf_engine\n')
    (tmp_path / "hal" / "ops_registry.py").write_text('ROW = ("hal.integrations.hf_engine:hf_paged_attention",)\n')
    (tmp_path / "kernels" / "layout.py").write_text('def g():\n    """See hal.integrations.hf_engine."""\n')
    mods = modules(str(tmp_path), {"hal": "hal", "kernels": "hal.kernels"})
    assert core_reaches_integration(import_graph(mods), named_modules(mods)) == [
        ("hal.ops_registry", "hal.integrations.hf_engine"), ("hal.serving", "hal.integrations.hf_engine")]


def test_a_module_importing_an_op_module_inside_a_function_is_flagged(tmp_path):
    # a real source tree, parsed as the package is: the old circle (hal.attention <-> hal.kv_cache, one side
    # a function-level import) and a kernel that reaches into an op module
    (tmp_path / "hal").mkdir()
    (tmp_path / "kernels").mkdir()
    (tmp_path / "hal" / "__init__.py").write_text("")
    (tmp_path / "hal" / "attention.py").write_text("from .kv_cache import gather_kv\n")
    (tmp_path / "hal" / "kv_cache.py").write_text("def attend():\n    from .attention import plan\n")
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "attention.py").write_text("def f():\n    from hal.attention import key_visibility\n")
    g = import_graph(modules(str(tmp_path), {"hal": "hal", "kernels": "hal.kernels"}))
    assert cycles(g) == [["hal.attention", "hal.kv_cache"]]
    assert implementation_imports_op(g) == [("hal.kernels.attention", "hal.attention")]


# ------------------------------------------------------------------ the backend contract's single homes


def _sources(folder: str) -> dict[str, str]:
    base = os.path.join(ROOT, folder)
    return {f: open(os.path.join(base, f), encoding="utf-8").read() for f in sorted(os.listdir(base))
            if f.endswith(".py")}


def test_float64_oracle_branch_is_written_once():
    """No backend writes `if x.dtype == F64: return oracle...` per op: backends/float64.py routes them all."""
    offenders = []
    for name, src in _sources("backends").items():
        if name == "float64.py":
            continue
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Name) and c.id == "F64"
                                                      for c in [node.left, *node.comparators]):
                offenders.append(f"backends/{name}:{node.lineno}")
    assert offenders == []


def test_claimed_suites_are_listed_once():
    """The conformance suites a backend claims come from the ops it implements (Backend.suites), never a
    per-backend list."""
    listed = []
    for name, src in _sources("backends").items():
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    ident = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
                    if "famil" in ident.lower() or "suite" in ident.lower():
                        listed.append(f"backends/{name}:{node.lineno} {ident}")
    assert listed == []


def test_conformance_suites_table_matches_the_suites():
    from hal.backend import CONFORMANCE_SUITES
    from hal.conformance import suites
    assert sorted(CONFORMANCE_SUITES) == sorted(suites.names())
    for name, (ops, policies) in CONFORMANCE_SUITES.items():
        suite = suites.get(name)
        assert tuple(suite.ops) == ops, name
        assert {p for c in suite.quick_cases() for p in c.spec.policies_used()} == set(policies), name


def test_suites_follow_from_the_ops_a_backend_implements():
    import hal
    from hal.backend import Backend, CONFORMANCE_SUITES
    from hal.spec import EXACT, STRICT

    ref = hal.get_backend("reference")
    assert ref.suites == {s for s, (_, p) in CONFORMANCE_SUITES.items() if set(p) <= {STRICT, EXACT}}
    assert "matmul_fast" not in ref.suites and {"matmul_exact", "token_logprobs_exact"} <= ref.suites

    class NoConv(type(ref)):  # one op of gdn_layer missing: the suite is not served, the others are
        gdn_causal_conv1d = None
    assert NoConv().suites == ref.suites - {"gdn_layer"}
    assert NoConv().claimed_levels("gdn_layer", hal.spec.DEFAULTS["gated_delta_rule"]) == frozenset()
    assert Backend().suites == frozenset()
    assert hal.get_backend("stock").claimed_levels("matmul", hal.spec.DEFAULTS["matmul"]) == frozenset()


def test_triton_versions_have_one_home():
    """MIN_INTERPRETER / MIN_TRITON and the version parse live in kernels/triton/versions.py only."""
    from hal.kernels.triton import versions
    assert versions.parse_version("3.9.0rc1") == (3, 9) and versions.parse_version("3") == (3, 0)
    assert versions.interpreter_too_old((3, 8)) and versions.interpreter_too_old((3, 9)) is None
    defined = []
    for folder in ("backends", "kernels/triton"):
        for name, src in _sources(folder).items():
            if name == "versions.py":
                continue
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.startswith("MIN_")
                                                        and t.id in ("MIN_TRITON", "MIN_INTERPRETER")
                                                        for t in node.targets):
                    defined.append(f"{folder}/{name}:{node.lineno}")
                if isinstance(node, ast.FunctionDef) and node.name in ("_version", "installed_triton",
                                                                        "interpreting", "_interpreting"):
                    defined.append(f"{folder}/{name}:{node.lineno} def {node.name}")
    assert defined == []


# ------------------------------------------------------------------ float64 routing: real calls, raw bits


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64)


def _chain(fn):
    """fn and every function it wraps (functools.wraps' __wrapped__), outermost first."""
    out = [fn]
    while hasattr(out[-1], "__wrapped__"):
        out.append(out[-1].__wrapped__)
    return out


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_float64_calls_run_the_oracle(backend):
    import hal
    from hal.kernels import oracle
    why = hal.get_backend(backend).unavailable_reason()
    if why:
        pytest.skip(why)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64)
    assert torch.equal(_bits(hal.linear(x, w, backend=backend)), _bits(oracle.linear(x, w)))
    assert torch.equal(_bits(hal.softmax(x, backend=backend)), _bits(oracle.softmax(x)))


def test_float64_check_catches_an_unrouted_backend():
    # negative control: the reference's own linear without the routing (its innermost function, reached from
    # outside), given the float64 call, computes the float32 spec's bits, not the oracle's
    import hal
    from hal.backends.reference import ReferenceBackend
    from hal.kernels import oracle
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64)
    w = torch.randn(5, 7, generator=g, dtype=torch.float64)
    bare = _chain(ReferenceBackend.linear)[-1]
    got = bare(hal.get_backend("reference"), x, w, None, hal.spec.DEFAULTS["matmul"])
    assert not torch.equal(_bits(got.to(torch.float64)), _bits(oracle.linear(x, w)))


def test_float64_routing_covers_every_op_the_oracle_has():
    from hal.backends import float64
    from hal.backends.cpu import CpuBackend
    from hal.backends.reference import ReferenceBackend
    from hal.ops_registry import OPS
    routed_code = float64._routed(lambda: None, lambda: None).__code__
    oracle_ops = {op for op in OPS if callable(getattr(float64.ORACLE, op, None))}
    assert oracle_ops == set(OPS) - {"rotary_cos_sin"}  # the rotary table is float32 whatever the inputs
    for cls in (ReferenceBackend, CpuBackend):
        for op in OPS:
            routed = any(f.__code__ is routed_code for f in _chain(getattr(cls, op)))
            assert routed == (op in oracle_ops), (cls.__name__, op)
