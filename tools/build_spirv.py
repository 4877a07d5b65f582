"""Build spirv/: the SPIR-V of every kernel that `make demo` (and, as they land, the reference
models) compiles, so a deployed app runs without naga's wasm. Files are named by the sha256 of
their WGSL; spirv/manifest.json lists them. Kernels differ between GPUs and CPU drivers (the
matmul reads operands directly on a CPU), so both variants are built.

    python tools/build_spirv.py          # rebuild spirv/
    python tools/build_spirv.py --check  # exit 1 and say what differs if spirv/ is not current
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vkml import dump  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.runtime.device import default_device  # noqa: E402
from vkml.vk import naga  # noqa: E402

SPIRV_DIR = REPO / "spirv"
# (what it is, the script or module whose first vkml.compile call is shipped, its arguments)
SHIPPED = [("make demo", "vkml", ["demo"])]
DEVICE_TYPES = ("discrete", "cpu")


def expected_kernels() -> dict[str, dict]:
    """WGSL hash -> {name, wgsl, used_by} for every shipped program on every device type."""
    caps = default_device().caps
    kernels: dict[str, dict] = {}
    for label, target, argv in SHIPPED:
        call = dump.capture(target, argv)
        for device_type in DEVICE_TYPES:
            stages = lower(call.graph, dataclasses.replace(caps, device_type=device_type),
                           call.options)
            for name, wgsl in stages.kernels().items():
                entry = kernels.setdefault(naga.wgsl_hash(wgsl), {"name": name, "wgsl": wgsl,
                                                                  "used_by": []})
                if f"{label} ({device_type})" not in entry["used_by"]:
                    entry["used_by"].append(f"{label} ({device_type})")
    return kernels


def build(kernels: dict[str, dict], out: Path) -> dict:
    """Compile every kernel afresh (no cache, no shipped file) into `out`; returns the manifest."""
    with tempfile.TemporaryDirectory() as cache:
        compiler = naga.Compiler(cache_dir=cache, shipped_dir=Path(cache) / "none")
        for key, entry in kernels.items():
            (out / f"{key}.spv").write_bytes(compiler.compile(entry["wgsl"], entry["name"]))
    return {"naga_wasm": naga.wasm_package_version(),
            "kernels": {k: {"name": e["name"], "used_by": e["used_by"]}
                        for k, e in sorted(kernels.items())}}


def check(kernels: dict[str, dict]) -> list[str]:
    """What differs between spirv/ and a fresh build; empty when spirv/ is current."""
    with tempfile.TemporaryDirectory() as fresh:
        manifest = build(kernels, Path(fresh))
        problems = []
        wanted = {f"{k}.spv" for k in kernels} | {"manifest.json"}
        present = {p.name for p in SPIRV_DIR.glob("*")} if SPIRV_DIR.is_dir() else set()
        problems += [f"missing: spirv/{n}" for n in sorted(wanted - present)]
        problems += [f"stale: spirv/{n}" for n in sorted(present - wanted)]
        for name in sorted(wanted & present - {"manifest.json"}):
            if (SPIRV_DIR / name).read_bytes() != (Path(fresh) / name).read_bytes():
                problems.append(f"differs from a fresh naga build: spirv/{name}")
        if "manifest.json" in present and json.loads(
                (SPIRV_DIR / "manifest.json").read_text()) != manifest:
            problems.append("spirv/manifest.json is out of date")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    kernels = expected_kernels()
    if parser.parse_args().check:
        problems = check(kernels)
        for p in problems:
            print(p)
        print(f"spirv/: {len(kernels)} kernels, " + (
            "current" if not problems else "NOT current: run python tools/build_spirv.py"))
        return 1 if problems else 0
    SPIRV_DIR.mkdir(exist_ok=True)
    for old in SPIRV_DIR.glob("*.spv"):
        old.unlink()
    manifest = build(kernels, SPIRV_DIR)
    (SPIRV_DIR / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {len(kernels)} kernels to spirv/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
