"""What a run leaves behind: a PNG strip (image | true depth | predicted depth at a few
moments), an animation of the learning (GIF and APNG), a plot of depth error and frame time
over time, and the metrics JSON. Pillow draws the pictures, matplotlib the plot."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from xr_demo.app import Prediction, RunLog
from xr_demo.colormap import NEAR, depth_fraction, depth_picture, turbo
from xr_demo.scene import FAR


def _panel(p: Prediction, scale: int) -> np.ndarray:
    row = np.concatenate([p.image, depth_picture(p.true_depth), depth_picture(p.depth)], 1)
    return np.repeat(np.repeat(row, scale, 0), scale, 1)


def _labelled(p: Prediction, scale: int, caption: str) -> Any:
    from PIL import Image, ImageDraw

    body = _panel(p, scale)
    h, w, _ = body.shape
    img = Image.new("RGB", (w, h + 18), (255, 255, 255))
    img.paste(Image.fromarray(body), (0, 18))
    draw = ImageDraw.Draw(img)
    draw.text((4, 3), caption, fill=(0, 0, 0))
    third = w // 3
    for k, name in enumerate(("image", "true depth", "predicted")):
        draw.text((k * third + 4, 21), name, fill=(255, 255, 255))
    return img


def moments(predictions: Sequence[Prediction], count: int) -> list[Prediction]:
    """`count` predictions evenly spread over the run, the first and the last included."""
    if not predictions:
        return []
    idx = np.unique(np.linspace(0, len(predictions) - 1, min(count, len(predictions)))
                    .round().astype(int))
    return [predictions[i] for i in idx]


def caption(p: Prediction) -> str:
    return (f"frame {p.frame}  t={p.t:.1f}s  {p.train_steps} training steps  "
            f"AbsRel {p.abs_rel:.3f}")


def colour_bar(width: int, height: int = 12) -> Any:
    """The depth pictures' scale: the colours from FAR to NEAR, ticks labelled in metres."""
    from PIL import Image, ImageDraw

    bar = np.repeat(turbo(np.linspace(0.0, 1.0, width))[None], height, 0)
    img = Image.new("RGB", (width, height + 16), (255, 255, 255))
    img.paste(Image.fromarray(bar), (0, 0))
    draw = ImageDraw.Draw(img)
    for metres in (FAR, 10.0, 5.0, 3.0, 2.0, NEAR):
        x = int(round(float(depth_fraction(np.float64(metres))) * (width - 1)))
        draw.line([(x, height - 4), (x, height + 1)], fill=(0, 0, 0))
        label = f"{metres:g} m"
        draw.text((min(max(0, x - 3 * len(label)), width - 6 * len(label)), height + 3), label,
                  fill=(0, 0, 0))
    return img


def write_strip(path: str, predictions: Sequence[Prediction], count: int = 4,
                scale: int = 3) -> None:
    from PIL import Image

    rows = [_labelled(p, scale, caption(p)) for p in moments(predictions, count)]
    if rows:  # the depth panels' scale, under the two of them
        third = rows[0].width // 3
        bar = colour_bar(2 * third - 8)
        scale_row = Image.new("RGB", (rows[0].width, bar.height + 6), (255, 255, 255))
        scale_row.paste(bar, (third + 4, 4))
        rows.append(scale_row)
    w = max(r.width for r in rows)
    out = Image.new("RGB", (w, sum(r.height for r in rows)), (255, 255, 255))
    y = 0
    for r in rows:
        out.paste(r, (0, y))
        y += r.height
    out.save(path)


def write_animation(gif_path: str, apng_path: str, predictions: Sequence[Prediction],
                    max_frames: int = 48, scale: int = 3) -> None:
    frames = [_labelled(p, scale, caption(p)) for p in moments(predictions, max_frames)]
    if not frames:
        return
    frames[0].save(gif_path, save_all=True, append_images=frames[1:], duration=120, loop=0)
    frames[0].save(apng_path, format="PNG", save_all=True, append_images=frames[1:],
                   duration=120, loop=0)


def loss_points(run: RunLog) -> list[tuple[float, float]]:
    """(seconds, loss) of the training steps harvested in this run's frames. The schedule
    comparison after the run logs its own steps at frames this run's timeline does not have;
    they were once all drawn at its last second, a spike no logged loss explained."""
    t_of = {f.frame: f.t for f in run.frames}
    return [(t_of[frame], loss) for _, frame, loss in run.losses if frame in t_of]


def write_plot(path: str, run: RunLog, hz: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    preds = run.predictions
    if preds:
        top.plot([p.t for p in preds], [p.abs_rel for p in preds], ".-", ms=3, lw=1,
                 color="tab:red", label="live AbsRel (inference on the current frame)")
    top.set_ylabel("depth error (AbsRel)")
    if run.eval_start is not None:
        top.axhline(run.eval_start, color="gray", ls=":", lw=1,
                    label=f"held-out AbsRel at start {run.eval_start:.3f}")
    if run.eval_end is not None:
        top.axhline(run.eval_end, color="black", ls="--", lw=1,
                    label=f"held-out AbsRel at end {run.eval_end:.3f}")
    losses = loss_points(run)
    if losses:
        twin = top.twinx()
        twin.plot(*zip(*losses), lw=0.8, color="tab:blue", alpha=0.6)
        twin.set_ylabel("training loss (MSE)", color="tab:blue")
        twin.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    if top.get_legend_handles_labels()[0]:  # above the axes, never over the data
        top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=2, fontsize=7,
                   frameon=False)
    frames = run.frames
    t = [f.t for f in frames]
    bottom.plot(t, [f.frame_ms for f in frames], lw=0.8, color="tab:purple",
                label="frame time (frame start to render fence)")
    # frames that submitted no model work are gaps, not a fall to the log axis' floor
    cost = np.array([f.model_cost_ms for f in frames], np.float64)
    bottom.plot(t, np.where(cost > 0, cost, np.nan), lw=0.8, color="tab:orange", alpha=0.8,
                label="model GPU ms submitted (profiled; gaps: none that frame)")
    for rate, style in ((72, "--"), (90, ":")):
        bottom.axhline(1000 / rate, color="red", ls=style, lw=1, label=f"{rate} Hz frame")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("seconds")
    bottom.set_yscale("log")
    bottom.legend(loc="upper left", bbox_to_anchor=(0.0, -0.2), ncol=2, fontsize=7,
                  frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=float)


def write_all(out_dir: str, run: RunLog, metrics: dict[str, Any], hz: float,
              title: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, file) for name, file in (
        ("strip", "strip.png"), ("gif", "learning.gif"), ("apng", "learning.apng"),
        ("plot", "plot.png"), ("metrics", "metrics.json"))}
    if run.predictions:
        write_strip(paths["strip"], run.predictions)
        write_animation(paths["gif"], paths["apng"], run.predictions)
    else:
        for k in ("strip", "gif", "apng"):
            paths.pop(k)
    write_plot(paths["plot"], run, hz, title)
    write_json(paths["metrics"], metrics)
    return paths
