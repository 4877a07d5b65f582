"""What every backend shares: the closed state, one-off programs, command checks and the
Python protocol methods. Backends subclass it and implement the rest of `hal.Backend`."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from vkml.errors import DeviceError, InputError
from vkml.hal.capabilities import Capabilities
from vkml.hal.commands import Command, check_commands
from vkml.hal.interface import (
    DeviceMemory,
    HostRecording,
    HostResources,
    HostWrite,
    TimelineSync,
    Timestamps,
)
from vkml.hal.kernel import Kernel

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self needs 3.11; the project targets 3.10

# How long a wait polls for the work's completion before it sleeps in the driver: waking from
# the driver's blocking wait costs a GPU step about as much as a small model's kernels. The host
# thread is busy meanwhile, as CUDA's default synchronisation keeps it. 0 never polls; CPU
# drivers never do (their work runs on the cores polling would take).
def seconds_from_env(name: str, default: float, least: float) -> float:
    """Seconds from environment variable `name` (`default` when unset), at least `least`; else
    an InputError naming the variable (float() alone failed `import vkml` with a ValueError)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= least:  # NaN too
        raise InputError(f"{name}={text!r}: give a number of seconds >= {least:g} (unset: "
                         f"{default:g})")
    return value


WAIT_POLL_S = seconds_from_env("VKML_WAIT_POLL", 0.02, 0.0)


class BackendTimestamps:
    """The `timestamps` capability of a backend, from its own two functions: `record(commands,
    label)`, a program with a timestamp around every dispatch, and `timings(program)`, their
    milliseconds per dispatch after a run."""

    def __init__(self, record: Callable[[Sequence[Command], str], Any],
                 timings: Callable[[Any], list[float]]) -> None:
        self.record, self.timings = record, timings


class BackendBase:
    caps: Capabilities
    owned = True
    timeline: TimelineSync | None = None
    host_recording: HostRecording | None = None
    timestamps: Timestamps | None = None
    host_resources: HostResources | None = None
    # How many pipelines create_pipelines makes at once: more than one only where the driver's
    # compiler runs outside Python's lock and may be called from several threads.
    pipeline_threads = 1
    # How long wait() polls before it sleeps in the driver: WAIT_POLL_S on a GPU, 0 on a CPU.
    _poll_s = 0.0

    def __init__(self, queue_lock: Any = None) -> None:
        self._closed = False
        self.validation_messages: list[str] = []
        # Every submission holds it; a host sharing the queue passes its own.
        self.queue_lock = queue_lock if queue_lock is not None else threading.Lock()

    # Implemented by each backend.
    def record(self, commands: Sequence[Command], label: str) -> Any:
        raise NotImplementedError

    def submit(self, program: Any) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def _polled(self, done: Callable[[], Any]) -> bool:
        """Whether `done()` turned true within the polling time (see WAIT_POLL_S)."""
        if self._poll_s <= 0:
            return False
        deadline = time.perf_counter() + self._poll_s
        while not done():
            if time.perf_counter() > deadline:
                return False
        return True

    @staticmethod
    def check_transfer(kind: str, buffer: Any, offset: int, nbytes: int) -> None:
        """Raise DeviceError for a host `kind` ("read" or "write") outside `buffer`."""
        if offset < 0 or nbytes < 0 or offset + nbytes > buffer.nbytes:
            raise DeviceError(f"{kind} of {nbytes} bytes at offset {offset} does not fit in "
                              f"{buffer!r}")

    def write_buffer(self, buffer: Any, offset: int, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def write_buffers(self, writes: Sequence[HostWrite]) -> None:
        """One write_buffer per write where a backend has nothing better (wgpu's queue writes
        are already batched into its next submission)."""
        for w in writes:
            self.write_buffer(w.buffer, w.offset, bytes(w.nbytes) if w.data is None else w.data)

    def read_buffer(self, buffer: Any, offset: int, nbytes: int) -> bytes:
        raise NotImplementedError

    def read_buffers(self, reads: Sequence[tuple[Any, int, int]]) -> list[bytes]:
        """One read_buffer per read where a backend has nothing better (wgpu maps each)."""
        return [self.read_buffer(*r) for r in reads]

    # Nothing to load or start where the driver takes the kernel as it is (wgpu takes WGSL).
    def preload(self) -> None:
        pass

    def prefetch(self, kernels: Sequence[Kernel]) -> None:
        pass

    def why_absent(self, capability: str) -> str:
        return f"{type(self).__name__} does not offer {capability!r}"

    def device_memory(self) -> DeviceMemory | None:
        """Unknown by default (WebGPU tells no heap sizes)."""
        return None

    def create_pipeline(self, kernel: Kernel) -> Any:
        raise NotImplementedError

    def free_pipeline(self, pipeline: Any) -> None:
        raise NotImplementedError

    def create_pipelines(self, kernels: Sequence[Kernel]) -> list[Any]:
        """create_pipeline of each kernel, `pipeline_threads` at a time; on a failure the
        pipelines made are freed and the first failure in kernel order is raised."""
        if self.pipeline_threads > 1 and len(kernels) > 1:
            with ThreadPoolExecutor(min(len(kernels), self.pipeline_threads),
                                    thread_name_prefix="vkml-pipelines") as pool:
                futures = [pool.submit(self.create_pipeline, k) for k in kernels]
            failures = [f.exception() for f in futures if f.exception() is not None]
            made = [f.result() for f in futures if f.exception() is None]
        else:
            failures, made = [], []
            for kernel in kernels:
                try:
                    made.append(self.create_pipeline(kernel))
                except BaseException as e:
                    failures.append(e)
                    break
        if failures:
            for pipeline in made:
                self.free_pipeline(pipeline)
            raise failures[0]
        return made

    def submit_batch(self, programs: Sequence[Any]) -> None:
        """One submission per program where a backend has nothing better (same order)."""
        for program in programs:
            self.submit(program)

    def wait_for(self, program: Any) -> None:
        """Where a backend cannot tell submissions apart: wait for all of them."""
        self.wait()

    def stage_reads(self, buffer: Any) -> bool:
        """By default reads take the backend's own route (wgpu's waits for all work anyway)."""
        return False

    def free_program(self, program: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def live_objects(self) -> dict[str, int]:
        raise NotImplementedError

    def _live_buffer(self, buffer: object) -> bool:
        raise NotImplementedError

    def _live_pipeline(self, pipeline: object) -> bool:
        raise NotImplementedError

    def _check_command(self, n: int, command: Command, what: str) -> None:
        """A backend's own rules beyond the shared ones (none by default)."""

    # Shared.
    def run_now(self, commands: Sequence[Command]) -> None:
        """Record, run and free a one-off program (uploads, downloads): slow, for rare use."""
        program = self.record(commands, "run_now")
        try:
            self.submit(program)
            self.wait()
        finally:
            self.free_program(program)

    def check(self, commands: Sequence[Command], label: str) -> None:
        """Raise DeviceError naming the first command this backend could not run."""
        check_commands(commands, label, self.caps, self._live_buffer, self._live_pipeline,
                       self._check_command)

    def _alive(self) -> None:
        if self._closed:
            raise DeviceError(f"this {type(self).__name__} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.caps.device_name!r} ({self.caps.device_type})>"
