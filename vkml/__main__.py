"""Command line: `python -m vkml <command>`.

    demo    train an MLP on procedurally drawn shapes, report test accuracy, save weights and a
            figure (loss curve and labelled test images) under out/
    dump    run a script up to its vkml.compile call and print a compiler stage
            (graph, rewritten, split, plan, memory, wgsl, spirv)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from vkml import Adam, Device, Graph, Session, compile
from vkml import dump as dump_command
from vkml.datasets import SHAPE_CLASSES, make_shapes
from vkml.errors import DeviceError
from vkml.models import mlp
from vkml.png import Canvas, text_width, write_png

GREEN, RED, GREY, INK = (30, 150, 60), (210, 40, 40), (110, 110, 110), (20, 20, 20)
LIGHT_BLUE, BLUE, FAINT = (170, 200, 235), (25, 80, 170), (225, 225, 225)


# ---- demo: training and evaluation -------------------------------------------------------------
def build_classifier(batch: int, sizes: Sequence[int], seed: int, device: Device | None = None,
                     lr: float = 1e-3) -> Session:
    """A training session for an MLP on flat images; "logits" is readable after forward()."""
    g = Graph(seed=seed)
    x = g.input("x", (batch, sizes[0]))
    labels = g.input("labels", (batch,), "i32")
    logits = g.output("logits", mlp(g, x, sizes))
    return compile(g, loss=g.cross_entropy(logits, labels), optimizer=Adam(lr=lr),
                   device=device)


def train_epoch(session: Session, images: np.ndarray, labels: np.ndarray,
                rng: np.random.Generator, progress: object | None = None
                ) -> tuple[list[float], list[float]]:
    """One pass over a shuffled copy of the data in full batches (a session's batch is fixed,
    so the remainder waits for the next epoch's shuffle). Returns per-step losses and times."""
    batch = session.plan.slots[session.plan.inputs["x"]].shape[0]
    order = rng.permutation(len(images))
    losses, times = [], []
    for start in range(0, len(order) - batch + 1, batch):
        idx = order[start:start + batch]
        session.set_input("x", images[idx])
        session.set_input("labels", labels[idx])
        t0 = time.perf_counter()
        session.step()
        loss = float(session.read("loss"))  # waits for the step
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if progress is not None:
            progress.update(1)  # type: ignore[attr-defined]
            progress.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")  # type: ignore[attr-defined]
    return losses, times


def predict(session: Session, images: np.ndarray) -> np.ndarray:
    """Class predictions by forward() over fixed-size batches, the last one zero-padded."""
    batch, features = session.plan.slots[session.plan.inputs["x"]].shape
    # The forward program uploads every input, so "labels" must hold something (it is unused).
    session.set_input("labels", np.zeros(batch, np.int32))
    preds = np.empty(len(images), np.int32)
    for start in range(0, len(images), batch):
        chunk = images[start:start + batch]
        padded = np.zeros((batch, features), np.float32)
        padded[:len(chunk)] = chunk
        session.set_input("x", padded)
        session.forward()
        preds[start:start + len(chunk)] = session.read("logits")[:len(chunk)].argmax(axis=1)
    return preds


def run_demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    sizes, batch, side = (256, 128, 64, len(SHAPE_CLASSES)), 64, 16
    os.makedirs(args.out, exist_ok=True)
    train_x, train_y = make_shapes(args.train, seed=args.seed, size=side)
    # A distant seed keeps the test images disjoint from the training set of any nearby seed.
    test_x, test_y = make_shapes(args.test, seed=args.seed + 1_000_003, size=side)

    device = Device(args.device)
    print(f"device: {device.name} ({device.caps.device_type}, {device.backend_name} backend, "
          f"API {device.caps.api_version})")
    t0 = time.perf_counter()
    session = build_classifier(batch, sizes, args.seed, device)
    compile_s = time.perf_counter() - t0
    arch = "-".join(map(str, sizes))
    print(f"model: MLP {arch}, relu, Adam lr=1e-3, batch {batch}; compiled in {compile_s:.2f} s "
          f"({session.kernel_count} kernels, {len(session.plan.dispatches)} dispatches/step)")
    print(f"data: {len(train_x)} train / {len(test_x)} test {side}x{side} images of "
          f"{', '.join(SHAPE_CLASSES)}")

    rng = np.random.default_rng(args.seed)
    steps_per_epoch = len(train_x) // batch
    losses: list[float] = []
    times: list[float] = []
    t_train = time.perf_counter()
    with tqdm(total=args.epochs * steps_per_epoch, unit="step", dynamic_ncols=True) as bar:
        for epoch in range(args.epochs):
            bar.set_description(f"epoch {epoch + 1}/{args.epochs}")
            epoch_losses, epoch_times = train_epoch(session, train_x, train_y, rng, bar)
            losses += epoch_losses
            times += epoch_times
    train_s = time.perf_counter() - t_train

    preds = predict(session, test_x)
    correct = int((preds == test_y).sum())
    accuracy = correct / len(test_y)
    # The first step includes the driver's lazy shader compilation (lavapipe JITs kernels at
    # their first dispatch), so it is reported apart from the steady state.
    step_ms = 1e3 * statistics.median(times[1:] or times)
    steady_s = train_s - times[0]
    print(f"trained {len(losses)} steps in {train_s:.1f} s; first step {times[0]:.2f} s "
          f"(includes the driver's shader compilation)")
    print(f"time per step: {step_ms:.1f} ms median, {1e3 * min(times):.1f} ms min (step + wait + "
          f"loss read-back); {1e3 * steady_s / max(len(losses) - 1, 1):.1f} ms with batching")
    print(f"final loss {np.mean(losses[-steps_per_epoch:]):.4f} (last epoch's mean)")
    print(f"test accuracy: {100 * accuracy:.1f}% ({correct}/{len(test_y)}; chance is "
          f"{100 / len(SHAPE_CLASSES):.1f}%)")

    weights = os.path.join(args.out, "mlp_shapes.safetensors")
    session.save(weights)
    figure = os.path.join(args.out, "mlp_shapes.png")
    pixels = demo_figure(losses, steps_per_epoch, test_x, test_y, preds, side,
                         f"MLP {arch} ON SHAPES: TEST ACCURACY {100 * accuracy:.1f}%",
                         f"{device.name}, {step_ms:.1f} MS/STEP")
    write_png(figure, pixels)
    print(f"saved {weights} (parameters and Adam state) and {figure}")
    session.close()
    device.close()
    return 0


# ---- demo: the figure --------------------------------------------------------------------------
def pick_examples(preds: np.ndarray, labels: np.ndarray, count: int) -> np.ndarray:
    """Test indices to show: the first mistakes (up to a quarter of the tiles, as they are the
    interesting ones) topped up with the first correct answers, in test-set order."""
    wrong = np.flatnonzero(preds != labels)[:count // 4]
    right = np.flatnonzero(preds == labels)[:count - len(wrong)]
    return np.sort(np.concatenate([wrong, right]))


def draw_loss(c: Canvas, x: int, y: int, w: int, h: int, losses: Sequence[float],
              steps_per_epoch: int) -> None:
    c.text(x, y, "TRAINING LOSS (CROSS-ENTROPY) PER STEP, SMOOTHED IN DARK BLUE", INK)
    y += 14
    left = x + 30  # room for tick labels
    pw, ph = w - (left - x), h - 26
    top = float(np.max(losses)) * 1.05
    for epoch in range(0, len(losses) + 1, steps_per_epoch):
        gx = left + round(epoch / max(len(losses) - 1, 1) * (pw - 1))
        c.rect(gx, y, 1, ph, FAINT)
    steps = np.arange(len(losses))
    xs = left + steps / max(len(losses) - 1, 1) * (pw - 1)

    def to_y(v: np.ndarray) -> np.ndarray:
        return y + (1 - np.asarray(v) / top) * (ph - 1)

    c.polyline(xs, to_y(losses), LIGHT_BLUE)
    smooth = np.empty(len(losses))
    acc = float(losses[0])
    for i, v in enumerate(losses):  # exponential moving average, as tqdm's bar shows it
        acc = 0.9 * acc + 0.1 * v
        smooth[i] = acc
    c.polyline(xs, to_y(smooth), BLUE, thickness=2)
    c.frame(left, y, pw, ph, GREY)
    for v in (0.0, top / 2, top):
        label = f"{v:.1f}"
        ty = int(to_y(v)) - 3
        c.text(left - 4 - text_width(label), min(max(ty, y), y + ph - 7), label, GREY)
    c.text(left, y + ph + 4, "0", GREY)
    end = f"{len(losses)} STEPS ({len(losses) // steps_per_epoch} EPOCHS)"
    c.text(left + pw - text_width(end), y + ph + 4, end, GREY)


def demo_figure(losses: Sequence[float], steps_per_epoch: int, images: np.ndarray,
                labels: np.ndarray, preds: np.ndarray, side: int, title: str, subtitle: str,
                cols: int = 8, rows: int = 4) -> np.ndarray:
    """The demo's figure as RGB pixels: title, loss curve, and a grid of test images each framed
    green (right) or red (wrong) with the predicted class above the true one."""
    zoom, border, pitch_x = 3, 2, 62
    tile = side * zoom + 2 * border
    pitch_y = tile + 22
    margin = 12
    width = 2 * margin + cols * pitch_x - (pitch_x - tile)
    loss_h, legend_h = 170, 34
    height = margin + 30 + loss_h + 14 + legend_h + rows * pitch_y + margin
    c = Canvas(width, height)
    c.text(margin, margin, title, INK)
    c.text(margin, margin + 12, subtitle, GREY)
    y = margin + 30
    draw_loss(c, margin, y, width - 2 * margin, loss_h, losses, steps_per_epoch)
    y += loss_h + 14
    c.text(margin, y, "TEST IMAGES: PREDICTED CLASS ABOVE THE TRUE CLASS", INK)
    x = c.text(margin, y + 12, "RIGHT", GREEN)
    x = c.text(x, y + 12, " / ", GREY)
    c.text(x, y + 12, "WRONG", RED)
    y += legend_h
    for n, i in enumerate(pick_examples(preds, labels, rows * cols)):
        tx, ty = margin + (n % cols) * pitch_x, y + (n // cols) * pitch_y
        ok = preds[i] == labels[i]
        color = GREEN if ok else RED
        c.frame(tx, ty, tile, tile, color, border)
        img = images[i].reshape(side, side)
        lo, hi = float(img.min()), float(img.max())
        c.image(tx + border, ty + border, (img - lo) / max(hi - lo, 1e-6), zoom)
        c.text(tx, ty + tile + 3, SHAPE_CLASSES[preds[i]], color)
        c.text(tx, ty + tile + 12, SHAPE_CLASSES[labels[i]], GREY)
    return c.upscaled(2)


# ---- entry point -------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vkml",
                                     description="vkml: a Vulkan-native ML engine")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = commands.add_parser(
        "demo", help="train an MLP on procedurally drawn shapes and save a figure",
        description="Train a 256-128-64-6 MLP on 16x16 images of six shapes, print the test "
                    "accuracy and the time per step, and write out/mlp_shapes.safetensors and "
                    "out/mlp_shapes.png.")
    demo.add_argument("--epochs", type=int, default=6, help="passes over the training set "
                      "(default: %(default)s, well under a minute on lavapipe)")
    demo.add_argument("--seed", type=int, default=0, help="seeds data, weights and shuffling")
    demo.add_argument("--device", default=None,
                      help="Vulkan device: an index or part of its name (default: $VKML_DEVICE, "
                           "else the best device found)")
    demo.add_argument("--train", type=int, default=6000, help="training images")
    demo.add_argument("--test", type=int, default=1200, help="test images")
    demo.add_argument("--out", default="out", help="output directory (default: %(default)s)")
    demo.set_defaults(run=run_demo)
    dump = commands.add_parser("dump", help="print a stage of what a script compiles",
                               description=dump_command.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    dump_command.add_arguments(dump)
    dump.set_defaults(run=dump_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.run(args)
    except DeviceError as e:
        # No usable device is an environment problem, not a bug: the message, not a traceback.
        print(f"python -m vkml {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
