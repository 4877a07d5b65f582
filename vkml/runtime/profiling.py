"""Profiling a bound plan: GPU time per dispatch from device timestamps where the backend has them
and they are plausible, else from the host, one submission per dispatch. `Profile` (what
session.profile() returns) is a per-kernel table and a GPU timeline (Chrome/Perfetto trace).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vkml.compiler.plan import Slot
from vkml.errors import InputError
from vkml.hal import Copy
from vkml.runtime.bound import BoundPlan


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


class Profiler:
    """Times a bound plan's steps; its programs (timestamped, or one per dispatch) are recorded
    on first use and kept."""

    def __init__(self, bound: BoundPlan) -> None:
        self.bound = bound
        self._timed: object | None = None
        self._per_dispatch: list[object] | None = None

    def run(self, steps: int, update: bool = True) -> Profile:
        """Run `steps` whole steps, timed (see Session.profile). The caller has finished any
        step in progress. `update=False`: what the steps write that outlives a step
        (parameters, optimizer state, the step count) is copied aside on the device first and
        put back after, so the session's state is as before (bit for bit)."""
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise InputError(f"profile(steps) takes a whole number of steps >= 1, got {steps!r}")
        bound = self.bound
        bound.require_inputs()
        bound.check_submit(True, int(bound.step_writes_params))
        bound.wait()
        saved = None if update else _save_state(bound)
        try:
            return self._run(steps)
        finally:
            if saved is not None:
                _restore_state(bound, saved)

    def _run(self, steps: int) -> Profile:
        bound = self.bound
        dispatches = bound.plan.dispatches
        stamps = bound.backend.timestamps
        timed = stamps is not None
        note = "" if timed else "the device writes no timestamps"
        gpu_runs: list[tuple[list[float], float]] = []
        host_runs: list[tuple[list[float], list[float], float]] = []
        updates = int(bound.step_writes_params)
        remaining = steps
        while remaining > 0:
            if timed:
                assert stamps is not None
                if self._timed is None:
                    self._timed = bound.keep(stamps.record(
                        bound.commands(range(len(dispatches))), "step (timed)"))
                t0 = time.perf_counter()
                bound.submit([self._timed], updates=updates)
                bound.wait()
                host_ms = (time.perf_counter() - t0) * 1e3
                ms = stamps.timings(self._timed)
                remaining -= 1
                ok, why = timestamps_plausible(ms, host_ms)
                if ok:
                    gpu_runs.append((ms, host_ms))
                    continue
                timed = False
                note = (f"GPU timestamps implausible: {why}; timed from the host, one "
                        "submission per dispatch, submit overhead included")
                if gpu_runs:
                    note += f"; {len(gpu_runs)} earlier timestamped step(s) dropped"
                gpu_runs = []
                if remaining == 0:
                    note += "; one extra step was run for host timing"
                    remaining = 1
                continue
            host_runs.append(self._host_timed_step())
            bound.step_updates += bound.step_writes_params  # sharing sessions' prologues follow
            remaining -= 1
        return _summarise(dispatches, gpu_runs, host_runs, note)

    def _host_timed_step(self) -> tuple[list[float], list[float], float]:
        """One step as one submission per dispatch, each timed from the host: (ms per
        dispatch, start ms of each relative to the step, the step's wall ms)."""
        bound = self.bound
        if self._per_dispatch is None:
            self._per_dispatch = [bound.record([i], f"dispatch {i}")
                                  for i in range(len(bound.plan.dispatches))]
        ms, starts = [], []
        last = len(self._per_dispatch) - 1
        t_step = time.perf_counter()
        for i, program in enumerate(self._per_dispatch):
            t0 = time.perf_counter()
            # The first one carries the inputs' upload, as a step's first program does.
            bound.submit([program], begins=i == 0, ends=i == last)
            bound.wait()
            t1 = time.perf_counter()
            starts.append((t0 - t_step) * 1e3)
            ms.append((t1 - t0) * 1e3)
        return ms, starts, (time.perf_counter() - t_step) * 1e3


def _state_slots(bound: BoundPlan) -> list[Slot]:
    """The slots a step writes whose values outlive it: parameters, optimizer state, the
    hyperparameters with the step count (not activations, gradients or outputs)."""
    plan = bound.plan
    written = {s for d in plan.dispatches for s in d.writes}
    return [plan.slots[s] for s in sorted(written)
            if plan.slots[s].role in ("param", "optimizer_state", "hyperparams", "constant")]


def _save_state(bound: BoundPlan) -> tuple[object, list[tuple[Slot, int]]] | None:
    """Copy the state slots into a device buffer of their own (one copy program)."""
    slots = _state_slots(bound)
    if not slots:
        return None
    layout, total = [], 0
    for slot in slots:
        layout.append((slot, total))
        total += -(-slot.nbytes // 16) * 16
    backend = bound.backend
    backup = backend.create_buffer(total, "device", "profile: state kept aside")
    try:
        backend.run_now([Copy(*bound.place(slot.id), backup, at, slot.nbytes)
                         for slot, at in layout])
    except BaseException:
        backend.free_buffer(backup)
        raise
    return backup, layout


def _restore_state(bound: BoundPlan, saved: tuple[object, list[tuple[Slot, int]]]) -> None:
    backup, layout = saved
    backend = bound.backend
    try:
        bound.wait()
        backend.run_now([Copy(backup, at, *bound.place(slot.id), slot.nbytes)
                         for slot, at in layout])
        # what the steps write, written back: the prologues of sessions sharing these
        # parameters run again, as after an update (this plan's own reads none of it)
        bound.step_updates += 1
    finally:
        backend.free_buffer(backup)


def _summarise(dispatches: Sequence, gpu_runs: list[tuple[list[float], float]],
               host_runs: list[tuple[list[float], list[float], float]], note: str) -> Profile:
    events = []
    clock = 0.0
    per_dispatch: list[list[float]] = []
    step_ms, host_step_ms = [], []
    if gpu_runs:
        source = "gpu timestamps"
        for s, (ms, host_ms) in enumerate(gpu_runs):
            t = clock
            for d, m in zip(dispatches, ms):
                events.append((d.kernel.name, d.label, s, t, m))
                t += m
            clock += max(host_ms, sum(ms))
            per_dispatch.append(ms)
            step_ms.append(sum(ms))
            host_step_ms.append(host_ms)
    else:
        source = "host timing"
        for s, (ms, starts, host_ms) in enumerate(host_runs):
            for d, m, start in zip(dispatches, ms, starts):
                events.append((d.kernel.name, d.label, s, clock + start, m))
            clock += host_ms
            per_dispatch.append(ms)
            step_ms.append(sum(ms))
            host_step_ms.append(host_ms)
    runs = len(per_dispatch)
    mean = [sum(run[i] for run in per_dispatch) / runs for i in range(len(dispatches))]
    totals: dict[str, list[float]] = {}
    for i, d in enumerate(dispatches):
        entry = totals.setdefault(d.kernel.name, [0, 0.0])
        entry[0] += runs
        entry[1] += sum(run[i] for run in per_dispatch)
    rows = [KernelRow(name, int(c), t) for name, (c, t) in totals.items()]
    return Profile(rows, runs, source, note, step_ms, host_step_ms, events, mean)
