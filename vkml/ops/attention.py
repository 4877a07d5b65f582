"""Attention building blocks as compositions: scaled-dot-product attention (batched matmul,
scale, additive mask, softmax, batched matmul; grouped-query heads through the matmul's
broadcasting of leading dimensions, so K and V are never repeated in memory), rotary position
embedding (LLaMA / Hugging Face `rotate_half` convention) and SwiGLU. Autodiff differentiates
them through their parts. `flash_attention` is the fused alternative (causal or full, cross,
grouped-query; no additive mask): one kernel with an online softmax, and a backward that
recomputes the scores from a saved-by-recomputation log-sum-exp (`vkml/kernels/attention.py`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from vkml.errors import GraphError
from vkml.ops import OpDef, register

if TYPE_CHECKING:
    from vkml.graph import Graph, Tensor

MASKED = -1e30  # exp(MASKED - max) is exactly 0 in f32, with no infinities in the arithmetic


def scaled_dot_product_attention(g: Graph, q: Tensor, k: Tensor, v: Tensor, mask=None,
                                 causal: bool = False, scale: float | None = None,
                                 fused: bool = False) -> Tensor:
    """q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) -> (..., H, L, Dv); H a multiple
    of Hkv (query head h uses key/value head h // (H / Hkv), as torch's enable_gqa). `mask`: an
    additive f32 tensor broadcastable to (..., H, L, S); `causal`: query i sees keys j <= i.
    `fused`: one flash-style kernel (`flash_attention`) instead of the composition."""
    if len(q.shape) < 3 or len(k.shape) != len(q.shape) or len(v.shape) != len(q.shape):
        raise GraphError(f"attention takes q, k, v of one rank >= 3 (..., heads, seq, dim), got "
                         f"{q.type}, {k.type}, {v.type}")
    *lead, h, length, dim = q.shape
    hkv, s = k.shape[-3], k.shape[-2]
    if h % hkv or v.shape[-3] != hkv or v.shape[-2] != s or k.shape[-1] != dim:
        raise GraphError(f"attention: q {q.type}, k {k.type}, v {v.type} do not agree")
    rep = h // hkv
    dv = v.shape[-1]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if fused:
        if mask is not None:
            raise GraphError("fused attention takes no additive mask (causal or full only)")
        return g.apply("flash_attention", [q, k, v], causal=bool(causal), scale=scale)
    q5 = g.reshape(q, (*lead, hkv, rep, length, dim))
    k5 = g.reshape(k, (*k.shape[:-3], hkv, 1, s, dim))
    v5 = g.reshape(v, (*v.shape[:-3], hkv, 1, s, dv))
    scores = g.reshape(g.matmul(q5, k5, transpose_b=True), (*lead, h, length, s))
    scores = g.mul(scores, scale)
    if causal:
        tri = np.triu(np.full((length, s), MASKED, np.float32), k=1)
        scores = g.add(scores, g.constant(tri))
    if mask is not None:
        scores = g.add(scores, mask)
    probs = g.reshape(g.softmax(scores), (*lead, hkv, rep, length, s))
    return g.reshape(g.matmul(probs, v5), (*lead, h, length, dv))


def rope_tables(length: int, dim: int, theta: float, offset: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    freqs = np.outer(np.arange(offset, offset + length, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rope(g: Graph, x: Tensor, theta: float = 10000.0, offset: int = 0) -> Tensor:
    """x (..., S, D), D even: x * cos + rotate_half(x) * sin, positions offset..offset+S-1."""
    *_, length, dim = x.shape
    if dim % 2:
        raise GraphError(f"rope: the last axis of {x.label} must be even")
    cos, sin = rope_tables(length, dim, theta, offset)
    half = dim // 2
    rotated = g.concat([g.neg(g.slice(x, -1, half, dim)), g.slice(x, -1, 0, half)], -1)
    return g.add(g.mul(x, g.constant(cos)), g.mul(rotated, g.constant(sin)))


def swiglu(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    """silu(a) * b (the gate and the up projection of a LLaMA FFN)."""
    return g.mul(g.silu(a), b)


# ---- fused (flash-style) attention: online softmax, the score matrix never stored ---------------
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


register(OpDef("flash_attention", _flash, "attention", grad=_flash_grad))
register(OpDef("flash_attention_lse", lambda inputs, attrs: (inputs[0].shape[:-1], "f32"),
               "attention"))
register(OpDef("flash_attention_dq", lambda inputs, attrs: (inputs[0].shape, "f32"), "attention"))
register(OpDef("flash_attention_dk", lambda inputs, attrs: (inputs[1].shape, "f32"), "attention"))
register(OpDef("flash_attention_dv", lambda inputs, attrs: (inputs[1].shape[:-1] +
                                                            inputs[2].shape[-1:], "f32"),
               "attention"))
