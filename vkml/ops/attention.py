"""Fused (flash-style) attention: causal or full, cross, grouped-query; no additive mask. One
kernel with an online softmax (vkml/kernels/attention.py), and a backward of products that
recomputes the scores and takes P from the row log-sum-exp.
`scaled_dot_product_attention(..., fused=True)` builds it (ops/composite.py); the default there
is the composition of matmuls and a softmax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vkml.errors import GraphError
from vkml.graph import OpDef, Shape, Tensor, register
from vkml.hal import Capabilities
from vkml.kernels import attention as kernels
from vkml.ops.composite import attention_scores, causal_mask, grouped_heads


def _attention_dims(q, k, v):
    *lead, h, length, dim = q.shape
    if (len(k.shape) != len(q.shape) or len(v.shape) != len(q.shape)
            or tuple(k.shape[:-3]) != tuple(lead) or tuple(v.shape[:-3]) != tuple(lead)):
        raise GraphError(f"fused attention takes q, k, v with equal leading axes, got {q.type}, "
                         f"{k.type}, {v.type}")
    hkv, s = k.shape[-3], k.shape[-2]
    if h % hkv or v.shape[-3] != hkv or v.shape[-2] != s or k.shape[-1] != dim:
        raise GraphError(f"attention: q {q.type}, k {k.type}, v {v.type} do not agree")
    if any(x.dtype != "f32" for x in (q, k, v)):
        raise GraphError("attention takes f32 q, k, v")
    return lead, h, hkv, length, s, dim, v.shape[-1]


def _flash(inputs, attrs):
    q, k, v = inputs
    *lead, h, length, _ = q.shape
    _attention_dims(q, k, v)
    return (*lead, h, length, v.shape[-1]), "f32"


def _flash_grad(g, node, d):
    # The scores are recomputed as a product and P = exp(scores - lse) from the row
    # log-sum-exp (so P costs no second reduction), then the backward runs as the composed
    # attention's does, on the GEMM core: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
    # dQ = dS K * scale, dK = dS^T Q * scale. P is held for the backward only. This replaced
    # FlashAttention-2's backward as kernels of one thread a key (or query) row looping over every
    # row of the other side, which never hold P; the two were not timed against each other.
    q, k, v = node.inputs
    *lead, h, length, dim = q.shape
    hkv, s, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    rep, scale = h // hkv, node.attrs["scale"]
    q5, k5, v5 = grouped_heads(g, q, k, v, scale)
    d5 = g.reshape(d, (*lead, hkv, rep, length, dv))
    lse = g.reshape(g.apply("flash_attention_lse", [q, k], **node.attrs),
                    (*lead, hkv, rep, length, 1))
    p = g.exp(g.sub(attention_scores(g, q5, k5, node.attrs["causal"]), lse))
    row = g.reshape(g.sum(g.mul(d, node), -1, keepdims=True), (*lead, hkv, rep, length, 1))
    ds = g.mul(p, g.sub(g.matmul(d5, v5, transpose_b=True), row))

    def per_kv_head(x, width):  # (..., hkv, rep, s, width) summed over the heads sharing kv
        return g.sum(x, -3) if rep > 1 else g.reshape(x, (*lead, hkv, s, width))
    return [g.reshape(g.mul(g.matmul(ds, k5), scale), q.shape),
            per_kv_head(g.matmul(ds, q5, transpose_a=True), dim),
            per_kv_head(g.matmul(p, d5, transpose_a=True), dv)]


# The composition `scaled_dot_product_attention(..., fused=False)` (ops/composite.py) builds,
#
#     reshape(matmul(reshape(softmax(reshape(S))), v5)),  S = matmul(q5, k5^T) [+ causal mask]
#     q5 = reshape(mul(q, scale)), k5 = reshape(k), v5 = reshape(v)
#
# is computed by flash_attention where kernels/attention.py `cooperative` says its
# cooperative-matrix kernel takes the shapes (precision "f16", short sequences of keys), and
# nothing else reads the scores or the probabilities: a training step's backward pass reads the
# probabilities, so training keeps the composition, whose backward runs on the GEMM core.
# Where q, k or v is the heads' transpose of a (..., rows, heads, width) projection, the kernel
# reads the projection; where the attention's only reader is the heads' transpose back (their
# merge), the kernel writes that, so those transposes are not made at all.
@dataclass(frozen=True)
class Composed:
    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool
    scale: float
    interior: tuple[Tensor, ...]  # what the composition alone may read (its result aside)

    def takes_reader(self, reader: Tensor) -> bool:
        return _heads_swap(reader)

    def replacement(self, node: Tensor, with_reader: bool
                    ) -> tuple[str, list[Tensor], Shape, dict[str, Any]]:
        sources = [x.inputs[0] if _heads_swap(x) else x for x in (self.q, self.k, self.v)]
        inner = (*(x is not y for x, y in zip(sources, (self.q, self.k, self.v))), with_reader)
        attrs = {"causal": self.causal, "scale": self.scale, "heads_inner": inner}
        *lead, h, length, dv = node.shape
        shape = (*lead, length, h, dv) if with_reader else node.shape
        return "flash_attention", sources, shape, attrs


def _heads_swap(t: Tensor) -> bool:
    """Whether t transposes its input's heads and rows, (..., a, b, width) -> (..., b, a, width)."""
    n = len(t.shape)
    return (t.op == "transpose" and n >= 3
            and tuple(t.attrs["axes"]) == (*range(n - 3), n - 2, n - 3, n - 1))


def composed_attention(out: Tensor, values: dict[int, np.ndarray],
                       caps: Capabilities | None = None) -> Composed | None:
    """`out` as the composition above, if it is one (and, given `caps`, one the cooperative
    kernel takes); `values`: the graph's constants."""
    if out.op != "reshape" or out.inputs[0].op != "matmul":
        return None
    product = out.inputs[0]
    probs5, v5 = product.inputs
    if product.attrs["transpose_a"] or product.attrs["transpose_b"]:
        return None
    if probs5.op != "reshape" or probs5.inputs[0].op != "softmax":
        return None
    softmax = probs5.inputs[0]
    scores4 = softmax.inputs[0]
    if scores4.op != "reshape":
        return None
    scores, causal = scores4.inputs[0], False
    interior = [product, probs5, softmax, scores4]
    if scores.op == "add":
        product_qk, mask = scores.inputs
        if (mask.op != "constant" or mask.id not in values
                or values[mask.id].shape != product_qk.shape[-2:]
                or not np.array_equal(values[mask.id], causal_mask(*product_qk.shape[-2:]))):
            return None
        interior.append(scores)
        scores, causal = product_qk, True
    if (scores.op != "matmul" or scores.attrs["transpose_a"]
            or not scores.attrs["transpose_b"]):
        return None
    interior.append(scores)
    q5, k5 = scores.inputs
    if q5.op != "reshape" or q5.inputs[0].op != "mul" or k5.op != "reshape" or v5.op != "reshape":
        return None
    q, factor = q5.inputs[0].inputs
    if factor.op != "constant" or factor.id not in values or values[factor.id].shape != ():
        return None
    k, v = k5.inputs[0], v5.inputs[0]
    if len(q.shape) < 3 or not all(len(x.shape) == len(q.shape) for x in (k, v, out)):
        return None
    *lead, h, length, dim = q.shape
    hkv, s, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    if (h % hkv or tuple(k.shape) != (*lead, hkv, s, dim)
            or tuple(v.shape) != (*lead, hkv, s, dv)
            or tuple(q5.shape) != (*lead, hkv, h // hkv, length, dim)
            or tuple(k5.shape) != (*lead, hkv, 1, s, dim)
            or tuple(v5.shape) != (*lead, hkv, 1, s, dv)
            or tuple(scores4.shape) != (*lead, h, length, s)
            or tuple(out.shape) != (*lead, h, length, dv)):
        return None
    if caps is not None and not kernels.cooperative(dim, dv, s, caps):
        return None
    return Composed(q, k, v, causal, float(values[factor.id]), tuple(interior))


register(OpDef("flash_attention", _flash, "kernel", grad=_flash_grad,
               lower=kernels.lowering("forward"), composes=composed_attention))
register(OpDef("flash_attention_lse", lambda inputs, attrs: (inputs[0].shape[:-1], "f32"),
               "kernel", lower=kernels.lowering("lse")))
