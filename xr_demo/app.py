"""The demo's core, shared by the three modes: the depth network's two vkml sessions on the
host's device and queue, the live-learning loop around the host's frames, and its metrics.

Per frame, a mode calls, in this order:
  begin_frame(n)      harvest finished model work (prediction, loss, parameters), start new steps
  ... the host records and submits its render (under host.queue_lock) ...
  fill(n)             the model's pieces that fit this frame's slack go to the same queue
  ... the host waits for its frame, presents ...
  end_frame(n, ...)   the frame's image and true depth (read back by the renderer) become the
                      next inference input and, every `train_every` frames, a training sample

With `zero_copy` (the default) the frames reach the model without the CPU
(session.bind_input: the copy and the conversion run in the step's first piece, on the same
queue): the inference reads the renderer's colour target, so it sees the frame rendered last
before its first piece; the trainer reads two sample images that the host fills on the GPU
with the frame it was given (xr_demo/samples.py), so it trains on the same frames as with
set_input whatever the schedule; the prediction lands in an r32_float image (bind_output) a
renderer can sample. The renderer's read-back then serves the metrics only (the live AbsRel
and the pictures need the frame on the host).

Two sessions: a training session (MSE, Adam; decoder only or the whole network) and an
inference session (forward only) that draws the prediction, compiled with
`share_params_with=` the training session: it reads the trainer's parameters in place, so
nothing is copied after a step. An inference starts only while the trainer is not part-way
through its updates (`train.updating`), so every prediction sees one consistent set of
weights: those of the last update fully submitted before it.

Nothing in the frame loop blocks on vkml: results are read once their own session's timeline
value is reached (`done()` is per session), set_input never waits for the step in flight, and
latencies are taken by one waiter thread per job.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import vulkan as vk
from safetensors.numpy import load_file

import vkml
from vkml.models import dinov2
from xr_demo import model as net
from xr_demo.panel import clear_prediction
from xr_demo.renderer import SceneRenderer, create_image, destroy_image
from xr_demo.samples import SampleRing
from xr_demo.scene import FAR, desktop_camera
from xr_demo.schedule import Job, Policy, Scheduler
from xr_demo.vkhost import VulkanHost

ORBIT_FRAMES = 2880  # one turn of the camera rig (40 s at 72 Hz)
EVAL_FRAMES = (101, 917, 1733, 2549)  # fixed views for the held-out depth error
RECENT_FRAMES = 256  # zero_copy: frames kept on the host for the metrics of the inference


WARM_S = 0.6  # seconds of GPU work before a measurement (Demo.warm_gpu)

@dataclass
class Options:
    mode: str = "headless"
    model: str = "small"  # small | vits14 (xr_demo/model.py)
    resolution: int = 64  # the model's input and output size (vits14: a multiple of 14)
    encoder_weights: str | None = None  # vits14: a Dinov2Model safetensors file
    precision: str = "f32"  # f32 | f16 | bf16 (vkml.compile's precision)
    frames: int = 900
    hz: float = 72.0  # the frame rate the loop is paced at (0: as fast as it goes)
    train_every: int = 1  # a training sample every N frames (0: no training)
    infer_every: int = 6  # an inference on the latest frame every k frames (0: none)
    schedule: str = "slack"  # slack | chunks:N | budget:MS
    live: str = "decoder"  # what learns live: the decoder (encoder frozen) or all
    lr: float = 2e-3
    checkpoint: str | None = None  # safetensors to start from
    fresh_decoder: bool = False  # with a checkpoint: keep its encoder only
    save: str | None = None  # safetensors written at the end (session.save)
    seed: int = 0
    out: str = "out/xr_demo"
    max_pending: int = 1  # training samples waiting for the trainer (older ones are dropped)
    camera: str = "orbit"  # orbit (the moving camera) | random (views from all of the orbit)
    margin_ms: float = 1.0  # the frame's time kept free of model work
    compare: bool = False  # headless: also 1/2/4 chunks, budget and slack, training alone
    compare_frames: int = 72
    evaluate: bool = True  # held-out depth error at the start and the end
    xr_size: int = 256  # XR: swapchain image size per eye
    window_scale: int = 4  # window: screen pixels per model pixel
    screenshot: str | None = None  # window: grab the X screen into this PNG before closing
    zero_copy: bool = True  # frames in and the prediction out through GPU memory (bind_input)
    # the prediction is the training step's own forward pass (before its update) on the frame
    # it trains on: one encoder pass a frame, no inference job (needs train_every 1)
    predict_in_training: bool = False
    load_ms: float = 0.0  # headless: a synthetic render load (xr_demo/loadgen.py) of this GPU ms
    load_size: int = 512  # its image's size


@dataclass
class FrameStat:
    frame: int
    t: float  # seconds since the loop started
    frame_ms: float  # render submit -> its fence, host clock
    render_gpu_ms: float | None
    pieces: int
    model_cost_ms: float  # the submitted pieces' profiled GPU time
    model_gpu_ms: float | None  # timestamps around the model's submissions, where plausible
    skipped: int  # frame slots the loop fell behind by
    # The frame loop's own time in this frame (Python, recording, submits), the fence wait
    # and the pacing sleep excluded: wall time, and the main thread's CPU time (on a CPU
    # driver the wall time also holds the driver's threads running the GPU work beside it).
    host_ms: float | None = None
    host_cpu_ms: float | None = None


@dataclass
class Prediction:
    frame: int  # the frame whose image it saw
    t: float
    train_steps: int  # training steps whose updates were all submitted before it began
    image: np.ndarray  # (R, R, 3) uint8
    true_depth: np.ndarray  # metres
    depth: np.ndarray  # metres
    abs_rel: float


@dataclass
class RunLog:
    frames: list[FrameStat] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    losses: list[tuple[int, int, float]] = field(default_factory=list)  # step, frame, loss
    dropped_samples: int = 0
    eval_start: float | None = None
    eval_end: float | None = None


def to_input(rgb: np.ndarray, mean: Any = 0.5, std: Any = 0.25) -> np.ndarray:
    """(H, W, 3) uint8 -> (1, 3, H, W) float32, normalised by `mean` and `std` (numbers or
    one per channel)."""
    x = (rgb.astype(np.float32) / 255.0 - np.float32(mean)) / np.float32(std)
    return x.astype(np.float32).transpose(2, 0, 1)[None].copy()


def to_target(depth_m: np.ndarray) -> np.ndarray:
    return np.clip(depth_m / FAR, 0.0, 1.0).astype(np.float32)[None, None]


def abs_rel(pred_m: np.ndarray, true_m: np.ndarray) -> float:
    """Mean absolute relative depth error over all pixels (the usual AbsRel)."""
    return float(np.mean(np.abs(pred_m - true_m) / np.maximum(true_m, 1e-3)))


def weights_problem(model: str, path: str) -> str | None:
    """What is wrong with --encoder-weights `path` for `model` before it is read, if anything."""
    if model != "vits14":
        return f"--encoder-weights {path}: the {model!r} model has no DINOv2 encoder; add " \
               "--model vits14"
    if not path.endswith((".safetensors", ".onnx")):
        return (f"--encoder-weights {path}: give a .safetensors file of a Dinov2Model state "
                "dict (e.g. safetensors.torch.save_file(Dinov2Model.from_pretrained("
                "'facebook/dinov2-small').state_dict(), path)) or an .onnx export of "
                "Dinov2Backbone (see README)")
    if not os.path.isfile(path):
        return f"--encoder-weights {path}: no such file"
    return None


def camera_frame(opts: Options, n: int) -> int:
    """Which frame of the camera path loop frame n shows."""
    if opts.camera == "random":
        return int(np.random.default_rng((opts.seed, n)).integers(ORBIT_FRAMES))
    return n


def pct(values: list[float], p: float) -> float | None:
    v = sorted(x for x in values if x is not None and math.isfinite(x))
    if not v:
        return None
    return round(v[min(len(v) - 1, int(p / 100 * len(v)))], 3)


class ModelTimer:
    """GPU time of the model's work in a frame, from timestamps the host submits around its
    pieces: a window before the frame's render (continuing steps) and one after it (new
    steps), two stamps each (a tiny command buffer per stamp, recorded once; a BOTTOM_OF_PIPE
    stamp is written once everything submitted before it has finished). Read a frame or more
    later, when the fence after the frame's last stamp has signalled; None when not available
    or implausible."""

    WINDOWS = 2

    def __init__(self, host: VulkanHost) -> None:
        self.host = host
        d = host.device
        n = 2 * self.WINDOWS
        self.pool = vk.vkCreateQueryPool(d, vk.VkQueryPoolCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=n), None)
        self.cbs = host.command_buffers(n)
        for i, cb in enumerate(self.cbs):
            vk.vkBeginCommandBuffer(cb, vk.VkCommandBufferBeginInfo(
                sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO))
            vk.vkCmdResetQueryPool(cb, self.pool, i, 1)
            vk.vkCmdWriteTimestamp(cb, vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT, self.pool, i)
            vk.vkEndCommandBuffer(cb)
        self.fence = host.fence(signaled=True)
        self._pending = False  # a frame's stamps are in flight
        self.frame = -1  # the frame they time
        self._used: list[int] = []  # windows stamped this frame
        self._stamps = vk.ffi.new(f"uint64_t[{n}]")

    @property
    def usable(self) -> bool:
        return bool(self.host.timestamp_bits) and self.host.timestamp_period > 0

    def new_frame(self) -> bool:
        """Whether this frame can be timed (the previous frame's stamps were read)."""
        if not self.usable or self._pending:
            return False
        self._used = []
        return True

    def open(self, window: int) -> None:
        if not self._used:  # the frame's first stamp: the fence will go with its last
            vk.vkResetFences(self.host.device, 1, [self.fence])
        self.host.submit(self.cbs[2 * window])

    def close_window(self, window: int, last: bool) -> None:
        self.host.submit(self.cbs[2 * window + 1], self.fence if last else None)
        self._used.append(window)
        self._pending = self._pending or last

    def read(self) -> float | None:
        """The timed frame's model GPU ms, if its fence has signalled (non-blocking)."""
        if not self._pending:
            return None
        if vk.lib.vkGetFenceStatus(self.host.device, self.fence) != vk.VK_SUCCESS:
            return None
        self._pending = False
        ticks = 0
        for w in self._used:  # only the windows stamped (the others were never reset)
            result = vk.lib.vkGetQueryPoolResults(self.host.device, self.pool, 2 * w, 2, 16,
                                                  self._stamps, 8, vk.VK_QUERY_RESULT_64_BIT)
            if result != vk.VK_SUCCESS:
                return None
            ticks += self._stamps[1] - self._stamps[0]
        ms = ticks * self.host.timestamp_period / 1e6
        return ms if 0 <= ms < 10_000 else None

    def close(self) -> None:
        if self._pending:
            vk.vkWaitForFences(self.host.device, 1, [self.fence], vk.VK_TRUE, 60 * 10**9)
        vk.vkDestroyFence(self.host.device, self.fence, None)
        vk.vkFreeCommandBuffers(self.host.device, self.host.pool, len(self.cbs), self.cbs)
        vk.vkDestroyQueryPool(self.host.device, self.pool, None)


class Demo:
    """The model side of the demo, living in the host's frame loop."""

    def __init__(self, host: VulkanHost, opts: Options, renderer: SceneRenderer,
                 log: Callable[[str], None] = print) -> None:
        self.host, self.opts, self.renderer, self.log = host, opts, renderer, log
        if opts.predict_in_training and opts.train_every != 1:
            raise ValueError("predict_in_training draws every training step's prediction: "
                             f"it needs a training step every frame (train_every 1, got "
                             f"{opts.train_every})")
        encoder, self.encoder_source = self._encoder_weights()
        onnx = opts.encoder_weights if self.encoder_source.endswith(".onnx") else None
        self.cfg = net.config(opts.model, opts.resolution, net.checked_vits14(
            encoder, self.encoder_source) if encoder else None, onnx)
        if renderer.width != opts.resolution or renderer.height != opts.resolution:
            raise ValueError("the model's renderer must draw at the model's resolution")
        self.device = host.vkml_device()
        t0 = time.perf_counter()
        self.train: vkml.Session | None = None
        if opts.train_every > 0:
            b = net.build(self.cfg, train=True, live=opts.live, seed=opts.seed)
            # decoder live: everything else frozen (an imported encoder's parameters too)
            trainable = None if opts.live == "all" else (lambda n: n.startswith("decoder."))
            self.train = vkml.compile(b.graph, loss=b.loss, optimizer=vkml.Adam(lr=opts.lr),
                                      device=self.device, precision=opts.precision,
                                      trainable=trainable)
        # The inference session's parameters are the trainer's own memory.
        self.infer = vkml.compile(net.build(self.cfg, train=False, seed=opts.seed).graph,
                                  device=self.device, share_params_with=self.train,
                                  precision=opts.precision)
        self.compile_s = time.perf_counter() - t0
        # What learns live (the rest is frozen).
        self.live_params = [n for n in self.infer.plan.params
                            if opts.live == "all" or n.startswith("decoder.")]
        owner = self.train if self.train is not None else self.infer
        for name, value in (encoder or {}).items():
            owner.set_param("encoder." + name, value)
        if opts.checkpoint:  # after the encoder weights: the checkpoint has the last word
            self._load(opts.checkpoint, opts.fresh_decoder)
            self.encoder_source = os.path.abspath(opts.checkpoint)
        self.counts = self._count_params()
        log(f"model {self.cfg.describe()}; parameters: encoder {self.counts['encoder']:,}, "
            f"decoder {self.counts['decoder']:,}, learning live {self.counts['live']:,} "
            f"({opts.live}); encoder weights: {self.encoder_source}; precision {opts.precision}")
        self.run = RunLog()
        self.samples: deque[tuple[int, np.ndarray, np.ndarray]] = deque()
        self.latest: tuple[int, np.ndarray, np.ndarray] | None = None
        self._infer_input: tuple[int, np.ndarray, np.ndarray] | None = None
        # zero_copy: the frame the inference in flight reads (known once its first piece is
        # submitted), and the recent frames' read-backs, for the metrics
        self._infer_frame: int | None = None
        self._recent: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._infer_harvested = True
        self._infer_due = False  # an inference frame came and its inference has not started
        self._infer_train_steps = 0  # training steps the inference in flight sees
        self._train_harvested = True
        self._train_steps_done = 0
        self._train_sample: tuple[int, np.ndarray, np.ndarray] | None = None  # in training
        self._sync_cb = host.command_buffers(1)[0]
        self._sync_fence = host.fence()
        self.timer = ModelTimer(host)
        self.jobs: list[Job] = []
        self.scheduler = Scheduler([])
        self.slack_ms = 0.0
        self.render_ms = 0.0
        self._t0 = time.perf_counter()
        self._frame_use: Any = None
        self._timed = False
        self._query_reads_wait_for_queue = host.device_name.startswith("llvmpipe")
        self.period_ms = 0.0
        self._last_slot = 0
        self.drawable: Any = None  # zero_copy: the r32_float image the prediction lands in
        self.ring: SampleRing | None = None  # zero_copy: the training samples, on the GPU
        # zero_copy: called with the frame a prediction saw once it is in self.drawable and
        # before another step can overwrite it (XR copies it to the eye that frame showed)
        self.on_prediction: Callable[[int], None] | None = None
        self._sample_slots: deque[int] = deque()  # their slots, beside self.samples
        self._samples_taken = 0
        if opts.zero_copy:
            self._bind()

    def _bind(self) -> None:
        """Bind the renderer's targets as the sessions' inputs (with to_input's and
        to_target's arithmetic) and an r32_float image as the prediction."""
        r, host = self.opts.resolution, self.host
        usage = vk.VK_IMAGE_USAGE_COLOR_ATTACHMENT_BIT | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT
        after_render = vk.VK_IMAGE_LAYOUT_TRANSFER_SRC_OPTIMAL  # where record() leaves them
        colour = vkml.HostImage(self.renderer.color.image, host.device, "rgba8_unorm", (r, r),
                                usage, after_render)
        mean, std = self.cfg.normalisation
        self.infer.bind_input("image", colour, mean=mean, std=std)
        if self.train is not None:
            self.ring = ring = SampleRing(host, self.renderer, self.opts.max_pending + 1)
            samples = vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT | vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT
            general = vk.VK_IMAGE_LAYOUT_GENERAL
            self.train.bind_input("image", vkml.HostImage(
                ring.colour.image, host.device, "rgba8_unorm", (r, r), samples, general),
                mean=mean, std=std)
            self.train.bind_input("target", vkml.HostImage(
                ring.depth.image, host.device, "r32_float", (r, r), samples, general),
                mean=0.0, std=FAR)
        drawn = (vk.VK_IMAGE_USAGE_TRANSFER_DST_BIT | vk.VK_IMAGE_USAGE_SAMPLED_BIT
                 | vk.VK_IMAGE_USAGE_TRANSFER_SRC_BIT)
        self.drawable = create_image(host, r, r, vk.VK_FORMAT_R32_SFLOAT, drawn)
        readable = vk.VK_IMAGE_LAYOUT_SHADER_READ_ONLY_OPTIMAL
        self._run_now(lambda cb: clear_prediction(cb, self.drawable.image))
        predicting = self.train if self.opts.predict_in_training else self.infer
        predicting.bind_output("depth", vkml.HostImage(  # type: ignore[union-attr]
            self.drawable.image, host.device, "r32_float", (r, r), drawn, readable))

    # ---- weights ----------------------------------------------------------------------------
    def _encoder_weights(self) -> tuple[dict[str, np.ndarray] | None, str]:
        """The --encoder-weights safetensors file's tensors under Dinov2Model's names (None
        for an ONNX file, which the graph is imported from), and where the encoder's weights
        come from (for the log and the metrics)."""
        path = self.opts.encoder_weights
        if not path:
            return None, f"seeded (seed {self.opts.seed})"
        problem = weights_problem(self.opts.model, path)
        if problem:
            raise net.WeightsError(problem)
        if path.endswith(".onnx"):
            return None, os.path.abspath(path)
        return dinov2.state_dict_names(load_file(path)), os.path.abspath(path)

    def _count_params(self) -> dict[str, int]:
        sizes = {n: int(v.size) for n, v in self.infer.params().items()}
        return {"encoder": sum(v for n, v in sizes.items() if not n.startswith("decoder.")),
                "decoder": sum(v for n, v in sizes.items() if n.startswith("decoder.")),
                "live": sum(sizes[n] for n in self.live_params)}

    def to_input(self, rgb: np.ndarray) -> np.ndarray:
        return to_input(rgb, *self.cfg.normalisation)

    def _load(self, path: str, fresh_decoder: bool) -> None:
        # The inference session shares the trainer's parameters: load into the owner only.
        owner = self.train if self.train is not None else self.infer
        if fresh_decoder:
            # The encoder only (as DinoVision's frozen backbone); the decoder keeps its fresh
            # initialisation and learns live.
            tensors = load_file(path)
            enc = {k: v for k, v in tensors.items() if k.startswith("encoder.")}
            if not enc:
                raise ValueError(f"{path} has no encoder.* tensors")
            for k, v in enc.items():
                owner.set_param(k, v)
            self.log(f"loaded the encoder ({len(enc)} tensors) from {path}; fresh decoder")
            return
        owner.load(path)
        self.log(f"loaded {path}")

    def save(self, path: str) -> None:
        session = self.train if self.train is not None else self.infer
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        session.save(path)
        self.log(f"wrote checkpoint {path} ({os.path.getsize(path) / 1e6:.2f} MB)")

    # ---- set-up -----------------------------------------------------------------------------
    def _run_now(self, record: Callable[[Any], Any]) -> None:
        """Record with `record(cb)`, submit and wait (outside the frame loop)."""
        self.host.run_now(self._sync_cb, self._sync_fence, record)

    def render_now(self, frame: int) -> tuple[np.ndarray, np.ndarray]:
        """Render a camera frame synchronously (outside the frame loop: evaluation, warm-up);
        with zero_copy it stays in the renderer's targets, which the next step reads."""
        self._run_now(lambda cb: self.renderer.record(cb, desktop_camera(frame), frame / 72.0,
                                                      timestamps=False))
        return self.renderer.read()

    def predict_now(self, rgb: np.ndarray) -> np.ndarray:
        """The prediction for `rgb`, the frame render_now() drew last."""
        if not self.opts.zero_copy:
            self.infer.set_input("image", self.to_input(rgb))
        self.infer.step()
        return self.infer.read("depth")[0, 0] * FAR

    def evaluate(self) -> float:
        """AbsRel over the fixed evaluation views (blocking)."""
        errors = []
        for f in EVAL_FRAMES:
            rgb, depth = self.render_now(f)
            errors.append(abs_rel(self.predict_now(rgb), depth))
        return float(np.mean(errors))

    def warm_gpu(self, seconds: float = WARM_S) -> None:
        """Keep the GPU busy for `seconds` (the inference session, back to back) so its clock is
        up before anything is measured: a GPU left idle through the compile runs at its lowest
        clock for a while (on the H200 345 against 1980 MHz, a session's first 0.15-0.4 s of
        steps 3-4x slower: tools/clock_lab.py), and a schedule planned from those times would
        cut the steps for a slower device. CPU drivers have no such state: one step there."""
        rgb, _ = self.render_now(0)  # what the inference reads: zero-copy binds the target
        if not self.opts.zero_copy:
            self.infer.set_input("image", self.to_input(rgb))
        self._keep_busy(seconds)

    def _keep_busy(self, seconds: float) -> None:
        """Inference steps back to back for `seconds` (one on a CPU driver), on whatever input
        the session has."""
        end = time.perf_counter() + (0.0 if self.device.caps.device_type == "cpu" else seconds)
        while True:
            self.infer.step()
            self.infer.wait()
            if time.perf_counter() >= end:
                break

    def prepare(self, period_ms: float, render_ms: float) -> dict[str, Any]:
        """Measure each session's dispatches (profile) and build the jobs for a frame of
        `period_ms` whose render takes `render_ms` (measured by the mode)."""
        info: dict[str, Any] = {}
        rgb, depth = self.render_now(0)
        sessions = [("infer", self.infer)]
        if self.train is not None:
            sessions.append(("train", self.train))
        if self.ring is not None:  # the profiled steps' sample: this frame
            self.ring.capture(0)
            self.ring.release(0)
        if not self.opts.zero_copy:
            self.infer.set_input("image", self.to_input(rgb))
            if self.train is not None:
                self.train.set_input("image", self.to_input(rgb))
                self.train.set_input("target", to_target(depth))
        self._keep_busy(WARM_S)  # warm_gpu without its render: frame 0 is in place above
        for name, s in sessions:
            # update=False: the profiled steps leave the training session's state as it was,
            # so the run does not depend on them. The first one warms the driver up.
            s.profile(steps=1, update=False)
            prof = s.profile(steps=2, update=False)
            info[name] = {"dispatches": len(s.plan.dispatches),
                          "levels": len({d.level for d in s.plan.dispatches}),
                          "step_wall_ms": round(statistics.median(prof.host_step_ms), 3),
                          "step_gpu_ms": round(sum(prof.dispatch_ms), 3),
                          "timing": prof.source + (f" ({prof.note})" if prof.note else "")}
        self.render_ms = render_ms
        self.period_ms = period_ms
        self.slack_ms = max(0.0, period_ms - render_ms - self.opts.margin_ms) if period_ms else \
            float("inf")
        policy = Policy.parse(self.opts.schedule).within(self.slack_ms)
        self.jobs = []
        if self.opts.infer_every > 0 and not self.opts.predict_in_training:
            self.jobs.append(Job("infer", self.infer, self.host,
                                 policy if policy.kind == "slack" else Policy("chunks", 1)))
        if self.train is not None:
            self.jobs.append(Job("train", self.train, self.host, policy))
        self.scheduler = Scheduler(self.jobs)
        for job in self.jobs:
            info[job.name]["pieces"] = len(job.costs)
            info[job.name]["piece_ms_max"] = round(max(job.costs), 3)
            info[job.name]["level_ms_max"] = round(job.level_ms_max, 3)
            info[job.name]["levels_cut"] = job.levels_cut
            info[job.name]["policy"] = str(job.policy)
        info["slack_ms"] = round(self.slack_ms, 3) if math.isfinite(self.slack_ms) else None
        info["render_ms"] = round(render_ms, 3)
        # Everything made so far lives as long as the loop: out of the collector's sight, a
        # full collection in a frame (tens of ms with numpy, cffi and matplotlib loaded)
        # costs only what the loop itself allocates.
        gc.collect()
        gc.freeze()
        self._t0 = time.perf_counter()
        return info

    def job(self, name: str) -> Job | None:
        return next((j for j in self.jobs if j.name == name), None)

    @property
    def predictions_begun(self) -> int:
        """Steps begun so far of the job whose output is the prediction."""
        job = self.job("train" if self.opts.predict_in_training else "infer")
        return job.steps_started if job is not None else 0

    # ---- the frame loop -----------------------------------------------------------------------
    def queries_readable(self) -> bool:
        """Whether reading timestamp queries now would not stall the frame loop. Mesa's
        lavapipe (22.3) waits in vkGetQueryPoolResults for its whole queue to go idle
        (measured: 100-150 ms behind a training step), so there they are read only when
        vkml's work has drained; other drivers return at once."""
        return not self._query_reads_wait_for_queue or self._drained()


    def _drained(self) -> bool:
        """All of vkml's submitted work has finished (non-blocking): each session's own
        timeline value is reached."""
        for session in filter(None, (self.infer, self.train)):
            semaphore, last = session.done()
            if self.host.timeline_value(semaphore) < last:
                return False
        return True

    def begin_frame(self, n: int, start_inference: bool = True) -> None:
        """Harvest finished model work and start new steps (before the frame's render).
        Nothing here blocks: a result is read once its own session's step has finished (a
        read waits for that session only, never for the other one's pieces queued after)."""
        infer, train = self.job("infer"), self.job("train")
        self._read_timer()  # before new work is queued: the best moment on lavapipe
        if infer is not None and not self._infer_harvested and not infer.busy:
            self._harvest_prediction()
            if self.on_prediction is not None and self._infer_frame is not None:
                self.on_prediction(self._infer_frame)
        if train is not None and not self._train_harvested and not train.busy:
            loss = float(self.train.read("loss"))  # type: ignore[union-attr]
            if self.opts.predict_in_training:
                self._record_prediction(*self._train_sample, self.train,  # type: ignore[arg-type]
                                        self._train_steps_done)
                if self.on_prediction is not None:
                    self.on_prediction(self._train_sample[0])  # type: ignore[index]
            self._train_steps_done += 1
            self.run.losses.append((self._train_steps_done, n, loss))
            self._train_harvested = True
        # An inference reads the trainer's parameters in place: it may not start while the
        # trainer is part-way through its updates (it would see some layers updated, others
        # not); a due one starts at the first frame where the updates are all submitted (on
        # an inference frame alone, a trainer that is always busy could starve it).
        updating = self.train is not None and self.train.updating
        self._infer_due = infer is not None and start_inference and (
            self._infer_due or n % self.opts.infer_every == 0)
        if infer is not None and self._infer_due and self._infer_harvested and \
                not infer.busy and self.latest is not None and not updating:
            self._infer_train_steps = train.steps_submitted if train is not None else 0
            if self.opts.zero_copy:
                self._infer_input, self._infer_frame = None, None
            else:
                self._infer_input = self.latest
                self.infer.set_input("image", self.to_input(self.latest[1]))
            self._infer_harvested = False
            self._infer_due = False
            infer.begin(n)
        if train is not None and self._train_harvested and not train.busy and self.samples:
            self._train_sample = self.samples.popleft()
            _, rgb, depth = self._train_sample
            if self.ring is not None:  # its frame into the images the trainer reads
                self.ring.release(self._sample_slots.popleft())
            else:
                self.train.set_input("image", self.to_input(rgb))  # type: ignore[union-attr]
                self.train.set_input("target", to_target(depth))  # type: ignore[union-attr]
            self._train_harvested = False
            train.begin(n)

    def _harvest_prediction(self) -> None:
        self._infer_harvested = True
        if self.opts.zero_copy:  # the frame it read, if still kept (the first may not be)
            seen = self._recent.get(self._infer_frame if self._infer_frame is not None else -1)
            if seen is None:
                return
            self._infer_input = (self._infer_frame, *seen)  # type: ignore[assignment]
        assert self._infer_input is not None
        self._record_prediction(*self._infer_input, self.infer, self._infer_train_steps)

    def _record_prediction(self, frame: int, rgb: np.ndarray, depth: np.ndarray,
                           session: vkml.Session, train_steps: int) -> None:
        pred = session.read("depth")[0, 0] * FAR
        self.run.predictions.append(Prediction(
            frame, time.perf_counter() - self._t0, train_steps, rgb, depth, pred,
            abs_rel(pred, depth)))

    def fill_before_render(self, n: int) -> None:
        """Before the frame's render is submitted: pieces of steps begun in an earlier frame,
        so that they run right after that frame's pieces, contiguous on the GPU (a step split
        across the frame boundary finishes as soon as it would have whole)."""
        self._timed = self.timer.new_frame()
        self._frame_use = self.scheduler.new_frame()
        if self._timed and self.scheduler.wants("before"):
            self.timer.open(0)
            self.scheduler.fill(n, self.slack_ms, "before")
            self.timer.close_window(0, last=False)
        self._note_inference_frame(n - 1)  # a first piece here reads the frame before this

    def _note_inference_frame(self, rendered: int) -> None:
        """zero_copy: once the inference's first piece is submitted, the frame it reads is the
        one rendered last before it on the queue."""
        infer = self.job("infer")
        if self.opts.zero_copy and infer is not None and not self._infer_harvested and \
                self._infer_frame is None and infer.steps_started and \
                (infer.started or not infer.pieces_left):
            self._infer_frame = rendered

    def fill(self, n: int) -> None:
        """After the frame's render is submitted: new steps' pieces, in what is left of the
        frame's slack."""
        if self._frame_use is None:
            self._frame_use = self.scheduler.new_frame()
            self._timed = self.timer.new_frame()
        try:
            self._fill_after(n)
        finally:
            self._note_inference_frame(n)

    def _fill_after(self, n: int) -> None:
        if not self._timed:
            self.scheduler.fill(n, self.slack_ms, "after")
            return
        if self.scheduler.wants("after"):
            self.timer.open(1)
            self.scheduler.fill(n, self.slack_ms, "after")
            self.timer.close_window(1, last=True)
            self.timer.frame = n
        elif self.timer._used:  # only the window before the render: an empty pair after it
            self.timer.open(1)  # (about 0 ms) carries the frame's fence
            self.timer.close_window(1, last=True)
            self.timer.frame = n

    def end_frame(self, n: int, rgb: np.ndarray, depth: np.ndarray, frame_ms: float,
                  render_gpu_ms: float | None, skipped: int = 0,
                  host_ms: float | None = None, host_cpu_ms: float | None = None) -> None:
        """After the frame's fence: its image becomes the latest input and maybe a sample."""
        self.latest = (n, rgb, depth)
        if self.opts.zero_copy:
            self._recent[n] = (rgb, depth)
            self._recent.pop(n - RECENT_FRAMES, None)
        if self.train is not None and n % self.opts.train_every == 0:
            self.samples.append((n, rgb, depth))
            if self.ring is not None:  # the frame just rendered, kept on the GPU
                slot = self._samples_taken % self.ring.size
                self.ring.capture(slot)
                self._sample_slots.append(slot)
            self._samples_taken += 1
            while len(self.samples) > self.opts.max_pending:
                self.samples.popleft()
                if self.ring is not None:
                    self._sample_slots.popleft()
                self.run.dropped_samples += 1
        use = self._frame_use
        self.scheduler.observe(frame_ms, self.period_ms, self.opts.margin_ms)
        self.run.frames.append(FrameStat(
            n, time.perf_counter() - self._t0, frame_ms, render_gpu_ms,
            use.pieces if use else 0, use.cost_ms if use else 0.0, None, skipped, host_ms,
            host_cpu_ms))
        self._frame_use = None
        self._read_timer()

    def _read_timer(self) -> None:
        """The model's GPU time of the last timed frame, once readable (non-blocking), into
        that frame's record (a frame or more later where reads wait for the queue)."""
        if not self.queries_readable():
            return
        ms = self.timer.read()
        if ms is None:
            return
        for stat in reversed(self.run.frames):
            if stat.frame == self.timer.frame:
                stat.model_gpu_ms = ms
                return
            if stat.frame < self.timer.frame:
                return

    def finish(self) -> None:
        """After the last frame: train on the samples still waiting, harvest everything."""
        n = self.run.frames[-1].frame + 1 if self.run.frames else 0
        while True:
            self._finish_jobs()
            # an inference begun but not yet submitted when the loop ended reads the last frame
            # rendered: noted, so its prediction (the one left drawn) is recorded and shown
            self._note_inference_frame(n - 1)
            self.begin_frame(n, start_inference=False)
            if not any(j.pieces_left for j in self.jobs) and not self.samples and \
                    self._train_harvested and self._infer_harvested:
                break
            n += 1

    # ---- results ----------------------------------------------------------------------------
    def metrics(self, period_ms: float) -> dict[str, Any]:
        frames = self.run.frames
        ft = [f.frame_ms for f in frames]
        result: dict[str, Any] = {
            "frames": len(frames),
            "frame_ms_p50": pct(ft, 50), "frame_ms_p99": pct(ft, 99),
            "missed_frames_72hz": sum(f > 1000 / 72 for f in ft),
            "missed_frames_90hz": sum(f > 1000 / 90 for f in ft),
            # frame slots the paced loop fell behind by (its host work or a blocking call was
            # late): a missed frame too, which the frame time above does not see
            "skipped_slots": sum(f.skipped for f in frames),
            # the frame loop's host time (Python, recording, submits; the fence wait and the
            # pacing sleep excluded): what a fast GPU leaves as the limit
            "host_cpu_ms_per_frame_p50": pct([f.host_cpu_ms for f in frames], 50),
            "host_cpu_ms_per_frame_p99": pct([f.host_cpu_ms for f in frames], 99),
            "host_ms_per_frame_p50": pct([f.host_ms for f in frames], 50),
            "host_ms_per_frame_p99": pct([f.host_ms for f in frames], 99),
            "host_ms_per_frame_max": pct([f.host_ms for f in frames], 100),
            "render_gpu_ms_p50": pct([f.render_gpu_ms for f in frames], 50),
            "model_pieces_per_frame_mean": round(statistics.mean(
                [f.pieces for f in frames]), 3) if frames else None,
            "model_cost_ms_per_frame_p50": pct([f.model_cost_ms for f in frames
                                                if f.pieces], 50),
            "model_gpu_ms_per_frame_p50": pct([f.model_gpu_ms for f in frames
                                               if f.model_gpu_ms is not None], 50),
            "model_gpu_ms_frames_timed": sum(f.model_gpu_ms is not None for f in frames),
            "dropped_samples": self.run.dropped_samples,
            "cost_scale_final": round(self.scheduler.scale, 3),
            "cost_scale_max": round(self.scheduler.scale_max, 3),
        }
        for job in self.jobs:
            lat = job.latencies()
            result[f"{job.name}_steps"] = len(lat)
            result[f"{job.name}_latency_ms_p50"] = pct(lat, 50)
            result[f"{job.name}_latency_ms_p99"] = pct(lat, 99)
            if period_ms:
                p50 = pct(lat, 50)
                result[f"{job.name}_latency_frames_p50"] = (round(p50 / period_ms, 2)
                                                            if p50 is not None else None)
            frames_spanned = [r.frames for r in job.records]
            result[f"{job.name}_frames_per_step_p50"] = pct(frames_spanned, 50)
        # frame to prediction: the job whose step draws it (first piece submitted -> done)
        source = "train" if self.opts.predict_in_training else "infer"
        result["prediction_from"] = source
        for key in ("latency_ms_p50", "latency_ms_p99", "latency_frames_p50"):
            result[f"prediction_{key}"] = result.get(f"{source}_{key}")
        return result

    def _finish_jobs(self, close: bool = False) -> None:
        """Submit the rest of every step in progress. A step that has begun submitting goes
        first: while the inference is part-way, the trainer's updates must wait for it, and
        an inference not yet started must wait for the trainer's updates."""
        for job in sorted(self.jobs, key=lambda j: not j.started):
            if close:
                job.close()
            else:
                job.finish()

    def close(self) -> None:
        gc.unfreeze()  # what prepare() froze may be collected again
        self._finish_jobs(close=True)
        self.timer.close()
        vk.vkDestroyFence(self.host.device, self._sync_fence, None)
        vk.vkFreeCommandBuffers(self.host.device, self.host.pool, 1, [self._sync_cb])
        for s in filter(None, (self.train, self.infer)):
            s.close()
        self.device.close()
        if self.drawable is not None:
            destroy_image(self.host, self.drawable)
        if self.ring is not None:
            self.ring.close()
