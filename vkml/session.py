"""The session: a compiled plan bound to a device, and the user's handle on it.

Construction allocates the memory plan's arenas, compiles each distinct kernel once, uploads
initial values and records the command buffers. After that, `step()` writes nothing but the
inputs' staging memory and submits a pre-recorded command buffer: no Python runs per dispatch.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence

import numpy as np

from . import naga
from .backend import Barrier, Binding, Command, Copy, Dispatch
from .device import Device, default_device
from .errors import InputError
from .graph import Graph, Tensor
from .kernels import optimizer as optimizer_kernels
from .optim import Optimizer
from .pipeline import lower
from .plan import Plan, Slot

NUMPY_DTYPE = {"f32": np.float32, "i32": np.int32}
STATE_PREFIX = "optimizer/"


def compile(graph: Graph, loss: Tensor | None = None, optimizer: Optimizer | None = None,
            device: Device | None = None, outputs: Mapping[str, Tensor] | None = None,
            rewrite: str = "greedy", keep_grads: bool | None = None) -> Session:
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
    """
    device = device or default_device()
    stages = lower(graph, device.caps, loss=loss, optimizer=optimizer, outputs=outputs,
                   rewrite=rewrite, keep_grads=keep_grads)
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
                spirv = naga.compile_wgsl(k.wgsl, k.name)
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

        def program(phases: set[str], label: str) -> object:
            commands = list(uploads)
            level = None
            for d in plan.dispatches:
                if d.phase not in phases:
                    continue
                if level is not None and d.level != level:
                    commands.append(Barrier())
                level = d.level
                bindings = tuple(Binding(*self._place(s), max(plan.slots[s].nbytes, 4), w)
                                 for s, w in zip(d.slots, d.kernel.writable))
                commands.append(Dispatch(pipelines[d.kernel.wgsl], bindings, d.kernel.groups))
            return backend.record(commands, label)

        phases = {d.phase for d in plan.dispatches}
        self._step_program = program(phases, "step")
        self._forward_program = (program({"forward"}, "forward") if phases != {"forward"}
                                 else self._step_program)

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

    def step(self) -> None:
        """Submit one step (a training step for a session with an optimizer) and return at once.
        Reads wait for it; `wait()` blocks explicitly."""
        self._submit(self._step_program)

    def forward(self) -> None:
        """Compute the outputs (and loss) only: no gradients, no update."""
        self._submit(self._forward_program)

    def _submit(self, program: object) -> None:
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
        self.wait()
        for program in {id(p): p for p in (self._step_program, self._forward_program)}.values():
            self._backend.free_program(program)
        for buffer in (*self._arenas, self._staging):
            self._backend.free_buffer(buffer)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------
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
