"""vkml.vk.naga: WGSL -> SPIR-V via naga's wasm, its caches, and its error reports."""

import shutil
import threading
from pathlib import Path

import pytest

from vkml.cachedir import read_entry
from vkml.errors import NagaError
from vkml.vk import naga

KERNEL = """@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    x[g.x] = x[g.x] * SCALE;
}
"""

TYPE_ERROR = """@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {
    let a: f32 = g.x;
    x[g.x] = a;
}
"""

# A non-constant stride in a cooperative-matrix store makes naga 30.1.0 trap (`unreachable`).
TRAPS = """enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> c: array<f32>;
@group(0) @binding(1) var<uniform> s: vec4<u32>;
@compute @workgroup_size(32)
fn main() {
    let acc = coop_mat16x16<f32, C>();
    coopStore(acc, &c[0], s.x);
}
"""


def kernel(scale: float = 2.0) -> str:
    return KERNEL.replace("SCALE", f"{scale:.1f}")


@pytest.fixture(scope="session")
def warm_module_dir(tmp_path_factory) -> Path:
    """A cache dir holding the serialized wasm module, so most tests skip the ~1 s compile."""
    d = tmp_path_factory.mktemp("module_cache")
    naga.Compiler(d).compile(kernel(), "warmup")
    return d / "wasm"


@pytest.fixture
def compiler(tmp_path, warm_module_dir) -> naga.Compiler:
    shutil.copytree(warm_module_dir, tmp_path / "cache" / "wasm")
    return naga.Compiler(tmp_path / "cache")


@pytest.fixture(autouse=True)
def _isolated_default(tmp_path, monkeypatch):
    monkeypatch.setenv("VKML_CACHE_DIR", str(tmp_path / "default_cache"))
    monkeypatch.delenv("VKML_NAGA_WASM", raising=False)
    naga._reset_for_tests()
    yield
    naga._reset_for_tests()


def test_compiles_to_spirv(compiler):
    spirv = compiler.compile(kernel(), "scale")
    assert len(spirv) % 4 == 0 and len(spirv) > 20
    assert int.from_bytes(spirv[:4], "little") == naga.SPIRV_MAGIC
    assert compiler.stats["compiles"] == 1
    assert len(list((compiler.cache_dir / "spirv").glob("*.spv"))) == 1


def test_second_compile_is_memory_hit(compiler):
    first = compiler.compile(kernel(), "scale")
    assert compiler.compile(kernel(), "scale") == first
    assert compiler.stats["memory_hits"] == 1 and compiler.stats["compiles"] == 1


def test_disk_hit_does_no_wasm_work(compiler):
    first = compiler.compile(kernel(), "scale")
    fresh = naga.Compiler(compiler.cache_dir)  # empty memo, like a new process
    assert fresh.compile(kernel(), "scale") == first
    assert fresh.stats == {"memory_hits": 0, "shipped_hits": 0, "disk_hits": 1, "compiles": 0,
                           "module_compiles": 0, "module_deserializes": 0}
    assert fresh._naga is None and fresh._engine_module is None


def test_corrupt_spirv_file_is_recompiled(compiler):
    first = compiler.compile(kernel(), "scale")
    (spv,) = (compiler.cache_dir / "spirv").glob("*.spv")
    spv.write_bytes(b"junk")
    fresh = naga.Compiler(compiler.cache_dir)
    assert fresh.compile(kernel(), "scale") == first
    assert fresh.stats["compiles"] == 1 and read_entry(spv) == first


def test_type_error_reports_naga_text_name_and_numbered_source(compiler):
    with pytest.raises(NagaError) as info:
        compiler.compile(TYPE_ERROR, "bad_kernel")
    msg = str(info.value)
    assert msg.startswith("naga rejected kernel 'bad_kernel':\n")
    assert "expected to be `f32`, but got `u32`" in msg
    assert "wgsl:4:9" in msg  # line and column of the offending `a`
    assert "--- WGSL of 'bad_kernel' (numbered) ---\n1 | @group(0)" in msg
    assert "4 |     let a: f32 = g.x;" in msg
    err = info.value
    assert "wgsl:4:9" in err.report and err.wgsl == TYPE_ERROR and err.kernel_name == "bad_kernel"
    # naga's instance survives a rejection, and the failure is not cached.
    assert compiler.compile(kernel(), "good")[:4] == (naga.SPIRV_MAGIC).to_bytes(4, "little")
    assert len(list((compiler.cache_dir / "spirv").glob("*.spv"))) == 1


def test_line_numbers_are_right_aligned(compiler):
    src = "\n" * 9 + "fn oops( {}\n"
    with pytest.raises(NagaError) as info:
        compiler.compile(src, "ten_lines")
    assert " 9 | \n10 | fn oops( {}" in str(info.value)


def test_trap_raises_naga_error_and_next_compile_works(compiler):
    with pytest.raises(NagaError, match="naga crashed on kernel 'coop'") as info:
        compiler.compile(TRAPS, "coop")
    assert "unreachable" in str(info.value) and "stride" in str(info.value)
    assert info.value.wgsl == TRAPS and info.value.kernel_name == "coop"
    assert compiler._naga is None  # the trapped instance was dropped
    spirv = compiler.compile(kernel(3.0), "after_trap")
    assert int.from_bytes(spirv[:4], "little") == naga.SPIRV_MAGIC


def test_missing_wasm_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("VKML_NAGA_WASM", str(tmp_path / "nowhere" / "naga_bg.wasm"))
    with pytest.raises(NagaError, match="npm ci") as info:
        naga.compile_wgsl(kernel(), "scale")
    assert "nowhere" in str(info.value) and "VKML_NAGA_WASM" in str(info.value)


def test_a_file_that_is_not_naga_names_the_fix(tmp_path, monkeypatch):
    bogus = tmp_path / "naga_bg.wasm"
    bogus.write_text("not WebAssembly")  # a wasmtime.WasmtimeError before
    monkeypatch.setenv("VKML_NAGA_WASM", str(bogus))
    with pytest.raises(NagaError, match="(?s)is not naga.s WebAssembly build .* VKML_NAGA_WASM"):
        naga.compile_wgsl(kernel(), "scale")


def test_module_level_api_uses_env_cache_dir(tmp_path):
    spirv = naga.compile_wgsl(kernel(), "scale")
    assert naga.compile_wgsl(kernel(), "scale") == spirv
    stats = naga.cache_stats()
    assert stats["compiles"] == 1 and stats["memory_hits"] == 1
    assert len(list((tmp_path / "default_cache" / "spirv").glob("*.spv"))) == 1


def test_serialized_module_is_written_then_reused(tmp_path):
    first = naga.Compiler(tmp_path)
    first.compile(kernel(), "a")
    assert first.stats["module_compiles"] == 1 and first.stats["module_deserializes"] == 0
    assert len(list((tmp_path / "wasm").glob("naga-*-wasmtime-*.cwasm"))) == 1
    second = naga.Compiler(tmp_path)
    second.compile(kernel(5.0), "b")  # a new kernel: needs the wasm, not the compile
    assert second.stats["module_compiles"] == 0 and second.stats["module_deserializes"] == 1
    assert second.stats["compiles"] == 1


def test_unreadable_serialized_module_falls_back_to_compiling(compiler):
    (cwasm,) = (compiler.cache_dir / "wasm").glob("*.cwasm")
    cwasm.write_bytes(b"not a module")
    assert compiler.compile(kernel(), "a")[:4] == (naga.SPIRV_MAGIC).to_bytes(4, "little")
    assert compiler.stats["module_compiles"] == 1
    assert cwasm.read_bytes() != b"not a module"  # rewritten for the next process


def test_wasm_memory_does_not_grow_with_many_compiles(compiler):
    compiler.compile(kernel(0.0), "k")
    for i in range(20):
        with pytest.raises(NagaError):
            compiler.compile(TYPE_ERROR + f"// {i}\n", "bad")
        compiler.compile(kernel(float(i + 1)), "k")
    n = compiler._naga
    pages = n.x["memory"].size(n.store)
    for i in range(20, 400):
        with pytest.raises(NagaError):
            compiler.compile(TYPE_ERROR + f"// {i}\n", "bad")
        compiler.compile(kernel(float(i + 1)), "k")
    assert n.x["memory"].size(n.store) == pages


def test_threads_share_one_compiler(compiler):
    results: dict[int, bytes] = {}

    def work(i: int) -> None:
        results[i] = compiler.compile(kernel(float(i % 4)), f"k{i}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16 and compiler.stats["compiles"] == 4
    assert compiler.stats["memory_hits"] == 12


def test_unsupported_import_is_named():
    fn = naga._NagaWasm._import(object.__new__(naga._NagaWasm), "__wbg_entries_972a87586902cf87")
    with pytest.raises(NotImplementedError, match="__wbg_entries_972a87586902cf87"):
        fn(None)


def test_prefetch_translates_in_the_background(compiler):
    kernels = [(kernel(float(i)), f"k{i}") for i in range(6)]
    compiler.prefetch(kernels + [(TYPE_ERROR, "bad")])
    for wgsl, name in kernels:
        assert compiler.compile(wgsl, name) == naga.Compiler(compiler.cache_dir).compile(wgsl,
                                                                                          name)
    with pytest.raises(NagaError, match="naga rejected kernel 'bad'"):
        compiler.compile(TYPE_ERROR, "bad")
    assert compiler.stats["compiles"] == 7  # each once: compile() waited for the prefetch
    assert compiler.stats["memory_hits"] == 6


def test_prefetch_from_a_warm_cache_starts_no_thread(compiler):
    compiler.compile(kernel(), "a")
    warm = naga.Compiler(compiler.cache_dir)
    warm.prefetch([(kernel(), "a")])
    assert not [t for t in threading.enumerate() if t.name.startswith("vkml-naga")]
    assert warm.stats["disk_hits"] == 1
    assert warm.compile(kernel(), "a") and warm.stats["memory_hits"] == 1


def test_preload_compiles_the_module_only_when_none_is_cached(tmp_path, warm_module_dir):
    cold = naga.Compiler(tmp_path / "cold")
    cold.preload()
    cold.compile(kernel(), "a")  # waits for the preload's compile, does not start another
    assert cold.stats["module_compiles"] == 1 and cold.stats["module_deserializes"] == 0
    shutil.copytree(warm_module_dir, tmp_path / "warm" / "wasm")
    warm = naga.Compiler(tmp_path / "warm")
    warm.preload()
    for thread in threading.enumerate():
        if thread.name == "vkml-naga-preload":
            thread.join()
    assert warm.stats["module_compiles"] == 0 and warm.stats["module_deserializes"] == 0
