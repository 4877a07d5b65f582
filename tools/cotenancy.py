"""Co-tenancy: a host renderer and a vkml training step on ONE Vulkan queue (tools/PROTOCOL.md).

    PYTHONPATH=. python tools/cotenancy.py [--hz 72] [--frames 150] [--size 256]
        [--iterations 32] [--width 256] [--budget-ms auto] [--out out/cotenancy]

The host (vkml.host: its own instance, device and queue; vkml joins with Device.from_vulkan and
shares the queue lock) draws offscreen frames at a vsync-like cadence: each frame waits for its
slot, submits the render, then the model's next piece (session.step_chunk()), then waits for
the render's fence. Modes: renderer alone, the model whole (1 chunk), 2 and 4 chunks, and
budget mode (pieces of at most --budget-ms of measured GPU time). A new training step starts
only when the previous one has finished (its timeline value reached).

Reported per mode: frame time p50/p99 (submit to fence, host clock), render GPU time p50
(timestamps), missed frames (a frame not done within its period), skipped slots, steps done,
worker latency (first piece submitted to last piece done, ms and frames) p50/p99. JSON and a PNG
figure (vkml/png.py) go to --out.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

import vkml
from vkml.host import HostContext, OffscreenRenderer
from vkml.png import Canvas, write_png


def model(device: vkml.Device, width: int) -> vkml.Session:
    """A training MLP (4 layers, Adam) whose step costs a few frames' worth on lavapipe."""
    g = vkml.Graph(seed=0)
    x = g.input("x", (64, width))
    labels = g.input("labels", (64,), "i32")
    h = vkml.nn.Linear(g, "fc1", width, width)(x).relu()
    h = vkml.nn.Linear(g, "fc2", width, width)(h).relu()
    h = vkml.nn.Linear(g, "fc3", width, width)(h).relu()
    logits = vkml.nn.Linear(g, "fc4", width, 10)(h)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                           optimizer=vkml.Adam(lr=1e-3), device=device)
    rng = np.random.default_rng(0)
    session.set_input("x", rng.standard_normal((64, width)).astype(np.float32))
    session.set_input("labels", rng.integers(0, 10, 64).astype(np.int32))
    return session


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(p / 100 * len(v)))], 3)


class Worker:
    """Feeds the model one piece per frame; times each step from its first piece's submission
    to its completion on the timeline (a waiter thread blocks in vkWaitSemaphores)."""

    def __init__(self, ctx: HostContext, session: vkml.Session, chunks: int | None,
                 budget_ms: float | None) -> None:
        self.ctx, self.session = ctx, session
        self.chunks, self.budget_ms = chunks, budget_ms
        self.latencies: list[float] = []
        self.pieces: list[int] = []
        self.start: float | None = None
        self.count = 0
        self.done_value = 0
        self.waiter: threading.Thread | None = None

    def frame(self) -> None:
        s = self.session
        if s.pieces_left == 0:  # between steps: start one only when the last has finished
            semaphore, _ = s.done()
            if self.ctx.timeline_value(semaphore) < self.done_value:
                return
            self.start, self.count = time.perf_counter(), 0
            left = s.step_chunk(chunks=self.chunks, budget_ms=self.budget_ms)
        else:
            left = s.step_chunk()
        self.count += 1
        if left == 0:
            semaphore, value = s.done()
            self.done_value, start, count = value, self.start, self.count

            def wait(semaphore=semaphore, value=value, start=start, count=count) -> None:
                self.ctx.wait_timeline(semaphore, value)
                self.latencies.append((time.perf_counter() - start) * 1e3)
                self.pieces.append(count)

            if self.waiter is not None:
                self.waiter.join()
            self.waiter = threading.Thread(target=wait)
            self.waiter.start()

    def finish(self) -> None:
        if self.waiter is not None:
            self.waiter.join()
        self.session.wait()


def run_mode(ctx: HostContext, renderer: OffscreenRenderer, worker: Worker | None, hz: float,
             frames: int) -> dict:
    period = 1.0 / hz
    frame_ms, gpu_ms = [], []
    missed = skipped = 0
    base = time.perf_counter()
    slot = 1
    for _ in range(frames):
        start = base + slot * period  # xrWaitFrame's analogue: block until this frame's slot
        now = time.perf_counter()
        if now > start:
            skip = int((now - start) / period) + 1
            skipped += skip
            slot += skip
            start = base + slot * period
        time.sleep(max(0.0, start - time.perf_counter()))
        # GPU timestamps only without the model: reading them waits for the whole queue on
        # lavapipe 22.3, which would charge the model's work to the host's frame loop.
        t0 = renderer.render(timed=worker is None)
        if worker is not None:
            worker.frame()
        cpu, gpu = renderer.wait(t0)
        frame_ms.append(cpu)
        if gpu == gpu:  # not NaN
            gpu_ms.append(gpu)
        missed += cpu > period * 1e3
        slot += 1
    if worker is not None:
        worker.finish()
    lat = worker.latencies if worker else []
    return {
        "frames": frames, "frame_ms_p50": pct(frame_ms, 50), "frame_ms_p99": pct(frame_ms, 99),
        "render_gpu_ms_p50": pct(gpu_ms, 50), "missed_frames": missed,
        "skipped_slots": skipped, "steps_done": len(lat),
        "worker_latency_ms_p50": pct(lat, 50), "worker_latency_ms_p99": pct(lat, 99),
        "worker_latency_frames_p50": (round(pct(lat, 50) / (period * 1e3), 2) if lat else None),
        "pieces_per_step": (statistics.median(worker.pieces) if worker and worker.pieces
                            else None),
    }


def figure(result: dict, path: str) -> None:
    modes = result["modes"]
    names = list(modes)
    c = Canvas(560, 300)
    c.text(10, 8, f"CO-TENANCY, {result['device'].split(' (')[0]}, {result['hz']:g} HZ, "
           f"MODEL STEP {result['model']['step_ms_profiled']:.1f} MS")
    top = max([m["frame_ms_p99"] or 0 for m in modes.values()]
              + [m["worker_latency_ms_p50"] or 0 for m in modes.values()] + [1.0])
    x0, y0, h = 40, 30, 220
    slot = (c.width - x0 - 10) // len(names)
    budget = 1000 / result["hz"]
    yb = y0 + h - int(h * budget / top)
    c.text(2, y0, f"{top:.0f}", (80, 80, 80))
    c.text(2, y0 + h - 7, "0", (80, 80, 80))
    c.rect(x0, yb, c.width - x0 - 10, 1, (200, 0, 0))
    c.text(x0 + 2, yb - 9, f"FRAME {budget:.1f} MS", (200, 0, 0))
    for i, name in enumerate(names):
        m = modes[name]
        bars = [(m["frame_ms_p50"], (60, 110, 200)), (m["frame_ms_p99"], (30, 50, 120)),
                (m["worker_latency_ms_p50"], (230, 150, 40))]
        for j, (v, color) in enumerate(bars):
            if v is None:
                continue
            bh = int(h * v / top)
            c.rect(x0 + i * slot + 6 + j * 18, y0 + h - bh, 16, bh, color)
        c.text(x0 + i * slot + 4, y0 + h + 6, name)
        c.text(x0 + i * slot + 4, y0 + h + 16, f"MISSED {m['missed_frames']}", (120, 0, 0))
    c.rect(x0, y0 + h, c.width - x0 - 10, 1, (0, 0, 0))
    c.text(10, 284, "BLUE FRAME P50 P99   ORANGE STEP LATENCY P50 (MS)", (80, 80, 80))
    write_png(path, c.upscaled(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hz", type=float, default=72.0)
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--size", type=int, default=256, help="render target width = height")
    ap.add_argument("--iterations", type=int, default=32, help="fragment work per pixel")
    ap.add_argument("--width", type=int, default=256, help="the model's hidden width")
    ap.add_argument("--budget-ms", default="auto",
                    help="budget mode's piece size; auto = a quarter of the frame period")
    ap.add_argument("--out", default="out/cotenancy")
    args = ap.parse_args()
    period_ms = 1000 / args.hz
    budget = period_ms / 4 if args.budget_ms == "auto" else float(args.budget_ms)

    ctx = HostContext()
    renderer = OffscreenRenderer(ctx, args.size, args.size, args.iterations)
    device = ctx.vkml_device()
    session = model(device, args.width)
    for _ in range(5):  # warm-up: driver JIT, caches
        renderer.wait(renderer.render())
    # Programs for every mode recorded before timing; the profile measures the step's GPU
    # time (after graphics work: lavapipe 22.3 timestamps may be implausible, and it says so).
    t0 = time.perf_counter()
    session.step()
    session.wait()
    whole_ms = (time.perf_counter() - t0) * 1e3
    prof = session.profile(steps=3)
    for chunks in (1, 2, 4):
        session.step(chunks=chunks)
    session.step(budget_ms=budget)
    session.wait()
    result = {
        "device": ctx.device_name, "hz": args.hz, "frame_budget_ms": round(period_ms, 3),
        "render": {"size": args.size, "iterations": args.iterations},
        "model": {"width": args.width, "dispatches": len(session.plan.dispatches),
                  "levels": len({d.level for d in session.plan.dispatches}),
                  "step_wall_ms_alone": round(whole_ms, 3),
                  "profile_source": prof.source, "profile_note": prof.note,
                  "step_ms_profiled": round(statistics.median(prof.step_ms), 3)},
        "budget_ms": round(budget, 3),
        "pieces": {f"chunks={c}": len(session.chunk_boundaries(chunks=c)) for c in (1, 2, 4)}
        | {"budget": len(session.chunk_boundaries(budget_ms=budget))},
        "modes": {},
    }
    modes = [("none", None, None), ("chunks=1", 1, None), ("chunks=2", 2, None),
             ("chunks=4", 4, None), ("budget", None, budget)]
    for name, chunks, budget_ms in modes:
        worker = Worker(ctx, session, chunks, budget_ms) if name != "none" else None
        result["modes"][name] = run_mode(ctx, renderer, worker, args.hz, args.frames)
        print(name, json.dumps(result["modes"][name]), flush=True)
    none = result["modes"]["none"]["frame_ms_p50"] or 0.0
    for m in result["modes"].values():
        m["frame_ms_added_p50"] = round((m["frame_ms_p50"] or 0.0) - none, 3)
    session.close()
    device.close()
    renderer.close()
    ctx.close()
    result["validation_messages"] = len(ctx.messages)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    figure(result, args.out + ".png")
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
