"""Frame scheduling of model work: which pieces of which step go to the queue in which frame.

A `Job` is one vkml session whose steps are submitted piece by piece on the host's queue. The
session cuts and prices the pieces itself: `piece_costs(...)` gives each piece's measured GPU
time (from `profile(update=False)`), and `step_chunk(max_ms=X)` submits as many of the next
pieces as fit X ms, in one vkQueueSubmit.

Policies (`Policy`):
- `chunks=N` / `budget=b`: the step is cut into N balanced pieces, or into pieces of at most
  b ms, and ONE piece goes per frame (what tools/cotenancy.py measured: smooth frames, but the
  step's latency grows with the number of pieces).
- `slack` (the default): the step is cut into pieces of at most a quarter of the slack
  (`Policy.within`: levels packed together, and a longer level cut into ranges of its
  dispatches' workgroups, as Session.step's budget_ms cuts; unpaced, one piece per level), and
  every frame submits as many pieces as fit the GPU time left after the render, in one
  submission: the slack is the frame period minus the measured render time minus a margin. A
  step that fits the slack runs whole in one frame (no added latency); a longer one spreads
  over as few frames as its cost needs, and no level is too long for a frame where its
  kernels can be cut.

`Scheduler.fill(slack_ms)` runs after the frame's render has been submitted; it goes through the
jobs in priority order (inference first: it is what the user sees). The decision itself
(`plan_pieces`) is pure, so it is tested without a GPU.

Worker latency is measured from the first piece's submission to the step's completion on
vkml's timeline semaphore (the value `session.done()` gives for that session alone), by one
waiter thread per job that takes the steps from a deque: the frame loop never starts a thread,
wakes one, or blocks for it. The start time travels with the queued item (it is never read back
from shared state), and a job never continues a step it did not start: the race that crashed
tools/cotenancy.py's waiter.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import vkml

# The slack policy's pieces are at most this fraction of the slack: a frame's slack fills to
# at least the rest of it, and no piece outgrows the slack even at the Scheduler's largest
# cost scale (4).
SLACK_PIECE = 0.25


@dataclass(frozen=True)
class Policy:
    kind: str  # "chunks", "budget" or "slack"
    value: float = 0.0  # chunks: N; budget: ms per piece; slack: ms per piece (0: a level)

    @classmethod
    def parse(cls, text: str) -> Policy:
        """"slack", "chunks:2", "budget:3.5"."""
        kind, _, value = text.partition(":")
        if kind == "slack" and not value:
            return cls("slack")
        if kind == "chunks" and value:
            return cls("chunks", int(value))
        if kind == "budget" and value:
            return cls("budget", float(value))
        raise ValueError(f"unknown schedule {text!r}: use slack, chunks:N or "
                         "budget:MS")

    def within(self, slack_ms: float) -> Policy:
        """This policy for frames with `slack_ms` of room: the slack policy's pieces sized to
        it (with no slack to size them by, unpaced or none left, one piece per level)."""
        if self.kind != "slack" or not 0 < slack_ms < math.inf:
            return self
        return Policy("slack", slack_ms * SLACK_PIECE)

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

    def __init__(self, name: str, session: vkml.Session, host: Any, policy: Policy) -> None:
        self.name, self.session, self.host, self.policy = name, session, host, policy
        p = policy
        if p.kind == "chunks":
            self._chunking: dict[str, float] = {"chunks": int(p.value)}
        elif p.kind == "budget":
            self._chunking = {"budget_ms": float(p.value)}
        elif p.value:  # pieces of at most p.value ms: step_chunk(max_ms=...) packs them
            self._chunking = {"budget_ms": float(p.value)}
        else:  # one piece per level, packed the same way
            self._chunking = {"chunks": len({d.level for d in session.plan.dispatches})}
        self.costs = session.piece_costs(**self._chunking)  # measured by profile()
        session.record_pieces(**self._chunking)  # now, not in the first frames
        self.records: list[StepRecord] = []
        self._lock = threading.Lock()  # the waiter thread appends to records
        # Steps for the waiter thread: appended by the frame loop (a deque append signals
        # nothing, so the frame loop never hands the GIL over: a queue's put cost 1.4 ms a
        # step on this 2-core machine, a thread start per step 2.7 ms).
        self._steps: deque[Any] = deque()
        self._stop = False
        self._waiter: threading.Thread | None = None
        self._in_step = False
        self._next = 0
        self._start: tuple[int, float] | None = None
        self._submitted_frames: set[int] = set()
        self._done_value = 0
        self.steps_started = 0
        self.steps_submitted = 0  # steps whose last piece has gone to the queue

    # ---- pieces --------------------------------------------------------------------------
    @property
    def step_ms(self) -> float:
        return sum(self.costs)

    @property
    def level_ms_max(self) -> float:
        """The measured cost of the step's longest level."""
        levels = len({d.level for d in self.session.plan.dispatches})
        return max(self.session.piece_costs(chunks=levels))

    @property
    def levels_cut(self) -> int:
        """Levels of the step that run as more than one piece (cut into workgroup ranges)."""
        level = [d.level for d in self.session.plan.dispatches]
        pieces = Counter(lv for a, b in self.session.chunk_boundaries(**self._chunking)
                         for lv in {level[a], level[b - 1]})
        return sum(n > 1 for n in pieces.values())

    # ---- state ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A step is in progress: pieces left to submit, or submitted and not finished."""
        return self._in_step or not self.finished

    @property
    def pieces_left(self) -> int:
        return len(self.costs) - self._next if self._in_step else 0

    @property
    def started(self) -> bool:
        """The step in progress has submitted a piece."""
        return self._in_step and self._start is not None

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

    def submit(self, frame: int, max_ms: float | None = None, at_least_one: bool = False
               ) -> tuple[int, float]:
        """Submit pieces of the step in progress: one (one-per-frame policies), or as many as
        fit `max_ms` of measured cost in one submission. Returns (pieces, their cost ms)."""
        if not self._in_step:
            return 0, 0.0
        first = self._start is None
        chunking = self._chunking if first else {}
        if self.policy.one_per_frame or max_ms is None:
            left = self.session.step_chunk(**chunking)
            cost = self.costs[self._next]
        else:
            left, cost = self.session.step_chunk(**chunking, max_ms=max_ms,
                                                 at_least_one=at_least_one)
        count = len(self.costs) - left - self._next
        if count == 0:
            return 0, 0.0
        if first:
            self._start = (frame, time.perf_counter())
        self._next += count
        self._submitted_frames.add(frame)
        if left == 0:
            if self._next != len(self.costs):
                raise RuntimeError(f"job {self.name}: the session cut the step into "
                                   f"{self._next} pieces, not {len(self.costs)}")
            self._end_step()
        return count, cost

    def _end_step(self) -> None:
        semaphore, value = self.session.done()
        assert self._start is not None
        first_frame, t0 = self._start
        record = StepRecord(first_frame, len(self.costs), len(self._submitted_frames), 0.0)
        self._done_value = value
        self._in_step = False
        self.steps_submitted += 1
        if self._waiter is None:
            self._stop = False
            self._waiter = threading.Thread(target=self._wait_loop, name=f"{self.name}-latency",
                                            daemon=True)
            self._waiter.start()
        self._steps.append((semaphore, value, t0, record))

    IDLE_S = 0.0005  # how often an idle waiter looks for a new step

    def _wait_loop(self) -> None:
        """The waiter thread: blocks on each step's timeline value in turn (vkWaitSemaphores
        releases the GIL), and looks for the next one every IDLE_S when there is none. A step
        that finished while it looked elsewhere is timed up to IDLE_S late."""
        while True:
            try:
                semaphore, value, t0, record = self._steps[0]
            except IndexError:
                if self._stop:
                    return
                time.sleep(self.IDLE_S)
                continue
            self.host.wait_timeline(semaphore, value)
            record.latency_ms = (time.perf_counter() - t0) * 1e3
            with self._lock:
                self.records.append(record)
            self._steps.popleft()

    def finish(self) -> None:
        """Submit what is left of a step in progress and wait for everything (the latency of
        every step submitted so far recorded)."""
        while self._in_step:
            self.submit(-1, at_least_one=True)
        while self._steps and self._waiter is not None:
            time.sleep(self.IDLE_S)
        self.session.wait()

    def close(self) -> None:
        """Finish, then stop the waiter thread."""
        self.finish()
        if self._waiter is not None:
            self._stop = True
            self._waiter.join()
            self._waiter = None

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

    A piece longer than the slack goes only alone, after the render. So that another job's
    small pieces, every frame, cannot keep it waiting for ever, a job left waiting with one
    gets the next frame to itself (unless it could not submit in that frame either: a session
    sharing its parameters held it back, and the others must run to release it).
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
        self._reserved: Job | None = None  # the job this frame belongs to
        self._refused: Job | None = None  # reserved last frame and could not submit

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
            return not job.policy.one_per_frame and job.started
        return True

    def wants(self, phase: str) -> bool:
        return any(self._eligible(j, phase) for j in self.jobs)

    def fill(self, frame: int, slack_ms: float, phase: str = "after") -> FrameUse:
        use = self.use
        for job in self.jobs:
            if not self._eligible(job, phase):
                continue
            reserved = self._reserved
            if reserved is not None and reserved._in_step and job is not reserved:
                continue
            if job.policy.one_per_frame and job.name in use.by_job:
                continue
            costs = [c * self.scale for c in job.costs[job._next:]]
            # A piece longer than the slack never goes before the render: there it would make
            # this frame late as well as the next; after the render only the next one is.
            n = plan_pieces(costs, slack_ms, use.cost_ms * self.scale,
                            job.policy.one_per_frame, use.pieces > 0 or phase == "before")
            if not n:
                continue
            # The session packs the pieces itself (one submission): the room left, in
            # measured (unscaled) ms; a piece longer than it goes only where plan_pieces
            # allowed it (alone in its frame).
            room = max(0.0, slack_ms / self.scale - use.cost_ms)
            count, cost = job.submit(frame, room, at_least_one=True)
            use.oversized = use.oversized or (count > 0 and costs[0] > slack_ms)
            use.cost_ms += cost
            use.pieces += count
            use.by_job[job.name] = use.by_job.get(job.name, 0) + count
        if phase == "after":
            self._reserve(slack_ms)
        return use

    def _reserve(self, slack_ms: float) -> None:
        """After the frame's last window: the first job whose next piece is longer than the
        slack and went nowhere this frame gets the next frame to itself."""
        reserved, self._reserved = self._reserved, None
        if reserved is not None and not self.use.by_job.get(reserved.name):
            self._refused = reserved  # held back even with the frame to itself
            return
        for job in self.jobs:
            if (self._eligible(job, "after") and not job.policy.one_per_frame
                    and job is not self._refused and job.pieces_left
                    and job.costs[job._next] * self.scale > slack_ms
                    and not self.use.by_job.get(job.name)):
                self._reserved = job
                break
        self._refused = None
