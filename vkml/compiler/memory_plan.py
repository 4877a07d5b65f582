"""Memory planning: where each tensor of the plan lives, as (arena, byte offset).

Tensors whose lifetimes do not overlap share memory. A lifetime is an interval of schedule
levels (see schedule.py: dispatches of one level run between the same two barriers), so two tensors
sharing bytes are always separated by a barrier and never race. Tensors live forever when they
are pinned: parameters, optimizer state, constants written once at start-up. Placement is the
greedy-by-size heuristic: biggest tensors first, each at the lowest offset that is free for its
whole lifetime. Ranges are aligned for storage-buffer binding offsets; arenas are capped at
ARENA_LIMIT so no single allocation grows past what drivers hand out reliably.
"""

from __future__ import annotations

from dataclasses import dataclass

ARENA_LIMIT = 1 << 30
FOREVER = 1 << 62


@dataclass(frozen=True)
class Lifetime:
    nbytes: int
    first: int  # schedule level that writes it (-1: before the first dispatch)
    last: int  # last level that reads it (FOREVER: pinned)


@dataclass(frozen=True)
class MemoryPlan:
    placement: dict[int, tuple[int, int]]  # slot id -> (arena index, byte offset)
    arena_bytes: list[int]
    logical_bytes: int  # sum of all tensors: what one buffer per tensor would take

    @property
    def physical_bytes(self) -> int:
        return sum(self.arena_bytes)


def plan_memory(lifetimes: dict[int, Lifetime], alignment: int, max_binding_bytes: int,
                aliases: dict[int, int] | None = None) -> MemoryPlan:
    """`aliases`: slot -> slot it overwrites in place; the two share one range, which must hold
    for both lifetimes. Raises ValueError for a tensor too large to bind."""
    aliases = aliases or {}

    def root(slot: int) -> int:
        while slot in aliases:
            slot = aliases[slot]
        return slot

    logical = sum(lt.nbytes for lt in lifetimes.values())
    merged = {s: lt for s, lt in lifetimes.items() if s not in aliases}
    for slot, life in lifetimes.items():
        if slot in aliases:
            r = merged[root(slot)]
            merged[root(slot)] = Lifetime(max(r.nbytes, life.nbytes), min(r.first, life.first),
                                          max(r.last, life.last))
    lifetimes = merged
    arenas: list[list[tuple[int, int, Lifetime]]] = []  # per arena: (offset, end, lifetime)
    placement: dict[int, tuple[int, int]] = {}
    order = sorted(lifetimes, key=lambda s: (-lifetimes[s].nbytes, lifetimes[s].first, s))
    for slot in order:
        life = lifetimes[slot]
        if life.nbytes > max_binding_bytes:
            raise ValueError(f"tensor slot {slot} needs {life.nbytes} bytes, more than the "
                             f"device's largest storage-buffer binding ({max_binding_bytes} bytes)")
        size = max(life.nbytes, 4)
        for index, placed in enumerate(arenas + [[]]):
            offset = _lowest_free_offset(placed, life, size, alignment)
            if offset + size <= ARENA_LIMIT or not placed:
                if index == len(arenas):
                    arenas.append(placed)
                placed.append((offset, offset + size, life))
                placement[slot] = (index, offset)
                break
    for slot in aliases:
        placement[slot] = placement[root(slot)]
    arena_bytes = [max(end for _, end, _ in placed) for placed in arenas]
    return MemoryPlan(placement, arena_bytes, logical)


def _lowest_free_offset(placed: list[tuple[int, int, Lifetime]], life: Lifetime, size: int,
                        alignment: int) -> int:
    busy = sorted((start, end) for start, end, other in placed
                  if other.first <= life.last and life.first <= other.last)
    offset = 0
    for start, end in busy:
        if offset + size <= start:
            break
        offset = max(offset, -(-end // alignment) * alignment)
    return offset
