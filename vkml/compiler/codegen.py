"""Codegen, the last compile stage: Plan -> the same Plan with a Kernel for every dispatch.

Everything a kernel's bindings mean was decided before (what each dispatch reads and writes, which
pointwise results overwrite an input, where each tensor lives), so each dispatch is lowered once,
and a kernel that disagrees with its dispatch about a binding's access is a codegen bug caught
here. Device rules (tile shapes, read-only bindings, CPU-driver variants) come from `caps`.
"""

from __future__ import annotations

import dataclasses

from vkml.compiler.schedule import Plan, PlannedDispatch
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels import optimizer, pointwise


def generate(plan: Plan, caps: Capabilities) -> Plan:
    dispatches = []
    for d in plan.dispatches:
        kernel = lower_dispatch(d, plan, phase_target(caps, d.phase == "forward"))
        if kernel.access != d.access:
            raise AssertionError(f"codegen of {d.label}: the kernel's bindings {kernel.access} "
                                 f"disagree with the plan's {d.access}")
        dispatches.append(dataclasses.replace(d, kernel=kernel))
    return dataclasses.replace(plan, dispatches=dispatches)


def phase_target(caps: Capabilities, forward: bool) -> Capabilities:
    """Accelerated (f16) products in the forward pass only: gradients are often far below f16's
    smallest normal (6e-5) and would be flushed without loss scaling, so the backward pass and
    the update stay f32."""
    if forward or caps.precision == "f32":
        return caps
    return dataclasses.replace(caps, precision="f32")


def lower_dispatch(d: PlannedDispatch, plan: Plan, caps: Capabilities) -> Kernel:
    if d.update is not None:
        if d.update.size == 0:
            return optimizer.step_counter(plan.hyperparams, d.update.guarded, caps)
        return optimizer.update(d.update.optimizer, d.update.size, plan.hyperparams,
                                list(plan.optimizer_tables), d.update.guarded, caps)
    assert d.node is not None
    if d.in_place is not None:
        return pointwise.generate(d.node, caps, in_place=d.in_place)
    return lower_node(d.node, caps)


def lower_node(node: Tensor, caps: Capabilities) -> Kernel:
    """The kernel computing `node` from its inputs (bindings: inputs in order, then output):
    the pointwise generator for pointwise ops, else the op's own lowering."""
    opdef = OPS[node.op]
    if opdef.kind == "pointwise":
        return pointwise.generate(node, caps)
    if opdef.lower is None:
        raise ValueError(f"{node.label}: a {opdef.kind} op has no kernel")
    return opdef.lower(node, caps)
