"""Headless mode: the host renders offscreen at a vsync-like cadence (each frame waits for its
slot of 1/hz), the model learns between frames on the same queue, and the run's pictures, plot
and metrics are written to the output folder."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import vulkan as vk

from xr_demo import outputs
from xr_demo.app import EVAL_FRAMES, Demo, Options, camera_frame, pct
from xr_demo.loadgen import FullscreenLoad, calibrated
from xr_demo.renderer import SceneRenderer
from xr_demo.scene import Scene, desktop_camera
from xr_demo.schedule import Job, Policy, Scheduler
from xr_demo.vkhost import VulkanHost


class Pacer:
    """xrWaitFrame's analogue: block until the next frame's slot; a loop that fell behind
    skips the slots it missed (counted)."""

    def __init__(self, hz: float) -> None:
        self.period = 1.0 / hz if hz else 0.0
        self.base = time.perf_counter()
        self.slot = 1

    def wait(self) -> tuple[int, float]:
        """Block until the next slot: (slots skipped, the frame's start time). A frame is
        on time if its render is done within one period of its start."""
        if not self.period:
            return 0, time.perf_counter()
        start = self.base + self.slot * self.period
        now = time.perf_counter()
        skipped = 0
        if now > start:
            skipped = int((now - start) / self.period) + 1
            self.slot += skipped
            start = self.base + self.slot * self.period
        time.sleep(max(0.0, start - time.perf_counter()))
        self.slot += 1
        return skipped, start


def calibrate(host: VulkanHost, renderer: SceneRenderer, frames: int = 16,
              load: FullscreenLoad | None = None) -> tuple[float, str, list[float]]:
    """The render's time per frame (with the synthetic `load`, submitted before it, if any),
    measured alone: GPU timestamps where plausible against the host's submit-to-fence time,
    else that host time. Returns (p90 ms, source, samples)."""
    cb = host.command_buffers(1)[0]
    fence = host.fence()
    gpu, wall = [], []
    try:
        for n in range(frames + 3):
            vk.vkResetCommandBuffer(cb, 0)
            vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
            renderer.record(cb, desktop_camera(n * 97), n / 72.0)
            vk.vkEndCommandBuffer(cb)
            t0 = time.perf_counter()
            t_load = load.render(timed=True) if load is not None else 0.0
            host.submit(cb, fence)
            host.wait_fence(fence)
            load_ms = load.wait(t_load)[1] if load is not None else 0.0
            ms = (time.perf_counter() - t0) * 1e3
            g = renderer.gpu_ms()
            g = g + load_ms if g is not None and math.isfinite(load_ms) else None
            if n >= 3:  # the first frames compile the driver's shaders
                wall.append(ms)
                gpu.append(g)
    finally:
        vk.vkDestroyFence(host.device, fence, None)
        vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])
    plausible = [g for g, w in zip(gpu, wall) if g is not None and 0.01 * w <= g <= w + 0.5]
    if len(plausible) == len(wall):
        return pct(plausible, 90) or 0.0, "gpu timestamps", plausible
    return pct(wall, 90) or 0.0, "host submit-to-fence (timestamps implausible)", wall


def frame_loop(host: VulkanHost, renderer: SceneRenderer, demo: Demo, opts: Options,
               frames: int, first: int = 0, log: Callable[[str], None] | None = None,
               load: FullscreenLoad | None = None) -> None:
    """`frames` frames paced at opts.hz: each renders the scene (after the synthetic `load`,
    if any: one frame's GPU work is both), the model's pieces around it."""
    cb = host.command_buffers(1)[0]
    fence = host.fence()
    pacer = Pacer(opts.hz)
    last_report = time.perf_counter()
    try:
        for n in range(first, first + frames):
            if log is not None and time.perf_counter() - last_report > 10:
                last_report = time.perf_counter()
                run = demo.run
                loss = f", loss {run.losses[-1][2]:.5f}" if run.losses else ""
                err = (f", live AbsRel {run.predictions[-1].abs_rel:.3f}"
                       if run.predictions else "")
                log(f"  frame {n - first}/{frames}: {len(run.losses)} training steps{loss}{err}")
            skipped, frame_start = pacer.wait()
            t_host, cpu_host = time.perf_counter(), time.thread_time()
            demo.begin_frame(n)
            c = camera_frame(opts, n)
            vk.vkResetCommandBuffer(cb, 0)
            vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
            renderer.record(cb, desktop_camera(c), c / 72.0)
            vk.vkEndCommandBuffer(cb)
            demo.fill_before_render(n)  # continuing steps' pieces, then the render
            t_load = load.render(timed=False) if load is not None else 0.0
            host.submit(cb, fence)
            demo.fill(n)  # new steps' pieces go in after the render, on the same queue
            t_wait, cpu_wait = time.perf_counter(), time.thread_time()
            host.wait_fence(fence)
            if load is not None:
                load.wait(t_load)
            t_fenced, cpu_fenced = time.perf_counter(), time.thread_time()
            # frame time: from the frame's slot (host work, the pieces before the render and
            # the render itself) to the render's fence
            frame_ms = (t_fenced - frame_start) * 1e3
            rgb, depth = renderer.read()
            gpu = renderer.gpu_ms() if demo.queries_readable() else None
            host_ms = (t_wait - t_host + time.perf_counter() - t_fenced) * 1e3
            cpu_ms = (cpu_wait - cpu_host + time.thread_time() - cpu_fenced) * 1e3
            demo.end_frame(n, rgb, depth, frame_ms, gpu, skipped, host_ms, cpu_ms)
    finally:
        host.idle()
        vk.vkDestroyFence(host.device, fence, None)
        vk.vkFreeCommandBuffers(host.device, host.pool, 1, [cb])


def compare_policies(host: VulkanHost, renderer: SceneRenderer, demo: Demo, opts: Options,
                     first_frame: int, log: Callable[[str], None],
                     load: FullscreenLoad | None = None) -> dict[str, Any]:
    """Training alone (no inference) under 1, 2, 4 chunks, a budget and the slack schedule,
    `compare_frames` frames each: frame times, missed frames, worker latency (PROTOCOL.md's
    co-tenancy metrics). The budget is the slack the render leaves, as measured."""
    assert demo.train is not None
    train = demo.job("train")
    assert train is not None
    budget = round(max(demo.slack_ms, 0.25), 2)
    policies = [Policy("chunks", 1), Policy("chunks", 2), Policy("chunks", 4),
                Policy("budget", budget), Policy("slack").within(demo.slack_ms)]
    results: dict[str, Any] = {"budget_ms": budget}
    saved_jobs, saved_sched = demo.jobs, demo.scheduler
    saved_infer = opts.infer_every
    n = first_frame
    try:
        opts.infer_every = 0
        for policy in policies:
            job = Job("train", demo.train, host, policy)
            demo.jobs, demo.scheduler = [job], Scheduler([job])
            demo.run.frames = []
            frame_loop(host, renderer, demo, opts, opts.compare_frames, first=n, load=load)
            n += opts.compare_frames
            job.close()
            demo.begin_frame(n, start_inference=False)
            m = demo.metrics(1000 / opts.hz if opts.hz else 0.0)
            m["pieces"] = len(job.costs)
            m["piece_ms_max"] = round(max(job.costs), 3)
            results[str(policy)] = m
            log(f"  {str(policy):>14}: frame p50 {m['frame_ms_p50']} p99 {m['frame_ms_p99']} "
                f"ms, missed@72 {m['missed_frames_72hz']}, skipped slots "
                f"{m['skipped_slots']}, latency p50 "
                f"{m['train_latency_ms_p50']} ms over {m['train_frames_per_step_p50']} "
                f"frames ({m['train_steps']} steps, {len(job.costs)} pieces)")
    finally:
        demo.jobs, demo.scheduler = saved_jobs, saved_sched
        opts.infer_every = saved_infer
    base = results["chunks=1"].get("train_latency_ms_p50")
    for key in ("chunks=2", "chunks=4", f"budget={budget:g}ms", "slack"):
        lat = results.get(key, {}).get("train_latency_ms_p50")
        if base and lat:
            results[key]["latency_vs_chunks1"] = round(lat / base, 3)
    return results


def run(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole headless run; returns the metrics (also written to <out>/metrics.json)."""
    t_start = time.perf_counter()
    host = VulkanHost.create()
    renderer = demo = load = None
    try:
        renderer = SceneRenderer(host, opts.resolution, opts.resolution, Scene.build(opts.seed))
        demo = Demo(host, opts, renderer, log)
        log(f"device: {host.device_name}; compiled the depth network in {demo.compile_s:.1f} s")
        load_info = None
        demo.warm_gpu()  # the calibration below measures at the GPU's running clock
        if opts.load_ms > 0:
            load, load_ms = calibrated(host, opts.load_ms, opts.load_size)
            load_info = {"size": opts.load_size, "iterations": load.iterations,
                         "ms": round(load_ms, 3)}
            log(f"synthetic render load (xr_demo/loadgen.py): {opts.load_size}x{opts.load_size}"
                f", {load.iterations} iterations a pixel, {load_ms:.2f} ms a frame alone "
                f"(asked {opts.load_ms:g})")
        render_ms, render_source, _ = calibrate(host, renderer, load=load)
        period_ms = 1000 / opts.hz if opts.hz else 0.0
        if opts.evaluate:
            demo.run.eval_start = demo.evaluate()
            log(f"held-out depth error (AbsRel) at the start: {demo.run.eval_start:.4f}")
        info = demo.prepare(period_ms, render_ms)
        info["render_timing"] = render_source
        info["load"] = load_info
        log(f"render {render_ms:.2f} ms ({render_source}); frame {period_ms:.2f} ms; "
            f"slack {info['slack_ms']} ms")
        for name in ("infer", "train"):
            if name in info and "pieces" in info[name]:
                i = info[name]
                log(f"{name}: step {i['step_gpu_ms']} ms GPU ({i['timing']}), "
                    f"{i['dispatches']} dispatches, {i['pieces']} pieces under {i['policy']}")
        t_loop = time.perf_counter()
        frame_loop(host, renderer, demo, opts, opts.frames, log=log, load=load)
        loop_s = time.perf_counter() - t_loop
        demo.finish()
        metrics: dict[str, Any] = {
            "device": host.device_name, "mode": "headless", "options": vars(opts).copy(),
            "network": {"model": opts.model, "description": demo.cfg.describe(),
                        "params": demo.counts["encoder"] + demo.counts["decoder"],
                        "params_encoder": demo.counts["encoder"],
                        "params_decoder": demo.counts["decoder"],
                        "params_live": demo.counts["live"],
                        "trainable_live": len(demo.live_params),
                        "encoder_weights": demo.encoder_source, "config": repr(demo.cfg)},
            "setup": info, "loop_seconds": round(loop_s, 2),
            "run": demo.metrics(period_ms),
        }
        run_log = demo.run
        if opts.evaluate:
            run_log.eval_end = demo.evaluate()
            log(f"held-out depth error (AbsRel) at the end: {run_log.eval_end:.4f} "
                f"(start {run_log.eval_start:.4f}, {len(run_log.losses)} training steps)")
        preds = run_log.predictions
        metrics["depth_error"] = {
            "eval_abs_rel_start": run_log.eval_start, "eval_abs_rel_end": run_log.eval_end,
            "eval_frames": list(EVAL_FRAMES),
            "live_abs_rel": [(p.frame, round(p.t, 3), p.train_steps, round(p.abs_rel, 5))
                             for p in preds],
            "train_loss": [(s, f, round(v, 6)) for s, f, v in run_log.losses],
        }
        if opts.compare and demo.train is not None:
            log(f"comparing schedules, training alone, {opts.compare_frames} frames each:")
            frames_before = list(run_log.frames)
            metrics["schedules"] = compare_policies(host, renderer, demo, opts,
                                                    opts.frames + 1000, log, load)
            run_log.frames = frames_before
        if opts.save:
            demo.save(opts.save)
        metrics["validation_messages"] = list(host.messages)
        metrics["validating"] = host.messenger is not None
        metrics["total_seconds"] = round(time.perf_counter() - t_start, 2)
        title = (f"{host.device_name.split(' (')[0]}: {opts.model} {opts.resolution}x"
                 f"{opts.resolution}, "
                 f"live {opts.live}, schedule {opts.schedule}, {opts.hz:g} Hz")
        paths = outputs.write_all(opts.out, run_log, metrics, opts.hz, title)
        metrics["outputs"] = {k: os.path.abspath(v) for k, v in paths.items()}
        outputs.write_json(paths["metrics"], metrics)
        r = metrics["run"]
        log(f"frames {r['frames']}: frame time p50 {r['frame_ms_p50']} ms, p99 "
            f"{r['frame_ms_p99']} ms; missed {r['missed_frames_72hz']} at 72 Hz, "
            f"{r['missed_frames_90hz']} at 90 Hz, {r['skipped_slots']} slots skipped; model "
            f"{r['model_gpu_ms_per_frame_p50']} ms GPU per frame (timestamps), train latency "
            f"p50 {r.get('train_latency_ms_p50')} ms; {r.get('train_steps', 0)} training steps, "
            f"{len(run_log.predictions)} predictions (from {r['prediction_from']}: latency p50 "
            f"{r['prediction_latency_ms_p50']} ms, p99 {r['prediction_latency_ms_p99']} ms, "
            f"{r['prediction_latency_frames_p50']} frames), {r['dropped_samples']} samples "
            "dropped")
        for k, v in metrics["outputs"].items():
            log(f"  {k:>8}: {v}")
        return metrics
    finally:
        if demo is not None:
            demo.close()
        if load is not None:
            load.close()
        if renderer is not None:
            renderer.close()
        host.close()

