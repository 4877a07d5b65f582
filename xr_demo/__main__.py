"""python -m xr_demo [--headless | --window | --xr] [options]: the host application, a depth
network learning live between its frames. See README's "The demo" section."""

from __future__ import annotations

import argparse
import sys

from xr_demo.app import Options, weights_problem
from xr_demo.model import DEFAULT_RESOLUTION, LIVE_MODES, MODELS, WeightsError, config
from xr_demo.vkhost import HostError


def parse(argv: list[str] | None = None) -> Options:
    d = Options()
    ap = argparse.ArgumentParser(prog="python -m xr_demo", description=" ".join(__doc__.split()))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--headless", dest="mode", action="store_const", const="headless",
                      help="offscreen; writes pictures, a plot and metrics (the default)")
    mode.add_argument("--window", dest="mode", action="store_const", const="window",
                      help="a GLFW window with a Vulkan swapchain")
    mode.add_argument("--xr", dest="mode", action="store_const", const="xr",
                      help="OpenXR (pyopenxr, XR_KHR_vulkan_enable2), stereo")
    ap.add_argument("--model", choices=MODELS, default=d.model,
                    help="the depth network: small (a small ViT and decoder, the default: quick "
                    "on a CPU driver) or vits14 (DINOv2-small's ViT-S/14 encoder, frozen, and a "
                    "DPT-style decoder learning live: a GPU's model)")
    ap.add_argument("--resolution", "--size", type=int,
                    help="the model's input and output size, square: small a multiple of 8 "
                    "(default 64), vits14 a multiple of 14 (default 224)")
    ap.add_argument("--encoder-weights", metavar="PATH",
                    help="vits14: the encoder's weights, a safetensors file of a transformers "
                    "Dinov2Model state dict (DINOv2-small's; either spelling of the names), or "
                    "the encoder itself, an ONNX export of Dinov2Backbone with four stages "
                    "(README); without it the encoder is seeded at random")
    ap.add_argument("--precision", choices=("f32", "f16", "bf16"), default=d.precision,
                    help="f16: matrix products in f16, on the device's cooperative matrices "
                    "(tensor cores) where it has them, else in f16 arithmetic where it has "
                    "shaderFloat16; bf16: on bfloat16 cooperative matrices where the device "
                    "has them (vkml.compile's precision)")
    ap.add_argument("--frames", type=int, default=d.frames)
    ap.add_argument("--hz", type=float, default=d.hz,
                    help="frame rate the headless and window loops are paced at (0: unpaced); "
                    "XR is paced by the runtime")
    ap.add_argument("--train-every", type=int, default=d.train_every,
                    help="a training sample every N frames (0: no training)")
    ap.add_argument("--infer-every", type=int, default=d.infer_every,
                    help="an inference on the latest frame every k frames (0: none)")
    ap.add_argument("--schedule", default=d.schedule,
                    help="slack (pieces by the frame's measured slack), chunks:N or "
                    "budget:MS (one piece per frame)")
    ap.add_argument("--chunks", type=int, help="shorthand for --schedule chunks:N")
    ap.add_argument("--budget", type=float, help="shorthand for --schedule budget:MS")
    ap.add_argument("--live", choices=LIVE_MODES, default=d.live,
                    help="what learns live: the decoder (encoder frozen) or the whole network")
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--checkpoint",
                    help="safetensors to start from (e.g. assets/depthnet64.safetensors)")
    ap.add_argument("--fresh-decoder", action="store_true",
                    help="with --checkpoint: load only its encoder; the decoder starts fresh")
    ap.add_argument("--save", help="write a safetensors checkpoint at the end")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out, help="output folder")
    ap.add_argument("--max-pending", type=int, default=d.max_pending,
                    help="training samples that may wait for the trainer (older are dropped)")
    ap.add_argument("--camera", choices=("orbit", "random"), default=d.camera)
    ap.add_argument("--margin-ms", type=float, default=d.margin_ms)
    ap.add_argument("--compare", action="store_true",
                    help="headless: also run 1/2/4 chunks, budget and slack, training alone")
    ap.add_argument("--compare-frames", type=int, default=d.compare_frames)
    ap.add_argument("--no-eval", dest="evaluate", action="store_false",
                    help="skip the held-out depth error at the start and the end")
    ap.add_argument("--xr-size", type=int, default=d.xr_size,
                    help="XR swapchain images' size per eye (capped by the runtime's maximum)")
    ap.add_argument("--window-scale", type=int, default=d.window_scale,
                    help="window: pixels per model pixel")
    ap.add_argument("--screenshot", help="window: save a screenshot of the X screen (PNG) "
                    "after the last frame")
    ap.add_argument("--set-input", dest="zero_copy", action="store_false",
                    help="frames reach the model through the host (read-back, set_input) "
                    "instead of GPU memory (bind_input, the default)")
    ap.add_argument("--predict-in-training", action="store_true",
                    help="the prediction drawn is each training step's own forward pass on its "
                    "frame (before the update): one encoder pass a frame, no inference job; "
                    "needs --train-every 1")
    ap.add_argument("--load-ms", type=float, default=d.load_ms,
                    help="headless: add a synthetic render load (xr_demo/loadgen.py: a full-"
                    "screen fragment shader) costing about this many GPU ms a frame, measured "
                    "and scaled on the device, submitted with every frame's render (0: none)")
    ap.add_argument("--load-size", type=int, default=d.load_size,
                    help="the synthetic load's image size (square)")
    a = ap.parse_args(argv)
    if a.load_ms and a.mode not in (None, "headless"):
        ap.error("--load-ms is for --headless runs")
    if a.predict_in_training and a.train_every != 1:
        ap.error("--predict-in-training needs a training step every frame (--train-every 1)")
    resolution = a.resolution or DEFAULT_RESOLUTION[a.model]
    try:
        config(a.model, resolution)
    except ValueError as e:
        ap.error(str(e))
    if a.encoder_weights and (problem := weights_problem(a.model, a.encoder_weights)):
        ap.error(problem)
    schedule = a.schedule
    if a.chunks is not None:
        schedule = f"chunks:{a.chunks}"
    if a.budget is not None:
        schedule = f"budget:{a.budget}"
    return Options(mode=a.mode or "headless", model=a.model,
                   resolution=resolution,
                   encoder_weights=a.encoder_weights, precision=a.precision, frames=a.frames,
                   hz=a.hz, train_every=a.train_every, infer_every=a.infer_every,
                   schedule=schedule, live=a.live, lr=a.lr, checkpoint=a.checkpoint,
                   fresh_decoder=a.fresh_decoder, save=a.save, seed=a.seed, out=a.out,
                   max_pending=a.max_pending, camera=a.camera, margin_ms=a.margin_ms,
                   compare=a.compare, compare_frames=a.compare_frames, evaluate=a.evaluate,
                   xr_size=a.xr_size, window_scale=a.window_scale,
                   screenshot=a.screenshot, zero_copy=a.zero_copy,
                   predict_in_training=a.predict_in_training, load_ms=a.load_ms,
                   load_size=a.load_size)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        run(opts)
    except (HostError, WeightsError) as e:
        # no display, no OpenXR runtime, no device, or another model's weights: one line
        print(f"python -m xr_demo: {e}", file=sys.stderr)
        return 2
    return 0


def run(opts: Options) -> None:
    if opts.mode == "headless":
        from xr_demo import headless

        headless.run(opts)
    elif opts.mode == "window":
        from xr_demo import window

        window.run(opts)
    else:
        from xr_demo import xr_mode

        xr_mode.run(opts)


if __name__ == "__main__":
    sys.exit(main())
