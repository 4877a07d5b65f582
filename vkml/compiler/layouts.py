"""Operand layouts for inference (it runs after rewriting, before the split stage, on graphs
compiled without a loss): where a node's kernel reads an input faster in another layout on the
target (OpDef.layouts: a convolution's operands channels-last in f16 for f16 tiles), the input
is copied so by a layout op first and the node reads the copy. One copy serves every node that
wants the same tensor in the same layout. Training keeps the layouts as they are: the backward
pass reads the forward pass's tensors in theirs.

After the split stage, `store_layouts` drops the copies whose input's kernel can write that
layout itself (OpDef.stores: a convolution's store, the sum of a split one's partial sums) and
that are its only reader: the producer writes the copy's layout in their place.
"""

from __future__ import annotations

from collections import defaultdict

from vkml.compiler.codegen import value_key
from vkml.compiler.rebuild import Emit, rebuild
from vkml.compiler.rooted import Rooted
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities


def relayout_operands(rooted: Rooted, caps: Capabilities) -> Rooted:
    """The graph with each node's wanted operand layouts (OpDef.layouts) on `caps`."""
    copies: dict[tuple, Tensor] = {}  # (input's new id, layout op, its attributes) -> the copy

    def copy(x: Tensor, op: str, attrs: dict, emit: Emit) -> Tensor:
        key = (x.id, op, value_key(attrs))
        if key not in copies:
            shape, dtype = OPS[op].infer([x], attrs)
            copies[key] = emit(op, [x], shape, attrs, x, dtype)
        return copies[key]

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        rule = OPS[node.op].layouts
        wanted = rule(node, caps) if rule is not None else None
        if wanted is None:
            return emit(node.op, inputs, node.shape, node.attrs, node)
        layouts, attrs = wanted
        moved = [x if k >= len(layouts) or layouts[k] is None
                 else copy(x, *layouts[k], emit) for k, x in enumerate(inputs)]
        return emit(node.op, moved, node.shape, attrs, node)

    return rebuild(rooted, make)


def store_layouts(rooted: Rooted) -> Rooted:
    """The graph with each layout copy that is its input's only reader made by that input's
    kernel instead, where it can (OpDef.stores): the producer gets attribute "store" naming the
    layout op and the copy's dtype, and keeps its shape (the copy's bytes fit in its slot)."""
    graph = rooted.graph
    nodes = graph.reachable(rooted.roots)
    readers: dict[int, list[Tensor]] = defaultdict(list)
    for node in nodes:
        for x in node.inputs:
            readers[x.id].append(node)
    kept = {t.id for t in rooted.roots}
    stored: dict[int, Tensor] = {}  # copy's id -> the producer storing it

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        if node.id in stored:  # the copy: its producer wrote it
            return inputs[0]
        after = readers[node.id]
        copy = after[0] if len(after) == 1 else None
        rule = OPS[node.op].stores
        if (copy is not None and node.id not in kept and rule is not None
                and [x.id for x in copy.inputs] == [node.id] and rule(node, copy.op)):
            stored[copy.id] = node
            return emit(node.op, inputs, node.shape, {**node.attrs, "store": copy.op}, node,
                        copy.dtype)
        return emit(node.op, inputs, node.shape, node.attrs, node)

    return rebuild(rooted, make)
