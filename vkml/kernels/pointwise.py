"""Pointwise archetype: one thread per output element; each input read through its own strides,
which covers broadcasting, transposition and one-hot encoding with a single generator."""

from __future__ import annotations

from ..backend import Capabilities
from ..graph import Tensor
from ..ops import OPS, contiguous_strides, input_strides
from . import Kernel
from .common import ENTRY_ARGS, LINEAR_WORKGROUP, grid, offset, storage, unflatten

WORKGROUP = 256


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    opdef = OPS[node.op]
    assert opdef.expr is not None
    out_shape = node.shape
    own = contiguous_strides(out_shape)
    index_names = [f"i{a}" for a in range(len(out_shape))]
    expr = opdef.expr(node)

    lines = [opdef.helpers.strip()] if opdef.helpers else []
    lines += [storage(k, f"in{k}", x.dtype) for k, x in enumerate(node.inputs)]
    lines.append(storage(len(node.inputs), "out", node.dtype, writable=True))
    lines += [f"@compute @workgroup_size({WORKGROUP})", f"fn main({ENTRY_ARGS}) {{",
              f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
              f"  if (idx >= {node.size}u) {{ return; }}"]
    strides = input_strides(node)
    # Unused axis indices cost nothing: the driver's compiler drops them.
    lines += unflatten("idx", out_shape, "i")
    for k, s in enumerate(strides):
        at = "idx" if s == own else offset(index_names, s)
        lines.append(f"  let x{k} = in{k}[{at}];")
    lines += [f"  out[idx] = {expr};", "}"]
    return Kernel(name=f"{node.op}_{'x'.join(map(str, out_shape)) or 'scalar'}",
                  wgsl="\n".join(lines) + "\n",
                  writable=(False,) * len(node.inputs) + (True,),
                  groups=grid(-(-node.size // WORKGROUP), caps))
