"""Packaging (issue 7, section 3): lockstep installs exactly one top-level import name, `hal`, ships
the golden files, and coexists with another distribution named `kernels` (Hugging Face's, say).

Builds run offline (`--no-deps --no-build-isolation`) from a copy of the repository, so the
checkout gets no build/ or egg-info folders. About 15-30 s on two cores.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--no-cache-dir"]
SOURCES = ["pyproject.toml", "README.md", "hal", "backends", "kernels", "conformance"]


def _pip(*args, cwd=None):
    r = subprocess.run([*PIP, *args], capture_output=True, text=True, cwd=cwd, timeout=300,
                       env={**os.environ, "PIP_NO_INDEX": "1"})  # never the network
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """A wheel of lockstep built from a copy of this checkout."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        else:
            shutil.copy2(p, src / name)
    out = tmp / "wheels"
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src))
    (whl,) = out.glob("lockstep-*.whl")
    return whl


def test_wheel_has_one_top_level_package_and_the_goldens(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"hal"}, top
    for sub in ("hal/backends/reference.py", "hal/kernels/reference/strict_math.py", "hal/kernels/oracle/__init__.py",
                "hal/conformance/runner.py", "hal/conformance/suites/__init__.py",
                "hal/conformance/families/__init__.py"):  # families: the deprecated alias package
        assert sub in names, sub
    # every golden file of the checkout is in the wheel, at hal/conformance/golden/...
    golden = ROOT / "conformance" / "golden"
    want = {"hal/conformance/golden/" + p.relative_to(golden).as_posix() for p in golden.rglob("*") if p.is_file()}
    assert want and any(w.endswith("manifest.json") for w in want)
    missing = sorted(want - set(names))
    assert not missing, missing[:5]
    # the verification tools (kernels/checks: lints, machine-code profile) run from a checkout, never ship
    assert (ROOT / "kernels" / "checks" / "lint.py").is_file()
    shipped_tools = [n for n in names if n.startswith("hal/kernels/checks/")]
    assert not shipped_tools, shipped_tools
    # the dist-info declares exactly one top-level name too
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["hal"]


def _throwaway_kernels(tmp: pathlib.Path) -> pathlib.Path:
    d = tmp / "kernels_dist"
    (d / "kernels").mkdir(parents=True)
    (d / "kernels" / "__init__.py").write_text('WHO = "the other kernels distribution"\n')
    (d / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "kernels"\nversion = "0.0.1"\n[tool.setuptools]\npackages = ["kernels"]\n')
    return d


def test_another_kernels_distribution_coexists_with_lockstep(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--no-build-isolation", "--target", str(target), str(wheel))
    _pip("install", "--no-deps", "--no-build-isolation", "--target", str(target), str(_throwaway_kernels(tmp_path)))
    code = (
        "import kernels, hal, hal.kernels.reference, hal.kernels.reference.strict_math as sm\n"
        "import hal.backends.reference, hal.conformance.golden as g\n"
        "print(kernels.WHO)\n"
        "print(hal.__file__)\nprint(hal.kernels.reference.__file__)\nprint(g.ROOT)\n"
        "import torch\n"
        "print(hal.matmul(torch.ones(2, 3), torch.ones(3, 2), backend='reference').sum().item())\n")
    # PYTHONPATH is the target only, and the working directory is not the checkout: the installed copies
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCKSTEP_GOLDEN_DIR")}
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    who, hal_file, ref_file, golden_root, total = r.stdout.split("\n")[:5]
    assert who == "the other kernels distribution"
    for f in (hal_file, ref_file, golden_root):
        assert f.startswith(str(target)), f
    assert (pathlib.Path(golden_root) / "softmax" / "manifest.json").is_file()
    assert float(total) == 12.0


def test_a_clones_root_does_not_shadow_another_kernels_distribution(tmp_path):
    """Python run from the clone's root has the repository's kernels/ folder on its path ahead of site-packages;
    ``import kernels`` there must be the other distribution when one is installed (transformers >= 5.25 imports
    Hugging Face's), not lockstep's folder (issue 51)."""
    other = _throwaway_kernels(tmp_path)
    code = "import kernels; print(kernels.WHO, kernels.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**env, "PYTHONPATH": str(other)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("the other kernels distribution " + str(other)), r.stdout
    r = subprocess.run([sys.executable, "-S", "-c", "import kernels; print(kernels.__file__, hasattr(kernels, "
                        "'__version__'))"], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    # -S: no site-packages, so no other kernels anywhere: the folder stays, with no version (transformers' check:
    # not installed)
    assert r.returncode == 0 and r.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "False"], r.stderr


def test_qwen3_next_reference_checks_do_not_need_transformers():
    """With transformers unimportable, the Qwen3-Next test module still collects (and runs) the checks
    of lockstep's own pieces; only the checks against transformers skip."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rs', "
        "'tests/test_gated_delta_rule_qwen3_next.py', '-k', 'gating_is_per_token or agrees_with']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "1 passed" in out, out  # the reference's own check ran
    assert "5 skipped" in out and "transformers" in out, out  # the 5 checks against transformers skipped
