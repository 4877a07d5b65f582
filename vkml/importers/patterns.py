"""Patterns: where an exporter spells a composite op as primitives, the composite is built instead,
so an imported model gets the plan (fusions, kernels) a hand-built one gets.

A pattern is matched at its root node, over the program's nodes (not vkml's): the root's value
becomes the composite op of the pattern's leaves. The pattern's inner nodes are still converted,
but nothing reads their results, so compiling drops them (a graph is compiled from its outputs).

Recognised (in torch.export programs; the ops torch.export keeps whole need none, e.g.
aten.layer_norm, aten.gelu, aten.scaled_dot_product_attention, aten.silu):
- RMSNorm as Hugging Face writes it: weight * (x * rsqrt(mean(x ** 2, -1, keepdim) + eps))
  -> g.rms_norm(x, weight, eps);
- RoPE's rotate_half: cat([-x[..., h:], x[..., :h]], -1) -> g.rotate_half(x) (one kernel).
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


def rotate_half_fx(root: Any) -> Any | None:
    """x where `root` is cat([-x[..., h:], x[..., :h]], -1), h half the last axis."""
    if not _is(root, "cat") or len(root.args[0]) != 2:
        return None
    neg, first = root.args[0]
    rank = len(root.meta["val"].shape)
    dim = root.args[1] if len(root.args) > 1 else 0
    if dim % rank != rank - 1 or not _is(neg, "neg") or not _is(first, "slice"):
        return None
    second = neg.args[0]
    if not _is(second, "slice") or second.args[0] is not first.args[0]:
        return None
    x = first.args[0]
    n = x.meta["val"].shape[-1]
    half = n // 2

    def bounds(s: Any) -> tuple[int, int]:
        dim, start, end = (list(s.args[1:4]) + [None] * 3)[:3]
        return (dim % rank, 0 if start is None else start,
                n if end is None else min(end, n))
    if bounds(first) == (rank - 1, 0, half) and bounds(second) == (rank - 1, half, n):
        return x
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
            continue
        x = rotate_half_fx(node)
        if x is not None:
            found[node.name] = lambda get, x=x: get.g.rotate_half(get.device(get.env[x.name]))
    return found


# ---- vkml nodes ---------------------------------------------------------------------------------
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
    if x.op != "reshape" or x.inputs[0].op != "broadcast_to":
        return x
    wide = x.inputs[0]
    inner = wide.inputs[0]
    *lead, h, r, s, d = wide.shape
    if (len(x.shape) != len(wide.shape) - 1 or x.shape[-3] != h * r or x.shape[-3] != heads
            or inner.shape != (*lead, h, 1, s, d) or inner.op != "reshape"):
        return x
    base = inner.inputs[0]
    return base if base.shape == (*lead, h, s, d) else x


# ---- ONNX nodes ----------------------------------------------------------------------------------
def onnx_composite(builder: Any, node: Any, producer: dict[str, Any]
                   ) -> Callable[[], Any] | None:
    """A function building the composite whose value `node` computes, or None. Matched when
    the walk reaches `node`, so the constants it reads are known."""
    x = gelu_onnx(builder, node, producer)
    if x is not None:
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
