"""Bit-for-bit comparison of vkml's results across a code change.

`save FILE` runs every op case of tests/test_ops.py (forward output and every gradient) and the
five reference models at their tiny configs (loss, outputs and gradients of a first step, then
the parameters after three Adam steps) on the default device, and writes every array to FILE
(.npz). `compare FILE` does the same and reports each array that differs in any bit. `cut`
compares the models' whole steps with the same steps cut into pieces at every level and inside
every dispatch that can be cut (made-up costs against a small budget_ms: the workgroup ranges
of runtime/chunking.py), in one run. VKML_BACKEND=wgpu runs them all on the wgpu backend.

    git stash; python tools/bitwise.py save /tmp/before.npz; git stash pop
    python tools/bitwise.py compare /tmp/before.npz
    python tools/bitwise.py cut
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import vkml  # noqa: E402
from vkml.models import resnet, smollm2, smolvla_expert, unet, whisper_encoder  # noqa: E402

MODELS = {"smollm2": smollm2, "resnet": resnet, "unet": unet, "whisper_encoder": whisper_encoder,
          "smolvla_expert": smolvla_expert}


def op_results(device: vkml.Device) -> dict[str, np.ndarray]:
    from test_ops import CASES, build_session

    results = {}
    for case in CASES:
        rng = np.random.default_rng(1234)
        session, operands, _, _ = build_session(case, device, rng)
        session.step()
        results[f"op/{case.name}/out"] = session.read("out")
        for i in range(len(operands)):
            results[f"op/{case.name}/grad{i}"] = session.grad(f"p{i}")
        session.close()
    return results


def model_results(device: vkml.Device, cut: bool = False) -> dict[str, np.ndarray]:
    """`cut`: every step in pieces of at most 0.3 of a made-up 1 ms per dispatch, so every
    level, and every dispatch with workgroups to spare, is cut."""
    results = {}
    for name, module in MODELS.items():
        built = module.build(module.tiny())
        session = vkml.compile(built.graph, loss=built.loss, outputs=built.outputs,
                               optimizer=vkml.Adam(lr=1e-2), keep_grads=True, device=device)
        for key, value in built.sample_inputs(np.random.default_rng(7)).items():
            session.set_input(key, value)
        budget = None
        if cut:
            session._chunker.set_measured([1.0] * len(session.plan.dispatches), "made up")
            budget = 0.3
            bounds = session.chunk_boundaries(budget_ms=budget)
            inside = sum(end > first for (_, end), (first, _) in zip(bounds, bounds[1:]))
            print(f"{name}: {len(session.plan.dispatches)} dispatches in {len(bounds)} "
                  f"pieces, {inside} of them cut inside a dispatch")
        session.step(budget_ms=budget)
        results[f"model/{name}/loss"] = session.read("loss")
        for out in built.outputs:
            results[f"model/{name}/{out}"] = session.read(out)
        for param in session.plan.grads:  # frozen parameters have none
            results[f"model/{name}/grad/{param}"] = session.grad(param)
        session.step(budget_ms=budget)
        session.step(budget_ms=budget)
        for param, value in session.params().items():
            results[f"model/{name}/param3/{param}"] = value
        session.close()
    return results


def report(before: dict[str, np.ndarray], results: dict[str, np.ndarray], what: str) -> int:
    """Print each array of `before` that `results` lacks or differs in; 1 if any does."""
    differing = [k for k in before
                 if k not in results or results[k].shape != before[k].shape
                 or results[k].tobytes() != before[k].tobytes()]
    missing = sorted(set(results) - set(before))
    for k in differing:
        now = results.get(k)
        detail = "absent now" if now is None else (
            f"max |diff| {np.max(np.abs(now.astype(np.float64) - before[k])):.3g}"
            if now.shape == before[k].shape else f"shape {before[k].shape} -> {now.shape}")
        print(f"DIFFERS {k}: {detail}")
    for k in missing:
        print(f"NEW {k} (not in {what})")
    print(f"{len(before) - len(differing)} of {len(before)} arrays bit-identical; "
          f"{len(differing)} differ, {len(missing)} new")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["save", "compare", "cut"])
    parser.add_argument("file", nargs="?", help="the .npz of save and compare")
    opts = parser.parse_args()
    device = vkml.Device()
    if opts.action == "cut":
        return report(model_results(device), model_results(device, cut=True), "whole steps")
    if opts.file is None:
        parser.error(f"{opts.action} needs a FILE")
    results = op_results(device) | model_results(device)
    if opts.action == "save":
        np.savez(opts.file, **results)
        print(f"{len(results)} arrays written to {opts.file} ({device.name})")
        return 0
    return report(dict(np.load(opts.file)), results, opts.file)


if __name__ == "__main__":
    raise SystemExit(main())
