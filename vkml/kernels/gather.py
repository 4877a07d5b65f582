"""Gather archetype: one thread per output element, which computes the addresses it reads (slice,
pad, concat, embedding, pooling windows) or scans for the positions it sums. The op supplies the
WGSL lines that set `out[idx]` from `idx` and the output's indices i0, i1, ... (see
vkml/ops/indexing.py); shapes are baked in as constants."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import ENTRY_ARGS, LINEAR_WORKGROUP, Buf, assemble, grid, unflatten

WORKGROUP = 64


def generate(node: Tensor, caps: Capabilities, body: Sequence[str], prelude: Sequence[str] = (),
             flops: int | None = None) -> Kernel:
    """Bindings: the inputs, then the output. `prelude`: WGSL functions the body calls."""
    buffers = [*[Buf(f"in{k}", x.dtype) for k, x in enumerate(node.inputs)],
               Buf("out", node.dtype, writable=True)]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {node.size}u) {{ return; }}",
             *unflatten("idx", node.shape, "i"), *body, "}"]
    return assemble(f"{node.op}_{'x'.join(map(str, node.shape))}", caps, buffers, (WORKGROUP,),
                    entry, grid(-(-node.size // WORKGROUP), caps), prelude=prelude,
                    flops=node.size if flops is None else flops,
                    nbytes=4 * (node.size + sum(x.size for x in node.inputs)))


def lowering(body: Callable[[Tensor], list[str]]) -> Callable[[Tensor, Capabilities], Kernel]:
    """An op's lowering from the function that writes its body."""
    return lambda node, caps: generate(node, caps, body(node))
