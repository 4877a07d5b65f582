"""Reductions: sums over any axes, and the row-wise softmax / log-softmax over the last axis."""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.ops import OpDef, register


def _sum(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32":
        raise GraphError(f"expects f32, got {x.dtype}")
    return tuple(d for i, d in enumerate(x.shape) if i not in attrs["axes"]), "f32"


def _sum_grad(g, node, d):
    (x,) = node.inputs
    kept = [1 if i in node.attrs["axes"] else n for i, n in enumerate(x.shape)]
    return [g.broadcast_to(g.reshape(d, kept), x.shape)]


register(OpDef("sum", _sum, "reduce", grad=_sum_grad))


def _rowwise(inputs, attrs):
    (x,) = inputs
    if x.dtype != "f32" or not x.shape:
        raise GraphError(f"expects an f32 tensor of rank >= 1, got {x.type}")
    return x.shape, "f32"


def _softmax_grad(g, node, d):
    # d softmax: y * (d - sum(d * y)) over the row
    return [g.mul(node, g.sub(d, g.sum(g.mul(d, node), -1, keepdims=True)))]


def _log_softmax_grad(g, node, d):
    # d log_softmax: d - softmax(x) * sum(d) over the row, softmax(x) = exp(y)
    return [g.sub(d, g.mul(g.exp(node), g.sum(d, -1, keepdims=True)))]


register(OpDef("softmax", _rowwise, "softmax", grad=_softmax_grad))
register(OpDef("log_softmax", _rowwise, "softmax", grad=_log_softmax_grad))


def _amax_grad(g, node, d):
    # torch.amax's rule: the gradient is shared evenly among the elements equal to the maximum.
    (x,) = node.inputs
    kept = [1 if i in node.attrs["axes"] else n for i, n in enumerate(x.shape)]
    hit = g.apply("equal", [x, g.reshape(node, kept)])
    share = g.div(g.reshape(d, kept), g.reshape(g.sum(hit, node.attrs["axes"]), kept))
    return [g.mul(hit, share)]


# Max over any axes: a serial loop per output element (the gather archetype), not a tree
# reduction; fine for the short rows it serves.
register(OpDef("amax", _sum, "gather", grad=_amax_grad))
