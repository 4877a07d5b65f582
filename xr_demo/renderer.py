"""The host's renderer: a Vulkan graphics pipeline (dynamic rendering, a depth buffer, two colour
targets: the shaded image and linear depth) drawing `scene.Scene`, with WGSL shaders compiled to
SPIR-V by vkml.vk.compile_wgsl. Each frame's command buffer is recorded by
`SceneRenderer.record()`; the sessions read its targets in place (bind_input), and it can end
with them copied to a host-visible buffer: `read()` after the frame's fence, for the metrics and
pictures, or as the network's input and target with --set-input.

`Compositor` puts frames on a screen: it blits the scene and a panel of depth images (drawn on
the GPU by xr_demo/panel.py, or uploaded from the host with --set-input) into a swapchain image
(GLFW) or an OpenXR swapchain image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import vulkan as vk

from vkml.vk import compile_wgsl
from xr_demo import graphics
from xr_demo.scene import FAR, SCENE_WGSL, SKY_CLEAR, VERTEX_FLOATS, Camera, Scene, push_constants
from xr_demo.vkhost import HostError, VulkanHost

ffi = vk.ffi
COLOR_FORMAT = vk.VK_FORMAT_R8G8B8A8_UNORM
DEPTH_TARGET_FORMAT = vk.VK_FORMAT_R32_SFLOAT  # linear depth, metres
ZBUFFER_FORMAT = vk.VK_FORMAT_D32_SFLOAT
COLOR_RANGE = vk.VkImageSubresourceRange(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 1, 0, 1)
DEPTH_RANGE = vk.VkImageSubresourceRange(vk.VK_IMAGE_ASPECT_DEPTH_BIT, 0, 1, 0, 1)
PUSH_BYTES = 112


@dataclass
class Image:
    image: Any
    memory: Any
    view: Any
    width: int
    height: int
    format: int


@dataclass
class Buffer:
    buffer: Any
    memory: Any
    size: int
    mapped: Any  # the whole buffer, mapped (a writable cffi buffer: host-visible, coherent)


def create_image(host: VulkanHost, width: int, height: int, fmt: int, usage: int,
                 aspect: int = vk.VK_IMAGE_ASPECT_COLOR_BIT, view: bool = True) -> Image:
    """A device-local 2-D image; with a view unless `view` is False (an image used only by
    copies and blits may not have one)."""
    d = host.device
    image = vk.vkCreateImage(d, vk.VkImageCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_IMAGE_CREATE_INFO, imageType=vk.VK_IMAGE_TYPE_2D,
        format=fmt, extent=vk.VkExtent3D(width, height, 1), mipLevels=1, arrayLayers=1,
        samples=vk.VK_SAMPLE_COUNT_1_BIT, tiling=vk.VK_IMAGE_TILING_OPTIMAL, usage=usage,
        sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE, initialLayout=vk.VK_IMAGE_LAYOUT_UNDEFINED),
        None)
    req = vk.vkGetImageMemoryRequirements(d, image)
    memory = vk.vkAllocateMemory(d, vk.VkMemoryAllocateInfo(
        sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=req.size,
        memoryTypeIndex=host.memory_type(req.memoryTypeBits,
                                         vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)), None)
    vk.vkBindImageMemory(d, image, memory, 0)
    handle = vk.vkCreateImageView(d, vk.VkImageViewCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_IMAGE_VIEW_CREATE_INFO, image=image,
        viewType=vk.VK_IMAGE_VIEW_TYPE_2D, format=fmt,
        subresourceRange=vk.VkImageSubresourceRange(aspect, 0, 1, 0, 1)), None) if view else None
    return Image(image, memory, handle, width, height, fmt)


def destroy_image(host: VulkanHost, img: Image) -> None:
    if img.view is not None:
        vk.vkDestroyImageView(host.device, img.view, None)
    vk.vkDestroyImage(host.device, img.image, None)
    vk.vkFreeMemory(host.device, img.memory, None)


def create_buffer(host: VulkanHost, size: int, usage: int) -> Buffer:
    """A host-visible, coherent buffer, mapped for its whole life (vertex data, read-backs,
    uploads: small, and written or read by the host every frame)."""
    d = host.device
    buf = vk.vkCreateBuffer(d, vk.VkBufferCreateInfo(
        sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size, usage=usage,
        sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
    req = vk.vkGetBufferMemoryRequirements(d, buf)
    want = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
    memory = vk.vkAllocateMemory(d, vk.VkMemoryAllocateInfo(
        sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO, allocationSize=req.size,
        memoryTypeIndex=host.memory_type(req.memoryTypeBits, want)), None)
    vk.vkBindBufferMemory(d, buf, memory, 0)
    mapped = vk.vkMapMemory(d, memory, 0, size, 0)
    return Buffer(buf, memory, size, mapped)


def destroy_buffer(host: VulkanHost, buf: Buffer) -> None:
    vk.vkUnmapMemory(host.device, buf.memory)
    vk.vkDestroyBuffer(host.device, buf.buffer, None)
    vk.vkFreeMemory(host.device, buf.memory, None)


def image_barrier(cb: Any, image: Any, old: int, new: int, src_stage: int, dst_stage: int,
                  src_access: int, dst_access: int, subresource: Any = COLOR_RANGE) -> None:
    barrier = vk.VkImageMemoryBarrier(
        sType=vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER, srcAccessMask=src_access,
        dstAccessMask=dst_access, oldLayout=old, newLayout=new,
        srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
        dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, image=image,
        subresourceRange=subresource)
    vk.vkCmdPipelineBarrier(cb, src_stage, dst_stage, 0, 0, None, 0, None, 1, [barrier])


class SceneRenderer:
    """Draws the scene into its own targets (colour RGBA8, linear depth R32F, a D32 depth
    buffer) at width x height; after record(), the colour target is in TRANSFER_SRC_OPTIMAL
    layout (for Compositor's blits) and, when asked, both targets are in the read-back
    buffer."""

    def __init__(self, host: VulkanHost, width: int, height: int, scene: Scene) -> None:
        self.host, self.width, self.height = host, width, height
        d = host.device
        self._objects: list[Any] = []
        src = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT
        self.color = create_image(host, width, height, COLOR_FORMAT,
                                  vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT | src)
        self.depth = create_image(host, width, height, DEPTH_TARGET_FORMAT,  # sampled: panel.py
                                  vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT | src
                                  | vk.VK_IMAGE_USAGE_SAMPLED_BIT)
        zprops = vk.vkGetPhysicalDeviceFormatProperties(host.physical, ZBUFFER_FORMAT)
        if not zprops.optimalTilingFeatures & vk.VK_FORMAT_FEATURE_DEPTH_STENCIL_ATTACHMENT_BIT:
            raise HostError("the device cannot render to D32_SFLOAT depth buffers")
        self.zbuffer = create_image(host, width, height, ZBUFFER_FORMAT,
                                    vk.VK_IMAGE_USAGE_DEPTH_STENCIL_ATTACHMENT_BIT,
                                    vk.VK_IMAGE_ASPECT_DEPTH_BIT)
        # Geometry: uploaded once into host-visible buffers (small; read by the GPU each frame).
        self.index_count = len(scene.indices)
        self.vertices = create_buffer(host, scene.vertices.nbytes,
                                      vk.VK_BUFFER_USAGE_VERTEX_BUFFER_BIT)
        self.vertices.mapped[:] = scene.vertices.tobytes()
        self.indices = create_buffer(host, scene.indices.nbytes,
                                     vk.VK_BUFFER_USAGE_INDEX_BUFFER_BIT)
        self.indices.mapped[:] = scene.indices.tobytes()
        self.pixels = width * height
        self.readback = create_buffer(host, 8 * self.pixels,
                                      vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        self.queries = vk.vkCreateQueryPool(d, vk.VkQueryPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=2), None)
        self._stamps = ffi.new("uint64_t[2]")
        self._timed = False
        self._pipeline(width, height)

    def _pipeline(self, width: int, height: int) -> None:
        d = self.host.device
        spirv = compile_wgsl(SCENE_WGSL, "xr_demo_scene")
        self.module = vk.vkCreateShaderModule(d, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv),
            pCode=spirv), None)
        stages_mask = vk.VK_SHADER_STAGE_VERTEX_BIT | vk.VK_SHADER_STAGE_FRAGMENT_BIT
        push = vk.VkPushConstantRange(stageFlags=stages_mask, offset=0, size=PUSH_BYTES)
        self.layout = vk.vkCreatePipelineLayout(d, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, pushConstantRangeCount=1,
            pPushConstantRanges=[push]), None)
        # Every nested struct in a variable that outlives the call (cffi lifetime trap).
        formats = [COLOR_FORMAT, DEPTH_TARGET_FORMAT]
        rendering = vk.VkPipelineRenderingCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_RENDERING_CREATE_INFO, colorAttachmentCount=2,
            pColorAttachmentFormats=formats, depthAttachmentFormat=ZBUFFER_FORMAT)
        binding = vk.VkVertexInputBindingDescription(
            binding=0, stride=4 * VERTEX_FLOATS, inputRate=vk.VK_VERTEX_INPUT_RATE_VERTEX)
        attributes = [
            vk.VkVertexInputAttributeDescription(location=0, binding=0, offset=0,
                                                 format=vk.VK_FORMAT_R32G32B32_SFLOAT),
            vk.VkVertexInputAttributeDescription(location=1, binding=0, offset=12,
                                                 format=vk.VK_FORMAT_R32G32B32_SFLOAT),
            vk.VkVertexInputAttributeDescription(location=2, binding=0, offset=24,
                                                 format=vk.VK_FORMAT_R32G32B32_SFLOAT),
            vk.VkVertexInputAttributeDescription(location=3, binding=0, offset=36,
                                                 format=vk.VK_FORMAT_R32_SFLOAT)]
        vertex = vk.VkPipelineVertexInputStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_VERTEX_INPUT_STATE_CREATE_INFO,
            vertexBindingDescriptionCount=1, pVertexBindingDescriptions=[binding],
            vertexAttributeDescriptionCount=len(attributes),
            pVertexAttributeDescriptions=attributes)
        depth = vk.VkPipelineDepthStencilStateCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_DEPTH_STENCIL_STATE_CREATE_INFO,
            depthTestEnable=vk.VK_TRUE, depthWriteEnable=vk.VK_TRUE,
            depthCompareOp=vk.VK_COMPARE_OP_LESS)
        self.pipeline = graphics.create_pipeline(d, self.module, self.layout, width, height,
                                                 rendering, vertex, colors=2, depth=depth)

    def record(self, cb: Any, camera: Camera, time_s: float, readback: bool = True,
               timestamps: bool = True) -> None:
        """Record the scene pass into `cb` (begun by the caller). `timestamps`: two queries
        around it, read by gpu_ms() once the frame's fence has signalled."""
        self._timed = timestamps
        color_stage = vk.VK_PIPELINE_STAGE_COLOR_ATTACHMENT_OUTPUT_BIT
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        tests = (vk.VK_PIPELINE_STAGE_EARLY_FRAGMENT_TESTS_BIT
                 | vk.VK_PIPELINE_STAGE_LATE_FRAGMENT_TESTS_BIT)
        attachment = vk.VK_IMAGE_LAYOUT_COLOR_ATTACHMENT_OPTIMAL
        write = vk.VK_ACCESS_COLOR_ATTACHMENT_WRITE_BIT
        if timestamps:
            vk.vkCmdResetQueryPool(cb, self.queries, 0, 2)
            vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self.queries, 0)
        # The previous frame's copies and blits read these targets: wait for them (a
        # write-after-read hazard needs only the execution dependency), then discard.
        for img in (self.color, self.depth):
            image_barrier(cb, img.image, vk.VK_IMAGE_LAYOUT_UNDEFINED, attachment,
                          transfer | color_stage, color_stage, 0, write)
        depth_write = vk.VK_ACCESS_DEPTH_STENCIL_ATTACHMENT_WRITE_BIT
        image_barrier(cb, self.zbuffer.image, vk.VK_IMAGE_LAYOUT_UNDEFINED,
                      vk.VK_IMAGE_LAYOUT_DEPTH_ATTACHMENT_OPTIMAL, tests, tests, depth_write,
                      depth_write | vk.VK_ACCESS_DEPTH_STENCIL_ATTACHMENT_READ_BIT,
                      DEPTH_RANGE)
        sky = vk.VkClearValue(color=vk.VkClearColorValue(float32=list(SKY_CLEAR)))
        far = vk.VkClearValue(color=vk.VkClearColorValue(float32=[FAR, 0.0, 0.0, 1.0]))
        targets = [vk.VkRenderingAttachmentInfo(
            sType=vk.VK_STRUCTURE_TYPE_RENDERING_ATTACHMENT_INFO, imageView=img.view,
            imageLayout=attachment, loadOp=vk.VK_ATTACHMENT_LOAD_OP_CLEAR,
            storeOp=vk.VK_ATTACHMENT_STORE_OP_STORE, clearValue=clear)
            for img, clear in ((self.color, sky), (self.depth, far))]
        zclear = vk.VkClearValue(depthStencil=vk.VkClearDepthStencilValue(1.0, 0))
        ztarget = vk.VkRenderingAttachmentInfo(
            sType=vk.VK_STRUCTURE_TYPE_RENDERING_ATTACHMENT_INFO, imageView=self.zbuffer.view,
            imageLayout=vk.VK_IMAGE_LAYOUT_DEPTH_ATTACHMENT_OPTIMAL,
            loadOp=vk.VK_ATTACHMENT_LOAD_OP_CLEAR, storeOp=vk.VK_ATTACHMENT_STORE_OP_DONT_CARE,
            clearValue=zclear)
        area = vk.VkRect2D(vk.VkOffset2D(0, 0), vk.VkExtent2D(self.width, self.height))
        rendering = vk.VkRenderingInfo(sType=vk.VK_STRUCTURE_TYPE_RENDERING_INFO,
                                       renderArea=area, layerCount=1, colorAttachmentCount=2,
                                       pColorAttachments=targets, pDepthAttachment=ztarget)
        vk.vkCmdBeginRendering(cb, rendering)
        vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_GRAPHICS, self.pipeline)
        vk.vkCmdBindVertexBuffers(cb, 0, 1, [self.vertices.buffer], [0])
        vk.vkCmdBindIndexBuffer(cb, self.indices.buffer, 0, vk.VK_INDEX_TYPE_UINT32)
        data = ffi.new("char[]", push_constants(camera, time_s))
        vk.vkCmdPushConstants(cb, self.layout, vk.VK_SHADER_STAGE_VERTEX_BIT
                              | vk.VK_SHADER_STAGE_FRAGMENT_BIT, 0, PUSH_BYTES, data)
        vk.vkCmdDrawIndexed(cb, self.index_count, 1, 0, 0, 0)
        vk.vkCmdEndRendering(cb)
        for img in (self.color, self.depth):
            image_barrier(cb, img.image, attachment, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL,
                          color_stage, transfer, write, vk.VK_ACCESS_TRANSFER_READ_BIT)
        if readback:
            layers = vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 0, 1)
            for k, img in enumerate((self.color, self.depth)):
                region = vk.VkBufferImageCopy(
                    bufferOffset=4 * self.pixels * k, bufferRowLength=0, bufferImageHeight=0,
                    imageSubresource=layers, imageOffset=vk.VkOffset3D(0, 0, 0),
                    imageExtent=vk.VkExtent3D(self.width, self.height, 1))
                vk.vkCmdCopyImageToBuffer(cb, img.image, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL,
                                          self.readback.buffer, 1, [region])
            host_read = vk.VkBufferMemoryBarrier(
                sType=vk.VK_STRUCTURE_TYPE_BUFFER_MEMORY_BARRIER,
                srcAccessMask=vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT,
                srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
                dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED, buffer=self.readback.buffer,
                offset=0, size=self.readback.size)
            vk.vkCmdPipelineBarrier(cb, transfer, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 0, None, 1,
                                    [host_read], 0, None)
        if timestamps:
            vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.queries, 1)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """The last frame's image (H, W, 3) uint8 and linear depth (H, W) float32 metres; call
        after the frame's fence."""
        raw = self.readback.mapped
        rgba = np.frombuffer(raw, np.uint8, 4 * self.pixels).reshape(self.height, self.width, 4)
        depth = np.frombuffer(raw, np.float32, self.pixels, 4 * self.pixels)
        return rgba[..., :3].copy(), depth.reshape(self.height, self.width).copy()

    def gpu_ms(self) -> float | None:
        """GPU time of the last recorded frame from its timestamps (None if not timed or not
        available); call after the frame's fence."""
        if not self._timed or not self.host.timestamp_bits:
            return None
        result = vk.lib.vkGetQueryPoolResults(self.host.device, self.queries, 0, 2, 16,
                                              self._stamps, 8, vk.VK_QUERY_RESULT_64_BIT)
        if result != vk.VK_SUCCESS:
            return None
        return (self._stamps[1] - self._stamps[0]) * self.host.timestamp_period / 1e6

    def close(self) -> None:
        h, d = self.host, self.host.device
        if d is None or self.pipeline is None:
            return
        vk.vkDestroyPipeline(d, self.pipeline, None)
        vk.vkDestroyPipelineLayout(d, self.layout, None)
        vk.vkDestroyShaderModule(d, self.module, None)
        vk.vkDestroyQueryPool(d, self.queries, None)
        for img in (self.color, self.depth, self.zbuffer):
            destroy_image(h, img)
        for buf in (self.vertices, self.indices, self.readback):
            destroy_buffer(h, buf)
        self.pipeline = None


class Compositor:
    """Puts a frame on a screen image: the rendered scene and depth panels side by side, by
    vkCmdBlitImage (scaling and converting to the screen's format). With `panel_size` (width,
    height) it also owns a panel of host-made pixels (set_panel), uploaded through a mapped
    buffer when it changes."""

    def __init__(self, host: VulkanHost, panel_size: tuple[int, int] | None = None) -> None:
        self.host = host
        self.panel: Image | None = None
        if panel_size is None:
            return
        panel_width, panel_height = panel_size
        self.panel = create_image(host, panel_width, panel_height, COLOR_FORMAT,
                                  vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT
                                  | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT, view=False)
        self.staging = create_buffer(host, 4 * panel_width * panel_height,
                                     vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT)
        # The panel starts undefined: its first use uploads black pixels unless set_panel came
        # first.
        self.staging.mapped[:] = bytes(self.staging.size)
        self._dirty = True
        self._initialised = False

    def set_panel(self, rgb: np.ndarray) -> None:
        """New panel pixels (H, W, 3) uint8, uploaded by the next record(). The previous frame
        must have finished (the caller waits for its fence before building the next)."""
        assert self.panel is not None, "Compositor made without a panel_size"
        h, w = self.panel.height, self.panel.width
        if rgb.shape != (h, w, 3):
            raise ValueError(f"panel is {(h, w, 3)}, got {rgb.shape}")
        rgba = np.empty((h, w, 4), np.uint8)
        rgba[..., :3], rgba[..., 3] = rgb, 255
        self.staging.mapped[:] = rgba.tobytes()
        self._dirty = True

    def check_format(self, fmt: int) -> None:
        props = vk.vkGetPhysicalDeviceFormatProperties(self.host.physical, fmt)
        if not props.optimalTilingFeatures & vk.VK_FORMAT_FEATURE_BLIT_DST_BIT:
            raise HostError(f"the screen's format {fmt} cannot be a blit destination here")

    def record(self, cb: Any, placements: list[tuple[Image, tuple[int, int, int, int]]],
               dst: Any, old_layout: int, new_layout: int, dst_stage: int,
               dst_access: int) -> None:
        """Blit each (source, (x0, y0, x1, y1)) of `placements` into `dst`, scaled; sources
        are in TRANSFER_SRC_OPTIMAL: the scene's colour target (after SceneRenderer.record),
        a DepthPanel's image (after its record) or `self.panel`. `dst` goes from `old_layout`
        to `new_layout`, ready for `dst_stage` (present: BOTTOM_OF_PIPE and no access; an
        OpenXR swapchain: colour attachment)."""
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        if self.panel is not None and self._dirty and \
                any(src is self.panel for src, _ in placements):
            old = (vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL if self._initialised
                   else vk.VK_IMAGE_LAYOUT_UNDEFINED)
            image_barrier(cb, self.panel.image, old, vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL,
                          transfer, transfer, 0, vk.VK_ACCESS_TRANSFER_WRITE_BIT)
            region = vk.VkBufferImageCopy(
                bufferOffset=0, bufferRowLength=0, bufferImageHeight=0,
                imageSubresource=vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0,
                                                             0, 1),
                imageOffset=vk.VkOffset3D(0, 0, 0),
                imageExtent=vk.VkExtent3D(self.panel.width, self.panel.height, 1))
            vk.vkCmdCopyBufferToImage(cb, self.staging.buffer, self.panel.image,
                                      vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL, 1, [region])
            image_barrier(cb, self.panel.image, vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL,
                          vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL, transfer, transfer,
                          vk.VK_ACCESS_TRANSFER_WRITE_BIT, vk.VK_ACCESS_TRANSFER_READ_BIT)
            self._dirty, self._initialised = False, True
        image_barrier(cb, dst, old_layout, vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL,
                      vk.VK_PIPELINE_STAGE_COLOR_ATTACHMENT_OUTPUT_BIT | transfer, transfer, 0,
                      vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        layers = vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 0, 1)
        for src, (x0, y0, x1, y1) in placements:
            blit = vk.VkImageBlit(
                srcSubresource=layers,
                srcOffsets=[vk.VkOffset3D(0, 0, 0), vk.VkOffset3D(src.width, src.height, 1)],
                dstSubresource=layers,
                dstOffsets=[vk.VkOffset3D(x0, y0, 0), vk.VkOffset3D(x1, y1, 1)])
            vk.vkCmdBlitImage(cb, src.image, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL, dst,
                              vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL, 1, [blit],
                              vk.VK_FILTER_NEAREST)
        image_barrier(cb, dst, vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL, new_layout, transfer,
                      dst_stage, vk.VK_ACCESS_TRANSFER_WRITE_BIT, dst_access)

    def close(self) -> None:
        if self.host.device is None or self.panel is None:
            return
        destroy_image(self.host, self.panel)
        destroy_buffer(self.host, self.staging)
        self.panel = None
