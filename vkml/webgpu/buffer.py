"""A wgpu buffer as the backend holds it: vkml's own, or a host's adopted by bind_input."""

from __future__ import annotations

from typing import Any

from vkml.hal import BufferKind


class Buffer:
    __slots__ = ("handle", "kind", "label", "nbytes")

    def __init__(self, handle: Any, nbytes: int, kind: BufferKind, label: str) -> None:
        self.handle, self.nbytes, self.kind, self.label = handle, nbytes, kind, label

    def __repr__(self) -> str:
        return f"<wgpu.Buffer {self.label!r} {self.kind} {self.nbytes} B>"
