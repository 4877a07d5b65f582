"""Codegen, the last compile stage: Plan -> the same Plan with a Kernel for every dispatch.

Everything a kernel's bindings mean was decided before (what each dispatch reads and writes, which
pointwise results overwrite an input, where each tensor lives), so each dispatch is lowered once,
and a kernel that disagrees with its dispatch about a binding's access is a codegen bug caught
here. Device rules (tile shapes, read-only bindings, CPU-driver variants) come from `caps`.

A lowering is a function of the node's op, shape, dtype and attributes, its inputs' shapes and
dtypes, and the target: never of the node's identity, name or place in the graph. So dispatches
that agree on those (a model's repeated layers, the backward pass of each) share one Kernel,
generated once (`lowering_key`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from vkml.compiler.plan import Plan, PlannedDispatch
from vkml.compiler.schedule import Scheduled
from vkml.expr import Body
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import optimizer, pointwise


def generate(scheduled: Scheduled, caps: Capabilities) -> Plan:
    """The scheduled plan with a kernel for every dispatch, the prologue's included."""
    plan = scheduled.plan
    targets = {True: phase_target(caps, True), False: phase_target(caps, False)}
    made: dict[tuple, Kernel] = {}
    dispatches = []
    for d, node in zip((*plan.prologue, *plan.dispatches), scheduled.nodes):
        target = targets[d.phase == "forward"]
        key = dispatch_key(d, node, target)
        kernel = made.get(key) if key is not None else None
        if kernel is None:
            kernel = lower_dispatch(d, node, plan, target)
            if kernel.access != d.access:
                raise AssertionError(f"codegen of {d.label}: the kernel's bindings "
                                     f"{kernel.access} disagree with the plan's {d.access}")
            if key is not None:
                made[key] = kernel
        dispatches.append(dataclasses.replace(d, kernel=kernel))
    hoisted = len(plan.prologue)
    return dataclasses.replace(plan, prologue=tuple(dispatches[:hoisted]),
                               dispatches=tuple(dispatches[hoisted:]))


def dispatch_key(d: PlannedDispatch, node: Tensor | None, caps: Capabilities) -> tuple | None:
    """What the dispatch's kernel is a function of (see the module's doc), or None where that
    cannot be told (an attribute of a type `lowering_key` does not know): lowered on its own.
    Optimizer updates: the optimizer object is the plan's one, the same for every update."""
    if d.update is not None:
        return ("update", id(d.update.optimizer), d.update.size, d.access, caps)
    assert node is not None
    key = lowering_key(node)
    return None if key is None else (key, d.in_place, d.access, caps)


class Unkeyable(Exception):
    """An attribute value `value_key` cannot represent faithfully."""


def lowering_key(node: Tensor) -> tuple | None:
    """A hashable value that determines `node`'s kernel, given the target; None if an
    attribute's value cannot be keyed faithfully."""
    try:
        return (node.op, node.shape, node.dtype, value_key(node.attrs),
                tuple((x.shape, x.dtype) for x in node.inputs))
    except Unkeyable:
        return None


def value_key(v: Any) -> Any:
    """A hashable value equal for attribute values that lower alike. Types are part of the key
    and numbers go by repr: 1 and 1.0, or 0.0 and -0.0, are equal in Python but may be written
    differently into the WGSL."""
    if v is None or isinstance(v, (bool, int, float, str, np.generic)):
        return type(v).__name__, repr(v)
    if isinstance(v, (tuple, list)):
        return type(v).__name__, tuple(value_key(x) for x in v)
    if isinstance(v, dict):
        return "dict", tuple((k, value_key(x)) for k, x in v.items())
    if isinstance(v, Body):
        return "Body", v.structure()
    if isinstance(v, np.ndarray):
        return "ndarray", v.dtype.str, v.shape, v.tobytes()
    raise Unkeyable(type(v))


def phase_target(caps: Capabilities, forward: bool) -> Capabilities:
    """Accelerated (f16) products in the backward pass scale their operands: gradients are
    often far below f16's smallest normal (6e-5) and would be flushed without it
    (Capabilities.scaled_operands). bfloat16 has f32's exponent range: nothing to scale."""
    if forward or caps.precision != "f16":
        return caps
    return dataclasses.replace(caps, scaled_operands=True)


def lower_dispatch(d: PlannedDispatch, node: Tensor | None, plan: Plan,
                   caps: Capabilities) -> Kernel:
    if d.update is not None:
        if d.update.size == 0:
            return optimizer.step_counter(plan.hyperparams, d.update.guarded, d.update.checks,
                                          caps)
        return optimizer.update(d.update.optimizer, d.update.size, plan.hyperparams,
                                list(plan.optimizer_tables), d.update.guarded, d.update.checks,
                                caps)
    assert node is not None
    if d.in_place is not None:
        return pointwise.generate(node, caps, in_place=d.in_place)
    return lower_node(node, caps)


def lower_node(node: Tensor, caps: Capabilities) -> Kernel:
    """The kernel computing `node` from its inputs (bindings: inputs in order, then output):
    the pointwise generator for pointwise ops, else the op's own lowering."""
    opdef = OPS[node.op]
    if opdef.kind == "pointwise":
        return pointwise.generate(node, caps)
    if opdef.lower is None:
        raise ValueError(f"{node.label}: a {opdef.kind} op has no kernel")
    return opdef.lower(node, caps)
