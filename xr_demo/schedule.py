"""Frame scheduling of model work: which pieces of which step go to the queue in which frame.

A `Job` is one vkml session whose steps are submitted piece by piece (`session.step_chunk`) on
the host's queue. Its pieces and their measured GPU costs come from the session:
`chunk_boundaries(...)` gives the pieces as dispatch ranges, `profile().dispatch_ms` the time of
each dispatch, so a piece costs the sum over its range.

Policies (`Policy`):
- `chunks=N` / `budget=b`: the step is cut into N balanced pieces, or into pieces of at most
  b ms, and ONE piece goes per frame (what tools/cotenancy.py measured: smooth frames, but the
  step's latency grows with the number of pieces).
- `slack` (the default): the step is cut into small pieces (a fraction of the frame's slack),
  and every frame takes as many as fit the GPU time left after the render: the slack is the
  frame period minus the measured render time minus a margin. A step that fits the slack runs
  whole in one frame (no added latency); a longer one spreads over as few frames as its cost
  needs.

`Scheduler.fill(slack_ms)` runs after the frame's render has been submitted; it goes through the
jobs in priority order (inference first: it is what the user sees). The decision itself
(`plan_pieces`) is pure, so it is tested without a GPU.

Worker latency is measured from the first piece's submission to the step's completion on
vkml's timeline semaphore, by a waiter thread per step. The start time travels with the
thread's arguments (it is never read back from shared state), and a job never continues a
step it did not start: the race that crashed tools/cotenancy.py's waiter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import vkml


@dataclass(frozen=True)
class Policy:
    kind: str  # "chunks", "budget" or "slack"
    value: float = 0.0  # chunks: N; budget: ms per piece; slack: piece size as a slack fraction

    @classmethod
    def parse(cls, text: str) -> Policy:
        """"slack", "slack:0.25", "chunks:2", "budget:3.5"."""
        kind, _, value = text.partition(":")
        if kind == "slack":
            return cls("slack", float(value) if value else 0.34)
        if kind == "chunks" and value:
            return cls("chunks", int(value))
        if kind == "budget" and value:
            return cls("budget", float(value))
        raise ValueError(f"unknown schedule {text!r}: use slack[:fraction], chunks:N or "
                         "budget:MS")

    @property
    def one_per_frame(self) -> bool:
        return self.kind != "slack"

    def __str__(self) -> str:
        if self.kind == "chunks":
            return f"chunks={int(self.value)}"
        if self.kind == "budget":
            return f"budget={self.value:g}ms"
        return "slack"


def plan_pieces(costs: Sequence[float], slack_ms: float, used_ms: float,
                one_per_frame: bool, frame_has_model_work: bool) -> int:
    """How many of the next pieces (costs in ms, in order) to submit this frame.

    One-per-frame policies take exactly one. The slack policy takes pieces while the frame's
    total stays within `slack_ms` (`used_ms` is what earlier jobs took this frame); a piece
    longer than the whole slack (a level that cannot be cut) goes alone, in a frame with no
    other model work, which is the best that can be done with it."""
    if not costs:
        return 0
    if one_per_frame:
        return 1
    n, total = 0, used_ms
    for c in costs:
        if total + c > slack_ms:
            break
        total += c
        n += 1
    if n == 0 and not frame_has_model_work and costs[0] > slack_ms:
        return 1
    return n


@dataclass
class StepRecord:
    """One completed step: when its first piece went in (frame, time), its latency."""

    first_frame: int
    pieces: int
    frames: int  # frames it spanned
    latency_ms: float


class Job:
    """One session's steps, submitted piece by piece on the host's queue."""

    def __init__(self, name: str, session: vkml.Session, host: Any, policy: Policy,
                 dispatch_ms: Sequence[float], slack_ms: float) -> None:
        self.name, self.session, self.host, self.policy = name, session, host, policy
        self.dispatch_ms = list(dispatch_ms)
        self.set_slack(slack_ms)
        self.records: list[StepRecord] = []
        self._lock = threading.Lock()  # waiter threads append to records
        self._waiters: list[threading.Thread] = []
        self._in_step = False
        self._next = 0
        self._start: tuple[int, float] | None = None
        self._submitted_frames: set[int] = set()
        self._done_value = 0
        self.steps_started = 0

    # ---- pieces --------------------------------------------------------------------------
    def set_slack(self, slack_ms: float) -> None:
        """Choose the pieces (only between steps: a step keeps the cut it started with)."""
        p = self.policy
        if p.kind == "chunks":
            self._chunking: dict[str, float] = {"chunks": int(p.value)}
        elif p.kind == "budget":
            self._chunking = {"budget_ms": float(p.value)}
        else:
            # Quantised so a drifting render time does not record new pieces every frame.
            granule = max(0.05, round(slack_ms * p.value * 4) / 4 or 0.25)
            self._chunking = {"budget_ms": granule}
        bounds = self.session.chunk_boundaries(**self._chunking)
        self.costs = [sum(self.dispatch_ms[a:b]) for a, b in bounds]

    @property
    def step_ms(self) -> float:
        return sum(self.costs)

    @property
    def granule_ms(self) -> float | None:
        return self._chunking.get("budget_ms")

    # ---- state ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A step is in progress: pieces left to submit, or submitted and not finished."""
        return self._in_step or not self.finished

    @property
    def pieces_left(self) -> int:
        return len(self.costs) - self._next if self._in_step else 0

    @property
    def finished(self) -> bool:
        """Everything this job submitted has completed (non-blocking)."""
        if self._in_step:
            return False
        semaphore, _ = self.session.done()
        return self.host.timeline_value(semaphore) >= self._done_value

    def begin(self, frame: int) -> None:
        """Start a step (the caller has set its inputs); its pieces go in by submit()."""
        if self.busy:
            raise RuntimeError(f"job {self.name}: a step is still in progress")
        self._in_step, self._next = True, 0
        self._start = None
        self._submitted_frames = set()
        self.steps_started += 1

    def submit(self, frame: int, count: int) -> float:
        """Submit the next `count` pieces; returns their measured cost in ms."""
        cost = 0.0
        for _ in range(count):
            if not self._in_step:
                break
            if self._start is None:
                self._start = (frame, time.perf_counter())
                left = self.session.step_chunk(**self._chunking)
            else:
                left = self.session.step_chunk()
            cost += self.costs[self._next]
            self._next += 1
            self._submitted_frames.add(frame)
            if left == 0:
                if self._next != len(self.costs):
                    raise RuntimeError(f"job {self.name}: the session cut the step into "
                                       f"{self._next} pieces, not {len(self.costs)}")
                self._end_step()
        return cost

    def _end_step(self) -> None:
        semaphore, value = self.session.done()
        assert self._start is not None
        first_frame, t0 = self._start
        record = StepRecord(first_frame, len(self.costs), len(self._submitted_frames), 0.0)
        self._done_value = value
        self._in_step = False
        thread = threading.Thread(target=self._wait, args=(semaphore, value, t0, record),
                                  name=f"{self.name}-latency", daemon=True)
        self._waiters.append(thread)
        thread.start()

    def _wait(self, semaphore: Any, value: int, t0: float, record: StepRecord) -> None:
        self.host.wait_timeline(semaphore, value)
        record.latency_ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self.records.append(record)

    def finish(self) -> None:
        """Submit what is left of a step in progress and wait for everything."""
        while self._in_step:
            self.submit(-1, 1)
        for thread in self._waiters:
            thread.join()
        self._waiters.clear()
        self.session.wait()

    def latencies(self) -> list[float]:
        with self._lock:
            return [r.latency_ms for r in sorted(self.records, key=lambda r: r.first_frame)]


@dataclass
class FrameUse:
    pieces: int = 0
    cost_ms: float = 0.0
    by_job: dict[str, int] = field(default_factory=dict)
    oversized: bool = False  # a piece longer than the whole slack went (alone) this frame


class Scheduler:
    """Fills each frame's slack with the jobs' pieces, in priority order, in two windows.

    "before" (submitted before the frame's render): the pieces of steps that began in an
    earlier frame. They run right after that frame's last pieces, so a step cut at the frame
    boundary runs contiguously on the GPU, and the render that follows them still ends within
    the frame (the slack is the period minus the render, both windows together).
    "after" (after the render): new steps start here, in what the frame has left.
    One-per-frame policies (chunks=N, budget) use only the "after" window, one piece a frame.
    """

    def __init__(self, jobs: Sequence[Job]) -> None:
        self.jobs = list(jobs)
        self.use = FrameUse()
        # Measured costs are scaled by this before planning: it grows when a frame misses its
        # period and relaxes back towards 1 while frames are on time (the profile's costs were
        # measured alone; under co-tenancy, and on a CPU driver sharing cores with the host,
        # pieces run slower).
        self.scale = 1.0
        self.scale_max = 1.0
        self._previous = FrameUse()

    def new_frame(self) -> FrameUse:
        self._previous = self.use
        self.use = FrameUse()
        return self.use

    def observe(self, frame_ms: float, period_ms: float, margin_ms: float) -> None:
        """Feedback from a finished frame (its time from start to the render's fence, which
        the previous frame's pieces after its render and this frame's before it delay). A
        miss with no piece that was known to be too long for the slack means the prices were
        low: raise them; on-time frames bring them back."""
        if not period_ms:
            return
        if frame_ms > period_ms:
            if not (self.use.oversized or self._previous.oversized):
                self.scale = min(4.0, self.scale * 1.25)
        elif frame_ms < period_ms - 2 * margin_ms:
            self.scale = max(1.0, self.scale * 0.97)
        self.scale_max = max(self.scale_max, self.scale)

    def _eligible(self, job: Job, phase: str) -> bool:
        if not job._in_step:
            return False
        if phase == "before":  # only steps already running, and only the slack policy
            return not job.policy.one_per_frame and job._start is not None
        return True

    def wants(self, phase: str) -> bool:
        return any(self._eligible(j, phase) for j in self.jobs)

    def fill(self, frame: int, slack_ms: float, phase: str = "after") -> FrameUse:
        use = self.use
        for job in self.jobs:
            if not self._eligible(job, phase):
                continue
            if job.policy.one_per_frame and job.name in use.by_job:
                continue
            costs = [c * self.scale for c in job.costs[job._next:]]
            n = plan_pieces(costs, slack_ms, use.cost_ms * self.scale,
                            job.policy.one_per_frame, use.pieces > 0)
            if n == 1 and costs and costs[0] > slack_ms:
                use.oversized = True
            if n:
                use.cost_ms += job.submit(frame, n)
                use.pieces += n
                use.by_job[job.name] = use.by_job.get(job.name, 0) + n
        return use
