"""Pointwise archetype: one thread per output element; each input read through its own strides,
which covers broadcasting, transposition, one-hot encoding and fused pointwise DAGs with a
single generator."""

from __future__ import annotations

from ..backend import Capabilities
from ..graph import Tensor
from ..ops import body_of, contiguous_strides
from . import Kernel
from .common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    body_lines,
    grid,
    helper_functions,
    offset,
    storage,
    unflatten,
)

WORKGROUP = 256


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    body = body_of(node)
    own = contiguous_strides(node.shape)
    index_names = [f"i{a}" for a in range(len(node.shape))]
    reads = {k: f"in{k}[{'idx' if s == own else offset(index_names, s)}]"
             for k, s in enumerate(body.strides)}
    lines = helper_functions(body)
    lines += [storage(k, f"in{k}", x.dtype) for k, x in enumerate(node.inputs)]
    lines.append(storage(len(node.inputs), "out", node.dtype, writable=True))
    lines += [f"@compute @workgroup_size({WORKGROUP})", f"fn main({ENTRY_ARGS}) {{",
              f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
              f"  if (idx >= {node.size}u) {{ return; }}",
              # Unused axis indices cost nothing: the driver's compiler drops them.
              *unflatten("idx", node.shape, "i"),
              *body_lines(body, reads, "  ", "out[idx] ="), "}"]
    return Kernel(name=f"{node.op}_{'x'.join(map(str, node.shape)) or 'scalar'}",
                  wgsl="\n".join(lines) + "\n",
                  writable=(False,) * len(node.inputs) + (True,),
                  groups=grid(-(-node.size // WORKGROUP), caps))
