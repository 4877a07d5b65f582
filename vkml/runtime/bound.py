"""A plan bound to a device: the memory plan's arenas, the inputs' staging buffer, one pipeline per
distinct kernel (shared with other sessions of the device), the programs recorded from the plan,
and whether work is in flight. Everything the session, chunking, profiling and checkpoints do on
the GPU goes through here.

Binding allocates, compiles and records once; after that a step writes nothing but the inputs'
staging memory and submits a pre-recorded program: no Python runs per dispatch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from vkml import naga
from vkml.compiler.schedule import Plan, Slot
from vkml.errors import InputError
from vkml.hal import Barrier, Binding, Command, Copy, Dispatch
from vkml.runtime.device import Device

NUMPY_DTYPE = {"f32": np.float32, "i32": np.int32}


class BoundPlan:
    def __init__(self, plan: Plan, device: Device) -> None:
        self.plan, self.device = plan, device
        self.backend = backend = device.backend
        self._programs: list[object] = []
        self._kernels = list({d.kernel.wgsl: d.kernel for d in plan.dispatches}.values())
        self._pipelines: dict[str, object] = {}
        self.arenas: list[object] = []
        self._staging: object | None = None
        self.in_flight = False
        try:
            self.arenas = [backend.create_buffer(max(n, 4), "device", f"arena {i}")
                           for i, n in enumerate(plan.memory.arena_bytes)]
            align = max(device.caps.min_storage_offset_alignment, 16)
            self.staging_offsets: dict[str, int] = {}
            staged = 0
            for name, slot in plan.inputs.items():
                self.staging_offsets[name] = staged
                staged += -(-plan.slots[slot].nbytes // align) * align
            self._staging = backend.create_buffer(max(staged, 4), "upload", "inputs")
            if device.backend_name == "vulkan":  # kernels no cache holds: naga works meanwhile
                naga.prefetch((k.wgsl, k.name) for k in self._kernels)
            for slot in plan.slots:
                if slot.id in plan.initial_values:
                    self.write_slot(slot, plan.initial_values[slot.id])
                elif slot.role == "optimizer_state":  # device memory starts undefined
                    self.write_slot(slot, np.zeros(slot.shape, np.float32))
            for kernel in self._kernels:
                self._pipelines[kernel.wgsl] = device.pipelines.acquire(kernel)
            self._uploads: list[Command] = [
                Copy(self._staging, self.staging_offsets[name], *self.place(slot),
                     plan.slots[slot].nbytes) for name, slot in plan.inputs.items()]
            if self._uploads:
                self._uploads.append(Barrier())
            phases = {d.phase for d in plan.dispatches}
            self.step_program = self.record(self.indices(phases), "step")
            self.forward_program = (self.record(self.indices({"forward"}), "forward")
                                    if phases != {"forward"} else self.step_program)
        except BaseException:
            self.close()
            raise
        self.unset_inputs = set(plan.inputs)

    @property
    def kernel_count(self) -> int:
        return len(self._kernels)

    def indices(self, phases: Iterable[str]) -> list[int]:
        """The dispatches of the given phases, in plan order."""
        wanted = set(phases)
        return [i for i, d in enumerate(self.plan.dispatches) if d.phase in wanted]

    def commands(self, indices: Iterable[int], uploads: bool) -> list[Command]:
        """The commands of the dispatches at `indices` (in plan order), with a barrier wherever
        the level changes; the input copies from staging first when `uploads`."""
        plan = self.plan
        commands: list[Command] = list(self._uploads) if uploads else []
        level = None
        for i in indices:
            d = plan.dispatches[i]
            if level is not None and d.level != level:
                commands.append(Barrier())
            level = d.level
            bindings = tuple(Binding(*self.place(s), max(plan.slots[s].nbytes, 4), w)
                             for s, w in zip(d.slots, d.kernel.writable))
            commands.append(Dispatch(self._pipelines[d.kernel.wgsl], bindings, d.kernel.groups))
        return commands

    def record(self, indices: Iterable[int], label: str, uploads: bool = True) -> object:
        """A program of the dispatches at `indices` (freed with the session)."""
        return self.keep(self.backend.record(self.commands(indices, uploads), label))

    def keep(self, program: object) -> object:
        """Free `program` when the session closes."""
        self._programs.append(program)
        return program

    # ---- running ------------------------------------------------------------------------------
    def require_inputs(self) -> None:
        if self.unset_inputs:
            missing = ", ".join(f"'{n}'" for n in sorted(self.unset_inputs))
            raise InputError(f"input {missing} was never set; call set_input(name, array) first")

    def submit(self, program: object) -> None:
        self.backend.submit(program)
        self.in_flight = True

    def wait(self) -> None:
        if self.in_flight:
            self.backend.wait()
            self.in_flight = False

    # ---- tensors ------------------------------------------------------------------------------
    def place(self, slot: int) -> tuple[object, int]:
        arena, offset = self.plan.memory.placement[slot]
        return self.arenas[arena], offset

    def write_input(self, name: str, array: np.ndarray) -> None:
        self.wait()
        self.backend.write_buffer(self._staging, self.staging_offsets[name], array.tobytes())
        self.unset_inputs.discard(name)

    def write_slot(self, slot: Slot, array: np.ndarray) -> None:
        buffer, offset = self.place(slot.id)
        data = np.ascontiguousarray(array, dtype=NUMPY_DTYPE[slot.dtype])
        # the array's own bytes: a model's parameters are not copied into a bytes object first
        self.backend.write_buffer(buffer, offset, memoryview(data.reshape(-1).view(np.uint8)))

    def read_slot(self, slot: Slot) -> np.ndarray:
        self.wait()
        buffer, offset = self.place(slot.id)
        raw = self.backend.read_buffer(buffer, offset, slot.nbytes)
        return np.frombuffer(raw, dtype=NUMPY_DTYPE[slot.dtype]).reshape(slot.shape).copy()

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free what binding made: programs, pipelines no other live session uses, buffers.
        Safe to call twice."""
        self.wait()
        for program in {id(p): p for p in self._programs}.values():
            self.backend.free_program(program)
        self._programs.clear()
        for kernel in self._kernels:
            if kernel.wgsl in self._pipelines:
                self.device.pipelines.release(kernel)
        self._pipelines.clear()
        for buffer in [*self.arenas, self._staging]:
            if buffer is not None:
                self.backend.free_buffer(buffer)
        self.arenas, self._staging = [], None
