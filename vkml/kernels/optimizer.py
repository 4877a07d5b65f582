"""Optimizer archetype: the step-count kernel and one pointwise update kernel per parameter. The
hyperparameter buffer's layout (`hyperparams`: a name per f32, the step count "t" among them)
comes from the plan."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, grid
from vkml.optim import Optimizer

WORKGROUP = 256


def step_counter(hyperparams: Sequence[str], caps: Capabilities) -> Kernel:
    t = list(hyperparams).index("t")
    return assemble("optimizer_step_count", caps, [Buf("hp", writable=True)], (1,),
                    [f"fn main() {{ hp[{t}] = hp[{t}] + 1.0; }}"], (1, 1, 1), flops=1, nbytes=8)


def update(optimizer: Optimizer, size: int, hyperparams: Sequence[str],
           caps: Capabilities) -> Kernel:
    """Bindings: parameter, gradient, hyperparameters, then each state tensor."""
    states = optimizer.state_names
    buffers = [Buf("param", writable=True), Buf("grad"), Buf("hp"),
               *[Buf(f"{name}_buf", writable=True) for name in states]]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let i = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (i >= {size}u) {{ return; }}",
             *[f"  let {name} = hp[{k}];" for k, name in enumerate(hyperparams)],
             "  var p = param[i];", "  var g = grad[i];",
             *[f"  var {name} = {name}_buf[i];" for name in states],
             *["  " + s for s in optimizer.update().splitlines() if s],
             "  param[i] = p;", *[f"  {name}_buf[i] = {name};" for name in states], "}"]
    return assemble(f"{type(optimizer).__name__.lower()}_update_{size}", caps, buffers,
                    (WORKGROUP,), entry, grid(-(-size // WORKGROUP), caps), flops=16 * size,
                    nbytes=4 * size * (3 + 2 * len(states)))
