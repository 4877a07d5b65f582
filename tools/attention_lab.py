"""Attention lab: the fused (flash) attention kernel's tile shapes against the composed attention
(products and a softmax), on the shapes the reference models run, each checked against float64
numpy and timed with device timestamps in one run.

    python tools/attention_lab.py                   # every tile shape, every case
    python tools/attention_lab.py --quick           # small shapes (lavapipe: correctness)
    python tools/attention_lab.py --out DIR         # also attention_lab.json there

A tile shape is (BLOCK_Q query rows a workgroup, PARTS threads a row, KEY_TILE keys a tile) of
vkml/kernels/attention.py's GPU kernel; "composed" is `fused=False`, its dispatches summed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernel_lab import profiled, rel  # noqa: E402  (tools/, the script's own folder)

import vkml  # noqa: E402
from vkml.compiler.stages import lower  # noqa: E402
from vkml.kernels import attention  # noqa: E402

# (label, q shape, k/v shape, causal): Whisper-tiny's encoder, SmolLM2's grouped heads at 128
# tokens, a longer sequence
CASES = [("whisper", (1, 6, 1500, 64), (1, 6, 1500, 64), False),
         ("smollm2", (1, 9, 128, 64), (1, 3, 128, 64), True),
         ("long 4096", (1, 8, 4096, 64), (1, 8, 4096, 64), True)]
QUICK = [("quick", (1, 2, 70, 8), (1, 2, 45, 8), False),
         ("quick causal", (2, 4, 37, 4), (2, 2, 37, 4), True)]
SHAPES = [(32, 4, 32), (16, 8, 32), (64, 2, 32), (32, 8, 64), (32, 2, 32), (16, 4, 32),
          (64, 4, 32)]


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    rep = q.shape[1] // k.shape[1]
    k, v = (np.repeat(x.astype(np.float64), rep, axis=1) for x in (k, v))
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        scores += np.triu(np.full(scores.shape[-2:], -np.inf), k=1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def timed(device: vkml.Device, caps, operands, causal: bool, fused: bool, reps: int
          ) -> tuple[float, np.ndarray, list[str]]:
    g = vkml.Graph()
    q, k, v = (g.param(n, x.shape, init=x) for n, x in zip("qkv", operands))
    g.output("o", g.scaled_dot_product_attention(q, k, v, causal=causal, fused=fused))
    plan = lower(g, caps).plan
    session, profile = profiled(device, plan, reps)
    out = session.read("o")
    session.close()
    return (float(sum(profile.dispatch_ms)), out,
            [d.kernel.name for d in plan.dispatches])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path)
    opts = parser.parse_args()
    device = vkml.Device()
    caps = (dataclasses.replace(device.caps, device_type="discrete") if opts.quick
            else device.caps)
    rng = np.random.default_rng(0)
    rows = []
    print(f"device: {device.name}")
    print(f"{'case':12} {'variant':14} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}  kernels")
    for label, q_shape, kv_shape, causal in QUICK if opts.quick else CASES:
        operands = [rng.standard_normal(s).astype(np.float32)
                    for s in (q_shape, kv_shape, kv_shape)]
        want = reference(*operands, causal)
        pairs = q_shape[0] * q_shape[1] * q_shape[2] * kv_shape[2] / (2 if causal else 1)
        flop = 4 * pairs * q_shape[3]
        variants = [("composed", None), *[("x".join(map(str, s)), s) for s in SHAPES]]
        for name, shape in variants:
            saved = attention.BLOCK_Q, attention.PARTS, attention.KEY_TILE
            if shape is not None:
                attention.BLOCK_Q, attention.PARTS, attention.KEY_TILE = shape
            try:
                ms, got, kernels = timed(device, caps, operands, causal, shape is not None,
                                         opts.reps)
                err = rel(got, want)
                row = {"case": label, "variant": name, "ms": ms, "tflops": flop / ms / 1e9,
                       "err": err, "kernels": kernels}
                print(f"{label:12} {name:14} {ms:8.4f} {row['tflops']:8.2f} {err:9.2e}  "
                      f"{len(kernels)}: {kernels[0] if len(kernels) == 1 else ''}", flush=True)
            except vkml.VkmlError as exc:  # a shape the device refuses is a result too
                row = {"case": label, "variant": name, "error": str(exc)[:300]}
                print(f"{label:12} {name:14} {'-':>8} refused: {str(exc)[:80]}", flush=True)
            finally:
                attention.BLOCK_Q, attention.PARTS, attention.KEY_TILE = saved
            rows.append(row)
            if opts.out:
                opts.out.mkdir(parents=True, exist_ok=True)
                (opts.out / "attention_lab.json").write_text(json.dumps(
                    {"device": device.name, "rows": rows}, indent=1))
    bad = [r for r in rows if "err" in r and r["err"] > 1e-5]
    for r in bad:
        print(f"WRONG: {r['case']} {r['variant']} rel err {r['err']:.2e}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
