"""The compiler's product: a Plan, the fixed sequence of dispatches a session records once, with
each tensor's place in memory, and the records it is made of. What the runtime reads of the
compiler is these types."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from vkml.compiler.memory_plan import FOREVER, Lifetime, MemoryPlan, alignment, plan_memory
from vkml.hal import Access, Capabilities, Kernel
from vkml.optim import Optimizer

ELSEWHERE = -1  # the arena index of a slot held in another plan's memory (shared parameters)

Role = Literal["input", "param", "constant", "activation", "gradient", "optimizer_state",
               "hyperparams", "pack", "hoisted"]
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
        return 4 * math.prod(self.shape)


@dataclass(frozen=True)
class View:
    """A readable tensor: a slot seen with the tensor's own shape (a reshape shares its slot)."""

    slot: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Update:
    """An optimizer dispatch: the update of one parameter or of a pack of them (`size`
    elements), or the step count (`size` 0) that runs once before the updates."""

    optimizer: Optimizer
    size: int
    guarded: bool = False  # the loss is bound after the tables; nothing changes unless finite
    checks: int = 0  # index checks bound last; nothing changes if one found an index out of range


@dataclass(frozen=True)
class PlannedDispatch:
    slots: tuple[int, ...]  # one per kernel binding: the inputs in order, then the output
    access: tuple[Access, ...]  # per binding
    level: int  # a barrier separates dispatches of different levels
    phase: Phase
    label: str  # the node (or update) it computes
    op: str | None = None  # the op of the node it computes (None: an optimizer dispatch)
    update: Update | None = None
    in_place: int | None = None  # a pointwise result written over this input (no output slot)
    kernel: Kernel | None = None  # made by codegen, the last stage
    # per binding, the slots a pack binding holds (Plan.packs), read or written as it is
    covers: tuple[tuple[int, ...], ...] = ()

    @property
    def writes(self) -> set[int]:
        held = self.covers or ((),) * len(self.slots)
        return {t for s, a, inner in zip(self.slots, self.access, held) if a == "read_write"
                for t in (s, *inner)}

    @property
    def reads(self) -> set[int]:
        # a writable binding may be read too (an optimizer update reads its parameter)
        return {*self.slots, *(s for held in self.covers for s in held)}

    @property
    def name(self) -> str:
        """The kernel's name once codegen ran, else what the dispatch computes."""
        return self.kernel.name if self.kernel is not None else self.label


@dataclass(frozen=True)
class Plan:
    """What a session binds: tensors (slots) and their places in memory, the dispatches in
    order with the kernel of each, names of inputs, outputs, parameters and gradients, the
    optimizer's state and tables. Made by the compiler once and never changed (a session that
    shares parameters binds a copy with its own memory plan), holding no graph."""

    slots: tuple[Slot, ...]
    dispatches: tuple[PlannedDispatch, ...]
    memory: MemoryPlan
    inputs: dict[str, int]
    outputs: dict[str, View]
    params: dict[str, int]
    grads: dict[str, View]  # parameter name -> its gradient
    optimizer: Optimizer | None = None
    optimizer_state: dict[str, dict[str, int]] = field(default_factory=dict)
    hyperparams_slot: int | None = None
    optimizer_tables: dict[str, int] = field(default_factory=dict)  # name -> slot
    initial_values: dict[int, np.ndarray] = field(default_factory=dict)
    lifetimes: dict[int, Lifetime] = field(default_factory=dict)
    aliases: dict[int, int] = field(default_factory=dict)  # slot written in place -> its input
    # Parameters that get gradients (None: no loss, nothing is differentiated)
    trainable: tuple[str, ...] | None = None
    # The optimizer hyperparameter buffer's layout: one f32 per name, the step count "t" last
    hyperparams: tuple[str, ...] = ()
    # i32 inputs that select classes or rows: name -> (first valid, end, what they index)
    input_ranges: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    # Slots laid out one after another inside a larger one (role "pack"), which an optimizer
    # update binds whole: pack slot -> (slot, byte offset in the pack) for each
    packs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # The index checks' results (vkml/ops/indexing.py index_check: i32 (found, operand, value,
    # position)), each with what its operands are, read by the session after a step
    index_checks: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # What the step reads that depends on parameters and constants alone (compiler/schedule.py
    # `hoisted`): dispatches run before a step only when a parameter they read was written
    # since they last ran, at levels before the step's; their results the step reads are
    # slots of role "hoisted", kept between steps
    prologue: tuple[PlannedDispatch, ...] = ()

    def without(self, elsewhere: Collection[int], caps: Capabilities) -> Plan:
        """This plan with the slots `elsewhere` held in another plan's memory (a session that
        shares the owner's parameters): its memory planned without them, their placement
        arena ELSEWHERE."""
        lifetimes = {s: lt for s, lt in self.lifetimes.items() if s not in elsewhere}
        aliases = {k: v for k, v in self.aliases.items()
                   if k not in elsewhere and v not in elsewhere}
        memory = plan_memory(lifetimes, alignment(caps), caps.max_storage_buffer_range, aliases,
                             self.packs)
        placement = {**memory.placement, **{s: (ELSEWHERE, 0) for s in elsewhere}}
        return dataclasses.replace(self, memory=MemoryPlan(placement, memory.arena_bytes,
                                                            memory.logical_bytes))

    @property
    def barrier_count(self) -> int:
        return len({d.level for d in self.dispatches}) - 1 if self.dispatches else 0

    def memory_report(self) -> dict[str, int]:
        """Bytes: logical (one buffer per tensor) per role and in all, and physical."""
        report: dict[str, int] = {}
        for s in self.slots:
            if s.role == "pack":  # its slots count
                continue
            report[f"logical_{s.role}"] = report.get(f"logical_{s.role}", 0) + s.nbytes
        report["logical"] = self.memory.logical_bytes
        report["physical"] = self.memory.physical_bytes
        return report

    def summary(self) -> str:
        kernels = Counter(d.name for d in self.dispatches)
        report = self.memory_report()
        by_role = ", ".join(f"{k[8:]} {v}" for k, v in report.items() if k.startswith("logical_"))
        lines = [f"{len(self.dispatches)} dispatches of {len(kernels)} kernels, "
                 f"{self.barrier_count} barriers",
                 f"memory: {report['physical']} bytes allocated for {report['logical']} bytes of "
                 f"tensors ({100 * report['physical'] / max(report['logical'], 1):.0f}%); "
                 f"by role: {by_role}",
                 "kernels: " + ", ".join(f"{k}" + (f" x{n}" if n > 1 else "")
                                         for k, n in kernels.items())]
        if self.prologue:
            hoisted = Counter(d.name for d in self.prologue)
            lines.append(f"prologue (run when a parameter it reads changes): "
                         f"{len(self.prologue)} dispatches hoisted out of every step, "
                         f"{len({d.level for d in self.prologue})} levels: "
                         + ", ".join(f"{k}" + (f" x{n}" if n > 1 else "")
                                     for k, n in hoisted.items()))
        return "\n".join(lines)

    def dump_memory(self) -> str:
        """Each tensor's lifetime (in schedule levels) and placement, biggest first."""
        lines = [self.summary().splitlines()[1]]
        for slot in sorted(self.slots, key=lambda s: -s.nbytes):
            life = self.lifetimes[slot.id]
            arena, offset = self.memory.placement[slot.id]
            span = "pinned" if life.last == FOREVER and life.first < 0 else (
                f"levels {life.first}..{'end' if life.last == FOREVER else life.last}")
            lines.append(f"  t{slot.id:<4} {slot.nbytes:>10} B  arena {arena} +{offset:<10} "
                         f"{span:18} {slot.role:15} {slot.label}")
        return "\n".join(lines)

    def dump(self) -> str:
        hoisted = f" (and {len(self.prologue)} in the prologue)" if self.prologue else ""
        lines = [f"plan: {len(self.dispatches)} dispatches{hoisted}, {self.barrier_count} "
                 f"barriers, {len(self.slots)} tensors, {self.memory.physical_bytes} bytes in "
                 f"{len(self.memory.arena_bytes)} arena(s)"]
        for s in self.slots:
            arena, offset = self.memory.placement[s.id]
            lines.append(f"  t{s.id}: {s.dtype}[{','.join(map(str, s.shape))}] {s.role:15} "
                         f"arena {arena} +{offset:<10} {s.label}")
        if self.prologue:
            lines.append(f"prologue: {len(self.prologue)} dispatches, run before a step only "
                         "when a parameter they read was written since they last ran")
            lines += _dispatch_lines(self.prologue)
            lines.append("step:")
        lines += _dispatch_lines(self.dispatches)
        return "\n".join(lines)

    __str__ = dump


def _dispatch_lines(dispatches: tuple[PlannedDispatch, ...]) -> list[str]:
    lines = []
    for previous, d in zip([None, *dispatches], dispatches):
        if previous is not None and previous.level != d.level:
            lines.append("  -- barrier --")
        bindings = ", ".join(f"t{s}" for s in d.slots)
        groups = f" groups={d.kernel.groups}" if d.kernel is not None else ""
        lines.append(f"  [{d.phase:8}] {d.name}{groups} ({bindings})  # {d.label}")
    return lines
