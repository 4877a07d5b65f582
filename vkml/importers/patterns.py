"""Patterns: where an exporter spells a composite op as primitives, the composite is built instead,
so an imported model gets the plan (fusions, kernels) a hand-built one gets.

A pattern is matched at its root: over the program's nodes (torch.export's, ONNX's) when it
needs what only they say, else over the vkml nodes already built for the root's inputs, when the
root's op is built (then one rule serves both front ends). The root's value becomes the
composite op of the pattern's leaves; the nodes inside the pattern may still be built, but
nothing reads them, so compiling drops them (a graph is compiled from its outputs).

Recognised in torch.export programs (the ops torch.export keeps whole need none, e.g.
aten.layer_norm, aten.gelu, aten.scaled_dot_product_attention, aten.silu): RMSNorm as Hugging
Face writes it, weight * (x * rsqrt(mean(x ** 2, -1, keepdim) + eps)) -> g.rms_norm.

Recognised over vkml's own nodes as they are built (so in both front ends):
- RoPE's rotate_half: cat([-x[..., h:], x[..., :h]], -1) -> g.rotate_half(x) (one kernel);
- attention spelled as products: softmax(q k^T * scale [+ mask]) @ v, the scale on q, k or
  the scores, k^T a transpose (or a transposing product), NaN guards around the softmax ->
  g.scaled_dot_product_attention, which never copies k transposed;
- 1 / sqrt(x) -> g.rsqrt(x);
- a constant attention mask that is the causal one -> causal attention (its add fuses into the
  score product); key/value heads repeated for grouped-query attention (Hugging Face's
  repeat_kv: an unsqueeze, expand and reshape) -> the heads before repeating, which
  g.scaled_dot_product_attention groups itself.
In ONNX files: GELU's erf form, x * 0.5 * (1 + erf(x / sqrt(2))) in any operand order ->
g.gelu(x) (opsets before 20 have no Gelu op).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vkml.errors import GraphError

# ---- torch.export (FX) nodes --------------------------------------------------------------------
# Ops that pass a value through unchanged in a float32 program (HF's .to(torch.float32)).
PASS_THROUGH = {"_to_copy", "clone", "alias", "contiguous", "to"}


def _fx_key(node: Any) -> str | None:
    if getattr(node, "op", None) != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__.removesuffix("_") if packet is not None else None


def _through(node: Any) -> Any:
    while _fx_key(node) in PASS_THROUGH:
        node = node.args[0]
    return node


def _is(node: Any, key: str) -> bool:
    return _fx_key(node) == key


def rms_norm_fx(root: Any) -> tuple[Any, Any, float] | None:
    """(x, weight, eps) where `root` is weight * (x * rsqrt(mean(x^2, -1, keepdim) + eps))."""
    if not _is(root, "mul") or len(root.args) != 2:
        return None
    for weight, h in (root.args, root.args[::-1]):
        h = _through(h)
        if getattr(weight, "op", None) != "placeholder" or not _is(h, "mul"):
            continue
        for x, r in (h.args, h.args[::-1]):
            if not _is(r, "rsqrt") or not _is(r.args[0], "add"):
                continue
            var, eps = r.args[0].args
            if not isinstance(eps, float) or not _is(var, "mean"):
                continue
            sq, dims = var.args[0], var.args[1]
            keep = var.args[2] if len(var.args) > 2 else var.kwargs.get("keepdim", False)
            if (_is(sq, "pow") and sq.args[1] == 2 and _through(sq.args[0]) is _through(x)
                    and list(dims) in ([-1], [len(x.meta["val"].shape) - 1]) and keep):
                return _through(x), weight, eps
    return None


def match_fx(nodes: Any) -> dict[str, Callable[[Any], Any]]:
    """Node name -> a function of the builder's value lookup building the composite."""
    found: dict[str, Callable[[Any], Any]] = {}
    for node in nodes:
        rms = rms_norm_fx(node)
        if rms is not None:
            x, weight, eps = rms
            found[node.name] = lambda get, x=x, w=weight, eps=eps: get.g.rms_norm(
                get.device(get.env[x.name]), get.device(get.env[w.name]), eps)
    return found


# ---- vkml nodes ---------------------------------------------------------------------------------
def _views(t: Any) -> Any:
    """`t` before any reshapes (views: the same elements)."""
    while t.op == "reshape":
        t = t.inputs[0]
    return t


def scalar(t: Any) -> float | None:
    """The value of a one-element constant node, else None."""
    if t.op == "constant" and t.size == 1:
        return float(t.graph.initial_values[t.id].reshape(()))
    return None


def rotate_half_of(xs: Any, axis: int) -> Any | None:
    """x where `xs` concatenated along the last axis is rotate_half(x): [-x2, x1]."""
    if len(xs) != 2 or axis % len(xs[0].shape) != len(xs[0].shape) - 1:
        return None
    neg, first = xs
    if neg.op != "neg" or neg.inputs[0].op != "slice" or first.op != "slice":
        return None
    second = neg.inputs[0]
    x = first.inputs[0]
    n, last = x.shape[-1], len(x.shape) - 1
    if second.inputs[0] is not x or n % 2:
        return None
    spans = [(s.attrs["axis"] % len(x.shape), s.attrs["start"], s.attrs["stop"])
             for s in (first, second)]
    return x if spans == [(last, 0, n // 2), (last, n // 2, n)] else None


def rsqrt_of(t: Any) -> Any | None:
    """x where `t` is sqrt(x), whose reciprocal is then rsqrt(x)."""
    return t.inputs[0] if t.op == "sqrt" else None


def _scaled(t: Any) -> tuple[Any, float]:
    """(x, s) where `t` is x times the constant s (or divided by 1/s); (t, 1) otherwise."""
    if t.op in ("mul", "div"):
        for k in (1, 0) if t.op == "mul" else (1,):
            c = scalar(t.inputs[k])
            if c is not None and c != 0:
                return t.inputs[1 - k], c if t.op == "mul" else 1.0 / c
    return t, 1.0


def _untransposed(b: Any) -> Any | None:
    """k where `b` is k with its last two axes swapped: a transpose, possibly of a reshape to
    three axes and back (as exporters spell a batched transpose)."""
    t = _views(b)
    axes = t.attrs.get("axes") if t.op == "transpose" else None
    rank = len(t.shape)
    if axes is None or list(axes) != [*range(rank - 2), rank - 1, rank - 2]:
        return None
    inner = t.inputs[0]
    shape = (*b.shape[:-2], b.shape[-1], b.shape[-2])
    return inner if inner.shape == shape else inner.graph.reshape(inner, shape)


def attention_of(g: Any, p: Any, v: Any) -> Any | None:
    """g.scaled_dot_product_attention(q, k, v, mask, scale) where p @ v is attention written
    out: p = softmax(q' k'^T * s + mask) (q' = q * s1, k'^T = k^T * s2, a NaN guard allowed);
    None when it is not."""
    if p.op == "where" and p.inputs[0].op == "isnan" and p.inputs[0].inputs[0] is p.inputs[2]:
        p = p.inputs[2]
    if p.op != "softmax" or len(v.shape) < 3 or len(p.shape) != len(v.shape):
        return None
    scores, mask = p.inputs[0], None
    if scores.op == "add":
        for k in (0, 1):
            if _scaled(scores.inputs[k])[0].op == "matmul":
                scores, mask = scores.inputs[k], scores.inputs[1 - k]
                break
    product, scale = _scaled(scores)
    if product.op != "matmul" or product.attrs["transpose_a"]:
        return None
    q, s1 = _scaled(product.inputs[0])
    right, s2 = _scaled(product.inputs[1])
    k = right if product.attrs["transpose_b"] else _untransposed(right)
    if k is None or len(q.shape) != len(v.shape) or k.shape[-2] != v.shape[-2]:
        return None
    k, v = unrepeated_heads(k, q.shape[-3]), unrepeated_heads(v, q.shape[-3])
    causal = False
    # an ONNX exporter's mask is an initializer, so a parameter: if it is the causal mask,
    # nothing reads it any more, so training leaves it as imported
    if mask is not None and mask.op in ("constant", "param") and is_causal_mask(
            g.initial_values[mask.id], q.shape[-2], k.shape[-2]):
        mask, causal = None, True
    try:
        return g.scaled_dot_product_attention(q, k, v, mask, causal, scale * s1 * s2)
    except GraphError:  # shapes the composite does not take: the products stay
        return None


def is_causal_mask(mask: Any, queries: int, keys: int) -> bool:
    """Whether an additive mask known at import (broadcast to (..., queries, keys)) is the
    causal one: 0 on and below the diagonal, a large negative number above it."""
    import numpy as np
    if mask.ndim < 2 or mask.shape[-2:] != (queries, keys) or queries != keys:
        return False
    above = np.triu(np.ones((queries, keys), bool), 1)
    flat = mask.reshape(-1, queries, keys)
    return bool(np.all(flat[:, ~above] == 0) and np.all(flat[:, above] <= -1e30 / 2))


def unrepeated_heads(x: Any, heads: int) -> Any:
    """k or v before repeat_kv: x = reshape(broadcast_to(reshape(k0, (b, h, 1, s, d)),
    (b, h, r, s, d)), (b, h * r, s, d)) -> k0 (b, h, s, d); x itself otherwise."""
    wide = _views(x)
    if x.op != "reshape" or wide.op != "broadcast_to" or len(wide.shape) != len(x.shape) + 1:
        return x
    *lead, h, r, s, d = wide.shape
    base = _views(wide.inputs[0])
    if (x.shape != (*lead, h * r, s, d) or h * r != heads
            or wide.inputs[0].shape != (*lead, h, 1, s, d)):
        return x
    if base.shape == (*lead, h, s, d):
        return base
    return base.graph.reshape(wide.inputs[0], (*lead, h, s, d))


# ---- ONNX nodes ----------------------------------------------------------------------------------
def onnx_composite(builder: Any, node: Any, producer: dict[str, Any]
                   ) -> Callable[[], Any] | None:
    """A function building the composite whose value `node` computes, or None. Matched when
    the walk reaches `node`, so the constants it reads are known."""
    x = gelu_onnx(builder, node, producer)
    if x is not None and x in builder.env:  # not when x could not be built
        return lambda: builder.g.gelu(builder.device(builder.env[x]))
    return None


def _scalar(builder: Any, name: str) -> float | None:
    import numpy as np
    value = builder.env.get(name)
    if isinstance(value, np.ndarray) and value.size == 1:
        return float(value.reshape(()))
    return None


def gelu_onnx(builder: Any, root: Any, producer: dict[str, Any]) -> str | None:
    """x where `root` computes x * 0.5 * (1 + erf(x / sqrt(2))): the TorchScript exporter's
    ((x * (erf(x / c) + 1)) * 0.5) or x * 0.5 first, any operand order."""
    if root.op_type != "Mul":
        return None

    def other(node: Any, name: str) -> str | None:
        a, b = node.input
        return b if a == name else a if b == name else None

    def half_of(node: Any) -> str | None:  # the operand multiplied by 0.5
        for k in (0, 1):
            if _scalar(builder, node.input[k]) == 0.5:
                return node.input[1 - k]
        return None

    def erf_term(name: str) -> str | None:  # x where name = 1 + erf(x / sqrt 2)
        add = producer.get(name)
        if add is None or add.op_type != "Add":
            return None
        for k in (0, 1):
            erf = producer.get(add.input[k])
            if _scalar(builder, add.input[1 - k]) == 1.0 and erf is not None and \
                    erf.op_type == "Erf":
                div = producer.get(erf.input[0])
                if div is None:
                    return None
                if div.op_type == "Div" and abs((_scalar(builder, div.input[1]) or 0)
                                                - math.sqrt(2)) < 1e-6:
                    return div.input[0]
                if div.op_type == "Mul" and abs((_scalar(builder, div.input[1]) or 0)
                                                - 1 / math.sqrt(2)) < 1e-6:
                    return div.input[0]
        return None

    # (x * (1 + erf)) * 0.5
    half = half_of(root)
    if half is not None:
        inner = producer.get(half)
        if inner is not None and inner.op_type == "Mul":
            for k in (0, 1):
                x = erf_term(inner.input[k])
                if x is not None and inner.input[1 - k] == x:
                    return x
    # (x * 0.5) * (1 + erf)
    for k in (0, 1):
        x = erf_term(root.input[k])
        scaled = producer.get(root.input[1 - k])
        if x is not None and scaled is not None and scaled.op_type == "Mul" \
                and other(scaled, x) is not None and _scalar(builder, other(scaled, x)) == 0.5:
            return x
    return None
