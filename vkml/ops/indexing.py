"""Shape ops that move elements by index: slice, zero-pad, concat (along one axis), and the
embedding gather with its deterministic scatter-add gradient. All lower to the "gather"
archetype (`vkml/kernels/gather.py`): one thread per output element, reading its inputs at
computed addresses (a pointwise body cannot: it reads every input at a strided offset, with no
offsets and no choice of input). Split is slices; nearest upsampling is a broadcast (graph.py).
"""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.ops import OpDef, register


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


register(OpDef("slice", _slice, "gather", grad=_slice_grad))


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


register(OpDef("pad", _pad, "gather", grad=_pad_grad))


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


register(OpDef("concat", _concat, "gather", grad=_concat_grad))


def _embedding(inputs, attrs):
    weight, ids = inputs
    if len(weight.shape) != 2 or weight.dtype != "f32":
        raise GraphError(f"embedding weight must be f32 (rows, dim), got {weight.type}")
    if ids.dtype != "i32":
        raise GraphError(f"embedding ids must be i32, got {ids.type}")
    return (*ids.shape, weight.shape[1]), "f32"


def _embedding_grad(g, node, d):
    weight, ids = node.inputs
    return [g.apply("embedding_backward", [d, ids], rows=weight.shape[0]), None]


register(OpDef("embedding", _embedding, "gather", grad=_embedding_grad))


def _embedding_backward(inputs, attrs):
    d, ids = inputs
    return (attrs["rows"], d.shape[-1]), "f32"


# d weight[v, j] = sum over positions p with ids[p] == v of d[p, j]: one thread per weight
# element scanning the ids, so the sum is deterministic (no float atomics).
register(OpDef("embedding_backward", _embedding_backward, "gather"))
