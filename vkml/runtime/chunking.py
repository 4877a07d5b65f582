"""Splitting one step into pieces at level (barrier) boundaries: pure functions, no GPU.

A plan's dispatches are sorted by level and a barrier separates levels, so any cut between two
levels yields pieces that, run in order, do exactly what the whole step does. These functions
choose the cuts: `balanced` for a given number of pieces, `within_budget` for a time budget.
Costs are per level (the sum over its dispatches): measured GPU milliseconds when a profile or
a budget step measured them, else `estimate`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_WORKGROUP = re.compile(r"@workgroup_size\(\s*([^)]*)\)")


def estimate(wgsl: str, groups: Sequence[int]) -> float:
    """A dispatch's relative cost when nothing was measured: threads launched times kernel
    size (the WGSL text length stands for the work per thread: kernels are straight-line code
    with shapes baked in), plus a fixed cost per dispatch."""
    threads = 1
    match = _WORKGROUP.search(wgsl)
    if match:
        for part in match.group(1).split(","):
            part = part.strip()
            if part.isdigit():
                threads *= int(part)
    launched = threads * max(1, groups[0]) * max(1, groups[1]) * max(1, groups[2])
    return launched * len(wgsl) + 1e5


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
