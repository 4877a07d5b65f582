"""Co-tenancy: a host renderer and a vkml training step on ONE Vulkan queue (tools/PROTOCOL.md).

    python tools/cotenancy.py [--hz 72] [--frames 150] [--size 256] [--iterations 32]
        [--width 256] [--budget-ms auto] [--margin-ms 1] [--out out/cotenancy]

The host (xr_demo.vkhost: its own instance, device and queue; vkml joins with
Device.from_vulkan and shares the queue lock) draws offscreen frames of a synthetic load
(xr_demo.loadgen: a full-screen fragment shader, GPU cost = size x iterations) at a vsync-like
cadence: each frame waits for its slot, submits the render, then the model's pieces, then waits
for the render's fence. A new training step starts only when the previous one has finished.

Modes (xr_demo.schedule): renderer alone; one piece per frame with the step whole (1 chunk), in
2 and 4 chunks, or in pieces of at most --budget-ms (auto: the slack the render leaves, i.e. the
frame period minus the measured render GPU time minus --margin-ms); and `slack`: small pieces,
as many per frame as fit that slack.

Reported per mode: frame time p50/p99 (submit to fence, host clock), render GPU time p50
(timestamps), missed frames (a frame not done within its period), skipped slots, steps done,
worker latency (first piece submitted to last piece done, ms and frames) p50/p99, and how it
compares with 1 chunk. Before the modes, `step_overhead` splits a lone step's wall time into
the time in step() (Python + vkQueueSubmit), the wait, and the GPU time, first step and steady
state. JSON and a PNG figure go to --out.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import vkml  # noqa: E402
from xr_demo.loadgen import FullscreenLoad  # noqa: E402
from xr_demo.schedule import Job, Policy, Scheduler  # noqa: E402
from xr_demo.vkhost import VulkanHost  # noqa: E402


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


def step_overhead(session: vkml.Session, steps: int = 10) -> dict:
    """Where a lone step's wall time goes: time inside step() (Python, input copies recorded
    in the program, vkQueueSubmit under the lock), time blocked in wait(), for the session's
    first step and in steady state. The GPU time comes from profile() (run afterwards)."""

    def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        session.step()
        t1 = time.perf_counter()
        session.wait()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3

    first_submit, first_wait = one()
    runs = [one() for _ in range(steps)]
    return {"first_step_submit_ms": round(first_submit, 3),
            "first_step_wait_ms": round(first_wait, 3),
            "first_step_wall_ms": round(first_submit + first_wait, 3),
            "steady_submit_ms_p50": pct([s for s, _ in runs], 50),
            "steady_wait_ms_p50": pct([w for _, w in runs], 50),
            "steady_wall_ms_p50": pct([s + w for s, w in runs], 50)}


def run_mode(host: VulkanHost, renderer: FullscreenLoad, job: Job | None, hz: float,
             frames: int, slack_ms: float, margin_ms: float) -> dict:
    period = 1.0 / hz
    frame_ms, gpu_ms = [], []
    missed = skipped = 0
    scheduler = Scheduler([job] if job is not None else [])
    base = time.perf_counter()
    slot = 1
    for n in range(frames):
        start = base + slot * period  # xrWaitFrame's analogue: block until this frame's slot
        now = time.perf_counter()
        if now > start:
            skip = int((now - start) / period) + 1
            skipped += skip
            slot += skip
            start = base + slot * period
        time.sleep(max(0.0, start - time.perf_counter()))
        scheduler.new_frame()
        if job is not None:  # slack mode: a step begun last frame continues before the render
            scheduler.fill(n, slack_ms, "before")
        # GPU timestamps only without the model: reading them waits for the whole queue on
        # lavapipe 22.3, which would charge the model's work to the host's frame loop.
        t0 = renderer.render(timed=job is None)
        if job is not None:
            if not job.busy:  # a new step only once the last one has finished
                job.begin(n)
            scheduler.fill(n, slack_ms, "after")
        cpu, gpu = renderer.wait(t0)
        # A miss raises the pieces' prices (measured alone, they run slower beside the
        # render), on-time frames relax them: as the demo does.
        scheduler.observe(cpu, period * 1e3, margin_ms)
        frame_ms.append(cpu)
        if gpu == gpu:  # not NaN
            gpu_ms.append(gpu)
        missed += cpu > period * 1e3
        slot += 1
    if job is not None:
        # The step in progress is completed here, by this mode: the next mode's job never
        # continues a step it did not start (the waiter race seen at --width 8192).
        job.close()
    lat = job.latencies() if job else []
    records = job.records if job else []
    return {
        "frames": frames, "frame_ms_p50": pct(frame_ms, 50), "frame_ms_p99": pct(frame_ms, 99),
        "render_gpu_ms_p50": pct(gpu_ms, 50), "missed_frames": missed,
        "skipped_slots": skipped, "steps_done": len(lat),
        "worker_latency_ms_p50": pct(lat, 50), "worker_latency_ms_p99": pct(lat, 99),
        "worker_latency_frames_p50": (round(pct(lat, 50) / (period * 1e3), 2) if lat else None),
        "pieces_per_step": (statistics.median(r.pieces for r in records) if records else None),
        "frames_per_step": (statistics.median(r.frames for r in records) if records else None),
        "pieces": len(job.costs) if job else None,
        "piece_ms_max": round(max(job.costs), 3) if job else None,
    }


def figure(result: dict, path: str) -> None:
    """Frame time (p50, p99) and the training step's latency per mode, against the frame period."""
    from matplotlib.figure import Figure

    modes = result["modes"]
    series = [("frame p50", "frame_ms_p50", "#3c6ec8"), ("frame p99", "frame_ms_p99", "#1e3278"),
              ("step latency p50", "worker_latency_ms_p50", "#e69628")]
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    x = np.arange(len(modes))
    for j, (label, key, color) in enumerate(series):
        values = [m[key] if m[key] is not None else np.nan for m in modes.values()]
        ax.bar(x + (j - 1) * 0.27, values, 0.27, label=label, color=color)
    budget = 1000 / result["hz"]
    ax.axhline(budget, color="#c80000", linewidth=1)
    ax.annotate(f"frame {budget:.1f} ms", (x[0] - 0.4, budget), color="#c80000",
                textcoords="offset points", xytext=(0, 3))
    ax.set_xticks(x, [f"{name}\nmissed {m['missed_frames']}" for name, m in modes.items()])
    ax.set(ylabel="ms", title=f"co-tenancy, {result['device'].split(' (')[0]}, {result['hz']:g} "
           f"Hz, model step {result['model']['step_ms_profiled']:.1f} ms")
    ax.legend(frameon=False)
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hz", type=float, default=72.0)
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--size", type=int, default=256, help="render target width = height")
    ap.add_argument("--iterations", type=int, default=32, help="fragment work per pixel")
    ap.add_argument("--width", type=int, default=256, help="the model's hidden width")
    ap.add_argument("--budget-ms", default="auto",
                    help="budget mode's piece size; auto = the measured slack of the frame")
    ap.add_argument("--margin-ms", type=float, default=1.0,
                    help="frame time kept free of model work when computing the slack")
    ap.add_argument("--out", default="out/cotenancy")
    args = ap.parse_args()
    period_ms = 1000 / args.hz

    host = VulkanHost.create()
    renderer = FullscreenLoad(host, args.size, args.size, args.iterations)
    device = host.vkml_device()
    session = model(device, args.width)
    render_gpu = []
    for _ in range(15):  # warm-up (driver JIT, caches), then the render's GPU time alone
        _, gpu = renderer.wait(renderer.render())
        render_gpu.append(gpu)
    render_ms = statistics.median(render_gpu[5:])
    slack_ms = max(0.0, period_ms - render_ms - args.margin_ms)
    budget = slack_ms if args.budget_ms == "auto" else float(args.budget_ms)
    budget = max(budget, 0.05)
    overhead = step_overhead(session)
    # The profile measures the step's GPU time per dispatch (after graphics work lavapipe
    # 22.3's timestamps may be implausible: then host timing, and it says so).
    prof = session.profile(steps=3)
    overhead["gpu_ms_profiled"] = round(statistics.median(prof.step_ms), 3)
    overhead["steady_wall_minus_gpu_ms"] = round(
        (overhead["steady_wall_ms_p50"] or 0) - overhead["gpu_ms_profiled"], 3)
    print("step overhead", json.dumps(overhead), flush=True)
    policies = [("chunks=1", Policy("chunks", 1)), ("chunks=2", Policy("chunks", 2)),
                ("chunks=4", Policy("chunks", 4)), ("budget", Policy("budget", budget)),
                ("slack", Policy("slack").within(slack_ms))]
    jobs = {name: Job("train", session, host, p)
            for name, p in policies}
    for job in jobs.values():  # record every mode's pieces before timing
        session.step(**job._chunking)
    session.wait()
    result = {
        "device": host.device_name, "hz": args.hz, "frame_budget_ms": round(period_ms, 3),
        "render": {"size": args.size, "iterations": args.iterations,
                   "gpu_ms_alone_p50": round(render_ms, 3)},
        "slack_ms": round(slack_ms, 3),
        "model": {"width": args.width, "dispatches": len(session.plan.dispatches),
                  "levels": len({d.level for d in session.plan.dispatches}),
                  "profile_source": prof.source, "profile_note": prof.note,
                  "step_ms_profiled": round(statistics.median(prof.step_ms), 3)},
        "step_overhead": overhead,
        "budget_ms": round(budget, 3),
        "pieces": {name: len(job.costs) for name, job in jobs.items()},
        "modes": {},
    }
    result["modes"]["none"] = run_mode(host, renderer, None, args.hz, args.frames, slack_ms,
                                       args.margin_ms)
    print("none", json.dumps(result["modes"]["none"]), flush=True)
    for name, job in jobs.items():
        result["modes"][name] = run_mode(host, renderer, job, args.hz, args.frames, slack_ms,
                                          args.margin_ms)
        print(name, json.dumps(result["modes"][name]), flush=True)
    none = result["modes"]["none"]["frame_ms_p50"] or 0.0
    base = result["modes"]["chunks=1"]["worker_latency_ms_p50"]
    for m in result["modes"].values():
        m["frame_ms_added_p50"] = round((m["frame_ms_p50"] or 0.0) - none, 3)
        if base and m["worker_latency_ms_p50"]:
            m["latency_vs_chunks1"] = round(m["worker_latency_ms_p50"] / base, 3)
    session.close()
    device.close()
    renderer.close()
    host.close()
    result["validation_messages"] = len(host.messages)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    figure(result, args.out + ".png")
    print(json.dumps({k: v for k, v in result.items() if k != "modes"}))
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
