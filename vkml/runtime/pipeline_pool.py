"""Compute pipelines shared among the live sessions of one device, by WGSL: a kernel two sessions
both use is compiled once, and destroyed when its last user closes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from vkml.hal import Backend, Kernel


class PipelinePool:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._entries: dict[str, list] = {}  # wgsl -> [pipeline, users]

    def acquire(self, kernels: Sequence[Kernel]) -> list[object]:
        """The pipelines of `kernels`, in order, those no session holds created (several at a
        time where the backend can); pair each kernel with a release()."""
        with self._lock:
            missing = list({k.wgsl: k for k in kernels if k.wgsl not in self._entries}.values())
            for kernel, pipeline in zip(missing, self._backend.create_pipelines(missing)):
                self._entries[kernel.wgsl] = [pipeline, 0]
            entries = [self._entries[k.wgsl] for k in kernels]
            for entry in entries:
                entry[1] += 1
            return [entry[0] for entry in entries]

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
