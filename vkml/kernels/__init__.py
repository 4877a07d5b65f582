"""Codegen: each dispatch of the plan becomes WGSL text specialised to its shapes and the device.

Kernels come from a few archetypes (pointwise, reduce, softmax, matmul, optimizer update), each a
small Python generator. Shapes are baked in as constants, so every kernel is straight-line code
the driver can optimise and naga never has to unroll anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from vkml.graph import Tensor
from vkml.hal import Capabilities
from vkml.ops import OPS


@dataclass(frozen=True)
class Kernel:
    name: str
    wgsl: str
    writable: tuple[bool, ...]  # per binding, in binding order
    groups: tuple[int, int, int]

    @property
    def num_bindings(self) -> int:
        return len(self.writable)


def lower(node: Tensor, caps: Capabilities) -> Kernel:
    """The kernel computing `node` from its inputs (bindings: inputs in order, then output)."""
    from vkml.kernels import attention, conv, gather, matmul, pointwise, reduce

    generators = {"pointwise": pointwise.generate, "reduce": reduce.generate_sum,
                  "softmax": reduce.generate_softmax, "matmul": matmul.generate,
                  "gather": gather.generate, "conv": conv.generate,
                  "attention": attention.generate}
    archetype = OPS[node.op].archetype
    if archetype in generators:
        return generators[archetype](node, caps)
    raise ValueError(f"{node.label}: archetype '{archetype}' produces no kernel")
