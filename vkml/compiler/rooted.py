"""The data between the graph stages: a graph with what it is compiled for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vkml.graph import Graph, Tensor


@dataclass(frozen=True)
class Rooted:
    """A graph with its roots by name: the outputs (the loss among them, as "loss") and the
    trained parameters' gradients (by parameter name), and the index checks computed with the
    outputs (compiler/stages.py index_checks: each node with what its operands are). Every
    graph pass takes one and returns one, so the names follow their values through each
    rewrite."""

    graph: Graph
    outputs: Mapping[str, Tensor]
    grads: Mapping[str, Tensor]
    checks: tuple[tuple[Tensor, tuple[str, ...]], ...] = field(default=())

    @property
    def roots(self) -> list[Tensor]:
        return [*self.outputs.values(), *self.grads.values(), *(t for t, _ in self.checks)]

    def renamed(self, graph: Graph, new_of: Mapping[int, Tensor]) -> Rooted:
        """The same roots in `graph`, where node `id` became `new_of[id]`."""
        return Rooted(graph, {n: new_of[t.id] for n, t in self.outputs.items()},
                      {n: new_of[t.id] for n, t in self.grads.items()},
                      tuple((new_of[t.id], about) for t, about in self.checks))

    def dump(self) -> str:
        return self.graph.dump(self.roots)
