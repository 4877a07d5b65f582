"""Fused (flash-style) attention: causal or full, cross, grouped-query; no additive mask. One
kernel with an online softmax, and a backward that recomputes the scores from the row
log-sum-exp (vkml/kernels/attention.py). `scaled_dot_product_attention(..., fused=True)` builds it
(ops/composite.py); the default there is the composition of matmuls and a softmax."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkml.errors import GraphError
from vkml.graph import OpDef, register
from vkml.kernels import attention as kernels

if TYPE_CHECKING:
    pass

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
    # FlashAttention-2's backward: the row log-sum-exp (a second pass over the keys, instead of
    # a second output) and D = rowsum(dO * O) let each kernel recompute P one score at a time.
    q, k, v = node.inputs
    a = node.attrs
    lse = g.apply("flash_attention_lse", [q, k], **a)
    dsum = g.sum(g.mul(d, node), -1)
    return [g.apply("flash_attention_dq", [q, k, v, d, lse, dsum], **a),
            g.apply("flash_attention_dk", [q, k, v, d, lse, dsum], **a),
            g.apply("flash_attention_dv", [q, k, d, lse], **a)]


register(OpDef("flash_attention", _flash, "kernel", grad=_flash_grad,
               lower=kernels.lowering("forward")))
register(OpDef("flash_attention_lse", lambda inputs, attrs: (inputs[0].shape[:-1], "f32"),
               "kernel", lower=kernels.lowering("lse")))
register(OpDef("flash_attention_dq", lambda inputs, attrs: (inputs[0].shape, "f32"), "kernel",
               lower=kernels.lowering("dq")))
register(OpDef("flash_attention_dk", lambda inputs, attrs: (inputs[1].shape, "f32"), "kernel",
               lower=kernels.lowering("dk")))
register(OpDef("flash_attention_dv",
               lambda inputs, attrs: (inputs[1].shape[:-1] + inputs[2].shape[-1:], "f32"),
               "kernel", lower=kernels.lowering("dv")))
