"""Lab: what the wgpu backend's step costs beyond the Vulkan backend's, host or GPU.

    PYTHONPATH=. python tools/wgpu_gap_lab.py [--model smollm2] [--tiny] [--phase train|infer]
        [--rounds 10] [--steps 10] [--warmup-s 1.5] [--json OUT.json]

One model's step in three sessions, timed in alternating rounds (so a change in the machine's
load or the GPU's clock falls on all three alike) after `--warmup-s` of steps each (an idle GPU
clocks down and takes a few hundred milliseconds of work to climb back):
- `vulkan`: the Vulkan backend as it records, a barrier wherever the level changes;
- `vulkan-barriers`: the same with a barrier between every two dispatches, which is what
  WebGPU implies for vkml: wgpu puts one between any two dispatches that bind one buffer
  writable, and every vkml dispatch binds the arena writable (caps.read_only_storage=False);
- `wgpu`: the wgpu backend, which encodes the next step's commands inside step().
Per session: dispatches, barriers in the step's program, `step()` (the host's time in the call;
for wgpu mostly that encoding), `step+wait` (the round trip), medians (and minima) in ms.

Reading it: wgpu's step() well below its step+wait means its host work is hidden behind the
GPU, so the gap to Vulkan is the GPU's; `vulkan-barriers` near `wgpu` means the barriers
between dispatches account for that gap, and far below it that the kernels or the encoding do.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench  # noqa: E402

import vkml  # noqa: E402
from vkml.hal import Barrier, Dispatch  # noqa: E402

SESSIONS = ("vulkan", "vulkan-barriers", "wgpu")


def rerecord_step(session: vkml.Session, every: bool) -> dict[str, int]:
    """Records the session's step program again (the runtime's own, recorded at compile, stays
    unused until close), with a barrier between every two dispatches where `every`; returns its
    dispatch and barrier counts."""
    bound = session._bound
    phases = {d.phase for d in session.plan.dispatches}
    listed = bound.commands(bound.indices(phases))
    if every:
        spaced: list[Any] = []
        for cmd in listed:
            if isinstance(cmd, Dispatch) and spaced and isinstance(spaced[-1], Dispatch):
                spaced.append(Barrier())
            spaced.append(cmd)
        listed = spaced
    bound.step_program = bound.record_commands(listed, "step")
    return {"dispatches": sum(isinstance(c, Dispatch) for c in listed),
            "barriers": sum(isinstance(c, Barrier) for c in listed)}


def build(name: str, kind: str, tiny: bool, phase: str) -> tuple[vkml.Session, dict[str, int]]:
    module = importlib.import_module(f"vkml.models.{name}")
    built = module.build(module.tiny() if tiny else None)
    device = vkml.Device(backend="wgpu" if kind == "wgpu" else "vulkan")
    session = vkml.compile(built.graph, device=device, **bench.session_args(vkml, built, phase))
    counts = rerecord_step(session, every=kind == "vulkan-barriers")
    for input_name, value in built.sample_inputs(np.random.default_rng(0)).items():
        session.set_input(input_name, value)
    return session, counts


def timed(session: vkml.Session, steps: int, into: tuple[list[float], list[float]]) -> None:
    host, trip = into
    for _ in range(steps):
        t0 = time.perf_counter()
        session.step()
        t1 = time.perf_counter()
        session.wait()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        trip.append((t2 - t0) * 1e3)


def warm(session: vkml.Session, seconds: float) -> None:
    end = time.perf_counter() + seconds
    timed(session, 3, ([], []))  # the first steps record and compile lazily
    while time.perf_counter() < end:
        timed(session, 5, ([], []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2",
                        choices=("smollm2", "whisper_encoder", "unet", "resnet", "smolvla_expert"))
    parser.add_argument("--tiny", action="store_true", help="the model's tiny config")
    parser.add_argument("--phase", default="train", choices=("train", "infer"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="steps per session per round")
    parser.add_argument("--warmup-s", type=float, default=1.5)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    sessions = {kind: build(args.model, kind, args.tiny, args.phase) for kind in SESSIONS}
    for session, _ in sessions.values():
        warm(session, args.warmup_s)
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in sessions}
    for _ in range(args.rounds):
        for kind, (session, _) in sessions.items():
            timed(session, args.steps, times[kind])
    med: Callable[[list[float]], float] = statistics.median
    base = med(times["vulkan"][1])
    rows = []
    print(f"{args.model}{' (tiny)' if args.tiny else ''} {args.phase}, {args.rounds} rounds of "
          f"{args.steps} steps; ms, median (min)")
    print(f"{'session':16} {'dispatches':>10} {'barriers':>9} {'step()':>16} "
          f"{'step+wait':>16} {'/ vulkan':>8}")
    for kind, (session, counts) in sessions.items():
        host, trip = times[kind]
        dispatches = len(session.plan.dispatches)
        barriers = counts["barriers"] if kind != "wgpu" else "implied"
        rows.append({"session": kind, "model": args.model, "tiny": args.tiny,
                     "phase": args.phase, "dispatches": dispatches,
                     "recorded_dispatches": counts["dispatches"], "barriers": barriers,
                     "step_ms": med(host), "step_min_ms": min(host),
                     "step_wait_ms": med(trip), "step_wait_min_ms": min(trip),
                     "device": repr(session.device)})
        print(f"{kind:16} {dispatches:10d} {barriers!s:>9} "
              f"{med(host):8.3f} ({min(host):.3f}) {med(trip):8.3f} ({min(trip):.3f}) "
              f"{med(trip) / base:7.2f}x")
    print(f"devices: {rows[0]['device']}; {rows[-1]['device']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for session, _ in sessions.values():
        device = session.device
        session.close()
        device.close()


if __name__ == "__main__":
    main()
