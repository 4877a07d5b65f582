"""A stand-in host application for co-tenancy work: `HostContext` owns a Vulkan instance, device
and queue (as a game engine or OpenXR app would) and hands them to vkml with
`ctx.vkml_device()` (Device.from_vulkan, sharing the queue lock); `OffscreenRenderer` draws
frames (a WGSL full-screen triangle compiled by vkml.naga) on that queue.

    ctx = HostContext(); renderer = OffscreenRenderer(ctx, 256, 256, iterations=32)
    dev = ctx.vkml_device(); model = vkml.compile(..., device=dev)
    t0 = renderer.render(); model.step_chunk(); cpu_ms, gpu_ms = renderer.wait(t0)

The Vulkan code lives in vkml/vk/renderer.py (only vkml/vk/ imports `vulkan`); importing this
module loads nothing until a class is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vkml.vk.renderer import HostContext, OffscreenRenderer

__all__ = ["HostContext", "OffscreenRenderer"]


def __getattr__(name: str) -> Any:
    if name in ("HostContext", "OffscreenRenderer"):
        from vkml.vk import renderer

        return getattr(renderer, name)
    raise AttributeError(f"module 'vkml.host' has no attribute {name!r}")
