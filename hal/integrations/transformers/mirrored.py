"""What lockstep mirrors of transformers, and the check that an installed release still has it unchanged.

The per-instance forwards (modules.py), the engine's forward step (engine.py) and the wrapped engine entry points
(engine_install.py) re-implement or hook transformers functions of the releases they were tested with. Another
release may change one of them (a new kwarg, another op order) and lockstep would compute other bits without a
word. So each function in :data:`MIRRORED` is hashed from the installed release's source (:func:`source_hash`:
read from its file, never imported: seconds for all of them) and must equal that function's hash in a release CI
tests (``mirrored_table.TABLE``); a differing one is refused by name (:func:`check_sources`). The model code is
checked at ``lt.register`` / ``lt.patch``; the continuous-batching engine's functions when a lockstep model's engine
is built (engine_install.py), so a release whose engine was not tested still patches models.

Regenerate the table after installing each release of the supported range in its own environment::

    python -m hal.integrations.transformers.mirrored --dump > /tmp/5.25.json   # in each release's environment
    python -m hal.integrations.transformers.mirrored --write /tmp/5.*.json     # writes mirrored_table.py
        [--tested-model 5.17,5.18,5.19,5.21,5.23,5.24,5.25 --tested-engine 5.17,5.18,5.19,5.24,5.25]

(``--dump`` reads only the transformers sources, so a ``pip install --no-deps transformers==5.N.*`` venv is
enough.) See docs/integrations.md.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from functools import lru_cache

from ...errors import UnsupportedError

# model class prefix -> its folder under transformers/models
_MODEL_DIRS = {"Llama": "llama", "Qwen2": "qwen2", "Qwen3": "qwen3", "Mistral": "mistral", "Qwen3Next": "qwen3_next",
               "Qwen3_5": "qwen3_5", "Qwen3_5Moe": "qwen3_5_moe"}
_MIRRORED_CLASSES = (  # the classes whose forward modules.py mirrors (the sets in __init__.py, by model)
    [f"{p}{c}" for p in ("Llama", "Qwen2", "Qwen3", "Mistral") for c in ("RMSNorm", "Attention", "MLP",
                                                                         "RotaryEmbedding")]
    + [f"Qwen3Next{c}" for c in ("RMSNorm", "RMSNormGated", "Attention", "MLP", "RotaryEmbedding", "GatedDeltaNet",
                                 "SparseMoeBlock", "TopKRouter", "Experts")]
    + [f"Qwen3_5{c}" for c in ("RMSNorm", "RMSNormGated", "Attention", "MLP", "TextRotaryEmbedding", "GatedDeltaNet")]
    + [f"Qwen3_5Moe{c}" for c in ("RMSNorm", "RMSNormGated", "Attention", "MLP", "TextRotaryEmbedding",
                                  "GatedDeltaNet", "SparseMoeBlock", "TopKRouter", "Experts")])
_CB = "generation/continuous_batching"


def _model_file(cls: str) -> str:
    prefix = max((p for p in _MODEL_DIRS if cls.startswith(p)), key=len)
    d = _MODEL_DIRS[prefix]
    return f"models/{d}/modeling_{d}.py"


#: the engine functions lockstep hooks that only releases older than the newest define: 5.17's fork and the block
#: manager's reclaim path its prefix eviction calls (engine.py); "missing" on the later releases
OLDER_ONLY = (f"{_CB}/cache.py:PagedAttentionCache.fork_request",
              f"{_CB}/cache_manager.py:BlockManager.has_enough_free_blocks")

#: "file under transformers/:qualified name" of every function lockstep mirrors (re-implements) or whose contract
#: its hooks rely on: the mirrored classes' forwards; the rotary classes' inv_freq (lockstep's rotary and the vLLM
#: shim read that buffer); each model's decoder layer (how it calls them, and the GDN
#: position hook); the mask builder lockstep's mask function calls; the engine's forward step (mirrored by
#: engine._LockstepStep) and the entry points engine_install.py and engine.attach wrap.
MIRRORED = tuple(
    [f"{_model_file(c)}:{c}.forward" for c in _MIRRORED_CLASSES]
    + [f"{_model_file(c)}:{c}.compute_default_rope_parameters" for c in _MIRRORED_CLASSES if "RotaryEmbedding" in c]
    + ["models/qwen3_next/modeling_qwen3_next.py:Qwen3NextGatedDeltaNet.fix_query_key_value_ordering"]
    + [f"{_model_file(p)}:{p}DecoderLayer.forward" for p in _MODEL_DIRS]
    + ["masking_utils.py:sdpa_mask"]
    + [f"{_CB}/model_runner.py:ModelRunner._forward_process_and_sample"]
    + [f"{_CB}/continuous_api.py:ContinuousBatchingManager.{m}"
       for m in ("__init__", "switch_to_cb_friendly_attn", "_create_batch_processor", "add_request")]
    + [f"{_CB}/continuous_api.py:ContinuousBatchProcessor.{m}" for m in ("prepare_next_batch", "update_batch")]
    + [f"{_CB}/initialization.py:ensure_decode_fast_path_is_available",
       f"{_CB}/cache.py:group_layers_by_attn_type",
       f"{_CB}/cache.py:PagedAttentionCache.update", f"{_CB}/cache.py:PagedAttentionCache.prepare_fork_request",
       f"{_CB}/input_outputs.py:ContinuousBatchingIOs.carry_over_tokens",
       f"{_CB}/offloading_manager.py:OffloadingManager.offload_requests",
       # what engine.py uses where a release lacks the above: 5.18's decode page views, the prefix eviction
       f"{_CB}/cache.py:PagedAttentionCache.get_cache_for_block_table",
       f"{_CB}/cache.py:PagedAttentionCache.evict_cached_blocks"]
    + list(OLDER_ONLY))

MISSING = "missing"  # the hash of a function the installed release does not define
PARTS = ("model", "engine")  # checked apart: a release's model code may be tested while its engine is not


def part_of(name: str) -> str:
    """"engine" for the continuous-batching engine's functions (checked when a lockstep model's engine is built),
    "model" for the rest (checked at lt.register / lt.patch)."""
    return "engine" if name.startswith(_CB + "/") else "model"


def _find(tree: ast.Module, qualname: str):
    """The def node of ``qualname`` ("Class.method" or "function") in a module; None when absent. A module-level
    alias (``sdpa_mask = sdpa_mask_recent_torch``) is followed."""
    scope, node = tree.body, None
    for part in qualname.split("."):
        node = None
        for stmt in scope:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == part:
                node = stmt
            elif (scope is tree.body and isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name)
                  and any(isinstance(t, ast.Name) and t.id == part for t in stmt.targets)):
                node = _find(tree, stmt.value.id)  # an alias of another top-level def
        if node is None:
            return None
        scope = getattr(node, "body", [])
    return node


def normalised_source(text: str, qualname: str, tree: ast.Module | None = None) -> str | None:
    """The source of ``qualname``'s def in module source ``text`` without its docstring, comment-only lines, blank
    lines and trailing spaces, dedented to the ``def`` (decorators excluded: a per-instance forward replaces the
    decorated method). Plain text, so the same on every Python version. None when the module has no such def."""
    node = _find(tree if tree is not None else ast.parse(text), qualname)
    if node is None:
        return None
    lines = text.splitlines()
    skip = set()
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
    kept = []
    for n in range(node.lineno, node.end_lineno + 1):
        line = lines[n - 1].rstrip()
        if n in skip or not line.strip() or line.lstrip().startswith("#"):
            continue
        kept.append(line[indent:] if line[:indent].isspace() or not line[:indent] else line)
    return "\n".join(kept) + "\n"


def source_hash(text: str, qualname: str, tree: ast.Module | None = None) -> str:
    """sha256 (first 16 hex digits) of :func:`normalised_source`; :data:`MISSING` when the def is absent.
    ``tree``: ``ast.parse(text)`` when the caller has it (one parse per file)."""
    src = normalised_source(text, qualname, tree)
    return MISSING if src is None else hashlib.sha256(src.encode()).hexdigest()[:16]


def transformers_dir() -> str:
    """The installed transformers package's folder, found without importing it."""
    import importlib.util
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise UnsupportedError("transformers is not installed")
    return os.path.dirname(spec.origin)


def installed_hashes(root: str | None = None) -> dict[str, str]:
    """``{name: hash}`` of every :data:`MIRRORED` function in the transformers sources under ``root``."""
    root = root or transformers_dir()
    files: dict[str, tuple | None] = {}  # path -> (text, its parse), None when the release has no such file
    out = {}
    for name in MIRRORED:
        path, qualname = name.split(":")
        if path not in files:
            full = os.path.join(root, path)
            text = open(full, encoding="utf-8").read() if os.path.exists(full) else None
            files[path] = None if text is None else (text, ast.parse(text))
        out[name] = MISSING if files[path] is None else source_hash(files[path][0], qualname, files[path][1])
    return out


def differing(hashes: dict[str, str], table: dict, tested: dict, part: str) -> list[str]:
    """The names of ``part`` whose hash in ``hashes`` equals that name's hash in none of the releases
    ``tested[part]`` of ``table`` (``{"5.25": {"hashes": {name: hash}}}``)."""
    return [name for name in MIRRORED if part_of(name) == part
            and hashes.get(name) not in {table[r]["hashes"].get(name) for r in tested[part] if r in table}]


def check_sources(version: str, part: str = "model", hashes: dict[str, str] | None = None, hint: str = "") -> None:
    """Refuse (UnsupportedError, naming the release and each function) an installed transformers whose mirrored
    functions of ``part`` ("model": the forwards; "engine": the continuous-batching engine's) differ from every
    release that part was tested on; ``hashes`` defaults to the installed release's (computed once per process);
    ``hint`` ends the message (what the caller may do)."""
    from .mirrored_table import TABLE, TESTED
    names = differing(hashes if hashes is not None else _installed_hashes_cached(transformers_dir()), TABLE, TESTED,
                      part)
    if names:  # the names follow the message, one a line (UnsupportedError's reasons)
        what = "model code" if part == "model" else "continuous-batching engine"
        raise UnsupportedError(
            f"transformers {version}: {len(names)} function(s) of its {what} that lockstep mirrors differ from their "
            f"source in every release lockstep tested it with ({', '.join(TESTED[part])}); lockstep may compute "
            f"other bits on this release.{hint} Differing:", names)


@lru_cache(maxsize=4)
def _installed_hashes_cached(root: str) -> dict:
    return installed_hashes(root)


def _write_table(dumps: list[str], tested: dict) -> str:
    rows = [json.load(open(p)) for p in dumps]
    rows.sort(key=lambda r: tuple(int(x) for x in r["version"].split(".")[:2]))
    table = {".".join(r["version"].split(".")[:2]): {"version": r["version"], "hashes": r["hashes"]} for r in rows}
    missing = [t for part in tested.values() for t in part if t not in table]
    if missing:
        raise SystemExit(f"no dump for the tested release(s) {missing}")
    lines = ['"""Generated by ``python -m hal.integrations.transformers.mirrored --write`` (see mirrored.py): the '
             'source hash\nof each function lockstep mirrors, per transformers release. Do not edit by hand."""',
             "", "# per part, the releases the HF integration tests of that part ran on (docs/integrations.md)",
             f"TESTED = {tested!r}", "",
             "TABLE = {"]
    for rel, row in table.items():
        lines.append(f"    {rel!r}: {{\"version\": {row['version']!r}, \"hashes\": {{")
        lines += [f"        {k!r}: {v!r}," for k, v in sorted(row["hashes"].items())]
        lines.append("    }},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m hal.integrations.transformers.mirrored", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", action="store_true", help="print the installed release's hashes as JSON")
    ap.add_argument("--root", help="a transformers package folder to read instead of the installed one")
    ap.add_argument("--write", nargs="+", metavar="DUMP", help="write mirrored_table.py from --dump outputs")
    ap.add_argument("--tested-model", default="5.17,5.18,5.19,5.21,5.23,5.24,5.25",
                    help="the releases the model code was tested on")
    ap.add_argument("--tested-engine", default="5.17,5.18,5.19,5.24,5.25", help="the releases the engine was tested on")
    args = ap.parse_args(argv)
    if args.dump:
        root = args.root or transformers_dir()
        print(json.dumps({"version": _version_of(root), "hashes": installed_hashes(root)}, indent=1))
        return 0
    if args.write:
        tested = {"model": tuple(t.strip() for t in args.tested_model.split(",")),
                  "engine": tuple(t.strip() for t in args.tested_engine.split(","))}
        text = _write_table(args.write, tested)
        out = os.path.join(os.path.dirname(__file__), "mirrored_table.py")
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    ap.print_help()
    return 2


def _version_of(root: str) -> str:
    """``__version__`` of the transformers package under ``root``, read from its ``__init__.py``."""
    for line in open(os.path.join(root, "__init__.py"), encoding="utf-8"):
        if line.startswith("__version__"):
            return ast.literal_eval(line.split("=", 1)[1].strip())
    raise SystemExit(f"no __version__ in {root}/__init__.py")


if __name__ == "__main__":
    sys.exit(main())
