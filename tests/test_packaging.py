"""A pip-only user can compile: the sdist, and the wheel built from it, carry naga's wasm and the
shipped SPIR-V; installed into a fresh virtual environment that sees neither this checkout nor
any node_modules, the README's example and `python -m vkml demo --epochs 1` run.

How the fresh environment gets vkml's dependencies without downloading anything: a directory of
symlinks to exactly the distributions vkml declares (and theirs, recursively), taken from this
test's own environment, put on the new venv's path by a .pth file. Not `--system-site-packages`
(it would show the base interpreter's packages, and not this venv's), and not this environment's
site-packages as a whole: that holds the editable vkml's metadata, torch, wgpu and pytest, so an
undeclared dependency would go unnoticed. The symlinked directory holds no .pth files, so the
editable install's finder never runs there; and the test asserts that vkml is imported from the
new venv and that torch is not importable.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
NPM_WASM = REPO / "node_modules" / "naga-wasm" / "dist" / "wasm" / "naga_bg.wasm"
WHEEL_WASM = "vkml/_shipped/naga-wasm/dist/wasm/naga_bg.wasm"
SDIST_WASM = "node_modules/naga-wasm/dist/wasm/naga_bg.wasm"
SHIPPED = sorted(p.name for p in (REPO / "spirv").iterdir())


def run(cmd: list[str | Path], timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess:
    """Run `cmd`, failing the test with its output when it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          **kw)
    assert proc.returncode == 0, (f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                                  f"\n--- stderr\n{proc.stderr}")
    return proc


def distributions_needed(name: str) -> list[importlib.metadata.Distribution]:
    """`name`'s installed requirements, recursively (extras not taken, markers evaluated)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [Requirement(r) for r in importlib.metadata.requires(name) or []]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = canonicalize_name(req.name)
        if key in seen:
            continue
        seen[key] = importlib.metadata.distribution(req.name)
        todo += [Requirement(r) for r in seen[key].requires or []]
    return list(seen.values())


def link_distributions(dists: list[importlib.metadata.Distribution], dest: Path) -> None:
    """Symlink each distribution's top-level files and directories (from its RECORD) into dest."""
    dest.mkdir()
    for dist in dists:
        site = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
        assert tops, f"{dist.metadata['Name']} lists no files: cannot isolate it"
        for top in sorted(tops):
            if top.endswith(".pth") or not (site / top).exists() or (dest / top).exists():
                continue
            (dest / top).symlink_to(site / top)


def child_env(cache: Path) -> dict[str, str]:
    """This environment, minus everything that could lead a child to the checkout's files."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VKML_NAGA_WASM", "VKML_SPIRV_DIR", "VIRTUAL_ENV")}
    return {**env, "VKML_CACHE_DIR": str(cache), "PYTHONNOUSERSITE": "1"}


def build_impossible() -> str | None:
    if not NPM_WASM.is_file() and shutil.which("npm") is None:
        return "neither node_modules' naga wasm nor npm is here: the wheel cannot carry the wasm"
    try:
        from setuptools import __version__ as setuptools_version
    except ImportError:
        return "setuptools is not installed (the test extra has it)"
    if int(setuptools_version.split(".")[0]) < 77:
        return f"setuptools {setuptools_version} < 77 (pyproject's build requirement)"
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(sdist, wheel): the sdist built from the checkout, the wheel built from the sdist."""
    reason = build_impossible()
    if reason:
        print(f"\ntest_packaging skipped: {reason}")
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("packaging")
    run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
         "b.build_sdist(sys.argv[1])", tmp / "sdist"], cwd=REPO)
    (sdist,) = (tmp / "sdist").glob("vkml-*.tar.gz")
    with tarfile.open(sdist) as tar:
        # The "data" filter (refuse links out, absolute paths) where this Python has it.
        tar.extractall(tmp / "src", **({"filter": "data"} if hasattr(tarfile, "data_filter")
                                       else {}))
    (src,) = (tmp / "src").iterdir()
    # No npm on the wheel build's PATH: from an sdist the wheel must not need it.
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", tmp / "dist", src], env=env)
    (wheel,) = (tmp / "dist").glob("vkml-*.whl")
    return sdist, wheel


def test_sdist_carries_wasm_and_spirv(built):
    sdist, _ = built
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        wasm = tar.extractfile(f"{sdist.name.removesuffix('.tar.gz')}/{SDIST_WASM}")
        assert wasm is not None and wasm.read() == NPM_WASM.read_bytes()
    assert {f"spirv/{n}" for n in SHIPPED} <= names
    assert {"package.json", "package-lock.json", "setup.py", "MANIFEST.in"} <= names


def test_wheel_carries_wasm_and_spirv(built):
    _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(WHEEL_WASM) == NPM_WASM.read_bytes()
        spirv = sorted(n.rsplit("/", 1)[1] for n in zf.namelist()
                       if n.startswith("vkml/_shipped/spirv/"))
        assert spirv == SHIPPED, "the wheel's SPIR-V is not exactly spirv/"
        for name in SHIPPED:
            assert zf.read(f"vkml/_shipped/spirv/{name}") == (REPO / "spirv" / name).read_bytes()
        version = json.loads(zf.read("vkml/_shipped/naga-wasm/package.json"))["version"]
        manifest = json.loads(zf.read("vkml/_shipped/spirv/manifest.json"))
        assert version == manifest["naga_wasm"]
        assert "vkml/_shipped/naga-wasm/LICENSE-MIT" in zf.namelist()


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory):
    """(python, workdir): a fresh venv holding the wheel and only vkml's declared dependencies."""
    _, wheel = built
    tmp = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(tmp / "venv")
    python = tmp / "venv" / "bin" / "python"
    # Without PYTHONPATH: a checkout on it (its vkml.egg-info) would pass for an installed vkml.
    env = child_env(tmp / "cache")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
         "--ignore-installed", wheel], env=env)
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                    env=env).stdout.strip())
    link_distributions(distributions_needed("vkml"), tmp / "deps")
    (site / "vkml-test-deps.pth").write_text(f"{tmp / 'deps'}\n")
    work = tmp / "work"
    work.mkdir()
    return python, work


def test_installed_vkml_is_isolated_from_the_checkout(installed):
    python, work = installed
    probe = ("import json, sys, importlib.util, vkml, vkml.vk.naga as n; print(json.dumps({"
             "'vkml': vkml.__file__, 'wasm': str(n.DEFAULT_WASM), 'spirv': str(n.SHIPPED_SPIRV),"
             "'source_tree': n.SOURCE_TREE and str(n.SOURCE_TREE), 'path': sys.path,"
             "'torch': importlib.util.find_spec('torch') is not None}))")
    info = json.loads(run([python, "-c", probe], cwd=work,
                          env=child_env(work / "cache")).stdout)
    venv_dir = python.parent.parent
    package = venv_dir / "lib"
    assert info["vkml"].startswith(str(package)), info["vkml"]
    assert info["wasm"].startswith(str(package)) and info["wasm"].endswith(WHEEL_WASM)
    assert info["spirv"].startswith(str(package)) and info["source_tree"] is None
    assert not info["torch"], "the test venv sees torch: it is not isolated"
    for entry in info["path"]:
        assert "node_modules" not in entry and not entry.startswith(str(REPO)), entry


def test_readme_example_compiles_with_the_wheels_wasm(installed):
    python, work = installed
    readme = (REPO / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", readme, re.S)[0]
    script = work / "readme_example.py"
    script.write_text(code.replace("/tmp/mlp.safetensors", str(work / "mlp.safetensors")))
    cache = work / "readme_cache"
    t0 = time.perf_counter()
    out = run([python, script], cwd=work, env=child_env(cache)).stdout
    print(f"README example in the fresh venv: {time.perf_counter() - t0:.1f} s")
    assert re.search(r"^loss \d", out, re.M), out
    # Its kernels are not shipped: naga's wasm from the wheel compiled them (and was cached).
    assert list((cache / "spirv").glob("*.spv")) and list((cache / "wasm").glob("*.cwasm"))


def test_demo_runs_on_the_wheels_shipped_spirv(installed):
    python, work = installed
    cache = work / "demo_cache"
    t0 = time.perf_counter()
    proc = run([python, "-m", "vkml", "demo", "--epochs", "1", "--out", work / "out"], cwd=work,
               env=child_env(cache))
    print(f"python -m vkml demo --epochs 1 in the fresh venv: {time.perf_counter() - t0:.1f} s")
    assert "test accuracy" in proc.stdout, proc.stdout
    assert (work / "out" / "mlp_shapes.safetensors").is_file()
    # Every demo kernel came from the wheel's spirv/: nothing was translated by naga.
    assert not list(cache.glob("spirv/*.spv")), (
        "demo kernels missing from the wheel's SPIR-V: is spirv/ current? (tests/test_spirv.py)")


def test_missing_wasm_advice_fits_an_installed_vkml(installed, tmp_path):
    python, work = installed
    # A copy of the venv's vkml without its wasm, as a build that failed to carry it would be.
    site = Path(run([python, "-c", "import vkml, os; print(os.path.dirname(vkml.__path__[0]))"],
                    cwd=work, env=child_env(tmp_path)).stdout.strip())
    broken = tmp_path / "site"
    shutil.copytree(site / "vkml", broken / "vkml", symlinks=True)
    (broken / "vkml" / WHEEL_WASM.removeprefix("vkml/")).unlink()
    code = ("import vkml.vk.naga as n\ntry:\n    n.compile_wgsl('@compute @workgroup_size(1) "
            "fn main() {}', 'k')\nexcept vkml.NagaError as e:\n    print(e)\n")
    env = {**child_env(tmp_path / "cache"), "PYTHONPATH": str(broken)}
    message = run([python, "-c", "import vkml\n" + code], cwd=work, env=env).stdout
    assert str(broken / "vkml") in message, message  # the broken copy was the one imported
    assert "naga's wasm file is missing" in message and "--force-reinstall" in message
    assert "VKML_NAGA_WASM" in message and "npm ci" not in message
