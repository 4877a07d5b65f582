"""What session.profile() returns: a per-kernel table and a GPU timeline (Chrome/Perfetto trace).

Pure data and formatting; the session does the measuring.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field


def timestamps_plausible(dispatch_ms: Sequence[float], host_ms: float) -> tuple[bool, str]:
    """Whether device timestamps of one submission can be believed, given the host's wall time
    from submit to completion of the same submission.

    GPU time cannot exceed the wall time around it; and a sum below 1% of a wall time over 1 ms
    is what Mesa 22.3's lavapipe reports once graphics work has run on the device (about
    0.01 ms for a 95 ms job). Returns (ok, the reason when not)."""
    values = list(dispatch_ms)
    if any(not math.isfinite(v) or v < 0 for v in values):
        return False, "a timestamp difference is negative or not finite"
    total = sum(values)
    if total > 1.1 * host_ms + 0.5:
        return False, (f"the timestamps add up to {total:.3f} ms, more than the {host_ms:.3f} ms "
                       "the host waited")
    if host_ms > 1.0 and total < 0.01 * host_ms:
        return False, (f"the timestamps add up to {total:.4f} ms in a submission the host "
                       f"waited {host_ms:.3f} ms for")
    return True, ""


@dataclass(frozen=True)
class KernelRow:
    name: str
    calls: int
    total_ms: float

    @property
    def mean_ms(self) -> float:
        return self.total_ms / self.calls if self.calls else 0.0


@dataclass
class Profile:
    """Per-kernel times over `steps` steps. `source` is "gpu timestamps" or "host timing";
    `note` says why host timing was used, when it was."""

    rows: list[KernelRow]
    steps: int
    source: str
    note: str = ""
    step_ms: list[float] = field(default_factory=list)  # per step: sum over its dispatches
    host_step_ms: list[float] = field(default_factory=list)  # per step: wall clock, host
    # (name, label, step, start_ms, duration_ms) per dispatch, on one timeline
    events: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    dispatch_ms: list[float] = field(default_factory=list)  # mean per dispatch index

    @property
    def total_ms(self) -> float:
        return sum(r.total_ms for r in self.rows)

    def table(self) -> str:
        lines = [f"profile: {self.steps} step(s), timed by {self.source}"
                 + (f" ({self.note})" if self.note else "")]
        width = max([len(r.name) for r in self.rows] + [6])
        lines.append(f"{'kernel':<{width}}  {'calls':>6}  {'total ms':>10}  {'mean ms':>9}  "
                     f"{'share':>6}")
        total = self.total_ms or 1.0
        for r in sorted(self.rows, key=lambda r: -r.total_ms):
            lines.append(f"{r.name:<{width}}  {r.calls:>6}  {r.total_ms:>10.3f}  "
                         f"{r.mean_ms:>9.4f}  {100 * r.total_ms / total:>5.1f}%")
        lines.append(f"{'all':<{width}}  {sum(r.calls for r in self.rows):>6}  "
                     f"{self.total_ms:>10.3f}")
        return "\n".join(lines)

    __str__ = table

    def trace(self) -> dict:
        """The timeline as a Chrome trace-event document (chrome://tracing, ui.perfetto.dev)."""
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "vkml"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1,
             "args": {"name": f"queue ({self.source})"}},
        ]
        step_start: dict[int, float] = {}
        step_end: dict[int, float] = {}
        for name, label, step, start, duration in self.events:
            events.append({"name": name, "cat": "dispatch", "ph": "X", "pid": 1, "tid": 1,
                           "ts": round(start * 1000, 3), "dur": round(duration * 1000, 3),
                           "args": {"node": label, "step": step}})
            step_start[step] = min(step_start.get(step, start), start)
            step_end[step] = max(step_end.get(step, 0.0), start + duration)
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": 0,
                       "args": {"name": "steps"}})
        for step, start in step_start.items():
            events.append({"name": f"step {step}", "cat": "step", "ph": "X", "pid": 1, "tid": 0,
                           "ts": round(start * 1000, 3),
                           "dur": round((step_end[step] - start) * 1000, 3)})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source, "note": self.note, "steps": self.steps}}

    def to_trace(self, path: str | os.PathLike) -> None:
        """Write the trace JSON (open it in ui.perfetto.dev or chrome://tracing)."""
        with open(os.fspath(path), "w") as f:
            json.dump(self.trace(), f)
