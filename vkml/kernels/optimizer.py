"""Optimizer archetype: the step-count kernel and one pointwise update kernel per parameter. The
hyperparameter buffer's layout (`hyperparams`: a name per f32, the step count "t" among them)
and the tables computed on the host come from the plan. `guarded` kernels read the loss (bound
after the tables) and change nothing unless it is finite: compile(..., check_finite=True); and
kernels with `checks` read that many index checks (bound last, vkml/ops/indexing.py) and change
nothing where one found an index out of range."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, grid
from vkml.optim import Optimizer

WORKGROUP = 256
# Not NaN and not infinite; no builtin says so in WGSL, and NaN fails every comparison.
FINITE = "abs(loss[0]) <= 3.4028235e38"


def _guards(guarded: bool, checks: int) -> tuple[list[Buf], list[str]]:
    """The bindings the guards read and the conditions under which nothing changes."""
    return ([*([Buf("loss")] if guarded else []), *[Buf(f"check{c}", "i32") for c in
                                                     range(checks)]],
            [*([f"!({FINITE})"] if guarded else []), *[f"check{c}[0] != 0" for c in
                                                       range(checks)]])


def step_counter(hyperparams: Sequence[str], guarded: bool, checks: int, caps: Capabilities
                 ) -> Kernel:
    t = list(hyperparams).index("t")
    buffers, skips = _guards(guarded, checks)
    skip = f"if ({' || '.join(skips)}) {{ return; }} " if skips else ""
    return assemble("optimizer_step_count", caps, [Buf("hp", writable=True), *buffers], (1,),
                    [f"fn main() {{ {skip}hp[{t}] = hp[{t}] + 1.0; }}"], (1, 1, 1), flops=1,
                    nbytes=8)


def update(optimizer: Optimizer, size: int, hyperparams: Sequence[str], tables: Sequence[str],
           guarded: bool, checks: int, caps: Capabilities) -> Kernel:
    """Bindings: parameter, gradient, hyperparameters, each state tensor, each table, the
    loss when guarded, and the index checks."""
    states = optimizer.state_names
    guards, skips = _guards(guarded, checks)
    buffers = [Buf("param", writable=True), Buf("grad"), Buf("hp"),
               *[Buf(f"{name}_buf", writable=True) for name in states],
               *[Buf(name) for name in tables], *guards]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let i = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if ({' || '.join([f'i >= {size}u', *skips])}) {{ return; }}",
             *[f"  let {name} = hp[{k}];" for k, name in enumerate(hyperparams)],
             "  var p = param[i];", "  var g = grad[i];",
             *[f"  var {name} = {name}_buf[i];" for name in states],
             *["  " + s for s in optimizer.update().splitlines() if s],
             "  param[i] = p;", *[f"  {name}_buf[i] = {name};" for name in states], "}"]
    return assemble(f"{type(optimizer).__name__.lower()}_update_{size}", caps, buffers,
                    (WORKGROUP,), entry, grid(-(-size // WORKGROUP), caps), flops=16 * size,
                    nbytes=4 * size * (3 + 2 * len(states)))
