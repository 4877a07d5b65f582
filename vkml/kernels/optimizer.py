"""Optimizer archetype: the step-count kernel and one pointwise update kernel per parameter."""

from __future__ import annotations

from vkml.hal import Capabilities
from vkml.kernels import Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, grid, storage
from vkml.optim import Optimizer

WORKGROUP = 256


def hyperparam_names(optimizer: Optimizer) -> list[str]:
    """Layout of the hyperparameter buffer: the optimizer's values, then the step count."""
    return [*optimizer.hyperparams(), "t"]


def step_counter(optimizer: Optimizer) -> Kernel:
    slot = len(hyperparam_names(optimizer)) - 1
    wgsl = "\n".join([storage(0, "hp", writable=True), "@compute @workgroup_size(1)",
                      f"fn main() {{ hp[{slot}] = hp[{slot}] + 1.0; }}"]) + "\n"
    return Kernel(name="optimizer_step_count", wgsl=wgsl, writable=(True,), groups=(1, 1, 1))


def update(optimizer: Optimizer, size: int, caps: Capabilities) -> Kernel:
    """Bindings: parameter, gradient, hyperparameters, then each state tensor."""
    states = optimizer.state_names
    lines = [storage(0, "param", writable=True), storage(1, "grad"), storage(2, "hp")]
    lines += [storage(3 + k, f"{name}_buf", writable=True) for k, name in enumerate(states)]
    lines += [f"@compute @workgroup_size({WORKGROUP})", f"fn main({ENTRY_ARGS}) {{",
              f"  let i = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
              f"  if (i >= {size}u) {{ return; }}"]
    lines += [f"  let {name} = hp[{k}];" for k, name in enumerate(hyperparam_names(optimizer))]
    lines += ["  var p = param[i];", "  var g = grad[i];"]
    lines += [f"  var {name} = {name}_buf[i];" for name in states]
    lines += ["  " + s for s in optimizer.update().splitlines() if s]
    lines += ["  param[i] = p;"] + [f"  {name}_buf[i] = {name};" for name in states] + ["}"]
    return Kernel(name=f"{type(optimizer).__name__.lower()}_update_{size}",
                  wgsl="\n".join(lines) + "\n",
                  writable=(True, False, False) + (True,) * len(states),
                  groups=grid(-(-size // WORKGROUP), caps))
