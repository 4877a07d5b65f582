"""The depth panel drawn on the GPU: a compute pass that colour-maps two r32_float images, the
renderer's linear depth (true depth, metres) and the prediction the model's step wrote with
bind_output (depth / FAR), side by side into an RGBA8 image the compositor blits to the screen.
Recorded by the host into its frame's command buffer after its render; vkml's output program
ends with a barrier over every stage, so a prediction finished earlier on the queue is complete
and visible here, and one still in flight leaves the previous one in place. The colours are
xr_demo/colormap.py's (the same polynomial, evaluated in f32)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import vulkan as vk

from vkml.vk import compile_wgsl
from xr_demo.colormap import turbo_wgsl
from xr_demo.renderer import (
    COLOR_FORMAT,
    Image,
    create_buffer,
    create_image,
    destroy_buffer,
    destroy_image,
    image_barrier,
)
from xr_demo.vkhost import VulkanHost

if TYPE_CHECKING:
    from xr_demo.app import Demo

NONE_YET = -1.0  # a prediction image's value before the first prediction: drawn black
READABLE = vk.VK_IMAGE_LAYOUT_SHADER_READ_ONLY_OPTIMAL
GROUP = 8

SHADER = turbo_wgsl() + """
@group(0) @binding(0) var true_depth: texture_2d<f32>;
@group(0) @binding(1) var predicted: texture_2d<f32>;
@group(0) @binding(2) var panel: texture_storage_2d<rgba8unorm, write>;

@compute @workgroup_size(GROUP, GROUP)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let size = textureDimensions(true_depth);
    if (id.x >= 2u * size.x || id.y >= size.y) {
        return;
    }
    var colour = vec4<f32>(0.0, 0.0, 0.0, 1.0);
    if (id.x < size.x) {
        let metres = textureLoad(true_depth, vec2<i32>(id.xy), 0).r;
        colour = vec4<f32>(depth_colour(metres), 1.0);
    } else {
        let v = textureLoad(predicted, vec2<i32>(i32(id.x - size.x), i32(id.y)), 0).r;
        if (v >= 0.0) {  // false for NONE_YET and NaN
            colour = vec4<f32>(depth_colour(v * FAR), 1.0);
        }
    }
    textureStore(panel, vec2<i32>(id.xy), colour);
}
""".replace("GROUP", str(GROUP))


def clear_prediction(cb: Any, image: Any) -> None:
    """Record: an r32_float prediction image (TRANSFER_DST usage) from UNDEFINED to NONE_YET
    everywhere, left in SHADER_READ_ONLY_OPTIMAL (where DepthPanel samples it)."""
    dst = vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL
    transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    image_barrier(cb, image, vk.VK_IMAGE_LAYOUT_UNDEFINED, dst,
                  vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, transfer, 0,
                  vk.VK_ACCESS_TRANSFER_WRITE_BIT)
    value = vk.VkClearColorValue(float32=[NONE_YET, 0.0, 0.0, 0.0])
    vk.vkCmdClearColorImage(cb, image, dst, value, 1, [vk.VkImageSubresourceRange(
        vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 1, 0, 1)])
    image_barrier(cb, image, dst, READABLE, transfer, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT,
                  vk.VK_ACCESS_TRANSFER_WRITE_BIT, vk.VK_ACCESS_MEMORY_READ_BIT)


class DepthPanel:
    """An RGBA8 image of 2r x r (true depth | prediction), drawn by record(); after it the
    image is in TRANSFER_SRC_OPTIMAL, as Compositor's sources are."""

    def __init__(self, host: VulkanHost, size: int) -> None:
        self.host, self.size = host, size
        d = host.device
        self.image = create_image(host, 2 * size, size, COLOR_FORMAT,
                                  vk.VK_IMAGE_USAGE_STORAGE_BIT
                                  | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT)
        spirv = compile_wgsl(SHADER, "xr_demo_depth_panel")
        self.module = vk.vkCreateShaderModule(d, vk.VkShaderModuleCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, codeSize=len(spirv),
            pCode=spirv), None)
        compute = vk.VK_SHADER_STAGE_COMPUTE_BIT
        bindings = [vk.VkDescriptorSetLayoutBinding(
            binding=i, descriptorType=kind, descriptorCount=1, stageFlags=compute)
            for i, kind in enumerate((vk.VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE,
                                      vk.VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE,
                                      vk.VK_DESCRIPTOR_TYPE_STORAGE_IMAGE))]
        self.set_layout = vk.vkCreateDescriptorSetLayout(d, vk.VkDescriptorSetLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
            bindingCount=len(bindings), pBindings=bindings), None)
        self.layout = vk.vkCreatePipelineLayout(d, vk.VkPipelineLayoutCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, setLayoutCount=1,
            pSetLayouts=[self.set_layout]), None)
        stage = vk.VkPipelineShaderStageCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, stage=compute,
            module=self.module, pName="main")
        self.pipeline = vk.vkCreateComputePipelines(d, vk.VK_NULL_HANDLE, 1, [
            vk.VkComputePipelineCreateInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, stage=stage,
                layout=self.layout)], None)[0]
        # One set per (true depth, prediction) pair drawn: XR's eyes swap renderers.
        self.max_sets = 4
        sizes = [vk.VkDescriptorPoolSize(vk.VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE, 2 * self.max_sets),
                 vk.VkDescriptorPoolSize(vk.VK_DESCRIPTOR_TYPE_STORAGE_IMAGE, self.max_sets)]
        self.pool = vk.vkCreateDescriptorPool(d, vk.VkDescriptorPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO, maxSets=self.max_sets,
            poolSizeCount=len(sizes), pPoolSizes=sizes), None)
        self._sets: dict[tuple[int, int], Any] = {}

    def _set(self, true_depth: Image, prediction: Image) -> Any:
        key = (int(vk.ffi.cast("uintptr_t", true_depth.view)),
               int(vk.ffi.cast("uintptr_t", prediction.view)))
        if key in self._sets:
            return self._sets[key]
        if len(self._sets) == self.max_sets:
            raise ValueError(f"DepthPanel draws at most {self.max_sets} pairs of images")
        d = self.host.device
        ds = vk.vkAllocateDescriptorSets(d, vk.VkDescriptorSetAllocateInfo(
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO, descriptorPool=self.pool,
            descriptorSetCount=1, pSetLayouts=[self.set_layout]))[0]
        infos = [vk.VkDescriptorImageInfo(imageView=true_depth.view, imageLayout=READABLE),
                 vk.VkDescriptorImageInfo(imageView=prediction.view, imageLayout=READABLE),
                 vk.VkDescriptorImageInfo(imageView=self.image.view,
                                          imageLayout=vk.VK_IMAGE_LAYOUT_GENERAL)]
        kinds = (vk.VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE, vk.VK_DESCRIPTOR_TYPE_SAMPLED_IMAGE,
                 vk.VK_DESCRIPTOR_TYPE_STORAGE_IMAGE)
        writes = [vk.VkWriteDescriptorSet(
            sType=vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, dstSet=ds, dstBinding=i,
            descriptorCount=1, descriptorType=kind, pImageInfo=[info])
            for i, (kind, info) in enumerate(zip(kinds, infos))]
        vk.vkUpdateDescriptorSets(d, len(writes), writes, 0, None)
        self._sets[key] = ds
        return ds

    def record(self, cb: Any, true_depth: Image, prediction: Image) -> None:
        """Record the pass into `cb`: `true_depth` is a SceneRenderer's depth target (in
        TRANSFER_SRC_OPTIMAL after its record(), and left there), `prediction` an r32_float
        image in SHADER_READ_ONLY_OPTIMAL (the bound output, or a copy of it)."""
        ds = self._set(true_depth, prediction)
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        shader = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        after_render = vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL
        image_barrier(cb, true_depth.image, after_render, READABLE,
                      transfer | vk.VK_PIPELINE_STAGE_COLOR_ATTACHMENT_OUTPUT_BIT, shader,
                      vk.VK_ACCESS_COLOR_ATTACHMENT_WRITE_BIT, vk.VK_ACCESS_SHADER_READ_BIT)
        # The previous frame's blit read the panel: wait for it, then discard.
        image_barrier(cb, self.image.image, vk.VK_IMAGE_LAYOUT_UNDEFINED,
                      vk.VK_IMAGE_LAYOUT_GENERAL, transfer, shader, 0,
                      vk.VK_ACCESS_SHADER_WRITE_BIT)
        vk.vkCmdBindPipeline(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.pipeline)
        vk.vkCmdBindDescriptorSets(cb, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1,
                                   [ds], 0, None)
        groups = -(-self.size // GROUP)
        vk.vkCmdDispatch(cb, 2 * groups, groups, 1)
        image_barrier(cb, true_depth.image, READABLE, after_render, shader, transfer, 0,
                      vk.VK_ACCESS_TRANSFER_READ_BIT)
        image_barrier(cb, self.image.image, vk.VK_IMAGE_LAYOUT_GENERAL, after_render, shader,
                      transfer, vk.VK_ACCESS_SHADER_WRITE_BIT, vk.VK_ACCESS_TRANSFER_READ_BIT)

    def read_now(self, cb: Any, fence: Any) -> np.ndarray:
        """The panel's pixels (r, 2r, 3) uint8 as the last record() drew them (blocking; for
        checks outside the frame loop)."""
        h, w = self.size, 2 * self.size
        staging = create_buffer(self.host, 4 * w * h, vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        try:
            region = vk.VkBufferImageCopy(
                bufferOffset=0, bufferRowLength=0, bufferImageHeight=0,
                imageSubresource=vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0,
                                                             0, 1),
                imageOffset=vk.VkOffset3D(0, 0, 0), imageExtent=vk.VkExtent3D(w, h, 1))
            self.host.run_now(cb, fence, lambda c: vk.vkCmdCopyImageToBuffer(
                c, self.image.image, vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL, staging.buffer,
                1, [region]))
            rgba = np.frombuffer(staging.mapped, np.uint8, 4 * w * h).reshape(h, w, 4)
            return rgba[..., :3].copy()
        finally:
            destroy_buffer(self.host, staging)

    def close(self) -> None:
        d = self.host.device
        if d is None or self.pipeline is None:
            return
        vk.vkDestroyDescriptorPool(d, self.pool, None)
        vk.vkDestroyPipeline(d, self.pipeline, None)
        vk.vkDestroyPipelineLayout(d, self.layout, None)
        vk.vkDestroyDescriptorSetLayout(d, self.set_layout, None)
        vk.vkDestroyShaderModule(d, self.module, None)
        destroy_image(self.host, self.image)
        self.pipeline = None


def save_panels(demo: Demo, shown: Sequence[tuple[DepthPanel, Image, Image, int | None]],
                out: str) -> None:
    """After the loop, for each (panel, true depth, prediction image, the frame that image's
    prediction saw): the panel drawn once more and read back (`drawn_k`), beside the
    prediction session.read gave for that frame in metres (`read_k`, where the run kept it),
    into `out`/panels.npz; the tests compare them through colormap.depth_picture."""
    host = demo.host
    cb, fence = host.command_buffers(1)[0], host.fence()
    by_frame = {p.frame: p.depth for p in demo.run.predictions}
    arrays: dict[str, np.ndarray] = {}
    try:
        for k, (panel, true_depth, prediction, frame) in enumerate(shown):
            host.run_now(cb, fence, lambda c, panel=panel, t=true_depth, p=prediction:
                         panel.record(c, t, p))
            arrays[f"drawn_{k}"] = panel.read_now(cb, fence)
            if frame in by_frame:
                arrays[f"read_{k}"] = by_frame[frame]
    finally:
        vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])
        vk.vkDestroyFence(host.device, fence, None)
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "panels.npz"), **arrays)
