"""Checkpoints of a bound plan as safetensors: parameters by their (PyTorch) names (those the plan
does not compute with too, held on the host), optimizer state under "optimizer/<param>/<state>"
(a prefix no name of a graph may start with), hyperparameters and step count under
"optimizer/hyperparams", the optimizer's kind and hyperparameter names in the metadata, and the
graph's extras (tensors a checkpoint carries that nothing computes with, `Graph.extra`) in their
own dtypes.

A load reads and checks everything before it writes anything, so a bad file changes nothing:
an unreadable or malformed file, a tensor of the wrong shape, integers or booleans for a
floating-point parameter, another optimizer's state, a tensor of a model option the graph does
not implement (`Graph.unsupported`) all raise CheckpointError with the session untouched.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from vkml.compiler.plan import Slot
from vkml.errors import CheckpointError, InputError
from vkml.files import write_atomic
from vkml.graph import STATE_PREFIX, TRAINING_STEP, user_stacklevel
from vkml.interrupts import deferred_interrupts
from vkml.runtime.bound import BoundPlan

HYPERPARAMS = STATE_PREFIX + "hyperparams"
# Metadata key of the hyperparameters as the user gave them (JSON, float64): the tensor holds f32.
EXACT = "hyperparam_values"
# Metadata key of the training steps taken (graph.TRAINING_STEP), where the graph numbers them
# (dropout's masks), so that a resumed run draws the masks it would have drawn.
TRAINING_STEPS = "training_steps"

# safetensors' dtype names -> numpy, little-endian as the format stores them. BF16 has no numpy
# dtype: it is the upper half of an f32, widened by hand (decode()).
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


@dataclasses.dataclass
class Entries:
    """What a graph adds to its checkpoints beyond the plan's tensors: its parameters the plan
    does not use (the compiled outputs and loss do not depend on them), kept on the host as f32
    and frozen, so that a load and save carries them over; the extras (Graph.extra) in their
    own dtypes; and, by tensor name, why a file holding that tensor is refused
    (Graph.unsupported). Loads replace the arrays held, never write into them."""

    extras: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    unsupported: dict[str, str] = dataclasses.field(default_factory=dict)
    params: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def state_dict(bound: BoundPlan, entries: Entries | None = None) -> dict[str, np.ndarray]:
    targets = _targets(bound)
    tensors = dict(zip(targets, bound.read_slots(list(targets.values()))))
    if entries is not None:
        held = {**entries.params, **entries.extras}
        clash = sorted(set(tensors) & set(held) | set(entries.params) & set(entries.extras))
        if clash:  # Graph's names are unique; a clash here would save one value over another
            raise CheckpointError(f"two tensors would be saved as {_names(clash)}; nothing "
                                  "was written")
        tensors |= {name: value.copy() for name, value in held.items()}
    return tensors


def save(bound: BoundPlan, path: str | os.PathLike, entries: Entries | None = None,
         hyperparams: Mapping[str, float] | None = None) -> None:
    """Write atomically: a crash never leaves half a file. `hyperparams`: the optimizer's as
    the user gave them (float64), kept in the metadata for an exact resumption."""
    from safetensors.numpy import save as serialize

    path = _path(path, "write")
    plan = bound.plan
    metadata = {"format": "vkml"}
    if plan.optimizer is not None:
        metadata["optimizer"] = type(plan.optimizer).__name__
        metadata["hyperparams"] = ",".join(plan.hyperparams)
        if hyperparams:
            metadata[EXACT] = json.dumps({k: float(v) for k, v in hyperparams.items()})
    if TRAINING_STEP in plan.inputs:
        metadata[TRAINING_STEPS] = str(bound.training_steps)
    write_atomic(path, serialize(state_dict(bound, entries), metadata=metadata))


def read_file(path: str | os.PathLike) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """A safetensors file's tensors, undecoded ({"dtype", "shape", "data"} by name), and its
    metadata. Every failure is a CheckpointError whose cause is the OS's or safetensors' own
    exception."""
    from safetensors import SafetensorError, deserialize

    path = _path(path, "read")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc} (give the "
                              "path of a .safetensors file); nothing was changed") from exc
    try:
        tensors = dict(deserialize(data))
        # deserialize() has validated the header; it does not return the metadata, which sits
        # in the same JSON header: 8 bytes of little-endian length, then the JSON.
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    except (SafetensorError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file ({exc}): it may be "
                              "truncated or another kind of file; nothing was changed") from exc
    metadata = header.get("__metadata__") or {}
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def decode(name: str, entry: Mapping[str, Any]) -> np.ndarray:
    """One tensor of read_file() as numpy, in its own dtype (BF16 widened to f32 exactly)."""
    dtype, shape, raw = entry["dtype"], tuple(entry["shape"]), entry["data"]
    if dtype == "BF16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    if dtype not in _NUMPY:
        raise CheckpointError(f"'{name}' has dtype {dtype}, which vkml cannot read (it reads "
                              f"{', '.join([*_NUMPY, 'BF16'])}); nothing was changed")
    return np.frombuffer(raw, _NUMPY[dtype]).reshape(shape)


def load(bound: BoundPlan, path: str | os.PathLike, strict: bool = True,
         optimizer_state: bool = True, entries: Entries | None = None,
         hyperparams: dict[str, float] | None = None) -> None:
    """Parameters (and optimizer state, where the file has it and `optimizer_state`) by name.
    `strict`: every parameter must be present and no unknown tensor may be (optimizer state
    of a parameter this session does not train is not unknown: it is skipped).
    `hyperparams`: the session's float64 hyperparameters, updated in place to the file's when
    it has them; the optimizer's tables (Adam's bias corrections) are rebuilt from them."""
    plan = bound.plan
    entries = entries or Entries()
    path = _path(path, "read")
    tensors, metadata = read_file(path)
    targets = _targets(bound)
    optimizer = plan.optimizer if optimizer_state else None
    problems: list[str] = []

    for name, reason in entries.unsupported.items():
        if name in tensors:
            problems.append(f"it holds '{name}': {reason}")
    carries_state = optimizer is not None and any(n.startswith(STATE_PREFIX) for n in tensors)
    state_problems, saved_hyperparams = (
        _saved_hyperparams(plan, metadata, tensors, hyperparams or {}) if carries_state
        else ([], None))
    problems += state_problems
    wanted = [n for n in tensors if n in entries.extras or n in entries.params or (
        n in targets and (optimizer is not None or not n.startswith(STATE_PREFIX)))]
    missing_state: list[str] = []
    if strict:
        missing = [n for n in (*plan.params, *entries.params) if n not in tensors]
        # (after a mismatch of kind, the other optimizer's names would only add noise)
        missing_state = [n for n in targets if carries_state and not state_problems
                         and n.startswith(STATE_PREFIX) and n not in tensors]
        unknown = [n for n in tensors if n not in targets and n not in entries.extras
                   and n not in entries.params and n not in entries.unsupported
                   and not n.startswith(STATE_PREFIX)]
        if missing:
            problems.append(f"missing parameters {_names(missing)}")
        if missing_state:
            problems.append(f"missing optimizer state {_names(missing_state)}")
        if unknown:
            problems.append(f"unknown tensors {_names(unknown)} (load(path, strict=False) "
                            "skips tensors this graph does not have)")

    values: dict[str, np.ndarray] = {}
    for name in wanted:
        entry = tensors[name]
        shape = tuple(entry["shape"])
        held = entries.extras.get(name, entries.params.get(name))
        expected = targets[name].shape if held is None else held.shape
        if shape != expected:
            problems.append(f"'{name}' has shape {shape}, expected {expected}")
            continue
        if name in entries.extras:
            value, problem = _as_extra(name, entry, entries.extras[name].dtype)
        else:
            param = name in entries.params or targets[name].role == "param"
            value, problem = _as_float(name, entry, "parameter" if param else "tensor")
        if problem:
            problems.append(problem)
        else:
            values[name] = value
    steps = metadata.get(TRAINING_STEPS) if optimizer_state else None
    if steps is not None and not steps.isdigit():
        problems.append(f"its metadata's {TRAINING_STEPS} is {steps!r}, not a count")
    if problems:
        hint = (" (load(path, optimizer_state=False) loads the parameters alone)"
                if state_problems or (strict and missing_state) else "")
        raise CheckpointError(f"cannot load {path}: " + "; ".join(problems) + hint
                              + "; nothing was changed")
    bound.wait()
    with deferred_interrupts():  # a Ctrl-C now would leave the session half loaded
        _apply(bound, values, targets, entries, saved_hyperparams, hyperparams, steps)
    if optimizer is not None and plan.hyperparams_slot is not None and any(
            plan.optimizer_state.values()):  # (plain SGD keeps no state to lose)
        _warn_of_missing_state(bound, path, tensors)


def _warn_of_missing_state(bound: BoundPlan, path: str, tensors: Mapping[str, Any]) -> None:
    """Warn where a training session that has stepped loaded parameters without their
    optimizer state, which then goes on from this session's own moments, as torch.optim's
    does after a model's load_state_dict (a user resuming a run into it would not see
    otherwise that the moments are not the file's; a session that has not stepped starts
    afresh, the usual fine-tuning, without a warning), or that a parameter's fresh state is
    taken as old as the file's step count (strict=False, a file whose run trained fewer
    parameters: vkml counts steps once for all parameters, torch.optim per parameter)."""
    plan = bound.plan
    kind = type(plan.optimizer).__name__
    t = int(bound.read_slot(plan.slots[plan.hyperparams_slot])[plan.hyperparams.index("t")])
    if not any(n.startswith(STATE_PREFIX) for n in tensors):
        if t == 0:  # pretrained weights into a new session: its optimizer starts afresh, as
            return  # torch.optim's made after load_state_dict; nothing to warn of
        own = (f"the state of its own {t} step(s) ({', '.join(plan.optimizer.state_names)} "
               "and step count)")
        warnings.warn(f"{path} holds no optimizer state: its parameters were loaded, and this "
                      f"session's {kind} keeps {own}. To resume a run exactly, load a file "
                      "session.save() wrote; load(path, optimizer_state=False) loads parameters "
                      "alone without this warning", stacklevel=user_stacklevel())
        return
    lacking = [p for p, slots in plan.optimizer_state.items()
               if any(f"{STATE_PREFIX}{p}/{k}" not in tensors for k in slots)]
    if lacking and t > 0:
        warnings.warn(f"{path} holds no optimizer state for {_names(lacking)}: they keep this "
                      f"session's under the file's step count t={t}, so {kind}'s update takes "
                      f"their state as {t} steps old (vkml counts steps once for all "
                      "parameters; torch.optim counts them per parameter and would start "
                      "these at step 1). To train them from fresh state, load the file with "
                      "optimizer_state=False into a session that has not stepped: every "
                      "parameter's state then starts afresh", stacklevel=user_stacklevel())


def _apply(bound: BoundPlan, values: dict[str, np.ndarray], targets: Mapping[str, Slot],
           entries: Entries, saved_hyperparams: dict[str, float] | None,
           hyperparams: dict[str, float] | None, steps: str | None) -> None:
    """Put a checked checkpoint's values in place."""
    plan = bound.plan
    writes = []
    for name, value in values.items():
        if name in entries.extras:
            entries.extras[name] = value
        elif name in entries.params:
            entries.params[name] = value
        else:
            writes.append((targets[name], value))
    restores = saved_hyperparams is not None and HYPERPARAMS in values
    if restores:
        writes += [(plan.slots[plan.optimizer_tables[table]], data)
                   for table, data in plan.optimizer.tables(saved_hyperparams).items()]
    bound.write_slots(writes)
    if restores and hyperparams is not None:
        hyperparams.update(saved_hyperparams)
    if steps is not None and TRAINING_STEP in plan.inputs:
        bound.training_steps = int(steps)


def _as_float(name: str, entry: Mapping[str, Any], what: str) -> tuple[np.ndarray, str]:
    """A file's tensor for an f32 `what` ("parameter", "tensor"): any float dtype, converted;
    integers and booleans are refused (a silent cast would hand the model class ids or masks
    as weights)."""
    if entry["dtype"] not in FLOAT_DTYPES:
        return np.empty(0), (f"'{name}' is {entry['dtype']} in the file, but it is a "
                             f"floating-point {what} here (f32): vkml reads F32, F16, BF16 and "
                             "F64 into it and never casts integers or booleans")
    converted, overflowed = to_f32(decode(name, entry))
    if overflowed is not None and overflowed.any():
        return converted, f"'{name}' holds F64 values beyond the range of f32"
    return converted, ""


def to_f32(value: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A float array as contiguous f32, and where its finite values became infinite on the
    way, past f32's range (None for dtypes that cannot hold such values: no pass over them),
    for the caller to refuse by name (a file's tensor; set_input's, set_param's values)."""
    with np.errstate(over="ignore"):
        converted = np.ascontiguousarray(value, dtype=np.float32)
    if value.dtype.itemsize <= 4:
        return converted, None
    return converted, np.isinf(converted) & np.isfinite(value)


def _as_extra(name: str, entry: Mapping[str, Any], dtype: np.dtype) -> tuple[np.ndarray, str]:
    """A file's tensor for an extra of `dtype`: the same kind of number, converted exactly."""
    value = decode(name, entry)
    kind = {"b": "booleans", "i": "integers", "u": "integers", "f": "floats"}
    if kind.get(value.dtype.kind) != kind.get(dtype.kind):
        return value, (f"'{name}' is {entry['dtype']} in the file; this graph keeps "
                       f"{kind.get(dtype.kind, dtype.name)} ({dtype.name}) there")
    converted = value.astype(dtype)
    if not np.array_equal(converted, value):
        return value, f"'{name}' holds values that {dtype.name} cannot represent"
    return converted, ""


def _saved_hyperparams(plan: Any, metadata: Mapping[str, str],
                       tensors: Mapping[str, Mapping[str, Any]],
                       current: Mapping[str, float]) -> tuple[list[str], dict[str, float] | None]:
    """Why the file's optimizer state does not fit this session's optimizer, if it does not
    (another kind: SGD's hyperparameters read as Adam's would set beta1 = beta2 = eps = 0;
    other hyperparameter names; values torch.optim would refuse; a value the compiled update
    depends on, such as momentum where this session's SGD was compiled without it), and else
    the file's hyperparameters as float64 (None where it has none): the exact values saved in
    its metadata, or this session's own, wherever they round to the file's f32 values (the
    optimizer's host-side tables are computed from them, as from the user's values)."""
    optimizer = plan.optimizer
    kind = type(optimizer).__name__
    saved = metadata.get("optimizer")
    if saved is None:
        return ["it holds optimizer state but does not say which optimizer wrote it (no "
                "'optimizer' in its metadata), so it cannot be checked against this session's "
                f"{kind}"], None
    if saved != kind:
        return [f"it holds {saved} optimizer state, and this session's optimizer is {kind}"], None
    names = metadata.get("hyperparams", "").split(",")
    if names != list(plan.hyperparams):
        return [f"its {kind} optimizer has hyperparameters {names}, this session's has "
                f"{list(plan.hyperparams)} (another vkml version?)"], None
    entry = tensors.get(HYPERPARAMS)
    if entry is None or tuple(entry["shape"]) != (len(names),) or (
            entry["dtype"] not in FLOAT_DTYPES):
        return [], None  # the missing, shape and dtype checks name it
    stored = dict(zip(names, decode(HYPERPARAMS, entry).astype(np.float32).tolist()))
    t = stored.pop("t")
    try:
        exact = {str(k): float(v) for k, v in json.loads(metadata.get(EXACT, "{}")).items()}
    except (ValueError, TypeError, AttributeError):
        exact = {}  # vkml wrote it: never malformed, but then the f32 values serve
    values: dict[str, float] = {}
    for n, v in stored.items():
        candidates = [current.get(n), exact.get(n)]
        values[n] = next((c for c in candidates if c is not None and np.float32(c) == v), v)
    problems = []
    if not (np.isfinite(t) and t >= 0 and t == int(t)):
        problems.append(f"its step count t={t} is not a count")
    try:
        optimizer.check(values)
    except InputError as exc:
        problems.append(f"its hyperparameters are invalid: {exc}")
    # A hyperparameter the update's code depends on (SGD's momentum when compiled without
    # it, nesterov) is compiled in: the file's value would be ignored in silence.
    differ = [f"{n}={values[n]:g} (this session: {float(getattr(optimizer, n)):g})"
              for n in optimizer.fixed if np.float32(getattr(optimizer, n)) != stored[n]]
    if differ:
        problems.append(f"its {kind} optimizer has {', '.join(differ)}, which the compiled "
                        "update depends on: compile the session with those values to resume "
                        "this optimizer state")
    return problems, None if problems else values


def _path(path: object, verb: str) -> str:
    """A checkpoint's path as a str (bytes decoded as the OS names files), or CheckpointError."""
    try:
        return os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
    except TypeError:
        raise CheckpointError(f"cannot {verb} a checkpoint at {path!r}: give its path, a str or "
                              "an os.PathLike such as pathlib.Path") from None


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:limit])
    return f"[{shown}" + (f", and {len(names) - limit} more]" if len(names) > limit else "]")


def _targets(bound: BoundPlan) -> dict[str, Slot]:
    """Every tensor a checkpoint holds, by its name there."""
    plan = bound.plan
    targets = {n: plan.slots[s] for n, s in plan.params.items()}
    for param, slots in plan.optimizer_state.items():
        targets |= {f"{STATE_PREFIX}{param}/{k}": plan.slots[s] for k, s in slots.items()}
    if plan.hyperparams_slot is not None:
        targets[HYPERPARAMS] = plan.slots[plan.hyperparams_slot]
    return targets
