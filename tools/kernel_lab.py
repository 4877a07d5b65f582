"""Kernel lab: every GEMM tiling on the shapes the reference models run, checked against float64
numpy and timed with device timestamps, in one run, so one call on a lent GPU compares them all.

    python tools/kernel_lab.py                      # the default shapes, every tiling
    python tools/kernel_lab.py --quick              # small shapes (lavapipe: correctness)
    python tools/kernel_lab.py --out DIR            # also lab.json there

Each case is a graph of one matmul or convolution (of the kind the models' forward and backward
passes make) compiled as usual, whose kernel is then regenerated with each forced tiling; the
"auto" row is what codegen chooses. A row reports the median GPU ms over --reps steps (the
profile's timestamps), TFLOP/s and the relative L2 error against float64.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vkml  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.kernels import gemm, matmul  # noqa: E402
from vkml.session import Session  # noqa: E402

# (label, a shape, b shape, transpose_a, transpose_b): SmolLM2/SmolVLA projections forward and
# their gradients (dX = dY W, dW = dY^T X), the LM head, attention's batched products, one
# square matmul.
MATMULS = [
    ("square 4096", (4096, 4096), (4096, 4096), False, False),
    ("square 1024", (1024, 1024), (1024, 1024), False, False),
    ("smollm2 up fwd", (128, 576), (1536, 576), False, True),
    ("smollm2 down fwd", (128, 1536), (576, 1536), False, True),
    ("smollm2 q fwd", (128, 576), (576, 576), False, True),
    ("smollm2 kv fwd", (128, 576), (192, 576), False, True),
    ("smollm2 up dX", (128, 1536), (1536, 576), False, False),
    ("smollm2 up dW", (128, 1536), (128, 576), True, False),
    ("smollm2 lm head", (128, 576), (49152, 576), False, True),
    ("smollm2 scores", (1, 9, 128, 64), (1, 9, 128, 64), False, True),
    ("whisper qkv fwd", (1500, 384), (384, 384), False, True),
    ("whisper ffn dW", (1500, 1536), (1500, 384), True, False),
]
QUICK = [
    ("edges", (70, 21), (21, 33), False, False),
    ("nt", (130, 200), (70, 200), False, True),
    ("tn", (200, 130), (200, 70), True, False),
    ("tt", (40, 70), (33, 40), True, True),
    ("batched", (3, 20, 17), (17, 18), False, False),
]


def matmul_case(device: vkml.Device, a_shape, b_shape, ta: bool, tb: bool, rng):
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    g = vkml.Graph()
    pa, pb = g.param("a", a_shape, init=a), g.param("b", b_shape, init=b)
    g.output("c", g.matmul(pa, pb, transpose_a=ta, transpose_b=tb))
    a64 = np.swapaxes(a, -1, -2).astype(np.float64) if ta else a.astype(np.float64)
    b64 = np.swapaxes(b, -1, -2).astype(np.float64) if tb else b.astype(np.float64)
    return g, a64 @ b64


def run(device: vkml.Device, g: vkml.Graph, expected: np.ndarray, tiling, reps: int,
        caps) -> dict:
    plan = lower(g, caps).plan
    if tiling is not None:
        d = plan.dispatches[0]
        d = dataclasses.replace(d, kernel=matmul.generate(d.node, caps, tiling))
        plan = dataclasses.replace(plan, dispatches=[d, *plan.dispatches[1:]])
    name = plan.dispatches[0].kernel.name
    t0 = time.perf_counter()
    session = Session(plan, device)
    build_s = time.perf_counter() - t0
    session.step()
    got = session.read("c").astype(np.float64)
    err = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
    profile = session.profile(steps=reps)
    ms = sorted(profile.step_ms)[len(profile.step_ms) // 2]
    session.close()
    return {"kernel": name, "ms": ms, "err": err, "build_s": build_s, "source": profile.source}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tilings", default="all",
                        help="'all', 'auto' or names like s64x64k16r4x4")
    opts = parser.parse_args()
    device = vkml.Device()
    staged_caps = (dataclasses.replace(device.caps, device_type="discrete")
                   if opts.quick else device.caps)
    tilings = [t for t in gemm.STAGED if gemm._fits(t, staged_caps)]
    if opts.tilings == "auto":
        tilings = []
    elif opts.tilings != "all":
        wanted = set(opts.tilings.split(","))
        tilings = [t for t in tilings if str(t) in wanted]
    rng = np.random.default_rng(0)
    rows = []
    print(f"device: {device.name} ({device.caps.device_type})")
    print(f"{'case':22} {'tiling':22} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    for label, sa, sb, ta, tb in (QUICK if opts.quick else MATMULS):
        g, expected = matmul_case(device, sa, sb, ta, tb, rng)
        m, n = expected.shape[-2:]
        k = sa[-2] if ta else sa[-1]
        flop = 2 * expected.size * k
        for tiling in [None, *tilings]:
            caps = staged_caps if tiling is not None else device.caps
            try:
                r = run(device, g, expected, tiling, opts.reps, caps)
            except Exception as exc:  # a variant the device refuses is a result too
                r = {"kernel": str(tiling), "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(f"{label:22} {str(tiling or 'auto'):22} failed: {r['error'][:80]}")
                rows.append({"case": label, "tiling": str(tiling or "auto"), **r})
                continue
            tflops = flop / (r["ms"] * 1e-3) / 1e12 if r["ms"] > 0 else 0.0
            rows.append({"case": label, "m": m, "n": n, "k": k, "tiling": str(tiling or "auto"),
                         "tflops": tflops, **r})
            print(f"{label:22} {str(tiling or 'auto:' + r['kernel'].rsplit('_', 1)[-1]):22} "
                  f"{r['ms']:9.4f} {tflops:8.2f} {r['err']:9.2e}", flush=True)
    if opts.out:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / "lab.json").write_text(json.dumps({"device": device.name, "rows": rows},
                                                      indent=1))
    bad = [r for r in rows if r.get("err", 0) > 1e-5 or "error" in r]
    print(f"{len(rows)} runs, {len(bad)} failed or above 1e-5")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("VKML_WAIT_TIMEOUT", "60")
    raise SystemExit(main())
