"""Compute pipelines (one storage-buffer descriptor set each) and the on-disk pipeline cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vkml.cachedir import cache_dir, read_entry, write_entry
from vkml.errors import DeviceError
from vkml.vk.spirv import prepare, to_bfloat16

# VK_PIPELINE_CREATE_DISPATCH_BASE_BIT (Vulkan 1.1), which the `vulkan` package lacks: its
# VK_PIPELINE_CREATE_DISPATCH_BASE_KHR alias is None.
DISPATCH_BASE_BIT = 0x10


class Pipeline:
    __slots__ = ("dispatch_base", "handle", "layout", "module", "name", "num_bindings",
                 "set_layout", "writable")

    def __init__(self, name: str, num_bindings: int, writable: tuple[bool, ...],
                 dispatch_base: bool) -> None:
        self.name = name
        self.num_bindings = num_bindings
        self.writable = writable
        self.dispatch_base = dispatch_base  # made to run with a base workgroup too
        self.module: Any = None
        self.set_layout: Any = None
        self.layout: Any = None
        self.handle: Any = None

    def __repr__(self) -> str:
        return f"<vk.Pipeline {self.name!r} {self.num_bindings} bindings>"


class PipelineCache:
    """A VkPipelineCache seeded from and saved to a file keyed by device, driver and cache UUID.

    Driver compilation dominates pipeline creation (a tenth of a second or more per kernel on a
    GPU driver), so a second run of the same model should not pay it again. The driver only
    checks the blob's header before trusting the rest, so the file is a cache entry
    (vkml/cachedir.py) with a digest over the blob: a damaged one is dropped, and the cache
    starts empty and is saved again.
    """

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.root = cache_dir()
        self.path = self.root / f"pipelines-{dev.pipeline_cache_key}.bin"
        self.dirty = False
        # A blob the driver refuses despite its digest (another driver build): start empty.
        self.handle = self._create(read_entry(self.path) or b"") or self._create(b"")
        if self.handle is None:
            raise DeviceError("vkCreatePipelineCache failed")

    def _create(self, initial: bytes) -> Any:
        dev, vk, ffi = self.dev, self.dev.vk, self.dev.ffi
        data = ffi.from_buffer(initial) if initial else ffi.NULL
        info = ffi.new("VkPipelineCacheCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
            "initialDataSize": len(initial), "pInitialData": data})
        out = ffi.new("VkPipelineCache*")
        if dev.lib.vkCreatePipelineCache(dev.device, info, ffi.NULL, out) != vk.VK_SUCCESS:
            return None
        return out[0]

    def save_and_destroy(self) -> None:
        dev, ffi = self.dev, self.dev.ffi
        if self.dirty:
            size = ffi.new("size_t*")
            if dev.lib.vkGetPipelineCacheData(dev.device, self.handle, size, ffi.NULL) == 0:
                data = ffi.new("char[]", size[0])
                if dev.lib.vkGetPipelineCacheData(dev.device, self.handle, size, data) == 0:
                    # Only saves time: an unwritable cache directory warns once, never raises.
                    write_entry(self.path, ffi.buffer(data, size[0])[:], self.root)
        dev.lib.vkDestroyPipelineCache(dev.device, self.handle, ffi.NULL)


def create_pipeline(dev: Any, cache: PipelineCache, name: str, spirv: bytes, num_bindings: int,
                    writable: Sequence[bool], dispatch_base: bool, bfloat16: bool = False
                    ) -> Pipeline:
    """`dispatch_base`: the pipeline may be dispatched with a base workgroup
    (vkCmdDispatchBase, hal.Dispatch.base), which Vulkan allows only where it was made so.
    `bfloat16`: the module's f16 type is made bfloat16 first (hal.Kernel.bfloat16)."""
    vk, ffi, lib = dev.vk, dev.ffi, dev.lib
    if len(spirv) == 0 or len(spirv) % 4:
        raise DeviceError(f"kernel {name!r}: SPIR-V must be a non-empty multiple of 4 bytes, "
                          f"got {len(spirv)}")
    if len(writable) != num_bindings:
        raise DeviceError(f"kernel {name!r}: {len(writable)} writable flags for "
                          f"{num_bindings} bindings")
    if num_bindings > dev.caps.max_bindings_per_stage:
        raise DeviceError(f"kernel {name!r} uses {num_bindings} storage buffers; the device "
                          f"allows {dev.caps.max_bindings_per_stage} per stage")
    pipe = Pipeline(name, num_bindings, tuple(bool(w) for w in writable), dispatch_base)
    try:
        spirv = prepare(to_bfloat16(spirv) if bfloat16 else spirv)
    except ValueError as exc:  # a module the bfloat16 pass refuses
        raise DeviceError(f"kernel {name!r}: {exc}") from None
    try:
        code = ffi.from_buffer(spirv)
        module_info = ffi.new("VkShaderModuleCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, "codeSize": len(spirv),
            "pCode": ffi.cast("uint32_t*", code)})
        out_module = ffi.new("VkShaderModule*")
        _check(dev, lib.vkCreateShaderModule(dev.device, module_info, ffi.NULL, out_module),
               name, "vkCreateShaderModule")
        pipe.module = out_module[0]

        bindings = ffi.new("VkDescriptorSetLayoutBinding[]", max(num_bindings, 1))
        for i in range(num_bindings):
            bindings[i].binding = i
            bindings[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            bindings[i].descriptorCount = 1
            bindings[i].stageFlags = vk.VK_SHADER_STAGE_COMPUTE_BIT
        set_info = ffi.new("VkDescriptorSetLayoutCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
            "bindingCount": num_bindings, "pBindings": bindings})
        out_set = ffi.new("VkDescriptorSetLayout*")
        _check(dev, lib.vkCreateDescriptorSetLayout(dev.device, set_info, ffi.NULL, out_set),
               name, "vkCreateDescriptorSetLayout")
        pipe.set_layout = out_set[0]

        set_layouts = ffi.new("VkDescriptorSetLayout[1]", [pipe.set_layout])
        layout_info = ffi.new("VkPipelineLayoutCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
            "setLayoutCount": 1, "pSetLayouts": set_layouts})
        out_layout = ffi.new("VkPipelineLayout*")
        _check(dev, lib.vkCreatePipelineLayout(dev.device, layout_info, ffi.NULL, out_layout),
               name, "vkCreatePipelineLayout")
        pipe.layout = out_layout[0]

        entry = ffi.new("char[]", b"main")
        info = ffi.new("VkComputePipelineCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO,
            "flags": DISPATCH_BASE_BIT if dispatch_base else 0,
            "stage": {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                      "stage": vk.VK_SHADER_STAGE_COMPUTE_BIT, "module": pipe.module,
                      "pName": entry},
            "layout": pipe.layout})
        out_pipe = ffi.new("VkPipeline*")
        _check(dev, lib.vkCreateComputePipelines(dev.device, cache.handle, 1, info, ffi.NULL,
                                                 out_pipe), name, "vkCreateComputePipelines")
        pipe.handle = out_pipe[0]
        cache.dirty = True
    except BaseException:
        destroy_pipeline(dev, pipe)
        raise
    return pipe


def destroy_pipeline(dev: Any, pipe: Pipeline) -> None:
    lib, null = dev.lib, dev.ffi.NULL
    if pipe.handle is not None:
        lib.vkDestroyPipeline(dev.device, pipe.handle, null)
    if pipe.layout is not None:
        lib.vkDestroyPipelineLayout(dev.device, pipe.layout, null)
    if pipe.set_layout is not None:
        lib.vkDestroyDescriptorSetLayout(dev.device, pipe.set_layout, null)
    if pipe.module is not None:
        lib.vkDestroyShaderModule(dev.device, pipe.module, null)
    pipe.handle = pipe.layout = pipe.set_layout = pipe.module = None


def _check(dev: Any, result: int, name: str, call: str) -> None:
    if result != dev.vk.VK_SUCCESS:
        code = getattr(dev.vk.exception_codes.get(result), "__name__", str(result))
        raise DeviceError(f"kernel {name!r}: {call} failed with {code}"
                          + (f"; validation said: {dev.validation_messages[-1]}"
                             if dev.validation_messages else ""))
