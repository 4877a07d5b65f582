"""Shape ops that move elements by index: slice, zero-pad, concat (along one axis), and the
embedding gather with its deterministic scatter-add gradient. Each lowers to the gather archetype
(vkml/kernels/gather.py) with the WGSL body defined beside it: one thread per output element,
reading its inputs at computed addresses (a pointwise body cannot: it reads every input at a
strided offset, with no offsets and no choice of input). Split is slices and nearest upsampling
a broadcast (ops/composite.py)."""

from __future__ import annotations

from collections.abc import Sequence

from vkml.errors import GraphError
from vkml.expr import contiguous_strides
from vkml.graph import Graph, OpDef, Tensor, builder, register
from vkml.kernels import gather
from vkml.kernels.common import offset


def _axis_of(x, axis: int) -> int:
    if not -len(x.shape) <= axis < len(x.shape):
        raise GraphError(f"axis {axis} is out of range for shape {x.shape}")
    return axis % len(x.shape)


def _slice(inputs, attrs):
    (x,) = inputs
    axis, start, stop = _axis_of(x, attrs["axis"]), attrs["start"], attrs["stop"]
    if not 0 <= start < stop <= x.shape[axis]:
        raise GraphError(f"slice [{start}:{stop}] is empty or outside axis {axis} of {x.shape}")
    return tuple(stop - start if a == axis else d for a, d in enumerate(x.shape)), x.dtype


def _slice_grad(g, node, d):
    (x,) = node.inputs
    a = node.attrs
    axis = a["axis"] % len(x.shape)
    return [g.pad(d, axis, a["start"], x.shape[axis] - a["stop"])]


def _slice_body(node: Tensor) -> list[str]:
    (x,) = node.inputs
    axis = node.attrs["axis"] % len(node.shape)
    idx = [f"({n} + {node.attrs['start']}u)" if a == axis else n
           for a, n in enumerate(_indices(node))]
    return [f"  out[idx] = in0[{offset(idx, contiguous_strides(x.shape))}];"]


register(OpDef("slice", _slice, "kernel", grad=_slice_grad, lower=gather.lowering(_slice_body)))


@builder
def slice(g: Graph, x: Tensor, axis: int, start: int, stop: int) -> Tensor:  # noqa: A001
    """x[..., start:stop, ...] along `axis` (step 1, non-negative bounds)."""
    return g.apply("slice", [x], axis=int(axis), start=int(start), stop=int(stop))


def _pad(inputs, attrs):
    (x,) = inputs
    axis, before, after = _axis_of(x, attrs["axis"]), attrs["before"], attrs["after"]
    if before < 0 or after < 0:
        raise GraphError(f"pad amounts must be >= 0, got ({before}, {after})")
    return tuple(d + before + after if a == axis else d for a, d in enumerate(x.shape)), x.dtype


def _pad_grad(g, node, d):
    (x,) = node.inputs
    axis = node.attrs["axis"] % len(x.shape)
    before = node.attrs["before"]
    return [g.slice(d, axis, before, before + x.shape[axis])]


def _pad_body(node: Tensor) -> list[str]:
    (x,) = node.inputs
    axis = node.attrs["axis"] % len(node.shape)
    before, extent = node.attrs["before"], x.shape[axis]
    idx = [f"({n} - {before}u)" if a == axis else n for a, n in enumerate(_indices(node))]
    return ["  var v = 0.0;",
            f"  if (i{axis} >= {before}u && i{axis} < {before + extent}u) {{",
            f"    v = in0[{offset(idx, contiguous_strides(x.shape))}];", "  }",
            "  out[idx] = v;"]


register(OpDef("pad", _pad, "kernel", grad=_pad_grad, lower=gather.lowering(_pad_body)))


@builder
def pad(g: Graph, x: Tensor, axis: int, before: int, after: int) -> Tensor:
    """Zero padding along one axis."""
    return g.apply("pad", [x], axis=int(axis), before=int(before), after=int(after))


def _concat(inputs, attrs):
    first = inputs[0]
    axis = _axis_of(first, attrs["axis"])
    for x in inputs[1:]:
        if (len(x.shape) != len(first.shape) or x.dtype != first.dtype
                or any(p != q for a, (p, q) in enumerate(zip(x.shape, first.shape)) if a != axis)):
            raise GraphError(f"concat along axis {axis}: {x.type} does not match {first.type}")
    total = sum(x.shape[axis] for x in inputs)
    return tuple(total if a == axis else d for a, d in enumerate(first.shape)), first.dtype


def _concat_grad(g, node, d):
    axis = node.attrs["axis"] % len(node.shape)
    out, start = [], 0
    for x in node.inputs:
        out.append(g.slice(d, axis, start, start + x.shape[axis]))
        start += x.shape[axis]
    return out


def _concat_body(node: Tensor) -> list[str]:
    axis = node.attrs["axis"] % len(node.shape)
    lines, start = [], 0
    for k, x in enumerate(node.inputs):
        stop = start + x.shape[axis]
        idx = [f"({n} - {start}u)" if a == axis else n for a, n in enumerate(_indices(node))]
        head = "if" if k == 0 else "} else if"
        cond = f"i{axis} < {stop}u" if k < len(node.inputs) - 1 else "true"
        lines += [f"  {head} ({cond}) {{",
                  f"    out[idx] = in{k}[{offset(idx, contiguous_strides(x.shape))}];"]
        start = stop
    return [*lines, "  }"]


register(OpDef("concat", _concat, "kernel", grad=_concat_grad,
               lower=gather.lowering(_concat_body)))


@builder
def concat(g: Graph, xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """torch.cat along `axis`."""
    if len(xs) == 1:
        return xs[0]
    return g.apply("concat", list(xs), axis=int(axis))


def _rotate_half(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32" or not x.shape or x.shape[-1] % 2:
        raise GraphError(f"rotate_half needs an f32 tensor with an even last axis, got {x.type}")
    return x.shape, x.dtype


def _rotate_half_grad(g, node, d):
    # a quarter turn in each (x1, x2) plane: its transpose is the opposite turn
    return [g.neg(g.rotate_half(d))]


def _rotate_half_body(node: Tensor) -> list[str]:
    half = node.shape[-1] // 2
    return [f"  if (i{len(node.shape) - 1} < {half}u) {{ out[idx] = -in0[idx + {half}u]; }}"
            f" else {{ out[idx] = in0[idx - {half}u]; }}"]


register(OpDef("rotate_half", _rotate_half, "kernel", grad=_rotate_half_grad,
               lower=gather.lowering(_rotate_half_body)))


@builder(tensor=True)
def rotate_half(g: Graph, x: Tensor) -> Tensor:
    """concat([-x2, x1], -1) for x = concat([x1, x2], -1) (RoPE's rotation), one kernel."""
    return g.apply("rotate_half", [x])


def _embedding(inputs, attrs):
    weight, ids = inputs
    if len(weight.shape) != 2 or weight.dtype != "f32":
        raise GraphError(f"embedding weight must be f32 (rows, dim), got {weight.type}")
    if ids.dtype != "i32":
        raise GraphError(f"embedding ids must be i32, got {ids.type}")
    return (*ids.shape, weight.shape[1]), "f32"


# Positions one embedding-gradient kernel scans: its loops stay within what CPU drivers run
# (lavapipe stops an invocation's loops after 65535 iterations); longer runs are summed in parts.
MAX_POSITIONS = 32768


def _embedding_grad(g, node, d):
    weight, ids = node.inputs
    rows, dim = weight.shape
    flat_ids, flat_d = g.reshape(ids, (ids.size,)), g.reshape(d, (ids.size, dim))
    total = None
    for start in range(0, ids.size, MAX_POSITIONS):
        stop = min(start + MAX_POSITIONS, ids.size)
        part_ids = flat_ids if stop - start == ids.size else g.slice(flat_ids, 0, start, stop)
        part_d = flat_d if stop - start == ids.size else g.slice(flat_d, 0, start, stop)
        first = g.apply("embedding_first_use", [part_ids], rows=rows)
        part = g.apply("embedding_backward", [part_d, part_ids, first], rows=rows)
        total = part if total is None else g.add(total, part)
    return [total, None]


def _embedding_body(node: Tensor) -> list[str]:
    weight, _ = node.inputs
    rows, dim = weight.shape
    # An id outside [0, rows) reads the nearest row rather than outside the buffer.
    return [f"  let row = u32(clamp(in1[idx / {dim}u], 0, {rows - 1}));",
            f"  out[idx] = in0[row * {dim}u + idx % {dim}u];"]


register(OpDef("embedding", _embedding, "kernel", grad=_embedding_grad,
               lower=gather.lowering(_embedding_body)))


@builder
def embedding(g: Graph, ids: Tensor, weight: Tensor) -> Tensor:
    """F.embedding(ids, weight): rows of `weight` (rows, dim) at i32 `ids` -> (*ids, dim)."""
    return g.apply("embedding", [weight, ids])


# d weight[v, j] = sum over positions p with ids[p] == v of d[p, j], deterministically (no float
# atomics), in two kernels: the first position of each row among the ids (-1: unused), then one
# thread per weight element, which for a used row sums from that position on and otherwise
# writes 0. A vocabulary is mostly unused in a step, so most threads only write.
def _first_use(inputs, attrs):
    return (attrs["rows"],), "i32"


def _first_use_body(node: Tensor) -> list[str]:
    (ids,) = node.inputs
    return ["  var first = -1;",
            f"  for (var p = 0u; p < {ids.size}u; p++) {{",
            "    if (in0[p] == i32(idx)) { first = i32(p); break; }", "  }",
            "  out[idx] = first;"]


register(OpDef("embedding_first_use", _first_use, "kernel",
               lower=gather.lowering(_first_use_body)))


def _embedding_backward(inputs, attrs):
    d, ids, _ = inputs
    return (attrs["rows"], d.shape[-1]), "f32"


def _embedding_backward_body(node: Tensor) -> list[str]:
    d, ids, _ = node.inputs
    dim, positions = d.shape[-1], ids.size
    return [f"  let row = idx / {dim}u; let col = idx % {dim}u;",
            "  var acc = 0.0;",
            "  let first = in2[row];",
            "  if (first >= 0) {",
            f"    for (var p = u32(first); p < {positions}u; p++) {{",
            f"      if (in1[p] == i32(row)) {{ acc += in0[p * {dim}u + col]; }}", "    }", "  }",
            "  out[idx] = acc;"]


register(OpDef("embedding_backward", _embedding_backward, "kernel",
               lower=gather.lowering(_embedding_backward_body)))


def _indices(node: Tensor) -> list[str]:
    """The output's index variables in the gather kernel: i0, i1, ..."""
    return [f"i{a}" for a in range(len(node.shape))]
