"""`python -m vkml demo`: the quickstart. Train a small MLP on images of shapes it draws itself
(no download), report test accuracy and time per step, and save the weights and, where
matplotlib is installed, a figure (loss curve, labelled test images).

The data: grey images of six shape classes drawn from signed distance functions, each shape's
edge anti-aliased by the same rule, so no class can be told apart by its edge quality, only by
its geometry. Position, size, intensity, background and pixel noise vary per image, which keeps
a linear classifier well short of perfect while the MLP learns it in a few epochs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from vkml import Adam, Device, Graph, Session, compile
from vkml.models import mlp

# ---- the data ----------------------------------------------------------------------------------
SHAPE_CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "bar", "ring")


def _signed_distance(kind: str, dx: np.ndarray, dy: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Approximate signed distance (pixels, negative inside) to shape `kind` of half-size `r`,
    centred at the origin; y grows downwards as in an image."""
    ax, ay = np.abs(dx), np.abs(dy)
    if kind == "circle":
        return np.hypot(dx, dy) - r
    if kind == "square":
        # 0.85 r gives the square roughly the circle's area, so total brightness is no clue.
        return np.maximum(ax, ay) - 0.85 * r
    if kind == "triangle":
        # Apex at (0, -r), base corners at (+-w, b): the base line and the two slanted edges.
        w, b = 0.95 * r, 0.8 * r
        slant = (ax * (b + r) - (dy + r) * w) / np.hypot(b + r, w)
        return np.maximum(dy - b, slant)
    if kind == "cross":
        t = 0.3 * r
        return np.minimum(np.maximum(ax - t, ay - r), np.maximum(ax - r, ay - t))
    if kind == "bar":
        return np.maximum(ax - 1.2 * r, ay - 0.3 * r)
    if kind == "ring":
        return np.abs(np.hypot(dx, dy) - 0.78 * r) - 0.22 * r
    raise ValueError(f"unknown shape {kind!r}; known: {SHAPE_CLASSES}")


def render_shapes(labels: np.ndarray, rng: np.random.Generator, size: int = 16) -> np.ndarray:
    """Grey images in [0, 1] (before noise), one per label, shape (n, size, size) float32."""
    n = len(labels)
    cx = rng.uniform(0.35, 0.65, n) * size
    cy = rng.uniform(0.35, 0.65, n) * size
    r = rng.uniform(0.2, 0.32, n) * size
    ink = rng.uniform(0.45, 1.0, n)
    paper = rng.uniform(0.0, 0.25, n)
    coords = np.arange(size, dtype=np.float64) + 0.5
    images = np.empty((n, size, size), np.float64)
    for k, kind in enumerate(SHAPE_CLASSES):
        idx = np.flatnonzero(labels == k)
        dx = coords[None, None, :] - cx[idx, None, None]
        dy = coords[None, :, None] - cy[idx, None, None]
        coverage = np.clip(0.5 - _signed_distance(kind, dx, dy, r[idx, None, None]), 0.0, 1.0)
        images[idx] = paper[idx, None, None] + (ink[idx] - paper[idx])[:, None, None] * coverage
    return images.astype(np.float32)


def make_shapes(n: int, seed: int, size: int = 16, noise: float = 0.12
                ) -> tuple[np.ndarray, np.ndarray]:
    """`n` noisy shape images and their labels, the same for the same arguments.

    Returns images as float32 (n, size*size), each standardised to zero mean and unit variance
    (so ink and paper brightness carry no label information), and labels as int32 (n,) indexing
    `SHAPE_CLASSES`, balanced to within one image per class.
    """
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % len(SHAPE_CLASSES)).astype(np.int32)
    images = render_shapes(labels, rng, size)
    images += rng.normal(0.0, noise, images.shape).astype(np.float32)
    flat = images.reshape(n, size * size)
    flat -= flat.mean(axis=1, keepdims=True)
    flat /= flat.std(axis=1, keepdims=True) + 1e-6
    return flat, labels


# ---- training and evaluation -------------------------------------------------------------------
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


# ---- the figure ---------------------------------------------------------------------------------
def pick_examples(preds: np.ndarray, labels: np.ndarray, count: int) -> np.ndarray:
    """Test indices to show: the first mistakes (up to a quarter of the tiles, as they are the
    interesting ones) topped up with the first correct answers, in test-set order."""
    wrong = np.flatnonzero(preds != labels)[:count // 4]
    right = np.flatnonzero(preds == labels)[:count - len(wrong)]
    return np.sort(np.concatenate([wrong, right]))


def save_figure(path: str, losses: Sequence[float], steps_per_epoch: int, images: np.ndarray,
                labels: np.ndarray, preds: np.ndarray, side: int, title: str,
                cols: int = 8, rows: int = 4) -> bool:
    """Write the loss curve over a grid of test images, each framed green (right) or red (wrong)
    with the predicted class above it and the true one below, as a PNG at `path`. Returns False,
    writing nothing, where matplotlib is not installed (the library does not depend on it)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    fig = Figure(figsize=(8, 9.5), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 2.6])
    ax = top.subplots()
    smooth, acc = [], float(losses[0])
    for v in losses:  # exponential moving average, as tqdm's bar shows it
        acc = 0.9 * acc + 0.1 * v
        smooth.append(acc)
    for epoch in range(steps_per_epoch, len(losses), steps_per_epoch):
        ax.axvline(epoch, color="0.9", linewidth=0.8, zorder=0)
    ax.plot(losses, color="#aac8eb", linewidth=0.8, label="per step")
    ax.plot(smooth, color="#1950aa", linewidth=1.6, label="smoothed")
    ax.set(title=title, xlabel="step (grey lines: epochs)", ylabel="cross-entropy", ylim=(0, None))
    ax.legend(frameon=False)
    bottom.suptitle("test images: predicted class above, true class below", fontsize=10)
    shown = pick_examples(preds, labels, rows * cols)
    for n, tile in enumerate(bottom.subplots(rows, cols).flat):
        tile.set_xticks([])
        tile.set_yticks([])
        if n >= len(shown):
            tile.axis("off")
            continue
        i = shown[n]
        color = "#1e963c" if preds[i] == labels[i] else "#d22828"
        tile.imshow(images[i].reshape(side, side), cmap="gray")
        tile.set_title(SHAPE_CLASSES[preds[i]], color=color, fontsize=8)
        tile.set_xlabel(SHAPE_CLASSES[labels[i]], color="0.4", fontsize=8)
        for spine in tile.spines.values():
            spine.set_edgecolor(color)
            spine.set_linewidth(2)
    fig.savefig(path, dpi=100)
    return True


# ---- the command line ---------------------------------------------------------------------------
BATCH = 64  # the classifier's batch: every step takes one
def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an int >= `least` (0 epochs or fewer images than a batch ended in a
    StatisticsError after the run)."""
    def count(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value
    count.__name__ = "int"  # argparse's "invalid int value" for text that is no int
    return count


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=_at_least(1), default=6,
                        help="passes over the training set (default: %(default)s, well under a "
                             "minute on lavapipe)")
    parser.add_argument("--seed", type=int, default=0, help="seeds data, weights and shuffling")
    parser.add_argument("--device", default=None,
                        help="Vulkan device: an index or part of its name (default: "
                             "$VKML_DEVICE, else the best device found)")
    parser.add_argument("--train", type=_at_least(BATCH), default=6000,
                        help=f"training images (at least a batch, {BATCH})")
    parser.add_argument("--test", type=_at_least(1), default=1200, help="test images")
    parser.add_argument("--out", default="out", help="output directory (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    sizes, batch, side = (256, 128, 64, len(SHAPE_CLASSES)), BATCH, 16
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
    print(f"saved {weights} (parameters and Adam state)")
    figure = os.path.join(args.out, "mlp_shapes.png")
    if save_figure(figure, losses, steps_per_epoch, test_x, test_y, preds, side,
                   f"MLP {arch} on shapes: test accuracy {100 * accuracy:.1f}%\n"
                   f"{device.name}, {step_ms:.1f} ms/step"):
        print(f"saved {figure}")
    else:
        print("no figure: it is drawn with matplotlib (pip install matplotlib)")
    session.close()
    device.close()
    return 0
