"""Build hooks: the wheel carries naga's wasm and the shipped SPIR-V, so a pip-only user compiles.

Everything else about the package is declared in pyproject.toml. What is here, and why:
- vkml.compile needs naga's wasm for every kernel not in spirv/; a pip-only user has neither npm
  nor a checkout. So `build_py` copies, into the wheel only (nothing generated lands in the
  source tree or in git):
      node_modules/naga-wasm/{package.json,LICENSE-*,dist/wasm/naga_bg.wasm}
                                              -> vkml/_shipped/naga-wasm/  (npm's layout kept)
      spirv/*.spv, spirv/manifest.json        -> vkml/_shipped/spirv/
  vkml/vk/naga.py looks there first, then in the checkout (editable installs skip the copy).
- npm is a build-time tool only: when node_modules lacks the wasm pinned in package-lock.json,
  the build runs `npm ci` if npm exists, and fails saying what to do otherwise.
- The sdist carries the same node_modules files (MANIFEST.in), so a wheel builds from it with no
  npm; `sdist` makes sure they are there before the file list is taken.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
NPM_PACKAGE = Path("node_modules") / "naga-wasm"
WASM = Path("dist") / "wasm" / "naga_bg.wasm"
SHIPPED = Path("vkml") / "_shipped"  # inside the wheel


def pinned_version() -> str:
    lock = json.loads((ROOT / "package-lock.json").read_text())
    return str(lock["packages"][f"node_modules/{NPM_PACKAGE.name}"]["version"])


def installed_version() -> str | None:
    """The naga-wasm version in node_modules, or None when its wasm is not there."""
    package = ROOT / NPM_PACKAGE
    if not (package / WASM).is_file():
        return None
    return str(json.loads((package / "package.json").read_text())["version"])


def ensure_wasm() -> None:
    """node_modules holds the pinned naga-wasm, running `npm ci` if needed and possible."""
    want, have = pinned_version(), installed_version()
    if have == want:
        return
    found = f"naga-wasm {have}" if have else "no naga wasm"
    npm = shutil.which("npm")
    if npm is None:
        raise SetupError(
            f"vkml's wheel must carry naga's wasm (npm package naga-wasm {want}, pinned in "
            f"package-lock.json), but {ROOT / NPM_PACKAGE} holds {found} and npm is not "
            f"installed. Install npm (Debian: apt-get install npm) and build again (the build "
            f"runs `npm ci`), or run `npm ci` in {ROOT} yourself first.")
    print(f"vkml build: {found} in node_modules; running npm ci for naga-wasm {want}")
    subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=ROOT,
                   check=True)
    if installed_version() != want:
        raise SetupError(f"`npm ci` in {ROOT} did not install naga-wasm {want}")


def shipped_files() -> list[tuple[Path, Path]]:
    """(source, destination under vkml/_shipped/) for every file the wheel must carry."""
    package = ROOT / NPM_PACKAGE
    npm_files = [package / "package.json", package / WASM, *sorted(package.glob("LICENSE*"))]
    spirv = sorted((ROOT / "spirv").glob("*.spv"))
    if not spirv or not (ROOT / "spirv" / "manifest.json").is_file():
        raise SetupError(f"{ROOT / 'spirv'} has no shipped SPIR-V or no manifest.json: run "
                         "python tools/build_spirv.py")
    return ([(f, Path("naga-wasm") / f.relative_to(package)) for f in npm_files]
            + [(f, Path("spirv") / f.name) for f in [*spirv, ROOT / "spirv" / "manifest.json"]])


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install reads node_modules/ and spirv/ in the checkout
        ensure_wasm()
        dest = Path(self.build_lib) / SHIPPED
        # build/lib survives between builds: start empty so no stale kernel or wasm ships.
        shutil.rmtree(dest, ignore_errors=True)
        for src, rel in shipped_files():
            self.mkpath(str((dest / rel).parent))
            self.copy_file(str(src), str(dest / rel))


class Sdist(sdist):
    def run(self) -> None:
        # Before super().run(): its egg_info step takes MANIFEST.in's file list, wasm included.
        ensure_wasm()
        super().run()


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
