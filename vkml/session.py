"""The session: a compiled plan bound to a device, and the user's handle on it.

Construction allocates the memory plan's arenas, compiles each distinct kernel once, uploads
initial values and records the command buffers. After that, `step()` writes nothing but the
inputs' staging memory and submits a pre-recorded command buffer: no Python runs per dispatch.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from vkml import naga
from vkml.compiler.schedule import Plan, Slot
from vkml.compiler.stages import Trainable, lower
from vkml.errors import DeviceError, InputError
from vkml.graph import Graph, Tensor
from vkml.hal import Barrier, Binding, Command, Copy, Dispatch
from vkml.kernels import optimizer as optimizer_kernels
from vkml.optim import Optimizer
from vkml.runtime import chunking
from vkml.runtime.device import Device, default_device
from vkml.runtime.profiling import KernelRow, Profile, timestamps_plausible

NUMPY_DTYPE = {"f32": np.float32, "i32": np.int32}
STATE_PREFIX = "optimizer/"


def compile(graph: Graph, loss: Tensor | None = None, optimizer: Optimizer | None = None,
            device: Device | None = None, outputs: Mapping[str, Tensor] | None = None,
            rewrite: str = "greedy", keep_grads: bool | None = None,
            trainable: Trainable = None) -> Session:
    """Compile `graph` into a runnable session.

    - no `loss`: an inference session; `step()` computes the graph's outputs.
    - `loss` and no `optimizer`: `step()` computes the outputs, the loss and every parameter's
      gradient (`session.grad(name)`), changing nothing.
    - `loss` and `optimizer`: `step()` is one training step (forward, backward, update) in a
      single submission.
    The loss is readable as "loss"; `outputs` adds more readable tensors by name.
    `rewrite`: "greedy" fuses kernels (vkml/rewrite.py); "none" runs one kernel per op.
    `keep_grads`: keep gradients readable after a training step (by default only sessions
    without an optimizer keep them; otherwise their memory is reused).
    `trainable`: which parameters get gradients and updates: by default those built with
    `trainable=True` (the default of `graph.param`); or a collection of names, or a predicate
    on the name (e.g. `lambda n: n.startswith("decoder.")`). The others are frozen.
    """
    device = device or default_device()
    stages = lower(graph, device.caps, loss=loss, optimizer=optimizer, outputs=outputs,
                   rewrite=rewrite, keep_grads=keep_grads, trainable=trainable)
    return Session(stages.plan, device)


class Session:
    def __init__(self, plan: Plan, device: Device) -> None:
        self.plan, self.device = plan, device
        backend = self._backend = device.backend
        caps = device.caps
        self._arenas = [backend.create_buffer(max(n, 4), "device", f"arena {i}")
                        for i, n in enumerate(plan.memory.arena_bytes)]
        align = max(caps.min_storage_offset_alignment, 16)
        self._staging_offsets: dict[str, int] = {}
        staged = 0
        for name, slot in plan.inputs.items():
            self._staging_offsets[name] = staged
            staged += -(-plan.slots[slot].nbytes // align) * align
        self._staging = backend.create_buffer(max(staged, 4), "upload", "inputs")
        self._unset_inputs = set(plan.inputs)
        self._in_flight = False

        pipelines: dict[str, object] = {}
        for d in plan.dispatches:
            k = d.kernel
            if k.wgsl not in pipelines:
                spirv = naga.compile_wgsl(k.wgsl, k.name) if backend.consumes_spirv else b""
                pipelines[k.wgsl] = backend.create_pipeline(k.name, k.wgsl, spirv,
                                                            k.num_bindings, k.writable)
        self.kernel_count = len(pipelines)

        for slot in plan.slots:
            if slot.id in plan.initial_values:
                self._write_slot(slot, plan.initial_values[slot.id])
            elif slot.role == "optimizer_state":  # device memory starts undefined, not zeroed
                self._write_slot(slot, np.zeros(slot.shape, np.float32))

        uploads: list[Command] = [
            Copy(self._staging, self._staging_offsets[name], *self._place(slot),
                 plan.slots[slot].nbytes) for name, slot in plan.inputs.items()]
        if uploads:
            uploads.append(Barrier())

        self._pipelines, self._uploads = pipelines, uploads

        def program(phases: set[str], label: str) -> object:
            chosen = [i for i, d in enumerate(plan.dispatches) if d.phase in phases]
            return backend.record(self._commands(chosen, uploads=True), label)

        phases = {d.phase for d in plan.dispatches}
        self._step_program = program(phases, "step")
        self._forward_program = (program({"forward"}, "forward") if phases != {"forward"}
                                 else self._step_program)
        # Render-loop state (step(chunks=...), step_chunk, record, profile): programs made on
        # first use and kept; nothing is recorded per step.
        self._extra_programs: list[object] = []
        self._piece_cache: dict[tuple[int, ...], list[object]] = {}
        self._cuts_cache: dict[tuple[str, float, int], tuple[int, ...]] = {}
        self._chunking: tuple[str, float] = ("chunks", 1)
        self._pieces: list[object] | None = None  # the chunked step in progress
        self._piece_next = 0
        self._dispatch_ms: list[float] | None = None  # measured per dispatch
        self._estimates: list[float] | None = None
        self._cost_version = 0
        self._timed_program: object | None = None
        self._dispatch_programs: list[object] | None = None
        self._external: object | None = None
        self.timing_note = ""  # how the costs chunking uses were measured

    @property
    def inputs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Each input's (shape, dtype), as `set_input` expects them."""
        return {name: (self.plan.slots[s].shape, self.plan.slots[s].dtype)
                for name, s in self.plan.inputs.items()}

    # ---- running ------------------------------------------------------------------------------
    def set_input(self, name: str, value: np.ndarray | Sequence) -> None:
        """Copy `value` into input `name` for the next step (waits if a step is in flight)."""
        if name not in self.plan.inputs:
            known = ", ".join(f"'{n}'" for n in self.plan.inputs) or "none"
            raise InputError(f"unknown input '{name}'; this session's inputs are: {known}")
        slot = self.plan.slots[self.plan.inputs[name]]
        array = _conform(f"input '{name}'", value, slot)
        self.wait()
        self._backend.write_buffer(self._staging, self._staging_offsets[name], array.tobytes())
        self._unset_inputs.discard(name)

    def step(self, chunks: int | None = None, budget_ms: float | None = None) -> None:
        """Submit one step (a training step for a session with an optimizer) and return at once.
        Reads wait for it; `wait()` blocks explicitly.

        `chunks=N`: the step goes to the queue as N submissions (pieces cut at barrier
        boundaries, balanced by measured GPU time per dispatch when a profile() or budget step
        measured it, else by an estimate), so a host's submits can run between them. A level
        is never split: N above the number of levels gives one piece per level.
        `budget_ms=b`: as many pieces as needed for each to fit b ms of measured GPU time (a
        level longer than b is a piece of its own); when nothing was measured yet this step
        runs whole with timestamps, blocks until done, and later steps are cut by what it
        measured. Results are bit-identical to a whole step either way."""
        if chunks is None and budget_ms is None:
            self._submit(self._step_program)
            return
        self._finish_pieces()
        pieces = self._chunked(chunks, budget_ms)
        if pieces is None:
            self._measure_for_budget()
            return
        self._start_pieces(pieces)
        while self._pieces is not None:
            self._submit_piece()

    def step_chunk(self, chunks: int | None = None, budget_ms: float | None = None) -> int:
        """Submit the next piece of the current chunked step (starting a new step when none is
        in progress) and return at once: the number of pieces of this step still to submit (0:
        the whole step is submitted). Call it once per frame. `chunks`/`budget_ms` choose the
        pieces as in step(); they apply from the next new step, and by default the last
        chunking given to step() or step_chunk() is used (one piece if none was)."""
        if chunks is not None and budget_ms is not None:
            raise InputError("give chunks or budget_ms, not both")
        if chunks is not None or budget_ms is not None:
            self._chunking = ("chunks", chunks) if chunks is not None else ("budget", budget_ms)
        if self._pieces is None:
            kind, value = self._chunking
            pieces = self._chunked(value if kind == "chunks" else None,
                                   value if kind == "budget" else None)
            if pieces is None:
                self._measure_for_budget()
                return 0
            self._start_pieces(pieces)
        self._submit_piece()
        return len(self._pieces) - self._piece_next if self._pieces is not None else 0

    @property
    def pieces_left(self) -> int:
        """Pieces of the chunked step in progress not yet submitted (0 when none)."""
        return len(self._pieces) - self._piece_next if self._pieces is not None else 0

    def done(self) -> tuple[object, int]:
        """(timeline semaphore, value): the semaphore reaches the value when everything this
        session's device has submitted so far has finished. A host can wait on it in its own
        vkQueueSubmit (VkTimelineSemaphoreSubmitInfo) or with vkWaitSemaphores. The handle is
        a cffi VkSemaphore of the `vulkan` package (int(vulkan.ffi.cast("uintptr_t", h)) gives
        the integer). Vulkan only; needs timeline semaphores on the device."""
        backend = self._backend
        if not hasattr(backend, "timeline_semaphore"):
            raise DeviceError("session.done() needs the Vulkan backend (it returns a Vulkan "
                              "timeline semaphore); this session runs on "
                              f"{type(backend).__name__}")
        semaphore = backend.timeline_semaphore
        if semaphore is None:
            from vkml.vk.context import how_to_enable

            raise DeviceError("session.done() needs the Vulkan feature 'timelineSemaphore', "
                              "which this device runs without (vkml tracks its work with "
                              "fences): " + how_to_enable("timelineSemaphore"))
        return semaphore, backend.last_value

    def record(self, command_buffer: object) -> None:
        """Record this session's step (input copies from staging, dispatches, barriers between
        levels) into `command_buffer`, a primary command buffer the host is recording (a
        `vulkan` cffi handle or an integer) from a pool of this device's queue family. Vulkan
        only. Descriptor sets are made on the first call; later calls only record commands.

        Barriers around it (global VkMemoryBarriers): on entry, src ALL_COMMANDS | HOST with
        MEMORY_WRITE | HOST_WRITE -> dst COMPUTE_SHADER | TRANSFER with SHADER_READ |
        SHADER_WRITE | TRANSFER_READ | TRANSFER_WRITE: the host's earlier work in any stage
        finishes and its writes are visible before vkml touches memory. On exit, src
        COMPUTE_SHADER | TRANSFER with SHADER_WRITE | TRANSFER_WRITE -> dst ALL_COMMANDS | HOST
        with MEMORY_READ | MEMORY_WRITE | HOST_READ: the host's later work waits for vkml's
        and sees its results, and so does session.read() once the host has waited for the
        submission (vkml cannot see the host's submit: wait for it before reading, and do not
        run step() while a recorded copy may still be executing)."""
        backend = self._backend
        if not hasattr(backend, "record_into"):
            raise DeviceError("session.record() needs the Vulkan backend (it records into a "
                              f"Vulkan command buffer); this session runs on "
                              f"{type(backend).__name__}")
        self._require_inputs()
        self._finish_pieces()
        self.wait()
        if self._external is None:
            self._external = backend.prepare_external(
                self._commands(range(len(self.plan.dispatches)), uploads=True), "step (host)")
            self._extra_programs.append(self._external)
        backend.record_into(command_buffer, self._external)

    def profile(self, steps: int = 3) -> Profile:
        """Run `steps` steps with a timestamp after every dispatch and return per-kernel times
        (`print()` it; `.to_trace(path)` writes a Chrome/Perfetto trace of the GPU timeline).

        Timestamps are checked against the host's wall time of the same submission; when they
        are implausible (lavapipe 22.3 after graphics work) or the device has none, steps are
        timed from the host instead, one submission per dispatch (submit overhead included),
        and the result says so. If the timestamps of the last step turn out implausible, one
        more step is run for host timing. Measured times also steer step(chunks=...)."""
        if steps < 1:
            raise InputError("profile(steps) needs at least one step")
        self._require_inputs()
        self._finish_pieces()
        self.wait()
        backend, dispatches = self._backend, self.plan.dispatches
        timed = hasattr(backend, "program_timings") and self.device.caps.timestamp_period_ns > 0
        note = "" if timed else "the device writes no timestamps"
        gpu_runs: list[tuple[list[float], float]] = []
        host_runs: list[tuple[list[float], list[float], float]] = []
        remaining = steps
        while remaining > 0:
            if timed:
                if self._timed_program is None:
                    self._timed_program = backend.record(
                        self._commands(range(len(dispatches)), uploads=True), "step (timed)",
                        timestamps=True)
                    self._extra_programs.append(self._timed_program)
                t0 = time.perf_counter()
                backend.submit(self._timed_program)
                backend.wait()
                host_ms = (time.perf_counter() - t0) * 1e3
                ms = backend.program_timings(self._timed_program)
                remaining -= 1
                ok, why = timestamps_plausible(ms, host_ms)
                if ok:
                    gpu_runs.append((ms, host_ms))
                    continue
                timed = False
                note = (f"GPU timestamps implausible: {why}; timed from the host, one "
                        "submission per dispatch, submit overhead included")
                if gpu_runs:
                    note += f"; {len(gpu_runs)} earlier timestamped step(s) dropped"
                gpu_runs = []
                if remaining == 0:
                    note += "; one extra step was run for host timing"
                    remaining = 1
                continue
            host_runs.append(self._host_timed_step())
            remaining -= 1
        events = []
        clock = 0.0
        per_dispatch: list[list[float]] = []
        step_ms, host_step_ms = [], []
        if gpu_runs:
            source = "gpu timestamps"
            for s, (ms, host_ms) in enumerate(gpu_runs):
                t = clock
                for d, m in zip(dispatches, ms):
                    events.append((d.kernel.name, d.label, s, t, m))
                    t += m
                clock += max(host_ms, sum(ms))
                per_dispatch.append(ms)
                step_ms.append(sum(ms))
                host_step_ms.append(host_ms)
        else:
            source = "host timing"
            for s, (ms, starts, host_ms) in enumerate(host_runs):
                for d, m, start in zip(dispatches, ms, starts):
                    events.append((d.kernel.name, d.label, s, clock + start, m))
                clock += host_ms
                per_dispatch.append(ms)
                step_ms.append(sum(ms))
                host_step_ms.append(host_ms)
        runs = len(per_dispatch)
        mean = [sum(run[i] for run in per_dispatch) / runs for i in range(len(dispatches))]
        totals: dict[str, list[float]] = {}
        for d, i in zip(dispatches, range(len(dispatches))):
            entry = totals.setdefault(d.kernel.name, [0, 0.0])
            entry[0] += runs
            entry[1] += sum(run[i] for run in per_dispatch)
        rows = [KernelRow(name, int(c), t) for name, (c, t) in totals.items()]
        self._set_costs(mean, f"measured by profile() with {source}")
        return Profile(rows, runs, source, note, step_ms, host_step_ms, events, mean)

    def forward(self) -> None:
        """Compute the outputs (and loss) only: no gradients, no update."""
        self._submit(self._forward_program)

    def _submit(self, program: object) -> None:
        self._finish_pieces()
        if self._unset_inputs:
            missing = ", ".join(f"'{n}'" for n in sorted(self._unset_inputs))
            raise InputError(f"input {missing} was never set; call set_input(name, array) first")
        self.wait()
        self._backend.submit(program)
        self._in_flight = True

    def wait(self) -> None:
        if self._in_flight:
            self._backend.wait()
            self._in_flight = False

    # ---- reading and writing tensors ----------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """An output (such as "loss") or a parameter, by name, as a new numpy array."""
        if name in self.plan.params:
            return self._read_slot(self.plan.slots[self.plan.params[name]])
        if name not in self.plan.outputs:
            raise InputError(f"nothing named '{name}' can be read; outputs: "
                             f"{sorted(self.plan.outputs)}, parameters: {sorted(self.plan.params)}")
        view = self.plan.outputs[name]
        return self._read_slot(self.plan.slots[view.slot]).reshape(view.shape)

    def grad(self, param: str) -> np.ndarray:
        """The gradient of the loss for parameter `param`, as computed by the last step."""
        if param not in self.plan.grads:
            if param in self.plan.params and self.plan.trainable is not None and (
                    param not in self.plan.trainable):
                raise InputError(f"'{param}' is frozen (not trainable in this compilation): "
                                 "it has no gradient")
            if param in self.plan.params and self.plan.optimizer is not None:
                raise InputError(f"the gradient of '{param}' is not kept by this training "
                                 "session: compile with keep_grads=True to read it")
            raise InputError(f"no gradient for '{param}': compile with a loss, and name one of "
                             f"the parameters {sorted(self.plan.params)}")
        view = self.plan.grads[param]
        return self._read_slot(self.plan.slots[view.slot]).reshape(view.shape)

    def params(self) -> dict[str, np.ndarray]:
        return {name: self._read_slot(self.plan.slots[s]) for name, s in self.plan.params.items()}

    def set_param(self, name: str, value: np.ndarray) -> None:
        if name not in self.plan.params:
            raise InputError(f"unknown parameter '{name}'; parameters: {sorted(self.plan.params)}")
        slot = self.plan.slots[self.plan.params[name]]
        array = _conform(f"parameter '{name}'", value, slot)
        self.wait()
        self._write_slot(slot, array)

    def set_hyperparams(self, **values: float) -> None:
        """Change optimizer hyperparameters (e.g. lr) from the next step on; nothing is
        recompiled or re-recorded."""
        if self.plan.optimizer is None or self.plan.hyperparams_slot is None:
            raise InputError("this session has no optimizer")
        names = optimizer_kernels.hyperparam_names(self.plan.optimizer)
        unknown = set(values) - set(names[:-1])
        if unknown:
            raise InputError(f"unknown hyperparameter(s) {sorted(unknown)}; "
                             f"{type(self.plan.optimizer).__name__} has {names[:-1]}")
        slot = self.plan.slots[self.plan.hyperparams_slot]
        current = self._read_slot(slot)
        for k, v in values.items():
            current[names.index(k)] = v
        self._write_slot(slot, current)

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters by name, plus optimizer state under "optimizer/<param>/<state>" and the
        hyperparameters (step count included) under "optimizer/hyperparams"."""
        state = self.params()
        for param, slots in self.plan.optimizer_state.items():
            for s, slot in slots.items():
                state[f"{STATE_PREFIX}{param}/{s}"] = self._read_slot(self.plan.slots[slot])
        if self.plan.hyperparams_slot is not None:
            state[f"{STATE_PREFIX}hyperparams"] = self._read_slot(
                self.plan.slots[self.plan.hyperparams_slot])
        return state

    def save(self, path: str | os.PathLike) -> None:
        """Write a safetensors checkpoint atomically (a crash never leaves half a file)."""
        from safetensors.numpy import save_file

        path = os.fspath(path)
        metadata = {"format": "vkml"}
        if self.plan.optimizer is not None:
            metadata["optimizer"] = type(self.plan.optimizer).__name__
            metadata["hyperparams"] = ",".join(
                optimizer_kernels.hyperparam_names(self.plan.optimizer))
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        os.close(fd)
        try:
            save_file(self.state_dict(), tmp, metadata=metadata)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def load(self, path: str | os.PathLike, strict: bool = True) -> None:
        """Load parameters (and optimizer state, where the checkpoint has it) by name.
        Everything is checked before anything is written: a bad file changes nothing.
        `strict`: every parameter must be present and no unknown tensor may be."""
        from safetensors.numpy import load_file

        loaded = load_file(os.fspath(path))
        targets: dict[str, Slot] = {n: self.plan.slots[s] for n, s in self.plan.params.items()}
        for param, slots in self.plan.optimizer_state.items():
            targets |= {f"{STATE_PREFIX}{param}/{k}": self.plan.slots[s] for k, s in slots.items()}
        if self.plan.hyperparams_slot is not None:
            targets[f"{STATE_PREFIX}hyperparams"] = self.plan.slots[self.plan.hyperparams_slot]
        problems = []
        missing = [n for n in self.plan.params if n not in loaded]
        unknown = [n for n in loaded if n not in targets and not n.startswith(STATE_PREFIX)]
        if strict and missing:
            problems.append(f"missing parameters {missing}")
        if strict and unknown:
            problems.append(f"unknown tensors {unknown}")
        for name, value in loaded.items():
            slot = targets.get(name)
            if slot is not None and value.shape != slot.shape:
                problems.append(f"'{name}' has shape {value.shape}, expected {slot.shape}")
        if problems:
            raise InputError(f"cannot load {os.fspath(path)}: " + "; ".join(problems)
                             + " (nothing was changed)")
        self.wait()
        for name, value in loaded.items():
            if name in targets:
                self._write_slot(targets[name], value.astype(np.float32))

    # ---- inspection and teardown ----------------------------------------------------------------
    def explain(self) -> str:
        """What was compiled: dispatch and barrier counts, memory, kernels chosen, then the
        plan itself (tensors with their placement, dispatches between barriers)."""
        return self.plan.summary() + "\n\n" + self.plan.dump()

    def close(self) -> None:
        self._finish_pieces()
        self.wait()
        for program in self._extra_programs:
            self._backend.free_program(program)
        self._extra_programs.clear()
        for program in {id(p): p for p in (self._step_program, self._forward_program)}.values():
            self._backend.free_program(program)
        for buffer in (*self._arenas, self._staging):
            self._backend.free_buffer(buffer)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
    def _commands(self, indices: Iterable[int], uploads: bool) -> list[Command]:
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
            bindings = tuple(Binding(*self._place(s), max(plan.slots[s].nbytes, 4), w)
                             for s, w in zip(d.slots, d.kernel.writable))
            commands.append(Dispatch(self._pipelines[d.kernel.wgsl], bindings, d.kernel.groups))
        return commands

    def _require_inputs(self) -> None:
        if self._unset_inputs:
            missing = ", ".join(f"'{n}'" for n in sorted(self._unset_inputs))
            raise InputError(f"input {missing} was never set; call set_input(name, array) first")

    def _level_costs(self) -> list[float]:
        dispatches = self.plan.dispatches
        if self._dispatch_ms is not None:
            costs = self._dispatch_ms
        else:
            if self._estimates is None:
                self._estimates = [chunking.estimate(d.kernel.wgsl, d.kernel.groups)
                                   for d in dispatches]
            costs = self._estimates
        ranges = chunking.level_ranges([d.level for d in dispatches])
        return [sum(costs[a:b]) for a, b in ranges]

    def _set_costs(self, dispatch_ms: list[float], note: str) -> None:
        self._dispatch_ms = list(dispatch_ms)
        self._cost_version += 1
        self.timing_note = note

    def _chunked(self, chunks: int | None, budget_ms: float | None) -> list[object] | None:
        """The programs of a step cut into pieces (recorded once per distinct cut); None when
        budget_ms needs a measurement first."""
        if chunks is not None and budget_ms is not None:
            raise InputError("give chunks or budget_ms, not both")
        if chunks is not None:
            if int(chunks) != chunks or chunks < 1:
                raise InputError(f"chunks must be a positive integer, got {chunks!r}")
            key: tuple[str, float, int] = ("chunks", int(chunks), self._cost_version)
            self._chunking = ("chunks", int(chunks))
        else:
            if budget_ms is None or not budget_ms > 0:
                raise InputError(f"budget_ms must be a positive number, got {budget_ms!r}")
            self._chunking = ("budget", float(budget_ms))
            if self._dispatch_ms is None:
                return None
            key = ("budget", float(budget_ms), self._cost_version)
        cuts = self._cuts_cache.get(key)
        if cuts is None:
            costs = self._level_costs()
            cuts = tuple(chunking.balanced(costs, int(chunks)) if chunks is not None
                         else chunking.within_budget(costs, float(budget_ms)))
            self._cuts_cache[key] = cuts
        return self._piece_programs(cuts)

    def chunk_boundaries(self, chunks: int | None = None,
                         budget_ms: float | None = None) -> list[tuple[int, int]]:
        """The pieces step(chunks=...) / step(budget_ms=...) would submit, as [first, end)
        ranges of dispatch indices into session.plan.dispatches (records nothing)."""
        ranges = chunking.level_ranges([d.level for d in self.plan.dispatches])
        costs = self._level_costs()
        if chunks is not None:
            cuts = chunking.balanced(costs, int(chunks))
        elif budget_ms is not None and self._dispatch_ms is not None:
            cuts = chunking.within_budget(costs, float(budget_ms))
        else:
            raise InputError("give chunks, or budget_ms once times were measured (profile())")
        return [(ranges[a][0], ranges[b - 1][1])
                for a, b in chunking.pieces_of(cuts, len(ranges))]

    def _piece_programs(self, cuts: tuple[int, ...]) -> list[object]:
        programs = self._piece_cache.get(cuts)
        if programs is not None:
            return programs
        ranges = chunking.level_ranges([d.level for d in self.plan.dispatches])
        if not ranges:
            programs = [self._step_program]
        else:
            pieces = chunking.pieces_of(list(cuts), len(ranges))
            programs = []
            for k, (a, b) in enumerate(pieces):
                indices = range(ranges[a][0], ranges[b - 1][1])
                program = self._backend.record(self._commands(indices, uploads=k == 0),
                                               f"step piece {k + 1}/{len(pieces)}")
                programs.append(program)
                self._extra_programs.append(program)
        self._piece_cache[cuts] = programs
        return programs

    def _start_pieces(self, pieces: list[object]) -> None:
        self._require_inputs()
        self._pieces, self._piece_next = pieces, 0

    def _submit_piece(self) -> None:
        assert self._pieces is not None
        self._backend.submit(self._pieces[self._piece_next])
        self._in_flight = True
        self._piece_next += 1
        if self._piece_next == len(self._pieces):
            self._pieces = None

    def _finish_pieces(self) -> None:
        """Submit what is left of a chunked step in progress."""
        while self._pieces is not None:
            self._submit_piece()

    def _measure_for_budget(self) -> None:
        """One whole step with timestamps (blocking) to learn the per-dispatch GPU times."""
        profile = self.profile(steps=1)
        if profile.source != "gpu timestamps":
            # Host timing per dispatch includes a submission each; still the best we have.
            self.timing_note = "budget chunks cut by host timing: " + profile.note

    def _host_timed_step(self) -> tuple[list[float], list[float], float]:
        """One step as one submission per dispatch, each timed from the host: (ms per
        dispatch, start ms of each relative to the step, the step's wall ms)."""
        backend = self._backend
        if self._dispatch_programs is None:
            self._dispatch_programs = [
                backend.record(self._commands([i], uploads=i == 0), f"dispatch {i}")
                for i in range(len(self.plan.dispatches))]
            self._extra_programs.extend(self._dispatch_programs)
        ms, starts = [], []
        t_step = time.perf_counter()
        for program in self._dispatch_programs:
            t0 = time.perf_counter()
            backend.submit(program)
            backend.wait()
            t1 = time.perf_counter()
            starts.append((t0 - t_step) * 1e3)
            ms.append((t1 - t0) * 1e3)
        return ms, starts, (time.perf_counter() - t_step) * 1e3

    def _place(self, slot: int) -> tuple[object, int]:
        arena, offset = self.plan.memory.placement[slot]
        return self._arenas[arena], offset

    def _write_slot(self, slot: Slot, array: np.ndarray) -> None:
        buffer, offset = self._place(slot.id)
        data = np.ascontiguousarray(array, dtype=NUMPY_DTYPE[slot.dtype])
        self._backend.write_buffer(buffer, offset, data.tobytes())

    def _read_slot(self, slot: Slot) -> np.ndarray:
        self.wait()
        buffer, offset = self._place(slot.id)
        raw = self._backend.read_buffer(buffer, offset, slot.nbytes)
        return np.frombuffer(raw, dtype=NUMPY_DTYPE[slot.dtype]).reshape(slot.shape).copy()


def _conform(what: str, value: np.ndarray | Sequence, slot: Slot) -> np.ndarray:
    """Check a user's array against a slot's shape and dtype; convert only where lossless in
    kind (any float to f32, any integer to i32 within range)."""
    array = np.asarray(value)
    if array.shape != slot.shape:
        raise InputError(f"{what} expects shape {slot.shape}, got {array.shape}")
    if slot.dtype == "f32":
        if array.dtype.kind != "f":
            raise InputError(f"{what} expects floating-point values (float32), got "
                             f"{array.dtype}; convert with .astype(np.float32)")
        return array.astype(np.float32, copy=False)
    if array.dtype.kind not in "iu":
        raise InputError(f"{what} expects integers (int32), got {array.dtype}; convert with "
                         ".astype(np.int32)")
    if array.size and (array.min() < -2**31 or array.max() >= 2**31):
        raise InputError(f"{what}: values do not fit in int32")
    return array.astype(np.int32, copy=False)
