"""Fused (flash-style) attention: causal or full, cross, grouped-query; no additive mask. One
kernel with an online softmax (vkml/kernels/attention.py), and a backward of products that
recomputes the scores and takes P from the row log-sum-exp.
`scaled_dot_product_attention(..., fused=True)` builds it (ops/composite.py); the default there
is the composition of matmuls and a softmax."""

from __future__ import annotations

from vkml.errors import GraphError
from vkml.graph import OpDef, register
from vkml.kernels import attention as kernels
from vkml.ops.composite import attention_scores, grouped_heads


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


register(OpDef("flash_attention", _flash, "kernel", grad=_flash_grad,
               lower=kernels.lowering("forward")))
register(OpDef("flash_attention_lse", lambda inputs, attrs: (inputs[0].shape[:-1], "f32"),
               "kernel", lower=kernels.lowering("lse")))
