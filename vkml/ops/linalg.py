"""Matrix multiplication, with either operand read transposed (no transpose copy is made), and
batched over leading dimensions: (..., M, K) @ (..., K, N) with numpy broadcasting of the leading
dimensions (the kernel carries the batch in the z dimension of its dispatch grid)."""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.graph import Graph, OpDef, Tensor, builder, register
from vkml.kernels import matmul as kernels
from vkml.ops.pointwise import broadcast_shapes, sum_to


def _matmul(inputs, attrs):
    a, b = inputs[:2]
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise GraphError(f"matmul takes operands of rank >= 2, got shapes {a.shape} and {b.shape}")
    if a.dtype != "f32" or b.dtype != "f32":
        raise GraphError(f"matmul takes f32 operands, got {a.dtype} and {b.dtype}")
    m, ka = a.shape[-2:][::-1] if attrs["transpose_a"] else a.shape[-2:]
    kb, n = b.shape[-2:][::-1] if attrs["transpose_b"] else b.shape[-2:]
    if ka != kb:
        ta = "^T" if attrs["transpose_a"] else ""
        tb = "^T" if attrs["transpose_b"] else ""
        raise GraphError(f"inner dimensions differ: a{ta} is ({m}, {ka}) and b{tb} is "
                         f"({kb}, {n}); {ka} != {kb}")
    try:
        leading = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except GraphError as e:
        raise GraphError(f"leading (batch) dimensions: {e}") from None
    return (*leading, m, n), "f32"


def _matmul_grad(g, node, d):
    # C = op(A) op(B); each case writes dA, dB in the stored layout of A and B, then sums over
    # the leading dimensions along which A or B was broadcast.
    a, b = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    if not ta and not tb:
        da, db = g.matmul(d, b, transpose_b=True), g.matmul(a, d, transpose_a=True)
    elif not ta and tb:
        da, db = g.matmul(d, b), g.matmul(d, a, transpose_a=True)
    elif ta and not tb:
        da, db = g.matmul(b, d, transpose_b=True), g.matmul(a, d)
    else:
        da = g.matmul(b, d, transpose_a=True, transpose_b=True)
        db = g.matmul(d, a, transpose_a=True, transpose_b=True)
    return [sum_to(g, da, a.shape), sum_to(g, db, b.shape)]


register(OpDef("matmul", _matmul, "kernel", grad=_matmul_grad, lower=kernels.generate,
               splits=kernels.splits, fusion="product", fused="fused_matmul",
               scaled=kernels.scaled))


@builder
def matmul(g: Graph, a: Tensor, b: Tensor, transpose_a: bool = False,
           transpose_b: bool = False) -> Tensor:
    """op(a) @ op(b), op transposing the last two axes when asked (no copy is made); operands
    of rank > 2 are batches of matrices, their leading axes broadcast as numpy's."""
    return g.apply("matmul", [a, b], transpose_a=bool(transpose_a),
                   transpose_b=bool(transpose_b))
