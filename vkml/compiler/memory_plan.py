"""Memory planning: where each tensor of the plan lives, as (arena, byte offset).

Tensors whose lifetimes do not overlap share memory. A lifetime is an interval of schedule
levels (see schedule.py: dispatches of one level run between the same two barriers), so two tensors
sharing bytes are always separated by a barrier and never race. Tensors live forever when they
are pinned: parameters, optimizer state, constants written once at start-up. Placement is the
greedy-by-size heuristic: biggest tensors first, each at the lowest offset that is free for its
whole lifetime. Ranges are aligned for storage-buffer binding offsets; arenas are capped at
ARENA_LIMIT so no single allocation grows past what drivers hand out reliably.

Each placement looks at every tensor already placed in an arena (vectorized: an arena's tensors
are numpy columns), so planning a graph of thousands of tensors takes milliseconds, not seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
    arenas: list[_Arena] = []
    placement: dict[int, tuple[int, int]] = {}
    order = sorted(lifetimes, key=lambda s: (-lifetimes[s].nbytes, lifetimes[s].first, s))
    for slot in order:
        life = lifetimes[slot]
        if life.nbytes > max_binding_bytes:
            raise ValueError(f"tensor slot {slot} needs {life.nbytes} bytes, more than the "
                             f"device's largest storage-buffer binding ({max_binding_bytes} bytes)")
        size = max(life.nbytes, 4)
        for index, arena in enumerate(arenas + [_Arena()]):
            offset = arena.lowest_free_offset(life, size, alignment)
            if offset + size <= ARENA_LIMIT or not arena.count:
                if index == len(arenas):
                    arenas.append(arena)
                arena.add(offset, offset + size, life)
                placement[slot] = (index, offset)
                break
    for slot in aliases:
        placement[slot] = placement[root(slot)]
    return MemoryPlan(placement, [arena.end() for arena in arenas], logical)


class _Arena:
    """The byte ranges and lifetimes of the tensors placed in one arena, as numpy columns."""

    def __init__(self) -> None:
        self.count = 0
        # start, end (bytes), first, last (levels) of each placed tensor; grown by doubling
        self._columns = np.zeros((4, 64), np.int64)

    def add(self, start: int, end: int, life: Lifetime) -> None:
        if self.count == self._columns.shape[1]:
            self._columns = np.concatenate([self._columns, np.zeros_like(self._columns)], 1)
        self._columns[:, self.count] = (start, end, life.first, life.last)
        self.count += 1

    def end(self) -> int:
        return int(self._columns[1, :self.count].max())

    def lowest_free_offset(self, life: Lifetime, size: int, alignment: int) -> int:
        """The lowest offset, 0 or the aligned end of a range in use, where `size` bytes are
        free for the whole of `life`: first fit over the ranges of the tensors whose lifetimes
        overlap it, taken in order of their starts (the offset so far is past every range seen;
        the first range starting at or after its end leaves the gap)."""
        start, end, first, last = self._columns[:, :self.count]
        busy = (first <= life.last) & (life.first <= last)
        starts, ends = start[busy], end[busy]
        if not len(starts):
            return 0
        order = np.argsort(starts, kind="stable")
        starts = starts[order]
        # the offset before each range: 0, then the aligned end of the furthest range so far
        reach = np.maximum.accumulate(-(-ends[order] // alignment) * alignment)
        before = np.concatenate(([0], reach))
        fits = np.flatnonzero(before[:-1] + size <= starts)
        return int(before[fits[0]] if len(fits) else before[-1])
