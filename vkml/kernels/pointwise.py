"""Pointwise archetype: one thread per output element; each input read through its own strides,
which covers broadcasting, transposition, one-hot encoding and fused pointwise DAGs with a
single generator."""

from __future__ import annotations

from vkml.expr import in_order
from vkml.graph import Tensor, body_of
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    Buf,
    assemble,
    body_lines,
    grid,
    helper_functions,
    offset,
    unflatten,
)

WORKGROUP = 256


def generate(node: Tensor, caps: Capabilities, in_place: int | None = None) -> Kernel:
    """Bindings: the inputs, then the output; with `in_place` = k the result overwrites input k
    (read at the same index it is written) and there is no output binding."""
    body = body_of(node)
    index_names = [f"i{a}" for a in range(len(node.shape))]
    reads = {k: f"in{k}[{'idx' if in_order(s, node.shape) else offset(index_names, s)}]"
             for k, s in enumerate(body.strides)}
    buffers = [Buf(f"in{k}", x.dtype, writable=k == in_place) for k, x in enumerate(node.inputs)]
    if in_place is None:
        buffers.append(Buf("out", node.dtype, writable=True))
    target = "out" if in_place is None else f"in{in_place}"
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {node.size}u) {{ return; }}",
             # Unused axis indices cost nothing: the driver's compiler drops them.
             *unflatten("idx", node.shape, "i"),
             *body_lines(body, reads, "  ", f"{target}[idx] ="), "}"]
    suffix = "" if in_place is None else f"_inplace{in_place}"
    return assemble(f"{node.op}_{'x'.join(map(str, node.shape)) or 'scalar'}{suffix}", caps,
                    buffers, (WORKGROUP,), entry, grid(-(-node.size // WORKGROUP), caps),
                    prelude=helper_functions(body), flops=node.size * 4,
                    nbytes=4 * node.size * len(buffers))
