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
    nodes = rooted.graph.reachable(rooted.roots)
    wants = {node.id: wanted for node in nodes
             if (rule := OPS[node.op].layouts) is not None
             and (wanted := rule(node, caps)) is not None}
    wants = _where_copies_are_free(nodes, {t.id for t in rooted.roots}, wants)
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


def _where_copies_are_free(nodes: list[Tensor], roots: set[int], wants: dict) -> dict:
    """The wants whose every copy costs the step nothing: a copy of parameters and constants
    alone (the prologue makes it once), or one its input's kernel can write in place of the
    input (OpDef.stores; `store_layouts`), which needs every reader of that input to want the
    same copy and the input not to be a root. A copy made by a dispatch of its own reads and
    writes the whole tensor for a layout that saves less than that on the convolutions
    measured (tools/rule_ab.py chlast-all against library, tools/KERNELS.md v18: ResNet-50's
    copies of block outputs that a residual add reads too; the U-Net's of group norms'
    outputs)."""
    static: set[int] = set()
    for node in nodes:
        if node.op in ("param", "constant") or (node.inputs and
                                                all(x.id in static for x in node.inputs)):
            static.add(node.id)
    readers = _readers(nodes)

    def layout_of(node: Tensor, x: Tensor) -> str | None:
        layouts = wants[node.id][0] if node.id in wants else ()
        found = {layouts[k][0] if k < len(layouts) and layouts[k] else None
                 for k, y in enumerate(node.inputs) if y.id == x.id}
        return found.pop() if len(found) == 1 else None

    def free(x: Tensor, layout: str) -> bool:
        stores = OPS[x.op].stores
        return x.id in static or (
            stores is not None and x.id not in roots and stores(x, layout)
            and all(layout_of(reader, x) == layout for reader in readers[x.id]))

    by_id = {node.id: node for node in nodes}
    wants = dict(wants)
    changed = True
    while changed:  # dropping one node's wants can leave another's copy with a reader to spare
        changed = False
        for node_id, (layouts, _) in list(wants.items()):
            if not all(layout is None or free(x, layout[0])
                       for x, layout in zip(by_id[node_id].inputs, layouts)):
                del wants[node_id]
                changed = True
    return wants


def store_layouts(rooted: Rooted) -> Rooted:
    """The graph with each layout copy that is its input's only reader made by that input's
    kernel instead, where it can (OpDef.stores): the producer gets attribute "store" naming the
    layout op and the copy's dtype, and keeps its shape (the copy's bytes fit in its slot)."""
    graph = rooted.graph
    nodes = graph.reachable(rooted.roots)
    readers = _readers(nodes)
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


def _readers(nodes: list[Tensor]) -> dict[int, list[Tensor]]:
    """Each node's id -> the nodes among `nodes` that read it."""
    readers: dict[int, list[Tensor]] = defaultdict(list)
    for node in nodes:
        for x in node.inputs:
            readers[x.id].append(node)
    return readers
