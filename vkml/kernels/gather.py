"""Gather archetype: one thread per output element, which computes the addresses it reads (slice,
pad, concat, embedding) or scans for the positions it sums (the embedding's scatter-add
gradient, deterministic: no float atomics). Shapes are baked in as constants."""

from __future__ import annotations

import numpy as np

from vkml.graph import Tensor
from vkml.hal import Capabilities, Kernel
from vkml.kernels.common import (
    ENTRY_ARGS,
    LINEAR_WORKGROUP,
    Buf,
    assemble,
    grid,
    offset,
    unflatten,
)
from vkml.ops import contiguous_strides

WORKGROUP = 64


def _body(node: Tensor) -> list[str]:
    """WGSL lines setting `out[idx]`, given idx and the output indices i0, i1, ..."""
    names = [f"i{a}" for a in range(len(node.shape))]
    if node.op in ("slice", "pad", "concat"):
        axis = node.attrs["axis"] % len(node.shape)
    if node.op == "slice":
        (x,) = node.inputs
        idx = [f"({n} + {node.attrs['start']}u)" if a == axis else n for a, n in enumerate(names)]
        return [f"  out[idx] = in0[{offset(idx, contiguous_strides(x.shape))}];"]
    if node.op == "pad":
        (x,) = node.inputs
        before, extent = node.attrs["before"], x.shape[axis]
        idx = [f"({n} - {before}u)" if a == axis else n for a, n in enumerate(names)]
        return ["  var v = 0.0;",
                f"  if (i{axis} >= {before}u && i{axis} < {before + extent}u) {{",
                f"    v = in0[{offset(idx, contiguous_strides(x.shape))}];", "  }",
                "  out[idx] = v;"]
    if node.op == "concat":
        lines, start = [], 0
        for k, x in enumerate(node.inputs):
            stop = start + x.shape[axis]
            idx = [f"({n} - {start}u)" if a == axis else n for a, n in enumerate(names)]
            head = "if" if k == 0 else "} else if"
            cond = f"i{axis} < {stop}u" if k < len(node.inputs) - 1 else "true"
            lines += [f"  {head} ({cond}) {{",
                      f"    out[idx] = in{k}[{offset(idx, contiguous_strides(x.shape))}];"]
            start = stop
        return [*lines, "  }"]
    if node.op == "embedding":
        weight, _ = node.inputs
        rows, dim = weight.shape
        # An id outside [0, rows) reads the nearest row rather than outside the buffer.
        return [f"  let row = u32(clamp(in1[idx / {dim}u], 0, {rows - 1}));",
                f"  out[idx] = in0[row * {dim}u + idx % {dim}u];"]
    if node.op == "embedding_backward":
        d, ids = node.inputs
        dim, positions = d.shape[-1], ids.size
        return [f"  let row = i32(idx / {dim}u); let col = idx % {dim}u;",
                "  var acc = 0.0;",
                f"  for (var p = 0u; p < {positions}u; p++) {{",
                f"    if (in1[p] == row) {{ acc += in0[p * {dim}u + col]; }}", "  }",
                "  out[idx] = acc;"]
    if node.op == "amax":
        (x,) = node.inputs
        axes = node.attrs["axes"]
        reduced = tuple(x.shape[a] for a in axes)
        count = int(np.prod(reduced, dtype=np.int64))
        kept_names = iter(names)
        index = [f"j{axes.index(a)}" if a in axes else next(kept_names)
                 for a in range(len(x.shape))]
        return ["  var m = -3.4028235e38;",
                f"  for (var r = 0u; r < {count}u; r++) {{",
                *["  " + line for line in unflatten("r", reduced, "j")],
                f"    m = max(m, in0[{offset(index, contiguous_strides(x.shape))}]);", "  }",
                "  out[idx] = m;"]
    raise ValueError(f"{node.label}: no gather kernel")


def generate(node: Tensor, caps: Capabilities) -> Kernel:
    buffers = [*[Buf(f"in{k}", x.dtype) for k, x in enumerate(node.inputs)],
               Buf("out", node.dtype, writable=True)]
    entry = [f"fn main({ENTRY_ARGS}) {{",
             f"  let idx = ({LINEAR_WORKGROUP}) * {WORKGROUP}u + lid;",
             f"  if (idx >= {node.size}u) {{ return; }}",
             *unflatten("idx", node.shape, "i"), *_body(node), "}"]
    return assemble(f"{node.op}_{'x'.join(map(str, node.shape))}", caps, buffers, (WORKGROUP,),
                    entry, grid(-(-node.size // WORKGROUP), caps), flops=node.size,
                    nbytes=4 * (node.size + sum(x.size for x in node.inputs)))
