"""Reduction archetypes: one workgroup per output element (sum over any axes), and one
workgroup per row for softmax / log-softmax (max, sum of exponentials, write)."""

from __future__ import annotations

import numpy as np

from vkml.expr import Arg, Body
from vkml.graph import Tensor
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
    tree_reduce,
    unflatten,
)
from vkml.ops import contiguous_strides

WORKGROUP = 64
# lavapipe (llvmpipe) silently stops a shader invocation's loops after 65535 iterations in all;
# longer reductions get more threads per workgroup, so each thread loops fewer times.
LOOP_LIMIT = 65535


def workgroup_for(iterations: int, caps: Capabilities, what: str) -> int:
    """The smallest power-of-two workgroup (from WORKGROUP up) whose threads each run at most
    LOOP_LIMIT of `iterations` loop trips."""
    size = WORKGROUP
    while -(-iterations // size) > LOOP_LIMIT:
        size *= 2
        if size > caps.max_workgroup_invocations:
            raise ValueError(f"{what}: {iterations} loop trips exceed what "
                             f"{caps.max_workgroup_invocations} threads may run on this device")
    return size


def _input_offset(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[list[str], str]:
    """WGSL lines and the expression of the input offset of (output `o`, reduced index `r`)."""
    strides = contiguous_strides(shape)
    kept = [a for a in range(len(shape)) if a not in axes]
    reduced_count = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    kept_count = int(np.prod([shape[a] for a in kept], dtype=np.int64))
    if all(a >= len(shape) - len(axes) for a in axes):  # trailing axes: rows of a matrix
        return [], f"o * {reduced_count}u + r"
    if all(a < len(axes) for a in axes):  # leading axes: columns of a matrix
        return [], f"r * {kept_count}u + o"
    lines = unflatten("o", tuple(shape[a] for a in kept), "k")
    lines += ["    " + line.strip() for line in unflatten("r", tuple(shape[a] for a in axes), "j")]
    indices = {a: f"k{n}" for n, a in enumerate(kept)} | {a: f"j{n}" for n, a in enumerate(axes)}
    return lines, offset([indices[a] for a in range(len(shape))], strides)


def sum_parts(node: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], Body, Body, int]:
    """(summed tensor's shape, axes, prologue, epilogue, number of prologue inputs): a plain sum
    is the fused form with identity bodies."""
    if node.op == "fused_sum":
        a = node.attrs
        return a["in_shape"], a["axes"], a["prologue"], a["epilogue"], a["n_prologue"]
    (x,) = node.inputs
    identity = Body(Arg(0), (contiguous_strides(x.shape),))
    return x.shape, node.attrs["axes"], identity, Body(Arg(0), ((),)), 1


def generate_sum(node: Tensor, caps: Capabilities) -> Kernel:
    in_shape, axes, prologue, epilogue, n_prologue = sum_parts(node)
    reduced = int(np.prod([in_shape[a] for a in axes], dtype=np.int64))
    outputs = node.size
    setup, at = _input_offset(in_shape, axes)
    wg = workgroup_for(reduced, caps, node.label)
    out_index = [f"i{a}" for a in range(len(node.shape))]
    epilogue_reads = {0: "partial[0]"} | {
        k: f"in{n_prologue + k - 1}[{offset(out_index, epilogue.strides[k])}]"
        for k in range(1, len(epilogue.strides))}
    buffers = [*[Buf(f"in{k}") for k in range(len(node.inputs))], Buf("out", writable=True)]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let o = {LINEAR_WORKGROUP};",
             "  var acc = 0.0;",
             # Surplus workgroups of the 2-D grid skip the loads but join the barriers.
             f"  if (o < {outputs}u) {{",
             *[line for line in setup if line.lstrip().startswith("let k")],
             f"    for (var r = lid; r < {reduced}u; r += {wg}u) {{",
             *["  " + line for line in setup if line.lstrip().startswith("let j")],
             f"      let at = {at};",
             *body_lines(prologue, {k: f"in{k}[at]" for k in range(n_prologue)}, "      ",
                         "acc +="),
             "    }", "  }",
             "  partial[lid] = acc;",
             *tree_reduce("partial", wg, "{a} + {b}"),
             f"  if (lid == 0u && o < {outputs}u) {{",
             *unflatten("o", node.shape, "i"),
             *body_lines(epilogue, epilogue_reads, "    ", "out[o] ="), "  }", "}"]
    total = outputs * reduced
    return assemble(f"{node.op}_{'x'.join(map(str, in_shape))}_axes{''.join(map(str, axes))}",
                    caps, buffers, (wg,), entry, grid(outputs, caps),
                    prelude=[*helper_functions(prologue, epilogue),
                             f"var<workgroup> partial: array<f32, {wg}>;"],
                    flops=2 * total, nbytes=4 * (total * n_prologue + outputs))


def generate_softmax(node: Tensor, caps: Capabilities) -> Kernel:
    (x,) = node.inputs
    length = x.shape[-1]
    rows = x.size // length
    wg = workgroup_for(3 * length, caps, node.label)  # three passes over the row
    if node.op == "softmax":
        result = "exp(inp[base + c] - row_max) / row_sum"
    else:
        result = "inp[base + c] - row_max - log(row_sum)"
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let row = {LINEAR_WORKGROUP};",
             f"  let valid = row < {rows}u;",
             f"  let base = min(row, {rows - 1}u) * {length}u;",
             "  var m = -3.4028235e38;",
             f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
             "    m = max(m, inp[base + c]);", "  }",
             "  partial[lid] = m;",
             *tree_reduce("partial", wg, "max({a}, {b})"),
             "  let row_max = partial[0];",
             "  workgroupBarrier();",
             "  var s = 0.0;",
             f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
             "    s += exp(inp[base + c] - row_max);", "  }",
             "  partial[lid] = s;",
             *tree_reduce("partial", wg, "{a} + {b}"),
             "  let row_sum = partial[0];",
             "  if (!valid) { return; }",
             f"  for (var c = lid; c < {length}u; c += {wg}u) {{",
             f"    out[base + c] = {result};", "  }", "}"]
    return assemble(f"{node.op}_{rows}x{length}", caps, [Buf("inp"), Buf("out", writable=True)],
                    (wg,), entry, grid(rows, caps),
                    prelude=[f"var<workgroup> partial: array<f32, {wg}>;"],
                    flops=5 * x.size, nbytes=12 * x.size)
