"""Training samples kept on the GPU (the zero-copy mode): a frame taken as a sample is copied
from the renderer's targets into a ring of images right after its render, and a training step
about to begin gets its sample copied into the two images bound to the trainer's inputs. So a
step trains on the frame it was given, whenever its first piece runs, as with set_input, and
nothing passes through system memory. The copies are the host's own commands on the shared
queue; each submission's global barriers order them against the renders and vkml's steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import vulkan as vk

from xr_demo.renderer import SceneRenderer, create_image, destroy_image
from xr_demo.vkhost import VulkanHost

GENERAL = vk.VK_IMAGE_LAYOUT_GENERAL
USAGE = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT | vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT


class SampleRing:
    """`size` sample slots (colour and linear depth) and the sample images a trainer binds
    (`colour`, `depth`: in GENERAL layout, TRANSFER_SRC | TRANSFER_DST)."""

    def __init__(self, host: VulkanHost, renderer: SceneRenderer, size: int) -> None:
        self.host, self.size = host, size
        r = renderer.width
        targets = (renderer.color, renderer.depth)
        self.slots = [[create_image(host, r, r, t.format, USAGE, view=False) for t in targets]
                      for _ in range(size)]
        self.colour, self.depth = (create_image(host, r, r, t.format, USAGE, view=False)
                                   for t in targets)
        self._fence = host.fence()
        self._capture = host.command_buffers(size)
        self._release = host.command_buffers(size)
        first = host.command_buffers(1)[0]
        self._record(first, [], [img.image for slot in self.slots for img in slot]
                     + [self.colour.image, self.depth.image])
        host.submit(first, self._fence)
        host.wait_fence(self._fence)
        vk.vkFreeCommandBuffers(host.device, host.pool, 1, [first])
        after_render = vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL
        for k, slot in enumerate(self.slots):
            self._record(self._capture[k], [(t.image, after_render, s.image, r)
                                            for t, s in zip(targets, slot)])
            self._record(self._release[k], [(s.image, GENERAL, d.image, r)
                                             for s, d in zip(slot, (self.colour, self.depth))])

    @staticmethod
    def _record(cb: Any, copies: list[tuple[Any, int, Any, int]],
                initial: Sequence[Any] = ()) -> None:
        """Image copies between global barriers over all stages; `initial`: images moved
        from UNDEFINED to GENERAL instead."""
        everything = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
        memory = vk.VK_ACCESS_MEMORY_READ_BIT | vk.VK_ACCESS_MEMORY_WRITE_BIT
        vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        barrier = vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                                     srcAccessMask=vk.VK_ACCESS_MEMORY_WRITE_BIT,
                                     dstAccessMask=memory)
        vk.vkCmdPipelineBarrier(cb, everything, everything, 0, 1, [barrier], 0, None, 0, None)
        if initial:
            vk.vkCmdPipelineBarrier(cb, everything, everything, 0, 0, None, 0, None,
                                    len(initial), [vk.VkImageMemoryBarrier(
                                        sType=vk.VK_STRUCTURE_TYPE_IMAGE_MEMORY_BARRIER,
                                        srcAccessMask=0, dstAccessMask=memory,
                                        oldLayout=vk.VK_IMAGE_LAYOUT_UNDEFINED,
                                        newLayout=GENERAL,
                                        srcQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
                                        dstQueueFamilyIndex=vk.VK_QUEUE_FAMILY_IGNORED,
                                        image=img, subresourceRange=vk.VkImageSubresourceRange(
                                            vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 1, 0, 1))
                                        for img in initial])
        layers = vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 0, 1)
        for src, layout, dst, r in copies:
            region = vk.VkImageCopy(srcSubresource=layers, srcOffset=vk.VkOffset3D(0, 0, 0),
                                    dstSubresource=layers, dstOffset=vk.VkOffset3D(0, 0, 0),
                                    extent=vk.VkExtent3D(r, r, 1))
            vk.vkCmdCopyImage(cb, src, layout, dst, GENERAL, 1, [region])
        vk.vkCmdPipelineBarrier(cb, everything, everything, 0, 1, [barrier], 0, None, 0, None)
        vk.vkEndCommandBuffer(cb)

    def capture(self, slot: int) -> None:
        """Queue the copy of the renderer's targets (the frame just rendered) into `slot`."""
        self.host.submit(self._capture[slot])

    def release(self, slot: int) -> None:
        """Queue the copy of `slot` into the trainer's sample images."""
        self.host.submit(self._release[slot])

    def close(self) -> None:
        self.host.idle()
        vk.vkFreeCommandBuffers(self.host.device, self.host.pool, 2 * self.size,
                                self._capture + self._release)
        vk.vkDestroyFence(self.host.device, self._fence, None)
        for img in [img for slot in self.slots for img in slot] + [self.colour, self.depth]:
            destroy_image(self.host, img)
