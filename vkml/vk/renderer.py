"""A stand-in host application: its own Vulkan instance, device and queue (as a game engine or an
OpenXR app would create them), and an offscreen renderer whose frames are a full-screen triangle
with a fragment workload. Shaders are WGSL compiled by vkml.naga. vkml joins through
`HostContext.vkml_device()` (Device.from_vulkan) and shares the queue and its lock.

Used by tools/cotenancy.py and the tests; `vkml.host` re-exports it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from vkml import naga
from vkml.errors import DeviceError
from vkml.vk.context import load_vulkan
from vkml.vk.select import DEVICE_TYPE_NAMES, select_device

# Features the host enables when the device has them, and declares to vkml.
SHARED_FEATURES = ("timelineSemaphore", "shaderFloat16", "vulkanMemoryModel")
FORMAT_NAME = "VK_FORMAT_R8G8B8A8_UNORM"


def scene_wgsl(iterations: int) -> str:
    """A full-screen triangle; each pixel iterates a Julia-like map `iterations` times (the
    per-frame GPU cost knob)."""
    return f"""
struct VOut {{ @builtin(position) pos: vec4<f32>, @location(0) uv: vec2<f32> }};

@vertex fn vs_main(@builtin(vertex_index) i: u32) -> VOut {{
    let x = f32((i << 1u) & 2u);
    let y = f32(i & 2u);
    var o: VOut;
    o.pos = vec4<f32>(x * 2.0 - 1.0, y * 2.0 - 1.0, 0.0, 1.0);
    o.uv = vec2<f32>(x, y);
    return o;
}}

@fragment fn fs_main(v: VOut) -> @location(0) vec4<f32> {{
    var z = v.uv * 2.4 - vec2<f32>(1.2, 1.2);
    var n = 0.0;
    for (var k = 0; k < {int(iterations)}; k++) {{
        z = vec2<f32>(z.x * z.x - z.y * z.y, 2.0 * z.x * z.y) + vec2<f32>(-0.70, 0.27);
        if (dot(z, z) < 4.0) {{ n += 1.0; }} else {{ z = z * 0.5; }}
    }}
    let t = n / f32({int(iterations)});
    return vec4<f32>(t, t * t, 1.0 - t, 1.0);
}}
"""


class HostContext:
    """The host's Vulkan objects: instance, one physical device, a device with one universal
    (graphics + compute) queue, the lock it holds around queue submissions, a command pool."""

    def __init__(self, selector: str | None = None) -> None:
        self.vk = vk = load_vulkan()
        ffi = vk.ffi
        self.messages: list[str] = []
        self._keep: list[Any] = []
        self.instance = self.device = self.messenger = self.pool = None
        names = {e.extensionName for e in vk.vkEnumerateInstanceExtensionProperties(None)}
        validate = "VK_LAYER_KHRONOS_validation" in os.environ.get("VK_INSTANCE_LAYERS", "")
        exts = ["VK_EXT_debug_utils"] if validate and "VK_EXT_debug_utils" in names else []
        app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                                   pApplicationName="vkml host", applicationVersion=1,
                                   pEngineName="vkml host", engineVersion=1,
                                   apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
        info = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                       pApplicationInfo=app, enabledExtensionCount=len(exts),
                                       ppEnabledExtensionNames=exts or None)
        self.instance = vk.vkCreateInstance(info, None)
        try:
            if exts:
                self._callback = ffi.callback("PFN_vkDebugUtilsMessengerCallbackEXT",
                                              self._on_message)
                minfo = ffi.new("VkDebugUtilsMessengerCreateInfoEXT*", {
                    "sType": vk.VK_STRUCTURE_TYPE_DEBUG_UTILS_MESSENGER_CREATE_INFO_EXT,
                    "messageSeverity": vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_WARNING_BIT_EXT
                    | vk.VK_DEBUG_UTILS_MESSAGE_SEVERITY_ERROR_BIT_EXT,
                    "messageType": vk.VK_DEBUG_UTILS_MESSAGE_TYPE_GENERAL_BIT_EXT
                    | vk.VK_DEBUG_UTILS_MESSAGE_TYPE_VALIDATION_BIT_EXT,
                    "pfnUserCallback": self._callback})
                create = vk.vkGetInstanceProcAddr(self.instance, "vkCreateDebugUtilsMessengerEXT")
                self.messenger = create(self.instance, minfo, None)
            self._create_device(selector)
        except BaseException:
            self.close()
            raise

    def _on_message(self, severity: int, types: int, data: Any, user: Any) -> int:
        ffi = self.vk.ffi
        message = ffi.string(data.pMessage).decode(errors="replace") if data.pMessage else ""
        ident = ffi.string(data.pMessageIdName).decode() if data.pMessageIdName else ""
        if not (ident == "Loader Message" and message.startswith("env var ")):
            self.messages.append(message)
        return 0

    def _create_device(self, selector: str | None) -> None:
        vk, ffi = self.vk, self.vk.ffi
        physical = vk.vkEnumeratePhysicalDevices(self.instance)
        described = []
        for pd in physical:
            p = vk.vkGetPhysicalDeviceProperties(pd)
            described.append((p.deviceName, DEVICE_TYPE_NAMES.get(p.deviceType, "other")))
        index = select_device(described, selector or os.environ.get("VKML_DEVICE"))
        self.physical = physical[index]
        self.device_name = described[index][0]
        props = vk.vkGetPhysicalDeviceProperties(self.physical)
        self.timestamp_period = props.limits.timestampPeriod
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        universal = [i for i, f in enumerate(families)
                     if f.queueFlags & vk.VK_QUEUE_GRAPHICS_BIT
                     and f.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not universal:
            raise DeviceError(f"{self.device_name!r} has no graphics+compute queue family")
        self.family = universal[0]
        device_exts = {e.extensionName for e in
                       vk.vkEnumerateDeviceExtensionProperties(self.physical, None)}
        coop_stype = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR
        q_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*", {"sType": coop_stype})
        q13 = ffi.new("VkPhysicalDeviceVulkan13Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
                       "pNext": q_coop if "VK_KHR_cooperative_matrix" in device_exts
                       else ffi.NULL})
        q12 = ffi.new("VkPhysicalDeviceVulkan12Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                       "pNext": q13})
        q11 = ffi.new("VkPhysicalDeviceVulkan11Features*",
                      {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                       "pNext": q12})
        q2 = ffi.new("VkPhysicalDeviceFeatures2*",
                     {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, "pNext": q11})
        vk.lib.vkGetPhysicalDeviceFeatures2(self.physical, q2)
        if not q13.dynamicRendering:
            raise DeviceError(f"{self.device_name!r} lacks dynamicRendering (Vulkan 1.3)")
        self.features = [f for f in SHARED_FEATURES if getattr(q12, f)]
        if "shaderFloat16" in self.features and q11.storageBuffer16BitAccess:
            self.features.append("storageBuffer16BitAccess")
        else:
            self.features = [f for f in self.features if f != "shaderFloat16"]
        # Cooperative matrices where the GPU has them, as vkml's own device would enable them.
        coop = bool("VK_KHR_cooperative_matrix" in device_exts and q_coop.cooperativeMatrix
                    and "shaderFloat16" in self.features and q12.vulkanMemoryModelDeviceScope)
        self.extensions = ["VK_KHR_cooperative_matrix"] if coop else []
        if coop:
            self.features += ["cooperativeMatrix", "vulkanMemoryModelDeviceScope"]
        e_coop = ffi.new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR*",
                         {"sType": coop_stype, "cooperativeMatrix": 1})
        e13 = ffi.new("VkPhysicalDeviceVulkan13Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
            "pNext": e_coop if coop else ffi.NULL, "dynamicRendering": 1})
        e12 = ffi.new("VkPhysicalDeviceVulkan12Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES, "pNext": e13,
            **{f: 1 for f in self.features
               if f in (*SHARED_FEATURES, "vulkanMemoryModelDeviceScope")}})
        e11 = ffi.new("VkPhysicalDeviceVulkan11Features*", {
            "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES, "pNext": e12,
            "storageBuffer16BitAccess": int("storageBuffer16BitAccess" in self.features)})
        qci = vk.VkDeviceQueueCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                         queueFamilyIndex=self.family, queueCount=1,
                                         pQueuePriorities=[1.0])
        dci = vk.VkDeviceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=e11,
                                    queueCreateInfoCount=1, pQueueCreateInfos=[qci],
                                    enabledExtensionCount=len(self.extensions),
                                    ppEnabledExtensionNames=self.extensions or None)
        self.device = vk.vkCreateDevice(self.physical, dci, None)
        self.queue = vk.vkGetDeviceQueue(self.device, self.family, 0)
        self.queue_lock = threading.Lock()
        self.memory = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        self.pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO, queueFamilyIndex=self.family,
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT), None)

    def vkml_device(self) -> Any:
        """A vkml.Device on this context's device and queue, sharing `queue_lock`."""
        from vkml.runtime.device import Device

        return Device.from_vulkan(self.instance, self.physical, self.device, self.family,
                                  self.queue, self.queue_lock, enabled_features=self.features,
                                  enabled_extensions=self.extensions)

    def memory_type(self, bits: int, flags: int) -> int:
        for i in range(self.memory.memoryTypeCount):
            if bits >> i & 1 and self.memory.memoryTypes[i].propertyFlags & flags == flags:
                return i
        raise DeviceError("no suitable memory type")

    def submit(self, command_buffer: Any, fence: Any) -> None:
        vk = self.vk
        info = vk.VkSubmitInfo(sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1,
                               pCommandBuffers=[command_buffer])
        with self.queue_lock:  # a VkQueue is externally synchronized: vkml holds it too
            vk.vkQueueSubmit(self.queue, 1, [info], fence)

    def timeline_value(self, semaphore: Any) -> int:
        return self.vk.vkGetSemaphoreCounterValue(self.device, semaphore)

    def wait_timeline(self, semaphore: Any, value: int, timeout_s: float = 300.0) -> None:
        vk = self.vk
        info = vk.VkSemaphoreWaitInfo(sType=vk.VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                                      semaphoreCount=1, pSemaphores=[semaphore], pValues=[value])
        vk.vkWaitSemaphores(self.device, info, int(timeout_s * 1e9))

    def close(self) -> None:
        vk = self.vk
        if self.device is not None:
            vk.vkDeviceWaitIdle(self.device)
            if self.pool is not None:
                vk.vkDestroyCommandPool(self.device, self.pool, None)
            vk.vkDestroyDevice(self.device, None)
            self.device = None
        if self.messenger is not None:
            destroy = vk.vkGetInstanceProcAddr(self.instance, "vkDestroyDebugUtilsMessengerEXT")
            destroy(self.instance, self.messenger, None)
            self.messenger = None
        if self.instance is not None:
            vk.vkDestroyInstance(self.instance, None)
            self.instance = None


class OffscreenRenderer:
    """Draws a frame into an offscreen RGBA8 image with dynamic rendering; two timestamps per
    frame give its GPU time."""

    def __init__(self, ctx: HostContext, width: int = 256, height: int = 256,
                 iterations: int = 32) -> None:
        self.ctx, self.width, self.height = ctx, width, height
        vk, d = ctx.vk, ctx.device
        fmt = getattr(vk, FORMAT_NAME)
        self.image = vk.vkCreateImage(d, vk.VkImageCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_CREATE_INFO, imageType=vk.VK_IMAGE_TYPE_2D,
            format=fmt, extent=vk.VkExtent3D(width, height, 1), mipLevels=1, arrayLayers=1,
            samples=vk.VK_SAMPLE_COUNT_1_BIT, tiling=vk.VK_IMAGE_TILING_OPTIMAL,
            usage=vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT,
            sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE,
            initialLayout=vk.VK_IMAGE_LAYOUT_UNDEFINED), None)
        req = vk.vkGetImageMemoryRequirements(d, self.image)
        self.memory = vk.vkAllocateMemory(d, vk.VkMemoryAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=req.size,
            memoryTypeIndex=ctx.memory_type(req.memoryTypeBits,
                                            vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)), None)
        vk.vkBindImageMemory(d, self.image, self.memory, 0)
        self.range = vk.VkImageSubresourceRange(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 1, 0, 1)
        self.view = vk.vkCreateImageView(d, vk.VkImageViewCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_VIEW_CREATE_INFO, image=self.image,
            viewType=vk.VK_IMAGE_VIEW_TYPE_2D, format=fmt, subresourceRange=self.range), None)
        spirv = naga.compile_wgsl(scene_wgsl(iterations), f"host_scene_{iterations}")
        self.module = vk.vkCreateShaderModule(d, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv),
            pCode=spirv), None)
        self.layout = vk.vkCreatePipelineLayout(d, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO), None)
        # Every nested struct in a variable that outlives the call (cffi lifetime trap).
        stages = [vk.VkPipelineShaderStageCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=stage,
            module=self.module, pName=entry)
            for stage, entry in ((vk.VK_SHADER_STAGE_VERTEX_BIT, "vs_main"),
                                 (vk.VK_SHADER_STAGE_FRAGMENT_BIT, "fs_main"))]
        rendering = vk.VkPipelineRenderingCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_RENDERING_CREATE_INFO, colorAttachmentCount=1,
            pColorAttachmentFormats=[fmt])
        vertex = vk.VkPipelineVertexInputStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_VERTEX_INPUT_STATE_CREATE_INFO)
        assembly = vk.VkPipelineInputAssemblyStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_INPUT_ASSEMBLY_STATE_CREATE_INFO,
            topology=vk.VK_PRIMITIVE_TOPOLOGY_TRIANGLE_LIST)
        viewport = vk.VkViewport(0, 0, width, height, 0, 1)
        scissor = vk.VkRect2D(vk.VkOffset2D(0, 0), vk.VkExtent2D(width, height))
        viewports = vk.VkPipelineViewportStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_VIEWPORT_STATE_CREATE_INFO, viewportCount=1,
            pViewports=[viewport], scissorCount=1, pScissors=[scissor])
        raster = vk.VkPipelineRasterizationStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_RASTERIZATION_STATE_CREATE_INFO,
            polygonMode=vk.VK_POLYGON_MODE_FILL, cullMode=vk.VK_CULL_MODE_NONE,
            frontFace=vk.VK_FRONT_FACE_COUNTER_CLOCKWISE, lineWidth=1.0)
        multisample = vk.VkPipelineMultisampleStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_MULTISAMPLE_STATE_CREATE_INFO,
            rasterizationSamples=vk.VK_SAMPLE_COUNT_1_BIT)
        attachment = vk.VkPipelineColorBlendAttachmentState(colorWriteMask=0xF)
        blend = vk.VkPipelineColorBlendStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_COLOR_BLEND_STATE_CREATE_INFO,
            attachmentCount=1, pAttachments=[attachment])
        info = vk.VkGraphicsPipelineCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_GRAPHICS_PIPELINE_CREATE_INFO, pNext=rendering,
            stageCount=2, pStages=stages, pVertexInputState=vertex,
            pInputAssemblyState=assembly, pViewportState=viewports,
            pRasterizationState=raster, pMultisampleState=multisample,
            pColorBlendState=blend, layout=self.layout, renderPass=vk.VK_NULL_HANDLE)
        self.pipeline = vk.vkCreateGraphicsPipelines(d, vk.VK_NULL_HANDLE, 1, [info], None)[0]
        # Two recordings of the frame: with timestamps, and without (lavapipe 22.3's
        # vkGetQueryPoolResults waits for the whole queue, the model's work included).
        self.command_buffers = vk.vkAllocateCommandBuffers(d, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=ctx.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=2))
        self._timed = False
        self.fence = vk.vkCreateFence(d, vk.VkFenceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        self.queries = vk.vkCreateQueryPool(d, vk.VkQueryPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=2), None)
        self._stamps = vk.ffi.new("uint64_t[2]")
        self._record(self.command_buffers[0], timestamps=True)
        self._record(self.command_buffers[1], timestamps=False)

    def _barrier(self, cb: Any, old: int, new: int, src_stage: int, dst_stage: int,
                 src_access: int, dst_access: int) -> None:
        vk = self.ctx.vk
        barrier = vk.VkImageMemoryBarrier(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER, srcAccessMask=src_access,
            dstAccessMask=dst_access, oldLayout=old, newLayout=new,
            srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
            dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, image=self.image,
            subresourceRange=self.range)
        vk.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 0, None, 0, None, 1, [barrier])

    def _record(self, cb: Any, timestamps: bool) -> None:
        """The frame's command buffer, recorded once and resubmitted every frame."""
        vk = self.ctx.vk
        vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        if timestamps:
            vk.vkCmdResetQueryPool(cb, self.queries, 0, 2)
            vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self.queries, 0)
        color = vk.VK_PIPELINE_STAGE_COLOR_ATTACHMENT_OUTPUT_BIT
        write = vk.VK_ACCESS_COLOR_ATTACHMENT_WRITE_BIT
        attachment = vk.VK_IMAGE_LAYOUT_COLOR_ATTACHMENT_OPTIMAL
        self._barrier(cb, vk.VK_IMAGE_LAYOUT_UNDEFINED, attachment, color, color, 0, write)
        clear = vk.VkClearValue(color=vk.VkClearColorValue(float32=[0, 0, 0, 1]))
        target = vk.VkRenderingAttachmentInfo(
            sType=vk.VK_STRUCTURE_TYPE_RENDERING_ATTACHMENT_INFO, imageView=self.view,
            imageLayout=attachment, loadOp=vk.VK_ATTACHMENT_LOAD_OP_CLEAR,
            storeOp=vk.VK_ATTACHMENT_STORE_OP_STORE, clearValue=clear)
        area = vk.VkRect2D(vk.VkOffset2D(0, 0), vk.VkExtent2D(self.width, self.height))
        rendering = vk.VkRenderingInfo(sType=vk.VK_STRUCTURE_TYPE_RENDERING_INFO,
                                       renderArea=area, layerCount=1, colorAttachmentCount=1,
                                       pColorAttachments=[target])
        vk.vkCmdBeginRendering(cb, rendering)
        vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_GRAPHICS, self.pipeline)
        vk.vkCmdDraw(cb, 3, 1, 0, 0)
        vk.vkCmdEndRendering(cb)
        self._barrier(cb, attachment, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL, color,
                      vk.VK_PIPELINE_STAGE_TRANSFER_BIT, write, vk.VK_ACCESS_TRANSFER_READ_BIT)
        if timestamps:
            vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.queries, 1)
        vk.vkEndCommandBuffer(cb)

    def render(self, timed: bool = True) -> float:
        """Submit one frame (under the queue lock); returns the submit time for wait().
        `timed`: with GPU timestamps, which wait() then reads."""
        t0 = time.perf_counter()
        self._timed = timed
        self.ctx.submit(self.command_buffers[0 if timed else 1], self.fence)
        return t0

    def wait(self, t0: float) -> tuple[float, float]:
        """Block until the frame is done: (ms from submit to done seen by the host, GPU ms or
        NaN for an untimed frame)."""
        vk, d = self.ctx.vk, self.ctx.device
        vk.vkWaitForFences(d, 1, [self.fence], vk.VK_TRUE, 300 * 10**9)
        cpu_ms = (time.perf_counter() - t0) * 1e3
        vk.vkResetFences(d, 1, [self.fence])
        if not self._timed:
            return cpu_ms, float("nan")
        result = vk.lib.vkGetQueryPoolResults(d, self.queries, 0, 2, 16, self._stamps, 8,
                                              vk.VK_QUERY_RESULT_64_BIT)
        if result != vk.VK_SUCCESS:
            return cpu_ms, float("nan")
        gpu_ms = (self._stamps[1] - self._stamps[0]) * self.ctx.timestamp_period / 1e6
        return cpu_ms, gpu_ms

    def close(self) -> None:
        """Destroy the renderer's objects; every frame must have been waited for."""
        vk, d = self.ctx.vk, self.ctx.device
        if d is None or self.pipeline is None:
            return
        vk.vkDestroyQueryPool(d, self.queries, None)
        vk.vkDestroyFence(d, self.fence, None)
        vk.vkFreeCommandBuffers(d, self.ctx.pool, 2, self.command_buffers)
        vk.vkDestroyPipeline(d, self.pipeline, None)
        vk.vkDestroyPipelineLayout(d, self.layout, None)
        vk.vkDestroyShaderModule(d, self.module, None)
        vk.vkDestroyImageView(d, self.view, None)
        vk.vkDestroyImage(d, self.image, None)
        vk.vkFreeMemory(d, self.memory, None)
        self.pipeline = None
