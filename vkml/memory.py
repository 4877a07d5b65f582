"""Memory planning: where each tensor of the plan lives, as (arena, byte offset).

This first planner gives every tensor its own range (no reuse): correct for any schedule, and
the place where liveness-based packing will go. Ranges are aligned for storage-buffer binding
offsets; arenas are capped so no single allocation grows past what drivers hand out reliably.
"""

from __future__ import annotations

from dataclasses import dataclass

ARENA_LIMIT = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    placement: dict[int, tuple[int, int]]  # slot id -> (arena index, byte offset)
    arena_bytes: list[int]
    logical_bytes: int  # sum of all tensors

    @property
    def physical_bytes(self) -> int:
        return sum(self.arena_bytes)


def plan_memory(sizes: dict[int, int], alignment: int, max_binding_bytes: int) -> MemoryPlan:
    """`sizes`: slot id -> bytes. Raises ValueError for a tensor too large to bind."""
    placement: dict[int, tuple[int, int]] = {}
    arenas = [0]
    for slot, nbytes in sizes.items():
        if nbytes > max_binding_bytes:
            raise ValueError(f"tensor slot {slot} needs {nbytes} bytes, more than the device's "
                             f"largest storage-buffer binding ({max_binding_bytes} bytes)")
        start = -(-arenas[-1] // alignment) * alignment
        if start + nbytes > ARENA_LIMIT and arenas[-1] > 0:
            arenas.append(0)
            start = 0
        placement[slot] = (len(arenas) - 1, start)
        arenas[-1] = start + max(nbytes, 4)
    return MemoryPlan(placement, arenas, sum(sizes.values()))
