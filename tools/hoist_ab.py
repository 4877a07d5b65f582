"""A/B of hoisting (compile's `hoist`): per model, the step's dispatches, its GPU time (device
timestamps, else the host's), and whether its outputs are bit-identical with the prologue and
without.

    PYTHONPATH=. python tools/hoist_ab.py [--small] [--reps 20] [--out FILE.json]

Models: ResNet-50 inference at batch 4 (batch-norm in inference form) in f16 with every
convolution on channels-last operands (kernels/conv.py CHANNELS_LAST_MIN = 0: the weights'
copies are what the prologue takes), and DINOv2's ViT-S/14 encoder at 224 x 224 (its position
table resized bicubically from 37 x 37) in f32 and f16. `--small`: the tiny configs the tests
use, for a CPU driver. Plans are lowered here rather than compiled (the plan cache keys the
sources, not the switch set here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vkml  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.kernels import conv  # noqa: E402
from vkml.models import dinov2, resnet  # noqa: E402
from vkml.session import Session  # noqa: E402


def resnet_case(small: bool) -> tuple[vkml.Graph, dict, dict[str, tuple[int, ...]]]:
    cfg = resnet.tiny("bottleneck") if small else resnet.resnet50()
    built = resnet.build(dataclasses.replace(cfg, bn="eval"))
    return built.graph, built.outputs, {"x": built.inputs["x"].shape}


def dinov2_case(small: bool) -> tuple[vkml.Graph, dict, dict[str, tuple[int, ...]]]:
    cfg, side = (dinov2.tiny(), 28) if small else (dinov2.Dinov2Config(), 224)
    g = vkml.Graph(seed=0)
    pixels = g.input("pixel_values", (1, 3, side, side))
    hidden = dinov2.dinov2(g, pixels, cfg, trainable=False)
    return g, {"last": dinov2.final_norm(g, cfg, trainable=False)(hidden[-1])}, {
        "pixel_values": pixels.shape}


CASES = {"resnet f16 channels-last": (resnet_case, "f16"),
         "dinov2 f32": (dinov2_case, "f32"),
         "dinov2 f16": (dinov2_case, "f16")}


def run(name: str, small: bool, reps: int, device: vkml.Device) -> dict[str, Any]:
    make, precision = CASES[name]
    graph, outputs, shapes = make(small)
    caps = dataclasses.replace(device.caps, precision=precision)
    rng = np.random.default_rng(0)
    feed = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    row: dict[str, Any] = {"model": name, "small": small}
    results = {}
    for hoist in (True, False):
        plan = lower(graph, caps, outputs=outputs, precision=precision, hoist=hoist).plan
        session = Session(plan, device)
        for n, v in feed.items():
            session.set_input(n, v)
        session.step()  # the prologue runs here, once
        profile = session.profile(steps=reps)
        results[hoist] = {n: session.read(n) for n in outputs}
        key = "hoisted" if hoist else "plain"
        row[f"{key}_dispatches"] = len(plan.dispatches)
        row[f"{key}_prologue"] = len(plan.prologue)
        row[f"{key}_step_ms"] = statistics.median(profile.step_ms)
        row["timing"] = profile.source
        session.close()
    row["bit_identical"] = all(np.array_equal(results[True][n], results[False][n])
                               for n in outputs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the tests' tiny configs")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    conv.CHANNELS_LAST_MIN = dict.fromkeys(conv.CHANNELS_LAST_MIN, 0)
    device = vkml.Device()
    rows = []
    for name in CASES:
        row = run(name, args.small, args.reps, device)
        rows.append(row)
        print(f"{name}: {row['plain_dispatches']} -> {row['hoisted_dispatches']} dispatches a "
              f"step ({row['hoisted_prologue']} in the prologue), {row['plain_step_ms']:.3f} -> "
              f"{row['hoisted_step_ms']:.3f} ms ({row['timing']}), bit-identical: "
              f"{row['bit_identical']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": device.name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
