"""Lab: how long a rendered frame takes to become a drawable prediction, through the CPU
(read-back, set_input, step, read, upload) or without it (bind_input / bind_output).

    PYTHONPATH=. python tools/frame_latency.py [--model small|vits14] [--frames 40]
        [--resolution 64] [--out PATH]

The demo's scene renderer (xr_demo/renderer.py) draws a view into its RGBA8 target on the host's
queue and the demo's depth network (inference, xr_demo/model.py) predicts its depth into an
r32_float image the renderer could sample. Latency: from the host seeing the render's fence
signal (the end of the render) to the prediction being in that image (the host sees its
submission complete), per frame, the two paths alternating so drift on a shared machine hits
both alike; also from the render's submission. The set_input path feeds the values bind_input's
conversion computes ((k / 255 - 0.5) / 0.25, the demo's normalisation, through the same table),
so both predictions of one view are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vulkan as vk  # noqa: E402

import vkml  # noqa: E402
from vkml.kernels.frames import table  # noqa: E402
from xr_demo import model as net  # noqa: E402
from xr_demo.renderer import (  # noqa: E402
    SceneRenderer,
    create_buffer,
    create_image,
    destroy_buffer,
    destroy_image,
    image_barrier,
)
from xr_demo.scene import Scene, desktop_camera  # noqa: E402
from xr_demo.vkhost import VulkanHost  # noqa: E402

MEAN, STD = 0.5, 0.25  # xr_demo.app.to_input's
SHADER_READ = vk.VK_IMAGE_LAYOUT_SHADER_READ_ONLY_OPTIMAL
TRANSFER_DST = vk.VK_IMAGE_LAYOUT_TRANSFER_DST_OPTIMAL


class Lab:
    def __init__(self, model: str, resolution: int, seed: int) -> None:
        self.r = r = resolution
        self.host = host = VulkanHost.create()
        self.renderer = SceneRenderer(host, r, r, Scene.build(seed))
        self.device = host.vkml_device()
        graph = net.build(net.config(model, r), train=False, seed=seed).graph
        self.plain = vkml.compile(graph, device=self.device)
        self.bound = vkml.compile(graph, device=self.device)  # the same initial parameters
        usage = (vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT
                 | vk.VK_IMAGE_USAGE_SAMPLED_BIT)
        # The drawable predictions, one per path, kept in SHADER_READ_ONLY as a renderer
        # sampling them would.
        self.drawn = {k: create_image(host, r, r, vk.VK_FORMAT_R32_SFLOAT, usage, view=False)
                      for k in ("plain", "bound")}
        self.staging = create_buffer(host, 4 * r * r, vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                                     | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        self.cb, self.upload_cb, self.check_cb = host.command_buffers(3)
        self.fence, self.upload_fence = host.fence(), host.fence()
        self._once(lambda cb: [image_barrier(
            cb, img.image, vk.VK_IMAGE_LAYOUT_UNDEFINED, SHADER_READ,
            vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT, 0,
            vk.VK_ACCESS_MEMORY_READ_BIT) for img in self.drawn.values()])
        self._record_upload()
        lut = table("rgba8_unorm", (MEAN,) * 4, (STD,) * 4).reshape(4, 256)
        self.convert = lambda rgb: np.stack([lut[c][rgb[..., c]] for c in range(3)])[None]
        colour = self.renderer.color
        self.bound.bind_input("image", vkml.HostImage(
            colour.image, host.device, "rgba8_unorm", (r, r),
            vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT,
            vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL), mean=MEAN, std=STD)
        self.bound.bind_output("depth", vkml.HostImage(
            self.drawn["bound"].image, host.device, "r32_float", (r, r), usage, SHADER_READ))

    def _once(self, record: Any) -> None:
        self.host.run_now(self.check_cb, self.fence, record)

    def _copy(self, cb: Any, image: Any, to_image: bool) -> None:
        """The staging buffer into the image or back, the image left in SHADER_READ."""
        transfer, everything = (vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                                vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT)
        layout = TRANSFER_DST if to_image else vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL
        access = (vk.VK_ACCESS_TRANSFER_WRITE_BIT if to_image
                  else vk.VK_ACCESS_TRANSFER_READ_BIT)
        image_barrier(cb, image, SHADER_READ, layout, everything, transfer,
                      vk.VK_ACCESS_MEMORY_WRITE_BIT, access)
        region = vk.VkBufferImageCopy(
            bufferOffset=0, bufferRowLength=0, bufferImageHeight=0,
            imageSubresource=vk.VkImageSubresourceLayers(vk.VK_IMAGE_ASPECT_COLOR_BIT, 0, 0, 1),
            imageOffset=vk.VkOffset3D(0, 0, 0), imageExtent=vk.VkExtent3D(self.r, self.r, 1))
        if to_image:
            vk.vkCmdCopyBufferToImage(cb, self.staging.buffer, image, layout, 1, [region])
        else:
            vk.vkCmdCopyImageToBuffer(cb, image, layout, self.staging.buffer, 1, [region])
        image_barrier(cb, image, layout, SHADER_READ, transfer, everything,
                      access if to_image else 0, vk.VK_ACCESS_MEMORY_READ_BIT)
        vk.vkCmdPipelineBarrier(cb, transfer, vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, [
            vk.VkMemoryBarrier(sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                               srcAccessMask=vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                               dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT)], 0, None, 0, None)

    def _record_upload(self) -> None:
        """The set_input path's last leg, recorded once: the prediction into its image."""
        vk.vkBeginCommandBuffer(self.upload_cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        self._copy(self.upload_cb, self.drawn["plain"].image, to_image=True)
        vk.vkEndCommandBuffer(self.upload_cb)

    def render(self, frame: int, readback: bool) -> None:
        """Record and submit the frame's render (its fence: self.fence)."""
        cb = self.cb
        vk.vkResetCommandBuffer(cb, 0)
        vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
        self.renderer.record(cb, desktop_camera(frame), frame / 72.0, readback=readback,
                             timestamps=False)
        vk.vkEndCommandBuffer(cb)
        self.host.submit(cb, self.fence)

    def through_cpu(self, frame: int) -> tuple[float, float, np.ndarray]:
        """(ms from the render's end, ms from its submission) to the drawable prediction."""
        t_submit = time.perf_counter()
        self.render(frame, readback=True)
        self.host.wait_fence(self.fence)
        t_end = time.perf_counter()
        rgb, _ = self.renderer.read()
        self.plain.set_input("image", self.convert(rgb))
        self.plain.step()
        prediction = self.plain.read("depth")
        self.staging.mapped[:] = prediction.tobytes()
        self.host.submit(self.upload_cb, self.upload_fence)
        self.host.wait_fence(self.upload_fence)
        t_ready = time.perf_counter()
        return 1e3 * (t_ready - t_end), 1e3 * (t_ready - t_submit), prediction

    def on_gpu(self, frame: int) -> tuple[float, float]:
        t_submit = time.perf_counter()
        self.render(frame, readback=False)
        self.bound.step()  # queued behind the render: it reads the frame the render draws
        self.host.wait_fence(self.fence)
        t_end = time.perf_counter()
        semaphore, value = self.bound.done()
        self.host.wait_timeline(semaphore, value)
        t_ready = time.perf_counter()
        return 1e3 * (t_ready - t_end), 1e3 * (t_ready - t_submit)

    def drawn_bound(self) -> np.ndarray:
        """The bound path's drawable prediction, read back (the check, not the path)."""
        self._once(lambda cb: self._copy(cb, self.drawn["bound"].image, to_image=False))
        return np.frombuffer(self.staging.mapped, np.float32).reshape(1, 1, self.r, self.r)

    def close(self) -> None:
        self.host.idle()
        for s in (self.plain, self.bound):
            s.close()
        self.device.close()
        for img in self.drawn.values():
            destroy_image(self.host, img)
        destroy_buffer(self.host, self.staging)
        for f in (self.fence, self.upload_fence):
            vk.vkDestroyFence(self.host.device, f, None)
        self.renderer.close()
        self.host.close()


def summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"median": round(statistics.median(v), 3), "min": round(v[0], 3),
            "p90": round(v[min(len(v) - 1, int(0.9 * len(v)))], 3), "n": len(v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=40, help="frames per path (after warm-up)")
    ap.add_argument("--model", choices=net.MODELS, default="small",
                    help="the demo's depth network (xr_demo --model)")
    ap.add_argument("--resolution", type=int, default=None,
                    help="the model's input size (default: the demo's for the model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/frame_latency.json")
    args = ap.parse_args()
    args.resolution = args.resolution or net.DEFAULT_RESOLUTION[args.model]
    lab = Lab(args.model, args.resolution, args.seed)
    try:
        for f in range(3):  # warm-up: pipelines, caches, first submissions
            lab.through_cpu(f)
            lab.on_gpu(f)
        # The same view both ways: the predictions must agree bit for bit.
        _, _, via_cpu = lab.through_cpu(500)
        lab.on_gpu(500)
        identical = bool(np.array_equal(lab.drawn_bound().view(np.uint32),
                                        via_cpu.view(np.uint32)))
        cpu: dict[str, list[float]] = {"end": [], "submit": []}
        gpu: dict[str, list[float]] = {"end": [], "submit": []}
        for f in range(args.frames):
            end, submit, _ = lab.through_cpu(10 + 2 * f)
            cpu["end"].append(end)
            cpu["submit"].append(submit)
            end, submit = lab.on_gpu(11 + 2 * f)
            gpu["end"].append(end)
            gpu["submit"].append(submit)
        result = {
            "device": lab.host.device_name, "model": args.model, "resolution": args.resolution,
            "frames_per_path": args.frames, "bit_identical": identical,
            "set_input_path_ms": {"from_render_end": summary(cpu["end"]),
                                  "from_render_submit": summary(cpu["submit"])},
            "bound_path_ms": {"from_render_end": summary(gpu["end"]),
                              "from_render_submit": summary(gpu["submit"])},
            "validation_messages": list(lab.host.messages),
        }
    finally:
        lab.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['device']}, {args.model} at {args.resolution}x{args.resolution}, "
          f"{args.frames} frames a "
          f"path; predictions bit-identical: {identical}")
    print("| path | render end -> drawable ms, median (min, p90) | render submit -> drawable |")
    print("| --- | --- | --- |")
    for name, key in (("set_input / read / upload", "set_input_path_ms"),
                      ("bind_input / bind_output", "bound_path_ms")):
        e, s = result[key]["from_render_end"], result[key]["from_render_submit"]
        print(f"| {name} | {e['median']} ({e['min']}, {e['p90']}) | {s['median']} "
              f"({s['min']}, {s['p90']}) |")
    if result["validation_messages"]:
        print("validation layer reported:\n" + "\n".join(result["validation_messages"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
