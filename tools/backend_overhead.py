"""Per-step host overhead of each backend on the same model's training step, side by side.

    PYTHONPATH=. python tools/backend_overhead.py [--steps 200] [--layers 2]
        [--model mlp|smollm2|whisper_encoder|unet|resnet|smolvla_expert [--tiny]]
        [--backends vulkan,wgpu]

For each backend: `submit` is the time step() takes to return (Vulkan: one vkQueueSubmit of
the recorded command buffer; wgpu: re-encoding the recorded command list, then one submit),
`host us / dispatch` is the processor time the calling thread spent in step() over the step's
dispatches (unlike the wall clock, hardly changed by other processes on a shared machine), and
`step` is step() + wait(), the whole round trip. Medians. More `--layers` make more dispatches,
so the per-dispatch cost shows above the fixed cost of a step. `--model` takes a reference
model of vkml/models/ instead (its default config, or its tiny one with `--tiny`), under Adam.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import numpy as np

import vkml

WIDTH = 64
MODELS = ("smollm2", "whisper_encoder", "unet", "resnet", "smolvla_expert")


def mlp(device: vkml.Device, layers: int) -> vkml.Session:
    """`layers` Linear layers (ReLU between them) under cross-entropy and Adam."""
    g = vkml.Graph(seed=0)
    x = g.input("x", (32, WIDTH))
    labels = g.input("labels", (32,), "i32")
    h = x
    for i in range(layers - 1):
        h = vkml.nn.Linear(g, f"fc{i + 1}", WIDTH, WIDTH)(h).relu()
    logits = vkml.nn.Linear(g, f"fc{layers}", WIDTH, 10)(h)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                           optimizer=vkml.Adam(lr=1e-3), device=device)
    rng = np.random.default_rng(0)
    session.set_input("x", rng.standard_normal((32, WIDTH)).astype(np.float32))
    session.set_input("labels", rng.integers(0, 10, 32).astype(np.int32))
    return session


Times = tuple[list[float], list[float], list[float]]  # submit, host processor time, step


def reference_model(device: vkml.Device, name: str, tiny: bool) -> vkml.Session:
    """A model of vkml/models/ (its default or tiny config) under Adam, seeded inputs set."""
    module = importlib.import_module(f"vkml.models.{name}")
    built = module.build(module.tiny() if tiny else None)
    session = vkml.compile(built.graph, loss=built.loss, outputs=built.outputs,
                           optimizer=vkml.Adam(lr=1e-4), device=device)
    for input_name, value in built.sample_inputs(np.random.default_rng(0)).items():
        session.set_input(input_name, value)
    return session


def measure(session: vkml.Session, steps: int, times: Times) -> None:
    submit, host, step = times
    for _ in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        session.step()
        t1, c1 = time.perf_counter(), time.thread_time()
        session.wait()
        t2 = time.perf_counter()
        submit.append(t1 - t0)
        host.append(c1 - c0)
        step.append(t2 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2, help="Linear layers of the MLP")
    parser.add_argument("--model", default="mlp", choices=("mlp", *MODELS),
                        help="the MLP of --layers, or a reference model's training step")
    parser.add_argument("--tiny", action="store_true", help="the reference model's tiny config")
    parser.add_argument("--backends", default="vulkan,wgpu")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: the MLP needs at least one layer")
    sessions = {}
    for name in args.backends.split(","):
        device = vkml.Device(backend=name)
        sessions[name] = (device, mlp(device, args.layers) if args.model == "mlp"
                          else reference_model(device, args.model, args.tiny))
    times: dict[str, Times] = {name: ([], [], []) for name in sessions}
    for _, session in sessions.values():  # warm-up: first submissions compile lazily
        measure(session, 5, ([], [], []))
    # Alternating rounds, so a change in the machine's load falls on every backend alike.
    for _ in range(10):
        for name, (_, session) in sessions.items():
            measure(session, max(args.steps // 10, 1), times[name])
    print(f"{'backend':8} {'dispatches':>10} {'submit ms':>10} {'host us/dispatch':>17} "
          f"{'step ms':>10}   device")
    for name, (device, session) in sessions.items():
        submit, host, step = (statistics.median(t) * 1e3 for t in times[name])
        n = len(session.plan.dispatches)
        print(f"{name:8} {n:10d} {submit:10.3f} {host / n * 1e3:17.2f} {step:10.3f}   "
              f"{device!r}")
    for device, session in sessions.values():
        session.close()
        device.close()


if __name__ == "__main__":
    main()
