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
    """The graph with each node's wanted operand layouts (OpDef.layouts) on `caps`; the graph
    itself where no node wants any."""
    wants = {node.id: wanted for node in rooted.graph.reachable(rooted.roots)
             if (rule := OPS[node.op].layouts) is not None
             and (wanted := rule(node, caps)) is not None}
    if not wants:
        return rooted
    copies: dict[tuple, Tensor] = {}  # (input's new id, layout op, its attributes) -> the copy

    def copy(x: Tensor, op: str, attrs: dict, emit: Emit) -> Tensor:
        key = (x.id, op, value_key(attrs))
        if key not in copies:
            shape, dtype = OPS[op].infer([x], attrs)
            copies[key] = emit(op, [x], shape, attrs, x, dtype)
        return copies[key]

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        if node.id not in wants:
            return emit(node.op, inputs, node.shape, node.attrs, node)
        layouts, attrs = wants[node.id]
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
    stored: dict[int, Tensor] = {}  # producer's id -> the copy it writes
    for node in nodes:
        after = readers[node.id]
        rule = OPS[node.op].stores
        if (len(after) == 1 and node.id not in kept and rule is not None
                and [x.id for x in after[0].inputs] == [node.id] and rule(node, after[0].op)):
            stored[node.id] = after[0]
    if not stored:
        return rooted
    copies = {copy.id for copy in stored.values()}

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        if node.id in copies:  # its producer wrote it
            return inputs[0]
        if node.id in stored:
            copy = stored[node.id]
            return emit(node.op, inputs, node.shape, {**node.attrs, "store": copy.op}, node,
                        copy.dtype)
        return emit(node.op, inputs, node.shape, node.attrs, node)

    return rebuild(rooted, make)
