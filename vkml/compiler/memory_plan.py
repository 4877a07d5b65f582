"""Memory planning: where each tensor of the plan lives, as (arena, byte offset).

Tensors whose lifetimes do not overlap share memory. A lifetime is an interval of schedule
levels (see schedule.py: dispatches of one level run between the same two barriers), so two tensors
sharing bytes are always separated by a barrier and never race. Tensors live forever when they
are pinned: parameters, optimizer state, constants written once at start-up. Placement is the
greedy-by-size heuristic: biggest tensors first, each at the lowest offset that is free for its
whole lifetime. Ranges are aligned for storage-buffer binding offsets; arenas are capped at
ARENA_LIMIT so no single allocation grows past what drivers hand out reliably.

Each placement looks at the ranges already in use in an arena (vectorized: numpy columns, touching
ranges of one lifetime merged), so planning thousands of tensors takes a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkml.hal import Capabilities

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


def alignment(caps: Capabilities) -> int:
    """The byte alignment of every tensor's place in memory (a storage-buffer binding's)."""
    return max(caps.min_storage_offset_alignment, 16)


def plan_memory(lifetimes: dict[int, Lifetime], alignment: int, max_binding_bytes: int,
                aliases: dict[int, int] | None = None,
                packs: dict[int, tuple[tuple[int, int], ...]] | None = None) -> MemoryPlan:
    """`aliases`: slot -> slot it overwrites in place; the two share one range, which must hold
    for both lifetimes. `packs`: slot -> (slot, byte offset) of the slots laid out inside it
    (its lifetime covers theirs). Raises ValueError for a tensor too large to bind."""
    aliases = aliases or {}
    inside = {s: (pack, offset) for pack, held in (packs or {}).items() for s, offset in held}

    def root(slot: int) -> int:
        while slot in aliases:
            slot = aliases[slot]
        return slot

    logical = sum(lt.nbytes for s, lt in lifetimes.items() if s not in (packs or {}))
    merged = {s: lt for s, lt in lifetimes.items() if s not in aliases and s not in inside}
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
        for index, arena in enumerate(arenas + [_Arena(alignment)]):
            offset = arena.lowest_free_offset(life, size)
            if offset + size <= ARENA_LIMIT or not arena.count:
                if index == len(arenas):
                    arenas.append(arena)
                arena.add(offset, offset + size, life)
                placement[slot] = (index, offset)
                break
    for slot, (pack, offset) in inside.items():
        arena, start = placement[pack]
        placement[slot] = (arena, start + offset)
    for slot in aliases:
        placement[slot] = placement[root(slot)]
    return MemoryPlan(placement, [arena.end for arena in arenas], logical)


class _Arena:
    """The ranges in use in one arena and their lifetimes, as numpy columns sorted by start.

    Only the union of the ranges in use during a lifetime decides a placement (see
    `lowest_free_offset`), so ranges of one lifetime that touch (up to alignment padding, which
    nothing can use) are kept as one: the pinned tensors, a third of a training graph's, become
    a few blocks."""

    def __init__(self, alignment: int) -> None:
        self.alignment = alignment
        self.count = 0
        self.end = 0  # the highest end placed: the arena's size
        # start, end (bytes), first, last (levels) per range; grown by doubling
        self._columns = np.zeros((4, 64), np.int64)

    def _aligned(self, offset: int) -> int:
        return -(-offset // self.alignment) * self.alignment

    def add(self, start: int, end: int, life: Lifetime) -> None:
        self.end = max(self.end, end)
        c, n = self._columns, self.count
        at = int(np.searchsorted(c[0, :n], start))

        def same(i: int) -> bool:
            return bool(c[2, i] == life.first and c[3, i] == life.last)

        if at > 0 and same(at - 1) and self._aligned(int(c[1, at - 1])) == start:
            c[1, at - 1] = end  # extends the range before it
            if at < n and same(at) and self._aligned(end) == c[0, at]:  # and joins the next
                c[1, at - 1] = c[1, at]
                c[:, at:n - 1] = c[:, at + 1:n].copy()
                self.count -= 1
            return
        if at < n and same(at) and self._aligned(end) == c[0, at]:
            c[0, at] = start  # extends the range after it
            return
        if n == c.shape[1]:
            self._columns = c = np.concatenate([c, np.zeros_like(c)], 1)
        c[:, at + 1:n + 1] = c[:, at:n].copy()
        c[:, at] = (start, end, life.first, life.last)
        self.count += 1

    def lowest_free_offset(self, life: Lifetime, size: int) -> int:
        """The lowest offset, 0 or the aligned end of a range in use, where `size` bytes are
        free for the whole of `life`: first fit over the ranges in use during `life`, in order
        of their starts (the offset so far is past every range seen; the first range starting
        at or after its end leaves the gap). A function of those ranges' union."""
        start, end, first, last = self._columns[:, :self.count]
        busy = (first <= life.last) & (life.first <= last)
        starts, ends = start[busy], end[busy]
        if not len(starts):
            return 0
        # the offset before each range: 0, then the aligned end of the furthest range so far
        reach = np.maximum.accumulate(-(-ends // self.alignment) * self.alignment)
        before = np.concatenate(([0], reach))
        fits = np.flatnonzero(before[:-1] + size <= starts)
        return int(before[fits[0]] if len(fits) else before[-1])
