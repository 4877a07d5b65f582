"""Checkpoints of a bound plan as safetensors: parameters by their (PyTorch) names, optimizer state
under "optimizer/<param>/<state>", hyperparameters and step count under "optimizer/hyperparams".
A load checks everything before it writes anything, so a bad file changes nothing."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from vkml.compiler.schedule import Slot
from vkml.errors import InputError
from vkml.runtime.bound import BoundPlan

STATE_PREFIX = "optimizer/"


def state_dict(bound: BoundPlan) -> dict[str, np.ndarray]:
    return {name: bound.read_slot(slot) for name, slot in _targets(bound).items()}


def save(bound: BoundPlan, path: str | os.PathLike) -> None:
    """Write atomically: a crash never leaves half a file."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    plan = bound.plan
    metadata = {"format": "vkml"}
    if plan.optimizer is not None:
        metadata["optimizer"] = type(plan.optimizer).__name__
        metadata["hyperparams"] = ",".join(plan.hyperparams)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    os.close(fd)
    try:
        save_file(state_dict(bound), tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(bound: BoundPlan, path: str | os.PathLike, strict: bool = True) -> None:
    """Parameters (and optimizer state, where the file has it) by name. `strict`: every
    parameter must be present and no unknown tensor may be."""
    from safetensors.numpy import load_file

    plan = bound.plan
    loaded = load_file(os.fspath(path))
    targets = _targets(bound)
    problems = []
    missing = [n for n in plan.params if n not in loaded]
    unknown = [n for n in loaded if n not in targets and not n.startswith(STATE_PREFIX)]
    if strict and missing:
        problems.append(f"missing parameters {missing}")
    if strict and unknown:
        problems.append(f"unknown tensors {unknown}")
    for name, value in loaded.items():
        slot = targets.get(name)
        if slot is not None and value.shape != slot.shape:
            problems.append(f"'{name}' has shape {value.shape}, expected {slot.shape}")
    if problems:
        raise InputError(f"cannot load {os.fspath(path)}: " + "; ".join(problems)
                         + " (nothing was changed)")
    bound.wait()
    for name, value in loaded.items():
        if name in targets:
            bound.write_slot(targets[name], value.astype(np.float32))


def _targets(bound: BoundPlan) -> dict[str, Slot]:
    """Every tensor a checkpoint holds, by its name there."""
    plan = bound.plan
    targets = {n: plan.slots[s] for n, s in plan.params.items()}
    for param, slots in plan.optimizer_state.items():
        targets |= {f"{STATE_PREFIX}{param}/{k}": plan.slots[s] for k, s in slots.items()}
    if plan.hyperparams_slot is not None:
        targets[f"{STATE_PREFIX}hyperparams"] = plan.slots[plan.hyperparams_slot]
    return targets
