"""Golden files: the reference backend's output bits for every conformance case.

Layout, per suite: ``golden/<suite>/manifest.json`` and ``golden/<suite>/<spec_id>/<case>.<output>.bin``
(raw little-endian element bytes). The manifest records, per case, the spec id, the SHA-256 of the
regenerated inputs, and per output its dtype, shape and the SHA-256 of the file. Loading checks
all of them and never unpickles; any mismatch raises :class:`GoldenError` naming the file, the
case and the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from hal.errors import GoldenError

from .suite import Case, Suite
from .inputs import inputs_sha256

FORMAT = "lockstep-golden-1"
ROOT = Path(os.environ.get("LOCKSTEP_GOLDEN_DIR", Path(__file__).parent / "golden"))
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_FIX = "regenerate with `hal conformance generate --ops {suite}` (from a trusted reference build) and review the diff"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def manifest_path(suite: str, root: Path | None = None) -> Path:
    return (root or ROOT) / suite / "manifest.json"


def _case_key(case: Case) -> str:
    return f"{case.spec.id}/{case.id}"


def write(suite: Suite, results: list[tuple[Case, dict, dict]], root: Path | None = None) -> Path:
    """Write the golden files of one suite from (case, inputs, outputs) triples; returns the manifest path."""
    root = root or ROOT
    entries = {}
    for case, inputs, outputs in results:
        outs = {}
        for name, t in outputs.items():
            rel = f"{case.spec.id}/{case.id}.{name}.bin"
            data = _raw(t)
            path = root / suite.name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            outs[name] = {"file": rel, "dtype": _name(t.dtype), "shape": list(t.shape),
                          "sha256": hashlib.sha256(data).hexdigest()}
        entries[_case_key(case)] = {"spec_id": case.spec.id, "case": case.id, "inputs_sha256": inputs_sha256(inputs),
                                    "outputs": outs}
    mpath = manifest_path(suite.name, root)
    mpath.parent.mkdir(parents=True, exist_ok=True)
    # the manifest's key stays "family" (format lockstep-golden-1): the files on disk do not change with the name
    body = {"format": FORMAT, "family": suite.name, "entries": dict(sorted(entries.items()))}
    mpath.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return mpath


_manifests: dict[tuple[str, str], dict] = {}


def _manifest(suite: str, root: Path) -> dict:
    path = manifest_path(suite, root)
    fix = _FIX.format(suite=suite)
    if not path.exists():
        raise GoldenError(f"golden manifest {path} is missing; {fix}")
    raw = path.read_bytes()
    key = (str(path), hashlib.sha256(raw).hexdigest())
    if key not in _manifests:
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise GoldenError(f"golden manifest {path} is not valid JSON ({e}); {fix}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("entries"), dict):
            raise GoldenError(f"golden manifest {path} has an unknown format (want {FORMAT!r}); {fix}")
        _manifests[key] = body
    return _manifests[key]


def load(suite: str, case: Case, inputs: dict, root: Path | None = None,
         outputs=None) -> dict[str, torch.Tensor]:
    """The golden outputs of a case, verified against the manifest.

    ``outputs``: the output names the suite produces for this case (the runner passes the names
    of the run's outputs). The manifest must list exactly those: a manifest that lost an output
    (or lists one the suite does not make) is an error, so L4 can never pass by comparing nothing.
    """
    root = root or ROOT
    fix = _FIX.format(suite=suite)
    entry = _manifest(suite, root)["entries"].get(_case_key(case))
    where = f"case {case.id} (spec {case.spec.id}, suite {suite})"
    if entry is None:
        raise GoldenError(f"no golden for {where} in {manifest_path(suite, root)}; {fix}")
    if entry.get("inputs_sha256") != inputs_sha256(inputs):
        raise GoldenError(f"golden for {where} is stale: its inputs hash differs from the regenerated inputs "
                          f"(the case or the input generator changed); {fix}")
    listed = entry.get("outputs")
    if not isinstance(listed, dict):
        raise GoldenError(f"golden manifest entry for {where} has no outputs table; {fix}")
    if outputs is not None:
        missing = sorted(set(outputs) - set(listed))
        extra = sorted(set(listed) - set(outputs))
        if missing or extra:
            raise GoldenError(f"golden manifest entry for {where} does not match the suite's outputs "
                              f"{sorted(outputs)}: " + "; ".join(
                                  ([f"missing output(s) {missing}"] if missing else []) +
                                  ([f"unknown output(s) {extra}"] if extra else [])) + f"; {fix}")
    out = {}
    for name, meta in listed.items():
        path = root / suite / meta["file"]
        if not path.exists():
            raise GoldenError(f"golden file {path} for {where} is missing; {fix}")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise GoldenError(f"golden file {path} for {where} is corrupt: SHA-256 mismatch with the manifest; "
                              f"restore it from git (`git checkout -- {path}`) or {fix}")
        dtype = _DTYPES.get(meta["dtype"])
        shape = tuple(meta["shape"])
        if dtype is None:
            raise GoldenError(f"golden file {path} for {where} names unknown dtype {meta['dtype']!r}; {fix}")
        n = int(np.prod(shape)) if shape else 1
        if len(data) != n * torch.tensor([], dtype=dtype).element_size():
            raise GoldenError(f"golden file {path} for {where} has {len(data)} bytes, not {shape} x {meta['dtype']}; {fix}")
        t = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape)
    return out
