"""Layout ops: reshape (a view, no kernel), transpose / permute (a pointwise gather), and expand
and tile, broadcasts (pointwise: read in place by whatever consumes them where fused)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vkml.errors import GraphError
from vkml.expr import Arg, contiguous_strides
from vkml.graph import Graph, OpDef, Tensor, as_shape, builder, register
from vkml.ops.pointwise import broadcast_shapes


def _reshape(inputs, attrs):
    (x,) = inputs
    shape = attrs["shape"]
    if any(d <= 0 for d in shape) or int(np.prod(shape, dtype=np.int64)) != x.size:
        raise GraphError(f"cannot reshape {x.shape} ({x.size} elements) to {shape}")
    return shape, x.dtype


register(OpDef("reshape", _reshape, "view",
               grad=lambda g, node, d: [g.reshape(d, node.inputs[0].shape)]))


@builder(tensor=lambda x, *shape: x.graph.reshape(
    x, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape))
def reshape(g: Graph, x: Tensor, shape: int | Sequence[int]) -> Tensor:
    """The same elements in another shape; one axis may be -1 (inferred). No copy is made."""
    shape = as_shape(shape, f"reshape of {x.label}", minus_ones=1)
    if shape.count(-1) == 1:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        shape = tuple(x.size // known if d == -1 and known else d for d in shape)
    return g.apply("reshape", [x], shape=shape)


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


@builder(tensor=lambda x, *axes: x.graph.transpose(x, axes or None))
def transpose(g: Graph, x: Tensor, axes: Sequence[int] | None = None) -> Tensor:
    """Permute axes; with no `axes`, swap the last two (the matrix transpose)."""
    if axes is None:
        if len(x.shape) < 2:
            raise GraphError(f"transpose: {x.label} has fewer than 2 axes")
        axes = (*range(len(x.shape) - 2), len(x.shape) - 1, len(x.shape) - 2)
    return g.apply("transpose", [x], axes=tuple(int(a) for a in axes))


@builder
def permute(g: Graph, x: Tensor, axes: Sequence[int]) -> Tensor:
    """torch.permute: transpose with explicit axes."""
    return g.transpose(x, axes)


@builder(tensor=lambda x, *shape: x.graph.expand(
    x, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape))
def expand(g: Graph, x: Tensor, shape: int | Sequence[int]) -> Tensor:
    """torch.expand and ONNX Expand: `x` broadcast (numpy's rules, from the right) with `shape`;
    -1 keeps x's size, and a 1 where x is longer keeps x's (ONNX's two-way broadcast). A
    broadcast, no copy where its consumer reads it in place."""
    shape = as_shape(shape, f"expand of {x.label}", minus_ones=len(x.shape))
    pad = len(shape) - len(x.shape)
    if pad < 0:
        raise GraphError(f"expand: shape {shape} has fewer axes than {x.label}")
    if any(d == -1 and a < pad for a, d in enumerate(shape)):
        raise GraphError(f"expand: -1 in shape {shape} must stand for one of {x.label}'s axes")
    shape = tuple(x.shape[a - pad] if d == -1 else d for a, d in enumerate(shape))
    out = broadcast_shapes(x.shape, shape)
    return x if out == x.shape else g.broadcast_to(x, out)


@builder
def tile(g: Graph, x: Tensor, repeats: int | Sequence[int]) -> Tensor:
    """ONNX Tile and torch's Tensor.repeat: `x` repeated repeats[a] times along each axis a
    (more repeats than axes add leading axes, as torch's). A broadcast of x with a new axis
    before each repeated one, then a reshape; its gradient sums the copies."""
    repeats = as_shape(repeats, f"tile of {x.label}", what="repeats")
    if len(repeats) < len(x.shape):
        raise GraphError(f"tile: repeats {repeats} need one count >= 1 per axis of {x.label}")
    shape = (1,) * (len(repeats) - len(x.shape)) + x.shape
    if all(r == 1 for r in repeats):
        return g.reshape(x, shape)
    spread = [d for r, n in zip(repeats, shape) for d in (r, n)]
    wide = g.broadcast_to(g.reshape(x, [d for n in shape for d in (1, n)]), tuple(spread))
    return g.reshape(wide, [r * n for r, n in zip(repeats, shape)])
