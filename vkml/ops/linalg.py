"""Matrix multiplication, with either operand read transposed (no transpose copy is made)."""

from __future__ import annotations

from ..errors import GraphError
from . import OpDef, register


def _matmul(inputs, attrs):
    a, b = inputs
    if len(a.shape) != 2 or len(b.shape) != 2:
        raise GraphError(f"matmul takes 2-D operands, got shapes {a.shape} and {b.shape}")
    if a.dtype != "f32" or b.dtype != "f32":
        raise GraphError(f"matmul takes f32 operands, got {a.dtype} and {b.dtype}")
    m, ka = a.shape[::-1] if attrs["transpose_a"] else a.shape
    kb, n = b.shape[::-1] if attrs["transpose_b"] else b.shape
    if ka != kb:
        ta = "^T" if attrs["transpose_a"] else ""
        tb = "^T" if attrs["transpose_b"] else ""
        raise GraphError(f"inner dimensions differ: a{ta} is ({m}, {ka}) and b{tb} is "
                         f"({kb}, {n}); {ka} != {kb}")
    return (m, n), "f32"


def _matmul_grad(g, node, d):
    # C = op(A) op(B); each case writes dA, dB in the stored layout of A and B.
    a, b = node.inputs
    ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
    if not ta and not tb:
        return [g.matmul(d, b, transpose_b=True), g.matmul(a, d, transpose_a=True)]
    if not ta and tb:
        return [g.matmul(d, b), g.matmul(d, a, transpose_a=True)]
    if ta and not tb:
        return [g.matmul(b, d, transpose_b=True), g.matmul(a, d)]
    return [g.matmul(b, d, transpose_a=True, transpose_b=True),
            g.matmul(d, a, transpose_a=True, transpose_b=True)]


register(OpDef("matmul", _matmul, "matmul", grad=_matmul_grad))
