"""A synthetic GPU load for co-tenancy measurements (tools/cotenancy.py, the render-loop
tests): a full-screen triangle whose fragment shader iterates a Julia-like map `iterations` times
per pixel, so the frame's GPU cost is a knob (size x iterations). It draws into an offscreen RGBA8
image with dynamic rendering; WGSL compiled by vkml.vk.compile_wgsl; two timestamps give its GPU
time.

Formerly vkml/vk/renderer.py: the library holds no host-application code any more.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import vulkan as vk

from vkml.vk import compile_wgsl
from xr_demo import graphics
from xr_demo.vkhost import VulkanHost

ffi = vk.ffi


def load_wgsl(iterations: int) -> str:
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


class FullscreenLoad:
    """Draws a frame into an offscreen RGBA8 image with dynamic rendering; two timestamps per
    frame give its GPU time. Its command buffers are recorded once and resubmitted."""

    def __init__(self, host: VulkanHost, width: int = 256, height: int = 256,
                 iterations: int = 32) -> None:
        self.host, self.width, self.height = host, width, height
        self.iterations = iterations
        d = host.device
        fmt = vk.VK_FORMAT_R8G8B8A8_UNORM
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
            memoryTypeIndex=host.memory_type(req.memoryTypeBits,
                                            vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)), None)
        vk.vkBindImageMemory(d, self.image, self.memory, 0)
        self.range = vk.VkImageSubresourceRange(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 1, 0, 1)
        self.view = vk.vkCreateImageView(d, vk.VkImageViewCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_VIEW_CREATE_INFO, image=self.image,
            viewType=vk.VK_IMAGE_VIEW_TYPE_2D, format=fmt, subresourceRange=self.range), None)
        spirv = compile_wgsl(load_wgsl(iterations), f"fullscreen_load_{iterations}")
        self.module = vk.vkCreateShaderModule(d, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv),
            pCode=spirv), None)
        self.layout = vk.vkCreatePipelineLayout(d, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO), None)
        rendering = vk.VkPipelineRenderingCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_RENDERING_CREATE_INFO, colorAttachmentCount=1,
            pColorAttachmentFormats=[fmt])
        vertex = vk.VkPipelineVertexInputStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_VERTEX_INPUT_STATE_CREATE_INFO)
        self.pipeline = graphics.create_pipeline(d, self.module, self.layout, width, height,
                                                 rendering, vertex, colors=1)
        # Two recordings of the frame: with timestamps, and without (lavapipe 22.3's
        # vkGetQueryPoolResults waits for the whole queue, the model's work included).
        self.command_buffers = vk.vkAllocateCommandBuffers(d, vk.VkCommandBufferAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO, commandPool=host.pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=2))
        self._timed = False
        self.fence = vk.vkCreateFence(d, vk.VkFenceCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO), None)
        self.queries = vk.vkCreateQueryPool(d, vk.VkQueryPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=2), None)
        self._stamps = ffi.new("uint64_t[2]")
        self._record(self.command_buffers[0], timestamps=True)
        self._record(self.command_buffers[1], timestamps=False)

    def _barrier(self, cb: Any, old: int, new: int, src_stage: int, dst_stage: int,
                 src_access: int, dst_access: int) -> None:
        barrier = vk.VkImageMemoryBarrier(
            sType=vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER, srcAccessMask=src_access,
            dstAccessMask=dst_access, oldLayout=old, newLayout=new,
            srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
            dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, image=self.image,
            subresourceRange=self.range)
        vk.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 0, None, 0, None, 1, [barrier])

    def _record(self, cb: Any, timestamps: bool) -> None:
        """The frame's command buffer, recorded once and resubmitted every frame."""
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
        self.host.submit(self.command_buffers[0 if timed else 1], self.fence)
        return t0

    def wait(self, t0: float) -> tuple[float, float]:
        """Block until the frame is done: (ms from submit to done seen by the host, GPU ms or
        NaN for an untimed frame)."""
        d = self.host.device
        vk.vkWaitForFences(d, 1, [self.fence], vk.VK_TRUE, 300 * 10**9)
        cpu_ms = (time.perf_counter() - t0) * 1e3
        vk.vkResetFences(d, 1, [self.fence])
        if not self._timed:
            return cpu_ms, float("nan")
        result = vk.lib.vkGetQueryPoolResults(d, self.queries, 0, 2, 16, self._stamps, 8,
                                              vk.VK_QUERY_RESULT_64_BIT)
        if result != vk.VK_SUCCESS:
            return cpu_ms, float("nan")
        gpu_ms = (self._stamps[1] - self._stamps[0]) * self.host.timestamp_period / 1e6
        return cpu_ms, gpu_ms

    def measure(self, frames: int = 6) -> float:
        """The median ms of a frame alone: GPU timestamps where plausible against the host's
        submit-to-fence time (lavapipe's can read wrong), else that time."""
        times = []
        for _ in range(frames + 1):
            wall, gpu = self.wait(self.render(timed=True))
            times.append(gpu if math.isfinite(gpu) and 0 < gpu <= wall + 0.5 else wall)
        return statistics.median(times[1:])  # the first one compiles the driver's shaders

    def close(self) -> None:
        """Destroy the renderer's objects; every frame must have been waited for."""
        d = self.host.device
        if d is None or self.pipeline is None:
            return
        vk.vkDestroyQueryPool(d, self.queries, None)
        vk.vkDestroyFence(d, self.fence, None)
        vk.vkFreeCommandBuffers(d, self.host.pool, 2, self.command_buffers)
        vk.vkDestroyPipeline(d, self.pipeline, None)
        vk.vkDestroyPipelineLayout(d, self.layout, None)
        vk.vkDestroyShaderModule(d, self.module, None)
        vk.vkDestroyImageView(d, self.view, None)
        vk.vkDestroyImage(d, self.image, None)
        vk.vkFreeMemory(d, self.memory, None)
        self.pipeline = None


def calibrated(host: VulkanHost, target_ms: float, size: int = 512, rounds: int = 4
               ) -> tuple[FullscreenLoad, float]:
    """A size x size load whose frame takes about `target_ms` on this device, and its measured
    ms: the iterations scaled from a measured probe (a frame's cost is about linear in them),
    a few rounds until within 10%."""
    iterations = 16
    for _ in range(rounds):
        load = FullscreenLoad(host, size, size, iterations)
        ms = load.measure()
        if abs(ms - target_ms) <= 0.1 * target_ms:
            break
        load.close()
        iterations = max(1, round(iterations * target_ms / max(ms, 1e-3)))
    else:
        load = FullscreenLoad(host, size, size, iterations)
        ms = load.measure()
    return load, ms
