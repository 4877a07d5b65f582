"""Planning: Graph (+ gradients, optimizer) -> Plan, the fixed sequence of dispatches a session
records once.

Every node that computes something becomes one dispatch of its lowered kernel; views (reshape)
share their input's storage. A barrier is placed before a dispatch only when it reads or
overwrites something written, or overwrites something read, since the previous barrier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from . import kernels
from .backend import Capabilities
from .errors import GraphError
from .graph import Graph, Tensor
from .kernels import Kernel
from .kernels import optimizer as optimizer_kernels
from .memory import MemoryPlan, plan_memory
from .ops import OPS
from .optim import Optimizer

Role = Literal["input", "param", "constant", "activation", "gradient", "optimizer_state",
               "hyperparams"]
Phase = Literal["forward", "backward", "update"]


@dataclass(frozen=True)
class Slot:
    """A tensor's storage: several nodes (a tensor and its reshapes) may share one slot."""

    id: int
    label: str
    shape: tuple[int, ...]
    dtype: str
    role: Role

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class View:
    """A readable tensor: a slot seen with the tensor's own shape (a reshape shares its slot)."""

    slot: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlannedDispatch:
    kernel: Kernel
    slots: tuple[int, ...]  # one per kernel binding
    barrier_before: bool
    phase: Phase
    label: str  # the node (or update) it computes


@dataclass
class Plan:
    slots: list[Slot]
    dispatches: list[PlannedDispatch]
    memory: MemoryPlan
    inputs: dict[str, int]
    outputs: dict[str, View]
    params: dict[str, int]
    grads: dict[str, View]  # parameter name -> its gradient
    optimizer: Optimizer | None = None
    optimizer_state: dict[str, dict[str, int]] = field(default_factory=dict)
    hyperparams_slot: int | None = None
    initial_values: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def barrier_count(self) -> int:
        return sum(d.barrier_before for d in self.dispatches)

    def dump(self) -> str:
        lines = [f"plan: {len(self.dispatches)} dispatches, {self.barrier_count} barriers, "
                 f"{len(self.slots)} tensors, {self.memory.physical_bytes} bytes in "
                 f"{len(self.memory.arena_bytes)} arena(s)"]
        for s in self.slots:
            arena, offset = self.memory.placement[s.id]
            lines.append(f"  t{s.id}: {s.dtype}[{','.join(map(str, s.shape))}] {s.role:15} "
                         f"arena {arena} +{offset:<10} {s.label}")
        for d in self.dispatches:
            if d.barrier_before:
                lines.append("  -- barrier --")
            bindings = ", ".join(f"t{s}" for s in d.slots)
            lines.append(f"  [{d.phase:8}] {d.kernel.name} groups={d.kernel.groups} "
                         f"({bindings})  # {d.label}")
        return "\n".join(lines)

    __str__ = dump


def make_plan(graph: Graph, outputs: dict[str, Tensor], grads: dict[str, Tensor],
              optimizer: Optimizer | None, caps: Capabilities) -> Plan:
    for name, t in outputs.items():
        if not graph._owns(t):
            raise GraphError(f"output '{name}' ({t.label}) is not a node of this graph")
    roots = [*outputs.values(), *grads.values()]
    nodes = graph.reachable(roots)
    grad_ids = {t.id for t in grads.values()}
    forward_ids = {t.id for t in graph.reachable(outputs.values())}
    slots: list[Slot] = []
    slot_of: dict[int, int] = {}

    def new_slot(label: str, shape: tuple[int, ...], dtype: str, role: Role) -> int:
        slots.append(Slot(len(slots), label, shape, dtype, role))
        return len(slots) - 1

    initial: dict[int, np.ndarray] = {}
    dispatches: list[PlannedDispatch] = []
    for node in nodes:
        archetype = OPS[node.op].archetype
        if archetype == "view":
            slot_of[node.id] = slot_of[node.inputs[0].id]
            continue
        role: Role = {"input": "input", "param": "param", "constant": "constant"}.get(
            node.op, "gradient" if node.id in grad_ids else "activation")
        slot_of[node.id] = new_slot(node.name or node.label, node.shape, node.dtype, role)
        if archetype == "source":
            if node.id in graph.initial_values:
                initial[slot_of[node.id]] = graph.initial_values[node.id]
            continue
        kernel = kernels.lower(node, caps)
        bound = tuple(slot_of[t.id] for t in node.inputs) + (slot_of[node.id],)
        phase: Phase = "forward" if node.id in forward_ids else "backward"
        dispatches.append(PlannedDispatch(kernel, bound, False, phase, f"{node.label} "
                                          f"at {node.where}"))

    params = {name: slot_of[t.id] for name, t in graph.params.items() if t.id in slot_of}
    plan = Plan(slots, dispatches, MemoryPlan({}, [], 0),
                inputs={n: slot_of[t.id] for n, t in graph.inputs.items() if t.id in slot_of},
                outputs={n: View(slot_of[t.id], t.shape) for n, t in outputs.items()},
                params=params, grads={n: View(slot_of[t.id], t.shape) for n, t in grads.items()},
                initial_values=initial)
    if optimizer is not None:
        _add_optimizer(plan, optimizer, new_slot, caps)
    plan.dispatches = _place_barriers(plan.dispatches)
    try:
        plan.memory = plan_memory({s.id: s.nbytes for s in slots},
                                  max(caps.min_storage_offset_alignment, 16),
                                  caps.max_storage_buffer_range)
    except ValueError as e:
        raise GraphError(f"{e}; on {caps.device_name}") from None
    return plan


def _add_optimizer(plan: Plan, optimizer: Optimizer, new_slot, caps: Capabilities) -> None:
    names = optimizer_kernels.hyperparam_names(optimizer)
    hp = new_slot("optimizer hyperparameters", (len(names),), "f32", "hyperparams")
    values = optimizer.hyperparams()
    plan.initial_values[hp] = np.array([values.get(n, 0.0) for n in names], np.float32)
    plan.optimizer, plan.hyperparams_slot = optimizer, hp
    counter = optimizer_kernels.step_counter(optimizer)
    plan.dispatches.append(PlannedDispatch(counter, (hp,), False, "update", "step count"))
    for name, param in plan.params.items():
        shape = plan.slots[param].shape
        state = {s: new_slot(f"{name} {s}", shape, "f32", "optimizer_state")
                 for s in optimizer.state_names}
        plan.optimizer_state[name] = state
        kernel = optimizer_kernels.update(optimizer, plan.slots[param].nbytes // 4, caps)
        bound = (param, plan.grads[name].slot, hp, *state.values())
        plan.dispatches.append(PlannedDispatch(kernel, bound, False, "update", f"update {name}"))


def _place_barriers(dispatches: list[PlannedDispatch]) -> list[PlannedDispatch]:
    placed = []
    written: set[int] = set()  # since the last barrier
    read: set[int] = set()
    for d in dispatches:
        writes = {s for s, w in zip(d.slots, d.kernel.writable) if w}
        reads = set(d.slots) - writes
        # read-after-write, write-after-write and write-after-read all need the barrier
        hazard = bool((reads | writes) & written or writes & read)
        if hazard:
            written, read = set(), set()
        written |= writes
        read |= reads
        placed.append(PlannedDispatch(d.kernel, d.slots, hazard, d.phase, d.label))
    return placed
