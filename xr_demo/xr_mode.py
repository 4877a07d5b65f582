"""XR mode: OpenXR through pyopenxr with XR_KHR_vulkan_enable2. The runtime dictates the Vulkan
instance, physical device and device (created through xrCreateVulkanInstanceKHR /
xrCreateVulkanDeviceKHR from the host's own create infos, so the same features are on); vkml
adopts that device and queue with Device.from_vulkan. Two eyes, one swapchain each; xrWaitFrame
paces everything: the model's pieces fill the slack of the runtime's frame period.

Both eyes feed the model, one inference each in turn: the renderer whose targets the sessions
read (bind_input) draws the eye whose turn it is, the other renderer the other eye, so an
inference and the training samples of its frames see that eye with no copy, and every inference
costs the same (one eye, one step: the frame time stays as predictable as with one eye; a batch
of both eyes would double each step, and the images would need a copy into one input). Each
eye's latest prediction is copied from the image the model writes (bind_output) into that eye's
own r32_float image when harvested, and drawn on the GPU in the eye's lower right (xr_demo/
panel.py); after the loop each eye's panel is read back beside session.read of the prediction
it shows (panels.npz). With --set-input the left eye alone feeds the model, through the CPU,
and its panel is made on the host, as before.

xrBeginFrame, xrEndFrame and swapchain acquire/release may use the app's VkQueue inside the
runtime, so they are called holding the queue lock, as every vkQueueSubmit is (the host's and
vkml's)."""

from __future__ import annotations

import ctypes
import importlib
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import vulkan as vk
import xr

from xr_demo import outputs
from xr_demo.app import Demo, Options, pct
from xr_demo.headless import calibrate
from xr_demo.panel import READABLE, DepthPanel, clear_prediction, save_panels
from xr_demo.renderer import (
    Compositor,
    Image,
    SceneRenderer,
    create_image,
    destroy_image,
    image_barrier,
)
from xr_demo.scene import Scene, pose_matrix, xr_camera
from xr_demo.vkhost import (
    HostError,
    VulkanHost,
    device_create_info,
    instance_create_info,
    universal_family,
)
from xr_demo.window import panel_pixels

ffi = vk.ffi
# pyopenxr's ctypes stand-ins for the Vulkan structs (VkInstanceCreateInfo, ...) live in its
# platform module.
xrp = importlib.import_module(xr.VulkanInstanceCreateInfoKHR.__module__)
FORMATS = (vk.VK_FORMAT_R8G8B8A8_UNORM, vk.VK_FORMAT_B8G8R8A8_UNORM, vk.VK_FORMAT_R8G8B8A8_SRGB,
           vk.VK_FORMAT_B8G8R8A8_SRGB)


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _as_ctypes(cdata: Any, ctype: Any) -> Any:
    """A cffi struct (or pointer to one) as a ctypes POINTER(ctype) to the same memory."""
    if ffi.typeof(cdata).kind == "struct":
        cdata = ffi.addressof(cdata)
    address = int(ffi.cast("uintptr_t", cdata))
    return ctypes.cast(ctypes.c_void_p(address), ctypes.POINTER(ctype))


class XrSession:
    """Instance, system, the Vulkan objects the runtime asked for, session, space, swapchains."""

    def __init__(self, size: int, log: Callable[[str], None]) -> None:
        try:
            self.instance = xr.create_instance(xr.InstanceCreateInfo(
                application_info=xr.ApplicationInfo(
                    application_name="vkml xr_demo", application_version=1, engine_name="vkml",
                    engine_version=1, api_version=xr.Version(1, 0, 0)),
                enabled_extension_names=[xr.KHR_VULKAN_ENABLE2_EXTENSION_NAME]))
        except (xr.RuntimeUnavailableError, xr.RuntimeFailureError) as e:
            raise HostError(
                f"no OpenXR runtime to run on ({type(e).__name__}): install one and start it "
                "(`make monado` provisions Monado in a chroot; README, The demo), or run "
                "--headless or --window") from e
        props = xr.get_instance_properties(self.instance)
        self.system = xr.get_system(self.instance, xr.SystemGetInfo(
            form_factor=xr.FormFactor.HEAD_MOUNTED_DISPLAY))
        system_name = xr.get_system_properties(self.instance, self.system).system_name.decode()
        self.runtime = f"{props.runtime_name.decode()} ({system_name})"
        log(f"OpenXR runtime: {self.runtime}")
        # The runtime's Vulkan requirements must be queried before creating the device.
        pfn = ctypes.cast(xr.get_instance_proc_addr(
            self.instance, "xrGetVulkanGraphicsRequirements2KHR"),
            xr.PFN_xrGetVulkanGraphicsRequirements2KHR)
        reqs = xr.GraphicsRequirementsVulkan2KHR()
        result = xr.check_result(pfn(self.instance, self.system, ctypes.byref(reqs)))
        if result.is_exception():
            raise result
        libvulkan = ctypes.CDLL("libvulkan.so.1")
        gipa = ctypes.cast(libvulkan.vkGetInstanceProcAddr, xrp.PFN_vkGetInstanceProcAddr)
        ici = instance_create_info()
        vk_instance, res = xr.create_vulkan_instance_khr(self.instance,
                                                         xr.VulkanInstanceCreateInfoKHR(
            system_id=self.system, pfn_get_instance_proc_addr=gipa,
            vulkan_create_info=_as_ctypes(ici.info, xrp.VkInstanceCreateInfo)))
        if res.value != 0:
            raise HostError(f"xrCreateVulkanInstanceKHR: VkResult {res.value}")
        self.vk_instance_ct = vk_instance
        instance = ffi.cast("VkInstance", _address(vk_instance))
        physical_ct = xr.get_vulkan_graphics_device2_khr(self.instance,
                                                         xr.VulkanGraphicsDeviceGetInfoKHR(
            system_id=self.system, vulkan_instance=vk_instance))
        physical = ffi.cast("VkPhysicalDevice", _address(physical_ct))
        family = universal_family(physical)
        if family is None:
            raise HostError("the runtime's GPU has no graphics + compute queue family")
        dci = device_create_info(physical, family, for_openxr=True)
        device_ct, res = xr.create_vulkan_device_khr(self.instance, xr.VulkanDeviceCreateInfoKHR(
            system_id=self.system, pfn_get_instance_proc_addr=gipa,
            vulkan_physical_device=physical_ct,
            vulkan_create_info=_as_ctypes(dci.info, xrp.VkDeviceCreateInfo)))
        if res.value != 0:
            raise HostError(f"xrCreateVulkanDeviceKHR: VkResult {res.value}")
        device = ffi.cast("VkDevice", _address(device_ct))
        self.host = VulkanHost.adopt(instance, physical, device, family, dci.features,
                                     dci.extensions)
        binding = xr.GraphicsBindingVulkan2KHR(
            instance=vk_instance, physical_device=physical_ct, device=device_ct,
            queue_family_index=family, queue_index=0)
        self.session = xr.create_session(self.instance, xr.SessionCreateInfo(
            system_id=self.system, next=ctypes.cast(ctypes.pointer(binding), ctypes.c_void_p)))
        self.space = xr.create_reference_space(self.session, xr.ReferenceSpaceCreateInfo(
            reference_space_type=xr.ReferenceSpaceType.LOCAL))
        available = list(xr.enumerate_swapchain_formats(self.session))
        self.format = next((f for f in FORMATS if f in available), None)
        if self.format is None:
            raise HostError(f"no 8-bit RGBA swapchain format among {available}")
        views = xr.enumerate_view_configuration_views(self.instance, self.system,
                                                      xr.ViewConfigurationType.PRIMARY_STEREO)
        self.eyes = []
        for v in views:
            w = min(size, v.max_image_rect_width)
            h = min(size, v.max_image_rect_height)
            chain = xr.create_swapchain(self.session, xr.SwapchainCreateInfo(
                usage_flags=xr.SwapchainUsageFlags.COLOR_ATTACHMENT_BIT
                | xr.SwapchainUsageFlags.TRANSFER_DST_BIT,
                format=self.format, sample_count=1, width=w, height=h, face_count=1,
                array_size=1, mip_count=1))
            images = [ffi.cast("VkImage", _address(i.image)) for i in
                      xr.enumerate_swapchain_images(chain, xr.SwapchainImageVulkan2KHR)]
            self.eyes.append((chain, w, h, images))
        self.states: list[str] = []
        self.running = False
        self.exiting = False

    def poll(self) -> None:
        """Drain the event queue: begin the session when READY, end it when STOPPING."""
        while True:
            try:
                event = xr.poll_event(self.instance)
            except xr.EventUnavailable:
                return
            if event.type != xr.StructureType.EVENT_DATA_SESSION_STATE_CHANGED:
                continue
            changed = ctypes.cast(ctypes.byref(event),
                                  ctypes.POINTER(xr.EventDataSessionStateChanged)).contents
            state = xr.SessionState(changed.state)
            self.states.append(state.name)
            if state == xr.SessionState.READY:
                xr.begin_session(self.session, xr.SessionBeginInfo(
                    primary_view_configuration_type=xr.ViewConfigurationType.PRIMARY_STEREO))
                self.running = True
            elif state == xr.SessionState.STOPPING:
                xr.end_session(self.session)
                self.running = False
            elif state in (xr.SessionState.EXITING, xr.SessionState.LOSS_PENDING):
                self.running = False
                self.exiting = True

    def close(self) -> None:
        for chain, *_ in self.eyes:
            xr.destroy_swapchain(chain)
        xr.destroy_space(self.space)
        xr.destroy_session(self.session)
        self.host.close()  # the device and instance the runtime made for us
        xr.destroy_instance(self.instance)


class EyePredictions:
    """Each eye's latest prediction, on the GPU: the frame -> eye map of the frames the model's
    renderer drew, an r32_float image per eye, and a recorded copy from the image the model
    writes into each; `shown(frame)` (Demo.on_prediction) queues the copy for that frame's eye.
    The copy runs after the step (it was harvested: finished) and before the next step's output
    (whose program starts with a barrier over every stage), between barriers of its own."""

    def __init__(self, host: VulkanHost, drawable: Image, eyes: int) -> None:
        self.host = host
        r = drawable.width
        usage = vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT | vk.VK_IMAGE_USAGE_SAMPLED_BIT
        self.images = [create_image(host, r, r, vk.VK_FORMAT_R32_SFLOAT, usage)
                       for _ in range(eyes)]
        self.eye_of: dict[int, int] = {}
        self.frames: list[int | None] = [None] * eyes  # the frame each eye's image shows
        self.counts = [0] * eyes
        cb, fence = host.command_buffers(1)[0], host.fence()

        def clear(c: Any) -> None:
            for img in self.images:
                clear_prediction(c, img.image)

        host.run_now(cb, fence, clear)
        vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])
        vk.vkDestroyFence(host.device, fence, None)
        self.copies = host.command_buffers(eyes)
        for c, img in zip(self.copies, self.images):
            vk.vkBeginCommandBuffer(c, vk.VkCommandBufferBeginInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
            self._record_copy(c, drawable.image, img.image, r)
            vk.vkEndCommandBuffer(c)

    @staticmethod
    def _record_copy(cb: Any, src: Any, dst: Any, r: int) -> None:
        every = vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT
        transfer = vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        src_layout = vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL
        dst_layout = vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL
        image_barrier(cb, src, READABLE, src_layout, every, transfer,
                      vk.VK_ACCESS_MEMORY_WRITE_BIT, vk.VK_ACCESS_TRANSFER_READ_BIT)
        image_barrier(cb, dst, READABLE, dst_layout, every, transfer, 0,
                      vk.VK_ACCESS_TRANSFER_WRITE_BIT)
        layers = vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 0, 1)
        origin = vk.VkOffset3D(0, 0, 0)
        vk.vkCmdCopyImage(cb, src, src_layout, dst, dst_layout, 1, [vk.VkImageCopy(
            srcSubresource=layers, srcOffset=origin, dstSubresource=layers, dstOffset=origin,
            extent=vk.VkExtent3D(r, r, 1))])
        image_barrier(cb, src, src_layout, READABLE, transfer, every, 0, 0)
        image_barrier(cb, dst, dst_layout, READABLE, transfer, every,
                      vk.VK_ACCESS_TRANSFER_WRITE_BIT, vk.VK_ACCESS_MEMORY_READ_BIT)

    def drew(self, frame: int, eye: int) -> None:
        """The model's renderer drew `eye` in `frame`."""
        self.eye_of[frame] = eye
        self.eye_of.pop(frame - 4096, None)

    def shown(self, frame: int) -> None:
        eye = self.eye_of.get(frame)
        if eye is None:  # a frame from before the loop (the set-up's renders)
            return
        self.host.submit(self.copies[eye])
        self.frames[eye] = frame
        self.counts[eye] += 1

    def close(self) -> None:
        self.host.idle()
        vk.vkFreeCommandBuffers(self.host.device, self.host.pool, len(self.copies), self.copies)
        for img in self.images:
            destroy_image(self.host, img)


def run(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    r = opts.resolution
    xs = XrSession(opts.xr_size, log)
    host = xs.host
    renderers: list[SceneRenderer] = []
    panels: list[DepthPanel] = []
    compositor = demo = eyes = None
    try:
        scene = Scene.build(opts.seed)
        renderers = [SceneRenderer(host, r, r, scene) for _ in xs.eyes]
        compositor = Compositor(host, None if opts.zero_copy else (2 * r, r))
        compositor.check_format(xs.format)
        demo = Demo(host, opts, renderers[0], log)  # the model's renderer: renderers[0]
        if opts.zero_copy:
            eyes = EyePredictions(host, demo.drawable, len(xs.eyes))
            demo.on_prediction = eyes.shown
            panels = [DepthPanel(host, r) for _ in xs.eyes]
        log(f"device: {host.device_name}; eyes {[(w, h) for _, w, h, _ in xs.eyes]}, "
            f"format {xs.format}")
        demo.warm_gpu()  # the calibration below measures at the GPU's running clock
        render_ms, render_source, _ = calibrate(host, renderers[0])
        render_ms *= len(xs.eyes)
        cb = host.command_buffers(1)[0]
        fence = host.fence()
        intervals: list[float] = []
        frames_rendered = 0
        prepared = False
        info: dict[str, Any] = {}
        t_last = None
        n = 0
        deadline = time.perf_counter() + 120.0
        try:
            while frames_rendered < opts.frames and not xs.exiting:
                if time.perf_counter() > deadline:
                    raise HostError(f"the XR session did not render {opts.frames} frames in "
                                    f"120 s (states {xs.states})")
                xs.poll()
                if not xs.running:
                    time.sleep(0.01)
                    continue
                state = xr.wait_frame(xs.session)  # the runtime's pacing
                now = time.perf_counter()
                if t_last is not None:
                    intervals.append((now - t_last) * 1e3)
                t_last = now
                if not prepared:
                    # The frame period is the runtime's; the render's time was measured
                    # before the session's frames (two eyes), the slack follows from both.
                    period_ms = state.predicted_display_period / 1e6
                    info = demo.prepare(period_ms, render_ms)
                    info["period_ms"] = round(period_ms, 3)
                    info["render_timing"] = render_source
                    prepared = True
                with host.queue_lock:
                    xr.begin_frame(xs.session)
                layers = []
                if state.should_render:
                    _, views = xr.locate_views(xs.session, xr.ViewLocateInfo(
                        view_configuration_type=xr.ViewConfigurationType.PRIMARY_STEREO,
                        display_time=state.predicted_display_time, space=xs.space))
                    demo.begin_frame(n)
                    model_eye = 0
                    if eyes is not None:  # the eye of the latest prediction begun
                        model_eye = max(demo.predictions_begun - 1, 0) % len(xs.eyes)
                        eyes.drew(n, model_eye)
                    else:
                        compositor.set_panel(panel_pixels(demo, r))
                    drawn_by = list(renderers)  # the renderer of each eye
                    drawn_by[0], drawn_by[model_eye] = drawn_by[model_eye], drawn_by[0]
                    head = np.mean([[v.pose.position.x, v.pose.position.y, v.pose.position.z]
                                    for v in views], 0)
                    indices = []
                    for chain, *_ in xs.eyes:
                        with host.queue_lock:
                            indices.append(xr.acquire_swapchain_image(
                                chain, xr.SwapchainImageAcquireInfo()))
                        xr.wait_swapchain_image(chain, xr.SwapchainImageWaitInfo(
                            timeout=xr.INFINITE_DURATION))
                    vk.vkResetCommandBuffer(cb, 0)
                    vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                        sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
                    projection_views = []
                    for e, ((chain, w, h, images), view, rend) in enumerate(
                            zip(xs.eyes, views, drawn_by)):
                        p, o = view.pose.position, view.pose.orientation
                        pose = pose_matrix(np.array([p.x, p.y, p.z]) - head, (o.x, o.y, o.z, o.w))
                        fov = (view.fov.angle_left, view.fov.angle_right, view.fov.angle_up,
                               view.fov.angle_down)
                        model = rend is renderers[0]
                        rend.record(cb, xr_camera(n, pose, fov), n / 72.0, readback=model,
                                    timestamps=model)
                        placements = [(rend.color, (0, 0, w, h))]
                        corner = (w // 2, h - w // 4, w, h)  # the panel: the lower right
                        if eyes is not None:  # the eye's latest prediction
                            panels[e].record(cb, rend.depth, eyes.images[e])
                            placements.append((panels[e].image, corner))
                        elif e == 0:
                            placements.append((compositor.panel, corner))
                        compositor.record(cb, placements, images[indices[e]],
                                          vk.VK_IMAGE_LAYOUT_UNDEFINED,
                                          vk.VK_IMAGE_LAYOUT_COLOR_ATTACHMENT_OPTIMAL,
                                          vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, 0)
                        projection_views.append(xr.CompositionLayerProjectionView(
                            pose=view.pose, fov=view.fov,
                            sub_image=xr.SwapchainSubImage(swapchain=chain, image_rect=xr.Rect2Di(
                                offset=xr.Offset2Di(0, 0), extent=xr.Extent2Di(w, h)))))
                    vk.vkEndCommandBuffer(cb)
                    demo.fill_before_render(n)  # continuing steps' pieces, then the eyes
                    t0 = time.perf_counter()
                    host.submit(cb, fence)
                    for chain, *_ in xs.eyes:
                        with host.queue_lock:
                            xr.release_swapchain_image(chain, xr.SwapchainImageReleaseInfo())
                    demo.fill(n)  # the model's pieces after the eyes, on the same queue
                    host.wait_fence(fence)
                    frame_ms = (time.perf_counter() - t0) * 1e3
                    rgb, depth = renderers[0].read()  # zero_copy: for the metrics only
                    gpu = renderers[0].gpu_ms() if demo.queries_readable() else None
                    demo.end_frame(n, rgb, depth, frame_ms, gpu)
                    layer = xr.CompositionLayerProjection(space=xs.space,
                                                          views=projection_views)
                    layers = [ctypes.byref(layer)]
                    frames_rendered += 1
                    n += 1
                with host.queue_lock:
                    xr.end_frame(xs.session, xr.FrameEndInfo(
                        display_time=state.predicted_display_time,
                        environment_blend_mode=xr.EnvironmentBlendMode.OPAQUE, layers=layers))
        finally:
            host.idle()
            vk.vkDestroyFence(host.device, fence, None)
            vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])
        demo.finish()
        checked: dict[str, Any] = {}
        if eyes is not None:
            save_panels(demo, [(panel, renderers[0].depth, image, frame) for panel, image, frame
                               in zip(panels, eyes.images, eyes.frames)], opts.out)
            checked = {"eye_shows_frame": eyes.frames, "eye_predictions": eyes.counts}
        metrics = {
            "device": host.device_name, "mode": "xr", "runtime": xs.runtime,
            "session_states": xs.states, "reached_focused": "FOCUSED" in xs.states,
            "frames_rendered": frames_rendered, "setup": info,
            "xr_wait_frame_interval_ms_p50": pct(intervals, 50),
            "run": demo.metrics(info.get("period_ms", 0.0)),
            "train_steps_done": len(demo.run.losses),
            "predictions": len(demo.run.predictions),
            **checked,
            "validation_messages": list(host.messages),
            "validating": host.messenger is not None,
        }
        os.makedirs(opts.out, exist_ok=True)
        path = os.path.join(opts.out, "metrics_xr.json")
        outputs.write_json(path, metrics)
        log(f"XR: {frames_rendered} frames, states {xs.states}, {len(demo.run.losses)} "
            f"training steps; metrics {os.path.abspath(path)}")
        return metrics
    finally:
        for panel in panels:
            panel.close()
        if eyes is not None:
            eyes.close()
        if demo is not None:
            demo.close()
        if compositor is not None:
            compositor.close()
        for rend in renderers:
            rend.close()
        try:
            xr.request_exit_session(xs.session)
        except xr.XrException:
            pass
        xs.close()
