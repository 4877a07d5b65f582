"""Layout ops: reshape (a view, no kernel) and transpose (a pointwise gather)."""

from __future__ import annotations

import numpy as np

from vkml.errors import GraphError
from vkml.expr import Arg
from vkml.ops import OpDef, contiguous_strides, register


def _reshape(inputs, attrs):
    (x,) = inputs
    shape = attrs["shape"]
    if any(d <= 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) != x.size:
        raise GraphError(f"cannot reshape {x.shape} ({x.size} elements) to {shape}")
    return shape, x.dtype


register(OpDef("reshape", _reshape, "view",
               grad=lambda g, node, d: [g.reshape(d, node.inputs[0].shape)]))


def _transpose(inputs, attrs):
    (x,) = inputs
    axes = attrs["axes"]
    if sorted(axes) != list(range(len(x.shape))):
        raise GraphError(f"axes {axes} are not a permutation of the {len(x.shape)} axes of "
                         f"shape {x.shape}")
    return tuple(x.shape[a] for a in axes), x.dtype


def _transpose_strides(node):
    own = contiguous_strides(node.inputs[0].shape)
    return [tuple(own[a] for a in node.attrs["axes"])]


register(OpDef("transpose", _transpose, "pointwise",
               grad=lambda g, node, d: [g.transpose(d, tuple(np.argsort(node.attrs["axes"])))],
               expr=lambda node: Arg(0), strides=_transpose_strides))
