"""Window mode: a GLFW window with a Vulkan swapchain. The host draws the scene and a panel (true
depth | predicted depth, colour-mapped on the GPU from its depth target and the image the model's
prediction lands in: xr_demo/panel.py), blits both into the swapchain image and presents it; the
model learns between frames on the same queue, reading the frames where they were rendered. With
--set-input the frames go through the CPU and the panel is made on the host and uploaded.
Close the window (or run --frames) to stop; the run's metrics JSON goes to the output folder, and
`--screenshot` grabs the screen (X) before closing; with the GPU panel, panels.npz holds it read
back after the loop beside session.read of the prediction it shows."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import vulkan as vk

from xr_demo import outputs
from xr_demo.app import Demo, Options, camera_frame
from xr_demo.colormap import depth_picture
from xr_demo.headless import Pacer, calibrate
from xr_demo.panel import DepthPanel, save_panels
from xr_demo.renderer import Compositor, SceneRenderer
from xr_demo.scene import Scene, desktop_camera
from xr_demo.vkhost import HostError, VulkanHost

ffi = vk.ffi
PREFERRED_FORMATS = (vk.VK_FORMAT_B8G8R8A8_UNORM, vk.VK_FORMAT_R8G8B8A8_UNORM,
                     vk.VK_FORMAT_B8G8R8A8_SRGB, vk.VK_FORMAT_R8G8B8A8_SRGB)


class Swapchain:
    def __init__(self, host: VulkanHost, surface: Any, width: int, height: int) -> None:
        self.host, self.surface = host, surface
        gipa = lambda n: vk.vkGetInstanceProcAddr(host.instance, n)  # noqa: E731
        gdpa = lambda n: vk.vkGetDeviceProcAddr(host.device, n)  # noqa: E731
        if not gipa("vkGetPhysicalDeviceSurfaceSupportKHR")(host.physical, host.family,
                                                            surface):
            raise HostError("the queue family cannot present to this window")
        caps = gipa("vkGetPhysicalDeviceSurfaceCapabilitiesKHR")(host.physical, surface)
        formats = gipa("vkGetPhysicalDeviceSurfaceFormatsKHR")(host.physical, surface)
        chosen = next((f for p in PREFERRED_FORMATS for f in formats if f.format == p),
                      formats[0])
        self.format = chosen.format
        if caps.currentExtent.width != 0xFFFFFFFF:
            width, height = caps.currentExtent.width, caps.currentExtent.height
        self.width, self.height = width, height
        if not caps.supportedUsageFlags & vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT:
            raise HostError("the swapchain's images cannot be blit destinations here")
        count = max(caps.minImageCount, 2)
        if caps.maxImageCount:
            count = min(count, caps.maxImageCount)
        info = vk.VkSwapchainCreateInfoKHR(
            sType=vk.VK_STRUCTURE_TYPE_SWAPCHAIN_CREATE_INFO_KHR, surface=surface,
            minImageCount=count, imageFormat=self.format, imageColorSpace=chosen.colorSpace,
            imageExtent=vk.VkExtent2D(width, height), imageArrayLayers=1,
            imageUsage=vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT
            | vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT,
            imageSharingMode=vk.VK_SHARING_MODE_EXCLUSIVE, preTransform=caps.currentTransform,
            compositeAlpha=vk.VK_COMPOSITE_ALPHA_OPAQUE_BIT_KHR,
            presentMode=vk.VK_PRESENT_MODE_FIFO_KHR, clipped=vk.VK_TRUE)
        self._create = gdpa("vkCreateSwapchainKHR")
        self._destroy = gdpa("vkDestroySwapchainKHR")
        self.acquire_fn = gdpa("vkAcquireNextImageKHR")
        self.present_fn = gdpa("vkQueuePresentKHR")
        self.swapchain = self._create(host.device, info, None)
        self.images = gdpa("vkGetSwapchainImagesKHR")(host.device, self.swapchain)
        # One "image available" semaphore per frame slot, one "rendered" per image.
        self.available = [host.semaphore() for _ in self.images]
        self.rendered = [host.semaphore() for _ in self.images]
        self._slot = 0

    def acquire(self) -> tuple[int, Any]:
        sem = self.available[self._slot]
        self._slot = (self._slot + 1) % len(self.available)
        index = self.acquire_fn(self.host.device, self.swapchain, 10**10, sem,
                                vk.VK_NULL_HANDLE)
        return index, sem

    def present(self, index: int) -> None:
        info = vk.VkPresentInfoKHR(
            sType=vk.VK_STRUCTURE_TYPE_PRESENT_INFO_KHR, waitSemaphoreCount=1,
            pWaitSemaphores=[self.rendered[index]], swapchainCount=1,
            pSwapchains=[self.swapchain], pImageIndices=[index])
        with self.host.queue_lock:  # presenting uses the queue: externally synchronized too
            self.present_fn(self.host.queue, info)

    def close(self) -> None:
        for s in (*self.available, *self.rendered):
            vk.vkDestroySemaphore(self.host.device, s, None)
        self._destroy(self.host.device, self.swapchain, None)


def panel_pixels(demo: Demo, resolution: int) -> np.ndarray:
    """--set-input's panel, made on the host: true depth of the latest frame | the latest
    prediction (black until the first)."""
    blank = np.zeros((resolution, resolution, 3), np.uint8)
    true = depth_picture(demo.latest[2]) if demo.latest is not None else blank
    preds = demo.run.predictions
    pred = depth_picture(preds[-1].depth) if preds else blank
    return np.concatenate([true, pred], 1)


def screenshot(path: str) -> None:
    """The X screen as a person would see it (Pillow grabs it over XCB)."""
    from PIL import ImageGrab

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    ImageGrab.grab(xdisplay=os.environ.get("DISPLAY")).save(path)


def run(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    import glfw

    if not glfw.init():
        raise HostError("glfw.init failed (no display? run under X or Xvfb)")
    window = None
    host = renderer = demo = compositor = swapchain = panel = None
    surface = None
    r = opts.resolution
    try:
        glfw.window_hint(glfw.CLIENT_API, glfw.NO_API)
        glfw.window_hint(glfw.RESIZABLE, glfw.FALSE)
        s = opts.window_scale
        window = glfw.create_window(3 * r * s, r * s, "vkml xr_demo: image | true depth | "
                                    "predicted depth", None, None)
        if not window:
            raise HostError("glfw.create_window failed")
        host = VulkanHost.create(instance_extensions=glfw.get_required_instance_extensions(),
                                 device_extensions=["VK_KHR_swapchain"])
        surface_p = ffi.new("VkSurfaceKHR*")
        result = glfw.create_window_surface(host.instance, window, None, surface_p)
        if result != vk.VK_SUCCESS:
            raise HostError(f"glfwCreateWindowSurface failed ({result})")
        surface = surface_p[0]
        swapchain = Swapchain(host, surface, 3 * r * s, r * s)
        renderer = SceneRenderer(host, r, r, Scene.build(opts.seed))
        compositor = Compositor(host, None if opts.zero_copy else (2 * r, r))
        compositor.check_format(swapchain.format)
        demo = Demo(host, opts, renderer, log)
        shows: list[int] = []  # the frames whose predictions were drawn, the latest last
        if opts.zero_copy:
            panel = DepthPanel(host, r)
            demo.on_prediction = shows.append
        demo.warm_gpu()  # the calibration below measures at the GPU's running clock
        render_ms, source, _ = calibrate(host, renderer)
        period_ms = 1000 / opts.hz if opts.hz else 0.0
        info = demo.prepare(period_ms, render_ms)
        log(f"window {swapchain.width}x{swapchain.height}, format {swapchain.format}, "
            f"{len(swapchain.images)} images; render {render_ms:.2f} ms ({source}); slack "
            f"{info['slack_ms']} ms")
        cb = host.command_buffers(1)[0]
        fence = host.fence()
        pacer = Pacer(opts.hz)
        presented = 0
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        try:
            for n in range(opts.frames):
                glfw.poll_events()
                if glfw.window_should_close(window):
                    break
                skipped, frame_start = pacer.wait()
                demo.begin_frame(n)
                if panel is None:
                    compositor.set_panel(panel_pixels(demo, r))
                index, available = swapchain.acquire()
                c = camera_frame(opts, n)
                vk.vkResetCommandBuffer(cb, 0)
                vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                    sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
                renderer.record(cb, desktop_camera(c), c / 72.0)
                if panel is not None:  # the latest prediction finished before this frame
                    panel.record(cb, renderer.depth, demo.drawable)
                w, h = swapchain.width, swapchain.height
                shown = panel.image if panel is not None else compositor.panel
                placements = [(renderer.color, (0, 0, w // 3, h)), (shown, (w // 3, 0, w, h))]
                compositor.record(cb, placements, swapchain.images[index],
                                  vk.VK_IMAGE_LAYOUT_UNDEFINED,
                                  vk.VK_IMAGE_LAYOUT_PRESENT_SRC_KHR,
                                  vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, 0)
                vk.vkEndCommandBuffer(cb)
                demo.fill_before_render(n)  # continuing steps' pieces, then the frame
                host.submit(cb, fence, wait=[(available, transfer)],
                            signal=[swapchain.rendered[index]])
                swapchain.present(index)
                presented += 1
                demo.fill(n)  # the model's pieces after the frame, on the same queue
                host.wait_fence(fence)
                frame_ms = (time.perf_counter() - frame_start) * 1e3  # slot to fence
                rgb, depth = renderer.read()  # zero_copy: for the metrics only
                gpu = renderer.gpu_ms() if demo.queries_readable() else None
                demo.end_frame(n, rgb, depth, frame_ms, gpu, skipped)
            if opts.screenshot:
                host.idle()
                time.sleep(0.2)  # let the X server show the last present
                screenshot(opts.screenshot)
                log(f"screenshot {os.path.abspath(opts.screenshot)}")
        finally:
            host.idle()
            vk.vkDestroyFence(host.device, fence, None)
            vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])
        demo.finish()
        if panel is not None:  # the panel as drawn, beside session.read of its prediction
            save_panels(demo, [(panel, renderer.depth, demo.drawable,
                                shows[-1] if shows else None)], opts.out)
        metrics = {"device": host.device_name, "mode": "window", "presented": presented,
                   "window": [swapchain.width, swapchain.height], "setup": info,
                   "run": demo.metrics(period_ms),
                   "validation_messages": list(host.messages),
                   "validating": host.messenger is not None}
        os.makedirs(opts.out, exist_ok=True)
        path = os.path.join(opts.out, "metrics_window.json")
        outputs.write_json(path, metrics)
        log(f"presented {presented} frames; metrics {os.path.abspath(path)}")
        return metrics
    finally:
        if panel is not None:
            panel.close()
        if demo is not None:
            demo.close()
        if compositor is not None:
            compositor.close()
        if renderer is not None:
            renderer.close()
        if swapchain is not None:
            swapchain.close()
        if host is not None:
            if surface is not None:
                vk.vkGetInstanceProcAddr(host.instance, "vkDestroySurfaceKHR")(
                    host.instance, surface, None)
            host.close()
        if window is not None:
            glfw.destroy_window(window)
        glfw.terminate()
