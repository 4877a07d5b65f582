"""Gather archetype: one thread per output element, which computes the addresses it reads (slice,
pad, concat, embedding, pooling windows) or scans for the positions it sums. The op supplies the
WGSL lines that set `out[idx]` from `idx` and the output's indices i0, i1, ... (see
vkml/ops/indexing.py); shapes are baked in as constants."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    Buf,
    assemble,
    check_loop,
    grid,
    tree_reduce,
    unflatten,
)

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


# Threads of the index check's one workgroup.
CHECK_WORKGROUP = 256


def index_check(node: Tensor, caps: Capabilities) -> Kernel:
    """The `index_check` kernel (vkml/ops/indexing.py): one workgroup scans every i32 operand k
    for values outside its [first, end) (`node.attrs["ranges"]`), and writes out = (1, k, the
    value, its flat position) for the first one, in operand order, or (0, 0, 0, 0): a check that
    needs no clearing between steps. Index operands are small (ids, labels, a gather's
    indices), so one workgroup keeps the kernel free of atomics."""
    operands, ranges = node.inputs, node.attrs["ranges"]
    starts = [0]
    for x in operands:
        starts.append(starts[-1] + x.size)
    check_loop(node, caps, -(-starts[-1] // CHECK_WORKGROUP),
               "index fewer elements with one op, or split the index tensor")
    scans = []
    for k, (x, (first, end)) in enumerate(zip(operands, ranges)):
        scans += [f"  for (var p = lid; p < {x.size}u; p += {CHECK_WORKGROUP}u) {{",
                  f"    let v = in{k}[p];",
                  f"    if (v < {first} || v >= {end}) {{ bad = min(bad, p + {starts[k]}u); "
                  "break; }", "  }"]
    report = []
    for k in range(len(operands)):
        head = "if" if k == 0 else "} else if"
        report += [f"    {head} (b < {starts[k + 1]}u) {{",
                   f"      k = {k}; at = b - {starts[k]}u; v = in{k}[at];"]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             "  var bad = 0xffffffffu;  // the first bad position, over the operands in order",
             *scans, "  first_bad[lid] = bad;",
             *tree_reduce("first_bad", CHECK_WORKGROUP, "min({a}, {b})"),
             "  if (lid == 0u) {", "    let b = first_bad[0];",
             "    var k = -1; var at = 0u; var v = 0;", *report, "    }",
             "    out[0] = select(0, 1, k >= 0); out[1] = max(k, 0); out[2] = v;",
             "    out[3] = i32(at);", "  }", "}"]
    buffers = [*[Buf(f"in{k}", "i32") for k in range(len(operands))],
               Buf("out", "i32", writable=True)]
    return assemble(f"index_check_{starts[-1]}", caps, buffers, (CHECK_WORKGROUP,), entry,
                    (1, 1, 1), prelude=[f"var<workgroup> first_bad: array<u32, "
                                        f"{CHECK_WORKGROUP}>;"],
                    flops=starts[-1], nbytes=4 * starts[-1])
