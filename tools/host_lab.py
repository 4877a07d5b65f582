"""Lab: what a step's round trip costs beyond its kernels (the inputs' upload, the wait).

    PYTHONPATH=. python tools/host_lab.py [--rounds 8] [--steps 20] [--only whisper_encoder,...]

Per workload and phase, two sessions of the same plan: inputs staged in system memory and where
vkml stages them (mappable VRAM on a GPU whose VRAM is all mappable); each timed with the wait
sleeping in the driver at once and with vkml's polling first (hal/base.py WAIT_POLL_S),
interleaved in rounds so drift hits all four alike. Medians and minima of step(); wait() in ms,
with the GPU time of the step's dispatches (profile()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench  # noqa: E402

import vkml  # noqa: E402
from vkml.vk import buffers  # noqa: E402

chosen_candidates = buffers.memory_candidates


def system_memory_staging(types, heap_sizes, type_bits, kind):
    """The order before staging moved into VRAM: mappable system memory first."""
    order = chosen_candidates(types, heap_sizes, type_bits, kind)
    if kind == "upload":
        return sorted(order, key=lambda i: bool(types[i][0] & buffers.DEVICE_LOCAL))
    return order


def compile_session(built, phase, device, vram):
    buffers.memory_candidates = chosen_candidates if vram else system_memory_staging
    try:
        return vkml.compile(built.graph, device=device, **bench.session_args(vkml, built, phase))
    finally:
        buffers.memory_candidates = chosen_candidates


def timed(session, backend, steps, poll_s):
    backend._poll_s, chosen = poll_s, backend._poll_s
    try:
        out = []
        for _ in range(steps):
            t0 = time.perf_counter()
            session.step()
            session.wait()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    finally:
        backend._poll_s = chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="whisper_encoder,resnet,unet,smolvla_expert,smollm2")
    ap.add_argument("--phases", default="infer,train")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "out"
                                         / "host_lab.json"))
    ap.add_argument("--tiny", action="store_true")
    opts = ap.parse_args()
    device = vkml.Device()
    backend = device.backend
    poll_s = backend._poll_s
    results = []
    for name in opts.only.split(","):
        wl = bench.WORKLOADS[name]
        for phase in opts.phases.split(","):
            built = wl.build(opts.tiny, phase)
            arrays = built.sample_inputs(np.random.default_rng(0))
            nbytes = sum(a.nbytes for a in arrays.values())
            sessions = {}
            for vram in (False, True):
                s = compile_session(built, phase, device, vram)
                for k, v in arrays.items():
                    s.set_input(k, v)
                for _ in range(5):
                    s.step()
                s.wait()
                sessions[vram] = s
            samples = {(v, p): [] for v in (False, True) for p in (False, True)}
            for _ in range(opts.rounds):
                for key in samples:
                    samples[key] += timed(sessions[key[0]], backend, opts.steps,
                                          poll_s if key[1] else 0.0)
            gpu = sessions[False].profile(5)
            row = {"workload": name, "phase": phase, "input_bytes": nbytes,
                   "gpu_ms": statistics.median(gpu.step_ms) if gpu.step_ms else None}
            for (v, p), xs in samples.items():
                tag = f"{'vram' if v else 'sysmem'}_{'poll' if p else 'block'}"
                row[tag] = {"median": statistics.median(xs), "min": min(xs)}
            results.append(row)
            print(json.dumps(row), flush=True)
            for s in sessions.values():
                s.close()
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
