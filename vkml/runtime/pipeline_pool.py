"""Compute pipelines shared among the live sessions of one device, by WGSL: a kernel two sessions
both use is compiled once, and destroyed when its last user closes."""

from __future__ import annotations

import threading

from vkml.hal import Backend, Kernel


class PipelinePool:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._entries: dict[str, list] = {}  # wgsl -> [pipeline, users]

    def acquire(self, kernel: Kernel) -> object:
        """The pipeline for `kernel`, created on first use; pair each call with release()."""
        with self._lock:
            entry = self._entries.get(kernel.wgsl)
            if entry is None:
                entry = self._entries[kernel.wgsl] = [self._backend.create_pipeline(kernel), 0]
            entry[1] += 1
            return entry[0]

    def release(self, kernel: Kernel) -> None:
        with self._lock:
            entry = self._entries.get(kernel.wgsl)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._entries[kernel.wgsl]
                self._backend.free_pipeline(entry[0])

    def __len__(self) -> int:
        return len(self._entries)
