"""Per-step host overhead of each backend on the same small MLP, measured side by side.

    PYTHONPATH=. python tools/backend_overhead.py [--steps 200] [--backends vulkan,wgpu]

For each backend: `submit` is the time step() takes to return (Vulkan: one vkQueueSubmit of
the recorded command buffer; wgpu: re-encoding the recorded command list, then one submit),
and `step` is step() + wait(), the whole round trip. Medians in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import vkml


def mlp(device: vkml.Device) -> vkml.Session:
    g = vkml.Graph(seed=0)
    x = g.input("x", (32, 64))
    labels = g.input("labels", (32,), "i32")
    h = vkml.nn.Linear(g, "fc1", 64, 64)(x).relu()
    logits = vkml.nn.Linear(g, "fc2", 64, 10)(h)
    session = vkml.compile(g, loss=g.cross_entropy(logits, labels),
                           optimizer=vkml.Adam(lr=1e-3), device=device)
    rng = np.random.default_rng(0)
    session.set_input("x", rng.standard_normal((32, 64)).astype(np.float32))
    session.set_input("labels", rng.integers(0, 10, 32).astype(np.int32))
    return session


def measure(session: vkml.Session, steps: int, submit: list[float], step: list[float]) -> None:
    for _ in range(steps):
        t0 = time.perf_counter()
        session.step()
        t1 = time.perf_counter()
        session.wait()
        t2 = time.perf_counter()
        submit.append(t1 - t0)
        step.append(t2 - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--backends", default="vulkan,wgpu")
    args = parser.parse_args()
    sessions = {}
    for name in args.backends.split(","):
        device = vkml.Device(backend=name)
        sessions[name] = (device, mlp(device))
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in sessions}
    for _, session in sessions.values():  # warm-up: first submissions compile lazily
        measure(session, 5, [], [])
    # Alternating rounds, so a change in the machine's load falls on every backend alike.
    for _ in range(10):
        for name, (_, session) in sessions.items():
            measure(session, max(args.steps // 10, 1), *times[name])
    print(f"{'backend':8} {'dispatches':>10} {'submit ms':>10} {'step ms':>10}   device")
    for name, (device, session) in sessions.items():
        submit, step = (statistics.median(t) * 1e3 for t in times[name])
        n = len(session.plan.dispatches)
        print(f"{name:8} {n:10d} {submit:10.3f} {step:10.3f}   {device!r}")
    for device, session in sessions.values():
        session.close()
        device.close()


if __name__ == "__main__":
    main()
