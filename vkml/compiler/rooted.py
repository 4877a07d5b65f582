"""The data between the graph stages: a graph with what it is compiled for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from vkml.graph import Graph, Tensor


@dataclass(frozen=True)
class Rooted:
    """A graph with its roots by name: the outputs (the loss among them, as "loss") and the
    trained parameters' gradients (by parameter name). Every graph pass takes one and returns
    one, so the names follow their values through each rewrite."""

    graph: Graph
    outputs: Mapping[str, Tensor]
    grads: Mapping[str, Tensor]

    @property
    def roots(self) -> list[Tensor]:
        return [*self.outputs.values(), *self.grads.values()]

    def renamed(self, graph: Graph, new_of: Mapping[int, Tensor]) -> Rooted:
        """The same roots in `graph`, where node `id` became `new_of[id]`."""
        return Rooted(graph, {n: new_of[t.id] for n, t in self.outputs.items()},
                      {n: new_of[t.id] for n, t in self.grads.items()})

    def dump(self) -> str:
        return self.graph.dump(self.roots)
