"""A plan bound to a device: the memory plan's arenas, the inputs' staging buffers, one pipeline
per distinct kernel (shared with other sessions of the device), the programs recorded from the
plan, and this session's work in flight. Everything the session, chunking, profiling and
checkpoints do on the GPU goes through here.

Binding allocates, compiles and records once; after that a step writes nothing but the inputs'
staging memory and submits pre-recorded programs: no Python runs per dispatch.

Completion is per session: `last` is the latest program this plan submitted, and waiting for it
waits for this session's work (and whatever was queued before it), never for work other sessions
or the host submitted later.

Inputs go through two staging buffers, each with a small upload program (its copies into the
arena), submitted in the same queue submission as the first program of a step. set_input() only
keeps the value; a step writes what changed into the staging buffer that the step before the
one in flight used, so setting the next step's inputs never waits for the step in flight.

Outputs (and index checks) in memory the host cannot read in place (a discrete GPU's VRAM) are
copied into a host-readable buffer by a small download program that ends every step, in the
same queue submission: reading one then waits for this session's step only and submits nothing
(a copy submitted at read time would queue behind the work other sessions submitted meanwhile).

A host's buffers and images bound to inputs and outputs (runtime/frames.py) add a program after
the upload that copies or converts them, and one before the download that writes the bound
outputs; the uploads leave bound inputs out.

A plan may take its parameters from another plan (`owner`, see runtime/sharing.py): those slots
live in the owner's arenas, and the submissions check that a step never sees half an update.

A plan's prologue (Plan.prologue: what the step reads that depends on parameters and constants
alone) is a program of its own, put before the first program of a step's submission when a
parameter it may read was written since it last ran. Two counters per plan say so: `host_writes`
(the host's writes of its parameters: set_param, load) and `step_updates` (its submissions that
update parameters); the prologue of a plan that shares its owner's parameters follows the
owner's counters too, and the owner's `step_updates` only where it reads a parameter the owner's
step writes (a training session's frozen parameters never move with its steps). Comparing a
tuple of counters is all a step costs when nothing moved. A chunked step's prologue goes with
its first piece, outside the pieces' measured costs (profile() times the step alone): where it
runs before most steps (a session reading what a trainer updates every step) that first piece
takes longer than its budget by the prologue's time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vkml.compiler.plan import Plan, PlannedDispatch, Slot
from vkml.errors import DeviceError, InputError
from vkml.graph import TRAINING_STEP
from vkml.hal import Barrier, Binding, Command, Copy, Dispatch, HostWrite
from vkml.interrupts import deferred_interrupts
from vkml.runtime.device import Device
from vkml.runtime.frames import FrameBindings

NUMPY_DTYPE = {"f32": np.float32, "i32": np.int32}
STAGING_BUFFERS = 2
# Plans sharing arenas (BoundPlan.owner, sharers) may close on different threads at once: this
# guards their sharers, closed and arenas
_HANDOVER = threading.Lock()
# Outputs copied at the end of every step, at most this many bytes in all (the largest first
# left out): an LLM's logits are read rarely and would cost a copy per step.
DOWNLOAD_LIMIT = 16 << 20


@dataclass(frozen=True)
class Part:
    """Workgroups [start, end) of plan dispatch `dispatch` along its kernel's cut_axis: run
    alone, with a base workgroup (hal.Dispatch.base), it does that much of the dispatch."""

    dispatch: int
    start: int
    end: int


def _on_axis(v: tuple[int, int, int], axis: int, value: int) -> tuple[int, int, int]:
    out = list(v)
    out[axis] = value
    return out[0], out[1], out[2]


def check_fits(plan: Plan, device: Device) -> None:
    """Refuse a plan whose arenas are larger than the heap they would be allocated from, or
    than what the driver's budget leaves this process there: some drivers hand out more than
    they have (lavapipe reports one 2 GiB heap and does not enforce it), others fail part-way."""
    memory = device.backend.device_memory()
    need = sum(plan.memory.arena_bytes)
    if memory is None:
        return
    room, what = memory.size, f"its memory heap {memory.heap} holds {_gib(memory.size)}"
    if memory.available is not None and memory.available < room:
        room = memory.available
        what += (f", of which {_gib(memory.available)} is left to this process "
                 "(VK_EXT_memory_budget: other sessions and applications use the rest)")
    if need > room:
        raise DeviceError(
            f"this model needs {_gib(need)} of device memory (parameters, optimizer state, "
            f"activations and gradients in {len(plan.memory.arena_bytes)} arenas) but "
            f"{device.name!r} cannot hold it: {what}. Use a "
            "smaller model or batch, close other sessions on this device, or choose a device "
            "with more memory (vkml.Device(...) or VKML_DEVICE)")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB ({nbytes} bytes)"


class BoundPlan:
    def __init__(self, plan: Plan, device: Device, owner: BoundPlan | None = None,
                 shared: dict[int, int] | None = None) -> None:
        """`owner`, `shared`: this plan's parameter slots (keys) that live in `owner`'s slots
        (values), as runtime/sharing.py matched them; plan.memory leaves them out."""
        self.plan, self.device = plan, device
        self.backend = backend = device.backend
        self.owner = owner
        self.shared = dict(shared or {})
        self.sharers: list[BoundPlan] = []  # plans that read this plan's parameters
        self._programs: list[object] = []
        self._kernels = list({d.kernel.wgsl: d.kernel
                              for d in (*plan.prologue, *plan.dispatches)}.values())
        self._pipelines: dict[str, object] = {}
        self.arenas: list[object] = []
        self._staging: list[object] = []
        self._upload_programs: list[object] = []
        self._readback: object | None = None
        self.download_offsets: dict[int, int] = {}  # output slot -> offset in _readback
        self.download_program: object | None = None
        self.frames = FrameBindings(self)
        self.input_program: object | None = None  # the bound inputs' copies and conversions
        self.output_program: object | None = None  # the bound outputs' copies
        # A host's (timeline semaphore, value) the next step's first submission waits for.
        self.host_wait: tuple[object, int] | None = None
        self._next_staging = 0
        self._latest: dict[str, np.ndarray] = {}  # each input's value for the next step
        self._version: dict[str, int] = {}
        self._held: list[dict[str, int]] = [{} for _ in range(STAGING_BUFFERS)]
        self.last: object | None = None  # the latest program submitted
        self.in_flight = False
        self.closed = False
        # The step in progress, for the checks between plans sharing parameters.
        self.mid_step = False  # a step's first piece is submitted, its last one not yet
        self.updates_left = 0  # its pieces that write parameters, not yet submitted
        self.updated_some = False  # one of its pieces that write parameters was submitted
        params = {s for s in plan.params.values()}
        self.step_writes_params = any(s in params for d in plan.dispatches for s in d.writes)
        self.host_writes = 0  # bumped by every host write of this plan's parameters
        self.step_updates = 0  # bumped by every submission that updates them
        self.prologue_program: object | None = None
        self._prologue_ran: tuple[int, ...] | None = None  # the counters when it last ran
        # whether the prologue reads a parameter the owner's steps update
        read = {self.shared[s] for d in plan.prologue for s in d.reads if s in self.shared}
        self._follows_updates = owner is not None and any(
            read & d.writes for d in owner.plan.dispatches)
        check_fits(plan, device)
        try:
            for i, n in enumerate(plan.memory.arena_bytes):  # one by one: close() frees them
                self.arenas.append(backend.create_buffer(max(n, 4), "device", f"arena {i}"))
            align = max(device.caps.min_storage_offset_alignment, 16)
            self.staging_offsets: dict[str, int] = {}
            staged = 0
            for name, slot in plan.inputs.items():
                self.staging_offsets[name] = staged
                staged += -(-plan.slots[slot].nbytes // align) * align
            backend.prefetch(self._kernels)  # works meanwhile on what pipelines need
            self.write_initial_values()
            pipelines = device.pipelines.acquire(self._kernels)
            self._pipelines = {k.wgsl: p for k, p in zip(self._kernels, pipelines)}
            if plan.inputs:
                for b in range(STAGING_BUFFERS):
                    staging = backend.create_buffer(max(staged, 4), "upload", f"inputs {b}")
                    self._staging.append(staging)
                    self._upload_programs.append(self.record_commands(
                        self.uploads(b), f"inputs {b}"))
            downloads = self.downloads()
            if downloads:
                self.download_program = self.record_commands(downloads, "outputs")
            if plan.prologue:
                self.prologue_program = self.record_commands(self.prologue_commands(),
                                                             "prologue")
            phases = {d.phase for d in plan.dispatches}
            self.step_program = self.record(self.indices(phases), "step")
            self.forward_program = (self.record(self.indices({"forward"}), "forward")
                                    if phases != {"forward"} else self.step_program)
        except BaseException:
            self.close()
            raise
        if owner is not None:
            with _HANDOVER:
                owner.sharers.append(self)
        self.unset_inputs = set(plan.inputs)
        # The training steps this session has begun (graph.TRAINING_STEP): none in a session
        # without a loss, whose steps are all inference.
        self.training_steps = 0
        if TRAINING_STEP in plan.inputs:
            self.write_input(TRAINING_STEP, np.zeros((), np.int32))

    @property
    def staging_buffers(self) -> list[object]:
        return list(self._staging)

    @property
    def kernel_count(self) -> int:
        return len(self._kernels)

    def indices(self, phases: Iterable[str]) -> list[int]:
        """The dispatches of the given phases, in plan order."""
        wanted = set(phases)
        return [i for i, d in enumerate(self.plan.dispatches) if d.phase in wanted]

    def uploads(self, buffer: int) -> list[Command]:
        """The copies of every input from staging buffer `buffer` into the arena."""
        plan = self.plan
        return [Copy(self._staging[buffer], self.staging_offsets[name], *self.place(slot),
                     plan.slots[slot].nbytes) for name, slot in plan.inputs.items()
                if name not in self.frames.inputs]

    def downloads(self) -> list[Command]:
        """The copies of the outputs the host cannot read in place into a readback buffer
        (allocated on the first call), or nothing."""
        plan = self.plan
        if self._readback is None:
            slots = sorted({v.slot for v in plan.outputs.values()}
                           | {s for s, _ in plan.index_checks},
                           key=lambda s: plan.slots[s].nbytes)
            staged = [s for s in slots if self.backend.stage_reads(self.place(s)[0])]
            total = 0
            for s in staged:
                nbytes = -(-plan.slots[s].nbytes // 16) * 16
                if total + nbytes > DOWNLOAD_LIMIT:
                    break
                self.download_offsets[s] = total
                total += nbytes
            if not total:
                return []
            self._readback = self.backend.create_buffer(total, "readback", "outputs")
        return [Copy(*self.place(s), self._readback, at, self.plan.slots[s].nbytes)
                for s, at in self.download_offsets.items()]

    def prologue_commands(self) -> list[Command]:
        """What the prologue runs (Plan.prologue), a program of its own before a step's."""
        return self.commands(range(len(self.plan.prologue)), self.plan.prologue)

    def commands(self, indices: Iterable[int | Part],
                 dispatches: Sequence[PlannedDispatch] | None = None) -> list[Command]:
        """The commands of the dispatches at `indices` (in plan order; a Part for a range of
        one's workgroups) of the step's (or of `dispatches`: the prologue's), with a barrier
        wherever the level changes. The inputs' copies are a program of their own
        (upload())."""
        plan = self.plan
        dispatches = plan.dispatches if dispatches is None else dispatches
        commands: list[Command] = []
        level = None
        for item in indices:
            i = item.dispatch if isinstance(item, Part) else item
            d = dispatches[i]
            if level is not None and d.level != level:
                commands.append(Barrier())
            level = d.level
            bindings = tuple(Binding(*self.place(s), max(plan.slots[s].nbytes, 4), w)
                             for s, w in zip(d.slots, d.kernel.writable))
            groups, base = d.kernel.groups, (0, 0, 0)
            axis = d.kernel.cut_axis
            if isinstance(item, Part) and axis is not None:
                groups = _on_axis(groups, axis, item.end - item.start)
                base = _on_axis(base, axis, item.start)
            commands.append(Dispatch(self._pipelines[d.kernel.wgsl], bindings, groups, base))
        return commands

    def record(self, indices: Iterable[int | Part], label: str) -> object:
        """A program of the dispatches at `indices` (freed with the session)."""
        return self.record_commands(self.commands(indices), label)

    def record_commands(self, commands: Sequence[Command], label: str) -> object:
        return self.keep(self.backend.record(commands, label))

    def keep(self, program: object) -> object:
        """Free `program` when the session closes."""
        self._programs.append(program)
        return program

    def drop(self, program: object | None) -> None:
        """Free a kept program now (the caller waited for its work)."""
        if program is not None:
            self._programs.remove(program)
            self.backend.free_program(program)

    def rebind(self) -> None:
        """Record again what the host's bound buffers and images change: the uploads (which
        leave bound inputs out) and the programs copying into and out of them."""
        self.wait()
        for b, program in enumerate(self._upload_programs):
            self.drop(program)
            self._upload_programs[b] = self.record_commands(self.uploads(b), f"inputs {b}")
        self.drop(self.input_program)
        self.drop(self.output_program)
        self.input_program = self.output_program = None
        commands = self.frames.input_commands()
        if commands:
            self.input_program = self.record_commands(commands, "bound inputs")
        commands = self.frames.output_commands()
        if commands:
            self.output_program = self.record_commands(commands, "bound outputs")

    # ---- running ------------------------------------------------------------------------------
    def require_inputs(self) -> None:
        if self.unset_inputs:
            missing = ", ".join(f"'{n}'" for n in sorted(self.unset_inputs))
            raise InputError(f"input {missing} was never set; call set_input(name, array) first")

    def upload(self, forward_only: bool = False) -> int | None:
        """Bring the staging buffer the next step copies its inputs from up to date; returns
        its index (None without inputs). That buffer was last read by the step before the
        previous one, so this waits only if that one is still running. The training step's
        number goes with them (0 for a `forward_only` pass or where there is no loss)."""
        if not self._staging:
            return None
        if TRAINING_STEP in self.plan.inputs:
            training = self.plan.trainable is not None and not forward_only
            self.training_steps += training
            self.write_input(TRAINING_STEP, np.array(self.training_steps if training else 0,
                                                     np.int32))
        b = self._next_staging
        held = self._held[b]
        stale = [n for n, v in self._version.items() if held.get(n) != v]
        if stale:
            self.backend.wait_for(self._upload_programs[b])
            for name in stale:
                self.backend.write_buffer(self._staging[b], self.staging_offsets[name],
                                          memoryview(self._latest[name]).cast("B"))
                held[name] = self._version[name]
        self._next_staging = (b + 1) % STAGING_BUFFERS
        return b

    def check_submit(self, begins: bool, updates: int) -> None:
        """Refuse a submission that would let a step see half of a parameter update (see
        runtime/sharing.py): a sharing plan's step starting while its owner is part-way
        through its updates, or the owner's updates while a sharing plan's step is part-way
        submitted. `updates`: how many of the submission's programs write parameters."""
        owner = self.owner
        if begins and owner is not None and owner.updating:
            raise InputError(
                "this session reads the parameters of another session that is part-way "
                f"through a parameter update ({owner.updates_left} of its pieces that write "
                "parameters not yet submitted): submit the rest of its step first (its "
                "`updating` property says when it is safe)")
        if updates and any(s.mid_step for s in self.sharers):
            raise InputError(
                "a session sharing this session's parameters is part-way through a chunked "
                "step; submit the rest of its step before pieces of this one that update the "
                "parameters (they would see some layers old and some new)")

    def submit(self, programs: Sequence[object], *, begins: bool = True, ends: bool = True,
               updates: int = 0, total_updates: int = 0, upload: bool | None = None,
               forward_only: bool = False) -> None:
        """Submit `programs` in one queue submission, after the inputs' upload when the batch
        begins a step (`upload`, by default `begins`). `updates`: programs among them that
        write parameters; `total_updates`: all of the step's such programs (when `begins`);
        `forward_only`: the batch is a forward pass (forward()), not a training step. A Ctrl-C
        meanwhile is raised after the submission and its bookkeeping."""
        with deferred_interrupts():
            self._submit(programs, begins, ends, updates, total_updates, upload, forward_only)

    def _submit(self, programs: Sequence[object], begins: bool, ends: bool, updates: int,
                total_updates: int, upload: bool | None, forward_only: bool) -> None:
        self.check_submit(begins, updates)
        batch = list(programs)
        if begins if upload is None else upload:
            staging = self.upload(forward_only)
            first = [] if staging is None else [self._upload_programs[staging]]
            batch[:0] = first + ([self.input_program] if self.input_program is not None else [])
        prologue = self.prologue_due() if begins else None
        if prologue is not None:
            assert self.prologue_program is not None
            batch.insert(0, self.prologue_program)
        if ends:
            batch += [p for p in (self.output_program, self.download_program) if p is not None]
        wait, self.host_wait = (self.host_wait, None) if begins else (None, self.host_wait)
        if wait is not None:
            assert self.backend.timeline is not None
            self.backend.timeline.submit_after(batch, *wait)
        elif len(batch) == 1:
            self.backend.submit(batch[0])
        else:
            self.backend.submit_batch(batch)
        self.last, self.in_flight = batch[-1], True
        if prologue is not None:
            self._prologue_ran = prologue
        if updates:
            self.step_updates += 1
        if begins:
            self.mid_step, self.updated_some = True, False
            self.updates_left = total_updates
        self.updates_left -= updates
        self.updated_some = self.updated_some or updates > 0
        if ends:
            self.mid_step, self.updates_left = False, 0

    def prologue_due(self) -> tuple[int, ...] | None:
        """The parameter counters the prologue would run at, where it must run before the
        next step (it never ran, or a parameter it may read was written since); else None."""
        if self.prologue_program is None:
            return None
        owner = self.owner
        now = (self.host_writes,) if owner is None else (
            self.host_writes, owner.host_writes,
            owner.step_updates if self._follows_updates else 0)
        return None if now == self._prologue_ran else now

    def prologue_recorded(self, counters: tuple[int, ...]) -> None:
        """The prologue, recorded into a host's command buffer (Session.record), runs before
        the step recorded after it, at these counters."""
        self._prologue_ran = counters

    @property
    def updating(self) -> bool:
        """Part-way through a chunked step's parameter updates."""
        return self.mid_step and self.updated_some and self.updates_left > 0

    def wait(self) -> None:
        """Block until this plan's submitted work has finished."""
        if self.in_flight:
            assert self.last is not None
            self.backend.wait_for(self.last)
            self.in_flight = False

    def done_value(self) -> int:
        """The timeline value this plan's latest submission signals (0: none yet)."""
        timeline = self.backend.timeline
        if timeline is None or self.last is None:
            return 0
        return timeline.value_of(self.last)

    # ---- tensors ------------------------------------------------------------------------------
    def place(self, slot: int) -> tuple[object, int]:
        if slot in self.shared:
            assert self.owner is not None
            return self.owner.place(self.shared[slot])
        arena, offset = self.plan.memory.placement[slot]
        return self.arenas[arena], offset

    def write_input(self, name: str, array: np.ndarray) -> None:
        """Keep `array` (a copy) for the next step's upload; returns at once."""
        self._latest[name] = np.array(array, dtype=NUMPY_DTYPE[self.plan.slots[
            self.plan.inputs[name]].dtype], order="C", copy=True)
        self._version[name] = self._version.get(name, 0) + 1
        self.unset_inputs.discard(name)

    def write_initial_values(self) -> None:
        """Parameters and constants from the plan, optimizer state zeroed (device memory starts
        undefined); the owner's memory where parameters are shared keeps the owner's values."""
        writes = []
        for slot in self.plan.slots:
            if slot.id in self.shared:
                continue
            if slot.id in self.plan.initial_values:
                writes.append(HostWrite.of(*self.place(slot.id),
                                           self._bytes(slot, self.plan.initial_values[slot.id])))
            elif slot.role == "optimizer_state":
                writes.append(HostWrite(*self.place(slot.id), slot.nbytes))
        self.backend.write_buffers(writes)

    def write_slot(self, slot: Slot, array: np.ndarray) -> None:
        self.write_slots([(slot, array)])

    def write_slots(self, values: Sequence[tuple[Slot, np.ndarray]]) -> None:
        """Host values into slots, in as few submissions as the backend can (a checkpoint's
        hundreds of tensors)."""
        for slot, _ in values:
            if slot.id in self.shared:
                raise InputError(f"'{slot.label}' belongs to the session this one shares its "
                                 "parameters with: write it there")
        params = [slot.label for slot, _ in values if slot.role == "param"]
        if self.sharers and params:
            if any(s.mid_step for s in self.sharers):
                raise InputError(f"cannot write parameter '{params[0]}' while a session "
                                 "sharing it is part-way through a chunked step")
            for s in self.sharers:  # their submitted steps read the old values
                s.wait()
        if params:
            self.host_writes += 1
        self.backend.write_buffers([HostWrite.of(*self.place(slot.id), self._bytes(slot, array))
                                    for slot, array in values])

    @staticmethod
    def _bytes(slot: Slot, array: np.ndarray) -> memoryview:
        # the array's own bytes: a model's parameters are not copied into a bytes object first
        data = np.ascontiguousarray(array, dtype=NUMPY_DTYPE[slot.dtype])
        return memoryview(data.reshape(-1).view(np.uint8))

    def read_output(self, slot: Slot) -> np.ndarray:
        """An output as of this session's latest step: from the readback buffer the step's
        download filled where there is one (no submission), else read in place."""
        at = self.download_offsets.get(slot.id)
        if at is None:
            return self.read_slot(slot)
        self.wait()
        raw = self.backend.read_buffer(self._readback, at, slot.nbytes)
        return np.frombuffer(raw, dtype=NUMPY_DTYPE[slot.dtype]).reshape(slot.shape).copy()

    def read_slot(self, slot: Slot) -> np.ndarray:
        """One slot, through a read the backend keeps for reading it again (a value read every
        frame)."""
        self._wait_for_writers([slot])
        buffer, offset = self.place(slot.id)
        raw = self.backend.read_buffer(buffer, offset, slot.nbytes)
        return np.frombuffer(raw, dtype=NUMPY_DTYPE[slot.dtype]).reshape(slot.shape).copy()

    def read_slots(self, slots: Sequence[Slot]) -> list[np.ndarray]:
        """Many slots read once (a checkpoint, all parameters), in as few submissions as the
        backend can."""
        self._wait_for_writers(slots)
        raws = self.backend.read_buffers([(*self.place(s.id), s.nbytes) for s in slots])
        return [np.frombuffer(raw, dtype=NUMPY_DTYPE[s.dtype]).reshape(s.shape).copy()
                for s, raw in zip(slots, raws)]

    def _wait_for_writers(self, slots: Sequence[Slot]) -> None:
        self.wait()
        if any(s.id in self.shared for s in slots):
            assert self.owner is not None
            self.owner.wait()  # the owner's later updates write them

    # ---- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Free what binding made: programs, pipelines no other live session uses, buffers.
        The arenas of a plan whose parameters others still share stay until the last of those
        closes. Safe to call twice."""
        with _HANDOVER:  # the waits of an owner and a sharer closing at once, one at a time
            self.wait()
            for s in self.sharers:
                s.wait()
        for program in {id(p): p for p in self._programs}.values():
            self.backend.free_program(program)
        self._programs.clear()
        self._upload_programs.clear()
        self.input_program = self.output_program = None
        self.frames.close()
        for kernel in self._kernels:
            if kernel.wgsl in self._pipelines:
                self.device.pipelines.release(kernel)
        self._pipelines.clear()
        for buffer in [*self._staging, self._readback]:
            if buffer is not None:
                self.backend.free_buffer(buffer)
        self._staging, self._readback = [], None
        # An owner and its sharers may close on different threads at once: each decides under
        # the one lock who frees which arenas, and takes them away, so each is freed once.
        with _HANDOVER:
            self.closed = True
            freed = []
            owner = self.owner
            if owner is not None and self in owner.sharers:
                owner.sharers.remove(self)
                if owner.closed and not owner.sharers:
                    freed += owner.arenas
                    owner.arenas = []
            if not self.sharers:
                freed += self.arenas
                self.arenas = []
        for buffer in freed:
            self.backend.free_buffer(buffer)
