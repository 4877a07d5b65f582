"""Shape ops that move elements by index: slice, zero-pad, concat (along one axis), the embedding
gather and the gathers at index tensors (ONNX Gather and GatherElements), with their
deterministic scatter-add gradients. Each lowers to the gather archetype
(vkml/kernels/gather.py) with the WGSL body defined beside it: one thread per output element,
reading its inputs at computed addresses (a pointwise body cannot: it reads every input at a
strided offset, with no offsets and no choice of input). Split is slices and nearest upsampling
a broadcast (ops/composite.py)."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from vkml.errors import GraphError
from vkml.expr import contiguous_strides
from vkml.graph import Graph, OpDef, Tensor, builder, register
from vkml.hal import Capabilities, Kernel
from vkml.kernels import gather as kernels
from vkml.kernels.common import check_loop, offset
from vkml.ops.pointwise import broadcast_shapes


def _axis_of(x, axis: int) -> int:
    if not -len(x.shape) <= axis < len(x.shape):
        raise GraphError(f"axis {axis} is out of range for shape {x.shape}")
    return axis % len(x.shape)


def _slice(inputs, attrs):
    (x,) = inputs
    axis, start, stop = _axis_of(x, attrs["axis"]), attrs["start"], attrs["stop"]
    step = attrs.get("step", 1)
    if not 0 <= start < stop <= x.shape[axis] or step < 1:
        raise GraphError(f"slice [{start}:{stop}:{step}] is empty or outside axis {axis} of "
                         f"{x.shape}")
    count = -(-(stop - start) // step)
    return tuple(count if a == axis else d for a, d in enumerate(x.shape)), x.dtype


def _slice_grad(g, node, d):
    (x,) = node.inputs
    a = node.attrs
    axis, step = a["axis"] % len(x.shape), a.get("step", 1)
    last = a["start"] + (node.shape[axis] - 1) * step  # the last element taken
    return [g.pad(d, axis, a["start"], x.shape[axis] - 1 - last, stride=step)]


def _slice_body(node: Tensor) -> list[str]:
    (x,) = node.inputs
    axis, step = node.attrs["axis"] % len(node.shape), node.attrs.get("step", 1)
    taken = f"i{axis} * {step}u" if step != 1 else f"i{axis}"
    idx = [f"({taken} + {node.attrs['start']}u)" if a == axis else n
           for a, n in enumerate(_indices(node))]
    return [f"  out[idx] = in0[{offset(idx, contiguous_strides(x.shape))}];"]


register(OpDef("slice", _slice, "kernel", grad=_slice_grad, lower=kernels.lowering(_slice_body)))


@builder
def slice(g: Graph, x: Tensor, axis: int, start: int, stop: int,  # noqa: A001
          step: int = 1) -> Tensor:
    """x[..., start:stop:step, ...] along `axis`, the bounds as Python's (negative ones count
    from the end, both clipped to the axis), a positive step; an empty slice is refused."""
    if step >= 1:
        start, stop, _ = builtins.slice(int(start), int(stop)).indices(x.shape[_axis_of(x, axis)])
    attrs = {"step": int(step)} if step != 1 else {}
    return g.apply("slice", [x], axis=int(axis), start=int(start), stop=int(stop), **attrs)


def _pad(inputs, attrs):
    (x,) = inputs
    axis, before, after = _axis_of(x, attrs["axis"]), attrs["before"], attrs["after"]
    stride = attrs.get("stride", 1)
    if before < 0 or after < 0 or stride < 1:
        raise GraphError(f"pad amounts must be >= 0 and the stride >= 1, got ({before}, "
                         f"{after}) and {stride}")
    spread = (x.shape[axis] - 1) * stride + 1
    return tuple(spread + before + after if a == axis else d
                 for a, d in enumerate(x.shape)), x.dtype


def _pad_grad(g, node, d):
    (x,) = node.inputs
    axis = node.attrs["axis"] % len(x.shape)
    before, stride = node.attrs["before"], node.attrs.get("stride", 1)
    return [g.slice(d, axis, before, before + (x.shape[axis] - 1) * stride + 1, stride)]


def _pad_body(node: Tensor) -> list[str]:
    (x,) = node.inputs
    axis = node.attrs["axis"] % len(node.shape)
    before, extent, stride = node.attrs["before"], x.shape[axis], node.attrs.get("stride", 1)
    spread = (extent - 1) * stride + 1
    inside = f"i{axis} >= {before}u && i{axis} < {before + spread}u"
    at = f"({{}} - {before}u)" if stride == 1 else f"(({{}} - {before}u) / {stride}u)"
    if stride != 1:
        inside += f" && (i{axis} - {before}u) % {stride}u == 0u"
    idx = [at.format(n) if a == axis else n for a, n in enumerate(_indices(node))]
    return [f"  var v = {_f32(node.attrs.get('value', 0.0))};",
            f"  if ({inside}) {{",
            f"    v = in0[{offset(idx, contiguous_strides(x.shape))}];", "  }",
            "  out[idx] = v;"]


register(OpDef("pad", _pad, "kernel", grad=_pad_grad, lower=kernels.lowering(_pad_body)))


def _f32(value: float) -> str:
    """A WGSL f32 literal, infinities included."""
    if math.isinf(value):
        return f"bitcast<f32>({'0xff800000u' if value < 0 else '0x7f800000u'})"
    return f"{value:.9e}"


PAD_MODES = ("constant", "reflect", "replicate", "circular")


@builder
def pad(g: Graph, x: Tensor, axis: int, before: int, after: int, stride: int = 1,
        mode: str = "constant", value: float = 0.0) -> Tensor:
    """Padding along one axis (F.pad, ONNX Pad): mode "constant" (with `value`), "reflect",
    "replicate" (ONNX's edge) or "circular"; a negative amount crops, as ONNX's. `stride` > 1
    also puts stride - 1 values between elements (the gradient of a strided slice). Only the
    constant mode is a kernel of its own: the others are slices, flips, broadcasts and a
    concat of x."""
    axis, before, after = _axis_of(x, axis), int(before), int(after)
    if mode not in PAD_MODES or math.isnan(value) or (
            stride != 1 and (mode != "constant" or min(before, after) < 0)):
        raise GraphError(f"pad: mode {mode!r}, value {value}, stride {stride}, amounts "
                         f"({before}, {after}): modes are {PAD_MODES}, the value is not NaN, "
                         "and a stride needs the constant mode and amounts >= 0")
    n = x.shape[axis]
    if before < 0 or after < 0:  # crop first
        x = g.slice(x, axis, max(-before, 0), n + min(after, 0))
        before, after, n = max(before, 0), max(after, 0), x.shape[axis]
    if before == after == 0 and stride == 1:
        return x
    if mode == "constant":
        attrs = ({"stride": int(stride)} if stride != 1 else {}) | (
            {"value": float(value)} if value != 0 else {})
        return g.apply("pad", [x], axis=axis, before=before, after=after, **attrs)
    # reflect mirrors x without its edge, circular wraps around once (PyTorch's limits);
    # replicate repeats the edge element, as many times as asked
    if mode != "replicate" and max(before, after) > (n - 1 if mode == "reflect" else n):
        limit = f"below its length {n}" if mode == "reflect" else f"of at most its length {n}"
        raise GraphError(f"pad: {mode} padding by ({before}, {after}) along axis {axis} of "
                         f"{x.label} needs amounts {limit}")

    def edge(start: int, count: int) -> Tensor:  # element `start` repeated `count` times
        shape = tuple(count if a == axis else d for a, d in enumerate(x.shape))
        return g.broadcast_to(g.slice(x, axis, start, start + 1), shape)

    sides = {"reflect": lambda: (before and g.flip(g.slice(x, axis, 1, before + 1), axis),
                                 after and g.flip(g.slice(x, axis, n - 1 - after, n - 1), axis)),
             "replicate": lambda: (before and edge(0, before), after and edge(n - 1, after)),
             "circular": lambda: (before and g.slice(x, axis, n - before, n),
                                  after and g.slice(x, axis, 0, after))}[mode]()
    return g.concat([t for t in (sides[0], x, sides[1]) if t], axis)


@builder
def flip(g: Graph, x: Tensor, axis: int | Sequence[int]) -> Tensor:
    """torch.flip: `x` reversed along `axis` (one or several), each a gather at constant
    indices."""
    for a in (axis,) if isinstance(axis, int) else axis:
        a = _axis_of(x, a)
        x = g.gather(x, g.constant(np.arange(x.shape[a] - 1, -1, -1), "i32"), a)
    return x


@builder
def roll(g: Graph, x: Tensor, shift: int | Sequence[int], axis: int | Sequence[int]) -> Tensor:
    """torch.roll: `x` shifted cyclically by `shift` along `axis` (ints, or sequences of one
    length): two slices and a concat an axis."""
    shifts, axes = ((shift,), (axis,)) if isinstance(axis, int) else (tuple(shift), tuple(axis))
    if len(shifts) != len(axes):
        raise GraphError(f"roll: {len(shifts)} shifts for {len(axes)} axes")
    for s, a in zip(shifts, axes):
        a = _axis_of(x, a)
        n = x.shape[a]
        s = int(s) % n
        if s:
            x = g.concat([g.slice(x, a, n - s, n), g.slice(x, a, 0, n - s)], a)
    return x


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
               lower=kernels.lowering(_concat_body)))


# A concat's kernel binds every input: more than this many are concatenated in groups first,
# so the kernel stays within devices' storage-buffer limits (lavapipe's 32 a stage; an
# exported T5 concatenates 44 tensors)
CONCAT_INPUTS = 16


@builder
def concat(g: Graph, xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """torch.cat along `axis`."""
    xs = list(xs)
    if not xs:
        raise GraphError("concat takes a non-empty list of tensors, got none")
    if len(xs) == 1:
        return xs[0]
    if len(xs) > CONCAT_INPUTS:
        xs = [concat(g, xs[at:at + CONCAT_INPUTS], axis)
              for at in range(0, len(xs), CONCAT_INPUTS)]
        return concat(g, xs, axis)
    return g.apply("concat", xs, axis=int(axis))


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
               lower=kernels.lowering(_rotate_half_body)))


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


# Positions one scatter-add kernel scans: its loops stay within what CPU drivers run (lavapipe
# stops an invocation's loops after 65535 iterations); longer runs are summed in parts.
MAX_POSITIONS = 32768


def _embedding_grad(g, node, d):
    weight, ids = node.inputs
    rows, dim = weight.shape
    total = scatter_rows(g, g.reshape(d, (1, ids.size, dim)), ids, rows, wrap=False)
    return [g.reshape(total, (rows, dim)), None]


def scatter_rows(g: Graph, d: Tensor, ids: Tensor, rows: int, wrap: bool) -> Tensor:
    """The gradient of a gather of rows (embedding, gather along an axis): `d` (pre, P, post)
    summed into (pre, rows, post) at row ids[p] (any shape, P elements; `wrap`: a negative id
    counts from the end, as ONNX's)."""
    flat_ids = g.reshape(ids, (ids.size,))
    total = None
    for start in range(0, ids.size, MAX_POSITIONS):
        stop = min(start + MAX_POSITIONS, ids.size)
        part_ids = flat_ids if stop - start == ids.size else g.slice(flat_ids, 0, start, stop)
        part_d = d if stop - start == ids.size else g.slice(d, 1, start, stop)
        first = g.apply("scatter_first_use", [part_ids], rows=rows, wrap=wrap)
        part = g.apply("scatter_rows", [part_d, part_ids, first], rows=rows, wrap=wrap)
        total = part if total is None else g.add(total, part)
    assert total is not None
    return total


def _embedding_body(node: Tensor) -> list[str]:
    weight, _ = node.inputs
    rows, dim = weight.shape
    # An id outside [0, rows) reads the nearest row rather than outside the buffer.
    return [f"  let row = u32(clamp(in1[idx / {dim}u], 0, {rows - 1}));",
            f"  out[idx] = in0[row * {dim}u + idx % {dim}u];"]


register(OpDef("embedding", _embedding, "kernel", grad=_embedding_grad,
               lower=kernels.lowering(_embedding_body),
               indexes=lambda node: (1, 0, node.inputs[0].shape[0], "embedding row")))


@builder
def embedding(g: Graph, ids: Tensor, weight: Tensor) -> Tensor:
    """F.embedding(ids, weight): rows of `weight` (rows, dim) at i32 `ids` -> (*ids, dim)."""
    return g.apply("embedding", [weight, ids])


# d x[a, v, j] = sum over positions p with ids[p] == v of d[a, p, j], deterministically (no float
# atomics), in two kernels: the first position of each row among the ids (-1: unused), then one
# thread per element of the result, which for a used row sums from that position on and
# otherwise writes 0. A vocabulary is mostly unused in a step, so most threads only write.
def _is_row(node: Tensor, value: str, row: str) -> str:
    """WGSL: whether the id `value` names row `row` (an i32), also from the end where wrapping."""
    if node.attrs["wrap"]:
        return f"({value} == {row} || {value} == {row} - {node.attrs['rows']})"
    return f"{value} == {row}"


def _first_use(inputs, attrs):
    return (attrs["rows"],), "i32"


def _first_use_body(node: Tensor) -> list[str]:
    (ids,) = node.inputs
    return ["  var first = -1;",
            f"  for (var p = 0u; p < {ids.size}u; p++) {{",
            f"    if ({_is_row(node, 'in0[p]', 'i32(idx)')}) {{ first = i32(p); break; }}", "  }",
            "  out[idx] = first;"]


register(OpDef("scatter_first_use", _first_use, "kernel",
               lower=kernels.lowering(_first_use_body)))


def _scatter_rows(inputs, attrs):
    d, ids, _ = inputs
    return (d.shape[0], attrs["rows"], d.shape[2]), "f32"


def _scatter_rows_body(node: Tensor) -> list[str]:
    d, ids, _ = node.inputs
    pre, positions, post = d.shape
    rows = node.attrs["rows"]
    row = f"idx / {post}u" if pre == 1 else f"(idx / {post}u) % {rows}u"
    at = (f"p * {post}u + col" if pre == 1
          else f"(idx / {rows * post}u * {positions}u + p) * {post}u + col")
    return [f"  let row = {row}; let col = idx % {post}u;",
            "  var acc = 0.0;",
            "  let first = in2[row];",
            "  if (first >= 0) {",
            f"    for (var p = u32(first); p < {positions}u; p++) {{",
            f"      if ({_is_row(node, 'in1[p]', 'i32(row)')}) {{ acc += in0[{at}]; }}", "    }",
            "  }",
            "  out[idx] = acc;"]


register(OpDef("scatter_rows", _scatter_rows, "kernel",
               lower=kernels.lowering(_scatter_rows_body)))


# ---- gathers with index tensors (ONNX Gather and GatherElements, torch.index_select and gather):
# the indices are data, i32, and a negative one counts from the end of the axis, as ONNX's.
def _wrapped(value: str, extent: int) -> str:
    return f"u32(select({value}, {value} + {extent}, {value} < 0))"


def _check_indices(op: str, x: Tensor, indices: Tensor, axis: int) -> int:
    if indices.dtype != "i32":
        raise GraphError(f"{op} takes i32 indices, got {indices.type} (convert integer indices "
                         "to i32: g.constant(values, 'i32') or an i32 input)")
    return _axis_of(x, axis)


def _check_constant_indices(g: Graph, node: Tensor) -> Tensor:
    """Refuse a gather whose indices are a constant outside [-n, n) at once; indices from an
    input are checked by set_input (its OpDef.indexes)."""
    x, indices = node.inputs
    if indices.op == "constant" and indices.size:
        values, extent = g.initial_values[indices.id], x.shape[node.attrs["axis"] % len(x.shape)]
        if values.min() < -extent or values.max() >= extent:
            raise GraphError(f"{node.op} at {node.where}: constant indices {indices.label} hold "
                             f"values outside [{-extent}, {extent}), the range of the axis "
                             f"gathered from {x.label}")
    return node


def _gather(inputs, attrs):
    x, indices = inputs
    axis = _check_indices("gather", x, indices, attrs["axis"])
    return (*x.shape[:axis], *indices.shape, *x.shape[axis + 1:]), x.dtype


def _gather_grad(g, node, d):
    x, indices = node.inputs
    axis = node.attrs["axis"] % len(x.shape)
    pre, post = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
    summed = scatter_rows(g, g.reshape(d, (pre, indices.size, post)), indices, x.shape[axis],
                          wrap=True)
    return [g.reshape(summed, x.shape), None]


def _gather_body(node: Tensor) -> list[str]:
    x, indices = node.inputs
    axis, rank = node.attrs["axis"] % len(x.shape), len(indices.shape)
    out = _indices(node)
    source = [*out[:axis], "j", *out[axis + rank:]]
    return [f"  let k = in1[{offset(out[axis:axis + rank], contiguous_strides(indices.shape))}];",
            f"  let j = {_wrapped('k', x.shape[axis])};",
            f"  out[idx] = in0[{offset(source, contiguous_strides(x.shape))}];"]


def _axis_range(what: str):
    """A gather's valid indices: negative ones count from the end, as ONNX's."""
    def indexes(node: Tensor) -> tuple[int, int, int, str]:
        extent = node.inputs[0].shape[node.attrs["axis"]]
        return 1, -extent, extent, what
    return indexes


register(OpDef("gather", _gather, "kernel", grad=_gather_grad,
               lower=kernels.lowering(_gather_body), indexes=_axis_range("gather index")))


@builder
def gather(g: Graph, x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """ONNX Gather: the slices of `x` along `axis` at i32 `indices` (any shape, which replaces
    that axis: x.shape[:axis] + indices.shape + x.shape[axis+1:]); a negative index counts from
    the end. Differentiable in x (a deterministic scatter-add)."""
    return _check_constant_indices(g, g.apply("gather", [x, indices], axis=int(axis)))


@builder
def index_select(g: Graph, x: Tensor, axis: int, index: Tensor) -> Tensor:
    """torch.index_select: `x` at the 1-D i32 `index` along `axis`."""
    if len(index.shape) != 1:
        raise GraphError(f"index_select takes a 1-D index, got {index.label}; use gather for "
                         "an index of any shape")
    return g.gather(x, index, axis)


# i32 values declared to index an axis of `extent` ([-extent, extent)): a view (no kernel, no
# memory) whose only use is its OpDef.indexes fact, so an index computed from them (index's
# flat index) is range-checked per axis, as torch checks each, not only as a whole.
def _index_bounds(inputs, attrs):
    (t,) = inputs
    if t.dtype != "i32":
        raise GraphError(f"index bounds apply to i32 indices, got {t.type}")
    return t.shape, t.dtype


register(OpDef("index_bounds", _index_bounds, "view",
               indexes=lambda node: (0, -node.attrs["extent"], node.attrs["extent"],
                                     node.attrs["what"])))


@builder
def index(g: Graph, x: Tensor, indices: Sequence[Tensor | None]) -> Tensor:
    """torch's advanced indexing x[i0, i1, ...] (aten.index; ONNX GatherND over leading axes):
    an i32 index tensor, or None for the whole axis, for each of x's leading axes, the tensors
    broadcast together. Their shape replaces the indexed axes where they are adjacent, else it
    comes first (torch's rule); a negative index counts from its axis's end. One gather along
    the indexed axes flattened, at the flat index computed from the tensors (i32 arithmetic);
    each tensor is range-checked against its own axis."""
    if len(indices) > len(x.shape):
        raise GraphError(f"index: {len(indices)} indices for {x.label}")
    used = [a for a, i in enumerate(indices) if i is not None]
    if not used:
        return x
    tensors = [indices[a] for a in used]
    for a, t in zip(used, tensors):
        if not isinstance(t, Tensor) or t.dtype != "i32":
            raise GraphError(f"index takes i32 index tensors (or None), got {t!r}")
        if t.op == "constant" and t.size:
            values, n = g.initial_values[t.id], x.shape[a]
            if values.min() < -n or values.max() >= n:
                raise GraphError(f"index: constant indices {t.label} hold values outside "
                                 f"[{-n}, {n}), the range of axis {a} of {x.label}")
    if len(used) == 1:
        return g.gather(x, tensors[0], used[0])
    shape: tuple[int, ...] = ()
    for t in tensors:
        shape = broadcast_shapes(shape, t.shape)
    if used != list(range(used[0], used[-1] + 1)):  # apart: indexed axes first, as torch
        x = g.transpose(x, used + [a for a in range(len(x.shape)) if a not in used])
        used = list(range(len(used)))
    dims = x.shape[used[0]:used[-1] + 1]
    flat: Tensor | None = None
    for k, (n, t) in enumerate(zip(dims, tensors)):
        t = g.apply("index_bounds", [t], extent=n, what=f"index of axis {used[k]}")
        term = g.where(g.less(t, 0), g.add(t, n), t)  # each axis's own negative indices
        stride = math.prod(dims[k + 1:])
        term = g.mul(term, stride) if stride != 1 else term
        flat = term if flat is None else g.add(flat, term)
    assert flat is not None
    flat = flat if flat.shape == shape else g.broadcast_to(flat, shape)
    rows = g.reshape(x, (*x.shape[:used[0]], math.prod(dims), *x.shape[used[-1] + 1:]))
    return g.gather(rows, flat, used[0])


def _gather_elements(inputs, attrs):
    x, indices = inputs
    axis = _check_indices("gather_elements", x, indices, attrs["axis"])
    if len(indices.shape) != len(x.shape) or any(
            i > n for a, (i, n) in enumerate(zip(indices.shape, x.shape)) if a != axis):
        raise GraphError(f"gather_elements: indices {indices.type} must have the rank of x "
                         f"{x.type} and no longer axes than it, except along axis {axis}")
    return indices.shape, x.dtype


def _gather_elements_grad(g, node, d):
    x, indices = node.inputs
    return [g.apply("gather_elements_backward", [d, indices], axis=node.attrs["axis"],
                    shape=x.shape), None]


def _gather_elements_body(node: Tensor) -> list[str]:
    x, _ = node.inputs
    axis = node.attrs["axis"] % len(x.shape)
    source = [("j" if a == axis else n) for a, n in enumerate(_indices(node))]
    return ["  let k = in1[idx];",
            f"  let j = {_wrapped('k', x.shape[axis])};",
            f"  out[idx] = in0[{offset(source, contiguous_strides(x.shape))}];"]


register(OpDef("gather_elements", _gather_elements, "kernel", grad=_gather_elements_grad,
               lower=kernels.lowering(_gather_elements_body),
               indexes=_axis_range("gather_elements index")))


@builder
def gather_elements(g: Graph, x: Tensor, indices: Tensor, axis: int) -> Tensor:
    """torch.gather / ONNX GatherElements: out[i] = x[i with its `axis` index replaced by
    indices[i]] (i32 `indices` of x's rank; a negative index counts from the end)."""
    return _check_constant_indices(g, g.apply("gather_elements", [x, indices],
                                              axis=int(axis)))


# d x[j] = sum over the positions k along `axis` of indices whose other coordinates are j's and
# whose index names j[axis]: one thread per element of x, looping over that axis.
def _gather_elements_backward(inputs, attrs):
    return attrs["shape"], "f32"


def _gather_elements_backward_kernel(node: Tensor, caps: Capabilities) -> Kernel:
    d, indices = node.inputs
    axis = node.attrs["axis"] % len(node.shape)
    extent = indices.shape[axis]
    check_loop(node, caps, extent, "gather along a shorter axis")
    out = _indices(node)
    inside = [f"{n} < {indices.shape[a]}u" for a, n in enumerate(out)
              if a != axis and indices.shape[a] < node.shape[a]]
    at = offset([("k" if a == axis else n) for a, n in enumerate(out)],
                contiguous_strides(indices.shape))
    row = f"i32({out[axis]})"
    return kernels.generate(node, caps, [
        "  var acc = 0.0;",
        f"  if ({' && '.join(inside) or 'true'}) {{",
        f"    for (var k = 0u; k < {extent}u; k++) {{",
        f"      let v = in1[{at}];",
        f"      if (v == {row} || v == {row} - {node.shape[axis]}) {{ acc += in0[{at}]; }}",
        "    }", "  }",
        "  out[idx] = acc;"], flops=node.size * extent)


register(OpDef("gather_elements_backward", _gather_elements_backward, "kernel",
               lower=_gather_elements_backward_kernel))


# ---- resample: a sparse constant linear map along one axis (resizing's interpolation) ----------
# y[..., o, ...] = sum over k in row o of weights[k] * x[..., columns[k], ...], the matrix in
# compressed rows (offsets, columns, weights: constants); one thread per output element. Its
# gradient is the same op with the transposed matrix, so neither pass reads the zeros of the
# dense matrix (a product with it did: (out x in) multiplies a row for a few weights each).
def _resample(inputs, attrs):
    x, offsets, columns, weights = inputs
    axis = _axis_of(x, attrs["axis"])
    if (x.dtype != "f32" or offsets.dtype != "i32" or columns.dtype != "i32"
            or weights.dtype != "f32" or columns.shape != weights.shape):
        raise GraphError(f"resample takes f32 x, i32 offsets and columns and f32 weights, got "
                         f"{x.type}, {offsets.type}, {columns.type}, {weights.type}")
    return tuple(offsets.size - 1 if a == axis else d for a, d in enumerate(x.shape)), "f32"


def _resample_grad(g, node, d):
    # the same taps transposed, each read (as torch's backward adds every tap's weight times
    # the gradient, 0 times an infinite one included)
    x, offsets, columns, weights = node.inputs
    starts, cols, values = (g.initial_values[t.id] for t in (offsets, columns, weights))
    rows = np.repeat(np.arange(starts.size - 1), np.diff(starts))
    return [_resample_taps(g, d, node.attrs["axis"], x.shape[node.attrs["axis"]], cols, rows,
                           values), None, None, None]


def _resample_kernel(node: Tensor, caps: Capabilities) -> Kernel:
    x = node.inputs[0]
    axis, most = node.attrs["axis"], node.attrs["most"]
    check_loop(node, caps, most, "resample along a shorter axis")
    out = _indices(node)
    at = offset([("u32(in2[k])" if a == axis else n) for a, n in enumerate(out)],
                contiguous_strides(x.shape))
    return kernels.generate(node, caps, [
        "  var acc = 0.0;",
        f"  for (var k = u32(in1[{out[axis]}]); k < u32(in1[{out[axis]} + 1u]); k++) {{",
        f"    acc += in3[k] * in0[{at}];", "  }",
        "  out[idx] = acc;"], flops=2 * node.size * most)


register(OpDef("resample", _resample, "kernel", grad=_resample_grad, lower=_resample_kernel))


@builder
def resample(g: Graph, x: Tensor, axis: int, matrix: np.ndarray | tuple[np.ndarray, np.ndarray]
             ) -> Tensor:
    """x multiplied along `axis` by the constant (out, in) `matrix`: y[..., o, ...] = sum over
    i of matrix[o, i] x[..., i, ...], reading only its nonzero entries (an interpolation's
    few taps a row). Or `matrix` as taps (columns, weights), each (out, taps): every tap is
    read, those of weight 0 and repeated columns too, so that an infinity or NaN there gives
    NaN, as torch's and onnxruntime's interpolations compute it."""
    axis = _axis_of(x, axis)
    if isinstance(matrix, tuple):
        columns, weights = (np.asarray(a) for a in matrix)
        out = columns.shape[0] if columns.ndim == 2 else 0
        if columns.shape != weights.shape or columns.ndim != 2 or not out or (
                columns.min() < 0 or columns.max() >= x.shape[axis]):
            raise GraphError(f"resample: taps (columns {columns.shape}, weights "
                             f"{weights.shape}) do not map axis {axis} of {x.label}")
        rows = np.repeat(np.arange(out), columns.shape[1])
        return _resample_taps(g, x, axis, out, rows, columns.ravel(), weights.ravel())
    matrix = np.asarray(matrix, np.float32)
    if matrix.ndim != 2 or matrix.shape[1] != x.shape[axis] or not matrix.shape[0]:
        raise GraphError(f"resample: a matrix of shape {matrix.shape} does not map axis {axis} "
                         f"of {x.label}")
    rows, columns = np.nonzero(matrix)
    return _resample_taps(g, x, axis, matrix.shape[0], rows, columns, matrix[rows, columns])


def _resample_taps(g: Graph, x: Tensor, axis: int, out: int, rows: np.ndarray,
                   columns: np.ndarray, weights: np.ndarray) -> Tensor:
    """The resample node of the taps (row, column, weight), in compressed rows."""
    order = np.argsort(rows, kind="stable")
    counts = np.bincount(rows, minlength=out)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return g.apply("resample", [x, g.constant(offsets, "i32"),
                                g.constant(columns[order], "i32"),
                                g.constant(np.asarray(weights, np.float32)[order])],
                   axis=axis, most=int(counts.max(initial=0)))


def _indices(node: Tensor) -> list[str]:
    """The output's index variables in the gather kernel: i0, i1, ..."""
    return [f"i{a}" for a in range(len(node.shape))]


# ---- index checks -------------------------------------------------------------------------------
# An op that reads at i32 indices declares them on its OpDef, `indexes=`: which input, its valid
# [first, end) for the node, and what it indexes (embedding, one_hot, gather, gather_elements
# do). That is all a new op does: every index operand is then checked, whatever computes it,
# as PyTorch raises on an index out of range:
# - an i32 input (through views) by set_input, before anything runs (compiler/stages.py
#   index_ranges);
# - a constant when the graph is compiled (GraphError);
# - anything else (a slice, concat or transpose of an input, another gather's result, ...) on
#   the GPU, by `index_check` nodes that the compiler adds beside the step (compiler/stages.py
#   index_checks): the session reads their result where it waits anyway (wait(), read()) and
#   raises InputError naming the op, the operand and the first bad value, and the step's
#   optimizer update was skipped.
# The check runs beside the op, not before it, so the op's kernel must still keep every read
# inside its buffer (clamp or wrap the index) whatever the value.
def _index_check(inputs, attrs):
    if len(attrs["ranges"]) != len(inputs) or any(x.dtype != "i32" for x in inputs):
        raise GraphError("index_check takes i32 operands, one [first, end) range each")
    return (4,), "i32"


register(OpDef("index_check", _index_check, "kernel", lower=kernels.index_check))
