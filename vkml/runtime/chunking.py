"""Splitting one step into pieces, and submitting them one by one.

A plan's dispatches are sorted by level and a barrier separates levels, so any cut between two
levels yields pieces that, run in order, do exactly what the whole step does. The dispatches of
one level are independent of each other, and a dispatch whose kernel's workgroups are
independent (Kernel.cut_axis) can itself run as ranges of its workgroups, each a dispatch with
a base workgroup (a backend with caps.dispatch_base): so a level longer than a time budget is
cut too, and the pieces still compute bit for bit what the whole step does (each workgroup
computes what it would have, from what the levels before it wrote).

The pure functions choose the cuts: `balanced` for a given number of pieces, `within_budget` for
a time budget, `cut_level` for the parts of one long level. Costs are per unit (a level, or a
part of one): measured GPU milliseconds when a profile or a budget step measured them, else
each kernel's own estimate (`Kernel.cost`). `Chunker` records each distinct cut's pieces once
and steps through them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vkml.errors import InputError
from vkml.interrupts import deferred_interrupts
from vkml.runtime.bound import BoundPlan, Part

# A level is cut into parts no shorter than this (measured ms): each part is a dispatch of its
# own with a barrier after its piece, which costs more than it frees below that.
MIN_PART_MS = 0.1

# A cut of a step: its pieces in order, each the dispatches and workgroup ranges it runs.
Cut = tuple[tuple[Part, ...], ...]


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
    """Cut points (unit indices where pieces 2.. start) splitting `costs` (one per unit)
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
    # best[j][i]: the smallest largest-piece cost splitting units [0, i) into j pieces
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
    contiguous pieces). A single unit costing more than the budget becomes a piece of its own."""
    cuts, total = [], 0.0
    for i, c in enumerate(costs):
        c = max(0.0, float(c))
        if i > 0 and total + c > budget:
            cuts.append(i)
            total = 0.0
        total += c
    return cuts


def pieces_of(cuts: Sequence[int], n_units: int) -> list[tuple[int, int]]:
    """[first, end) unit ranges from cut points."""
    bounds = [0, *cuts, n_units]
    return [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def cut_level(costs: Sequence[float], slabs: Sequence[int], parts: int
              ) -> list[list[tuple[int, int, int]]]:
    """One level's dispatches (the cost of each, and its slabs: the workgroups along its cut
    axis, 1 where it cannot be cut) in at most `parts` consecutive parts of about equal cost,
    each a list of (dispatch, first slab, end slab). A dispatch's cost is taken as spread
    evenly over its slabs; one that cannot be cut goes whole to the part where most of it
    falls."""
    n = len(costs)
    clipped = [max(0.0, float(c)) for c in costs]
    total = sum(clipped)
    starts: set[tuple[int, int]] = set()  # (dispatch, slab) where a part begins
    done, j = 0.0, 1
    for i, c in enumerate(clipped):
        while j < parts and total * j / parts < done + c:
            s = round((total * j / parts - done) / c * slabs[i])
            starts.add((i, s) if s < slabs[i] else (i + 1, 0))
            j += 1
        done += c
    result: list[list[tuple[int, int, int]]] = [[]]
    for i in range(n):
        if (i, 0) in starts and result[-1]:
            result.append([])
        first = 0
        for s in sorted(s for d, s in starts if d == i and s > 0):
            result[-1].append((i, first, s))
            result.append([])
            first = s
        result[-1].append((i, first, slabs[i]))
    return result


def joined(parts: Sequence[Part]) -> tuple[Part, ...]:
    """`parts` with consecutive ranges of one dispatch made one: the same work in fewer
    dispatches."""
    out: list[Part] = []
    for p in parts:
        if out and out[-1].dispatch == p.dispatch and out[-1].end == p.start:
            out[-1] = Part(p.dispatch, out[-1].start, p.end)
        else:
            out.append(p)
    return tuple(out)


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
        self._cuts: dict[tuple[str, float, int], Cut] = {}
        self._programs: dict[Cut, list[object]] = {}
        dispatches = bound.plan.dispatches
        params = set(bound.plan.params.values())
        self._param_writer = [bool(d.writes & params) for d in dispatches]
        self._level_ranges = level_ranges([d.level for d in dispatches])
        # Per dispatch: its workgroups along its kernel's cut axis (1 without one), and
        # whether it may be cut there.
        self._extent = [d.kernel.groups[axis] if axis is not None else 1
                        for d in dispatches for axis in [d.kernel.cut_axis]]
        base = bound.device.caps.dispatch_base
        self._cuttable = [base and d.kernel.cut_axis is not None for d in dispatches]
        # Per cut: which pieces write parameters, and (per measurement) their costs; a
        # render loop starts a step every frame, so nothing is recomputed per step.
        self._writes_of: dict[Cut, list[bool]] = {}
        self._costs_of: dict[tuple[Cut, int], list[float]] = {}
        self._pieces: list[object] | None = None  # the chunked step in progress
        self._writes: list[bool] = []  # per piece of it: it writes parameters
        self._total_writes = 0
        self._costs: list[float] | None = None  # per piece of it: measured ms
        self._current: Cut = ()  # its cut
        self._next = 0

    # ---- costs --------------------------------------------------------------------------------
    def set_measured(self, dispatch_ms: Sequence[float], note: str) -> None:
        self.dispatch_ms = list(dispatch_ms)
        self.note = note
        self._version += 1

    def _dispatch_costs(self) -> list[float]:
        return (self.dispatch_ms if self.dispatch_ms is not None
                else [d.kernel.cost for d in self.bound.plan.dispatches])

    def _cost(self, parts: Sequence[Part], costs: Sequence[float]) -> float:
        return sum(costs[p.dispatch] * (p.end - p.start) / self._extent[p.dispatch]
                   for p in parts)

    def level_costs(self) -> list[float]:
        costs = self._dispatch_costs()
        return [sum(costs[a:b]) for a, b in self._level_ranges]

    @property
    def levels(self) -> int:
        return len(self._level_ranges)

    def units(self, budget: float | None) -> list[tuple[Part, ...]]:
        """The step's levels in order, each whole, or with a `budget` cut into as many parts
        as its cost needs to fit it (as far as its dispatches can be cut, and no part shorter
        than MIN_PART_MS)."""
        costs = self._dispatch_costs()
        units = []
        for a, b in self._level_ranges:
            cost = sum(costs[a:b])
            parts = (1 if budget is None or cost <= budget else
                     min(math.ceil(cost / budget), max(1, int(cost / MIN_PART_MS))))
            slabs = [e if c else 1 for e, c in zip(self._extent[a:b], self._cuttable[a:b])]
            for part in cut_level(costs[a:b], slabs, parts):
                units.append(tuple(Part(a + i, first, end) if self._cuttable[a + i]
                                   else Part(a + i, 0, self._extent[a + i])
                                   for i, first, end in part))
        return units

    def piece_costs(self, cut: Cut) -> list[float] | None:
        """Measured ms per piece of `cut` (None before anything was measured)."""
        if self.dispatch_ms is None:
            return None
        key = (cut, self._version)
        costs = self._costs_of.get(key)
        if costs is None:
            costs = [self._cost(piece, self.dispatch_ms) for piece in cut] if cut else [0.0]
            self._costs_of[key] = costs
        return costs

    # ---- cuts ---------------------------------------------------------------------------------
    def cuts(self, chunks: int | None, budget_ms: float | None) -> Cut | None:
        """The pieces of a step cut into `chunks` (at level boundaries) or to fit `budget_ms`
        (levels longer than it cut into workgroup ranges where their kernels allow); None when
        budget_ms needs a measurement."""
        if chunks is not None and budget_ms is not None:
            raise InputError("give chunks or budget_ms, not both")
        count, budget = 0, None
        if chunks is not None:
            if int(chunks) != chunks or chunks < 1:
                raise InputError(f"chunks must be a positive integer, got {chunks!r}")
            count = int(chunks)
            key: tuple[str, float, int] = ("chunks", count, self._version)
        else:
            if budget_ms is None or not budget_ms > 0:
                raise InputError(f"budget_ms must be a positive number, got {budget_ms!r}")
            if self.dispatch_ms is None:
                return None
            budget = float(budget_ms)
            key = ("budget", budget, self._version)
        cut = self._cuts.get(key)
        if cut is None:
            units = self.units(budget)
            costs = self._dispatch_costs()
            unit_costs = [self._cost(u, costs) for u in units]
            points = (balanced(unit_costs, count) if budget is None
                      else within_budget(unit_costs, budget))
            cut = tuple(joined([p for u in units[a:b] for p in u])
                        for a, b in pieces_of(points, len(units))) if units else ()
            self._cuts[key] = cut
        return cut

    def default_cuts(self, finest: bool) -> Cut | None:
        """The cut of the chunking last given, else one piece, or with `finest` one piece
        per level (what step_chunk(max_ms=...) packs)."""
        if self.chunking is None:
            return self.cuts(max(1, self.levels) if finest else 1, None)
        kind, value = self.chunking
        return self.cuts(int(value) if kind == "chunks" else None,
                         value if kind == "budget" else None)

    def boundaries(self, chunks: int | None, budget_ms: float | None) -> list[tuple[int, int]]:
        """The pieces as [first, end) ranges of dispatch indices (records nothing); the pieces
        of a level cut into workgroup ranges share its dispatches."""
        if chunks is None and (budget_ms is None or self.dispatch_ms is None):
            raise InputError("give chunks, or budget_ms once times were measured (profile())")
        cut = self.cuts(chunks, budget_ms)
        assert cut is not None
        return [(piece[0].dispatch, piece[-1].dispatch + 1) for piece in cut]

    def programs(self, cut: Cut) -> list[object]:
        programs = self._programs.get(cut)
        if programs is None:
            programs = ([self.bound.record(piece, f"step piece {k + 1}/{len(cut)}")
                         for k, piece in enumerate(cut)] if cut else [self.bound.step_program])
            self._programs[cut] = programs
        return programs

    def _piece_writes(self, cut: Cut) -> list[bool]:
        writes = self._writes_of.get(cut)
        if writes is None:
            writes = ([any(self._param_writer[p.dispatch] for p in piece) for piece in cut]
                      if cut else [False])
            self._writes_of[cut] = writes
        return writes

    @property
    def recorded_cuts(self) -> int:
        """How many distinct cuts have pieces recorded."""
        return len(self._programs)

    # ---- stepping -----------------------------------------------------------------------------
    def start(self, cut: Cut) -> None:
        """Begin a chunked step (nothing is submitted yet: its inputs are those set when its
        first piece goes)."""
        self.bound.require_inputs()
        self._pieces, self._next = self.programs(cut), 0
        self._current = cut
        self._writes = self._piece_writes(cut)
        self._total_writes = sum(self._writes)
        self._costs = self.piece_costs(cut)

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

    def current_cuts(self) -> Cut:
        """The cut of the chunked step in progress."""
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
