"""Shipped SPIR-V: spirv/ holds exactly what a fresh naga build of the demo's kernels gives, and
a deployed app runs those kernels without naga's wasm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vkml.errors import NagaError
from vkml.vk import naga

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("build_spirv", REPO / "tools" / "build_spirv.py")
build_spirv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build_spirv)


@pytest.fixture(scope="module")
def kernels():
    return build_spirv.expected_kernels()


def test_shipped_spirv_is_current(kernels):
    assert kernels, "nothing is shipped"
    problems = build_spirv.check(kernels)
    assert not problems, "run python tools/build_spirv.py:\n" + "\n".join(problems)


def test_shipped_kernels_need_no_wasm(kernels, tmp_path):
    compiler = naga.Compiler(cache_dir=tmp_path, wasm_path=tmp_path / "absent.wasm")
    for key, entry in kernels.items():
        spirv = compiler.compile(entry["wgsl"], entry["name"])
        assert spirv == (REPO / "spirv" / f"{key}.spv").read_bytes()
    assert compiler.stats["shipped_hits"] == len(kernels)
    assert compiler.stats["compiles"] == compiler.stats["module_compiles"] == 0
    with pytest.raises(NagaError, match="npm ci"):
        compiler.compile("@compute @workgroup_size(1) fn main() {}\n", "not_shipped")
