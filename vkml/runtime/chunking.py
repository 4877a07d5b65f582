"""Splitting one step into pieces at level (barrier) boundaries, and submitting them one by one.

A plan's dispatches are sorted by level and a barrier separates levels, so any cut between two
levels yields pieces that, run in order, do exactly what the whole step does. The pure functions
choose the cuts: `balanced` for a given number of pieces, `within_budget` for a time budget.
Costs are per level (the sum over its dispatches): measured GPU milliseconds when a profile or
a budget step measured them, else each kernel's own estimate (`Kernel.cost`). `Chunker` records
each distinct cut's pieces once and steps through them.
"""

from __future__ import annotations

from collections.abc import Sequence

from vkml.errors import InputError
from vkml.interrupts import deferred_interrupts
from vkml.runtime.bound import BoundPlan


def level_ranges(levels: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) dispatch index ranges of each level, for dispatches sorted by level."""
    ranges: list[tuple[int, int]] = []
    for i, level in enumerate(levels):
        if i == 0 or level != levels[i - 1]:
            ranges.append((i, i + 1))
        else:
            ranges[-1] = (ranges[-1][0], i + 1)
    return ranges


def balanced(costs: Sequence[float], pieces: int) -> list[int]:
    """Cut points (level indices where pieces 2.. start) splitting `costs` (one per level)
    into min(pieces, len(costs)) contiguous pieces whose largest total is as small as
    possible. Deterministic: among equal optima the earliest cuts win."""
    n = len(costs)
    k = max(1, min(int(pieces), n))
    if n == 0 or k == 1:
        return []
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(0.0, float(c)))
    inf = float("inf")
    # best[j][i]: the smallest largest-piece cost splitting levels [0, i) into j pieces
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for m in range(j - 1, i):
                value = max(best[j - 1][m], prefix[i] - prefix[m])
                if value < best[j][i] - 1e-12 * max(1.0, value):
                    best[j][i], cut[j][i] = value, m
    cuts, i = [], n
    for j in range(k, 1, -1):
        i = cut[j][i]
        cuts.append(i)
    return sorted(cuts)


def within_budget(costs: Sequence[float], budget: float) -> list[int]:
    """Cut points giving the fewest pieces each within `budget` (greedy, which is optimal for
    contiguous pieces). A single level costing more than the budget becomes a piece of its own:
    a level is never split."""
    cuts, total = [], 0.0
    for i, c in enumerate(costs):
        c = max(0.0, float(c))
        if i > 0 and total + c > budget:
            cuts.append(i)
            total = 0.0
        total += c
    return cuts


def pieces_of(cuts: Sequence[int], n_levels: int) -> list[tuple[int, int]]:
    """[first, end) level ranges from cut points."""
    bounds = [0, *cuts, n_levels]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


class Chunker:
    """The pieces of a bound plan's step, recorded once per distinct cut, and the chunked step
    in progress."""

    def __init__(self, bound: BoundPlan) -> None:
        self.bound = bound
        self.dispatch_ms: list[float] | None = None  # measured per dispatch
        self.note = ""  # how the costs were measured
        # What step_chunk() uses (None: never set; one piece, or one per level with max_ms).
        self.chunking: tuple[str, float] | None = None
        self._version = 0  # bumped when measured costs change, so cuts are recomputed
        self._cuts: dict[tuple[str, float, int], tuple[int, ...]] = {}
        self._programs: dict[tuple[int, ...], list[object]] = {}
        params = set(bound.plan.params.values())
        self._param_writer = [bool(d.writes & params) for d in bound.plan.dispatches]
        self._level_ranges = level_ranges([d.level for d in bound.plan.dispatches])
        # Per cut: which pieces write parameters, and (per measurement) their costs; a
        # render loop starts a step every frame, so nothing is recomputed per step.
        self._writes_of: dict[tuple[int, ...], list[bool]] = {}
        self._costs_of: dict[tuple[tuple[int, ...], int], list[float]] = {}
        self._pieces: list[object] | None = None  # the chunked step in progress
        self._writes: list[bool] = []  # per piece of it: it writes parameters
        self._total_writes = 0
        self._costs: list[float] | None = None  # per piece of it: measured ms
        self._current: tuple[int, ...] = ()  # its cuts
        self._next = 0

    # ---- costs --------------------------------------------------------------------------------
    def set_measured(self, dispatch_ms: Sequence[float], note: str) -> None:
        self.dispatch_ms = list(dispatch_ms)
        self.note = note
        self._version += 1

    def level_costs(self) -> list[float]:
        dispatches = self.bound.plan.dispatches
        costs = (self.dispatch_ms if self.dispatch_ms is not None
                 else [d.kernel.cost for d in dispatches])
        return [sum(costs[a:b]) for a, b in self._ranges()]

    def _ranges(self) -> list[tuple[int, int]]:
        return self._level_ranges

    @property
    def levels(self) -> int:
        return len(self._ranges())

    def piece_costs(self, cuts: tuple[int, ...]) -> list[float] | None:
        """Measured ms per piece of `cuts` (None before anything was measured)."""
        if self.dispatch_ms is None:
            return None
        key = (cuts, self._version)
        costs = self._costs_of.get(key)
        if costs is None:
            ranges = self._ranges()
            costs = [sum(self.dispatch_ms[ranges[a][0]:ranges[b - 1][1]])
                     for a, b in pieces_of(list(cuts), len(ranges))] if ranges else [0.0]
            self._costs_of[key] = costs
        return costs

    # ---- cuts ---------------------------------------------------------------------------------
    def cuts(self, chunks: int | None, budget_ms: float | None) -> tuple[int, ...] | None:
        """Where the pieces start (level indices); None when budget_ms needs a measurement."""
        if chunks is not None and budget_ms is not None:
            raise InputError("give chunks or budget_ms, not both")
        if chunks is not None:
            if int(chunks) != chunks or chunks < 1:
                raise InputError(f"chunks must be a positive integer, got {chunks!r}")
            key: tuple[str, float, int] = ("chunks", int(chunks), self._version)
        else:
            if budget_ms is None or not budget_ms > 0:
                raise InputError(f"budget_ms must be a positive number, got {budget_ms!r}")
            if self.dispatch_ms is None:
                return None
            key = ("budget", float(budget_ms), self._version)
        cuts = self._cuts.get(key)
        if cuts is None:
            costs = self.level_costs()
            cuts = tuple(balanced(costs, int(chunks)) if chunks is not None
                         else within_budget(costs, float(budget_ms)))
            self._cuts[key] = cuts
        return cuts

    def default_cuts(self, finest: bool) -> tuple[int, ...] | None:
        """The cuts of the chunking last given, else one piece, or with `finest` one piece
        per level (what step_chunk(max_ms=...) packs)."""
        if self.chunking is None:
            return self.cuts(max(1, self.levels) if finest else 1, None)
        kind, value = self.chunking
        return self.cuts(int(value) if kind == "chunks" else None,
                         value if kind == "budget" else None)

    def boundaries(self, chunks: int | None, budget_ms: float | None) -> list[tuple[int, int]]:
        """The pieces as [first, end) ranges of dispatch indices (records nothing)."""
        if chunks is None and (budget_ms is None or self.dispatch_ms is None):
            raise InputError("give chunks, or budget_ms once times were measured (profile())")
        cuts = self.cuts(chunks, budget_ms)
        assert cuts is not None
        ranges = self._ranges()
        return [(ranges[a][0], ranges[b - 1][1]) for a, b in pieces_of(cuts, len(ranges))]

    def programs(self, cuts: tuple[int, ...]) -> list[object]:
        programs = self._programs.get(cuts)
        if programs is None:
            ranges = self._ranges()
            if not ranges:
                programs = [self.bound.step_program]
            else:
                pieces = pieces_of(list(cuts), len(ranges))
                programs = [self.bound.record(range(ranges[a][0], ranges[b - 1][1]),
                                              f"step piece {k + 1}/{len(pieces)}")
                            for k, (a, b) in enumerate(pieces)]
            self._programs[cuts] = programs
        return programs

    def _piece_writes(self, cuts: tuple[int, ...]) -> list[bool]:
        writes = self._writes_of.get(cuts)
        if writes is None:
            ranges = self._ranges()
            writes = [any(self._param_writer[ranges[a][0]:ranges[b - 1][1]])
                      for a, b in pieces_of(list(cuts), len(ranges))] if ranges else [False]
            self._writes_of[cuts] = writes
        return writes

    @property
    def recorded_cuts(self) -> int:
        """How many distinct cuts have pieces recorded."""
        return len(self._programs)

    # ---- stepping -----------------------------------------------------------------------------
    def start(self, cuts: tuple[int, ...]) -> None:
        """Begin a chunked step (nothing is submitted yet: its inputs are those set when its
        first piece goes)."""
        self.bound.require_inputs()
        self._pieces, self._next = self.programs(cuts), 0
        self._current = cuts
        self._writes = self._piece_writes(cuts)
        self._total_writes = sum(self._writes)
        self._costs = self.piece_costs(cuts)

    def submit(self, count: int) -> float:
        """Submit the next `count` pieces in one queue submission; returns their measured cost
        in ms (0.0 before anything was measured)."""
        assert self._pieces is not None
        first, end = self._next, min(self._next + count, len(self._pieces))
        if end <= first:
            return 0.0
        with deferred_interrupts():  # submitted is counted as submitted
            self.bound.submit(self._pieces[first:end], begins=first == 0,
                              ends=end == len(self._pieces),
                              updates=sum(self._writes[first:end]),
                              total_updates=self._total_writes)
            self._next = end
            cost = sum(self._costs[first:end]) if self._costs is not None else 0.0
            if self._next == len(self._pieces):
                self._pieces = None
        return cost

    def submit_next(self) -> None:
        self.submit(1)

    def fitting(self, max_ms: float) -> int:
        """How many of the next pieces add up to at most `max_ms` of measured time."""
        assert self._pieces is not None and self._costs is not None
        n, total = 0, 0.0
        for cost in self._costs[self._next:]:
            if total + cost > max_ms:
                break
            total += cost
            n += 1
        return n

    def allowed(self) -> int:
        """How many of the next pieces may go now without a step of a session sharing these
        parameters seeing half an update (see runtime/sharing.py): none while the owner is
        part-way through its updates, if this step has not begun; only those before the next
        piece that writes parameters while a sharing session's step is part-way."""
        assert self._pieces is not None
        bound, left = self.bound, len(self._pieces) - self._next
        if self._next == 0 and bound.owner is not None and bound.owner.updating:
            return 0
        if any(s.mid_step for s in bound.sharers):
            writes = self._writes[self._next:]
            return writes.index(True) if True in writes else left
        return left

    def finish(self) -> None:
        """Submit what is left of a chunked step in progress, a submission per piece (as
        step(chunks=N) promises: the host's submits may come between them)."""
        while self._pieces is not None:
            self.submit(1)

    def current_cuts(self) -> tuple[int, ...]:
        """The cuts of the chunked step in progress."""
        return self._current

    @property
    def in_progress(self) -> bool:
        return self._pieces is not None

    @property
    def submitted(self) -> int:
        """Pieces of the step in progress already submitted."""
        return self._next if self._pieces is not None else 0

    @property
    def pieces_left(self) -> int:
        return len(self._pieces) - self._next if self._pieces is not None else 0
