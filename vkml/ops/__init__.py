"""The op registry: each op is defined once, with its shape rule, its gradient and its lowering.

Like JAX's primitives, an `OpDef` carries everything later stages need to know about an op:
`infer` (shape and dtype, raising GraphError), `grad` (input gradients built from other ops), and
the kernel archetype that lowers it (`vkml/kernels/`). Adding an op touches one file here plus its
test. The families live in `source.py`, `pointwise.py`, `reduce.py`, `linalg.py` and `layout.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

from vkml.expr import Body, Expr

if TYPE_CHECKING:
    from vkml.graph import Graph, Tensor

DType = Literal["f32", "i32"]
Shape = tuple[int, ...]
Archetype = Literal["source", "view", "pointwise", "reduce", "softmax", "matmul", "gather",
                    "conv", "attention"]

InferRule = Callable[[list["Tensor"], dict[str, Any]], tuple[Shape, DType]]
GradRule = Callable[["Graph", "Tensor", "Tensor"], Sequence[Optional["Tensor"]]]


@dataclass(frozen=True)
class OpDef:
    name: str
    infer: InferRule
    archetype: Archetype
    grad: GradRule | None = None  # None: not differentiable (sources, integer ops)
    # Pointwise archetype only: the result as an expression of the inputs' elements
    # (vkml/expr.py: Arg(k)) and the output's multi-index (Axis(a)).
    expr: Callable[[Tensor], Expr] | None = None
    # Pointwise only: per input, the element stride of each output axis (0 = broadcast).
    # Default: numpy broadcasting of the input's shape against the output's.
    strides: Callable[[Tensor], list[Shape]] | None = None


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in OPS:
        raise ValueError(f"op '{op.name}' is defined twice")
    OPS[op.name] = op
    return op


def contiguous_strides(shape: Shape) -> Shape:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def broadcast_strides(shape: Shape, out_shape: Shape) -> Shape:
    """Strides that read `shape` (numpy-broadcast to `out_shape`) at each output index."""
    own = contiguous_strides(shape)
    pad = len(out_shape) - len(shape)
    return tuple(0 if i < pad or shape[i - pad] == 1 else own[i - pad]
                 for i in range(len(out_shape)))


def body_of(node: Tensor) -> Body:
    """The pointwise body of a pointwise node: stored on fused nodes, built from the OpDef else."""
    if "body" in node.attrs:
        return node.attrs["body"]
    opdef = OPS[node.op]
    assert opdef.expr is not None, f"{node.label} is not pointwise"
    strides = (opdef.strides(node) if opdef.strides is not None
               else [broadcast_strides(x.shape, node.shape) for x in node.inputs])
    return Body(opdef.expr(node), tuple(strides))


# The families register their ops on import.
from vkml.ops import attention, conv, fused, indexing, layout, linalg, pointwise, reduce, source  # noqa: E402,F401,E501
