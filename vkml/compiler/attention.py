"""Composed attention into one kernel where the device runs that faster: Graph -> Graph, the
first rewrite (before the greedy fusion, which would fold the scaling of q and the causal mask
into other kernels).

`scaled_dot_product_attention(..., fused=False)` (ops/composite.py) builds

    reshape(matmul(reshape(softmax(reshape(S))), v5)),  S = matmul(q5, k5^T) [+ causal mask]
    q5 = reshape(mul(q, scale)), k5 = reshape(k), v5 = reshape(v)

which this replaces by `flash_attention(q, k, v)` where kernels/attention.py `cooperative`
says its cooperative-matrix kernel takes the shapes (precision "f16", short sequences of keys):
on an H200 that ran SmolLM2's and SmolVLA's accelerated inference 4-7% faster
(tools/KERNELS.md v14). It is replaced only where nothing else reads the scores or the
probabilities: a training step's backward pass reads the probabilities, so training keeps the
composition, whose backward runs on the GEMM core."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vkml.compiler.rebuild import Emit, rebuild
from vkml.graph import Graph, Tensor
from vkml.hal import Capabilities
from vkml.kernels.attention import cooperative
from vkml.ops.composite import causal_mask


@dataclass(frozen=True)
class Composed:
    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool
    scale: float
    interior: tuple[Tensor, ...]  # what the composition alone may read (its result aside)


def fuse_attention(graph: Graph, roots: list[Tensor], caps: Capabilities
                   ) -> tuple[Graph, dict[int, Tensor]]:
    """The graph with each composed attention the cooperative kernel takes replaced by
    `flash_attention`, and a map from the id of each node of `graph` kept to its new node.
    Where q, k or v is the heads' transpose of a (..., rows, heads, width) projection, the
    kernel reads the projection; where the attention's only reader is the heads' transpose
    back (their merge), the kernel writes that, so those transposes are not made at all."""
    order = graph.reachable(roots)
    readers: dict[int, list[Tensor]] = {}
    for t in order:
        for i in {x.id: x for x in t.inputs}.values():
            readers.setdefault(i.id, []).append(t)
    pinned = {t.id for t in roots}
    found: dict[int, Composed] = {}
    merged: dict[int, Tensor] = {}  # the heads' transpose after an attention -> the attention
    for node in order:
        match = composed_attention(node, graph.initial_values)
        if (match is not None
                and all(len(readers[t.id]) == 1 and t.id not in pinned for t in match.interior)
                and cooperative(match.q.shape[-1], match.v.shape[-1], match.k.shape[-2], caps)):
            found[node.id] = match
            after = readers.get(node.id, [])
            if len(after) == 1 and node.id not in pinned and _heads_swap(after[0]):
                merged[after[0].id] = node
    merging = {t.id for t in merged.values()}
    new_of: dict[int, Tensor] = {}

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        match = found.get(node.id)
        if node.id in merged:  # made with the attention it reads
            new_of[node.id] = new_of[merged[node.id].id]
        elif match is None:
            new_of[node.id] = emit(node.op, inputs, node.shape, node.attrs, node)
        else:
            new_of[node.id] = _fused(node, match, new_of, emit, node.id in merging)
        return new_of[node.id]

    if not found:
        return graph, {t.id: t for t in order}
    return rebuild(graph, roots, make)  # the interior nodes stay behind, unreachable


def _heads_swap(t: Tensor) -> bool:
    """Whether t transposes its input's heads and rows, (..., a, b, width) -> (..., b, a, width)."""
    n = len(t.shape)
    return (t.op == "transpose" and n >= 3
            and tuple(t.attrs["axes"]) == (*range(n - 3), n - 2, n - 3, n - 1))


def _fused(node: Tensor, match: Composed, new_of: dict[int, Tensor], emit: Emit,
           writes_merged: bool) -> Tensor:
    """The fused attention in `node`'s place, reading past the heads' transposes of q, k, v and
    writing the merged heads' layout where `writes_merged`."""
    sources = [x.inputs[0] if _heads_swap(x) else x for x in (match.q, match.k, match.v)]
    q, k, v = (new_of[x.id] for x in sources)
    inner = (*(x is not y for x, y in zip(sources, (match.q, match.k, match.v))), writes_merged)
    attrs = {"causal": match.causal, "scale": match.scale, "heads_inner": inner}
    *lead, h, length, dv = node.shape
    shape = (*lead, length, h, dv) if writes_merged else node.shape
    return emit("flash_attention", [q, k, v], shape, attrs, node)


def composed_attention(out: Tensor, values: dict[int, np.ndarray]) -> Composed | None:
    """`out` as the composition above, if it is one; `values`: the graph's constants."""
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
    return Composed(q, k, v, causal, float(values[factor.id]), tuple(interior))
