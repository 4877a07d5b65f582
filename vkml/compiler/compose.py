"""Compositions into one kernel where the device runs that faster: Graph -> Graph, the first
rewrite (before the greedy fusion, which would fold parts of a composition into other kernels).

An op whose OpDef has a `composes` rule computes some composition of other ops in one kernel
(flash_attention: the composed attention of `scaled_dot_product_attention`, on cooperative
matrices). At each node the rule recognizes the composition that ends there, if the target runs
the op faster; this pass puts the op in its place where nothing else reads the composition's
interior, and folds in the composition's only reader where the rule says the kernel computes it
too (a layout change it writes directly)."""

from __future__ import annotations

from vkml.compiler.rebuild import Emit, rebuild
from vkml.compiler.rooted import Rooted
from vkml.graph import OPS, Composition, Tensor
from vkml.hal import Capabilities


def fuse_compositions(rooted: Rooted, caps: Capabilities) -> Rooted:
    """The graph with each composition an op's `composes` rule finds replaced by that op."""
    rules = [op.composes for op in OPS.values() if op.composes is not None]
    graph, roots = rooted.graph, rooted.roots
    order = graph.reachable(roots)
    readers: dict[int, list[Tensor]] = {}
    for t in order:
        for i in {x.id: x for x in t.inputs}.values():
            readers.setdefault(i.id, []).append(t)
    pinned = {t.id for t in roots}
    found: dict[int, Composition] = {}
    with_reader: dict[int, Tensor] = {}  # a reader computed by the composition -> its node
    for node in order:
        for rule in rules:
            match = rule(node, graph.initial_values, caps)
            if match is None or not all(len(readers[t.id]) == 1 and t.id not in pinned
                                        for t in match.interior):
                continue
            found[node.id] = match
            after = readers.get(node.id, [])
            if len(after) == 1 and node.id not in pinned and match.takes_reader(after[0]):
                with_reader[after[0].id] = node
            break
    writing_reader = {t.id for t in with_reader.values()}
    new_of: dict[int, Tensor] = {}

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        match = found.get(node.id)
        if node.id in with_reader:  # made with the composition it reads
            new_of[node.id] = new_of[with_reader[node.id].id]
        elif match is None:
            new_of[node.id] = emit(node.op, inputs, node.shape, node.attrs, node)
        else:
            op, sources, shape, attrs = match.replacement(node, node.id in writing_reader)
            new_of[node.id] = emit(op, [new_of[x.id] for x in sources], shape, attrs, node)
        return new_of[node.id]

    if not found:
        return rooted
    return rebuild(rooted, make)  # the interior nodes stay behind, unreachable
